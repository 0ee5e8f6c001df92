"""Reading a regular file at a path that someone else may have put anything at: a FIFO, a
socket or a device is never opened (`stat` first: opening a FIFO blocks, opening a device can
do things), and one swapped in after the `stat` is not waited on (O_NONBLOCK) or read (`fstat`
on the open file); at most a set number of bytes is read, whatever the file's size says.

`read_bytes` raises `Unreadable` saying why; each caller words that its own way.
`read_with_stat` gives the fstat of the descriptor the bytes came from too: a time or an
identity taken by another look at the path may be another file's (one replaced in between).

`has_access_acl` is the one reader of POSIX access ACLs, for the checks that a file is root's
alone (`config`, `envsafety`).
"""

from __future__ import annotations

import enum
import errno
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
