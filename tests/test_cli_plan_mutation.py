"""`gpuslice plan UNIT` and `gpuslice metrics` (and `--serve`) as a user sees them: what they
ask the controller on which bus, what they print of its answer, and what they say, cut and
escaped, when the answer, the bus or the controller fails them.

The bus is a fake `dbus_next.aio.MessageBus` that records each connection and call and
answers with a real dbus_next `Message`, so that `_call_controller` runs as it does."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Awaitable
from typing import Any, ClassVar

import dbus_next.aio
import pytest
from click.testing import CliRunner, Result
from dbus_next import Message, MessageType

import gpuslice.status
import gpuslice.systemd
from gpuslice.cli import BUS_TIMEOUT, main
from gpuslice.service import BUS_NAME, INTERFACE, LIMITS_EXCEEDED, OBJECT_PATH

ADDRESS = "unix:path=/run/test-system-bus"
STATUS: dict[str, Any] = {
    "version": 1,
    "gpus": [],
    "waiting": [],
    "preempted": [],
    "held": [],
    "finished": [],
    "failed": [],
}


class Bus:
    """What the CLI reaches over D-Bus: `connect_error` refuses the connection, `reply` is
    the controller's answer (a Message, or "hang" for a controller that never answers)."""

    connect_error: ClassVar[Exception | None] = None
    reply: ClassVar[Message | str | None] = None
    connected: ClassVar[list[str | None]] = []
    calls: ClassVar[list[tuple[str, str, str, str, str, list[Any]]]] = []

    def __init__(self, bus_address: str | None = None, bus_type: Any = None) -> None:
        self.address = bus_address

    async def connect(self) -> Bus:
        Bus.connected.append(self.address)
        if Bus.connect_error is not None:
            raise Bus.connect_error
        return self

    async def call(self, message: Message) -> Message | None:
        Bus.calls.append(
            (
                message.destination,
                message.path,
                message.interface,
                message.member,
                message.signature,
                list(message.body),
            )
        )
        if Bus.reply == "hang":
            await asyncio.Event().wait()
        assert not isinstance(Bus.reply, str)
        return Bus.reply

    def disconnect(self) -> None:
        pass


def answer(text: str) -> Message:
    return Message(
        message_type=MessageType.METHOD_RETURN, reply_serial=1, signature="s", body=[text]
    )


@pytest.fixture
def bus(monkeypatch: pytest.MonkeyPatch) -> type[Bus]:
    monkeypatch.setattr(Bus, "connect_error", None)
    monkeypatch.setattr(Bus, "reply", answer("{}"))
    monkeypatch.setattr(Bus, "connected", [])
    monkeypatch.setattr(Bus, "calls", [])
    monkeypatch.setattr(dbus_next.aio, "MessageBus", Bus)
    monkeypatch.setattr(gpuslice.systemd, "MessageBus", Bus)  # open_bus: the CLI's connect
    monkeypatch.setenv("GPUSLICE_BUS_ADDRESS", ADDRESS)
    return Bus


def invoke(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return result


def planned(summary: str, *messages: str) -> Message:
    return answer(json.dumps({"summary": summary, "decisions": [{"message": m} for m in messages]}))


# ---------------------------------------------------------------------------------------------
# plan: what it asks


@pytest.mark.parametrize(
    ("given", "asked"),
    [
        ("job", "job.service"),
        ("job.service", "job.service"),
        ("train@7", "train@7.service"),
        ("train@7.service", "train@7.service"),
    ],
)
def test_plan_asks_the_controller_on_the_bus_named_for_the_unit_named(
    bus: type[Bus], given: str, asked: str
) -> None:
    """A name without a suffix is a service, as for systemctl; one with a suffix is asked
    as given; the bus is GPUSLICE_BUS_ADDRESS's (the system bus when unset)."""
    bus.reply = planned("start at once")
    result = invoke("plan", given)
    assert (result.exit_code, result.output) == (0, "start at once\n")
    assert bus.connected == [ADDRESS]
    assert bus.calls == [(BUS_NAME, OBJECT_PATH, INTERFACE, "Plan", "s", [asked])]


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("a b", "'a b.service': not a unit name"),
        ("a\x1b[2J", "'a\\\\x1b[2J.service': not a unit name"),  # no escape reaches the tty
        ("job@", "job@.service is a template: name one of its instances (job@0.service)"),
        ("job@.service", "job@.service is a template: name one of its instances (job@0.service)"),
    ],
)
def test_plan_refuses_what_systemctl_could_not_start_without_asking(
    bus: type[Bus], given: str, said: str
) -> None:
    result = invoke("plan", given)
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == f"Error: Invalid value for UNIT: {said}"
    assert bus.connected == []


