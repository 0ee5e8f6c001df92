"""config.yaml: defaults, validation with line numbers, unknown keys, the shipped file."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice.config import (
    SETTINGS,
    SETTINGS_BY_NAME,
    SETTLE_SECONDS,
    Config,
    ConfigError,
    Settling,
    load_config,
    load_config_with_warnings,
    located,
    parse_config,
    pin_runtime_dir,
    read_pinned_runtime_dir,
    read_unchanged,
    runtime_dirs_of_this_boot,
    stamp,
    unsettled,
)

REPO_CONFIG = Path(__file__).resolve().parent.parent / "config.yaml"
# what error messages say is allowed, word for word
ALLOWED = {
    "GPUS": "an integer 1-1024",
    "RETRY": "a number of seconds 0.05-60",
    "STATE": "/var/lib/gpuslice or a directory below it, at most 200 characters of letters, "
    'digits, ".", "_", "-" and "/", without "." or ".." components: the service\'s sandbox lets '
    'it write nowhere else; with no name below it that is "state-dir" or "state.json", nor one '
    'of them followed by "." or "-", nor any of these after a ".": gpuslice names its own '
    "files there so",
    "RUNTIME": "/run/gpuslice or a directory below it, at most 200 characters of letters, "
    'digits, ".", "_", "-" and "/", without "." or ".." components: the service\'s sandbox lets '
    'it write nowhere else; with no name below it that is "runtime-dir", "state.json", "env" or '
    '"gate", nor one of them followed by "." or "-", nor any of these after a ".": gpuslice '
    "names its own files there so",
    "MANAGE": "a list of at most 1024 GPU indices or GPU- UUIDs (MIG devices are not supported; "
    "empty: every GPU NVML finds)",
    "RESERVE": "a size such as 512M, 20G or 20GiB (binary units, at most 1P), or a mapping of "
    'GPU index or GPU- UUID (or "*") to such a size',
    "TOOL": '"" (look for it on PATH and in the driver\'s usual directories) or an absolute path, '
    'at most 200 characters of letters, digits, ".", "_", "-" and "/", without "." or ".." '
    'components or a trailing "/"',
}


def fill(message: str, path: Path) -> str:
    message = message.replace("{P}", str(path))
    for name, allowed in ALLOWED.items():
        message = message.replace("{" + name + "}", allowed)
    return message


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_table_and_dataclass_agree() -> None:
    assert [s.name for s in SETTINGS] == [f.name for f in dataclasses.fields(Config)]
    assert Config() == Config(**{s.name: s.default for s in SETTINGS})
    assert Config() == Config(
        1,
        "info",
        "/var/lib/gpuslice",
        "/run/gpuslice",
        (),
        (("*", 0),),
        "yield",
        2.0,
        30.0,
        0.5,
        False,
        90.0,
        120.0,
        "",
        10.0,
        300.0,
        300.0,
        2 << 30,
    )


def test_missing_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config_with_warnings(tmp_path / "absent.yaml") == (Config(), [])


def test_a_symlink_that_leads_nowhere_is_no_missing_file(tmp_path: Path) -> None:
    """config.yaml (or the directory above it) linked elsewhere, and the target not there:
    a file moved, a file system not mounted yet. Read as a missing file, it meant the
    defaults, on a reload too (manage_gpus gone: the cluster's GPUs handed out)."""
    linked = tmp_path / "config.yaml"
    linked.symlink_to(tmp_path / "srv" / "gpuslice.yaml")
    with pytest.raises(ConfigError) as caught:
        load_config(linked)
    assert caught.value.problems == [
        f"{linked}: cannot read: {linked} is a symbolic link that leads nowhere (to "
        f"{tmp_path}/srv/gpuslice.yaml: a file system not mounted yet, a file moved?); not "
        "taken for a missing file, which would mean the defaults"
    ]
    etc = tmp_path / "etc-gpuslice"
    etc.symlink_to("../not-mounted/gpuslice")
    with pytest.raises(ConfigError) as caught:
        load_config(etc / "config.yaml")
    assert caught.value.problems[0].startswith(
        f"{etc}/config.yaml: cannot read: {etc} is a symbolic link that leads nowhere (to "
        "../not-mounted/gpuslice: "
    )
    (tmp_path / "srv").mkdir()  # a link to a directory that is there: the file is absent
    here = tmp_path / "here"
    here.symlink_to(tmp_path / "srv")
    assert load_config_with_warnings(here / "config.yaml") == (Config(), [])
    (tmp_path / "srv" / "gpuslice.yaml").write_text("gpus: 3\n")
    assert load_config(linked) == Config(gpus=3)


@pytest.mark.parametrize("text", ["", "# only comments\n", "---\n", "~\n"])
def test_empty_file_gives_defaults(tmp_path: Path, text: str) -> None:
    assert load_config(write(tmp_path, text)) == Config()


def test_shipped_file_is_the_defaults_and_comments_every_setting() -> None:
    assert load_config_with_warnings(REPO_CONFIG) == (Config(), [])
    text = REPO_CONFIG.read_text()
    for setting in SETTINGS:
        before = text.split(f"\n{setting.name}:")[0]
        assert before.rstrip().splitlines()[-1].startswith("#"), setting.name


def test_the_readmes_table_of_keys_lists_every_setting() -> None:
    """An admin looks a key up in README's Configuration table (driver_wait, the bound on how
    long background units wait for a driver that never comes, was missing from it)."""
    readme = (REPO_CONFIG.parent / "README.md").read_text()
    table = readme.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    keys = {row.split("|")[1].strip().strip("`") for row in rows}
    assert keys == set(SETTINGS_BY_NAME)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpus: 4\n", Config(gpus=4)),
        ("log_level: debug\n", Config(log_level="debug")),
        (
            "state_dir: /var/lib/gpuslice/a\nruntime_dir: /run/gpuslice/b/\n",
            Config(state_dir="/var/lib/gpuslice/a", runtime_dir="/run/gpuslice/b"),
        ),
        ("gate_retry_seconds: 2\n", Config(gate_retry_seconds=2.0)),
        ("gate_retry_seconds: 0.05\n", Config(gate_retry_seconds=0.05)),
    ],
)
def test_valid(tmp_path: Path, text: str, expected: Config) -> None:
    config = load_config(write(tmp_path, text))
    assert config == expected
    assert isinstance(config.gate_retry_seconds, float)


