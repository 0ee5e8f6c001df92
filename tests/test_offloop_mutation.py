"""gpuslice.offloop's promises that mutation testing showed no test held.

The worker thread is named `nvml` (what `py-spy dump` or a traceback of a hung controller
shows next to the loop's thread) and is a daemon thread: a call hung in the driver never
holds up the controller's exit. `timeouts` counts the calls given up on, one each, from 0
(`gpuslice metrics`), and the error line an admin reads says how long NVML had.
"""

from __future__ import annotations

import logging
import threading

import pytest

from gpuslice.offloop import OffLoop
from tests.test_controller import hang_until, patient_nvml


def test_a_call_runs_on_a_daemon_thread_named_nvml() -> None:
    seen: list[threading.Thread] = []

    def where() -> int:
        seen.append(threading.current_thread())
        return 1

    assert OffLoop(5).call(where) == 1
    (worker,) = seen
    assert worker is not threading.main_thread()
    assert worker.name == "nvml"
    assert worker.daemon is True


def test_each_call_given_up_on_is_counted_once_and_said_with_its_deadline(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    patient_nvml(monkeypatch)
    offloop = OffLoop(0.05)
    assert offloop.timeouts == 0
    for n in (1, 2):
        started, release = threading.Event(), threading.Event()
        workers: list[threading.Thread] = []

        def hangs(
            started: threading.Event = started,
            release: threading.Event = release,
            workers: list[threading.Thread] = workers,
        ) -> int:
            workers.append(threading.current_thread())
            started.set()
            hang_until(release)
            return 1

        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            caplog.clear()
            assert offloop.call(hangs, deadline=0.02 * n) is None
        assert offloop.timeouts == n
        assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
            (
                logging.ERROR,
                f"NVML did not answer within {0.02 * n:g} s: keeping the last GPU sample "
                "(stale) until it does",
            )
        ]
        assert started.wait(10)
        release.set()
        workers[0].join(10)  # the hung call returned: NVML answers again
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            caplog.clear()
            assert offloop.call(lambda: 7) == 7
        assert [r.getMessage() for r in caplog.records] == ["NVML answers again"]
    assert offloop.timeouts == 2
