"""The `[X-GPUSlice]` section of a unit: read from its fragment and drop-ins, merged, validated.

One table (`KEYS`) declares every key; adding a key is one row there plus a `UnitSpec` field.
Every problem is collected with its file and line; a unit with an error is left unmanaged, and
the other units are unaffected. Pure stdlib + `core.model`, so the generator can import it cheaply.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from gpuslice.core.model import UnitKind, UnitSpec
from gpuslice.sizes import SIZE_ALLOWED, parse_size
from gpuslice.unitfiles import (
    Entry,
    TextIssue,
    UnitFile,
    UnitIndex,
    is_instance,
    parse_sections,
    template_of,
)

SECTION = "X-GPUSlice"

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """One finding, printed as `PATH:LINE: [X-GPUSlice] KEY: message`."""

    path: str
    line: int
    key: str
    message: str
    severity: Severity = "error"
    unit: str = ""

    def __str__(self) -> str:
        key = f" {self.key}:" if self.key else ""
        return f"{self.path}:{self.line}: [{SECTION}]{key} {self.message}"


# ---------------------------------------------------------------------------------------------
# the key table


def _integer(low: int, high: int | None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit()):
            raise ValueError(text)
        value = int(text)
        if value < low or (high is not None and value > high):
            raise ValueError(text)
        return value

    return parse


def _kind(text: str) -> UnitKind:
    return UnitKind(text)  # ValueError for anything else


_TRUE = frozenset({"1", "yes", "y", "true", "t", "on"})
_FALSE = frozenset({"0", "no", "n", "false", "f", "off"})


def _boolean(text: str) -> bool:
    """systemd's parse_boolean."""
    lowered = text.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(text)


_DEVICE = re.compile(r"^(\d+|(GPU|MIG)-[0-9A-Za-z-]+)$")


def _devices(text: str) -> tuple[str, ...]:
    tokens = tuple(t for t in re.split(r"[,\s]+", text) if t)
    if not tokens or not all(_DEVICE.match(t) for t in tokens):
        raise ValueError(text)
    return tokens


@dataclass(frozen=True)
class Key:
    """One `[X-GPUSlice]` key: `parse` raises ValueError for a bad value; `allowed` completes
    "expected ..."; `field` is the `UnitSpec` attribute it fills; `required` keys have no default.
    An empty assignment (`Key=`) resets the key to its default, as in systemd."""

    name: str
    field: str
    parse: Callable[[str], Any]
    default: Any
    allowed: str
    required: bool = False


KEYS: tuple[Key, ...] = (
    Key("Priority", "priority", _integer(0, 999), None, "an integer 0-999", required=True),
    Key(
        "Type",
        "kind",
        _kind,
        UnitKind.ON_DEMAND,
        "one of " + ", ".join(k.value for k in UnitKind),
    ),
    Key("GPUs", "gpus", _integer(1, None), 1, "an integer >= 1"),
    Key("Requeue", "requeue", _boolean, True, "a boolean (yes/no, true/false, on/off, 1/0)"),
    Key("Memory", "memory", parse_size, None, SIZE_ALLOWED),
    Key(
        "Devices",
        "devices",
        _devices,
        (),
        "GPU indices or UUIDs separated by commas or spaces (e.g. 0,1 or GPU-8f6c...)",
    ),
)
KEYS_BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}


# ---------------------------------------------------------------------------------------------
# loading


@dataclass
class _Setting:
    value: Any
    raw: str
    path: str
    line: int


class Loader:
    """Reads annotations through one `UnitIndex`, parsing each file once."""

    def __init__(self, index: UnitIndex):
        self.index = index
        self._parsed: dict[str, _Parsed] = {}
        self._files: dict[str, list[UnitFile] | None] = {}

    def parsed(self, unit_file: UnitFile) -> _Parsed:
        """The file's entries, ignorable lines, and the line of its first `[X-GPUSlice]`."""
        cached = self._parsed.get(unit_file.path)
        if cached is None:
            text = unit_file.read_text()
            issues: list[TextIssue] = []
            entries = parse_sections(text, issues)
            header = None
            if _HEADER in text:
                header = next(
                    (n for n, raw in enumerate(text.splitlines(), 1) if raw.strip() == _HEADER),
                    None,
                )
            cached = _Parsed(entries, issues, header)
            self._parsed[unit_file.path] = cached
        return cached

    def files(self, name: str) -> list[UnitFile] | None:
        """Fragment then drop-ins in systemd's order; None when not found or masked."""
        if name not in self._files:
            fragment = self.index.fragment(name)
            if fragment is None or fragment.masked:
                self._files[name] = None
            else:
                self._files[name] = [fragment, *self.index.dropins(name)]
        return self._files[name]

    def load(self, name: str) -> tuple[UnitSpec | None, list[Problem]]:
        files = self.files(name)
        if files is None:
            return None, []
        return self.load_files(name, files)

    def load_files(self, name: str, files: list[UnitFile]) -> tuple[UnitSpec | None, list[Problem]]:
        """Merge the annotation of `files` (fragment first, then drop-ins in order)."""
        problems: list[Problem] = []
        settings: dict[str, _Setting] = {}
        # where the first [X-GPUSlice] header is: the place to report a missing key
        section_at: tuple[str, int] | None = None
        for unit_file in files:
            try:
                parsed = self.parsed(unit_file)
            except OSError as e:
                problems.append(
                    Problem(unit_file.path, 0, "", f"cannot read: {e.strerror}", "warning", name)
                )
                continue
            if section_at is None and parsed.header is not None:
                section_at = (unit_file.path, parsed.header)
            for issue in parsed.issues:
                if issue.section == SECTION:
                    problems.append(
                        Problem(unit_file.path, issue.line, "", issue.message, "warning", name)
                    )
            for entry in parsed.entries:
                if entry.section == SECTION:
                    self._assign(name, unit_file.path, entry, settings, problems)
        if section_at is None:
            return None, []

        values: dict[str, Any] = {}
        for key in KEYS:
            setting = settings.get(key.name)
            if setting is not None:
                if isinstance(setting.value, _Invalid):
                    problems.append(_bad_value(name, key, setting))
                else:
                    values[key.field] = setting.value
            elif key.required:
                path, line = section_at
                problems.append(
                    Problem(path, line, key.name, f"missing, expected {key.allowed}", "error", name)
                )
            else:
                values[key.field] = key.default
        if any(p.severity == "error" for p in problems):
            return None, problems
        source = settings["Priority"].path
        return UnitSpec(name=name, source=source, **values), problems

    def _assign(
        self,
        unit: str,
        path: str,
        entry: Entry,
        settings: dict[str, _Setting],
        problems: list[Problem],
    ) -> None:
        key = KEYS_BY_NAME.get(entry.key)
        if key is None:
            known = ", ".join(KEYS_BY_NAME)
            problems.append(
                Problem(
                    path,
                    entry.line,
                    entry.key,
                    f"unknown key, ignored (known keys: {known})",
                    "warning",
                    unit,
                )
            )
            return
        previous = settings.get(key.name)
        if previous is not None and isinstance(previous.value, _Invalid):
            # a bad value that a later assignment overrides does not make the unit unmanaged
            problems.append(
                _bad_value(
                    unit,
                    key,
                    previous,
                    severity="warning",
                    suffix=f" (overridden at {path}:{entry.line})",
                )
            )
        if entry.value == "":
            settings.pop(key.name, None)
            return
        try:
            value: Any = key.parse(entry.value)
        except ValueError:
            value = _Invalid()
        settings[key.name] = _Setting(value, entry.value, path, entry.line)


