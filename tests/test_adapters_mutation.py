"""Boundary tests for the validating adapters that `make mutate MUTATE=adapters` asked for.

Each test pins observable behaviour (a returned value, the exact words of a located error) at
an edge that the adapters' own test files left open; mutation testing found the edges.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import stat
import threading
import tracemalloc
from pathlib import Path
from typing import Any, cast

import pytest

from gpuslice.cgroups import CGROUP_FILE_MAX, unit_of_cgroup_path, unit_of_pid
from gpuslice.config import MAX_CONFIG_BYTES, MAX_GPUS, ConfigError, parse_config, read_config_text
from gpuslice.core.scheduler import SavedState
from gpuslice.sizes import SIZE_MAX, format_size, parse_size
from gpuslice.state import STATE_FILE_MAX, Problems, StateStore, validate
from gpuslice.unitfiles import is_instance, is_template, template_of
from tests.test_inventory import MANAGED, StubNvml, make_inventory, write_proc

GIB = 1 << 30

# ---- state.json: the exact words of every dropped entry -------------------------------------


def problems_of(data: dict[str, Any]) -> tuple[SavedState, str, str]:
    problems = Problems()
    saved, boot_id = validate(data, problems)
    return saved, boot_id, str(problems)


FULL: dict[str, Any] = {
    "version": 1,
    "boot_id": "b",
    "holders": {},
    "preempted": {},
    "held": [],
    "finished": [],
    "failed": [],
    "seq": 0,
}


def test_a_file_with_only_its_version_names_every_missing_key_and_nothing_else() -> None:
    saved, boot_id, words = problems_of({"version": 1})
    assert (saved, boot_id) == (SavedState(), "")
    assert words == "no 'boot_id', 'failed', 'finished', 'held', 'holders', 'preempted', 'seq'"


def test_zero_is_a_valid_sequence_number_everywhere() -> None:
    data = {
        **FULL,
        "holders": {"a.service": [[0], "running", 0, ""]},
        "preempted": {"b.service": 0},
    }
    saved, _boot, words = problems_of(data)
    assert words == ""
    assert saved.holders == {"a.service": ((0,), "running", 0, "")}
    assert saved.preempted == {"b.service": 0}
    assert saved.seq == 0


def test_a_bad_sequence_number_falls_back_to_zero() -> None:
    saved, _boot, words = problems_of({**FULL, "seq": "7"})
    assert saved.seq == 0
    assert words == 'seq: "7" is no sequence number'


@pytest.mark.parametrize(
    ("seq", "shown"),
    [
        (10**23, str(10**23)),  # 24 digits: shown whole
        (10**24, "10000000000000000000... (25 digits)"),
    ],
)
def test_a_huge_sequence_number_is_shown_cut(seq: int, shown: str) -> None:
    assert problems_of({**FULL, "seq": seq})[2] == f"seq: {shown} is no sequence number"


def test_the_longest_boot_id_is_kept() -> None:
    assert problems_of({**FULL, "boot_id": "b" * 256})[1:] == ("b" * 256, "")
    assert problems_of({**FULL, "boot_id": "b" * 257})[1] == ""


def test_a_bad_preempted_name_is_named() -> None:
    _saved, _boot, words = problems_of({**FULL, "preempted": {"x": 1, "y" * 70: 1}})
    assert words == (
        'preempted: dropped "x": not a unit name; '
        f'preempted: dropped "{"y" * 60}...": not a unit name'
    )


def test_a_gpu_listed_twice_in_a_holder() -> None:
    words = problems_of({**FULL, "holders": {"a.service": [[1, 1], "running", 1, ""]}})[2]
    assert words == 'holders: dropped "a.service": a GPU listed twice'


@pytest.mark.parametrize(
    ("name", "kept"),
    [
        ("a@b@.service", True),  # an instance may hold `@` (systemd's unit_instance_is_valid)
        ("a.b@.service", False),  # a template, whatever its prefix holds
        ("a.b@c.service", True),
    ],
)
def test_templates_are_not_units_to_hold(name: str, kept: bool) -> None:
    saved, _boot, words = problems_of({**FULL, "held": [name]})
    assert saved.held == ([name] if kept else [])
    assert words == ("" if kept else f'held: dropped "{name}": not a unit name')


@pytest.mark.parametrize(
    ("count", "words"),
    [
        (1, "p1"),
        (2, "p1; p2"),
        (5, "p1; p2; p3; p4; p5"),
        (7, "p1; p2; p3; p4; p5; and 2 more"),
    ],
)
def test_problems_are_joined_and_counted(count: int, words: str) -> None:
    problems = Problems()
    for i in range(count):
        problems.add(f"p{i + 1}")
    assert str(problems) == words


def store_error(tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes) -> str:
    (tmp_path / "state.json").write_bytes(content)
    with caplog.at_level(logging.ERROR):
        StateStore(tmp_path).load()
    [record] = [r for r in caplog.records if r.name.startswith("gpuslice")]
    return record.getMessage()


def test_cannot_move_aside_says_why_in_the_systems_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "state.json.bad").mkdir()
    (tmp_path / "state.json.bad" / "x").touch()
    message = store_error(tmp_path, caplog, b"[]")
    assert f"could not move it to {tmp_path / 'state.json.bad'} (Is a directory);" in message


def test_cannot_copy_aside_says_why_in_the_systems_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "state.json.bad").mkdir()
    (tmp_path / "state.json.bad" / "x").touch()
    content = json.dumps({**FULL, "held": ["a.service", "x"]}).encode()
    message = store_error(tmp_path, caplog, content)
    assert (
        f"could not copy it to {tmp_path / 'state.json.bad'} (Is a directory); left it as it is"
        in message
    )


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda p: p.symlink_to("/nowhere"), "a symbolic link"),
        (lambda p: p.mkdir(), "a directory"),
        (lambda p: os.mkfifo(p), "a FIFO"),
    ],
)
def test_a_file_that_is_not_regular_is_named_by_its_kind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, make: Any, kind: str
) -> None:
    make(tmp_path / "state.json")
    with caplog.at_level(logging.ERROR):
        StateStore(tmp_path).load()
    [record] = [r for r in caplog.records if r.name.startswith("gpuslice")]
    assert f"state.json: not a regular file ({kind});" in record.getMessage()


# ---- sizes ----------------------------------------------------------------------------------


def test_the_largest_size_is_accepted() -> None:
    assert parse_size("1P") == SIZE_MAX


def test_a_size_of_exactly_32_digits_is_read() -> None:
    assert parse_size("1." + "0" * 31 + "K") == 1024
    with pytest.raises(ValueError):
        parse_size("1." + "0" * 32 + "K")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1 << 20, "1 MiB"),
        (3 << 19, "1.5 MiB"),
        ((1 << 21) - (1 << 10), "2.0 MiB"),
        (1 << 30, "1 GiB"),
        (1 << 40, "1 TiB"),
    ],
)
def test_sizes_are_printed_in_the_largest_binary_unit(value: int, text: str) -> None:
    assert format_size(value) == text


# ---- config.yaml: the boundaries of every key ------------------------------------------------

P = "/etc/gpuslice/config.yaml"


def config_problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, P)
    return caught.value.problems


@pytest.mark.parametrize(
    ("text", "reserve"),
    [
        ("reserve: 0\n", (("*", 0),)),
        ('reserve: "0"\n', (("*", 0),)),
        ('reserve: " 0 "\n', (("*", 0),)),
        (f"reserve: {SIZE_MAX}\n", (("*", SIZE_MAX),)),
        ("reserve: 1P\n", (("*", SIZE_MAX),)),
        ("reserve:\n  0: 0\n  1: 1K\n", (("0", 0), ("1", 1024))),
        ("reserve: " + "0" * 38 + "1G\n", (("*", GIB),)),  # 40 characters
    ],
)
def test_reserve_boundaries_that_are_accepted(text: str, reserve: tuple[Any, ...]) -> None:
    assert parse_config(text, P)[0].reserve == reserve


@pytest.mark.parametrize(
    "value",
    [str(SIZE_MAX + 1), "0" * 39 + "1G", "1.5", "-1", "٣G", "0.0001K", "1E"],
)
def test_reserve_boundaries_that_are_refused(value: str) -> None:
    [problem] = config_problems(f"reserve: {value}\n")
    shown = value.encode("ascii", "backslashreplace").decode()
    assert problem.startswith(f'{P}:1: reserve: invalid value "{shown}" (allowed: ')


def test_reserve_for_every_gpu_there_may_be() -> None:
    text = "reserve:\n" + "".join(f"  {i}: 1M\n" for i in range(MAX_GPUS))
    config = parse_config(text, P)[0]
    assert config.reserve_for(MAX_GPUS - 1, "GPU-x") == 1 << 20
    [problem] = config_problems(text + f"  {MAX_GPUS}: 1M\n")
    assert problem.startswith(f"{P}:2: reserve: invalid value a mapping (allowed: ")


@pytest.mark.parametrize(
    ("key", "low", "high"),
    [
        ("sample_interval", 0.05, 3600),
        ("vram_release_timeout", 0.1, 3600),
        ("gate_retry_seconds", 0.05, 60),
        ("stop_timeout", 1, 86400),
        ("driver_wait", 0, 3600),
    ],
)
def test_intervals_at_and_past_their_bounds(key: str, low: float, high: float) -> None:
    assert getattr(parse_config(f"{key}: {low}\n", P)[0], key) == low
    assert getattr(parse_config(f"{key}: {high}\n", P)[0], key) == high
    for bad in (low - 0.001, high + 0.001, ".inf", "-.inf", ".nan", "true", '"1"', "1e400"):
        [problem] = config_problems(f"{key}: {bad}\n")
        assert problem.startswith(f"{P}:1: {key}: invalid value "), problem


def test_gpus_at_and_past_their_bounds() -> None:
    assert parse_config("gpus: 1\n", P)[0].gpus == 1
    assert parse_config(f"gpus: {MAX_GPUS}\n", P)[0].gpus == MAX_GPUS
    for bad in ("0", str(MAX_GPUS + 1), "true", "1.0", '"1"'):
        [problem] = config_problems(f"gpus: {bad}\n")
        assert problem.startswith(f"{P}:1: gpus: invalid value "), problem


@pytest.mark.parametrize("key", ["state_dir", "runtime_dir"])
def test_directories_below_the_sandbox(key: str) -> None:
    base = {"state_dir": "/var/lib/gpuslice", "runtime_dir": "/run/gpuslice"}[key]
    good = [
        base,
        base + "/",
        base + "/a",
        base + "/a.b_c-d/e",
        base + "/" + "x" * (199 - len(base)),
    ]
    for value in good:
        assert getattr(parse_config(f"{key}: {value}\n", P)[0], key) == value.rstrip("/")
    bad = [
        base + "x",
        base + "//a",
        base + "/./a",
        base + "/../etc",
        base + "/a/..",
        base + "/a/.",
        "/" + base,
        base[1:],
        base + "/a b",
        base + "/" + "x" * (200 - len(base)),
        "/",
        "",
        "1",
    ]
    for value in bad:
        [problem] = config_problems(f"{key}: '{value}'\n")
        assert problem.startswith(f"{P}:1: {key}: invalid value "), value
        assert problem.endswith(
            f"(allowed: {base} or a directory below it, at most 200 characters of letters, "
            'digits, ".", "_", "-" and "/", without "." or ".." components: the service\'s '
            "sandbox lets it write nowhere else"
            + (
                '; with no name below it that is "runtime-dir", "state.json", "env" or "gate", '
                'nor one of them followed by "." or "-", nor any of these after a ".": '
                "gpuslice names its own files there so)"
                if key == "runtime_dir"
                else '; with no name below it that is "state-dir" or "state.json", nor one of '
                'them followed by "." or "-", nor any of these after a ".": gpuslice names its '
                "own files there so)"
            )
        ), problem


# ---- cgroups: where PID 1's tree starts ------------------------------------------------------

M = "0::/machine.slice/m.scope"


@pytest.mark.parametrize(
    ("init", "content", "unit"),
    [
        # PID 1 in a container's system.slice (nspawn without a cgroup namespace)
        (f"{M}/system.slice\n", f"{M}/a.service\n", "a.service"),
        (f"{M}/system\n", f"{M}/a.service\n", "a.service"),
        (f"{M}//init.scope\n", f"{M}/a.service\n", "a.service"),
        (f"{M}/\n", f"{M}/a.service\n", "a.service"),
        (f"{M}/\n", f"{M}\n", None),
        # PID 1's file is no cgroup file: no shift
        ("garbage\n", "0::/system.slice/a.service\n", "a.service"),
    ],
)  # fmt: skip
def test_the_root_of_pid_1(tmp_path: Path, init: str, content: str, unit: str | None) -> None:
    for pid, text in ((1, init), (42, content)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    assert unit_of_pid(42, tmp_path) == unit


# ---- unit names ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "template", "instance", "its_template"),
    [
        ("a@.service", True, False, "a@.service"),
        ("a@b.service", False, True, "a@.service"),
        ("a@b@.service", False, True, "a@.service"),  # the instance is `b@`
        ("a@.b@.service", False, True, "a@.service"),  # the instance is `.b@`
        ("a.b@.service", True, False, "a.b@.service"),
        ("a.service", False, False, "a.service"),
    ],
)
def test_templates_and_instances_split_at_the_first_at(
    name: str, template: bool, instance: bool, its_template: str
) -> None:
    assert (is_template(name), is_instance(name), template_of(name)) == (
        template,
        instance,
        its_template,
    )


# ---- inventory: attribution of GPU processes ---------------------------------------------------


def test_an_exited_process_is_announced_once_with_its_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = StubNvml()
    nvml.add(0, 500, 6 * GIB)
    nvml.add(1, 501, None)  # NVML does not know its memory
    inventory, clock = make_inventory(tmp_path, nvml)
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        inventory.sample(MANAGED)
        clock.now += 1
        inventory.sample(MANAGED)
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 0 still lists exited PID 500 (6 GiB): counting it until released, at most 30 s "
        "(vram_release_timeout)",
        "GPU 1 still lists exited PID 501 (0 B): counting it until released, at most 30 s "
        "(vram_release_timeout)",
    ]


def test_every_process_on_a_gpu_is_attributed(tmp_path: Path) -> None:
    """An exited process first on the list does not hide the live ones after it; a stray of a
    managed unit on a GPU it does not hold adds to what is foreign there."""
    nvml = StubNvml()
    write_proc(tmp_path, 100, "0::/system.slice/asr.service\n", "asr")
    write_proc(tmp_path, 101, "0::/system.slice/asr.service\n", "asr")
    write_proc(tmp_path, 102, "0::/user.slice/user-1000.slice/session-1.scope\n", "x")
    nvml.add(0, 499, 1 * GIB)  # exited, still listed
    nvml.add(0, 100, 2 * GIB)
    nvml.add(0, 101, None)
    nvml.add(0, 102, 4 * GIB)
    inventory, _clock = make_inventory(tmp_path, nvml)
    sample = inventory.sample(MANAGED, {"asr.service": [1]})
    assert [(p.pid, p.unit, p.command) for p in sample.processes] == [
        (499, None, "?"),
        (100, "asr.service", "asr"),
        (101, "asr.service", "asr"),
        (102, None, "x"),
    ]
    gpu0 = sample.gpus[0]
    assert (gpu0.foreign, gpu0.foreign_pids) == (7 * GIB, (499, 102))
    assert sample.health is inventory.health
    held = inventory.sample(MANAGED, {"asr.service": [0]}).gpus[0]
    assert (held.foreign, held.foreign_pids) == (5 * GIB, (499, 102))


# ---- state.json: the store's own words, and what it writes ----------------------------------

STATE = SavedState(
    holders={"asr.service": ((0,), "running", 4, "")},
    preempted={"vlm.service": 3},
    held=["train.service"],
    seq=5,
)


def test_a_bug_while_loading_is_logged_and_the_controller_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(data: dict[str, Any], problems: Problems) -> tuple[SavedState, str]:
        raise RuntimeError("a bug")

    monkeypatch.setattr("gpuslice.state.validate", broken)
    (tmp_path / "state.json").write_text(json.dumps(FULL))
    with caplog.at_level(logging.ERROR):
        assert StateStore(tmp_path).load() == (SavedState(), "")
    [record] = [r for r in caplog.records if r.name.startswith("gpuslice")]
    assert record.getMessage() == (
        f"{tmp_path / 'state.json'}: cannot load the state; starting from what systemd reports"
    )
    assert record.exc_info is not None and str(record.exc_info[1]) == "a bug"


def test_a_bad_file_is_one_exact_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    assert store_error(tmp_path, caplog, b"[]") == (
        f"{path}: expected a JSON object, got a list; moved it to {path}.bad; "
        "starting from what systemd reports"
    )


def test_bad_entries_are_one_exact_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    content = json.dumps({**FULL, "held": ["a.service", "x"]}).encode()
    assert store_error(tmp_path, caplog, content) == (
        f'{path}: invalid entries (held: dropped "x": not a unit name); copied it to {path}.bad '
        "and kept the valid entries; starting from the valid ones and what systemd reports"
    )


def test_a_file_that_cannot_be_read_is_moved_aside_before_a_save_replaces_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    real_open = os.open

    def failing_open(file: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(file) == str(path):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing_open)
    path.write_text(json.dumps(FULL))
    with caplog.at_level(logging.ERROR):
        assert StateStore(tmp_path).load() == (SavedState(), "")
    [record] = [r for r in caplog.records if r.name.startswith("gpuslice")]
    assert record.getMessage() == (
        f"{path}: cannot read the state (Input/output error); moved it to {path}.bad; "
        "starting from what systemd reports"
    )
    # kept, byte for byte, where the next save does not replace it
    assert not path.exists()
    assert json.loads((tmp_path / "state.json.bad").read_text()) == FULL


def test_a_long_json_error_is_cut_at_120_characters(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Python's own error for an integer over its digit limit is longer than 120 characters."""
    message = store_error(tmp_path, caplog, b'{"version":1,"seq":' + b"9" * 5000 + b"}")
    start = message.index("not JSON (") + len("not JSON (")
    shown = message[start : message.index("); moved it to")]
    assert len(shown) == 123 and shown.endswith("...")
    assert shown.startswith("Exceeds the limit (4300 digits) for integer string conversion")


