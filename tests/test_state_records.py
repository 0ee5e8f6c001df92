"""Which of two state files was saved last, and the names a runtime_dir or a record may take.

Of two state files (state_dir's and the stand-in in runtime_dir, or the old state_dir's and
the new one's after state_dir was edited), the one saved last wins. Told by modification
times, a clock stepped back between two saves (an NTP correction at boot, a board without a
real-time clock that starts in 1970, then syncs) made the stale file win: the units the other
owed a restart or a resume were lost, or a long-finished preemption replayed. Every save now
writes a generation, one higher than any the store has seen; a file without one (an older
gpuslice's) is generation 0, and only two files of one generation are told by their times.

A runtime_dir named as one of the files or directories gpuslice writes in a runtime_dir
(`/run/gpuslice/gate`, `/run/gpuslice/state.json`, ...) was valid, in config.yaml, in the
record of this boot's runtime_dir and in GPUSLICE_RUNTIME_DIR: `gpuslice release-gates`, which
empties RUNTIME_DIR/gate of config.yaml's runtime_dir and of the default's, then removed the
pinned runtime_dir with its env files and its stand-in.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest

from gpuslice import envfiles
from gpuslice import state as state_module
from gpuslice.config import (
    SETTINGS_BY_NAME,
    ConfigError,
    load_config_with_warnings,
    parse_config,
    pin_runtime_dir,
    read_pinned_runtime_dir,
    read_recorded_state_dir,
    runtime_dirs_of_this_boot,
)
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import SavedState
from gpuslice.gatepipes import GatePipes, wake_and_remove
from gpuslice.paths import DEFAULT_RUNTIME_DIR, DEFAULT_STATE_DIR, gate_pipe_dir
from gpuslice.state import GENERATION_MAX, StateStore, saved_in

BOOT = "0f6c/1234"
OLD = SavedState(preempted={"old.service": 1}, seq=1)
NEW = SavedState(preempted={"new.service": 2}, suspended={"sus.service": ((0,), 3)}, seq=3)
# modification times: before a clock was stepped back (a clock ahead, in 2033), and after
# (a board without a real-time clock, in 1970)
AHEAD_NS = 2 * 10**18
BEHIND_NS = 10**9


def state_file(directory: Path, saved: SavedState, generation: int | None, mtime_ns: int) -> None:
    """What `save()` writes, with this generation (None: none, as an older gpuslice wrote),
    modified at `mtime_ns`."""
    store = StateStore(directory)
    store.save(saved, BOOT)
    data = json.loads(store.path.read_text())
    data.pop("generation", None)
    if generation is not None:
        data["generation"] = generation
    store.path.write_text(json.dumps(data))
    os.utime(store.path, ns=(mtime_ns, mtime_ns))


def generation(path: Path) -> int:
    return int(json.loads(path.read_text())["generation"])


# ---- every save is numbered --------------------------------------------------------------


def test_every_save_is_numbered_one_after_any_the_store_has_seen(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state", tmp_path / "run")
    store.save(OLD, BOOT)
    store.save(NEW, BOOT)
    assert generation(store.path) == 2
    restarted = StateStore(tmp_path / "state", tmp_path / "run")
    assert restarted.load() == (NEW, BOOT)
    restarted.save(NEW, BOOT)
    assert generation(restarted.path) == 3


def test_a_file_of_an_older_gpuslice_is_read_without_a_word_and_numbered_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state_file(tmp_path, OLD, None, BEHIND_NS)
    store = StateStore(tmp_path)
    with caplog.at_level(logging.DEBUG, "gpuslice"):
        assert store.load() == (OLD, BOOT)
    assert caplog.records == []
    store.save(OLD, BOOT)
    assert generation(store.path) == 1


def test_an_older_gpuslice_keeps_every_entry_of_the_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A downgrade: the format version is the same, so an older reader does not set the file
    aside as bad; it names the key it does not know, keeps every entry and saves them."""
    StateStore(tmp_path).save(NEW, BOOT)
    before = tuple(k for k in state_module.LATER_FIELDS if k != "generation")
    monkeypatch.setattr(state_module, "LATER_FIELDS", before)
    with caplog.at_level(logging.ERROR, "gpuslice"):
        assert StateStore(tmp_path).load() == (NEW, BOOT)
    assert 'unknown key "generation"' in caplog.text
    assert json.loads((tmp_path / "state.json").read_text())["version"] == 1


