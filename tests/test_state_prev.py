"""gpuslice.state: the state file's last durable copy (`state.json.prev`).

The controller saves without fsync (the loop never waits on the disk) and flushes about a
second later off the loop. On XFS a rename(2) reaches the disk before the new file's data,
so a power cut in that second left `state.json` empty: it was set aside as a bad file, and
the units the controller had preempted were never brought back. Each flush now keeps the
file it made durable as `state.json.prev`, which a load takes in place of a torn state file.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from gpuslice import safefile
from gpuslice.core.scheduler import SavedState
from gpuslice.state import StateStore, find_saved

FLUSHED = SavedState(preempted={"vlm.service": 3}, seq=3)
LATER = SavedState(preempted={"vlm.service": 3, "asr.service": 4}, seq=4)


def power_cut(path: Path, torn: bytes) -> None:
    """What XFS leaves of a file renamed over the state file whose data never reached the
    disk: the new name, and no data (empty; zeros on older kernels)."""
    os.truncate(path, 0)
    if torn:
        path.write_bytes(torn)


def torn_with_copy(state_dir: Path, generation: int = 1, torn: bytes = b"") -> StateStore:
    """A state_dir as a power cut left it: the copy (FLUSHED, saved as `generation`) and
    the torn file (`torn`) of the save after it, which came before its flush."""
    store = StateStore(state_dir)
    store.generation = generation - 1
    store.save(FLUSHED, "b")
    store.flush()
    store.save(LATER, "b")
    power_cut(store.path, torn)
    return store


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("gpuslice") and r.levelno >= logging.ERROR
    ]


@pytest.mark.parametrize("torn", [b"", b"\0" * 300, b'{"version": 1, "boot_id": "b", "hol'])
def test_a_power_cut_after_an_unflushed_save_loads_the_last_flushed_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, torn: bytes
) -> None:
    """Without the copy: SavedState(), the torn file moved aside, vlm.service never back."""
    store = torn_with_copy(tmp_path, torn=torn)
    again = StateStore(tmp_path)
    with caplog.at_level(logging.DEBUG):
        assert again.load() == (FLUSHED, "b")
    [message] = errors(caplog)
    assert message.startswith(f"{store.path}: not JSON") or message.startswith(
        f"{store.path}: not UTF-8"
    )
    assert f"kept it as {store.bad_path}; loading {store.prev_path}" in message
    # the torn file kept for an admin; the copy back in its place (one file, two names)
    assert store.bad_path.read_bytes() == torn
    assert store.path.stat().st_ino == store.prev_path.stat().st_ino
    # a restart before the next save finds the same state, without a word
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        assert StateStore(tmp_path).load() == (FLUSHED, "b")
    assert errors(caplog) == []
    # the next save is numbered after the copy
    assert again.save(LATER, "b") == store.path
    assert (
        json.loads(store.path.read_bytes())["generation"]
        > json.loads(store.prev_path.read_bytes())["generation"]
    )


def test_a_good_state_file_wins_over_its_copy_whatever_the_copy_says(tmp_path: Path) -> None:
    """The copy is only ever older: a copy that says it is newer (a forged generation, a
    backup put back) is never taken over a state file that can be read."""
    store = StateStore(tmp_path)
    store.save(FLUSHED, "b")
    store.flush()
    store.save(LATER, "b")
    data = json.loads(store.prev_path.read_bytes())
    data["generation"] = 10**6
    store.prev_path.unlink()  # not written through the link: the state file is another file
    store.prev_path.write_text(json.dumps(data))
    assert StateStore(tmp_path).load() == (LATER, "b")


def test_no_state_file_takes_no_copy(tmp_path: Path) -> None:
    """Not there is not torn: nothing was saved, or it was moved (take_over) or removed."""
    store = StateStore(tmp_path)
    store.save(FLUSHED, "b")
    store.flush()
    store.path.unlink()
    assert StateStore(tmp_path).load() == (SavedState(), "")
    assert not store.path.exists()


def test_a_copy_others_could_write_is_not_taken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Hostile input as the state file is: a copy anyone could have written booked GPUs."""
    store = torn_with_copy(tmp_path)
    store.prev_path.chmod(0o666)
    with caplog.at_level(logging.DEBUG):
        assert StateStore(tmp_path).load() == (SavedState(), "")
    first, second = errors(caplog)
    assert first == (
        f"{store.prev_path}: writable by others (mode 0666); not used in place of {store.path}"
    )
    assert second.startswith(f"{store.path}: not JSON")
    assert f"moved it to {store.bad_path}" in second


