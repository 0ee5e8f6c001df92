"""Every `gpuslice` command under hostile or unlucky input: a located error (exit 2 for usage,
1 otherwise), never a traceback, never a broken file left behind or a working one destroyed,
and nothing printed that could drive the admin's terminal."""

from __future__ import annotations

import gc
import os
import stat
import threading
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

import gpuslice.cli
from gpuslice import newunit
from gpuslice.annotations import load_spec
from gpuslice.cli import main
from gpuslice.newunit import LOCK_NAME
from gpuslice.unitfiles import MAX_FILE_SIZE

SYSTEM = "etc/systemd/system"


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(main, list(args), env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output
    return result


def new(root: Path, name: str, *args: str, command: tuple[str, ...] = ("/bin/true",)) -> Result:
    return invoke("new", name, *args, "--no-reload", "--root", str(root), "--", *command)


def enroll(root: Path, unit: str, *args: str) -> Result:
    return invoke("enroll", unit, *args, "--no-reload", "--root", str(root))


def files(root: Path) -> list[str]:
    """The files below `root`, but the lock `new` and `enroll` keep in the unit directory."""
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir() and p.name != LOCK_NAME
    )


def plain_unit(root: Path, name: str = "plain.service") -> Path:
    path = root / SYSTEM / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[Service]\nExecStart=/bin/true\n")
    return path


# ---------------------------------------------------------------------------------------------
# names


def test_new_takes_the_longest_name_it_can_gate_and_refuses_longer_ones(tmp_path: Path) -> None:
    """systemd takes 255 characters, but the generator gates a unit through `UNIT.d/`, one file
    name of at most 255: a 254- or 255-character unit would run ungated. The temporary file
    was the name plus 15 characters: every name over 240 characters was a traceback."""
    longest = "a" * (253 - len(".service"))
    result = new(tmp_path, longest, "--priority", "5")
    assert result.exit_code == 0, result.output
    assert files(tmp_path) == [f"{SYSTEM}/{longest}.service"]  # no temporary file left
    for name in ("a" * 246, "a" * 247, "a" * 246 + ".service"):
        root = tmp_path / str(len(name))
        result = new(root, name, "--priority", "5")
        assert result.exit_code == 2, result.output
        assert "characters; a unit gpuslice gates has at most 253" in result.output
        assert files(root) == []
    result = new(tmp_path / "x", "a" * 255, "--priority", "5")
    assert result.exit_code == 2
    assert "not a service name: 263 characters, systemd takes at most 255" in result.output


@pytest.mark.parametrize("name", ["-H", "--user.service", "-.service"])
def test_new_refuses_a_name_that_systemctl_takes_for_an_option(tmp_path: Path, name: str) -> None:
    """`gpuslice new --priority 5 --now -- -H /bin/true` wrote -H.service (a name systemd
    takes) and ran `systemctl start --no-block -H.service`: systemctl's -H, a host to reach
    over ssh, ".service"."""
    result = invoke(
        "new", "--priority", "5", "--now", "--root", str(tmp_path), "--", name, "/bin/true",
        env={"PATH": str(tmp_path)},  # no systemctl: nothing could be started by mistake
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "a name that starts with '-' is an option to systemctl" in result.output
    assert files(tmp_path) == []


def test_enroll_refuses_a_unit_whose_dropin_directory_cannot_exist(tmp_path: Path) -> None:
    unit = "b" * 246 + ".service"  # 254: valid for systemd, `UNIT.d` is not a file name
    result = enroll(tmp_path, unit, "--priority", "5")
    assert result.exit_code == 2, result.output
    assert "254 characters; a unit gpuslice gates has at most 253" in result.output
    assert not (tmp_path / "etc").exists()


@pytest.mark.parametrize("unit", ["a.socket", "a.timer", "a.target", "a.mount"])
def test_enroll_refuses_units_that_are_not_services(tmp_path: Path, unit: str) -> None:
    """The scan reads services only: an enrolled timer was "enrolled" and then never gated."""
    plain_unit(tmp_path, unit)
    result = enroll(tmp_path, unit, "--priority", "5")
    assert result.exit_code == 2, result.output
    assert f"{unit}: only services are scheduled" in result.output
    assert not (tmp_path / SYSTEM / f"{unit}.d").exists()


def test_enroll_of_a_unit_that_does_not_exist_says_so_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / SYSTEM).mkdir(parents=True)
    result = enroll(tmp_path, "ghost", "--priority", "5")
    assert result.exit_code == 1
    assert "ghost.service: no such unit in systemd's search path (or masked)" in result.output
    assert files(tmp_path) == []
    assert [p.name for p in (tmp_path / SYSTEM).iterdir()] == [LOCK_NAME]  # no ghost.service.d/


