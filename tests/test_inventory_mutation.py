"""gpuslice.inventory's promises about NVML's case that mutation testing showed no test held.

tests/test_inventory.py covers what a sample shows; here is what the inventory says and does
while NVML is not ready, hangs at start, goes away or is opened afresh by a reload: the
health `gpuslice status` shows (state, since, the detail naming NVML's reason and the driver),
the lines an admin reads (each reason once, word for word), how often nvmlInit runs (a
reload opens NVML once, not at every sample), and that a GPU NVML cannot vouch for is never
shown as NVML's: the guess (`gpus:`) stays whole GPUs of unknown size until NVML answers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gpuslice.config import Config
from gpuslice.core.model import Gpu
from gpuslice.inventory import Inventory, Sample
from gpuslice.nvml import NvmlStatus, NvmlUnavailableError
from tests.test_inventory import (
    MANAGED,
    UUIDS,
    Clock,
    StubNvml,
    enumerate_as,
    make_inventory,
    nvidia_root,
)

NO_MODULE = "1 NVIDIA PCI device (0000:65:00.0), nvidia module not loaded"


class Reasons(StubNvml):
    """A StubNvml whose failing nvmlInit says `reason` (as gpuslice.nvml words it), and whose
    driver version, once it answers, is `version` (None: NVML could not say)."""

    def __init__(self, gpus: int = 2, *, available: bool = False) -> None:
        super().__init__(gpus, available=available)
        self.reason = "stub"
        self.version: str | None = "550.54.15"

    def open(self, fallback: str = "no GPUs") -> NvmlStatus:
        self.opened += 1
        if self.available:
            return NvmlStatus(True, driver_version=self.version)
        return NvmlStatus(
            False, warning=f"NVML unavailable ({self.reason}): using {fallback}. Hint: none"
        )


class Wall:
    """time.time by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def on_nvidia_hardware(tmp_path: Path, nvml: StubNvml, config: Config) -> tuple[Inventory, Wall]:
    """An inventory on a host with an NVIDIA card and no nvidia module yet, not opened."""
    wall = Wall()
    inventory = Inventory(
        config, nvml=nvml, clock=Clock(), proc=tmp_path, driver_root=nvidia_root(tmp_path),
        wall=wall,
    )  # fmt: skip
    return inventory, wall


def test_a_sample_is_as_old_as_the_time_since_it_was_taken() -> None:
    """A gate's request samples NVML again when the last sample is older than FRESH_SAMPLE."""
    assert Sample([], taken_at=100.0).age(103.5) == 3.5


def test_nvml_init_hung_at_start_is_waiting_on_the_guess_until_nvml_answers(
    tmp_path: Path,
) -> None:
    """nvmlInit did not answer before READY=1: NVML is not ready, whatever the hung call may
    still return. Taken for ready, the next sample asked the hung driver, and background
    units did not wait for NVML; the detail says why and on what hardware."""
    nvml = StubNvml(gpus=2)
    inventory, wall = on_nvidia_hardware(tmp_path, nvml, Config(gpus=3))
    wall.now = 1010.0
    inventory.open_hung(2.5)
    assert inventory.available is False
    assert inventory.health.to_json() == {
        "state": "waiting",
        "since": 1010.0,
        "detail": f"waiting for NVML (nvmlInit did not answer within 2.5 s; {NO_MODULE})",
        "driver_version": None,
    }
    assert inventory.sample(MANAGED).gpus == [Gpu(0), Gpu(1), Gpu(2)]  # `gpus: 3`, not NVML's
    assert nvml.opened == 0
    assert inventory.retry() is True
    assert inventory.health.state == "ready"
    assert [g.uuid for g in inventory.sample(MANAGED).gpus] == list(UUIDS)


def test_retries_say_each_new_reason_once_and_keep_the_waiting_detail_current(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Retries run every 0.25 to 30 s: a line per retry flooded the journal, none at all hid
    that the reason changed (module loaded, now a permission problem). `gpuslice status`
    shows the reason of the last retry while waiting; once driver_wait ran out, the
    fallback's own detail (what background units run on) stays."""
    nvml = Reasons()
    inventory, _ = on_nvidia_hardware(tmp_path, nvml, Config(gpus=1))
    inventory.open()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        assert inventory.retry() is False  # the same reason as at open: nothing new
        nvml.reason = "NVIDIA driver not loaded"
        assert inventory.retry() is False
        assert inventory.retry() is False
        assert inventory.health.state == "waiting"
        assert inventory.health.detail == (
            f"waiting for NVML (NVIDIA driver not loaded; {NO_MODULE})"
        )
        inventory.give_up_waiting(120)
        nvml.reason = "permission denied"
        assert inventory.retry() is False
    fallback = (
        "NVML not ready after 120 s (NVIDIA driver not loaded): using gpus: 1 from config.yaml"
    )
    assert (inventory.health.state, inventory.health.detail) == ("fallback", fallback)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "NVML still not ready: NVIDIA driver not loaded"),
        (
            "WARNING",
            "NVML still not ready after 120 s (driver_wait): background units now start on "
            "gpus: 1 from config.yaml; gpuslice switches to NVML when it answers",
        ),
        ("INFO", "NVML still not ready: permission denied"),
    ]


