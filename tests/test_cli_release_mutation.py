"""`gpuslice release-jobs` (debian/gpuslice.prerm, as `apt remove` runs it) in the words an
admin reads on stderr, and which units it thaws, resumes, stops or names, in what order:
a controller that systemd cannot show or that failed, a config.yaml gone bad, systemctl
failing or hanging, systemd's answers long or missing, the PIDs of a unit resumed in part.
No systemd and no cuda-checkpoint: the state, systemctl and the resume are stand-ins (as in
tests/test_release_jobs_resume.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from gpuslice import cli as cli_module
from gpuslice.checkpoint import CheckpointError, CheckpointSettings, Resumed
from gpuslice.cli import main
from gpuslice.config import Config
from gpuslice.core.scheduler import SavedState
from gpuslice.state import StateStore
from tests.test_release_jobs_resume import (
    _Systemd,
    _systemd_started,
    _this_boot,
    _tool_and_systemd,
)

WHERE = "gpuslice is being removed:"
FROZEN = "ActiveState=active\nFreezerState=frozen\n"


@dataclass
class Run:
    """What one release-jobs did: ("thaw" | "stop" | "resume", unit) in order, the settings
    each resume got, its stdout and stderr."""

    done: list[tuple[str, str]] = field(default_factory=list)
    settings: list[CheckpointSettings] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""


def _release(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    saved: SavedState,
    shown: Mapping[str, str | BaseException],
    *,
    verbs: Mapping[str, int | BaseException] | None = None,
    resume: Mapping[str, Resumed | CheckpointError] | None = None,
    config: str = "restore_timeout: 42\n",
) -> Run:
    """release-jobs on `saved` (of this boot), `systemctl show` printing `shown[unit]` for
    each unit it names (or raising it; gpuslice.service inactive and other units inactive
    unless said), each other systemctl verb exiting with, or raising, `verbs[verb]` (0 by
    default), each resume answering `resume[unit]` (one process restored by default). Every
    systemctl is run with a timeout of at most a minute: `apt remove` waits on each."""
    monkeypatch.setattr(StateStore, "load", lambda self: (saved, _this_boot()))
    # the state is this stand-in, in no file: nothing on the host to save over or
    # to find saved since (a /var/lib/gpuslice left by another run made it so)
    monkeypatch.setattr(StateStore, "saved_since", lambda self: None)
    _systemd_started(monkeypatch)
    run = Run()

    def systemctl(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        timeout = kwargs.get("timeout")
        assert timeout is not None and 0 < timeout <= 60, f"{command}: timeout {timeout}"
        unit = command[-1]
        if command[1] == "show":  # a block for each unit after `--`, blank-line separated
            blocks = []
            for one in command[command.index("--") + 1 :]:
                answer = shown.get(one, "ActiveState=inactive\nFreezerState=running\n")
                if isinstance(answer, BaseException):
                    raise answer
                blocks.append(answer)
            return subprocess.CompletedProcess(command, 0, "\n".join(blocks), "")
        run.done.append((command[1], unit))
        code = (verbs or {}).get(command[1], 0)
        if isinstance(code, BaseException):
            raise code
        return subprocess.CompletedProcess(command, code, "", "")

    def resume_left(
        unit: str, s: CheckpointSettings, pids: Sequence[int] | None = None
    ) -> Resumed | CheckpointError:
        run.done.append(("resume", unit))
        run.settings.append(s)
        return (resume or {}).get(unit, Resumed(0.5, (11,)))

    monkeypatch.setattr(subprocess, "run", systemctl)
    monkeypatch.setattr(cli_module, "_resume_left", resume_left)
    (tmp_path / "config.yaml").write_text(config)
    result = CliRunner().invoke(main, ["release-jobs", "--config", str(tmp_path / "config.yaml")])
    assert result.exit_code == 0, result.output
    run.stdout, run.stderr = result.stdout, result.stderr
    return run


# --- the controller ---------------------------------------------------------------------------


@pytest.mark.parametrize("answer", ["", FileNotFoundError("systemctl")])
def test_a_controller_systemd_cannot_show_is_said_unknown_and_its_units_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: str | BaseException
) -> None:
    """systemctl printing nothing, or not there: the controller may still run, so nothing is
    thawed or resumed behind its back, and the line says its state is unknown."""
    saved = SavedState(
        holders={"z.service": ((0,), "frozen", 2, "")}, suspended={"a.service": ((1,), 3)}
    )
    shown = {"gpuslice.service": answer, "z.service": FROZEN, "a.service": FROZEN}
    run = _release(tmp_path, monkeypatch, saved, shown)
    assert run.done == []
    assert run.stderr.splitlines() == [
        "gpuslice release-jobs: gpuslice.service is unknown: its units are left to it"
    ]


def test_the_controllers_state_is_shown_cut_at_60_characters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What systemctl shows of it is bounded on the line `apt remove` prints."""
    state = "activating-" * 6
    run = _release(
        tmp_path, monkeypatch, SavedState(), {"gpuslice.service": f"ActiveState={state}"}
    )
    assert run.stderr.splitlines() == [
        f"gpuslice release-jobs: gpuslice.service is {state[:60]}...: its units are left to it"
    ]


