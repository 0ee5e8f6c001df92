"""Whether only root can change what gpuslice's gate runs with as root.

gpuslice's gate runs as `ExecStartPre=+`: as root, without `User=`, capabilities and most of
the unit's sandbox, but with the unit's environment (`EnvironmentFile=` included), working
directory, root directory and mounts (systemd v252's apply_mount_namespace, in
src/core/execute.c, passes RootDirectory=/RootImage= unless RootDirectoryStartOnly=yes, the
bind mounts, TemporaryFileSystem=, MountImages=, ExtensionImages= and ExtensionDirectories=
to every command, `+` or not; only ReadOnlyPaths=, InaccessiblePaths=, ProtectSystem= and the
like wait on `needs_sandboxing`). A unit with `User=asr` (or `DynamicUser=yes`) whose
environment file asr can change ran nothing as root before gpuslice gated it; once gated,
asr's `LD_PRELOAD=` runs in the gate's root shell (the dynamic loader acts before the gate
can). So is a root-written `LD_LIBRARY_PATH=/home/asr/lib`: the loader takes asr's
libc.so.6, and a root-written `LD_DEBUG_OUTPUT=/srv/asr/dbg` has the loader create files as
root in whatever directory asr's symlink there leads to. Such a unit is not managed:
`EnvFileChecker.check` says why, for each file, each loader variable (`LOADER_PATHS`),
each variable that names where the gate's programs write (`OUTPUT_PATHS`) and each with which
they exit 0 at once, the gate passed without asking (`SKIPS_GATE`), and
`annotations.Loader` makes that an error on the unit (no gate). A unit that runs as root is
checked for `SKIPS_GATE` alone (its environment files read where they are root's alone, and
one someone else can change refused: they could set one at any time): its own processes
already load what those paths name, as root (and write where they say, as root), but a gate
that exits 0 unasked let it run ungated without a word; a root template's file that an
instance's name, chosen by whoever starts it, can lead elsewhere is refused too
(`EnvFileChecker._by_instance`), as is a word of its environment not worked out that may
set one (`_may_skip`). A root directory
or mount of any gated unit that replaces or hides what the gate runs or talks through
(`GATE_PATHS`) is an error too: a user's files there would run as root, and a hidden bus or
pipe holds the start for ever without a word.

A file is root's alone when every component of its path, walked from / with symlinks followed
(the link's directory, then its target's components), is owned by UID 0 and writable by no
group but GID 0 (without an access ACL) and by no one else (a sticky world-writable directory
such as /tmp included), on no FUSE file system a user mounted (it shows whatever owner
its program likes) nor one whose kernel lets others write whatever it shows (`_UNCHECKED`),
and at or under no mount point /etc/fstab lets users mount on (`user`: a USB stick of
theirs), nor where such a mount point's own symlink leads (an fstab not read whole refuses
every path, as do a user mount point someone but root may put a symlink on the way to, one
under another (a symlink on the stick mounted there leads it anywhere) and a
/proc/self/mountinfo that cannot be read or does not answer: a FUSE a user mounted would be
taken for root's). A
file that does not exist is fine when the deepest directory that does is root's alone, so
that only root can make it. A path under `USER_TREES` is refused whatever
it holds, and nothing in it is looked at: users make files there, /home may not be mounted
yet when systemd runs the generator at boot (its empty mount point looks like root's), and
an automounted or network home that does not answer would hang the walk. Whatever cannot be
checked (a specifier whose value is not known here, a relative path, a wildcard, a loop of
symlinks, a FIFO, a path longer than systemd takes) is refused too, with the reason.

Paths are system paths, looked up under the scan's root (tests use a temporary directory, as
`unitfiles.UnitIndex` does). Only lstat(2), readlink(2), getxattr(2) and, for a loader
directory, listdir are used; besides /proc/self/mountinfo and /etc/fstab (once per scan),
only an environment file is opened (O_NONBLOCK, so a FIFO cannot block), once the walk found
it a regular file root's alone, to read its loader variables. A loader directory is root's
alone with everything in it, at any depth (symlinks followed), at most `MAX_TREE` entries.
Results are cached for the checker's life (one scan): 10,000 units that share one file cost
one walk. Pure stdlib + `unitfiles`,
`envsyntax`, `paths`; `check` never raises.

A file system elsewhere (NFS at /srv/nfs, /mnt, /data) may not answer either, and a hung
lstat would hang the generator (systemd kills it: no unit gated, as it plans every unit
before writing any drop-in) or a controller's scan (no later annotation change taken in).
So each system call of the walk on a file system mounted under the root (/proc/self/
mountinfo, polled: a mount made during the scan is seen) runs on a daemon thread and is
waited for at most `DEADLINE` seconds: one that does not answer refuses its path, and every
later path under the same mount point is refused without asking: a hung mount costs one
deadline per scan, however many units name files on it. The thread stuck in the kernel is
left there; a daemon, it never holds up the process's exit. It is remembered process-wide
(`_STUCK`) under that mount point: until it returns, every later scan refuses the paths under
that mount point at once, without a call (the controller rescans at each daemon-reload, and a
new call each time would leave one more stuck thread each: a daemon-reload loop during an NFS
outage grew the controller's threads without bound); once it returns, the next scan asks that
file system again. Calls on the root's own file system (/etc: most environment files) are
made directly, as the unit files are read from it without a deadline: were it not to answer,
the scan would hang on those first.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import select
import stat
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from gpuslice import envsyntax
from gpuslice.envsyntax import PATH_MAX  # systemd ignores a longer EnvironmentFile=
from gpuslice.paths import DEFAULT_RUNTIME_DIR, LIBEXEC_DIR
from gpuslice.safefile import file_kind, has_access_acl
from gpuslice.unitfiles import MAX_FILE_SIZE, Entry, is_instance, is_template, printable

T = TypeVar("T")

# Where users make files, or file systems are mounted after the generator ran at boot.
USER_TREES: tuple[str, ...] = (
    "/home",
    "/run/user",
    "/tmp",
    "/var/tmp",
    "/dev/shm",
    "/media",
    "/run/media",
)
MAX_SYMLINKS = 32  # systemd's chase limit (the kernel's is 40)
MAX_STEPS = 1024  # components walked, symlinks' targets included: no real path comes near
# systemd's specifiers whose value is fixed for the system manager (systemd.unit(5))
_SYSTEM_DIRS = {
    "t": "/run",
    "S": "/var/lib",
    "C": "/var/cache",
    "L": "/var/log",
    "E": "/etc",
    "T": "/tmp",
    "V": "/var/tmp",
}
_NAME_SPECIFIERS = "nNpPiIjJ"
_BY_INSTANCE = "nNiI"  # in a template, these depend on the instance, chosen at each start
# and these, which gpuslice does not work out: %f is %I after a `/` (what it unescapes may be
# `\\.\\.`, `..` to glob(3)), %d the credentials' directory, the unit's name in it
_HOLD_INSTANCE = "fd"
# the specifiers whose value never holds a `=`, whatever the instance: the unit's name or a
# part of it as written (unit_name_is_valid: [a-zA-Z0-9:_.\@-] alone), and the credentials'
# directory, /run/credentials/ and the name (%I and %f unescape it: `\x3d` is `=`)
_NO_EQUALS = "nNijpd"
# a bracket expression with more `]` after it than this, where it may be a dot, is taken for
# `..` maybe: each is tried as its end, and each reading may hold another (root's patterns)
BRACKET_ENDS_MAX = 8
_WILDCARDS = "*?[\\"  # systemd globs EnvironmentFile= (glob(3) without flags: \ escapes)
# seconds one lstat, readlink or getxattr of the walk may take: a local one takes
# microseconds, a network file system whose server is gone never answers
DEADLINE = 2.0
MOUNTINFO = "/proc/self/mountinfo"  # which file system a path is on
# where mount(8) lets users mount a file system of theirs (a USB stick, whose files show
# whatever owner and mode they were made with elsewhere), at any time: the entries with one
# of `USER_MOUNTS` among their options, not cleared by its `no` form after it
FSTAB = "/etc/fstab"
USER_MOUNTS = frozenset({b"user", b"users", b"owner", b"group"})

# The variables whose paths the gate's programs load code from as root before its script can
# act: glibc's dynamic loader (every program: /bin/sh first), and the locale and gconv modules
# of a /bin/sh that sets its locale at start (bash does, dash does not). Name -> (whether it
# lists directories, its separators: glibc's). An empty directory element is the current
# directory; an empty file element is skipped. DBUS_SYSTEM_BUS_ADDRESS, read by dbus-send
# only once the script runs, never reaches it: the gate runs each program with `env -i`.
LOADER_PATHS: dict[str, tuple[bool, str]] = {
    "LD_LIBRARY_PATH": (True, ":;"),
    "LD_PRELOAD": (False, " :"),
    "LD_AUDIT": (False, ":"),
    "GCONV_PATH": (True, ":"),
    "LOCPATH": (True, ":"),
}
# The variables whose paths the gate's programs write to as root, whatever else is set:
# the dynamic loader's debug output (LD_DEBUG_OUTPUT=F, with LD_DEBUG=: F.PID, each program
# its own) and profile (LD_PROFILE=LIB: LIB.profile in LD_PROFILE_OUTPUT's directory,
# /var/tmp where that is unset or empty: `PROFILE_DIR`). The loader opens them O_NOFOLLOW,
# but the directories on the way are followed: a user who can change one has root create
# or append to a file where they choose, /etc included. Name -> the file written, `{}`
# being the value. Of glibc's other "unsecure" variables (unsecvars.h), none names a path
# the gate's programs open: MALLOC_TRACE (mtrace(3), which none calls), NLSPATH (catopen),
# TMPDIR, TZDIR, HOSTALIASES, LOCALDOMAIN, RES_OPTIONS, GETCONF_DIR and LD_ORIGIN_PATH (read
# only without /proc) are used by none of /bin/sh, dbus-send, sleep and systemctl as the
# gate runs them, the rest (LD_BIND_NOW, MALLOC_ARENA_MAX, GLIBC_TUNABLES, ...) name no
# path, and a LANG=, LC_*= or LANGUAGE= that is a path is looked for under the locale
# directories (glibc 2.36: /usr/lib/locale//home/asr/x/LC_CTYPE).
OUTPUT_PATHS: dict[str, str] = {
    "LD_DEBUG_OUTPUT": "{}.PID",
    "LD_PROFILE_OUTPUT": "{}/LIBRARY.profile",
}
PROFILE_DIR = "/var/tmp"  # glibc's LD_PROFILE_OUTPUT where it is unset or empty (not secure)
# The variables with which the gate's programs exit 0 at once, doing nothing: the gate's shell
# then "succeeds" without asking, and a job they do not stop (a static binary) runs ungated,
# on GPUs another job holds. glibc's loader lists the libraries of the program it was to run
# (LD_TRACE_LOADED_OBJECTS, ldd's way: whatever its value, empty included; before glibc 2.36,
# Ubuntu 22.04's and RHEL 9's, LD_TRACE_PRELINKING too) or LD_DEBUG's options (`help` among
# them), and bash, /bin/sh on Fedora, RHEL and Arch, takes SHELLOPTS from the environment, as
# sh too: with `noexec` it reads the gate without running it, with `onecmd` it runs the
# gate's first command (PATH=...) and exits with its status, 0. Name -> (the words that do
# it, none for any value; the separators of the words, the program's).
# Exported functions (BASH_FUNC_dbus-send%%=, which bash as sh imports) never get there:
# systemd drops a name that is not letters, digits and `_` (envsyntax.is_env_name).
SKIPS_GATE: dict[str, tuple[frozenset[str], str]] = {
    "LD_TRACE_LOADED_OBJECTS": (frozenset(), ""),
    "LD_TRACE_PRELINKING": (frozenset(), ""),
    "LD_DEBUG": (frozenset({"help"}), " ,:"),
    "SHELLOPTS": (frozenset({"noexec", "onecmd"}), ":"),
}
_SKIPS_HOW = {
    "LD_TRACE_LOADED_OBJECTS": "glibc's loader lists a program's libraries and exits 0 "
    "instead of running it, whatever the value",
    "LD_TRACE_PRELINKING": "glibc's loader before 2.36 lists a program's libraries and exits "
    "0 instead of running it, whatever the value",
    "LD_DEBUG": "glibc's loader prints LD_DEBUG's options and exits 0 instead of running "
    "the program",
    "SHELLOPTS": "a /bin/sh that is bash reads the gate without running it (noexec), or "
    "runs its first command alone (onecmd), and exits 0",
}
# every variable `check` works out the value of
_WATCHED = frozenset({*LOADER_PATHS, *OUTPUT_PATHS, *SKIPS_GATE, "LD_PROFILE"})
MAX_TREE = 10_000  # entries of a loader directory and its subdirectories, walked per scan
MAX_ENV_FILE = MAX_FILE_SIZE  # systemd reads more; no real environment file comes near it
# What the gate (its PATH's programs, their libraries and the loader's own files, the bus,
# systemctl's socket, the gate's pipe, the gate itself) needs to find as the host has it. A
# component ending in `*` stands for every name that starts with what is before it.
GATE_PATHS: tuple[str, ...] = (
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
    "/lib*",
    "/usr/lib*",
    "/usr/local/lib*",
    "/etc/ld.so.preload",
    "/etc/ld.so.cache",
    "/run/dbus",
    "/var/run",  # libdbus's default bus address is under it (a symlink to /run)
    "/run/systemd",
    DEFAULT_RUNTIME_DIR,
    LIBEXEC_DIR,
    "/proc",
    "/sys",
)
GATE_USES = (
    "where gpuslice's gate finds the programs and libraries it runs as root, or its way to "
    "the controller"
)
_MOUNTINFO_MANGLED = re.compile(rb"\\([0-7]{3})")  # the kernel writes " \t\n\\" as \ooo
_FSTAB_BLANKS = re.compile(rb"[ \t]+")  # what separates fstab's fields, as for libmount


class Assignment(NamedTuple):
    """One assignment of a setting collected in `RunAs`: where it is and what it says."""

    path: str
    line: int
    value: str


# the settings that add mounts to a command of ExecStartPre=+ too (systemd v252's
# apply_mount_namespace passes them whatever the command's flags), each a list an empty
# assignment resets
MOUNT_KEYS = (
    "BindPaths",
    "BindReadOnlyPaths",
    "TemporaryFileSystem",
    "MountImages",
    "ExtensionImages",
    "ExtensionDirectories",
)
ROOT_KEYS = ("RootDirectory", "RootImage")  # last wins, an empty one resets
RUN_AS_KEYS = frozenset(
    {
        "User",
        "DynamicUser",
        "EnvironmentFile",
        "Environment",
        "UnsetEnvironment",
        "RootDirectoryStartOnly",
        *MOUNT_KEYS,
        *ROOT_KEYS,
    }
)
_ROOT_USERS = frozenset({"root", "0"})
_FALSE = frozenset({"0", "no", "n", "false", "f", "off"})
_TRUE = frozenset({"1", "yes", "y", "true", "t", "on"})


@dataclass
class RunAs:
    """The `[Service]` settings that decide what the gate runs with as root: `User=` (last
    wins, empty resets), `DynamicUser=`, `EnvironmentFile=`, `Environment=`,
    `UnsetEnvironment=` and the mount lists (each appends, an empty one resets the list),
    `RootDirectory=`/`RootImage=` (last wins, empty resets) and `RootDirectoryStartOnly=`.
    Collected while the unit's files are read, in order; values are parsed by `check`, which
    knows the unit's name (specifiers)."""

    user: str = ""
    dynamic: bool = False
    env_files: list[Assignment] = field(default_factory=list)
    environment: list[Assignment] = field(default_factory=list)
    unset: list[Assignment] = field(default_factory=list)
    mounts: dict[str, list[Assignment]] = field(default_factory=dict)
    roots: dict[str, Assignment] = field(default_factory=dict)
    start_only: bool = False

    def assign(self, path: str, entry: Entry) -> None:
        key, value = entry.key, entry.value
        lists = {
            "EnvironmentFile": self.env_files,
            "Environment": self.environment,
            "UnsetEnvironment": self.unset,
        }
        if key == "User":
            self.user = value
        elif key == "DynamicUser":
            # systemd ignores a bad value and keeps the last: taken as yes here, which only
            # adds a check
            self.dynamic = value.lower() not in _FALSE
        elif key == "RootDirectoryStartOnly":
            # a bad value is ignored, the last good one kept; only a yes spares the gate
            if value.lower() in _TRUE | _FALSE:
                self.start_only = value.lower() in _TRUE
        elif key in ROOT_KEYS:
            if value == "":
                self.roots.pop(key, None)
            else:
                self.roots[key] = Assignment(path, entry.line, value)
        elif key in lists or key in MOUNT_KEYS:
            found = lists[key] if key in lists else self.mounts.setdefault(key, [])
            if value == "":
                found.clear()
            else:
                found.append(Assignment(path, entry.line, value))

    def other_user(self) -> bool:
        """Whether the unit runs as a user other than root (a specifier in `User=` counts)."""
        return self.dynamic or (self.user != "" and self.user not in _ROOT_USERS)


