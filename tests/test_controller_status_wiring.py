"""The Status a caller gets over the bus from the SchedulerService the controller builds for
itself (no `service=` given, as gpuslice's main runs it): where /proc hides other users'
processes (`hidepid=`), the answer for that caller (README: "Security model").

The other tests hand the controller a FakeService and ask its status_for directly, or
(tests/test_controller_startup.py) let it build its service where /proc hides nothing: a
controller that built its service without `on_status_for` answered every caller with
`on_status`, every user's processes, and no test saw it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
from dbus_next import MessageType
from dbus_next.constants import NameFlag, RequestNameReply

from gpuslice.controller import Controller
from gpuslice.inventory import Inventory
from gpuslice.service import BUS_NAME, SchedulerService
from gpuslice.systemd import Systemd
from tests.service_bus import ServiceBus
from tests.test_controller import GIB, run
from tests.test_status_privacy import Credentials, _foreign_bed, _turns, status_call


class NamedBus(ServiceBus):
    """The stand-in bus, which also gives the controller its name (claim_name)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    async def request_name(self, name: str, flags: NameFlag) -> RequestNameReply:
        self.names.append(name)
        return RequestNameReply.PRIMARY_OWNER


def _controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Controller, NamedBus, Credentials]:
    """tests/test_status_privacy.py's bed (/proc mounted hidepid=invisible,gid=27, user
    1000's process on GPU 1; callers :1.2 root, :1.3 in group 27, :1.5 user 1002), and a
    controller over its fakes that builds its own service on a stand-in bus (the bed's
    own controller, on a FakeService, is left unused)."""
    bed = _foreign_bed(tmp_path, monkeypatch, "rw,hidepid=invisible,gid=27")
    bus = NamedBus()
    bed.systemd.bus = bus  # type: ignore[attr-defined]
    inventory = Inventory(
        bed.config, nvml=bed.nvml, proc=tmp_path / "proc", driver_root=tmp_path / "no-nvidia"
    )
    controller = Controller(
        bed.config,
        tmp_path / "config.yaml",
        cast(Systemd, bed.systemd),
        root=str(tmp_path / "root"),
        inventory=inventory,
    )
    return controller, bus, bed.systemd.caller_credentials  # type: ignore[attr-defined]


async def _status_over_the_bus(bus: NamedBus, sender: int) -> dict[str, Any]:
    """Status called from the unique name `:1.<sender>`: the answer the service sent."""
    sent = len(bus.sent)
    assert bus.deliver(status_call(sender)) is True  # answered by the service itself
    await _turns()  # the bus daemon is asked who calls (Credentials), then it is sent
    [reply] = bus.sent[sent:]
    assert reply.message_type is MessageType.METHOD_RETURN
    assert reply.reply_serial == sender
    bus.write()
    data: dict[str, Any] = json.loads(reply.body[0])
    return data


def test_the_controllers_own_service_answers_each_caller_with_what_proc_shows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user gets the redacted answer, asked the first time and known the next;
    root and a member of the mount's gid= group get the whole."""
    controller, bus, credentials = _controller(tmp_path, monkeypatch)
    assert isinstance(controller.service, SchedulerService)

    async def test() -> None:
        await controller.start()
        assert bus.names == [BUS_NAME]
        for _ in range(2):  # the second time the caller is known (gpuslice/callers.py)
            data = await _status_over_the_bus(bus, 5)
            assert data["redacted"] is True
            [foreign] = data["gpus"][1]["foreign"]
            assert (foreign["pid"], foreign["command"], foreign["owner"]) == (
                None,
                None,
                {"kind": "user", "id": None},
            )
            assert foreign["memory"] == GIB
        for sender in (2, 3):
            data = await _status_over_the_bus(bus, sender)
            assert "redacted" not in data, sender
            [foreign] = data["gpus"][1]["foreign"]
            assert (foreign["pid"], foreign["command"], foreign["owner"]["id"]) == (
                200,
                "secret",
                "1000",
            )
        assert credentials.asked == [":1.5", ":1.2", ":1.3"]  # each once

    run(test)
