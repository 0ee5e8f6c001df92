"""Each state file read once at a start (gpuslice/state.py: Found, read_found, find_saved,
StateStore.read_ahead, take_over): which file wins, which is read and how often, the time
a copied file keeps, and how a flush that gets no thread is reported."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from gpuslice import state as state_module
from gpuslice.core.scheduler import SavedState
from gpuslice.paths import STATE_FILE_NAME
from gpuslice.state import STATE_FILE_MAX, Flusher, StateStore, find_saved, read_found, saved_in
from tests.test_controller import BOOT
from tests.test_state_reads_once import EARLY, LATE, count_reads, saved_at

OLD_STATE = SavedState(preempted={"old.service": 1}, seq=1)
HERE_STATE = SavedState(held=["here.service"], seq=0)
EXDEV = OSError(errno.EXDEV, os.strerror(errno.EXDEV))


def older_gpuslice_file(state_dir: Path, state: SavedState, when: int) -> Path:
    """A state file as a gpuslice without save generations wrote it, modified at `when`."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / STATE_FILE_NAME
    data = {
        "version": 1,
        "boot_id": BOOT,
        "holders": {},
        "preempted": state.preempted,
        "held": state.held,
        "finished": [],
        "failed": [],
        "seq": state.seq,
    }
    path.write_text(json.dumps(data))
    os.utime(path, ns=(when, when))
    return path


def refuse_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    """rename(2) across two file systems."""

    def rename(src: Any, dst: Any) -> None:
        raise EXDEV

    monkeypatch.setattr(os, "rename", rename)


def test_a_file_modified_at_the_epoch_is_older_than_one_modified_a_nanosecond_later(
    tmp_path: Path,
) -> None:
    """Two files of an older gpuslice (no generation) on a board without a real-time clock:
    the one modified at 1970-01-01 00:00:00 exactly is the older, not a tie kept where it
    was."""
    recorded, configured = tmp_path / "old", tmp_path / "new"
    older_gpuslice_file(recorded, OLD_STATE, 0)
    newer = older_gpuslice_file(configured, HERE_STATE, 1)

    where, found = find_saved(configured, recorded)

    assert where == configured
    assert found is not None and found.path == newer and found.rank() == (0, 1)
    assert saved_in(configured, recorded) == configured


def test_a_state_file_not_there_is_found_at_its_path(tmp_path: Path) -> None:
    """read_found never raises: a file that cannot be looked at is a Found of that path
    with the error, ranked below any saved one."""
    missing = tmp_path / "state" / STATE_FILE_NAME

    found = read_found(missing)

    assert found.path == missing
    assert isinstance(found.error, FileNotFoundError)
    assert found.rank() == (0, 0)
    with pytest.raises(FileNotFoundError):
        found.parsed()


def test_no_state_file_in_the_configured_state_dir_chooses_the_recorded_one_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing to rank the recorded file against: it is chosen by a look alone, none read
    (its store reads it, once, to load it)."""
    recorded, configured = tmp_path / "old", tmp_path / "new"
    saved_at(recorded, OLD_STATE, LATE)
    reads = count_reads(monkeypatch)

    assert find_saved(configured, recorded) == (recorded, None)
    assert saved_in(configured, recorded) == recorded
    assert reads == {}, reads


def test_a_file_read_ahead_from_another_path_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """read_ahead holding another state_dir's file: the store loads its own, read here."""
    other = saved_at(tmp_path / "other", OLD_STATE, LATE)
    mine = saved_at(tmp_path / "state", HERE_STATE, EARLY)
    store = StateStore(tmp_path / "state")
    store.read_ahead = read_found(other)
    reads = count_reads(monkeypatch)

    assert store.load() == (HERE_STATE, BOOT)
    assert reads == {str(mine): 1}, reads
    assert store.read_ahead is None


