"""More of gpuslice/systemd.py's promises that mutation testing showed no test held (the
rest of tests/test_systemd_mutation.py's).

The adapter shares its connection with the service (gpuslice/service.py adds its own message
handler): it claims no message, so every handler after it sees each one, and the units'
PropertiesChanged that handler sees are the fast reader's, with only the four properties
kept. A fresh adapter takes every signal systemd may send with no one listening yet (its
callbacks do nothing, they do not fail); the first owner of systemd's name it learns of is
no "systemd is back"; asked who owns the name while no one does, it has nothing to follow.
A bug in a callback is logged with what was being handled and the connection goes on. The
patient socket passes dbus-next's flags through, and wraps only dbus-next's own socket.

Most of it on a stand-in for dbus-next's MessageBus (what Systemd uses of it); the handler
chain on a private dbus-daemon (tests/test_dbus_adapter.py's, stopped when the test ends).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from dbus_next import Message, MessageType, Variant

from gpuslice.systemd import (
    BUS_DAEMON,
    BUS_DAEMON_PATH,
    MANAGER,
    MANAGER_PATH,
    PROPERTIES,
    SYSTEMD,
    UNIT,
    Systemd,
    _PatientSocket,
    unit_path,
)
from tests.test_dbus_adapter import (
    adapter,
    connect,
    manager_signal,
    properties_changed,
    run,
    sync,
)
from tests.test_dbus_adapter import bus_address as bus_address  # fixture
from tests.test_dbus_adapter import bus_daemon as bus_daemon  # fixture

JOB = "/org/freedesktop/systemd1/job/7"


class Bus:
    """What Systemd uses of dbus-next's MessageBus: its handlers, its serials, and `_call`,
    answered at once by `answer` (the reply goes through the handlers first, as in dbus-next)."""

    def __init__(self, answer: Callable[[Message], Message] | None = None) -> None:
        self.handlers: list[Callable[[Message], Any]] = []
        self.serial = 0
        self.answer = answer

    def add_message_handler(self, handler: Callable[[Message], Any]) -> None:
        self.handlers.append(handler)

    def next_serial(self) -> int:
        self.serial += 1
        return self.serial

    def _call(
        self, message: Message, answered: Callable[[Message, Exception | None], None]
    ) -> None:
        assert self.answer is not None
        reply = self.answer(message)
        self.deliver(reply)
        answered(reply, None)

    def deliver(self, msg: Message) -> list[Any]:
        return [handler(msg) for handler in self.handlers]


def _signal(
    sender: str, path: str, interface: str, member: str, sig: str, body: list[Any]
) -> Message:
    return Message(
        message_type=MessageType.SIGNAL,
        sender=sender,
        path=path,
        interface=interface,
        member=member,
        signature=sig,
        body=body,
    )


def _owner_changed(old: str, new: str) -> Message:
    return _signal(
        BUS_DAEMON, BUS_DAEMON_PATH, BUS_DAEMON, "NameOwnerChanged", "sss", [SYSTEMD, old, new]
    )


def _from_systemd(sender: str) -> list[Message]:
    """One of each signal the adapter hands on."""
    manager = (sender, MANAGER_PATH, MANAGER)
    return [
        _signal(*manager, "JobNew", "uos", [7, JOB, "a.service"]),
        _signal(*manager, "JobRemoved", "uoss", [7, JOB, "a.service", "done"]),
        _signal(*manager, "Reloading", "b", [True]),
        _signal(
            sender,
            unit_path("a.service"),
            PROPERTIES,
            "PropertiesChanged",
            "sa{sv}as",
            [UNIT, {"ActiveState": Variant("s", "active")}, []],
        ),
    ]


def _said(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "gpuslice.systemd"]


# ---- the socket dbus-next writes to -------------------------------------------------------------


def test_the_patient_socket_passes_the_writers_flags_through() -> None:
    sent: list[tuple[bytes, tuple[int, ...]]] = []

    class Sock:
        def send(self, data: bytes, *flags: int) -> int:
            sent.append((data, flags))
            return len(data)

    assert _PatientSocket(Sock()).send(b"abc", socket.MSG_DONTWAIT) == 3  # type: ignore[arg-type]
    assert sent == [(b"abc", (socket.MSG_DONTWAIT,))]


def test_only_dbus_nexts_own_socket_is_made_patient_and_only_once() -> None:
    """A connection without dbus-next 0.2.3's writer is left as it is (no AttributeError at
    start-up); a second adapter on a connection does not wrap the wrapper."""
    Systemd(Bus())
    ours, theirs = socket.socketpair()
    with ours, theirs:
        bus = Bus()
        bus._writer = SimpleNamespace(sock=ours)  # type: ignore[attr-defined]
        Systemd(bus)
        patient = bus._writer.sock  # type: ignore[attr-defined]
        assert isinstance(patient, _PatientSocket) and patient._sock is ours
        Systemd(bus)
        assert bus._writer.sock is patient  # type: ignore[attr-defined]


# ---- a fresh adapter ----------------------------------------------------------------------------


def test_a_fresh_adapter_takes_every_signal_with_no_one_listening(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Until the controller sets its callbacks, systemd's signals go nowhere, without an error;
    the first owner of systemd's name heard of is not systemd coming back, the second is."""
    bus = Bus()
    systemd = Systemd(bus)
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        assert bus.deliver(_owner_changed("", ":1.1")) == [False]
        for msg in _from_systemd(":1.1"):
            assert bus.deliver(msg) == [False]
        assert bus.deliver(_owner_changed(":1.1", ":1.2")) == [False]
    assert systemd.owner == ":1.2"
    assert systemd.dropped == 0
    assert _said(caplog) == [(logging.INFO, "systemd is back on the bus as :1.2")]


