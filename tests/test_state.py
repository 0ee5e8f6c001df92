"""gpuslice.state: no state file may keep the controller (and so every GPU job) from starting.

Each bad input below crashed `StateStore.load()` or the `Scheduler.load()` after it (issue 8):
the controller then looped until systemd's start limit failed it for good. Now a file that is
not exactly what `save()` writes costs one error line naming the file and the reason; a bad
file is moved to state.json.bad; bad entries are dropped and the valid ones kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.core.scheduler import SavedState, Scheduler
from gpuslice.state import STATE_FILE_MAX, Flusher, StateStore, saved_fields
from gpuslice.unitfiles import UNIT_NAME_MAX
from tests.core_builders import BG, sized, spec

GOOD: dict[str, Any] = {
    "version": 1,
    "boot_id": "0f6c/1234",
    "holders": {"asr.service": [[0], "running", 4, ""]},
    "preempted": {"vlm.service": 3},
    "held": ["train.service"],
    "finished": ["done.service"],
    "failed": ["bad.service"],
    "seq": 5,
    "suspended": {},
    "frozen_for": {},
    "started": [],
    "terms": {},
    "thaw_owed": [],
    "requeued": [],
    "wait_failed": [],
    "stopped_by_shutdown": [],
    "refills": [],
    "checkpointed": {},
    "remained": [],
}
GOOD_STATE = SavedState(
    holders={"asr.service": ((0,), "running", 4, "")},
    preempted={"vlm.service": 3},
    held=["train.service"],
    finished=["done.service"],
    failed=["bad.service"],
    seq=5,
)
# the Preempt= ladder's entries: a unit frozen beside another, one suspended
LADDER = {
    **GOOD,
    "holders": {"asr.service": [[0], "running", 4, ""], "emb.service": [[0], "frozen", 1, ""]},
    "suspended": {"ocr.service": [[1], 2]},
    "frozen_for": {"emb.service": ["asr.service"]},
}


def good(**changes: Any) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


def load(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> tuple[SavedState, str, list[logging.LogRecord]]:
    (tmp_path / "state.json").write_bytes(content)
    with caplog.at_level(logging.DEBUG):
        saved, boot_id = StateStore(tmp_path).load()
    records = [r for r in caplog.records if r.name.startswith("gpuslice")]
    # whatever was loaded, the scheduler takes it without raising
    names = set(saved.holders) | set(saved.preempted)
    Scheduler([0, 1], {n: spec(n, 10) for n in names}).load(saved)
    return saved, boot_id, records


def one_error(records: list[logging.LogRecord], *words: str) -> str:
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.ERROR
    message = records[0].getMessage()
    for word in words:
        assert word in message
    return message


# ---- the file as a whole is bad: moved aside, start from systemd -------------------------


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"[]", "expected a JSON object, got a list"),
        (b"null", "expected a JSON object, got null"),
        (b'"state"', 'expected a JSON object, got "state"'),
        (b"", "not JSON"),
        (b'{"version":1', "not JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"version":1,"seq":NaN}', "not JSON (NaN is not a number)"),
        (b'{"version":1,"seq":-Infinity}', "not JSON (-Infinity is not a number)"),
        (b"[" * 200_000 + b"]" * 200_000, "not JSON this controller can read (nested too deeply)"),
        (b'{"version":1,"seq":' + b"9" * 5000 + b"}", "not JSON"),
        (b'{"version":2}', "format version 2, expected 1"),
        (b'{"version":true}', "format version true, expected 1"),
        (b'{"version":1.0}', "format version 1.0, expected 1"),
        (b'{"boot_id":"x"}', "format version null, expected 1"),
    ],
)
def test_a_bad_file_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, reason: str
) -> None:
    saved, boot_id, records = load(tmp_path, content, caplog)
    assert (saved, boot_id) == (SavedState(), "")
    one_error(records, f"{tmp_path / 'state.json'}: {reason}", "state.json.bad")
    assert not (tmp_path / "state.json").exists()
    assert (tmp_path / "state.json.bad").read_bytes() == content


@pytest.mark.parametrize(
    ("mode", "reason"),
    [(0o666, "writable by others (mode 0666)"), (0o602, "writable by others (mode 0602)")],
)
def test_a_state_file_others_can_write_is_not_trusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, reason: str
) -> None:
    """Anyone could have written its holders and grants (a GPU booked for a unit that runs
    on another, then granted beside it): moved aside as any bad file, its content kept for
    the admin. Group-writable by root's group (or the controller's own) is root's still."""
    path = tmp_path / "state.json"
    path.write_bytes(good())
    path.chmod(mode)
    with caplog.at_level(logging.DEBUG):
        assert StateStore(tmp_path).load() == (SavedState(), "")
    records = [r for r in caplog.records if r.name.startswith("gpuslice")]
    one_error(records, f"{path}: {reason}", "state.json.bad")
    assert (tmp_path / "state.json.bad").read_bytes() == good() and not path.exists()
    path.write_bytes(good())
    path.chmod(0o664)
    os.chown(path, -1, os.getegid())
    assert StateStore(tmp_path).load() == (GOOD_STATE, "0f6c/1234")


def test_a_state_file_another_user_owns_is_not_trusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(good())
    owner = path.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # the file is another's then
    with caplog.at_level(logging.DEBUG):
        assert StateStore(tmp_path).load() == (SavedState(), "")
    records = [r for r in caplog.records if r.name.startswith("gpuslice")]
    one_error(records, f"{path}: owned by UID {owner}, not the controller's")
    assert (tmp_path / "state.json.bad").read_bytes() == good()


