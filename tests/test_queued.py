"""gpuslice/queued.py on its own: gate calls held until systemd's queued starts are read.

A fake systemd answers ListJobs (`start_jobs`) and ListUnitsByNames (`units_state`) from what
the test sets, and can hold its answer (`gate`); the controller's side (`take`) is a list.
README ("The rules in short"): units started together are served in priority order, right
after the daemon-reload that made them known too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any, cast

import pytest

from gpuslice.core.model import UnitSpec
from gpuslice.counters import Counters
from gpuslice.queued import WAITED_FOR_READS, QueuedStarts
from gpuslice.systemd import NO_REPLY, Systemd, SystemdError
from gpuslice.tracker import Tracker, UnitState

A, B, C, D = "a.service", "b.service", "c.service", "d.service"


def at_gate(name: str, job: int) -> UnitState:
    return UnitState(name, "activating", "start-pre", job, "start")


class FakeSystemd:
    def __init__(self) -> None:
        self.jobs: list[str] = []  # units with a start job, in systemd's order
        self.states: dict[str, UnitState] = {}
        self.reads: list[str] = []  # what was asked, in order
        self.gate: asyncio.Event | None = None  # set: ListJobs answers
        self.error: SystemdError | None = None  # ListJobs fails with it
        # the jobs each job waits for (Job.GetBefore), by id (else none), or the read's error
        self.waited_for: dict[int, list[tuple[int, str, str]] | SystemdError] = {}

    async def start_jobs(self) -> list[str]:
        self.reads.append("ListJobs")
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        return list(self.jobs)

    async def units_state(self, names: Collection[str]) -> list[UnitState]:
        self.reads.append("ListUnitsByNames " + ",".join(names))
        return [self.states[n] for n in names if n in self.states]

    async def jobs_waited_for(self, job_id: int) -> list[tuple[int, str, str]]:
        found = self.waited_for.get(job_id, [])
        if isinstance(found, SystemdError):
            raise found
        return found


class FakeTracker:
    def __init__(self) -> None:
        self.stamps: dict[str, int] = {}

    def heard(self, name: str) -> int:
        return self.stamps.get(name, 0)


class Kit:
    def __init__(self) -> None:
        self.systemd = FakeSystemd()
        self.tracker = FakeTracker()
        self.counters = Counters()
        self.specs = {A: UnitSpec(A, 50), B: UnitSpec(B, 10), C: UnitSpec(C, 30), D: UnitSpec(D, 5)}
        self.known: set[str] = set()
        self.rescanning = False
        self.taken: list[tuple[list[str], list[str]]] = []
        self.gates: list[dict[str, str]] = []  # the starts at their gate, of each round
        self.tasks: list[asyncio.Task[None]] = []
        self.queued = QueuedStarts(
            cast(Systemd, self.systemd),
            cast(Tracker, self.tracker),
            self.counters,
            self.specs.get,
            self.known.__contains__,
            lambda: self.rescanning,
            self.spawn,
            self.take,
        )

    def spawn(self, coro: Any) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(coro))

    def take(self, starts: list[UnitSpec], units: list[str], gates: dict[str, str]) -> None:
        self.taken.append(([s.name for s in starts], units))
        self.gates.append(gates)

    async def done(self) -> None:
        while not all(t.done() for t in self.tasks):
            await asyncio.sleep(0)
        for task in self.tasks:
            task.result()


def test_the_starts_of_one_transaction_are_taken_with_the_call_that_waited() -> None:
    """a.service's gate asks first; b.service's start, queued with it, is unknown to the
    core: both are taken, in systemd's order, with a.service's call."""

    async def test() -> None:
        kit = Kit()
        kit.systemd.jobs = [A, B, "plain.service"]
        kit.systemd.states = {A: at_gate(A, 7), B: at_gate(B, 8)}
        kit.queued.wait(A)
        await kit.done()
        assert kit.taken == [([A, B], [A])]
        assert kit.systemd.reads == ["ListJobs", f"ListUnitsByNames {A},{B}"]

    asyncio.run(test())


def test_only_starts_the_core_does_not_know_and_bound_for_their_gate_are_taken() -> None:
    """A unit the core knows is not read; a start job of a unit that runs (it ends at once)
    is not a start, nor one in its ExecCondition= (it may be skipped: known at its gate,
    tracker.at_condition); nor a read older than a word of systemd's about the unit."""

    async def test() -> None:
        kit = Kit()
        kit.known.add(C)
        kit.systemd.jobs = [A, B, C, B, D]
        kit.systemd.states = {
            A: UnitState(A, "active", "running", 7, "start"),
            B: at_gate(B, 8),
            D: UnitState(D, "activating", "condition", 9, "start"),
        }
        kit.queued.wait(A)
        await kit.done()
        assert kit.taken == [([B], [A])]
        assert kit.systemd.reads == ["ListJobs", f"ListUnitsByNames {A},{B},{D}"]

        kit.tracker.stamps[B] = 1
        states = kit.systemd.units_state

        async def heard_meanwhile(names: Collection[str]) -> list[UnitState]:
            kit.tracker.stamps[B] = 2  # a signal about B while its state was read
            return await states(names)

        kit.systemd.units_state = heard_meanwhile  # type: ignore[method-assign]
        kit.queued.wait(A)
        await kit.done()
        assert kit.taken[-1] == ([], [A])

    asyncio.run(test())


