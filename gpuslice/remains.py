"""Units that systemd keeps active after their job ended (`RemainAfterExit=yes`).

Such a unit shows `active (exited)` until someone stops it; kept as a holder, its GPUs
stayed reserved that long and every unit waiting for them waited for ever. Its GPUs go
(Scheduler.exited) once systemd, the only source believed, counts no task left in its
cgroup: a process a `KillMode=none`/`process` leftover or a daemon it forked may still use
them, so while any is left the unit keeps them, said once; asked again at each audit
(systemd signals no leftover's end), it releases them once none is left, or at its stop.
Systemd's count (TasksCurrent) is asked first: GetUnitProcesses answers with every
process's command line, up to the bus's message limit for a unit that left hundreds of
thousands, decoded in pure Python on the loop (seconds every GPU job waited, every 30 s).
The list is asked only where the count is not known: tasks accounting off, or the cgroup
gone (systemd 252 removes a unit's cgroup as it turns `exited` with no process left, and
keeps it while one is: the list is then empty, and cheap).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from gpuslice.systemd import SystemdError

log = logging.getLogger("gpuslice")


class UnitProcesses(Protocol):
    async def tasks_current(self, name: str) -> int | None: ...
    async def unit_pids(self, name: str) -> list[int]: ...


class Remains:
    """Asks systemd, for each unit told `Exited`, whether a process is left in it."""

    def __init__(
        self,
        systemd: UnitProcesses,
        heard: Callable[[str], int],
        still_exited: Callable[[str], bool],
        release: Callable[[str], None],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        """`heard`: a stamp that moves with each word of systemd about the unit (the
        tracker's): an answer read after it moved may describe an older run. `still_exited`:
        the unit still shows `active (exited)` and is not released. `release`: tell the
        core (Scheduler.exited)."""
        self.systemd = systemd
        self.heard = heard
        self.still_exited = still_exited
        self.release = release
        self.spawn = spawn
        self._left: set[str] = set()  # told of processes left in it: said once per run
        self._unlisted: set[str] = set()  # told its processes cannot be listed: the same
        self._asking: dict[str, int] = {}  # a check under way: the stamp it was sent at

    def exited(self, unit: str) -> None:
        """Systemd shows the unit `active (exited)`: its processes are listed now. Each
        signal of it asks again (one is rare for a unit that stays so); the answer to a
        request sent before a later signal is dropped, that signal's own one decides. One
        under way since systemd's last word of the unit decides alone: asked again at each
        audit, a slow answer (thousands of processes listed) piled up calls behind it."""
        stamp = self.heard(unit)
        if self._asking.get(unit) == stamp:
            return
        self._asking[unit] = stamp
        self.spawn(self._check(unit, stamp))

    def went_down(self, unit: str) -> None:
        """Its run is over: a leftover of its next run is said again."""
        self._left.discard(unit)
        self._unlisted.discard(unit)

    async def _check(self, unit: str, stamp: int) -> None:
        try:
            left = await self._left_in(unit)
        finally:
            if self._asking.get(unit) == stamp:
                del self._asking[unit]  # answered (or failed): the next signal asks again
        if left is None:
            return
        if self.heard(unit) != stamp or not self.still_exited(unit):
            return  # a later signal's check decides (or it is down, or released)
        count, what = left
        if not count:
            self._left.discard(unit)
            self._unlisted.discard(unit)
            self.release(unit)
        elif unit not in self._left:
            self._left.add(unit)
            log.warning(
                "%s stays active after its job ended (RemainAfterExit=yes), and %d "
                "%s are left in it (KillMode=): it keeps its GPUs until none is left "
                "(asked again every 30 s) or it is stopped (systemctl stop)",
                unit,
                count,
                what,
            )

    async def _left_in(self, unit: str) -> tuple[int, str] | None:
        """How many tasks systemd counts in the unit (TasksCurrent), or, where it does not
        know or cannot say, how many processes it lists: the count and what it counts; None
        where neither can be had (said once)."""
        try:
            count = await self.systemd.tasks_current(unit)
        except SystemdError as e:
            log.debug("TasksCurrent of %s not read (%s): its processes are listed", unit, e)
            count = None
        if count is not None:
            return count, "task(s) (processes and threads)"
        try:
            return len(await self.systemd.unit_pids(unit)), "process(es)"
        except SystemdError as e:
            if unit not in self._unlisted:  # asked again at each audit: said once per run
                self._unlisted.add(unit)
                log.warning(
                    "%s stays active after its job ended (RemainAfterExit=yes), but its "
                    "processes cannot be listed (%s): it keeps its GPUs until they can be "
                    "(asked again every 30 s) or it is stopped",
                    unit,
                    e.text,
                )
            return None
