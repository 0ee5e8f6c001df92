"""Edges the other tests left open (mutation run): how a service's main process ended, read
from systemd (Systemd.main_exit: its errors in full, a Result= of no form systemd gives);
a connection put away (close_bus) whose end a cancelled task waited for, or whose connect()
timed out after adding its reader; the STATUS= line asking the core for no reasons and
ordering a phase it does not know last; a Status call that names no sender; and a stop of
ours that did not end a unit (WentDown.not_ours) said of that run only.

D-Bus through a real, private dbus-daemon (tests/test_dbus_adapter.py), or a socket that
authenticates the client and never answers its Hello; the tracker and the answers alone."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from dbus_next import BusType, Message, MessageFlag, MessageType, Variant
from dbus_next.aio import MessageBus

from gpuslice.annotations import Scan
from gpuslice.answers import StatusAnswers
from gpuslice.core.scheduler import Outcome, Phase, Snapshot
from gpuslice.counters import Counters
from gpuslice.inventory import Sample
from gpuslice.procmount import ProcHiding
from gpuslice.service import BUS_NAME, INTERFACE, OBJECT_PATH, SchedulerService
from gpuslice.systemd import (
    PROPERTIES,
    SERVICE,
    SYSTEMD,
    Systemd,
    SystemdError,
    close_bus,
    unit_path,
)
from gpuslice.tracker import ReachedGate, WentDown
from tests.service_bus import ServiceBus
from tests.test_dbus_adapter import bus_address as bus_address  # fixture
from tests.test_dbus_adapter import bus_daemon as bus_daemon  # fixture
from tests.test_dbus_adapter import connect, run
from tests.test_service_mutation import _in_loop
from tests.test_tracker import JOB1, JOB2, A, Model, props

BAD_REPLY = "org.gpuslice.Error.BadReply"

# ---------------------------------------------------------------------------------------------
# Systemd.main_exit: the three Gets, and a reply of another form


def _main_exit(address: str, answers: dict[str, dict[str, Variant]], unit: str) -> Any:
    """What main_exit says of `unit` (its MainExit, or the SystemdError raised) when systemd
    answers each Get on a unit's object with `answers[unit][property]`."""
    got: list[Any] = []

    async def scenario() -> None:
        bus = await connect(address)

        def answer(msg: Message) -> Message | bool:
            if msg.interface != PROPERTIES or msg.member != "Get":
                return False
            interface, prop = msg.body
            by_unit = {unit_path(name): values for name, values in answers.items()}
            if interface != SERVICE or msg.path not in by_unit:
                return Message.new_error(msg, "org.freedesktop.DBus.Error.UnknownProperty", prop)
            return Message.new_method_return(msg, "v", [by_unit[msg.path][prop]])

        bus.add_message_handler(answer)
        await bus.request_name(SYSTEMD)
        systemd = Systemd(await connect(address))
        try:
            got.append(await systemd.main_exit(unit))
        except SystemdError as e:
            got.append(e)

    run(scenario)
    return got[0]


KILLED = {"ExecMainCode": Variant("i", 2), "ExecMainStatus": Variant("i", 15)}


def test_a_reply_not_of_systemds_form_is_bad_reply_naming_the_property_and_value(
    bus_address: str,
) -> None:
    """A Result= that is no string: the error's name is gpuslice's BadReply exactly (the
    controller's counters and journal say it), its text which property of which unit, and
    what came instead."""
    wrong = Variant("u", 1)
    raised = _main_exit(bus_address, {"b.service": {**KILLED, "Result": wrong}}, "b.service")
    assert isinstance(raised, SystemdError), raised
    assert raised.name == BAD_REPLY
    assert raised.text == f"Result of b.service: {wrong!r}"
    assert str(raised) == f"{BAD_REPLY}: Result of b.service: {wrong!r}"


def test_a_long_wrong_reply_is_cut_at_80_characters_in_the_error(bus_address: str) -> None:
    """Whatever came instead is said up to 80 characters of its repr, not whole: the text
    goes to the journal."""
    wrong = Variant("s", "x" * 200)
    assert len(repr(wrong)) > 81
    answers = {"c.service": {"ExecMainCode": wrong}}
    raised = _main_exit(bus_address, answers, "c.service")
    assert isinstance(raised, SystemdError), raised
    assert raised.name == BAD_REPLY
    assert raised.text == f"ExecMainCode of c.service: {repr(wrong)[:80]}"


