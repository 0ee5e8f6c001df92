"""gpuslice/calls.py on its own: our StartUnit/StopUnit calls, those sent again, the stop timers.

Small fakes stand for the core, the tracker, the rereads and systemd (no controller, no bus):
each records what it was asked and answers what the test set. Timers are never waited for: a
test reads the delay a timer was armed with and runs its callback itself (`fire`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine
from typing import Any, cast

import pytest

from gpuslice import calls as calls_module
from gpuslice.calls import Calls, JobCall
from gpuslice.core.scheduler import Action, Log, Outcome, Phase, Scheduler, Start
from gpuslice.counters import Counters
from gpuslice.rereads import Rereads
from gpuslice.systemd import Queued, SystemdError, job_named, job_path
from gpuslice.tracker import Tracker, UnitState
from tests.timers import armed_for

U = "low.service"
NO_REPLY = SystemdError("org.freedesktop.DBus.Error.NoReply", "no reply")
MASKED = SystemdError("org.freedesktop.systemd1.UnitMasked", "Unit low.service is masked.")
RUNNING = UnitState(U, "active", "running", 0)
STOPPING = UnitState(U, "deactivating", "stop-sigterm", 7, "stop")
DOWN = UnitState(U, "inactive", "dead", 0)


class FakeScheduler:
    """The core's answers: a Log naming what was asked, or what `retry` holds."""

    def __init__(self) -> None:
        self.phases: dict[str, Phase] = {}
        self.retry: list[Action] = []
        self.waiter: dict[str, str] = {}  # victim -> the waiter its stop is for
        self.held_for_jobs: dict[str, tuple[str, ...]] = {}

    def phase(self, name: str) -> Phase | None:
        return self.phases.get(name)

    def stopping_for(self, name: str) -> str | None:
        return self.waiter.get(name)

    def retry_start(self, name: str) -> list[Action]:
        return [*self.retry, Log(f"retry_start {name}")]

    def start_failed(self, name: str, why: str) -> list[Action]:
        return [Log(f"start_failed {name}: {why}")]

    def stop_failed(
        self,
        name: str,
        why: str,
        *,
        refused: bool,
        while_waits: bool = False,
        jobs: tuple[str, ...] = (),
    ) -> list[Action]:
        waits = " while_waits" if while_waits else ""
        if jobs:
            self.held_for_jobs[name] = jobs
            waits += f" for {','.join(jobs)}"
        return [Log(f"stop_failed {name}: {why} refused={refused}{waits}")]

    def jobs_ended(self, name: str) -> list[Action]:
        self.held_for_jobs.pop(name, None)
        return [Log(f"jobs_ended {name}")]

    def inactive(self, name: str, outcome: Outcome) -> list[Action]:
        return [Log(f"inactive {name} {outcome.value}")]

    def stop_overdue(self, name: str, after: str) -> list[Action]:
        return [Log(f"stop_overdue {name} after {after}")]


class FakeTracker:
    """Systemd's word as signals told it: `states`; what the calls told it, recorded."""

    def __init__(self) -> None:
        self.states: dict[str, UnitState] = {}
        self.told: list[tuple[str, ...]] = []
        self.read_after_answer = False  # call_answered's verdict: read the unit again

    def state(self, name: str) -> UnitState:
        return self.states.get(name, UnitState(name, "inactive", "dead", 0))

    def heard(self, name: str) -> int:
        return 3

    def call_sent(self, unit: str) -> None:
        self.told.append(("sent", unit))

    def call_queued(self, unit: str, job: str, what: str) -> bool:
        self.told.append(("queued", unit, job, what))
        return False

    def call_answered(self, unit: str, job: str | None, what: str) -> bool:
        self.told.append(("answered", unit, str(job), what))
        return self.read_after_answer

    def stop_found(self, unit: str, job: str) -> bool:
        self.told.append(("stop_found", unit, job))
        return True


class FakeReads:
    """A read of systemd's shows `shown` (None: it failed, or was stale)."""

    def __init__(self) -> None:
        self.shown: UnitState | None = None
        self.asked: list[tuple[str, ...]] = []

    async def read_fresh(self, unit: str, seen: int) -> UnitState | None:
        self.asked.append(("read_fresh", unit, str(seen)))
        await asyncio.sleep(0)  # answered on a later turn of the loop, as systemd's is
        return self.shown

    async def refresh(self, unit: str) -> None:
        self.asked.append(("refresh", unit))

    def confirm(self, unit: str) -> None:
        self.asked.append(("confirm", unit))


def answering(outcomes: list[str | Exception], sent: list[str]) -> JobCall:
    """A job call whose answers are `outcomes` in turn: a job path, told at once as systemd's
    answer is, or an error raised as the bus answers; each call noted in `sent`."""

    def call(name: str, queued: Queued) -> Awaitable[str]:
        sent.append(name)
        outcome = outcomes.pop(0)

        async def answer() -> str:
            if isinstance(outcome, Exception):
                raise outcome
            queued(outcome)
            return outcome

        return answer()

    return call


