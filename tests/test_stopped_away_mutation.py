"""Restore.stopped_while_away and _main_exit under mutation: the holders found down at
start-up whose main process's record is read, what a failed or overtaken read leaves of the
others' findings, what is said of each (the journal, dbus_call_errors), and that nothing is
decided while the reads are in flight; on the fakes of tests/test_controller.py.

README: "A unit you stop by hand (`systemctl stop`) is held [...] across controller
restarts and reboots", also when it was stopped while no controller ran.
"""

from __future__ import annotations

import logging
from pathlib import Path
from signal import SIGKILL, SIGQUIT, SIGTERM

import pytest

from gpuslice.core.scheduler import SavedState
from gpuslice.state import StateStore
from gpuslice.systemd import SystemdError
from gpuslice.tracker import CLD_DUMPED, CLD_EXITED, CLD_KILLED, MainExit, UnitState
from tests.test_controller import Bed, bed_config, messages, run, settle, state

KILLED = MainExit(CLD_KILLED, SIGTERM, "success")
EXITED = MainExit(CLD_EXITED, 0, "success")
NO_REPLY = SystemdError("org.freedesktop.DBus.Error.NoReply", "no reply")
# a.service's read comes first (holders are read in name order), b.service's after it
PAIR = {n: "Priority=50\nType=background\n" for n in ("a.service", "b.service")}


def _started(bed: Bed) -> list[str]:
    return [unit for what, unit in bed.systemd.calls if what == "start"]


def _pair(tmp_path: Path) -> Bed:
    """a.service and b.service held GPU 0 and GPU 1, running, when the last controller of
    this boot saved; systemd shows both down with no job."""
    saved = SavedState(
        holders={
            "a.service": ((0,), "running", 1, ""),
            "b.service": ((1,), "running", 2, ""),
        },
        seq=2,
    )
    down = [state(n, "inactive", "dead") for n in PAIR]
    return Bed(tmp_path, PAIR, down, saved, config=bed_config(tmp_path, gpus=2))


async def _rebooted(tmp_path: Path, bed: Bed) -> Bed:
    """The host reboots after `bed`'s controller saved: its file is of the last boot, systemd
    shows both units down, and a controller starts (refill starts what is neither held nor
    owed)."""
    bed.controller.save_now()
    store = StateStore(Path(bed.config.state_dir))
    kept, _ = store.load()
    store.save(kept, "boot-0")
    down = [state(n, "inactive", "dead") for n in PAIR]
    again = Bed(tmp_path, PAIR, down, config=bed.config)
    await again.controller.start()
    await settle()
    return again


def test_a_failed_read_leaves_the_next_units_finding_standing_and_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """a.service's read fails, b.service's says killed by SIGTERM: a.service is finished (as
    before), b.service held, each read once; the failure is logged with the unit and the
    error's text and counted once in dbus_call_errors. After a reboot the refill starts
    a.service again, not b.service."""
    bed = _pair(tmp_path)
    bed.systemd.main_exits.update({"a.service": NO_REPLY, "b.service": KILLED})

    async def test() -> None:
        ctl = bed.controller
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            await ctl.start()
            await settle()
        assert ctl.ready
        assert bed.systemd.exit_reads == ["a.service", "b.service"]
        snap = ctl.scheduler.snapshot()
        assert (snap.held, snap.finished) == (["b.service"], ["a.service"])
        assert _started(bed) == []
        assert ctl.counters.to_json([])["dbus_call_errors"] == 1
        again = await _rebooted(tmp_path, bed)
        assert _started(again) == ["a.service"]
        assert again.controller.scheduler.snapshot().held == ["b.service"]

    run(test)
    said = [m for m in messages(caplog) if "main process" in m]
    assert said == [
        "cannot read how the main process of a.service ended (no reply): taken for ended by itself"
    ]


