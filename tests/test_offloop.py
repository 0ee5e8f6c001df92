"""NVML off the event loop: a hung driver call costs the loop one deadline, not the daemon."""

from __future__ import annotations

import threading
import time

import pytest

from gpuslice.offloop import OffLoop
from tests.test_controller import PATIENCE, hang_until, patient_nvml


def test_a_call_that_answers_returns_its_result() -> None:
    assert OffLoop(5).call(lambda: 42) == 42


def test_an_exception_reaches_the_caller() -> None:
    def broken() -> int:
        raise ValueError("nvml said no")

    with pytest.raises(ValueError, match="nvml said no"):
        OffLoop(5).call(broken)


def test_a_hung_call_is_given_up_and_no_call_is_made_until_it_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    patient_nvml(monkeypatch)
    release = threading.Event()
    calls: list[str] = []
    offloop = OffLoop(0.05)

    def hangs() -> int:
        calls.append("hang")
        hang_until(release)
        return 1

    assert offloop.call(hangs) is None
    assert offloop.hung

    def later() -> int:
        calls.append("later")
        return 2

    assert offloop.call(later) is None  # not even started
    assert calls == ["hang"]
    release.set()
    deadline = time.monotonic() + PATIENCE
    while offloop.hung:  # until the hung call has returned
        assert time.monotonic() < deadline, "the released call never returned"
        threading.Event().wait(0.01)
    assert offloop.call(lambda: 3) == 3


def test_under_the_watchdog_each_wait_begins_alive_and_lasts_no_longer_than_half_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WatchdogSec=3 pings every 1.5 s: a 2 s wait for a hung call, begun just before a
    ping fell due, kept the loop from feeding the watchdog for 3.5 s, and systemd killed the
    controller for the very hang the deadline is there to survive (CI, once). Each wait now
    begins with WATCHDOG=1 (`alive`) and lasts at most `longest` (half WatchdogSec=)."""
    patient_nvml(monkeypatch)
    release = threading.Event()
    pings: list[bool] = []
    offloop = OffLoop(5, alive=lambda: pings.append(offloop.hung), longest=0.05)
    assert offloop.call(lambda: 1) == 1
    assert pings == [False]  # every wait, those answered at once too
    began = time.monotonic()
    try:
        assert offloop.call(lambda: hang_until(release)) is None
        assert time.monotonic() - began < 2.5  # not the 5 s deadline: half the watchdog's
        assert pings == [False, False]  # said alive before the wait, not after giving up
        assert offloop.hung
    finally:
        release.set()


def test_a_deadline_shorter_than_half_the_watchdog_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    patient_nvml(monkeypatch)
    release = threading.Event()
    offloop = OffLoop(0.05, longest=30)
    began = time.monotonic()
    try:
        assert offloop.call(lambda: hang_until(release)) is None
        assert time.monotonic() - began < 2.5
    finally:
        release.set()
