"""What `gpuslice enroll` and `gpuslice new` say, and where, at the edges mutation testing
found no test holding: the exact words of each refusal and the argument it points at
(`Invalid value for UNIT`, `NAME`, `--user`), the whole drop-in enroll writes, which messages
go to stderr (warnings, the parser's findings) and which to stdout (what was done), how a
file that cannot be written is named (the path the error is about, when it is not the unit
file; cut at 600 characters), the unit-size limit at its edge, the list of leftover drop-ins
cut at 1000 characters, a systemctl that fails or cannot run (the real `subprocess.run`, a
stand-in systemctl on PATH), and an undo that itself fails."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import gpuslice.cli
from gpuslice.cli import ENROLL_MARKER, main
from gpuslice.newunit import LOCK_NAME, write_atomically
from gpuslice.unitfiles import MAX_FILE_SIZE

SYSTEM = "etc/systemd/system"
NEW_USAGE = "Usage: main new [OPTIONS] NAME COMMAND...\nTry 'main new --help' for help.\n\n"
ENROLL_USAGE = "Usage: main enroll [OPTIONS] UNIT\nTry 'main enroll --help' for help.\n\n"


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(main, list(args), env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return result


def new(root: Path, name: str, *args: str, command: tuple[str, ...] = ("/bin/true",)) -> Result:
    return invoke("new", name, *args, "--no-reload", "--root", str(root), "--", *command)


def enroll(root: Path, unit: str, *args: str, env: dict[str, str] | None = None) -> Result:
    reload = [] if env is not None else ["--no-reload"]
    return invoke("enroll", unit, *args, *reload, "--root", str(root), env=env)


def files(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir() and p.name != LOCK_NAME
    )


def plain_unit(root: Path, name: str = "plain.service") -> Path:
    path = root / SYSTEM / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[Service]\nExecStart=/bin/true\n")
    return path


def dropin(root: Path, relative: str, text: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def systemctl_on_path(tmp_path: Path, reload_status: int) -> dict[str, str]:
    """A stand-in systemctl, run by the real `subprocess.run`: it notes its arguments and
    exits `reload_status` for daemon-reload, 0 for anything else. The environment that
    finds it first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "systemctl"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> {bin_dir}/ran\n'
        f'[ "$1" = daemon-reload ] && exit {reload_status}\nexit 0\n'
    )
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


# ---------------------------------------------------------------------------------------------
# refusals: their words and the argument they point at


@pytest.mark.parametrize(
    ("unit", "expected"),
    [
        ("bad name", "Invalid value for UNIT: 'bad name.service': not a unit name"),
        # printable's escape, then repr's: the backslash shown doubled
        ("esc\x1b[2J", "Invalid value for UNIT: 'esc\\\\x1b[2J.service': not a unit name"),
        (
            "plain.socket",
            "Invalid value for UNIT: plain.socket: only services are scheduled; enroll the "
            "service it starts",
        ),
        (
            "b" * 246 + ".service",
            "Invalid value for UNIT: " + "b" * 60 + "...: 254 characters; a unit gpuslice "
            "gates has at most 253, so that its drop-in directory (UNIT.d) fits in a file name",
        ),
    ],
)
def test_enroll_refuses_a_unit_in_exact_words_pointing_at_unit(
    tmp_path: Path, unit: str, expected: str
) -> None:
    """The name shown escaped (a terminal sequence in it never reaches the terminal), a name
    too long to gate shown by its first 60 characters only."""
    result = enroll(tmp_path, unit, "--priority", "5")
    assert result.exit_code == 2, result.output
    assert result.output == ENROLL_USAGE + "Error: " + expected + "\n"
    assert not (tmp_path / "etc").exists()


def test_new_refuses_a_name_too_long_to_gate_pointing_at_name(tmp_path: Path) -> None:
    result = new(tmp_path, "n" * 246, "--priority", "5")
    assert result.exit_code == 2, result.output
    assert result.output == NEW_USAGE + (
        "Error: Invalid value for NAME: " + "n" * 60 + "...: 254 characters; a unit gpuslice "
        "gates has at most 253, so that its drop-in directory (UNIT.d) fits in a file name\n"
    )
    assert files(tmp_path) == []


def test_new_now_without_reload_is_a_usage_error_in_exact_words(tmp_path: Path) -> None:
    result = new(tmp_path, "job", "--priority", "5", "--now")
    assert result.exit_code == 2, result.output
    assert result.output == (
        NEW_USAGE + "Error: --now needs the daemon-reload that --no-reload leaves out\n"
    )