@pytest.mark.parametrize(
    ("text", "messages"),
    [
        pytest.param(
            "gpus: 0\n", ['{P}:1: gpus: invalid value "0" (allowed: {GPUS})'], id="gpus-0"
        ),
        pytest.param(
            "gpus: two\n",
            ['{P}:1: gpus: invalid value "two" (allowed: {GPUS})'],
            id="gpus-word",
        ),
        pytest.param(
            "gpus: true\n",
            ['{P}:1: gpus: invalid value "true" (allowed: {GPUS})'],
            id="gpus-bool",
        ),
        pytest.param(
            "gpus: 1.5\n",
            ['{P}:1: gpus: invalid value "1.5" (allowed: {GPUS})'],
            id="gpus-float",
        ),
        pytest.param(
            "# comment\nlog_level: loud\n",
            ['{P}:2: log_level: invalid value "loud" (allowed: debug, info, warning, error)'],
            id="log-level",
        ),
        pytest.param(
            "state_dir: var/lib\n",
            ['{P}:1: state_dir: invalid value "var/lib" (allowed: {STATE})'],
            id="relative-path",
        ),
        pytest.param(
            "runtime_dir:\n  - /run\n",
            ["{P}:2: runtime_dir: invalid value a list (allowed: {RUNTIME})"],
            id="list-value",
        ),
        pytest.param(
            "gate_retry_seconds: 0\n",
            ['{P}:1: gate_retry_seconds: invalid value "0" (allowed: {RETRY})'],
            id="retry-zero",
        ),
        pytest.param(
            "gate_retry_seconds: .nan\n",
            ['{P}:1: gate_retry_seconds: invalid value ".nan" (allowed: {RETRY})'],
            id="retry-nan",
        ),
        pytest.param(
            "gate_retry_seconds: '1'\n",
            ['{P}:1: gate_retry_seconds: invalid value "1" (allowed: {RETRY})'],
            id="retry-quoted-string",
        ),
        pytest.param(
            "gpus: 0\nlog_level: loud\nstate_dir: x\nruntime_dir:\ngate_retry_seconds: -1\n",
            [
                '{P}:1: gpus: invalid value "0" (allowed: {GPUS})',
                '{P}:2: log_level: invalid value "loud" (allowed: debug, info, warning, error)',
                '{P}:3: state_dir: invalid value "x" (allowed: {STATE})',
                "{P}:4: runtime_dir: invalid value an empty value (allowed: {RUNTIME})",
                '{P}:5: gate_retry_seconds: invalid value "-1" (allowed: {RETRY})',
            ],
            id="every-problem-collected",
        ),
        pytest.param(
            "gpus: 2\ngpus: 3\n", ["{P}:2: gpus: set twice (first at line 1)"], id="duplicate"
        ),
        pytest.param(
            'reserve:\n  0: 20G\n  "0": 1G\n',
            ['{P}:3: reserve: "0" set twice (first at line 2)'],
            id="duplicate-reserve-gpu",  # 1G kept silently before
        ),
        pytest.param(
            'reserve: {"*": 2G, "*": 1G}\n',
            ['{P}:1: reserve: "*" set twice (first at line 1)'],
            id="duplicate-reserve-default",
        ),
        pytest.param(
            f"reserve: {{{'G' * 70}: 2G, {'G' * 70}: 1G}}\n",
            [f'{{P}}:1: reserve: "{"G" * 60}..." set twice (first at line 1)'],
            id="duplicate-reserve-long-key",  # cut as every echoed value is
        ),
        pytest.param(
            "- gpus\n", ["{P}:1: expected a mapping of settings, got a list"], id="not-a-mapping"
        ),
        pytest.param(
            "gpus: [1\n",
            ["{P}:2: not valid YAML: expected ',' or ']', but got '<stream end>'"],
            id="yaml-syntax",
        ),
    ],
)
def test_errors(tmp_path: Path, text: str, messages: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    expected = [fill(m, path) for m in messages]
    assert caught.value.problems == expected
    assert str(caught.value) == "\n".join(expected)


def test_unknown_keys_are_warnings(tmp_path: Path) -> None:
    path = write(tmp_path, "gpus: 2\ncolour: blue\n")
    config, warnings = load_config_with_warnings(path)
    assert config == Config(gpus=2)
    assert warnings == [
        f"{path}:2: colour: unknown setting, ignored (known: gpus, log_level, state_dir, "
        "runtime_dir, manage_gpus, reserve, foreign_processes, sample_interval, "
        "vram_release_timeout, gate_retry_seconds, requeue_at_gate, stop_timeout, driver_wait, "
        "cuda_checkpoint, checkpoint_lock_timeout, checkpoint_timeout, restore_timeout, "
        "suspend_host_memory_margin)"
    ]


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().gpus = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("reserve: 1G\n", {0: 1 << 30, 1: 1 << 30}),
        ("reserve:\n  1: 512M\n", {0: 0, 1: 512 << 20}),
        ("reserve:\n  GPU-b: 2GiB\n  '*': 1G\n", {0: 1 << 30, 1: 2 << 30}),
    ],
)
def test_reserve_per_gpu(tmp_path: Path, text: str, expected: dict[int, int]) -> None:
    config = load_config(write(tmp_path, text))
    uuids = {0: "GPU-a", 1: "GPU-b"}
    assert {i: config.reserve_for(i, uuids[i]) for i in (0, 1)} == expected


