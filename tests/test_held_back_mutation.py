"""Mutation-guided checks of a call taken as unanswered (gpuslice/systemd.py `_unanswered`):
what the journal says, what the caller is told, and that a late answer tells nobody. The
timer is fired by hand: no wall-clock race."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from dbus_next import Message

from gpuslice.core.scheduler import SavedState
from gpuslice.systemd import CALL_TIMEOUT, NO_REPLY, Systemd, SystemdError
from tests.test_controller import (
    Bed,
    at_gate,
    bed_config,
    run,
    settle,
    shell_reader,
    state,
    until,
    write_unannotated,
)
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_controller import signal as signal_of
from tests.test_controller_reload import HeldScan
from tests.test_controller_run import ENDS_WITHIN
from tests.test_dbus_adapter import JOB, connect
from tests.test_dbus_adapter import bus_address as bus_address
from tests.test_dbus_adapter import bus_daemon as bus_daemon
from tests.test_dbus_adapter import run as run_on_bus

SYSTEMD = ":1.99"  # systemd's unique name, as followed


def _stop_call() -> Message:
    return Message(
        destination="org.freedesktop.systemd1",
        path="/org/freedesktop/systemd1",
        interface="org.freedesktop.systemd1.Manager",
        member="StopUnit",
        signature="ss",
        body=["a.service", "replace"],
        serial=4242,
    )


def test_a_call_taken_as_unanswered_says_which_and_tells_nobody_of_a_late_answer(
    bus_address: str, caplog: pytest.LogCaptureFixture
) -> None:
    """CALL_TIMEOUT ran out for a StopUnit whose caller is told its job in message order:
    the journal names the call and why its answer was lost, the caller's error says how
    long it waited, and an answer that comes after all tells nobody of a job (told, the
    unit's stop was taken as ours twice: once failed, once found)."""

    async def scenario() -> None:
        systemd = Systemd(await connect(bus_address))
        systemd.owner = SYSTEMD
        call = _stop_call()
        told: list[Message] = []
        systemd._told[call.serial] = told.append
        handlers = systemd.bus._method_return_handlers
        handlers[call.serial] = lambda reply, err: None  # as bus._call left it
        reply: asyncio.Future[Message | None] = asyncio.get_running_loop().create_future()
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            systemd._unanswered(reply, call)  # the timer, fired by hand
        with pytest.raises(SystemdError) as lost:
            reply.result()
        assert lost.value.name == NO_REPLY
        assert lost.value.text == f"no answer within {CALL_TIMEOUT:g} s"
        assert [r.getMessage() for r in caplog.records] == [
            "no answer to org.freedesktop.systemd1.Manager.StopUnit within "
            f"{CALL_TIMEOUT:g} s: the bus daemon drops answers to a connection whose queue "
            "is full (a flood of calls to gpuslice?); taken as unanswered"
        ]
        late = Message.new_method_return(call, "o", [JOB])
        late.sender = SYSTEMD
        systemd._answered(late)  # read before the caller resumes: in message order
        assert told == []
        assert call.serial not in handlers  # dbus-next drops the late answer too

    run_on_bus(scenario)


def _at_gate_by_signal(bed: Bed, unit: str, job_id: int) -> None:
    """The unit's start as systemd shows it: its JobNew (which makes its pipe), then its gate
    in systemd's signal."""
    job = f"/org/freedesktop/systemd1/job/{job_id}"
    bed.systemd.units[unit] = state(unit, "activating", "start-pre", job_id, "start")
    bed.controller.on_job_new(job_id, job, unit)
    signal_of(bed, unit, {**at_gate(), "Job": (job_id, job)})


def test_starts_held_back_are_each_judged_and_an_unannotated_ones_gate_sent_to_d_bus(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two starts are seen at their gate while a rescan reads the unit files: urgent.service,
    whose annotation that reload took out, then mid.service (5). Once the scan is read,
    urgent.service's gate, waiting on the pipe its JobNew made, is sent to D-Bus (nobody
    would ever write that pipe: it waited for ever), and mid.service is judged too (one
    start judged no further than the first was left waiting): it preempts low.service."""
    bed = Bed(
        tmp_path,
        {
            "low.service": "Priority=90\n",
            "urgent.service": "Priority=10\n",
            "mid.service": "Priority=5\n",
        },
        [state("low.service", "active", "running")],
        SavedState(holders={"low.service": ((0,), "running", 1, "")}, seq=1),
        config=bed_config(tmp_path),
    )
    held = HeldScan(monkeypatch)
    pipe = Path(bed.config.runtime_dir) / "gate" / "urgent.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        write_unannotated(tmp_path, "urgent.service")
        await held.reloaded(bed)
        _at_gate_by_signal(bed, "urgent.service", 7)
        _at_gate_by_signal(bed, "mid.service", 8)
        await settle()
        assert list(ctl.rescans.after_scan) == ["urgent.service", "mid.service"] and pipe.exists()
        gate = await shell_reader(pipe)  # as a gate that found its pipe
        try:
            assert gate.returncode is None
            held.go.set()  # also at the end of every path: HeldScan waits for it
            out, _ = await asyncio.wait_for(gate.communicate(), ENDS_WITHIN)
            assert out == b"read [-]\n"  # asks over D-Bus
            await until(lambda: ("stop", "low.service") in bed.systemd.calls)
            assert ctl.scheduler.is_waiting("mid.service")
        finally:
            held.go.set()
            if gate.returncode is None:
                gate.kill()
            await gate.wait()

    run(test)