def test_a_copy_another_user_owns_is_not_taken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = torn_with_copy(tmp_path)
    owner = store.prev_path.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # every file is another's then
    with caplog.at_level(logging.DEBUG):
        assert StateStore(tmp_path).load() == (SavedState(), "")
    assert errors(caplog)[0] == (
        f"{store.prev_path}: owned by UID {owner}, not the controller's; "
        f"not used in place of {store.path}"
    )


def test_a_copy_with_invalid_entries_gives_its_valid_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = StateStore(tmp_path)
    store.save(FLUSHED, "b")
    store.flush()
    data = json.loads(store.prev_path.read_bytes())
    data["held"] = ["not a unit", "train.service"]
    store.prev_path.unlink()
    store.prev_path.write_text(json.dumps(data))
    power_cut(store.path, b"")
    with caplog.at_level(logging.DEBUG):
        saved, _ = StateStore(tmp_path).load()
    assert saved.preempted == FLUSHED.preempted and saved.held == ["train.service"]
    assert any('held: dropped "not a unit"' in m for m in errors(caplog))


def test_a_newer_standin_wins_over_the_copy(tmp_path: Path) -> None:
    """The stand-in in runtime_dir (saved while state_dir could not be written) is ranked
    against the copy as against the state file: by save generation."""
    store = StateStore(tmp_path / "state", tmp_path / "run")
    store.save(FLUSHED, "b")
    store.flush()
    assert store.standin is not None
    store.standin.parent.mkdir()
    data = json.loads(store.path.read_bytes())
    data["generation"] += 1
    data["held"] = ["later.service"]
    store.standin.write_text(json.dumps(data))
    store.save(LATER, "b")  # the torn one: not the copy's file (a save writes a new one)
    power_cut(store.path, b"")
    saved, _ = StateStore(tmp_path / "state", tmp_path / "run").load()
    assert saved.held == ["later.service"]
    # an older stand-in loses to the copy, and is removed
    data["generation"] = 0
    store.standin.write_text(json.dumps(data))
    store.save(LATER, "b")
    power_cut(store.path, b"")
    assert StateStore(tmp_path / "state", tmp_path / "run").load() == (FLUSHED, "b")
    assert not store.standin.exists()


