"""Whether only root can change the `EnvironmentFile=` of a unit that runs as another user.

gpuslice's gate runs as `ExecStartPre=+`: as root, outside `User=` and the unit's sandbox, but
with the unit's environment, `EnvironmentFile=` included. A unit with `User=asr` (or
`DynamicUser=yes`) whose environment file asr can change ran nothing as root before gpuslice
gated it; once gated, asr's `LD_PRELOAD=` or `PATH=` runs in the gate's root shell (the dynamic
loader acts before the gate can). Such a unit is not managed: `EnvFileChecker.check` says why,
for each file, and `annotations.Loader` makes that an error on the unit (no gate).

A file is root's alone when every component of its path, walked from / with symlinks followed
(the link's directory, then its target's components), is owned by UID 0 and writable by no
group but GID 0 (without an access ACL) and by no one else (a sticky world-writable directory
such as /tmp included). A file that does not exist is fine when the deepest directory that does
is root's alone, so that only root can make it. A path under `USER_TREES` is refused whatever
it holds, and nothing in it is looked at: users make files there, /home may not be mounted
yet when systemd runs the generator at boot (its empty mount point looks like root's), and
an automounted or network home that does not answer would hang the walk. Whatever cannot be
checked (a specifier whose value is not known here, a relative path, a wildcard, a loop of
symlinks, a FIFO, a path longer than systemd takes) is refused too, with the reason.

Paths are system paths, looked up under the scan's root (tests use a temporary directory, as
`unitfiles.UnitIndex` does). Only lstat(2), readlink(2) and getxattr(2) are used: nothing is
opened (but /proc/self/mountinfo), so a FIFO cannot block. Results are cached for the
checker's life (one scan): 10,000 units that share one file cost one walk. Pure stdlib +
`unitfiles`; `check` never raises.

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
import os
import re
import select
import stat
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from gpuslice.safefile import file_kind, has_access_acl
from gpuslice.unitfiles import Entry, is_instance, is_template, printable

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
PATH_MAX = 4096  # Linux's, with the NUL: systemd ignores a longer EnvironmentFile=
MAX_SYMLINKS = 32  # systemd's chase limit (the kernel's is 40)
MAX_STEPS = 1024  # components walked, symlinks' targets included: no real path comes near
RUN_AS_KEYS = frozenset({"User", "DynamicUser", "EnvironmentFile"})
_ROOT_USERS = frozenset({"root", "0"})
_FALSE = frozenset({"0", "no", "n", "false", "f", "off"})
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
_WILDCARDS = "*?[\\"  # systemd globs EnvironmentFile= (glob(3) without flags: \ escapes)
# seconds one lstat, readlink or getxattr of the walk may take: a local one takes
# microseconds, a network file system whose server is gone never answers
DEADLINE = 2.0
MOUNTINFO = "/proc/self/mountinfo"  # which file system a path is on
_MOUNTINFO_MANGLED = re.compile(rb"\\([0-7]{3})")  # the kernel writes " \t\n\\" as \ooo


class EnvFile(NamedTuple):
    """One `EnvironmentFile=` assignment: where it is and what it says."""

    path: str
    line: int
    value: str


@dataclass
class RunAs:
    """The `[Service]` settings that decide whether the gate's environment is the admin's:
    `User=` (last wins, empty resets), `DynamicUser=`, `EnvironmentFile=` (each appends, an
    empty one resets the list). Collected while the unit's files are read, in order."""

    user: str = ""
    dynamic: bool = False
    env_files: list[EnvFile] = field(default_factory=list)

    def assign(self, path: str, entry: Entry) -> None:
        if entry.key == "User":
            self.user = entry.value
        elif entry.key == "DynamicUser":
            # systemd ignores a bad value and keeps the last: taken as yes here, which only
            # adds a check
            self.dynamic = entry.value.lower() not in _FALSE
        elif entry.key == "EnvironmentFile":
            if entry.value == "":
                self.env_files.clear()
            else:
                self.env_files.append(EnvFile(path, entry.line, entry.value))

    def other_user(self) -> bool:
        """Whether the unit runs as a user other than root (a specifier in `User=` counts)."""
        return self.dynamic or (self.user != "" and self.user not in _ROOT_USERS)


# what an admin does about a refusal, ending its message
FIX_OWNERS = "until only root can change that file and its directories"
FIX_PATH = "until it names, by an absolute path, a file only root can change"
FIX_TREE = "until it names a file elsewhere, that only root can change"
FIX_ANSWER = "until that file system answers at a later scan (systemctl daemon-reload)"


class Refusal(NamedTuple):
    """Why one EnvironmentFile= is refused, and what fixes it (`FIX_*`)."""

    reason: str
    fix: str


class Finding(NamedTuple):
    """A refused `EnvironmentFile=` assignment: its file, line and the whole message."""

    path: str
    line: int
    message: str


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