def test_a_start_queued_behind_a_gpu_units_start_is_not_taken() -> None:
    """d.service (5) Requires= and After= c.service (30): its start waits in systemd's queue
    for c's, whose gate asks. Taken with c's call, d's start kept the GPU c's gate waited
    for, while d waited for c: neither ran. It is known at its gate instead; a start whose
    waits cannot be read is too (counted), one waiting for a plain unit's start is taken."""

    async def test() -> None:
        kit = Kit()
        kit.systemd.jobs = [C, D]
        waiting = UnitState(D, "inactive", "dead", 9, "start")
        kit.systemd.states = {C: at_gate(C, 8), D: waiting}
        kit.systemd.waited_for = {9: [(8, C, "start")]}
        kit.queued.wait(C)
        await kit.done()
        assert kit.taken == [([C], [C])]
        kit.systemd.waited_for = {9: SystemdError(NO_REPLY, "no answer within 60 s")}
        kit.queued.wait(C)
        await kit.done()
        assert kit.taken[-1] == ([C], [C])
        assert kit.counters.errors["dbus_call_errors"] == 1
        kit.systemd.waited_for = {9: [(10, "plain.service", "start"), (8, C, "stop")]}
        kit.queued.wait(C)
        await kit.done()
        assert kit.taken[-1] == ([C, D], [C])

    asyncio.run(test())


@pytest.mark.parametrize("reads", [WAITED_FOR_READS, WAITED_FOR_READS + 1])
def test_a_start_whose_waits_take_more_than_the_bound_to_read_is_not_taken(reads: int) -> None:
    """d.service's start waits, through a chain of plain units' stops, for nothing of
    ours: read to its end within WAITED_FOR_READS Job.GetBefore reads, it is taken; one
    read more is not sent, and the start is known at its gate instead (counted)."""

    async def test() -> None:
        kit = Kit()
        kit.systemd.jobs = [C, D]
        kit.systemd.states = {C: at_gate(C, 8), D: UnitState(D, "inactive", "dead", 100, "start")}
        kit.systemd.waited_for = {
            job: [(job + 1, f"p{job}.service", "stop")] for job in range(100, 100 + reads - 1)
        }
        kit.queued.wait(C)
        await kit.done()
        within = reads <= WAITED_FOR_READS
        assert kit.taken == [([C, D] if within else [C], [C])]
        assert kit.counters.errors["dbus_call_errors"] == (0 if within else 1)

    asyncio.run(test())


def test_a_job_many_waits_lead_to_is_read_once() -> None:
    """d.service's start waits for ten plain units' starts, all After= one plain unit whose
    start every one of them waits for: 12 reads in all, within WAITED_FOR_READS, not one
    more for each way to the shared job (which passed the bound: d was not taken)."""

    async def test() -> None:
        kit = Kit()
        kit.systemd.jobs = [C, D]
        kit.systemd.states = {C: at_gate(C, 8), D: UnitState(D, "inactive", "dead", 100, "start")}
        shared = (200, "base.service", "start")
        ways = range(101, 111)
        kit.systemd.waited_for = {100: [(j, f"p{j}.service", "start") for j in ways]}
        kit.systemd.waited_for |= {j: [shared] for j in ways}
        kit.queued.wait(C)
        await kit.done()
        assert kit.taken == [([C, D], [C])]
        assert kit.counters.errors["dbus_call_errors"] == 0

    asyncio.run(test())


def test_a_read_that_fails_is_said_in_the_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    """Counted as a D-Bus error, each failed read says why at debug level: ListJobs, and a
    Job.GetBefore (with the job whose waits were walked)."""
    caplog.set_level(logging.DEBUG, logger="gpuslice")

    async def test() -> None:
        kit = Kit()
        kit.systemd.error = SystemdError(NO_REPLY, "no answer within 60 s")
        kit.queued.wait(A)
        await kit.done()
        kit.systemd.error = None
        kit.systemd.jobs = [C, D]
        kit.systemd.states = {C: at_gate(C, 8), D: UnitState(D, "inactive", "dead", 9, "start")}
        kit.systemd.waited_for = {9: [(10, "plain.service", "start")]}
        kit.systemd.waited_for[10] = SystemdError(NO_REPLY, "no answer within 25 s")
        kit.queued.wait(C)
        await kit.done()

    asyncio.run(test())
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG] == [
        f"cannot read systemd's start jobs: {NO_REPLY}: no answer within 60 s",
        f"cannot read the jobs job 9 waits for: {NO_REPLY}: no answer within 25 s",
    ]


