"""The SystemState reads that follow a hold, the tracker's shutdown stamps, the cap on kept
preemptions and the end of a holder found failed at start-up: what mutation testing found
untested in gpuslice/rereads.py, tracker.py and controller.py.

A unit held (someone's stop) is followed by one read of systemd's SystemState at a time
(`Rereads.hold_booked`); whether its answer is believed rests on the tracker's stamps of
shutdown jobs heard (`shutdown_jobs_heard`) and shutdown.target queued (`shutdown_queued`).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from gpuslice import instances as instances_module
from gpuslice.controller import Controller
from gpuslice.core.scheduler import SavedState
from gpuslice.state import StateStore
from gpuslice.systemd import SystemdError
from gpuslice.tracker import Ledger, Tracker
from tests import test_rereads
from tests.test_controller import BOOT, Bed, bed_config, messages, run, settle, state
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_rereads import SHUTDOWN_JOB, UNIT, turns

DEAD = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
BG = "Priority=90\nType=background\n"


def _stopped_by_someone(bed: Bed, unit: str, job_id: int) -> None:
    """A stop job of someone's (or of a shutdown whose JobNew the bus lost) takes `unit`
    down."""
    ctl = bed.controller
    job = f"/org/freedesktop/systemd1/job/{job_id}"
    ctl.on_job_new(job_id, job, unit)
    ctl.on_unit_changed(
        unit, {"ActiveState": "deactivating", "SubState": "stop-sigterm", "Job": (job_id, job)}
    )
    ctl.on_job_removed(job_id, job, unit, "done")
    bed.systemd.units[unit] = state(unit, "inactive", "dead")
    ctl.on_unit_changed(unit, DEAD)


# -- the tracker's stamps ---------------------------------------------------------------------


def test_a_shutdown_read_after_a_cancel_disbelieves_an_older_read_of_the_host_running() -> None:
    """An audit's SystemState read goes out while a reboot is pending; the reboot is
    cancelled, then a hold's read says `stopping` (another shutdown, its JobNew lost:
    `shutdown_read`). The audit's answer `running`, sent before that, is not believed: the
    host stays taken to go down. Had the stamp gone back to the audit's (reset, or counted
    down), nothing would be held back while the host went down."""
    tracker = Tracker(lambda _: True, Ledger(lambda _: None, lambda _: False))
    tracker.job_new(SHUTDOWN_JOB, "shutdown.target")
    audit_sent = tracker.shutdown_jobs_heard()
    tracker.job_removed(SHUTDOWN_JOB, "shutdown.target", "canceled")
    assert not tracker.shutting_down
    tracker.shutdown_read()
    assert not tracker.shutdown_unheard(audit_sent)
    assert tracker.shutting_down


def test_a_hold_before_a_second_reboot_stands_when_shutdown_target_is_queued_anew() -> None:
    """A reboot, cancelled; someone stops a unit, and its SystemState read goes out; then
    the host is rebooted again: shutdown.target's JobNew is heard (its second), and the
    answer says `stopping`. The stop came before that shutdown: the hold stands. Counted as
    the first JobNew again, the stamp had not moved, and the hold was taken for the
    shutdown's (not kept across the reboot)."""

    async def test(bed: test_rereads.Bed) -> None:
        tracker = bed.tracker
        tracker.job_new(SHUTDOWN_JOB, "shutdown.target")
        tracker.job_removed(SHUTDOWN_JOB, "shutdown.target", "canceled")
        assert not tracker.shutting_down

        def second_reboot() -> None:
            tracker.job_new("/org/freedesktop/systemd1/job/10", "reboot.target")
            tracker.job_new("/org/freedesktop/systemd1/job/11", "shutdown.target")

        bed.systemd.system = "stopping"
        bed.systemd.before_system = second_reboot
        bed.reads.hold_booked(UNIT)
        await turns(0)
        assert bed.holds == [([UNIT], False)]

    test_rereads.run(test)


# -- the SystemState reads that follow holds --------------------------------------------------


