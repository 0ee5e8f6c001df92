"""`make bench` case "a day on one GPU": a realistic mix replayed, compressed in time.

    python -m bench.day        # this case alone (QUICK params), prints its tables

The day (DAY_S seconds of wall time; arrivals seeded by DAY_SEED, the same every run):

- embeddings: background, Priority=80: a 1 s model load, then 50 ms items;
- VLM batch: background, Priority=90: a 2 s model load, then 100 ms items, more than a day holds;
- transcriptions: on-demand, Priority=10, `bench-day-transcribe@N.service`, arriving at random
  (exponential gaps): a 0.3 s load, then 5-12 items of 100 ms;
- nightly: on-demand, Priority=50, requested once (at 45 % of the day): a 1 s load, 50 items.

Every job is the same worker (bench/day_probe.py `work`): it persists its progress after each
item, so a stopped job loads again and redoes only the item it was in. The day begins (t0) when
the driver enrols the background jobs (writes their units, daemon-reload) and ends DAY_S later,
when it stops every unit; quick and full runs play the same day (Params sets only timeouts).
Policies, each in its own container, every policy's day at the same time:

- "systemd alone (Conflicts=)": what an admin gets without gpuslice. The background jobs are
  Type=oneshot, VLM `After=` embeddings (one GPU: one after the other), started by the driver at
  t0; every on-demand unit has `Conflicts=` and `After=` both. Nothing brings a stopped
  background job back (no refill), and two on-demand jobs share the GPU.
- "gpuslice (stop)": the same jobs annotated, `gpus: 1`; gpuslice starts the background jobs,
  preempts (stops) them for on-demand ones and brings them back.
- "gpuslice (suspend)": the same, every job also `Preempt=suspend stop`: a preempted job is
  suspended (cuda-checkpoint moves its VRAM to host memory, systemd freezes it) and later
  thawed and restored, the same process carrying on. That needs what a real GPU host has, here
  simulated (tests/bed/fakegpu): NVML showing each job's VRAM (every job holds VRAM_PER_JOB
  through a gpu-alloc child), cuda-checkpoint (the fake) configured, and a container on pure
  cgroup v2 (systemd's freezer).

A later preemption mode is one more entry in POLICIES (its config lines, its Preempt= and its
oracle).

Metrics (`analyse`, pure, from the logs): on-demand wait = the unit's main process start minus
its request (p50, p99 by nearest rank: the maximum below 100 requests); GPU busy = the time in
which some job's *completed* item was being worked on (model loads and items lost to a stop do
not count), as a share of the day; items redone (an item begun more than once), items
interrupted (begun, then stopped before the end of the day), model loads, preemptions
(gpuslice: its journal's GPUSLICE_DECISION=preempt, suspend and freeze, less rung-failed; else
stops before the end of the day), pauses (the jobs' own `pause` lines: a frozen worker sees
the gap in its clock when it runs again, bench/day_probe.py), and seconds in which two or more
jobs ran at once (sharing a GPU that holds one; a paused job is not running).

The oracle (`simulate`) is the same day on one GPU under strict priority (on-demand FIFO by
arrival) with zero scheduling overhead: a preemption is instant and the next job starts at
once. Mode "stop" pays what gpuslice's stop pays (a load on every start, the item in hand
lost); mode "suspend" is free preemption (the job pauses and resumes where it was): the bound
for any cheaper-than-stop mode. Its logs go through the same `analyse`.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.run import (
    CONTROLLER,
    QUICK,
    RESULTS_DIR,
    UNIT_DIR,
    Params,
    Row,
    decisions,
    prepare,
    table,
)
from tests.bed import fakegpu
from tests.bed.container import BedError, Container, ensure_tree

DAY_S = 60.0
DAY_SEED = 7
WORKDIR = "/var/lib/bench-day"
DRIVER = "/src/bench/day_probe.py"
EMBED = "bench-day-embed.service"
VLM = "bench-day-vlm.service"
NIGHTLY = "bench-day-nightly.service"
TRANSCRIBE = "bench-day-transcribe@.service"
BACKGROUND = (EMBED, VLM)
EPS = 1e-9
VRAM_PER_JOB = "2G"  # what each job holds where a policy suspends (whole-GPU units all the same)


# ------------------------------------------------------------------------------- the day


@dataclass(frozen=True)
class Job:
    """One job of the day: when it is asked for (background: at t0) and what it costs."""

    unit: str
    priority: int
    kind: str  # "background" or "on-demand"
    load_s: float
    item_s: float
    items: int
    at_s: float = 0.0


@dataclass(frozen=True)
class Day:
    window_s: float
    jobs: tuple[Job, ...]

    @property
    def on_demand(self) -> list[Job]:
        return sorted((j for j in self.jobs if j.kind == "on-demand"), key=lambda j: j.at_s)

    @property
    def background(self) -> list[Job]:
        return [j for j in self.jobs if j.kind == "background"]

    def job(self, unit: str) -> Job | None:
        return next((j for j in self.jobs if j.unit == unit), None)


def day_plan(seed: int = DAY_SEED, window_s: float = DAY_S) -> Day:
    """The day's jobs; transcriptions arrive from 3 s on, exponential gaps of 5 s on average,
    none in the last 10 s (so that each can be served before the day ends)."""
    rng = random.Random(seed)
    jobs = [
        Job(EMBED, 80, "background", 1.0, 0.05, 160),
        Job(VLM, 90, "background", 2.0, 0.1, 100_000),
        Job(NIGHTLY, 50, "on-demand", 1.0, 0.1, 50, at_s=round(0.45 * window_s, 3)),
    ]
    t, i = 3.0, 0
    while t <= window_s - 10:
        unit = TRANSCRIBE.replace("@.", f"@{i}.")
        jobs.append(Job(unit, 10, "on-demand", 0.3, 0.1, rng.randint(5, 12), at_s=round(t, 3)))
        t += rng.expovariate(1 / 5.0)
        i += 1
    return Day(window_s, tuple(jobs))


# ------------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class Policy:
    """One column: how the GPU is shared. `config` is gpuslice's config.yaml (None: no
    gpuslice, Conflicts= instead); `oracle` names the `simulate` mode it is judged against;
    `preempt` is every job's Preempt= (None: gpuslice's default, stop)."""

    key: str
    title: str
    config: str | None
    oracle: str = "stop"
    preempt: str | None = None

    @property
    def suspends(self) -> bool:
        """Its jobs may be suspended: they hold simulated VRAM (fake NVML, gpu-alloc and
        cuda-checkpoint) in a container on pure cgroup v2, where systemd can freeze units."""
        return self.preempt is not None and "suspend" in self.preempt.split()


SUSPEND_CONFIG = (
    "gpus: 1\nlog_level: info\n"
    f"cuda_checkpoint: {fakegpu.CHECKPOINT}\n"
    "suspend_host_memory_margin: 0\n"  # the bed's host memory is what it is
)
POLICIES: list[Policy] = [
    Policy("systemd", "systemd alone (Conflicts=)", None),
    Policy("gpuslice-stop", "gpuslice (stop)", "gpus: 1\nlog_level: info\n"),
    Policy(
        "gpuslice-suspend",
        "gpuslice (suspend)",
        SUSPEND_CONFIG,
        oracle="suspend",
        preempt="suspend stop",
    ),
]
GPUSLICE, FLOOR = "gpuslice-stop", "systemd"  # the policies bench.run's rows compare
SUSPEND = "gpuslice-suspend"  # in the rows' notes
ORACLES: dict[str, str] = {
    "stop": "oracle (stop, no overhead)",
    "suspend": "oracle (free preemption)",
}

EXEC = (
    f'ExecStart=/bin/bash -c \'echo "start $$EPOCHREALTIME" >> {WORKDIR}/%n.log; '
    f"exec python3 {DRIVER} work %n'\n"
)


def unit_text(job: Job, gated: bool, preempt: str | None = None) -> str:
    """The job's unit: annotated for gpuslice (with `Preempt=PREEMPT` where given: its worker
    then holds simulated VRAM), else systemd's own ordering and conflicts."""
    name = job.unit if "@" not in job.unit else TRANSCRIBE
    head = f"[Unit]\nDescription=gpuslice bench day: {name}\nStartLimitIntervalSec=0\n"
    service = "\n[Service]\n" + EXEC
    if gated:
        annotation = f"\n[X-GPUSlice]\nPriority={job.priority}\nType={job.kind}\n"
        if preempt is not None:
            service += (
                f"Environment=FAKE_NVML_DIR={fakegpu.STATE} BENCH_DAY_ALLOC={fakegpu.ALLOC} "
                f"BENCH_DAY_VRAM={VRAM_PER_JOB}\n"
            )
            annotation += f"Preempt={preempt}\n"
        return head + service + annotation
    if job.kind == "on-demand":
        deps = " ".join(BACKGROUND)
        head += f"Conflicts={deps}\nAfter={deps}\n"
    else:
        service += "Type=oneshot\nTimeoutStartSec=infinity\n"
        if job.unit == VLM:
            head += f"After={EMBED}\n"
    return head + service