# ---------------------------------------------------------------------------------------------
# the command and the options


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (("/bin/echo", "\udcff"), "argument 2 ('\\xff') is not UTF-8"),
        (("/bin/echo\udcfe",), "argument 1 ('/bin/echo\\xfe') is not UTF-8"),
    ],
)
def test_new_refuses_an_argument_that_is_not_utf8(
    tmp_path: Path, command: tuple[str, ...], expected: str
) -> None:
    """`gpuslice new x -- /bin/echo $'\\xff'`: a traceback that left `.x.service.gpuslice-tmp`."""
    result = new(tmp_path, "x", "--priority", "5", command=command)
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert files(tmp_path) == []


@pytest.mark.parametrize(
    ("program", "expected"),
    [
        ('/opt/my "app"/run', "a quote, a backslash or a control character in the program's"),
        ("/opt/it's/run", "a quote, a backslash or a control character in the program's"),
        ("/opt/a\\b/run", "a quote, a backslash or a control character in the program's"),
        ("/opt/a\nb/run", "a quote, a backslash or a control character in the program's"),
        ("/opt/jobs/$JOB/run", "'$' in the program's path: systemd keeps it there"),
        ("/usr/bin/", "a directory, or a name over 255 bytes"),
        ("/opt/" + "r" * 256, "a directory, or a name over 255 bytes"),
    ],
)
def test_new_refuses_a_program_path_systemd_would_not_run(
    tmp_path: Path, program: str, expected: str
) -> None:
    """systemd refuses a unit whose program path holds a quote, a backslash or a control
    character ("Executable name contains special characters"), ends in `/` or has a name over
    255 bytes; and it does not expand `$` there, so the `$$` written for an argument's `$`
    named another file. `gpuslice new` reported each unit written: it never loaded or ran."""
    result = new(tmp_path, "job", "--priority", "5", command=(program, "arg"))
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert files(tmp_path) == []


