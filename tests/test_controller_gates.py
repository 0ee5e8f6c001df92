"""The gate path of the controller, pinned where mutation testing found no test holding it.

gpuslice/controller.py answers each start's gate (through its pipe, or over D-Bus), checks
who calls, withholds a grant until its environment file is written, counts every answer and
takes in what systemd says of the units at their gates (on_unit_changed, _unmanaged_gate,
_follow_gate, _apply, Gates.verify_acquire, acquire_verified, _grant_again, serve_gate, and
gpuslice/delivery.py's deliver, _write_or_withhold, _deliver_withheld). Mutants of those
functions survived the
other controller tests: a gate's pipe let go while its line was unread, a cancelled start
granted, a gate sent to D-Bus early, a stale grant said again on GPUs a more urgent unit
takes, a counter that stopped counting, a log line an admin reads with other words. Each
test here states the rule it holds, and why. The last ones hold the env file of a unit let
through on GPUs still held for it, its annotation gone (Gates.let_through, Delivery.names_held
and _let_through_withheld), and of an instance so held when it goes down (_apply,
Instances.went_down).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from functools import partial
from pathlib import Path

import pytest

from gpuslice import calls as calls_module
from gpuslice import controller as controller_module
from gpuslice import delivery as delivery_module
from gpuslice.controller import Controller
from gpuslice.core.scheduler import Phase, SavedState
from gpuslice.nvml import DeviceScan, GpuProcess
from gpuslice.paths import env_file
from gpuslice.systemd import Queued, SystemdError
from tests.test_controller import (
    GIB,
    HOUR,
    PATIENCE,
    START,
    Bed,
    StubNvml,
    _no_notify_socket,  # noqa: F401  (autouse: as in tests/test_controller.py)
    at_gate,
    bed_config,
    due_now,
    frozen_beside_voice,
    goes_down,
    held_after_answer,
    holding_a_gpu_each,
    late_stops,
    low_holds_gpu_0,
    messages,
    past,
    process_in,
    queued,
    read_pipe,
    refill_bed,
    restarted_by_hand,
    run,
    settle,
    shell_reader,
    signal,
    state,
    unannotate,
    until,
    write_unannotated,
    write_unit,
)
from tests.test_controller import cgroup_of as cgroup_of  # a fixture

NO_REPLY = SystemdError(
    "org.freedesktop.DBus.Error.NoReply",
    "Message recipient disconnected from message bus without replying",
)


def running() -> dict[str, object]:
    """PropertiesChanged of a unit past its gate."""
    return {"ActiveState": "active", "SubState": "running"}


# ---- the pipe of a unit gpuslice no longer manages ----


def test_a_granted_gate_whose_annotation_went_keeps_its_pipe_until_systemd_names_its_state(
    tmp_path: Path,
) -> None:
    """a.service was granted GPU 0 at its pipe and its gate has not read the line yet when
    a daemon-reload takes its annotation out. A change of the unit that names no SubState (a
    job queued on it; the adapter drops a SubState it cannot read) says nothing of its gate:
    our end of the pipe stays open, so the gate still reads its grant. Closed before the
    gate had opened the pipe, the line went with the last writer, and the gate blocked in
    open() on a pipe nobody would open again. Once systemd shows it past its gate, the pipe
    is let go."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_unit_changed("a.service", at_gate())
        await settle()
        assert ctl.gates.answered("a.service")
        await unannotate(ctl, tmp_path, "a.service")
        assert ctl.gates.holding() == ["a.service"]
        ctl.on_unit_changed("a.service", {"Job": (7, "/org/freedesktop/systemd1/job/7")})
        ctl.on_unit_changed("a.service", {"ActiveState": "activating"})
        assert ctl.gates.holding() == ["a.service"]
        assert read_pipe(bed, "a.service") == START.hex() + "\n"
        ctl.on_unit_changed("a.service", running())
        assert ctl.gates.holding() == []

    run(test)


# ---- the counters of gate answers ----


def test_every_gate_answer_is_counted_once_by_the_way_it_went(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """`gpuslice metrics` shows how gates were answered (gpuslice_gate_answers_total by
    way): two starts that took their line from the pipe count 2 there; two grants said over
    D-Bus, and a pipe grant said again over D-Bus to a gate that had not found its pipe,
    count 3 there. A counter that is set rather than added to tells an admin that the fast
    way was taken once."""
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n", "b.service": "Priority=50\n", "c.service": "Priority=50\n"},
        [],
    )
    cgroup_of[4242] = "b.service"
    cgroup_of[4243] = "c.service"
    cgroup_of[4244] = "a.service"
    second = bytes.fromhex("ab" * 16)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        for start in (START, second):  # two starts of a.service, each read at its pipe
            ctl.on_unit_changed("a.service", at_gate(start))
            await settle()
            assert read_pipe(bed, "a.service") == start.hex() + "\n"
            ctl.on_unit_changed("a.service", running())
            goes_down(bed, "a.service")
            await settle()
        assert ctl.counters.gate_answers == {"pipe": 2, "dbus": 0}
        for unit, sender, pid in (("b.service", ":1.9", 4242), ("c.service", ":1.10", 4243)):
            await bed.acquire(unit, sender, pid)  # no pipe: over D-Bus
            assert bed.service.granted[-1] == (unit, "0")
            goes_down(bed, unit)
            await settle()
        assert ctl.counters.gate_answers == {"pipe": 2, "dbus": 2}
        bed.systemd.invocations["a.service"] = START.hex()
        ctl.on_unit_changed("a.service", at_gate(START))
        await settle()
        await bed.acquire("a.service", ":1.11", 4244)  # its gate found no pipe
        assert bed.service.waiting == {}
        assert ctl.counters.gate_answers == {"pipe": 2, "dbus": 3}

    run(test)


# ---- a start whose signals were all lost ----


def test_a_gate_waiting_on_its_pipe_for_a_start_no_signal_told_is_woken_by_the_audit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """a.service ran once (its pipe stays); its next start's signals, JobNew and start-pre
    alike, were all dropped by the bus daemon (a user's flood of Status calls fills the
    controller's queue). Its gate waited in open() on that pipe for ever: nothing opens a
    pipe but a signal of the start, and the audit read only the units the core knows. An
    audit holds it, the next one wakes it, to ask over D-Bus. Not while a.service holds its
    GPU: the core knows it, and the audit's read of it tells (a restart's signals lost)."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    pipe = Path(bed.config.runtime_dir) / "gate" / "a.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_unit_changed("a.service", at_gate(START))
        await settle()
        assert read_pipe(bed, "a.service") == START.hex() + "\n"
        ctl.on_unit_changed("a.service", running())
        await settle()
        assert not ctl.gates.holds("a.service") and pipe.exists()
        gate = await shell_reader(pipe)  # as the gate of a start unheard
        await ctl.reads.audit()
        assert gate.returncode is None  # a holder: known to the core, read by the audit
        goes_down(bed, "a.service")
        await settle()
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            await ctl.reads.audit()  # held: its start's signal may be on its way
            await asyncio.sleep(0.1)
            assert gate.returncode is None
            assert not [m for m in messages(caplog) if "signals were lost" in m]
            await ctl.reads.audit()  # none came
            out, _ = await asyncio.wait_for(gate.communicate(), PATIENCE)
        assert out == b"read []\n"  # end of file: the gate asks over D-Bus
        assert ctl.counters.errors["dbus_signals_lost"] == 1
        assert messages(caplog)[-1] == (
            "a.service waits at its gate on its pipe, yet no word of that start reached "
            "gpuslice (its signals were lost on the bus): it asks over D-Bus now"
        )

    run(test)


def test_an_audit_leaves_a_gate_whose_start_signal_is_late_to_that_signal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """a.service's next start is queued (its JobNew read) and its gate waits in open() on
    its pipe, the signal that shows it at its gate not read yet: systemd holds its
    PropertiesChanged back while its bus queue is long, and a busy controller reads its
    socket late. An audit then is no proof the start went unheard: woken, that gate went to
    D-Bus (a second process, two round trips), and the journal and dbus_signals_lost said
    signals were lost that were only on their way. The audit holds it instead, and its
    signal answers it through its pipe."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    pipe = Path(bed.config.runtime_dir) / "gate" / "a.service"
    second = bytes.fromhex("ab" * 16)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_unit_changed("a.service", at_gate(START))
        await settle()
        ctl.on_unit_changed("a.service", running())
        goes_down(bed, "a.service")
        await settle()
        ctl.on_job_new(7, "/org/freedesktop/systemd1/job/7", "a.service")  # the next start
        gate = await shell_reader(pipe)  # its start-pre signal on its way
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            await ctl.reads.audit()
            await asyncio.sleep(0.1)
            assert gate.returncode is None
            ctl.on_unit_changed("a.service", at_gate(second))  # its signal, read
            await settle()
            out, _ = await asyncio.wait_for(gate.communicate(), PATIENCE)
        assert out == f"read [{second.hex()}]\n".encode()  # through its pipe
        assert ctl.counters.errors["dbus_signals_lost"] == 0
        assert not [m for m in messages(caplog) if "signals were lost" in m]

    run(test)


