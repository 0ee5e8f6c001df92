"""The scheduling rules: events in, actions out, every decision with its reason.

Each action carries its `Decision` (gpuslice/core/decisions.py): the data; its `reason` or
`message` is that decision rendered, the words the journal and status show.

The scheduler owns no I/O. Adapters tell it what systemd reported (a gate request, a unit
that became inactive, new annotations) and carry out the actions it returns (reply to the
gate, StopUnit, StartUnit, a journal line). Ordering uses a sequence counter, not a clock,
so tests are exact and restarts keep the order.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from gpuslice.core.decisions import Blocker, Cause, Code, Decision, Part, level, reason, render
from gpuslice.core.model import (
    PRIORITY_MAX,
    Gpu,
    Restart,
    Rung,
    UnitKind,
    UnitSpec,
    is_instance,
    is_template,
)
from gpuslice.core.placement import (
    Placement,
    Use,
    allowed,
    applies,
    fits,
    format_gpus,
    free_memory,
    overuse,
    place,
)


class Phase(enum.Enum):
    """Why a unit counts against capacity."""

    # placed, its gate not yet answered (gpuslice started it, or systemd announced its start
    # job): moved back to waiting, never stopped, when a more urgent unit needs its GPUs
    STARTING = "starting"
    RUNNING = "running"  # granted: its main process may run
    STOPPING = "stopping"  # gpuslice asked systemd to stop it for a more urgent unit
    # Preempt= ladder: it keeps its GPUs while its VRAM moves to host memory (cuda-checkpoint)
    SUSPENDING = "suspending"
    SUSPENDED = "suspended"  # its VRAM is in host memory, it is frozen: it holds no GPU
    RESUMING = "resuming"  # its VRAM is being restored onto its GPUs, reserved for it
    FROZEN = "frozen"  # frozen beside a more urgent unit: it keeps its VRAM, not the compute


# A holder's state in the status while its GPUs are kept for its Restart= (`restart_kept`):
# down, nothing of it runs, shown apart from a start on its way to its gate
RESTARTING = "restarting"
# A holder's states as status, STATUS= and the metrics show them, in the order they list them
HOLDER_STATES = (
    Phase.RUNNING.value,
    Phase.STARTING.value,
    RESTARTING,
    Phase.STOPPING.value,
    Phase.FROZEN.value,
    Phase.SUSPENDING.value,
    Phase.RESUMING.value,
)


def kept_for_restart_said(name: str, gpus: Iterable[int]) -> str:
    """`GPU 0 kept for u.service's restart (its Restart=)`: the journal's words and
    status's, for a unit whose GPUs are kept for its Restart= (`_keep_for_restart`)."""
    return f"{format_gpus(gpus)} kept for {name}'s restart (its Restart=)"


class Outcome(enum.Enum):
    """How a unit became inactive, as far as systemd can tell the adapter."""

    STOPPED = "stopped"  # a stop job that gpuslice did not issue (systemctl stop)
    EXITED = "exited"  # its main process ended successfully on its own
    FAILED = "failed"  # failed, crashed or could not start
    SHUTDOWN = "shutdown"  # stopped because the system is going down
    # its start was skipped: a `Condition*=` or `ExecCondition=` of its unit said no, so its
    # job never ran (systemd leaves it inactive); judged as a FAILED start, said skipped
    SKIPPED = "skipped"


# An action's decision is the data its words were rendered from; it does not take part in
# comparisons, so that `Grant(unit, gpus, "starting ...")` in a test equals what the core said.


@dataclass(frozen=True)
class Grant:
    """Let the unit's start job continue on these GPUs."""

    unit: str
    gpus: tuple[int, ...]
    reason: str
    decision: Decision | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Stop:
    """Stop the unit through systemd (its own ExecStop/KillSignal give it a graceful end)."""

    unit: str
    reason: str
    decision: Decision | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Start:
    """Start the unit through systemd; its start job then passes the gate."""

    unit: str
    reason: str
    decision: Decision | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Suspend:
    """Move the unit's VRAM to host memory and freeze it (cuda-checkpoint, FreezeUnit); the
    adapter answers with `suspended_done` or `suspend_failed`. `thaw_first`: it is frozen
    (beside a more urgent unit), and a frozen process can be neither locked nor restored.
    `thaw_owed`: gpuslice owes it a thaw (not yet seen done): found frozen, it may be frozen
    by gpuslice still, not by someone else."""

    unit: str
    gpus: tuple[int, ...]
    reason: str
    decision: Decision | None = field(default=None, compare=False)
    thaw_first: bool = False
    thaw_owed: bool = False


@dataclass(frozen=True)
class Resume:
    """Thaw the unit and restore its VRAM onto `gpus` (reserved for it); the adapter answers
    with `resumed` or `resume_failed`."""

    unit: str
    gpus: tuple[int, ...]
    reason: str
    decision: Decision | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Freeze:
    """Freeze the unit (FreezeUnit): it keeps its VRAM; `freeze_failed` if that fails.
    `thaw_owed`: gpuslice owes it a thaw (not yet seen done): found frozen, it may be frozen
    by gpuslice still, not by someone else."""

    unit: str
    reason: str
    decision: Decision | None = field(default=None, compare=False)
    thaw_owed: bool = False


@dataclass(frozen=True)
class Thaw:
    """Thaw a unit frozen beside a more urgent one (ThawUnit)."""

    unit: str
    reason: str
    decision: Decision | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Log:
    """One journal line; `decision` when it tells a decision about a unit."""

    message: str
    level: str = "info"
    decision: Decision | None = field(default=None, compare=False)


def _log(decision: Decision) -> Log:
    return Log(render(decision), level(decision), decision)


def _grant(decision: Decision) -> Grant:
    return Grant(decision.unit, decision.gpus, render(decision), decision)


def _stop(decision: Decision) -> Stop:
    return Stop(decision.unit, render(decision), decision)


def _start(decision: Decision) -> Start:
    return Start(decision.unit, render(decision), decision)


Action = Grant | Stop | Start | Log | Suspend | Resume | Freeze | Thaw

# Phases in which a unit is on its way out of a waiter's way (Holder.stopping_for names it)
GIVING_WAY = (Phase.STOPPING, Phase.SUSPENDING)
# Phases in which a unit gpuslice froze is owed a thaw (Scheduler.thaws_owed): it holds the
# unit neither frozen nor in the middle of a suspend or resume, which freeze and thaw it
_THAW_OWED_IN = (Phase.RUNNING, Phase.STOPPING)
# Preempted while it still runs: frozen, or its VRAM on its way to host memory or back. Only
# a unit that passed its gate (and has not gone down since) can be in these phases, so one
# that systemd shows at its gate again ran and ended meanwhile (Restore.started_again).
PREEMPTED_IN_PLACE = frozenset({Phase.FROZEN, Phase.SUSPENDING, Phase.SUSPENDED, Phase.RESUMING})


@dataclass
class Holder:
    spec: UnitSpec
    gpus: frozenset[int]
    phase: Phase
    seq: int
    stopping_for: str | None = None
    overdue: str = ""  # set when its stop takes longer than the stop timeout: for how long
    # when this controller answered its gate (the thrash rule); 0: it did not (adopted after
    # a restart, or running when its annotation appeared), and no request was known then
    granted: int = 0
    frozen_for: set[str] = field(default_factory=set)  # FROZEN: the units it gave way to
    # what each of its GPUs was, by UUID, when granted or resumed (its env file: what its
    # processes run on), where known: a suspend takes it along (`suspended_done`)
    uuids: dict[int, str] = field(default_factory=dict)


@dataclass
class Suspended:
    """A unit whose VRAM is in host memory: it comes back on the same GPUs (a restore puts
    its memory back at the same device addresses), most urgent first.

    `gpus` are the indices it held; `uuids` what each of them named then, where known. NVML
    numbers GPUs only in its order of enumeration, and may number them anew while the unit
    is suspended (a card gone off the bus, the driver reloaded, a controller restart): its
    processes wake on their own GPU (their environment and CUDA context name it by UUID),
    whatever index it has now (`Scheduler._where_now`)."""

    spec: UnitSpec
    gpus: frozenset[int]
    seq: int
    uuids: dict[int, str] = field(default_factory=dict)
    # someone thawed it by hand, said once: its FreezerState is read at each sample, and
    # said at each, the journal had a line (and the state file a save) every sample
    thawed: bool = False


@dataclass
class Waiter:
    spec: UnitSpec
    seq: int  # when its request became known: systemd announced its start job, or it asked
    victims: set[str] = field(default_factory=set)
    reason: str = ""
    decision: Decision | None = None  # the reason as data
    target: tuple[int, ...] = ()  # where it goes once its victims have stopped
    asked: bool = True  # its gate asked (False: only its start job is known so far)
    # The thrash rule protects from it what was granted after this (`seq` unless it lost a
    # place kept for it: `_unkept`); `seq` alone orders the queue.
    since: int = -1

    def __post_init__(self) -> None:
        if self.since < 0:
            self.since = self.seq


@dataclass(frozen=True)
class Waiting:
    """A waiter, read-only: where it goes, whom it waits for, and why (None: not told yet)."""

    target: tuple[int, ...]
    victims: tuple[str, ...]
    decision: Decision | None


@dataclass
class _PassView:
    """What a scheduling pass has seen, valid while serving waiters changes nothing: a
    waiter found blocked (no placement, even preempting) changes nothing but its own
    reason. Then every later waiter sees the same uses, and one that asks no less of the
    same GPUs and may preempt no more than a blocked one is blocked too (`_blocked_too`):
    a pass over 200 waiters of a burst costs one placement, not 200."""

    uses: dict[int, list[Use]]
    blocked: list[Waiter] = field(default_factory=list)
    # the latest grant among stoppable uses: a waiter known later than a blocked one may
    # preempt only what was granted in between (the thrash rule), and there is none before
    newest_grant: int = 0
    # per GPU: declared memory free (None: size unknown), whether a use takes it whole, and
    # what its holders use beyond their Memory=
    gpu_room: dict[int, tuple[int | None, bool, int]] = field(default_factory=dict)
    first_waiters: dict[int, Waiter] = field(default_factory=dict)
    # the GPUs a unit may ever run on, by its pins and whether it avoids foreign processes
    usable: dict[tuple[tuple[str, ...], bool], list[Gpu]] = field(default_factory=dict)


@dataclass
class Snapshot:
    """What `gpuslice status` shows; produced here so the words match the journal."""

    gpus: dict[int, list[tuple[str, int, str]]]
    waiting: list[tuple[str, int, str]]
    preempted: list[tuple[str, int, bool]]
    held: list[str]
    finished: list[str]
    failed: list[str]
    # each waiter's reason as data (keyed by unit; `waiting` gives the queue order)
    reasons: dict[str, Decision] = field(default_factory=dict)
    # suspended units, most urgent first: (unit, priority, the GPUs it comes back on)
    suspended: list[tuple[str, int, tuple[int, ...]]] = field(default_factory=list)
    # finished units systemd still shows active (RemainAfterExit=yes): they hold no GPU
    remained: list[str] = field(default_factory=list)
    # holders whose GPUs are kept for their Restart= (state RESTARTING in `gpus`): why
    restarting: dict[str, str] = field(default_factory=dict)


@dataclass
class SavedState:
    """What the controller persists: everything systemd cannot tell it after a restart."""

    # unit -> (GPUs, phase, seq, the waiter it is stopping for or "")
    holders: dict[str, tuple[tuple[int, ...], str, int, str]] = field(default_factory=dict)
    preempted: dict[str, int] = field(default_factory=dict)
    held: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    seq: int = 0
    suspended: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    frozen_for: dict[str, list[str]] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)  # STARTING holders gpuslice started
    # running or stopping holders gpuslice froze and has not yet seen thawed (thaws_owed)
    thaw_owed: list[str] = field(default_factory=list)
    # unit -> (priority, kind, GPUs, memory or None): the terms each holder (but a starting
    # one) and each suspended unit holds its GPUs on, for one whose annotation goes before
    # the next controller reads it (`_kept_terms`)
    terms: dict[str, tuple[int, str, int, int | None]] = field(default_factory=dict)
    # preempted units restarted to wait at their gate (requeue_at_gate) that have not passed
    # it: a starting holder, or a waiter (which is not saved). Lost at a restart, one whose
    # wait failed then was recorded failed, its preemption forgotten: never brought back
    requeued: list[str] = field(default_factory=list)
    # preempted units whose wait at the gate failed: brought back only onto free GPUs
    wait_failed: list[str] = field(default_factory=list)
    # background instances the host's shutdown stopped (Scheduler.stopped_by_shutdown): lost
    # at a restart after its cancel (gpuslice.service stopped with them), the next
    # controller learnt them dormant, or not at all, and never refilled them
    stopped_by_shutdown: list[str] = field(default_factory=list)
    # those of `started` that are refills (Scheduler.refills), not comebacks: lost, a refill
    # whose unit turned on-demand since was taken for a comeback by its kind
    refills: list[str] = field(default_factory=list)
    # suspended unit -> (the PIDs its suspend checkpointed, the bytes it moved, when: Unix
    # time): the ladder's (gpuslice.ladder.Suspension), never the core's, which leaves it
    # empty. Lost at a restart, the resume asked the tool the state of every process of the
    # unit, and one of more than MAX_RECOVERED_PIDS processes was stopped, its work lost
    checkpointed: dict[str, tuple[tuple[int, ...], int, float]] = field(default_factory=dict)
    # finished units systemd keeps active (RemainAfterExit=yes), their GPUs released
    # (Scheduler.remained): lost, the next controller adopted each as holding GPUs again
    remained: list[str] = field(default_factory=list)


def _unannotated(spec: UnitSpec) -> UnitSpec:
    """The terms a unit whose annotation went holds its GPUs on until it ends: those it was
    granted them on (its priority, its memory, its kind), but it gives way only by a stop
    (frozen or suspended, nobody's annotation would bring it back) and is not brought back
    after one."""
    return replace(spec, preempt=(Rung.STOP,), requeue=False)


def _terms(spec: UnitSpec) -> tuple[int, str, int, int | None]:
    """What `SavedState.terms` keeps of a spec: what an unannotated holder is judged by."""
    return (spec.priority, spec.kind.value, spec.gpus, spec.memory)


def _kept_terms(name: str, saved: SavedState) -> UnitSpec:
    """After a controller restart, the terms of a unit whose annotation went: those the last
    controller held it on, so that it is preempted for no request it would not have been
    preempted for before. A file of a controller before `terms` has none: then the least
    urgent, whole GPUs (its GPUs are its holder's; a spec's count is read only to place a
    unit, which it never is again)."""
    kept = saved.terms.get(name)
    if kept is None:
        return _unannotated(UnitSpec(name, PRIORITY_MAX))
    priority, kind, gpus, memory = kept
    return _unannotated(UnitSpec(name, priority, UnitKind(kind), gpus, memory=memory))


def _saved_refills(saved: SavedState) -> set[str]:
    """The starts of ours `saved` holds that are refills (`Scheduler.refills`), not
    comebacks. A file of a controller before `refills` has none, but its
    `stopped_by_shutdown` keeps the name of an instance whose refill is under way: a start
    of ours of an instance the shutdown stopped was its cancel's refill (a comeback's unit
    was preempted since, and no longer kept so: `inactive`)."""
    return {*saved.refills, *saved.stopped_by_shutdown}


def _seq(waiter: Waiter) -> int:
    return waiter.seq


def _memory_rungs(spec: UnitSpec, *, suspend_failed: bool) -> list[Rung]:
    """The rungs of its ladder that free VRAM (freeze keeps it), in its order; without
    suspend once a suspend of it failed while it runs."""
    return [
        r
        for r in spec.preempt
        if r is not Rung.FREEZE and not (suspend_failed and r is Rung.SUSPEND)
    ]


def _asks_no_less_memory(spec: UnitSpec, than: UnitSpec) -> bool:
    """A GPU whole (no `Memory=`) is no more and no less than a size: it fits an empty GPU
    too small for the size, and a size fits beside other units where it does not."""
    if spec.memory is None or than.memory is None:
        return spec.memory is than.memory
    return spec.memory >= than.memory


def _no_better_placed(spec: UnitSpec, than: UnitSpec) -> bool:
    """Whether a background unit tried after `than` (so no more urgent: no fewer places
    kept from it) fits no better on free capacity: the same GPUs allowed (pins; background
    units all avoid foreign processes alike), no fewer GPUs and no less memory asked."""
    return (
        spec.devices == than.devices and spec.gpus >= than.gpus and _asks_no_less_memory(spec, than)
    )


def _refillable(spec: UnitSpec) -> bool:
    """A background unit that is not a template: refill may start it."""
    return spec.kind is UnitKind.BACKGROUND and not is_template(spec.name)


