"""The `[X-GPUSlice]` section of a unit: read from its fragment and drop-ins, merged, validated.

One table (`KEYS`) declares every key; adding a key is one row there plus a `UnitSpec` field.
Every problem is collected with its file and line; a unit with an error is left unmanaged, and
the other units are unaffected. A unit run as another user whose `EnvironmentFile=` or loader
paths (`LD_PRELOAD=`, ...) someone but root can change is an error too, as is any unit whose
mounts replace what the gate runs (`envsafety`: the gate runs as root with the unit's
environment and mounts). Pure stdlib + `core.model` + `paths` + `envsafety`, so the generator
can import it cheaply.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal, NamedTuple

from gpuslice.core.model import (
    GPU_ID,
    INSTANCE_DEVICE,
    PRIORITY_MAX,
    Restart,
    Rung,
    UnitKind,
    UnitSpec,
)
from gpuslice.envsafety import RUN_AS_KEYS, EnvFileChecker, RunAs
from gpuslice.envsyntax import NAME_MAX
from gpuslice.paths import GATE_DROPIN_NAME
from gpuslice.sizes import SIZE_ALLOWED, parse_size
from gpuslice.starttimeout import KEYS as START_TIMEOUT_KEYS
from gpuslice.starttimeout import StartTimeout
from gpuslice.unitfiles import (
    Entry,
    TextIssue,
    UnitFile,
    UnitIndex,
    fits_dropin_dir,
    has_control_character,
    is_instance,
    is_template,
    parse_sections,
    printable,
    template_of,
)

SECTION = "X-GPUSlice"

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """One finding, printed as `PATH:LINE: [SECTION] KEY: message`: a key of `[X-GPUSlice]`, or
    of another section where it affects gpuslice (`[Service] ExecStartPre`). `line` is 0 when
    the finding is about the whole file (it cannot be read); `section` is empty for a file that
    systemd ignores (its name is not a valid unit name, it is a FIFO). `public_message`: the
    message as anyone but root is shown it (`public`), where `message` quotes what only root
    may read, an environment file's text (gpuslice/envsafety.py); "" where it is the same.
    `private`: the file is not others' to read (its mode or ACL, `UnitFile.read`, or a
    directory on its path that others may not search, `UnitIndex.reachable`), so anyone but root
    is shown where the finding is, not what it says (a value, an unknown key's name)."""

    path: str
    line: int
    key: str
    message: str
    severity: Severity = "error"
    unit: str = ""
    section: str = SECTION
    public_message: str = ""
    private: bool = False

    def __str__(self) -> str:
        return self._said(self.message, self.key)

    def public(self) -> str:
        """The finding as Status shows it to anyone but root (the journal and `gpuslice
        check` show root `str`)."""
        if self.private:
            # a key of the table or of systemd's that gpuslice reads, not one the file made up
            named = self.key in KEYS_BY_NAME or self.section != SECTION
            return self._said(_WITHHELD, self.key if named else "")
        return self._said(self.public_message or self.message, self.key)

    def _said(self, message: str, key: str) -> str:
        section = f" [{self.section}]" if self.section else ""
        named = f" {key}:" if key else ""
        return f"{self.path}:{self.line}:{section}{named} {message}"


_WITHHELD = "not shown: the file is not everyone's to read (`gpuslice check` as root says what)"


# ---------------------------------------------------------------------------------------------
# the key table


def _integer(text: str, low: int, high: int) -> int:
    """ASCII digits only (`str.isdigit` alone takes "٣" and "²"), between low and high. The
    table binds the bounds with `partial`, so that the check runs as a plain function (no
    closure made at import: mutation testing reaches it)."""
    if not (text.isascii() and text.isdigit()) or len(text.lstrip("0")) > len(str(high)):
        raise ValueError(text)
    value = int(text)
    if not low <= value <= high:
        raise ValueError(text)
    return value


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


MAX_GPUS = 64  # GPUs= and the number of Devices= entries: more than any host has
_SEPARATORS = re.compile(r"[, \t]+")


_NO_INSTANCE = (
    "%i names the GPU by the unit's instance: only a template (NAME@.service) and its "
    "instances may say it"
)


class InvalidValue(ValueError):
    """A bad value with its own explanation, used in place of "expected ...": `reason`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _ladder(text: str) -> tuple[Rung, ...]:
    """`suspend stop`, `freeze,stop`: rungs tried in this order, each once."""
    words = [t for t in _SEPARATORS.split(text) if t]
    if not words:
        raise InvalidValue("expected stop, freeze or suspend, found only separators")
    known = {r.value: r for r in Rung}
    if any(w not in known for w in words):
        raise ValueError(text)  # "expected ..., got TEXT"
    rungs = tuple(known[w] for w in words)
    if len(set(rungs)) != len(rungs):
        raise InvalidValue("each of stop, freeze and suspend may appear once")
    return rungs


def _devices(text: str) -> tuple[str, ...]:
    """`0,1`, `0 1`, `GPU-8f6c...`: indices or UUIDs (`GPU_ID`), each once, in order; or
    `%i` alone, the instance's name (`INSTANCE_DEVICE`, resolved by `UnitSpec.for_instance`)."""
    tokens = [t for t in _SEPARATORS.split(text) if t]
    if not tokens:
        raise InvalidValue("expected GPU indices or UUIDs, found only separators")
    if tokens == [INSTANCE_DEVICE]:
        return (INSTANCE_DEVICE,)
    if INSTANCE_DEVICE in tokens:
        raise InvalidValue("%i stands alone: an instance's name is the one GPU it may use")
    if len(tokens) > MAX_GPUS:
        raise InvalidValue(f"expected at most {MAX_GPUS} GPUs, found {len(tokens)}")
    for token in tokens:
        if token[:4].upper() == "MIG-":
            raise InvalidValue(
                "MIG devices are not supported (name the whole GPU by its index or GPU- UUID)"
            )
        if GPU_ID.fullmatch(token) is None:
            raise ValueError(text)
    return tuple(dict.fromkeys(tokens))


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
    Key(
        "Priority",
        "priority",
        partial(_integer, low=0, high=PRIORITY_MAX),
        None,
        f"an integer 0-{PRIORITY_MAX}",
        required=True,
    ),
    Key(
        "Type",
        "kind",
        _kind,
        UnitKind.ON_DEMAND,
        "one of " + ", ".join(k.value for k in UnitKind),
    ),
    Key("GPUs", "gpus", partial(_integer, low=1, high=MAX_GPUS), 1, f"an integer 1-{MAX_GPUS}"),
    Key("Requeue", "requeue", _boolean, True, "a boolean (yes/no, true/false, on/off, 1/0)"),
    Key("Memory", "memory", parse_size, None, SIZE_ALLOWED),
    Key(
        "Devices",
        "devices",
        _devices,
        (),
        f"up to {MAX_GPUS} GPU indices or UUIDs separated by commas or spaces "
        "(e.g. 0,1 or GPU-8f6c...), or %i in a template (each instance names its GPU)",
    ),
    Key(
        "Preempt",
        "preempt",
        _ladder,
        (Rung.STOP,),
        "stop, freeze and suspend, in the order to try them, each once (e.g. suspend stop)",
    ),
)
KEYS_BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}


