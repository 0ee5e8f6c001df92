"""The fast reader of units' PropertiesChanged (gpuslice/busread.py) against dbus-next's own.

Whatever the bytes, it must give what dbus-next's reader gives for the properties it keeps,
or leave the message to dbus-next's reader; never raise where that reader would not.
Recorded systemd 252 signals, generated ones of every D-Bus type, corrupted ones.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from dbus_next import Message, MessageFlag, MessageType, Variant
from dbus_next._private.marshaller import Marshaller
from dbus_next._private.unmarshaller import Unmarshaller
from dbus_next.errors import InvalidMessageError
from dbus_next.signature import SignatureTree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice import busread

UNIT = "org.freedesktop.systemd1.Unit"
KEEP = frozenset(
    {
        "ActiveState",
        "SubState",
        "Job",
        "InvocationID",
        "ConditionResult",
        "ConditionTimestampMonotonic",
    }
)
RECORDED = [
    base64.b64decode(m)
    for m in json.loads(
        (Path(__file__).parent / "data" / "systemd252-unit-properties-changed.json").read_text()
    )["messages"]
]
HEADER = ("path", "interface", "member", "sender", "destination", "serial", "signature")


def stock(data: bytes) -> Message:
    return Unmarshaller(io.BytesIO(data)).unmarshall()


def fast(data: bytes, interface: str = UNIT) -> Message:
    return busread.Reader(io.BytesIO(data), None, interface, KEEP).unmarshall()


def kept(msg: Message) -> dict[str, Any]:
    return {k: v for k, v in msg.body[1].items() if k in KEEP}


def assert_same_but_kept(got: Message, want: Message) -> None:
    for field in HEADER:
        assert getattr(got, field) == getattr(want, field), field
    assert (got.message_type, got.flags) == (want.message_type, want.flags)
    assert got.body[0] == want.body[0]
    assert got.body[1] == kept(want)
    assert got.body[2] == want.body[2]


def unit_signal(props: dict[str, Variant], invalidated: list[str] | None = None) -> Message:
    """systemd's PropertiesChanged of a.service's Unit interface, as dbus-next builds it."""
    return Message.new_signal(
        "/org/freedesktop/systemd1/unit/a_2eservice",
        busread.PROPERTIES,
        "PropertiesChanged",
        "sa{sv}as",
        [UNIT, props, invalidated or []],
    )


def test_recorded_signals_of_systemd_252_read_as_dbus_next_reads_them() -> None:
    for data in RECORDED:
        got, want = fast(data), stock(data)
        assert_same_but_kept(got, want)
        assert set(got.body[1]) == KEEP  # systemd 252 sends all six, among 22
    start_pre = fast(RECORDED[1]).body[1]
    assert start_pre["SubState"] == Variant("s", "start-pre")
    assert start_pre["Job"].value[1].startswith("/org/freedesktop/systemd1/job/")
    assert isinstance(start_pre["InvocationID"].value, bytes)


def test_other_messages_and_other_interfaces_are_left_to_dbus_next() -> None:
    job_new = Message.new_signal(
        "/org/freedesktop/systemd1",
        "org.freedesktop.systemd1.Manager",
        "JobNew",
        "uos",
        [7, "/org/freedesktop/systemd1/job/7", "a.service"],
    )
    service = Message.new_signal(
        "/org/freedesktop/systemd1/unit/a_2eservice",
        busread.PROPERTIES,
        "PropertiesChanged",
        "sa{sv}as",
        ["org.freedesktop.systemd1.Service", {"MainPID": Variant("u", 7)}, []],
    )
    forged = Message.new_signal(  # systemd's member with one more argument
        "/org/freedesktop/systemd1/unit/a_2eservice",
        busread.PROPERTIES,
        "PropertiesChanged",
        "sa{sv}asu",
        [UNIT, {"ActiveState": Variant("s", "active")}, [], 7],
    )
    for msg in (job_new, service, forged):
        data = msg._marshall()
        assert busread.properties_changed(bytearray(data), UNIT, KEEP) is None
        got = fast(data)
        assert (got.member, got.body) == (msg.member, msg.body)
    # a unit's, read for another interface's sake: all of it
    got = fast(RECORDED[0], interface="org.freedesktop.systemd1.Service")
    assert got.body == stock(RECORDED[0]).body


def test_what_dbus_next_reads_differently_is_left_to_it() -> None:
    """A message with file descriptors (dbus-next hands them on), another protocol version
    (dbus-next refuses it), bytes beyond the message."""
    with_fds = unit_signal({"ActiveState": Variant("s", "active")})
    with_fds.unix_fds = [0]
    data = bytearray(with_fds._marshall(negotiate_unix_fd=True))
    with pytest.raises(busread.NotTaken, match="header field 9 of type 'u'"):
        busread.properties_changed(data, UNIT, KEEP)
    big_endian = bytearray(RECORDED[0])
    big_endian[0] = ord("B")  # the rest still little-endian: read as it is, it would parse
    assert busread.properties_changed(big_endian, UNIT, KEEP) is None
    assert busread.properties_changed(bytearray(RECORDED[0]), UNIT, KEEP) is not None
    longer = bytearray(RECORDED[0]) + b"\0" * 8
    with pytest.raises(busread.NotTaken, match=r"^not one whole message$"):
        busread.properties_changed(longer, UNIT, KEEP)
    odd_field = bytearray(RECORDED[0])
    at = odd_field.index(bytes([3, 1, ord("s"), 0]), 16)  # the member, a string
    odd_field[at + 2] = ord("y")
    with pytest.raises(busread.NotTaken, match="header field 3 of type 'y'"):
        busread.properties_changed(odd_field, UNIT, KEEP)
    for skip in (busread._type_end, lambda sig, i: busread._skip(bytearray(8), 0, sig, i)):
        with pytest.raises(busread.NotTaken, match="type 'z'"):
            skip("z", 0)
    version_2 = bytearray(RECORDED[0])
    version_2[3] = 2
    assert busread.properties_changed(version_2, UNIT, KEEP) is None
    with pytest.raises(InvalidMessageError):
        fast(bytes(version_2))


def test_a_message_delivered_in_parts_is_read_once_whole() -> None:
    class Trickle(io.RawIOBase):
        """Gives at most `budget` bytes, then nothing (a socket with no more data yet)."""

        def __init__(self, data: bytes) -> None:
            self.data, self.budget = data, 0

        def read(self, n: int = -1) -> bytes | None:
            if self.budget == 0:
                return None
            take = self.data[: min(n, self.budget)]
            self.data, self.budget = self.data[len(take) :], self.budget - len(take)
            return take

    stream = Trickle(RECORDED[1])
    reader = busread.Reader(stream, None, UNIT, KEEP)
    for budget in (10, 100, 500):  # the fixed part, then part of the rest: not yet
        stream.budget = budget
        assert reader.unmarshall() is None
    stream.budget = len(RECORDED[1])
    assert_same_but_kept(reader.unmarshall(), stock(RECORDED[1]))


def call_bytes(signature: str, body: list[Any]) -> bytes:
    """A call of Status as dbus-next sends it (little-endian)."""
    call = Message(
        destination="org.gpuslice.Scheduler1",
        path="/org/gpuslice/Scheduler1",
        interface="org.gpuslice.Scheduler1",
        member="Status",
        signature=signature,
        body=body,
        serial=7,
    )
    return bytes(call._marshall())


def big_endian_call(body: bytes) -> bytes:
    """A call of Status with `body` as an `ay`, big-endian (dbus-next sends only the other)."""
    fields = bytearray()
    for code, sig, value in (
        (1, "o", "/org/gpuslice/Scheduler1"),
        (3, "s", "Status"),
        (8, "g", "ay"),
    ):
        fields += b"\0" * (-len(fields) & 7)
        fields += bytes([code, 1, ord(sig), 0])
        if sig == "g":
            fields += bytes([len(value)]) + value.encode() + b"\0"
        else:
            fields += b"\0" * (-len(fields) & 3)  # at 16 + len(fields): the same alignment
            fields += struct.pack(">I", len(value)) + value.encode() + b"\0"
    head = b"B\x01\x00\x01" + struct.pack(">III", 4 + len(body), 7, len(fields)) + fields
    return head + b"\0" * (-len(head) & 7) + struct.pack(">I", len(body)) + body


def test_a_method_calls_long_arguments_are_not_read() -> None:
    """Anyone may call Status, with any arguments (a bus policy names no signature), and
    dbus-next reads them a value at a time: 32 MiB of variants, the system bus's largest
    message, held the controller's loop for a minute, past its watchdog. Past MAX_CALL_BODY
    the call comes with its header alone; a call that fits is read as dbus-next reads it."""
    variants = [Variant("y", 1)] * 5000
    data = call_bytes("av", [variants])
    got = fast(data)
    assert isinstance(got, busread.Unread)
    want = stock(data)
    for field in ("path", "interface", "member", "destination", "serial", "flags"):
        assert getattr(got, field) == getattr(want, field), field
    assert (got.message_type, got.signature, got.body) == (want.message_type, "", [])
    assert got.body_len > busread.MAX_CALL_BODY
    big_endian = big_endian_call(b"x" * 5000)
    assert stock(big_endian).body == [b"x" * 5000]
    got = fast(big_endian)
    assert isinstance(got, busread.Unread)
    assert (got.path, got.member, got.serial, got.body_len) == (
        "/org/gpuslice/Scheduler1",
        "Status",
        7,
        5004,
    )
    short = call_bytes("s", ["a.service"])
    assert not isinstance(fast(short), busread.Unread)
    assert fast(short).body == ["a.service"]
    # the reader goes on with the message after it, in one stream
    reader = busread.Reader(io.BytesIO(data + short), None, UNIT, KEEP)
    assert isinstance(reader.unmarshall(), busread.Unread)
    after = busread.Reader(reader.stream, None, UNIT, KEEP).unmarshall()
    assert after is not None and after.body == ["a.service"]


def test_an_unread_message_keeps_every_field_of_its_header() -> None:
    """Its error reply goes to its sender, names its serial, and is not sent when its flags
    say none is expected; a signal that is too long stays a signal (never answered)."""
    for message_type, flags in (
        (MessageType.METHOD_CALL, MessageFlag.NO_REPLY_EXPECTED),
        (MessageType.SIGNAL, MessageFlag.NO_AUTOSTART),
    ):
        whole = Message(
            destination="org.gpuslice.Scheduler1",
            path="/org/gpuslice/Scheduler1",
            interface="org.gpuslice.Scheduler1",
            member="Status",
            message_type=message_type,
            flags=flags,
            sender=":1.42",
            serial=7,
        )
        got = busread.Unread(whole, 1 << 20)
        fields = ("destination", "path", "interface", "member", "message_type", "flags")
        for field in (*fields, "sender", "serial"):
            assert getattr(got, field) == getattr(whole, field), field
        assert (got.body, got.body_len) == ([], 1 << 20)


# -- any property of any type --------------------------------------------------------------

BASIC: dict[str, st.SearchStrategy[Any]] = {
    "y": st.integers(0, 255),
    "b": st.booleans(),
    "n": st.integers(-(2**15), 2**15 - 1),
    "q": st.integers(0, 2**16 - 1),
    "i": st.integers(-(2**31), 2**31 - 1),
    "u": st.integers(0, 2**32 - 1),
    "x": st.integers(-(2**63), 2**63 - 1),
    "t": st.integers(0, 2**64 - 1),
    "d": st.floats(allow_nan=False),
    "s": st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\0")),
    "o": st.sampled_from(["/", "/org/freedesktop/systemd1/job/76", "/a/b_2ec"]),
    "g": st.sampled_from(["", "s", "a{sv}", "(uo)"]),
}


def signatures(depth: int = 3) -> st.SearchStrategy[str]:
    """A single complete D-Bus type."""
    basic = st.sampled_from(sorted(BASIC))
    if depth == 0:
        return st.one_of(basic, st.just("v"))
    inner = signatures(depth - 1)
    return st.one_of(
        basic,
        st.just("v"),
        inner.map(lambda t: "a" + t),
        st.lists(inner, min_size=1, max_size=3).map(lambda ts: "(" + "".join(ts) + ")"),
        st.tuples(st.sampled_from("suyo"), inner).map(lambda kv: "a{" + kv[0] + kv[1] + "}"),
    )


def values(type_: Any, depth: int) -> st.SearchStrategy[Any]:
    """Values of a dbus-next SignatureType, as dbus-next marshals and reads them."""
    t = type_.token
    if t in BASIC:
        return BASIC[t]
    if t == "v":
        return typed(max(depth - 1, 0))
    if t == "(":
        return st.tuples(*(values(c, depth) for c in type_.children)).map(list)
    (child,) = type_.children
    if child.token == "{":
        key, value = child.children
        return st.dictionaries(values(key, depth), values(value, depth), max_size=3)
    if child.token == "y":
        return st.binary(max_size=8)  # dbus-next reads an array of bytes as bytes
    return st.lists(values(child, depth), max_size=3)


def typed(depth: int = 2) -> st.SearchStrategy[Variant]:
    """A Variant of any D-Bus type."""
    return signatures(depth).flatmap(
        lambda sig: values(SignatureTree._get(sig).types[0], depth).map(lambda v: Variant(sig, v))
    )


# a kept property of another type: dbus-next reads it
READ_TYPES = ("s", "o", "ay", "(uo)", "b", "t")
PROPER = {
    "ActiveState": ("s", st.sampled_from(["active", "inactive", "activating"])),
    "SubState": ("s", st.sampled_from(["running", "dead", "start-pre"])),
    "Job": ("(uo)", st.tuples(BASIC["u"], BASIC["o"]).map(list)),
    "InvocationID": ("ay", st.binary(max_size=16)),
    "ConditionResult": ("b", st.booleans()),
    "ConditionTimestampMonotonic": ("t", BASIC["t"]),
}


@st.composite
def unit_signals(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A unit's PropertiesChanged, and whether every kept property has a type Reader reads."""
    props: dict[str, Variant] = {}
    usual = True
    for name, (sig, values) in PROPER.items():
        if draw(st.booleans()):
            if draw(st.integers(0, 9)) == 0:
                props[name] = draw(typed(1))
                usual = usual and props[name].signature in READ_TYPES
            else:
                props[name] = Variant(sig, draw(values))
    for name in draw(st.lists(st.sampled_from(["A", "ActivationDetails", "B_c", "x" * 40]))):
        props[name] = draw(typed())
    invalidated = draw(st.lists(st.sampled_from(["Conditions", "Asserts"]), max_size=2))
    msg = unit_signal(dict(draw(st.permutations(list(props.items())))), invalidated)
    msg.sender = ":1.1"
    msg.serial = draw(st.integers(1, 2**32 - 1))
    return bytes(msg._marshall()), usual


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(unit_signals())
def test_any_properties_read_as_dbus_next_reads_the_kept_ones(sample: tuple[bytes, bool]) -> None:
    data, usual = sample
    got, want = fast(data), stock(data)
    if usual:
        assert_same_but_kept(got, want)
    else:  # a kept property of another type: dbus-next read all of it
        assert got.body == want.body


