"""gpuslice.nvml's promises that mutation testing showed no test held.

tests/test_nvml_fake.py runs pynvml on the fake libnvidia-ml.so.1 in child processes, which
cannot return every NVML code and which mutation testing does not see. Here a `pynvml` of our
own (`FakePynvml`, put in `sys.modules`) answers in-process and fails on demand with any NVML
code, so each outcome of `Nvml._call` is pinned word for word: the one warning line (reason,
fallback, hint) an admin reads when NVML is unavailable, the exception type, call, code and GPU
of every failure, the lost GPUs `devices()` lists instead of raising, and the process lists
merged by pid from the newest call the driver has.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from gpuslice.nvml import (
    DeviceScan,
    GpuInfo,
    GpuLostError,
    GpuProcess,
    Nvml,
    NvmlError,
    NvmlStatus,
    NvmlUnavailableError,
    _NotSupportedError,
)

GIB = 1 << 30
FALLBACK = "gpus: 2 from config.yaml"
DRIVER = "550.54.15"

# What pynvml's NVMLError says (nvmlErrorString) for the codes used here.
MESSAGES = {
    1: "Uninitialized",
    2: "Invalid Argument",
    3: "Not Supported",
    4: "Insufficient Permissions",
    8: "Insufficient External Power",
    9: "Driver Not Loaded",
    11: "Interrupt request issue",
    12: "NVML Shared Library Not Found",
    13: "Function Not Found",
    15: "GPU is lost",
    16: "GPU requires restart",
    18: "RM has detected an NVML/RM version mismatch.",
    21: "No data",
    999: "Unknown Error",
}


class FakeNVMLError(Exception):
    """pynvml's NVMLError: the NVML return code in `value`, nvmlErrorString as str()."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return MESSAGES[self.value]


class Handle:
    """An nvmlDevice_t: only what nvmlDeviceGetHandleByIndex returned is accepted."""

    def __init__(self, index: int) -> None:
        self.index = index


def entry(pid: int, used: int | None) -> types.SimpleNamespace:
    """One c_nvmlProcessInfo_t as pynvml returns it (usedGpuMemory None: NVML cannot say)."""
    return types.SimpleNamespace(pid=pid, usedGpuMemory=used)


class FakePynvml:
    """A pynvml module: `gpus` GPUs of 24 GiB, GPU i using i GiB; every call recorded in
    `calls`. `fail[(name, gpu)]` (gpu None: any) makes that call raise an NVML code (int) or
    any exception; `lost` GPUs fail every call with GPU_IS_LOST; `missing` names the process
    functions this driver lacks (pynvml says FUNCTION_NOT_FOUND); `processes[(kind, gpu)]`
    is the list NVML returns."""

    NVMLError = FakeNVMLError

    def __init__(self, gpus: int = 2) -> None:
        self.gpus = gpus
        self.calls: list[str] = []
        self.fail: dict[tuple[str, int | None], int | Exception] = {}
        self.lost: set[int] = set()
        self.missing: set[str] = set()
        self.processes: dict[tuple[str, int], list[types.SimpleNamespace]] = {}

    def _enter(self, name: str, gpu: int | None = None) -> None:
        self.calls.append(name)
        failure = self.fail.get((name, gpu), self.fail.get((name, None)))
        if failure is None and gpu in self.lost:
            failure = 15
        if isinstance(failure, Exception):
            raise failure
        if failure is not None:
            raise FakeNVMLError(failure)

    def _gpu(self, name: str, handle: object) -> int:
        if not isinstance(handle, Handle):
            self.calls.append(name)
            raise FakeNVMLError(2)
        self._enter(name, handle.index)
        return handle.index

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return DRIVER

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index: object) -> Handle:
        if not isinstance(index, int) or not 0 <= index < self.gpus:
            self.calls.append("nvmlDeviceGetHandleByIndex")
            raise FakeNVMLError(2)
        self._enter("nvmlDeviceGetHandleByIndex", index)
        return Handle(index)

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> types.SimpleNamespace:
        index = self._gpu("nvmlDeviceGetMemoryInfo", handle)
        return types.SimpleNamespace(total=24 * GIB, used=index * GIB, free=(24 - index) * GIB)

    def nvmlDeviceGetUUID(self, handle: object) -> str:
        return f"GPU-{self._gpu('nvmlDeviceGetUUID', handle)}"

    def nvmlDeviceGetName(self, handle: object) -> str:
        return f"NVIDIA Fake {self._gpu('nvmlDeviceGetName', handle)}"

    def _list(self, kind: str, version: str, handle: object) -> list[types.SimpleNamespace]:
        name = f"nvmlDeviceGet{kind}RunningProcesses{version}"
        if name in self.missing:
            self.calls.append(name)
            raise FakeNVMLError(13)
        return list(self.processes.get((kind, self._gpu(name, handle)), []))

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: object) -> list[Any]:
        return self._list("Compute", "_v3", handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: object) -> list[Any]:
        return self._list("Compute", "_v2", handle)

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: object) -> list[Any]:
        return self._list("Graphics", "_v3", handle)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: object) -> list[Any]:
        return self._list("Graphics", "_v2", handle)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakePynvml:
    module = FakePynvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def gpu(index: int) -> GpuInfo:
    return GpuInfo(index, f"GPU-{index}", f"NVIDIA Fake {index}", 24 * GIB, index * GIB)


