"""`/etc/gpuslice/config.yaml`: one table declares every setting; load and validate it.

Validation collects every problem as `PATH:LINE: KEY: message (allowed: ...)`; unknown keys are
warnings. A missing file means the defaults. Keeping the last good config on a bad reload is the
caller's job: `load_config` either returns a complete `Config` or raises `ConfigError`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

from gpuslice.paths import CONFIG_PATH
from gpuslice.sizes import SIZE_ALLOWED, parse_size


class ConfigError(Exception):
    """The config file is unusable; `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def _integer_at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _positive_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _absolute_path(v: Any) -> bool:
    return isinstance(v, str) and v.startswith("/") and "\0" not in v


LOG_LEVELS = ("debug", "info", "warning", "error")
FOREIGN_POLICIES = ("yield", "ignore")
_GPU_ID = re.compile(r"^(\d+|(GPU|MIG)-[0-9A-Za-z-]+)$")


def _gpu_id(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool) and v >= 0) or (
        isinstance(v, str) and bool(_GPU_ID.match(v))
    )


def _size(v: Any) -> int | None:
    if isinstance(v, int) and not isinstance(v, bool):
        return v if v >= 0 else None
    if isinstance(v, str):
        if v.strip() == "0":
            return 0
        try:
            return parse_size(v)
        except ValueError:
            return None
    return None


def _reserve_valid(v: Any) -> bool:
    if isinstance(v, dict):
        return all((k == "*" or _gpu_id(k)) and _size(size) is not None for k, size in v.items())
    return _size(v) is not None


def _reserve_convert(v: Any) -> tuple[tuple[str, int], ...]:
    """("*", bytes) for every GPU, or (index-or-UUID, bytes) pairs."""
    if isinstance(v, dict):
        return tuple((str(k), _size(size) or 0) for k, size in v.items())
    return (("*", _size(v) or 0),)


@dataclass(frozen=True)
class Setting:
    """One config key: `valid` says whether a parsed YAML value is acceptable, `allowed` says in
    words what is, `convert` turns an accepted value into the stored one."""

    name: str
    default: Any
    valid: Callable[[Any], bool]
    allowed: str
    help: str
    convert: Callable[[Any], Any] = lambda v: v


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "gpus",
        1,
        _integer_at_least(1),
        "an integer >= 1",
        "How many GPUs to schedule on hosts where NVML cannot count them.",
    ),
    Setting(
        "log_level",
        "info",
        lambda v: v in LOG_LEVELS,
        ", ".join(LOG_LEVELS),
        "How much the controller writes to the journal.",
    ),
    Setting(
        "state_dir",
        "/var/lib/gpuslice",
        _absolute_path,
        "an absolute path",
        "Where the controller keeps what must survive a reboot.",
    ),
    Setting(
        "runtime_dir",
        "/run/gpuslice",
        _absolute_path,
        "an absolute path",
        "Where the controller writes per-unit environment files (RUNTIME_DIR/env/UNIT.env).",
    ),
    Setting(
        "manage_gpus",
        (),
        lambda v: isinstance(v, list) and all(_gpu_id(x) for x in v),
        "a list of GPU indices or UUIDs (empty: every GPU NVML finds)",
        "Which GPUs gpuslice schedules on; the others are left alone.",
        convert=lambda v: tuple(str(x) for x in v),
    ),
    Setting(
        "reserve",
        (("*", 0),),
        _reserve_valid,
        f'{SIZE_ALLOWED}, or a mapping of GPU index or UUID (or "*") to such a size',
        "VRAM per GPU that gpuslice never hands out (e.g. 1G for a desktop).",
        convert=_reserve_convert,
    ),
    Setting(
        "foreign_processes",
        "yield",
        lambda v: v in FOREIGN_POLICIES,
        ", ".join(FOREIGN_POLICIES),
        "What a GPU process that no managed unit owns means: yield (background units on its "
        "GPU stop while it runs) or ignore (only its memory is counted).",
    ),
    Setting(
        "sample_interval",
        2.0,
        _positive_number,
        "a number > 0",
        "Seconds between NVML samples, taken only while something needs protecting.",
        convert=float,
    ),
    Setting(
        "vram_release_timeout",
        30.0,
        _positive_number,
        "a number > 0",
        "Seconds a grant waits for a preempted unit's VRAM to be released before it goes ahead.",
        convert=float,
    ),
    Setting(
        "gate_retry_seconds",
        0.5,
        _positive_number,
        "a number > 0",
        "How long the gate waits before asking again while the controller is away.",
        convert=float,
    ),
)
SETTINGS_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def _default(name: str) -> Any:
    return SETTINGS_BY_NAME[name].default


@dataclass(frozen=True)
class Config:
    """gpuslice's settings; the fields mirror `SETTINGS` (a test keeps them in step)."""

    gpus: int = _default("gpus")
    log_level: str = _default("log_level")
    state_dir: str = _default("state_dir")
    runtime_dir: str = _default("runtime_dir")
    manage_gpus: tuple[str, ...] = _default("manage_gpus")
    reserve: tuple[tuple[str, int], ...] = _default("reserve")
    foreign_processes: str = _default("foreign_processes")
    sample_interval: float = _default("sample_interval")
    vram_release_timeout: float = _default("vram_release_timeout")
    gate_retry_seconds: float = _default("gate_retry_seconds")

    def reserve_for(self, index: int, uuid: str) -> int:
        """Bytes kept back on one GPU: its own entry, else the entry for every GPU."""
        table = dict(self.reserve)
        return table.get(str(index), table.get(uuid, table.get("*", 0)))


def _describe(node: yaml.Node) -> str:
    if isinstance(node, yaml.ScalarNode):
        if node.style in ("'", '"'):
            return f'"{node.value}"'
        return f'"{node.value}"' if node.value else "an empty value"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return "a mapping"


def parse_config(text: str, path: str) -> tuple[Config, list[str]]:
    """Validate config text; returns the config and warnings, or raises ConfigError."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f"{mark.line + 1}:" if mark is not None else ""
        reason = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"{path}:{line} not valid YAML: {reason}"]) from None
    if root is None or (isinstance(root, yaml.ScalarNode) and root.tag.endswith(":null")):
        return Config(), []
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(
            [
                f"{path}:{root.start_mark.line + 1}: expected a mapping of settings, "
                f"got {_describe(root)}"
            ]
        )
    errors: list[str] = []
    warnings: list[str] = []
    values: dict[str, Any] = {}
    first_line: dict[str, int] = {}
    constructor = SafeConstructor()
    for key_node, value_node in root.value:
        line = key_node.start_mark.line + 1
        key = str(key_node.value)
        setting = SETTINGS_BY_NAME.get(key) if isinstance(key_node, yaml.ScalarNode) else None
        if setting is None:
            known = ", ".join(SETTINGS_BY_NAME)
            warnings.append(f"{path}:{line}: {key}: unknown setting, ignored (known: {known})")
            continue
        if key in first_line:
            errors.append(f"{path}:{line}: {key}: set twice (first at line {first_line[key]})")
            continue
        first_line[key] = line
        try:
            value = constructor.construct_object(value_node, deep=True)
        except yaml.YAMLError as e:
            value = e  # never valid
        if not setting.valid(value):
            errors.append(
                f"{path}:{value_node.start_mark.line + 1}: {key}: invalid value "
                f"{_describe(value_node)} (allowed: {setting.allowed})"
            )
            continue
        values[key] = setting.convert(value)
    if errors:
        raise ConfigError(errors)
    return Config(**values), warnings


def load_config_with_warnings(
    path: str | os.PathLike[str] = CONFIG_PATH,
) -> tuple[Config, list[str]]:
    """Load and validate the file; a missing file gives the defaults."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return Config(), []
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"{os.fspath(path)}: cannot read: {e}"]) from None
    return parse_config(text, os.fspath(path))


def load_config(path: str | os.PathLike[str] = CONFIG_PATH) -> Config:
    return load_config_with_warnings(path)[0]
