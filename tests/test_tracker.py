"""The tracker: systemd's signals and our own calls in, the core's events out.

Recorded sequences (as systemd 252 sends them for a preemption, a hand stop, a finished
unit, a shutdown) and forged or reordered ones; no D-Bus, milliseconds each.
"""

from __future__ import annotations

import pytest

from gpuslice.core.scheduler import Outcome, Phase
from gpuslice.tracker import (
    CLD_DUMPED,
    CLD_EXITED,
    CLD_KILLED,
    CameUp,
    Exited,
    Kind,
    Ledger,
    MainExit,
    ReachedGate,
    StopLost,
    Tracker,
    UnitState,
    WentDown,
    bound_for_gate,
    classify,
    restart_coming,
    stopped_by_a_job,
)

A = "a.service"
B = "b.service"
JOB1 = "/org/freedesktop/systemd1/job/1"
JOB2 = "/org/freedesktop/systemd1/job/2"


class Model:
    """The scheduler's answers the tracker asks for, set by each test."""

    def __init__(self) -> None:
        self.phases: dict[str, Phase] = {}
        self.waiters: set[str] = set()
        self.away: set[str] = set()  # comebacks at their gate the core has not heard yet
        self.remained: set[str] = set()  # released, kept active (Scheduler.remained)

    def tracker(self, managed: frozenset[str] = frozenset({A})) -> Tracker:
        return Tracker(
            lambda n: n in managed,
            Ledger(
                lambda n: self.phases.get(n),
                lambda n: n in self.waiters,
                lambda n: n in self.away,
                lambda n: n in self.remained,
            ),
        )


def props(active: str, sub: str, job: int = 0) -> dict[str, object]:
    return {"ActiveState": active, "SubState": sub, "Job": [job, "/"]}


def our_stop_sent() -> Tracker:
    """A tracker of A, which the scheduler is stopping, with our StopUnit on its way."""
    model = Model()
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    tracker.call_sent(A)
    return tracker


def test_classify_table() -> None:
    table = [
        (("active", "running", 0), Kind.RUNNING),
        (("reloading", "reload", 5), Kind.RUNNING),
        (("activating", "start-pre", 5), Kind.GATE),
        (("activating", "condition", 5), Kind.GATE),
        (("activating", "start", 5), Kind.RUNNING),
        (("activating", "auto-restart", 0), Kind.DOWN),
        (("activating", "auto-restart-queued", 5), Kind.DOWN),  # systemd 254+
        (("inactive", "dead", 0), Kind.DOWN),
        (("failed", "failed", 0), Kind.DOWN),
        (("inactive", "dead", 7), Kind.TRANSITION),  # a start job is queued
        (("deactivating", "stop-sigterm", 7), Kind.TRANSITION),
    ]
    for (active, sub, job), kind in table:
        assert classify(UnitState(A, active, sub, job)) is kind, (active, sub, job)


def test_our_stop_of_a_holder_is_a_preemption_not_a_hold() -> None:
    tracker = our_stop_sent()
    tracker.job_new(JOB1, A)  # JobNew arrives before our StopUnit's reply
    assert tracker.unit_changed(A, props("deactivating", "stop-sigterm", 1)) == []
    assert tracker.call_answered(A, JOB1, "stop") is False
    assert tracker.job_removed(JOB1, A, "done") is True
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.EXITED)]


def test_a_stop_by_someone_else_is_a_hold() -> None:
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    tracker.unit_changed(A, props("deactivating", "stop-sigterm", 1))
    tracker.job_removed(JOB1, A, "done")
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.STOPPED)]


def test_a_unit_that_ends_by_itself_finished_and_one_that_fails_failed() -> None:
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.EXITED)]
    assert tracker.unit_changed(A, props("failed", "failed")) == [WentDown(A, Outcome.FAILED)]
    tracker.unit_changed(A, props("active", "running"))
    restart = props("activating", "auto-restart")
    assert tracker.unit_changed(A, restart) == [WentDown(A, Outcome.FAILED)]


def running_being_stopped() -> tuple[Model, Tracker]:
    """A, seen running past its gate, which the scheduler now stops: our StopUnit is sent."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.passed_gate(A)
    assert tracker.unit_changed(A, props_of("activating", "start", 0)) == []
    assert tracker.unit_changed(A, props_of("active", "running", 0)) == []  # runs on
    model.phases[A] = Phase.STOPPING
    tracker.call_sent(A)
    return model, tracker


def test_a_unit_that_left_running_with_no_job_ended_by_itself_though_our_stop_came_after() -> None:
    """Systemd signals each change as it happens: a unit whose main process ended shows
    deactivating (its ExecStopPost=) or inactive with no job before our stop job reaches
    it. Its work is done: `by_itself`, whichever way it goes down after."""
    # in its ExecStopPost= when our stop job comes, which waits for it
    _, tracker = running_being_stopped()
    assert tracker.unit_changed(A, props_of("deactivating", "stop-post", 0)) == []
    tracker.job_new(JOB1, A)
    assert tracker.call_queued(A, JOB1, "stop") is False
    assert tracker.unit_changed(A, props_of("deactivating", "stop-post", 1)) == []
    down = tracker.unit_changed(A, props_of("inactive", "dead", 1))
    assert down == [WentDown(A, Outcome.EXITED, by_itself=True)]
    # down before our StopUnit answered: decided once it has, still by itself
    _, tracker = running_being_stopped()
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []
    tracker.job_new(JOB1, A)
    assert tracker.call_queued(A, JOB1, "stop") is True
    assert tracker.job_removed(JOB1, A, "done") is True
    assert tracker.unit_changed(A, props("inactive", "dead")) == [
        WentDown(A, Outcome.EXITED, by_itself=True, not_ours=True)
    ]
    # a oneshot: its start job runs while it does, until it is down, and is no stop
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    tracker.passed_gate(A)
    tracker.unit_changed(A, props_of("activating", "start", 1))
    model.phases[A] = Phase.STOPPING
    assert tracker.unit_changed(A, props_of("deactivating", "stop-post", 1)) == []
    tracker.job_removed(JOB1, A, "failed")
    assert tracker.unit_changed(A, props_of("failed", "failed", 0)) == [
        WentDown(A, Outcome.FAILED, by_itself=True)
    ]
    # someone's `systemctl start` of it while it ran (a job that did nothing) stopped nothing
    _, tracker = running_being_stopped()
    tracker.job_new(JOB2, A)
    tracker.job_removed(JOB2, A, "done")
    tracker.call_answered(A, JOB1, "stop")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.EXITED, by_itself=True)
    ]


def test_a_unit_left_running_by_a_job_or_restarting_did_not_end_by_itself() -> None:
    # our stop: the unit leaves running with our stop job
    _, tracker = running_being_stopped()
    tracker.job_new(JOB1, A)
    tracker.call_queued(A, JOB1, "stop")
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1)) == []
    assert tracker.unit_changed(A, props_of("inactive", "dead", 1)) == [WentDown(A, Outcome.EXITED)]
    # someone else's stop while ours is on its way: a hold, as before
    _, tracker = running_being_stopped()
    tracker.job_new(JOB2, A)
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 2)) == []
    tracker.call_answered(A, None, "stop")
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED)
    ]
    # Restart=: systemd would start it again, and our stop is what ends it
    _, tracker = running_being_stopped()
    tracker.call_answered(A, JOB1, "stop")
    restart = props_of("activating", "auto-restart", 0)
    assert tracker.unit_changed(A, restart) == [WentDown(A, Outcome.FAILED)]
    # a job named without its path: not known to be none of ours
    _, tracker = running_being_stopped()
    tracker.call_answered(A, JOB1, "stop")
    assert tracker.unit_changed(A, props("deactivating", "stop-sigterm", 1)) == []
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.EXITED)]


def test_a_read_of_a_unit_cannot_tell_it_ended_by_itself() -> None:
    """A read (after signals were lost) shows where the unit is, not what came first:
    the stop of ours it went down with counts, and it stays owed its comeback."""
    _, tracker = running_being_stopped()
    tracker.call_answered(A, JOB1, "stop")
    down = tracker.unit_changed(A, props_of("inactive", "dead", 0), read=True)
    assert down == [WentDown(A, Outcome.EXITED)]
    # nor does a change that names no job
    _, tracker = running_being_stopped()
    tracker.call_answered(A, JOB1, "stop")
    down = tracker.unit_changed(A, {"ActiveState": "inactive", "SubState": "dead"})
    assert down == [WentDown(A, Outcome.EXITED)]


def test_ending_by_itself_is_forgotten_when_the_unit_starts_again() -> None:
    """Down by itself while our stop was on its way (decided at its answer), but started
    again and past its gate before that answer came: the next run is its own."""
    _, tracker = running_being_stopped()
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []  # deferred
    tracker.job_new(JOB2, A)
    tracker.unit_changed(A, props_of("activating", "start-pre", 2))
    tracker.passed_gate(A)
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.call_answered(A, None, "stop")
    tracker.call_sent(A)
    tracker.job_new(JOB1, A)
    tracker.call_queued(A, JOB1, "stop")
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1)) == []
    assert tracker.unit_changed(A, props_of("inactive", "dead", 1)) == [WentDown(A, Outcome.EXITED)]


def test_ending_by_itself_is_forgotten_when_a_start_asks_at_its_gate_before_our_answer() -> None:
    """Down by itself while our stop was on its way, then started again by someone (found
    by tests/test_tracker_properties.py): the new start's gate asks before our StopUnit's
    answer, and the core leaves it to our stop (Scheduler.request), which reaches systemd
    and cancels it there. One run to the core, ended by our stop: not by itself, so it is
    owed the comeback that the start our stop cut would have given it."""
    _, tracker = running_being_stopped()
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []  # deferred
    tracker.job_new(JOB2, A)  # someone's start
    assert tracker.unit_changed(A, props_of("inactive", "dead", 2)) == []
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 2)) == []
    tracker.job_removed(JOB2, A, "canceled")  # our stop replaces it
    tracker.job_new(JOB3, A)
    assert tracker.call_queued(A, JOB3, "stop") is True
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 3)) == []
    tracker.passed_gate(A)  # its gate asks
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 3)) == []
    assert tracker.unit_changed(A, props_of("inactive", "dead", 3)) == [WentDown(A, Outcome.EXITED)]


def test_ending_by_itself_is_said_of_one_run_only() -> None:
    """A unit that ended by itself while nobody followed it, then was started and stopped
    by someone before its gate, is held: the earlier run's end says nothing of this one."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.unit_changed(A, props_of("active", "running", 0))
    model.phases.pop(A)
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []
    model.waiters.add(A)
    tracker.job_new(JOB1, A)
    tracker.unit_changed(A, props_of("inactive", "dead", 1))
    tracker.job_new(JOB2, A)
    tracker.job_removed(JOB1, A, "canceled")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED)
    ]


def test_down_while_our_call_is_in_flight_waits_for_its_answer() -> None:
    """Which jobs are ours is known only once StopUnit answers: decide after it."""
    tracker = our_stop_sent()
    tracker.job_new(JOB1, A)
    tracker.job_removed(JOB1, A, "done")
    assert tracker.unit_changed(A, props("inactive", "dead")) == []
    assert tracker.call_answered(A, JOB1, "stop") is True  # read the state again
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.EXITED)]


def test_shutdown_is_no_hold_and_a_cancelled_shutdown_does_not_disable_holds() -> None:
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    assert tracker.shutting_down is False
    tracker.job_new(JOB2, "shutdown.target")
    tracker.job_new(JOB1, A)
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.SHUTDOWN)]
    assert tracker.job_removed(JOB1, A, "canceled") is True  # no shutdown target's
    assert tracker.shutting_down is True
    tracker.job_removed(JOB2, "shutdown.target", "done")  # the shutdown goes on
    assert tracker.shutting_down is True
    tracker.job_removed(JOB2, "shutdown.target", "canceled")
    assert tracker.shutting_down is False
    tracker.job_new("/org/freedesktop/systemd1/job/3", A)
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.STOPPED)]