def _owed_its_start(spec: UnitSpec) -> bool:
    """Whether a start of ours of this unit that did not happen (the host's end cut it
    short, or it did not reach systemd) is owed: refill starts a plain background unit
    anyway, never an instance, which is forgotten at its down and, learnt again, dormant
    (`Scheduler.dormant`)."""
    return spec.kind is UnitKind.ON_DEMAND or is_instance(spec.name)


def _about(spec: UnitSpec, code: Code, **parts: Any) -> Decision:
    """A decision about the unit of this spec, with what it asks for."""
    return Decision(
        code,
        spec.name,
        spec.priority,
        need_gpus=spec.gpus,
        need_memory=spec.memory,
        **parts,
    )


class Scheduler:
    """The whole scheduling state of one host, and the rules that change it."""

    def __init__(
        self,
        gpus: Iterable[int | Gpu],
        specs: Mapping[str, UnitSpec],
        *,
        yield_to_foreign: bool = True,
        requeue_at_gate: bool = False,
    ) -> None:
        self.devices: dict[int, Gpu] = {}
        for gpu in gpus:
            device = gpu if isinstance(gpu, Gpu) else Gpu(gpu)
            self.devices[device.index] = device
        self.yield_to_foreign = yield_to_foreign
        # config.yaml's requeue_at_gate: a preempted unit whose GPUs are taken is restarted
        # at once and waits at its gate, instead of being restarted once they are free
        self.requeue_at_gate = requeue_at_gate
        self.specs: dict[str, UnitSpec] = {}
        # annotated unit -> seq when it last went inactive: refill starts the longest out first
        self.out_since: dict[str, int] = {}
        # the background units refill may start: kept apart so that a decision costs the
        # same at 10,000 annotated units as at 10 (refill runs after every event)
        self._background: dict[str, UnitSpec] = {}
        # instances known with no start of them seen (learnt from a signal, listed at
        # start-up, or learnt again once forgotten, `forget_instance`): refill starts no
        # background one of them until someone starts it. An instance's name is one job:
        # started by refill, a finished one, forgotten and learnt again, ran again
        self.dormant: set[str] = set()
        # background instances the host's shutdown stopped, owed nothing (no comeback, no
        # record): kept, not forgotten (`forget_instance`), until they go down again, so that
        # a cancelled shutdown's refill starts them again as it does a plain background unit
        self.stopped_by_shutdown: set[str] = set()
        self._set_specs(specs)
        self.holders: dict[str, Holder] = {}
        self.waiters: dict[str, Waiter] = {}
        self.preempted: dict[str, int] = {}  # unit -> seq when it was preempted
        # restarted after a preemption while its GPUs were still taken (it waits at its gate,
        # so its refill costs one grant, not a start): until it is inactive again
        self.requeued: set[str] = set()
        # their wait at the gate failed (a TimeoutStartSec= of the admin's): brought back
        # only when their GPUs are free, until they start again
        self.wait_failed: set[str] = set()
        # started by gpuslice (refill, requeue), their gates not yet asking: saved, so that a
        # restarted controller can tell a StartUnit it may never have sent (start_lost)
        self.started: set[str] = set()
        # those of them that are refills (`_refill`), not comebacks: a refill's start that does
        # not happen (cut short by the host going down, or not reaching systemd) is owed
        # nothing but refill's, whatever the unit's kind by then. Told by its kind, a refill of
        # a unit (or of its template's instance) that a daemon-reload turned on-demand
        # meanwhile ended as a comeback's, and gpuslice started again a unit it no longer
        # starts; an instance the shutdown stopped (`stopped_by_shutdown`), refilled by the
        # cancel, went preempted: with `Requeue=no` never started again, with `Requeue=yes`
        # brought back preempting, which no refill does
        self.refills: set[str] = set()
        # lost starts sent again by this controller, once each (start_lost: at start-up, so
        # no more than the starts the last controller saved)
        self._sent_again: set[str] = set()
        # units a start of ours failed to reach systemd for (`start_failed`), until a start
        # of them goes through: True while no start of them is sent again (the adapter's
        # delay, `retry_start`); the journal said so once. Not saved: a restarted controller
        # may start them at once
        self.start_retries: dict[str, bool] = {}
        self.suspended: dict[str, Suspended] = {}
        self.held: set[str] = set()
        # holds booked while the host was taken to run, not yet confirmed by systemd's
        # SystemState, each with whether the shutdown's end of it is owed a comeback: a
        # shutdown whose JobNew the bus lost makes its stops someone's (`holds_of_shutdown`)
        self.unconfirmed_holds: dict[str, bool] = {}
        # preempted units systemd stopped with a victim they need (`stopped_with`), each with
        # that victim: not brought back while its stop is under way, which their start,
        # pulling its start along, would cancel
        self.stopped_along: dict[str, str] = {}
        # units held while stops of gpuslice's were under way, each with those victims, until
        # systemd says whether they were stopped with one (`hold_in_doubt`)
        self.in_doubt: dict[str, frozenset[str]] = {}
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        # units that ended running and that their Restart= starts again (or may: its
        # signal not seen yet, `inactive`), their GPUs kept for that start
        # (`_keep_for_restart`) until it asks or `restart_overdue`, each with how it ended
        # (EXITED or FAILED: recorded so if released). Not saved: a restarted controller
        # releases them (`Restore.rebuild`: down, failed)
        self.restart_kept: dict[str, Outcome] = {}
        # finished units systemd keeps active (RemainAfterExit=yes, SubState `exited`): their
        # GPUs are released (`exited`), and they are no holder until they run again
        self.remained: set[str] = set()
        # units whose stop systemd refused: never chosen as victims again while they run
        self.unstoppable: set[str] = set()
        # of those, the ones refused only while a start was queued that their stop would
        # have cancelled (`stop_failed`, `while_waits`): each with the waiter it was sent for
        self.unstoppable_while: dict[str, str] = {}
        # of those, the ones refused only for jobs under way (the unit's own start, the jobs
        # of units that need it), with those units: stoppable again once one ends
        # (`jobs_ended`), as they then would be. Held for the waiter's whole wait, an urgent
        # start waited for a background unit's whole run
        self.held_for_jobs: dict[str, tuple[str, ...]] = {}
        self.unfreezable: set[str] = set()  # units whose freeze failed: not tried again
        self.unsuspendable: set[str] = set()  # units whose suspend failed: the next rung
        # units gpuslice froze, or may have left frozen (a freeze, suspend or resume that
        # failed half way), that it now holds running or stopping: owed a thaw until systemd
        # shows them running (`thaws_owed`, `thaw_done`); saved, so that a controller killed
        # before its ThawUnit left leaves the next one to send it
        self.thaw_owed: set[str] = set()
        # Why background units must not start now (the GPUs are a guess: NVML is not ready
        # yet); empty: they may. Refill, requeue and background waiters honour it.
        self.refill_paused = ""
        # the host is going down (systemd queued its shutdown): no comeback and no refill is
        # started, as systemd refuses every start then (`set_shutting_down`)
        self.shutting_down = False
        self._deferred = 0
        self._seq = 0
        self._tops_cache: dict[int, Holder] | None = None
        self._displaced: list[Waiter] = []  # moved back to waiting during a pass
        # comebacks started to preempt (no GPUs held: their gate's request preempts): the
        # GPUs they were placed on, kept from less urgent waiters until that gate asks
        self._comeback_room: dict[str, tuple[int, ...]] = {}
        self._view: _PassView | None = None  # read only while a pass serves its waiters

    @property
    def gpus(self) -> frozenset[int]:
        return frozenset(self.devices)

    # -- events ---------------------------------------------------------------------------

    def set_gpus(self, gpus: Iterable[Gpu]) -> list[Action]:
        """A new view of the GPUs (an NVML sample, a config reload): sizes, foreign use,
        lost GPUs. Holders keep their GPUs; what no longer fits is not stopped for it."""
        before = self.devices
        self.devices = {g.index: g for g in gpus}
        actions: list[Action] = []
        for index, gpu in sorted(self.devices.items()):
            if gpu.lost and not (index in before and before[index].lost):
                held = sorted(n for n, h in self.holders.items() if index in h.gpus)
                actions.append(_log(Decision(Code.LOST_GPU, gpus=(index,), units=tuple(held))))
        return actions + self.schedule()

    def announce(self, spec: UnitSpec) -> list[Action]:
        """Systemd queued a start job for the unit: its gate will ask soon. Known from now
        on, it is served in priority order with every other start known, so that no less
        urgent unit is granted GPUs that it would take a moment later; a place found before
        its gate asks is kept for it (Phase.STARTING) and given when it asks."""
        if spec.name in self.holders or spec.name in self.waiters:
            return []  # our own start, or a start job for a unit that already runs
        self._forget_past(spec)
        return self._arrive(spec, asked=False)

    def request(self, spec: UnitSpec) -> list[Action]:
        """A unit's start job reached the gate and asks for its GPUs."""
        name = spec.name
        self._forget_past(spec)
        holder = self.holders.get(name)
        if holder is not None and holder.phase not in (Phase.RUNNING, Phase.STARTING):
            return []  # its start is being cancelled by our own stop job (or it runs)
        if holder is not None:
            if holder.phase is Phase.RUNNING and holder.gpus and not self._lost(holder.gpus):
                return [self._grant(holder)]  # asked again (after a controller restart)
            # asked again on a GPU lost since: a GPU that stopped answering, or an index NVML
            # numbered anew while the controller was away, whose GPU now is one another
            # unit runs on (told by UUID). Granted again, its env file named that GPU and
            # two jobs shared it; its processes have not started: it waits like any start
            # not while the host goes down: it waits like any start (`schedule`)
            if (
                holder.phase is Phase.STARTING
                and holder.gpus
                and not self.shutting_down
                and self._keeps_its_place(holder)
            ):
                holder.seq = holder.granted = self._next()  # the thrash rule counts from here
                holder.phase = Phase.RUNNING
                # a unit it freezes may have frozen others, which then run again (as at the
                # end of a pass): left frozen, they waited for the next event of any kind
                freezes = self._freeze_beside(spec, holder.gpus)
                return [self._grant(holder), *freezes, *self._thaw()]
            del self.holders[name]
            if holder.phase is Phase.STARTING:
                # A requeue that must preempt, GPUs lost or filled meanwhile, or a more
                # urgent start seen since its place was kept (and not yet decided on: the
                # controller decides once per turn of its loop): it queues from when it was
                # started, with every start known, and is granted from a pass.
                self.waiters[name] = self._unkept(holder, asked=True)
                if self._comeback_room.pop(name, None) is not None:
                    # a comeback started to preempt lost no place: known since its start, it
                    # does not stop what was granted after that (`_comebacks_room`)
                    self.waiters[name].since = holder.seq
                return self.schedule()
        waiter = self.waiters.get(name)
        if waiter is not None:
            waiter.asked = True
            return self.schedule()
        return self._arrive(spec, asked=True)

    def _forget_past(self, spec: UnitSpec) -> None:
        """A new start: how the unit last ended no longer matters."""
        name = spec.name
        self.learn(spec)
        self.dormant.discard(name)  # someone started it
        self.held.discard(name)
        self.unconfirmed_holds.pop(name, None)
        self.finished.discard(name)
        self.failed.discard(name)
        self.remained.discard(name)
        self.wait_failed.discard(name)
        self.preempted.pop(name, None)
        # and what it was preempted with: kept, its next preemption waited for that
        # victim's stop, or was taken for a hold of it (`_requeue`) and never came back
        self.stopped_along.pop(name, None)
        self.start_retries.pop(name, None)
        self.restart_kept.pop(name, None)  # its restart asks: no longer owed a release

    def _arrive(self, spec: UnitSpec, *, asked: bool) -> list[Action]:
        self.waiters[spec.name] = Waiter(spec, self._next(), asked=asked)
        actions = self.schedule()
        if spec.gpus > len(self.gpus):
            too_big = _about(spec, Code.EXCEEDS_HOST, available=len(self.gpus))
            return [_log(too_big), *actions]
        return actions

    def _keeps_its_place(self, holder: Holder) -> bool:
        """Whether a unit whose place was kept gets it when its gate asks: no more urgent
        start is known, and its GPUs still take it next to everyone else: as many as it asks
        for now (a reload may have changed its GPUs= since its place was kept)."""
        if any(w.spec.priority < holder.spec.priority for w in self.waiters.values()):
            return False
        spec = holder.spec
        if len(holder.gpus) != spec.gpus:
            return False
        # a priority edited since it was placed; a comeback started to preempt since
        uses = self._uses(self._suspended_room() + self._comebacks_room())
        avoid = self._avoids_foreign(spec)
        for index in holder.gpus:
            gpu = self.devices.get(index)
            others = [
                u for u in uses.get(index, []) if u.unit != spec.name and applies(u, spec.priority)
            ]
            if gpu is None or not allowed(spec, gpu, avoid) or not fits(spec, gpu, others):
                return False
        return True

    def inactive(
        self,
        name: str,
        outcome: Outcome,
        *,
        by_itself: bool = False,
        not_ours: bool = False,
        in_shutdown: bool = False,
        restarting: bool = False,
    ) -> list[Action]:
        """The unit is inactive or failed (or its waiting start job was cancelled).

        `by_itself`: it ended with no stop of anyone's (its main process exited), though we
        may have been stopping it: its work is done (or failed) and is not owed a comeback;
        restarting it would run a finished job again. `not_ours`: a stop of ours was sent
        but another's ended it (it was down before ours reached systemd, or ours merged into
        theirs): stopped by someone, it is held as they wanted, not brought back.
        `in_shutdown`: it went down while the host went down, told after the shutdown's
        cancel: a failure then is judged as in the shutdown (recorded failed, a preempted
        unit's comeback was lost, and a background unit was never refilled). One that
        finished and stayed active (`exited`) ended by itself: its down now is no hold, no
        failure and no preemption, and releases nothing more. `restarting`: it ended and
        systemd's Restart= starts it again (`activating (auto-restart)`, or systemd 254's
        `*-before-auto-restart` just before): its GPUs are kept for that start
        (`_keep_for_restart`). One that failed running by itself with no restart seen yet
        keeps them too, for the controller's short wait: systemd 252 signals `failed` before
        `auto-restart`, and its restart is only known a signal later (`restart_overdue`
        releases them, recorded failed; the FAILED said now claims no restart). A clean exit
        (EXITED) is kept so where its Restart= restarts one (`always`, `on-success`), said
        finished and kept at once (its file says the restart comes), recorded finished if
        released; with any other Restart= its GPUs go at once. A bare `auto-restart`
        (RestartMode=direct) is told FAILED: under `on-success` it was a clean exit (under
        `always` the controller reads its Result= first: gpuslice/restartresult.py). Kept
        so, one seen down with no stop (`systemctl reset-failed`: inactive) ended no new
        run: it is recorded as the wait's end has it."""
        skipped = outcome is Outcome.SKIPPED
        if skipped:
            outcome = Outcome.FAILED  # a start that ran nothing, as one a dependency failed
        if name in self.restart_kept and outcome is Outcome.EXITED and not by_itself:
            return self.restart_overdue(name)
        self.restart_kept.pop(name, None)
        known = self.specs.get(name)
        restart = Restart.NO if known is None else known.restart
        if restarting and outcome is Outcome.FAILED and restart is Restart.ON_SUCCESS:
            outcome = Outcome.EXITED  # only a clean exit is restarted
        ended_itself = by_itself and not not_ours and not in_shutdown
        may_restart = ended_itself and (
            outcome is Outcome.FAILED
            or (outcome is Outcome.EXITED and restart.restarts_clean_exit())
        )
        if (
            (restarting or may_restart)
            and outcome in (Outcome.EXITED, Outcome.FAILED)
            and name not in self.remained
            and self._keep_for_restart(name, outcome)
        ):
            kept = self.holders[name]
            gpus = tuple(sorted(kept.gpus))
            if outcome is Outcome.EXITED:
                said = _about(kept.spec, Code.FINISHED, gpus=gpus, cause=Cause.RESTARTS)
            else:
                said = _about(kept.spec, Code.FAILED, gpus=gpus if restarting else ())
            return [_log(said), *self.schedule()]
        if name in self.remained:
            self.remained.discard(name)
            if name not in self.holders:
                return self.schedule()  # released at its exit, recorded finished then
            by_itself = True  # exited while our stop was on its way: its work is done
        actions: list[Action] = []
        self.out_since[name] = self._next()
        self.unstoppable.discard(name)
        self.unstoppable_while.pop(name, None)
        self.held_for_jobs.pop(name, None)
        self.unfreezable.discard(name)
        self.unsuspendable.discard(name)
        self.stopped_by_shutdown.discard(name)  # said of a down before
        self.thaw_owed.discard(name)  # systemd thaws a unit before it stops it
        self.start_retries.pop(name, None)
        waiter = self.waiters.pop(name, None)
        holder = self.holders.pop(name, None)
        requeued = name in self.requeued
        self.requeued.discard(name)
        # a start of ours (a refill, a comeback) whose gate was not answered yet
        ours = name in self.started and (holder is None or holder.phase is Phase.STARTING)
        refill = ours and name in self.refills
        self.started.discard(name)
        self.refills.discard(name)
        # a suspended unit stopped by hand (systemd thaws it first) is held like any other;
        # frozen, it cannot have ended by itself
        suspended = self.suspended.pop(name, None) is not None
        if suspended and outcome is Outcome.EXITED:
            outcome = Outcome.STOPPED
        # preempted (frozen, suspended, or being suspended or resumed), or its comeback
        # under way: owed a comeback should the shutdown end it. A refill is no comeback (an
        # instance the shutdown stopped is kept for refill again, below)
        start_owed = (
            ours and not refill and name in self.specs and _owed_its_start(self.specs[name])
        )
        owed = (
            suspended or (holder is not None and holder.phase in PREEMPTED_IN_PLACE) or start_owed
        )
        # a background unit that ran, or a start of ours (a refill, a comeback) under way:
        # not by itself, the shutdown's stop ended it. An on-demand one that ran is failed as
        # before: nothing of gpuslice's starts it again, so no refill is lost
        known = self.specs.get(name)
        ran = (
            holder is not None
            and holder.phase is Phase.RUNNING
            and known is not None
            and known.kind is UnitKind.BACKGROUND
        )
        if (
            outcome is Outcome.FAILED
            and (self.shutting_down or in_shutdown)
            and (owed or ours or ran)
            and not by_itself
        ):
            # the shutdown's SIGTERM ended it and its main process exited non-zero (143, or 1
            # from its own handler), which systemd records as failed: its work went with the
            # boot all the same. Recorded failed, a new boot cleared a preempted unit and it
            # was lost, and a cancelled shutdown left a background unit down for good, where
            # it refills one that exited 0 on the SIGTERM (an instance: `stopped_by_shutdown`)
            outcome = Outcome.SHUTDOWN
        if waiter is not None and holder is None:
            actions.append(_log(_about(waiter.spec, Code.CANCELLED)))
        theirs = not_ours and outcome is Outcome.STOPPED
        if holder is not None and holder.phase is Phase.STOPPING and not by_itself and not theirs:
            spec = self.specs.get(name, holder.spec)
            self.preempted[name] = self.out_since[name]
            withdrawn = name not in self.specs and holder.stopping_for is None
            if not spec.requeue and not withdrawn:
                actions.append(_log(_about(spec, Code.NOT_REQUEUED)))
        elif outcome is Outcome.SHUTDOWN and not by_itself and owed:
            # its work is lost with the boot, as a stopped unit's, and it comes back after it
            # (Requeue=); told ended by the shutdown, it was never started again
            self.preempted[name] = self.out_since[name]
        elif outcome is Outcome.STOPPED:
            self.held.add(name)
            self.unconfirmed_holds[name] = owed or (
                holder is not None and holder.phase is Phase.STOPPING
            )
            self.preempted.pop(name, None)
            actions.append(_log(self._about_name(name, Code.HOLD)))
        elif (
            outcome is Outcome.FAILED
            and requeued
            and not skipped  # started again, skipped again while its condition is false
            and (holder is None or holder.phase is Phase.STARTING)
        ):
            # it never ran: its wait failed, not its work (nothing else fails at the gate)
            self.preempted[name] = self.out_since[name]
            self.wait_failed.add(name)
            actions.append(_log(self._about_name(name, Code.REQUEUE_FAILED)))
        elif outcome is Outcome.FAILED:
            self.failed.add(name)
            said = self._about_name(name, Code.FAILED)
            if skipped:
                said = replace(said, cause=Cause.SKIPPED)
            actions.append(_log(said))
        elif outcome is Outcome.EXITED and holder is not None:
            self.finished.add(name)
            gpus = tuple(sorted(holder.gpus))
            actions.append(_log(_about(holder.spec, Code.FINISHED, gpus=gpus)))
        if holder is not None and outcome is Outcome.SHUTDOWN:
            gpus = tuple(sorted(holder.gpus))
            actions.append(_log(_about(holder.spec, Code.SHUTDOWN, gpus=gpus)))
        if (
            outcome is Outcome.SHUTDOWN
            and not by_itself
            and name not in self.preempted
            and self._kept_for_refill(name)
        ):
            # forgotten at its down, a cancelled shutdown left it down for good, where refill
            # starts a plain background unit again; the host gone, the next controller learns
            # it dormant, as any instance
            self.stopped_by_shutdown.add(name)
        if name not in self.specs:
            self._forget_end(name)
        return actions + self.schedule()

    def _keep_for_restart(self, name: str, outcome: Outcome) -> bool:
        """A unit that ran on GPUs granted or adopted ended (`outcome`: failed, or a clean
        exit its Restart= restarts), and its Restart= starts it
        again in RestartSec= (100 ms by default): its GPUs are kept for that start, as for
        any start known before its gate asks (Phase.STARTING, not one of ours). Released,
        they went to a less urgent waiter or refill, stopped again (or moved back to
        waiting) a moment later by the restart, at every crash of a unit that crash-loops:
        each time a model loaded for nothing. A more urgent start still takes them (the
        restart then waits at its gate); its start limit reached (`failed`), a stop, or no
        restart within the controller's bound (`restart_overdue`) releases them. Only less
        urgent units wait for it: one as urgent that waits came before the restart, which is
        a new arrival (kept, its GPUs went to the restart whenever it crash-looped)."""
        holder = self.holders.get(name)
        if (
            holder is None
            or holder.phase is not Phase.RUNNING
            or not holder.gpus
            or name not in self.specs
            or self.shutting_down
            or self._lost(holder.gpus)
            or any(w.spec.priority <= self.specs[name].priority for w in self.waiters.values())
        ):
            return False
        holder.phase = Phase.STARTING
        holder.granted = 0
        self.restart_kept[name] = outcome
        # the restart is systemd's: a refill's or comeback's record left from its run (inert
        # while it ran) made it a start of ours again, never released by `restart_overdue`,
        # or (a requeue at its gate) one whose wait is owed a comeback and a stop
        self.started.discard(name)
        self.refills.discard(name)
        self.requeued.discard(name)
        self.out_since[name] = self._next()
        self.unstoppable.discard(name)
        self.unstoppable_while.pop(name, None)
        self.held_for_jobs.pop(name, None)
        self.unfreezable.discard(name)
        self.unsuspendable.discard(name)
        self.thaw_owed.discard(name)
        self._tops_cache = None
        return True

    def restart_keeps(self) -> dict[str, str]:
        """The holders whose GPUs are kept for their Restart= (`_keep_for_restart`), each
        with why: nothing of them runs, and shown starting, they passed for a start on its
        way to its gate (one its place was taken from waits, and says why there)."""
        return {
            name: kept_for_restart_said(name, sorted(holder.gpus))
            for name in sorted(self.restart_kept)
            if (holder := self.holders.get(name)) is not None and holder.phase is Phase.STARTING
        }

    def restart_overdue(self, name: str) -> list[Action]:
        """The unit whose GPUs were kept for its Restart= (`_keep_for_restart`) has not
        asked at its gate within the controller's bound (a long RestartSec=): they go to the
        units waiting for them; it is failed, as any unit that fails, and its restart, when
        it comes, waits at its gate as any start (finished, if it was a clean exit)."""
        outcome = self.restart_kept.pop(name, None)
        if outcome is None:
            return []
        holder = self.holders.get(name)
        waiter = self.waiters.get(name)
        if holder is not None and holder.phase is Phase.STARTING and name not in self.started:
            del self.holders[name]
        elif waiter is not None and not waiter.asked:
            del self.waiters[name]  # its kept place taken by a more urgent start
        else:
            return []
        (self.finished if outcome is Outcome.EXITED else self.failed).add(name)
        return self.schedule()

    def _kept_for_refill(self, name: str) -> bool:
        """A background instance: one the host's shutdown stopped is kept, not forgotten
        (`stopped_by_shutdown`), so that a cancelled shutdown's refill starts it again."""
        known = self.specs.get(name)
        return known is not None and known.kind is UnitKind.BACKGROUND and is_instance(name)

    def _forget_end(self, name: str) -> None:
        """How a unit no longer annotated ended is not kept: it is forgotten like any
        unannotated unit, whether it ends unannotated (`inactive`) or was down when its
        annotation went (`_forget_unannotated`). Kept, its preemption would bring it back
        once it is annotated again, maybe days later, a hold or end would keep it from a
        refill then, and status would show it for ever."""
        self.preempted.pop(name, None)
        self.wait_failed.discard(name)  # a note on its preemption
        self.stopped_along.pop(name, None)
        self.in_doubt.pop(name, None)
        self.held.discard(name)
        self.unconfirmed_holds.pop(name, None)
        self.finished.discard(name)
        self.failed.discard(name)
        self.remained.discard(name)
        self.out_since.pop(name, None)
        self.stopped_by_shutdown.discard(name)

    def recorded(self) -> frozenset[str]:
        """The units down with a record of how they went: preempted, held, finished, failed."""
        return frozenset(self.preempted.keys() | self.held | self.finished | self.failed)

    def _forget_unannotated(self, was: Mapping[str, UnitSpec]) -> list[Action]:
        """The records of units whose annotation went while they were down (or while no
        controller ran: `load`) are forgotten (`_forget_end`): gpuslice manages only
        annotated units. Kept, a preempted unit was shown preempted for ever and never
        brought back, its comeback kept the GPUs sampled, and annotated again it was
        restarted by itself, maybe days later. Its preemption forgotten is said once, in its
        journal and the controller's (`was`: its annotation before, where known): work
        gpuslice stopped is not dropped without a word. A hold, an end or a failure goes
        silently: nothing was owed."""
        actions: list[Action] = []
        # one the shutdown stopped too: kept, it was saved, and kept from `forget_instance`
        for name in sorted((self.recorded() | self.stopped_by_shutdown) - self.specs.keys()):
            if name in self.preempted:
                spec = was.get(name)
                forgotten = (
                    _about(spec, Code.UNMANAGED, cause=Cause.PREEMPTED)
                    if spec is not None
                    else Decision(Code.UNMANAGED, name, cause=Cause.PREEMPTED)
                )
                actions.append(_log(forgotten))
            self._forget_end(name)
        return actions

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
        self.dormant.discard(name)  # someone started it
        # finished and kept active (`exited`), it is shown starting again (a restart whose
        # down went unheard): a new run, it holds again (a reload is none: Tracker)
        self.remained.discard(name)
        holder = self.holders.get(name)
        told = frozenset(gpus or ())
        if holder is not None and holder.phase is Phase.STARTING and holder.gpus:
            if not told or told == holder.gpus:
                holder.phase = Phase.RUNNING
                return self.schedule()
            # granted elsewhere than the place kept (moved back to waiting, then granted by
            # a pass, and the last controller killed before it saved that): where it runs
        elif holder is not None and (holder.gpus or holder.phase is Phase.STOPPING):
            return []  # known (a suspended unit being stopped holds no GPU)
        self.holders.pop(name, None)
        self.waiters.pop(name, None)
        wanted = told & self.gpus
        uses = self._uses([])
        if len(wanted) != spec.gpus or not all(
            fits(spec, self.devices[g], uses[g]) for g in wanted
        ):
            # a guess, by index: its own processes, not yet booked, count as foreign memory
            # on the GPU it runs on, and shunned, it was booked on another, which a grant
            # then gave to a second job beside it
            found = self._place(spec, [], preempt=False, shun_foreign=False)
            wanted = frozenset(found.gpus) if found is not None else frozenset()
        actions: list[Action] = []
        if len(wanted) < spec.gpus:
            actions.append(_log(_about(spec, Code.UNACCOUNTED)))
        phase = Phase.STOPPING if stopping else Phase.RUNNING
        self.holders[name] = Holder(spec, wanted, phase, self._next())
        return actions + self.schedule()

    def exited(self, name: str) -> list[Action]:
        """Systemd keeps the unit active after its main process ended (`RemainAfterExit=yes`,
        SubState `exited`), and no process is left in it: its work is done, and its GPUs go
        to the units waiting for them now, as at its end (kept until someone stopped it, they
        waited for ever). Said once and recorded finished; `remained` from then on: no holder
        while systemd shows it active, not refilled (it is finished), and its later down (a
        stop, or a restart, whose start passes its gate as any) releases nothing more. Being
        stopped by us, it keeps its GPUs until that stop, soon, ends it: its down is then its
        own end (finished, owed no comeback that would run its finished work again). A unit
        found so with nothing known of it (a state file lost) holds nothing from now on."""
        holder = self.holders.get(name)
        if name not in self.specs or name in self.remained:
            return []
        if holder is None:
            if name not in self.waiters and name not in self.suspended:
                self._remain(name)
            return []
        if holder.phase is Phase.STOPPING:
            self._remain(name)
            return []
        if holder.phase not in (Phase.RUNNING, Phase.STARTING):
            return []  # frozen (its processes cannot end) or moving its VRAM: runs still
        del self.holders[name]
        self._remain(name)
        self.finished.add(name)
        self.out_since[name] = self._next()
        self.unstoppable.discard(name)
        self.unstoppable_while.pop(name, None)
        self.held_for_jobs.pop(name, None)
        self.unfreezable.discard(name)
        self.unsuspendable.discard(name)
        self.thaw_owed.discard(name)  # it ran to its end: thawed
        self.stopped_by_shutdown.discard(name)  # and its refill came: its down owes none
        self.started.discard(name)
        self.refills.discard(name)
        self.requeued.discard(name)
        gpus = tuple(sorted(holder.gpus))
        done = _about(holder.spec, Code.FINISHED, gpus=gpus, cause=Cause.REMAINS)
        return [_log(done), *self.schedule()]

    def _remain(self, name: str) -> None:
        """Released while systemd keeps it active (`exited`): its work is done, so it is owed
        no comeback (one started was a no-op to systemd, the unit active: its holder stayed
        starting, and its waiter waited, for ever)."""
        self.remained.add(name)
        self.preempted.pop(name, None)
        self.wait_failed.discard(name)

    def stop_failed(
        self,
        name: str,
        why: str,
        *,
        refused: bool,
        while_waits: bool = False,
        jobs: tuple[str, ...] = (),
    ) -> list[Action]:
        """A stop gpuslice asked for did not happen (refused, failed, cancelled, or lost in a
        controller restart): the unit holds its GPUs again and its waiter plans anew. A unit
        whose stop systemd `refused` is not chosen as a victim again while it runs, so that
        the waiter does not ask for the same refused stop forever; `while_waits`: refused
        for a job of another unit's that the stop would have cancelled (the waiter's own
        start, which needs the unit), only until that waiter waits no more. Kept for as
        long as the victim ran, a unit once needed by a start was never preempted again,
        for anyone. `jobs`: refused only for the jobs of these units under way (its own
        start, the starts of units that need it), until one ends (`jobs_ended`); given only
        with `refused`."""
        holder = self.holders.get(name)
        if holder is None or holder.phase is not Phase.STOPPING:
            return []
        waiter = self.waiters.get(holder.stopping_for or "")
        holder.phase = Phase.RUNNING
        holder.stopping_for = None
        holder.overdue = ""
        if waiter is not None:
            waiter.target = ()
        if refused:
            self.unstoppable.add(name)
            if while_waits and waiter is not None:
                self.unstoppable_while[name] = waiter.spec.name
            else:
                self.unstoppable_while.pop(name, None)
            self.held_for_jobs.pop(name, None)
            if jobs:
                self.held_for_jobs[name] = jobs
        if name in self.remained:  # it exited while our stop was on its way: released now
            self.remained.discard(name)
            return self.exited(name)
        decision = _about(
            holder.spec,
            Code.STOP_REFUSED if refused else Code.STOP_FAILED,
            cause=Cause.NEEDED if name in self.unstoppable_while or jobs else None,
            for_unit=waiter.spec.name if waiter is not None else "",
            for_priority=waiter.spec.priority if waiter is not None else None,
            gpus=tuple(sorted(holder.gpus)),
            units=jobs,
            detail=why,
        )
        return [_log(decision), *self.schedule()]

    def jobs_ended(self, name: str) -> list[Action]:
        """A job that a refusal of the unit's stop was held for ended (`stop_failed`,
        `jobs`): the refusal no longer stands, so the unit may be chosen as a victim again
        and its waiter's preemption is decided anew. Refused again, it holds again; [] where
        no such refusal holds (told twice, or its unit stopped or refused since for a
        waiter that needs it)."""
        if self.held_for_jobs.pop(name, None) is None:
            return []
        self.unstoppable.discard(name)
        self.unstoppable_while.pop(name, None)
        return self.schedule()

    def start_lost(self, name: str) -> list[Action]:
        """After a controller restart: a unit gpuslice had started (refill or requeue) shows
        no start job and is inactive. The last controller saves its decisions before it
        sends them, so it may have died before its StartUnit went out: started again, once
        (by this controller), keeping its place. A start that systemd did run and end (a
        failed condition or dependency) ends the same way again and is then taken as it
        ended. [] for any other unit: a start announced by systemd that ended meanwhile
        was someone's, and what ended it stands. Sent again, it is still gpuslice's own
        (`started`): withdrawn, not let through, should its annotation go before its gate
        asks."""
        holder = self.holders.get(name)
        if holder is None or holder.phase is not Phase.STARTING or name not in self.started:
            return []
        if name in self._sent_again:
            return []
        self._sent_again.add(name)
        return [_start(_about(holder.spec, Code.START_LOST))]

    def keeps_place(self, name: str) -> bool:
        """Whether GPUs are kept for the unit's start until its gate asks (`start_waits`)."""
        holder = self.holders.get(name)
        if holder is None or holder.phase is not Phase.STARTING:
            return False
        return bool(holder.gpus) or name in self._comeback_room

    def start_waits(self, name: str) -> list[Action]:
        """The unit's start, its place kept (a refill or comeback of ours, or a start seen
        queued), waits in systemd's queue for the start of a GPU unit (`After=`): it keeps
        nothing from now on, and its gate asks as any start does (`request`). Kept, the
        GPUs kept that unit's gate waiting while this start waited for its start: on one
        GPU neither ran. [] when nothing is kept for it."""
        if not self.keeps_place(name):
            return []
        holder = self.holders[name]
        kept = format_gpus(holder.gpus or self._comeback_room[name])  # either: `keeps_place`
        holder.gpus = frozenset()
        self._comeback_room.pop(name, None)
        self._tops_cache = None
        said = Log(
            f"{name} waits in systemd's queue for the start of a GPU unit: {kept} no longer "
            "kept for it, its gate asks for GPUs as any start's"
        )
        return [said, *self.schedule()]

    def asked(self, name: str) -> bool:
        """Whether the unit waits and its gate has asked (not its start job alone known)."""
        waiter = self.waiters.get(name)
        return waiter is not None and waiter.asked

    def kept_in_the_way(self, name: str) -> list[str]:
        """The units whose GPUs are kept for their gate (`keeps_place`) on a GPU this unit,
        waiting since its gate asked, may use: a start of theirs that waits in systemd's
        queue for this one's would leave both waiting (`start_waits`). [] when it does not
        wait, or only its start job is known."""
        if not self.asked(name):
            return []
        spec = self.waiters[name].spec
        avoid = self._avoids_foreign(spec)
        usable = {g.index for g in self.devices.values() if allowed(spec, g, avoid)}
        return sorted(
            other
            for other, holder in self.holders.items()
            if self.keeps_place(other)
            and usable & (holder.gpus or frozenset(self._comeback_room[other]))
        )

    def start_failed(self, name: str, why: str) -> list[Action]:
        """A start gpuslice sent itself (refill, requeue, a lost start sent again) did not
        reach systemd: an error of the bus, or of a systemd that is re-executing (`why`),
        not a refusal (those are `inactive` FAILED). Taken for failed, a preempted unit was
        never brought back: its work was lost without a word. It is owed as before the
        start, its GPUs released: a refill's unit is idle again (`refills`: an instance the
        shutdown stopped is kept for refill, and one turned on-demand meanwhile is owed
        nothing), and so is a plain background unit (refill or a requeue brings it back); any
        other is preempted again (only a requeue started it).
        Nothing starts it until the adapter's delay is over (`retry_start`): at once, the
        same failure would be sent again in a tight loop while the bus fails. [] when the
        start is no longer ours and unanswered: its gate asked (it reached systemd after
        all), it went down, or its annotation went (its withdrawal's stop decides)."""
        holder = self.holders.get(name)
        waiter = self.waiters.get(name)
        if name not in self.started:
            return []
        if holder is not None and holder.phase is Phase.STARTING:
            del self.holders[name]
            self._tops_cache = None
            spec, gpus = holder.spec, holder.gpus
        elif holder is None and waiter is not None and not waiter.asked:
            del self.waiters[name]  # its place was taken back for a more urgent start
            spec, gpus = waiter.spec, frozenset()
        else:
            return []
        refill = name in self.refills
        self.started.discard(name)
        self.refills.discard(name)
        self.requeued.discard(name)
        if name in self.specs and _owed_its_start(self.specs[name]) and not refill:
            self.preempted[name] = self._next()
        said = name in self.start_retries
        self.start_retries[name] = True
        if said:
            return self.schedule()
        retry = _about(spec, Code.START_RETRY, gpus=tuple(sorted(gpus)), detail=why)
        return [_log(retry), *self.schedule()]

    def retry_start(self, name: str) -> list[Action]:
        """The adapter's delay after a start that did not reach systemd is over: a pass may
        start the unit again, if it still wants to (nobody started it meanwhile, no more
        urgent unit took its GPUs, it is still annotated and owed)."""
        if not self.start_retries.get(name):
            return []
        self.start_retries[name] = False
        return self.schedule()

    def stop_overdue(self, name: str, after: str) -> list[Action]:
        """A unit asked to stop is still running after the stop timeout (`after`, in words):
        its waiter's reason says so."""
        holder = self.holders.get(name)
        if holder is None or holder.phase is not Phase.STOPPING or holder.overdue:
            return []
        holder.overdue = after
        waiter = self.waiters.get(holder.stopping_for or "")
        decision = _about(
            holder.spec,
            Code.STOP_OVERDUE,
            for_unit=holder.stopping_for or "",
            for_priority=waiter.spec.priority if waiter is not None else None,
            gpus=tuple(sorted(holder.gpus)),
            detail=after,
        )
        return [_log(decision), *self.schedule()]

    # -- the Preempt= ladder: what the adapter reports back -------------------------------------

    def suspended_done(self, name: str, detail: str) -> list[Action]:
        """Its VRAM left its GPUs (NVML confirmed) and it is frozen: the GPUs are free for
        the unit it gave way to. `detail`: how much moved, how fast (for the journal)."""
        holder = self.holders.get(name)
        if holder is None or holder.phase is not Phase.SUSPENDING:
            return []
        del self.holders[name]
        self._tops_cache = None
        waiter = self.waiters.get(holder.stopping_for or "")
        # what it was granted (or resumed on): a GPU the inventory reports lost may be one
        # NVML numbered anew under it, whose UUID now is no word of what the unit runs on;
        # taken as lost, it was resumed by its index once released: on another GPU
        uuids = {g: u for g, u in holder.uuids.items() if g in holder.gpus}
        for g in holder.gpus - uuids.keys():
            if g in self.devices and self.devices[g].uuid and not self.devices[g].lost:
                uuids[g] = self.devices[g].uuid
        self.suspended[name] = Suspended(holder.spec, holder.gpus, self._next(), uuids)
        decision = _about(
            holder.spec,
            Code.SUSPENDED,
            for_unit=holder.stopping_for or "",
            for_priority=waiter.spec.priority if waiter is not None else None,
            gpus=tuple(sorted(holder.gpus)),
            detail=detail,
        )
        return [_log(decision), *self.schedule()]

    def suspend_failed(
        self, name: str, why: str, *, lost: bool = False, not_ours: bool = False
    ) -> list[Action]:
        """Suspending did not work (no cuda-checkpoint, a lock that timed out, too little
        host memory...): the next rung of its ladder, or, with none left, it keeps its GPUs
        and is not chosen as a victim again while it runs. `lost`: undoing it failed for a
        process of it (its restore), which cannot run again: the unit is stopped, as after
        a failed resume, whatever its ladder (kept running, its work was broken).
        `not_ours`: someone else froze it (`systemctl freeze`), before the suspend or during
        its lock, and no FreezeUnit was sent: theirs to thaw, never owed one by gpuslice (a
        stop, its next rung, thaws it as any stop)."""
        holder = self.holders.get(name)
        if holder is None or holder.phase is not Phase.SUSPENDING:
            return []
        waiter = self.waiters.get(holder.stopping_for or "")
        self.unsuspendable.add(name)  # not tried again while it runs, whoever waits next
        spec = self.specs.get(name, holder.spec)  # its annotation now (a reload may edit it)
        if lost:
            return self._stop_undone(holder, spec, waiter, why, not_ours)
        rungs = _memory_rungs(spec, suspend_failed=True)
        fallback = rungs[0] if rungs else None
        decision = _about(
            holder.spec,
            Code.RUNG_FAILED,
            for_unit=holder.stopping_for or "",
            for_priority=waiter.spec.priority if waiter is not None else None,
            gpus=tuple(sorted(holder.gpus)),
            detail=why,
            rung=Rung.SUSPEND.value,
            fallback=fallback.value if fallback is not None else "",
        )
        self._tops_cache = None
        # frozen beside, or a freeze after the checkpoint that hung; so too before a stop,
        # which may fail (stop_failed holds it running then)
        if not not_ours:
            self.thaw_owed.add(name)
        # the stop only while it is still for a more urgent waiter (a reload may have changed
        # either priority since the suspend was decided)
        if fallback is Rung.STOP and waiter is not None and spec.priority > waiter.spec.priority:
            on = tuple(sorted(holder.gpus & set(waiter.target)) or sorted(holder.gpus))
            # a pass tells its waiter that it waits for a stop now, not for a suspend
            return [_log(decision), self._stop_for(holder, waiter.spec, on), *self.schedule()]
        holder.phase = Phase.RUNNING
        holder.stopping_for = None
        if waiter is not None:
            waiter.target = ()
        if fallback is None:
            self.unstoppable.add(name)
        return [_log(decision), *self.schedule()]

    def _stop_undone(
        self, holder: Holder, spec: UnitSpec, waiter: Waiter | None, why: str, not_ours: bool
    ) -> list[Action]:
        """A suspend whose undo lost a process: stopped, as a failed resume's unit. While
        still less urgent than its waiter the stop is for it (the waiter waits for it, as
        for the stop rung); else the waiter plans anew. `not_ours`: frozen by someone else
        (`suspend_failed`), owed no thaw, also should the stop fail."""
        if not not_ours:  # a freeze that hung; stop_failed holds it running
            self.thaw_owed.add(holder.spec.name)
        holder.phase = Phase.STOPPING
        self._tops_cache = None
        if waiter is None or spec.priority <= waiter.spec.priority:
            holder.stopping_for = None
            if waiter is not None:
                waiter.target = ()
        gpus = tuple(sorted(holder.gpus))
        detail = f"undoing its suspend: {why}"
        stop = _stop(_about(holder.spec, Code.RESUME_FAILED, gpus=gpus, detail=detail))
        return [stop, *self.schedule()]

    def resumed(self, name: str, detail: str) -> list[Action]:
        """Its VRAM is back and it runs again. `detail`: after how long, how fast."""
        holder = self.holders.get(name)
        if holder is None or holder.phase is not Phase.RESUMING:
            return []
        holder.phase = Phase.RUNNING
        self.thaw_owed.add(name)  # its ThawUnit came first, and may have failed
        self._tops_cache = None
        gpus = tuple(sorted(holder.gpus))
        actions: list[Action] = [_log(_about(holder.spec, Code.RESUMED, gpus=gpus, detail=detail))]
        if name not in self.specs:  # its annotation went while it was suspended
            actions.append(_log(self._still_runs(holder)))
        return actions + self.schedule()

    def _still_runs(self, holder: Holder) -> Decision:
        """A running unit whose annotation went keeps its GPUs until it ends, then is
        forgotten like any unannotated unit: its job still runs there, and handed out they
        would hold two jobs. It holds them on `_unannotated` terms."""
        holder.spec = _unannotated(holder.spec)
        gpus = tuple(sorted(holder.gpus))
        return _about(holder.spec, Code.UNMANAGED, gpus=gpus, cause=Cause.RUNS)

    def resume_failed(self, name: str, why: str) -> list[Action]:
        """A restore failed: the process cannot continue (a restore that ran out of memory
        is permanent), so the unit is stopped; Requeue= decides whether it starts again."""
        holder = self.holders.get(name)
        if holder is None or holder.phase is not Phase.RESUMING:
            return []
        holder.phase = Phase.STOPPING
        holder.stopping_for = None
        self._tops_cache = None
        gpus = tuple(sorted(holder.gpus))
        return [_stop(_about(holder.spec, Code.RESUME_FAILED, gpus=gpus, detail=why))]

    def freeze_failed(self, name: str, why: str, *, not_ours: bool = False) -> list[Action]:
        """A freeze did not work: it keeps running beside the units it was to give way to
        (they fit beside it: nothing else needs to happen). `not_ours`: someone else froze
        it (`systemctl freeze`) before ours: theirs to thaw, never owed one by gpuslice."""
        holder = self.holders.get(name)
        if holder is None or holder.phase is not Phase.FROZEN:
            return []
        holder.phase = Phase.RUNNING
        if not not_ours:  # a FreezeUnit not answered may have frozen it after all
            self.thaw_owed.add(name)
        for_unit = min(holder.frozen_for, default="")
        holder.frozen_for.clear()
        self.unfreezable.add(name)
        other = self.holders.get(for_unit)
        decision = _about(
            holder.spec,
            Code.RUNG_FAILED,
            for_unit=for_unit,
            for_priority=other.spec.priority if other is not None else None,
            gpus=tuple(sorted(holder.gpus)),
            detail=why,
            rung=Rung.FREEZE.value,
        )
        return [_log(decision), *self.schedule()]

    def thawed_outside(self, name: str) -> list[Action]:
        """Someone thawed a frozen or suspended unit by hand (`systemctl thaw`). Frozen: it
        counts as running again and is not frozen again while it runs. Suspended: its memory
        is still in host memory; it is restored as soon as it fits, as before (said once a
        suspend: it is found thawed at each look until then). While the
        host goes down a frozen unit found thawed stays frozen in the books: systemd thaws a
        unit to stop it, and the shutdown's stop ends it, owed a comeback (`inactive`); taken
        for running, it ended owed nothing. Told again at the next look should the shutdown
        be cancelled."""
        holder = self.holders.get(name)
        if holder is not None and holder.phase is Phase.FROZEN and self.shutting_down:
            return []
        if holder is not None and holder.phase is Phase.FROZEN:
            holder.phase = Phase.RUNNING
            holder.frozen_for.clear()
            self.unfreezable.add(name)
            gpus = tuple(sorted(holder.gpus))
            return [_log(_about(holder.spec, Code.THAWED_OUTSIDE, gpus=gpus))]
        entry = self.suspended.get(name)
        if entry is not None and not entry.thawed:
            entry.thawed = True
            gpus = self._where_now(entry) or tuple(sorted(entry.gpus))
            thawed = _about(entry.spec, Code.THAWED_OUTSIDE, gpus=gpus, cause=Cause.SUSPENDED)
            return [_log(thawed)]
        return []

    def frozen_units(self) -> list[str]:
        """Units gpuslice froze: frozen beside a more urgent unit, or suspended."""
        frozen = [n for n, h in self.holders.items() if h.phase is Phase.FROZEN]
        return sorted([*frozen, *self.suspended])

    def thaws_owed(self) -> list[str]:
        """Units gpuslice froze (or may have left frozen) and no longer holds frozen, not yet
        seen running: the adapter reads their FreezerState and thaws a frozen one. One it
        holds frozen, suspending or resuming again is that operation's, not owed."""
        return sorted(n for n in self.thaw_owed if self.phase(n) in _THAW_OWED_IN)

    def thaw_done(self, name: str) -> list[Action]:
        """systemd answered a ThawUnit, or shows the unit running: no thaw is owed."""
        self.thaw_owed.discard(name)
        return []

    def froze_after_end(self, name: str) -> list[Action]:
        """A FreezeUnit of the ladder was answered after the run it was for went down (a
        stop, a restart): it may have frozen the next run, which nobody holds frozen. That
        run (one this knows) is owed a thaw, as after a freeze that failed half way."""
        if self.phase(name) is not None:
            self.thaw_owed.add(name)
        return []

    def recover(self) -> list[Action]:
        """After a controller restart: units caught between suspend and resume are resumed
        on the GPUs they still hold (a resume is safe in any state: it restores what was
        moved and unlocks what was locked); the scheduler suspends them again if it must.
        A frozen unit whose annotation went while the last controller was away is thawed,
        as set_specs would have."""
        actions: list[Action] = []
        for name, holder in sorted(self.holders.items()):
            if holder.phase is Phase.FROZEN and name not in self.specs:
                actions.append(self._thaw_unannotated(holder))
            if holder.phase in (Phase.SUSPENDING, Phase.RESUMING):
                holder.phase = Phase.RESUMING
                holder.stopping_for = None
                gpus = tuple(sorted(holder.gpus))
                resume = _about(
                    holder.spec, Code.RESUME, gpus=gpus, detail="after a controller restart"
                )
                actions.append(Resume(name, gpus, render(resume), resume))
        return actions

    def remember_uuids(self, name: str, told: Mapping[int, str]) -> None:
        """After a controller restart: the UUID of each GPU a suspended unit was suspended
        from, or a holder past its gate was granted, as its env file tells (what its
        processes run on). The state file names its GPUs by index only, and the NVML this
        controller opened may number them otherwise (`Suspended`, `Holder.uuids`). A file
        that names other GPUs than its own says nothing of it."""
        entry = self.suspended.get(name)
        if entry is not None and set(told) == entry.gpus and all(told.values()):
            entry.uuids = dict(told)
        holder = self.holders.get(name)
        if holder is not None and set(told) == holder.gpus and all(told.values()):
            holder.uuids = dict(told)

    def set_policy(self, *, yield_to_foreign: bool, requeue_at_gate: bool) -> None:
        """config.yaml's two policy switches, changed by a reload. Decides nothing: they
        apply from the next `schedule`, which the reload's rescan runs."""
        self.yield_to_foreign = yield_to_foreign
        self.requeue_at_gate = requeue_at_gate

    def pause_refill(self, reason: str) -> None:
        """Hold background units back for `reason` (the GPUs are a guess: NVML is not ready
        yet), or let them start again with "". Decides nothing: the next `schedule` does."""
        self.refill_paused = reason

    def set_shutting_down(self, down: bool) -> list[Action]:
        """Systemd queued the host's shutdown (or cancelled it). Meanwhile nothing is
        started, granted or preempted (`schedule`): each unit that goes down frees GPUs, and
        a preempted unit brought back then had its start refused (the transaction is
        destructive), was taken for failed and, its preemption forgotten, was never started
        again after the reboot."""
        was, self.shutting_down = self.shutting_down, down
        return self.schedule() if was and not down else []

    def holds_confirmed(self, names: Iterable[str]) -> None:
        """systemd said the host was not going down after these holds were booked: they
        were someone's stops, and stand."""
        for name in names:
            self.unconfirmed_holds.pop(name, None)

    def holds_of_shutdown(self, names: Iterable[str]) -> list[str]:
        """systemd says the host is going down, which no JobNew told (the bus lost it): the
        stops that took these units down since were the shutdown's, not someone's. Not held,
        as when the shutdown is heard (`inactive`): a hold outlived the reboot, and a
        background unit never ran again until someone started it; one preempted while it
        ran (or being stopped by gpuslice, or its comeback under way) lost its work with the
        boot, and comes back after it (Requeue=); a background instance owed nothing is kept
        for a cancel's refill (`stopped_by_shutdown`). The units no longer held."""
        freed: list[str] = []
        for name in sorted(set(names)):
            owed = self.unconfirmed_holds.pop(name, None)
            if owed is None or name not in self.held:
                continue
            self.held.discard(name)
            if owed:
                self.preempted[name] = self.out_since[name]
            elif self._kept_for_refill(name):
                self.stopped_by_shutdown.add(name)  # as `inactive` keeps it
            freed.append(name)
        return freed

    def stopping(self) -> dict[str, str]:
        """The units a stop of gpuslice's is under way for, each with the unit it is for
        ("" for none: a withdrawn start, a yield to foreign processes)."""
        return {
            name: holder.stopping_for or ""
            for name, holder in self.holders.items()
            if holder.phase is Phase.STOPPING
        }

    def hold_in_doubt(self, name: str, victims: Iterable[str]) -> None:
        """`name` was held while gpuslice stopped `victims`: systemd may have stopped it with
        one it needs (`stopped_with`), which is asked. Meanwhile they are not brought back:
        back first, a less urgent victim took the GPUs of the more urgent unit that needs it.
        Decides nothing."""
        self.in_doubt[name] = frozenset(victims)

    def hold_stands(self, name: str) -> list[Action]:
        """`name` was not stopped with a unit it needs, or systemd could not say: held as
        booked; the victims kept back for it may come back."""
        if self.in_doubt.pop(name, None) is None:
            return []
        return self.schedule()

    def stopped_with(self, name: str, victim: str, why: str, for_unit: str) -> list[Action]:
        """systemd stopped `name` with `victim`, which gpuslice was stopping (for
        `for_unit`) and which `name` needs (`why`: its `Requires=`, `BindsTo=` or
        `PartOf=`, as systemd read them after its down): a stop of gpuslice's took it down,
        not someone's. Held at its down (that stop was not ours), it is preempted like
        `victim`, and comes back as a preempted unit does (Requeue=), once `victim`'s stop is
        over (`stopped_along`): held, the more urgent unit that needs a less urgent victim
        never came back, and the victim came back on its GPUs. Not once its hold is over
        (started or forgotten since), nor where `victim` is held (ours merged into someone's
        stop of it)."""
        doubted = self.in_doubt.pop(name, None) is not None
        spec = self.specs.get(name)
        if spec is None or name not in self.held or victim in self.held:
            return self.schedule() if doubted else []
        self.held.discard(name)
        self.unconfirmed_holds.pop(name, None)
        self.preempted[name] = self.out_since[name]
        self.stopped_along[name] = victim
        known = self.specs.get(for_unit)
        actions = [
            _log(
                _about(
                    spec,
                    Code.STOPPED_WITH,
                    units=(victim,),
                    detail=why,
                    for_unit=for_unit,
                    for_priority=known.priority if known is not None else None,
                )
            )
        ]
        if not spec.requeue:
            actions.append(_log(_about(spec, Code.NOT_REQUEUED)))
        return actions + self.schedule()

    def set_specs(self, specs: Mapping[str, UnitSpec]) -> list[Action]:
        """Annotations were (re)read: apply new priorities. A unit no longer annotated whose
        start was not answered yet: one gpuslice sent itself is stopped (`_withdraw_start`);
        anyone else's is forgotten, and goes on ungated, as any unannotated unit's start
        (its gate's drop-in went with the daemon-reload; a gate of it that still runs is let
        through by the controller), with no GPUs of gpuslice's. One that was answered holds
        its GPUs until it ends (`_keep_unannotated`). One down loses how it went down
        (`_forget_unannotated`)."""
        actions: list[Action] = []
        was = self.specs
        self._set_specs(specs)
        # one annotated again while it holds GPUs (or is suspended) is new to the annotations,
        # not to gpuslice: someone started it, as `load` counts it
        self.dormant -= self.holders.keys() | self.suspended.keys()
        self._tops_cache = None  # priorities change, holders go
        for name in list(self.holders):
            holder = self.holders[name]
            if name in self.specs:
                holder.spec = self.specs[name]
            elif holder.phase is Phase.STARTING and name in self.started:
                actions.append(self._withdraw_start(name))
            elif holder.phase is Phase.STARTING:
                actions.append(self._forget_start(name))
            else:
                actions += self._keep_unannotated(holder, told=name not in was)
        for name in list(self.waiters):
            if name in self.specs:
                self.waiters[name].spec = self.specs[name]
            elif name in self.started:  # ours, moved back to waiting, or a requeue at its gate
                actions.append(self._withdraw_start(name))
            else:
                actions.append(self._forget_start(name))
        for name in self.requeued_away():  # its gate has not asked this controller yet
            if name not in self.specs and name in was:
                actions.append(self._withdraw_start(name, was[name]))
        actions += self._forget_unannotated(was)
        return actions + self.schedule()

    def _withdraw_start(self, name: str, spec: UnitSpec | None = None) -> Stop:
        """A start gpuslice sent itself (a refill, a requeue) of a unit whose annotation went
        before its gate was answered is stopped: gpuslice starts no unannotated unit. Let
        through instead, it would run, ungated, on the GPUs kept for it, and those would be
        handed to the next unit, or beside the units it waited for: two jobs on one GPU,
        both started by gpuslice. It keeps what was kept for it (one waiting, nothing) until
        it is down, as a holder being stopped (so that its gate, should it ask, is stopped
        again), then is forgotten (`inactive`, which also drops it from `started` and
        `requeued`: neither is read of a unit that is not STARTING). `spec`: its terms
        before, for a requeue at its gate that neither holds nor waits (`requeued_away`)."""
        holder = self.holders.get(name)
        if holder is None and spec is not None and name not in self.waiters:
            holder = Holder(spec, frozenset(), Phase.STARTING, self._next())
            self.holders[name] = holder
        elif holder is None:
            waiter = self.waiters.pop(name)
            holder = Holder(waiter.spec, frozenset(), Phase.STARTING, waiter.seq)
            self.holders[name] = holder
        holder.spec = _unannotated(holder.spec)
        holder.phase = Phase.STOPPING
        holder.stopping_for = None
        gpus = tuple(sorted(holder.gpus))
        return _stop(_about(holder.spec, Code.UNMANAGED, gpus=gpus, cause=Cause.WITHDRAWN))

    def _forget_start(self, name: str) -> Log:
        """A start not answered yet (a place kept for it, or waiting), not one gpuslice sent
        itself, of a unit whose annotation went: nothing of it runs on GPUs of gpuslice's,
        and the units stopping for it stop for nobody now, as for a start that was
        cancelled. Never granted later: its gate would pass onto GPUs its process is not
        told of (the environment file's drop-in went with its annotation), after less
        urgent units were stopped for an unmanaged one. One kept for its Restart= is kept
        no more: its restart, unmanaged, may run and be adopted once annotated again, its
        down then the down of a run, not the end of a keep (`restart_overdue`)."""
        self.restart_kept.pop(name, None)
        gone = self.holders.pop(name, None)
        if gone is not None:
            return _log(_about(gone.spec, Code.UNMANAGED, gpus=tuple(sorted(gone.gpus))))
        return _log(_about(self.waiters.pop(name).spec, Code.UNMANAGED))

    def _keep_unannotated(self, holder: Holder, *, told: bool) -> list[Action]:
        """A holder whose annotation went, its start answered: its job runs on its GPUs (or
        is being stopped, suspended or resumed there), so it keeps them until it ends, on
        `_unannotated` terms; a frozen one is thawed (never left frozen with nobody's
        annotation to thaw it), and one that runs is told so (once: `told` already)."""
        holder.spec = _unannotated(holder.spec)
        actions: list[Action] = []
        if holder.phase is Phase.FROZEN:
            actions.append(self._thaw_unannotated(holder))
        if holder.phase is Phase.RUNNING and not told:
            actions.append(_log(self._still_runs(holder)))
        return actions

    def _thaw_unannotated(self, holder: Holder) -> Thaw:
        """Thaw a frozen unit whose annotation went: it runs beside the units it was frozen
        for, as if thawed by hand (`thawed_outside`)."""
        thaw = _about(holder.spec, Code.THAW, gpus=tuple(sorted(holder.gpus)))
        holder.phase = Phase.RUNNING
        holder.frozen_for.clear()
        self.thaw_owed.add(holder.spec.name)
        return Thaw(holder.spec.name, render(thaw), thaw)

    def let_through(self, name: str) -> list[Action]:
        """The gate of a unit whose annotation went, that still holds its GPUs (restarted
        with no moment down between, `_keep_unannotated`), is let through on them once its
        env file names them (`told`). It cannot be while one of them is lost and its books
        lack the UUID it was granted (its file named none, or none was read at a controller
        restart): `told` then names what the index is now, another GPU after a renumbering
        (one another unit may run on, by its old index) or, stopped answering, one CUDA
        numbers otherwise. Its new run's processes have not started: its GPUs are released,
        as `request` gives up an annotated unit's, and it runs as any unannotated unit does,
        with no GPUs of gpuslice's. [] for any other unit."""
        holder = self.holders.get(name)
        if holder is None or holder.phase is not Phase.RUNNING or name in self.specs:
            return []
        if not any(self.device(g).lost and not holder.uuids.get(g) for g in holder.gpus):
            return []
        del self.holders[name]
        self._tops_cache = None
        gone = _about(holder.spec, Code.UNMANAGED, gpus=tuple(sorted(holder.gpus)))
        return [_log(gone), *self.schedule()]

    # -- the rules --------------------------------------------------------------------------

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Take in several facts before deciding (the rebuild after a controller restart):
        inside, `schedule` decides nothing; the caller calls it once afterwards. Deciding
        after each fact would bring a preempted unit back onto a GPU released by the first
        fact before a waiter named by a later one is known."""
        self._deferred += 1  # nests: only the outermost ends it
        try:
            yield
        finally:
            self._deferred -= 1

    def schedule(self) -> list[Action]:
        """Yield to foreign processes, serve waiters, requeue preempted units, then fill
        free capacity with background units."""
        if self._deferred:
            return []
        for victim, needed_by in list(self.unstoppable_while.items()):
            if needed_by not in self.waiters:  # granted, or its start ended: stoppable again
                del self.unstoppable_while[victim]
                self.unstoppable.discard(victim)
                self.held_for_jobs.pop(victim, None)
        # while the host goes down no frozen unit is thawed (see below)
        actions = [] if self.shutting_down else self._thaw()
        if not self.shutting_down:  # nor yields a unit: the shutdown stops it anyway
            actions += self._yield_to_foreign()
        self._tops_cache = None
        promises = self._suspended_room() + self._comebacks_room()
        # nor is a waiter served: the shutdown stops its unit anyway. Granted, its job began
        # only to be stopped; its victims' stops, freezes and suspends raced the shutdown's
        # stop of them (a checkpoint under the SIGTERM). A cancelled shutdown serves it
        waiting = [] if self.shutting_down else self.waiters.values()
        queue = [(w.spec.priority, w.seq, w.spec.name) for w in waiting]
        heapq.heapify(queue)
        # the preempted units owed a comeback, the most urgent last (popped first)
        comebacks = sorted(
            (self._prio(n), at, i, n) for i, (n, at) in enumerate(self.preempted.items())
        )
        comebacks.reverse()
        unplaced: list[UnitSpec] = []
        self._view = None
        while queue:
            priority, _, name = heapq.heappop(queue)
            # a preempted unit more urgent than this waiter comes back first: served after
            # it, its comeback's gate preempted the waiter granted a moment before
            back = self._requeue(promises, comebacks, unplaced, before=priority)
            if back:
                self._view = None  # it took capacity the pass's view does not show
                actions += back
            waiter = self.waiters.get(name)
            if waiter is None:
                continue
            actions += self._serve(waiter, promises)
            for again in self._displaced:  # moved back to waiting: served in turn
                heapq.heappush(queue, (again.spec.priority, again.seq, again.spec.name))
            self._displaced.clear()
        if self.shutting_down:
            # no suspended unit is resumed, or a frozen one thawed: the shutdown ends it
            # anyway, owed a comeback (`inactive`). Resumed or thawed first, its VRAM came
            # back for nothing, racing its stop, and it ended running: owed nothing
            return actions
        actions += self._requeue(promises, comebacks, unplaced)
        actions += self._resume(promises)
        actions += self._refill(promises)
        return actions + self._thaw()  # a unit frozen in this pass no longer runs

    def _uses(self, promises: list[tuple[int, Use]]) -> dict[int, list[Use]]:
        uses: dict[int, list[Use]] = {i: [] for i in self.devices}
        for name, h in self.holders.items():
            stoppable = name not in self.unstoppable and (
                h.phase is Phase.STARTING
                or (h.phase in (Phase.RUNNING, Phase.FROZEN) and bool(self._memory_rungs_of(h)))
            )
            use = Use(
                name,
                h.spec.priority,
                h.spec.memory,
                stoppable,
                h.seq,
                granted=h.granted,
            )
            for gpu in h.gpus:
                uses.setdefault(gpu, []).append(use)
        for gpu, use in promises:
            uses.setdefault(gpu, []).append(use)
        return uses

    def _avoids_foreign(self, spec: UnitSpec) -> bool:
        return self.yield_to_foreign and spec.kind is UnitKind.BACKGROUND

    def _place(
        self,
        spec: UnitSpec,
        promises: list[tuple[int, Use]],
        *,
        preempt: bool,
        known_since: int | None = None,
        uses: dict[int, list[Use]] | None = None,
        shun_foreign: bool = True,
    ) -> Placement | None:
        return place(
            spec,
            self.devices,
            self._uses(promises) if uses is None else uses,
            preempt=preempt,
            avoid_foreign=self._avoids_foreign(spec),
            known_since=known_since,
            shun_foreign=shun_foreign,
        )

    def _promise(
        self,
        promises: list[tuple[int, Use]],
        spec: UnitSpec,
        gpus: Iterable[int],
        kept_from: int | None = None,
        uses: dict[int, list[Use]] | None = None,
    ) -> None:
        """Keep capacity for a waiter for the rest of this pass (and in `uses`, if given)."""
        for gpu in gpus:
            use = Use(spec.name, spec.priority, spec.memory, kept_from=kept_from)
            promises.append((gpu, use))
            if uses is not None:
                uses.setdefault(gpu, []).append(use)

    def _yield_to_foreign(self) -> list[Action]:
        if not self.yield_to_foreign:
            return []
        actions: list[Action] = []
        for name, holder in sorted(self.holders.items()):
            if (
                holder.phase not in (Phase.RUNNING, Phase.STARTING)
                or holder.spec.kind is not UnitKind.BACKGROUND
                or name in self.unstoppable
                # down, kept for its Restart=: nothing to stop (a stop cancelled that restart,
                # its failure taken for a yield that gpuslice starts again); its gate waits
                or name in self.restart_kept
            ):
                continue
            busy = [self.devices[g] for g in sorted(holder.gpus) if g in self.devices]
            busy = [g for g in busy if g.foreign_pids]
            if busy:
                holder.phase = Phase.STOPPING
                holder.stopping_for = None
                pids = tuple(p for g in busy for p in g.foreign_pids)
                owners = tuple(sorted({o for g in busy for o in g.foreign_owners}))
                gpus = tuple(sorted(g.index for g in busy))
                yielded = _about(holder.spec, Code.YIELD, gpus=gpus, pids=pids, owners=owners)
                actions.append(_stop(yielded))
        return actions

    def _serve(self, waiter: Waiter, promises: list[tuple[int, Use]]) -> list[Action]:
        spec = waiter.spec
        if self.refill_paused and spec.kind is UnitKind.BACKGROUND and not waiter.victims:
            paused = _about(spec, Code.WAIT, cause=Cause.PAUSED, detail=self.refill_paused)
            return self._set_reason(waiter, paused)
        view, self._view = self._view, None  # serving may change what later waiters see
        waiter.victims = {
            n
            for n, h in self.holders.items()
            if h.phase in GIVING_WAY and h.stopping_for == spec.name
        }
        if view is not None and not waiter.victims and self._blocked_too(waiter, view):
            return self._still_blocked(waiter, view, dominated=True)
        uses = self._uses(promises)  # what the placements below see, built once per waiter
        found = None
        if not waiter.victims:
            # One placement with preemption answers both questions: victim-free GPUs always
            # cost less than GPUs with victims, so it names victims only when the unit does
            # not fit on free capacity. A free fit is placed again without preemption (the
            # choice among free GPUs must not depend on how many GPUs have victims).
            found = self._place(spec, promises, preempt=True, known_since=waiter.since, uses=uses)
            if found is not None and not found.victims:
                found = self._place(spec, promises, preempt=False, uses=uses)
            if found is not None and not found.victims:
                gpus = found.gpus
                del self.waiters[spec.name]
                if waiter.asked:
                    holder = Holder(spec, frozenset(gpus), Phase.RUNNING, self._next())
                    holder.granted = holder.seq
                else:
                    # a place kept keeps its arrival: moved back to waiting (_displace), it
                    # is still known since then, for its place in the queue and for the
                    # thrash rule (what was granted after it arrived stays protected from it)
                    holder = Holder(spec, frozenset(gpus), Phase.STARTING, waiter.seq)
                self.holders[spec.name] = holder
                self._tops_cache = None
                if waiter.asked:
                    return [self._grant(holder, gpus), *self._freeze_beside(spec, gpus)]
                # kept for it, given when its gate asks; said if it was told it waits
                keep = _about(spec, Code.KEEP, gpus=tuple(sorted(gpus)))
                return [_log(keep)] if waiter.reason else []
        if waiter.victims:
            # after a controller restart the target is unknown: the victims' GPUs stand in
            victim_gpus = {g for v in waiter.victims for g in self.holders[v].gpus}
            self._promise(promises, spec, waiter.target or sorted(victim_gpus)[: spec.gpus])
            return self._set_reason(waiter, self._stopping_reason(waiter))
        if found is not None and self._displace(found.victims):
            return self._serve(waiter, promises)  # the places it takes were only kept
        if found is None or not found.victims:
            allowed_gpus = [
                g for g in self.devices.values() if allowed(spec, g, self._avoids_foreign(spec))
            ]
            if 1 < spec.gpus <= len(allowed_gpus):  # one that can never fit keeps nothing back
                # (a unit of one GPU that does not fit on free capacity fits on no GPU now)
                room = [g.index for g in allowed_gpus if self._fits_now(spec, g, uses)]
                kept = room[: spec.gpus]
                if kept:
                    self._promise(promises, spec, kept, kept_from=spec.priority, uses=uses)
                    return self._set_reason(waiter, self._blocked_reason(waiter, uses))
            # blocked, keeping nothing: what later waiters of this pass see is unchanged
            granted = [u.granted for on in uses.values() for u in on if u.stoppable]
            return self._still_blocked(
                waiter, _PassView(uses, newest_grant=max(granted, default=0))
            )
        gpus, victims = found.gpus, found.victims
        actions: list[Action] = []
        self._tops_cache = None
        for victim in victims:
            holder = self.holders[victim]
            waiter.victims.add(victim)
            on = tuple(sorted(holder.gpus & set(gpus)) or sorted(holder.gpus))
            actions.append(self._give_way(holder, spec, on))
        waiter.target = gpus
        self._promise(promises, spec, gpus)
        return actions + self._set_reason(waiter, self._stopping_reason(waiter))

    def _give_way(self, holder: Holder, spec: UnitSpec, on: tuple[int, ...]) -> Action:
        """The first rung of the victim's ladder that frees VRAM: suspend or stop (`_uses`
        makes a unit with neither no victim)."""
        if self._memory_rungs_of(holder)[0] is Rung.SUSPEND:
            frozen = holder.phase is Phase.FROZEN
            holder.phase = Phase.SUSPENDING
            holder.stopping_for = spec.name
            every = tuple(sorted(holder.gpus))  # all its VRAM moves, on every GPU it holds
            suspend = _about(
                holder.spec,
                Code.SUSPEND,
                for_unit=spec.name,
                for_priority=spec.priority,
                gpus=every,
            )
            owed = holder.spec.name in self.thaw_owed
            return Suspend(
                holder.spec.name, every, render(suspend), suspend, thaw_first=frozen, thaw_owed=owed
            )
        return self._stop_for(holder, spec, on)

    def _memory_rungs_of(self, holder: Holder) -> list[Rung]:
        name = holder.spec.name
        return _memory_rungs(holder.spec, suspend_failed=name in self.unsuspendable)

    def _stop_for(self, holder: Holder, spec: UnitSpec, on: tuple[int, ...]) -> Stop:
        if holder.phase is Phase.FROZEN:  # systemd thaws it as it stops it: a stop that
            self.thaw_owed.add(holder.spec.name)  # fails (stop_failed) would leave it frozen
        holder.phase = Phase.STOPPING
        holder.stopping_for = spec.name
        preempt = _about(
            holder.spec, Code.PREEMPT, for_unit=spec.name, for_priority=spec.priority, gpus=on
        )
        return _stop(preempt)

    def _freeze_beside(self, spec: UnitSpec, gpus: Iterable[int]) -> list[Action]:
        """Units with `freeze` in Preempt= that run beside a unit just granted and are less
        urgent give it their compute: frozen (their VRAM stays) until it has left. A freeze
        loses no work, so the thrash rule does not hold it back."""
        actions: list[Action] = []
        on = set(gpus)
        for name, holder in sorted(self.holders.items()):
            if (
                name == spec.name
                or not holder.gpus & on
                or holder.spec.priority <= spec.priority
                or not holder.spec.gives_way_by(Rung.FREEZE)
                or name in self.unfreezable
            ):
                continue
            if holder.phase is Phase.FROZEN:
                holder.frozen_for.add(spec.name)
            elif holder.phase is Phase.RUNNING:
                holder.phase = Phase.FROZEN
                holder.frozen_for = {spec.name}
                where = tuple(sorted(holder.gpus & on))
                freeze = _about(
                    holder.spec,
                    Code.FREEZE,
                    for_unit=spec.name,
                    for_priority=spec.priority,
                    gpus=where,
                )
                owed = name in self.thaw_owed
                actions.append(Freeze(name, render(freeze), freeze, thaw_owed=owed))
        return actions

    def _thaw(self) -> list[Action]:
        """Thaw frozen units whose more urgent neighbours have all left (or stopped running
        themselves: stopping, suspended)."""
        actions: list[Action] = []
        running = (Phase.RUNNING, Phase.STARTING, Phase.RESUMING)
        # most urgent first: whether a unit frozen in turn runs again is known before the
        # less urgent units frozen for it look at it
        by_urgency = sorted(self.holders.items(), key=lambda item: (item[1].spec.priority, item[0]))
        for name, holder in by_urgency:
            if holder.phase is not Phase.FROZEN:
                continue
            # one frozen in turn stays named: its freeze may fail, or someone may thaw it,
            # and then it runs beside this unit again
            holder.frozen_for = {
                u
                for u in holder.frozen_for
                if u in self.holders
                and self.holders[u].phase in (*running, Phase.FROZEN)
                and self.holders[u].spec.priority < holder.spec.priority  # a reload may change it
            }
            if not any(self.holders[u].phase in running for u in holder.frozen_for):
                holder.frozen_for.clear()
                holder.phase = Phase.RUNNING
                self.thaw_owed.add(name)
                thaw = _about(holder.spec, Code.THAW, gpus=tuple(sorted(holder.gpus)))
                actions.append(Thaw(name, render(thaw), thaw))
        return actions

    def _resume(self, promises: list[tuple[int, Use]]) -> list[Action]:
        """Bring suspended units back, most urgent first, onto their own GPUs when their
        memory fits there again and no more urgent unit waits (as a kept place is given);
        one that does not fit keeps its room from less urgent units (`promises`)."""
        actions: list[Action] = []
        if not self.suspended:
            return actions
        ahead: list[tuple[int, Use]] = []  # the room of those before it that stay suspended
        for entry in sorted(self.suspended.values(), key=self._resume_order):
            spec = self.specs.get(entry.spec.name, entry.spec)  # a priority edited meanwhile
            if self._awaits_names(entry):
                continue
            gpus = self._where_now(entry)
            if gpus is None or not self._can_come_back(gpus):
                if not self._gpus_a_guess(entry, gpus) and not self._held_by_old_numbers(gpus):
                    actions.append(self._stop_suspended(entry, spec, gpus))
                continue
            others = [p for p in promises if p[1].unit != spec.name]  # its own room is its
            # a waiter as urgent keeps nothing from it: it ran before that waiter came, and
            # comes back unless a more urgent unit waits (`urgent` below)
            kept = [p for p in others if not self._kept_by_an_equal(p[1], spec)]
            uses = self._uses(kept + ahead)  # no backfill: as urgent and earlier goes first
            avoid = self._avoids_foreign(spec)
            # Devices= chose where it was granted; a resume places nothing: its memory goes
            # back on its own GPUs, as a running unit stays on them. Its pin may name them no
            # longer (NVML numbered them anew: `Devices=1` is GPU 0 now; or Devices= edited
            # meanwhile, which applies from its next start, as systemd's unit files do), and
            # it waited forever, keeping their room from less urgent units
            unpinned = replace(spec, devices=())
            fits_now = all(
                index in self.devices
                and allowed(unpinned, self.devices[index], avoid)
                and self._fits_now(spec, self.devices[index], uses)
                for index in gpus
            )
            urgent = any(w.spec.priority < spec.priority for w in self.waiters.values())
            if not fits_now or urgent:
                self._promise(ahead, spec, gpus)  # its room stays kept (see `schedule`)
                continue
            promises[:] = others  # it holds its room from now on
            del self.suspended[spec.name]
            holder = Holder(spec, frozenset(gpus), Phase.RESUMING, self._next())
            holder.granted = holder.seq
            self._note_uuids(holder)
            self.holders[spec.name] = holder
            self._tops_cache = None
            resume = _about(spec, Code.RESUME, gpus=gpus, detail=self._moved(entry, gpus))
            actions.append(Resume(spec.name, gpus, render(resume), resume))
        return actions

    def _where_now(self, entry: Suspended) -> tuple[int, ...] | None:
        """The indices its GPUs have now: each GPU whose UUID it was suspended from is
        found by that UUID, the others (suspended before NVML named them) by their index;
        None when one of its GPUs NVML no longer lists (its index may name another GPU:
        its memory cannot be restored there). GPUs not named at all (config.yaml's guess,
        NVML not ready) say nothing: then by index, as before NVML answered (once NVML is
        no longer awaited: `_awaits_names`)."""
        at = {g.uuid: g.index for g in self.devices.values() if g.uuid}
        where: list[int] = []
        for index in sorted(entry.gpus):
            uuid = entry.uuids.get(index, "")
            if uuid and uuid in at:
                where.append(at[uuid])
            elif uuid and at:
                return None
            else:
                where.append(index)
        return tuple(sorted(where))

    def _moved(self, entry: Suspended, gpus: tuple[int, ...]) -> str:
        """The resume's detail when NVML numbered its GPUs anew since it was suspended."""
        if gpus == tuple(sorted(entry.gpus)):
            return ""
        uuids = [entry.uuids[g] for g in sorted(entry.gpus) if g in entry.uuids]
        return (
            f"{', '.join(uuids)} {'was' if len(uuids) == 1 else 'were'} "
            f"{format_gpus(entry.gpus)} when it was suspended: NVML numbered the GPUs anew"
        )

    def _kept_by_an_equal(self, use: Use, spec: UnitSpec) -> bool:
        """A place kept by a waiter (that cannot run yet) of the unit's own priority."""
        return use.kept_from == spec.priority and use.unit in self.waiters

    def _suspended_room(self) -> list[tuple[int, Use]]:
        """Each suspended unit's room on its GPUs, kept from strictly less urgent units (from
        the start of a pass: waiters are served first; `_resume` gives it back)."""
        promises: list[tuple[int, Use]] = []
        for entry in self.suspended.values():
            gpus = self._where_now(entry)
            if gpus is not None and self._can_come_back(gpus):
                spec = self.specs.get(entry.spec.name, entry.spec)
                self._promise(promises, spec, gpus, kept_from=spec.priority + 1)
        return promises

    def _can_come_back(self, gpus: tuple[int, ...]) -> bool:
        """A suspended unit's GPUs (`_where_now`) are all here and answering: a restore puts
        its memory back on them."""
        return all(g in self.devices and not self.devices[g].lost for g in gpus)

    def _awaits_names(self, entry: Suspended) -> bool:
        """NVML is not ready yet (`pause_refill`) and no GPU listed has a UUID (config.yaml's
        guess: a controller started before NVML answered), while it was suspended from GPUs
        known by UUID (its env file): the index each has now is unknown. Resumed by index
        (`_where_now`), its processes wake on their own GPU, by UUID, while the books say
        it holds what the guess calls that index; once NVML numbers the GPUs otherwise, its
        own GPU is free on the books and granted again: two jobs on one GPU. It waits for
        NVML, as one whose index the guess does not list (`_gpus_a_guess`); after
        driver_wait (fallback: NVML may never come) it comes back by index, as before.

        Without any UUID (NVML gives none: a fake or an odd driver; or the unit was
        suspended before NVML named its GPU) a renumbering cannot be told from nothing at
        all: its GPU is taken by index, as every grant and holder is then
        (`Inventory._as_booked` books only GPUs with a UUID)."""
        return (
            bool(self.refill_paused)
            and any(entry.uuids.values())
            and not any(g.uuid for g in self.devices.values())
        )

    def _gpus_a_guess(self, entry: Suspended, gpus: tuple[int, ...] | None) -> bool:
        """NVML is not ready yet (the GPUs are config.yaml's guess, `pause_refill`) and none
        of its GPUs (`gpus`: `_where_now`, None when one is gone) is known lost: it waits for
        NVML rather than being stopped, which would lose its work (a controller restarted
        while the driver does not answer)."""
        return bool(self.refill_paused) and not self._lost(gpus or entry.gpus)

    def _lost(self, gpus: Iterable[int]) -> bool:
        """Any of these GPUs listed and known lost (one not listed at all is not)."""
        return any(g in self.devices and self.devices[g].lost for g in gpus)

    def _held_by_old_numbers(self, gpus: tuple[int, ...] | None) -> bool:
        """Its GPUs are all listed and answer, but some are lost for new work only: NVML
        numbered the GPUs anew under units that hold them (`Gpu.renumbered`; a card off the
        bus shifts every GPU after it). It waits until they are released, as for a GPU in
        use: stopped, it lost the work its suspend kept, on a GPU that is there."""
        return gpus is not None and all(
            g in self.devices and (not self.devices[g].lost or self.devices[g].renumbered)
            for g in gpus
        )

    def _stop_suspended(
        self, entry: Suspended, spec: UnitSpec, where: tuple[int, ...] | None
    ) -> Stop:
        """A suspended unit whose GPU is lost or gone (`where`: `_where_now`) can never be
        restored: it is stopped (never left frozen for good), and Requeue= decides whether it
        starts again."""
        del self.suspended[spec.name]
        self.holders[spec.name] = Holder(spec, frozenset(), Phase.STOPPING, self._next())
        if where is None:  # never onto another GPU: its processes would wake on their own
            at = {g.uuid for g in self.devices.values()}
            why = "; ".join(
                f"its GPU {g} was {entry.uuids[g]}, which NVML no longer lists"
                for g in sorted(entry.gpus)
                if entry.uuids.get(g, "") and entry.uuids[g] not in at
            )
            why += ": its memory cannot be restored on another GPU"
        else:
            gone = sorted(g for g in where if g not in self.devices or self.devices[g].lost)
            why = f"{format_gpus(gone)} lost or gone: its memory cannot be restored there"
        gpus = where or tuple(sorted(entry.gpus))
        return _stop(_about(spec, Code.RESUME_FAILED, gpus=gpus, detail=why))

    def _resume_order(self, entry: Suspended) -> tuple[int, int]:
        return (self.specs.get(entry.spec.name, entry.spec).priority, entry.seq)

    def _displace(self, victims: Iterable[str]) -> bool:
        """Move units whose gate is not answered yet back to waiting (nothing of theirs ran:
        no stop, no work lost); whether any was."""
        moved = False
        for name in victims:
            holder = self.holders[name]
            if holder.phase is Phase.STARTING:
                del self.holders[name]
                self.waiters[name] = self._unkept(holder, asked=False)
                self._displaced.append(self.waiters[name])
                self._tops_cache = None
                moved = True
        return moved

    def _unkept(self, holder: Holder, *, asked: bool) -> Waiter:
        """A start whose kept place it loses (its GPU lost or filled, a reload, a more urgent
        start) waits again. Its place in the queue is where its start put it (`seq`); for the
        thrash rule it is new (`since`): what was granted while its place was kept was not
        granted before it, and protected from it, it left a more urgent start waiting behind
        a less urgent one that runs for hours (found by tests/test_core_renumber_properties.py
        at 20,000 examples: its GPU lost while its place was kept)."""
        return Waiter(holder.spec, holder.seq, asked=asked, since=self._next())

    def _fits_now(self, spec: UnitSpec, gpu: Gpu, uses: dict[int, list[Use]]) -> bool:
        here = [u for u in uses.get(gpu.index, []) if applies(u, spec.priority)]
        return fits(spec, gpu, here)

    def _blocked_too(self, waiter: Waiter, view: _PassView) -> bool:
        """Whether a waiter found blocked in this pass shows that this one is blocked too:
        the same GPUs allowed, no fewer GPUs and no less memory asked, no more urgent
        (fewer victims, more places kept bind it), and no more uses preemptable under the
        thrash rule (known no later, or nothing granted since the blocked one was known)."""
        spec = waiter.spec
        for seen in view.blocked:
            first = seen.spec
            if (
                spec.devices == first.devices
                and self._avoids_foreign(spec) == self._avoids_foreign(first)
                and spec.gpus >= first.gpus
                and spec.priority >= first.priority
                and _asks_no_less_memory(spec, first)
                and (waiter.since <= seen.since or view.newest_grant < seen.since)
            ):
                return True
        return False

    def _still_blocked(
        self, waiter: Waiter, view: _PassView, *, dominated: bool = False
    ) -> list[Action]:
        """A waiter that cannot be placed, preempting or not, and keeps no GPU: it changes
        nothing, so the pass's view stays valid for the waiters after it. One `dominated`
        (found blocked too by the caller) adds nothing to the blocked waiters that judge the
        next ones: its dominator judges them as it would."""
        actions = self._set_reason(waiter, self._blocked_reason(waiter, view.uses, view))
        if not dominated and not self._blocked_too(waiter, view):
            view.blocked.append(waiter)
        self._view = view
        return actions

    def _requeue(
        self,
        promises: list[tuple[int, Use]],
        comebacks: list[tuple[int, int, int, str]],
        unplaced: list[UnitSpec],
        before: int | None = None,
    ) -> list[Action]:
        """Bring back the preempted units of `comebacks` (by priority, then the one preempted
        first: taken from its end) more urgent than `before` (all, if None)."""
        actions: list[Action] = []
        # Placing only takes capacity away, and a later unit is no more urgent (fewer victims,
        # more places kept bind it): one that asks no less than a unit that did not fit even
        # preempting does not fit either. A burst's 8 preempted background units cost one
        # placement per pass, not 8 (issue 10: a fifth of a burst's controller CPU).
        while comebacks and (before is None or comebacks[-1][0] < before):
            name = comebacks.pop()[-1]
            if name not in self.preempted:
                continue
            spec = self.specs.get(name)
            if (
                spec is None
                or not spec.requeue
                or name in self.holders
                or name in self.waiters
                or name in self.suspended
                or self.start_retries.get(name)  # its last start failed: not yet again
            ):
                continue
            if self.refill_paused and spec.kind is UnitKind.BACKGROUND:
                continue
            if self.phase(self.stopped_along.get(name, "")) is Phase.STOPPING or any(
                name in victims for victims in self.in_doubt.values()
            ):
                continue
            if self.stopped_along.pop(name, "") in self.held:
                # its victim's stop was someone's after all (ours merged into theirs), and
                # so was its own: held like it. Back, it started the victim again
                del self.preempted[name]
                self.held.add(name)
                actions.append(_log(self._about_name(name, Code.HOLD)))
                continue
            if self._requeue_blocked_too(spec, unplaced):
                found = None
            else:
                found = self._place(spec, promises, preempt=True)
            if found is None:
                unplaced.append(spec)
                if self.requeue_at_gate and name not in self.wait_failed:
                    actions.append(self._queue_at_gate(spec))
                continue
            gpus, victims = found.gpus, found.victims
            if victims:
                held: frozenset[int] = frozenset()  # its gate request preempts like any start
                cause = Cause.PREEMPTS
                # kept from the less urgent for the rest of the pass: one served after it
                # here was granted, or preempted its victims too, and stopped at its gate
                self._promise(promises, spec, gpus)
            else:
                held = frozenset(gpus)
                cause = Cause.FREE
            del self.preempted[name]
            self._starting(spec, held)
            if victims:  # and in later passes, until its gate asks (`_comebacks_room`)
                self._comeback_room[name] = gpus
            requeue = _about(spec, Code.REQUEUE, gpus=tuple(sorted(gpus)), cause=cause)
            actions.append(_start(requeue))
        return actions

    def _comebacks_room(self) -> list[tuple[int, Use]]:
        """The GPUs each comeback started to preempt will ask for, kept from strictly less
        urgent units until its gate asks (then it is a waiter): granted in a pass between
        its start and that call (any event), a less urgent waiter was stopped by its gate
        a moment later."""
        promises: list[tuple[int, Use]] = []
        for name, gpus in list(self._comeback_room.items()):
            holder = self.holders.get(name)
            if holder is None or holder.phase is not Phase.STARTING or holder.gpus:
                del self._comeback_room[name]
                continue
            # its terms as annotated now: set_specs gives a STARTING holder its new spec, and
            # withdraws or forgets one whose annotation went
            spec = holder.spec
            self._promise(promises, spec, gpus, kept_from=spec.priority + 1)
        return promises

    def _requeue_blocked_too(self, spec: UnitSpec, unplaced: list[UnitSpec]) -> bool:
        """Whether a preempted unit that did not fit in this pass, even preempting, shows
        that this one, tried after it (so no more urgent), does not fit either: the same
        GPUs allowed (pins, and foreign processes avoided alike), no fewer GPUs and no less
        memory asked."""
        return any(
            self._avoids_foreign(spec) == self._avoids_foreign(than)
            and _no_better_placed(spec, than)
            for than in unplaced
        )

    def _queue_at_gate(self, spec: UnitSpec) -> Start:
        """Restart a preempted unit whose GPUs more urgent units hold: it waits at its gate
        in priority order with every other start, so that once they are free it costs the
        grant alone (its gate already runs), not a start job, a gate and a grant."""
        del self.preempted[spec.name]
        self._starting(spec, frozenset())
        self.requeued.add(spec.name)
        return _start(_about(spec, Code.REQUEUE, cause=Cause.QUEUES))

    def _starting(self, spec: UnitSpec, gpus: frozenset[int]) -> None:
        """A unit gpuslice starts (refill, requeue): `gpus` kept for it until its gate asks,
        and noted as started by us (saved: `start_lost`)."""
        self.holders[spec.name] = Holder(spec, gpus, Phase.STARTING, self._next())
        self.started.add(spec.name)
        self.dormant.discard(spec.name)  # a comeback: someone started it before

    def _refill(self, promises: list[tuple[int, Use]]) -> list[Action]:
        actions: list[Action] = []
        if self.refill_paused:
            return actions
        idle = [
            spec
            for name, spec in self._background.items()
            if name not in self.holders
            and name not in self.waiters
            and name not in self.preempted
            and name not in self.held
            and name not in self.finished
            and name not in self.failed
            and name not in self.suspended  # it runs (frozen): resumed, never started
            and name not in self.dormant  # an instance nobody started since it was learnt
            and not self.start_retries.get(name)  # its last start failed: not yet again
        ]
        # Placing only takes capacity away, and a later unit is no more urgent (no fewer
        # places kept from it): one that asks no less than a unit that did not fit, of the
        # same GPUs, does not fit either. At thousands of idle background units and no free
        # GPU, a pass costs one placement per kind of unit, not one per unit.
        unplaced: list[UnitSpec] = []
        for spec in sorted(idle, key=lambda s: (s.priority, self.out_since.get(s.name, -1))):
            if self._refill_blocked_too(spec, unplaced):
                continue
            found = self._place(spec, promises, preempt=False)
            if found is None:
                unplaced.append(spec)
                continue
            gpus = found.gpus
            self._starting(spec, frozenset(gpus))
            self.refills.add(spec.name)
            actions.append(_start(_about(spec, Code.REFILL, gpus=tuple(sorted(gpus)))))
        return actions

    def _refill_blocked_too(self, spec: UnitSpec, unplaced: list[UnitSpec]) -> bool:
        """Whether an idle background unit that did not fit in this refill shows that this
        one does not fit either (`_no_better_placed`)."""
        return any(_no_better_placed(spec, than) for than in unplaced)

    # -- helpers ----------------------------------------------------------------------------

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _prio(self, name: str) -> int:
        spec = self.specs.get(name)
        return spec.priority if spec is not None else 1000

    def _about_name(self, name: str, code: Code) -> Decision:
        spec = self.specs.get(name)
        return _about(spec, code) if spec is not None else Decision(code, name)

    def _grant(self, holder: Holder, gpus: tuple[int, ...] | None = None) -> Grant:
        """`gpus` in the order placement chose them (the unit's CUDA order)."""
        where = gpus if gpus is not None else tuple(sorted(holder.gpus))
        self._note_uuids(holder)
        return _grant(_about(holder.spec, Code.GRANT, gpus=where))

    def _note_uuids(self, holder: Holder) -> None:
        """The UUIDs of its GPUs as the adapter tells them to the unit now (its env file
        names what `device` says), but for a GPU lost: its UUID now may be another GPU's
        than the one the unit was told before (`Holder.uuids`)."""
        for g in holder.gpus:
            gpu = self.devices.get(g)
            if gpu is not None and gpu.uuid and not gpu.lost:
                holder.uuids[g] = gpu.uuid

    def _stopping_reason(self, waiter: Waiter) -> Decision:
        parts = []
        for name in sorted(waiter.victims):
            victim = self.holders[name]
            parts.append(
                Part(
                    Blocker.VICTIM,
                    tuple(sorted(victim.gpus)),
                    name,
                    victim.spec.priority,
                    overdue=victim.overdue,
                    rung="suspend" if victim.phase is Phase.SUSPENDING else "",
                )
            )
        return _about(
            waiter.spec,
            Code.WAIT,
            cause=Cause.STOPPING,
            parts=tuple(parts),
            gpus=tuple(sorted(waiter.target)),
        )

    def _blocked_reason(
        self,
        waiter: Waiter,
        uses: dict[int, list[Use]],
        view: _PassView | None = None,
        *,
        fresh: bool = False,
    ) -> Decision:
        """Why a waiter that cannot be placed waits. Told once that its GPUs are busy, it
        keeps that decision while they stay busy, unless `fresh` (what status shows)."""
        spec = waiter.spec
        room = view.gpu_room if view is not None else {}
        avoid = self._avoids_foreign(spec)
        usable = self._usable(spec, avoid, view)
        if spec.gpus > len(usable):
            if spec.devices or any(g.lost for g in self.devices.values()) or avoid:
                return _about(spec, Code.WAIT, cause=Cause.UNUSABLE, available=len(usable))
            return _about(spec, Code.WAIT, cause=Cause.HOST, available=len(self.devices))
        if not fresh and waiter.decision is not None and waiter.decision.cause is Cause.BUSY:
            # said once: which units hold its GPUs meanwhile is for `status` to show, not a
            # new line at every change (at 200 waiters, 200 lines per GPU handed over)
            return waiter.decision
        parts: list[Part] = []
        tops = self._tops()
        for gpu in sorted(usable, key=lambda g: g.index):
            top = tops.get(gpu.index)
            if gpu.index not in room:
                on_gpu = uses[gpu.index]  # `whole`: a use that declares no memory
                room[gpu.index] = (
                    free_memory(gpu, on_gpu),
                    any(u.memory is None for u in on_gpu),
                    overuse(gpu, on_gpu),
                )
            free, whole, beyond = room[gpu.index]
            on = (gpu.index,)
            # the thrash rule keeps a less urgent top holder granted after this waiter was known
            protected = (
                top is not None
                and top.spec.name not in self.unstoppable
                and top.spec.priority > spec.priority
                and top.phase is Phase.RUNNING
                and top.granted > waiter.since
            )
            if spec.memory is not None and free is not None and not whole:
                parts.append(
                    Part(
                        Blocker.MEMORY,
                        on,
                        top.spec.name if top else "",
                        top.spec.priority if top else None,
                        free=free,
                        granted_after=protected,
                        others=gpu.foreign,
                        beyond=beyond,
                        owners=gpu.foreign_owners,
                        owner_kinds=gpu.foreign_owner_kinds,
                    )
                )
            elif top is not None and top.phase in GIVING_WAY:
                how = "suspend" if top.phase is Phase.SUSPENDING else ""
                parts.append(Part(Blocker.STOPPING, on, top.spec.name, top.spec.priority, rung=how))
            elif top is not None:
                refused = top.spec.name in self.unstoppable
                parts.append(
                    Part(
                        Blocker.HELD,
                        on,
                        top.spec.name,
                        top.spec.priority,
                        refused=refused,
                        granted_after=protected,
                    )
                )
            elif (kept := self._suspended_ahead(gpu.index, spec.priority)) is not None:
                parts.append(Part(Blocker.SUSPENDED, on, kept.name, kept.priority))
            elif self._first_waiter(spec.priority, view) is not waiter:
                parts.append(Part(Blocker.KEPT, on, priority=spec.priority))
        return _about(spec, Code.WAIT, cause=Cause.BUSY, parts=tuple(parts))

    def _usable(self, spec: UnitSpec, avoid: bool, view: _PassView | None) -> list[Gpu]:
        """The GPUs the unit may ever run on (`allowed`), listed once per pass for each pins
        and avoidance of foreign processes: every blocked waiter's reason asks (issue 10)."""
        key = (spec.devices, avoid)
        found = view.usable.get(key) if view is not None else None
        if found is None:
            found = [g for g in self.devices.values() if allowed(spec, g, avoid)]
            if view is not None:
                view.usable[key] = found
        return found

    def _suspended_ahead(self, gpu: int, priority: int) -> UnitSpec | None:
        """The most urgent suspended unit whose room on this GPU is kept from units of this
        priority (`_suspended_room`), if any."""
        kept = [
            self.specs.get(e.spec.name, e.spec)
            for e in self.suspended.values()
            if (gpus := self._where_now(e)) is not None
            and gpu in gpus
            and self._can_come_back(gpus)
        ]
        ahead = [k for k in kept if k.priority < priority]
        return min(ahead, key=lambda k: (k.priority, k.name), default=None)

    def _tops(self) -> dict[int, Holder]:
        """Each GPU's most urgent holder (the first listed among equals). Kept for a
        scheduling pass until a holder changes: every blocked waiter's reason names them."""
        if self._tops_cache is None:
            tops: dict[int, Holder] = {}
            for holder in self.holders.values():
                for gpu in holder.gpus:
                    top = tops.get(gpu)
                    if top is None or holder.spec.priority < top.spec.priority:
                        tops[gpu] = holder
            self._tops_cache = tops
        return self._tops_cache

    def _first_waiter(self, priority: int, view: _PassView | None = None) -> Waiter:
        """The waiter of this priority that has waited longest (there is one: the caller's)."""
        first = view.first_waiters.get(priority) if view is not None else None
        if first is None:
            first = min((w for w in self.waiters.values() if w.spec.priority == priority), key=_seq)
            if view is not None:
                view.first_waiters[priority] = first
        return first

    def _set_reason(self, waiter: Waiter, decision: Decision) -> list[Action]:
        if decision == waiter.decision:
            return []  # said already (comparing data is cheaper than rendering words)
        waiter.decision = decision
        said = reason(decision)
        if said == waiter.reason:
            return []
        waiter.reason = said
        return [_log(decision)]

    # -- questions the adapters ask -----------------------------------------------------------

    def phase(self, name: str) -> Phase | None:
        holder = self.holders.get(name)
        if holder is None:
            return Phase.SUSPENDED if name in self.suspended else None
        return holder.phase

    def stopping_for(self, name: str) -> str | None:
        """The waiter a stop of ours of `name` is for, while it waits: None where the core
        stops it for nobody (a withdrawal, a yield, a waiter gone since) or does not stop it."""
        holder = self.holders.get(name)
        if holder is None or holder.phase is not Phase.STOPPING:
            return None
        return holder.stopping_for if holder.stopping_for in self.waiters else None

    def suspended_units(self) -> list[str]:
        return sorted(self.suspended)

    def requeued_away(self) -> list[str]:
        """Comebacks that wait at their gate with no place kept (their gate asked), not yet
        waiting here: after a controller restart, until their gate asks again. One that
        went down meanwhile is told with `inactive`."""
        return sorted(n for n in self.requeued if self.awaits_gate(n))

    def awaits_gate(self, name: str) -> bool:
        """One of `requeued_away`: its down, when it comes, is owed `inactive` (its wait
        failed: preempted still), though nobody holds or waits under its name."""
        return name in self.requeued and name not in self.holders and name not in self.waiters

    def is_waiting(self, name: str) -> bool:
        return name in self.waiters

    def waiting_units(self) -> list[str]:
        return list(self.waiters)

    def waiting(self, name: str) -> Waiting:
        """A waiter as others may see it (KeyError if it does not wait)."""
        w = self.waiters[name]
        return Waiting(tuple(sorted(w.target)), tuple(sorted(w.victims)), w.decision)

    def learn(self, spec: UnitSpec) -> None:
        """A unit seen for the first time (an instance of a managed template): dormant until
        a start of it is seen (`_forget_past`, `running`)."""
        if spec.name not in self.specs:
            self.specs[spec.name] = spec
            if _refillable(spec):
                self._background[spec.name] = spec
            if is_instance(spec.name):
                self.dormant.add(spec.name)

    def forget_instance(self, name: str) -> bool:
        """An instance that systemd shows down (`transcribe@REC.service`: a name per job)
        is forgotten once gpuslice owes it nothing: on-demand, not waiting, holding,
        suspended or owed a comeback (preempted with `Requeue=no` is owed none). Kept, every
        instance ever started would stay in memory, be saved with each change of state and be
        watched, which beyond 200 units means every unit's signals (issue 10). Whether it was
        forgotten. A background instance likewise (finished, failed, ended with no record,
        preempted with `Requeue=no`), but not one held: a hold is someone's wish, shown in
        status until someone starts it; nor one the host's shutdown stopped until it is
        down again (`stopped_by_shutdown`). Learnt again (a signal, the next controller's
        start), it is dormant: refill starts it only once someone has started it, so a
        finished job never runs again. Never a unit that is not an instance (the controller asks for
        instances only: a plain unit's annotation is its file's)."""
        spec = self.specs.get(name)
        background = spec is not None and spec.kind is UnitKind.BACKGROUND and is_instance(name)
        if (
            spec is None
            or (spec.kind is not UnitKind.ON_DEMAND and not background)
            or name in self.holders
            or name in self.waiters
            or name in self.suspended
            or (name in self.preempted and spec.requeue)
            or (background and name in self.held)
            or name in self.stopped_by_shutdown  # its refill is owed, should the shutdown end
            # held where it was preempted: the shutdown's stop, should SystemState say so
            # (`holds_of_shutdown`), owes it its comeback; forgotten, it never came back
            or self.unconfirmed_holds.get(name, False)
        ):
            return False
        del self.specs[name]
        self._background.pop(name, None)
        self.dormant.discard(name)
        self.start_retries.pop(name, None)
        self._forget_end(name)
        return True

    def drop_preempted_instances(self, limit: int) -> list[Action]:
        """More than `limit` instances kept preempted (a name per job: a flood of
        `Accept=yes` connections, each preempted in turn, grew the tables and the state file,
        saved with every decision, without bound): those down that would come back last (the
        least urgent, then the last preempted) are no longer brought back, so that what is
        kept comes back first and a flood of less urgent instances pushes out no more urgent
        work. Each is said once in its journal and the controller's, as a warning; dormant,
        it is then an instance owed nothing, which `forget_instance` forgets. Cheap below
        the bound."""
        if len(self.preempted) <= limit:
            return []
        kept = [n for n in self.preempted if is_instance(n)]
        down = [
            n
            for n in kept
            if n in self.specs
            and n not in self.holders
            and n not in self.waiters
            and n not in self.suspended
        ]
        actions: list[Action] = []
        last = heapq.nlargest(
            len(kept) - limit, down, key=lambda n: (self._prio(n), self.preempted[n], n)
        )
        for name in last:
            del self.preempted[name]
            self.wait_failed.discard(name)  # a note on its preemption
            self.dormant.add(name)  # refill starts it only once someone does
            detail = f"more than {limit:,} preempted instances are kept"
            actions.append(_log(_about(self.specs[name], Code.DROPPED, detail=detail)))
        return actions

    def _set_specs(self, specs: Mapping[str, UnitSpec]) -> None:
        was = self.specs
        self.specs = dict(specs)
        self._background = {n: s for n, s in self.specs.items() if _refillable(s)}
        # an instance new to the core is dormant (`learn`); one known stays as it was
        self.dormant = {
            n for n in self.specs if n in self.dormant or (n not in was and is_instance(n))
        }
        # read for annotated units alone (refill's order): kept for others, an entry stayed
        # for every unit ever seen down (each instance's name, which may never come again)
        self.out_since = {n: s for n, s in self.out_since.items() if n in self.specs}
        # its refill is owed to a background unit alone: one whose annotation turned
        # on-demand (a daemon-reload with another `Type=`) is owed nothing, and kept, it was
        # saved until the next reboot. One whose annotation went is `_forget_unannotated`'s
        self.stopped_by_shutdown = {
            n for n in self.stopped_by_shutdown if n not in self.specs or self._kept_for_refill(n)
        }

    def annotated(self) -> frozenset[str]:
        """The units with an annotation in force (plain units and known instances)."""
        return frozenset(self.specs)

    def grants(self) -> dict[str, frozenset[int]]:
        return {name: holder.gpus for name, holder in self.holders.items()}

    def declared_memory(self) -> dict[str, int]:
        """Holders with `Memory=`: what each declared per GPU."""
        return {n: h.spec.memory for n, h in self.holders.items() if h.spec.memory is not None}

    def device(self, index: int) -> Gpu:
        return self.devices.get(index, Gpu(index))

    def told(self, name: str) -> list[Gpu]:
        """The GPUs a holder runs on, as its env file names them (by index): each by the UUID
        it had when granted or resumed, or that the file a restart read gave
        (`Holder.uuids`), else as `device` says now. NVML may have numbered the GPUs anew
        since: the index held may name another GPU now, one another unit runs on."""
        holder = self.holders.get(name)
        if holder is None:
            return []
        return [
            Gpu(g, holder.uuids[g]) if holder.uuids.get(g) else self.device(g)
            for g in sorted(holder.gpus)
        ]

    def has_work(self) -> bool:
        """Something the GPUs' state matters to: a waiter, a holder, a unit to bring back."""
        return bool(self.waiters or self.holders or self.preempted or self.suspended)

    # -- status and persistence ---------------------------------------------------------------

    def snapshot(self, *, reasons: bool = True) -> Snapshot:
        """What status shows; with `reasons`, a waiter for busy GPUs says who holds them
        now (its journal line said who held them when it began to wait)."""
        gpus: dict[int, list[tuple[str, int, str]]] = {g: [] for g in sorted(self.gpus)}
        restarting = self.restart_keeps()
        for name, holder in sorted(self.holders.items()):
            state = RESTARTING if name in restarting else holder.phase.value
            for gpu in holder.gpus:
                gpus.setdefault(gpu, []).append((name, holder.spec.priority, state))
        told = {n: w.decision for n, w in self.waiters.items() if w.decision is not None}
        words = {n: w.reason for n, w in self.waiters.items()}
        busy = [
            w
            for w in self.waiters.values()
            if w.decision is not None and w.decision.cause is Cause.BUSY
        ]
        if reasons and busy:
            uses = self._uses([])
            for w in busy:
                told[w.spec.name] = self._blocked_reason(w, uses, fresh=True)
                words[w.spec.name] = reason(told[w.spec.name])
        waiting = [
            (w.spec.name, w.spec.priority, words[w.spec.name])
            for w in sorted(self.waiters.values(), key=lambda w: (w.spec.priority, w.seq))
        ]
        preempted = [
            (n, self._prio(n), self.specs[n].requeue if n in self.specs else False)
            for n in sorted(self.preempted, key=lambda n: (self._prio(n), self.preempted[n]))
        ]
        suspended = [
            (e.spec.name, e.spec.priority, self._where_now(e) or tuple(sorted(e.gpus)))
            for e in sorted(self.suspended.values(), key=lambda e: (e.spec.priority, e.seq))
        ]
        return Snapshot(
            gpus,
            waiting,
            preempted,
            sorted(self.held),
            sorted(self.finished),
            sorted(self.failed),
            told,
            suspended,
            sorted(self.remained),
            restarting,
        )

    def save(self) -> SavedState:
        return SavedState(
            holders={
                n: (tuple(sorted(h.gpus)), h.phase.value, h.seq, h.stopping_for or "")
                for n, h in self.holders.items()
            },
            preempted=dict(self.preempted),
            held=sorted(self.held),
            finished=sorted(self.finished),
            failed=sorted(self.failed),
            seq=self._seq,
            suspended={n: (tuple(sorted(e.gpus)), e.seq) for n, e in self.suspended.items()},
            frozen_for={
                n: sorted(h.frozen_for) for n, h in self.holders.items() if h.phase is Phase.FROZEN
            },
            started=sorted(n for n in self.started if self.phase(n) is Phase.STARTING),
            refills=sorted(
                n for n in self.refills & self.started if self.phase(n) is Phase.STARTING
            ),
            thaw_owed=self.thaws_owed(),
            requeued=sorted(n for n in self.requeued if self.phase(n) in (None, Phase.STARTING)),
            wait_failed=sorted(n for n in self.wait_failed if n in self.preempted),
            stopped_by_shutdown=sorted(self.stopped_by_shutdown),
            remained=sorted(self.remained),
            terms={
                **{
                    n: _terms(h.spec)
                    for n, h in self.holders.items()
                    if h.phase is not Phase.STARTING
                },
                **{n: _terms(e.spec) for n, e in self.suspended.items()},
            },
        )

    def load(self, saved: SavedState) -> list[Action]:
        """Restore what the last controller knew; the caller then reconciles with systemd.
        The records of units no longer annotated (their annotation went while no controller
        ran) are forgotten, as `set_specs` forgets them: what that says is returned, for the
        caller to carry out with its first decisions.

        Holders come back with their GPUs and phase, all at once, so that no unit is placed
        on GPUs a not-yet-adopted unit still holds. They keep GPUs not listed now, as
        `set_gpus` lets them: a restart that sees fewer GPUs (NVML not answering yet, so
        `gpus:` from config.yaml) must not hand the others out beside them once they are
        listed again. The caller reports with `inactive()` those systemd no longer shows
        active, then calls `schedule()`.
        """
        self._seq = max(self._seq, saved.seq)
        for name, (gpus, phase, seq, *rest) in saved.holders.items():
            stopping_for = rest[0] if rest and rest[0] else None
            spec = self.specs.get(name)
            if spec is None and Phase(phase) is Phase.STARTING and name in saved.started:
                # a start of ours whose annotation went while we were away: withdrawn, as
                # set_specs does (its gate, when it asks, is stopped; Gates.serve_gate)
                phase, stopping_for = Phase.STOPPING.value, None
            elif spec is None and Phase(phase) is Phase.STARTING:
                continue  # its start goes on ungated (set_specs)
            # no longer annotated, its job still runs there (or is being stopped, suspended,
            # resumed, or is frozen: `recover` thaws it), as set_specs keeps it
            spec = spec or _kept_terms(name, saved)
            self.holders[name] = Holder(spec, frozenset(gpus), Phase(phase), seq, stopping_for)
            if Phase(phase) is Phase.FROZEN:
                self.holders[name].frozen_for = set(saved.frozen_for.get(name, ()))
        for name, (gpus, seq) in saved.suspended.items():
            # kept even if no longer annotated: nobody else would ever resume it
            spec = self.specs.get(name) or _kept_terms(name, saved)
            self.suspended[name] = Suspended(spec, frozenset(gpus), seq)
        self.started = {n for n in saved.started if self.phase(n) is Phase.STARTING}
        self.refills = self.started & _saved_refills(saved)
        self.dormant -= self.holders.keys() | self.suspended.keys()  # someone started them
        self.thaw_owed = {n for n in saved.thaw_owed if self.phase(n) in _THAW_OWED_IN}
        self.preempted = dict(saved.preempted)
        self.held = set(saved.held)
        self.finished = set(saved.finished)
        self.failed = set(saved.failed)
        # an annotated unit holding nothing (the caller adopts one systemd shows running
        # again, not `exited`: Restore.rebuild), or one our stop ends (`exited`)
        self.remained = set(saved.remained) & self.specs.keys()
        self.remained -= self.suspended.keys()
        self.remained -= {n for n, h in self.holders.items() if h.phase is not Phase.STOPPING}
        # one saved waiting at its gate is no holder: its gate asks again (`request`). Its
        # start is ours as before (a waiter is not saved as started): withdrawn should its
        # annotation go (`set_specs`), owed should the shutdown end it (`inactive`)
        self.requeued = {
            n for n in saved.requeued if self.phase(n) in (None, Phase.STARTING) and n in self.specs
        } - self.recorded()
        self.started |= {n for n in self.requeued if self.phase(n) is None}
        self.wait_failed = {n for n in saved.wait_failed if n in self.preempted}
        # one whose refill was under way (ours, STARTING) keeps its name, as it did before
        # the restart: a start of it that does not happen is refill's again (`refills`)
        self.stopped_by_shutdown = {
            n for n in saved.stopped_by_shutdown if self._kept_for_refill(n)
        } - ((self.holders.keys() - self.started) | self.suspended.keys() | self.recorded())
        self.dormant -= self.stopped_by_shutdown  # someone started them before the shutdown
        return self._forget_unannotated({})

    def ended_with_boot(self, saved: SavedState) -> SavedState:
        """A state saved in an earlier boot, as `load` takes it: nothing it granted runs now,
        so its holders go. One preempted while it ran (being stopped, frozen, being suspended
        or resumed), or an on-demand unit or instance whose comeback gpuslice had started
        (refill starts a plain background unit anyway; one waiting at its gate is no holder,
        known by its requeue), lost its work with that boot as a suspended unit does
        (`forget_boot`): it counts as preempted. Dropped with the holders, it was never
        started again."""
        owed: dict[str, int] = {
            name: saved.seq
            for name in saved.requeued
            if name in self.specs and _owed_its_start(self.specs[name])
        }
        refills = _saved_refills(saved)
        for name, (_, phase, seq, *_) in saved.holders.items():
            spec = self.specs.get(name)
            if spec is None:
                continue  # one no longer annotated is owed nothing
            # a refill is none (`refills`): one of an instance the shutdown stopped is dormant,
            # as that one, and one of a unit turned on-demand since is owed nothing
            comeback = Phase(phase) is Phase.STARTING and name in saved.started
            comeback = comeback and name not in refills
            if (
                (comeback and _owed_its_start(spec))
                or Phase(phase) in PREEMPTED_IN_PLACE
                or Phase(phase) is Phase.STOPPING
            ):
                owed[name] = seq
        # one the shutdown stopped, owed nothing, is dormant as any instance learnt again
        return replace(
            saved,
            holders={},
            preempted={**owed, **saved.preempted},
            requeued=[],
            stopped_by_shutdown=[],
            remained=[],  # systemd keeps nothing active across a boot
        )

    def forget_boot(self) -> None:
        """A new boot: finished and failed units may run again; holds and preemptions stay.
        A suspended unit's processes and host memory went with the last boot: it was
        preempted and its work is lost, as a stopped one's (Requeue= decides whether it
        comes back). Kept suspended, systemd showed it down, and a suspended unit down was
        stopped by hand: held, and a background unit never ran again until someone started
        it."""
        self.finished.clear()
        self.failed.clear()
        self.remained.clear()
        for name, entry in self.suspended.items():
            if name in self.specs:  # one no longer annotated is owed nothing
                self.preempted.setdefault(name, entry.seq)
        self.suspended.clear()
