"""NVML answers a real host gives that once blinded gpuslice to every GPU (review R1).

Run on the in-process FakePynvml of tests/test_nvml_mutation.py, through the real `Nvml`
and `Inventory`, so each case is what the controller's sample sees.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gpuslice.config import Config
from gpuslice.core.model import Gpu
from gpuslice.inventory import READY, Inventory
from gpuslice.nvml import DeviceScan, GpuInfo, GpuLostError, Nvml, NvmlUnavailableError
from tests.test_inventory import Clock, write_proc
from tests.test_nvml_mutation import FakePynvml, entry, gpu
from tests.test_nvml_mutation import fake as fake

GIB = 1 << 30
NOT_SUPPORTED = 3


def sampled(tmp_path: Path, config: Config | None = None) -> Inventory:
    inventory = Inventory(
        config or Config(gpus=1),
        nvml=Nvml(),
        clock=Clock(),
        proc=tmp_path,
        driver_root=tmp_path / "no-nvidia",
    )
    inventory.open()
    return inventory


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_gpu_with_no_memory_of_its_own_is_of_unknown_size_not_a_failed_scan(
    fake: FakePynvml,
) -> None:
    """GB10 (DGX Spark) has unified memory: nvmlDeviceGetMemoryInfo answers NOT_SUPPORTED.
    That is an unknown, as the module promises, not a failure of the whole scan."""
    fake.fail[("nvmlDeviceGetMemoryInfo", 1)] = NOT_SUPPORTED
    with Nvml() as nvml:
        assert nvml.devices() == DeviceScan(
            [gpu(0), GpuInfo(1, "GPU-1", "NVIDIA Fake 1", None, None)], []
        )
    assert GpuInfo(1, "GPU-1", "x", None, None).memory_free is None
    assert gpu(1).memory_free == 23 * GIB


def test_a_unified_memory_gpu_is_sampled_with_its_uuid_and_foreign_processes(
    fake: FakePynvml, tmp_path: Path
) -> None:
    """Failed, every sample showed `gpus:` from config.yaml (no UUID, no process seen: a
    foreign job on it never made a background unit yield) while the health said ready."""
    fake.gpus = 1
    fake.fail[("nvmlDeviceGetMemoryInfo", None)] = NOT_SUPPORTED
    fake.processes[("Compute", 0)] = [entry(4242, None)]
    write_proc(tmp_path, 4242, "0::/user.slice/user-1000.slice/session-2.scope\n", "python3")
    inventory = sampled(tmp_path)
    sample = inventory.sample(set(), {})
    assert inventory.health.state == READY
    assert inventory.errors == 0
    assert [(g.index, g.uuid, g.total, g.used, g.foreign_pids) for g in sample.gpus] == [
        (0, "GPU-0", None, None, (4242,))
    ]
    assert isinstance(sample.gpus[0], Gpu)


NO_PERMISSION = 4


@pytest.mark.parametrize("code", [NO_PERMISSION, 8, 11])  # INSUFFICIENT_POWER, IRQ_ISSUE
def test_a_gpu_gpuslice_may_not_use_is_lost_not_nvml_gone_nor_every_gpu_hidden(
    fake: FakePynvml, tmp_path: Path, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    """NVML counts a GPU whose node the sandbox refuses (a DeviceAllow= drop-in for a split
    host, a container given some GPUs) and answers NO_PERMISSION for its handle. Taken for
    NVML gone as a whole, every sample went back to waiting, and every retry to ready. One
    whose power cable is loose failed every scan: the healthy GPU beside it went unseen."""
    fake.fail[("nvmlDeviceGetHandleByIndex", 1)] = code
    with Nvml() as nvml:
        assert nvml.devices() == DeviceScan([gpu(0)], [1])
        with pytest.raises(GpuLostError):
            nvml.processes(1)
    inventory = sampled(tmp_path)
    caplog.set_level(logging.INFO, "gpuslice")
    for _ in range(2):
        sample = inventory.sample(set(), {})
        assert inventory.available and inventory.health.state == READY
        assert [(g.index, g.uuid, g.lost) for g in sample.gpus] == [
            (0, "GPU-0", False),
            (1, "", True),
        ]
    assert said(caplog) == ["GPU 1 is lost (it stopped answering NVML): nothing new runs on it"]


def test_nvml_wide_no_permission_is_still_nvml_unavailable(fake: FakePynvml) -> None:
    """Only a call on one GPU is that GPU's: nvmlInit or the count refused is NVML's."""
    fake.fail[("nvmlDeviceGetCount", None)] = NO_PERMISSION
    with Nvml() as nvml, pytest.raises(NvmlUnavailableError):
        nvml.devices()


def test_a_gpu_lost_again_after_it_came_back_is_said_again(
    fake: FakePynvml, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The journal tells each loss and each return: a GPU reset (`nvidia-smi -r`) and lost
    again was said only the first time, and one lost while its processes were asked for
    (after its memory was read) never."""
    fake.gpus = 3
    inventory = sampled(tmp_path)
    caplog.set_level(logging.INFO, "gpuslice")
    for lost in ({1}, set(), {1}, {1}):
        fake.lost = set(lost)
        assert [g.lost for g in inventory.sample(set(), {}).gpus][1] == bool(lost)
    fake.lost = set()
    fake.fail[("nvmlDeviceGetComputeRunningProcesses_v3", 2)] = 15  # after its memory
    assert [g.lost for g in inventory.sample(set(), {}).gpus] == [False, False, True]
    assert said(caplog) == [
        "GPU 1 is lost (it stopped answering NVML): nothing new runs on it",
        "GPUs changed: now 0, 1, 2 (were 0, 2)",
        "GPU 1 is lost (it stopped answering NVML): nothing new runs on it",
        "GPUs changed: now 0, 2 (were 0, 1, 2)",
        "GPU 2 is lost (it stopped answering NVML): nothing new runs on it",
        "GPUs changed: now 0, 1 (were 0, 2)",
    ]