def test_one_shutdown_job_cancelled_while_another_goes_on_is_no_cancelled_shutdown() -> None:
    """`systemctl cancel` of reboot.target's job leaves shutdown.target's: the host still goes
    down, and a start then is refused (destructive): the flag stays until the last one is
    cancelled. Cleared at the first, a preempted unit's comeback was started, refused, taken
    for failed and never started after the reboot."""
    tracker = Model().tracker()
    tracker.job_new(JOB2, "reboot.target")
    tracker.job_new(JOB1, "shutdown.target")
    tracker.job_removed(JOB2, "reboot.target", "canceled")
    assert tracker.shutting_down is True
    tracker.job_removed(JOB1, "shutdown.target", "canceled")
    assert tracker.shutting_down is False


def test_a_soft_reboot_is_a_shutdown() -> None:
    """`systemctl soft-reboot` (systemd 254+) stops every unit as a reboot does: a unit its
    stop took down is no hold, and a preempted one stays owed (its work goes with it)."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.job_new(JOB2, "soft-reboot.target")
    assert tracker.shutting_down is True
    tracker.job_new(JOB3, "shutdown.target")
    tracker.job_new(JOB1, A)
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.SHUTDOWN)]
    tracker.job_removed(JOB2, "soft-reboot.target", "canceled")
    tracker.job_removed(JOB3, "shutdown.target", "canceled")
    assert tracker.shutting_down is False


@pytest.mark.parametrize("result", ["dependency", "failed", "skipped", "invalid"])
def test_a_shutdown_job_that_ends_undone_ends_the_shutdown(result: str) -> None:
    """reboot.target's job removed without `done` (a dependency's job failed): systemd-reboot
    never ran and the host stays up, every unit stopped. Taken for going down still, gpuslice
    started nothing until it restarted: no comeback, no refill, every waiter waiting."""
    tracker = Model().tracker()
    tracker.job_new(JOB2, "reboot.target")
    tracker.job_new(JOB1, "shutdown.target")
    tracker.job_removed(JOB1, "shutdown.target", "done")
    assert tracker.shutting_down is True
    tracker.job_removed(JOB2, "reboot.target", result)
    assert tracker.shutting_down is False


def test_a_shutdown_job_that_times_out_still_takes_the_host_down() -> None:
    """reboot.target's JobTimeoutAction=reboot-force (poweroff.target's, halt.target's, ...
    alike): its job timed out, the host is forced down all the same; nor does one job that
    failed end a shutdown whose other job goes on."""
    tracker = Model().tracker()
    tracker.job_new(JOB2, "reboot.target")
    tracker.job_removed(JOB2, "reboot.target", "timeout")
    assert tracker.shutting_down is True
    tracker.job_new(JOB1, "shutdown.target")
    tracker.job_new(JOB3, "poweroff.target")
    tracker.job_removed(JOB1, "shutdown.target", "dependency")
    assert tracker.shutting_down is True


@pytest.mark.parametrize(
    ("removed", "down"),
    [
        # `systemctl cancel` of shutdown.target's job: systemd removes it, then fails what
        # requires it (systemd-reboot.service, so reboot.target): `dependency`, host up
        ([("shutdown.target", "canceled"), ("reboot.target", "dependency")], False),
        # `systemctl isolate multi-user.target` meanwhile: each cancelled, none failed on
        ([("reboot.target", "canceled"), ("shutdown.target", "canceled")], False),
        # reboot.target's alone: shutdown.target's and systemd-reboot.service's go on
        ([("reboot.target", "canceled")], True),
    ],
)
def test_a_shutdown_ends_as_systemd_removes_its_jobs(
    removed: list[tuple[str, str]], down: bool
) -> None:
    """The JobRemoveds systemd sends, in its order (job_finish_and_invalidate removes a job
    before it fails those that require it), for `systemctl reboot` cut short: taken for
    going down still after shutdown.target's cancel, nothing was started again."""
    tracker = Model().tracker()
    jobs = {"reboot.target": JOB2, "shutdown.target": JOB1}
    for unit, job in jobs.items():
        tracker.job_new(job, unit)
    for unit, result in removed:
        tracker.job_removed(jobs[unit], unit, result)
    assert tracker.shutting_down is down


def test_a_cancelled_stop_job_is_a_stop_lost() -> None:
    """`systemctl start victim` while gpuslice stops it replaces our stop job: the victim
    keeps running and the waiter must not wait for it forever."""
    tracker = our_stop_sent()
    tracker.job_new(JOB1, A)
    tracker.call_answered(A, JOB1, "stop")
    tracker.job_new(JOB2, A)
    assert tracker.job_removed(JOB1, A, "canceled") is True
    tracker.job_removed(JOB2, A, "done")
    changes = tracker.unit_changed(A, props("active", "running"))
    assert changes == [StopLost(A, "its stop job ended with result 'canceled'")]


def test_running_with_our_stop_not_yet_sent_is_no_stop_lost() -> None:
    tracker = our_stop_sent()
    assert tracker.unit_changed(A, props("active", "running")) == []
    assert tracker.unit_changed(A, props("active", "running", 4)) == []


def test_came_up_only_for_units_not_known_running() -> None:
    model = Model()
    tracker = model.tracker()
    assert tracker.unit_changed(A, props("active", "running")) == [CameUp(A)]
    model.phases[A] = Phase.STARTING
    assert tracker.unit_changed(A, props("activating", "start")) == [CameUp(A)]
    model.phases[A] = Phase.RUNNING
    assert tracker.unit_changed(A, props("active", "running")) == []


def test_a_start_in_its_exec_condition_is_announced_only_at_its_gate() -> None:
    """`ExecCondition=` runs before the gate, and may skip the start (exit 1): no start is
    known until start-pre. Announced at `condition`, a less urgent holder was preempted for
    a start that never ran; a skipped one goes down unannounced."""
    model = Model()
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    assert tracker.unit_changed(A, props("activating", "condition", 7)) == []
    assert tracker.unit_changed(A, props("activating", "start-pre", 7)) == [ReachedGate(A)]
    tracker = model.tracker()
    assert tracker.unit_changed(A, props("activating", "condition", 7)) == []
    assert bound_for_gate(UnitState(A, "activating", "condition", 7))  # a start under way


def test_a_unit_at_its_gate_is_announced_once_unless_known() -> None:
    """start-pre: its gate runs and asks in a moment; the core learns of it now, unless it
    already waits or holds GPUs (our own start of it, or a gate that asked already)."""
    model = Model()
    tracker = model.tracker()
    assert tracker.unit_changed(A, props("activating", "start-pre", 7)) == [ReachedGate(A)]
    model.waiters.add(A)
    assert tracker.unit_changed(A, props("activating", "start-pre", 7)) == []
    model.waiters.clear()
    for phase in Phase:
        model.phases[A] = phase
        assert tracker.unit_changed(A, props("activating", "start-pre", 7)) == []


def test_unmanaged_units_are_not_tracked() -> None:
    model = Model()
    tracker = model.tracker()
    other = "other.service"
    tracker.job_new(JOB1, other)
    assert tracker.job_removed(JOB1, other, "done") is False
    assert tracker.unit_changed(other, props("inactive", "dead")) == []
    assert tracker.states == {}
    assert tracker.signals(other) == 0


def test_a_waiter_whose_start_is_cancelled_goes_down() -> None:
    model = Model()
    model.waiters.add(A)
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    tracker.unit_changed(A, props("activating", "start-pre", 1))
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.STOPPED)]


def test_an_idle_unit_going_down_again_is_nothing() -> None:
    tracker = Model().tracker()
    assert tracker.unit_changed(A, props("inactive", "dead")) == []


def test_passing_the_gate_forgets_earlier_jobs() -> None:
    """A hand stop long ago must not make today's end of the unit a hold."""
    model = Model()
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    tracker.passed_gate(A)
    model.phases[A] = Phase.RUNNING
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.EXITED)]


def test_each_signal_moves_the_units_stamp_so_stale_reads_can_be_dropped() -> None:
    tracker = Model().tracker(frozenset({A, B}))
    seen = [tracker.signals(A)]
    for signal in (
        lambda: tracker.unit_changed(A, props("activating", "start-pre", 1)),
        lambda: tracker.job_new(JOB1, A),
        lambda: tracker.job_removed(JOB1, A, "done"),
    ):
        signal()
        assert tracker.signals(A) not in seen
        seen.append(tracker.signals(A))
    tracker.unit_changed(B, props("activating", "start-pre", 2))  # another unit's
    assert tracker.signals(A) == seen[-1] == tracker.heard(A)


def test_a_forgotten_unit_never_shows_a_stamp_a_read_was_sent_with() -> None:
    """An instance forgotten once down and started again under the same name: a read of
    its state sent before it was forgotten is still older than what was heard since."""
    tracker = Model().tracker()
    tracker.job_new(JOB1, A)
    sent_at = {tracker.heard(A)}
    tracker.unit_changed(A, props("inactive", "dead"))
    sent_at.add(tracker.heard(A))
    assert tracker.forget(A)
    assert (tracker.states, tracker.heard(A)) == ({}, 0)
    for _ in range(3):
        tracker.job_new(JOB2, A)
        assert tracker.heard(A) not in sent_at


def test_a_unit_with_a_call_of_ours_unanswered_is_not_forgotten() -> None:
    """The answer is judged with what is known of the unit (its job is ours)."""
    tracker = our_stop_sent()
    tracker.unit_changed(A, props("active", "running"))
    assert not tracker.forget(A)
    assert tracker.state(A).active == "active"
    tracker.call_queued(A, JOB1, "stop")
    assert tracker.forget(A)
    assert tracker.state(A) == UnitState(A, "inactive", "dead", 0)


def test_our_stop_told_as_its_answer_is_read_decides_the_signals_after_it_at_once() -> None:
    """Systemd answers StopUnit before it signals the job: told then, the job is ours for
    every signal after, with no read again; a read answered before it is stale (`heard`),
    while the signal count (the gate's check of a cancelled start) does not move."""
    tracker = our_stop_sent()
    heard, signals = tracker.heard(A), tracker.signals(A)
    assert tracker.call_queued(A, JOB1, "stop") is False  # nothing deferred: no read
    assert tracker.heard(A) != heard and tracker.signals(A) == signals
    answered = tracker.heard(A)
    assert not tracker.in_flight(A)
    tracker.job_new(JOB1, A)
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.EXITED)]
    assert tracker.heard(A) not in (heard, answered)


def props_of(active: str, sub: str, job: int) -> dict[str, object]:
    """As systemd's signals name the job: with its path ("/" for none)."""
    return {
        "ActiveState": active,
        "SubState": sub,
        "Job": [job, f"/org/freedesktop/systemd1/job/{job}" if job else "/"],
    }


def test_down_with_our_stop_job_still_shown_is_down_at_once() -> None:
    """Systemd 252 shows a preempted unit inactive while our stop job is still its job,
    then JobRemoved, then inactive with no job (traced in issue 10): its processes are
    gone at the first, and the GPUs go then. Only our own stop: someone else's job, a
    start queued after ours, or a unit still on its way down waits as before."""
    model = Model()
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    tracker.call_sent(A)
    tracker.job_new(JOB1, A)
    assert tracker.call_queued(A, JOB1, "stop") is False
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1)) == []
    assert tracker.unit_changed(A, props_of("inactive", "dead", 1)) == [WentDown(A, Outcome.EXITED)]
    model.phases.pop(A)
    assert tracker.job_removed(JOB1, A, "done") is True
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []
    # a stop of someone else's, and a start queued behind ours, are not ours to end
    for ours, shown in ((None, 2), (JOB1, 2)):
        model.phases[A] = Phase.STOPPING
        tracker = model.tracker()
        tracker.job_new(JOB2, A)
        if ours is not None:
            tracker.call_sent(A)
            tracker.job_new(ours, A)
            tracker.call_queued(A, ours, "stop")
        assert tracker.unit_changed(A, props_of("inactive", "dead", shown)) == []
    # our start job is no stop
    model.phases[A] = Phase.STARTING
    tracker = model.tracker()
    tracker.call_sent(A)
    tracker.job_new(JOB1, A)
    tracker.call_queued(A, JOB1, "start")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 1)) == []
    # a read gives no job path: it waits for the job's end as before
    model.phases[A] = Phase.STOPPING
    tracker = our_stop_sent()
    tracker.call_queued(A, JOB1, "stop")
    assert tracker.unit_changed(A, props("inactive", "dead", 1)) == []


