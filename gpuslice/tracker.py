"""Systemd's signals about managed units, turned into the core's events.

Pure code (no D-Bus, no asyncio): the controller feeds it what systemd said (JobNew,
JobRemoved, a unit's ActiveState/SubState/Job) and what its own StartUnit/StopUnit calls
answered; the tracker says what happened to a unit in the core's terms: it went down (and
how), it runs past the gate, its job ended where systemd keeps it active, or a stop
gpuslice asked for is not going to happen. Which jobs are ours decides "stopped by
someone" (a hold) from "preempted" or "finished".
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuslice.core.scheduler import Outcome, Phase

# soft-reboot.target (systemd 254+) stops every unit as a reboot does; its
# systemd-soft-reboot.service pulls in shutdown.target too
SHUTDOWN_TARGETS = frozenset(
    {
        "shutdown.target",
        "reboot.target",
        "poweroff.target",
        "halt.target",
        "kexec.target",
        "soft-reboot.target",
    }
)
# how a shutdown target's job may end with the host still going down: it ran, or it timed
# out and the target's JobTimeoutAction= (reboot-force, poweroff-force, ...) forces it down
SHUTDOWN_GOES_ON = frozenset({"done", "timeout"})


@dataclass(frozen=True)
class UnitState:
    """The part of a unit's state the controller decides on."""

    name: str
    active: str
    sub: str
    job_id: int
    job_type: str = ""  # of the job queued for it (ListUnits says; signals do not)


# The object paths systemd gives its jobs (job_number reads one; systemd.job_path makes one)
JOB_PREFIX = "/org/freedesktop/systemd1/job/"

# A unit's ActiveState once its processes are gone.
GONE = ("inactive", "failed")

# How systemd ends a start job that ran nothing of its unit, left down (JobRemoved's result):
# a dependency failed, an `Assert*=` did not hold, `JobTimeoutSec=` ran out while it was
# queued. No stop job of a unit that is down ends so (one ends `done` at once), so such a
# job is no one's stop: taken for one, the unit was held (`... was stopped outside
# gpuslice`), and a comeback of ours said finished, its work never run again. A start a
# `Condition*=` skipped ends `done`, as a stop does: told apart by the failed check the
# unit's PropertiesChanged shows first (`Tracker._condition_checked`).
START_NOT_RUN = frozenset({"dependency", "assert", "timeout", "skipped", "invalid", "once"})

# Jobs that run a unit's ExecStartPre=, and so its gate.
START_JOBS = frozenset({"start", "restart"})

# A service its Restart= starts again (ActiveState `activating`, no process of its run left):
# `auto-restart` until RestartSec= is over; systemd 254 and later then show
# `auto-restart-queued` while the restart's start job waits to run (252 stays in
# `auto-restart`). Taken for running, a queued restart was adopted on a GPU before its gate.
RESTARTING = frozenset({"auto-restart", "auto-restart-queued"})


# how Tracker._told_down names a down told in auto-restart (or auto-restart-queued)
RESTARTING_TOLD = "auto-restart"


def restarting(state: UnitState) -> bool:
    """Down, waiting for its Restart= to start it again."""
    return state.sub in RESTARTING


# systemd 254 and later: a service its Restart= starts again is `inactive` or `failed` in
# these for an instant, signalled before `auto-restart` (RestartMode=direct skips them).
# Its ActiveState says how it ended; it ended by itself (no stop is followed by a restart).
BEFORE_RESTART = frozenset({"dead-before-auto-restart", "failed-before-auto-restart"})


def restart_coming(state: UnitState) -> bool:
    """Down, and its Restart= starts it again: in `auto-restart`, or just before it."""
    return restarting(state) or state.sub in BEFORE_RESTART


# How a service's main process last ended (its ExecMainCode=): waitid()'s si_code, as
# systemd records it; 0 while it runs or when it never ran.
CLD_EXITED = 1
CLD_KILLED = 2
CLD_DUMPED = 3


@dataclass(frozen=True)
class MainExit:
    """How a service's main process last ended, as systemd recorded it: ExecMainCode=
    (CLD_*), ExecMainStatus= (its exit status, or the signal's number), the unit's Result=."""

    code: int
    status: int
    result: str


def stopped_by_a_job(state: UnitState, main: MainExit) -> bool:
    """Whether a service found down with no job, no signal of its end heard (the controller
    was away), was stopped rather than ended by itself: its main process died of a signal and
    systemd left it `inactive`, Result=success. A signal outside a stop job fails it
    (Result=signal), unless it is one systemd takes for a clean end (SuccessExitStatus=, or
    SIGHUP, SIGINT, SIGTERM, SIGPIPE for a daemon): only someone's `kill` sends those. One that
    exited with a code is not told apart from one that ended by itself (it may have trapped
    the stop's SIGTERM and exited 0)."""
    return (
        state.active == "inactive"
        and state.job_id == 0
        and main.result == "success"
        and main.code in (CLD_KILLED, CLD_DUMPED)
    )


class Kind(enum.Enum):
    RUNNING = "running"  # past the gate (or active): it uses its GPUs
    GATE = "gate"  # in ExecStartPre=, where the gate waits
    DOWN = "down"  # released its GPUs
    TRANSITION = "transition"  # on its way down, or a job is still queued


def classify(state: UnitState) -> Kind:
    if state.active in ("active", "reloading"):
        return Kind.RUNNING
    if state.active == "activating":
        if restarting(state):
            return Kind.DOWN
        return Kind.GATE if state.sub in ("start-pre", "condition") else Kind.RUNNING
    if state.active in GONE and state.job_id == 0:
        return Kind.DOWN
    return Kind.TRANSITION


