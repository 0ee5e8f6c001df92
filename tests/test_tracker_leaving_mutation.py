"""A waiter someone stops at its gate (Tracker.stopped_at_gate, leaving_read,
job_number): the sequences the tracker tests left open, each as systemd sends them."""

from __future__ import annotations

from gpuslice.core.scheduler import Outcome, Phase
from gpuslice.tracker import JOB_PREFIX, ReachedGate, UnitState, WentDown, job_number
from tests.test_tracker import JOB1, JOB2, JOB3, JOB4, A, Model, props_of, waiting_at_its_gate


def test_a_job_number_is_read_only_from_a_jobs_path() -> None:
    """Any other string (a path of another object, "/" for none, hostile text) is 0: it
    must never pass for a job, nor raise."""
    assert job_number(JOB2) == 2
    assert job_number(f"{JOB_PREFIX}123") == 123
    for path in ("/", "", "7", "/org/freedesktop/systemd1/unit/7", f"{JOB_PREFIX}x", JOB_PREFIX):
        assert job_number(path) == 0, path
    assert job_number(f"{JOB_PREFIX}\u0661") == 0  # a digit, not an ASCII one


def test_a_waiter_told_down_at_its_gate_is_told_so_once_and_names_the_stop() -> None:
    """Its down names the stop that takes it (Controller._stop_before reads it), and is told
    once, also when asked again before the core took it in."""
    _, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    tracker.job_new(JOB2, A)
    [down] = tracker.stopped_at_gate(A)
    assert down == WentDown(A, Outcome.STOPPED)
    assert down.job == JOB2
    assert tracker.stopped_at_gate(A) == []  # still a waiter for the core: told already


def test_a_late_signal_of_its_cancelled_start_keeps_it_leaving() -> None:
    """The signal that still shows the start its stop replaced, heard after the stop's
    JobNew, is no start that replaced the stop: it does not wait again."""
    _, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    tracker.job_new(JOB2, A)
    assert tracker.stopped_at_gate(A) == [WentDown(A, Outcome.STOPPED)]
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 1)) == []
    assert tracker.leaving(A)


def test_a_start_after_a_cancel_at_the_gate_is_stopped_there_as_any() -> None:
    """`systemctl cancel a`, `systemctl start a`, then `systemctl stop a`: the stop,
    announced after the second start was shown at the gate, tells the waiter down."""
    _, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 0)) == []
    tracker.job_new(JOB2, A)
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 2)) == []
    tracker.job_removed(JOB2, A, "canceled")
    tracker.job_new(JOB3, A)
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 3)) == [
        WentDown(A, Outcome.STOPPED)
    ]
    assert tracker.leaving(A)


def test_a_start_whose_job_new_was_lost_after_a_cancel_is_no_stop() -> None:
    """After `systemctl cancel a`, a new start shown at the gate whose JobNew the bus
    dropped is announced by that signal: a start, not a stop of it."""
    _, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 0)) == []
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 2)) == []
    assert not tracker.leaving(A)


def test_a_waiter_whose_gate_is_being_killed_is_told_down_at_its_down() -> None:
    """The stop's signals came before its JobNew: the unit has left its gate (its gate is
    being killed), so the JobNew tells nothing; its down does."""
    _, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 2)) == []
    tracker.job_new(JOB2, A)
    assert tracker.stopped_at_gate(A) == []
    assert not tracker.leaving(A)
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED)
    ]


def test_a_read_of_a_start_waits_again_though_no_start_was_cancelled_at_its_gate() -> None:
    """Told down by the stop job its signal showed (its start's end not heard yet), then
    read with a start job (one that replaced the stop): it waits again."""
    _, tracker = waiting_at_its_gate()
    tracker.job_new(JOB2, A)
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 2)) == [
        WentDown(A, Outcome.STOPPED)
    ]
    assert tracker.leaving_read(A, UnitState(A, "activating", "start-pre", 3, "start"))
    assert not tracker.leaving(A)


def test_a_read_waits_again_only_a_unit_told_down_and_still_at_its_gate() -> None:
    """A unit no one stops, or one whose stop ran and that now has a start queued (not at
    its gate: its next gate is seen by its signal), does not wait again by a read."""
    _, tracker = waiting_at_its_gate()
    assert not tracker.leaving_read(A, UnitState(A, "activating", "start-pre", 1, "start"))
    tracker.job_removed(JOB1, A, "canceled")
    tracker.job_new(JOB2, A)
    assert tracker.stopped_at_gate(A) == [WentDown(A, Outcome.STOPPED)]
    assert not tracker.leaving_read(A, UnitState(A, "inactive", "dead", 3, "start"))
    assert tracker.leaving(A)


