"""gpuslice.nvml on the fake NVML (tests/fakenvml): the production code path, no GPU.

pynvml dlopens libnvidia-ml.so.1 (found through LD_LIBRARY_PATH) once per process, so
every NVML query runs in a fresh child: this file run as `python test_nvml_fake.py PROBE`,
which prints one JSON object. Fake jobs are gpu-alloc processes; tests wait for their
output lines and exits, never for a fixed time.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
MIB = 1 << 20
UUIDS = ("GPU-11111111-1111-1111-1111-111111111111", "GPU-22222222-2222-2222-2222-222222222222")
# The two spellings of 24 GiB exercise the fake's size parser.
GPUS = (
    "# index uuid total name\n"
    f"0 {UUIDS[0]} 24GiB NVIDIA Fake 24GB\n"
    f"1 {UUIDS[1]} 24G NVIDIA Fake 24GB\n"
)
FALLBACK = "gpus: 2 from config.yaml"
TIMEOUT = 30.0  # generous ceiling for a child or a line; a pass never waits this long


# ---- probes: run in the child process, print JSON ----


def _probe_api() -> dict[str, Any]:
    """Everything gpuslice.nvml reports, as the controller would call it."""
    from gpuslice.nvml import GpuLostError, Nvml, NvmlUnavailableError

    with Nvml() as nvml:
        status = nvml.open(fallback=FALLBACK)
        out: dict[str, Any] = {"status": asdict(status)}
        try:
            scan = nvml.devices()
        except NvmlUnavailableError as e:
            out["devices_error"] = str(e)
            return out
        out["gpus"] = [asdict(gpu) for gpu in scan.gpus]
        out["lost"] = scan.lost
        processes: dict[str, Any] = {}
        for index in range(len(scan.gpus) + len(scan.lost)):
            try:
                processes[str(index)] = [asdict(p) for p in nvml.processes(index)]
            except GpuLostError as e:
                processes[str(index)] = f"lost: {e}"
        out["processes"] = processes
    return out


def _probe_pynvml() -> dict[str, Any]:
    """What raw pynvml sees: proves the fake's symbols and struct layouts match it."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return {"init_error": e.value, "message": str(e)}
    out: dict[str, Any] = {
        "driver": pynvml.nvmlSystemGetDriverVersion(),
        "nvml_version": pynvml.nvmlSystemGetNVMLVersion(),
        "count": pynvml.nvmlDeviceGetCount(),
    }
    gpus: list[dict[str, Any]] = []
    for i in range(out["count"]):
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            mem2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            compute = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            bus_id = pynvml.nvmlDeviceGetPciInfo(h).busId  # str or bytes, by pynvml version
            gpus.append(
                {
                    "index": pynvml.nvmlDeviceGetIndex(h),
                    "by_uuid": pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid)),
                    "uuid": uuid,
                    "name": pynvml.nvmlDeviceGetName(h),
                    "pci_bus_id": bus_id.decode() if isinstance(bus_id, bytes) else bus_id,
                    "memory": [mem.total, mem.free, mem.used],
                    "memory_v2": [mem2.total, mem2.free, mem2.used],
                    "compute": [[p.pid, p.usedGpuMemory] for p in compute],
                    "graphics": [
                        [p.pid, p.usedGpuMemory]
                        for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
                    ],
                }
            )
        except pynvml.NVMLError as e:
            gpus.append({"index": i, "error": e.value, "message": str(e)})
    out["gpus"] = gpus
    pynvml.nvmlShutdown()
    return out


def _probe_size_protocol() -> dict[str, Any]:
    """NVML's two-call protocol on GPU 0, through ctypes with pynvml's own struct."""
    import pynvml

    lib = ctypes.CDLL("libnvidia-ml.so.1")
    assert lib.nvmlInit_v2() == 0
    handle = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
    get = lib.nvmlDeviceGetComputeRunningProcesses_v3
    count = ctypes.c_uint(0)
    first = get(handle, ctypes.byref(count), None)
    needed = count.value
    short = ctypes.c_uint(needed - 1)
    buffer = (pynvml.c_nvmlProcessInfo_v3_t * needed)()
    too_small = get(handle, ctypes.byref(short), buffer)
    count = ctypes.c_uint(needed)
    second = get(handle, ctypes.byref(count), buffer)
    pids = [buffer[i].pid for i in range(count.value)]
    return {
        "first": first,
        "needed": needed,
        "too_small": too_small,
        "second": second,
        "pids": pids,
    }


