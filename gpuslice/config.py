"""`/etc/gpuslice/config.yaml`: one table declares every setting; load and validate it.

Validation collects every problem as `PATH:LINE: KEY: message (allowed: ...)`; unknown keys are
warnings. A missing file means the defaults (a symlink that leads nowhere is an error).
Keeping the last good config on a bad reload is the caller's job: `load_config` either returns
a complete `Config` or raises `ConfigError`.

The file is input from outside the daemon, so nothing in it may crash or stall its readers (the
controller, the generator at boot, `gpuslice check`): the read is capped at `MAX_CONFIG_BYTES`,
YAML nesting at `MAX_DEPTH`, aliases are refused (no "billion laughs"), and every value has a
range. yaml is imported only when a file is parsed, so the generator can read the defaults
cheaply.
"""

from __future__ import annotations

import functools
import math
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gpuslice import safefile
from gpuslice.core.model import GPU_ID
from gpuslice.paths import (
    CONFIG_PATH,
    DEFAULT_RUNTIME_DIR,
    DEFAULT_STATE_DIR,
    OWN_RUNTIME_NAMES,
    OWN_STATE_NAMES,
)
from gpuslice.sizes import SIZE_ALLOWED, SIZE_MAX, parse_size
from gpuslice.unitfiles import printable

if TYPE_CHECKING:
    import yaml

# A config of ten keys is a few KiB, one that reserves memory on each of 1,024 GPUs ~50 KiB.
# The cap bounds what a hostile file costs the controller's loop on reload (and the
# generator at boot): a flow sequence of 1 MiB took PyYAML 12.7 s and 350 MiB here.
MAX_CONFIG_BYTES = 256 << 10
_TOO_LARGE = f"larger than {MAX_CONFIG_BYTES} bytes ({MAX_CONFIG_BYTES >> 10} KiB), not read"
MAX_DEPTH = 16  # the deepest valid config is 3 levels (settings -> reserve -> size)
MAX_GPUS = 1024
MAX_PATH_LENGTH = 200
# Problems shown per kind (errors, warnings); the rest are counted in one more line.
MAX_PROBLEMS = 20


