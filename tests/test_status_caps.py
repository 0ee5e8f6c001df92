"""The status stays small whatever local users run: a waiter's part names at most LISTED_MAX
owners of foreign processes and says how many it left out (gpuslice/core/decisions.py), in
the JSON as in the table (gpuslice/status.py).

A user of the host's Slurm or Kubernetes runs CUDA processes of many owners (a job or pod
each): every waiter's `memory` part on every GPU repeated them all, and 1,500 waiters on 8
GPUs of 500 owners each made a status of 120 MiB, built on the controller's one loop, past
the 32 MiB the bus takes (service.MAX_STATUS_ANSWER: Status refused to everyone)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gpuslice.annotations import Scan
from gpuslice.core.decisions import LISTED_MAX, Blocker, Cause, Code, Decision, Part, reason
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import Scheduler
from gpuslice.inventory import GpuUse, Sample, _with_foreign
from gpuslice.owners import SLURM, Owner
from gpuslice.status import render, snapshot_to_json
from tests.test_status import snapshot

GIB = 1 << 30
MIB = 1 << 20
GPUS, OWNERS, WAITERS = 8, 500, 1500


def _busy_host(owners: int) -> tuple[list[Gpu], list[GpuUse]]:
    """8 GPUs of 80 GiB, each used by `owners` foreign processes of 150 MiB, each process its
    own Slurm job: the GPUs as the inventory makes them (`foreign_owners` sorted, once each)."""
    uses = [
        GpuUse(10_000 + n, g, 150 * MIB, None, "python3", Owner(SLURM, str(100_000 + n)))
        for g in range(GPUS)
        for n in range(g * owners, (g + 1) * owners)
    ]
    on = [[u for u in uses if u.gpu == g] for g in range(GPUS)]
    gpus = [Gpu(g, f"GPU-{g}", "Fake 80GB", 80 * GIB) for g in range(GPUS)]
    return [_with_foreign(gpu, on[gpu.index], {}) for gpu in gpus], uses


def _status_of_many_waiters(owners: int = OWNERS) -> dict[str, Any]:
    """1,500 waiters for 79.5 GiB each, kept off every GPU by the foreign processes: the
    first one's reason is the scheduler's own; the others wait for the same reason (the
    scheduler takes seconds to queue 1,500; the status is built the same)."""
    gpus, uses = _busy_host(owners)
    scheduler = Scheduler(gpus, {})
    scheduler.request(UnitSpec("w0000.service", 10, memory=int(79.5 * GIB)))
    first = scheduler.snapshot().reasons["w0000.service"]
    assert [p.kind for p in first.parts] == [Blocker.MEMORY] * GPUS
    names = [f"w{i:04d}.service" for i in range(WAITERS)]
    reasons = {name: dataclasses.replace(first, unit=name) for name in names}
    snap = snapshot(
        gpus={g.index: [] for g in gpus},
        waiting=[(name, 10, reason(reasons[name])) for name in names],
        reasons=reasons,
    )
    return snapshot_to_json(snap, Scan(), Sample(gpus, uses))


def test_the_status_of_many_waiters_beside_many_owners_stays_small() -> None:
    """1,500 waiters, 4,000 foreign processes of 4,000 owners: 8.1 MiB (120.4 MiB before the
    cap; 7.6 MiB with 9 owners on each GPU), the table 3.2 MiB."""
    data = _status_of_many_waiters()
    size = len(json.dumps(data, sort_keys=True))
    assert size < 10 * MIB, f"{size / MIB:.1f} MiB"
    table = render(data)
    assert len(table) < 10 * MIB, f"{len(table) / MIB:.1f} MiB"


def test_the_waiters_do_not_grow_with_the_owners_past_those_named() -> None:
    """From LISTED_MAX + 1 owners on each GPU to 500, only each GPU's `foreign` list grows
    (once per GPU, not per waiter); each waiter's parts and reason change only in digits:
    how many owners are left out, how many bytes are used."""
    few, many = _status_of_many_waiters(LISTED_MAX + 1), _status_of_many_waiters()
    grown = len(json.dumps(many["waiting"])) - len(json.dumps(few["waiting"]))
    # "and 1 more" to "and 492 more", "owners_left_out": 1 to 492, and the digits of the
    # bytes the foreign processes use and leave free (1.3 GiB to 73.2 GiB)
    assert 0 < grown < WAITERS * GPUS * 16, grown


def test_a_part_names_the_first_owners_and_how_many_it_left_out() -> None:
    """The JSON names the same first LISTED_MAX owners (sorted) as the reason does, and how
    many more there are; the table says "and N more"."""
    data = _status_of_many_waiters()
    waiting = data["waiting"]
    part = waiting[0]["decision"]["parts"][1]
    firsts = [f"Slurm job {n}" for n in range(100_500, 100_500 + LISTED_MAX)]
    assert (part["gpus"], part["owners"], part["owners_left_out"]) == (
        [1],
        firsts,
        OWNERS - LISTED_MAX,
    )
    assert part["others"] == OWNERS * 150 * MIB
    said = f"({', '.join(firsts)} and {OWNERS - LISTED_MAX} more)"
    assert said in waiting[0]["reason"]
    lines = render(data).splitlines()
    first = next(line for line in lines if line.startswith("  1. w0000.service (priority 10): "))
    assert said in first


def _memory_part(owners: tuple[str, ...]) -> dict[str, Any]:
    part = Part(Blocker.MEMORY, (0,), free=GIB, others=20 * GIB, owners=owners)
    decision = Decision(Code.WAIT, "w.service", 20, cause=Cause.BUSY, parts=(part,))
    shown: dict[str, Any] = decision.to_json()["parts"][0]
    return shown


def test_a_part_of_few_owners_names_them_all() -> None:
    """Up to LISTED_MAX owners: all named, none left out; none at all: [] and 0, as a part of
    any other kind says it."""
    eight = tuple(f"UID {n}" for n in range(1000, 1000 + LISTED_MAX))
    assert (_memory_part(eight)["owners"], _memory_part(eight)["owners_left_out"]) == (
        list(eight),
        0,
    )
    nine = (*eight, "UID 2000")
    assert (_memory_part(nine)["owners"], _memory_part(nine)["owners_left_out"]) == (
        list(eight),
        1,
    )
    held = Part(Blocker.HELD, (0,), "a.service", 5).to_json()
    assert (held["owners"], held["owners_left_out"]) == ([], 0)