def test_holders_as_a_list(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 8's first report: AttributeError ('list' has no attribute 'items')."""
    saved, _boot, records = load(tmp_path, b'{"version":1,"holders":[]}', caplog)
    assert saved == SavedState()
    one_error(records, "holders: expected an object, got a list", "state.json.bad")
    assert not (tmp_path / "state.json").exists()


def test_only_a_version(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved, boot_id, records = load(tmp_path, b'{"version":1}', caplog)
    assert (saved, boot_id) == (SavedState(), "")
    message = one_error(records, "no 'boot_id'", "starting from what systemd reports")
    assert "valid ones" not in message


def test_the_bad_file_is_replaced_each_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    load(tmp_path, b"[]", caplog)
    caplog.clear()
    load(tmp_path, b"null", caplog)
    assert (tmp_path / "state.json.bad").read_bytes() == b"null"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json.bad"]


def test_a_file_over_16_mib(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    with open(path, "wb") as f:
        f.truncate(STATE_FILE_MAX + 1)  # sparse: instant
    with caplog.at_level(logging.ERROR):
        assert StateStore(tmp_path).load() == (SavedState(), "")
    one_error(caplog.records, "larger than 16 MiB", "state.json.bad")
    assert (tmp_path / "state.json.bad").stat().st_size == STATE_FILE_MAX + 1


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink", "dangling symlink", "socket"])
def test_not_a_regular_file(tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str) -> None:
    """A FIFO must not block the start (nobody writes to it); a symlink is not followed."""
    path = tmp_path / "state.json"
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(GOOD))
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to(target)
    elif kind == "dangling symlink":
        path.symlink_to(tmp_path / "missing")
    else:
        import socket

        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    with caplog.at_level(logging.ERROR):
        assert StateStore(tmp_path).load() == (SavedState(), "")
    one_error(caplog.records, "not a regular file", "moved it to", "state.json.bad")
    assert not path.exists() and not path.is_symlink()
    assert json.loads(target.read_text()) == GOOD  # a symlink's target is left alone


def test_cannot_move_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The .bad name is taken by a directory: still one line, still a start."""
    (tmp_path / "state.json.bad").mkdir()
    (tmp_path / "state.json.bad" / "x").touch()
    saved, _boot, records = load(tmp_path, b"[]", caplog)
    assert saved == SavedState()
    one_error(records, "could not move it to", "starting from what systemd reports")


def test_no_file_no_directory_no_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        assert StateStore(tmp_path / "missing").load() == (SavedState(), "")
        assert StateStore(tmp_path).load() == (SavedState(), "")
    assert caplog.records == []


# ---- bad entries: dropped, the rest kept --------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "kept", "reason"),
    [
        (  # issue 8: a holder [[0]] (ValueError: not enough values to unpack)
            {"holders": {"asr.service": [[0]], "tts.service": [[1], "running", 2, ""]}},
            {"holders": {"tts.service": ((1,), "running", 2, "")}},
            'holders: dropped "asr.service": expected [GPUs, phase, seq, stopping_for]',
        ),
        (  # issue 8: int("x")
            {"seq": "x"},
            {"seq": 4},  # the highest seq the entries carry
            'seq: "x" is no sequence number',
        ),
        (  # issue 8: list(5)
            {"held": 5},
            {"held": []},
            "held: expected a list, got 5",
        ),
        (
            {"holders": {"asr.service": [[0], "paused", 4, ""]}},
            {"holders": {}},
            'phase "paused" is not one of starting, running, stopping',
        ),
        (
            {"holders": {"asr.service": [[0], "running", -1, ""]}},
            {"holders": {}},
            "seq -1",
        ),
        (
            {"holders": {"asr.service": [[0], "running", True, ""]}},
            {"holders": {}},
            "seq true",
        ),
        (
            {"holders": {"asr.service": [[-1], "running", 4, ""]}},
            {"holders": {}},
            "GPUs must be a list of indices 0-1023",
        ),
        (
            {"holders": {"asr.service": [[1024], "running", 4, ""]}},
            {"holders": {}},
            "GPUs must be a list of indices 0-1023",
        ),
        (
            {"holders": {"asr.service": [[0, 0], "running", 4, ""]}},
            {"holders": {}},
            "a GPU listed twice",
        ),
        (
            {"holders": {"asr.service": [[0.0], "running", 4, ""]}},
            {"holders": {}},
            "GPUs must be a list",
        ),
        (
            {"holders": {"asr.service": [[0], "stopping", 4, "../../etc"]}},
            {"holders": {}},
            'stopping for "../../etc", not a unit name',
        ),
        (
            {"holders": {"asr": [[0], "running", 4, ""]}},
            {"holders": {}},
            'holders: dropped "asr": not a unit name',
        ),
        (
            {"holders": {"w@.service": [[0], "running", 4, ""]}},
            {"holders": {}},
            'holders: dropped "w@.service": not a unit name',
        ),
        (
            {"seq": -3},
            {"seq": 4},
            "seq: -3 is no sequence number",
        ),
        (
            {"seq": 1 << 64},
            {"seq": 4},
            "seq: 18446744073709551616 is no sequence number",
        ),
        (
            {"seq": 2},
            {"seq": 4},
            "seq: 2 is below the entries it numbered; using 4",
        ),
        (
            {"preempted": {"vlm.service": "3", "x.service": 1}},
            {"preempted": {"x.service": 1}},
            'preempted: dropped "vlm.service": seq "3"',
        ),
        (
            {"preempted": [["vlm.service", 3]]},
            {"preempted": {}},
            "preempted: expected an object, got a list",
        ),
        (
            {"held": ["train.service", "train.service", "x.service"]},
            {"held": ["train.service", "x.service"]},
            'held: dropped "train.service": listed twice',
        ),
        (
            {"failed": ["bad.service", None, "a b.service", "x\n.service"]},
            {"failed": ["bad.service"]},
            'failed: dropped "x\\x0a.service": not a unit name',
        ),
        (
            {"finished": [{"done.service": 1}]},
            {"finished": []},
            "finished: dropped an object: not a unit name",
        ),
        (
            {"boot_id": 7},
            {},
            "boot_id: 7 is no boot id",
        ),
        (
            {"extra": 1},
            {},
            'unknown key "extra"',
        ),
    ],
)
def test_bad_entries_are_dropped_and_the_rest_kept(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    changes: dict[str, Any],
    kept: dict[str, Any],
    reason: str,
) -> None:
    content = good(**changes)
    saved, boot_id, records = load(tmp_path, content, caplog)
    fields = {k: v for k, v in vars(GOOD_STATE).items()}
    assert saved == SavedState(**{**fields, **kept})
    assert boot_id == ("" if "boot_id" in changes else GOOD["boot_id"])
    one_error(
        records,
        f"{tmp_path / 'state.json'}: invalid entries (",
        reason,
        "copied it to",
        "state.json.bad",
        "starting from the valid ones and what systemd reports",
    )
    # the original is kept for a look; the file now holds the valid entries only
    assert (tmp_path / "state.json.bad").read_bytes() == content
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        assert StateStore(tmp_path).load() == (saved, boot_id)
    assert caplog.records == []


def test_duplicate_names(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    content = (
        b'{"version":1,"boot_id":"b","holders":{"a.service":[[0],"running",1,""],'
        b'"a.service":[[1],"running",2,""]},"preempted":{},"held":[],"finished":[],'
        b'"failed":[],"seq":2}'
    )
    saved, _boot, records = load(tmp_path, content, caplog)
    assert saved.holders == {"a.service": ((1,), "running", 2, "")}
    one_error(records, 'key "a.service" appears more than once; kept the last')


def test_an_unknown_phase_no_longer_crashes_the_scheduler(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It used to load fine and then raise ValueError in Scheduler.load (Phase("paused"))."""
    content = good(holders={"asr.service": [[0], "paused", 4, ""]})
    saved, _boot, _records = load(tmp_path, content, caplog)
    scheduler = Scheduler([0], {"asr.service": spec("asr", 10)})
    scheduler.load(saved)
    assert scheduler.holders == {}


def test_many_problems_make_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    content = good(held=[f"bad {i}" for i in range(100)])
    _saved, _boot, records = load(tmp_path, content, caplog)
    message = one_error(records, "and 95 more")
    assert len(message) < 1000


def test_a_three_element_holder_is_still_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved, _boot, records = load(tmp_path, good(holders={"a.service": [[0], "running", 1]}), caplog)
    assert saved.holders == {"a.service": ((0,), "running", 1, "")}
    assert records == []


# ---- save ------------------------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "new")
    store.save(GOOD_STATE, "0f6c/1234")
    assert store.load() == (GOOD_STATE, "0f6c/1234")
    assert json.loads(store.path.read_text()) == {**GOOD, "generation": 1}


def test_round_trip_of_the_ladder(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save(
        SavedState(
            holders={
                "asr.service": ((0,), "running", 4, ""),
                "emb.service": ((0,), "frozen", 1, ""),
            },
            preempted={"vlm.service": 3},
            held=["train.service"],
            finished=["done.service"],
            failed=["bad.service"],
            seq=5,
            suspended={"ocr.service": ((1,), 2)},
            frozen_for={"emb.service": ["asr.service"]},
        ),
        "0f6c/1234",
    )
    assert json.loads(store.path.read_text()) == {**LADDER, "generation": 1}
    assert store.load()[0].suspended == {"ocr.service": ((1,), 2)}
    assert store.load()[0].frozen_for == {"emb.service": ["asr.service"]}


def test_a_file_of_a_controller_before_the_ladder_is_complete(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = {k: v for k, v in GOOD.items() if k not in ("suspended", "frozen_for", "started")}
    saved, _, records = load(tmp_path, json.dumps(old).encode(), caplog)
    assert records == []
    assert (saved.suspended, saved.frozen_for, saved.started) == ({}, {}, [])


def said_all(records: list[logging.LogRecord], *problems: str) -> None:
    """Each problem is said, somewhere in what was logged."""
    said = " ".join(r.getMessage() for r in records)
    for problem in problems:
        assert problem in said, said


def test_the_starts_gpuslice_sent_are_kept_for_starting_holders_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted controller sends again a start of its own that systemd does not show;
    a name that is no starting holder is dropped, with why, and never started."""
    holders = {"bg.service": [[0], "starting", 6, ""], "asr.service": [[1], "running", 4, ""]}
    started = ["bg.service", "asr.service", "gone.service", "../x"]
    saved, _, records = load(tmp_path, good(holders=holders, started=started, seq=6), caplog)
    assert saved.started == ["bg.service"]
    said_all(
        records,
        'started: dropped "../x": not a unit name',
        'started: dropped "asr.service": not a starting holder',
        'started: dropped "gone.service": not a starting holder',
    )


def test_thaws_owed_are_kept_for_running_and_stopping_holders_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted controller thaws a unit the last one owed a thaw (saved before its
    ThawUnit left); a name that is no running or stopping holder is dropped, with why, and
    never thawed (one held frozen stays frozen)."""
    holders = {
        "asr.service": [[0], "running", 4, ""],
        "emb.service": [[0], "frozen", 1, ""],
        "low.service": [[1], "stopping", 3, ""],
    }
    owed = ["asr.service", "low.service", "emb.service", "gone.service", "../x"]
    saved, _, records = load(tmp_path, good(holders=holders, thaw_owed=owed), caplog)
    assert saved.thaw_owed == ["asr.service", "low.service"]
    said_all(
        records,
        'thaw_owed: dropped "../x": not a unit name',
        'thaw_owed: dropped "emb.service": not a running or stopping holder',
        'thaw_owed: dropped "gone.service": not a running or stopping holder',
    )
    store = StateStore(tmp_path / "again")
    store.save(saved, "b")
    assert store.load()[0].thaw_owed == ["asr.service", "low.service"]


def test_refills_are_kept_for_starts_of_ours_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted controller tells a refill of its own from a comeback (a unit turned
    on-demand since is owed none); a name that is no start of ours is dropped, with why."""
    holders = {"bg.service": [[0], "starting", 6, ""], "asr.service": [[1], "running", 4, ""]}
    refills = ["bg.service", "asr.service", "../x"]
    content = good(holders=holders, started=["bg.service"], refills=refills, seq=6)
    saved, _, records = load(tmp_path, content, caplog)
    assert saved.refills == ["bg.service"]
    said_all(
        records,
        'refills: dropped "../x": not a unit name',
        'refills: dropped "asr.service": not a start of ours',
    )
    store = StateStore(tmp_path / "again")
    store.save(saved, "b")
    assert store.load()[0].refills == ["bg.service"]


def test_units_kept_active_after_their_job_ended_are_kept_unless_they_hold_gpus(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted controller knows the units it released at the end of their job while
    systemd keeps them active (RemainAfterExit=yes): not adopted as holders again; and one
    whose job ended while our stop of it was on its way: that stop's end is its own. One
    the file also names as a holder not being stopped or as preempted (its comeback a no-op
    to systemd, its start waited for ever), or a name that is none, is dropped with why."""
    holders = {"asr.service": [[0], "running", 4, ""], "low.service": [[1], "stopping", 3, ""]}
    remained = ["done.service", "asr.service", "low.service", "../x", "owed.service"]
    data = good(holders=holders, remained=remained, preempted={"owed.service": 2})
    saved, _, records = load(tmp_path, data, caplog)
    assert saved.remained == ["done.service", "low.service"]
    assert saved.preempted == {"owed.service": 2}
    said_all(
        records,
        'remained: dropped "../x": not a unit name',
        'remained: dropped "asr.service": it holds GPUs, not being stopped',
        'remained: dropped "owed.service": a preempted unit (owed a comeback, which systemd '
        "would take as a no-op while the unit shows active)",
    )
    store = StateStore(tmp_path / "again")
    store.save(saved, "b")
    assert store.load()[0].remained == ["done.service", "low.service"]


def test_requeues_and_failed_waits_are_kept_and_a_file_without_them_is_complete(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted controller knows a unit waiting at its gate for its comeback (a starting
    holder, or a waiter, which is no holder), and that a preempted unit's wait there failed;
    a requeue past its gate, or a failed wait of a unit not preempted, is dropped with why.
    An older controller's file, without either, loads without a word."""
    holders = {"bg.service": [[], "starting", 6, ""], "asr.service": [[0], "running", 4, ""]}
    requeued = ["bg.service", "asr.service", "waits.service", "../x"]
    wait_failed = ["vlm.service", "asr.service"]
    content = good(holders=holders, started=["bg.service"], requeued=requeued, seq=6)
    data = {**json.loads(content), "wait_failed": wait_failed}
    saved, _, records = load(tmp_path, json.dumps(data).encode(), caplog)
    assert saved.requeued == ["bg.service", "waits.service"]
    assert saved.wait_failed == ["vlm.service"]
    said_all(
        records,
        'requeued: dropped "../x": not a unit name',
        'requeued: dropped "asr.service": a holder past its gate',
        'wait_failed: dropped "asr.service": not a preempted unit',
    )
    store = StateStore(tmp_path / "again")
    store.save(saved, "b")
    assert store.load()[0] == saved
    caplog.clear()
    later = ("requeued", "wait_failed", "stopped_by_shutdown", "refills", "remained")
    older = {k: v for k, v in GOOD.items() if k not in later}
    saved, _, records = load(tmp_path / "again", json.dumps(older).encode(), caplog)
    assert (saved, records) == (GOOD_STATE, [])


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"suspended": []}, "suspended: expected an object, got a list"),
        ({"suspended": {"x.service": [[], 1]}}, 'dropped "x.service": no GPU'),
        ({"suspended": {"x.service": [[0, 0], 1]}}, "a GPU listed twice"),
        ({"suspended": {"x.service": [[0], -1]}}, "seq -1"),
        ({"suspended": {"x.service": [[0]]}}, 'dropped "x.service": expected [GPUs, seq]'),
        ({"suspended": {"../x": [[0], 1]}}, 'suspended: dropped "../x": not a unit name'),
        ({"suspended": {"x.service": [[-1], 1]}}, 'dropped "x.service": GPUs must be a list'),
        ({"suspended": {"x.service": [3, 1]}}, 'dropped "x.service": GPUs must be a list'),
        ({"suspended": {"asr.service": [[0], 1]}}, 'dropped "asr.service": also a holder'),
        ({"frozen_for": {"asr.service": []}}, 'frozen_for: dropped "asr.service": not a frozen'),
        (
            {"frozen_for": {"emb.service": ["../x"]}},
            'frozen_for: dropped "emb.service": expected a list of unit names',
        ),
        ({"frozen_for": 7}, "frozen_for: expected an object, got 7"),
        ({"holders": {"x.service": [[0], "suspended", 1, ""]}}, 'phase "suspended"'),
    ],
)
def test_bad_ladder_entries_are_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, changes: dict[str, Any], problem: str
) -> None:
    content = json.dumps({**LADDER, **changes}).encode()
    saved, _, records = load(tmp_path, content, caplog)
    assert any(problem in r.getMessage() for r in records), [r.getMessage() for r in records]
    assert "x.service" not in saved.suspended and "x.service" not in saved.holders


