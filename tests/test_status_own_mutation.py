"""What tests/test_status_own_processes.py, tests/test_status_table_cap.py and
tests/test_envfiles.py left unchecked: the redacted answer's text is the stable JSON every
other answer is (each object's keys sorted, "gpus" first), for anyone and for a caller
shown its own processes; the table lists exactly LISTED_MAX foreign processes in the JSON's
order; and envfiles.present opens nothing at RUNTIME_DIR/env but a directory, and skips an
entry it cannot examine (gpuslice/status.py, gpuslice/envfiles.py)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice import envfiles
from gpuslice.annotations import Problem, Scan
from gpuslice.core.decisions import LISTED_MAX
from gpuslice.core.model import Gpu
from gpuslice.inventory import GpuUse, Health, Sample
from gpuslice.owners import Owner
from gpuslice.status import RedactedStatus, render, snapshot_to_json
from tests.test_status import GIB, MIB, snapshot

# ---------------------------------------------------------------------------------------------
# RedactedStatus: the text of the answer


def _key_orders(text: str) -> list[list[str]]:
    """The keys of every JSON object in `text`, in the order the text has them (innermost
    objects first, as the parser closes them)."""
    orders: list[list[str]] = []

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        orders.append([k for k, _ in pairs])
        return dict(pairs)

    json.loads(text, object_pairs_hook=hook)
    return orders


def _assert_stable(text: str, data: dict[str, Any]) -> None:
    """`text` is `data` as the unredacted answer is serialized (json.dumps, sort_keys), but
    for "gpus", which comes first: every object's keys sorted."""
    assert json.loads(text) == data
    *inner, top = _key_orders(text)
    assert top == ["gpus", *sorted(k for k in data if k != "gpus")], top
    for keys in inner:
        assert keys == sorted(keys), (keys, text)
    assert text.startswith('{"gpus": [{"foreign": ['), text[:80]


def _rich_state() -> tuple[dict[str, Any], Sample]:
    """A redacted answer with every top-level key filled: holders, a waiter, held, finished,
    failed, a problem, NVML's health; GPU 0 has a Slurm job's process and UID 1000's."""
    uses = [
        GpuUse(881, 0, 10 * GIB, None, "slurm-job", Owner("slurm", "881")),
        GpuUse(4242, 0, 2 * GIB, None, "mine", Owner("user", "1000")),
        GpuUse(4343, 1, None, None, "theirs", Owner("user", "1001")),
    ]
    gpus = [Gpu(i, f"GPU-{i}", "Fake 80GB", 80 * GIB, used=20 * GIB) for i in (0, 1)]
    sample = Sample(gpus, uses, health=Health("ready", 1000.0, "", "550.54"))
    snap = snapshot(
        gpus={0: [("a.service", 10, "running")], 1: []},
        waiting=[("w.service", 5, "waiting: GPU 0 held by a.service, priority 10")],
        held=["h.service"],
        finished=["f.service"],
        failed=["x.service"],
    )
    scan = Scan(problems=[Problem("/etc/bad.service", 3, "Priority", "not a number")])
    return snapshot_to_json(snap, scan, sample, redact=True), sample


def test_the_redacted_answer_is_stable_json_keys_sorted_gpus_first() -> None:
    """The answer anyone gets is the unredacted one's form (json.dumps(sort_keys=True), as
    the controller serializes every other answer), "gpus" moved first: the same state gives
    the same text, and a script that diffs answers sees no key moved."""
    data, sample = _rich_state()
    assert list(data)[:2] == ["version", "gpus"]  # built in another order than sorted
    redacted = RedactedStatus(json.loads(json.dumps(data)), sample)
    _assert_stable(redacted.text, data)
    for uid in (None, 0, 4242):  # no process of theirs: the same text
        assert redacted.text_for(uid) == redacted.text


def test_a_callers_own_answer_is_stable_json_keys_sorted_gpus_first() -> None:
    """UID 1000's answer, its own process shown whole, is serialized alike: each foreign
    entry's keys sorted (command, compute, memory, owner, pid), as in anyone's answer."""
    data, sample = _rich_state()
    redacted = RedactedStatus(json.loads(json.dumps(data)), sample)
    mine = redacted.text_for(1000)
    shown = json.loads(mine)
    entry = shown["gpus"][0]["foreign"][1]
    assert entry == {
        "compute": True,
        "command": "mine",
        "memory": 2 * GIB,
        "owner": {"id": "1000", "kind": "user"},
        "pid": 4242,
    }
    shown["gpus"][0]["foreign"][1] = {**entry, "pid": None, "command": None}
    shown["gpus"][0]["foreign"][1]["owner"] = {"kind": "user", "id": None}
    assert shown == data  # all but that entry is anyone's answer
    _assert_stable(mine, json.loads(mine))
    assert '{"command": "mine", "compute": true, "memory": 2147483648, ' in mine
    assert mine.index('"gpus"') == 1
    assert redacted.text_for(1000) == mine  # kept: the same text again


