"""A state_dir edited in config.yaml, then a restart: the state moves, nothing is forgotten.

A reload keeps the state_dir the controller started with; the next start (Restart= after a
crash, the exit a driver loaded late asks for, `systemctl restart`, a reboot) took the new
one from config.yaml, empty: units preempted and owed a restart were never started again,
suspended ones stayed frozen with their VRAM in host memory, holders were adopted as best it
could. Now the controller records the state_dir it runs with (paths.STATE_DIR_RECORD, in
/var/lib/gpuslice, so that it outlives a reboot as preempted units do), and a start with
another one moves the state there: the newer of the two files wins, the other is removed.

The record's directory stands for /var/lib/gpuslice (StateDirectory=): every state_dir, and so
every state_dir the record may name, is that directory or below it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuslice import cli as cli_module
from gpuslice import controller as controller_module
from gpuslice import paths
from gpuslice.cli import main
from gpuslice.config import Config, ConfigError, load_config_with_warnings
from gpuslice.core.scheduler import Phase, SavedState
from gpuslice.state import StateStore
from tests.hostpaths import REAL
from tests.test_controller import BOOT, Bed, bed_config, messages, run, settle, state
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller_run import ENDS_WITHIN, Host
from tests.test_controller_run import host as host  # fixture

UNITS = {"low.service": "Priority=90\n", "b.service": "Priority=80\nPreempt=suspend stop\n"}
# what the last controller owed: low.service a restart, b.service (suspended) a resume
OWED = SavedState(preempted={"low.service": 1}, suspended={"b.service": ((0,), 2)}, seq=2)


class Dirs:
    """/var/lib/gpuslice under tmp_path: the record, the old state_dir and the new one."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.base = tmp_path / "var-lib-gpuslice"  # StateDirectory=
        self.base.mkdir()
        self.record = self.base / "state-dir"
        self.old = self.base  # the default state_dir
        self.new = self.base / "new"

    def controller(self, state_dir: Path, shown: list[Any] | None = None) -> Bed:
        """A controller started with `state_dir` in config.yaml, as run() makes it."""
        shown = [state("b.service", "active", "running")] if shown is None else shown
        config = bed_config(self.tmp_path, gpus=2, state_dir=str(state_dir))
        bed = Bed(self.tmp_path, UNITS, shown, config=config)
        bed.controller.state_record = self.record
        return bed

    def recorded(self) -> str:
        return self.record.read_text()