# ---------------------------------------------------------------------------------------------
# loading

# A file that floods (thousands of bad lines) is reported this far, then summed up in one line.
MAX_PROBLEMS_PER_FILE = 50
_QUOTE_MAX = 100  # how much of a bad value or key a message quotes
# What the loader catches from reading and parsing files so that no file can crash a scan; a
# failure is an error on the unit (left unmanaged), never an exception.
_READ_ERRORS = (OSError, ValueError, RecursionError, UnicodeError)
# Units that no gate may hold: the controller's own, and those it starts after
# (units/gpuslice.service's After=) or needs to answer (the bus). A gate makes its unit wait
# for the controller (After=gpuslice.service, then a grant over D-Bus): annotated, one of
# these is a start that waits for itself, or an ordering cycle, which systemd breaks by
# dropping a start job, perhaps the controller's; either way every GPU job waits.
NEVER_GATED = frozenset(
    {
        "gpuslice.service",
        "dbus.service",
        "dbus-broker.service",
        "systemd-modules-load.service",
        "nvidia-persistenced.service",
        "nvidia-fabricmanager.service",
    }
)
# What gpuslice.service is ordered after, or is: NEVER_GATED, and through its default
# dependencies (After=basic.target) basic.target, sysinit.target and the targets those two
# come after. A gated unit ordered before one of these (its own or a drop-in's Before=) is
# ordered before the controller its gate waits for (After=gpuslice.service): a cycle as for
# NEVER_GATED.
BEFORE_THE_CONTROLLER = NEVER_GATED | frozenset(
    {
        "basic.target",
        "sysinit.target",
        "sockets.target",
        "paths.target",
        "slices.target",
        "local-fs.target",
        "local-fs-pre.target",
        "swap.target",
        "cryptsetup.target",
        "cryptsetup-pre.target",
    }
)


