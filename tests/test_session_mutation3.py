"""What mutation testing of this session's new code showed no test held (the third run).

- suspends under way count all they move: a third suspend decided while two others still
  copy is refused for the memory of both, and MemAvailable below what they move is told as
  "0 B" available (`Ladder._suspend`, `_host_memory_left`);
- a FreezeUnit that failed after the checkpoint is no freeze: the undo sends no ThawUnit
  (only one that worked is thawed before the restore);
- the thaw before the undo of a suspend whose freeze worked, sent again after an error that
  passes, says so in a debug line naming the suspend (`_thaw_to_undo`); the resume's line
  for a PID another unit's process has now, in its exact words (`_still_its_own`);
- status read right after a suspend or resume ended (in the controller's batch, before its
  pass; or after a failed resume, which no pass follows) or a resume began still says why
  each waiter waits (the core's cache of each GPU's top holder, reset then, is read by
  `snapshot` outside a pass);
- a systemd re-exec reads again an annotated unit that ended before it: one started while
  its signals were lost is taken in (`Controller._apply` keeps the tracker's record of an
  annotated unit at its down).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from gpuslice import checkpoint
from gpuslice.checkpoint import CheckpointSettings, Resumed
from gpuslice.core.scheduler import Action, Outcome, Phase, Scheduler
from gpuslice.inventory import GpuUse
from gpuslice.ladder import Ladder
from tests.core_builders import BG, brief, sized, spec
from tests.test_checkpoint import FAST
from tests.test_controller import Bed, low_holds_gpu_0, run, settle, state, until
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_ladder_adapter import LOOK, NO_REPLY, BlinkingFreezer, Events, Freezer

GIB = 1 << 30
UNIT = "vlm.service"

# ---- the ladder, with cuda-checkpoint's steps stubbed ---------------------------------------


class Stubbed:
    """A Ladder whose checkpoint and restore are stubs: `shown` is what NVML shows (a
    checkpoint takes its PIDs off it once `go` is set, if it `frees` them), `available`
    MemAvailable."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        tool = tmp_path / "cuda-checkpoint"
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
        marker = tmp_path / "cgroup.controllers"
        marker.touch()
        self.owners: dict[int, str] = {}
        self.shown: list[GpuUse] = []
        self.available: int | None = 64 * GIB
        self.go = asyncio.Event()
        self.copying: list[int] = []  # the PIDs whose checkpoint has begun
        self.frees = True  # whether a checkpoint takes its PIDs off the GPU
        self.restored: list[list[int]] = []
        self.freezer = Freezer()
        self.events = Events()
        self.settings = dataclasses.replace(FAST, tool=str(tool), host_memory_margin=0)
        monkeypatch.setattr(checkpoint, "suspend", self._suspend)
        monkeypatch.setattr(checkpoint, "resume", self._resume)
        self.ladder = Ladder(
            self.freezer,
            self.events,
            lambda: list(self.shown),
            lambda: self.settings,
            self._report,
            unified_marker=marker,
            host_memory=lambda: self.available,
            unit_of_pid=self.owners.get,
            sleep=self._no_wait,
        )

    def job(self, pid: int, unit: str, gib: int) -> None:
        self.owners[pid] = unit
        self.shown.append(GpuUse(pid, 0, gib * GIB, unit, "job"))

    async def _suspend(
        self, tool: str, pids: Sequence[int], s: CheckpointSettings, owned: object = None
    ) -> float:
        self.copying += pids
        await self.go.wait()
        if self.frees:
            self.shown[:] = [p for p in self.shown if p.pid not in pids]
        return 0.5

    async def _resume(
        self, tool: str, pids: Sequence[int], s: CheckpointSettings, owned: object = None
    ) -> Resumed:
        self.restored.append(list(pids))
        return Resumed(0.5, tuple(pids))

    async def _no_wait(self, seconds: float) -> None:
        pass

    def _report(self, event: Callable[[], list[Action]]) -> None:
        event()


@pytest.fixture
def stubbed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Stubbed:
    return Stubbed(tmp_path, monkeypatch)


