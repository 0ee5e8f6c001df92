"""The shared reader of regular files: what it reads, what it refuses and why, and that it
never waits on a FIFO or opens a device."""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuslice.safefile import Unreadable, Why, file_kind, read_bytes, read_with_stat
from tests.descriptors import open_below
from tests.test_adapters_mutation4 import spy_on_os_reads

LIMIT = 100
BASE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def refused(path: Path | str, limit: int | None = LIMIT, *, follow_links: bool) -> Unreadable:
    """The Unreadable that reading `path` raises."""
    with pytest.raises(Unreadable) as raised:
        read_bytes(path, limit, follow_links=follow_links)
    return raised.value


def spy_on_opens(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The path and flags of every `os.open` from now on."""
    opened: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path: str, flags: int, *args: int) -> int:
        opened.append((os.fspath(path), flags))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", spy)
    return opened


def without_hanging(read: Callable[[], object], fifo: Path) -> list[object]:
    """What `read` returned or raised, run on a thread: should it block in open() on `fifo`,
    a writer lets it go after 5 s and the test fails."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(read())
        except Exception as e:  # handed to the test
            outcome.append(e)

    reader = threading.Thread(target=run)
    reader.start()
    reader.join(30)  # a pass never waits this long: a loaded machine may start it late
    if reader.is_alive():
        os.close(os.open(fifo, os.O_WRONLY))
        reader.join()
        pytest.fail("blocked on the FIFO (30 s)")
    return outcome


# ---- what is read ------------------------------------------------------------------------------


@pytest.mark.parametrize("follow_links", [True, False])
def test_a_file_of_exactly_the_limit_is_read(tmp_path: Path, follow_links: bool) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * LIMIT)
    assert read_bytes(path, LIMIT, follow_links=follow_links) == b"x" * LIMIT


@pytest.mark.parametrize("follow_links", [True, False])
def test_a_file_one_byte_over_the_limit_is_too_large(tmp_path: Path, follow_links: bool) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * (LIMIT + 1))
    error = refused(path, follow_links=follow_links)
    assert (error.why, error.error, str(error)) == (Why.TOO_LARGE, None, "too large")


def test_a_prefix_is_the_first_bytes_of_a_larger_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"a" * LIMIT + b"b")
    assert read_bytes(path, LIMIT, follow_links=False, prefix=True) == b"a" * LIMIT
    assert read_bytes(path, 1000, follow_links=False, prefix=True) == b"a" * LIMIT + b"b"


def test_a_huge_file_costs_one_read_of_the_limit_and_a_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: instant
    reads = spy_on_os_reads(monkeypatch)
    assert refused(path, 1 << 20, follow_links=True).why is Why.TOO_LARGE
    assert reads == [(1 << 20) + 1]


def test_without_a_limit_the_whole_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10_000)
    assert read_bytes(path, None, follow_links=True) == b"x" * 10_000


def test_an_empty_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "f").touch()
    assert read_bytes(tmp_path / "f", LIMIT, follow_links=False) == b""


def test_the_stat_given_is_that_of_the_file_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file replaced between the look and the open: the stat is the open file's, whose
    bytes were read, not the one looked at."""
    path, other = tmp_path / "f", tmp_path / "other"
    path.write_bytes(b"looked at")
    other.write_bytes(b"read")
    os.utime(other, ns=(7, 7))
    real_open = os.open

    def replaced_first(name: Any, flags: int, *args: Any) -> int:
        os.replace(other, path)
        return real_open(name, flags, *args)

    monkeypatch.setattr(os, "open", replaced_first)
    data, st = read_with_stat(path, LIMIT, follow_links=False)
    assert (data, st.st_mtime_ns, st.st_size) == (b"read", 7, 4)


def test_a_file_refused_carries_the_stat_it_was_refused_by(tmp_path: Path) -> None:
    """Too large: the open file's; no regular file: the look's; not there: none."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * (LIMIT + 1))
    os.utime(path, ns=(7, 7))
    too_large = refused(path, follow_links=False).stat
    assert too_large is not None and too_large.st_mtime_ns == 7
    (tmp_path / "link").symlink_to(path)
    link = refused(tmp_path / "link", follow_links=False).stat
    assert link is not None and stat.S_ISLNK(link.st_mode)
    assert refused(tmp_path / "none", follow_links=False).stat is None


# ---- links -------------------------------------------------------------------------------------


def test_a_symlink_is_followed_only_when_asked(tmp_path: Path) -> None:
    (tmp_path / "target").write_bytes(b"text")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert read_bytes(tmp_path / "link", LIMIT, follow_links=True) == b"text"
    error = refused(tmp_path / "link", follow_links=False)
    assert (error.why, error.kind, error.error) == (Why.LINK, "a symbolic link", None)