@dataclass
class _Setting:
    value: Any
    raw: str
    path: str
    line: int


def _parse(text: str) -> _Parsed:
    issues: list[TextIssue] = []
    headers: list[tuple[str, int]] = []
    entries = parse_sections(text, issues, headers)
    header = next((line for name, line in headers if name == SECTION), None)
    return _Parsed(entries, issues, header)


class Loader:
    """Reads annotations through one `UnitIndex`, parsing each file once."""

    def __init__(self, index: UnitIndex):
        self.index = index
        self._parsed: dict[str, _Parsed | OSError] = {}
        # a parse depends on the text alone: the generator's gate drop-ins are the same
        # text for every unit whose own ExecStartPre= lines are alike (10,000 units: 1 parse)
        self._by_text: dict[str, _Parsed] = {}
        self._private: set[str] = set()  # the files read that are not others' to read
        self._files: dict[str, list[UnitFile] | None] = {}
        # whether what the gate runs with as root (environment files, loader paths, mounts)
        # is root's alone
        self.env_files = EnvFileChecker(index.root)

    def parsed(self, unit_file: UnitFile) -> _Parsed:
        """The file's entries, ignorable lines, and the line of its first `[X-GPUSlice]`.
        OSError (remembered, so each file is read once) when the file cannot be read: not a
        regular file, too large, a symlink loop, ..."""
        cached = self._parsed.get(unit_file.path)
        if cached is None:
            try:
                text, public = unit_file.read()
                if not public or not self.index.reachable(unit_file.real):
                    self._private.add(unit_file.path)
                cached = self._by_text.get(text)
                if cached is None:
                    cached = self._by_text[text] = _parse(text)
            except OSError as e:
                cached = e
            except _READ_ERRORS as e:  # belt and braces: no file may crash a scan
                cached = OSError(errno.EIO, f"cannot be parsed ({type(e).__name__})")
            self._parsed[unit_file.path] = cached
        if isinstance(cached, OSError):
            raise cached
        return cached

    def private(self, unit_file: UnitFile) -> bool:
        """Whether the file, read (`parsed`), is not others' to read (`UnitFile.read`)."""
        return unit_file.path in self._private

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
        """The unit's merged annotation (see `load_spec`). Never raises for what a file holds:
        an unreadable file is an error Problem on it."""
        try:
            files = self.files(name)
        except _READ_ERRORS as e:  # belt and braces: UnitIndex itself catches what it meets
            return None, [
                Problem(printable(name), 0, "", f"cannot be read: {_reason(e)}", unit=name)
            ]
        if files is None:
            return None, []
        return self.load_files(name, files)

    def load_files(self, name: str, files: list[UnitFile]) -> tuple[UnitSpec | None, list[Problem]]:
        """Merge the annotation of `files` (fragment first, then drop-ins in order).

        A file that cannot be read (gone: a warning; anything else, such as a FIFO, a file over
        `MAX_FILE_SIZE` or a symlink loop: an error) leaves the unit unmanaged, whether or not
        its readable files are annotated: what the unread file says is unknown.

        A unit that runs as another user (`User=`, `DynamicUser=`) is unmanaged too when
        someone but root can change one of its `EnvironmentFile=`s or a path its
        environment's `LD_PRELOAD=`, `LD_LIBRARY_PATH=`, ... names, and any unit whose root
        directory or mounts replace or hide what the gate uses (gpuslice/envsafety.py): the
        gate runs as root with the unit's environment and mounts."""
        problems: list[Problem] = []
        run_as = RunAs()
        unreadable: list[Problem] = []
        settings: dict[str, _Setting] = {}
        # where the first [X-GPUSlice] header is: the place to report a missing key
        section_at: tuple[str, int] | None = None
        before: list[tuple[str, int, str]] = []  # [Unit] Before= names: file, line, name
        # [Service] ExecStartPre= lines that the gate's drop-in copies (those of the files
        # applied before it): file, entry
        copied: list[tuple[str, Entry]] = []
        remains: tuple[str, Entry] | None = None  # the RemainAfterExit= in force: file, entry
        restart = Restart.NO  # the Restart= in force: whether a clean exit is restarted
        start_timeout = StartTimeout()  # what the gate's TimeoutStartSec=infinity overrides
        private: set[str] = set()  # the files of these that are not others' to read
        for number, unit_file in enumerate(files):
            if is_our_gate(unit_file.path):
                continue  # the generator's own output holds no annotation: not read
            path = printable(unit_file.path)
            try:
                parsed = self.parsed(unit_file)
            except OSError as e:
                severity: Severity = "warning" if e.errno == errno.ENOENT else "error"
                unreadable.append(
                    Problem(path, 0, "", f"cannot read: {_reason(e)}", severity, name)
                )
                continue
            if self.private(unit_file):
                private.add(path)
            if section_at is None and parsed.header is not None:
                section_at = (path, parsed.header)
            for issue in parsed.issues:
                if issue.section == SECTION:
                    problems.append(Problem(path, issue.line, "", issue.message, "warning", name))
            before_gate = number == 0 or unit_file.path.rsplit("/", 1)[-1] < GATE_DROPIN_NAME
            for entry in parsed.entries:
                if entry.section == "Service" and entry.key in START_TIMEOUT_KEYS:
                    start_timeout.assign(path, entry, before_gate)
                if entry.section == SECTION:
                    self._assign(name, path, entry, settings, problems)
                elif entry.section == "Service" and entry.key in RUN_AS_KEYS:
                    run_as.assign(path, entry)
                elif entry.section == "Unit" and entry.key == "Before":
                    before += [(path, entry.line, n) for n in entry.value.split()]
                elif entry.section == "Service" and entry.key == "RemainAfterExit":
                    with contextlib.suppress(ValueError):  # systemd ignores what is no boolean
                        remains = (path, entry) if _boolean(entry.value) else None
                elif entry.section == "Service" and entry.key == "Restart":
                    with contextlib.suppress(ValueError):  # systemd ignores what it cannot parse
                        restart = Restart(entry.value)
                elif before_gate and entry.section == "Service" and entry.key == "ExecStartPre":
                    if entry.value == "":
                        copied.clear()
                    else:
                        copied.append((path, entry))
        if section_at is None:
            return None, _capped(unreadable)
        problems = unreadable + problems
        if name in NEVER_GATED:
            path, line = section_at
            problems.append(
                Problem(
                    path,
                    line,
                    "",
                    "gpuslice.service starts after this unit, or is it: a gate here would wait "
                    "for the controller that waits for it (left unmanaged, ungated)",
                    "error",
                    name,
                )
            )
        if not is_instance(name) and not fits_dropin_dir(name):
            problems.append(_too_long(*section_at, name))  # an instance's: `_scan`
        problems += [
            Problem(
                path,
                entry.line,
                "ExecStartPre",
                f"{printable(entry.value, _QUOTE_MAX)}: a control character in a line the "
                "gate's drop-in would copy, which gpuslice-generator does not write (left "
                "unmanaged, ungated)",
                "error",
                name,
                "Service",
            )
            for path, entry in copied
            if has_control_character(entry.value)
        ]
        problems += [
            Problem(
                path,
                line,
                "Before",
                f"{target}: this unit is ordered before gpuslice.service, which its gate would "
                "wait for (left unmanaged, ungated)",
                "error",
                name,
                "Unit",
            )
            for path, line, target in before
            if target in BEFORE_THE_CONTROLLER
        ]
        problems += [
            Problem(f.path, f.line, f.key, f.message, "error", name, "Service", f.public)
            for f in self.env_files.check(name, run_as)
        ]
        if remains is not None:  # its GPUs go at its job's end, its stop comes later
            path, entry = remains
            problems.append(
                Problem(
                    path,
                    entry.line,
                    "RemainAfterExit",
                    # a word _boolean took (yes, on, 1, ...): short and ASCII, shown as written
                    f"{entry.value}: the unit stays active after its main process exits: "
                    "gpuslice releases its GPUs once no process is left in it, its "
                    "ExecReload= and ExecStop= run later with no GPU visible, and `systemctl "
                    "start` does nothing until it is stopped (`systemctl restart` runs it "
                    "again, on a GPU)",
                    "warning",
                    name,
                    "Service",
                )
            )
        problems += [
            Problem(f.path, f.line, f.key, f.message, "warning", name, "Service")
            for f in start_timeout.findings()
        ]

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
        devices = settings.get("Devices")
        if (
            devices is not None
            and devices.value == (INSTANCE_DEVICE,)
            and not (is_template(name) or is_instance(name))
        ):
            problems.append(
                Problem(devices.path, devices.line, "Devices", _NO_INSTANCE, "error", name)
            )
        if private:
            problems = [replace(p, private=True) if p.path in private else p for p in problems]
        if any(p.severity == "error" for p in problems):
            return None, _capped(problems)
        source = settings["Priority"].path
        spec = UnitSpec(name=name, source=source, restart=restart, **values)
        return (spec.for_instance(name) if is_instance(name) else spec), _capped(problems)

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
                    printable(entry.key, _QUOTE_MAX),
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
        except InvalidValue as e:
            value = _Invalid(e.reason)
        except (ValueError, ArithmeticError):
            value = _Invalid()
        settings[key.name] = _Setting(value, entry.value, path, entry.line)


