"""The controller killed at any instant (kill -9, OOM) and started again.

A restart here is a new Bed built from the state file the killed controller left and from
the units as systemd would show them then. The controller answers a gate before it saves
the grant (gpuslice/controller.py, `execute`: the waiting unit first), so a kill between
the two leaves a state file that has not caught up with the unit's run; everything else it
sends (StopUnit, StartUnit, FreezeUnit, cuda-checkpoint) must leave after the state that
names it is saved.
"""

from __future__ import annotations

from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from gpuslice import envfiles
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Phase, SavedState
from gpuslice.state import StateStore
from tests.test_controller import Bed, StubNvml, at_gate, bed_config, refill_bed, run, settle, state


@pytest.mark.parametrize("started", [["bg.service"], []])
def test_a_start_granted_just_before_the_kill_is_taken_for_running_after_a_restart(
    tmp_path: Path, started: list[str]
) -> None:
    """bg.service's place was kept (a refill of ours, or someone's start job seen early) and
    saved as starting; its gate was granted and the controller killed before the grant was
    saved. After the restart systemd shows bg.service running: it is running on GPU 0, so
    urgent.service, at its gate, preempts it. Kept as starting, bg.service was moved back to
    waiting like a start not yet answered, and urgent.service was granted GPU 0 beside the
    job that runs there (two jobs on one GPU; bg.service then waited for ever for a gate
    that had passed)."""
    bed = Bed(
        tmp_path,
        {"bg.service": "Priority=90\nType=background\n", "urgent.service": "Priority=10\n"},
        [
            state("bg.service", "active", "running"),
            state("urgent.service", "activating", "start-pre", 7, "start"),
        ],
        SavedState(holders={"bg.service": ((0,), "starting", 1, "")}, seq=1, started=started),
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert bed.service.granted == []
        assert bed.systemd.calls == [("subscribe", ""), ("stop", "bg.service")]
        assert ctl.scheduler.phase("bg.service") is Phase.STOPPING
        assert ctl.scheduler.is_waiting("urgent.service")
        saved, _ = StateStore(Path(bed.config.state_dir)).load()
        assert saved.started == []  # not a start of ours any more: it ran

    run(test)


def test_a_requeue_granted_just_before_the_kill_keeps_the_gpus_it_was_told(
    tmp_path: Path,
) -> None:
    """A requeue of a.service that had to preempt (kept no GPU: saved starting on none)
    stopped z.service on GPU 1 and was granted GPU 1 once z.service was down; the controller
    was killed before the grant was saved. After the restart a.service holds GPU 1, the GPU
    its environment file names, once z.service's end has released it (taken in before it,
    GPU 1 was still z.service's: a.service was booked on GPU 0, and GPU 1 granted again)."""
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n", "z.service": "Priority=90\n"},
        [state("a.service", "active", "running"), state("z.service", "inactive", "dead")],
        SavedState(
            holders={
                "a.service": ((), "starting", 2, ""),
                "z.service": ((1,), "stopping", 1, "a.service"),
            },
            seq=2,
            started=["a.service"],
        ),
        config=bed_config(tmp_path, gpus=2),
    )
    envfiles.write(bed.config.runtime_dir, "a.service", [Gpu(1)])  # its grant, not saved

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert ctl.scheduler.phase("a.service") is Phase.RUNNING
        # z.service, preempted, comes back on the GPU that is free
        assert ctl.scheduler.grants() == {"a.service": frozenset({1}), "z.service": frozenset({0})}
        assert bed.systemd.calls == [("subscribe", ""), ("start", "z.service")]

    run(test)


def test_a_freeze_beside_a_kept_place_leaves_after_the_state_that_names_it_is_saved(
    tmp_path: Path,
) -> None:
    """urgent.service's start was seen first without its InvocationID (a place kept for it
    on GPU 0, beside low.service), then its gate asks: in that turn it is granted the place
    kept and low.service is frozen beside it. The ladder's task sends FreezeUnit in its
    first step, which ran before the turn's deferred save: a controller killed then left
    low.service saved as running, not frozen nor owed a thaw, and the next controller left
    it frozen for good (as if an admin had frozen it)."""
    bed = Bed(
        tmp_path,
        {
            "low.service": "Priority=90\nDevices=0\nMemory=4G\nPreempt=freeze stop\n",
            "urgent.service": "Priority=10\nDevices=0\nMemory=4G\n",
        },
        [state("low.service", "active", "running")],
        SavedState(holders={"low.service": ((0,), "running", 1, "")}, seq=1),
        nvml=StubNvml(),
    )
    at_freeze: list[str] = []

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        freeze = ctl.ladder.freeze

        def freezing(unit: str, thaw_owed: bool = False) -> Coroutine[Any, Any, None]:
            saved, _ = StateStore(Path(bed.config.state_dir)).load()
            at_freeze.append(saved.holders[unit][1])
            return freeze(unit, thaw_owed)

        ctl.ladder.freeze = freezing  # type: ignore[method-assign]
        ctl.on_unit_changed("urgent.service", at_gate(invocation=None))
        await settle()
        assert ctl.scheduler.phase("urgent.service") is Phase.STARTING
        ctl.on_unit_changed("urgent.service", at_gate())
        await settle()
        assert ctl.scheduler.phase("urgent.service") is Phase.RUNNING
        assert at_freeze == ["frozen"]

    run(test)


def test_a_grant_of_a_kept_place_is_saved_in_the_turn_that_answers_its_gate(
    tmp_path: Path,
) -> None:
    """bg.service, refilled by gpuslice (saved as a start of ours, its place kept), reaches
    its gate and is granted through its pipe. The grant was saved only by the pass due
    later in the loop: a controller killed in between left bg.service saved as a start of
    ours, and if the job ended while no controller ran, the next one took it for a
    StartUnit never sent and ran the finished job again (`start-lost`)."""
    bed = refill_bed(tmp_path)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert ("start", "bg.service") in bed.systemd.calls
        saved, _ = StateStore(Path(bed.config.state_dir)).load()
        assert saved.started == ["bg.service"]
        ctl.on_unit_changed("bg.service", at_gate())  # no turn of the loop after it
        assert ctl.scheduler.phase("bg.service") is Phase.RUNNING
        saved, _ = StateStore(Path(bed.config.state_dir)).load()
        assert saved.started == []
        assert saved.holders["bg.service"][1] == "running"

    run(test)


def test_a_kept_place_granted_elsewhere_just_before_the_kill_is_booked_where_it_runs(
    tmp_path: Path,
) -> None:
    """a.service's place was kept on GPU 0 (saved starting there); when its gate asked the
    place was no longer its (moved back to waiting), and a pass granted it GPU 1, its env
    file written and its gate answered; the controller was killed before that grant was
    saved. After the restart a.service runs on GPU 1, as its env file says: booked on GPU 0,
    the place saved, GPU 1 looked free and was granted again (two jobs on one GPU)."""
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n", "b.service": "Priority=50\n"},
        [
            state("a.service", "active", "running"),
            state("b.service", "activating", "start-pre", 7, "start"),
        ],
        SavedState(holders={"a.service": ((0,), "starting", 1, "")}, seq=1),
        config=bed_config(tmp_path, gpus=2),
    )
    envfiles.write(bed.config.runtime_dir, "a.service", [Gpu(1)])  # its grant, not saved

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert ctl.scheduler.grants() == {"a.service": frozenset({1}), "b.service": frozenset({0})}

    run(test)
