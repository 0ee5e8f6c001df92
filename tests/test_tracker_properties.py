"""The tracker alone against a model of what systemd 252 sends about one unit.

A hypothesis search draws one unit's lives step by step, as systemd runs them, interleaved
with what gpuslice does: a start job (a person's, gpuslice's StartUnit, Restart='s own),
start-pre (the gate, let through by the core or stopped again), running, and its end: its
main process exits (success or failure, through ExecStopPost= or not), a stop job (ours or a
person's) stops it or cancels its start, Restart= auto-restarts it, a shutdown stops it.

Systemd's side (`Systemd`) emits what systemd 252 emits for each step, in its order
(tests/test_tracker.py's recorded sequences, gpuslice/systemd.py's `_queue`): JobNew first,
then the answer to the call that queued the job (when it was ours), then the unit's
PropertiesChanged showing the job; a job replaced is removed ("canceled") before the new
one is announced; a job's end is signalled as the unit's state with the job still shown
(flushed before JobRemoved), JobRemoved, then the state with no job. A PropertiesChanged may
name only the states that changed (`partial`; Job is always named, as systemd 252 sends
every property of the Unit interface). A call merged into a job already queued (ours into
a person's stop) is answered with that job's path, and no JobNew.

The controller's side (`Harness`) reads that wire in order, as the controller does: an
answer of ours is told as it is read (`call_queued`), or, with `late`, only when the task
awaiting it resumes (`call_answered`, any time later). A read of the unit's state is sent
when the tracker asks for one (and after JobRemoved, when nothing was heard meanwhile) and
answered by systemd later; it is applied only when nothing about the unit was heard in
between (`Rereads.read_fresh`). A small core stands in for the scheduler's answers
(its phase and waiting), from the tracker's events, the gate and its own stops and starts.

Each event the tracker gives is judged against the model's ground truth: a WentDown names a
run that ended and was not reported before, with the outcome systemd's story says (a
person's stop is STOPPED, ours is not; an exit by itself is EXITED or FAILED, `by_itself`
when it ran and left running with no job queued; Restart= is FAILED and not by itself; a
shutdown is SHUTDOWN); no CameUp or ReachedGate for a run already reported down; no StopLost
while a stop of ours still goes on. Once the wire is drained, every run the core knew of
(let through its gate, started by us, announced, seen running) ended has been reported once.

What the tracker cannot tell, and the core does not need, is let pass (each at its place):
a stop of ours told as a person's when a job of theirs came during the run; a run whose end
waited for our call's answer while another start (or someone's stop of it down) came, told
with the later one and from the state then; a stop of a unit down that is failed, told failed.

Half the histories are lossy: the bus daemon drops any message to the controller (a signal,
the answer to our call, a read's answer) whose queue is full. A dropped answer is NO_REPLY
60 s later (`call_answered` with no job): a start is owed as before (Scheduler.start_failed),
a stop is sent again after a delay, once a read shows the unit running with no job
(Calls._stop_again: a stop job it shows is taken in by `stop_found`, any other state at
a second look). The periodic audit reads the unit the core knows, and takes in a state its
signals did not tell when two reads in a row show it with nothing heard between, and whether
the host still goes down (Rereads.audit, audit_shutdown). A host shutdown (reboot.target's
JobNew, a stop job for the unit) may be cancelled (its JobRemoved "canceled", and the unit's
stop job with it if it has not run yet).

What the tracker must conclude, as an admin would, is judged by what the core makes of it
(`verdict`: preempted, held, finished, failed, the shutdown's), and with the bus lossless
exactly as before. A person's stop is a hold, also when its JobNew was lost but its states
came (a job the unit did not have is someone's), also one ours joined (its answer names
theirs); one right after ours joins ours: a preemption. A unit the shutdown's stop took
down is the shutdown's, also when the shutdown was cancelled before its down could be told;
a job cancelled before it ran stopped nothing (no hold); a cancelled shutdown's stop job that
ran on stopped it: someone's stop or the shutdown's. Where what says more was lost the
documented choice only is accepted (`lost_outcomes`; README's "The rules in short" and
"Security model"): a person's stop whose JobNew was lost while a stop of ours was on its way
or unanswered is taken for ours (announced after ours was sent); one whose JobNew and first
state were both lost, or whose unit was first seen at its gate with it, or whose leaving
state was lost, is found down as if by itself (finished), or stopped by ours if we sent one;
a lost shutdown JobNew makes its stop someone's (a hold, which outlives the reboot); a lost
cancel of someone's job is taken for a stop there (a hold, or the shutdown's while the
cancel of the shutdown is not heard yet, until the audit finds it over).

`GPUSLICE_FUZZ_EXAMPLES` sets the number of histories (default 300). On a failure the
transcript of the tracker's calls is printed, to be turned into a recorded test.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from gpuslice.core.scheduler import Outcome, Phase
from gpuslice.tracker import (
    CameUp,
    Change,
    Kind,
    ReachedGate,
    StopLost,
    UnitState,
    WentDown,
    classify,
)
from tests.test_tracker import A, Model

EXAMPLES = int(os.environ.get("GPUSLICE_FUZZ_EXAMPLES", "300"))
STEPS = 40
SHUTDOWN_TARGET = "shutdown.target"


@dataclass
class Job:
    path: str
    number: int
    kind: str  # "start" | "stop"
    owner: str  # "us" | "person" | "systemd" (Restart=) | "shutdown"
    ran: bool = False  # a start job in start-pre, a stop job stopping the unit


@dataclass
class Run:
    """One run of the unit: from a start job queued while it was down to its end."""

    number: int
    ran: bool = False  # past its gate
    cause: str = ""  # "exit", "fail", "restart", "stop:<owner>"
    # a job was queued when it left running (a stop job not run yet): who ended it is moot
    left_with_job: bool = False
    outcomes: frozenset[Outcome] = frozenset()
    by_itself: frozenset[bool] = frozenset()
    pseudo: bool = False  # a stop of a unit already down: no run, but a person's word
    # a person's job came during it: a stop of ours may be told as theirs (the tracker
    # cannot tell a person's start from their stop; the core takes a unit it was stopping
    # as preempted whatever the outcome)
    person_job: bool = False
    merged: bool = False  # our stop merged into someone's, its answer told late
    taken_by: str = ""  # the path of the stop job that took it down
    unshut: frozenset[Outcome] = frozenset()  # ended in a shutdown: as if none came
    # down before the start that followed was cancelled (by this job): its processes ended
    # earlier, by `cause`
    earlier: bool = False


@dataclass(frozen=True)
class Shown:
    """Systemd's state of the unit when a message was emitted."""

    active: str
    sub: str
    job: int
    run: int  # the run then (0: none)
    ended: int  # the last run that had ended then (0: none)
    job_kind: str = ""  # "start" | "stop" of the job shown ("": none)

    def path(self) -> str:
        return f"/org/freedesktop/systemd1/job/{self.job}" if self.job else "/"