@settings(deadline=None)
@given(
    st.sampled_from(range(len(RECORDED))),
    st.lists(st.tuples(st.integers(0, 1200), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_corrupted_bytes_never_raise_where_dbus_next_would_not(
    which: int, flips: list[tuple[int, int]]
) -> None:
    data = bytearray(RECORDED[which])
    for at, value in flips:
        data[at % len(data)] = value
    try:
        want: Message | None = stock(bytes(data))
    except Exception:
        want = None
    try:
        got = fast(bytes(data))
    except Exception:
        assert want is None, "raised where dbus-next's reader did not"
        return
    taken = got is not None and got.member == "PropertiesChanged" and got.body[0] == UNIT
    if want is not None and taken:  # both read it: the same properties
        assert got.body[1] == kept(want) or got.body == want.body


def marshalled(msg: Message, sender: str, destination: str) -> bytes:
    """As dbus-next's Message._marshall, with the sender (which the bus daemon adds)."""
    body = Marshaller(msg.signature, msg.body)
    body.marshall()
    fields = [
        [1, Variant("o", msg.path)],
        [2, Variant("s", msg.interface)],
        [3, Variant("s", msg.member)],
        [6, Variant("s", destination)],
        [7, Variant("s", sender)],
        [8, Variant("g", msg.signature)],
    ]
    header = [ord("l"), 4, 0, 1, len(body.buffer), msg.serial, fields]
    head = Marshaller("yyyyuua(yv)", header)
    head.marshall()
    head.align(8)
    return bytes(head.buffer + body.buffer)


def test_the_header_as_the_bus_daemon_sends_it() -> None:
    """Sender and destination (which dbus-next's own marshaller leaves out), a serial and a
    job id past 2**31, and interfaces of every length (the padding after its name)."""
    for interface in ("a.b", "a.bc", "a.bcd", "a.bcde", UNIT):
        for name in ("A", "AB", "ABC", "ABCD", "Job"):
            props = {
                name: Variant("(uo)", [2**32 - 1, "/j/1"]) if name == "Job" else Variant("s", "x"),
                "SubState": Variant("s", "dead"),
            }
            msg = Message.new_signal("/u", busread.PROPERTIES, "PropertiesChanged", "sa{sv}as")
            msg.body = [interface, props, []]
            msg.serial = 2**32 - 2
            data = marshalled(msg, ":1.77", ":1.3")
            got = busread.properties_changed(bytearray(data), interface, KEEP)
            assert got is not None
            want = stock(data)
            assert (got.sender, got.destination, got.serial) == (":1.77", ":1.3", 2**32 - 2)
            assert_same_but_kept(got, want)
    other = Message.new_signal("/u", "org.example.Other", "PropertiesChanged", "sa{sv}as")
    other.body = [UNIT, {"SubState": Variant("s", "dead")}, []]
    assert busread.properties_changed(bytearray(other._marshall()), UNIT, KEEP) is None


TRICKY = {  # types whose values are stepped over by their lengths and alignments
    "Bytes": Variant("ay", b"\x01\x02\x03"),
    "Nested": Variant("(aasu)", [[["a"], ["b", "cd"]], 7]),
    "Structs": Variant("a(ta{sv}y)", [[1, {"k": Variant("d", 1.5)}, 2], [3, {}, 4]]),
    "Empty": Variant("a(tt)", []),
    "Deep": Variant("v", Variant("v", Variant("(gqx)", ["a{sv}", 3, -5]))),
    "Dict": Variant("a{oav}", {"/a": [Variant("b", True)], "/b": []}),
    "Tail": Variant("(yaay)", [1, [b"", b"xyz"]]),
    "Texts": Variant("(sogu)", ["a", "/b", "s", 7]),
    "InStruct": Variant("((yu)s(vq)x)", [[1, 2], "c", [Variant("s", "d"), 3], 4]),
    "InVariant": Variant("v", Variant("o", "/e")),
    "VariantFirst": Variant("(vs)", [Variant("y", 1), "abcdefghij"]),
    "A": Variant("u", 1),
    "AB": Variant("s", "f"),
    "ABC": Variant("t", 2),
    "ABCDE": Variant("n", 3),
}


def test_every_kind_of_property_is_stepped_over_to_the_kept_ones() -> None:
    """Kept properties after every kind of value: read by Reader itself (a message left to
    dbus-next would carry all its properties)."""
    for name, variant in TRICKY.items():
        msg = unit_signal({name: variant, "SubState": Variant("s", "dead"), "Z": variant}, ["Q"])
        got = busread.properties_changed(bytearray(msg._marshall()), UNIT, KEEP)
        assert got is not None, name
        assert got.body == [UNIT, {"SubState": Variant("s", "dead")}, ["Q"]], name


def test_a_property_after_an_invocation_id_of_any_length() -> None:
    """What follows an array of bytes starts where it ends: the next dict entry aligns to 8,
    which hides an offset one too far except where the array ends on a multiple of 8 (an
    InvocationID of 4 or 12 bytes here)."""
    for n in range(17):
        invocation = bytes(range(n))
        props = {"InvocationID": Variant("ay", invocation), "SubState": Variant("s", "dead")}
        msg = unit_signal(props)
        got = busread.properties_changed(bytearray(msg._marshall()), UNIT, KEEP)
        assert got is not None and got.body[1] == props, n


@pytest.mark.parametrize(
    ("sig", "end"),
    [("s", 1), ("as", 2), ("aas", 3), ("(su)", 4), ("((su)u)", 7), ("a{sv}", 5), ("(a(ss)u)", 8)],
)
def test_the_end_of_a_type_in_a_signature(sig: str, end: int) -> None:
    assert busread._type_end(sig + "u", 0) == end


def test_installed_only_on_the_dbus_next_it_is_built_for(monkeypatch: pytest.MonkeyPatch) -> None:
    class Bus:  # what of dbus-next's MessageBus Reader uses
        def __init__(self) -> None:
            self._stream = io.BytesIO(RECORDED[0])
            self._sock: object = None
            self._negotiate_unix_fd = False

        def _create_unmarshaller(self) -> Unmarshaller:
            return Unmarshaller(self._stream, self._sock)

    bus = Bus()
    assert busread.install(bus, UNIT, KEEP) is True
    reader = bus._create_unmarshaller()
    assert isinstance(reader, busread.Reader)
    assert_same_but_kept(reader.unmarshall(), stock(RECORDED[0]))
    # file descriptors come through the socket where the bus negotiated them, as dbus-next's
    assert reader.sock is None
    bus._sock = "the socket"
    assert bus._create_unmarshaller().sock is None
    bus._negotiate_unix_fd = True
    assert bus._create_unmarshaller().sock == "the socket"
    assert busread.install(object(), UNIT, KEEP) is False
    monkeypatch.setattr(busread, "DBUS_NEXT_VERSION", "0.2.4")
    assert busread.install(Bus(), UNIT, KEEP) is False


class Socketlike(io.BytesIO):
    """A non-blocking socket's stream: at its end a read would block, it has not ended."""

    def read(self, size: int | None = -1, /) -> bytes:
        data = super().read(size)
        if not data:
            raise BlockingIOError
        return data


def test_at_most_max_per_turn_messages_are_read_in_one_turn_of_the_loop() -> None:
    """As dbus-next's reader runs them (a loop over the socket's messages), the installed
    readers stop after MAX_PER_TURN and read on at the loop's next turn, whether or not
    the socket becomes readable again (the stream may hold the rest already). Without a
    `_message_reader` (no such loop) nothing is counted. tests/test_dbus_adapter.py floods
    a real bus."""
    per_turn = busread.MAX_PER_TURN
    calls = b"".join(call_bytes("s", [f"u{i}.service"]) for i in range(2 * per_turn + 1))

    class Bus:  # what of dbus-next's MessageBus the readers use
        _unmarshaller: Unmarshaller

        def __init__(self) -> None:
            self._stream = Socketlike(calls)
            self._sock: object = None
            self._negotiate_unix_fd = False
            self.connected = True
            self.got: list[Any] = []

        def _create_unmarshaller(self) -> Unmarshaller:
            return Unmarshaller(self._stream, self._sock)

    class Looping(Bus):  # and its reading loop
        def _message_reader(self) -> None:  # as dbus-next 0.2.3's
            while self._unmarshaller.unmarshall():
                self.got.append(self._unmarshaller.message.body[0])
                self._unmarshaller = self._create_unmarshaller()

    async def scenario() -> None:
        bus = Looping()
        assert busread.install(bus, UNIT, KEEP) is True
        bus._unmarshaller = bus._create_unmarshaller()
        bus._message_reader()
        assert len(bus.got) == per_turn
        bus._message_reader()  # readable again in the same turn: nothing more
        assert len(bus.got) == per_turn
        await asyncio.sleep(0)
        assert len(bus.got) == 2 * per_turn
        await asyncio.sleep(0)
        assert bus.got == [f"u{i}.service" for i in range(2 * per_turn + 1)]
        bus._stream.write(calls)  # more come: the count goes on (the last turn read one)
        bus._stream.seek(-len(calls), io.SEEK_END)
        bus.connected = False
        bus._message_reader()
        assert len(bus.got) == 3 * per_turn
        await asyncio.sleep(0)
        assert len(bus.got) == 3 * per_turn  # a connection gone is not read on

    asyncio.run(scenario())
    plain = Bus()
    assert busread.install(plain, UNIT, KEEP) is True
    assert all(plain._create_unmarshaller().unmarshall() for _ in range(per_turn + 1))


def long_path_call(path: str, order: str = "<", serial: int = 9, flags: int = 0) -> bytes:
    """A call of Introspect on `path` (anyone may call Introspect, on any path), with the
    sender the bus daemon adds; `order` "<" little-endian, ">" big-endian. A reply serial
    (`u`) and an empty signature (`g`) come between names: header fields of every type the
    bus passes, each to be stepped over by its own length."""
    fields = bytearray()
    for code, sig, value in (
        (2, "s", "org.freedesktop.DBus.Introspectable"),
        (5, "u", 0x80000001),
        (3, "s", "Introspect"),
        (8, "g", ""),
        (1, "o", path),
        (6, "s", "org.gpuslice.Scheduler1"),
        (7, "s", ":1.42"),
    ):
        fields += b"\0" * (-len(fields) & 7)
        fields += bytes([code, 1, ord(sig), 0])
        if isinstance(value, int):
            fields += struct.pack(order + "I", value)
        elif sig == "g":
            fields += bytes([len(value)]) + value.encode() + b"\0"
        else:
            fields += struct.pack(order + "I", len(value)) + value.encode() + b"\0"
    endian = b"l" if order == "<" else b"B"
    head = endian + bytes([1, flags, 1]) + struct.pack(order + "III", 0, serial, len(fields))
    head += fields
    return head + b"\0" * (-len(head) & 7)


def test_a_method_calls_long_header_is_not_read() -> None:
    """Anyone may call Introspect on any path, and an object path has no limit but the
    message's (32 MiB on the system bus). dbus-next checks a path one element at a time, and
    twice: an 8 MiB `/a/a/...` held the controller's loop 1.7 s, and 64 such calls are read
    in one turn. Past MAX_CALL_HEADER the call comes unread, its path not decoded; its sender,
    serial, member and flags kept for its error reply. A short header is read as before."""
    path = "/a" * busread.MAX_CALL_HEADER
    for order in ("<", ">"):
        data = long_path_call(path, order, serial=0x80000009, flags=MessageFlag.NO_AUTOSTART)
        assert stock(data).path == path
        got = fast(data)
        assert isinstance(got, busread.Unread)
        assert (got.path, got.member, got.sender, got.serial, got.destination) == (
            "/",
            "Introspect",
            ":1.42",
            0x80000009,
            "org.gpuslice.Scheduler1",
        )
        assert got.interface == "org.freedesktop.DBus.Introspectable"
        assert got.flags == MessageFlag.NO_AUTOSTART
        fields_len = struct.unpack_from(order + "I", data, 12)[0]
        assert fields_len > busread.MAX_CALL_HEADER
        assert (got.body, got.body_len, got.header_len) == ([], 0, fields_len)
    short = long_path_call("/org/gpuslice/Scheduler1")
    assert not isinstance(fast(short), busread.Unread)
    assert fast(short).path == "/org/gpuslice/Scheduler1"
    # the reader goes on with the message after it, in one stream
    reader = busread.Reader(io.BytesIO(long_path_call(path) + short), None, UNIT, KEEP)
    assert isinstance(reader.unmarshall(), busread.Unread)
    after = busread.Reader(reader.stream, None, UNIT, KEEP).unmarshall()
    assert after is not None and after.path == "/org/gpuslice/Scheduler1"


def test_a_condition_check_is_read_and_a_boolean_not_0_or_1_left_to_dbus_next() -> None:
    """ConditionResult (`b`) and ConditionTimestampMonotonic (`t`), kept, are read as
    dbus-next reads them; a boolean of another value than 0 or 1 (which the specification
    does not allow, and the bus daemon rejects) is not Reader's to read."""
    props = {
        "ConditionResult": Variant("b", True),
        "SubState": Variant("s", "dead"),
        "ConditionTimestampMonotonic": Variant("t", 2**64 - 1),
    }
    msg = unit_signal(props)
    data = bytearray(msg._marshall())
    got = busread.properties_changed(data, UNIT, KEEP)
    assert got is not None and got.body[1] == props == stock(bytes(data)).body[1]
    value = data.index(b"ConditionResult\0") + len("ConditionResult\0") + 3  # `\1b\0`, aligned
    value += -value & 3
    assert data[value : value + 4] == b"\1\0\0\0"
    data[value] = 2
    with pytest.raises(busread.NotTaken, match=r"^boolean 2$"):
        busread.properties_changed(data, UNIT, KEEP)
    data[value : value + 4] = b"\xff" * 4  # unsigned: not -1, which is not above 1
    with pytest.raises(busread.NotTaken, match=r"^boolean 4294967295$"):
        busread.properties_changed(data, UNIT, KEEP)
