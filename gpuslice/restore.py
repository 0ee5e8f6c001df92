"""Start-up's restore: what the core kept in the saved state, checked against what systemd shows.

A controller that starts finds units that went on while none ran: holders that ended, were
stopped by hand, or were started again; starts of ours that died with the last controller;
units running that the saved state does not name; starts waiting at their gate. Once the core
has loaded the saved state and the tracker systemd's list of units, `stopped_while_away` asks
the journal (and systemd's record of each main process) which of the holders found down a
stop job ended, `queued_free` which queued starts wait for no GPU unit's start, `rebuild`
takes in what systemd shows and decides once, and
`sweep_env_files` removes the env files of units that ended meanwhile. The core's books name
GPUs by NVML index; `remember_told` reads back, by UUID, the GPUs each holder was told.

The controller runs these in order (Controller.start) and carries out the actions; everything
else is given: the core, the tracker, systemd's record of main processes, the counters, the
journal's answers (`ask_journal`), the runtime_dir, the annotations (`spec_for`), the
inventory's word on UUIDs and a new sample (`remember_gpus`, `resample`), and whether a
rescan is due, with the starts it holds back (`rescan_due`, `hold_for_rescan`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from gpuslice import envfiles, stopjournal
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import PREEMPTED_IN_PLACE, Action, Phase, Scheduler
from gpuslice.counters import Counters
from gpuslice.paths import ENV_DIR_NAME
from gpuslice.queued import JobsWaitedFor, starts_waited_for
from gpuslice.systemd import SystemdError
from gpuslice.tracker import (
    Kind,
    MainExit,
    Tracker,
    UnitState,
    at_condition,
    bound_for_gate,
    classify,
    still_released,
    stopped_by_a_job,
)

log = logging.getLogger("gpuslice")

# Entries of RUNTIME_DIR/env a controller start looks at for the env files of units that
# ended while no controller ran (Restore.sweep_env_files): at most this many entries
# read (~15 ms) and removals (5 system calls each, ~0.3 s on tmpfs for all of them: a start
# usually finds a few, the units that ran when the last controller stopped). The rest, if
# any (a /run filled before instances lost their file when they went down), goes at the
# next start.
ENV_SWEEP_MAX = 8192
# Phases of a holder whose end, found down at start-up, is asked of the journal, or read from
# systemd's record of its main process (Restore.stopped_while_away): a unit gpuslice was
# stopping is preempted however it went down, and a suspended one found inactive is held
# already (frozen, it cannot have ended).
_READ_IF_DOWN = frozenset({Phase.RUNNING, Phase.STARTING, Phase.FROZEN})
# ... and of a unit found failed: frozen or suspended, one whose main process exited non-zero
# on a stop's SIGTERM (143) is held, not failed, where a stop job ended it
# (Tracker._stopped_frozen); any other that failed failed.
_READ_IF_FAILED = frozenset({Phase.FROZEN, Phase.SUSPENDED})
# Queued starts (not at their gate yet) whose wait for other units' starts start-up reads
# (Restore.queued_free, Job.GetBefore, queued.WAITED_FOR_READS each), the most urgent first:
# at most this many, all read at once, and waited for at most QUEUED_READ_WAIT s (a job
# queue of thousands, or a systemd slow to answer, must not hold start-up). Any other is
# neither queued at once nor keeps a place: its gate asks, as any start's.
QUEUED_READ_MAX = 64
QUEUED_READ_WAIT = 5.0
# stopjournal.ask: whether systemd's journal shows a stop job ending each unit's last run.
AskJournal = Callable[[Sequence[str]], Awaitable[Mapping[str, stopjournal.Answer]]]


def _queued(state: UnitState) -> bool:
    """A start job is queued for the unit, which has not reached its gate (`bound_for_gate`)."""
    return bound_for_gate(state) and classify(state) is not Kind.GATE


def _end_asked(phase: Phase | None, active: str) -> bool:
    """Whether the end of a unit in this phase, found down with no job at start-up (one
    systemd unloaded shows inactive), is asked of the journal (`stopped_while_away`)."""
    return (phase in _READ_IF_DOWN and active == "inactive") or (
        phase in _READ_IF_FAILED and active == "failed"
    )


class MainExits(JobsWaitedFor, Protocol):
    """Systemd's record of how a service's main process last ended (Systemd.main_exit), and
    the jobs a job waits for (Systemd.jobs_waited_for)."""

    async def main_exit(self, name: str) -> MainExit: ...


class Restore:
    """What start-up rebuilds from the saved state and systemd, once; holds nothing of its own."""

    def __init__(
        self,
        scheduler: Scheduler,
        tracker: Tracker,
        systemd: MainExits,
        counters: Counters,
        ask_journal: Callable[[], AskJournal | None],
        runtime_dir: str,
        spec_for: Callable[[str], UnitSpec | None],
        remember_gpus: Callable[[Mapping[int, str]], bool],
        resample: Callable[[], list[Gpu]],
        rescan_due: Callable[[], bool],
        hold_for_rescan: Callable[[str], None],
    ) -> None:
        self.scheduler = scheduler
        self.tracker = tracker
        self.systemd = systemd
        self.counters = counters
        # the journal's answers (Controller.ask_journal, stopjournal.ask under systemd);
        # None: not asked, each main process's record decides
        self.ask_journal = ask_journal
        self.runtime_dir = runtime_dir  # this boot's, never changed (Controller._keep_paths)
        self.spec_for = spec_for
        self.remember_gpus = remember_gpus  # Inventory.remember
        self.resample = resample  # GpuWatch.resample
        # a daemon-reload ended since start-up read the unit files (Rescans.again),
        # and the starts at their gate that wait for its rescan (Rescans.after_scan)
        self.rescan_due = rescan_due
        self.hold_for_rescan = hold_for_rescan

    async def stopped_while_away(self) -> set[str]:
        """The holders the last controller saw running or starting (or froze) that systemd
        shows down with no job (or no longer loads), or frozen or suspended that it shows
        failed (a frozen process cannot fail by itself), and that a stop job ended: stopped by
        hand while no controller ran, they are held, not finished (a reboot forgets finished
        units, and refill started them again). No signal told how they ended, and the state
        systemd lists is the same for a unit that ended by itself. The journal says it first
        (`ask_journal`: PID 1's "Stopped" after a stop job, or its "Starting" with none
        after, the better word: a unit that trapped SIGTERM and exited 0, or one systemd
        unloaded with its record, is told too, and a `kill` of the main process is an end by
        itself, as while a controller runs); where it cannot tell, systemd's record of the
        main process of a loaded unit (`stopped_by_a_job`). Asked of those few only; an
        answer that fails, or that a signal of the unit overtook, leaves the unit to be
        taken as it was before (finished); `_end_asked` says which units are asked.
        Scheduling is deferred meanwhile: a timer's sample decides nothing before `rebuild`."""
        core = self.scheduler
        names = [
            name
            for name in sorted(core.grants().keys() | set(core.suspended_units()))
            if name.endswith(".service")
            and classify(self.tracker.state(name)) is Kind.DOWN
            and _end_asked(core.phase(name), self.tracker.state(name).active)
        ]
        if not names:
            return set()
        heard = {name: self.tracker.heard(name) for name in names}
        with core.deferred():
            told = await self._ask_journal(names)
            # loaded: systemd unloaded the others with their record (a Get loads one anew);
            # inactive: the record tells no failed one stopped (`stopped_by_a_job`)
            unknown = [
                n
                for n in names
                if told.get(n) is None
                and n in self.tracker.states
                and self.tracker.state(n).active == "inactive"
            ]
            found = await asyncio.gather(*(self._main_exit(name) for name in unknown))
        mains = dict(zip(unknown, found, strict=True))
        stopped: set[str] = set()
        for name in names:
            if self.tracker.heard(name) != heard[name]:
                continue
            main = mains.get(name)
            if told.get(name):
                log.debug(
                    "%s was stopped while no controller ran (the journal shows systemd's stop "
                    "job ending it)",
                    name,
                )
                stopped.add(name)
            elif main is not None and stopped_by_a_job(self.tracker.state(name), main):
                log.debug(
                    "%s was stopped while no controller ran (its main process was killed by "
                    "signal %d)",
                    name,
                    main.status,
                )
                stopped.add(name)
        return stopped

    async def _ask_journal(self, names: Sequence[str]) -> dict[str, bool | None]:
        """Whether a stop job ended each unit's last run, as the journal says (None: it
        cannot tell); one line for those it could not tell of."""
        ask = self.ask_journal()
        if ask is None:
            return {}
        answers = await ask(names)
        said = stopjournal.unknown_line(answers)
        if said is not None:
            failed, text = said
            log.log(
                logging.WARNING if failed else logging.INFO,
                "the journal cannot tell whether systemd stopped %s: judged by how systemd "
                "recorded the main process ending (a unit it no longer loads: ended by itself)",
                text,
            )
        return {name: answers[name].stopped if name in answers else None for name in names}

    async def _main_exit(self, name: str) -> MainExit | None:
        try:
            return await self.systemd.main_exit(name)
        except SystemdError as e:
            self.counters.error("dbus_call_errors")
            log.warning(
                "cannot read how the main process of %s ended (%s): taken for ended by itself",
                name,
                e.text,
            )
            return None

    async def queued_free(self) -> dict[str, int]:
        """The queued starts of annotated units (a start job, not at its gate yet) whose job
        waits for no start of an annotated unit (queued.starts_waited_for), by unit: the job
        read. Read for the starts `rebuild` may queue at once (unknown to the core) or keep a
        place for (`Scheduler.keeps_place`, a start of ours): queued, or keeping GPUs, behind
        the start of a GPU unit, they kept that unit's gate waiting for those GPUs while
        their start waited for its start, and neither ran. At most QUEUED_READ_MAX of them,
        the most urgent first, read at once, for at most QUEUED_READ_WAIT s; one read that
        fails or is not over by then is not free (`rebuild`: its gate asks)."""
        core = self.scheduler
        found = []
        for state in self.tracker.states.values():
            spec = self.spec_for(state.name)
            if (
                spec is not None
                and _queued(state)
                and not core.is_waiting(state.name)
                and (core.phase(state.name) is not Phase.STARTING or core.keeps_place(state.name))
            ):
                found.append((spec.priority, state.name, state.job_id))
        chosen = sorted(found)[:QUEUED_READ_MAX]
        if not chosen:
            return {}
        reads = [asyncio.ensure_future(starts_waited_for(self.systemd, j)) for _, _, j in chosen]
        done, pending = await asyncio.wait(reads, timeout=QUEUED_READ_WAIT)
        for read in pending:
            read.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        free: dict[str, int] = {}
        unread = []
        for (_, name, job), read in zip(chosen, reads, strict=True):
            waited = None
            if read in done and read.exception() is None:
                waited = read.result()
            elif read in done:  # a reply of no form the adapter knows: start-up goes on
                log.warning("cannot read the jobs %s waits for: %r", name, read.exception())
            if waited is None:
                unread.append(name)
            elif not any(self.spec_for(u) is not None for u in waited):
                free[name] = job
        if unread:
            self.counters.error("dbus_call_errors", len(unread))
        if unread or len(found) > len(chosen):
            log.info(
                "cannot tell whether %d queued starts wait for a GPU unit's start (%s): each "
                "is judged when its gate asks",
                len(unread) + len(found) - len(chosen),
                ", ".join(unread[:8]) or f"more than {QUEUED_READ_MAX} queued",
            )
        return free

    def rebuild(
        self, stopped: Collection[str] = frozenset(), free: Mapping[str, int] | None = None
    ) -> list[Action]:
        """Take in what systemd shows, then decide once: restored holders that ended while
        we were away (a frozen or suspended one systemd shows starting again among them,
        `started_again`) are recorded as finished, failed, preempted or held (`stopped`:
        `stopped_while_away`), but a start of ours that systemd shows no job for is sent
        again (Scheduler.start_lost); a stop we had asked
        for that systemd no longer runs is given up; running units we did not know, or
        knew only as starting, are adopted (once the ended ones released their GPUs);
        units at their gate (but one someone stops there, `Tracker.listed`: held), or
        whose start job waits for us to be ready, queue at once
        (their gate calls within a second), so a released GPU goes to them before any
        preempted unit comes back, unless a daemon-reload ended since the unit files were
        read: they wait for its rescan (`hold_for_rescan`), as a start does while one runs
        (Rescans.hold_gate). A start queued, not at its gate yet, does so only where
        `free` (`queued_free`) names its job: one behind a GPU unit's start, or not read, is
        known at its gate, and a start of ours keeps no GPUs for it (Scheduler.start_waits).
        A start job that is cancelled instead removes its waiter as usual (JobRemoved, then
        the unit is read down)."""
        actions: list[Action] = []
        with self.scheduler.deferred():
            for name, _ in self.scheduler.grants().items():
                state = self.tracker.state(name)
                kind = classify(state)
                if kind is Kind.DOWN:
                    # no job: a StartUnit of ours may have died with the last controller
                    lost = self.scheduler.start_lost(name) if state.job_id == 0 else []
                    outcome = self.tracker.outcome(state, stopped=name in stopped)
                    actions += lost or self.scheduler.inactive(name, outcome)
                elif self.started_again(name, state):
                    actions += self.scheduler.inactive(name, self.tracker.outcome(state))
                elif (
                    kind is Kind.RUNNING
                    and self.scheduler.phase(name) is Phase.STOPPING
                    and state.job_id == 0
                ):
                    why = "its stop was lost while the controller was away"
                    actions += self.scheduler.stop_failed(name, why, refused=False)
            for name in self.scheduler.suspended_units():  # stopped by hand while we were away
                state = self.tracker.state(name)
                if classify(state) is Kind.DOWN or self.started_again(name, state):
                    outcome = self.tracker.outcome(state, stopped=name in stopped)
                    actions += self.scheduler.inactive(name, outcome)
            for name in self.scheduler.requeued_away():
                # a comeback whose wait at its gate ended while we were away (its
                # TimeoutStartSec=): owed as before, not forgotten with its start
                state = self.tracker.state(name)
                if classify(state) is Kind.DOWN:
                    actions += self.scheduler.inactive(name, self.tracker.outcome(state))
            for name in sorted(self.scheduler.remained):
                # finished, released and kept active: stopped while we were away (its next
                # start, at its gate or running, is taken in below as any)
                state = self.tracker.state(name)
                if classify(state) is Kind.DOWN:
                    actions += self.scheduler.inactive(name, self.tracker.outcome(state))
            states = sorted(self.tracker.states.values(), key=lambda s: s.name)
            for state in states:
                # one saved starting that runs was granted, and the last controller killed
                # before the grant was saved (execute answers a gate first): kept starting,
                # it was moved back to waiting for a more urgent start, beside its own job
                if classify(state) is Kind.RUNNING and self.scheduler.phase(state.name) in (
                    None,
                    Phase.STARTING,
                ):
                    if still_released(state) and state.name in self.scheduler.remained:
                        continue  # finished, its GPUs released: kept active by systemd
                    actions += self.scheduler.running(state.name, self._told_gpus(state.name))
            if self.remember_told():  # those adopted: checked before anything is granted
                self.scheduler.set_gpus(self.resample())  # as start-up's first sample
            free = free or {}
            for state in states:
                spec = self.spec_for(state.name)
                if (
                    spec is not None
                    and self.tracker.leaving(state.name)
                    and self.scheduler.phase(state.name) is None
                    and not self.scheduler.is_waiting(state.name)
                ):
                    # someone's stop waits at its gate (Tracker.listed): held, as a waiter
                    # told down there (Tracker.stopped_at_gate); queued, it preempted less
                    # urgent units for a unit being stopped, and a background one left
                    # unheld was refilled, its start replacing that stop
                    outcome = self.tracker.outcome(state, stopped=True)
                    actions += self.scheduler.inactive(state.name, outcome)
                    continue
                if spec is not None and _queued(state) and free.get(state.name) != state.job_id:
                    # behind a GPU unit's start, or not read (`queued_free`): neither queued
                    # now nor keeping a place (a start of ours), its gate asks
                    actions += self.scheduler.start_waits(state.name)
                    continue
                if (
                    bound_for_gate(state)
                    and not at_condition(state)  # known at its gate, if it gets there
                    and spec is not None
                    and self.scheduler.phase(state.name) is None
                    and not self.scheduler.is_waiting(state.name)
                ):
                    if self.rescan_due():
                        # a daemon-reload ended since start-up read the unit files, and
                        # systemd already runs the new ones: judged once the rescan is read
                        # (Controller._gates_after_scan), not on an annotation it may no
                        # longer have
                        self.hold_for_rescan(state.name)
                    else:
                        actions += self.scheduler.request(spec)
            actions += self.scheduler.recover()  # caught between suspend and resume
        # held for stops while no controller ran: no SystemState read says now how the host
        # was then (a shutdown's would have ended the boot), and an instance kept for one
        # (Scheduler.forget_instance) stayed held for ever
        self.scheduler.holds_confirmed(list(self.scheduler.unconfirmed_holds))
        return actions + self.scheduler.schedule()

    def _told_gpus(self, unit: str) -> list[int]:
        """The GPUs a running unit the saved state does not name was last told (its env
        file), a hint the core takes where they fit: placed anywhere free instead (the state
        file lost, set aside or from another version), its books named other GPUs than those
        it runs on, and the GPU it really uses was granted again once the one it was booked
        on ended."""
        found = envfiles.told_gpus(self.runtime_dir, unit)
        if found:
            log.info("%s runs without a saved grant: GPUs %s from its env file", unit, found)
        return found

    def remember_told(self) -> bool:
        """Tell the inventory which GPU, by UUID, each holder past its gate was granted (its
        env file; a starting one's is an earlier run's), and the core that and which GPU
        each suspended unit was suspended from. The books name GPUs by NVML index, and the NVML
        this controller opened may number them otherwise than the last one's (a card gone
        off the bus, the driver reloaded meanwhile): the index a unit holds may be another
        GPU now, and its own GPU the one the books say is free (Inventory); a suspended
        unit's processes wake on their own GPU, whatever its index (Suspended), a holder
        suspended later too (Holder.uuids). Whether
        the inventory learned a GPU it had booked otherwise (a new sample then shows it)."""
        learned = False
        for name, gpus in self.scheduler.grants().items():
            if self.scheduler.phase(name) is Phase.STARTING:
                continue
            told = envfiles.told_uuids(self.runtime_dir, name)
            if set(told) == gpus:
                learned |= self.remember_gpus(told)
                self.scheduler.remember_uuids(name, told)  # what a suspend of it takes along
        for name in self.scheduler.suspended_units():
            self.scheduler.remember_uuids(name, envfiles.told_uuids(self.runtime_dir, name))
        return learned

    def started_again(self, name: str, state: UnitState) -> bool:
        """Whether a unit frozen or suspended (or being suspended or resumed) is shown
        starting afresh: at its gate, or down with a start job queued. Only a unit past its
        gate is in those phases, so it was stopped while we were away, or restarted
        (systemd thaws a frozen unit to stop it), and started again: that run ended. Kept in
        its phase, the new start's gate would ask a core that answers no frozen, suspended
        or resuming unit (Scheduler.request), and wait for ever."""
        return self.scheduler.phase(name) in PREEMPTED_IN_PLACE and bound_for_gate(state)

    def sweep_env_files(self, units: Sequence[UnitState]) -> None:
        """Remove the env files of units that ended while no controller ran (a crash, a
        restart, an upgrade): a running instance's file goes when it is seen going down
        (Controller._follow_gate), and the start-up that forgot it since removed none, so a
        job queue or an Accept=yes socket still filled /run across restarts, and then no env
        file could be written and every gated start waited. Kept: the file of every unit
        systemd listed other than inactive or failed with no job (running, at its gate,
        starting or stopping, waiting to restart: its processes, or those of its next run, may
        read it), or that the core holds GPUs for or keeps suspended (its resume rewrites the
        file, `Delivery.tell_again`). Any other unit's next start is let through its gate only once
        a grant of ours wrote its file anew (`Delivery.deliver`). Called after `rebuild`,
        which read back the files of running units the saved state named no grant for, and
        before any grant is delivered; after our name is claimed, so that no other controller
        writes one meanwhile. At most ENV_SWEEP_MAX entries are looked at; one line says how
        many went."""
        core = self.scheduler
        keep = {u.name for u in units if u.active not in ("inactive", "failed") or u.job_id}
        keep |= {*core.grants(), *core.suspended_units()}
        names, more = envfiles.present(self.runtime_dir, ENV_SWEEP_MAX)
        removed = sum(envfiles.remove(self.runtime_dir, n) for n in names if n not in keep)
        if more:
            log.warning(
                "removed env files of units no longer running: %d; %s holds more than %d "
                "entries, the rest are looked at when gpuslice starts again",
                removed,
                Path(self.runtime_dir) / ENV_DIR_NAME,
                ENV_SWEEP_MAX,
            )
        elif removed:
            log.info("removed env files of units no longer running: %d", removed)
