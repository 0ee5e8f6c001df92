"""What is on the GPUs right now: NVML samples turned into the core's `Gpu` values.

A process on a GPU belongs to the unit whose cgroup it runs in (/proc/PID/cgroup, read by
systemd's own rule in gpuslice.cgroups), never to whatever its command line looks like: seed
001 learned that "busy" must exclude one's own workers. Processes of no managed unit are
foreign (a user's `systemd-run --user --unit=x` belongs to user@UID.service, whatever x is);
their memory counts against the GPU. Without NVML the GPUs are the configured count, every
one of unknown size.

`Health` says which NVML case applies (gpuslice.driver tells the last two apart):
  ready     NVML answers: real GPUs, memory packing, foreign-process protection;
  waiting   NVIDIA hardware or driver present, NVML not ready yet (module loading, nodes
            missing, nvidia-persistenced starting) or gone (module unloaded, `nvidia-smi -r`):
            the controller retries with a back-off and holds background units back;
  fallback  still waiting after `driver_wait`: background units run on the fallback GPUs;
  absent    no NVIDIA GPU here (no PCI device, no module): `gpus:` from config.yaml.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice.cgroups import cgroup_path_of_pid, unit_of_cgroup_path
from gpuslice.cgroups import unit_of_pid as unit_of_pid  # re-exported: callers import it here
from gpuslice.config import Config
from gpuslice.core.decisions import listed
from gpuslice.core.model import Gpu
from gpuslice.core.placement import format_gpus
from gpuslice.driver import (
    DriverProbe,
    device_denied,
    frontend_registered,
    probe,
    root_from_env,
)
from gpuslice.nvml import DeviceScan, GpuLostError, Nvml, NvmlError, NvmlUnavailableError
from gpuslice.owners import UNKNOWN, Owner, owner_of_cgroup_path
from gpuslice.sizes import format_size
from gpuslice.unitfiles import printable

log = logging.getLogger("gpuslice")

# Bytes read of /proc/PID/comm: the kernel keeps 15 (TASK_COMM_LEN), 64 for some threads.
COMM_MAX = 256


@dataclass(frozen=True)
class GpuUse:
    """One process on one GPU, attributed to its unit (None: foreign); a foreign process's
    owner says whose it is (a Slurm job, a pod, a unit gpuslice does not manage); `compute`
    False for a graphics-only process (a display server: background units stay beside it)."""

    pid: int
    gpu: int
    used: int | None
    unit: str | None
    command: str
    owner: Owner | None = None
    compute: bool = True


READY = "ready"
WAITING = "waiting"
FALLBACK = "fallback"
ABSENT = "absent"

# What `Inventory.adopt` takes of a call that answered late: NVML's session, as it left it
_SESSION = (
    "available",
    "driver",
    "_reason",
    "_opened_with",
    "_failing",
    "_frontend_at_start",
    "restart_needed",
)


@dataclass
class Health:
    """Which NVML case applies now (see the module's docstring); `since` is wall-clock
    seconds (Unix time) of the last change, `detail` one line on why."""

    state: str = ABSENT
    since: float = 0.0
    detail: str = ""
    driver_version: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "state": self.state,
            "since": round(self.since, 3),
            "detail": self.detail,
            "driver_version": self.driver_version,
        }


@dataclass
class Sample:
    gpus: list[Gpu]
    processes: list[GpuUse] = field(default_factory=list)
    taken_at: float = 0.0
    health: Health | None = None  # the inventory's (shared, current) NVML case

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
    """The process's name, escaped for a journal line or a terminal; "?" when it is gone.

    /proc/PID/comm holds whatever the process set (prctl(PR_SET_NAME): 15 bytes, any but
    NUL), and any local user may run a process on a GPU: a name that is no UTF-8 raised out
    of every sample, and a terminal's control sequence reached `gpuslice status` as is."""
    try:
        with open(proc / str(pid) / "comm", "rb") as f:
            raw = f.read(COMM_MAX)
    except (OSError, ValueError):
        return "?"
    return printable(raw.decode("utf-8", "backslashreplace").strip(), COMM_MAX)


class Inventory:
    """Owns the Nvml handle; `sample()` answers "what is on each GPU" in one go."""

    def __init__(
        self,
        config: Config,
        nvml: Nvml | None = None,
        clock: Callable[[], float] = time.monotonic,
        proc: Path = Path("/proc"),
        driver_root: Path | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.nvml = nvml or Nvml()
        self.clock = clock
        self.proc = proc
        self.available = False
        self.health = Health(since=wall())
        self.driver_root = driver_root or root_from_env()
        self.wall = wall
        self.driver = DriverProbe()
        self._gone_since: dict[int, float] = {}
        self._overrun_logged: set[int] = set()
        self._lost_logged: set[int] = set()
        self._gone_logged: set[int] = set()
        # The UUID each held GPU index named when its units were granted it (`_as_booked`)
        self._booked: dict[int, str] = {}
        self._renumbered_logged: set[tuple[int, str, str, int | None]] = set()
        self._last: Sample | None = None  # the last good sample, kept while NVML fails
        self.errors = 0  # NVML calls that failed while sampling (`gpuslice metrics`)
        self._failing = False
        self._opened_with: Config | None = None  # the config NVML was last opened under
        self._reason = ""  # why NVML is not ready, as NVML said it
        # The nvidia device major was not registered when we started, so systemd's
        # DeviceAllow=char-nvidia(-frontend) allowed nothing: once the driver is there and its
        # node answers EPERM, only a restart of the service lets NVML in (`restart_needed`).
        self._frontend_at_start: bool | None = None
        self.restart_needed = ""
        self._base: Inventory | None = None  # a fork's: the inventory it was forked from

    def fork(self) -> Inventory:
        """A copy for one NVML call on the worker thread (gpuwatch): its books and Health
        its own, so that a call that outlives its deadline changes nothing the event loop
        reads or writes meanwhile; `adopt` takes the copy's state back, on the loop."""
        twin = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, (dict, set, list)):
                setattr(twin, name, copy.copy(value))
        twin.health = dataclasses.replace(self.health)
        twin._base = copy.copy(self)  # what the call began from (its fields are only read)
        twin._base.health = dataclasses.replace(self.health)
        return twin

    def adopt(self, twin: Inventory, late: bool = False) -> None:
        """The state `twin` (`fork`) was left in by its NVML call. A call that answered in
        time: all of it (the loop waited for it). One that answered `late`: its errors and
        what it did to NVML's session (opened, reopened, gone: dropped, a slow nvmlInit
        never got through), never the books of its sample: taken on the holders of when
        it began and never acted on, they replaced the loop's since (the GPUs holders' env
        files named: a renumbered GPU went unseen)."""
        base = twin._base
        assert base is not None, "adopt takes a fork"
        if not late:
            state = dict(vars(twin))
            del state["health"], state["_base"]
            vars(self).update(state)
        else:
            self.errors += twin.errors - base.errors
            for name in _SESSION:  # each the call set; the loop's own writes stand otherwise
                if getattr(twin, name) is not getattr(base, name):
                    setattr(self, name, getattr(twin, name))
            if twin.health == base.health or (
                self.health.state == FALLBACK and twin.health.state == WAITING
            ):
                return  # the loop's (it gave up waiting: a late "not yet" changes nothing)
        for f in dataclasses.fields(Health):  # in place: samples carry this one
            setattr(self.health, f.name, getattr(twin.health, f.name))

    def _fallback(self) -> str:
        if self._last is not None:
            return f"the {len(self._last.gpus)} GPUs NVML last showed, as whole GPUs"
        if _guessed(self.config) != list(range(self.config.gpus)):
            return f"manage_gpus: {', '.join(self.config.manage_gpus)} from config.yaml"
        return f"gpus: {self.config.gpus} from config.yaml"

    def open(self) -> None:
        """The first NVML open: ready, or which of the other cases applies (logged once)."""
        self._opened_with = self.config
        if self._frontend_at_start is None:
            self._frontend_at_start = frontend_registered(self.driver_root)
        status = self.nvml.open(fallback=self._fallback())
        self.available = status.available
        if status.available:
            self._set(READY, f"driver {status.driver_version or 'unknown'}", status)
            return
        self._reason = _reason_of(status.warning)
        self.driver = probe(self.driver_root)
        if not self.driver.hardware:
            if status.warning:
                log.warning("%s", status.warning)
            self._set(ABSENT, f"no NVIDIA GPU here ({self._reason})", status)
            return
        self._set(WAITING, self._waiting_detail(), status)
        log.warning(
            "NVIDIA hardware present (%s) but NVML is not ready (%s): retrying; background "
            "units wait for it, on-demand units run on %s meanwhile",
            self.driver.describe(),
            self._reason,
            self._fallback(),
        )

    def open_hung(self, deadline: float) -> None:
        """nvmlInit did not answer within `deadline`: a driver is there, but not ready."""
        self.available = False
        self._reason = f"nvmlInit did not answer within {deadline:g} s"
        self.driver = probe(self.driver_root)
        self._set(WAITING, self._waiting_detail(), None)

    def retry(self) -> bool:
        """Initialise NVML again while it is not ready; True once it is (logged once)."""
        if self.available:
            return True
        self._opened_with = self.config
        status = self.nvml.reopen(fallback=self._fallback())
        if not status.available:
            reason = _reason_of(status.warning)
            if reason != self._reason:
                log.info("NVML still not ready: %s", reason)
            self._reason = reason
            self.driver = probe(self.driver_root)
            if (
                self._frontend_at_start is False
                and self.driver.module_loaded
                and device_denied(self.driver_root)
            ):
                self.restart_needed = (
                    "the nvidia driver loaded after gpuslice.service started, and systemd "
                    "allowed its devices (DeviceAllow=char-nvidia, char-nvidia-frontend) only as "
                    "they were then"
                )
            if self.health.state == WAITING:
                self.health.detail = self._waiting_detail()
            return False
        self.available = True
        self._failing = False
        self._set(READY, f"driver {status.driver_version or 'unknown'}", status)
        return True

    def give_up_waiting(self, waited: float) -> None:
        """`driver_wait` ran out: background units may use the fallback GPUs (retries go on)."""
        if self.health.state != WAITING:
            return
        self._set(
            FALLBACK,
            f"NVML not ready after {waited:g} s ({self._reason}): using {self._fallback()}",
            None,
        )
        log.warning(
            "NVML still not ready after %g s (driver_wait): background units now start on %s; "
            "gpuslice switches to NVML when it answers",
            waited,
            self._fallback(),
        )

    def _waiting_detail(self) -> str:
        return f"waiting for NVML ({self._reason}; {self.driver.describe()})"

    def _set(self, state: str, detail: str, status: object) -> None:
        version = getattr(status, "driver_version", None) or self.driver.version
        if state != self.health.state:
            self.health.since = self.wall()
        self.health.state = state
        self.health.detail = detail
        self.health.driver_version = version if state == READY else self.driver.version

    def _went_away(self, reason: str) -> None:
        """NVML as a whole stopped answering (driver unloaded, reset): back to waiting."""
        self.available = False
        self.nvml.forget()
        self._reason = reason
        self.driver = probe(self.driver_root)
        self._set(WAITING, self._waiting_detail(), None)
        log.error(
            "NVML went away (%s): using %s until it answers again; background units wait for it",
            reason,
            self._fallback(),
        )

    def fallback_gpus(self, holding: Mapping[str, Collection[int]] | None = None) -> list[Gpu]:
        """The GPUs without NVML: those NVML last showed (by index, UUID and name, of
        unknown size), else config.yaml's guess (`_guessed`); GPUs held beyond them are lost."""
        if self._last is not None:
            gpus = [Gpu(g.index, g.uuid, g.name, lost=g.lost) for g in self._last.gpus]
        else:
            gpus = [Gpu(i) for i in _guessed(self.config)]
        return self._with_gone(gpus, holding or {})

    def _with_gone(self, gpus: list[Gpu], holding: Mapping[str, Collection[int]]) -> list[Gpu]:
        """A GPU that units hold but that is no longer there (fewer GPUs after NVML came,
        a card removed, manage_gpus edited) is reported like a lost GPU until released."""
        present = {g.index for g in gpus}
        gone = sorted({i for held in holding.values() for i in held} - present)
        for index in gone:
            if index not in self._gone_logged:
                log.error(
                    "GPU %d is no longer among the GPUs gpuslice manages, but units hold it: "
                    "treated as lost",
                    index,
                )
                self._gone_logged.add(index)
        self._gone_logged &= set(gone)
        return sorted([*gpus, *(Gpu(i, lost=True) for i in gone)], key=lambda g: g.index)

    def _managed(self, index: int, uuid: str) -> bool:
        wanted = self.config.manage_gpus
        return not wanted or str(index) in wanted or uuid in wanted

    def sample(
        self,
        managed_units: Collection[str],
        holding: Mapping[str, Collection[int]] | None = None,
        declared: Mapping[str, int] | None = None,
    ) -> Sample:
        """The GPUs with foreign use filled in, and every GPU process with its unit.

        `holding` says which GPUs each unit holds: a managed unit's process on a GPU it does
        not hold (left behind after a stop with KillMode=process, say) is not foreign, but
        its memory counts against the GPU like foreign memory, since no declaration covers it.
        `declared`: each holder's `Memory=` (per GPU), to tell what it uses beyond that.
        """
        now = self.clock()
        holding = holding or {}
        declared = declared or {}
        if self.available and self._opened_with is not self.config:
            self._enumerate_again()
        if not self.available:
            return Sample(self.fallback_gpus(holding), taken_at=now, health=self.health)
        try:
            sample = self._build(self.nvml.devices(), managed_units, holding, declared, now)
        except NvmlUnavailableError as e:
            self.errors += 1
            self._went_away(str(e))
            return Sample(self.fallback_gpus(holding), taken_at=now, health=self.health)
        except NvmlError as e:
            self.errors += 1
            if not self._failing:  # once per failure spell: sampling repeats every interval
                log.error("NVML failed (%s): keeping the GPUs as they were", e)
            self._failing = True
            if self._last is not None:
                return self.reattribute(self._last, managed_units, holding, declared)
            return Sample(self.fallback_gpus(holding), taken_at=now, health=self.health)
        if self._failing:
            log.info("NVML answers again")
        self._failing = False
        if self._last is not None and _indices(self._last) != _indices(sample):
            log.info(
                "GPUs changed: now %s (were %s)",
                _indices(sample) or "none",
                _indices(self._last) or "none",
            )
        self._last = sample
        return sample

    def _enumerate_again(self) -> None:
        """The configuration changed (a reload): NVML counts GPUs only at init, so open it
        afresh to see a card added or removed since (and apply manage_gpus). NVML not
        answering then is said as `open` and `retry` say it: NVML's reason alone (an error
        made up here named "NVML error 0", which is NVML_SUCCESS, and an unknown failure's
        call and code twice)."""
        self._opened_with = self.config
        status = self.nvml.reopen(fallback=self._fallback())
        if not status.available:
            self._went_away(_reason_of(status.warning))

    def reattribute(
        self,
        sample: Sample,
        managed_units: Collection[str],
        holding: Mapping[str, Collection[int]],
        declared: Mapping[str, int] | None = None,
    ) -> Sample:
        """A sample kept while NVML does not answer (hung, failing), its processes attributed
        anew to the units known now, from their cgroups (no NVML call). Kept as it was, the
        first sample of a start-up, taken before any unit was known, took every running
        job's process for foreign, and a background unit yielded its GPU to itself."""
        if not sample.processes:
            return sample
        uses: list[GpuUse] = []
        for use in sample.processes:
            path = cgroup_path_of_pid(use.pid, self.proc)
            uses.append(use if path is None else _attributed(use, path, managed_units))
        gpus = [
            g
            if g.lost
            else _with_foreign(g, [u for u in uses if u.gpu == g.index], holding, declared)
            for g in sample.gpus
        ]
        return dataclasses.replace(sample, gpus=gpus, processes=uses)

    def _build(
        self,
        scan: DeviceScan,
        managed_units: Collection[str],
        holding: Mapping[str, Collection[int]],
        declared: Mapping[str, int],
        now: float,
    ) -> Sample:
        gpus: list[Gpu] = []
        processes: list[GpuUse] = []
        # A lost GPU names no UUID: one manage_gpus leaves out by index is none of ours
        # (shown, the cluster's GPU fallen off the bus was "lost" in gpuslice's status)
        wanted = self.config.manage_gpus
        lost = [i for i in scan.lost if not _by_index(self.config) or str(i) in wanted]
        seen_gone: set[int] = set()
        for info in scan.gpus:
            if not self._managed(info.index, info.uuid):
                continue
            try:
                found = self.nvml.processes(info.index)
            except GpuLostError:
                gpus.append(Gpu(info.index, info.uuid, info.name, lost=True))
                lost.append(info.index)
                continue
            uses: list[GpuUse] = []
            for proc in found:
                path = cgroup_path_of_pid(proc.pid, self.proc)
                alive = (self.proc / str(proc.pid)).exists()
                if not alive and not self._still_releasing(
                    proc.pid, proc.used_memory, info.index, now
                ):
                    seen_gone.add(proc.pid)
                    continue
                if not alive:
                    seen_gone.add(proc.pid)
                use = GpuUse(
                    proc.pid,
                    info.index,
                    proc.used_memory,
                    None,
                    command_of(proc.pid, self.proc),
                    compute=proc.compute,
                )
                uses.append(_attributed(use, path, managed_units))
            processes += uses
            gpus.append(
                _with_foreign(
                    Gpu(
                        info.index,
                        info.uuid,
                        info.name,
                        total=info.memory_total,
                        reserve=self.config.reserve_for(info.index, info.uuid),
                        used=info.memory_used,
                    ),
                    uses,
                    holding,
                    declared,
                )
            )
        for pid in set(self._gone_since) - seen_gone:
            del self._gone_since[pid]
            self._overrun_logged.discard(pid)
        self._say_lost(set(lost))
        gpus += [Gpu(i, lost=True) for i in scan.lost if i in lost]  # in order: _with_gone
        gpus = self._as_booked(gpus, holding)
        return Sample(self._with_gone(gpus, holding), processes, now, self.health)

    def _say_lost(self, lost: set[int]) -> None:
        """Each GPU lost since the last sample, said once ("GPUs changed" says one back):
        said once for ever, a GPU reset and lost again went unsaid, and one lost while its
        processes were asked for never was."""
        for index in sorted(lost - self._lost_logged):
            log.error("GPU %d is lost (it stopped answering NVML): nothing new runs on it", index)
        self._lost_logged = lost

    def remember(self, told: Mapping[int, str]) -> bool:
        """The UUIDs a restarted controller's holders were told, by index (their env files):
        the NVML it opened afresh may number the GPUs otherwise than the last one did.
        An env file's word replaces a booking a sample made: the file names the GPU the
        unit's processes run on, a sample only NVML's numbering of the moment (a unit
        adopted at start-up is told after the sample that booked its index by that
        numbering, or that booked it for a unit beside it). Whether a booking changed."""
        changed = False
        for index, uuid in told.items():
            if uuid and self._booked.get(index) != uuid:
                self._booked[index] = uuid
                changed = True
        return changed

    def _as_booked(self, gpus: list[Gpu], holding: Mapping[str, Collection[int]]) -> list[Gpu]:
        """`gpus` with every GPU whose index no longer names the GPU its holders were granted
        marked lost, for as long as they hold it.

        Units hold GPUs by NVML index, which is only NVML's order of enumeration: once NVML
        was opened afresh (the driver reloaded, a card gone off the bus, a reload or restart
        of gpuslice) the same index may be another GPU. A unit granted GPU 1 runs on the GPU
        its env file names by UUID; with the card before it gone, that GPU is GPU 0, which
        the books said was free: granted again, two jobs shared it. So both the index held
        and the one its GPU now has take nothing new until the holders release the index.
        The UUID an index is booked with is the one the grant saw, the last sample's (a grant
        is decided on it), else the one shown now."""
        held: dict[int, list[str]] = {}
        for name, indices in sorted(holding.items()):
            for index in indices:
                held.setdefault(index, []).append(name)
        before = {g.index: g.uuid for g in self._last.gpus} if self._last is not None else {}
        now = {g.index: g.uuid for g in gpus}
        self._booked = {i: u for i, u in self._booked.items() if i in held}
        for index in held:
            uuid = self._booked.get(index) or before.get(index) or now.get(index)
            # one NVML names by no UUID (a fake, an odd driver) is not booked: nothing tells
            # its renumbering, and it is held by index, as before NVML answered
            if uuid:
                self._booked[index] = uuid
        where = {u: i for i, u in now.items() if u}
        lost: set[int] = set()
        changes: set[tuple[int, str, str, int | None]] = set()
        for index, uuid in sorted(self._booked.items()):
            current = now.get(index, "")
            moved = where.get(uuid, index)  # its GPU's index now
            if (current and current != uuid) or moved != index:
                changes.add((index, uuid, current, None if moved == index else moved))
                lost |= {index, moved}
        for index, uuid, current, now_at in sorted(changes - self._renumbered_logged):
            also = {index} if now_at is None else {index, now_at}
            log.error(
                "GPU %d names another GPU since NVML numbered the GPUs anew: it was %s when "
                "granted to %s, and %s (%s); %s %s treated as lost until %s released",
                index,
                uuid,
                listed(tuple(held[index])),
                f"is now {current}" if current else "is no longer listed",
                f"{uuid} is now GPU {now_at}"
                if now_at is not None
                else f"{uuid} is no longer listed",
                format_gpus(also),
                "is" if len(also) == 1 else "are",
                "it is" if now_at is None else f"GPU {index} is",
            )
        self._renumbered_logged = changes
        return [
            Gpu(g.index, g.uuid, g.name, lost=True, renumbered=True)
            if g.index in lost and not g.lost
            else g
            for g in gpus
        ]

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


def _attributed(use: GpuUse, path: str | None, managed_units: Collection[str]) -> GpuUse:
    """The process with its unit (`path`: its cgroup), or, of no managed unit, its owner."""
    unit = unit_of_cgroup_path(path) if path is not None else None
    if unit is not None and unit in managed_units:
        return dataclasses.replace(use, unit=unit, owner=None)
    owner = owner_of_cgroup_path(path) if path is not None else UNKNOWN
    return dataclasses.replace(use, unit=None, owner=owner)


def _with_foreign(
    gpu: Gpu,
    uses: Collection[GpuUse],
    holding: Mapping[str, Collection[int]],
    declared: Mapping[str, int] | None = None,
) -> Gpu:
    """`gpu` with the foreign use its processes `uses` make: every process of no managed unit,
    a stray of a managed unit that does not hold it (left after a KillMode=process stop), and
    apart (`Gpu.overuse`), what a holder with `Memory=` (`declared`, per GPU) uses on it
    beyond that: counted by its declaration alone, a unit declared 8G grown to 20G got a
    second 8G unit packed beside it on a 24G GPU, and one of them ran out of memory. Never
    foreign: as such it outlived its unit's preemption (a more urgent unit found no room in
    what the stop would free), and a holder's PID in `foreign_pids` made a background unit
    yield to the very unit that overuses."""
    declared = declared or {}
    foreign = 0
    own: dict[str, int] = {}  # what each holder with Memory= uses on this GPU (known bytes)
    foreign_pids: list[int] = []
    owners: dict[str, str] = {}  # each owner's label: its kind (one label, one owner)
    for use in uses:
        unit = use.unit or ""
        if use.owner is not None:
            foreign += use.used or 0
            if use.compute:  # a desktop's display server is no job to yield to
                foreign_pids.append(use.pid)
                owners[use.owner.label()] = use.owner.kind
        elif gpu.index not in holding.get(unit, ()):
            foreign += use.used or 0  # a stray of a unit not holding this GPU
        elif unit in declared:  # a whole-GPU holder (no Memory=) has the GPU to itself
            own[unit] = own.get(unit, 0) + (use.used or 0)
    labels = sorted(owners.keys() - {""})
    return dataclasses.replace(
        gpu,
        foreign=foreign,
        foreign_pids=tuple(foreign_pids),
        overuse=tuple(
            sorted((n, used - declared[n]) for n, used in own.items() if used > declared[n])
        ),
        foreign_owners=tuple(labels),
        foreign_owner_kinds=tuple(owners[label] for label in labels),
    )


def _guessed(config: Config) -> list[int]:
    """The GPUs before NVML has shown any: those `manage_gpus` names by index, when it names
    them all so (a split host: the others are a cluster's, and a unit granted one would run
    beside its job), else `gpus:`, 0 to gpus-1."""
    if _by_index(config):
        return sorted({int(w) for w in config.manage_gpus})
    return list(range(config.gpus))


def _by_index(config: Config) -> bool:
    """`manage_gpus` names its GPUs all by index: a GPU it leaves out is known by index."""
    return bool(config.manage_gpus) and all(w.isdigit() for w in config.manage_gpus)


def _reason_of(warning: str | None) -> str:
    """ "NVML unavailable (REASON): using ..." -> REASON. Cut at the last "): ": what follows
    REASON is gpuslice's own words (`nvml._unavailable`: GPU indices or UUIDs, a hint), with
    none in them, while REASON may hold one (the message of whatever pynvml raised)."""
    text = warning or "NVML unavailable"
    if text.startswith("NVML unavailable (") and "): " in text:
        return text[len("NVML unavailable (") : text.rindex("): ")]
    return text


def _indices(sample: Sample) -> str:
    return ", ".join(str(g.index) for g in sample.gpus if not g.lost)
