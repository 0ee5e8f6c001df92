"""The scheduling rules: events in, actions out, every decision with its reason.

The scheduler owns no I/O. Adapters tell it what systemd reported (a gate request, a unit
that became inactive, new annotations) and carry out the actions it returns (reply to the
gate, StopUnit, StartUnit, a journal line). Ordering uses a sequence counter, not a clock,
so tests are exact and restarts keep the order.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuslice.core.model import UnitKind, UnitSpec
from gpuslice.core.placement import Candidate, choose_victims, format_gpus, pick_free


class Phase(enum.Enum):
    """Why a unit counts against capacity."""

    STARTING = "starting"  # gpuslice asked systemd to start it; its gate has not asked yet
    RUNNING = "running"  # granted: its main process may run
    STOPPING = "stopping"  # gpuslice asked systemd to stop it for a more urgent unit


class Outcome(enum.Enum):
    """How a unit became inactive, as far as systemd can tell the adapter."""

    STOPPED = "stopped"  # a stop job that gpuslice did not issue (systemctl stop)
    EXITED = "exited"  # its main process ended successfully on its own
    FAILED = "failed"  # failed, crashed or could not start
    SHUTDOWN = "shutdown"  # stopped because the system is going down


@dataclass(frozen=True)
class Grant:
    """Let the unit's start job continue on these GPUs."""

    unit: str
    gpus: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Stop:
    """Stop the unit through systemd (its own ExecStop/KillSignal give it a graceful end)."""

    unit: str
    reason: str


@dataclass(frozen=True)
class Start:
    """Start the unit through systemd; its start job then passes the gate."""

    unit: str
    reason: str


@dataclass(frozen=True)
class Log:
    """One journal line."""

    message: str
    level: str = "info"


Action = Grant | Stop | Start | Log


@dataclass
class Holder:
    spec: UnitSpec
    gpus: frozenset[int]
    phase: Phase
    seq: int
    stopping_for: str | None = None


@dataclass
class Waiter:
    spec: UnitSpec
    seq: int
    victims: set[str] = field(default_factory=set)
    reason: str = ""


@dataclass
class Snapshot:
    """What `gpuslice status` shows; produced here so the words match the journal."""

    gpus: dict[int, list[tuple[str, int, str]]]
    waiting: list[tuple[str, int, str]]
    preempted: list[tuple[str, int, bool]]
    held: list[str]
    finished: list[str]
    failed: list[str]


@dataclass
class SavedState:
    """What the controller persists: everything systemd cannot tell it after a restart."""

    holders: dict[str, tuple[tuple[int, ...], str, int]] = field(default_factory=dict)
    preempted: dict[str, int] = field(default_factory=dict)
    held: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    seq: int = 0


def _describe(spec: UnitSpec) -> str:
    return f"{spec.name} (priority {spec.priority})"