# ---- a read that names no start ----


def test_a_read_of_a_start_taken_in_at_its_pipe_leaves_the_next_starts_gate_its_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A state read shows a.service at its gate, with no InvocationID, after the signal
    that named that start: its pipe is held, and nothing is armed. Armed, the timer fired
    GATE_UNSEEN_DELAY after that read, when a.service's next start was at its gate, read
    but not yet signalled: that gate was sent to D-Bus (a second process, two round trips)
    before its own read's delay was over, though its signal was on its way. Here the first
    read's delay is over at once, the second's is long: the next start still gets its line
    through the pipe."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    pipe = tmp_path / "run" / "gate" / "a.service"
    second = bytes.fromhex("ab" * 16)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_unit_changed("a.service", at_gate())
        await settle()
        assert read_pipe(bed, "a.service") == START.hex() + "\n"
        monkeypatch.setattr(controller_module, "GATE_UNSEEN_DELAY", 0.0)
        ctl.on_unit_changed("a.service", at_gate(invocation=None), read=True)
        monkeypatch.setattr(controller_module, "GATE_UNSEEN_DELAY", 60.0)
        ctl.on_unit_changed("a.service", running())
        goes_down(bed, "a.service")
        ctl.on_unit_changed("a.service", at_gate(invocation=None), read=True)  # next start
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            await settle()
        assert pipe.exists()
        assert not [m for m in messages(caplog) if "sent to D-Bus" in m]
        ctl.on_unit_changed("a.service", at_gate(second))  # its signal
        await settle()
        assert read_pipe(bed, "a.service") == second.hex() + "\n"

    run(test)


# ---- a unit's end: what NVML still shows of it, how it ended, its gate's call ----


class LingeringVram(StubNvml):
    """One 24 GiB GPU; `shown` lists the processes NVML shows on it (PID, bytes)."""

    def __init__(self) -> None:
        super().__init__(available=True)
        self.shown: list[tuple[int, int]] = []
        self.scans = 0

    def devices(self) -> DeviceScan:
        self.scans += 1
        return DeviceScan(super().devices().gpus[:1], [])

    def processes(self, index: int) -> list[GpuProcess]:
        return [GpuProcess(pid, 1, used, compute=True) for pid, used in self.shown]


def a_and_b_on_lingering_vram(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    section: str = "Priority=50\n",
    b_section: str | None = None,
) -> tuple[Bed, LingeringVram]:
    """a.service and b.service (`section` each, or b.service's own `b_section`) for the one
    GPU of a LingeringVram, their gates to ask from PIDs 4242 and 4243."""
    nvml = LingeringVram()
    units = {"a.service": section, "b.service": section if b_section is None else b_section}
    bed = Bed(tmp_path, units, [], nvml=nvml)
    cgroup_of[4242] = "a.service"
    cgroup_of[4243] = "b.service"
    return bed, nvml


def a_and_b_of_16_gib(tmp_path: Path, cgroup_of: dict[int, str]) -> tuple[Bed, LingeringVram]:
    """`a_and_b_on_lingering_vram`, Memory=16G each; a.service's job is PID 300, in its
    cgroup (NVML is to show its VRAM)."""
    process_in(tmp_path, 300, "/system.slice/a.service")
    return a_and_b_on_lingering_vram(tmp_path, cgroup_of, "Priority=50\nMemory=16G\n")