def test_a_third_suspend_counts_what_both_under_way_still_move(stubbed: Stubbed) -> None:
    """a and b (4 GiB each) copy to host memory at once; c, decided meanwhile, finds 10 GiB
    available less the 8 GiB both still move, not the 4 GiB of the last one begun."""
    for pid, unit in ((11, "a.service"), (12, "b.service"), (13, "c.service")):
        stubbed.job(pid, unit, 4)
    stubbed.available = 10 * GIB

    async def test() -> None:
        first = asyncio.ensure_future(stubbed.ladder.suspend("a.service"))
        second = asyncio.ensure_future(stubbed.ladder.suspend("b.service"))
        while len(stubbed.copying) < 2:
            await asyncio.sleep(0)
        third = asyncio.ensure_future(stubbed.ladder.suspend("c.service"))
        while not third.done() and len(stubbed.copying) < 3:
            await asyncio.sleep(0)
        stubbed.go.set()
        await asyncio.gather(first, second, third)

    run(test)
    assert stubbed.events.said[0] == (
        "suspend_failed",
        "c.service",
        "not enough host memory: 4 GiB to move but 2 GiB of host memory available "
        "(margin 0 B); other suspends under way are moving 8 GiB there",
    )
    assert [e[:2] for e in stubbed.events.said[1:]] == [
        ("suspended", "a.service"),
        ("suspended", "b.service"),
    ]
    assert stubbed.ladder.moving == 0


def test_memory_available_below_what_suspends_move_is_none_left(stubbed: Stubbed) -> None:
    """MemAvailable fell (another program's memory) under the 8 GiB a suspend still moves:
    none is left, told as 0 B, never a byte."""
    stubbed.job(11, "a.service", 8)
    stubbed.job(12, "b.service", 1)

    async def test() -> None:
        first = asyncio.ensure_future(stubbed.ladder.suspend("a.service"))
        while not stubbed.copying:
            await asyncio.sleep(0)
        stubbed.available = 6 * GIB
        await stubbed.ladder.suspend("b.service")
        stubbed.go.set()
        await first

    run(test)
    assert stubbed.events.said[0] == (
        "suspend_failed",
        "b.service",
        "not enough host memory: 1 GiB to move but 0 B of host memory available "
        "(margin 0 B); other suspends under way are moving 8 GiB there",
    )


def test_a_freeze_that_failed_after_the_checkpoint_is_not_thawed_before_the_undo(
    stubbed: Stubbed,
) -> None:
    """Only a FreezeUnit that worked is undone by a ThawUnit before the restore: after one
    systemd refused, the unit was never frozen, and a thaw (or its failure, in the reason)
    would claim otherwise."""
    stubbed.job(11, UNIT, 2)
    stubbed.go.set()
    stubbed.freezer.fail.update({"freeze", "thaw"})
    asyncio.run(stubbed.ladder.suspend(UNIT))
    assert stubbed.events.said == [("suspend_failed", UNIT, "FreezeUnit failed: freeze refused")]
    assert stubbed.freezer.calls == [LOOK, f"freeze {UNIT}"]
    assert stubbed.restored == [[11]]


def test_the_thaw_before_an_undo_sent_again_says_it_is_the_suspend_s(
    stubbed: Stubbed, caplog: pytest.LogCaptureFixture
) -> None:
    """Frozen, the unit still shows its process on the GPU (the checkpoint left it there):
    the suspend is undone, thawed first; the ThawUnit that failed for a moment is sent again
    with a debug line naming what it was for."""
    stubbed.job(11, UNIT, 2)
    stubbed.go.set()
    stubbed.ladder.systemd = stubbed.freezer = BlinkingFreezer(1)
    stubbed.frees = False  # still on the GPU after the checkpoint
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        asyncio.run(stubbed.ladder.suspend(UNIT))
    assert f"suspending {UNIT}: ThawUnit failed: {NO_REPLY}; sent again in 1 s" in [
        r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG
    ]
    assert stubbed.freezer.calls == [LOOK, f"freeze {UNIT}", f"thaw {UNIT}", f"thaw {UNIT}"]
    [(event, _, words)] = stubbed.events.said
    assert (event, words) == (
        "suspend_failed",
        "NVML still shows PID 11 on GPU 0 after the checkpoint",
    )


def test_a_restore_says_which_pids_are_other_units_processes_now(
    stubbed: Stubbed, caplog: pytest.LogCaptureFixture
) -> None:
    stubbed.owners.update({11: UNIT, 12: "other.service"})
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        asyncio.run(stubbed.ladder.restore(UNIT, [11, 12]))
    assert stubbed.restored == [[11]]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        f"resuming {UNIT}: PIDs [12] are other units' processes now"
    ]


# ---- the core: status read outside a pass after a ladder report ------------------------------