def _user_tree(path: str) -> str | None:
    for tree in USER_TREES:
        if path == tree or path.startswith(tree + "/"):
            return tree
    return None


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
    `caller` at the first use; None when the table cannot be read. The file stays open and
    is polled before each use: the kernel flags it at each mount and unmount, and it is read
    again."""

    def __init__(self, caller: _Caller, root: str) -> None:
        self._caller = caller
        self._root = root
        self._fd: int | None = None
        self._poll: select.poll | None = None
        self._points: set[str] | None = None

    def points(self) -> set[str] | None:
        if self._poll is None:
            self._poll = select.poll()
            try:
                self._fd = os.open(MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
            self._poll.register(self._fd, select.POLLPRI)
            self._points = self._read()
        elif self._fd is not None and self.changed():
            self._points = self._read()
        return self._points

    def _read(self) -> set[str] | None:
        if _STUCK.under(MOUNTINFO) is not None:  # an earlier read has not returned
            return None
        try:
            table = self._caller.call(_read_mount_table, MOUNTINFO, MOUNTINFO)
        except OSError:
            return None
        return None if table is None else _mount_points(table, self._root) - {"/"}

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
        # directories found root's alone, by their path without symlinks: a walk to a file in
        # one starts there (10,000 files in one directory: one walk of its parents)
        self._safe_dirs: set[str] = set()
        # mount points (system paths) of file systems where a call did not answer (`_Unanswered`)
        self._unanswered: list[str] = []
        self._caller = _Caller()
        self._mounts = _MountTable(self._caller, self._root)
        # the worker thread ends with the checker, and the mount table is closed (neither
        # holds a reference to it)
        weakref.finalize(self, _close, self._caller, self._mounts)

    def check(self, unit: str, run_as: RunAs) -> list[Finding]:
        """A finding for each of the unit's environment files that someone other than root
        can change, or that cannot be checked; none for a unit that runs as root. Never
        raises."""
        if not run_as.env_files or not run_as.other_user():
            return []
        findings: list[Finding] = []
        for env_file in run_as.env_files:
            try:
                refusal = self.refusal(unit, env_file.value)
            except Exception as e:  # belt and braces: no file may crash a scan
                quoted = printable(env_file.value, 200)
                refusal = Refusal(f"{quoted} cannot be checked ({type(e).__name__})", FIX_PATH)
            if refusal is not None:
                findings.append(Finding(env_file.path, env_file.line, _message(unit, refusal)))
        return findings

    def refusal(self, unit: str, value: str) -> Refusal | None:
        """Why the value of one EnvironmentFile= (`-` first when optional) is refused, or None
        when only root can change the file it names."""
        quoted = printable(value, 200)
        path, why = expand(unit, value[1:] if value.startswith("-") else value)
        if path is None:
            return Refusal(f"{quoted} cannot be checked: {why}", FIX_PATH)
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
        if any(c in path for c in _WILDCARDS):
            return Refusal(
                f"{quoted} cannot be checked: systemd reads it as a wildcard pattern "
                "(*, ?, [ or \\), which gpuslice does not expand; name each file",
                FIX_PATH,
            )
        if path not in self._verdicts:
            self._verdicts[path] = self._walk(path)
        return self._verdicts[path]

    # -- the walk

    def _real(self, path: str) -> str:
        """Where the system path `path` (absolute) is under the root."""
        return self._root + path if path != "/" else self._root or "/"

    def _lstat(self, path: str) -> os.stat_result | OSError | _Unanswered:
        return self._remembered(self._stats, path, os.lstat)

    def _readlink(self, path: str) -> str | OSError | _Unanswered:
        return self._remembered(self._links, path, os.readlink)

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
        shown = printable(path)
        # refused whatever it holds, so nothing in a user tree is looked at: an lstat there
        # may go through an automounted or network home that does not answer, and hang the
        # generator (and the scans) on it
        tree = _user_tree(os.path.normpath(path))
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
            if here in USER_TREES:
                return _in_user_tree(shown, here, here)
            st = self._lstat(here)
            if isinstance(st, _Unanswered):
                return _no_answer(shown, st)
            if isinstance(st, OSError):
                if st.errno in (errno.ENOENT, errno.ENOTDIR):
                    # only root can make it (`current` is root's alone)
                    return None
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
                return None
            if stat.S_ISDIR(st.st_mode):
                self._safe_dirs.add(here)  # no symlink in it, each directory above checked
            current = here
        st = self._lstat(current or "/")  # walked: remembered, not asked again
        if isinstance(st, _Unanswered):
            return _no_answer(shown, st)
        if isinstance(st, os.stat_result) and not stat.S_ISREG(st.st_mode):
            kind = file_kind(st.st_mode) or "not a regular file"
            return Refusal(
                f"{_subject(shown, current, via, True)} is {kind}, not a regular file", FIX_PATH
            )
        return None

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


def _close(caller: _Caller, mounts: _MountTable) -> None:
    caller.close()
    mounts.close()


def _mount_of(path: str, points: set[str]) -> str | None:
    """The deepest of `points` that is `path` or a directory above it, or None."""
    while path != "/":
        if path in points:
            return path
        path = path[: path.rfind("/")] or "/"
    return None


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


def _message(unit: str, refusal: Refusal) -> str:
    return (
        f"{refusal.reason}; gpuslice's gate runs as root with this unit's environment, so "
        f"gpuslice does not manage {printable(unit)} {refusal.fix}"
    )