def test_a_dangling_symlink_is_missing_when_followed(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert refused(tmp_path / "link", follow_links=True).why is Why.MISSING
    assert refused(tmp_path / "link", follow_links=False).why is Why.LINK


def test_a_symlink_swapped_in_after_the_lstat_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O_NOFOLLOW: the open fails (ELOOP) rather than read the link's target."""
    (tmp_path / "regular").write_bytes(b"mine")
    (tmp_path / "target").write_bytes(b"theirs")
    path = tmp_path / "f"
    path.symlink_to(tmp_path / "target")
    regular = os.lstat(tmp_path / "regular")
    real_lstat = os.lstat

    def lstat(file: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        return regular if file == path else real_lstat(file, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    error = refused(path, follow_links=False)
    assert error.why is Why.FAILED
    assert error.error is not None and error.error.errno == errno.ELOOP


@pytest.mark.parametrize(
    ("follow_links", "flags"),
    [(True, BASE_FLAGS), (False, BASE_FLAGS | os.O_NOFOLLOW)],
)
def test_the_file_is_opened_without_side_effects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, follow_links: bool, flags: int
) -> None:
    """Read-only, never blocking on a FIFO swapped in, never taken as controlling terminal,
    never inherited by a child; O_NOFOLLOW when links are not followed."""
    path = tmp_path / "f"
    path.write_bytes(b"x")
    opened = spy_on_opens(monkeypatch)
    read_bytes(path, LIMIT, follow_links=follow_links)
    assert opened == [(str(path), flags)]


# ---- what is not a regular file ----------------------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.parametrize("follow_links", [True, False])
def test_a_fifo_nobody_writes_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, follow_links: bool
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    opened = spy_on_opens(monkeypatch)
    [error] = without_hanging(lambda: read_bytes(fifo, LIMIT, follow_links=follow_links), fifo)
    assert isinstance(error, Unreadable)
    assert (error.why, error.kind, str(error)) == (Why.NOT_REGULAR, "a FIFO", "not a regular file")
    assert opened == []  # known from the stat: never opened


@pytest.mark.timeout(20)
@pytest.mark.parametrize("follow_links", [True, False])
def test_a_fifo_swapped_in_after_the_stat_is_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, follow_links: bool
) -> None:
    """O_NONBLOCK: the open returns at once, and fstat() on the open file refuses it."""
    (tmp_path / "regular").touch()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    regular = os.stat(tmp_path / "regular")
    name = "stat" if follow_links else "lstat"
    real = getattr(os, name)

    def swapped(file: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        return regular if file == fifo else real(file, *args, **kwargs)

    monkeypatch.setattr(os, name, swapped)
    [error] = without_hanging(lambda: read_bytes(fifo, LIMIT, follow_links=follow_links), fifo)
    assert isinstance(error, Unreadable)
    assert (error.why, error.kind) == (Why.NOT_REGULAR, "a FIFO")
    assert open_below(tmp_path) == []  # closed


@pytest.mark.parametrize("follow_links", [True, False])
def test_a_directory_is_not_a_regular_file(tmp_path: Path, follow_links: bool) -> None:
    error = refused(tmp_path, follow_links=follow_links)
    assert (error.why, error.kind, stat.S_ISDIR(error.mode)) == (
        Why.NOT_REGULAR,
        "a directory",
        True,
    )


def test_a_device_is_never_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    opened = spy_on_opens(monkeypatch)
    error = refused("/dev/null", follow_links=False)
    assert (error.why, error.kind) == (Why.NOT_REGULAR, "a character device")
    assert opened == []


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        (stat.S_IFDIR, "a directory"),
        (stat.S_IFIFO, "a FIFO"),
        (stat.S_IFSOCK, "a socket"),
        (stat.S_IFCHR, "a character device"),
        (stat.S_IFBLK, "a block device"),
        (stat.S_IFREG, None),
        (0, None),
    ],
)
def test_every_kind_of_file_is_named(mode: int, kind: str | None) -> None:
    assert file_kind(mode | 0o644) == kind


# ---- what cannot be read -----------------------------------------------------------------------


@pytest.mark.parametrize("follow_links", [True, False])
def test_a_missing_file_is_missing(tmp_path: Path, follow_links: bool) -> None:
    error = refused(tmp_path / "nothing", follow_links=follow_links)
    assert error.why is Why.MISSING
    assert isinstance(error.error, FileNotFoundError)
    assert str(error) == "No such file or directory"


def test_a_nul_in_the_path_is_an_invalid_argument() -> None:
    error = refused("/etc/\0passwd", follow_links=True)
    assert error.why is Why.FAILED
    assert error.error is not None
    assert (error.error.errno, error.error.strerror) == (errno.EINVAL, "embedded null byte")


def test_a_refused_open_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As root, mode 000 stops no read: the kernel's EACCES is played by os.open."""
    path = tmp_path / "f"
    path.write_bytes(b"x")

    def refuse(*args: object) -> int:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(os, "open", refuse)
    error = refused(path, follow_links=False)
    assert (error.why, str(error)) == (Why.FAILED, "Permission denied")


def test_an_error_without_the_systems_words_is_said_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> int:
        raise OSError("refused by a filter")

    monkeypatch.setattr(os, "open", refuse)
    (tmp_path / "f").write_bytes(b"x")
    assert str(refused(tmp_path / "f", follow_links=True)) == "refused by a filter"


def test_a_read_error_closes_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")

    def fail(fd: int, size: int) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "read", fail)
    error = refused(path, follow_links=True)
    assert (error.why, str(error)) == (Why.FAILED, "Input/output error")
    assert open_below(tmp_path) == []