class ConfigError(Exception):
    """The config file is unusable; `problems` holds one line per problem. `valid` holds the
    settings the file does set validly (each once) when only others are bad: the generator
    takes runtime_dir from there, since the running controller keeps the last good one."""

    def __init__(self, problems: list[str], valid: dict[str, Any] | None = None):
        super().__init__("\n".join(problems))
        self.problems = problems
        self.valid = valid or {}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The table binds the bounds of these checks with `partial`: they run as plain functions (no
# closure made at import), so that mutation testing reaches them.


def _integer_in(v: Any, low: int, high: int) -> bool:
    return _is_int(v) and low <= v <= high


def _number_in(v: Any, low: float, high: float) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    if isinstance(v, float) and not math.isfinite(v):
        return False
    return low <= v <= high  # exact for any int (math.isfinite(10**400) would overflow)


_PATH = re.compile(r"/[A-Za-z0-9._/-]*", re.ASCII)


def _directory_below(v: Any, base: str) -> bool:
    """`base` or a directory below it, spelled plainly: the unit's sandbox
    (ProtectSystem=strict + StateDirectory=/RuntimeDirectory=) lets it write nowhere else, and
    the generator writes runtime_dir into every gate drop-in."""
    if not isinstance(v, str) or len(v) > MAX_PATH_LENGTH or not _PATH.fullmatch(v):
        return False
    path = v.rstrip("/")
    parts = path.split("/")[1:]
    return (
        "//" not in v
        and (path == base or path.startswith(base + "/"))
        and all(part not in ("", ".", "..") for part in parts)
    )


def _own_name_below(v: str, base: str, names: tuple[str, ...]) -> bool:
    """Whether a name in `v` below `base` is one gpuslice gives its own files in every such
    directory (paths.py): one of `names`, or one of them then "." or "-" (`state.json.bad`,
    `gate.released-42`), each also after a "." (`.state.json.tmp-PID-N`, safefile.write_atomic's
    temporary files; `.state.json.tmp`, an older gpuslice's). Not any name that merely
    begins so: `/run/gpuslice/gateway` is an admin's, and a runtime_dir pinned for the boot
    under an older gpuslice must stay valid through an upgrade."""
    below = [n.removeprefix(".") for n in v[len(base) :].split("/")]
    own = tuple(f"{name}{end}" for name in names for end in (".", "-"))
    return any(n in names or n.startswith(own) for n in below)


def _runtime_dir(v: Any) -> bool:
    """`_directory_below` /run/gpuslice, with no name below it that gpuslice gives its own
    files there (paths.OWN_RUNTIME_NAMES): not the record of this boot's runtime_dir,
    the stand-in state file, the env files' or the gates' directory, their temporary or
    moved-aside names, nor below them."""
    return _directory_below(v, DEFAULT_RUNTIME_DIR) and not _own_name_below(
        v, DEFAULT_RUNTIME_DIR, OWN_RUNTIME_NAMES
    )


def _state_dir(v: Any) -> bool:
    """`_directory_below` /var/lib/gpuslice, with no name below it that gpuslice gives its own
    files there (paths.OWN_STATE_NAMES, `_own_name_below`): not the record of
    the state_dir in use, the default state_dir's state file, their temporary files, nor
    below them."""
    return _directory_below(v, DEFAULT_STATE_DIR) and not _own_name_below(
        v, DEFAULT_STATE_DIR, OWN_STATE_NAMES
    )


def _own_names(names: tuple[str, ...]) -> str:
    """What no name below the base of a path setting may be (`_own_name_below`), in words."""
    said = [f'"{name}"' for name in names]
    listed = said[0] if len(said) == 1 else f"{', '.join(said[:-1])} or {said[-1]}"
    return f'{listed}, nor one of them followed by "." or "-", nor any of these after a "."'


_PATH_ALLOWED = (
    f"{{base}} or a directory below it, at most {MAX_PATH_LENGTH} characters of letters, "
    'digits, ".", "_", "-" and "/", without "." or ".." components: the service\'s '
    "sandbox lets it write nowhere else"
)


def _executable_path(v: Any) -> bool:
    """Empty (search for it) or an absolute file path spelled plainly: the controller runs it
    as root."""
    if v == "":
        return True
    if not isinstance(v, str) or len(v) > MAX_PATH_LENGTH or not _PATH.fullmatch(v):
        return False
    return "//" not in v and all(part not in ("", ".", "..") for part in v.split("/")[1:])


_EXECUTABLE_ALLOWED = (
    f'"" (look for it on PATH and in the driver\'s usual directories) or an absolute path, at '
    f'most {MAX_PATH_LENGTH} characters of letters, digits, ".", "_", "-" and "/", without '
    '"." or ".." components or a trailing "/"'
)


LOG_LEVELS = ("debug", "info", "warning", "error")
FOREIGN_POLICIES = ("yield", "ignore")


def _gpu_id(v: Any) -> bool:
    """An NVML index or a `GPU-` UUID (core.model.GPU_ID); YAML reads `0` as an integer."""
    if _is_int(v):
        v = str(v) if v >= 0 else ""
    return isinstance(v, str) and GPU_ID.fullmatch(v) is not None


def _size(v: Any) -> int | None:
    """Bytes, 0 to `SIZE_MAX`; None for anything else."""
    if _is_int(v):
        return v if 0 <= v <= SIZE_MAX else None
    if not isinstance(v, str) or not v.isascii() or len(v) > 40:
        return None
    if v.strip() == "0":
        return 0
    try:
        size = parse_size(v)
    except (ValueError, OverflowError):
        return None
    return size if 0 <= size <= SIZE_MAX else None


def _reserve_key_valid(gpu: Any) -> bool:
    return gpu == "*" or _gpu_id(gpu)


def _size_valid(v: Any) -> bool:
    return _size(v) is not None


def _reserve_valid(v: Any) -> bool:
    if isinstance(v, dict):
        return len(v) <= MAX_GPUS and all(
            _reserve_key_valid(k) and _size_valid(size) for k, size in v.items()
        )
    return _size_valid(v)


def _reserve_convert(v: Any) -> tuple[tuple[str, int], ...]:
    """("*", bytes) for every GPU, or (index-or-UUID, bytes) pairs."""
    if isinstance(v, dict):
        return tuple((str(k), _size(size) or 0) for k, size in v.items())
    return (("*", _size(v) or 0),)


@dataclass(frozen=True)
class Setting:
    """One config key: `valid` says whether a parsed YAML value is acceptable, `allowed` says in
    words what is, `convert` turns an accepted value into the stored one. For a list setting,
    `item_valid` checks one entry, so that an error can point at the bad entry's line."""

    name: str
    default: Any
    valid: Callable[[Any], bool]
    allowed: str
    help: str
    convert: Callable[[Any], Any] = lambda v: v
    item_valid: Callable[[Any], bool] | None = None
    # for a mapping setting, one key and one value, so that an error can point at its line
    key_valid: Callable[[Any], bool] | None = None
    value_valid: Callable[[Any], bool] | None = None


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "gpus",
        1,
        functools.partial(_integer_in, low=1, high=MAX_GPUS),
        f"an integer 1-{MAX_GPUS}",
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
        DEFAULT_STATE_DIR,
        _state_dir,
        _PATH_ALLOWED.format(base=DEFAULT_STATE_DIR)
        + f"; with no name below it that is {_own_names(OWN_STATE_NAMES)}: "
        "gpuslice names its own files there so",
        "Where the controller keeps what must survive a reboot; a change takes effect when "
        "gpuslice.service restarts, which moves the state there.",
        convert=lambda v: v.rstrip("/"),
    ),
    Setting(
        "runtime_dir",
        DEFAULT_RUNTIME_DIR,
        _runtime_dir,
        _PATH_ALLOWED.format(base=DEFAULT_RUNTIME_DIR)
        + f"; with no name below it that is {_own_names(OWN_RUNTIME_NAMES)}: "
        "gpuslice names its own files there so",
        "Where the controller writes per-unit environment files "
        "(RUNTIME_DIR/env/UNIT/gpuslice.env) and the gate's pipes (RUNTIME_DIR/gate/UNIT); "
        "a change takes effect at the next boot.",
        convert=lambda v: v.rstrip("/"),
    ),
    Setting(
        "manage_gpus",
        (),
        lambda v: isinstance(v, list) and len(v) <= MAX_GPUS and all(_gpu_id(x) for x in v),
        f"a list of at most {MAX_GPUS} GPU indices or GPU- UUIDs (MIG devices are not "
        "supported; empty: every GPU NVML finds)",
        "Which GPUs gpuslice schedules on; the others are left alone.",
        convert=lambda v: tuple(str(x) for x in v),
        item_valid=_gpu_id,
    ),
    Setting(
        "reserve",
        (("*", 0),),
        _reserve_valid,
        f'{SIZE_ALLOWED}, or a mapping of GPU index or GPU- UUID (or "*") to such a size',
        "VRAM per GPU that gpuslice never hands out (e.g. 1G for a desktop).",
        convert=_reserve_convert,
        key_valid=_reserve_key_valid,
        value_valid=_size_valid,
    ),
    Setting(
        "foreign_processes",
        "yield",
        lambda v: v in FOREIGN_POLICIES,
        ", ".join(FOREIGN_POLICIES),
        "What a GPU process that no managed unit owns means: yield (background units on its "
        "GPU stop while it runs) or ignore (only its memory is counted). A graphics-only "
        "process (a display server) only counts its memory.",
    ),
    Setting(
        "sample_interval",
        2.0,
        functools.partial(_number_in, low=0.05, high=3600),
        "a number of seconds 0.05-3600",
        "Seconds between NVML samples, taken only while something needs protecting.",
        convert=float,
    ),
    Setting(
        "vram_release_timeout",
        30.0,
        functools.partial(_number_in, low=0.1, high=3600),
        "a number of seconds 0.1-3600",
        "Seconds a grant waits for a preempted unit's VRAM to be released before it goes ahead.",
        convert=float,
    ),
    Setting(
        "gate_retry_seconds",
        0.5,
        functools.partial(_number_in, low=0.05, high=60),
        "a number of seconds 0.05-60",
        "How long the gate waits before asking again while the controller is away.",
        convert=float,
    ),
    Setting(
        "requeue_at_gate",
        False,
        lambda v: isinstance(v, bool),
        "true or false",
        "Whether a preempted unit is restarted at once to wait at its gate for the GPUs "
        "(it comes back as a grant, ~10 ms sooner; systemctl list-jobs shows it waiting) "
        "rather than when they are free.",
    ),
    Setting(
        "stop_timeout",
        90.0,
        functools.partial(_number_in, low=1, high=86400),
        "a number of seconds 1-86400",
        "How long a preempted unit may take to stop before the waiter's reason names it and a "
        "warning is logged.",
        convert=float,
    ),
    Setting(
        "driver_wait",
        120.0,
        functools.partial(_number_in, low=0, high=3600),
        "a number of seconds 0-3600",
        "How long background units wait for NVML when NVIDIA hardware is present but its driver "
        "is not ready (at boot, after an unload); after that they start on the fallback GPUs.",
        convert=float,
    ),
    Setting(
        "cuda_checkpoint",
        "",
        _executable_path,
        _EXECUTABLE_ALLOWED,
        "Which cuda-checkpoint suspends GPU jobs instead of stopping them; without one they "
        "are stopped.",
    ),
    Setting(
        "checkpoint_lock_timeout",
        10.0,
        functools.partial(_number_in, low=0.1, high=3600),
        "a number of seconds 0.1-3600",
        "How long cuda-checkpoint may wait for a job's submitted GPU work when it locks it "
        "before a suspend; past it the job is not suspended.",
        convert=float,
    ),
    Setting(
        "checkpoint_timeout",
        300.0,
        functools.partial(_number_in, low=1, high=86400),
        "a number of seconds 1-86400",
        "How long copying one process's GPU memory to host memory may take before the suspend "
        "is undone.",
        convert=float,
    ),
    Setting(
        "restore_timeout",
        300.0,
        functools.partial(_number_in, low=1, high=86400),
        "a number of seconds 1-86400",
        "How long copying one suspended process's memory back to its GPU may take.",
        convert=float,
    ),
    Setting(
        "suspend_host_memory_margin",
        2 << 30,
        lambda v: _size(v) is not None,
        SIZE_ALLOWED,
        "Host memory (MemAvailable) that must be left after a suspend's copy of GPU memory; "
        "a job that would leave less is stopped instead.",
        convert=_size,
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
    requeue_at_gate: bool = _default("requeue_at_gate")
    stop_timeout: float = _default("stop_timeout")
    driver_wait: float = _default("driver_wait")
    cuda_checkpoint: str = _default("cuda_checkpoint")
    checkpoint_lock_timeout: float = _default("checkpoint_lock_timeout")
    checkpoint_timeout: float = _default("checkpoint_timeout")
    restore_timeout: float = _default("restore_timeout")
    suspend_host_memory_margin: int = _default("suspend_host_memory_margin")

    def reserve_for(self, index: int, uuid: str) -> int:
        """Bytes kept back on one GPU: its own entry, else the entry for every GPU."""
        table = dict(self.reserve)
        return table.get(str(index), table.get(uuid, table.get("*", 0)))


# ---------------------------------------------------------------------------------------------
# parsing


def _describe(node: yaml.Node) -> str:
    import yaml

    tag = ""
    if node.tag.startswith(_YAML_TAG) and node.tag[len(_YAML_TAG) :] not in _PLAIN_TAGS:
        tag = f" tagged !!{printable(node.tag[len(_YAML_TAG) :], 60)}"
    elif not node.tag.startswith(_YAML_TAG):
        tag = f" tagged {printable(node.tag, 60)}"
    if isinstance(node, yaml.ScalarNode):
        if node.style in ("'", '"') or node.value:
            return f'"{printable(node.value, 60)}"{tag}'
        return f"an empty value{tag}"
    if isinstance(node, yaml.SequenceNode):
        return f"a list{tag}"
    return f"a mapping{tag}"


_YAML_TAG = "tag:yaml.org,2002:"
_PLAIN_TAGS = frozenset({"str", "int", "float", "bool", "null", "seq", "map"})


@functools.cache
def _loader_class() -> type[Any]:
    """SafeLoader (no Python objects) that refuses aliases and deep nesting while composing,
    with the line of the offending node."""
    import yaml
    from yaml.composer import ComposerError

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            event: Any = self.peek_event()  # type: ignore[no-untyped-call]
            mark: Any = event.start_mark
            if isinstance(event, yaml.AliasEvent):
                raise ComposerError(
                    None, None, "aliases (*name) are not allowed in config.yaml", mark
                )
            if self.depth >= MAX_DEPTH:
                raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
            self.depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return Loader


def _compose(text: str, path: str) -> yaml.Node | None:
    import yaml

    loader = None
    try:
        loader = _loader_class()(text)
        return loader.get_single_node()  # type: ignore[no-any-return]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        position = getattr(e, "position", None)  # ReaderError: a character YAML forbids
        if mark is not None:
            line = f"{mark.line + 1}:"
        elif isinstance(position, int):
            line = f"{text.count(chr(10), 0, position) + 1}:"
        else:
            line = ""
        if isinstance(e, yaml.reader.ReaderError) and isinstance(e.character, int):
            reason = f"character #x{e.character:04x} is not allowed in YAML"
        else:
            reason = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"{path}:{line} not valid YAML: {printable(reason, 200)}"]) from None
    except RecursionError:  # belt and braces: MAX_DEPTH keeps the composer shallow
        raise ConfigError([f"{path}: not valid YAML: nested too deeply"]) from None
    finally:
        if loader is not None:
            loader.dispose()


