"""Where systemd finds a unit's files, in systemd's own order, and a reader for their text.

Paths come in two forms: the *system path* systemd itself would show
(`/etc/systemd/system/x.service`, used in messages and `UnitSpec.source`) and the *real path* on
this filesystem, which differs only when `root` is not "/" (tests use a temporary directory).

The search path and the drop-in rules follow systemd 252 (`src/basic/path-lookup.c`,
`src/shared/dropin.c`, `src/basic/conf-files.c`, `src/shared/conf-parser.c`).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# `systemd-analyze unit-paths` of systemd 252 (Debian 12) for the system manager, highest
# priority first. Two names for one directory (/lib -> /usr/lib on merged-/usr) count once.
SYSTEM_UNIT_PATH: tuple[str, ...] = (
    "/etc/systemd/system.control",
    "/run/systemd/system.control",
    "/run/systemd/transient",
    "/run/systemd/generator.early",
    "/etc/systemd/system",
    "/etc/systemd/system.attached",
    "/run/systemd/system",
    "/run/systemd/system.attached",
    "/run/systemd/generator",
    "/usr/local/lib/systemd/system",
    "/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/run/systemd/generator.late",
)

UNIT_SUFFIX = ".service"
COMMENT_CHARS = "#;"
_MAX_SYMLINKS = 32


# ---------------------------------------------------------------------------------------------
# unit names


UNIT_NAME_MAX = 255  # systemd's UNIT_NAME_MAX less the NUL
_UNIT_NAME = re.compile(
    r"[A-Za-z0-9:_.\\-]+(@[A-Za-z0-9:_.\\@-]*)?"
    r"\.(service|socket|target|device|mount|automount|swap|timer|path|slice|scope)"
)


def is_valid_unit_name(name: object) -> bool:
    """systemd's unit_name_is_valid(), near enough: ASCII letters, digits and `:-_.\\`, one
    `@` before an instance, a known type suffix, at most 255 characters. Every name that
    comes from outside (a signal, a call, the state file) is checked with this first."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= UNIT_NAME_MAX
        and _UNIT_NAME.fullmatch(name) is not None
    )


def printable(text: str, limit: int = 300) -> str:
    """`text` safe for one journal line: control and non-ASCII characters escaped, cut at
    `limit` characters. For names that failed `is_valid_unit_name` and must still be shown."""
    escaped = text.encode("ascii", "backslashreplace").decode("ascii")
    escaped = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in escaped)
    return escaped if len(escaped) <= limit else escaped[:limit] + "..."


def is_template(name: str) -> bool:
    """`foo@.service`."""
    return "@." in name and name.index("@") == name.index("@.")


def is_instance(name: str) -> bool:
    """`foo@bar.service` (not the template `foo@.service`)."""
    at = name.find("@")
    dot = name.rfind(".")
    return 0 < at < dot - 1


def template_of(name: str) -> str:
    """`foo@bar.service` -> `foo@.service`; any other name is returned unchanged."""
    if not is_instance(name):
        return name
    at = name.index("@")
    return name[: at + 1] + name[name.rfind(".") :]


def _dash_prefixes(name: str) -> list[str]:
    """`foo-bar-baz.service` -> [`foo-bar-.service`, `foo-.service`] (systemd's prefix drop-ins)."""
    dot = name.rfind(".")
    suffix = name[dot:]
    at = name.find("@")
    prefix = name[:at] if at > 0 else name[:dot]
    if prefix.endswith("-"):  # `foo-.service` is itself a prefix name: chop its dash once
        prefix = prefix[:-1]
    out: list[str] = []
    dash = prefix.rfind("-")
    while dash > 0:
        out.append(prefix[: dash + 1] + suffix)
        dash = prefix.rfind("-", 0, dash)
    return out


# ---------------------------------------------------------------------------------------------
# systemd-style ini text


class Entry(NamedTuple):
    """One assignment: `key=value` in `[section]`, starting at 1-based `line`."""

    section: str
    key: str
    value: str
    line: int


class TextIssue(NamedTuple):
    """A line systemd would ignore with a warning (e.g. no `=`)."""

    section: str | None
    line: int
    message: str


