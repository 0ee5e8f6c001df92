"""Tiny builders for the core's tests, and `Sim`: the core inside a well-behaved systemd.

`Sim` feeds events to a `Scheduler` and plays its actions back the way systemd and the
adapter would: a `Start` becomes a start job whose gate later asks (`request`), a `Stop`
becomes a stop job after which the unit is later reported inactive, a `Suspend` or `Resume`
becomes the adapter's work, done or failed later (`finish_suspend`, `finish_resume`); a
stop may fail (`fail_stop`: the unit runs on).
They are queued and played by `finish_start`, `finish_stop`, those two or `settle`, so a
test (or hypothesis) decides what happens in between. A `Freeze` or `Thaw` takes effect at
once; FreezeUnit may fail (`fail_freeze`, or at once for the units in `freeze_fails`).
`restart` is a controller restart: save, load, adopt, `recover()`. A start of gpuslice's may
not reach systemd (`fail_start`: the bus failed it on the way); it is owed as before and is
not started again until the adapter's delay is over (`retry_start`). A unit's job may end
with systemd keeping it active (`exit_remaining`: RemainAfterExit=yes): finished, its GPUs
free, active (a start of it does nothing) until someone stops it.

`Sim` is also the oracle: it keeps its own model of the host, built only from the events
it fed in and the actions that came back (who runs where, who waits at the gate, who a
person stopped, which units finished, failed or were preempted and in what order, who is
being suspended for whom, who is suspended from which GPUs and since when, who is being
resumed, who is frozen for whom, whose suspend or freeze failed, the GPUs as last sampled),
never from the scheduler's fields. Every batch of actions is checked against that model,
whatever the test:

- a Grant answers a gate that is asking, with as many distinct, known, not lost GPUs as the
  unit asks for; a whole-GPU unit (no `Memory=`, or a GPU of unknown size) never shares a
  GPU; the declared memory on a GPU never exceeds total - reserve - foreign use, counting
  every unit that holds it (running, frozen, being stopped, suspended or resumed), never a
  suspended one; no Grant while a victim chosen for that unit still runs or is still being
  suspended; no waiter is left waiting while a less urgent unit is granted GPUs it would fit
  on; a Grant leaves a more urgent suspended unit its room on its GPUs;
- a Stop preempts a unit strictly less urgent (by its annotation) than the waiting unit it is
  for, or makes a background unit yield to a foreign process, or follows a failed resume of
  that unit, or an undo of its failed suspend that lost a process of it (whatever its
  Preempt=: then, while still less urgent than its waiter, the waiter waits for it); never
  twice, never a unit that is not active, never more victims while earlier ones still stop
  or suspend; only a unit whose Preempt= has stop, and when suspend comes first, only after
  its suspend failed (then at once, for the same waiter); never a unit being resumed; never
  to preempt or yield a unit whose stop systemd refused while it runs;
- a Suspend is of a running unit (not stopping, suspending or resuming) whose Preempt= gives
  way by suspend first, on GPUs it holds, strictly less urgent than the waiting unit it is
  for, by the same thrash and one-round-of-victims rules as a Stop; never again after its
  suspend failed while it runs; `thaw_first` exactly when it is frozen;
- a Resume is of a suspended unit, onto exactly the GPUs it had (not lost, no foreign
  process it avoids), only when its declared memory fits there next to everyone, never while
  a more urgent unit waits at its gate, most urgent first (then suspended first) within a
  batch, never taking the room of a more urgent suspended unit; after a restart `recover()`
  resumes exactly the units caught being suspended or resumed, on the GPUs they hold; a
  failed resume is followed by a Stop, a failed suspend by the Stop its Preempt= names next,
  one whose undo lost a process by a Stop whatever its Preempt=;
- a Freeze is of a unit granted beside a unit just granted in this batch, and every such
  unit is frozen: running (not frozen, stopping, suspending or resuming), with freeze in its
  Preempt=, strictly less urgent, not one whose freeze failed while it runs; a Thaw is of a
  frozen unit, only once every unit it was frozen for has left or stopped running (or its
  annotation went: a frozen unit is never left frozen unmanaged);
- a Start is only for a preempted unit with Requeue=yes (in the order priority, then the one
  preempted first) or an idle background unit (priority, then the one out longest), never for
  a unit a person stopped, one that failed or finished, or a suspended one (it still runs),
  nor for one whose start did not reach systemd before the adapter's delay is over;
  preempted units come back before idle background units are started; a refill (or a
  requeue onto free GPUs) names GPUs that take it next to every unit on them: it never
  preempts.

`check_quiet` adds what must hold once everything has played out (nothing left to decide; no
unit frozen without a more urgent unit running beside it; the most urgent waiter is not left
waiting beside a GPU held only by units it may preempt), and `drain` what must hold once
every unit has ended: every waiter that can fit on the host was granted, the others were told
why they wait, and every preempted unit with Requeue=yes and every suspended unit came back
(unless a waiter that cannot fit, more urgent, or as urgent and earlier, keeps the capacity it
needs: strict order, no backfill).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from gpuslice.core.decisions import Cause, Code, render
from gpuslice.core.model import Gpu, Restart, Rung, UnitKind, UnitSpec, is_instance, is_template
from gpuslice.core.scheduler import (
    Action,
    Freeze,
    Grant,
    Log,
    Outcome,
    Phase,
    Resume,
    Scheduler,
    Start,
    Stop,
    Suspend,
    Thaw,
)

# the thrash rule's "known since" of a start that lost its kept place, while its batch is
# checked (`Sim._unkept`)
_LATER_THAN_ANY_GRANT = 1 << 62
BG = UnitKind.BACKGROUND
OD = UnitKind.ON_DEMAND
GIB = 1 << 30


def spec(
    name: str,
    prio: int,
    kind: UnitKind = OD,
    gpus: int = 1,
    requeue: bool = True,
    *,
    mem_gib: float | None = None,
    devices: tuple[str, ...] = (),
    preempt: str = "stop",
) -> UnitSpec:
    """`spec("vlm", 90, BG)` is `vlm.service`, priority 90, background, 1 whole GPU;
    `mem_gib=10` declares `Memory=10G`."""
    if "." not in name:
        name += ".service"
    memory = None if mem_gib is None else int(mem_gib * GIB)
    ladder = tuple(Rung(r) for r in preempt.split())
    return UnitSpec(name, prio, kind, gpus, requeue, memory=memory, devices=devices, preempt=ladder)


def sized(index: int, total_gib: int = 24, **kw: object) -> Gpu:
    """A GPU of known size as NVML reports it: `sized(0, reserve=GIB, foreign_pids=(7,))`."""
    return Gpu(index, f"GPU-{index}", "Fake", total_gib * GIB, **kw)  # type: ignore[arg-type]


def drawn(
    prio: int,
    kind: UnitKind,
    gpus: int,
    requeue: bool,
    memory: int | None,
    ladder: str,
    devices: tuple[str, ...] = (),
    restart: Restart = Restart.NO,
) -> UnitSpec:
    """A unit as the core's random histories draw it, named later (`replace`): `ladder` is
    its Preempt= as written, `"freeze suspend stop"`; `restart` its [Service] Restart=."""
    preempt = tuple(Rung(r) for r in ladder.split())
    return UnitSpec(
        "",
        prio,
        kind,
        gpus,
        requeue,
        memory=memory,
        devices=devices,
        preempt=preempt,
        restart=restart,
    )


def drawn_host(whole: bool, gpus: int) -> list[int] | list[Gpu]:
    """The host the core's random histories draw: `gpus` GPUs of unknown size (no NVML:
    every unit takes a whole GPU), or at most 3 of known size."""
    return list(range(gpus)) if whole else [sized(i) for i in range(min(gpus, 3))]


def brief(actions: Iterable[Action]) -> list[str]:
    """Actions without their words: `grant a.service 0,1`, `stop b.service`, `start c.service`."""
    out: list[str] = []
    for action in actions:
        if isinstance(action, Grant):
            out.append(f"grant {action.unit} " + ",".join(str(g) for g in action.gpus))
        elif isinstance(action, Stop):
            out.append(f"stop {action.unit}")
        elif isinstance(action, Start):
            out.append(f"start {action.unit}")
        elif isinstance(action, Suspend | Resume):
            what = "suspend" if isinstance(action, Suspend) else "resume"
            out.append(f"{what} {action.unit} " + ",".join(str(g) for g in action.gpus))
        elif isinstance(action, Freeze | Thaw):
            out.append(f"{'freeze' if isinstance(action, Freeze) else 'thaw'} {action.unit}")
    return out


def words(actions: Iterable[Action]) -> list[str]:
    """Every reason and journal line, in order."""
    return [a.message if isinstance(a, Log) else a.reason for a in actions]


def room(gpu: Gpu) -> int | None:
    """Declared memory a GPU may hold: total - reserve - foreign; None when its size is unknown."""
    return None if gpu.total is None else gpu.total - gpu.reserve - gpu.foreign


def _ladder(unit: UnitSpec) -> str:
    return " ".join(r.value for r in unit.preempt) or "(none)"


def _memory_rungs(unit: UnitSpec) -> list[Rung]:
    """The rungs of a unit's ladder that free its VRAM, in its order (freeze keeps it)."""
    return [r for r in unit.preempt if r in (Rung.SUSPEND, Rung.STOP)]


