"""Promises of README.md's "The rules in short" and "Preemption that loses no work" that no
fast core test held on its own (tests/test_core_properties.py's random histories found their
breakage, minutes and thousands of steps later): one test per promise, on the pure core.
"""

from __future__ import annotations

import pytest

from gpuslice.core.scheduler import Outcome
from tests.core_builders import BG, GIB, Sim, brief, sized, spec


@pytest.mark.parametrize("outcome", [Outcome.EXITED, Outcome.FAILED], ids=["finished", "failed"])
def test_a_background_unit_that_ended_stays_out_across_a_controller_restart(
    outcome: Outcome,
) -> None:
    """README: "A background unit that ends successfully is finished until it is started again (by
    hand, a timer, or the next boot). A unit that fails is left to its own Restart= policy." A
    controller restart is none of those: the state it saves keeps how the unit ended, and the new
    controller's refill does not start it (it did, on the GPU freed, when the saved state forgot
    it). The next boot does."""
    sim = Sim(1, [spec("job", 50, BG)])
    assert brief(sim.boot()) == ["start job.service"]
    assert brief(sim.settle()) == ["grant job.service 0"]
    assert brief(sim.exit("job.service", outcome)) == []
    sim.restart_not_seen("job.service")  # Restart=no: the wait for a restart ends with none
    assert brief(sim.restart()) == []
    ended = sim.sched.snapshot()
    assert (ended.finished, ended.failed) == (
        (["job.service"], []) if outcome is Outcome.EXITED else ([], ["job.service"])
    )
    assert brief(sim.new_boot()) == ["start job.service"]


def test_a_unit_stopped_by_hand_stays_held_across_a_controller_restart_and_a_reboot() -> None:
    """README: "A unit you stop by hand (systemctl stop) is held: gpuslice will not start it again
    until someone starts it, across controller restarts and reboots." Beside it a finished unit,
    which the reboot does start again."""
    sim = Sim(2, [spec("held", 50, BG), spec("done", 60, BG)])
    assert brief(sim.boot()) == ["start held.service", "start done.service"]
    sim.settle()
    assert brief(sim.stop("held.service")) == []
    assert brief(sim.exit("done.service")) == []
    assert brief(sim.restart()) == []
    assert brief(sim.new_boot()) == ["start done.service"]  # not held.service
    assert brief(sim.settle()) == ["grant done.service 0"]
    assert sim.sched.snapshot().held == ["held.service"]
    assert brief(sim.restart()) == []
    assert brief(sim.start("held.service")) == ["grant held.service 1"]  # someone started it


@pytest.mark.parametrize("ladder", ["suspend stop", "freeze stop", "freeze suspend stop"])
def test_a_background_unit_yields_to_a_foreign_process_by_a_stop_whatever_its_ladder(
    ladder: str,
) -> None:
    """README: "A background unit that yields to a process gpuslice does not manage
    (foreign_processes: yield) is always stopped: that process's memory is unknown in advance, and
    it may stay for hours." Suspended, its VRAM would wait in host memory for as long; frozen, it
    would keep its VRAM beside that process. It comes back once the process has left."""
    sim = Sim([sized(0)], [spec("bg", 90, BG, mem_gib=10, preempt=ladder)])
    sim.boot()
    assert brief(sim.settle()) == ["grant bg.service 0"]
    foreign = sized(0, foreign=2 * GIB, foreign_pids=(4242,))
    assert brief(sim.sample([foreign])) == ["stop bg.service"]
    assert brief(sim.settle()) == []
    assert sim.sched.snapshot().suspended == []
    assert brief(sim.sample([sized(0)])) == ["start bg.service"]