def test_down_before_our_stop_was_told_is_read_again_when_it_is() -> None:
    tracker = our_stop_sent()
    assert tracker.unit_changed(A, props("inactive", "dead")) == []
    assert tracker.call_queued(A, JOB1, "stop") is True


def test_tables_stay_small_under_ten_thousand_jobs() -> None:
    """Jobs of units that went down are forgotten: memory does not grow with uptime."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    for i in range(10_000):
        path = f"/org/freedesktop/systemd1/job/{i}"
        tracker.call_sent(A)
        tracker.job_new(path, A)
        tracker.call_answered(A, path, "start")
        tracker.job_removed(path, A, "done")
        tracker.unit_changed(A, props("inactive", "dead"))
    assert len(tracker._own_jobs) <= 1
    assert len(tracker._unit_jobs) <= 1


def test_tables_stay_small_under_ten_thousand_starts_of_ours_that_ran_nothing() -> None:
    """A comeback of ours that systemd ends before anything runs (a `Requires=` unit that
    keeps failing: `dependency`), asked again and again: each such job is forgotten as it
    ends, not kept for the uptime."""
    model = Model()
    model.phases[A] = Phase.STARTING
    tracker = model.tracker()
    for i in range(10_000):
        path = f"/org/freedesktop/systemd1/job/{i}"
        tracker.call_sent(A)
        tracker.job_new(path, A)
        tracker.call_queued(A, path, "start")
        tracker.job_removed(path, A, "dependency")
        assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.FAILED)]
    assert len(tracker._own_jobs) <= 1
    assert len(tracker._unit_jobs) <= 1


def test_jobs_that_left_a_running_unit_running_are_forgotten() -> None:
    """A unit that runs for months, started again each minute by a cron job (or reloaded,
    or started by a timer while it runs): each no-op job, read once it ended, is forgotten
    while the unit runs, not kept until it is next down. Who stops it later is still told."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.unit_changed(A, props("active", "running"))
    for i in range(10_000):
        path = f"/org/freedesktop/systemd1/job/{i}"
        tracker.job_new(path, A)
        assert tracker.job_removed(path, A, "done") is True  # read, as no signal follows
        tracker.unit_changed(A, props("active", "running"), read=True)
    assert len(tracker._unit_jobs.get(A, {})) <= 1 and len(tracker._own_jobs) <= 1
    tracker.job_new(JOB1, A)  # a person's stop
    tracker.unit_changed(A, props("deactivating", "stop-sigterm", 1))
    tracker.job_removed(JOB1, A, "done")
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.STOPPED)]


def test_a_job_of_a_running_unit_is_kept_while_our_call_is_unanswered() -> None:
    """Our StartUnit of a running unit, its job ended before systemd's answer is read: the
    answer still finds it (ours), and it is forgotten once the unit is next seen running."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.unit_changed(A, props("active", "running"))
    tracker.call_sent(A)
    tracker.job_new(JOB1, A)
    tracker.job_removed(JOB1, A, "done")
    tracker.unit_changed(A, props("active", "running"), read=True)
    assert tracker._unit_jobs == {A: {JOB1: tracker.signals(A) - 2}}
    tracker.call_answered(A, JOB1, "start")
    assert tracker._own_jobs == {JOB1: "start"}
    tracker.unit_changed(A, props("active", "running"), read=True)
    assert (tracker._unit_jobs, tracker._own_jobs) == ({}, {})


@pytest.mark.parametrize(
    ("active", "sub", "job_id", "job_type", "bound"),
    [
        ("activating", "start-pre", 5, "start", True),  # at its gate
        ("inactive", "dead", 5, "start", True),  # its start job waits (behind the controller)
        ("inactive", "dead", 1, "start", True),  # any job id but 0 is a job
        ("failed", "failed", 5, "restart", True),
        ("activating", "auto-restart", 5, "restart", True),
        ("inactive", "dead", 0, "", False),
        ("inactive", "dead", 5, "stop", False),
        ("deactivating", "stop-sigterm", 5, "start", False),  # still holds its GPUs
        ("active", "running", 0, "", False),
        ("activating", "start", 5, "start", False),  # past its gate
    ],
)
def test_bound_for_gate(active: str, sub: str, job_id: int, job_type: str, bound: bool) -> None:
    assert bound_for_gate(UnitState("a.service", active, sub, job_id, job_type)) is bound


# -- what each rule is made of (issue 10: the tracker under mutation testing) ---------------


def test_a_state_without_some_properties_keeps_the_ones_known() -> None:
    """A PropertiesChanged may name only some properties (and a read names no job path):
    the others keep what was known, or for a unit never seen, inactive/dead with no job."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    assert tracker.state(A) == UnitState(A, "inactive", "dead", 0)
    assert tracker.unit_changed(A, {"ActiveState": "inactive"}) == [WentDown(A, Outcome.EXITED)]
    assert tracker.state(A) == UnitState(A, "inactive", "dead", 0)
    tracker = model.tracker()
    tracker.unit_changed(A, {"SubState": "dead"})
    assert tracker.state(A) == UnitState(A, "inactive", "dead", 0)
    tracker.unit_changed(A, props("deactivating", "stop-sigterm", 4))
    tracker.unit_changed(A, {"SubState": "final-sigterm"})
    assert tracker.state(A) == UnitState(A, "deactivating", "final-sigterm", 4)
    tracker.unit_changed(A, {"ActiveState": "inactive"})
    assert tracker.state(A) == UnitState(A, "inactive", "final-sigterm", 4)
    assert tracker.unit_changed(A, {"Job": [0, "/"]}) == [WentDown(A, Outcome.EXITED)]


def test_our_stop_ending_in_a_failed_unit_is_down_at_once_and_failed() -> None:
    model = Model()
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    tracker.call_sent(A)
    tracker.job_new(JOB1, A)
    tracker.call_queued(A, JOB1, "stop")
    assert tracker.unit_changed(A, props_of("failed", "failed", 1)) == [WentDown(A, Outcome.FAILED)]


def test_a_unit_nobody_holds_goes_down_for_a_waiter_or_a_stop_by_someone_else() -> None:
    model = Model()
    model.waiters.add(A)
    tracker = model.tracker()
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.EXITED)]
    model.waiters.clear()
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.STOPPED)]


def test_a_stop_lost_says_how_its_stop_job_ended_and_only_ours() -> None:
    """A job of someone else's that did not end "done" is not our stop's result; ours that
    ended "done" leaves nothing to say; a result is forgotten once the unit starts afresh."""
    for job, owner, result in ((JOB2, None, "canceled"), (JOB1, "stop", "done")):
        tracker = our_stop_sent()
        tracker.job_new(JOB1, A)
        tracker.call_answered(A, JOB1, "stop")
        if owner is None:
            tracker.job_new(JOB2, A)
        tracker.job_removed(job, A, result)
        assert tracker.unit_changed(A, props("active", "running")) == [
            StopLost(A, "no stop job runs")
        ]
    tracker = our_stop_sent()
    tracker.job_new(JOB1, A)
    tracker.call_answered(A, JOB1, "stop")
    tracker.job_removed(JOB1, A, "failed")
    tracker.passed_gate(A)
    assert tracker.unit_changed(A, props("active", "running")) == [StopLost(A, "no stop job runs")]


def test_an_answer_of_ours_not_seen_as_a_job_is_forgotten_when_its_job_ends() -> None:
    tracker = our_stop_sent()
    tracker.call_queued(A, JOB1, "stop")  # no JobNew seen for it
    tracker.job_removed(JOB1, A, "done")
    assert tracker._own_jobs == {}


def test_calls_in_flight_are_counted_one_by_one() -> None:
    """Two calls of ours about a unit: it is decided on only once both answered; an
    answer with no call counted (a restarted controller's) is nothing."""
    model = Model()
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    assert tracker.call_answered(A, None, "stop") is False
    assert not tracker.in_flight(A)
    tracker.call_sent(A)
    tracker.call_sent(A)
    assert tracker.in_flight(A)
    assert tracker.unit_changed(A, props("inactive", "dead")) == []  # deferred
    assert tracker.call_answered(A, JOB1, "stop") is False
    assert tracker.in_flight(A)
    assert tracker.call_answered(A, JOB2, "stop") is True  # read it again now
    assert not tracker.in_flight(A)
    tracker.call_sent(A)
    assert tracker.call_answered(A, None, "stop") is False  # nothing deferred any more
    heard = [tracker.heard(A)]
    tracker.call_sent(A)
    tracker.call_sent(A)
    for job in (JOB1, JOB2):
        tracker.call_queued(A, job, "stop")
        assert tracker.heard(A) not in heard
        heard.append(tracker.heard(A))


def test_listed_replaces_what_was_known_with_the_managed_units_only() -> None:
    tracker = Model().tracker()
    tracker.unit_changed(A, props("active", "running"))
    other = UnitState("other.service", "active", "running", 0)
    tracker.listed([UnitState(A, "inactive", "dead", 3, "start"), other])
    assert tracker.states == {A: UnitState(A, "inactive", "dead", 3, "start")}
    assert tracker.state("other.service") == UnitState("other.service", "inactive", "dead", 0)


# -- found by tests/test_tracker_properties.py ----------------------------------------------

JOB3 = "/org/freedesktop/systemd1/job/3"


def test_our_stop_merged_into_a_persons_stop_is_theirs() -> None:
    """`systemctl stop` of a unit that takes a while to stop, then our StopUnit of it:
    systemd merges ours into the stop job installed and answers with that job's path, and
    announces no job. It is the person's stop: a hold, not our preemption."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.passed_gate(A)
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.job_new(JOB3, A)
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 3))
    model.phases[A] = Phase.STOPPING
    tracker.call_sent(A)
    assert tracker.call_queued(A, JOB3, "stop") is False
    assert tracker.unit_changed(A, props_of("inactive", "dead", 3)) == []
    tracker.job_removed(JOB3, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED, not_ours=True)
    ]
    # theirs reached systemd between our call's sending and its arrival: told in order,
    # the answer names a job announced before other signals, not just before it
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.call_sent(A)
    tracker.job_new(JOB3, A)
    tracker.unit_changed(A, props_of("active", "running", 3))
    tracker.call_queued(A, JOB3, "stop")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 3)) == []
    tracker.job_removed(JOB3, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED, not_ours=True)
    ]
    # sent after the person's job was announced, told late: not ours either
    tracker = our_stop_sent()
    tracker.job_new(JOB3, A)
    tracker.call_sent(A)  # a second call, after the person's stop was announced
    tracker.call_answered(A, JOB1, "stop")
    tracker.call_answered(A, JOB3, "stop")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 3)) == []


def a_stop_announced_at_the_gate_is_a_hold(served_at_signal: bool) -> None:
    """A's start (job 1) waits at its gate (served at its signal, its pipe, when
    `served_at_signal`); job 1 is cancelled and a person's stop, job 2, queued; A's gate
    asks over D-Bus and is granted: A stops by job 2, told down stopped (a hold)."""
    model = Model()
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 1)) == [ReachedGate(A)]
    if served_at_signal:
        tracker.passed_gate(A)  # served at its signal: it waits
    model.waiters.add(A)
    tracker.job_removed(JOB1, A, "canceled")
    tracker.job_new(JOB2, A)
    tracker.unit_changed(A, props_of("activating", "start-pre", 2))
    tracker.passed_gate(A)  # its Acquire over D-Bus: granted (the same start, served again)
    model.waiters.clear()
    model.phases[A] = Phase.RUNNING
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 2)) == []
    assert tracker.unit_changed(A, props_of("inactive", "dead", 2)) == []
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED)
    ]


def test_a_stop_announced_at_the_gate_outlives_a_second_ask_of_the_same_start() -> None:
    """The controller takes a start in at its signal (its pipe) and again when its gate,
    which found no pipe, asks over D-Bus: a person's stop announced in between must still
    say who stopped it (a hold), not be dropped by the second ask as a job of before."""
    a_stop_announced_at_the_gate_is_a_hold(served_at_signal=True)


def test_a_stop_announced_while_the_unit_waited_at_its_gate_outlives_its_ask() -> None:
    """A person's stop queued while the unit waits at its gate, whose ask (over D-Bus)
    comes after: the unit stops by that stop, a hold, though its start passed the gate."""
    a_stop_announced_at_the_gate_is_a_hold(served_at_signal=False)


def running_past_its_gate() -> tuple[Model, Tracker]:
    """A, which the scheduler runs, past its gate and seen running."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.passed_gate(A)
    tracker.unit_changed(A, props_of("active", "running", 0))
    return model, tracker