class FakeSystemd:
    def __init__(self) -> None:
        self.stops: list[str] = []
        self.answers: list[str | Exception] = []
        self.needed: dict[str, dict[str, list[str]] | Exception] = {}
        self.needs_read = asyncio.Event()  # set: `needs` answers
        # what `needed_by` answers for a unit (none: nobody needs it), and the states
        # `units_state` gives (none: inactive, no job); the reads of both, in order
        self.needers: dict[str, Any] = {}
        self.states: dict[str, Any] = {}
        self.read: list[str] = []
        self.jobs_read = asyncio.Event()  # set: `needed_by` answers
        self.jobs_read.set()

    def stop_unit(self, name: str, queued: Queued | None = None) -> Awaitable[str]:
        assert queued is not None
        return answering(self.answers, self.stops)(name, queued)

    def stop_unit_replacing(self, name: str, queued: Queued | None = None) -> Awaitable[str]:
        assert queued is not None
        return answering(self.answers, self.stops)(f"{name} replace", queued)

    async def needs(self, name: str) -> dict[str, list[str]]:
        self.stops.append(f"needs {name}")
        await self.needs_read.wait()
        found = self.needed.get(name, {})
        if isinstance(found, Exception):
            raise found
        return found

    async def needed_by(self, name: str) -> dict[str, list[str]]:
        self.read.append(f"needed_by {name}")
        await self.jobs_read.wait()
        found = self.needers.get(name, {"RequiredBy": []})
        if isinstance(found, Exception):
            raise found
        return cast(dict[str, list[str]], found)

    async def units_state(self, names: Collection[str]) -> list[UnitState]:
        self.read.append(f"units_state {','.join(sorted(names))}")
        found = [self.states.get(n, UnitState(n, "inactive", "dead", 0)) for n in sorted(names)]
        for state in found:
            if isinstance(state, Exception):
                raise state
        return cast(list[UnitState], found)


class Kit:
    """A Calls with its fakes; `done()` runs every task it spawned to its end."""

    def __init__(self) -> None:
        self.scheduler = FakeScheduler()
        self.tracker = FakeTracker()
        self.reads = FakeReads()
        self.counters = Counters()
        self.systemd = FakeSystemd()
        self.executed: list[str] = []
        self.changed: list[tuple[str, dict[str, Any], bool]] = []
        self.forgotten: list[str] = []
        self.down: set[str] = set()
        self.timeout = 5.0
        self.tasks: set[asyncio.Task[None]] = set()
        self.calls = Calls(
            cast(Scheduler, self.scheduler),
            cast(Tracker, self.tracker),
            cast(Rereads, self.reads),
            self.counters,
            self.systemd,
            self.execute,
            self.spawn,
            self.on_unit_changed,
            lambda unit: unit in self.down,
            self.forgotten.append,
            lambda: self.timeout,
        )

    def execute(self, actions: list[Action]) -> None:
        self.executed += [a.message for a in actions if isinstance(a, Log)]
        self.executed += [f"Start {a.unit}" for a in actions if isinstance(a, Start)]

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self.tasks.add(asyncio.get_running_loop().create_task(coro))

    def on_unit_changed(self, name: str, props: dict[str, Any], *, read: bool = False) -> None:
        self.changed.append((name, props, read))

    async def done(self) -> None:
        while self.tasks:
            tasks, self.tasks = self.tasks, set()
            await asyncio.gather(*tasks)


def fire(handle: asyncio.TimerHandle) -> None:
    """Run a timer's callback now, as the loop would once its delay is over."""
    timer = cast(Any, handle)  # asyncio has no public way to fire a timer
    callback, args = timer._callback, timer._args
    handle.cancel()  # clears them
    callback(*args)


def run(test: Callable[[Kit], Coroutine[Any, Any, None]]) -> Kit:
    kit = Kit()
    asyncio.run(test(kit))
    return kit


# ---- sent again: the delays ----


def test_a_call_that_keeps_not_reaching_systemd_waits_twice_as_long_each_time_up_to_the_cap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """1 s, doubling up to 30 s (README: "is sent again after 1 s, doubling up to 30 s"); the
    journal says so once, and once when it goes through, which forgets the delay."""
    caplog.set_level(logging.DEBUG, logger="gpuslice")
    sent: list[str] = []

    async def test(kit: Kit) -> None:
        kit.scheduler.phases[U] = Phase.STOPPING
        outcomes: list[str | Exception] = [NO_REPLY] * 7
        call = answering([*outcomes, job_path(9)], sent)
        delays = []
        for _ in range(7):
            kit.calls.send(call, U, "stop")
            await kit.done()
            delays.append(kit.calls._retry_delays[(U, "stop")])
            assert armed_for(kit.calls._retry_timers[(U, "stop")]) == delays[-1]
        assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
        timer = kit.calls._retry_timers[(U, "stop")]
        kit.calls.send(call, U, "stop")  # went through
        assert timer.cancelled()
        await kit.done()
        assert kit.calls._retry_timers == {} and kit.calls._retry_delays == {}

    kit = run(test)
    assert len(sent) == 8 and kit.counters.errors["dbus_call_errors"] == 7
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "stopping low.service did not reach systemd: no reply "
        "(org.freedesktop.DBus.Error.NoReply); sent again in 1 s, and until systemd takes it "
        "(said once)"
    ]
    assert "stopping low.service reached systemd: sent again, it went through" in caplog.messages
    assert kit.executed == []  # a stop not taken is no core event


