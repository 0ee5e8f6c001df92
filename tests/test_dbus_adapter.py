"""The D-Bus adapters (gpuslice/systemd.py, gpuslice/service.py) on a real, private
dbus-daemon started by the test: what they believe, what they drop, what they answer.

A second connection owns `org.freedesktop.systemd1` on that bus and plays systemd's part
of the conversation (it answers Subscribe and sends systemd's signals); a third is the
attacker. No container, a fraction of a second per test.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from dbus_next import BusType, Message, MessageFlag, MessageType, Variant
from dbus_next.aio import MessageBus

from gpuslice import busread, cli
from gpuslice import service as service_module
from gpuslice.service import (
    BUS_NAME,
    INTERFACE,
    NOT_MANAGED,
    OBJECT_PATH,
    START_ENDED,
    NotManaged,
    SchedulerService,
)
from gpuslice.systemd import (
    MANAGER,
    MANAGER_PATH,
    MAX_CALLS_IN_FLIGHT,
    MAX_UNIT_RULES,
    PROPERTIES,
    SERVICE,
    SYSTEMD,
    UNIT,
    Systemd,
    SystemdError,
    is_transient,
    job_path,
    refused_for_own_job,
    unit_path,
)

# seconds a test waits for the bus daemon's part (a pass never waits this long; `run` ends a
# test at 20)
WITHIN = 15.0
BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>{limits}
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
  </policy>
</busconfig>
"""


@pytest.fixture
def bus_daemon(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A private dbus-daemon: its address, and its process (to stop it for a while)."""
    yield from _bus_daemon(tmp_path)


def _bus_daemon(
    tmp_path: Path, limits: str = ""
) -> Generator[tuple[str, subprocess.Popen[bytes]], None, None]:
    """The daemon of `bus_daemon`, with these <limit> elements in its configuration."""
    daemon = shutil.which("dbus-daemon")
    assert daemon, "dbus-daemon is needed (Debian package dbus-daemon)"
    path = tmp_path / "bus"
    config = tmp_path / "bus.conf"
    config.write_text(BUS_CONFIG.format(socket=path, limits=limits))
    log = tmp_path / "bus.log"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(
            [daemon, f"--config-file={config}", "--nofork", "--nopidfile"],
            stderr=stderr,
            preexec_fn=_die_with_parent,
        )
    try:
        deadline = time.monotonic() + 10
        while not _accepts(path):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        yield f"unix:path={path}", proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=5)


def _die_with_parent() -> None:
    """In the dbus-daemon's child, before exec: SIGTERM when the test process dies, so a
    killed test run (a timeout, a mutant that hangs under mutmut) leaves no daemon behind."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _accepts(path: Path) -> bool:
    """Whether the daemon listens: its socket file exists from bind(), a moment before
    listen(), and a connect() in between is refused (seen once in 20 runs of this file)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


@pytest.fixture
def bus_address(bus_daemon: tuple[str, subprocess.Popen[bytes]]) -> str:
    return bus_daemon[0]


_OPEN: list[MessageBus] = []


def run(coro: Callable[[], Awaitable[None]]) -> None:
    async def closing() -> None:
        try:
            await asyncio.wait_for(coro(), timeout=20)
        finally:
            for bus in _OPEN:
                if bus.connected:
                    bus.disconnect()
                    await bus.wait_for_disconnect()
                bus._stream.close()  # dbus-next 0.2.3 leaves its socket's file object open
                bus._sock.close()
            _OPEN.clear()

    asyncio.run(closing())


async def connect(address: str) -> MessageBus:
    bus = MessageBus(bus_address=address, bus_type=BusType.SYSTEM)
    _OPEN.append(bus)
    return await bus.connect()


async def owning_systemds_name(
    address: str, answer: Callable[[Message], Message | bool]
) -> MessageBus:
    """A connection that owns systemd's name and answers with `answer`."""
    bus = await connect(address)
    bus.add_message_handler(answer)
    await bus.request_name(SYSTEMD)
    return bus


async def answering_gets(
    address: str, asked: list[tuple[str, list[Any]]], answer: Callable[[Message], Message]
) -> Systemd:
    """An adapter on its own connection; systemd's name answers each Properties.Get with
    `answer`, noted in `asked` (object path, arguments), and no other call."""

    def get(msg: Message) -> Message | bool:
        if msg.interface != PROPERTIES or msg.member != "Get":
            return False
        asked.append((msg.path or "", list(msg.body)))
        return answer(msg)

    await owning_systemds_name(address, get)
    return Systemd(await connect(address))


async def fake_systemd(address: str) -> MessageBus:
    """A connection that owns systemd's name and answers the manager's calls we make."""

    def answer(msg: Message) -> Message | bool:
        if msg.message_type is MessageType.METHOD_CALL and msg.interface == MANAGER:
            return Message.new_method_return(msg)
        return False

    return await owning_systemds_name(address, answer)


async def until_true(condition: Callable[[], bool]) -> None:
    """Until `condition` holds, failing after WITHIN s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def sync(bus: MessageBus) -> None:
    """A round trip to the bus daemon: everything this connection sent before is routed."""
    await bus.call(
        Message(
            destination="org.freedesktop.DBus",
            path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus.Peer",
            member="Ping",
        )
    )


async def waiting_in_socket(bus: MessageBus, member: str, count: int) -> None:
    """Until `count` calls of `member` wait in the connection's socket (looked at, not read:
    its reader is off). Routed by the bus daemon (`sync`) is not yet written to us: a
    daemon that a loaded machine ran late had written only some when the test went on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN
    waiting = 0
    while waiting < count:
        assert loop.time() < deadline, f"{waiting} of {count} {member} calls came"
        await asyncio.sleep(0.01)
        try:
            data = bus._sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
        waiting = data.count(member.encode())


def properties_changed(unit: str, active: str, destination: str | None = None) -> Message:
    return (
        Message.new_signal(
            unit_path(unit),
            PROPERTIES,
            "PropertiesChanged",
            "sa{sv}as",
            [
                UNIT,
                {
                    "ActiveState": Variant("s", active),
                    "SubState": Variant("s", "dead"),
                    "Job": Variant("(uo)", [0, "/"]),
                    "Id": Variant("s", unit),
                },
                [],
            ],
        )
        if destination is None
        else _addressed(properties_changed(unit, active), destination)
    )


def _addressed(msg: Message, destination: str) -> Message:
    return Message(
        message_type=MessageType.SIGNAL,
        destination=destination,
        path=msg.path,
        interface=msg.interface,
        member=msg.member,
        signature=msg.signature,
        body=msg.body,
    )


def manager_signal(
    member: str, signature: str, body: list[Any], destination: str | None = None
) -> Message:
    msg = Message.new_signal(MANAGER_PATH, MANAGER, member, signature, body)
    return msg if destination is None else _addressed(msg, destination)


class Seen:
    """What the adapter handed to the controller."""

    def __init__(self, systemd: Systemd) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.marker = asyncio.Event()
        systemd.on_unit_changed = self._unit
        systemd.on_job_new = lambda i, p, u: self.events.append(("new", i, p, u))
        systemd.on_job_removed = lambda i, p, u, r: self.events.append(("removed", i, p, u, r))
        systemd.on_reloading = lambda active: self.events.append(("reloading", active))
        systemd.on_systemd_restarted = lambda: self.events.append(("restarted",))

    def _unit(self, name: str, props: dict[str, Any]) -> None:
        if name == "marker.service":
            self.marker.set()
        else:
            self.events.append(("unit", name, props))

    async def after(self, owner: MessageBus) -> list[tuple[Any, ...]]:
        """Everything seen before a marker signal from systemd arrives."""
        self.marker.clear()
        owner.send(properties_changed("marker.service", "active"))
        await self.marker.wait()
        return self.events


async def adapter(address: str) -> tuple[Systemd, MessageBus, Seen]:
    owner = await fake_systemd(address)
    systemd = Systemd(await connect(address))
    seen = Seen(systemd)
    await systemd.subscribe()
    return systemd, owner, seen


def test_signals_from_systemd_are_believed(bus_address: str) -> None:
    async def scenario() -> None:
        systemd, owner, seen = await adapter(bus_address)
        owner.send(properties_changed("a.service", "inactive"))
        owner.send(
            manager_signal("JobNew", "uos", [7, "/org/freedesktop/systemd1/job/7", "a.service"])
        )
        owner.send(
            manager_signal(
                "JobRemoved", "uoss", [7, "/org/freedesktop/systemd1/job/7", "a.service", "done"]
            )
        )
        owner.send(manager_signal("Reloading", "b", [False]))
        assert await seen.after(owner) == [
            ("unit", "a.service", {"ActiveState": "inactive", "SubState": "dead", "Job": [0, "/"]}),
            ("new", 7, "/org/freedesktop/systemd1/job/7", "a.service"),
            ("removed", 7, "/org/freedesktop/systemd1/job/7", "a.service", "done"),
            ("reloading", False),
        ]
        # nothing was forged: the bus daemon's own signals (NameAcquired) are not counted
        await systemd.bus.request_name("org.gpuslice.Test1")
        await seen.after(owner)
        assert systemd.dropped == 0

    run(scenario)