@dataclass(frozen=True)
class Msg:
    kind: str  # "new" | "removed" | "props" | "answer" | "read"
    unit: str = A
    path: str = ""
    result: str = ""
    props: dict[str, Any] = field(default_factory=dict)
    shown: Shown | None = None
    what: str = ""  # of an answer: "start" | "stop"; of a read: "read" | "audit" | "stop"
    seen: int = 0  # of a read: the stamp it was sent with
    leaving: int = 0  # of a state: the run it shows leaving running or its gate
    stopping: bool = False  # of an audit's read: systemd's SystemState is "stopping"
    shutdown_seen: int = -1  # of an audit's read: the shutdown stamp it was sent with


class Systemd:
    """One unit as systemd 252 runs it (Type=simple, or with `activating (start)` shown)."""

    def __init__(self, draw: Any, *, restart: bool, partial: bool) -> None:
        self.draw = draw
        self.restart = restart
        self.late = False
        self.partial = partial
        self.active, self.sub = "inactive", "dead"
        self.job: Job | None = None
        self.numbers = iter(range(1, 1_000))
        self.runs: dict[int, Run] = {}
        self.run = 0  # the current run (0: down)
        self.ended = 0
        self.wire: list[Msg] = []
        self.granted = False  # the gate of the current start-pre was let through
        self.shutting_down = False
        self.shutdown_job = ""  # the shutdown target's job, while the host goes down
        self.last_props: dict[str, Any] = {}
        self.was_up = False  # the last state emitted showed the unit running or at its gate
        # what the bus daemon dropped: JobNew of these jobs, the states that showed these
        # runs leave running or their gate, the JobNew of a shutdown, and of its cancel
        self.lost_new: set[str] = set()
        self.lost_leave: set[int] = set()
        self.lost_gate: set[int] = set()  # runs a state that showed them at their gate of
        self.lost_shutdown = False
        self.lost_cancel = False

    # -- what it emits --

    def shown(self) -> Shown:
        job = self.job
        return Shown(
            self.active,
            self.sub,
            job.number if job else 0,
            self.run,
            self.ended,
            job.kind if job else "",
        )

    def props(self) -> None:
        job = [self.job.number, self.job.path] if self.job else [0, "/"]
        full: dict[str, Any] = {"ActiveState": self.active, "SubState": self.sub, "Job": job}
        sent = dict(full)
        if self.partial and self.last_props and self.draw(st.booleans()):
            # systemd 252 sends every property of the Unit interface that emits changes
            # (Job among them); the adapter drops what it cannot read: here what did not
            # change. Without Job a change cannot tell the unit ended by itself
            # (tests/test_tracker.py), which is not what systemd sends.
            sent = {k: v for k, v in full.items() if k == "Job" or self.last_props.get(k) != v}
        self.last_props = full
        shown = self.shown()
        state = UnitState(A, shown.active, shown.sub, shown.job)
        up = classify(state) in (Kind.RUNNING, Kind.GATE)
        leaving = (self.run or self.ended) if self.was_up and not up else 0
        self.was_up = up
        self.wire.append(Msg("props", props=sent, shown=shown, leaving=leaving))

    def new_job(self, kind: str, owner: str) -> Job:
        number = next(self.numbers)
        job = Job(f"/org/freedesktop/systemd1/job/{number}", number, kind, owner)
        self.wire.append(Msg("new", path=job.path))
        return job

    def finish(self, result: str) -> None:
        """The unit's job ends: its state with the job (flushed), JobRemoved, with none."""
        assert self.job is not None
        job = self.job
        self.props()
        self.job = None
        self.wire.append(Msg("removed", path=job.path, result=result))
        self.props()

    # -- the unit's runs --

    def down(self) -> bool:
        return self.active in ("inactive", "failed") or self.sub == "auto-restart"

    def running(self) -> bool:
        return self.active == "active"

    def begin_run(self) -> None:
        if self.run == 0:
            self.run = max(self.runs, default=0) + 1
            self.runs[self.run] = Run(self.run)

    def end_run(self, cause: str, *, failed: bool | None = None) -> None:
        """The unit is down (inactive or failed with no start job queued, or restarting)."""
        run = self.runs[self.run]
        run.cause = cause
        self.pending_cause = ""
        if failed is None:
            failed = self.active == "failed" or self.sub == "auto-restart"
        if self.shutting_down:
            # as told if its shutdown's JobNew is lost: as if the host did not go down,
            # the shutdown's stop someone's
            self.shutting_down = False
            self.end_run(cause, failed=failed)
            self.shutting_down, self.run = True, run.number
            run.unshut = run.outcomes | {Outcome.STOPPED}
        if failed:
            outcomes = {Outcome.FAILED}
        elif self.shutting_down:
            outcomes = {Outcome.SHUTDOWN}
        elif cause == "stop:person":
            outcomes = {Outcome.STOPPED}
        elif cause == "stop:shutdown":
            # a cancelled shutdown's stop job that ran on: nobody's, told as someone's stop
            # or (its cancel not heard yet) the shutdown's
            outcomes = {Outcome.STOPPED, Outcome.SHUTDOWN}
        else:
            outcomes = {Outcome.EXITED}
        if cause == "stop:shutdown" and self.cancelled:
            # stopped by a shutdown's job that ran on after its cancel (down while the next
            # one cancels the start that followed): told as someone's stop, or the shutdown
            outcomes |= {Outcome.STOPPED, Outcome.SHUTDOWN}
        if self.job is not None and self.job.kind == "stop" and self.job.owner == "person":
            outcomes.add(Outcome.STOPPED)  # stopped by us, a person's stop queued: theirs too
        if cause == "stop:us" and run.person_job:
            outcomes.add(Outcome.STOPPED)
        if run.merged:
            outcomes.add(Outcome.EXITED)
        itself = cause in ("exit", "fail") and run.ran
        by_itself = {itself}
        if itself and run.left_with_job:
            by_itself = {True, False}  # a stop job was queued when it exited: either
            if not failed and not self.shutting_down:
                outcomes |= {Outcome.STOPPED, Outcome.EXITED}
        run.outcomes, run.by_itself = frozenset(outcomes), frozenset(by_itself)
        self.ended, self.run = self.run, 0

    def reach_down(self, cause: str, failed: bool = False) -> None:
        """The unit's processes are gone: dead, failed, or restarting (Restart=)."""
        stop_queued = self.job is not None and self.job.kind == "stop"
        if failed and self.restart and not stop_queued and not self.shutting_down:
            self.active, self.sub = "activating", "auto-restart"
            self.end_run("restart")
        else:
            self.active, self.sub = ("failed", "failed") if failed else ("inactive", "dead")
            if self.job is None or self.job.kind == "stop":
                self.end_run(cause)
            else:
                self.pending_cause = cause  # a start is queued: the run goes on
        if self.job is not None and self.job.kind == "stop" and self.job.ran:
            self.finish("done")
        else:
            self.props()

    # -- jobs --

    def install(self, kind: str, owner: str, *, ours: bool = False) -> None:
        """A job queued in "replace" mode (and the answer to our call that queued it)."""
        if self.job is not None and self.job.kind == kind:  # merged
            if ours:
                self.wire.append(Msg("answer", path=self.job.path, what=kind))
                if self.late and self.job.owner != "us" and self.run:
                    # told late, the answer cannot show the job is someone else's
                    self.runs[self.run].merged = True
            return
        cut = None  # the run this job's coming ends
        if self.job is not None:  # replaced: its JobRemoved first
            old, self.job = self.job, None
            self.wire.append(Msg("removed", path=old.path, result="canceled"))
            if old.kind == "start" and self.run and not old.ran and self.down():
                # a start that never ran, cancelled: the run ends as it went down before
                # the start was queued (its processes gone), else by this stop
                cause = self.pending_cause or f"stop:{owner}"
                earlier = bool(self.pending_cause)
                self.end_run(cause, failed=None if earlier else False)
                cut = self.runs[self.ended]
                cut.earlier = earlier
        job = self.new_job(kind, owner)
        if cut is not None and not cut.taken_by:
            cut.taken_by = job.path
        if owner == "person" and self.run:
            self.runs[self.run].person_job = True
        if ours:
            self.wire.append(Msg("answer", path=job.path, what=kind))
        self.job = job
        if kind == "stop" and self.active == "deactivating" and self.sub != "stop-post":
            # a stop that replaced the one stopping it (cancelled by a start) goes on with
            # it: the unit goes down with this job, this stop's end
            self.stopping_by = owner
            if self.run:
                self.runs[self.run].taken_by = job.path
        if kind == "start" and (self.down() or self.run == 0):
            self.begin_run()
        self.props()

    def can_run_job(self) -> bool:
        job = self.job
        if job is None or job.ran:
            return False
        if job.kind == "start":
            return self.down() or self.running()
        return self.active != "deactivating"

    def run_job(self) -> None:
        job = self.job
        assert job is not None
        if job.kind == "start":
            if self.running():  # already up: a start that does nothing
                self.finish("done")
                return
            job.ran = True
            self.begin_run()
            self.active, self.sub, self.granted = "activating", "start-pre", False
            self.gate_pos = len(self.wire)  # its gate is forked after what came before
            self.props()
            return
        if self.down():
            if self.sub == "auto-restart":
                self.active, self.sub = "inactive", "dead"
            if job.owner != "us":  # a stop of a unit down: its owner's word all the same
                self.begin_run()
                self.end_run(f"stop:{job.owner}", failed=False)
                self.runs[self.ended].pseudo = True
            self.finish("done")
            return
        job.ran = True
        self.stopping_by = job.owner
        if self.run:
            self.runs[self.run].taken_by = job.path
        self.active, self.sub = "deactivating", "stop-sigterm"
        self.props()

    def pass_gate(self) -> None:
        assert self.job is not None
        self.runs[self.run].ran = True
        if self.draw(st.booleans()):
            self.active, self.sub = "activating", "start"
            self.props()
        self.active, self.sub = "active", "running"
        self.finish("done")

    def exit(self, failed: bool) -> None:
        """The main process ends by itself, through ExecStopPost= or at once."""
        self.runs[self.run].left_with_job = self.job is not None
        if self.draw(st.booleans()):
            self.active, self.sub = "deactivating", "stop-post"
            self.exit_failed = failed
            self.props()
        else:
            self.reach_down("fail" if failed else "exit", failed)

    def processes_gone(self) -> None:
        """A unit in deactivating: its last process ended."""
        if self.sub == "stop-post":
            failed = self.exit_failed
            self.reach_down("fail" if failed else "exit", failed)
        else:
            self.reach_down(f"stop:{self.stopping_by}")

    def shutdown(self) -> None:
        """`systemctl reboot`: reboot.target's job, and a stop job for the unit."""
        self.shutting_down = True
        number = next(self.numbers)
        self.shutdown_job = f"/org/freedesktop/systemd1/job/{number}"
        self.wire.append(Msg("new", unit=SHUTDOWN_TARGET, path=self.shutdown_job))
        self.install("stop", "shutdown")

    def cancel_shutdown(self) -> None:
        """`systemctl cancel`: the target's job is cancelled, and the unit's stop job with
        it if it has not run yet (drawn: `systemctl cancel JOB` leaves it queued)."""
        self.shutting_down, self.cancelled = False, True
        path, self.shutdown_job = self.shutdown_job, ""
        self.wire.append(Msg("removed", unit=SHUTDOWN_TARGET, path=path, result="canceled"))
        job = self.job
        if job is not None and job.owner == "shutdown" and not job.ran and self.draw(st.booleans()):
            self.job = None
            self.wire.append(Msg("removed", path=job.path, result="canceled"))
            self.props()

    exit_failed = False
    cancelled = False  # a shutdown was cancelled
    gate_pos = 0  # the state that shows the unit at its gate: its place on the wire
    lost_cancels = 0  # JobRemoved "canceled" of someone's jobs, dropped
    lost_props = False  # a state was dropped
    pending_cause = ""  # how the unit went down while a start of it was queued
    stopping_by = ""  # the owner of the stop job that is stopping the unit


