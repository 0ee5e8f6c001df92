"""gpuslice's own D-Bus interface (gpuslice/service.py) at its edges (mutation run): the
words of each error a caller reads, the calls that are not ours and are left to the
connection's other handlers, the bounds of Status (MAX_STATUS_UNSENT, MAX_STATUS_ANSWER,
MAX_STATUS_ASKING) at exactly their values and going back down, `refuse` answering one
sender's calls only, and what the admin reads in the journal when a handler fails.

Calls a client makes go through a real, private dbus-daemon (tests/test_dbus_adapter.py);
the bounds are counted on a stand-in bus that keeps each answer unwritten until the test
writes it (SchedulerService uses only add_message_handler, send and request_name)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, cast

import pytest
from dbus_next import DBusError, Message, MessageFlag, MessageType
from dbus_next.aio import MessageBus

from gpuslice.busread import Unread
from gpuslice.service import (
    ACCESS_DENIED,
    BUS_NAME,
    INTERFACE,
    INTROSPECTION,
    INVALID_ARGS,
    LIMITS_EXCEEDED,
    MAX_STATUS_ANSWER,
    MAX_STATUS_ASKING,
    MAX_STATUS_UNSENT,
    OBJECT_PATH,
    NameTaken,
    SchedulerService,
)
from tests.service_bus import ServiceBus
from tests.test_dbus_adapter import bus_address as bus_address  # fixture
from tests.test_dbus_adapter import bus_daemon as bus_daemon  # fixture
from tests.test_dbus_adapter import call, connect, run, sync

FAILED = "org.freedesktop.DBus.Error.Failed"
UNKNOWN_METHOD = "org.freedesktop.DBus.Error.UnknownMethod"
BUSY = "too many status answers still being sent: try again"


def _nothing(*_: object) -> None:
    return None


_SERIALS = itertools.count(1)


def _call(
    member: str,
    signature: str = "",
    body: list[Any] | None = None,
    sender: str = ":1.7",
    flags: MessageFlag = MessageFlag.NONE,
) -> Message:
    return Message(
        destination=BUS_NAME,
        path=OBJECT_PATH,
        interface=INTERFACE,
        member=member,
        signature=signature,
        body=body or [],
        sender=sender,
        serial=next(_SERIALS),
        flags=flags,
    )


def _service(
    bus: ServiceBus,
    on_status: Callable[[], str] = lambda: "{}",
    on_status_for: Callable[[str], str | Coroutine[Any, Any, str]] | None = None,
    on_acquire: Callable[[str, str], None] = _nothing,
) -> SchedulerService:
    return SchedulerService(
        cast(MessageBus, bus), on_acquire, on_status, _nothing, None, on_status_for
    )


def _saying(text: str) -> Callable[[], str]:
    return lambda: text


def _in_loop(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=20))


def _error(answer: Message | bool) -> tuple[str | None, list[Any]]:
    assert isinstance(answer, Message), answer
    assert answer.message_type is MessageType.ERROR, answer.body
    return answer.error_name, answer.body


async def _answered(service: SchedulerService) -> None:
    """Every Status answer that waited for the bus daemon's word is sent, and counted out of
    MAX_STATUS_ASKING (each task's own done callbacks run before gather's)."""
    await asyncio.gather(*list(service._asking))


# ---------------------------------------------------------------------------------------------
# a unit name that is none: the words of InvalidArgs


@pytest.mark.parametrize("member", ["Acquire", "Plan"])
def test_a_call_without_one_valid_unit_name_is_told_what_it_sent(
    bus_address: str, member: str
) -> None:
    """The one string argument, shortened to 80 printable characters; nothing where none was
    sent; only the first of two (one is taken, not the first of several)."""
    long_bad = "a b" + "x" * 200

    async def scenario() -> None:
        bus = await connect(bus_address)
        asked: list[tuple[str, str]] = []
        service = SchedulerService(
            bus,
            lambda unit, sender: asked.append((unit, sender)),
            lambda: "{}",
            _nothing,
            lambda unit: '{"verdict": "starts"}',
        )
        await service.claim_name()
        client = await connect(bus_address)
        cases: list[tuple[str, list[Any], str]] = [
            ("", [], ""),
            ("ss", ["a.service", "b.service"], "a.service"),
            ("u", [5], "5"),
            ("s", ["x\n<3>fake.service"], "x\\x0a<3>fake.service"),
            ("s", ["\u00e9.service"], "\\xe9.service"),
            ("s", [long_bad], long_bad[:80] + "..."),
        ]
        for signature, body, shown in cases:
            reply = await call(client, member, signature, body)
            assert (reply.error_name, reply.body) == (
                INVALID_ARGS,
                [f"not a valid unit name: {shown}"],
            ), (signature, body)
        assert asked == []
        assert not service.pending("a.service")

    run(scenario)


# ---------------------------------------------------------------------------------------------
# the bus name


def test_a_name_owned_by_another_controller_is_said_with_the_bus_daemons_word(
    bus_address: str,
) -> None:
    """The second controller does not queue for the name: it stops, saying who has it."""

    async def scenario() -> None:
        first = await connect(bus_address)
        await first.request_name(BUS_NAME)
        service = SchedulerService(await connect(bus_address), _nothing, lambda: "{}", _nothing)
        with pytest.raises(NameTaken) as taken:
            await service.claim_name()
        assert str(taken.value) == (
            f"{BUS_NAME} is owned by another process (EXISTS): another gpuslice controller "
            "runs (systemctl status gpuslice), or `gpuslice release-jobs` releases the units "
            "of a stopped one (apt remove)"
        )
        await first.release_name(BUS_NAME)
        await service.claim_name()
        await service.claim_name()  # already ours: fine

    run(scenario)


class RefusingBus(ServiceBus):
    """A system bus whose policy lets only root own the name (data/org.gpuslice.Scheduler1.conf)."""

    async def request_name(self, name: str, flags: object) -> object:
        raise DBusError(
            ACCESS_DENIED, f'Connection ":1.5" is not allowed to own the service "{name}"\x1b[2J'
        )


def test_a_name_the_bus_policy_refuses_is_said_in_the_bus_daemons_words() -> None:
    """`gpuslice controller` run by a user other than root: refused the name, as the second
    controller is, in one line that says why (escaped), not a traceback."""

    async def scenario() -> None:
        service = _service(RefusingBus())
        with pytest.raises(NameTaken) as taken:
            await service.claim_name()
        assert str(taken.value) == (
            f'cannot own {BUS_NAME}: Connection ":1.5" is not allowed to own the service '
            f'"{BUS_NAME}"\\x1b[2J'
        )

    run(scenario)


# ---------------------------------------------------------------------------------------------
# a handler that fails: the caller's words and the admin's


def test_a_failing_handler_answers_internal_error_and_says_which_call_from_whom(
    bus_address: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        bus = await connect(bus_address)

        def broken() -> None:
            raise RuntimeError("secret detail")

        service = SchedulerService(bus, _nothing, broken, broken)  # type: ignore[arg-type]
        await service.claim_name()
        client = await connect(bus_address)
        with caplog.at_level(logging.ERROR, logger="gpuslice"):
            for member in ("Status", "Reload"):
                reply = await call(client, member)
                assert (reply.message_type, reply.error_name, reply.body) == (
                    MessageType.ERROR,
                    FAILED,
                    ["internal error"],
                )
        said = [
            (r.getMessage(), r.exc_info is not None and r.exc_info[0])
            for r in caplog.records
            if r.name == "gpuslice.service"
        ]
        assert said == [
            (f"error handling Status from {client.unique_name}", RuntimeError),
            (f"error handling Reload from {client.unique_name}", RuntimeError),
        ]

    run(scenario)


def test_a_status_answer_that_failed_while_asking_is_internal_error_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Where /proc hides processes the answer comes later; failing then, it is still an
    error with no detail to the caller and a line with the traceback for the admin."""

    async def failing() -> str:
        raise RuntimeError("secret detail")

    async def body() -> None:
        bus = ServiceBus()
        service = _service(bus, on_status_for=lambda sender: failing())
        with caplog.at_level(logging.ERROR, logger="gpuslice"):
            assert bus.deliver(_call("Status", sender=":1.42")) is True
            await _answered(service)
        (reply,) = bus.sent
        assert (reply.destination, *_error(reply)) == (":1.42", FAILED, ["internal error"])
        said = [
            (r.getMessage(), r.exc_info is not None and r.exc_info[0])
            for r in caplog.records
            if r.name == "gpuslice.service"
        ]
        assert said == [("error handling Status from :1.42", RuntimeError)]

    _in_loop(body)


