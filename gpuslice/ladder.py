"""Carrying out the Preempt= ladder: freeze, suspend and resume units for the core.

The core decides who gives way and how (gpuslice/core/scheduler.py); this adapter does it
with systemd's freezer and cuda-checkpoint (gpuslice/checkpoint.py), checks with NVML that
the memory really left, and reports the outcome back as one of the core's events. Each
failure becomes one reason in words for the journal, and the core falls to the next rung;
nothing here raises into the event loop, and nothing is left locked or frozen by a failure.

Suspend, in this order (NVIDIA's and CRIU's findings, ../shared/notes/cuda-checkpoint.md):
check what can be checked first (the tool, NVML, cgroup v2, every process visible to NVML,
host memory, that nobody else froze the unit), lock every CUDA process of the unit,
checkpoint each, FreezeUnit for the CPU side, then confirm through NVML that no process of
it is on a GPU (frozen, none can reach one after that look). A failed suspend is undone:
ThawUnit if it was (or may have been) frozen, then restore and unlock; a process whose undo
failed is `lost` to the core, which stops the unit as after a failed resume. Resume: the
core has already reserved the unit's memory on its GPUs; ThawUnit (the restore runs inside
the process; sent again a few times while the bus fails for a moment, THAW_RETRY), restore,
unlock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuslice import checkpoint, clock
from gpuslice.cgroups import unit_of_pid
from gpuslice.checkpoint import CheckpointError, CheckpointSettings
from gpuslice.core.scheduler import Action
from gpuslice.inventory import GpuUse
from gpuslice.sizes import format_size
from gpuslice.systemd import SystemdError, is_transient
from gpuslice.tracker import UnitState
from gpuslice.unitfiles import printable

log = logging.getLogger("gpuslice")

# systemd's freezer needs the unified hierarchy; hybrid hosts have no cgroup.controllers here
UNIFIED_MARKER = Path("/sys/fs/cgroup/cgroup.controllers")
# systemd answers FreezeUnit once every process of the unit is frozen, and ThawUnit once every
# one is thawed: a process stuck in the kernel (in the driver, on a dead NFS server) never is,
# and then no answer comes at all. A call not answered within this counts as failed.
FREEZER_TIMEOUT = 30.0
# A ThawUnit that must work before cuda-checkpoint runs in the process (a restore, or the
# checkpoint of a unit frozen beside another) and failed for an error that passes (systemd
# re-executing, as Debian's upgrade of it does; the bus daemon's limits:
# gpuslice.systemd.TRANSIENT_ERRORS) is sent again after each of these waits, as the
# controller sends a job call again (Calls._call_not_taken). Taken for a refusal, it left
# the unit frozen: the restore failed and the job was stopped, its work lost. Bounded (15 s
# of waits, each call FREEZER_TIMEOUT at most): the resume must not hold the unit's GPUs
# forever, nor the suspend its waiter.
THAW_RETRY = (1.0, 2.0, 4.0, 8.0)
# After a controller restart a resume asks cuda-checkpoint the state of each process of the
# unit, one at a time (up to checkpoint.STATE_TIMEOUT each): a unit with more than this many
# fails its resume (and is stopped) rather than hold its reserved GPUs for hours (a user may
# fork thousands of idle processes).
MAX_RECOVERED_PIDS = 1024


class Freezer(Protocol):
    """What this module needs of gpuslice.systemd.Systemd."""

    async def freeze_unit(self, name: str) -> None: ...

    async def thaw_unit(self, name: str) -> None: ...

    async def freezer_state(self, name: str) -> str: ...

    async def unit_state(self, name: str) -> UnitState: ...

    async def unit_pids(self, name: str) -> list[int]: ...


class LadderEvents(Protocol):
    """The core's events this adapter reports (gpuslice.core.scheduler.Scheduler)."""

    def suspended_done(self, name: str, detail: str) -> list[Action]: ...

    def suspend_failed(
        self, name: str, why: str, *, lost: bool = False, not_ours: bool = False
    ) -> list[Action]: ...

    def resumed(self, name: str, detail: str) -> list[Action]: ...

    def resume_failed(self, name: str, why: str) -> list[Action]: ...

    def freeze_failed(self, name: str, why: str, *, not_ours: bool = False) -> list[Action]: ...

    def thawed_outside(self, name: str) -> list[Action]: ...

    def thaw_done(self, name: str) -> list[Action]: ...

    def froze_after_end(self, name: str) -> list[Action]: ...


