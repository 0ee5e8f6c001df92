"""The stand-ins `gpuslice release-jobs` runs on in its tests (tests/test_release_jobs_*.py):
systemctl, the resume of a suspended unit, and the run itself. No systemd, no
cuda-checkpoint."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuslice import cli as cli_module
from gpuslice.checkpoint import CheckpointError, CheckpointSettings, Resumed
from gpuslice.cli import main


def systemctl_and_resume(
    monkeypatch: pytest.MonkeyPatch,
    shown: Mapping[str, tuple[str, str]],
    resume: Mapping[str, str | Resumed | CheckpointError] | None = None,
) -> tuple[list[tuple[str, str]], list[CheckpointSettings]]:
    """systemctl showing each unit's (ActiveState, FreezerState) as `shown` (inactive and
    running unless said), and each resume answering as `resume` says (why it failed, or its
    outcome; one process restored by default): what was done in order (("resume" |
    systemctl's verb, unit)), and the settings each resume got."""
    done: list[tuple[str, str]] = []
    settings: list[CheckpointSettings] = []

    def systemctl(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if command[1] == "show":
            return subprocess.CompletedProcess(command, 0, show(command, shown), "")
        done.append((command[1], command[-1]))
        return subprocess.CompletedProcess(command, 0, "", "")

    def resume_left(
        unit: str, s: CheckpointSettings, pids: Sequence[int] | None = None
    ) -> Resumed | CheckpointError:
        done.append(("resume", unit))
        settings.append(s)
        answer = (resume or {}).get(unit, "")
        if isinstance(answer, str):
            return CheckpointError(answer) if answer else Resumed(0.5, (11,))
        return answer

    monkeypatch.setattr(subprocess, "run", systemctl)
    monkeypatch.setattr(cli_module, "_resume_left", resume_left)
    return done, settings


def show(command: list[str], shown: Mapping[str, tuple[str, str]]) -> str:
    """What `systemctl show -p ActiveState -p FreezerState -- UNIT...` prints: a block for
    each unit named after `--`, in that order, blank-line separated; each unit's
    (ActiveState, FreezerState) as `shown` says (inactive and running unless said)."""
    units = command[command.index("--") + 1 :]
    blocks = []
    for unit in units:
        active, freezer = shown.get(unit, ("inactive", "running"))
        blocks.append(f"ActiveState={active}\nFreezerState={freezer}\n")
    return "\n".join(blocks)


def release_jobs(tmp_path: Path, config: str) -> str:
    """`gpuslice release-jobs` with `config` as its config.yaml, which exits 0: its stderr."""
    (tmp_path / "config.yaml").write_text(config)
    result = CliRunner().invoke(main, ["release-jobs", "--config", str(tmp_path / "config.yaml")])
    assert result.exit_code == 0, result.output
    return result.stderr