def _probe_lost_after_handle() -> dict[str, Any]:
    """A GPU lost after its handle was taken: later calls on that handle fail too."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(1)
    lost = Path(os.environ["FAKE_NVML_DIR"]) / "lost"
    lost.mkdir()
    (lost / "1").touch()
    try:
        pynvml.nvmlDeviceGetMemoryInfo(handle)
    except pynvml.NVMLError as e:
        return {"error": e.value, "message": str(e)}
    return {"error": None}


def _probe_driver_lifecycle() -> dict[str, Any]:
    """One process across the driver's life: not loaded yet, loaded, a GPU added, gone, back.
    The test leaves `gpus` at `gpus.later`; this probe moves it into place ("the module
    loads"), as a driver that appears after gpuslice started."""
    from gpuslice.nvml import Nvml, NvmlUnavailableError

    state = Path(os.environ["FAKE_NVML_DIR"])
    steps: dict[str, Any] = {}
    nvml = Nvml()

    def seen(name: str) -> None:
        status = nvml.reopen(fallback=FALLBACK)
        step: dict[str, Any] = {"available": status.available}
        if status.available:
            try:
                step["gpus"] = [g.uuid for g in nvml.devices().gpus]
            except NvmlUnavailableError as e:
                step["devices_error"] = e.code
        else:
            step["warning"] = status.warning
        steps[name] = step

    assert not nvml.open(fallback=FALLBACK).available
    seen("not loaded yet")
    (state / "gpus.later").rename(state / "gpus")
    seen("loaded")
    with open(state / "gpus", "a") as f:
        f.write(f"2 {UUIDS[0][:-1]}3 24GiB NVIDIA Fake 24GB\n")
    steps["before re-init"] = len(nvml.devices().gpus)
    seen("gpu added")
    (state / "unloaded").touch()
    try:
        nvml.devices()
    except NvmlUnavailableError as e:
        steps["gone: devices"] = e.code
    seen("gone")
    (state / "unloaded").unlink()
    seen("back")
    nvml.close()
    return steps


PROBES: dict[str, Callable[[], dict[str, Any]]] = {
    "driver_lifecycle": _probe_driver_lifecycle,
    "api": _probe_api,
    "pynvml": _probe_pynvml,
    "size_protocol": _probe_size_protocol,
    "lost_after_handle": _probe_lost_after_handle,
}


# ---- harness ----


def _read_line(stream: Any, deadline: float) -> str:
    """One line from an unbuffered pipe, or fail at `deadline` instead of hanging."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        ready, _, _ = select.select([stream], [], [], max(left, 0))
        if not ready:
            raise AssertionError(f"no line within {TIMEOUT}s (got {data!r})")
        chunk = os.read(stream.fileno(), 1)
        if not chunk:
            raise AssertionError(f"pipe closed before a full line (got {data!r})")
        data += chunk
    return data.decode().rstrip("\n")


class Alloc:
    """A running gpu-alloc: a fake job holding GPU memory until signalled (the jobs of
    tests/test_fake_checkpoint.py too)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.ready = ""

    def read_line(self) -> str:
        return _read_line(self.proc.stdout, time.monotonic() + TIMEOUT)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=TIMEOUT)


def reap(allocs: list[Alloc]) -> None:
    """Kill what still runs and collect every one (tests/test_fake_checkpoint.py's jobs too)."""
    for alloc in allocs:
        if alloc.proc.poll() is None:
            alloc.proc.kill()
        alloc.proc.wait()
        if alloc.proc.stdout is not None:
            alloc.proc.stdout.close()