def raised(call: Any, *args: Any) -> NvmlError:
    with pytest.raises(NvmlError) as failed:
        call(*args)
    return failed.value


def pinned(error: NvmlError) -> tuple[type, str, str, int, int | None]:
    return type(error), str(error), error.call, error.code, error.gpu


# ---- open(): the one warning line -------------------------------------------------------------


def test_pynvml_not_importable_is_one_warning_that_says_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No pynvml at all (a host without nvidia-ml-py): the same one warning line as a missing
    library, then every query says so as NvmlUnavailableError, with libnvidia-ml's code."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    warning = (
        "NVML unavailable (pynvml not importable: import of pynvml halted; None in "
        f"sys.modules): using {FALLBACK}. Hint: install nvidia-ml-py"
    )
    with Nvml() as nvml:
        assert nvml.open(fallback=FALLBACK) == NvmlStatus(False, warning, None)
        error = raised(nvml.devices)
        assert pinned(error) == (
            NvmlUnavailableError,
            f"nvmlInit: {warning} (NVML error 12)",
            "nvmlInit",
            12,
            None,
        )
        assert pinned(raised(nvml.processes, 0)) == pinned(error)


def test_the_default_fallback_is_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a fallback (the first query opening NVML itself) the line says "no GPUs"."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    warning = (
        "NVML unavailable (pynvml not importable: import of pynvml halted; None in "
        "sys.modules): using no GPUs. Hint: install nvidia-ml-py"
    )
    nvml = Nvml()
    assert str(raised(nvml.devices)) == f"nvmlInit: {warning} (NVML error 12)"
    assert nvml.open() == NvmlStatus(False, warning, None)


CONFIG_HINT = "set gpus: in config.yaml"


@pytest.mark.parametrize(
    ("code", "reason", "hint"),
    [
        (12, "libnvidia-ml.so.1 not found", f"install the NVIDIA driver or {CONFIG_HINT}"),
        (
            9,
            "NVIDIA driver not loaded",
            f"check `nvidia-smi` and `dmesg`, load the nvidia kernel module, or {CONFIG_HINT}",
        ),
        (
            18,
            "driver and libnvidia-ml.so.1 versions differ",
            "reboot (or reload the nvidia kernel module) after a driver upgrade",
        ),
        (
            4,
            "permission denied",
            "run gpuslice as root or check the permissions of /dev/nvidia*",
        ),
        # codes without a hint of their own: NVML's words, and the generic hint
        (1, "nvmlInit: Uninitialized (NVML error 1)", f"check `nvidia-smi` or {CONFIG_HINT}"),
        (999, "nvmlInit: Unknown Error (NVML error 999)", f"check `nvidia-smi` or {CONFIG_HINT}"),
    ],
)
def test_a_failed_nvml_init_is_one_warning_with_its_hint(
    fake: FakePynvml, code: int, reason: str, hint: str
) -> None:
    """The admin reads the cause, what gpuslice does instead, and what to do, in one line;
    later queries fail as NvmlUnavailableError carrying nvmlInit's own code (the retry logic
    and `gpuslice status` tell "not loaded yet" from "no permission" by it)."""
    fake.fail[("nvmlInit", None)] = code
    warning = f"NVML unavailable ({reason}): using {FALLBACK}. Hint: {hint}"
    nvml = Nvml()
    assert nvml.open(fallback=FALLBACK) == NvmlStatus(False, warning, None)
    assert nvml.open(fallback="ignored: the outcome is remembered") == NvmlStatus(False, warning)
    assert pinned(raised(nvml.devices)) == (
        NvmlUnavailableError,
        f"nvmlInit: {warning} (NVML error {code})",
        "nvmlInit",
        code,
        None,
    )
    assert fake.calls == ["nvmlInit"]
    nvml.close()  # nothing was initialised: nothing to shut down, nothing raised
    nvml.forget()
    assert fake.calls == ["nvmlInit"]