# what ocr.service's suspend checkpointed: its PIDs, the bytes moved, when (Unix time)
CHECKPOINTED = {**LADDER, "checkpointed": {"ocr.service": [[4242, 17], 3 << 30, 1.7e9]}}


def test_the_pids_a_suspend_checkpointed_are_kept_and_an_older_file_is_complete(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted controller resumes exactly what the last one checkpointed
    (Ladder.recall); a file of a controller that did not save them loads without a word."""
    saved, _, records = load(tmp_path, json.dumps(CHECKPOINTED).encode(), caplog)
    assert records == []
    assert saved.checkpointed == {"ocr.service": ((4242, 17), 3 << 30, 1.7e9)}
    store = StateStore(tmp_path / "again")
    store.save(saved, "0f6c/1234")
    assert json.loads(store.path.read_text()) == {**CHECKPOINTED, "generation": 1}
    assert store.load()[0] == saved
    caplog.clear()
    saved, _, records = load(tmp_path / "again", json.dumps(LADDER).encode(), caplog)
    assert (saved.checkpointed, records) == ({}, [])
    assert saved.suspended == {"ocr.service": ((1,), 2)}


@pytest.mark.parametrize(
    ("checkpointed", "problem"),
    [
        ([], "checkpointed: expected an object, got a list"),
        ({"asr.service": [[1], 0, 0.0]}, 'dropped "asr.service": not a suspended unit'),
        ({"x.service": [[1], 0, 0.0]}, 'dropped "x.service": not a suspended unit'),
        ({"ocr.service": [[1], 0]}, "expected [PIDs, bytes, time]"),
        ({"ocr.service": {"pids": [1]}}, "expected [PIDs, bytes, time]"),
        ({"ocr.service": [[], 0, 0.0]}, "no PID, or a PID listed twice"),
        ({"ocr.service": [[5, 5], 0, 0.0]}, "no PID, or a PID listed twice"),
        ({"ocr.service": [[0], 0, 0.0]}, "PIDs must be a list of integers 1-4194304"),
        ({"ocr.service": [[4194305], 0, 0.0]}, "PIDs must be a list of integers"),
        ({"ocr.service": [[-1], 0, 0.0]}, "PIDs must be a list of integers"),
        ({"ocr.service": [[True], 0, 0.0]}, "PIDs must be a list of integers"),
        ({"ocr.service": [[1.0], 0, 0.0]}, "PIDs must be a list of integers"),
        ({"ocr.service": [["1"], 0, 0.0]}, "PIDs must be a list of integers"),
        ({"ocr.service": [1, 0, 0.0]}, "PIDs must be a list of integers"),
        ({"ocr.service": [[1], -1, 0.0]}, "bytes -1 is not an integer 0-"),
        ({"ocr.service": [[1], 1.5, 0.0]}, "bytes 1.5 is not an integer 0-"),
        ({"ocr.service": [[1], 0, -1.0]}, "time -1.0 is no time"),
        ({"ocr.service": [[1], 0, None]}, "time null is no time"),
        ({"ocr.service": [[1], 0, True]}, "time true is no time"),
    ],
)
def test_bad_checkpointed_entries_are_dropped_with_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, checkpointed: Any, problem: str
) -> None:
    """Root runs cuda-checkpoint on each PID kept: one that is no PID, or kept for a unit
    the file does not name suspended, is dropped (its resume then asks the tool the state
    of each process of the unit, as after a file of an older gpuslice); the rest is kept."""
    content = json.dumps({**LADDER, "checkpointed": checkpointed}).encode()
    saved, _, records = load(tmp_path, content, caplog)
    assert any(problem in r.getMessage() for r in records), [r.getMessage() for r in records]
    assert saved.checkpointed == {}
    assert saved.suspended == {"ocr.service": ((1,), 2)}


@pytest.mark.parametrize("wall", ["1e999", "-1e999", "1" + "0" * 400])
def test_a_checkpointed_time_no_float_holds_is_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, wall: str
) -> None:
    """JSON's 1e999 reads as infinity, and float() of a 400-digit integer raises: neither is
    a time, and neither stops the load."""
    text = json.dumps({**LADDER, "checkpointed": {"ocr.service": [[1], 0, "WALL"]}})
    saved, _, records = load(tmp_path, text.replace('"WALL"', wall).encode(), caplog)
    assert any("is no time" in r.getMessage() for r in records), [r.getMessage() for r in records]
    assert saved.checkpointed == {} and saved.suspended == {"ocr.service": ((1,), 2)}


def test_the_checkpointed_bounds_are_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """PID 1 and the kernel's PID_MAX_LIMIT, no bytes, an integer time: each a value a
    suspend may have saved."""
    widest = {**LADDER, "checkpointed": {"ocr.service": [[1, 4194304], 0, 0]}}
    saved, _, records = load(tmp_path, json.dumps(widest).encode(), caplog)
    assert records == []
    assert saved.checkpointed == {"ocr.service": ((1, 4194304), 0, 0.0)}


# the terms units hold their GPUs on, for one whose annotation goes: (priority, kind, GPUs,
# memory); ocr.service is suspended
TERMS = {
    **LADDER,
    "terms": {
        "asr.service": [10, "on-demand", 1, None],
        "emb.service": [90, "background", 2, 8 << 30],
        "ocr.service": [50, "on-demand", 1, 4 << 30],
    },
}


def test_round_trip_of_the_terms(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved, _, records = load(tmp_path, json.dumps(TERMS).encode(), caplog)
    assert records == []
    assert saved.terms == {
        "asr.service": (10, "on-demand", 1, None),
        "emb.service": (90, "background", 2, 8 << 30),
        "ocr.service": (50, "on-demand", 1, 4 << 30),
    }
    store = StateStore(tmp_path / "again")
    store.save(saved, "0f6c/1234")
    assert json.loads(store.path.read_text()) == {**TERMS, "generation": 1}


def test_a_restarted_controller_holds_unannotated_units_on_their_saved_terms(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The annotations of all three went: each keeps what it held its GPUs on."""
    saved, _, _ = load(tmp_path, json.dumps(TERMS).encode(), caplog)
    scheduler = Scheduler([sized(0), sized(1)], {})
    scheduler.load(saved)
    emb = scheduler.holders["emb.service"].spec
    assert (emb.priority, emb.kind, emb.gpus, emb.memory) == (90, BG, 2, 8 << 30)
    assert scheduler.holders["asr.service"].spec.priority == 10
    assert scheduler.suspended["ocr.service"].spec.memory == 4 << 30


def test_a_file_of_a_controller_before_the_terms_is_complete(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = {k: v for k, v in LADDER.items() if k != "terms"}
    saved, _, records = load(tmp_path, json.dumps(old).encode(), caplog)
    assert records == []
    assert saved.terms == {} and set(saved.holders) == {"asr.service", "emb.service"}


@pytest.mark.parametrize(
    ("terms", "problem"),
    [
        ([], "terms: expected an object, got a list"),
        ({"asr.service": 10}, 'dropped "asr.service": expected [priority, kind, GPUs, memory]'),
        ({"asr.service": [10, "on-demand", 1]}, "expected [priority, kind, GPUs, memory]"),
        ({"asr.service": [-1, "on-demand", 1, None]}, "priority -1 is not an integer 0-999"),
        ({"asr.service": [1000, "on-demand", 1, None]}, "priority 1000 is not an integer 0-999"),
        ({"asr.service": [True, "on-demand", 1, None]}, "priority true is not an integer"),
        ({"asr.service": ["10", "on-demand", 1, None]}, 'priority "10" is not an integer'),
        ({"asr.service": [10, "daemon", 1, None]}, 'kind "daemon" is not one of on-demand,'),
        ({"asr.service": [10, None, 1, None]}, "kind null is not one of"),
        ({"asr.service": [10, "on-demand", 0, None]}, "GPUs 0 is not an integer 1-1024"),
        ({"asr.service": [10, "on-demand", 1025, None]}, "GPUs 1025 is not an integer 1-1024"),
        ({"asr.service": [10, "on-demand", 1, 0]}, "memory 0 is neither null nor 1-"),
        ({"asr.service": [10, "on-demand", 1, (1 << 50) + 1]}, "memory 1125899906842625 is"),
        ({"asr.service": [10, "on-demand", 1, "8G"]}, 'memory "8G" is neither null nor'),
        ({"asr.service": [10, "on-demand", 1, 1.5]}, "memory 1.5 is neither null nor"),
        ({"../x": [10, "on-demand", 1, None]}, 'terms: dropped "../x": not a unit name'),
        (
            {"x.service": [10, "on-demand", 1, None]},
            'terms: dropped "x.service": neither a holder nor a suspended unit',
        ),
    ],
)
def test_bad_terms_are_dropped_with_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, terms: Any, problem: str
) -> None:
    """A unit whose terms are dropped is judged as before them (the least urgent, whole
    GPUs); the rest of the file is kept."""
    saved, _, records = load(tmp_path, json.dumps({**LADDER, "terms": terms}).encode(), caplog)
    assert any(problem in r.getMessage() for r in records), [r.getMessage() for r in records]
    assert saved.terms == {}
    assert set(saved.holders) == {"asr.service", "emb.service"}


def test_the_terms_at_their_bounds_are_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Priority 0, as many GPUs as a host may have, 1 byte: what an annotation may say."""
    widest = {**TERMS, "terms": {"asr.service": [0, "on-demand", 1024, 1]}}
    saved, _, records = load(tmp_path, json.dumps(widest).encode(), caplog)
    assert records == []
    assert saved.terms == {"asr.service": (0, "on-demand", 1024, 1)}


def test_a_suspended_unit_of_seq_0_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved, _, _ = load(tmp_path, good(suspended={"ocr.service": [[1], 0]}), caplog)
    assert saved.suspended == {"ocr.service": ((1,), 0)}


def test_a_save_whose_file_went_missing_midway_is_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FileNotFoundError means no state directory (made, then written again), or a file
    that went missing under the save: the directory is there, and the save writes anew."""
    real_replace = os.replace
    failures = [FileNotFoundError(2, "gone")]

    def replace(src: Any, dst: Any) -> None:
        if failures:
            raise failures.pop()
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    store = StateStore(tmp_path)
    store.save(GOOD_STATE, "b")
    assert store.load() == (GOOD_STATE, "b")


def test_a_suspended_seq_above_the_counter_raises_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved, _, _ = load(tmp_path, good(suspended={"ocr.service": [[1], 50]}), caplog)
    assert saved.seq == 50


def test_round_trip_of_the_longest_unit_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    names = [
        "a" * (UNIT_NAME_MAX - len(".service")) + ".service",
        "w@" + "i\\x2d" * 48 + "i" * (UNIT_NAME_MAX - 2 - 5 * 48 - len(".service")) + ".service",
        "a" * (UNIT_NAME_MAX - len(".scope")) + ".scope",
    ]
    assert all(len(n) == UNIT_NAME_MAX for n in names)
    state = SavedState(
        holders={names[0]: ((0, 1023), "stopping", 9, names[1])},
        preempted={names[1]: 8},
        held=names,
        finished=names[:1],
        failed=names[1:],
        seq=10,
    )
    store = StateStore(tmp_path)
    store.save(state, "b")
    with caplog.at_level(logging.DEBUG):
        assert store.load() == (state, "b")
    assert caplog.records == []


def test_one_character_too_long_is_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    name = "a" * (UNIT_NAME_MAX + 1 - len(".service")) + ".service"
    saved, _boot, records = load(tmp_path, good(held=[name]), caplog)
    assert saved.held == []
    one_error(records, "held: dropped", "not a unit name")


def test_save_error_propagates_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.path.mkdir()  # os.replace() onto a non-empty directory fails
    (store.path / "x").touch()
    with pytest.raises(OSError):
        store.save(GOOD_STATE, "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]

    blocked = StateStore(tmp_path / "file" / "sub")
    (tmp_path / "file").touch()
    with pytest.raises(OSError):
        blocked.save(GOOD_STATE, "b")


# ---- a state directory that cannot be written: the stand-in in runtime_dir ---------------

PREEMPTED = SavedState(preempted={"vlm.service": 3}, seq=3)


def store_on_disk(tmp_path: Path) -> StateStore:
    return StateStore(tmp_path / "disk" / "state", tmp_path / "run")


def blocked_store(tmp_path: Path) -> StateStore:
    """A store whose state_dir cannot be made (its parent is a file: a full or read-only
    disk to save(), as root passes every permission check) and whose runtime_dir can."""
    (tmp_path / "disk").touch()
    return store_on_disk(tmp_path)


def test_a_state_dir_that_cannot_be_written_leaves_the_state_in_the_stand_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk lost every preemption at the controller's next restart: the state
    that save() could not write was only in the memory of the controller that stopped."""
    store = blocked_store(tmp_path)
    assert store.save(PREEMPTED, "b") == tmp_path / "run" / "state.json"
    assert isinstance(store.failure, NotADirectoryError)
    with caplog.at_level(logging.INFO, "gpuslice"):
        assert blocked_store(tmp_path).load() == (PREEMPTED, "b")
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"{tmp_path}/run/state.json: the state saved while")

    (tmp_path / "disk").unlink()  # the disk has room again: the next save goes there
    (tmp_path / "disk").mkdir()
    restarted = store_on_disk(tmp_path)
    assert restarted.load() == (PREEMPTED, "b")
    later = SavedState(preempted={"vlm.service": 3}, held=["x.service"], seq=4)
    assert restarted.save(later, "b") == restarted.path and restarted.failure is None
    assert not (tmp_path / "run" / "state.json").exists()  # removed once it is not needed
    assert store_on_disk(tmp_path).load() == (later, "b")


def test_neither_directory_writable_raises_the_state_dirs_error(tmp_path: Path) -> None:
    (tmp_path / "run").touch()
    store = blocked_store(tmp_path)
    with pytest.raises(NotADirectoryError, match="disk/state"):
        store.save(PREEMPTED, "b")
    alone = StateStore(tmp_path / "disk" / "state")  # no runtime_dir: no stand-in
    with pytest.raises(NotADirectoryError):
        alone.save(PREEMPTED, "b")
    assert alone.standin is None
    assert StateStore(tmp_path / "x", tmp_path / "y" / ".." / "x").standin is None


def test_a_stand_in_older_than_the_state_file_is_removed_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The trace of a controller killed between a save that reached state_dir again and
    the stand-in's removal: the state file is the newer, so it is what is loaded."""
    StateStore(tmp_path / "state").save(GOOD_STATE, "0f6c/1234")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state.json").write_bytes(good(seq=2))
    os.utime(tmp_path / "run" / "state.json", ns=(1, 1))
    with caplog.at_level(logging.INFO, "gpuslice"):
        assert StateStore(tmp_path / "state", tmp_path / "run").load() == (GOOD_STATE, "0f6c/1234")
    assert not (tmp_path / "run" / "state.json").exists()
    assert "older than" in caplog.text


@pytest.mark.parametrize("content", [b"{", good(seq=-1, generation=2), b"x" * (STATE_FILE_MAX + 1)])
def test_an_invalid_stand_in_is_removed_and_the_state_file_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    StateStore(tmp_path / "state").save(GOOD_STATE, "0f6c/1234")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state.json").write_bytes(content)
    with caplog.at_level(logging.INFO, "gpuslice"):
        assert StateStore(tmp_path / "state", tmp_path / "run").load() == (GOOD_STATE, "0f6c/1234")
    assert not (tmp_path / "run" / "state.json").exists()
    assert f"{tmp_path}/run/state.json: " in one_error(caplog.records, "removed, using")


def test_a_stand_in_link_is_not_followed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere.json").write_bytes(good())
    (tmp_path / "run" / "state.json").symlink_to(tmp_path / "elsewhere.json")
    with caplog.at_level(logging.INFO, "gpuslice"):
        assert StateStore(tmp_path / "state", tmp_path / "run").load() == (SavedState(), "")
    assert (tmp_path / "elsewhere.json").read_bytes() == good()
    one_error(caplog.records, "not a regular file")


def test_a_stand_in_as_new_as_the_state_file_is_the_one_read(tmp_path: Path) -> None:
    """A stand-in is written only when the state file could not be: on a tie (one save
    generation, and a clock of coarse steps) it is the newer word."""
    StateStore(tmp_path / "state").save(GOOD_STATE, "0f6c/1234")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state.json").write_bytes(good(seq=7, generation=1))
    for path in (tmp_path / "state" / "state.json", tmp_path / "run" / "state.json"):
        os.utime(path, ns=(5, 5))
    store = StateStore(tmp_path / "state", tmp_path / "run")
    assert store.failure is None
    assert store.load()[0].seq == 7


def test_the_older_stand_in_is_named_as_it_is_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    StateStore(tmp_path / "state").save(GOOD_STATE, "0f6c/1234")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state.json").write_bytes(good(seq=2))
    os.utime(tmp_path / "run" / "state.json", ns=(1, 1))
    with caplog.at_level(logging.INFO, "gpuslice"):
        StateStore(tmp_path / "state", tmp_path / "run").load()
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path}/run/state.json: older than {tmp_path}/state/state.json; removed"
    ]


