"""Mutants of this session's changes that the suite let live (mutmut, 2026-12-07): a PID no
longer the job's met in the middle of a resume or of a suspend's undo, a unit file's
directories that cannot be looked at, a path given relative or through `..`, and a program
path that cannot be looked at."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuslice import newunit, unitfiles
from gpuslice.checkpoint import resume, suspend
from gpuslice.cli import main
from gpuslice.unitfiles import UnitIndex
from tests.test_checkpoint import FAST, calls, failure, run, stub
from tests.test_controller import write_unit
from tests.test_status_privacy import LEAK, _privacy


def looked_at_until(pid: int, looks: int) -> Callable[[int], bool]:
    """An `owned` of checkpoint's: every PID is the job's, `pid` only for its first `looks`
    looks (then freed and given to another unit's process)."""
    seen: list[int] = []

    def owned(looked: int) -> bool:
        seen.append(looked)
        return looked != pid or seen.count(pid) <= looks

    return owned


LOCKED_AND_CHECKPOINTED = (
    'case "$*" in\n'
    '  "--get-state --pid 11") echo checkpointed ;;\n'
    '  "--get-state --pid 12") echo locked ;;\n'
    "esac"
)


def test_a_resume_goes_on_past_a_pid_no_longer_the_jobs(tmp_path: Path) -> None:
    tool = stub(tmp_path, LOCKED_AND_CHECKPOINTED)
    owned = looked_at_until(11, 0)
    run(resume(tool, [11, 12], FAST, owned))
    assert calls(tmp_path) == ["--get-state --pid 12", "--action unlock --pid 12"]


@pytest.mark.parametrize(
    "states",
    [
        LOCKED_AND_CHECKPOINTED,  # given away while its state was read, before its restore
        'case "$*" in\n  "--get-state --pid "*) echo locked ;;\nesac',  # before its unlock
    ],
    ids=["restore", "unlock"],
)
def test_a_resume_goes_on_past_a_pid_given_away_after_its_state_was_read(
    tmp_path: Path, states: str
) -> None:
    tool = stub(tmp_path, states)
    owned = looked_at_until(11, 1)
    run(resume(tool, [11, 12], FAST, owned))
    assert calls(tmp_path) == [
        "--get-state --pid 11",
        "--get-state --pid 12",
        "--action unlock --pid 12",
    ]


def test_the_undo_of_a_refused_checkpoint_leaves_a_pid_no_longer_the_jobs_alone(
    tmp_path: Path,
) -> None:
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--action checkpoint --pid 12") echo refused >&2; exit 33 ;;\n'
        '  "--get-state --pid 11") echo checkpointed ;;\n'
        '  "--get-state --pid 12") echo locked ;;\n'
        "esac",
    )
    owned = looked_at_until(11, 2)  # its lock's look and its checkpoint's
    failure(suspend(tool, [11, 12], FAST, owned))
    assert calls(tmp_path)[4:] == ["--get-state --pid 12", "--action unlock --pid 12"]


# ---------------------------------------------------------------------------------------------
# unit files others may read


def test_a_unit_file_whose_acl_cannot_be_read_is_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """True where it cannot be told: what root's file says reaches root alone."""
    root = tmp_path / "root"
    write_unit(tmp_path, "leak.service", "Priority=10\nMemory=open1\n")
    assert _privacy(root) == {LEAK: False}

    def has_access_acl(path: str) -> bool:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(unitfiles, "has_access_acl", has_access_acl)
    assert _privacy(root) == {LEAK: True}


def test_a_directory_that_cannot_be_looked_at_is_not_searchable(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    assert not UnitIndex(tmp_path / "root").reachable(f"{tmp_path}/root/gone/x.service")
    assert UnitIndex(tmp_path / "root").reachable(f"{tmp_path}/root/x.service")


def test_a_path_through_a_shut_directory_is_not_reachable_though_dotdot_leads_out(
    tmp_path: Path,
) -> None:
    """The kernel searches each component: `shut/..` needs `shut` searched."""
    root = tmp_path / "root"
    (root / "shut").mkdir(parents=True, mode=0o700)
    (root / "open").mkdir(mode=0o755)
    assert UnitIndex(root).reachable(f"{root}/open/x.service")
    assert not UnitIndex(root).reachable(f"{root}/shut/../open/x.service")


def test_a_relative_path_is_looked_at_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each directory above it counts, up to the index's root, not only those it names."""
    root = tmp_path / "root"
    (root / "shut" / "etc").mkdir(parents=True)
    (root / "shut").chmod(0o700)
    monkeypatch.chdir(root / "shut")
    assert not UnitIndex(root).reachable("etc/x.service")
    (root / "shut").chmod(0o755)
    assert UnitIndex(root).reachable("etc/x.service")


# ---------------------------------------------------------------------------------------------
# gpuslice new: a program path that cannot be looked at


def test_a_program_that_cannot_be_looked_at_gets_no_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A network home that root may not search (root_squash): the program may well be
    there; `gpuslice new` does not say it is missing."""
    program = "/home/asr/bin/transcribe"
    real_stat = os.stat

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if path == program:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat)  # newunit's look
    assert not newunit.missing_program(program)
    result = CliRunner().invoke(
        main, ["new", "job", "--priority", "5", "--no-reload", "--root", str(tmp_path), "--",
               program],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