# ---------------------------------------------------------------------------------------------
# plan: what it prints


def test_plan_prints_the_summary_then_each_decision_indented(bus: type[Bus]) -> None:
    bus.reply = planned(
        "would preempt 1 unit, then start on GPU 0",
        "preempt batch.service (priority 50): less urgent",
        "start job.service on GPU 0",
    )
    result = invoke("plan", "job")
    assert (result.exit_code, result.output) == (
        0,
        "would preempt 1 unit, then start on GPU 0\n"
        "  preempt batch.service (priority 50): less urgent\n"
        "  start job.service on GPU 0\n",
    )


def test_plan_escapes_each_line_and_cuts_it_at_4000_characters(bus: type[Bus]) -> None:
    """Each line on its own: a newline the controller put in a message stays a line break,
    every other control character is escaped, and only a line over 4000 characters is cut."""
    bus.reply = planned("s" * 4001, "x" * 3998, "two\nlines\x1b[2J\x9b31m", "w" * 4000)
    result = invoke("plan", "job")
    assert result.exit_code == 0
    assert result.output.split("\n") == [
        "s" * 4000 + "...",
        "  " + "x" * 3998,
        "  two",
        "lines\\x1b[2J\\x9b31m",
        "  " + "w" * 3998 + "...",
        "",
    ]


def test_plan_json_prints_the_answer_as_it_came_indented_and_sorted(bus: type[Bus]) -> None:
    bus.reply = answer('{"summary": "s", "decisions": [], "b": {"z": [1, 2], "a": null}}')
    result = invoke("plan", "job", "--json")
    assert (result.exit_code, result.output) == (
        0,
        "{\n"
        '  "b": {\n'
        '    "a": null,\n'
        '    "z": [\n'
        "      1,\n"
        "      2\n"
        "    ]\n"
        "  },\n"
        '  "decisions": [],\n'
        '  "summary": "s"\n'
        "}\n",
    )


# ---------------------------------------------------------------------------------------------
# plan: an answer it cannot read


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            "\x1b" + "x" * 100,
            "the controller's Plan answer is not JSON (Expecting value: line 1 column 1 "
            "(char 0)): \\x1b" + "x" * 76 + "...",
        ),
        (
            json.dumps(list(range(40))),
            "the controller's Plan answer is not a JSON object: "
            + json.dumps(list(range(40)))[:80]
            + "...",
        ),
        (
            "{}",
            "the controller's Plan answer is not what this gpuslice reads (KeyError: "
            "'summary'); --json shows it as it came",
        ),
        (
            '{"summary": "s", "decisions": [{"msg": 1}]}',
            "the controller's Plan answer is not what this gpuslice reads (KeyError: "
            "'message'); --json shows it as it came",
        ),
    ],
)
def test_plan_says_what_came_when_it_cannot_read_the_answer(
    bus: type[Bus], text: str, said: str
) -> None:
    """The call named as the controller knows it, what was wrong, and the first 80 characters
    of what came, escaped."""
    bus.reply = answer(text)
    result = invoke("plan", "job")
    assert (result.exit_code, result.output) == (1, f"Error: {said}\n")


