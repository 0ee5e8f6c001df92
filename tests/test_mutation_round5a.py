"""`gpuslice release-jobs` near its deadline: what is still shown with under a second left,
what is not asked once the time is gone, the SHOW_LATE it still has past the deadline, and
which units the closing count of unshown preempted units names. systemctl and the clock are
stand-ins (tests/release_jobs_standins.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpuslice import cli as cli_module
from gpuslice.core.scheduler import SavedState
from tests.release_jobs_standins import release_jobs, show
from tests.test_release_jobs_many import WHERE, _named, _preempted, _shows

CONFIG = "log_level: info\n"


def _clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """release-jobs' clock, at 0 until a stand-in moves it."""
    clock = [0.0]
    monkeypatch.setattr(cli_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    return clock


def _answered(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(command, 0, show(command, {}), "")


def test_a_call_of_500_is_still_sent_with_half_a_second_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first 500 take all but half a second of the 120 s: the last unit is still asked,
    given that half second, and named like the rest."""
    clock = _clock(monkeypatch)
    saved = _preempted(501)

    def answer(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        if len(command[command.index("--") + 1 :]) == 500:
            clock[0] = 119.5
        return _answered(command)

    calls = _shows(monkeypatch, saved, {}, answer)
    stderr = release_jobs(tmp_path, CONFIG)
    assert [t for _, t in calls] == [30.0, 30.0, 0.5]
    assert _named(stderr) == sorted(saved.preempted)
    assert "did not show" not in stderr


def test_units_asked_one_by_one_get_what_is_left_of_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call systemctl refused (a name it takes for no unit) ends with half a second left:
    each of its units is still asked alone, given that half second, not 30 s."""
    clock = _clock(monkeypatch)
    saved = _preempted(3)

    def answer(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        if len(command[command.index("--") + 1 :]) > 1:
            clock[0] = 119.5
            return subprocess.CompletedProcess(command, 1, "", "Invalid unit name")
        return _answered(command)

    calls = _shows(monkeypatch, saved, {}, answer)
    stderr = release_jobs(tmp_path, CONFIG)
    assert [t for _, t in calls] == [30.0, 30.0, 0.5, 0.5, 0.5]
    assert _named(stderr) == sorted(saved.preempted)


def test_units_asked_one_by_one_are_not_asked_once_the_deadline_is_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every show takes its whole time (the clock moved by it): the units of a refused call
    are asked alone until the 120 s are spent to the second, and none after; the one never
    asked is counted with those not shown."""
    clock = _clock(monkeypatch)
    saved = _preempted(3)

    def answer(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        clock[0] += timeout
        if command[-1] == "gpuslice.service":
            return _answered(command)
        if len(command[command.index("--") + 1 :]) > 1:
            return subprocess.CompletedProcess(command, 1, "", "Invalid unit name")
        raise subprocess.TimeoutExpired(command, timeout)

    calls = _shows(monkeypatch, saved, {}, answer)
    stderr = release_jobs(tmp_path, CONFIG)
    assert [t for _, t in calls] == [30.0] * 4
    assert clock[0] == 120.0
    assert stderr.splitlines() == [
        f"{WHERE} 3 more units were preempted (the first job@00000.service), which "
        "systemctl did not show within release-jobs' 120 s: nothing will start again those of "
        "them that are down"
    ]


def test_preempted_units_are_still_shown_for_show_late_once_thaws_spent_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two thaws of a systemd that does not answer take the 120 s (60 s each): the
    preempted units are still shown, given SHOW_LATE (5 s), and named."""
    clock = _clock(monkeypatch)
    frozen = ("active", "frozen")
    saved = SavedState(
        preempted={"job@00000.service": 0, "job@00001.service": 1},
        thaw_owed=["a.service", "b.service"],
        seq=2,
    )
    calls = _shows(monkeypatch, saved, {"a.service": frozen, "b.service": frozen})
    shows = subprocess.run

    def systemctl(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if command[1] == "thaw":
            clock[0] += kwargs["timeout"]
            raise subprocess.TimeoutExpired(command, kwargs["timeout"])
        return shows(command, **kwargs)

    monkeypatch.setattr(subprocess, "run", systemctl)
    stderr = release_jobs(tmp_path, CONFIG)
    assert clock[0] == 120.0
    assert calls[-1] == (sorted(saved.preempted), cli_module.SHOW_LATE)
    assert _named(stderr) == sorted(saved.preempted)
    assert f"{WHERE} a.service stays frozen: `systemctl thaw` failed" in stderr.splitlines()


def test_the_count_of_unshown_preempted_units_leaves_out_the_units_thawed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemctl shows nothing but gpuslice.service: a unit owed a thaw is thawed unseen,
    and the closing line counts the preempted unit alone, naming it."""
    saved = SavedState(preempted={"job@00000.service": 0}, thaw_owed=["a.service"], seq=1)

    def answer(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        if command[-1] == "gpuslice.service":
            return _answered(command)
        raise subprocess.TimeoutExpired(command, timeout)

    calls = _shows(monkeypatch, saved, {}, answer)
    stderr = release_jobs(tmp_path, CONFIG)
    assert [units for units, _ in calls] == [
        ["gpuslice.service"],
        ["a.service"],
        ["job@00000.service"],
    ]
    assert stderr.splitlines() == [
        f"{WHERE} 1 more units were preempted (the first job@00000.service), which "
        "systemctl did not show within release-jobs' 120 s: nothing will start again those of "
        "them that are down"
    ]
