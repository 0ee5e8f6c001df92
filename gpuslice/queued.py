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

A start systemd shows at its gate, answered through its pipe, asks nothing: it waits for a
read only while a start the core does not know may not be shown at its gate with it
(`unplaced`, set by `unseen`): a JobNew dropped while a rescan read the unit files, whose
unit that scan may make annotated, or one of an annotated unit whose signals are not
matched yet (new to the scan, or an instance). In `systemctl daemon-reload && systemctl
start a b`, a less urgent a.service known for long, whose start-pre signal the rescan held
(Rescans.hold_gate) or came once it was applied, was granted at its pipe before b.service,
new and unmatched, was known, and preempted by it a moment later. Such a start
(`hold_gate`) is taken with the next read; the mark goes with a read sent while no rescan
runs and taken in with no such JobNew since. Starts of matched units alone set no mark: a
pipe's grant costs no read.

One read at a time, and one more after it for all the calls that came meanwhile (they may
name a start queued after the read was answered): a unit is held once however often it
asks, and a flood of calls costs no timer and no more than one read in flight. A read that
fails or is not answered (bounded by the bus call timeout, systemd.CALL_TIMEOUT) announces
nothing, and the calls are served as they were before: on the starts known.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from gpuslice.core.model import UnitSpec
from gpuslice.counters import Counters
from gpuslice.systemd import Systemd, SystemdError
from gpuslice.tracker import START_JOBS, Tracker, at_condition, bound_for_gate

log = logging.getLogger("gpuslice")


# The most Job.GetBefore reads one start's walk of the jobs it waits for costs
# (`starts_waited_for`): past it, the start is taken as waiting for one of ours.
WAITED_FOR_READS = 16


class JobsWaitedFor(Protocol):
    """Systemd's Job.GetBefore (Systemd.jobs_waited_for)."""

    async def jobs_waited_for(self, job_id: int) -> list[tuple[int, str, str]]: ...


async def starts_waited_for(systemd: JobsWaitedFor, job_id: int) -> set[str] | None:
    """The units whose start job systemd runs before this job, directly or through the
    jobs this one waits for (Job.GetBefore, one read a job, WAITED_FOR_READS at most);
    None when a read fails, its reply is not systemd's, or the bound is passed. A start
    announced to the core before its gate keeps the GPUs it takes (Phase.STARTING): held
    behind the start of a GPU unit (`Requires=b` + `After=b`), it kept them from that
    very unit, whose gate then waited for them while its start waited for b's: neither
    ran. Such a start is known at its gate, as any start."""
    found: set[str] = set()
    todo, seen = [job_id], {job_id}
    for _ in range(WAITED_FOR_READS):
        if not todo:
            return found
        try:
            jobs = await systemd.jobs_waited_for(todo.pop())
        except SystemdError as e:
            log.debug("cannot read the jobs job %d waits for: %s", job_id, e)
            return None
        for other, unit, kind in jobs:
            if kind in START_JOBS:
                found.add(unit)
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return None if todo else found


class QueuedStarts:
    """The units whose gate call waits for the next read (`waiting`, in the order they
    came), the starts at their gate that do (`at_gate`, with their InvocationID), whether a
    read is under way, and whether a start no signal shows may be unknown (`unplaced`).
    Given: systemd, the tracker (a read older than a word of systemd's about a unit is not
    taken in for it), the counters, the annotations (`spec_for`), whether the core knows a
    unit's start (`known`), whether a rescan runs (`rescanning`), the controller's `spawn`,
    and `take`: the starts read, as specs in systemd's order, the units whose calls waited
    and the starts held at their gate, decided on together."""

    def __init__(
        self,
        systemd: Systemd,
        tracker: Tracker,
        counters: Counters,
        spec_for: Callable[[str], UnitSpec | None],
        known: Callable[[str], bool],
        rescanning: Callable[[], bool],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        take: Callable[[list[UnitSpec], list[str], dict[str, str]], None],
    ) -> None:
        self.systemd = systemd
        self.tracker = tracker
        self.counters = counters
        self.spec_for = spec_for
        self.known = known
        self.rescanning = rescanning
        self.spawn = spawn
        self.take = take
        self.waiting: dict[str, None] = {}  # a unit once however often it asks
        self.at_gate: dict[str, str] = {}  # the InvocationID last shown, a unit once
        self.reading = False
        self.unplaced = False
        self._unseen = 0  # such JobNews: a read sent before the last one clears nothing

    def unseen(self) -> None:
        """A JobNew the core may not know the start of, whose signal at its gate may not
        come (dropped while a rescan ran, or of a unit not matched): its gate's call may
        come after a less urgent start at its pipe is granted. Those wait for a read."""
        self.unplaced = True
        self._unseen += 1

    def wait(self, unit: str) -> None:
        """The unit's gate call is served once a read sent from now on is taken in."""
        self.waiting[unit] = None
        self._read()

    def hold_gate(self, unit: str, invocation: str) -> None:
        """This start, shown at its gate, is judged once a read sent from now on is taken
        in (while `unplaced`)."""
        self.at_gate[unit] = invocation
        self._read()

    def _read(self) -> None:
        if not self.reading:
            self.reading = True
            self.spawn(self._read_until_done())

    async def _read_until_done(self) -> None:
        """Read, and take in, until no call came during a read. A bug in `take` stops no
        later round (its first error then reaches the task's report): stopped, the calls
        that came meanwhile were answered by nobody, and their gates waited for ever. A
        round sent while no rescan runs, with no `unseen` JobNew until it was taken in,
        announced every start such a JobNew named: `unplaced` goes (not with a read that
        failed)."""
        errors: list[Exception] = []
        try:
            while self.waiting or self.at_gate:
                units, self.waiting = list(self.waiting), {}
                gates, self.at_gate = self.at_gate, {}
                unseen = None if self.rescanning() else self._unseen
                starts = await self._unknown_starts()
                if starts is not None and unseen == self._unseen:
                    self.unplaced = False
                try:
                    self.take(starts or [], units, gates)
                except Exception as e:
                    errors.append(e)
        finally:
            self.reading = False
        if errors:
            raise errors[0]

    async def _unknown_starts(self) -> list[UnitSpec] | None:
        """The start jobs systemd holds of annotated units the core does not know, whose
        unit is bound for its gate (`bound_for_gate`: not a start of a unit that already
        runs, which ends at once), as a read of their states says, sent once the jobs were
        read; None when either read fails."""
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
            return None
        starts = []
        for unit in unknown:
            state = states.get(unit)
            if (
                state is None
                or not bound_for_gate(state)
                or at_condition(state)  # it may be skipped: known at its gate, if ever
                or not await self._free_of_gpu_starts(state.job_id)
            ):
                continue
            spec = self.spec_for(unit)
            # a word of systemd's about it since: the read may be older than what we know
            if spec is not None and self.tracker.heard(unit) == seen[unit]:
                starts.append(spec)
        return starts

    async def _free_of_gpu_starts(self, job_id: int) -> bool:
        """The start waits for no start of an annotated unit (`starts_waited_for`): one that
        does, announced, would keep the GPUs that unit's gate waits for."""
        waited = await starts_waited_for(self.systemd, job_id)
        if waited is None:
            self.counters.error("dbus_call_errors")
            return False
        return not any(self.spec_for(u) is not None for u in waited)