def _construct(node: yaml.Node) -> Any:
    """The node's Python value (SafeConstructor: plain data only); a `_Bad` for anything that
    cannot be built (`!!python/object`, `!!int abc`, a 5000-digit number) or is not ASCII
    (digits of other scripts that `int()` would accept)."""
    import yaml
    from yaml.constructor import SafeConstructor

    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, yaml.ScalarNode):
            if not current.value.isascii():
                return _Bad()
        elif isinstance(current, yaml.SequenceNode):
            stack.extend(current.value)
        elif isinstance(current, yaml.MappingNode):
            stack.extend(n for pair in current.value for n in pair)
    try:
        return SafeConstructor().construct_object(node, deep=True)
    except Exception:  # any value that cannot be built is simply invalid
        return _Bad()


class _Bad:
    """A value that could not be built; never valid."""


def _limited(problems: list[str], path: str, kind: str) -> list[str]:
    if len(problems) <= MAX_PROBLEMS:
        return problems
    more = len(problems) - MAX_PROBLEMS
    return [*problems[:MAX_PROBLEMS], f"{path}: {more} more {kind} not shown"]


def _check(setting: Setting, node: yaml.Node, path: str) -> tuple[Any, str | None]:
    """(converted value, None) or (None, the error line)."""
    import yaml

    value = _construct(node)
    twice = _set_twice(setting, node, path)
    if twice is not None:
        return None, twice
    if setting.valid(value):
        return setting.convert(value), None
    blame = node
    if (
        setting.item_valid is not None
        and isinstance(value, list)
        and isinstance(node, yaml.SequenceNode)
        and len(value) <= MAX_GPUS
    ):
        blame = next(
            (n for n, v in zip(node.value, value, strict=False) if not setting.item_valid(v)),
            node,
        )
    key_valid, value_valid = setting.key_valid, setting.value_valid
    if (
        key_valid is not None
        and value_valid is not None
        and isinstance(value, dict)
        and isinstance(node, yaml.MappingNode)
        and len(node.value) <= MAX_GPUS
    ):
        blame = next(
            (
                bad
                for k, v in node.value
                for bad, ok in ((k, key_valid), (v, value_valid))
                if not ok(_construct(bad))
            ),
            node,
        )
    return None, (
        f"{path}:{blame.start_mark.line + 1}: {setting.name}: invalid value "
        f"{_describe(blame)} (allowed: {setting.allowed})"
    )


