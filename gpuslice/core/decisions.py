"""Decisions as data: what the scheduler decided about a unit, and the one place that says it.

Every action the core returns carries a `Decision`: a code, the unit it is about, the unit it
is for, GPUs, priorities and the reason's parts. The sentences in `journalctl -u gpuslice`,
in a unit's own journal and in `gpuslice status` are rendered from it here and nowhere else,
so tests (and anyone reading the journal's structured fields or the status JSON) can rely on
the data, and the words stay the same wherever they are shown.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from gpuslice.core.placement import format_gpus
from gpuslice.sizes import format_size


class Code(enum.Enum):
    """What was decided (GPUSLICE_DECISION= in the journal, "code" in the status JSON)."""

    GRANT = "grant"  # its gate may pass: it runs on `gpus`
    WAIT = "wait"  # it waits at its gate; `cause` and `blockers` say why
    KEEP = "keep"  # a waiter told so gets `gpus` kept for it; its gate is answered when it asks
    PREEMPT = "preempt"  # it is stopped for `for_unit`, more urgent
    YIELD = "yield-to-foreign"  # a background unit stops for processes gpuslice does not manage
    REQUEUE = "requeue"  # a preempted unit is brought back
    REFILL = "refill"  # an idle background unit is started on free capacity
    HOLD = "hold"  # stopped by hand: held until someone starts it
    # stopped by systemd with `units`, which gpuslice stopped for `for_unit` and which it
    # needs (`detail`: `Requires=`, ...): preempted, not held
    STOPPED_WITH = "stopped-with"
    FINISHED = "finished"  # ended successfully; its GPUs are free
    FAILED = "failed"  # failed; its own Restart= policy applies
    SHUTDOWN = "shutdown"  # stopped for shutdown; its GPUs are free
    CANCELLED = "cancelled"  # its start was cancelled while it waited
    NOT_REQUEUED = "preempted-no-requeue"  # preempted with Requeue=no: not brought back
    # a preempted instance no longer brought back: more instances than the bound (`detail`)
    # were kept preempted, and it would have come back last
    DROPPED = "preemption-dropped"
    # restarted to wait at its gate, its start failed before its grant: it is brought back
    # when its GPUs are free instead
    REQUEUE_FAILED = "requeue-failed"
    # after a controller restart, a start gpuslice had decided on is not in systemd's queue
    # (the last controller may have died before sending it): sent again, once
    START_LOST = "start-lost"
    # a start gpuslice sent did not reach systemd (an error of the bus, or of a systemd that
    # was re-executing: `detail`): it is owed as before, its GPUs released, sent again soon
    START_RETRY = "start-retry"
    STOP_FAILED = "stop-failed"  # a stop gpuslice asked for did not happen
    STOP_REFUSED = "stop-refused"  # systemd refused the stop: not tried again while it runs
    STOP_OVERDUE = "stop-overdue"  # still running `detail` after gpuslice asked it to stop
    LOST_GPU = "lost-gpu"  # a GPU stopped answering; `units` held it
    EXCEEDS_HOST = "exceeds-host"  # it needs more GPUs than the host has
    UNACCOUNTED = "running-unaccounted"  # runs without enough free GPUs to count it on
    # no longer annotated: its GPUs are released, or with `cause` RUNS kept until it ends
    UNMANAGED = "unmanaged"
    SUSPEND = "suspend"  # its VRAM goes to host memory for `for_unit` (Preempt=suspend)
    SUSPENDED = "suspended"  # done: its VRAM left `gpus` (`detail`: how much, how fast)
    RESUME = "resume"  # a suspended unit's VRAM is restored onto its `gpus`, reserved for it
    RESUMED = "resumed"  # done (`detail`: after how long, how fast)
    RESUME_FAILED = "resume-failed"  # its restore failed: it is stopped (`detail`: why)
    FREEZE = "freeze"  # frozen beside `for_unit` on `gpus`: it keeps its VRAM (Preempt=freeze)
    THAW = "thaw"  # the units it was frozen for have left: it runs again
    RUNG_FAILED = "rung-failed"  # `rung` did not work (`detail`); `fallback` is tried next
    THAWED_OUTSIDE = "thawed-outside"  # someone thawed a frozen or suspended unit by hand


class Cause(enum.Enum):
    """Which kind of reason, where a code has several ("cause" in the status JSON)."""

    PAUSED = "paused"  # wait: background units wait for the driver (`detail`)
    STOPPING = "victims-stopping"  # wait: for the units in `blockers` to stop
    UNUSABLE = "too-few-usable-gpus"  # wait: only `available` GPUs may run it
    HOST = "host-too-small"  # wait: the host has `available` GPUs
    BUSY = "gpus-busy"  # wait: every usable GPU is taken; `blockers` say by whom
    FREE = "free-gpus"  # requeue: onto free `gpus`
    PREEMPTS = "must-preempt"  # requeue: its gate will preempt less urgent units
    QUEUES = "waits-at-gate"  # requeue: it waits at its gate for more urgent units' GPUs
    SUSPENDED = "suspended"  # thawed-outside: the unit was suspended (else frozen)
    RUNS = "still-runs"  # unmanaged: it runs on, holding `gpus` until it ends
    WITHDRAWN = "start-withdrawn"  # unmanaged: gpuslice's own start of it is stopped
    # unmanaged: a start at the gate a daemon-reload took out is restarted, its own
    # ExecStartPre= lines kept
    RESTARTED = "start-restarted"
    # unmanaged: a unit down that gpuslice had preempted is no longer brought back (only
    # annotated units are); its preemption is forgotten
    PREEMPTED = "preemption-forgotten"
    # finished: its main process ended and no process is left, and systemd keeps it active
    # (RemainAfterExit=yes) until someone stops it: its GPUs are released now all the same
    REMAINS = "remains-active"
    # stop-refused: its stop would have cancelled a job of another unit's (the start of one
    # that needs it): not tried again while the unit it was for waits
    NEEDED = "would-cancel-a-job"
    # finished: its Restart= (always, on-success) starts it again, its `gpus` kept for that
    RESTARTS = "kept-for-restart"
    # failed: its start was skipped, a `Condition*=` or `ExecCondition=` of its unit unmet
    SKIPPED = "condition-unmet"


class Blocker(enum.Enum):
    """What keeps one GPU (or, for a victim, several) from a waiter."""

    VICTIM = "victim"  # `unit` was asked to stop for it; `overdue` when it is late
    HELD = "held"  # `unit` holds it and may not be preempted for the waiter
    STOPPING = "stopping"  # `unit` is stopping for another waiter
    MEMORY = "memory"  # only `free` bytes of declared memory are left (`unit`: top holder)
    KEPT = "kept"  # kept for an earlier waiter of the same priority
    SUSPENDED = "suspended"  # kept for `unit`, suspended, more urgent: it comes back there


# A line, or a part in the status JSON, names at most this many processes, owners or units:
# a user can start thousands of them
LISTED_MAX = 8


@dataclass(frozen=True)
class Part:
    """One part of a waiter's reason."""

    kind: Blocker
    gpus: tuple[int, ...]
    unit: str = ""
    priority: int | None = None
    free: int | None = None  # bytes, for MEMORY
    refused: bool = False  # HELD by a unit whose stop systemd refused
    granted_after: bool = False  # HELD by a less urgent unit granted after the waiter was known
    overdue: str = ""  # VICTIM still running this long after the stop (in words)
    rung: str = ""  # VICTIM, STOPPING: how it gives way (Preempt=): "suspend", else a stop
    others: int = 0  # MEMORY: bytes used by processes of no holder (foreign, or leftovers)
    beyond: int = 0  # MEMORY: bytes holders there use beyond their Memory=
    owners: tuple[str, ...] = ()  # MEMORY: whose the foreign ones are (`Slurm job 881`), sorted
    # MEMORY: the kind of each of `owners` (`slurm`), in its order: a status that may not
    # name them counts them by kind from these, never from their words. Told by the owners
    # (one label, one owner), so no part of equality
    owner_kinds: tuple[str, ...] = field(default=(), compare=False)

    def __deepcopy__(self, memo: dict[int, object]) -> Part:
        return self  # immutable through and through: a copy of the scheduler shares it

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "gpus": list(self.gpus),
            "unit": self.unit or None,
            "priority": self.priority,
            "free": self.free,
            "refused": self.refused,
            "granted_after": self.granted_after,
            "overdue": self.overdue or None,
            "rung": self.rung or None,
            "others": self.others,
            "beyond": self.beyond,
            # the first LISTED_MAX, as the reason names them: every waiter's part on every
            # GPU repeated them all, and a user can run processes of thousands of owners
            "owners": list(self.owners[:LISTED_MAX]),
            "owners_left_out": max(len(self.owners) - LISTED_MAX, 0),
        }