def test_a_restart_after_state_dir_was_edited_carries_the_state_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The controller runs with the default state_dir, preempts low.service and suspends
    b.service; the admin edits state_dir (a reload keeps the old one), then the controller
    restarts. It read the new directory, empty: low.service was never started again and
    b.service stayed frozen for good."""
    dirs = Dirs(tmp_path)
    caplog.set_level(logging.INFO, "gpuslice")

    async def test() -> None:
        first = dirs.controller(dirs.old, shown=[])
        await first.controller.start()
        assert dirs.recorded() == f"{dirs.old}\n"
        StateStore(dirs.old).save(OWED, BOOT)  # what it decided since

        bed = dirs.controller(dirs.new)
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert ("start", "low.service") in bed.systemd.calls
        # resumed: with no cuda-checkpoint here that fails, and b.service is stopped
        assert ctl.scheduler.phase("b.service") in (Phase.RESUMING, Phase.STOPPING)
        assert ctl.counters.to_json([])["decisions"].get("resume") == 1

    run(test)
    assert f"state moved from {dirs.old}/state.json to {dirs.new}/state.json" in messages(caplog)
    assert not (dirs.old / "state.json").exists()  # one state per host: see take_over
    assert dirs.recorded() == f"{dirs.new}\n"


def test_a_reboot_after_state_dir_was_edited_still_restarts_the_preempted_units(
    tmp_path: Path,
) -> None:
    """The record is in /var/lib/gpuslice, not in /run: units preempted before a reboot are
    owed a restart after it (a suspended one's run ended with the boot: it is preempted)."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    StateStore(dirs.old).save(OWED, "boot-0")
    bed = dirs.controller(dirs.new, shown=[])

    async def test() -> None:
        await bed.controller.start()
        await settle()
        assert ("start", "low.service") in bed.systemd.calls
        assert ("start", "b.service") in bed.systemd.calls

    run(test)
    assert not (dirs.old / "state.json").exists()
    assert dirs.recorded() == f"{dirs.new}\n"


def test_without_a_record_the_state_is_looked_for_in_the_default_state_dir(
    tmp_path: Path,
) -> None:
    """A gpuslice without the record ran last, with the default state_dir, and state_dir was
    edited before the upgrade restarted it: the state is in the default one."""
    dirs = Dirs(tmp_path)
    StateStore(dirs.old).save(OWED, BOOT)

    saved, _ = dirs.controller(dirs.new).controller._load_state()

    assert saved == OWED
    assert not (dirs.old / "state.json").exists()
    assert dirs.recorded() == f"{dirs.new}\n"


@pytest.mark.parametrize("newer", ["recorded", "configured"])
def test_of_two_state_files_the_newer_is_kept_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, newer: str
) -> None:
    """Both directories hold a state (state_dir edited back and forth by an older gpuslice,
    a file copied by hand): the one saved last is what the controller owes, whichever
    directory it is in. Read from config.yaml's alone, an older one brought back units that
    had long come back (or were stopped by hand since)."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    old, new = SavedState(preempted={"low.service": 1}, seq=1), SavedState(held=["b.service"])
    StateStore(dirs.old).save(old, BOOT)
    StateStore(dirs.new).save(new, BOOT)
    later, earlier = (dirs.old, dirs.new) if newer == "recorded" else (dirs.new, dirs.old)
    os.utime(earlier / "state.json", ns=(10**18, 10**18))
    os.utime(later / "state.json", ns=(15 * 10**17, 15 * 10**17))
    caplog.set_level(logging.INFO, "gpuslice")

    saved, boot = dirs.controller(dirs.new).controller._load_state()

    assert (saved, boot) == (old if newer == "recorded" else new, BOOT)
    assert not (dirs.old / "state.json").exists()
    assert os.stat(dirs.new / "state.json").st_mtime_ns == 15 * 10**17  # saved then
    assert dirs.recorded() == f"{dirs.new}\n"
    said = (
        f"state moved from {dirs.old}/state.json to {dirs.new}/state.json, replacing an "
        "older state there"
        if newer == "recorded"
        else f"{dirs.old}/state.json: older than {dirs.new}/state.json, saved since, which "
        "holds the state; removed"
    )
    assert said in messages(caplog)


@pytest.mark.parametrize("file_systems", [1, 2])
def test_a_state_moved_keeps_the_time_it_was_saved_so_a_newer_stand_in_still_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_systems: int
) -> None:
    """The old state_dir could not be written (a full disk): the last saves went to the
    stand-in in runtime_dir, newer than the old state file. Moved with the time of the
    move, that stale file looked newer than the stand-in, which was removed: the last
    decisions (low.service preempted) were lost. Renamed on one file system, copied across
    two (rename(2) fails with EXDEV), the old one removed after the copy."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    StateStore(dirs.old).save(SavedState(held=["b.service"]), BOOT)
    os.utime(dirs.old / "state.json", ns=(10**18, 10**18))
    bed = dirs.controller(dirs.new)
    standin = Path(bed.config.runtime_dir) / "state.json"
    standin.parent.mkdir(parents=True, exist_ok=True)
    StateStore(standin.parent).save(SavedState(preempted={"low.service": 1}, seq=1), BOOT)
    os.utime(standin, ns=(15 * 10**17, 15 * 10**17))  # newer than the old file, older than now
    if file_systems == 2:

        def rename(src: Any, dst: Any) -> None:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

        monkeypatch.setattr(os, "rename", rename)

    saved, _ = bed.controller._load_state()
    monkeypatch.undo()

    assert saved.preempted == {"low.service": 1}
    assert not (dirs.old / "state.json").exists()
    assert os.stat(dirs.new / "state.json").st_mtime_ns == 10**18