class _Parsed(NamedTuple):
    entries: list[Entry]
    issues: list[TextIssue]
    header: int | None


class _Invalid:
    """Marks a value that failed to parse; `reason` replaces "expected ..." when given."""

    def __init__(self, reason: str = ""):
        self.reason = reason


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return printable(e.strerror, 200)
    return printable(str(e) or type(e).__name__, 200)


def _bad_value(
    unit: str, key: Key, setting: _Setting, severity: Severity = "error", suffix: str = ""
) -> Problem:
    assert isinstance(setting.value, _Invalid)
    got = f'got "{printable(setting.raw, _QUOTE_MAX)}"'
    reason = setting.value.reason
    message = f"{reason or 'expected ' + key.allowed}, {got}{suffix}"
    return Problem(setting.path, setting.line, key.name, message, severity, unit)


def _too_long(path: str, line: int, unit: str) -> Problem:
    """A unit whose `UNIT.d`, where gpuslice-generator writes its gate, would not fit in a
    file name (systemd takes names of 254 and 255 characters): ungated, it is no unit of
    gpuslice's, which `gpuslice check` and the controller must say as the generator does."""
    return Problem(
        path,
        line,
        "",
        f"the unit's name is too long for its gate's drop-in directory UNIT.d ({len(unit)} "
        f"characters; at most {NAME_MAX - 2}): gpuslice-generator cannot gate it (left "
        "unmanaged, ungated)",
        "error",
        unit,
    )


