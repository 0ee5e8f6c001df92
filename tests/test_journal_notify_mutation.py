"""What gpuslice/journal.py and gpuslice/notify.py promise that no test held until mutation
testing asked (`make mutate MUTATE=outer`).

The journal entries are what an admin reads with `journalctl -u UNIT`: the bytes of a value
nothing can encode, where a long value is cut and to how much, PRIORITY for each level, and
the exact words said (once) when journald lags, refuses or is gone. For sd_notify: what goes
for a status Latin-1 cannot hold, the words of each failure, a failure said again after it
worked, the watchdog's interval, and a notifier that is usable again after close().
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from pathlib import Path

import pytest

from gpuslice import journal as journal_module
from gpuslice.core.decisions import Code, Decision
from gpuslice.journal import decision_fields, encode
from gpuslice.notify import Notifier
from tests.test_journal import Make, _fill, _read_all, receive
from tests.test_journal import journald as journald
from tests.test_journal import make as make
from tests.test_notify import _fill as _fill_notify
from tests.test_notify import systemd_socket as systemd_socket

UNWRITTEN = (
    "; decisions are logged as plain lines, not in their units' own journals "
    "(said once until it works)"
)


def _cannot_write(path: str, why: str) -> str:
    return f"cannot write to the journal at {path}: {why}{UNWRITTEN}"


def _said(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records]


# ---- the datagram's bytes --------------------------------------------------------------------


def test_a_value_utf8_cannot_hold_goes_with_a_question_mark(
    make: Make, journald: tuple[str, socket.socket]
) -> None:
    """A unit or file name read as bytes (a lone surrogate from surrogateescape) is still an
    entry, not a failure that loses the decision's fields."""
    assert encode([("MESSAGE", "bad\udcffname")]) == b"MESSAGE=bad?name\n"
    path, server = journald
    journal = make(path)
    assert journal.send([("MESSAGE", "x\udcff.service stopped")])
    assert receive(server) == [("MESSAGE", b"x?.service stopped")]
    assert journal.failures == 0


def test_a_value_is_cut_to_max_value_bytes_never_inside_a_character() -> None:
    """Cut to max_value bytes ending in "...": a value of exactly max_value bytes stays whole,
    a multi-byte character the cut falls in is left out, not sent half (journalctl would show
    the value as a blob)."""
    assert encode([("MESSAGE", "x" * 10)], max_value=10) == b"MESSAGE=" + b"x" * 10 + b"\n"
    assert encode([("MESSAGE", "x" * 11)], max_value=10) == b"MESSAGE=xxxxxxx...\n"
    # 20 bytes cut to 8: 5 kept would end inside the third "é", so 4 and "..."
    assert encode([("MESSAGE", "é" * 10)], max_value=8) == "MESSAGE=éé...\n".encode()
    assert encode([("MESSAGE", "xxxxx")], max_value=3) == b"MESSAGE=...\n"
    cut = encode([("MESSAGE", "a\n" + "é" * 10)], max_value=9)
    assert cut == b"MESSAGE\n" + struct.pack("<Q", 9) + "a\néé...".encode() + b"\n"


@pytest.mark.parametrize(
    ("level", "priority"),
    [("critical", "2"), ("error", "3"), ("warning", "4"), ("info", "6"), ("debug", "7")],
)
def test_priority_is_the_syslog_number_of_the_level(level: str, priority: str) -> None:
    fields = dict(decision_fields(Decision(Code.GRANT, "a.service", 5), "m", level))
    assert fields["PRIORITY"] == priority


def test_a_level_journald_has_no_number_for_is_info() -> None:
    """PRIORITY= journald cannot read would leave the entry out of `journalctl -p`."""
    fields = dict(decision_fields(Decision(Code.GRANT, "a.service", 5), "m", "notice"))
    assert fields["PRIORITY"] == "6"


# ---- an entry over max_entry: its values cut to a share of it ---------------------------------


