"""gpuslice/journal.py against a real AF_UNIX datagram socket standing in for journald's."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import struct
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice import journal as journal_module
from gpuslice.core.decisions import Blocker, Cause, Code, Decision, Part
from gpuslice.journal import Journal, decision_fields, encode


def parse(data: bytes) -> list[tuple[str, bytes]]:
    """journald's reading of a native-protocol datagram (systemd's journald-native.c)."""
    fields: list[tuple[str, bytes]] = []
    rest = data
    while rest:
        line, sep, after = rest.partition(b"\n")
        assert sep, f"unterminated field {line!r}"
        if b"=" in line:
            key, _, value = line.partition(b"=")
            fields.append((key.decode("ascii"), value))
            rest = after
        else:
            (size,) = struct.unpack("<Q", after[:8])
            value = after[8 : 8 + size]
            assert after[8 + size : 9 + size] == b"\n"
            fields.append((line.decode("ascii"), value))
            rest = after[9 + size :]
    for name, _ in fields:
        assert name.isascii() and name.replace("_", "").isalnum() and name.isupper(), name
    return fields


Make = Callable[..., Journal]


@pytest.fixture
def make() -> Iterator[Make]:
    """Journal(...) for a test, closed after it."""
    made: list[Journal] = []

    def new(*args: Any, **kw: Any) -> Journal:
        made.append(Journal(*args, **kw))
        return made[-1]

    yield new
    for journal in made:
        journal.close()


@pytest.fixture
def journald(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "socket")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(2)
    yield path, server
    server.close()


def receive(server: socket.socket) -> list[tuple[str, bytes]]:
    return parse(server.recv(1 << 22))


PREEMPT = Decision(
    Code.PREEMPT, "bg.service", 90, for_unit="voice.service", for_priority=10, gpus=(0, 1)
)


def test_a_decision_is_one_entry_with_its_fields(
    make: Make, journald: tuple[str, socket.socket]
) -> None:
    path, server = journald
    journal = make(path)
    message = "preempting bg.service (priority 90) for voice.service (priority 10) on GPUs 0,1"
    assert journal.send(decision_fields(PREEMPT, message, "info"))
    assert receive(server) == [
        ("MESSAGE", message.encode()),
        ("PRIORITY", b"6"),
        ("SYSLOG_IDENTIFIER", b"gpuslice"),
        ("GPUSLICE_DECISION", b"preempt"),
        ("OBJECT_SYSTEMD_UNIT", b"bg.service"),
        ("GPUSLICE_UNIT", b"bg.service"),
        ("GPUSLICE_PRIORITY", b"90"),
        ("GPUSLICE_FOR", b"voice.service"),
        ("GPUSLICE_FOR_PRIORITY", b"10"),
        ("GPUSLICE_GPUS", b"0,1"),
    ]
    assert journal.failures == 0


def test_grant_says_how_long_it_waited_and_a_wait_what_would_end_it(
    make: Make,
    journald: tuple[str, socket.socket],
) -> None:
    path, server = journald
    journal = make(path)
    grant = Decision(Code.GRANT, "voice.service", 10, gpus=(0,))
    journal.send(decision_fields(grant, "starting", "info", waited_usec=1_500_000))
    assert dict(receive(server))["GPUSLICE_WAITED_USEC"] == b"1500000"
    wait = Decision(
        Code.WAIT,
        "voice.service",
        10,
        cause=Cause.BUSY,
        parts=(Part(Blocker.HELD, (0,), "a.service", 5),),
    )
    journal.send(decision_fields(wait, "waiting", "info"))
    fields = dict(receive(server))
    assert fields["GPUSLICE_CAUSE"] == b"gpus-busy"
    assert fields["GPUSLICE_UNTIL"].startswith(b"the GPUs named free up")
    assert "GPUSLICE_WAITED_USEC" not in fields


def test_one_entry_for_every_unit_on_a_lost_gpu(
    make: Make, journald: tuple[str, socket.socket]
) -> None:
    path, server = journald
    lost = Decision(Code.LOST_GPU, gpus=(1,), units=("a.service", "b.service"))
    make(path).send(decision_fields(lost, "GPU 1 is lost", "error"))
    fields = receive(server)
    assert [v for k, v in fields if k == "OBJECT_SYSTEMD_UNIT"] == [b"a.service", b"b.service"]
    assert ("PRIORITY", b"3") in fields


@pytest.mark.parametrize(
    "hostile",
    [
        "x.service\nOBJECT_SYSTEMD_UNIT=gpuslice.service",
        "x.service\nPRIORITY=0\n",
        "\n",
        "a\x00b\nMESSAGE=forged",
        "ünïcode\r\n\tMESSAGE=x",
    ],
)
def test_no_value_can_inject_a_field(
    make: Make, journald: tuple[str, socket.socket], hostile: str
) -> None:
    path, server = journald
    decision = Decision(Code.HOLD, hostile, 5, for_unit=hostile, gpus=(0,), detail=hostile)
    make(path).send(decision_fields(decision, f"{hostile} was stopped", "info"))
    fields = receive(server)
    keys = [k for k, _ in fields]
    assert keys == [
        "MESSAGE",
        "PRIORITY",
        "SYSLOG_IDENTIFIER",
        "GPUSLICE_DECISION",
        "OBJECT_SYSTEMD_UNIT",
        "GPUSLICE_UNIT",
        "GPUSLICE_PRIORITY",
        "GPUSLICE_FOR",
        "GPUSLICE_GPUS",
    ]
    assert dict(fields)["OBJECT_SYSTEMD_UNIT"] == hostile.encode()
    assert dict(fields)["PRIORITY"] == b"6"


def test_encoding_forms() -> None:
    assert encode([("MESSAGE", "plain")]) == b"MESSAGE=plain\n"
    assert (
        encode([("MESSAGE", "two\nlines")]) == b"MESSAGE\n" + struct.pack("<Q", 9) + b"two\nlines\n"
    )
    assert encode([("MESSAGE", "x" * 100)], max_value=10) == b"MESSAGE=xxxxxxx...\n"
    with pytest.raises(ValueError, match="not a journal field name"):
        encode([("BAD=KEY", "x")])
    with pytest.raises(ValueError, match="not a journal field name"):
        encode([("_TRUSTED", "x")])


def test_oversized_values_are_cut_to_fit(make: Make, journald: tuple[str, socket.socket]) -> None:
    path, server = journald
    journal = make(path, max_entry=4096)
    huge = "y" * (1 << 20)
    assert journal.send([("MESSAGE", huge), ("GPUSLICE_UNIT", "a.service")])
    fields = dict(receive(server))
    assert len(fields["MESSAGE"]) < 4096 and fields["MESSAGE"].endswith(b"...")
    assert fields["GPUSLICE_UNIT"] == b"a.service"


def test_a_datagram_the_kernel_refuses_is_counted_not_raised(
    make: Make, journald: tuple[str, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    path, server = journald
    journal = make(path, max_entry=64 << 20)  # no cutting: the kernel says EMSGSIZE
    many = [("GPUSLICE_X", "z" * 16000)] * 1024
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        assert not journal.send(many)
        assert not journal.send(many)
        assert journal.failures == 2
        assert journal.send([("MESSAGE", "small")])
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if m.startswith("cannot write to the journal")]) == 1
    assert said[-1] == "writing to the journal works again (2 entries were not written)"
    assert receive(server) == [("MESSAGE", b"small")]


def test_missing_socket_is_counted_and_said_once(
    make: Make, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = make(str(tmp_path / "absent"))
    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        for _ in range(3):
            assert not journal.send(decision_fields(PREEMPT, "m", "info"))
    assert journal.failures == 3
    assert len(caplog.records) == 1
    assert "No such file or directory" in caplog.records[0].getMessage()
    journal.close()


def test_a_full_journald_queue_does_not_block(make: Make, tmp_path: Path) -> None:
    """EAGAIN when journald lags, outside an event loop (nothing could write a backlog
    later): the entry is not taken and counted, the caller goes on."""
    path = str(tmp_path / "socket")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    try:
        journal = make(path)
        sent = 0
        while journal.send([("MESSAGE", "x" * 1000)]) and sent < 100_000:
            sent += 1
        assert journal.failures == 1 and sent < 100_000
    finally:
        server.close()


def _fill(journal: Journal) -> int:
    """Send until journald's queue is full (the entry that found it full is held)."""
    sent = 0
    while not journal.backlog:
        assert journal.send([("MESSAGE", f"{sent}")])
        sent += 1
        assert sent < 100_000
    return sent


