"""A faster reader for the message that floods the controller: a unit's PropertiesChanged.

dbus-next 0.2.3 reads every message in pure Python and builds a Variant, verified against
its signature, for each of the 22 properties systemd 252 sends with every change of a
unit; the controller reads six of them. Over a burst of 200 starts among 10,000 annotated
units that was 57 % of the controller's CPU (cProfile, issue 10). This reader takes those
signals from the bytes: it keeps the properties asked for and steps over the others by
their lengths. Every other message, and any it cannot take (big-endian, file descriptors,
a property of an unexpected type), is left to dbus-next's reader, which reads the same
bytes again.

The bus daemon checks every message against the D-Bus specification before it routes it;
still, whatever this reader fails on falls back and never raises out of dbus-next's read
loop, which would close the connection.

At most `MAX_PER_TURN` messages are read in one turn of the event loop; the rest wait for
its next turn, after its timers and tasks (the watchdog's among them). dbus-next reads every
message the socket holds in one go: anyone may call Status, and one process's 4 s of calls
(~340,000) kept the controller's loop in that read for 88 s on a 2-core VM, past
WatchdogSec=, after which systemd kills the controller (0.22 s with the limit).

A method call's body longer than any of our methods takes (`MAX_CALL_BODY`) is not read at
all: the call comes with its header only, as `Unread`, and is answered with an error. Anyone
may call Status, with whatever arguments (a bus policy names no signature), and dbus-next
reads a body a value at a time: 8 MiB of variants took 7.8 s of the controller's loop, and
the system bus passes 32 MiB in one message. Both measured by `python -m bench.flood --old`.
A call whose header fields are longer than `MAX_CALL_HEADER` comes as `Unread` too, with no
path: only an object path can make them long (every other field is a name of at most 255
characters), the bus daemon sets no limit on one but the message's, and dbus-next checks it
one element at a time (twice): a call to `/a/a/...` of 8 MiB held the loop 1.7 s, and 64 of
32 MiB fit in one turn, far past WatchdogSec=.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable, Collection
from struct import pack_into, unpack_from
from typing import Any

from dbus_next import Message, MessageFlag, MessageType, Variant
from dbus_next.aio import MessageBus

try:  # private to dbus-next: without it (another version), its own reader reads everything
    from dbus_next.__version__ import __version__ as DBUS_NEXT_VERSION
    from dbus_next._private.unmarshaller import Unmarshaller
except ImportError:  # pragma: no cover - the version we depend on has it
    DBUS_NEXT_VERSION, Unmarshaller = "", None
# The dbus-next whose reader Reader builds on and is tested against (Debian 12's, and the
# last release on PyPI); under any other, dbus-next's reader reads everything.
BUILT_FOR = "0.2.3"

PROPERTIES = "org.freedesktop.DBus.Properties"
_LITTLE_ENDIAN = ord("l")
_SIGNAL = MessageType.SIGNAL.value
_METHOD_CALL = MessageType.METHOD_CALL.value
# Messages read in one turn of the event loop, at most; the rest at its next turn.
MAX_PER_TURN = 64
# Bytes of a method call's arguments read, at most: every method of ours takes at most one
# unit name (255 characters).
MAX_CALL_BODY = 4096
# Bytes of a method call's header fields read, at most: ours are a short path and a few names.
MAX_CALL_HEADER = 4096
_PATH, _INTERFACE, _MEMBER, _DESTINATION, _SENDER, _SIGNATURE = 1, 2, 3, 6, 7, 8
# The alignment of each type's values, and the size of those of fixed size.
_ALIGN = {"y": 1, "b": 4, "n": 2, "q": 2, "i": 4, "u": 4, "x": 8, "t": 8, "d": 8, "h": 4}
_ALIGN |= {"s": 4, "o": 4, "g": 1, "a": 4, "(": 8, "{": 8, "v": 1}
_FIXED = {"y": 1, "b": 4, "n": 2, "q": 2, "i": 4, "u": 4, "x": 8, "t": 8, "d": 8, "h": 4}


class NotTaken(Exception):
    """The message is left to dbus-next's own reader."""