def _late_waits_behind_vlm() -> Scheduler:
    """late.service waits for GPU 0, which vlm.service (more urgent) holds and is being
    suspended for voice.service."""
    vlm = spec("vlm", 90, BG, preempt="suspend stop")
    voice, late = spec("voice", 10), spec("late", 95)
    s = Scheduler([sized(0)], {u.name: u for u in (vlm, voice, late)})
    assert brief(s.request(vlm)) == ["grant vlm.service 0"]
    assert brief(s.request(late)) == []
    assert brief(s.request(voice)) == ["suspend vlm.service 0"]
    return s


def _late_s_reason(s: Scheduler) -> str:
    return dict((n, w) for n, _, w in s.snapshot().waiting)["late.service"]


@pytest.mark.parametrize(
    ("report", "then", "says"),
    [
        ("failed", ["stop vlm.service"], "GPU 0 being freed by vlm.service (stopping)"),
        ("lost", ["stop vlm.service"], "GPU 0 being freed by vlm.service (stopping)"),
        ("done", [], "GPU 0 kept for suspended vlm.service, priority 90"),
    ],
    ids=["failed", "lost", "done"],
)
def test_status_read_in_a_batch_after_a_suspend_ended_says_why_each_waits(
    report: str, then: list[str], says: str
) -> None:
    """vlm.service's suspend for voice.service ends (fails and falls to a stop; fails and
    its undo lost a process; is done) in a batch of the controller's, whose pass comes only
    after it: status, asked before that pass, names GPU 0's holder as it is now (the core's
    cache of each GPU's top holder, reset then, is read by `snapshot` outside a pass)."""
    s = _late_waits_behind_vlm()
    with s.deferred():  # as Controller._batched takes in a ladder's report
        if report == "done":
            acts = s.suspended_done("vlm.service", "14 GiB to host memory in 2 s")
        else:
            acts = s.suspend_failed("vlm.service", "no cuda-checkpoint", lost=report == "lost")
    assert brief(acts) == then
    assert _late_s_reason(s) == f"waiting: {says}"


@pytest.mark.parametrize("report", ["resumed", "resume_failed"])
def test_status_after_a_resume_began_and_ended_says_why_each_waits(report: str) -> None:
    """voice.service exits and vlm.service is resumed on GPU 0, then is resumed or stopped
    after a failed resume (in a batch, or with no pass after it): status, asked after each,
    names GPU 0's holder as it is now."""
    s = _late_waits_behind_vlm()
    assert brief(s.suspended_done("vlm.service", "")) == ["grant voice.service 0"]
    assert brief(s.inactive("voice.service", Outcome.EXITED)) == ["resume vlm.service 0"]
    assert _late_s_reason(s) == "waiting: GPU 0 held by vlm.service, priority 90"
    with s.deferred():  # as Controller._batched takes in a ladder's report
        if report == "resumed":
            assert brief(s.resumed("vlm.service", "6 s")) == []
            says = "GPU 0 held by vlm.service, priority 90"
        else:  # a pass would change nothing: none follows
            assert brief(s.resume_failed("vlm.service", "out of memory")) == ["stop vlm.service"]
            says = "GPU 0 being freed by vlm.service (stopping)"
    assert _late_s_reason(s) == f"waiting: {says}"


# ---- the controller: an annotated unit's record kept at its down -----------------------------


def test_an_annotated_unit_started_while_systemd_re_executed_is_read_and_taken_in(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """low.service ended before systemd re-executed; during the re-exec it was started again,
    and its signals were lost. The controller reads every unit it follows once systemd is
    back: low.service among them (the record of an annotated unit is kept at its down, not
    dropped as an unannotated one's is), and its start at the gate is taken in."""
    bed: Bed = low_holds_gpu_0(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        bed.systemd.units["low.service"] = state("low.service", "inactive", "dead")
        ctl.on_unit_changed("low.service", {"ActiveState": "inactive", "SubState": "dead"})
        await settle()
        assert ctl.scheduler.phase("low.service") is None
        bed.systemd.reads.clear()
        bed.systemd.units["low.service"] = state("low.service", "activating", "start-pre", 7)
        ctl.on_systemd_restarted()
        await until(lambda: ctl.rescans.task is None)  # the start is judged on the unit files now
        await settle()
        assert "low.service" in bed.systemd.reads
        assert ctl.scheduler.phase("low.service") is Phase.STARTING  # GPU 0 kept for its gate
        assert ctl.scheduler.grants() == {"low.service": frozenset({0})}

    run(test)
