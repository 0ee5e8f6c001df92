"""`/etc/gpuslice/config.yaml`: one table declares every setting; load and validate it.

Validation collects every problem as `PATH:LINE: KEY: message (allowed: ...)`; unknown keys are
warnings. A missing file means the defaults. Keeping the last good config on a bad reload is the
caller's job: `load_config` either returns a complete `Config` or raises `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

CONFIG_PATH = "/etc/gpuslice/config.yaml"


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
    gate_retry_seconds: float = _default("gate_retry_seconds")


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


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config))
