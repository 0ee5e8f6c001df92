"""The move of the state to a state_dir edited in config.yaml, at its edges: where the record
says the state is, what is said (the journal is what an admin reads) when the move, the
record or a removal fails, and that the CLI (saved_in) names the directory whose state the
controller goes on from. Set-ups are those of tests/test_state_dir_moved.py."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from gpuslice import controller as controller_module
from gpuslice.config import read_recorded_state_dir
from gpuslice.core.scheduler import SavedState
from gpuslice.state import STATE_FILE_MAX, StateStore, saved_in
from tests.test_controller import BOOT, messages
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_state_dir_moved import OWED, Dirs

OTHER = SavedState(held=["b.service"])
EARLY, LATE = 10**18, 15 * 10**17


def said(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def failing(call: Any, path: Path, error: int) -> Any:
    """`call` (an os function), failing with `error` for `path` alone."""

    def fail(target: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(target) == os.fspath(path):
            raise OSError(error, os.strerror(error))
        return call(target, *args, **kwargs)

    return fail


def exdev(src: Any, dst: Any) -> None:
    """rename(2) across two file systems."""
    raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))


# ---------------------------------------------------------------------------------------------
# where the record says the state is


@pytest.mark.parametrize("end", ["\n", ""])
def test_the_state_is_taken_from_the_state_dir_the_record_names(
    tmp_path: Path, end: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The record names a state_dir other than the default (the first edit was longer ago):
    the state is there, not in the record's directory. A record without its newline (written
    by hand) names the same directory, not one a character shorter."""
    dirs = Dirs(tmp_path)
    first = dirs.base / "first"
    dirs.record.write_text(f"{first}{end}")
    StateStore(first).save(OWED, BOOT)
    caplog.set_level(logging.INFO, "gpuslice")

    saved, boot = dirs.controller(dirs.new).controller._load_state()

    assert (saved, boot) == (OWED, BOOT)
    assert not (first / "state.json").exists()
    assert dirs.recorded() == f"{dirs.new}\n"
    assert said(caplog, logging.INFO) == [
        f"state moved from {first}/state.json to {dirs.new}/state.json"
    ]


@pytest.mark.parametrize(
    ("written", "named"),
    [
        ("a\n", "a"),
        ("a", "a"),
        ("a/\n", "a"),
        ("a/b/", "a/b"),
        ("jobX\n", "jobX"),  # only "/" comes off the end
        ("", ""),  # the record's directory: the default state_dir
    ],
)
def test_the_record_is_read_as_config_yaml_spells_a_state_dir(
    tmp_path: Path, written: str, named: str
) -> None:
    """The value is compared with config.yaml's state_dir, which has its trailing "/" off:
    read with it, an unchanged state_dir looked changed and was moved onto itself."""
    record = tmp_path / "state-dir"
    record.write_text(f"{tmp_path}/{written}" if written else f"{tmp_path}\n")
    assert read_recorded_state_dir(record) == (f"{tmp_path}/{named}" if named else str(tmp_path))


@pytest.mark.parametrize("below", ["state-dir", "state-dir/", "state-dir/x"])
def test_a_record_that_names_itself_is_no_state_dir(tmp_path: Path, below: str) -> None:
    """The record is a file: neither it nor a directory below it is a state_dir."""
    record = tmp_path / "state-dir"
    record.write_text(f"{tmp_path}/{below}\n")
    assert read_recorded_state_dir(record) is None


def test_a_huge_record_is_not_read_in_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record is one line of at most a path's length: a big file there (root's mistake, a
    disk error) is refused after its first kilobyte, not read into the daemon's memory."""
    record = tmp_path / "state-dir"
    with open(record, "wb") as f:
        f.write(f"{tmp_path}/a\n".encode())
        f.truncate(64 << 20)
    read = os.read
    total = 0

    def counting(fd: int, n: int) -> bytes:
        nonlocal total
        data = read(fd, n)
        total += len(data)
        return data

    monkeypatch.setattr(os, "read", counting)
    assert read_recorded_state_dir(record) is None
    assert total <= 4096


# ---------------------------------------------------------------------------------------------
# the CLI and the controller agree on which state is the last