class FakeGpus:
    """A fake NVML state dir (two 24 GiB GPUs) plus the built library and gpu-alloc."""

    def __init__(self, build: Path, state: Path) -> None:
        self.build = build
        self.state = state
        self.allocs: list[Alloc] = []
        state.mkdir()
        (state / "gpus").write_text(GPUS)

    def env(self, *, library: bool = True, state: bool = True) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_DIR")}
        env["PYTHONPATH"] = str(REPO)
        env["LD_LIBRARY_PATH"] = str(self.build if library else self.state / "empty")
        if state:
            env["FAKE_NVML_DIR"] = str(self.state)
        return env

    def alloc(self, gpu: int, size: str, *extra: str) -> Alloc:
        cmd = [str(self.build / "gpu-alloc"), "--gpu", str(gpu), "--bytes", size, *extra]
        proc = subprocess.Popen(cmd, env=self.env(), stdout=subprocess.PIPE, bufsize=0)
        alloc = Alloc(proc)
        self.allocs.append(alloc)  # before waiting, so close() reaps it even on failure
        alloc.ready = alloc.read_line()
        return alloc

    def lose(self, index: int) -> None:
        (self.state / "lost").mkdir(exist_ok=True)
        (self.state / "lost" / str(index)).touch()

    def alloc_files(self) -> list[str]:
        return sorted(p.name for p in (self.state / "alloc").iterdir())

    def probe(self, name: str, *, library: bool = True, state: bool = True) -> dict[str, Any]:
        run = subprocess.run(
            [sys.executable, __file__, name],
            env=self.env(library=library, state=state),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        assert run.returncode == 0, run.stderr
        assert run.stderr == "", "NVML use must not print anything"
        result: dict[str, Any] = json.loads(run.stdout)
        return result

    def close(self) -> None:
        reap(self.allocs)


@pytest.fixture
def fake(fake_build: Path, tmp_path: Path) -> Iterator[FakeGpus]:
    gpus = FakeGpus(fake_build, tmp_path / "nvml")
    yield gpus
    gpus.close()


def _gpu(index: int, used: int) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": UUIDS[index],
        "name": "NVIDIA Fake 24GB",
        "memory_total": 24 * GIB,
        "memory_used": used,
    }


# ---- tests ----


def test_discovers_two_24gib_gpus(fake: FakeGpus) -> None:
    api = fake.probe("api")
    assert api["status"] == {"available": True, "warning": None, "driver_version": "550.54.15"}
    assert api["gpus"] == [_gpu(0, 0), _gpu(1, 0)]
    assert api["lost"] == []
    assert api["processes"] == {"0": [], "1": []}

    raw = fake.probe("pynvml")
    assert (raw["driver"], raw["nvml_version"], raw["count"]) == ("550.54.15", "12.550.54.15", 2)
    for i, gpu in enumerate(raw["gpus"]):
        assert gpu["index"] == gpu["by_uuid"] == i
        assert gpu["uuid"] == UUIDS[i]
        assert gpu["pci_bus_id"] == f"00000000:0{i + 1}:00.0"
        assert gpu["memory"] == gpu["memory_v2"] == [24 * GIB, 24 * GIB, 0]
        assert (gpu["compute"], gpu["graphics"]) == ([], [])


def test_memory_and_processes_follow_allocations(fake: FakeGpus) -> None:
    a = fake.alloc(0, "512M")
    b = fake.alloc(0, "1GiB")
    c = fake.alloc(1, "20G")
    assert a.ready == f"ready pid={a.pid} gpu=0 bytes={512 * MIB}"

    api = fake.probe("api")
    assert api["gpus"] == [_gpu(0, 512 * MIB + GIB), _gpu(1, 20 * GIB)]
    assert api["processes"]["0"] == sorted(
        [
            {"pid": a.pid, "gpu_index": 0, "used_memory": 512 * MIB, "compute": True},
            {"pid": b.pid, "gpu_index": 0, "used_memory": GIB, "compute": True},
        ],
        key=lambda p: p["pid"],
    )
    assert api["processes"]["1"] == [
        {"pid": c.pid, "gpu_index": 1, "used_memory": 20 * GIB, "compute": True}
    ]

    raw = fake.probe("pynvml")
    used0 = 512 * MIB + GIB
    assert raw["gpus"][0]["memory"] == [24 * GIB, 24 * GIB - used0, used0]
    assert sorted(raw["gpus"][0]["compute"]) == sorted([[a.pid, 512 * MIB], [b.pid, GIB]])
    assert raw["gpus"][1]["compute"] == [[c.pid, 20 * GIB]]

    assert b.stop() == -signal.SIGTERM
    assert str(b.pid) not in fake.alloc_files(), "gpu-alloc removes its file on exit"
    assert fake.probe("api")["gpus"][0] == _gpu(0, 512 * MIB)


