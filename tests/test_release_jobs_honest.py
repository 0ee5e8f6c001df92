"""`gpuslice release-jobs` says what its resume of a suspended unit really did, and leaves
none half resumed: a resume that restored no process is not called one (nor in the
controller's journal), a unit that got part of its memory back before a restore failed is
stopped rather than frozen again on that memory for ever, and no resume starts once
RELEASE_DEADLINE has passed (`apt remove` waits on it). No systemd and no cuda-checkpoint:
shell-script stubs of the tool (tests/test_checkpoint.py), systemd's side recorded."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from gpuslice import cli as cli_module
from gpuslice import clock as clock_module
from gpuslice.checkpoint import CheckpointSettings, Resumed, resume
from gpuslice.cli import main
from gpuslice.core.scheduler import Action, SavedState
from gpuslice.ladder import Ladder, Suspension
from gpuslice.state import StateStore
from gpuslice.systemd import Systemd
from tests.release_jobs_standins import release_jobs, systemctl_and_resume
from tests.test_checkpoint import FAST, calls, failure, run, stub
from tests.test_ladder_adapter import Events
from tests.test_release_jobs_resume import _release, _Systemd, _systemd_started, _this_boot

UNIT = "train.service"
OOM = "echo 'Error restoring CUDA in process ID 12: \"out of memory\"' >&2; exit 1"


def _release_with_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, stop_code: int = 0
) -> tuple[list[tuple[str, ...]], list[list[str]], str]:
    """release-jobs on one unit suspended in this boot, active and frozen, whose processes
    are 11-13, through the real resume (Ladder.restore, checkpoint.resume) with the stub tool
    running `body`, settings as config.yaml's but the tool run directly. systemd's D-Bus
    calls, the systemctl commands other than `show` (each answering `stop_code`), stderr."""
    tool = stub(tmp_path, body)
    bus: list[tuple[str, ...]] = []
    commands: list[list[str]] = []

    async def connect(address: str | None = None, timeout: float | None = None) -> _Systemd:
        return _Systemd(bus, [11, 12, 13])

    def systemctl(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if command[1] == "show":
            shown = "inactive\n" if command[-1] == "gpuslice.service" else "active\n"
            return subprocess.CompletedProcess(
                command, 0, f"ActiveState={shown}FreezerState=frozen\n", ""
            )
        commands.append(command)
        return subprocess.CompletedProcess(command, stop_code, "", "")

    settings = dataclasses.replace(FAST, tool=tool)
    # the stand-in processes 11-13 are the unit's (their cgroups, looked at before each run
    # of the tool on them, are not here)
    monkeypatch.setattr(Ladder, "_owned_by", lambda self, unit: lambda pid: pid in (11, 12, 13))
    saved = SavedState(suspended={UNIT: ((1,), 4)})
    monkeypatch.setattr(StateStore, "load", lambda self: (saved, _this_boot()))
    # the state is this stand-in, in no file: nothing on the host to save over or
    # to find saved since (a /var/lib/gpuslice left by another run made it so)
    monkeypatch.setattr(StateStore, "saved_since", lambda self: None)
    monkeypatch.setattr(CheckpointSettings, "from_config", classmethod(lambda cls, c: settings))
    monkeypatch.setattr(Systemd, "connect", connect)
    monkeypatch.setattr(subprocess, "run", systemctl)
    (tmp_path / "config.yaml").write_text("log_level: info\n")
    result = CliRunner().invoke(main, ["release-jobs", "--config", str(tmp_path / "config.yaml")])
    assert result.exit_code == 0, result.output
    return bus, commands, result.stderr


def _report(event: Callable[[], list[Action]]) -> None:
    event()


# --- 1. no "resumed" for a restore that did not happen --------------------------------------


def test_resume_says_which_processes_it_restored_and_which_it_only_unlocked(
    tmp_path: Path,
) -> None:
    """checkpoint.resume returned the seconds alone: a resume that found every process
    running, exited or unreadable looked the same as one that restored them."""
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--get-state --pid 11") echo checkpointed ;;\n'
        '  "--get-state --pid 12") echo locked ;;\n'
        '  "--get-state --pid 13") echo running ;;\n'
        "esac",
    )
    done = run(resume(tool, [11, 12, 13], FAST))
    assert (done.restored, done.unlocked) == ((11,), (12,))
    assert 0 <= done.seconds < 30
    nothing = run(resume(tool, [13], FAST))
    assert (nothing.restored, nothing.unlocked) == ((), ())


def test_a_resume_that_fails_names_what_it_restored_all_the_same(tmp_path: Path) -> None:
    tool = stub(tmp_path, f'case "$*" in "--get-state"*) echo checkpointed ;; *12) {OOM} ;; esac')
    error = failure(resume(tool, [11, 12], FAST))
    assert (error.restored, error.lost) == ((11,), (12,))


def test_release_jobs_does_not_call_a_resume_that_restored_nothing_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuda-checkpoint refused each of the unit's processes (none a CUDA process): the
    resume thawed it and restored nothing, and release-jobs said "resumed from host memory".
    (A tool that exits 0 naming no state is no answer: the process may be checkpointed,
    test_ladder_adapter's `..._whose_state_it_cannot_read`.)"""
    refuses = 'echo "process has no CUDA context" >&2; exit 1'
    bus, commands, stderr = _release_with_tool(tmp_path, monkeypatch, refuses)
    assert bus == [("ThawUnit", UNIT), ("GetUnitProcesses", UNIT)]
    assert commands == []
    assert stderr.splitlines() == [
        f"gpuslice is being removed: {UNIT} thawed, not resumed from host memory: "
        "cuda-checkpoint found no process of it checkpointed or locked: nothing restored"
    ]
    assert calls(tmp_path) == [f"--get-state --pid {pid}" for pid in (11, 12, 13)]