def parse_sections(text: str, issues: list[TextIssue] | None = None) -> list[Entry]:
    """Read systemd unit-file text the way systemd's config_parse does.

    Comments are lines whose first non-blank character is `#` or `;` (also inside a continuation).
    A line ending in an unescaped backslash continues on the next line; the backslash becomes a
    space. Keys may repeat. Values are kept verbatim (quotes, `%` specifiers, escapes): each
    setting's own parser interprets them. `line` is where the logical line starts. Lines systemd
    would ignore are reported to `issues` when given.
    """
    entries: list[Entry] = []
    section: str | None = None
    pending: list[str] = []
    start = 0
    if text.startswith("\ufeff"):
        text = text[1:]
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped and stripped[0] in COMMENT_CHARS:
            continue
        if not pending:
            start = number
        # an odd number of trailing backslashes means the last one escapes the newline
        trailing = len(raw) - len(raw.rstrip("\\"))
        if trailing % 2 == 1:
            pending.append(raw[:-1] + " ")
            continue
        logical = "".join(pending) + raw if pending else raw
        pending = []
        section = _parse_line(logical.strip(), start, section, entries, issues)
    if pending:
        _parse_line("".join(pending).strip(), start, section, entries, issues)
    return entries


def _parse_line(
    line: str,
    number: int,
    section: str | None,
    entries: list[Entry],
    issues: list[TextIssue] | None,
) -> str | None:
    if not line or line[0] in COMMENT_CHARS:
        return section
    if line[0] == "[":
        if line[-1] != "]" or len(line) < 3:
            if issues is not None:
                issues.append(TextIssue(section, number, f"invalid section header {line!r}"))
            return None
        return line[1:-1]
    key, sep, value = line.partition("=")
    if issues is not None:
        if section is None:
            issues.append(TextIssue(None, number, "assignment outside of any section, ignored"))
        elif not sep:
            issues.append(TextIssue(section, number, "missing '=', line ignored"))
        elif not key.strip():
            issues.append(TextIssue(section, number, "missing key before '=', line ignored"))
    if section is not None and sep and key.strip():
        entries.append(Entry(section, key.strip(), value.strip(), number))
    return section


# ---------------------------------------------------------------------------------------------
# files


@dataclass(frozen=True)
class UnitFile:
    """A unit fragment or drop-in: `path` as systemd names it, `real` as this process opens it."""

    path: str
    real: Path

    def read_text(self) -> str:
        return self.real.read_text(encoding="utf-8", errors="replace")


@dataclass(frozen=True)
class Fragment(UnitFile):
    """The main file of a unit; `masked` when it is a symlink to /dev/null or an empty file."""

    masked: bool = False


_DIR = 1
_LINK = 2


def _scan_dir(real: Path) -> dict[str, int]:
    """Entry name -> _DIR (a directory, symlinks followed) | _LINK (a symlink), one scandir."""
    names: dict[str, int] = {}
    with os.scandir(real) as it:
        for entry in it:
            try:
                names[entry.name] = (_DIR if entry.is_dir() else 0) | (
                    _LINK if entry.is_symlink() else 0
                )
            except OSError:
                continue
    return names


