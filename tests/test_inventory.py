"""gpuslice.inventory without a container or a GPU: a fake /proc tree and a stub NVML.

`StubNvml` subclasses `Nvml` and answers open/devices/processes from plain data, so the
inventory runs exactly as in the controller; processes belong to units through the
`cgroup` files written under tmp_path, as /proc/PID/cgroup would say.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gpuslice.config import Config
from gpuslice.core.model import Gpu
from gpuslice.inventory import COMM_MAX, GpuUse, Inventory, command_of, unit_of_pid
from gpuslice.nvml import (
    DeviceScan,
    GpuInfo,
    GpuLostError,
    GpuProcess,
    Nvml,
    NvmlError,
    NvmlStatus,
    NvmlUnavailableError,
)
from gpuslice.owners import UNKNOWN, Owner

GIB = 1 << 30
UUIDS = ("GPU-11111111-1111-1111-1111-111111111111", "GPU-22222222-2222-2222-2222-222222222222")
MANAGED = {"asr.service", "w@a.service"}

HYBRID_IN_CONTAINER = (  # what the test bed's systemd 252 shows for a service (hybrid mode)
    "9:name=systemd:/system.slice/asr.service\n8:pids:/\n7:blkio:/\n6:freezer:/\n"
    "5:devices:/\n4:memory:/\n3:cpuset:/\n2:cpuacct:/\n1:cpu:/\n0::/system.slice/asr.service\n"
)


def write_proc(proc: Path, pid: int, cgroup: str, comm: str = "gpu-job") -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(cgroup)
    (proc / str(pid) / "comm").write_text(comm + "\n")


# ---- unit_of_pid (gpuslice.cgroups, re-exported here; tests/test_cgroups.py has the rest) ----


@pytest.mark.parametrize(
    ("cgroup", "unit"),
    [
        ("1:name=systemd:/system.slice/x.service\n", "x.service"),
        ("0::/system.slice/system-w.slice/w@a.service\n", "w@a.service"),
        (HYBRID_IN_CONTAINER, "asr.service"),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", "session-3.scope"),
        ("0::/system.slice/x.service/worker/inner\n", "x.service"),  # delegated subgroups
        ("0::/system.slice/x.service/worker.scope\n", "x.service"),  # the first unit counts
        ("0::/system.slice/x.service/.control\n", "x.service"),
        ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/x.service\n",
         "user@1000.service"),
        ("0::/system.slice/system-gpu\\x2dworker.slice/gpu\\x2dworker@b.service\n",
         "gpu\\x2dworker@b.service"),
        ("0::/\n", None),
        ("0::/system.slice\n1:name=systemd:/system.slice\n", None),
        ("", None),
    ],
)  # fmt: skip
def test_unit_of_pid(tmp_path: Path, cgroup: str, unit: str | None) -> None:
    write_proc(tmp_path, 42, cgroup)
    assert unit_of_pid(42, tmp_path) == unit


def test_unit_of_pid_prefers_systemds_own_hierarchy(tmp_path: Path) -> None:
    """Legacy/hybrid: a v1 controller may place a process elsewhere (cgexec, a tool that
    moved it); systemd's hierarchies (0:: and name=systemd) say which unit it belongs to."""
    write_proc(
        tmp_path,
        42,
        "4:memory:/system.slice/other.service\n"
        "1:name=systemd:/system.slice/x.service\n"
        "0::/system.slice/x.service\n",
    )
    assert unit_of_pid(42, tmp_path) == "x.service"
    write_proc(
        tmp_path,
        43,
        "4:memory:/system.slice/other.service\n1:name=systemd:/system.slice/y.service\n",
    )
    assert unit_of_pid(43, tmp_path) == "y.service"


def test_unit_of_pid_and_command_of_a_process_that_is_gone(tmp_path: Path) -> None:
    assert unit_of_pid(7, tmp_path) is None
    assert command_of(7, tmp_path) == "?"


# ---- Inventory on a stub NVML ----


class StubNvml(Nvml):
    """Nvml's public surface, answered from data; `fail` makes the next call raise."""

    def __init__(self, gpus: int = 2, *, available: bool = True) -> None:
        super().__init__()
        self.available = available
        self.infos = [GpuInfo(i, UUIDS[i], "NVIDIA Fake 24GB", 24 * GIB, 0) for i in range(gpus)]
        self.lost: list[int] = []
        self.procs: dict[int, list[GpuProcess]] = {i: [] for i in range(gpus)}
        self.raises: dict[int, NvmlError] = {}
        self.devices_error: NvmlError | None = None
        self.opened = 0

    def open(self, fallback: str = "no GPUs") -> NvmlStatus:
        self.opened += 1
        if self.available:
            return NvmlStatus(True, driver_version="550.54.15")
        return NvmlStatus(False, warning=f"NVML unavailable (stub): using {fallback}. Hint: none")

    def devices(self) -> DeviceScan:
        if self.devices_error is not None:
            raise self.devices_error
        return DeviceScan([g for g in self.infos if g.index not in self.lost], list(self.lost))

    def processes(self, index: int) -> list[GpuProcess]:
        if index in self.raises:
            raise self.raises[index]
        return list(self.procs[index])

    def add(self, gpu: int, pid: int, used: int | None, *, compute: bool = True) -> None:
        self.procs[gpu].append(GpuProcess(pid, gpu, used, compute))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_inventory(
    tmp_path: Path, nvml: StubNvml, config: Config | None = None
) -> tuple[Inventory, Clock]:
    clock = Clock()
    inventory = Inventory(
        config or Config(gpus=1),
        nvml=nvml,
        clock=clock,
        proc=tmp_path,
        driver_root=tmp_path / "no-nvidia",  # no NVIDIA hardware, whatever the host has
    )
    inventory.open()
    return inventory, clock