class Turn:
    """The messages the bus's readers (a new one for each message) read in this turn of the
    loop. Once MAX_PER_TURN are read, reading stops, and starts again at the loop's next
    turn: then, not when the socket is next readable, since dbus-next's buffered stream may
    already hold the next messages."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        self.read = 0
        self._due = False

    def spent(self) -> bool:
        if self.read < MAX_PER_TURN:
            return False
        if not self._due:
            self._due = True
            asyncio.get_running_loop().call_soon(self._next)
        return True

    def _next(self) -> None:
        self._due = False
        self.read = 0
        if self.bus.connected:
            self.bus._message_reader()


class Unread(Message):  # type: ignore[misc]
    """A method call whose arguments were not read (`body_len` bytes, over MAX_CALL_BODY):
    its header, with no arguments; or one whose header fields were not read whole
    (`header_len` bytes, over MAX_CALL_HEADER): then its path is `/`, not its own."""

    def __init__(self, call: Message, body_len: int, header_len: int = 0) -> None:
        super().__init__(
            destination=call.destination,
            path=call.path,
            interface=call.interface,
            member=call.member,
            message_type=call.message_type,
            flags=call.flags,
            sender=call.sender,
            serial=call.serial,
        )
        self.body_len = body_len
        self.header_len = header_len


def _text(buf: bytearray, o: int) -> tuple[str, int]:
    """A string or object path at `o`: its text and the offset after it."""
    o += -o & 3
    (n,) = unpack_from("<I", buf, o)
    return buf[o + 4 : o + 4 + n].decode(), o + 5 + n


def _signature(buf: bytearray, o: int) -> tuple[str, int]:
    n = buf[o]
    return buf[o + 1 : o + 1 + n].decode("ascii"), o + 2 + n


def _type_end(sig: str, i: int) -> int:
    """The index just after the single complete type that starts at sig[i]."""
    t = sig[i]
    if t == "a":
        return _type_end(sig, i + 1)
    if t in "({":
        close = ")" if t == "(" else "}"
        j = i + 1
        while sig[j] != close:
            j = _type_end(sig, j)
        return j + 1
    if t not in _ALIGN:
        raise NotTaken(f"type {t!r}")
    return i + 1


def _skip(buf: bytearray, o: int, sig: str, i: int) -> tuple[int, int]:
    """Step over the value at `o` of the type that starts at sig[i]: the offset after the
    value and the index after the type. Arrays are stepped over by their length. As
    dbus-next's reader, a variant's value is of the first type its signature names."""
    t = sig[i]
    size = _FIXED.get(t)
    if size is not None:
        o += -o & (size - 1)
        return o + size, i + 1
    if t in "so":
        return _text(buf, o)[1], i + 1
    if t == "g":
        return _signature(buf, o)[1], i + 1
    if t == "v":
        inner, o = _signature(buf, o)
        return _skip(buf, o, inner, 0)[0], i + 1
    if t == "a":
        o += -o & 3
        (n,) = unpack_from("<I", buf, o)
        o += 4
        o += -o & (_ALIGN[sig[i + 1]] - 1)  # not counted in the length
        return o + n, _type_end(sig, i + 1)
    if t == "(":  # a dict entry is only ever an array's element: stepped over with it
        o += -o & 7
        j = i + 1
        while sig[j] != ")":
            o, j = _skip(buf, o, sig, j)
        return o, j + 1
    raise NotTaken(f"type {t!r}")


def _read_bytes(buf: bytearray, o: int) -> tuple[Any, int]:
    o += -o & 3
    (n,) = unpack_from("<I", buf, o)
    return bytes(buf[o + 4 : o + 4 + n]), o + 4 + n


def _read_job(buf: bytearray, o: int) -> tuple[Any, int]:
    o += -o & 7
    (job_id,) = unpack_from("<I", buf, o)
    path, o = _text(buf, o + 4)
    return [job_id, path], o


def _read_bool(buf: bytearray, o: int) -> tuple[Any, int]:
    o += -o & 3
    (n,) = unpack_from("<I", buf, o)
    if n > 1:
        raise NotTaken(f"boolean {n}")  # not one the specification allows
    return n == 1, o + 4


def _read_u64(buf: bytearray, o: int) -> tuple[Any, int]:
    o += -o & 7
    return unpack_from("<Q", buf, o)[0], o + 8


# The types of the properties kept, as dbus-next gives them (a struct is a list).
_READERS: dict[str, Callable[[bytearray, int], tuple[Any, int]]] = {
    "s": _text,
    "o": _text,
    "ay": _read_bytes,
    "(uo)": _read_job,
    "b": _read_bool,
    "t": _read_u64,
}


def _header_fields(buf: bytearray, o: int, end: int) -> dict[int, Any]:
    fields: dict[int, Any] = {}
    while o < end:
        o += -o & 7
        code = buf[o]
        sig, o = _signature(buf, o + 1)
        if sig in ("s", "o"):
            fields[code], o = _text(buf, o)
        elif sig == "g":
            fields[code], o = _signature(buf, o)
        else:  # the only other field a signal has is UNIX_FDS: dbus-next hands the fds on
            raise NotTaken(f"header field {code} of type {sig!r}")
    return fields


def properties_changed(buf: bytearray, interface: str, keep: Collection[str]) -> Message | None:
    """The PropertiesChanged signal of `interface` that `buf` holds whole, with only the
    properties in `keep`; None for any other message. Raises NotTaken (or struct.error,
    UnicodeDecodeError, IndexError, KeyError) for one it cannot take."""
    if buf[0] != _LITTLE_ENDIAN or buf[1] != _SIGNAL or buf[3] != 1:
        return None
    body_len, serial, fields_len = unpack_from("<III", buf, 4)
    body = 16 + fields_len + (-fields_len & 7)
    end = body + body_len
    if len(buf) != end:
        raise NotTaken("not one whole message")
    fields = _header_fields(buf, 16, 16 + fields_len)
    if (
        fields.get(_MEMBER) != "PropertiesChanged"
        or fields.get(_INTERFACE) != PROPERTIES
        or fields.get(_SIGNATURE) != "sa{sv}as"
    ):
        return None
    name, o = _text(buf, body)
    if name != interface:
        return None
    o += -o & 3
    (n,) = unpack_from("<I", buf, o)
    o += 4
    o += -o & 7
    props_end = o + n
    props: dict[str, Variant] = {}
    while o < props_end:  # the hot loop: what _text, _signature and _skip do, inline
        o += -o & 7
        (n,) = unpack_from("<I", buf, o)
        key = buf[o + 4 : o + 4 + n].decode()
        o += 5 + n
        n = buf[o]
        sig = buf[o + 1 : o + 1 + n].decode("ascii")
        o += 2 + n
        if key in keep:
            value, o = _READERS[sig](buf, o)  # KeyError for another type: not taken
            props[key] = Variant(sig, value)
            continue
        size = _FIXED.get(sig)
        if size is not None:
            o += (-o & (size - 1)) + size
        elif sig == "s":
            o += -o & 3
            (n,) = unpack_from("<I", buf, o)
            o += 5 + n
        else:
            o = _skip(buf, o, sig, 0)[0]
    o += -o & 3
    (n,) = unpack_from("<I", buf, o)
    o += 4
    invalidated_end = o + n
    invalidated = []
    while o < invalidated_end:
        text, o = _text(buf, o)
        invalidated.append(text)
    return Message(
        destination=fields.get(_DESTINATION),
        path=fields.get(_PATH),
        interface=PROPERTIES,
        member="PropertiesChanged",
        message_type=MessageType.SIGNAL,
        flags=MessageFlag(buf[2]),
        sender=fields.get(_SENDER),
        signature="sa{sv}as",
        body=[name, props, invalidated],
        serial=serial,
    )


if Unmarshaller is not None:

    class Reader(Unmarshaller):  # type: ignore[misc]
        """dbus-next's reader, with PropertiesChanged of one interface taken first."""

        def __init__(
            self,
            stream: Any,
            sock: Any,
            interface: str,
            keep: Collection[str],
            turn: Turn | None = None,
        ):
            super().__init__(stream, sock)
            self._interface = interface
            self._keep = keep
            self._turn = turn

        def unmarshall(self) -> Message | None:
            """The next message; None when none is there yet, or this turn's are read."""
            if self._turn is not None and self._turn.spent():
                return None
            message: Message | None = super().unmarshall()
            if message is not None and self._turn is not None:
                self._turn.read += 1
            return message

        def _unmarshall(self) -> None:
            # as dbus-next's: the fixed part, then the whole message (a short read raises,
            # and the next call starts again with what was read kept)
            self.offset = 0
            self.read(16, prefetch=True)
            if self.buf[1] == _METHOD_CALL:
                order = "<" if self.buf[0] == _LITTLE_ENDIAN else ">"
                body_len, _, fields_len = unpack_from(order + "III", self.buf, 4)
                if body_len > MAX_CALL_BODY or fields_len > MAX_CALL_HEADER:
                    head = 16 + fields_len + (-fields_len & 7)
                    self.read(head + body_len, prefetch=True)  # the whole call, then past it
                    if fields_len <= MAX_CALL_HEADER:
                        call = _header_only(self.buf[:head], order)
                        self.message = Unread(call, body_len)
                        return
                    try:
                        call = _header_but_path(self.buf, order, 16 + fields_len)
                    except Exception:  # whatever it is, dbus-next's reader decides
                        super()._unmarshall()
                        return
                    self.message = Unread(call, body_len, fields_len)
                    return
            if self.buf[0] == _LITTLE_ENDIAN and self.buf[1] == _SIGNAL:
                body_len, _, fields_len = unpack_from("<III", self.buf, 4)
                self.read(16 + fields_len + (-fields_len & 7) + body_len, prefetch=True)
                try:
                    message = properties_changed(self.buf, self._interface, self._keep)
                except Exception:  # whatever it is, dbus-next's reader decides
                    message = None
                if message is not None:
                    self.message = message
                    return
            super()._unmarshall()

    def _header_only(head: bytearray, order: str) -> Message:
        """The message whose fixed part and header fields `head` is, read by dbus-next's
        reader as if it had no body (its signature names no type to read then)."""
        head = bytearray(head)
        pack_into(order + "I", head, 4, 0)
        message: Message = Unmarshaller(io.BytesIO(bytes(head))).unmarshall()
        return message