def restart_job_queued(sub: str) -> tuple[Model, Tracker]:
    """A, running past its gate, fails into its Restart= (`auto-restart`: told down once),
    and its restart's start job (JOB2, nobody's we know) is queued, shown `activating (sub)`:
    no second down."""
    model, tracker = running_past_its_gate()
    restart = props_of("activating", "auto-restart", 0)
    assert tracker.unit_changed(A, restart) == [WentDown(A, Outcome.FAILED)]
    model.phases.pop(A)
    tracker.job_new(JOB2, A)
    assert tracker.unit_changed(A, props_of("activating", sub, 2)) == []
    return model, tracker


def test_a_unit_restarting_is_told_down_once_though_its_restart_job_is_queued() -> None:
    """Restart=: systemd shows the unit in auto-restart, then queues its restart job (a job
    of nobody's we know) while it is still there: one WentDown, not a second failure."""
    model, tracker = restart_job_queued("auto-restart")
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 2)) == [ReachedGate(A)]
    # a person's stop of it there is theirs: a hold (it is not restarted)
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    restart = props_of("activating", "auto-restart", 0)
    assert tracker.unit_changed(A, restart) == [WentDown(A, Outcome.FAILED)]
    model.phases.pop(A)
    tracker.job_new(JOB3, A)
    assert tracker.unit_changed(A, props_of("activating", "auto-restart", 3)) == []
    tracker.job_removed(JOB3, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED)
    ]


def test_a_failure_signalled_failed_then_auto_restart_is_told_once() -> None:
    """Systemd 252 signals a crash `failed`, then `activating (auto-restart)` at the same
    instant: one down. Its GPUs kept meanwhile (Phase.STARTING), the second signal told it
    down again, and the core released them. A `failed` read again is no new down either;
    the `failed` of its start limit, after `auto-restart`, is (the keep is released)."""
    model, tracker = running_past_its_gate()
    failed = props_of("failed", "failed", 0)
    assert tracker.unit_changed(A, failed) == [WentDown(A, Outcome.FAILED, by_itself=True)]
    model.phases[A] = Phase.STARTING  # kept for its restart
    assert tracker.unit_changed(A, failed, read=True) == []
    assert tracker.unit_changed(A, props_of("activating", "auto-restart", 0)) == []
    assert tracker.unit_changed(A, failed) == [WentDown(A, Outcome.FAILED)]


@pytest.mark.parametrize("sub", ["dead", "dead-before-auto-restart"])
def test_a_clean_exit_then_auto_restart_is_told_once(sub: str) -> None:
    """A exits 0 and its Restart= (always, on-success) starts it again: systemd 252 signals
    `inactive (dead)`, 254 `inactive (dead-before-auto-restart)`, then `activating
    (auto-restart)`: one down, told EXITED by itself. Its GPUs kept meanwhile (Phase
    .STARTING), the `auto-restart` was told a second down, FAILED, and the core released
    them, said failed. Read again, the `inactive` is no new down either; a job announced for
    it (a stop, a start), or a start of ours, ends what was told, unless kept for its
    restart (its restart's job, heard before `auto-restart` with RestartSec=0)."""
    model, tracker = running_past_its_gate()
    down = props_of("inactive", sub, 0)
    assert tracker.unit_changed(A, down) == [WentDown(A, Outcome.EXITED, by_itself=True)]
    model.phases[A] = Phase.STARTING  # kept for its restart
    assert tracker.unit_changed(A, down, read=True) == []
    assert tracker.unit_changed(A, props_of("activating", "auto-restart", 0)) == []
    model, tracker = running_past_its_gate()
    tracker.unit_changed(A, down)
    tracker.job_new(JOB2, A)
    assert tracker.unit_changed(A, down) == [WentDown(A, Outcome.STOPPED)]
    # a start of ours (a comeback), whose job ends with the unit still down, is a new down
    model, tracker = running_past_its_gate()
    tracker.unit_changed(A, down)
    model.phases[A] = Phase.STARTING
    tracker.call_sent(A)
    tracker.call_answered(A, JOB2, "start")
    assert tracker.job_removed(JOB2, A, "canceled") is True
    assert tracker.unit_changed(A, down) == [WentDown(A, Outcome.EXITED)]
    # kept, the job heard before `auto-restart` (RestartSec=0) is its restart's
    model, tracker = running_past_its_gate()
    tracker.unit_changed(A, down)
    model.phases[A] = Phase.STARTING
    tracker.job_new(JOB2, A)
    assert tracker.unit_changed(A, props_of("activating", "auto-restart", 2)) == []


def test_a_failure_before_auto_restart_on_systemd_254_is_told_once() -> None:
    """systemd 254's `failed (failed-before-auto-restart)`, then `auto-restart`: one down,
    FAILED by itself (its Restart= follows no stop)."""
    model, tracker = running_past_its_gate()
    failed = props_of("failed", "failed-before-auto-restart", 0)
    assert tracker.unit_changed(A, failed) == [WentDown(A, Outcome.FAILED, by_itself=True)]
    model.phases[A] = Phase.STARTING
    assert tracker.unit_changed(A, props_of("activating", "auto-restart", 0)) == []
    assert restart_coming(UnitState(A, "failed", "failed-before-auto-restart", 0))
    assert restart_coming(UnitState(A, "inactive", "dead-before-auto-restart", 0))
    assert not restart_coming(UnitState(A, "inactive", "dead", 0))


def test_a_unit_whose_restart_job_is_queued_on_systemd_254_is_down_not_running() -> None:
    """Systemd 254 and later show a unit whose RestartSec= is over `activating
    (auto-restart-queued)` while its restart's start job waits to run. Taken for running,
    it was told CameUp and adopted on a GPU before its gate ran; it is down, told once, and
    reaches its gate as any start."""
    _, tracker = restart_job_queued("auto-restart-queued")
    assert bound_for_gate(UnitState(A, "activating", "auto-restart-queued", 2, "start"))
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 2)) == [ReachedGate(A)]


JOB4 = "/org/freedesktop/systemd1/job/4"


def test_a_unit_restarting_when_our_stop_comes_did_not_end_by_itself_though_told_later() -> None:
    """Restart=: its main process failed while our StopUnit was on its way, and systemd
    shows it in auto-restart; a shutdown's stop, queued before ours reached systemd, takes
    ours in and ends the restart. Its down waited for our answer and is judged from the state
    after it (inactive, dead), but it never ended by itself: by itself, the unit we were
    preempting would be owed no comeback after the reboot."""
    model = Model()
    tracker = model.tracker()
    tracker.job_new(JOB1, A)  # a person's start
    tracker.unit_changed(A, props_of("inactive", "dead", 1))
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 1)) == [ReachedGate(A)]
    model.waiters.add(A)
    tracker.passed_gate(A)  # its gate asks, and is granted
    model.waiters.clear()
    model.phases[A] = Phase.STOPPING
    tracker.call_sent(A)  # our stop
    tracker.job_removed(JOB1, A, "canceled")  # a person's stop, then start, replace it
    tracker.job_new(JOB2, A)
    tracker.unit_changed(A, props_of("activating", "start-pre", 2))
    tracker.job_removed(JOB2, A, "canceled")
    tracker.job_new(JOB3, A)
    tracker.unit_changed(A, props_of("activating", "start-pre", 3))
    assert tracker.unit_changed(A, props_of("active", "running", 3)) == []
    tracker.job_removed(JOB3, A, "done")
    assert tracker.unit_changed(A, props_of("active", "running", 0)) == []
    assert tracker.unit_changed(A, props_of("activating", "auto-restart", 0)) == []  # deferred
    tracker.job_new("/org/freedesktop/systemd1/job/999", "shutdown.target")
    tracker.job_new(JOB4, A)  # the shutdown's stop
    assert tracker.unit_changed(A, props_of("activating", "auto-restart", 4)) == []
    assert tracker.call_queued(A, JOB4, "stop") is True  # ours, merged into it
    assert tracker.unit_changed(A, props_of("inactive", "dead", 4)) == []
    tracker.job_removed(JOB4, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.SHUTDOWN, by_itself=False, not_ours=True)
    ]


def test_a_persons_stop_of_a_unit_restarting_while_our_stop_came_is_theirs() -> None:
    """As above, a person's `systemctl stop` ending the restart: theirs (a hold), whether
    ours merged into it or reached the unit down after it. Not by itself: it would be told
    finished, and the person's stop forgotten."""
    _, tracker = running_being_stopped()
    assert tracker.unit_changed(A, props_of("activating", "auto-restart", 0)) == []
    tracker.job_new(JOB2, A)  # the person's stop
    assert tracker.unit_changed(A, props_of("activating", "auto-restart", 2)) == []
    assert tracker.call_queued(A, JOB2, "stop") is True  # ours, merged into it
    assert tracker.unit_changed(A, props_of("inactive", "dead", 2)) == []
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED, not_ours=True)
    ]
    # theirs done before ours reached systemd, which runs ours on a unit down
    _, tracker = running_being_stopped()
    assert tracker.unit_changed(A, props_of("activating", "auto-restart", 0)) == []
    tracker.job_new(JOB2, A)
    assert tracker.unit_changed(A, props_of("activating", "auto-restart", 2)) == []
    assert tracker.unit_changed(A, props_of("inactive", "dead", 2)) == []
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []
    tracker.job_new(JOB3, A)
    assert tracker.call_queued(A, JOB3, "stop") is True
    assert tracker.unit_changed(A, props_of("inactive", "dead", 3)) == [
        WentDown(A, Outcome.STOPPED, not_ours=True)
    ]


def _kept_of(tracker: Tracker, unit: str) -> dict[str, object]:
    """Every per-unit record of the tracker's that still names `unit`."""
    kept: dict[str, object] = {}
    for field, value in vars(tracker).items():
        if isinstance(value, dict) and unit in value:
            kept[field] = value[unit]
        elif isinstance(value, set) and unit in value:
            kept[field] = True
    return kept


def test_a_forgotten_unit_leaves_no_record_whatever_its_life_was() -> None:
    """A person's stop at its gate, our calls, a restart by Restart=, then down: forgotten,
    nothing of it is kept (an instance per job would grow the tracker for ever); and a unit
    never heard of is forgotten as well."""
    model = Model()
    tracker = model.tracker()
    assert tracker.forget(A) and _kept_of(tracker, A) == {}
    tracker.job_new(JOB1, A)
    tracker.unit_changed(A, props_of("activating", "start-pre", 1))
    model.waiters.add(A)
    tracker.job_new(JOB2, A)  # a person's stop, while it waits at its gate
    tracker.passed_gate(A)
    model.waiters.clear()
    model.phases[A] = Phase.RUNNING
    tracker.unit_changed(A, props_of("active", "running", 2))
    tracker.call_sent(A)
    tracker.call_queued(A, JOB2, "stop")  # ours merged into theirs
    tracker.unit_changed(A, props_of("activating", "auto-restart", 0))
    tracker.job_removed(JOB2, A, "canceled")
    tracker.unit_changed(A, props_of("failed", "failed", 0))
    assert tracker.forget(A)
    assert _kept_of(tracker, A) == {}
    assert all(path not in tracker._own_jobs for path in (JOB1, JOB2))


