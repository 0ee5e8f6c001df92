"""More of gpuslice/journal.py's and gpuslice/notify.py's promises that mutation testing showed
no test held (the rest of tests/test_journal_notify_mutation.py's).

Journal: a backlog lost to a journald gone holds no bytes afterwards, so the next lag may
hold MAX_BACKLOG_BYTES again, to the byte; closing counts what still waits on top of every
entry lost before. sd_notify: STATUS= goes only when it changed, READY=1's status included
(systemd's starts empty); while systemd's queue is full only the last STATUS= is owed, even
when a status holds an "=" of its own.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from gpuslice import journal as journal_module
from gpuslice.journal import encode
from gpuslice.notify import Notifier
from tests.test_journal import Make, _fill, _read_all
from tests.test_journal import make as make
from tests.test_notify import _fill as _fill_notify
from tests.test_notify import _next_message
from tests.test_notify import systemd_socket as systemd_socket


def test_after_journald_comes_back_the_backlog_holds_its_full_bytes_again(
    make: Make, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "socket")

    def journald() -> socket.socket:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        server.bind(path)
        return server

    async def scenario() -> None:
        journal = make(path)
        with journald() as server:
            _fill(journal)  # journald lags: one entry held
        Path(path).unlink()  # journald is gone: what waits is lost
        while journal.backlog:
            await asyncio.sleep(0.002)
        lost = journal.failures
        assert lost == 1
        with journald() as server:
            _fill(journal)  # lags again
            entry = [("MESSAGE", "a" * 100)]
            held = sum(len(b) for b in journal.backlog)
            monkeypatch.setattr(journal_module, "MAX_BACKLOG_BYTES", held + 2 * len(encode(entry)))
            assert journal.send(entry) and journal.send(entry)  # up to the bound exactly
            assert not journal.send(entry)
            assert len(journal.backlog) == 3 and journal.failures == lost + 1
            journal.close()  # journald reads nothing: what waits is counted too
            assert journal.failures == lost + 1 + 3
            assert _read_all(server) != []  # what it took before it lagged

    asyncio.run(scenario())


def test_a_status_goes_only_when_it_changed(systemd_socket: socket.socket) -> None:
    notifier = Notifier()
    notifier.status("")  # systemd's STATUS= is empty until said
    notifier.ready("1 GPU: idle; 0 waiting")
    notifier.status("1 GPU: idle; 0 waiting")
    notifier.status("1 GPU: a.service running; 0 waiting")
    notifier.status("1 GPU: a.service running; 0 waiting")
    got = []
    while True:
        try:
            got.append(systemd_socket.recv(8192))
        except BlockingIOError:
            break
    notifier.close()
    assert got == [
        b"READY=1\nSTATUS=1 GPU: idle; 0 waiting",
        b"STATUS=1 GPU: a.service running; 0 waiting",
    ]


def test_only_the_last_status_is_owed_whatever_it_holds(systemd_socket: socket.socket) -> None:
    """An assignment is keyed by the name before its first "=": a status that holds one
    (a unit's Memory=) was another key, and every status said while systemd's queue was
    full went, one after the other, once it took datagrams again."""

    async def main() -> None:
        _fill_notify(systemd_socket.getsockname())
        notifier = Notifier()
        notifier.status("1 GPU: a.service running (Memory=4G); 0 waiting")
        notifier.status("1 GPU: b.service running (Memory=8G); 0 waiting")
        assert await _next_message(systemd_socket) == (
            b"STATUS=1 GPU: b.service running (Memory=8G); 0 waiting"
        )
        notifier.close()

    asyncio.run(main())
