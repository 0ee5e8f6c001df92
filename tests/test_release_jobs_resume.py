"""`gpuslice release-jobs` resumes the units the stopped controller left suspended by
cuda-checkpoint (their processes frozen, their GPU memory in host memory), by the controller's
own resume (gpuslice.ladder.Ladder.resume), instead of leaving them frozen for ever with only
a stop, their work lost, to end them. No systemd and no cuda-checkpoint: the state, systemd's
answers and the resume are stand-ins."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from dbus_next import Variant

from gpuslice import checkpoint
from gpuslice import cli as cli_module
from gpuslice.checkpoint import CheckpointError, CheckpointSettings, Resumed
from gpuslice.config import Config
from gpuslice.core.scheduler import SavedState
from gpuslice.ladder import Ladder
from gpuslice.state import StateStore
from gpuslice.systemd import MANAGER, PROPERTIES, Systemd
from gpuslice.tracker import UnitState
from tests.release_jobs_standins import release_jobs, systemctl_and_resume

TOOL = "/opt/nvidia/cuda-checkpoint"


STARTED = 1700000000000000  # the stand-in systemd's UserspaceTimestamp


def _this_boot(started: int = STARTED) -> str:
    """This boot as the controller's Systemd.boot_id tells it, systemd having started at
    `started` (the stand-in's, `_Systemd`)."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip() + f"/{started}"


def _systemd_started(
    monkeypatch: pytest.MonkeyPatch, started: int | BaseException | None = STARTED
) -> list[tuple[str | None, _Systemd]]:
    """systemd on the bus as release-jobs asks it when it started (`_Systemd`: answering
    `started`, or failing with it, or never answering): each connection made, with the bus
    address it was for."""
    made: list[tuple[str | None, _Systemd]] = []

    async def connect(address: str | None = None, timeout: float | None = None) -> _Systemd:
        made.append((address, _Systemd([], [], started=started)))
        return made[-1][1]

    monkeypatch.setattr(Systemd, "connect", connect)
    return made


def _release(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    saved: SavedState,
    shown: dict[str, tuple[str, str]],
    resume: Mapping[str, str | Resumed | CheckpointError] | None = None,
    boot: str = "",
) -> tuple[list[tuple[str, str]], list[CheckpointSettings], str]:
    """Run release-jobs on the saved state `saved` (of this boot unless `boot`), systemd showing
    each unit's (ActiveState, FreezerState) as `shown`, each resume answering as `resume` says
    (why it failed, or its outcome; one process restored by default): what it did in order
    (("thaw" | "resume" | systemctl's verb, unit)), the settings each resume got, and its
    stderr."""
    monkeypatch.setattr(StateStore, "load", lambda self: (saved, boot or _this_boot()))
    # the state is this stand-in, in no file: nothing on the host to save over or
    # to find saved since (a /var/lib/gpuslice left by another run made it so)
    monkeypatch.setattr(StateStore, "saved_since", lambda self: None)
    _systemd_started(monkeypatch)
    done, settings = systemctl_and_resume(monkeypatch, shown, resume)
    return done, settings, release_jobs(tmp_path, "restore_timeout: 42\n")


def test_a_unit_suspended_in_this_boot_is_resumed_with_the_controllers_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removing gpuslice while a job was suspended left it frozen for ever, its memory in
    host memory: `systemctl stop` (its work lost) was the only way out. Resumed with
    config.yaml's settings, the tool run as the controller runs it (root's alone, through
    systemd-run)."""
    saved = SavedState(suspended={"train.service": ((1,), 4)})
    done, settings, stderr = _release(
        tmp_path, monkeypatch, saved, {"train.service": ("active", "frozen")}
    )
    assert done == [("resume", "train.service")]
    assert stderr.splitlines() == [
        "gpuslice is being removed: train.service resumed from host memory, 1 process: "
        "restored in 0.5 s"
    ]
    (s,) = settings
    assert (s.restore_timeout, s.root_only, s.via_systemd) == (42.0, True, True)


@pytest.mark.parametrize(
    "why",
    [
        "restore of PID 7 ran out of GPU memory; the process cannot be resumed and must be stopped",
        "cuda-checkpoint is not installed",
        "restore of PID 7 timed out after 42 s: cuda-checkpoint did not return",
    ],
)
def test_a_failed_resume_leaves_the_unit_suspended_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """Other jobs may hold the GPU memory a restore needs now, the tool may be gone: the unit
    is left as it was (never stopped), named with what ends it and why it was not resumed."""
    saved = SavedState(suspended={"train.service": ((1,), 4)})
    shown = {"train.service": ("active", "frozen")}
    done, _, stderr = _release(tmp_path, monkeypatch, saved, shown, {"train.service": why})
    assert done == [("resume", "train.service")]  # no stop, no kill, no thaw of its own
    assert stderr.splitlines() == [
        "gpuslice is being removed: train.service is left suspended by cuda-checkpoint: "
        "nothing can resume it now; `systemctl stop train.service` ends it "
        f"(not resumed: {why})"
    ]


def test_only_a_unit_active_and_frozen_in_this_boot_is_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit thawed since (by hand) is not frozen: nothing is tried, and the line says why.
    One down needs nothing; one of an earlier boot was preempted (its processes died)."""
    saved = SavedState(
        suspended={"thawed.service": ((0,), 1), "down.service": ((1,), 2)},
    )
    shown = {"thawed.service": ("active", "running"), "down.service": ("inactive", "running")}
    done, _, stderr = _release(tmp_path, monkeypatch, saved, shown)
    assert done == []
    assert stderr.splitlines() == [
        "gpuslice is being removed: thawed.service is left suspended by cuda-checkpoint: "
        "nothing can resume it now; `systemctl stop thawed.service` ends it "
        "(not resumed: systemd shows it running)"
    ]
    shown = {"thawed.service": ("active", "frozen")}
    done, _, stderr = _release(tmp_path, monkeypatch, saved, shown, boot="another-boot/1")
    assert done == []
    assert "resumed from host memory" not in stderr