def test_a_result_longer_than_systemd_gives_is_no_result(bus_address: str) -> None:
    """Result= is one of systemd's short words ("success", "signal", ...); a string past 32
    characters is none of them: no result (""), which stopped_by_a_job never takes for a
    stop, rather than a word of gpuslice's own or the string whole."""
    answers = {"a.service": {**KILLED, "Result": Variant("s", "s" * 33)}}
    main = _main_exit(bus_address, answers, "a.service")
    assert (main.code, main.status, main.result) == (2, 15, "")
    answers = {"a.service": {**KILLED, "Result": Variant("s", "s" * 32)}}
    assert _main_exit(bus_address, answers, "a.service").result == "s" * 32


# ---------------------------------------------------------------------------------------------
# close_bus


def test_a_connection_whose_end_a_cancelled_task_awaited_is_put_away_without_raising(
    bus_address: str,
) -> None:
    """A task waiting for the connection's end (the controller's `disconnected`) cancelled,
    as asyncio.run cancels what is left at exit: its end is a cancelled future, which has
    no exception to take; close_bus puts the connection away all the same (its socket
    closed) and raises nothing (CancelledError is no Exception: it would pass through)."""

    async def scenario() -> None:
        bus = MessageBus(bus_address=bus_address, bus_type=BusType.SYSTEM)
        await bus.connect()
        try:
            waiter = asyncio.ensure_future(bus.wait_for_disconnect())
            await asyncio.sleep(0)  # it waits on the connection's end now
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
            assert bus._disconnect_future.cancelled()
            close_bus(bus)
            assert bus._sock.fileno() == -1
        finally:
            bus._stream.close()
            bus._sock.close()

    asyncio.run(asyncio.wait_for(scenario(), timeout=20))


@contextlib.contextmanager
def _never_says_hello(path: Path) -> Iterator[None]:
    """A socket at `path` that authenticates each client (EXTERNAL: OK) and then answers
    nothing: a connect() waits for its Hello's reply with its reader added."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    accepted: list[socket.socket] = []

    def serve() -> None:
        conn, _ = listener.accept()
        accepted.append(conn)
        conn.sendall(b"OK 0123456789abcdef0123456789abcdef\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(5)
        for conn in accepted:
            conn.close()
        listener.close()


def test_a_connect_timed_out_after_adding_its_reader_leaves_no_reader_for_the_next(
    bus_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Systemd.connect past its timeout while its Hello waits: the connection is put away
    with the reader dbus-next added for its socket removed. Left there, the next connection,
    which the kernel gives the same descriptor number, is never read: asyncio takes its
    reader for the old one's, and never asks epoll to watch the new socket (every connect
    after one such timeout hangs)."""
    made: list[MessageBus] = []
    real_connect = MessageBus.connect

    async def recorded(bus: MessageBus) -> MessageBus:
        made.append(bus)
        return await real_connect(bus)

    monkeypatch.setattr(MessageBus, "connect", recorded)

    async def scenario() -> None:
        with _never_says_hello(tmp_path / "silent"):  # its sockets kept open meanwhile
            with pytest.raises(TimeoutError):
                await Systemd.connect(f"unix:path={tmp_path}/silent", timeout=0.3)
            first = made[0]
            assert first._sock.fileno() == -1  # closed
            try:
                systemd = await Systemd.connect(bus_address, timeout=15)  # under load too
            except TimeoutError:
                pytest.fail("the connection after the one that timed out was never read")
        try:
            assert systemd.bus._fd == first._fd, "the same number: what made it hang"
            assert systemd.bus.unique_name
        finally:
            systemd.bus.disconnect()
            await systemd.bus.wait_for_disconnect()
            systemd.bus._stream.close()
            systemd.bus._sock.close()

    asyncio.run(asyncio.wait_for(scenario(), timeout=20))


# ---------------------------------------------------------------------------------------------
# the STATUS= line