def test_a_holders_end_counts_the_vram_nvml_still_shows_of_it_until_released(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """a.service (Memory=16G) ends; NVML still shows its process's 16 GiB on GPU 0 (the
    driver frees VRAM a moment after the process is gone). A sample is taken at its end
    with a.service no longer counted as holding GPU 0, so those 16 GiB are in use by no
    declaration: b.service (Memory=16G) waits until NVML shows them freed. Decided on the
    sample before the end, b.service was granted 16 GiB of a GPU that had 8 free, and its
    job ran out of memory."""
    bed, nvml = a_and_b_of_16_gib(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await bed.acquire("a.service", ":1.9", 4242)
        assert bed.service.granted == [("a.service", "0")]
        nvml.shown = [(300, 16 * GIB)]
        ctl.on_unit_changed("a.service", running())
        await bed.acquire("b.service", ":1.10", 4243)
        assert ctl.scheduler.is_waiting("b.service")
        goes_down(bed, "a.service")
        await settle()
        assert ctl.scheduler.grants() == {}
        assert ctl.scheduler.is_waiting("b.service")
        nvml.shown = []  # released
        ctl.watch.refresh()
        await settle()
        assert bed.service.granted[1:] == [("b.service", "0")]

    run(test)


def test_a_start_that_held_no_gpu_takes_no_nvml_sample_when_it_is_cancelled(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """A sample costs NVML calls on the controller's loop (issue 10): one is taken at a
    unit's end only when the unit held GPUs, whose VRAM may still be in use. A start that
    waited at its gate and was cancelled released nothing."""
    bed, nvml = a_and_b_on_lingering_vram(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await bed.acquire("a.service", ":1.9", 4242)
        await bed.acquire("b.service", ":1.10", 4243)
        assert ctl.scheduler.is_waiting("b.service")
        scans = nvml.scans
        goes_down(bed, "b.service")
        assert nvml.scans == scans
        assert not ctl.scheduler.is_waiting("b.service")
        goes_down(bed, "a.service")
        assert nvml.scans == scans + 1

    run(test)


def test_a_victim_a_person_stopped_before_our_stop_is_held_not_brought_back(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """An admin runs `systemctl stop low.service` as urgent.service's gate asks: systemd
    merges gpuslice's StopUnit into the admin's stop job, announced before it, and answers
    with that job. low.service was stopped by the admin, not preempted: it is held until
    someone starts it (told so), not started again once urgent.service ends."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    theirs = "/org/freedesktop/systemd1/job/5"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_job_new(5, theirs, "low.service")  # the admin's stop
        bed.systemd.stop_jobs["low.service"] = theirs  # ours joins it
        await bed.acquire("urgent.service", ":1.9", 4242)
        assert bed.systemd.calls[-1] == ("stop", "low.service")
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            goes_down(bed, "low.service")
            await settle()
        assert bed.service.granted == [("urgent.service", "0")]
        assert ctl.scheduler.snapshot().held == ["low.service"]
        assert "low.service" not in ctl.scheduler.preempted
        assert "low.service was stopped outside gpuslice: held until started again" in (
            messages(caplog)
        )

    run(test)


def test_a_gate_whose_start_is_cancelled_while_it_waits_is_told_to_ask_again(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """urgent.service's gate waits over D-Bus for low.service to stop when its start is
    cancelled (`systemctl stop urgent.service`). Its calls are answered "ask again" at once
    (SchedulerService.forget): one may be the gate of its next start, read before this
    end's signals, and dropped or left waiting its dbus-send waited for ever (its reply
    timeout is ~24 days)."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await bed.acquire("urgent.service", ":1.9", 4242)
        assert bed.service.pending("urgent.service")
        goes_down(bed, "urgent.service")
        await settle()
        assert not ctl.scheduler.is_waiting("urgent.service")
        assert bed.service.waiting == {}
        assert bed.service.sent_back == ["urgent.service"]
        assert bed.service.granted == []

    run(test)


def test_a_stop_of_ours_that_systemd_cancelled_is_said_and_asked_again(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Someone cancels gpuslice's stop job of low.service (`systemctl cancel`): it still
    runs on GPU 0, and urgent.service still waits. The journal says so, with the job's
    result, at warning level; low.service keeps GPU 0 and, not having refused, is asked to
    stop again for urgent.service (a refusal, told otherwise, would not be)."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await bed.acquire("urgent.service", ":1.9", 4242)
        assert bed.systemd.calls.count(("stop", "low.service")) == 1
        path = "/org/freedesktop/systemd1/job/1"
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            ctl.on_job_removed(1, path, "low.service", "canceled")
            ctl.on_unit_changed("low.service", {**running(), "Job": (0, "/")})
            await settle()
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            (
                "WARNING",
                "low.service (priority 90) did not stop for urgent.service (priority 10): "
                "its stop job ended with result 'canceled'; it keeps GPU 0",
            )
        ]
        assert bed.systemd.calls.count(("stop", "low.service")) == 2
        assert ctl.scheduler.phase("low.service") is Phase.STOPPING
        assert "low.service" not in ctl.scheduler.unstoppable

    run(test)


# ---- who calls, and whether the start still waits ----


def test_an_acquire_from_a_process_in_no_unit_is_refused_and_says_so(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Any local user can call Acquire naming any unit, from a login shell's process that
    runs in no service unit: refused, and the journal names the unit asked for, the PID and
    where it runs, in the words an admin greps for."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])

    async def test() -> None:
        await bed.controller.start()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            await bed.acquire("a.service", ":1.9", 4242)  # PID 4242's cgroup names no unit
        assert bed.service.granted == []
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
            "refused an Acquire for a.service from PID 4242, which runs in no unit"
        ]

    run(test)


def test_a_start_cancelled_while_its_caller_is_checked_is_told_to_ask_again(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """a.service's first start asks over D-Bus (no pipe yet) and is cancelled while the
    controller asks the bus daemon who calls: systemd shows it down. Its call is answered
    "ask again", nothing is granted or kept for it. Granted, a start that no longer runs
    held GPU 0 until its unit was seen down again; left unanswered, a gate that is gone held
    a bus connection of root's."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    cgroup_of[4242] = "a.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        bed.systemd.pids[":1.9"] = 4242
        bed.service.call("a.service", ":1.9")
        ctl.on_acquire("a.service", ":1.9")
        goes_down(bed, "a.service")  # before the caller's PID is known
        await settle()
        assert bed.service.granted == []
        assert bed.service.waiting == {}
        assert bed.service.sent_back == ["a.service"]
        assert ctl.scheduler.grants() == {} and not ctl.scheduler.is_waiting("a.service")

    run(test)


def test_a_start_shown_at_its_gate_while_its_caller_is_checked_is_served(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """Systemd's word on the unit while its caller is checked is not always an end: a read
    showing it at its gate changes nothing, and the call is granted."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    cgroup_of[4242] = "a.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        bed.systemd.pids[":1.9"] = 4242
        bed.service.call("a.service", ":1.9")
        ctl.on_acquire("a.service", ":1.9")
        ctl.on_unit_changed("a.service", at_gate(invocation=None), read=True)
        await settle()
        assert bed.service.granted == [("a.service", "0")]
        assert bed.service.sent_back == []

    run(test)


def answered_or_granted(ctl: Controller, bed: Bed, unit: str) -> bool:
    """No rescan under way, and the unit's gate call answered: waiting, or something granted."""
    return ctl.rescans.task is None and (
        ctl.scheduler.is_waiting(unit) or bed.service.granted != []
    )


def test_each_gate_the_scan_does_not_know_gets_its_own_rescan(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """An admin annotates new.service, then later other.service, each time with a
    daemon-reload whose Reloading signal is lost (a full bus queue, which any user can
    cause). Each unit's gate asks a controller whose scan does not know it: each is worth
    one rescan, and waits its turn behind top.service. One rescan for the first unknown gate
    only let the second through at once, ungated, onto GPU 0 that top.service holds."""
    bed = Bed(
        tmp_path,
        {"top.service": "Priority=10\n"},
        [state("top.service", "active", "running")],
        SavedState(holders={"top.service": ((0,), "running", 1, "")}, seq=1),
    )
    cgroup_of[4242] = "new.service"
    cgroup_of[4243] = "other.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        for unit, sender, pid in (("new.service", ":1.9", 4242), ("other.service", ":1.10", 4243)):
            write_unit(tmp_path, unit, "Priority=50\n")  # daemon-reload: signal lost
            bed.systemd.units[unit] = state(unit, "activating", "start-pre", 5)
            await bed.acquire(unit, sender, pid)
            # the call's answer, not the scan's end alone: one combined run under load once
            # looked before the call had reached the rescan it asks for
            answered = partial(answered_or_granted, ctl, bed, unit)
            await until(answered)
            assert ctl.scheduler.is_waiting(unit), (bed.service.granted, bed.service.sent_back)
        assert bed.service.granted == []
        assert ctl.scheduler.grants() == {"top.service": frozenset({0})}

    run(test)


def test_a_gate_that_asks_again_after_a_controller_restart_is_granted_again(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """a.service was granted GPU 0 over D-Bus and the controller restarted before its gate
    had the answer: systemd still shows it at its gate, and its gate asks again. Nothing
    was granted at a pipe of this controller's: the grant kept for it is said again. Taken
    for a gate on a pipe that a next start found, it was told to ask again, and asked again
    until its start timed out."""
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n"},
        [state("a.service", "activating", "start-pre", 3, "start")],
        SavedState(holders={"a.service": ((0,), "running", 1, "")}, seq=1),
    )
    cgroup_of[4242] = "a.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.scheduler.phase("a.service") is Phase.RUNNING
        await bed.acquire("a.service", ":1.9", 4242)
        assert bed.service.granted == [("a.service", "0")]
        assert bed.service.sent_back == []

    run(test)


# ---- a pipe grant asked for again over D-Bus ----


def test_a_pipe_grant_whose_start_cannot_be_read_is_not_said_again(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """a.service was granted at its pipe and a gate of it asks over D-Bus: only systemd's
    InvocationID tells whether it is the same start. When that read fails (systemd
    re-executing), the call is answered "ask again", the failed call is counted with the
    bus's errors, and the journal's debug line names the unit and the error."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    cgroup_of[4242] = "a.service"

    async def unreadable(name: str) -> str | None:
        raise NO_REPLY

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        bed.systemd.invocation = unreadable  # type: ignore[method-assign]
        ctl.on_unit_changed("a.service", at_gate())
        await settle()
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            await bed.acquire("a.service", ":1.9", 4242)
        assert bed.service.granted == [("a.service", "0")]  # the pipe's, said once
        assert bed.service.sent_back == ["a.service"]
        assert ctl.counters.to_json([])["dbus_call_errors"] == 1
        assert ctl.counters.gate_answers == {"pipe": 0, "dbus": 0}
        assert (
            "cannot read the InvocationID of a.service: org.freedesktop.DBus.Error.NoReply: "
            "Message recipient disconnected from message bus without replying"
        ) in messages(caplog)

    run(test)


def test_a_pipe_grant_is_not_said_again_to_a_unit_preempted_while_its_start_was_read(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """low.service was granted GPU 0 at its pipe; its gate, which found no pipe, asks over
    D-Bus, and while systemd's answer on which start that is comes, urgent.service's gate
    takes GPU 0 from it (its stop is sent). The answer names the same start, but the grant
    is no longer low.service's to say: its call is answered "ask again" (and its gate, asking
    again, is stopped). Said again, low.service ran on GPU 0 beside urgent.service."""
    bed = Bed(tmp_path, {"low.service": "Priority=90\n", "urgent.service": "Priority=10\n"}, [])
    cgroup_of[4242] = "low.service"
    read = asyncio.Event()
    answer = asyncio.Event()

    async def invocation(name: str) -> str | None:
        read.set()
        await answer.wait()
        return START.hex()  # the start granted at the pipe

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        bed.systemd.invocation = invocation  # type: ignore[method-assign]
        ctl.on_unit_changed("low.service", at_gate())
        await settle()
        assert bed.service.granted == [("low.service", "0")]
        bed.systemd.pids[":1.9"] = 4242
        bed.service.call("low.service", ":1.9")
        ctl.on_acquire("low.service", ":1.9")
        await until(read.is_set)
        ctl.on_unit_changed("urgent.service", at_gate(bytes.fromhex("cd" * 16)))
        await settle()
        assert ctl.scheduler.phase("low.service") is Phase.STOPPING
        answer.set()
        await settle()
        assert bed.service.granted == [("low.service", "0")]
        assert bed.service.sent_back == ["low.service"]

    run(test)


def test_a_grant_of_several_gpus_names_them_all_on_both_ways(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """A unit with GPUs=2 is told "0,1" over D-Bus, the form the gate writes into its
    environment: at its grant, and when its gate asks over D-Bus after its pipe grant."""
    bed = Bed(
        tmp_path, {"a.service": "Priority=50\nGPUs=2\n"}, [], config=bed_config(tmp_path, gpus=2)
    )
    bed.systemd.invocations["a.service"] = START.hex()
    cgroup_of[4242] = "a.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_unit_changed("a.service", at_gate())
        await settle()
        await bed.acquire("a.service", ":1.9", 4242)
        assert bed.service.granted == [("a.service", "0,1")] * 2
        assert bed.service.waiting == {}

    run(test)


# ---- a grant withheld until the environment file is written ----


def unwritable_run(tmp_path: Path) -> Path:
    """A runtime directory that cannot be made (a file in its place: a full /run, say);
    removing the file makes room."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    return blocker


def renumbered(ctl: Controller, nvml: StubNvml) -> None:
    """NVML numbers the GPUs anew: GPU-B, 1 before, is 0 now, and GPU-A 1; both indices are
    lost to new work while units hold them by the old numbers."""
    nvml.uuids = ("GPU-B", "GPU-A")
    ctl.watch.refresh()
    assert [(g.uuid, g.lost) for g in ctl.watch.sample.gpus] == [
        ("GPU-B", True),
        ("GPU-A", True),
    ]


def test_a_gate_that_asks_again_while_its_grant_is_withheld_goes_through_once(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """a.service is granted GPU 0 while its environment file cannot be written, and its
    gate asks again meanwhile (a second call of it over D-Bus): the grant is decided again
    and still withheld, with one retry of the write pending, not two, and the journal does
    not say it again (a unit's process calling in a loop wrote an error line per call).
    Once the file is written the gate goes through once, and the journal says so; two
    retries said it twice and answered twice."""
    monkeypatch.setattr(delivery_module, "ENV_RETRY", 0.01)
    blocker = unwritable_run(tmp_path)
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n"},
        [],
        config=bed_config(tmp_path, runtime_dir=str(blocker)),
    )
    cgroup_of[4242] = "a.service"
    cgroup_of[4243] = "a.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_unit_changed("a.service", at_gate(invocation=None), read=True)
        await bed.acquire("a.service", ":1.9", 4242)
        await bed.acquire("a.service", ":1.10", 4243)  # asks again
        assert bed.service.granted == []
        assert ctl.scheduler.grants() == {"a.service": {0}}
        blocker.unlink()
        await until(lambda: bool(bed.service.granted))
        await past(delivery_module.ENV_RETRY)
        assert bed.service.granted == [("a.service", "0")]
        assert bed.service.waiting == {}
        assert not ctl.delivery.withheld

    caplog.set_level(logging.INFO, "gpuslice")
    run(test)
    path = blocker / "env" / "a.service" / "gpuslice.env"
    assert [m for m in messages(caplog) if "gpuslice.env" in m] == [
        f"cannot write {path} ([Errno 20] Not a directory: '{path.parent}'): "
        "a.service waits at its gate until it can (tried again every 0.01 s)",
        f"wrote {path}: a.service goes past its gate",
    ]


def test_a_withheld_grant_names_the_gpu_granted_by_uuid_after_a_renumbering(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """a.service is granted GPU 0, GPU-A, while its env file cannot be written, and NVML
    numbers the GPUs anew meanwhile (GPU-B is 0 now: both indices lost to new work). The
    file written at the retry names GPU-A, the GPU granted, by its UUID: written as NVML
    numbers index 0 now, it named GPU-B, which the unit holding index 1 runs on (two jobs
    on one GPU), as `Gates.let_through` and a resume already have it (`Scheduler.told`)."""
    monkeypatch.setattr(delivery_module, "ENV_RETRY", 0.01)
    blocker = unwritable_run(tmp_path)
    nvml = StubNvml()
    nvml.uuids = ("GPU-A", "GPU-B")
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n"},
        [],
        config=bed_config(tmp_path, gpus=2, runtime_dir=str(blocker)),
        nvml=nvml,
    )
    cgroup_of[4242] = "a.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_unit_changed("a.service", at_gate(invocation=None), read=True)
        await bed.acquire("a.service", ":1.9", 4242)
        await until(lambda: "a.service" in ctl.delivery.withheld)
        assert ctl.scheduler.grants() == {"a.service": {0}}
        renumbered(ctl, nvml)
        blocker.unlink()
        await until(lambda: bool(bed.service.granted))
        assert bed.service.granted == [("a.service", "0")]
        assert env_file(str(blocker), "a.service").read_text() == (
            "CUDA_VISIBLE_DEVICES=GPU-A\nCUDA_DEVICE_ORDER=PCI_BUS_ID\n"
            "NVIDIA_VISIBLE_DEVICES=GPU-A\nGPUSLICE_GPUS=0\n"
        )

    run(test)


def test_a_withheld_grant_of_a_unit_being_preempted_is_not_let_through(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """low.service's grant waits for its environment file when urgent.service's gate asks
    and takes GPU 0 (low.service is stopped). The file written later does not let
    low.service's gate through onto GPU 0, which is urgent.service's once low.service is
    down."""
    monkeypatch.setattr(delivery_module, "ENV_RETRY", 0.01)
    blocker = unwritable_run(tmp_path)
    bed = Bed(
        tmp_path,
        {"low.service": "Priority=90\n", "urgent.service": "Priority=10\n"},
        [],
        config=bed_config(tmp_path, runtime_dir=str(blocker)),
    )
    cgroup_of[4242] = "low.service"
    errors: list[dict[str, object]] = []

    async def test() -> None:
        ctl = bed.controller
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: errors.append(context)
        )
        await ctl.start()
        ctl.on_unit_changed("low.service", at_gate(invocation=None), read=True)
        await bed.acquire("low.service", ":1.9", 4242)
        await until(lambda: "low.service" in ctl.delivery.withheld)
        ctl.on_unit_changed("urgent.service", at_gate(invocation=None), read=True)
        await settle()
        assert ctl.scheduler.phase("low.service") is Phase.STOPPING
        blocker.unlink()
        await until(lambda: not ctl.delivery.withheld)
        await settle()
        assert bed.service.granted == []
        assert bed.service.pending("low.service")
        assert not (blocker / "env" / "low.service").exists()
        assert errors == []

    run(test)


# ---- a gate served: a frozen unit's new start, a victim's gate ----


def test_a_frozen_unit_restarted_by_hand_ended_stopped_and_its_vram_counts_until_released(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """emb.service is frozen beside voice.service on GPU 0 when an admin restarts it: that
    run was ended by the admin's restart job, so it is taken as stopped from outside (said
    so), and its new start is served. NVML still shows the 18 GiB of the run that ended:
    sampled with emb.service no longer counted as holding GPU 0, they count as in use, and
    the new start (Memory=4G) waits for them to be freed instead of being granted 4 GiB of
    a GPU that has 2 free."""
    nvml = LingeringVram()
    process_in(tmp_path, 300, "/system.slice/emb.service")
    bed = frozen_beside_voice(tmp_path, nvml=nvml)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert ctl.scheduler.phase("emb.service") is Phase.FROZEN
        nvml.shown = [(300, 18 * GIB)]
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            restarted_by_hand(bed, "emb.service", 9)
            await settle()
        assert "emb.service was stopped outside gpuslice: held until started again" in (
            messages(caplog)
        )
        assert ctl.scheduler.phase("emb.service") is None
        assert ctl.scheduler.is_waiting("emb.service")
        nvml.shown = []
        ctl.watch.refresh()
        await settle()
        assert ctl.scheduler.phase("emb.service") is Phase.RUNNING
        assert read_pipe(bed, "emb.service") == START.hex() + "\n"

    run(test)


def test_a_gate_on_dbus_of_a_start_frozen_after_its_pipe_grant_asks_again_once_thawed(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """emb.service's first start found no pipe and its gate asks over D-Bus; the controller
    granted that start at its start-pre signal (through the pipe, unread), and froze it for
    voice.service before the call was served. The call is the same start's: emb.service is
    not taken for ended (its run did not end, systemd still holds it frozen), and the call
    is answered "ask again". Left waiting, as the core answers no frozen unit, nobody
    answered it once emb.service was thawed: its start stayed at its gate for good while
    the core counted it running on GPU 0. Thawed, its gate asks again and is granted."""
    nvml = LingeringVram()
    bed = Bed(
        tmp_path,
        {
            "emb.service": "Priority=90\nMemory=4G\nPreempt=freeze stop\n",
            "voice.service": "Priority=10\nMemory=4G\n",
        },
        [],
        nvml=nvml,
    )
    bed.systemd.invocations["emb.service"] = START.hex()
    cgroup_of[4242] = "emb.service"
    (tmp_path / "cgroup.controllers").write_text("")  # the unified hierarchy: a freezer

    async def test() -> None:
        ctl = bed.controller
        ctl.ladder.unified_marker = tmp_path / "cgroup.controllers"
        await ctl.start()
        ctl.on_unit_changed("emb.service", at_gate())
        await settle()
        assert bed.service.granted == [("emb.service", "0")]
        ctl.on_unit_changed("voice.service", at_gate(bytes.fromhex("cd" * 16)))
        await settle()
        assert ctl.scheduler.phase("emb.service") is Phase.FROZEN
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.acquire("emb.service", ":1.9", 4242)
        assert bed.service.sent_back == ["emb.service"]
        assert bed.service.waiting == {}
        assert ctl.scheduler.phase("emb.service") is Phase.FROZEN
        assert [m for m in messages(caplog) if "emb.service" in m] == []
        goes_down(bed, "voice.service")
        await until(lambda: ctl.scheduler.phase("emb.service") is Phase.RUNNING)
        assert ("thaw", "emb.service") in bed.systemd.calls
        await bed.acquire("emb.service", ":1.10", 4242)  # thawed, its gate asks again
        assert bed.service.granted[-1] == ("emb.service", "0")
        assert bed.service.waiting == {}

    run(test)


def test_the_gate_of_a_unit_being_stopped_is_stopped_again_and_said_as_a_stop(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """low.service, granted at its pipe, is being stopped for urgent.service when its gate,
    which found no pipe, asks over D-Bus: it is stopped again, not let through. That second
    StopUnit does not reach systemd (re-executing): the journal's lines say "stop" of it,
    the words an admin greps for, and it is sent again until it does."""
    monkeypatch.setattr(calls_module, "CALL_RETRY_FIRST", 0.02)
    bed = Bed(tmp_path, {"low.service": "Priority=90\n", "urgent.service": "Priority=10\n"}, [])
    cgroup_of[4242] = "low.service"
    stop = bed.systemd.stop_unit
    fails = [False, True]  # the first stop goes through, the one at the gate does not

    def flaky(name: str, queued: Queued | None = None) -> Awaitable[str]:
        if not (fails.pop(0) if fails else False):
            return stop(name, queued)
        bed.systemd.calls.append(("stop", name))

        async def lost() -> str:
            raise NO_REPLY

        return lost()

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        bed.systemd.stop_unit = flaky  # type: ignore[method-assign]
        # a read shows it at its gate, as its signals do (the fake runs no stop job)
        bed.systemd.units["low.service"] = state("low.service", "activating", "start-pre")
        ctl.on_unit_changed("low.service", at_gate())
        await settle()
        ctl.on_unit_changed("urgent.service", at_gate(bytes.fromhex("cd" * 16)))
        await settle()
        assert ctl.scheduler.phase("low.service") is Phase.STOPPING
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            await bed.acquire("low.service", ":1.9", 4242)
            await until(lambda: bed.systemd.calls.count(("stop", "low.service")) == 3)
            await settle()
        assert bed.service.granted == [("low.service", "0")]  # the pipe's, not said again
        assert [m for m in messages(caplog) if "reach" in m] == [
            "stop low.service did not reach systemd: Message recipient disconnected from "
            "message bus without replying (org.freedesktop.DBus.Error.NoReply); sent again "
            "in 0.02 s",
            "stopping low.service did not reach systemd: Message recipient disconnected from "
            "message bus without replying (org.freedesktop.DBus.Error.NoReply); sent again in "
            "0.02 s, and until systemd takes it (said once)",
            "stopping low.service reached systemd: sent again, it went through",
        ]

    run(test)


def test_the_gate_of_a_unit_the_core_still_knows_is_judged_without_a_rescan(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """low.service holds GPU 0 and its annotation went (the core keeps it until it ends);
    a gate of its asks over D-Bus. The core knows it: judged at once (sent back, as a gate
    of a unit systemd shows past its gate), with no rescan spent on it: the one rescan per
    unknown unit is for units neither the scan nor the core knows."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    cgroup_of[4343] = "low.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await unannotate(ctl, tmp_path, "low.service")
        await until(lambda: ctl.rescans.task is None)
        assert ctl.scheduler.grants() == {"low.service": frozenset({0})}
        await bed.acquire("low.service", ":1.7", 4343)
        assert bed.service.sent_back == ["low.service"]
        assert ctl.rescans.task is None and ctl.rescans.rescanned_for_gate == set()

    run(test)


# ---- a unit held without its annotation, let through: its env file first ----


# an env file written before NVML answered: GPU 0 by its index, in PCI bus order
TOLD_GPU_0_BY_INDEX = "CUDA_VISIBLE_DEVICES=0\nCUDA_DEVICE_ORDER=PCI_BUS_ID\nGPUSLICE_GPUS=0\n"


def low_unannotated_holds_gpu_0(tmp_path: Path, **settings: object) -> Bed:
    """low.service (90) runs on GPU 0, urgent.service (10) is annotated too; `settings`
    change the bed's config (a second GPU, a runtime directory that cannot be made)."""
    return Bed(
        tmp_path,
        {"low.service": "Priority=90\n", "urgent.service": "Priority=10\n"},
        [state("low.service", "active", "running")],
        SavedState(holders={"low.service": ((0,), "running", 1, "")}, seq=1),
        config=bed_config(tmp_path, **settings),
    )


def env_file_left(bed: Bed, left: str | None) -> Path:
    """low.service's env file, as an earlier run or someone left it (None: none)."""
    path = env_file(bed.config.runtime_dir, "low.service")
    if left is not None:
        path.parent.mkdir(parents=True)
        path.write_text(left)
    return path


async def unannotated_and_restarted(bed: Bed, tmp_path: Path) -> None:
    """low.service's annotation goes (the core keeps GPU 0 booked for it until it ends),
    then `systemctl restart low.service` runs it again with no moment down between: its
    gate, still in place until the next daemon-reload, asks over D-Bus."""
    await unannotate(bed.controller, tmp_path, "low.service")
    assert bed.controller.scheduler.grants()["low.service"] == frozenset({0})
    bed.systemd.units["low.service"] = state("low.service", "activating", "start-pre")
    signal(bed, "low.service", at_gate(invocation=b"next"))


@pytest.mark.parametrize(
    "left",
    [None, "CUDA_VISIBLE_DEVICES=1\nGPUSLICE_GPUS=1\n", "GPUSLICE_GPUS=zero\n"],
    ids=["none", "another-gpu", "not-ours"],
)
def test_a_restarted_unit_whose_annotation_went_passes_once_its_env_file_names_its_gpu(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    caplog: pytest.LogCaptureFixture,
    left: str | None,
) -> None:
    """low.service holds GPU 0 when its annotation goes and it is restarted. Its env file
    is missing (/run was full at its grant and the controller restarted since, or someone
    removed it), names GPU 1, or is no file of ours: let through so, its new run saw every
    GPU (the drop-in's `EnvironmentFile=-` starts it without the file), GPU 1 among them,
    which the core may grant to another unit. The file is written from the core's books
    first: GPU 0 only."""
    bed = low_unannotated_holds_gpu_0(tmp_path, gpus=2)
    cgroup_of[4343] = "low.service"
    path = env_file_left(bed, left)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await unannotated_and_restarted(bed, tmp_path)
        caplog.clear()
        await bed.acquire("low.service", ":1.10", 4343)
        await until(lambda: bed.service.granted != [])
        assert bed.service.granted == [("low.service", "0")]
        assert path.read_text() == (
            "CUDA_VISIBLE_DEVICES=0\nCUDA_DEVICE_ORDER=PCI_BUS_ID\nGPUSLICE_GPUS=0\n"
        )
        assert ctl.scheduler.grants() == {"low.service": frozenset({0})}
        assert not ctl.delivery.withheld

    caplog.set_level(logging.INFO, "gpuslice")
    run(test)
    assert (
        "low.service passed the gate on GPU 0, which it keeps until it ends: no longer annotated"
    ) in messages(caplog)


def test_a_restarted_unit_whose_annotation_went_waits_while_its_env_file_cannot_be_written(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As above, and the file cannot be written (a full /run): the gate waits, GPU 0 kept
    for it, as a withheld grant's does, rather than pass onto every GPU. Its gate asking
    again meanwhile leaves one retry pending and says nothing more; once the file is
    written the gate goes through once, and the journal says so."""
    monkeypatch.setattr(delivery_module, "ENV_RETRY", 0.01)
    blocker = unwritable_run(tmp_path)
    bed = low_unannotated_holds_gpu_0(tmp_path, runtime_dir=str(blocker))
    cgroup_of[4343] = "low.service"
    cgroup_of[4344] = "low.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await unannotated_and_restarted(bed, tmp_path)
        caplog.clear()
        await bed.acquire("low.service", ":1.10", 4343)
        await bed.acquire("low.service", ":1.11", 4344)  # asks again
        await past(delivery_module.ENV_RETRY)
        assert bed.service.granted == []
        assert bed.service.pending("low.service")
        assert ctl.scheduler.grants() == {"low.service": frozenset({0})}
        assert list(ctl.delivery.withheld) == ["low.service"]
        blocker.unlink()  # room again
        await until(lambda: bool(bed.service.granted))
        await past(delivery_module.ENV_RETRY)
        assert bed.service.granted == [("low.service", "0")]
        assert bed.service.waiting == {}
        assert not ctl.delivery.withheld
        assert "CUDA_VISIBLE_DEVICES=0\n" in env_file(str(blocker), "low.service").read_text()

    caplog.set_level(logging.INFO, "gpuslice")
    run(test)
    path = env_file(str(blocker), "low.service")
    assert [m for m in messages(caplog) if "low.service" in m] == [
        f"cannot write {path} ([Errno 20] Not a directory: '{path.parent}'): "
        "low.service waits at its gate until it can (tried again every 0.01 s)",
        f"wrote {path}: low.service goes past its gate",
        "low.service passed the gate on GPU 0, which it keeps until it ends: no longer annotated",
    ]


def test_a_held_gate_waiting_for_its_env_file_is_judged_again_when_its_unit_is_preempted(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """low.service's gate waits for its env file when urgent.service takes GPU 0 from it
    (low.service is stopped). The retry judges the gate again: it is stopped again, not let
    through onto GPU 0, which is urgent.service's once low.service is down, and no file
    names GPU 0 for it."""
    monkeypatch.setattr(delivery_module, "ENV_RETRY", HOUR)  # ended by the test
    blocker = unwritable_run(tmp_path)
    bed = low_unannotated_holds_gpu_0(tmp_path, runtime_dir=str(blocker))
    cgroup_of[4343] = "low.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await unannotated_and_restarted(bed, tmp_path)
        await bed.acquire("low.service", ":1.10", 4343)
        assert "low.service" in ctl.delivery.withheld
        ctl.on_unit_changed("urgent.service", at_gate(invocation=None), read=True)
        await settle()
        assert ctl.scheduler.phase("low.service") is Phase.STOPPING
        assert bed.systemd.calls.count(("stop", "low.service")) == 1
        blocker.unlink()
        assert await due_now(ctl.delivery._let_through_withheld) == 1
        assert not ctl.delivery.withheld
        assert bed.service.granted == []
        assert bed.systemd.calls.count(("stop", "low.service")) == 2
        assert not (blocker / "env" / "low.service").exists()

    run(test)


def test_a_held_unit_at_its_gate_after_a_controller_restart_gets_its_env_file_first(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """The last controller held GPU 0 for low.service, whose annotation went while it ran,
    and stopped (an upgrade) while low.service, restarted, waited at its gate for its env
    file (/run was full). Its gate asks the next controller, which holds GPU 0 for it from
    the state file: the file is written before the gate passes."""
    bed = Bed(
        tmp_path,
        {"urgent.service": "Priority=10\n"},
        [state("low.service", "activating", "start-pre")],
        SavedState(holders={"low.service": ((0,), "running", 1, "")}, seq=1),
    )
    cgroup_of[4343] = "low.service"
    path = env_file(bed.config.runtime_dir, "low.service")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.scheduler.grants() == {"low.service": frozenset({0})}
        await bed.acquire("low.service", ":1.10", 4343)
        await until(lambda: bed.service.granted != [])
        assert bed.service.granted == [("low.service", "0")]
        assert "CUDA_VISIBLE_DEVICES=0\n" in path.read_text()

    run(test)


def test_a_held_unit_let_through_is_told_the_gpu_it_holds_by_uuid_after_a_renumbering(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """low.service holds GPU 0, GPU-A (its env file says so); NVML numbers the GPUs anew
    (GPU-B is 0 now), its annotation goes, its file is removed by hand, and it is
    restarted. Its file is written with GPU-A, the GPU the books hold for it (both indices
    are lost to new work meanwhile), not GPU-B, which another unit may run on by its old
    index."""
    nvml = StubNvml()
    nvml.uuids = ("GPU-A", "GPU-B")
    bed = Bed(
        tmp_path,
        {"low.service": "Priority=90\n"},
        [state("low.service", "active", "running")],
        SavedState(holders={"low.service": ((0,), "running", 1, "")}, seq=1),
        config=bed_config(tmp_path, gpus=2),
        nvml=nvml,
    )
    cgroup_of[4343] = "low.service"
    path = env_file(bed.config.runtime_dir, "low.service")
    path.parent.mkdir(parents=True)
    path.write_text(
        "CUDA_VISIBLE_DEVICES=GPU-A\nCUDA_DEVICE_ORDER=PCI_BUS_ID\n"
        "NVIDIA_VISIBLE_DEVICES=GPU-A\nGPUSLICE_GPUS=0\n"
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        renumbered(ctl, nvml)
        path.unlink()
        await unannotated_and_restarted(bed, tmp_path)
        await bed.acquire("low.service", ":1.10", 4343)
        await until(lambda: bed.service.granted != [])
        assert bed.service.granted == [("low.service", "0")]
        assert path.read_text() == (
            "CUDA_VISIBLE_DEVICES=GPU-A\nCUDA_DEVICE_ORDER=PCI_BUS_ID\n"
            "NVIDIA_VISIBLE_DEVICES=GPU-A\nGPUSLICE_GPUS=0\n"
        )

    run(test)


@pytest.mark.parametrize("left", [None, TOLD_GPU_0_BY_INDEX], ids=["none", "by-index"])
def test_a_held_unit_whose_gpu_is_lost_by_an_unknown_uuid_is_let_go_not_told_another_gpu(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture, left: str | None
) -> None:
    """As above, but no UUID of low.service's GPU 0 was read at start-up (its file was gone,
    or named it by index only: written before NVML answered), and other.service runs on GPU
    1, GPU-B. NVML numbers the GPUs anew (GPU-B is 0 now), low.service's annotation goes and
    it is restarted: its books cannot name its GPU, so the core lets it go and its gate
    passes with no GPUs of gpuslice's, its file removed, as an annotated unit's gate on a
    lost index waits like any start (`Scheduler.request`). Told from the books, its file
    named index 0 as NVML numbers it now, GPU-B, or kept, by index: other.service's GPU."""
    nvml = StubNvml()
    nvml.uuids = ("GPU-A", "GPU-B")
    bed = holding_a_gpu_each(
        tmp_path,
        {"low.service": "Priority=90\n", "other.service": "Priority=50\n"},
        config=bed_config(tmp_path, gpus=2),
        nvml=nvml,
    )
    cgroup_of[4343] = "low.service"
    path = env_file_left(bed, left)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        renumbered(ctl, nvml)
        await unannotated_and_restarted(bed, tmp_path)
        caplog.clear()
        await bed.acquire("low.service", ":1.10", 4343)
        await until(lambda: bed.service.granted != [])
        assert bed.service.granted == [("low.service", "")]
        assert not path.exists()
        assert ctl.scheduler.grants() == {"other.service": frozenset({1})}

    caplog.set_level(logging.INFO, "gpuslice")
    run(test)
    assert [m for m in messages(caplog) if "low.service" in m] == [
        "low.service is no longer annotated: released its GPUs",
        "low.service passed the gate: not managed by gpuslice",
    ]


# ---- an instance held without its annotation: its env file goes when it goes down ----

INSTANCE = "t@1.service"
TOLD_GPU_0 = "CUDA_VISIBLE_DEVICES=0\nCUDA_DEVICE_ORDER=PCI_BUS_ID\nGPUSLICE_GPUS=0\n"
DOWN = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}


def instance_holds_gpu_0(tmp_path: Path) -> tuple[Bed, Path]:
    """t@1.service, an instance of annotated t@.service (90), runs on GPU 0, its env file
    naming it; urgent.service (10) asks from PID 4242. The bed, and the instance's file."""
    bed = Bed(
        tmp_path,
        {"t@.service": "Priority=90\n", "urgent.service": "Priority=10\n"},
        [state(INSTANCE, "active", "running")],
        SavedState(holders={INSTANCE: ((0,), "running", 1, "")}, seq=1),
    )
    path = env_file(bed.config.runtime_dir, INSTANCE)
    path.parent.mkdir(parents=True)
    path.write_text(TOLD_GPU_0)
    return bed, path


async def template_unannotated(bed: Bed, tmp_path: Path) -> None:
    """t@.service's annotation goes (daemon-reload): t@1.service keeps GPU 0 until it ends,
    its file with it."""
    ctl = bed.controller
    write_unannotated(tmp_path, "t@.service")
    ctl.rescans.request()
    await until(lambda: ctl.spec_for(INSTANCE) is None and ctl.rescans.task is None)
    assert ctl.scheduler.grants() == {INSTANCE: frozenset({0})}
    assert bed.systemd.watches(INSTANCE)  # followed while the core holds GPU 0 for it


async def instance_down_before_our_stop_is_answered(bed: Bed, tmp_path: Path) -> None:
    """t@.service's annotation goes, then urgent.service (PID 4242) takes GPU 0 from
    t@1.service, which shows down before systemd answered our stop of it (systemd takes
    our stops late: `late_stops`): the core still holds GPU 0 for it."""
    ctl = bed.controller
    await template_unannotated(bed, tmp_path)
    await bed.acquire("urgent.service", ":1.9", 4242)
    assert ctl.tracker.in_flight(INSTANCE)  # our stop, not answered yet
    bed.systemd.units[INSTANCE] = state(INSTANCE, "inactive", "dead")
    signal(bed, INSTANCE, DOWN)
    await settle()
    assert ctl.scheduler.grants() == {INSTANCE: frozenset({0})}


@pytest.mark.parametrize(
    "down",
    [
        DOWN,
        {"ActiveState": "failed", "SubState": "failed", "Job": (0, "/")},
        {"ActiveState": "activating", "SubState": "auto-restart", "Job": (0, "/")},
    ],
    ids=["dead", "failed", "auto-restart"],
)
def test_an_instance_whose_annotation_went_loses_its_env_file_when_it_goes_down(
    tmp_path: Path, down: dict[str, object]
) -> None:
    """t@1.service's template loses its annotation while it runs on GPU 0; then it ends (or
    fails, or waits to restart by its Restart=). Its GPU is released, and it is no longer
    followed: its file stayed in /run until the next controller start, one for each such
    instance, whose names may never come again. It goes with the down that released the GPU,
    its directory too (a restart by its Restart= that is gated is let through with no GPUs
    of gpuslice's, its file removed then anyway: `Gates.let_through`)."""
    bed, path = instance_holds_gpu_0(tmp_path)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await template_unannotated(bed, tmp_path)
        assert path.read_text() == TOLD_GPU_0
        signal(bed, INSTANCE, down)
        await settle()
        assert ctl.scheduler.grants() == {}
        assert not path.parent.exists()
        assert INSTANCE not in ctl._watched()

    run(test)


def test_an_instance_granted_then_unannotated_loses_its_pipe_and_env_file_when_down(
    tmp_path: Path,
) -> None:
    """t@1.service is started, granted GPU 0 through its pipe (its env file written), and
    runs; its template's annotation goes, then it ends. Its pipe and env file go, as an
    annotated instance's do: kept, /run held one of each for every such instance."""
    bed = Bed(tmp_path, {"t@.service": "Priority=90\n"}, [])
    path = env_file(bed.config.runtime_dir, INSTANCE)
    pipe = Path(bed.config.runtime_dir) / "gate" / INSTANCE

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_job_new(1, "/org/freedesktop/systemd1/job/1", INSTANCE)
        await until(lambda: bed.systemd.watches(INSTANCE))
        signal(bed, INSTANCE, at_gate())
        await settle()
        assert read_pipe(bed, INSTANCE) == START.hex() + "\n"
        signal(bed, INSTANCE, {**running(), "Job": (0, "/")})
        await settle()
        assert ctl.scheduler.grants() == {INSTANCE: frozenset({0})}
        assert path.read_text() == TOLD_GPU_0
        assert pipe.exists()
        await template_unannotated(bed, tmp_path)
        signal(bed, INSTANCE, DOWN)
        await settle()
        assert ctl.scheduler.grants() == {}
        assert not path.parent.exists()
        assert not pipe.exists()

    run(test)


def test_an_instance_let_through_on_its_gpu_keeps_its_env_file_until_it_goes_down(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """t@1.service's template loses its annotation while it runs on GPU 0, and
    `systemctl restart t@1.service` runs it again with no moment down between (its restart
    job shows it inactive, the job still queued): it keeps GPU 0 and its file, and is let
    through on them. When that run ends, the file goes."""
    bed, path = instance_holds_gpu_0(tmp_path)
    cgroup_of[4343] = INSTANCE
    job = "/org/freedesktop/systemd1/job/7"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await template_unannotated(bed, tmp_path)
        ctl.on_job_new(7, job, INSTANCE)
        signal(bed, INSTANCE, {"ActiveState": "deactivating", "SubState": "stop", "Job": (7, job)})
        signal(bed, INSTANCE, {"ActiveState": "inactive", "SubState": "dead", "Job": (7, job)})
        await settle()
        assert ctl.scheduler.grants() == {INSTANCE: frozenset({0})}
        assert path.read_text() == TOLD_GPU_0
        bed.systemd.units[INSTANCE] = state(INSTANCE, "activating", "start-pre", 7)
        signal(bed, INSTANCE, {**at_gate(invocation=b"next"), "Job": (7, job)})
        await bed.acquire(INSTANCE, ":1.10", 4343)
        await until(lambda: bed.service.granted != [])
        assert bed.service.granted == [(INSTANCE, "0")]
        assert path.read_text() == TOLD_GPU_0
        signal(bed, INSTANCE, {**running(), "Job": (0, "/")})
        await settle()
        assert path.read_text() == TOLD_GPU_0
        bed.systemd.units[INSTANCE] = state(INSTANCE, "inactive", "dead")
        signal(bed, INSTANCE, DOWN)
        await settle()
        assert ctl.scheduler.grants() == {}
        assert not path.parent.exists()

    run(test)


def test_an_instance_whose_annotation_went_loses_its_env_file_at_the_down_our_stop_ends(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """urgent.service takes GPU 0 from t@1.service, whose template lost its annotation: the
    signal showing t@1.service down while our stop job is still there releases GPU 0, and
    t@1.service is no longer followed, so the signals that end the job are not heard. The
    file goes at that down."""
    bed, path = instance_holds_gpu_0(tmp_path)
    cgroup_of[4242] = "urgent.service"
    resume, jobs = held_after_answer(bed)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await template_unannotated(bed, tmp_path)
        await bed.acquire("urgent.service", ":1.9", 4242)
        assert bed.systemd.calls[-1] == ("stop", INSTANCE)
        (job,) = jobs
        signal(bed, INSTANCE, {"ActiveState": "deactivating", "SubState": "stop", "Job": (1, job)})
        assert path.read_text() == TOLD_GPU_0
        signal(bed, INSTANCE, {"ActiveState": "inactive", "SubState": "dead", "Job": (1, job)})
        await settle()
        assert bed.service.granted == [("urgent.service", "0")]
        assert not path.parent.exists()
        ctl.on_job_removed(1, job, INSTANCE, "done")
        signal(bed, INSTANCE, DOWN)
        resume.set()
        await settle()
        assert ctl.scheduler.grants() == {"urgent.service": frozenset({0})}

    run(test)


def test_an_instance_whose_annotation_went_keeps_its_env_file_while_its_down_waits(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """t@1.service, its template's annotation gone, shows down before systemd answered our
    stop of it: the tracker waits for the answer to judge that down, and the core still
    holds GPU 0 for it meanwhile, so its file stays. The read at the answer takes the down
    in, and the file goes then."""
    bed, path = instance_holds_gpu_0(tmp_path)
    cgroup_of[4242] = "urgent.service"
    answer = late_stops(bed)

    async def test() -> None:
        await bed.controller.start()
        await instance_down_before_our_stop_is_answered(bed, tmp_path)
        assert path.read_text() == TOLD_GPU_0
        answer.set()
        await until(lambda: bed.service.granted != [])
        assert bed.systemd.reads == [INSTANCE]
        assert not path.parent.exists()

    run(test)


def test_a_plain_unit_whose_annotation_went_keeps_its_env_file_when_it_goes_down(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """Not an instance: low.service, its annotation gone while it ran on GPU 0, ends. Its
    file stays, as an annotated plain unit's does (one per unit file, not per job): a start
    of it that is still gated is let through only after `Gates.let_through` removed the file
    (no GPUs held), and the next controller start sweeps it."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    path = env_file(bed.config.runtime_dir, "low.service")
    path.parent.mkdir(parents=True)
    path.write_text(TOLD_GPU_0)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await unannotate(ctl, tmp_path, "low.service")
        goes_down(bed, "low.service")
        await settle()
        assert ctl.scheduler.grants() == {}
        assert path.read_text() == TOLD_GPU_0

    run(test)


def test_a_start_in_its_exec_condition_stops_nothing_until_its_gate(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """urgent.service (10) runs its `ExecCondition=` (SubState `condition`, its InvocationID
    known) while low.service (90) holds the GPU: systemd runs that check before every
    `ExecStartPre=`, the gate's included, and may skip the start. Taken in as if its gate
    had asked, low was stopped for a start that never ran; it is stopped once urgent shows
    at start-pre."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        condition = {**at_gate(), "SubState": "condition"}
        ctl.on_unit_changed("urgent.service", condition)
        await settle()
        assert ("stop", "low.service") not in bed.systemd.calls
        assert ctl.scheduler.phase("low.service") is Phase.RUNNING
        assert not ctl.scheduler.is_waiting("urgent.service")
        ctl.on_unit_changed("urgent.service", at_gate())
        await settle()
        assert ("stop", "low.service") in bed.systemd.calls

    run(test)


def test_a_queued_start_read_in_its_exec_condition_stops_nothing(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start announced (JobNew) whose read, no signal since, shows it in its
    `ExecCondition=`: not yet known (no announce), so low.service runs on."""
    monkeypatch.setattr(controller_module, "QUEUED_DELAY", HOUR)  # ended by the test
    bed = low_holds_gpu_0(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        queued(bed, "urgent.service", "start")
        bed.systemd.units["urgent.service"] = state(
            "urgent.service", "activating", "condition", 5, "start"
        )
        assert await due_now(ctl._queued) == 1
        assert bed.systemd.reads == ["urgent.service"]
        assert ("stop", "low.service") not in bed.systemd.calls
        assert not ctl.scheduler.is_waiting("urgent.service")

    run(test)


def skipped_by_its_condition(ctl: Controller, unit: str, job_id: int, at: int) -> None:
    """systemd 252's signals of a start its `Condition*=` skips, as the bed shows them: the
    JobNew, the unit's PropertiesChanged with the failed check (sent before the JobRemoved,
    also where the check came before the JobNew was sent), the job's end `done`, as a stop
    of a unit down ends, and the unit shown with no job."""
    job = f"/org/freedesktop/systemd1/job/{job_id}"
    ctl.on_job_new(job_id, job, unit)
    check = {"ConditionResult": False, "ConditionTimestampMonotonic": at}
    down = {"ActiveState": "inactive", "SubState": "dead"}
    ctl.on_unit_changed(unit, {**down, "Job": (job_id, job), **check})
    ctl.on_job_removed(job_id, job, unit, "done")
    ctl.on_unit_changed(unit, {**down, "Job": (0, "/"), **check})


def test_a_start_its_condition_skips_is_no_stop_and_preempts_nothing(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`systemctl start urgent.service` (10), its `ConditionPathExists=` false, while
    low.service (90) holds the GPU: the start job ended `done` with urgent down, and was
    taken for someone's stop: urgent held (`urgent.service was stopped outside gpuslice:
    held until started again`). Nothing of it ran: no hold, low runs on. Someone's stop of
    it later, down as it is, still holds it: the check it shows is the one seen."""
    monkeypatch.setattr(controller_module, "QUEUED_DELAY", HOUR)  # not read: told by signals
    bed = low_holds_gpu_0(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        skipped_by_its_condition(ctl, "urgent.service", 5, 1_000_000)
        await settle()
        assert "urgent.service" not in ctl.scheduler.held
        assert ctl.scheduler.save().failed == []  # unknown to the core: nothing to say
        assert ("stop", "low.service") not in bed.systemd.calls
        assert ctl.scheduler.phase("low.service") is Phase.RUNNING
        job = "/org/freedesktop/systemd1/job/6"  # `systemctl stop urgent.service`
        check = {"ConditionResult": False, "ConditionTimestampMonotonic": 1_000_000}
        ctl.on_job_new(6, job, "urgent.service")
        down = {"ActiveState": "inactive", "SubState": "dead"}
        ctl.on_unit_changed("urgent.service", {**down, "Job": (6, job), **check})
        ctl.on_job_removed(6, job, "urgent.service", "done")
        ctl.on_unit_changed("urgent.service", {**down, "Job": (0, "/"), **check})
        await settle()
        assert "urgent.service" in ctl.scheduler.held

    run(test)


def test_a_refill_its_condition_skips_is_said_skipped_and_not_started_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A start of gpuslice's (here a refill of bg.service) that systemd skips for a false
    `Condition*=`: its start job ends `done`, the unit down, as a run that ended: it was
    said `finished` (work done), where nothing of it ran. It is said skipped, recorded with
    the failed units, and not started again (no StartUnit at every pass)."""
    bed = refill_bed(tmp_path)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert bed.systemd.calls.count(("start", "bg.service")) == 1
        assert ctl.scheduler.phase("bg.service") is Phase.STARTING
        skipped_by_its_condition(ctl, "bg.service", 1, 2_000_000)
        await settle()
        assert ctl.scheduler.save().failed == ["bg.service"]
        assert ctl.scheduler.save().finished == []
        assert ctl.scheduler.phase("bg.service") is None
        said = [m for m in messages(caplog) if m.startswith("bg.service ")]
        assert said[-1].startswith("bg.service skipped: its Condition*= or ExecCondition= said no")
        assert bed.systemd.calls.count(("start", "bg.service")) == 1

    run(test)