@pytest.mark.parametrize(
    ("recorded_at", "configured_at", "expected"),
    [
        (None, None, "configured"),
        (None, EARLY, "configured"),
        (EARLY, None, "recorded"),
        (EARLY, LATE, "configured"),
        (LATE, EARLY, "recorded"),
        (EARLY, EARLY, "recorded"),  # saved in the same instant: the one recorded
    ],
)
def test_saved_in_names_the_state_the_controller_goes_on_from(
    tmp_path: Path, recorded_at: int | None, configured_at: int | None, expected: str
) -> None:
    """`gpuslice release-jobs` (saved_in) reads the state the stopped controller left: the
    one its next start keeps (take_over), or it named units the controller never restarts,
    or missed those it does."""
    dirs = {"recorded": tmp_path / "recorded", "configured": tmp_path / "configured"}
    states = {"recorded": OWED, "configured": OTHER}
    for name, at in (("recorded", recorded_at), ("configured", configured_at)):
        if at is not None:
            StateStore(dirs[name]).save(states[name], BOOT)
            os.utime(dirs[name] / "state.json", ns=(at, at))
        else:
            dirs[name].mkdir()

    assert saved_in(dirs["configured"], dirs["recorded"]) == dirs[expected]

    store = StateStore(dirs["configured"])
    assert store.take_over(dirs["recorded"])
    kept = states[expected] if expected == "recorded" or configured_at else SavedState()
    assert store.load()[0] == kept
    assert not (dirs["recorded"] / "state.json").exists()


# ---------------------------------------------------------------------------------------------
# take_over at its edges


def test_a_state_dir_taken_over_from_itself_is_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = StateStore(tmp_path)
    store.save(OWED, BOOT)
    caplog.set_level(logging.INFO, "gpuslice")
    assert store.take_over(tmp_path / "." / "")
    assert store.load()[0] == OWED
    assert messages(caplog) == []


def test_one_directory_by_two_names_is_recorded_by_config_yamls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The recorded state_dir is a link to the configured one: the state is where config.yaml
    says, and the record names that directory from now on (not the link, which may go)."""
    dirs = Dirs(tmp_path)
    StateStore(dirs.new).save(OWED, BOOT)
    (dirs.base / "link").symlink_to(dirs.new)
    dirs.record.write_text(f"{dirs.base}/link\n")
    caplog.set_level(logging.INFO, "gpuslice")

    assert StateStore(dirs.new).take_over(dirs.base / "link")
    saved, _ = dirs.controller(dirs.new).controller._load_state()

    assert saved == OWED
    assert dirs.recorded() == f"{dirs.new}\n"
    assert messages(caplog) == []


def test_an_old_state_file_that_cannot_be_looked_at_is_said_and_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """lstat of the old file fails (EIO): nothing is moved, the controller starts from the
    new state_dir, and the journal says which file was left and why."""
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    StateStore(old_dir).save(OWED, BOOT)
    old = old_dir / "state.json"
    monkeypatch.setattr(os, "lstat", failing(os.lstat, old, errno.EIO))
    store = StateStore(new_dir)

    assert store.take_over(old_dir)
    monkeypatch.undo()

    assert old.exists()
    assert not store.path.exists()
    assert said(caplog, logging.ERROR) == [
        f"{old}: cannot look at it ([Errno 5] Input/output error); left there, starting from "
        f"{store.path}"
    ]


def test_an_old_state_file_too_big_to_be_ours_is_not_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Across two file systems the file is read to be copied: one over STATE_FILE_MAX is not
    a state save() wrote. Left there, said; the controller starts from the new state_dir."""
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    old_dir.mkdir()
    old = old_dir / "state.json"
    with open(old, "wb") as f:
        f.truncate(STATE_FILE_MAX + 1)
    monkeypatch.setattr(os, "rename", exdev)
    store = StateStore(new_dir)

    assert store.take_over(old_dir)
    monkeypatch.undo()

    assert old.stat().st_size == STATE_FILE_MAX + 1
    assert not store.path.exists()
    assert said(caplog, logging.ERROR) == [
        f"{old}: cannot move it to {store.path} (larger than 16 MiB); left there"
    ]


