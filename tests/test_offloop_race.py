"""An NVML call that outlives its deadline and returns later, while the event loop goes on.

`OffLoop` gives up waiting for a hung call, but its worker thread stays in it; when the
driver answers, the call finishes on that thread. It ran on the controller's Inventory
itself: the late result changed, from the thread, what the loop was reading and writing
meanwhile. A start-up sample taken before any holder was known wiped, when it came back,
the GPUs the holders' env files had named (a GPU renumbered since went unseen: two jobs on
one GPU); a retry that answered while the loop gave up waiting left NVML "fallback" for
good. Each test holds the fake NVML call on its thread with an Event past the deadline and
releases it at a chosen point of the loop's own work: no timing races.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import gpuslice.gpuwatch as gpuwatch_module
from gpuslice.config import Config
from gpuslice.nvml import GpuProcess, NvmlStatus
from tests.test_controller import StubNvml, hang_until, patient_nvml
from tests.test_gpuwatch_mutation import watch_on


def finish_nvml_threads() -> None:
    """Wait until every worker thread's NVML call has returned (released by the test)."""
    for thread in threading.enumerate():
        if thread.name == "nvml":
            thread.join(10)
            assert not thread.is_alive()


class HangingListing(StubNvml):
    """Two GPUs; each process listing hangs while `hang` is set, until `release` is."""

    def __init__(self) -> None:
        super().__init__()
        self.hang = threading.Event()
        self.release = threading.Event()

    def processes(self, index: int) -> list[GpuProcess]:
        if self.hang.is_set():
            hang_until(self.release)
        return []


def test_a_start_up_sample_that_answers_late_keeps_the_gpus_holders_were_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up: the first sample is taken before any unit is known, and hangs. The loop
    goes on (Controller.start): an adopted holder's env file says GPU 1 was GPU-B when it
    was granted (`remember`), while this NVML numbers GPU-B 0. When the hung sample
    returned, it booked the GPUs as held when it began (nothing), on the thread: the
    holder's GPU was forgotten, the next sample booked GPU 1 by NVML's new numbering, and
    GPU 0, where the holder runs, was free for another job."""
    monkeypatch.setattr(gpuwatch_module, "NVML_DEADLINE", 0.05)
    patient_nvml(monkeypatch)
    nvml = HangingListing()
    nvml.uuids = ("GPU-B", "GPU-A")  # numbered otherwise than by the last controller's NVML
    watch, holdings, _, _ = watch_on(tmp_path, nvml, Config(gpus=2))
    nvml.hang.set()
    try:
        watch.open()
        assert watch.stale
        holdings.held = {"a.service": frozenset({1})}
        assert watch.inventory.remember({1: "GPU-B"})
    finally:
        nvml.release.set()
    finish_nvml_threads()  # the hung sample came back
    nvml.hang.clear()
    watch.refresh()
    assert not watch.stale
    assert [(g.index, g.uuid, g.lost, g.renumbered) for g in watch.sample.gpus] == [
        (0, "GPU-B", True, True),
        (1, "GPU-A", True, True),
    ]


class HangingInit(StubNvml):
    """nvmlInit fails (no NVML yet) until `available`; while `hang` is set it hangs until
    `release` is, then answers as `available` says."""

    def __init__(self) -> None:
        super().__init__(available=False)
        self.hang = threading.Event()
        self.release = threading.Event()

    def open(self, fallback: str = "no GPUs") -> NvmlStatus:
        if self.hang.is_set():
            hang_until(self.release)
        return super().open(fallback)


def test_a_retry_that_answers_late_while_the_loop_gives_up_waiting_leaves_nvml_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML is not ready, and the retry's nvmlInit hangs past its deadline just as
    driver_wait runs out. The loop gives up waiting (fallback) while the hung nvmlInit
    answers on its thread: it marked NVML ready from there, and the loop's "fallback" went
    over it, for good (a retry does nothing once NVML is available): `gpuslice status`
    said fallback, on guessed GPUs, while NVML answered."""
    monkeypatch.setattr(gpuwatch_module, "NVML_DEADLINE", 0.05)
    patient_nvml(monkeypatch)
    main = threading.current_thread()
    armed = threading.Event()
    nvml = HangingInit()

    def wall() -> float:
        """The loop's clock of record; while armed, the hung nvmlInit answers the moment
        the loop reads it (Inventory._set, as it gives up waiting)."""
        if armed.is_set() and threading.current_thread() is main:
            armed.clear()
            nvml.release.set()
            finish_nvml_threads()
        return 1000.0

    watch, _, timers, clock = watch_on(tmp_path, nvml, Config(gpus=1, driver_wait=60), wall)
    inventory = watch.inventory
    watch.open()
    assert inventory.health.state == "waiting"
    nvml.available = True
    nvml.hang.set()
    armed.set()
    clock.now += 60  # driver_wait runs out
    try:
        timers.fire()  # the retry: nvmlInit hangs; the loop gives up waiting
    finally:
        nvml.release.set()
    assert not armed.is_set()  # the hung call answered inside the loop's give-up
    finish_nvml_threads()
    nvml.hang.clear()
    clock.now += 1
    timers.fire()  # the next retry finds NVML ready
    assert watch.available
    assert inventory.health.state == "ready"
    assert watch.sample.health is not None and watch.sample.health.state == "ready"
    assert [g.uuid for g in watch.sample.gpus] == ["GPU-0", "GPU-1"]  # NVML's, not guessed


