"""What is on the GPUs right now: NVML samples turned into the core's `Gpu` values.

A process on a GPU belongs to the unit whose cgroup it runs in (/proc/PID/cgroup, read by
systemd's own rule in gpuslice.cgroups), never to whatever its command line looks like: seed
001 learned that "busy" must exclude one's own workers. Processes of no managed unit are
foreign (a user's `systemd-run --user --unit=x` belongs to user@UID.service, whatever x is);
their memory counts against the GPU. Without NVML the GPUs are the configured count, every
one of unknown size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice.cgroups import unit_of_pid as unit_of_pid  # re-exported: callers import it here
from gpuslice.config import Config
from gpuslice.core.model import Gpu
from gpuslice.nvml import DeviceScan, GpuLostError, Nvml, NvmlError
from gpuslice.sizes import format_size

log = logging.getLogger("gpuslice")


@dataclass(frozen=True)
class GpuUse:
    """One process on one GPU, attributed to its unit (None: foreign)."""

    pid: int
    gpu: int
    used: int | None
    unit: str | None
    command: str


@dataclass
class Sample:
    gpus: list[Gpu]
    processes: list[GpuUse] = field(default_factory=list)
    taken_at: float = 0.0

    def age(self, now: float) -> float:
        return now - self.taken_at

    def used_by(self, unit: str) -> dict[int, int]:
        """Bytes the unit's processes actually use, per GPU."""
        out: dict[int, int] = {}
        for p in self.processes:
            if p.unit == unit and p.used is not None:
                out[p.gpu] = out.get(p.gpu, 0) + p.used
        return out


def command_of(pid: int, proc: Path = Path("/proc")) -> str:
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


class Inventory:
    """Owns the Nvml handle; `sample()` answers "what is on each GPU" in one go."""

    def __init__(
        self,
        config: Config,
        nvml: Nvml | None = None,
        clock: Callable[[], float] = time.monotonic,
        proc: Path = Path("/proc"),
    ) -> None:
        self.config = config
        self.nvml = nvml or Nvml()
        self.clock = clock
        self.proc = proc
        self.available = False
        self._gone_since: dict[int, float] = {}
        self._overrun_logged: set[int] = set()
        self._lost_logged: set[int] = set()
        self._last: Sample | None = None  # the last good sample, kept while NVML fails
        self._failing = False

    def open(self) -> None:
        status = self.nvml.open(fallback=f"gpus: {self.config.gpus} from config.yaml")
        self.available = status.available
        if status.warning:
            log.warning("%s", status.warning)

    def _managed(self, index: int, uuid: str) -> bool:
        wanted = self.config.manage_gpus
        return not wanted or str(index) in wanted or uuid in wanted

    def sample(
        self, managed_units: Collection[str], holding: Mapping[str, Collection[int]] | None = None
    ) -> Sample:
        """The GPUs with foreign use filled in, and every GPU process with its unit.

        `holding` says which GPUs each unit holds: a managed unit's process on a GPU it does
        not hold (left behind after a stop with KillMode=process, say) is not foreign, but
        its memory counts against the GPU like foreign memory, since no declaration covers it.
        """
        now = self.clock()
        if not self.available:
            return Sample([Gpu(i) for i in range(self.config.gpus)], taken_at=now)
        try:
            sample = self._build(self.nvml.devices(), managed_units, holding or {}, now)
        except NvmlError as e:
            if not self._failing:  # once per failure spell: sampling repeats every interval
                log.error("NVML failed (%s): keeping the GPUs as they were", e)
            self._failing = True
            if self._last is not None:
                return self._last
            return Sample([Gpu(i) for i in range(self.config.gpus)], taken_at=now)
        if self._failing:
            log.info("NVML answers again")
        self._failing = False
        self._last = sample
        return sample

    def _build(
        self,
        scan: DeviceScan,
        managed_units: Collection[str],
        holding: Mapping[str, Collection[int]],
        now: float,
    ) -> Sample:
        gpus: list[Gpu] = []
        processes: list[GpuUse] = []
        for lost in scan.lost:
            if lost not in self._lost_logged:
                self._lost_logged.add(lost)
                log.error(
                    "GPU %d is lost (it stopped answering NVML): nothing new runs on it", lost
                )
            gpus.append(Gpu(lost, lost=True))
        seen_gone: set[int] = set()
        for info in scan.gpus:
            if not self._managed(info.index, info.uuid):
                continue
            try:
                found = self.nvml.processes(info.index)
            except GpuLostError:
                gpus.append(Gpu(info.index, info.uuid, info.name, lost=True))
                continue
            foreign = 0
            foreign_pids: list[int] = []
            for proc in found:
                unit = unit_of_pid(proc.pid, self.proc)
                alive = (self.proc / str(proc.pid)).exists()
                if not alive and not self._still_releasing(
                    proc.pid, proc.used_memory, info.index, now
                ):
                    seen_gone.add(proc.pid)
                    continue
                if not alive:
                    seen_gone.add(proc.pid)
                owned = unit is not None and unit in managed_units
                processes.append(
                    GpuUse(
                        proc.pid,
                        info.index,
                        proc.used_memory,
                        unit if owned else None,
                        command_of(proc.pid, self.proc),
                    )
                )
                if not owned:
                    foreign += proc.used_memory or 0
                    foreign_pids.append(proc.pid)
                elif info.index not in holding.get(unit or "", ()):
                    foreign += proc.used_memory or 0  # a stray of a unit not holding this GPU
            gpus.append(
                Gpu(
                    info.index,
                    info.uuid,
                    info.name,
                    total=info.memory_total,
                    reserve=self.config.reserve_for(info.index, info.uuid),
                    foreign=foreign,
                    foreign_pids=tuple(foreign_pids),
                    used=info.memory_used,
                )
            )
        for pid in set(self._gone_since) - seen_gone:
            del self._gone_since[pid]
            self._overrun_logged.discard(pid)
        return Sample(sorted(gpus, key=lambda g: g.index), processes, now)

    def _still_releasing(self, pid: int, used: int | None, gpu: int, now: float) -> bool:
        """An exited process NVML still lists: its VRAM counts until the configured bound."""
        if pid not in self._gone_since:
            self._gone_since[pid] = now
            log.info(
                "GPU %d still lists exited PID %d (%s): counting it until released, at most "
                "%g s (vram_release_timeout)",
                gpu,
                pid,
                format_size(used or 0),
                self.config.vram_release_timeout,
            )
        if now - self._gone_since[pid] < self.config.vram_release_timeout:
            return True
        if pid not in self._overrun_logged:
            self._overrun_logged.add(pid)
            log.warning(
                "GPU %d still shows %s for exited PID %d after %g s "
                "(vram_release_timeout): no longer counting it",
                gpu,
                format_size(used or 0),
                pid,
                self.config.vram_release_timeout,
            )
        return False
