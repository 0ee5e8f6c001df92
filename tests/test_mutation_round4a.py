"""Start-up's signals while it reads the unit files, a shutdown heard before it is ready, the
kept-instances warning, and the audit of a shutdown: what mutation testing found untested.

Start-up subscribes, then reads the unit files, buffering systemd's JobNew and JobRemoved
meanwhile (`Controller._unscanned`); a shutdown heard before it is ready holds back its
first pass; past KEPT_INSTANCES_WARN instances kept held or preempted the journal says so,
once until the count falls back to the bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from gpuslice import controller as controller_module
from gpuslice import instances as instances_module
from gpuslice.annotations import Scan, scan
from gpuslice.controller import Controller
from gpuslice.core.scheduler import SavedState
from gpuslice.systemd import SystemdError
from gpuslice.tracker import UnitState
from tests import test_rereads
from tests.test_controller import (
    Bed,
    at_gate,
    bed_config,
    due_now,
    goes_down,
    run,
    settle,
    state,
    until,
    write_unit,
)
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import cgroup_of as cgroup_of  # a fixture

JOB = "/org/freedesktop/systemd1/job/7"
DOWN = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
EMBED = {"a.service": "Priority=50\n", "embed@.service": "Priority=90\nType=background\n"}


def p_preempted(tmp_path: Path) -> Bed:
    """p.service was preempted; its GPU is free: start-up's first pass brings it back."""
    return Bed(
        tmp_path, {"p.service": "Priority=60\n"}, [], SavedState(preempted={"p.service": 1}, seq=1)
    )


def signalled_while_reading(
    ctl: Controller, monkeypatch: pytest.MonkeyPatch, cancelled: bool
) -> asyncio.Event:
    """reboot.target's job is announced (and cancelled, `systemctl cancel`) while start-up,
    subscribed, reads the unit files."""
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()

    def reading(root: str) -> Scan:
        loop.call_soon_threadsafe(ctl.on_job_new, 7, JOB, "reboot.target")
        if cancelled:
            loop.call_soon_threadsafe(ctl.on_job_removed, 7, JOB, "reboot.target", "canceled")
        loop.call_soon_threadsafe(signalled.set)
        time.sleep(0.05)
        return scan(root)

    monkeypatch.setattr(controller_module, "scan", reading)
    return signalled


def test_a_shutdown_cancelled_while_start_up_reads_the_unit_files_holds_nothing_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both the JobNew and the JobRemoved (cancelled) of reboot.target come while start-up
    reads the unit files: taken in once it has, in order, each with its own job, unit and
    result, the host is not going down and p.service comes back at start-up."""
    bed = p_preempted(tmp_path)

    async def test() -> None:
        ctl = bed.controller
        signalled = signalled_while_reading(ctl, monkeypatch, cancelled=True)
        await ctl.start()
        await settle()
        assert signalled.is_set()
        assert not ctl.tracker.shutting_down and not ctl.scheduler.shutting_down
        assert ("start", "p.service") in bed.systemd.calls

    run(test)


def test_a_shutdown_announced_while_start_up_reads_the_unit_files_holds_back_its_first_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reboot.target's JobNew comes while start-up reads the unit files: its first pass
    starts nothing (systemd refuses every start while the host goes down, and p.service's
    comeback would have been taken for failed); its cancel brings p.service back."""
    bed = p_preempted(tmp_path)

    async def test() -> None:
        ctl = bed.controller
        signalled_while_reading(ctl, monkeypatch, cancelled=False)
        await ctl.start()
        await settle()
        assert ctl.scheduler.shutting_down is True
        assert ("start", "p.service") not in bed.systemd.calls
        ctl.on_job_removed(7, JOB, "reboot.target", "canceled")
        await settle()
        assert bed.systemd.calls[-1] == ("start", "p.service")

    run(test)


def test_an_unannotated_instance_announced_during_start_up_is_not_matched(
    tmp_path: Path,
) -> None:
    """getty@tty1.service's start job is announced after ListUnits, before start-up is done:
    no template of it is annotated, so its signals are not matched once start-up narrows the
    rules to the units that matter (a plain unit's are matched as annotated, not as an
    instance)."""
    bed = Bed(tmp_path, {"job@.service": "Priority=50\n", "a.service": "Priority=50\n"}, [])
    ctl = bed.controller
    list_units = bed.systemd.list_units

    async def announced_after_listing() -> list[UnitState]:
        units = await list_units()
        ctl.on_job_new(7, JOB, "getty@tty1.service")
        ctl.on_job_new(8, "/org/freedesktop/systemd1/job/8", "a.service")
        return units

    bed.systemd.list_units = announced_after_listing  # type: ignore[method-assign]

    async def test() -> None:
        await ctl.start()
        await settle()
        assert bed.systemd.watched == {"a.service"}

    run(test)


def test_a_start_of_ours_lost_is_sent_again_beside_a_requeue_whose_wait_ended_away(
    tmp_path: Path,
) -> None:
    """bg.service's start (ours) never reached systemd, and p.service's wait at its gate
    ended while no controller ran: start-up sends bg.service's start again, and p.service's
    comeback stays owed; neither decision drops the other."""
    bed = Bed(
        tmp_path,
        {"bg.service": "Priority=90\nType=background\n", "p.service": "Priority=50\n"},
        [state("bg.service", "inactive", "dead"), state("p.service", "failed", "failed")],
        SavedState(
            holders={"bg.service": ((0,), "starting", 1, "")},
            started=["bg.service"],
            requeued=["p.service"],
            seq=2,
        ),
        config=bed_config(tmp_path, gpus=2, requeue_at_gate=True),
    )

    async def test() -> None:
        await bed.controller.start()
        await settle()
        assert ("start", "bg.service") in bed.systemd.calls
        assert bed.controller.scheduler.snapshot().failed == []

    run(test)