@pytest.mark.parametrize(
    "args",
    [
        # no `--`: the job's own options were taken for gpuslice's (GPUs=2, Memory=4G)
        ("job", "--priority", "5", "/bin/echo", "train.py", "--gpus", "2", "--memory", "4G"),
        ("job", "--priority", "5", "/bin/echo", "--now"),
        # the program before `--`, its arguments after it: an option between them was ours
        ("job", "--priority", "5", "/bin/echo", "--user", "nobody", "--", "hi"),
    ],
)
def test_new_takes_the_command_only_after_dashes(tmp_path: Path, args: tuple[str, ...]) -> None:
    """click takes an option anywhere among the positional words: without `--` before the
    whole command, a unit was written that ran `/bin/echo train.py`, not what was typed."""
    result = invoke("new", *args, "--no-reload", "--root", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert "give the command after --, e.g. -- /usr/bin/python3 job.py (an option of" in (
        result.output
    )
    assert files(tmp_path) == []
    # after `--`, each word is the command's, the name too if it stands there
    result = invoke(
        "new", "--priority", "5", "--no-reload", "--root", str(tmp_path), "--", "job",
        "/bin/echo", "--gpus", "2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    text = (tmp_path / SYSTEM / "job.service").read_text()
    assert 'ExecStart="/bin/echo" "--gpus" "2"\n' in text and "GPUs=" not in text


def test_control_characters_of_the_command_are_escaped_in_the_unit(tmp_path: Path) -> None:
    """A unit file is text an admin reads with `systemctl cat`: a raw ESC would reach the
    terminal; systemd decodes `\\x1b` back into the same argument."""
    result = new(tmp_path, "x", "--priority", "5", command=("/bin/echo", "\x1b]0;pwn\x07\x7f\x0b"))
    assert result.exit_code == 0, result.output
    data = (tmp_path / SYSTEM / "x.service").read_bytes()
    assert b'ExecStart="/bin/echo" "\\x1b]0;pwn\\x07\\x7f\\x0b"\n' in data
    assert all(32 <= b < 127 or b == 10 for b in data)


def test_no_character_beyond_ascii_that_drives_or_fools_a_terminal_reaches_the_unit(
    tmp_path: Path,
) -> None:
    """Only C0 controls and DEL were escaped: a C1 control went raw (U+009B is CSI to a
    terminal that honours C1 in UTF-8), as did a BiDi override (`systemctl cat` showed the
    arguments after U+202E reversed) and zero-width characters; a noncharacter (U+1FFFE) made
    systemd drop ExecStart= as "not UTF-8 clean", and the unit failed to load. Each goes as
    its UTF-8 bytes, which systemd decodes back into the same argument; printable text stays."""
    command = ("/bin/echo", "\u009b31m", "\u202etxt.exe", "a\u200bb", "\U0001fffe", "café")
    result = new(tmp_path, "x", "--priority", "5", command=command)
    assert result.exit_code == 0, result.output
    text = (tmp_path / SYSTEM / "x.service").read_text()
    assert (
        'ExecStart="/bin/echo" "\\xc2\\x9b31m" "\\xe2\\x80\\xaetxt.exe" "a\\xe2\\x80\\x8bb" '
        '"\\xf0\\x9f\\xbf\\xbe" "café"\n'
    ) in text
    assert all(c.isprintable() or c == "\n" for c in text)


def test_new_refuses_a_command_too_long_for_a_unit_file(tmp_path: Path) -> None:
    """It wrote the file, read it back as "cannot read: larger than 1 MiB" at line 0, and
    removed it: exit 1, after destroying the previous version of the unit."""
    result = new(tmp_path, "x", "--priority", "5", command=("/bin/echo", "a" * MAX_FILE_SIZE))
    assert result.exit_code == 2, result.output
    assert "COMMAND: too long: the unit file would be" in result.output
    assert files(tmp_path) == []


@pytest.mark.parametrize("uid", ["65535", "4294967295", "4294967296", "9999999999"])
def test_new_refuses_a_uid_systemd_refuses(tmp_path: Path, uid: str) -> None:
    """systemd's uid_is_valid() refuses these: the unit would fail to load (bad-setting)."""
    result = new(tmp_path, "x", "--priority", "5", "--user", uid)
    assert result.exit_code == 2, result.output
    assert "not a user name" in result.output
    assert files(tmp_path) == []


def test_new_takes_the_highest_uid_systemd_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gpuslice.cli.user_exists", lambda user: True)  # not the host's users
    result = new(tmp_path, "x", "--priority", "5", "--user", "4294967294")
    assert result.exit_code == 0, result.output
    assert "User=4294967294\n" in (tmp_path / SYSTEM / "x.service").read_text()


@pytest.mark.parametrize("option", ["--memory", "--devices", "--preempt", "--priority"])
def test_a_bad_option_value_is_echoed_escaped(tmp_path: Path, option: str) -> None:
    args = ["--priority", "5"] if option != "--priority" else []
    result = new(tmp_path, "x", *args, option, "1\x1b]0;pwn\x07\n2")
    assert result.exit_code == 2, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "1\\x1b]0;pwn\\x07\\x0a2" in result.output


@pytest.mark.parametrize("value", ["\n8G", "8G\r", "8G\n", "\x0b8G"])
def test_an_option_value_with_a_line_end_is_refused(tmp_path: Path, value: str) -> None:
    """The parser takes a size with blanks around it, and the value was written as given:
    `--memory $'\\n8G'` wrote `Memory=` (the whole GPU) and a stray line `8G` below it."""
    result = new(tmp_path, "x", "--priority", "5", "--memory", value)
    assert result.exit_code == 2, result.output
    assert "a line end or control character" in result.output
    assert files(tmp_path) == []
    plain_unit(tmp_path)
    result = enroll(tmp_path, "plain", "--priority", "5", "--memory", value)
    assert result.exit_code == 2, result.output
    assert files(tmp_path) == [f"{SYSTEM}/plain.service"]


# ---------------------------------------------------------------------------------------------
# the files around


def test_a_rejected_rewrite_puts_the_previous_unit_back(tmp_path: Path) -> None:
    """A second `gpuslice new` whose annotation the parser refuses removed the unit the first
    one wrote: a working, gated job gone by a typo."""
    assert new(tmp_path, "job", "--priority", "5").exit_code == 0
    path = tmp_path / SYSTEM / "job.service"
    before = path.read_bytes()
    result = new(tmp_path, "job", "--priority", "6", "--devices", "%i")
    assert result.exit_code == 1
    assert "annotation rejected; put back the previous" in result.output
    assert path.read_bytes() == before
    assert files(tmp_path) == [f"{SYSTEM}/job.service"]


def test_a_rejected_enroll_puts_the_previous_dropin_back(tmp_path: Path) -> None:
    """Removed, the drop-in took the unit's annotation with it: after the next daemon-reload
    the job ran ungated, on whatever GPU it found."""
    plain_unit(tmp_path)
    assert enroll(tmp_path, "plain", "--priority", "5").exit_code == 0
    dropin = tmp_path / SYSTEM / "plain.service.d/gpuslice.conf"
    before = dropin.read_bytes()
    result = enroll(tmp_path, "plain", "--priority", "6", "--devices", "%i")
    assert result.exit_code == 1
    assert "annotation rejected; put back the previous" in result.output
    assert dropin.read_bytes() == before


def test_enroll_never_replaces_a_gpuslice_conf_it_did_not_write(tmp_path: Path) -> None:
    """An admin's own `plain.service.d/gpuslice.conf` (any drop-in may carry the section) was
    replaced whole by `gpuslice enroll plain`: its Environment= and the rest were lost."""
    plain_unit(tmp_path)
    theirs = tmp_path / SYSTEM / "plain.service.d/gpuslice.conf"
    theirs.parent.mkdir()
    theirs.write_text("[Service]\nEnvironment=MODEL=/srv/m\n\n[X-GPUSlice]\nPriority=40\n")
    before = theirs.read_bytes()
    result = enroll(tmp_path, "plain", "--priority", "5")
    assert result.exit_code == 1, result.output
    assert f"{theirs} exists and was not written by gpuslice enroll: not overwritten" in (
        result.output
    )
    assert theirs.read_bytes() == before
    assert files(tmp_path) == [f"{SYSTEM}/plain.service", f"{SYSTEM}/plain.service.d/gpuslice.conf"]


@pytest.mark.parametrize(
    ("target", "alias", "enrolled"),
    [
        ("real.service", "alias", "real.service"),  # `Alias=alias.service` in real's [Install]
        ("real@.service", "alias@gpu0", "real@gpu0.service"),  # a template's alias
    ],
)
def test_enroll_of_an_alias_annotates_the_unit_it_names(
    tmp_path: Path, target: str, alias: str, enrolled: str
) -> None:
    """`gpuslice enroll alias` wrote `alias.service.d/gpuslice.conf` and said `enrolled
    alias.service`: systemd reads that directory for the unit, but gpuslice scans a unit under
    its own name, so the generator gave it no gate and it ran ungated. Now the drop-in goes
    where `systemctl edit alias` puts its own: the directory of the name the alias leads to."""
    lib = tmp_path / "usr/lib/systemd/system"
    lib.mkdir(parents=True)
    (lib / target).write_text("[Service]\nExecStart=/bin/true\n")
    (tmp_path / SYSTEM).mkdir(parents=True)
    alias_name = target.replace("real", "alias")
    (tmp_path / SYSTEM / alias_name).symlink_to(f"/usr/lib/systemd/system/{target}")
    result = enroll(tmp_path, alias, "--priority", "5")
    assert result.exit_code == 0, result.output
    assert f"is an alias of {enrolled}: enrolling {enrolled}" in result.output
    assert files(tmp_path) == [
        f"{SYSTEM}/{alias_name}",
        f"{SYSTEM}/{enrolled}.d/gpuslice.conf",
        f"usr/lib/systemd/system/{target}",
    ]
    assert load_spec(enrolled, tmp_path)[0] is not None


def test_a_directory_made_for_a_unit_or_a_drop_in_is_root_s_whatever_the_umask(
    tmp_path: Path,
) -> None:
    """Made with the umask's mode, `enroll`'s `UNIT.d/` was 0777 when root ran it with
    `umask 0` (its drop-in 0644 all the same): any local user could then add a drop-in with
    `ExecStartPre=+...` (run as root at the unit's next start) or swap the annotation. The
    unit directory itself likewise, where `new` had to make it."""
    (tmp_path / "etc/systemd").mkdir(parents=True)
    old = os.umask(0)
    try:
        made = new(tmp_path, "job", "--priority", "1")
        plain_unit(tmp_path)
        enrolled = enroll(tmp_path, "plain", "--priority", "5")
    finally:
        os.umask(old)
    assert (made.exit_code, enrolled.exit_code) == (0, 0), made.output + enrolled.output
    for directory in (SYSTEM, f"{SYSTEM}/plain.service.d"):
        assert stat.S_IMODE((tmp_path / directory).stat().st_mode) == 0o755, directory


@pytest.mark.parametrize("umask", [0, 0o077])
def test_every_directory_new_makes_is_0755_those_above_the_unit_directory_too(
    tmp_path: Path, umask: int
) -> None:
    """Under a root with no `etc/systemd/` yet (an image being prepared), `mkdir -p` made
    `etc/` and `etc/systemd/` with the umask's mode: 0777 under `umask 0`, where any user
    could move `system/` aside and put a directory of their own there. And the umask took
    bits off the directories it did make 0755: 0700 under `umask 077` (the README says 0755
    whatever the umask, as its files are 0644 whatever it is)."""
    old = os.umask(umask)
    try:
        made = new(tmp_path, "job", "--priority", "1")
        enrolled = enroll(tmp_path, "job", "--priority", "5")
    finally:
        os.umask(old)
    assert (made.exit_code, enrolled.exit_code) == (0, 0), made.output + enrolled.output
    for directory in ("etc", "etc/systemd", SYSTEM, f"{SYSTEM}/job.service.d"):
        assert stat.S_IMODE((tmp_path / directory).stat().st_mode) == 0o755, directory


def test_a_unit_is_on_disk_before_its_name_and_its_name_before_new_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Renamed without an fsync, a unit's name could outlive its data in a power cut: an
    empty unit file, which systemd takes for a masked unit (the job gone, or the drop-in's
    annotation, so the unit ran ungated)."""
    events: list[str] = []
    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

    def fsync(fd: int) -> None:
        events.append("fsync directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append("rename")
        real_replace(src, dst)

    def link(src: Any, dst: Any) -> None:
        events.append("link")
        real_link(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "link", link)
    assert new(tmp_path, "job", "--priority", "5").exit_code == 0
    assert events == ["fsync file", "link", "fsync directory"]  # made: never over another
    events.clear()
    assert new(tmp_path, "job", "--priority", "6").exit_code == 0
    assert events == ["fsync file", "rename", "fsync directory"]
    events.clear()
    plain_unit(tmp_path)
    assert enroll(tmp_path, "plain", "--priority", "5").exit_code == 0
    assert events == ["fsync file", "link", "fsync directory"]  # as new's
    events.clear()
    assert enroll(tmp_path, "plain", "--priority", "6").exit_code == 0
    assert events == ["fsync file", "rename", "fsync directory"]


@pytest.mark.parametrize(
    "unit", ["gpuslice", "dbus", "nvidia-persistenced", "nvidia-fabricmanager", "dbus-broker"]
)
def test_enroll_refuses_the_controller_and_what_it_starts_after(tmp_path: Path, unit: str) -> None:
    """`gpuslice enroll nvidia-persistenced --priority 0` was taken: gated, the unit was
    ordered after gpuslice.service, which starts after it, a cycle systemd breaks at boot by
    dropping a start job, perhaps the controller's; gpuslice.service itself, gated, waited at
    its restart for the controller it was. The annotation is refused and the drop-in removed."""
    plain_unit(tmp_path, f"{unit}.service")
    result = enroll(tmp_path, unit, "--priority", "0")
    assert result.exit_code == 1, result.output
    assert "gpuslice.service starts after this unit, or is it" in result.output
    assert "annotation rejected; removed" in result.output
    assert files(tmp_path) == [f"{SYSTEM}/{unit}.service"]


def test_new_names_the_dropins_an_earlier_unit_of_its_name_left(tmp_path: Path) -> None:
    """A unit once enrolled (its `gpuslice.conf` says every key) and then deleted without its
    `NAME.d/`: `gpuslice new NAME --type background` wrote a unit that the old drop-in made
    on-demand and gave the old priority, and said nothing of it."""
    old = tmp_path / SYSTEM / "job.service.d/gpuslice.conf"
    old.parent.mkdir(parents=True)
    old.write_text("[X-GPUSlice]\nPriority=5\nType=on-demand\nGPUs=1\nRequeue=yes\n")
    edit = tmp_path / "run/systemd/system/job.service.d/override.conf"
    edit.parent.mkdir(parents=True)
    edit.write_text("[Service]\nEnvironment=OLD=1\n")
    gate = tmp_path / "run/systemd/generator/job.service.d/gpuslice-gate.conf"
    gate.parent.mkdir(parents=True)
    gate.write_text("[Service]\n")  # the generator's: made anew at the next reload
    service_wide = tmp_path / SYSTEM / "service.d/all.conf"
    service_wide.parent.mkdir(parents=True)
    service_wide.write_text("[Service]\n")  # every service's, on purpose
    result = new(tmp_path, "job", "--priority", "50", "--type", "background")
    assert result.exit_code == 0, result.output
    assert (
        "warning: drop-ins made before job.service apply to it too: "
        "/etc/systemd/system/job.service.d/gpuslice.conf, "
        "/run/systemd/system/job.service.d/override.conf (remove those"
    ) in result.output
    # a rewrite of its own unit says nothing: the drop-ins were made for it, or named before
    result = new(tmp_path, "job", "--priority", "50", "--type", "background")
    assert result.exit_code == 0 and "warning" not in result.output


def test_new_never_replaces_a_unit_written_after_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An admin's unit (or another program's) written between `gpuslice new`'s look at the
    search path and its write: the rename replaced it, and the admin's job was gone."""
    real_existing_unit = newunit.existing_unit

    def look(unit: str, root: Path) -> Path | None:
        found = real_existing_unit(unit, root)
        plain_unit(tmp_path, "job.service")  # the admin's, just after the look
        return found

    monkeypatch.setattr(gpuslice.cli, "existing_unit", look)
    result = new(tmp_path, "job", "--priority", "5")
    assert result.exit_code == 1, result.output
    assert f"{tmp_path / SYSTEM}/job.service appeared while gpuslice new wrote it" in result.output
    assert (tmp_path / SYSTEM / "job.service").read_text() == "[Service]\nExecStart=/bin/true\n"
    assert files(tmp_path) == [f"{SYSTEM}/job.service"]  # no temporary file left


def test_enroll_never_replaces_a_dropin_written_after_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An admin's own `gpuslice.conf` written between `enroll`'s look (none there) and its
    write, fsync included: the rename replaced it, its other settings with it, though enroll
    never replaces a gpuslice.conf it did not write."""
    plain_unit(tmp_path)
    dropin = tmp_path / SYSTEM / "plain.service.d/gpuslice.conf"
    admins = "[Service]\nEnvironment=MODEL=/srv/m\n[X-GPUSlice]\nPriority=7\n"
    real_write = newunit.write_atomically

    def admin_first(target: Path, data: Any, **kwargs: Any) -> os.stat_result:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(admins)
        return real_write(target, data, **kwargs)

    monkeypatch.setattr(gpuslice.cli, "write_atomically", admin_first)
    result = enroll(tmp_path, "plain", "--priority", "5")
    assert result.exit_code == 1, result.output
    assert f"{dropin} appeared while gpuslice enroll wrote it" in result.output
    assert dropin.read_text() == admins
    assert files(tmp_path) == [f"{SYSTEM}/plain.service", f"{SYSTEM}/plain.service.d/gpuslice.conf"]


@pytest.mark.timeout(20)
def test_two_new_of_one_name_at_once_run_one_after_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `gpuslice new job` at once (two admins, a script in a loop) each read the unit
    there, wrote its own and read back whatever was there by then: the last rename won. Here
    the first one's annotation is refused, and its undo put back the unit it had read over
    the one the second had written and reported written: the second's unit lost, silently.
    With the unit directory's lock, the second waits, then rewrites what the first left."""
    assert new(tmp_path, "job", "--priority", "5").exit_code == 0
    path = tmp_path / SYSTEM / "job.service"
    first_writes, second_waits_or_done = threading.Event(), threading.Event()
    real_write, real_lock = newunit.write_atomically, newunit.lock_unit_dir

    def write(path: Path, data: bytes, **kwargs: Any) -> os.stat_result:
        if threading.current_thread().name == "first" and not first_writes.is_set():
            first_writes.set()
            assert second_waits_or_done.wait(10)
        return real_write(path, data, **kwargs)

    def lock(directory: Path, *, wait: bool = True) -> int:
        if threading.current_thread().name == "second" and wait:
            second_waits_or_done.set()
        return real_lock(directory, wait=wait)

    monkeypatch.setattr(gpuslice.cli, "write_atomically", write)
    monkeypatch.setattr(gpuslice.cli, "lock_unit_dir", lock)
    outcome: dict[str, str] = {}

    def run(*args: str) -> None:
        name = threading.current_thread().name
        try:
            main.main(
                ["new", "job", *args, "--no-reload", "--root", str(tmp_path), "--", "/bin/true"],
                standalone_mode=False,
            )
            outcome[name] = "written"
        except click.ClickException as e:
            outcome[name] = e.format_message()
        finally:
            if name == "second":
                second_waits_or_done.set()

    first = threading.Thread(target=run, args=("--priority", "6", "--devices", "%i"), name="first")
    second = threading.Thread(target=run, args=("--priority", "7"), name="second")
    first.start()
    assert first_writes.wait(10)
    second.start()
    first.join(10)
    second.join(10)
    assert "annotation rejected; put back the previous" in outcome["first"]
    assert outcome["second"] == "written"
    assert "Priority=7\n" in path.read_text()  # what the second said it wrote
    assert files(tmp_path) == [f"{SYSTEM}/job.service"]
    # no other user can open the lock, and so hold every `gpuslice new` waiting
    assert stat.S_IMODE((tmp_path / SYSTEM / LOCK_NAME).stat().st_mode) == 0o600


def test_a_unit_file_it_cannot_write_is_a_located_error(tmp_path: Path) -> None:
    """A read-only /etc, or a file where a directory should be: a traceback before."""
    (tmp_path / "etc/systemd").mkdir(parents=True)
    (tmp_path / SYSTEM).write_text("")
    result = new(tmp_path, "job", "--priority", "5")
    assert result.exit_code == 1
    assert f"cannot write {tmp_path / SYSTEM}/job.service: File exists" in result.output
    result = enroll(tmp_path, "job", "--priority", "5")
    assert result.exit_code == 1
    assert f"cannot write {tmp_path / SYSTEM}/job.service.d/gpuslice.conf: " in result.output


@pytest.mark.timeout(10)
def test_new_does_not_wait_on_a_unit_that_is_a_fifo(tmp_path: Path) -> None:
    """Whether the unit is its own was read with a blocking open(): a FIFO there (or a link
    to one) held `gpuslice new` forever."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / SYSTEM).mkdir(parents=True)
    (tmp_path / SYSTEM / "job.service").symlink_to(fifo)
    result = new(tmp_path, "job", "--priority", "5")
    assert result.exit_code == 1
    assert "exists and was not written by gpuslice new: not overwritten" in result.output


@pytest.mark.parametrize(
    "directory",
    [
        "usr/local/lib/systemd/system",  # `make install`'s gpuslice.service, an admin's units
        "run/systemd/generator.late",  # a SysV script's unit
        "run/systemd/generator",
        "etc/systemd/system.attached",  # a portable service
        "run/systemd/transient",  # systemd-run --unit: it would shadow the one written
        "etc/systemd/system.control",
    ],
)
def test_new_shadows_no_unit_anywhere_in_the_search_path(tmp_path: Path, directory: str) -> None:
    """`gpuslice new gpuslice ...` on a host where `make install` put gpuslice.service in
    /usr/local/lib/systemd/system wrote /etc/systemd/system/gpuslice.service over it: after the
    next daemon-reload the controller's unit was a GPU job that waited for the controller."""
    theirs = tmp_path / directory / "gpuslice.service"
    theirs.parent.mkdir(parents=True)
    theirs.write_text("[Service]\nExecStart=/usr/local/bin/gpuslice controller\n")
    result = new(tmp_path, "gpuslice", "--priority", "5")
    assert result.exit_code == 1, result.output
    assert f"{theirs} exists and was not written by gpuslice new" in result.output
    assert files(tmp_path) == [f"{directory}/gpuslice.service"]


def test_new_now_refuses_to_leave_out_the_reload(tmp_path: Path) -> None:
    """`--now --no-reload` started the unit as systemd knew it before the reload it left out:
    a new one not found, a rewritten one with its old command and old annotation."""
    result = new(tmp_path, "job", "--priority", "5", "--now")
    assert result.exit_code == 2, result.output
    assert "--now needs the daemon-reload that --no-reload leaves out" in result.output
    assert files(tmp_path) == []


def test_a_systemctl_that_cannot_run_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    result = invoke(
        "new", "job", "--priority", "5", "--root", str(tmp_path), "--", "/bin/true",
        env={"PATH": str(tmp_path)},
    )  # fmt: skip
    assert result.exit_code == 1
    assert "wrote " in result.output and "cannot run systemctl: " in result.output


# ---------------------------------------------------------------------------------------------
# the controller's answers


# dbus-next leaves the socket of a connection that failed unclosed (message_bus.py,
# _setup_socket): harmless in a command that exits, a ResourceWarning here.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["plan", "x"]])
def test_no_system_bus_is_an_error_not_a_traceback(tmp_path: Path, args: list[str]) -> None:
    address = f"unix:path={tmp_path}/no-bus-here"
    result = invoke(*args, env={"GPUSLICE_BUS_ADDRESS": address})
    assert result.exit_code == 1
    assert "cannot reach the system bus to ask the gpuslice controller (" in result.output
    del result
    gc.collect()  # the leaked socket warns now, under this test's filters


def _answering(monkeypatch: pytest.MonkeyPatch, answer: str) -> None:
    async def call(address: Any, member: str, *args: str) -> str:
        return answer

    monkeypatch.setattr(gpuslice.cli, "_call_controller", call)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("not json", "answer is not JSON ("),
        ("[" * 100_000 + "]" * 100_000, "answer is not JSON ("),
        ("[]", "answer is not a JSON object: []"),
        ("1e999", "answer is not JSON (1e999 is not a finite number)"),
        ('{"x": NaN}', "answer is not JSON (NaN is not JSON)"),
        ("{}", "answer is not what this gpuslice reads (KeyError"),
        ('{"gpus": 1, "summary": 2, "decisions": 3}', "answer is not what this gpuslice reads ("),
    ],
)
@pytest.mark.parametrize("args", [["status"], ["plan", "x"]])
def test_a_malformed_answer_is_an_error_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, args: list[str], answer: str, expected: str
) -> None:
    _answering(monkeypatch, answer)
    result = invoke(*args)
    assert result.exit_code == 1, result.output
    assert expected in result.output