@dataclass(frozen=True)
class Suspension:
    """A suspended unit as status shows it: what moved to host memory, and since when."""

    pids: tuple[int, ...]  # those its suspend checkpointed
    vram: int  # bytes now in host memory
    # clock.moment() when it was suspended: status shows it as a Unix time (clock.unix_time)
    since: float
    wall: float  # time.time() of the same moment, for the state file (`saved`)
    # read back from the state file by a controller started since (`recall`): the last
    # one's cuda-checkpoint runs may still be under way on its processes
    recalled: bool = False

    def saved(self) -> tuple[tuple[int, ...], int, float]:
        """What the state file keeps of it (SavedState.checkpointed)."""
        return self.pids, self.vram, self.wall


class Ladder:
    """Runs freezes, thaws, suspends and resumes as tasks (`busy` counts those under way).

    `processes` takes a fresh NVML sample and returns every GPU process with its unit (None
    when NVML is not available); `report` runs a core event and carries out its actions.
    """

    def __init__(
        self,
        systemd: Freezer,
        events: LadderEvents,
        processes: Callable[[], list[GpuUse] | None],
        settings: Callable[[], CheckpointSettings],
        report: Callable[[Callable[[], list[Action]]], None],
        *,
        unified_marker: Path = UNIFIED_MARKER,
        host_memory: Callable[[], int | None] = checkpoint.host_memory_available,
        unit_of_pid: Callable[[int], str | None] = unit_of_pid,
        freezer_timeout: float = FREEZER_TIMEOUT,
        sleep: Callable[[float], Coroutine[Any, Any, None]] = asyncio.sleep,
    ) -> None:
        self.systemd = systemd
        self.events = events
        self.processes = processes
        self.settings = settings
        self.report = report
        self.unified_marker = unified_marker
        self.host_memory = host_memory
        self.unit_of_pid = unit_of_pid
        self.freezer_timeout = freezer_timeout
        self.sleep = sleep  # THAW_RETRY's waits
        self.suspensions: dict[str, Suspension] = {}
        # units with a freeze, thaw, suspend or resume under way, and how many
        self.busy: dict[str, int] = {}
        # units owed a thaw whose ThawUnit failed, said once (a warning) until one works
        self.thaw_failing: set[str] = set()
        # bytes the suspends under way are moving to host memory: not yet out of MemAvailable
        self.moving = 0
        # the run of each busy unit that its freezes, suspends and resumes act for (`_run_of`)
        self.runs: dict[str, object] = {}

    def checkpointed(self, units: Collection[str]) -> dict[str, tuple[tuple[int, ...], int, float]]:
        """What the suspends of `units` (those the core keeps suspended) checkpointed, for the
        state file: a controller started since resumes exactly those (`recall`)."""
        return {u: s.saved() for u, s in self.suspensions.items() if u in units}

    def recall(self, saved: Mapping[str, tuple[tuple[int, ...], int, float]]) -> None:
        """After a controller restart within the boot it saved them in: what the last one's
        suspends checkpointed (`checkpointed`), for the units the core restored suspended.
        Their resume restores those PIDs that are still the unit's processes
        (`_still_its_own`: one freed and given to another unit's process is left alone),
        rather than asking the tool the state of each process of the unit: more than
        MAX_RECOVERED_PIDS of them failed the resume, and the unit was stopped."""
        now, wall_now = clock.moment(), time.time()
        for unit, (pids, vram, wall) in saved.items():
            since = now - max(0.0, wall_now - wall)  # for status alone: a clock step is cosmetic
            self.suspensions[unit] = Suspension(tuple(pids), vram, since, wall, recalled=True)

    def went_down(self, unit: str) -> None:
        """The unit's processes are gone: what a suspend of it kept is of no use (one entry
        per unit ever suspended, instances without end, kept until the controller exits).
        Its run is over: a step of it still under way sends systemd nothing more and reports
        nothing (_RunEnded). They know only the unit's name: a FreezeUnit or ThawUnit of the
        ended run's suspend landed on the next run (a restart, a start after the stop), and
        its report, ignored by the core, left that run frozen with nobody owing it a thaw."""
        self.suspensions.pop(unit, None)
        self.runs.pop(unit, None)

    def _run_of(self, unit: str) -> object:
        """The unit's run as a step that starts now knows it: ended by `went_down`."""
        return self.runs.setdefault(unit, object())

    def _ended(self, unit: str, run: object | None) -> bool:
        return run is not None and self.runs.get(unit) is not run

    # -- suspend ------------------------------------------------------------------------------

    def suspend(
        self, unit: str, thaw_first: bool = False, thaw_owed: bool = False
    ) -> Coroutine[Any, Any, None]:
        """Suspend the unit. One someone else froze (`systemctl freeze`) is left alone and
        reported failed, `not_ours`, before anything is sent: its lock timed out in the
        frozen processes, and the undo thawed their freeze (gpuslice thaws only what it
        froze); so is one found frozen once its lock or checkpoint failed, before any
        FreezeUnit (frozen by someone since the look). Not looked at when frozen beside a more
        urgent unit (`thaw_first`: that freeze is ours to undo), nor when a thaw of ours is
        owed to it (`thaw_owed`: frozen, it may be ours still, its ThawUnit under way or
        failed)."""
        run = self._run_of(unit)
        look = not thaw_first and not thaw_owed
        return self._run(unit, self._suspend_and_report(unit, thaw_first, look, run))

    async def _suspend_and_report(
        self, unit: str, thaw_first: bool, look: bool, run: object
    ) -> None:
        try:
            if thaw_first:  # frozen beside a more urgent unit: the tool needs it running
                await self._thaw_for_suspend(unit, run)
            done = await self._suspend(unit, run, look=look)
        except _RunEnded as e:
            self._ended_after(unit, e)
            return
        except Exception as e:  # a bug here must not leave the unit (and its waiter) stuck
            why = _reason(e, "suspending")
            # a process its undo could not restore cannot run again, whatever Preempt= says
            lost = isinstance(e, CheckpointError) and bool(e.lost)
            theirs = isinstance(e, _FrozenBySomeone)
            if not self._ended(unit, run):  # else the next run's to stop
                self.report(
                    lambda: self.events.suspend_failed(unit, why, lost=lost, not_ours=theirs)
                )
            return
        self.report(lambda: self.events.suspended_done(unit, done))

    def _ended_after(self, unit: str, e: _RunEnded) -> None:
        """A step whose run ended: nothing to report, but a thaw owed when its FreezeUnit
        may have frozen the next run."""
        log.info("%s went down during a step of its ladder: that step ends there", unit)
        if e.froze:
            self.report(functools.partial(self.events.froze_after_end, unit))

    async def _thaw_for_suspend(self, unit: str, run: object) -> None:
        await self._thaw_patiently(unit, "suspending", run)

    async def _suspend(self, unit: str, run: object | None = None, *, look: bool = True) -> str:
        """What the suspend did, in words; `look`: whether someone else froze it is read
        first (`suspend`)."""
        s = self.settings()
        tool = checkpoint.require_tool(s.tool, root_only=s.root_only)
        self._require_freezer()
        # before the sample and the host memory check: no wait between that check and
        # `moving`, nor a sample of the processes of a run that ended during the read
        if look:
            theirs = await self._frozen_by_someone(unit)
            if self._ended(unit, run):
                raise _RunEnded()
            if theirs:
                raise _FrozenBySomeone(theirs)
        pids, vram = self._cuda_processes(unit)
        moved = [p for p in pids if self.unit_of_pid(p) != unit]
        if moved:  # exited since the sample: its PID may be another unit's process by now
            raise CheckpointError(f"PID {moved[0]} is no longer a process of it")
        too_big = checkpoint.host_memory_fits(vram, s, self._host_memory_left())
        if too_big:
            if self.moving:
                too_big += f"; other suspends under way are moving {format_size(self.moving)} there"
            raise CheckpointError(f"not enough host memory: {too_big}")
        # counted until the copy is done (then MemAvailable shows it) or undone: two suspends
        # decided at once (one waiter's two victims) each found the other's memory available
        self.moving += vram
        try:
            try:
                seconds = await checkpoint.suspend(tool, pids, s, self._owned_by(unit))
            finally:
                self.moving -= vram
        except CheckpointError as e:
            # nothing of gpuslice's froze it: one frozen now was frozen since the look (of
            # its run: a next run's state says nothing of it, and it reports nothing)
            if look and not self._ended(unit, run):
                await self._frozen_since_look(unit, e)
            raise
        frozen = False
        try:
            await self._freezer("FreezeUnit", unit, run)
            frozen = True
            # After the freeze, not before: looked at first, a process of the unit that made
            # a CUDA context between the look and the freeze was missed, and stayed frozen on
            # the GPU given away. Frozen, none can make one now; still one sample, none more.
            self._confirm_gone(unit, pids)
        except _RunEnded:  # its processes went with the run: nothing to undo
            raise
        except Exception as e:  # a bus error is a reason, not a crash
            why = _reason(e, "suspending")
            if isinstance(e, _FreezerHung):  # half frozen: a restore would hang in it
                why += await self._thaw_after_hung_freeze(unit, run)
            elif frozen or isinstance(e, _FreezerTransient):
                # the restore runs in the process: thawed first; so too after a FreezeUnit
                # whose answer was lost (systemd re-executing once it froze the cgroup)
                why += await self._thaw_to_undo(unit, run)
            lost: tuple[int, ...] = ()
            try:
                await checkpoint.resume(tool, pids, s, self._owned_by(unit))
            except CheckpointError as undo:
                why += f"; and undoing the checkpoint failed: {undo.reason}"
                lost = undo.unsettled  # left locked or checkpointed: it never runs on
            raise CheckpointError(why, lost) from None
        self.suspensions[unit] = Suspension(pids, vram, clock.moment(), time.time())
        return f"{format_size(vram)} to host memory in {seconds:.1f} s"

    async def _frozen_since_look(self, unit: str, failed: CheckpointError) -> None:
        """After a lock or checkpoint that failed, before any FreezeUnit: a unit frozen now was
        frozen by someone else since the look (`systemctl freeze`: the lock timed out in the
        frozen processes). _FrozenBySomeone then, with what failed: told to the core as a
        plain failure, it owed the unit a thaw, which undid their freeze."""
        theirs = await self._frozen_by_someone(unit, "since")
        if theirs:
            raise _FrozenBySomeone(f"{failed.reason}; {theirs}", failed.lost) from None

    def _host_memory_left(self) -> int | None:
        """MemAvailable less what the suspends under way are still moving there."""
        available = self.host_memory()
        return None if available is None else max(0, available - self.moving)

    def _confirm_gone(self, unit: str, pids: tuple[int, ...]) -> None:
        """A fresh sample, taken once the unit is frozen, shows none of the checkpointed
        processes on a GPU, and no process of the unit either (one that started CUDA after
        the first sample was not checkpointed: frozen on its GPU, it would share it with the
        unit given way to)."""
        processes = self.processes()
        if processes is None:
            raise CheckpointError(
                "NVML is not available: the memory could not be confirmed gone after the checkpoint"
            )
        for p in processes:
            if p.pid in pids:
                raise CheckpointError(
                    f"NVML still shows PID {p.pid} on GPU {p.gpu} after the checkpoint"
                )
            if p.unit == unit:
                raise CheckpointError(
                    f"NVML shows PID {p.pid} of it on GPU {p.gpu} after the checkpoint: a "
                    "process started on a GPU meanwhile"
                )

    def _cuda_processes(self, unit: str) -> tuple[tuple[int, ...], int]:
        """The unit's processes on GPUs, from a fresh sample, and the bytes they use; every
        case in which the memory could not be confirmed gone afterwards is refused."""
        processes = self.processes()
        if processes is None:
            raise CheckpointError("NVML is not available: the memory could not be confirmed")
        mine = [p for p in processes if p.unit == unit]
        if not mine:
            raise CheckpointError("NVML shows no process of it on a GPU: nothing to suspend")
        unseen = [p for p in mine if p.used is None]
        if unseen:
            raise CheckpointError(
                f"NVML does not report the memory of PID {unseen[0].pid}: the memory could "
                "not be confirmed"
            )
        pids = tuple(dict.fromkeys(p.pid for p in mine))
        return pids, sum(p.used or 0 for p in mine)

    # -- resume -------------------------------------------------------------------------------

    def resume(self, unit: str) -> Coroutine[Any, Any, None]:
        run = self._run_of(unit)
        return self._run(unit, self._resume_and_report(unit, run))

    async def _resume_and_report(self, unit: str, run: object) -> None:
        try:
            done = await self._resume(unit, run)
        except _RunEnded as e:
            self._ended_after(unit, e)
            return
        except Exception as e:  # never left frozen with nobody responsible for it
            why = _reason(e, "resuming")
            if not self._ended(unit, run):  # else the next run's to stop
                self.report(lambda: self.events.resume_failed(unit, why))
            return
        if not self._ended(unit, run):
            self.report(lambda: self.events.resumed(unit, done))

    async def _resume(self, unit: str, run: object) -> str:
        suspension = self.suspensions.pop(unit, None)
        if suspension is None:
            done = await self.restore(unit, run=run)
            if done is None:  # the last controller may have checkpointed it: never "resumed"
                raise CheckpointError(_NO_TOOL)
            return f"a controller restart: {resumed_words(done)}"
        done = await self.restore(unit, suspension.pids, run, recalled=suspension.recalled)
        away = clock.moment() - suspension.since  # a host sleep meanwhile counts
        return f"{away:.0f} s: {resumed_words(done)}"

    async def restore(
        self,
        unit: str,
        pids: Sequence[int] | None = None,
        run: object | None = None,
        *,
        recalled: bool = False,
    ) -> checkpoint.Resumed | None:
        """ThawUnit, then restore and unlock `pids` (those a controller checkpointed,
        `recalled` from the state file when an earlier one did; None after a restart that
        kept none: those of the unit that cuda-checkpoint knows). What was done; None
        when `pids` is None and there is no tool (what is checkpointed cannot be told: both
        callers take it for a failure); CheckpointError when it failed
        (`restored` on it: what is back on a GPU all the same). `resume` reports it to the
        core; `gpuslice release-jobs`, which has none, calls it itself. `run`: the run it is
        for (_RunEnded once it ended)."""
        s = self.settings()
        try:  # before the restore: it runs in the process
            await self._thaw_patiently(unit, "resuming", run)
        except CheckpointError as e:  # a bus error is a reason, not a crash
            # (none when it was stopped meanwhile); one not answered, or failing still
            # after THAW_RETRY, may leave it frozen, and then its restore fails: the journal
            # says why first
            left_frozen = isinstance(e, _FreezerHung | _FreezerTransient)
            level = logging.WARNING if left_frozen else logging.DEBUG
            log.log(level, "resuming %s: %s", unit, e.reason)
        tool = checkpoint.find_tool(s.tool)
        if tool is None:
            if pids is None:
                return None
            raise CheckpointError(_NO_TOOL)
        checkpoint.check_tool(tool, s.root_only)
        if pids is None:
            pids = await self._recovered_pids(unit, tool, s.via_systemd)
        else:
            pids = self._still_its_own(unit, pids)
            if recalled and s.via_systemd:
                await self._stop_earlier_runs(unit, pids)
        # ended while they were listed and asked after (a restart's): those may be the next
        # run's processes, and one its own suspend checkpointed meanwhile would be restored
        if self._ended(unit, run):
            raise _RunEnded()
        return await checkpoint.resume(tool, pids, s, self._owned_by(unit))

    def _owned_by(self, unit: str) -> checkpoint.Owned:
        """The look `checkpoint` takes right before each run of the tool on a PID: its cgroup
        is the unit's still (`unit_of_pid`, as `_still_its_own` looked first). Said once a
        PID: a suspend's undo of its locks looks again at the one that failed it."""
        said: set[int] = set()

        def owned(pid: int) -> bool:
            if self.unit_of_pid(pid) == unit:
                return True
            if pid not in said:
                said.add(pid)
                log.info("%s: PID %d is no longer a process of it: left alone", unit, pid)
            return False

        return owned

    def _still_its_own(self, unit: str, pids: Sequence[int]) -> list[int]:
        """The PIDs a suspend checkpointed that are still the unit's processes. One killed
        meanwhile (frozen processes die of SIGKILL; thawed by hand, they may exit) frees its
        PID, and the host may give it to another unit's process: one locked or checkpointed
        by its own suspend was restored or unlocked by this resume, beside its own ladder's
        work (onto a GPU given away, or a frozen process whose restore never returns). One
        whose unit cannot be told is left alone too: gone, there is nothing to resume; still
        there, it may be a user's process in a delegated cgroup whose name forges the file
        (a newline in it), and root would run cuda-checkpoint on it."""
        owners = {p: self.unit_of_pid(p) for p in pids}
        others = [p for p, owner in owners.items() if owner not in (unit, None)]
        if others:
            log.info("resuming %s: PIDs %s are other units' processes now", unit, others)
        unknown = [p for p, owner in owners.items() if owner is None]
        # looked at after the cgroup: one that exits between the two reads counts as gone
        there = [p for p in unknown if _exists(p)]
        if there:
            log.warning(
                "resuming %s: the cgroup of PIDs %s cannot be read as its own: not resumed",
                unit,
                there,
            )
        gone = [p for p in unknown if p not in there]
        if gone:
            log.debug("resuming %s: PIDs %s are gone", unit, gone)
        return [p for p in pids if owners[p] == unit]

    async def _recovered_pids(self, unit: str, tool: str, via_systemd: bool) -> list[int]:
        """After a controller restart: the processes of the unit that cuda-checkpoint knows
        (the others are no CUDA processes). One whose state the tool gave no answer for
        (StateUnread) may be checkpointed: skipped, it blocked in its next CUDA call for good
        while the unit counted as resumed; the resume fails (and the unit is stopped)."""
        try:
            pids = await self.systemd.unit_pids(unit)
        except Exception as e:
            raise CheckpointError(f"cannot list its processes: {e}") from None
        if len(pids) > MAX_RECOVERED_PIDS:
            raise CheckpointError(
                f"it has {len(pids)} processes, more than the {MAX_RECOVERED_PIDS} whose "
                f"state {checkpoint.TOOL_NAME} is asked after a controller restart"
            )
        if via_systemd:
            await self._stop_earlier_runs(unit, pids)
        known = []
        for pid in pids:
            try:
                await checkpoint.get_state(tool, pid, via_systemd)
            except checkpoint.StateUnread as e:
                if _exists(pid):  # one that has exited needs nothing
                    raise CheckpointError(f"{e.reason}: it may be checkpointed") from None
                continue
            except CheckpointError:
                continue
            known.append(pid)
        return known

    async def _stop_earlier_runs(self, unit: str, pids: Sequence[int]) -> None:
        """After a controller restart: a run the last controller left must not land after
        this resume (a lock or a checkpoint then blocked the job in its next CUDA call)."""
        problem = await checkpoint.stop_earlier_runs(pids)
        if problem:
            log.warning(
                "resuming %s: cuda-checkpoint runs an earlier controller left on its "
                "processes %s (systemd ends them at their RuntimeMaxSec=)",
                unit,
                problem,
            )

    # -- freeze and thaw ----------------------------------------------------------------------

    def _require_freezer(self) -> None:
        if not self.unified_marker.exists():
            raise CheckpointError("cgroup v1 (hybrid hierarchy): systemd cannot freeze units")

    def freeze(self, unit: str, thaw_owed: bool = False) -> Coroutine[Any, Any, None]:
        """FreezeUnit, unless someone else froze it already (not when a thaw of ours is owed
        to it, `thaw_owed`: frozen, it may be ours still): systemd takes a FreezeUnit of a
        frozen unit for done, and the thaw that followed undid an admin's `systemctl
        freeze` (gpuslice thaws only what it froze)."""
        run = self._run_of(unit)
        return self._run(unit, self._freeze_and_report(unit, thaw_owed, run))

    async def _freeze_and_report(self, unit: str, thaw_owed: bool, run: object) -> None:
        try:
            await self._freeze(unit, thaw_owed, run)
        except _RunEnded as e:
            self._ended_after(unit, e)

    async def _freeze(self, unit: str, thaw_owed: bool, run: object) -> None:
        try:
            self._require_freezer()
            if not thaw_owed and (why := await self._frozen_by_someone(unit)):
                if self._ended(unit, run):  # read of its next run: nothing to tell
                    raise _RunEnded()
                self.report(lambda: self.events.freeze_failed(unit, why, not_ours=True))
                return
            await self._freezer("FreezeUnit", unit, run)
        except _RunEnded:
            raise
        except Exception as e:
            why = _reason(e, "freezing")
            if isinstance(e, _FreezerHung):  # left half frozen, and the core takes it running
                why += await self._thaw_after_hung_freeze(unit, run)
            self.report(lambda: self.events.freeze_failed(unit, why))

    def thaw(self, unit: str) -> Coroutine[Any, Any, None]:
        return self._run(unit, self._thaw(unit))

    async def _thaw(self, unit: str) -> None:
        try:
            await self._freezer("ThawUnit", unit)
        except CheckpointError as e:
            self.thaw_failing.add(unit)
            log.warning(
                "thawing %s: %s (tried again at each sample; systemctl thaw %s thaws it)",
                unit,
                e.reason,
                unit,
            )
            return
        self.report(functools.partial(self.events.thaw_done, unit))

    async def _frozen_by_someone(self, unit: str, when: str = "already") -> str:
        """Why the unit, which gpuslice holds running, is not frozen by gpuslice: someone
        froze it (`systemctl freeze`); "" when systemd shows it running, or cannot be read
        (taken for running, as before this look); `when` it was frozen, in words: before the
        suspend, or since its look (`_frozen_since_look`). Frozen, it is theirs to thaw:
        systemd takes a FreezeUnit of a frozen unit for done, and the thaw gpuslice owed after
        that undid their freeze; a suspend's lock times out in it, and the undo thawed it
        (gpuslice thaws only what it froze)."""
        try:
            state = await asyncio.wait_for(self.systemd.freezer_state(unit), self.freezer_timeout)
        except Exception as e:
            log.debug("FreezerState of %s: %s", unit, e)
            return ""
        if state not in ("frozen", "freezing"):
            return ""
        # one of the two words above: nothing of the bus's to escape
        return f"{state} {when}, by someone else (systemctl freeze): theirs to thaw"

    async def _freezer(self, what: str, unit: str, run: object | None = None) -> None:
        """FreezeUnit or ThawUnit (`what`), answered within `freezer_timeout`; else
        CheckpointError (_FreezerHung when no answer came). For a `run` (`_run_of`) that has
        ended: not sent, or answered after its end, _RunEnded (whatever the answer: a
        FreezeUnit then may have frozen the next run)."""
        if self._ended(unit, run):
            raise _RunEnded()
        failed: CheckpointError | None = None
        try:
            await self._send(what, unit)
        except CheckpointError as e:
            failed = e
        if self._ended(unit, run):
            raise _RunEnded(froze=what == "FreezeUnit")
        if failed is not None:
            raise failed

    async def _send(self, what: str, unit: str) -> None:
        try:
            call = self.systemd.freeze_unit if what == "FreezeUnit" else self.systemd.thaw_unit
            await asyncio.wait_for(call(unit), self.freezer_timeout)
        except TimeoutError:
            raise _FreezerHung(f"{what} did not answer within {self.freezer_timeout:g} s") from None
        except SystemdError as e:
            if is_transient(e):
                raise _FreezerTransient(f"{what} failed: {e}") from None
            raise CheckpointError(f"{what} failed: {e}") from None
        except Exception as e:  # a bus error is a reason, not a crash
            raise CheckpointError(f"{what} failed: {e}") from None

    async def _thaw_patiently(self, unit: str, doing: str, run: object | None = None) -> None:
        """ThawUnit, sent again after each of THAW_RETRY's waits while it fails for an error
        that passes; else CheckpointError, as `_freezer`. One not answered (_FreezerHung: a
        process stuck in the kernel, which a second call would not thaw) and systemd's
        refusal (the unit stopped meanwhile) are not sent again."""
        for delay in THAW_RETRY:
            try:
                return await self._freezer("ThawUnit", unit, run)
            except _FreezerTransient as e:
                log.debug("%s %s: %s; sent again in %g s", doing, unit, e.reason, delay)
            await self.sleep(delay)
        try:
            await self._freezer("ThawUnit", unit, run)
        except _FreezerTransient as e:
            raise _FreezerTransient(f"{e.reason} (sent {len(THAW_RETRY) + 1} times)") from None

    async def _thaw_to_undo(self, unit: str, run: object) -> str:
        """ThawUnit before the undo of a suspend whose FreezeUnit worked (sent again while it
        fails for an error that passes, as before a restore); what to add to the reason."""
        try:
            await self._thaw_patiently(unit, "suspending", run)
        except CheckpointError as e:
            return f"; and {e.reason} (thaw it with systemctl thaw {unit})"
        return ""

    async def _thaw_after_hung_freeze(self, unit: str, run: object) -> str:
        """ThawUnit after a FreezeUnit that got no answer (it ends the freeze systemd still
        waits for); what to add to the reason."""
        try:
            await self._freezer("ThawUnit", unit, run)
        except CheckpointError as e:
            return f"; and {e.reason} (thaw it with systemctl thaw {unit})"
        return ": thawed again"

    # -- a thaw by hand -----------------------------------------------------------------------

    async def check_thawed(self, units: list[str]) -> None:
        """Ask systemd which of these frozen units someone thawed by hand (systemd 252 signals
        no FreezerState change); a unit with an operation of ours under way is not asked.
        One found `running` is read again: systemd thaws a unit as its stop begins, which
        leaves `active` at once, but signals it later than it answers. Shown `active` (or
        `reloading`) after the thaw, no stop had thawed it; taken for a thaw by hand on the
        first read alone, a frozen unit being stopped ended owed nothing (a stop of ours) or
        failed on its 143 (someone's), where its `deactivating` signal came after the read
        was sent. One that cannot be read is asked again at the next sample."""
        async for unit, state in self._freezer_states(units):
            if state != "running":
                continue
            try:
                active = (await self.systemd.unit_state(unit)).active
            except Exception as e:
                log.debug("ActiveState of %s: %s", unit, e)
                continue
            if active in ("active", "reloading") and unit not in self.busy:
                self.report(functools.partial(self.events.thawed_outside, unit))

    async def _freezer_states(self, units: list[str]) -> AsyncIterator[tuple[str, str]]:
        """Each unit's FreezerState, for those with no operation of ours under way before
        the read or after it (the core froze, suspended or resumed it meanwhile); a unit
        whose read fails is gone meanwhile, and its inactive state says so."""
        for unit in units:
            if unit in self.busy:
                continue
            try:
                state = await self.systemd.freezer_state(unit)
            except Exception as e:
                log.debug("FreezerState of %s: %s", unit, e)
                continue
            if unit not in self.busy:
                yield unit, state

    async def thaw_owed(self, units: list[str]) -> None:
        """Units gpuslice froze and no longer holds frozen, not yet seen running (a ThawUnit
        that failed or got no answer; one a killed controller never sent; a freeze or suspend
        that failed half way): each that systemd shows frozen (or freezing, thawing) is
        thawed, with a journal line that says why; one shown running is owed nothing more.
        A unit with an operation of ours under way is left to it."""
        self.thaw_failing &= set(units)  # one no longer owed (it went down) is not said
        async for unit, state in self._freezer_states(units):
            if state == "running":
                self.thaw_failing.discard(unit)
                self.report(functools.partial(self.events.thaw_done, unit))
            else:
                await self._run(unit, self._thaw_left(unit, state))

    async def _thaw_left(self, unit: str, state: str) -> None:
        try:
            await self._freezer("ThawUnit", unit)
        except CheckpointError as e:
            level = logging.DEBUG if unit in self.thaw_failing else logging.WARNING
            self.thaw_failing.add(unit)
            log.log(
                level,
                "thawing %s, %s though gpuslice no longer holds it frozen: %s (tried again at "
                "each sample; systemctl thaw %s thaws it)",
                unit,
                printable(state, 20),
                e.reason,
                unit,
            )
            return
        self.thaw_failing.discard(unit)
        log.info(
            "thawed %s: systemd showed it %s, and gpuslice, which froze it, no longer holds "
            "it frozen",
            unit,
            printable(state, 20),
        )
        self.report(functools.partial(self.events.thaw_done, unit))

    def _run(self, unit: str, work: Coroutine[Any, Any, None]) -> Coroutine[Any, Any, None]:
        """The unit counts as busy from now (before its task first runs: a check of thaws by
        hand in between must not take our own freeze, not yet sent, for one), until done."""
        self.busy[unit] = self.busy.get(unit, 0) + 1

        async def run() -> None:
            try:
                await work
            finally:
                left = self.busy.get(unit, 1) - 1
                if left:
                    self.busy[unit] = left
                else:
                    self.busy.pop(unit, None)
                    self.runs.pop(unit, None)

        return run()