def test_units_properties_are_read_by_the_fast_reader(bus_address: str) -> None:
    """gpuslice/busread.py reads the connection's PropertiesChanged, through the bus daemon
    (which adds the sender): the four properties kept, the rest stepped over."""

    async def scenario() -> None:
        systemd, owner, seen = await adapter(bus_address)
        assert systemd.fast_reader
        assert isinstance(systemd.bus._create_unmarshaller(), busread.Reader)
        owner.send(properties_changed("a.service", "activating"))
        props = {"ActiveState": "activating", "SubState": "dead", "Job": [0, "/"]}
        assert await seen.after(owner) == [("unit", "a.service", props)]

    run(scenario)


def test_forged_signals_are_dropped_broadcast_or_addressed(bus_address: str) -> None:
    """The attack of issue 8: any user emits systemd's signals at the controller."""

    async def scenario() -> None:
        systemd, owner, seen = await adapter(bus_address)
        attacker = await connect(bus_address)
        me = systemd.bus.unique_name
        for destination in (None, me):
            attacker.send(properties_changed("a.service", "inactive", destination))
            attacker.send(
                manager_signal("JobNew", "uos", [1, "/j/1", "shutdown.target"], destination)
            )
            attacker.send(
                manager_signal("JobRemoved", "uoss", [1, "/j/1", "a.service", "done"], destination)
            )
            attacker.send(manager_signal("Reloading", "b", [False], destination))
        # the bus daemon's own signal, forged: systemd's name "moves" to the attacker
        attacker.send(
            _addressed(
                Message.new_signal(
                    "/org/freedesktop/DBus",
                    "org.freedesktop.DBus",
                    "NameOwnerChanged",
                    "sss",
                    [SYSTEMD, owner.unique_name, attacker.unique_name],
                ),
                me,
            )
        )
        await sync(attacker)
        assert await seen.after(owner) == []
        assert systemd.owner == owner.unique_name
        assert (
            systemd.dropped >= 5
        )  # addressed ones reach us and are dropped; broadcasts don't match

    run(scenario)


def test_malformed_signals_from_systemd_itself_are_dropped(bus_address: str) -> None:
    """Wrong signatures, invalid unit names, escaped paths decoding to control characters,
    oversized values: nothing reaches the controller, nothing raises, the bus stays up."""

    async def scenario() -> None:
        systemd, owner, seen = await adapter(bus_address)
        owner.send(manager_signal("JobNew", "sos", ["x", "/j", "a.service"]))
        owner.send(manager_signal("JobNew", "uos", [1, "/j/1", "a b.service"]))
        owner.send(manager_signal("JobNew", "uos", [1, "/j/1", "x" * 300 + ".service"]))
        owner.send(manager_signal("JobRemoved", "uos", [1, "/j/1", "a.service"]))
        owner.send(manager_signal("Reloading", "s", ["no"]))
        bad_path = Message.new_signal(
            "/org/freedesktop/systemd1/unit/x_0a_3c3_3ebad_2eservice",
            PROPERTIES,
            "PropertiesChanged",
            "sa{sv}as",
            [UNIT, {"ActiveState": Variant("s", "inactive")}, []],
        )
        owner.send(bad_path)
        wrong_types = properties_changed("a.service", "inactive")
        wrong_types.body[1] = {
            "ActiveState": Variant("u", 3),
            "SubState": Variant("s", "x" * 100_000),
            "Job": Variant("s", "no"),
        }
        owner.send(wrong_types)
        owner.send(
            Message.new_signal(
                unit_path("a.service"), PROPERTIES, "PropertiesChanged", "s", ["only"]
            )
        )
        assert await seen.after(owner) == []
        assert systemd.bus.connected and owner.connected

    run(scenario)


def test_a_starts_invocation_id_is_passed_on_as_the_gate_sees_it(bus_address: str) -> None:
    """16 bytes become the hex of $INVOCATION_ID; anything else (empty for a unit that never
    ran, the wrong length or type) is left out, and the rest of the signal still counts."""

    async def scenario() -> None:
        _systemd, owner, seen = await adapter(bus_address)
        invocation = bytes(range(16))
        for value in (
            Variant("ay", invocation),
            Variant("ay", b""),
            Variant("ay", b"x" * 17),
            Variant("s", invocation.hex()),
        ):
            msg = properties_changed("a.service", "activating")
            msg.body[1]["InvocationID"] = value
            owner.send(msg)
        changed = [event[2] for event in await seen.after(owner)]
        assert [c.get("InvocationID") for c in changed] == [invocation.hex(), None, None, None]
        assert all(c["ActiveState"] == "activating" for c in changed)

    run(scenario)


def test_a_units_condition_check_is_passed_on_only_of_systemds_types(bus_address: str) -> None:
    """ConditionResult (`b`) and ConditionTimestampMonotonic (`t`) tell a start its
    `Condition*=` skipped (Tracker._condition_checked); of any other type each is left out,
    and the rest of the signal still counts."""

    async def scenario() -> None:
        _systemd, owner, seen = await adapter(bus_address)
        for passed, at in (
            (Variant("b", False), Variant("t", 5)),
            (Variant("s", "no"), Variant("x", -1)),
            (Variant("u", 0), Variant("s", "5")),
            (Variant("b", True), Variant("t", 2**64 - 1)),
            (Variant("b", True), Variant("t", 0)),  # systemd's time of no check yet
        ):
            msg = properties_changed("a.service", "inactive")
            msg.body[1]["ConditionResult"] = passed
            msg.body[1]["ConditionTimestampMonotonic"] = at
            owner.send(msg)
        changed = [event[2] for event in await seen.after(owner)]
        assert [c.get("ConditionResult") for c in changed] == [False, None, None, True, True]
        at = [c.get("ConditionTimestampMonotonic") for c in changed]
        assert at == [5, None, None, 2**64 - 1, 0]
        assert all(c["ActiveState"] == "inactive" for c in changed)

    run(scenario)


def test_only_the_units_watched_are_heard_and_every_unit_again_on_demand(
    bus_address: str,
) -> None:
    """Match rules per unit (Systemd.watch): the bus daemon no longer routes the other units'
    PropertiesChanged to us; the units newly watched are named (their state must be read);
    more than MAX_UNIT_RULES, or None, is every unit again. Manager signals are unaffected."""

    async def scenario() -> None:
        systemd, owner, seen = await adapter(bus_address)
        assert systemd.watches("b.service")  # every unit's, until told
        assert await systemd.watch({"a.service", "marker.service"}) == []  # all heard before
        assert systemd.watches("a.service") and not systemd.watches("b.service")
        owner.send(properties_changed("a.service", "active"))
        owner.send(properties_changed("b.service", "active"))
        owner.send(manager_signal("JobNew", "uos", [7, "/j/7", "b.service"]))
        events = await seen.after(owner)
        assert [e[1] for e in events if e[0] == "unit"] == ["a.service"]
        assert ("new", 7, "/j/7", "b.service") in events
        assert await systemd.watch({"a.service", "c.service", "marker.service"}) == ["c.service"]
        assert await systemd.watch({"a.service", "c.service", "marker.service"}) == []
        assert await systemd.watch(None) == []
        seen.events.clear()
        owner.send(properties_changed("b.service", "inactive"))
        assert [e[1] for e in await seen.after(owner) if e[0] == "unit"] == ["b.service"]
        many = {f"u{i}.service" for i in range(MAX_UNIT_RULES + 1)}
        assert await systemd.watch(many) == []  # every unit's still: no rule per unit
        assert systemd.watches("b.service")
        assert await systemd.watch({"marker.service"}) == []
        # from one unit to every unit's: the others were not heard until now
        assert await systemd.watch(many) == sorted(many)
        seen.events.clear()
        owner.send(properties_changed("d.service", "inactive"))
        assert [e[1] for e in await seen.after(owner) if e[0] == "unit"] == ["d.service"]

    run(scenario)