def lstat_says_regular(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """The file at `path` is swapped between the lstat() and the open() that follows it."""
    real_lstat = os.lstat
    regular = os.lstat(path.parent / "regular")

    def lstat(file: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        return regular if str(file) == str(path) else real_lstat(file, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)


def test_a_symlink_swapped_in_after_the_check_is_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    (tmp_path / "regular").write_text(json.dumps(FULL))
    (tmp_path / "elsewhere.json").write_text(json.dumps({**FULL, "held": ["a.service"]}))
    path.symlink_to(tmp_path / "elsewhere.json")
    lstat_says_regular(monkeypatch, path)
    with caplog.at_level(logging.ERROR):
        assert StateStore(tmp_path).load() == (SavedState(), "")
    [record] = [r for r in caplog.records if r.name.startswith("gpuslice")]
    assert record.getMessage() == (
        f"{path}: cannot read the state (Too many levels of symbolic links); moved it to "
        f"{path}.bad; starting from what systemd reports"
    )
    assert (tmp_path / "state.json.bad").is_symlink()  # the link itself, not what it names
    assert json.loads((tmp_path / "elsewhere.json").read_text())["held"] == ["a.service"]


@pytest.mark.timeout(20)
def test_a_fifo_swapped_in_after_the_check_does_not_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    (tmp_path / "regular").write_text(json.dumps(FULL))
    os.mkfifo(path)
    lstat_says_regular(monkeypatch, path)
    result: list[tuple[SavedState, str]] = []
    with caplog.at_level(logging.ERROR):
        loader = threading.Thread(target=lambda: result.append(StateStore(tmp_path).load()))
        loader.start()
        loader.join(30)  # a pass never waits this long: a loaded machine may start it late
        if loader.is_alive():  # blocked in open(): a writer lets it go, then fail
            os.close(os.open(path, os.O_WRONLY))
            loader.join()
    assert result == [(SavedState(), "")]
    [record] = [r for r in caplog.records if r.name.startswith("gpuslice")]
    assert record.getMessage() == (
        f"{path}: not a regular file (a FIFO); moved it to {path}.bad; "
        "starting from what systemd reports"
    )


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        (stat.S_IFSOCK, "a socket"),
        (stat.S_IFCHR, "a character device"),
        (stat.S_IFBLK, "a block device"),
        (0, "an unknown kind of file"),
    ],
)
def test_every_kind_of_file_is_named(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    mode: int,
    kind: str,
) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(FULL))
    real_lstat = os.lstat
    fake = os.stat_result((mode | 0o644, *real_lstat(path)[1:]))

    def lstat(file: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        return fake if str(file) == str(path) else real_lstat(file, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    message = store_error(tmp_path, caplog, json.dumps(FULL).encode())
    assert message.startswith(f"{path}: not a regular file ({kind}); moved it to")


def test_a_file_of_exactly_16_mib_is_read(tmp_path: Path) -> None:
    content = json.dumps(FULL).encode()
    (tmp_path / "state.json").write_bytes(content + b" " * (STATE_FILE_MAX - len(content)))
    assert StateStore(tmp_path).load() == (SavedState(), "b")


def test_no_more_than_16_mib_is_read_of_a_bigger_file(tmp_path: Path) -> None:
    with open(tmp_path / "state.json", "wb") as f:
        f.truncate(4 * STATE_FILE_MAX)  # sparse: instant
    tracing = tracemalloc.is_tracing()  # PYTHONTRACEMALLOC= traces from the start: its peak
    tracemalloc.start()  # is the whole run's, so the peak is reset and counted from here
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        assert StateStore(tmp_path).load() == (SavedState(), "")
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        if not tracing:
            tracemalloc.stop()
    assert peak - before < 2 * STATE_FILE_MAX


def test_cannot_rewrite_says_why_in_the_systems_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    real_replace = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if str(dst) == str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    content = json.dumps({**FULL, "held": ["a.service", "x"]}).encode()
    message = store_error(tmp_path, caplog, content)
    assert f"copied it to {path}.bad; could not rewrite it (Read-only file system);" in message
    assert path.read_bytes() == content


def test_save_writes_sorted_keys(tmp_path: Path) -> None:
    StateStore(tmp_path).save(STATE, "b")
    assert (tmp_path / "state.json").read_text() == (
        '{"boot_id": "b", "checkpointed": {}, "failed": [], "finished": [], "frozen_for": {}, '
        '"generation": 1, "held": ["train.service"], '
        '"holders": {"asr.service": [[0], "running", 4, ""]}, '
        '"preempted": {"vlm.service": 3}, "refills": [], "remained": [], "requeued": [], '
        '"seq": 5, '
        '"started": [], "stopped_by_shutdown": [], "suspended": {}, "terms": {}, '
        '"thaw_owed": [], "version": 1, "wait_failed": []}'
    )


def test_save_creates_its_directory_and_its_parents(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "var" / "lib" / "gpuslice")
    store.save(STATE, "b")
    store.save(STATE, "c")
    assert store.load() == (STATE, "c")


def test_save_refuses_what_load_would_move_aside(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save(STATE, "b")
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        store.save(SavedState(seq=cast(int, math.nan)), "b")
    assert store.load() == (STATE, "b")


def test_the_temporary_file_lies_beside_the_state_with_a_hidden_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """So that rename(2) stays on one filesystem, and a leftover of a kill is recognisable
    (its writer's process id: removed at the next load once that process is gone), and no
    other writer's (safefile.write_atomic)."""
    real_replace = os.replace
    moved: list[tuple[str, str]] = []

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        moved.append((str(src), str(dst)))
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    StateStore(tmp_path).save(STATE, "b")
    [(src, dst)] = moved
    assert dst == str(tmp_path / "state.json")
    assert Path(src).parent == tmp_path
    assert re.fullmatch(rf"\.state\.json\.tmp-{os.getpid()}-[0-9]+", Path(src).name)


def test_a_failed_save_reports_its_own_error_when_cleaning_up_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(OSError) as raised:
        StateStore(tmp_path).save(STATE, "b")
    assert raised.value.errno == errno.EXDEV


# ---- cgroups: systemd's rule at its edges ---------------------------------------------------


def unit_of(tmp_path: Path, content: str | bytes, pid: int = 42) -> str | None:
    (tmp_path / str(pid)).mkdir(exist_ok=True)
    data = content.encode() if isinstance(content, str) else content
    (tmp_path / str(pid) / "cgroup").write_bytes(data)
    return unit_of_pid(pid, tmp_path)


@pytest.mark.parametrize(
    ("path", "unit"),
    [
        ("/a@b.slice/x.service", None),  # slices take no instance: no slice, no unit
        ("/system.slice/a@b@.service", "a@b@.service"),  # instance `b@`: no template
        ("/system.slice/a@.b.service", "a@.b.service"),  # instance `.b`
    ],
)
def test_templates_and_instanced_slices_in_cgroup_paths(path: str, unit: str | None) -> None:
    assert unit_of_cgroup_path(path) == unit


@pytest.mark.parametrize(
    ("content", "unit"),
    [
        # blank lines are skipped, not the end of the file
        ("1:name=systemd:/system.slice/a.service\n\n0::/system.slice/b.service\n", "b.service"),
        # a hierarchy that is no ASCII number is a forged line
        ("x:name=systemd:/system.slice/a.service\n", None),
        ("\u0663:name=systemd:/system.slice/a.service\n", None),
        # a v1 hierarchy without controllers is not the unified one
        ("5::/system.slice/a.service\n0::/system.slice/b.service\n", "b.service"),
    ],
)
def test_lines_of_a_cgroup_file(tmp_path: Path, content: str, unit: str | None) -> None:
    assert unit_of(tmp_path, content) == unit


def test_pid_1_is_looked_up_like_any_other(tmp_path: Path) -> None:
    assert unit_of(tmp_path, "0::/init.scope\n", pid=1) == "init.scope"


def test_a_cgroup_file_over_1_mib_keeps_its_whole_lines_up_to_1_mib(tmp_path: Path) -> None:
    """The `b` line ends one byte past the limit's read (1 MiB + 1): it is cut, and the
    whole `a` line before it counts (a second unified line would make the file forged)."""
    a = "0::/system.slice/a.service\n"
    b = "0::/system.slice/b.service\n"
    pad = "1:cpu:/" + "p" * (CGROUP_FILE_MAX + 2 - len(a) - len(b) - len("1:cpu:/\n")) + "\n"
    content = pad + a + b
    assert len(content) == CGROUP_FILE_MAX + 2
    assert unit_of(tmp_path, content) == "a.service"


@pytest.mark.parametrize("tail", ["/init.scope", ""])
def test_a_root_whose_name_ends_in_x(tmp_path: Path, tail: str) -> None:
    root = "/lxc.payload.BOX"
    unit_of(tmp_path, f"0::{root}{tail}\n", pid=1)
    assert unit_of(tmp_path, f"0::{root}/system.slice/a.service\n") == "a.service"


# ---- config.yaml: every message at its edges, and the bounded read --------------------------


def test_directory_names_may_end_in_any_letter_but_not_in_two_slashes() -> None:
    assert parse_config("runtime_dir: /run/gpuslice/BOX\n", P)[0].runtime_dir == (
        "/run/gpuslice/BOX"
    )
    [problem] = config_problems("runtime_dir: /run/gpuslice//\n")
    assert problem.startswith(f'{P}:1: runtime_dir: invalid value "/run/gpuslice//" (allowed: ')


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("gpus: !!" + "t" * 61 + " 1\n", '"1" tagged !!' + "t" * 60 + "..."),
        ("gpus: !local 1\n", '"1" tagged !local'),
        ("gpus: !" + "t" * 60 + " 1\n", '"1" tagged !' + "t" * 59 + "..."),
        ("log_level: ''\n", '""'),
        ('log_level: ""\n', '""'),
        ("log_level:\n", "an empty value"),
    ],
)
def test_values_are_described_with_their_tags(text: str, shown: str) -> None:
    [problem] = config_problems(text)
    key = text.split(":")[0]
    assert problem.startswith(f"{P}:1: {key}: invalid value {shown} (allowed: ")


def test_a_forbidden_character_is_located_by_its_line() -> None:
    assert config_problems("\n\ngpus: 1\x00\n") == [
        f"{P}:3: not valid YAML: character #x0000 is not allowed in YAML"
    ]


def test_a_long_yaml_problem_is_cut_at_200_characters() -> None:
    [problem] = config_problems("gpus: !" + "h" * 300 + "!x 1\n")
    reason = problem.removeprefix(f"{P}:1: not valid YAML: ")
    assert reason.startswith("found undefined tag handle '!hhh")
    assert len(reason) == 203 and reason.endswith("...")


def test_exactly_as_many_problems_as_are_shown() -> None:
    text = "".join(f"unknown{i}: 1\n" for i in range(20))
    warnings = parse_config(text, P)[1]
    assert len(warnings) == 20
    assert warnings[-1].startswith(f"{P}:20: unknown19: unknown setting, ignored (known: ")


def test_too_many_errors_are_counted_under_the_files_name() -> None:
    problems = config_problems("".join(f"[{i}]: 1\n" for i in range(25)))
    assert len(problems) == 21
    assert problems[-1] == f"{P}: 5 more errors not shown"


def test_errors_after_a_bad_key_and_a_repeated_key_are_all_reported() -> None:
    problems = config_problems("[a]: 1\ngpus: 1\ngpus: 2\nlog_level: loud\n")
    assert [p.split(": ", 2)[:2] for p in problems] == [
        [f"{P}:1", "expected a setting name, got a list (known"],
        [f"{P}:3", "gpus"],
        [f"{P}:4", "log_level"],
    ]
    assert problems[1] == f"{P}:3: gpus: set twice (first at line 2)"


def test_a_long_unknown_key_is_cut_at_60_characters() -> None:
    [warning] = parse_config("k" * 61 + ": 1\n", P)[1]
    assert warning.startswith(f"{P}:1: {'k' * 60}...: unknown setting, ignored (known: ")


def test_a_scalar_is_no_config() -> None:
    assert config_problems("hello\n") == [f'{P}:1: expected a mapping of settings, got "hello"']


def test_the_largest_config_text_is_parsed_and_one_more_character_refused() -> None:
    head = "gpus: 2\n#"
    assert parse_config(head + "x" * (MAX_CONFIG_BYTES - len(head)), P)[0].gpus == 2
    assert config_problems(head + "x" * (MAX_CONFIG_BYTES + 1 - len(head))) == [
        f"{P}: larger than 262144 bytes (256 KiB), not read"
    ]


def test_the_first_bad_entry_of_the_longest_list_is_blamed() -> None:
    text = "manage_gpus:\n" + "".join(f"  - {i}\n" for i in range(MAX_GPUS - 1)) + "  - x\n"
    [problem] = config_problems(text)
    assert problem.startswith(f'{P}:{MAX_GPUS + 1}: manage_gpus: invalid value "x" (allowed: ')


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: "/dev/null", "not a regular file"),
        (lambda d: d / "file" / "config.yaml", "Not a directory"),
        (lambda d: str(d / "a\0b"), "embedded null byte"),
    ],
)
def test_a_config_that_cannot_be_read_says_why(tmp_path: Path, make: Any, reason: str) -> None:
    (tmp_path / "file").touch()
    path = make(tmp_path)
    with pytest.raises(ConfigError) as caught:
        read_config_text(path)
    shown = str(path).replace("\0", "\\x00")
    assert caught.value.problems == [f"{shown}: cannot read: {reason}"]