def test_a_stand_in_that_cannot_be_looked_at_is_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    StateStore(tmp_path / "state").save(GOOD_STATE, "0f6c/1234")
    (tmp_path / "run").symlink_to(tmp_path / "run")  # a loop: ELOOP
    with caplog.at_level(logging.INFO, "gpuslice"):
        assert StateStore(tmp_path / "state", tmp_path / "run").load() == (GOOD_STATE, "0f6c/1234")
    message = one_error(caplog.records)
    assert message == (
        f"{tmp_path}/run/state.json: cannot look at the stand-in ([Errno 40] Too many levels "
        f"of symbolic links: '{tmp_path}/run/state.json'); not used"
    )


def test_a_stand_in_with_a_key_twice_is_removed_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    StateStore(tmp_path / "state").save(GOOD_STATE, "0f6c/1234")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state.json").write_bytes(b'{"seq": 1, ' + good(generation=2)[1:])
    with caplog.at_level(logging.INFO, "gpuslice"):
        assert StateStore(tmp_path / "state", tmp_path / "run").load() == (GOOD_STATE, "0f6c/1234")
    message = one_error(caplog.records)
    assert message.startswith(f"{tmp_path}/run/state.json: ")
    assert message.endswith(f"; removed, using {tmp_path}/state/state.json")
    assert not (tmp_path / "run" / "state.json").exists()