def _set_twice(setting: Setting, node: yaml.Node, path: str) -> str | None:
    """The error for a mapping setting that names one key twice (`0:` and `"0":` too): YAML
    keeps the last silently, as it would a setting given twice."""
    import yaml

    if setting.key_valid is None or not isinstance(node, yaml.MappingNode):
        return None
    first: dict[str, int] = {}
    for key, _value in node.value:
        if not isinstance(key, yaml.ScalarNode):
            continue
        line = key.start_mark.line + 1
        if key.value in first:
            return (
                f'{path}:{line}: {setting.name}: "{printable(key.value, 60)}" set twice '
                f"(first at line {first[key.value]})"
            )
        first[key.value] = line
    return None


def parse_config(text: str, path: str) -> tuple[Config, list[str]]:
    """Validate config text; returns the config and warnings, or raises ConfigError (whose
    every line starts with `path`). Never raises anything else."""
    import yaml

    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError([f"{path}: {_TOO_LARGE}"])
    root = _compose(text, path)
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
    twice: set[str] = set()
    known = ", ".join(SETTINGS_BY_NAME)
    for key_node, value_node in root.value:
        line = key_node.start_mark.line + 1
        if not isinstance(key_node, yaml.ScalarNode):
            errors.append(
                f"{path}:{line}: expected a setting name, got {_describe(key_node)} "
                f"(known: {known})"
            )
            continue
        key = key_node.value
        setting = SETTINGS_BY_NAME.get(key)
        if setting is None:
            warnings.append(
                f"{path}:{line}: {printable(key, 60)}: unknown setting, ignored (known: {known})"
            )
            continue
        if key in first_line:
            errors.append(f"{path}:{line}: {key}: set twice (first at line {first_line[key]})")
            twice.add(key)
            continue
        first_line[key] = line
        value, error = _check(setting, value_node, path)
        if error is not None:
            errors.append(error)
        else:
            values[key] = value
    if errors:
        valid = {k: v for k, v in values.items() if k not in twice}
        raise ConfigError(_limited(errors, path, "errors"), valid)
    return Config(**values), _limited(warnings, path, "warnings")


