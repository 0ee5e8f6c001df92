"""The gate's pipes (gpuslice/gatepipes.py) with the real gate script (data/gpuslice-gate).

Real named pipes in tmp_path and the shipped gate run by /bin/sh, without systemd: the gate
is given its unit's $INVOCATION_ID and pipe as systemd and the generator give them, and a
`dbus-send` in PATH that records each call stands for asking over D-Bus. What must hold:
a gate passes through its pipe only with its own start's InvocationID, and whatever else
happens (a line for another start, the controller gone, a state without an InvocationID,
too many gates) it asks over D-Bus instead: it never waits on a pipe nobody will write.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import resource
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice.gatepipes import (
    MAX_OPEN,
    RESERVED_FDS,
    TO_THE_BUS,
    GatePipes,
    pipe_budget,
    raise_fd_limit,
    wake_and_remove,
)
from gpuslice.paths import PACKAGE_DIR
from tests.descriptors import open_below

GATE = PACKAGE_DIR.parent / "data" / "gpuslice-gate"
UNIT = "job.service"
START = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"


# The gate's own PATH (it runs as root: the unit's PATH= chooses nothing there)
# How long a gate may take to get where a test waits for it (a pass never waits this long)
BLOCKS_WITHIN = 30.0
GATE_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"


def gate_with_stubs(tmp_path: Path, bin_dir: Path) -> Path:
    """A copy of the shipped gate that finds the stubs in `bin_dir` first: the gate sets its
    PATH itself, so stubs in the PATH it is given are never run."""
    text = GATE.read_text()
    assert text.count(GATE_PATH) == 1
    copy = tmp_path / "gpuslice-gate"
    copy.write_text(text.replace(GATE_PATH, f"PATH={bin_dir}:{GATE_PATH[5:]}"))
    return copy


def stub(path: Path, body: str) -> None:
    """An executable sh script, renamed into place: an earlier gate of the same test may be
    running the stub right now, and opening a file being executed for writing fails
    (ETXTBSY: a flaky test)."""
    path.parent.mkdir(exist_ok=True)
    new = path.with_name(f".{path.name}.new")
    new.write_text(f"#!/bin/sh\n{body}")
    new.chmod(0o755)
    new.replace(path)


class Gate:
    """One run of the shipped gate for UNIT, as the start `invocation`: its `dbus-send`
    records each call and answers as `dbus_send` says (at once, a grant, by default), and its
    `systemctl` shows the unit in the ActiveState written to `self.state` (none: a
    `systemctl` that fails)."""

    def __init__(
        self,
        tmp_path: Path,
        pipes: GatePipes,
        invocation: str = START,
        dbus_send: str = "",
        unit_env: dict[str, str] | None = None,
        unit: str = UNIT,
    ) -> None:
        self.calls = tmp_path / "dbus-send.calls"
        self.state = tmp_path / "active-state"
        bin_dir = tmp_path / "bin"
        stub(bin_dir / "dbus-send", f'echo "$@" >> {self.calls}\n{dbus_send}\n')
        stub(
            bin_dir / "systemctl",
            'if [ "$1" = is-active ]; then echo active; exit 0; fi\n'
            f'[ "$*" = "show -p ActiveState --value -- {unit}" ] || exit 1\n'
            f"exec cat {self.state}\n",
        )
        env = {
            # a PATH that would run stubs of the unit's, were the gate to keep it
            "PATH": f"{unit_bin(tmp_path)}:/usr/bin:/bin",
            "INVOCATION_ID": invocation,
            **(unit_env or {}),
        }
        pipe = pipes.directory / unit
        self.proc = subprocess.Popen(
            ["/bin/sh", str(gate_with_stubs(tmp_path, bin_dir)), unit, "0.5", str(pipe)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        STARTED.append(self)

    def asked_over_dbus(self) -> bool:
        return self.calls.exists() and "Acquire" in self.calls.read_text()

    def ended(self, timeout: float = 10, said: str = "") -> int:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"the gate still waits: {out!r} {err!r}") from None
        assert err == said
        assert not (unit_bin(self.calls.parent) / "ran").exists()  # nothing of the unit's PATH
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

    def blocked_in_pipe(self, opened: bool) -> None:
        """Wait until the shell sleeps in the pipe's open(2) (no writer: `opened` False) or
        its read(2) (`opened`): a signal sent before it got there (a loaded machine) is
        taken by the trap before the shell blocks, and no read is cut short. Waiting a fixed
        time made the test fail once under load."""
        wanted = _SYSCALLS.get(os.uname().machine, {}).get("read" if opened else "openat")
        deadline, call = time.monotonic() + BLOCKS_WITHIN, list[str]()
        while time.monotonic() < deadline:
            sleeping, call = self._sleeping()
            if wanted is None and self.waits(2.0):  # an architecture not listed: as before
                return
            if sleeping and call[:1] == [str(wanted)]:
                return
            assert self.proc.poll() is None, "the gate ended instead of waiting"
            self.waits(0.02)
        raise AssertionError(f"the gate never blocked in its pipe: syscall {call}")

    def waiting_on_dbus(self) -> None:
        """Wait until its dbus-send asked and the shell sleeps (in `wait`, the one place it
        sleeps after that): its trap is set by then. A signal sent a fixed 0.3 s after the
        start came, on a loaded machine, before the shell had set its trap, and killed it."""
        deadline = time.monotonic() + BLOCKS_WITHIN
        while not (self.asked_over_dbus() and self._sleeping()[0]):
            assert self.proc.poll() is None, "the gate ended instead of waiting"
            assert time.monotonic() < deadline, "the gate never waited on its D-Bus call"
            self.waits(0.02)

    def _sleeping(self) -> tuple[bool, list[str]]:
        """Whether the shell sleeps (state S), and the system call it is in (its number
        first, as /proc/PID/syscall gives it; none once it ended)."""
        try:
            state = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1]
            call = Path(f"/proc/{self.proc.pid}/syscall").read_text().split()
        except OSError:
            return False, []
        return state.split()[:1] == ["S"], call


# read(2) and openat(2), as /proc/PID/syscall numbers them
_SYSCALLS = {"x86_64": {"read": 0, "openat": 257}, "aarch64": {"read": 63, "openat": 56}}


def unit_bin(tmp_path: Path) -> Path:
    """The directory a unit's PATH= names first (a user's conda or venv, under User=): each
    command the gate runs is there, and says so if run."""
    bin_dir = tmp_path / "unit-bin"
    if not bin_dir.exists():
        for name in ("dbus-send", "systemctl", "sleep"):
            stub(bin_dir / name, f"echo {name} >> {bin_dir / 'ran'}\n")
    return bin_dir


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


def blocked_in_open(tmp_path: Path, pipes: GatePipes) -> Gate:
    """A gate that waits in open() on its pipe, which the controller made for an earlier start
    and does not hold open now."""
    pipes.at_gate(UNIT, START)
    pipes.close_all()
    gate = Gate(tmp_path, pipes)
    gate.blocked_in_pipe(opened=False)
    return gate


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
    gate = blocked_in_open(tmp_path, pipes)  # the pipe stays, as after an earlier start
    assert pipes.at_gate(UNIT, START)
    pipes.grant(UNIT)
    assert gate.ended() == 0
    assert not gate.asked_over_dbus()


def test_a_pipe_made_when_the_start_is_queued_holds_the_gate_for_the_controller(
    tmp_path: Path, pipes: GatePipes
) -> None:
    """JobNew comes before systemd spawns the gate: the pipe made then is there for the first
    start of a unit too, which found none and asked over D-Bus before."""
    pipes.expect(UNIT)
    path = pipes.directory / UNIT
    assert stat.S_ISFIFO(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(pipes.directory.stat().st_mode) == 0o700
    assert not pipes.holds(UNIT)  # nothing opened: made only
    gate = Gate(tmp_path, pipes)
    assert gate.waits()
    assert pipes.at_gate(UNIT, START)  # the start systemd shows at its gate
    pipes.grant(UNIT)
    assert gate.ended() == 0
    assert not gate.asked_over_dbus()


def test_without_a_pipe_made_ahead_the_first_start_asks_over_dbus(
    tmp_path: Path, pipes: GatePipes
) -> None:
    """What expect() saves: a gate that looks before the controller made any pipe."""
    pipes.directory.mkdir(parents=True)
    gate = Gate(tmp_path, pipes)
    gate.ended()
    assert gate.asked_over_dbus()


def test_a_pipe_is_made_ahead_beside_the_pipes_of_other_units(pipes: GatePipes) -> None:
    pipes.expect("other.service")
    pipes.expect(UNIT)  # the directory is there already
    assert sorted(p.name for p in pipes.directory.iterdir()) == [UNIT, "other.service"]


def test_making_a_pipe_ahead_leaves_what_is_there_alone(tmp_path: Path, pipes: GatePipes) -> None:
    assert pipes.at_gate(UNIT, START)
    pipes.expect(UNIT)  # held: the start at the gate keeps its pipe
    assert pipes.holds(UNIT)
    pipes.close_all()
    pipes.expect(UNIT)  # an earlier start's pipe: kept
    assert stat.S_ISFIFO((pipes.directory / UNIT).stat().st_mode)
    (pipes.directory / "other.service").write_text("not a pipe")
    pipes.expect("other.service")  # never replaced; at_gate sends its gate to the bus
    assert (pipes.directory / "other.service").read_text() == "not a pipe"


def test_a_pipe_that_cannot_be_made_ahead_is_said_at_debug_level_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    pipes = GatePipes(tmp_path / "file" / "gate")
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        pipes.expect(UNIT)  # never raises: its gate asks over D-Bus
    assert [r.levelname for r in caplog.records] == ["DEBUG"]
    said = caplog.records[0].getMessage()
    assert said.startswith(f"gate pipe of {UNIT} not made ahead: [Errno 20] Not a directory"), said


def test_retiring_a_pipe_removes_it_and_sends_a_gate_waiting_on_it_to_dbus(
    tmp_path: Path, pipes: GatePipes, caplog: pytest.LogCaptureFixture
) -> None:
    """An instance that went down gives its pipe up: a gate of a start that came meanwhile
    and waits on it asks over D-Bus, and nothing is left in the directory. Routine for every
    instance that ends, so not a line of the journal, even at debug level."""
    gate = blocked_in_open(tmp_path, pipes)
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        pipes.retire(UNIT)
    assert caplog.records == []
    assert gate.ended() == 0 and gate.asked_over_dbus()
    assert list(pipes.directory.iterdir()) == []
    pipes.retire(UNIT)  # none left: nothing to do, nothing raised
    assert pipes.at_gate(UNIT, START)  # held, then retired: let go of too
    pipes.retire(UNIT)
    assert not pipes.holds(UNIT) and list(pipes.directory.iterdir()) == []


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
    gate.blocked_in_pipe(opened=True)  # come later, it would wait in open() for good
    pipes.close_all()  # what the kernel does when the controller dies
    assert gate.ended() == 0
    assert gate.asked_over_dbus()


def test_release_wakes_a_gate_blocked_before_the_controller_opened_its_pipe(
    tmp_path: Path, pipes: GatePipes
) -> None:
    """`gpuslice release-gates` (ExecStopPost=): the controller died before it opened the pipe
    a gate already waits on."""
    gate = blocked_in_open(tmp_path, pipes)
    wake_and_remove(pipes.directory)
    assert gate.ended() == 0
    assert gate.asked_over_dbus()
    assert not pipes.directory.exists()
    wake_and_remove(pipes.directory)  # twice, or with nothing there: nothing to do


def test_a_gate_waiting_on_a_pipe_for_a_start_never_heard_is_woken_to_ask_over_dbus(
    tmp_path: Path, pipes: GatePipes
) -> None:
    """The bus daemon dropped every signal of the start (any user can fill the controller's
    queue): the gate waits in open() on the pipe an earlier start left, and nothing would
    ever open it; the start waited for ever. The audit that finds it holds it (its signal
    may be on its way); the next one, no signal between, wakes it: it asks over D-Bus."""
    gate = blocked_in_open(tmp_path, pipes)
    asked: list[str] = []

    def unheard(unit: str) -> bool:
        asked.append(unit)
        return True

    assert pipes.wake_unheard(unheard) == []
    assert asked == [UNIT]
    gate.blocked_in_pipe(opened=True)  # out of open(), in read(): our end is open
    assert not pipes.holds(UNIT)
    assert pipes.wake_unheard(unheard) == [UNIT]
    assert gate.ended() == 0
    assert gate.asked_over_dbus()
    assert stat.S_ISFIFO((pipes.directory / UNIT).stat().st_mode)  # kept for the next start
    assert pipes.wake_unheard(unheard) == []  # nothing waits any more


def test_a_gate_an_audit_holds_is_answered_through_its_pipe_when_its_signal_comes(
    tmp_path: Path, pipes: GatePipes
) -> None:
    """The start's signal was late, not lost (systemd holds its PropertiesChanged back while
    its bus queue is long): the audit found its gate waiting in open() first. Woken there,
    it asked over D-Bus, and the journal said its signals were lost. Held, it takes its
    grant from the pipe as any other, and the next audit has nothing to wake."""
    gate = blocked_in_open(tmp_path, pipes)
    assert pipes.wake_unheard(lambda unit: True) == []
    gate.blocked_in_pipe(opened=True)
    assert pipes.at_gate(UNIT, START)  # its signal: decided on now
    assert not pipes.at_gate(UNIT, START)  # and once
    assert pipes.wake_unheard(lambda unit: True) == []  # held for its start: not woken
    pipes.grant(UNIT)
    assert gate.ended() == 0
    assert not gate.asked_over_dbus()
    assert pipes.close(UNIT)  # its gate took the grant


def test_a_held_gate_stopped_before_the_next_audit_is_not_said_woken(
    tmp_path: Path, pipes: GatePipes
) -> None:
    """A held gate whose start was stopped (its shell killed) reads nothing: the next audit
    closes our end without a word, and a state read sending the unit's gate to D-Bus, or a
    close, lets go of our end at once."""
    gate = blocked_in_open(tmp_path, pipes)
    assert pipes.wake_unheard(lambda unit: True) == []
    gate.blocked_in_pipe(opened=True)
    gate.close()
    assert pipes.wake_unheard(lambda unit: True) == []
    for let_go in (pipes.at_gate_unknown, pipes.close):
        gate = blocked_in_open(tmp_path, pipes)
        gate.calls.unlink(missing_ok=True)
        assert pipes.wake_unheard(lambda unit: True) == []
        gate.blocked_in_pipe(opened=True)
        let_go(UNIT)
        assert gate.ended() == 0
        assert gate.asked_over_dbus()
        assert pipes.wake_unheard(lambda unit: True) == []


def test_a_gate_found_unheard_with_no_descriptor_to_spare_is_woken_at_once(
    tmp_path: Path,
) -> None:
    pipes = GatePipes(tmp_path / "run" / "gate", max_open=1)
    gate = blocked_in_open(tmp_path, pipes)
    assert pipes.at_gate("first.service", START)  # the one descriptor there is
    assert pipes.wake_unheard(lambda unit: unit == UNIT) == [UNIT]
    assert gate.ended() == 0
    assert gate.asked_over_dbus()
    pipes.close_all()


def test_a_start_at_the_gate_without_its_invocation_is_sent_to_dbus(
    tmp_path: Path, pipes: GatePipes
) -> None:
    gate = blocked_in_open(tmp_path, pipes)
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
    gate.blocked_in_pipe(opened=blocked_in == "read")
    gate.state.write_text("deactivating\n")  # systemd shows the stop before it reads a call
    gate.proc.send_signal(signal.SIGTERM)
    assert gate.ended() == 0  # inactive, not failed
    assert not gate.asked_over_dbus()


@pytest.mark.parametrize("killed", [1, 4])
def test_a_stop_whose_signal_kills_the_traps_own_question_still_ends_the_gate(
    tmp_path: Path, pipes: GatePipes, killed: int
) -> None:
    """The stop's SIGTERM reaches every process in the unit's cgroup, those forked while
    systemd walks it too: the `systemctl show` the trap forks died of it, said nothing, and
    the gate took the stop for a `systemctl kill` and waited on, the unit hung in stop-sigterm
    (seen in a loaded CI run, a start restarted by the controller). Asked again, it ends."""
    pipes.at_gate(UNIT, START)
    gate = Gate(tmp_path, pipes)
    asked = tmp_path / "asked"
    stub(
        tmp_path / "bin" / "systemctl",
        f'echo >> {asked}\n[ "$(wc -l < {asked})" -gt {killed} ] || kill -TERM $$\n'
        f"exec cat {gate.state}\n",
    )
    assert gate.waits()
    gate.state.write_text("deactivating\n")
    gate.proc.send_signal(signal.SIGTERM)
    assert gate.ended() == 0  # inactive, not failed
    assert len(asked.read_text().splitlines()) == killed + 1


@pytest.mark.parametrize("blocked_in", ["open", "read", "dbus"])
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["TERM", "INT", "HUP"]
)
def test_a_signal_that_is_no_stop_lets_no_start_through(
    tmp_path: Path, pipes: GatePipes, blocked_in: str, sig: signal.Signals
) -> None:
    """`systemctl kill UNIT` (whoever may start a unit may send it; an admin ending a start
    that seems stuck) signals the gate while systemd still shows the unit activating. The gate
    ended 0 at any TERM, INT or HUP, and systemd went on with the start: ungated, with no env
    file (every GPU visible) or an earlier grant's. It keeps waiting for its grant instead,
    and says why; a stop still ends it at once."""
    answer = tmp_path / "granted"
    if blocked_in != "dbus":
        pipes.at_gate(UNIT, START)
        if blocked_in == "open":
            pipes.close_all()
    else:
        pipes.directory.mkdir(parents=True)  # no pipe: it asks over D-Bus, and waits there
    waits_for_grant = f"while [ ! -e {answer} ]; do sleep 0.02; done"
    gate = Gate(tmp_path, pipes, dbus_send=waits_for_grant)
    if blocked_in != "dbus":
        gate.blocked_in_pipe(opened=blocked_in == "read")
    else:
        gate.waiting_on_dbus()
    gate.state.write_text("activating\n")
    gate.proc.send_signal(sig)
    assert gate.waits(1.0)  # not let through
    if blocked_in != "dbus":  # its pipe read cut short: it asks over D-Bus instead
        gate.waiting_on_dbus()
    assert gate.asked_over_dbus()
    answer.write_text("")  # the grant, over D-Bus
    said = f"signalled while {UNIT} is not being stopped: still waiting for its GPUs\n"
    assert gate.ended(said=said) == 0


def test_what_the_gate_says_names_its_unit_as_it_is_named(tmp_path: Path, pipes: GatePipes) -> None:
    """A unit's name may hold a backslash (an instance's escapes), which dash's echo reads as
    an escape: `\\c` cut the line there, `\\n` began another, in the unit's own journal."""
    unit = "job@a\\cb\\nc.service"
    answer = tmp_path / "granted"
    pipes.directory.mkdir(parents=True)  # no pipe: it asks over D-Bus, and waits there
    waits_for_grant = f"while [ ! -e {answer} ]; do sleep 0.02; done"
    gate = Gate(tmp_path, pipes, dbus_send=waits_for_grant, unit=unit)
    gate.waiting_on_dbus()
    gate.state.write_text("activating\n")
    gate.proc.send_signal(signal.SIGHUP)
    assert gate.waits(1.0)  # not let through
    answer.write_text("")  # the grant, over D-Bus
    said = f"signalled while {unit} is not being stopped: still waiting for its GPUs\n"
    assert gate.ended(said=said) == 0