def _down_told(state: UnitState, kind: Kind) -> str | None:
    """The state a down is told once in, and not again while it lasts: auto-restart
    (RESTARTING_TOLD), or its ActiveState (`failed`, `inactive`) once down; None for any
    other, not kept as told."""
    if restarting(state):
        return RESTARTING_TOLD
    return state.active if kind is Kind.DOWN and state.active in GONE else None


def _same_down(told: str | None, down: str) -> bool:
    """Whether a down in `down` (`_down_told`) is the one told in `told`: the same state,
    or the `auto-restart` that follows a `failed` or `inactive` (systemd 252's order for a
    failure and for a clean exit its Restart= restarts; 254's `*-before-auto-restart`).
    `failed` after auto-restart (its start limit), `inactive` after it (a stop) or after
    `failed` (`systemctl reset-failed`, which ends a keep: Scheduler.inactive) is a new
    down."""
    return told == down or (told in GONE and down == RESTARTING_TOLD)


def job_number(path: str) -> int:
    """The number of the job systemd named by this object path (0: none, or not a job's)."""
    number = path.rsplit("/", 1)[-1]
    digits = number.isascii() and number.isdigit()
    return int(number) if path.startswith(JOB_PREFIX) and digits else 0


def at_condition(state: UnitState) -> bool:
    """In its `ExecCondition=`, which systemd runs before every `ExecStartPre=`, the gate's
    included: the start may yet be skipped (an exit of 1-254), so it is no start known yet
    (ReachedGate comes at `start-pre`). Taken for one, it preempted a less urgent holder for
    a start that never ran (with `Requeue=no`, for good)."""
    return state.active == "activating" and state.sub == "condition"


def bound_for_gate(state: UnitState) -> bool:
    """The unit waits at its gate, or a start job queued for it will run the gate soon
    (behind the controller's own start, after a restart of it)."""
    if classify(state) is Kind.GATE:
        return True
    down = state.active in GONE or restarting(state)
    return down and state.job_id != 0 and state.job_type in START_JOBS


@dataclass(frozen=True)
class WentDown:
    """`by_itself`: it left running with no job of anyone's (its main process ended), so a
    stop of ours that came after took nothing from it: its work is done, not cut."""

    unit: str
    outcome: Outcome
    by_itself: bool = False
    # a stop of ours was sent but did not end it: it went down before systemd announced our
    # stop's job, or systemd merged our stop into someone's stop announced before we sent it
    not_ours: bool = False
    # failed as the host went down, told only after the shutdown's cancel (the shutdown's
    # stop job still shown, our call's answer awaited): the core judges it as in the shutdown
    in_shutdown: bool = False
    # the path of the job it left running with ("/": none known): a stop systemd queued
    # along with one of ours has a later id than ours (Controller._stop_before); not
    # compared, a detail of the down
    job: str = field(default="/", compare=False)


@dataclass(frozen=True)
class CameUp:
    """Systemd shows the unit running past the gate."""

    unit: str


@dataclass(frozen=True)
class ReachedGate:
    """Systemd shows the unit in its start-pre phase, where the gate runs: its gate asks in
    a few milliseconds. Known now, it is served in order with every other start known, and
    the units it preempts are stopped while its gate starts."""

    unit: str


@dataclass(frozen=True)
class Exited:
    """Systemd keeps the unit active after its main process ended (`RemainAfterExit=yes`:
    SubState `exited`): its GPUs may go, once no process is left in it (the controller
    asks systemd)."""

    unit: str


def remains_active(state: UnitState) -> bool:
    """Active with its main process ended (`RemainAfterExit=yes`)."""
    return state.active == "active" and state.sub == "exited"


def still_released(state: UnitState) -> bool:
    """A unit released while systemd kept it active (Scheduler.remained) is still in that
    run: active, or reloading (its ExecReload=, with no GPU: Delivery.tell_none). Only its
    stop or restart ends that run; taken for a new one, a reload booked it on GPUs again."""
    return state.active in ("active", "reloading")


@dataclass(frozen=True)
class StopLost:
    """A stop gpuslice asked for ended and the unit still runs (its stop job was cancelled
    or failed, or the request was lost while the controller was away)."""

    unit: str
    why: str


Change = WentDown | CameUp | ReachedGate | StopLost | Exited


class Ledger:
    """What the tracker needs to know of the scheduler's view of a unit."""

    def __init__(
        self,
        phase: Callable[[str], Phase | None],
        waiting: Callable[[str], bool],
        away: Callable[[str], bool] = lambda _: False,
        remained: Callable[[str], bool] = lambda _: False,
    ) -> None:
        """`away`: a comeback of ours at its gate that the core neither holds nor queues
        yet (Scheduler.requeued_away): its down is told all the same. `remained`: finished
        and kept active by systemd, its GPUs released (Scheduler.remained): told `Exited`
        no more, and its down is told all the same (the core forgets it then)."""
        self.phase = phase
        self.waiting = waiting
        self.away = away
        self.remained = remained


