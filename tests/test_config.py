"""config.yaml: defaults, validation with line numbers, unknown keys, the shipped file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpuslice.config import (
    SETTINGS,
    Config,
    ConfigError,
    load_config,
    load_config_with_warnings,
)

REPO_CONFIG = Path(__file__).resolve().parent.parent / "config.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_table_and_dataclass_agree() -> None:
    assert [s.name for s in SETTINGS] == [f.name for f in dataclasses.fields(Config)]
    assert Config() == Config(**{s.name: s.default for s in SETTINGS})
    assert Config() == Config(
        1, "info", "/var/lib/gpuslice", "/run/gpuslice", (), (("*", 0),), "yield", 2.0, 30.0, 0.5
    )


def test_missing_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config_with_warnings(tmp_path / "absent.yaml") == (Config(), [])


@pytest.mark.parametrize("text", ["", "# only comments\n", "---\n", "~\n"])
def test_empty_file_gives_defaults(tmp_path: Path, text: str) -> None:
    assert load_config(write(tmp_path, text)) == Config()


def test_shipped_file_is_the_defaults_and_comments_every_setting() -> None:
    assert load_config_with_warnings(REPO_CONFIG) == (Config(), [])
    text = REPO_CONFIG.read_text()
    for setting in SETTINGS:
        before = text.split(f"\n{setting.name}:")[0]
        assert before.rstrip().splitlines()[-1].startswith("#"), setting.name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpus: 4\n", Config(gpus=4)),
        ("log_level: debug\n", Config(log_level="debug")),
        (
            "state_dir: /srv/state\nruntime_dir: /run/x\n",
            Config(state_dir="/srv/state", runtime_dir="/run/x"),
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
            "gpus: 0\n", ['{P}:1: gpus: invalid value "0" (allowed: an integer >= 1)'], id="gpus-0"
        ),
        pytest.param(
            "gpus: two\n",
            ['{P}:1: gpus: invalid value "two" (allowed: an integer >= 1)'],
            id="gpus-word",
        ),
        pytest.param(
            "gpus: true\n",
            ['{P}:1: gpus: invalid value "true" (allowed: an integer >= 1)'],
            id="gpus-bool",
        ),
        pytest.param(
            "gpus: 1.5\n",
            ['{P}:1: gpus: invalid value "1.5" (allowed: an integer >= 1)'],
            id="gpus-float",
        ),
        pytest.param(
            "# comment\nlog_level: loud\n",
            ['{P}:2: log_level: invalid value "loud" (allowed: debug, info, warning, error)'],
            id="log-level",
        ),
        pytest.param(
            "state_dir: var/lib\n",
            ['{P}:1: state_dir: invalid value "var/lib" (allowed: an absolute path)'],
            id="relative-path",
        ),
        pytest.param(
            "runtime_dir:\n  - /run\n",
            ["{P}:2: runtime_dir: invalid value a list (allowed: an absolute path)"],
            id="list-value",
        ),
        pytest.param(
            "gate_retry_seconds: 0\n",
            ['{P}:1: gate_retry_seconds: invalid value "0" (allowed: a number > 0)'],
            id="retry-zero",
        ),
        pytest.param(
            "gate_retry_seconds: .nan\n",
            ['{P}:1: gate_retry_seconds: invalid value ".nan" (allowed: a number > 0)'],
            id="retry-nan",
        ),
        pytest.param(
            "gate_retry_seconds: '1'\n",
            ['{P}:1: gate_retry_seconds: invalid value "1" (allowed: a number > 0)'],
            id="retry-quoted-string",
        ),
        pytest.param(
            "gpus: 0\nlog_level: loud\nstate_dir: x\nruntime_dir:\ngate_retry_seconds: -1\n",
            [
                '{P}:1: gpus: invalid value "0" (allowed: an integer >= 1)',
                '{P}:2: log_level: invalid value "loud" (allowed: debug, info, warning, error)',
                '{P}:3: state_dir: invalid value "x" (allowed: an absolute path)',
                "{P}:4: runtime_dir: invalid value an empty value (allowed: an absolute path)",
                '{P}:5: gate_retry_seconds: invalid value "-1" (allowed: a number > 0)',
            ],
            id="every-problem-collected",
        ),
        pytest.param(
            "gpus: 2\ngpus: 3\n", ["{P}:2: gpus: set twice (first at line 1)"], id="duplicate"
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
    expected = [m.replace("{P}", str(path)) for m in messages]
    assert caught.value.problems == expected
    assert str(caught.value) == "\n".join(expected)


def test_unknown_keys_are_warnings(tmp_path: Path) -> None:
    path = write(tmp_path, "gpus: 2\ncolour: blue\n")
    config, warnings = load_config_with_warnings(path)
    assert config == Config(gpus=2)
    assert warnings == [
        f"{path}:2: colour: unknown setting, ignored (known: gpus, log_level, state_dir, "
        "runtime_dir, manage_gpus, reserve, foreign_processes, sample_interval, "
        "vram_release_timeout, gate_retry_seconds)"
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
        f'{path}:1: reserve: invalid value "lots" (allowed: a size such as 512M, 20G or 20GiB '
        '(binary units), or a mapping of GPU index or UUID (or "*") to such a size)',
        f'{path}:2: foreign_processes: invalid value "fight" (allowed: yield, ignore)',
        f"{path}:3: manage_gpus: invalid value a list (allowed: a list of GPU indices or "
        "UUIDs (empty: every GPU NVML finds))",
    ]
