"""A unit stopped by hand while no controller ran (gpuslice.service restarting, failed, or
stopped for an upgrade): found down at start-up with no job, how it ended is read from
systemd's record of its main process (Restore.stopped_while_away), on the fakes of
tests/test_controller.py.

README: "A unit you stop by hand (`systemctl stop`) is held [...] across controller
restarts and reboots". Taken for finished, such a unit was started again by the first refill
after the next reboot (finished is forgotten at a reboot, held is not).
"""

from __future__ import annotations

import logging
from pathlib import Path
from signal import SIGKILL, SIGTERM

import pytest

from gpuslice.core.scheduler import SavedState
from gpuslice.state import StateStore
from gpuslice.systemd import SystemdError
from gpuslice.tracker import CLD_DUMPED, CLD_EXITED, CLD_KILLED, MainExit, UnitState
from tests.test_controller import BOOT, Bed, bed_config, run, settle, state

BG = {"bg.service": "Priority=50\nType=background\n"}
KILLED = MainExit(CLD_KILLED, SIGTERM, "success")


def _saved(phase: str) -> SavedState:
    return SavedState(holders={"bg.service": ((0,), phase, 1, "")}, seq=1)


def _bed(tmp_path: Path, phase: str, states: list[UnitState] | None = None) -> Bed:
    """bg.service held GPU 0 in `phase` when the last controller of this boot saved; systemd
    shows it down with no job (or `states`)."""
    config = bed_config(tmp_path)
    StateStore(Path(config.state_dir)).save(_saved(phase), BOOT)
    down = [state("bg.service", "inactive", "dead")] if states is None else states
    return Bed(tmp_path, BG, down, config=config)


def _started(bed: Bed) -> list[str]:
    return [unit for what, unit in bed.systemd.calls if what == "start"]


async def _rebooted(tmp_path: Path, bed: Bed) -> Bed:
    """The host reboots: the state file the controller of `bed` saved is of the last boot,
    systemd shows bg.service down, and a controller starts."""
    bed.controller.save_now()
    store = StateStore(Path(bed.config.state_dir))
    kept, _ = store.load()
    store.save(kept, "boot-0")
    again = Bed(tmp_path, BG, [state("bg.service", "inactive", "dead")], config=bed.config)
    await again.controller.start()
    await settle()
    return again


@pytest.mark.parametrize(
    ("phase", "main"),
    [
        ("running", KILLED),
        ("running", MainExit(CLD_KILLED, SIGKILL, "success")),  # KillSignal=SIGKILL
        ("running", MainExit(CLD_DUMPED, 3, "success")),  # SIGQUIT, SuccessExitStatus=SIGQUIT
        ("starting", KILLED),  # it ran before the last controller saw it past its gate
        ("frozen", KILLED),  # systemd thaws a frozen unit to stop it
    ],
    ids=["running", "sigkill", "dumped", "starting", "frozen"],
)
def test_a_holder_killed_by_a_signal_while_no_controller_ran_is_held_after_a_reboot_too(
    tmp_path: Path, phase: str, main: MainExit
) -> None:
    """Its main process died of a signal and systemd left it inactive, Result=success: a stop
    job ended it (a signal outside one fails the unit). Held: not started at this start nor
    by the refill after the next boot. Its record is read once, and for it alone."""
    bed = _bed(tmp_path, phase)
    bed.systemd.main_exits["bg.service"] = main

    async def test() -> None:
        await bed.controller.start()
        await settle()
        snap = bed.controller.scheduler.snapshot()
        assert (snap.held, snap.finished) == (["bg.service"], [])
        assert bed.systemd.exit_reads == ["bg.service"]
        assert _started(bed) == []
        again = await _rebooted(tmp_path, bed)
        assert again.controller.scheduler.snapshot().held == ["bg.service"]
        assert _started(again) == []
        assert again.systemd.exit_reads == []  # the last boot's holders are not read

    run(test)


@pytest.mark.parametrize(
    "main",
    [
        MainExit(CLD_EXITED, 0, "success"),  # ended by itself, or trapped SIGTERM and exited 0
        MainExit(0, 0, "success"),  # no record: systemd loaded it anew
        MainExit(CLD_KILLED, SIGTERM, "exit-code"),  # not as systemd leaves an inactive unit
    ],
    ids=["exited", "no-record", "not-success"],
)
def test_a_holder_that_exited_while_no_controller_ran_is_finished_as_before(
    tmp_path: Path, main: MainExit
) -> None:
    """Its main process exited with a code (or systemd keeps no word of a signal): finished,
    as a unit that ended by itself; the refill after the next boot starts it again."""
    bed = _bed(tmp_path, "running")
    bed.systemd.main_exits["bg.service"] = main

    async def test() -> None:
        await bed.controller.start()
        await settle()
        snap = bed.controller.scheduler.snapshot()
        assert (snap.held, snap.finished) == ([], ["bg.service"])
        assert _started(bed) == []
        again = await _rebooted(tmp_path, bed)
        assert _started(again) == ["bg.service"]

    run(test)