def test_processes_are_attributed_by_cgroup_not_by_name(tmp_path: Path) -> None:
    nvml = StubNvml()
    # seed 001: the managed unit's workers are named like other programs
    write_proc(tmp_path, 100, "0::/system.slice/asr.service\n", "python3")
    write_proc(tmp_path, 101, "0::/system.slice/asr.service\n", "Xorg")
    write_proc(tmp_path, 200, "0::/user.slice/user-1000.slice/session-2.scope\n", "python3")
    write_proc(tmp_path, 201, "0::/system.slice/unmanaged.service\n", "gpu-alloc")
    write_proc(tmp_path, 300, "0::/system.slice/system-w.slice/w@a.service\n", "ollama")
    nvml.add(0, 100, 3 * GIB)
    nvml.add(0, 101, GIB)
    nvml.add(0, 200, 2 * GIB)
    nvml.add(0, 201, None)  # NVML cannot say: listed, counts as 0 bytes, still foreign
    nvml.add(1, 300, 5 * GIB)
    inventory, clock = make_inventory(tmp_path, nvml)

    sample = inventory.sample(MANAGED, {"asr.service": (0,), "w@a.service": (1,)})

    assert sample.taken_at == clock.now
    whose = ("UID 1000", "unmanaged.service")
    assert sample.gpus == [
        Gpu(0, UUIDS[0], "NVIDIA Fake 24GB", 24 * GIB, 0, 2 * GIB, (200, 201), False, 0, whose),
        Gpu(1, UUIDS[1], "NVIDIA Fake 24GB", 24 * GIB, 0, 0, (), False, 0),
    ]
    assert sample.processes == [
        GpuUse(100, 0, 3 * GIB, "asr.service", "python3"),
        GpuUse(101, 0, GIB, "asr.service", "Xorg"),
        GpuUse(200, 0, 2 * GIB, None, "python3", Owner("user", "1000")),
        GpuUse(201, 0, None, None, "gpu-alloc", Owner("unit", "unmanaged.service")),
        GpuUse(300, 1, 5 * GIB, "w@a.service", "ollama"),
    ]
    assert sample.used_by("asr.service") == {0: 4 * GIB}
    assert sample.used_by("w@a.service") == {1: 5 * GIB}
    assert sample.used_by("unmanaged.service") == {}


def test_processes_are_attributed_by_systemds_rule(tmp_path: Path) -> None:
    """Issue 8: the first unit in the cgroup path counts, as systemd says (the deepest did):
    a user's `systemd-run --user --unit=asr` is no managed asr.service, and the managed
    unit's own delegated sub-scope and .control cgroup are not foreign."""
    nvml = StubNvml()
    user = "/user.slice/user-1000.slice/user@1000.service"
    write_proc(tmp_path, 100, f"0::{user}/app.slice/asr.service\n", "python3")
    write_proc(tmp_path, 101, f"0::{user}/app.slice/app-w.slice/w@a.service\n", "python3")
    write_proc(tmp_path, 200, "0::/system.slice/asr.service/worker.scope\n", "worker")
    write_proc(tmp_path, 201, "0::/system.slice/asr.service/.control\n", "pre")
    write_proc(tmp_path, 300, "0::/system.slice/system-w.slice/w@a.service/ray/raylet\n", "ray")
    for pid in (100, 101, 200, 201):
        nvml.add(0, pid, GIB)
    nvml.add(1, 300, GIB)
    inventory, _ = make_inventory(tmp_path, nvml)

    sample = inventory.sample(MANAGED, {"asr.service": (0,), "w@a.service": (1,)})

    assert [(p.pid, p.unit) for p in sample.processes] == [
        (100, None),
        (101, None),
        (200, "asr.service"),
        (201, "asr.service"),
        (300, "w@a.service"),
    ]
    assert (sample.gpus[0].foreign, sample.gpus[0].foreign_pids) == (2 * GIB, (100, 101))
    assert (sample.gpus[1].foreign, sample.gpus[1].foreign_pids) == (0, ())
    assert sample.used_by("asr.service") == {0: 2 * GIB}