def test_units_listed_at_start_up_count_as_heard() -> None:
    """A read sent before one of them changes (and, an instance, is forgotten) must be
    found older than what was heard: its stamp is never 0, as a forgotten unit's is."""
    tracker = Model().tracker()
    tracker.listed([UnitState(A, "active", "running", 0)])
    assert tracker.heard(A) != 0


def test_an_answer_naming_a_job_announced_before_other_signals_is_not_ours_from_the_start() -> None:
    """Told in order, our answer comes right after our job's JobNew: one naming a job
    announced before other signals of the unit is someone else's, into which ours merged.
    Also when our call was the first thing the tracker ever counted."""
    model = Model()
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    tracker.call_sent(A)  # the first stamp
    tracker.job_new(JOB1, A)  # a person's stop
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1))
    tracker.call_queued(A, JOB1, "stop")
    assert tracker.stopped_by_others(A)


def test_a_persons_stop_kept_at_the_gate_is_still_theirs_when_our_stop_merges_into_it() -> None:
    model = Model()
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    tracker.unit_changed(A, props_of("activating", "start-pre", 1))
    model.waiters.add(A)
    tracker.job_new(JOB2, A)  # a person's stop, while it waits at its gate
    tracker.passed_gate(A)  # its gate is granted
    model.waiters.clear()
    model.phases[A] = Phase.STOPPING
    tracker.call_sent(A)
    tracker.call_answered(A, JOB2, "stop")  # ours merged into theirs, told late
    assert tracker.stopped_by_others(A)


def test_a_unit_forgotten_in_any_state_leaves_no_record() -> None:
    """Seen at its gate and gone down with no run the core knew of (nothing told down, so
    nothing cleared), or waiting to be restarted by Restart=: forgotten, nothing kept."""
    model = Model()
    tracker = model.tracker()
    tracker.unit_changed(A, props_of("activating", "start-pre", 1))
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []
    assert _kept_of(tracker, A) != {}
    assert tracker.forget(A) and _kept_of(tracker, A) == {}
    model.phases[A] = Phase.RUNNING
    tracker.passed_gate(A)
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.unit_changed(A, props_of("activating", "auto-restart", 0))
    model.phases.clear()
    assert tracker.forget(A) and _kept_of(tracker, A) == {}


def test_a_persons_stop_that_ended_the_unit_before_ours_reached_systemd_is_theirs() -> None:
    """Chaos in CI: `systemctl stop bg` while an urgent start came; the controller chose bg
    as its victim before it had read bg's stop, and sent StopUnit. Systemd had bg down by
    then and ran our stop as a job of its own on a unit down. The person's stop ended it: a
    hold, not our preemption (bg was started again, against the stop)."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.passed_gate(A)
    tracker.unit_changed(A, props_of("active", "running", 0))
    model.phases[A] = Phase.STOPPING
    tracker.call_sent(A)  # our StopUnit, sent before the signals below were read
    tracker.job_new(JOB1, A)  # the person's stop
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1)) == []
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []  # waits for ours
    tracker.job_removed(JOB1, A, "done")
    tracker.job_new(JOB2, A)  # ours, on a unit down: it changes nothing
    assert tracker.call_queued(A, JOB2, "stop") is True
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0), read=True) == [
        WentDown(A, Outcome.STOPPED, not_ours=True)
    ]


def test_our_second_stop_merged_into_our_first_is_still_ours() -> None:
    """Two StopUnit calls of ours (a stop sent again): systemd merges the second into the
    first's job. Both are ours: a preemption, owed its comeback."""
    tracker = our_stop_sent()
    tracker.job_new(JOB1, A)
    assert tracker.call_queued(A, JOB1, "stop") is False
    tracker.call_sent(A)
    assert tracker.call_queued(A, JOB1, "stop") is False
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1)) == []
    tracker.job_removed(JOB1, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [WentDown(A, Outcome.EXITED)]


def test_a_stop_job_read_after_our_unanswered_stop_is_ours_unless_announced_before_it() -> None:
    """Our StopUnit got no answer (NO_REPLY: the bus daemon dropped it, and perhaps the job's
    signals): a stop job a read shows then is ours, its JobNew heard or not, and its end a
    preemption; one announced before our call was sent is someone's, ours merged into it."""
    for heard in (True, False):
        tracker = our_stop_sent()
        tracker.unit_changed(A, props_of("active", "running", 0))
        if heard:
            tracker.job_new(JOB1, A)  # its PropertiesChanged dropped
        assert tracker.call_answered(A, None, "stop") is False
        assert tracker.stop_found(A, JOB1) is True
        assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1), read=True) == []
        tracker.job_removed(JOB1, A, "done")
        assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
            WentDown(A, Outcome.EXITED)
        ]
    model = Model()
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.job_new(JOB1, A)  # a person's stop, its PropertiesChanged dropped
    tracker.call_sent(A)
    tracker.call_answered(A, None, "stop")
    assert tracker.stop_found(A, JOB1) is False
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1), read=True)
    tracker.job_removed(JOB1, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED, not_ours=True)
    ]


def test_the_job_that_took_a_unit_down_after_our_unanswered_stop_says_whose_it_was() -> None:
    """Our StopUnit got no answer (NO_REPLY), before or after the unit's end: the job the
    unit left running with, its signals heard, decides. Announced before our call was sent
    (a person's `systemctl stop`, which ours joined): theirs, a hold. Announced after: the
    one ours queued, a preemption; so is a stop job after a start job announced before ours
    (someone's restart, which our stop replaced at its gate)."""
    for answer_lost_first in (True, False):
        model = Model()
        model.phases[A] = Phase.RUNNING
        tracker = model.tracker()
        tracker.passed_gate(A)
        tracker.unit_changed(A, props_of("active", "running", 0))
        tracker.job_new(JOB3, A)  # the person's stop, queued behind something
        tracker.unit_changed(A, props_of("active", "running", 3))
        model.phases[A] = Phase.STOPPING
        tracker.call_sent(A)
        if answer_lost_first:
            assert tracker.call_answered(A, None, "stop") is False
        assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 3)) == []
        down = tracker.unit_changed(A, props_of("inactive", "dead", 0))
        tracker.job_removed(JOB3, A, "done")
        if not answer_lost_first:
            assert down == []  # told once the answer says which job is ours
            assert tracker.call_answered(A, None, "stop") is True
            down = tracker.unit_changed(A, props_of("inactive", "dead", 0), read=True)
        assert down == [WentDown(A, Outcome.STOPPED, not_ours=True)], answer_lost_first
    tracker = our_stop_sent()
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.call_answered(A, None, "stop")
    tracker.job_new(JOB3, A)
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 3))
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED)
    ]
    model = Model()
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    tracker.job_new(JOB2, A)  # someone's restart: at its gate when our stop replaces it
    tracker.unit_changed(A, props_of("activating", "start-pre", 2))
    tracker.call_sent(A)
    tracker.call_answered(A, None, "stop")
    tracker.job_removed(JOB2, A, "canceled")
    tracker.job_new(JOB3, A)
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 3))
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED)
    ]
    # a person's stop queued before ours, then cancelled: the unit leaves with no job, and
    # that stop, which it never left with, says nothing of whose stop ended it
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.passed_gate(A)
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.job_new(JOB3, A)
    tracker.unit_changed(A, props_of("active", "running", 3))
    model.phases[A] = Phase.STOPPING
    tracker.call_sent(A)
    tracker.call_answered(A, None, "stop")
    tracker.job_removed(JOB3, A, "canceled")
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 0))
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.EXITED, by_itself=True)
    ]
    # a person's stop replaced that restart at its gate before ours was sent: theirs
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    tracker.job_new(JOB2, A)
    tracker.unit_changed(A, props_of("activating", "start-pre", 2))
    tracker.job_removed(JOB2, A, "canceled")
    tracker.job_new(JOB3, A)
    tracker.unit_changed(A, props_of("activating", "start-pre", 3))
    tracker.call_sent(A)
    tracker.call_answered(A, None, "stop")
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 3))
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED, not_ours=True)
    ]


def test_our_stop_whose_job_new_was_lost_takes_the_unit_down_not_its_own_end() -> None:
    """The bus daemon dropped our stop job's JobNew; its answer came, and the unit leaves
    running with that job: a job of ours, not a oneshot's start job, so no end by itself
    (that would book a preempted unit finished, never brought back)."""
    tracker = our_stop_sent()
    tracker.unit_changed(A, props_of("active", "running", 0))
    assert tracker.call_queued(A, JOB1, "stop") is False
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1)) == []
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [WentDown(A, Outcome.EXITED)]


def test_a_job_no_job_new_announced_while_our_stop_is_unanswered_is_no_end_by_itself() -> None:
    """The bus daemon dropped our StopUnit's answer and its job's JobNew, not its
    PropertiesChanged: the unit leaves running with a job new since its last signal, which
    no JobNew announced. Taken for ours, as a read finding it is (`stop_found`), whether the
    answer was lost before or after: a preemption, not an end by itself (finished, never
    brought back). A job the unit already ran under (a oneshot's start job) still says it
    ended by itself."""
    for answer_lost_first in (True, False):
        tracker = our_stop_sent()
        tracker.unit_changed(A, props_of("active", "running", 0))
        if answer_lost_first:
            tracker.call_answered(A, None, "stop")
        assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1)) == []
        down = tracker.unit_changed(A, props_of("inactive", "dead", 0))
        if not answer_lost_first:
            assert down == []
            assert tracker.call_answered(A, None, "stop") is True
            down = tracker.unit_changed(A, props_of("inactive", "dead", 0), read=True)
        assert down == [WentDown(A, Outcome.EXITED)], answer_lost_first
    tracker = our_stop_sent()
    tracker.unit_changed(A, props_of("activating", "start", 1))  # a oneshot: its start job
    tracker.call_answered(A, None, "stop")
    tracker.unit_changed(A, props_of("deactivating", "stop-post", 1))
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.EXITED, by_itself=True)
    ]
    model = Model()
    model.phases[A] = Phase.RUNNING  # a call of ours unanswered, but no stop: someone's
    tracker = model.tracker()
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.call_sent(A)
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1)) == []
    assert tracker.call_answered(A, None, "start") is False
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED)
    ]


