"""A holder using more VRAM than its `Memory=` declares: what it uses beyond that counts
against its GPU while it holds it (gpuslice.inventory `_with_foreign` tells it, `Gpu.overuse`;
gpuslice.core.placement `free_memory` counts it), so that placement sees the memory really
free. Counted by declarations alone, a unit declared 8G that had grown to 20G on a 24G GPU
got a second 8G unit packed beside it, and one of them ran out of memory. It is never
foreign: no holder's PID joins `foreign_pids` (a background unit yields to foreign compute
processes: it would yield to the very unit that overuses), and stopping the unit frees it (a
more urgent unit preempts an overusing one for all the memory it takes).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpuslice.config import Config
from gpuslice.core.model import Gpu, UnitKind, UnitSpec
from gpuslice.core.placement import Use, fits, free_memory
from gpuslice.core.scheduler import Scheduler
from gpuslice.gpuwatch import GpuWatch
from gpuslice.inventory import Inventory
from gpuslice.nvml import GpuProcess, NvmlError
from tests.core_builders import brief
from tests.test_controller import Timers, hang_until, patient_nvml
from tests.test_gpuwatch_mutation import until
from tests.test_inventory import GIB, UUIDS, Clock, StubNvml, make_inventory, write_proc

BIG = "0::/system.slice/big.service\n"


def sized(index: int) -> Gpu:
    return Gpu(index, UUIDS[index], "NVIDIA Fake 24GB", 24 * GIB)


def spec(name: str, memory_gib: int | None, kind: UnitKind = UnitKind.ON_DEMAND) -> UnitSpec:
    memory = None if memory_gib is None else memory_gib * GIB
    return UnitSpec(name, 50, kind, memory=memory)


def _decide(scheduler: Scheduler, gpus: list[Gpu]) -> None:
    scheduler.set_gpus(gpus)  # its actions are not played: a start is asked for by hand


def watched(
    tmp_path: Path, gpus: int, *specs: UnitSpec, nvml: StubNvml | None = None
) -> tuple[Scheduler, GpuWatch, StubNvml]:
    """The core's scheduler as the watch's holdings, deciding on every sample."""
    nvml = nvml or StubNvml(gpus)
    scheduler = Scheduler([sized(i) for i in range(gpus)], {s.name: s for s in specs})
    config = Config(gpus=gpus)
    inventory = Inventory(config, nvml=nvml, clock=Clock(), proc=tmp_path, driver_root=tmp_path)
    watch = GpuWatch(
        config,
        inventory,
        scheduler,
        managed=lambda: set(scheduler.specs),
        decide=lambda gpus: _decide(scheduler, gpus),
        ready=lambda: True,
        call_later=Timers(),
    )
    return scheduler, watch, nvml


def test_a_second_unit_is_not_packed_beside_a_unit_grown_past_its_memory(tmp_path: Path) -> None:
    big, second = spec("big.service", 8), spec("second.service", 8)
    s, watch, nvml = watched(tmp_path, 2, big, second)
    assert brief(s.request(big)) == ["grant big.service 0"]
    write_proc(tmp_path, 100, BIG)
    nvml.add(0, 100, 20 * GIB)  # declared 8G, grown to 20G
    watch.open()
    watch.refresh()
    # by declarations the tightest fit was GPU 0 (8 GiB left); 4 GiB are really free there
    assert brief(s.request(second)) == ["grant second.service 1"]
    assert s.device(0).overuse == (("big.service", 12 * GIB),)
    assert (s.device(0).foreign, s.device(0).foreign_pids) == (0, ())  # nobody yields to it


def test_with_one_gpu_the_second_unit_waits(tmp_path: Path) -> None:
    big, second = spec("big.service", 8), spec("second.service", 8)
    s, watch, nvml = watched(tmp_path, 1, big, second)
    assert brief(s.request(big)) == ["grant big.service 0"]
    write_proc(tmp_path, 100, BIG)
    nvml.add(0, 100, 20 * GIB)
    watch.open()
    watch.refresh()
    s.request(second)
    assert "second.service" in s.waiters
    assert set(s.grants()) == {"big.service"}
    # said as what it is: big.service's, not processes of no holder
    assert s.waiters["second.service"].reason == (
        "waiting: needs 8 GiB on one GPU; GPU 0 has 4 GiB free after the reserve, held by "
        "big.service, priority 50, "
        "12 GiB used by holders beyond their Memory="
    )


def test_a_background_unit_does_not_yield_to_a_holder_over_its_memory(tmp_path: Path) -> None:
    worker = spec("big.service", 8, UnitKind.BACKGROUND)
    s, watch, nvml = watched(tmp_path, 1, worker)
    s.request(worker)
    write_proc(tmp_path, 100, BIG)
    nvml.add(0, 100, 20 * GIB)
    watch.open()
    watch.refresh()
    assert set(s.grants()) == {"big.service"}
    assert s.device(0).overuse == (("big.service", 12 * GIB),)


def test_overuse_is_per_gpu_and_of_holders_with_memory_only(tmp_path: Path) -> None:
    """Memory= is per GPU: a holder of two GPUs over it on one counts there only. A whole-GPU
    holder (no Memory=) has its GPU to itself; a leftover of a unit that does not hold the
    GPU counts whole, once; a process NVML gives no memory for counts as 0 bytes."""
    nvml = StubNvml(2)
    write_proc(tmp_path, 100, "0::/system.slice/asr.service\n")
    write_proc(tmp_path, 101, "0::/system.slice/asr.service\n")
    write_proc(tmp_path, 102, "0::/system.slice/asr.service\n")
    write_proc(tmp_path, 200, "0::/system.slice/system-w.slice/w@a.service\n")
    write_proc(tmp_path, 300, "0::/user.slice/user-1000.slice/session-2.scope\n")
    nvml.add(0, 100, 5 * GIB)  # asr.service on GPU 0: 5 + 2 against its 4 GiB
    nvml.add(0, 101, 2 * GIB)
    nvml.add(1, 102, 3 * GIB)  # and within it on GPU 1
    nvml.add(1, 200, None)
    nvml.add(0, 300, GIB)  # foreign
    inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=2))
    managed = {"asr.service", "w@a.service"}
    holding = {"asr.service": (0, 1), "w@a.service": (1,)}
    declared = {"asr.service": 4 * GIB}
    sample = inventory.sample(managed, holding, declared)
    assert [g.foreign for g in sample.gpus] == [GIB, 0]
    assert [g.overuse for g in sample.gpus] == [(("asr.service", 3 * GIB),), ()]
    assert [g.foreign_pids for g in sample.gpus] == [(300,), ()]
    # w@a.service holds GPU 1 whole and uses 30 GiB there (more than the GPU, say): its own
    nvml.procs[1] = [p for p in nvml.procs[1] if p.pid != 200]
    nvml.add(1, 200, 30 * GIB)
    assert inventory.sample(managed, holding, declared).gpus[1].overuse == ()
    # asr.service let go of GPU 0 (stopped, its processes still there): leftovers, once
    gone = {"asr.service": (1,), "w@a.service": (1,)}
    left = inventory.sample(managed, gone, declared).gpus[0]
    assert (left.foreign, left.overuse) == (8 * GIB, ())
    # a kept sample attributed anew (NVML hung) counts it the same way
    kept = inventory.reattribute(sample, managed, holding, declared)
    assert [(g.foreign, g.overuse) for g in kept.gpus] == [
        (GIB, (("asr.service", 3 * GIB),)),
        (0, ()),
    ]


def test_a_more_urgent_unit_preempts_an_overusing_unit_for_all_it_takes(tmp_path: Path) -> None:
    """Stopping big.service frees its 20 GiB, not only its declared 8: counted as foreign,
    its overuse stayed after the stop in the core's eyes, and a 16G unit that stopping it
    makes room for waited behind it."""
    big, urgent = spec("big.service", 8), UnitSpec("urgent.service", 10, memory=16 * GIB)
    s, watch, nvml = watched(tmp_path, 1, big, urgent)
    s.request(big)
    write_proc(tmp_path, 100, BIG)
    nvml.add(0, 100, 20 * GIB)
    watch.open()
    watch.refresh()
    assert brief(s.request(urgent)) == ["stop big.service"]


def test_a_unit_checked_again_on_its_own_gpu_needs_what_it_uses() -> None:
    """A unit whose place is checked again where it is (a thaw, a kept place) fits only if
    what it really uses does, not its declaration alone; its overuse is no one else's."""
    gpu = Gpu(0, total=24 * GIB, overuse=(("big.service", 12 * GIB),))
    other = Use("other.service", 50, 8 * GIB)
    assert not fits(spec("big.service", 8), gpu, [other])  # 8 + 12 > 24 - 8
    assert fits(spec("big.service", 8), gpu, [])
    assert fits(spec("new.service", 16), gpu, [other])  # big.service is not there
    assert free_memory(gpu, [other, Use("big.service", 90, 8 * GIB)]) == 24 * GIB - 28 * GIB


