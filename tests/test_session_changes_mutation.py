"""This session's changes at their edges: the words of the allowed values of state_dir and
runtime_dir, the record that names no state_dir, which of two state files was saved last
(`_rank`: the save generation, a file with none or one that cannot be read being of
generation 0, told by its time alone) and how the next save is numbered after a take-over,
journald entries past its field limit split into several, an NVML call's fork of the
inventory taken back on the loop, and what a resume did, in words."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from gpuslice.checkpoint import Resumed
from gpuslice.config import SETTINGS_BY_NAME, Config, _own_names, read_recorded_state_dir
from gpuslice.core.scheduler import SavedState
from gpuslice.inventory import Inventory
from gpuslice.journal import Journal, entries
from gpuslice.ladder import resumed_words
from gpuslice.state import (
    GENERATION_MAX,
    STATE_FILE_MAX,
    BadFile,
    Problems,
    StateStore,
    parse,
    saved_in,
)
from tests.test_inventory import StubNvml, make_inventory, waiting_inventory

BOOT = "0f6c/1234"
OWED = SavedState(preempted={"owed.service": 1}, seq=1)
EARLY, LATE = 10**18, 15 * 10**17


def saved(directory: Path, generation: int | None, mtime_ns: int, extra: str = "") -> Path:
    """A state file as save() writes it, with this generation (None: none, as an older
    gpuslice wrote), modified at `mtime_ns`; `extra` (raw JSON members) goes first."""
    store = StateStore(directory)
    store.save(OWED, BOOT)
    data = json.loads(store.path.read_text())
    data.pop("generation")
    if generation is not None:
        data["generation"] = generation
    text = json.dumps(data)
    store.path.write_text("{" + extra + text[1:] if extra else text)
    os.utime(store.path, ns=(mtime_ns, mtime_ns))
    return store.path


def written_generation(store: StateStore) -> int:
    return int(json.loads(store.path.read_text())["generation"])


# ---- config.yaml's path settings and the record -----------------------------------------


def test_the_names_a_path_setting_refuses_are_said_with_what_may_follow_or_precede() -> None:
    rest = ', nor one of them followed by "." or "-", nor any of these after a "."'
    assert _own_names(("a",)) == '"a"' + rest
    assert _own_names(("a", "b")) == '"a" or "b"' + rest
    assert _own_names(("a", "b", "c")) == '"a", "b" or "c"' + rest
    assert SETTINGS_BY_NAME["state_dir"].allowed.endswith(
        '; with no name below it that is "state-dir" or "state.json"'
        + rest
        + ": gpuslice names its own files there so"
    )
    assert SETTINGS_BY_NAME["runtime_dir"].allowed.endswith(
        '; with no name below it that is "runtime-dir", "state.json", "env" or "gate"'
        + rest
        + ": gpuslice names its own files there so"
    )


@pytest.mark.parametrize("below", ["", "/", "/x"])
def test_a_record_never_names_itself_whatever_its_name(tmp_path: Path, below: str) -> None:
    """The record is a file, neither it nor a directory below it a state_dir: not only when
    its name is one of gpuslice's own (paths.STATE_DIR_RECORD's is)."""
    record = tmp_path / "record"
    record.write_text(f"{record}{below}\n")
    assert read_recorded_state_dir(record) is None
    record.write_text(f"{tmp_path}/records\n")  # a name that begins with its name is another
    assert read_recorded_state_dir(record) == f"{tmp_path}/records"


# ---- which of two state files was saved last --------------------------------------------


def test_a_bad_generation_is_shown_in_the_reason() -> None:
    with pytest.raises(BadFile) as e:
        parse(b'{"version": 1, "generation": -1}', Problems())
    assert str(e.value) == f"save generation -1, expected an integer 0-{GENERATION_MAX}"


def test_a_file_too_big_to_be_ours_is_of_generation_0(tmp_path: Path) -> None:
    """Past STATE_FILE_MAX it is no file save() wrote, whatever generation it holds: the
    configured state_dir's file of generation 1, though older, is the later saved."""
    recorded, configured = tmp_path / "recorded", tmp_path / "configured"
    big = saved(recorded, 9, LATE)
    with open(big, "ab") as f:
        f.write(b" " * STATE_FILE_MAX)  # still valid JSON, read in full
    os.utime(big, ns=(LATE, LATE))
    saved(configured, 1, EARLY)
    assert saved_in(configured, recorded) == configured