def test_a_running_controllers_suspended_units_are_left_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop the removal asked for and did not get: the controller resumes its units, and a
    second resume beside its own would fight it."""
    saved = SavedState(suspended={"train.service": ((1,), 4)})
    shown = {"gpuslice.service": ("active", "running"), "train.service": ("active", "frozen")}
    done, _, stderr = _release(tmp_path, monkeypatch, saved, shown)
    assert done == []
    assert "gpuslice.service is active: its units are left to it" in stderr


def test_thaws_then_resumes_most_urgent_first_as_the_controller_orders_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume needs GPU memory that other jobs may hold now: the most urgent unit gets it
    first (the priority it was last held on, then who was suspended first), after a unit
    caught between suspend and resume (it still holds its GPUs: the controller's `recover`
    resumes it at once), after the thaws (the controller thaws before it resumes), not in
    the order of their names."""
    terms: dict[str, tuple[int, str, int, int | None]] = {
        "a-mid.service": (50, "background", 1, None),
        "b-urgent-late.service": (10, "background", 1, None),
        "c-urgent-early.service": (10, "background", 1, None),
        "d-caught.service": (900, "background", 1, None),
    }
    saved = SavedState(
        holders={
            "d-caught.service": ((2,), "suspending", 8, ""),
            "z-frozen.service": ((0,), "frozen", 2, ""),
        },
        suspended={
            "a-mid.service": ((1,), 3),
            "b-urgent-late.service": ((1,), 12),
            "c-urgent-early.service": ((1,), 5),
            "e-no-terms.service": ((1,), 1),  # an older controller's file: the least urgent
        },
        terms=terms,
    )
    shown = {n: ("active", "frozen") for n in [*saved.suspended, *saved.holders]}
    done, _, _ = _release(tmp_path, monkeypatch, saved, shown)
    assert done == [
        ("thaw", "z-frozen.service"),
        ("resume", "d-caught.service"),
        ("resume", "c-urgent-early.service"),
        ("resume", "b-urgent-late.service"),
        ("resume", "a-mid.service"),
        ("resume", "e-no-terms.service"),
    ]


# --- the resume itself: the controller's Ladder, on a stand-in systemd and cuda-checkpoint


class _Bus:
    def __init__(self) -> None:
        self.disconnected = False

    def disconnect(self) -> None:
        self.disconnected = True


class _Systemd:
    """What Ladder asks of gpuslice.systemd.Systemd, recorded in `calls`; FreezeUnit fails
    with `freeze_fails` when given. Asked when it started (the Get of UserspaceTimestamp
    that the controller's own Systemd.boot_id sends), it answers `started`, or fails with
    it, or never answers (None)."""

    boot_id = Systemd.boot_id  # the controller's reading of this boot, on these answers

    def __init__(
        self,
        calls: list[tuple[str, ...]],
        pids: list[int],
        freeze_fails: str = "",
        started: int | BaseException | None = STARTED,
    ) -> None:
        self.bus = _Bus()
        self.calls = calls
        self.pids = pids
        self.freeze_fails = freeze_fails
        self.started = started

    async def call(
        self, member: str, signature: str = "", body: list[Any] | None = None, **where: str
    ) -> list[Any]:
        assert (member, signature, body, where) == (
            "Get",
            "ss",
            [MANAGER, "UserspaceTimestamp"],
            {"interface": PROPERTIES},
        )
        if self.started is None:
            await asyncio.Event().wait()  # never answers
        if isinstance(self.started, BaseException):
            raise self.started
        return [Variant("t", self.started)]

    async def freeze_unit(self, name: str) -> None:
        self.calls.append(("FreezeUnit", name))
        if self.freeze_fails:
            raise RuntimeError(self.freeze_fails)

    async def thaw_unit(self, name: str) -> None:
        self.calls.append(("ThawUnit", name))

    async def freezer_state(self, name: str) -> str:
        return "frozen"

    async def unit_state(self, name: str) -> UnitState:
        return UnitState(name, "active", "running", 0)

    async def unit_pids(self, name: str) -> list[int]:
        self.calls.append(("GetUnitProcesses", name))
        return self.pids