def test_a_stand_in_that_cannot_be_removed_is_said_and_tried_again_at_each_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stand-in left behind would be read by a restarted controller while it looks the
    newer: its removal is tried until it works."""
    (tmp_path / "run" / "state.json").mkdir(parents=True)  # unlink(2) cannot remove it
    store = StateStore(tmp_path / "state", tmp_path / "run")
    with caplog.at_level(logging.INFO, "gpuslice"):
        store.save(GOOD_STATE, "b")
        store.save(GOOD_STATE, "b")
    said = [r.getMessage() for r in caplog.records]
    assert said == 2 * [
        f"cannot remove {tmp_path}/run/state.json: [Errno 21] Is a directory: "
        f"'{tmp_path}/run/state.json'"
    ]
    (tmp_path / "run" / "state.json").rmdir()
    store.save(GOOD_STATE, "b")


def test_the_stand_in_is_looked_for_once_not_at_every_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save comes before every StartUnit and StopUnit (issue 10): once no stand-in is
    left, saves make no call for it."""
    unlinked: list[str] = []
    unlink = os.unlink

    def counted(path: Any, *args: Any, **kwargs: Any) -> None:
        unlinked.append(os.fspath(path))
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", counted)
    for runtime in ("run", "run2"):
        store = StateStore(tmp_path / "state", tmp_path / runtime)
        if runtime == "run2":
            store.load()  # no stand-in found: none to remove
        for _ in range(3):
            store.save(GOOD_STATE, "b")
    assert unlinked == [f"{tmp_path}/run/state.json"]


