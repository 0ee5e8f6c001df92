"""What `gpuslice new` and `enroll` promise at the edges that mutation testing found no test
holding: the exact words of each refusal of a command (an admin reads them, with the
COMMAND they point at), which program paths systemd runs and so are taken, the defaults the
options' help shows, the drop-ins named as left over, a unit that starts with bytes that are
no ASCII, one reached through a symlink, and what `write_atomically` and `lock_unit_dir` leave
on disk: the file's mode whatever the umask, the temporary file's name and place, the flags
of the lock and of the directory synced, and the failures that must not undo a written file.
One fault they showed is fixed here: a program path of 4096 bytes or more (which systemd
refuses, and with it the unit) was written.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any

import click
import pytest

from gpuslice.annotations import Key
from gpuslice.cli import main
from gpuslice.core.model import Rung
from gpuslice.newunit import (
    LOCK_NAME,
    _shown,
    lock_unit_dir,
    resolve_command,
    write_atomically,
)
from tests.test_cli_hostile import SYSTEM, enroll, files, new, plain_unit

USAGE = "Usage: main new [OPTIONS] NAME COMMAND...\nTry 'main new --help' for help.\n\n"


def refused(tmp_path: Path, *command: str) -> str:
    """The whole output of a `gpuslice new` whose command is refused, nothing written."""
    result = new(tmp_path, "job", "--priority", "5", command=command)
    assert result.exit_code == 2, result.output
    assert files(tmp_path) == []
    return result.output


# ---------------------------------------------------------------------------------------------
# the command


def test_an_empty_command_is_refused_with_an_example() -> None:
    """click refuses `gpuslice new job --` first (COMMAND is required); a caller of the
    function is told the same in gpuslice's words."""
    with pytest.raises(click.UsageError) as caught:
        resolve_command([])
    assert caught.value.format_message() == (
        "give the command after --, e.g. -- /usr/bin/python3 job.py"
    )


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ("/bin/echo", "\udcff"),
            "Invalid value for COMMAND: argument 2 ('\\xff') is not UTF-8, and a unit file is",
        ),
        (
            ("no-such-program-here-at-all",),
            "Invalid value for COMMAND: 'no-such-program-here-at-all': not found in PATH",
        ),
        (
            ('/opt/my "app"/run',),
            "Invalid value for COMMAND: '/opt/my \"app\"/run': a quote, a backslash or a "
            "control character in the program's path: systemd refuses it",
        ),
        (
            ("/opt/jobs/$JOB/run",),
            "Invalid value for COMMAND: '/opt/jobs/$JOB/run': '$' in the program's path: "
            "systemd keeps it there, but expands it in argv[0]",
        ),
        (
            ("/usr/bin/",),
            "Invalid value for COMMAND: '/usr/bin/': a directory, or a name over 255 bytes: "
            "systemd refuses such a program's path",
        ),
    ],
)
def test_a_refused_command_says_why_in_exact_words_and_names_command(
    tmp_path: Path, command: tuple[str, ...], expected: str
) -> None:
    assert refused(tmp_path, *command) == USAGE + "Error: " + expected + "\n"


def test_an_argument_that_is_not_utf8_is_shown_cut_at_80_characters(tmp_path: Path) -> None:
    """A long argument of undecodable bytes is quoted in the error as its first 80 escaped
    characters: the error stays one readable line."""
    shown = "/opt/x" + "\\xff" * 18 + "\\x"  # 80 characters
    assert refused(tmp_path, "/opt/x" + "\udcff" * 100) == (
        USAGE + f"Error: Invalid value for COMMAND: argument 1 ('{shown}...') is not UTF-8, "
        "and a unit file is\n"
    )


@pytest.mark.parametrize(
    "program",
    [
        "/opt/My X job/run",  # a blank and any letter: systemd runs a quoted path with them
        "/opt/" + "a" * 200 + "/" + "b" * 200,  # long, but no name in it over 255 bytes
        "/opt/" + "r" * 255,  # a name of exactly 255 bytes
        "/opt/" + "é" * 127 + "a",  # 255 bytes in UTF-8
    ],
)
def test_new_takes_a_program_path_systemd_runs(tmp_path: Path, program: str) -> None:
    result = new(tmp_path, "job", "--priority", "5", command=(program, "arg"))
    assert result.exit_code == 0, result.output
    text = (tmp_path / SYSTEM / "job.service").read_text()
    assert f'\nExecStart="{program}" "arg"\n' in text


def test_a_name_over_255_bytes_in_utf8_is_refused(tmp_path: Path) -> None:
    """128 characters, 256 bytes: systemd counts bytes."""
    assert "a directory, or a name over 255 bytes" in refused(tmp_path, "/opt/" + "é" * 128)


def _path_of(size: int) -> str:
    """An absolute program path of `size` bytes, no name in it over 200."""
    head = ("/" + "d" * 200) * 20
    return head + "/" + "r" * (size - len(head) - 1)