def test_foreign_processes_are_said_whose_they_are(tmp_path: Path) -> None:
    """Beside Slurm or Kubernetes: each foreign process's owner from its cgroup, the GPU's
    owners once each; a process whose cgroup cannot be read is foreign, of no known owner."""
    nvml = StubNvml()
    pod = "1b4e28ba_2fa1_11d2_883f_0016d3cca427"
    write_proc(tmp_path, 100, "0::/system.slice/slurmstepd.scope/job_881/step_0/user\n", "py")
    write_proc(tmp_path, 101, "0::/system.slice/slurmstepd.scope/job_881/step_1/user\n", "py")
    write_proc(
        tmp_path, 102, f"0::/kubepods.slice/kubepods-pod{pod}.slice/cri-containerd-a.scope\n", "t"
    )
    write_proc(tmp_path, 103, "0::/system.slice/asr.service\n", "python3")
    for pid in (100, 101, 102, 103):
        nvml.add(0, pid, GIB)
    nvml.add(1, 104, GIB)
    (tmp_path / "104").mkdir()  # alive, but its cgroup cannot be read
    inventory, _ = make_inventory(tmp_path, nvml)

    sample = inventory.sample(MANAGED, {"asr.service": (0,)})

    assert [(p.pid, p.owner) for p in sample.processes] == [
        (100, Owner("slurm", "881")),
        (101, Owner("slurm", "881")),
        (102, Owner("kubernetes", pod.replace("_", "-"))),
        (103, None),
        (104, UNKNOWN),
    ]
    assert sample.gpus[0].foreign_owners == (
        "Kubernetes pod 1b4e28ba-2fa1-11d2-883f-0016d3cca427",
        "Slurm job 881",
    )
    assert (sample.gpus[0].foreign_pids, sample.gpus[1].foreign_pids) == ((100, 101, 102), (104,))
    assert sample.gpus[1].foreign_owners == ()


def test_a_process_name_is_read_as_bytes_and_kept_escaped(tmp_path: Path) -> None:
    """/proc/PID/comm holds whatever the process set (prctl(PR_SET_NAME): any byte but NUL).
    Any local user's CUDA process named with a byte that is no UTF-8 made every sample raise
    UnicodeDecodeError (the controller's start-up, each gate's grant, each release of a
    GPU); one named with a terminal's control sequence reached `gpuslice status`'s table as
    it was. Either is now a name in escapes, and the process is foreign as any other."""
    nvml = StubNvml()
    write_proc(tmp_path, 200, "0::/user.slice/user-1000.slice/session-2.scope\n")
    (tmp_path / "200" / "comm").write_bytes(b"\xff\xfe\n")
    write_proc(tmp_path, 201, "0::/user.slice/user-1000.slice/session-2.scope\n")
    (tmp_path / "201" / "comm").write_bytes(b"\x1b[2J\x1b[Hjob\n")
    nvml.add(0, 200, GIB)
    nvml.add(0, 201, GIB)
    inventory, _ = make_inventory(tmp_path, nvml)

    sample = inventory.sample(MANAGED, {})

    assert [p.command for p in sample.processes] == ["\\xff\\xfe", "\\x1b[2J\\x1b[Hjob"]
    assert (sample.gpus[0].foreign, sample.gpus[0].foreign_pids) == (2 * GIB, (200, 201))
    assert command_of(200, tmp_path) == "\\xff\\xfe"
    # at most COMM_MAX bytes are read, and at most COMM_MAX characters shown (escapes count)
    (tmp_path / "200" / "comm").write_bytes(b"a" * 1000)
    assert command_of(200, tmp_path) == "a" * COMM_MAX
    (tmp_path / "200" / "comm").write_bytes(b"\xff" * 100)
    assert command_of(200, tmp_path) == "\\xff" * (COMM_MAX // 4) + "..."


def test_a_desktops_display_server_takes_memory_but_is_yielded_to_by_nobody(
    tmp_path: Path,
) -> None:
    """A graphics-only process (Xorg, a compositor) on a desktop's GPU: its memory counts,
    but it is no job that background units step aside for (they never would run there)."""
    nvml = StubNvml()
    write_proc(tmp_path, 50, "0::/system.slice/gdm.service\n", "Xorg")
    write_proc(tmp_path, 51, "0::/user.slice/user-1000.slice/session-2.scope\n", "python3")
    nvml.add(0, 50, GIB, compute=False)
    nvml.add(0, 51, 2 * GIB)
    inventory, _ = make_inventory(tmp_path, nvml)

    sample = inventory.sample(MANAGED)

    gpu0 = sample.gpus[0]
    assert (gpu0.foreign, gpu0.foreign_pids, gpu0.foreign_owners) == (3 * GIB, (51,), ("UID 1000",))
    assert [(p.pid, p.compute) for p in sample.processes] == [(50, False), (51, True)]


def test_manage_gpus_and_reserve(tmp_path: Path) -> None:
    nvml = StubNvml()
    config = Config(manage_gpus=(UUIDS[1],), reserve=(("1", GIB), ("*", 512 << 20)))
    sample = make_inventory(tmp_path, nvml, config)[0].sample(MANAGED)
    assert [(g.index, g.reserve) for g in sample.gpus] == [(1, GIB)]

    config = Config(manage_gpus=("0",), reserve=(("*", 512 << 20),))
    sample = make_inventory(tmp_path, nvml, config)[0].sample(MANAGED)
    assert [(g.index, g.reserve) for g in sample.gpus] == [(0, 512 << 20)]


def test_nvml_unavailable_means_the_configured_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = StubNvml(available=False)
    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=3))
        first = inventory.sample(MANAGED)
        second = inventory.sample(MANAGED)
    assert not inventory.available
    assert first.gpus == second.gpus == [Gpu(0), Gpu(1), Gpu(2)]
    assert [r.getMessage() for r in caplog.records] == [
        "NVML unavailable (stub): using gpus: 3 from config.yaml. Hint: none"
    ]