def test_gpu_settings_are_validated(tmp_path: Path) -> None:
    path = write(tmp_path, "reserve: lots\nforeign_processes: fight\nmanage_gpus: [0, first]\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [
        fill('{P}:1: reserve: invalid value "lots" (allowed: {RESERVE})', path),
        f'{path}:2: foreign_processes: invalid value "fight" (allowed: yield, ignore)',
        fill('{P}:3: manage_gpus: invalid value "first" (allowed: {MANAGE})', path),
    ]


# ---------------------------------------------------------------------------------------------
# trust: nothing in config.yaml crashes or stalls a reader, every value has a range


def problems_of(text: str, path: str = "/etc/gpuslice/config.yaml") -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, path)
    assert all(p.startswith(f"{path}:") for p in caught.value.problems)
    return caught.value.problems


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "gpus: " + "[" * 3000 + "]" * 3000 + "\n",
            "{P}:1: not valid YAML: nested deeper than 16 levels",
            id="deep-flow-list",  # RecursionError before
        ),
        pytest.param(
            "".join(" " * i + "-\n" for i in range(500)),
            "{P}:17: not valid YAML: nested deeper than 16 levels",
            id="deep-block-list",
        ),
        pytest.param(
            "a: &a [x, x, x, x, x, x, x, x, x]\n"
            "b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
            "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
            "manage_gpus: [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n",
            "{P}:2: not valid YAML: aliases (*name) are not allowed in config.yaml",
            id="billion-laughs",
        ),
        pytest.param(
            "? [a, b]\n: 1\n",
            "{P}:1: expected a setting name, got a list (known: gpus, log_level, state_dir, "
            "runtime_dir, manage_gpus, reserve, foreign_processes, sample_interval, "
            "vram_release_timeout, gate_retry_seconds, requeue_at_gate, stop_timeout, "
            "driver_wait, cuda_checkpoint, checkpoint_lock_timeout, checkpoint_timeout, "
            "restore_timeout, suspend_host_memory_margin)",
            id="list-as-key",
        ),
        pytest.param(
            "gpus: !!python/object/apply:os.system [ls]\n",
            "{P}:1: gpus: invalid value a list tagged !!python/object/apply:os.system "
            "(allowed: {GPUS})",
            id="python-tag",
        ),
        pytest.param(
            "gpus: !!int abc\n",
            '{P}:1: gpus: invalid value "abc" (allowed: {GPUS})',
            id="int-tag-not-a-number",  # ValueError before
        ),
        pytest.param(
            "gpus: !!timestamp 2020-99\n",
            '{P}:1: gpus: invalid value "2020-99" tagged !!timestamp (allowed: {GPUS})',
            id="bad-timestamp",  # AttributeError before
        ),
        pytest.param(
            "gpus: !!int \u0661\u0662\n",
            '{P}:1: gpus: invalid value "\\u0661\\u0662" (allowed: {GPUS})',
            id="arabic-indic-digits",  # int() takes them: 12 GPUs before
        ),
        pytest.param(
            "gpus: " + "9" * 5000 + "\n",
            '{P}:1: gpus: invalid value "' + "9" * 60 + '..." (allowed: {GPUS})',
            id="5000-digits",  # ValueError (int max str digits) before
        ),
        pytest.param(
            "gpus: 1\x00\n",
            "{P}:1: not valid YAML: character #x0000 is not allowed in YAML",
            id="nul",
        ),
        pytest.param(
            'log_level: "\\e[2J"\n',
            '{P}:1: log_level: invalid value "\\x1b[2J" (allowed: debug, info, warning, error)',
            id="escape-sequence-is-not-echoed",
        ),
    ],
)
def test_hostile_yaml_is_a_located_error(text: str, expected: str) -> None:
    path = "/etc/gpuslice/config.yaml"
    assert problems_of(text, path) == [fill(expected, Path(path))]