@pytest.mark.parametrize("value", [-1, "7", 1.5, True, None, [1], {}, GENERATION_MAX + 1])
def test_a_bad_generation_makes_the_file_bad(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, value: Any
) -> None:
    """Root writes the file, but it is checked as every other field: a generation that is no
    integer 0-GENERATION_MAX leaves no way to tell the file from another, so it is moved
    aside as a bad file is."""
    state_file(tmp_path, OLD, 1, BEHIND_NS)
    data = json.loads((tmp_path / "state.json").read_text())
    (tmp_path / "state.json").write_text(json.dumps({**data, "generation": value}))
    with caplog.at_level(logging.INFO, "gpuslice"):
        assert StateStore(tmp_path).load() == (SavedState(), "")
    assert not (tmp_path / "state.json").exists()
    assert (tmp_path / "state.json.bad").exists()
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert f"{tmp_path}/state.json: save generation " in record.getMessage()
    assert f"expected an integer 0-{GENERATION_MAX}; moved it to" in record.getMessage()


def test_a_generation_at_its_bound_stays_there(tmp_path: Path) -> None:
    state_file(tmp_path, OLD, GENERATION_MAX, BEHIND_NS)
    store = StateStore(tmp_path)
    assert store.load() == (OLD, BOOT)
    store.save(NEW, BOOT)
    assert generation(store.path) == GENERATION_MAX
    assert StateStore(tmp_path).load() == (NEW, BOOT)


# ---- a clock stepped back between two saves ------------------------------------------------


def test_a_stand_in_saved_after_a_clock_step_back_still_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved to state_dir while the clock was ahead, then to the stand-in (state_dir full)
    once it was stepped back: the stand-in holds the last word, though older by its time.
    Judged by times, the state file won, the stand-in was removed, and new.service (owed a
    restart) and sus.service (owed a resume) were forgotten."""
    store = StateStore(tmp_path / "state", tmp_path / "run")
    store.save(OLD, BOOT)
    write_new = state_module._write_new

    def full(path: Path, data: bytes) -> None:
        if path == store.path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_new(path, data)

    monkeypatch.setattr(state_module, "_write_new", full)
    assert store.save(NEW, BOOT) == store.standin
    monkeypatch.undo()
    os.utime(store.path, ns=(AHEAD_NS, AHEAD_NS))
    assert store.standin is not None
    os.utime(store.standin, ns=(BEHIND_NS, BEHIND_NS))

    restarted = StateStore(tmp_path / "state", tmp_path / "run")
    assert restarted.load() == (NEW, BOOT)
    assert restarted.save(NEW, BOOT) == restarted.path  # the disk has room again
    assert generation(restarted.path) == 3
    assert not (tmp_path / "run" / "state.json").exists()


def test_a_stand_in_saved_before_the_state_file_loses_though_modified_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The trace of a controller killed between a save that reached state_dir again and the
    stand-in's removal, the clock stepped back in between: the state file is the later."""
    state_file(tmp_path / "run", OLD, 4, AHEAD_NS)
    state_file(tmp_path / "state", NEW, 5, BEHIND_NS)
    store = StateStore(tmp_path / "state", tmp_path / "run")
    with caplog.at_level(logging.INFO, "gpuslice"):
        assert store.load() == (NEW, BOOT)
    assert not (tmp_path / "run" / "state.json").exists()
    assert f"{tmp_path}/run/state.json: older than {tmp_path}/state/state.json" in caplog.text
    store.save(NEW, BOOT)
    assert generation(store.path) == 6


@pytest.mark.parametrize("later", ["recorded", "configured"])
def test_take_over_keeps_the_state_saved_last_whatever_the_clock_said(
    tmp_path: Path, later: str
) -> None:
    """state_dir edited back and forth: the file saved last is kept and the other removed,
    though the clock made it the older; the next save is numbered after both."""
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    if later == "recorded":
        state_file(old_dir, NEW, 7, BEHIND_NS)
        state_file(new_dir, OLD, 3, AHEAD_NS)
    else:
        state_file(old_dir, OLD, 3, AHEAD_NS)
        state_file(new_dir, NEW, 7, BEHIND_NS)
    assert saved_in(new_dir, old_dir) == (old_dir if later == "recorded" else new_dir)

    store = StateStore(new_dir)
    assert store.take_over(old_dir)
    assert not (old_dir / "state.json").exists()
    assert store.load() == (NEW, BOOT)
    store.save(NEW, BOOT)
    assert generation(store.path) == 8