def test_a_failed_controller_is_as_stopped_as_an_inactive_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A controller that crashed before the removal (or whose stop failed) will not come
    back either: its frozen unit is thawed, its suspended one resumed."""
    saved = SavedState(
        holders={"z.service": ((0,), "frozen", 2, "")}, suspended={"a.service": ((1,), 3)}
    )
    shown = {"gpuslice.service": "ActiveState=failed\n", "z.service": FROZEN, "a.service": FROZEN}
    run = _release(tmp_path, monkeypatch, saved, shown)
    assert run.done == [("thaw", "z.service"), ("resume", "a.service")]


def test_a_config_file_gone_bad_still_releases_with_the_settings_it_sets_validly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller kept its last good file's settings: a bad log_level does not stop
    the release, and the resume gets the restore_timeout the file does set."""
    saved = SavedState(suspended={"a.service": ((1,), 3)})
    run = _release(
        tmp_path,
        monkeypatch,
        saved,
        {"a.service": FROZEN},
        config="restore_timeout: 42\nlog_level: loud\n",
    )
    assert run.done == [("resume", "a.service")]
    assert [s.restore_timeout for s in run.settings] == [42.0]


# --- the order ----------------------------------------------------------------------------------


def test_thaws_come_before_every_resume_and_caught_units_go_by_priority_then_seq(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen unit is thawed before even the most urgent resume (priority 0, suspended
    first, its name first); units caught between suspend and resume go by the priority they
    were held on, then who was suspended first, not by name."""
    terms: dict[str, tuple[int, str, int, int | None]] = {
        "a-caught.service": (0, "background", 1, None),
        "b-caught.service": (5, "background", 1, None),
        "c-caught.service": (5, "background", 1, None),
    }
    saved = SavedState(
        holders={
            "a-caught.service": ((0,), "suspending", 0, ""),
            "b-caught.service": ((1,), "resuming", 7, ""),
            "c-caught.service": ((2,), "suspending", 3, ""),
            "z-frozen.service": ((3,), "frozen", 1, ""),
        },
        terms=terms,
    )
    run = _release(tmp_path, monkeypatch, saved, {n: FROZEN for n in saved.holders})
    assert run.done == [
        ("thaw", "z-frozen.service"),
        ("resume", "a-caught.service"),
        ("resume", "c-caught.service"),
        ("resume", "b-caught.service"),
    ]


# --- what systemd shows ---------------------------------------------------------------------------


def test_a_unit_still_freezing_is_taken_for_frozen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A freeze systemd has not finished yet leaves the unit as stuck as a frozen one: it is
    thawed, or resumed, all the same."""
    saved = SavedState(
        holders={"z.service": ((0,), "frozen", 2, "")}, suspended={"a.service": ((1,), 3)}
    )
    freezing = "ActiveState=active\nFreezerState=freezing\n"
    run = _release(tmp_path, monkeypatch, saved, {"z.service": freezing, "a.service": freezing})
    assert run.done == [("thaw", "z.service"), ("resume", "a.service")]
    assert run.stderr.splitlines() == [
        f"{WHERE} a.service resumed from host memory, 1 process: restored in 0.5 s"
    ]


@pytest.mark.parametrize(
    ("shown", "said"),
    [
        ("ActiveState=active\n", "unknown"),  # a systemd without a freezer shows none
        ("ActiveState=active\nFreezerState=" + "thawing-" * 4 + "\n", "thawing-thawing-thaw..."),
    ],
)
def test_a_suspended_unit_systemd_does_not_show_frozen_is_named_with_what_it_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shown: str, said: str
) -> None:
    saved = SavedState(suspended={"a.service": ((1,), 3)})
    run = _release(tmp_path, monkeypatch, saved, {"a.service": shown})
    assert run.done == []
    assert run.stderr.splitlines() == [
        f"{WHERE} a.service is left suspended by cuda-checkpoint: nothing can resume it now; "
        f"`systemctl stop a.service` ends it (not resumed: systemd shows it {said})"
    ]


