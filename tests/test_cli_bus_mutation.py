"""The CLI's edges to the buses and to systemctl (gpuslice/cli.py): its one call to the
controller (`_call_controller`) on a real, private dbus-daemon and the words a user reads for
each answer; `_unit_state`, systemctl show read back; `_resume_by_ladder`, release-jobs' resume
by the controller's own Ladder; `_release_gates`, gpuslice.service's ExecStopPost=."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from dbus_next import Message, MessageType
from dbus_next.aio import MessageBus

from gpuslice import checkpoint
from gpuslice import cli as cli_module
from gpuslice.checkpoint import CheckpointError, CheckpointSettings, Resumed
from gpuslice.cli import main
from gpuslice.config import Config
from gpuslice.ladder import Ladder
from gpuslice.service import (
    ACCESS_DENIED,
    BUS_NAME,
    INTERFACE,
    LIMITS_EXCEEDED,
    NOT_MANAGED,
    OBJECT_PATH,
)
from gpuslice.systemd import Systemd
from tests.hostpaths import REAL
from tests.test_dbus_adapter import _OPEN, _bus_daemon, connect, run
from tests.test_dbus_adapter import bus_address as bus_address
from tests.test_dbus_adapter import bus_daemon as bus_daemon
from tests.test_release_jobs_resume import _Systemd

POLICY = Path(__file__).parent.parent / "data" / "org.gpuslice.Scheduler1.conf"
TRY = "is it running? Try: systemctl status gpuslice"

# ---------------------------------------------------------------------------------------------
# _call_controller: one call, and the words for each answer


@pytest.fixture
def closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's own connection is closed by `run` too (dbus-next leaves its socket open)."""
    real_connect = MessageBus.connect

    async def closed_by_run(bus: MessageBus) -> MessageBus:
        _OPEN.append(bus)
        return await real_connect(bus)

    monkeypatch.setattr(MessageBus, "connect", closed_by_run)


Answer = Callable[[Message], Message | bool]


async def controller(address: str, answer: Answer) -> list[Message]:
    """A connection that owns the controller's name and answers each call on its object as
    `answer` says: the calls it got."""
    bus = await connect(address)
    calls: list[Message] = []

    def handle(msg: Message) -> Message | bool:
        if msg.message_type is MessageType.METHOD_CALL and msg.path == OBJECT_PATH:
            calls.append(msg)
            return answer(msg)
        return False

    bus.add_message_handler(handle)
    await bus.request_name(BUS_NAME)
    return calls


def error(name: str, *body: str) -> Answer:
    """An answer that is the error `name`, its body `body` (none at all when empty)."""

    def answer(msg: Message) -> Message:
        return Message(
            message_type=MessageType.ERROR,
            reply_serial=msg.serial,
            destination=msg.sender,
            error_name=name,
            signature="s" * len(body),
            body=list(body),
        )

    return answer


def refused_with(address: str, answer: Answer) -> str:
    """What the CLI says when the controller answers its call as `answer` does."""
    said: list[str] = []

    async def scenario() -> None:
        await controller(address, answer)
        with pytest.raises(click.ClickException) as refused:
            await cli_module._call_controller(address, "Status")
        said.append(refused.value.message)

    run(scenario)
    return said[0]


def test_the_answer_is_the_controllers_text_to_a_call_that_names_its_interface(
    bus_address: str, closed: None
) -> None:
    """Plan carries its unit as one string, on the controller's interface (the policy that
    gpuslice installs lets a user call only a member named with it); the answer is the
    controller's text as it came."""
    answered = '{"summary": "starts at once", "decisions": []}'

    async def scenario() -> None:
        calls = await controller(
            bus_address, lambda msg: Message.new_method_return(msg, "s", [answered])
        )
        assert await cli_module._call_controller(bus_address, "Plan", "x.service") == answered
        (call,) = calls
        assert (call.interface, call.member) == (INTERFACE, "Plan")
        assert (call.signature, call.body) == ("s", ["x.service"])

    run(scenario)