def test_lost_gpu_is_reported_once_and_marked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = StubNvml()
    inventory, _ = make_inventory(tmp_path, nvml)
    nvml.lost = [1]
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        first = inventory.sample(MANAGED)
        second = inventory.sample(MANAGED)
    assert [(g.index, g.lost) for g in first.gpus] == [(0, False), (1, True)]
    assert second.gpus == first.gpus
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 1 is lost (it stopped answering NVML): nothing new runs on it"
    ]


def test_gpu_lost_between_enumeration_and_process_query(tmp_path: Path) -> None:
    nvml = StubNvml()
    nvml.raises[0] = GpuLostError("nvmlDeviceGetHandleByIndex", 15, "GPU is lost", 0)
    sample = make_inventory(tmp_path, nvml)[0].sample(MANAGED)
    assert sample.gpus[0] == Gpu(0, UUIDS[0], "NVIDIA Fake 24GB", lost=True)
    assert not sample.gpus[1].lost


@pytest.mark.parametrize("where", ["devices", "processes"])
def test_nvml_error_keeps_the_gpus_as_they_were(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """A failing NVML call (e.g. a timeout) must neither raise into the controller nor shrink
    the host to `gpus:` GPUs of unknown size."""
    nvml = StubNvml()
    write_proc(tmp_path, 100, "0::/system.slice/asr.service\n")
    nvml.add(0, 100, 3 * GIB)
    inventory, clock = make_inventory(tmp_path, nvml)
    good = inventory.sample(MANAGED)
    error = NvmlError("nvmlDeviceGetCount", 999, "Unknown Error")
    if where == "devices":
        nvml.devices_error = error
    else:
        nvml.raises[1] = error
    clock.now += 1
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        kept = inventory.sample(MANAGED)
        again = inventory.sample(MANAGED)  # sampling repeats: one error line per spell
        nvml.devices_error = None
        nvml.raises.clear()
        back = inventory.sample(MANAGED)
    assert kept.gpus == again.gpus == good.gpus
    assert kept.processes == good.processes
    assert inventory.errors == 2  # each failed sample counts (gpuslice_nvml_errors_total)
    assert back.taken_at == clock.now and back.gpus == good.gpus
    assert [r.getMessage() for r in caplog.records] == [
        "NVML failed (nvmlDeviceGetCount: Unknown Error (NVML error 999)): "
        "keeping the GPUs as they were",
        "NVML answers again",
    ]


def test_exited_process_counts_until_vram_release_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NVML may list a process for a while after it exited: its memory still counts (as no
    unit's) for vram_release_timeout seconds, then one warning and it no longer counts."""
    nvml = StubNvml()
    nvml.add(0, 500, 6 * GIB)  # no /proc/500: exited
    inventory, clock = make_inventory(tmp_path, nvml, Config(vram_release_timeout=5))
    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        assert inventory.sample(MANAGED).gpus[0].foreign == 6 * GIB
        clock.now += 4.9
        assert inventory.sample(MANAGED).gpus[0].foreign == 6 * GIB
        clock.now += 0.2
        late = inventory.sample(MANAGED)
        clock.now += 10
        later = inventory.sample(MANAGED)
    assert (late.gpus[0].foreign, late.gpus[0].foreign_pids, late.processes) == (0, (), [])
    assert later.gpus[0].foreign == 0
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 0 still shows 6 GiB for exited PID 500 after 5 s (vram_release_timeout): "
        "no longer counting it"
    ]
    nvml.procs[0] = []  # gone from NVML: a later PID 500 starts a fresh clock
    inventory.sample(MANAGED)
    nvml.add(0, 500, GIB)
    assert inventory.sample(MANAGED).gpus[0].foreign == GIB


def test_open_is_called_once_per_inventory_open(tmp_path: Path) -> None:
    nvml = StubNvml()
    inventory, _ = make_inventory(tmp_path, nvml)
    for _ in range(3):
        inventory.sample(MANAGED)
    assert nvml.opened == 1


def test_leftover_of_a_managed_unit_counts_but_does_not_make_units_yield(tmp_path: Path) -> None:
    """A process left in a managed unit's cgroup after it lost its GPU (KillMode=process)
    is no foreign process, but nothing declares its memory: it counts against the GPU."""
    nvml = StubNvml()
    write_proc(tmp_path, 100, "0::/system.slice/asr.service\n", "python3")
    nvml.add(0, 100, 3 * GIB)
    inventory, _ = make_inventory(tmp_path, nvml)
    sample = inventory.sample(MANAGED, {})
    gpu0 = sample.gpus[0]
    assert (gpu0.foreign, gpu0.foreign_pids) == (3 * GIB, ())
    assert sample.used_by("asr.service") == {0: 3 * GIB}


# ---- NVML's cases: absent, waiting, fallback, ready; gone and back ----


def nvidia_root(tmp_path: Path) -> Path:
    """A /sys with one NVIDIA 3D controller and no nvidia module: "not ready yet"."""
    device = tmp_path / "nvidia-root" / "sys" / "bus" / "pci" / "devices" / "0000:65:00.0"
    device.mkdir(parents=True, exist_ok=True)
    (device / "vendor").write_text("0x10de\n")
    (device / "class").write_text("0x030200\n")
    return tmp_path / "nvidia-root"


def waiting_inventory(tmp_path: Path, nvml: StubNvml, config: Config) -> Inventory:
    inventory = Inventory(
        config, nvml=nvml, clock=Clock(), proc=tmp_path, driver_root=nvidia_root(tmp_path),
        wall=lambda: 1000.0,
    )  # fmt: skip
    inventory.open()
    return inventory


def test_no_nvidia_hardware_is_absent(tmp_path: Path) -> None:
    inventory, _ = make_inventory(tmp_path, StubNvml(available=False))
    assert inventory.health.state == "absent"
    assert inventory.health.detail == "no NVIDIA GPU here (stub)"
    assert inventory.sample(MANAGED).health is inventory.health


def test_hardware_without_nvml_is_waiting_then_ready(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = StubNvml(available=False)
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        inventory = waiting_inventory(tmp_path, nvml, Config(gpus=1))
        assert inventory.health.state == "waiting"
        assert inventory.sample(MANAGED).gpus == [Gpu(0)]  # the guess, until NVML answers
        assert inventory.retry() is False
        nvml.available = True
        assert inventory.retry() is True
    assert inventory.available
    assert inventory.health.to_json() == {
        "state": "ready",
        "since": 1000.0,
        "detail": "driver 550.54.15",
        "driver_version": "550.54.15",
    }
    assert [g.uuid for g in inventory.sample(MANAGED).gpus] == list(UUIDS)
    assert [r.getMessage() for r in caplog.records] == [
        "NVIDIA hardware present (1 NVIDIA PCI device (0000:65:00.0), nvidia module not loaded) "
        "but NVML is not ready (stub): retrying; background units wait for it, on-demand units "
        "run on gpus: 1 from config.yaml meanwhile"
    ]


def test_waiting_gives_up_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    inventory = waiting_inventory(tmp_path, StubNvml(available=False), Config(gpus=2))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        inventory.give_up_waiting(120)
        inventory.give_up_waiting(121)
    assert inventory.health.state == "fallback"
    assert inventory.health.detail == (
        "NVML not ready after 120 s (stub): using gpus: 2 from config.yaml"
    )
    assert [r.getMessage() for r in caplog.records] == [
        "NVML still not ready after 120 s (driver_wait): background units now start on "
        "gpus: 2 from config.yaml; gpuslice switches to NVML when it answers"
    ]


def test_driver_gone_keeps_the_known_gpus_and_comes_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = StubNvml()
    inventory = waiting_inventory(tmp_path, nvml, Config(gpus=1))
    assert inventory.health.state == "ready"
    inventory.sample(MANAGED)
    nvml.devices_error = NvmlUnavailableError("nvmlDeviceGetCount", 9, "Driver Not Loaded")
    nvml.available = False
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        gone = inventory.sample(MANAGED)
    assert not inventory.available and inventory.health.state == "waiting"
    assert inventory.errors == 1
    # the GPUs NVML last showed, as whole GPUs of unknown size
    assert gone.gpus == [Gpu(0, UUIDS[0], "NVIDIA Fake 24GB"), Gpu(1, UUIDS[1], "NVIDIA Fake 24GB")]
    assert [r.getMessage() for r in caplog.records] == [
        "NVML went away (nvmlDeviceGetCount: Driver Not Loaded (NVML error 9)): using the 2 "
        "GPUs NVML last showed, as whole GPUs until it answers again; background units wait "
        "for it"
    ]
    nvml.devices_error = None
    nvml.available = True
    assert inventory.retry()
    assert [g.total for g in inventory.sample(MANAGED).gpus] == [24 * GIB, 24 * GIB]


def test_held_gpus_that_are_gone_are_reported_like_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Guessed `gpus: 4` at boot, 2 real GPUs: a holder of GPU 3 keeps it, as a lost GPU."""
    nvml = StubNvml()
    inventory, _ = make_inventory(tmp_path, nvml)
    holding = {"asr.service": [3], "w@a.service": [0]}
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        first = inventory.sample(MANAGED, holding)
        inventory.sample(MANAGED, holding)
    assert [(g.index, g.lost) for g in first.gpus] == [(0, False), (1, False), (3, True)]
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 3 is no longer among the GPUs gpuslice manages, but units hold it: treated as lost"
    ]
    assert [g.index for g in inventory.sample(MANAGED, {"w@a.service": [0]}).gpus] == [0, 1]


def enumerate_as(nvml: StubNvml, *uuids: str) -> None:
    """NVML numbers these GPUs 0, 1, ... (as at its next init: a card gone shifts the rest)."""
    nvml.infos = [GpuInfo(i, u, "NVIDIA Fake 24GB", 24 * GIB, 0) for i, u in enumerate(uuids)]
    nvml.procs = {i: [] for i in range(len(uuids))}


def test_a_held_index_that_names_another_gpu_after_nvml_came_back_is_lost_until_released(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """asr.service was granted GPU 1, told GPU-B (its env file names UUIDs). GPU-A goes and
    NVML comes back numbering GPU-B 0 and GPU-C 1: by index the books said GPU 0 was free,
    and a unit granted it ran on GPU-B beside asr.service. Both are lost while it holds 1."""
    nvml = StubNvml()
    enumerate_as(nvml, "GPU-A", "GPU-B", "GPU-C")
    inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=3))
    holding = {"asr.service": [1]}
    assert not any(g.lost for g in inventory.sample(MANAGED, holding).gpus)
    nvml.devices_error = NvmlUnavailableError("nvmlDeviceGetCount", 9, "Driver Not Loaded")
    inventory.sample(MANAGED, holding)
    assert not inventory.available
    nvml.devices_error = None
    enumerate_as(nvml, "GPU-B", "GPU-C")
    assert inventory.retry()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        back = inventory.sample(MANAGED, holding)
        again = inventory.sample(MANAGED, holding)
    assert [(g.index, g.uuid, g.lost) for g in back.gpus] == [
        (0, "GPU-B", True),
        (1, "GPU-C", True),
    ]
    assert again.gpus == back.gpus
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 1 names another GPU since NVML numbered the GPUs anew: it was GPU-B when "
        "granted to asr.service, and is now GPU-C (GPU-B is now GPU 0); GPUs 0,1 are treated "
        "as lost until GPU 1 is released"
    ]
    released = inventory.sample(MANAGED, {})
    assert [(g.index, g.lost) for g in released.gpus] == [(0, False), (1, False)]


def test_a_renumbered_gpu_names_its_holders_up_to_a_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same with ten units sharing GPU 1 by Memory= (a user's `Accept=yes` instances may
    be thousands): the line names the first eight and how many more, not every one."""
    nvml = StubNvml()
    enumerate_as(nvml, "GPU-A", "GPU-B", "GPU-C")
    inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=3))
    holding = {f"u{i}.service": [1] for i in range(10)}
    inventory.sample(MANAGED, holding)
    enumerate_as(nvml, "GPU-B", "GPU-C")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        inventory.sample(MANAGED, holding)
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 1 names another GPU since NVML numbered the GPUs anew: it was GPU-B when "
        "granted to u0.service, u1.service, u2.service, u3.service, u4.service, u5.service, "
        "u6.service, u7.service and 2 more, and is now GPU-C (GPU-B is now GPU 0); GPUs 0,1 "
        "are treated as lost until GPU 1 is released"
    ]