@dataclass(frozen=True)
class Decision:
    """One decision about a unit (or, for a lost GPU, about the units on it)."""

    code: Code
    unit: str = ""  # the unit it is about
    priority: int | None = None
    for_unit: str = ""  # the unit it is for: the waiter a victim stops for
    for_priority: int | None = None
    gpus: tuple[int, ...] = ()
    cause: Cause | None = None
    parts: tuple[Part, ...] = ()
    need_gpus: int = 1  # what the unit asks for: GPUs ...
    need_memory: int | None = None  # ... and bytes of VRAM on each (None: whole GPUs)
    available: int | None = None  # GPUs the host has, or that may run it (EXCEEDS_HOST, WAIT)
    units: tuple[str, ...] = ()  # LOST_GPU: the units that held it
    pids: tuple[int, ...] = ()  # YIELD: the foreign processes
    owners: tuple[str, ...] = ()  # YIELD: whose they are (`Slurm job 881`), for people
    detail: str = ""  # free words: why a stop failed, for how long it is overdue, a pause
    rung: str = ""  # RUNG_FAILED: the way of giving way that did not work
    fallback: str = ""  # RUNG_FAILED: the one tried instead ("": none, it keeps its GPUs)

    def __deepcopy__(self, memo: dict[int, object]) -> Decision:
        return self  # immutable through and through: a copy of the scheduler shares it

    def subjects(self) -> tuple[str, ...]:
        """The units whose own journal gets this decision."""
        if self.unit:
            return (self.unit,)
        return self.units

    def to_json(self) -> dict[str, Any]:
        """The decision in `gpuslice status --json`: every key, always (null when unset)."""
        return {
            "code": self.code.value,
            "unit": self.unit or None,
            "priority": self.priority,
            "for": self.for_unit or None,
            "for_priority": self.for_priority,
            "gpus": list(self.gpus),
            "cause": self.cause.value if self.cause is not None else None,
            "parts": [p.to_json() for p in self.parts],
            "need_gpus": self.need_gpus,
            "need_memory": self.need_memory,
            "available": self.available,
            "detail": self.detail or None,
            "rung": self.rung or None,
            "fallback": self.fallback or None,
        }