def test_an_open_nvml_reports_the_driver_version(fake: FakePynvml) -> None:
    with Nvml() as nvml:
        assert nvml.open(fallback=FALLBACK) == NvmlStatus(True, None, DRIVER)
        assert nvml.open() == NvmlStatus(True, None, DRIVER)
    assert fake.calls == ["nvmlInit", "nvmlSystemGetDriverVersion", "nvmlShutdown"]


@pytest.mark.parametrize("code", [3, 999])
def test_a_driver_version_nvml_cannot_give_is_unknown_not_fatal(
    fake: FakePynvml, code: int
) -> None:
    """The version is informational: NVML stays usable, the version unknown (None, not "")."""
    fake.fail[("nvmlSystemGetDriverVersion", None)] = code
    with Nvml() as nvml:
        assert nvml.open(fallback=FALLBACK) == NvmlStatus(True, None, None)
        assert nvml.devices() == DeviceScan([gpu(0), gpu(1)], [])


# ---- devices(): lost GPUs are data, other failures name the call and the GPU -------------------


def test_devices_lists_every_gpu_and_puts_lost_ones_apart(fake: FakePynvml) -> None:
    fake.gpus = 4
    fake.lost.add(1)  # fell off the bus: its handle lookup fails
    fake.fail[("nvmlDeviceGetMemoryInfo", 2)] = 16  # lost after its handle was taken
    with Nvml() as nvml:
        assert nvml.devices() == DeviceScan([gpu(0), gpu(3)], [1, 2])
        fake.lost.clear()
        fake.fail.clear()
        assert nvml.devices() == DeviceScan([gpu(0), gpu(1), gpu(2), gpu(3)], [])


@pytest.mark.parametrize(
    "call",
    [
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
    ],
)
def test_a_failing_device_query_names_the_call_and_the_gpu(fake: FakePynvml, call: str) -> None:
    """Not a lost GPU: the whole scan fails, and the journal line says which call on which GPU."""
    fake.fail[(call, 1)] = 999
    with Nvml() as nvml:
        error = raised(nvml.devices)
    assert pinned(error) == (
        NvmlError,
        f"{call} on GPU 1: Unknown Error (NVML error 999)",
        call,
        999,
        1,
    )


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (1, NvmlUnavailableError),
        (4, NvmlUnavailableError),
        (9, NvmlUnavailableError),
        (12, NvmlUnavailableError),
        (18, NvmlUnavailableError),
        (15, GpuLostError),
        (16, GpuLostError),
        (3, _NotSupportedError),
        (13, _NotSupportedError),
        (21, _NotSupportedError),
        (2, NvmlError),  # not in the table: a plain NvmlError
        (999, NvmlError),
    ],
)
def test_every_nvml_code_maps_to_its_outcome(fake: FakePynvml, code: int, outcome: type) -> None:
    fake.fail[("nvmlDeviceGetCount", None)] = code
    with Nvml() as nvml:
        assert nvml.open().available
        error = raised(nvml.devices)
    assert pinned(error) == (
        outcome,
        f"nvmlDeviceGetCount: {MESSAGES[code]} (NVML error {code})",
        "nvmlDeviceGetCount",
        code,
        None,
    )
    assert isinstance(error.__cause__, FakeNVMLError)


@pytest.mark.parametrize(("length", "shown"), [(271, 271), (272, 271)])
def test_pynvml_failing_its_own_way_is_an_nvml_error_cut_at_300_characters(
    fake: FakePynvml, length: int, shown: int
) -> None:
    """pynvml's own exceptions (not NVMLError) are NVML not answering, code NVML_ERROR_UNKNOWN;
    their text goes into one journal line, so it is cut at 300 characters."""
    fake.fail[("nvmlDeviceGetName", 0)] = RuntimeError("x" * length)
    with Nvml() as nvml:
        error = raised(nvml.devices)
    reason = "pynvml failed: RuntimeError: " + "x" * shown + ("..." if length > shown else "")
    assert pinned(error) == (
        NvmlError,
        f"nvmlDeviceGetName on GPU 0: {reason} (NVML error 999)",
        "nvmlDeviceGetName",
        999,
        0,
    )


