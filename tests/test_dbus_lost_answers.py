"""Answers to the controller's own calls that never come (gpuslice/systemd.py, CALL_TIMEOUT),
on a real, private dbus-daemon as in tests/test_dbus_adapter.py.

The bus daemon drops any message for a connection whose queue is full, the answers to our
calls included, and says nothing; the system bus never times a call out. Anyone may fill the
controller's queue: the policy lets every user call Status, as often as they like.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dbus_next import Message, MessageFlag

from gpuslice import systemd as systemd_module
from gpuslice.service import BUS_NAME, INTERFACE, OBJECT_PATH, SchedulerService
from gpuslice.systemd import (
    MAX_CALLS_IN_FLIGHT,
    NO_REPLY,
    Systemd,
    SystemdError,
    is_transient,
)
from tests.test_dbus_adapter import (
    JOB,
    _bus_daemon,
    adapter,
    connect,
    properties_changed,
    queuing_systemd,
    run,
    sync,
)
from tests.test_dbus_adapter import bus_address as bus_address
from tests.test_dbus_adapter import bus_daemon as bus_daemon

LIMITS = '\n  <limit name="max_outgoing_bytes">100000</limit>'


@contextlib.contextmanager
def lost_within(monkeypatch: pytest.MonkeyPatch, seconds: float) -> Iterator[None]:
    """CALL_TIMEOUT is `seconds` for the calls sent meanwhile, the one whose answer is lost:
    the set-up's calls wait as long as the controller's do. With the short bound for all, a
    bus daemon 0.3 s late (stopped for that long, as a loaded host may leave it) failed the
    subscription, and the test, before its call was sent."""
    with monkeypatch.context() as patch:
        patch.setattr(systemd_module, "CALL_TIMEOUT", seconds)
        yield


def _big_status() -> Message:
    """A user's Status call, refused unread (busread.MAX_CALL_BODY), asking for no answer:
    5 KB of the controller's queue in the bus daemon for one message read."""
    return Message(
        destination=BUS_NAME,
        path=OBJECT_PATH,
        interface=INTERFACE,
        member="Status",
        flags=MessageFlag.NO_REPLY_EXPECTED,
        signature="ay",
        body=[bytes(5000)],
    )


def test_a_call_whose_answer_never_comes_fails_as_unanswered_and_gives_its_place_back(
    bus_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call with no answer within CALL_TIMEOUT fails as unanswered, a transient error (a
    job call is sent again), its place among MAX_CALLS_IN_FLIGHT given back and nobody told
    of a job; an answer that comes after all changes nothing. It waited for ever before."""

    async def scenario() -> None:
        held: list[Message] = []
        owner = await queuing_systemd(bus_address, held)  # takes StopUnit, never answers it
        systemd = Systemd(await connect(bus_address))
        await systemd.subscribe()
        told: list[str] = []
        with lost_within(monkeypatch, 0.2), pytest.raises(SystemdError) as lost:
            await asyncio.wait_for(systemd.stop_unit("a.service", told.append), 10)
        assert lost.value.name == NO_REPLY and is_transient(lost.value)
        assert systemd._calls.free == MAX_CALLS_IN_FLIGHT
        assert systemd._told == {}
        assert held[0].serial not in systemd.bus._method_return_handlers
        owner.send(Message.new_method_return(held[0], "o", [JOB]))  # late: dropped
        await sync(owner)
        await sync(systemd.bus)
        assert told == []
        assert await systemd.check_owner() is False  # the connection serves on

    run(scenario)


def test_answers_a_users_flood_of_status_calls_made_the_bus_daemon_drop_fail_in_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's Status calls fill the controller's queue in the bus daemon; the answer to
    the controller's own call then comes while it is full, and the bus daemon drops it. The
    audit's question of who owns systemd's name (or a gate's caller_pid, a StopUnit, ...)
    waited for ever, its place held: the audit never came again, and once 64 were lost the
    controller sent no call at all. It fails as unanswered now, once the flood is read."""
    daemon = _bus_daemon(tmp_path, LIMITS)
    address, _ = next(daemon)

    async def scenario() -> None:
        await queuing_systemd(address)
        systemd = Systemd(await connect(address))
        await systemd.subscribe()
        service = SchedulerService(systemd.bus, lambda u, s: None, lambda: "{}", lambda: None)
        await service.claim_name()
        user = Systemd(await connect(address)).bus  # its writer waits when the bus lags
        loop = asyncio.get_running_loop()
        loop.remove_reader(systemd.bus._fd)  # its loop is busy: the user's calls pile up
        for _ in range(200):  # 1 MB: past the socket's buffer and the daemon's 100 KB
            user.send(_big_status())
        await sync(user)  # all routed, those past the limit dropped: the queue is full
        with lost_within(monkeypatch, 0.5):
            asked = asyncio.ensure_future(systemd.check_owner())  # its answer is dropped
            await asyncio.sleep(0.1)
            loop.add_reader(systemd.bus._fd, systemd.bus._message_reader)
            with pytest.raises(SystemdError) as lost:
                await asyncio.wait_for(asked, 10)
        assert lost.value.name == NO_REPLY
        assert systemd._calls.free == MAX_CALLS_IN_FLIGHT
        assert await systemd.check_owner() is False  # the flood read, calls answered again

    try:
        run(scenario)
    finally:
        daemon.close()


def test_a_match_rule_whose_answer_was_lost_is_taken_back_with_the_change(
    bus_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bus daemon adds a rule, then drops its answer: the change of the units matched
    fails as unanswered, and that rule goes with the others (all or none), not left in place
    unrecorded, where it would bring that unit's signals for good and count against the
    daemon's 512 rules at each such loss."""

    async def scenario() -> None:
        systemd, owner, seen = await adapter(bus_address)
        real = systemd._add_match
        lost: list[str] = []

        async def add_match(rule: str) -> None:
            await real(rule)
            if "b_2eservice" in rule and not lost:
                lost.append(rule)
                raise SystemdError(NO_REPLY, "no answer")

        monkeypatch.setattr(systemd, "_add_match", add_match)
        with pytest.raises(SystemdError):
            await systemd.watch({"a.service", "b.service", "marker.service"})
        assert lost
        assert await systemd.watch({"a.service", "marker.service"}) == []
        owner.send(properties_changed("b.service", "active"))
        owner.send(properties_changed("a.service", "active"))
        units: list[Any] = [e[1] for e in await seen.after(owner) if e[0] == "unit"]
        assert units == ["a.service"]

    run(scenario)
