"""Behaviours of the whole-file writer and its clean-up that mutation testing of
gpuslice/safefile.py (write_atomic, remove_stale, _stale) and gpuslice/envfiles.py (remove)
showed kept by no test: the temporary file's mode from its first moment, a failed write's
temporary file cleaned by the next sweep, what the sweep takes for a dead writer's, and that
the sweep of a directory the caller opened never goes through the link swapped in at its
path."""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path
from typing import Any

import pytest

from gpuslice import envfiles, safefile
from gpuslice.paths import env_file


def modes_at_creation(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The permission bits each file that write_atomic opens has before its fchmod."""
    seen: list[int] = []
    real = os.fchmod

    def fchmod(fd: int, mode: int) -> None:
        seen.append(os.fstat(fd).st_mode & 0o7777)
        real(fd, mode)

    monkeypatch.setattr(os, "fchmod", fchmod)
    return seen


@pytest.fixture
def no_umask() -> Any:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.usefixtures("no_umask")
def test_the_temporary_file_is_never_more_open_than_0644_even_before_its_chmod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under umask 0 a temporary file created 0777 (or with any other bit) is one every local
    user may open for writing before the fchmod: a descriptor kept writes into the state once
    renamed. It is created 0644."""
    seen = modes_at_creation(monkeypatch)
    target = tmp_path / "state.json"
    safefile.write_atomic(target, b"{}")
    assert seen == [0o644]
    assert target.read_bytes() == b"{}"
    assert (target.stat().st_mode & 0o7777) == 0o644


@pytest.mark.usefixtures("no_umask")
def test_a_temporary_file_left_at_this_writers_name_is_replaced_by_one_0644(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file at the writer's own temporary name (left by a killed writer of this PID) is
    removed and created anew: 0644 from its first moment as well."""
    monkeypatch.setattr(safefile, "_numbers", itertools.count(7))
    target = tmp_path / "state.json"
    left = tmp_path / f".state.json{safefile.TEMPORARY}-{os.getpid()}-7"
    left.write_bytes(b"half")
    left.chmod(0o666)
    seen = modes_at_creation(monkeypatch)
    safefile.write_atomic(target, b"{}")
    assert seen == [0o644]
    assert target.read_bytes() == b"{}"
    assert not left.exists()


def test_a_temporary_file_a_failed_write_could_not_remove_goes_with_the_next_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk filled mid-write, and the clean-up's unlink failed too: the temporary file
    stays. Its write is over, so it is no live writer's: `remove_stale` removes it."""
    target = tmp_path / "state.json"

    def write(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def unlink(path: Any, *args: Any, **kw: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(OSError, match="No space"):
        safefile.write_atomic(target, b"{}")
    monkeypatch.undo()
    [left] = [p.name for p in tmp_path.iterdir()]
    assert left.startswith(f".state.json{safefile.TEMPORARY}-{os.getpid()}-")
    assert safefile.remove_stale(target) == 1
    assert list(tmp_path.iterdir()) == []


def stale_name(tail: str, suffix: str) -> str:
    return f".{tail}{safefile.TEMPORARY}{suffix}"


def test_a_dead_writer_of_a_seven_digit_pid_is_stale(tmp_path: Path) -> None:
    """PID_MAX_LIMIT is 4194304: a PID of 7 digits is a process's (9999999 is none's, which
    os.kill says as it would of a dead one); one of 8 is not gpuslice's name."""
    target = tmp_path / "state.json"
    (tmp_path / stale_name("state.json", "-9999999-0")).write_bytes(b"")
    (tmp_path / stale_name("state.json", "-99999999-0")).write_bytes(b"")
    assert safefile.remove_stale(target) == 1
    assert [p.name for p in tmp_path.iterdir()] == [stale_name("state.json", "-99999999-0")]


def test_a_pid_with_a_leading_zero_is_not_gpuslices_name(tmp_path: Path) -> None:
    """`-0PID-N` is no name write_atomic gives (a PID never starts with 0), though its number
    is this process's, with no write under way: someone else's file, left."""
    pid = str(os.getpid())
    suffix = f"-0{pid}-0" if len(pid) < 7 else "-0999999-0"
    name = stale_name("state.json", suffix)
    (tmp_path / name).write_bytes(b"")
    assert safefile.remove_stale(tmp_path / "state.json") == 0
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_a_stale_file_that_cannot_be_removed_does_not_keep_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whichever stale file is reached first and cannot be removed, the others still are."""
    target = tmp_path / "state.json"
    names = [stale_name("state.json", f"-9999999-{n}") for n in range(5)]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    real_unlink = os.unlink
    refused: list[str] = []

    def unlink(path: Any, *args: Any, **kw: Any) -> None:
        if not refused:
            refused.append(os.path.basename(path))
            raise OSError(errno.EBUSY, "Device or resource busy")
        real_unlink(path, *args, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    assert safefile.remove_stale(target) == 4
    assert [p.name for p in tmp_path.iterdir()] == refused


def swap_for_a_link(directory: Path, elsewhere: Path) -> Path:
    """Move `directory` aside and put a link to `elsewhere` at its path; where it went."""
    aside = directory.with_name(directory.name + ".aside")
    directory.rename(aside)
    directory.symlink_to(elsewhere)
    return aside


def test_a_sweep_lists_and_removes_in_the_directory_opened_not_through_a_link_swapped_in(
    tmp_path: Path,
) -> None:
    """The caller opened the file's directory (`dir_fd`); someone then swapped a link to a
    directory of their choosing in at its path. The sweep lists the directory opened and
    removes there: the other directory's look-alike is never touched."""
    real = tmp_path / "unit"
    real.mkdir()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (real / stale_name("gpuslice.env", "")).write_bytes(b"")
    (theirs / stale_name("gpuslice.env", "-9999999-1")).write_bytes(b"")
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
    try:
        aside = swap_for_a_link(real, theirs)
        assert safefile.remove_stale(real / "gpuslice.env", dir_fd=fd) == 1
    finally:
        os.close(fd)
    assert list(aside.iterdir()) == []
    assert [p.name for p in theirs.iterdir()] == [stale_name("gpuslice.env", "-9999999-1")]


def test_removing_a_units_env_file_removes_nothing_through_a_link_swapped_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """envfiles.remove opened the unit's directory; its directory is swapped for a link to
    another one between the unlink and the sweep: the sweep's removals stay in the directory
    opened (the one left by a write killed mid-way), never the link's target's."""
    runtime = tmp_path / "run"
    unit = "a.service"
    path = env_file(str(runtime), unit)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"CUDA_VISIBLE_DEVICES=0\n")
    left = stale_name(path.name, "")
    (path.parent / left).write_bytes(b"")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / left).write_bytes(b"precious")
    real_unlink = os.unlink
    moved: list[Path] = []

    def unlink(name: Any, *args: Any, dir_fd: int | None = None, **kw: Any) -> None:
        real_unlink(name, *args, dir_fd=dir_fd, **kw)
        if name == path.name and not moved:
            moved.append(swap_for_a_link(path.parent, theirs))

    monkeypatch.setattr(os, "unlink", unlink)
    assert envfiles.remove(str(runtime), unit) is False  # its path is a link now
    assert moved and list(moved[0].iterdir()) == []
    assert (theirs / left).read_bytes() == b"precious"


def test_removing_a_unit_whose_env_file_is_already_gone_removes_its_directory(
    tmp_path: Path,
) -> None:
    """Its directory alone is left (a stop came while no file was written): removed all
    the same, and a temporary file a killed write left in it with it."""
    runtime = tmp_path / "run"
    path = env_file(str(runtime), "b.service")
    path.parent.mkdir(parents=True)
    (path.parent / stale_name(path.name, "")).write_bytes(b"")
    assert envfiles.remove(str(runtime), "b.service") is True
    assert not path.parent.exists()