def test_a_resume_starting_at_the_deadline_itself_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No resume starts *after* RELEASE_DEADLINE: one whose turn comes at 120 s exactly
    runs; the next, a moment later, is left suspended."""
    clock = iter([0.0, 120.0, 120.001])
    monkeypatch.setattr(cli_module, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    saved = SavedState(suspended={"a.service": ((1,), 1), "b.service": ((1,), 2)})
    run = _release(tmp_path, monkeypatch, saved, {n: FROZEN for n in saved.suspended})
    assert run.done == [("resume", "a.service")]
    assert run.stderr.splitlines()[1].endswith(
        "(not resumed: release-jobs spent its 120 s on the units before it)"
    )


def test_why_a_resume_failed_is_said_up_to_600_characters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    why = "restore of PID 11 failed: " + "x" * 600
    saved = SavedState(suspended={"a.service": ((1,), 3)})
    resume = {"a.service": CheckpointError(why)}
    run = _release(tmp_path, monkeypatch, saved, {"a.service": FROZEN}, resume=resume)
    (line,) = run.stderr.splitlines()
    assert line.endswith(f"(not resumed: {why[:600]}...)")


# --- thaws and the preempted ------------------------------------------------------------------


@pytest.mark.parametrize(
    "thaw",
    [1, FileNotFoundError("systemctl"), subprocess.TimeoutExpired(["systemctl"], 60)],
    ids=["exits-1", "not-there", "hangs"],
)
def test_a_thaw_that_fails_is_said_on_stderr_and_the_rest_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thaw: int | BaseException
) -> None:
    """The admin running `apt remove` reads which unit stays frozen (holding its GPU
    memory); stdout (dpkg's own) gets nothing, and the units after it are still released."""
    saved = SavedState(
        holders={"z.service": ((0,), "frozen", 2, "")}, suspended={"a.service": ((1,), 3)}
    )
    shown = {"z.service": FROZEN, "a.service": FROZEN}
    run = _release(tmp_path, monkeypatch, saved, shown, verbs={"thaw": thaw})
    assert run.done == [("thaw", "z.service"), ("resume", "a.service")]
    assert run.stdout == ""
    assert run.stderr.splitlines()[0] == f"{WHERE} z.service stays frozen: `systemctl thaw` failed"
    assert len(run.stderr.splitlines()) == 2


@pytest.mark.parametrize(
    "answer", ["", subprocess.TimeoutExpired(["systemctl"], 30)], ids=["fails", "hangs"]
)
def test_a_suspended_unit_systemd_cannot_show_is_named_with_what_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: str | BaseException
) -> None:
    """Suspended (or caught between suspend and resume) but not shown: it was passed over
    without a word, maybe frozen for ever with its memory in host memory. Not resumed (a
    unit down would be taken for running again), it is named with what ends it."""
    saved = SavedState(
        holders={"c.service": ((0,), "suspending", 2, "")}, suspended={"a.service": ((1,), 3)}
    )
    run = _release(tmp_path, monkeypatch, saved, {"a.service": answer, "c.service": answer})
    assert run.done == []
    assert run.stderr.splitlines() == [
        f"{WHERE} {u} may be left suspended by cuda-checkpoint: systemctl did not show its "
        f"state, so it was not resumed, and nothing can resume it now; if `systemctl "
        f"is-active {u}` says active, it is frozen with its GPU memory in host memory: "
        f"`systemctl stop {u}` ends it"
        for u in ("c.service", "a.service")
    ]