def test_the_pipes_are_the_controllers_alone(tmp_path: Path, pipes: GatePipes) -> None:
    pipes.at_gate(UNIT, START)
    assert stat.S_IMODE(pipes.directory.stat().st_mode) == 0o700
    path = pipes.directory / UNIT
    assert stat.S_ISFIFO(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_something_else_in_a_pipes_place_is_never_written(
    tmp_path: Path, pipes: GatePipes, caplog: pytest.LogCaptureFixture
) -> None:
    """A file or a link where a pipe should be (not ours: only root writes there): the gate
    asks over D-Bus, nothing is written through it, and the controller says so once."""
    pipes.directory.mkdir(parents=True)
    target = tmp_path / "target"
    target.write_text("")
    (pipes.directory / UNIT).symlink_to(target)
    (pipes.directory / "plain.service").write_text("")
    with caplog.at_level(logging.DEBUG, logger="gpuslice.gatepipes"):
        assert not pipes.at_gate(UNIT, START)
        assert not pipes.at_gate("plain.service", START)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"gate pipe of {UNIT}: [Errno 40] ")
    assert lines[1] == "gate pipe of plain.service is not a pipe; its gate asks over D-Bus"
    assert target.read_text() == ""
    assert pipes.holding() == []
    gate = Gate(tmp_path, pipes)
    assert gate.ended() == 0
    assert gate.asked_over_dbus()


