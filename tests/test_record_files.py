"""The files gpuslice keeps beside its state: a state_dir never named as one of them, and the
records of the state_dir and runtime_dir in use written as the state file is (never through a
link at the temporary name, 0644, on disk before the write returns)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice.config import (
    SETTINGS_BY_NAME,
    ConfigError,
    parse_config,
    pin_runtime_dir,
    record_state_dir,
)
from gpuslice.core.scheduler import SavedState
from gpuslice.paths import DEFAULT_STATE_DIR, STATE_DIR_RECORD
from gpuslice.state import StateStore


def problems_of(text: str) -> list[str]:
    try:
        parse_config(text, "/c")
    except ConfigError as e:
        return e.problems
    return []


def valid_state_dir(value: str) -> bool:
    return bool(SETTINGS_BY_NAME["state_dir"].valid(value))


@pytest.mark.parametrize(
    "value",
    [
        # the default state_dir's state file: the directory could not be made while the file
        # was there, every save went to runtime_dir, and the state was gone after a reboot
        f"{DEFAULT_STATE_DIR}/state.json",
        f"{DEFAULT_STATE_DIR}/state.json/",
        f"{DEFAULT_STATE_DIR}/state.json.bad",
        f"{DEFAULT_STATE_DIR}/state.json.bad/x",
        f"{DEFAULT_STATE_DIR}/.state.json.tmp",
        f"{DEFAULT_STATE_DIR}/.state.json.bad.tmp",
        STATE_DIR_RECORD,
        f"{STATE_DIR_RECORD}/x",
        f"{DEFAULT_STATE_DIR}/.state-dir.tmp",
        # another state_dir's state file
        f"{DEFAULT_STATE_DIR}/a/state.json",
        f"{DEFAULT_STATE_DIR}/a/.state.json.tmp",
        f"{DEFAULT_STATE_DIR}/state-dir.x",
        f"{DEFAULT_STATE_DIR}/state-dir-x",
    ],
)
def test_a_state_dir_named_as_gpuslices_own_file_is_refused(value: str) -> None:
    assert problems_of(f"state_dir: {value}\n") == [
        f'/c:1: state_dir: invalid value "{value}" '
        f"(allowed: {SETTINGS_BY_NAME['state_dir'].allowed})"
    ]


@pytest.mark.parametrize(
    "value",
    [
        DEFAULT_STATE_DIR,
        f"{DEFAULT_STATE_DIR}/",
        f"{DEFAULT_STATE_DIR}/state",
        f"{DEFAULT_STATE_DIR}/statejson",
        f"{DEFAULT_STATE_DIR}/my-state.json",
        f"{DEFAULT_STATE_DIR}/a.b/x-state-dir",
        # a name that only begins as one of ours is an admin's
        f"{DEFAULT_STATE_DIR}/state-dirs",
        f"{DEFAULT_STATE_DIR}/state.jsonl",
        f"{DEFAULT_STATE_DIR}/.x",  # a hidden directory of the admin's
        f"{DEFAULT_STATE_DIR}/..state.json",
    ],
)
def test_other_names_are_state_dirs(value: str) -> None:
    assert problems_of(f"state_dir: {value}\n") == []


def test_every_name_the_state_store_writes_is_refused_as_a_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule and the writers agree: every name saved, set aside, recorded or written as
    a temporary file in a state_dir (here the default's, made in tmp_path) is refused."""
    names: set[str] = set()
    replace = os.replace

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        names.update((Path(src).name, Path(dst).name))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    store = StateStore(tmp_path)
    store.save(SavedState(held=["train.service"], seq=1), "boot")
    good = store.path.read_text()
    store.path.write_text("{}")  # no state: moved aside as a bad file
    store.load()
    store.path.write_text(good[:-1] + ', "extra": 1}')  # a bad entry: copied aside
    store.load()
    assert record_state_dir(tmp_path / Path(STATE_DIR_RECORD).name, DEFAULT_STATE_DIR)
    names.update(p.name for p in tmp_path.iterdir())
    assert {re.sub(r"-[0-9]+-[0-9]+$", "-PID-N", name) for name in names} == {
        "state.json",
        ".state.json.tmp-PID-N",
        "state.json.bad",
        ".state.json.bad.tmp-PID-N",
        "state-dir",
        ".state-dir.tmp-PID-N",
    }
    assert {name for name in names if valid_state_dir(f"{DEFAULT_STATE_DIR}/{name}")} == set()


@pytest.mark.parametrize("write", [pin_runtime_dir, record_state_dir])
def test_a_link_at_the_temporary_name_is_not_written_through(
    write: Callable[[Path, str], bool], tmp_path: Path
) -> None:
    """Before, open(tmp, "w") followed a link left at `.NAME.tmp`: it truncated and wrote the
    file it pointed to, and the rename put the link in the record's place."""
    record = tmp_path / "gpuslice" / "record"
    record.parent.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    (record.parent / ".record.tmp").symlink_to(victim)
    assert write(record, "/var/lib/gpuslice/a")
    assert victim.read_text() == "keep me\n"
    assert stat.S_ISREG(os.lstat(record).st_mode)
    assert record.read_text() == "/var/lib/gpuslice/a\n"
    assert sorted(p.name for p in record.parent.iterdir()) == ["record"]


def test_a_leftover_temporary_file_is_replaced(tmp_path: Path) -> None:
    record = tmp_path / "runtime-dir"
    (tmp_path / ".runtime-dir.tmp").write_text("a controller killed mid-write, and more\n")
    assert pin_runtime_dir(record, "/run/gpuslice/a")
    assert record.read_text() == "/run/gpuslice/a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runtime-dir"]


def test_the_record_is_0644_whatever_the_umask(tmp_path: Path) -> None:
    record = tmp_path / "state-dir"
    old = os.umask(0o077)
    try:
        assert record_state_dir(record, "/var/lib/gpuslice/a")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(record).st_mode) == 0o644


def test_the_record_is_on_disk_when_the_write_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record of the state_dir lost to a power cut soon after a start made the next start
    look for the state in the wrong directory: the record's data and its directory entry are
    flushed."""
    record = tmp_path / "state-dir"
    synced: list[tuple[int, int]] = []
    fsync = os.fsync

    def spy(fd: int) -> None:
        found = os.fstat(fd)
        synced.append((found.st_dev, found.st_ino))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    assert record_state_dir(record, "/var/lib/gpuslice/a")
    written, directory = os.lstat(record), os.lstat(tmp_path)
    assert (written.st_dev, written.st_ino) in synced
    assert (directory.st_dev, directory.st_ino) in synced


def test_a_failed_write_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a failed rename left `.state-dir.tmp` behind."""
    record = tmp_path / "state-dir"
    record.write_text("/var/lib/gpuslice/old\n")

    def failing(src: object, dst: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="Input/output"):
        record_state_dir(record, "/var/lib/gpuslice/a")
    monkeypatch.undo()
    assert record.read_text() == "/var/lib/gpuslice/old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state-dir"]


def test_the_generator_does_not_load_the_state_store() -> None:
    """pin_runtime_dir imports the writer lazily: gpuslice-generator imports config.py at
    every daemon-reload and must stay light (no asyncio, no scheduler)."""
    code = (
        "import sys, gpuslice.generator\n"
        "assert 'gpuslice.state' not in sys.modules and 'asyncio' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