def test_save_does_not_follow_a_planted_temporary_name(tmp_path: Path) -> None:
    """The old save wrote through whatever `state.tmp` was, a symlink included."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    for name in ("state.tmp", "state.json.tmp", ".state.json.tmp"):
        (tmp_path / name).symlink_to(victim)
    store = StateStore(tmp_path)
    store.save(GOOD_STATE, "b")
    assert victim.read_text() == "keep"
    assert store.load() == (GOOD_STATE, "b")
    assert oct(store.path.stat().st_mode & 0o777) == oct(0o644)


def test_save_replaces_a_symlink_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    store = StateStore(tmp_path)
    store.path.symlink_to(victim)
    store.save(GOOD_STATE, "b")
    assert victim.read_text() == "keep"
    assert not store.path.is_symlink()


def test_save_writes_all_of_a_large_state_and_mode_0644_whatever_the_umask(
    tmp_path: Path,
) -> None:
    """os.write may take part of what it is given: the rest is written too."""
    store = StateStore(tmp_path)
    big = SavedState(held=[f"u{i:05d}.service" for i in range(20_000)], seq=3)
    old = os.umask(0o077)
    try:
        store.save(big, "b")
    finally:
        os.umask(old)
    assert store.load() == (big, "b")
    assert oct(store.path.stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_leftover_temporary_file_of_a_killed_save_is_replaced(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    (tmp_path / ".state.json.tmp").write_text("half a state")
    store.save(GOOD_STATE, "b")
    assert store.load() == (GOOD_STATE, "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_flush_syncs_the_file_then_the_directory_its_rename_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power cut after a flush finds the last save: rename(2) alone is atomic against a
    kill, not against the disk's cache (an empty file on filesystems without ext4's
    flush-on-rename)."""
    store = StateStore(tmp_path)
    store.save(SavedState(held=["a.service"]), "b")
    saved = store.path.stat().st_ino
    synced: list[str] = []
    inodes: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        inodes.append(os.fstat(fd).st_ino)
        real(fd)

    opened: list[int] = []
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        opened.append(flags)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "open", open_)
    store.flush()
    # the file is synced under the name of its copy-to-be (state.json.prev), then renamed
    assert synced[0].startswith(f"{tmp_path}/.state.json.prev.tmp-")
    assert synced[1:] == [str(tmp_path)]
    assert inodes[0] == saved == store.prev_path.stat().st_ino == store.path.stat().st_ino
    # neither a link nor a FIFO put in its place is followed or waited on
    for flags, wanted in zip(
        opened,
        (os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, os.O_DIRECTORY | os.O_CLOEXEC),
        strict=True,
    ):
        assert flags & wanted == wanted


