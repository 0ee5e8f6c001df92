"""gpuslice.gpuwatch's promises that mutation testing showed no test held.

tests/test_controller.py runs the watch on its own (a fake scheduler, timers by hand) for the
retry back-off and the sampler; here is the rest: the "NVML ready" line that says what changed
without a restart (how many GPUs, which models, which holders keep which GPUs by index), said
after every way NVML was not ready (not yet, hung at start, gone while sampling); the error
line an admin reads before gpuslice exits for a restart; that a reloaded config drives the
timers; and that the sampler, once it fired, can be armed again (sampling stopped after one
tick, and a foreign process that came later was never seen).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import gpuslice.gpuwatch as gpuwatch_module
from gpuslice.config import Config
from gpuslice.core.model import Gpu
from gpuslice.gpuwatch import GpuWatch
from gpuslice.inventory import Inventory
from gpuslice.nvml import DeviceScan, GpuInfo, NvmlStatus, NvmlUnavailableError
from tests.test_controller import (
    GIB,
    PATIENCE,
    Clock,
    Holdings,
    StubNvml,
    Timers,
    hang_until,
    messages,
    patient_nvml,
)
from tests.test_inventory import nvidia_root

NO_MODULE = "1 NVIDIA PCI device (0000:65:00.0), nvidia module not loaded"
WAITING = "NVIDIA hardware is present but NVML is not ready yet: background units wait for it"


class Models(StubNvml):
    """GPUs of the given model names (NVML numbers them 0, 1, ...; "" where NVML gave none);
    `gone`: the driver unloaded, every call fails as NVML does then."""

    def __init__(self, *names: str, available: bool = False) -> None:
        super().__init__(available=available)
        self.names = names
        self.gone = False

    def devices(self) -> DeviceScan:
        if self.gone:
            raise NvmlUnavailableError("nvmlDeviceGetCount", 9, "Driver Not Loaded")
        return DeviceScan(
            [GpuInfo(i, f"GPU-{i}", n, 24 * GIB, 0) for i, n in enumerate(self.names)], []
        )


class HangsAtOpen(Models):
    """nvmlInit hangs until `release` is set, the first time only."""

    def __init__(self, *names: str) -> None:
        super().__init__(*names, available=True)
        self.release = threading.Event()

    def open(self, fallback: str = "no GPUs") -> NvmlStatus:
        hang_until(self.release)
        return super().open(fallback)


def watch_on(
    tmp_path: Path, nvml: StubNvml, config: Config, wall: Callable[[], float] = time.time
) -> tuple[GpuWatch, Holdings, Timers, Clock]:
    clock = Clock()
    inventory = Inventory(
        config,
        nvml=nvml,
        clock=clock,
        proc=tmp_path,
        driver_root=nvidia_root(tmp_path),
        wall=wall,
    )
    holdings, timers = Holdings(), Timers()
    watch = GpuWatch(
        config,
        inventory,
        holdings,
        managed=set,
        decide=lambda gpus: None,
        ready=lambda: True,
        call_later=timers,
    )
    return watch, holdings, timers, clock


def switches(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for m in messages(caplog) if m.startswith("NVML ready")]


def until(condition: Callable[[], bool], timeout: float = PATIENCE) -> None:
    """Wait for the worker thread (not a fixed sleep)."""
    waited = threading.Event()
    for _ in range(int(timeout / 0.005)):
        if condition():
            return
        waited.wait(0.005)
    raise AssertionError("timed out")


def test_the_switch_to_nvml_names_the_models_and_every_holders_gpus_in_order(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Units granted GPUs on the guess keep them by index: the line says which, so an admin
    can tell which jobs to check against the GPUs NVML now names. A unit holding none
    (waiting) is not listed."""
    nvml = Models("NVIDIA Fake 80GB", "NVIDIA Fake 24GB")
    watch, holdings, timers, _ = watch_on(tmp_path, nvml, Config(gpus=2))
    watch.open()
    holdings.held = {
        "b.service": frozenset({1}),
        "a.service": frozenset({1, 0}),
        "idle.service": frozenset(),
    }
    nvml.available = True
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        timers.fire()
    assert switches(caplog) == [
        "NVML ready (driver 550.54.15): switched to 2 GPUs (NVIDIA Fake 24GB, NVIDIA Fake "
        "80GB) without a restart; memory packing and foreign-process protection from now "
        "on; background units may start; holders keep their GPUs by index: a.service on "
        "GPU 0,1, b.service on GPU 1"
    ]


