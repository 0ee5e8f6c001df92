"""Stops that do not happen: refused, failed, cancelled or overdue (issue 8).

A waiter must never wait forever for a victim that is not stopping, and must say why.
"""

from __future__ import annotations

import pytest

from gpuslice.core.decisions import Cause
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Log, Outcome, Phase, Scheduler, Stop
from tests.core_builders import BG, brief, spec

BG_A = spec("bga", 90, BG)
BG_B = spec("bgb", 80, BG)
VOICE = spec("voice", 10)


def preempting(gpus: int = 1) -> tuple[Scheduler, list[str]]:
    """bga runs (with two GPUs, bgb runs on the other); voice asks and bga, the least urgent,
    is being stopped for it."""
    units = (BG_A, BG_B)[:gpus]
    sched = Scheduler(range(gpus), {s.name: s for s in units})
    started = brief(sched.schedule())
    for unit in started:
        name = unit.split()[1]
        sched.request(sched.specs[name])
    first = brief(sched.request(VOICE))
    return sched, first


def test_a_refused_stop_keeps_the_victim_and_is_not_asked_again() -> None:
    sched, first = preempting()
    assert first == ["stop bga.service"]
    actions = sched.stop_failed("bga.service", "Operation refused", refused=True)
    assert sched.phase("bga.service") is Phase.RUNNING
    assert brief(actions) == []  # no second stop of the same victim
    warning = [a for a in actions if isinstance(a, Log) and a.level == "warning"]
    assert warning[0].message == (
        "bga.service (priority 90) did not stop for voice.service (priority 10): "
        "Operation refused; it keeps GPU 0; gpuslice will not try to stop it again while it runs"
    )
    assert sched.snapshot().waiting == [
        (
            "voice.service",
            10,
            "waiting: GPU 0 held by bga.service, priority 90 (refused to stop)",
        )
    ]
    # the refusal lasts only while it runs: once down, the waiter gets the GPU
    assert brief(sched.inactive("bga.service", Outcome.STOPPED)) == ["grant voice.service 0"]
    assert "bga.service" not in sched.unstoppable


def test_a_refused_victim_gives_way_to_another_on_a_second_gpu() -> None:
    sched, first = preempting(gpus=2)
    assert first == ["stop bga.service"]  # the least urgent victim first
    actions = sched.stop_failed("bga.service", "refused", refused=True)
    assert brief(actions) == ["stop bgb.service"]


def test_a_lost_stop_is_tried_again() -> None:
    """A cancelled stop job (someone started the victim again) is not a refusal."""
    sched, _ = preempting()
    actions = sched.stop_failed(
        "bga.service", "its stop job ended with result 'canceled'", refused=False
    )
    assert brief(actions) == ["stop bga.service"]
    assert "bga.service" not in sched.unstoppable


def test_stop_failed_of_a_unit_not_stopping_changes_nothing() -> None:
    sched, _ = preempting()
    sched.inactive("bga.service", Outcome.EXITED)
    assert sched.stop_failed("bga.service", "x", refused=True) == []
    assert sched.stop_failed("nobody.service", "x", refused=True) == []


def test_an_overdue_stop_is_named_in_the_waiters_reason_once() -> None:
    sched, _ = preempting()
    actions = sched.stop_overdue("bga.service", "90 s")
    assert isinstance(actions[0], Log) and actions[0].level == "warning"
    assert actions[0].message == (
        "bga.service (priority 90) has not stopped 90 s after gpuslice asked "
        "(voice.service waits for it): see its TimeoutStopSec= and ExecStop="
    )
    assert sched.snapshot().waiting[0][2] == (
        "waiting for bga.service (priority 90) to stop on GPU 0 (still running 90 s after the stop)"
    )
    assert sched.stop_overdue("bga.service", "90 s") == []


def test_a_refused_background_unit_does_not_yield_to_foreign_processes_in_a_loop() -> None:
    sched = Scheduler([Gpu(0)], {BG_A.name: BG_A})
    sched.schedule()
    sched.request(BG_A)
    foreign = [Gpu(0, foreign_pids=(4242,))]
    assert [type(a) for a in sched.set_gpus(foreign) if not isinstance(a, Log)] == [Stop]
    sched.stop_failed("bga.service", "refused", refused=True)
    assert brief(sched.set_gpus(foreign)) == []