def test_holds_booked_while_a_read_is_out_wait_for_it_and_share_the_next() -> None:
    """One SystemState read at a time: units held while one is out wait for its answer and
    are then asked together, in one more read. A read each, a flood of holds (anyone may
    stop their own units in a loop) would be a flood of calls to systemd."""

    async def test(bed: test_rereads.Bed) -> None:
        calls = 0
        answer = asyncio.Event()

        async def system_state() -> str:
            nonlocal calls
            calls += 1
            await answer.wait()
            return "running"

        bed.systemd.system_state = system_state  # type: ignore[method-assign]
        bed.reads.hold_booked(UNIT)
        await turns(0)
        bed.reads.hold_booked("b.service")
        await turns(0)
        bed.reads.hold_booked("c.service")
        await turns(0)
        assert calls == 1
        answer.set()
        await turns(0)
        assert calls == 2
        assert bed.holds == [([UNIT], False), (["b.service", "c.service"], False)]

    test_rereads.run(test)


def test_a_failed_hold_read_is_logged_with_its_error(caplog: pytest.LogCaptureFixture) -> None:
    """A SystemState read that fails is counted, and said (debug) with systemd's error."""

    async def test(bed: test_rereads.Bed) -> None:
        bed.systemd.system = SystemdError("org.freedesktop.DBus.Error.NoReply", "no reply")
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            bed.reads.hold_booked(UNIT)
            await turns(0)
        assert bed.counters.errors["dbus_call_errors"] == 1

    test_rereads.run(test)
    assert messages(caplog) == [
        "cannot ask whether the host is going down: org.freedesktop.DBus.Error.NoReply: no reply"
    ]


def test_units_freed_by_one_hold_read_are_named_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The bus lost the shutdown's JobNew, and its stops of a.service and b.service looked
    like someone's; one SystemState read says `stopping`: one warning names both, as a
    list."""
    units = {"a.service": BG, "b.service": BG}
    saved = SavedState(
        holders={"a.service": ((0,), "running", 1, ""), "b.service": ((1,), "running", 2, "")},
        seq=2,
    )
    bed = Bed(
        tmp_path,
        units,
        [state(u, "active", "running") for u in units],
        saved,
        config=bed_config(tmp_path, gpus=2),
    )
    bed.systemd.system = "stopping"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        _stopped_by_someone(bed, "a.service", 1)
        _stopped_by_someone(bed, "b.service", 2)
        await settle()
        assert [c for c in bed.systemd.calls if c[0] == "system-state"] == [("system-state", "")]
        assert ctl.scheduler.save().held == []

    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        run(test)
    assert [m for m in messages(caplog) if "not held" in m] == [
        "systemd says the host is going down, which no signal told (lost on the bus): "
        "a.service, b.service stopped with the shutdown, not held"
    ]


def test_units_freed_by_one_hold_read_are_named_up_to_a_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same, for ten units: the line names the first LISTED_MAX (8) and how many more.
    Named whole, a shutdown of thousands of instances wrote one line of unbounded size."""
    units = {f"u{i}.service": BG for i in range(10)}
    saved = SavedState(
        holders={f"u{i}.service": ((i,), "running", i + 1, "") for i in range(10)},
        seq=10,
    )
    bed = Bed(
        tmp_path,
        units,
        [state(u, "active", "running") for u in units],
        saved,
        config=bed_config(tmp_path, gpus=10),
    )
    bed.systemd.system = "stopping"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        for i in range(10):
            _stopped_by_someone(bed, f"u{i}.service", i + 1)
        await settle()
        assert ctl.scheduler.save().held == []

    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        run(test)
    assert [m for m in messages(caplog) if "not held" in m] == [
        "systemd says the host is going down, which no signal told (lost on the bus): "
        + ", ".join(f"u{i}.service" for i in range(8))
        + " and 2 more stopped with the shutdown, not held"
    ]


# -- the cap on kept preemptions --------------------------------------------------------------


