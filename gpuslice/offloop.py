"""NVML off the event loop: a hung driver call costs the loop one deadline, not the daemon."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("gpuslice")

T = TypeVar("T")


class OffLoop:
    """Runs NVML calls on a worker thread and waits for them at most `deadline` seconds.

    A hung driver call then costs the event loop (and the watchdog) `deadline` once; until
    that call returns, later calls are not made and the caller keeps what it had. The
    thread is a daemon: a call hung in the driver never holds up the controller's exit.
    A call given up on finishes on its thread whenever the driver answers: its `late`
    runs on the caller's thread, at the first `hung` (or `call`) after that.

    Under systemd's watchdog the loop says it is alive (`alive`: WATCHDOG=1) right before
    each wait, and waits no longer than `longest` (half WatchdogSec=): a wait of 2 s begun
    just before a ping fell due, under WatchdogSec=3, had systemd kill the controller for a
    hung driver call, which is what the deadline is there to survive."""

    def __init__(
        self,
        deadline: float,
        alive: Callable[[], None] | None = None,
        longest: float | None = None,
    ) -> None:
        self.deadline = deadline
        self.alive = alive
        self.longest = longest
        self.timeouts = 0  # calls that did not answer within their deadline
        self._hung: threading.Event | None = None
        self._late: tuple[list[Any], Callable[[], None] | None] = ([], None)  # the hung call's

    @property
    def hung(self) -> bool:
        if self._hung is not None and self._hung.is_set():
            self._hung = None
            log.info("NVML answers again")
            (outcome, late), self._late = self._late, ([], None)
            if late is not None and not isinstance(outcome[0], BaseException):
                late()
        return self._hung is not None

    def call(
        self,
        fn: Callable[[], T],
        deadline: float | None = None,
        late: Callable[[], None] | None = None,
    ) -> T | None:
        """fn()'s result, or None when NVML is hung (an exception of fn's is raised);
        `late`: run on this thread if fn outlives the deadline and then returns (not raises)."""
        if self.hung:
            return None
        done = threading.Event()
        outcome: list[Any] = []

        def work() -> None:
            try:
                outcome.append(fn())
            except BaseException as e:  # handed to the caller's thread
                outcome.append(e)
            done.set()

        wait = deadline or self.deadline
        if self.longest is not None:
            wait = min(wait, self.longest)
        threading.Thread(target=work, name="nvml", daemon=True).start()
        if self.alive is not None:
            self.alive()
        if not done.wait(wait):
            self._hung, self._late = done, (outcome, late)
            self.timeouts += 1
            log.error(
                "NVML did not answer within %g s: keeping the last GPU sample (stale) "
                "until it does",
                wait,
            )
            return None
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        result: T = outcome[0]
        return result
