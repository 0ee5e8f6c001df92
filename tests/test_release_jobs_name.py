"""`gpuslice release-jobs` holds the controller's bus name while it acts, on a real, private
dbus-daemon: the name every controller claims before it reads or writes anything
(Controller.start) is the lock both honour. Without it, a controller started while
release-jobs resumed a unit (`systemctl start gpuslice` beside a release-jobs run by hand)
loaded the state from before, took the unit for suspended still, and granted its GPU to
another job: two jobs on one GPU. Such a controller waits for the name, told by its owner
(RELEASING), no longer than RELEASE_WAIT; one whose name another controller holds is refused
at once. systemctl, the state and the resume are stand-ins (tests/release_jobs_standins.py)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from dbus_next import Message, MessageType
from dbus_next.aio import MessageBus
from dbus_next.constants import BusType, NameFlag

from gpuslice import cli as cli_module
from gpuslice import service as service_module
from gpuslice.checkpoint import CheckpointError, CheckpointSettings, Resumed
from gpuslice.core.scheduler import SavedState
from gpuslice.service import (
    BUS_NAME,
    INTERFACE,
    OBJECT_PATH,
    RELEASING,
    NameTaken,
    SchedulerService,
    answer_releasing,
)
from gpuslice.state import StateStore
from gpuslice.systemd import close_bus
from tests.release_jobs_standins import release_jobs, systemctl_and_resume
from tests.test_dbus_adapter import bus_address as bus_address
from tests.test_dbus_adapter import bus_daemon as bus_daemon
from tests.test_release_jobs_resume import _systemd_started, _this_boot

SUSPENDED = SavedState(suspended={"train.service": ((1,), 4)})
SHOWN = {"train.service": ("active", "frozen")}


async def _claim(address: str, waited: list[int] | None = None) -> str:
    """What a controller starting now is told when it claims its name (the controller's own
    SchedulerService.claim_name, which waits while release-jobs holds it, each PID it waited
    for added to `waited`), on a connection closed again at once: "claimed", or why not."""
    bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()
    try:
        service = SchedulerService(bus, lambda unit, sender: None, str, lambda: None)
        await service.claim_name((waited if waited is not None else []).append)
        return "claimed"
    except NameTaken as e:
        return str(e)
    finally:
        bus.disconnect()
        await bus.wait_for_disconnect()
        close_bus(bus)


class Claiming(threading.Thread):
    """A controller starting now, in a thread of its own (release-jobs blocks this one):
    `_claim`'s answer once it has one, and the PIDs it waited for meanwhile."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.waited: list[int] = []
        self.answer: str | None = None
        self.took = 0.0  # seconds until it had its answer

    def run(self) -> None:
        began = time.monotonic()
        self.answer = asyncio.run(_claim(self.address, self.waited))
        self.took = time.monotonic() - began


async def _acquire(address: str) -> tuple[MessageType, str | None]:
    """What a gate's Acquire sent to the controller's name now is answered with, and its
    error's name (within 10 s: a gate's dbus-send waits ~24 days)."""
    bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()
    try:
        call = Message(
            destination=BUS_NAME,
            path=OBJECT_PATH,
            interface=INTERFACE,
            member="Acquire",
            signature="s",
            body=["train.service"],
        )
        reply = await asyncio.wait_for(bus.call(call), 10)
        assert reply is not None
        return reply.message_type, reply.error_name
    finally:
        bus.disconnect()
        await bus.wait_for_disconnect()
        close_bus(bus)


def _stand_in(monkeypatch: pytest.MonkeyPatch, address: str) -> None:
    """release-jobs on SUSPENDED, of this boot, with the private bus as its system bus."""
    monkeypatch.setenv("GPUSLICE_BUS_ADDRESS", address)
    monkeypatch.setattr(StateStore, "load", lambda self: (SUSPENDED, _this_boot()))
    monkeypatch.setattr(StateStore, "saved_since", lambda self: None)
    _systemd_started(monkeypatch)


def test_a_controller_started_while_release_jobs_resumes_waits_for_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bus_address: str
) -> None:
    """While release-jobs resumes a unit, a controller that starts is refused its name, and
    waits for it (having loaded nothing, Controller.start), told release-jobs' PID; a gate
    that asks is answered at once (RELEASING: it asks again, as for a stopped controller).
    Once release-jobs ends, the waiting controller has its name. Before, it exited 1 at
    once, and under systemd Restart= retried it into the start limit: gpuslice.service
    stayed failed after release-jobs ended, every gated start waiting."""
    _stand_in(monkeypatch, bus_address)
    done, _ = systemctl_and_resume(monkeypatch, SHOWN)
    claiming = Claiming(bus_address)
    seen: list[object] = []
    stand_in = cli_module._resume_left

    def resume_left(
        unit: str, settings: CheckpointSettings, pids: Sequence[int] | None = None
    ) -> Resumed | CheckpointError:
        claiming.start()
        deadline = time.monotonic() + 10
        while len(claiming.waited) < 2 and claiming.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        seen.append(claiming.answer)  # none yet: it waits
        seen.append(asyncio.run(_acquire(bus_address)))
        return stand_in(unit, settings, pids)

    monkeypatch.setattr(cli_module, "_resume_left", resume_left)
    stderr = release_jobs(tmp_path, "")
    claiming.join(10)
    assert done == [("resume", "train.service")]
    assert "resumed" in stderr
    assert seen == [None, (MessageType.ERROR, RELEASING)]
    assert claiming.answer == "claimed"
    assert len(claiming.waited) >= 2
    assert set(claiming.waited) == {os.getpid()}  # release-jobs ran in this process
    assert asyncio.run(_claim(bus_address)) == "claimed"


