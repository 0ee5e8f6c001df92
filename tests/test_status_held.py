"""What the bus daemon holds of the controller's Status answers (gpuslice/service.py:
MAX_STATUS_HELD), on a stand-in bus whose daemon says it as the test scripts it.

dbus-daemon keeps an answer until its caller reads it, counted against the controller's
connection, and stops reading the controller's socket at max_incoming_bytes: callers that
never read held every call of the controller's to systemd (tests/test_dbus_adapter.py shows
it on a real daemon). Here: the count at exactly its bound, what is sent while a reading is
on its way, how often the daemon is asked, a daemon that cannot say, and a reading that fails
this time (asked again later, backing off)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any, cast

import pytest
from dbus_next import Message, MessageFlag, MessageType, Variant
from dbus_next.aio import MessageBus

from gpuslice import service as service_module
from gpuslice.service import (
    BUS_NAME,
    INTERFACE,
    LIMITS_EXCEEDED,
    OBJECT_PATH,
    SchedulerService,
    _incoming_bytes,
)
from tests.service_bus import ServiceBus

HELD = "too many status answers not yet read by their callers: try again"
_SERIALS = itertools.count(1)


class StatsBus(ServiceBus):
    """A stand-in bus whose daemon answers GetConnectionStats when the test says what."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[Message, asyncio.Future[Message]]] = []

    async def call(self, msg: Message) -> Message:
        answer: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        msg.serial = next(_SERIALS)  # as the bus gives it one
        self.asked.append((msg, answer))
        return await answer

    def say(self, stats: dict[str, Variant] | None, error: str = "") -> None:
        """The daemon's answer to the oldest question still unanswered."""
        msg, answer = next((m, a) for m, a in self.asked if not a.done())
        if error:
            answer.set_result(Message.new_error(msg, error, "said so"))
        else:
            answer.set_result(Message.new_method_return(msg, "a{sv}", [stats]))


def _stats(held: int) -> dict[str, Variant]:
    return {"IncomingBytes": Variant("u", held), "OutgoingBytes": Variant("u", 0)}


def _status(member: str = "Status", interface: str = INTERFACE, path: str = OBJECT_PATH) -> Message:
    return Message(
        destination=BUS_NAME,
        path=path,
        interface=interface,
        member=member,
        signature="s" if member in ("Acquire", "Plan") else "",
        body=["a.service"] if member in ("Acquire", "Plan") else [],
        sender=":1.7",
        serial=next(_SERIALS),
    )


def _service(bus: ServiceBus, text: str) -> SchedulerService:
    return SchedulerService(cast(MessageBus, bus), lambda u, s: None, lambda: text, lambda: None)


def _refused(answer: Message | bool) -> bool:
    if answer is True:
        return False
    assert isinstance(answer, Message) and answer.message_type is MessageType.ERROR
    assert (answer.error_name, answer.body) == (LIMITS_EXCEEDED, [HELD])
    return True


async def _turns() -> None:
    """A few turns of the loop: a reading's task, its call, and the answer taken in."""
    for _ in range(5):
        await asyncio.sleep(0)


def _in_loop(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=20))


async def _read_once(bus: ServiceBus) -> SchedulerService:
    """A service on `bus` (its status 40 bytes) after one Status call: a reading asked."""
    service = _service(bus, "x" * 40)
    bus.deliver(_status())
    await _turns()
    return service