def test_a_gpu_lost_to_a_renumbering_is_told_from_one_that_nvml_lost(tmp_path: Path) -> None:
    """Both take nothing new; only one NVML lost is no place for a suspended unit's memory.
    One lost because units hold another GPU by its number (`renumbered`) is there: a unit
    suspended from it waits for them to release it (Scheduler._held_by_old_numbers), where
    it was stopped, its work lost. asr.service holds GPU 1, GPU-B; GPU-A goes off the bus
    and GPU-C, now GPU 1, stops answering."""
    nvml = StubNvml()
    enumerate_as(nvml, "GPU-A", "GPU-B", "GPU-C")
    inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=3))
    holding = {"asr.service": [1]}
    inventory.sample(MANAGED, holding)
    enumerate_as(nvml, "GPU-B", "GPU-C")
    nvml.raises[1] = GpuLostError("nvmlDeviceGetComputeRunningProcesses", 15, "GPU is lost", 1)
    after = inventory.sample(MANAGED, holding)
    assert [(g.index, g.uuid, g.lost, g.renumbered) for g in after.gpus] == [
        (0, "GPU-B", True, True),
        (1, "GPU-C", True, False),
    ]


def test_a_held_index_whose_gpu_is_gone_keeps_its_gpu_from_being_granted_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A grant made while NVML was away (on the GPUs it last showed) counts as made on them:
    asr.service holds GPU 2 (GPU-C) and w@a.service GPU 0 (GPU-A); GPU-A goes."""
    nvml = StubNvml()
    enumerate_as(nvml, "GPU-A", "GPU-B", "GPU-C")
    inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=3))
    inventory.sample(MANAGED, {"asr.service": [2]})
    nvml.devices_error = NvmlUnavailableError("nvmlDeviceGetCount", 9, "Driver Not Loaded")
    inventory.sample(MANAGED, {"asr.service": [2]})
    holding = {"asr.service": [2], "w@a.service": [0]}  # granted GPU-A meanwhile
    assert [g.uuid for g in inventory.sample(MANAGED, holding).gpus] == [
        "GPU-A",
        "GPU-B",
        "GPU-C",
    ]
    nvml.devices_error = None
    enumerate_as(nvml, "GPU-B", "GPU-C")
    assert inventory.retry()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        back = inventory.sample(MANAGED, holding)
    assert [(g.index, g.lost) for g in back.gpus] == [(0, True), (1, True), (2, True)]
    assert sorted(r.getMessage() for r in caplog.records) == [
        "GPU 0 names another GPU since NVML numbered the GPUs anew: it was GPU-A when "
        "granted to w@a.service, and is now GPU-B (GPU-A is no longer listed); GPU 0 is "
        "treated as lost until it is released",
        "GPU 2 is no longer among the GPUs gpuslice manages, but units hold it: treated as lost",
        "GPU 2 names another GPU since NVML numbered the GPUs anew: it was GPU-C when "
        "granted to asr.service, and is no longer listed (GPU-C is now GPU 1); GPUs 1,2 are "
        "treated as lost until GPU 2 is released",
    ]
    after = inventory.sample(MANAGED, {"asr.service": [2]})
    assert [(g.index, g.lost) for g in after.gpus] == [(0, False), (1, True), (2, True)]


def test_a_restarted_controller_checks_its_holders_gpus_against_what_they_were_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The books (state.json) say GPU 1, its env file GPU-B: NVML, opened afresh by the new
    controller, numbers GPU-B 0. Told nothing, the inventory trusts today's numbering."""
    nvml = StubNvml()
    enumerate_as(nvml, "GPU-B", "GPU-C")
    inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=2))
    inventory.sample(MANAGED)  # the first sample, before the books are read
    inventory.remember({1: "GPU-B", 0: ""})
    holding = {"asr.service": [1]}
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        after = inventory.sample(MANAGED, holding)
    assert [(g.index, g.lost) for g in after.gpus] == [(0, True), (1, True)]
    assert len(caplog.records) == 1