def _capped(problems: list[Problem]) -> list[Problem]:
    """At most `MAX_PROBLEMS_PER_FILE` problems of each file, then one line saying how many more
    (an error if any of them is)."""
    kept: list[Problem] = []
    dropped: dict[str, list[Problem]] = {}
    count: dict[str, int] = {}
    for problem in problems:
        count[problem.path] = count.get(problem.path, 0) + 1
        if count[problem.path] <= MAX_PROBLEMS_PER_FILE:
            kept.append(problem)
        else:
            dropped.setdefault(problem.path, []).append(problem)
    for path, rest in dropped.items():
        severity: Severity = "error" if any(p.severity == "error" for p in rest) else "warning"
        kept.append(
            Problem(
                path,
                0,
                "",
                f"{len(rest)} more problems in this file not shown",
                severity,
                rest[0].unit,
            )
        )
    return kept


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
    """Read every `.service` unit's annotation (one pass over the search path).

    Never raises for what the files hold: every unit is loaded on its own, and what cannot be
    read is a Problem on that unit only. Files that systemd ignores (an invalid unit name, a
    FIFO) are warnings; so is a drop-in that would remove a managed unit's gate (`_gate_removed`).
    """
    with _no_cycle_collection():
        return _scan(loader or Loader(UnitIndex(root)))


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector off for a scan, which makes no cycles but many objects that
    live on (entries, specs): at 10,000 units its passes were a fifth of the scan. Reference
    counting still frees what the scan drops."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _scan(loader: Loader) -> Scan:
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

    def report(problems: list[Problem]) -> None:
        for problem in problems:
            # an instance re-reads its template's files: report each finding once
            ident = (problem.path, problem.line, problem.key, problem.message, problem.severity)
            if ident not in reported:
                reported.add(ident)
                result.problems.append(problem)

    gate_reported: set[tuple[str, int]] = set()
    for name in names:
        spec, problems = loader.load(name)
        if spec is not None:
            problems = problems + [
                p for p in _gate_removed(loader, name) if (p.path, p.line) not in gate_reported
            ]
            gate_reported.update((p.path, p.line) for p in problems if p.key == "ExecStartPre")
        if name not in known and spec is not None:
            template = result.specs.get(template_of(name))
            if template is not None and spec == template.for_instance(name):
                spec = None  # nothing of its own: spec_for derives it from the template
        report(problems)
        if spec is not None:
            result.specs[name] = spec
        elif any(p.severity == "error" for p in problems):
            result.invalid.add(name)
        elif name in known and is_instance(name):
            result.unannotated_instances.add(name)
    report(
        [
            Problem(issue.path, 0, "", issue.message, "warning", "", section="")
            for issue in sorted(loader.index.issues)
        ]
    )
    # An instance is gated by its template's `UNIT.d/` while its template is managed; one
    # whose name is too long for a directory of its own has no gate otherwise (as a plain
    # unit's, `load_files`).
    for name in sorted(result.specs):
        if (
            is_instance(name)
            and not fits_dropin_dir(name)
            and template_of(name) not in result.specs
        ):
            result.invalid.add(name)
            report([_too_long(result.specs.pop(name).source, 0, name)])
    return result