def test_an_entry_of_exactly_max_entry_bytes_is_sent_whole(
    make: Make, journald: tuple[str, socket.socket]
) -> None:
    path, server = journald
    fields = [("MESSAGE", "y" * 1000)]
    journal = make(path, max_entry=len(encode(fields)))
    assert journal.send(fields)
    assert receive(server) == [("MESSAGE", b"y" * 1000)]


@pytest.mark.parametrize(
    ("max_entry", "fields", "kept"),
    [
        # one field: half of max_entry (a value's share is max_entry / (2 * fields))
        (4096, [("MESSAGE", "y" * 10_000)], 2048),
        (4096, [("MESSAGE", "y" * 10_000), ("GPUSLICE_UNIT", "a" * 5000)], 1024),
        # ten fields of 1000 bytes: 50 each, but never under 64
        (1000, [(f"GPUSLICE_X{i}", "z" * 200) for i in range(10)], 64),
    ],
)
def test_an_entry_over_max_entry_has_each_long_value_cut_to_its_share(
    make: Make,
    journald: tuple[str, socket.socket],
    max_entry: int,
    fields: list[tuple[str, str]],
    kept: int,
) -> None:
    path, server = journald
    journal = make(path, max_entry=max_entry)
    assert journal.send(fields)
    got = receive(server)
    assert [k for k, _ in got] == [k for k, _ in fields]
    for (_, sent), (_, value) in zip(fields, got, strict=True):
        assert value == sent.encode()[: kept - 3] + b"..."


# ---- the backlog's byte bound ---------------------------------------------------------------