def test_a_read_of_its_record_that_fails_leaves_it_finished_and_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The read fails (an error of the bus, a reply of the wrong form): the unit is taken as
    before, for finished, the journal says why, and the error is counted; start-up goes on."""
    bed = _bed(tmp_path, "running")
    bed.systemd.main_exits["bg.service"] = SystemdError(
        "org.freedesktop.DBus.Error.NoReply", "no reply"
    )

    async def test() -> None:
        ctl = bed.controller
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            await ctl.start()
            await settle()
        snap = ctl.scheduler.snapshot()
        assert (snap.held, snap.finished) == ([], ["bg.service"])
        assert ctl.ready
        assert ctl.counters.to_json([])["dbus_call_errors"] == 1

    run(test)
    assert (
        "cannot read how the main process of bg.service ended (no reply): taken for ended by itself"
    ) in [r.getMessage() for r in caplog.records]


def test_a_unit_gpuslice_was_stopping_is_preempted_however_its_main_process_ended(
    tmp_path: Path,
) -> None:
    """The last controller had sent its stop (saved stopping) and died: the unit found down is
    preempted, as before ("Two cases still count as preempted"), and brought back on the
    GPU now free; its record, killed like any stopped unit, is not read."""
    bed = _bed(tmp_path, "stopping")
    bed.systemd.main_exits["bg.service"] = KILLED

    async def test() -> None:
        await bed.controller.start()
        await settle()
        snap = bed.controller.scheduler.snapshot()
        assert (snap.held, snap.finished) == ([], [])
        assert _started(bed) == ["bg.service"]
        assert bed.systemd.exit_reads == []

    run(test)


@pytest.mark.parametrize(
    "shown",
    [
        [state("bg.service", "failed", "failed")],  # failed: its own Restart= decides
        [state("bg.service", "inactive", "dead", 4, "start")],  # started again: its gate asks
        [],  # systemd unloaded it, and its record with it
    ],
    ids=["failed", "job", "unloaded"],
)
def test_only_a_loaded_holder_inactive_with_no_job_has_its_record_read(
    tmp_path: Path, shown: list[UnitState]
) -> None:
    """Few reads, each where it can tell: a failed unit is failed whatever killed it, one
    with a job queued is not down yet, and one systemd does not list has no record (a Get
    would load it anew, with none)."""
    bed = _bed(tmp_path, "running", shown)
    bed.systemd.main_exits["bg.service"] = KILLED

    async def test() -> None:
        await bed.controller.start()
        await settle()
        assert bed.systemd.exit_reads == []
        assert bed.controller.scheduler.snapshot().held == []

    run(test)


def test_a_read_a_signal_of_the_unit_overtook_is_not_taken(tmp_path: Path) -> None:
    """A signal of the unit came while its record was read (it was started and ended again,
    say): the record may be of another run than the state judged, and the unit is taken as
    before."""
    bed = _bed(tmp_path, "running")
    ctl = bed.controller
    read = bed.systemd.main_exit

    async def overtaken(name: str) -> MainExit:
        ctl.on_unit_changed(name, {"ActiveState": "inactive", "SubState": "dead"})
        return await read(name)

    bed.systemd.main_exits["bg.service"] = KILLED
    bed.systemd.main_exit = overtaken  # type: ignore[method-assign]

    async def test() -> None:
        await ctl.start()
        await settle()
        snap = ctl.scheduler.snapshot()
        assert (snap.held, snap.finished) == ([], ["bg.service"])

    run(test)


@pytest.mark.parametrize(
    ("phase", "started", "back"),
    [
        ("frozen", [], True),
        ("suspending", [], True),
        ("resuming", [], True),
        ("stopping", [], True),  # our stop of it sent, its end unseen
        ("starting", ["od.service"], True),  # its comeback, sent by the last controller
        ("starting", [], False),  # someone's start at its gate: cancelled with the boot
        ("running", [], False),  # ended with the boot, as any unit
    ],
)
def test_an_on_demand_unit_preempted_when_no_controller_saw_the_host_go_down_comes_back(
    tmp_path: Path, phase: str, started: list[str], back: bool
) -> None:
    """The last controller saved od.service preempted while it ran (or its comeback under
    way), and was gone before the host went down (a crash, `kill -9`, an upgrade). Its work
    went with the boot as a suspended unit's does: preempted, it is started again once its
    GPU is free. Dropped with the last boot's holders, no one started it again."""
    config = bed_config(tmp_path)
    saved = SavedState(holders={"od.service": ((0,), phase, 1, "")}, seq=1, started=started)
    StateStore(Path(config.state_dir)).save(saved, "boot-0")
    od = {"od.service": "Priority=50\n"}
    bed = Bed(tmp_path, od, [state("od.service", "inactive", "dead")], config=config)

    async def test() -> None:
        await bed.controller.start()
        await settle()
        assert (("start", "od.service") in bed.systemd.calls) is back

    run(test)