class Tracker:
    """Systemd's view of the managed units, and which of their jobs are ours."""

    def __init__(self, managed: Callable[[str], bool], ledger: Ledger) -> None:
        self.managed = managed
        self.ledger = ledger
        self.states: dict[str, UnitState] = {}
        self.shutting_down = False
        # how many jobs of the shutdown targets were heard: a read of whether the host goes
        # down is believed only if none was heard while it was answered (`shutdown_unheard`)
        self._shutdown_jobs = 0
        # how many JobNews of shutdown.target were heard (`shutdown_queued`)
        self._shutdown_queued = 0
        # the jobs of shutdown targets announced and not yet ended: `systemctl cancel` of one
        # (reboot.target's) leaves the others (shutdown.target's), and the host goes down
        self._shutdown_pending: set[str] = set()
        # a signal of shutdown.target's job was heard in this shutdown: without one, the end
        # of the others says nothing of it (its JobNew lost), and SystemState is read instead
        self._shutdown_target_heard = False
        self._shutdown_doubted = False  # that read is owed (`shutdown_in_doubt`)
        # jobs systemd announced for a unit since it last passed the gate (or went down),
        # each with the stamp of its JobNew
        self._unit_jobs: dict[str, dict[str, int]] = {}
        self._gate_seen: dict[str, int] = {}  # the stamp of the signal that showed it at its gate
        # unit -> the state its down was told in (`failed`, `inactive`, or RESTARTING_TOLD:
        # in auto-restart), while it is still there: told once (`_same_down`). systemd 252
        # signals `failed` (or `inactive`, a clean exit), then `auto-restart`, of one down;
        # the GPUs kept meanwhile (Scheduler.inactive) make it no holder's down to tell again
        self._told_down: dict[str, str] = {}
        self._sent: dict[str, list[int]] = {}  # stamps of our calls not yet answered, in order
        self._own_jobs: dict[str, str] = {}  # job path -> "start" | "stop", from our calls
        self._stop_results: dict[str, str] = {}  # unit -> how our stop job for it ended
        # units whose last job was a start that ran nothing of them (START_NOT_RUN, or one a
        # `Condition*=` skipped), with how their down is told (FAILED, SKIPPED), until told,
        # up again or another job comes
        self._start_failed: dict[str, Outcome] = {}
        # the newest ConditionTimestampMonotonic a signal showed of each unit, and the units
        # whose check since their last job's end failed (`_condition_checked`)
        self._checked_at: dict[str, int] = {}
        self._check_failed: set[str] = set()
        # unit -> the job it entered its `ExecCondition=` with, until it is past it
        self._condition_job: dict[str, str] = {}
        self._in_flight: dict[str, int] = {}  # our StartUnit/StopUnit calls not yet answered
        self._deferred: set[str] = set()  # went down while a call of ours was in flight
        # when systemd last spoke of each unit, to drop stale reads: a stamp from one count
        # for all units, so that a unit forgotten and heard of again never shows an old one
        self._stamps = itertools.count(1)
        self._signals: dict[str, int] = {}  # its last signal's stamp
        self._answers: dict[str, int] = {}  # its last answer's to a call of ours
        self._job_paths: dict[str, str] = {}  # unit -> the job path its last signal named
        self._by_itself: set[str] = set()  # left running with no job since its gate, not to restart
        self._not_ours: set[str] = set()  # down, but not by our stop (WentDown.not_ours)
        self._down_at: dict[str, int] = {}  # the stamp of a down deferred to our answer
        # went down while the host was going down, told maybe after its cancel (`outcome`)
        self._down_in_shutdown: set[str] = set()
        # unit -> when the first stop of ours that got no answer was sent (`stop_found`)
        self._unanswered_stops: dict[str, int] = {}
        # unit -> the job a signal named as it left running or its gate: the one that takes
        # it down, whose JobRemoved ends it (`_theirs_first`)
        self._taken_down_by: dict[str, str] = {}
        # unit -> the number of the start job it showed at its gate, ended `canceled` there:
        # replaced by a stop, whose JobNew is next (`_stop_at_gate`), or cancelled
        self._cancelled_at_gate: dict[str, int] = {}
        # units shown at their gate with no job (`systemctl cancel` of their start, which
        # goes on): the next job shown there is a start (`_stop_at_gate`)
        self._jobless_at_gate: set[str] = set()
        # unit -> someone's stop job seen at its gate, its waiter told down at once
        # (`stopped_at_gate`), until that down comes
        self._leaving: dict[str, str] = {}

    # -- systemd's signals ----------------------------------------------------------------

    def job_new(self, path: str, unit: str) -> None:
        if unit in SHUTDOWN_TARGETS:
            if not self.shutting_down:
                self._shutdown_target_heard = False  # a new shutdown
            self.shutting_down = True
            self._shutdown_jobs += 1
            self._shutdown_pending.add(path)
        if unit == "shutdown.target":
            self._shutdown_queued += 1
            self._shutdown_target_heard = True
        if self.managed(unit):
            self._count(unit)
            self._unit_jobs.setdefault(unit, {})[path] = self._signals[unit]
            self._start_failed.pop(unit, None)  # said of a job before this one
            self._check_failed.discard(unit)  # its check comes after its JobNew, if at all
            kept = self.ledger.phase(unit) is Phase.STARTING  # its GPUs kept for its restart
            if self._told_down.get(unit) == "inactive" and not kept:
                # a job for it ends the clean down told (a stop: held; a start: cancelled);
                # one kept for its restart: the restart's job (RestartSec=0), maybe heard
                # before the `auto-restart` that is still the same down
                del self._told_down[unit]

    def shutdown_jobs_heard(self) -> int:
        """A stamp that moves with every job of a shutdown target heard."""
        return self._shutdown_jobs

    def shutdown_unheard(self, stamp: int) -> bool:
        """systemd says (read when `shutdown_jobs_heard` was `stamp`) that the host is not
        going down, where its signals left us thinking it was: the JobRemoved of a cancelled
        shutdown was lost on the bus. Taken in (True) unless a shutdown job was heard since."""
        if not self.shutting_down or stamp != self._shutdown_jobs:
            return False
        self.shutting_down = False
        self._shutdown_pending.clear()
        return True

    def shutdown_in_doubt(self) -> bool:
        """Whether a shutdown's last known job ended undone, no signal of shutdown.target's
        job heard: the host goes down still, unless systemd's SystemState, read now, says
        otherwise (`shutdown_unheard`). Told once."""
        doubted, self._shutdown_doubted = self._shutdown_doubted, False
        return doubted and self.shutting_down

    def shutdown_queued(self) -> int:
        """A stamp that moves with each JobNew of shutdown.target: every shutdown queues its
        start job anew, but one queued while another's is pending (`systemctl poweroff`
        after `systemctl reboot`) is merged into that one's, with no JobNew."""
        return self._shutdown_queued

    def shutdown_read(self) -> None:
        """systemd's SystemState says the host is going down, where no JobNew of a shutdown
        target was heard: the bus lost it. Taken in as that JobNew would have been (a read
        of the host as running, sent before, is not believed: `shutdown_unheard`)."""
        if not self.shutting_down:
            self._shutdown_target_heard = False  # shutdown.target's JobNew among those lost
        self.shutting_down = True
        self._shutdown_jobs += 1

    def job_removed(self, path: str, unit: str, result: str) -> bool:
        """Whether the unit's state must be read again: a job that changed nothing sends
        no PropertiesChanged."""
        if unit in SHUTDOWN_TARGETS:
            self._shutdown_jobs += 1
            self._shutdown_pending.discard(path)
            self._shutdown_target_heard |= unit == "shutdown.target"
            # a cancelled shutdown must not disable holds for good; one of its jobs cancelled
            # (`systemctl cancel`) while another goes on is no cancelled shutdown. The last
            # one failed (`dependency`: a job it required did) ends it too: systemd-reboot
            # never ran, and the host stays up with its units stopped, as after a cancel.
            # Every shutdown queues shutdown.target's job: where none of its signals was
            # heard, it may go on (reboot.target's alone cancelled, shutdown.target's JobNew
            # lost): SystemState, read now, says (`shutdown_in_doubt`). Taken for ended,
            # the host rebooted while gpuslice started units, each refused by systemd
            if result not in SHUTDOWN_GOES_ON and not self._shutdown_pending:
                if self._shutdown_target_heard or not self.shutting_down:
                    self.shutting_down = False
                else:
                    self._shutdown_doubted = True
        if self._own_jobs.get(path) == "stop" and result != "done":
            self._stop_results[unit] = result
        if path not in self._unit_jobs.get(unit, ()):
            self._own_jobs.pop(path, None)  # already accounted for: keep the table small
        if not self.managed(unit):
            return False
        shown = self.state(unit)
        if (
            result == "canceled"
            and classify(shown) is Kind.GATE
            and job_number(path) == shown.job_id
        ):
            self._cancelled_at_gate[unit] = shown.job_id
        down = self.state(unit).active in GONE
        # its start's check failed: systemd skipped it (a stop of a unit down checks nothing);
        # or it left its `ExecCondition=` for down with the start job it ran that in, which
        # ends `done`: the condition said no (someone's stop of it ends another job)
        skipped = result == "done" and (
            unit in self._check_failed or self._condition_job.get(unit) == path
        )
        self._check_failed.discard(unit)  # said of this job's check
        self._condition_job.pop(unit, None)
        if (result in START_NOT_RUN or skipped) and down and self._own_jobs.get(path) != "stop":
            # a start that ran nothing (`outcome`): no stop
            self._start_failed[unit] = Outcome.SKIPPED if skipped else Outcome.FAILED
            self._unit_jobs.get(unit, {}).pop(path, None)
            self._own_jobs.pop(path, None)
        if result == "canceled" and path not in self._own_jobs and down:
            # queued for a unit down, it did nothing to it (a cancelled shutdown's stop
            # job, `systemctl cancel`, a start replaced): no stop of anyone's, so no hold;
            # a job that replaced it is announced itself. One cancelled while the unit ran
            # or waited at its gate may have begun to stop it, and still says who did
            self._unit_jobs.get(unit, {}).pop(path, None)
        self._count(unit)
        return True

    def unit_changed(
        self, name: str, props: Mapping[str, Any], *, read: bool = False
    ) -> list[Change]:
        """A unit's ActiveState/SubState/Job changed (a signal, or a `read` of them)."""
        if not self.managed(name):
            return []
        self._count(name)
        old = self.states.get(name, UnitState(name, "inactive", "dead", 0))
        job = props.get("Job")
        state = UnitState(
            name,
            props.get("ActiveState", old.active),
            props.get("SubState", old.sub),
            job[0] if job is not None else old.job_id,
        )
        self.states[name] = state
        self._condition_checked(name, props)
        if self.shutting_down and state.active in GONE and old.active not in GONE:
            self._down_in_shutdown.add(name)  # its processes ended while the host went down
        elif classify(state) in (Kind.RUNNING, Kind.GATE):
            self._down_in_shutdown.discard(name)  # up again: said of a down before
        if classify(state) in (Kind.RUNNING, Kind.GATE):
            self._start_failed.pop(name, None)  # a start that ran: its down is its own
        if classify(state) is Kind.GATE and classify(old) is not Kind.GATE:
            self._gate_seen[name] = self._signals[name]
            self._cancelled_at_gate.pop(name, None)  # said of a gate before
            self._jobless_at_gate.discard(name)
            self._leaving.pop(name, None)
        before = self._job_paths.get(name)
        if job is not None:
            self._job_paths[name] = job[1]
        if job is not None and not read and classify(state) is Kind.GATE:
            self._job_at_gate(name, state)
        if at_condition(state) and not at_condition(old) and name in self._job_paths:
            # the start job it runs its check in; a job shown while it is still there is
            # someone's stop (the start's ended `canceled`), whose end is no skip
            self._condition_job[name] = self._job_paths[name]
        elif not at_condition(state) and state.active not in GONE:
            self._condition_job.pop(name, None)  # past it: a oneshot's start ends `done` too
        if job is not None and not read:  # only a signal tells what came first
            self._unannounced(old, state, job[1])
            self._note_leaving(old, state, job[1], before)
        if classify(state) is Kind.RUNNING and state.job_id == 0:
            self._jobs_done(name)
        return self._judge(state)

    def _job_at_gate(self, name: str, state: UnitState) -> None:
        """A signal names the job of a unit at its gate. Told down there (`stopped_at_gate`),
        another job than its stop (a start that replaced the stop before it ran), or none
        (the stop cancelled before it ran): its gate goes on, and it waits again. None: its
        start was cancelled (`systemctl cancel`) and its ExecStartPre= goes on, so the next
        job shown there is a start of someone's, not a stop that replaced it
        (`_stop_at_gate`): jobs before that one say nothing of it."""
        stop = self._leaving.get(name)
        if stop is not None and state.job_id not in (
            job_number(stop),
            self._cancelled_at_gate.get(name),
        ):
            self._waits_again(name)
        if not state.job_id:
            self._cancelled_at_gate.pop(name, None)
            self._jobless_at_gate.add(name)
        elif name in self._jobless_at_gate:
            self._jobless_at_gate.discard(name)
            self._gate_seen[name] = self._signals[name]

    def _condition_checked(self, name: str, props: Mapping[str, Any]) -> None:
        """systemd checks a unit's `Condition*=` as its start job runs, before anything of
        it, and a false one skips the start: the job ends `done`, the unit left down, as a
        stop's of a unit down ends. The check's result and time come in the unit's
        PropertiesChanged sent after the job's JobNew and before its JobRemoved (systemd 252
        sends both with every change of the unit; in the bed the check ran before the JobNew
        was sent, and no signal of the unit came between them). A newer time than any seen is
        a new check: failed, the job that ends next is a skipped start, no one's stop
        (`job_removed`). The first time seen of a unit counts as new: a unit systemd had
        unloaded (as it does with one inactive that nothing needs) starts again at 0, and
        where no earlier signal of it came since the controller started, its skip was taken
        for a stop. Its cost: a check that failed before the controller started, of a unit
        systemd kept loaded, seen first with someone's stop of it while down, makes that
        stop no hold. A read (`read`) brings neither: only a signal tells of a check."""
        at, passed = props.get("ConditionTimestampMonotonic"), props.get("ConditionResult")
        if not isinstance(at, int) or isinstance(at, bool) or not isinstance(passed, bool):
            return  # not of systemd's types (`t`, `b`): no check told
        if at <= self._checked_at.get(name, 0):
            return  # the check seen before, or an older answer's
        self._checked_at[name] = at
        if passed:
            self._check_failed.discard(name)
        else:
            self._check_failed.add(name)

    def _jobs_done(self, name: str) -> None:
        """The unit runs with no job: the jobs announced for it since its gate all ended
        without ending this run (a `systemctl start` or `reload` of a running unit, a
        timer's start of it), so none says who stops it later; a job that does is announced
        anew. Kept until its next gate or down, every such job of a unit that runs for
        months stayed, one per job (a cron job that starts it each minute). Not while a call
        of ours is unanswered: its answer looks its job up (`_answered`)."""
        if self._in_flight.get(name):
            return
        for path in self._unit_jobs.pop(name, {}):
            self._own_jobs.pop(path, None)

    def _unannounced(self, old: UnitState, new: UnitState, path: str) -> None:
        """The unit, running, at its gate, or with a job queued, shows a job it did not have
        (one that replaced it) that no JobNew announced nor answer of ours named: the bus
        daemon dropped its JobNew. Announced now: someone's (a stop that takes the unit down
        is theirs, a hold, as when its JobNew came; taken for an end by itself, a person's
        stop was booked finished), or, while a stop of ours is unanswered, the one ours
        queued (a preemption, also once the unit leaves running with it later)."""
        if classify(old) not in (Kind.RUNNING, Kind.GATE) and old.job_id == 0:
            return  # a start's (a oneshot's start job is no stop when it ends)
        if new.job_id in (0, old.job_id) or path == "/" or path in self._own_jobs:
            return
        name = new.name
        if path in self._unit_jobs.get(name, ()):
            return
        unanswered = bool(self._in_flight.get(name)) or name in self._unanswered_stops
        if unanswered and self.ledger.phase(name) is Phase.STOPPING:
            self._own_jobs[path] = "stop"  # the one ours queued, as `stop_found` takes it
        self._unit_jobs.setdefault(name, {}).setdefault(path, self._signals[name])

    def _note_leaving(self, old: UnitState, new: UnitState, path: str, before: str | None) -> None:
        """The unit stops running: by a job announced since its gate (a stop, ours or
        anyone's; or one its JobNew lost: named by our call's answer, or new since its last
        signal (`before` named another) while a stop of ours is unanswered, taken for ours as
        `stop_found` takes it), or by itself (its main process ended: no job, or only a
        oneshot's start job still running). Systemd signals each change as it happens, so a
        stop job of ours that reaches a unit already down (or in its ExecStopPost=) finds it
        there. The job it leaves with is noted: the one that takes it down."""
        up = (Kind.RUNNING, Kind.GATE)
        if classify(old) in up and classify(new) not in up:
            self._taken_down_by[new.name] = path  # "/": none, never announced
        if classify(old) is not Kind.RUNNING or classify(new) is Kind.RUNNING:
            return
        name = new.name
        unanswered = bool(self._in_flight.get(name)) or name in self._unanswered_stops
        stopping = unanswered and self.ledger.phase(name) is Phase.STOPPING
        ours = path in self._own_jobs or (stopping and path != before)
        if new.job_id == 0 or (
            path != "/" and path not in self._unit_jobs.get(name, ()) and not ours
        ):
            self._by_itself.add(name)

    def _our_stop_ends(self, state: UnitState) -> bool:
        """The unit is down and the job it still shows is our stop, about to end: down for
        good (a start queued meanwhile would be a job of its own). Its processes are gone;
        the GPUs go now rather than at the JobRemoved and PropertiesChanged a moment later
        (issue 10: 0.4-1.3 ms of a handover)."""
        if state.active not in GONE or state.job_id == 0:
            return False
        path = self._job_paths.get(state.name)
        return path is not None and self._own_jobs.get(path) == "stop"

    def _judge(self, state: UnitState) -> list[Change]:
        name = state.name
        kind = classify(state)
        if kind is Kind.TRANSITION and self._our_stop_ends(state):
            kind = Kind.DOWN
        phase = self.ledger.phase(name)
        if restarting(state):
            # Restart= starts it again: it has not ended by itself, whatever stop ends it
            # now (ours, a person's, a shutdown's), also when its down waits for our call's
            # answer and is judged from a later state
            self._by_itself.discard(name)
        down = _down_told(state, kind)
        if down is not None and _same_down(self._told_down.get(name), down):
            self._told_down[name] = down
        else:
            self._told_down.pop(name, None)
        if kind is Kind.DOWN:
            if name in self._told_down:
                return []  # told once already: its restart queued (Restart='s, a person's)
            if self._in_flight.get(name):
                self._deferred.add(name)  # decide once we know which of its jobs are ours
                self._down_at.setdefault(name, self._signals.get(name, 0))
                return []
            told = self._leaving.pop(name, None) is not None
            if told and phase is None and not self.ledger.waiting(name):
                self._went_down(name)  # told at its gate (`stopped_at_gate`): this down
                if down is not None:
                    self._told_down[name] = down
                return []
            outcome = self.outcome(state)
            # failed on the shutdown's SIGTERM (143), maybe: the core's `shutting_down` no
            # longer says so (an exit 0 is told SHUTDOWN: `outcome`)
            in_shutdown = (
                outcome is Outcome.FAILED
                and not self.shutting_down
                and name in self._down_in_shutdown
            )
            self._down_in_shutdown.discard(name)  # said of this down only
            by_itself = name in self._by_itself
            not_ours = name in self._not_ours or self._theirs_first(name)
            self._by_itself.discard(name)  # said of this run only
            self._not_ours.discard(name)
            if (
                phase is None
                and not self.ledger.waiting(name)
                and not self.ledger.away(name)
                and not self.ledger.remained(name)
                and not self.stopped_by_others(name)
            ):
                return []
            job = self._taken_down_by.get(name, "/")
            self._went_down(name)
            if down is not None:
                self._told_down[name] = down
            return [WentDown(name, outcome, by_itself, not_ours, in_shutdown, job)]
        if kind is Kind.GATE:
            leaving = self.stopped_at_gate(name)
            if leaving or name in self._leaving:
                return leaving  # being stopped: no start to take in
            if phase is None and not self.ledger.waiting(name):
                return [] if at_condition(state) else [ReachedGate(name)]
        if kind is not Kind.RUNNING:
            return []
        # its job ended and systemd keeps it active: its GPUs to release, once; released,
        # it has no start to take note of (adopted again, it held them for ever), nor at a
        # reload (`reloading`, then `exited` again)
        released = still_released(state) and self.ledger.remained(name)
        ended: list[Change] = [Exited(name)] if remains_active(state) and not released else []
        if phase is None or phase is Phase.STARTING:
            return [] if released else [CameUp(name), *ended]
        if phase is Phase.STOPPING and state.job_id == 0 and not self._in_flight.get(name):
            result = self._stop_results.pop(name, "")
            why = f"its stop job ended with result '{result}'" if result else "no stop job runs"
            return [StopLost(name, why), *ended]
        return ended

    def stopped_at_gate(self, name: str) -> list[Change]:
        """A waiter someone stops at its gate (`systemctl stop`) is down for the core from
        the moment its stop job is seen (`_stop_at_gate`), as its down will be told: it
        preempts no one and is granted nothing while systemd kills its gate. Told at its
        down, it waited until then: a refusal's job that ended meanwhile (D's start, which
        `systemctl stop a d b` cancels) preempted B for it, and B came back later. Its down
        is told no more, nor its gate taken in, until it is at a gate again (`leaving`)."""
        if name in self._leaving or self.ledger.phase(name) is not None:
            return []
        stop = self._stop_at_gate(name)
        if stop is None or not self.ledger.waiting(name):
            return []
        self._leaving[name] = stop
        return [WentDown(name, self.outcome(self.state(name)), job=stop)]

    def _stop_at_gate(self, name: str) -> str | None:
        """Someone's job, announced since the unit was seen at its gate, that replaced the
        start job it showed there: systemd replaces a running start only with a job that
        conflicts with it, a stop (one that merges, a restart, keeps the start's number).
        The job it shows there is such a one, or one was announced after that start ended
        `canceled` (its PropertiesChanged, naming the stop, may come later: after the
        signals of a later call). None where it shows no job (`systemctl cancel`: its start
        goes on), or a call of ours is unanswered (the job may be ours)."""
        state, gate = self.state(name), self._gate_seen.get(name)
        kind = classify(state)
        if gate is None or kind is not Kind.GATE or not state.job_id or self._in_flight.get(name):
            return None
        jobs = self._unit_jobs.get(name, {})
        since = [path for path, at in jobs.items() if at > gate and path not in self._own_jobs]
        shown = [path for path in since if job_number(path) == state.job_id]
        if shown:
            return shown[0]
        return since[-1] if since and self._cancelled_at_gate.get(name) == state.job_id else None

    def leaving(self, name: str) -> bool:
        """Told down at its gate (`stopped_at_gate`), its stop under way: no gate of it is
        served until it is at a gate again."""
        return name in self._leaving

    def leaving_units(self) -> list[str]:
        """The units told down at their gate (`stopped_at_gate`) whose stop is under way."""
        return sorted(self._leaving)

    def leaving_read(self, name: str, state: UnitState) -> bool:
        """A read of a unit told down at its gate (`stopped_at_gate`), which names the type
        of its job (signals do not): one at its gate with a start job waits there again (a
        start replaced the stop before it ran, and that signal was lost; or the job taken
        for a stop was its start, a signal that showed it at its gate lost), as does one
        with no job (`systemctl cancel` of the stop before it ran: its ExecStartPre= goes
        on, as `_job_at_gate` takes that signal; left leaving, its gate was never served).
        Whether it does: its gate is then served as a new start's."""
        if name not in self._leaving or classify(state) is not Kind.GATE:
            return False
        if state.job_id and state.job_type not in START_JOBS:
            return False
        self._waits_again(name)
        return True

    def _waits_again(self, name: str) -> None:
        """Not leaving any more: a start at its gate from now on, jobs before it said of
        no run of it (`passed_gate`)."""
        del self._leaving[name]
        self._cancelled_at_gate.pop(name, None)
        self._gate_seen[name] = next(self._stamps)

    def _theirs_first(self, unit: str) -> bool:
        """A stop of ours got no answer, and the job that took the unit down, its signals
        heard, is not known ours and was announced before ours was sent: someone's stop
        (`systemctl stop`), which ours joined or came after; held as they wanted, as when an
        answer names it (`_answered`) or a read finds it (`stop_found`). One announced after
        ours was sent is taken for ours: systemd takes calls in the order they reach it, so
        that job is the one ours queued, unless someone's reached systemd in the moment ours
        was on its way; a stop of someone's that came later joined ours, which ended it."""
        since = self._unanswered_stops.get(unit, 0)  # stamps start at 1
        return self._announced_before(unit, self._taken_down_by.get(unit, "/"), since)

    def _announced_before(self, unit: str, job: str, since: int) -> bool:
        """The job, not known ours, was announced before the stamp `since`."""
        announced = self._unit_jobs.get(unit, {}).get(job)
        return job not in self._own_jobs and announced is not None and announced < since

    def listed(self, units: Iterable[UnitState]) -> None:
        """ListUnits answered (start-up): the managed units' states replace what was known.
        Each counts as heard now: a read of one sent before it is forgotten (an instance that
        ended) is then still found older, its stamp not 0 (`forget`). One the core has no
        phase for, shown at its gate with a job the list names no start (someone's
        `systemctl stop` there, waiting its turn), is leaving from now on, as
        `stopped_at_gate` leaves a waiter (Restore.rebuild holds it): taken for a start, it
        was queued and preempted less urgent units for a unit being stopped. Its gate is
        served once a start replaces the stop, or the stop is cancelled (`_job_at_gate`,
        `leaving_read`). Any unit at its gate is seen there now, as its signal would have
        shown it: a stop of it announced later is `stopped_at_gate`'s (unseen, a start found
        there and queued waited, and was granted, while someone's stop of it ran)."""
        self.states = {u.name: u for u in units if self.managed(u.name)}
        for name, state in self.states.items():
            self._count(name)
            if classify(state) is Kind.GATE:
                self._gate_seen[name] = self._signals[name]
            stop = state.job_id != 0 and state.job_type not in ("", *START_JOBS)
            if stop and classify(state) is Kind.GATE and self.ledger.phase(name) is None:
                self._leaving[name] = f"{JOB_PREFIX}{state.job_id}"

    # -- our own calls --------------------------------------------------------------------

    def call_sent(self, unit: str) -> None:
        self._in_flight[unit] = self._in_flight.get(unit, 0) + 1
        self._not_ours.discard(unit)  # said of the stop before this call: a new story
        if self._told_down.get(unit) == "inactive":
            del self._told_down[unit]  # and of the clean down told: a start of ours may fail
        self._sent.setdefault(unit, []).append(next(self._stamps))

    def call_answered(self, unit: str, job: str | None, what: str) -> bool:
        """A StartUnit/StopUnit of ours returned (`job` is None when it failed). Whether the
        unit's state must be read again: it went down while we did not know the job."""
        return self._answered(unit, job, what, in_order=False)

    def _answered(self, unit: str, job: str | None, what: str, *, in_order: bool) -> bool:
        """Systemd answers a call merged into a job already queued (a person's stop, when
        ours comes while it runs) with that job's path, and announces no job: a job
        announced before our call was sent is not ours, nor, told in order, one announced
        before other signals of the unit (a new job's JobNew comes right before the answer)."""
        sent = self._sent.get(unit, [])
        since = sent.pop(0) if sent else 0
        if not sent:
            self._sent.pop(unit, None)
        announced = self._unit_jobs.get(unit, {}).get(job or "")
        if in_order and announced is not None and announced != self._signals.get(unit):
            announced = -1
        if job is not None and (announced is None or announced >= since):
            self._own_jobs[job] = what
            down_at = self._down_at.get(unit, 0)  # stamps start at 1
            if what == "stop" and in_order and announced is not None and 0 < down_at < announced:
                self._not_ours.add(unit)  # down before systemd had our stop: not by it
        elif job is not None and what == "stop" and job not in self._own_jobs:
            self._not_ours.add(unit)  # merged into someone's stop: theirs ends it
        elif job is None and what == "stop":
            self._unanswered_stops.setdefault(unit, since)  # it may have reached systemd
        count = self._in_flight.get(unit, 0) - 1
        if count > 0:
            self._in_flight[unit] = count
            return False
        self._in_flight.pop(unit, None)
        self._down_at.pop(unit, None)
        if unit in self._deferred:
            self._deferred.discard(unit)
            return True
        return False

    def call_queued(self, unit: str, job: str, what: str) -> bool:
        """A StartUnit/StopUnit of ours queued `job`, told as systemd's answer is read (after
        JobNew, before the job's other signals): those are judged knowing the job is ours. A
        read of the unit answered before it is older (`heard`). As call_answered."""
        self._answers[unit] = next(self._stamps)
        return self._answered(unit, job, what, in_order=True)

    def stop_found(self, unit: str, job: str) -> bool:
        """A read shows the stop job `job` for a unit whose StopUnit of ours got no answer
        (CALL_TIMEOUT: the bus daemon drops answers to a flooded connection, and may drop
        the job's signals too): ours reached systemd, and the job is taken for the one it
        queued, its end ours (a preemption). One announced before our first unanswered stop
        was sent is someone's, ours merged into it: theirs ends the unit, as `_answered`
        tells. Whether it is ours."""
        since = self._unanswered_stops.pop(unit, 0)
        if self._announced_before(unit, job, since):
            self._not_ours.add(unit)
            return False
        self._own_jobs[job] = "stop"
        # announced now if its JobNew was lost: a job since its gate, not an end by itself
        self._unit_jobs.setdefault(unit, {}).setdefault(job, next(self._stamps))
        return True

    def in_flight(self, unit: str) -> bool:
        return bool(self._in_flight.get(unit))

    # -- questions ------------------------------------------------------------------------

    def passed_gate(self, unit: str) -> None:
        """The unit starts afresh: jobs before this one no longer say who stopped it. A job
        announced since a signal showed it at its gate came while it waited there (a
        person's stop): it still says, also when the same start is served again (taken in
        at its signal, then asked over D-Bus by a gate that found no pipe). That stamp goes
        when it is down, or is replaced when it is next seen at its gate."""
        gate = self._gate_seen.get(unit)
        jobs = self._unit_jobs.pop(unit, {})
        for path, stamp in jobs.items():
            if gate is not None and stamp > gate:
                self._unit_jobs.setdefault(unit, {})[path] = stamp
            else:
                self._own_jobs.pop(path, None)
        self._stop_results.pop(unit, None)
        self._by_itself.discard(unit)
        self._not_ours.discard(unit)
        self._down_in_shutdown.discard(unit)
        self._unanswered_stops.pop(unit, None)
        self._taken_down_by.pop(unit, None)

    def _went_down(self, unit: str) -> None:
        """Down: no job announced before says anything of its next run."""
        self._gate_seen.pop(unit, None)
        self._start_failed.pop(unit, None)
        self._cancelled_at_gate.pop(unit, None)
        self._jobless_at_gate.discard(unit)
        self._leaving.pop(unit, None)
        self.passed_gate(unit)

    def stopped_by_others(self, name: str) -> bool:
        return any(path not in self._own_jobs for path in self._unit_jobs.get(name, ()))

    def outcome(self, state: UnitState, *, stopped: bool = False) -> Outcome:
        """`stopped`: the journal, or systemd's record of its main process, says a stop job
        ended it (stopjournal, `stopped_by_a_job`: asked at start-up of a unit that ended
        while no controller ran, whose jobs nobody saw)."""
        if restarting(state) or (
            state.active == "failed" and not self._stopped_frozen(state.name, stopped)
        ):
            return Outcome.FAILED
        if self.shutting_down or state.name in self._down_in_shutdown:
            # also where the shutdown was cancelled before its down could be told (our
            # answer awaited, the stop job still shown): the shutdown's stop ended it,
            # nobody's hold
            return Outcome.SHUTDOWN
        not_run = self._start_failed.get(state.name)
        if not_run is not None and state.active in GONE:
            return not_run  # its start ran nothing: no run ended, none finished
        if stopped:
            return Outcome.STOPPED
        if self.stopped_by_others(state.name) and state.name not in self._by_itself:
            return Outcome.STOPPED
        return Outcome.EXITED

    def _stopped_frozen(self, name: str, stopped: bool) -> bool:
        """Frozen or suspended by gpuslice, its processes could not end by themselves: a
        stop of someone's ended it, also where its main process exited non-zero on the
        SIGTERM (143 from a shell wrapper), which systemd records as failed. Held as any
        unit stopped by hand: booked failed, the next boot cleared it, and refill started a
        background unit someone had stopped. One killed with no stop job failed."""
        if self.ledger.phase(name) not in (Phase.FROZEN, Phase.SUSPENDED):
            return False
        return stopped or (self.stopped_by_others(name) and name not in self._by_itself)

    def state(self, name: str) -> UnitState:
        return self.states.get(name, UnitState(name, "inactive", "dead", 0))

    def signals(self, name: str) -> int:
        """When a signal about the unit was last seen (a stamp, 0 for none): a read of its
        state answered after this moved is older than what we know."""
        return self._signals.get(name, 0)

    def heard(self, name: str) -> int:
        """When systemd's last word about the unit was read in order (a signal, or an answer
        to our call; a stamp, 0 for none): a read of its state answered after this moved is
        older than what we know."""
        return max(self.signals(name), self._answers.get(name, 0))

    def _count(self, unit: str) -> None:
        self._signals[unit] = next(self._stamps)

    def forget(self, name: str) -> bool:
        """The unit is down and gpuslice has forgotten it (an instance it owes nothing):
        drop what is known of it, unless a call of ours about it is still unanswered (the
        answer is judged with what we know). Whether it was dropped. A read of its state
        sent before is still found older: its stamp was not 0, and new ones are new."""
        if self._in_flight.get(name) or name in self._deferred:
            return False
        self.states.pop(name, None)
        self._went_down(name)
        self._checked_at.pop(name, None)
        self._check_failed.discard(name)
        self._condition_job.pop(name, None)
        self._told_down.pop(name, None)
        self._signals.pop(name, None)
        self._answers.pop(name, None)
        self._job_paths.pop(name, None)
        return True