def test_the_backlog_holds_exactly_max_backlog_bytes(
    make: Make, journald: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound is on the bytes of all entries held together, and an entry that reaches it
    exactly is still held."""

    async def scenario() -> None:
        path, server = journald
        server.settimeout(None)
        journal = make(path)
        _fill(journal)  # journald's queue full: one entry held
        entry = [("MESSAGE", "a" * 100)]
        held = sum(len(b) for b in journal.backlog)
        monkeypatch.setattr(journal_module, "MAX_BACKLOG_BYTES", held + 2 * len(encode(entry)))
        assert journal.send(entry) and journal.send(entry)  # up to the bound exactly
        assert not journal.send(entry)  # one byte over it
        assert not journal.send([("MESSAGE", "")])
        assert len(journal.backlog) == 3 and journal.failures == 2

    asyncio.run(scenario())


# ---- the words said when the journal cannot be written ----------------------------------------


def test_a_full_backlog_says_journald_lags(
    make: Make, journald: tuple[str, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        path, server = journald
        server.settimeout(None)
        journal = make(path, max_backlog=1)
        _fill(journal)
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            assert not journal.send([("MESSAGE", "one too many")])
        assert _said(caplog) == [(logging.WARNING, _cannot_write(path, "journald lags"))]
        assert journal.failures == 1

    asyncio.run(scenario())


def test_a_full_queue_outside_an_event_loop_says_the_kernels_error(
    make: Make, journald: tuple[str, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    path, _ = journald
    journal = make(path)
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        for _ in range(100_000):
            if not journal.send([("MESSAGE", "x" * 1000)]):
                break
    assert _said(caplog) == [
        (logging.WARNING, _cannot_write(path, "[Errno 11] Resource temporarily unavailable"))
    ]
    assert journal.failures == 1


def test_journald_refusing_what_waits_is_said_with_its_error_and_again_after_it_worked(
    make: Make, journald: tuple[str, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    """Entries held while journald lagged, then journald's socket refuses (no reader behind
    it): all of them counted and said once with the kernel's words; the journal works again
    and says so once; a later failure is said again (an admin reads each episode)."""

    async def scenario() -> None:
        path, server = journald
        server.settimeout(None)
        journal = make(path)
        _fill(journal)
        assert journal.send([("MESSAGE", "held too")])
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            server.close()  # the socket's file stays: connection refused
            deadline = asyncio.get_running_loop().time() + 10
            while journal.backlog:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.002)
            assert journal.failures == 2
            Path(path).unlink()
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as again:
                again.bind(path)
                assert journal.send([("MESSAGE", "back")])
                assert journal.send([("MESSAGE", "and more")])
                assert _read_all(again) == [b"MESSAGE=back\n", b"MESSAGE=and more\n"]
            assert not journal.send([("MESSAGE", "gone again")])
        assert _said(caplog) == [
            (logging.WARNING, _cannot_write(path, "[Errno 111] Connection refused")),
            (logging.INFO, "writing to the journal works again (2 entries were not written)"),
            (logging.WARNING, _cannot_write(path, "[Errno 111] Connection refused")),
        ]

    asyncio.run(scenario())


# ---- sd_notify ------------------------------------------------------------------------------


def _not_sent(path: str, why: str, what: str) -> str:
    return f"cannot notify systemd at {path} ({why}): {what} not sent (said once until it works)"


def test_a_status_latin1_cannot_hold_goes_with_question_marks(
    systemd_socket: socket.socket,
) -> None:
    """sdnotify encodes as Latin-1 and raises on anything else: a unit named in Unicode
    would have cost the status (and a READY=1 sent with it)."""
    notifier = Notifier()
    notifier.ready("1 GPU: 日本é.service running; 0 waiting")
    assert systemd_socket.recv(8192) == (
        "READY=1\nSTATUS=1 GPU: ??é.service running; 0 waiting".encode("latin-1")
    )
    assert notifier.failures == 0
    notifier.close()


def test_a_full_queue_without_an_event_loop_is_given_up_and_said_with_what_was_lost(
    systemd_socket: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    path = systemd_socket.getsockname()
    _fill_notify(path)
    notifier = Notifier()
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        notifier.ready("1 GPU: idle; 0 waiting")
        notifier.watchdog()
    notifier.close()
    why = "no event loop to send it again from"
    assert _said(caplog) == [
        (logging.WARNING, _not_sent(path, why, "READY=1, STATUS=1 GPU: idle; 0 waiting"))
    ]
    assert notifier.failures == 2


def test_a_notify_socket_gone_is_said_with_its_error_and_again_after_it_worked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "notify")
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    notifier = Notifier()
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        notifier.watchdog()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK) as pid1:
            pid1.bind(path)
            notifier.watchdog()
            assert pid1.recv(8192) == b"WATCHDOG=1"
        notifier.status("1 GPU: idle; 0 waiting")
    notifier.close()
    assert _said(caplog) == [
        (logging.WARNING, _not_sent(path, "[Errno 2] No such file or directory", "WATCHDOG=1")),
        (
            logging.WARNING,
            _not_sent(path, "[Errno 111] Connection refused", "STATUS=1 GPU: idle; 0 waiting"),
        ),
    ]
    assert notifier.failures == 2


def test_a_closed_notifier_sends_again_at_once(systemd_socket: socket.socket) -> None:
    """close() drops what was owed and the retry; what is said after it goes at once."""

    async def main() -> None:
        _fill_notify(systemd_socket.getsockname())
        notifier = Notifier()
        notifier.ready("1 GPU: idle; 0 waiting")  # not taken: owed, tried again later
        notifier.close()
        while True:
            try:
                systemd_socket.recv(8192)
            except BlockingIOError:
                break
        notifier.send("STOPPING=1")
        assert systemd_socket.recv(8192) == b"STOPPING=1"
        assert notifier.failures == 0
        notifier.close()

    asyncio.run(main())


def test_the_watchdog_is_fed_at_half_watchdog_sec(
    systemd_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert Notifier().watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_USEC", "1")
    assert Notifier().watchdog_interval() == 0.0000005
    monkeypatch.delenv("WATCHDOG_USEC")
    assert Notifier().watchdog_interval() is None