# The journal level of each decision (syslog names, as Log.level)
LEVELS: dict[Code, str] = {
    Code.FAILED: "warning",
    Code.STOP_FAILED: "warning",
    Code.START_RETRY: "warning",
    Code.STOP_REFUSED: "warning",
    Code.STOP_OVERDUE: "warning",
    Code.EXCEEDS_HOST: "warning",
    Code.UNACCOUNTED: "warning",
    Code.LOST_GPU: "error",
    Code.RUNG_FAILED: "warning",
    Code.RESUME_FAILED: "error",
    Code.DROPPED: "warning",  # work gpuslice stopped that nothing will bring back
}


def level(decision: Decision) -> str:
    if decision.cause is Cause.PREEMPTED:
        return "warning"  # work gpuslice stopped that nothing will bring back
    return LEVELS.get(decision.code, "info")


def _who(unit: str, priority: int | None) -> str:
    return f"{unit} (priority {priority})"


def _need(d: Decision) -> str:
    """`needs 20 GiB on one GPU; ` (empty for a whole-GPU unit on one GPU)."""
    where = "one GPU" if d.need_gpus == 1 else f"each of {d.need_gpus} GPUs"
    if d.need_memory is not None:
        return f"needs {format_size(d.need_memory)} on {where}; "
    return f"needs {d.need_gpus} GPUs; " if d.need_gpus > 1 else ""


