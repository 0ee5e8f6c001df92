"""More of gpuslice.inventory's promises that mutation testing showed no test held (the rest
of tests/test_inventory_mutation.py's).

The health `gpuslice status` shows right after the first nvmlInit (ready: the driver NVML
names, "unknown" when it names none, `since` moved to the change; absent: NVML's reason, or
"NVML unavailable" when it gave none; waiting: the reason and the hardware). Every sample
NVML could not give is the fallback GPUs with the GPUs units hold beyond them, stamped with
the time it was taken and the inventory's health: before the first nvmlInit, while NVML is
not ready, when it fails, when it goes away. `errors` counts each failed sampling call once
(`gpuslice metrics`). The words an admin reads: "NVML answers again", "GPUs changed: now
... (were ...)" with "none" for no GPU, and a held GPU that is gone said again each time it
is held anew.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gpuslice.config import Config
from gpuslice.core.model import Gpu
from gpuslice.inventory import Inventory, _reason_of
from gpuslice.nvml import NvmlError, NvmlStatus, NvmlUnavailableError
from tests.test_inventory import MANAGED, UUIDS, StubNvml, make_inventory
from tests.test_inventory_mutation import NO_MODULE, Reasons, on_nvidia_hardware

NAME = "NVIDIA Fake 24GB"
GONE = "GPU 5 is no longer among the GPUs gpuslice manages, but units hold it: treated as lost"


def _said(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records]


@pytest.mark.parametrize(
    ("version", "detail"), [("550.54.15", "driver 550.54.15"), (None, "driver unknown")]
)
def test_nvml_ready_at_start_shows_the_driver_nvml_names(
    tmp_path: Path, version: str | None, detail: str
) -> None:
    nvml = Reasons(available=True)
    nvml.version = version
    inventory, wall = on_nvidia_hardware(tmp_path, nvml, Config(gpus=1))
    assert inventory.health.to_json() == {
        "state": "absent",
        "since": 1000.0,
        "detail": "",
        "driver_version": None,
    }
    wall.now = 1020.0
    inventory.open()
    assert inventory.available is True
    assert inventory.health.to_json() == {
        "state": "ready",
        "since": 1020.0,  # the change, not the inventory's creation
        "detail": detail,
        "driver_version": version,
    }


def test_nvml_not_ready_at_start_says_why_and_changes_since_only_with_the_state(
    tmp_path: Path,
) -> None:
    nvml = Reasons()
    nvml.reason = "NVIDIA driver not loaded"
    inventory, wall = on_nvidia_hardware(tmp_path, nvml, Config(gpus=1))
    wall.now = 1010.0
    inventory.open()
    waiting = {
        "state": "waiting",
        "since": 1010.0,
        "detail": f"waiting for NVML (NVIDIA driver not loaded; {NO_MODULE})",
        "driver_version": None,
    }
    assert inventory.health.to_json() == waiting
    wall.now = 1030.0
    inventory.open_hung(2.0)  # still waiting: since stays
    assert inventory.health.since == 1010.0


class Silent(StubNvml):
    """nvmlInit fails without a word (warning None)."""

    def open(self, fallback: str = "no GPUs") -> NvmlStatus:
        return NvmlStatus(False)


def test_no_nvidia_and_no_word_from_nvml_is_absent_as_nvml_unavailable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        inventory, _ = make_inventory(tmp_path, Silent(available=False))
    assert inventory.health.state == "absent"
    assert inventory.health.detail == "no NVIDIA GPU here (NVML unavailable)"
    assert _said(caplog) == []  # nothing to say


def test_nvmls_reason_is_what_its_warning_names_up_to_what_gpuslice_does_instead() -> None:
    """nvml._unavailable words it "NVML unavailable (REASON): using FALLBACK. Hint: HINT".
    What follows REASON is gpuslice's own text, with no "): " in it (FALLBACK names GPU
    indices or GPU- UUIDs only); REASON may hold one (pynvml's message of whatever it
    raised): it is cut at the last, not the first. Any other text is the reason as it is."""
    warning = "NVML unavailable ({}): using gpus: 1 from config.yaml. Hint: check `nvidia-smi`"
    assert _reason_of(warning.format("permission denied")) == "permission denied"
    odd = "nvmlInit: pynvml failed: OSError: libnvidia (ml): gone (NVML error 999)"
    assert _reason_of(warning.format(odd)) == odd
    assert _reason_of("libnvidia-ml (v2): missing") == "libnvidia-ml (v2): missing"
    assert _reason_of(None) == "NVML unavailable"


def test_before_the_first_nvml_init_a_sample_is_the_guess_and_what_units_hold(
    tmp_path: Path,
) -> None:
    """NVML is not asked before it was opened (GpuWatch.open does that on its worker thread)."""
    nvml = StubNvml()
    inventory = Inventory(
        Config(gpus=2), nvml=nvml, clock=lambda: 55.0, proc=tmp_path, driver_root=tmp_path
    )
    nvml.devices_error = NvmlError("nvmlDeviceGetCount", 999, "asked too early")
    sample = inventory.sample(MANAGED, {"asr.service": (3,)})
    assert sample.gpus == [Gpu(0), Gpu(1), Gpu(3, lost=True)]
    assert sample.taken_at == 55.0
    assert sample.health is inventory.health
    assert inventory.errors == 0


def test_samples_nvml_could_not_give_are_the_fallback_and_each_failure_counts_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = StubNvml(gpus=1)
    inventory, clock = make_inventory(tmp_path, nvml)
    holding = {"asr.service": (0, 5)}
    nvml.devices_error = NvmlError("nvmlDeviceGetCount", 999, "Unknown Error")
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        for now in (101.0, 102.0):
            clock.now = now
            sample = inventory.sample(MANAGED, holding)  # no sample yet to keep
            assert sample.gpus == [Gpu(0), Gpu(5, lost=True)]
            assert (sample.taken_at, sample.health) == (now, inventory.health)
        assert inventory.errors == 2
        nvml.devices_error = None
        clock.now = 103.0
        good = inventory.sample(MANAGED, holding)
        assert [g.uuid for g in good.gpus] == [UUIDS[0], ""]
        nvml.devices_error = NvmlUnavailableError("nvmlDeviceGetCount", 9, "Driver Not Loaded")
        clock.now = 104.0
        sample = inventory.sample(MANAGED, holding)
    assert inventory.errors == 3
    assert sample.gpus == [Gpu(0, UUIDS[0], NAME), Gpu(5, lost=True)]  # as NVML last showed
    assert (sample.taken_at, sample.health) == (104.0, inventory.health)
    assert _said(caplog) == [
        (
            logging.ERROR,
            "NVML failed (nvmlDeviceGetCount: Unknown Error (NVML error 999)): keeping the "
            "GPUs as they were",
        ),
        (logging.ERROR, GONE),
        (logging.INFO, "NVML answers again"),
        (
            logging.ERROR,
            "NVML went away (nvmlDeviceGetCount: Driver Not Loaded (NVML error 9)): using the "
            "2 GPUs NVML last showed, as whole GPUs until it answers again; background units "
            "wait for it",
        ),
    ]


def test_gpus_appearing_or_vanishing_are_said_with_none_for_no_gpu(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = StubNvml(gpus=2)
    inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=2))
    inventory.sample(MANAGED)
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        nvml.lost = [0, 1]
        inventory.sample(MANAGED)
        nvml.lost = []
        inventory.sample(MANAGED)
    changed = [m for _, m in _said(caplog) if m.startswith("GPUs changed")]
    assert changed == ["GPUs changed: now none (were 0, 1)", "GPUs changed: now 0, 1 (were none)"]


def test_a_gone_gpu_held_anew_is_said_anew(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Once its holders released it the line is owed again: the next unit that holds it (a
    restart restoring an old grant) is as much news to an admin."""
    inventory, _ = make_inventory(tmp_path, StubNvml(gpus=1))
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        for holding in ({"asr.service": (5,)}, {"asr.service": (5,)}, {}, {"asr.service": (5,)}):
            inventory.sample(MANAGED, holding)
    assert _said(caplog) == [(logging.ERROR, GONE), (logging.ERROR, GONE)]