class Scheduler:
    """The whole scheduling state of one host, and the rules that change it."""

    def __init__(self, gpus: Iterable[int], specs: Mapping[str, UnitSpec]) -> None:
        self.gpus: frozenset[int] = frozenset(gpus)
        self.specs: dict[str, UnitSpec] = dict(specs)
        self.holders: dict[str, Holder] = {}
        self.waiters: dict[str, Waiter] = {}
        self.preempted: dict[str, int] = {}  # unit -> seq when it was preempted
        self.held: set[str] = set()
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.out_since: dict[str, int] = {}
        self._seq = 0

    # -- events ---------------------------------------------------------------------------

    def request(self, spec: UnitSpec) -> list[Action]:
        """A unit's start job reached the gate and asks for its GPUs."""
        name = spec.name
        self.specs.setdefault(name, spec)
        self.held.discard(name)
        self.finished.discard(name)
        self.failed.discard(name)
        self.preempted.pop(name, None)
        holder = self.holders.get(name)
        if holder is not None and holder.phase is Phase.STOPPING:
            return []  # its start is being cancelled by our own stop job
        if holder is not None:
            if holder.gpus:
                holder.phase = Phase.RUNNING
                return [Grant(name, tuple(sorted(holder.gpus)), self._grant_reason(holder))]
            del self.holders[name]  # a requeue that must queue like everyone else
        if name not in self.waiters:
            if spec.gpus > len(self.gpus):
                return [
                    Log(
                        f"{_describe(spec)} needs {spec.gpus} GPUs but this host has "
                        f"{len(self.gpus)}: it waits until the configuration changes",
                        "warning",
                    ),
                    *self._enqueue(spec),
                ]
            return self._enqueue(spec)
        return self.schedule()

    def inactive(self, name: str, outcome: Outcome) -> list[Action]:
        """The unit is inactive or failed (or its waiting start job was cancelled)."""
        actions: list[Action] = []
        self.out_since[name] = self._next()
        waiter = self.waiters.pop(name, None)
        holder = self.holders.pop(name, None)
        if waiter is not None and holder is None:
            actions.append(Log(f"{name}: start cancelled while waiting; nothing reserved"))
        if holder is not None and holder.phase is Phase.STOPPING:
            spec = self.specs.get(name, holder.spec)
            self.preempted[name] = self.out_since[name]
            if not spec.requeue:
                actions.append(Log(f"{_describe(spec)} preempted; Requeue=no, not restarting"))
        elif outcome is Outcome.STOPPED:
            self.held.add(name)
            self.preempted.pop(name, None)
            actions.append(Log(f"{name} was stopped outside gpuslice: held until started again"))
        elif outcome is Outcome.FAILED:
            self.failed.add(name)
            actions.append(
                Log(
                    f"{name} failed: gpuslice will not start it by itself "
                    "(its own Restart= policy applies)",
                    "warning",
                )
            )
        elif outcome is Outcome.EXITED and holder is not None:
            self.finished.add(name)
            actions.append(Log(f"{name} finished: released {format_gpus(holder.gpus)}"))
        if holder is not None and outcome is Outcome.SHUTDOWN:
            actions.append(Log(f"{name} stopped for shutdown: released {format_gpus(holder.gpus)}"))
        return actions + self.schedule()

    def running(
        self, name: str, gpus: Iterable[int] | None = None, *, stopping: bool = False
    ) -> list[Action]:
        """Systemd shows the unit running past the gate without a grant: take note of it.

        This happens after a controller restart (then `gpus` is what we had granted, and
        `stopping` says we had asked systemd to stop it for a more urgent unit) and for a
        unit whose annotation appeared while it ran. It holds GPUs from now on.
        """
        spec = self.specs.get(name)
        if spec is None:
            return []
        holder = self.holders.get(name)
        if holder is not None and holder.phase is Phase.STARTING and holder.gpus:
            holder.phase = Phase.RUNNING
            return self.schedule()
        if holder is not None and holder.gpus:
            return []
        self.holders.pop(name, None)
        self.waiters.pop(name, None)
        taken = self._taken()
        wanted = frozenset(gpus or ()) & self.gpus
        if len(wanted) != spec.gpus or wanted & taken:
            wanted = frozenset(pick_free(self.gpus - taken, spec.gpus) or ())
        actions: list[Action] = []
        if len(wanted) < spec.gpus:
            actions.append(
                Log(
                    f"{_describe(spec)} is running without enough free GPUs to account "
                    "for it; counting it on none",
                    "warning",
                )
            )
        phase = Phase.STOPPING if stopping else Phase.RUNNING
        self.holders[name] = Holder(spec, wanted, phase, self._next())
        return actions + self.schedule()

    def set_specs(self, specs: Mapping[str, UnitSpec]) -> list[Action]:
        """Annotations were (re)read: apply new priorities, forget units no longer managed."""
        actions: list[Action] = []
        self.specs = dict(specs)
        for name in list(self.holders):
            if name not in self.specs:
                del self.holders[name]
                actions.append(Log(f"{name} is no longer annotated: released its GPUs"))
            else:
                self.holders[name].spec = self.specs[name]
        for name in list(self.waiters):
            if name in self.specs:
                self.waiters[name].spec = self.specs[name]
        return actions + self.schedule()

    # -- the rules --------------------------------------------------------------------------

    def schedule(self) -> list[Action]:
        """Serve waiters, then requeue preempted units, then fill with background units."""
        actions: list[Action] = []
        reserved: set[int] = set()
        blocked_claims: dict[int, set[int]] = {}
        for waiter in sorted(self.waiters.values(), key=lambda w: (w.spec.priority, w.seq)):
            actions += self._serve(waiter, reserved, blocked_claims)
        actions += self._requeue(reserved, blocked_claims)
        actions += self._refill(reserved, blocked_claims)
        return actions

    def _serve(
        self, waiter: Waiter, reserved: set[int], blocked_claims: dict[int, set[int]]
    ) -> list[Action]:
        spec = waiter.spec
        waiter.victims &= {n for n, h in self.holders.items() if h.phase is Phase.STOPPING}
        free = self._available(reserved, blocked_claims, spec.priority)
        chosen = pick_free(free, spec.gpus)
        if chosen is not None and not waiter.victims:
            del self.waiters[spec.name]
            holder = Holder(spec, frozenset(chosen), Phase.RUNNING, self._next())
            self.holders[spec.name] = holder
            reserved.update(chosen)
            return [Grant(spec.name, chosen, self._grant_reason(holder))]
        if waiter.victims:
            victim_gpus = {g for v in waiter.victims for g in self.holders[v].gpus}
            reserved.update(victim_gpus)
            reserved.update(sorted(free)[: max(0, spec.gpus - len(victim_gpus))])
            return self._set_reason(waiter, self._stopping_reason(waiter))
        candidates = [
            Candidate(n, h.spec.priority, h.gpus, h.seq)
            for n, h in self.holders.items()
            if h.phase is not Phase.STOPPING and h.spec.priority > spec.priority and h.gpus
        ]
        victims = (
            choose_victims(spec.gpus, free, candidates) if spec.gpus <= len(self.gpus) else None
        )
        if not victims:
            blocked_claims.setdefault(spec.priority, set()).update(sorted(free)[: spec.gpus])
            return self._set_reason(waiter, self._blocked_reason(spec))
        actions: list[Action] = []
        for victim in victims:
            holder = self.holders[victim.name]
            holder.phase = Phase.STOPPING
            holder.stopping_for = spec.name
            waiter.victims.add(victim.name)
            reserved.update(holder.gpus)
            actions.append(
                Stop(
                    victim.name,
                    f"preempting {_describe(holder.spec)} for {_describe(spec)} "
                    f"on {format_gpus(holder.gpus)}",
                )
            )
        victim_gpus = {g for v in victims for g in v.gpus}
        reserved.update(sorted(free)[: max(0, spec.gpus - len(victim_gpus))])
        return actions + self._set_reason(waiter, self._stopping_reason(waiter))

    def _requeue(self, reserved: set[int], blocked_claims: dict[int, set[int]]) -> list[Action]:
        actions: list[Action] = []
        for name, _ in sorted(self.preempted.items(), key=lambda i: (self._prio(i[0]), i[1])):
            spec = self.specs.get(name)
            if spec is None or not spec.requeue or name in self.holders or name in self.waiters:
                continue
            free = self._available(reserved, blocked_claims, spec.priority)
            chosen = pick_free(free, spec.gpus)
            if chosen is not None:
                reserved.update(chosen)
                gpus: frozenset[int] = frozenset(chosen)
                where = format_gpus(chosen)
            else:
                candidates = [
                    Candidate(n, h.spec.priority, h.gpus, h.seq)
                    for n, h in self.holders.items()
                    if h.phase is not Phase.STOPPING and h.spec.priority > spec.priority and h.gpus
                ]
                if spec.gpus > len(self.gpus) or not choose_victims(spec.gpus, free, candidates):
                    continue
                gpus = frozenset()  # its gate request will preempt like any other start
                where = "GPUs held by less urgent units"
            del self.preempted[name]
            self.holders[name] = Holder(spec, gpus, Phase.STARTING, self._next())
            actions.append(Start(name, f"restarting preempted {_describe(spec)} on {where}"))
        return actions

    def _refill(self, reserved: set[int], blocked_claims: dict[int, set[int]]) -> list[Action]:
        actions: list[Action] = []
        idle = [
            spec
            for name, spec in self.specs.items()
            if spec.kind is UnitKind.BACKGROUND
            and "@." not in name
            and name not in self.holders
            and name not in self.waiters
            and name not in self.preempted
            and name not in self.held
            and name not in self.finished
            and name not in self.failed
        ]
        for spec in sorted(idle, key=lambda s: (s.priority, self.out_since.get(s.name, -1))):
            free = self._available(reserved, blocked_claims, spec.priority)
            chosen = pick_free(free, spec.gpus)
            if chosen is None:
                continue
            reserved.update(chosen)
            self.holders[spec.name] = Holder(spec, frozenset(chosen), Phase.STARTING, self._next())
            actions.append(
                Start(
                    spec.name,
                    f"starting background {_describe(spec)} on free {format_gpus(chosen)}",
                )
            )
        return actions

    # -- helpers ----------------------------------------------------------------------------

    def _enqueue(self, spec: UnitSpec) -> list[Action]:
        self.waiters[spec.name] = Waiter(spec, self._next())
        return self.schedule()

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _prio(self, name: str) -> int:
        spec = self.specs.get(name)
        return spec.priority if spec is not None else 1000

    def _taken(self) -> set[int]:
        return {g for h in self.holders.values() for g in h.gpus}

    def _available(
        self, reserved: set[int], blocked_claims: dict[int, set[int]], priority: int
    ) -> set[int]:
        """Free GPUs this unit may take: not held, not promised to a more urgent waiter,
        and not kept for an earlier waiter of the same priority (which could never
        preempt it later)."""
        return set(self.gpus) - self._taken() - reserved - blocked_claims.get(priority, set())

    def _grant_reason(self, holder: Holder) -> str:
        return f"starting {_describe(holder.spec)} on {format_gpus(holder.gpus)}"

    def _stopping_reason(self, waiter: Waiter) -> str:
        parts = [
            f"{_describe(self.holders[v].spec)} to stop on {format_gpus(self.holders[v].gpus)}"
            for v in sorted(waiter.victims)
        ]
        return "waiting for " + ", ".join(parts)

    def _blocked_reason(self, spec: UnitSpec) -> str:
        if spec.gpus > len(self.gpus):
            return f"waiting: needs {spec.gpus} GPUs, this host has {len(self.gpus)}"
        parts = []
        for gpu in sorted(self.gpus):
            holders = [h for h in self.holders.values() if gpu in h.gpus]
            if holders:
                h = min(holders, key=lambda h: h.spec.priority)
                if h.phase is Phase.STOPPING:
                    parts.append(f"GPU {gpu} being freed by {h.spec.name} (stopping)")
                else:
                    parts.append(f"GPU {gpu} held by {h.spec.name}, priority {h.spec.priority}")
            else:
                queued = [w for w in self.waiters.values() if w.spec.priority == spec.priority]
                if queued and min(queued, key=lambda w: w.seq).spec.name != spec.name:
                    parts.append(f"GPU {gpu} kept for an earlier unit of priority {spec.priority}")
        needs = f"needs {spec.gpus} GPUs; " if spec.gpus > 1 else ""
        return "waiting: " + needs + "; ".join(parts)

    def _set_reason(self, waiter: Waiter, reason: str) -> list[Action]:
        if reason == waiter.reason:
            return []
        waiter.reason = reason
        return [Log(f"{waiter.spec.name} {reason}")]

    # -- status and persistence ---------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        gpus: dict[int, list[tuple[str, int, str]]] = {g: [] for g in sorted(self.gpus)}
        for name, holder in sorted(self.holders.items()):
            for gpu in holder.gpus:
                gpus.setdefault(gpu, []).append((name, holder.spec.priority, holder.phase.value))
        waiting = [
            (w.spec.name, w.spec.priority, w.reason)
            for w in sorted(self.waiters.values(), key=lambda w: (w.spec.priority, w.seq))
        ]
        preempted = [
            (n, self._prio(n), self.specs[n].requeue if n in self.specs else False)
            for n in sorted(self.preempted, key=lambda n: (self._prio(n), self.preempted[n]))
        ]
        return Snapshot(
            gpus, waiting, preempted, sorted(self.held), sorted(self.finished), sorted(self.failed)
        )

    def save(self) -> SavedState:
        return SavedState(
            holders={
                n: (tuple(sorted(h.gpus)), h.phase.value, h.seq) for n, h in self.holders.items()
            },
            preempted=dict(self.preempted),
            held=sorted(self.held),
            finished=sorted(self.finished),
            failed=sorted(self.failed),
            seq=self._seq,
        )

    def load(self, saved: SavedState) -> None:
        """Restore what the last controller knew; the caller then reconciles with systemd.

        Holders come back with their GPUs and phase, all at once, so that no unit is placed
        on GPUs a not-yet-adopted unit still holds. The caller reports with `inactive()`
        those systemd no longer shows active, then calls `schedule()`.
        """
        self._seq = max(self._seq, saved.seq)
        for name, (gpus, phase, seq) in saved.holders.items():
            if name in self.specs:
                held_gpus = frozenset(gpus) & self.gpus
                self.holders[name] = Holder(self.specs[name], held_gpus, Phase(phase), seq)
        self.preempted = dict(saved.preempted)
        self.held = set(saved.held)
        self.finished = set(saved.finished)
        self.failed = set(saved.failed)

    def forget_boot(self) -> None:
        """A new boot: finished and failed units may run again; holds and preemptions stay."""
        self.finished.clear()
        self.failed.clear()