# (setting, lowest, highest, just below, just above)
BOUNDS = [
    ("gpus", "1", "1024", "0", "1025"),
    ("sample_interval", "0.05", "3600", "0.049", "3600.01"),
    ("vram_release_timeout", "0.1", "3600", "0.09", "3601"),
    ("gate_retry_seconds", "0.05", "60", "1e-9", "60.5"),
    ("stop_timeout", "1", "86400", "0.5", "86401"),
    ("driver_wait", "0", "3600", "-0.5", "3600.5"),
    ("reserve", "0", "1P", "-1", "1025T"),
    ("checkpoint_lock_timeout", "0.1", "3600", "0.09", "3600.5"),
    ("checkpoint_timeout", "1", "86400", "0.99", "86401"),
    ("restore_timeout", "1", "86400", "0", "86400.5"),
    ("suspend_host_memory_margin", "0", "1P", "-1", "1025T"),
]


@pytest.mark.parametrize(("key", "low", "high", "below", "above"), BOUNDS)
def test_every_number_has_a_range(key: str, low: str, high: str, below: str, above: str) -> None:
    parse_config(f"{key}: {low}\n", "/c")
    parse_config(f"{key}: {high}\n", "/c")
    allowed = SETTINGS_BY_NAME[key].allowed
    # 400 digits: math.isfinite() of it raised OverflowError (found by test_fuzz_config)
    for bad in (below, above, "10000000000000000", "9" * 400, ".inf", "-.inf", ".nan"):
        shown = bad if len(bad) <= 60 else bad[:60] + "..."
        assert problems_of(f"{key}: {bad}\n", "/c") == [
            f'/c:1: {key}: invalid value "{shown}" (allowed: {allowed})'
        ]


def test_a_trillion_gpus_is_refused_at_once() -> None:
    # the CPU time taken, not the wall time: a loaded machine stretches the one, not the other
    start = time.process_time()
    assert problems_of("gpus: 1000000000000\n", "/c") == [
        '/c:1: gpus: invalid value "1000000000000" (allowed: an integer 1-1024)'
    ]
    assert time.process_time() - start < 1


def test_stop_timeout() -> None:
    assert Config().stop_timeout == 90.0
    assert parse_config("stop_timeout: 600\n", "/c")[0].stop_timeout == 600.0
    assert SETTINGS_BY_NAME["stop_timeout"].allowed == "a number of seconds 1-86400"


@pytest.mark.parametrize(
    "value",
    [
        "/srv/state",
        "/var/lib/gpuslice2",  # a prefix of the name is not below it
        "/var/lib",
        "/var/lib/gpuslice/../../../etc",
        "/var/lib/gpuslice/./x",
        "/var/lib//gpuslice",
        "/var/lib/gpuslice/a b",
        "/var/lib/gpuslice/x%n",
        '"/var/lib/gpuslice\\nExecStartPre=/bin/evil"',
        "/var/lib/gpuslice/" + "x" * 183,  # 201 characters
    ],
)
def test_state_dir_must_be_where_the_sandbox_lets_the_service_write(value: str) -> None:
    (problem,) = problems_of(f"state_dir: {value}\n", "/c")
    assert problem.startswith("/c:1: state_dir: invalid value ")
    assert problem.endswith(f"(allowed: {ALLOWED['STATE']})")


def test_runtime_dir_with_a_newline_is_refused() -> None:
    # before, it became two lines in every generated drop-in
    (problem,) = problems_of('runtime_dir: "/run/gpuslice\\nExecStartPre=/bin/evil"\n', "/c")
    assert problem == (
        '/c:1: runtime_dir: invalid value "/run/gpuslice\\x0aExecStartPre=/bin/evil" '
        f"(allowed: {ALLOWED['RUNTIME']})"
    )


def test_paths_at_the_limit() -> None:
    longest = "/var/lib/gpuslice/" + "x" * 182
    assert len(longest) == 200
    config, _ = parse_config(f"state_dir: {longest}\nruntime_dir: /run/gpuslice/a.b_c-d/\n", "/c")
    assert (config.state_dir, config.runtime_dir) == (longest, "/run/gpuslice/a.b_c-d")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("manage_gpus: [0, MIG-1234]\n", '{P}:1: manage_gpus: invalid value "MIG-1234"'),
        ("manage_gpus:\n  - 0\n  - GPU-ok\n  - -1\n", '{P}:4: manage_gpus: invalid value "-1"'),
        ("manage_gpus: [10000]\n", '{P}:1: manage_gpus: invalid value "10000"'),
        (
            "manage_gpus: [" + ", ".join(["0"] * 1025) + "]\n",
            "{P}:1: manage_gpus: invalid value a list",
        ),
    ],
)
def test_manage_gpus_entries(text: str, expected: str) -> None:
    assert problems_of(text, "/c") == [
        fill(f"{expected} (allowed: {{MANAGE}})", Path("/c")),
    ]


