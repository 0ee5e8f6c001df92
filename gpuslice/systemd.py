"""The only module that talks to systemd over D-Bus.

Raw messages rather than introspected proxies: a proxy costs an Introspect round trip per
unit, which matters at a thousand units. D-Bus errors become `SystemdError` here, once.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dbus_next import BusType, Message, MessageFlag, MessageType, Variant
from dbus_next.aio import MessageBus

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
PROPERTIES = "org.freedesktop.DBus.Properties"
UNIT_PATH_PREFIX = "/org/freedesktop/systemd1/unit/"

SHUTDOWN_TARGETS = frozenset(
    {"shutdown.target", "reboot.target", "poweroff.target", "halt.target", "kexec.target"}
)


class SystemdError(Exception):
    """A call to systemd failed; `name` is the D-Bus error name."""

    def __init__(self, name: str, text: str) -> None:
        super().__init__(f"{name}: {text}")
        self.name = name
        self.text = text


@dataclass(frozen=True)
class UnitState:
    """The part of a unit's state the controller decides on."""

    name: str
    active: str
    sub: str
    job_id: int


def unit_path(name: str) -> str:
    """The object path systemd gives a unit (its bus_label_escape)."""
    safe = string.ascii_letters
    out = []
    for i, char in enumerate(name):
        if char in safe or (i > 0 and char in string.digits):
            out.append(char)
        else:
            out.extend(f"_{byte:02x}" for byte in char.encode())
    return UNIT_PATH_PREFIX + ("".join(out) or "_")


def unit_name_from_path(path: str) -> str | None:
    """The inverse of `unit_path`; None for paths that are not unit objects."""
    if not path.startswith(UNIT_PATH_PREFIX):
        return None
    label = path[len(UNIT_PATH_PREFIX) :]
    raw = bytearray()
    i = 0
    while i < len(label):
        if label[i] == "_" and len(label[i + 1 : i + 3]) == 2:
            raw.append(int(label[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.extend(label[i].encode())
            i += 1
    return raw.decode(errors="replace")


def _check(reply: Message | None) -> Message:
    if reply is None:
        raise SystemdError("org.gpuslice.Error.NoReply", "no reply from systemd")
    if reply.message_type == MessageType.ERROR:
        text = reply.body[0] if reply.body else ""
        raise SystemdError(reply.error_name or "unknown", str(text))
    return reply


class Systemd:
    """A connection to the system bus and the systemd manager on it."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        self.on_job_new: Callable[[int, str, str], None] = lambda job_id, path, unit: None
        self.on_job_removed: Callable[[int, str, str, str], None] = lambda i, p, u, r: None
        self.on_unit_changed: Callable[[str, dict[str, Any]], None] = lambda unit, props: None
        self.on_reloading: Callable[[bool], None] = lambda active: None
        bus.add_message_handler(self._dispatch)

    @classmethod
    async def connect(cls, address: str | None = None) -> Systemd:
        bus = MessageBus(bus_address=address, bus_type=BusType.SYSTEM)
        await bus.connect()
        return cls(bus)

    async def call(
        self,
        member: str,
        signature: str = "",
        body: list[Any] | None = None,
        *,
        path: str = MANAGER_PATH,
        interface: str = MANAGER,
    ) -> list[Any]:
        reply = await self.bus.call(
            Message(
                destination=SYSTEMD,
                path=path,
                interface=interface,
                member=member,
                signature=signature,
                body=body or [],
            )
        )
        return list(_check(reply).body)

    async def subscribe(self) -> None:
        """Match the signals we act on, then ask systemd to emit them (supervisor's order)."""
        rules = [
            f"type='signal',sender='{SYSTEMD}',path='{MANAGER_PATH}',interface='{MANAGER}'",
            f"type='signal',sender='{SYSTEMD}',interface='{PROPERTIES}',"
            f"member='PropertiesChanged',path_namespace='/org/freedesktop/systemd1/unit',"
            f"arg0='{UNIT}'",
        ]
        for rule in rules:
            _check(
                await self.bus.call(
                    Message(
                        destination="org.freedesktop.DBus",
                        path="/org/freedesktop/DBus",
                        interface="org.freedesktop.DBus",
                        member="AddMatch",
                        signature="s",
                        body=[rule],
                    )
                )
            )
        await self.call("Subscribe")

    async def list_units(self) -> list[UnitState]:
        (units,) = await self.call("ListUnits")
        return [UnitState(u[0], u[3], u[4], u[7]) for u in units]

    async def unit_state(self, name: str) -> UnitState:
        (props,) = await self.call(
            "GetAll", "s", [UNIT], path=unit_path(name), interface=PROPERTIES
        )
        return UnitState(
            name, props["ActiveState"].value, props["SubState"].value, props["Job"].value[0]
        )

    async def start_unit(self, name: str) -> str:
        (job,) = await self.call("StartUnit", "ss", [name, "replace"])
        return str(job)

    async def restart_preempted(self, name: str) -> str:
        """Start a unit gpuslice itself stopped or holds back, resetting its start rate
        limit first: being preempted five times in ten seconds must not make systemd refuse
        to bring it back. Units that failed are never started this way."""
        # sent, not awaited: StartUnit must follow it at once, before any later StopUnit
        self.bus.send(
            Message(
                destination=SYSTEMD,
                path=MANAGER_PATH,
                interface=MANAGER,
                member="ResetFailedUnit",
                signature="s",
                body=[name],
                flags=MessageFlag.NO_REPLY_EXPECTED,
            )
        )
        return await self.start_unit(name)

    async def stop_unit(self, name: str) -> str:
        (job,) = await self.call("StopUnit", "ss", [name, "replace"])
        return str(job)

    async def boot_id(self) -> str:
        """What changes with every boot: the kernel's boot id and when systemd started.

        The second part matters in containers, which share the host's kernel (and a
        sandboxed service may see the host's boot id even where nspawn gives the container
        its own)."""
        with open("/proc/sys/kernel/random/boot_id") as f:
            kernel = f.read().strip()
        (started,) = await self.call(
            "Get", "ss", [MANAGER, "UserspaceTimestamp"], interface=PROPERTIES
        )
        return f"{kernel}/{started.value}"

    async def system_state(self) -> str:
        (state,) = await self.call("Get", "ss", [MANAGER, "SystemState"], interface=PROPERTIES)
        return str(state.value)

    def _dispatch(self, msg: Message) -> bool:
        if msg.message_type != MessageType.SIGNAL:
            return False
        if msg.member == "PropertiesChanged" and msg.path and msg.body[0] == UNIT:
            name = unit_name_from_path(msg.path)
            if name is not None:
                changed = {
                    k: v.value if isinstance(v, Variant) else v for k, v in msg.body[1].items()
                }
                self.on_unit_changed(name, changed)
        elif msg.interface == MANAGER:
            if msg.member == "JobNew":
                self.on_job_new(msg.body[0], msg.body[1], msg.body[2])
            elif msg.member == "JobRemoved":
                self.on_job_removed(msg.body[0], msg.body[1], msg.body[2], msg.body[3])
            elif msg.member == "Reloading":
                self.on_reloading(bool(msg.body[0]))
        return False