def test_a_person_stop_that_ours_joined_and_that_was_cancelled_says_nothing_of_our_next() -> None:
    """Our stop merged into a person's stop job, which was then cancelled (a start replaced
    it): the unit ran on, our stop was lost. Our next stop, which ends it, is ours: told
    another's, the preempted unit would never come back."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.passed_gate(A)
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.job_new(JOB3, A)  # the person's stop, queued behind something
    model.phases[A] = Phase.STOPPING
    tracker.call_sent(A)
    assert tracker.call_queued(A, JOB3, "stop") is False  # merged into theirs
    tracker.job_removed(JOB3, A, "canceled")
    assert tracker.unit_changed(A, props_of("active", "running", 0)) == [
        StopLost(A, "no stop job runs")
    ]
    model.phases[A] = Phase.STOPPING  # the core stops it again
    tracker.call_sent(A)
    tracker.job_new(JOB1, A)
    assert tracker.call_queued(A, JOB1, "stop") is False
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1)) == []
    tracker.job_removed(JOB1, A, "done")
    down = tracker.unit_changed(A, props_of("inactive", "dead", 0))
    assert len(down) == 1 and isinstance(down[0], WentDown) and not down[0].not_ours, down


@pytest.mark.parametrize(
    ("active", "job", "main", "stopped"),
    [
        ("inactive", 0, MainExit(CLD_KILLED, 15, "success"), True),  # the stop's SIGTERM
        ("inactive", 0, MainExit(CLD_DUMPED, 3, "success"), True),
        ("inactive", 0, MainExit(CLD_EXITED, 0, "success"), False),  # ended, or trapped it
        ("inactive", 0, MainExit(0, 0, "success"), False),  # no record (loaded anew)
        ("inactive", 0, MainExit(CLD_KILLED, 15, "signal"), False),
        ("failed", 0, MainExit(CLD_KILLED, 9, "signal"), False),  # killed outside a stop job
        ("inactive", 3, MainExit(CLD_KILLED, 15, "success"), False),  # a job still to run
    ],
)
def test_a_unit_found_down_was_stopped_when_its_main_process_died_of_a_signal(
    active: str, job: int, main: MainExit, stopped: bool
) -> None:
    """stopped_by_a_job: killed (or dumped) and left inactive with Result=success, no job."""
    state = UnitState(A, active, "dead" if active == "inactive" else "failed", job)
    assert stopped_by_a_job(state, main) is stopped


def test_an_outcome_read_as_stopped_gives_way_to_failed_and_shutdown() -> None:
    """Tracker.outcome of a unit whose record says a stop ended it: STOPPED, unless it failed
    or the host shuts down."""
    model = Model()
    tracker = model.tracker()
    down = UnitState(A, "inactive", "dead", 0)
    assert tracker.outcome(down) is Outcome.EXITED
    assert tracker.outcome(down, stopped=True) is Outcome.STOPPED
    assert tracker.outcome(UnitState(A, "failed", "failed", 0), stopped=True) is Outcome.FAILED
    tracker.shutting_down = True
    assert tracker.outcome(down, stopped=True) is Outcome.SHUTDOWN


def test_the_down_of_a_comeback_away_at_its_gate_is_told() -> None:
    """After a controller restart, a comeback of ours waiting at its gate is neither held nor
    waiting until its gate asks again (Scheduler.requeued_away). Its wait failing then was
    taken for the down of a unit nobody knows, and its comeback was lost."""
    model = Model()
    model.away.add(A)
    tracker = model.tracker()
    tracker.unit_changed(A, props("deactivating", "stop-sigterm", 5))
    assert tracker.unit_changed(A, props("failed", "failed")) == [WentDown(A, Outcome.FAILED)]
    model.away.clear()  # any other unit nobody holds or waits for: its down says nothing
    tracker.unit_changed(A, props("activating", "start-pre", 6))
    assert tracker.unit_changed(A, props("failed", "failed")) == []


REBOOT = "/org/freedesktop/systemd1/job/9"
SHUTDOWN = "/org/freedesktop/systemd1/job/8"


def waiter_stopped_in_a_shutdown(*targets: tuple[str, str]) -> Tracker:
    """A waiter at its gate as the host goes down (`targets`: the shutdown's jobs, each its
    path and target; reboot.target's by default), and the shutdown's stop (JOB2) of it
    begins: deactivating, not down yet."""
    model = Model()
    model.waiters.add(A)
    tracker = model.tracker()
    tracker.unit_changed(A, props_of("activating", "start-pre", 1))
    for job, target in targets or [(REBOOT, "reboot.target")]:
        tracker.job_new(job, target)
    tracker.job_new(JOB2, A)
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 2))
    return tracker


def test_a_cancelled_job_of_a_unit_down_is_no_stop() -> None:
    """`systemctl reboot`, then `systemctl cancel` (found by tests/test_tracker_properties.py):
    the shutdown's stop job of a unit down is cancelled before it runs. Nobody stopped the
    unit: no hold (a preempted unit owed its comeback was held, never brought back). A stop
    job that had begun to stop the unit when it was cancelled still says who stopped it."""
    tracker = Model().tracker()
    tracker.job_new(REBOOT, "reboot.target")
    tracker.job_new(JOB1, A)
    assert tracker.unit_changed(A, props_of("inactive", "dead", 1)) == []
    tracker.job_removed(REBOOT, "reboot.target", "canceled")
    assert tracker.job_removed(JOB1, A, "canceled") is True
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.job_new(JOB1, A)  # someone's stop, which runs
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1))
    tracker.job_removed(JOB1, A, "canceled")  # `systemctl cancel`: it goes down all the same
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 0))
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED)
    ]


def test_a_job_whose_job_new_was_lost_that_takes_a_unit_down_is_someones_stop() -> None:
    """The bus daemon dropped the JobNew of a person's stop (found by
    tests/test_tracker_properties.py), not its PropertiesChanged: the unit, running or at
    its gate, shows a job it did not have and leaves with it. A stop of theirs, a hold, as
    when its JobNew came: not an end by itself (finished), nor nothing (a waiter)."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.unit_changed(A, props_of("active", "running", 3))  # its JobNew lost
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 3)) == []
    tracker.job_removed(JOB3, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.STOPPED)
    ]
    model = Model()
    model.waiters.add(A)
    tracker = model.tracker()
    tracker.job_new(JOB1, A)  # their start, at its gate
    tracker.unit_changed(A, props_of("activating", "start-pre", 1))
    tracker.job_removed(JOB1, A, "canceled")  # their stop replaces it, its JobNew lost
    # a waiter: told down as soon as it shows their stop at its gate (Tracker.stopped_at_gate)
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 2)) == [
        WentDown(A, Outcome.STOPPED, job=JOB2)
    ]
    model.waiters.discard(A)
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 2)) == []
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []  # told once
    # ours, its JobNew lost, shown queued before the unit leaves with it: not by itself
    _, tracker = running_being_stopped()
    assert tracker.unit_changed(A, props_of("active", "running", 2)) == []
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 2)) == []
    assert tracker.unit_changed(A, props_of("inactive", "dead", 2)) == []
    assert tracker.call_answered(A, JOB2, "stop") is True
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0), read=True) == [
        WentDown(A, Outcome.EXITED)
    ]


def test_a_unit_down_in_a_shutdown_told_after_its_cancel_is_the_shutdowns() -> None:
    """The shutdown's stop took the unit down, and the shutdown was cancelled before its
    down could be told (found by tests/test_tracker_properties.py): our StopUnit's answer
    awaited, or the shutdown's stop job still shown.
    The shutdown ended it, no person: never a hold (a preempted unit held, or a waiter)."""
    # our stop unanswered: the down waits for it
    model = Model()
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    tracker.passed_gate(A)
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.call_sent(A)
    tracker.job_new(REBOOT, "reboot.target")
    tracker.job_new(JOB3, A)
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 3))
    tracker.job_removed(JOB3, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []  # deferred
    tracker.job_removed(REBOOT, "reboot.target", "canceled")
    tracker.job_new(JOB2, A)
    assert tracker.call_queued(A, JOB2, "stop") is True
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0), read=True) == [
        WentDown(A, Outcome.SHUTDOWN, not_ours=True)
    ]
    # the shutdown's stop job still shown when the shutdown is cancelled
    tracker = waiter_stopped_in_a_shutdown()
    assert tracker.unit_changed(A, props_of("inactive", "dead", 2)) == []
    tracker.job_removed(REBOOT, "reboot.target", "canceled")
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.SHUTDOWN)
    ]


def test_a_unit_failed_in_a_shutdown_told_after_its_cancel_says_so() -> None:
    """As above, its main process exiting 143 on the shutdown's SIGTERM: systemd shows it
    failed, and the core, no longer shutting down, recorded a failed job (a comeback's work
    lost, a background unit never refilled). Told `in_shutdown`; one told before the cancel,
    or that went down before the shutdown, is not."""
    tracker = waiter_stopped_in_a_shutdown((REBOOT, "reboot.target"), (SHUTDOWN, "shutdown.target"))
    assert tracker.unit_changed(A, props_of("failed", "failed", 2)) == []
    tracker.job_removed(REBOOT, "reboot.target", "canceled")
    tracker.job_removed(SHUTDOWN, "shutdown.target", "canceled")
    assert not tracker.shutting_down  # nor is the core (Controller._follow_shutdown)
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("failed", "failed", 0)) == [
        WentDown(A, Outcome.FAILED, in_shutdown=True)
    ]
    # told while the host still goes down: the core knows
    tracker = waiter_stopped_in_a_shutdown()
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("failed", "failed", 0)) == [WentDown(A, Outcome.FAILED)]


@pytest.mark.parametrize("phase", [Phase.FROZEN, Phase.SUSPENDED])
def test_a_frozen_or_suspended_unit_stopped_by_hand_that_fails_on_the_sigterm_is_held(
    phase: Phase,
) -> None:
    """systemd thaws it, then its main process exits non-zero on the SIGTERM (143 from a
    shell wrapper), and systemd records it failed. Its processes could not end by
    themselves: someone's stop ended it, a hold as for any unit stopped by hand. Booked
    failed, the next boot cleared it, and refill started a background unit someone had
    stopped. Killed with no stop job, or waiting to restart, it failed as before; one that
    ran is left to systemd's word (failed)."""
    model = Model()
    model.phases[A] = phase
    tracker = model.tracker()
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.job_new(JOB1, A)
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1))
    down = tracker.unit_changed(A, props_of("failed", "failed", 0))
    assert down == [WentDown(A, Outcome.STOPPED)]
    start = UnitState(A, "failed", "failed", 0)
    assert tracker.outcome(start, stopped=True) is Outcome.STOPPED  # the journal said, at start-up
    assert tracker.outcome(start) is Outcome.FAILED
    tracker.unit_changed(A, props_of("active", "running", 0))  # killed: no job
    down = tracker.unit_changed(A, props_of("failed", "failed", 0))
    assert down == [WentDown(A, Outcome.FAILED, by_itself=True)]
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.job_new(JOB2, A)
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 2))
    restarting = tracker.unit_changed(A, props_of("activating", "auto-restart", 0))
    assert restarting == [WentDown(A, Outcome.FAILED)]
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.unit_changed(A, props_of("active", "running", 0))
    tracker.job_new(JOB1, A)
    tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 1))
    assert tracker.unit_changed(A, props_of("failed", "failed", 0)) == [WentDown(A, Outcome.FAILED)]


