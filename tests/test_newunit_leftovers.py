"""`gpuslice new` where it failed late or spoke Python: a User= the host does not know (the
unit failed only when started) or that systemd takes but gpuslice refused (`john.doe`), a
program that is not there (each start failed, unsaid), a daemon-reload or a start that fails
after the unit was written (the file was left behind, unsaid), and an invalid `--type` (the
enum's own error). systemctl and the host's users are stood in for: nothing here depends on the
machine."""

from __future__ import annotations

import os
import pwd
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from gpuslice import newunit
from gpuslice.annotations import KEYS
from gpuslice.annotations import load_spec as real_load_spec
from gpuslice.cli import main
from gpuslice.newunit import LOCK_NAME, lock_unit_dir

SYSTEM = "etc/systemd/system"
NO_SUCH_USER = "gpuslice-no-such-user"  # 21 characters: a name systemd takes without a lookup


def invoke(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output
    return result


def new(root: Path, name: str, *args: str, reload: bool = False) -> Result:
    """`gpuslice new NAME ARGS -- /bin/true`; with `reload`, systemctl (stood in for) runs."""
    return invoke(
        "new", name, *args, *([] if reload else ["--no-reload"]), "--root", str(root),
        "--", "/bin/true",
    )  # fmt: skip


def files(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir() and p.name != LOCK_NAME
    )


def systemctl(
    monkeypatch: pytest.MonkeyPatch, status: Callable[[list[str]], int]
) -> list[list[str]]:
    """systemctl stood in for: each command's exit status is `status(command)` (which may
    raise OSError: not found); the commands run, in order."""
    ran: list[list[str]] = []

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        ran.append(command)
        return subprocess.CompletedProcess(command, status(command), "", "")

    monkeypatch.setattr(subprocess, "run", run)
    return ran


# ---------------------------------------------------------------------------------------------
# --user


def test_new_refuses_a_user_the_host_does_not_know_and_takes_root(tmp_path: Path) -> None:
    """User=NAME was written as given: the unit was reported written and failed only when
    started ("Failed to determine user credentials")."""
    with pytest.raises(KeyError):
        pwd.getpwnam(NO_SUCH_USER)
    result = new(tmp_path, "job", "--priority", "5", "--user", NO_SUCH_USER)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for --user: '{NO_SUCH_USER}': no such user on this host" in (
        result.output
    )
    assert files(tmp_path) == []
    for user in ("root", "0"):
        result = new(tmp_path, f"job{user}", "--priority", "5", "--user", user)
        assert result.exit_code == 0, result.output
        assert f"User={user}\n" in (tmp_path / SYSTEM / f"job{user}.service").read_text()