def test_rules_of_a_change_the_bus_daemon_refused_halfway_are_taken_back(
    tmp_path: Path,
) -> None:
    """The bus daemon keeps at most so many match rules per connection
    (max_match_rules_per_connection). A change of the units matched that it refused halfway
    left the rules already added in place, unrecorded: each later try added them again,
    until no rule at all could be added and every unit's signals were read for good."""
    limits = '\n  <limit name="max_match_rules_per_connection">12</limit>'
    daemon = _bus_daemon(tmp_path, limits)
    address, _ = next(daemon)

    async def scenario() -> None:
        systemd, owner, seen = await adapter(address)
        many = {f"u{i:02}.service" for i in range(20)}
        for _ in range(3):  # the controller tries again at each change of the units it follows
            with pytest.raises(SystemdError):
                await systemd.watch(many)
            assert systemd.watches("b.service")  # every unit's, as before the refused change
        assert await systemd.watch({"a.service", "marker.service"}) == []
        assert not systemd.watches("b.service")
        owner.send(properties_changed("a.service", "active"))
        owner.send(properties_changed("b.service", "active"))
        assert [e[1] for e in await seen.after(owner) if e[0] == "unit"] == ["a.service"]

    try:
        run(scenario)
    finally:
        daemon.close()


def test_systemd_changing_hands_is_followed(bus_address: str) -> None:
    """daemon-reexec: systemd's name moves to a new connection; from then on only the new
    owner is believed, and the controller is told to read everything again."""

    async def scenario() -> None:
        systemd, owner, seen = await adapter(bus_address)
        old = owner.unique_name
        owner.disconnect()
        await owner.wait_for_disconnect()
        new_owner = await fake_systemd(bus_address)
        events = await seen.after(new_owner)
        assert systemd.owner == new_owner.unique_name != old
        assert events == [("restarted",)]

    run(scenario)


def test_systemd_changing_hands_unheard_is_found_by_asking(bus_address: str) -> None:
    """The bus daemon drops its NameOwnerChanged like any signal for a connection whose
    queue is full: lost at a daemon-reexec, the old name stayed believed and every signal
    of the new systemd was dropped as forged. Asked (the audit asks), the new owner is
    followed and the controller told to read everything again; asked again, nothing."""

    async def scenario() -> None:
        systemd, owner, seen = await adapter(bus_address)
        old = owner.unique_name
        # as if every NameOwnerChanged from now on were dropped for our full queue
        await systemd._remove_match(
            f"type='signal',sender='org.freedesktop.DBus',path='/org/freedesktop/DBus',"
            f"interface='org.freedesktop.DBus',member='NameOwnerChanged',arg0='{SYSTEMD}'"
        )
        assert await systemd.check_owner() is False
        owner.disconnect()
        await owner.wait_for_disconnect()
        new_owner = await fake_systemd(bus_address)
        new_owner.send(manager_signal("Reloading", "b", [False]))
        await sync(new_owner)
        await sync(systemd.bus)
        assert systemd.owner == old  # deaf: the new systemd's signals are dropped
        assert seen.events == [] and systemd.dropped == 1
        assert await systemd.check_owner() is True
        assert systemd.owner == new_owner.unique_name
        assert await systemd.check_owner() is False
        new_owner.send(manager_signal("Reloading", "b", [False]))
        assert await seen.after(new_owner) == [("restarted",), ("reloading", False)]

    run(scenario)


JOB = "/org/freedesktop/systemd1/job/7"


async def queuing_systemd(address: str, held: list[Message] | None = None) -> MessageBus:
    """Owns systemd's name; answers StartUnit/StopUnit with job 7 between its JobNew and the
    unit's PropertiesChanged, as systemd does; refuses units named "refused*" and answers no
    job path for "odd*". With `held`, calls are kept there, unanswered."""
    bus = await connect(address)

    def answer(msg: Message) -> Message | bool:
        if msg.message_type is not MessageType.METHOD_CALL or msg.interface != MANAGER:
            return False
        if msg.member not in ("StartUnit", "StopUnit"):  # Subscribe, ResetFailedUnit
            return bool(msg.flags & MessageFlag.NO_REPLY_EXPECTED) or Message.new_method_return(msg)
        if held is not None:
            held.append(msg)
        elif msg.body[0].startswith("refused"):
            bus.send(Message.new_error(msg, "org.freedesktop.systemd1.NoSuchUnit", "no"))
        elif msg.body[0].startswith("odd"):
            bus.send(Message.new_method_return(msg, "u", [7]))  # not a job path
        else:
            bus.send(manager_signal("JobNew", "uos", [7, JOB, msg.body[0]]))
            bus.send(Message.new_method_return(msg, "o", [JOB]))
            bus.send(properties_changed(msg.body[0], "deactivating"))
        return True

    bus.add_message_handler(answer)
    await bus.request_name(SYSTEMD)
    return bus


def test_a_call_systemd_never_got_is_told_apart_from_its_refusal(bus_address: str) -> None:
    """What a real bus daemon answers a StartUnit that systemd never took: systemd left the
    bus with it pending (daemon-reexec: NoReply), then its name had no owner for a moment
    (ServiceUnknown). Both pass, and the controller sends the call again; systemd's own
    refusal (a unit not found) does not, and a second call would only repeat it."""

    async def scenario() -> None:
        held: list[Message] = []
        owner = await queuing_systemd(bus_address, held)
        systemd = Systemd(await connect(bus_address))
        await systemd.subscribe()
        pending = asyncio.ensure_future(systemd.start_unit("a.service"))
        while not held:
            await asyncio.sleep(0.01)
        owner.disconnect()  # systemd re-executes: it leaves the bus, our call unanswered
        with pytest.raises(SystemdError) as left:
            await pending
        assert left.value.name == "org.freedesktop.DBus.Error.NoReply"
        with pytest.raises(SystemdError) as away:
            await systemd.start_unit("a.service")
        assert away.value.name == "org.freedesktop.DBus.Error.ServiceUnknown"
        assert is_transient(left.value) and is_transient(away.value)
        await queuing_systemd(bus_address)  # back, as a new connection
        with pytest.raises(SystemdError) as refused:
            await systemd.start_unit("refused.service")
        assert not is_transient(refused.value)
        masked = SystemdError("org.freedesktop.systemd1.UnitMasked", "Unit a.service is masked.")
        denied = SystemdError("org.freedesktop.DBus.Error.AccessDenied", "not allowed")
        assert not is_transient(masked) and not is_transient(denied)

    run(scenario)


def test_the_job_a_call_queued_is_told_before_the_signals_after_its_answer(
    bus_address: str,
) -> None:
    """Systemd sends JobNew, its answer to StartUnit/StopUnit, then the job's other signals:
    the caller is told the job as the answer is read, before those are handled (the
    awaiting coroutine resumes only after them)."""

    async def scenario() -> None:
        owner = await queuing_systemd(bus_address)
        systemd = Systemd(await connect(bus_address))
        seen = Seen(systemd)
        await systemd.subscribe()
        for call in (systemd.stop_unit, systemd.start_unit, systemd.restart_preempted):
            seen.events.clear()
            job = await call("a.service", lambda path: seen.events.append(("queued", path)))
            assert job == JOB
            assert [e[:2] for e in await seen.after(owner)] == [
                ("new", 7),
                ("queued", JOB),
                ("unit", "a.service"),
            ]
        seen.events.clear()
        with pytest.raises(SystemdError, match="NoSuchUnit"):
            await systemd.stop_unit("refused.service", lambda p: seen.events.append(("queued",)))
        assert await seen.after(owner) == []
        await systemd.stop_unit("odd.service", lambda p: seen.events.append(("queued",)))
        assert await seen.after(owner) == []
        assert await systemd.stop_unit("b.service") == JOB  # nobody to tell
        assert systemd._told == {}

    run(scenario)


def test_an_answer_from_a_former_owner_of_systemds_name_is_not_told(bus_address: str) -> None:
    """Only systemd's current owner is believed in order: an answer of the connection that
    held the name when we called reaches the caller as it resumes, as before."""

    async def scenario() -> None:
        held: list[Message] = []
        old = await queuing_systemd(bus_address, held)
        systemd = Systemd(await connect(bus_address))
        seen = Seen(systemd)
        await systemd.subscribe()
        told: list[str] = []
        call = asyncio.ensure_future(systemd.stop_unit("a.service", told.append))
        while not held:
            await asyncio.sleep(0.01)
        await old.release_name(SYSTEMD)
        new = await fake_systemd(bus_address)
        await seen.after(new)  # NameOwnerChanged handled: the new owner is followed
        assert systemd.owner == new.unique_name
        old.send(Message.new_method_return(held[0], "o", [JOB]))
        assert await call == JOB
        assert told == []

    run(scenario)


def test_caller_pid_is_the_bus_daemons_word(bus_address: str) -> None:
    async def scenario() -> None:
        systemd, _owner, _seen = await adapter(bus_address)
        assert await systemd.caller_pid(systemd.bus.unique_name) == os.getpid()

    run(scenario)