def test_facts_taken_in_deferred_are_decided_once_waiters_before_preempted_units() -> None:
    """The rebuild after a controller restart: the holder ended while the controller was
    away and a more urgent unit waits at its gate. Deciding after the first fact would
    bring bga back onto the released GPU and then preempt it for the waiter."""
    second = spec("second", 20)
    sched, _ = preempting()
    sched.inactive("bga.service", Outcome.STOPPED)
    sched.request(VOICE)
    assert sched.phase("voice.service") is Phase.RUNNING
    with sched.deferred():
        assert brief(sched.inactive("voice.service", Outcome.EXITED)) == []
        assert brief(sched.request(second)) == []
    assert brief(sched.schedule()) == ["grant second.service 0"]
    assert sched.phase("bga.service") is None


def test_a_victim_stopped_by_someone_before_our_stop_is_held_not_brought_back() -> None:
    """A person's `systemctl stop` ended the victim before our stop reached systemd (the
    tracker's WentDown.not_ours): held as they wanted. Our own stop, or a person's start
    job that came meanwhile (STOPPED without not_ours), stays a preemption owed its comeback."""
    sched, first = preempting()
    assert first == ["stop bga.service"]
    assert brief(sched.inactive("bga.service", Outcome.STOPPED, not_ours=True)) == [
        "grant voice.service 0"
    ]
    assert "bga.service" in sched.held and "bga.service" not in sched.preempted
    sched, _ = preempting()
    sched.inactive("bga.service", Outcome.STOPPED)
    assert "bga.service" in sched.preempted and "bga.service" not in sched.held
    sched, _ = preempting()  # down before ours, by itself: its work is done
    sched.inactive("bga.service", Outcome.EXITED, by_itself=True, not_ours=True)
    assert "bga.service" not in sched.preempted and "bga.service" not in sched.held


def test_a_stop_refused_for_the_start_it_would_cancel_holds_only_while_that_start_waits() -> None:
    """Systemd refuses the stop of bga because it would cancel a job of another unit's:
    voice's own start, when voice `Requires=` bga (Systemd.stop_unit). Bga keeps its GPU
    while voice waits, and then no longer: kept for as long as bga ran, it was never
    preempted again for anyone, though no start of anyone's would be cancelled by then."""
    sched, first = preempting()
    assert first == ["stop bga.service"]
    destructive = "Transaction for bga.service/stop is destructive"
    actions = sched.stop_failed("bga.service", destructive, refused=True, while_waits=True)
    assert brief(actions) == []
    warning = [a for a in actions if isinstance(a, Log) and a.level == "warning"]
    assert warning[0].message == (
        "bga.service (priority 90) did not stop for voice.service (priority 10): "
        f"{destructive}; it keeps GPU 0; gpuslice will not try to stop it again while "
        "voice.service waits"
    )
    assert warning[0].decision is not None and warning[0].decision.cause is Cause.NEEDED
    assert brief(sched.request(spec("other", 20))) == []  # voice still waits: refused too
    assert brief(sched.inactive("voice.service", Outcome.STOPPED)) == ["stop bga.service"]
    assert "bga.service" not in sched.unstoppable


def test_a_stop_is_for_its_waiter_only_while_that_waiter_waits() -> None:
    """Scheduler.stopping_for: the waiter whose needs decide a stop refused for the victim's
    own job (Calls._over_own_job); nobody once that waiter's start went, or the victim no
    longer stops."""
    sched, _ = preempting()
    assert sched.stopping_for("bga.service") == "voice.service"
    assert sched.stopping_for("voice.service") is None  # a waiter, not stopped
    sched.waiters.pop("voice.service")
    assert sched.stopping_for("bga.service") is None
    sched, _ = preempting()
    sched.stop_failed("bga.service", "refused", refused=True)
    assert sched.stopping_for("bga.service") is None


