"""Hypothesis over config.yaml and the generator: nothing an admin or a package writes crashes them.

Properties: `parse_config` over any text returns a `Config` whose every value is in its range, or
raises `ConfigError` whose every line starts with the file's path; nothing else escapes. The
generator over a tree of generated unit files (valid names up to 255 characters, `\\x2d`
escapes, templates and instances, hostile ExecStartPre= values) never raises, and every valid
annotated unit is gated or named in an error line. `GPUSLICE_FUZZ_EXAMPLES` sets the examples
per property (default 200; `make fuzz` runs 10000).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice import generator
from gpuslice.annotations import scan
from gpuslice.config import MAX_GPUS, SETTINGS, Config, ConfigError, parse_config
from gpuslice.core.model import GPU_ID
from gpuslice.paths import DEFAULT_RUNTIME_DIR, DEFAULT_STATE_DIR, GATE_DROPIN_NAME
from gpuslice.sizes import SIZE_MAX
from gpuslice.unitfiles import (
    fits_dropin_dir,
    is_instance,
    is_valid_unit_name,
    printable,
    template_of,
)

EXAMPLES = int(os.environ.get("GPUSLICE_FUZZ_EXAMPLES", "200"))
# pyproject's per-test timeout (120 s) is sized for 200 examples; `make fuzz` runs 50 times more
pytestmark = pytest.mark.timeout(max(120, EXAMPLES // 10))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PATH = "/etc/gpuslice/config.yaml"
# unit trees are written and removed per example: in memory where there is a tmpfs
_TMP = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None

# ---- config.yaml ------------------------------------------------------------------------------

# numbers at and around every bound, huge, negative, not finite, in other scripts, as strings
_NUMBERS = [
    "0", "1", "-1", "0.0", "-0", "0.05", "0.049", "0.1", "0.09", "60", "60.0001", "61", "3600",
    "3600.5", "86400", "86401", "1024", "1025", "1023", "90", "2", "0.5", "1e-9", "1.0e+3",
    "1000000000000", "9" * 400, "-" + "9" * 30, "0x10", "0o7", "1_000", "+5", ".5", "5.",
    ".nan", ".NaN", ".inf", "-.inf", "+.inf", "\u0661\u0662", "\uff11", "\u00b2", "\u0967",
    "'1'", '"0.5"', "!!int 7", "!!float 1", "!!int \u0661", "!!str 4", "true", "no", "~",
    "1P", "1125899906842624", "1125899906842625", "1025T", "512M", "1.5G", "0.0001K", "1.5",
    "20GiB", "-1G", "1E", "1 G",
]  # fmt: skip
_WORDS = [
    "info", "debug", "loud", "yield", "ignore", "", "''", '""', "GPU-abc", "MIG-1", "GPU-",
    "*", "'*'", '"\\x00"', '"\\e[2J"', '"a\\nb"', '"\\u202e"', "x" * 300, "!!binary aGk=",
    "!!python/object:os.system ls", "!!timestamp 2020-99", "!foo bar", "&a 1", "*a", "[]",
    "{}", "[0, 1]", "[MIG-1]", "[GPU-a, 0, '*']", "{'*': 1G, 0: 2G}", "{[0]: 1}", "? a",
]  # fmt: skip
_PATHS = [
    DEFAULT_STATE_DIR, DEFAULT_RUNTIME_DIR, DEFAULT_STATE_DIR + "/", DEFAULT_RUNTIME_DIR + "/x",
    DEFAULT_STATE_DIR + "/a/b.c_d-e", "/srv/state", "/var/lib/gpuslice2", "/run",
    DEFAULT_RUNTIME_DIR + "/../etc", DEFAULT_RUNTIME_DIR + "/./x", "/run//gpuslice",
    DEFAULT_RUNTIME_DIR + "/" + "x" * 185, DEFAULT_RUNTIME_DIR + "/a b", "'/run/gpuslice/%n'",
    '"/run/gpuslice\\nX=1"', "relative", "/",
]  # fmt: skip
_KEYS = [s.name for s in SETTINGS] + ["colour", "GPUS", "gpus ", "'gpus'", "[gpus]", "? [a]"]


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@st.composite
def values(draw: st.DrawFn) -> str:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.sampled_from(_NUMBERS))
    if kind == 1:
        return draw(st.sampled_from(_WORDS))
    if kind == 2:
        return draw(st.sampled_from(_PATHS))
    if kind == 3:
        return _nested(draw(st.integers(1, 40)))
    if kind == 4:
        items = draw(st.lists(st.sampled_from(_NUMBERS + _WORDS[:12]), max_size=6))
        return "[" + ", ".join(items) + "]"
    return draw(st.text(max_size=20).map(lambda t: '"' + t.replace('"', "'") + '"'))


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    """A mapping of settings, one per line, with values at and beyond every bound."""
    lines = [
        f"{draw(st.sampled_from(_KEYS))}: {draw(values())}" for _ in range(draw(st.integers(0, 12)))
    ]
    if draw(st.booleans()):
        lines.append("manage_gpus:\n" + "".join(f"  - {draw(values())}\n" for _ in range(3)))
    if draw(st.booleans()):
        lines.append("reserve:\n" + "".join(f"  {draw(values())}: {draw(values())}\n" * 2))
    return "\n".join(lines) + "\n"


def _in_range(config: Config) -> None:
    assert 1 <= config.gpus <= MAX_GPUS
    for value, low, high in (
        (config.sample_interval, 0.05, 3600),
        (config.vram_release_timeout, 0.1, 3600),
        (config.gate_retry_seconds, 0.05, 60),
        (config.stop_timeout, 1, 86400),
    ):
        assert isinstance(value, float) and math.isfinite(value) and low <= value <= high
    for path, base in (
        (config.state_dir, DEFAULT_STATE_DIR),
        (config.runtime_dir, DEFAULT_RUNTIME_DIR),
    ):
        assert path == base or path.startswith(base + "/")
        assert path.isascii() and path.isprintable() and "/." not in path and "//" not in path
        assert len(path) <= 200
    assert len(config.manage_gpus) <= MAX_GPUS
    assert all(GPU_ID.fullmatch(g) for g in config.manage_gpus)
    for key, size in config.reserve:
        assert key == "*" or GPU_ID.fullmatch(key)
        assert 0 <= size <= SIZE_MAX


def _parses_or_located_error(text: str) -> None:
    try:
        config, warnings = parse_config(text, PATH)
    except ConfigError as e:
        assert e.problems
        assert all(p.startswith(f"{PATH}:") and "\n" not in p for p in e.problems), e.problems
        return
    _in_range(config)
    assert all(w.startswith(f"{PATH}:") and "\n" not in w for w in warnings), warnings


@FUZZ
@given(st.text())
def test_any_text(text: str) -> None:
    _parses_or_located_error(text)


@FUZZ
@given(st.text(alphabet="[]{}:,-? \n\t&*!|>'\"#%@`ab01.~\\", max_size=200))
def test_yaml_punctuation(text: str) -> None:
    _parses_or_located_error(text)


@FUZZ
@given(config_texts())
def test_settings_at_and_beyond_their_bounds(text: str) -> None:
    _parses_or_located_error(text)


# A small space, and each case costs up to 0.2 s (PyYAML looks 1024 characters ahead for a
# possible key at every level before the depth limit stops it): one example in 40.
@settings(FUZZ, max_examples=max(5, EXAMPLES // 40))
@given(st.integers(0, 5000), st.sampled_from(["[", "{a: ", "- "]), st.sampled_from(_KEYS))
def test_deep_nesting(depth: int, opener: str, key: str) -> None:
    if opener == "- ":
        body = "".join(" " * i + "-\n" for i in range(min(depth, 800)))
        text = f"{key}:\n{body}"
    else:
        closer = "]" if opener == "[" else "}"
        text = f"{key}: {opener * depth}{closer * depth}\n"
    _parses_or_located_error(text)


# ---- the generator ----------------------------------------------------------------------------

_PREFIX = st.lists(
    st.one_of(st.sampled_from("abcxyzABZ019:_-"), st.sampled_from(["\\x2d", "\\x40", "\\x5c"])),
    min_size=1,
    max_size=80,
).map("".join)


@st.composite
def unit_names(draw: st.DrawFn) -> str:
    """Valid `.service` names up to 255 characters: plain, templates, instances."""
    prefix = draw(_PREFIX)
    kind = draw(st.sampled_from(["plain", "template", "instance"]))
    if kind == "template":
        name = f"{prefix}@.service"
    elif kind == "instance":
        name = f"{prefix}@{draw(_PREFIX)}.service"
    else:
        name = f"{prefix}.service"
    pad = draw(st.sampled_from([0, 0, 150, 240, 245, 250, 255]))
    if pad > len(name):  # lengthen the part before the suffix up to `pad` characters
        at = name.rfind(".service")
        name = name[:at] + "y" * (pad - len(name)) + name[at:]
    return name


_PRE = ["/bin/prep %i", "-/bin/mkdir -p /x", "/bin/a\x1bb", "/bin/a\tb", "/bin/\u00e9", ""]


@st.composite
def unit_trees(draw: st.DrawFn) -> dict[str, str]:
    """Unit file name -> text: annotated or not, valid or not, with ExecStartPre= lines."""
    units: dict[str, str] = {}
    for name in draw(st.lists(unit_names(), max_size=8)):
        if not is_valid_unit_name(name) or name.startswith("."):
            continue
        pre = draw(st.lists(st.sampled_from(_PRE), max_size=2))
        text = "[Service]\nExecStart=/bin/true\n" + "".join(f"ExecStartPre={p}\n" for p in pre)
        annotation = draw(st.sampled_from(["ok", "ok", "bad", "none"]))
        if annotation == "ok":
            text += "[X-GPUSlice]\nPriority=5\n"
        elif annotation == "bad":
            text += "[X-GPUSlice]\nPriority=high\n"
        units[name] = text
        if is_instance(name) and draw(st.booleans()):
            units.setdefault(template_of(name), "[X-GPUSlice]\nPriority=7\n")
    return units


@FUZZ
@given(unit_trees())
def test_generator_gates_every_valid_annotated_unit_or_says_why(units: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory(dir=_TMP) as tmp:
        root = Path(tmp)
        unit_dir = root / "usr/lib/systemd/system"
        unit_dir.mkdir(parents=True)
        for name, content in units.items():
            (unit_dir / name).write_text(content, encoding="utf-8")
        out = root / "out"
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            assert generator.main([str(out)], root=tmp) == 0
        errors = stderr.getvalue()
        result = scan(root)
        for unit in result.specs:
            own = out / f"{unit}.d" / GATE_DROPIN_NAME
            text: str | None = own.read_text() if fits_dropin_dir(unit) and own.exists() else None
            template = out / f"{template_of(unit)}.d" / GATE_DROPIN_NAME
            if text is None and is_instance(unit) and template.exists():
                text = template.read_text()
            if text is not None and text != generator.MASK_TEXT:
                assert "/gpuslice-gate %n 0.5 /run/gpuslice/gate/%n\n" in text
                continue
            # no gate: only when the generator said why, naming the unit
            assert f"{printable(unit)}: " in errors, (unit, errors)