def test_a_state_that_cannot_be_moved_is_still_numbered_after(tmp_path: Path) -> None:
    """The move fails (the new state_dir cannot be made): the state is read where it is, and
    saves go to the new one numbered after it, so the next start keeps the new one."""
    old_dir = tmp_path / "old"
    state_file(old_dir, OLD, 9, AHEAD_NS)
    (tmp_path / "file").write_text("")
    store = StateStore(tmp_path / "file" / "new", tmp_path / "run")
    assert not store.take_over(old_dir)
    assert StateStore(old_dir).load() == (OLD, BOOT)
    assert store.save(NEW, BOOT) == store.standin
    assert store.standin is not None and generation(store.standin) == 10


def test_two_files_of_an_older_gpuslice_are_told_by_their_times(tmp_path: Path) -> None:
    """No generation in either (generation 0 both): the later modified wins, as before."""
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    state_file(old_dir, NEW, None, AHEAD_NS)
    state_file(new_dir, OLD, None, BEHIND_NS)
    assert saved_in(new_dir, old_dir) == old_dir
    store = StateStore(new_dir)
    assert store.take_over(old_dir)
    assert store.load() == (NEW, BOOT)


def test_a_numbered_file_wins_over_one_of_an_older_gpuslice(tmp_path: Path) -> None:
    """Only a gpuslice with generations wrote a numbered file, after it read the others."""
    state_file(tmp_path / "run", OLD, None, AHEAD_NS)
    state_file(tmp_path / "state", NEW, 1, BEHIND_NS)
    assert StateStore(tmp_path / "state", tmp_path / "run").load() == (NEW, BOOT)


# ---- no runtime_dir named as gpuslice's own files ----------------------------------------

OWN_NAMES = [
    "state.json",  # the stand-in of /run/gpuslice
    ".state.json.tmp",
    "env",  # the env files' directory
    "env/a.service",
    "gate",  # the gates' pipes: `release-gates` removes it
    ".gate.released-42",
    "runtime-dir",  # the record of this boot's runtime_dir
    ".runtime-dir.tmp",
]


def problems_of(text: str) -> list[str]:
    try:
        parse_config(text, "/c")
    except ConfigError as e:
        return e.problems
    return []


@pytest.mark.parametrize("name", OWN_NAMES)
@pytest.mark.parametrize("parent", ["", "a/"])
def test_a_runtime_dir_named_as_gpuslices_own_file_is_refused(name: str, parent: str) -> None:
    value = f"{DEFAULT_RUNTIME_DIR}/{parent}{name}"
    assert problems_of(f"gpus: 2\nruntime_dir: {value}\n") == [
        f'/c:2: runtime_dir: invalid value "{value}" '
        f"(allowed: {SETTINGS_BY_NAME['runtime_dir'].allowed})"
    ]