def test_an_env_files_word_replaces_a_booking_a_sample_made_by_todays_numbering(
    tmp_path: Path,
) -> None:
    """GPU 1 was booked by the sample that saw asr.service hold it (GPU-C, NVML's numbering
    of the moment); then the env file of a unit adopted beside it says GPU 1 was GPU-B
    when granted. The file names what the unit's processes run on: it wins, and GPU-B's
    index now (0) is lost with GPU 1. Kept, the sample's word hid that GPU 0 is GPU-B, and
    it was granted beside the adopted unit. A word the books already hold teaches nothing
    (the controller samples again only after one that does)."""
    nvml = StubNvml()
    enumerate_as(nvml, "GPU-B", "GPU-C")
    inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=2))
    holding = {"asr.service": [1]}
    assert not any(g.lost for g in inventory.sample(MANAGED, holding).gpus)
    assert not inventory.remember({1: "GPU-C"})  # booked so by the first sample itself
    assert inventory.remember({1: "GPU-B"})
    assert not inventory.remember({1: "GPU-B"})
    holding = {"asr.service": [1], "tts.service": [1]}
    after = inventory.sample(MANAGED, holding)
    assert [(g.index, g.lost) for g in after.gpus] == [(0, True), (1, True)]


def test_a_renumbered_gpu_shared_by_units_names_them_all_and_keeps_its_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two units share GPU 1 (each a part of its memory): the error names both, the units an
    admin must release it from. A GPU marked lost is still shown by its UUID and model (what
    `gpuslice status` lists): only what it can hold is gone."""
    nvml = StubNvml()
    enumerate_as(nvml, "GPU-A", "GPU-B", "GPU-C")
    inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=3))
    holding = {"w@a.service": [1], "asr.service": [1]}
    inventory.sample(MANAGED, holding)
    enumerate_as(nvml, "GPU-B", "GPU-C")
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        after = inventory.sample(MANAGED, holding)
    assert [(g.index, g.uuid, g.name, g.lost) for g in after.gpus] == [
        (0, "GPU-B", "NVIDIA Fake 24GB", True),
        (1, "GPU-C", "NVIDIA Fake 24GB", True),
    ]
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 1 names another GPU since NVML numbered the GPUs anew: it was GPU-B when "
        "granted to asr.service, w@a.service, and is now GPU-C (GPU-B is now GPU 0); GPUs 0,1 "
        "are treated as lost until GPU 1 is released"
    ]


def test_a_held_gpu_gone_with_its_index_is_gone_not_renumbered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The last card goes: its index and its UUID are both unlisted, and no other GPU took
    its number. One error says so (_with_gone); the GPUs still there are not renumbered, so
    none of them is lost and none is said to name another GPU."""
    nvml = StubNvml()
    enumerate_as(nvml, "GPU-A", "GPU-B")
    inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=2))
    holding = {"asr.service": [1]}
    inventory.sample(MANAGED, holding)
    enumerate_as(nvml, "GPU-A")
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        after = inventory.sample(MANAGED, holding)
    assert [(g.index, g.uuid, g.lost) for g in after.gpus] == [(0, "GPU-A", False), (1, "", True)]
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 1 is no longer among the GPUs gpuslice manages, but units hold it: treated as lost"
    ]


