"""A controller that starts while someone's stop waits at a unit's gate (`systemctl stop a`
while A waits there, the stop waiting its turn): ListUnits names the job's type, and the unit
is leaving (Tracker.listed), as a waiter told down there is (Tracker.stopped_at_gate). Taken
for a start, it was queued (Restore.rebuild) and preempted less urgent units for a unit being
stopped, whose GPUs then went unused. On the fakes of tests/test_controller.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.core.scheduler import SavedState
from gpuslice.tracker import UnitState
from tests.test_controller import (
    Bed,
    _no_notify_socket,  # noqa: F401  (autouse: as in tests/test_controller.py)
    bed_config,
    goes_down,
    run,
    settle,
    state,
)
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_controller_leaving_mutation import DOWN
from tests.test_controller_stopped_with import AT_GATE, _job

A, LOW, BG = "a.service", "low.service", "bg.service"


def _stopped(bed: Bed, unit: str, job: int = 21) -> None:
    """Someone's stop (job `job`) ran: the unit is down, its job gone."""
    bed.systemd.units[unit] = state(unit, "inactive", "dead")
    bed.controller.on_job_removed(job, _job(job), unit, "done")
    bed.controller.on_unit_changed(unit, DOWN)


def _a_at_its_gate(
    tmp_path: Path,
    job: int = 21,
    job_type: str = "stop",
    requeued: bool = False,
) -> Bed:
    """LOW (90) holds the one GPU; A (10, or a comeback of 50 `requeued`: restarted by the
    last controller to wait at its gate) is shown at its gate with job `job` of `job_type`."""
    return Bed(
        tmp_path,
        {A: "Priority=50\n" if requeued else "Priority=10\n", LOW: "Priority=90\n"},
        [
            state(LOW, "active", "running"),
            state(A, "activating", "start-pre", job, job_type),
        ],
        SavedState(
            holders={LOW: ((0,), "running", 2, "")},
            requeued=[A] if requeued else [],
            seq=2,
        ),
        config=bed_config(tmp_path, requeue_at_gate=requeued),
    )


