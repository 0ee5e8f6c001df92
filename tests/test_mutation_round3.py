"""Promises of the audit that wakes gates never heard, of starts held back by a rescan, of a
reload's sampler and of a unit file's search, that mutation testing showed no test held.

The audit (GatePipes.wake_unheard, Controller._wake_unheard_gates) wakes, over two audits,
the gate of a start whose signals were all lost: each pipe in the directory is probed, not
only the first; the one a gate waits on is found behind pipes no gate waits on and behind
something that is not a pipe; our own end of a held pipe is never taken for a gate; with no
descriptor to spare, a second gate found is woken at once. Not the gate of a unit the core
knows, nor of a start held back while a rescan runs; a gate of a start never heard is woken
while a rescan runs too. The starts held back (Controller._gates_after_scan) are each taken
in once the scan is read, after one that left its gate meanwhile. A reload that leaves
sample_interval as it was keeps the sampler's timer (GpuWatch.reconfigure). A link out of
the search path whose links loop is not-found, as in systemd, not a lower directory's file
(UnitIndex.fragment).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import time
from pathlib import Path
from subprocess import PIPE

import pytest

from gpuslice.annotations import scan
from gpuslice.config import Config
from gpuslice.core.scheduler import SavedState
from gpuslice.gatepipes import GatePipes
from gpuslice.unitfiles import UnitIndex
from tests.test_controller import (
    PATIENCE,
    Bed,
    StubNvml,
    at_gate,
    bed_config,
    goes_down,
    messages,
    run,
    settle,
    shell_reader,
    state,
    until,
)
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_controller import signal as signal_of
from tests.test_controller_reload import HeldScan, start_in_flight
from tests.test_gatepipes import (
    _SYSCALLS,
    BLOCKS_WITHIN,
    START,
    UNIT,
    _open_ends,
    blocked_in_open,
)
from tests.test_gatepipes import _no_gate_left as _no_gate_left  # autouse
from tests.test_gatepipes import pipes as pipes  # a fixture
from tests.test_gpuwatch_mutation import watch_on
from tests.test_unitfiles import ETC, LIB, link, write

# ---- GatePipes.wake_unheard ----


class Reader:
    """A gate's read of the pipe of `unit` (`read -r line < PIPE`), as the shipped gate
    does it, for units other than UNIT; it says what it read."""

    def __init__(self, pipes: GatePipes, unit: str) -> None:
        self.unit = unit
        self.proc = subprocess.Popen(
            [
                "/bin/sh",
                "-c",
                'read -r line < "$1"; echo "read [$line]"',
                "sh",
                str(pipes.directory / unit),
            ],
            stdout=PIPE,
            text=True,
        )

    def blocked(self, opened: bool) -> None:
        """Wait until it sleeps in open(2) (`opened` False) or read(2)."""
        wanted = _SYSCALLS.get(os.uname().machine, {}).get("read" if opened else "openat")
        deadline = time.monotonic() + BLOCKS_WITHIN
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the reader ended instead of waiting"
            if wanted is None:
                time.sleep(0.5)
                return
            try:
                call = Path(f"/proc/{self.proc.pid}/syscall").read_text().split()
            except OSError:
                call = []
            if call[:1] == [str(wanted)]:
                return
            time.sleep(0.02)
        raise AssertionError(f"{self.unit}'s reader never blocked in its pipe")

    def waits(self) -> bool:
        try:
            self.proc.wait(0.3)
        except subprocess.TimeoutExpired:
            return True
        return False

    def read(self) -> str:
        out, _ = self.proc.communicate(timeout=10)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def readers(pipes: GatePipes, units: list[str]) -> list[Reader]:
    """A reader on each unit's pipe (made first, as an earlier start left it), each blocked
    in open(): nothing holds the pipes."""
    for unit in units:
        pipes.expect(unit)
    found = [Reader(pipes, unit) for unit in units]
    for reader in found:
        reader.blocked(opened=False)
    return found


def test_the_audit_asks_of_each_kept_gate_by_its_own_unit(tmp_path: Path, pipes: GatePipes) -> None:
    """The controller's `unheard` answers by the unit it is asked of: a gate the last audit
    kept is woken only if its own unit is still unheard."""
    gate = blocked_in_open(tmp_path, pipes)
    asked: list[str] = []

    def unheard(unit: str) -> bool:
        asked.append(unit)
        return unit == UNIT

    assert pipes.wake_unheard(unheard) == []
    gate.blocked_in_pipe(opened=True)
    assert pipes.wake_unheard(unheard) == [UNIT]
    assert asked == [UNIT, UNIT]
    assert gate.ended() == 0
    assert gate.asked_over_dbus()


def test_a_pipe_held_for_its_start_is_never_taken_for_an_unheard_gate(pipes: GatePipes) -> None:
    """Our own end of a held pipe reads as a gate waiting on it: probed, it was kept as if
    found unheard, and the next audit said the start's signals were lost and sent its gate to
    D-Bus, though its signal had come and it was being decided on."""
    assert pipes.at_gate(UNIT, START)
    for _ in range(3):
        assert pipes.wake_unheard(lambda unit: True) == []
    assert pipes.holds(UNIT)


def test_a_gate_is_found_behind_pipes_no_gate_waits_on(tmp_path: Path, pipes: GatePipes) -> None:
    """Most pipes in the directory are of units no gate waits on now (ENXIO): each is passed
    over, and the gate behind them, in whatever order the directory lists them, is found."""
    units = [f"u{i}.service" for i in range(6)]
    for unit in units:
        pipes.expect(unit)
    last = [entry.name for entry in os.scandir(pipes.directory)][-1]
    reader = Reader(pipes, last)
    try:
        reader.blocked(opened=False)
        assert pipes.wake_unheard(lambda unit: True) == []
        reader.blocked(opened=True)  # held: our end is open
        assert pipes.wake_unheard(lambda unit: True) == [last]
        assert reader.read() == "read []\n"
    finally:
        reader.close()


def test_something_not_a_pipe_in_the_directory_is_passed_over(
    tmp_path: Path, pipes: GatePipes
) -> None:
    """A file where a pipe should be (left by hand; the gate never reads it: `[ -p ]`) is
    opened by the probe, closed, and the audit goes on to the gate behind it."""
    pipes.expect(UNIT)
    (pipes.directory / "file.service").write_text("not a pipe\n")
    (pipes.directory / "other.service").write_text("")
    reader = Reader(pipes, UNIT)
    try:
        reader.blocked(opened=False)
        assert pipes.wake_unheard(lambda unit: True) == []
        reader.blocked(opened=True)
        assert pipes.wake_unheard(lambda unit: True) == [UNIT]
        assert reader.read() == "read []\n"
    finally:
        reader.close()
    # nothing left open below the directory (this process's other descriptors, counted, are
    # also those a thread of an earlier test or the garbage collector opens or closes)
    assert _open_ends(pipes) == []


def test_gates_found_unheard_beyond_the_descriptors_left_are_woken_at_once(
    tmp_path: Path,
) -> None:
    """One descriptor to spare and two gates found unheard in one audit: the first is held,
    the second, for which there is none, is woken at once (as at_gate sends a gate over the
    budget to the bus); held too, the descriptors in use went past max_open."""
    pipes = GatePipes(tmp_path / "run" / "gate", max_open=1)
    found = readers(pipes, ["a.service", "b.service"])
    try:
        woken = pipes.wake_unheard(lambda unit: True)
        assert len(woken) == 1
        [reader] = [r for r in found if r.unit == woken[0]]
        [other] = [r for r in found if r.unit != woken[0]]
        assert reader.read() == "read []\n"
        assert other.waits()  # held: in read(), for its signal or the next audit
        assert pipes.wake_unheard(lambda unit: True) == [other.unit]
        assert other.read() == "read []\n"
    finally:
        for r in found:
            r.close()
        pipes.close_all()


# ---- Controller._wake_unheard_gates ----


def three_units(tmp_path: Path) -> Bed:
    """low.service (90) runs on the one GPU; urgent.service (10) and a.service (50) may
    start."""
    return Bed(
        tmp_path,
        {
            "low.service": "Priority=90\n",
            "urgent.service": "Priority=10\n",
            "a.service": "Priority=50\n",
        },
        [state("low.service", "active", "running")],
        SavedState(holders={"low.service": ((0,), "running", 1, "")}, seq=1),
        config=bed_config(tmp_path),
    )


async def reloaded(bed: Bed, held: HeldScan) -> None:
    """A daemon-reload ends: the rescan it begins has read the unit files once this returns,
    and waits for `held.go`."""
    bed.controller.on_reloading(False)
    await held.has_read()


def test_during_a_rescan_the_audit_wakes_only_the_gate_of_a_start_never_heard(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A rescan is under way (a scan of 10,000 units takes ~1 s; a tool may reload in a
    loop). Three gates wait on their pipes through two audits:
    - urgent.service's, whose start systemd showed at its gate and which is held back for the
      scan: its signal was heard, and it is answered at its pipe once the scan is read;
    - low.service's, of a unit the core knows (it holds GPU 0): the audit's read of it tells
      what its signals did not;
    - a.service's, whose start's signals were all lost: nothing else would ever open its
      pipe, rescan or not; it is woken to ask over D-Bus, and said so, once."""
    bed = three_units(tmp_path)
    held = HeldScan(monkeypatch)
    gate_dir = Path(bed.config.runtime_dir) / "gate"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await reloaded(bed, held)
        await start_in_flight(bed, "pipe")()
        assert ctl.rescans.task is not None and "urgent.service" in ctl.rescans.after_scan
        ctl.gates.expect("low.service")  # pipes their earlier starts left
        ctl.gates.expect("a.service")
        gates = {u: await shell_reader(gate_dir / f"{u}.service") for u in ("urgent", "low", "a")}
        try:
            assert [g.returncode for g in gates.values()] == [None, None, None]
            with caplog.at_level(logging.WARNING, logger="gpuslice"):
                await ctl.reads.audit()
                await ctl.reads.audit()
                out, _ = await asyncio.wait_for(gates["a"].communicate(), PATIENCE)
                await asyncio.sleep(0.1)
            assert out == b"read []\n"  # end of file: it asks over D-Bus
            assert gates["urgent"].returncode is None
            assert gates["low"].returncode is None
            assert ctl.counters.errors["dbus_signals_lost"] == 1
            assert [m for m in messages(caplog) if "signals were lost" in m] == [
                "a.service waits at its gate on its pipe, yet no word of that start reached "
                "gpuslice (its signals were lost on the bus): it asks over D-Bus now"
            ]
            held.go.set()
            await until(lambda: ("stop", "low.service") in bed.systemd.calls)
            assert ctl.gates.holds("urgent.service")  # taken in at its pipe
        finally:
            for gate in gates.values():
                if gate.returncode is None:
                    gate.kill()
                await gate.wait()

    run(test)