LONG = "\x1b[2J" + "a" * 400  # a control sequence, and more than a line of the terminal
LONG_SHOWN = "\\x1b[2J" + "a" * (300 - len("\\x1b[2J")) + "..."


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        # the controller's own sentence: the unit has no annotation in force
        (error(NOT_MANAGED, "x.service is not managed"), "x.service is not managed"),
        (error(NOT_MANAGED, LONG), LONG_SHOWN),
        (error(ACCESS_DENIED, "who are you"), "only root may ask the controller for Status"),
        # a controller that runs and says why not: not "is it running?"
        (error(LIMITS_EXCEEDED, "try again"), "the gpuslice controller refused: try again"),
        (error(LIMITS_EXCEEDED), "the gpuslice controller refused: "),
        (error(LIMITS_EXCEEDED, LONG), f"the gpuslice controller refused: {LONG_SHOWN}"),
        # any other error: what it says, and where to look
        (
            error("org.freedesktop.DBus.Error.Failed", "internal error"),
            f"the gpuslice controller did not answer (internal error); {TRY}",
        ),
        (
            error("org.freedesktop.DBus.Error.Failed"),
            f"the gpuslice controller did not answer (no reply); {TRY}",
        ),
        (
            error("org.freedesktop.DBus.Error.Failed", LONG),
            f"the gpuslice controller did not answer ({LONG_SHOWN}); {TRY}",
        ),
    ],
)
def test_each_error_of_the_controller_in_its_own_words(
    bus_address: str, closed: None, answer: Answer, said: str
) -> None:
    assert refused_with(bus_address, answer) == said


def test_no_controller_on_the_bus_is_said_with_the_bus_daemons_words(
    bus_address: str, closed: None
) -> None:
    said: list[str] = []

    async def scenario() -> None:
        with pytest.raises(click.ClickException) as refused:
            await cli_module._call_controller(bus_address, "Status")
        said.append(refused.value.message)

    run(scenario)
    assert said[0].startswith(f"the gpuslice controller did not answer (The name {BUS_NAME} ")
    assert said[0].endswith(f"); {TRY}")


