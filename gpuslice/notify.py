"""sd_notify: READY=1 after state is rebuilt, a one-line STATUS=, WATCHDOG=1, STOPPING=1.

Does nothing when NOTIFY_SOCKET is unset (a controller run by hand or in tests).

Sent from a non-blocking socket, never waiting. systemd's notify socket takes datagrams from
every local user (/run/systemd/notify is mode 0777, so that any service may notify), and PID 1
queues at most net.unix.max_dgram_qlen of them (10 by the kernel's default): a user who keeps
that queue full, or a PID 1 busy in a long daemon-reload, held the controller's event loop in
sdnotify's blocking send for as long, with no gate answered, no stop sent and no WATCHDOG=1
either. sdnotify still connects and sends (with debug=True, so that it raises instead of
dropping every error), from its socket made non-blocking. What systemd does not take now is
owed and sent again RETRY_DELAY later, merged with what was said since (the last STATUS=,
READY=1 once): READY=1 dropped had systemd kill the controller at TimeoutStartSec= and start
it again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import warnings

import sdnotify

log = logging.getLogger("gpuslice")

# Seconds between tries to send what systemd's queue did not take.
RETRY_DELAY = 0.05


class Notifier:
    def __init__(self) -> None:
        self._path = os.environ.get("NOTIFY_SOCKET", "")
        self._enabled = bool(self._path)
        self._notifier: sdnotify.SystemdNotifier | None = None
        self._last_status = ""
        # assignments systemd did not take yet, by name (one of each: the last said)
        self._owed: dict[str, str] = {}
        self._retry: asyncio.TimerHandle | None = None
        self.failures = 0  # messages given up (systemd's socket gone, or no loop to retry on)
        self._failing = False  # said once until a message goes again

    def send(self, message: str) -> None:
        """Send `message`'s assignments (`KEY=VALUE` lines) now, or as soon as systemd takes
        them; never waits, never raises."""
        if not self._enabled:
            return
        for line in message.split("\n"):
            if line:
                self._owed[line.partition("=")[0]] = line
        if self._retry is None:
            self._flush()

    def _flush(self) -> None:
        self._retry = None
        # sdnotify encodes as Latin-1: whatever else was said goes as "?"
        data = "\n".join(self._owed.values()).encode("latin-1", "replace").decode("latin-1")
        try:
            if self._notifier is None:
                self._notifier = _connected()
            self._notifier.notify(data)
        except BlockingIOError:  # systemd's queue is full: again in a moment
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._give_up("no event loop to send it again from")
                return
            self._retry = loop.call_later(RETRY_DELAY, self._flush)
            return
        except (OSError, ValueError) as e:  # the socket gone: connected again next time
            self._drop_socket()
            self._give_up(str(e))
            return
        self._owed.clear()
        self._failing = False

    def _drop_socket(self) -> None:
        if self._notifier is not None and self._notifier.socket is not None:
            self._notifier.socket.close()
        self._notifier = None

    def _give_up(self, why: str) -> None:
        self.failures += 1
        if not self._failing:
            log.warning(
                "cannot notify systemd at %s (%s): %s not sent (said once until it works)",
                self._path,
                why,
                ", ".join(self._owed.values()),
            )
        self._failing = True
        self._owed.clear()

    def close(self) -> None:
        """Drop what is owed and the socket (tests: the process's exit does it otherwise)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._owed.clear()
        self._drop_socket()

    def ready(self, status: str) -> None:
        self._last_status = status
        self.send(f"READY=1\nSTATUS={_one_line(status)}")

    def status(self, status: str) -> None:
        if status != self._last_status:
            self._last_status = status
            self.send(f"STATUS={_one_line(status)}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Half of WatchdogSec, as sd_watchdog_enabled(3) advises; None when not asked."""
        usec = os.environ.get("WATCHDOG_USEC")
        if not usec or not self._enabled:
            return None
        return int(usec) / 2_000_000


def _connected() -> sdnotify.SystemdNotifier:
    """sdnotify's notifier, connected to NOTIFY_SOCKET, whose sends raise and never wait."""
    with warnings.catch_warnings():  # the socket of a failed connect is left to the GC
        warnings.simplefilter("ignore", ResourceWarning)
        notifier = sdnotify.SystemdNotifier(debug=True)  # raises when it cannot connect
    notifier.socket.setblocking(False)
    return notifier


def _one_line(text: str) -> str:
    """STATUS='s value: each line of a notify message is an assignment of its own, and a
    value's newline would make what follows one (READY=1, MAINPID=, FDSTORE=1)."""
    return text.replace("\n", " ").replace("\r", " ")