def test_a_holder_at_exactly_its_memory_is_no_overuse_and_unknown_use_counts_nothing(
    tmp_path: Path,
) -> None:
    """Beyond means beyond: 8 GiB used of 8 declared is none, and a process NVML gives no
    memory for adds nothing (not a byte) to its unit's use."""
    nvml = StubNvml(1)
    write_proc(tmp_path, 100, BIG)
    write_proc(tmp_path, 101, BIG)
    nvml.add(0, 100, 8 * GIB)
    nvml.add(0, 101, None)
    inventory, _ = make_inventory(tmp_path, nvml)
    declared = {"big.service": 8 * GIB}
    sample = inventory.sample({"big.service"}, {"big.service": (0,)}, declared)
    assert (sample.gpus[0].overuse, sample.gpus[0].foreign) == ((), 0)


def test_a_failing_nvml_keeps_the_last_sample_with_its_overuse(tmp_path: Path) -> None:
    """An NVML error keeps the last sample, attributed anew with the holders' Memory=: a
    holder's use beyond it still counts (dropped, the 12 GiB it took beyond its 8 looked
    free while NVML failed, and a second 8G unit was packed beside it)."""
    nvml = StubNvml(1)
    write_proc(tmp_path, 100, BIG)
    nvml.add(0, 100, 20 * GIB)
    inventory, _ = make_inventory(tmp_path, nvml)
    managed, holding, declared = {"big.service"}, {"big.service": (0,)}, {"big.service": 8 * GIB}
    assert inventory.sample(managed, holding, declared).gpus[0].overuse == (
        ("big.service", 12 * GIB),
    )
    nvml.devices_error = NvmlError("nvmlDeviceGetCount", 999, "Unknown Error", 0)
    kept = inventory.sample(managed, holding, declared)
    assert [(g.foreign, g.overuse) for g in kept.gpus] == [(0, (("big.service", 12 * GIB),))]