def test_a_shutdown_read_where_its_jobnew_was_lost_is_taken_in() -> None:
    """SystemState `stopping` (Rereads.hold_booked): the units' downs from now on are the
    shutdown's; an audit's read of the host running, sent before, is not believed; the
    JobRemoved of its cancel, or a later read of the host running, ends it."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    stamp = tracker.shutdown_jobs_heard()
    tracker.shutdown_read()
    assert tracker.shutting_down is True
    assert tracker.shutdown_unheard(stamp) is False and tracker.shutting_down is True
    tracker.job_new(JOB1, A)
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.SHUTDOWN)]
    tracker.job_removed(REBOOT, "shutdown.target", "canceled")
    assert tracker.shutting_down is False
    tracker.shutdown_read()
    assert tracker.shutdown_unheard(tracker.shutdown_jobs_heard()) is True
    assert tracker.shutting_down is False


def test_a_shutdown_whose_shutdown_target_went_unheard_ends_only_by_systemds_word() -> None:
    """The bus lost shutdown.target's JobNew, and reboot.target's job alone is cancelled:
    shutdown.target's goes on, and the host still reboots. Taken for ended, every comeback
    and refill was started, refused by systemd, until an audit read `stopping`. Its end is
    left to SystemState, read then (`shutdown_in_doubt`, once); shutdown.target's JobRemoved
    heard (an isolate's order: reboot.target's first) ends it, as does the same doubt where
    the shutdown was read (`shutdown_read`) rather than heard."""
    tracker = Model().tracker()
    tracker.job_new(REBOOT, "reboot.target")  # shutdown.target's JobNew lost
    tracker.job_removed(REBOOT, "reboot.target", "canceled")
    assert tracker.shutting_down is True
    stamp = tracker.shutdown_jobs_heard()
    assert tracker.shutdown_in_doubt() is True
    assert tracker.shutdown_in_doubt() is False  # told once
    assert tracker.shutdown_unheard(stamp) is True  # systemd: `running`
    assert tracker.shutting_down is False
    tracker.job_new(REBOOT, "reboot.target")
    tracker.job_removed(REBOOT, "reboot.target", "canceled")
    tracker.job_removed(JOB1, "shutdown.target", "canceled")
    assert tracker.shutting_down is False
    assert tracker.shutdown_in_doubt() is False  # ended since: no read owed
    tracker.shutdown_read()
    tracker.job_removed(REBOOT, "reboot.target", "dependency")
    assert tracker.shutting_down is True and tracker.shutdown_in_doubt() is True
    # heard in an earlier shutdown, it says nothing of this one
    tracker.job_removed(JOB1, "shutdown.target", "canceled")
    tracker.job_new(REBOOT, "reboot.target")
    tracker.job_removed(REBOOT, "reboot.target", "canceled")
    assert tracker.shutting_down is True and tracker.shutdown_in_doubt() is True


# -- RemainAfterExit=yes: active (exited) ---------------------------------------------------


def test_a_holder_kept_active_after_its_job_ended_is_told_exited_until_released() -> None:
    """Its main process ended and systemd keeps it active: told `Exited` (the controller
    then asks whether a process is left) at each signal until the core released it; then
    neither `Exited` nor `CameUp` (adopted again, it held its GPUs for ever), and its
    later stop by someone is told all the same, though the core no longer holds it."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    tracker.passed_gate(A)
    assert tracker.unit_changed(A, props("active", "running")) == []
    assert tracker.unit_changed(A, props("active", "exited")) == [Exited(A)]
    assert tracker.unit_changed(A, props("active", "exited"), read=True) == [Exited(A)]
    del model.phases[A]
    model.remained.add(A)
    assert tracker.unit_changed(A, props("active", "exited")) == []
    tracker.job_new(JOB1, A)
    assert tracker.unit_changed(A, props("deactivating", "stop", 1)) == []
    tracker.job_removed(JOB1, A, "done")
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.STOPPED)]


def test_a_released_unit_reloaded_is_no_new_run() -> None:
    """`systemctl reload` of a released unit (its ExecReload= runs, with no GPU: its env file
    names none): `reloading`, then `exited` again, is the same run: neither `CameUp` (the
    core booked it on a guessed GPU again) nor `Exited` (then said finished again)."""
    model = Model()
    model.remained.add(A)
    tracker = model.tracker()
    assert tracker.unit_changed(A, props("active", "exited")) == []
    assert tracker.unit_changed(A, props("reloading", "reload")) == []
    assert tracker.unit_changed(A, props("active", "exited")) == []


def test_a_unit_found_kept_active_that_the_core_does_not_know_is_adopted_then_told() -> None:
    model = Model()
    tracker = model.tracker()
    assert tracker.unit_changed(A, props("active", "exited")) == [CameUp(A), Exited(A)]
    model.phases[A] = Phase.STARTING
    assert tracker.unit_changed(A, props("active", "exited")) == [CameUp(A), Exited(A)]


def test_a_unit_that_exited_while_our_stop_was_on_its_way_is_told_its_stop_lost() -> None:
    """The core marked it (remained) and keeps it stopping: a stop that did not happen is
    told, so that it is released then (Scheduler.stop_failed)."""
    tracker = our_stop_sent()
    tracker.call_answered(A, None, "stop")
    assert tracker.unit_changed(A, props("active", "exited")) == [
        StopLost(A, "no stop job runs"),
        Exited(A),
    ]
    tracker.ledger.remained = lambda n: n == A
    assert tracker.unit_changed(A, props("active", "exited")) == [StopLost(A, "no stop job runs")]


@pytest.mark.parametrize("result", ["dependency", "assert", "timeout"])
def test_a_start_job_that_ran_nothing_is_a_failure_not_a_stop(result: str) -> None:
    """Systemd ends a start job before anything of its down unit runs (a `Requires=` unit
    failed, an `Assert*=`, `JobTimeoutSec=` while queued): someone's start of a waiter
    (announced queued) was taken for someone's stop (held: `... was stopped outside
    gpuslice`), and a comeback of ours for a run that ended (finished: its work never run
    again). Both failed; a later start that runs, or a later job (someone's stop: a hold),
    is judged on its own."""
    model = Model()
    model.waiters.add(A)
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    assert tracker.job_removed(JOB1, A, result) is True
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.FAILED)]
    model.waiters.clear()
    model.phases[A] = Phase.STARTING
    tracker = model.tracker()
    tracker.call_sent(A)
    tracker.job_new(JOB1, A)
    tracker.call_queued(A, JOB1, "start")
    assert tracker.job_removed(JOB1, A, result) is True
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.FAILED)]
    tracker.job_removed(JOB1, A, result)  # told, then up again: its next end is its own
    tracker.unit_changed(A, props("activating", "start-pre", 2))
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.EXITED)]
    model.phases.clear()  # a unit the core does not know: no down told, the failure kept
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    tracker.job_removed(JOB1, A, result)
    assert tracker.unit_changed(A, props("inactive", "dead", 0)) == []
    tracker.job_new(JOB2, A)  # then someone's stop of it: a hold, as any
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.STOPPED)]


@pytest.mark.parametrize("result", ["done", "timeout"])
def test_our_stop_of_a_unit_that_ended_meanwhile_is_no_start_that_ran_nothing(result: str) -> None:
    """A ends by itself while our stop is on its way; systemd queues the stop for A down
    anyway, which may wait behind another unit's stop past A's `JobTimeoutSec=` and end
    `timeout`, a result of a start that ran nothing. Ours is a stop: A ended by itself
    (finished, as when the stop ends `done`), not a start that failed."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    assert tracker.unit_changed(A, props("active", "running")) == []
    model.phases[A] = Phase.STOPPING
    tracker.call_sent(A)
    assert tracker.unit_changed(A, props("inactive", "dead")) == []  # our answer awaited
    tracker.job_new(JOB1, A)
    tracker.call_queued(A, JOB1, "stop")
    assert tracker.unit_changed(A, props("inactive", "dead", 1)) == []
    assert tracker.job_removed(JOB1, A, result) is True
    assert tracker.unit_changed(A, props("inactive", "dead")) == [
        WentDown(A, Outcome.EXITED, by_itself=True, not_ours=True)
    ]


def test_a_start_that_ran_nothing_after_a_failure_told_is_told_again() -> None:
    """A failed (told), then someone's start of it, a waiter (announced queued), that systemd
    ends before anything runs (a `Requires=` unit failed): A is still `failed`, but this is
    a down of its own, told (the waiter's start failed). Kept as the failure told before
    while the job was queued, the waiter was left waiting for a start that had ended."""
    model = Model()
    model.phases[A] = Phase.RUNNING
    tracker = model.tracker()
    assert tracker.unit_changed(A, props("failed", "failed")) == [WentDown(A, Outcome.FAILED)]
    model.phases.clear()
    model.waiters.add(A)
    tracker.job_new(JOB1, A)
    assert tracker.unit_changed(A, props("failed", "failed", 1)) == []
    assert tracker.job_removed(JOB1, A, "dependency") is True
    assert tracker.unit_changed(A, props("failed", "failed")) == [WentDown(A, Outcome.FAILED)]


def checked(active: str, sub: str, job: int, passed: object, at: object) -> dict[str, object]:
    """PropertiesChanged with the unit's last `Condition*=` check (systemd sends it with
    every change of the unit)."""
    return {**props(active, sub, job), "ConditionResult": passed, "ConditionTimestampMonotonic": at}


def test_a_start_its_condition_skips_is_no_stop_and_a_comeback_of_ours_is_said_skipped() -> None:
    """A start job a false `Condition*=` skips ends `done` with the unit down, as a stop of a
    unit down does, and JobNew names no type: taken for someone's stop, the unit was held
    (`... was stopped outside gpuslice`) and a comeback of ours said finished. The failed
    check, newer than any seen, comes before the job's end: a skip (SKIPPED), no stop. A
    stop of it later shows the same check: a stop (held), as is one whose check passed."""
    model = Model()
    tracker = model.tracker()
    tracker.job_new(JOB1, A)  # someone's start, unknown to the core: nothing told
    assert tracker.unit_changed(A, checked("inactive", "dead", 1, False, 100)) == []
    assert tracker.job_removed(JOB1, A, "done") is True
    assert tracker.unit_changed(A, checked("inactive", "dead", 0, False, 100)) == []
    assert tracker.outcome(tracker.state(A)) is Outcome.SKIPPED
    tracker.job_new(JOB2, A)  # then someone's stop of it: the check shown is the one seen
    tracker.unit_changed(A, checked("inactive", "dead", 2, False, 100))
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, checked("inactive", "dead", 0, False, 100)) == [
        WentDown(A, Outcome.STOPPED)
    ]
    model.phases[A] = Phase.STARTING  # a comeback of ours
    tracker = model.tracker()
    tracker.call_sent(A)
    tracker.job_new(JOB1, A)
    tracker.call_queued(A, JOB1, "start")
    tracker.unit_changed(A, checked("inactive", "dead", 1, False, 100))
    tracker.job_removed(JOB1, A, "done")
    assert tracker.unit_changed(A, checked("inactive", "dead", 0, False, 100)) == [
        WentDown(A, Outcome.SKIPPED)
    ]
    tracker.call_sent(A)  # again: its check passes, and the start runs (a oneshot) and ends
    tracker.job_new(JOB2, A)
    tracker.call_queued(A, JOB2, "start")
    tracker.unit_changed(A, checked("activating", "start-pre", 2, True, 200))
    tracker.unit_changed(A, checked("active", "running", 2, True, 200))
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, checked("inactive", "dead", 0, True, 200)) == [
        WentDown(A, Outcome.EXITED, by_itself=True)
    ]


def test_only_a_new_failed_check_since_the_jobs_announce_makes_a_skip() -> None:
    """A check older than one seen (an answer read late), one seen before the job was
    announced, or properties not of systemd's types (a boolean, a u64) make no skip: the
    stop of a unit down stays someone's stop (held)."""
    model = Model()
    for before, shown in [
        ((True, 300), (False, 200)),  # older than the check seen
        ((False, 300), (False, 300)),  # the check seen before the job was announced
        (None, ("no", 300)),
        (None, (False, "300")),
        (None, (False, True)),
        (None, (0, 300)),
    ]:
        tracker = model.tracker()
        if before is not None:
            tracker.unit_changed(A, checked("inactive", "dead", 0, *before))
        tracker.job_new(JOB1, A)
        tracker.unit_changed(A, checked("inactive", "dead", 1, *shown))
        tracker.job_removed(JOB1, A, "done")
        down = tracker.unit_changed(A, checked("inactive", "dead", 0, *shown))
        assert down == [WentDown(A, Outcome.STOPPED)], (before, shown)
    tracker = model.tracker()  # failed, but before this job's JobNew: its check is to come
    tracker.unit_changed(A, checked("inactive", "dead", 0, False, 300))
    tracker.job_new(JOB1, A)
    tracker.job_removed(JOB1, A, "done")
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.STOPPED)]


def skipped_or_stopped(tracker: Tracker, job: str, check: tuple[bool, int] | None) -> Outcome:
    """A job of a unit down announced, a check shown (or none), the job ended `done`: what
    the down after it is taken for (told, or the outcome of its state where none is)."""
    tracker.job_new(job, A)
    if check is not None:
        tracker.unit_changed(A, checked("inactive", "dead", int(job.rsplit("/", 1)[1]), *check))
    tracker.job_removed(job, A, "done")
    down = tracker.unit_changed(A, props("inactive", "dead"))
    if not down:
        return tracker.outcome(tracker.state(A))
    [event] = down
    assert isinstance(event, WentDown)
    return event.outcome