class UnitIndex:
    """Lists each search directory once, then answers fragment and drop-in questions from memory.

    Build one per scan (a daemon-reload): it does not notice later changes on disk.
    """

    def __init__(
        self, root: str | os.PathLike[str] = "/", search_path: Iterable[str] = SYSTEM_UNIT_PATH
    ):
        self.root = Path(root)
        # (system dir, real dir, {entry name: _DIR | _LINK bits}), from one scandir each
        self._dirs: list[tuple[str, Path, dict[str, int]]] = []
        seen: set[tuple[int, int]] = set()
        for sysdir in search_path:
            real = self.chase(sysdir)
            try:
                st = real.stat()
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            try:
                names = _scan_dir(real)
            except OSError:
                continue
            self._dirs.append((sysdir, real, names))

    # -- paths

    def real_path(self, system_path: str) -> Path:
        """Where the system path lies under this index's root (no symlinks followed)."""
        return self.root / system_path.lstrip("/")

    def chase(self, system_path: str) -> Path:
        """Resolve symlinks in `system_path` inside the root (absolute targets stay in the root)."""
        return self.real_path(self._chase_system(system_path))

    def _chase_system(self, system_path: str) -> str:
        parts = [p for p in system_path.split("/") if p]
        done: list[str] = []
        hops = 0
        while parts:
            part = parts.pop(0)
            if part == ".":
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            candidate = "/" + "/".join([*done, part])
            real = self.real_path(candidate)
            if real.is_symlink() and hops < _MAX_SYMLINKS:
                hops += 1
                target = os.readlink(real)
                if target.startswith("/"):
                    done = []
                parts = [p for p in target.split("/") if p] + parts
                continue
            done.append(part)
        return "/" + "/".join(done)

    def _resolve(self, sysdir: str, real_dir: Path, name: str, kind: int) -> tuple[Path, bool]:
        """Real path of a directory entry and whether it is a symlink to /dev/null."""
        if not kind & _LINK:
            return real_dir / name, False
        target = self._chase_system(f"{sysdir}/{name}")
        return self.real_path(target), target == "/dev/null"

    # -- questions

    def unit_names(self) -> list[str]:
        """Every `.service` name that has a fragment (file or symlink) in some search directory.

        Templates are listed as `foo@.service`; instance files (`foo@a.service`) as themselves.
        Alias symlinks (a link whose target has another unit name) are left out: their unit is
        listed under its own name.
        """
        names: set[str] = set()
        for sysdir, _real, entries in self._dirs:
            for name, kind in entries.items():
                if kind & _DIR or not name.endswith(UNIT_SUFFIX) or name.startswith("."):
                    continue
                if name in names:
                    continue
                if kind & _LINK and self._is_alias(f"{sysdir}/{name}", name):
                    continue
                names.add(name)
        return sorted(names)

    def _is_alias(self, system_path: str, name: str) -> bool:
        target = self._chase_system(system_path)
        base = target.rsplit("/", 1)[-1]
        return target != "/dev/null" and base.endswith(UNIT_SUFFIX) and base != name

    def instance_dropin_names(self) -> list[str]:
        """Instance names (`foo@a.service`) that have a drop-in directory of their own."""
        found: set[str] = set()
        for _sysdir, _real, entries in self._dirs:
            for name, kind in entries.items():
                if kind & (_DIR | _LINK) and name.endswith(UNIT_SUFFIX + ".d"):
                    unit = name[:-2]
                    if is_instance(unit):
                        found.add(unit)
        return sorted(found)

    def fragment(self, name: str) -> Fragment | None:
        """The unit's main file: first match in path order; an instance without its own file
        uses its template's. None when systemd would say not-found. Masked: a symlink to
        /dev/null or an empty file."""
        candidates = [name, template_of(name)] if is_instance(name) else [name]
        for candidate in candidates:
            for sysdir, real_dir, entries in self._dirs:
                kind = entries.get(candidate)
                if kind is None or kind & _DIR:
                    continue
                real, masked = self._resolve(sysdir, real_dir, candidate, kind)
                if not masked:
                    try:
                        st = real.stat()
                        masked = stat.S_ISCHR(st.st_mode) or st.st_size == 0
                    except OSError:
                        pass
                return Fragment(f"{sysdir}/{candidate}", real, masked)
        return None

    def dropin_dirs(self, name: str) -> list[tuple[str, Path]]:
        """Drop-in directories that exist, in systemd's precedence order (earlier wins a tie)."""
        names: list[str] = []

        def add(n: str) -> None:
            if n not in names:
                names.append(n)
            if is_instance(n):
                add(template_of(n))

        add(name)
        for p in _dash_prefixes(name):
            if p not in names:
                names.append(p)
        dirs: list[tuple[str, Path]] = []
        for group in (names, [name[name.rfind(".") + 1 :]]):  # then the type-level `service.d`
            for sysdir, real, entries in self._dirs:
                for n in group:
                    kind = entries.get(n + ".d", 0)
                    if kind & _LINK:  # resolve inside the root
                        target = self.chase(f"{sysdir}/{n}.d")
                        if target.is_dir():
                            dirs.append((f"{sysdir}/{n}.d", target))
                    elif kind & _DIR:
                        dirs.append((f"{sysdir}/{n}.d", real / (n + ".d")))
        return dirs

    def dropins(self, name: str) -> list[UnitFile]:
        """The unit's `*.conf` drop-ins in the order systemd applies them: sorted by file name; a
        file name in a higher-priority directory hides the same name in lower ones. A symlink to
        /dev/null hides the name and is left out; an empty file hides it too (and, as in
        systemd's DropInPaths, is listed: it contributes nothing)."""
        chosen: dict[str, UnitFile | None] = {}
        for sysdir, real_dir in self.dropin_dirs(name):
            try:
                entries = _scan_dir(real_dir)
            except OSError:
                continue
            for fname, kind in entries.items():
                if not fname.endswith(".conf") or fname.startswith(".") or fname in chosen:
                    continue
                if kind & _DIR:
                    continue
                real, masked = self._resolve(sysdir, real_dir, fname, kind)
                if masked:
                    chosen[fname] = None
                elif not kind & _LINK or real.is_file():
                    chosen[fname] = UnitFile(f"{sysdir}/{fname}", real)
        return [f for _n, f in sorted(chosen.items()) if f is not None]


def find_fragment(name: str, root: str | os.PathLike[str] = "/") -> Fragment | None:
    return UnitIndex(root).fragment(name)


def find_dropins(name: str, root: str | os.PathLike[str] = "/") -> list[UnitFile]:
    return UnitIndex(root).dropins(name)


def list_unit_names(root: str | os.PathLike[str] = "/") -> list[str]:
    return UnitIndex(root).unit_names()