def test_manage_gpus_at_the_limit() -> None:
    text = "manage_gpus: [" + ", ".join(str(i) for i in range(1024)) + ", GPU-a1-b2]\n"
    with pytest.raises(ConfigError):
        parse_config(text, "/c")  # 1025 entries
    config, _ = parse_config(text.replace(", GPU-a1-b2", ""), "/c")
    assert len(config.manage_gpus) == 1024


@pytest.mark.parametrize(
    "text",
    [
        "reserve:\n  MIG-1: 1G\n",
        "reserve:\n  first: 1G\n",
        "reserve:\n  0: 2P\n",
        "reserve:\n  [0]: 1G\n",
        "reserve: 1.5\n",
    ],
)
def test_reserve_keys_and_sizes(text: str) -> None:
    (problem,) = problems_of(text, "/c")
    assert problem.endswith(fill("(allowed: {RESERVE})", Path("/c")))


def test_a_bad_reserve_entry_is_named_at_its_own_line() -> None:
    text = "reserve:\n  0: 1G\n  '*': 2G\n  1: lots\n  first: 1G\n"
    assert problems_of(text, "/c") == [
        fill('/c:4: reserve: invalid value "lots" (allowed: {RESERVE})', Path("/c"))
    ]
    assert problems_of("reserve:\n  0: 1G\n\n  first: 1G\n", "/c") == [
        fill('/c:4: reserve: invalid value "first" (allowed: {RESERVE})', Path("/c"))
    ]
    # as many entries as a host may have GPUs, the last one bad
    most = "".join(f"  {i}: 1G\n" for i in range(1023)) + "  1023: lots\n"
    assert problems_of("reserve:\n" + most, "/c") == [
        fill('/c:1025: reserve: invalid value "lots" (allowed: {RESERVE})', Path("/c"))
    ]


def test_hundreds_of_problems_are_cut_short() -> None:
    text = "".join(f"unknown{i}: 1\n" for i in range(500))
    _, warnings = parse_config(text, "/c")
    assert len(warnings) == 21
    assert warnings[-1] == "/c: 480 more warnings not shown"


# ---------------------------------------------------------------------------------------------
# the file itself