def test_a_reload_enumerates_the_gpus_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NVML counts GPUs at init: a new config (a reload) opens it afresh, so a card added
    since is seen; manage_gpus applies at once."""
    nvml = StubNvml(gpus=2)
    inventory, _ = make_inventory(tmp_path, nvml)
    inventory.sample(MANAGED)
    nvml.infos.append(GpuInfo(2, "GPU-3", "NVIDIA Fake 24GB", 24 * GIB, 0))
    nvml.procs[2] = []
    inventory.config = Config(gpus=1)
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        after = inventory.sample(MANAGED)
    assert [g.index for g in after.gpus] == [0, 1, 2]
    assert nvml.opened == 2
    assert [r.getMessage() for r in caplog.records] == ["GPUs changed: now 0, 1, 2 (were 0, 1)"]
    inventory.config = Config(manage_gpus=("1",))
    assert [g.index for g in inventory.sample(MANAGED).gpus] == [1]


def test_driver_loaded_after_start_behind_the_device_cgroup_asks_for_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd resolved DeviceAllow=char-nvidia-frontend when no nvidia major existed: the
    node answers EPERM once the module is there, and only a restart helps."""
    nvml = StubNvml(available=False)
    inventory = waiting_inventory(tmp_path, nvml, Config())
    assert inventory.retry() is False
    assert inventory.restart_needed == ""  # module not loaded yet
    module = nvidia_root(tmp_path) / "sys" / "module" / "nvidia"
    module.mkdir(parents=True)
    monkeypatch.setattr("gpuslice.inventory.device_denied", lambda root: True)
    assert inventory.retry() is False
    assert "loaded after gpuslice.service started" in inventory.restart_needed


