"""More of gpuslice/envsafety.py at its exact words and edges: where a check that fails is
reported, what a file system that does not answer or a file that cannot be read says, the
names and values of loader variables written with specifiers, mounts of templates' instances
(checked per instance), where a walk through a regular file or a symlink to / leads, and
how much of an environment file is read."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuslice import envsafety
from gpuslice.envsafety import (
    FIX_ANSWER,
    FIX_PATH,
    EnvFileChecker,
    Finding,
    Refusal,
    RunAs,
)
from gpuslice.unitfiles import Entry
from tests.test_envsafety import ANYWHERE, GATE, LOADER, MOUNTS, TREE, USES, put
from tests.test_envsafety import root as root  # a fixture
from tests.test_envsafety_mutation import fresh_covered as fresh_covered  # autouse
from tests.test_unitfiles import link

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")

UNIT = "/etc/systemd/system/x.service"  # where the settings of `run_as` are, one a line
CRASH = "cannot be checked (RecursionError)"


def run_as(*lines: str) -> RunAs:
    """The settings `KEY=value`, at lines 1, 2, ... of UNIT."""
    found = RunAs()
    for line, text in enumerate(lines, 1):
        key, _, value = text.partition("=")
        found.assign(UNIT, Entry("Service", key, value, line))
    return found


def message(unit: str, reason: str, fix: str = FIX_PATH) -> str:
    return f"{reason}; {GATE} {unit} {fix}"


def mount_message(unit: str, reason: str, fix: str = ANYWHERE) -> str:
    return f"{reason}; {MOUNTS} gpuslice does not manage {unit} {fix}"


def boom(*args: object, **kwargs: object) -> Any:
    raise RecursionError


def answering(monkeypatch: pytest.MonkeyPatch, answer: Callable[[str], object]) -> None:
    """The environment files' reads answer `answer(path)`; every other call is made (the
    read of /etc/fstab too)."""
    real = EnvFileChecker._ask

    def ask(self: EnvFileChecker, fn: Callable[[str], Any], path: str) -> Any:
        if fn is envsafety._read_head and path != envsafety.FSTAB:
            return answer(path)
        return real(self, fn, path)

    monkeypatch.setattr(EnvFileChecker, "_ask", ask)


# ---------------------------------------------------------------------------------------------
# what a RunAs collects


def test_an_empty_root_directory_with_none_before_resets_nothing() -> None:
    found = run_as("RootDirectory=", "RootImage=/srv/a.raw", "RootImage=", "RootImage=")
    assert found.roots == {}


# ---------------------------------------------------------------------------------------------
# a check that fails is a finding at the first assignment it reads


def test_a_failed_loader_check_is_found_at_the_environment_file(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(root, "/etc/asr/x.env")
    monkeypatch.setattr(EnvFileChecker, "_loader_findings", boom)
    found = EnvFileChecker(root).check(
        "x.service", run_as("User=asr", "EnvironmentFile=/etc/asr/x.env")
    )
    assert found == [
        Finding(UNIT, 2, message("x.service", f"x.service {CRASH}"), "EnvironmentFile")
    ]


def test_a_failed_mount_check_is_found_at_the_root_directory_before_the_mounts(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(EnvFileChecker, "_mount_findings", boom)
    found = EnvFileChecker(root).check(
        "x.service", run_as("BindPaths=/a:/b", "RootDirectory=/srv/r")
    )
    assert found == [Finding(UNIT, 2, message("x.service", f"x.service {CRASH}"), "RootDirectory")]


def test_a_failed_check_of_a_unit_with_no_such_settings_is_found_at_the_unit(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing to point at: the unit's name, line 0, no key."""
    monkeypatch.setattr(EnvFileChecker, "_mount_findings", boom)
    found = EnvFileChecker(root).check("x\\x2dy.service", RunAs())
    unit = "x\\x2dy.service"
    assert found == [Finding(unit, 0, message(unit, f"{unit} {CRASH}"), "")]


# ---------------------------------------------------------------------------------------------
# EnvironmentFile=


def test_a_single_refusal_expands_the_units_specifiers(root: Path) -> None:
    put(root, "/etc/asr/b.env")
    put(root, "/etc/asr/c.env", uid=1000)
    checker = EnvFileChecker(root)
    assert checker.refusal("x@b.service", "-/etc/asr/%i.env") is None
    assert checker.refusal("x@c.service", "/etc/asr/%i.env") == Refusal(
        "/etc/asr/%i.env (/etc/asr/c.env) is owned by UID 1000, who can change it",
        envsafety.FIX_OWNERS,
    )