def test_the_first_delay_and_the_cap_are_the_modules_constants(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(calls_module, "CALL_RETRY_FIRST", 3.0)
    monkeypatch.setattr(calls_module, "CALL_RETRY_MAX", 10.0)

    async def test(kit: Kit) -> None:
        assert [kit.calls._retry_later(U, "start") for _ in range(4)] == [3.0, 6.0, 10.0, 10.0]
        assert len(kit.calls._retry_timers) == 1  # each armed anew, the last one's cancelled
        assert kit.calls._retry_delays == {(U, "start"): 10.0}

    run(test)


# ---- sent again: a start ----


def test_a_start_not_taken_is_sent_again_only_if_the_core_sends_it_again() -> None:
    """Its delay over, the core decides again (`retry_start`): a Start of the unit among its
    actions keeps the delay (a failure doubles it); none forgets it, a new story."""
    sent: list[str] = []

    async def test(kit: Kit) -> None:
        kit.calls.send(answering([NO_REPLY], sent), U, "start")
        await kit.done()
        assert kit.executed == [
            "start_failed low.service: no reply (org.freedesktop.DBus.Error.NoReply)"
        ]
        kit.scheduler.retry = [Start(U, "again")]
        fire(kit.calls._retry_timers[(U, "start")])
        assert kit.executed[1:] == ["retry_start low.service", "Start low.service"]
        assert kit.calls._retry_timers == {} and kit.calls._retry_delays == {(U, "start"): 1.0}
        kit.calls._retry_later(U, "start")
        kit.scheduler.retry = [Start("other.service", "not this one")]
        fire(kit.calls._retry_timers[(U, "start")])
        assert kit.calls._retry_timers == {} and kit.calls._retry_delays == {}

    kit = run(test)
    assert sent == [U] and kit.systemd.stops == []


# ---- sent again: a stop ----


def stop_not_taken(kit: Kit) -> Coroutine[Any, Any, None]:
    """A stop of U, running, failed on the bus: its retry armed."""
    kit.scheduler.phases[U] = Phase.STOPPING
    kit.tracker.states[U] = RUNNING
    kit.calls.send(answering([NO_REPLY], []), U, "stop")
    return kit.done()


def test_a_stop_is_sent_again_only_after_a_read_shows_its_unit_running_with_no_job() -> None:
    async def test(kit: Kit) -> None:
        await stop_not_taken(kit)
        kit.reads.shown = RUNNING
        kit.systemd.answers = [job_path(9)]
        fire(kit.calls._retry_timers[(U, "stop")])
        assert kit.systemd.stops == []  # not on the signals' word: read first
        await kit.done()
        assert ("read_fresh", U, "3") in kit.reads.asked
        assert kit.systemd.stops == [U]
        assert kit.calls._retry_delays == {} and kit.calls._stop_reads == set()

    run(test)


def test_a_stop_whose_read_shows_a_stop_job_takes_it_in_as_ours_not_sending_another() -> None:
    async def test(kit: Kit) -> None:
        await stop_not_taken(kit)
        kit.reads.shown = STOPPING
        fire(kit.calls._retry_timers[(U, "stop")])
        await kit.done()
        assert kit.systemd.stops == []
        assert ("stop_found", U, job_path(7)) in kit.tracker.told
        props = {"ActiveState": "deactivating", "SubState": "stop-sigterm", "Job": (7, job_path(7))}
        assert kit.changed == [(U, props, True)]
        assert kit.calls._retry_delays == {}

    run(test)


def test_a_stop_whose_read_shows_its_unit_down_is_confirmed_at_a_second_look() -> None:
    async def test(kit: Kit) -> None:
        await stop_not_taken(kit)
        kit.reads.shown = DOWN
        fire(kit.calls._retry_timers[(U, "stop")])
        await kit.done()
        assert kit.systemd.stops == [] and kit.changed == []
        assert kit.reads.asked[-1] == ("confirm", U)
        assert kit.calls._retry_delays == {}

    run(test)


def test_a_stop_whose_read_shows_a_job_not_ours_is_not_sent_again_but_confirmed() -> None:
    """Running with a job that is no stop (a reload, someone's restart): its signals were
    lost too, and a second look takes it in (Rereads.confirm); a stop sent now would merge."""

    async def test(kit: Kit) -> None:
        await stop_not_taken(kit)
        kit.reads.shown = UnitState(U, "active", "running", 8, "reload")
        fire(kit.calls._retry_timers[(U, "stop")])
        await kit.done()
        assert kit.systemd.stops == [] and kit.reads.asked[-1] == ("confirm", U)

    run(test)


def test_a_stop_whose_read_shows_its_unit_at_its_gate_is_sent_again_unless_a_stop_waits() -> None:
    async def test(kit: Kit) -> None:
        await stop_not_taken(kit)
        kit.reads.shown = UnitState(U, "activating", "start-pre", 8, "start")
        kit.systemd.answers = [job_path(9)]
        fire(kit.calls._retry_timers[(U, "stop")])
        await kit.done()
        assert kit.systemd.stops == [U]
        await stop_not_taken(kit)
        kit.reads.shown = UnitState(U, "activating", "start-pre", 8, "stop")
        fire(kit.calls._retry_timers[(U, "stop")])
        await kit.done()
        assert kit.systemd.stops == [U]  # the stop job waiting its turn: ours, taken in
        assert kit.changed[-1][0] == U and ("stop_found", U, job_path(8)) in kit.tracker.told

    run(test)


def test_a_stop_whose_read_fails_is_read_again_after_the_next_delay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="gpuslice")

    async def test(kit: Kit) -> None:
        await stop_not_taken(kit)
        fire(kit.calls._retry_timers[(U, "stop")])  # kit.reads.shown: None
        await kit.done()
        assert kit.systemd.stops == []
        assert kit.calls._retry_delays == {(U, "stop"): 2.0}
        assert armed_for(kit.calls._retry_timers[(U, "stop")]) == 2.0

    run(test)
    assert "cannot tell whether stopping low.service reached systemd; read again in 2 s" in (
        caplog.messages
    )


def test_a_stop_no_longer_wanted_when_its_delay_ends_is_forgotten_unread() -> None:
    """The core no longer stops the unit, or its signals show a job for it: no read."""

    async def test(kit: Kit) -> None:
        await stop_not_taken(kit)
        kit.tracker.states[U] = STOPPING
        fire(kit.calls._retry_timers[(U, "stop")])
        await kit.done()
        assert kit.reads.asked == [] and kit.calls._retry_delays == {}
        await stop_not_taken(kit)
        kit.scheduler.phases[U] = Phase.RUNNING
        fire(kit.calls._retry_timers[(U, "stop")])
        await kit.done()
        assert kit.reads.asked == [] and kit.calls._retry_delays == {}

    kit = run(test)
    assert kit.systemd.stops == []


