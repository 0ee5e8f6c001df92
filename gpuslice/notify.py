"""sd_notify: READY=1 after state is rebuilt, a one-line STATUS=, WATCHDOG=1, STOPPING=1.

Does nothing when NOTIFY_SOCKET is unset (a controller run by hand or in tests).
"""

from __future__ import annotations

import os

import sdnotify


class Notifier:
    def __init__(self) -> None:
        self._enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._notifier = sdnotify.SystemdNotifier() if self._enabled else None
        self._last_status = ""

    def send(self, message: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(message)

    def ready(self, status: str) -> None:
        self._last_status = status
        self.send(f"READY=1\nSTATUS={status}")

    def status(self, status: str) -> None:
        if status != self._last_status:
            self._last_status = status
            self.send(f"STATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Half of WatchdogSec, as sd_watchdog_enabled(3) advises; None when not asked."""
        usec = os.environ.get("WATCHDOG_USEC")
        if not usec or not self._enabled:
            return None
        return int(usec) / 2_000_000
