"""Where a unit fits and which less urgent units must make room for it.

Kept apart from the scheduler's bookkeeping so that later capacity models (VRAM packing,
device pinning) replace only this module's answers, not the rules around them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A unit that holds GPUs and could be stopped to free them."""

    name: str
    priority: int
    gpus: frozenset[int]
    granted_seq: int


def pick_free(free: Iterable[int], count: int) -> tuple[int, ...] | None:
    """The lowest-numbered `count` free GPUs, or None when there are not enough."""
    ordered = sorted(free)
    return tuple(ordered[:count]) if len(ordered) >= count else None


def choose_victims(
    need: int, free: Iterable[int], candidates: Sequence[Candidate]
) -> list[Candidate] | None:
    """The units to stop so that `need` GPUs become available, or None if none suffice.

    Start from stopping every candidate, then reprieve them most urgent first (then those
    holding fewer GPUs, then the longest running), keeping only the ones that must go.
    This never stops a more urgent unit where less urgent ones suffice and, among equals,
    stops fewer units and loses the least recent work.
    """
    have = len(set(free))
    shortfall = need - have
    if shortfall <= 0:
        return []
    if sum(len(c.gpus) for c in candidates) < shortfall:
        return None
    victims = list(candidates)
    freed = sum(len(c.gpus) for c in victims)
    for candidate in sorted(candidates, key=lambda c: (c.priority, len(c.gpus), c.granted_seq)):
        if freed - len(candidate.gpus) >= shortfall:
            victims.remove(candidate)
            freed -= len(candidate.gpus)
    return victims


def format_gpus(gpus: Iterable[int]) -> str:
    """`GPU 0` or `GPUs 0,1`: the words used in the journal and in status."""
    ordered = sorted(gpus)
    if len(ordered) == 1:
        return f"GPU {ordered[0]}"
    return "GPUs " + ",".join(str(g) for g in ordered)