def _header_but_path(buf: bytearray, order: str, end: int) -> Message:
    """The method call whose header fields run from 16 to `end` in `buf`, read by their
    lengths, its path stepped over (never decoded, never checked) and given as `/`."""
    fields: dict[int, Any] = {}
    o = 16
    while o < end:
        o += -o & 7
        code = buf[o]
        sig, o = _signature(buf, o + 1)
        if sig == "g":
            fields[code], o = _signature(buf, o)
            continue
        if sig not in ("s", "o", "u"):
            raise NotTaken(f"header field {code} of type {sig!r}")
        o += -o & 3
        (n,) = unpack_from(order + "I", buf, o)
        if sig == "u":
            fields[code], o = n, o + 4
        else:
            fields[code] = None if code == _PATH else buf[o + 4 : o + 4 + n].decode()
            o += 5 + n
    return Message(
        destination=fields.get(_DESTINATION),
        path="/",
        interface=fields.get(_INTERFACE),
        member=fields.get(_MEMBER),
        flags=MessageFlag(buf[2]),
        sender=fields.get(_SENDER),
        serial=unpack_from(order + "I", buf, 8)[0],
    )


def install(bus: MessageBus, interface: str, keep: Collection[str]) -> bool:
    """Read `bus`'s next messages with Reader: PropertiesChanged of `interface` keep only
    the properties in `keep`. False (dbus-next's reader stays) under another dbus-next than
    the one Reader builds on."""
    if DBUS_NEXT_VERSION != BUILT_FOR or not all(
        hasattr(bus, a) for a in ("_create_unmarshaller", "_stream", "_sock", "_negotiate_unix_fd")
    ):
        return False
    turn = Turn(bus) if hasattr(bus, "_message_reader") else None

    def create() -> Reader:
        sock = bus._sock if bus._negotiate_unix_fd else None
        return Reader(bus._stream, sock, interface, keep, turn)

    bus._create_unmarshaller = create
    return True