def _tool_and_systemd(
    monkeypatch: pytest.MonkeyPatch,
    restore_fails: str = "",
) -> tuple[list[tuple[str, ...]], list[_Systemd]]:
    """A trusted tool at TOOL that finds PIDs 11 and 12 checkpointed and knows nothing of 13
    (no CUDA process), whose restore fails with `restore_fails` when given; systemd listing
    the unit's processes 11-13. What was called, in order, and each connection made."""
    calls: list[tuple[str, ...]] = []
    made: list[_Systemd] = []

    async def connect(address: str | None = None, timeout: float | None = None) -> _Systemd:
        made.append(_Systemd(calls, [11, 12, 13]))
        return made[-1]

    async def get_state(tool: str, pid: int, via_systemd: bool = False) -> str:
        if pid == 13:
            raise CheckpointError("the state of PID 13 could not be read: no CUDA")
        return checkpoint.CHECKPOINTED

    async def stop_earlier_runs(pids: list[int]) -> str:
        return ""

    async def resume(
        tool: str, pids: list[int], s: CheckpointSettings, owned: object = None
    ) -> Resumed:
        calls.append(("restore", tool, *map(str, pids)))
        if restore_fails:
            raise CheckpointError(restore_fails, lost=(pids[0],))
        return Resumed(0.5, tuple(pids))

    monkeypatch.setattr(Systemd, "connect", connect)
    monkeypatch.setattr(checkpoint, "find_tool", lambda configured, **kw: TOOL)
    monkeypatch.setattr(checkpoint, "check_tool", lambda tool, root_only: None)
    monkeypatch.setattr(checkpoint, "get_state", get_state)
    monkeypatch.setattr(checkpoint, "stop_earlier_runs", stop_earlier_runs)
    monkeypatch.setattr(checkpoint, "resume", resume)
    monkeypatch.setattr(Ladder, "_require_freezer", lambda self: None)  # no cgroup v2 here
    return calls, made


def test_the_resume_is_the_controllers_thaw_then_restore_of_its_cuda_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ladder.resume, as after a controller restart: ThawUnit first (the restore runs in
    the process), then each process cuda-checkpoint knows is restored; nothing frozen again."""
    calls, made = _tool_and_systemd(monkeypatch)
    saved = SavedState(suspended={"train.service": ((1,), 4)})
    monkeypatch.setattr(StateStore, "load", lambda self: (saved, _this_boot()))
    # the state is this stand-in, in no file: nothing on the host to save over or
    # to find saved since (a /var/lib/gpuslice left by another run made it so)
    monkeypatch.setattr(StateStore, "saved_since", lambda self: None)
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda command, **kw: subprocess.CompletedProcess(
            command,
            0,
            "ActiveState=inactive\n"
            if command[-1] == "gpuslice.service"
            else "ActiveState=active\nFreezerState=frozen\n",
            "",
        ),
    )
    assert release_jobs(tmp_path, "log_level: info\n").splitlines() == [
        "gpuslice is being removed: train.service resumed from host memory, 2 processes: "
        "restored in 0.5 s"
    ]
    assert calls == [
        ("ThawUnit", "train.service"),
        ("GetUnitProcesses", "train.service"),
        ("restore", TOOL, "11", "12"),
    ]
    assert made[0].bus.disconnected


def test_a_restore_that_fails_leaves_the_unit_frozen_again_never_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thawed for its restore, a unit whose restore failed (out of GPU memory: other jobs
    run now) is frozen again, as it was; its reason says why."""
    why = "restore of PID 11 ran out of GPU memory; the process cannot be resumed"
    calls, made = _tool_and_systemd(monkeypatch, restore_fails=why)
    settings = CheckpointSettings.from_config(Config())
    failed = cli_module._resume_left("train.service", settings)
    assert isinstance(failed, CheckpointError) and failed.reason == why
    assert calls == [
        ("ThawUnit", "train.service"),
        ("GetUnitProcesses", "train.service"),
        ("restore", TOOL, "11", "12"),
        ("FreezeUnit", "train.service"),
    ]
    assert made[0].bus.disconnected


def test_no_thaw_without_a_tool_that_only_root_can_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run as root: a cuda-checkpoint that anyone can write is not run (check_tool, as the
    controller runs it), and one not there cannot restore; either way the unit is not thawed
    (not even connected to systemd for), so it stays as it was."""
    monkeypatch.setattr(Systemd, "connect", lambda address=None: pytest.fail("connected"))
    tool = tmp_path / "cuda-checkpoint"
    tool.write_text("#!/bin/sh\nexit 0\n")
    os.chmod(tool, 0o777)
    anyones = CheckpointSettings.from_config(Config(cuda_checkpoint=str(tool)))
    why = cli_module._resume_left("train.service", anyones)
    assert isinstance(why, CheckpointError)
    assert "is not run: gpuslice runs it as root, and someone other than root" in why.reason
    gone = CheckpointSettings.from_config(Config(cuda_checkpoint=str(tmp_path / "gone")))
    why = cli_module._resume_left("train.service", gone)
    assert isinstance(why, CheckpointError) and "is not an executable file" in why.reason