# what an admin does about a refusal, ending its message
FIX_OWNERS = "until only root can change that file and its directories"
FIX_PATH = "until it names, by an absolute path, a file only root can change"
FIX_TREE = "until it names a file elsewhere, that only root can change"
FIX_ANSWER = "until that file system answers at a later scan (systemctl daemon-reload)"
FIX_LOADER = (
    "until only root can change each path it names (a directory and everything in it), "
    "named by an absolute path"
)
FIX_OUTPUT = "until it names, by an absolute path, a place only root can change"
FIX_SKIPS = "until its environment does not set it so"
FIX_MOUNT = "until none of its mounts lands on, in or above a path the gate uses"
FIX_DESTINATION = (
    "until each bind lands on a path only root can change (or on its own source, which shows "
    "what is there)"
)
FIX_ROOT = "until RootDirectoryStartOnly=yes (the gate then runs outside it)"
FIX_IMAGES = "until it has none (gpuslice does not look into images)"
FIX_FSTAB = f"until {FSTAB} can be read whole"
FIX_MOUNTINFO = f"until {MOUNTINFO} can be read"
FIX_USER_POINT = (
    f"until each mount point {FSTAB} lets users mount on is in a directory only root can change"
)
FIX_INSTANCE = (
    "until an instance's name can only name a file in a directory only root can change (%i in "
    "the file's name, as /etc/job/%i.env; not %I)"
)


# the refusals of a file someone but root can change (or that did not answer, or with FSTAB
# not read whole or a user mount point someone may redirect, where users may mount unknown:
# its text not known): one of a unit run as
# root too, where that someone could set `SKIPS_GATE` at any time
_ANYONES = frozenset({FIX_OWNERS, FIX_TREE, FIX_ANSWER, FIX_FSTAB, FIX_MOUNTINFO, FIX_USER_POINT})
# the fixes a walk's refusal keeps wherever it is met: no path named elsewhere fixes them
_KEEP_FIX = (FIX_ANSWER, FIX_FSTAB, FIX_MOUNTINFO, FIX_USER_POINT)


class Refusal(NamedTuple):
    """Why one setting is refused, and what fixes it (`FIX_*`)."""

    reason: str
    fix: str


class Finding(NamedTuple):
    """A refused assignment: its file, line, key and the whole message; `public`, the message
    as anyone but root is shown it where `message` quotes an environment file's text (""
    where it does not: the same)."""

    path: str
    line: int
    message: str
    key: str = "EnvironmentFile"
    public: str = ""


def _unescape(text: str) -> str | None:
    """systemd's unit_name_unescape: `-` is `/`, `\\xNN` a byte (kept as a surrogate when
    not ASCII, so that the file system sees that byte). None for a bad escape."""
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "-":
            out.append("/")
        elif c == "\\":
            code = text[i + 2 : i + 4]
            if text[i + 1 : i + 2] != "x" or len(code) != 2:
                return None
            try:
                byte = int(code, 16)
            except ValueError:
                return None
            out.append(chr(byte) if byte < 0x80 else chr(0xDC00 + byte))
            i += 3
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _name_parts(unit: str) -> dict[str, str | None]:
    """The values of the name specifiers; None where unescaping fails."""
    dot = unit.rfind(".")
    at = unit.find("@")
    prefix = unit[:at] if at > 0 else unit[:dot]
    instance = unit[at + 1 : dot] if is_instance(unit) else ""
    last = prefix[prefix.rfind("-") + 1 :]
    return {
        "n": unit,
        "N": unit[:dot],
        "p": prefix,
        "P": _unescape(prefix),
        "i": instance,
        "I": _unescape(instance),
        "j": last,
        "J": _unescape(last),
    }


def expand(unit: str, value: str) -> tuple[str, None] | tuple[None, str]:
    """`value` with its specifiers expanded, or why it cannot be (systemd's specifier_printf:
    `%%` is `%`, a lone `%` at the end stays)."""
    if "%" not in value:
        return value, None
    names: dict[str, str | None] | None = None
    out: list[str] = []
    i = 0
    while i < len(value):
        c = value[i]
        if c != "%" or i + 1 == len(value):
            out.append(c)
            i += 1
            continue
        spec = value[i + 1]
        i += 2
        if spec == "%":
            out.append("%")
        elif spec in _SYSTEM_DIRS:
            out.append(_SYSTEM_DIRS[spec])
        elif spec in _NAME_SPECIFIERS:
            if spec in _BY_INSTANCE and is_template(unit):
                return None, (
                    f"%{spec} depends on the instance's name, which whoever starts an "
                    f"instance of {unit} chooses, so the file cannot be checked for every "
                    "instance"
                )
            names = names or _name_parts(unit)
            part = names[spec]
            if part is None:
                return None, f"%{spec} of {unit} cannot be unescaped"
            out.append(part)
        else:
            return None, (
                f"the specifier %{printable(spec)} has a value gpuslice does not work out "
                "(it knows %n %N %p %P %i %I %j %J %t %S %C %L %E %T %V %%)"
            )
    return "".join(out), None