def test_new_looks_a_user_up_by_name_or_by_uid_when_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A numeric UID must be known too: systemd needs the user's group, and fails the start
    for one its database lacks. root and nobody (0, 65534) it makes up without a lookup."""
    names, uids = {"asr": 1234}, {1234: "asr"}

    def getpwnam(name: str) -> Any:
        return names[name]

    def getpwuid(uid: int) -> Any:
        return uids[uid]

    monkeypatch.setattr(pwd, "getpwnam", getpwnam)
    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    for user, known in [
        ("asr", True), ("1234", True), ("root", True), ("0", True), ("nobody", True),
        ("65534", True),
        ("bob", False), ("4321", False), ("asr1", False),
    ]:  # fmt: skip
        result = new(tmp_path, "job", "--priority", "5", "--user", user)
        assert result.exit_code == (0 if known else 2), (user, result.output)
        assert ("no such user on this host" in result.output) is not known, user


def test_a_uid_past_what_the_database_takes_is_unknown_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def getpwuid(uid: int) -> Any:
        raise OverflowError("uid is greater than maximum")

    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    assert not newunit.user_exists("4294967294")


# names systemd's relaxed rule takes (valid_user_group_name(VALID_USER_RELAX|ALLOW_NUMERIC)):
# SSSD's, Samba's, winbind's, ... (`gpuslice new` took `[a-z_][a-z0-9_-]*` alone)
SYSTEMD_TAKES = [
    "john.doe", "John", "JOHN", "1st", "0x1", "_x", "x$", "-john", "+5", "a b", "DOM\\john",
    "jöhn", "ユーザー", "a@example.com", "a\u0085b", "x" * 10_000,
    "a\ud7ffb", "a\ue000b", "a\ufdcfb", "a\ufdf0b",  # next to the surrogates, non-characters
    "0", "1", "65534", "65536", "4294967294",
]  # fmt: skip
# what systemd refuses (the unit fails to load: bad-setting), or what could not be written as
# it is: a specifier, a line joined to the next, an injected line
REFUSED = [
    "", ".", "..", " john", "john ", " ", "a:b", "a/b", "john\n", "root\nExecStartPre=/bin/evil",
    "a\rb", "a\tb", "a\x00b", "a\x1bb", "a\x7fb", "%i", "a%%b", "john%", "john\\",
    "00", "0123", "65535", "4294967295", "4294967296", "99999999999", "-1", "-", "-0",
    "a\udcffb", "a\ufffeb", "a\U0010ffffb", "a\ufdd0b",
    "a\ud800b", "a\udfffb", "a\ufdefb",  # the ends of the surrogates and non-characters
    "x" * 10_000 + "\n",
]  # fmt: skip


@pytest.mark.parametrize("user", SYSTEMD_TAKES)
def test_new_takes_the_user_names_systemd_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user: str
) -> None:
    """`john.doe` (an SSSD or AD account) was refused as "not a user name"."""
    monkeypatch.setattr("gpuslice.cli.user_exists", lambda name: name == user)  # not the host's
    assert newunit.is_user_name(user)
    result = new(tmp_path, "job", "--priority", "5", "--user", user)
    assert result.exit_code == 0, result.output[:300]
    text = (tmp_path / SYSTEM / "job.service").read_text(encoding="utf-8")
    assert f"\nUser={user}\n" in text


@pytest.mark.parametrize("user", REFUSED)
def test_new_refuses_what_systemd_refuses_or_would_read_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user: str
) -> None:
    """Refused before the user database is asked (no lookup of a hostile name), escaped and
    cut short in the message, nothing written."""

    def user_exists(name: str) -> bool:
        raise AssertionError(f"looked up {name!r}")

    monkeypatch.setattr("gpuslice.cli.user_exists", user_exists)
    assert not newunit.is_user_name(user)
    result = new(tmp_path, "job", "--priority", "5", "--user", user)
    assert result.exit_code == 2, result.output
    assert "Invalid value for --user" in result.output
    assert "not a user name systemd takes" in result.output
    assert "\nExecStartPre" not in result.output and "\x00" not in result.output
    assert len(result.output) < 2_000
    assert files(tmp_path) == []


def test_a_name_of_digits_but_not_ascii_ones_is_looked_up_as_a_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """systemd parses a UID of ASCII digits alone; `²` (which int() refuses: a traceback)
    and `١٢٣` (which int() reads as 123: another user's UID) are names to it."""
    asked: list[object] = []

    def getpwnam(name: str) -> Any:
        asked.append(name)
        raise KeyError(name)

    def getpwuid(uid: int) -> Any:
        asked.append(uid)
        raise KeyError(uid)

    monkeypatch.setattr(pwd, "getpwnam", getpwnam)
    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    for user in ("²", "١٢٣", "\uff11\uff12\uff13"):
        assert newunit.is_user_name(user)
        assert not newunit.user_exists(user)
    assert asked == ["²", "١٢٣", "\uff11\uff12\uff13"]


# ---------------------------------------------------------------------------------------------
# a program that is not there


@pytest.mark.parametrize(
    "missing", ["gone", "dangling", "loop", "true/x", f"{'d' * 200}/{'p' * 200}"]
)
def test_a_program_that_is_not_there_is_written_with_a_warning(
    tmp_path: Path, missing: str
) -> None:
    """Each start failed (status=203/EXEC), unsaid; it is not refused, as the program may be
    on a file system mounted later. Named whole, however long (up to PATH_MAX)."""
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # ELOOP at each start too
    (tmp_path / "true").write_text("#!/bin/sh\n")
    program = f"{tmp_path}/{missing}"
    result = CliRunner().invoke(
        main, ["new", "job", "--priority", "5", "--no-reload", "--root", str(tmp_path), "--",
               program, "--flag"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    warning = (
        f"warning: {program} does not exist (yet): each start of job.service fails "
        "(status=203/EXEC) until it does\n"
    )
    assert result.stderr == warning
    [exec_start] = [
        line
        for line in (tmp_path / SYSTEM / "job.service").read_text().splitlines()
        if line.startswith("ExecStart=")
    ]
    assert program in exec_start


def test_a_program_that_is_there_gets_no_warning(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to("/bin/true")
    for program in ("/bin/true", f"{tmp_path}/link"):
        result = CliRunner().invoke(
            main, ["new", "job", "--priority", "5", "--no-reload", "--root", str(tmp_path),
                   "--", program],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        assert result.stderr == ""


# ---------------------------------------------------------------------------------------------
# a daemon-reload or a start that fails after the write


def _fails(*failing: str) -> Callable[[list[str]], int]:
    return lambda command: 1 if command[1] in failing else 0


@pytest.mark.parametrize("now", [False, True])
def test_a_failed_reload_removes_the_unit_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, now: bool
) -> None:
    """The unit stayed on disk, unloaded, for some later daemon-reload to bring in: a job
    half installed, and the error did not say the file was there."""
    ran = systemctl(monkeypatch, _fails("daemon-reload"))
    result = new(tmp_path, "job", "--priority", "5", *(["--now"] if now else []), reload=True)
    assert result.exit_code == 1, result.output
    path = tmp_path / SYSTEM / "job.service"
    assert (
        "Error: systemctl daemon-reload failed (exit status 1), so systemd has not loaded "
        f"job.service: removed {path}\n"
    ) in result.output
    assert files(tmp_path) == []
    assert ran == [["systemctl", "daemon-reload"]]  # and no start


def test_a_systemctl_that_cannot_run_removes_the_unit_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(command: list[str]) -> int:
        raise FileNotFoundError(2, "No such file or directory", "systemctl")

    systemctl(monkeypatch, missing)
    result = new(tmp_path, "job", "--priority", "5", reload=True)
    assert result.exit_code == 1, result.output
    assert "cannot run systemctl: " in result.output
    assert f"removed {tmp_path / SYSTEM / 'job.service'}" in result.output
    assert files(tmp_path) == []


def test_a_failed_reload_puts_back_the_unit_new_had_written_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert new(tmp_path, "job", "--priority", "5").exit_code == 0
    path = tmp_path / SYSTEM / "job.service"
    before = path.read_bytes()
    systemctl(monkeypatch, _fails("daemon-reload"))
    result = new(tmp_path, "job", "--priority", "6", reload=True)
    assert result.exit_code == 1, result.output
    assert f"so systemd has not loaded job.service: put back the previous {path}" in (result.output)
    assert path.read_bytes() == before


def reload_fails_after_a_rewrite(path: Path, theirs: str) -> Callable[[list[str]], int]:
    """A systemctl whose daemon-reload fails after another writer renamed its own file over
    `path` (an admin's editor, `systemctl edit`)."""

    def run(command: list[str]) -> int:
        tmp = path.with_name(".theirs")
        tmp.write_text(theirs)
        os.replace(tmp, path)
        return 1

    return run


def test_a_failed_reload_leaves_a_unit_another_writer_put_there_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The undo removes the file this run wrote (its device and inode), never one an admin's
    editor or another program renamed over it while the reload ran."""
    path = tmp_path / SYSTEM / "job.service"
    theirs = "[Service]\nExecStart=/bin/true\n"
    systemctl(monkeypatch, reload_fails_after_a_rewrite(path, theirs))
    result = new(tmp_path, "job", "--priority", "5", reload=True)
    assert result.exit_code == 1, result.output
    assert f"left {path} as it is: another program replaced it since it was written" in (
        result.output
    )
    assert path.read_text() == theirs


def reload_noting_the_lock(root: Path, held: list[bool], status: int) -> Callable[[list[str]], int]:
    """A systemctl whose daemon-reload notes in `held` whether the unit directory's lock is
    held while it runs, and exits with `status`."""

    def run(command: list[str]) -> int:
        try:
            os.close(lock_unit_dir(root / SYSTEM, wait=False))
            held.append(False)
        except BlockingIOError:
            held.append(True)
        return status

    return run


def test_the_reload_and_its_undo_hold_the_unit_directory_s_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another `gpuslice new` of this name waits until the reload is done or undone: the undo
    never meets its unit."""
    held: list[bool] = []
    systemctl(monkeypatch, reload_noting_the_lock(tmp_path, held, 1))
    assert new(tmp_path, "job", "--priority", "5", reload=True).exit_code == 1
    assert held == [True]


def test_a_failed_start_keeps_the_unit_and_says_where_it_is_and_how_to_see_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reloaded, the unit is valid and installed: it stays, and the start can be tried
    again. The error said only `systemctl start --no-block job.service failed`."""
    ran = systemctl(monkeypatch, _fails("start"))
    result = new(tmp_path, "job", "--priority", "5", "--now", reload=True)
    assert result.exit_code == 1, result.output
    path = tmp_path / SYSTEM / "job.service"
    assert (
        "Error: systemctl start --no-block job.service failed (exit status 1): job.service is "
        f"written ({path}) and installed, but not started; `systemctl status job.service` and "
        "`journalctl -u job.service` say why, `systemctl start job.service` tries again\n"
    ) in result.output
    assert files(tmp_path) == [f"{SYSTEM}/job.service"]
    assert ran == [
        ["systemctl", "daemon-reload"],
        ["systemctl", "start", "--no-block", "job.service"],
    ]


def test_a_rejected_annotation_leaves_a_unit_another_writer_put_there_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-back's undo, as the reload's: it removed whatever file was at the path."""
    path = tmp_path / SYSTEM / "job.service"
    theirs = "[Service]\nExecStart=/bin/true\n"

    def load_spec(unit: str, root: Any) -> Any:
        found = real_load_spec(unit, root)
        tmp = path.with_name(".theirs")
        tmp.write_text(theirs)
        os.replace(tmp, path)
        return found

    monkeypatch.setattr("gpuslice.cli.load_spec", load_spec)
    result = new(tmp_path, "job", "--priority", "5", "--devices", "%i")
    assert result.exit_code == 1, result.output
    assert f"annotation rejected; left {path} as it is" in result.output
    assert path.read_text() == theirs


# ---------------------------------------------------------------------------------------------
# --type and the other options: click's words, not Python's


@pytest.mark.parametrize("command", ["new", "enroll"])
def test_an_invalid_type_is_refused_in_click_s_words(tmp_path: Path, command: str) -> None:
    """It said "Type=urgent: 'urgent' is not a valid UnitKind", the enum's own error."""
    plain = tmp_path / SYSTEM / "plain.service"
    plain.parent.mkdir(parents=True)
    plain.write_text("[Service]\nExecStart=/bin/true\n")
    args = ["--priority", "5", "--type", "urgent", "--no-reload", "--root", str(tmp_path)]
    if command == "new":
        result = invoke("new", "job", *args, "--", "/bin/true")
    else:
        result = invoke("enroll", "plain", *args)
    assert result.exit_code == 2, result.output
    assert (
        "Error: Invalid value for '--type': 'urgent' is not one of 'on-demand', 'background'.\n"
    ) in result.output
    assert files(tmp_path) == [f"{SYSTEM}/plain.service"]


def test_no_option_of_new_speaks_python(tmp_path: Path) -> None:
    """Each annotation option with a value none takes (Preempt= is a list of rungs, not one
    enum value: its own words, as before); nothing names a Python type."""
    for option in ("--priority", "--type", "--gpus", "--memory", "--devices", "--preempt"):
        args = ["--priority", "5"] if option != "--priority" else []
        result = new(tmp_path, "job", *args, option, "urgent")
        assert result.exit_code == 2, result.output
        assert f"Invalid value for '{option}': " in result.output
        for python in ("is not a valid", "UnitKind", "Rung"):
            assert python not in result.output, option


def test_a_type_with_a_control_character_is_echoed_escaped(tmp_path: Path) -> None:
    """click.Choice quotes the value as given: a terminal's escape sequence would reach the
    admin's terminal raw."""
    result = new(tmp_path, "job", "--priority", "5", "--type", "on-\x1b]0;pwn\x07demand\n")
    assert result.exit_code == 2, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "on-\\\\x1b]0;pwn\\\\x07demand\\\\x0a' is not one of 'on-demand', 'background'." in (
        result.output
    )
    assert files(tmp_path) == []


def test_the_annotation_options_built_now_are_those_new_and_enroll_take() -> None:
    """`annotation_options` runs once, when gpuslice.cli is imported: options built again now
    are the ones `gpuslice new` and `gpuslice enroll` were built with (names, flags, whether
    required, defaults, choices, help, validated or not). mutmut runs each mutant in a
    process that imported gpuslice.cli before the mutant was switched on; this is where a
    mutant of the option table is seen."""
    import click

    from gpuslice import cli

    def shape(p: click.Parameter) -> tuple[object, ...]:
        kind = getattr(p.type, "choices", None) or p.type.name
        shown = getattr(p, "help", None), getattr(p, "is_flag", None)
        validated = p.callback is not None
        return (p.name, p.opts, p.secondary_opts, p.required, p.default, kind, *shown, validated)

    built = click.command()(newunit.annotation_options(lambda **_: None))
    names = {p.name for p in built.params}
    assert len(names) == len(KEYS)
    for command in (cli.new, cli.enroll):
        taken = [p for p in command.params if p.name in names]
        assert [shape(p) for p in taken] == [shape(p) for p in built.params]
    # and each validates by its own key: a value taken, a bad one refused in the key's words
    given = CliRunner().invoke(built, ["--priority", "5", "--memory", "8G", "--gpus", "2"])
    assert given.exit_code == 0 and given.exception is None, given.output
    refused = CliRunner().invoke(built, ["--priority", "5", "--gpus", "many"])
    assert refused.exit_code == 2 and "--gpus" in refused.output, refused.output
