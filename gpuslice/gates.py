"""The gate's judgement: what a gate that asks is answered.

A unit's gate asks over D-Bus (Acquire), or systemd shows it at its gate and the controller
takes that in as if it had asked (Controller._follow_gate). `verify_acquire` serves a call only
from a process in the unit it names, and holds it back while a rescan may change what is
annotated (Rescans.park); `acquire_verified` tells a call of a start already answered, or of
the next start, from a new one (`_grant_again`), and holds one the core has not answered
until systemd's queued starts are read (`queued`: gpuslice/queued.py); `serve_gate` takes in
a restart that ended a frozen or suspended run, stops again a start that outran our stop,
asks the core of an annotated unit and lets an unannotated one through (`let_through`: its
env file made to say what the core books for it first, its ExecStartPre= read, `_pass_gate`,
and a start whose gate a daemon-reload took out restarted, `_restart_ungated`).

The controller decides when a gate asks (its start-up holds the early calls back) and carries
out the core's actions; everything else is given: the core, the tracker, systemd's calls, the
gate calls waiting on D-Bus (`service`) and at their pipes (`gates`), the counters, the
annotations (`spec_for`), the rescans, start-up's word on a run started again (`restore`),
NVML's sample (`watch`), the Preempt= ladder, our calls to systemd (`calls`), a grant's way to
its gate (`delivery`), the runtime_dir, and the controller's batching of a scheduling pass,
its `execute`, `spawn` and the journal's line for a decision (`say`), and the hold of a
call until systemd's queued starts are read (`queued`), and its look at a gate that waits on
GPUs kept for a start of ours (`waits`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from typing import Any

from gpuslice import envfiles
from gpuslice.calls import Calls
from gpuslice.cgroups import unit_of_pid
from gpuslice.core.decisions import Cause, Code, Decision, render
from gpuslice.core.model import UnitSpec
from gpuslice.core.placement import format_gpus
from gpuslice.core.scheduler import PREEMPTED_IN_PLACE, Action, Phase, Scheduler
from gpuslice.counters import Counters
from gpuslice.delivery import Delivery
from gpuslice.gatepipes import GatePipes
from gpuslice.gpuwatch import FRESH_SAMPLE, GpuWatch
from gpuslice.ladder import Ladder
from gpuslice.paths import GATE_NAME
from gpuslice.rescans import Rescans
from gpuslice.restore import Restore
from gpuslice.service import ACCESS_DENIED, SchedulerService
from gpuslice.systemd import Systemd, SystemdError, is_transient
from gpuslice.tracker import Kind, Tracker, classify
from gpuslice.unitfiles import printable

log = logging.getLogger("gpuslice")


class Gates:
    """Answers each gate that asks; holds only the units let through whose ExecStartPre= is
    being read (`_passing`)."""

    def __init__(
        self,
        scheduler: Scheduler,
        tracker: Tracker,
        systemd: Systemd,
        service: SchedulerService,
        gates: GatePipes,
        counters: Counters,
        spec_for: Callable[[str], UnitSpec | None],
        rescans: Rescans,
        restore: Restore,
        watch: GpuWatch,
        ladder: Ladder,
        calls: Calls,
        delivery: Delivery,
        runtime_dir: Callable[[], str],
        batched: Callable[[], AbstractContextManager[None]],
        execute: Callable[[list[Action]], None],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        say: Callable[[str, str, Decision | None], None],
        queued: Callable[[str], None],
        waits: Callable[[str], None],
    ) -> None:
        self.scheduler = scheduler
        self.tracker = tracker
        self.systemd = systemd
        self.service = service  # the gate calls waiting on D-Bus
        self.gates = gates  # the gates' pipes
        self.counters = counters
        self.spec_for = spec_for  # Controller.spec_for: the scan of now (a rescan replaces it)
        # the scan under way (`task`), and the gate calls it holds back (`for_gate`, `park`)
        self.rescans = rescans
        self.restore = restore  # `started_again`: a run that ended while kept in its phase
        self.watch = watch  # NVML's sample, taken again before a grant
        self.ladder = ladder
        self.calls = calls  # our StopUnit, for a start that outran our stop
        self.delivery = delivery  # a let-through's env file, written before its gate passes
        # the controller's runtime_dir, read at each use (a reload replaces its config)
        self.runtime_dir = runtime_dir
        # Controller._batched, execute, _spawn and _say
        self._batched = batched
        self.execute = execute
        self._spawn = spawn
        self._say = say
        # holds a call until systemd's queued starts are read (QueuedStarts.wait), which
        # then serves it (`acquire_verified`, placed)
        self.queued = queued
        # a gate's first ask of its start, served: the controller looks, after the pass
        # that decides it, whether it waits on GPUs kept for a start of ours
        # (Controller._gate_waits)
        self.waits = waits
        # units whose gate `let_through` passes once systemd's ExecStartPre= of the unit is
        # read (_pass_gate): the calls that come meanwhile are answered with the first
        self._passing: set[str] = set()

    async def verify_acquire(self, unit: str, sender: str, seen: int) -> None:
        """Serve only the gate of the unit it names: the calling process must run in that
        unit's cgroup, by systemd's own rule (the first unit in its cgroup path)."""
        try:
            pid = await self.systemd.caller_pid(sender)
        except SystemdError as e:
            self.counters.error("dbus_acquire_refused")
            self.service.refuse(unit, sender, ACCESS_DENIED, f"cannot identify the caller: {e}")
            return
        actual = unit_of_pid(pid)
        if actual != unit:
            self.counters.error("dbus_acquire_refused")
            log.warning(
                "refused an Acquire for %s from PID %d, which runs in %s",
                unit,
                pid,
                printable(actual or "no unit"),
            )
            self.service.refuse(unit, sender, ACCESS_DENIED, f"PID {pid} does not run in {unit}")
            return
        if not self.service.pending(unit):
            return  # answered or cancelled meanwhile
        if self.tracker.signals(unit) != seen and classify(self.tracker.state(unit)) is Kind.DOWN:
            self.service.forget(unit)  # its start was cancelled while we checked
            return
        spec = self.spec_for(unit)
        # a unit the scan does not know gets a rescan of its own, even while one runs: that
        # one may have read its files before the daemon-reload that gave it its gate
        if spec is None and self.rescans.for_gate(unit):
            self.rescans.park(unit)
            return
        if self.rescans.task is not None and (spec is None or self.unanswered(unit)):
            self.rescans.park(unit)  # judged on the annotations of now (Rescans.hold_gate)
            return
        self.acquire_verified(unit)

    def unanswered(self, unit: str) -> bool:
        """Whether the core has not answered the unit's start: unknown, waiting, or its
        GPUs kept for it until its gate asks."""
        return self.scheduler.phase(unit) in (None, Phase.STARTING)

    def acquire_verified(self, unit: str, *, placed: bool = False) -> None:
        """A verified call (or one held back, now judged). A start the core has not
        answered is served only among the starts systemd has queued (`placed`, once
        gpuslice/queued.py has read them): known only by this call, the first gate of a
        `systemctl start a b` to ask was granted before the others' starts were seen, and
        preempted by the more urgent ones a moment later."""
        if not self.service.pending(unit):
            return
        running = self.scheduler.phase(unit) is Phase.RUNNING
        if running and classify(self.tracker.state(unit)) is not Kind.GATE:
            # granted, and systemd last showed it past its gate: no gate of that start asks
            # any more. This is the gate of its next start, whose call came before the
            # signals of this one's end: granted again (Scheduler.request, for a gate that
            # asks again after a controller restart), it ran on GPUs that end frees for
            # another unit. Answered with an error, it asks again, after them.
            self.service.forget(unit)
            return
        if self.gates.answered(unit) and running:
            self._spawn(self._grant_again(unit, self.gates.granted(unit)))
            return
        if not placed and self.spec_for(unit) is not None and self.unanswered(unit):
            self.queued(unit)
            return
        self.serve_gate(unit)

    async def _grant_again(self, unit: str, granted: str | None) -> None:
        """A unit granted at its pipe asks over D-Bus: its gate had not found the pipe (the
        same grant, said again), or this is the gate of its next start, and that start ran
        and ended before its signals reached us (a unit that fails at once, Restart=): its
        gate read our line for the last start, not its own, and granted again it ran on GPUs
        that end frees for another unit. Which, systemd's InvocationID of the unit tells
        (the gate's call names the unit, not the start); the next start is told to ask
        again (StartEnded), after the signals of the last one's end."""
        try:
            current = await self.systemd.invocation(unit)
        except SystemdError as e:
            self.counters.error("dbus_call_errors")
            log.debug("cannot read the InvocationID of %s: %s", unit, e)
            current = None
        if not self.service.pending(unit):
            return
        if (
            current is None
            or current != granted
            or self.gates.granted(unit) != granted
            or self.scheduler.phase(unit) is not Phase.RUNNING
        ):
            self.service.forget(unit)  # it asks again, and is judged on what we know then
            return
        gpus = sorted(self.scheduler.grants()[unit])
        if self.service.grant(unit, ",".join(map(str, gpus))):
            self.counters.gate_answers["dbus"] += 1

    def serve_gate(self, unit: str) -> None:
        """The unit's gate asks (over D-Bus, or systemd showed it at its gate)."""
        if self.tracker.leaving(unit):
            # someone stops it at its gate, told down (Tracker.stopped_at_gate): served, it
            # waited again, preempting for a start being stopped. Its gate, being killed,
            # is told to ask again
            self.service.forget(unit)
            return
        spec = self.spec_for(unit)
        state = self.tracker.state(unit)
        if self.restore.started_again(unit, state) and not self.gates.answered(unit):
            # restarted (systemctl restart) while frozen, suspended, or being suspended or
            # resumed: systemd thawed it and ended that run, with no moment down between (a
            # restart job's stop turns into its start), so only its new gate tells. Kept in
            # its phase, that gate was never answered (`request` answers none of those), or
            # a suspended unit was resumed onto the GPUs its new start was granted. Taken
            # before the gate counts as passed: the restart job says who ended the run.
            if self.watch.available:
                self.watch.refresh(released=unit)
            with self._batched():
                self.execute(self.scheduler.inactive(unit, self.tracker.outcome(state)))
            self.ladder.went_down(unit)  # that run's processes, and what a suspend kept, went
        if spec is not None:
            self.tracker.passed_gate(unit)
        if self.scheduler.phase(unit) in PREEMPTED_IN_PLACE:
            # granted at its pipe, then frozen (or suspended) before the call of its gate,
            # which had not found the pipe, was served: the core answers no such unit
            # (`request`), and the call, left waiting, was answered by nobody once the unit
            # ran again: its start stuck at its gate on GPUs counted as in use. It asks
            # again, and is judged then (`_grant_again`)
            self.service.forget(unit)
            return
        if self.scheduler.phase(unit) is Phase.STOPPING:
            # its start job outran our stop job (a preemption, or a start of ours withdrawn
            # when its annotation went): stop it again rather than leave it waiting or let
            # it through
            self.calls.send(self.systemd.stop_unit, unit, "stop")
            return
        if spec is None:
            self.let_through(unit)
            return
        first = not self.scheduler.asked(unit)  # asked again, it waits on what it did
        self.watch.refresh_if_older(FRESH_SAMPLE)  # grant against what is on the GPUs now
        with self._batched():
            self.execute(self.scheduler.request(spec))
        if first:
            self.waits(unit)

    def let_through(self, unit: str) -> None:
        """An unannotated unit's gate passes (the core forgot its start, or never knew it):
        its calls over D-Bus are answered (`_pass_gate`, which restarts instead a start whose
        gate a daemon-reload took out from under its own ExecStartPre= lines), and a gate on
        its pipe is sent there. Not through
        the pipe: that needs our end held until the unit has left its gate, which its
        signals, no longer matched, would not tell. Its env file is made to say what the
        core books for it first, as the gate drop-in (until the next daemon-reload) still
        names it with `EnvironmentFile=-`, which starts a unit without the file on every GPU:
        - a unit the core holds no GPU for passes with no GPUs of gpuslice's: its file goes
          (a grant of an earlier run's would tell its processes GPUs gpuslice may have
          handed to another unit since, as if granted them), and it runs as any unannotated
          unit does;
        - a unit the core still holds GPUs for (its annotation went while it ran, and
          `systemctl restart` ran it again with no moment down between) passes only once
          its file names them: one that names them stays (the word its last run was told,
          by UUID, `Restore.remember_told`), one missing (a /run that was full at its grant,
          removed by hand) or naming others is written from the core's books
          (`Scheduler.told`). While it cannot be written, the gate waits, as
          `Delivery.deliver`'s does: without it, the new run saw every GPU, another unit's
          too. One whose books cannot name a GPU it holds (lost since, the UUID it was
          granted unknown) is let go first, and passes as the first kind
          (`Scheduler.let_through`)."""
        withheld = self.delivery.withdraw(unit)
        self.execute(self.scheduler.let_through(unit))  # let go: its GPUs cannot be named
        held = self.held_for(unit)
        self.gates.close(unit)
        self.gates.at_gate_unknown(unit)
        if not held:
            envfiles.remove(self.runtime_dir(), unit)
        elif not self.delivery.names_held(unit, held, again=withheld):
            return
        if self.service.pending(unit) and unit not in self._passing:
            self._passing.add(unit)
            self._spawn(self._pass_gate(unit, held))

    async def _pass_gate(self, unit: str, held: list[int]) -> None:
        """Answer the gate `let_through` lets through, once systemd's ExecStartPre= of the
        unit is read (only here: a let-through is rare, a grant costs no read). A
        daemon-reload that took the unit's annotation out took its gate's drop-in out too,
        and systemd does not go on with a command list whose running command vanished from
        it: let through, the start skipped every ExecStartPre= line of the unit's own (a
        model download, a mount check) and ran its ExecStart= at once. A list that holds no
        gate but other commands has the start restarted instead (`_restart_ungated`): one
        job, the one whoever started it waits for, stopped and then started from the unit
        file of now, every line of it run. A list that still holds the gate (no reload took
        it out yet) goes on after it, and an empty one has nothing to skip: let through."""
        try:
            try:
                commands = await self.systemd.exec_start_pre(unit)
            except SystemdError as e:
                self.counters.error("dbus_call_errors")
                if is_transient(e):
                    self.service.forget(unit)  # it asks again, and is read again then
                    return
                log.debug("cannot read the ExecStartPre= of %s: %s", unit, e)
                commands = []
            if not self.service.pending(unit):
                return  # answered or cancelled meanwhile
            if self.spec_for(unit) is not None or self.held_for(unit) != held:
                self.service.forget(unit)  # it asks again, and is judged on what we know then
                return
            gone = all(path.rsplit("/", 1)[-1] != GATE_NAME for path, _ in commands)
            if commands and gone and await self._restart_ungated(unit):
                return
            if self.service.pending(unit) and self.service.grant(unit, ",".join(map(str, held))):
                if held:
                    log.info(
                        "%s passed the gate on %s, which it keeps until it ends: no longer "
                        "annotated",
                        unit,
                        format_gpus(held),
                    )
                else:
                    log.info("%s passed the gate: not managed by gpuslice", unit)
        finally:
            self._passing.discard(unit)

    def held_for(self, unit: str) -> list[int]:
        """The GPUs the core books for the unit, in order."""
        return sorted(self.scheduler.grants().get(unit, ()))

    async def _restart_ungated(self, unit: str) -> bool:
        """Whether systemd took a restart of a start let through whose gate a daemon-reload
        took out (`_pass_gate`). TryRestartUnit on a unit still activating is merged into
        its start job, which stops the unit (its gate ends 0, as at any stop, and the unit
        ends inactive, not failed: no OnFailure=) and then starts it from the unit file of
        now: no gate, and its own ExecStartPre= lines first. Its gate's calls are answered
        "ask again": its shell is being stopped. Not RestartUnit: a unit that left its gate
        while its list was read (`systemctl stop`, TimeoutStartSec=: its signals are no
        longer followed, and its call stays pending) was started again by it, over that
        stop; TryRestartUnit leaves a unit inactive or being stopped as it is. Refused
        (RefuseManualStart=, say), the gate is let through as before, and the journal says
        what that costs; a call that did not reach systemd is tried again when the gate
        asks again. Its journal line says the start is restarted unless it was stopped
        meanwhile: systemd answers a no-op with a job of its own too, so the answer does not
        tell which happened."""
        try:
            await self.systemd.try_restart_unit(unit)
        except SystemdError as e:
            self.counters.error("dbus_call_errors")
            if is_transient(e):
                self.service.forget(unit)
                return True
            log.warning(
                "cannot restart %s, whose gate a daemon-reload took out: %s; letting it "
                "through, and systemd skips its own ExecStartPre= lines",
                unit,
                e.text,
            )
            return False
        self.service.forget(unit)
        decision = Decision(Code.UNMANAGED, unit, cause=Cause.RESTARTED)
        self._say(render(decision), "info", decision)
        return True