def two_preempted_instances(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Bed:
    """embed@0 and embed@1 (background) preempted for a.service, shown down, with
    PREEMPTED_INSTANCES_MAX 2: both kept at start-up."""
    monkeypatch.setattr(instances_module, "PREEMPTED_INSTANCES_MAX", 2)
    embed = {"a.service": "Priority=50\n", "embed@.service": BG}
    names = [f"embed@{i}.service" for i in range(2)]
    saved = SavedState(
        holders={"a.service": ((0,), "running", 3, "")},
        preempted={n: i + 1 for i, n in enumerate(names)},
        seq=3,
    )
    shown = [state("a.service", "active", "running")] + [
        state(n, "inactive", "dead") for n in names
    ]
    bed = Bed(tmp_path, embed, shown, saved)
    return bed


def test_an_instance_dropped_past_the_bound_while_running_is_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance kept goes down and the preempted instances pass the bound: the one
    dropped is forgotten by the core and the tracker at once, as any instance owed
    nothing (kept, each dropped instance stayed in memory, in the state file's specs and
    watched)."""
    bed = two_preempted_instances(tmp_path, monkeypatch)
    names = [f"embed@{i}.service" for i in range(2)]

    async def test() -> None:
        ctl: Controller = bed.controller
        await ctl.start()
        await settle()
        assert set(names) <= set(ctl.scheduler.annotated())
        monkeypatch.setattr(instances_module, "PREEMPTED_INSTANCES_MAX", 1)
        ctl.on_unit_changed("embed@0.service", DEAD)  # an instance kept goes down (again)
        await settle()
        assert set(ctl.scheduler.preempted) == {"embed@0.service"}
        assert "embed@1.service" not in ctl.scheduler.annotated()
        assert "embed@1.service" not in ctl.tracker.states

    run(test)


def test_an_instance_dropped_past_the_bound_with_a_call_unanswered_goes_at_the_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same, while a call of ours on the instance dropped is unanswered: its forget waits
    for the answer, and goes then. Kept until its next down, it stayed known, dormant, for
    as long as the controller ran: an instance's name is one job, which may never come
    again."""
    bed = two_preempted_instances(tmp_path, monkeypatch)

    async def test() -> None:
        ctl: Controller = bed.controller
        await ctl.start()
        await settle()
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        ctl.calls.send(lambda unit, queued: answer, "embed@1.service", "stop")
        monkeypatch.setattr(instances_module, "PREEMPTED_INSTANCES_MAX", 1)
        ctl.on_unit_changed("embed@0.service", DEAD)  # an instance kept goes down (again)
        await settle()
        assert set(ctl.scheduler.preempted) == {"embed@0.service"}
        assert "embed@1.service" in ctl.scheduler.dormant  # kept for the answer
        answer.set_exception(SystemdError("org.freedesktop.systemd1.NoSuchUnit", "gone"))
        await settle()
        assert "embed@1.service" not in ctl.scheduler.annotated()
        assert "embed@1.service" not in ctl.tracker.states

    run(test)


# -- holders found down at start-up -----------------------------------------------------------


def test_a_frozen_holder_found_failed_has_no_main_process_record_read(tmp_path: Path) -> None:
    """A holder the last controller froze is found failed, and the journal cannot tell
    whether a stop job ended it: systemd's record of its main process could not tell either
    (`stopped_by_a_job` holds only for an inactive unit), so it is not read: no call to
    systemd, and no warning should that call fail."""
    config = bed_config(tmp_path)
    saved = SavedState(holders={"bg.service": ((0,), "frozen", 1, "")}, seq=1)
    StateStore(Path(config.state_dir)).save(saved, BOOT)
    bed = Bed(
        tmp_path, {"bg.service": BG}, [state("bg.service", "failed", "failed")], config=config
    )
    bed.systemd.main_exits["bg.service"] = SystemdError(
        "org.freedesktop.DBus.Error.NoReply", "no reply"
    )

    async def test() -> None:
        await bed.controller.start()
        await settle()
        assert bed.systemd.exit_reads == []
        assert bed.controller.counters.errors["dbus_call_errors"] == 0

    run(test)


def test_an_instance_started_again_while_its_hold_is_read_is_not_forgotten(
    tmp_path: Path,
) -> None:
    """Someone stops an instance (a hold, its SystemState read out), then starts it again:
    its start job is queued when the answer `running` comes. Not down, it is kept with what
    is known of it, its start job among that; forgotten, the tracker lost the job someone
    queued, and took the unit for down with none."""
    bed = Bed(
        tmp_path,
        {"job@.service": "Priority=50\n"},
        [state("job@1.service", "active", "running")],
        SavedState(holders={"job@1.service": ((0,), "running", 1, "")}, seq=1),
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        _stopped_by_someone(bed, "job@1.service", 1)
        job = "/org/freedesktop/systemd1/job/2"
        ctl.on_job_new(2, job, "job@1.service")
        ctl.on_unit_changed("job@1.service", {"Job": (2, job)})
        await settle()
        assert ("system-state", "") in bed.systemd.calls
        assert "job@1.service" in ctl.scheduler.annotated()
        assert ctl.tracker.state("job@1.service").job_id == 2

    run(test)