# ---- Controller._gates_after_scan ----


def test_each_start_held_back_is_taken_in_after_one_that_left_its_gate(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """a.service's and then urgent.service's starts are seen at their gates while a rescan
    runs, and held back; a.service's is stopped before the scan is read. Once it is,
    urgent.service's start is taken in all the same: it preempts low.service and waits for
    its GPU. a.service, gone from its gate, asks for nothing."""
    bed = three_units(tmp_path)
    held = HeldScan(monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await reloaded(bed, held)
        job = "/org/freedesktop/systemd1/job/8"
        bed.systemd.units["a.service"] = state("a.service", "activating", "start-pre", 8, "start")
        ctl.on_job_new(8, job, "a.service")
        signal_of(bed, "a.service", {**at_gate(), "Job": (8, job)})
        await settle()
        job = "/org/freedesktop/systemd1/job/7"
        bed.systemd.units["urgent.service"] = state(
            "urgent.service", "activating", "start-pre", 7, "start"
        )
        ctl.on_job_new(7, job, "urgent.service")
        signal_of(bed, "urgent.service", {**at_gate(), "Job": (7, job)})
        await settle()
        assert list(ctl.rescans.after_scan) == ["a.service", "urgent.service"]
        goes_down(bed, "a.service")  # stopped at its gate
        await settle()
        held.go.set()
        await until(lambda: ("stop", "low.service") in bed.systemd.calls)
        await until(lambda: ctl.rescans.task is None)
        assert ctl.scheduler.is_waiting("urgent.service")
        assert not ctl.scheduler.is_waiting("a.service")
        assert ctl.scheduler.phase("a.service") is None

    run(test)


# ---- GpuWatch.reconfigure ----


def test_a_reload_that_keeps_the_interval_leaves_the_sampler_armed_as_it_was(
    tmp_path: Path,
) -> None:
    """A reload that changes anything but sample_interval keeps the timer running: armed
    anew, each reload put the next sample off by a whole interval, and a tool that reloads
    more often than that (every few minutes, with an hour's interval) stopped sampling."""
    watch, holdings, timers, _ = watch_on(
        tmp_path, StubNvml(), Config(gpus=1, sample_interval=3600)
    )
    watch.open()
    holdings.work = True
    watch.arm_sampler()
    [armed] = timers.due
    for level in ("debug", "info", "warning"):
        watch.reconfigure(Config(gpus=1, sample_interval=3600, log_level=level))
        assert len(timers.due) == 1 and timers.due[0] is armed


# ---- UnitIndex.fragment ----


def test_a_linked_unit_file_whose_links_loop_is_not_found_not_a_lower_directorys(
    tmp_path: Path,
) -> None:
    """/etc's a.service links out of the search path (`systemctl link`), to a link that loops.
    systemd 252 maps the name to the link by its text alone (unit_file_build_name_map; a
    lower directory's entry of a name already mapped is skipped), then cannot open it: the
    unit is not-found, and /usr/lib's a.service is never loaded. Taken for the unit's file,
    it made gpuslice manage, by an annotation systemd never reads, a unit that cannot start.
    The same for an instance with such a link of its own: its template's file is not its."""
    annotated = "[Service]\nExecStart=/bin/a\n[X-GPUSlice]\nPriority=3\n"
    write(tmp_path, f"{LIB}/a.service", annotated)
    write(tmp_path, f"{LIB}/t@.service", annotated)
    link(tmp_path, f"{ETC}/a.service", "/opt/a.service")
    link(tmp_path, "/opt/a.service", "/opt/a.service")
    link(tmp_path, f"{ETC}/t@x.service", "/opt/t@x.service")
    link(tmp_path, "/opt/t@x.service", "/opt/b")
    link(tmp_path, "/opt/b", "/opt/t@x.service")
    index = UnitIndex(tmp_path)
    assert index.fragment("a.service") is None
    assert index.fragment("t@x.service") is None
    fragment = index.fragment("t@y.service")  # no file of its own: its template's
    assert fragment is not None and fragment.path == f"{LIB}/t@.service"
    assert "a.service" not in scan(tmp_path).specs
