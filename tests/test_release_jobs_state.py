"""`gpuslice release-jobs` saves what it did in the controller's state (`_record_released`).

It thawed the units the stopped controller froze, resumed those it suspended and stopped one
restored only in part, and left the saved state as it was: after `apt remove` then `apt
install` in the same boot (or any start after a `gpuslice release-jobs` by hand), the new
controller loaded a unit thawed here as frozen (then said it was "thawed outside" and never
froze it again) and a unit resumed here as suspended: its GPU was booked for nobody, and a
unit at its gate was granted the GPU it runs on, two jobs on one GPU. No systemd and no
cuda-checkpoint: systemctl and the resume are stand-ins (tests/release_jobs_standins.py), the
state is a real file, the controller runs on the fakes of tests/test_controller.py."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpuslice import cli as cli_module
from gpuslice import paths
from gpuslice.checkpoint import CheckpointError, CheckpointSettings, Resumed
from gpuslice.config import Config
from gpuslice.core.scheduler import Phase, SavedState
from gpuslice.state import StateStore
from tests.release_jobs_standins import release_jobs, systemctl_and_resume
from tests.test_controller import BOOT, Bed, bed_config, run, settle, state
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import cgroup_of as cgroup_of  # a fixture

FROZEN = ("active", "frozen")
# one of each: frozen beside a more urgent unit, owed a thaw, suspended and resumed, resumed
# in part and stopped, not resumed at all; and what release-jobs only names or never reads
SAVED = SavedState(
    holders={
        "voice.service": ((0,), "running", 1, ""),
        "emb.service": ((0,), "frozen", 2, ""),
        "owed.service": ((2,), "running", 3, ""),
        "caught.service": ((3,), "resuming", 4, ""),
    },
    suspended={
        "train.service": ((1,), 5),
        "partly.service": ((2,), 6),
        "left.service": ((3,), 7),
    },
    preempted={"gone.service": 8},
    held=["held.service"],
    finished=["done.service"],
    failed=["broke.service"],
    seq=8,
    frozen_for={"emb.service": ["voice.service"]},
    thaw_owed=["owed.service"],
    terms={"train.service": (60, "on-demand", 1, None)},
)
SHOWN = {n: FROZEN for n in ["emb.service", "owed.service", "caught.service", *SAVED.suspended]}
RESUME: dict[str, str | Resumed | CheckpointError] = {
    "partly.service": CheckpointError("restore of PID 8 ran out of GPU memory", restored=(7,)),
    "left.service": "cuda-checkpoint is not installed",
}


def _release(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    saved: SavedState,
    shown: dict[str, tuple[str, str]],
    boot: str = BOOT,
    gpus: int = 4,
    stop_fails: bool = False,
    during_resume: Callable[[], object] = lambda: None,
    state_dir: Path | None = None,
    pids_given: list[tuple[str, Sequence[int] | None]] | None = None,
) -> tuple[Config, list[tuple[str, str]], str]:
    """release-jobs on `saved`, saved in boot `boot` in a state file under tmp_path, this
    boot being BOOT, systemd showing units as `shown`, each resume answering as RESUME says,
    `systemctl stop` failing if `stop_fails`, `during_resume` called at each resume, the
    state in `state_dir` if given, the PIDs each resume was given to `pids_given`: the config
    it ran with, what it did in order, its stderr."""
    config = bed_config(tmp_path, gpus=gpus, state_dir=str(state_dir or tmp_path / "state"))
    StateStore(Path(config.state_dir)).save(saved, boot)
    monkeypatch.setattr(cli_module, "load_config_with_warnings", lambda path: (config, []))
    monkeypatch.setattr(paths, "STATE_DIR_RECORD", str(tmp_path / "no-record"))
    # nor the host's default state_dir (release-jobs looks there for an older controller's)
    monkeypatch.setattr(paths, "DEFAULT_STATE_DIR", str(tmp_path / "no-default-state"))
    monkeypatch.setattr(paths, "RUNTIME_DIR_RECORD", str(tmp_path / "no-runtime-record"))
    monkeypatch.setattr(cli_module, "_this_boot", lambda: (BOOT, ""))
    done, _ = systemctl_and_resume(monkeypatch, shown, RESUME)
    stand_in = subprocess.run

    def systemctl(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        ran = stand_in(command, **kwargs)  # recorded in `done`
        if stop_fails and command[1] == "stop":
            return subprocess.CompletedProcess(command, 1, "", "")
        return ran

    monkeypatch.setattr(subprocess, "run", systemctl)
    resume_left = cli_module._resume_left

    def resume(
        unit: str, settings: CheckpointSettings, pids: Sequence[int] | None = None
    ) -> Resumed | CheckpointError:
        during_resume()
        if pids_given is not None:
            pids_given.append((unit, pids))
        return resume_left(unit, settings, pids)

    monkeypatch.setattr(cli_module, "_resume_left", resume)
    return config, done, release_jobs(tmp_path, "")


def _loaded(config: Config) -> tuple[SavedState, str, int]:
    """The state file as the next controller loads it: the state, its boot, its generation."""
    store = StateStore(Path(config.state_dir), Path(config.runtime_dir))
    saved, boot = store.load()
    return saved, boot, store.generation


@pytest.mark.parametrize("stop_fails", [False, True])
def test_the_state_says_what_release_jobs_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_fails: bool
) -> None:
    """Thawed, the frozen unit runs on its GPU and the thaw owed is paid; resumed, a suspended
    unit holds its GPUs running (numbered anew, owed a thaw as after the controller's own
    resume), one caught between suspend and resume too; stopped after a resume in part, one
    holds its GPUs until systemd shows it down (then Requeue= decides, as after the
    controller's own failed resume), or runs thawed when its stop failed. The unit not
    resumed stays suspended, the preempted one is handed back (owed no comeback), and
    everything else is kept. Saved after the state it read, in the boot it was of."""
    config, done, _ = _release(tmp_path, monkeypatch, SAVED, SHOWN, stop_fails=stop_fails)
    assert ("stop", "partly.service") in done  # the stand-ins did what the test says
    saved, boot, generation = _loaded(config)
    assert (boot, generation) == (BOOT, 2)
    partly = "running" if stop_fails else "stopping"
    assert saved.holders == {
        "voice.service": ((0,), "running", 1, ""),
        "emb.service": ((0,), "running", 2, ""),
        "owed.service": ((2,), "running", 3, ""),
        "caught.service": ((3,), "running", 4, ""),
        "train.service": ((1,), "running", 9, ""),
        "partly.service": ((2,), partly, 10, ""),
    }
    assert saved.suspended == {"left.service": ((3,), 7)}
    assert saved.frozen_for == {}
    owed = ["caught.service", "train.service", "partly.service"]
    assert saved.thaw_owed == (owed if stop_fails else owed[:2])
    assert saved.seq == 10
    # gone.service, preempted, was named as nothing will start it again: it is owed nothing
    assert (saved.preempted, saved.held, saved.finished, saved.failed) == (
        {},
        SAVED.held,
        SAVED.finished,
        SAVED.failed,
    )
    assert saved.terms == SAVED.terms


def test_the_pids_the_suspends_checkpointed_are_resumed_and_go_with_their_units(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """release-jobs resumes the PIDs each suspend checkpointed (`_resume_left`). Kept for a
    unit resumed or stopped here, the next controller's load dropped them as an
    invalid entry (no suspended unit), said an error and set the file aside; the PIDs of
    the unit left suspended are kept for its resume."""
    pids: dict[str, tuple[tuple[int, ...], int, float]] = {
        n: ((4242 + i,), 1 << 30, 1.7e9) for i, n in enumerate(SAVED.suspended)
    }
    given: list[tuple[str, Sequence[int] | None]] = []
    saved = replace(SAVED, checkpointed=pids)
    config, _, _ = _release(tmp_path, monkeypatch, saved, SHOWN, pids_given=given)
    # each resumed on what its suspend checkpointed; caught.service, with none, as before
    assert sorted(given) == sorted(
        [("caught.service", None), *((n, p[0]) for n, p in pids.items())]
    )
    with caplog.at_level(logging.WARNING):
        saved = _loaded(config)[0]
    assert saved.checkpointed == {"left.service": pids["left.service"]}
    assert [r.getMessage() for r in caplog.records if r.name.startswith("gpuslice")] == []


def test_a_state_release_jobs_did_nothing_to_is_left_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another boot's state: nothing acted on, and what is written only hands back the units
    it names preempted (gone.service, and the suspended ones, preempted with that boot), in
    the boot it was of; with none, nothing is written (its file unchanged). Nor when nothing
    could be done in this boot (the units not frozen now)."""
    config, done, _ = _release(tmp_path, monkeypatch, SAVED, SHOWN, boot="boot-0")
    assert done == []
    handed_back = replace(SAVED, suspended={}, preempted={}, terms={})
    assert _loaded(config) == (handed_back, "boot-0", 2)
    _release(tmp_path, monkeypatch, handed_back, SHOWN, boot="boot-0")
    assert _loaded(config) == (handed_back, "boot-0", 1)  # as the test saved it
    kept = replace(SAVED, preempted={})
    shown = {n: ("active", "running") for n in SHOWN}
    _release(tmp_path, monkeypatch, kept, shown)
    assert _loaded(config) == (kept, BOOT, 1)


@pytest.mark.parametrize("meanwhile", ["controller", "saved", "unreadable", "unwritable"])
def test_a_state_that_changed_or_cannot_be_written_is_left_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    """The controller shares no lock with release-jobs: one started meanwhile loaded the old
    state (or loads it) and saves its own, and one that saved since wrote a state newer than
    the one read. That state is not replaced; nor is one that cannot be read again (nothing
    is written over what was not read) or written. Each is said, with the units the next
    controller takes for frozen or suspended still."""
    saved = SavedState(
        holders={"emb.service": ((0,), "frozen", 1, "")},
        suspended={"train.service": ((1,), 2)},
        seq=2,
    )
    path = tmp_path / "state" / "state.json"
    other = SavedState(preempted={"other.service": 3}, seq=3)
    shown = {"emb.service": FROZEN, "train.service": FROZEN}
    written: list[bytes] = []

    def during_resume() -> None:
        written.append(path.read_bytes())
        if meanwhile == "controller":
            shown["gpuslice.service"] = ("activating", "running")
        elif meanwhile == "saved":  # a controller started and stopped: loaded, then saved
            controller = StateStore(path.parent)
            controller.load()
            controller.save(other, BOOT)
        elif meanwhile == "unreadable":
            path.unlink()
            path.mkdir()
        else:
            monkeypatch.setattr(StateStore, "save", refused)

    def refused(self: StateStore, saved: SavedState, boot: str) -> Path:
        raise PermissionError(13, "Permission denied")

    config, done, stderr = _release(
        tmp_path, monkeypatch, saved, shown, gpus=2, during_resume=during_resume
    )
    assert done == [("thaw", "emb.service"), ("resume", "train.service")]
    why = {
        "controller": "gpuslice.service is activating now",
        "saved": f"{path} was saved again since it was read",
        "unreadable": f"{path}: not a regular file (a directory)",
        "unwritable": "cannot write it: Permission denied",
    }[meanwhile]
    assert stderr.splitlines()[-1] == (
        f"gpuslice release-jobs: the saved state {path} is left as it was ({why}): a gpuslice "
        "started again this boot takes emb.service, train.service for still frozen or suspended"
    )
    if meanwhile == "saved":
        assert _loaded(config)[0] == other
    elif meanwhile == "unreadable":
        assert path.is_dir()
    else:
        assert path.read_bytes() == written[0]


def test_a_state_gone_meanwhile_is_not_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removed while release-jobs ran: no controller reads what it said, and nothing is made
    in its place (nor its directory: no state of ours is written where none was read)."""

    def gone() -> None:
        path = tmp_path / "state" / "state.json"
        path.unlink()
        path.parent.rmdir()

    saved = SavedState(suspended={"train.service": ((1,), 2)}, seq=2)
    shown = {"train.service": FROZEN}
    config, done, stderr = _release(tmp_path, monkeypatch, saved, shown, gpus=2, during_resume=gone)
    assert done == [("resume", "train.service")]
    assert "left as it was" not in stderr
    assert not Path(config.state_dir).exists()


def test_a_controller_started_after_release_jobs_books_what_it_resumed(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cgroup_of: dict[int, str],
) -> None:
    """`apt remove`, then `apt install` in the same boot: emb.service, frozen beside
    voice.service, was thawed, and train.service, suspended from GPU 1, resumed there. The
    new controller loaded them frozen and suspended: it called emb.service thawed outside
    (never to be frozen again while it runs), and b.service, at its gate, was granted GPU 1,
    where train.service runs. Now both are running holders on their GPUs: b.service, more
    urgent, waits for train.service to give way."""
    saved = SavedState(
        holders={
            "voice.service": ((0,), "running", 1, ""),
            "emb.service": ((0,), "frozen", 2, ""),
        },
        suspended={"train.service": ((1,), 3)},
        frozen_for={"emb.service": ["voice.service"]},
        seq=3,
    )
    shown = {"emb.service": FROZEN, "train.service": FROZEN}
    config, done, _ = _release(tmp_path, monkeypatch, saved, shown, gpus=2)
    assert done == [("thaw", "emb.service"), ("resume", "train.service")]
    caplog.set_level(logging.DEBUG, "gpuslice")
    bed = Bed(
        tmp_path,
        {
            "voice.service": "Priority=10\nMemory=4G\n",
            "emb.service": "Priority=90\nMemory=4G\nPreempt=freeze stop\n",
            "train.service": "Priority=60\nPreempt=suspend stop\n",
            "b.service": "Priority=50\n",
        },
        [
            state("voice.service", "active", "running"),
            state("emb.service", "active", "running"),
            state("train.service", "active", "running"),
            state("b.service", "activating", "start-pre", 3, "start"),
        ],
        config=config,
    )
    cgroup_of[4242] = "b.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        core = ctl.scheduler
        assert core.suspended_units() == []
        assert core.grants() == {
            "voice.service": frozenset({0}),
            "emb.service": frozenset({0}),
            "train.service": frozenset({1}),
        }
        assert core.phase("emb.service") is Phase.RUNNING
        assert "emb.service" not in core.unfreezable
        await bed.acquire("b.service", ":1.9", 4242)
        await settle()
        assert bed.service.granted == []  # not beside train.service: it gives way first
        assert core.phase("train.service") in (Phase.SUSPENDING, Phase.STOPPING)
        assert not [r for r in caplog.records if "thawed outside" in r.getMessage()]

    run(test)