# The gate's own drop-in is written here (the generator's normal directory).
_GENERATOR_DIR = "/run/systemd/generator/"


def is_our_gate(path: str) -> bool:
    """The gate drop-in gpuslice-generator wrote (only generators, run by systemd as root,
    write there): at 10,000 annotated units, half the files a scan would read."""
    return path.startswith(_GENERATOR_DIR) and path.endswith("/" + GATE_DROPIN_NAME)


def _gate_removed(loader: Loader, name: str) -> list[Problem]:
    """Warnings for the files that would remove the gate of `name`, a managed unit.

    systemd applies drop-ins sorted by file name across all directories. The gate drop-in
    resets ExecStartPre= and puts the gate first; an empty `ExecStartPre=` in a drop-in that
    sorts after it (a template's or an instance's) resets the list again and the unit starts
    without the gate. A drop-in of the same name in another directory hides the gate file, as
    does a mask of that name (a symlink to /dev/null) or anything else systemd lists by it (a
    directory, a dangling link: `UnitIndex.hiding_dropins`).
    """
    files = loader.files(name) or []
    out: list[Problem] = []
    if files:
        for hider in loader.index.hiding_dropins(name):
            if hider.endswith("/" + GATE_DROPIN_NAME) and not hider.startswith(_GENERATOR_DIR):
                out.append(
                    Problem(
                        printable(hider),
                        0,
                        "",
                        f"this mask hides the GPU gate's {GATE_DROPIN_NAME}: {name} starts "
                        "without waiting for its GPUs; remove it",
                        "warning",
                        name,
                        section="Service",
                    )
                )
    for unit_file in files[1:]:
        base = unit_file.path.rsplit("/", 1)[-1]
        if base < GATE_DROPIN_NAME:
            continue
        path = printable(unit_file.path)
        if base == GATE_DROPIN_NAME:
            if not unit_file.path.startswith(_GENERATOR_DIR):
                out.append(
                    Problem(
                        path,
                        0,
                        "",
                        f"this file hides the GPU gate's {GATE_DROPIN_NAME}: {name} starts "
                        "without waiting for its GPUs; give it another name",
                        "warning",
                        name,
                        section="Service",
                    )
                )
            continue
        try:
            entries = loader.parsed(unit_file).entries
        except OSError:
            continue  # reported by load()
        for entry in entries:
            if entry.section == "Service" and entry.key == "ExecStartPre" and entry.value == "":
                out.append(
                    Problem(
                        path,
                        entry.line,
                        "ExecStartPre",
                        f"an empty ExecStartPre= after {GATE_DROPIN_NAME} removes the GPU gate: "
                        f"{name} starts without waiting for its GPUs; put your ExecStartPre= "
                        f"lines in a drop-in named before {GATE_DROPIN_NAME}",
                        "warning",
                        name,
                        section="Service",
                    )
                )
    return out


def check_file(path: str | os.PathLike[str]) -> list[Problem]:
    """Problems of one unit file's own `[X-GPUSlice]` section, read on its own (for
    `gpuslice check FILE` before the file is installed): drop-ins are not merged."""
    unit_file = UnitFile(os.fspath(path), os.fspath(path))
    name = os.path.basename(os.fspath(path))
    loader = Loader(UnitIndex(search_path=()))
    return loader.load_files(name, [unit_file])[1]
