"""More of gpuslice.gpuwatch's promises that mutation testing showed no test held (the rest
of tests/test_gpuwatch_mutation.py's).

nvmlInit gets NVML_OPEN_DEADLINE, not a sample's NVML_DEADLINE, and the lines say which ran
out. A retry armed while nvmlInit hung is dropped once NVML answers, and NVML going away
after that arms a fresh one at the first back-off (the retry was never armed again, and
NVML that went away stayed "waiting" for good). driver_wait's line says how long NVML was
waited for to a tenth of a second. A gate's request re-samples only when NVML answers and
the sample is older than asked. A unit whose processes use more than its Memory= is said
once per spell, with its size, GPU and declaration; one using exactly its Memory= is not.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import gpuslice.gpuwatch as gpuwatch_module
from gpuslice.config import Config
from gpuslice.gpuwatch import NVML_RETRY_FIRST, GpuWatch
from gpuslice.inventory import Inventory
from tests.test_controller import (
    GIB,
    Clock,
    Holdings,
    StubNvml,
    Timers,
    make_watch,
    messages,
    patient_nvml,
)
from tests.test_gpuwatch_mutation import NO_MODULE, HangsAtOpen, Models, until, watch_on
from tests.test_inventory import StubNvml as ProcessNvml
from tests.test_inventory import write_proc

HUNG = "NVML did not answer within {} s: keeping the last GPU sample (stale) until it does"


def test_nvml_init_has_its_own_deadline_and_its_hung_retry_gives_way_to_nvml(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpuwatch_module, "NVML_OPEN_DEADLINE", 0.05)
    monkeypatch.setattr(gpuwatch_module, "NVML_DEADLINE", 0.5)
    patient_nvml(monkeypatch)
    nvml = HangsAtOpen("NVIDIA Fake 24GB")
    watch, holdings, timers, _ = watch_on(tmp_path, nvml, Config(gpus=1))
    assert not watch.stale  # nothing asked yet, nothing hung
    try:
        with caplog.at_level(logging.ERROR, logger="gpuslice"):
            watch.open()
        assert messages(caplog) == [HUNG.format("0.05")]
        assert watch.inventory.health.detail == (
            f"waiting for NVML (nvmlInit did not answer within 0.05 s; {NO_MODULE})"
        )
        assert watch.stale
        assert len(timers.due) == 1  # the retry
    finally:
        nvml.release.set()
    until(lambda: not watch.nvml.hung)  # nvmlInit returned: NVML is ready
    watch.resample()
    assert not watch.stale
    assert timers.due == []  # no retry left armed
    nvml.gone, nvml.available = True, False
    watch.refresh()  # NVML goes away while sampling
    assert holdings.paused.startswith("NVIDIA hardware is present but NVML is not ready")
    assert [delay for delay, _ in timers.due] == [NVML_RETRY_FIRST]


def test_nvml_back_then_gone_again_retries_from_the_first_back_off(tmp_path: Path) -> None:
    nvml = Models("NVIDIA Fake 24GB")
    watch, holdings, timers, clock = watch_on(tmp_path, nvml, Config(gpus=1, driver_wait=60))
    watch.open()
    for _ in range(3):  # the back-off grows
        clock.now += 1
        assert timers.fire() != []
    nvml.available = True
    clock.now += 1
    timers.fire()
    assert watch.available and timers.due == []
    nvml.gone, nvml.available = True, False
    clock.now += 100  # long after the first wait: driver_wait counts from now
    watch.refresh()
    assert [delay for delay, _ in timers.due] == [NVML_RETRY_FIRST]
    assert holdings.paused.startswith("NVIDIA hardware is present but NVML is not ready")


def test_driver_wait_running_out_says_the_wait_to_a_tenth_of_a_second(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    watch, _, timers, clock, _ = make_watch(
        tmp_path, StubNvml(available=False), Config(gpus=1, driver_wait=3)
    )
    watch.open()
    clock.now += 3.26
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        timers.fire()
    assert messages(caplog) == [
        "NVML still not ready after 3.3 s (driver_wait): background units now start on gpus: "
        "1 from config.yaml; gpuslice switches to NVML when it answers"
    ]
    assert watch.inventory.health.detail == (
        "NVML not ready after 3.3 s (stub): using gpus: 1 from config.yaml"
    )


def test_a_gate_resamples_only_nvml_that_answers_and_only_a_sample_older_than_asked(
    tmp_path: Path,
) -> None:
    for available in (False, True):
        watch, _, _, clock, decided = make_watch(
            tmp_path, StubNvml(available=available), Config(gpus=2)
        )
        watch.open()
        taken = watch.sample.taken_at
        clock.now = taken + 0.25
        watch.refresh_if_older(0.25)  # exactly as old as asked: fresh enough
        clock.now = taken + 1.0
        watch.refresh_if_older(5.0)
        assert decided == []
        watch.refresh_if_older(0.5)
        assert len(decided) == (1 if available else 0)


def test_a_unit_over_its_memory_is_said_once_per_spell(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = ProcessNvml(gpus=2)
    write_proc(tmp_path, 100, "0::/system.slice/asr.service\n")
    write_proc(tmp_path, 200, "0::/system.slice/exact.service\n")
    nvml.add(1, 100, 5 * GIB)
    nvml.add(0, 200, 2 * GIB)
    config = Config(gpus=2)
    inventory = Inventory(config, nvml=nvml, clock=Clock(), proc=tmp_path, driver_root=tmp_path)
    holdings, timers = Holdings(), Timers()
    holdings.held = {"asr.service": frozenset({1}), "exact.service": frozenset({0})}
    holdings.memory = {"asr.service": 4 * GIB, "exact.service": 2 * GIB}
    watch = GpuWatch(
        config,
        inventory,
        holdings,
        managed=lambda: {"asr.service", "exact.service"},
        decide=lambda gpus: None,
        ready=lambda: True,
        call_later=timers,
    )
    over = "asr.service uses 5 GiB on GPU 1, more than its Memory=4 GiB"
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        watch.open()
        watch.refresh()  # still over: said already
        assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, over)]
        nvml.procs[1] = []
        watch.refresh()  # the spell ends
        nvml.add(1, 100, 5 * GIB)
        watch.refresh()
    assert messages(caplog) == [over, over]