def test_a_stop_sent_while_its_read_was_under_way_leaves_the_read_moot() -> None:
    async def test(kit: Kit) -> None:
        await stop_not_taken(kit)
        kit.reads.shown = RUNNING
        fire(kit.calls._retry_timers[(U, "stop")])  # its read spawned, not run yet
        assert kit.calls._stop_reads == set()
        await asyncio.sleep(0)
        assert kit.calls._stop_reads == {U}
        kit.systemd.answers = [job_path(9)]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")  # a preemption sends it meanwhile
        await kit.done()
        assert kit.systemd.stops == [U]  # once: the read, answered after, sent nothing
        assert kit.calls._stop_reads == set() and kit.calls._retry_delays == {}

    run(test)


# ---- an error that passes, and systemd's refusal ----


def test_a_refused_start_is_the_cores_failure_and_not_sent_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def test(kit: Kit) -> None:
        kit.calls.send(answering([MASKED], []), U, "start")
        await kit.done()
        assert kit.executed == ["inactive low.service failed"]
        assert kit.calls._retry_timers == {} and kit.calls._retry_delays == {}

    kit = run(test)
    assert "start low.service failed: Unit low.service is masked." in caplog.messages
    assert kit.counters.errors["dbus_call_errors"] == 1


def test_a_refused_stop_is_the_cores_refusal_its_timer_cancelled_its_retry_forgotten() -> None:
    async def test(kit: Kit) -> None:
        await stop_not_taken(kit)
        kit.calls.arm_stop_timer(U)
        timer = kit.calls._stop_timers[U]
        kit.calls.send(answering([MASKED], []), U, "stop")
        await kit.done()
        assert kit.executed == ["stop_failed low.service: Unit low.service is masked. refused=True"]
        assert timer.cancelled() and kit.calls._stop_timers == {}
        assert kit.calls._retry_timers == {} and kit.calls._retry_delays == {}

    kit = run(test)
    assert kit.counters.errors["dbus_call_errors"] == 2  # the error that passed, the refusal


def test_a_stop_refused_as_it_would_cancel_another_units_job_holds_while_its_waiter_waits() -> None:
    """Systemd.stop_unit's mode "fail": a refusal for another unit's job (the start of the
    unit the stop is for, which needs the victim) holds only while that start waits."""
    text = "Transaction for low.service/stop is destructive (urgent.service has 'start' job"
    destructive = SystemdError("org.freedesktop.systemd1.TransactionIsDestructive", text)

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.systemd.needed[A] = {"Requires": [U]}
        kit.systemd.needers[U] = {"RequiredBy": [A]}
        kit.systemd.states[A] = UnitState(A, "inactive", "dead", 12, "start")
        kit.calls.send(answering([destructive], []), U, "stop")
        await kit.done()
        assert kit.executed == [f"stop_failed low.service: {text} refused=True while_waits"]
        kit.calls.job_ended(12, A)
        assert kit.executed[1:] == []

    run(test)


@pytest.mark.parametrize("found", ["needs-it", "named-only"])
def test_a_stop_refused_naming_the_job_of_a_unit_needing_it_holds_for_that_job(
    found: str,
) -> None:
    """Systemd names whichever conflicting job it finds first: here D's start, queued behind
    the victim's own (D `Requires=` + `After=` it), A needing nothing of it. The refusal
    holds only for the jobs read (D's, read as the one named where not read as a unit that
    needs the victim, and the victim's own start), and ends with the first to end."""
    text = "Transaction for low.service/stop is destructive (d.service has 'start' job queued"
    destructive = SystemdError("org.freedesktop.systemd1.TransactionIsDestructive", text)

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.tracker.states[U] = U_STARTING
        kit.systemd.needed[A] = {"Requires": []}
        kit.systemd.needers[U] = {"RequiredBy": [D] if found == "needs-it" else []}
        kit.systemd.states[D] = D_QUEUED
        kit.calls.send(answering([destructive], kit.systemd.stops), U, "stop")
        await kit.done()
        assert f"{U} replace" not in kit.systemd.stops
        assert kit.systemd.read[-1] == f"units_state {D}"
        held = f"stop_failed {U}: {text} refused=True while_waits for {D},{U}"
        assert kit.executed == [held]
        kit.calls.job_ended(12, D)
        assert kit.executed[1:] == [f"jobs_ended {U}"]

    run(test)


def test_a_stop_refused_for_a_job_gone_by_the_read_is_asked_again_a_few_times_in_a_row() -> None:
    """The job the refusal names ended before the read (its JobRemoved handled before the
    refusal's answer): the refusal is over, the stop asked again (the core decides anew).
    At most ASKED_AGAIN_MAX times in a row: then it holds while A waits (the safe side, a
    job the reads cannot see), never a loop of refusals."""
    text = "Transaction for low.service/stop is destructive (d.service has 'start' job queued"
    destructive = SystemdError("org.freedesktop.systemd1.TransactionIsDestructive", text)

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.systemd.needed[A] = {"Requires": []}
        again = f"stop_failed {U}: {text} refused=False"
        for _ in range(calls_module.ASKED_AGAIN_MAX):
            kit.calls.send(answering([destructive], kit.systemd.stops), U, "stop")
            await kit.done()
            assert kit.executed[-1] == again
        kit.calls.send(answering([destructive], kit.systemd.stops), U, "stop")
        await kit.done()
        assert kit.executed[-1] == f"stop_failed {U}: {text} refused=True while_waits"
        assert kit.calls._held_for == {}

    run(test)


OWN_JOB = SystemdError(
    "org.freedesktop.systemd1.TransactionIsDestructive",
    "Transaction for low.service/stop is destructive (low.service has 'start' job queued, but"
    " 'stop' is included in transaction).",
)
A = "urgent.service"


def _stopping_for_a(kit: Kit) -> None:
    """low.service is being stopped for A, which waits."""
    kit.scheduler.phases[U] = Phase.STOPPING
    kit.scheduler.waiter[U] = A
    kit.systemd.needs_read.set()