@pytest.fixture(autouse=True)
def _small(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bounds scaled down: 100 bytes held, 50 more of refusals, a reading every 30 bytes
    sent; an answer's own bytes (ANSWER_BYTES) counted only where a test says."""
    monkeypatch.setattr(service_module, "MAX_STATUS_HELD", 100)
    monkeypatch.setattr(service_module, "MAX_REFUSALS_HELD", 50)
    monkeypatch.setattr(service_module, "READ_EVERY", 30)
    monkeypatch.setattr(service_module, "ANSWER_BYTES", 0)


def test_answers_count_until_exactly_the_bound_then_refused_until_the_daemon_says_less() -> None:
    """Each answer sent counts as held until the daemon says otherwise: at exactly
    MAX_STATUS_HELD the next call is refused; the daemon's word replaces the count."""

    async def body() -> None:
        bus = StatsBus()
        service = _service(bus, "x" * 25)
        for _ in range(4):
            assert not _refused(bus.deliver(_status()))
        assert service._held() == 100
        assert _refused(bus.deliver(_status()))
        assert len(bus.sent) == 4
        await _turns()
        bus.say(_stats(99))  # the reading asked for after 30 bytes, of all four
        await _turns()
        assert service._held() == 99
        assert not _refused(bus.deliver(_status()))  # one answer goes: then past the bound
        assert service._held() == 124
        assert _refused(bus.deliver(_status()))

    _in_loop(body)


def test_what_is_sent_while_a_reading_is_on_its_way_still_counts() -> None:
    """The daemon's word counts what was sent before it was asked; what was sent after
    comes on top of it."""

    async def body() -> None:
        bus = StatsBus()
        service = _service(bus, "x" * 20)
        bus.deliver(_status())
        bus.deliver(_status())  # 40 bytes: a reading is asked for
        await _turns()
        assert len(bus.asked) == 1
        msg = bus.asked[0][0]
        assert (msg.destination, msg.path, msg.interface, msg.member, msg.body) == (
            "org.freedesktop.DBus",
            "/org/freedesktop/DBus",
            "org.freedesktop.DBus.Debug.Stats",
            "GetConnectionStats",
            [":1.1"],
        )
        bus.deliver(_status())  # 60 sent, 20 of them after the question
        bus.say(_stats(5))
        await _turns()
        assert service._held() == 25

    _in_loop(body)


def test_the_daemon_is_asked_one_reading_at_a_time_every_read_every_bytes() -> None:
    async def body() -> None:
        bus = StatsBus()
        _service(bus, "x" * 10)
        bus.deliver(_status())
        bus.deliver(_status())
        await _turns()
        assert bus.asked == []  # 20 bytes
        bus.deliver(_status())
        await _turns()
        assert len(bus.asked) == 1  # 30: exactly READ_EVERY
        for _ in range(5):
            bus.deliver(_status())
        await _turns()
        assert len(bus.asked) == 1  # one on its way: no other
        bus.say(_stats(0))
        await _turns()
        bus.deliver(_status())  # 90: 60 since the last was asked for
        await _turns()
        assert len(bus.asked) == 2
        bus.say(_stats(0))
        await _turns()
        bus.deliver(_status())
        bus.deliver(_status())
        await _turns()
        assert len(bus.asked) == 2  # 20 bytes since
        bus.deliver(_status())
        await _turns()
        assert len(bus.asked) == 3

    _in_loop(body)


def test_a_refused_call_asks_again_at_most_every_read_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused, a call asks the daemon again (the callers may have read, or left), once per
    READ_AGAIN s at most: once it says they did, Status is answered again. The clock is the
    test's: on the real one, 50 ms between the first two asks (a loaded host) asked again."""
    now = [100.0]
    monkeypatch.setattr(service_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(service_module, "READ_EVERY", 1000)
    monkeypatch.setattr(service_module, "READ_AGAIN", 0.05)

    async def body() -> None:
        bus = StatsBus()
        _service(bus, "x" * 100)
        assert not _refused(bus.deliver(_status()))
        assert _refused(bus.deliver(_status()))
        await _turns()
        assert len(bus.asked) == 1
        bus.say(_stats(100))  # not read yet
        await _turns()
        assert _refused(bus.deliver(_status()))
        await _turns()
        assert len(bus.asked) == 1  # asked less than READ_AGAIN s ago
        now[0] = 100.06
        assert _refused(bus.deliver(_status()))
        await _turns()
        assert len(bus.asked) == 2
        bus.say(_stats(0))  # read, or the callers left
        await _turns()
        assert not _refused(bus.deliver(_status()))

    _in_loop(body)


@pytest.mark.parametrize(
    ("stats", "error"),
    [
        (None, "org.freedesktop.DBus.Error.UnknownMethod"),  # no Debug.Stats
        (None, "org.freedesktop.DBus.Error.UnknownInterface"),  # dbus-broker's
        (None, "org.freedesktop.DBus.Error.AccessDenied"),  # a policy's
        ({"OutgoingBytes": Variant("u", 0)}, ""),  # another daemon's stats
        ({"IncomingBytes": Variant("t", 5)}, ""),
    ],
)
def test_a_daemon_that_cannot_say_is_not_asked_again_and_nothing_is_refused_for_it(
    stats: dict[str, Variant] | None, error: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        bus = StatsBus()
        service = await _read_once(bus)
        bus.say(stats, error)
        await _turns()
        for _ in range(10):
            assert not _refused(bus.deliver(_status()))
        await _turns()
        assert len(bus.asked) == 1 and service._held() == 0

    caplog.set_level(logging.INFO, logger="gpuslice.service")
    _in_loop(body)
    assert "Status answers its callers do not read are not bounded" in caplog.text


def test_a_reading_that_does_not_come_keeps_the_count_and_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(service_module, "READ_TIMEOUT", 0.01)

    async def body() -> None:
        bus = StatsBus()
        service = _service(bus, "x" * 40)
        bus.deliver(_status())
        reading = service._reading
        assert reading is not None
        # its end, not a sleep: on a loaded host the sleep's end and the timeout's may come in
        # one turn of the loop, and Python 3.11's wait_for takes more turns to end its call
        await asyncio.wait_for(reading, 10)  # timed out
        assert service._reading is None and service._held() == 40
        bus.deliver(_status())
        await _turns()
        assert len(bus.asked) == 2

    _in_loop(body)


def test_the_stand_in_bus_is_a_daemon_that_cannot_say(caplog: pytest.LogCaptureFixture) -> None:
    """tests/service_bus.py answers as a dbus-daemon without Debug.Stats (UnknownMethod): not
    asked again, nothing refused."""

    async def body() -> None:
        bus = ServiceBus()
        service = await _read_once(bus)
        assert service._held_said is None
        for _ in range(5):
            assert bus.deliver(_status()) is True

    assert _run_said(caplog, body, logging.INFO) == [
        "the bus daemon does not say how much of ours it holds (no method GetConnectionStats): "
        "Status answers its callers do not read are not bounded"
    ]


def test_incoming_bytes_only_from_a_well_formed_answer() -> None:
    call = Message(destination=":1.2", path="/x", member="M", serial=1)
    good = Message.new_method_return(call, "a{sv}", [_stats(7)])
    assert _incoming_bytes(good) == 7
    assert _incoming_bytes(None) is None
    assert _incoming_bytes(Message.new_error(call, "a.b", "no")) is None
    assert _incoming_bytes(Message.new_method_return(call, "s", ["x"])) is None
    assert _incoming_bytes(Message.new_method_return(call, "a{sv}", [{}])) is None
    assert _incoming_bytes(Message.new_method_return(call)) is None  # no body at all
    assert _incoming_bytes(Message.new_method_return(call, "a{sv}s", [_stats(7), "x"])) is None


def test_every_answer_counts_its_own_bytes_refusals_and_introspections_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any answer waits in the bus daemon until read: ANSWER_BYTES each, a Status answer's
    text on top; an introspection of our path or another, a refusal, alike. A call that
    asks for no answer counts nothing."""
    monkeypatch.setattr(service_module, "ANSWER_BYTES", 7)

    async def body() -> None:
        bus = StatsBus()
        service = _service(bus, "x" * 3)
        bus.deliver(_status())
        assert service._held() == 10
        bus.deliver(_status("Introspect", "org.freedesktop.DBus.Introspectable"))
        bus.deliver(_status("Introspect", "org.freedesktop.DBus.Introspectable", "/other"))
        assert service._held() == 24
        quiet = _status()
        quiet.flags = MessageFlag.NO_REPLY_EXPECTED
        assert bus.deliver(quiet) is True
        assert service._held() == 24

    _in_loop(body)


def test_past_the_refusals_bound_only_roots_calls_are_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused calls count, ANSWER_BYTES each: at MAX_STATUS_HELD + MAX_REFUSALS_HELD a call
    anyone may make gets no answer at all, Status, Introspect, another path or interface
    alike; root's Acquire, Plan and Reload (the bus policy's) are answered still. The daemon
    is asked again, and once it says less, Status is answered again."""
    monkeypatch.setattr(service_module, "ANSWER_BYTES", 10)
    monkeypatch.setattr(service_module, "READ_EVERY", 1000)
    monkeypatch.setattr(service_module, "READ_AGAIN", 0)
    acquired: list[str] = []
    reloads: list[int] = []

    async def body() -> None:
        bus = StatsBus()
        service = SchedulerService(
            cast(MessageBus, bus),
            lambda unit, sender: acquired.append(unit),
            lambda: "x" * 90,
            lambda: reloads.append(1),
            lambda unit: "{}",
        )
        assert bus.deliver(_status()) is True  # 100: at MAX_STATUS_HELD
        for _ in range(4):
            assert _refused(bus.deliver(_status()))  # 110, 120, 130, 140
        assert service._held() == 140
        assert _refused(bus.deliver(_status()))  # 150: exactly the refusals' bound
        for member, interface, path in [
            ("Status", INTERFACE, OBJECT_PATH),
            ("Introspect", "org.freedesktop.DBus.Introspectable", OBJECT_PATH),
            ("Introspect", "org.freedesktop.DBus.Introspectable", "/"),
            ("Get", "org.freedesktop.DBus.Properties", OBJECT_PATH),
            ("Acquire", "org.freedesktop.DBus.Peer", OBJECT_PATH),
            ("Acquire", INTERFACE, "/elsewhere"),
        ]:
            assert bus.deliver(_status(member, interface, path)) is True, member
        assert service._held() == 150 and len(bus.sent) == 1
        assert bus.deliver(_status("Acquire")) is True and acquired == ["a.service"]
        plan = bus.deliver(_status("Plan"))
        assert isinstance(plan, Message) and plan.body == ["{}"]
        reload = bus.deliver(_status("Reload"))
        assert isinstance(reload, Message) and reload.message_type is MessageType.METHOD_RETURN
        assert reloads == [1] and service._held() == 180
        await _turns()
        bus.say(_stats(0))
        await _turns()
        assert bus.deliver(_status()) is True
        assert bus.sent[-1].body == ["x" * 90]

    _in_loop(body)


def _said(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def _run_said(
    caplog: pytest.LogCaptureFixture, body: Callable[[], Coroutine[Any, Any, None]], level: int
) -> list[str]:
    """`body` run with the service's journal lines taken; those said at `level`."""
    caplog.set_level(logging.INFO, logger="gpuslice.service")
    _in_loop(body)
    return _said(caplog, level)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("no Debug.Stats " + "y" * 250, "no Debug.Stats " + "y" * 185 + "..."),  # cut at 200
        (None, "no count"),  # an answer that says nothing
    ],
)
def test_what_a_daemon_that_cannot_say_answered_is_logged_cut_at_200_characters(
    text: str | None, shown: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        bus = StatsBus()
        await _read_once(bus)
        msg, answer = bus.asked[0]
        if text is None:
            answer.set_result(Message.new_method_return(msg))
        else:
            answer.set_result(
                Message.new_error(msg, "org.freedesktop.DBus.Error.UnknownInterface", text)
            )
        await _turns()

    assert _run_said(caplog, body, logging.INFO) == [
        f"the bus daemon does not say how much of ours it holds ({shown}): Status answers "
        "its callers do not read are not bounded"
    ]


class Failing(StatsBus):
    """A bus whose calls raise (the connection lost) while `failing`, then as StatsBus."""

    failing = True

    async def call(self, msg: Message) -> Message:
        if self.failing:
            raise ConnectionError("the bus went away")
        return await super().call(msg)


@pytest.mark.parametrize(
    ("error", "why"),
    [
        ("", "the bus went away"),  # the call raises
        ("org.freedesktop.DBus.Error.NoMemory", "org.freedesktop.DBus.Error.NoMemory: said so"),
        (LIMITS_EXCEEDED, f"{LIMITS_EXCEEDED}: said so"),
        (
            "org.freedesktop.DBus.Error.Disconnected",
            "org.freedesktop.DBus.Error.Disconnected: said so",
        ),
        ("org.freedesktop.DBus.Error.Failed", "org.freedesktop.DBus.Error.Failed: said so"),
    ],
)
def test_a_reading_that_fails_keeps_the_bound_and_is_asked_again_later(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: str, why: str
) -> None:
    """A failure the daemon need not give next time (an error other than CANNOT_SAY's, a call
    that raises) keeps the count and the bound: asked again READ_RETRY s later, twice as long
    after each failure in a row (READ_RETRY_MAX at most), not at every answer; said once per
    streak of failures, and once more when the daemon says again. It was taken for a daemon
    that cannot say: nothing was refused any more, for good."""
    now = [100.0]
    monkeypatch.setattr(service_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(service_module, "READ_RETRY", 2.0)
    monkeypatch.setattr(service_module, "READ_RETRY_MAX", 5.0)

    async def body() -> None:
        bus = Failing()
        bus.failing = not error
        service = _service(bus, "x" * 40)

        async def fail() -> None:
            await _turns()
            if error:
                bus.say(None, error)
                await _turns()

        bus.deliver(_status())  # 40 bytes: asked at 100
        await fail()
        assert service._held_said == 0 and service._held() == 40 and service._reading is None
        assert len(bus.asked) == (1 if error else 0)
        now[0] = 101.9
        assert not _refused(bus.deliver(_status()))
        assert not _refused(bus.deliver(_status()))
        await _turns()
        assert _refused(bus.deliver(_status()))  # 120 bytes: the bound still holds
        await _turns()
        assert len(bus.asked) == (1 if error else 0)  # not before READ_RETRY s
        now[0] = 102.0
        assert _refused(bus.deliver(_status()))
        await fail()  # asked at 102, failed again: 4 s to wait
        assert len(bus.asked) == (2 if error else 0)
        now[0] = 105.9
        assert _refused(bus.deliver(_status()))
        await _turns()
        now[0] = 106.0
        assert _refused(bus.deliver(_status()))
        await fail()  # asked at 106, failed a 3rd time: 5 s (READ_RETRY_MAX) to wait
        now[0] = 110.9
        assert _refused(bus.deliver(_status()))
        await _turns()
        assert len(bus.asked) == (3 if error else 0)
        bus.failing = False
        now[0] = 111.0
        assert _refused(bus.deliver(_status()))
        await _turns()
        assert len(bus.asked) == (4 if error else 1)
        bus.say(_stats(0))  # the callers read
        await _turns()
        assert service._held() == 0 and not _refused(bus.deliver(_status()))

    assert _run_said(caplog, body, logging.WARNING) == [
        f"cannot read what the bus daemon holds of ours ({why}): asked again later; until "
        "then the Status answers sent count as held"
    ]
    assert _said(caplog, logging.INFO) == ["the bus daemon says again how much of ours it holds"]


def test_a_new_streak_of_failures_is_said_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After a reading that came, the next failure waits READ_RETRY s only, and is said."""
    now = [100.0]
    monkeypatch.setattr(service_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(service_module, "READ_RETRY", 2.0)
    nomem = "org.freedesktop.DBus.Error.NoMemory"

    async def body() -> None:
        bus = StatsBus()
        service = _service(bus, "x" * 30)
        for answer in [nomem, "", nomem, nomem]:
            bus.deliver(_status())  # 30 bytes since the last word: asked
            await _turns()
            bus.say(_stats(0), answer)
            await _turns()
            now[0] += 2.0
        assert len(bus.asked) == 4 and service._failures == 2

    assert len(_run_said(caplog, body, logging.WARNING)) == 2


class Raising(StatsBus):
    """A bus whose calls raise `error` (the connection's, with whatever words it has)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def call(self, msg: Message) -> Message:
        raise self.error


NAMED = "org.freedesktop.DBus.Error." + "E" * 200  # valid: 227 characters, 255 at most


@pytest.mark.parametrize(
    ("error", "why"),
    [
        (ConnectionError("z" * 300), "z" * 200 + "..."),  # cut at 200
        (ConnectionResetError(), "ConnectionResetError"),  # no words: its type's name
        (NAMED, NAMED[:100] + "...: said so"),  # the daemon's error name cut at 100
    ],
    ids=["raised", "raised-silently", "error-name"],
)
def test_what_a_failed_reading_says_is_cut(
    caplog: pytest.LogCaptureFixture, error: Exception | str, why: str
) -> None:
    """One journal line, however long what the connection or the daemon answered: an
    exception's words cut at 200 characters (its type named where it has none), an error's
    name at 100."""

    async def body() -> None:
        bus = StatsBus() if isinstance(error, str) else Raising(error)
        await _read_once(bus)
        if isinstance(error, str):
            bus.say(None, error)
            await _turns()

    assert _run_said(caplog, body, logging.WARNING) == [
        f"cannot read what the bus daemon holds of ours ({why}): asked again later; until "
        "then the Status answers sent count as held"
    ]


def test_past_the_refusals_bound_each_unanswered_call_asks_the_daemon_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call left unanswered (past MAX_STATUS_HELD + MAX_REFUSALS_HELD) counts nothing, so
    READ_EVERY bytes never come: it asks again itself, READ_AGAIN s after the last reading,
    and once the daemon says its callers read, Status is answered again."""
    monkeypatch.setattr(service_module, "ANSWER_BYTES", 10)
    monkeypatch.setattr(service_module, "READ_EVERY", 1000)
    monkeypatch.setattr(service_module, "READ_AGAIN", 0)

    async def body() -> None:
        bus = StatsBus()
        service = _service(bus, "x" * 140)
        assert bus.deliver(_status()) is True  # 150: exactly the refusals' bound
        await _turns()
        assert bus.asked == []  # 150 bytes, less than READ_EVERY
        assert bus.deliver(_status()) is True and len(bus.sent) == 1  # no answer
        await _turns()
        assert len(bus.asked) == 1
        bus.say(_stats(150))  # not read yet
        await _turns()
        assert service._held() == 150
        assert bus.deliver(_status()) is True and len(bus.sent) == 1
        await _turns()
        assert len(bus.asked) == 2
        bus.say(_stats(0))
        await _turns()
        assert bus.deliver(_status()) is True and len(bus.sent) == 2

    _in_loop(body)


def test_a_refused_call_asks_again_once_exactly_read_again_has_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At most every READ_AGAIN s: at READ_AGAIN s after the last reading, no earlier, the
    daemon is asked again (a clock the test sets)."""
    now = [100.0]
    monkeypatch.setattr(service_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(service_module, "READ_EVERY", 1000)
    monkeypatch.setattr(service_module, "READ_AGAIN", 2.0)

    async def body() -> None:
        bus = StatsBus()
        _service(bus, "x" * 100)
        assert not _refused(bus.deliver(_status()))
        assert _refused(bus.deliver(_status()))  # asked at 100
        await _turns()
        bus.say(_stats(100))
        await _turns()
        now[0] = 101.5
        assert _refused(bus.deliver(_status()))
        await _turns()
        assert len(bus.asked) == 1
        now[0] = 102.0
        assert _refused(bus.deliver(_status()))
        await _turns()
        assert len(bus.asked) == 2

    _in_loop(body)