def test_a_controller_that_never_answers_is_given_up_on(
    bus_address: str, closed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name owner that takes the call and never answers (the bus daemon's own reply
    timeout is the config's, none at all on some): the CLI says so after BUS_TIMEOUT, as
    systemctl gives up after its own, instead of waiting for ever."""
    assert cli_module.BUS_TIMEOUT == 30.0
    monkeypatch.setattr(cli_module, "BUS_TIMEOUT", 0.2)
    connect = cli_module._connect

    async def unhurried(address: str | None) -> MessageBus:
        """The connection is made within the real BUS_TIMEOUT: in 0.2 s, a bus daemon a
        loaded machine ran late had not answered its Hello yet."""
        with monkeypatch.context() as patch:
            patch.setattr(cli_module, "BUS_TIMEOUT", 30.0)
            return await connect(address)

    monkeypatch.setattr(cli_module, "_connect", unhurried)
    said = refused_with(bus_address, lambda msg: True)  # taken, never answered
    assert said == f"the gpuslice controller did not answer within 0.2 s; {TRY}"


def test_a_bus_daemon_that_never_authenticates_is_given_up_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A socket that takes the connection and says nothing: the CLI says so after
    BUS_TIMEOUT, its socket closed (ResourceWarning at the collection below otherwise)."""
    path = tmp_path / "silent"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    monkeypatch.setattr(cli_module, "BUS_TIMEOUT", 0.2)
    try:
        with pytest.raises(click.ClickException) as raised:
            asyncio.run(cli_module._call_controller(f"unix:path={path}", "Status"))
    finally:
        listener.close()
    assert raised.value.message == (
        "cannot reach the system bus to ask the gpuslice controller (no answer within 0.2 s)"
    )
    gc.collect()


def test_a_connection_dropped_mid_call_is_said_with_why(
    bus_daemon: tuple[str, subprocess.Popen[bytes]], closed: None
) -> None:
    """The bus daemon gone while the controller holds the call: what dbus-next said, and
    where to look, not a traceback."""
    address, daemon = bus_daemon

    said: list[str] = []

    def kill_the_bus(msg: Message) -> bool:
        daemon.kill()
        return True

    async def scenario() -> None:
        await controller(address, kill_the_bus)
        with pytest.raises(click.ClickException) as refused:
            await cli_module._call_controller(address, "Status")
        said.append(refused.value.message)
        for bus in _OPEN:  # each connection's end, taken (else printed at exit)
            with contextlib.suppress(EOFError):
                await bus.wait_for_disconnect()

    run(scenario)
    assert said == [f"the gpuslice controller did not answer (EOFError); {TRY}"]


POLICED = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={{socket}}</listen>
  <auth>EXTERNAL</auth>{{limits}}
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
  </policy>
  {default}
  <policy user="root">
    <allow own="{name}"/>
  </policy>
</busconfig>
"""


@pytest.fixture
def policed_bus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A bus daemon that holds every sender to the rules a user's sends get on a system bus
    with gpuslice installed: the system bus's own (Debian's system.conf: method calls denied
    unless allowed, signals allowed unless denied), then
    the default context of data/org.gpuslice.Scheduler1.conf. The tests run as root, whose
    policy there allows any send: only its right to own the name is kept."""
    (default,) = ET.parse(POLICY).getroot().findall("policy[@context='default']")
    config = POLICED.format(default=ET.tostring(default, encoding="unicode"), name=BUS_NAME)
    monkeypatch.setattr("tests.test_dbus_adapter.BUS_CONFIG", config)
    for address, _ in _bus_daemon(tmp_path):
        yield address


def test_a_users_status_call_passes_the_policy_gpuslice_installs(
    policed_bus: str, closed: None
) -> None:
    """Anyone may read the status: the policy allows them Status named with the controller's
    interface, and nothing without it (a call left unnamed was refused, and the user read
    "only root may ask")."""

    async def scenario() -> None:
        await controller(policed_bus, lambda msg: Message.new_method_return(msg, "s", ["{}"]))
        assert await cli_module._call_controller(policed_bus, "Status") == "{}"
        unnamed = await (await connect(policed_bus)).call(
            Message(destination=BUS_NAME, path=OBJECT_PATH, member="Status")
        )
        assert unnamed is not None and unnamed.error_name == ACCESS_DENIED

    run(scenario)


def test_without_an_address_the_call_goes_to_the_system_bus(
    bus_address: str, closed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No GPUSLICE_BUS_ADDRESS: the controller is on the system bus (DBUS_SYSTEM_BUS_ADDRESS
    where set, as for any D-Bus client), never the caller's session bus."""
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", bus_address)
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", "unix:path=/nonexistent/session-bus")

    async def scenario() -> None:
        await controller(bus_address, lambda msg: Message.new_method_return(msg, "s", ["{}"]))
        assert await cli_module._call_controller(None, "Status") == "{}"

    run(scenario)


# dbus-next leaves the socket of a connection that failed unclosed (message_bus.py,
# _setup_socket): harmless in a command that exits, a ResourceWarning here.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_no_bus_is_said_with_why(tmp_path: Path) -> None:
    with pytest.raises(click.ClickException) as refused:
        asyncio.run(cli_module._call_controller(f"unix:path={tmp_path}/no-bus", "Status"))
    assert refused.value.message == (
        "cannot reach the system bus to ask the gpuslice controller (No such file or directory)"
    )
    del refused
    gc.collect()  # the leaked socket warns now, under this test's filters


# ---------------------------------------------------------------------------------------------
# status --watch: one connection for the whole watch

STATUS = json.dumps(
    {"gpus": [], "waiting": [], "preempted": [], "held": [], "finished": [], "failed": []}
)
TABLE = "Waiting:\n  -\n"  # what a screen that shows the controller's answer holds
HEADER = re.compile(r"^\d\d:\d\d:\d\d every 0\.1 s\n\n", re.MULTILINE)


def answered(msg: Message) -> Message:
    return Message.new_method_return(msg, "s", [STATUS])


class Enough(Exception):
    """The end of a watch that ran for as many redraws as its test needed."""


Step = Callable[[list[MessageBus]], Awaitable[None]]


async def watch(
    address: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *steps: Step
) -> tuple[list[str], list[MessageBus]]:
    """`_watch_status` on `address` every 0.1 s, for one redraw more than `steps`: the pause
    after the n-th redraw does steps[n] (given the connections made so far) and takes no
    time. Each screen as drawn (its header checked, then left out), and each connection
    the watch made."""
    screens: list[str] = []
    made: list[MessageBus] = []
    real_connect = cli_module._connect

    async def connect(at: str | None) -> MessageBus:
        made.append(await real_connect(at))
        return made[-1]

    async def pause(seconds: float) -> None:
        assert seconds == 0.1
        drawn = capsys.readouterr().out
        assert HEADER.match(drawn), drawn
        screens.append(HEADER.sub("", drawn, count=1))
        if len(screens) > len(steps):
            raise Enough
        await steps[len(screens) - 1](made)

    with monkeypatch.context() as patched:
        patched.setattr(cli_module, "_connect", connect)
        patched.setattr(asyncio, "sleep", pause)
        with pytest.raises(Enough):
            await cli_module._watch_status(address, 0.1)
    return screens, made


async def nothing(made: list[MessageBus]) -> None:
    pass


def test_a_watch_asks_on_one_connection_for_all_its_redraws(
    bus_address: str,
    closed: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each redraw is one Status call on the connection of the first: a connection per
    redraw cost the bus daemon a Hello, and the controller, where /proc hides processes,
    the bus daemon's word on each new name (callers.py keeps it per unique name). Ended,
    the watch leaves its connection closed."""

    async def scenario() -> None:
        calls = await controller(bus_address, answered)
        screens, made = await watch(bus_address, monkeypatch, capsys, nothing, nothing)
        assert [call.sender for call in calls] == [made[0].unique_name] * 3, made
        assert len(made) == 1
        assert all(TABLE in screen for screen in screens), screens
        assert not made[0].connected

    run(scenario)


def test_a_watch_keeps_its_connection_while_the_controller_restarts(
    bus_address: str,
    closed: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The controller away (its name without owner: ServiceUnknown) is said on the screen
    in the words of `gpuslice status`, and the watch goes on, on the same connection: the
    controller back (another connection, as after a restart) is asked on it."""
    restarted: list[list[Message]] = []

    async def scenario() -> None:
        calls = await controller(bus_address, answered)
        gone = _OPEN[-1]  # the controller's connection

        async def stop(made: list[MessageBus]) -> None:
            await gone.release_name(BUS_NAME)

        async def start(made: list[MessageBus]) -> None:
            restarted.append(await controller(bus_address, answered))

        screens, made = await watch(bus_address, monkeypatch, capsys, stop, start)
        assert len(made) == 1, made
        assert [call.sender for call in calls + restarted[0]] == [made[0].unique_name] * 2
        away = "no status from the controller: the gpuslice controller did not answer ("
        assert screens[1].startswith(f"{away}The name {BUS_NAME} "), screens[1]
        assert screens[1].endswith(f"; {TRY}\n"), screens[1]
        assert TABLE in screens[0] and TABLE in screens[2], screens

    run(scenario)


def test_a_connection_the_bus_dropped_is_replaced_at_the_next_redraw(
    bus_address: str,
    closed: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The bus daemon ends the watch's connection (here: for bytes that are no D-Bus
    message): the next redraw asks on a new one (a call on the one dropped waits for ever),
    and the one dropped is closed, its end taken (else asyncio prints "Future exception
    was never retrieved" over the watch, or as it exits)."""

    async def scenario() -> None:
        calls = await controller(bus_address, answered)

        async def drop(made: list[MessageBus]) -> None:
            made[0]._sock.send(b"X" * 16)  # no byte order: the bus daemon hangs up
            await asyncio.wait([made[0]._disconnect_future])  # its EOFError left untaken

        screens, made = await watch(bus_address, monkeypatch, capsys, drop)
        assert len(made) == 2, made
        assert [call.sender for call in calls] == [bus.unique_name for bus in made]
        assert made[0].unique_name != made[1].unique_name
        assert all(TABLE in screen for screen in screens), screens
        assert made[0]._sock.fileno() == -1  # closed

    run(scenario)
    gc.collect()  # the connections' futures, gone: one whose end was not taken logs it
    assert "never retrieved" not in caplog.text


# as test_no_bus_is_said_with_why: the socket of each connect that failed is left unclosed
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_watch_without_a_bus_says_why_at_each_redraw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No bus to connect to: each redraw says so in the words of `gpuslice status`, and
    tries again."""

    async def scenario() -> list[str]:
        screens, made = await watch(f"unix:path={tmp_path}/no-bus", monkeypatch, capsys, nothing)
        assert made == []
        return screens

    screens = asyncio.run(scenario())
    said = "cannot reach the system bus to ask the gpuslice controller (No such file or directory)"
    assert screens == [f"no status from the controller: {said}\n"] * 2
    gc.collect()  # the leaked sockets warn now, under this test's filters


@contextlib.contextmanager
def controller_aside(address: str, answer: Answer) -> Iterator[list[Message]]:
    """The stand-in controller on an event loop of its own, in a thread: for a command that
    runs its own loop (asyncio.run). The calls it got."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    own: list[MessageBus] = []

    async def close() -> None:
        for bus in own:
            bus.disconnect()
            await bus.wait_for_disconnect()
            bus._stream.close()
            bus._sock.close()

    try:
        calls = asyncio.run_coroutine_threadsafe(controller(address, answer), loop).result(10)
        own.append(_OPEN.pop())  # closed here, on its loop, not by `run`
        yield calls
    finally:
        asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_gpuslice_status_watch_asks_on_one_connection_until_ctrl_c(
    bus_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpuslice status --watch -n 0.1` to its end: Ctrl-C (SIGINT to the main thread, sent
    by the controller on the third call) ends it with exit status 0 and no traceback, its
    connection closed; all three calls came on one connection (each redraw made its own:
    three senders)."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # as in a shell
    asked: list[Message] = []
    cli_thread = threading.get_ident()

    def answer_then_ctrl_c(msg: Message) -> Message:
        asked.append(msg)
        if len(asked) == 3:
            signal.pthread_kill(cli_thread, signal.SIGINT)
        return answered(msg)

    made: list[MessageBus] = []
    real_connect = MessageBus.connect

    async def connect(bus: MessageBus) -> MessageBus:
        made.append(bus)
        return await real_connect(bus)

    monkeypatch.setenv("GPUSLICE_BUS_ADDRESS", bus_address)
    try:
        with controller_aside(bus_address, answer_then_ctrl_c) as calls:
            monkeypatch.setattr(MessageBus, "connect", connect)  # the CLI's connections
            result = CliRunner().invoke(main, ["status", "--watch", "-n", "0.1"])
    finally:
        for bus in made:  # dbus-next leaves the socket open
            bus._stream.close()
            bus._sock.close()
    assert [call.sender for call in calls] == [made[0].unique_name] * 3
    assert len(made) == 1
    assert result.exit_code == 0 and result.exception is None, result.output
    screens = HEADER.split(result.output)[1:]
    assert len(screens) >= 2 and all(TABLE in screen for screen in screens), result.output
    assert not made[0].connected


# ---------------------------------------------------------------------------------------------
# _resume_by_ladder: release-jobs' resume, by the controller's Ladder

TOOL = "/opt/nvidia/cuda-checkpoint"
UNIT = "train.service"


def _ladder(
    monkeypatch: pytest.MonkeyPatch,
    tool: str | None = TOOL,
    restore: Callable[[], Resumed] | None = None,
    freeze_fails: str = "",
) -> tuple[list[tuple[str, ...]], list[_Systemd]]:
    """systemd and cuda-checkpoint stood in for: `tool` found (None: none), PID 11 of the
    unit checkpointed, its restore doing `restore`. What was called, and each connection."""
    calls: list[tuple[str, ...]] = []
    made: list[_Systemd] = []

    async def connect(address: str | None = None, timeout: float | None = None) -> _Systemd:
        made.append(_Systemd(calls, [11], freeze_fails))
        return made[-1]

    async def get_state(tool: str, pid: int, via_systemd: bool = False) -> str:
        return checkpoint.CHECKPOINTED

    async def stop_earlier_runs(pids: list[int]) -> str:
        return ""

    async def resume(
        tool: str, pids: list[int], s: CheckpointSettings, owned: object = None
    ) -> Resumed:
        calls.append(("restore", tool, *map(str, pids)))
        return restore() if restore else Resumed(0.5, tuple(pids))

    monkeypatch.setattr(Systemd, "connect", connect)
    monkeypatch.setattr(checkpoint, "find_tool", lambda configured, **kw: tool)
    monkeypatch.setattr(checkpoint, "check_tool", lambda tool, root_only: None)
    monkeypatch.setattr(checkpoint, "get_state", get_state)
    monkeypatch.setattr(checkpoint, "stop_earlier_runs", stop_earlier_runs)
    monkeypatch.setattr(checkpoint, "resume", resume)
    monkeypatch.setattr(Ladder, "_require_freezer", lambda self: None)  # no cgroup v2 here
    return calls, made


def _resume() -> Resumed | CheckpointError:
    settings = CheckpointSettings.from_config(Config())
    return asyncio.run(cli_module._resume_by_ladder(UNIT, settings))


def test_the_resume_asks_systemd_on_the_bus_gpuslice_is_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPUSLICE_BUS_ADDRESS, as for the controller; a bus that cannot be reached is a reason
    (the unit left as it was), not the end of release-jobs."""
    asked: list[str | None] = []

    async def refused(address: str | None = None, timeout: float | None = None) -> Systemd:
        asked.append(address)
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(Systemd, "connect", refused)
    monkeypatch.setenv("GPUSLICE_BUS_ADDRESS", "unix:path=/run/elsewhere")
    failed = _resume()
    assert isinstance(failed, CheckpointError)
    assert failed.reason == "cannot reach systemd on the system bus (Connection refused)"
    assert asked == ["unix:path=/run/elsewhere"]


def test_the_resume_restores_the_pids_the_state_file_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The PIDs the stopped controller's suspend checkpointed (SavedState.checkpointed):
    those still the unit's processes are restored, after the cuda-checkpoint runs it left on
    them are stopped; systemd's list of the unit's processes is not asked (one of more than
    MAX_RECOVERED_PIDS failed the resume, and the unit was left suspended)."""
    calls, _ = _ladder(monkeypatch)
    stopped: list[list[int]] = []

    async def stop_earlier_runs(pids: list[int]) -> str:
        stopped.append(list(pids))
        return ""

    monkeypatch.setattr(checkpoint, "stop_earlier_runs", stop_earlier_runs)
    # PID 13 is another unit's process now
    monkeypatch.setattr(Ladder, "_still_its_own", lambda self, unit, pids: [12])
    settings = CheckpointSettings.from_config(Config())
    done = asyncio.run(cli_module._resume_by_ladder(UNIT, settings, [12, 13]))
    assert done == Resumed(0.5, (12,))
    assert calls == [("ThawUnit", UNIT), ("restore", TOOL, "12")]
    assert stopped == [[12]]


def test_a_tool_gone_since_leaves_the_unit_frozen_again_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cuda-checkpoint removed between the check and the restore: nothing is restored, the
    unit is frozen again as it was, and the reason says why."""
    calls, made = _ladder(monkeypatch, tool=None)
    failed = _resume()
    assert isinstance(failed, CheckpointError)
    assert failed.reason == "cuda-checkpoint is not installed any more: cannot restore"
    assert calls == [("ThawUnit", UNIT), ("FreezeUnit", UNIT)]
    assert made[0].bus.disconnected


def test_a_unit_that_cannot_be_frozen_again_is_said_to_be_thawed_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The freeze back failed: the reason says both, what failed first and that the unit
    runs thawed now."""
    _ladder(monkeypatch, tool=None, freeze_fails="the bus went away")
    failed = _resume()
    assert isinstance(failed, CheckpointError)
    assert failed.reason == (
        "cuda-checkpoint is not installed any more: cannot restore; and it could not be "
        "frozen again: FreezeUnit failed: the bus went away"
    )


def test_a_bug_while_resuming_is_a_reason_and_the_unit_frozen_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug must not end release-jobs (the other units are owed their resume): it is the
    unit's reason, and the unit is frozen again."""

    def bug() -> Resumed:
        raise KeyError("pid")

    calls, made = _ladder(monkeypatch, restore=bug)
    failed = _resume()
    assert isinstance(failed, CheckpointError)
    assert failed.reason == "gpuslice failed while resuming ('pid')"
    assert calls[-1] == ("FreezeUnit", UNIT)
    assert made[0].bus.disconnected


# ---------------------------------------------------------------------------------------------
# _unit_state: systemctl show, read back

FAKE_SYSTEMCTL = """\
#!{python}
# `systemctl show` as systemd's parses its arguments: -p NAME (each), -P NAME (--value: the
# values alone), `--` ends the options; properties matched as spelled. Units: {units}.
import json, sys, time
units = json.loads({units!r})
args, props, value_only, names = sys.argv[1:], [], False, []
while args:
    arg = args.pop(0)
    if arg == "--":
        names += args
        break
    if arg in ("-p", "-P"):
        props.append(args.pop(0))
        value_only = value_only or arg == "-P"
    elif arg.startswith("-"):
        sys.exit(f"systemctl: invalid option -- '{{arg}}'")
    else:
        names.append(arg)
time.sleep({sleep})
verb, *names = names
assert verb == "show"
blocks = []
for name in names:
    shown = units.get(name, {{"ActiveState": "inactive", "FreezerState": "running"}})
    blocks.append("".join(
        v + "\\n" if value_only else f"{{k}}={{v}}\\n" for k, v in shown.items() if k in props
    ))
print("\\n".join(blocks), end="")
sys.exit({status})
"""


def _systemctl(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    units: dict[str, dict[str, str]],
    status: int = 0,
    sleep: float = 0,
) -> None:
    """A systemctl first on PATH that shows `units` so, exiting with `status` after `sleep`
    seconds."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "systemctl"
    fake.write_text(
        FAKE_SYSTEMCTL.format(
            python=sys.executable, units=json.dumps(units), status=status, sleep=sleep
        )
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


@pytest.mark.parametrize("status", [0, 1])
@pytest.mark.parametrize("unit", ["train.service", "-h.service"])
def test_the_state_is_what_systemctl_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unit: str, status: int
) -> None:
    """Both properties, by their names, as name=value; a unit whose name begins with a dash
    is a unit, never an option; what systemctl printed counts whatever its exit status."""
    shown = {"Id": unit, "ActiveState": "active", "SubState": "running", "FreezerState": "frozen"}
    _systemctl(tmp_path, monkeypatch, {unit: shown}, status=status)
    assert cli_module._unit_state(unit) == {"ActiveState": "active", "FreezerState": "frozen"}


def test_several_units_are_shown_in_one_call_each_read_from_its_own_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """release-jobs' preempted units: one `systemctl show` names them all, and systemctl
    prints a block for each, blank-line separated, in the order named."""
    shown = {
        "a.service": {"ActiveState": "active", "FreezerState": "frozen"},
        "-h.service": {"ActiveState": "failed", "FreezerState": "running"},
    }
    _systemctl(tmp_path, monkeypatch, shown)
    names = ["a.service", "-h.service", "b.service"]
    assert cli_module._unit_states(names, time.monotonic() + 60) == {
        **shown,
        "b.service": {"ActiveState": "inactive", "FreezerState": "running"},
    }


def test_a_systemctl_that_hangs_is_given_up_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """release-jobs runs in prerm, which `apt remove` waits for: a systemctl that does not
    answer is no state, not a wait for ever (its time limit shortened a hundredfold here)."""
    _systemctl(tmp_path, monkeypatch, {UNIT: {"ActiveState": "active"}}, sleep=5)
    real_run = subprocess.run

    def hurried(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("timeout") is not None:
            kwargs["timeout"] /= 100
        return real_run(*args, **kwargs)

    monkeypatch.setattr(subprocess, "run", hurried)
    assert cli_module._unit_state(UNIT) == {}


def test_no_systemctl_is_no_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cli_module._unit_state(UNIT) == {}


# ---------------------------------------------------------------------------------------------
# _release_gates: gpuslice.service's ExecStopPost=


def _release_gates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> tuple[list[str], Any]:
    """release-gates with config.yaml holding `text`: the gate directories woken, the run."""
    from gpuslice import gatepipes

    woken: list[str] = []
    monkeypatch.setattr(gatepipes, "wake_and_remove", lambda d: woken.append(str(d)))
    monkeypatch.setattr("gpuslice.paths.RUNTIME_DIR_RECORD", str(tmp_path / "no-record"))
    # the real default, whose gates are woken by the stand-in above, not on this host
    monkeypatch.setattr("gpuslice.paths.DEFAULT_RUNTIME_DIR", REAL["paths.DEFAULT_RUNTIME_DIR"])
    monkeypatch.delenv("GPUSLICE_RUNTIME_DIR", raising=False)
    (tmp_path / "config.yaml").write_text(text)
    result = CliRunner().invoke(main, ["release-gates", "--config", str(tmp_path / "config.yaml")])
    assert result.exit_code == 0, result.output
    return woken, result


def test_release_gates_says_nothing_when_the_config_is_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    woken, result = _release_gates(tmp_path, monkeypatch, "runtime_dir: /run/gpuslice/x\n")
    assert woken == ["/run/gpuslice/x/gate"]
    assert (result.stdout, result.stderr) == ("", "")


def test_release_gates_says_on_stderr_which_dirs_a_bad_config_left_it_to_guess(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal of gpuslice.service tells why gates were woken in more than one place:
    the file's problem, and each runtime_dir tried."""
    text = "runtime_dir: /run/gpuslice/x\ngpus: 0\n"
    woken, result = _release_gates(tmp_path, monkeypatch, text)
    assert woken == ["/run/gpuslice/gate", "/run/gpuslice/x/gate"]
    assert result.stdout == ""
    assert result.stderr == (
        f'gpuslice release-gates: {tmp_path}/config.yaml:2: gpus: invalid value "0" '
        "(allowed: an integer 1-1024); using /run/gpuslice, /run/gpuslice/x\n"
    )


def test_a_bus_that_accepts_and_never_answers_is_given_up_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`apt remove` waits on release-jobs: a bus daemon that takes the connection and never
    authenticates it costs BUS_TIMEOUT, then the unit is a reason, left as it was."""
    path = tmp_path / "silent"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    monkeypatch.setenv("GPUSLICE_BUS_ADDRESS", f"unix:path={path}")
    monkeypatch.setattr(cli_module, "BUS_TIMEOUT", 0.2)
    try:
        failed = _resume()
    finally:
        listener.close()
    assert isinstance(failed, CheckpointError)
    assert failed.reason == "cannot reach systemd on the system bus (no answer within 0.2 s)"


def test_a_connection_the_bus_daemon_hangs_up_on_is_closed_not_leaked(tmp_path: Path) -> None:
    """A bus daemon that takes the connection and hangs up before authenticating it: the
    call says why, and the socket dbus-next opened is closed (a watch tries again at each
    redraw: a descriptor left per redraw until garbage collection)."""
    path = tmp_path / "hangs-up"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def hang_up() -> None:
        conn, _ = listener.accept()
        conn.close()

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    try:
        with pytest.raises(click.ClickException) as raised:
            asyncio.run(cli_module._call_controller(f"unix:path={path}", "Status"))
    finally:
        thread.join(5)
        listener.close()
    assert raised.value.message.startswith(
        "cannot reach the system bus to ask the gpuslice controller ("
    )
    gc.collect()  # an unclosed socket says so here (ResourceWarning: the run fails)
