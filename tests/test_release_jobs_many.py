"""`gpuslice release-jobs` on a state naming thousands of preempted units (an instance per
job, up to 10,000 kept): `apt remove` waits on it. One `systemctl show` each, 30 s each and
past the deadline, held it for minutes; they are shown SHOW_AT_ONCE to a call, within what
is left of RELEASE_DEADLINE. systemctl and the clock are stand-ins
(tests/release_jobs_standins.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpuslice import cli as cli_module
from gpuslice.core.scheduler import SavedState
from gpuslice.state import StateStore
from tests.release_jobs_standins import release_jobs, show, systemctl_and_resume
from tests.test_release_jobs_resume import _systemd_started, _this_boot

WHERE = "gpuslice is being removed:"


def _preempted(count: int) -> SavedState:
    return SavedState(preempted={f"job@{i:05}.service": i for i in range(count)}, seq=count)


def _named(stderr: str) -> list[str]:
    """The units a line says nothing will start again."""
    return [
        line.split()[4]
        for line in stderr.splitlines()
        if line.endswith("if it is still wanted") and "was preempted" in line
    ]


def _shows(
    monkeypatch: pytest.MonkeyPatch,
    saved: SavedState,
    shown: dict[str, tuple[str, str]],
    answer: Any = None,
) -> list[tuple[list[str], float]]:
    """release-jobs' stand-ins on `saved` (of this boot), systemctl showing `shown`, each
    `systemctl show` answered by `answer(command, timeout)` where given: the units each
    show named (after `--`), with its timeout, in order."""
    monkeypatch.setattr(StateStore, "load", lambda self: (saved, _this_boot()))
    monkeypatch.setattr(StateStore, "saved_since", lambda self: None)
    _systemd_started(monkeypatch)
    systemctl_and_resume(monkeypatch, shown)
    standin = subprocess.run
    calls: list[tuple[list[str], float]] = []

    def systemctl(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if command[1] == "show":
            calls.append((command[command.index("--") + 1 :], kwargs["timeout"]))
            if answer is not None:
                return answer(command, kwargs["timeout"])  # type: ignore[no-any-return]
        return standin(command, **kwargs)

    monkeypatch.setattr(subprocess, "run", systemctl)
    return calls


def test_thousands_of_preempted_units_are_shown_500_to_a_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,201 preempted units: three shows (and gpuslice.service's), not 1,201; each unit read
    from its own block, so the one started meanwhile is not named, the others are."""
    saved = _preempted(1201)
    calls = _shows(monkeypatch, saved, {"job@00600.service": ("active", "running")})
    stderr = release_jobs(tmp_path, "log_level: info\n")
    assert [len(units) for units, _ in calls] == [1, 500, 500, 201]
    assert calls[0][0] == ["gpuslice.service"]
    assert [u for units, _ in calls[1:] for u in units] == sorted(saved.preempted)
    assert all(0 < timeout <= cli_module.SHOW_TIMEOUT for _, timeout in calls)
    assert _named(stderr) == sorted(set(saved.preempted) - {"job@00600.service"})
    assert "did not show" not in stderr


def test_a_name_systemctl_refuses_fails_its_call_and_that_calls_units_are_asked_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemctl refuses the whole call over one name it takes for no unit (prints nothing,
    exits 1): that call's units are asked one by one, and each is named as before."""
    saved = _preempted(3)
    refused = "job@00001.service"

    def answer(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        if refused in command:
            return subprocess.CompletedProcess(command, 1, "", "Invalid unit name")
        return subprocess.CompletedProcess(command, 0, show(command, {}), "")

    calls = _shows(monkeypatch, saved, {}, answer)
    stderr = release_jobs(tmp_path, "log_level: info\n")
    assert [units for units, _ in calls[1:]] == [
        sorted(saved.preempted),
        *([u] for u in sorted(saved.preempted)),
    ]
    assert _named(stderr) == ["job@00000.service", "job@00002.service"]
    assert stderr.splitlines()[-1] == (
        f"{WHERE} 1 more units were preempted (the first {refused}), which systemctl did not "
        "show within release-jobs' 120 s: nothing will start again those of them that are down"
    )


def test_a_systemd_that_does_not_answer_holds_the_removal_no_longer_than_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each show runs out of its time (the clock moved by it): shows are given what is left
    of the 120 s, and none is sent past them; the units not shown are counted in one line."""
    clock = [0.0]
    monkeypatch.setattr(cli_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    saved = _preempted(3000)

    def answer(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        if command[-1] == "gpuslice.service":
            return subprocess.CompletedProcess(command, 0, show(command, {}), "")
        clock[0] += timeout
        raise subprocess.TimeoutExpired(command, timeout)

    calls = _shows(monkeypatch, saved, {}, answer)
    stderr = release_jobs(tmp_path, "log_level: info\n")
    assert [t for _, t in calls] == [30.0] * 5  # gpuslice.service's first
    assert clock[0] == 120.0
    assert stderr.splitlines() == [
        f"{WHERE} 3000 more units were preempted (the first job@00000.service), which "
        "systemctl did not show within release-jobs' 120 s: nothing will start again those of "
        "them that are down"
    ]
