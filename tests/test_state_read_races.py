"""A state file replaced or removed between the look at it and its read (gpuslice/state.py:
read_found, find_saved, StateStore.take_over, the stand-in's load).

Its modification time, which ranks two files of one generation (an older gpuslice's), came
from an lstat just before the open: a file replaced in between was ranked by one file's time
and loaded with another's bytes. One removed in between (moved here by root, or removed) still
ranked by the time looked at, chose the old state_dir, empty, over a file that is there. The
time is now the open file's (fstat of the descriptor read), and a file gone is chosen again."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuslice.core.scheduler import SavedState
from gpuslice.paths import STATE_FILE_NAME
from gpuslice.state import StateStore, find_saved, read_found
from tests.test_controller import BOOT
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_state_dir_moved import Dirs
from tests.test_state_mutation3 import HERE_STATE, OLD_STATE, older_gpuslice_file
from tests.test_state_reads_once import EARLY, LATE, MIDDLE, saved_at

STALE = SavedState(held=["stale.service"], seq=0)


def before_open(monkeypatch: pytest.MonkeyPatch, path: Path, action: Callable[[], None]) -> None:
    """`action` done once, right before `path` is first opened: after any look at it."""
    real_open = os.open
    done: list[bool] = []

    def opened(name: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(name) == path and not done:
            done.append(True)
            action()
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", opened)


def replaced_by_stale(monkeypatch: pytest.MonkeyPatch, path: Path, staging: Path) -> None:
    """`path` replaced, right before its open, by an older gpuslice's file of STALE saved
    EARLY: the look saw the one it replaced."""
    stale = older_gpuslice_file(staging, STALE, EARLY)
    before_open(monkeypatch, path, lambda: os.replace(stale, path))


def test_a_state_file_s_time_is_that_of_the_bytes_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = older_gpuslice_file(tmp_path / "state", OLD_STATE, LATE)
    replaced_by_stale(monkeypatch, path, tmp_path / "staging")

    found = read_found(path)

    assert found.mtime_ns == EARLY
    assert found.data is not None and found.data["held"] == ["stale.service"]


def test_a_moved_state_replaced_before_its_read_is_ranked_by_what_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two files of an older gpuslice: the old state_dir's, modified LATE when looked at,
    is replaced by one modified EARLY before it is read. The state here (MIDDLE) is the
    newer: it was ranked below the LATE time, and the replacement moved over it."""
    old = older_gpuslice_file(tmp_path / "old", OLD_STATE, LATE)
    older_gpuslice_file(tmp_path / "new", HERE_STATE, MIDDLE)
    replaced_by_stale(monkeypatch, old, tmp_path / "staging")
    store = StateStore(tmp_path / "new")

    assert store.take_over(tmp_path / "old")
    assert store.load() == (HERE_STATE, BOOT)
    assert not old.exists()


def test_a_recorded_state_replaced_before_its_read_is_ranked_by_what_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """find_saved (release-jobs): as take_over, the configured state_dir's file is the newer."""
    recorded, configured = tmp_path / "old", tmp_path / "new"
    old = older_gpuslice_file(recorded, OLD_STATE, LATE)
    here = older_gpuslice_file(configured, HERE_STATE, MIDDLE)
    replaced_by_stale(monkeypatch, old, tmp_path / "staging")

    where, found = find_saved(configured, recorded)

    assert where == configured
    assert found is not None and found.path == here and found.mtime_ns == MIDDLE


def test_a_stand_in_replaced_before_its_read_is_ranked_by_what_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in of the state file's generation, modified LATE when looked at, replaced by
    one modified EARLY: the state file (MIDDLE) is the newer, and loaded."""
    saved_at(tmp_path / "state", OLD_STATE, MIDDLE)  # generation 1
    standin = saved_at(tmp_path / "run", HERE_STATE, LATE)  # generation 1
    stale = saved_at(tmp_path / "staging", STALE, EARLY)  # generation 1
    before_open(monkeypatch, standin, lambda: os.replace(stale, standin))

    assert StateStore(tmp_path / "state", tmp_path / "run").load() == (OLD_STATE, BOOT)
    assert not standin.exists()


def test_a_stand_in_removed_before_its_read_leaves_the_state_file_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Gone since the look: no stand-in, nothing said of one."""
    caplog.set_level(logging.INFO, "gpuslice")
    saved_at(tmp_path / "state", OLD_STATE, MIDDLE)
    standin = saved_at(tmp_path / "run", HERE_STATE, LATE)
    before_open(monkeypatch, standin, standin.unlink)

    assert StateStore(tmp_path / "state", tmp_path / "run").load() == (OLD_STATE, BOOT)
    assert not any(str(standin) in m for m in caplog.messages), caplog.messages


def test_a_state_moved_here_by_root_while_it_is_read_is_loaded_from_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An admin's `mv` of the old state_dir's file to the new one, between the controller's
    look at it and its read: the move found it gone, and the controller loaded the old
    state_dir, empty, with the state beside it."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    old = saved_at(dirs.old, OLD_STATE, LATE)
    dirs.new.mkdir()
    here = dirs.new / STATE_FILE_NAME
    bed = dirs.controller(dirs.new)
    before_open(monkeypatch, old, lambda: os.replace(old, here))

    saved, _ = bed.controller._load_state()

    assert saved == OLD_STATE
    assert dirs.recorded() == f"{dirs.new}\n"


def test_an_old_state_removed_while_it_is_read_leaves_the_one_here_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Files of an older gpuslice: the old state_dir's (LATE when looked at) is removed by
    root before it is read. Ranked by the time looked at, it was chosen over the one here,
    then found gone: the old state_dir, empty, was loaded."""
    caplog.set_level(logging.INFO, "gpuslice")
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    old = older_gpuslice_file(dirs.old, OLD_STATE, LATE)
    older_gpuslice_file(dirs.new, HERE_STATE, EARLY)
    bed = dirs.controller(dirs.new)
    before_open(monkeypatch, old, old.unlink)

    saved, _ = bed.controller._load_state()

    assert saved == HERE_STATE
    assert (
        f"{old}: not there to read (No such file or directory); starting from "
        f"{dirs.new / STATE_FILE_NAME}" in caplog.messages
    )


def test_a_recorded_state_moved_while_it_is_read_is_found_where_it_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """find_saved: the recorded file moved over the configured one (keeping its time)
    between the look and the read; both were then of one time, the tie kept the recorded
    state_dir, and release-jobs loaded it empty."""
    recorded, configured = tmp_path / "old", tmp_path / "new"
    old = older_gpuslice_file(recorded, OLD_STATE, LATE)
    here = older_gpuslice_file(configured, HERE_STATE, EARLY)
    before_open(monkeypatch, old, lambda: os.replace(old, here))

    where, found = find_saved(configured, recorded)

    assert where == configured
    assert found is not None and found.path == here
    store = StateStore(where)
    store.read_ahead = found
    assert store.load() == (OLD_STATE, BOOT)


def test_an_old_state_removed_after_its_read_is_loaded_as_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chosen and read, then removed before the rename: what was chosen is loaded, from the
    read, never nothing."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    old = saved_at(dirs.old, OLD_STATE, LATE)
    bed = dirs.controller(dirs.new)
    real_rename = os.rename

    def removed_first(src: Any, dst: Any) -> None:
        if Path(src) == old:
            old.unlink()
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", removed_first)

    saved, _ = bed.controller._load_state()

    assert saved == OLD_STATE
