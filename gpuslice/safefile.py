"""Reading a regular file at a path that someone else may have put anything at: a FIFO, a
socket or a device is never opened (`stat` first: opening a FIFO blocks, opening a device can
do things), and one swapped in after the `stat` is not waited on (O_NONBLOCK) or read (`fstat`
on the open file); at most a set number of bytes is read, whatever the file's size says.

`read_bytes` raises `Unreadable` saying why; each caller words that its own way.
`read_with_stat` gives the fstat of the descriptor the bytes came from too: a time or an
identity taken by another look at the path may be another file's (one replaced in between).

`has_access_acl` is the one reader of POSIX access ACLs, for the checks that a file is root's
alone (`config`, `envsafety`).

`write_atomic` is the one writer of a whole file (the state, the records, the env files, the
generator's drop-ins): replaced in one rename(2) from a temporary file of the writer's own,
which `remove_stale` removes once its writer is gone. `link_atomic` puts a file under a
second name the same way (the state's last durable copy).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import itertools
import os
import stat

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
ACCESS_ACL = "system.posix_acl_access"
# what getxattr(2) of ACCESS_ACL says of a file with no access ACL, or on a file system with none
_NO_ACL = (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def file_kind(mode: int) -> str | None:
    """What a file that is no regular file (nor a symlink) is, for a message; None for a
    regular file or a type of no name here."""
    return next((kind for test, kind in _KINDS if test(mode)), None)


def has_access_acl(path: str) -> bool:
    """Whether `path` carries a POSIX access ACL (a symlink is not followed: it has none of
    its own); OSError when that cannot be asked. With one, the mode's group bits are the ACL's
    mask, and each user or group it names may write when the mask has `w`, whatever st_gid is
    (`setfacl -m u:bob:rw`). The kernel keeps no ACL that the mode bits say alone, so one that
    is there names someone. Never None: `envsafety`'s calls under a deadline take None for no
    answer."""
    try:
        os.getxattr(path, ACCESS_ACL, follow_symlinks=False)
    except OSError as e:
        if e.errno in _NO_ACL:
            return False
        raise
    return True


class Why(enum.Enum):
    MISSING = "not found"
    LINK = "a symbolic link"  # only when links are not followed
    NOT_REGULAR = "not a regular file"
    TOO_LARGE = "too large"
    FAILED = "cannot be read"  # permission, I/O error, a NUL in the path, ...


class Unreadable(Exception):
    """Why `read_bytes` gave nothing. `mode`: the file's mode (LINK, NOT_REGULAR); `error`:
    the OSError (MISSING, FAILED), whose strerror says why in the system's words (a NUL in the
    path is EINVAL, "embedded null byte"). `stat`: the file as last looked at, the open one's
    fstat once opened (else the first look's); None when it was not there or could not be
    looked at."""

    def __init__(
        self,
        why: Why,
        *,
        mode: int = 0,
        error: OSError | None = None,
        stat: os.stat_result | None = None,
    ) -> None:
        super().__init__(why.value if error is None else error.strerror or str(error))
        self.why = why
        self.mode = mode
        self.error = error
        self.stat = stat

    @property
    def kind(self) -> str | None:
        """What the file is (LINK, NOT_REGULAR), as `file_kind` says."""
        return Why.LINK.value if self.why is Why.LINK else file_kind(self.mode)


def read_bytes(
    path: str | os.PathLike[str], limit: int | None, *, follow_links: bool, prefix: bool = False
) -> bytes:
    """The bytes of the regular file at `path`: all of them, TOO_LARGE when there are more than
    `limit`; or, with `prefix`, the first `limit` of them. `limit` None reads the whole file.
    Without `follow_links`, a symlink is LINK (and one swapped in after the `lstat` makes the
    open fail: FAILED, ELOOP)."""
    return read_with_stat(path, limit, follow_links=follow_links, prefix=prefix)[0]


def read_with_stat(
    path: str | os.PathLike[str], limit: int | None, *, follow_links: bool, prefix: bool = False
) -> tuple[bytes, os.stat_result]:
    """`read_bytes`, and the fstat of the descriptor they were read from: its time and
    identity are those of the bytes, whatever was at `path` before the open or is since."""
    looked: os.stat_result | None = None
    try:
        looked = os.stat(path) if follow_links else os.lstat(path)
        _check_regular(looked)
        fd = os.open(path, _OPEN_FLAGS if follow_links else _OPEN_FLAGS | os.O_NOFOLLOW)
    except FileNotFoundError as e:  # gone, whatever the look saw
        raise Unreadable(Why.MISSING, error=e) from None
    except OSError as e:
        raise Unreadable(Why.FAILED, error=e, stat=looked) from None
    except ValueError as e:  # a NUL in the path
        raise Unreadable(Why.FAILED, error=OSError(errno.EINVAL, str(e))) from None
    st = looked
    try:
        st = os.fstat(fd)
        _check_regular(st)
        data = _read_at_most(fd, limit if prefix or limit is None else limit + 1, st.st_size)
    except OSError as e:
        raise Unreadable(Why.FAILED, error=e, stat=st) from None
    finally:
        os.close(fd)
    if limit is not None and len(data) > limit:
        raise Unreadable(Why.TOO_LARGE, stat=st)
    return data, st


def _check_regular(looked: os.stat_result) -> None:
    mode = looked.st_mode
    if stat.S_ISLNK(mode):
        raise Unreadable(Why.LINK, stat=looked)
    if not stat.S_ISREG(mode):
        raise Unreadable(Why.NOT_REGULAR, mode=mode, stat=looked)


def _read_at_most(fd: int, limit: int | None, expected: int) -> bytes:
    """Up to `limit` bytes, to the end of the file, in reads of the size fstat() gave: a
    buffered read of `limit` bytes allocates all of them per file (a megabyte for a unit file:
    64 us a file, against 19 us). The size is a hint only: a file that grew since is read on,
    up to the limit."""
    chunks: list[bytes] = []
    size = 0
    while limit is None or size < limit:
        want = max(expected, 4096)
        chunk = os.read(fd, want if limit is None else min(limit - size, want))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------------------------------
# writing a file whole

# A writer's temporary file is `.NAME.tmp-PID-N`, beside NAME (a rename stays on one file
# system): PID its process, N a number that process takes once, so no two writers share one.
# With one name for every writer (`.NAME.tmp`), two processes writing one file at once (the
# controller and `gpuslice release-jobs`, or two release-jobs) wrote into one temporary file:
# the second removed the first's and made its own there, and the first's rename put the
# second's half-written file at NAME (the second's rename then failed). Hidden, as before: no
# reader of a directory of gpuslice's files takes a name that starts with ".", and config.py
# refuses it as a path setting (`_own_name_below`: "." then NAME then ".").
TEMPORARY = ".tmp"
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
# a file opened to be synced: never a link followed or a FIFO waited on
_SYNC_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_numbers = itertools.count()
_writing: set[str] = set()  # the names of this process's temporary files being written
_PID_DIGITS = 7  # PID_MAX_LIMIT is 4194304: a longer number is no process's


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` with `data` in one rename(2), mode 0644 whatever the umask; its
    temporary file never outlives an error, and is never another writer's (see TEMPORARY).

    No fsync, which would put a disk flush before every StartUnit/StopUnit the controller
    sends (the state: state.StateStore.flush follows off the loop). No mkstemp: its random
    names and Python file objects cost 4 times the time (95 against 24 us on tmpfs, issue 10).
    Whatever is found at the temporary name was left by a writer killed mid-write that had
    this process's id (no live process has it), or is a link: it is removed, never written
    through."""
    name = os.fspath(path)
    own, tmp = _temporary(name)
    try:
        fd = os.open(tmp, _NEW_FILE, 0o644)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, _NEW_FILE, 0o644)
    _writing.add(own)
    try:
        try:
            os.fchmod(fd, 0o644)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        _writing.discard(own)