# ---------------------------------------------------------------------------------------------
# Introspect, and the calls that are not ours


async def _introspect(client: MessageBus, interface: str | None, member: str) -> Message:
    reply = await client.call(
        Message(destination=BUS_NAME, path=OBJECT_PATH, interface=interface, member=member)
    )
    assert reply is not None
    return reply


def test_introspect_says_our_interface_and_only_introspect_does(bus_address: str) -> None:
    """`busctl introspect`, `gdbus introspect` read what we say of ourselves; a method named
    Introspect of another interface, or of none, is no such call."""

    async def scenario() -> None:
        bus = await connect(bus_address)
        service = SchedulerService(bus, _nothing, lambda: "{}", _nothing)
        await service.claim_name()
        client = await connect(bus_address)
        said = await _introspect(client, "org.freedesktop.DBus.Introspectable", "Introspect")
        assert (said.message_type, said.signature, said.body) == (
            MessageType.METHOD_RETURN,
            "s",
            [INTROSPECTION],
        )
        for interface in (INTERFACE, None):
            other = await _introspect(client, interface, "Introspect")
            assert (other.error_name, other.body) == (UNKNOWN_METHOD, ["no method Introspect"])
        nope = await _introspect(client, "org.freedesktop.DBus.Introspectable", "Nope")
        assert nope.error_name == UNKNOWN_METHOD

    run(scenario)


