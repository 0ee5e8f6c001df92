"""A grant's way to its gate: the unit's environment file written first, then its gate answered.

The gate drop-in names the env file with `EnvironmentFile=-`: a unit started without one saw
every GPU, those granted to other units included. So a gate passes (at its pipe, and its calls
over D-Bus) only once the file names the GPUs the core books for the unit (`deliver`, and
`names_held` for a unit let through on GPUs still held for it). While the file cannot be
written (a full /run) the gate waits, its GPUs kept for it, and the write is tried again every
ENV_RETRY s; the journal says so once, and when it goes through. A unit resumed on GPUs NVML
numbered anew gets its file written anew (`tell_again`).

The controller decides who is granted (Controller.execute) and judges a gate again
(`ask_again`: Gates.acquire_verified); everything else is given: the core (its books),
the gate pipes, the gate calls in wait, the counters and the runtime_dir.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from gpuslice import envfiles
from gpuslice.core.placement import format_gpus
from gpuslice.core.scheduler import Phase, Scheduler
from gpuslice.counters import Counters
from gpuslice.gatepipes import GatePipes
from gpuslice.paths import env_file

log = logging.getLogger("gpuslice")

# How often a granted unit's environment file that could not be written (a full /run) is
# tried again while its gate waits (Delivery.deliver).
ENV_RETRY = 1.0


class GateCalls(Protocol):
    """The gate calls in wait (SchedulerService): answered, or still waiting."""

    def grant(self, unit: str, gpus: str) -> int: ...

    def pending(self, unit: str) -> bool: ...


class Delivery:
    """The grants whose gate waits for its env file (`withheld`: the timer of each retry),
    and the writes of the file before a gate passes."""

    def __init__(
        self,
        scheduler: Scheduler,
        gates: GatePipes,
        service: GateCalls,
        counters: Counters,
        runtime_dir: str,
        ask_again: Callable[[str], None],
    ) -> None:
        self.scheduler = scheduler
        self.gates = gates
        self.service = service
        self.counters = counters
        self.runtime_dir = runtime_dir  # this boot's, never changed (Controller._keep_paths)
        self.ask_again = ask_again
        # units whose gate waits for their environment file to be written: granted
        # (deliver), or let through on GPUs still held for them (Gates.let_through)
        self.withheld: dict[str, asyncio.TimerHandle] = {}
        # units kept active whose file naming no GPU could not be written (tell_none)
        self._unreleased: set[str] = set()

    def withdraw(self, unit: str) -> bool:
        """The retry of a withheld grant goes (the gate is judged anew); whether one was."""
        withheld = self.withheld.pop(unit, None)
        if withheld is not None:
            withheld.cancel()
        return withheld is not None

    def deliver(self, unit: str, gpus: Sequence[int], again: bool = False) -> None:
        """Let a granted unit's gate through once the unit's environment file says which
        GPUs are its own. Started without one, its processes saw every GPU, those granted
        to other units included. While the file cannot be written (a full /run) the gate
        waits, its GPUs kept for it, and the write is tried again every ENV_RETRY s; the
        journal says so once, and when it starts."""
        withheld = self.withdraw(unit)
        # granted again while withheld (its gate asked again): said once already, so said
        # again only when it goes through (a process of the unit calling in a loop wrote
        # an error line per call)
        again = again or withheld
        if not self._write_or_withhold(unit, again, self._deliver_withheld):
            return
        self.gates.grant(unit)  # counted when its gate took it (Controller._follow_gate)
        if self.service.grant(unit, ",".join(map(str, gpus))):
            self.counters.gate_answers["dbus"] += 1

    def names_held(self, unit: str, held: Sequence[int], again: bool) -> bool:
        """Whether the env file of a unit let through names the GPUs the core holds for it,
        written anew if need be (Gates.let_through); if it cannot be, the gate waits
        and is judged again in ENV_RETRY s (said once: `again` when it was said already)."""
        if sorted(envfiles.told_gpus(self.runtime_dir, unit)) == list(held):
            return True
        return self._write_or_withhold(unit, again, self._let_through_withheld)

    def _write_or_withhold(self, unit: str, again: bool, retry: Callable[[str], None]) -> bool:
        """Write the unit's env file from the core's books before its gate passes (`deliver`,
        `names_held`): by the UUIDs it was granted (`Scheduler.told`), as NVML may number
        the GPUs anew while a write is withheld, and index 0 then named another GPU, one
        another unit runs on. While it cannot be written (a full /run) the gate waits and
        `retry` judges it again in ENV_RETRY s; the journal says so once (`again`: said
        already), and when it goes through. Whether it was written."""
        path = env_file(self.runtime_dir, unit)
        try:
            envfiles.write(self.runtime_dir, unit, self.scheduler.told(unit))
        except OSError as e:
            if not again:
                log.error(
                    "cannot write %s (%s): %s waits at its gate until it can (tried again "
                    "every %g s)",
                    path,
                    e,
                    unit,
                    ENV_RETRY,
                )
            loop = asyncio.get_running_loop()
            self.withheld[unit] = loop.call_later(ENV_RETRY, retry, unit)
            return False
        if again:
            log.info("wrote %s: %s goes past its gate", path, unit)
        return True

    def tell_again(self, unit: str, gpus: Sequence[int]) -> None:
        """A unit resumed on GPUs its env file names by other indices (NVML numbered them
        anew while it was suspended: the same GPUs, by UUID) gets the file written anew:
        a restarted controller checks the GPUs it holds against the file
        (Restore.remember_told), and an index the file does not name would leave them
        unchecked. Its processes read the file at their start only: they keep the UUIDs they
        run on."""
        told = envfiles.told_uuids(self.runtime_dir, unit)
        if not told or sorted(told) == sorted(gpus):
            return
        try:
            envfiles.write(self.runtime_dir, unit, [self.scheduler.device(g) for g in sorted(gpus)])
        except OSError as e:
            log.warning(
                "cannot write %s (%s): it still names the GPUs of %s by the indices they had "
                "before NVML numbered them anew (%s)",
                env_file(self.runtime_dir, unit),
                e,
                unit,
                format_gpus(told),
            )

    def tell_none(self, unit: str) -> bool:
        """A unit released while systemd keeps it active (Scheduler.exited) gets a file naming
        no GPU: systemd reads it anew for each command it spawns (ExecReload=, ExecStop=),
        and the GPUs it named may be another unit's by then. Whether it was written; if not
        (a full /run), said once, the old file is kept: the unit keeps its GPUs until it is
        (gone, its commands saw every GPU)."""
        try:
            envfiles.write(self.runtime_dir, unit, [], keep_old=True)
        except OSError as e:
            if unit not in self._unreleased:
                self._unreleased.add(unit)
                log.warning(
                    "cannot write %s (%s): %s keeps its GPUs until it can (tried again every "
                    "30 s) or it is stopped",
                    env_file(self.runtime_dir, unit),
                    e,
                    unit,
                )
            return False
        self._unreleased.discard(unit)
        return True

    def went_down(self, unit: str) -> None:
        """A unit whose name may never come again is down (Instances.went_down): a file
        of a next run that cannot be written is said again. Kept, each instance (a name per
        job) that ended while /run was full stayed for good."""
        self._unreleased.discard(unit)

    def _deliver_withheld(self, unit: str) -> None:
        """Try a withheld grant again, if the unit still holds it and its gate was not let
        through meanwhile (a gate that asked again after a controller restart, say)."""
        self.withheld.pop(unit, None)
        gpus = self.scheduler.grants().get(unit)
        running = self.scheduler.phase(unit) is Phase.RUNNING
        if running and gpus is not None and not self.gates.answered(unit):
            self.deliver(unit, sorted(gpus), again=True)

    def _let_through_withheld(self, unit: str) -> None:
        """A gate held by `names_held` asks again, in effect: judged on what is known now
        (annotated again, preempted, down meanwhile), its file tried again if it is still
        let through (Gates.let_through takes over this retry)."""
        handle = self.withheld.get(unit)
        if self.service.pending(unit):
            self.ask_again(unit)
        if self.withheld.get(unit) is handle:  # judged otherwise: nothing left to retry
            self.withheld.pop(unit, None)