# ---------------------------------------------------------------------------------------------
# render: exactly LISTED_MAX foreign processes


def _line(gpu: int, pid: int, command: str, memory: str) -> str:
    return f"{gpu:<4} {f'foreign: PID {pid} {command}':<40} {'':>8}  {'':<9} {memory}"


def test_exactly_listed_max_foreign_processes_are_listed_in_the_jsons_order() -> None:
    """LISTED_MAX processes, the larger the later: each gets its line, in the JSON's order
    (by PID), not re-ranked largest first, and no "... more" line; one more, and they are
    the LISTED_MAX largest, largest first."""
    uses = [GpuUse(100 + i, 0, (i + 1) * MIB, None, "p") for i in range(LISTED_MAX)]
    sample = Sample([Gpu(0, "GPU-0", "Fake 80GB", 80 * GIB)], uses)
    data = snapshot_to_json(snapshot(gpus={0: []}), Scan(), sample)
    assert [p["pid"] for p in data["gpus"][0]["foreign"]] == [100 + i for i in range(LISTED_MAX)]
    lines = [line for line in render(data).split("\n") if "foreign" in line or "more" in line]
    assert lines == [_line(0, 100 + i, "p", f"{i + 1} MiB") for i in range(LISTED_MAX)]
    # an older controller's JSON, uncapped: one more is ranked, the smallest left out
    data["gpus"][0]["foreign"].append(
        {"pid": 999, "command": "q", "memory": 100 * MIB, "owner": None, "compute": True}
    )
    lines = [line for line in render(data).split("\n") if "foreign" in line or "more" in line]
    assert lines == [
        _line(0, 999, "q", "100 MiB"),
        *(_line(0, 100 + i, "p", f"{i + 1} MiB") for i in reversed(range(1, LISTED_MAX))),
        "0    ... and 1 more foreign process using 1 MiB",
    ]


# ---------------------------------------------------------------------------------------------
# envfiles.present


IN_OPEN = 0x20


@contextlib.contextmanager
def _opens_of(path: Path) -> Iterator[list[bytes]]:
    """The inotify events of `path` being opened while the block runs (read at its end)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        pytest.skip(f"no inotify: errno {ctypes.get_errno()}")
    events: list[bytes] = []
    try:
        assert libc.inotify_add_watch(fd, os.fsencode(path), IN_OPEN) >= 0, ctypes.get_errno()
        yield events
        with contextlib.suppress(BlockingIOError):
            events.append(os.read(fd, 4096))
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["fifo", "file"])
def test_nothing_but_a_directory_at_runtime_dir_env_is_opened(tmp_path: Path, kind: str) -> None:
    """A FIFO or a file in the place of RUNTIME_DIR/env lists nothing, and is never opened:
    a FIFO opened would release a writer waiting on it (and, blocking, wait for one)."""
    env = tmp_path / "env"
    if kind == "fifo":
        os.mkfifo(env)
    else:
        env.write_text("x")
    with _opens_of(env) as events:
        assert envfiles.present(str(tmp_path), 100) == ([], False)
    assert events == [], "RUNTIME_DIR/env was opened"
    # the watch sees an open at all (else this test proves nothing)
    with _opens_of(env) as events:
        os.close(os.open(env, os.O_RDONLY | os.O_NONBLOCK))
    assert events, "inotify saw no open"


class _Unexaminable:
    """An entry whose type cannot be read (DirEntry.is_dir's lstat, where the file system
    gives no type, failing): EACCES, EIO."""

    name = "gone@1.service"

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        raise PermissionError(errno.EACCES, "Permission denied", self.name)


def test_an_entry_that_cannot_be_examined_is_skipped_and_the_rest_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One entry's type cannot be read: it is not listed, the entries after it still are,
    and the start-up sweep gets its list (no exception from present)."""
    for unit in ("a.service", "b.service"):
        envfiles.write(str(tmp_path), unit, [Gpu(0)])
    real = os.scandir

    @contextlib.contextmanager
    def scandir(fd: int) -> Iterator[list[Any]]:
        with real(fd) as entries:
            found = sorted(entries, key=lambda e: e.name)
            yield [found[0], _Unexaminable(), *found[1:]]

    monkeypatch.setattr(os, "scandir", scandir)
    assert envfiles.present(str(tmp_path), 100) == (["a.service", "b.service"], False)
    assert envfiles.present(str(tmp_path), 2) == (["a.service"], True)