@pytest.mark.parametrize(
    ("user", "exists", "expected"),
    [
        (
            "Bad User ",
            True,
            "'Bad User ': not a user name systemd takes (none is empty, '.' or '..', has a "
            "control character, ':' or '/', a blank at either end, or is all digits but a UID "
            "0-4294967294 other than 65535), or it has a '%' (a specifier) or a '\\' at the "
            "end (which joins the next line)",
        ),
        (
            "asr",
            False,
            "'asr': no such user on this host (systemd would fail the start: \"Failed to "
            'determine user credentials")',
        ),
    ],
)
def test_new_refuses_a_user_in_exact_words_pointing_at_the_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user: str, exists: bool, expected: str
) -> None:
    monkeypatch.setattr(gpuslice.cli, "user_exists", lambda name: exists)
    result = new(tmp_path, "job", "--priority", "5", "--user", user)
    assert result.exit_code == 2, result.output
    assert result.output == NEW_USAGE + "Error: Invalid value for --user: " + expected + "\n"
    assert files(tmp_path) == []


def test_enroll_refuses_an_admins_gpuslice_conf_in_exact_words(tmp_path: Path) -> None:
    plain_unit(tmp_path)
    theirs = dropin(tmp_path, f"{SYSTEM}/plain.service.d/gpuslice.conf", "[Service]\n")
    result = enroll(tmp_path, "plain", "--priority", "5")
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"Error: {theirs} exists and was not written by gpuslice enroll: not overwritten "
        "(edit its [X-GPUSlice] section, or remove it first)\n"
    )
    assert theirs.read_text() == "[Service]\n"


# ---------------------------------------------------------------------------------------------
# what enroll writes and says, and on which stream


def test_enroll_writes_the_whole_annotation_and_says_so_on_stdout(tmp_path: Path) -> None:
    """Every key the parser knows by default is written out (Type=, GPUs=, Requeue=): the
    drop-in says the whole annotation, not only what was given. Nothing on stderr."""
    plain_unit(tmp_path)
    result = enroll(tmp_path, "plain", "--priority", "5")
    assert result.exit_code == 0, result.output
    path = tmp_path / SYSTEM / "plain.service.d/gpuslice.conf"
    assert path.read_text() == (
        f"{ENROLL_MARKER}; edit or remove it with systemctl edit.\n"
        "[X-GPUSlice]\nPriority=5\nType=on-demand\nGPUs=1\nRequeue=yes\n"
    )
    assert result.stderr == ""
    assert result.stdout == f"enrolled plain.service (priority 5) via {path}\n"


def test_a_later_dropin_that_overrides_the_priority_is_a_warning_on_stderr(
    tmp_path: Path,
) -> None:
    plain_unit(tmp_path)
    dropin(tmp_path, f"{SYSTEM}/plain.service.d/zz-mine.conf", "[X-GPUSlice]\nPriority=9\n")
    result = enroll(tmp_path, "plain", "--priority", "5")
    assert result.exit_code == 0, result.output
    path = tmp_path / SYSTEM / "plain.service.d/gpuslice.conf"
    assert result.stderr == (
        "warning: a later drop-in overrides this one: plain.service has priority 9\n"
    )
    assert result.stdout == f"enrolled plain.service (priority 9) via {path}\n"


def test_a_warning_of_the_parser_is_shown_on_stderr_and_does_not_refuse(tmp_path: Path) -> None:
    """Only an error leaves the unit unmanaged; an unknown key in another drop-in is a
    warning: shown, and the unit enrolled."""
    plain_unit(tmp_path)
    dropin(tmp_path, f"{SYSTEM}/plain.service.d/aa.conf", "[X-GPUSlice]\nColour=red\n")
    result = enroll(tmp_path, "plain", "--priority", "5")
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith(
        "warning: /etc/systemd/system/plain.service.d/aa.conf:2: [X-GPUSlice] Colour: unknown key"
    )
    assert result.stderr.count("\n") == 1
    assert result.stdout.startswith("enrolled plain.service (priority 5) via ")


# ---------------------------------------------------------------------------------------------
# what new says, and on which stream


def test_new_rejected_by_an_earlier_dropin_removes_its_unit_and_leaves_the_directory(
    tmp_path: Path,
) -> None:
    """The unit directory was not made for the unit (it holds the lock, and every other
    unit): the undo removes the file only, and says so."""
    dropin(tmp_path, "run/systemd/system/job.service.d/bad.conf", "[X-GPUSlice]\nGPUs=x\n")
    result = new(tmp_path, "job", "--priority", "5")
    assert result.exit_code == 1, result.output
    path = tmp_path / SYSTEM / "job.service"
    assert result.stderr == (
        "error: /run/systemd/system/job.service.d/bad.conf:2: [X-GPUSlice] GPUs: expected an "
        f'integer 1-64, got "x"\nError: job.service: annotation rejected; removed {path}\n'
    )
    assert result.stdout == ""
    assert files(tmp_path) == ["run/systemd/system/job.service.d/bad.conf"]
    assert (tmp_path / SYSTEM).is_dir()


