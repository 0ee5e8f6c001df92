"""A waiter someone stops at its gate (Tracker.stopped_at_gate): told down at once, read for
its job's type (Controller._read_leaving, LEAVING_READS reads at most), waiting again only
where a start replaced the stop (Controller._waits_again), and never announced or taken in
again while its stop is under way (`_announce_queued`, `_gates_after_scan`). On the fakes
of tests/test_controller.py, with the set-ups of tests/test_controller_stopped_with.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path

import pytest

from gpuslice import controller as controller_module
from gpuslice import rereads as rereads_module
from gpuslice.controller import LEAVING_READS, Controller
from gpuslice.tracker import UnitState
from tests.test_controller import (
    HOUR,
    NO_REPLY,
    Bed,
    _no_notify_socket,  # noqa: F401  (autouse: as in tests/test_controller.py)
    bed_config,
    due_now,
    goes_down,
    holding_a_gpu_each,
    messages,
    run,
    settle,
    state,
    until,
)
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_controller_reload import HeldScan
from tests.test_controller_stopped_with import (
    AT_GATE,
    _a_behind_b,
    _job,
    _waits_at_its_gate,
)

A, B, E = "a.service", "b.service", "e.service"
DOWN = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
WAITS_AGAIN = f"{A} waits at its gate again: a start replaced its stop"


@pytest.fixture(autouse=True)
def _no_audit(monkeypatch: pytest.MonkeyPatch) -> None:
    """No audit comes within a test: each reads the units still told down at their gate
    again (Controller._at_audit), a read more than a test counts, on a loaded machine."""
    monkeypatch.setattr(rereads_module, "AUDIT_INTERVAL", 3600)


def _told_down(bed: Bed, unit: str, start: int, stop: int) -> None:
    """Someone's `systemctl stop` of `unit` waiting at its gate: its start (job `start`)
    ends `canceled` and the stop (job `stop`) is announced; systemd shows the stop there."""
    ctl = bed.controller
    ctl.on_job_removed(start, _job(start), unit, "canceled")
    ctl.on_job_new(stop, _job(stop), unit)
    bed.systemd.units[unit] = state(unit, "activating", "start-pre", stop, "stop")


def _reads_of(bed: Bed, unit: str) -> int:
    return bed.systemd.calls.count(("units_state", unit))


def _meanwhile(bed: Bed, said: Callable[[int], None]) -> None:
    """Each read of units' states is answered after `said(n)` (n: the reads so far) ran:
    systemd's signals that came while the read was on its way."""
    read = bed.systemd.units_state
    count = 0

    async def late(names: Collection[str]) -> list[UnitState]:
        nonlocal count
        count += 1
        said(count)
        return await read(names)

    bed.systemd.units_state = late  # type: ignore[method-assign]


def _a_down_at_the_first_read(bed: Bed) -> None:
    """A's gate is killed, its down signalled, while the first read is on its way."""

    def down(reads: int) -> None:
        if reads == 1:
            bed.systemd.units[A] = state(A, "inactive", "dead")
            bed.controller.on_unit_changed(A, DOWN)

    _meanwhile(bed, down)