def test_a_thaw_that_fails_for_a_unit_systemd_cannot_show_is_not_said_frozen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit owed a thaw whose state could not be read is thawed all the same; the thaw
    fails for one that is down (systemd thaws no inactive unit): "stays frozen" was untrue
    then. The line says what is known, and what to do if it is frozen."""
    saved = SavedState(holders={"z.service": ((0,), "frozen", 2, "")})
    run = _release(tmp_path, monkeypatch, saved, {"z.service": ""}, verbs={"thaw": 1})
    assert run.done == [("thaw", "z.service")]
    assert run.stderr.splitlines() == [
        f"{WHERE} z.service may stay frozen: systemctl did not show its state, and `systemctl "
        "thaw` failed (as it does for a unit that is not running); if `systemctl show -p "
        "FreezerState z.service` says frozen, `systemctl thaw z.service` lets it run"
    ]


def test_a_preempted_unit_is_named_while_systemd_shows_it_down_or_going_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inactive, failed or on its way down, nothing will start it again: named with what
    starts it. One that runs (started by hand meanwhile) needs nothing."""
    states = ["inactive", "failed", "deactivating", "active", "activating"]
    saved = SavedState(preempted={f"{s}.service": i for i, s in enumerate(states)})
    shown = {f"{s}.service": f"ActiveState={s}\nFreezerState=running\n" for s in states}
    run = _release(tmp_path, monkeypatch, saved, shown)
    assert run.done == []
    assert run.stderr.splitlines() == [
        f"{WHERE} {s}.service was preempted and nothing will start it again: "
        f"`systemctl start {s}.service` if it is still wanted"
        for s in sorted(["inactive", "failed", "deactivating"])
    ]


# --- a unit resumed in part ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("restored", "said"),
    [
        ((11,), "PID 11"),
        ((11, 12), "PIDs 11, 12"),
        (tuple(range(11, 21)), "PIDs " + ", ".join(map(str, range(11, 21)))),
        (tuple(range(11, 22)), "PIDs " + ", ".join(map(str, range(11, 21))) + ", ..."),
    ],
)
def test_a_unit_resumed_in_part_is_stopped_naming_up_to_ten_pids_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restored: tuple[int, ...], said: str
) -> None:
    """The PIDs whose memory went back to a GPU, ten at most (a line per unit, not per
    process), and the reason, up to 600 characters; the units after it are still released."""
    why = "restore of PID 30 ran out of GPU memory: " + "y" * 600
    saved = SavedState(suspended={"a.service": ((1,), 3), "b.service": ((1,), 4)})
    resume = {"a.service": CheckpointError(why, lost=(30,), restored=restored)}
    shown = {"a.service": FROZEN, "b.service": FROZEN}
    run = _release(tmp_path, monkeypatch, saved, shown, resume=resume)
    assert run.done == [("resume", "a.service"), ("stop", "a.service"), ("resume", "b.service")]
    assert run.stderr.splitlines() == [
        f"{WHERE} a.service is being stopped (systemctl stop): its resume restored {said} but "
        f"failed for the rest ({why[:600]}...); frozen again it would hold that GPU memory "
        "for ever, and nothing can resume the rest now: its work since its last save is lost",
        f"{WHERE} b.service resumed from host memory, 1 process: restored in 0.5 s",
    ]


@pytest.mark.parametrize(
    "stop",
    [FileNotFoundError("systemctl"), subprocess.TimeoutExpired(["systemctl"], 60)],
    ids=["not-there", "hangs"],
)
def test_a_stop_that_could_not_run_is_not_said_to_be_under_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: BaseException
) -> None:
    saved = SavedState(suspended={"a.service": ((1,), 3)})
    resume = {"a.service": CheckpointError("out of GPU memory", restored=(11,))}
    run = _release(
        tmp_path, monkeypatch, saved, {"a.service": FROZEN}, verbs={"stop": stop}, resume=resume
    )
    assert run.stderr.splitlines() == [
        f"{WHERE} a.service restored PID 11 but failed for the rest (out of GPU memory), and "
        "`systemctl stop` failed: it runs thawed, part of its memory never restored; "
        "`systemctl stop a.service` ends it"
    ]


# --- the resume's freeze back ---------------------------------------------------------------------


def test_a_unit_that_could_not_be_frozen_again_after_a_failed_restore_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its restore failed with nothing restored and FreezeUnit failed too: the unit runs
    thawed with its processes still checkpointed, and the reason says so."""
    calls, _ = _tool_and_systemd(monkeypatch, restore_fails="restore of PID 11 timed out")

    async def refused(self: _Systemd, name: str) -> None:
        calls.append(("FreezeUnit", name))
        raise RuntimeError("the bus went away")

    monkeypatch.setattr(_Systemd, "freeze_unit", refused)
    settings = CheckpointSettings.from_config(Config())
    failed = cli_module._resume_left("train.service", settings)
    assert isinstance(failed, CheckpointError)
    assert failed.reason.startswith(
        "restore of PID 11 timed out; and it could not be frozen again: FreezeUnit failed"
    )
    assert "the bus went away" in failed.reason
    assert calls[-1] == ("FreezeUnit", "train.service")
