"""Scheduler.pause_refill: while the GPUs are a guess (NVML not ready yet), background units
are not started, neither by refill nor by requeue nor through their own gate; on-demand units
are served as usual; clearing the switch starts the background units at once."""

from __future__ import annotations

from gpuslice.core.model import Gpu, UnitKind, UnitSpec
from gpuslice.core.scheduler import Grant, Log, Outcome, Scheduler, Start

REASON = "NVML is not ready yet"
BG = UnitSpec("bg.service", 90, UnitKind.BACKGROUND)
BG2 = UnitSpec("bg2.service", 80, UnitKind.BACKGROUND)
URGENT = UnitSpec("urgent.service", 10)


def paused(*specs: UnitSpec, gpus: int = 2) -> Scheduler:
    scheduler = Scheduler([Gpu(i) for i in range(gpus)], {s.name: s for s in specs})
    scheduler.pause_refill(REASON)
    return scheduler


def test_not_paused_by_default() -> None:
    scheduler = Scheduler([Gpu(0)], {BG.name: BG})
    assert scheduler.refill_paused == ""
    assert [type(a) for a in scheduler.schedule()] == [Start]


def test_paused_refill_starts_nothing_and_on_demand_still_runs() -> None:
    scheduler = paused(BG, URGENT)
    assert scheduler.schedule() == []
    assert scheduler.request(URGENT) == [
        Grant("urgent.service", (0,), "starting urgent.service (priority 10) on GPU 0")
    ]
    assert scheduler.holders.keys() == {"urgent.service"}


def test_a_background_unit_started_by_hand_waits_with_the_reason() -> None:
    """E.g. WantedBy=multi-user.target: systemd starts it at boot; its gate waits."""
    scheduler = paused(BG)
    assert scheduler.request(BG) == [Log(f"bg.service waiting: {REASON}")]
    assert scheduler.snapshot().waiting == [("bg.service", 90, f"waiting: {REASON}")]
    assert scheduler.schedule() == []  # the reason is logged once


def test_preempted_background_units_are_not_requeued_while_paused() -> None:
    scheduler = paused(BG, URGENT, gpus=1)
    scheduler.preempted = {BG.name: 1, URGENT.name: 2}
    actions = scheduler.schedule()
    assert [(type(a), a.unit) for a in actions if isinstance(a, Start)] == [
        (Start, "urgent.service")
    ]
    assert scheduler.preempted == {BG.name: 1}


def test_unpausing_starts_them_on_the_gpus_now_known() -> None:
    scheduler = paused(BG, BG2)
    scheduler.request(BG)
    scheduler.pause_refill("")
    actions = scheduler.set_gpus([Gpu(0, "GPU-a", total=24 << 30), Gpu(1, "GPU-b", total=24 << 30)])
    assert actions == [
        Grant("bg.service", (0,), "starting bg.service (priority 90) on GPU 0"),
        Start("bg2.service", "starting background bg2.service (priority 80) on free GPU 1"),
    ]


def test_holders_keep_their_gpus_across_the_pause() -> None:
    scheduler = paused(BG, URGENT)
    scheduler.request(URGENT)
    assert scheduler.inactive(URGENT.name, Outcome.EXITED) == [
        Log("urgent.service finished: released GPU 0")
    ]
    assert scheduler.holders == {}
