"""Boundary tests for the validating adapters that `make mutate MUTATE=adapters` asked for.

Each test pins observable behaviour (a returned value, the exact words of a located error) at
an edge that the adapters' own test files left open; mutation testing found the edges.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from gpuslice.cgroups import unit_of_pid
from gpuslice.config import MAX_GPUS, ConfigError, parse_config
from gpuslice.core.scheduler import SavedState
from gpuslice.sizes import SIZE_MAX, format_size, parse_size
from gpuslice.state import Problems, StateStore, validate
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
            "sandbox lets it write nowhere else)"
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