def test_no_restart_when_the_driver_was_there_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = nvidia_root(tmp_path)
    (root / "proc").mkdir()
    (root / "proc" / "devices").write_text("Character devices:\n195 nvidia-frontend\n")
    (root / "sys" / "module" / "nvidia").mkdir(parents=True)
    inventory = waiting_inventory(tmp_path, StubNvml(available=False), Config())
    monkeypatch.setattr("gpuslice.inventory.device_denied", lambda root: True)
    assert inventory.retry() is False
    assert inventory.restart_needed == ""


@pytest.mark.parametrize(
    ("manage", "expected", "said"),
    [
        ((), [0, 1, 2], "gpus: 3 from config.yaml"),
        (("2", "0"), [0, 2], "manage_gpus: 2, 0 from config.yaml"),  # a split host's own
        (("1", "GPU-x"), [0, 1, 2], "gpus: 3 from config.yaml"),  # a UUID: not known yet
    ],
)
def test_before_nvml_answers_a_split_host_guesses_only_its_own_gpus(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    manage: tuple[str, ...],
    expected: list[int],
    said: str,
) -> None:
    nvml = StubNvml(available=False)
    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=3, manage_gpus=manage))
        sample = inventory.sample(MANAGED)
    assert [g.index for g in sample.gpus] == expected
    assert inventory.fallback_gpus() == [Gpu(i) for i in expected]
    assert said in caplog.records[0].getMessage()


def test_a_kept_sample_is_attributed_again_to_the_units_known_now(tmp_path: Path) -> None:
    """The first sample of a start-up knows no unit: every job's process is foreign. Kept
    while NVML fails, it is attributed again from the processes' cgroups (no NVML call):
    a unit's own process counts as its, a stray of a unit not holding that GPU as foreign,
    and a process whose cgroup cannot be read keeps how it was counted."""
    nvml = StubNvml()
    write_proc(tmp_path, 100, "0::/system.slice/asr.service\n")
    write_proc(tmp_path, 101, "0::/system.slice/asr.service\n")
    write_proc(tmp_path, 102, "0::/user.slice/user-1000.slice/session-3.scope\n")
    write_proc(tmp_path, 103, "0::/system.slice/old.service\n")
    nvml.add(0, 100, 3 * GIB)
    nvml.add(1, 101, 1 * GIB)  # asr holds GPU 0 only: a stray on GPU 1
    nvml.add(1, 102, 2 * GIB)  # a user's, gone from /proc before the next sample
    nvml.add(0, 103, 1 * GIB)  # old.service's, no longer managed by then
    inventory, clock = make_inventory(tmp_path, nvml)
    first = inventory.sample(frozenset({"old.service"}))
    assert [(p.pid, p.unit) for p in first.processes] == [
        (100, None),
        (103, "old.service"),
        (101, None),
        (102, None),
    ]
    assert [g.foreign for g in first.gpus] == [3 * GIB + 1 * GIB, 3 * GIB]
    nvml.devices_error = NvmlError("nvmlDeviceGetCount", 999, "Unknown Error")
    clock.now += 1
    (tmp_path / "102" / "cgroup").unlink()  # its cgroup cannot be read now
    kept = inventory.sample(MANAGED, {"asr.service": {0}})
    assert [(p.pid, p.unit) for p in kept.processes] == [
        (100, "asr.service"),
        (103, None),
        (101, "asr.service"),
        (102, None),
    ]
    assert kept.processes[3].owner == first.processes[3].owner  # the user's, as it was
    assert kept.processes[3].owner is not None and "1000" in kept.processes[3].owner.label()
    assert kept.processes[1].owner is not None  # old.service's process is foreign now
    assert [g.foreign for g in kept.gpus] == [1 * GIB, 3 * GIB]  # old's; the stray and 102
    assert [g.foreign_pids for g in kept.gpus] == [(103,), (102,)]
    assert kept.gpus[0].total == first.gpus[0].total  # all else as NVML last showed it


def test_without_nvml_the_gpus_it_last_showed_keep_their_marks(tmp_path: Path) -> None:
    nvml = StubNvml()
    nvml.lost = [1]
    inventory, _ = make_inventory(tmp_path, nvml)
    inventory.sample(MANAGED)
    assert [(g.index, g.uuid, g.lost) for g in inventory.fallback_gpus()] == [
        (0, UUIDS[0], False),
        (1, "", True),  # lost before NVML named it
    ]