def test_a_link_at_the_state_files_name_is_not_followed_to_rank_it(tmp_path: Path) -> None:
    """A symlink there is of generation 0, whatever the file it points to holds."""
    recorded, configured, elsewhere = (tmp_path / n for n in ("recorded", "configured", "x"))
    saved(recorded, 1, EARLY)
    target = saved(elsewhere, 9, LATE)
    configured.mkdir()
    (configured / "state.json").symlink_to(target)
    assert saved_in(configured, recorded) == recorded


def test_a_duplicated_generation_counts_its_last_value(tmp_path: Path) -> None:
    recorded, configured = tmp_path / "recorded", tmp_path / "configured"
    saved(recorded, 5, EARLY, extra='"generation": 1, ')
    saved(configured, 3, LATE)
    assert saved_in(configured, recorded) == recorded


@pytest.mark.parametrize("newer", ["older gpuslice's", "bad"])
def test_a_file_of_no_generation_and_a_bad_one_are_told_by_their_times(
    tmp_path: Path, newer: str
) -> None:
    """Both are of generation 0 (none written, none to read): the later modified wins."""
    dirs = {"older gpuslice's": tmp_path / "a", "bad": tmp_path / "b"}
    times = {n: LATE if n == newer else EARLY for n in dirs}
    saved(dirs["older gpuslice's"], None, times["older gpuslice's"])
    bad = saved(dirs["bad"], 4, times["bad"])
    bad.write_text("not JSON")
    os.utime(bad, ns=(times["bad"], times["bad"]))
    assert saved_in(dirs["older gpuslice's"], dirs["bad"]) == dirs[newer]
    assert saved_in(dirs["bad"], dirs["older gpuslice's"]) == dirs[newer]


# ---- the next save after a take-over ----------------------------------------------------


@pytest.mark.parametrize(("mine", "theirs"), [(5, 2), (2, 7)])
def test_the_save_after_a_take_over_is_numbered_after_both_files(
    tmp_path: Path, mine: int, theirs: int
) -> None:
    """Whichever is kept: the other's number was seen, and a file saved after both must be
    ranked after both."""
    here, old = tmp_path / "here", tmp_path / "old"
    saved(here, mine, LATE if mine > theirs else EARLY)
    saved(old, theirs, EARLY if mine > theirs else LATE)
    store = StateStore(here)
    assert store.take_over(old)
    assert not (old / "state.json").exists()
    store.save(OWED, BOOT)
    assert written_generation(store) == max(mine, theirs) + 1


def test_an_older_gpuslices_file_taken_over_is_followed_by_generation_1(tmp_path: Path) -> None:
    here, old = tmp_path / "here", tmp_path / "old"
    saved(old, None, EARLY)
    store = StateStore(here)
    assert store.take_over(old)
    store.save(OWED, BOOT)
    assert written_generation(store) == 1


def test_a_take_over_never_numbers_the_store_back(tmp_path: Path) -> None:
    """The store saved three times (its file gone since): a file of generation 1 taken over
    is followed by generation 4, not by a number it already wrote."""
    here, old = tmp_path / "here", tmp_path / "old"
    store = StateStore(here)
    for _ in range(3):
        store.save(OWED, BOOT)
    store.path.unlink()
    saved(old, 1, EARLY)
    assert store.take_over(old)
    store.save(OWED, BOOT)
    assert written_generation(store) == 4


# ---- journald entries past its field limit ----------------------------------------------

M, P = ("MESSAGE", "m"), ("PRIORITY", "3")


def unit_fields(*names: str) -> list[tuple[str, str]]:
    return [f for n in names for f in (("OBJECT_SYSTEMD_UNIT", n), ("GPUSLICE_UNIT", n))]


def test_an_entry_of_exactly_the_most_fields_goes_as_one() -> None:
    fields = [M, P, ("A", "1"), ("B", "2")]
    assert entries(fields, max_fields=4) == [fields]