def test_a_flush_that_cannot_keep_a_copy_flushes_the_file_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system without hard links: the state file is made durable as before."""
    store = StateStore(tmp_path)
    store.save(FLUSHED, "b")

    def link(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError) as e:
        store.flush()
    # the link's errno is kept: a caller tells a file system without links from a full disk
    assert (e.value.errno, e.value.strerror) == (
        errno.EPERM,
        f"{store.prev_path} not kept: Operation not permitted",
    )
    assert synced == [str(store.path), str(tmp_path)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_link_atomic_leaves_no_temporary_name_when_the_sync_fails(tmp_path: Path) -> None:
    """A symlink is linked as itself, and its sync refused (never followed): nothing is
    left beside the copy, which is as it was."""
    (tmp_path / "target").write_text("x")
    (tmp_path / "state.json").symlink_to(tmp_path / "target")
    (tmp_path / "state.json.prev").write_text("old")
    with pytest.raises(OSError) as e:
        safefile.link_atomic(tmp_path / "state.json", tmp_path / "state.json.prev", sync=True)
    assert e.value.errno == errno.ELOOP
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.json.prev", "target"]
    assert (tmp_path / "state.json.prev").read_text() == "old"


def test_a_copy_left_half_made_by_a_killed_flush_is_removed_at_the_next_load(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path)
    store.save(FLUSHED, "b")
    leftover = tmp_path / ".state.json.prev.tmp-4194303-0"  # no live process has that PID
    os.link(store.path, leftover)
    assert StateStore(tmp_path).load() == (FLUSHED, "b")
    assert not leftover.exists()


def test_a_flush_with_no_save_since_the_last_leaves_no_temporary_name(tmp_path: Path) -> None:
    """The copy is that file already: rename(2) of one file's two names does nothing, and
    left the temporary one there, one more at each such flush."""
    store = StateStore(tmp_path)
    store.save(FLUSHED, "b")
    store.flush()
    store.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.json.prev"]


def test_a_torn_state_file_moved_to_a_new_state_dir_brings_its_copy(tmp_path: Path) -> None:
    """state_dir edited after the power cut: take_over moved the torn file, then removed
    the old state_dir's copy, the one good state there was (and the flush after the move
    made the new copy of the torn file)."""
    old, new = tmp_path / "old", tmp_path / "new"
    torn_with_copy(old, 5)
    new.mkdir()
    store = StateStore(new)
    assert store.take_over(old)
    assert store.load() == (FLUSHED, "b")
    assert sorted(p.name for p in old.iterdir()) == ["state.json.bad"]


def test_a_torn_state_file_is_ranked_as_its_copy(tmp_path: Path) -> None:
    """Torn, the old state_dir's file was generation 0: an older file in the new one won
    over it (its long-finished preemptions replayed), and the copy was removed."""
    old, new = tmp_path / "old", tmp_path / "new"
    StateStore(new).save(SavedState(preempted={"stale.service": 1}, seq=1), "b")  # generation 1
    torn_with_copy(old, 5)
    store = StateStore(new)
    assert store.take_over(old)
    assert store.load() == (FLUSHED, "b")
    # `gpuslice release-jobs` chooses the state_dir the same way
    torn_with_copy(old, 9)
    where, found = find_saved(new, old)
    assert where == old and found is not None and found.error is None
    store = StateStore(old)
    store.read_ahead = found
    assert store.load() == (FLUSHED, "b")


def refuse_opening(monkeypatch: pytest.MonkeyPatch, path: Path, code: int) -> None:
    """os.open fails with `code` for `path` only (as root, mode 000 stops no read)."""
    real = os.open

    def open_(file: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.fspath(file) == str(path):
            raise OSError(code, os.strerror(code))
        return real(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


def test_a_copy_that_cannot_be_read_is_said_in_the_systems_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = torn_with_copy(tmp_path)
    refuse_opening(monkeypatch, store.prev_path, errno.EACCES)
    with caplog.at_level(logging.DEBUG):
        assert StateStore(tmp_path).load() == (SavedState(), "")
    assert errors(caplog)[0] == (
        f"{store.prev_path}: Permission denied; not used in place of {store.path}"
    )


def test_a_state_file_that_cannot_be_read_is_replaced_by_its_copy_in_the_systems_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = torn_with_copy(tmp_path, torn=b"{}")
    refuse_opening(monkeypatch, store.path, errno.EIO)
    with caplog.at_level(logging.DEBUG):
        assert StateStore(tmp_path).load() == (FLUSHED, "b")
    [message] = errors(caplog)
    assert message.startswith(
        f"{store.path}: Input/output error (a power cut just after a save?); "
        f"kept it as {store.bad_path}; loading {store.prev_path}"
    )


def test_a_copy_that_cannot_be_put_in_place_is_loaded_all_the_same(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal says all that was done and not done; the next save writes the state."""
    store = torn_with_copy(tmp_path)
    real = os.link

    def link(source: Any, tmp: Any, **kwargs: Any) -> None:
        if os.fspath(source) == str(store.prev_path):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        real(source, tmp, **kwargs)

    monkeypatch.setattr(os, "link", link)
    with caplog.at_level(logging.DEBUG):
        assert StateStore(tmp_path).load() == (FLUSHED, "b")
    [message] = errors(caplog)
    assert message.endswith(
        " (a power cut just after a save?); "
        f"kept it as {store.bad_path}; could not put the copy in its place "
        f"(Invalid cross-device link); loading {store.prev_path}, the state as its last "
        "flush made it durable: the decisions of the second before may be lost"
    )
    assert store.path.read_bytes() == b"" and store.bad_path.read_bytes() == b""