class _Core:
    """A core that shows these holders on GPU 0 and records how it was asked."""

    def __init__(self, holders: list[tuple[str, int, str]]) -> None:
        self.holders = holders
        self.asked: list[dict[str, Any]] = []

    def snapshot(self, **kwargs: Any) -> Snapshot:
        self.asked.append(kwargs)
        return Snapshot({0: list(self.holders)}, [("w.service", 10, "waits")], [], [], [], [])

    def declared_memory(self) -> dict[str, int]:
        return {}


async def _nobody(sender: str) -> tuple[int | None, frozenset[int]]:
    raise LookupError(sender)


def _answers(core: _Core) -> StatusAnswers:
    return StatusAnswers(
        core,
        scan=Scan,
        sample=lambda: Sample([]),
        waiting_since=dict,
        suspensions=dict,
        counters=Counters(),
        adapter_counts=list,
        started=lambda: 0.0,
        credentials=_nobody,
        read_hiding=ProcHiding,
    )


def test_the_status_line_asks_the_core_for_no_reasons() -> None:
    """STATUS= is sent at every change and says no waiter's reason: it asks the snapshot
    without them (reasons=False), which spares the core working out, for each waiter
    on busy GPUs, who holds them now."""
    core = _Core([("a.service", 10, "running")])
    assert _answers(core).status_line() == "1 GPU: a.service running; 1 waiting"
    assert core.asked == [{"reasons": False}]


def test_a_holder_in_a_phase_the_line_does_not_order_comes_last() -> None:
    """The core's phases are strings to the line: one it has no place for (a phase added
    to the core later) is named after the phases it orders, never a TypeError out of the
    line at every change."""
    core = _Core([("a.service", 10, "migrating"), ("b.service", 10, "stopping")])
    assert _answers(core).status_line() == (
        "1 GPU: b.service stopping; a.service migrating; 1 waiting"
    )


# ---------------------------------------------------------------------------------------------
# a Status call that names no sender


def test_a_status_call_without_a_sender_is_answered_for_no_name() -> None:
    """A call with no sender (a peer-to-peer connection: no bus daemon names the caller) is
    answered for the empty name, which no caller on a bus has and the bus daemon is never
    asked about, not for a made-up one."""
    asked: list[str] = []

    def status_for(sender: str) -> str:
        asked.append(sender)
        return "{}"

    async def scenario() -> None:
        bus = ServiceBus()
        SchedulerService(
            cast(MessageBus, bus), lambda u, s: None, lambda: "{}", lambda: None, None, status_for
        )
        call = Message(
            destination=BUS_NAME,
            path=OBJECT_PATH,
            interface=INTERFACE,
            member="Status",
            serial=1,
            flags=MessageFlag.NONE,
        )
        assert call.sender is None
        assert bus.deliver(call) is True
        [reply] = bus.sent
        assert reply.message_type is MessageType.METHOD_RETURN and reply.body == ["{}"]

    _in_loop(scenario)
    assert asked == [""]


# ---------------------------------------------------------------------------------------------
# the tracker: not_ours said of one run only


def test_a_stop_of_ours_that_did_not_end_a_unit_is_not_said_of_its_next_start() -> None:
    """A went down before systemd announced our stop (not_ours), and the core no longer
    counted it when that down was judged: nothing to tell it. Someone then starts A (it
    reaches its gate and waits) and cancels that start: no stop of ours was sent for this
    start, so its WentDown says a stop of someone's, not one of ours that did not end it."""
    model = Model()
    model.phases[A] = Phase.STOPPING
    tracker = model.tracker()
    tracker.call_sent(A)
    assert tracker.unit_changed(A, props("inactive", "dead")) == []  # judged at the answer
    tracker.job_new(JOB1, A)
    assert tracker.call_queued(A, JOB1, "stop") is True  # down before our stop was announced
    del model.phases[A]  # the core took it as down meanwhile
    assert tracker.job_removed(JOB1, A, "done") is True
    assert tracker.unit_changed(A, props("inactive", "dead"), read=True) == []
    # someone's `systemctl start`, then `systemctl stop` while it waits at its gate
    tracker.job_new(JOB2, A)
    assert tracker.unit_changed(A, props("activating", "start-pre", 2)) == [ReachedGate(A)]
    model.waiters.add(A)
    tracker.job_removed(JOB2, A, "canceled")
    assert tracker.unit_changed(A, props("inactive", "dead")) == [
        WentDown(A, Outcome.STOPPED, by_itself=False, not_ours=False)
    ]