def read_config_text(path: str | os.PathLike[str]) -> str | None:
    """The file's text; None when it does not exist. ConfigError (one line naming the file)
    when it, or a directory above it, is a symlink that leads nowhere, or it is not a regular
    file, cannot be read, is larger than `MAX_CONFIG_BYTES` or is not UTF-8. A symlink is
    followed; a FIFO or a device is never read from (`safefile`), so this never blocks."""
    shown = printable(os.fspath(path))
    try:
        data = safefile.read_bytes(path, MAX_CONFIG_BYTES, follow_links=True)
    except safefile.Unreadable as e:
        if e.why is safefile.Why.MISSING:
            nowhere = _dangling_link(os.fspath(path))
            if nowhere is None:
                return None
            raise ConfigError(
                [
                    f"{shown}: cannot read: {printable(nowhere)} is a symbolic link that leads "
                    f"nowhere (to {printable(_link_target(nowhere))}: a file system not "
                    "mounted yet, a file moved?); not taken for a missing file, which would "
                    "mean the defaults"
                ]
            ) from None
        if e.why is safefile.Why.TOO_LARGE:
            raise ConfigError([f"{shown}: {_TOO_LARGE}"]) from None
        if e.error is not None:
            reason = str(e)  # the system's words
        elif stat.S_ISDIR(e.mode) or stat.S_ISFIFO(e.mode):
            reason = f"{e.kind}, not a regular file"
        else:
            reason = "not a regular file"
        raise ConfigError([f"{shown}: cannot read: {reason}"]) from None
    untrusted = _changeable_by_others(os.fspath(path))
    if untrusted is not None:
        raise ConfigError(
            [
                f"{shown}: not read: {untrusted}: only root may be able to change what "
                "gpuslice does as root (it runs cuda_checkpoint); make the file and its "
                "directories root's, writable by root alone"
            ]
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            [f"{shown}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"]
        ) from None