class _Parsed(NamedTuple):
    entries: list[Entry]
    issues: list[TextIssue]
    header: int | None


_HEADER = f"[{SECTION}]"


class _Invalid:
    """Marks a value that failed to parse."""


def _bad_value(
    unit: str, key: Key, setting: _Setting, severity: Severity = "error", suffix: str = ""
) -> Problem:
    return Problem(
        setting.path,
        setting.line,
        key.name,
        f'expected {key.allowed}, got "{setting.raw}"{suffix}',
        severity,
        unit,
    )


def load_spec(
    unit_name: str, root: str | os.PathLike[str] = "/"
) -> tuple[UnitSpec | None, list[Problem]]:
    """The unit's merged annotation. (None, []) when the unit is not annotated, not found or
    masked; (None, problems) when it is annotated but unmanaged because of errors."""
    return Loader(UnitIndex(root)).load(unit_name)


# ---------------------------------------------------------------------------------------------
# scanning every unit


@dataclass
class Scan:
    """All annotated units at one moment.

    `specs` holds valid units under their own names: plain units, templates (`foo@.service`),
    instance files, and instances whose own drop-ins (`foo@a.service.d/`) exist and are annotated.
    `invalid` holds annotated units left unmanaged because of errors. `unannotated_instances`
    holds instances with a unit file of their own (`foo@a.service`) that carries no annotation:
    they do not inherit their template's.
    """

    specs: dict[str, UnitSpec] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    invalid: set[str] = field(default_factory=set)
    unannotated_instances: set[str] = field(default_factory=set)
    root: str = "/"

    def spec_for(self, unit_name: str) -> UnitSpec | None:
        """The spec of any unit, instances resolved through their template."""
        spec = self.specs.get(unit_name)
        if spec is not None:
            return spec
        if (
            unit_name in self.invalid
            or unit_name in self.unannotated_instances
            or not is_instance(unit_name)
        ):
            return None
        template = self.specs.get(template_of(unit_name))
        return template.for_instance(unit_name) if template is not None else None


def scan(root: str | os.PathLike[str] = "/", loader: Loader | None = None) -> Scan:
    """Read every `.service` unit's annotation (one pass over the search path)."""
    loader = loader or Loader(UnitIndex(root))
    result = Scan(root=os.fspath(loader.index.root))
    names = loader.index.unit_names()
    known = set(names)
    # instances that have drop-ins of their own, after their templates
    names += [
        n
        for n in loader.index.instance_dropin_names()
        if n not in known and template_of(n) in known
    ]
    reported: set[tuple[str, int, str, str, str]] = set()
    for name in names:
        spec, problems = loader.load(name)
        if name not in known and spec is not None:
            template = result.specs.get(template_of(name))
            if template is not None and spec == template.for_instance(name):
                spec = None  # nothing of its own: spec_for derives it from the template
        for problem in problems:
            # an instance re-reads its template's files: report each finding once
            ident = (problem.path, problem.line, problem.key, problem.message, problem.severity)
            if ident not in reported:
                reported.add(ident)
                result.problems.append(problem)
        if spec is not None:
            result.specs[name] = spec
        elif any(p.severity == "error" for p in problems):
            result.invalid.add(name)
        elif name in known and is_instance(name):
            result.unannotated_instances.add(name)
    return result


def check_file(path: str | os.PathLike[str]) -> list[Problem]:
    """Problems of one unit file's own `[X-GPUSlice]` section, read on its own (for
    `gpuslice check FILE` before the file is installed): drop-ins are not merged."""
    unit_file = UnitFile(os.fspath(path), Path(path))
    name = os.path.basename(os.fspath(path))
    loader = Loader(UnitIndex(search_path=()))
    return loader.load_files(name, [unit_file])[1]
