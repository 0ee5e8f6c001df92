"""Tiny builders for the core's tests, and `Sim`: the core inside a well-behaved systemd.

`Sim` feeds events to a `Scheduler` and plays its actions back the way systemd and the
adapter would: a `Start` becomes a start job whose gate later asks (`request`), a `Stop`
becomes a stop job after which the unit is later reported inactive. Both are queued and
played by `finish_start`, `finish_stop` or `settle`, so a test (or hypothesis) decides
what happens in between.

Every action is checked as it comes back, whatever the test: a Grant never puts two
units on one GPU and only answers a gate that is asking; a Grant never comes while a
victim chosen for that unit is still running; a Stop's victim is strictly less urgent
than the unit it is stopped for, and is never stopped twice; a Start is only for a
background unit or a preempted unit being requeued, never for a unit a person stopped,
one that failed, or one that finished. `check_quiet` adds what must hold once everything
has played out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuslice.core.model import UnitKind, UnitSpec
from gpuslice.core.scheduler import Action, Grant, Log, Outcome, Scheduler, Start, Stop

BG = UnitKind.BACKGROUND
OD = UnitKind.ON_DEMAND

_STOP_REASON = re.compile(
    r"preempting (?P<victim>\S+) \(priority (?P<vprio>\d+)\) "
    r"for (?P<waiter>\S+) \(priority (?P<wprio>\d+)\) on GPUs? [\d,]+"
)


def spec(
    name: str, prio: int, kind: UnitKind = OD, gpus: int = 1, requeue: bool = True
) -> UnitSpec:
    """`spec("vlm", 90, BG)` is `vlm.service`, priority 90, background, 1 GPU."""
    if "." not in name:
        name += ".service"
    return UnitSpec(name, prio, kind, gpus, requeue)


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
    return out


def words(actions: Iterable[Action]) -> list[str]:
    """Every reason and journal line, in order."""
    return [a.message if isinstance(a, Log) else a.reason for a in actions]


class InvariantError(AssertionError):
    """The core broke a rule; the message says which and how."""


@dataclass(frozen=True)
class StopRecord:
    victim: str
    victim_priority: int
    waiter: str
    waiter_priority: int


class Sim:
    """A Scheduler inside a well-behaved systemd that records who runs where."""

    def __init__(self, gpus: int | Iterable[int], specs: Sequence[UnitSpec] = ()) -> None:
        gpu_ids = range(gpus) if isinstance(gpus, int) else gpus
        self.annotations: dict[str, UnitSpec] = {s.name: s for s in specs}
        self.sched = Scheduler(gpu_ids, self.annotations)
        self.actions: list[Action] = []
        self.running: dict[str, tuple[int, ...]] = {}  # granted, not yet inactive
        self.at_gate: set[str] = set()  # start job waiting in the gate for a reply
        self.pending_starts: list[str] = []  # Start issued, gate not yet reached
        self.pending_stops: list[str] = []  # Stop issued, unit not yet inactive
        self.start_after_stop: set[str] = set()  # a person started it while it stopped
        self.stops: list[StopRecord] = []  # every Stop, in order
        self.victims_of: dict[str, set[str]] = {}  # waiter -> its victims not yet inactive
        self.owed: set[str] = set()  # preempted by gpuslice, nobody has decided since
        self.no_auto: set[str] = set()  # stopped by a person, failed or finished
        self.unmanaged: set[str] = set()  # still running, annotation removed

    # -- what a person or a unit does ------------------------------------------------------

    def boot(self) -> list[Action]:
        """The controller starts with nothing running: fill the GPUs."""
        return self._feed(self.sched.schedule())

    def start(self, name: str) -> list[Action]:
        """`systemctl start NAME`: its start job reaches the gate at once."""
        self.no_auto.discard(name)
        if name in self.pending_stops:
            self.start_after_stop.add(name)  # queued behind the stop job
            return []
        if name in self.running or name in self.at_gate or name in self.pending_starts:
            return []  # merges with the job already there
        return self._request(name)

    def exit(self, name: str, outcome: Outcome = Outcome.EXITED) -> list[Action]:
        """A running unit's main process ends by itself (EXITED or FAILED)."""
        assert name in self.running and name not in self.pending_stops, name
        del self.running[name]
        if outcome is not Outcome.STOPPED:
            self.no_auto.add(name)
        self.owed.discard(name)
        return self._feed(self.sched.inactive(name, outcome))

    def stop(self, name: str) -> list[Action]:
        """`systemctl stop NAME` by a person (a stop job gpuslice did not issue)."""
        if name in self.pending_stops:
            return []  # merges with gpuslice's own stop job
        if name in self.pending_starts:
            self.pending_starts.remove(name)
        elif name not in self.running and name not in self.at_gate:
            return []  # already inactive: systemd reports nothing
        self.running.pop(name, None)
        self.at_gate.discard(name)
        self.victims_of.pop(name, None)
        self.no_auto.add(name)
        self.owed.discard(name)
        return self._feed(self.sched.inactive(name, Outcome.STOPPED))

    def annotate(self, specs: Iterable[UnitSpec]) -> list[Action]:
        """New annotations (daemon-reload): the whole set, replacing the old one."""
        self.annotations = {s.name: s for s in specs}
        for name in [n for n in self.running if n not in self.annotations]:
            del self.running[name]  # runs on, but gpuslice no longer accounts for it
            self.unmanaged.add(name)
        actions = self._feed(self.sched.set_specs(self.annotations))
        for name in sorted(self.unmanaged & set(self.annotations)):
            # annotated while it runs: the adapter tells the core, which counts it somewhere
            self.unmanaged.discard(name)
            adopted = self.sched.running(name)
            self.running[name] = tuple(sorted(self.sched.holders[name].gpus))
            actions += self._feed(adopted)
        return actions

    # -- what systemd does with gpuslice's actions ---------------------------------------------

    def finish_start(self, name: str | None = None) -> list[Action]:
        """The oldest (or the named) pending start job reaches the gate."""
        name = self.pending_starts[0] if name is None else name
        self.pending_starts.remove(name)
        if name not in self.annotations:
            self.unmanaged.add(name)  # its gate went away with its annotation
            return []
        return self._request(name)

    def finish_stop(self, name: str | None = None) -> list[Action]:
        """The oldest (or the named) pending stop job completes: the unit is inactive."""
        name = self.pending_stops[0] if name is None else name
        self.pending_stops.remove(name)
        self.running.pop(name, None)
        self.at_gate.discard(name)
        for victims in self.victims_of.values():
            victims.discard(name)
        if name in self.annotations:
            self.owed.add(name)
        actions = self._feed(self.sched.inactive(name, Outcome.STOPPED))
        if name in self.start_after_stop:
            self.start_after_stop.discard(name)
            if name not in self.pending_starts:
                self.pending_starts.append(name)
        return actions

    def settle(self, limit: int = 1000) -> list[Action]:
        """Play every pending stop and start job until nothing is pending."""
        actions: list[Action] = []
        for _ in range(limit):
            if self.pending_stops:
                actions += self.finish_stop()
            elif self.pending_starts:
                actions += self.finish_start()
            else:
                return actions
        raise InvariantError(f"no quiet after {limit} jobs: {brief(actions)[-12:]}")

    @property
    def quiet(self) -> bool:
        return not self.pending_starts and not self.pending_stops

    # -- bookkeeping and checks ------------------------------------------------------------------

    def _request(self, name: str) -> list[Action]:
        spec = self.annotations.get(name)
        assert spec is not None, f"{name} is not annotated"
        self.at_gate.add(name)
        self.owed.discard(name)
        return self._feed(self.sched.request(spec))

    def _feed(self, actions: list[Action]) -> list[Action]:
        self.actions += actions
        stopping_for = {w for w, victims in self.victims_of.items() if victims}
        for action in actions:
            if isinstance(action, Grant):
                self._on_grant(action)
            elif isinstance(action, Stop):
                self._on_stop(action, stopping_for)
            elif isinstance(action, Start):
                self._on_start(action)
        self._check_books()
        self._check_order(actions)
        return actions

    def _on_grant(self, grant: Grant) -> None:
        name = grant.unit
        if name not in self.at_gate:
            raise InvariantError(f"Grant for {name}, whose gate is not asking")
        for other, gpus in self.running.items():
            if set(gpus) & set(grant.gpus):
                raise InvariantError(f"Grant {name} on {grant.gpus}: {other} runs on {gpus}")
        if len(set(grant.gpus)) != len(grant.gpus) or not set(grant.gpus) <= self.sched.gpus:
            raise InvariantError(f"Grant {name} on bad GPUs {grant.gpus}")
        still = self.victims_of.pop(name, set())
        if still:
            raise InvariantError(f"Grant {name} while its victims {sorted(still)} still run")
        self.at_gate.discard(name)
        self.running[name] = grant.gpus

    def _on_stop(self, stop: Stop, stopping_for: set[str]) -> None:
        match = _STOP_REASON.fullmatch(stop.reason)
        if match is None:
            raise InvariantError(f"Stop reason not in the journal's words: {stop.reason!r}")
        record = StopRecord(
            match["victim"], int(match["vprio"]), match["waiter"], int(match["wprio"])
        )
        if record.victim != stop.unit:
            raise InvariantError(f"Stop {stop.unit} says it preempts {record.victim}")
        if record.victim_priority <= record.waiter_priority:
            raise InvariantError(f"not strictly less urgent: {stop.reason}")
        if stop.unit in self.pending_stops:
            raise InvariantError(f"{stop.unit} stopped twice")
        if stop.unit in self.pending_starts:
            self.pending_starts.remove(stop.unit)  # the stop job replaces the start job
        elif stop.unit not in self.running and stop.unit not in self.at_gate:
            raise InvariantError(f"Stop {stop.unit}, which is not active")
        if record.waiter in stopping_for:
            raise InvariantError(
                f"more victims for {record.waiter} while {self.victims_of[record.waiter]} stop"
            )
        self.stops.append(record)
        self.pending_stops.append(stop.unit)
        self.victims_of.setdefault(record.waiter, set()).add(stop.unit)

    def _on_start(self, start: Start) -> None:
        name = start.unit
        spec = self.annotations.get(name)
        if spec is None:
            raise InvariantError(f"Start for {name}, which is not annotated")
        if name in self.no_auto:
            raise InvariantError(f"Start for {name}, stopped, failed or finished: {start.reason}")
        busy = name in self.running or name in self.at_gate or name in self.pending_stops
        if busy:
            raise InvariantError(f"Start for {name}, which is not inactive")
        if start.reason.startswith("restarting preempted "):
            if name not in self.owed or not spec.requeue:
                raise InvariantError(f"requeue of {name}, not preempted or Requeue=no")
        elif not (start.reason.startswith("starting background ") and spec.kind is BG):
            raise InvariantError(f"spontaneous Start of {name}: {start.reason}")
        self.owed.discard(name)
        if name not in self.pending_starts:  # else it merges with a person's start job
            self.pending_starts.append(name)

    def _check_books(self) -> None:
        """The scheduler's own books never put two units on one GPU."""
        seen: dict[int, str] = {}
        for name, holder in self.sched.holders.items():
            for gpu in holder.gpus:
                if gpu in seen:
                    raise InvariantError(f"GPU {gpu} counted for {seen[gpu]} and {name}")
                seen[gpu] = name
        for name, gpus in self.running.items():
            known = self.sched.holders.get(name)
            if name in self.annotations and (known is None or set(gpus) != known.gpus):
                raise InvariantError(f"{name} runs on {gpus}; the scheduler lost track of it")

    def _check_order(self, actions: list[Action]) -> None:
        """No waiter stays waiting while a less urgent one is granted GPUs it would fit on."""
        for grant in (a for a in actions if isinstance(a, Grant)):
            granted = self.sched.holders[grant.unit].spec.priority
            for waiter in self.sched.waiters.values():
                if waiter.victims or waiter.spec.gpus > len(grant.gpus):
                    continue  # capacity is already being freed for it, or it would not fit
                if waiter.spec.priority < granted:
                    raise InvariantError(
                        f"{grant.unit} (priority {granted}) granted {grant.gpus} while "
                        f"{waiter.spec.describe()} waits: {waiter.reason}"
                    )

    def check_quiet(self) -> None:
        """Once every job has played out: nothing left undone, nothing preempted forgotten."""
        assert self.quiet
        again = [a for a in self.sched.schedule() if not isinstance(a, Log)]
        if again:
            raise InvariantError(f"work left undone at rest: {brief(again)}")
        for name in sorted(self.owed & set(self.annotations)):
            if not self.annotations[name].requeue:
                continue
            known = (
                name in self.sched.preempted
                or name in self.sched.waiters
                or name in self.sched.holders
                or name in self.sched.held
            )
            if not known:
                raise InvariantError(f"preempted {name} (Requeue=yes) was forgotten")