def test_huge_file_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("# " + "x" * (2 << 20) + "\ngpus: 2\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [f"{path}: larger than 262144 bytes (256 KiB), not read"]


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"gpus: 2\nlog_level: \xff\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [f"{path}:2: not UTF-8 text (byte 0xff at offset 19)"]


def test_directory_and_fifo_are_errors_without_blocking(tmp_path: Path) -> None:
    directory = tmp_path / "dir.yaml"
    directory.mkdir()
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opening it for reading would block
    for path, what in ((directory, "a directory"), (fifo, "a FIFO")):
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        assert caught.value.problems == [f"{path}: cannot read: {what}, not a regular file"]


def test_path_with_control_characters_is_shown_escaped(tmp_path: Path) -> None:
    path = tmp_path / "bad\nname.yaml"
    path.write_text("gpus: 0\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems[0].startswith(f"{tmp_path}/bad\\x0aname.yaml:1: gpus: ")


def test_driver_wait() -> None:
    assert Config().driver_wait == 120.0
    assert parse_config("driver_wait: 0\n", "/c") == (Config(driver_wait=0.0), [])
    assert parse_config("driver_wait: 7.5\n", "/c")[0].driver_wait == 7.5
    assert problems_of("driver_wait: soon\n", "/c") == [
        '/c:1: driver_wait: invalid value "soon" (allowed: a number of seconds 0-3600)'
    ]


def test_requeue_at_gate_is_a_yaml_boolean() -> None:
    assert Config().requeue_at_gate is False
    assert parse_config("requeue_at_gate: true\n", "/c") == (Config(requeue_at_gate=True), [])
    assert parse_config("requeue_at_gate: no\n", "/c") == (Config(requeue_at_gate=False), [])
    for text, shown in (("1", '"1"'), ('"true"', '"true"')):  # a number, a string
        assert problems_of(f"requeue_at_gate: {text}\n", "/c") == [
            f"/c:1: requeue_at_gate: invalid value {shown} (allowed: true or false)"
        ], text


# ---------------------------------------------------------------------------------------------
# suspending with cuda-checkpoint


def test_checkpoint_defaults() -> None:
    config = Config()
    assert (
        config.cuda_checkpoint,
        config.checkpoint_lock_timeout,
        config.checkpoint_timeout,
        config.restore_timeout,
        config.suspend_host_memory_margin,
    ) == ("", 10.0, 300.0, 300.0, 2 << 30)


def test_checkpoint_settings_are_read() -> None:
    text = (
        "cuda_checkpoint: /opt/nvidia/bin/cuda-checkpoint\n"
        "checkpoint_lock_timeout: 2.5\n"
        "checkpoint_timeout: 60\n"
        "restore_timeout: 120\n"
        "suspend_host_memory_margin: 512M\n"
    )
    config, warnings = parse_config(text, "/c")
    assert warnings == []
    assert config == Config(
        cuda_checkpoint="/opt/nvidia/bin/cuda-checkpoint",
        checkpoint_lock_timeout=2.5,
        checkpoint_timeout=60.0,
        restore_timeout=120.0,
        suspend_host_memory_margin=512 << 20,
    )
    assert isinstance(config.checkpoint_timeout, float)
    assert isinstance(config.restore_timeout, float)


def test_checkpoint_settings_for_the_checkpoint_module() -> None:
    from gpuslice.checkpoint import CheckpointSettings

    config = parse_config("cuda_checkpoint: /usr/bin/cuda-checkpoint\nrestore_timeout: 9\n", "/c")[
        0
    ]
    assert CheckpointSettings.from_config(config) == CheckpointSettings(
        tool="/usr/bin/cuda-checkpoint",
        lock_timeout=10.0,
        checkpoint_timeout=300.0,
        restore_timeout=9.0,
        host_memory_margin=2 << 30,
        via_systemd=True,
        root_only=True,
    )


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        ('""', ""),
        ("''", ""),
        ("/usr/local/cuda/bin/cuda-checkpoint", "/usr/local/cuda/bin/cuda-checkpoint"),
        ("/a", "/a"),
        ("/opt/" + "x" * 195, "/opt/" + "x" * 195),  # 200 characters
    ],
)
def test_cuda_checkpoint_paths(value: str, stored: str) -> None:
    assert parse_config(f"cuda_checkpoint: {value}\n", "/c")[0].cuda_checkpoint == stored


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("cuda-checkpoint", '"cuda-checkpoint"'),  # relative: PATH is not the admin's to pick
        ("bin/cuda-checkpoint", '"bin/cuda-checkpoint"'),
        ("/", '"/"'),
        ("/usr/bin/", '"/usr/bin/"'),
        ("/usr//bin/cuda-checkpoint", '"/usr//bin/cuda-checkpoint"'),
        ("/usr/bin/../sbin/x", '"/usr/bin/../sbin/x"'),
        ("/usr/./bin/x", '"/usr/./bin/x"'),
        ("/opt/a b", '"/opt/a b"'),
        ("/opt/x%n", '"/opt/x%n"'),
        ('"/opt/x\\nExecStart=/bin/evil"', '"/opt/x\\x0aExecStart=/bin/evil"'),
        ("/opt/" + "x" * 196, '"/opt/' + "x" * 55 + '..."'),  # 201 characters
        ("", "an empty value"),  # null: write "" to search
        ("[/usr/bin/cuda-checkpoint]", "a list"),
        ("1", '"1"'),
    ],
)
def test_cuda_checkpoint_bad_paths(value: str, shown: str) -> None:
    assert problems_of(f"cuda_checkpoint: {value}\n", "/c") == [
        fill(f"/c:1: cuda_checkpoint: invalid value {shown} (allowed: {{TOOL}})", Path("/c"))
    ]


@pytest.mark.parametrize(
    ("key", "allowed"),
    [
        ("checkpoint_lock_timeout", "a number of seconds 0.1-3600"),
        ("checkpoint_timeout", "a number of seconds 1-86400"),
        ("restore_timeout", "a number of seconds 1-86400"),
        (
            "suspend_host_memory_margin",
            "a size such as 512M, 20G or 20GiB (binary units, at most 1P)",
        ),
    ],
)
def test_checkpoint_numbers_say_what_is_allowed(key: str, allowed: str) -> None:
    assert SETTINGS_BY_NAME[key].allowed == allowed
    assert problems_of(f"{key}: soon\n", "/c") == [
        f'/c:1: {key}: invalid value "soon" (allowed: {allowed})'
    ]


@pytest.mark.parametrize(
    ("value", "stored"),
    [("0", 0), ("2G", 2 << 30), ("1.5GiB", 3 << 29), ("4096", 4096), ("1P", 1 << 50)],
)
def test_suspend_host_memory_margin_sizes(value: str, stored: int) -> None:
    config = parse_config(f"suspend_host_memory_margin: {value}\n", "/c")[0]
    assert config.suspend_host_memory_margin == stored


@pytest.mark.parametrize("value", ["lots", "1.5", "-1G", "{'*': 1G}", "[1G]", "1E", "true"])
def test_suspend_host_memory_margin_refuses_what_is_not_one_size(value: str) -> None:
    (problem,) = problems_of(f"suspend_host_memory_margin: {value}\n", "/c")
    assert problem.startswith("/c:1: suspend_host_memory_margin: invalid value ")
    assert problem.endswith(
        "(allowed: a size such as 512M, 20G or 20GiB (binary units, at most 1P))"
    )


# ---- who may change the file -----------------------------------------------------------------

ROOTS_ALONE = (
    ": only root may be able to change what gpuslice does as root (it runs cuda_checkpoint); "
    "make the file and its directories root's, writable by root alone"
)