def _read_all(server: socket.socket) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(server.recv(1 << 16, socket.MSG_DONTWAIT))
        except BlockingIOError:
            return out


def test_a_lagging_journald_gets_every_entry_in_order_later(
    make: Make, journald: tuple[str, socket.socket]
) -> None:
    """EAGAIN within the event loop: the entry is taken and held, with those after it, and
    written, oldest first, as journald takes them: none lost, none without its fields."""

    async def scenario() -> None:
        path, server = journald
        server.settimeout(None)  # read with MSG_DONTWAIT, no timeout's wait
        journal = make(path)
        n = _fill(journal) + 200
        for i in range(n - 200, n):
            assert journal.send([("MESSAGE", f"{i}")])
        assert len(journal.backlog) == 201 and journal.failures == 0
        got: list[bytes] = []
        deadline = asyncio.get_running_loop().time() + 10
        while len(got) < n:
            assert asyncio.get_running_loop().time() < deadline, len(got)
            got += _read_all(server)
            await asyncio.sleep(0.002)
        assert got == [f"MESSAGE={i}\n".encode() for i in range(n)]
        assert not journal.backlog and journal.failures == 0

    asyncio.run(scenario())


def test_a_full_backlog_and_a_journald_gone_are_counted_and_said_once(
    make: Make, journald: tuple[str, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        path, server = journald
        server.settimeout(None)  # read with MSG_DONTWAIT, no timeout's wait
        journal = make(path, max_backlog=3)
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            _fill(journal)
            assert journal.send([("MESSAGE", "a")]) and journal.send([("MESSAGE", "b")])
            assert not journal.send([("MESSAGE", "c")])  # 3 held: the caller's plain line
            assert journal.failures == 1
            server.close()
            Path(path).unlink()  # journald is gone: what waits is lost
            while journal.backlog:
                await asyncio.sleep(0.002)
            assert journal.failures == 4
        assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1

    asyncio.run(scenario())


def test_closing_writes_what_waits_if_journald_takes_it_now(
    make: Make, journald: tuple[str, socket.socket]
) -> None:
    async def scenario() -> None:
        path, server = journald
        server.settimeout(None)  # read with MSG_DONTWAIT, no timeout's wait
        journal = make(path)
        sent = _fill(journal)
        assert journal.send([("MESSAGE", "last")])
        journal.close()  # nothing read yet: both held entries stay unwritten, counted
        assert (journal.backlog, journal.failures) == (deque(), 2)
        journal = make(path)
        _read_all(server)
        sent = _fill(journal)
        assert len(_read_all(server)) == sent - 1  # room again, then close
        journal.close()
        assert _read_all(server) == [f"MESSAGE={sent - 1}\n".encode()]
        assert journal.failures == 0

    asyncio.run(scenario())


def test_the_backlog_is_bounded_in_bytes_too(
    make: Make, journald: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "MAX_BACKLOG_BYTES", 3000)

    async def scenario() -> None:
        path, server = journald
        server.settimeout(None)  # read with MSG_DONTWAIT, no timeout's wait
        journal = make(path)
        _fill(journal)  # the one held is a few bytes
        assert journal.send([("MESSAGE", "x" * 2000)])
        assert not journal.send([("MESSAGE", "y" * 1000)])  # 3000 bytes would be passed
        assert journal.send([("MESSAGE", "z" * 100)])
        _read_all(server)
        while journal.backlog:
            _read_all(server)
            await asyncio.sleep(0.002)
        assert journal.send([("MESSAGE", "y" * 2500)])  # room again once written

    asyncio.run(scenario())


def test_a_second_outage_says_its_own_losses_not_the_firsts_again(
    make: Make, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ "works again (N entries were not written)" counts the entries lost to that outage:
    the total since start said the first outage's losses again at every later one."""
    path = str(tmp_path / "socket")
    journal = make(path)
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        for outage in (3, 2):
            for _ in range(outage):
                assert not journal.send([("MESSAGE", "lost")])  # no journald at `path`
            server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            server.bind(path)
            assert journal.send([("MESSAGE", "back")])
            server.close()
            Path(path).unlink()
    said = [r.getMessage() for r in caplog.records if "works again" in r.getMessage()]
    assert said == [
        "writing to the journal works again (3 entries were not written)",
        "writing to the journal works again (2 entries were not written)",
    ]
    assert journal.failures == 5


def test_an_entry_too_big_for_the_socket_among_held_ones_loses_only_itself(
    make: Make, journald: tuple[str, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    """An entry held behind others is queued without being tried; one the kernel refuses as
    too big (EMSGSIZE, e.g. a lost-GPU decision naming thousands of units) when the backlog
    is written is that entry lost, not a journald gone: the entries held with it go."""

    async def scenario() -> None:
        path, server = journald
        server.settimeout(None)  # read with MSG_DONTWAIT, no timeout's wait
        journal = make(path, max_entry=64 << 20)  # no cutting: the kernel says EMSGSIZE
        sent = _fill(journal)
        assert journal.send([("GPUSLICE_X", "z" * 16000)] * 40)  # held, not tried
        assert journal.send([("MESSAGE", "after")])
        got: list[bytes] = []
        deadline = asyncio.get_running_loop().time() + 10
        while journal.backlog or len(got) < sent + 1:
            assert asyncio.get_running_loop().time() < deadline, (len(got), journal.backlog)
            got += _read_all(server)
            await asyncio.sleep(0.002)
        assert got[-2:] == [f"MESSAGE={sent - 1}\n".encode(), b"MESSAGE=after\n"]
        assert journal.failures == 1

    with caplog.at_level(logging.INFO, logger="gpuslice"):
        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("cannot write to the journal at ") and "too long" in said[0]
    assert said[-1] == "writing to the journal works again (1 entries were not written)"


def test_the_bytes_held_are_room_again_once_written(
    make: Make, journald: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each entry written from the backlog gives its bytes back to the bound: a count that
    kept them (or kept the last one's) refused entries with the backlog empty."""
    monkeypatch.setattr(journal_module, "MAX_BACKLOG_BYTES", 3000)

    async def scenario() -> None:
        path, server = journald
        server.settimeout(None)  # read with MSG_DONTWAIT, no timeout's wait
        journal = make(path)
        _fill(journal)
        assert journal.send([("MESSAGE", "x" * 2000)])  # the last one held
        while journal.backlog:
            _read_all(server)
            await asyncio.sleep(0.002)
        _fill(journal)  # held again: a few bytes
        assert journal.send([("MESSAGE", "y" * 2500)])
        assert journal.backlog[-1] == b"MESSAGE=" + b"y" * 2500 + b"\n"

    asyncio.run(scenario())


def test_every_documented_filter_on_gpuslices_fields_keeps_only_gpuslices_entries() -> None:
    """Any local user may send journald entries with GPUSLICE_DECISION=, GPUSLICE_UNIT=,
    SYSLOG_IDENTIFIER=gpuslice and any MESSAGE (`logger --journald`): only the fields that
    journald itself sets, `_SYSTEMD_UNIT=` from the sender's cgroup, tell gpuslice's
    decisions from theirs. README and the man page showed filters on the GPUSLICE_* fields
    alone, which an admin's audit of what was preempted took for gpuslice's word."""
    root = Path(__file__).resolve().parent.parent
    readme = " ".join((root / "README.md").read_text().split())
    man = " ".join((root / "debian" / "gpuslice.h2m").read_text().split())
    commands = re.findall(r"`(journalctl [^`]*)`", readme)
    commands += re.findall(r"\\fB(journalctl .*?)\\fR", man)
    filters = [c for c in commands if "GPUSLICE_" in c]
    assert len(filters) >= 3
    assert [c for c in filters if "_SYSTEMD_UNIT=gpuslice.service" not in c.split()] == []