def test_calls_not_ours_are_left_to_the_connections_other_handlers(bus_address: str) -> None:
    """The controller's connection is also the Systemd adapter's: a call to another path, or
    of another interface on ours (Peer.Ping, as any peer's), is not swallowed unanswered
    (its caller would wait for ever) but left to dbus-next, which answers it."""

    async def scenario() -> None:
        bus = await connect(bus_address)
        service = SchedulerService(bus, _nothing, lambda: "{}", _nothing)
        await service.claim_name()
        client = await connect(bus_address)
        for path in (OBJECT_PATH, "/", "/org/gpuslice/Other"):
            ping = Message(
                destination=BUS_NAME,
                path=path,
                interface="org.freedesktop.DBus.Peer",
                member="Ping",
            )
            reply = await asyncio.wait_for(client.call(ping), timeout=15)  # under load too
            assert reply is not None and reply.message_type is MessageType.METHOD_RETURN, path

    run(scenario)


def test_a_call_that_asks_for_no_answer_is_ours_and_gets_none(bus_address: str) -> None:
    """NO_REPLY_EXPECTED: the call is handled once (Reload reloads), answered with nothing,
    and not handed on to the connection's next handler as if it were not ours."""

    async def scenario() -> None:
        bus = await connect(bus_address)
        reloads: list[int] = []
        service = SchedulerService(bus, _nothing, lambda: "{}", lambda: reloads.append(1))
        passed_on: list[str | None] = []

        def after(msg: Message) -> bool:
            if msg.message_type is MessageType.METHOD_CALL and msg.path == OBJECT_PATH:
                passed_on.append(msg.member)
            return False

        bus.add_message_handler(after)
        await service.claim_name()
        client = await connect(bus_address)
        for member, signature, body in [
            ("Reload", "", []),
            ("Acquire", "s", ["x y.service"]),
            ("Nope", "", []),
        ]:
            client.send(
                Message(
                    destination=BUS_NAME,
                    path=OBJECT_PATH,
                    interface=INTERFACE,
                    member=member,
                    signature=signature,
                    body=body,
                    flags=MessageFlag.NO_REPLY_EXPECTED,
                )
            )
        await sync(client)
        await sync(bus)
        assert reloads == [1]
        assert passed_on == []

    run(scenario)


def test_a_call_whose_header_was_not_read_gets_no_answer_when_it_asks_for_none() -> None:
    """Refused (LimitsExceeded) as any call whose header is longer than busread reads, but one
    that asks for no answer gets none, as every other call: anyone may send one (Introspect of
    a long path), and the answer no one asked for went out, to be refused by the bus daemon."""

    async def body() -> None:
        bus = ServiceBus()
        service = _service(bus)
        quiet = Unread(_call("Introspect", flags=MessageFlag.NO_REPLY_EXPECTED), 0, 8192)
        assert bus.deliver(quiet) is True
        asked = Unread(_call("Introspect"), 0, 8192)
        assert _error(bus.deliver(asked)) == (LIMITS_EXCEEDED, ["a header of 8192 bytes: not read"])
        assert bus.sent == [] and service._answers_sent == 8 << 10  # the one answer counted

    _in_loop(body)


# ---------------------------------------------------------------------------------------------
# refuse: one sender's calls


def test_refuse_answers_that_senders_calls_only_and_the_others_stay_pending() -> None:
    async def body() -> None:
        bus = ServiceBus()
        service = _service(bus)
        calls = [
            _call("Acquire", "s", ["a.service"], sender=sender)
            for sender in (":1.5", ":1.6", ":1.5")
        ]
        for msg in calls:
            assert bus.deliver(msg) is True
        service.refuse("a.service", ":1.5", ACCESS_DENIED, "PID 9 does not run in a.service")
        assert [(m.destination, m.reply_serial, *_error(m)) for m in bus.sent] == [
            (":1.5", msg.serial, ACCESS_DENIED, ["PID 9 does not run in a.service"])
            for msg in (calls[0], calls[2])
        ]
        assert service.pending("a.service")
        bus.sent.clear()
        assert service.grant("a.service", "0") == 1
        assert [(m.destination, m.reply_serial, m.body) for m in bus.sent] == [
            (":1.6", calls[1].serial, ["0"])
        ]

    _in_loop(body)