def _pairs(text: str) -> Iterator[str]:
    """`text` in the pieces `expand` reads it in: a `%` with the character after it (a
    specifier, `%%` included, `%=` too), or one other character (a lone `%` at the end)."""
    i = 0
    while i < len(text):
        piece = text[i : i + 2] if text[i] == "%" else text[i]
        yield piece
        i += len(piece)


def _specifiers(value: str) -> set[str]:
    """The specifiers `value` holds, as `expand` reads them (`%%` is none)."""
    return set(re.findall(r"%(.)", value, re.DOTALL)) - {"%"}


def _varies(part: str) -> bool:
    """Whether the path component `part` differs by instance (the name stands as a NUL in it:
    `EnvFileChecker._by_instance`) or holds a wildcard."""
    return "\0" in part or any(c in part for c in _WILDCARDS)


def _may_be_up(part: str) -> bool:
    """Whether the path component `part` (as `_varies`) may be `..` as glob(3) reads it (no
    GLOB_PERIOD): an instance's name (a NUL in it: `.`, `..` or `\\.\\.`, chosen by whoever
    starts it) with dots, or a wildcard that matches `..`: `.*`, `.?`, `.[.]` (glibc's glob
    lists `.` and `..`; systemd's safe_glob skips them, an older systemd's glob(3) did not) and
    `\\.\\.` (no wildcard: unescaped and used as it is, `..`, by both), as is `..\\` before
    a `/` (glob(3) drops the `\\`). A leading dot is matched by a dot alone (`*`, `?`, `[.]`
    match none there). A bracket expression is one character, a dot maybe whatever it holds
    (`.[[:alpha:]]` too: refused, never `..` to glibc, but a rule that reads brackets as
    glibc does is glibc's fnmatch_loop.c again), and the rest is read from each `]` that may
    end it."""
    pattern: list[str] = []
    i = 0
    while i < len(part):
        c = part[i]
        i += 1
        if c == "\0":
            pattern.append(".*")  # any name: a `\\` it ends with only makes the next literal
        elif c == "\\" and i < len(part):
            pattern.append(re.escape(part[i]))
            i += 1
        elif c == "\\":
            pass  # last, before a `/`: glob(3) drops it (`..\\/x` is `../x`)
        elif c in "*?[" and i == 1:
            return False  # no leading dot
        elif c == "*":
            pattern.append(".*")
        elif c == "?":
            pattern.append(".")
        elif c == "[":
            if re.match(f"{''.join(pattern)}.", "..", re.DOTALL) is None:
                return False  # a third character (or a second after one not a dot)
            if "\0" in part[i:]:
                return True  # where it ends, and what follows, is the instance's to say
            # one character, a dot maybe, whatever it holds; it ends at one of the `]` after
            # it, which one glibc's fnmatch(3) says as it reads what matched (`.[.[:Alpha:]`
            # is `..`): each is tried. None: the `[` is itself, never a dot
            ends = [j + 1 for j in range(i, len(part)) if part[j] == "]"]
            if len(ends) > BRACKET_ENDS_MAX:
                return True
            return any(_may_be_up(f"{part[: i - 1]}?{part[e:]}") for e in ends)
        else:
            pattern.append(re.escape(c))
    return re.fullmatch("".join(pattern), "..", re.DOTALL) is not None


def _dropped(unit: str, word: str) -> bool:
    """Whether systemd drops the `Environment=` word `word` of `unit`, its specifiers not all
    worked out, whatever they turn out to be: it holds no `=`, nor can one of them make one
    (`_NO_EQUALS`, or one `expand` works out). systemd v252's config_parse_environ expands
    a word's specifiers, then ignores it where it is no assignment (`LD_%i`: `LD_x`), so
    it sets nothing, whoever starts the instance."""
    known = ["x" if piece[1:] and piece[1] in _NO_EQUALS else piece for piece in _pairs(word)]
    text, _ = expand(unit, "".join(known))
    return text is not None and "=" not in text


def _may_skip(unit: str, word: str) -> str | None:
    """Why the `Environment=` word `word` of `unit`, its specifiers not all worked out, may
    have the gate exit 0 unasked (`SKIPS_GATE`) whoever it runs as, or None. Its name not
    worked out may be any of them its known part allows (`%i=1`:
    b@LD_TRACE_LOADED_OBJECTS.service; not `JOB_%i=1`: `_names_it_may_be`); one that
    skips whatever its value does so (`LD_TRACE_LOADED_OBJECTS=%h`); one that skips with a
    word of its value (`LD_DEBUG`, `SHELLOPTS`) may have it from the instance's name, which
    whoever starts an instance chooses (`LD_DEBUG=%i`: a@help.service; polkit can let others
    than root start one), as may %f (%I after a `/`) and %d (the credentials' directory, the
    instance's unit name in it). Another specifier not known is the unit's own (root's %h)."""
    i = 0
    for piece in _pairs(word):
        if piece == "=":  # `%=` is a specifier, no `=`
            break
        i += len(piece)
    name, value = word[:i], word[i + 1 :]
    text, why = expand(unit, name)
    if text is None:
        names = _names_it_may_be(unit, name)
        if not names:
            return None  # `JOB_%i`: none of them, whatever the instance
        return (
            f"its name is not worked out ({why}), and may be one with which the gate's "
            f"programs exit 0 at once ({', '.join(names)})"
        )
    if text not in SKIPS_GATE:
        return None
    if not SKIPS_GATE[text][0]:
        return f"{_SKIPS_HOW[text]}, and its value is not worked out ({expand(unit, value)[1]})"
    by_instance = _specifiers(value) & set(_BY_INSTANCE + _HOLD_INSTANCE)
    if not by_instance or not is_template(unit):
        return None
    spec = sorted(by_instance)[0]
    return (
        f"%{spec} is the instance's name, or holds it, which whoever starts an instance of "
        f"{printable(unit)} chooses, and {_SKIPS_HOW[text]} where one of its words is "
        f"{' or '.join(sorted(SKIPS_GATE[text][0]))}"
    )


def _names_it_may_be(unit: str, name: str) -> list[str]:
    """The `SKIPS_GATE` names the `Environment=` name `name` of `unit` may be, each specifier
    `expand` does not work out standing for any text: `%i=1` any, `LD_TRACE_%i=1` two,
    `JOB_%i=1` none (its name is JOB_ and the instance's, whatever that is)."""
    pattern: list[str] = []
    for piece in _pairs(name):
        text, _ = expand(unit, piece)  # a character alone (a lone `%` too) is itself
        pattern.append(".*" if text is None else re.escape(text))
    return [known for known in SKIPS_GATE if re.fullmatch("".join(pattern), known, re.DOTALL)]


def _is_pattern(path: str) -> bool:
    """Whether systemd reads the absolute path `path` as a glob pattern."""
    return path.startswith("/") and any(c in path for c in _WILDCARDS)


def _leads_out(path: str) -> tuple[str, bool]:
    """The directory every file the system path `path` may name is under (an instance's name
    a NUL in it, or a glob pattern): its components before the first that the name (or a
    wildcard) makes; and whether a directory after it may be `..` (`_may_be_up`), which
    leads out of it (the file itself never does: `..` is a directory, which systemd cannot
    read)."""
    parts = path.split("/")
    first = next((i for i, part in enumerate(parts) if _varies(part)), len(parts))
    return "/".join(parts[:first]) or "/", any(_may_be_up(part) for part in parts[first:-1])


def _user_tree(path: str) -> str | None:
    for tree in USER_TREES:
        if path == tree or path.startswith(tree + "/"):
            return tree
    return None


class _Reached(NamedTuple):
    """Where a walk led: `real`, the system path with symlinks followed, and its lstat
    (None: not there)."""

    real: str
    st: os.stat_result | None


class _Value(NamedTuple):
    """A loader variable's value as the gate would get it (None: `unknown` says why it
    cannot be told), the assignment that set it, and the environment file it came from, as
    `_named` names it ("": the assignment's own)."""

    value: str | None
    assignment: Assignment
    file: str
    unknown: str
    # a value not worked out that may have the gate exit 0 unasked (`_may_skip`): refused in
    # a unit run as root too
    skips: bool = False


class _Unanswered(NamedTuple):
    """A system call that did not answer within `DEADLINE`, or one not made because an
    earlier one did: `where` is the mount point of that one's file system (its own path when
    the mount table cannot be read), under which nothing more is asked."""

    where: str


class _Worker:
    """A daemon thread that makes one call at a time, handed over through two locks (a
    call costs two thread switches, not a thread)."""

    def __init__(self) -> None:
        self.go = threading.Lock()
        self.go.acquire()
        self.done = threading.Lock()
        self.done.acquire()
        self.call: tuple[Callable[[str], Any], str] | None = None
        self.answer: Any = None
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="gpuslice-envsafety", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.go.acquire()
            if self.stopped or self.call is None:
                return
            fn, arg = self.call
            try:
                self.answer = fn(arg)
            except BaseException as e:  # handed to the caller's thread
                e.__traceback__ = None  # frames of this thread: nothing to keep
                self.answer = e
            self.call = None
            self.done.release()

    def stop(self) -> None:
        """Ends the thread once it is free: now when idle, else when its call returns."""
        if not self.stopped:
            self.stopped = True
            # a call handed over, not yet taken (go not held): the thread sees `stopped`
            with contextlib.suppress(RuntimeError):
                self.go.release()


class _StuckWorkers:
    """Workers whose call did not answer, process-wide (every checker's: a scan's, the next
    scan's, `checkpoint.check_tool`'s), by the real path under which they were stuck: the
    mount point of that call's file system (its own path without a mount table), or
    MOUNTINFO. At most one per path: while one has not returned, nothing under its path is
    asked again. Scans run on threads of their own (`asyncio.to_thread`): one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}

    def under(self, real: str) -> str | None:
        """The path of a worker still stuck at or above the real path `real`, or None;
        those whose call has returned since (their thread ended) are forgotten."""
        with self._lock:
            for where, worker in list(self._workers.items()):
                if not worker.thread.is_alive():
                    del self._workers[where]
                elif real == where or real.startswith(where + "/"):
                    return where
        return None

    def add(self, where: str, worker: _Worker) -> None:
        with self._lock:
            self._workers[where] = worker


_STUCK = _StuckWorkers()


class _Caller:
    """Calls made on a `_Worker`, each waited for at most `DEADLINE` s. A worker whose call
    did not answer is stopped (it ends when the kernel lets it go), remembered in `_STUCK`,
    and the next call gets a new one."""

    def __init__(self) -> None:
        self._worker: _Worker | None = None

    def call(self, fn: Callable[[str], T], arg: str, where: str) -> T | None:
        """fn(arg) (never None here), or None when it did not answer (the worker then kept
        in `_STUCK` under the real path `where`); an exception of fn's is raised here."""
        worker = self._worker
        if worker is None:
            worker = self._worker = _Worker()
        worker.call = (fn, arg)
        worker.go.release()
        if not worker.done.acquire(timeout=DEADLINE):
            worker.stop()
            self._worker = None
            _STUCK.add(where, worker)
            return None
        answer: T | BaseException = worker.answer
        worker.answer = None
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None