def resumed_words(done: checkpoint.Resumed | None) -> str:
    """What a resume did (`Ladder.restore`), in the journal's words and release-jobs':
    "restored" only when cuda-checkpoint restored a process. A resume that found none
    checkpointed (every PID exited, or none whose state the tool could read) is no
    restore, whatever the time it took."""
    if done is None:
        return "nothing to restore without cuda-checkpoint"
    if done.restored:
        return f"restored in {done.seconds:.1f} s"
    if done.unlocked:
        return (
            f"unlocked in {done.seconds:.1f} s: cuda-checkpoint found no process of it "
            "checkpointed, nothing restored"
        )
    return "cuda-checkpoint found no process of it checkpointed or locked: nothing restored"


_NO_TOOL = "cuda-checkpoint is not installed any more: cannot restore"


class _FreezerHung(CheckpointError):
    """FreezeUnit or ThawUnit got no answer in time: the unit may be half frozen."""


class _FrozenBySomeone(CheckpointError):
    """The unit to suspend is frozen by someone else (`systemctl freeze`): theirs to thaw."""


class _RunEnded(Exception):
    """The unit went down (or was restarted) during a step of its ladder (`Ladder.went_down`):
    what the step would still do would land on its next run. `froze`: a FreezeUnit of the
    step was answered after the end (it may have frozen the next run: a thaw is owed)."""

    def __init__(self, froze: bool = False) -> None:
        super().__init__()  # never shown: each step's `except _RunEnded` ends it
        self.froze = froze


class _FreezerTransient(CheckpointError):
    """FreezeUnit or ThawUnit failed for an error that passes (gpuslice.systemd.is_transient):
    the same call may work a moment later."""


def _exists(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether process `pid` is there (a zombie too)."""
    return (proc / str(pid)).exists()


def _reason(error: Exception, doing: str) -> str:
    if isinstance(error, CheckpointError):
        return error.reason
    log.error("%s failed unexpectedly", doing, exc_info=error)
    return f"gpuslice failed while {doing} ({type(error).__name__}: {error})"