class Harness:
    """The controller's side: the tracker, read in the controller's order, and a core."""

    def __init__(self, draw: Any) -> None:
        self.draw = draw
        self.late = draw(st.booleans())
        self.lossy = draw(st.booleans())  # the bus daemon drops messages to the controller
        # states that name only what changed since the last one sent: with one dropped, the
        # tracker's view stays stale for good (systemd sends them whole: a model's artefact)
        partial = not self.lossy and draw(st.booleans())
        self.sd = Systemd(draw, restart=draw(st.booleans()), partial=partial)
        self.sd.late = self.late
        self.model = Model()
        self.tracker = self.model.tracker()
        self.pos = 0  # the next message of the wire the controller reads
        self.last: Shown = self.sd.shown()  # what the last message read showed
        self.answers: list[Msg] = []  # answers read whose task has not resumed (late)
        self.refreshes: list[int] = []  # JobRemoved's refresh timers, with their stamps
        # reads sent, not yet answered: what for ("read", "audit", "stop") and their stamps
        self.reads: list[tuple[str, int, int]] = []  # and the shutdown stamp of an audit
        self.auditing = False  # an audit's read is on its way
        self.suspect: tuple[tuple[str, str, int, str], int] | None = None  # Rereads._suspects
        self.stop_retry = False  # our stop got no answer: its retry timer runs
        self.stop_read = False  # _stop_again's read is on its way (moot once a stop is sent)
        self.start_run = 0  # the run our last start began
        self.calls: list[str] = []  # our StartUnit/StopUnit sent, not yet received
        self.preempted = False
        self.reported: dict[int, WentDown] = {}
        # runs told down at their gate, a stop of someone's shown there (stopped_at_gate)
        self.told_at_gate: set[int] = set()
        self.owed: set[int] = set()  # runs the core knew of
        self.gate_asked = 0  # the run whose gate asked
        self.log: list[str] = [f"late={self.late} restart={self.sd.restart} lossy={self.lossy}"]

    def note(self, line: str) -> None:
        self.log.append(line)

    # -- the controller's steps --

    def steps(self) -> list[str]:
        sd, phase = self.sd, self.model.phases.get(A)
        out = []
        if self.pos < len(sd.wire):
            out += ["read_wire", "read_wire"]
            if self.lossy:
                out.append("drop")
        if not self.auditing:
            out.append("audit")
        if self.stop_retry:
            out.append("stop_retry_due")
        if self.answers:
            out.append("answer_resumes")
        if self.refreshes:
            out.append("refresh_timer")
        if self.reads:
            out.append("systemd_answers_read")
        if self.calls:
            out.append("systemd_gets_call")
        if (
            sd.sub == "start-pre"
            and not sd.granted
            and self.gate_asked != sd.run
            and not self.tracker.leaving(A)  # refused then (Gates.serve_gate)
            and (
                (self.last.run == sd.run and self.last.sub == "start-pre")
                or (self.lossy and self.pos > sd.gate_pos)
            )
        ):
            # its signal opens the gate's pipe; where that signal is lost, the audit wakes
            # it to ask over D-Bus (GatePipes.wake_unheard), after what was sent before it
            out.append("gate_asks")
        if phase is Phase.RUNNING and "stop" not in self.calls:
            out.append("we_stop")
        comeback = self.preempted and not sd.shutting_down
        if phase is None and A not in self.model.waiters and comeback:
            out.append("we_start")
        if not sd.shutting_down:
            out += ["person_start", "person_stop", "shutdown"]
        else:
            out.append("cancel_shutdown")
        if sd.can_run_job():
            out.append("job_runs")
        if sd.sub == "start-pre" and sd.granted and sd.job and sd.job.kind == "start":
            out.append("gate_passes")
        if sd.running():
            out += ["exits", "fails"]
        if sd.active == "deactivating":
            out.append("processes_gone")
        if sd.sub == "auto-restart" and sd.job is None:
            out.append("restart_timer")
        return out

    def step(self, name: str) -> None:
        sd = self.sd
        if name != "read_wire":
            self.note(f"# {name}")
        if name == "read_wire":
            self.read_one()
        elif name == "answer_resumes":
            self.resume(self.answers.pop(0))
        elif name == "refresh_timer":
            seen = self.refreshes.pop(0)
            if self.tracker.heard(A) == seen:
                self.reads.append(("read", seen, -1))
        elif name == "systemd_answers_read":
            what, seen, shutdown_seen = self.reads.pop(0)
            self.sd.wire.append(
                Msg(
                    "read",
                    what=what,
                    seen=seen,
                    shown=sd.shown(),
                    stopping=sd.shutting_down,
                    shutdown_seen=shutdown_seen,
                )
            )
        elif name == "drop":
            self.drop()
        elif name == "audit":
            self.audit()
        elif name == "stop_retry_due":
            self.stop_retry = False
            if self.stop_unsent():  # Calls._send_again: read first (_stop_again)
                self.stop_read = True
                self.reads.append(("stop", self.tracker.heard(A), -1))
        elif name == "cancel_shutdown":
            sd.cancel_shutdown()
        elif name == "systemd_gets_call":
            what = self.calls.pop(0)
            if what == "start":
                sd.install("start", "us", ours=True)
                if sd.run:
                    self.owed.add(sd.run)
                    self.start_run = sd.run
            else:
                sd.install("stop", "us", ours=True)
        elif name == "gate_asks":
            self.gate_asked = sd.run
            self.note("tracker.passed_gate(A)  # its gate asks")
            self.tracker.passed_gate(A)
            if self.model.phases.get(A) is Phase.STOPPING:
                self.send("stop")  # its start outran our stop: stopped again
            else:
                self.model.phases[A] = Phase.RUNNING
                self.model.waiters.discard(A)
                sd.granted = True
                self.owed.add(sd.run)
        elif name == "we_stop":
            self.model.phases[A] = Phase.STOPPING
            self.send("stop")
        elif name == "we_start":
            self.preempted = False
            self.model.phases[A] = Phase.STARTING
            self.send("start")
        elif name == "person_start":
            sd.install("start", "person")
        elif name == "person_stop":
            sd.install("stop", "person")
        elif name == "shutdown":
            sd.shutdown()
        elif name == "job_runs":
            sd.run_job()
        elif name == "gate_passes":
            sd.pass_gate()
        elif name in ("exits", "fails"):
            sd.exit(name == "fails")
        elif name == "processes_gone":
            sd.processes_gone()
        elif name == "restart_timer":
            sd.install("start", "systemd")
        else:
            raise AssertionError(name)

    def send(self, what: str) -> None:
        self.note(f"tracker.call_sent(A)  # {what}")
        self.tracker.call_sent(A)
        self.calls.append(what)
        if what == "stop":
            self.stop_read = False  # sent again: a read under way is moot
            self.stop_retry = False  # the retry timer is the one sent

    def known(self) -> bool:
        """The core knows the unit (a holder or a waiter): the audit reads it."""
        return A in self.model.phases or A in self.model.waiters

    def stop_unsent(self) -> bool:
        """Calls._stop_unsent: the core stops it and its signals show it running with
        no job, or at its gate."""
        state = self.tracker.state(A)
        kind = classify(state)
        unsent = kind is Kind.GATE or (kind is Kind.RUNNING and state.job_id == 0)
        return unsent and self.model.phases.get(A) is Phase.STOPPING

    def resume(self, msg: Msg) -> None:
        """The task awaiting our call's answer resumes: the answer (a job), or NO_REPLY
        after CALL_TIMEOUT when the bus daemon dropped it (Calls._call)."""
        job = msg.path or None
        if job is None and msg.what == "start":
            # Calls._call_not_taken: Scheduler.start_failed, owed as before the start
            if self.model.phases.get(A) is Phase.STARTING:
                del self.model.phases[A]
                self.preempted = True
                self.owed.discard(self.start_run)
        elif job is None:
            self.stop_retry = True  # sent again after a delay, if still wanted
        self.note(f"tracker.call_answered(A, {job!r}, {msg.what!r})")
        if self.tracker.call_answered(A, job, msg.what):
            self.reads.append(("read", self.tracker.heard(A), -1))

    def drop(self) -> None:
        """The bus daemon drops the next message to the controller (its queue is full)."""
        msg = self.sd.wire[self.pos]
        self.pos += 1
        self.note(f"# dropped: {msg}")
        sd = self.sd
        if msg.kind == "new" and msg.unit == SHUTDOWN_TARGET:
            sd.lost_shutdown = True
        elif msg.kind == "new":
            sd.lost_new.add(msg.path)
        elif msg.kind == "removed" and msg.unit == SHUTDOWN_TARGET:
            sd.lost_cancel = True
        elif msg.kind == "removed" and msg.result == "canceled":
            sd.lost_cancels += 1
        if msg.kind == "props":
            sd.lost_props = True
        if msg.kind == "props" and msg.leaving:
            sd.lost_leave.add(msg.leaving)
        elif msg.kind == "props" and msg.shown and msg.shown.sub == "start-pre":
            sd.lost_gate.add(msg.shown.run)
        elif msg.kind == "answer":
            self.answers.append(Msg("answer", what=msg.what))  # NO_REPLY, 60 s later
        elif msg.kind == "read" and msg.what == "audit":
            self.auditing = False
        elif msg.kind == "read" and msg.what == "stop" and self.stop_read:
            self.stop_read = False  # the read failed: tried again after the next delay
            self.stop_retry = True

    def audit(self) -> None:
        """Rereads.audit: whether the host still goes down (when its signals said so),
        and the unit's state, in one go here."""
        self.auditing = True
        tracker = self.tracker
        shutdown_seen = tracker.shutdown_jobs_heard() if tracker.shutting_down else -1
        self.reads.append(("audit", tracker.heard(A), shutdown_seen))

    def audited(self, msg: Msg) -> None:
        """Rereads.audit_shutdown and _take_audited: a state its signals did not tell is
        taken in when the next audit's read shows the same, nothing heard between."""
        self.auditing = False
        tracker = self.tracker
        over = msg.shutdown_seen >= 0 and not msg.stopping
        if over and tracker.shutdown_unheard(msg.shutdown_seen):
            self.note("# the audit finds the shutdown cancelled")
        if tracker.heard(A) != msg.seen or not self.known():
            self.suspect = None
            return
        suspect, self.suspect = self.suspect, None
        s = msg.shown
        assert s is not None
        known = tracker.state(A)
        if (known.active, known.sub, known.job_id) == (s.active, s.sub, s.job):
            return
        key = ((s.active, s.sub, s.job, s.job_kind), tracker.heard(A))
        if suspect != key:
            self.suspect = key
            return
        props: dict[str, Any] = {"ActiveState": s.active, "SubState": s.sub}
        if s.job != known.job_id:
            props["Job"] = (s.job, "/")
        self.take_read(props, s)

    def stop_read_answered(self, msg: Msg) -> None:
        """Calls._stop_again: the read of a unit whose stop got no answer."""
        s = msg.shown
        assert s is not None
        if not self.stop_read:
            return  # a stop sent meanwhile tells
        self.stop_read = False
        if not self.stop_unsent():
            return  # not wanted any more
        if self.tracker.heard(A) != msg.seen:
            self.stop_retry = True  # stale: tried again after the next delay
            return
        kind = classify(UnitState(A, s.active, s.sub, s.job))
        if (kind is Kind.GATE and s.job_kind != "stop") or (kind is Kind.RUNNING and not s.job):
            self.send("stop")
            return
        if s.job_kind != "stop":
            self.refreshes.append(self.tracker.heard(A))  # Rereads.confirm
            return
        self.note(f"tracker.stop_found(A, {s.path()!r})")
        self.tracker.stop_found(A, s.path())
        self.take_read({"ActiveState": s.active, "SubState": s.sub, "Job": (s.job, s.path())}, s)

    def take_read(self, props: dict[str, Any], shown: Shown) -> None:
        self.last = shown
        self.note(f"tracker.unit_changed(A, {props!r}, read=True)  # {shown}")
        self.judge(self.tracker.unit_changed(A, props, read=True), shown)

    def read_one(self) -> None:
        msg = self.sd.wire[self.pos]
        self.pos += 1
        tracker = self.tracker
        if msg.kind == "new":
            self.note(f"tracker.job_new({msg.path!r}, {msg.unit!r})")
            tracker.job_new(msg.path, msg.unit)
        elif msg.kind == "removed":
            self.note(f"tracker.job_removed({msg.path!r}, A, {msg.result!r})")
            if tracker.job_removed(msg.path, msg.unit, msg.result):
                self.refreshes.append(tracker.heard(A))
        elif msg.kind == "answer":
            if self.late:
                self.answers.append(msg)
                return
            self.note(f"tracker.call_queued(A, {msg.path!r}, {msg.what!r})")
            if tracker.call_queued(A, msg.path, msg.what):
                self.reads.append(("read", tracker.heard(A), -1))
        elif msg.kind == "props":
            assert msg.shown is not None
            self.last = msg.shown
            self.note(f"tracker.unit_changed(A, {msg.props!r})  # {msg.shown}")
            self.judge(tracker.unit_changed(A, msg.props), msg.shown)
        elif msg.kind == "read" and msg.what == "audit":
            self.audited(msg)
        elif msg.kind == "read" and msg.what == "stop":
            self.stop_read_answered(msg)
        elif msg.kind == "read":
            assert msg.shown is not None
            if tracker.heard(A) != msg.seen:
                return  # older than what was heard since
            s = msg.shown
            self.take_read({"ActiveState": s.active, "SubState": s.sub, "Job": (s.job, "/")}, s)

    # -- the ground truth --

    def judge(self, changes: list[Change], shown: Shown) -> None:
        for change in changes:
            self.note(f"#   -> {change}")
            at_gate = shown.active == "activating" and shown.sub == "start-pre"
            if isinstance(change, WentDown) and at_gate and shown.run > shown.ended:
                # a waiter shows someone's stop at its gate: its run told down at once
                # (Tracker.stopped_at_gate), a stop (checked once it ended: check_at_rest)
                assert A in self.model.waiters, (change, shown)
                assert change.outcome in (Outcome.STOPPED, Outcome.SHUTDOWN), change
                now = self.sd.shown()
                read = UnitState(A, now.active, now.sub, now.job, now.job_kind)
                if self.tracker.leaving_read(A, read):
                    # the controller's read of its job's type (Controller._leaving_read): a
                    # start there (one that replaced the stop, or the start itself where the
                    # state that showed it at its gate was lost): it waits on
                    self.note(f"tracker.leaving_read(A, {read})  # -> waits again")
                    continue
                assert not change.by_itself and shown.run not in self.reported, change
                self.reported[shown.run] = change
                self.told_at_gate.add(shown.run)
                self.model.waiters.discard(A)
                continue
            if isinstance(change, WentDown):
                # the oldest run the core knew of that ended unreported (a run deferred
                # while our call was in flight is told later), else the last one ended
                unreported = [
                    n
                    for n in range(1, shown.ended + 1)
                    if n in self.owed and n not in self.reported and self.sd.runs[n].cause
                ]
                run = self.sd.runs.get(unreported[0] if unreported else shown.ended)
                phantom = run is None or run.number in self.reported
                stop = change.outcome in (Outcome.STOPPED, Outcome.SHUTDOWN)
                if phantom and stop and self.sd.lost_cancels:
                    # a job of someone's queued for the unit down, its cancel lost: the
                    # tracker cannot tell it from a stop that ran there (a hold, or the
                    # shutdown's, which the core takes for nothing)
                    self.sd.lost_cancels -= 1
                    self.model.phases.pop(A, None)
                    self.model.waiters.discard(A)
                    continue
                assert run is not None, "down with no run ended"
                assert run.number not in self.reported, f"run {run.number} reported twice"
                outcomes = set(run.outcomes)
                going = self.sd.shutting_down or self.tracker.shutting_down
                if going and Outcome.FAILED not in outcomes:
                    # decided once the shutdown began (deferred while our call was in
                    # flight, its stop job still shown), before its cancel was read: the
                    # tracker tells the shutdown, which ends it as much
                    outcomes.add(Outcome.SHUTDOWN)
                outcomes |= self.lost_outcomes(run)
                if run.earlier:
                    # its processes ended before the shutdown (someone's stop), the start
                    # that followed cancelled by it: told as that stop, or the shutdown
                    outcomes |= run.unshut
                if self.sd.lost_props:
                    # someone's stop of the unit down, its last state lost: told with the
                    # next down, as the next run's (its job still counted)
                    for n in range(1, run.number):
                        if self.sd.runs[n].pseudo and n not in self.reported:
                            outcomes |= self.sd.runs[n].outcomes
                if run.number != shown.ended and Outcome.FAILED in outcomes:
                    # its end was left to our call's answer, and another start came before
                    # it: told from the state then (a known loss: tracker._judge)
                    outcomes |= {Outcome.EXITED, Outcome.SHUTDOWN}
                    later = self.sd.runs[shown.ended]
                    if later.pseudo:
                        # or someone's stop of it down (in auto-restart): told as that
                        # stop, where the core ends after both reports too (failed, then
                        # a person's hold or the shutdown's)
                        outcomes |= later.outcomes
                if run.pseudo:  # a stop of a unit down: failed stays failed
                    outcomes |= {Outcome.FAILED, Outcome.SHUTDOWN}
                by_itself = set(run.by_itself)
                if run.number in self.sd.lost_leave:
                    # the signal of it leaving running was lost: found down, by a read or a
                    # later signal, it was ended by our stop if we sent one (README), by
                    # itself or by someone's stop job if heard
                    by_itself.add(False)
                if run.number < self.gate_asked <= shown.ended:
                    # its end was left to our call's answer, and a later start's gate asked
                    # before it (tracker.passed_gate: its end by itself forgotten): one run
                    # to the core, told as the later one ended (check_at_rest). Our stop
                    # cut that start (the core leaves its ask to our stop: request), so
                    # it is owed the comeback a run ended by itself is not
                    for n in range(self.gate_asked, shown.ended + 1):
                        by_itself |= self.sd.runs[n].by_itself
                if change.outcome not in outcomes or change.by_itself not in by_itself:
                    # told otherwise, but what the core makes of it is the same (a stop of
                    # the unit it stops, not told someone else's, is a preemption, whatever
                    # the outcome: Scheduler.inactive)
                    phase = self.model.phases.get(A)
                    told = verdict(phase, change.outcome, change.by_itself, change.not_ours)
                    truth = {
                        verdict(phase, outcome, itself, False)
                        for outcome in outcomes
                        for itself in by_itself
                    }
                    assert told in truth, (change, run, told, truth)
                # a run our own stop ended is never told another's: it would not come back
                assert not (change.not_ours and run.cause == "stop:us"), (change, run)
                self.reported[run.number] = change
                was = self.model.phases.pop(A, None)
                self.model.waiters.discard(A)
                theirs = change.not_ours and change.outcome is Outcome.STOPPED
                if was is Phase.STOPPING and not change.by_itself and not theirs:
                    self.preempted = True
            elif isinstance(change, CameUp):
                assert shown.run and shown.run not in self.reported, "up after down"
                self.owed.add(shown.run)
                self.model.phases[A] = Phase.RUNNING
            elif isinstance(change, ReachedGate):
                if shown.run in self.told_at_gate:
                    # told down at its gate, a start replaced the stop before it ran: the
                    # same run waits there again, told at its end (Tracker._waits_again)
                    self.told_at_gate.discard(shown.run)
                    del self.reported[shown.run]
                assert shown.run and shown.run not in self.reported, "at its gate after down"
                self.owed.add(shown.run)
                self.model.waiters.add(A)
            elif isinstance(change, StopLost):
                assert "stop" not in self.calls, "our stop not even received"
                job = self.sd.job
                assert not (job and job.kind == "stop" and job.owner == "us"), "our stop runs"
                self.model.phases[A] = Phase.RUNNING

    def lost_outcomes(self, run: Run) -> set[Outcome]:
        """What the tracker may tell of a run where the bus daemon dropped what says more."""
        sd, more = self.sd, set()
        if sd.lost_shutdown and (sd.shutting_down or run.cause == "stop:shutdown"):
            # the shutdown's JobNew lost: its stop job is someone's, a hold (the host goes
            # down anyway; the hold outlives the reboot: a loss), its other ends as if no
            # shutdown came (Systemd.end_run)
            more |= {Outcome.STOPPED, *run.unshut}
        if run.taken_by in sd.lost_new:
            # someone's stop whose JobNew was lost: with ours sent, taken for the one ours
            # queued (README: one announced after ours was sent is taken for gpuslice's);
            # with the state that first named it lost too, a read shows the job but not
            # whose, and the run ended as if by itself (README: found down by the audit)
            more.add(Outcome.EXITED)
        if run.number in sd.lost_leave:
            more.add(Outcome.EXITED)
        if run.number in sd.lost_gate:
            # first seen at its gate with someone's stop job queued (its start's state
            # lost): that job, older than the gate's signal, is forgotten when the gate
            # asks (Tracker.passed_gate), and the stop taken for an end by itself
            more.add(Outcome.EXITED)
        if run.pseudo and run.cause == "stop:shutdown" and sd.cancelled and sd.lost_props:
            # the shutdown's stop of a unit down, its state after lost and read after the
            # shutdown's cancel: a stop of someone's, a hold
            more.add(Outcome.STOPPED)
        if sd.lost_cancels:
            # someone's job whose cancel was lost (a start, a cancelled shutdown's stop):
            # taken for a stop of theirs, a hold
            more.add(Outcome.STOPPED)
        if sd.lost_cancel and not sd.shutting_down:
            # its cancel's JobRemoved lost: the host is taken to go down until the audit
            # finds otherwise (Rereads.audit_shutdown), and a unit down meanwhile for the
            # shutdown's
            more.add(Outcome.SHUTDOWN)
        return more

    def drain(self) -> None:
        """Everything sent is read and answered; nothing more happens on systemd's side.
        Audits follow until two in a row found the tracker where systemd is."""
        audits = 0
        while True:
            if self.pos < len(self.sd.wire):
                self.step("read_wire")
            elif self.answers:
                self.step("answer_resumes")
            elif self.reads:
                self.step("systemd_answers_read")
            elif self.refreshes:
                self.step("refresh_timer")
            elif self.calls:
                self.step("systemd_gets_call")
            elif self.sd.active == "deactivating":
                self.step("processes_gone")
            elif self.sd.can_run_job() and self.sd.job and self.sd.job.kind == "stop":
                self.step("job_runs")
            elif self.stop_retry:
                self.step("stop_retry_due")
            elif audits < 3 and (self.astray() or self.suspect is not None):
                audits += 1
                self.step("audit")
            else:
                return

    def astray(self) -> bool:
        """The tracker's view differs from systemd's: an audit would tell."""
        sd, state = self.sd, self.tracker.state(A)
        job = sd.job.number if sd.job else 0
        shown = (state.active, state.sub, state.job_id) != (sd.active, sd.sub, job)
        return (shown and self.known()) or self.tracker.shutting_down != sd.shutting_down

    def check_at_rest(self) -> None:
        for number, run in self.sd.runs.items():
            # a run whose end was left to our call's answer, started again before it came,
            # is one run to the core (tests/test_tracker.py: "ending by itself is
            # forgotten when the unit starts again"): told by the next run's end
            later = any(n > number for n in self.reported) or self.sd.run > number
            if run.cause and number in self.owed and not later:
                assert number in self.reported, f"run {number} ended unreported ({run})"
            if number in self.told_at_gate and run.cause:
                # told stopped at its gate: someone's stop ended it there (the shutdown's
                # too: its JobNew lost, taken for a person's)
                assert run.cause in ("stop:person", "stop:shutdown") and not run.ran, run


def verdict(phase: Phase | None, outcome: Outcome, by_itself: bool, not_ours: bool) -> str:
    """What the core makes of a unit's end (Scheduler.inactive), for the units here."""
    theirs = not_ours and outcome is Outcome.STOPPED
    if phase is Phase.STOPPING and not by_itself and not theirs:
        return "preempted"
    if outcome is Outcome.EXITED and phase is None:
        return "nothing"
    return {
        Outcome.STOPPED: "held",
        Outcome.FAILED: "failed",
        Outcome.EXITED: "finished",
        Outcome.SHUTDOWN: "shutdown",
    }[outcome]


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_the_tracker_tells_each_run_as_systemd_ran_it(data: st.DataObject) -> None:
    harness = Harness(data.draw)
    try:
        for _ in range(data.draw(st.integers(1, STEPS))):
            steps = harness.steps()
            if not steps:
                break
            harness.step(data.draw(st.sampled_from(steps)))
        harness.drain()
        harness.check_at_rest()
    finally:
        note("\n".join(harness.log))