def test_a_start_listed_at_its_gate_during_a_reload_is_sent_to_the_bus_not_held(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """urgent.service is listed at its gate (a read: no InvocationID names that start) and a
    daemon-reload ends during ListUnits: judged once the rescan is read, its gate, as any
    start shown at its gate by a read alone, is sent to the bus unless a signal names the
    start within GATE_UNSEEN_DELAY; its pipe is not held for a start it cannot name."""
    urgent = "urgent.service"
    bed = Bed(
        tmp_path,
        {"low.service": "Priority=90\n", urgent: "Priority=10\n"},
        [
            state("low.service", "active", "running"),
            state(urgent, "activating", "start-pre", 7, "start"),
        ],
        SavedState(holders={"low.service": ((0,), "running", 1, "")}, seq=1),
    )
    ctl = bed.controller
    list_units = bed.systemd.list_units

    async def reloaded_while_listing() -> list[UnitState]:
        units = await list_units()
        write_unit(tmp_path, urgent, "Priority=95\n")
        ctl.on_reloading(False)
        return units

    bed.systemd.list_units = reloaded_while_listing  # type: ignore[method-assign]

    async def test() -> None:
        await ctl.start()
        await until(lambda: ctl.rescans.task is None)
        await settle()
        assert ctl.scheduler.is_waiting(urgent)
        assert not ctl.gates.holds(urgent)
        assert await due_now(Controller._gate_unseen) == 1

    run(test)


# -- KEPT_INSTANCES_WARN ----------------------------------------------------------------------

KEPT_WORDS = (
    "{} instances are kept held or preempted (more than 3): gpuslice forgets a held one only "
    "once it is started again and has ended, a preempted one once it is back; each is saved "
    "in the state file, which is refused whole past 16 MiB"
)


def kept(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "kept held or preempted" in r.message]


@pytest.mark.parametrize(
    ("held", "preempted", "said"),
    [
        ([f"embed@{i}.service" for i in range(4)], [], [KEPT_WORDS.format(4)]),
        ([], [f"embed@{i}.service" for i in range(4)], [KEPT_WORDS.format(4)]),
        (["embed@0.service", "embed@1.service"], ["embed@2.service"], []),
        # four kept, but only three of them instances: the bound is not passed
        ([f"embed@{i}.service" for i in range(3)] + ["b.service"], [], []),
    ],
)
def test_instances_kept_at_start_up_past_the_bound_are_said_once(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    held: list[str],
    preempted: list[str],
    said: list[str],
) -> None:
    """The state names instances held (an admin's stop) or preempted, down: start-up, which
    forgets each instance down that is owed nothing, keeps them, and past the bound says how
    many, with the state file's limit, once. a.service holds the one GPU, so none comes back."""
    monkeypatch.setattr(instances_module, "KEPT_INSTANCES_WARN", 3)
    bed = Bed(
        tmp_path,
        {**EMBED, "b.service": "Priority=90\nType=background\n"},
        [state("a.service", "active", "running")],
        SavedState(
            holders={"a.service": ((0,), "running", 1, "")},
            held=held,
            preempted={name: 1 for name in preempted},
            seq=1,
        ),
    )

    async def test() -> None:
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            await bed.controller.start()
            await settle()
        assert sorted(bed.controller.scheduler.held) == sorted(held)
        assert sorted(bed.controller.scheduler.preempted) == sorted(preempted)

    run(test)
    assert kept(caplog) == said


def test_kept_instances_are_said_again_once_they_fell_back_to_the_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four held instances are said at start-up; embed@0 is started again (three kept, told
    by a late signal of embed@1), then stopped by hand again: four, said again."""
    monkeypatch.setattr(instances_module, "KEPT_INSTANCES_WARN", 3)
    bed = Bed(tmp_path, EMBED, [], SavedState(held=[f"embed@{i}.service" for i in range(4)], seq=1))
    name = "embed@0.service"

    async def test() -> None:
        ctl = bed.controller
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            await ctl.start()
            await settle()
            assert kept(caplog) == [KEPT_WORDS.format(4)]
            ctl.on_job_new(20, "/org/freedesktop/systemd1/job/20", name)
            ctl.on_unit_changed(name, at_gate())
            await settle()
            assert len(ctl.scheduler.held) == 3
            ctl.on_unit_changed("embed@1.service", DOWN)  # a late signal: still kept
            ctl.on_job_new(21, "/org/freedesktop/systemd1/job/21", name)
            ctl.on_unit_changed(name, {"ActiveState": "deactivating", "SubState": "stop"})
            goes_down(bed, name)
            await settle()
            assert len(ctl.scheduler.held) == 4
        assert kept(caplog) == [KEPT_WORDS.format(4)] * 2

    run(test)


# -- Rereads.audit_shutdown -------------------------------------------------------------------


def test_an_audit_that_cannot_ask_whether_the_host_goes_down_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = SystemdError("org.freedesktop.DBus.Error.NoReply", "no reply")

    async def test(bed: test_rereads.Bed) -> None:
        bed.tracker.job_new(test_rereads.SHUTDOWN_JOB, "reboot.target")
        bed.systemd.system = error
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            await bed.reads.audit()
        assert bed.tracker.shutting_down

    test_rereads.run(test)
    said = [r.getMessage() for r in caplog.records if "going down" in r.getMessage()]
    assert said == [f"cannot ask whether the host is going down: {error}"]
