"""Where systemd finds a unit's files, in systemd's own order, and a reader for their text.

Paths come in two forms: the *system path* systemd itself would show
(`/etc/systemd/system/x.service`, used in messages and `UnitSpec.source`) and the *real path* on
this filesystem, which differs only when `root` is not "/" (tests use a temporary directory).

The search path and the drop-in rules follow systemd 252 (`src/basic/path-lookup.c`,
`src/shared/dropin.c`, `src/basic/conf-files.c`, `src/shared/conf-parser.c`).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# the core's: unit names are read alike on both sides of it
from gpuslice.core.model import is_instance as is_instance
from gpuslice.core.model import is_template as is_template
from gpuslice.envsyntax import NAME_MAX, WHITESPACE, is_valid_utf8
from gpuslice.safefile import Unreadable, Why, file_kind, has_access_acl, read_with_stat

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


def fits_dropin_dir(unit: str) -> bool:
    """Whether `UNIT.d` fits in one path component (Linux's NAME_MAX): a unit name of 254 or
    255 characters (valid for systemd) can have no drop-in directory of its own."""
    return len(f"{unit}.d".encode()) <= NAME_MAX


_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # a tab is whitespace to systemd


def has_control_character(line: str) -> bool:
    """Whether `line` holds a newline or another control character (a tab, whitespace to
    systemd, is none): gpuslice-generator writes no such line into a drop-in."""
    return _CONTROL.search(line) is not None


def printable(text: str, limit: int = 300) -> str:
    """`text` safe for one journal line: control and non-ASCII characters escaped, cut at
    `limit` characters. For names that failed `is_valid_unit_name` and must still be shown."""
    if text.isascii() and text.isprintable():  # the common case, at C speed (every path)
        escaped = text
    else:
        escaped = text.encode("ascii", "backslashreplace").decode("ascii")
        escaped = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in escaped)
    return escaped if len(escaped) <= limit else escaped[:limit] + "..."


def template_of(name: str) -> str:
    """`foo@bar.service` -> `foo@.service`; any other name is returned unchanged."""
    if not is_instance(name):
        return name
    at = name.index("@")
    return name[: at + 1] + name[name.rfind(".") :]


def _dash_prefixes(stem: str) -> list[str]:
    """`foo-bar-baz` -> [`foo-bar-`, `foo-`]: the dash prefixes systemd 252 looks up for a
    name whose part before its first `@` (or its suffix) is `stem` (`unit_file_find_dirs` in
    src/shared/dropin.c): a trailing dash is chopped once, a leading one gives none."""
    if stem.endswith("-"):  # `foo-.service` is itself a prefix name: chop its dash once
        stem = stem[:-1]
    out: list[str] = []
    dash = stem.rfind("-")
    while dash > 0:
        out.append(stem[: dash + 1])
        dash = stem.rfind("-", 0, dash)
    return out


def _dropin_names(name: str) -> list[str]:
    """The names whose `NAME.d` directories systemd 252 reads for unit name `name`, in its
    order. `unit_file_find_dirs` reads the name, then (an instance) its template's names,
    then its dash prefix's, built with the instance: `foo-bar@a.service` reads `foo-bar@a`,
    `foo-bar@`, `foo-` (the template's prefix), `foo-@a` and `foo-@`.

    A template stands for every instance (its gate covers them all): its names are an
    instance's less those that name the instance (`foo-bar@`, `foo-`, `foo-@`)."""
    dot = name.rfind(".")
    at = name.find("@")
    suffix = name[dot:]
    stem = name[:at] if at >= 0 else name[:dot]
    prefixes = _dash_prefixes(stem)
    names = [name]
    if at < 0:
        return names + [p + suffix for p in prefixes]
    instance = name[at + 1 : dot]  # "" in a template
    if instance:
        names.append(f"{stem}@{suffix}")
    names += [p + suffix for p in prefixes]
    for p in prefixes:
        if instance:
            names.append(f"{p}@{instance}{suffix}")
        names.append(f"{p}@{suffix}")
    return names


def _kind_of_name(name: str) -> int:
    """0 for a plain name, 1 for an instance, 2 for a template: an alias is of its unit's kind."""
    return 2 if is_template(name) else 1 if is_instance(name) else 0


_KINDS = ("a plain name", "an instance", "a template")  # by `_kind_of_name`


def _instance_part(name: str) -> str:
    """`x@a@b.service` -> `a@b`: all between the first `@` and the type's dot, as systemd's."""
    return name[name.index("@") + 1 : name.rfind(".")]


def _alias_refused(name: str, target: str) -> str | None:
    """Why systemd 252 refuses the symlink `name` (a valid `.service` name) into the search
    path as an alias of `target` (the name its target path ends in), or None when it takes it
    (`unit_validate_alias_symlink_or_warn` in src/basic/unit-file.c). A refused link is
    ignored: its name stays unmapped, and a lower directory's entry of that name is the unit's.
    "" for an alias to its own name, which systemd ignores too, but logs at debug level only."""
    if target == name:
        return ""
    if not is_valid_unit_name(target):
        return "not a valid unit name"
    kind = _kind_of_name(name)
    target_kind = _kind_of_name(target)
    # an instance may alias a template: `foo@a.service -> bar@.service` is `bar@a.service`
    if target_kind != kind and not (kind == 1 and is_template(target)):
        return f"{_KINDS[kind]} to {_KINDS[target_kind]}"
    if kind == target_kind == 1 and _instance_part(name) != _instance_part(target):
        return "another instance"
    if not target.endswith(UNIT_SUFFIX):
        return "another unit type"
    return None


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


# systemd's read_line (`src/basic/fileio.c`) ends a line at a run of "\n", "\r" and NUL,
# each at most once, that a NUL ends: "\r\n", "\n\r" and "\r\0" are one line end each,
# "\n\n" and "\0\n" two
_LINE_END = re.compile(r"\n\r?\0?|\r\n?\0?|\0")
_BOM = "\ufeff"
_ISSUE_TEXT_MAX = 80  # how much of a bad line a message quotes


def parse_sections(
    text: str,
    issues: list[TextIssue] | None = None,
    headers: list[tuple[str, int]] | None = None,
) -> list[Entry]:
    """Read systemd unit-file text the way systemd's config_parse does.

    Lines end at a newline, a carriage return or a NUL, as in systemd (`_LINE_END`). Comments are
    lines whose first non-blank character is `#` or `;` (also inside a continuation). The first
    other line that starts with a byte order mark loses it, wherever it is (systemd's bom_seen).
    A line ending in an unescaped backslash continues on the next line; the backslash becomes a
    space. Keys may repeat. Values are kept verbatim (quotes, `%` specifiers, escapes): each
    setting's own parser interprets them. `line` is where the logical line starts. A line that is
    not valid UTF-8 (`UnitFile.read_text` keeps such bytes as lone surrogates) or a section header
    without its `]` ends the reading: systemd 252's config_parse stops there and fails, so
    nothing after it applies (a drop-in's earlier lines do; a fragment fails to load). Lines
    systemd would ignore are reported to `issues` when given; every section header goes to
    `headers` (name, line) when given.
    """
    entries: list[Entry] = []
    section: str | None = None
    pending: list[str] = []
    start = 0
    bom_seen = _BOM not in text
    # most files end lines with "\n" alone: str.split is a quarter of the regex's time
    lines = _LINE_END.split(text) if "\r" in text or "\0" in text else text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the text ended with a line end
    for number, raw in enumerate(lines, start=1):
        stripped = raw.strip(WHITESPACE)
        if stripped and stripped[0] in COMMENT_CHARS:
            continue  # before the mark is dropped: "\ufeff#..." is no comment to systemd
        if not bom_seen and raw.startswith(_BOM):
            bom_seen = True
            raw = raw[1:]
            stripped = raw.strip(WHITESPACE)
        if not pending:
            if not stripped:
                continue  # a blank line ends nothing and says nothing
            start = number
        # an odd number of trailing backslashes means the last one escapes the newline
        trailing = len(raw) - len(raw.rstrip("\\")) if raw.endswith("\\") else 0
        if trailing % 2 == 1:
            pending.append(raw[:-1] + " ")
            continue
        logical = "".join(pending) + raw if pending else raw
        pending = []
        section = _parse_line(logical, start, section, entries, issues, headers)
        if section is _STOP:
            return entries
    if pending:
        _parse_line("".join(pending), start, section, entries, issues, headers)
    return entries


_STOP = "\0stop"  # `_parse_line`'s answer to a line that ends systemd's reading of the file
_REST_IGNORED = "systemd ignores the rest of the file"


def _parse_line(
    raw: str,
    number: int,
    section: str | None,
    entries: list[Entry],
    issues: list[TextIssue] | None,
    headers: list[tuple[str, int]] | None,
) -> str | None:
    line = raw.strip(WHITESPACE)
    if not line or line[0] in COMMENT_CHARS:
        return section
    if not is_valid_utf8(line):  # undecodable bytes, or worse
        if issues is not None:
            message = f"line is not valid UTF-8: {_REST_IGNORED}"
            issues.append(TextIssue(section, number, message))
        return _STOP
    if line[0] == "[":
        if line[-1] != "]" or len(line) < 3:
            unclosed = line[-1] != "]" or len(line) == 1  # "[]" names a section none has
            if issues is not None:
                quoted = printable(line, _ISSUE_TEXT_MAX)
                message = f"invalid section header '{quoted}'"
                if unclosed:
                    message += f": {_REST_IGNORED}"
                issues.append(TextIssue(section, number, message))
            return _STOP if unclosed else None
        name = line[1:-1]
        if headers is not None:
            headers.append((name, number))
        return name
    key, sep, value = line.partition("=")
    key = key.strip(WHITESPACE)
    if issues is not None:
        if section is None:
            issues.append(TextIssue(None, number, "assignment outside of any section, ignored"))
        elif not sep:
            issues.append(TextIssue(section, number, "missing '=', line ignored"))
        elif not key:
            issues.append(TextIssue(section, number, "missing key before '=', line ignored"))
    if section is not None and sep and key:
        entries.append(Entry(section, key, value.strip(WHITESPACE), number))
    return section


# ---------------------------------------------------------------------------------------------
# files


MAX_FILE_SIZE = 1 << 20  # systemd's LONG_LINE_MAX; no real unit file comes near it


def _not_regular(mode: int) -> str | None:
    """What the file is when it is not a regular file, for a message."""
    if stat.S_ISREG(mode):
        return None
    return file_kind(mode) or "not a regular file"


def read_unit_text(path: str | os.PathLike[str]) -> str:
    """See `UnitFile.read_text`."""
    return read_unit(path)[0]


def read_unit(path: str | os.PathLike[str]) -> tuple[str, bool]:
    """See `UnitFile.read`."""
    try:
        data, st = read_with_stat(path, MAX_FILE_SIZE, follow_links=True)
    except Unreadable as e:
        if e.error is not None:
            raise e.error from None
        if e.why is Why.TOO_LARGE:
            raise OSError(
                errno.EFBIG, f"larger than {MAX_FILE_SIZE >> 20} MiB, which no unit file needs"
            ) from None
        raise OSError(errno.EINVAL, f"{_not_regular(e.mode)}, not a regular file") from None
    public = bool(st.st_mode & stat.S_IROTH) and not _has_acl(os.fspath(path))
    return data.decode("utf-8", errors="surrogateescape"), public


def _has_acl(path: str) -> bool:
    """Whether `path` carries an access ACL (`safefile.has_access_acl`), True where that cannot
    be told. An ACL names someone whose access differs from what the mode gives others
    (`setfacl -m u:bob:---` shuts bob out of a 0644 file): gpuslice reads none of its entries,
    so a file or directory with one is taken as not everyone's (as `config` and `envsafety`
    take one as not root's alone)."""
    try:
        return has_access_acl(path)
    except (OSError, ValueError):
        return True


def _others_may(path: str, bit: int) -> bool:
    """Whether the mode of `path` (links followed) gives others `bit` and it carries no access
    ACL (`_has_acl`); False where it cannot be told."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return bool(mode & bit) and not _has_acl(path)


@dataclass(frozen=True)
class UnitFile:
    """A unit fragment or drop-in: `path` as systemd names it, `real` as this process opens it."""

    path: str
    real: str

    def read_text(self) -> str:
        """The file's text. Bytes that are not UTF-8 stay as lone surrogates (surrogateescape),
        so that `parse_sections` can ignore their lines as systemd does. OSError (with a
        `strerror` fit for a message) for anything but a regular file of at most
        `MAX_FILE_SIZE` bytes: a FIFO, a socket or a device is never opened (opening a FIFO
        would block, at boot, forever), and the size is checked on the open file."""
        return read_unit_text(self.real)

    def read(self) -> tuple[str, bool]:
        """`read_text`, and whether anyone may read the file: its mode (of the descriptor the
        text came from) lets others read it, and it carries no access ACL (`_has_acl`). Where
        it does not, its owner (root) made what it says its own, which gpuslice then quotes
        to root alone (annotations.Problem). Its directories count too: see
        `UnitIndex.reachable`."""
        return read_unit(self.real)


@dataclass(frozen=True)
class Fragment(UnitFile):
    """The main file of a unit; `masked` when it is a symlink to /dev/null or an empty file."""

    masked: bool = False


# what a drop-in that systemd lists but cannot read as a file does (`_dropin_dir_files`)
_HIDES = "ignored; it hides the drop-ins of its name in the directories after it"

_DIR = 1
_LINK = 2
_OTHER = 4  # neither a regular file, a directory nor a symlink: a FIFO, a socket, a device


def _scan_dir(real: str) -> dict[str, int]:
    """Entry name -> _DIR (a directory, symlinks followed) | _LINK (a symlink) | _OTHER, from
    one scandir. Entries that cannot be examined are left out."""
    names: dict[str, int] = {}
    with os.scandir(real) as it:
        for entry in it:
            try:
                if entry.is_symlink():
                    kind = _LINK
                    try:
                        if entry.is_dir():  # follows the link
                            kind |= _DIR
                    except OSError:  # a loop: a link that leads nowhere, as a dangling one
                        pass
                elif entry.is_dir(follow_symlinks=False):
                    kind = _DIR
                else:
                    kind = 0 if entry.is_file(follow_symlinks=False) else _OTHER
            except OSError:
                continue
            names[entry.name] = kind
    return names


def _stat(path: str | None) -> os.stat_result | None:
    """stat() that follows symlinks; None for anything that fails (missing, a loop, too long)."""
    if path is None:
        return None
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


class IndexIssue(NamedTuple):
    """A file in the search path that systemd would ignore, and why (for a warning)."""

    path: str
    message: str


class UnitIndex:
    """Lists each search directory once, then answers fragment and drop-in questions from memory
    (each drop-in directory, too, is listed once, at the first unit that reads it).

    Build one per scan (a daemon-reload): it does not notice later changes on disk.
    """

    def __init__(
        self, root: str | os.PathLike[str] = "/", search_path: Iterable[str] = SYSTEM_UNIT_PATH
    ):
        self.root = Path(root)
        # real paths are strings: at 10,000 units, building Paths was a quarter of a scan
        self._root = os.fspath(self.root).rstrip("/")
        # (system dir, real dir, {entry name: _DIR | _LINK | _OTHER bits}), one scandir each
        self._dirs: list[tuple[str, str, dict[str, int]]] = []
        # files that systemd ignores, as they are met (listing names, looking up drop-ins)
        self.issues: list[IndexIssue] = []
        self._issue_set: set[IndexIssue] = set()
        # every directory systemd searches, found or not: a link into one of them is an alias
        self._search_path = tuple(search_path)
        seen: set[tuple[int, int]] = set()
        for sysdir in self._search_path:
            real = self.chase(sysdir)
            st = _stat(real)
            if real is None or st is None or not stat.S_ISDIR(st.st_mode):
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            try:
                names = _scan_dir(real)
            except OSError:
                continue
            self._dirs.append((sysdir, real, names))
        # every `X.d` a directory holds (or a link may make one): most units have no drop-in
        # directory but the generator's, and need not be looked up in every directory
        self._dropin_dir_names = {
            name
            for _sysdir, _real, entries in self._dirs
            for name, kind in entries.items()
            if kind & (_DIR | _LINK) and name.endswith(".d")
        }
        # (primary name of each alias link, the alias names of each primary name), when asked
        self._alias_maps: tuple[dict[str, str], dict[str, list[str]]] | None = None
        # (system dir, link name) -> what systemd maps the link's name to (`_alias_of`): asked
        # by unit_names, then by fragment and primary_name, of the same links
        self._link_maps: dict[tuple[str, str], str | None] = {}
        # a drop-in directory link's system path -> the directory it leads to, or None; and a
        # drop-in directory's (system path, real path) -> what it offers (`_dropin_dir_files`).
        # `service.d/`, a dash prefix's or a template's directory is read by thousands of units:
        # at 10,000 units, listing it again for each was three in four of a scan's listings
        self._linked_dirs: dict[str, str | None] = {}
        self._dir_files: dict[tuple[str, str], list[tuple[str, UnitFile | str | None]]] = {}
        # real directory -> whether others may search it and each one above it in the root
        # (`reachable`): the few directories of thousands of units are looked at once each
        self._searchable: dict[str, bool] = {}
        # unit name -> the system paths of the drop-ins `dropins` chose that apply nothing and
        # hide their name (a mask, a directory, a dangling link): `hiding_dropins`
        self._hiding: dict[str, list[str]] = {}

    # -- paths

    def reachable(self, real: str) -> bool:
        """Whether another user could reach the file at `real` (a real path of this index's,
        links resolved, as `UnitFile.real`: for a link, its target's): each directory from the
        root down to it lets others search it (o+x) and carries no access ACL (`_has_acl`).
        A 0644 unit file in root's 0700 directory is no more others' to read than a 0600 one
        (`UnitFile.read`). The root itself is not looked at: the host's `/`, which everyone
        searches (a test's root is a temporary directory, root's alone). Iterative, as a link's
        target may be thousands of directories deep."""
        directory = os.path.dirname(os.path.abspath(real) if not real.startswith("/") else real)
        unknown: list[str] = []  # from the deepest up
        answer = True  # the root's
        while (known := self._searchable.get(directory)) is None:
            parent = os.path.dirname(directory)
            if directory in (self._root, parent):
                break
            unknown.append(directory)
            directory = parent
        else:
            answer = known
        for directory in reversed(unknown):  # from the top down: one shut is enough
            answer = answer and _others_may(directory, stat.S_IXOTH)
            self._searchable[directory] = answer
        return answer

    def real_path(self, system_path: str) -> str:
        """Where the system path lies under this index's root (no symlinks followed)."""
        return f"{self._root}/{system_path.lstrip('/')}"

    def chase(self, system_path: str) -> str | None:
        """Resolve symlinks in `system_path` inside the root (absolute targets stay in the root);
        None after more than `_MAX_SYMLINKS` links (a loop or a long chain), as in systemd."""
        target = self._chase_system(system_path)
        return None if target is None else self.real_path(target)

    def _issue(self, path: str, message: str) -> None:
        issue = IndexIssue(printable(path), message)
        if issue not in self._issue_set:
            self._issue_set.add(issue)
            self.issues.append(issue)

    def _chase_system(self, system_path: str) -> str | None:
        """The system path with every symlink resolved; None past `_MAX_SYMLINKS` links (a loop,
        a long chain). Never raises: a link it cannot read is taken as a plain name."""
        parts = [p for p in system_path.split("/") if p]
        parts.reverse()  # popped from the end
        done: list[str] = []
        hops = 0
        while parts:
            part = parts.pop()
            if part == ".":
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            try:
                target = os.readlink(self.real_path("/" + "/".join([*done, part])))
            except (OSError, ValueError):  # not a link, missing, name too long
                target = None
            if target is not None:
                hops += 1
                if hops > _MAX_SYMLINKS:
                    return None
                if target.startswith("/"):
                    done = []
                parts.extend(reversed([p for p in target.split("/") if p]))
                continue
            done.append(part)
        return "/" + "/".join(done)

    def _resolve(self, sysdir: str, real_dir: str, name: str, kind: int) -> tuple[str | None, bool]:
        """Real path of a directory entry (None: too many links) and whether it is a symlink
        to /dev/null."""
        if not kind & _LINK:
            return f"{real_dir}/{name}", False
        target = self._chase_system(f"{sysdir}/{name}")
        if target is None:
            return None, False
        return self.real_path(target), target == "/dev/null"

    # -- questions

    def unit_names(self) -> list[str]:
        """Every `.service` name that has a fragment (file or symlink) in some search directory.

        Templates are listed as `foo@.service`; instance files (`foo@a.service`) as themselves.
        Alias symlinks (a link into the search path whose target has another unit name) are left
        out: their unit is listed under its own name, and the alias hides that name in lower
        directories. A link out of the search path (`systemctl link`) is the unit's file under
        the link's name, whatever the target's (`_alias_of`). A link into the search path that
        systemd refuses as an alias (`t@.service -> a.service`) is ignored, as a directory is:
        a lower directory's entry of that name is the unit's.

        Names that are not valid unit names and entries that are neither files nor symlinks
        (a FIFO, a socket, a device) are left out, as systemd leaves them out, with an issue.
        """
        names: set[str] = set()
        aliases: set[str] = set()  # as systemd, the first directory that names a unit wins
        for sysdir, _real, entries in self._dirs:
            for name, kind in sorted(entries.items()):
                if kind & _DIR and not kind & _LINK:
                    continue  # a link to a directory is a link: systemd takes it by its text
                if not name.endswith(UNIT_SUFFIX) or name.startswith("."):
                    continue
                if name in names or name in aliases:
                    continue
                if not is_valid_unit_name(name):
                    self._issue(
                        f"{sysdir}/{name}", "not a valid unit name, ignored (as by systemd)"
                    )
                    continue
                if kind & _OTHER:
                    self._issue(f"{sysdir}/{name}", "not a regular file or a symlink, ignored")
                    continue
                if kind & _LINK:
                    target = self._chase_system(f"{sysdir}/{name}")
                    if target is None or (
                        target != "/dev/null" and _stat(self.real_path(target)) is None
                    ):
                        self._issue(
                            f"{sysdir}/{name}",
                            "a symlink that leads nowhere (dangling, a loop, too long), ignored",
                        )
                        continue
                    mapped = self._alias_of(sysdir, name)
                    if mapped is None:
                        self._refused_issue(sysdir, name)
                        continue
                    if mapped != name:
                        aliases.add(name)
                        continue
                names.add(name)
        return sorted(names)

    def _refused_issue(self, sysdir: str, name: str) -> None:
        """Say why systemd ignores the link `sysdir/name` (`_alias_of` gave None), as it does."""
        target = self._link_target(sysdir, name)
        if target is None:
            return  # unreadable since it was listed: systemd says so in its own words
        why = _alias_refused(name, os.path.basename(target))
        if why:  # not an alias to its own name, which systemd ignores quietly
            self._issue(
                f"{sysdir}/{name}",
                f"a symlink to {printable(target)}, which systemd refuses as an alias"
                f" ({why}) and ignores: a lower directory's file of this name is the unit's",
            )

    def _alias_of(self, sysdir: str, name: str) -> str | None:
        """What systemd maps the symlink `sysdir/name` (a valid `.service` name) to: the
        target's name for an alias; `name` itself for the unit's own file; None for a link it
        ignores, whose name is then a lower directory's (a link into the search path that it
        refuses as an alias (`_alias_refused`), one it cannot read).

        systemd 252 (unit_file_build_name_map) decides by the link's own target, its last
        component not followed: inside the search path, the link is an alias of the target's
        name; outside it (`systemctl link /opt/app/x.service`, any name, or a mask), the
        target is the unit's file under the link's name. The fully resolved target's name
        would leave such a linked unit out of the scan: ungated, without a word. Whether the
        target is a file or a directory does not matter: systemd reads only the link's text."""
        key = (sysdir, name)
        if key in self._link_maps:
            return self._link_maps[key]
        target = self._link_target(sysdir, name)
        mapped: str | None = None
        if target is not None:
            mapped = name
            if any(target.startswith(f"{d}/") for d in self._search_path):
                base = os.path.basename(target)
                mapped = None if _alias_refused(name, base) is not None else base
        self._link_maps[key] = mapped
        return mapped

    def _link_target(self, sysdir: str, name: str) -> str | None:
        """Where the symlink `sysdir/name` points, as systemd reads it (chase_symlinks with
        CHASE_NOFOLLOW): absolute, the links of its directories resolved, its last component
        as the link says. None when it cannot be read or its directories loop."""
        try:
            target = os.readlink(self.real_path(f"{sysdir}/{name}"))
        except (OSError, ValueError):
            return None
        head, last = os.path.split(os.path.join(sysdir, target))  # an absolute one stays
        parent = self._chase_system(head)
        return None if parent is None else os.path.join(parent, last)

    def primary_name(self, name: str) -> str:
        """The name systemd loads unit `name` under: an alias (a symlink in the search path to
        another unit's name, as `Alias=` makes) followed to that name, an instance of an
        aliased template to the same instance of the template it names (`b@x.service` for
        `a@x.service` when `a@.service -> b@.service`); `name` itself otherwise, and after
        `_MAX_SYMLINKS` aliases (a loop, which systemd does not load). The scan keys a unit by
        this name, and `gpuslice enroll` writes under it, as `systemctl edit` does; its
        aliases' drop-in directories are read with its own (`names_of`)."""
        current = name
        for _ in range(_MAX_SYMLINKS):
            target = self._alias_target(current)
            # an instance with no file of its own, or an alias of its own template (`t@x.service
            # -> t@.service`), is its template's: so are its aliases
            if is_instance(current) and (
                target == current or (target is None and not self._named(current))
            ):
                of_template = self._alias_target(template_of(current))
                target = None
                if of_template is not None and is_template(of_template):
                    at = current.index("@")
                    target = of_template[: of_template.index("@")] + current[at:]
            if target is None or not is_valid_unit_name(target):
                return current
            current = target
        return name

    def _maps(self, sysdir: str, name: str, kind: int) -> bool:
        """Whether systemd maps `name` to the entry `sysdir/name` of `kind` (one `_scan_dir`
        gave): a file, or a link it does not ignore (`_alias_of`); not a directory, a FIFO, a
        socket or a device. An entry it does not map leaves the name to lower directories."""
        if kind & _LINK:
            return self._alias_of(sysdir, name) is not None
        return not kind & (_DIR | _OTHER)

    def _named(self, name: str) -> bool:
        """Whether some directory of the search path has an entry that systemd maps `name` to."""
        for sysdir, _real, entries in self._dirs:
            kind = entries.get(name)
            if kind is not None and self._maps(sysdir, name, kind):
                return True
        return False

    def _alias_target(self, name: str) -> str | None:
        """The unit name that the first entry systemd maps `name` to (`_maps`) makes it an
        alias of: an instance's alias of a template (`a@x.service -> b@.service`) is of that
        template's instance (`b@x.service`; `name` itself for its own template's). None when
        that entry is the unit's own file (a file, a link out of the search path) or there is
        none."""
        for sysdir, _real, entries in self._dirs:
            kind = entries.get(name)
            if kind is None or not self._maps(sysdir, name, kind):
                continue
            target = self._alias_of(sysdir, name) if kind & _LINK else None
            if target is None or target == name:
                return None
            if is_instance(name) and is_template(target):
                target = target[: target.index("@")] + name[name.index("@") :]
            return target
        return None

    def _aliases(self) -> tuple[dict[str, str], dict[str, list[str]]]:
        """Alias name -> the name it leads to (`primary_name`), and that name -> its aliases,
        for every alias link in the search path (systemd's unit_name_map), built on first use:
        one `primary_name` per link, not per unit. A link systemd refuses (`_alias_of`) is no
        alias: an alias and its unit are names of one kind, and of one instance."""
        if self._alias_maps is None:
            primary_of: dict[str, str] = {}
            aliases: dict[str, list[str]] = {}
            seen: set[str] = set()
            for _sysdir, _real, entries in self._dirs:
                for name, kind in entries.items():
                    if not kind & _LINK or not name.endswith(UNIT_SUFFIX):
                        continue
                    if name in seen or not is_valid_unit_name(name):
                        continue
                    seen.add(name)
                    primary = self.primary_name(name)
                    if primary != name:
                        primary_of[name] = primary
                        aliases.setdefault(primary, []).append(name)
            self._alias_maps = (primary_of, aliases)
        return self._alias_maps

    def names_of(self, name: str) -> list[str]:
        """Every name of the unit systemd loads as `name`, whose drop-in directories it reads
        (load-dropin.c: the unit's id, then its aliases): the name it loads it under
        (`primary_name`) first, then its aliases in name order. An instance of an aliased
        template has the alias's instance too (`a@x.service` of `b@x.service` when
        `a@.service -> b@.service`), unless that instance is a unit of its own. (systemd's order
        among aliases is its hash set's: it decides only between drop-ins of one file name in
        two aliases' directories.)"""
        primary_of, aliases = self._aliases()
        primary = name
        if name in primary_of or template_of(name) in primary_of:
            primary = self.primary_name(name)
        others = set(aliases.get(primary, ()))
        template = template_of(primary)
        if template != primary:  # an instance: its template's aliases name it too
            at = primary.index("@")
            for alias in aliases.get(template, ()):
                instance = alias[: alias.index("@")] + primary[at:]
                if is_valid_unit_name(instance) and self.primary_name(instance) == primary:
                    others.add(instance)
        return [primary, *sorted(others)]

    def instance_dropin_names(self) -> list[str]:
        """Instances, by the name systemd loads them under, that read a drop-in directory named
        for an instance: their own (`foo-bar@a.service.d`), an alias's (`baz@a.service.d`
        when `baz@.service -> foo-bar@.service`) or a dash prefix's (`foo-@a.service.d`, read
        by `foo-bar@a.service` and by every other `foo-...@a.service`). Their templates' scan
        cannot see these: each is scanned with its own name."""
        named: set[str] = set()
        for dir_name in self._dropin_dir_names:
            unit = dir_name[:-2]
            if unit.endswith(UNIT_SUFFIX) and is_instance(unit) and is_valid_unit_name(unit):
                named.add(unit)
        if not named:
            return []
        # template-form name `X@.service` -> the templates whose instances read `X@i.service.d`
        readers: dict[str, set[str]] = {}
        for template in self._template_names():
            primary = self.primary_name(template)
            if not is_template(primary):
                continue  # never (`_alias_of` refuses `t@.service -> a.service`): no crash
            for n in _dropin_names(template):
                if is_template(n):
                    readers.setdefault(n, set()).add(primary)
        found: set[str] = set()
        for unit in named:
            found.add(self.primary_name(unit))
            instance = unit[unit.index("@") :]
            for template in readers.get(template_of(unit), ()):
                reader = template[: template.index("@")] + instance
                if is_valid_unit_name(reader):
                    found.add(self.primary_name(reader))
        return sorted(n for n in found if is_instance(n))

    def _template_names(self) -> set[str]:
        """Every `foo@.service` that systemd maps to a file or a symlink (`_maps`) in some
        search directory."""
        return {
            name
            for sysdir, _real, entries in self._dirs
            for name, kind in entries.items()
            if name.endswith(UNIT_SUFFIX)
            and is_template(name)
            and is_valid_unit_name(name)
            and self._maps(sysdir, name, kind)
        }

    def fragment(self, name: str) -> Fragment | None:
        """The unit's main file: first match in path order; an instance without its own file
        uses its template's. None when systemd would say not-found (a link whose target loops,
        which systemd maps the name to and cannot open). Masked: a symlink to /dev/null or an
        empty file. An entry systemd does not map (`_maps`: a directory, a refused alias)
        leaves the name to lower directories; a link to a directory is the fragment, which
        then cannot be read, as systemd cannot load it."""
        candidates = [name, template_of(name)] if is_instance(name) else [name]
        for candidate in candidates:
            for sysdir, real_dir, entries in self._dirs:
                kind = entries.get(candidate)
                if kind is None or not self._maps(sysdir, candidate, kind):
                    continue
                real, masked = self._resolve(sysdir, real_dir, candidate, kind)
                if real is None:
                    # too many links past the link's own text: systemd 252 maps the name to
                    # this link all the same (unit_file_build_name_map reads only its text),
                    # and its load fails: not-found, never a lower directory's file
                    return None
                if not masked:
                    # systemd's null_or_empty(): any character device or an empty file
                    st = _stat(real)
                    masked = st is not None and (
                        stat.S_ISCHR(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_size == 0)
                    )
                return Fragment(f"{sysdir}/{candidate}", real, masked)
        return None

    def dropin_dirs(self, name: str) -> list[tuple[str, str]]:
        """Drop-in directories that exist, in systemd's precedence order (earlier wins a tie):
        for each name of the unit (`names_of`), each search directory in turn holds the
        directories of that name's `_dropin_names`; the type-level `service.d` comes last."""
        groups = [_dropin_names(n) for n in self.names_of(name)]
        groups.append([name[name.rfind(".") + 1 :]])
        dirs: list[tuple[str, str]] = []
        seen: set[str] = set()  # a name met again adds nothing: its files are all taken
        for group in groups:
            group = [n for n in group if n + ".d" in self._dropin_dir_names and n not in seen]
            if not group:
                continue
            seen.update(group)
            for sysdir, real, entries in self._dirs:
                for n in group:
                    kind = entries.get(n + ".d", 0)
                    if kind & _LINK:  # resolve inside the root
                        target = self._linked_dir(f"{sysdir}/{n}.d")
                        if target is not None:
                            dirs.append((f"{sysdir}/{n}.d", target))
                    elif kind & _DIR:
                        dirs.append((f"{sysdir}/{n}.d", f"{real}/{n}.d"))
        return dirs

    def _linked_dir(self, path: str) -> str | None:
        """The real directory that the drop-in directory link `path` (a system path) leads to
        inside the root; None when it leads to no directory. Once per scan: see `_linked_dirs`."""
        if path not in self._linked_dirs:
            target = self.chase(path)
            st = _stat(target)
            ok = target is not None and st is not None and stat.S_ISDIR(st.st_mode)
            self._linked_dirs[path] = target if ok else None
        return self._linked_dirs[path]

    def _dropin_dir_files(
        self, sysdir: str, real_dir: str
    ) -> list[tuple[str, UnitFile | str | None]]:
        """What the drop-in directory `sysdir` (its real path `real_dir`) offers a unit, in its
        listing's order: (file name, its UnitFile; None when masked; or the message of the
        issue that it is ignored with). Every `*.conf` name hides its name in lower directories,
        whatever it is (a directory, a FIFO, a dangling link): systemd 252 lists drop-ins with
        no check of their kind (conf_files_list_strv, flags 0), then reads nothing of what it
        cannot read as a file. Empty when the directory cannot be read (gone, unreadable), as
        systemd skips it. Read once per scan: what a file is does not depend on the unit."""
        key = (sysdir, real_dir)
        cached = self._dir_files.get(key)
        if cached is not None:
            return cached
        files: list[tuple[str, UnitFile | str | None]] = []
        self._dir_files[key] = files
        try:
            entries = _scan_dir(real_dir)
        except OSError:
            return files
        for fname, kind in entries.items():
            if not fname.endswith(".conf") or fname.startswith("."):
                continue
            if kind & _DIR:
                files.append((fname, f"a directory, {_HIDES}"))
                continue
            if kind & _OTHER:
                files.append((fname, f"not a regular file or a symlink, {_HIDES}"))
                continue
            real, masked = self._resolve(sysdir, real_dir, fname, kind)
            if real is None:
                files.append((fname, f"a symlink that leads nowhere (a loop, too long), {_HIDES}"))
                continue
            st = _stat(real) if kind & _LINK and not masked else None
            if masked or (st is not None and stat.S_ISCHR(st.st_mode)):
                files.append((fname, None))  # masked, as systemd's null_or_empty() says
            elif not kind & _LINK or (st is not None and stat.S_ISREG(st.st_mode)):
                files.append((fname, UnitFile(f"{sysdir}/{fname}", real)))
            elif st is not None:
                files.append((fname, f"links to something that is not a regular file, {_HIDES}"))
            else:
                files.append((fname, f"a symlink that leads nowhere (dangling), {_HIDES}"))
        return files

    def dropins(self, name: str) -> list[UnitFile]:
        """The unit's `*.conf` drop-ins in the order systemd applies them: sorted by file name; a
        file name in a higher-priority directory hides the same name in lower ones. A symlink to
        /dev/null, or what systemd cannot read as a file (a directory, a FIFO, a dangling link:
        `_dropin_dir_files`), hides the name and is left out; an empty file hides it too (and,
        as in systemd's DropInPaths, is listed: it contributes nothing)."""
        chosen: dict[str, UnitFile | None] = {}
        hiding: list[str] = []
        for sysdir, real_dir in self.dropin_dirs(name):
            for fname, found in self._dropin_dir_files(sysdir, real_dir):
                if fname in chosen:
                    continue  # hidden by this name's file (or mask) in a higher directory
                if isinstance(found, str):  # ignored: said where a unit would have read it
                    self._issue(f"{sysdir}/{fname}", found)
                    found = None  # applies nothing, and hides its name as a mask does
                if found is None:
                    hiding.append(f"{sysdir}/{fname}")
                chosen[fname] = found
        self._hiding[name] = hiding
        # by the names' bytes, as systemd's strcmp(3): a name that is not UTF-8 holds lone
        # surrogates (U+DC80 for the byte 0x80), which sort after `é` (0xC3 0xA9) as text
        ordered = sorted(chosen.items(), key=lambda item: os.fsencode(item[0]))
        return [f for _n, f in ordered if f is not None]

    def hiding_dropins(self, name: str) -> list[str]:
        """The system paths of the unit's drop-in names that `dropins` leaves out and that hide
        their name in lower directories (a symlink to /dev/null, a directory, a dangling link):
        one named as the generator's gate hides the gate (annotations._gate_removed)."""
        if name not in self._hiding:
            self.dropins(name)
        return self._hiding[name]


def find_fragment(name: str, root: str | os.PathLike[str] = "/") -> Fragment | None:
    return UnitIndex(root).fragment(name)


def find_dropins(name: str, root: str | os.PathLike[str] = "/") -> list[UnitFile]:
    return UnitIndex(root).dropins(name)


def list_unit_names(root: str | os.PathLike[str] = "/") -> list[str]:
    return UnitIndex(root).unit_names()
