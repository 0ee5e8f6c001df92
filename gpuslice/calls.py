"""Our calls to systemd that queue a job (StartUnit, StopUnit), and what follows each.

A call is counted as in flight before it is sent (`send`), its answer taken in by the tracker
(a job of ours, or a failure read again). One that did not reach systemd (an error that
passes: gpuslice.systemd.is_transient) is sent again after a delay that doubles up to a cap,
while still wanted: a start once the core decides again, a stop once a read shows its unit
still running with no job. Systemd's refusal goes to the core as it is. A stop gets a timer:
its unit still up after `stop_timeout` is the core's `stop_overdue`.

The controller carries out what the core answers (`execute`) and runs the tasks (`spawn`); a
read that shows a stop job of ours is taken in as its signal would be (`on_unit_changed`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine
from typing import Any, Protocol

from gpuslice.core.scheduler import Action, Outcome, Phase, Scheduler, Start
from gpuslice.counters import Counters
from gpuslice.rereads import Rereads
from gpuslice.systemd import (
    DESTRUCTIVE,
    Queued,
    SystemdError,
    is_transient,
    job_named,
    job_path,
    refused_for_own_job,
)
from gpuslice.tracker import Kind, Tracker, UnitState, classify

log = logging.getLogger("gpuslice")

# A StartUnit or StopUnit of ours that did not reach systemd (an error of the bus, or of a
# systemd that is re-executing: gpuslice.systemd.is_transient) is sent again this long
# after, the delay doubling while it keeps failing so, up to CALL_RETRY_MAX: never a tight
# loop against a bus that fails at once (Calls._call_not_taken).
CALL_RETRY_FIRST = 1.0
CALL_RETRY_MAX = 30.0
# The longest a stop refused for its unit's own job waits for a read of what its waiter needs
# (Calls._over_own_job): the waiter waits meanwhile, and systemd answers a Get in
# milliseconds. Past it the refusal holds (the safe side).
NEEDS_READ_WAIT = 5.0
# The most units needing such a unit, directly or through others, whose jobs are read
# (Calls._jobs_need): one call reads them all, and past it the refusal holds (the safe side).
NEEDED_BY_MAX = 64
# The most job ends remembered while the jobs of the units that need a unit are read
# (Calls._ended): one of the jobs read may end before the refusal is held for it. Past it
# they are not remembered, and such a refusal holds while its waiter waits (the safe side).
ENDED_MAX = 4096
# How many times in a row a stop refused for another unit's job, that job gone by the read,
# is asked again at once (Calls._over_own_job): each time a job ended, but past it the
# refusal holds while its waiter waits (the safe side), never a loop of refusals.
ASKED_AGAIN_MAX = 3
# Systemd.stop_unit and Systemd.restart_preempted: they queue a job for a unit.
JobCall = Callable[[str, Queued], Awaitable[str]]


class StopsUnits(Protocol):
    """What a stop sent again is sent with: Systemd, looked up at each call (tests replace
    its methods)."""

    def stop_unit(self, name: str, queued: Queued | None = None) -> Awaitable[str]: ...

    def stop_unit_replacing(self, name: str, queued: Queued | None = None) -> Awaitable[str]: ...

    async def needs(self, name: str) -> dict[str, list[str]]: ...

    async def needed_by(self, name: str) -> dict[str, list[str]]: ...

    async def units_state(self, names: Collection[str]) -> list[UnitState]: ...


class UnitChanged(Protocol):
    """Controller.on_unit_changed: systemd's word of a unit, here a read's."""

    def __call__(self, name: str, props: dict[str, Any], *, read: bool = False) -> None: ...


async def _raising(error: Exception) -> str:
    raise error


class Calls:
    """The calls in flight, their retries and the stop timers. Everything else it touches
    is given: the core and the tracker (shared with the controller), the rereads, and the
    controller's callables (`down_instance`/`forget_instance`: an instance whose forget
    waited for a failed call's answer goes; `stop_timeout`: the config's, read at each stop)."""

    def __init__(
        self,
        scheduler: Scheduler,
        tracker: Tracker,
        reads: Rereads,
        counters: Counters,
        systemd: StopsUnits,
        execute: Callable[[list[Action]], None],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        on_unit_changed: UnitChanged,
        down_instance: Callable[[str], bool],
        forget_instance: Callable[[str], None],
        stop_timeout: Callable[[], float],
    ) -> None:
        self.scheduler = scheduler
        self.tracker = tracker
        self.reads = reads
        self.counters = counters
        self.systemd = systemd
        self.execute = execute
        self.spawn = spawn
        self.on_unit_changed = on_unit_changed
        self.down_instance = down_instance
        self.forget_instance = forget_instance
        self.stop_timeout = stop_timeout
        self._stop_timers: dict[str, asyncio.TimerHandle] = {}
        # (unit, "start" | "stop"): the last delay of a call that did not reach systemd, until
        # one goes through or is no longer wanted, and the timer that sends it again
        self._retry_delays: dict[tuple[str, str], float] = {}
        self._retry_timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        # units whose stop, its delay over, waits for a read of systemd's (_stop_again)
        self._stop_reads: set[str] = set()
        # units whose stop systemd refused only for jobs under way (`_over_own_job`): the
        # units of those jobs, with each job's number. The end of one is the end of the
        # refusal (`job_ended`), once: it is forgotten then
        self._held_for: dict[str, dict[str, int]] = {}
        # the reads of `_over_own_job` under way, and the jobs that ended meanwhile (unit,
        # number: up to ENDED_MAX), told to the refusal they hold once it is
        self._reading = 0
        self._ended: set[tuple[str, int]] = set()
        # units whose stop was asked again as the job it was refused for had ended by the
        # read: how many times in a row (ASKED_AGAIN_MAX)
        self._asked_again: dict[str, int] = {}

    def send(self, method: JobCall, unit: str, what: str) -> None:
        """Sent now (Systemd.send_call), counted as in flight before: a signal handled
        before the answer must not take the unit for one nobody is stopping. The caller
        has saved the state first (Controller.execute)."""
        self.tracker.call_sent(unit)
        if what == "stop":
            self._stop_reads.discard(unit)  # this one is sent again: a read under way is moot
            self._held_for.pop(unit, None)  # its refusal is over: this stop decides anew
        retry = self._retry_timers.pop((unit, what), None)
        if retry is not None:  # this call is the one sent again
            retry.cancel()
        told = [False]

        def queued(path: str) -> None:
            """Systemd's answer, read before the signals it sent after it (the task
            awaiting the answer resumes only once they are handled): the unit it stops is
            seen down as preempted at once, not read again (issue 10: 3 ms of an idle GPU)."""
            told[0] = True
            if self.tracker.call_queued(unit, path, what):
                self.spawn(self.reads.refresh(unit))

        try:
            answer = method(unit, queued)
        except Exception as e:  # raised while sending: the task reports it, as it did
            answer = _raising(e)
        self.spawn(self._call(answer, told, unit, what))

    async def _call(self, answer: Awaitable[str], told: list[bool], unit: str, what: str) -> None:
        job: str | None = None
        try:
            job = await answer
        except SystemdError as e:
            if what == "stop" and refused_for_own_job(e, unit):
                await self._over_own_job(unit, e)
                return
            self.counters.error("dbus_call_errors")
            if is_transient(e):
                self._call_not_taken(unit, what, e)
                return
            self._retry_delays.pop((unit, what), None)
            if what == "stop" and e.name == DESTRUCTIVE:
                # for another unit's job (Systemd.stop_unit): the waiter's start, which needs
                # the unit, or the job of a unit that needs it, whichever systemd found first
                await self._over_own_job(unit, e, own=False)
                return
            log.error("%s %s failed: %s", what, unit, e.text)
            if what == "start":
                self.execute(self.scheduler.inactive(unit, Outcome.FAILED))
            else:
                self.cancel_stop_timer(unit)
                # a refusal held for jobs since this stop was sent (that of a stop sent
                # before it) stays theirs: the core, no longer stopping the unit, keeps it
                # and ignores this one (Scheduler.stop_failed); forgotten here, the end of
                # its jobs went untold and it held for the unit's whole run
                self.execute(self.scheduler.stop_failed(unit, e.text, refused=True))
        else:
            self._asked_again.pop(unit, None)
            if self._retry_delays.pop((unit, what), None) is not None:
                doing = "starting" if what == "start" else "stopping"
                log.info("%s %s reached systemd: sent again, it went through", doing, unit)
        finally:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # the controller stops (asyncio.run cancels its tasks once run() returns):
                # read again, the unit's state was decided on by a controller on its way out,
                # after its last save (a victim seen down: its waiter granted, more stops
                # sent). The next one reads every unit anew
                pass
            elif not told[0] and self.tracker.call_answered(unit, job, what):
                await self.reads.refresh(unit)
            elif not told[0] and self.down_instance(unit):
                # the call failed (`queued` tells every answer), so no job of ours ends the
                # instance: one whose forget waited for this answer (dropped past
                # PREEMPTED_INSTANCES_MAX meanwhile) goes now. Kept, it stayed known,
                # dormant, until a down that may never come (its name is one job's)
                self.forget_instance(unit)

    async def _over_own_job(self, unit: str, refusal: SystemdError, *, own: bool = True) -> None:
        """A stop of ours refused in mode "fail" for the unit's own job (its start still under
        way past its gate), or (not `own`) for another unit's. Systemd names one conflicting
        job: the start of the waiter the stop is for, queued in the same transaction when it
        `Requires=` the unit, may conflict too, and a stop sent again in mode "replace"
        cancelled it (taken for someone's stop: held). So what the waiter needs is read
        first (Systemd.needs, within NEEDS_READ_WAIT): where it needs the unit, the refusal
        holds while it waits, as one that names its start; else (its own job) the stop is
        sent again in mode "replace". The resend cancelled a third unit's start too, one
        queued behind the unit's own (`Requires=` + `After=` it: `systemctl start d`): a
        user's start silently undone. So the jobs of the units that need the unit are read
        too (`_jobs_need`): where one has a job, the refusal holds as one naming it would
        (systemd names whichever it finds first). Where the waiter does not need the unit,
        that refusal stands only for jobs under way, the unit's own start and those read: it
        ends when one of them ends (`job_ended`). Held while the waiter waited, an urgent
        start waited for the whole run of a unit whose start merely had a long
        `ExecStartPost=`. A refusal naming another unit's job reads that unit's job too:
        gone by then (its end heard before the read began), the stop is asked again,
        ASKED_AGAIN_MAX times in a row at most; past it, or where the refusal names no unit,
        it holds while the waiter waits (the safe side). A read that fails or hangs takes
        the safe side, the refusal: the unit keeps running and the waiter waits for it or
        for other GPUs, where a stop wrongly sent cancels a start for good."""
        waiter = self.scheduler.stopping_for(unit)
        named = None if own else job_named(refusal, unit)
        self._reading += 1
        try:
            needed = waiter is not None and await self._needs(waiter, unit)
            # read too where the waiter is gone meanwhile; with the unit the refusal names
            jobs = await self._jobs_need(unit, named)
        finally:
            self._reading -= 1
            ended = set(self._ended)  # no signal comes between here and the hold: no await
            if not self._reading:
                self._ended.clear()
        if self.scheduler.phase(unit) is not Phase.STOPPING:
            return  # down meanwhile, or no longer stopped: whoever changed that decides
        now = self.scheduler.stopping_for(unit)
        if now is not None and now != waiter:  # for another waiter since, its needs unread
            log.info("stopping %s refused for a job under way: asked again for %s", unit, now)
            self.cancel_stop_timer(unit)
            self.execute(self.scheduler.stop_failed(unit, refusal.text, refused=False))
        elif named and not needed and jobs == {} and self._ask_again(unit):
            # the job it names ended between the refusal and the read (its JobRemoved came
            # before the read began): the refusal is over
            log.info("stopping %s refused for a job of %s, ended since: asked again", unit, named)
            self.cancel_stop_timer(unit)
            self.execute(self.scheduler.stop_failed(unit, refusal.text, refused=False))
        elif (needed and now is not None) or jobs is None or jobs or not own:
            log.error("stop %s failed: %s", unit, refusal.text)
            self.cancel_stop_timer(unit)
            held: dict[str, int] = {}
            if not (needed and now is not None) and jobs:
                started = self.tracker.state(unit).job_id  # its start, if still under way
                held = {**jobs, unit: started} if started else dict(jobs)
            self._held_for.pop(unit, None)  # a guard: `send` forgot any hold already
            refused = self.scheduler.stop_failed(
                unit, refusal.text, refused=True, while_waits=True, jobs=tuple(sorted(held))
            )
            if held:
                self._held_for[unit] = held
            self.execute(refused)
            gone = sorted(job for job in held.items() if job in ended)
            if gone:  # it ended during the reads: its JobRemoved came before the hold
                self.job_ended(gone[0][1], gone[0][0])
        else:  # nobody waits who needs it, nor has a job
            self.send(self.systemd.stop_unit_replacing, unit, "stop")

    async def _needs(self, waiter: str, unit: str) -> bool:
        """Whether `waiter` needs `unit` (`Requires=`, `BindsTo=`, `PartOf=`: a stop of it
        cancels the waiter's start), as systemd says within NEEDS_READ_WAIT; True when that
        read fails or hangs (the safe side, Calls._over_own_job)."""
        try:
            needs = await asyncio.wait_for(self.systemd.needs(waiter), NEEDS_READ_WAIT)
            return any(unit in units for units in needs.values())
        except Exception as e:  # whatever failed or hung, and a reply of any form
            self.counters.error("dbus_call_errors")
            log.warning("cannot read what %s needs: %s; %s not stopped", waiter, e, unit)
            return True

    def _ask_again(self, unit: str) -> bool:
        """Whether the unit's stop may be asked again at once (ASKED_AGAIN_MAX in a row)."""
        times = self._asked_again.get(unit, 0)
        if times >= ASKED_AGAIN_MAX:
            return False
        self._asked_again[unit] = times + 1
        return True

    async def _jobs_need(self, unit: str, named: str | None = None) -> dict[str, int] | None:
        """The units that need `unit` (its RequiredBy=, BoundBy=, ConsistsOf=, and theirs:
        `_needers`) with a job but a stop, which a stop of `unit` in mode "replace" cancels
        (a start queued behind its start, or under way beside it), each with its job's
        number. Read within NEEDS_READ_WAIT (the units' needs, then their jobs, one call
        each); None when the read fails or hangs, or more than NEEDED_BY_MAX units need it
        (the safe side, `_over_own_job`). `named`: the unit a refusal names, its job read
        with theirs."""

        async def read() -> dict[str, int]:
            needers = await self._needers(unit)
            if named is not None and named != unit:
                needers.add(named)
            states = await self.systemd.units_state(needers) if needers else []
            jobs: dict[str, int] = {}
            for state in states:
                if state.job_id != 0 and state.job_type != "stop":
                    if type(state.job_id) is not int:  # a reply of any form
                        raise ValueError(f"job {state.job_id!r} is no number")
                    jobs[str(state.name)] = state.job_id
            return jobs

        try:
            jobs = await asyncio.wait_for(read(), NEEDS_READ_WAIT)
        except Exception as e:  # whatever failed or hung, and a reply of any form
            self.counters.error("dbus_call_errors")
            log.warning("cannot read the jobs of the units that need %s: %s; not stopped", unit, e)
            return None
        if jobs:
            log.warning(
                "stopping %s would cancel the jobs of %s, which need it: not stopped",
                unit,
                ", ".join(sorted(jobs)),
            )
        return jobs

    async def _needers(self, unit: str) -> set[str]:
        """Every unit a stop of `unit` reaches: those that need it, and those that need them
        (a stop of D, which `Requires=` B, stops F, which `Requires=` D: read one level
        deep, F's queued start was cancelled by B's stop sent again in mode "replace").
        Each level is read at once; past NEEDED_BY_MAX units in all, ValueError."""
        found: set[str] = set()
        level = [unit]
        while level:
            reads = await asyncio.gather(*(self.systemd.needed_by(u) for u in level))
            new = {str(u) for read in reads for units in read.values() for u in units}
            new -= found | {unit}
            found |= new
            if len(found) > NEEDED_BY_MAX:
                raise ValueError(f"{len(found)} units need it, more than {NEEDED_BY_MAX}")
            level = sorted(new)
        return found

    def job_ended(self, job_id: int, unit: str) -> None:
        """Systemd's JobRemoved (or a signal showing the unit's job gone, `unit_heard`): a
        refusal held for that job ends, once (Scheduler.jobs_ended): the waiter's preemption
        is decided anew, and a stop refused again holds again. A job's end comes once, so a
        flood of signals sends no flood of stops."""
        if self._reading and len(self._ended) < ENDED_MAX:
            self._ended.add((unit, job_id))
        for victim, jobs in list(self._held_for.items()):
            if jobs.get(unit) != job_id:
                continue
            del self._held_for[victim]
            if victim in self.scheduler.held_for_jobs:
                log.info(
                    "job %d of %s ended, for which stopping %s was refused: it may be "
                    "stopped again",
                    job_id,
                    unit,
                    victim,
                )
            self.execute(self.scheduler.jobs_ended(victim))

    def unit_heard(self, unit: str) -> None:
        """Systemd's word on a unit whose stop was refused for its own job: that job gone
        (its JobRemoved lost on the bus), the refusal ends as at its end (`job_ended`)."""
        job = self._held_for.get(unit, {}).get(unit)
        if job is not None and self.tracker.state(unit).job_id != job:
            self.job_ended(job, unit)

    def _call_not_taken(self, unit: str, what: str, error: SystemdError) -> None:
        """A StartUnit or StopUnit of ours did not reach systemd, for an error that passes
        (systemd re-executing, its name without an owner for a moment, the bus daemon's
        limits: gpuslice.systemd.TRANSIENT_ERRORS). Taken for systemd's refusal, a preempted
        unit whose start failed so was recorded failed and never came back, and a victim
        whose stop failed so was never asked again, its waiter left behind it for as long as
        it ran. Both are sent again after a delay (CALL_RETRY_FIRST, doubling up to
        CALL_RETRY_MAX), if still wanted then; the journal says so once until one goes
        through."""
        key = (unit, what)
        first = key not in self._retry_delays
        delay = self._retry_later(unit, what)
        why = f"{error.text} ({error.name})"
        log.debug("%s %s did not reach systemd: %s; sent again in %g s", what, unit, why, delay)
        if what == "start":
            # the core says it (once), owes the start as before, and releases its GPUs
            self.execute(self.scheduler.start_failed(unit, why))
        elif first:
            log.warning(
                "stopping %s did not reach systemd: %s; sent again in %g s, and until "
                "systemd takes it (said once)",
                unit,
                why,
                delay,
            )

    def _retry_later(self, unit: str, what: str) -> float:
        """Arm the timer that sends the call again (`_send_again`), its delay doubled from
        the last one (CALL_RETRY_FIRST, up to CALL_RETRY_MAX); the delay."""
        key = (unit, what)
        delay = min(self._retry_delays.get(key, CALL_RETRY_FIRST / 2) * 2, CALL_RETRY_MAX)
        self._retry_delays[key] = delay
        old = self._retry_timers.pop(key, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._retry_timers[key] = loop.call_later(delay, self._send_again, unit, what)
        return delay

    def _send_again(self, unit: str, what: str) -> None:
        """The delay after a call that did not reach systemd is over. A start: the core
        decides again whether to send it (`Scheduler.retry_start`). A stop: while the core
        still stops the unit and its signals show no job for it, systemd is asked first
        (`_stop_again`). Not wanted any more: forgotten."""
        key = (unit, what)
        self._retry_timers.pop(key, None)
        if what == "start":
            actions = self.scheduler.retry_start(unit)
            self.execute(actions)
            if not any(isinstance(a, Start) and a.unit == unit for a in actions):
                self._retry_delays.pop(key, None)  # started later, if ever: a new story
            return
        if self._stop_unsent(unit):
            self.spawn(self._stop_again(unit))
        else:
            self._retry_delays.pop(key, None)

    def _stop_unsent(self, unit: str) -> bool:
        """The core still stops the unit and its signals show it running with no job (or at
        its gate): no stop of ours is known to have reached systemd."""
        state = self.tracker.state(unit)
        kind = classify(state)
        unsent = kind is Kind.GATE or (kind is Kind.RUNNING and state.job_id == 0)
        return unsent and self.scheduler.phase(unit) is Phase.STOPPING

    async def _stop_again(self, unit: str) -> None:
        """A stop is sent again only if a read shows the unit still running with no job. A
        StopUnit whose answer the bus daemon dropped (NO_REPLY after CALL_TIMEOUT: anyone can
        flood our queue) may have reached systemd, its job's signals dropped too: sent again
        on the signals' word, it merged into our own job, announced before it, and the
        tracker took that for someone's stop: the victim was held, never brought back. A
        stop job the read shows is ours (the core still stops the unit, and sent a stop),
        unless announced before ours was sent (Tracker.stop_found): taken in, its end a
        preemption; one that shows it down is taken in at a second look. A read that fails,
        or that systemd's word on the unit since has made stale, is tried again after the
        next delay."""
        key = (unit, "stop")
        self._stop_reads.add(unit)
        try:
            state = await self.reads.read_fresh(unit, self.tracker.heard(unit))
        finally:
            sent = unit not in self._stop_reads
            self._stop_reads.discard(unit)
        if sent or key not in self._retry_delays:
            return  # a stop sent meanwhile tells: its answer, or the retry its failure arms
        if not self._stop_unsent(unit):
            self._retry_delays.pop(key, None)  # not wanted any more: forgotten
            return
        if state is None:
            delay = self._retry_later(unit, "stop")
            log.debug(
                "cannot tell whether stopping %s reached systemd; read again in %g s", unit, delay
            )
            return
        kind = classify(state)
        # at its gate with a stop job (one waiting its turn): ours, maybe, as when running
        gate = kind is Kind.GATE and state.job_type != "stop"
        if gate or (kind is Kind.RUNNING and state.job_id == 0):
            self.send(self.systemd.stop_unit, unit, "stop")
            return
        self._retry_delays.pop(key, None)
        if state.job_type != "stop":
            # down (our stop ran, its signals lost too?), or a job not ours: taken in once a
            # second look still shows it (Rereads.confirm)
            self.reads.confirm(unit)
            return
        path = job_path(state.job_id)
        if self.tracker.stop_found(unit, path):
            log.info(
                "stopping %s reached systemd: its answer was lost, its job %d runs",
                unit,
                state.job_id,
            )
        props = {"ActiveState": state.active, "SubState": state.sub, "Job": (state.job_id, path)}
        self.on_unit_changed(unit, props, read=True)

    def arm_stop_timer(self, unit: str) -> None:
        """A stop sent: its unit still up after `stop_timeout` is overdue (`_stop_overdue`);
        a timer armed before for the unit goes."""
        self.cancel_stop_timer(unit)
        timeout = self.stop_timeout()
        loop = asyncio.get_running_loop()
        self._stop_timers[unit] = loop.call_later(timeout, self._stop_overdue, unit, timeout)

    def cancel_stop_timer(self, unit: str) -> None:
        """The unit went down, or its stop failed: nothing is overdue."""
        timer = self._stop_timers.pop(unit, None)
        if timer is not None:
            timer.cancel()

    def _stop_overdue(self, unit: str, timeout: float) -> None:
        self._stop_timers.pop(unit, None)
        self.execute(self.scheduler.stop_overdue(unit, f"{timeout:g} s"))