def test_a_move_that_cannot_be_written_says_where_the_state_is_read_and_saved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The new state_dir cannot be made (its parent is a file): the error names both files
    and the reason alone (strerror, not the exception's text with its paths again)."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    StateStore(dirs.old).save(OWED, BOOT)
    (dirs.base / "file").write_text("")
    new = dirs.base / "file" / "new"

    assert not StateStore(new).take_over(dirs.old)

    old, path = dirs.old / "state.json", new / "state.json"
    assert old.exists()
    assert said(caplog, logging.ERROR) == [
        f"cannot move the state from {old} to {path} (Not a directory); read from {old}, "
        f"saved to {path}"
    ]


def test_a_move_that_cannot_be_written_still_uses_the_stand_in(tmp_path: Path) -> None:
    """The state is read where it is, as that controller would have: its stand-in in
    runtime_dir (saved while the old state_dir could not be written, newer) wins, or the
    last decisions (low.service preempted) were lost."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    StateStore(dirs.old).save(OTHER, BOOT)
    os.utime(dirs.old / "state.json", ns=(EARLY, EARLY))
    (dirs.base / "file").write_text("")
    bed = dirs.controller(dirs.base / "file" / "new")
    standin = Path(bed.config.runtime_dir)
    StateStore(standin).save(OWED, BOOT)
    os.utime(standin / "state.json", ns=(LATE, LATE))

    saved, _ = bed.controller._load_state()

    assert saved == OWED
    assert dirs.recorded() == f"{dirs.old}\n"


def test_a_new_state_dir_several_levels_down_is_made(tmp_path: Path) -> None:
    """state_dir: /var/lib/gpuslice/a/b, neither there yet: both are made for the move."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    StateStore(dirs.old).save(OWED, BOOT)
    new = dirs.base / "a" / "b"

    saved, _ = dirs.controller(new).controller._load_state()

    assert saved == OWED
    assert (new / "state.json").exists()
    assert not (dirs.old / "state.json").exists()
    assert dirs.recorded() == f"{new}\n"


def test_a_copy_not_on_disk_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Across two file systems, the flush of the copy fails (EIO): the old file is kept (a
    power cut may lose the copy), the state is read from the copy."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    StateStore(dirs.old).save(OWED, BOOT)

    def flush(self: StateStore) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "rename", exdev)
    monkeypatch.setattr(StateStore, "flush", flush)

    saved, _ = dirs.controller(dirs.new).controller._load_state()
    monkeypatch.undo()

    assert saved == OWED
    assert StateStore(dirs.old).load()[0] == OWED
    assert (
        f"cannot flush {dirs.new}/state.json to disk ([Errno 5] Input/output error): a "
        "power cut may lose it" in said(caplog, logging.ERROR)
    )


@pytest.mark.parametrize("newer", ["configured", "recorded"])
def test_an_old_file_that_cannot_be_removed_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, newer: str
) -> None:
    """The old file is removed once the state is on disk here (the one here was newer, or
    the old one was copied across file systems); a removal that fails (EROFS) is said, and
    the state here is kept."""
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    StateStore(old_dir).save(OWED, BOOT)
    StateStore(new_dir).save(OTHER, BOOT)
    later, earlier = (new_dir, old_dir) if newer == "configured" else (old_dir, new_dir)
    os.utime(earlier / "state.json", ns=(EARLY, EARLY))
    os.utime(later / "state.json", ns=(LATE, LATE))
    old = old_dir / "state.json"
    monkeypatch.setattr(os, "unlink", failing(os.unlink, old, errno.EROFS))
    monkeypatch.setattr(os, "rename", exdev)
    store = StateStore(new_dir)

    assert store.take_over(old_dir)
    monkeypatch.undo()

    assert old.exists()
    assert store.load()[0] == (OTHER if newer == "configured" else OWED)
    assert said(caplog, logging.ERROR) == [f"cannot remove {old}: Read-only file system"]


# ---------------------------------------------------------------------------------------------
# the record of the state_dir


def test_a_record_that_cannot_be_written_is_said_and_the_state_still_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The state moved, the record of the new state_dir cannot be written (EROFS): the
    controller starts with the state, and the journal says what a next edit of state_dir
    would cost."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    StateStore(dirs.old).save(OWED, BOOT)

    def record_state_dir(record: Any, state_dir: str) -> bool:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(controller_module, "record_state_dir", record_state_dir)

    saved, _ = dirs.controller(dirs.new).controller._load_state()

    assert saved == OWED
    assert said(caplog, logging.ERROR) == [
        f"cannot record the state_dir in {dirs.record} ([Errno 30] Read-only file system): a "
        f"restart after state_dir is changed in {tmp_path}/config.yaml starts without the state"
    ]