def _leftovers(root: Path, total: int) -> list[str]:
    """Drop-ins an earlier job.service left, their paths (as the warning names them) joined
    by ", " exactly `total` characters long."""
    head = "/etc/systemd/system/job.service.d/"
    names: list[str] = []
    length = 0
    while total - length > 2 + len(head) + 250 + 5:
        names.append("d" * 200 + f"{len(names):02d}.conf")
        length += len(head) + len(names[-1]) + 2
    names.append("z" * (total - length - len(head) - len(".conf")) + ".conf")
    for name in names:
        dropin(root, head.lstrip("/") + name, "[Service]\n")
    shown = [head + name for name in names]
    assert len(", ".join(shown)) == total
    return shown


@pytest.mark.parametrize("total", [1000, 1001])
def test_new_names_leftover_dropins_on_stderr_cut_at_1000_characters(
    tmp_path: Path, total: int
) -> None:
    joined = ", ".join(_leftovers(tmp_path, total))
    result = new(tmp_path, "job", "--priority", "5")
    assert result.exit_code == 0, result.output
    shown = joined if total <= 1000 else joined[:1000] + "..."
    assert result.stderr == (
        f"warning: drop-ins made before job.service apply to it too: {shown} "
        "(remove those an earlier unit of this name left)\n"
    )
    assert result.stdout == (
        f"wrote {tmp_path / SYSTEM / 'job.service'}: job.service (priority 5)\n"
    )


def test_new_now_says_the_unit_is_queued(tmp_path: Path) -> None:
    env = systemctl_on_path(tmp_path, 0)
    result = invoke(
        "new", "job", "--priority", "5", "--now", "--root", str(tmp_path), "--", "/bin/true",
        env=env,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith(
        "\nqueued job.service: `systemctl status job.service` says whether it waits and why\n"
    )
    assert (tmp_path / "bin/ran").read_text() == "daemon-reload\nstart --no-block job.service\n"


def test_a_unit_of_exactly_the_largest_size_is_written(tmp_path: Path) -> None:
    """MAX_FILE_SIZE is the most the parser reads: a unit of that size is still read whole."""
    probe = new(tmp_path / "probe", "job", "--priority", "5", command=("/bin/echo", "a"))
    assert probe.exit_code == 0, probe.output
    size = (tmp_path / "probe" / SYSTEM / "job.service").stat().st_size
    arg = "a" * (1 + MAX_FILE_SIZE - size)
    result = new(tmp_path, "job", "--priority", "5", command=("/bin/echo", arg))
    assert result.exit_code == 0, result.output
    assert (tmp_path / SYSTEM / "job.service").stat().st_size == MAX_FILE_SIZE
    result = new(tmp_path / "over", "job", "--priority", "5", command=("/bin/echo", arg + "a"))
    assert result.exit_code == 2, result.output
    assert (
        f"Invalid value for COMMAND: too long: the unit file would be {MAX_FILE_SIZE + 1} "
        f"bytes, at most {MAX_FILE_SIZE}\n"
    ) in result.output


# ---------------------------------------------------------------------------------------------
# a file that cannot be written


def test_a_dropin_directory_that_is_a_file_names_it(tmp_path: Path) -> None:
    """The error is about `plain.service.d`, not the drop-in: it is named after the reason."""
    plain_unit(tmp_path)
    directory = dropin(tmp_path, f"{SYSTEM}/plain.service.d", "")
    result = enroll(tmp_path, "plain", "--priority", "5")
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"Error: cannot write {directory}/gpuslice.conf: File exists ({directory})\n"
    )


def _writes_fail(monkeypatch: pytest.MonkeyPatch, error: OSError) -> None:
    def write(path: Path, data: Any, **kwargs: Any) -> os.stat_result:
        raise error

    monkeypatch.setattr(gpuslice.cli, "write_atomically", write)