def test_an_environment_file_that_does_not_answer_when_read(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(root, "/etc/asr/x.env")
    answering(monkeypatch, lambda path: envsafety._Unanswered("/etc/asr"))
    found = EnvFileChecker(root).check(
        "x.service", run_as("User=asr", "EnvironmentFile=/etc/asr/x.env")
    )
    reason = (
        f"/etc/asr/x.env cannot be checked: /etc/asr did not answer within "
        f"{envsafety.DEADLINE:g} s (a network file system not answering?)"
    )
    assert found == [Finding(UNIT, 2, message("x.service", reason, FIX_ANSWER))]


def test_an_environment_file_of_a_unit_run_as_root_that_does_not_answer(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its text unknown, it may set LD_TRACE_LOADED_OBJECTS=: refused as for another user
    (it was let through unread); one root's alone that cannot be read is root's own doing."""
    put(root, "/etc/asr/x.env")
    answering(monkeypatch, lambda path: envsafety._Unanswered("/etc/asr"))
    found = EnvFileChecker(root).check("x.service", run_as("EnvironmentFile=/etc/asr/x.env"))
    reason = (
        f"/etc/asr/x.env cannot be checked: /etc/asr did not answer within "
        f"{envsafety.DEADLINE:g} s (a network file system not answering?)"
    )
    assert found == [Finding(UNIT, 1, message("x.service", reason, FIX_ANSWER))]
    answering(monkeypatch, lambda path: OSError(errno.EIO, "Input/output error"))
    assert EnvFileChecker(root).check("x.service", run_as("EnvironmentFile=/etc/asr/x.env")) == []


def test_an_environment_file_that_cannot_be_read(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(root, "/etc/asr/x.env")
    answering(monkeypatch, lambda path: OSError(errno.EIO, "Input/output error"))
    found = EnvFileChecker(root).check(
        "x.service", run_as("User=asr", "EnvironmentFile=/etc/asr/x.env")
    )
    reason = "/etc/asr/x.env cannot be read: Input/output error"
    assert found == [Finding(UNIT, 2, message("x.service", reason))]


def test_an_environment_file_replaced_by_a_fifo_after_its_walk(root: Path) -> None:
    """Only root can (its directories are root's alone): read without waiting, refused."""
    fifo = root / "etc/asr/x.env"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    # a writer: an open that waits for one (no O_NONBLOCK) would not hang the test
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        assert EnvFileChecker(root)._read_env("/etc/asr/x.env") == Refusal(
            "/etc/asr/x.env cannot be read: not a regular file", FIX_PATH
        )
    finally:
        os.close(writer)


def test_an_environment_file_is_opened_without_waiting_or_a_terminal(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO or terminal root put there must not hang the scan or become the generator's."""
    path = put(root, "/etc/asr/x.env")
    flags: list[int] = []
    real = os.open

    def record(file: Any, how: int, *args: Any, **kwargs: Any) -> int:
        flags.append(how)
        return real(file, how, *args, **kwargs)

    monkeypatch.setattr(os, "open", record)
    assert envsafety._read_head(str(path)) == b"X=1\n"
    [how] = flags
    assert how & os.O_ACCMODE == os.O_RDONLY
    want = os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    assert how & want == want


def test_an_environment_file_that_is_not_utf_8_is_read_as_systemd_reads_it(root: Path) -> None:
    """Bytes that are not UTF-8 in a comment: systemd skips it, and reads the rest."""
    put(root, "/etc/asr/x.env")
    (root / "etc/asr/x.env").write_bytes(b"# caf\xe9\nLD_PRELOAD=/home/asr/x.so\n")
    found = EnvFileChecker(root).check(
        "x.service", run_as("User=asr", "EnvironmentFile=/etc/asr/x.env")
    )
    reason = (
        "LD_PRELOAD=/home/asr/x.so (set in /etc/asr/x.env): /home/asr/x.so is under /home, "
        f"{TREE} at boot"
    )
    withheld = [f._replace(public="") for f in found]  # the value left out: test_envsafety.py
    assert withheld == [Finding(UNIT, 2, message("x.service", reason, envsafety.FIX_LOADER))]


def test_at_most_one_byte_past_the_limit_is_read_whole_chunks_joined(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read in chunks of 64 KiB: a file larger than the limit is cut one byte past it, never
    at it (which would pass as a file within it)."""
    monkeypatch.setattr(envsafety, "MAX_ENV_FILE", 1 << 16)
    text = bytes(range(256)) * (3 << 8)  # 196,608 bytes
    path = root / "big.env"
    path.write_bytes(text)
    assert envsafety._read_head(str(path)) == text[: (1 << 16) + 1]
    monkeypatch.setattr(envsafety, "MAX_ENV_FILE", 1 << 18)
    assert envsafety._read_head(str(path)) == text


# ---------------------------------------------------------------------------------------------
# the loader's variables in Environment=


def test_a_loader_value_holding_an_equals_sign_is_checked(root: Path) -> None:
    found = EnvFileChecker(root).check(
        "x.service", run_as("User=asr", "Environment=LD_PRELOAD=/home/asr/a=b.so")
    )
    reason = f"LD_PRELOAD=/home/asr/a=b.so: /home/asr/a=b.so is under /home, {TREE} at boot"
    assert found == [Finding(UNIT, 2, message("x.service", reason, LOADER), "Environment")]


def test_a_loader_variable_named_through_a_specifier_is_checked_and_unset(root: Path) -> None:
    unit = "x@_PRELOAD.service"
    checker = EnvFileChecker(root)
    found = checker.check(unit, run_as("User=asr", "Environment=LD%i=/home/asr/x.so"))
    reason = f"LD_PRELOAD=/home/asr/x.so: /home/asr/x.so is under /home, {TREE} at boot"
    assert found == [Finding(UNIT, 2, message(unit, reason, LOADER), "Environment")]
    settings = run_as("User=asr", "Environment=LD%i=/home/asr/x.so", "UnsetEnvironment=LD%i")
    assert checker.check(unit, settings) == []


def test_a_variable_whose_name_cannot_be_worked_out_is_refused_its_value_not(
    root: Path,
) -> None:
    """An unknown specifier in a name may make it LD_PRELOAD; in another's value, it is no
    loader path."""
    checker = EnvFileChecker(root)
    found = checker.check("x.service", run_as("User=asr", "Environment=LD_%q=/x"))
    why = (
        "the specifier %q has a value gpuslice does not work out (it knows %n %N %p %P %i %I "
        "%j %J %t %S %C %L %E %T %V %%)"
    )
    reason = f"LD_%q=/x cannot be checked: {why}"
    assert found == [Finding(UNIT, 2, message("x.service", reason), "Environment")]
    assert checker.check("x.service", run_as("User=asr", "Environment=FOO=%q")) == []


def test_a_long_loader_assignment_that_cannot_be_worked_out_is_cut_at_200(root: Path) -> None:
    word = "LD_PRELOAD=/" + "a" * 250 + "%q"
    found = EnvFileChecker(root).check("x.service", run_as("User=asr", f"Environment={word}"))
    assert len(found) == 1
    assert found[0].message.startswith(f"{word[:200]}... cannot be checked: the specifier %q")


# ---------------------------------------------------------------------------------------------
# mounts


def test_a_long_mount_is_cut_at_200_characters(root: Path) -> None:
    value = "/srv/" + "a" * 250 + ":/usr/bin"
    found = EnvFileChecker(root).check("x.service", run_as(f"BindPaths={value}"))
    reason = f"{value[:200]}...: its mount at /usr/bin lands on, in or above /usr/bin, {USES}"
    assert found == [Finding(UNIT, 1, mount_message("x.service", reason), "BindPaths")]


def test_a_mount_with_specifiers_is_checked_for_each_instance(root: Path) -> None:
    """Its verdict is the instance's: not remembered by the value, as others' are."""
    checker = EnvFileChecker(root)
    settings = run_as("BindPaths=/data:/%i", "BindPaths=/data:/srv/data")
    assert checker.check("x@data.service", settings) == []
    reason = f"/data:/%i: its mount at /usr lands on, in or above /usr/local/sbin, {USES}"
    assert checker.check("x@usr.service", settings) == [
        Finding(UNIT, 1, mount_message("x@usr.service", reason), "BindPaths")
    ]
    assert checker.check("x@data.service", settings) == []


def test_a_bind_through_a_symlink_to_a_file_lands_under_it(root: Path) -> None:
    """A user's bind onto /srv/link/x, /srv/link a symlink to /usr/bin/true, lands (were it
    a directory) in /usr/bin."""
    put(root, "/usr/bin/true")
    link(root, "/srv/link", "/usr/bin/true")
    found = EnvFileChecker(root).check("x.service", run_as("User=asr", "BindPaths=/d:/srv/link/x"))
    reason = (
        "/d:/srv/link/x: its mount at /srv/link/x lands at /usr/bin/true/x (symlinks "
        f"followed), on, in or above /usr/bin, {USES}"
    )
    assert found == [Finding(UNIT, 2, mount_message("x.service", reason), "BindPaths")]


def test_a_bind_through_a_symlink_to_the_root_lands_on_it(root: Path) -> None:
    link(root, "/srv/up", "/")
    found = EnvFileChecker(root).check("x.service", run_as("User=asr", "BindPaths=/d:/srv/up"))
    reason = (
        "/d:/srv/up: its mount at /srv/up lands at / (symlinks followed), on, in or above "
        f"/usr/local/sbin, {USES}"
    )
    assert found == [Finding(UNIT, 2, mount_message("x.service", reason), "BindPaths")]


def test_an_environment_file_under_a_regular_file_is_not_there(root: Path) -> None:
    """Only root, who owns the file, could make it a directory."""
    put(root, "/etc/asr/x.env")
    found = EnvFileChecker(root).check(
        "x.service", run_as("User=asr", "EnvironmentFile=/etc/asr/x.env/y")
    )
    assert found == []


# ---------------------------------------------------------------------------------------------
# EnvironmentFile= and the loader: a path that is no regular file


def test_a_loader_file_with_wildcard_characters_is_checked_as_named(root: Path) -> None:
    """The loader takes LD_PRELOAD's paths as they are; only systemd's EnvironmentFile=
    globs."""
    put(root, "/opt/lib[1]/x?.so")
    found = EnvFileChecker(root).check(
        "x.service", run_as("User=asr", "Environment=LD_PRELOAD=/opt/lib[1]/x?.so")
    )
    assert found == []