def test_a_stop_refused_for_jobs_under_way_is_asked_again_once_one_ends() -> None:
    """Refused only for jobs under way (bga's own start, d's start queued behind it: d needs
    it, voice does not), the refusal ends with the first of them (Scheduler.jobs_ended):
    voice's preemption is decided again, not left to wait for bga's whole run. Told again,
    or once bga is asked again, nothing more; refused again, it holds again."""
    sched, _ = preempting()
    actions = sched.stop_failed(
        "bga.service", "destructive", refused=True, while_waits=True, jobs=("d.service",)
    )
    assert brief(actions) == []
    said = next(a for a in actions if isinstance(a, Log))
    assert said.decision is not None and said.decision.cause is Cause.NEEDED
    assert said.message.endswith(
        "it keeps GPU 0; gpuslice will try to stop it again once a job of d.service ends"
    )
    assert brief(sched.jobs_ended("bga.service")) == ["stop bga.service"]
    assert sched.jobs_ended("bga.service") == []  # told twice: one stop
    sched.stop_failed("bga.service", "destructive", refused=True, while_waits=True)
    assert sched.jobs_ended("bga.service") == []  # refused for voice's own start: holds
    assert "bga.service" in sched.unstoppable


@pytest.mark.parametrize("end", ["down", "remains", "restarts"])
def test_a_stop_refused_for_jobs_is_held_no_more_once_its_unit_is_down(end: str) -> None:
    """Down, finished but kept active (`exited`), or down and kept for its Restart= once
    voice waits no more: the refusal held for d's jobs is over with the run it was refused
    for, and the controller, told of d's job's end later, has none left to end (it says
    none ended: Calls.job_ended)."""
    sched, _ = preempting()
    sched.stop_failed("bga.service", "destructive", refused=True, jobs=("d.service",))
    assert sched.held_for_jobs == {"bga.service": ("d.service",)}
    if end == "down":
        sched.inactive("bga.service", Outcome.EXITED)
    elif end == "remains":
        sched.exited("bga.service")
    else:
        sched.inactive("voice.service", Outcome.STOPPED)
        sched.inactive("bga.service", Outcome.FAILED, restarting=True)
        assert sched.restart_keeps().keys() == {"bga.service"}
    assert sched.held_for_jobs == {} and sched.jobs_ended("bga.service") == []


def test_a_stop_refused_for_its_own_start_alone_is_asked_again_once_that_start_ends() -> None:
    """Refused for bga's own start job only (no waiter's start needs it: `while_waits` not
    given), the refusal ends with that job (Scheduler.jobs_ended): voice's preemption is
    decided again."""
    sched, _ = preempting()
    sched.stop_failed("bga.service", "destructive", refused=True, jobs=("bga.service",))
    assert brief(sched.jobs_ended("bga.service")) == ["stop bga.service"]


def test_a_stop_that_fails_after_a_refusal_held_for_jobs_is_no_refusal_for_a_start() -> None:
    """The refusal held for d's jobs over (Scheduler.jobs_ended), bga is stopped again for
    voice; that stop fails (not refused): said as a failure, not as a stop refused for a
    start that needs bga, of which nothing is left."""
    sched, _ = preempting()
    sched.stop_failed(
        "bga.service", "destructive", refused=True, while_waits=True, jobs=("d.service",)
    )
    assert brief(sched.jobs_ended("bga.service")) == ["stop bga.service"]
    actions = sched.stop_failed("bga.service", "timed out", refused=False)
    said = next(a for a in actions if isinstance(a, Log))
    assert said.decision is not None and said.decision.cause is None


def test_a_stop_refused_for_jobs_is_held_no_more_once_its_waiter_waits_no_more() -> None:
    """Refused for voice's start and d's jobs, the refusal ends when voice waits no more:
    the controller, told of d's job's end later, has no refusal left to end (it says none
    ended: Calls.job_ended)."""
    sched, _ = preempting()
    sched.stop_failed(
        "bga.service", "destructive", refused=True, while_waits=True, jobs=("d.service",)
    )
    sched.inactive("voice.service", Outcome.STOPPED)
    assert "bga.service" not in sched.unstoppable
    assert sched.held_for_jobs == {} and sched.jobs_ended("bga.service") == []