def test_a_newer_state_here_is_kept_and_loaded_from_its_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The state here was saved after the one in the old state_dir (a higher generation,
    though modified earlier): the old one is removed, and the one here is loaded from the
    read that ranked it."""
    caplog.set_level(logging.INFO, "gpuslice")
    old = saved_at(tmp_path / "old", OLD_STATE, LATE)  # generation 1
    store = StateStore(tmp_path / "new")
    store.save(HERE_STATE, BOOT)
    store.save(HERE_STATE, BOOT)  # generation 2
    here = store.path
    os.utime(here, ns=(EARLY, EARLY))
    store = StateStore(tmp_path / "new")
    reads = count_reads(monkeypatch)

    assert store.take_over(tmp_path / "old")
    assert store.load() == (HERE_STATE, BOOT)

    assert not old.exists() and here.exists()
    assert reads == {str(old): 1, str(here): 1}, reads
    assert (
        f"{old}: older than {here}, saved since, which holds the state; removed" in caplog.messages
    )
    assert store.save(HERE_STATE, BOOT) == here
    assert json.loads(here.read_bytes())["generation"] == 3


def test_a_state_too_big_to_copy_is_left_and_the_one_here_loaded_from_its_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The old state_dir's file is on another file system and over the size limit: not
    copied, said, left there; the state here (older, of an older gpuslice) is the one
    loaded, from the read that ranked it."""
    caplog.set_level(logging.INFO, "gpuslice")
    (tmp_path / "old").mkdir()
    old = tmp_path / "old" / STATE_FILE_NAME
    with old.open("wb") as f:
        f.truncate(STATE_FILE_MAX + 1)  # sparse: no 16 MiB written
    os.utime(old, ns=(LATE, LATE))
    here = older_gpuslice_file(tmp_path / "new", HERE_STATE, EARLY)
    refuse_rename(monkeypatch)
    store = StateStore(tmp_path / "new")
    reads = count_reads(monkeypatch)

    assert store.take_over(tmp_path / "old")
    assert store.load() == (HERE_STATE, BOOT)

    assert old.exists() and here.exists()
    assert reads == {str(old): 1, str(here): 1}, reads
    assert (
        f"{old}: cannot move it to {here} (larger than {STATE_FILE_MAX >> 20} MiB); left there"
        in caplog.messages
    )


def test_a_state_copied_across_file_systems_keeps_a_time_at_the_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A board without a real-time clock saved it at 1970-01-01 00:00:00: the copy keeps
    that time, as `mv` does (against a stand-in it is judged by it)."""
    old = saved_at(tmp_path / "old", OLD_STATE, 0)
    refuse_rename(monkeypatch)
    store = StateStore(tmp_path / "new")

    assert store.take_over(tmp_path / "old")

    assert not old.exists()
    assert os.lstat(store.path).st_mtime_ns == 0
    assert store.load() == (OLD_STATE, BOOT)


def test_a_copied_state_s_time_is_never_set_through_a_link_put_in_its_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link swapped in for the copy right after it is written: the time the copy is
    given goes to the link itself, never to the file it points at."""
    saved_at(tmp_path / "old", OLD_STATE, LATE)
    victim = tmp_path / "victim"
    victim.write_text("")
    os.utime(victim, ns=(EARLY, EARLY))
    refuse_rename(monkeypatch)
    write_new = state_module._write_new

    def written_then_swapped(path: Path, data: bytes) -> None:
        write_new(path, data)
        path.unlink()
        path.symlink_to(victim)

    monkeypatch.setattr(state_module, "_write_new", written_then_swapped)
    store = StateStore(tmp_path / "new")

    store.take_over(tmp_path / "old")

    assert os.stat(victim).st_mtime_ns == EARLY
    assert victim.read_text() == ""


def test_a_flush_that_gets_no_thread_is_reported_as_eagain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No thread to be had (TasksMax=): the flush failed for a resource short for now, as
    the system would say it, in the words the controller logs (strerror)."""

    class Store:
        def flush(self) -> None:
            pass

    outcomes: list[OSError | None] = []
    flusher = Flusher(Store(), 0.0, outcomes.append)  # type: ignore[arg-type]

    def start(thread: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", start)

    loop = asyncio.new_event_loop()
    try:
        flusher._begin(loop)  # the retry it schedules is never run
    finally:
        loop.close()
    assert len(outcomes) == 1 and outcomes[0] is not None, outcomes
    error = outcomes[0]
    assert error.errno == errno.EAGAIN, error
    assert error.strerror == "cannot start a thread to flush: can't start new thread"
