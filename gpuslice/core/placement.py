"""Where a unit fits, and which less urgent units must make room for it.

Kept apart from the scheduler's bookkeeping: the scheduler says who holds what, this module
answers "does it fit" and "who would have to go", GPU by GPU. A GPU of unknown size (no
NVML) holds one unit; a GPU of known size holds units whose declared memory fits in
total - reserve - foreign use - what holders use beyond their `Memory=` (`Gpu.overuse`); a
unit without `Memory=` takes its GPU exclusively.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuslice.core.model import Gpu, UnitSpec


@dataclass(frozen=True)
class Use:
    """One unit's claim on one GPU: a holder, or a promise made during a scheduling pass.

    `stoppable` marks a holder that may be preempted (running or starting, not stopping);
    `seq` orders holders by when they started, `granted` is when this controller answered its
    gate (0: it did not, or not yet: a place kept is moved back to waiting, never stopped). A
    claim with `kept_from` set binds only units whose priority number is at least that: a
    blocked waiter keeps capacity from units that could not preempt it later.
    """

    unit: str
    priority: int
    memory: int | None
    stoppable: bool = False
    seq: int = 0
    kept_from: int | None = None
    granted: int = 0


@dataclass(frozen=True)
class Placement:
    gpus: tuple[int, ...]
    victims: tuple[str, ...]


def applies(use: Use, priority: int) -> bool:
    return use.kept_from is None or priority >= use.kept_from


def free_memory(gpu: Gpu, uses: Iterable[Use]) -> int | None:
    """Declared memory still free on a GPU of known size; None when its size is unknown.
    What a use's unit takes beyond its `Memory=` there counts too (`overuse`)."""
    if gpu.total is None:
        return None
    uses = list(uses)
    declared = sum(u.memory or 0 for u in uses)
    return gpu.total - gpu.reserve - gpu.foreign - declared - overuse(gpu, uses)


def overuse(gpu: Gpu, uses: Iterable[Use]) -> int:
    """What the units of `uses` take on the GPU beyond their `Memory=` (NVML's word): it
    goes with its unit, so stopping an overusing victim frees all it uses."""
    beyond = dict(gpu.overuse)
    return sum(beyond.get(name, 0) for name in {u.unit for u in uses})


def allowed(spec: UnitSpec, gpu: Gpu, avoid_foreign: bool) -> bool:
    """Whether the unit may ever run on this GPU (pinning, lost GPUs, foreign processes)."""
    if gpu.lost:
        return False
    if spec.devices and not any(gpu.matches(d) for d in spec.devices):
        return False
    return not (avoid_foreign and gpu.foreign_pids)


def fits(spec: UnitSpec, gpu: Gpu, uses: Sequence[Use]) -> bool:
    """Whether the unit fits next to these uses (the caller has checked `allowed`)."""
    if any(u.memory is None for u in uses):
        return False
    if spec.memory is None or gpu.total is None:
        return not uses
    free = free_memory(gpu, uses)
    # a unit on this GPU already (its place checked again) needs what it really uses
    return free is not None and free >= spec.memory + dict(gpu.overuse).get(spec.name, 0)


def may_preempt(use: Use, priority: int, known_since: int | None) -> bool:
    """Whether a unit of this priority, whose request is known since `known_since`, may take
    this use's place. Equal priority never preempts. The thrash rule: a unit granted its GPU
    after the request was known is not stopped for it; it was granted knowing of it (a place
    kept but not yet answered, `granted` 0, may always be taken)."""
    if not use.stoppable or use.priority <= priority:
        return False
    return known_since is None or use.granted < known_since


def victims_on(
    spec: UnitSpec, gpu: Gpu, uses: Sequence[Use], known_since: int | None = None
) -> list[Use] | None:
    """The fewest, least urgent stoppable uses whose removal makes the unit fit; None if no
    such set exists. Stop every strictly less urgent candidate, then reprieve them most
    urgent first, then the smallest (so that the fewest are stopped), then the longest
    running, while the unit still fits."""
    candidates = [u for u in uses if may_preempt(u, spec.priority, known_since)]
    staying = [u for u in uses if u not in candidates]
    if not fits(spec, gpu, staying):
        return None
    victims = list(candidates)
    for candidate in sorted(candidates, key=lambda u: (u.priority, u.memory or 0, u.seq)):
        trial = [v for v in victims if v is not candidate]
        if fits(spec, gpu, staying + [u for u in candidates if u not in trial]):
            victims = trial
    return victims