def _changeable_by_others(path: str) -> str | None:
    """Why someone but root (or this process's own user) can change the config file that was
    just read, or None: the file, a directory above it, or a directory above the symlink that
    led to it, is another user's, or writable by a group but root's, or by anyone, or has an
    access ACL whose mask lets write (as `envsafety` decides: the users and groups it names
    may write, whatever st_gid says). A sticky directory (/tmp) is fine: only a file's owner
    may replace it there. config.yaml steers a root daemon, which runs the cuda_checkpoint it
    names as root: a file that a user could write (a symlink into a home, `chmod 666`, a
    group-writable /etc/gpuslice, `setfacl -m u:bob:rw`) was trusted."""
    euid = os.geteuid()
    owners = {0, euid}
    groups = {0} if euid == 0 else {0, os.getegid()}
    real = os.path.realpath(path)
    places = [
        real,
        *_with_parents(os.path.dirname(real)),
        *_with_parents(os.path.realpath(os.path.dirname(os.path.abspath(path)))),
    ]
    for place in dict.fromkeys(places):
        shown = printable(place)
        try:
            st = os.lstat(place)
        except (OSError, ValueError) as e:
            return f"{shown} cannot be checked: {getattr(e, 'strerror', None) or e}"
        mode = st.st_mode
        if st.st_uid not in owners:
            return f"{shown} is owned by UID {st.st_uid}"
        if stat.S_ISDIR(mode) and mode & stat.S_ISVTX:
            continue
        if mode & stat.S_IWOTH:
            return f"{shown} is writable by anyone (mode {stat.S_IMODE(mode):04o})"
        if mode & stat.S_IWGRP and st.st_gid not in groups:
            return f"{shown} is writable by group GID {st.st_gid} (mode {stat.S_IMODE(mode):04o})"
        if mode & stat.S_IWGRP:
            try:
                acl = safefile.has_access_acl(place)
            except OSError as e:
                return f"{shown} cannot be checked: {e.strerror or e}"
            if acl:
                return (
                    f"{shown} is group-writable with an access ACL, which may let others write "
                    f"it (mode {stat.S_IMODE(mode):04o})"
                )
    return None