def test_a_graphics_process_is_in_the_graphics_list_only(fake: FakeGpus) -> None:
    """A display server (`gpu-alloc --graphics`): NVML's graphics list, not the compute one;
    its memory is used all the same; gpuslice marks it graphics-only."""
    x = fake.alloc(0, "1G", "--graphics")
    job = fake.alloc(0, "2G")
    raw = fake.probe("pynvml")
    assert (raw["gpus"][0]["compute"], raw["gpus"][0]["graphics"]) == (
        [[job.pid, 2 * GIB]],
        [[x.pid, GIB]],
    )
    assert raw["gpus"][0]["memory"][2] == 3 * GIB
    api = fake.probe("api")
    assert sorted(api["processes"]["0"], key=lambda p: p["pid"]) == sorted(
        [
            {"pid": x.pid, "gpu_index": 0, "used_memory": GIB, "compute": False},
            {"pid": job.pid, "gpu_index": 0, "used_memory": 2 * GIB, "compute": True},
        ],
        key=lambda p: p["pid"],
    )

    # in both lists (CUDA and OpenGL in one process): a compute process, as NVML's compute
    # entry says; a 4th field other than `graphics` is a malformed file, never listed
    (fake.state / "alloc" / "both-c").write_text(f"1 {os.getpid()} 1G\n")
    (fake.state / "alloc" / "both-g").write_text(f"1 {os.getpid()} 1G graphics\n")
    (fake.state / "alloc" / "odd").write_text(f"1 {os.getpid()} 1G vulkan\n")
    assert fake.probe("api")["processes"]["1"] == [
        {"pid": os.getpid(), "gpu_index": 1, "used_memory": GIB, "compute": True}
    ]


def test_process_list_uses_nvml_size_query_protocol(fake: FakeGpus) -> None:
    a = fake.alloc(0, "1G")
    b = fake.alloc(0, "2G")
    result = fake.probe("size_protocol")
    assert result == {
        "first": 7,  # NVML_ERROR_INSUFFICIENT_SIZE, count set to what is needed
        "needed": 2,
        "too_small": 7,
        "second": 0,
        "pids": sorted([a.pid, b.pid]),
    }


def test_allocations_of_dead_pids_do_not_count(fake: FakeGpus) -> None:
    killed = fake.alloc(0, "4G")
    assert killed.stop(signal.SIGKILL) == -signal.SIGKILL
    assert fake.alloc_files() == [str(killed.pid)], "SIGKILL leaves a stale file"

    zombie = fake.alloc(1, "4G")
    zombie.proc.kill()
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped

    # Listed, but NVML cannot say how much it uses ("-"): unknown, not zero.
    (fake.state / "alloc" / "unknown").write_text(f"1 {os.getpid()} -\n")

    api = fake.probe("api")
    assert api["gpus"] == [_gpu(0, 0), _gpu(1, 0)]
    assert api["processes"] == {
        "0": [],
        "1": [{"pid": os.getpid(), "gpu_index": 1, "used_memory": None, "compute": True}],
    }
    zombie.proc.wait()


def test_lost_gpu_is_reported_not_raised(fake: FakeGpus) -> None:
    fake.alloc(0, "1G")
    fake.lose(1)
    api = fake.probe("api")
    assert api["gpus"] == [_gpu(0, GIB)]
    assert api["lost"] == [1]
    assert api["processes"]["1"] == (
        "lost: nvmlDeviceGetHandleByIndex on GPU 1: GPU is lost (NVML error 15)"
    )

    raw = fake.probe("pynvml")
    assert raw["gpus"][1] == {"index": 1, "error": 15, "message": "GPU is lost"}


def test_gpu_lost_after_its_handle_was_taken(fake: FakeGpus) -> None:
    assert fake.probe("lost_after_handle") == {"error": 15, "message": "GPU is lost"}