def test_the_refusal_names_the_file_line_and_key(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("log_level: info\n\nruntime_dir: /run/gpuslice/gate\n")
    with pytest.raises(ConfigError) as caught:
        load_config_with_warnings(path)
    [problem] = caught.value.problems
    assert problem.startswith(f'{path}:3: runtime_dir: invalid value "/run/gpuslice/gate" ')
    assert '"env" or "gate", nor one of them followed by "." or "-"' in problem


@pytest.mark.parametrize(
    "value",
    [
        "/run/gpuslice/a",
        "/run/gpuslice/x.env",
        "/run/gpuslice/a-gate/b",
        "/run/gpuslice/.x",
        # a name that only begins as one of ours is an admin's
        "/run/gpuslice/gateway",
        "/run/gpuslice/environment",
        "/run/gpuslice/env2",
        "/run/gpuslice/runtime-dirs",
    ],
)
def test_other_runtime_dirs_are_still_valid(value: str) -> None:
    assert problems_of(f"runtime_dir: {value}\n") == []


def test_a_runtime_dir_pinned_under_the_last_version_stays_pinned(tmp_path: Path) -> None:
    """An upgrade within a boot: the record names the runtime_dir the gates' drop-ins name
    (valid for the gpuslice that wrote it). Refused by a rule wider than gpuslice's own
    names, the new controller and generator switched to /run/gpuslice mid-boot: the
    holders' env files and the stand-in state were left behind."""
    record = tmp_path / "runtime-dir"
    record.write_text("/run/gpuslice/gateway\n")
    assert read_pinned_runtime_dir(record) == "/run/gpuslice/gateway"
    assert runtime_dirs_of_this_boot(None, record, DEFAULT_RUNTIME_DIR) == [
        "/run/gpuslice/gateway",
        DEFAULT_RUNTIME_DIR,
    ]


@pytest.mark.parametrize("name", OWN_NAMES)
def test_a_pinned_runtime_dir_named_as_gpuslices_own_file_is_not_taken(
    tmp_path: Path, name: str
) -> None:
    """The record of this boot's runtime_dir, and what the generator told gpuslice.service,
    win over config.yaml until the next boot: neither may name what config.yaml may not."""
    record = tmp_path / "runtime-dir"
    value = f"{DEFAULT_RUNTIME_DIR}/{name}"
    record.write_text(f"{value}\n")
    assert read_pinned_runtime_dir(record) is None
    assert runtime_dirs_of_this_boot(value, record, DEFAULT_RUNTIME_DIR) == [DEFAULT_RUNTIME_DIR]


def test_every_name_gpuslice_writes_in_a_runtime_dir_is_refused_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule and the writers agree: every name saved, recorded, made, renamed or moved
    aside in a runtime_dir (here made in tmp_path) is refused as a runtime_dir below it."""
    names: set[str] = set()
    replace, rename = os.replace, os.rename

    def spy(real: Any) -> Any:
        def noted(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
            for path in (Path(src), Path(dst)):
                if tmp_path in path.parents:
                    names.add(path.relative_to(tmp_path).parts[0])
            real(src, dst)

        return noted

    monkeypatch.setattr(os, "replace", spy(replace))
    monkeypatch.setattr(os, "rename", spy(rename))
    (tmp_path / "disk").write_text("")  # state_dir cannot be made: the stand-in is written
    StateStore(tmp_path / "disk" / "state", tmp_path).save(NEW, BOOT)
    envfiles.write(str(tmp_path), "a.service", [Gpu(0)])
    GatePipes(gate_pipe_dir(str(tmp_path))).expect("a.service")
    assert pin_runtime_dir(tmp_path / "runtime-dir", DEFAULT_RUNTIME_DIR)
    names.update(p.name for p in tmp_path.iterdir())
    wake_and_remove(gate_pipe_dir(str(tmp_path)))
    names.discard("disk")
    assert names >= {"state.json", "env", "gate", "runtime-dir"}
    assert any(re.fullmatch(r"\.runtime-dir\.tmp-[0-9]+-[0-9]+", n) for n in names)
    assert any(n.startswith(".gate.released-") for n in names)
    refused = SETTINGS_BY_NAME["runtime_dir"].valid
    assert {n for n in names if refused(f"{DEFAULT_RUNTIME_DIR}/{n}")} == set()
    assert {n for n in names if refused(f"{DEFAULT_RUNTIME_DIR}/a/{n}")} == set()


def test_state_dir_and_runtime_dir_never_name_one_directory() -> None:
    """A guard: the two live below two bases neither of which is in the other, so no valid
    state_dir holds a runtime_dir's files or the reverse (a stand-in in state_dir would be
    the state file itself)."""
    for a, b in (
        (DEFAULT_STATE_DIR, DEFAULT_RUNTIME_DIR),
        (DEFAULT_RUNTIME_DIR, DEFAULT_STATE_DIR),
    ):
        assert not (a + "/").startswith(b + "/")
    assert problems_of(f"state_dir: {DEFAULT_RUNTIME_DIR}\n") != []
    assert problems_of(f"runtime_dir: {DEFAULT_STATE_DIR}\n") != []


# ---- the record of the state_dir in use ---------------------------------------------------


@pytest.mark.parametrize(
    "name", ["state.json", "state.json.bad", ".state.json.tmp", ".state-dir.tmp", "a/state.json"]
)
def test_a_state_dir_record_naming_gpuslices_own_file_is_ignored(tmp_path: Path, name: str) -> None:
    """As config.yaml's state_dir: the controller removes a state file in the directory the
    record names, which must be a state_dir config.yaml could give."""
    record = tmp_path / "state-dir"
    record.write_text(f"{tmp_path}/{name}\n")
    assert read_recorded_state_dir(record) is None
    record.write_text(f"{tmp_path}/a/b/\n")
    assert read_recorded_state_dir(record) == f"{tmp_path}/a/b"
