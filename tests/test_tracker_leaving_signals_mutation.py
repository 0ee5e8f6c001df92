"""A waiter someone stops at its gate (Tracker.stopped_at_gate), after its down: what it
leaves, how its down is told, and the jobs that end at a gate without stopping it."""

from __future__ import annotations

from gpuslice.core.scheduler import Outcome, Phase
from gpuslice.tracker import ReachedGate, Tracker, WentDown
from tests.test_tracker import (
    JOB1,
    JOB2,
    JOB3,
    A,
    Model,
    _kept_of,
    props_of,
    waiting_at_its_gate,
)


def told_down_at_its_gate() -> tuple[Model, Tracker]:
    """A waits at its gate; `systemctl stop a`: its start ends `canceled`, the stop's JobNew
    tells it down at once; the core no longer counts it waiting."""
    model, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    tracker.job_new(JOB2, A)
    assert tracker.stopped_at_gate(A) == [WentDown(A, Outcome.STOPPED, job=JOB2)]
    model.waiters.discard(A)
    return model, tracker


def test_a_down_told_at_the_gate_is_told_again_where_the_core_counts_it_waiting() -> None:
    """Told at its gate and not waiting: its down says nothing more. Counted waiting at its
    down (the core queued it again meanwhile), its down is told: left unsaid, the core
    waited for a start that is gone."""
    model, tracker = told_down_at_its_gate()
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 2))
    tracker.job_removed(JOB2, A, "done")
    model.waiters.add(A)
    changes = tracker.unit_changed(A, props_of("inactive", "dead", 0))
    assert [type(change) for change in changes] == [WentDown]
    assert not tracker.leaving(A)


def test_the_stop_told_at_the_gate_says_nothing_of_the_units_next_start() -> None:
    """Its down done with, the stop that took it down is forgotten: a next start that runs
    nothing (a dependency failed) of a unit nobody holds tells nothing, as for a unit never
    stopped; kept, it made that start's end someone's stop of the unit."""
    _, tracker = told_down_at_its_gate()
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 2))
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []
    tracker.job_new(JOB3, A)
    tracker.job_removed(JOB3, A, "dependency")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []


def test_a_down_told_at_the_gate_is_told_once_though_the_core_counts_it_waiting() -> None:
    """Its down (`failed`) came as told at its gate: a later signal of that same down says
    nothing, also once the core counts it waiting again (a start of someone's queued:
    Controller._queued); it is told at its next down, not at a word of this one."""
    model, tracker = told_down_at_its_gate()
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 2))
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("failed", "failed", 0)) == []
    tracker.job_new(JOB3, A)
    model.waiters.add(A)
    assert tracker.unit_changed(A, props_of("failed", "failed", 0)) == []


def test_a_unit_forgotten_while_being_stopped_at_its_gate_leaves_no_record() -> None:
    """Told down at its gate (its start `canceled`, a stop announced) and forgotten by the
    core before its down: nothing of it is kept. Nor of one whose start was cancelled there
    (`systemctl cancel`: shown with no job, its gate going on)."""
    _, tracker = told_down_at_its_gate()
    assert tracker.leaving(A)
    assert tracker.forget(A) and _kept_of(tracker, A) == {}
    assert not tracker.leaving(A)
    _, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 0)) == []
    assert tracker.forget(A) and _kept_of(tracker, A) == {}


def test_a_start_that_times_out_at_its_gate_is_no_cancel_for_a_stop() -> None:
    """JobTimeoutSec= ran out on a start at its gate: the job ends `timeout` and the unit
    stays there (its ExecStartPre= goes on). A job announced next, before the unit's signal,
    is someone's start, not a stop that replaced a cancelled start: the waiter is not told
    down. Nor does the end of another job, `canceled`, make one."""
    _, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "timeout")
    tracker.job_new(JOB2, A)
    assert tracker.stopped_at_gate(A) == []
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 0)) == []
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 2)) == []
    assert not tracker.leaving(A)
    _, tracker = waiting_at_its_gate()
    tracker.job_new(JOB2, A)  # queued beside its start
    tracker.job_removed(JOB2, A, "canceled")
    tracker.job_new(JOB3, A)
    assert tracker.stopped_at_gate(A) == []
    assert not tracker.leaving(A)


def test_a_unit_told_down_at_its_gate_read_at_a_gate_again_reaches_it() -> None:
    """Its stop ran, a start was queued meanwhile (never down: a job shown throughout), and
    a read shows it at its gate again: a new start there, taken in (ReachedGate); left
    leaving, its gate was never served."""
    _, tracker = told_down_at_its_gate()
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 2)) == []
    tracker.job_new(JOB3, A)
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 3)) == []
    read = props_of("activating", "start-pre", 3)
    assert tracker.unit_changed(A, read, read=True) == [ReachedGate(A)]
    assert not tracker.leaving(A)


def test_a_gate_again_after_a_jobless_one_counts_jobs_from_its_first_sight() -> None:
    """A start cancelled at its gate (shown with no job) went on and ran; a restart of it
    (`systemctl restart`, its job shown throughout) is read at its gate, then someone's stop
    is announced and shown there: that stop came while it waited, and tells it down. Taken
    for jobless still, its gate's first sight moved to the stop's signal, the stop was no
    stop, and the waiter was left waiting while systemd stopped it."""
    model, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 0)) == []
    tracker.passed_gate(A)
    model.waiters.clear()
    model.phases[A] = Phase.RUNNING
    assert tracker.unit_changed(A, props_of("active", "running", 0)) == []
    job5, job6 = "/org/freedesktop/systemd1/job/5", "/org/freedesktop/systemd1/job/6"
    tracker.job_new(job5, A)  # `systemctl restart a`
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 5))
    model.phases.clear()
    read = props_of("activating", "start-pre", 5)
    assert tracker.unit_changed(A, read, read=True) == [ReachedGate(A)]
    model.waiters.add(A)
    tracker.job_new(job6, A)  # `systemctl stop a`
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 6)) == [
        WentDown(A, Outcome.STOPPED, job=job6)
    ]