# The thrash rule, as a waiter's reason says it (README "Preemption and thrash")
GRANTED_AFTER = " (granted while this unit was known: not stopped for it)"


def listed(items: tuple[object, ...]) -> str:
    """`1, 2, 3`, or the first LISTED_MAX and how many more: the one way a line names what a
    user can make many of (the journal keeps a line whole, however long)."""
    shown = ", ".join(str(i) for i in items[:LISTED_MAX])
    more = len(items) - LISTED_MAX
    return f"{shown} and {more} more" if more > 0 else shown


def _part(p: Part) -> str:
    gpu = p.gpus[0] if p.gpus else -1
    if p.kind is Blocker.VICTIM:
        late = f" (still running {p.overdue} after the stop)" if p.overdue else ""
        how = "be suspended" if p.rung == "suspend" else "stop"
        return f"{_who(p.unit, p.priority)} to {how} on {format_gpus(p.gpus)}{late}"
    if p.kind is Blocker.MEMORY:
        held = f", held by {p.unit}, priority {p.priority}" if p.unit else ""
        held += GRANTED_AFTER if p.granted_after else ""
        if p.others:
            whose = f" ({listed(p.owners)})" if p.owners else ""
            held += f", {format_size(p.others)} used by processes of no holder{whose}"
        if p.beyond:  # it counts against the GPU as the rest does: no declaration covers it
            held += f", {format_size(p.beyond)} used by holders beyond their Memory="
        return f"GPU {gpu} has {format_size(max(p.free or 0, 0))} free after the reserve{held}"
    if p.kind is Blocker.STOPPING:
        how = "being suspended" if p.rung == "suspend" else "stopping"
        return f"GPU {gpu} being freed by {p.unit} ({how})"
    if p.kind is Blocker.SUSPENDED:
        return f"GPU {gpu} kept for suspended {p.unit}, priority {p.priority}"
    if p.kind is Blocker.HELD:
        refused = " (refused to stop)" if p.refused else GRANTED_AFTER if p.granted_after else ""
        return f"GPU {gpu} held by {p.unit}, priority {p.priority}{refused}"
    return f"GPU {gpu} kept for an earlier unit of priority {p.priority}"


def reason(d: Decision) -> str:
    """A waiter's reason as status shows it: `waiting: GPU 0 held by a.service, priority 20`."""
    if d.cause is Cause.PAUSED:
        return f"waiting: {d.detail}"
    if d.cause is Cause.STOPPING:
        # one part per victim: as many as Memory= units fit (instances a user may start)
        return "waiting for " + listed(tuple(_part(p) for p in d.parts))
    if d.cause is Cause.UNUSABLE:
        return (
            f"waiting: {_need(d)}only {d.available} of this host's GPUs "
            "may run it (Devices=, lost GPUs, or processes gpuslice does not manage)"
        )
    if d.cause is Cause.HOST:
        return f"waiting: needs {d.need_gpus} GPUs, this host has {d.available}"
    return "waiting: " + _need(d) + "; ".join(_part(p) for p in d.parts)


def until(d: Decision) -> str:
    """What would end a wait, in words (GPUSLICE_UNTIL= in the unit's journal)."""
    if d.cause is Cause.PAUSED:
        return "NVML answers, or driver_wait runs out"
    if d.cause is Cause.STOPPING:
        return "the units named have stopped"
    if d.cause is Cause.UNUSABLE:
        return "enough of the GPUs it may use are usable (Devices=, a lost GPU, foreign processes)"
    if d.cause is Cause.HOST:
        return "the host has enough GPUs (config.yaml gpus:, or NVML)"
    return "the GPUs named free up, or their holders become less urgent than it"