def test_a_unit_someone_stops_at_its_gate_is_not_queued_at_start_up(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """A waits at its gate with someone's stop queued (ListUnits: job type `stop`) as the
    controller starts: it is held, not queued, and preempts nothing; its gate, asking before
    systemd kills it, is told to ask again; its down tells nothing more. Queued, LOW was
    stopped for a unit that went down a moment later."""
    bed = _a_at_its_gate(tmp_path)
    cgroup_of[4242] = A

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert ("stop", LOW) not in bed.systemd.calls
        assert not ctl.scheduler.is_waiting(A)
        assert A in ctl.scheduler.held
        assert ctl.tracker.leaving(A)
        await bed.acquire(A)
        assert bed.service.sent_back == [A]
        _stopped(bed, A)
        await settle()
        assert not ctl.tracker.leaving(A)
        assert A in ctl.scheduler.held
        assert ("stop", LOW) not in bed.systemd.calls
        assert bed.service.granted == []
        assert ctl.scheduler.grants() == {LOW: frozenset({0})}

    run(test)


def test_a_comeback_someone_stops_at_its_gate_is_held_not_left_waiting(tmp_path: Path) -> None:
    """A, preempted and restarted to wait at its gate by the last controller (saved
    `requeued`), is stopped there by someone while no controller runs: start-up holds it, as
    a waiter told down at its gate is held; it is owed nothing more (no start of ours, no
    comeback) and preempts nothing. Queued, it stopped LOW (90) for a unit being stopped."""
    bed = _a_at_its_gate(tmp_path, requeued=True)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        core = ctl.scheduler
        assert ("stop", LOW) not in bed.systemd.calls
        assert not core.is_waiting(A)
        assert A in core.held
        assert (core.requeued, core.started, core.requeued_away()) == (set(), set(), [])
        assert A not in core.preempted
        _stopped(bed, A)
        await settle()
        assert A in core.held
        assert ("stop", LOW) not in bed.systemd.calls
        assert ("start", A) not in bed.systemd.calls

    run(test)


@pytest.mark.parametrize("told", ["signal", "read"])
def test_a_start_that_replaces_the_stop_found_at_start_up_waits_again_and_is_granted(
    tmp_path: Path, told: str
) -> None:
    """`systemctl start a` after start-up found A's stop at its gate: the start replaces the
    stop before it ran, and A waits again, as a new start: LOW is stopped for it, and A is
    granted the GPU. Told by its signals, or, those lost, by the read of each audit."""
    bed = _a_at_its_gate(tmp_path)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert ctl.tracker.leaving(A)
        bed.systemd.units[A] = state(A, "activating", "start-pre", 22, "start")
        if told == "signal":
            ctl.on_job_removed(21, _job(21), A, "canceled")
            ctl.on_job_new(22, _job(22), A)
            ctl.on_unit_changed(A, {**AT_GATE, "Job": (22, _job(22))})
        else:
            await ctl.reads.audit()
        await settle()
        assert not ctl.tracker.leaving(A)
        assert ctl.scheduler.is_waiting(A)
        assert A not in ctl.scheduler.held
        assert ("stop", LOW) in bed.systemd.calls
        goes_down(bed, LOW)
        await settle()
        assert ctl.scheduler.grants() == {A: frozenset({0})}

    run(test)


@pytest.mark.parametrize(
    ("job", "job_type"), [(0, ""), (7, "start"), (7, "restart")], ids=["no-job", "start", "restart"]
)
def test_a_unit_at_its_gate_with_no_job_or_a_start_is_queued_at_start_up(
    tmp_path: Path, job: int, job_type: str
) -> None:
    """A at its gate with no job (its start cancelled: its ExecStartPre= goes on) or with a
    start job is a start, queued at once as before: LOW is stopped for it."""
    bed = _a_at_its_gate(tmp_path, job, job_type)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert not ctl.tracker.leaving(A)
        assert ctl.scheduler.is_waiting(A)
        assert ("stop", LOW) in bed.systemd.calls

    run(test)


def test_a_background_unit_someone_stops_at_its_gate_is_not_refilled(tmp_path: Path) -> None:
    """BG (background) waits at its gate with someone's stop queued as the controller starts,
    and the GPU is free: held, it is not started again (a start of ours would replace the
    stop someone asked for), at start-up or once it is down."""
    bed = Bed(
        tmp_path,
        {BG: "Priority=90\nType=background\n"},
        [UnitState(BG, "activating", "start-pre", 21, "stop")],
        SavedState(seq=1),
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert ("start", BG) not in bed.systemd.calls
        _stopped(bed, BG)
        await settle()
        assert BG in ctl.scheduler.held
        assert ("start", BG) not in bed.systemd.calls
        assert ctl.scheduler.grants() == {}

    run(test)


def test_a_start_found_at_its_gate_and_stopped_there_later_is_told_down_at_once(
    tmp_path: Path,
) -> None:
    """A (50) found at its gate with its start (job 7) waits behind LOW (10, more urgent);
    then `systemctl stop a` there: its start ends `canceled`, the stop is announced and
    shown at its gate. A is down for the core at once, as a waiter seen reaching its gate
    is (Tracker.stopped_at_gate): LOW's end grants it nothing. Never seen at its gate by a
    signal, it waited on, and was granted the GPU while its stop ran."""
    bed = Bed(
        tmp_path,
        {A: "Priority=50\n", LOW: "Priority=10\n"},
        [state(LOW, "active", "running"), state(A, "activating", "start-pre", 7, "start")],
        SavedState(holders={LOW: ((0,), "running", 2, "")}, seq=2),
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert ctl.scheduler.is_waiting(A)
        ctl.on_job_removed(7, _job(7), A, "canceled")
        ctl.on_job_new(21, _job(21), A)
        bed.systemd.units[A] = state(A, "activating", "start-pre", 21, "stop")
        ctl.on_unit_changed(A, {**AT_GATE, "Job": (21, _job(21))})
        await settle()
        assert ctl.tracker.leaving(A)
        assert not ctl.scheduler.is_waiting(A)
        assert A in ctl.scheduler.held
        goes_down(bed, LOW)
        await settle()
        assert ctl.scheduler.grants() == {}
        assert bed.service.granted == []

    run(test)