def test_a_lost_gpu_manage_gpus_leaves_out_is_none_of_gpuslices(
    fake: FakePynvml, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A split host (`manage_gpus: [1]`): GPU 0 is the cluster's. Fallen off the bus, it was
    shown lost in gpuslice's status and journal all the same, as if gpuslice managed it."""
    inventory = sampled(tmp_path, Config(gpus=2, manage_gpus=("1",)))
    caplog.set_level(logging.INFO, "gpuslice")
    fake.lost = {0}
    assert [(g.index, g.lost) for g in inventory.sample(set(), {}).gpus] == [(1, False)]
    fake.lost = {0, 1}
    assert [(g.index, g.lost) for g in inventory.sample(set(), {}).gpus] == [(1, True)]
    assert said(caplog) == [
        "GPU 1 is lost (it stopped answering NVML): nothing new runs on it",
        "GPUs changed: now none (were 1)",
    ]


@pytest.mark.parametrize(
    ("uuid", "kept"),
    [
        ("GPU-8f6c2f1e-0b7a-4c1d-9e2f-3a4b5c6d7e8f", True),
        ("GPU-1\nLD_PRELOAD=/tmp/x.so", False),  # a second line in the env file
        ("GPU-" + "a" * 10_000, False),
        ("0", False),  # an index, not a UUID
        ("", False),
    ],
)
def test_only_a_gpu_uuid_reaches_env_files(fake: FakePynvml, uuid: str, kept: bool) -> None:
    """NVML's UUID is written as is into each granted unit's env file: one with a line break
    set a variable of its own in a root unit's environment. A UUID that is no `GPU-` one
    is none (the GPU goes by index, as before NVML answers)."""
    fake.gpus = 1
    fake.nvmlDeviceGetUUID = lambda handle: uuid  # type: ignore[method-assign]
    with Nvml() as nvml:
        assert nvml.devices().gpus[0].uuid == (uuid if kept else "")


def test_a_gpu_name_is_one_bounded_line(fake: FakePynvml) -> None:
    """The name goes into journal lines ("NVML ready ... (NAME)") and `gpuslice status`."""
    fake.gpus = 1
    fake.nvmlDeviceGetName = lambda handle: "A\nB\x1b[2J" + "x" * 200  # type: ignore[method-assign]
    with Nvml() as nvml:
        name = nvml.devices().gpus[0].name
    assert name == ("A\\x0aB\\x1b[2J" + "x" * 200)[:96] + "..."
