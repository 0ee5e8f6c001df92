"""`gpuslice release-jobs` holds the controller's bus name while it acts, on a real, private
dbus-daemon: the name every controller claims before it reads or writes anything
(Controller.start) is the lock both honour. Without it, a controller started while
release-jobs resumed a unit (`systemctl start gpuslice` beside a release-jobs run by hand)
loaded the state from before, took the unit for suspended still, and granted its GPU to
another job: two jobs on one GPU. systemctl, the state and the resume are stand-ins
(tests/release_jobs_standins.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from dbus_next import Message, MessageType
from dbus_next.aio import MessageBus
from dbus_next.constants import BusType, NameFlag

from gpuslice import cli as cli_module
from gpuslice.checkpoint import CheckpointError, CheckpointSettings, Resumed
from gpuslice.core.scheduler import SavedState
from gpuslice.service import BUS_NAME, INTERFACE, OBJECT_PATH, NameTaken, SchedulerService
from gpuslice.state import StateStore
from gpuslice.systemd import close_bus
from tests.release_jobs_standins import release_jobs, systemctl_and_resume
from tests.test_dbus_adapter import bus_address as bus_address
from tests.test_dbus_adapter import bus_daemon as bus_daemon
from tests.test_release_jobs_resume import _systemd_started, _this_boot

SUSPENDED = SavedState(suspended={"train.service": ((1,), 4)})
SHOWN = {"train.service": ("active", "frozen")}


async def _claim(address: str) -> str:
    """What a controller starting now is told when it claims its name (the controller's own
    SchedulerService.claim_name), on a connection closed again at once: "claimed", or why
    not."""
    bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()
    try:
        await SchedulerService(bus, lambda unit, sender: None, str, lambda: None).claim_name()
        return "claimed"
    except NameTaken as e:
        return str(e)
    finally:
        bus.disconnect()
        await bus.wait_for_disconnect()
        close_bus(bus)


async def _acquire(address: str) -> MessageType:
    """What a gate's Acquire sent to the controller's name now is answered with (within
    10 s: a gate's dbus-send waits ~24 days)."""
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
        return reply.message_type
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


def test_a_controller_started_while_release_jobs_resumes_is_refused_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bus_address: str
) -> None:
    """While release-jobs resumes a unit, a controller that starts is refused its name (and
    exits having loaded nothing, Controller.start), a gate that asks is answered at once
    (it waits on, as for a stopped controller); once release-jobs ends, the name is free."""
    _stand_in(monkeypatch, bus_address)
    done, _ = systemctl_and_resume(monkeypatch, SHOWN)
    seen: list[object] = []
    stand_in = cli_module._resume_left

    def resume_left(unit: str, settings: CheckpointSettings) -> Resumed | CheckpointError:
        seen.append(asyncio.run(_claim(bus_address)))
        seen.append(asyncio.run(_acquire(bus_address)))
        return stand_in(unit, settings)

    monkeypatch.setattr(cli_module, "_resume_left", resume_left)
    stderr = release_jobs(tmp_path, "")
    assert done == [("resume", "train.service")]
    assert "resumed" in stderr
    assert seen == [
        f"{BUS_NAME} is owned by another process (EXISTS): another gpuslice controller runs "
        "(systemctl status gpuslice), or `gpuslice release-jobs` releases the units of a "
        "stopped one (apt remove)",
        MessageType.ERROR,
    ]
    assert asyncio.run(_claim(bus_address)) == "claimed"


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