def test_a_program_path_of_4096_bytes_or_more_is_refused(tmp_path: Path) -> None:
    """systemd takes a path of at most PATH_MAX - 1 (4095) bytes (path_is_valid); a longer
    ExecStart= program is "neither a valid executable name nor an absolute path", a fatal
    error of the unit: `gpuslice new` reported written a unit that never loaded."""
    assert refused(tmp_path, _path_of(4096)) == (
        USAGE + f"Error: Invalid value for COMMAND: '{_path_of(4096)[:80]}...': a path of "
        "4096 bytes or more: systemd refuses such a program's path\n"
    )
    result = new(tmp_path, "job", "--priority", "5", command=(_path_of(4095),))
    assert result.exit_code == 0, result.output
    wide = ("/" + "d" * 200) * 20 + "/" + "é" * 38  # 4059 characters, 4097 bytes
    assert "a path of 4096 bytes or more" in refused(tmp_path / "wide", wide)


# ---------------------------------------------------------------------------------------------
# the options' help


def test_the_help_of_each_option_shows_the_default_the_parser_uses() -> None:
    helps = {p.opts[0]: p.help for p in main.commands["new"].params if isinstance(p, click.Option)}
    assert helps["--type"] == "Type=: one of on-demand, background (default: on-demand)"
    assert helps["--gpus"] == "GPUs=: an integer 1-64 (default: 1)"
    assert helps["--preempt"] == (
        "Preempt=: stop, freeze and suspend, in the order to try them, each once "
        "(e.g. suspend stop) (default: stop)"
    )


def test_a_default_of_several_values_is_shown_as_the_file_would_say_it() -> None:
    """`_shown` writes a default as the key's value in a unit file: an enum by its value,
    several separated by blanks (a Preempt= default of `suspend stop` would read so)."""
    key = Key("Preempt", "preempt", str, (Rung.SUSPEND, 2, "x"), "")
    assert _shown(key) == "suspend 2 x"
    assert _shown(Key("GPUs", "gpus", str, 7, "")) == "7"


# ---------------------------------------------------------------------------------------------
# what is already there


def test_the_gate_name_outside_the_generators_directory_is_a_leftover_drop_in(
    tmp_path: Path,
) -> None:
    """Only the generator's own gate is expected (made anew at each reload): a drop-in of
    that name elsewhere (an admin's copy), or another file in the generator's directory, is
    named like any other that applies to the new unit."""
    copy = tmp_path / SYSTEM / "job.service.d/gpuslice-gate.conf"
    copy.parent.mkdir(parents=True)
    copy.write_text("[Service]\n")
    other = tmp_path / "run/systemd/generator/job.service.d/other.conf"
    other.parent.mkdir(parents=True)
    other.write_text("[Service]\n")
    result = new(tmp_path, "job", "--priority", "50")
    assert result.exit_code == 0, result.output
    assert (
        "warning: drop-ins made before job.service apply to it too: "
        "/etc/systemd/system/job.service.d/gpuslice-gate.conf, "
        "/run/systemd/generator/job.service.d/other.conf (remove those"
    ) in result.output


def test_a_unit_that_starts_with_bytes_beyond_ascii_is_not_overwritten(tmp_path: Path) -> None:
    """An admin's unit whose first line is in UTF-8 (or in no encoding): a refusal, not a
    traceback on the bytes."""
    theirs = tmp_path / SYSTEM / "job.service"
    theirs.parent.mkdir(parents=True)
    before = "# Écrit à la main, n'écrasez pas\n[Service]\nExecStart=/bin/true\n".encode() + b"\xff"
    theirs.write_bytes(before)
    result = new(tmp_path, "job", "--priority", "5")
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"Error: {theirs} exists and was not written by gpuslice new: not overwritten "
        "(use gpuslice enroll job.service to annotate it)\n"
    )
    assert theirs.read_bytes() == before


def test_its_own_unit_reached_through_a_symlink_is_rewritten(tmp_path: Path) -> None:
    """An admin who keeps units elsewhere and links them in: the unit `gpuslice new` wrote is
    still its own (read through the link), and rewritten; an enroll's drop-in likewise."""
    assert new(tmp_path, "job", "--priority", "5").exit_code == 0
    unit = tmp_path / SYSTEM / "job.service"
    kept = tmp_path / "srv/units/job.service"
    kept.parent.mkdir(parents=True)
    unit.rename(kept)
    unit.symlink_to(kept)
    result = new(tmp_path, "job", "--priority", "6")
    assert result.exit_code == 0, result.output
    assert "Priority=6\n" in unit.read_text()

    plain_unit(tmp_path)
    result = enroll(tmp_path, "plain", "--priority", "5")
    assert result.exit_code == 0, result.output
    dropin = tmp_path / SYSTEM / "plain.service.d/gpuslice.conf"
    kept_dropin = tmp_path / "srv/units/gpuslice.conf"
    dropin.rename(kept_dropin)
    dropin.symlink_to(kept_dropin)
    result = enroll(tmp_path, "plain", "--priority", "7")
    assert result.exit_code == 0, result.output
    assert "Priority=7\n" in dropin.read_text()


