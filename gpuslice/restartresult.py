"""How a run ended that only a bare `auto-restart` told: systemd's `Result=` read first.

systemd signals a service its Restart= starts again `failed` or `inactive` first (252), or
`*-before-auto-restart` (254): the state says how the run ended. With `RestartMode=direct`
(254+) only `auto-restart` is signalled, which says nothing of it: the core is told FAILED,
and under `Restart=on-success` it takes that for a clean exit (the only end restarted). Under
`Restart=always` either end is restarted, and a worker that exits 0 when its queue is empty
read `failed` in the journal at every exit. So such a down (`unknown`) is told once the
unit's `Result=` is read (`hold`): `success` is a clean exit (EXITED), anything else a
failure. The read is taken only if systemd still shows the unit waiting to restart after
it: the restart's start sets `Result=` to `success` again. A read that fails (bounded by the
bus call timeout), or a word of systemd's about the unit before it is answered (`heard`:
its restart, a stop), has the down told at once as before, FAILED: a down held while later
signals were taken in would have released a restart already under way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from gpuslice.core.model import Restart, UnitSpec
from gpuslice.core.scheduler import Outcome, Phase
from gpuslice.counters import Counters
from gpuslice.systemd import Systemd, SystemdError
from gpuslice.tracker import UnitState, WentDown, restarting

log = logging.getLogger("gpuslice")


def unknown(change: WentDown, spec: UnitSpec | None, state: UnitState, phase: Phase | None) -> bool:
    """Whether the down of a unit that ran is told by a bare `auto-restart` under
    `Restart=always`, which does not say whether it failed or exited cleanly."""
    return (
        change.outcome is Outcome.FAILED
        and spec is not None
        and spec.restart is Restart.ALWAYS
        and restarting(state)
        and phase is Phase.RUNNING
    )


class RestartResults:
    """The downs held until their `Result=` is read (`pending`, by unit). Given: systemd,
    the counters, the controller's `spawn`, and `tell`: the down, with its outcome as read,
    taken in."""

    def __init__(
        self,
        systemd: Systemd,
        counters: Counters,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        tell: Callable[[WentDown], None],
    ) -> None:
        self.systemd = systemd
        self.counters = counters
        self.spawn = spawn
        self.tell = tell
        self.pending: dict[str, WentDown] = {}

    def hold(self, change: WentDown) -> None:
        """Tell the down once its `Result=` is read (one read per down: a unit is down once
        until it runs again, and each later word of systemd's about it tells it)."""
        self.pending[change.unit] = change
        self.spawn(self._read(change.unit))

    def heard(self, unit: str) -> None:
        """systemd said more of the unit: a down still held is told now, as it was signalled,
        before what systemd says next is taken in."""
        change = self.pending.pop(unit, None)
        if change is not None:
            self.tell(change)

    async def _read(self, unit: str) -> None:
        outcome = await self._outcome(unit)
        change = self.pending.pop(unit, None)
        if change is None:
            return  # told meanwhile (`heard`)
        self.tell(change if outcome is None else dataclasses.replace(change, outcome=outcome))

    async def _outcome(self, unit: str) -> Outcome | None:
        """EXITED for a `Result=` of `success`, FAILED for any other; None when it cannot be
        read, or its restart began before it was (then it says the new start's)."""
        try:
            result = (await self.systemd.main_exit(unit)).result
            state = await self.systemd.unit_state(unit)
        except SystemdError as e:
            self.counters.error("dbus_call_errors")
            log.debug("cannot read how %s ended: %s", unit, e)
            return None
        if not restarting(state):
            return None
        return Outcome.EXITED if result == "success" else Outcome.FAILED
