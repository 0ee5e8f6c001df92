"""A start seen at its gate while a rescan reads, and a StartUnit whose answer was lost,
under mutation.

Mutation testing of `Rescans.hold_gate` and of `Tracker._answered` left
rules no test held: a start the core has answered already is served at once, not held for
the scan (its GPUs are its own whatever the scan reads); a start held back keeps the
InvocationID its signal named when a read without one comes before the scan is applied (its
gate is answered at its pipe, not sent to D-Bus); a StartUnit that failed is no stop of
ours that may have reached systemd.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.core.scheduler import Phase, SavedState
from tests.test_controller import (
    START,
    Bed,
    at_gate,
    low_holds_gpu_0,
    read_pipe,
    run,
    settle,
    state,
    until,
)
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_controller_reload import HeldScan, start_during_rescan
from tests.test_tracker import JOB1, A, Model

# ---- Rescans.hold_gate ----


def test_a_start_already_granted_is_answered_at_its_pipe_while_a_rescan_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller restarted while a.service, granted GPU 0, still waited at its gate:
    the core holds it running. Its signal at the gate comes while a daemon-reload's rescan
    reads: the start was answered, on GPUs that are its own whatever the scan reads, and its
    gate is answered at its pipe at once, as after any controller restart. Held for the
    scan, it waited as long as the scan took (~1 s at 10,000 units); dropped, it never
    passed (a start stuck at its gate)."""
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n"},
        [state("a.service", "activating", "start-pre", 5, "start")],
        SavedState(holders={"a.service": ((0,), "running", 1, "")}, seq=1),
    )
    held = HeldScan(monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.scheduler.phase("a.service") is Phase.RUNNING
        await held.reloaded(bed)
        try:
            ctl.on_unit_changed("a.service", at_gate())
            await settle()
            assert ctl.rescans.task is not None  # the scan is not applied yet
            assert ctl.gates.holds("a.service")
            assert read_pipe(bed, "a.service") == START.hex() + "\n"
        finally:
            held.go.set()  # a failure ends at once, not after the scan's patience
        await until(lambda: ctl.rescans.task is None)
        assert ctl.scheduler.grants() == {"a.service": frozenset({0})}

    run(test)


def test_a_start_held_back_keeps_its_invocation_through_a_read_that_names_none(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """urgent.service's signal at its gate, with its InvocationID, comes while a rescan
    reads, and is held back; a read of its state (no InvocationID: a property read, not a
    signal) comes before the scan is applied. Its start is still the one the signal named:
    once the scan is read it is taken in at its pipe and low.service is preempted for it
    then. Told of no InvocationID, the controller waited GATE_UNSEEN_DELAY for a signal
    that had come already, and then sent the gate to D-Bus."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    held = HeldScan(monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await start_during_rescan(bed, held, "pipe")
        read = {"ActiveState": "activating", "SubState": "start-pre", "Job": (7, "/")}
        ctl.on_unit_changed("urgent.service", read, read=True)
        await settle()
        assert ("stop", "low.service") not in bed.systemd.calls
        held.go.set()
        await until(lambda: ctl.rescans.task is None)
        await settle()
        assert ctl.gates.holds("urgent.service")  # taken in at its pipe, now
        assert ("stop", "low.service") in bed.systemd.calls

    run(test)


# ---- Tracker._answered ----


def test_a_start_whose_answer_was_lost_is_not_taken_for_an_unanswered_stop() -> None:
    """gpuslice's StartUnit of A got no answer (the bus daemon drops answers to a flooded
    connection); a person then stops A, and our StopUnit, sent after it, gets no answer
    either. The stop job a read shows was announced before our stop was sent: the
    person's, ours merged into it, and theirs ends A. Dated from our lost start instead, it
    was taken for ours, A's end for a preemption, and A came back against the person's
    will."""
    model = Model()
    model.phases[A] = Phase.STARTING
    tracker = model.tracker()
    tracker.call_sent(A)
    assert tracker.call_answered(A, None, "start") is False
    tracker.job_new(JOB1, A)  # the person's stop
    model.phases[A] = Phase.STOPPING
    tracker.call_sent(A)
    assert tracker.call_answered(A, None, "stop") is False
    assert tracker.stop_found(A, JOB1) is False
    assert tracker.stopped_by_others(A) is True
