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
    ReachedGate,
    StopLost,
    WentDown,
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


@dataclass(frozen=True)
class Shown:
    """Systemd's state of the unit when a message was emitted."""

    active: str
    sub: str
    job: int
    run: int  # the run then (0: none)
    ended: int  # the last run that had ended then (0: none)


@dataclass(frozen=True)
class Msg:
    kind: str  # "new" | "removed" | "props" | "answer" | "read"
    unit: str = A
    path: str = ""
    result: str = ""
    props: dict[str, Any] = field(default_factory=dict)
    shown: Shown | None = None
    what: str = ""  # of an answer: "start" | "stop"
    seen: int = 0  # of a read: the stamp it was sent with


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
        self.last_props: dict[str, Any] = {}

    # -- what it emits --

    def shown(self) -> Shown:
        return Shown(
            self.active, self.sub, self.job.number if self.job else 0, self.run, self.ended
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
        self.wire.append(Msg("props", props=sent, shown=self.shown()))

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
        if failed:
            outcomes = {Outcome.FAILED}
        elif self.shutting_down:
            outcomes = {Outcome.SHUTDOWN}
        elif cause == "stop:person":
            outcomes = {Outcome.STOPPED}
        else:
            outcomes = {Outcome.EXITED}
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
        if self.job is not None:  # replaced: its JobRemoved first
            old, self.job = self.job, None
            self.wire.append(Msg("removed", path=old.path, result="canceled"))
            if old.kind == "start" and self.run and not old.ran and self.down():
                # a start that never ran, cancelled: the run ends as it went down before
                # the start was queued (its processes gone), else by this stop
                cause = self.pending_cause or f"stop:{owner}"
                self.end_run(cause, failed=None if self.pending_cause else False)
        job = self.new_job(kind, owner)
        if owner == "person" and self.run:
            self.runs[self.run].person_job = True
        if ours:
            self.wire.append(Msg("answer", path=job.path, what=kind))
        self.job = job
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

    exit_failed = False
    pending_cause = ""  # how the unit went down while a start of it was queued
    stopping_by = ""  # the owner of the stop job that is stopping the unit


class Harness:
    """The controller's side: the tracker, read in the controller's order, and a core."""

    def __init__(self, draw: Any) -> None:
        self.draw = draw
        self.late = draw(st.booleans())
        self.sd = Systemd(draw, restart=draw(st.booleans()), partial=draw(st.booleans()))
        self.sd.late = self.late
        self.model = Model()
        self.tracker = self.model.tracker()
        self.pos = 0  # the next message of the wire the controller reads
        self.last: Shown = self.sd.shown()  # what the last message read showed
        self.answers: list[Msg] = []  # answers read whose task has not resumed (late)
        self.refreshes: list[int] = []  # JobRemoved's refresh timers, with their stamps
        self.reads: list[int] = []  # reads sent, not yet answered, with their stamps
        self.calls: list[str] = []  # our StartUnit/StopUnit sent, not yet received
        self.preempted = False
        self.reported: dict[int, WentDown] = {}
        self.owed: set[int] = set()  # runs the core knew of
        self.gate_asked = 0  # the run whose gate asked
        self.log: list[str] = [f"late={self.late} restart={self.sd.restart}"]

    def note(self, line: str) -> None:
        self.log.append(line)

    # -- the controller's steps --

    def steps(self) -> list[str]:
        sd, phase = self.sd, self.model.phases.get(A)
        out = []
        if self.pos < len(sd.wire):
            out += ["read_wire", "read_wire"]
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
            and self.last.run == sd.run
            and self.last.sub == "start-pre"
        ):
            out.append("gate_asks")
        if phase is Phase.RUNNING and "stop" not in self.calls:
            out.append("we_stop")
        comeback = self.preempted and not sd.shutting_down
        if phase is None and A not in self.model.waiters and comeback:
            out.append("we_start")
        if not sd.shutting_down:
            out += ["person_start", "person_stop", "shutdown"]
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
            msg = self.answers.pop(0)
            self.note(f"tracker.call_answered(A, {msg.path!r}, {msg.what!r})")
            if self.tracker.call_answered(A, msg.path, msg.what):
                self.reads.append(self.tracker.heard(A))
        elif name == "refresh_timer":
            seen = self.refreshes.pop(0)
            if self.tracker.heard(A) == seen:
                self.reads.append(seen)
        elif name == "systemd_answers_read":
            seen = self.reads.pop(0)
            self.sd.wire.append(Msg("read", seen=seen, shown=sd.shown()))
        elif name == "systemd_gets_call":
            what = self.calls.pop(0)
            if what == "start":
                sd.install("start", "us", ours=True)
                if sd.run:
                    self.owed.add(sd.run)
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
            sd.shutting_down = True
            sd.wire.append(
                Msg("new", unit=SHUTDOWN_TARGET, path="/org/freedesktop/systemd1/job/999")
            )
            sd.install("stop", "shutdown")
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
                self.reads.append(tracker.heard(A))
        elif msg.kind == "props":
            assert msg.shown is not None
            self.last = msg.shown
            self.note(f"tracker.unit_changed(A, {msg.props!r})  # {msg.shown}")
            self.judge(tracker.unit_changed(A, msg.props), msg.shown)
        elif msg.kind == "read":
            assert msg.shown is not None
            if tracker.heard(A) != msg.seen:
                return  # older than what was heard since
            self.last = s = msg.shown
            props = {"ActiveState": s.active, "SubState": s.sub, "Job": (s.job, "/")}
            self.note(f"tracker.unit_changed(A, {props!r}, read=True)  # {s}")
            self.judge(tracker.unit_changed(A, props, read=True), s)

    # -- the ground truth --

    def judge(self, changes: list[Change], shown: Shown) -> None:
        for change in changes:
            self.note(f"#   -> {change}")
            if isinstance(change, WentDown):
                # the oldest run the core knew of that ended unreported (a run deferred
                # while our call was in flight is told later), else the last one ended
                unreported = [
                    n
                    for n in range(1, shown.ended + 1)
                    if n in self.owed and n not in self.reported and self.sd.runs[n].cause
                ]
                run = self.sd.runs.get(unreported[0] if unreported else shown.ended)
                assert run is not None, "down with no run ended"
                assert run.number not in self.reported, f"run {run.number} reported twice"
                outcomes = set(run.outcomes)
                if self.sd.shutting_down and Outcome.FAILED not in outcomes:
                    # decided once the shutdown began (deferred while our call was in
                    # flight): the tracker tells the shutdown, which ends it as much
                    outcomes.add(Outcome.SHUTDOWN)
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
                assert change.outcome in outcomes, (change, run)
                by_itself = set(run.by_itself)
                if run.number < self.gate_asked <= shown.ended:
                    # its end was left to our call's answer, and a later start's gate asked
                    # before it (tracker.passed_gate: its end by itself forgotten): one run
                    # to the core, told as the later one ended (check_at_rest). Our stop
                    # cut that start (the core leaves its ask to our stop: request), so
                    # it is owed the comeback a run ended by itself is not
                    for n in range(self.gate_asked, shown.ended + 1):
                        by_itself |= self.sd.runs[n].by_itself
                assert change.by_itself in by_itself, (change, run)
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
                assert shown.run and shown.run not in self.reported, "at its gate after down"
                self.owed.add(shown.run)
                self.model.waiters.add(A)
            elif isinstance(change, StopLost):
                assert "stop" not in self.calls, "our stop not even received"
                job = self.sd.job
                assert not (job and job.kind == "stop" and job.owner == "us"), "our stop runs"
                self.model.phases[A] = Phase.RUNNING

    def drain(self) -> None:
        """Everything sent is read and answered; nothing more happens on systemd's side."""
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
            else:
                return

    def check_at_rest(self) -> None:
        for number, run in self.sd.runs.items():
            # a run whose end was left to our call's answer, started again before it came,
            # is one run to the core (tests/test_tracker.py: "ending by itself is
            # forgotten when the unit starts again"): told by the next run's end
            later = any(n > number for n in self.reported) or self.sd.run > number
            if run.cause and number in self.owed and not later:
                assert number in self.reported, f"run {number} ended unreported ({run})"


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
