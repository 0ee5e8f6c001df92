"""The gate's pipes (gpuslice/gatepipes.py) with the real gate script (data/gpuslice-gate).

Real named pipes in tmp_path and the shipped gate run by /bin/sh, without systemd: the gate
is given its unit's $INVOCATION_ID and pipe as systemd and the generator give them, and a
`dbus-send` in PATH that records each call stands for asking over D-Bus. What must hold:
a gate passes through its pipe only with its own start's InvocationID, and whatever else
happens (a line for another start, the controller gone, a state without an InvocationID,
too many gates) it asks over D-Bus instead: it never waits on a pipe nobody will write.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice.gatepipes import GatePipes, wake_and_remove
from gpuslice.paths import PACKAGE_DIR

GATE = PACKAGE_DIR.parent / "data" / "gpuslice-gate"
UNIT = "job.service"
START = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"


class Gate:
    """One run of the shipped gate for UNIT, as the start `invocation`."""

    def __init__(self, tmp_path: Path, pipes: GatePipes, invocation: str = START) -> None:
        self.calls = tmp_path / "dbus-send.calls"
        stub = tmp_path / "bin" / "dbus-send"
        stub.parent.mkdir(exist_ok=True)
        stub.write_text(f'#!/bin/sh\necho "$@" >> {self.calls}\n')
        stub.chmod(0o755)
        env = {
            "PATH": f"{stub.parent}:/usr/bin:/bin",
            "INVOCATION_ID": invocation,
        }
        pipe = pipes.directory / UNIT
        self.proc = subprocess.Popen(
            ["/bin/sh", str(GATE), UNIT, "0.5", str(pipe)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        STARTED.append(self)

    def asked_over_dbus(self) -> bool:
        return self.calls.exists() and "Acquire" in self.calls.read_text()

    def ended(self, timeout: float = 10) -> int:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"the gate still waits: {out!r} {err!r}") from None
        assert err == ""
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()

    def waits(self, seconds: float = 0.3) -> bool:
        try:
            self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            return True
        return False


STARTED: list[Gate] = []


@pytest.fixture(autouse=True)
def _no_gate_left() -> Iterator[None]:
    yield
    while STARTED:
        STARTED.pop().close()


@pytest.fixture
def pipes(tmp_path: Path) -> Iterator[GatePipes]:
    p = GatePipes(tmp_path / "run" / "gate")
    yield p
    p.close_all()


def test_a_granted_start_passes_through_its_pipe_without_dbus(
    tmp_path: Path, pipes: GatePipes
) -> None:
    assert pipes.at_gate(UNIT, START)
    gate = Gate(tmp_path, pipes)
    assert gate.waits()  # nothing granted yet: it waits on the pipe
    assert not pipes.answered(UNIT)
    assert pipes.grant(UNIT)
    assert pipes.answered(UNIT)
    assert gate.ended() == 0
    assert not gate.asked_over_dbus()
    assert pipes.close(UNIT)  # its gate took the grant


def test_a_grant_its_gate_did_not_read_is_not_counted_as_taken(pipes: GatePipes) -> None:
    pipes.at_gate(UNIT, START)
    assert not pipes.answered(UNIT)
    pipes.grant(UNIT)
    assert pipes.answered(UNIT)
    assert not pipes.close(UNIT)  # the gate asked over D-Bus: the line is still there
    assert not pipes.close(UNIT)  # nothing held any more


def test_a_gate_that_opens_its_pipe_first_waits_for_the_controller(
    tmp_path: Path, pipes: GatePipes
) -> None:
    """The gate usually runs before the controller reads systemd's signal: it blocks in
    open() until the controller opens the pipe, then reads."""
    pipes.at_gate(UNIT, START)
    pipes.close(UNIT)  # the pipe stays, as after an earlier start
    gate = Gate(tmp_path, pipes)
    assert gate.waits()
    assert pipes.at_gate(UNIT, START)
    pipes.grant(UNIT)
    assert gate.ended() == 0
    assert not gate.asked_over_dbus()


def test_a_line_for_another_start_sends_the_gate_to_dbus(tmp_path: Path, pipes: GatePipes) -> None:
    """A grant left in the pipe by a start that was cancelled never lets a later one through."""
    pipes.at_gate(UNIT, OTHER)
    pipes.grant(UNIT)  # the gate of that start was stopped before it read
    gate = Gate(tmp_path, pipes, invocation=START)
    assert gate.ended() == 0
    assert gate.asked_over_dbus()


def test_the_controller_going_away_sends_a_waiting_gate_to_dbus(
    tmp_path: Path, pipes: GatePipes
) -> None:
    pipes.at_gate(UNIT, START)
    gate = Gate(tmp_path, pipes)
    assert gate.waits()
    pipes.close_all()  # what the kernel does when the controller dies
    assert gate.ended() == 0
    assert gate.asked_over_dbus()


def test_release_wakes_a_gate_blocked_before_the_controller_opened_its_pipe(
    tmp_path: Path, pipes: GatePipes
) -> None:
    """`gpuslice release-gates` (ExecStopPost=): the controller died before it opened the pipe
    a gate already waits on."""
    pipes.at_gate(UNIT, START)
    pipes.close_all()
    gate = Gate(tmp_path, pipes)
    assert gate.waits()
    wake_and_remove(pipes.directory)
    assert gate.ended() == 0
    assert gate.asked_over_dbus()
    assert not pipes.directory.exists()
    wake_and_remove(pipes.directory)  # twice, or with nothing there: nothing to do


def test_a_start_at_the_gate_without_its_invocation_is_sent_to_dbus(
    tmp_path: Path, pipes: GatePipes
) -> None:
    pipes.at_gate(UNIT, START)
    pipes.close_all()
    gate = Gate(tmp_path, pipes)
    assert gate.waits()
    pipes.at_gate_unknown(UNIT)
    assert gate.ended() == 0
    assert gate.asked_over_dbus()
    assert not (pipes.directory / UNIT).exists()  # the next gate asks over D-Bus at once


def test_a_start_held_already_is_not_sent_away_by_a_state_read(
    tmp_path: Path, pipes: GatePipes
) -> None:
    assert pipes.at_gate(UNIT, START)
    pipes.at_gate_unknown(UNIT)
    assert not pipes.at_gate(UNIT, START)  # the same start, seen again: decided once
    gate = Gate(tmp_path, pipes)
    pipes.grant(UNIT)
    assert gate.ended() == 0
    assert not gate.asked_over_dbus()


def test_too_many_gates_at_once_ask_over_dbus(tmp_path: Path) -> None:
    pipes = GatePipes(tmp_path / "gate", max_open=1)
    assert pipes.at_gate("first.service", START)
    assert not pipes.at_gate(UNIT, START)
    gate = Gate(tmp_path, pipes)
    assert gate.ended() == 0
    assert gate.asked_over_dbus()
    assert pipes.holding() == ["first.service"]
    pipes.close_all()


def test_a_grant_is_written_once(tmp_path: Path, pipes: GatePipes) -> None:
    pipes.at_gate(UNIT, START)
    assert pipes.grant(UNIT)
    assert not pipes.grant(UNIT)  # asked again over D-Bus: answered there
    assert not pipes.grant("other.service")  # no pipe held: nothing to write


def test_a_new_start_replaces_the_last_ones_pipe(tmp_path: Path, pipes: GatePipes) -> None:
    pipes.at_gate(UNIT, OTHER)
    assert pipes.at_gate(UNIT, START)
    gate = Gate(tmp_path, pipes)
    pipes.grant(UNIT)
    assert gate.ended() == 0
    assert not gate.asked_over_dbus()


@pytest.mark.parametrize("blocked_in", ["open", "read"])
def test_a_waiting_gate_stopped_ends_at_once_without_asking(
    tmp_path: Path, pipes: GatePipes, blocked_in: str
) -> None:
    pipes.at_gate(UNIT, START)
    if blocked_in == "open":
        pipes.close_all()
    gate = Gate(tmp_path, pipes)
    assert gate.waits()
    gate.proc.send_signal(signal.SIGTERM)
    assert gate.ended() == 0  # inactive, not failed
    assert not gate.asked_over_dbus()


def test_the_pipes_are_the_controllers_alone(tmp_path: Path, pipes: GatePipes) -> None:
    pipes.at_gate(UNIT, START)
    assert stat.S_IMODE(pipes.directory.stat().st_mode) == 0o700
    path = pipes.directory / UNIT
    assert stat.S_ISFIFO(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_something_else_in_a_pipes_place_is_never_written(tmp_path: Path, pipes: GatePipes) -> None:
    """A file or a link where a pipe should be (not ours: only root writes there): the gate
    asks over D-Bus, nothing is written through it."""
    pipes.directory.mkdir(parents=True)
    target = tmp_path / "target"
    target.write_text("")
    (pipes.directory / UNIT).symlink_to(target)
    (pipes.directory / "plain.service").write_text("")
    assert not pipes.at_gate(UNIT, START)
    assert not pipes.at_gate("plain.service", START)
    assert target.read_text() == ""
    assert pipes.holding() == []
    gate = Gate(tmp_path, pipes)
    assert gate.ended() == 0
    assert gate.asked_over_dbus()


def test_a_pipe_that_cannot_be_made_sends_the_gate_to_dbus(tmp_path: Path) -> None:
    blocker = tmp_path / "run"
    blocker.write_text("")  # /run/gpuslice/gate cannot be made under a file
    pipes = GatePipes(blocker / "gate")
    assert not pipes.at_gate(UNIT, START)
    assert pipes.holding() == []


def test_without_a_pipe_or_an_invocation_the_gate_asks_over_dbus(
    tmp_path: Path, pipes: GatePipes
) -> None:
    assert Gate(tmp_path, pipes).ended() == 0  # no pipe made yet
    assert Gate(tmp_path, pipes).asked_over_dbus()
    pipes.at_gate(UNIT, START)
    gate = Gate(tmp_path, pipes, invocation="")
    assert gate.ended() == 0
    assert gate.asked_over_dbus()


def test_a_granted_start_costs_no_process_but_the_shell(tmp_path: Path, pipes: GatePipes) -> None:
    """Not a timing test: the gate forks nothing on the fast way (a PATH with no dbus-send,
    sleep or systemctl at all still passes)."""
    pipes.at_gate(UNIT, START)
    pipes.grant(UNIT)
    env = {"PATH": str(tmp_path / "empty"), "INVOCATION_ID": START}
    result = subprocess.run(
        ["/bin/sh", str(GATE), UNIT, "0.5", str(pipes.directory / UNIT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert os.path.exists(pipes.directory / UNIT)  # kept for the unit's next start