def test_a_call_without_an_initialised_nvml_is_unavailable_not_a_crash() -> None:
    """The chokepoint's own guard: a call on a session that is not (or no longer) initialised
    raises NvmlUnavailableError like a driver that went away, never an AttributeError that
    would end the controller."""
    nvml = Nvml()
    assert pinned(raised(nvml._call, "nvmlDeviceGetCount")) == (
        NvmlUnavailableError,
        "nvmlDeviceGetCount: NVML is not initialised (NVML error 1)",
        "nvmlDeviceGetCount",
        1,
        None,
    )
    with pytest.raises(NvmlUnavailableError) as failed:
        nvml._call("nvmlDeviceGetMemoryInfo", None, gpu=3)
    assert pinned(failed.value) == (
        NvmlUnavailableError,
        "nvmlDeviceGetMemoryInfo on GPU 3: NVML is not initialised (NVML error 1)",
        "nvmlDeviceGetMemoryInfo",
        1,
        3,
    )


# ---- processes(): compute and graphics lists, merged by pid ----------------------------------


def test_processes_merge_both_lists_by_pid_compute_first(fake: FakePynvml) -> None:
    """A pid in both lists is a compute process; NVML not knowing a process's memory is an
    unknown (None), never 0; the result is sorted by pid whatever order NVML listed."""
    fake.processes[("Compute", 1)] = [entry(300, 5 * GIB), entry(100, None)]
    fake.processes[("Graphics", 1)] = [entry(300, GIB), entry(200, GIB)]
    fake.processes[("Compute", 0)] = [entry(400, GIB)]  # another GPU's: not listed
    with Nvml() as nvml:
        assert nvml.processes(1) == [
            GpuProcess(100, 1, None, compute=True),
            GpuProcess(200, 1, GIB, compute=False),
            GpuProcess(300, 1, 5 * GIB, compute=True),
        ]
    assert fake.calls[2:] == [
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlShutdown",
    ]


@pytest.mark.parametrize("code", [3, 13, 21])
def test_an_older_driver_answers_through_the_v2_process_lists(fake: FakePynvml, code: int) -> None:
    """A driver without the _v3 calls (or one that cannot answer them) still lists its
    processes through _v2: an empty list there would call a busy GPU idle."""
    fake.fail[("nvmlDeviceGetComputeRunningProcesses_v3", None)] = code
    fake.fail[("nvmlDeviceGetGraphicsRunningProcesses_v3", None)] = code
    fake.processes[("Compute", 0)] = [entry(10, GIB)]
    fake.processes[("Graphics", 0)] = [entry(20, 2 * GIB)]
    with Nvml() as nvml:
        assert nvml.processes(0) == [
            GpuProcess(10, 0, GIB, compute=True),
            GpuProcess(20, 0, 2 * GIB, compute=False),
        ]


def test_a_driver_without_any_process_list_call_lists_none(fake: FakePynvml) -> None:
    fake.missing.update(
        f"nvmlDeviceGet{kind}RunningProcesses{version}"
        for kind in ("Compute", "Graphics")
        for version in ("_v3", "_v2")
    )
    fake.processes[("Compute", 0)] = [entry(10, GIB)]
    with Nvml() as nvml:
        assert nvml.processes(0) == []


def test_processes_of_a_lost_gpu_raise_naming_the_call_and_the_gpu(fake: FakePynvml) -> None:
    """An empty list would claim the GPU is idle: a lost GPU raises GpuLostError."""
    fake.lost.add(1)
    with Nvml() as nvml:
        assert pinned(raised(nvml.processes, 1)) == (
            GpuLostError,
            "nvmlDeviceGetHandleByIndex on GPU 1: GPU is lost (NVML error 15)",
            "nvmlDeviceGetHandleByIndex",
            15,
            1,
        )
        fake.lost.clear()
        fake.fail[("nvmlDeviceGetComputeRunningProcesses_v3", 1)] = 15  # lost after its handle
        assert pinned(raised(nvml.processes, 1)) == (
            GpuLostError,
            "nvmlDeviceGetComputeRunningProcesses_v3 on GPU 1: GPU is lost (NVML error 15)",
            "nvmlDeviceGetComputeRunningProcesses_v3",
            15,
            1,
        )