def test_a_waiter_that_waits_again_is_told_down_by_the_next_stop_at_its_gate() -> None:
    """A start replaced its stop: it waits again, and a second `systemctl stop a` at its
    gate tells it down again."""
    model, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    tracker.job_new(JOB2, A)
    assert tracker.stopped_at_gate(A) == [WentDown(A, Outcome.STOPPED)]
    model.waiters.discard(A)
    tracker.job_removed(JOB2, A, "canceled")
    tracker.job_new(JOB3, A)
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 3)) == [ReachedGate(A)]
    model.waiters.add(A)
    tracker.job_removed(JOB3, A, "canceled")
    tracker.job_new(JOB4, A)
    [down] = tracker.stopped_at_gate(A)
    assert down == WentDown(A, Outcome.STOPPED)
    assert down.job == JOB4


def test_a_read_of_a_unit_told_down_at_its_gate_with_no_job_waits_again() -> None:
    """Its stop cancelled before it ran (`systemctl cancel`), that signal lost: the read
    shows it at its gate with no job, its ExecStartPre= going on, as that signal would
    have (`_job_at_gate`): it waits again. A stop job shown keeps it leaving."""
    _, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    tracker.job_new(JOB2, A)
    assert tracker.stopped_at_gate(A) == [WentDown(A, Outcome.STOPPED)]
    assert not tracker.leaving_read(A, UnitState(A, "activating", "start-pre", 2, "stop"))
    tracker.job_removed(JOB2, A, "canceled")
    assert tracker.leaving_read(A, UnitState(A, "activating", "start-pre", 0))
    assert not tracker.leaving(A)


def test_a_unit_listed_at_its_gate_with_a_stop_is_leaving_and_no_other() -> None:
    """Start-up's ListUnits names each job's type: a unit the core has no phase for, at its
    gate (or in its ExecCondition=) with a job that is no start, is leaving (someone's stop
    waits its turn there); none with no job, a start or restart, a job of no type said, one
    not at its gate, or one the core has a phase for."""
    model = Model()
    model.phases["held.service"] = Phase.STARTING
    names = ["stop", "cond", "none", "start", "restart", "untyped", "down", "held"]
    units = {f"{n}.service" for n in names}
    tracker = model.tracker(frozenset(units))
    tracker.listed(
        [
            UnitState("stop.service", "activating", "start-pre", 1, "stop"),  # the first job
            UnitState("cond.service", "activating", "condition", 22, "stop"),
            UnitState("none.service", "activating", "start-pre", 0),
            UnitState("start.service", "activating", "start-pre", 23, "start"),
            UnitState("restart.service", "activating", "start-pre", 24, "restart"),
            UnitState("untyped.service", "activating", "start-pre", 25),
            UnitState("down.service", "inactive", "dead", 26, "stop"),
            UnitState("held.service", "activating", "start-pre", 27, "stop"),
        ]
    )
    assert tracker.leaving_units() == ["cond.service", "stop.service"]
    assert tracker.stopped_at_gate("stop.service") == []  # told by Restore.rebuild


def test_a_start_that_replaces_a_stop_listed_at_the_gate_waits_again() -> None:
    """Listed at its gate with someone's stop (job 21): a signal naming another job there (a
    start that replaced the stop), or none (the stop cancelled), has it wait again (a new
    start, known at its gate), as does
    a read naming a start; its down, the stop run, is told no more (the core held it)."""
    for shown in (22, 0):
        model = Model()
        tracker = model.tracker()
        tracker.listed([UnitState(A, "activating", "start-pre", 21, "stop")])
        assert tracker.unit_changed(A, props_of("activating", "start-pre", 21)) == []
        assert tracker.leaving(A)
        changes = tracker.unit_changed(A, props_of("activating", "start-pre", shown))
        assert changes == [ReachedGate(A)], shown  # a start known at its gate
        assert not tracker.leaving(A), shown
    tracker = Model().tracker()
    tracker.listed([UnitState(A, "activating", "start-pre", 21, "stop")])
    assert not tracker.leaving_read(A, UnitState(A, "activating", "start-pre", 21, "stop"))
    assert tracker.leaving_read(A, UnitState(A, "activating", "start-pre", 22, "start"))
    tracker = Model().tracker()
    tracker.listed([UnitState(A, "activating", "start-pre", 21, "stop")])
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 21)) == []
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []
    assert not tracker.leaving(A)
