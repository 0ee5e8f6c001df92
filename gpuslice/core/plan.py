"""What a start would do now, without doing it: `gpuslice plan UNIT`.

The scheduler is copied and the copy is told what the controller would tell it when the
unit's gate asks; what the copy answers is the plan: the same decisions, in the same words,
that the journal would show. The copy shares only what nothing changes (specs, GPUs,
decisions and flat tables, copied as tables), so a plan never moves the live state.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass
from typing import Any

from gpuslice.core.decisions import Decision, listed, reason, render
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.placement import format_gpus
from gpuslice.core.scheduler import Grant, Scheduler, Waiting

# Values a copy may share with the live scheduler: no event changes them in place.
_IMMUTABLE = (int, str, bool, frozenset, tuple, UnitSpec, Gpu, Decision, type(None))


class Verdict(enum.Enum):
    """What starting the unit now would do ("verdict" in `gpuslice plan --json`)."""

    STARTS = "starts"  # its gate would pass at once, on `gpus`
    PREEMPTS = "preempts"  # it would start on `gpus` once `victims` have given way
    WAITS = "waits"  # it would wait at its gate: `reason` says why
    HOLDS = "holds"  # it already holds GPUs (or gives them back, or comes back): `phase`
    QUEUED = "queued"  # it already waits: `reason` says why


@dataclass(frozen=True)
class Plan:
    unit: str
    priority: int
    verdict: Verdict
    gpus: tuple[int, ...] = ()
    victims: tuple[str, ...] = ()
    reason: Decision | None = None
    phase: str = ""
    # what the controller would do and say, in order (the journal's lines)
    decisions: tuple[Decision, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "priority": self.priority,
            "summary": summary(self),
            "verdict": self.verdict.value,
            "gpus": list(self.gpus),
            "victims": list(self.victims),
            "reason": reason(self.reason) if self.reason is not None else None,
            "decision": self.reason.to_json() if self.reason is not None else None,
            "phase": self.phase or None,
            "decisions": [{"message": render(d), "decision": d.to_json()} for d in self.decisions],
        }


def trial_copy(scheduler: Scheduler) -> Scheduler:
    """A copy of the scheduler to try events on. Tables whose keys and values are all
    immutable are copied as tables, at C speed; everything else is copied deeply (specs,
    GPUs and decisions return themselves: they are immutable), so no object the copy may
    change is shared, whatever fields the scheduler gains."""
    memo: dict[int, Any] = {}
    for value in vars(scheduler).values():
        if isinstance(value, dict) and _flat(value.keys()) and _flat(value.values()):
            memo[id(value)] = dict(value)
        elif isinstance(value, set) and _flat(value):
            memo[id(value)] = set(value)
    return copy.deepcopy(scheduler, memo)


def _flat(values: Any) -> bool:
    return all(isinstance(v, _IMMUTABLE) and not _holds_mutable(v) for v in values)


def _holds_mutable(value: object) -> bool:
    """A tuple or frozenset is immutable only if what it holds is."""
    if isinstance(value, (tuple, frozenset)):
        return not _flat(value)
    return False


def plan_start(scheduler: Scheduler, spec: UnitSpec) -> Plan:
    """What `systemctl start` of the unit would make gpuslice do now."""
    name = spec.name
    phase = scheduler.phase(name)
    if phase is not None:
        gpus = tuple(sorted(scheduler.grants().get(name, ())))
        return Plan(name, spec.priority, Verdict.HOLDS, gpus=gpus, phase=phase.value)
    if name in scheduler.remained:  # systemd keeps it active: `systemctl start` is a no-op
        return Plan(name, spec.priority, Verdict.HOLDS, phase="exited")
    if scheduler.is_waiting(name):
        waiting = scheduler.waiting(name)
        # who holds its GPUs now, as status says it (its journal line said it once)
        now = scheduler.snapshot().reasons.get(name, waiting.decision)
        return _of_waiter(spec, Verdict.QUEUED, waiting, now)
    trial = trial_copy(scheduler)
    actions = trial.request(spec)
    decisions = tuple(a.decision for a in actions if a.decision is not None)
    for action in actions:
        if isinstance(action, Grant) and action.unit == name:
            return Plan(name, spec.priority, Verdict.STARTS, action.gpus, decisions=decisions)
    if not trial.is_waiting(name):  # nothing else answers a request: a rule broke
        raise AssertionError(f"a trial request of {name} neither granted nor queued it")
    waiting = trial.waiting(name)
    if waiting.victims:
        return _of_waiter(spec, Verdict.PREEMPTS, waiting, None, decisions)
    return _of_waiter(spec, Verdict.WAITS, waiting, waiting.decision, decisions)


def _of_waiter(
    spec: UnitSpec,
    verdict: Verdict,
    waiting: Waiting,
    reason: Decision | None,
    decisions: tuple[Decision, ...] = (),
) -> Plan:
    """A plan for a unit that waits (or would): where it goes and whom it waits for."""
    return Plan(
        spec.name,
        spec.priority,
        verdict,
        gpus=waiting.target,
        victims=waiting.victims,
        reason=reason,
        decisions=decisions,
    )


def summary(plan: Plan) -> str:
    """The plan in one line, for people (its victims: the first LISTED_MAX, and how many
    more)."""
    who = f"{plan.unit} (priority {plan.priority})"
    why = reason(plan.reason) if plan.reason is not None else "waiting"
    if plan.verdict is Verdict.STARTS:
        return f"{who} would start now on {format_gpus(plan.gpus)}"
    if plan.verdict is Verdict.PREEMPTS:
        # one line, bounded as the journal's: a unit may preempt hundreds of small ones
        # packed on its GPUs (`victims` in the JSON names every one)
        victims = listed(plan.victims)
        return f"{who} would start on {format_gpus(plan.gpus)} once {victims} gave way"
    if plan.verdict is Verdict.WAITS:
        return f"{who} would be {why}"
    if plan.verdict is Verdict.QUEUED:
        return f"{who} is already {why}"
    where = f" on {format_gpus(plan.gpus)}" if plan.gpus else ""
    return f"{who} is already {plan.phase}{where}: a start would change nothing"