async def _refused_while_d_is_read(kit: Kit) -> None:
    """U's stop for A is refused for U's own job; D (`RequiredBy` U) is read as queued, that
    read held until the test sets `kit.systemd.jobs_read`."""
    _stopping_for_a(kit)
    kit.systemd.needers[U] = {"RequiredBy": [D]}
    kit.systemd.states[D] = D_QUEUED
    kit.systemd.answers = [OWN_JOB]
    kit.systemd.jobs_read.clear()
    kit.calls.send(kit.systemd.stop_unit, U, "stop")
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_stop_refused_for_the_units_own_job_holds_where_its_waiter_needs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Systemd names one conflicting job: the victim's own start (queued with A's, A
    `Requires=` it). Sent again in mode "replace", the stop cancelled A's start too (the
    bed's test_a_unit_needed_by_a_start_is_preempted_again_once_that_start_is_gone): systemd
    says A needs it, so the refusal holds while A waits, as one naming A's start; the
    journal says which stop failed, and why."""
    caplog.set_level(logging.DEBUG, logger="gpuslice")

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.systemd.needed[A] = {"Requires": [], "BindsTo": [U], "PartOf": []}
        kit.calls.arm_stop_timer(U)
        kit.systemd.answers = [OWN_JOB]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()
        assert kit.systemd.stops == [U, f"needs {A}"]
        assert kit.executed == [f"stop_failed {U}: {OWN_JOB.text} refused=True while_waits"]
        assert kit.calls._stop_timers == {}
        assert ("answered", U, "None", "stop") in kit.tracker.told

    kit = run(test)
    assert kit.counters.errors.get("dbus_call_errors", 0) == 0
    assert f"stop {U} failed: {OWN_JOB.text}" in caplog.messages


def test_a_stop_refused_for_its_own_job_is_sent_again_in_mode_replace_if_not_needed() -> None:
    """The waiter needs nothing of the victim (or nobody waits: a withdrawal): the stop is
    sent again in mode "replace", which replaces the victim's own start; its timer runs on."""

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.systemd.needed[A] = {"Requires": ["other.service"], "BindsTo": [], "PartOf": []}
        kit.calls.arm_stop_timer(U)
        kit.systemd.answers = [OWN_JOB, job_path(9)]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()
        assert kit.systemd.stops == [U, f"needs {A}", f"{U} replace"]
        assert kit.executed == []
        assert U in kit.calls._stop_timers
        assert ("queued", U, job_path(9), "stop") in kit.tracker.told
        del kit.scheduler.waiter[U]
        kit.systemd.answers = [OWN_JOB, job_path(10)]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()
        assert kit.systemd.stops[3:] == [U, f"{U} replace"]  # nothing to read

    run(test)