def test_a_disk_that_fails_the_flush_after_the_move_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The move went through; the flush after it failed (EIO). The state is read where it
    went, not from the old directory, empty now."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    StateStore(dirs.old).save(OWED, BOOT)

    def flush(self: StateStore) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(StateStore, "flush", flush)

    saved, _ = dirs.controller(dirs.new).controller._load_state()

    assert saved == OWED
    assert dirs.recorded() == f"{dirs.new}\n"
    assert (
        f"cannot flush {dirs.new}/state.json to disk ([Errno 5] Input/output error): a "
        "power cut may lose it" in messages(caplog)
    )


def test_a_new_state_dir_that_cannot_be_written_reads_the_state_where_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The move cannot be written (here the new state_dir's parent is a file): the state is
    read from the old directory, which stays recorded, and saves go to the new one (or to
    the stand-in) as they would."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    StateStore(dirs.old).save(OWED, BOOT)
    (dirs.base / "file").write_text("")
    new = dirs.base / "file" / "new"

    saved, _ = dirs.controller(new).controller._load_state()

    assert saved == OWED
    assert (dirs.old / "state.json").exists()
    assert dirs.recorded() == f"{dirs.old}\n"
    assert any(m.startswith(f"cannot move the state from {dirs.old}/") for m in messages(caplog))


def test_a_state_file_that_is_no_regular_file_is_not_moved_nor_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The old state_dir's state.json is a link (to a file elsewhere): not read through, not
    moved, left there and said; the controller starts."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    elsewhere = tmp_path / "elsewhere"
    StateStore(elsewhere).save(OWED, BOOT)
    (dirs.old / "state.json").symlink_to(elsewhere / "state.json")

    saved, _ = dirs.controller(dirs.new).controller._load_state()

    assert saved == SavedState()
    assert (dirs.old / "state.json").is_symlink()
    assert (elsewhere / "state.json").exists()
    assert not (dirs.new / "state.json").exists()
    assert (
        f"{dirs.old}/state.json: not a regular file; left there, not moved to {dirs.new}/"
        "state.json" in messages(caplog)
    )


def test_one_directory_by_two_names_is_not_moved_onto_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The recorded state_dir is a link to the configured one: one file by two names, not
    moved (a copy onto itself, then the old name removed, was the state lost), nor said to."""
    dirs = Dirs(tmp_path)
    StateStore(dirs.new).save(OWED, BOOT)
    (dirs.base / "link").symlink_to(dirs.new)
    dirs.record.write_text(f"{dirs.base}/link\n")

    saved, _ = dirs.controller(dirs.new).controller._load_state()

    assert saved == OWED
    assert StateStore(dirs.new).load()[0] == OWED
    assert messages(caplog) == []


@pytest.mark.parametrize(
    "record",
    [
        "{elsewhere}",  # outside /var/lib/gpuslice
        "{base}/../elsewhere",
        "{base}//x",
        "{base}/state-dir",  # the record itself
        "{base}/new\n\n",
        "\udcff",
        "{base}/" + "x" * 300,
        "link",
    ],
)
def test_a_record_that_names_no_state_dir_is_ignored(
    tmp_path: Path, record: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Only root writes the record, but the controller removes a file in the directory it
    names: a value config.yaml could not give state_dir is ignored (the state of that
    directory left alone), the controller starts with config.yaml's and records it."""
    dirs = Dirs(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    StateStore(elsewhere).save(OWED, BOOT)
    if record == "link":  # a link to a record naming a valid state_dir: not followed
        (tmp_path / "other").write_text(f"{dirs.base}/x\n")
        dirs.record.symlink_to(tmp_path / "other")
        StateStore(dirs.base / "x").save(OWED, BOOT)
    else:
        text = record.format(base=dirs.base, elsewhere=elsewhere)
        dirs.record.write_bytes(text.encode("utf-8", "surrogateescape"))

    saved, _ = dirs.controller(dirs.new).controller._load_state()

    assert saved == SavedState()
    assert (elsewhere / "state.json").exists()
    if record == "link":
        assert (dirs.base / "x" / "state.json").exists()
        assert (tmp_path / "other").read_text() == f"{dirs.base}/x\n"  # replaced, not written
    assert dirs.recorded() == f"{dirs.new}\n"


def test_config_yaml_cannot_name_the_record_as_state_dir(tmp_path: Path) -> None:
    """A state_dir where the record is would be a file, not a directory: no state saved. Any
    name that begins as the record's does is refused too (tests/test_record_files.py); a
    shorter one is a state_dir."""
    path = tmp_path / "config.yaml"
    record, default = REAL["paths.STATE_DIR_RECORD"], REAL["paths.DEFAULT_STATE_DIR"]
    for value in (record, record + "/x"):
        path.write_text(f"state_dir: {value}\n")
        with pytest.raises(ConfigError, match="state_dir"):
            load_config_with_warnings(path)
    path.write_text(f"state_dir: {default}/state-di\n")
    assert load_config_with_warnings(path)[0].state_dir == f"{default}/state-di"


def test_the_daemon_records_the_state_dir_it_runs_with(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run() gives its controller the record (paths.STATE_DIR_RECORD): written at start."""
    record = host.tmp_path / "gpuslice" / "state-dir"
    record.parent.mkdir()
    monkeypatch.setattr(controller_module, "STATE_RECORD", record)

    async def test() -> None:
        daemon = host.start()
        await host.waiting_on_its_bus(daemon)
        assert record.read_text() == host.controller.config.state_dir + "\n"
        signal.raise_signal(signal.SIGTERM)
        assert await asyncio.wait_for(daemon, ENDS_WITHIN) == 0

    run(test)


def test_release_jobs_reads_the_state_where_the_stopped_controller_left_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`apt remove` after state_dir was edited (the controller not restarted since): the
    state is still in the old directory. Read from config.yaml's, release-jobs named no
    preempted unit and thawed no frozen one."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    StateStore(dirs.old).save(SavedState(preempted={"low.service": 1}, seq=1), "boot-0")
    config = Config(state_dir=str(dirs.new), runtime_dir=str(tmp_path / "run"))
    monkeypatch.setattr(cli_module, "load_config_with_warnings", lambda path: (config, []))
    monkeypatch.setattr(paths, "STATE_DIR_RECORD", str(dirs.record))

    def systemctl(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        out = "ActiveState=inactive\nFreezerState=running\n" if command[1] == "show" else ""
        return subprocess.CompletedProcess(command, 0, out, "")

    monkeypatch.setattr(subprocess, "run", systemctl)
    result = CliRunner().invoke(main, ["release-jobs", "--config", str(tmp_path / "c.yaml")])
    assert result.exit_code == 0, result.output
    assert "low.service was preempted and nothing will start it again" in result.stderr
    assert (dirs.old / "state.json").exists()  # read, never moved by the CLI


def test_release_jobs_reads_the_stand_in_where_the_controller_of_this_boot_kept_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runtime_dir edited this boot: the controller kept running with the one it pinned at
    its start, and its stand-in (state_dir unwritable) is there. Read from config.yaml's,
    release-jobs found no stand-in and named no preempted unit."""
    from gpuslice import config as config_module

    pinned, configured, state_dir = tmp_path / "run-old", tmp_path / "run-new", tmp_path / "lib"
    pinned.mkdir()
    state_dir.mkdir()
    StateStore(pinned).save(SavedState(preempted={"low.service": 1}, seq=1), BOOT)
    config = Config(state_dir=str(state_dir), runtime_dir=str(configured))
    monkeypatch.setattr(cli_module, "load_config_with_warnings", lambda path: (config, []))
    monkeypatch.setattr(paths, "STATE_DIR_RECORD", str(tmp_path / "no-record"))
    monkeypatch.setattr(paths, "RUNTIME_DIR_RECORD", str(tmp_path / "runtime-dir"))
    # the record names a runtime_dir below /run/gpuslice; here, the test's own directory
    monkeypatch.setattr(config_module, "read_pinned_runtime_dir", lambda record: str(pinned))

    def systemctl(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        out = "ActiveState=inactive\nFreezerState=running\n" if command[1] == "show" else ""
        return subprocess.CompletedProcess(command, 0, out, "")

    monkeypatch.setattr(subprocess, "run", systemctl)
    result = CliRunner().invoke(main, ["release-jobs", "--config", str(tmp_path / "c.yaml")])
    assert result.exit_code == 0, result.output
    assert "low.service was preempted and nothing will start it again" in result.stderr