async def call(
    bus: MessageBus, member: str, signature: str = "", body: list[Any] | None = None
) -> Message:
    reply = await bus.call(
        Message(
            destination=BUS_NAME,
            path=OBJECT_PATH,
            interface=INTERFACE,
            member=member,
            signature=signature,
            body=body or [],
        )
    )
    assert reply is not None
    return reply


def test_service_answers_bad_acquire_calls_with_errors(bus_address: str) -> None:
    async def scenario() -> None:
        bus = await connect(bus_address)
        asked: list[tuple[str, str]] = []
        service = SchedulerService(
            bus, lambda unit, sender: asked.append((unit, sender)), lambda: "{}", lambda: None
        )
        await service.claim_name()
        client = await connect(bus_address)
        bad = await call(client, "Acquire", "s", ["x\n<3>fake.service"])
        assert bad.error_name == "org.freedesktop.DBus.Error.InvalidArgs"
        assert "\n" not in bad.body[0]
        wrong = await call(client, "Acquire", "u", [5])
        assert wrong.error_name == "org.freedesktop.DBus.Error.InvalidArgs"
        long_name = "x" * 247 + ".service"  # 255 characters: valid
        pending = asyncio.ensure_future(call(client, "Acquire", "s", [long_name]))
        await sync(client)  # the call is routed to the service's connection ...
        await sync(bus)  # ... which read it before this answer (one loop turn was not always)
        assert asked and asked[0] == (long_name, client.unique_name)
        service.refuse(
            long_name, client.unique_name, "org.freedesktop.DBus.Error.AccessDenied", "no"
        )
        assert (await pending).error_name == "org.freedesktop.DBus.Error.AccessDenied"
        assert not service.pending(long_name)
        status = await call(client, "Status")
        assert status.body == ["{}"]

    run(scenario)


def test_a_call_with_long_arguments_is_refused_unread(bus_address: str) -> None:
    """Anyone may call Status, and the bus policy cannot say with which arguments: 32 MiB of
    variants (the system bus's largest message) took dbus-next a minute to read, the
    controller's loop blocked past its watchdog. On the controller's connection (Systemd
    installs its reader) a call's arguments past busread.MAX_CALL_BODY are not read: the
    call is refused, and the next one is answered as before."""

    async def scenario() -> None:
        systemd = Systemd(await connect(bus_address))
        service = SchedulerService(systemd.bus, lambda u, s: None, lambda: "{}", lambda: None)
        await service.claim_name()
        client = await connect(bus_address)
        padded = await call(client, "Status", "av", [[Variant("y", 1)] * 50_000])
        assert padded.error_name == "org.freedesktop.DBus.Error.LimitsExceeded"
        assert padded.body == ["arguments of 200004 bytes: not read"]
        assert (await call(client, "Status")).body == ["{}"]
        short = await call(client, "Status", "s", ["x" * 100])  # read, and ignored
        assert short.body == ["{}"]

    run(scenario)


def test_a_call_with_a_long_path_is_refused_unread(bus_address: str) -> None:
    """Anyone may call Introspect on any path of ours, and the bus daemon passes a path of up
    to 32 MiB, which dbus-next checked an element at a time (an 8 MiB one held the loop
    1.7 s). On the controller's connection a call whose header is past
    busread.MAX_CALL_HEADER is refused without its path being read; the next is answered."""

    async def scenario() -> None:
        systemd = Systemd(await connect(bus_address))
        service = SchedulerService(systemd.bus, lambda u, s: None, lambda: "{}", lambda: None)
        await service.claim_name()
        client = await connect(bus_address)
        reply = await client.call(
            Message(
                destination=BUS_NAME,
                path="/a" * busread.MAX_CALL_HEADER,
                interface="org.freedesktop.DBus.Introspectable",
                member="Introspect",
            )
        )
        assert reply is not None
        assert reply.error_name == "org.freedesktop.DBus.Error.LimitsExceeded"
        assert reply.body[0].startswith("a header of ")
        assert (await call(client, "Status")).body == ["{}"]

    run(scenario)


def status_asking_no_answer() -> Message:
    """A Status call with NO_REPLY_EXPECTED, which no limit of the bus daemon's counts."""
    return Message(
        destination=BUS_NAME,
        path=OBJECT_PATH,
        interface=INTERFACE,
        member="Status",
        flags=MessageFlag.NO_REPLY_EXPECTED,
    )


def test_a_flood_of_calls_is_read_a_turn_of_the_loop_at_a_time(bus_address: str) -> None:
    """Anyone may call Status, as often as they like. dbus-next read every message its
    socket held before the loop went on: one process's flood of calls kept the controller's
    loop there for as long as it lasted, its timers and the watchdog's feed waiting. On the
    controller's connection at most busread.MAX_PER_TURN are read per turn of the loop."""

    async def scenario() -> None:
        systemd = Systemd(await connect(bus_address))
        bus = systemd.bus
        turn = [0]
        answered: list[int] = []  # the turn of the loop each call was read in

        def read(msg: Message) -> bool:  # before the service's: sees every call as it is read
            if msg.member == "Status":
                answered.append(turn[0])
            return False

        bus.add_message_handler(read)
        service = SchedulerService(bus, lambda u, s: None, lambda: "{}", lambda: None)
        await service.claim_name()
        client = Systemd(await connect(bus_address)).bus  # its writer waits when the bus lags
        loop = asyncio.get_running_loop()
        loop.remove_reader(bus._fd)  # the calls pile up in its socket meanwhile
        for _ in range(300):
            client.send(status_asking_no_answer())
        await sync(client)
        # more than a turn reads (all 300 do not fit: the rest wait in the bus daemon)
        await waiting_in_socket(bus, "Status", 2 * busread.MAX_PER_TURN)

        def tick() -> None:
            turn[0] += 1
            if len(answered) < 300:
                loop.call_soon(tick)

        loop.call_soon(tick)
        loop.add_reader(bus._fd, bus._message_reader)
        while len(answered) < 300:
            await asyncio.sleep(0.01)
        per_turn = [answered.count(t) for t in set(answered)]
        assert max(per_turn) == busread.MAX_PER_TURN

    run(scenario)


def test_a_status_call_that_asks_for_no_answer_gets_none(bus_address: str) -> None:
    """Anyone may call Status with NO_REPLY_EXPECTED, as fast as their socket takes it
    (14,000-24,000 calls a second here), and no limit of the bus daemon's applies: each was
    answered with the whole status all the same, queued by dbus-next without bound, and
    dropped by the bus daemon once read. At 1,000 waiting units (2 MiB each) one second of it
    took the controller to the 4 GiB its measurement allowed. Such a call is not answered,
    and the status is not even built for it."""

    async def scenario() -> None:
        systemd = Systemd(await connect(bus_address))
        built: list[int] = []

        def status() -> str:
            built.append(1)
            return "{}"

        service = SchedulerService(systemd.bus, lambda u, s: None, status, lambda: None)
        await service.claim_name()
        client = await connect(bus_address)
        for _ in range(3):
            client.send(status_asking_no_answer())
        assert (await call(client, "Status")).body == ["{}"]  # read after the three
        assert built == [1]

    run(scenario)