def test_refuse_of_calls_already_answered_does_nothing() -> None:
    """The caller's check takes a round trip to the bus daemon; meanwhile its start may have
    ended (forget) or been granted: the refusal then has nothing to answer, and raises
    nothing; a unit none of whose calls are left holds nothing in the service."""

    async def body() -> None:
        bus = ServiceBus()
        service = _service(bus)
        service.refuse("a.service", ":1.5", ACCESS_DENIED, "no")  # never called
        assert bus.deliver(_call("Acquire", "s", ["a.service"], sender=":1.5")) is True
        service.forget("a.service")
        service.refuse("a.service", ":1.5", ACCESS_DENIED, "no")
        assert len(bus.sent) == 1  # the forget's answer only
        for i in range(3):
            assert bus.deliver(_call("Acquire", "s", [f"u{i}.service"], sender=":1.5")) is True
            service.refuse(f"u{i}.service", ":1.5", ACCESS_DENIED, "no")
        assert not any(service.pending(f"u{i}.service") for i in range(3))
        assert service._pending == {}  # one entry per unit name ever refused, for ever

    _in_loop(body)


# ---------------------------------------------------------------------------------------------
# Status: its bounds at exactly their values


def test_status_answers_unwritten_up_to_exactly_the_bound_refuse_the_next() -> None:
    """Answers not yet written count up, each its own bytes; at MAX_STATUS_UNSENT the next
    call is refused, and once they are written the count goes back down to answer again."""
    half = "x" * (MAX_STATUS_UNSENT // 2)

    async def body() -> None:
        bus = ServiceBus()
        service = _service(bus, on_status=lambda: half)
        assert bus.deliver(_call("Status")) is True
        assert bus.deliver(_call("Status")) is True  # now exactly at the bound
        assert [m.body == [half] for m in bus.sent] == [True, True]
        assert _error(bus.deliver(_call("Status"))) == (LIMITS_EXCEEDED, [BUSY])
        bus.write(1)
        await asyncio.sleep(0)  # the written callbacks
        assert bus.deliver(_call("Status")) is True  # at the bound again
        assert _error(bus.deliver(_call("Status"))) == (LIMITS_EXCEEDED, [BUSY])
        bus.write()
        await asyncio.sleep(0)
        assert service._status_unsent == 0
        assert bus.deliver(_call("Status")) is True

    _in_loop(body)


def test_a_status_of_exactly_the_longest_answer_is_sent() -> None:
    """MAX_STATUS_ANSWER bytes go (the header fits in what is left of 32 MiB); one more is
    refused."""

    async def body() -> None:
        for size, sent in [(MAX_STATUS_ANSWER, True), (MAX_STATUS_ANSWER + 1, False)]:
            bus = ServiceBus()
            _service(bus, on_status=_saying("x" * size))
            answer = bus.deliver(_call("Status"))
            assert (answer is True) == sent, size
            if not sent:
                assert _error(answer)[0] == LIMITS_EXCEEDED
            assert [len(m.body[0]) for m in bus.sent] == ([size] if sent else [])

    _in_loop(body)


def test_status_calls_waiting_for_the_bus_daemon_are_bounded_and_go_back_down() -> None:
    """MAX_STATUS_ASKING calls in wait for the bus daemon's word: the next is refused in
    words that say to try again; once they are answered, each to its own caller, the next
    is taken again."""

    async def body() -> None:
        bus = ServiceBus()
        loop = asyncio.get_running_loop()
        asked: dict[str, asyncio.Future[str]] = {}

        async def status_for(sender: str) -> str:
            """Asked of the bus daemon only once begun: a call refused is never begun."""
            asked[sender] = loop.create_future()
            return await asked[sender]

        service = _service(bus, on_status_for=status_for)
        senders = [f":1.{i}" for i in range(MAX_STATUS_ASKING)]
        for sender in senders:
            assert bus.deliver(_call("Status", sender=sender)) is True
        await asyncio.sleep(0)  # each question begins on its task
        assert list(asked) == senders
        refused = bus.deliver(_call("Status", sender=":1.99"))
        assert _error(refused) == (
            LIMITS_EXCEEDED,
            ["too many status calls being answered: try again"],
        )
        assert ":1.99" not in asked and bus.sent == []
        for sender in senders:
            asked[sender].set_result(f'{{"for": "{sender}"}}')
        await _answered(service)
        assert [(m.message_type, m.destination, m.body) for m in bus.sent] == [
            (MessageType.METHOD_RETURN, s, [f'{{"for": "{s}"}}']) for s in senders
        ]
        assert bus.deliver(_call("Status", sender=":1.99")) is True
        await asyncio.sleep(0)
        assert ":1.99" in asked

    _in_loop(body)
