"""Promises of README.md's "Security model" and "While the controller is down" that only an
integration test held (tests/integration/test_attacker.py, a booted container): the shipped
bus policy on a private dbus-daemon, and the shipped gate run by /bin/sh.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from dbus_next import Message, MessageType

from gpuslice.service import ACCESS_DENIED, BUS_NAME, INTERFACE, OBJECT_PATH
from tests.test_cli_bus_mutation import closed as closed
from tests.test_cli_bus_mutation import policed_bus as policed_bus
from tests.test_dbus_adapter import connect, run
from tests.test_gatepipes import gate_with_stubs

# ---------------------------------------------------------------------------------------------
# "Only root may call Acquire, Plan and Reload"; "the shipped bus policy also refuses
# signals to the controller from anyone but root"


def test_a_user_may_call_status_and_nothing_else_nor_send_the_controller_a_signal(
    policed_bus: str, closed: None
) -> None:
    """Under data/org.gpuslice.Scheduler1.conf's default context (what any local user gets),
    Acquire, Plan, Reload and a method the controller does not have are refused by the bus
    daemon (AccessDenied) before the controller reads them, and a signal addressed to the
    controller never reaches it; Status does. The controller's own checks (the caller's
    cgroup for Acquire) are the second wall, not the only one."""
    seen: list[tuple[str, str]] = []  # what the controller got from the user
    users: list[str] = []

    async def scenario() -> None:
        controller = await connect(policed_bus)

        def handle(msg: Message) -> Message | bool:
            if msg.sender not in users:
                return False
            seen.append((msg.message_type.name, msg.member or ""))
            if msg.message_type is MessageType.METHOD_CALL:
                return Message.new_method_return(msg, "s", ["{}"])
            return False

        controller.add_message_handler(handle)
        await controller.request_name(BUS_NAME)
        user = await connect(policed_bus)
        users.append(user.unique_name)
        refused: dict[str, str | None] = {}
        for member, signature, body in (
            ("Acquire", "s", ["job.service"]),
            ("Plan", "s", ["job.service"]),
            ("Reload", "", []),
            ("Frobnicate", "", []),
        ):
            call = Message(
                destination=BUS_NAME,
                path=OBJECT_PATH,
                interface=INTERFACE,
                member=member,
                signature=signature,
                body=body,
            )
            answer = await user.call(call)
            refused[member] = None if answer is None else answer.error_name
        forged = Message(
            message_type=MessageType.SIGNAL,
            destination=BUS_NAME,
            path=OBJECT_PATH,
            interface=INTERFACE,
            member="Forged",
        )
        await user.send(forged)
        # the bus daemon keeps one sender's messages in order: once Status is answered, a
        # signal let through would have been seen before it
        status = Message(
            destination=BUS_NAME, path=OBJECT_PATH, interface=INTERFACE, member="Status"
        )
        answer = await user.call(status)
        assert answer is not None and answer.message_type is MessageType.METHOD_RETURN, answer
        members = ("Acquire", "Plan", "Reload", "Frobnicate")
        assert refused == dict.fromkeys(members, ACCESS_DENIED)

    run(scenario)
    assert seen == [("METHOD_CALL", "Status")]


# ---------------------------------------------------------------------------------------------
# "Stopping a waiting unit ends it at once, whatever its KillMode="

DEADLINE = 10.0  # seconds: a gate that still waits by then waits for good


def _wait_for(path: Path, gate: subprocess.Popen[str] | None = None) -> None:
    """Until `path` is there (the stub wrote it), while `gate` (if given) still runs."""
    end = time.monotonic() + DEADLINE
    while not path.exists():
        if (gate is not None and gate.poll() is not None) or time.monotonic() > end:
            ended = "" if gate is None else f"; the gate ended with {gate.poll()}"
            raise AssertionError(f"{path.name} never appeared{ended}")
        time.sleep(0.01)


def _waits_in_shell(gate: subprocess.Popen[str]) -> None:
    """Until the gate's shell sleeps: once its dbus-send runs, only in `wait`, where $child
    names the call. A signal before that (the child forked, `child=$!` not run yet: a
    loaded machine that ran the stub first) leaves the trap nothing to end."""
    end = time.monotonic() + DEADLINE
    while Path(f"/proc/{gate.pid}/stat").read_text().rsplit(")", 1)[1].split()[:1] != ["S"]:
        assert gate.poll() is None and time.monotonic() < end, "the gate never waited"
        time.sleep(0.01)


def test_a_gate_stopped_while_its_dbus_call_waits_ends_at_once_and_ends_its_call(
    tmp_path: Path,
) -> None:
    """The gate waits in its D-Bus call (the controller has not answered: it waits for its
    GPUs); systemd stops the unit with KillMode=mixed or process, which signals only the
    gate's shell, not its dbus-send. The shell ends at once, inactive (exit 0, not failed),
    and ends the call it was waiting on: a dbus-send run in the foreground held the shell,
    and the stop, until systemd's TimeoutStopSec= killed it (a unit stopped to give way
    failed, and its waiter waited as long)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    asking, ended = tmp_path / "asking", tmp_path / "ended"
    stub = bin_dir / "dbus-send"
    stub.write_text(
        "#!/bin/sh\n"
        f"trap 'echo TERM > {ended}; exit 1' TERM\n"
        f"echo $$ > {asking}\n"
        "while :; do sleep 0.05; done\n"
    )
    stub.chmod(0o755)
    systemctl = bin_dir / "systemctl"  # a stop: systemd shows the unit deactivating
    systemctl.write_text("#!/bin/sh\necho deactivating\n")
    systemctl.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin"}  # no INVOCATION_ID, no pipe: the D-Bus way
    gate = subprocess.Popen(
        ["/bin/sh", str(gate_with_stubs(tmp_path, bin_dir)), "job.service", "0.5"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: the test ends whatever it leaves
    )
    try:
        _wait_for(asking, gate)
        _waits_in_shell(gate)
        gate.send_signal(signal.SIGTERM)  # the shell only, as KillMode=mixed does
        try:
            out, err = gate.communicate(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            raise AssertionError("the gate still waits after SIGTERM") from None
        assert (gate.returncode, out, err) == (0, "", "")
        _wait_for(ended)  # its call was ended too, not left waiting on the bus
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(gate.pid, signal.SIGKILL)
        gate.communicate()