def test_a_pipe_that_cannot_be_made_sends_the_gate_to_dbus(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "run"
    blocker.write_text("")  # /run/gpuslice/gate cannot be made under a file
    pipes = GatePipes(blocker / "gate")
    with caplog.at_level(logging.WARNING, logger="gpuslice.gatepipes"):
        assert not pipes.at_gate(UNIT, START)
    assert pipes.holding() == []
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (
        f"gate pipe of {UNIT}: [Errno 20] Not a directory: '{blocker / 'gate'}'; "
        "its gate asks over D-Bus"
    )


def test_without_a_pipe_or_an_invocation_the_gate_asks_over_dbus(
    tmp_path: Path, pipes: GatePipes
) -> None:
    assert Gate(tmp_path, pipes).ended() == 0  # no pipe made yet
    assert Gate(tmp_path, pipes).asked_over_dbus()
    pipes.at_gate(UNIT, START)
    gate = Gate(tmp_path, pipes, invocation="")
    assert gate.ended() == 0
    assert gate.asked_over_dbus()


def test_an_invocation_id_not_in_systemds_form_never_passes_through_the_pipe(
    tmp_path: Path, pipes: GatePipes
) -> None:
    """A unit's own `Environment=INVOCATION_ID=-` overrides systemd's: read from the pipe,
    the line that sends a gate to D-Bus was taken for its grant, and the start ran unasked.
    Such a gate asks over D-Bus instead."""
    pipes.expect(UNIT)  # its start's pipe, made ahead
    gate = Gate(tmp_path, pipes, invocation=TO_THE_BUS)
    if gate.waits(1.0):  # in the pipe's open(): the controller sends it to D-Bus
        pipes.at_gate_unknown(UNIT)
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


def test_the_units_path_chooses_nothing_the_gate_runs(tmp_path: Path, pipes: GatePipes) -> None:
    """The gate runs as root with the unit's environment: a `User=` unit whose `PATH=` names
    a user's directory first (a conda or venv bin) had that user's dbus-send, sleep or
    systemctl run as root by its gate: any file the user put there. The shipped gate, its
    own PATH as it is but for stubs first (gate_with_stubs): the host's dbus-send and
    systemctl would ask this machine's bus and systemd, and the gate's way, and so what the
    test saw, would be what the machine has installed. Each of the three is run, the gate's."""
    pipes.directory.mkdir(parents=True)  # no pipe: it asks over D-Bus
    ran, own = tmp_path / "gate-ran", tmp_path / "bin"
    stub(own / "dbus-send", f"echo dbus-send >> {ran}\nexit 1\n")  # no controller answers
    stub(own / "sleep", f'echo sleep >> {ran}\nexec /bin/sleep "$1"\n')
    stub(own / "systemctl", f'echo systemctl >> {ran}\n[ "$1" != is-active ] || echo active\n')
    env = {"PATH": f"{unit_bin(tmp_path)}:/usr/bin:/bin", "INVOCATION_ID": START}
    proc = subprocess.Popen(
        ["/bin/sh", str(gate_with_stubs(tmp_path, own)), UNIT, "0.05", str(pipes.directory / UNIT)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + BLOCKS_WITHIN
        seen: set[str] = set()
        while seen != {"dbus-send", "sleep", "systemctl"}:  # it asks, pauses, looks at gpuslice
            assert proc.poll() is None, "the gate ended instead of waiting for the controller"
            assert time.monotonic() < deadline, f"only {sorted(seen)} ran"
            time.sleep(0.02)
            seen = set(ran.read_text().split()) if ran.exists() else set()
    finally:
        proc.kill()
        proc.wait()
    assert not (unit_bin(tmp_path) / "ran").exists()


# What the unit's environment may say that steers the gate's programs: systemctl, dbus-send
# (and glibc in each) read these, and a unit sets any of them (`Environment=`, its files)
UNIT_ENV = {
    "DBUS_SYSTEM_BUS_ADDRESS": "unixexec:path=/home/asr/evil",
    "DBUS_SESSION_BUS_ADDRESS": "unix:path=/home/asr/bus",
    "SYSTEMD_OFFLINE": "1",
    "SYSTEMD_PAGER": "/home/asr/pager",
    "SYSTEMD_COLORS": "1",
    "SYSTEMD_LOG_LEVEL": "debug",
    "SYSTEMD_BUS_TIMEOUT": "1",
    "SYSTEMCTL_FORCE_BUS": "1",
    "LANG": "de_DE.UTF-8",
    "LC_ALL": "de_DE.UTF-8",
    "GCONV_PATH": "/home/asr/gconv",
    "LOCPATH": "/home/asr/locale",
    "UNIT_OWN": "its own",
}


def test_the_gates_programs_run_with_its_path_alone(tmp_path: Path, pipes: GatePipes) -> None:
    """dbus-send follows DBUS_SYSTEM_BUS_ADDRESS: a `User=` unit's made its gate, as root, ask
    a user's socket (which answered Acquire: the start let through ungated) or run a user's
    program (`unixexec:path=`); systemctl with SYSTEMD_OFFLINE=1 prints nothing and exits 0;
    glibc in each loads locale data and gconv modules from LOCPATH and GCONV_PATH. Each
    program the gate runs (dbus-send, sleep, systemctl) sees its PATH and nothing else."""
    pipes.directory.mkdir(parents=True)  # no pipe: it asks over D-Bus
    own = tmp_path / "bin"
    for name in ("dbus-send", "sleep", "systemctl"):  # no controller answers
        # renamed into place once written: the test reads a file as soon as it is there, and
        # one that `env >> file` had only created read as empty (a loaded machine, 1 in 8)
        env = tmp_path / f"{name}.env"
        stub(own / name, f'env > "{env}.$$" && mv -f "{env}.$$" "{env}"\nexit 1\n')
    proc = subprocess.Popen(
        ["/bin/sh", str(gate_with_stubs(tmp_path, own)), UNIT, "0.05", str(pipes.directory / UNIT)],
        env={"PATH": "/usr/bin:/bin", "INVOCATION_ID": START, **UNIT_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen = [tmp_path / f"{name}.env" for name in ("dbus-send", "sleep", "systemctl")]
    try:
        deadline = time.monotonic() + BLOCKS_WITHIN
        while not all(p.exists() for p in seen):  # it asks, pauses, looks at gpuslice
            assert proc.poll() is None, "the gate ended instead of waiting for the controller"
            assert time.monotonic() < deadline, [p.name for p in seen if p.exists()]
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait()
    for path in seen:
        names = {line.partition("=")[0] for line in path.read_text().splitlines()}
        assert names - {"PWD"} == {"PATH"}, path.name  # PWD: the stub's own shell sets it


def test_a_units_systemd_offline_does_not_hide_its_stop_from_the_gate(
    tmp_path: Path, pipes: GatePipes
) -> None:
    """With the unit's SYSTEMD_OFFLINE=1, the trap's `systemctl show` printed nothing: the
    gate took the stop for a `systemctl kill` and waited on, and the unit ended failed at
    TimeoutStopSec=. Its stubbed systemctl prints nothing whenever that is set, as systemd's."""
    pipes.at_gate(UNIT, START)
    gate = Gate(tmp_path, pipes, unit_env={"SYSTEMD_OFFLINE": "1"})
    stub(
        tmp_path / "bin" / "systemctl",
        '[ -z "${SYSTEMD_OFFLINE:-}" ] || exit 0\n'
        f'[ "$*" = "show -p ActiveState --value -- {UNIT}" ] || exit 1\n'
        f"exec cat {gate.state}\n",
    )
    gate.blocked_in_pipe(opened=True)
    gate.state.write_text("deactivating\n")
    gate.proc.send_signal(signal.SIGTERM)
    assert gate.ended() == 0  # inactive, not failed, and nothing said
    assert not gate.asked_over_dbus()


def first_pause(tmp_path: Path, pipes: GatePipes, unit_env: dict[str, str]) -> str:
    """How long the gate (its argument "0.5", as the generator writes it) first sleeps after
    an ask that failed, as its `sleep` is told."""
    pipes.directory.mkdir(parents=True)  # no pipe: it asks over D-Bus
    slept = tmp_path / "slept"
    stub(tmp_path / "bin" / "sleep", f'echo "$1" >> {slept}\nexec /bin/sleep 1\n')
    gate = Gate(tmp_path, pipes, dbus_send="exit 1", unit_env=unit_env)
    for _ in range(500):
        if slept.exists() and slept.read_text().endswith("\n"):
            break
        assert gate.waits(0.02), gate.proc.communicate()
    return slept.read_text().splitlines()[0]


@pytest.mark.parametrize(
    ("unit_env", "pause"),
    [
        ({"GPUSLICE_GATE_RETRY": "2"}, "2.000"),
        ({"GPUSLICE_GATE_RETRY": ""}, "0.500"),
        ({}, "0.500"),
    ],
    ids=["env", "empty", "argument"],
)
def test_the_gate_retries_after_the_retry_its_drop_ins_environment_sets(
    tmp_path: Path, pipes: GatePipes, unit_env: dict[str, str], pause: str
) -> None:
    """gate_retry_seconds reaches the gate in GPUSLICE_GATE_RETRY (the drop-in's
    Environment=), not in its command line, which stays the same whatever the retry: a
    changed line is one systemd no longer finds at a daemon-reload, and a start waiting at
    its gate then skipped the unit's own ExecStartPre= lines once granted. Without it (a
    drop-in of an older version), the argument."""
    assert first_pause(tmp_path, pipes, unit_env) == pause


@pytest.mark.parametrize("retry", ["x", ".", "1.2.3", "-1", "1 2"])
def test_a_retry_in_the_environment_that_is_no_number_fails_the_start_and_says_so(
    tmp_path: Path, pipes: GatePipes, retry: str
) -> None:
    """As a bad RETRY_SECONDS argument does (only a drop-in of the admin's sets another)."""
    gate = Gate(tmp_path, pipes, unit_env={"GPUSLICE_GATE_RETRY": retry})
    said = f"gpuslice-gate: GPUSLICE_GATE_RETRY={retry} is not a number of seconds\n"
    assert gate.ended(said=said) == 2
    assert not gate.asked_over_dbus()


# ---- what mutation testing asked for: each path out of the pipes, and its words ----


def test_reset_wakes_a_waiting_gate_and_lets_go_of_every_pipe(
    tmp_path: Path, pipes: GatePipes
) -> None:
    pipes.at_gate("held.service", START)
    pipes.at_gate(UNIT, START)
    pipes.close(UNIT)
    gate = Gate(tmp_path, pipes)
    gate.blocked_in_pipe(opened=False)
    pipes.reset()
    assert gate.ended() == 0
    assert gate.asked_over_dbus()
    assert pipes.holding() == []
    assert not pipes.holds("held.service")
    assert not pipes.directory.exists()


def test_holds_says_whether_a_pipe_is_held(pipes: GatePipes) -> None:
    assert not pipes.holds(UNIT)
    pipes.at_gate(UNIT, START)
    assert pipes.holds(UNIT)
    assert not pipes.holds("other.service")


def _open_ends(pipes: GatePipes) -> list[str]:
    """The pipes this process holds open below the controller's directory."""
    return open_below(pipes.directory)


def test_a_new_start_closes_the_last_ones_end(pipes: GatePipes) -> None:
    pipes.at_gate(UNIT, OTHER)
    pipes.at_gate(UNIT, START)
    # the first start's end is closed, not leaked
    assert _open_ends(pipes) == [str(pipes.directory / UNIT)]
    pipes.close_all()
    assert _open_ends(pipes) == []


def test_the_controllers_end_neither_blocks_nor_reaches_a_child(pipes: GatePipes) -> None:
    pipes.at_gate(UNIT, START)
    fd = pipes._open[UNIT].fd
    assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
    assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC


def test_a_link_to_a_pipe_elsewhere_is_not_followed(
    tmp_path: Path, pipes: GatePipes, caplog: pytest.LogCaptureFixture
) -> None:
    """O_NOFOLLOW: a grant is never written into a pipe outside the controller's directory."""
    elsewhere = tmp_path / "elsewhere"
    os.mkfifo(elsewhere)
    pipes.directory.mkdir(parents=True)
    (pipes.directory / UNIT).symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="gpuslice.gatepipes"):
        assert not pipes.at_gate(UNIT, START)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"gate pipe of {UNIT}: [Errno 40] ")
    reader = os.open(elsewhere, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert os.read(reader, 100) == b""
    finally:
        os.close(reader)
    assert not (pipes.directory / UNIT).exists()  # removed: the next gate asks over D-Bus


def test_a_pipe_that_cannot_be_written_sends_the_gate_to_dbus(
    tmp_path: Path, pipes: GatePipes, caplog: pytest.LogCaptureFixture
) -> None:
    gate = blocked_in_open(tmp_path, pipes)
    pipes.at_gate(UNIT, START)
    os.close(pipes._open[UNIT].fd)
    with caplog.at_level(logging.DEBUG, logger="gpuslice.gatepipes"):
        assert not pipes.grant(UNIT)
    [line] = [r.getMessage() for r in caplog.records]  # said once, as a warning
    assert line.startswith(f"gate pipe of {UNIT}: [Errno 9] ")
    assert line.endswith("; its gate asks over D-Bus")
    assert not pipes.holds(UNIT)
    assert gate.ended() == 0
    assert gate.asked_over_dbus()
    assert not (pipes.directory / UNIT).exists()


def test_sending_a_gate_to_dbus_says_why_at_debug_level(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pipes = GatePipes(tmp_path / "gate", max_open=1)
    pipes.at_gate("first.service", START)
    with caplog.at_level(logging.DEBUG, logger="gpuslice.gatepipes"):
        pipes.at_gate(UNIT, START)
        pipes.at_gate_unknown("other.service")
    assert [r.getMessage() for r in caplog.records] == [
        f"gate of {UNIT} sent to D-Bus: too many gates wait at once",
        "gate of other.service sent to D-Bus: its start is not known",
    ]
    pipes.close_all()


def test_release_clears_a_leftover_of_an_earlier_release(tmp_path: Path) -> None:
    directory = tmp_path / "gate"
    aside = tmp_path / f".gate.released-{os.getpid()}"
    (aside / "old").mkdir(parents=True)
    directory.mkdir()
    os.mkfifo(directory / UNIT)
    wake_and_remove(directory)
    assert sorted(os.listdir(tmp_path)) == []


def test_release_wakes_in_place_when_the_directory_cannot_be_moved(
    tmp_path: Path, pipes: GatePipes, caplog: pytest.LogCaptureFixture
) -> None:
    gate = blocked_in_open(tmp_path, pipes)
    aside = pipes.directory.with_name(f".gate.released-{os.getpid()}")
    aside.write_text("")  # a file: the directory cannot be renamed onto it
    with caplog.at_level(logging.WARNING, logger="gpuslice.gatepipes"):
        wake_and_remove(pipes.directory)
    assert gate.ended() == 0
    assert gate.asked_over_dbus()
    assert not pipes.directory.exists()
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"cannot move {pipes.directory} aside: [Errno 20] ")


def test_release_of_something_not_a_directory_says_so_and_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "gate"
    directory.write_text("")
    with caplog.at_level(logging.WARNING, logger="gpuslice.gatepipes"):
        wake_and_remove(directory)
    aside = tmp_path / f".gate.released-{os.getpid()}"
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"cannot read {aside}: [Errno 20] ")


def test_release_opens_nothing_through_a_link(tmp_path: Path, pipes: GatePipes) -> None:
    """A link in the directory is removed, not followed: a reader of its target stays
    waiting (opening the target would wake it)."""
    elsewhere = tmp_path / "elsewhere"
    os.mkfifo(elsewhere)
    reader = subprocess.Popen(["/bin/sh", "-c", f"read x < {elsewhere}"])
    try:
        pipes.directory.mkdir(parents=True)
        (pipes.directory / "link.service").symlink_to(elsewhere)
        os.mkfifo(pipes.directory / UNIT)
        wake_and_remove(pipes.directory)
        assert not pipes.directory.exists()
        with pytest.raises(subprocess.TimeoutExpired):
            reader.wait(0.3)
    finally:
        reader.kill()
        reader.wait()


def test_sending_a_gate_to_dbus_through_a_full_pipe_still_removes_it(pipes: GatePipes) -> None:
    """The "-" does not fit (a pipe holds 64 KiB): the pipe is removed all the same."""
    pipes.at_gate(UNIT, START)
    filler = os.open(pipes.directory / UNIT, os.O_RDWR | os.O_NONBLOCK)
    try:
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(filler, b"x" * 4096)
        pipes.close(UNIT)
        pipes.at_gate_unknown(UNIT)
        assert not (pipes.directory / UNIT).exists()
    finally:
        os.close(filler)


def test_the_gate_does_not_wait_on_a_link_to_a_pipe(tmp_path: Path, pipes: GatePipes) -> None:
    """A pipe nobody writes, behind a link at the gate's path: it asks over D-Bus at once."""
    elsewhere = tmp_path / "elsewhere"
    os.mkfifo(elsewhere)
    pipes.directory.mkdir(parents=True)
    (pipes.directory / UNIT).symlink_to(elsewhere)
    gate = Gate(tmp_path, pipes)
    assert gate.ended() == 0
    assert gate.asked_over_dbus()


@contextlib.contextmanager
def no_file_can_be_opened() -> Iterator[None]:
    """EMFILE for every open() of this process (as for a controller at its LimitNOFILE=, or
    ENFILE with the host's file table full): the soft limit lowered to the descriptors open
    now, and the holes below it filled."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        with pytest.raises(OSError) as full:
            os.open("/dev/null", os.O_RDONLY)
        assert full.value.errno == errno.EMFILE
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_gate_in_open_stays_within_reach_when_its_pipe_cannot_be_opened(
    tmp_path: Path, pipes: GatePipes, caplog: pytest.LogCaptureFixture
) -> None:
    """A gate blocked in open() on its pipe (made at JobNew) is woken only by an open of that
    pipe. When the controller can open no file (EMFILE), its pipe must stay: removed, the gate
    waited on a pipe nobody could ever reach again, not `gpuslice release-gates` nor the next
    controller, and its start for ever. Kept, either wakes it; the journal says so."""
    gate = blocked_in_open(tmp_path, pipes)
    with caplog.at_level(logging.WARNING, logger="gpuslice.gatepipes"), no_file_can_be_opened():
        assert not pipes.at_gate(UNIT, START)
        pipes.at_gate_unknown(UNIT)
        pipes.retire(UNIT)
    assert stat.S_ISFIFO((pipes.directory / UNIT).stat().st_mode)
    assert pipes.holding() == []
    assert gate.waits()
    kept = (
        f"gate pipe of {UNIT}: [Errno 24] Too many open files: '{pipes.directory / UNIT}'; "
        "kept: a gate waiting on it waits until gpuslice can open it "
        "(`systemctl restart gpuslice` wakes it)"
    )
    said = [r.getMessage() for r in caplog.records]
    assert said == [kept] * 3, said  # at its gate, its start unknown, retired
    wake_and_remove(pipes.directory)  # ExecStopPost=, or the next controller's start-up
    assert gate.ended() == 0
    assert gate.asked_over_dbus()


@pytest.mark.parametrize(
    ("soft", "budget"),
    [(1024, 1024 - RESERVED_FDS), (RESERVED_FDS - 1, 0), (1 << 20, MAX_OPEN)],
)
def test_as_many_pipes_as_the_descriptors_allow(
    monkeypatch: pytest.MonkeyPatch, soft: int, budget: int
) -> None:
    """A gate beyond the pipes holds one of root's 256 connections to the system bus until it
    is answered; past them, every other root client of the bus (pam_systemd at a login) is
    refused. So pipes go as far as the descriptors go, leaving RESERVED_FDS to the rest."""
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, 1 << 20))
    assert pipe_budget() == budget
    assert GatePipes(Path("/nonexistent")).max_open == budget


def test_an_unlimited_soft_limit_allows_max_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY,) * 2)
    assert pipe_budget() == MAX_OPEN


@pytest.mark.parametrize(
    ("soft", "hard", "raised"),
    [
        (1024, 524288, MAX_OPEN + RESERVED_FDS),
        (1024, 2000, 2000),
        (1024, resource.RLIM_INFINITY, MAX_OPEN + RESERVED_FDS),
        (MAX_OPEN + RESERVED_FDS, 524288, None),
        (resource.RLIM_INFINITY, resource.RLIM_INFINITY, None),
    ],
)
def test_the_controller_raises_its_soft_limit_within_the_hard_one(
    monkeypatch: pytest.MonkeyPatch, soft: int, hard: int, raised: int | None
) -> None:
    """systemd gives a service 1024 descriptors (soft): 512 pipes only. Raised within the hard
    limit by the controller itself (a LimitNOFILE= above a container's hard limit would keep
    it from starting at all)."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, hard))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: calls.append(limits))
    raise_fd_limit()
    assert calls == ([] if raised is None else [(raised, hard)])


def test_a_refused_raise_leaves_the_limit_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise ValueError("not allowed to raise maximum limit")

    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 524288))
    monkeypatch.setattr(resource, "setrlimit", refuse)
    raise_fd_limit()