def test_nvml_ready_on_a_retry_is_opened_once_and_stays_ready(tmp_path: Path) -> None:
    """The retry that finds NVML ready opened it under the config in force: the next sample
    uses that session (a second nvmlInit renumbers nothing but costs a driver round trip
    and a reload's worth of work), and a retry once ready is no reopen at all. A driver
    that does not say its version is "unknown", in the detail and in the JSON."""
    nvml = Reasons()
    inventory, _ = on_nvidia_hardware(tmp_path, nvml, Config(gpus=1))
    inventory.open()
    nvml.available = True
    nvml.version = None
    assert inventory.retry() is True
    assert nvml.opened == 2
    assert inventory.health.to_json()["detail"] == "driver unknown"
    assert inventory.health.driver_version is None
    assert [g.uuid for g in inventory.sample(MANAGED).gpus] == list(UUIDS)
    assert inventory.retry() is True
    assert [g.uuid for g in inventory.sample(MANAGED).gpus] == list(UUIDS)
    assert nvml.opened == 2


def test_a_driver_loaded_after_start_is_checked_on_the_driver_root_and_said_in_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The EPERM check opens the driver root's /dev/nvidiactl (GPUSLICE_DRIVER_ROOT in the
    test bed), not the host's; `restart_needed` is the first half of the error line logged
    before exit 75 (gpuslice.gpuwatch), the reason an admin reads for the restart."""
    root = nvidia_root(tmp_path)
    inventory, _ = on_nvidia_hardware(tmp_path, StubNvml(available=False), Config())
    inventory.open()
    (root / "sys" / "module" / "nvidia").mkdir(parents=True)
    asked: list[Path] = []

    def denied(at: Path) -> bool:
        asked.append(at)
        return at == root

    monkeypatch.setattr("gpuslice.inventory.device_denied", denied)
    assert inventory.retry() is False
    assert asked == [root]
    assert inventory.restart_needed == (
        "the nvidia driver loaded after gpuslice.service started, and systemd allowed its "
        "devices (DeviceAllow=char-nvidia, char-nvidia-frontend) only as they were then"
    )


def test_nvml_gone_while_sampling_is_waiting_for_its_reason(tmp_path: Path) -> None:
    """The driver unloaded under a running controller: `gpuslice status` says which NVML
    error ended sampling, on which hardware."""
    nvml = Reasons(available=True)
    inventory, _ = on_nvidia_hardware(tmp_path, nvml, Config(gpus=1))
    inventory.open()
    inventory.sample(MANAGED)
    nvml.devices_error = NvmlUnavailableError("nvmlDeviceGetCount", 9, "Driver Not Loaded")
    inventory.sample(MANAGED)
    assert inventory.available is False
    reason = "nvmlDeviceGetCount: Driver Not Loaded (NVML error 9)"
    assert inventory.health.to_json() == {
        "state": "waiting",
        "since": 1000.0,
        "detail": f"waiting for NVML ({reason}; {NO_MODULE})",
        "driver_version": None,
    }


def test_a_reload_opens_nvml_once_not_at_every_sample(tmp_path: Path) -> None:
    """A reload opens NVML afresh to count the GPUs again; the samples after it use that
    session. Reopened at every sample, each sample cost an nvmlInit and forgot NVML's
    processes' accounting of the last one."""
    nvml = StubNvml(gpus=2)
    inventory, _ = make_inventory(tmp_path, nvml)
    inventory.sample(MANAGED)
    inventory.config = Config(gpus=1, sample_interval=3)
    for _ in range(3):
        inventory.sample(MANAGED)
    assert nvml.opened == 2


def test_nvml_not_coming_back_at_a_reload_says_nvmls_reason_and_keeps_the_gpus(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reload reopens NVML and the driver is gone meanwhile: the GPUs NVML last showed stay,
    whole and of unknown size, and the line says NVML's reason as a failed open or retry
    does. It said "nvmlInit: NVIDIA driver not loaded (NVML error 0)": a code made up here,
    and 0 is NVML_SUCCESS."""
    nvml = Reasons(available=True)
    inventory, _ = make_inventory(tmp_path, nvml)
    inventory.sample(MANAGED)
    nvml.available = False
    nvml.reason = "NVIDIA driver not loaded"
    inventory.config = Config(gpus=1, sample_interval=3)
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        kept = inventory.sample(MANAGED)
    assert kept.gpus == [Gpu(0, UUIDS[0], "NVIDIA Fake 24GB"), Gpu(1, UUIDS[1], "NVIDIA Fake 24GB")]
    assert inventory.available is False
    assert inventory.health.state == "waiting"
    assert inventory.health.detail.startswith("waiting for NVML (NVIDIA driver not loaded; ")
    assert [r.getMessage() for r in caplog.records] == [
        "NVML went away (NVIDIA driver not loaded): using the 2 GPUs NVML last showed, as "
        "whole GPUs until it answers again; background units wait for it"
    ]
    assert nvml.opened == 2


def test_a_word_naming_no_uuid_leaves_the_booking_another_holders_file_made(
    tmp_path: Path,
) -> None:
    """`remember` takes the UUIDs holders were told; an index told with no UUID (the
    controller's env-file reader gives none, a caller may) teaches nothing. Taken as a word,
    it wiped GPU 1's booking as GPU-B, GPU 1 was booked anew by today's numbering (GPU-C),
    and GPU 0, which is GPU-B, looked free beside the job running on it."""
    nvml = StubNvml()
    enumerate_as(nvml, "GPU-B", "GPU-C")
    inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=2))
    inventory.sample(MANAGED)  # the first sample, before the books are read
    assert inventory.remember({1: "GPU-B"})
    assert not inventory.remember({1: ""})
    after = inventory.sample(MANAGED, {"asr.service": [1], "tts.service": [1]})
    assert [(g.index, g.lost) for g in after.gpus] == [(0, True), (1, True)]
