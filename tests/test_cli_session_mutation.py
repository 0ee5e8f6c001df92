"""The CLI's sessions with the buses, in what a user reads and what the bus sees: release-jobs
telling this boot (`_this_boot`) and naming the units it leaves alone when it cannot;
`gpuslice status --watch` (`_watch_status`) asking the controller for its Status on one
connection, drawing the table with how long each unit has waited, saying in its screen why
there is no status, and closing a connection the bus dropped when the watch ends. On a
private dbus-daemon (tests/test_dbus_adapter.py) or stand-ins for systemd
(tests/test_release_jobs_resume.py)."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from pathlib import Path

import pytest
from dbus_next import Message
from dbus_next.aio import MessageBus
from dbus_next.errors import DBusError

from gpuslice import cli as cli_module
from gpuslice.service import INTERFACE
from tests.test_cli_bus_mutation import TRY, Enough, answered, controller, error, watch
from tests.test_cli_bus_mutation import closed as closed
from tests.test_dbus_adapter import bus_address as bus_address
from tests.test_dbus_adapter import bus_daemon as bus_daemon
from tests.test_dbus_adapter import run
from tests.test_release_jobs_boot import _release
from tests.test_release_jobs_resume import _systemd_started, _this_boot

# ---------------------------------------------------------------------------------------------
# _this_boot: this boot, or none


@pytest.mark.parametrize(
    ("started", "why"),
    [
        (DBusError("org.freedesktop.DBus.Error.AccessDenied", "denied"), "denied"),
        (ConnectionResetError(104, "Connection reset by peer"), "Connection reset by peer"),
    ],
    ids=["refused", "dropped"],
)
def test_a_boot_systemd_will_not_tell_is_no_boot_and_why(
    monkeypatch: pytest.MonkeyPatch, started: BaseException, why: str
) -> None:
    """Systemd refusing to say when it started: no boot at all (""), which same_boot matches
    with no saved state, whatever boot id the state file says; and why, for the admin."""
    made = _systemd_started(monkeypatch, started)
    assert cli_module._this_boot() == ("", why)
    assert len(made) == 1 and made[0][1].bus.disconnected


def test_a_boot_systemd_never_tells_is_no_boot_after_bus_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli_module, "BUS_TIMEOUT", 0.01)
    _systemd_started(monkeypatch, None)  # never answers
    assert cli_module._this_boot() == ("", "systemd did not answer within 0.01 s")


def test_a_boot_systemd_tells_is_the_controllers_reading_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _systemd_started(monkeypatch)
    assert cli_module._this_boot() == (_this_boot(), "")


# ---------------------------------------------------------------------------------------------
# _name_left_alone: why the boot could not be told, bounded


def test_why_the_boot_could_not_be_told_is_said_up_to_300_characters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line `apt remove` prints is bounded, however long the bus's error is."""
    why = "y" * 400
    done, stderr, _ = _release(tmp_path, monkeypatch, _this_boot(), no_bus=OSError(5, why))
    assert done == []
    assert stderr.splitlines()[0] == (
        f"gpuslice release-jobs: cannot tell whether the saved state is of this boot "
        f"({why[:300]}...): a container restarted without its host has the kernel boot id "
        "of its last boot, whose units are others now; no unit the state names is thawed, "
        "resumed or stopped"
    )


# ---------------------------------------------------------------------------------------------
# status --watch


def test_each_redraw_asks_the_controller_for_its_status_by_name(
    bus_address: str,
    closed: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What the policy gpuslice installs lets a user call: Status, on the controller's
    interface, with no argument."""

    async def scenario() -> None:
        calls = await controller(bus_address, answered)
        await watch(bus_address, monkeypatch, capsys, _nothing)
        asked = [(c.interface, c.member, c.signature, list(c.body)) for c in calls]
        assert asked == [(INTERFACE, "Status", "", [])] * 2

    run(scenario)


async def _nothing(made: list[MessageBus]) -> None:
    pass


def test_the_watch_says_how_long_each_unit_has_waited(
    bus_address: str,
    closed: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """As `gpuslice status` does: the table is drawn as of the time of the redraw."""
    # an hour, a minute and a second ago: "1 h 1 min" for the next 59 s (3700 s ago, a
    # redraw a loaded host ran 20 s late would have said "1 h 2 min")
    since = time.time() - 3661
    status = {
        "gpus": [],
        "waiting": [{"unit": "a.service", "priority": 5, "reason": "waits", "since": since}],
        "preempted": [],
        "held": [],
        "finished": [],
        "failed": [],
    }

    def answer(msg: Message) -> Message:
        return Message.new_method_return(msg, "s", [json.dumps(status)])

    async def scenario() -> None:
        await controller(bus_address, answer)
        screens, _ = await watch(bus_address, monkeypatch, capsys)
        (screen,) = screens
        assert "  1. a.service (priority 5): waits (for 1 h 1 min)\n" in screen, screen

    run(scenario)


def test_an_answer_that_is_not_json_is_said_to_be_the_status_answer(
    bus_address: str,
    closed: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def answer(msg: Message) -> Message:
        return Message.new_method_return(msg, "s", ["not json"])

    async def scenario() -> None:
        await controller(bus_address, answer)
        screens, _ = await watch(bus_address, monkeypatch, capsys)
        assert screens == [
            "no status from the controller: the controller's Status answer is not JSON "
            "(Expecting value: line 1 column 1 (char 0)): not json\n"
        ]

    run(scenario)


def test_why_there_is_no_status_is_said_up_to_300_characters(
    bus_address: str,
    closed: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A controller's long error: the screen's line is cut at 300 characters, as the
    sentence `gpuslice status` would print is."""
    said = f"the gpuslice controller did not answer ({'a' * 300}...); {TRY}"

    async def scenario() -> None:
        await controller(bus_address, error("org.freedesktop.DBus.Error.Failed", "a" * 400))
        screens, _ = await watch(bus_address, monkeypatch, capsys)
        assert screens == [f"no status from the controller: {said[:300]}...\n"]

    run(scenario)


def test_a_watch_ended_after_the_bus_dropped_it_closes_that_connection(
    bus_address: str,
    closed: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ctrl-C between the bus daemon hanging up on the watch and the next redraw: the
    connection is put away as one replaced would be, its socket closed and its end taken
    (else asyncio prints "Future exception was never retrieved" as the command exits)."""

    async def scenario() -> None:
        await controller(bus_address, answered)

        async def drop_then_end(made: list[MessageBus]) -> None:
            made[0]._sock.send(b"X" * 16)  # no byte order: the bus daemon hangs up
            await asyncio.wait([made[0]._disconnect_future])  # its EOFError left untaken
            raise Enough

        screens, made = await watch(bus_address, monkeypatch, capsys, drop_then_end)
        assert len(screens) == 1 and len(made) == 1, (screens, made)
        assert made[0]._sock.fileno() == -1  # closed

    run(scenario)
    gc.collect()  # the connection's future, gone: one whose end was not taken logs it
    assert "never retrieved" not in caplog.text