@pytest.mark.parametrize("broken", ["fails", "hangs"])
def test_a_stop_refused_for_the_units_own_job_holds_if_what_its_waiter_needs_is_unread(
    broken: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The safe side: a stop wrongly sent cancels the waiter's start for good; one held back
    keeps the victim running while the waiter waits. A hung read is given up on (within
    NEEDS_READ_WAIT: the controller's task ends, it does not wait for good); the journal
    says whose needs went unread, why, and which unit keeps running."""
    monkeypatch.setattr(calls_module, "NEEDS_READ_WAIT", 0.01)
    caplog.set_level(logging.DEBUG, logger="gpuslice")
    error: Exception = NO_REPLY if broken == "fails" else TimeoutError()

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        if broken == "fails":
            kit.systemd.needed[A] = NO_REPLY
        else:
            kit.systemd.needs_read.clear()
        kit.systemd.answers = [OWN_JOB]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await asyncio.wait_for(kit.done(), 5.0)  # a read waited for unbounded hangs here
        assert kit.executed == [f"stop_failed {U}: {OWN_JOB.text} refused=True while_waits"]

    kit = run(test)
    assert kit.counters.errors["dbus_call_errors"] == 1
    assert f"cannot read what {A} needs: {error}; {U} not stopped" in caplog.messages


@pytest.mark.parametrize("since", ["down", "for-another"])
def test_a_stop_refused_for_the_units_own_job_follows_the_core_after_the_read(
    since: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The core moved on while the waiter's needs were read: the victim went down (nothing
    to do), or it is stopped for another waiter, whose needs were not read (the core plans
    anew, a plain failure, and asks again: the failed stop's timer goes with it, the journal
    says for whom it is asked again)."""
    caplog.set_level(logging.DEBUG, logger="gpuslice")

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.systemd.needs_read.clear()
        kit.systemd.answers = [OWN_JOB]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        kit.calls.arm_stop_timer(U)
        timer = kit.calls._stop_timers[U]
        for _ in range(5):
            await asyncio.sleep(0)
        assert kit.systemd.stops == [U, f"needs {A}"]
        if since == "down":
            del kit.scheduler.phases[U]
        kit.scheduler.waiter[U] = "other.service"
        kit.systemd.needs_read.set()
        await kit.done()
        expected = [] if since == "down" else [f"stop_failed {U}: {OWN_JOB.text} refused=False"]
        assert kit.executed == expected
        assert kit.systemd.stops == [U, f"needs {A}"]
        if since == "for-another":
            assert timer.cancelled() and kit.calls._stop_timers == {}

    run(test)
    again = f"stopping {U} refused for a job under way: asked again for other.service"
    assert (again in caplog.messages) == (since == "for-another")


D = "d.service"
D_QUEUED = UnitState(D, "inactive", "dead", 12, "start")  # its start queued behind U's
U_STARTING = UnitState(U, "activating", "start-post", 11, "start")  # its own start under way


@pytest.mark.parametrize("waiter", [A, None], ids=["for-a", "for-nobody"])
def test_a_stop_refused_for_its_own_job_holds_where_a_third_units_start_needs_it(
    waiter: str | None,
) -> None:
    """A needs nothing of the victim, but D `Requires=` + `After=` it, its start queued
    behind the victim's own (`systemctl start d`). Sent again in mode "replace", the stop
    cancelled D's start too (the bed's
    test_a_unit_still_starting_is_not_preempted_over_a_start_queued_that_needs_it): the
    refusal holds, as one naming D's start does."""

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.tracker.states[U] = U_STARTING
        if waiter is None:
            del kit.scheduler.waiter[U]
        kit.systemd.needed[A] = {"Requires": [], "BindsTo": [], "PartOf": []}
        kit.systemd.needers[U] = {"RequiredBy": [D, "idle.service"], "BoundBy": []}
        kit.systemd.states[D] = D_QUEUED
        kit.calls.arm_stop_timer(U)
        kit.systemd.answers = [OWN_JOB]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()
        assert f"{U} replace" not in kit.systemd.stops
        assert kit.systemd.read == [
            f"needed_by {U}",
            f"needed_by {D}",  # and the units that need them, each level at once
            "needed_by idle.service",
            f"units_state {D},idle.service",
        ]
        held = f"stop_failed {U}: {OWN_JOB.text} refused=True while_waits for {D},{U}"
        assert kit.executed == [held]
        assert kit.calls._stop_timers == {}

    kit = run(test)
    assert kit.counters.errors.get("dbus_call_errors", 0) == 0


@pytest.mark.parametrize(
    "state",
    [UnitState(D, "active", "running", 0), UnitState(D, "deactivating", "stop-sigterm", 7, "stop")],
    ids=["no-job", "stopping"],
)
def test_a_stop_refused_for_its_own_job_is_sent_again_where_no_unit_needing_it_has_a_job(
    state: UnitState,
) -> None:
    """D needs the victim but has no job a stop cancels (none, or a stop: merged with the
    one systemd adds): the stop is sent again in mode "replace"."""

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.systemd.needers[U] = {"RequiredBy": [D]}
        kit.systemd.states[D] = state
        kit.systemd.answers = [OWN_JOB, job_path(9)]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()
        assert kit.systemd.stops == [U, f"needs {A}", f"{U} replace"]
        assert kit.executed == []

    run(test)


def test_a_stop_refused_for_its_own_job_holds_where_a_unit_needing_a_needer_has_a_start() -> None:
    """F `Requires=` D, which `Requires=` the victim, running with a start job under way;
    D runs with no job, F's start is queued. The refusal names the victim's own job; sent
    again in mode "replace", the stop would stop D and so cancel F's start: the units that
    need D are read too, and the refusal holds for F's job."""
    f = "f.service"

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.tracker.states[U] = U_STARTING
        kit.systemd.needed[A] = {"Requires": [], "BindsTo": [], "PartOf": []}
        kit.systemd.needers[U] = {"RequiredBy": [D], "BoundBy": []}
        kit.systemd.needers[D] = {"RequiredBy": [f], "BoundBy": []}
        kit.systemd.needers[f] = {"RequiredBy": [U], "BoundBy": []}  # a cycle ends the read
        kit.systemd.states[f] = UnitState(f, "inactive", "dead", 14, "start")
        kit.systemd.answers = [OWN_JOB]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()
        assert f"{U} replace" not in kit.systemd.stops
        assert kit.systemd.read[-1] == f"units_state {D},{f}"
        assert kit.executed == [
            f"stop_failed {U}: {OWN_JOB.text} refused=True while_waits for {f},{U}"
        ]

    run(test)


@pytest.mark.parametrize("second", [24, 25], ids=["at-the-bound", "past-it"])
def test_the_bound_on_units_needing_the_victim_counts_them_over_every_level(second: int) -> None:
    """NEEDED_BY_MAX counts the units of every level together, each once: 40 need the
    victim, and `second` more need two of those (each named by both; and they name one of
    the 40 back). At the bound, the read goes on to the last level and every job is read;
    one past it, the read ends with that level (nothing more asked of systemd) and the
    refusal holds."""
    assert calls_module.NEEDED_BY_MAX == 64
    first = [f"u{i:02}.service" for i in range(40)]
    more = [f"v{i:02}.service" for i in range(second)]

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.systemd.needers[U] = {"RequiredBy": first}
        kit.systemd.needers[first[0]] = {"RequiredBy": more, "BoundBy": [U]}
        kit.systemd.needers[first[1]] = {"ConsistsOf": more}
        for v in more:
            kit.systemd.needers[v] = {"RequiredBy": [first[2]]}
        kit.systemd.answers = [OWN_JOB, job_path(9)]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()
        levels = [f"needed_by {U}", *(f"needed_by {u}" for u in first)]
        if second == 24:
            levels += [f"needed_by {v}" for v in more]
            levels.append(f"units_state {','.join(first + more)}")
            assert kit.systemd.read == levels
            assert kit.systemd.stops[-1] == f"{U} replace"
            assert kit.executed == []
        else:
            assert kit.systemd.read == levels
            assert f"{U} replace" not in kit.systemd.stops
            assert kit.executed == [f"stop_failed {U}: {OWN_JOB.text} refused=True while_waits"]

    run(test)


@pytest.mark.parametrize("e_job", [15, 0], ids=["e-queued", "e-idle"])
def test_a_cycle_among_the_units_needing_a_needer_ends_the_read_with_its_jobs_right(
    e_job: int,
) -> None:
    """D `Requires=` the victim; E and D need each other (and E itself), a cycle that does
    not pass through the victim: each unit is read once, the read ends, and E's queued start
    holds the refusal (with the victim's own start); E with no job, the stop is sent again
    in mode "replace"."""
    e = "e.service"

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.tracker.states[U] = U_STARTING
        kit.systemd.needers[U] = {"RequiredBy": [D]}
        kit.systemd.needers[D] = {"RequiredBy": [e], "BoundBy": [e]}
        kit.systemd.needers[e] = {"RequiredBy": [D, e]}
        kit.systemd.states[D] = UnitState(D, "active", "running", 0)
        kit.systemd.states[e] = UnitState(e, "inactive", "dead", e_job, "start" if e_job else "")
        kit.systemd.answers = [OWN_JOB, job_path(9)]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await asyncio.wait_for(kit.done(), 5.0)  # a cycle read round and round hangs here
        assert kit.systemd.read == [
            f"needed_by {U}",
            f"needed_by {D}",
            f"needed_by {e}",
            f"units_state {D},{e}",
        ]
        if e_job:
            assert f"{U} replace" not in kit.systemd.stops
            held = f"stop_failed {U}: {OWN_JOB.text} refused=True while_waits for {e},{U}"
            assert kit.executed == [held]
            assert kit.calls._held_for == {U: {e: 15, U: 11}}
        else:
            assert kit.systemd.stops[-1] == f"{U} replace"
            assert kit.executed == []

    run(test)


@pytest.mark.parametrize(
    "broken", ["fails", "hangs", "bad-reply", "bad-state", "bad-job", "too-many"]
)
def test_a_stop_refused_for_its_own_job_holds_if_the_jobs_of_units_needing_it_are_unread(
    broken: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The safe side, as for the waiter's needs: a read that fails, hangs, answers in a form
    not systemd's, or names more units than NEEDED_BY_MAX holds the refusal; nothing raises
    out of the controller's task."""
    monkeypatch.setattr(calls_module, "NEEDS_READ_WAIT", 0.01)

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        needers: Any = {"RequiredBy": [D]}
        if broken == "fails":
            needers = NO_REPLY
        elif broken == "hangs":
            kit.systemd.jobs_read.clear()
        elif broken == "bad-reply":
            needers = {"RequiredBy": 7}
        elif broken == "bad-state":
            kit.systemd.states[D] = SystemdError("org.gpuslice.Error.BadReply", "not a(s...)")
        elif broken == "bad-job":
            kit.systemd.states[D] = UnitState(D, "inactive", "dead", cast(int, "12"), "start")
        else:
            many = [f"u{i}.service" for i in range(calls_module.NEEDED_BY_MAX + 1)]
            needers = {"RequiredBy": many}
        kit.systemd.needers[U] = needers
        kit.systemd.answers = [OWN_JOB]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await asyncio.wait_for(kit.done(), 5.0)  # a read waited for unbounded hangs here
        assert f"{U} replace" not in kit.systemd.stops
        assert kit.executed == [f"stop_failed {U}: {OWN_JOB.text} refused=True while_waits"]

    kit = run(test)
    assert kit.counters.errors["dbus_call_errors"] == 1


async def _held_for_d(kit: Kit, d_job: int = 12) -> None:
    """The victim's stop, for A (which needs nothing of it), refused for its own start
    (job 11) while D's start (job `d_job`) is queued behind it: held for both jobs."""
    _stopping_for_a(kit)
    kit.tracker.states[U] = U_STARTING
    kit.systemd.needers[U] = {"RequiredBy": [D]}
    kit.systemd.states[D] = UnitState(D, "inactive", "dead", d_job, "start")
    kit.systemd.answers = [OWN_JOB]
    kit.calls.send(kit.systemd.stop_unit, U, "stop")
    await kit.done()
    assert kit.executed[-1].endswith(f"refused=True while_waits for {D},{U}")
    kit.executed.clear()


@pytest.mark.parametrize("ends", ["d", "own", "own-unheard"])
def test_a_refusal_held_for_jobs_under_way_ends_once_when_one_of_them_ends(ends: str) -> None:
    """B's start with a long ExecStartPost=, D's queued behind it: once either job ends
    (its JobRemoved, or B's signal showing its start gone where that JobRemoved was lost),
    the core decides A's preemption again, not after B's whole run. Once: the same end told
    again, other jobs of these units and jobs of other units end nothing."""

    async def test(kit: Kit) -> None:
        await _held_for_d(kit)
        kit.calls.job_ended(13, D)  # a later job of D's
        kit.calls.job_ended(12, "other.service")
        kit.calls.unit_heard(U)  # its start still under way
        assert kit.executed == []
        if ends == "d":
            kit.calls.job_ended(12, D)
        elif ends == "own":
            kit.calls.job_ended(11, U)
        else:
            kit.tracker.states[U] = RUNNING
            kit.calls.unit_heard(U)
        assert kit.executed == [f"jobs_ended {U}"]
        for _ in range(100):  # a flood of the same signals
            kit.calls.job_ended(12, D)
            kit.calls.job_ended(11, U)
            kit.calls.unit_heard(U)
        assert kit.executed == [f"jobs_ended {U}"]

    run(test)


def test_a_stop_refused_again_after_the_jobs_ended_holds_again_for_the_new_jobs() -> None:
    """No busy loop: the stop asked again is refused for D's next start; it holds for that
    one alone, not for the jobs that ended."""

    async def test(kit: Kit) -> None:
        await _held_for_d(kit)
        kit.calls.job_ended(12, D)
        kit.executed.clear()
        kit.systemd.states[D] = UnitState(D, "inactive", "dead", 14, "start")
        kit.systemd.answers = [OWN_JOB]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()
        assert kit.executed == [
            f"stop_failed {U}: {OWN_JOB.text} refused=True while_waits for {D},{U}"
        ]
        kit.executed.clear()
        kit.calls.job_ended(12, D)
        assert kit.executed == []
        kit.calls.job_ended(14, D)
        assert kit.executed == [f"jobs_ended {U}"]

    run(test)


def test_a_refusal_held_while_its_waiter_needs_the_unit_does_not_end_with_a_job() -> None:
    """A `Requires=` the victim: the refusal holds while A waits, whatever job ends (a stop
    of it cancels A's start, however often tried)."""

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.tracker.states[U] = U_STARTING
        kit.systemd.needed[A] = {"Requires": [U]}
        kit.systemd.needers[U] = {"RequiredBy": [D, A]}
        kit.systemd.states[D] = D_QUEUED
        kit.systemd.answers = [OWN_JOB]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()
        assert kit.executed == [f"stop_failed {U}: {OWN_JOB.text} refused=True while_waits"]
        kit.calls.job_ended(12, D)
        kit.calls.job_ended(11, U)
        assert kit.executed[1:] == []

    run(test)


def test_a_call_raising_as_it_is_sent_fails_its_task_not_the_caller() -> None:
    def broken(name: str, queued: Queued) -> Awaitable[str]:
        raise RuntimeError("bug")

    async def test(kit: Kit) -> None:
        kit.calls.send(broken, U, "stop")
        with pytest.raises(RuntimeError, match="bug"):
            await kit.done()
        assert ("answered", U, "None", "stop") in kit.tracker.told

    run(test)


def test_an_answer_goes_to_the_tracker_and_a_failed_call_is_read_again_if_it_says_so() -> None:
    async def test(kit: Kit) -> None:
        kit.calls.send(answering([job_path(9)], []), U, "stop")
        await kit.done()
        assert kit.tracker.told == [("sent", U), ("queued", U, job_path(9), "stop")]
        kit.tracker.read_after_answer = True
        kit.calls.send(answering([MASKED], []), U, "start")
        await kit.done()
        assert kit.tracker.told[-1] == ("answered", U, "None", "start")
        assert kit.reads.asked == [("refresh", U)]

    run(test)


def test_an_instance_down_whose_call_failed_is_forgotten_once_answered() -> None:
    name = "embed@1.service"

    async def test(kit: Kit) -> None:
        kit.down.add(name)
        kit.calls.send(answering([MASKED], []), name, "start")
        await kit.done()
        assert kit.forgotten == [name]
        kit.calls.send(answering([job_path(9)], []), name, "start")  # told: a job of ours
        await kit.done()
        assert kit.forgotten == [name]

    run(test)


def test_a_call_cancelled_as_the_controller_stops_reads_and_forgets_nothing() -> None:
    """asyncio.run cancels a call still awaiting systemd's answer once run() returns (the
    state saved, STOPPING=1 sent). Read again then, its unit's state was taken in and
    decided on by a controller on its way out (a victim seen down: its waiter granted, more
    stops sent, none of it saved); an instance forgotten likewise. The next controller reads
    every unit anew."""
    name = "embed@1.service"

    async def cancelled(kit: Kit, unit: str, what: str) -> None:
        never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        kit.calls.send(lambda unit, queued: never, unit, what)
        await asyncio.sleep(0)  # it awaits its answer
        for task in kit.tasks:
            task.cancel()  # as asyncio.run does
        with pytest.raises(asyncio.CancelledError):
            await kit.done()

    async def test(kit: Kit) -> None:
        kit.tracker.read_after_answer = True  # its signals deferred while the call ran
        await cancelled(kit, U, "stop")
        kit.tracker.read_after_answer = False
        kit.down.add(name)
        await cancelled(kit, name, "start")
        assert kit.reads.asked == [] and kit.forgotten == [] and kit.executed == []

    run(test)


# ---- the stop timer ----


def test_a_stop_timer_is_armed_with_the_timeout_of_now_and_armed_anew_cancels_the_last() -> None:
    async def test(kit: Kit) -> None:
        kit.calls.arm_stop_timer(U)
        first = kit.calls._stop_timers[U]
        assert armed_for(first) == 5.0
        kit.timeout = 60.0  # a reload changed stop_timeout
        kit.calls.arm_stop_timer(U)
        assert first.cancelled() and armed_for(kit.calls._stop_timers[U]) == 60.0
        kit.calls.cancel_stop_timer(U)
        assert kit.calls._stop_timers == {}
        kit.calls.cancel_stop_timer(U)  # nothing armed: nothing to do

    kit = run(test)
    assert kit.executed == []


def test_a_stop_overdue_is_the_cores_with_its_timeout_and_leaves_no_timer() -> None:
    async def test(kit: Kit) -> None:
        kit.timeout = 2.5
        kit.calls.arm_stop_timer(U)
        fire(kit.calls._stop_timers[U])
        assert kit.executed == ["stop_overdue low.service after 2.5 s"]
        assert kit.calls._stop_timers == {}

    run(test)


def test_a_job_that_ends_while_the_jobs_are_read_ends_the_refusal_held_for_it() -> None:
    """D's start ends (its JobRemoved) between the read that shows it and the hold: the
    refusal, held for a job already gone, ends at once (else A waited for B's whole run)."""

    async def test(kit: Kit) -> None:
        await _refused_while_d_is_read(kit)
        kit.calls.job_ended(12, D)  # D's start, read as queued, ends before the hold
        kit.systemd.jobs_read.set()
        await kit.done()
        assert kit.executed[1:] == [f"jobs_ended {U}"]
        assert kit.calls._held_for == {} and kit.calls._ended == set()

    run(test)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("Transaction for low.service/stop is destructive (d.service has 'start' job queued", D),
        ("Transaction for low.service/stop is destructive (low.service has 'start' job", U),
        ("Transaction for low.service/stop is destructive (../x has 'start' job queued", None),
        ("Transaction for low.service/stop is destructive (d.service)", None),
        # the name is what comes before the first " has '" (no name holds a space)
        ("Transaction for low.service/stop is destructive (d.service has 'x' has 'y'", D),
        ("Transaction for other.service/stop is destructive (d.service has 'start'", None),
        ("Unit low.service is masked.", None),
    ],
)
def test_the_unit_a_refusal_names_is_read_only_from_systemds_form(
    text: str, named: str | None
) -> None:
    """systemd.job_named: the unit whose job is read after a refusal, a name no unit can
    have (a path) or a text of another form naming none."""
    error = SystemdError("org.freedesktop.systemd1.TransactionIsDestructive", text)
    assert job_named(error, U) == named
    assert job_named(SystemdError("org.freedesktop.DBus.Error.Failed", text), U) is None