def test_the_switch_to_nvml_names_holders_up_to_a_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Ten holders (a state file's, granted by memory before this controller): the first
    eight and how many more, not one line as long as every holder's name."""
    nvml = Models("NVIDIA Fake 80GB", "NVIDIA Fake 24GB")
    watch, holdings, timers, _ = watch_on(tmp_path, nvml, Config(gpus=2))
    watch.open()
    holdings.held = {f"u{i}.service": frozenset({0}) for i in range(10)}
    nvml.available = True
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        timers.fire()
    shown = ", ".join(f"u{i}.service on GPU 0" for i in range(8))
    assert [s.split("by index: ")[1] for s in switches(caplog)] == [f"{shown} and 2 more"]


def test_the_switch_to_one_gpu_of_no_name_says_so_in_the_singular(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = Models("")
    watch, _, timers, _ = watch_on(tmp_path, nvml, Config(gpus=1))
    watch.open()
    nvml.available = True
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        timers.fire()
    assert switches(caplog) == [
        "NVML ready (driver 550.54.15): switched to 1 GPU without a restart; memory packing "
        "and foreign-process protection from now on; background units may start"
    ]


def test_nvml_back_after_it_went_away_while_sampling_is_a_switch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The driver unloads under a running controller and loads again: background units were
    held back meanwhile, and the line says they may start again."""
    nvml = Models("NVIDIA Fake 24GB", available=True)
    watch, holdings, timers, _ = watch_on(tmp_path, nvml, Config(gpus=1))
    watch.open()
    assert watch.available and holdings.paused == ""
    nvml.gone, nvml.available = True, False
    watch.refresh()
    assert watch.available is False
    assert holdings.paused.startswith(WAITING)
    nvml.gone, nvml.available = False, True
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        timers.fire()
    assert holdings.paused == ""
    assert switches(caplog) == [
        "NVML ready (driver 550.54.15): switched to 1 GPU (NVIDIA Fake 24GB) without a "
        "restart; memory packing and foreign-process protection from now on; background "
        "units may start"
    ]


def test_nvml_init_hung_at_start_holds_background_units_back_until_it_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nvmlInit does not answer before READY=1: the controller runs on `gpus:` from
    config.yaml, holds background units back and retries; when the hung call returns,
    the next retry switches to NVML and says so. Taken for ready, background units started
    at once on a guess NVML never checked, with no line saying when NVML came."""
    monkeypatch.setattr(gpuwatch_module, "NVML_OPEN_DEADLINE", 0.05)
    patient_nvml(monkeypatch)
    nvml = HangsAtOpen("NVIDIA Fake 24GB", "NVIDIA Fake 24GB")
    watch, holdings, timers, _ = watch_on(tmp_path, nvml, Config(gpus=1))
    try:
        watch.open()
        assert watch.available is False
        assert watch.inventory.health.state == "waiting"
        assert watch.inventory.health.detail == (
            f"waiting for NVML (nvmlInit did not answer within 0.05 s; {NO_MODULE})"
        )
        assert watch.sample.gpus == [Gpu(0)]
        assert holdings.paused.startswith(WAITING)
        assert len(timers.due) == 1  # the retry
    finally:
        nvml.release.set()
    until(lambda: not watch.nvml.hung)
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        timers.fire()
    assert [g.uuid for g in watch.sample.gpus] == ["GPU-0", "GPU-1"]
    assert holdings.paused == ""
    assert switches(caplog) == [
        "NVML ready (driver 550.54.15): switched to 2 GPUs (NVIDIA Fake 24GB) without a "
        "restart; memory packing and foreign-process protection from now on; background "
        "units may start"
    ]


def test_a_driver_loaded_after_start_says_why_gpuslice_exits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one line an admin finds in the journal before systemd restarts gpuslice (exit 75):
    why, and that running jobs are not touched."""
    watch, _, timers, _ = watch_on(tmp_path, StubNvml(available=False), Config(gpus=1))
    watch.open()
    (nvidia_root(tmp_path) / "sys" / "module" / "nvidia").mkdir(parents=True)
    monkeypatch.setattr("gpuslice.inventory.device_denied", lambda root: True)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="gpuslice"), pytest.raises(SystemExit) as exited:
        timers.fire()
    assert exited.value.code == 75
    assert messages(caplog) == [
        "the nvidia driver loaded after gpuslice.service started, and systemd allowed its "
        "devices (DeviceAllow=char-nvidia, char-nvidia-frontend) only as they were then: "
        "exiting so that "
        "systemd restarts gpuslice with the devices allowed (running jobs are left alone)"
    ]


def test_a_reloaded_config_sets_the_next_samplers_interval(tmp_path: Path) -> None:
    watch, holdings, timers, _ = watch_on(tmp_path, StubNvml(), Config(gpus=1, sample_interval=5))
    watch.open()
    reloaded = Config(gpus=1, sample_interval=7)
    watch.reconfigure(reloaded)
    assert watch.inventory.config is reloaded
    holdings.work = True
    watch.arm_sampler()
    assert [delay for delay, _ in timers.due] == [7]


def test_a_reload_arms_a_sampler_already_armed_with_the_new_interval(tmp_path: Path) -> None:
    """sample_interval edited from 3600 to 2 and `systemctl reload gpuslice` while something
    is sampled: the sampler armed before kept its hour, and the next sample (a foreign
    process on a background unit's GPU, a unit thawed by hand) came an hour later. The
    reload arms it anew; an interval left as it was keeps the timer running."""
    watch, holdings, timers, _ = watch_on(
        tmp_path, StubNvml(), Config(gpus=1, sample_interval=3600)
    )
    watch.open()
    holdings.work = True
    watch.arm_sampler()
    watch.reconfigure(Config(gpus=1, sample_interval=3600, log_level="debug"))
    assert [delay for delay, _ in timers.due] == [3600]
    watch.reconfigure(Config(gpus=1, sample_interval=2))
    assert [delay for delay, _ in timers.due] == [2]


def test_the_sampler_is_armed_again_after_it_fired(tmp_path: Path) -> None:
    """The controller arms the sampler after each decision: one that fired must be armable
    again, or sampling stopped after its first tick."""
    watch, holdings, timers, _ = watch_on(tmp_path, StubNvml(), Config(gpus=1, sample_interval=5))
    watch.open()
    holdings.work = True
    watch.arm_sampler()
    assert timers.fire() == [5]
    watch.arm_sampler()
    assert [delay for delay, _ in timers.due] == [5]