def test_a_read_that_fails_serves_the_calls_on_the_starts_known() -> None:
    async def test() -> None:
        kit = Kit()
        kit.systemd.error = SystemdError(NO_REPLY, "no answer within 60 s")
        kit.queued.wait(A)
        await kit.done()
        assert kit.taken == [([], [A])]
        assert kit.counters.errors["dbus_call_errors"] == 1
        assert not kit.queued.reading
        kit.queued.unseen()  # a start it did not list stays in doubt: the mark stays
        kit.queued.hold_gate(B, "1f")
        await kit.done()
        assert kit.gates[-1] == {B: "1f"}
        assert kit.queued.unplaced

    asyncio.run(test())


def test_a_flood_of_calls_costs_one_read_in_flight_and_one_after_it() -> None:
    """A root caller repeats Acquire 10,000 times, for three units, while a read is out:
    one read serves the first call, one more all the others (they may name a start queued
    after the first was answered), each unit once; no timer is set."""

    async def test() -> None:
        kit = Kit()
        kit.systemd.gate = asyncio.Event()
        kit.systemd.jobs = [A, B, C]
        kit.systemd.states = {n: at_gate(n, j) for j, n in enumerate((A, B, C), 1)}
        kit.queued.wait(A)
        await asyncio.sleep(0)
        timers = len(getattr(asyncio.get_running_loop(), "_scheduled", ()))
        for i in range(10_000):
            kit.queued.wait((A, B, C)[i % 3])
        assert len(kit.tasks) == 1
        assert kit.systemd.reads == ["ListJobs"]
        assert len(getattr(asyncio.get_running_loop(), "_scheduled", ())) == timers
        kit.systemd.gate.set()
        await kit.done()
        assert [units for _, units in kit.taken] == [[A], [A, B, C]]
        assert kit.systemd.reads.count("ListJobs") == 2
        assert len(kit.tasks) == 1

    asyncio.run(test())


def test_a_bug_in_taking_a_read_in_leaves_no_call_behind() -> None:
    """`take` raises (a bug) for the first round: the calls that came meanwhile are still
    taken in, and the error reaches the task."""

    async def test() -> None:
        kit = Kit()
        kit.systemd.gate = asyncio.Event()
        rounds: list[list[str]] = []

        def take(starts: list[UnitSpec], units: list[str], gates: dict[str, str]) -> None:
            rounds.append(units)
            if len(rounds) == 1:
                raise RuntimeError("bug")

        kit.queued.take = take
        kit.queued.wait(A)
        await asyncio.sleep(0)
        kit.queued.wait(B)
        kit.systemd.gate.set()
        while not kit.tasks[0].done():
            await asyncio.sleep(0)
        assert rounds == [[A], [B]]
        assert isinstance(kit.tasks[0].exception(), RuntimeError)
        assert not kit.queued.reading

    asyncio.run(test())


def test_a_start_at_its_pipe_is_taken_with_the_starts_a_dropped_job_new_hid() -> None:
    """b.service's JobNew was dropped while a rescan read the unit files (`unseen`): a
    start of a.service shown at its gate (`hold_gate`) is taken with the read, and b.service
    with it. The mark goes once a round sent while no rescan runs is taken in with no JobNew
    dropped meanwhile; then a pipe's grant reads nothing."""

    async def test() -> None:
        kit = Kit()
        kit.known.add(A)
        kit.rescanning = True
        kit.queued.unseen()
        kit.rescanning = False
        assert kit.queued.unplaced
        kit.systemd.jobs = [A, B]
        kit.systemd.states = {B: at_gate(B, 8)}
        kit.queued.hold_gate(A, "1f")
        await kit.done()
        assert kit.taken == [([B], [])]
        assert kit.gates == [{A: "1f"}]
        assert not kit.queued.unplaced

    asyncio.run(test())


@pytest.mark.parametrize("when", ["dropped during the read", "sent during a rescan"])
def test_a_read_that_may_miss_a_dropped_start_keeps_the_mark(when: str) -> None:
    """A JobNew dropped while the read was out may name a start it did not list; a read sent
    while a rescan runs was judged on a scan that may not know the unit: either keeps
    `unplaced`, and the next start at its pipe waits for a read again."""

    async def test() -> None:
        kit = Kit()
        kit.queued.unseen()
        kit.systemd.gate = asyncio.Event()
        kit.rescanning = when == "sent during a rescan"
        kit.queued.hold_gate(A, "1f")
        await asyncio.sleep(0)
        if when == "dropped during the read":
            kit.queued.unseen()
        kit.rescanning = False
        kit.systemd.gate.set()
        await kit.done()
        assert kit.gates == [{A: "1f"}]
        assert kit.queued.unplaced

    asyncio.run(test())