# ---------------------------------------------------------------------------------------------
# the lock


def _waiting_on(path: Path) -> bool:
    """Whether /proc/locks lists a lock request blocked (`->`) on `path`'s inode."""
    inode = f":{os.stat(path).st_ino}"
    return any(
        "->" in line and any(field.endswith(inode) for field in line.split())
        for line in Path("/proc/locks").read_text().splitlines()
    )


@pytest.mark.timeout(20)
def test_the_lock_is_waited_for_unless_told_not_to(tmp_path: Path) -> None:
    """The second `gpuslice new` waits for the first (after saying so): a lock taken without
    waiting would fail it with "cannot write"."""
    held = lock_unit_dir(tmp_path)
    got: list[Any] = []

    def take() -> None:
        try:
            got.append(lock_unit_dir(tmp_path))
        except BaseException as e:
            got.append(e)

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    try:
        deadline = time.monotonic() + 15
        while waiter.is_alive() and not _waiting_on(tmp_path / LOCK_NAME):
            assert time.monotonic() < deadline
            waiter.join(0.01)
        assert not got, got  # it waits
    finally:
        os.close(held)
    waiter.join(15)
    assert len(got) == 1 and isinstance(got[0], int), got
    try:
        with pytest.raises(BlockingIOError):
            lock_unit_dir(tmp_path, wait=False)
    finally:
        os.close(got[0])


def test_the_lock_is_opened_close_on_exec_non_blocking_and_never_through_a_link(
    tmp_path: Path,
) -> None:
    """A child (systemctl) never inherits it; a FIFO there is never waited on; a link
    planted at its name is not followed to make or lock a file elsewhere."""
    fd = lock_unit_dir(tmp_path / "a")
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
    finally:
        os.close(fd)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        lock_unit_dir(tmp_path / "b")
    assert not (tmp_path / "elsewhere").exists()


# ---------------------------------------------------------------------------------------------
# write_atomically


def test_a_written_file_is_0644_whatever_the_umask_in_directories_made_for_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a/b/c/job.service"
    old = os.umask(0o077)
    try:
        write_atomically(path, "text é")
    finally:
        os.umask(old)
    assert path.read_bytes() == "text é".encode()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert os.listdir(path.parent) == ["job.service"]


@pytest.mark.parametrize("exclusive", [False, True])
def test_the_temporary_file_is_hidden_next_to_the_unit_and_the_directory_synced_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exclusive: bool
) -> None:
    """The data goes to `.gpuslice-XXXXXXXX` in the unit's own directory (a rename across
    filesystems fails; a hidden name without a unit suffix is never read by systemd); the
    directory then synced is opened as a directory only (a FIFO swapped in is not waited on)
    and close-on-exec."""
    seen: list[tuple[str, Any]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            seen.append(("directory", fcntl.fcntl(fd, fcntl.F_GETFL)))
            seen.append(("cloexec", fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC))
        else:
            seen.append(("file", sorted(os.listdir(tmp_path))))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_atomically(tmp_path / "job.service", b"data", exclusive=exclusive)
    assert [kind for kind, _ in seen] == ["file", "directory", "cloexec"]
    names = seen[0][1]
    assert len(names) == 1 and re.fullmatch(r"\.gpuslice-[a-z0-9_]{8}", names[0]), names
    assert seen[1][1] & os.O_DIRECTORY
    assert seen[2][1]
    assert os.listdir(tmp_path) == ["job.service"]


def test_a_temporary_name_that_cannot_be_removed_after_the_link_is_no_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unit is in place once linked: a failed unlink of the extra name does not make it
    unwritten (and the caller undo a unit it then reports written)."""

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "unlink", unlink)
    write_atomically(tmp_path / "job.service", b"data", exclusive=True)
    assert (tmp_path / "job.service").read_bytes() == b"data"


def test_a_failed_rename_raises_its_own_error_even_when_the_cleanup_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller reports the write's error ("cannot write ...: ..."), not the cleanup's."""

    def replace(src: Any, dst: Any) -> None:
        raise OSError(30, "Read-only file system", str(dst))

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(OSError, match="Read-only file system") as caught:
        write_atomically(tmp_path / "job.service", b"data")
    assert caught.value.errno == 30


def test_a_directory_that_cannot_be_synced_leaves_the_file_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some filesystems refuse fsync on a directory (EINVAL): the unit is in place all the
    same, and no error is raised."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_atomically(tmp_path / "job.service", b"data")
    assert (tmp_path / "job.service").read_bytes() == b"data"