def test_flush_before_any_save_does_nothing(tmp_path: Path) -> None:
    StateStore(tmp_path / "none").flush()


class _Flushes:
    """A StateStore whose flush() is counted and may be held or fail."""

    def __init__(self) -> None:
        self.count = 0
        self.hold = threading.Event()
        self.hold.set()
        self.error: OSError | None = None

    def flush(self) -> None:
        self.count += 1
        self.hold.wait()
        if self.error is not None:
            raise self.error


async def _until(condition: Callable[[], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + 30  # a pass never waits this long
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_saves_in_a_row_are_flushed_once_and_a_save_during_a_flush_again() -> None:
    store, outcomes = _Flushes(), list[OSError | None]()
    flusher = Flusher(store, 0.01, outcomes.append)  # type: ignore[arg-type]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(100):
            flusher.saved(loop)
        await _until(lambda: len(outcomes) == 1)
        assert store.count == 1
        store.hold.clear()
        flusher.saved(loop)
        await _until(lambda: store.count == 2)
        flusher.saved(loop)  # while the flush runs: may not be in what it flushes
        flusher.saved(loop)
        store.hold.set()
        await _until(lambda: len(outcomes) == 3)
        await asyncio.sleep(0.05)
        assert store.count == 3 and outcomes == [None, None, None]

    asyncio.run(main())


def _flush_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "state-flush"}


def test_a_hung_flush_holds_its_thread_never_the_loop() -> None:
    store, outcomes = _Flushes(), list[OSError | None]()
    store.hold.clear()
    flusher = Flusher(store, 0.0, outcomes.append)  # type: ignore[arg-type]
    # an earlier test's flush may still be in its thread (an fsync on a loaded disk, or the
    # few lines after its word to its loop): counted, it would fail this test
    before = _flush_threads()

    async def main() -> None:
        flusher.saved(asyncio.get_running_loop())
        await _until(lambda: store.count == 1)
        ticks = 0
        for _ in range(10):
            await asyncio.sleep(0.001)
            ticks += 1
        assert ticks == 10 and outcomes == []
        # a daemon thread: the controller's exit never waits on the disk
        flushing = _flush_threads() - before
        assert len(flushing) == 1, f"this test's flush threads: {flushing}"
        assert all(t.daemon for t in flushing)

    asyncio.run(main())
    store.hold.set()  # the daemon thread ends; its word to the closed loop is dropped


def test_a_failed_flush_is_reported_and_the_next_save_flushes_again() -> None:
    store, outcomes = _Flushes(), list[OSError | None]()
    store.error = OSError(5, "Input/output error")
    flusher = Flusher(store, 0.0, outcomes.append)  # type: ignore[arg-type]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        flusher.saved(loop)
        await _until(lambda: len(outcomes) == 1)
        assert outcomes == [store.error]
        store.error = None
        flusher.saved(loop)
        await _until(lambda: len(outcomes) == 2)
        assert outcomes[1] is None

    asyncio.run(main())


def test_a_flush_whose_thread_cannot_start_is_reported_and_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thread.start raises when the controller is at its TasksMax= (or out of memory): that
    went to the loop's exception handler, the flusher stayed "due" and no save was ever
    flushed again, unsaid. Now it is a failed flush, said as one, and tried again."""
    store, outcomes = _Flushes(), list[OSError | None]()
    flusher = Flusher(store, 0.0, outcomes.append)  # type: ignore[arg-type]
    real_start = threading.Thread.start
    refused: list[str] = []

    def start(thread: threading.Thread) -> None:
        if thread.name == "state-flush" and not refused:
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        errors: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _, context: errors.append(context))
        flusher.saved(loop)
        await _until(lambda: len(outcomes) == 2)
        assert errors == []
        assert isinstance(outcomes[0], OSError) and "can't start new thread" in str(outcomes[0])
        assert outcomes[1] is None and store.count == 1

    asyncio.run(main())


_names = st.text("abc@0", min_size=1, max_size=4).map(lambda s: s + ".service")
_gpus = st.tuples(st.integers(0, 7)).map(tuple) | st.lists(st.integers(0, 7), max_size=3).map(tuple)


@settings(max_examples=200, deadline=None)
@given(
    holders=st.dictionaries(
        _names,
        st.tuples(_gpus, st.sampled_from(["running", "stopping"]), st.integers(0, 99), _names),
    ),
    preempted=st.dictionaries(_names, st.integers(0, 99)),
    held=st.lists(_names),
    suspended=st.dictionaries(_names, st.tuples(_gpus, st.integers(0, 99))),
    frozen_for=st.dictionaries(_names, st.lists(_names)),
    terms=st.dictionaries(
        _names,
        st.tuples(
            st.integers(0, 999),
            st.sampled_from(["on-demand", "background"]),
            st.integers(1, 8),
            st.none() | st.integers(1, 2**40),
        ),
    ),
)
def test_a_save_writes_what_dataclasses_asdict_would(**parts: Any) -> None:
    """The save takes the fields as they are, not asdict's deep copy (issue 10): the same
    JSON, tuples inside dicts and lists included."""
    saved = SavedState(**parts, seq=7, started=["x.service"])
    ours = json.dumps(saved_fields(saved), sort_keys=True)
    assert ours == json.dumps(dataclasses.asdict(saved), sort_keys=True)