def link_atomic(
    source: str | os.PathLike[str], path: str | os.PathLike[str], *, sync: bool = False
) -> None:
    """Make `path` one more name of the file `source` names now (a hard link), in one
    rename(2) from a temporary name of the writer's own (see TEMPORARY): `path` is always
    the old file or this one. With `sync`, the file's data are on disk before the rename (the
    directory is the caller's to flush): `path` then names a durable file, whatever the file
    system's rename does. `source` is never followed (a symlink is linked as itself, and its
    sync fails: ELOOP); FileNotFoundError when nothing is there."""
    name = os.fspath(path)
    own, tmp = _temporary(name)
    _writing.add(own)
    try:
        try:
            os.link(source, tmp, follow_symlinks=False)
        except FileExistsError:  # a killed writer's, of this process's id
            os.unlink(tmp)
            os.link(source, tmp, follow_symlinks=False)
        try:
            if sync:
                fd = os.open(tmp, _SYNC_FLAGS)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(tmp, name)
        finally:
            # also after the rename: one of two names of one file does nothing (rename(2)),
            # and the temporary name stayed (`path` was that file already)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    finally:
        _writing.discard(own)


def _temporary(name: str) -> tuple[str, str]:
    """A temporary name of this writer's own beside `name` (TEMPORARY), and its path."""
    head, tail = os.path.split(name)
    own = f".{tail}{TEMPORARY}-{os.getpid()}-{next(_numbers)}"
    return own, os.path.join(head, own)


def remove_stale(path: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """Remove the temporary files `write_atomic` left for `path` when killed mid-write (their
    process is gone, or is this one with no such write under way), and an older gpuslice's
    `.NAME.tmp`; how many. Each writer has names of its own, so without this every kill left
    one more for good. A live writer's file is left: removed, its rename would fail. `dir_fd`:
    `path`'s directory as the caller opened it (nothing is then reached through a link).
    What cannot be listed or removed is left, unsaid."""
    head, tail = os.path.split(os.fspath(path))
    prefix = f".{tail}{TEMPORARY}"
    try:
        with os.scandir((head or ".") if dir_fd is None else dir_fd) as entries:
            names = [e.name for e in entries if e.name.startswith(prefix)]
    except OSError:
        return 0
    removed = 0
    for name in names:
        if not _stale(name, name[len(prefix) :]):
            continue
        try:
            if dir_fd is None:
                os.unlink(os.path.join(head, name))
            else:
                os.unlink(name, dir_fd=dir_fd)
        except OSError:
            continue
        removed += 1
    return removed


def _stale(name: str, suffix: str) -> bool:
    """Whether the temporary file `name` (`suffix`: what follows `.NAME.tmp`) has no writer
    left. A name not of this form is not gpuslice's, and is left."""
    if not suffix:
        return True  # an older gpuslice's one name for every writer
    pid, dash, number = suffix[1:].partition("-")
    if not (
        suffix[0] == "-"
        and dash
        and pid.isascii()
        and pid.isdigit()
        and number.isascii()
        and number.isdigit()
        and len(pid) <= _PID_DIGITS
        and pid[0] != "0"
    ):
        return False
    if int(pid) == os.getpid():
        return name not in _writing
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: a process, still there
        return False
    return False
