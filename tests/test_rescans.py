"""gpuslice/rescans.py on its own: the rescans after a daemon-reload, one at a time, and the
starts they hold back.

Small fakes stand for the tracker's states and the core's word on a unit (no controller, no
bus); what the controller is handed (a scan applied, the starts held back judged, a gate's
call served) is recorded in one list, in order. A scan runs in a thread as the real one does;
once a test asks (`Kit.hold`), each waits there until the test lets it go (`Kit.release`), so
that the test can act while it runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from gpuslice.annotations import Scan
from gpuslice.rescans import RESCANNED_KEPT, Rescans
from gpuslice.tracker import UnitState

A = "a.service"
B = "b.service"
C = "c.service"
AT_GATE = ("activating", "start-pre")
# seconds to wait for what takes a scan's thread or a few turns of the loop: a pass never
# waits this long (a 1 s bound is one a loaded host can exceed)
WITHIN = 30.0


class FakeStates:
    """What systemd last showed of each unit: down with no job unless set."""

    def __init__(self) -> None:
        self.shown: dict[str, tuple[str, str]] = {}

    def state(self, name: str) -> UnitState:
        active, sub = self.shown.get(name, ("inactive", "dead"))
        return UnitState(name, active, sub, 0)


class Kit:
    """A Rescans with fakes around it; `events` is what it handed the controller, in order."""

    def __init__(self) -> None:
        self.ready = True
        self.states = FakeStates()
        self.known: set[str] = set()
        self.answered: set[str] = set()
        self.events: list[tuple[str, Any]] = []
        self.reads = 0
        self.fail = False
        self.holding = False  # scans wait in their thread, one `release` each
        self.go = threading.Semaphore(0)
        self.entered = threading.Semaphore(0)  # one release per scan begun
        self.failures: list[asyncio.Task[None]] = []
        self.rescans = Rescans(
            self.read,
            lambda: self.ready,
            self.states,
            lambda unit: unit in self.known,
            lambda unit: unit not in self.answered,
            lambda scan: self.events.append(("apply", scan.root)),
            lambda pending: self.events.append(("gates", dict(pending))),
            lambda unit: self.events.append(("acquire", unit)),
            self.failures.append,
        )

    def read(self) -> Scan:
        self.reads += 1
        n = self.reads
        self.entered.release()
        if self.holding:
            assert self.go.acquire(timeout=5)
        if self.fail:
            raise OSError("cannot read the unit files")
        return Scan(root=f"scan {n}")

    def hold(self) -> None:
        """Scans from now on wait in their thread, each until a `release`."""
        self.holding = True

    async def begun(self) -> None:
        """Return once a scan is running in its thread."""
        assert await asyncio.to_thread(self.entered.acquire, True, WITHIN), "no scan began"

    def release(self) -> None:
        """The scan held (or the next one) goes on."""
        self.go.release()

    def let_go(self) -> None:
        """The scan held goes on, and those after it are not held."""
        self.holding = False
        self.go.release()

    async def done(self) -> None:
        """Return once no scan is under way (the task ended, its held-back starts judged)
        and each task's done callbacks have run: `task` is None from the task's `finally`,
        before its failure is reported (`call_soon`), which a loaded host showed late."""
        seen: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WITHIN
        while loop.time() < deadline:
            if self.rescans.task is None:
                if seen:
                    await asyncio.wait(seen)  # its callbacks, registered first, ran
                return
            seen.add(self.rescans.task)
            await asyncio.sleep(0.01)
        raise AssertionError(f"the rescan did not end: {self.rescans.task}")


def run(test: Callable[[Kit], Coroutine[Any, Any, None]]) -> Kit:
    kit = Kit()
    asyncio.run(test(kit))
    return kit


def judged(pending: dict[str, str | None] | None = None, *acquired: str) -> list[Any]:
    """The events of judging the starts held back: the gates first, then the calls."""
    return [("gates", pending or {}), *(("acquire", u) for u in acquired)]


# ---- request ---------------------------------------------------------------------------------


def test_a_request_before_start_up_is_done_is_kept_for_then() -> None:
    async def test(kit: Kit) -> None:
        kit.ready = False
        kit.rescans.request()
        assert kit.rescans.task is None and kit.rescans.again
        await asyncio.sleep(0.05)
        assert kit.reads == 0 and kit.events == []

    run(test)


def test_a_request_scans_once_applies_it_then_judges_what_it_held_back() -> None:
    async def test(kit: Kit) -> None:
        kit.rescans.request()
        task = kit.rescans.task
        assert task is not None
        await kit.done()
        assert kit.reads == 1 and not kit.rescans.again
        assert kit.events == [("apply", "scan 1"), *judged(), *judged()]
        assert kit.failures == [task] and task.exception() is None

    run(test)


def test_requests_while_a_scan_runs_make_one_more_scan_not_one_each() -> None:
    async def test(kit: Kit) -> None:
        kit.hold()
        kit.rescans.request()
        first = kit.rescans.task
        await kit.begun()
        for _ in range(50):
            kit.rescans.request()
        assert kit.rescans.task is first and kit.rescans.again
        kit.let_go()
        await kit.done()
        assert kit.reads == 2 and not kit.rescans.again
        assert [e for e in kit.events if e[0] == "apply"] == [
            ("apply", "scan 1"),
            ("apply", "scan 2"),
        ]
        assert kit.failures == [first]

    run(test)


def test_a_new_request_once_one_ended_scans_again() -> None:
    async def test(kit: Kit) -> None:
        kit.rescans.request()
        await kit.done()
        kit.rescans.request()
        await kit.done()
        assert kit.reads == 2 and len(kit.failures) == 2

    run(test)


# ---- the starts held back ----------------------------------------------------------------------


def test_a_start_in_its_exec_condition_while_a_scan_runs_is_not_held_back() -> None:
    """`ExecCondition=` runs before the gate and may skip the start: held back, the start
    was judged at the scan's end as one at its gate (ReachedGate: its victims stopped for a
    start that may never run). Its start-pre signal, if it comes, is held back then."""

    async def test(kit: Kit) -> None:
        kit.hold()
        kit.rescans.request()
        await kit.begun()
        kit.states.shown[A] = ("activating", "condition")
        assert not kit.rescans.hold_gate(A, "inv-a")
        kit.states.shown[A] = AT_GATE
        assert kit.rescans.hold_gate(A, "inv-a")
        kit.release()

    run(test)


def test_a_start_at_its_gate_while_a_scan_runs_is_judged_once_it_is_applied() -> None:
    async def test(kit: Kit) -> None:
        kit.states.shown[A] = AT_GATE
        assert not kit.rescans.hold_gate(A, "inv-a")  # no scan under way: decided now
        kit.hold()
        kit.rescans.request()
        await kit.begun()
        assert kit.rescans.hold_gate(A, "inv-a")
        assert kit.rescans.hold_gate(A, None)  # a read names no start: the signal's kept
        assert kit.rescans.after_scan == {A: "inv-a"}
        kit.rescans.park(B)
        assert kit.events == []
        kit.release()
        await kit.done()
        assert kit.events == [
            ("apply", "scan 1"),
            *judged(),  # held before this scan began: none
            *judged({A: "inv-a"}, B),
        ]
        assert kit.rescans.after_scan == {} and kit.rescans.parked == []

    run(test)


def test_a_later_signal_names_the_start_held_back() -> None:
    async def test(kit: Kit) -> None:
        kit.states.shown[A] = AT_GATE
        kit.hold()
        kit.rescans.request()
        await kit.begun()
        assert kit.rescans.hold_gate(A, "inv-1")
        assert kit.rescans.hold_gate(A, "inv-2")
        assert kit.rescans.after_scan == {A: "inv-2"}
        kit.release()
        await kit.done()

    run(test)


@pytest.mark.parametrize(
    ("shown", "answered"),
    [
        (("activating", "start"), False),  # past its gate
        (("inactive", "dead"), False),  # down
        (AT_GATE, True),  # answered: its gate asks again
    ],
)
def test_only_an_unanswered_start_at_its_gate_is_held(
    shown: tuple[str, str], answered: bool
) -> None:
    async def test(kit: Kit) -> None:
        kit.states.shown[A] = shown
        if answered:
            kit.answered.add(A)
        kit.hold()
        kit.rescans.request()
        await kit.begun()
        assert not kit.rescans.hold_gate(A, "inv-a")
        assert kit.rescans.after_scan == {}
        kit.release()
        await kit.done()

    run(test)


def test_a_start_held_during_the_first_of_two_scans_is_judged_after_the_first() -> None:
    async def test(kit: Kit) -> None:
        kit.states.shown[A] = AT_GATE
        kit.states.shown[B] = AT_GATE
        kit.hold()
        kit.rescans.request()
        await kit.begun()
        kit.rescans.hold_gate(A, "inv-a")
        kit.rescans.park(C)
        kit.rescans.request()  # a daemon-reload during the scan
        kit.release()
        await kit.begun()  # the second scan
        kit.rescans.hold_gate(B, "inv-b")
        kit.release()
        await kit.done()
        assert kit.events == [
            ("apply", "scan 1"),
            *judged(),
            ("apply", "scan 2"),
            *judged({A: "inv-a"}, C),
            *judged({B: "inv-b"}),
        ]

    run(test)


def test_a_start_held_before_the_scan_began_is_judged_once_it_is_applied() -> None:
    async def test(kit: Kit) -> None:
        kit.rescans.hold_for_rescan(A)  # start-up's: a daemon-reload ended meanwhile
        kit.rescans.park(B)
        kit.rescans.request()
        await kit.done()
        assert kit.events == [("apply", "scan 1"), *judged({A: None}, B), *judged()]

    run(test)


def test_a_failed_scan_judges_what_it_held_back_on_the_scan_before() -> None:
    async def test(kit: Kit) -> None:
        kit.states.shown[A] = AT_GATE
        kit.fail = True
        kit.hold()
        kit.rescans.hold_for_rescan(C)
        kit.rescans.request()
        await kit.begun()
        kit.rescans.hold_gate(A, "inv-a")
        kit.rescans.park(B)
        waiting = asyncio.create_task(kit.rescans.scanned())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        kit.release()
        await kit.done()
        await asyncio.wait_for(waiting, WITHIN)
        assert kit.events == judged({C: None, A: "inv-a"}, B)
        [task] = kit.failures
        assert isinstance(task.exception(), OSError)
        assert kit.rescans.after_scan == {} and kit.rescans.parked == []
        assert kit.rescans.waits == []

    run(test)


def test_a_scan_that_fails_after_another_judges_what_it_held_back() -> None:
    async def test(kit: Kit) -> None:
        kit.hold()
        kit.rescans.request()
        await kit.begun()
        kit.rescans.park(B)
        waiting = asyncio.create_task(kit.rescans.scanned())
        await asyncio.sleep(0.01)
        kit.rescans.request()
        kit.release()
        await kit.begun()  # the second scan, which took them over
        assert kit.rescans.parked == [] and kit.rescans.waits == []
        kit.fail = True
        kit.release()
        await kit.done()
        await asyncio.wait_for(waiting, WITHIN)
        assert kit.events == [("apply", "scan 1"), *judged(), *judged(None, B)]
        assert isinstance(kit.failures[0].exception(), OSError)

    run(test)


def test_a_scan_cancelled_as_the_controller_stops_judges_nothing_it_held_back() -> None:
    """asyncio.run cancels the rescan under way once run() returns (SIGTERM: `systemctl
    restart gpuslice` right after a daemon-reload). Judged then on the scan before, a start
    at its gate whose annotation the reload took out or made less urgent was granted, and
    preempted others, by a controller on its way out; left alone, the next one takes it in
    on the unit files of then (Restore.rebuild), and its gate asks that one again."""

    async def test(kit: Kit) -> None:
        kit.states.shown[A] = AT_GATE
        kit.hold()
        kit.rescans.hold_for_rescan(C)
        kit.rescans.request()
        task = kit.rescans.task
        assert task is not None
        await kit.begun()
        assert kit.rescans.hold_gate(A, "inv-a")
        kit.rescans.park(B)
        waiting = asyncio.create_task(kit.rescans.scanned())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        kit.let_go()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, WITHIN)  # ended, not let on to decide
        assert kit.events == judged() and kit.rescans.task is None  # none of them
        assert kit.rescans.after_scan == {} and kit.rescans.parked == []
        assert kit.rescans.waits == []

    run(test)


# ---- scanned ---------------------------------------------------------------------------------


def test_scanned_returns_at_once_without_a_scan_under_way() -> None:
    async def test(kit: Kit) -> None:
        await asyncio.wait_for(kit.rescans.scanned(), WITHIN)
        assert kit.rescans.waits == []

    run(test)


def test_scanned_returns_once_the_scan_begun_after_it_is_applied() -> None:
    async def test(kit: Kit) -> None:
        kit.hold()
        kit.rescans.request()
        await kit.begun()
        waiting = asyncio.create_task(kit.rescans.scanned())
        gone = asyncio.create_task(kit.rescans.scanned())
        await asyncio.sleep(0.01)
        gone.cancel()  # a wait given up: not answered (nor failed on)
        kit.rescans.request()
        kit.release()
        await kit.begun()
        await asyncio.sleep(0.01)
        assert not waiting.done()  # the first scan began before it asked
        kit.rescans.request()
        kit.release()
        await kit.begun()  # a third scan: not waited for
        await asyncio.wait_for(waiting, WITHIN)
        kit.release()
        await kit.done()
        assert all(t.exception() is None for t in kit.failures)
        assert kit.events == [
            ("apply", "scan 1"),
            *judged(),
            ("apply", "scan 2"),
            *judged(),
            ("apply", "scan 3"),
            *judged(),
            *judged(),
        ]

    run(test)


# ---- a rescan for a gate -------------------------------------------------------------------------


def test_the_gate_of_a_unit_nobody_knows_gets_one_rescan_until_the_next_reload() -> None:
    async def test(kit: Kit) -> None:
        kit.hold()
        assert kit.rescans.for_gate(A)
        first = kit.rescans.task
        assert first is not None
        assert not kit.rescans.for_gate(A)  # once per unit
        assert not kit.rescans.again
        kit.let_go()
        await kit.done()
        assert not kit.rescans.for_gate(A)
        assert kit.rescans.task is None and kit.reads == 1
        kit.rescans.reloaded()  # a daemon-reload: scanned again, and A may ask again
        assert kit.rescans.task is not None and kit.rescans.rescanned_for_gate == set()
        await kit.done()
        assert kit.rescans.for_gate(A)
        await kit.done()
        assert kit.reads == 3

    run(test)


def test_the_units_given_a_rescan_for_their_gate_are_kept_bounded() -> None:
    """A template's gate left in place with its annotation gone (no daemon-reload since)
    asks for each instance started, a name per job: 2,000 of them keep at most
    RESCANNED_KEPT names until the next reload, not one each. A unit forgotten early asks
    for one more scan, no less."""

    async def test(kit: Kit) -> None:
        for i in range(2000):
            assert kit.rescans.for_gate(f"job@rec-{i:06d}.service")
            assert len(kit.rescans.rescanned_for_gate) <= RESCANNED_KEPT
        await kit.done()
        assert not kit.rescans.for_gate("job@rec-001999.service")  # kept: asked once

    run(test)


def test_the_gate_of_a_unit_the_core_knows_gets_no_rescan() -> None:
    async def test(kit: Kit) -> None:
        kit.known.add(A)
        assert not kit.rescans.for_gate(A)
        assert kit.rescans.task is None and kit.rescans.rescanned_for_gate == set()

    run(test)


def test_an_acquire_from_a_unit_that_has_no_gate_gets_no_rescan() -> None:
    """Only a service has ExecStartPre=, so only a service has a gate: an Acquire from a
    login's session scope (a new name at each login; the bus policy lets root alone call
    Acquire) or a slice is no reason to read 10,000 unit files again (~1 s of the
    controller's CPU per call, found by review R2)."""

    async def test(kit: Kit) -> None:
        for name in ("session-4.scope", "session-5.scope", "user-1000.slice", "x.socket"):
            assert not kit.rescans.for_gate(name)
        assert kit.rescans.task is None and kit.rescans.rescanned_for_gate == set()

    run(test)


def test_a_judgement_that_raises_leaves_no_held_back_start_undecided() -> None:
    """The gates' judgement raising (a bug, never a user's input) skipped the parked calls
    and the queued starts' waits, which then waited for ever, and the `finally` judged the
    same gates twice (review R2). Now every step runs once; the first error reaches the
    task's failure report."""

    async def test(kit: Kit) -> None:
        def judge_gates(pending: dict[str, str | None]) -> None:
            kit.events.append(("gates", dict(pending)))
            raise RuntimeError("a bug")

        kit.rescans.judge_gates = judge_gates
        kit.states.shown[A] = AT_GATE
        kit.hold()
        kit.rescans.request()
        await kit.begun()
        kit.rescans.hold_gate(A, "inv-a")
        kit.rescans.park(B)
        kit.rescans.park(C)
        waiting = asyncio.create_task(kit.rescans.scanned())
        await asyncio.sleep(0.01)
        kit.let_go()
        await kit.done()
        await asyncio.wait_for(waiting, WITHIN)
        # held during the scan: the next judgement's, here the `finally`'s (the loop's raised)
        assert kit.events == [("apply", "scan 1"), *judged(), *judged({A: "inv-a"}, B, C)]
        [task] = kit.failures
        assert isinstance(task.exception(), RuntimeError)

    run(test)