def test_the_controllers_journal_claims_no_restore_when_every_process_had_exited(
    tmp_path: Path,
) -> None:
    """The controller's own resume (the same words): its suspended processes all gone, it
    logged "restored in 0.0 s"."""
    tool = stub(tmp_path, 'echo "no such process" >&2; exit 1')
    gone = subprocess.Popen(["true"])
    gone.wait()
    events = Events()
    systemd = _Systemd([], [])
    ladder = Ladder(
        systemd,
        events,
        lambda: None,
        lambda: dataclasses.replace(FAST, tool=tool),
        _report,
    )
    ladder.suspensions[UNIT] = Suspension((gone.pid,), 1 << 30, clock_module.moment(), time.time())
    asyncio.run(ladder.resume(UNIT))
    [(event, unit, words)] = events.said
    assert (event, unit) == ("resumed", UNIT)
    assert "restored in" not in words
    assert words.endswith(
        " s: cuda-checkpoint found no process of it checkpointed or locked: nothing restored"
    )


# --- 2. a partial restore is not frozen again on its memory ---------------------------------


PARTIAL = (
    'case "$*" in\n'
    '  "--get-state --pid 13") exit 1 ;;\n'
    '  "--get-state"*) echo checkpointed ;;\n'
    f'  "--action restore --pid 12") {OOM} ;;\n'
    "esac"
)