_HOLDER = '{"unit": "a.service", "priority": 1, "state": "running", "memory_declared": %s}'
_WAITER = '{"unit": "w.service", "priority": 1, "reason": "r", "position": 1, "since": %s}'


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        # Python's reader takes 1e999 for infinity; the table's sizes and durations then
        # raised OverflowError: a traceback
        ('{"gpus": [{"index": 0, "holders": [%s]}]}' % (_HOLDER % "1e999"), "not JSON (1e999"),
        ('{"gpus": [], "waiting": [%s]}' % (_WAITER % "-1e999"), "not JSON (-1e999"),
        # a number Python's ints hold, too large for the float arithmetic of a duration
        ('{"gpus": [], "waiting": [%s]}' % (_WAITER % ("9" * 400)), "not what this gpuslice"),
    ],
)
def test_an_answer_whose_numbers_the_table_cannot_take_is_an_error_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, answer: str, expected: str
) -> None:
    _answering(monkeypatch, answer)
    result = invoke("status")
    assert result.exit_code == 1, result.output
    assert expected in result.output
    assert not isinstance(result.exception, ArithmeticError), result.exception


def test_status_and_plan_print_no_control_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    evil = "a\x1b]0;pwn\x07.service"
    _answering(
        monkeypatch,
        '{"gpus": [{"index": 0, "holders": [{"unit": "a\\u001b]0;pwn\\u0007.service",'
        ' "priority": 1, "state": "running"}]}], "waiting": [], "preempted": [], "held": [],'
        ' "finished": [], "failed": [], "summary": "a\\u001b[2J", "decisions":'
        ' [{"message": "b\\u009b31m"}]}',
    )
    for args in (["status"], ["plan", "x"]):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        assert not any(c in result.output for c in "\x1b\x07\x9b"), result.output
    assert "a\\x1b]0;pwn\\x07.service" in invoke("status").output
    assert evil not in invoke("status", "--json").output  # JSON escapes it itself


def test_a_number_too_large_is_named_in_its_first_40_characters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A float of 400 digits is infinity to Python's reader: the error names it, cut."""
    _answering(monkeypatch, '{"x": 1' + "0" * 400 + ".5}")
    result = invoke("status")
    assert result.exit_code == 1, result.output
    assert f"not JSON (1{'0' * 39}... is not a finite number)" in result.output
