"""A stand-in for the controller's bus connection as gpuslice.service.SchedulerService uses it
(add_message_handler, send, call): what it sent, each send's future (written to the socket)
pending until the test says it was written, and messages delivered to its handler as dbus-next
does. Its bus daemon answers a call as one without Debug.Stats does (UnknownMethod): the
service asks it no more what it holds (tests/test_status_held.py scripts a daemon that says)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dbus_next import Message

UNKNOWN_METHOD = "org.freedesktop.DBus.Error.UnknownMethod"


class ServiceBus:
    """Records what the service sends; each send's future stays pending until `write`."""

    unique_name = ":1.1"

    def __init__(self) -> None:
        self.handlers: list[Callable[[Message], Message | bool]] = []
        self.sent: list[Message] = []
        self.unwritten: list[asyncio.Future[None]] = []

    def add_message_handler(self, handler: Callable[[Message], Message | bool]) -> None:
        self.handlers.append(handler)

    def send(self, msg: Message) -> asyncio.Future[None]:
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sent.append(msg)
        self.unwritten.append(written)
        return written

    async def call(self, msg: Message) -> Message:
        """The bus daemon's answer: no such method (a dbus-daemon built without Debug.Stats)."""
        msg.serial = msg.serial or 1  # as the bus connection numbers what it sends
        return Message.new_error(msg, UNKNOWN_METHOD, f"no method {msg.member}")

    def write(self, count: int | None = None) -> None:
        """The oldest `count` answers (all by default) are written to the socket."""
        done = self.unwritten[: len(self.unwritten) if count is None else count]
        del self.unwritten[: len(done)]
        for written in done:
            written.set_result(None)

    def deliver(self, msg: Message) -> Message | bool:
        """A message read from the socket, as dbus-next hands it to the handlers."""
        (handler,) = self.handlers
        return handler(msg)