def render(d: Decision) -> str:
    """The sentence for a decision, as `journalctl -u gpuslice` shows it."""
    who = _who(d.unit, d.priority)
    code = d.code
    if code is Code.GRANT:
        return f"starting {who} on {format_gpus(d.gpus)}"
    if code is Code.WAIT:
        return f"{d.unit} {reason(d)}"
    if code is Code.KEEP:
        return f"keeping {format_gpus(d.gpus)} for {who}: it starts when its gate asks"
    if code is Code.PREEMPT:
        return f"preempting {who} for {_who(d.for_unit, d.for_priority)} on {format_gpus(d.gpus)}"
    if code is Code.YIELD:
        whose = f"; {listed(d.owners)}" if d.owners else ""
        return (
            f"yielding {format_gpus(d.gpus)}: stopping background {who} while a process "
            f"gpuslice does not manage uses it (PID {listed(d.pids)}{whose})"
        )
    if code is Code.REQUEUE:
        if d.cause is Cause.QUEUES:
            return f"restarting preempted {who}: it waits at its gate for more urgent units"
        where = (
            "GPUs held by less urgent units" if d.cause is Cause.PREEMPTS else format_gpus(d.gpus)
        )
        return f"restarting preempted {who} on {where}"
    if code is Code.REFILL:
        return f"starting background {who} on free {format_gpus(d.gpus)}"
    if code is Code.HOLD:
        return f"{d.unit} was stopped outside gpuslice: held until started again"
    if code is Code.STOPPED_WITH:
        done = f"preempted for {_who(d.for_unit, d.for_priority)}" if d.for_unit else "stopped"
        return (
            f"{who} was stopped with {listed(d.units)} (its {d.detail}), which gpuslice "
            f"{done}: preempted with it, not held"
        )
    if code is Code.FINISHED and d.cause is Cause.REMAINS:
        return (
            f"{d.unit} finished: released {format_gpus(d.gpus)}; systemd keeps it active "
            "(RemainAfterExit=yes) until it is stopped, and a restart waits at its gate again"
        )
    if (code is Code.FINISHED and d.cause is Cause.RESTARTS) or (code is Code.FAILED and d.gpus):
        # ended, its GPUs kept for the start its Restart= sends (Scheduler._keep_for_restart)
        return (
            f"{d.unit} {code.value}: its own Restart= policy starts it again, "
            f"{format_gpus(d.gpus)} kept for it meanwhile"
        )
    if code is Code.FINISHED:
        return f"{d.unit} finished: released {format_gpus(d.gpus)}"
    if code is Code.FAILED and d.cause is Cause.SKIPPED:
        return (
            f"{d.unit} skipped: its Condition*= or ExecCondition= said no (systemd left it "
            "inactive, its job never ran); gpuslice will not start it by itself"
        )
    if code is Code.FAILED:
        return (
            f"{d.unit} failed: gpuslice will not start it by itself "
            "(its own Restart= policy applies)"
        )
    if code is Code.SHUTDOWN:
        return f"{d.unit} stopped for shutdown: released {format_gpus(d.gpus)}"
    if code is Code.CANCELLED:
        return f"{d.unit}: start cancelled while waiting; nothing reserved"
    if code is Code.NOT_REQUEUED:
        return f"{who} preempted; Requeue=no, not restarting"
    if code is Code.DROPPED:
        return (
            f"{who} will not be restarted after its preemption: {d.detail}, and it would "
            "have come back last; start it yourself if its work is still wanted"
        )
    if code is Code.REQUEUE_FAILED:
        return (
            f"{who} failed while it waited at its gate to come back from a preemption: "
            "it is restarted when its GPUs are free"
        )
    if code in (Code.STOP_FAILED, Code.STOP_REFUSED):
        for_whom = f" for {_who(d.for_unit, d.for_priority)}" if d.for_unit else ""
        after = (
            f"; gpuslice will try to stop it again once a job of {listed(d.units)} ends"
            if d.cause is Cause.NEEDED and d.units
            else f"; gpuslice will not try to stop it again while {d.for_unit} waits"
            if d.cause is Cause.NEEDED
            else "; gpuslice will not try to stop it again while it runs"
            if code is Code.STOP_REFUSED
            else ""
        )
        return f"{who} did not stop{for_whom}: {d.detail}; it keeps {format_gpus(d.gpus)}{after}"
    if code is Code.START_LOST:
        return (
            f"starting {who} again: the start gpuslice decided on before the controller "
            "restarted is not in systemd's queue"
        )
    if code is Code.START_RETRY:
        released = f"; {format_gpus(d.gpus)} released meanwhile" if d.gpus else ""
        return (
            f"starting {who} did not reach systemd: {d.detail}; it is started again in a "
            f"moment, until systemd takes the start{released}"
        )
    if code is Code.STOP_OVERDUE:
        waits = f" ({d.for_unit} waits for it)" if d.for_unit else ""
        return (
            f"{who} has not stopped {d.detail} after gpuslice asked{waits}: "
            "see its TimeoutStopSec= and ExecStop="
        )
    if code is Code.LOST_GPU:
        held = listed(d.units) if d.units else "no unit"
        return f"GPU {d.gpus[0] if d.gpus else -1} is lost; it was held by {held}"
    if code is Code.EXCEEDS_HOST:
        return (
            f"{who} needs {d.need_gpus} GPUs but this host has {d.available}: "
            "it waits until the configuration changes"
        )
    if code is Code.SUSPEND:
        return (
            f"moving the VRAM of {who} on {format_gpus(d.gpus)} to host memory for "
            f"{_who(d.for_unit, d.for_priority)}"
        )
    if code is Code.SUSPENDED:
        return f"suspending {who} for {_who(d.for_unit, d.for_priority)}: {d.detail}"
    if code is Code.RESUME:
        why = f" ({d.detail})" if d.detail else ""
        return f"restoring the VRAM of {who} on {format_gpus(d.gpus)}{why}"
    if code is Code.RESUMED:
        return f"resuming {d.unit} on {format_gpus(d.gpus)} after {d.detail}"
    if code is Code.RESUME_FAILED:
        return (
            f"{who} could not be resumed on {format_gpus(d.gpus)}: {d.detail}; stopping it "
            "(Requeue= decides whether it starts again)"
        )
    if code is Code.FREEZE:
        return (
            f"freezing {who} on {format_gpus(d.gpus)} for {_who(d.for_unit, d.for_priority)}: "
            "it keeps its VRAM and runs again when that unit has left"
        )
    if code is Code.THAW:
        return f"thawing {who} on {format_gpus(d.gpus)}: the units it was frozen for have left"
    if code is Code.THAWED_OUTSIDE:
        if d.cause is Cause.SUSPENDED:
            return (
                f"{who} was thawed outside gpuslice while suspended: its CUDA calls wait until "
                f"its memory is restored on {format_gpus(d.gpus)}, as soon as it fits there"
            )
        return (
            f"{who} was thawed outside gpuslice: it runs beside the units it was frozen for "
            "and is not frozen again while it runs"
        )
    if code is Code.RUNG_FAILED:
        for_whom = f" for {_who(d.for_unit, d.for_priority)}" if d.for_unit else ""
        if d.fallback:
            then = f"trying {d.fallback} instead"
        elif d.rung == "freeze":
            then = "it keeps running beside it"
        else:
            then = f"it keeps {format_gpus(d.gpus)} (Preempt= names no other way)"
        return f"cannot {d.rung} {who}{for_whom}: {d.detail}; {then}"
    if code is Code.UNACCOUNTED:
        return f"{who} is running without enough free GPUs to account for it; counting it on none"
    if d.cause is Cause.RUNS:
        return (
            f"{d.unit} is no longer annotated: it keeps {format_gpus(d.gpus)} until it ends, "
            "then gpuslice forgets it"
        )
    if d.cause is Cause.WITHDRAWN:
        kept = f"; it keeps {format_gpus(d.gpus)} until it is down" if d.gpus else ""
        return f"{d.unit} is no longer annotated: stopping the start gpuslice gave it{kept}"
    if d.cause is Cause.PREEMPTED:
        return (
            f"{d.unit} is no longer annotated: gpuslice forgets that it preempted it and will "
            "not start it again; start it yourself if its work is still wanted"
        )
    if d.cause is Cause.RESTARTED:
        return (
            f"{d.unit} is no longer annotated: its start, which waited at the gate a "
            "daemon-reload took out, is restarted unless it was stopped meanwhile (then it "
            "stays stopped); let through, it would skip its own ExecStartPre= lines"
        )
    return f"{d.unit} is no longer annotated: released its GPUs"