def _with_parents(directory: str) -> list[str]:
    out = [directory]
    while directory not in ("/", ""):
        directory = os.path.dirname(directory)
        out.append(directory)
    return out


def _dangling_link(path: str) -> str | None:
    """For a config file that is not there: the symlink on its way that leads nowhere (the
    file itself, or a directory above it), or None when the file is simply absent. An admin
    who linked the file (or /etc/gpuslice) elsewhere configured something: read as a missing
    file, a link whose target was moved, or is on a file system not mounted yet, silently
    meant the defaults, on a reload too: every GPU for a host that manage_gpus splits with
    a cluster, no reserve for the desktop."""
    here = os.path.abspath(path)
    while not os.path.lexists(here):  # lexists: the last component's link is not followed
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent
    return here if os.path.islink(here) and not os.path.exists(here) else None


def _link_target(link: str) -> str:
    try:
        return os.readlink(link)
    except OSError as e:
        return f"? ({e.strerror})"


def load_config_with_warnings(
    path: str | os.PathLike[str] = CONFIG_PATH,
) -> tuple[Config, list[str]]:
    """Load and validate the file; a missing file gives the defaults."""
    text = read_config_text(path)
    if text is None:
        return Config(), []
    return parse_config(text, printable(os.fspath(path)))


def load_config(path: str | os.PathLike[str] = CONFIG_PATH) -> Config:
    return load_config_with_warnings(path)[0]


def located(path: str | os.PathLike[str], key: str) -> str:
    """`PATH:LINE` of the setting `key` in the config file, `PATH` when it is not found there
    (the file changed, or went bad, since it was read): for a message about a setting."""
    import yaml

    shown = printable(os.fspath(path))
    try:
        text = read_config_text(path)
        root = None if text is None else _compose(text, shown)
    except ConfigError:
        return shown
    if isinstance(root, yaml.MappingNode):
        for key_node, _value in root.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
                return f"{shown}:{key_node.start_mark.line + 1}"
    return shown


# ---------------------------------------------------------------------------------------------
# a file being written at the moment it is read

# A file written in place (`cp new config.yaml`, an editor that does not rename, a
# configuration tool) is truncated, then written: read in between, its first lines, or
# nothing, are valid YAML, and every setting past the cut falls back to its default
# (manage_gpus: every GPU, no reserve), silently. So the controller reads a file only once it
# has been left alone this long (its status change time: a write, a rename into place or a
# `touch` sets it), and again if it changed while it was read. A writer that pauses longer
# mid-file is not caught: an admin writes a new file and renames it over the old one.
SETTLE_SECONDS = 1.0


def unsettled(path: str | os.PathLike[str], now: float, settle: float = SETTLE_SECONDS) -> float:
    """Seconds until the file has been left alone for `settle` (0: read it now). A file that
    cannot be looked at is read now (the read says why); so is one changed "in the future"
    (the clock was set back): waited for, it would not be read until the clock caught up."""
    try:
        changed = os.stat(path).st_ctime
    except (OSError, ValueError):
        return 0.0
    age = now - changed
    return settle - age if 0 <= age < settle else 0.0


Stamp = tuple[int, int, int, int, int]