def test_the_sample_in_use_shows_the_nvml_case_the_loop_keeps_current(tmp_path: Path) -> None:
    """Each NVML call runs on a fork of the inventory, with a Health of its own; the
    sample in use (what `gpuslice status` shows as "nvml") must carry the inventory's
    Health, which the loop changes in place: giving up waiting right after a sample, a
    status that showed the fork's said "waiting" while background units ran on guesses."""
    nvml = StubNvml(available=False)
    watch, _, timers, clock = watch_on(tmp_path, nvml, Config(gpus=1, driver_wait=60))
    watch.open()
    assert watch.sample.health is watch.inventory.health
    clock.now += 60
    timers.fire()  # a retry (in time, not ready), a sample, then the loop gives up waiting
    assert watch.inventory.health.state == "fallback"
    assert watch.sample.health is not None and watch.sample.health.state == "fallback"


def test_a_retry_whose_nvml_init_always_outlasts_the_deadline_still_gets_nvml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a late call did to NVML's session is kept (taken back on the loop before the
    next call): dropped like its sample's books, a host whose nvmlInit takes longer than
    the deadline every time would retry for ever and never switch to NVML."""
    monkeypatch.setattr(gpuwatch_module, "NVML_DEADLINE", 0.05)
    patient_nvml(monkeypatch)
    nvml = HangingInit()
    watch, holdings, timers, clock = watch_on(tmp_path, nvml, Config(gpus=1, driver_wait=60))
    watch.open()
    nvml.available = True
    nvml.hang.set()  # every nvmlInit from now on answers only once released
    try:
        timers.fire()  # the retry gives up on nvmlInit
        assert not watch.available
        nvml.release.set()
        finish_nvml_threads()  # it answered: NVML is ready
        nvml.release.clear()  # a new nvmlInit would hang again
        clock.now += 1
        timers.fire()  # the next retry: NVML is taken as the late call left it
        assert watch.available and not watch.stale
        assert watch.inventory.health.state == "ready"
        assert holdings.paused == ""
        assert [g.uuid for g in watch.sample.gpus] == ["GPU-0", "GPU-1"]
    finally:
        nvml.release.set()


class StillLoading(HangingInit):
    """As HangingInit, but the hung nvmlInit fails in words of its own: its "waiting" is
    another than the one the loop had."""

    def open(self, fallback: str = "no GPUs") -> NvmlStatus:
        if self.hang.is_set():
            hang_until(self.release)
            return NvmlStatus(False, warning="NVML still loading (stub)")
        return super().open(fallback)


def test_a_late_retry_that_found_no_nvml_leaves_the_loops_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop gave up waiting (fallback: GPUs from config.yaml) while a retry's nvmlInit
    hung; that nvmlInit then failed. Its "not ready yet" is older news than the loop's
    fallback: taken back, status said "waiting" again while background units ran on the
    GPUs config.yaml guessed."""
    monkeypatch.setattr(gpuwatch_module, "NVML_DEADLINE", 0.05)
    patient_nvml(monkeypatch)
    nvml = StillLoading()
    watch, _, timers, clock = watch_on(tmp_path, nvml, Config(gpus=1, driver_wait=60))
    watch.open()
    assert watch.inventory.health.state == "waiting"
    nvml.hang.set()
    clock.now += 60  # driver_wait runs out
    try:
        timers.fire()  # the retry's nvmlInit hangs; the loop gives up waiting
        assert watch.inventory.health.state == "fallback"
    finally:
        nvml.release.set()
    finish_nvml_threads()  # it answered: still no NVML
    assert not watch.nvml.hung  # its state is taken back here
    assert watch.inventory.health.state == "fallback"
    assert "still loading" not in watch.inventory.health.detail
