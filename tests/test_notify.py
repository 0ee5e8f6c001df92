"""gpuslice/notify.py against a datagram socket of the test's own, in systemd's place."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice.notify import RETRY_DELAY, Notifier

FILLER = b"X_FILLER=1"
WITHIN = 30.0  # seconds a test waits for a datagram or a send (a pass never waits this long)


@pytest.fixture
def systemd_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A socket where NOTIFY_SOCKET points, read only when a test reads it."""
    path = tmp_path / "notify"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    receiver.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    try:
        yield receiver
    finally:
        receiver.close()


def _fill(path: str) -> None:
    """What any local user can do to systemd's notify socket: fill its queue."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK) as flooder:
        while True:
            try:
                flooder.sendto(FILLER, path)
            except BlockingIOError:
                return


async def _next_message(receiver: socket.socket) -> bytes:
    """The next datagram that is not the flood's (a pass waits a few of the notifier's
    retries; 50 of them, 2.5 s, were once the limit: short for a loaded machine)."""
    deadline = time.monotonic() + WITHIN
    while time.monotonic() < deadline:
        try:
            data = receiver.recv(8192)
        except BlockingIOError:
            await asyncio.sleep(RETRY_DELAY / 5)
            continue
        if data != FILLER:
            return data
    raise AssertionError("no notify message came")


def test_a_full_notify_queue_never_blocks_and_what_it_did_not_take_follows(
    systemd_socket: socket.socket,
) -> None:
    """A user who fills PID 1's notify queue (the socket is open to all) held the event loop
    in a blocking send (sdnotify's) as long as the queue stayed full; READY=1 not taken was
    dropped, and systemd killed the controller at TimeoutStartSec=. Now nothing waits, and
    what was said goes, merged, once systemd takes datagrams again."""
    _fill(systemd_socket.getsockname())
    # a send that blocks is let go after a while (the receiver closes), to fail, not to hang
    rescue = threading.Timer(WITHIN, systemd_socket.close)
    rescue.start()

    async def main() -> None:
        notifier = Notifier()
        began = time.monotonic()
        notifier.ready("2 GPUs: idle; 0 waiting")
        notifier.status("2 GPUs: a.service running; 0 waiting")
        notifier.watchdog()
        assert time.monotonic() - began < WITHIN  # not let go by the rescue: none blocked
        rescue.cancel()
        assert await _next_message(systemd_socket) == (
            b"READY=1\nSTATUS=2 GPUs: a.service running; 0 waiting\nWATCHDOG=1"
        )
        notifier.watchdog()
        assert await _next_message(systemd_socket) == b"WATCHDOG=1"
        assert notifier.failures == 0
        notifier.close()

    try:
        asyncio.run(main())
    finally:
        rescue.cancel()


def test_no_text_in_a_status_adds_an_assignment(systemd_socket: socket.socket) -> None:
    """Each line of a notify message is an assignment of its own: a newline in STATUS='s
    text would have made what follows one (READY=1, MAINPID=, FDSTORE=1)."""

    async def main() -> None:
        notifier = Notifier()
        notifier.status("1 GPU: idle\nMAINPID=1\r\nWATCHDOG=trigger")
        assert await _next_message(systemd_socket) == (
            b"STATUS=1 GPU: idle MAINPID=1  WATCHDOG=trigger"
        )
        notifier.close()

    asyncio.run(main())


def test_an_abstract_notify_socket_is_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"gpuslice-test-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK) as receiver:
        receiver.bind(b"\0" + name.encode())
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)

        async def main() -> None:
            notifier = Notifier()
            notifier.send("STOPPING=1")
            assert await _next_message(receiver) == b"STOPPING=1"
            notifier.close()

        asyncio.run(main())


def test_a_notify_socket_gone_is_said_once_and_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    notifier = Notifier()
    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        notifier.ready("1 GPU: idle; 0 waiting")
        notifier.watchdog()
    notifier.close()
    assert notifier.failures == 2
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"cannot notify systemd at {tmp_path / 'gone'}"
    ]


def test_without_notify_socket_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    notifier.ready("x")
    assert notifier.failures == 0 and notifier.watchdog_interval() is None
