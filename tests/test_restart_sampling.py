"""A real host's boot and the NVIDIA driver's lifecycle, as the controller sees them: NVML
that hangs or answers late, a controller restarted beside running jobs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpuslice.nvml import GpuProcess, NvmlError
from tests.test_controller import (
    OneForeignProcess,
    bg_running_on_gpu_1,
    hang_until,
    patient_nvml,
    run,
    settle,
)


class HangsAfterFirstSample(OneForeignProcess):
    """The GPUs with a job's process (PID 200) on GPU 1; the second sample hangs in the
    driver until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.samples = 0

    def processes(self, index: int) -> list[GpuProcess]:
        if index == 0:
            self.samples += 1
            if self.samples > 1:
                hang_until(self.release)
        return super().processes(index)


def test_a_restart_whose_second_sample_hangs_stops_no_running_unit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    patient_nvml(monkeypatch)
    nvml = HangsAfterFirstSample()
    bed = bg_running_on_gpu_1(tmp_path, nvml)
    bed.controller.watch.nvml.deadline = 0.05

    async def test() -> None:
        try:
            await bed.controller.start()
            await settle()
            assert bed.controller.watch.stale
            assert bed.systemd.calls == [("subscribe", "")]
        finally:
            nvml.release.set()

    run(test)


class FailsAfterFirstSample(OneForeignProcess):
    """The GPUs with a job's process (PID 200) on GPU 1; later samples fail (an NVML error
    that is not the driver going away)."""

    def __init__(self) -> None:
        super().__init__()
        self.samples = 0

    def processes(self, index: int) -> list[GpuProcess]:
        if index == 0:
            self.samples += 1
            if self.samples > 1:
                raise NvmlError("nvmlDeviceGetComputeRunningProcesses", 999, "Unknown Error", 0)
        return super().processes(index)


def test_a_restart_whose_second_sample_fails_stops_no_running_unit(tmp_path: Path) -> None:
    bed = bg_running_on_gpu_1(tmp_path, FailsAfterFirstSample())

    async def test() -> None:
        await bed.controller.start()
        await settle()
        assert bed.systemd.calls == [("subscribe", "")]

    run(test)