def stamp(path: str | os.PathLike[str]) -> Stamp | None:
    """What changes when the file does (which file, its size and times), None when it cannot
    be looked at: equal before and after a read, the read saw one version of the file."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


_Read = TypeVar("_Read")


def read_unchanged(
    path: str | os.PathLike[str], load: Callable[[str | os.PathLike[str]], _Read]
) -> _Read | None:
    """`load(path)`, None when the file changed while it was read (`stamp`): what was read,
    good or bad, may be a version cut short. Its ConfigError when the file did not change."""
    before = stamp(path)
    try:
        loaded = load(path)
    except ConfigError:
        if stamp(path) != before:
            return None
        raise
    return loaded if stamp(path) == before else None


@dataclass
class Settling:
    """The waits of one read of the config file, at start or at a reload (each waits as it
    can: asleep, or on the loop's timers): it is read once it has been left alone for
    `settle` s (`wait`), and again when it changed while it was read (`read_unchanged`, then
    `changed`); after `max_waits` waits of either kind (`last`) it is read as it is: a file
    rewritten without end is not waited for without end."""

    path: str | os.PathLike[str]
    settle: float
    max_waits: int
    waits: int = 0

    @property
    def last(self) -> bool:
        """No wait is left: the file is read as it is."""
        return self.waits >= self.max_waits

    def wait(self) -> float:
        """Seconds to wait before the file is read, counted as a wait; 0: read it now (also
        when no wait is left, once the file has been looked at)."""
        wait = unsettled(self.path, time.time(), self.settle)
        if wait > 0 and not self.last:
            self.waits += 1
            return wait
        return 0.0

    def changed(self) -> None:
        """The file changed while it was read: one wait more before it is read again."""
        self.waits += 1


# ---------------------------------------------------------------------------------------------
# the runtime_dir of this boot (paths.RUNTIME_DIR_RECORD)


def runtime_dir_value(value: str) -> str | None:
    """`value` as a runtime_dir (its trailing "/" off), None when it is not a valid one."""
    setting = SETTINGS_BY_NAME["runtime_dir"]
    return str(setting.convert(value)) if setting.valid(value) else None


def read_pinned_runtime_dir(record: str | os.PathLike[str]) -> str | None:
    """The runtime_dir the controller recorded at `record` when it started this boot; None
    when none did, or the record is no valid one (only root writes there)."""
    value = _record_line(record)
    return None if value is None else runtime_dir_value(value)


def _record_line(record: str | os.PathLike[str]) -> str | None:
    """The one line a record of the controller's holds (pin_runtime_dir), without its line
    end; None when there is none to read. 1 KiB at most, never through a link."""
    try:
        data = safefile.read_bytes(record, 1024, follow_links=False)
    except safefile.Unreadable:
        return None
    text = data.decode("ascii", "replace")
    return text[:-1] if text.endswith("\n") else text


def runtime_dirs_of_this_boot(
    told: str | None, record: str | os.PathLike[str], *configured: str
) -> list[str]:
    """The runtime_dirs the gates' drop-ins may name this boot, most binding first, each once:
    `told` (paths.RUNTIME_DIR_ENV: what gpuslice-generator told gpuslice.service its gates
    name) when it is a valid runtime_dir, the one a controller recorded at `record` earlier
    this boot, then `configured` (config.yaml's). The controller runs with the first; a stop
    releases the gates in each."""
    dirs = [None if told is None else runtime_dir_value(told), read_pinned_runtime_dir(record)]
    return list(dict.fromkeys(d for d in (*dirs, *configured) if d is not None))


def pin_runtime_dir(record: str | os.PathLike[str], runtime_dir: str) -> bool:
    """Record the runtime_dir the controller runs with (at once: a reader sees the old record
    or the new one), as the state file is written: never through what is found at the
    temporary name (a link), and on disk before this returns. False, and nothing written, when
    the record's directory does not exist: not started by gpuslice.service, whose
    RuntimeDirectory= makes it. OSError when it cannot be written."""
    # imported here: the generator imports this module and must not load the state's
    # (asyncio, the scheduler) at every daemon-reload
    from gpuslice.state import write_durably

    path = os.fspath(record)
    if not os.path.isdir(os.path.dirname(path)):
        return False
    write_durably(Path(path), f"{runtime_dir}\n".encode("ascii"))
    return True


# ---------------------------------------------------------------------------------------------
# the state_dir the controller last ran with (paths.STATE_DIR_RECORD)


def read_recorded_state_dir(record: str | os.PathLike[str]) -> str | None:
    """The state_dir the controller recorded at `record` when it last started (its trailing
    "/" off); None when none did, or the record names no state_dir: one spelled as config.yaml
    must spell it, in the record's directory (paths.DEFAULT_STATE_DIR) or below it, and not
    the record itself nor another of gpuslice's own files there (`_state_dir`'s rule). Only
    root writes there, but the controller removes a file in it."""
    value, path = _record_line(record), os.fspath(record)
    base = os.path.dirname(path)
    if value is None or _directory_below(value, path) or not _directory_below(value, base):
        return None
    return None if _own_name_below(value, base, OWN_STATE_NAMES) else value.rstrip("/")


def record_state_dir(record: str | os.PathLike[str], state_dir: str) -> bool:
    """Record the state_dir the controller runs with, as pin_runtime_dir records its
    runtime_dir (one line, replaced at once). False, and nothing written, when the record's
    directory does not exist (not started by gpuslice.service, whose StateDirectory= makes it).
    OSError when it cannot be written."""
    return pin_runtime_dir(record, state_dir)
