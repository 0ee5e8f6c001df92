"""A stop whose answer was lost, and a gate a daemon-reload took out, under mutation.

Mutation testing of `Calls._stop_again`, `Gates._pass_gate` and `_restart_ungated`,
and of `Tracker.stop_found`, left rules no test held: a stop job a read shows is booked as
ours (its unit down at once with it shown, its end a preemption), whatever the books held;
the controller's view takes the state read, sub-state and all; a retry no longer wanted is
forgotten, its read's mark too; the journal's words when the read fails; a list that
cannot be read lets the gate through; a gate annotated again while its list is read asks
again; the restart's decision goes to the unit's journal with its fields.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import pytest

from gpuslice.core.scheduler import Outcome, Phase
from gpuslice.journal import Journal
from gpuslice.systemd import SystemdError
from gpuslice.tracker import UnitState, WentDown
from tests.test_controller import (
    HOUR,
    NO_REPLY,
    low_holds_gpu_0,
    messages,
    run,
    settle,
    state,
    until,
    write_unit,
)
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_controller_calls import (
    JOB,
    FakeJournal,
    errors,
    held_reads,
    lost_stop,
    retry_fires,
    stops,
    urgent_asks,
)
from tests.test_controller_unannotated import RESTARTED, TOUCH, URGENT, waits_then_unannotated
from tests.test_tracker import JOB1, A, Model, our_stop_sent, props_of

LOW = "low.service"
KEY = (LOW, "stop")

# ---- Tracker.stop_found ----


def test_a_stop_job_found_is_ours_its_unit_down_at_once_while_it_still_shows_it() -> None:
    """The stop job a read shows after our StopUnit got no answer is booked as our stop:
    the unit shown down with it still its job is down at once (its GPUs go then), as with
    any stop of ours whose answer came."""
    tracker = our_stop_sent()
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.call_answered(A, None, "stop")
    assert tracker.stop_found(A, JOB1) is True
    assert tracker.unit_changed(A, props_of("inactive", "dead", 1)) == [WentDown(A, Outcome.EXITED)]


def test_a_stop_job_found_with_no_unanswered_stop_on_record_is_ours() -> None:
    """Nothing on record of when our unanswered stop was sent: no job was announced before
    it, and the one found is ours (never a crash of the root daemon)."""
    model = Model()
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    assert tracker.stop_found(A, JOB1) is True
    assert tracker.stopped_by_others(A) is False


def test_a_stop_job_found_unannounced_at_a_gate_is_one_since_that_gate() -> None:
    """Our stop's JobNew lost too, the job found is stamped now: after the unit's gate, so a
    start through that gate still counts it as a job since the gate, ours."""
    model = Model()
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    tracker.unit_changed(A, props_of("activating", "start-pre", 76))
    tracker.call_sent(A)
    tracker.call_answered(A, None, "stop")
    assert tracker.stop_found(A, JOB1) is True
    tracker.job_removed(JOB1, A, "canceled")
    tracker.passed_gate(A)
    assert tracker.stopped_by_others(A) is False


# ---- Calls._stop_again ----


def test_a_stop_job_found_is_taken_in_with_the_state_read(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read that finds our stop's job is taken in whole: the controller's view of
    low.service is deactivating (stop-sigterm), job 77, not its sub-state of before; and the
    read leaves no mark of itself."""
    bed = lost_stop(tmp_path, cgroup_of, monkeypatch, retry_max=4 * HOUR)
    job = f"{JOB}77"

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        bed.systemd.units[LOW] = state(LOW, "deactivating", "stop-sigterm", 77, "stop")
        ctl.on_job_new(77, job, LOW)
        await settle()
        retry_fires(bed, "stop")
        await settle()
        assert stops(bed) == 1
        shown = ctl.tracker.state(LOW)
        assert (shown.active, shown.sub, shown.job_id) == ("deactivating", "stop-sigterm", 77)
        assert ctl.calls._stop_reads == set()

    run(test)