@pytest.mark.parametrize("named", [False, True])
def test_an_error_about_the_unit_file_itself_does_not_repeat_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, named: bool
) -> None:
    """A disk full (no file named in the error) or an error naming the unit file: its path
    is said once."""
    path = tmp_path / SYSTEM / "job.service"
    if named:
        _writes_fail(monkeypatch, PermissionError(errno.EACCES, "Permission denied", str(path)))
        reason = "Permission denied"
    else:
        _writes_fail(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
        reason = "No space left on device"
    result = new(tmp_path, "job", "--priority", "5")
    assert result.exit_code == 1, result.output
    assert result.output == f"Error: cannot write {path}: {reason}\n"


@pytest.mark.parametrize("length", [600, 601])
def test_a_cannot_write_error_is_cut_at_600_characters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    path = tmp_path / SYSTEM / "job.service"
    head = f"cannot write {path}: Read-only file system ("
    other = "/" + "t" * (length - len(head) - 2)
    _writes_fail(monkeypatch, OSError(errno.EROFS, "Read-only file system", other))
    result = new(tmp_path, "job", "--priority", "5")
    assert result.exit_code == 1, result.output
    message = f"{head}{other})"
    assert len(message) == length
    shown = message if length <= 600 else message[:600] + "..."
    assert result.output == f"Error: {shown}\n"


def test_an_existing_name_that_is_not_the_unit_is_no_unit_that_appeared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rewriting its own unit (no exclusive link), a FileExistsError is about some other
    name (mkstemp finding no free temporary name): a "cannot write", not a unit that
    "appeared while gpuslice new wrote it"."""
    assert new(tmp_path, "job", "--priority", "5").exit_code == 0
    path = tmp_path / SYSTEM / "job.service"
    tmp = str(tmp_path / SYSTEM / ".gpuslice-abcdefgh")
    _writes_fail(monkeypatch, FileExistsError(errno.EEXIST, "File exists", tmp))
    result = new(tmp_path, "job", "--priority", "6")
    assert result.exit_code == 1, result.output
    assert result.output == f"Error: cannot write {path}: File exists ({tmp})\n"
    assert "Priority=5\n" in path.read_text()


def test_a_unit_an_admin_writes_meanwhile_is_not_overwritten_in_exact_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / SYSTEM / "job.service"

    def admin_first(target: Path, data: Any, **kwargs: Any) -> os.stat_result:
        target.write_text("[Service]\nExecStart=/bin/false\n")
        return write_atomically(target, data, **kwargs)

    monkeypatch.setattr(gpuslice.cli, "write_atomically", admin_first)
    result = new(tmp_path, "job", "--priority", "5")
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"Error: {path} appeared while gpuslice new wrote it (another program, or an admin, "
        "wrote it meanwhile): not overwritten\n"
    )
    assert path.read_text() == "[Service]\nExecStart=/bin/false\n"


# ---------------------------------------------------------------------------------------------
# systemctl, and an undo that fails


def test_a_failed_reload_undoes_the_enroll_with_the_real_subprocess_run(tmp_path: Path) -> None:
    """A systemctl that exits non-zero is a failure reported with its status (never an
    exception of subprocess): the drop-in and the directory made for it are removed."""
    plain_unit(tmp_path)
    env = systemctl_on_path(tmp_path, 3)
    result = enroll(tmp_path, "plain", "--priority", "5", env=env)
    assert result.exit_code == 1, result.output
    path = tmp_path / SYSTEM / "plain.service.d/gpuslice.conf"
    assert result.output == (
        "Error: systemctl daemon-reload failed (exit status 3), so systemd has not loaded "
        f"plain.service's drop-in: removed {path}\n"
    )
    assert files(tmp_path) == ["bin/ran", "bin/systemctl", f"{SYSTEM}/plain.service"]
    assert not path.parent.exists()


def test_a_systemctl_that_cannot_run_says_why(tmp_path: Path) -> None:
    plain_unit(tmp_path)
    (tmp_path / "empty").mkdir()
    result = enroll(tmp_path, "plain", "--priority", "5", env={"PATH": str(tmp_path / "empty")})
    assert result.exit_code == 1, result.output
    path = tmp_path / SYSTEM / "plain.service.d/gpuslice.conf"
    assert result.output == (
        "Error: cannot run systemctl: No such file or directory, so systemd has not loaded "
        f"plain.service's drop-in: removed {path}\n"
    )


def test_an_undo_that_fails_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The previous drop-in cannot be put back (the disk filled meanwhile): the error says so,
    with the reason, instead of claiming it was put back."""
    plain_unit(tmp_path)
    assert enroll(tmp_path, "plain", "--priority", "5").exit_code == 0
    calls: list[Path] = []

    def write(path: Path, data: Any, **kwargs: Any) -> os.stat_result:
        calls.append(path)
        if len(calls) > 1:  # the put-back
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_atomically(path, data, **kwargs)

    monkeypatch.setattr(gpuslice.cli, "write_atomically", write)
    result = enroll(tmp_path, "plain", "--priority", "6", "--devices", "%i")  # a template's
    assert result.exit_code == 1, result.output
    path = tmp_path / SYSTEM / "plain.service.d/gpuslice.conf"
    assert result.stderr.endswith(
        f"Error: plain.service: annotation rejected; could not undo {path}: "
        "No space left on device\n"
    ), result.stderr
    assert calls == [path, path]
