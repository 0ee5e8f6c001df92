"""Gate calls held until systemd's queued starts are read: one transaction, one priority order.

A start counts for the core from its JobNew (Controller._announce_queued) or from the
signal that shows it at its gate. Neither comes for a unit the scan did not know yet (the
daemon-reload that made it known is still being read: its JobNew is dropped) or whose
signals are not matched yet (a unit, or an instance, new to the controller): its gate asks
over D-Bus, and the core, knowing no other start, granted the first gate to ask. The more
urgent units started in the same `systemctl start a b c` then preempted it, and its work
was lost. So a gate's call whose start the core has not answered (`Gates.unanswered`)
waits for a read of systemd's jobs sent after it came (`wait`): every start job of an
annotated unit the core does not know, still bound for its gate, is announced first, in
the order systemd made them, then the calls are served, all in one scheduling pass
(`take`). The start of the unit that asks is among those jobs: its transaction was queued
before its gate ran.

One read at a time, and one more after it for all the calls that came meanwhile (they may
name a start queued after the read was answered): a unit is held once however often it
asks, and a flood of calls costs no timer and no more than one read in flight. A read that
fails or is not answered (bounded by the bus call timeout, systemd.CALL_TIMEOUT) announces
nothing, and the calls are served as they were before: on the starts known.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from gpuslice.core.model import UnitSpec
from gpuslice.counters import Counters
from gpuslice.systemd import Systemd, SystemdError
from gpuslice.tracker import Tracker, bound_for_gate

log = logging.getLogger("gpuslice")


class QueuedStarts:
    """The units whose gate call waits for the next read (`waiting`, in the order they
    came), and whether a read is under way. Given: systemd, the tracker (a read older than
    a word of systemd's about a unit is not taken in for it), the counters, the annotations
    (`spec_for`), whether the core knows a unit's start (`known`), the controller's
    `spawn`, and `take`: the starts read, as specs in systemd's order, and the units whose
    calls waited, decided on together."""

    def __init__(
        self,
        systemd: Systemd,
        tracker: Tracker,
        counters: Counters,
        spec_for: Callable[[str], UnitSpec | None],
        known: Callable[[str], bool],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        take: Callable[[list[UnitSpec], list[str]], None],
    ) -> None:
        self.systemd = systemd
        self.tracker = tracker
        self.counters = counters
        self.spec_for = spec_for
        self.known = known
        self.spawn = spawn
        self.take = take
        self.waiting: dict[str, None] = {}  # a unit once however often it asks
        self.reading = False

    def wait(self, unit: str) -> None:
        """The unit's gate call is served once a read sent from now on is taken in."""
        self.waiting[unit] = None
        if not self.reading:
            self.reading = True
            self.spawn(self._read_until_done())

    async def _read_until_done(self) -> None:
        """Read, and take in, until no call came during a read. A bug in `take` stops no
        later round (its first error then reaches the task's report): stopped, the calls
        that came meanwhile were answered by nobody, and their gates waited for ever."""
        errors: list[Exception] = []
        try:
            while self.waiting:
                units, self.waiting = list(self.waiting), {}
                starts = await self._unknown_starts()
                try:
                    self.take(starts, units)
                except Exception as e:
                    errors.append(e)
        finally:
            self.reading = False
        if errors:
            raise errors[0]

    async def _unknown_starts(self) -> list[UnitSpec]:
        """The start jobs systemd holds of annotated units the core does not know, whose
        unit is bound for its gate (`bound_for_gate`: not a start of a unit that already
        runs, which ends at once), as a read of their states says, sent once the jobs were
        read; none when either read fails."""
        try:
            units = await self.systemd.start_jobs()
            unknown = [u for u in dict.fromkeys(units) if self.spec_for(u) and not self.known(u)]
            if not unknown:
                return []
            seen = {u: self.tracker.heard(u) for u in unknown}
            states = {s.name: s for s in await self.systemd.units_state(unknown)}
        except SystemdError as e:
            self.counters.error("dbus_call_errors")
            log.debug("cannot read systemd's start jobs: %s", e)
            return []
        starts = []
        for unit in unknown:
            state = states.get(unit)
            spec = self.spec_for(unit)
            # a word of systemd's about it since: the read may be older than what we know
            fresh = self.tracker.heard(unit) == seen[unit]
            if spec is not None and state is not None and fresh and bound_for_gate(state):
                starts.append(spec)
        return starts
