"""`gpuslice status`: the scheduler's snapshot as stable JSON, and as a table for people.

The JSON (version 1) is a documented interface: keys are only ever added.
  {"version": 1,
   "gpus": [{"index": 0, "uuid": str|null, "name": str|null, "memory_total": int|null,
             "memory_reserved": int, "memory_used": int|null, "lost": bool,
             "holders": [{"unit": str, "priority": int, "state": str,
                          "memory_declared": int|null, "memory_used": int|null,
                          "reason": str|null, "since": float|null}],
             "foreign": [{"pid": int, "command": str, "memory": int|null}]}],
             (pid and command are null in a redacted answer: below)
   "waiting": [{"unit": str, "priority": int, "reason": str,
                "position": int, "since": float|null, "decision": DECISION|null}],
   "preempted": [{"unit": str, "priority": int, "requeue": bool}],
   "held": [str], "finished": [str], "failed": [str],
   "problems": [str],
   "nvml": {"state": str, "since": float, "detail": str, "driver_version": str|null}}
Memory is in bytes; null means unknown (no NVML) or, for memory_declared, the whole GPU.
`state` is "running", "starting" (gpuslice started it; its gate has not asked yet),
"stopping" (being preempted), or, for the Preempt= ladder (added later), "suspending" (its VRAM
is moving to host memory), "resuming" (moving back; the memory is reserved for it) or "frozen"
(beside a more urgent unit: it keeps its VRAM); added with the restart keep, "restarting": it
failed and its Restart= starts it again, its GPUs kept for that start meanwhile (nothing of it
runs; 30 s at most; README.md, "kept for its restart"): its "reason" says so (`GPU 0 kept for
crash.service's restart (its Restart=)`) and "since" is Unix time the keep began (null when
unknown); both are null for every other state.
`nvml` (added later; absent from older controllers) says which GPU case applies: "ready" (NVML
answers), "waiting" (NVIDIA hardware present, NVML not ready yet or gone: background units
wait), "fallback" (still not ready after driver_wait) or "absent" (no NVIDIA GPU: `gpus:`
from config.yaml); `since` is Unix time of the last change.
In `waiting` (added later): `position` is the place in the queue, 1 first (waiters are served
by priority, then arrival); `since` is Unix time (seconds, float) when the controller first saw
it wait (null when unknown); `decision` is its `reason` as data (null when not yet decided):
  DECISION = {"code": "wait", "unit": str, "priority": int, "for": str|null,
              "for_priority": int|null, "gpus": [int], "cause": str, "parts": [PART],
              "need_gpus": int, "need_memory": int|null, "available": int|null,
              "detail": str|null}
  PART = {"kind": "victim"|"held"|"stopping"|"memory"|"kept"|"suspended", "gpus": [int],
          "unit": str|null, "priority": int|null, "free": int|null, "refused": bool,
          "granted_after": bool, "overdue": str|null}
`cause` is "paused" (background units wait for the driver: `detail` says why),
"victims-stopping" (the `victim` parts were asked to stop for it; `gpus` is where it goes),
"too-few-usable-gpus" or "host-too-small" (`available` GPUs may run it / the host has), or
"gpus-busy" (each usable GPU's part: `held` by a unit it may not preempt, `refused` when that
unit's stop was refused, `granted_after` when it was granted after this waiter was known
and so is not preempted for it: the thrash rule; `stopping` for another waiter; `memory`:
`free` bytes of declared memory left; `kept` for an earlier waiter of the same priority;
`suspended` (added later): kept for `unit`, suspended and more urgent, until it comes back).
PART "others" and "owners" (added later; 0 and [] but for `memory`): bytes on that GPU used by
processes of no holder (foreign, or a managed unit's leftovers), and whose the foreign ones
are, as the table says them ("Slurm job 881").
PART "beyond" (added with overuse counted; 0 but for `memory`): bytes on that GPU its holders
use beyond their Memory=, which counts against the GPU like "others".
gpuslice/core/decisions.py defines every code, cause and kind.
Added later, for `gpuslice metrics` (absent from older controllers):
  "priorities": {unit: int} for the units in held, finished and failed that are annotated;
  "controller": {"version": str, "start_time": float (Unix time it started)};
  "counters": {"decisions": {code: int for every code}, "dbus_signals_dropped": int,
               "dbus_call_errors": int, "dbus_signals_lost": int, "dbus_acquire_refused": int,
               "nvml_errors": int, "nvml_timeouts": int, "journal_write_errors": int,
               "state_save_errors": int, "notify_errors": int (added later)};
  "admission_wait_seconds": {"buckets": [[upper bound (s), cumulative count], ...,
                             ["+Inf", count]], "sum": float, "count": int}: how long each
                             grant waited at its gate (0 when at once).
The counts are since the controller started (gpuslice/counters.py): a restart resets them.
Added with the gate's pipes: "counters" "gate_answers": {"pipe": int, "dbus": int}, how
many gates were let through by their pipe (gpuslice/gatepipes.py) and by a D-Bus reply.
Added with the Preempt= ladder: PART "rung" ("suspend" for a victim being suspended, else
null); DECISION "rung" and "fallback" (for "rung-failed"); and
  "suspended": [{"unit": str, "priority": int, "gpus": [int] (where it comes back),
                 "host_memory": int|null (bytes moved to host memory; null when this
                 controller did not suspend it), "since": float|null (Unix time)}],
  most urgent first: suspended units are frozen, active for systemd, and hold no GPU.
Added beside Slurm and Kubernetes: each "foreign" entry's "owner": {"kind": str, "id": str},
whose process it is, read from its cgroup (gpuslice/owners.py): "slurm" (id: the job),
"kubernetes" (the pod's UID), "docker" or "podman" (the container, 12 digits), "machine" (a
systemd-machined container's name), "user" (a UID), "unit" (a unit gpuslice does not
manage), or "other" (id ""); and "compute": bool, false for a graphics-only process (a
display server, a compositor), which background units do not yield to.
Added with the slow-build cache: "controller" "status_time": float, the Unix time of the state
shown (CachedStatus: on the largest hosts up to ten builds' time behind).
Added with the cap on owners: PART "owners_left_out": int, how many owners "owners" leaves
out. "owners" names at most the first 8 (LISTED_MAX in gpuslice/core/decisions.py; sorted,
those the reason names, which says "and N more"): a user of the host's Slurm or Kubernetes
runs processes of thousands of owners (a job or pod each), and every waiter's part on every
GPU named them all.
Added with renumbered GPUs: each GPU's "renumbered": bool, true when it is "lost" only because
NVML numbered the GPUs anew under units that hold it (`Gpu.renumbered`): it answers, and takes
no new work until they release it ("lost" stays true, as it was before this key).
Added with the cap on foreign processes: each GPU's "foreign" names at most LISTED_MAX
processes: all of them (by PID) when they are no more, else the LISTED_MAX using the most
memory, largest first, unknown memory last (the table's): a user of the host can run
thousands, and every answer named them all. And, for those it leaves out:
  "foreign_left_out": int (how many), "foreign_left_out_memory": int (the bytes they use, of
  those whose use NVML knows), "foreign_left_out_unknown": int (how many NVML gave no memory
  for), "foreign_left_out_by_kind": {kind: int} (their known bytes by owner kind, which
  `gpuslice metrics` adds to those listed); 0, 0, 0 and {} when none is left out.
Added for a /proc mounted with hidepid= (gpuslice/procmount.py), where the admin
hides each user's processes from the others: the answer to a caller /proc would hide them
from (neither root nor of the mount's gid= group, or whom the bus daemon did not name) is
redacted, and says so: "redacted": true (absent from every other answer). Each "foreign"
entry's "pid", "command" and "owner" "id" are null ("memory", "owner" "kind", "compute" and
the counts stay: a user still sees why a GPU is busy); each PART's "owners" is [] and
"owners_left_out" their number, "owner_kinds": {kind: int} (redacted answers only) counts
them by kind, and the waiter's `reason` says them so ("1 Slurm job, 2 users").
Added with a caller's own processes: a redacted answer shows the caller's own foreign
processes whole, as /proc shows a user their own: each "foreign" entry whose "owner" is
{"kind": "user", "id": the caller's UID} (a process of that user's sessions or user manager,
in user-UID.slice: gpuslice/owners.py) keeps its "pid", "command" and "id". Every other
entry stays redacted, whoever runs it: its owner (a Slurm job, a pod, a container, a unit,
even one run as that user) says no UID. The list, its order and the counts are the same for
every caller; the PARTs still count owners by kind only.
Added with root's environment files: the "problems" of an answer to anyone but root (a
redacted answer included) leave out what gpuslice read in a unit's environment files, which
systemd shows no one but root: `LD_PRELOAD=... (set in /etc/x.env; its value is shown to
root alone)`. The journal and `gpuslice check` run as root say the value; the number of
problems is the same for every caller.
Added with RemainAfterExit= released: "remained": [str], the units of "finished" that systemd
still shows active (`RemainAfterExit=yes`, SubState `exited`): their GPUs are released; the
table says "(still active)" after each.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from gpuslice import clock
from gpuslice.annotations import Scan
from gpuslice.core.decisions import LISTED_MAX, Decision, reason
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Snapshot
from gpuslice.inventory import GpuUse, Sample
from gpuslice.owners import OTHER, UNKNOWN, USER, Owner, kind_said, kinds_counted
from gpuslice.sizes import format_size

JSON_VERSION = 1
# A status that took longer than this to build is built again at most once per
# REBUILD_FACTOR times what it took (CachedStatus): anyone may ask for it as often as they
# like, and at 10,000 waiting units on 8 GPUs a build takes 1.2 s of the one loop every GPU
# job waits on; rebuilt at every change (a GPU sample every 2 s while anything waits), one
# `gpuslice status --watch` held the controller more than half of the time.
SLOW_BUILD = 0.02
REBUILD_FACTOR = 10
# `gpuslice status` says how old a state this far behind is.
STALE_SAID = 2.0
# The table's first line for a redacted answer
REDACTED_SAID = (
    "Processes of other users are hidden (/proc is mounted with hidepid): their PIDs, "
    "commands and owners are not shown"
)
# The callers' own texts a redacted answer keeps (RedactedStatus), the most recently asked
# for: one for each UID that owns a foreign process it lists (at most LISTED_MAX a GPU), each
# the whole status long (MiBs on the largest hosts). Past them, a text is made again, at the
# cost of its GPUs' JSON and one copy.
OWN_KEPT = 4

T = TypeVar("T")
U = TypeVar("U")


class CachedStatus(Generic[T]):
    """The status JSON (or what its build gives: a RedactedStatus), built once per change;
    a slow build (SLOW_BUILD) is reused, at most REBUILD_FACTOR times its cost (the loop's
    CPU), after a change: a reader then sees the state of a moment ago (`as_of`, Unix time,
    says which), and the controller spends at most a tenth of its time on readers. Fast
    builds (every host but the largest) are always of the moment."""

    def __init__(self, build: Callable[[], T]) -> None:
        self._build = build
        self._text: T | None = None
        self._fresh = False
        self._until = 0.0  # monotonic time before which a slow build is not repeated
        self.built = 0.0  # Unix time of the last build
        self._booted = 0.0  # the Unix time of the host's boot (clock.unix_time(0)) at it
        self._variants: list[CachedStatus[Any]] = []

    def variant(self, build: Callable[[], U]) -> CachedStatus[U]:
        """Another text of the same state (the answer that hides other users' processes),
        cached alike: built only when asked for, once per change (each of this one's)."""
        other = CachedStatus(build)
        self._variants.append(other)
        return other

    def changed(self) -> None:
        self._fresh = False
        for other in self._variants:
            other.changed()

    @property
    def as_of(self) -> float:
        """Unix time of the state `text()` last gave: now while nothing changed since its
        build (an idle host's status, built once, is of the moment hours later)."""
        return time.time() if self._fresh else self.built

    def text(self) -> T:
        # a wall clock stepped since the build (NTP, `date -s`) made the Unix times in it
        # (`since`) wrong by as much: built again. clock.unix_time moves only on a step (by
        # more than clock.STEP_SEEN), so any change of the boot's Unix time is one
        stepped = clock.unix_time(0.0) != self._booted
        if self._text is None or stepped or not (self._fresh or time.monotonic() < self._until):
            start, cpu = time.monotonic(), time.thread_time()
            self._booted = clock.unix_time(0.0)
            self._text, self.built = self._build(), time.time()
            # the loop's CPU, not the wall clock: a fast build that waited for a CPU on a busy
            # host is no reason to show readers a state of a moment ago
            cost = time.thread_time() - cpu
            self._until = start + cost * REBUILD_FACTOR if cost > SLOW_BUILD else 0.0
            self._fresh = True
        return self._text


def _gpu_json(
    index: int,
    holders: list[tuple[str, int, str]],
    scan: Scan,
    sample: Sample,
    declared: Mapping[str, int] | None,
    redact: bool = False,
    restarting: Mapping[str, tuple[str, float | None]] | None = None,
) -> dict[str, Any]:
    """`restarting`: why, and since when (Unix time), each holder whose GPUs are kept for
    its Restart= has them."""
    restarting = restarting or {}
    gpu = next((g for g in sample.gpus if g.index == index), Gpu(index))
    foreign = _foreigners(sample, index)
    out: dict[str, Any] = {
        "index": index,
        "uuid": gpu.uuid or None,
        "name": gpu.name or None,
        "memory_total": gpu.total,
        "memory_reserved": gpu.reserve,
        "memory_used": gpu.used,
        "lost": gpu.lost,
        "renumbered": gpu.renumbered,
        "holders": [],
        **_foreign_json(foreign, redact),
    }
    for unit, prio, state in holders:
        if declared is not None:
            memory = declared.get(unit)
        else:
            spec = scan.spec_for(unit)
            memory = spec.memory if spec is not None else None
        out["holders"].append(
            {
                "unit": unit,
                "priority": prio,
                "state": state,
                "memory_declared": memory,
                "memory_used": sample.used_by(unit).get(index),
                "reason": restarting[unit][0] if unit in restarting else None,
                "since": restarting[unit][1] if unit in restarting else None,
            }
        )
    return out


def _rank(memory: Any) -> Any:
    """The order foreign processes are listed in past LISTED_MAX: the most memory first,
    unknown memory last (a stable sort: then in their order, by PID)."""
    return -memory if memory is not None else 1


def _listed(foreign: list[GpuUse]) -> tuple[list[GpuUse], list[GpuUse]]:
    """The foreign processes a GPU's "foreign" list names, in its order, and those it
    leaves out (_foreign_json)."""
    if len(foreign) <= LISTED_MAX:
        return foreign, []
    ranked = sorted(foreign, key=lambda p: _rank(p.used))
    return ranked[:LISTED_MAX], ranked[LISTED_MAX:]


def _foreigners(sample: Sample, index: int) -> list[GpuUse]:
    """The foreign processes on GPU `index`: of no unit gpuslice manages."""
    return [p for p in sample.processes if p.gpu == index and p.unit is None]


def _foreign_json(foreign: list[GpuUse], redact: bool) -> dict[str, Any]:
    """A GPU's "foreign" list: every process up to LISTED_MAX, by PID, else the LISTED_MAX
    using the most memory (as the table shows them), and what the rest use (a user of the
    host can run thousands, and each answer named them all). `redact`: without PID,
    command or owner ID."""
    listed, left_out = _listed(foreign)
    by_kind: dict[str, int] = {}
    for p in left_out:
        if p.used is not None:
            kind = (p.owner or UNKNOWN).kind
            by_kind[kind] = by_kind.get(kind, 0) + p.used
    return {
        "foreign": [_process_json(p, redact) for p in listed],
        "foreign_left_out": len(left_out),
        "foreign_left_out_memory": sum(by_kind.values()),
        "foreign_left_out_unknown": sum(1 for p in left_out if p.used is None),
        "foreign_left_out_by_kind": by_kind,
    }


def _process_json(p: GpuUse, redact: bool) -> dict[str, Any]:
    owner = p.owner or UNKNOWN
    if redact:
        return {
            "pid": None,
            "command": None,
            "memory": p.used,
            "owner": {"kind": owner.kind, "id": None},
            "compute": p.compute,
        }
    return {
        "pid": p.pid,
        "command": p.command,
        "memory": p.used,
        "owner": owner.to_json(),
        "compute": p.compute,
    }


def _waiter_json(
    words: str, decision: Decision | None, redact: bool
) -> tuple[str, dict[str, Any] | None]:
    """A waiter's reason and decision; `redact`: each part's owners only counted by kind
    (`owner_kinds`), the reason saying them so (`1 Slurm job, 2 users`)."""
    if decision is None:
        return words, None
    if not redact:
        return words, decision.to_json()
    kinds = [Counter(p.owner_kinds) for p in decision.parts]
    out = decision.to_json()
    for part, p, counted in zip(out["parts"], decision.parts, kinds, strict=True):
        part["owners"] = []
        part["owners_left_out"] = len(p.owners)
        part["owner_kinds"] = dict(sorted(counted.items()))
    if any(p.owners for p in decision.parts):
        parts = tuple(
            dataclasses.replace(p, owners=kinds_counted(counted), owner_kinds=())
            for p, counted in zip(decision.parts, kinds, strict=True)
        )
        words = reason(dataclasses.replace(decision, parts=parts))
    return words, out


def snapshot_to_json(
    snap: Snapshot,
    scan: Scan,
    sample: Sample,
    since: Mapping[str, float] | None = None,
    suspensions: Mapping[str, tuple[int, float]] | None = None,
    declared: Mapping[str, int] | None = None,
    redact: bool = False,
    restart_since: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """`since`: Unix time each waiter started waiting, as the controller saw it;
    `suspensions`: the bytes each suspended unit moved to host memory, and when;
    `declared`: the memory each holder with `Memory=` holds its GPUs on, as the scheduler
    counts it (Scheduler.declared_memory: a unit whose annotation went keeps its terms),
    else read from the annotations; `redact`: the answer for a caller that /proc hides
    other users' processes from (gpuslice/procmount.py): no foreign process's PID,
    command or owner ID, no owner named in a waiter's reason, and the problems as anyone
    but root is shown them (`problems_json`); `restart_since`: Unix time each keep for a
    unit's Restart= (Snapshot.restarting) began."""
    since = since or {}
    suspensions = suspensions or {}
    restart_since = restart_since or {}
    restarting = {u: (why, restart_since.get(u)) for u, why in snap.restarting.items()}
    waiting = []
    for position, (unit, prio, words) in enumerate(snap.waiting, start=1):
        said, decision = _waiter_json(words, snap.reasons.get(unit), redact)
        waiting.append(
            {
                "unit": unit,
                "priority": prio,
                "reason": said,
                "position": position,
                "since": since.get(unit),
                "decision": decision,
            }
        )
    out = {
        "version": JSON_VERSION,
        "gpus": [
            _gpu_json(index, holders, scan, sample, declared, redact, restarting)
            for index, holders in sorted(snap.gpus.items())
        ],
        "waiting": waiting,
        "preempted": [
            {"unit": unit, "priority": prio, "requeue": requeue}
            for unit, prio, requeue in snap.preempted
        ],
        "suspended": [
            {
                "unit": unit,
                "priority": prio,
                "gpus": list(gpus),
                "host_memory": suspensions[unit][0] if unit in suspensions else None,
                "since": suspensions[unit][1] if unit in suspensions else None,
            }
            for unit, prio, gpus in snap.suspended
        ],
        "held": snap.held,
        "finished": snap.finished,
        "remained": snap.remained,
        "failed": snap.failed,
        "priorities": _priorities((*snap.held, *snap.finished, *snap.failed), scan),
        "problems": problems_json(scan, public=redact),
    }
    if sample.health is not None:
        out["nvml"] = sample.health.to_json()
    if redact:
        out["redacted"] = True
    return out


def problems_json(scan: Scan, public: bool = False) -> list[str]:
    """The scan's problems as root reads them, or (`public`) as anyone else may: without
    what only root may read, an environment file's values (Problem.public)."""
    return [p.public() if public else str(p) for p in scan.problems]


class FullStatus:
    """The answer that hides no process, of one state: `text` for root, `public` for anyone
    else, whose problems leave out what only root may read (`problems_json`). They differ
    in "problems" alone, and only where a problem withholds something (`withholds`): else
    both are one text."""

    def __init__(self, data: dict[str, Any], public: list[str]) -> None:
        """`data`: snapshot_to_json's answer; `public`: its problems as anyone may read them."""
        self.text = json.dumps(data, sort_keys=True)
        self.public = self.text
        if public != data["problems"]:
            self.public = json.dumps({**data, "problems": public}, sort_keys=True)

    @property
    def withholds(self) -> bool:
        return self.public is not self.text


def own_uid(p: GpuUse) -> int | None:
    """The UID whose process it is, where its owner says one: a process in a user's slice
    (user-UID.slice, which only root, logind, makes: gpuslice/owners.py); None for any
    other owner, whose UID is not known here."""
    owner = p.owner
    if owner is None or owner.kind != USER:
        return None
    return int(owner.id) if owner.id.isascii() and owner.id.isdigit() else None


class RedactedStatus:
    """The redacted answer of one state, for each caller: `text` for one who owns none of
    the foreign processes it lists, `text_for(uid)` with that UID's own shown whole (as
    /proc shows a user their own). Only "gpus" differs between them: the rest is serialized
    once, and a caller's own text costs its GPUs' JSON and one copy. The OWN_KEPT asked for
    last are kept: one is made once per change (a RedactedStatus is built per change, and
    what it keeps goes with it) and per UID that owns a process listed, never per caller."""

    def __init__(self, data: dict[str, Any], sample: Sample) -> None:
        """`data`: snapshot_to_json's redacted answer built from `sample`."""
        self._rest = json.dumps({k: v for k, v in data.items() if k != "gpus"}, sort_keys=True)
        self._gpus: list[dict[str, Any]] = data["gpus"]
        # each GPU's foreign processes as its "foreign" lists them (_gpu_json's)
        self._listed = [_listed(_foreigners(sample, gpu["index"]))[0] for gpu in self._gpus]
        self.owners = frozenset(
            uid for listed in self._listed for p in listed if (uid := own_uid(p)) is not None
        )
        self.text = self._joined(self._gpus)
        self._own: OrderedDict[int, str] = OrderedDict()

    def _joined(self, gpus: list[dict[str, Any]]) -> str:
        """The answer's text, "gpus" first and then the rest with its keys sorted: the JSON
        of json.dumps(data, sort_keys=True), all but the place of one key."""
        return '{"gpus": ' + json.dumps(gpus, sort_keys=True) + ", " + self._rest[1:]

    def text_for(self, uid: int | None) -> str:
        """The answer for a caller of this UID (None: unknown, the caller's own none)."""
        if uid is None or uid not in self.owners:
            return self.text
        text = self._own.get(uid)
        if text is not None:
            self._own.move_to_end(uid)
            return text
        pairs = zip(self._gpus, self._listed, strict=True)
        gpus = [_own_shown(gpu, listed, uid) for gpu, listed in pairs]
        text = self._own[uid] = self._joined(gpus)
        if len(self._own) > OWN_KEPT:
            self._own.popitem(last=False)
        return text


def _own_shown(gpu: dict[str, Any], listed: list[GpuUse], uid: int) -> dict[str, Any]:
    """A redacted GPU's JSON with the processes of `uid` among `listed` shown whole."""
    if all(own_uid(p) != uid for p in listed):
        return gpu
    return {**gpu, "foreign": [_process_json(p, own_uid(p) != uid) for p in listed]}


def _priorities(units: tuple[str, ...], scan: Scan) -> dict[str, int]:
    out = {}
    for unit in units:
        spec = scan.spec_for(unit)
        if spec is not None:
            out[unit] = spec.priority
    return out


# A foreign process whose PID and command a redacted answer leaves out
HIDDEN = "(hidden by /proc's hidepid)"


def _owner_label(owner: object) -> str:
    """`Slurm job 881` from the JSON's owner (absent from older controllers: ""); its kind
    alone (`Slurm job`) when its ID is left out (redacted), nothing for `other`."""
    if not isinstance(owner, dict):
        return ""
    kind, ident = owner.get("kind"), owner.get("id")
    if not isinstance(kind, str):
        return ""
    if ident is None and "id" in owner:
        return kind_said(kind) if kind != OTHER else ""
    return Owner(kind, ident).label() if isinstance(ident, str) else ""


def render(data: dict[str, Any], now: float | None = None) -> str:
    """A table a person reads at a glance; every list is shown, empty ones as "-", but for
    each GPU's foreign processes: at most LISTED_MAX of them, the largest, and how many more
    and their memory (the JSON names them all). Waiters are numbered by their place in the
    queue; with `now` (Unix time) each says how long it has waited."""
    lines = []
    shown = (data.get("controller") or {}).get("status_time")
    if isinstance(shown, (int, float)) and now is not None and now - shown >= STALE_SAID:
        lines.append(f"As of {_duration(now - shown)} ago (a large status is built less often)")
    nvml = data.get("nvml") or {}
    if nvml.get("state") in ("waiting", "fallback"):
        lines.append(f"NVML {nvml['state']}: {nvml.get('detail', '')}")
    if data.get("redacted") is True:
        lines.append(REDACTED_SAID)
    lines.append(f"{'GPU':<4} {'UNIT':<40} {'PRIORITY':>8}  {'STATE':<9} MEMORY")
    for gpu in data["gpus"]:
        if gpu.get("name") or gpu.get("lost"):
            lines.append(_gpu_line(gpu))
        if not gpu["holders"]:
            lines.append(f"{gpu['index']:<4} {'(free)':<40} {'':>8}")
        for h in gpu["holders"]:
            lines.append(
                f"{gpu['index']:<4} {h['unit']:<40} {h['priority']:>8}  {h['state']:<9} "
                + _holder_memory(h)
            )
            if h.get("reason"):  # absent from an older controller's answer
                kept = h.get("since")
                since = f" (for {_duration(now - kept)})" if kept and now is not None else ""
                lines.append(f"{'':<4} {h['reason']}{since}")
        foreign, left_out = _foreign_shown(gpu.get("foreign", []))
        for p in foreign:
            memory = format_size(p["memory"]) if p["memory"] is not None else "?"
            graphics = "graphics only" if p.get("compute") is False else ""
            whose = "; ".join(s for s in (graphics, _owner_label(p.get("owner"))) if s)
            what = f"PID {p['pid']} {p['command']}" if p.get("pid") is not None else HIDDEN
            lines.append(
                f"{gpu['index']:<4} {'foreign: ' + what:<40} "
                f"{'':>8}  {'':<9} {memory}" + (f"  ({whose})" if whose else "")
            )
        count, memory_left, unknown = _left_out_of(gpu, left_out)
        if count:
            lines.append(f"{gpu['index']:<4} {_left_out_line(count, memory_left, unknown)}")
    lines.append("")
    lines.append("Waiting:")
    for number, w in enumerate(data["waiting"], start=1):
        waited = ""
        if w.get("since") is not None and now is not None:
            waited = f" (for {_duration(now - w['since'])})"
        position = w.get("position", number)
        lines.append(f"  {position}. {w['unit']} (priority {w['priority']}): {w['reason']}{waited}")
    if not data["waiting"]:
        lines.append("  -")
    preempted = [
        f"{p['unit']} (priority {p['priority']}, "
        + ("returns when capacity frees)" if p["requeue"] else "Requeue=no)")
        for p in data["preempted"]
    ]
    suspended = [
        f"{p['unit']} (priority {p['priority']}"
        + (f", {format_size(p['host_memory'])} in host memory" if p.get("host_memory") else "")
        + (f" for {_duration(now - p['since'])}" if p.get("since") and now is not None else "")
        + f", returns to GPU {','.join(map(str, p['gpus']))})"
        for p in data.get("suspended", [])
    ]
    for title, items in (
        ("Suspended", suspended),
        ("Preempted", preempted),
        ("Held (stopped by hand)", data["held"]),
        ("Finished", _finished(data)),
        ("Failed", data["failed"]),
    ):
        lines.append(f"{title}: {', '.join(items) if items else '-'}")
    if data.get("problems"):
        lines.append("")
        lines.append("Annotation problems:")
        lines += [f"  {p}" for p in data["problems"]]
    return "\n".join(lines)


def _finished(data: dict[str, Any]) -> list[str]:
    """The finished units, each systemd still shows active (RemainAfterExit=yes) said so."""
    remained = set(data.get("remained", ()))  # absent from an older controller's answer
    return [f"{u} (still active)" if u in remained else u for u in data["finished"]]


def _foreign_shown(
    foreign: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The foreign processes a GPU's lines name, and those they leave out: all of them (in
    the JSON's order, by PID) up to LISTED_MAX, else the LISTED_MAX using the most memory,
    largest first (unknown memory last): a user of the host can run thousands of them, and
    one line each scrolled the rest of the table away."""
    if len(foreign) <= LISTED_MAX:
        return foreign, []
    ranked = sorted(foreign, key=lambda p: _rank(p.get("memory")))
    return ranked[:LISTED_MAX], ranked[LISTED_MAX:]


def _left_out_of(gpu: dict[str, Any], left_out: list[dict[str, Any]]) -> tuple[int, int, int]:
    """How many foreign processes the GPU's lines leave out, the bytes they use (of those
    whose use is known) and how many of them NVML gave none for: from those the table left
    out of the list, or, as the controller capped the list itself, from its counts."""
    if left_out:
        known = [p["memory"] for p in left_out if p.get("memory") is not None]
        return len(left_out), sum(known), len(left_out) - len(known)
    counts = [gpu.get(f"foreign_left_out{key}") for key in ("", "_memory", "_unknown")]
    said = [n for n in counts if isinstance(n, int) and n >= 0]
    if len(said) != len(counts):
        return 0, 0, 0  # an older controller's
    return said[0], said[1], said[2]


def _left_out_line(count: int, memory: int, unknown: int) -> str:
    """`... and 492 more foreign processes using 37 GiB` (`at least` when some of their
    memory is unknown; no memory said when none is known)."""
    text = f"... and {count} more foreign process" + ("es" if count > 1 else "")
    if unknown >= count:
        return text
    least = "at least " if unknown else ""
    return f"{text} using {least}{format_size(memory)}"


def _duration(seconds: float) -> str:
    """`42 s`, `3 min 5 s`, `2 h 10 min`."""
    whole = max(int(seconds), 0)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


def _gpu_line(gpu: dict[str, Any]) -> str:
    if gpu.get("renumbered") is True:
        return (
            f"GPU {gpu['index']}: RENUMBERED (NVML numbered the GPUs anew: no new work here "
            "until its units release it)"
        )
    if gpu.get("lost"):
        return f"GPU {gpu['index']}: LOST (stopped answering NVML)"
    total, used = gpu.get("memory_total"), gpu.get("memory_used")
    memory = ""
    if total is not None:
        shown = format_size(used) if used is not None else "?"
        memory = f", {shown} / {format_size(total)} used"
        if gpu.get("memory_reserved"):
            memory += f", {format_size(gpu['memory_reserved'])} reserved"
    return f"GPU {gpu['index']}: {gpu['name']}{memory}"


def _holder_memory(holder: dict[str, Any]) -> str:
    declared = holder.get("memory_declared")
    used = holder.get("memory_used")
    text = "whole GPU" if declared is None else f"{format_size(declared)} declared"
    if used is not None:
        text += f", {format_size(used)} used"
        if declared is not None and used > declared:
            text += " (MORE THAN DECLARED)"
    return text