def test_fields_given_several_times_are_shared_out_in_whole_groups() -> None:
    """Each entry: every field given once, then as many whole units (both their fields) as
    fit; a unit's two fields given twice are several too."""
    assert entries([M, P, *unit_fields("a", "b")], max_fields=5) == [
        [M, P, *unit_fields("a")],
        [M, P, *unit_fields("b")],
    ]
    assert entries([M, P, *unit_fields("a", "b", "c")], max_fields=7) == [
        [M, P, *unit_fields("a", "b")],
        [M, P, *unit_fields("c")],
    ]
    one_key = [M, P, ("U", "1"), ("U", "2")]
    assert entries(one_key, max_fields=3) == [[M, P, ("U", "1")], [M, P, ("U", "2")]]


@pytest.mark.parametrize(
    "fields",
    [
        [M, P, ("A", "1"), ("B", "2"), ("C", "3")],  # nothing to share out
        [M, P, ("A", "1"), *unit_fields("a", "b")],  # no room for one whole unit
    ],
)
def test_too_many_fields_given_once_is_said(fields: list[tuple[str, str]]) -> None:
    once = sum(1 for k, _ in fields if [x for x, _ in fields].count(k) == 1)
    with pytest.raises(ValueError) as e:
        entries(fields, max_fields=4)
    assert str(e.value) == f"an entry of {len(fields)} fields, {once} of them different"


def test_a_journal_says_why_an_entry_could_not_be_split(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = Journal(str(tmp_path / "no-journald"))
    fields = [(f"F{i}", "x") for i in range(961)]
    with caplog.at_level(logging.WARNING, "gpuslice"):
        assert not journal.send(fields)
    assert journal.failures == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot write to the journal at {tmp_path}/no-journald: an entry of 961 fields, 961 of "
        "them different; decisions are logged as plain lines, not in their units' own journals "
        "(said once until it works)"
    ]


# ---- an NVML call's fork of the inventory -----------------------------------------------


def test_a_call_in_time_is_taken_back_whole_a_late_one_without_its_books(
    tmp_path: Path,
) -> None:
    inventory, _ = make_inventory(tmp_path, StubNvml(), Config(gpus=2))
    twin = inventory.fork()
    assert twin.remember({0: "GPU-X"})
    inventory.adopt(twin)
    assert not inventory.remember({0: "GPU-X"})  # booked by the call already
    late = inventory.fork()
    assert late.remember({1: "GPU-Y"})
    inventory.adopt(late, late=True)
    assert inventory.remember({1: "GPU-Y"})  # the late call's booking was not taken


def test_a_late_call_adds_its_own_errors_to_the_loops(tmp_path: Path) -> None:
    inventory, _ = make_inventory(tmp_path, StubNvml())
    inventory.errors = 3
    twin = inventory.fork()
    twin.errors += 2  # the call's
    inventory.errors += 1  # the loop's, meanwhile
    inventory.adopt(twin, late=True)
    assert inventory.errors == 6


def test_a_late_call_that_changed_no_health_leaves_the_loops(tmp_path: Path) -> None:
    """A call forked while NVML was not ready answers late, having changed nothing;
    meanwhile a retry in time found NVML ready: that stands, not the late "waiting"."""
    nvml = StubNvml(available=False)
    inventory = waiting_inventory(tmp_path, nvml, Config(gpus=1, driver_wait=60))
    assert inventory.health.state == "waiting"
    late = inventory.fork()
    nvml.available = True
    retry = inventory.fork()
    assert retry.retry()
    inventory.adopt(retry)
    inventory.adopt(late, late=True)
    assert inventory.available
    assert inventory.health.state == "ready"


def test_only_a_fork_is_taken_back(tmp_path: Path) -> None:
    inventory, _ = make_inventory(tmp_path, StubNvml())
    with pytest.raises(AssertionError, match=r"^adopt takes a fork$"):
        inventory.adopt(Inventory(Config(gpus=1), nvml=StubNvml()))


# ---- what a resume did, in words --------------------------------------------------------


def test_a_resume_that_only_unlocked_says_nothing_was_restored() -> None:
    assert resumed_words(Resumed(0.34, (), (7,))) == (
        "unlocked in 0.3 s: cuda-checkpoint found no process of it checkpointed, nothing restored"
    )