def test_a_file_anyone_can_write_is_not_read(tmp_path: Path) -> None:
    """config.yaml `chmod 666`, or in a directory anyone can write (a user replaces it): a
    user set cuda_checkpoint to a program of theirs, which the controller ran as root."""
    path = write(tmp_path, "cuda_checkpoint: /home/eve/pwn\n")
    path.chmod(0o666)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [
        f"{path}: not read: {path} is writable by anyone (mode 0666){ROOTS_ALONE}"
    ]
    path.chmod(0o644)
    tmp_path.chmod(0o777)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [
        f"{path}: not read: {tmp_path} is writable by anyone (mode 0777){ROOTS_ALONE}"
    ]
    tmp_path.chmod(0o1777)  # sticky, as /tmp: only the file's owner may replace it there
    assert load_config(path).cuda_checkpoint == "/home/eve/pwn"


def test_a_symlink_to_a_file_anyone_can_write_is_not_read(tmp_path: Path) -> None:
    """/etc/gpuslice/config.yaml linked to a file elsewhere: the file it leads to counts,
    and the directories above it; so do those above the link."""
    target = tmp_path / "srv" / "gpuslice.yaml"
    target.parent.mkdir()
    target.write_text("gpus: 2\n")
    target.parent.chmod(0o777)
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "config.yaml").symlink_to(target)
    with pytest.raises(ConfigError) as caught:
        load_config(etc / "config.yaml")
    assert caught.value.problems == [
        f"{etc}/config.yaml: not read: {target.parent} is writable by anyone (mode 0777)"
        f"{ROOTS_ALONE}"
    ]
    target.parent.chmod(0o755)
    assert load_config(etc / "config.yaml") == Config(gpus=2)
    etc.chmod(0o777)  # the link itself can be replaced
    with pytest.raises(ConfigError) as caught:
        load_config(etc / "config.yaml")
    assert f"not read: {etc} is writable by anyone (mode 0777)" in caught.value.problems[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_file_of_another_user_or_group_is_not_read_by_root(tmp_path: Path) -> None:
    path = write(tmp_path, "gpus: 2\n")
    os.chown(path, 1000, 0)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [f"{path}: not read: {path} is owned by UID 1000{ROOTS_ALONE}"]
    os.chown(path, 0, 1000)
    path.chmod(0o664)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [
        f"{path}: not read: {path} is writable by group GID 1000 (mode 0664){ROOTS_ALONE}"
    ]
    os.chown(path, 0, 0)  # group root may write: root's
    assert load_config(path) == Config(gpus=2)
    os.chown(tmp_path, 1000, 1000)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert f"not read: {tmp_path} is owned by UID 1000" in caught.value.problems[0]


# ---- the runtime_dir of this boot, a file being written, where a key is ------------------------


@pytest.mark.parametrize("value", ["/run/gpuslice/runtime-dir", "/run/gpuslice/runtime-dir/x"])
def test_runtime_dir_is_not_where_the_runtime_dir_of_this_boot_is_recorded(value: str) -> None:
    (problem,) = problems_of(f"runtime_dir: {value}\n", "/c")
    assert problem == f'/c:1: runtime_dir: invalid value "{value}" (allowed: {ALLOWED["RUNTIME"]})'
    # any name that begins as the record's does is refused too (tests/test_state_records.py)
    assert parse_config("runtime_dir: /run/gpuslice/runtime-di\n", "/c")[0].runtime_dir == (
        "/run/gpuslice/runtime-di"
    )


def test_the_runtime_dir_record(tmp_path: Path) -> None:
    """Written at once, read back; a record that is no runtime_dir, or a symlink, is none;
    no record without the directory systemd makes for gpuslice.service."""
    record = tmp_path / "gpuslice" / "runtime-dir"
    assert not pin_runtime_dir(record, "/run/gpuslice/a")
    assert not record.parent.exists() and read_pinned_runtime_dir(record) is None
    record.parent.mkdir()
    assert pin_runtime_dir(record, "/run/gpuslice/a")
    assert record.read_text() == "/run/gpuslice/a\n"
    assert read_pinned_runtime_dir(record) == "/run/gpuslice/a"
    assert sorted(p.name for p in record.parent.iterdir()) == ["runtime-dir"]
    record.write_text("/run/gpuslice/c")  # no newline at the end: the whole of it
    assert read_pinned_runtime_dir(record) == "/run/gpuslice/c"
    for text in ("/etc\n", "/run/gpuslice/a\nX=1\n", "", "/run/gpuslice/\xe9\n"):
        record.write_text(text)
        assert read_pinned_runtime_dir(record) is None, text
    record.unlink()
    (tmp_path / "elsewhere").write_text("/run/gpuslice/b\n")
    record.symlink_to(tmp_path / "elsewhere")
    assert read_pinned_runtime_dir(record) is None


def test_a_file_is_settled_once_left_alone_for_a_second(tmp_path: Path) -> None:
    path = write(tmp_path, "gpus: 2\n")
    changed = os.stat(path).st_ctime
    assert unsettled(path, changed) == SETTLE_SECONDS  # changed this very instant
    assert unsettled(path, changed + 0.25) == pytest.approx(SETTLE_SECONDS - 0.25)
    assert unsettled(path, changed + SETTLE_SECONDS) == 0
    assert unsettled(path, changed - 3600) == 0  # the clock set back: not waited for
    assert unsettled(tmp_path / "absent.yaml", changed) == 0
    before = stamp(path)
    assert before is not None and stamp(path) == before
    path.write_text("gpus: 3\n")
    assert stamp(path) != before and stamp(tmp_path / "absent.yaml") is None


def test_read_unchanged_is_none_when_the_file_changed_while_it_was_read(tmp_path: Path) -> None:
    """What was read, good or bad, is None when the file changed meanwhile (a writer half-way);
    a bad file left alone is its ConfigError."""
    path = write(tmp_path, "gpus: 2\n")
    assert read_unchanged(path, load_config_with_warnings) == (Config(gpus=2), [])

    def rewritten(text: str) -> Callable[[str | os.PathLike[str]], tuple[Config, list[str]]]:
        def load(p: str | os.PathLike[str]) -> tuple[Config, list[str]]:
            try:
                return load_config_with_warnings(p)
            finally:
                Path(p).write_text(text)

        return load

    # sizes differ: a file's times may not move between two writes in one clock tick
    assert read_unchanged(path, rewritten("gpus: 0\n# x\n")) is None  # read good, changed
    assert read_unchanged(path, rewritten("gpus: 3\n")) is None  # read bad, then changed
    path.write_text("gpus: 0\n")
    with pytest.raises(ConfigError, match="gpus"):
        read_unchanged(path, load_config_with_warnings)


def test_settling_counts_waits_and_changed_reads_up_to_its_limit(tmp_path: Path) -> None:
    """A file changed just now is waited for, each wait counted; a read it changed under is
    one more; once `max_waits` are spent the file is read as it is, however fresh."""
    path = write(tmp_path, "gpus: 2\n")
    settling = Settling(path, settle=60, max_waits=3)
    assert 0 < settling.wait() <= 60 and settling.waits == 1 and not settling.last
    settling.changed()
    assert settling.waits == 2 and not settling.last
    assert settling.wait() > 0 and settling.waits == 3 and settling.last
    assert settling.wait() == 0 and settling.waits == 3  # none left: read it now
    left_alone = Settling(path, settle=0, max_waits=3)
    assert left_alone.wait() == 0 and left_alone.waits == 0 and not left_alone.last
    assert Settling(path, settle=60, max_waits=0).wait() == 0


def test_the_runtime_dirs_of_this_boot_most_binding_first(tmp_path: Path) -> None:
    """The generator's word (when valid), then the record, then config.yaml's, each once."""
    record = tmp_path / "gpuslice" / "runtime-dir"
    record.parent.mkdir()
    pick = runtime_dirs_of_this_boot
    assert pick(None, record, "/run/gpuslice/c") == ["/run/gpuslice/c"]
    assert pick(None, record, "/run/gpuslice/c", "/run/gpuslice") == [
        "/run/gpuslice/c",
        "/run/gpuslice",
    ]
    record.write_text("/run/gpuslice/a\n")
    assert pick(None, record, "/run/gpuslice/c") == ["/run/gpuslice/a", "/run/gpuslice/c"]
    assert pick("/run/gpuslice/b/", record, "/run/gpuslice/c") == [
        "/run/gpuslice/b",
        "/run/gpuslice/a",
        "/run/gpuslice/c",
    ]
    for invalid in ("", "/etc", "/run/gpuslice/runtime-dir", "/run/gpuslice/\x1b"):
        assert pick(invalid, record, "/run/gpuslice/c") == ["/run/gpuslice/a", "/run/gpuslice/c"]
    assert pick("/run/gpuslice/a", record, "/run/gpuslice/a") == ["/run/gpuslice/a"]


def test_located_names_the_line_of_a_key(tmp_path: Path) -> None:
    path = write(tmp_path, "gpus: 2\n# runtime_dir: /x\nruntime_dir: /run/gpuslice/b\n")
    assert located(path, "runtime_dir") == f"{path}:3"
    assert located(path, "state_dir") == str(path)
    assert located(tmp_path / "absent.yaml", "gpus") == str(tmp_path / "absent.yaml")
    path.write_text("gpus: [\n")
    assert located(path, "gpus") == str(path)


def test_the_record_is_written_beside_itself_then_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary file is made in the record's own directory (a rename is atomic within
    one file system only), never in the process's working directory."""
    record = tmp_path / "gpuslice" / "runtime-dir"
    record.parent.mkdir()
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    renamed: list[tuple[str, str]] = []
    replace = os.replace

    def spy(src: str, dst: str) -> None:
        renamed.append((os.path.abspath(src), os.fspath(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    assert pin_runtime_dir(record, "/run/gpuslice/a")
    [(src, dst)] = renamed
    assert dst == str(record) and os.path.dirname(src) == str(record.parent)
    assert re.fullmatch(rf"\.runtime-dir\.tmp-{os.getpid()}-[0-9]+", os.path.basename(src))