def test_an_overtaken_read_is_not_taken_and_leaves_the_next_units_finding_standing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A signal of a.service comes while its record (killed) is read: that record may be of
    another run, so a.service is taken as before (finished); b.service's read, killed, still
    holds it. Nothing failed: no warning, no error counted."""
    bed = _pair(tmp_path)
    ctl = bed.controller
    bed.systemd.main_exits.update({"a.service": KILLED, "b.service": KILLED})
    read = bed.systemd.main_exit

    async def overtaken(name: str) -> MainExit:
        if name == "a.service":
            ctl.on_unit_changed(name, {"ActiveState": "inactive", "SubState": "dead"})
        return await read(name)

    bed.systemd.main_exit = overtaken  # type: ignore[method-assign]

    async def test() -> None:
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            await ctl.start()
            await settle()
        assert bed.systemd.exit_reads == ["a.service", "b.service"]
        snap = ctl.scheduler.snapshot()
        assert (snap.held, snap.finished) == (["b.service"], ["a.service"])
        assert ctl.counters.to_json([])["dbus_call_errors"] == 0
        again = await _rebooted(tmp_path, bed)
        assert _started(again) == ["a.service"]

    run(test)
    assert [m for m in messages(caplog) if "main process" in m] == []


@pytest.mark.parametrize(
    "main",
    [KILLED, MainExit(CLD_KILLED, SIGKILL, "success"), MainExit(CLD_DUMPED, SIGQUIT, "success")],
    ids=["sigterm", "sigkill", "dumped"],
)
def test_a_unit_found_stopped_is_said_with_the_signal_that_killed_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, main: MainExit
) -> None:
    """The debug line names the unit and the signal number; a unit that exited by itself
    gets no such line."""
    bed = _pair(tmp_path)
    bed.systemd.main_exits.update({"a.service": EXITED, "b.service": main})

    async def test() -> None:
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            await bed.controller.start()
            await settle()
        snap = bed.controller.scheduler.snapshot()
        assert (snap.held, snap.finished) == (["b.service"], ["a.service"])

    run(test)
    said = [m for m in messages(caplog) if "while no controller ran" in m]
    assert said == [
        f"b.service was stopped while no controller ran (its main process was killed by "
        f"signal {int(main.status)})"
    ]


# Holders of every kind the read must tell apart, one GPU each, all killed by the stop's
# SIGTERM as systemd's record would say: name -> (saved phase, what systemd shows).
MIXED: dict[str, tuple[str, UnitState | None]] = {
    "down-running.service": ("running", state("down-running.service", "inactive", "dead")),
    "down-starting.service": ("starting", state("down-starting.service", "inactive", "dead")),
    "down-frozen.service": ("frozen", state("down-frozen.service", "inactive", "dead")),
    "ours-stopping.service": ("stopping", state("ours-stopping.service", "inactive", "dead")),
    "was-failed.service": ("running", state("was-failed.service", "failed", "failed")),
    "job-queued.service": ("running", state("job-queued.service", "inactive", "dead", 4, "start")),
    "unloaded.service": ("running", None),  # systemd does not list it: no record to read
}
READ = ["down-frozen.service", "down-running.service", "down-starting.service"]


def test_only_holders_loaded_inactive_with_no_job_and_not_being_stopped_are_read(
    tmp_path: Path,
) -> None:
    """One start-up, seven holders: only those the last controller saw running, starting or
    frozen that systemd lists inactive with no job have their record read, once each, and
    are held. The one gpuslice was stopping is preempted and brought back; the failed one is
    failed; the one with a start job queued and the one systemd unloaded are not read, and
    not held."""
    names = sorted(MIXED)
    saved = SavedState(
        holders={n: ((i,), MIXED[n][0], i + 1, "") for i, n in enumerate(names)}, seq=len(names)
    )
    shown = [s for _, s in MIXED.values() if s is not None]
    units = dict.fromkeys(names, "Priority=50\n")
    bed = Bed(tmp_path, units, shown, saved, config=bed_config(tmp_path, gpus=len(names)))
    for name in names:
        bed.systemd.main_exits[name] = KILLED

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert sorted(bed.systemd.exit_reads) == READ
        snap = ctl.scheduler.snapshot()
        assert snap.held == READ
        assert snap.failed == ["was-failed.service"]
        assert "ours-stopping.service" in _started(bed)  # preempted, then brought back
        assert ctl.counters.to_json([])["dbus_call_errors"] == 0

    run(test)


def test_nothing_is_decided_while_the_reads_are_in_flight(tmp_path: Path) -> None:
    """A sample taken while bg.service's record is read (the sampler's timer) starts nothing:
    GPU 1 is free and back.service is owed a comeback, but start-up decides once, after the
    reads. Then back.service is brought back and bg.service, killed, is held."""
    saved = SavedState(
        holders={"bg.service": ((0,), "running", 1, "")}, preempted={"back.service": 2}, seq=2
    )
    units = {"bg.service": "Priority=50\nType=background\n", "back.service": "Priority=50\n"}
    shown = [state(n, "inactive", "dead") for n in units]
    bed = Bed(tmp_path, units, shown, saved, config=bed_config(tmp_path, gpus=2))
    ctl = bed.controller
    bed.systemd.main_exits["bg.service"] = KILLED
    read = bed.systemd.main_exit
    during: list[list[str]] = []

    async def sampled_meanwhile(name: str) -> MainExit:
        ctl.watch.refresh()  # as the sampler's timer does: decide on what NVML shows
        await settle()
        during.append(_started(bed))
        return await read(name)

    bed.systemd.main_exit = sampled_meanwhile  # type: ignore[method-assign]

    async def test() -> None:
        await ctl.start()
        await settle()
        assert during == [[]]
        assert _started(bed) == ["back.service"]
        assert ctl.scheduler.snapshot().held == ["bg.service"]

    run(test)
