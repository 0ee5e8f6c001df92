"""A refill is no comeback: a refill's start that does not happen is owed nothing but
refill's, whatever the unit's kind by then (`Scheduler.refills`). And a background unit
whose main process fails on the shutdown's SIGTERM (143) is not a failed job: a cancelled
shutdown refills it as one that exited 0. A refill or comeback whose start waits in
systemd's queue for a GPU unit's start keeps no GPUs for its gate (`start_waits`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Outcome, Phase, SavedState, Scheduler
from tests.core_builders import BG, brief, spec, words

BG_UNIT = spec("bg", 90, BG)
ON_DEMAND = spec("bg", 90)  # the same unit, its `Type=background` gone
EMBED = spec("embed@a", 90, BG)


def refilled_then_on_demand() -> Scheduler:
    """bg.service is refilled; a daemon-reload turns it on-demand before its gate asks."""
    s = Scheduler([Gpu(0)], {BG_UNIT.name: BG_UNIT})
    assert brief(s.schedule()) == ["start bg.service"]
    assert brief(s.set_specs({BG_UNIT.name: ON_DEMAND})) == []
    return s


def refilled_at_a_cancel() -> Scheduler:
    """embed@a.service, stopped by the shutdown, is refilled by its cancel."""
    s = Scheduler([Gpu(0)], {})
    s.request(EMBED)
    s.set_shutting_down(True)
    s.inactive(EMBED.name, Outcome.SHUTDOWN)
    assert brief(s.set_shutting_down(False)) == [f"start {EMBED.name}"]
    return s


@pytest.mark.parametrize("outcome", [Outcome.SHUTDOWN, Outcome.FAILED])
def test_a_refill_cut_short_by_a_shutdown_once_on_demand_is_no_comeback(
    outcome: Outcome,
) -> None:
    """Told by its kind, the refill's start was taken for a comeback: preempted, and
    started again once the shutdown was cancelled, an on-demand unit gpuslice no longer
    starts. Its gate killed (143) is no failure either."""
    s = refilled_then_on_demand()
    s.set_shutting_down(True)
    s.inactive(BG_UNIT.name, outcome)
    assert (s.preempted, s.failed) == ({}, set())
    assert brief(s.set_shutting_down(False)) == []


def test_a_refill_that_did_not_reach_systemd_once_on_demand_is_no_comeback() -> None:
    s = refilled_then_on_demand()
    s.start_failed(BG_UNIT.name, "systemd is re-executing")
    assert s.preempted == {}
    assert brief(s.retry_start(BG_UNIT.name)) == []


@pytest.mark.parametrize("restarted", [False, True])
def test_a_cancels_refill_of_an_instance_turned_on_demand_is_forgotten(restarted: bool) -> None:
    """embed@a.service, stopped by the shutdown, is refilled by its cancel; its template
    turns on-demand before the gate asks, and a second shutdown cuts the start short (its
    gate killed: 143). No comeback: an on-demand instance owed nothing is forgotten. The
    same where the controller restarted in between (the refill saved as one)."""
    s = refilled_at_a_cancel()
    on_demand = spec("embed@a", 90)
    if restarted:
        saved = s.save()
        assert saved.refills == [EMBED.name]
        s = Scheduler([Gpu(0)], {})
        s.set_specs({EMBED.name: on_demand})
        s.load(saved)
    else:
        s.set_specs({EMBED.name: on_demand})
    s.set_shutting_down(True)
    s.inactive(EMBED.name, Outcome.FAILED)
    assert (s.preempted, s.failed, s.stopped_by_shutdown) == ({}, set(), set())
    assert s.forget_instance(EMBED.name)
    assert brief(s.set_shutting_down(False)) == []


def test_a_refill_saved_is_no_comeback_after_a_restart_or_the_reboot() -> None:
    """Saved with its start (`refills`), a refill of a unit turned on-demand while no
    controller ran is owed nothing: its start cut short, or its boot gone."""
    s = Scheduler([Gpu(0)], {BG_UNIT.name: BG_UNIT})
    s.schedule()
    saved = s.save()
    assert (saved.started, saved.refills) == ([BG_UNIT.name], [BG_UNIT.name])
    fresh = Scheduler([Gpu(0)], {BG_UNIT.name: ON_DEMAND})
    fresh.load(saved)
    fresh.start_failed(BG_UNIT.name, "systemd is re-executing")
    assert fresh.preempted == {}
    rebooted = Scheduler([Gpu(0)], {BG_UNIT.name: ON_DEMAND})
    assert rebooted.ended_with_boot(saved).preempted == {}


def test_a_comeback_of_a_unit_turned_on_demand_is_still_owed() -> None:
    """Only a refill is told apart: a preempted background unit's comeback (once refilled,
    then preempted) cut short after its unit turned on-demand is still owed."""
    s = Scheduler([Gpu(0)], {BG_UNIT.name: BG_UNIT})
    assert brief(s.schedule()) == ["start bg.service"]
    assert brief(s.request(BG_UNIT)) == ["grant bg.service 0"]
    urgent = spec("urgent", 10)
    assert brief(s.request(urgent)) == ["stop bg.service"]
    s.inactive(BG_UNIT.name, Outcome.STOPPED)
    assert brief(s.inactive(urgent.name, Outcome.EXITED)) == ["start bg.service"]
    s.set_specs({BG_UNIT.name: ON_DEMAND})
    assert s.save().refills == []
    s.set_shutting_down(True)
    s.inactive(BG_UNIT.name, Outcome.FAILED)
    assert list(s.preempted) == [BG_UNIT.name]
    assert brief(s.set_shutting_down(False)) == ["start bg.service"]


@pytest.mark.parametrize("name", ["bg", "embed@a"])
def test_a_background_unit_failing_on_the_shutdowns_sigterm_is_refilled(name: str) -> None:
    """Its main process exited 143 on the shutdown's SIGTERM, which systemd records as
    failed: recorded failed, the cancelled shutdown left it down for good (an instance
    forgotten), where one that exited 0 is refilled."""
    unit = spec(name, 90, BG)
    s = Scheduler([Gpu(0)], {})
    assert brief(s.request(unit)) == [f"grant {unit.name} 0"]
    s.set_shutting_down(True)
    s.inactive(unit.name, Outcome.FAILED)
    assert s.failed == set()
    assert not s.forget_instance(unit.name)
    assert brief(s.set_shutting_down(False)) == [f"start {unit.name}"]


@pytest.mark.parametrize("name", ["bg", "embed@a"])
def test_a_background_unit_that_failed_by_itself_in_a_shutdown_is_failed(name: str) -> None:
    """No stop job took it down: its own failure, not refilled after the cancel."""
    unit = spec(name, 90, BG)
    s = Scheduler([Gpu(0)], {})
    s.request(unit)
    s.set_shutting_down(True)
    s.inactive(unit.name, Outcome.FAILED, by_itself=True)
    assert s.failed == {unit.name}
    assert brief(s.set_shutting_down(False)) == []


def test_a_refill_whose_gate_the_shutdown_killed_is_refilled() -> None:
    """A plain background unit's refill, its gate killed by the shutdown (143) before it
    ran: no failed job, refilled when the shutdown is cancelled."""
    s = Scheduler([Gpu(0)], {BG_UNIT.name: BG_UNIT})
    assert brief(s.schedule()) == ["start bg.service"]
    s.set_shutting_down(True)
    s.inactive(BG_UNIT.name, Outcome.FAILED)
    assert s.failed == set()
    assert brief(s.set_shutting_down(False)) == ["start bg.service"]


def test_a_cancels_refill_saved_by_a_controller_before_refills_is_still_one() -> None:
    """A file without `refills` (an older controller's): a start of ours of an instance the
    shutdown stopped was its cancel's refill, as that controller took it."""
    s = refilled_at_a_cancel()
    older = replace(s.save(), refills=[])
    fresh = Scheduler([Gpu(0)], {EMBED.name: EMBED})
    fresh.load(older)
    fresh.start_failed(EMBED.name, "systemd is re-executing")
    assert fresh.preempted == {}
    assert fresh.stopped_by_shutdown == {EMBED.name}
    assert fresh.ended_with_boot(older).preempted == {}


def test_a_comeback_whose_gate_the_shutdown_killed_told_after_its_cancel_is_still_owed() -> None:
    """The shutdown killed a comeback's gate (143), its down told only after the shutdown's
    cancel (Tracker: `WentDown.in_shutdown`). Recorded failed, the preempted unit's work was
    lost: it is started again, as where the down is told before the cancel."""
    job = spec("job", 50)
    urgent = spec("urgent", 10)
    s = Scheduler([Gpu(0)], {})
    s.request(job)
    assert brief(s.request(urgent)) == ["stop job.service"]
    s.inactive(job.name, Outcome.STOPPED)
    assert brief(s.inactive(urgent.name, Outcome.EXITED)) == ["start job.service"]
    s.set_shutting_down(True)
    assert brief(s.set_shutting_down(False)) == []  # its start under way
    assert brief(s.inactive(job.name, Outcome.FAILED, in_shutdown=True)) == ["start job.service"]
    assert s.failed == set()


def test_a_refill_whose_start_waits_for_a_gpu_units_start_keeps_no_gpu_for_its_gate() -> None:
    """c.service (background, 40) Requires= and After= b.service (50), one GPU: c's refill
    keeps GPU 0, and b's gate, which c's start waits for, waits for GPU 0: neither runs.
    Once c's start is known to wait for b's, c keeps nothing (still starting, its gate asks
    as any start's) and b is granted GPU 0."""
    c, b = spec("c", 40, BG), spec("b", 50)
    s = Scheduler([Gpu(0)], {c.name: c, b.name: b})
    assert brief(s.schedule()) == ["start c.service"]
    assert brief(s.request(b)) == []
    assert s.keeps_place(c.name)
    done = s.start_waits(c.name)
    assert brief(done) == ["grant b.service 0"]
    assert words(done)[0] == (
        "c.service waits in systemd's queue for the start of a GPU unit: GPU 0 no longer "
        "kept for it, its gate asks for GPUs as any start's"
    )
    assert (s.phase(c.name), s.grants()[c.name]) == (Phase.STARTING, frozenset())
    assert not s.keeps_place(c.name)
    assert s.start_waits(c.name) == []
    assert s.start_waits(b.name) == []  # granted: kept for nobody
    assert brief(s.schedule()) == []  # not started again


def test_a_comeback_started_to_preempt_whose_start_waits_keeps_no_room_either() -> None:
    """job.service (50), preempted, comes back where low.service (90) runs: its start keeps
    GPU 0 from units less urgent than it until its gate asks, which preempts low
    (`_comebacks_room`). Waiting for a GPU unit's start (b, 60), it keeps it no more: b, less
    urgent than job, preempts low itself."""
    job, low, b = spec("job", 50), spec("low", 90), spec("b", 60)
    s = Scheduler([Gpu(0)], {n.name: n for n in (job, low, b)})
    saved = SavedState(holders={low.name: ((0,), "running", 1, "")}, preempted={job.name: 1})
    s.load(saved)
    assert brief(s.schedule()) == ["start job.service"]
    assert s.keeps_place(job.name)
    assert brief(s.request(b)) == []  # GPU 0 kept for job's comeback
    done = s.start_waits(job.name)
    assert brief(done) == ["stop low.service"]
    assert words(done)[0].startswith(  # the GPU its comeback was placed on, though it holds none
        "job.service waits in systemd's queue for the start of a GPU unit: GPU 0 no longer "
    )
    assert not s.keeps_place(job.name)


def test_the_starts_kept_in_the_way_of_a_gate_that_waits() -> None:
    """b's gate asked and waits: c's refill keeps GPU 0, which b may use (c's job is walked
    again by the controller), and x runs on GPU 1. Pinned to GPU 1, p waits on x alone. A
    start whose gate has not asked, or one granted, waits on nothing."""
    c, b, x = spec("c", 40, BG), spec("b", 50), spec("x", 10, devices=("1",))
    pinned = spec("p", 50, devices=("1",))
    s = Scheduler([Gpu(0), Gpu(1)], {n.name: n for n in (c, b, x, pinned)})
    assert brief(s.request(x)) == ["grant x.service 1", "start c.service"]
    assert s.kept_in_the_way(b.name) == []  # not known yet
    assert brief(s.announce(b)) == []  # its start job alone known: it has not asked
    assert not s.asked(b.name)
    assert s.kept_in_the_way(b.name) == []
    assert brief(s.request(b)) == []
    assert s.asked(b.name)
    assert s.kept_in_the_way(b.name) == [c.name]
    assert brief(s.request(pinned)) == []
    assert s.kept_in_the_way(pinned.name) == []
    assert s.kept_in_the_way(x.name) == []  # granted


def test_a_comebacks_room_is_in_the_way_of_a_gate_that_waits_on_it() -> None:
    """job.service's comeback keeps GPU 0 from units less urgent than it (`_comebacks_room`):
    b's gate waits on it."""
    job, low, b = spec("job", 50), spec("low", 90), spec("b", 60)
    s = Scheduler([Gpu(0)], {n.name: n for n in (job, low, b)})
    saved = SavedState(holders={low.name: ((0,), "running", 1, "")}, preempted={job.name: 1})
    s.load(saved)
    assert brief(s.schedule()) == ["start job.service"]
    assert brief(s.request(b)) == []
    assert s.kept_in_the_way(b.name) == [job.name]


def test_a_start_that_waits_frees_its_gpu_for_status_before_the_next_pass() -> None:
    """Told inside a batch of events (the controller decides once after it), a start that
    waits in systemd's queue holds nothing from then on, also for a status asked before the
    batch's pass: b waits for GPU 0, which c no longer keeps."""
    c, b = spec("c", 40, BG), spec("b", 50)
    s = Scheduler([Gpu(0)], {c.name: c, b.name: b})
    assert brief(s.schedule()) == ["start c.service"]
    assert brief(s.request(b)) == []
    assert "c.service" in s.snapshot().waiting[0][2]  # held by c
    with s.deferred():
        assert brief(s.start_waits(c.name)) == []
        assert "c.service" not in s.snapshot().waiting[0][2]


def test_a_start_kept_on_a_gpu_a_waiter_shuns_is_not_in_its_way() -> None:
    """A background waiter (b) never runs beside a foreign process: a start kept on the only
    GPU, where one runs, keeps nothing b could use (the controller walks nothing for b)."""
    c, b = spec("c", 40), spec("b", 50, BG)
    s = Scheduler([Gpu(0)], {c.name: c, b.name: b})
    assert brief(s.announce(c)) == []
    assert s.keeps_place(c.name)
    assert brief(s.request(b)) == []
    assert s.kept_in_the_way(b.name) == [c.name]  # GPU 0 is b's but for c's place
    assert brief(s.set_gpus([Gpu(0, foreign_pids=(4242,))])) == []
    assert s.keeps_place(c.name) and s.asked(b.name)
    assert s.kept_in_the_way(b.name) == []