def test_a_controller_that_finds_its_name_held_by_another_controller_exits_at_once(
    bus_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second controller (one run by hand beside gpuslice.service) does not wait: its
    owner answers as a controller does (here its Status, while it starts up), and the
    claim is refused at once, as before, with the bus daemon's word. So is one whose owner
    is not gpuslice's at all (answers nothing of ours: UnknownMethod)."""

    # a retry waits an hour: the test's 30 s fail it. Timed instead (under 4 CLAIM_RETRY),
    # a claim made at once failed if a loaded machine's bus daemon answered it late
    monkeypatch.setattr(service_module, "CLAIM_RETRY", 3600.0)

    async def scenario() -> tuple[list[str], list[int]]:
        answers: list[str] = []
        waited: list[int] = []
        bus = await MessageBus(bus_address=bus_address, bus_type=BusType.SYSTEM).connect()
        try:
            await bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
            answers.append(await _claim(bus_address, waited))  # a bare owner
            SchedulerService(bus, lambda unit, sender: None, str, lambda: None)
            answers.append(await _claim(bus_address, waited))  # a controller: its Status
            return answers, waited
        finally:
            bus.disconnect()
            await bus.wait_for_disconnect()
            close_bus(bus)

    answers, waited = asyncio.run(asyncio.wait_for(scenario(), 30))
    refused = (
        f"{BUS_NAME} is owned by another process (EXISTS): another gpuslice controller runs "
        "(systemctl status gpuslice), or `gpuslice release-jobs` releases the units of a "
        "stopped one (apt remove)"
    )
    assert answers == [refused, refused]
    assert waited == []  # and at once: not one retry each


def test_a_controller_waits_for_release_jobs_no_longer_than_release_wait(
    monkeypatch: pytest.MonkeyPatch, bus_address: str
) -> None:
    """A release-jobs that never lets go (hung) is waited for RELEASE_WAIT, not for ever:
    then the claim is refused, saying so, and the controller exits 1 (Restart= starts it
    again, to wait once more: each try lasts RELEASE_WAIT, far from the start limit)."""
    monkeypatch.setattr(service_module, "RELEASE_WAIT", 1.0)
    monkeypatch.setattr(service_module, "CLAIM_RETRY", 0.1)
    claiming = Claiming(bus_address)

    async def scenario() -> None:
        bus = await MessageBus(bus_address=bus_address, bus_type=BusType.SYSTEM).connect()
        try:
            bus.add_message_handler(answer_releasing)  # as release-jobs' own connection
            await bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
            claiming.start()
            await asyncio.to_thread(claiming.join, 10)
        finally:
            bus.disconnect()
            await bus.wait_for_disconnect()
            close_bus(bus)

    asyncio.run(scenario())
    assert claiming.answer == (
        f"{BUS_NAME} is still held by `gpuslice release-jobs` (PID {os.getpid()}) after 1 s"
    )
    assert 1.0 <= claiming.took < 5.0
    assert 2 <= len(claiming.waited) <= 12  # every CLAIM_RETRY, as the machine allows
    assert set(claiming.waited) == {os.getpid()}


def test_a_controller_that_holds_its_name_keeps_its_units(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bus_address: str
) -> None:
    """A controller that started after release-jobs looked at gpuslice.service (shown
    inactive) holds its name: it loaded the state, and the units are its own; none is
    resumed behind its back, and the state is not saved over."""
    _stand_in(monkeypatch, bus_address)
    done, _ = systemctl_and_resume(monkeypatch, SHOWN)
    saves: list[object] = []
    monkeypatch.setattr(StateStore, "save", lambda self, *a: saves.append(a))

    async def scenario() -> str:
        bus = await MessageBus(bus_address=bus_address, bus_type=BusType.SYSTEM).connect()
        try:
            await bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
            return await asyncio.to_thread(release_jobs, tmp_path, "")
        finally:
            bus.disconnect()
            await bus.wait_for_disconnect()
            close_bus(bus)

    stderr = asyncio.run(scenario())
    assert done == []
    assert saves == []
    assert stderr.splitlines() == [
        f"gpuslice release-jobs: {BUS_NAME} is owned by another process, a controller "
        "started meanwhile: its units are left to it"
    ]


def test_without_a_bus_release_jobs_acts_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No bus socket: no controller can claim its name either; the units are released, and
    no socket is left open (dbus-next leaks the one of a failed connect)."""
    _stand_in(monkeypatch, f"unix:path={tmp_path}/no-bus")
    done, _ = systemctl_and_resume(monkeypatch, SHOWN)
    release_jobs(tmp_path, "")
    assert done == [("resume", "train.service")]


def test_a_controller_waits_longer_than_release_jobs_starts_resumes() -> None:
    """RELEASE_WAIT outlasts release-jobs' RELEASE_DEADLINE (no resume starts after it) with
    room for the one under way and its save: a controller that gave up first exited 1 while
    release-jobs still held the name (Restart= then waited again, but said it failed)."""
    assert service_module.RELEASE_WAIT >= cli_module.RELEASE_DEADLINE + 20