def test_status_answers_not_yet_sent_are_bounded(
    bus_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Callers that ask faster than the bus daemon takes the answers (or never read them:
    the daemon lets a connection have 128 calls in wait, a user 256 connections) had every
    answer queued in the controller: at 1,000 waiting units eight such connections took it
    to 2.2 GiB and held its own calls 4.5 s. Past MAX_STATUS_UNSENT bytes of answers not yet
    written, a Status call is refused; one answer always goes, and once it is written the
    next call is answered again."""
    monkeypatch.setattr(service_module, "MAX_STATUS_UNSENT", 1 << 20)
    big = "{" + "x" * (1 << 20) + "}"

    async def scenario() -> None:
        systemd = Systemd(await connect(bus_address))
        bus = systemd.bus
        service = SchedulerService(bus, lambda u, s: None, lambda: big, lambda: None)
        await service.claim_name()
        client = await connect(bus_address)
        loop = asyncio.get_running_loop()
        loop.remove_reader(bus._fd)  # the three calls are read in one turn of the loop
        calls = [asyncio.ensure_future(call(client, "Status")) for _ in range(3)]
        await asyncio.sleep(0)
        await sync(client)
        await waiting_in_socket(bus, "Status", 3)
        loop.add_reader(bus._fd, bus._message_reader)
        replies = await asyncio.gather(*calls)
        assert [len(r.body[0]) for r in replies if r.message_type is MessageType.METHOD_RETURN] == [
            len(big)
        ]
        refused = [r for r in replies if r.message_type is MessageType.ERROR]
        assert [r.error_name for r in refused] == ["org.freedesktop.DBus.Error.LimitsExceeded"] * 2
        assert refused[0].body == ["too many status answers still being sent: try again"]
        assert (await call(client, "Status")).body == [big]  # the first one was written
        assert service._status_unsent == 0

    run(scenario)


def _never_reading(address: str) -> socket.socket:
    """A bus connection that says Hello and then never reads: it sends what it is told to."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address.removeprefix("unix:path="))
    sock.sendall(b"\0AUTH EXTERNAL " + str(os.getuid()).encode().hex().encode() + b"\r\n")
    assert sock.recv(4096).startswith(b"OK")
    sock.sendall(b"BEGIN\r\n")
    hello = Message(
        destination="org.freedesktop.DBus",
        path="/org/freedesktop/DBus",
        interface="org.freedesktop.DBus",
        member="Hello",
        serial=1,
    )
    sock.sendall(hello._marshall())
    return sock


@pytest.mark.parametrize(
    ("member", "interface", "rounds"),
    [
        ("Status", INTERFACE, 12),
        # ~1 KiB answers, and once Status is refused, its refusals: held all the same
        ("Introspect", "org.freedesktop.DBus.Introspectable", 30),
    ],
)
def test_status_answers_their_callers_never_read_cannot_stop_the_controllers_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, member: str, interface: str, rounds: int
) -> None:
    """dbus-daemon keeps an answer until its caller reads it, counted against the connection
    that sent it, and stops reading that connection's socket once it keeps
    max_incoming_bytes of it (127 MiB on the system bus; 4 MiB here, the bounds scaled
    alike). Two connections that called Status without ever reading held the controller's
    own calls (to systemd: StartUnit, StopUnit) for as long as they lived; so did ~1 KiB
    answers of Introspect, and refusals. Past MAX_STATUS_HELD bytes the bus daemon may hold,
    Status is refused, past MAX_REFUSALS_HELD more not answered; the calls go on, and once
    those callers left, Status is answered again."""
    daemon = _bus_daemon(tmp_path, '\n  <limit name="max_incoming_bytes">4194304</limit>')
    address, _ = next(daemon)
    monkeypatch.setattr(service_module, "MAX_STATUS_HELD", 2 << 20)
    monkeypatch.setattr(service_module, "MAX_REFUSALS_HELD", 1 << 20)
    monkeypatch.setattr(service_module, "READ_EVERY", 256 << 10)
    answer = "{" + "x" * (16 << 10) + "}"

    async def scenario() -> None:
        systemd = Systemd(await connect(address))
        await fake_systemd(address)
        service = SchedulerService(systemd.bus, lambda u, s: None, lambda: answer, lambda: None)
        await service.claim_name()
        flooders = [_never_reading(address) for _ in range(2)]
        status = Message(destination=BUS_NAME, path=OBJECT_PATH, interface=interface, member=member)
        serials = itertools.count(2)
        for _ in range(rounds):  # 100 calls at a time: the daemon lets each have 128 in wait
            for sock in flooders:
                for _ in range(100):
                    status.serial = next(serials)
                    sock.sendall(status._marshall())
            await asyncio.sleep(0.05)
        probe = Message(destination=SYSTEMD, path=MANAGER_PATH, interface=MANAGER, member="Ping")
        reply = await asyncio.wait_for(systemd.bus.call(probe), 5)  # held for ever before
        assert reply is not None and reply.message_type is MessageType.METHOD_RETURN
        client = await connect(address)

        async def said() -> list[Any] | None:
            """The answer's body; None for none (past the refusals' bound)."""
            try:
                body: list[Any] = (await asyncio.wait_for(call(client, "Status"), 1)).body
                return body
            except TimeoutError:
                return None

        refused = ["too many status answers not yet read by their callers: try again"]
        if service._held() >= 2 << 20:  # a loaded host read fewer of the flood: the daemon
            # refused the others itself (128 unanswered a caller), and dropped answers
            assert await said() in (refused, None)
        for sock in flooders:
            sock.close()  # the daemon drops what it held for them
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WITHIN
        while (body := await said()) != [answer]:  # asked again when refused
            assert body in (refused, None) and loop.time() < deadline, body
            await asyncio.sleep(0.05)

    try:
        run(scenario)
    finally:
        daemon.close()


def test_a_status_too_long_for_the_bus_is_refused_and_the_controller_stays(
    bus_address: str,
) -> None:
    """The bus daemon takes no message over 32 MiB (max_message_size): it dropped the
    controller's connection for sending one, and the controller exits with its bus. Its status
    grows ~2.2 KiB per waiting unit on 8 GPUs (~15 KiB on 64), and anyone may ask for it, again
    after each restart. Such an answer is refused with a sentence; the connection stays."""
    huge = "{" + "x" * (33 << 20) + "}"

    async def scenario() -> None:
        systemd = Systemd(await connect(bus_address))
        answers = iter([huge, "{}"])
        service = SchedulerService(
            systemd.bus, lambda u, s: None, lambda: next(answers), lambda: None
        )
        await service.claim_name()
        client = await connect(bus_address)
        refused = await call(client, "Status")
        assert refused.error_name == "org.freedesktop.DBus.Error.LimitsExceeded"
        assert refused.body == [
            f"the status is {len(huge)} bytes, more than one D-Bus message carries "
            f"({service_module.MAX_STATUS_ANSWER})"
        ]
        assert (await call(client, "Status")).body == ["{}"]
        assert systemd.bus.connected

    run(scenario)


