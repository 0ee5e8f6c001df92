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