def test_nvml_library_missing_is_one_warning(fake: FakeGpus) -> None:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        pass
    else:
        pytest.skip("a real libnvidia-ml.so.1 is installed on this host")
    api = fake.probe("api", library=False)
    warning = (
        "NVML unavailable (libnvidia-ml.so.1 not found): using gpus: 2 from config.yaml. "
        "Hint: install the NVIDIA driver or set gpus: in config.yaml"
    )
    assert api["status"] == {"available": False, "warning": warning, "driver_version": None}
    assert api["devices_error"] == f"nvmlInit: {warning} (NVML error 12)"


@pytest.mark.parametrize("broken", ["no FAKE_NVML_DIR", "no gpus file"])
def test_driver_not_loaded_is_one_warning(fake: FakeGpus, broken: str) -> None:
    if broken == "no gpus file":
        (fake.state / "gpus").unlink()
    api = fake.probe("api", state=broken != "no FAKE_NVML_DIR")
    warning = api["status"]["warning"]
    assert api["status"]["available"] is False
    assert warning.startswith("NVML unavailable (NVIDIA driver not loaded): using gpus: 2 ")
    assert "Hint: " in warning
    assert "\n" not in warning

    raw = fake.probe("pynvml", state=broken != "no FAKE_NVML_DIR")
    assert raw == {"init_error": 9, "message": "Driver Not Loaded"}


def test_ignore_term_delays_exit_on_sigterm(fake: FakeGpus) -> None:
    """6 s, not 2: the probe is a Python process of its own, and on a loaded machine it read
    the GPUs more than 2 s after the SIGTERM, when the victim had gone (a flaky failure)."""
    victim = fake.alloc(0, "8G", "--ignore-term", "6")
    sent = time.monotonic()
    victim.proc.send_signal(signal.SIGTERM)
    assert victim.read_line() == "ignoring SIGTERM for 6 s"
    # still there (unless the test itself ran 6 s late)
    assert victim.proc.poll() is None or time.monotonic() - sent >= 6.0
    gpu = fake.probe("api")["gpus"][0]
    probed = time.monotonic() - sent
    if probed < 6.0:  # else the probe came too late to tell: the exit is still checked
        assert gpu == _gpu(0, 8 * GIB), f"a slow victim still holds memory ({probed:.1f} s)"

    assert victim.proc.wait(timeout=TIMEOUT) == -signal.SIGTERM
    assert time.monotonic() - sent >= 6.0
    assert fake.alloc_files() == []


@pytest.mark.parametrize(
    ("size", "expected"),
    [("512M", 512 * MIB), ("20G", 20 * GIB), ("20GiB", 20 * GIB), ("4096", 4096), ("20GB", None)],
)
def test_gpu_alloc_sizes(fake: FakeGpus, size: str, expected: int | None) -> None:
    if expected is None:
        run = subprocess.run(
            [str(fake.build / "gpu-alloc"), "--gpu", "0", "--bytes", size],
            env=fake.env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        assert run.returncode == 2
        assert "expected a size like 512M, 20G or 20GiB" in run.stderr
        return
    alloc = fake.alloc(0, size)
    assert alloc.ready == f"ready pid={alloc.pid} gpu=0 bytes={expected}"


if __name__ == "__main__":
    print(json.dumps(PROBES[sys.argv[1]]()))


def test_driver_not_loaded_yet_loaded_gpu_added_gone_and_back(fake: FakeGpus) -> None:
    """The states gpuslice's retries rely on, in one NVML client process: a failed nvmlInit
    can be retried, a re-init sees GPUs added, and a session outlives an unloaded driver only
    as DRIVER_NOT_LOADED errors until a fresh init."""
    (fake.state / "gpus").rename(fake.state / "gpus.later")
    steps = fake.probe("driver_lifecycle")
    not_loaded = {
        "available": False,
        "warning": "NVML unavailable (NVIDIA driver not loaded): using gpus: 2 from config.yaml. "
        "Hint: check `nvidia-smi` and `dmesg`, load the nvidia kernel module, or set gpus: in "
        "config.yaml",
    }
    three = [*UUIDS, UUIDS[0][:-1] + "3"]
    assert steps == {
        "not loaded yet": not_loaded,
        "loaded": {"available": True, "gpus": list(UUIDS)},
        "before re-init": 2,
        "gpu added": {"available": True, "gpus": three},
        "gone: devices": 9,
        "gone": not_loaded,
        "back": {"available": True, "gpus": three},
    }