def test_a_unit_restored_in_part_is_stopped_not_frozen_again_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PID 11 restored, PID 12 out of GPU memory: frozen again, the unit held 11's GPU memory
    for ever (no controller will come back), 12 never able to run. It is stopped, as the
    controller stops a unit whose resume failed, and stderr says what was lost and why."""
    bus, commands, stderr = _release_with_tool(tmp_path, monkeypatch, PARTIAL)
    assert bus == [("ThawUnit", UNIT), ("GetUnitProcesses", UNIT)]  # no FreezeUnit
    assert commands == [["systemctl", "stop", "--no-block", "--", UNIT]]
    assert "--action unlock --pid 11" in calls(tmp_path)
    assert stderr.splitlines() == [
        f"gpuslice is being removed: {UNIT} is being stopped (systemctl stop): its resume "
        "restored PID 11 but failed for the rest (restore of PID 12 ran out of GPU memory; "
        "the process cannot be resumed and must be stopped); frozen again it would hold that "
        "GPU memory for ever, and nothing can resume the rest now: its work since its last "
        "save is lost"
    ]


def test_a_stop_that_fails_is_said_with_what_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, commands, stderr = _release_with_tool(tmp_path, monkeypatch, PARTIAL, stop_code=1)
    assert commands == [["systemctl", "stop", "--no-block", "--", UNIT]]
    (line,) = stderr.splitlines()
    assert line.startswith(f"gpuslice is being removed: {UNIT} restored PID 11 but failed")
    assert line.endswith(
        "and `systemctl stop` failed: it runs thawed, part of its memory never restored; "
        f"`systemctl stop {UNIT}` ends it"
    )


# --- 3. a bound on the time `apt remove` waits ------------------------------------------------


def test_no_resume_starts_after_the_deadline_and_each_unit_left_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resumes one after another, each up to restore_timeout per process, held `apt remove`
    for as long as they took. Each read of the clock here is 100 s later: the first resume
    starts in time, the two after it would start past RELEASE_DEADLINE and are left
    suspended (nothing lost: nothing was thawed or restored), each named."""
    clock = itertools.count(0.0, 100.0)
    monkeypatch.setattr(cli_module, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    assert cli_module.RELEASE_DEADLINE == 120.0
    saved = SavedState(
        suspended={"a.service": ((1,), 1), "b.service": ((1,), 2), "c.service": ((1,), 3)}
    )
    shown = {n: ("active", "frozen") for n in saved.suspended}
    done, _, stderr = _release(tmp_path, monkeypatch, saved, shown, {"a.service": Resumed(1.0)})
    assert done == [("resume", "a.service")]
    assert stderr.splitlines()[1:] == [
        f"gpuslice is being removed: {name} is left suspended by cuda-checkpoint: nothing "
        f"can resume it now; `systemctl stop {name}` ends it (not resumed: release-jobs "
        "spent its 120 s on the units before it)"
        for name in ("b.service", "c.service")
    ]


def test_a_thaw_is_given_what_is_left_of_the_deadline_and_still_sent_past_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thaws one after another, each given 60 s (a systemd that does not answer), held
    `apt remove` past RELEASE_DEADLINE by as much as they took. Each read of the clock here
    is 50 s later: the first thaw gets its 60 s, the second only the 20 s left, and the
    third, past the deadline, is still sent (left frozen with no controller, its job would
    never run again), given 5 s."""
    clock = itertools.count(0.0, 50.0)
    monkeypatch.setattr(cli_module, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    frozen = ("a.service", "b.service", "c.service")
    holders: dict[str, tuple[tuple[int, ...], str, int, str]] = {
        n: ((i,), "frozen", i + 1, "") for i, n in enumerate(frozen)
    }
    saved = SavedState(holders=holders, seq=3)
    monkeypatch.setattr(StateStore, "load", lambda self: (saved, _this_boot()))
    monkeypatch.setattr(StateStore, "saved_since", lambda self: None)
    _systemd_started(monkeypatch)
    done, _ = systemctl_and_resume(monkeypatch, {n: ("active", "frozen") for n in frozen})
    systemctl = subprocess.run
    timeouts: list[float] = []

    def timed(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if command[1] == "thaw":
            timeouts.append(kwargs["timeout"])
        return systemctl(command, **kwargs)

    monkeypatch.setattr(subprocess, "run", timed)
    stderr = release_jobs(tmp_path, "")
    assert done == [("thaw", "a.service"), ("thaw", "b.service"), ("thaw", "c.service")]
    assert timeouts == [60.0, 20.0, 5.0]
    assert stderr == ""


def test_a_frozen_unit_whose_state_cannot_be_read_is_thawed_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`systemctl show` of a frozen unit that does not answer in its 30 s (a systemd busy
    with `apt remove`'s daemon-reload) or fails: the unit was taken for not frozen and passed
    over without a word, left frozen with no controller for ever. The thaw is sent anyway
    (systemd thaws a unit that is not frozen as a no-op)."""
    frozen = ("a.service", "b.service")
    holders: dict[str, tuple[tuple[int, ...], str, int, str]] = {
        n: ((i,), "frozen", i + 1, "") for i, n in enumerate(frozen)
    }
    saved = SavedState(holders=holders, seq=2)
    monkeypatch.setattr(StateStore, "load", lambda self: (saved, _this_boot()))
    monkeypatch.setattr(StateStore, "saved_since", lambda self: None)
    _systemd_started(monkeypatch)
    done, _ = systemctl_and_resume(monkeypatch, {n: ("active", "frozen") for n in frozen})
    systemctl = subprocess.run

    def slow_show(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if command[1] == "show" and command[-1] == "a.service":
            raise subprocess.TimeoutExpired(command, kwargs["timeout"])
        if command[1] == "show" and command[-1] == "b.service":
            return subprocess.CompletedProcess(command, 1, "", "Failed to connect to bus")
        return systemctl(command, **kwargs)

    monkeypatch.setattr(subprocess, "run", slow_show)
    stderr = release_jobs(tmp_path, "")
    assert done == [("thaw", "a.service"), ("thaw", "b.service")]
    assert stderr == ""
