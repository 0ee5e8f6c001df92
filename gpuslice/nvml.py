"""The NVML boundary: the only module in gpuslice that imports pynvml.

pynvml is imported and NVML initialised lazily, so gpuslice starts (and its tests run)
on hosts without a driver. Every NVML call goes through `Nvml._call`, which turns
pynvml's `NVMLError` into one of a few outcomes callers can act on:

- NVML missing or unusable -> `NvmlUnavailableError` (and `open()` reports it as one
  warning line with a hint instead of raising);
- a GPU that fell off the bus, or that cannot be used (gpuslice may not open it, its power
  cable is loose) -> `GpuLostError` (`devices()` lists it in `lost`);
- a query the GPU or driver cannot answer -> an explicit unknown (`None`), never 0;
- anything else -> `NvmlError`, carrying the call and NVML's message.

Tests run this same code against tests/fakenvml (a fake libnvidia-ml.so.1).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from gpuslice.core.model import GPU_ID
from gpuslice.unitfiles import printable

# NVML return codes (nvml.h); named here so the mapping does not need pynvml imported.
_NO_PERMISSION = 4
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_LIB_RM_VERSION_MISMATCH = 18
_UNKNOWN = 999

_CONFIG_HINT = "set gpus: in config.yaml"

# Why NVML could not start, and what to do about it: (reason, hint).
_UNAVAILABLE_HINTS: dict[int, tuple[str, str]] = {
    _LIBRARY_NOT_FOUND: (
        "libnvidia-ml.so.1 not found",
        f"install the NVIDIA driver or {_CONFIG_HINT}",
    ),
    _DRIVER_NOT_LOADED: (
        "NVIDIA driver not loaded",
        f"check `nvidia-smi` and `dmesg`, load the nvidia kernel module, or {_CONFIG_HINT}",
    ),
    _LIB_RM_VERSION_MISMATCH: (
        "driver and libnvidia-ml.so.1 versions differ",
        "reboot (or reload the nvidia kernel module) after a driver upgrade",
    ),
    _NO_PERMISSION: (
        "permission denied",
        "run gpuslice as root or check the permissions of /dev/nvidia*",
    ),
}


class NvmlError(Exception):
    """An NVML call failed: `call` names it, `gpu` is the GPU it was about (if any)."""

    def __init__(self, call: str, code: int, message: str, gpu: int | None = None) -> None:
        where = call if gpu is None else f"{call} on GPU {gpu}"
        super().__init__(f"{where}: {message} (NVML error {code})")
        self.call = call
        self.code = code
        self.gpu = gpu


class NvmlUnavailableError(NvmlError):
    """NVML cannot be used at all (no library, no driver, no permission)."""


class GpuLostError(NvmlError):
    """The GPU stopped answering (fell off the bus, needs a reset)."""


class _NotSupportedError(NvmlError):
    """The GPU or driver cannot answer this query; callers turn it into an unknown."""


# The one table from NVML return codes to outcomes; unlisted codes are plain NvmlError.
_OUTCOMES: dict[int, type[NvmlError]] = {
    1: NvmlUnavailableError,  # UNINITIALIZED
    _NO_PERMISSION: NvmlUnavailableError,
    _DRIVER_NOT_LOADED: NvmlUnavailableError,
    _LIBRARY_NOT_FOUND: NvmlUnavailableError,
    _LIB_RM_VERSION_MISMATCH: NvmlUnavailableError,
    15: GpuLostError,  # GPU_IS_LOST: fell off the bus
    16: GpuLostError,  # RESET_REQUIRED: gone until someone resets it
    3: _NotSupportedError,  # NOT_SUPPORTED
    13: _NotSupportedError,  # FUNCTION_NOT_FOUND: older driver
    21: _NotSupportedError,  # NO_DATA
}
# Codes that, from a call on one GPU, say that GPU cannot be used, as a lost one: NVML counts
# it all the same. NO_PERMISSION: its node is outside the sandbox (a DeviceAllow= drop-in,
# a container given some GPUs), taken for NVML gone as a whole, every sample said "NVML went
# away" and each retry "ready", background units held back for ever; INSUFFICIENT_POWER (a
# power cable loose) and IRQ_ISSUE, a failed scan, hid every healthy GPU beside it.
_GPU_UNUSABLE = frozenset({_NO_PERMISSION, 8, 11})


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML enumerates it; memory in bytes, None where NVML cannot say (a GPU
    with no memory of its own: GB10's unified memory answers NOT_SUPPORTED)."""

    index: int
    uuid: str
    name: str
    memory_total: int | None
    memory_used: int | None

    @property
    def memory_free(self) -> int | None:
        if self.memory_total is None or self.memory_used is None:
            return None
        return self.memory_total - self.memory_used


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU; `used_memory` None means NVML cannot say.
    `compute`: NVML lists it as a compute (CUDA) process; False for a graphics-only one (a
    display server, a compositor, a browser), which a background unit does not yield to."""

    pid: int
    gpu_index: int
    used_memory: int | None
    compute: bool = True


@dataclass(frozen=True)
class DeviceScan:
    """Result of `Nvml.devices()`: the GPUs that answered, and the indexes that are lost.

    A lost GPU is data, not an exception, so one dead GPU never hides the healthy ones.
    """

    gpus: list[GpuInfo]
    lost: list[int]


@dataclass(frozen=True)
class NvmlStatus:
    """Outcome of `Nvml.open()`; when unavailable, `warning` is the one line to log."""

    available: bool
    warning: str | None = None
    driver_version: str | None = None


class Nvml:
    """One NVML session, created by the controller; never a module-level singleton.

    `open()` initialises NVML once and remembers the outcome until `close()`, so a
    missing driver is reported once rather than on every query.
    """

    def __init__(self) -> None:
        self._pynvml: Any = None
        self._status: NvmlStatus | None = None
        self._init_error = 0  # NVML's code when open() failed, for later NvmlUnavailableError

    def __enter__(self) -> Nvml:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def open(self, fallback: str = "no GPUs") -> NvmlStatus:
        """Initialise NVML if not done yet; never raises for a missing NVML.

        `fallback` says what gpuslice does instead (e.g. "gpus: 2 from config.yaml"),
        so the warning tells the admin both the cause and the consequence.
        """
        if self._status is not None:
            return self._status
        try:
            import pynvml
        except ImportError as e:
            self._init_error = _LIBRARY_NOT_FOUND
            self._status = _unavailable(
                f"pynvml not importable: {e}", fallback, "install nvidia-ml-py"
            )
            return self._status
        self._pynvml = pynvml
        try:
            self._call("nvmlInit")
        except NvmlError as e:
            self._pynvml = None
            self._init_error = e.code
            reason, hint = _UNAVAILABLE_HINTS.get(
                e.code, (str(e), f"check `nvidia-smi` or {_CONFIG_HINT}")
            )
            self._status = _unavailable(reason, fallback, hint)
            return self._status
        try:
            driver: str | None = str(self._call("nvmlSystemGetDriverVersion"))
        except NvmlError:
            driver = None  # informational only: not worth failing an initialised NVML
        self._status = NvmlStatus(available=True, driver_version=driver)
        return self._status

    def reopen(self, fallback: str = "no GPUs") -> NvmlStatus:
        """Initialise NVML again: after a failed `open()` (the driver may have loaded since),
        after the driver went away, or to enumerate the GPUs afresh (NVML counts them only
        at init). Never raises for a missing NVML, like `open()`."""
        self.forget()
        return self.open(fallback)

    def forget(self) -> None:
        """`close()` that never raises: the session may be dead (driver unloaded)."""
        with contextlib.suppress(NvmlError):
            self.close()

    def close(self) -> None:
        """Shut NVML down if `open()` initialised it; a later `open()` starts afresh."""
        try:
            if self._pynvml is not None:
                self._call("nvmlShutdown")
        finally:
            self._pynvml = None
            self._status = None
            self._init_error = 0

    def devices(self) -> DeviceScan:
        """Every GPU NVML enumerates; lost GPUs go to `lost` instead of raising."""
        self._require()
        gpus: list[GpuInfo] = []
        lost: list[int] = []
        for index in range(int(self._call("nvmlDeviceGetCount"))):
            try:
                gpus.append(self._device(index))
            except GpuLostError:
                lost.append(index)
        return DeviceScan(gpus, lost)

    def processes(self, index: int) -> list[GpuProcess]:
        """Compute and graphics processes on GPU `index`, by pid.

        Raises GpuLostError for a lost GPU: an empty list would claim it is idle.
        """
        self._require()
        handle = self._call("nvmlDeviceGetHandleByIndex", index, gpu=index)
        found: dict[int, GpuProcess] = {}
        for kind in ("Compute", "Graphics"):  # a process in both lists is a compute one
            for entry in self._process_list(kind, handle, index):
                pid = int(entry.pid)
                used = None if entry.usedGpuMemory is None else int(entry.usedGpuMemory)
                found.setdefault(pid, GpuProcess(pid, index, used, compute=kind == "Compute"))
        return sorted(found.values(), key=lambda p: p.pid)

    def _device(self, index: int) -> GpuInfo:
        handle = self._call("nvmlDeviceGetHandleByIndex", index, gpu=index)
        total: int | None = None
        used: int | None = None
        try:
            memory = self._call("nvmlDeviceGetMemoryInfo", handle, gpu=index)
            total, used = int(memory.total), int(memory.used)
        except _NotSupportedError:
            # a GPU with no memory of its own (GB10, DGX Spark: unified memory) is one of
            # unknown size, scheduled as a whole GPU; raised, it failed every sample, and
            # NVML "ready" showed `gpus:` from config.yaml with no process on them seen
            pass
        uuid = str(self._call("nvmlDeviceGetUUID", handle, gpu=index))
        return GpuInfo(
            index=index,
            # a UUID goes as is into every granted unit's env file (a line break there would
            # start a variable of NVML's choosing) and back at a restart, which trusts only
            # `GPU-` ones (envfiles.told_uuids): anything else names the GPU by index alone
            uuid=uuid if uuid.startswith("GPU-") and GPU_ID.fullmatch(uuid) else "",
            # for the journal and `gpuslice status`: one line, of a bounded length
            name=printable(str(self._call("nvmlDeviceGetName", handle, gpu=index)), 96),
            memory_total=total,
            memory_used=used,
        )

    def _process_list(self, kind: str, handle: Any, index: int) -> list[Any]:
        """Newest process-list call the driver has; none at all means an empty list."""
        for version in ("_v3", "_v2"):
            try:
                name = f"nvmlDeviceGet{kind}RunningProcesses{version}"
                return list(self._call(name, handle, gpu=index))
            except _NotSupportedError:
                continue
        return []

    def _require(self) -> None:
        status = self.open()
        if not status.available:
            raise NvmlUnavailableError("nvmlInit", self._init_error, status.warning or "")

    def _call(self, name: str, *args: Any, gpu: int | None = None) -> Any:
        """The chokepoint: call pynvml's `name` and map NVMLError to our outcomes."""
        nvml = self._pynvml
        if nvml is None:
            raise NvmlUnavailableError(name, 1, "NVML is not initialised", gpu)
        try:
            return getattr(nvml, name)(*args)
        except nvml.NVMLError as e:
            code = int(e.value)
            outcome = _OUTCOMES.get(code, NvmlError)
            if gpu is not None and code in _GPU_UNUSABLE:
                outcome = GpuLostError
            raise outcome(name, code, str(e), gpu) from e
        except Exception as e:
            # pynvml's own failures (a name that is not UTF-8, its NVMLLibraryMismatchError,
            # a function this pynvml lacks) are NVML not answering, like any NVMLError: let
            # through, one crashed start-up after another, or left a gate that asked
            # during a sample unanswered, its unit waiting for ever.
            reason = printable(f"pynvml failed: {type(e).__name__}: {e}", 300)
            raise NvmlError(name, _UNKNOWN, reason, gpu) from e


def _unavailable(reason: str, fallback: str, hint: str) -> NvmlStatus:
    return NvmlStatus(
        available=False, warning=f"NVML unavailable ({reason}): using {fallback}. Hint: {hint}"
    )
