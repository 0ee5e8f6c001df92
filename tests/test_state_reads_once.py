"""A start reads each state file once: one bounded read, parsed once, and the newer of the
state_dir's, a moved state_dir's and the runtime_dir's stand-in chosen among what was read
(gpuslice/state.py: Found).

Each file was read once for its save generation, then again for its content: a state file
moved from the old state_dir beside a stand-in was read three times (take_over's rank, the
stand-in's comparison, the load), up to 16 MiB each; and a file replaced between the reads was
ranked by one content and loaded with another."""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuslice import cli as cli_module
from gpuslice import paths, safefile
from gpuslice.cli import main
from gpuslice.config import Config
from gpuslice.core.scheduler import SavedState
from gpuslice.paths import STATE_FILE_NAME
from gpuslice.state import StateStore
from tests.test_controller import BOOT
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_state_dir_moved import OWED, Dirs

EARLY, MIDDLE, LATE = 10**18, 12 * 10**17, 15 * 10**17


def count_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How many times each state file is read (safefile.read_with_stat, which every read of
    one goes through), by path."""
    reads: Counter[str] = Counter()
    read_with_stat = safefile.read_with_stat

    def counted(path: Any, limit: int | None, **kwargs: Any) -> tuple[bytes, os.stat_result]:
        if Path(path).name == STATE_FILE_NAME:
            reads[str(path)] += 1
        return read_with_stat(path, limit, **kwargs)

    monkeypatch.setattr(safefile, "read_with_stat", counted)
    return reads


def saved_at(state_dir: Path, state: SavedState, when: int) -> Path:
    StateStore(state_dir).save(state, BOOT)  # generation 1, as any store's first save
    path = state_dir / STATE_FILE_NAME
    os.utime(path, ns=(when, when))
    return path


def test_a_start_that_moves_the_state_beside_a_stand_in_reads_each_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recorded state_dir's file is the newest; config.yaml's state_dir has an older one,
    and runtime_dir an older stand-in. The moved file was read three times (its rank in
    take_over, its rank against the stand-in's, its content), the others once."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    old = saved_at(dirs.old, OWED, LATE)
    new = saved_at(dirs.new, SavedState(held=["b.service"]), EARLY)
    bed = dirs.controller(dirs.new)
    standin = saved_at(Path(bed.config.runtime_dir), SavedState(held=["x.service"]), MIDDLE)
    reads = count_reads(monkeypatch)

    saved, _ = bed.controller._load_state()

    assert saved == OWED
    assert not standin.exists() and not old.exists()  # the older ones removed
    assert reads == {str(old): 1, str(new): 1, str(standin): 1}, reads


def test_a_start_beside_a_stand_in_reads_the_state_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No move: the state file was read for its rank against the stand-in, then again."""
    path = saved_at(tmp_path / "state", OWED, LATE)
    standin = saved_at(tmp_path / "run", SavedState(held=["x.service"]), EARLY)
    reads = count_reads(monkeypatch)

    assert StateStore(tmp_path / "state", tmp_path / "run").load() == (OWED, BOOT)
    assert reads == {str(path): 1, str(standin): 1}, reads


def test_a_move_across_file_systems_copies_the_bytes_it_ranked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rename(2) fails with EXDEV: the copy was one more read of the old file."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    old = saved_at(dirs.old, OWED, LATE)
    bed = dirs.controller(dirs.new)

    def rename(src: Any, dst: Any) -> None:
        raise OSError(18, os.strerror(18))  # EXDEV

    monkeypatch.setattr(os, "rename", rename)
    reads = count_reads(monkeypatch)

    saved, _ = bed.controller._load_state()

    assert saved == OWED
    assert os.stat(dirs.new / STATE_FILE_NAME).st_mtime_ns == LATE
    assert reads == {str(old): 1}, reads


def test_a_state_that_cannot_be_moved_is_loaded_where_it_is_from_its_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new state_dir cannot be written (its parent is a file): the old file was read for
    its rank, then again by the store that loads it there."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    old = saved_at(dirs.old, OWED, LATE)
    (dirs.base / "file").write_text("")
    bed = dirs.controller(dirs.base / "file" / "new")
    reads = count_reads(monkeypatch)

    saved, _ = bed.controller._load_state()

    assert saved == OWED and old.exists()
    assert reads == {str(old): 1}, reads
    assert bed.controller.store.read_ahead is None  # its bytes not kept for nothing


def test_release_jobs_reads_each_state_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpuslice release-jobs` chose the state_dir by both files' ranks, then read the chosen
    one again to load it."""
    dirs = Dirs(tmp_path)
    dirs.record.write_text(f"{dirs.old}\n")
    old = saved_at(dirs.old, SavedState(preempted={"low.service": 1}, seq=1), LATE)
    new = saved_at(dirs.new, SavedState(), EARLY)
    config = Config(state_dir=str(dirs.new), runtime_dir=str(tmp_path / "run"))
    monkeypatch.setattr(cli_module, "load_config_with_warnings", lambda path: (config, []))
    monkeypatch.setattr(paths, "STATE_DIR_RECORD", str(dirs.record))

    def systemctl(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        out = "ActiveState=inactive\nFreezerState=running\n" if command[1] == "show" else ""
        return subprocess.CompletedProcess(command, 0, out, "")

    monkeypatch.setattr(subprocess, "run", systemctl)
    # low.service handed back is saved, after a look for a save since the read, which reads
    # the file again (tests/test_release_jobs_state.py): the read to choose and load is this
    # test's
    saves: list[SavedState] = []
    monkeypatch.setattr(cli_module, "_record_released", lambda *args: saves.append(args[3]))
    reads = count_reads(monkeypatch)
    result = CliRunner().invoke(main, ["release-jobs", "--config", str(tmp_path / "c.yaml")])
    assert result.exit_code == 0, result.output
    assert "low.service was preempted and nothing will start it again" in result.stderr
    assert reads == {str(old): 1, str(new): 1}, reads
    assert saves == [SavedState(seq=1)]


def test_the_state_loaded_is_the_one_ranked_against_the_stand_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state file, newer than the stand-in, is replaced by an older state right after it
    was ranked (another gpuslice process rewriting it): the stand-in was removed as the
    older, then the replacement loaded, older than the stand-in removed for it. Read once,
    what is loaded is what was ranked."""
    path = saved_at(tmp_path / "state", OWED, LATE)
    standin = saved_at(tmp_path / "run", SavedState(held=["x.service"]), MIDDLE)
    stale = tmp_path / "stale"
    saved_at(stale, SavedState(held=["stale.service"]), EARLY)
    read_with_stat = safefile.read_with_stat
    replaced: list[Path] = []

    def replaced_after_read(
        path_read: Any, limit: int | None, **kwargs: Any
    ) -> tuple[bytes, os.stat_result]:
        data = read_with_stat(path_read, limit, **kwargs)
        if Path(path_read) == path and not replaced:
            os.replace(stale / STATE_FILE_NAME, path)
            replaced.append(path)
        return data

    monkeypatch.setattr(safefile, "read_with_stat", replaced_after_read)
    assert StateStore(tmp_path / "state", tmp_path / "run").load() == (OWED, BOOT)
    assert replaced and not standin.exists()