class Hangs(StubNvml):
    """Once `hang` is set, listing processes hangs in the driver until `release` is set."""

    def __init__(self, gpus: int) -> None:
        super().__init__(gpus)
        self.hang = False
        self.release = threading.Event()

    def processes(self, index: int) -> list[GpuProcess]:
        if self.hang:
            hang_until(self.release)
        return super().processes(index)


def test_a_hung_nvml_keeps_the_last_sample_with_the_holders_overuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sample kept while NVML hangs is attributed anew with the holders' Memory=: a
    process seen before its unit held the GPU (a stray, foreign) is the holder's now, and
    what it uses beyond its 8 GiB counts as its overuse, not as free memory."""
    patient_nvml(monkeypatch)
    big = spec("big.service", 8)
    nvml = Hangs(1)
    s, watch, _ = watched(tmp_path, 1, big, nvml=nvml)
    watch.nvml.deadline = 0.05
    write_proc(tmp_path, 100, BIG)
    nvml.add(0, 100, 12 * GIB)
    try:
        watch.open()
        watch.refresh()  # big.service holds no GPU yet: its process is a stray
        assert watch.sample.gpus[0].foreign == 12 * GIB
        assert brief(s.request(big)) == ["grant big.service 0"]
        nvml.hang = True
        watch.refresh()  # hangs: the last sample is kept
        assert watch.stale
        assert [(g.foreign, g.overuse) for g in watch.sample.gpus] == [
            (0, (("big.service", 4 * GIB),))
        ]
    finally:
        nvml.release.set()
    until(lambda: not watch.nvml.hung)
