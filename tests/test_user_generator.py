"""data/gpuslice-user-generator, run as a user's manager runs it: user units with an
[X-GPUSlice] section are told, in their own journal, that gpuslice does not schedule them.
(Against a real user manager: tests/integration/test_new.py.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

GENERATOR = Path(__file__).parent.parent / "data" / "gpuslice-user-generator"
ANNOTATED = "[Service]\nExecStart=/bin/true\n\n[X-GPUSlice]\nPriority=5\n"
DROPIN = "gpuslice-not-scheduled.conf"
# the user units' directories of the system, as the generator names them: the host's own,
# which a test must not read (an annotated user unit installed on this machine changed what
# the tests saw)
SYSTEM_DIRS = ("/etc/systemd/user", "/usr/local/lib/systemd/user", "/usr/lib/systemd/user")


def rooted(root: Path) -> Path:
    """A copy of the generator that reads SYSTEM_DIRS below `root` (where a test puts what it
    wants there, none by default), all else as shipped."""
    text = GENERATOR.read_text()
    for path in SYSTEM_DIRS:
        assert text.count(f" {path}") == 1, path  # named once, as a word of the loop
        text = text.replace(f" {path}", f" {shlex.quote(f'{root}{path}')}")
    copy = root / "gpuslice-user-generator"
    copy.write_text(text)
    return copy


def test_the_generator_reads_no_system_dir_but_those_the_tests_move() -> None:
    """`rooted` moves every directory of the system that the shipped generator's loop names:
    no test here reads one of the host's."""
    loop = re.search(r"^for dir in (.*?); do$", GENERATOR.read_text(), re.MULTILINE | re.DOTALL)
    assert loop is not None
    assert [word for word in loop[1].split() if word.startswith("/")] == list(SYSTEM_DIRS)


def generate(home: Path, *args: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = home.parent / "out"
    out.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home)}
    done = subprocess.run(
        ["sh", str(rooted(home.parent)), *(args or (str(out), str(out), str(out)))],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    return out, done


def user_dir(home: Path) -> Path:
    path = home / ".config" / "systemd" / "user"
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_an_annotated_user_unit_is_told_it_is_not_scheduled(tmp_path: Path) -> None:
    home = tmp_path / "home"
    units = user_dir(home)
    (units / "asr.service").write_text(ANNOTATED)
    (units / "plain.service").write_text("[Service]\nExecStart=/bin/true\n")
    (units / "worker@.service.d").mkdir()
    (units / "worker@.service.d" / "gpu.conf").write_text("  [X-GPUSlice]\nPriority=1\n")
    (units / "notes.txt").write_text(ANNOTATED)  # no unit
    out, done = generate(home)
    assert done.returncode == 0, done.stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.conf")) == [
        f"asr.service.d/{DROPIN}",
        f"worker@.service.d/{DROPIN}",
    ]
    text = (out / "asr.service.d" / DROPIN).read_text()
    assert (
        '\n[Service]\nExecStartPre=-/bin/sh -c \'printf "%%s\\\\n" "$1"; exec sleep 1\' '
        'gpuslice-not-scheduled "gpuslice does not schedule user units: the '
        "[X-GPUSlice] section of %n is ignored and it starts without waiting for GPUs" in text
    )
    assert done.stderr.count("is read only in system units") == 2, done.stderr


def test_a_unit_name_with_a_backslash_is_said_whole(tmp_path: Path) -> None:
    """dash's echo reads "\\c" as "print no more": the manager's journal line uses printf."""
    home = tmp_path / "home"
    (user_dir(home) / "a\\cb.service").write_text(ANNOTATED)
    _, done = generate(home)
    assert "a\\cb.service starts without waiting for GPUs" in done.stderr, done.stderr


def test_names_no_unit_could_have_and_bad_arguments_are_passed_over(tmp_path: Path) -> None:
    home = tmp_path / "home"
    units = user_dir(home)
    for name in ("a b.service", ".hidden.service", "new\nline.service", "x%y.service"):
        (units / name).write_text(ANNOTATED)
    out, done = generate(home)
    assert done.returncode == 0, done.stderr
    assert list(out.iterdir()) == []
    # never fails the manager's generators, whatever it is given
    for args in (("",), (str(tmp_path / "missing"),)):
        assert generate(home, *args)[1].returncode == 0


def test_without_a_home_nothing_is_read_from_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(
        ["sh", str(rooted(tmp_path)), str(out)],
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


def test_a_fifo_or_a_device_among_the_units_never_blocks_the_manager(tmp_path: Path) -> None:
    """A user's manager waits for its generators: a FIFO named like a unit, or a link to a
    device, is not read (grep would wait on the FIFO forever)."""
    home = tmp_path / "home"
    units = user_dir(home)
    os.mkfifo(units / "fifo.service")
    (units / "zero.service").symlink_to("/dev/zero")
    (units / "asr.service").write_text(ANNOTATED)
    out, done = generate(home)  # the timeout of 30 s fails the test if it blocks
    assert done.returncode == 0, done.stderr
    assert [p.name for p in out.iterdir()] == ["asr.service.d"]


def test_the_annotated_units_every_users_manager_reads_are_told_too(tmp_path: Path) -> None:
    """User units installed for every user (an admin's in /etc/systemd/user, a package's) are
    each user's manager's too: each is told, as the user's own are."""
    home = tmp_path / "home"
    user_dir(home)
    for i, path in enumerate(SYSTEM_DIRS):
        units = tmp_path / path.lstrip("/")
        units.mkdir(parents=True)
        (units / f"shared{i}.service").write_text(ANNOTATED)
    out, done = generate(home)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"shared{i}.service.d" for i in range(3)]
    assert done.stderr.count("is read only in system units") == 3, done.stderr
