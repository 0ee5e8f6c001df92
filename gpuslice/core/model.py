"""Value types shared by the scheduling core and its adapters.

Everything here is immutable and free of I/O, so the core can be tested exhaustively
and the adapters (systemd, files, CLI) can pass these values around safely.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass, field

# A GPU as `Devices=` and config.yaml name it: its NVML index (ASCII digits) or its UUID.
GPU_ID = re.compile(r"[0-9]{1,4}|GPU-[0-9A-Za-z-]{1,80}", re.ASCII)
# `Devices=%i` in a template: each instance is pinned to the GPU its instance names
# (`worker@0.service` to GPU 0, `gpuslice-claim@GPU-8f6c....service` to that GPU). An instance
# that names no GPU of the host waits, as a unit whose Devices= names none does.
INSTANCE_DEVICE = "%i"
# Priority= runs from 0, the most urgent, to this, the least.
PRIORITY_MAX = 999


def is_instance(name: str) -> bool:
    """`foo@bar.service` (not the template `foo@.service`): one definition for the core,
    which knows a unit by its name alone, and the unit file scan (unitfiles)."""
    at = name.find("@")
    dot = name.rfind(".")
    return 0 < at < dot - 1


def is_template(name: str) -> bool:
    """`foo@.service`: nothing between the first `@` and the suffix. `x@.y.service` (its
    instance starts with a dot) and `foo@.b@.service` are instances, as for systemd: one
    definition for the core, which refills no template, and the unit file scan."""
    at = name.find("@")
    return at >= 0 and at + 1 == name.rfind(".")


class Rung(enum.Enum):
    """One way a unit may give way to a more urgent one (`Preempt=`), tried in its order.

    `freeze` keeps the unit's VRAM and takes only its compute (systemd's FreezeUnit): it can
    help only a unit that fits beside it. `suspend` moves its VRAM to host memory
    (cuda-checkpoint) and freezes it; `stop` is systemd's StopUnit."""

    STOP = "stop"
    FREEZE = "freeze"
    SUSPEND = "suspend"


class Restart(enum.Enum):
    """A service's `Restart=` (systemd.service(5)): after which ends systemd starts it
    again. The core keeps a holder's GPUs for that start (`Scheduler._keep_for_restart`);
    only `always` and `on-success` restart a clean exit."""

    NO = "no"
    ON_SUCCESS = "on-success"
    ON_FAILURE = "on-failure"
    ON_ABNORMAL = "on-abnormal"
    ON_WATCHDOG = "on-watchdog"
    ON_ABORT = "on-abort"
    ALWAYS = "always"

    def restarts_clean_exit(self) -> bool:
        return self in (Restart.ALWAYS, Restart.ON_SUCCESS)


class UnitKind(enum.Enum):
    """How a unit may be started: only by a person, or by gpuslice when capacity is free."""

    ON_DEMAND = "on-demand"
    BACKGROUND = "background"


@dataclass(frozen=True)
class UnitSpec:
    """A managed unit's [X-GPUSlice] annotation, merged from its file and drop-ins.

    `name` is the unit name the annotation applies to; for a template (`foo@.service`)
    instances get their own spec via `for_instance`.
    """

    name: str
    priority: int
    kind: UnitKind = UnitKind.ON_DEMAND
    gpus: int = 1
    requeue: bool = True
    source: str = ""
    memory: int | None = None  # bytes of VRAM per GPU; None: the whole GPU, exclusively
    devices: tuple[str, ...] = ()  # pinned GPUs by index or UUID; empty: any
    preempt: tuple[Rung, ...] = (Rung.STOP,)  # how it gives way, in the order tried
    # its [Service] Restart= as its files say (systemd's order; an invalid one ignored)
    restart: Restart = Restart.NO

    def __deepcopy__(self, memo: dict[int, object]) -> UnitSpec:
        return self  # immutable through and through: a copy of the scheduler shares it

    def for_instance(self, instance_name: str) -> UnitSpec:
        devices = self.devices
        if devices == (INSTANCE_DEVICE,):
            at = instance_name.find("@")
            devices = (instance_name[at + 1 : instance_name.rfind(".")],)
        return dataclasses.replace(self, name=instance_name, devices=devices)

    def gives_way_by(self, rung: Rung) -> bool:
        return rung in self.preempt

    def describe(self) -> str:
        return f"{self.name} (priority {self.priority})"


@dataclass(frozen=True)
class Gpu:
    """One GPU as the core sees it: what it can hold and what others already use on it.

    Without NVML only `index` is known: `total` is None and every unit then takes a whole
    GPU. `foreign` is VRAM that no declaration covers: processes of no managed unit, and
    leftovers of managed units that do not hold this GPU; `foreign_pids` names the former's
    compute processes (only they make background units yield: a desktop's display server
    only takes memory), `foreign_owners` says whose those are, for people, and
    `foreign_owner_kinds` the kind of each (`slurm`, `user`: gpuslice/owners.py), for a status
    that may count them but not name them. `overuse`: what each holder with `Memory=` uses
    here beyond it, by unit (sorted), counted against the GPU while that unit stays on it
    (`placement.free_memory`): gone with it when it is stopped. `renumbered`: lost for new
    work only: NVML numbered the GPUs anew, and units hold this index as another GPU, or this
    GPU by another index, until they release it (`Inventory._as_booked`). The GPU
    answers: a unit suspended from it waits for it, as for a GPU in use.
    """

    index: int
    uuid: str = ""
    name: str = ""
    total: int | None = None
    reserve: int = 0
    foreign: int = 0
    foreign_pids: tuple[int, ...] = ()
    lost: bool = False
    used: int | None = None  # what NVML reports in use, for people; decisions use the rest
    foreign_owners: tuple[str, ...] = ()
    renumbered: bool = False
    overuse: tuple[tuple[str, int], ...] = ()
    # the kind of each of foreign_owners, in its order: told by the labels (one label, one
    # owner), so no part of equality
    foreign_owner_kinds: tuple[str, ...] = field(default=(), compare=False)

    def __deepcopy__(self, memo: dict[int, object]) -> Gpu:
        return self  # immutable through and through: a copy of the scheduler shares it

    def matches(self, device: str) -> bool:
        """Whether a `Devices=` entry (an index or a UUID) names this GPU."""
        return device == str(self.index) or (bool(self.uuid) and device == self.uuid)