def test_a_fresh_adapter_matches_every_unit_and_has_no_owner_to_follow(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before subscribe: every unit's signals count as matched (as after it), a first watch
    narrows that like any other, and asking who owns systemd's name while no one does is no
    change of hands."""
    calls: list[tuple[str | None, list[Any]]] = []

    def answer(msg: Message) -> Message:
        calls.append((msg.member, list(msg.body)))
        if msg.member == "GetNameOwner":
            return Message.new_error(msg, "org.freedesktop.DBus.Error.NameHasNoOwner", "none")
        return Message.new_method_return(msg)

    bus = Bus(answer)
    systemd = Systemd(bus)

    async def scenario() -> None:
        assert systemd.watches("a.service")
        assert await systemd.check_owner() is False
        assert await systemd.watch(["a.service"]) == []
        assert systemd.watches("a.service") and not systemd.watches("b.service")

    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        asyncio.run(scenario())
    assert systemd.owner is None
    assert _said(caplog) == []
    assert [member for member, _ in calls] == ["GetNameOwner", "AddMatch", "RemoveMatch"]


# ---- a bug in a callback ------------------------------------------------------------------------


def test_a_callback_that_raises_is_logged_with_the_signal_and_costs_nothing_else(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus = Bus()
    systemd = Systemd(bus)
    bus.deliver(_owner_changed("", ":1.1"))

    def broken(*args: object) -> None:
        raise RuntimeError("bug")

    systemd.on_job_new = broken
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        assert bus.deliver(_from_systemd(":1.1")[0]) == [False]
    (record,) = caplog.records
    assert (record.levelno, record.getMessage()) == (
        logging.ERROR,
        f"error handling {MANAGER}.JobNew from :1.1",
    )
    assert record.exc_info is not None and str(record.exc_info[1]) == "bug"


def test_a_told_callback_that_raises_is_logged_with_its_call_and_the_answer_still_comes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def answer(msg: Message) -> Message:
        return Message(
            message_type=MessageType.METHOD_RETURN,
            reply_serial=msg.serial,
            sender=":1.1",
            signature="o",
            body=[JOB],
        )

    bus = Bus(answer)
    systemd = Systemd(bus)
    bus.deliver(_owner_changed("", ":1.1"))
    bus.serial = 41

    def broken(path: str) -> None:
        raise RuntimeError("bug")

    async def scenario() -> str:
        return await systemd.start_unit("a.service", broken)

    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        assert asyncio.run(scenario()) == JOB
    (record,) = caplog.records
    assert (record.levelno, record.getMessage()) == (
        logging.ERROR,
        "error handling the answer to call 42",
    )
    assert record.exc_info is not None and str(record.exc_info[1]) == "bug"


def test_an_answer_to_a_call_no_one_is_told_of_is_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Most calls (and every call of another part of the controller on this connection)
    have no `told`: their answers pass through untouched."""
    bus = Bus()
    Systemd(bus)
    bus.deliver(_owner_changed("", ":1.1"))
    reply = Message(
        message_type=MessageType.METHOD_RETURN, reply_serial=99, sender=":1.1", signature=""
    )
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        assert bus.deliver(reply) == [False]
    assert caplog.records == []


# ---- on a bus: the handlers after the adapter's --------------------------------------------------


def test_the_adapter_claims_no_message_and_the_next_handler_sees_the_fast_readers_signal(
    bus_address: str,
) -> None:
    """The service's handler comes after the adapter's on the same connection (dbus-next
    calls no later handler once one returns True): the bus daemon's signals, systemd's
    and forged ones all pass on. A unit's PropertiesChanged is read with only the four
    properties the adapter reads (busread.install, for UNIT): systemd sends 22."""

    async def scenario() -> None:
        systemd, owner, seen = await adapter(bus_address)
        later: list[tuple[str | None, str | None, Any]] = []

        def after(msg: Message) -> bool:
            if msg.message_type is MessageType.SIGNAL:
                later.append((msg.sender, msg.member, msg.body))
            return False

        systemd.bus.add_message_handler(after)
        attacker = await connect(bus_address)
        await systemd.bus.request_name("org.gpuslice.Test2")  # NameAcquired, from the daemon
        attacker.send(manager_signal("Reloading", "b", [True], systemd.bus.unique_name))
        await sync(attacker)
        owner.send(properties_changed("a.service", "activating"))
        await seen.after(owner)
        assert systemd.dropped == 1
        assert (BUS_DAEMON, "NameAcquired", ["org.gpuslice.Test2"]) in later
        assert (attacker.unique_name, "Reloading", [True]) in later
        (body,) = [
            b
            for s, m, b in later
            if m == "PropertiesChanged" and b[1]["ActiveState"].value == "activating"
        ]
        assert body[0] == UNIT
        assert sorted(body[1]) == ["ActiveState", "Job", "SubState"]  # not "Id"

    run(scenario)