def chunked_reads(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> list[int]:
    """os.read returns at most 4 KiB at a time (as FUSE or a network filesystem may)."""
    real_read = os.read
    sizes: list[int] = []

    def read(fd: int, n: int) -> bytes:
        if fail:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        data = real_read(fd, min(n, 4096))
        sizes.append(len(data))
        return data

    monkeypatch.setattr(os, "read", read)
    return sizes


def test_short_reads_are_joined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "gpus: 2\n" + "#" * 10_000 + "\nlog_level: debug\n"
    (tmp_path / "config.yaml").write_text(text)
    chunked_reads(monkeypatch)
    assert read_config_text(tmp_path / "config.yaml") == text


def test_no_more_than_the_cap_and_a_byte_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("#" * (4 * MAX_CONFIG_BYTES))
    sizes = chunked_reads(monkeypatch)
    with pytest.raises(ConfigError) as caught:
        read_config_text(path)
    assert caught.value.problems == [f"{path}: larger than 262144 bytes (256 KiB), not read"]
    assert sum(sizes) == MAX_CONFIG_BYTES + 1


def test_a_config_of_exactly_the_cap_is_read(tmp_path: Path) -> None:
    text = "gpus: 2\n#" + "x" * (MAX_CONFIG_BYTES - 9)
    (tmp_path / "config.yaml").write_text(text)
    assert read_config_text(tmp_path / "config.yaml") == text


def test_a_read_error_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.yaml").write_text("gpus: 2\n")
    chunked_reads(monkeypatch, fail=True)
    with pytest.raises(ConfigError) as caught:
        read_config_text(tmp_path / "config.yaml")
    assert caught.value.problems == [f"{tmp_path}/config.yaml: cannot read: Input/output error"]


def test_a_bad_byte_after_blank_lines_is_located(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_bytes(b"\n\ngpus: \xff\n")
    with pytest.raises(ConfigError) as caught:
        read_config_text(tmp_path / "config.yaml")
    assert caught.value.problems == [
        f"{tmp_path}/config.yaml:3: not UTF-8 text (byte 0xff at offset 8)"
    ]


@pytest.mark.timeout(20)
def test_a_fifo_swapped_in_after_the_check_is_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    (tmp_path / "regular").touch()
    os.mkfifo(path)
    real_stat = os.stat
    regular = real_stat(tmp_path / "regular")

    def fake_stat(file: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        return regular if str(file) == str(path) else real_stat(file, *args, **kwargs)

    monkeypatch.setattr(os, "stat", fake_stat)
    errors: list[list[str]] = []

    def read() -> None:
        try:
            read_config_text(path)
        except ConfigError as e:
            errors.append(e.problems)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(30)  # a pass never waits this long: a loaded machine may start it late
    if reader.is_alive():  # blocked in open(): a writer lets it go, then fail
        os.close(os.open(path, os.O_WRONLY))
        reader.join()
    assert errors == [[f"{path}: cannot read: a FIFO, not a regular file"]]