class _MountTable:
    """The mount points under a root (system paths, the root's own left out), read through
    `caller` at the first use; None when the table cannot be read (`unknown` says why). The
    file stays open and is polled before each use: the kernel flags it at each mount and
    unmount, and it is read again."""

    def __init__(self, caller: _Caller, root: str) -> None:
        self._caller = caller
        self._root = root
        self._fd: int | None = None
        self._poll: select.poll | None = None
        self._points: set[str] | None = None
        # FUSE file systems a user mounted (`_user_mounts`), by mount point, as last read
        self.users: dict[str, int] = {}
        # file systems whose kernel does not check what their files show (`_unchecked_mounts`)
        self.unchecked: dict[str, str] = {}
        # why the table is not known, while `points` is None: a walk then cannot tell a FUSE
        # file system a user mounted, or a cifs `noperm`, from root's own, and is refused
        self.unknown: Refusal | None = None

    def points(self) -> set[str] | None:
        if self._poll is None:
            self._poll = select.poll()
            try:
                self._fd = os.open(MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                self.unknown = _table_unread(_strerror(e))
                return None
            self._poll.register(self._fd, select.POLLPRI)
            self._points = self._read()
        elif self._fd is not None and self.changed():
            self._points = self._read()
        return self._points

    def _read(self) -> set[str] | None:
        # an earlier read that has not returned counts as this one's: no second thread stuck
        table = None
        if _STUCK.under(MOUNTINFO) is None:
            try:
                table = self._caller.call(_read_mount_table, MOUNTINFO, MOUNTINFO)
            except OSError as e:
                self.unknown = _table_unread(_strerror(e))
                return None
        if table is None:
            reason = f"{printable(MOUNTINFO)} did not answer within {DEADLINE:g} s as it was read"
            self.unknown = Refusal(reason, FIX_ANSWER)
            return None
        self.unknown = None
        self.users = _user_mounts(table, self._root)
        self.unchecked = _unchecked_mounts(table, self._root)
        return _mount_points(table, self._root) - {"/"}

    def changed(self) -> bool:
        """Whether the kernel flagged the table since it was last polled."""
        return self._poll is not None and bool(self._poll.poll(0))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class EnvFileChecker:
    """Checks EnvironmentFile= paths under `root`, remembering every lstat and verdict."""

    def __init__(self, root: str | os.PathLike[str] = "/"):
        # the root is the caller's, trusted: a symlink to it is followed once here (its lstat
        # is a link's, mode 0777: every file under it would be refused as anyone's to change)
        self._root = os.path.realpath(root).rstrip("/")
        self._stats: dict[str, os.stat_result | OSError] = {}
        self._links: dict[str, str | OSError] = {}
        self._verdicts: dict[str, Refusal | None] = {}
        self._trees: dict[str, Refusal | None] = {}  # loader directories, with what is in them
        self._entries: dict[str, Refusal | None] = {}  # directories, with what is right in them
        self._listings: dict[str, list[str] | OSError] = {}
        self._texts: dict[str, str | Refusal | None] = {}  # environment files' texts
        # what a value says, and its verdict, by the value (10,000 units alike: one look)
        self._words: dict[str, list[str]] = {}
        # each environment file's `_WATCHED` variables, the last of each (a file shared by
        # 10,000 units, of 100,000 assignments: one pass over them, not one per unit)
        self._pairs: dict[str, dict[str, str]] = {}
        self._loader_verdicts: dict[tuple[str, str, str], Refusal | None] = {}
        self._mount_verdicts: dict[tuple[str, str, bool], Refusal | None] = {}
        # directories found root's alone, by their path without symlinks: a walk to a file in
        # one starts there (10,000 files in one directory: one walk of its parents)
        self._safe_dirs: set[str] = set()
        # where users may mount a file system of theirs (`_fstab_points`), read at the first walk
        self._fstab: frozenset[str] | None = None
        # why every walk is refused: FSTAB not read whole (`_user_mount_points`)
        self._fstab_unknown: Refusal | None = None
        # mount points (system paths) of file systems where a call did not answer (`_Unanswered`)
        self._unanswered: list[str] = []
        self._caller = _Caller()
        self._mounts = _MountTable(self._caller, self._root)
        # the worker thread ends with the checker, and the mount table is closed (neither
        # holds a reference to it)
        weakref.finalize(self, _close, self._caller, self._mounts)

    def check(self, unit: str, run_as: RunAs) -> list[Finding]:
        """A finding for each setting that would let someone other than root choose what
        gpuslice's gate runs as root, or that cannot be checked: for a unit that runs as
        another user, each environment file someone else can change and each loader path
        (`LOADER_PATHS`) or written path (`OUTPUT_PATHS`) of its environment; for every gated
        unit, each variable of its environment that has the gate exit 0 unasked
        (`SKIPS_GATE`: a unit run as root gains nothing by it, but would run ungated without
        a word; its environment files are read where they are root's alone) and each of its
        environment files someone but root can change (or that did not answer: `_ANYONES`),
        who could set such a variable at any time, and each root directory or mount that
        replaces or hides what the gate uses (`GATE_PATHS`). Never raises."""
        findings: list[Finding] = []
        other = run_as.other_user()
        # the environment files found root's alone, in order: (assignment, path, text)
        texts: list[tuple[Assignment, str, str]] = []
        for env_file in run_as.env_files:
            said = other  # whatever the refusal, or only one of `_ANYONES`
            try:
                path, refusal = self._env_file(unit, env_file.value)
                if refusal is not None and not other and path is None and is_template(unit):
                    said, refusal = self._by_instance(unit, env_file.value, refusal)
                elif refusal is not None and not other and path and _is_pattern(path):
                    # a root unit's pattern, not read: said where a directory of it may be
                    # `..`, or where something under where it starts is not root's alone, who
                    # could add a file it matches
                    said, refusal = self._by_pattern(env_file.value, path, refusal)
                if path is not None and refusal is None:
                    text = self._env_text(path)
                    if isinstance(text, Refusal):
                        refusal = _as_written(env_file.value, path, text)
                    elif text is not None:
                        texts.append((env_file, path, text))
            except Exception as e:  # belt and braces: no file may crash a scan
                quoted = printable(env_file.value, 200)
                refusal = Refusal(f"{quoted} cannot be checked ({type(e).__name__})", FIX_PATH)
                said = True  # a root unit's too: whose file it reads is not known
            if refusal is not None and (said or refusal.fix in _ANYONES):
                findings.append(Finding(env_file.path, env_file.line, _message(unit, refusal)))
        spots = [("Environment", a) for a in run_as.environment]
        spots += [("EnvironmentFile", a) for a in run_as.env_files]
        findings += self._guarded(
            unit, spots, self._loader_findings, unit, run_as, texts, not other
        )
        spots = list(run_as.roots.items())
        spots += [(key, a) for key, found in run_as.mounts.items() for a in found]
        findings += self._guarded(unit, spots, self._mount_findings, unit, run_as, other)
        return findings

    def refusal(self, unit: str, value: str) -> Refusal | None:
        """Why the value of one EnvironmentFile= (`-` first when optional) is refused, or None
        when only root can change the file it names."""
        return self._env_file(unit, value)[1]

    def path_refusal(self, path: str) -> Refusal | None:
        """Why the regular file at the system path `path` (no setting's value: no specifier,
        no wildcard) is refused, or None when only root can change it."""
        return self._file(path, printable(path, 200))

    def _env_file(self, unit: str, value: str) -> tuple[str | None, Refusal | None]:
        """The file one EnvironmentFile= names, and why it is refused (None: only root can
        change it)."""
        quoted = printable(value, 200)
        path, why = expand(unit, value[1:] if value.startswith("-") else value)
        if path is None:
            return None, Refusal(f"{quoted} cannot be checked: {why}", FIX_PATH)
        return path, _as_written(value, path, self._file(path, quoted, globbed=True))

    def _file(self, path: str, quoted: str, globbed: bool = False) -> Refusal | None:
        """Why the file at the system path `path` (as written: `quoted`; `globbed`: a
        pattern to systemd) is refused, or None when only root can change it (or make it: it
        is not there)."""
        if "\0" in path:
            return Refusal(f"{quoted} cannot be checked: it holds a NUL", FIX_PATH)
        if not path.startswith("/"):
            return Refusal(
                f"{quoted} is not an absolute path, which gpuslice cannot check", FIX_PATH
            )
        if len(os.fsencode(path)) >= PATH_MAX:
            return Refusal(
                f"{quoted} cannot be checked: longer than {PATH_MAX - 1} bytes", FIX_PATH
            )
        if globbed and any(c in path for c in _WILDCARDS):
            return Refusal(
                f"{quoted} cannot be checked: systemd reads it as a wildcard pattern "
                "(*, ?, [ or \\), which gpuslice does not expand; name each file",
                FIX_PATH,
            )
        if path not in self._verdicts:
            self._verdicts[path] = self._walk(path)
        return self._verdicts[path]

    def _by_instance(self, unit: str, value: str, refusal: Refusal) -> tuple[bool, Refusal]:
        """Whether the refusal of the EnvironmentFile= `value` of the template `unit`, run as
        root, is said (its specifiers not all known: `refusal`), and why. Whoever may start an
        instance (polkit can let others than root) names it: a file that depends on its name
        is said where that name can lead it out of the directory written before it, or where
        something it may name there is not root's alone (they could name a file someone else
        made there: `_names_in`). %I (the name unescaped: `-` is `/`) and %f (the same after
        a `/`; systemd refuses a `..` in it, not `\\.\\.`, which glob(3) reads as `..`) can
        name any file. %i, %n and %N hold no `/`, but %i may be `.` or `..`: a directory after
        it that may be `..` (`_may_be_up`) walks out; the file itself never does (`..` is a
        directory, which systemd cannot read). %P and %J are the template's own name, known.
        Another specifier not known (root's own %h) is not said, as before."""
        bare = value[1:] if value.startswith("-") else value
        quoted = printable(value, 200)
        at = unit.find("@")
        if unescaped := sorted(_specifiers(bare) & {"I", "f"}):
            reason = (
                f"{quoted} cannot be checked: %{unescaped[0]} is the instance's name unescaped"
                f"{' after a `/`' if unescaped[0] == 'f' else ''}, which whoever starts an "
                f"instance of {printable(unit)} chooses: a `-` in it is a `/` "
                f"({printable(unit[:at])}@..-..-home-x.service: ../../home/x), so it can name "
                "any file"
            )
            return True, Refusal(reason, FIX_INSTANCE)
        # the instance's name stands as a NUL, which no unit file's value holds
        path, _ = expand(f"{unit[: at + 1]}\0{unit[at + 1 :]}", bare)
        if path is None or not path.startswith("/") or "\0" in bare:
            return False, refusal
        base, out = _leads_out(path)
        if out:
            reason = (
                f"{quoted} cannot be checked: %i is the instance's name, which whoever starts "
                f"an instance of {printable(unit)} chooses: it may be `.` or `..` "
                f"({printable(unit[:at])}@...service), and the path then leads out of "
                f"{printable(base)}"
            )
            return True, Refusal(reason, FIX_INSTANCE)
        return self._names_in(path, base) is not None, refusal

    def _by_pattern(self, value: str, path: str, refusal: Refusal) -> tuple[bool, Refusal]:
        """Whether the refusal of the EnvironmentFile= `value` of a unit run as root, the
        pattern `path` (`refusal`: not read), is said, and why: where a directory of it may be
        `..` as systemd globs it (`/etc/job/.*/asr/x.env` matches `/etc/job/../asr/x.env`),
        it leads out of the directory before its first wildcard, anywhere; else where
        something it may match there is not root's alone (`_names_in`)."""
        base, out = _leads_out(path)
        if out:
            reason = (
                f"{printable(value, 200)} cannot be checked: systemd reads it as a wildcard "
                "pattern, and a directory of it may be `..` as glob(3) reads it (`.*` matches "
                f"`..`), so it leads out of {printable(base)}"
            )
            return True, Refusal(reason, FIX_PATH)
        return self._names_in(path, base) is not None, refusal

    def _names_in(self, path: str, base: str) -> Refusal | None:
        """Why the files the system path `path` may name (an instance's name a NUL in it, or
        a glob pattern), all under `base` (`_leads_out`), are refused: where only the file's
        own name varies, `base` and each entry right in it (`_entries_of`); else `base` and
        everything under it, however deep (`_tree`)."""
        if (path.rpartition("/")[0] or "/") == base:
            if base not in self._entries:
                self._entries[base] = self._entries_of(base)
            return self._entries[base]
        return self._tree(base)

    def _entries_of(self, path: str) -> Refusal | None:
        """Why the directory at the system path `path` is refused as the one a file whose name
        alone varies is in: someone but root can change it, a directory above it or an entry
        right in it; or None. A directory in it is not looked into (systemd cannot read one,
        and the name holds no `/`): /etc/postgresql, the postgres user's, leaves
        /etc/%i.conf root's alone, which a walk of all of /etc refused."""
        shown = printable(path)
        reached = self._resolve(path, True)
        if isinstance(reached, Refusal):
            return reached
        if reached.st is None or not stat.S_ISDIR(reached.st.st_mode):
            return None  # nothing in it: a file of root's, or not there and only root can make it
        names = self._listdir(reached.real)
        if isinstance(names, _Unanswered):
            return _no_answer(shown, names)
        if isinstance(names, OSError):
            return Refusal(f"{shown} cannot be checked: {_strerror(names)}", FIX_PATH)
        if len(names) > MAX_TREE:
            return Refusal(f"{shown} cannot be checked: more than {MAX_TREE} entries", FIX_PATH)
        for name in sorted(names):
            entry = f"{reached.real.rstrip('/')}/{name}"
            st = self._lstat(entry)
            if isinstance(st, os.stat_result) and stat.S_ISDIR(st.st_mode):
                continue  # a directory itself, no symlink: only root can replace it in `path`
            reached_entry = self._resolve(entry, True)
            if isinstance(reached_entry, Refusal):
                return reached_entry
        return None

    def _env_text(self, path: str) -> str | Refusal | None:
        """The text of the environment file at `path` (found root's alone), None when it is
        not there (systemd then skips it, or fails the start), or why it cannot be read."""
        if path not in self._texts:
            self._texts[path] = self._read_env(path)
        return self._texts[path]

    def _read_env(self, path: str) -> str | Refusal | None:
        shown = printable(path)
        answer = self._ask(_read_head, path)
        if isinstance(answer, _Unanswered):
            return _no_answer(shown, answer)
        if isinstance(answer, OSError):
            if answer.errno in (errno.ENOENT, errno.ENOTDIR):
                return None
            return Refusal(f"{shown} cannot be read: {_strerror(answer)}", FIX_PATH)
        if len(answer) > MAX_ENV_FILE:
            return Refusal(f"{shown} cannot be checked: larger than {MAX_ENV_FILE} bytes", FIX_PATH)
        return answer.decode("utf-8", "surrogateescape")

    def _guarded(
        self,
        unit: str,
        spots: list[tuple[str, Assignment]],
        check: Callable[..., list[Finding]],
        *args: Any,
    ) -> list[Finding]:
        """`check(*args)`, or one finding that says it failed (belt and braces: no unit may
        crash a scan), at the first of the assignments it reads (`spots`: key, assignment)."""
        try:
            return check(*args)
        except Exception as e:
            key, at = spots[0] if spots else ("", Assignment(printable(unit), 0, ""))
            reason = f"{printable(unit)} cannot be checked ({type(e).__name__})"
            message = _message(unit, Refusal(reason, FIX_PATH))
            return [Finding(at.path, at.line, message, key)]

    # -- loader paths

    def _loader_findings(
        self,
        unit: str,
        run_as: RunAs,
        texts: list[tuple[Assignment, str, str]],
        skips_only: bool = False,
    ) -> list[Finding]:
        """A finding for each `LOADER_PATHS` or `OUTPUT_PATHS` variable (or LD_PROFILE=) the
        gate would start with that names a path someone but root can change, and each
        `SKIPS_GATE` one set so: its value as systemd makes it (`Environment=`, in order,
        then each environment file, then `UnsetEnvironment=`). `skips_only` (a unit run as
        root): `SKIPS_GATE` alone, and only a value known to skip the gate."""
        findings: list[Finding] = []
        values: dict[str, _Value] = {}
        for assignment in run_as.environment:
            for word in self._split(assignment.value):
                text, why = expand(unit, word)
                name = (text if text is not None else word).partition("=")[0]
                if text is None and _dropped(unit, word):
                    continue  # no assignment, whatever the instance: systemd drops it
                if text is None:
                    if name in _WATCHED or "%" in name:
                        # systemd knows what gpuslice cannot tell: a LD_* of any value, maybe
                        reason = f"{printable(word, 200)} cannot be checked: {why}"
                        # one run as root: said only where it may skip the gate
                        skips = _may_skip(unit, word) if skips_only else None
                        if skips is not None:
                            reason = f"{printable(word, 200)} cannot be checked: {skips}"
                        values[name] = _Value(None, assignment, "", reason, skips is not None)
                elif name in _WATCHED and (pair := envsyntax.assignment(text)) is not None:
                    values[name] = _Value(pair[1], assignment, "", "")
        for env_file, path, text in texts:
            if path not in self._pairs:
                pairs = envsyntax.parse_env_file(text) or ()
                self._pairs[path] = {n: v for n, v in pairs if n in _WATCHED}
            named = _named(env_file.value, path, ", that is {}")
            for name, value in self._pairs[path].items():
                values[name] = _Value(value, env_file, named, "")
        for unset in run_as.unset:
            for word in self._split(unset.value):
                text, _ = expand(unit, word)
                name, eq, value = (text or "").partition("=")
                found = values.get(name)
                if found is not None and (not eq or found.value == value):
                    del values[name]  # strv_env_delete: a name, or that very assignment
        for name, found in values.items():
            if skips_only and not found.skips and (name not in SKIPS_GATE or found.value is None):
                # its own processes load and write those as root already; a value not
                # worked out that is root's own (%h) may well not skip the gate, and gains
                # no one anything
                continue
            if found.value is None:
                refusal: Refusal | None = Refusal(
                    found.unknown, FIX_SKIPS if found.skips else FIX_PATH
                )
            elif name == "LD_PROFILE" and "LD_PROFILE_OUTPUT" in values:
                refusal = None  # where it writes is LD_PROFILE_OUTPUT's, checked on its own
            else:
                said = (name, found.value, found.file)
                if said not in self._loader_verdicts:
                    self._loader_verdicts[said] = self._loader_refusal(*said)
                refusal = self._loader_verdicts[said]
            if refusal is not None:
                key = "EnvironmentFile" if found.file else "Environment"
                at = found.assignment
                public = ""  # a value of the unit file's own is no secret (systemctl show)
                if found.file:
                    public = _message(unit, _withheld(name, found.file, refusal.fix))
                message = _message(unit, refusal)
                findings.append(Finding(at.path, at.line, message, key, public))
        return findings

    def _split(self, value: str) -> list[str]:
        """The words of an `Environment=`/`UnsetEnvironment=`, split once per scan."""
        if value not in self._words:
            self._words[value] = envsyntax.words(value)
        return self._words[value]

    def _loader_refusal(self, name: str, value: str, file: str) -> Refusal | None:
        """Why the loader path list `name`=`value` (from the environment file `file`, or "")
        is refused, or None when only root can change what it names."""
        where = f" (set in {printable(file)})" if file else ""
        said = f"{name}={printable(value, 200)}{where}"
        if name in SKIPS_GATE:
            words, separators = SKIPS_GATE[name]
            if words and words.isdisjoint(re.split(f"[{re.escape(separators)}]", value)):
                return None
            return Refusal(f"{said}: {_skips_why(name)}", FIX_SKIPS)
        if name not in LOADER_PATHS:
            return self._output_refusal(name, value, said)
        if value == "":
            return None  # an empty list names nothing (glibc ignores it)
        directories, separators = LOADER_PATHS[name]
        if "$" in value:
            return Refusal(
                f"{said}: the dynamic loader expands $ORIGIN, $LIB and $PLATFORM there, to "
                "paths gpuslice does not work out",
                FIX_LOADER,
            )
        for element in re.split(f"[{re.escape(separators)}]", value):
            if element == "" and not directories:
                continue  # skipped: names no file
            if element == "":
                return Refusal(
                    f"{said}: its empty element is the current directory (the unit's "
                    "WorkingDirectory=)",
                    FIX_LOADER,
                )
            if not directories and "/" not in element:
                continue  # a library's name, looked up in the directories checked here
            quoted = printable(element, 200)
            if not element.startswith("/"):
                return Refusal(f"{said}: {quoted} is relative to the current directory", FIX_LOADER)
            if len(os.fsencode(element)) >= PATH_MAX:
                return Refusal(
                    f"{said}: {quoted} cannot be checked: longer than {PATH_MAX - 1} bytes",
                    FIX_LOADER,
                )
            refusal = self._tree(element) if directories else self._file(element, quoted)
            if refusal is not None:
                fix = refusal.fix if refusal.fix in _KEEP_FIX else FIX_LOADER
                return Refusal(f"{said}: {refusal.reason}", fix)
        return None

    def _output_refusal(self, name: str, value: str, said: str) -> Refusal | None:
        """Why the file `name`=`value` has the gate's programs write as root (`OUTPUT_PATHS`;
        LD_PROFILE= without LD_PROFILE_OUTPUT=: in `PROFILE_DIR`) is refused, or None: its
        directory must be root's alone (the file itself is opened O_NOFOLLOW). `said`: the
        assignment, for the message."""
        if name == "LD_PROFILE":
            if value == "":
                return None  # glibc ignores it
            name, value = "LD_PROFILE_OUTPUT", ""
        if value == "" and name == "LD_PROFILE_OUTPUT":
            value = PROFILE_DIR
        written = OUTPUT_PATHS[name].format(value)
        writes = f"{said}: the gate's programs would write {printable(written, 200)} as root"
        if not written.startswith("/"):
            return Refusal(
                f"{writes}, relative to the current directory (the unit's WorkingDirectory=)",
                FIX_OUTPUT,
            )
        if len(os.fsencode(written)) >= PATH_MAX:
            return Refusal(f"{writes}: longer than {PATH_MAX - 1} bytes", FIX_OUTPUT)
        reached = self._resolve(os.path.dirname(written), True)
        if isinstance(reached, Refusal):
            fix = reached.fix if reached.fix in _KEEP_FIX else FIX_OUTPUT
            return Refusal(f"{writes}, and {reached.reason}", fix)
        return None

    def _tree(self, path: str) -> Refusal | None:
        """Why the directory at the system path `path` is refused (someone but root can
        change it, a directory above it or anything in it, however deep), or None."""
        if path not in self._trees:
            self._trees[path] = self._walk_tree(path)
        return self._trees[path]

    def _walk_tree(self, path: str) -> Refusal | None:
        shown = printable(path)
        reached = self._resolve(path, True)
        if isinstance(reached, Refusal):
            return reached
        if reached.st is None or not stat.S_ISDIR(reached.st.st_mode):
            return None  # nothing in it: a file of root's, or not there and only root can make it
        todo = [reached.real]
        seen = {reached.real}
        count = 0
        while todo:
            directory = todo.pop()
            names = self._listdir(directory)
            if isinstance(names, _Unanswered):
                return _no_answer(shown, names)
            if isinstance(names, OSError):
                return Refusal(
                    f"{shown} cannot be checked: {printable(directory)}: {_strerror(names)}",
                    FIX_PATH,
                )
            for name in sorted(names):
                count += 1
                if count > MAX_TREE:
                    return Refusal(
                        f"{shown} cannot be checked: more than {MAX_TREE} entries in it and "
                        "its directories",
                        FIX_PATH,
                    )
                entry = self._resolve(f"{directory.rstrip('/')}/{name}", True)
                if isinstance(entry, Refusal):
                    return entry
                is_dir = entry.st is not None and stat.S_ISDIR(entry.st.st_mode)
                if is_dir and entry.real not in seen:
                    seen.add(entry.real)
                    todo.append(entry.real)
        return None

    # -- mounts

    def _mount_findings(self, unit: str, run_as: RunAs, other: bool) -> list[Finding]:
        """A finding for each root directory, image or mount of the unit's that the gate
        (ExecStartPre=+) gets too and that replaces or hides what it runs or reaches the
        controller through; for a unit of another user, also a bind whose destination that
        user may move there (systemd follows symlinks where a mount lands)."""
        findings: list[Finding] = []

        def add(at: Assignment, key: str, refusal: Refusal) -> None:
            said = printable(at.value, 200)
            message = _mount_message(unit, Refusal(f"{said}: {refusal.reason}", refusal.fix))
            findings.append(Finding(at.path, at.line, message, key))

        if not run_as.start_only:
            for key in ROOT_KEYS:
                if key in run_as.roots:
                    reason = (
                        "gpuslice's gate would run inside it, with its programs and without "
                        "the controller's bus and pipe"
                    )
                    add(run_as.roots[key], key, Refusal(reason, FIX_ROOT))
        for key in ("MountImages", "ExtensionImages", "ExtensionDirectories"):
            for at in run_as.mounts.get(key, ()):
                reason = "what it mounts may replace the programs the gate runs"
                add(at, key, Refusal(reason, FIX_IMAGES))

        def resolve(text: str) -> str | None:
            return expand(unit, text)[0]

        for key in ("BindPaths", "BindReadOnlyPaths", "TemporaryFileSystem"):
            parse = (
                envsyntax.temporary_file_systems
                if key == "TemporaryFileSystem"
                else envsyntax.bind_paths
            )
            binds = other and key != "TemporaryFileSystem"
            for at in run_as.mounts.get(key, ()):
                said = (key, at.value, binds)
                if "%" in at.value:  # specifiers: the unit's own
                    refusal = self._mount_refusal(parse(at.value, resolve), binds)
                elif said in self._mount_verdicts:
                    refusal = self._mount_verdicts[said]
                else:
                    refusal = self._mount_refusal(parse(at.value, resolve), binds)
                    self._mount_verdicts[said] = refusal
                if refusal is not None:
                    add(at, key, refusal)
        return findings

    def _mount_refusal(self, mounts: list[envsyntax.Mount], binds: bool) -> Refusal | None:
        """Why one assignment's mounts are refused, or None. `binds`: a user may change
        what they mount (a bind of another user's unit), so where they land must be
        root's alone, symlinks followed."""
        for mount in mounts:
            if mount.same:
                continue  # a path bound onto itself shows what was there
            if mount.destination is None:
                return Refusal(
                    "a destination has a specifier gpuslice does not work out (it knows "
                    "%n %N %p %P %i %I %j %J %t %S %C %L %E %T %V %%; %i %I %n %N not in a "
                    "template), so where it lands cannot be checked",
                    FIX_MOUNT,
                )
            shown = printable(mount.destination)
            covered = _covered(mount.destination)
            if covered is not None:
                return Refusal(
                    f"its mount at {shown} lands on, in or above {covered}, {GATE_USES}", FIX_MOUNT
                )
            if not binds:
                continue
            reached = self._resolve(mount.destination, True)
            if isinstance(reached, Refusal):
                fix = reached.fix if reached.fix in _KEEP_FIX else FIX_DESTINATION
                reason = f"systemd follows symlinks where a mount lands, and {reached.reason}"
                return Refusal(reason, fix)
            covered = _covered(reached.real)
            if covered is not None:
                real = printable(reached.real)
                return Refusal(
                    f"its mount at {shown} lands at {real} (symlinks followed), on, in or "
                    f"above {covered}, {GATE_USES}",
                    FIX_MOUNT,
                )
        return None

    # -- the walk

    def _real(self, path: str) -> str:
        """Where the system path `path` (absolute) is under the root."""
        return self._root + path if path != "/" else self._root or "/"

    def _lstat(self, path: str) -> os.stat_result | OSError | _Unanswered:
        return self._remembered(self._stats, path, os.lstat)

    def _readlink(self, path: str) -> str | OSError | _Unanswered:
        return self._remembered(self._links, path, os.readlink)

    def _listdir(self, path: str) -> list[str] | OSError | _Unanswered:
        return self._remembered(self._listings, path, os.listdir)

    def _remembered(
        self, seen: dict[str, T | OSError], path: str, ask: Callable[[str], T]
    ) -> T | OSError | _Unanswered:
        """`ask` of the system path `path`, or its OSError, asked once per scan. Never a
        ValueError: `refusal` lets no NUL or unencodable path through, and a symlink's
        target (read as bytes, decoded as the file system's) has neither."""
        found = seen.get(path)
        if found is None:
            answer = self._ask(ask, path)
            if isinstance(answer, _Unanswered):
                return answer  # not kept: its file system is, in `_unanswered`
            found = seen[path] = answer
        return found

    def _ask(self, ask: Callable[[str], T], path: str) -> T | OSError | _Unanswered:
        """`ask` of the system path `path`: on the root's file system directly, else on the
        worker, waited for at most `DEADLINE`; not asked when an earlier call under the same
        mount point did not answer."""
        for where in self._unanswered:
            if path == where or path.startswith(where + "/"):
                return _Unanswered(where)
        points = self._mounts.points()
        mount = None if points is None else _mount_of(path, points)
        # every later path under its mount point refused unasked; under `path` only when
        # the table cannot be read
        where = mount or path
        try:
            if points is not None and mount is None:
                return ask(self._real(path))
            # a call of an earlier scan there still stuck: refused without one more
            if _STUCK.under(self._real(path)) is None:
                answer = self._caller.call(ask, self._real(path), self._real(where))
            else:
                answer = None
        except OSError as e:
            return _kept(e)
        if answer is None:
            self._unanswered.append(where)
            return _Unanswered(where)
        return answer

    def _walk(self, path: str) -> Refusal | None:
        """Why the regular file at `path` is refused, or None."""
        reached = self._resolve(path, False)
        return reached if isinstance(reached, Refusal) else None

    def _resolve(self, path: str, any_kind: bool, trees: bool = True) -> Refusal | _Reached:
        """Where `path` leads, walked from / with symlinks followed, or why it is refused:
        someone but root can change it or a directory on the way (`_component`), it is
        under `USER_TREES` (unless not `trees`: walked there too), or it is no regular file
        (unless `any_kind`)."""
        shown = printable(path)
        unknown = self._mounts_unknown(shown)
        if unknown is not None:  # asked first: nothing else is read then, FSTAB included
            return unknown
        fstab = self._user_mount_points()
        if self._fstab_unknown is not None:
            unknown = self._fstab_unknown
            return Refusal(f"{shown} cannot be checked: {unknown.reason}", unknown.fix)
        # refused whatever it holds, so nothing in a user tree is looked at: an lstat there
        # may go through an automounted or network home that does not answer, and hang the
        # generator (and the scans) on it
        tree = _user_tree(os.path.normpath(path)) if trees else None
        if tree is not None:
            return _in_user_tree(shown, tree, "")
        root = self._lstat("/")
        if isinstance(root, _Unanswered):
            return _no_answer(shown, root)
        if isinstance(root, OSError):
            return Refusal(f"{shown} cannot be checked: /: {_strerror(root)}", FIX_PATH)
        refusal = self._component(shown, "/", root, "", False)
        if refusal is not None:
            return refusal
        current = ""  # the directory reached, symlinks resolved ("" is /)
        head, _, name = path.rpartition("/")
        if head in self._safe_dirs and name not in ("", ".", ".."):
            current, parts = head, [name]  # a directory already walked: root's alone
        else:
            parts = [p for p in path.split("/") if p]
            parts.reverse()  # popped from the end
        via = ""  # the first symlink followed, for the message
        hops = steps = 0
        while parts:
            steps += 1
            if steps > MAX_STEPS:
                return Refusal(
                    f"{shown} cannot be checked: more than {MAX_STEPS} path components to "
                    "walk, symlinks' targets included",
                    FIX_PATH,
                )
            part = parts.pop()
            if part == ".":
                continue
            if part == "..":
                current = current[: current.rfind("/")]
                continue
            here = f"{current}/{part}"
            # the walk goes through every directory above: meeting the tree itself is enough
            if trees and here in USER_TREES:
                return _in_user_tree(shown, here, here)
            if here in fstab:
                return Refusal(
                    f"{_subject(shown, here, via, not parts)} is where {FSTAB} lets users mount "
                    "a file system of theirs (user, users, owner or group), whose files show "
                    "whatever owner they were made with",
                    FIX_TREE,
                )
            st = self._lstat(here)
            if isinstance(st, _Unanswered):
                return _no_answer(shown, st)
            # whatever the lstat answered (its program may say ENOENT for its own root), and
            # with the table polled again after it: a FUSE a user mounted between `_ask`'s
            # read and the lstat showed its program's owner there, and the table read none
            unknown = self._mounts_unknown(shown)
            if unknown is not None:  # read again, it could not be: users' mounts not known
                return unknown
            if here in self._mounts.users:
                return Refusal(
                    f"{_subject(shown, here, via, not parts)} is a FUSE file system that UID "
                    f"{self._mounts.users[here]} mounted, whose files show whatever owner "
                    "its program likes",
                    FIX_OWNERS,
                )
            if here in self._mounts.unchecked:
                return Refusal(
                    f"{_subject(shown, here, via, not parts)} is {self._mounts.unchecked[here]}",
                    FIX_OWNERS,
                )
            if isinstance(st, OSError):
                if st.errno in (errno.ENOENT, errno.ENOTDIR):
                    # only root can make it (`current` is root's alone)
                    return _missing(here, parts)
                return Refusal(
                    f"{shown} cannot be checked: {printable(here)}: {_strerror(st)}", FIX_PATH
                )
            if stat.S_ISLNK(st.st_mode):
                # a symlink's own owner and mode change nothing: only who may write its
                # directory (`current`, checked) can replace it
                hops += 1
                if hops > MAX_SYMLINKS:
                    return Refusal(
                        f"{shown} cannot be checked: more than {MAX_SYMLINKS} symlinks (a loop?)",
                        FIX_PATH,
                    )
                target = self._readlink(here)
                if isinstance(target, _Unanswered):
                    return _no_answer(shown, target)
                if isinstance(target, OSError):
                    return Refusal(
                        f"{shown} cannot be checked: the symlink {printable(here)} cannot "
                        f"be read: {_strerror(target)}",
                        FIX_PATH,
                    )
                via = via or here
                if target.startswith("/"):
                    current = ""
                parts.extend(reversed([p for p in target.split("/") if p]))
                continue
            refusal = self._component(shown, here, st, via, not parts)
            if refusal is not None:
                return refusal
            if parts and not stat.S_ISDIR(st.st_mode):
                # the path cannot exist while this file of root's does
                return _missing(here, parts)
            if stat.S_ISDIR(st.st_mode):
                self._safe_dirs.add(here)  # no symlink in it, each directory above checked
            current = here
        st = self._lstat(current or "/")  # walked: remembered, not asked again
        if isinstance(st, _Unanswered):
            return _no_answer(shown, st)
        if isinstance(st, OSError):  # remembered from the walk: not reached when it failed
            return _missing(current, [])
        if not any_kind and not stat.S_ISREG(st.st_mode):
            kind = file_kind(st.st_mode) or "not a regular file"
            return Refusal(
                f"{_subject(shown, current, via, True)} is {kind}, not a regular file", FIX_PATH
            )
        return _Reached(current or "/", st)

    def _mounts_unknown(self, shown: str) -> Refusal | None:
        """Why the path `shown` is refused while the mount table cannot be read (polled
        first), or None: without it, a FUSE file system a user mounted, or a cifs `noperm`,
        would be taken for root's (fail closed, as for an `FSTAB` not read whole)."""
        if self._mounts.points() is not None:
            return None
        unknown = self._mounts.unknown or _table_unread("not read")
        return Refusal(f"{shown} cannot be checked: {unknown.reason}", unknown.fix)

    def _user_mount_points(self) -> frozenset[str]:
        """The mount points of `FSTAB` that users may mount on (`_fstab_points`), as written,
        with their directory's symlinks followed and, where the point itself is a symlink,
        where it leads (mount(2) follows it: a stick mounted there lands on its target; a
        point something is mounted on is not looked at: a network file system there may not
        answer), read once per scan; none when there is no `FSTAB`. One that cannot be read
        whole leaves `_fstab_unknown` set: every walk is refused (a user mount point past
        the cut, or in a file not read, would have been taken for none); so does a point
        someone but root may put a symlink on the way to (they could make it lead anywhere),
        and one that raised (belt and braces: the points found so far, none or some, would
        stand for all of them for the rest of the scan)."""
        if self._fstab is None:
            self._fstab = frozenset()  # the walks of their directories below see none
            try:
                self._find_user_mount_points()
            except Exception as e:
                reason = f"{FSTAB}'s user mount points cannot be worked out ({type(e).__name__})"
                self._fstab_unknown = Refusal(reason, FIX_FSTAB)
                self._safe_dirs.clear()  # found with some points, or none, known
        return self._fstab

    def _find_user_mount_points(self) -> None:
        """`_user_mount_points`'s work: `_fstab` and `_fstab_unknown` set."""
        answer = self._ask(_read_head, FSTAB)
        written: frozenset[str] = frozenset()
        if isinstance(answer, _Unanswered):
            reason = (
                f"{printable(answer.where)} did not answer within {DEADLINE:g} s as "
                f"{FSTAB} was read (a network file system not answering?)"
            )
            self._fstab_unknown = Refusal(reason, FIX_ANSWER)
        elif isinstance(answer, OSError) and answer.errno not in (errno.ENOENT, errno.ENOTDIR):
            reason = f"{FSTAB} cannot be read: {_strerror(answer)}"
            self._fstab_unknown = Refusal(reason, FIX_FSTAB)
        elif isinstance(answer, bytes) and len(answer) > MAX_ENV_FILE:
            reason = f"{FSTAB} is larger than {MAX_ENV_FILE} bytes"
            self._fstab_unknown = Refusal(reason, FIX_FSTAB)
        elif isinstance(answer, bytes):
            written = _fstab_points(answer)
        # where each point lands, walked with no user mount point known; then walked again
        # with the others' known (none of them may be on its way either)
        lands: dict[str, set[str]] = {}
        for point in sorted(written):
            landed = self._lands(point, frozenset())
            lands[point] = landed if isinstance(landed, set) else set()
        found = set(written).union(*lands.values())
        for point, own in lands.items():
            if self._fstab_unknown is not None:
                break
            # mount(8) follows the point's symlinks as a user mounts, and the entry matches
            # where they lead then: one someone but root may put on the way (its directory,
            # or where its own symlink leads, not root's alone: /home/asr/usb), or another
            # user mount point (/srv/usb, on the way to /srv/usb/part2: a symlink part2 on
            # the stick mounted there), leads the stick anywhere. Walked in user trees too:
            # /media/cdrom0 is Debian's default
            others = frozenset(found - own - {point})
            # under another as written too (the walk stops where a directory is missing,
            # which root may make later: /srv/usb/a of /srv/usb/a/b, /srv/usb not there)
            under = [(at, o) for at in sorted(own | {point}) if (o := _mount_of(at, others))]
            reached: set[str] | Refusal
            if under:
                at, outer = under[0]
                reached = Refusal(
                    f"{printable(at)}: its directory {printable(outer)} is where {FSTAB} "
                    "lets users mount a file system of theirs",
                    FIX_USER_POINT,
                )
            else:
                reached = self._lands(point, others)
            if isinstance(reached, Refusal):
                reason = (
                    f"{FSTAB} lets users mount on {printable(point)}, where a symlink "
                    f"someone but root may put on its way leads as they mount: "
                    f"{reached.reason}"
                )
                fix = FIX_ANSWER if reached.fix == FIX_ANSWER else FIX_USER_POINT
                self._fstab_unknown = Refusal(reason, fix)
        self._fstab = frozenset(found)
        # those walks saw no mount point of fstab's, or not all: a directory they found
        # root's alone may be one (/opt/job, where the symlink /srv/usb leads), and a walk
        # that started there went past it
        self._safe_dirs.clear()

    def _lands(self, point: str, others: frozenset[str]) -> set[str] | Refusal:
        """Where a file system mounted on the `FSTAB` mount point `point` lands (its path with
        its directory's symlinks followed and, where it is a symlink, where that leads), the
        walks taking `others` for the user mount points; or why a walk was refused."""
        self._fstab = others
        self._safe_dirs.clear()  # found root's alone with other points known, or none
        head, _, name = point.rpartition("/")
        reached = self._resolve(head or "/", True, trees=False)
        if isinstance(reached, Refusal):
            return reached
        real = f"{reached.real.rstrip('/')}/{name}"
        if real in (self._mounts.points() or set()):
            return {real}  # a file system's root, no symlink
        st = self._lstat(real)
        if isinstance(st, os.stat_result) and stat.S_ISLNK(st.st_mode):
            target = self._resolve(real, True, trees=False)
            if isinstance(target, Refusal):
                return target
            return {real, target.real}
        return {real}

    def _component(
        self, shown: str, here: str, st: os.stat_result, via: str, last: bool
    ) -> Refusal | None:
        """Why someone other than root can change `here` (not a symlink; `last`: the file
        itself), or None."""
        mode = st.st_mode
        if st.st_uid != 0:
            what = f"is owned by UID {st.st_uid}, who can change it"
        elif mode & stat.S_IWOTH:
            if stat.S_ISDIR(mode) and mode & stat.S_ISVTX:
                what = "is a sticky directory anyone can make files in (as /tmp)"
            else:
                what = f"is writable by anyone (mode {stat.S_IMODE(mode):04o})"
        elif mode & stat.S_IWGRP and st.st_gid != 0:
            what = f"is writable by group GID {st.st_gid} (mode {stat.S_IMODE(mode):04o})"
        elif mode & stat.S_IWGRP and (acl := self._has_acl(here)):
            if isinstance(acl, _Unanswered):
                return _no_answer(shown, acl)
            what = "is group-writable with an access ACL, which may let others write it"
        else:
            return None
        return Refusal(f"{_subject(shown, here, via, last)} {what}", FIX_OWNERS)

    def _has_acl(self, here: str) -> bool | _Unanswered:
        """Whether `here` has an access ACL (or cannot be asked): its group bits are then the
        ACL's mask, and named users or groups may write."""
        answer = self._ask(has_access_acl, here)
        return True if isinstance(answer, OSError) else answer


def _missing(here: str, parts: list[str]) -> _Reached:
    """What a walk reached where `here` is not there: that path with the rest of the walk
    (`parts`, popped from the end) after it."""
    rest = "/".join(reversed(parts))
    return _Reached(os.path.normpath(f"{here}/{rest}") if rest else here, None)


def _read_head(path: str) -> bytes:
    """Up to MAX_ENV_FILE + 1 bytes of the regular file at `path` (opened without waiting,
    as a FIFO put there by root would make it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        chunks: list[bytes] = []
        left = MAX_ENV_FILE + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=4096)  # 10,000 units with one data mount: one look
def _covered(destination: str) -> str | None:
    """The one of `GATE_PATHS` that a mount at `destination` (absolute, simplified) lands
    on, in or above, or None. /var/run is /run (a symlink systemd follows)."""
    if destination == "/var/run" or destination.startswith("/var/run/"):
        destination = "/run" + destination[len("/var/run") :]
    parts = [p for p in destination.split("/") if p]
    for gate_path in GATE_PATHS:
        want = [p for p in gate_path.split("/") if p]
        if all(_component_matches(p, w) for p, w in zip(parts, want, strict=False)):
            return gate_path
    return None


def _component_matches(name: str, want: str) -> bool:
    return name == want or (want.endswith("*") and name.startswith(want[:-1]))


def _table_unread(why: str) -> Refusal:
    """The refusal of every walk while `MOUNTINFO` cannot be read: a file system a user
    mounted, or one whose kernel lets others write what it shows, would be taken for root's."""
    reason = (
        f"{printable(MOUNTINFO)} cannot be read ({why}): which file systems users mounted "
        "is not known"
    )
    return Refusal(reason, FIX_MOUNTINFO)


def _close(caller: _Caller, mounts: _MountTable) -> None:
    caller.close()
    mounts.close()


def _mount_of(path: str, points: set[str] | frozenset[str]) -> str | None:
    """The deepest of `points` that is `path` or a directory above it, or None."""
    while path != "/":
        if path in points:
            return path
        path = path[: path.rfind("/")] or "/"
    return None


def _fstab_points(text: bytes) -> frozenset[str]:
    """The mount points (system paths, `.` and `..` taken away as written) of the entries of
    `text` (fstab(5): blank-separated fields, `\\ooo` escapes, `#` comments) that mount(8)
    lets users mount: one of `USER_MOUNTS` among their options."""
    found: set[str] = set()
    for line in text.split(b"\n"):
        # libmount's fields end at a space or a tab alone (a form feed is part of one), and
        # a \r before the newline goes
        line = line[:-1] if line.endswith(b"\r") else line
        fields = _FSTAB_BLANKS.split(line.strip(b" \t"))
        if len(fields) < 4 or fields[0].startswith(b"#"):
            continue
        allowed: dict[bytes, bool] = {}
        # libmount's flags: each option sets its own, its `no` form clears it, the last wins
        # (`user,nouser`: no user mount; `nouser,user`: one); a comma in "..." splits nothing,
        # one written \054 does (the field is unmangled first, as the mount point)
        for option in re.findall(rb'(?:[^,"]|"[^"]*"?)+', _fstab_unmangled(fields[3])):
            if option in USER_MOUNTS:
                allowed[option] = True
            elif option.startswith(b"no") and option[2:] in USER_MOUNTS:
                allowed[option[2:]] = False
        if not any(allowed.values()):
            continue
        point = os.fsdecode(_fstab_unmangled(fields[1]))
        if point.startswith("/"):
            found.add(os.path.normpath("/" + point.lstrip("/")))
    return frozenset(found)


def _fstab_unmangled(field: bytes) -> bytes:
    """An fstab field with its `\\ooo` escapes undone, as libmount's unmangle, up to the first
    NUL: libmount's C string ends at an unmangled \\000."""
    field = _MOUNTINFO_MANGLED.sub(lambda m: bytes([int(m[1], 8) & 0xFF]), field)
    return field.partition(b"\0")[0]


def _read_mount_table(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _mount_points(table: bytes, root: str) -> set[str]:
    """The mount points in `table` (/proc/self/mountinfo: the fifth field of each line,
    with the kernel's \\ooo escapes undone) at or under `root` ("" for /), as system paths."""
    found: set[str] = set()
    for line in table.split(b"\n"):
        fields = line.split(b" ", 5)
        if len(fields) < 6:
            continue
        point = os.fsdecode(
            _MOUNTINFO_MANGLED.sub(lambda m: bytes([int(m[1], 8) & 0xFF]), fields[4])
        )
        if point == root or point.startswith(root + "/"):
            found.add(point[len(root) :] or "/")
    return found


def _user_mounts(table: bytes, root: str) -> dict[str, int]:
    """The FUSE file systems in `table` (/proc/self/mountinfo) at or under `root` that a user
    mounted (`user_id=` other than 0 in their options: fusermount's), by mount point (system
    paths), with that user's UID. Such a file system shows whatever owner and mode its
    program likes: /srv/asr, asr's, refused, was root's 0755 once asr mounted sshfs on it
    (`allow_other`, which /etc/fuse.conf's user_allow_other lets users ask for)."""
    found: dict[str, int] = {}
    for line in table.split(b"\n"):
        point = _mount_points(line, root)  # none, or this line's
        fields = line.partition(b" - ")[2].split(b" ")  # type, source, options
        if not point or len(fields) < 3:
            continue
        if fields[0] != b"fuse" and not fields[0].startswith((b"fuse.", b"fuseblk")):
            continue
        for option in fields[2].split(b","):
            name, _, value = option.partition(b"=")
            if name == b"user_id" and value.isdigit() and int(value) != 0:
                found[point.pop()] = int(value)
                break
    return found


_FUSE_DECIDES = "whose program, not the kernel, decides who writes there, whatever owner it shows"
_ANYONE_WRITES = "where the kernel lets anyone write, whatever owner and mode it shows"
# File systems whose kernel lets users write whatever owner and mode their files show, even
# mounted by root: (type, a prefix where it ends with `.`; the option that makes it so; an
# option that undoes it, "" for none; its name and what it does, as a refusal says them). A
# root FUSE that lets others in (allow_other) without default_permissions leaves each access
# to its program (sshfs lets anyone write as its remote user), cifs noperm lets everyone (the
# server checks the mount's credentials), ntfs3 noacsrules too. Other owner options (vfat,
# exfat, ntfs3, cifs `uid=`, `gid=`, `umask=`; a vfat a user mounted takes the user as its
# owner) are what the kernel shows on each file and checks: judged by what it shows.
_UNCHECKED: tuple[tuple[bytes, bytes, bytes, str, str], ...] = (
    (b"fuse", b"allow_other", b"default_permissions", "FUSE", _FUSE_DECIDES),
    (b"fuse.", b"allow_other", b"default_permissions", "FUSE", _FUSE_DECIDES),
    (b"fuseblk", b"allow_other", b"default_permissions", "FUSE", _FUSE_DECIDES),
    (b"cifs", b"noperm", b"", "cifs", _ANYONE_WRITES),
    (b"smb3", b"noperm", b"", "smb3", _ANYONE_WRITES),
    (b"ntfs3", b"noacsrules", b"", "ntfs3", _ANYONE_WRITES),
)


def _unchecked_mounts(table: bytes, root: str) -> dict[str, str]:
    """The file systems in `table` (/proc/self/mountinfo) at or under `root` whose kernel lets
    other users write whatever owner and mode their files show (`_UNCHECKED`), by mount
    point (system paths), with what a refusal says of each."""
    found: dict[str, str] = {}
    for line in table.split(b"\n"):
        fields = line.partition(b" - ")[2].split(b" ")  # type, source, options
        if len(fields) < 3:
            continue
        options = fields[2].split(b",")
        for kind, option, undone, name, why in _UNCHECKED:
            if fields[0] != kind and not (kind.endswith(b".") and fields[0].startswith(kind)):
                continue
            if option in options and not (undone and undone in options):
                point = _mount_points(line, root)  # none, or this line's
                if point:
                    said = option.decode() + (f" without {undone.decode()}" if undone else "")
                    found[point.pop()] = f"a {name} file system mounted {said}, {why}"
            break
    return found


def _subject(shown: str, here: str, via: str, last: bool) -> str:
    """The component named in a message: the file itself (`last`), one of its directories,
    or what a symlink on its way leads to."""
    here_shown = printable(here or "/")
    if via:
        return f"{shown}: {here_shown}, reached through the symlink {printable(via)},"
    if here_shown == shown:
        return shown
    return f"{shown}: {'' if last else 'its directory '}{here_shown}"


def _kept(e: OSError) -> OSError:
    """`e` to remember: without its traceback, whose frames would hold the checker (a cycle
    per failed lstat, which the collector then walks: at 10,000 files, a quarter second)."""
    e.__traceback__ = None
    return e


def _strerror(e: OSError) -> str:
    return printable(e.strerror or str(e), 200)


def _no_answer(shown: str, unanswered: _Unanswered) -> Refusal:
    return Refusal(
        f"{shown} cannot be checked: {printable(unanswered.where)} did not answer within "
        f"{DEADLINE:g} s (a network file system not answering?)",
        FIX_ANSWER,
    )


def _in_user_tree(shown: str, tree: str, here: str) -> Refusal:
    """The refusal of a path in a user tree (`here`: the directory of it the walk reached,
    when the path as written is not under it)."""
    way = f" (by way of {printable(here)})" if here and not shown.startswith(tree + "/") else ""
    return Refusal(
        f"{shown} is under {tree}{way}, where users make files or file systems are mounted "
        "after systemd runs gpuslice's generator at boot",
        FIX_TREE,
    )


def _named(value: str, path: str, then: str = " ({})") -> str:
    """The file of the EnvironmentFile= `value` (`path`, specifiers expanded) as a message
    names it: the value as written in the unit, then (`then`) what its specifiers made of
    it. An admin looks for `EnvironmentFile=-%S/asr/env`; a message that named only
    /var/lib/asr/env sent them looking for a line no unit has."""
    if (value[1:] if value.startswith("-") else value) == path:
        return printable(path)
    return printable(value, 200) + then.format(printable(path))


def _as_written(value: str, path: str, refusal: Refusal | None) -> Refusal | None:
    """`refusal` of the file of the EnvironmentFile= `value` (`path`) naming it as `_named`
    does (a walk's reason starts with the path it walked)."""
    shown = printable(path)
    if refusal is None or refusal.reason.startswith(printable(value, 200)):
        return refusal  # as written already: the same, or `_file`'s own (a NUL, a wildcard)
    if not refusal.reason.startswith(shown):
        return refusal
    return Refusal(_named(value, path) + refusal.reason[len(shown) :], refusal.fix)


def _skips_why(name: str) -> str:
    return (
        f"{_SKIPS_HOW[name]}, so gpuslice's gate would let the start through without asking "
        "for its GPUs"
    )


def _withheld(name: str, file: str, fix: str) -> Refusal:
    """The refusal of the variable `name` set in the environment file `file` (as `_named`
    names it) as anyone but root is shown it (Status): without its value, nor what the walk
    of the paths it names said of them. systemd shows no one but root that file's text (it
    is often 0600), and a value holds more than a path: `LD_PRELOAD=/x.so TOKEN=...` is one
    value, the whole line, whose `TOKEN=...` names no file."""
    said = f"{name}=... (set in {printable(file)}; its value is shown to root alone)"
    if name in SKIPS_GATE:
        return Refusal(f"{said}: {_skips_why(name)}", fix)
    does = "load code from" if name in LOADER_PATHS else "write to"
    return Refusal(
        f"{said}: the gate's programs would {does} what it names as root, which someone but "
        "root can change or gpuslice cannot check",
        fix,
    )


def _message(unit: str, refusal: Refusal) -> str:
    return (
        f"{refusal.reason}; gpuslice's gate runs as root with this unit's environment, so "
        f"gpuslice does not manage {printable(unit)} {refusal.fix}"
    )


def _mount_message(unit: str, refusal: Refusal) -> str:
    return (
        f"{refusal.reason}; gpuslice's gate runs as root with this unit's mounts "
        f"(ExecStartPre=+ keeps them), so gpuslice does not manage {printable(unit)} "
        f"{refusal.fix}"
    )