def unit_files(
    day: Day, gated: bool, preempt: str | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """(on-demand units written before the day, background units the driver writes at t0)."""
    on_demand: dict[str, str] = {}
    for job in day.on_demand:
        on_demand[TRANSCRIBE if "@" in job.unit else job.unit] = unit_text(job, gated, preempt)
    background = {f"{UNIT_DIR}/{j.unit}": unit_text(j, gated, preempt) for j in day.background}
    return on_demand, background


def worker_plan(day: Day) -> dict[str, dict[str, float]]:
    """What each unit's worker reads from plan.json."""
    return {j.unit: {"load_s": j.load_s, "item_s": j.item_s, "items": j.items} for j in day.jobs}


# ------------------------------------------------------------------------------- analysis


@dataclass
class Replay:
    """A day as it happened (or as the oracle has it): stamps and every unit's log."""

    t0: float
    t_end: float
    requests: dict[str, float]
    logs: dict[str, str]
    preemptions: int | None = None  # from the controller's journal (or the oracle)


def parse_log(text: str) -> list[tuple[str, float, int | None]]:
    """`KIND STAMP [ITEM]` lines; a line a kill cut short is skipped."""
    out: list[tuple[str, float, int | None]] = []
    for line in text.splitlines():
        parts = line.split()
        try:
            item = int(parts[2]) if len(parts) > 2 else None
            out.append((parts[0], float(parts[1]), item))
        except (IndexError, ValueError):
            continue
    return out


def union_s(spans: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds covered by at least one span, within [lo, hi]."""
    total, reach = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            total += b - a
            reach = b
    return total


def shared_s(spans_by_unit: dict[str, list[tuple[float, float]]], lo: float, hi: float) -> float:
    """Seconds in which spans of two or more units overlap, within [lo, hi]."""
    edges: list[tuple[float, int]] = []
    for spans in spans_by_unit.values():
        for a, b in spans:
            a, b = max(a, lo), min(b, hi)
            if b > a:
                edges += [(a, 1), (b, -1)]
    total, level, last = 0.0, 0, lo
    for t, d in sorted(edges):
        if level >= 2:
            total += t - last
        level += d
        last = t
    return total


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest rank: a value that occurred; None without samples."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


@dataclass
class _UnitWalk:
    """One unit's log, walked: its completed items' work, its runs, what a stop cost it."""

    work: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    active: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    starts: list[float] = dataclasses.field(default_factory=list)
    loads: int = 0
    stops: int = 0
    pauses: int = 0
    interrupted: int = 0
    redone: int = 0
    done_items: int = 0


def walk(events: list[tuple[str, float, int | None]], t_end: float) -> _UnitWalk:
    """Runs begin at `start` (or `resume`) and end at `stop`, `pause`, `done` or the next
    start (a run that said nothing after its `start` ends there: it held nothing); an item
    in hand at a stop before `t_end` is interrupted (at t_end: the day's end)."""
    w = _UnitWalk()
    begun: Counter[int] = Counter()
    since: float | None = None  # the current run (or resumed stretch) began
    item: int | None = None
    pieces: list[tuple[float, float]] = []  # the item in hand, up to its last pause
    piece_from: float | None = None
    last: float | None = None

    def close(t: float, cut: bool) -> None:
        nonlocal since, item, piece_from, pieces
        if since is not None:
            w.active.append((since, t))
        if item is not None and cut:
            w.interrupted += 1
        since, piece_from = None, None
        if cut:
            item, pieces = None, []

    spoke = False  # the current run said something after its start
    for kind, t, n in events:
        last = t
        if kind == "start":
            if since is not None:  # the previous run died without a word
                # nothing said after its start: killed before the worker took SIGTERM, so
                # before it held anything on the GPU (day_probe: the handler, then VRAM)
                close(t if spoke else since, cut=True)
            since, spoke = t, False
            w.starts.append(t)
            item, pieces = None, []
            continue
        spoke = True
        if kind == "load":
            w.loads += 1
        elif kind == "begin" and n is not None:
            begun[n] += 1
            item, pieces, piece_from = n, [], t
        elif kind == "end" and item is not None and piece_from is not None:
            w.work += [*pieces, (piece_from, t)]
            w.done_items += 1
            item, pieces, piece_from = None, [], None
        elif kind == "pause":
            if item is not None and piece_from is not None:
                pieces.append((piece_from, t))
            w.stops += t < t_end
            w.pauses += t < t_end
            close(t, cut=False)
        elif kind == "resume":
            since = t
            if item is not None:
                piece_from = t
        elif kind == "stop":
            w.stops += t < t_end
            close(t, cut=t < t_end)
        elif kind == "done":
            close(t, cut=False)
    if since is not None and last is not None:
        close(last, cut=False)
    w.redone = sum(c - 1 for c in begun.values())
    return w


def analyse(day: Day, r: Replay) -> dict[str, Any]:
    """A day's figures from its logs and stamps: the policy-independent part of the case."""
    walks = {unit: walk(parse_log(text), r.t_end) for unit, text in r.logs.items()}
    waits: dict[str, float] = {}
    for unit, asked in r.requests.items():
        starts = walks[unit].starts if unit in walks else []
        later = [s for s in starts if asked <= s <= r.t_end]
        if later:
            waits[unit] = min(later) - asked
    window = r.t_end - r.t0
    busy = union_s((s for w in walks.values() for s in w.work), r.t0, r.t_end)
    bg = {j.unit for j in day.background}
    bg_work = sum(union_s(w.work, r.t0, r.t_end) for u, w in walks.items() if u in bg)
    p50, p99 = percentile(list(waits.values()), 0.5), percentile(list(waits.values()), 0.99)
    log_stops = sum(w.stops for w in walks.values())
    return {
        "window_s": window,
        "od_requests": len(r.requests),
        "od_served": len(waits),
        "unserved": sorted(set(r.requests) - set(waits)),
        "wait_p50_ms": None if p50 is None else p50 * 1000,
        "wait_p99_ms": None if p99 is None else p99 * 1000,
        "waits_ms": {u: w * 1000 for u, w in waits.items()},
        "busy_pct": 100 * busy / window if window > 0 else 0.0,
        "bg_work_s": bg_work,
        "loads": sum(w.loads for w in walks.values()),
        "preemptions": r.preemptions if r.preemptions is not None else log_stops,
        "stops_in_logs": log_stops,
        "pauses": sum(w.pauses for w in walks.values()),
        "items_redone": sum(w.redone for w in walks.values()),
        "items_interrupted": sum(w.interrupted for w in walks.values()),
        "shared_s": shared_s({u: w.active for u, w in walks.items()}, r.t0, r.t_end),
    }


# ------------------------------------------------------------------------------- the oracle


@dataclass
class _SimJob:
    job: Job
    order: int
    log: list[str] = dataclasses.field(default_factory=list)
    done: int = 0
    load_left: float = 0.0
    item_left: float | None = None  # the item in hand: seconds still to go
    started: bool = False  # a run is under way (suspend: maybe paused)
    finished: bool = False

    def say(self, kind: str, t: float, n: int | None = None) -> None:
        self.log.append(f"{kind} {t:.6f}" + ("" if n is None else f" {n}"))


def simulate(day: Day, mode: str = "stop") -> Replay:
    """The day on one GPU under strict priority (lower Priority= first; equal: earlier
    request, then the day's order), zero overhead. "stop": a preempted job ends; its next run
    loads again and its item in hand is lost. "suspend": it pauses and resumes where it was."""
    if mode not in ("stop", "suspend"):
        raise ValueError(f"unknown oracle mode {mode!r}")
    jobs = [_SimJob(j, i) for i, j in enumerate(day.jobs)]
    arrivals = sorted({j.at_s for j in day.jobs})
    t, end = 0.0, day.window_s
    current: _SimJob | None = None
    preemptions = 0
    while t < end - EPS:
        ready = [s for s in jobs if s.job.at_s <= t + EPS and not s.finished]
        best = min(ready, key=lambda s: (s.job.priority, s.job.at_s, s.order), default=None)
        if best is not current:
            if current is not None:
                preemptions += 1
                if mode == "stop":
                    current.say("stop", t)
                    current.started, current.item_left = False, None
                else:
                    current.say("pause", t)
            current = best
            if current is not None:
                if current.started:
                    current.say("resume", t)
                else:
                    current.started = True
                    current.say("start", t)
                    current.say("load", t)
                    current.load_left = current.job.load_s
        i = bisect.bisect_right(arrivals, t + EPS)
        next_arrival = arrivals[i] if i < len(arrivals) else math.inf
        if current is None:
            t = min(next_arrival, end)
            continue
        if current.load_left <= EPS and current.item_left is None:
            current.say("begin", t, current.done)
            current.item_left = current.job.item_s
        loading = current.load_left > EPS
        left = current.load_left if loading else (current.item_left or 0.0)
        step = min(t + left, next_arrival, end)
        spent = step - t
        t = step
        if loading:
            current.load_left -= spent
            if current.load_left <= EPS:
                current.load_left = 0.0
                current.say("ready", t)
            continue
        current.item_left = (current.item_left or 0.0) - spent
        if current.item_left <= EPS:
            current.say("end", t, current.done)
            current.done += 1
            current.item_left = None
            if current.done >= current.job.items:
                current.say("done", t)
                current.finished, current.started = True, False
                current = None
    for s in jobs:
        if s.started:
            s.say("stop", end)
    requests = {j.unit: j.at_s for j in day.on_demand}
    logs = {s.job.unit: "\n".join(s.log) + "\n" for s in jobs if s.log}
    return Replay(0.0, end, requests, logs, preemptions)


# ------------------------------------------------------------------------------- output

# (key, label, unit): the per-policy table's rows
METRICS: list[tuple[str, str, str]] = [
    ("od_requests", "on-demand requests", "count"),
    ("od_served", "on-demand served in the day", "count"),
    ("wait_p50_ms", "on-demand wait p50", "ms"),
    ("wait_p99_ms", "on-demand wait p99", "ms"),
    ("busy_pct", "GPU busy (completed work)", "%"),
    ("busy_vs_oracle", "busy / its oracle's", "x"),
    ("bg_work_s", "background work done", "s"),
    ("items_redone", "work items redone", "count"),
    ("items_interrupted", "work items interrupted", "count"),
    ("loads", "model loads", "count"),
    ("preemptions", "preemptions", "count"),
    ("pauses", "runs paused (frozen), from the jobs", "count"),
    ("shared_s", "2+ jobs on the GPU at once", "s"),
]


def _cell(v: Any, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "count":
        return f"{v:.0f}"
    if unit == "x":
        return f"{v:.2f}x"
    digits = 0 if unit == "ms" and v >= 100 else 1
    return f"{v:.{digits}f} {unit}"


def day_table(results: dict[str, dict[str, Any]]) -> str:
    """Metrics down, one column per policy (and oracle), in the order of `results`."""
    cols = list(results)
    head = ["metric", *cols]
    body = [
        [label, *(_cell(results[c].get(key), unit) for c in cols)] for key, label, unit in METRICS
    ]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(row: list[str]) -> str:
        first = row[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        return " | ".join([first, *rest])

    lines = [line(head), "-+-".join("-" * w for w in widths), *map(line, body)]
    return "\n".join(lines)


def with_oracles(
    day: Day, measured: dict[str, dict[str, Any]], policies: list[Policy]
) -> dict[str, dict[str, Any]]:
    """The measured columns, then one per oracle mode; each column's busy against its oracle."""
    oracles = {mode: analyse(day, simulate(day, mode)) for mode in ORACLES}
    out: dict[str, dict[str, Any]] = {}
    for p in policies:
        if p.title in measured:
            m = dict(measured[p.title])
            base = oracles[p.oracle]["busy_pct"]
            m["busy_vs_oracle"] = m["busy_pct"] / base if base else None
            out[p.title] = m
    for mode, title in ORACLES.items():
        out[title] = {**oracles[mode], "busy_vs_oracle": 1.0}
    return out


def rows_of(results: dict[str, dict[str, Any]]) -> list[Row]:
    """One bench row per metric: gpuslice (stop) in the gpuslice column, systemd alone as
    the floor, the oracle (and gpuslice (suspend), where measured) in the note; the whole
    per-policy table in the first row's extra."""
    titles = {p.key: p.title for p in POLICIES}
    gs, floor = results[titles[GPUSLICE]], results[titles[FLOOR]]
    oracle = results[ORACLES["stop"]]
    free = results[ORACLES["suspend"]]
    suspend = results.get(titles[SUSPEND])
    rows: list[Row] = []
    for key, label, unit in METRICS:
        if key in ("od_requests", "busy_vs_oracle", "pauses"):
            continue
        note = f"oracle {_cell(oracle.get(key), unit)}"
        if key == "busy_pct":
            note += f" (free preemption {_cell(free.get(key), unit)})"
        if suspend is not None:
            note += f"; suspend {_cell(suspend.get(key), unit)}"
        rows.append(
            Row(
                f"day: {label}",
                "%" if unit == "%" else unit,
                _num(gs.get(key)),
                _num(floor.get(key)),
                "(info)",
                None,
                note=note,
            )
        )
    rows[0].extra["policies"] = results
    return rows


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


# ------------------------------------------------------------------------------- the case


def _run_day(c: Container, day: Day, policy: Policy, timeout: float) -> dict[str, Any]:
    gated = policy.config is not None
    _, background = unit_files(day, gated, policy.preempt)
    spec = {
        "window_s": day.window_s,
        "background_files": background,
        "start_background": [] if gated else [j.unit for j in day.background],
        "arrivals": [[j.at_s, j.unit] for j in day.on_demand],
        "units": [j.unit for j in day.jobs],
    }
    result = c.run(["python3", DRIVER, "drive"], input=json.dumps(spec), timeout=timeout)
    out: dict[str, Any] = json.loads(result.stdout)
    if gated:
        journal = c.journal(CONTROLLER, "-o", "json")
        said = [d for d in decisions(journal, out["t0"]) if d[0] <= out["t_end"]]
        out["decisions"] = dict(Counter(code for _, code, _, _ in said))
    return out


def preemptions(decided: dict[str, int]) -> int:
    """Preemptions from the controller's decision counts: every way of giving way decided
    (stop, suspend, freeze), less the rungs that failed (each then tried the next way)."""
    ways = sum(decided.get(code, 0) for code in ("preempt", "suspend", "freeze"))
    return ways - decided.get("rung-failed", 0)


def _prepare(c: Container, day: Day, policy: Policy) -> None:
    """The on-demand units and the workers' plan; gpuslice (`gpus: 1`) where the policy has
    it, restarted on the policy's own config where that differs from bench.run's, and on one
    simulated 24 GiB GPU where it suspends (tests/bed/fakegpu, its cuda-checkpoint too)."""
    gated = policy.config is not None
    on_demand, _ = unit_files(day, gated, policy.preempt)
    c.write_file(f"{WORKDIR}/plan.json", json.dumps(worker_plan(day)))
    prepare(c, on_demand, gpus=1 if gated else None)
    config = "/etc/gpuslice/config.yaml"
    if policy.config is not None and policy.suspends:
        fakegpu.install(c, 1, config=policy.config)
    elif policy.config is not None and c.run(["cat", config]).stdout != policy.config:
        c.write_file(config, policy.config)
        c.systemctl("restart", CONTROLLER)


def case_day(tree: Path, p: Params, log: Callable[[str], None]) -> tuple[list[Row], dict[str, Any]]:
    """Every policy's day in its own container, all at the same time (the same load on
    each), then the oracles; rows for bench.run's table and the per-policy table in raw."""
    day = day_plan()
    timeout = day.window_s + p.timeout_s + 60
    n_od = len(day.on_demand)
    raw: dict[str, Any] = {"seed": DAY_SEED, "window_s": day.window_s, "plan": worker_plan(day)}
    raw["arrivals"] = {j.unit: j.at_s for j in day.on_demand}
    n = len(POLICIES)
    with contextlib.ExitStack() as stack, concurrent.futures.ThreadPoolExecutor(n) as pool:
        containers = [Container(tree, unified=p.suspends) for p in POLICIES]
        for c in containers:
            stack.enter_context(c)  # not started yet: entering boots it, here one at a time
        log(f"booted {', '.join(f'{c.name} ({c.boot_s or 0:.1f} s)' for c in containers)}")
        list(pool.map(_prepare, containers, [day] * n, POLICIES))
        log(f"a day of {day.window_s:g} s, {n_od} on-demand requests, every policy at once")
        days = list(pool.map(_run_day, containers, [day] * n, POLICIES, [timeout] * n))
    measured: dict[str, dict[str, Any]] = {}
    for policy, out in zip(POLICIES, days, strict=True):
        preempt = preemptions(out.get("decisions", {})) if policy.config else None
        replay = Replay(out["t0"], out["t_end"], out["requests"], out["logs"], preempt)
        measured[policy.title] = analyse(day, replay)
        raw[policy.key] = {**out, "metrics": measured[policy.title]}
        if out["max_late_s"] > 0.5:
            log(f"{policy.title}: a request went out {out['max_late_s']:.2f} s late")
    results = with_oracles(day, measured, POLICIES)
    raw["policies"] = results
    return rows_of(results), raw


if __name__ == "__main__":
    started = time.monotonic()

    def _log(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {text}", flush=True)

    tree, _ = ensure_tree()
    try:
        rows, raw = case_day(tree, QUICK, _log)
    except BedError as exc:
        raise SystemExit(f"bench day FAILED: {exc}") from exc
    print()
    print(table(rows))
    print()
    print(day_table(raw["policies"]))
    out = RESULTS_DIR / f"day-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(raw, indent=1) + "\n")
    print(f"\nresults: {out}")