def test_a_directory_at_the_state_files_name_is_moved_aside_for_the_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory cannot be linked: it is moved, as a bad file is, and the copy put there."""
    store = torn_with_copy(tmp_path)
    store.path.unlink()
    store.path.mkdir()
    with caplog.at_level(logging.DEBUG):
        assert StateStore(tmp_path).load() == (FLUSHED, "b")
    [message] = errors(caplog)
    assert f"; moved it to {store.bad_path}; loading {store.prev_path}" in message
    assert store.bad_path.is_dir()
    assert store.path.stat().st_ino == store.prev_path.stat().st_ino


def test_a_state_file_that_is_a_symlink_is_kept_aside_as_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Never followed, never synced (that would fail, ELOOP): the link itself is kept."""
    store = torn_with_copy(tmp_path)
    target = tmp_path / "target"
    target.write_text("not ours")
    store.path.unlink()
    store.path.symlink_to(target)
    with caplog.at_level(logging.DEBUG):
        assert StateStore(tmp_path).load() == (FLUSHED, "b")
    [message] = errors(caplog)
    assert f"; kept it as {store.bad_path}; loading {store.prev_path}" in message
    assert os.readlink(store.bad_path) == str(target)
    assert target.read_text() == "not ours"


@pytest.mark.parametrize("leftover", [False, True])
def test_link_atomic_links_a_symlink_as_itself_where_os_link_follows_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leftover: bool
) -> None:
    """Python 3.14's os.link follows a symlink unless told not to (gh-81793; 3.11's link(2)
    never does): a state file swapped for a link to another file never makes that file
    ours. Also when a killed writer of this PID left a file at the writer's own name."""
    real = os.link

    def link(source: str, tmp: str, *, follow_symlinks: bool = True) -> None:
        real(os.path.realpath(source) if follow_symlinks else source, tmp, follow_symlinks=False)

    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(safefile, "_numbers", itertools.count(7))
    target = tmp_path / "target"
    target.write_text("not ours")
    (tmp_path / "state.json").symlink_to(target)
    if leftover:
        (tmp_path / f".state.json.bad{safefile.TEMPORARY}-{os.getpid()}-7").write_text("half")
    safefile.link_atomic(tmp_path / "state.json", tmp_path / "state.json.bad")
    assert os.readlink(tmp_path / "state.json.bad") == str(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.json.bad", "target"]


def test_a_sweep_while_a_flush_links_its_copy_leaves_the_copy_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop sweeps killed writers' temporary names while the flusher's thread is between
    its link and its rename: that name is a live writer's, and the copy is kept."""
    store = StateStore(tmp_path)
    store.save(FLUSHED, "b")
    real = os.replace

    def replace(source: str, path: str) -> None:
        safefile.remove_stale(path)
        real(source, path)

    monkeypatch.setattr(os, "replace", replace)
    store.flush()
    assert store.prev_path.stat().st_ino == store.path.stat().st_ino


def test_a_temporary_name_a_failed_link_could_not_remove_goes_with_the_next_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename failed, and the clean-up's unlink too: that link is over, so its name is
    no live writer's, and `remove_stale` removes it."""
    (tmp_path / "state.json").write_text("x")
    (tmp_path / "state.json.bad").mkdir()

    def unlink(path: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(IsADirectoryError):
        safefile.link_atomic(tmp_path / "state.json", tmp_path / "state.json.bad")
    monkeypatch.undo()
    assert safefile.remove_stale(tmp_path / "state.json.bad") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.json.bad"]