def test_a_stop_no_longer_unsent_when_its_read_comes_back_is_forgotten(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While the read before a stop is sent again is out, the stop job's signals come after
    all: the read is moot, and the retry is forgotten (its delay too: the next lost stop
    starts again from CALL_RETRY_FIRST), quietly."""
    bed = lost_stop(tmp_path, cgroup_of, monkeypatch, retry_max=4 * HOUR)
    job = f"{JOB}77"
    read = held_reads(bed, monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        assert ctl.calls._retry_delays == {KEY: HOUR}
        retry_fires(bed, "stop")
        await settle()
        ctl.on_job_new(77, job, LOW)
        stopping = {"ActiveState": "deactivating", "SubState": "stop-sigterm", "Job": (77, job)}
        ctl.on_unit_changed(LOW, stopping)
        bed.systemd.units[LOW] = state(LOW, "deactivating", "stop-sigterm", 77, "stop")
        read.set()
        await settle()
        assert stops(bed) == 1
        assert ctl.calls._retry_timers == {} and ctl.calls._retry_delays == {}
        assert ctl.calls._stop_reads == set()

    run(test)
    assert errors(caplog) == []


def test_a_stop_whose_read_fails_says_when_it_is_read_again(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The read before a lost stop is sent again fails too: the journal's DEBUG line says
    so, with the unit and the doubled delay."""
    bed = lost_stop(tmp_path, cgroup_of, monkeypatch, retry_max=4 * HOUR)

    async def read(name: str) -> UnitState:
        raise NO_REPLY

    monkeypatch.setattr(bed.systemd, "unit_state", read)
    caplog.set_level(logging.DEBUG, "gpuslice")

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        retry_fires(bed, "stop")
        await settle()
        assert stops(bed) == 1 and ctl.calls._retry_delays == {KEY: 2 * HOUR}
        assert ctl.calls._stop_reads == set()

    run(test)
    assert (
        "cannot tell whether stopping low.service reached systemd; read again in 7200 s"
    ) in messages(caplog)


# ---- Gates._pass_gate, _restart_ungated ----


def test_a_list_that_cannot_be_read_lets_the_gate_through_and_says_why(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """systemd refuses to say the ExecStartPre= of urgent.service (not a call lost on the
    way): the gate is let through as before, and a DEBUG line says why."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    bed.systemd.exec_start_pres[URGENT] = SystemdError(
        "org.freedesktop.DBus.Error.AccessDenied", "denied"
    )
    caplog.set_level(logging.DEBUG, "gpuslice")

    async def test() -> None:
        await waits_then_unannotated(bed, tmp_path)
        await until(lambda: bed.service.granted != [])
        assert bed.service.granted == [(URGENT, "")]
        assert ("restart", URGENT) not in bed.systemd.calls
        assert not bed.controller.judge._passing

    run(test)
    assert (
        "cannot read the ExecStartPre= of urgent.service: "
        "org.freedesktop.DBus.Error.AccessDenied: denied"
    ) in messages(caplog)


def test_a_gate_annotated_again_while_its_list_is_read_asks_again(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """A daemon-reload puts urgent.service's annotation back while its ExecStartPre= is
    read: neither let through nor restarted; its gate asks again, judged as annotated."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    bed.systemd.exec_start_pres[URGENT] = [TOUCH]
    read = bed.systemd.exec_start_pre

    async def annotated_while_read(name: str) -> list[tuple[str, list[str]]]:
        commands = await read(name)
        write_unit(tmp_path, URGENT, "Priority=10\n")
        bed.controller.rescans.request()
        await until(lambda: bed.controller.spec_for(URGENT) is not None)
        return commands

    bed.systemd.exec_start_pre = annotated_while_read  # type: ignore[method-assign]

    async def test() -> None:
        await waits_then_unannotated(bed, tmp_path)
        await until(lambda: ("exec_start_pre", URGENT) in bed.systemd.calls)
        await until(lambda: not bed.controller.judge._passing)
        await settle()
        assert bed.service.granted == []
        assert bed.service.sent_back == [URGENT]
        assert ("restart", URGENT) not in bed.systemd.calls

    run(test)


def test_a_restart_of_a_gate_a_reload_took_out_is_in_the_units_journal(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The restart is a decision of its own: an entry the unit's journal shows, coded
    unmanaged, its cause start-restarted, at INFO."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    bed.systemd.exec_start_pres[URGENT] = [TOUCH]
    journal = FakeJournal()
    bed.controller.journal = cast(Journal, journal)
    caplog.set_level(logging.INFO, "gpuslice")

    async def test() -> None:
        await waits_then_unannotated(bed, tmp_path)
        await until(lambda: ("restart", URGENT) in bed.systemd.calls)
        await settle()

    run(test)
    [entry] = [e for e in journal.of(URGENT, "unmanaged") if e["MESSAGE"] == RESTARTED]
    assert entry["GPUSLICE_CAUSE"] == "start-restarted"
    assert entry["PRIORITY"] == "6"