class InvariantError(AssertionError):
    """The core broke a rule; the message says which and how."""


@dataclass(frozen=True)
class StopRecord:
    victim: str
    victim_priority: int
    waiter: str
    waiter_priority: int


class Sim:
    """A Scheduler inside a well-behaved systemd, and the oracle's model of the host."""

    def __init__(
        self,
        gpus: int | Iterable[int] | Iterable[Gpu],
        specs: Sequence[UnitSpec] = (),
        *,
        yield_to_foreign: bool = True,
        requeue_at_gate: bool = False,
    ) -> None:
        listed = range(gpus) if isinstance(gpus, int) else gpus
        self.devices: dict[int, Gpu] = {}
        for gpu in listed:
            device = gpu if isinstance(gpu, Gpu) else Gpu(gpu)
            self.devices[device.index] = device
        self.yield_to_foreign = yield_to_foreign
        self.requeue_at_gate = requeue_at_gate
        self.annotations: dict[str, UnitSpec] = {s.name: s for s in specs}
        self.sched = self._scheduler()
        self.actions: list[Action] = []
        self.running: dict[str, tuple[int, ...]] = {}  # granted, not yet inactive
        self.at_gate: set[str] = set()  # start job waiting in the gate for a reply
        self.pending_starts: list[str] = []  # Start issued, gate not yet reached
        self.ours: set[str] = set()  # of those, start jobs of gpuslice's alone
        # of those, refills (README: a refill's start that does not happen is no comeback)
        self.refilling: set[str] = set()
        # gpuslice's start did not reach systemd: not started again until `retry_start`
        self.paused: set[str] = set()
        self.pending_stops: list[str] = []  # Stop issued, unit not yet inactive
        self.start_after_stop: set[str] = set()  # a person started it while it stopped
        self.stops: list[StopRecord] = []  # every Stop that preempts, in order
        self.stopped_to_give_way: set[str] = set()  # its Stop preempts it or yields
        # its Stop follows an undo of its failed suspend that lost a process of it (the main
        # one, maybe: it may end by itself first)
        self.undo_lost: set[str] = set()
        self.unstoppable: set[str] = set()  # systemd refused its stop: never again while it runs
        self.victims_of: dict[str, set[str]] = {}  # waiter -> its victims not yet inactive
        self.preempted: dict[str, int] = {}  # stopped by gpuslice -> when; until started again
        self.held: set[str] = set()  # stopped by a person
        self.finished: set[str] = set()  # ended successfully on its own
        # of those, kept active by systemd (RemainAfterExit=yes) until someone stops it
        self.remaining: set[str] = set()
        self.failed: set[str] = set()
        self.out_since: dict[str, int] = {}  # unit -> when it last became inactive
        self.unmanaged: set[str] = set()  # still running, annotation removed
        # each unit's annotation before the last reload: a unit whose annotation went still
        # holds its GPUs on those terms while it runs
        self.last_specs: dict[str, UnitSpec] = {}
        self._clock = itertools.count(1)
        # the thrash rule: when each unit's start became known (announced, asked, or
        # started by gpuslice) and when its gate was answered
        self.known_at: dict[str, float] = {}  # `_known_anew` places some between grants
        self.answered_at: dict[str, int] = {}
        self.announced: set[str] = set()  # start jobs seen, gates not yet asking
        self._kept: set[str] = set()  # places the core keeps for starts (`_renew_unkept`)
        # comebacks started to preempt (their gate's request names the victims): known from
        # their Start, not anew at that request, as no place of theirs was lost
        self._preempting: set[str] = set()
        self.told_to_wait: set[str] = set()  # its last word: "waiting" (not "keeping GPUs")
        # the Preempt= ladder, as the adapter carries it out
        self._falling_back = ""  # the unit whose failed suspend is being reported
        self.pending_suspends: list[str] = []  # Suspend issued, the adapter not done yet
        self.suspend_for: dict[str, str] = {}  # unit being suspended -> the waiter it is for
        self.suspended: dict[str, tuple[int, ...]] = {}  # VRAM in host memory: its GPUs
        self.suspended_at: dict[str, int] = {}  # when its suspend was done (resume order)
        self.pending_resumes: list[str] = []  # Resume issued (it holds its GPUs again)
        self.frozen: dict[str, set[str]] = {}  # frozen -> the running units it gave way to
        self.suspend_failed: set[str] = set()  # a suspend failed while it runs: never again
        self.unfreezable: set[str] = set()  # its freeze failed while it runs: never again
        self.freeze_fails: set[str] = set()  # units FreezeUnit fails for (set by the test)
        self._resume_failing = ""  # the unit whose failed resume is being reported
        # the unit whose suspend's undo lost a process, being reported, and its waiter
        self._undo_losing: tuple[str, str] = ("", "")
        self._caught: set[str] = set()  # restarting: units `recover()` resumes
        self._to_freeze: dict[str, set[str]] = {}  # in a batch: granted -> who must freeze
        self._resumed: list[str] = []  # in a batch: resumed, in order

    def _scheduler(self) -> Scheduler:
        return Scheduler(
            self.devices.values(),
            self.annotations,
            yield_to_foreign=self.yield_to_foreign,
            requeue_at_gate=self.requeue_at_gate,
        )

    # -- what a person, a unit or NVML does ---------------------------------------------------

    def boot(self) -> list[Action]:
        """The controller starts with nothing running: fill the GPUs."""
        return self._feed(self.sched.schedule())

    def start(self, name: str) -> list[Action]:
        """`systemctl start NAME`: its start job reaches the gate at once."""
        if name in self.pending_stops:
            self.start_after_stop.add(name)  # queued behind the stop job
            return []
        if self.active(name):
            return []  # merges with the job already there (a suspended unit still runs)
        return self._request(name)

    def announce(self, name: str) -> list[Action]:
        """`systemctl start NAME`: systemd shows its start job on its way to the gate, which
        asks later (`finish_start`)."""
        if name in self.pending_stops:
            self.start_after_stop.add(name)
            return []
        if self.active(name):
            return []
        spec = self.annotations.get(name)
        assert spec is not None, f"{name} is not annotated"
        for gone in (self.held, self.finished, self.failed):
            gone.discard(name)
        self.preempted.pop(name, None)
        self.paused.discard(name)
        self.pending_starts.append(name)
        self.announced.add(name)
        self.known_at.setdefault(name, next(self._clock))
        return self._feed(self.sched.announce(spec))

    def exit(self, name: str, outcome: Outcome = Outcome.EXITED) -> list[Action]:
        """A running unit's main process ends by itself (EXITED or FAILED), also while it is
        being suspended or resumed; not while frozen (its processes cannot run)."""
        assert name in self.running and name not in self.pending_stops, name
        assert name not in self.frozen, f"{name} is frozen"
        del self.running[name]
        self._went_out(name)
        if outcome is Outcome.EXITED:
            self._record(self.finished, name)
        elif outcome is Outcome.FAILED:
            self._record(self.failed, name)
        # by itself (the tracker's word), so its GPUs may be kept for a restart: a failure's,
        # a clean exit's where its Restart= restarts one
        actions = self._feed(self.sched.inactive(name, outcome, by_itself=True))
        if name in self.sched.restart_kept:  # its Restart= may start it: a start known
            # not ended until its wait does (`restart_not_seen`): a start of it is owed, as
            # any start known (`announce`), also a comeback should a stop take it first
            for gone in (self.finished, self.failed):
                gone.discard(name)
            self.pending_starts.append(name)
            self.announced.add(name)
            self.known_at.setdefault(name, next(self._clock))
        return actions

    def restart_not_seen(self, name: str) -> list[Action]:
        """The controller's wait for the restart of a unit whose GPUs were kept for it
        ends with no restart (Restart=no, or a long RestartSec=): failed (or finished, a
        clean exit), the GPUs go."""
        outcome = self.sched.restart_kept.get(name)
        if name in self.pending_starts:
            self.pending_starts.remove(name)
            self.announced.discard(name)
            self.told_to_wait.discard(name)
            self.known_at.pop(name, None)
        if outcome is not None and not self.active(name):
            self._record(self.finished if outcome is Outcome.EXITED else self.failed, name)
        return self._feed(self.sched.restart_overdue(name))

    def ends_remaining(self) -> list[str]:
        """Running units (annotated, past their gate, not being stopped, frozen, suspended
        or resumed) whose job may end with systemd keeping them active."""
        moving = self.pending_stops + self.pending_suspends + self.pending_resumes
        return sorted(
            n
            for n in self.running
            if n in self.annotations and n not in moving and n not in self.frozen
        )

    def exit_remaining(self, name: str) -> list[Action]:
        """Its job ends and systemd keeps it active (RemainAfterExit=yes), no process left
        in it: finished, its GPUs free, active until someone stops it (`stop`)."""
        assert name in self.ends_remaining(), name
        del self.running[name]
        self._went_out(name)
        self._record(self.finished, name)
        self.remaining.add(name)
        return self._feed(self.sched.exited(name))

    def ends_before_its_stop(self) -> list[str]:
        """Units gpuslice is stopping (to preempt them, to yield to a foreign process, or
        because undoing their suspend lost a process of theirs) whose main process may still
        end by itself before the stop takes effect."""
        return [
            n
            for n in self.pending_stops
            if n in self.running
            and n not in self.frozen
            and (n in self.stopped_to_give_way or n in self.undo_lost)
        ]

    def exit_while_stopping(self, name: str, outcome: Outcome = Outcome.EXITED) -> list[Action]:
        """A unit being stopped by gpuslice ends by itself first (its main process exited,
        or it was in its ExecStopPost= already): the stop job finds it down. Its work is done
        (or failed): it is never owed a comeback."""
        assert name in self.ends_before_its_stop(), name
        self.pending_stops.remove(name)
        del self.running[name]
        self._went_out(name)
        self._record(self.finished if outcome is Outcome.EXITED else self.failed, name)
        return self._feed(self.sched.inactive(name, outcome, by_itself=True))

    def stop(self, name: str) -> list[Action]:
        """`systemctl stop NAME` by a person (a stop job gpuslice did not issue)."""
        if name in self.pending_stops:
            return []  # merges with gpuslice's own stop job
        if name in self.remaining:  # finished: its stop releases nothing, holds nothing
            self.remaining.discard(name)
            return self._feed(self.sched.inactive(name, Outcome.STOPPED))
        if name in self.pending_starts:
            self.pending_starts.remove(name)
            self.ours.discard(name)
        elif not self.active(name):
            return []  # already inactive: systemd reports nothing
        self.running.pop(name, None)
        self.at_gate.discard(name)
        self._went_out(name)  # victims stopping for it stay its own if it is started again
        self._record(self.held, name)
        self.preempted.pop(name, None)  # its start was queued behind gpuslice's stop
        return self._feed(self.sched.inactive(name, Outcome.STOPPED))

    def forget_instance(self, name: str) -> bool:
        """The controller sees the unit down and asks the core to forget it, as it does for
        an instance (`Scheduler.forget_instance`). Only one the model says is owed nothing
        may go: on-demand, its start not known, no comeback owed; the model forgets how
        it ended too. Whether it went."""
        if self.active(name):
            return False
        forgot = self.sched.forget_instance(name)
        if forgot:
            spec = self.annotations.get(name)
            owed = (
                spec is None
                or spec.kind is not UnitKind.ON_DEMAND
                or name in self.announced
                or self._waits(name)
                or (name in self.preempted and spec.requeue)
            )
            if owed:
                raise InvariantError(f"{name} forgotten while gpuslice owes it: {spec}")
            for ended in (self.held, self.finished, self.failed):
                ended.discard(name)
            self.preempted.pop(name, None)
            self.paused.discard(name)
        return forgot

    def annotate(self, specs: Iterable[UnitSpec]) -> list[Action]:
        """New annotations (daemon-reload): the whole set, replacing the old one."""
        # a running unit whose annotation went keeps its GPUs in gpuslice's books until it
        # ends (its job still runs there), on the terms it was granted them on (`_spec`),
        # but for how it gives way (a stop) and its comeback (none)
        specs = list(specs)
        names = {s.name for s in specs}
        for name in self.running:
            if name in self.annotations and name not in names:
                self.last_specs[name] = dataclasses.replace(
                    self.annotations[name], preempt=(Rung.STOP,), requeue=False
                )
        self.annotations = {s.name: s for s in specs}
        # how a unit went down is forgotten with its annotation: a preempted one is not
        # brought back (the core says so), and annotated again it is a new unit
        for ended in (self.held, self.finished, self.failed):
            ended.intersection_update(names)
        # one kept active forgotten with its annotation: annotated again, the adapter tells
        # the core what systemd shows as for any unit (not modelled: taken for stopped)
        self.remaining.intersection_update(names)
        dropped = sorted(self.preempted.keys() - names)
        for name in dropped:
            del self.preempted[name]
        for name in sorted((self.at_gate | set(self.pending_starts)) - names):
            # a start not answered yet is forgotten (units stopping for it stop for nobody,
            # as for a start that was cancelled): one at its gate is let through by the
            # controller and runs ungated, on no GPUs of gpuslice's; one on its way runs so
            # too (`finish_start`), unless annotated again before: then it asks anew
            if name in self.at_gate:
                self.at_gate.discard(name)
                self.unmanaged.add(name)
            self.announced.discard(name)
            self.told_to_wait.discard(name)
            self.known_at.pop(name, None)
        actions = self._feed(self.sched.set_specs(self.annotations))
        said = [
            a.decision.unit
            for a in actions
            if isinstance(a, Log) and a.decision is not None and a.decision.cause is Cause.PREEMPTED
        ]
        if said != dropped:
            raise InvariantError(f"preemptions forgotten: {dropped}; said of {said}")
        for name in sorted(self.unmanaged & set(self.annotations)):
            # annotated while it runs: the adapter tells the core, which counts it somewhere
            # (no action says where: the one place the model reads the scheduler's books)
            self.unmanaged.discard(name)
            adopted = self.sched.running(name)
            self.running[name] = tuple(sorted(self.sched.holders[name].gpus))
            actions += self._feed(adopted)
        return actions

    def sample(self, gpus: Iterable[Gpu]) -> list[Action]:
        """A new NVML sample: sizes, reserve, foreign use, lost GPUs."""
        self.devices = {g.index: g for g in gpus}
        return self._feed(self.sched.set_gpus(self.devices.values()))

    def new_boot(self) -> list[Action]:
        """The host rebooted (nothing runs): finished and failed units may run again."""
        assert not self.running and not self.at_gate and not self.suspended and self.quiet
        self.finished.clear()
        self.failed.clear()
        self.remaining.clear()  # the reboot stopped them
        self.sched.forget_boot()
        return self._feed(self.sched.schedule())

    def restart(self) -> list[Action]:
        """The controller restarts. A fresh Scheduler loads the saved state; running units
        are adopted on their saved GPUs (those being stopped as such), every gate still
        waiting and every start job still queued (but gpuslice's own, whose place is saved)
        queues, and units caught between suspend and resume are resumed (`recover`:
        the adapter's work in flight reported to the old controller), all before anything is
        decided (the controller's rebuild). A gate that asks late may find its unit started
        by refill meanwhile: systemd merges that start into its job. What the old controller
        knew only in memory is forgotten by the model too: when each unit went out, when
        requests were known and gates answered (the thrash rule holds within one
        controller's life), whose suspend or freeze failed."""
        saved = self.sched.save()
        self.sched = self._scheduler()
        self.sched.load(saved)
        self._loaded()
        # a unit whose annotation went while it ran keeps its GPUs on the same terms
        # (`last_specs`): the last controller saved them
        for forgotten in (self.out_since, self.known_at, self.answered_at):
            forgotten.clear()
        self.suspend_failed.clear()
        self.unfreezable.clear()
        self.unstoppable.clear()
        self.paused.clear()  # the delays were the last controller's
        caught = set(self.pending_suspends) | set(self.pending_resumes)
        for name in self.pending_suspends:
            self.suspend_for.pop(name, None)
            for victims in self.victims_of.values():
                victims.discard(name)  # no longer on its way out for anyone
        self.pending_suspends.clear()
        self.pending_resumes.clear()
        # start jobs queued, their gates not yet asking: the new controller sees them in
        # systemd's queue and queues them with the gates, as its rebuild does
        # (tracker.bound_for_gate), but for the starts of its own it saved (their places kept)
        self.announced.clear()
        queued = {
            n for n in self.pending_starts if self.sched.phase(n) is None and n in self.annotations
        }  # one whose annotation went runs ungated (finish_start)
        gates = sorted(self.at_gate | queued)
        self.at_gate.clear()
        adopted: list[Action] = []
        with self.sched.deferred():  # as the controller's rebuild: take in all, decide once
            for name, gpus in sorted(self.running.items()):
                if name in self.annotations:
                    stopping = name in self.pending_stops
                    adopted += self.sched.running(name, gpus, stopping=stopping)
            for name in gates:
                if name in self.pending_starts:  # started by refill before its gate asked again
                    self.pending_starts.remove(name)  # one start job: the one at the gate
                    self.ours.discard(name)
                self.start(name)
            recovered = self.sched.recover()
        resumed = sorted(a.unit for a in recovered if isinstance(a, Resume))
        if resumed != sorted(caught) or len(resumed) != len(recovered):
            raise InvariantError(
                f"recover() resumed {resumed}; caught between suspend and resume: {sorted(caught)}"
            )
        self._caught = caught
        try:
            return self._feed(adopted + recovered + self.sched.schedule())
        finally:
            self._caught = set()

    def _loaded(self) -> None:
        """In `restart`: the new controller has read the saved state and decided nothing
        yet. What it reads besides (env files, a new NVML sample) goes here in a subclass
        (tests/test_core_renumber_properties.py)."""

    # -- what systemd does with gpuslice's actions ---------------------------------------------

    def finish_start(self, name: str | None = None) -> list[Action]:
        """The oldest (or the named) pending start job reaches the gate."""
        name = self.pending_starts[0] if name is None else name
        self.pending_starts.remove(name)
        self.ours.discard(name)
        if name not in self.annotations:
            self.unmanaged.add(name)  # its gate went away with its annotation
            return []
        return self._request(name)

    def fail_start(self, name: str) -> list[Action]:
        """A start job of gpuslice's did not reach systemd (the bus failed the call on its
        way: systemd re-executing): nothing runs and no gate will ask. The unit is owed as
        before: a unit refill may start is idle again, any other is preempted again (from
        now); it holds no GPU, and is not started again until `retry_start`."""
        assert name in self.ours and name in self.pending_starts, name
        self.pending_starts.remove(name)
        self.ours.discard(name)
        self.known_at.pop(name, None)
        self.told_to_wait.discard(name)
        spec = self.annotations.get(name)
        # a comeback of an instance is owed as before (`Scheduler.start_failed`): it stays
        # preempted, where a plain background unit is left to refill. A refill is no
        # comeback, whatever the unit's kind since (README): refill's again, or nothing once
        # on-demand (an instance a cancelled shutdown stopped, or one turned background
        # after someone started it)
        refill = name in self.refilling
        self.refilling.discard(name)
        if spec is not None and not refill and (spec.kind is not BG or is_instance(name)):
            self.preempted[name] = next(self._clock)
        self.paused.add(name)
        actions = self._feed(self.sched.start_failed(name, "no reply (NoReply)"))
        if name in self.sched.holders or name in self.sched.waiters:
            raise InvariantError(f"{name}'s start did not reach systemd: the core still counts it")
        return actions

    def retry_start(self, name: str) -> list[Action]:
        """The adapter's delay after a start that did not reach systemd is over."""
        self.paused.discard(name)
        return self._feed(self.sched.retry_start(name))

    def finish_stop(self, name: str | None = None) -> list[Action]:
        """The oldest (or the named) pending stop job completes: the unit is inactive."""
        name = self.pending_stops[0] if name is None else name
        self.pending_stops.remove(name)
        self.running.pop(name, None)
        self.at_gate.discard(name)
        for victims in self.victims_of.values():
            victims.discard(name)
        out = self._went_out(name)
        if name in self.annotations:  # else forgotten: it is not brought back
            self.preempted[name] = out
        actions = self._feed(self.sched.inactive(name, Outcome.STOPPED))
        if name in self.start_after_stop:
            self.start_after_stop.discard(name)
            if name not in self.pending_starts:
                self.pending_starts.append(name)
        return actions

    def finish_suspend(
        self,
        name: str | None = None,
        ok: bool = True,
        why: str = "the lock timed out",
        *,
        lost: bool = False,
    ) -> list[Action]:
        """The adapter is done with the oldest (or the named) suspend: its VRAM left its GPUs
        (`ok`), or it could not move it (`why`); `lost`: and undoing it (restore, unlock)
        failed for a process of the unit, which can never run again."""
        assert not (ok and lost)
        name = self.pending_suspends[0] if name is None else name
        self.pending_suspends.remove(name)
        waiter = self.suspend_for.pop(name)
        for victims in self.victims_of.values():
            victims.discard(name)  # its memory left, or it stays, or a Stop names it again
        if ok:
            self.suspended[name] = self.running.pop(name)
            self.suspended_at[name] = next(self._clock)
            return self._feed(self.sched.suspended_done(name, "1 GiB to host memory in 1 s"))
        self.suspend_failed.add(name)
        if lost:
            return self._undo_lost_a_process(name, waiter, why)
        self._falling_back = name
        try:
            actions = self._feed(self.sched.suspend_failed(name, why))
        finally:
            self._falling_back = ""
        unit = self.annotations.get(name)
        rungs = [] if unit is None else _memory_rungs(unit)
        fallback = rungs[rungs.index(Rung.SUSPEND) + 1 :] if Rung.SUSPEND in rungs else []
        other = self.annotations.get(waiter)
        still_less_urgent = (
            unit is not None and other is not None and unit.priority > other.priority
        )
        if (
            fallback
            and still_less_urgent
            and self._waits(waiter)
            and name not in self.pending_stops
        ):
            raise InvariantError(f"{name}'s suspend failed: no Stop, the next rung, for {waiter}")
        return actions

    def _undo_lost_a_process(self, name: str, waiter: str, why: str) -> list[Action]:
        """A unit whose suspend's undo lost a process is stopped, whatever its Preempt=
        (it runs on broken otherwise): still for its waiter while less urgent than it."""
        self._undo_losing = (name, waiter)
        try:
            actions = self._feed(self.sched.suspend_failed(name, why, lost=True))
        finally:
            self._undo_losing = ("", "")
        if name not in self.pending_stops:
            raise InvariantError(f"{name}'s suspend undo lost a process: it was not stopped")
        # whom its waiter waits for is not in any action: read from the core, as `_unkept`
        if self.sched.is_waiting(waiter):
            kept = self._above(waiter, name)
            if kept != (name in self.sched.waiting(waiter).victims):
                how = "no longer waits" if kept else "still waits"
                raise InvariantError(f"{waiter} {how} for {name}, stopped: its undo lost a process")
        return actions

    def fail_stop(self, name: str, *, refused: bool) -> list[Action]:
        """A stop gpuslice asked for did not happen (the job failed or was cancelled; or
        systemd `refused` it): the unit runs on, on its GPUs, and its waiter plans anew. One
        whose stop was refused is never stopped or suspended for anyone while it runs."""
        assert name in self.failing_stops(), name
        self.pending_stops.remove(name)
        for victims in self.victims_of.values():
            victims.discard(name)
        self.stopped_to_give_way.discard(name)
        self.undo_lost.discard(name)
        self.start_after_stop.discard(name)  # queued behind the stop: it merges, the unit runs
        if refused:
            self.unstoppable.add(name)
        why = "the unit refused it" if refused else "the job failed"
        actions = self._feed(self.sched.stop_failed(name, why, refused=refused))
        if name not in self.sched.holders:
            raise InvariantError(f"{name}'s stop failed: it runs, the core counts it nowhere")
        return actions

    def failing_stops(self) -> list[str]:
        """Stops of gpuslice's that may fail: of units that run on GPUs (not of a start
        withdrawn before its gate was answered, nor of a suspended unit whose GPU was lost:
        those the adapter's tests cover)."""
        return [n for n in self.pending_stops if self.running.get(n)]

    def finish_resume(self, name: str | None = None, ok: bool = True) -> list[Action]:
        """The adapter is done with the oldest (or the named) resume: the unit runs again
        (`ok`), or its restore failed (it must then be stopped)."""
        name = self.pending_resumes[0] if name is None else name
        self.pending_resumes.remove(name)
        if ok:  # (its annotation may have gone meanwhile: it holds its GPUs until it ends)
            return self._feed(self.sched.resumed(name, "after 1 s: restored in 1 s"))
        self._resume_failing = name
        try:
            actions = self._feed(self.sched.resume_failed(name, "restore ran out of memory"))
        finally:
            self._resume_failing = ""
        if name not in self.pending_stops:
            raise InvariantError(f"{name} could not be resumed and was not stopped")
        return actions

    def fail_freeze(self, name: str) -> list[Action]:
        """FreezeUnit failed for a unit gpuslice froze: it runs on beside the unit it was
        frozen for, and is not frozen again while it runs."""
        del self.frozen[name]
        self.unfreezable.add(name)
        actions = self._feed(self.sched.freeze_failed(name, "the unit is not active"))
        return actions

    def settle(self, limit: int = 1000) -> list[Action]:
        """Play every pending stop, suspend, resume and start job until nothing is pending
        (every suspend and resume works)."""
        actions: list[Action] = []
        for _ in range(limit):
            if self.pending_stops:
                actions += self.finish_stop()
            elif self.pending_suspends:
                actions += self.finish_suspend()
            elif self.pending_resumes:
                actions += self.finish_resume()
            elif self.pending_starts:
                actions += self.finish_start()
            else:
                return actions
        raise InvariantError(f"no quiet after {limit} jobs: {brief(actions)[-12:]}")

    @property
    def quiet(self) -> bool:
        return not (
            self.pending_starts
            or self.pending_stops
            or self.pending_suspends
            or self.pending_resumes
        )

    # -- the model ----------------------------------------------------------------------------

    def active(self, name: str) -> bool:
        return (
            name in self.running
            or name in self.at_gate
            or name in self.pending_starts
            or name in self.pending_stops
            or name in self.suspended
            or name in self.remaining
        )

    def _waits(self, name: str) -> bool:
        """Its start is known and not answered: a waiter, unless the core kept it a place."""
        return name in self.at_gate or name in self.pending_starts

    def _giving_way_or_back(self, name: str) -> bool:
        """Being suspended or resumed: the adapter is at work on it."""
        return name in self.suspend_for or name in self.pending_resumes

    def runs(self, name: str) -> bool:
        """Holds its GPUs and computes: granted, resumed or being resumed; not frozen, not
        on its way out (stopping, suspending)."""
        return (
            name in self.running
            and name not in self.pending_stops
            and name not in self.suspend_for
            and name not in self.frozen
        )

    def owed(self) -> set[str]:
        """Preempted by gpuslice with Requeue=yes, not started since: to be brought back."""
        return {
            n
            for n in self.preempted
            if n in self.annotations
            and self._spec(n).requeue
            and not self.active(n)
            and n not in self.paused
        }

    def idle_background(self) -> set[str]:
        """Background units gpuslice may start: nobody stopped them, none ended or failed."""
        return {
            n
            for n, s in self.annotations.items()
            if s.kind is BG
            and not is_template(n)
            and not self.active(n)
            and n not in self.unmanaged
            and n not in self.preempted
            and n not in self.held
            and n not in self.finished
            and n not in self.failed
            and n not in self.paused
        }

    def _record(self, ended: set[str], name: str) -> None:
        """How a unit ended (held, finished, failed), kept while it is annotated: one whose
        annotation went is forgotten when it ends, and a refill may start it once it is
        annotated again."""
        if name in self.annotations:
            ended.add(name)

    def _spec(self, name: str) -> UnitSpec:
        """The unit's annotation, or the last one it had (it runs on, holding its GPUs)."""
        spec = self.annotations.get(name)
        return spec if spec is not None else self.last_specs[name]

    def could_fit_alone(self, unit: UnitSpec, besides: Collection[int] = ()) -> bool:
        """Whether the unit fits on this host with nothing else running (on GPUs but
        `besides`)."""
        usable = [
            g for g in self.devices.values() if self._may_use(unit, g) and g.index not in besides
        ]
        return len(usable) >= unit.gpus

    def _rooms_kept_from(self, unit: UnitSpec) -> set[int]:
        """The GPUs of suspended units more urgent than it: their room is kept from it."""
        return {
            g
            for other, on in self.suspended.items()
            if other in self.annotations and self._spec(other).priority < unit.priority
            for g in on
        }

    def _fits_alone_on(self, unit: UnitSpec, gpus: Iterable[int]) -> bool:
        """Whether the suspended unit fits back on its GPUs with nothing else running: its
        Devices= chose them when it was granted and is not asked again (NVML may have numbered
        them anew since, or the pin was edited: it applies from the next start)."""
        unpinned = dataclasses.replace(unit, devices=())
        return all(i in self.devices and self._may_use(unpinned, self.devices[i]) for i in gpus)

    def _may_use(self, unit: UnitSpec, gpu: Gpu) -> bool:
        if gpu.lost or (unit.devices and not any(gpu.matches(d) for d in unit.devices)):
            return False
        if self._avoids_foreign(unit) and gpu.foreign_pids:
            return False
        free = room(gpu)
        return unit.memory is None or free is None or unit.memory <= free

    def _avoids_foreign(self, unit: UnitSpec) -> bool:
        return self.yield_to_foreign and unit.kind is BG

    def _fits_wherever(self, small: UnitSpec, big: UnitSpec) -> bool:
        """Whether `small` fits wherever `big` does, whatever else runs (same or fewer GPUs,
        no more memory, no pinning, no stricter rule about foreign processes)."""
        if small.devices or small.gpus > big.gpus:
            return False
        if self._avoids_foreign(small) and not self._avoids_foreign(big):
            return False
        if small.memory is None or big.memory is None:
            return small.memory is None and big.memory is None
        return small.memory <= big.memory

    def _went_out(self, name: str) -> int:
        now = next(self._clock)
        self.out_since[name] = now
        for victims in self.victims_of.values():
            victims.discard(name)
        if name in self.pending_suspends:
            self.pending_suspends.remove(name)
        if name in self.pending_resumes:
            self.pending_resumes.remove(name)
        for ladder in (self.suspend_for, self.suspended, self.suspended_at, self.frozen):
            ladder.pop(name, None)  # a suspended unit stopped by hand is held like any other
        self.suspend_failed.discard(name)
        self.unfreezable.discard(name)
        self.stopped_to_give_way.discard(name)
        self.undo_lost.discard(name)
        self.unstoppable.discard(name)
        self.at_gate.discard(name)
        self.announced.discard(name)
        self.told_to_wait.discard(name)
        self.known_at.pop(name, None)
        self.answered_at.pop(name, None)
        return now

    # -- checking every batch of actions --------------------------------------------------------

    def _request(self, name: str) -> list[Action]:
        spec = self.annotations.get(name)
        assert spec is not None, f"{name} is not annotated"
        self.at_gate.add(name)
        self.announced.discard(name)
        for gone in (self.held, self.finished, self.failed):
            gone.discard(name)
        self.preempted.pop(name, None)
        self.paused.discard(name)
        self.known_at.setdefault(name, next(self._clock))
        return self._feed(self.sched.request(spec))

    def _feed(self, actions: list[Action]) -> list[Action]:
        self.actions += actions
        start, unkept = next(self._clock), self._unkept()
        # a unit frozen for others is frozen for those still running, and still more urgent
        # than it (a reload), when the core looks again: the others no longer count
        for name, owners in self.frozen.items():
            self.frozen[name] = {u for u in owners if self.runs(u) and self._above(u, name)}
        stopping_for = {w for w, victims in self.victims_of.items() if victims}
        owed, idle = self.owed(), self.idle_background()
        started: list[str] = []
        granted: list[Grant] = []
        self._to_freeze = {}
        self._resumed = []
        for action in actions:
            if isinstance(action, Log) and action.decision is not None:
                if action.decision.code is Code.WAIT:
                    self.told_to_wait.add(action.decision.unit)
                elif action.decision.code is Code.KEEP:
                    self.told_to_wait.discard(action.decision.unit)
            if isinstance(action, Grant):
                self._on_grant(action)
                granted.append(action)
            elif isinstance(action, Stop):
                self._on_stop(action, stopping_for)
            elif isinstance(action, Start):
                self._check_start_order(action, owed - set(started), idle - set(started))
                self._on_start(action)
                started.append(action.unit)
            elif isinstance(action, Suspend):
                self._on_suspend(action, stopping_for)
            elif isinstance(action, Resume):
                self._on_resume(action)
            elif isinstance(action, Freeze):
                self._on_freeze(action)
            elif isinstance(action, Thaw):
                self._on_thaw(action)
        for unit, left in sorted(self._to_freeze.items()):
            if left:
                raise InvariantError(f"{unit} granted beside {sorted(left)}: none was frozen")
        unowned = sorted(n for n in self.frozen if n not in self.annotations)
        if unowned:
            raise InvariantError(f"{unowned} left frozen without an annotation")
        self._known_anew(unkept, start, granted)
        self._check_books()
        self._check_waiters(granted)
        # FreezeUnit fails for these units: the adapter says so right after
        failing = [a.unit for a in actions if isinstance(a, Freeze) and a.unit in self.freeze_fails]
        for name in failing:
            if name in self.frozen:
                actions = actions + self.fail_freeze(name)
        return actions

    def _unkept(self) -> dict[str, int]:
        """Starts whose place the core kept (silently, before its gate asked) and that lost
        it in the batch being fed (its GPU lost or filled, a more urgent start), each with
        when the core counts it known anew for the thrash rule (`Scheduler._unkept`): a
        moment inside the batch, before or after the batch's grants, that this model cannot
        see, and reads from the core's sequence (`Waiter.since` against `Holder.granted`).
        While the batch is checked they count as known after every grant (a stop for them
        is of a unit granted before); `_known_anew` places them among the batch's grants.
        A place kept is the core's own too."""
        kept = {n for n in self.sched.grants() if self.sched.phase(n) is Phase.STARTING}
        waiting = set(self.sched.waiting_units())
        lost = self._kept - kept
        unkept = {
            n: self.sched.waiters[n].since for n in sorted(lost - self._preempting) if n in waiting
        }
        self._preempting -= lost
        self._kept = kept
        for name in unkept:
            self.known_at[name] = _LATER_THAN_ANY_GRANT
        return unkept

    def _known_anew(self, unkept: dict[str, int], start: float, grants: list[Grant]) -> None:
        """Each start that lost its kept place in this batch is known from just after the
        batch's grants the core made before it lost it (`start`: the batch's beginning)."""
        for name, since in unkept.items():
            before = [
                self.answered_at[g.unit]
                for g in grants
                if g.unit in self.sched.holders and self.sched.holders[g.unit].granted < since
            ]
            self.known_at[name] = max(before, default=start) + 0.5

    def _on_grant(self, grant: Grant) -> None:
        name = grant.unit
        unit = self.annotations.get(name)
        if name not in self.at_gate or unit is None:
            raise InvariantError(f"Grant for {name}, whose gate is not asking")
        if len(set(grant.gpus)) != unit.gpus or len(grant.gpus) != unit.gpus:
            raise InvariantError(f"Grant {name} on {grant.gpus}: it needs {unit.gpus} GPUs")
        for index in grant.gpus:
            gpu = self.devices.get(index)
            if gpu is None or gpu.lost:
                raise InvariantError(f"Grant {name} on GPU {index}: unknown or lost")
            if unit.devices and not any(gpu.matches(d) for d in unit.devices):
                raise InvariantError(f"Grant {name} on GPU {index}: Devices= {unit.devices}")
            self._check_room(unit, gpu)
        still = self.victims_of.pop(name, set())
        if still:
            raise InvariantError(f"Grant {name} while its victims {sorted(still)} still run")
        self._check_suspended_room(unit, grant.gpus, f"Grant {name}")
        self.at_gate.discard(name)
        self.running[name] = grant.gpus
        self.answered_at[name] = next(self._clock)
        # every less urgent unit beside it that may freeze gives it its compute: one that
        # runs is frozen now (a Freeze follows in this batch), one frozen is frozen for it too
        self._to_freeze[name] = set()
        for other, gpus in sorted(self.running.items()):
            spec = self.annotations.get(other)
            if (
                other == name
                or spec is None
                or not set(gpus) & set(grant.gpus)
                or spec.priority <= unit.priority
                or Rung.FREEZE not in spec.preempt
                or other in self.unfreezable
            ):
                continue
            if other in self.frozen:
                self.frozen[other].add(name)
            elif self.runs(other) and other not in self.pending_resumes:
                self._to_freeze[name].add(other)

    def _check_room(self, unit: UnitSpec, gpu: Gpu, what: str = "Grant") -> None:
        """A whole-GPU unit shares with nobody; declared memory fits in what is free."""
        problem = self._no_room(unit, gpu)
        if problem:
            raise InvariantError(f"{what} {unit.name} on GPU {gpu.index}{problem}")

    def _no_room(self, unit: UnitSpec, gpu: Gpu) -> str:
        """Why the unit does not fit on the GPU next to every unit that holds it (running,
        frozen, being stopped, suspended or resumed; not suspended): "" when it fits."""
        others = [n for n, gpus in self.running.items() if gpu.index in gpus and n != unit.name]
        free = room(gpu)
        if not others:
            if unit.memory is not None and free is not None and unit.memory > free:
                return ": over its memory"
            return ""
        whole = [n for n in others if self._memory_of(n) is None]
        if unit.memory is None or free is None or whole:
            return f", shared with {sorted(others)}: a whole-GPU unit or a GPU of unknown size"
        declared = unit.memory + sum(self._memory_of(n) or 0 for n in others)
        if declared > free:
            return f": {declared} bytes declared beside {sorted(others)}, {free} free"
        return ""

    def _check_suspended_room(self, unit: UnitSpec, gpus: tuple[int, ...], what: str) -> None:
        """A more urgent suspended unit (or as urgent, suspended earlier) keeps its room on
        its GPUs from `unit`, about to hold `gpus`: it still fits there next to everyone."""
        key = self._resume_key(unit.name)
        checks = [
            (self._spec(other), self.devices[index])
            for other, where in sorted(self.suspended.items())
            if other != unit.name
            and self._resume_key(other) <= key
            and self._can_come_back(where)  # else it is stopped: its room is no one's
            for index in sorted(set(where) & set(gpus))
        ]
        self.running[unit.name] = gpus
        try:
            for spec, gpu in checks:
                problem = self._no_room(spec, gpu)
                if problem:
                    raise InvariantError(
                        f"{what}: takes the room of suspended {spec.describe()} on GPU "
                        f"{gpu.index}{problem}"
                    )
        finally:
            del self.running[unit.name]

    def _can_come_back(self, gpus: Iterable[int]) -> bool:
        return all(g in self.devices and not self.devices[g].lost for g in gpus)

    def _behind_one_that_cannot_come_back(self, name: str) -> bool:
        """A suspended unit ahead of it, on a GPU of its, whose own GPUs no longer fit it."""
        gpus = set(self.suspended[name])
        return any(
            self._resume_key(other) < self._resume_key(name)
            and gpus & set(on)
            and not self._fits_alone_on(self._spec(other), on)
            for other, on in self.suspended.items()
            if other != name and other in self.annotations
        )

    def _resume_key(self, name: str) -> tuple[int, int]:
        unit = self.annotations.get(name)
        return (1000 if unit is None else unit.priority, self.suspended_at.get(name, 0))

    def _memory_of(self, name: str) -> int | None:
        unit = self.annotations.get(name, self.last_specs.get(name))
        return None if unit is None else unit.memory

    def _on_stop(self, stop: Stop, stopping_for: set[str]) -> None:
        if stop.unit in self.pending_stops:
            raise InvariantError(f"{stop.unit} stopped twice")
        lost_home = stop.unit in self.suspended  # suspended: only for a GPU lost or gone
        withdrawn = stop.decision is not None and stop.decision.code is Code.UNMANAGED
        if stop.unit in self.pending_starts:
            self.pending_starts.remove(stop.unit)  # the stop job replaces the start job
            self.ours.discard(stop.unit)
        elif withdrawn and stop.unit in self.unmanaged:
            self.unmanaged.discard(stop.unit)  # ours, at its gate: stopped, not let through
            self.at_gate.add(stop.unit)
        elif stop.unit not in self.running and stop.unit not in self.at_gate and not lost_home:
            raise InvariantError(f"Stop {stop.unit}, which is not active")
        self.pending_stops.append(stop.unit)
        d = stop.decision
        if d is not None and d.code in (Code.PREEMPT, Code.YIELD):
            self.stopped_to_give_way.add(stop.unit)
        if d is None or stop.reason != render(d):
            raise InvariantError(f"Stop {stop.unit} without its decision, or other words: {stop}")
        self.frozen.pop(stop.unit, None)  # stopped: whatever froze it no longer matters
        if d.code is Code.UNMANAGED:
            # a start of gpuslice's own whose annotation went before its gate was answered
            if stop.unit in self.annotations or stop.unit in self.running:
                raise InvariantError(f"Stop {stop.unit}, annotated or running: {stop.reason}")
            return
        if d.code is Code.YIELD:
            self._check_yield(stop.unit, d.unit)
            return
        if d.code is Code.PREEMPT and stop.unit in self.unstoppable:
            raise InvariantError(f"Stop {stop.unit} again: systemd refused its stop: {stop}")
        if d.code is Code.RESUME_FAILED and lost_home:
            home = self.suspended.pop(stop.unit)
            if all(g in self.devices and not self.devices[g].lost for g in home):
                raise InvariantError(f"Stop {stop.unit}: suspended, and its GPUs {home} answer")
            self.suspended_at.pop(stop.unit, None)
            self.running[stop.unit] = ()  # it holds nothing; its stop ends it
            return
        if lost_home:
            raise InvariantError(f"Stop {stop.unit}, suspended: {stop.reason}")
        if d.code is Code.RESUME_FAILED and stop.unit == self._undo_losing[0]:
            self._on_undo_lost(stop)
            return
        if d.code is Code.RESUME_FAILED:
            if stop.unit != self._resume_failing:
                raise InvariantError(f"Stop {stop.unit} for a failed resume it did not have")
            return
        if d.code is not Code.PREEMPT or d.priority is None or d.for_priority is None:
            raise InvariantError(f"Stop {stop.unit} is neither a preemption nor a yield: {d}")
        record = StopRecord(d.unit, d.priority, d.for_unit, d.for_priority)
        victim = self.annotations.get(record.victim, self.last_specs.get(record.victim))
        waiter = self.annotations.get(record.waiter)
        if record.victim != stop.unit or victim is None or waiter is None:
            raise InvariantError(f"Stop {stop.unit}: {stop.reason}")
        if (victim.priority, waiter.priority) != (record.victim_priority, record.waiter_priority):
            raise InvariantError(f"Stop {stop.unit} names stale priorities: {stop.reason}")
        if victim.priority <= waiter.priority:
            raise InvariantError(f"not strictly less urgent: {stop.reason}")
        rungs = _memory_rungs(victim)
        if Rung.STOP not in rungs:
            raise InvariantError(f"Stop {stop.unit}: Preempt= {_ladder(victim)} has no stop")
        if rungs[0] is Rung.SUSPEND and stop.unit not in self.suspend_failed:
            raise InvariantError(f"Stop {stop.unit} before suspend, first in {_ladder(victim)}")
        if stop.unit in self.pending_resumes:
            raise InvariantError(f"Stop {stop.unit} for {record.waiter} while it is resumed")
        if record.waiter not in self.at_gate and record.waiter not in self.pending_starts:
            raise InvariantError(f"Stop {stop.unit} for {record.waiter}, which is not waiting")
        if stop.unit not in self.running:
            raise InvariantError(f"{stop.unit} stopped before its gate was answered: {stop}")
        if self.answered_at.get(stop.unit, 0) > self.known_at.get(record.waiter, 0):
            raise InvariantError(
                f"thrash: {stop.unit} stopped for {record.waiter}, known when it was granted"
            )
        fallback = stop.unit == self._falling_back  # the same victim, its next rung
        if record.waiter in stopping_for and not fallback:
            raise InvariantError(
                f"more victims for {record.waiter} while {self.victims_of[record.waiter]} stop"
            )
        self.stops.append(record)
        self.victims_of.setdefault(record.waiter, set()).add(stop.unit)

    def _on_undo_lost(self, stop: Stop) -> None:
        """The Stop of a unit whose suspend's undo lost a process: of its GPUs, whatever its
        Preempt=. While still strictly less urgent than the waiter it was suspended for, and
        that one waits, it is that waiter's victim (no Grant for it before it is down);
        else the waiter plans anew."""
        name, waiter = self._undo_losing
        d = stop.decision
        assert d is not None
        if d.unit != name or tuple(sorted(d.gpus)) != tuple(sorted(self.running[name])):
            raise InvariantError(f"Stop {name} after its undo lost a process: {stop.reason}")
        self.undo_lost.add(name)
        if self._above(waiter, name) and self._waits(waiter):
            self.victims_of.setdefault(waiter, set()).add(name)

    def _on_suspend(self, suspend: Suspend, stopping_for: set[str]) -> None:
        name, d = suspend.unit, suspend.decision
        if d is None or suspend.reason != render(d) or d.code is not Code.SUSPEND:
            raise InvariantError(f"Suspend {name} without its decision, or other words: {suspend}")
        victim, waiter = self.annotations.get(name), self.annotations.get(d.for_unit)
        if d.unit != name or victim is None or waiter is None:
            raise InvariantError(f"Suspend {name}: {suspend.reason}")
        if (victim.priority, waiter.priority) != (d.priority, d.for_priority):
            raise InvariantError(f"Suspend {name} names stale priorities: {suspend.reason}")
        if victim.priority <= waiter.priority:
            raise InvariantError(f"Suspend, not strictly less urgent: {suspend.reason}")
        rungs = _memory_rungs(victim)
        if not rungs or rungs[0] is not Rung.SUSPEND:
            raise InvariantError(f"Suspend {name}: Preempt= {_ladder(victim)}")
        if name in self.suspend_failed:
            raise InvariantError(f"Suspend {name} again: its suspend failed while it runs")
        if name in self.unstoppable:
            raise InvariantError(f"Suspend {name}: systemd refused its stop while it runs")
        if name not in self.running or name in self.pending_stops or self._giving_way_or_back(name):
            raise InvariantError(f"Suspend {name}, which is not running: {suspend.reason}")
        if not suspend.gpus or not set(suspend.gpus) <= set(self.running[name]):
            raise InvariantError(f"Suspend {name} on {suspend.gpus}: it holds {self.running[name]}")
        if suspend.thaw_first != (name in self.frozen):
            raise InvariantError(f"Suspend {name}: thaw_first={suspend.thaw_first}, frozen or not")
        if d.for_unit not in self.at_gate and d.for_unit not in self.pending_starts:
            raise InvariantError(f"Suspend {name} for {d.for_unit}, which is not waiting")
        if self.answered_at.get(name, 0) > self.known_at.get(d.for_unit, 0):
            raise InvariantError(f"thrash: {name} suspended for {d.for_unit}, known when granted")
        if d.for_unit in stopping_for:
            raise InvariantError(
                f"more victims for {d.for_unit} while {self.victims_of[d.for_unit]} give way"
            )
        self.frozen.pop(name, None)
        self.pending_suspends.append(name)
        self.suspend_for[name] = d.for_unit
        self.victims_of.setdefault(d.for_unit, set()).add(name)

    def _on_resume(self, resume: Resume) -> None:
        name, d = resume.unit, resume.decision
        if d is None or resume.reason != render(d) or d.code is not Code.RESUME:
            raise InvariantError(f"Resume {name} without its decision, or other words: {resume}")
        if name in self._caught:  # after a restart: it holds its GPUs still
            if resume.gpus != tuple(sorted(self.running.get(name, ()))):
                raise InvariantError(f"recover() resumes {name} on {resume.gpus}")
            self._caught.discard(name)
            self.pending_resumes.append(name)
            return
        gpus = self.suspended.get(name)
        if gpus is None:
            raise InvariantError(f"Resume {name}, which is not suspended: {resume.reason}")
        if tuple(sorted(resume.gpus)) != tuple(sorted(gpus)):
            raise InvariantError(f"Resume {name} on {resume.gpus}: it was suspended from {gpus}")
        unit = self._spec(name)
        for index in gpus:
            gpu = self.devices.get(index)
            if gpu is None or gpu.lost or (self._avoids_foreign(unit) and gpu.foreign_pids):
                raise InvariantError(f"Resume {name} on GPU {index}: lost, unknown or foreign")
            self._check_room(unit, gpu, "Resume")
        # a start at its gate that is being stopped (its annotation went: Code.UNMANAGED)
        # waits for nothing
        urgent = sorted(
            n
            for n in self.at_gate
            if n not in self.pending_stops and self._spec(n).priority < unit.priority
        )
        if urgent:
            raise InvariantError(f"Resume {unit.describe()} while more urgent {urgent} wait")
        key = self._resume_key(name)
        for other in self._resumed:
            if self._resume_key(other) > key:
                raise InvariantError(f"Resume {name} after {other}, less urgent or later")
        del self.suspended[name]
        self._check_suspended_room(unit, gpus, f"Resume {name}")
        self.running[name] = gpus
        del self.suspended_at[name]
        self.pending_resumes.append(name)
        self.answered_at[name] = next(self._clock)
        self._resumed.append(name)

    def _on_freeze(self, freeze: Freeze) -> None:
        name, d = freeze.unit, freeze.decision
        if d is None or freeze.reason != render(d) or d.code is not Code.FREEZE:
            raise InvariantError(f"Freeze {name} without its decision, or other words: {freeze}")
        expected = self._to_freeze.get(d.for_unit, set())
        if name not in expected:
            unit, other = self.annotations.get(name), self.annotations.get(d.for_unit)
            why = (
                "not granted in this batch"
                if d.for_unit not in self._to_freeze or other is None
                else "not annotated"
                if unit is None
                else f"Preempt= {_ladder(unit)}"
                if Rung.FREEZE not in unit.preempt
                else f"not strictly less urgent: {unit.describe()}, {other.describe()}"
                if unit.priority <= other.priority
                else "its freeze failed while it runs"
                if name in self.unfreezable
                else "not beside it"
                if not set(self.running.get(name, ())) & set(self.running[d.for_unit])
                else "it does not run (frozen, stopping, suspended, resumed or gone)"
            )
            raise InvariantError(f"Freeze {name} for {d.for_unit}: {why}")
        expected.discard(name)
        self.frozen[name] = {d.for_unit}

    def _above(self, unit: str, other: str) -> bool:
        """Whether `unit` is strictly more urgent than `other` by their annotations now."""
        a, b = self.annotations.get(unit), self.annotations.get(other)
        return a is not None and b is not None and a.priority < b.priority

    def _on_thaw(self, thaw: Thaw) -> None:
        name = thaw.unit
        owners = self.frozen.pop(name, None)
        if owners is None:
            raise InvariantError(f"Thaw {name}, which is not frozen")
        # those that stopped running earlier in this batch (a Suspend, a Stop) count as gone
        owners = {u for u in owners if self.runs(u) and self._above(u, name)}
        if owners and name in self.annotations:
            raise InvariantError(f"Thaw {name} while {sorted(owners)}, more urgent, still run")

    def _check_yield(self, unit: str, named: str) -> None:
        spec = self.annotations.get(unit, self.last_specs.get(unit))
        if named != unit or spec is None or spec.kind is not BG or not self.yield_to_foreign:
            raise InvariantError(f"{unit} told to yield: not a background unit that must")
        if unit in self.unstoppable:
            raise InvariantError(f"{unit} told to yield: systemd refused its stop while it runs")
        on = self.running.get(unit)
        if on is not None and not any(self.devices[g].foreign_pids for g in on):
            raise InvariantError(f"{unit} told to yield GPUs {on}: no foreign process there")

    def _on_start(self, start: Start) -> None:
        name = start.unit
        spec = self.annotations.get(name)
        if spec is None:
            raise InvariantError(f"Start for {name}, which is not annotated")
        if name in self.suspended:
            raise InvariantError(f"Start for suspended {name}: it still runs")
        if name in self.held or name in self.finished or name in self.failed:
            raise InvariantError(f"Start for {name}, stopped, failed or finished: {start.reason}")
        if name in self.paused:
            raise InvariantError(f"Start for {name} before the delay after its failed start")
        if self.active(name) and name not in self.pending_starts:
            raise InvariantError(f"Start for {name}, which is not inactive")
        if start.reason.startswith("restarting preempted "):
            if name not in self.preempted or not spec.requeue:
                raise InvariantError(f"requeue of {name}, not preempted or Requeue=no")
        elif not (start.reason.startswith("starting background ") and spec.kind is BG):
            raise InvariantError(f"spontaneous Start of {name}: {start.reason}")
        d = start.decision
        if d is not None and (
            d.code is Code.REFILL or (d.code is Code.REQUEUE and d.cause is Cause.FREE)
        ):
            # onto free capacity: the GPUs it names take it next to every unit on them
            if len(set(d.gpus)) != spec.gpus:
                raise InvariantError(f"{start.reason}: it needs {spec.gpus} GPUs")
            for index in d.gpus:
                gpu = self.devices.get(index)
                if gpu is None or gpu.lost or not self._may_use(spec, gpu):
                    raise InvariantError(f"{start.reason}: GPU {index} may not run it")
                self._check_room(spec, gpu, "Start")
        self.preempted.pop(name, None)
        if d is not None and d.code is Code.REFILL:
            self.refilling.add(name)
        else:
            self.refilling.discard(name)
        self.known_at.setdefault(name, next(self._clock))
        if d is not None and d.code is Code.REQUEUE and d.cause is Cause.PREEMPTS:
            self._preempting.add(name)
        if name not in self.pending_starts:  # else it merges with a person's start job
            self.pending_starts.append(name)
            self.ours.add(name)

    def _check_start_order(self, start: Start, owed: set[str], idle: set[str]) -> None:
        """Preempted units come back before idle background units start; each kind in its
        order. `owed` and `idle` are those not started yet in this batch."""
        unit = self.annotations.get(start.unit)
        if unit is None:
            return
        if start.reason.startswith("restarting preempted "):
            key = (unit.priority, self.preempted.get(start.unit, 0))
            for name in sorted(owed - {start.unit}):
                other = self._spec(name)
                if (other.priority, self.preempted[name]) < key and self._fits_wherever(
                    other, unit
                ):
                    raise InvariantError(f"requeued {start.unit} before {name}, preempted first")
            return
        for name in sorted(owed):
            other = self._spec(name)
            if other.priority <= unit.priority and self._fits_wherever(other, unit):
                raise InvariantError(f"background {start.unit} started before preempted {name}")
        key = (unit.priority, self.out_since.get(start.unit, -1))
        for name in sorted(idle - {start.unit}):
            other = self._spec(name)
            if (other.priority, self.out_since.get(name, -1)) < key and self._fits_wherever(
                other, unit
            ):
                raise InvariantError(f"background {start.unit} started before {name}, out longer")

    def _check_books(self) -> None:
        """The scheduler's own books agree with the model on who runs where; a suspended unit
        holds no GPU there."""
        for name, gpus in self.running.items():
            known = self.sched.holders.get(name)
            if name in self.annotations and (known is None or set(gpus) != known.gpus):
                raise InvariantError(f"{name} runs on {gpus}; the scheduler lost track of it")
        for name in self.suspended:
            if name in self.sched.holders:
                raise InvariantError(f"{name} is suspended; the scheduler counts it on GPUs")

    def _check_waiters(self, grants: list[Grant]) -> None:
        """No unit still waiting at its gate, or whose start job was seen, is more urgent than
        a unit just granted GPUs it would fit on (unless capacity is being freed for it)."""
        for grant in grants:
            granted = self._spec(grant.unit)
            foreign = any(self.devices[g].foreign_pids for g in grant.gpus)
            # an announced unit gets GPUs kept silently unless it was told to wait first
            for name in sorted(self.at_gate | (self.announced & self.told_to_wait)):
                waiter = self.annotations.get(name)
                if waiter is None or self.victims_of.get(name):
                    continue
                if foreign and self._avoids_foreign(waiter):
                    continue
                if waiter.priority < granted.priority and self._fits_wherever(waiter, granted):
                    raise InvariantError(
                        f"{grant.unit} (priority {granted.priority}) granted {grant.gpus} while "
                        f"{waiter.describe()} waits"
                    )

    # -- at rest ----------------------------------------------------------------------------

    def check_quiet(self) -> None:
        """Once every job has played out: nothing left undone, nothing preempted forgotten."""
        assert self.quiet
        again = [a for a in self._feed(self.sched.schedule()) if not isinstance(a, Log)]
        if again:
            raise InvariantError(f"work left undone at rest: {brief(again)}")
        for name, gpus in sorted(self.running.items()):
            if name not in self.frozen:
                continue
            priority = self._spec(name).priority
            beside = [
                o
                for o, on in self.running.items()
                if self.runs(o) and set(on) & set(gpus) and self._spec(o).priority < priority
            ]
            if not beside:
                raise InvariantError(f"{name} frozen at rest, no more urgent unit runs beside it")
        self._check_preempted_for_the_first_waiter()

    def _check_preempted_for_the_first_waiter(self) -> None:
        """At rest, the most urgent waiter (no other as urgent) is not left waiting while a GPU
        it may use is held only by units it may preempt: strictly less urgent, granted before
        its start was known (the thrash rule), with a way to free their memory left (stop, or
        a suspend that has not failed). GPUs where a unit is suspended are left out (its room
        is kept), as are units whose annotation went."""
        waiting = sorted(self.at_gate, key=lambda n: self._spec(n).priority)
        if not waiting:
            return
        first = self._spec(waiting[0])
        if first.gpus != 1 or any(self._spec(n).priority <= first.priority for n in waiting[1:]):
            return
        kept = {g for on in self.suspended.values() for g in on}
        for gpu in self.devices.values():
            if gpu.index in kept or not self._may_use(first, gpu):
                continue
            holders = sorted(n for n, on in self.running.items() if gpu.index in on)
            if holders and all(self._gives_way_to(n, first) for n in holders):
                raise InvariantError(
                    f"{first.describe()} waits at rest while {holders}, less urgent, hold "
                    f"GPU {gpu.index}: none was preempted"
                )

    def _gives_way_to(self, name: str, waiter: UnitSpec) -> bool:
        """Whether the running unit must give way to the waiter when it needs its GPU."""
        unit = self.annotations.get(name)
        if unit is None or unit.priority <= waiter.priority or name in self.unstoppable:
            return False
        if self.answered_at.get(name, 0) > self.known_at.get(waiter.name, 0):
            return False  # granted knowing of the waiter: never stopped for it
        rungs = _memory_rungs(unit)
        if name in self.suspend_failed:
            rungs = [r for r in rungs if r is not Rung.SUSPEND]
        return bool(rungs)

    def drain(self, limit: int = 200) -> None:
        """Every running unit ends, again and again, until nothing runs: then every unit still
        waiting cannot fit on this host and was told why, and every preempted unit with
        Requeue=yes that fits on this host has come back, unless a more urgent unit still
        waits (it keeps the capacity it needs). Starts that did not reach systemd are
        sent again first (their delays end)."""
        for name in sorted(self.paused):
            self.retry_start(name)
        for _ in range(limit):
            self.settle()
            # a frozen unit cannot end: it is thawed once those it gave way to have ended
            ending = sorted(n for n in self.running if self.runs(n))
            if not ending:
                break
            for name in ending:
                if self.runs(name):
                    self.exit(name)
                if name in self.sched.restart_kept:
                    # Restart=always: ended for good (its start limit), no restart comes
                    self.restart_not_seen(name)
        else:
            raise InvariantError(f"still running after {limit} rounds: {sorted(self.running)}")
        self.check_quiet()
        # A waiter that cannot fit (a foreign process, a lost GPU) keeps capacity from units
        # as urgent or less: strict order, no backfill. A waiter it holds back is not stuck.
        waiting = [self._spec(n).priority for n in self.at_gate]
        for name in sorted(self.at_gate):
            unit = self._spec(name)
            behind = sum(1 for p in waiting if p <= unit.priority) > 1
            if self.could_fit_alone(unit, besides=self._rooms_kept_from(unit)) and not behind:
                raise InvariantError(f"{name} still waits on an idle host it fits on")
            told = [a.message for a in self.actions if isinstance(a, Log)]
            if not any(m.startswith(f"{name} waiting: ") for m in told):
                raise InvariantError(f"{name} waits and was never told why")
        # A unit still waiting keeps the capacity it needs from units as urgent or less (those
        # less urgent would be preempted as soon as it fits, an equal one would block it):
        # what it blocks is not forgotten. Waiters come before preempted units of their own
        # priority (README, "The rules in short").
        forgotten = sorted(
            n
            for n in self.owed()
            if self.could_fit_alone(self._spec(n))
            and not any(p <= self._spec(n).priority for p in waiting)
        )
        if forgotten:
            raise InvariantError(f"preempted, Requeue=yes, never brought back: {forgotten}")
        # likewise every suspended unit that fits on its own GPUs of an idle host is back,
        # but one behind a suspended unit that cannot come back (foreign memory where it
        # was): they come back in order, the room of those ahead kept (no backfill)
        stuck = sorted(
            n
            for n, gpus in self.suspended.items()
            if self._fits_alone_on(self._spec(n), gpus)
            and not any(p < self._spec(n).priority for p in waiting)
            and not self._behind_one_that_cannot_come_back(n)
        )
        if stuck:
            raise InvariantError(f"suspended, never resumed on an idle host: {stuck}")