def test_gpuslice_status_says_why_the_controller_refused_not_that_it_may_be_down(
    bus_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal (LimitsExceeded) comes from a controller that runs: `gpuslice status`
    prints its sentence, not "did not answer ... is it running?"."""
    huge = "{" + "x" * (33 << 20) + "}"
    real_connect = MessageBus.connect

    async def closed_by_run(bus: MessageBus) -> MessageBus:  # the CLI's connection too
        _OPEN.append(await real_connect(bus))
        return bus

    monkeypatch.setattr(MessageBus, "connect", closed_by_run)

    async def scenario() -> None:
        systemd = Systemd(await connect(bus_address))
        service = SchedulerService(systemd.bus, lambda u, s: None, lambda: huge, lambda: None)
        await service.claim_name()
        with pytest.raises(click.ClickException) as refused:
            await cli._call_status(bus_address)
        assert refused.value.message == (
            "the gpuslice controller refused: "
            f"the status is {len(huge)} bytes, more than one D-Bus message carries "
            f"({service_module.MAX_STATUS_ANSWER})"
        )

    run(scenario)


def test_service_caps_pending_calls_per_unit(bus_address: str) -> None:
    async def scenario() -> None:
        bus = await connect(bus_address)
        service = SchedulerService(bus, lambda unit, sender: None, lambda: "{}", lambda: None)
        await service.claim_name()
        client = await connect(bus_address)
        calls = [
            asyncio.ensure_future(call(client, "Acquire", "s", ["a.service"])) for _ in range(12)
        ]
        await asyncio.sleep(0)  # the twelve are sent
        await call(client, "Status")  # answered after each of them was (waited 2 s before)
        done = [c for c in calls if c.done()]
        refused = [c.result() for c in done]
        assert len(refused) == 12 - 8
        assert all(r.error_name == "org.freedesktop.DBus.Error.LimitsExceeded" for r in refused)
        service.grant("a.service", "0")
        granted = await asyncio.gather(*(c for c in calls if c not in done))
        assert [r.body for r in granted] == [["0"]] * 8

    run(scenario)


def test_calls_of_a_start_that_ended_are_answered_not_dropped(bus_address: str) -> None:
    """The controller forgets a unit's calls when its start ends. A call in wait then may be
    the gate of the unit's next start, whose Acquire came before the signals of that end
    (systemd holds them back while its bus queue is long): dropped, its dbus-send waited for
    ever (a reply timeout of ~24 days), and the start with it. Answered with an error, the
    gate asks again (data/gpuslice-gate retries on any failure)."""

    async def scenario() -> None:
        bus = await connect(bus_address)
        service = SchedulerService(bus, lambda unit, sender: None, lambda: "{}", lambda: None)
        await service.claim_name()
        client = await connect(bus_address)
        pending = asyncio.ensure_future(call(client, "Acquire", "s", ["a.service"]))
        await sync(client)
        await sync(bus)
        assert service.pending("a.service")
        service.forget("a.service")
        reply = await asyncio.wait_for(pending, timeout=WITHIN)
        assert reply.error_name == START_ENDED
        assert reply.body == ["the start of a.service this call waited for has ended: ask again"]
        assert not service.pending("a.service")
        service.forget("a.service")  # nothing in wait: nothing sent
        assert service.grant("a.service", "0") == 0

    run(scenario)


def test_plan_calls_are_checked_and_routed(bus_address: str) -> None:
    """Plan takes one valid unit name; an unmanaged unit is an error that says so."""

    async def scenario() -> None:
        bus = await connect(bus_address)

        def plan(unit: str) -> str:
            if unit != "a.service":
                raise NotManaged(f"{unit} is not managed by gpuslice")
            return '{"verdict": "starts"}'

        service = SchedulerService(bus, lambda u, s: None, lambda: "{}", lambda: None, plan)
        await service.claim_name()
        client = await connect(bus_address)
        assert (await call(client, "Plan", "s", ["a.service"])).body == ['{"verdict": "starts"}']
        other = await call(client, "Plan", "s", ["b.service"])
        assert other.error_name == NOT_MANAGED and "b.service" in other.body[0]
        bad = await call(client, "Plan", "s", ["x\n<3>y.service"])
        assert bad.error_name == "org.freedesktop.DBus.Error.InvalidArgs"
        assert "\n" not in bad.body[0]
        wrong = await call(client, "Plan", "u", [5])
        assert wrong.error_name == "org.freedesktop.DBus.Error.InvalidArgs"

    run(scenario)


def test_a_failing_handler_answers_without_a_traceback(bus_address: str) -> None:
    async def scenario() -> None:
        bus = await connect(bus_address)

        def broken() -> str:
            raise RuntimeError("secret detail")

        service = SchedulerService(bus, lambda unit, sender: None, broken, lambda: None)
        await service.claim_name()
        client = await connect(bus_address)
        reply = await call(client, "Status")
        assert reply.message_type is MessageType.ERROR
        assert "secret" not in str(reply.body)
        assert (await call(client, "Nope")).error_name == "org.freedesktop.DBus.Error.UnknownMethod"

    run(scenario)


def test_a_units_state_is_read_from_its_listing(bus_address: str) -> None:
    """One small ListUnitsByNames reply, not the unit's GetAll (kilobytes to unmarshal); the
    periodic read of the units the core knows asks for all of them in one."""

    async def body() -> None:
        owner = await connect(bus_address)
        asked: list[list[str]] = []

        def answer(msg: Message) -> Message | bool:
            if msg.message_type is not MessageType.METHOD_CALL or msg.member != "ListUnitsByNames":
                return False
            asked.append(msg.body[0])
            listed = [
                [n, "", "loaded", "activating", "start-pre", "", unit_path(n), 7, "start", "/j/7"]
                for n in msg.body[0]
                if n == "a.service"
            ]
            return Message.new_method_return(msg, "a(ssssssouso)", [listed])

        owner.add_message_handler(answer)
        await owner.request_name(SYSTEMD)
        systemd = Systemd(await connect(bus_address))
        state = await systemd.unit_state("a.service")
        assert (state.active, state.sub, state.job_id, state.job_type) == (
            "activating",
            "start-pre",
            7,
            "start",
        )
        with pytest.raises(SystemdError, match=r"did not list b\.service"):
            await systemd.unit_state("b.service")
        many = await systemd.units_state({"b.service", "a.service"})  # one call, sorted
        assert [(u.name, u.sub) for u in many] == [("a.service", "start-pre")]
        assert asked == [["a.service"], ["b.service"], ["a.service", "b.service"]]

    run(body)


def test_the_start_jobs_are_read_in_the_order_systemd_made_them(bus_address: str) -> None:
    """ListJobs: the units with a start or restart job, by job id (a gate's call waits for
    them, gpuslice/queued.py); a reply not of systemd's form is gpuslice's BadReply."""

    async def body() -> None:
        owner = await connect(bus_address)
        replies = [
            (
                "a(usssoo)",
                [
                    [9, "b.service", "start", "waiting", "/j/9", unit_path("b.service")],
                    [3, "c.service", "stop", "running", "/j/3", unit_path("c.service")],
                    [7, "a.service", "restart", "running", "/j/7", unit_path("a.service")],
                ],
            ),
            ("a(s)", [["a.service"]]),
        ]

        def answer(msg: Message) -> Message | bool:
            if msg.message_type is not MessageType.METHOD_CALL or msg.member != "ListJobs":
                return False
            signature, jobs = replies.pop(0)
            return Message.new_method_return(msg, signature, [jobs])

        owner.add_message_handler(answer)
        await owner.request_name(SYSTEMD)
        systemd = Systemd(await connect(bus_address))
        assert await systemd.start_jobs() == ["a.service", "b.service"]
        with pytest.raises(SystemdError, match="ListJobs") as raised:
            await systemd.start_jobs()
        assert raised.value.name == "org.gpuslice.Error.BadReply"

    run(body)


def test_the_jobs_a_job_waits_for_are_read_from_its_own_object(bus_address: str) -> None:
    """Job.GetBefore on the job's object (GetAfter names those that wait for it): (id, unit,
    type) of each; a reply not of systemd's form is gpuslice's BadReply."""

    async def body() -> None:
        owner = await connect(bus_address)
        replies = [
            (
                "a(usssoo)",
                [[6, "b.service", "start", "waiting", job_path(6), unit_path("b.service")]],
            ),
            ("a(us)", [[6, "b.service"]]),
        ]
        asked: list[tuple[str, str, str]] = []

        def answer(msg: Message) -> Message | bool:
            if msg.message_type is not MessageType.METHOD_CALL or msg.member != "GetBefore":
                return False
            asked.append((msg.path or "", msg.interface or "", msg.signature))
            signature, jobs = replies.pop(0)
            return Message.new_method_return(msg, signature, [jobs])

        owner.add_message_handler(answer)
        await owner.request_name(SYSTEMD)
        systemd = Systemd(await connect(bus_address))
        assert await systemd.jobs_waited_for(5) == [(6, "b.service", "start")]
        assert asked == [(job_path(5), "org.freedesktop.systemd1.Job", "")]
        with pytest.raises(SystemdError, match="GetBefore") as raised:
            await systemd.jobs_waited_for(5)
        assert raised.value.name == "org.gpuslice.Error.BadReply"

    run(body)


def test_the_freezer_calls_and_a_units_processes(bus_address: str) -> None:
    """FreezeUnit/ThawUnit by name, FreezerState read from the unit's own object, the PIDs of
    GetUnitProcesses; an error reply is a SystemdError (the ladder's reason), not a crash."""

    async def body() -> None:
        owner = await connect(bus_address)
        calls: list[tuple[str, str, list[Any]]] = []

        def answer(msg: Message) -> Message | bool:
            if msg.message_type is not MessageType.METHOD_CALL:
                return False
            calls.append((msg.member or "", msg.path or "", list(msg.body)))
            if msg.member in ("FreezeUnit", "ThawUnit"):
                if msg.body[0] == "gone.service":
                    return Message.new_error(msg, "org.freedesktop.systemd1.NoSuchUnit", "no")
                return Message.new_method_return(msg)
            if msg.member == "Get" and msg.body == [UNIT, "FreezerState"]:
                return Message.new_method_return(msg, "v", [Variant("s", "frozen")])
            if msg.member == "GetUnitProcesses":
                rows = [["/system.slice/a.service", 41, "sh"], ["/system.slice/a.service", 42, "x"]]
                return Message.new_method_return(msg, "a(sus)", [rows])
            return False

        owner.add_message_handler(answer)
        await owner.request_name(SYSTEMD)
        systemd = Systemd(await connect(bus_address))
        await systemd.freeze_unit("a.service")
        await systemd.thaw_unit("a.service")
        assert await systemd.freezer_state("a.service") == "frozen"
        assert await systemd.unit_pids("a.service") == [41, 42]
        with pytest.raises(SystemdError, match="NoSuchUnit"):
            await systemd.freeze_unit("gone.service")
        assert calls[:4] == [
            ("FreezeUnit", MANAGER_PATH, ["a.service"]),
            ("ThawUnit", MANAGER_PATH, ["a.service"]),
            ("Get", unit_path("a.service"), [UNIT, "FreezerState"]),
            ("GetUnitProcesses", MANAGER_PATH, ["a.service"]),
        ]

    run(body)


def test_more_calls_at_once_than_the_bus_lets_pending_all_get_their_answers(
    bus_address: str,
) -> None:
    """200 starts queued at once each ask systemd something: the bus refuses a connection's
    calls beyond 128 pending (max_replies_per_connection), so the adapter keeps at most
    MAX_CALLS_IN_FLIGHT in flight and the rest wait their turn."""

    async def body() -> None:
        owner = await connect(bus_address)
        held: list[Message] = []
        most = 0

        def answer(msg: Message) -> bool:
            nonlocal most
            if msg.message_type is not MessageType.METHOD_CALL or msg.member != "ListUnitsByNames":
                return False
            held.append(msg)  # answered later, all at once: they pile up pending meanwhile
            most = max(most, len(held))
            return True

        owner.add_message_handler(answer)
        await owner.request_name(SYSTEMD)
        systemd = Systemd(await connect(bus_address))
        calls = [asyncio.ensure_future(systemd.unit_state(f"u{i}.service")) for i in range(200)]
        while not all(c.done() for c in calls):
            await asyncio.sleep(0.02)
            for msg in held:
                name = msg.body[0][0]
                row = [name, "", "loaded", "inactive", "dead", "", unit_path(name), 0, "", "/"]
                owner.send(Message.new_method_return(msg, "a(ssssssouso)", [[row]]))
            held.clear()
        states = [c.result() for c in calls]
        assert [s.name for s in states] == [f"u{i}.service" for i in range(200)]
        assert 0 < most <= MAX_CALLS_IN_FLIGHT  # as many as arrived between two answers

    run(body)


def test_a_bus_daemon_that_stops_reading_for_a_while_costs_no_connection(
    bus_daemon: tuple[str, subprocess.Popen[bytes]],
) -> None:
    """With the bus daemon stopped, what the controller sends fills its socket's buffer; the
    connection waits until it can write again (dbus-next alone would drop it on EAGAIN)."""
    address, daemon = bus_daemon

    async def body() -> None:
        owner = await fake_systemd(address)
        systemd = Systemd(await connect(address))
        await sync(systemd.bus)
        daemon.send_signal(signal.SIGSTOP)
        try:
            for i in range(3000):  # ~1 MB: more than a socket's send buffer
                systemd.bus.send(flood(f"{'x' * 250}-{i}"))
            await asyncio.sleep(0.3)
            assert systemd.bus.connected
        finally:
            daemon.send_signal(signal.SIGCONT)
        await sync(systemd.bus)  # everything queued went out, then the round trip
        assert systemd.bus.connected
        await systemd.freeze_unit("a.service")  # and calls are still answered
        assert owner.connected

    run(body)


def flood(text: str) -> Message:
    """A signal nobody listens to: the bus daemon drops it, no process has to read it."""
    return Message.new_signal("/org/gpuslice/Test", "org.gpuslice.Test", "Flood", "s", [text])


def test_a_job_call_leaves_when_made_and_the_rest_in_turn(bus_address: str) -> None:
    """StopUnit/StartUnit are sent as they are made, before anyone awaits their answer
    (the decision's turn of the loop, issue 10); with MAX_CALLS_IN_FLIGHT in flight, the
    next waits for an answer, and a caller that gives up its turn (cancelled) passes it
    on; every place is given back once its answer is read."""

    async def body() -> None:
        held: list[Message] = []
        owner = await queuing_systemd(bus_address, held)
        systemd = Systemd(await connect(bus_address))
        first = systemd.stop_unit("a.service")
        while not held:  # nobody awaits `first`: it left anyway
            await asyncio.sleep(0.01)
        assert held[0].member == "StopUnit"
        fill = [
            asyncio.ensure_future(systemd.stop_unit(f"u{i}.service"))
            for i in range(MAX_CALLS_IN_FLIGHT - 1)
        ]
        await until_true(lambda: systemd._calls.free == 0)  # each place taken
        late = asyncio.ensure_future(systemd.start_unit("late.service"))
        given_up = asyncio.ensure_future(systemd.start_unit("given-up.service"))
        await until_true(lambda: len(held) >= MAX_CALLS_IN_FLIGHT)
        await sync(systemd.bus)  # what it sent before is routed to the owner,
        await sync(owner)  # and read there (a fixed 0.2 s was too short under load)
        assert len(held) == MAX_CALLS_IN_FLIGHT  # the two wait for a place
        given_up.cancel()
        owner.send(Message.new_method_return(held[0], "o", [JOB]))
        assert await first == JOB
        while len(held) < MAX_CALLS_IN_FLIGHT + 1:
            await asyncio.sleep(0.01)
        assert [m.body[0] for m in held[MAX_CALLS_IN_FLIGHT:]] == ["late.service"]
        for msg in held[1:]:
            owner.send(Message.new_method_return(msg, "o", [JOB]))
        assert await late == JOB
        assert await asyncio.gather(*fill) == [JOB] * len(fill)
        assert given_up.cancelled()
        assert systemd._calls.free == MAX_CALLS_IN_FLIGHT

    run(body)


def test_a_units_invocation_id_is_read_as_the_gate_sees_it(bus_address: str) -> None:
    """Systemd.invocation: the 16 bytes systemd gives, hex as in $INVOCATION_ID; None for a
    unit that never ran (no bytes)."""
    ids = {unit_path("a.service"): bytes(range(16)), unit_path("b.service"): b""}

    async def scenario() -> None:
        def answer(msg: Message) -> Message | bool:
            if (
                msg.interface == PROPERTIES
                and msg.member == "Get"
                and msg.body
                == [
                    UNIT,
                    "InvocationID",
                ]
            ):
                return Message.new_method_return(msg, "v", [Variant("ay", ids[msg.path])])
            return False

        await owning_systemds_name(bus_address, answer)
        systemd = Systemd(await connect(bus_address))
        assert await systemd.invocation("a.service") == bytes(range(16)).hex()
        assert await systemd.invocation("b.service") is None

    run(scenario)


def test_how_a_services_main_process_ended_is_read_from_its_own_object(bus_address: str) -> None:
    """Systemd.main_exit: ExecMainCode=, ExecMainStatus= and Result= of the Service interface,
    read on the unit's object; a reply of another form than systemd's (here a Result= that is
    not a string) is a SystemdError, which the controller takes for no record."""
    record = {"ExecMainCode": Variant("i", 2), "ExecMainStatus": Variant("i", 15)}
    results = {
        unit_path("a.service"): Variant("s", "success"),
        unit_path("b.service"): Variant("u", 1),
    }
    asked: list[tuple[str, list[Any]]] = []

    async def scenario() -> None:
        def answer(msg: Message) -> Message:
            interface, prop = msg.body
            if interface != SERVICE:
                return Message.new_error(msg, "org.freedesktop.DBus.Error.UnknownProperty", prop)
            value = results[msg.path] if prop == "Result" else record[prop]
            return Message.new_method_return(msg, "v", [value])

        systemd = await answering_gets(bus_address, asked, answer)
        main = await systemd.main_exit("a.service")
        assert (main.code, main.status, main.result) == (2, 15, "success")
        with pytest.raises(SystemdError, match="BadReply"):
            await systemd.main_exit("b.service")

    run(scenario)
    path = unit_path("a.service")
    assert asked[:3] == [
        (path, [SERVICE, "ExecMainCode"]),
        (path, [SERVICE, "ExecMainStatus"]),
        (path, [SERVICE, "Result"]),
    ]


def test_the_units_whose_stop_stops_a_unit_are_read_from_its_own_object(
    bus_address: str,
) -> None:
    """Systemd.needs: Requires=, BindsTo= and PartOf= of the Unit interface, on the unit's
    object (Controller._stopped_with asks them of a unit held while gpuslice stopped
    another); a reply of another form than systemd's (as) is gpuslice's BadReply."""
    values = {
        unit_path("c.service"): {
            "Requires": Variant("as", ["b.service"]),
            "BindsTo": Variant("as", []),
            "PartOf": Variant("as", ["x.target", "y.service"]),
        },
        unit_path("d.service"): {
            "Requires": Variant("as", []),
            "BindsTo": Variant("s", "b.service " * 10),  # said up to 80 characters
            "PartOf": Variant("as", []),
        },
    }
    asked: list[tuple[str, list[Any]]] = []

    async def scenario() -> None:
        def answer(msg: Message) -> Message:
            interface, prop = msg.body
            if interface != UNIT:
                return Message.new_error(msg, "org.freedesktop.DBus.Error.UnknownProperty", prop)
            return Message.new_method_return(msg, "v", [values[msg.path][prop]])

        systemd = await answering_gets(bus_address, asked, answer)
        assert await systemd.needs("c.service") == {
            "Requires": ["b.service"],
            "BindsTo": [],
            "PartOf": ["x.target", "y.service"],
        }
        with pytest.raises(SystemdError) as raised:
            await systemd.needs("d.service")
        wrong = repr(values[unit_path("d.service")]["BindsTo"])
        assert len(wrong) > 81
        assert (raised.value.name, raised.value.text) == (
            "org.gpuslice.Error.BadReply",
            f"BindsTo of d.service: {wrong[:80]}",
        )

    run(scenario)
    path = unit_path("c.service")
    assert asked[:3] == [
        (path, [UNIT, "Requires"]),
        (path, [UNIT, "BindsTo"]),
        (path, [UNIT, "PartOf"]),
    ]


def test_the_units_a_stop_of_a_unit_stops_are_read_from_its_own_object(
    bus_address: str,
) -> None:
    """Systemd.needed_by: RequiredBy=, BoundBy= and ConsistsOf= of the Unit interface, on the
    unit's object (Calls._jobs_need asks them of a victim whose stop was refused for its own
    start); a reply of another form than systemd's (as) is gpuslice's BadReply."""
    values = {
        unit_path("b.service"): {
            "RequiredBy": Variant("as", ["d.service"]),
            "BoundBy": Variant("as", []),
            "ConsistsOf": Variant("as", ["e.service"]),
        },
        unit_path("x.service"): {
            "RequiredBy": Variant("u", 7),
            "BoundBy": Variant("as", []),
            "ConsistsOf": Variant("as", []),
        },
    }
    asked: list[tuple[str, list[Any]]] = []

    async def scenario() -> None:
        def answer(msg: Message) -> Message:
            _, prop = msg.body
            return Message.new_method_return(msg, "v", [values[msg.path][prop]])

        systemd = await answering_gets(bus_address, asked, answer)
        assert await systemd.needed_by("b.service") == {
            "RequiredBy": ["d.service"],
            "BoundBy": [],
            "ConsistsOf": ["e.service"],
        }
        with pytest.raises(SystemdError) as raised:
            await systemd.needed_by("x.service")
        assert raised.value.name == "org.gpuslice.Error.BadReply"
        assert raised.value.text.startswith("RequiredBy of x.service: ")

    run(scenario)
    path = unit_path("b.service")
    assert asked[:3] == [
        (path, [UNIT, "RequiredBy"]),
        (path, [UNIT, "BoundBy"]),
        (path, [UNIT, "ConsistsOf"]),
    ]


def test_a_services_task_count_is_read_from_its_own_object(bus_address: str) -> None:
    """Systemd.tasks_current: TasksCurrent of the Service interface, on the unit's object;
    UINT64_MAX (systemd does not know it) is None, not 18 quintillion tasks left; a reply of
    another form is gpuslice's BadReply naming the unit and (its first 80 characters) what
    came, and an error (a unit of another type) is a SystemdError too."""
    values = {
        unit_path("a.service"): Variant("t", 0),
        unit_path("b.service"): Variant("t", 7),
        unit_path("c.service"): Variant("t", 2**64 - 1),
        unit_path("d.service"): Variant("u", 7),
        unit_path("f.service"): Variant("s", "x" * 200),  # said up to 80 characters
    }
    asked: list[tuple[str, list[Any]]] = []

    async def scenario() -> None:
        def answer(msg: Message) -> Message:
            if msg.body != [SERVICE, "TasksCurrent"] or msg.path not in values:
                return Message.new_error(msg, "org.freedesktop.DBus.Error.UnknownProperty", "no")
            return Message.new_method_return(msg, "v", [values[msg.path]])

        systemd = await answering_gets(bus_address, asked, answer)
        assert await systemd.tasks_current("a.service") == 0
        assert await systemd.tasks_current("b.service") == 7
        assert await systemd.tasks_current("c.service") is None
        for name in ("d.service", "f.service"):  # gpuslice's BadReply, naming what came
            with pytest.raises(SystemdError) as raised:
                await systemd.tasks_current(name)
            wrong = repr(values[unit_path(name)])
            assert (raised.value.name, raised.value.text) == (
                "org.gpuslice.Error.BadReply",
                f"TasksCurrent of {name}: {wrong[:80]}",
            )
        assert len(wrong) > 81
        with pytest.raises(SystemdError, match="UnknownProperty"):
            await systemd.tasks_current("e.mount")

    run(scenario)
    assert asked == [
        (unit_path(name), [SERVICE, "TasksCurrent"])
        for name in ("a.service", "b.service", "c.service", "d.service", "f.service", "e.mount")
    ]


def test_a_services_exec_start_pre_is_read_and_a_restart_asked_of_the_manager(
    bus_address: str,
) -> None:
    """Systemd.exec_start_pre: each command's path and argv from the Service interface's
    ExecStartPre (a(sasbttttuii)), on the unit's object; a reply of another form is a
    SystemdError. Systemd.try_restart_unit: TryRestartUnit with mode replace, the job's
    path."""
    gate = "/usr/lib/gpuslice/gpuslice-gate"
    argv = [gate, "a.service", "0.5", "/run/gpuslice/gate/a.service"]
    commands = [
        [gate, argv, False, 0, 0, 0, 0, 4242, 0, 0],
        ["/bin/touch", ["/bin/touch", "/tmp/x"], True, 0, 0, 0, 0, 0, 0, 0],
    ]
    values = {
        unit_path("a.service"): Variant("a(sasbttttuii)", commands),
        unit_path("b.service"): Variant("as", ["/bin/touch"]),
    }
    calls: list[tuple[str, str, list[Any]]] = []

    async def scenario() -> None:
        def answer(msg: Message) -> Message | bool:
            if msg.message_type is not MessageType.METHOD_CALL:
                return False
            calls.append((msg.path or "", msg.member or "", list(msg.body)))
            if msg.interface == MANAGER and msg.member == "TryRestartUnit":
                return Message.new_method_return(msg, "o", [JOB])
            if msg.interface != PROPERTIES or msg.member != "Get":
                return False
            return Message.new_method_return(msg, "v", [values[msg.path]])

        await owning_systemds_name(bus_address, answer)
        systemd = Systemd(await connect(bus_address))
        assert await systemd.exec_start_pre("a.service") == [
            (gate, argv),
            ("/bin/touch", ["/bin/touch", "/tmp/x"]),
        ]
        with pytest.raises(SystemdError, match="BadReply"):
            await systemd.exec_start_pre("b.service")
        assert await systemd.try_restart_unit("a.service") == JOB

    run(scenario)
    assert calls == [
        (unit_path("a.service"), "Get", [SERVICE, "ExecStartPre"]),
        (unit_path("b.service"), "Get", [SERVICE, "ExecStartPre"]),
        ("/org/freedesktop/systemd1", "TryRestartUnit", ["a.service", "replace"]),
    ]


def test_a_stop_is_asked_in_mode_fail_and_in_mode_replace_only_when_asked_so(
    bus_address: str,
) -> None:
    """Systemd.stop_unit: StopUnit in mode "fail", so that systemd refuses a stop that would
    cancel another unit's job (the start of a unit that `Requires=` this one: a preemption
    for it cancelled it); every refusal is the caller's, one for the unit's own job too
    (`refused_for_own_job`: sent again in mode "replace", it cancelled the start of the
    waiter it was for where that needs the unit, Calls._over_own_job).
    Systemd.stop_unit_replacing asks mode "replace"."""
    destructive = "org.freedesktop.systemd1.TransactionIsDestructive"
    text = (
        "Transaction for {0}/stop is destructive ({1} has 'start' job queued, but 'stop' is"
        " included in transaction)."
    )
    conflicts = {"a.service": "a.service", "b.service": "c.service"}
    calls: list[list[Any]] = []

    async def scenario() -> None:
        def answer(msg: Message) -> Message | bool:
            if msg.message_type is not MessageType.METHOD_CALL:
                return False
            if msg.member == "Subscribe":  # else nobody is told of a job as it is queued
                return Message.new_method_return(msg)
            if msg.member != "StopUnit":
                return False
            calls.append(list(msg.body))
            name, mode = msg.body
            if mode == "fail" and name in conflicts:
                return Message.new_error(msg, destructive, text.format(name, conflicts[name]))
            return Message.new_method_return(msg, "o", [JOB])

        await owning_systemds_name(bus_address, answer)
        systemd = Systemd(await connect(bus_address))
        await systemd.subscribe()
        told: list[str] = []
        with pytest.raises(SystemdError) as own:
            await systemd.stop_unit("a.service", told.append)
        assert refused_for_own_job(own.value, "a.service")
        assert told == []
        assert await systemd.stop_unit_replacing("a.service", told.append) == JOB
        assert told == [JOB]
        with pytest.raises(SystemdError) as refused:
            await systemd.stop_unit("b.service", told.append)
        assert (refused.value.name, refused.value.text) == (
            destructive,
            text.format("b.service", "c.service"),
        )
        assert not refused_for_own_job(refused.value, "b.service")
        assert not refused_for_own_job(refused.value, "c.service")  # named, not stopped
        assert await systemd.stop_unit("d.service") == JOB

    run(scenario)
    assert calls == [
        ["a.service", "fail"],
        ["a.service", "replace"],
        ["b.service", "fail"],
        ["d.service", "fail"],
    ]