def test_a_table_that_trips_on_the_answer_says_so_in_80_escaped_characters(
    bus: type[Bus], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the table trips on (a lookup by a name the controller sent, say), the user
    reads its type and at most 80 characters of it, escaped."""

    def trips(data: dict[str, Any], now: float | None = None) -> str:
        raise KeyError("\x1b[2J" + "u" * 200)

    monkeypatch.setattr(gpuslice.status, "render", trips)
    bus.reply = answer(json.dumps(STATUS))
    result = invoke("status")
    assert (result.exit_code, result.output) == (
        1,
        "Error: the controller's Status answer is not what this gpuslice reads (KeyError: "
        "'\\x1b[2J" + "u" * 72 + "...); --json shows it as it came\n",
    )


# ---------------------------------------------------------------------------------------------
# the bus that fails


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ConnectionRefusedError(111, "Connection refused"), "Connection refused"),
        (EOFError(), "EOFError"),  # no message: its type says what happened
        (ValueError("\x07" + "r" * 300), "\\x07" + "r" * 196 + "..."),
    ],
)
def test_a_bus_that_cannot_be_reached_says_why_in_200_escaped_characters(
    bus: type[Bus], error: Exception, reason: str
) -> None:
    bus.connect_error = error
    result = invoke("plan", "job")
    assert (result.exit_code, result.output) == (
        1,
        f"Error: cannot reach the system bus to ask the gpuslice controller ({reason})\n",
    )


# ---------------------------------------------------------------------------------------------
# metrics


def samples(text: str) -> dict[str, str]:
    return dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )


def test_metrics_prints_the_controllers_status_and_exits_0(bus: type[Bus]) -> None:
    bus.reply = answer(json.dumps(STATUS))
    result = invoke("metrics")
    assert result.exit_code == 0, result.output
    assert samples(result.stdout)["gpuslice_up"] == "1.0"
    assert result.stderr == ""
    assert bus.connected == [ADDRESS]
    assert bus.calls == [(BUS_NAME, OBJECT_PATH, INTERFACE, "Status", "", [])]


def test_metrics_says_why_the_controller_did_not_answer_in_300_characters(
    bus: type[Bus],
) -> None:
    refused = "\x1b" + "L" * 400
    bus.reply = Message(
        message_type=MessageType.ERROR,
        error_name=LIMITS_EXCEEDED,
        reply_serial=1,
        signature="s",
        body=[refused],
    )
    result = invoke("metrics")
    assert result.exit_code == 1
    assert samples(result.stdout) == {"gpuslice_up": "0.0"}
    said = ("the gpuslice controller refused: \\x1b" + "L" * 400)[:300] + "..."
    assert result.stderr == f"gpuslice metrics: no status from the controller: {said}\n"


def test_metrics_gives_up_on_a_hung_controller_after_10_seconds(
    bus: type[Bus], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A textfile cron job or a scrape is not held forever by a controller that took the
    call and never answers: 10 seconds (here run a thousand times faster), then up 0."""
    real = asyncio.wait_for
    given: list[float] = []

    def faster(aw: Awaitable[Any], timeout: float) -> Awaitable[Any]:
        given.append(timeout)
        return real(aw, timeout / 1000)

    monkeypatch.setattr(asyncio, "wait_for", faster)
    bus.reply = "hang"
    result = invoke("metrics")
    assert given[0] == 10  # the whole ask; its connection and its call each BUS_TIMEOUT
    assert set(given[1:]) <= {BUS_TIMEOUT}
    assert result.exit_code == 1
    assert samples(result.stdout) == {"gpuslice_up": "0.0"}
    assert result.stderr == "gpuslice metrics: no status from the controller: TimeoutError\n"


@pytest.mark.parametrize(("status", "up"), [(STATUS, "1.0"), (None, "0.0")])
def test_metrics_serve_answers_the_connection_on_standard_input(
    bus: type[Bus], monkeypatch: pytest.MonkeyPatch, status: dict[str, Any] | None, up: str
) -> None:
    """gpuslice-metrics@.service: the scrape is answered 200 with the controller's status,
    or with up 0 when the controller does not answer (Prometheus reads the reason there)."""
    if status is None:
        bus.connect_error = FileNotFoundError(2, "No such file or directory")
    else:
        bus.reply = answer(json.dumps(status))
    ours, theirs = socket.socketpair()
    with ours, theirs:
        monkeypatch.setattr(os, "dup", lambda fd: theirs.detach() if fd == 0 else -1)
        ours.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        ours.shutdown(socket.SHUT_WR)
        result = invoke("metrics", "--serve")
        assert result.exit_code == 0, result.output
        ours.settimeout(10)
        received = b""
        while chunk := ours.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 OK\r\n")
    assert samples(body.decode())["gpuslice_up"] == up
    assert bus.connected == [ADDRESS]