def _cost(
    spec: UnitSpec, gpu: Gpu, uses: Sequence[Use], victims: Sequence[Use], shun_foreign: bool
) -> _Cost:
    """The least urgent victims (and among equals the fewest), then the least slack: the
    least memory freed beyond need, or with no victims the tightest fit (large holes stay
    for large units); for a whole-GPU unit, the least memory foreign processes use (the
    GPU is to be its own: it got the lower index, beside a cluster job's 20 GiB, and ran out
    of memory there while another GPU was idle); then the most recently started victims."""
    if spec.memory is None:
        shunned = gpu.foreign if shun_foreign else 0
        return (_urgency(victims), len(victims), shunned, _recency(victims))
    free = free_memory(gpu, [u for u in uses if u not in victims])
    slack = free - spec.memory if free is not None else 0
    return (_urgency(victims), len(victims), slack, _recency(victims))


def _recency(victims: Iterable[Use]) -> tuple[int, ...]:
    """Among otherwise equal victim sets, stop the most recently started: least work lost."""
    return tuple(sorted(-v.seq for v in victims))


def _urgency(victims: Iterable[Use]) -> tuple[int, ...]:
    """Compares victim sets: the one whose most urgent member is least urgent is smaller,
    and among equals the shorter one (fewer units stopped) is."""
    return tuple(sorted(-v.priority for v in victims))


def place(
    spec: UnitSpec,
    gpus: Mapping[int, Gpu],
    uses: Mapping[int, Sequence[Use]],
    *,
    preempt: bool,
    avoid_foreign: bool = False,
    known_since: int | None = None,
    shun_foreign: bool = True,
) -> Placement | None:
    """The best GPUs for the unit: with `preempt`, victims may be named (see `may_preempt`
    for `known_since`); else only free capacity counts. None when it cannot be placed.
    `shun_foreign`: a whole-GPU unit is given the GPUs foreign processes use least (see
    `_cost`); without it, the lowest indices (a guess for a unit found running)."""
    options: list[_Option] = []
    for index, gpu in sorted(gpus.items()):
        if not allowed(spec, gpu, avoid_foreign):
            continue
        here = [u for u in uses.get(index, ()) if applies(u, spec.priority)]
        if fits(spec, gpu, here):
            options.append((_cost(spec, gpu, here, [], shun_foreign), index, []))
        elif preempt:
            victims = victims_on(spec, gpu, here, known_since)
            if victims is not None:
                options.append((_cost(spec, gpu, here, victims, shun_foreign), index, victims))
    if len(options) < spec.gpus:
        return None
    options.sort(key=lambda o: (o[0], o[1]))
    chosen = options[: spec.gpus]
    if spec.gpus > 1 and math.comb(len(options), spec.gpus) <= _MAX_COMBINATIONS:
        # a victim holding several GPUs frees them all: judge GPU sets, not single GPUs
        combos = itertools.combinations(options, spec.gpus)
        chosen = list(min(combos, key=_set_cost))
    by_gpu = sorted(chosen, key=lambda o: o[1])
    names = list(dict.fromkeys(v.unit for _, _, victims in by_gpu for v in victims))
    return Placement(tuple(o[1] for o in by_gpu), tuple(names))


_MAX_COMBINATIONS = 5000
_Cost = tuple[tuple[int, ...], int, int, tuple[int, ...]]
_Option = tuple[_Cost, int, list[Use]]


def _set_cost(
    options: Iterable[_Option],
) -> tuple[tuple[int, ...], int, tuple[int, ...], tuple[int, ...]]:
    combo = list(options)
    victims = {v.unit: v for _, _, vs in combo for v in vs}
    chosen = victims.values()
    slack = sum(o[0][2] for o in combo)
    return (_urgency(chosen), slack, _recency(chosen), tuple(o[1] for o in combo))


def format_gpus(gpus: Iterable[int]) -> str:
    """`GPU 0` or `GPUs 0,1`: the words used in the journal and in status."""
    ordered = sorted(gpus)
    if not ordered:
        return "no GPU"
    if len(ordered) == 1:
        return f"GPU {ordered[0]}"
    return "GPUs " + ",".join(str(g) for g in ordered)