def test_a_check_is_new_from_its_first_microsecond_and_a_newer_pass_clears_a_fail() -> None:
    """The first check seen of a unit is new at any time above 0 (1 µs too): failed, a
    skip. A newer check that passed, shown before the job ends, says the start ran its
    check through: the job's end is a stop."""
    model = Model()
    assert skipped_or_stopped(model.tracker(), JOB1, (False, 1)) is Outcome.SKIPPED
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    tracker.unit_changed(A, checked("inactive", "dead", 1, False, 100))
    tracker.unit_changed(A, checked("inactive", "dead", 1, True, 200))
    tracker.job_removed(JOB1, A, "done")
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.STOPPED)]


def test_a_forgotten_unit_keeps_no_check_nor_job_of_its_condition() -> None:
    """forget drops a unit's checks: one seen before is no older answer for a unit systemd
    unloaded since (its checks start again at 0); a failed one, or the job it ran its
    `ExecCondition=` in, skips no job heard of it after."""
    model = Model()
    tracker = model.tracker()
    assert skipped_or_stopped(tracker, JOB1, (True, 300)) is Outcome.STOPPED
    assert tracker.forget(A)
    assert skipped_or_stopped(tracker, JOB2, (False, 50)) is Outcome.SKIPPED
    tracker = model.tracker()  # a failed check, then forgotten before its job's end
    tracker.job_new(JOB1, A)
    tracker.unit_changed(A, checked("inactive", "dead", 1, False, 100))
    assert tracker.forget(A)
    tracker.job_removed(JOB1, A, "done")
    tracker.unit_changed(A, props("inactive", "dead"))
    assert tracker.outcome(tracker.state(A)) is not Outcome.SKIPPED
    tracker = model.tracker()  # down in its ExecCondition=, forgotten before its job's end
    tracker.job_new(JOB1, A)
    tracker.unit_changed(A, jobbed("activating", "condition", JOB1))
    tracker.unit_changed(A, jobbed("inactive", "dead", JOB1))
    assert tracker.forget(A)
    tracker.job_removed(JOB1, A, "done")
    tracker.unit_changed(A, props("inactive", "dead"))
    assert tracker.outcome(tracker.state(A)) is not Outcome.SKIPPED


def test_a_failed_check_is_said_of_the_job_that_ends_next_alone() -> None:
    """Two jobs announced (someone's start, then a stop) and a failed check: the check is
    said of the first job to end (here cancelled); the other's end `done` after it is a
    stop, held, not a skip."""
    model = Model()
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    tracker.job_new(JOB2, A)
    tracker.unit_changed(A, checked("inactive", "dead", 1, False, 100))
    tracker.job_removed(JOB1, A, "canceled")
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.STOPPED)]


def jobbed(active: str, sub: str, job: str) -> dict[str, object]:
    """PropertiesChanged naming the job the unit shows, as systemd does."""
    return {"ActiveState": active, "SubState": sub, "Job": [int(job.rsplit("/", 1)[1]), job]}


def test_a_start_its_exec_condition_skips_is_no_stop_and_one_past_it_runs_as_any() -> None:
    """`ExecCondition=` says no (exit 1-254): the unit leaves `activating (condition)` for
    `inactive` and its start job ends `done`. Taken for someone's stop, it was held
    (`... was stopped outside gpuslice`), a comeback of ours said finished: a skip. One
    stopped by someone in its `ExecCondition=` is a stop (their job, not the start's, ends
    it); a oneshot past it ends `done` with the same start job, a run that ended."""
    model = Model()
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    assert tracker.unit_changed(A, jobbed("activating", "condition", JOB1)) == []
    tracker.unit_changed(A, jobbed("inactive", "dead", JOB1))
    tracker.job_removed(JOB1, A, "done")
    assert tracker.unit_changed(A, props("inactive", "dead")) == []
    assert tracker.outcome(tracker.state(A)) is Outcome.SKIPPED
    model.phases[A] = Phase.STARTING  # a comeback of ours: said skipped
    tracker = model.tracker()
    tracker.call_sent(A)
    tracker.job_new(JOB1, A)
    tracker.call_queued(A, JOB1, "start")
    tracker.unit_changed(A, jobbed("activating", "condition", JOB1))
    tracker.unit_changed(A, jobbed("inactive", "dead", JOB1))
    tracker.job_removed(JOB1, A, "done")
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.SKIPPED)]
    model.phases.clear()
    tracker = model.tracker()  # someone's stop in its ExecCondition=: a hold
    tracker.job_new(JOB1, A)
    tracker.unit_changed(A, jobbed("activating", "condition", JOB1))
    tracker.job_new(JOB2, A)
    tracker.job_removed(JOB1, A, "canceled")
    tracker.unit_changed(A, jobbed("inactive", "dead", JOB2))
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.STOPPED)]
    model.phases[A] = Phase.STARTING  # a oneshot of ours past it: ran, and ended
    tracker = model.tracker()
    tracker.call_sent(A)
    tracker.job_new(JOB1, A)
    tracker.call_queued(A, JOB1, "start")
    tracker.unit_changed(A, jobbed("activating", "condition", JOB1))
    tracker.unit_changed(A, jobbed("activating", "start-pre", JOB1))
    model.phases[A] = Phase.RUNNING
    tracker.unit_changed(A, jobbed("activating", "start", JOB1))
    tracker.unit_changed(A, jobbed("inactive", "dead", JOB1))
    tracker.job_removed(JOB1, A, "done")
    [down] = tracker.unit_changed(A, props("inactive", "dead"))
    assert isinstance(down, WentDown) and down.outcome is Outcome.EXITED


def test_a_stop_shown_in_the_exec_condition_it_stops_is_still_a_stop() -> None:
    """Someone's stop of a unit in its `ExecCondition=`: systemd installs the stop job (the
    start's ends `canceled`) and signals the unit still `activating (condition)`, now with
    the stop job, before that job runs; the unit then goes `inactive` with it (its
    `deactivating` folded in while the bus is busy, or none: the stop job queued behind
    another while the check ends). The unit leaves its ExecCondition= with the stop, not
    the start it entered it with: a stop (held), not a skip. Taken for a skip, a preempted
    unit someone started, then stopped there, was still owed its comeback, and gpuslice
    started it again against that stop."""
    model = Model()
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    tracker.unit_changed(A, jobbed("activating", "condition", JOB1))
    tracker.job_new(JOB2, A)
    tracker.job_removed(JOB1, A, "canceled")
    tracker.unit_changed(A, jobbed("activating", "condition", JOB2))
    tracker.unit_changed(A, jobbed("inactive", "dead", JOB2))
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props("inactive", "dead")) == [WentDown(A, Outcome.STOPPED)]


def waiting_at_its_gate() -> tuple[Model, Tracker]:
    """A, someone's start (job 1), waits at its gate: a waiter of the core's."""
    model = Model()
    tracker = model.tracker()
    tracker.job_new(JOB1, A)
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 1)) == [ReachedGate(A)]
    model.waiters.add(A)
    return model, tracker


def test_a_waiter_someone_stops_at_its_gate_is_told_down_at_its_stops_job_new() -> None:
    """`systemctl stop a` of a waiter at its gate: its start ends `canceled`, the stop's JobNew
    follows; its PropertiesChanged (the stop job, still `start-pre` until its gate is killed)
    may come after other units' signals. Down for the core from the JobNew: a waiter until
    its down, it preempted B for a refusal's job that ended meanwhile. Its down is not told
    again, nor its gate again while it is being stopped."""
    model, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    assert tracker.stopped_at_gate(A) == []  # no job replaced it yet
    tracker.job_new(JOB2, A)
    assert tracker.stopped_at_gate(A) == [WentDown(A, Outcome.STOPPED, job=JOB2)]
    assert tracker.leaving(A)
    model.waiters.discard(A)
    assert tracker.stopped_at_gate(A) == []  # once
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 2)) == []
    assert tracker.unit_changed(A, props_of("deactivating", "stop-sigterm", 2)) == []
    tracker.job_removed(JOB2, A, "done")
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == []
    assert not tracker.leaving(A)
    # its next start is a start as any
    tracker.job_new(JOB3, A)
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 3)) == [ReachedGate(A)]


def test_a_job_at_the_gate_that_replaced_no_start_is_no_stop() -> None:
    """A job announced while the start still runs at its gate merged into nothing (systemd
    replaces a running start only with a stop; a no-op job is announced beside it), and a
    start after `systemctl cancel` (its start ended `canceled`, the unit shown with no job,
    its ExecStartPre= still running) is a start: neither tells the waiter down. Nor does a
    job while a call of ours is unanswered (it may be ours)."""
    _, tracker = waiting_at_its_gate()
    tracker.job_new(JOB2, A)  # a no-op job, its start still shown
    assert tracker.stopped_at_gate(A) == []
    _, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")  # `systemctl cancel`
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 0)) == []
    tracker.job_new(JOB2, A)  # `systemctl start a` again
    assert tracker.stopped_at_gate(A) == []
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 2)) == []
    assert not tracker.leaving(A)
    _, tracker = waiting_at_its_gate()
    tracker.call_sent(A)
    tracker.job_removed(JOB1, A, "canceled")
    tracker.job_new(JOB2, A)
    assert tracker.stopped_at_gate(A) == []
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 2)) == []


def test_a_waiter_told_down_at_its_gate_waits_again_when_a_start_replaced_its_stop() -> None:
    """The stop had not run when someone's start replaced it (systemd runs its queue after
    the calls it has read): the unit never left its gate, and waits there again with a new
    start job. Left told down, its gate was never served: stuck. Shown by its signal, or,
    that signal lost, by a read, which names the job's type."""
    model, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    tracker.job_new(JOB2, A)
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 2)) == [
        WentDown(A, Outcome.STOPPED, job=JOB2)
    ]
    model.waiters.discard(A)
    tracker.job_removed(JOB2, A, "canceled")
    tracker.job_new(JOB3, A)
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 3)) == [ReachedGate(A)]
    assert not tracker.leaving(A)
    # the read: a stop job keeps it leaving; a start job (or none known) has it wait again
    model, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    tracker.job_new(JOB2, A)
    assert tracker.stopped_at_gate(A) == [WentDown(A, Outcome.STOPPED, job=JOB2)]
    model.waiters.discard(A)
    assert not tracker.leaving_read(A, UnitState(A, "activating", "start-pre", 2, "stop"))
    assert not tracker.leaving_read(A, UnitState(A, "deactivating", "stop-sigterm", 2, "stop"))
    assert tracker.leaving(A)
    assert tracker.leaving_read(A, UnitState(A, "activating", "start-pre", 3, "start"))
    assert not tracker.leaving(A)
    # the job that took it down before its gate counts no more: its next down is its own
    tracker.passed_gate(A)
    model.phases[A] = Phase.RUNNING
    tracker.unit_changed(A, props_of("active", "running", 0))
    assert tracker.unit_changed(A, props_of("inactive", "dead", 0)) == [
        WentDown(A, Outcome.EXITED, by_itself=True)
    ]


def test_a_waiter_told_down_at_its_gate_waits_again_when_its_stop_is_cancelled() -> None:
    """`systemctl cancel` of the stop before it ran: the unit, shown at its gate with no
    job, goes on there: it waits again."""
    model, tracker = waiting_at_its_gate()
    tracker.job_removed(JOB1, A, "canceled")
    tracker.job_new(JOB2, A)
    assert tracker.stopped_at_gate(A) == [WentDown(A, Outcome.STOPPED, job=JOB2)]
    model.waiters.discard(A)
    tracker.job_removed(JOB2, A, "canceled")
    assert tracker.unit_changed(A, props_of("activating", "start-pre", 0)) == [ReachedGate(A)]
    assert not tracker.leaving(A)