def test_a_failed_read_of_a_waiter_told_down_at_its_gate_is_said_in_the_debug_log(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The read of A's job fails: the journal's debug level says so, and why."""
    bed = _a_behind_b(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = await _waits_at_its_gate(bed)
        read = bed.systemd.units_state

        async def failing(names: Collection[str]) -> list[UnitState]:
            bed.systemd.units_state = read  # type: ignore[method-assign]
            raise NO_REPLY

        bed.systemd.units_state = failing  # type: ignore[method-assign]
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            _told_down(bed, A, 20, 21)
            await settle()
        said = f"cannot read the jobs of units stopped at their gate: {NO_REPLY}"
        assert said in messages(caplog)
        assert ctl.counters.errors["dbus_call_errors"] == 1
        assert ctl.tracker.leaving(A)

    run(test)


def test_a_waiter_told_down_at_its_gate_is_read_leaving_reads_times_at_most(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """While each read of A's job is on its way, a signal of A comes (its stop still shown
    at its gate): the answer may be older, and A is read again, LEAVING_READS reads in all,
    not one a signal (a unit's signals are anyone's to cause)."""
    bed = _a_behind_b(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = await _waits_at_its_gate(bed)

        def signal(reads: int) -> None:
            if reads <= 2 * LEAVING_READS:  # a bound for a mutant that reads on and on
                ctl.on_unit_changed(A, {**AT_GATE, "Job": (21, _job(21))})

        _meanwhile(bed, signal)
        _told_down(bed, A, 20, 21)
        await settle()
        await settle()
        assert _reads_of(bed, A) == LEAVING_READS
        assert ctl.tracker.leaving(A)
        assert not ctl.scheduler.is_waiting(A)

    run(test)


def test_a_waiter_told_down_at_its_gate_that_goes_down_meanwhile_is_read_no_more(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """A's stop kills its gate while the read of its job is on its way: its down told, its
    signals said all, and it is not read again."""
    bed = _a_behind_b(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = await _waits_at_its_gate(bed)

        _a_down_at_the_first_read(bed)
        _told_down(bed, A, 20, 21)
        await settle()
        assert _reads_of(bed, A) == 1
        assert not ctl.tracker.leaving(A)

    run(test)


def _two_behind_b(tmp_path: Path, cgroup_of: dict[int, str]) -> Bed:
    """B (50) holds the one GPU; A (60) and E (70) down, their gates' processes 4242 and
    4243."""
    cgroup_of[4242], cgroup_of[4243] = A, E
    return holding_a_gpu_each(
        tmp_path,
        {B: "Priority=50\n"},
        down={A: "Priority=60\n", E: "Priority=70\n"},
        config=bed_config(tmp_path, gpus=1),
    )


def test_waiters_told_down_at_their_gate_together_are_each_read(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """`systemctl stop a e` while both wait at their gate: both are read in one call. A's
    gate is killed while the read is on its way; E's stop was replaced by a start before it
    ran, its signals lost: the read shows it, and E waits again, granted once B is down.
    Left told down, E's gate waited for ever."""
    bed = _two_behind_b(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        for unit, job, pid in ((A, 20, 4242), (E, 30, 4243)):
            ctl.on_job_new(job, _job(job), unit)
            bed.systemd.units[unit] = state(unit, "activating", "start-pre", job, "start")
            ctl.on_unit_changed(unit, {**AT_GATE, "Job": (job, _job(job))})
            await bed.acquire(unit, f":1.{pid}", pid)
        assert ctl.scheduler.is_waiting(A) and ctl.scheduler.is_waiting(E)

        _a_down_at_the_first_read(bed)
        _told_down(bed, A, 20, 21)
        _told_down(bed, E, 30, 31)
        bed.systemd.units[E] = state(E, "activating", "start-pre", 32, "start")
        await settle()
        assert bed.systemd.calls.count(("units_state", f"{A},{E}")) == 1
        assert ctl.scheduler.is_waiting(E)
        assert not ctl.scheduler.is_waiting(A)
        goes_down(bed, B)
        await settle()
        assert ctl.scheduler.grants() == {E: frozenset({0})}

    run(test)


def test_a_waiter_told_down_at_its_gate_that_goes_down_waits_for_nothing(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """A's stop at its gate runs: its next signal shows it down (the one between, its gate
    being killed, lost or merged). A is down: it waits for no GPU, and none is granted to it
    once B is down."""
    bed = _a_behind_b(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = await _waits_at_its_gate(bed)
        _told_down(bed, A, 20, 21)
        await settle()
        assert ctl.tracker.leaving(A)
        bed.systemd.units[A] = state(A, "inactive", "dead")
        ctl.on_unit_changed(A, DOWN)
        await settle()
        assert not ctl.scheduler.is_waiting(A)
        goes_down(bed, B)
        await settle()
        assert ctl.scheduler.grants() == {}
        assert ctl.scheduler.phase(A) is None

    run(test)


def test_the_journal_says_once_that_a_waiter_whose_stop_a_start_replaced_waits_again(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """`systemctl stop a; systemctl start a` while A waits at its gate: its signal naming
    the stop says nothing of waiting again; the start's signal does, once, naming A."""
    bed = _a_behind_b(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = await _waits_at_its_gate(bed)
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            _told_down(bed, A, 20, 21)
            ctl.on_unit_changed(A, {**AT_GATE, "Job": (21, _job(21))})
            await settle()
            assert [m for m in messages(caplog) if "gate again" in m] == []
            ctl.on_job_removed(21, _job(21), A, "canceled")
            ctl.on_job_new(22, _job(22), A)
            bed.systemd.units[A] = state(A, "activating", "start-pre", 22, "start")
            ctl.on_unit_changed(A, {**AT_GATE, "Job": (22, _job(22))})
            await settle()
        assert ctl.scheduler.is_waiting(A)
        assert [m for m in messages(caplog) if "gate again" in m] == [WAITS_AGAIN]

    run(test)


def test_a_waiter_told_down_at_its_gate_during_a_rescan_is_not_taken_in_after_it(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waits at its gate; a rescan is under way when A's signal at its gate comes (held
    back for the scan: Rescans.hold_gate), then someone stops A there. Once the scan is
    applied, A, being stopped, is not taken in again: taken in, it waited on, preempting
    for a start being stopped."""
    bed = _a_behind_b(tmp_path, cgroup_of)
    held = HeldScan(monkeypatch)

    async def test() -> None:
        ctl = await _waits_at_its_gate(bed)
        await held.reloaded(bed)
        ctl.on_unit_changed(A, {**AT_GATE, "Job": (20, _job(20))})
        assert A in ctl.rescans.after_scan
        _told_down(bed, A, 20, 21)
        await settle()
        assert not ctl.scheduler.is_waiting(A)
        held.go.set()
        await until(lambda: ctl.rescans.task is None)
        await settle()
        assert not ctl.scheduler.is_waiting(A)
        assert ctl.tracker.leaving(A)

    run(test)


def test_a_job_announced_for_a_waiter_being_stopped_at_its_gate_announces_no_start(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A, told down at its gate, gets one more job (someone's, shown there as a stop): it
    is not announced as a start queued (Controller._announce_queued), which would have it
    wait for a GPU while its stop runs."""
    monkeypatch.setattr(controller_module, "QUEUED_DELAY", HOUR)  # ended by the test
    bed = _a_behind_b(tmp_path, cgroup_of)

    async def test() -> None:
        ctl: Controller = await _waits_at_its_gate(bed)
        _told_down(bed, A, 20, 21)
        await settle()
        assert ctl.tracker.leaving(A) and not ctl.scheduler.is_waiting(A)
        ctl.on_job_new(23, _job(23), A)
        bed.systemd.units[A] = state(A, "activating", "start-pre", 23, "stop")
        reads = len(bed.systemd.reads)
        await due_now(ctl._queued)
        assert bed.systemd.reads[reads:] == [A]  # its job read: someone's stop
        assert not ctl.scheduler.is_waiting(A)
        assert ctl.scheduler.phase(A) is None

    run(test)


@pytest.mark.parametrize("read", ["first-read", "at-audit"])
def test_a_waiter_whose_stop_is_cancelled_at_its_gate_unheard_waits_again_by_a_read(
    tmp_path: Path, cgroup_of: dict[int, str], read: str
) -> None:
    """`systemctl stop a; systemctl cancel` of that stop before it ran (waiting its turn
    behind another unit's stop), the signal that showed A at its gate with no job lost: its
    ExecStartPre= goes on, and the read (the first, or an audit's where the first still
    showed the stop) shows A at its gate with no job. A waits again (README: a cancel of
    the stop leaves it waiting), granted once B is down. Left told down, its gate was told
    to ask again, and again, for ever."""
    bed = _a_behind_b(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = await _waits_at_its_gate(bed)
        _told_down(bed, A, 20, 21)
        if read == "at-audit":
            await settle()
            assert ctl.tracker.leaving(A)
        ctl.on_job_removed(21, _job(21), A, "canceled")
        bed.systemd.units[A] = state(A, "activating", "start-pre")
        await settle()
        if read == "at-audit":
            await ctl.reads.audit()
            await settle()
        assert not ctl.tracker.leaving(A)
        assert ctl.scheduler.is_waiting(A)
        goes_down(bed, B)
        await settle()
        assert ctl.scheduler.grants() == {A: frozenset({0})}

    run(test)
