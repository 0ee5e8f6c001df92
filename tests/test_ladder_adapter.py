"""gpuslice/ladder.py on its own: suspend, resume and freeze with the fake cuda-checkpoint and
real gpu-alloc jobs, a recording freezer for systemd's side and a process list read from the
fake GPU's allocation files (what NVML would show). Seconds, no container; the whole path
against a real systemd is tests/integration/test_ladder.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice import checkpoint, ladder
from gpuslice.core.scheduler import Action
from gpuslice.inventory import GpuUse
from gpuslice.ladder import THAW_RETRY, Ladder
from gpuslice.systemd import SystemdError
from gpuslice.tracker import UnitState
from tests.test_checkpoint import FAST, TIMEOUT, Bed, calls, fake_systemd

UNIT = "vlm.service"
GIB = 1 << 30
LOOK = f"state {UNIT}"  # a suspend reads FreezerState before its lock: nobody else froze it?


class Freezer:
    """systemd's freezer as the ladder calls it, recorded; `fail` makes a call raise."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail: set[str] = set()
        self.pids: list[int] = []
        self.states: dict[str, str] = {}  # FreezerState by unit ("running" if not named)
        self.active: dict[str, str] = {}  # ActiveState by unit ("active" if not named)
        self.on_active: Callable[[], object] = lambda: None  # run as ActiveState is read

    async def _do(self, what: str, name: str) -> None:
        self.calls.append(f"{what} {name}")
        if what in self.fail:
            raise RuntimeError(f"{what} refused")

    async def freeze_unit(self, name: str) -> None:
        await self._do("freeze", name)

    async def thaw_unit(self, name: str) -> None:
        await self._do("thaw", name)

    async def unit_pids(self, name: str) -> list[int]:
        return list(self.pids)

    async def freezer_state(self, name: str) -> str:
        self.calls.append(f"state {name}")
        if "state" in self.fail:
            raise RuntimeError("no such unit")
        return self.states.get(name, "running")

    async def unit_state(self, name: str) -> UnitState:
        self.calls.append(f"active {name}")
        self.on_active()
        if "active" in self.fail:
            raise SystemdError("org.freedesktop.DBus.Error.NoReply", "no answer")
        return UnitState(name, self.active.get(name, "active"), "running", 0)


class Events:
    """The core's ladder events, recorded as `name(unit, words)`."""

    def __init__(self) -> None:
        self.said: list[tuple[str, str, str]] = []

    def _note(self, event: str, name: str, words: str) -> list[Action]:
        self.said.append((event, name, words))
        return []

    def suspended_done(self, name: str, detail: str) -> list[Action]:
        return self._note("suspended", name, detail)

    def suspend_failed(
        self, name: str, why: str, *, lost: bool = False, not_ours: bool = False
    ) -> list[Action]:
        event = "suspend_failed_lost" if lost else "suspend_failed"
        return self._note(event + "_not_ours" if not_ours else event, name, why)

    def resumed(self, name: str, detail: str) -> list[Action]:
        return self._note("resumed", name, detail)

    def resume_failed(self, name: str, why: str) -> list[Action]:
        return self._note("resume_failed", name, why)

    def freeze_failed(self, name: str, why: str, *, not_ours: bool = False) -> list[Action]:
        return self._note("freeze_failed_not_ours" if not_ours else "freeze_failed", name, why)

    def thawed_outside(self, name: str) -> list[Action]:
        return self._note("thawed_outside", name, "")

    def thaw_done(self, name: str) -> list[Action]:
        return self._note("thaw_done", name, "")

    def froze_after_end(self, name: str) -> list[Action]:
        return self._note("froze_after_end", name, "")


class Host:
    """A Ladder wired to the fake GPU: `mine` are the PIDs NVML attributes to UNIT."""

    def __init__(self, bed: Bed, tmp_path: Path) -> None:
        self.bed = bed
        self.freezer = Freezer()
        self.events = Events()
        self.mine: set[int] = set()
        self.moved: set[int] = set()  # PIDs whose cgroup is no longer UNIT's
        self.unknown_memory = False
        self.nvml = True
        self.marker = tmp_path / "cgroup.controllers"
        self.marker.touch()
        self.host_memory: int | None = 64 * GIB
        self.settings = dataclasses.replace(FAST, tool=bed.tool)
        self.waits: list[float] = []  # THAW_RETRY's, recorded (not waited)
        self.ladder = Ladder(
            self.freezer,
            self.events,
            self.processes,
            lambda: self.settings,
            self.report,
            unified_marker=self.marker,
            host_memory=lambda: self.host_memory,
            unit_of_pid=lambda pid: UNIT if pid in self.mine and pid not in self.moved else None,
            sleep=self.wait,
        )

    def processes(self) -> list[GpuUse] | None:
        """What NVML shows: every live allocation, attributed to UNIT when it is `mine`."""
        if not self.nvml:
            return None
        out = []
        for path in sorted((self.bed.state / "alloc").glob("[0-9]*")):
            gpu, pid, size = path.read_text().split()
            used = None if self.unknown_memory else int(size)
            unit = UNIT if int(pid) in self.mine else None
            out.append(GpuUse(int(pid), int(gpu), used, unit, "gpu-alloc"))
        return out

    def report(self, event: Callable[[], list[Action]]) -> None:
        event()

    async def wait(self, seconds: float) -> None:
        self.waits.append(seconds)

    def job(self, size: str = "2G") -> int:
        pid = self.bed.alloc(size)
        self.mine.add(pid)
        return pid

    def restarted_ladder(self) -> Ladder:
        """The ladder of a controller restarted since: nothing kept of what it suspended."""
        return Ladder(
            self.freezer,
            self.events,
            self.processes,
            lambda: self.settings,
            self.report,
            unified_marker=self.marker,
            unit_of_pid=lambda pid: UNIT,
        )

    def said(self) -> list[tuple[str, str, str]]:
        return self.events.said


def hosted(fake_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    """A Host on its own fake GPU, closed after the test: the `host` fixtures' body (here
    and in test_ladder_mutation, which cannot import a fixture under its parameter's name)."""
    state = tmp_path / "nvml"
    monkeypatch.setenv("FAKE_NVML_DIR", str(state))
    bed = Bed(fake_build, state)
    yield Host(bed, tmp_path)
    bed.close()


@pytest.fixture
def host(fake_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    yield from hosted(fake_build, tmp_path, monkeypatch)


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_suspend_then_resume(host: Host) -> None:
    a, b = host.job("2G"), host.job("1G")
    other = host.bed.alloc("1G")  # another unit's: left alone
    run(host.ladder.suspend(UNIT))
    [(event, unit, words)] = host.said()
    assert (event, unit) == ("suspended", UNIT)
    assert words.startswith("3 GiB to host memory in ") and words.endswith(" s")
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}"]
    assert not host.bed.holds(a) and not host.bed.holds(b) and host.bed.holds(other)
    assert host.ladder.suspensions[UNIT].vram == 3 * GIB
    run(host.ladder.resume(UNIT))
    event, unit, words = host.said()[-1]
    assert (event, unit) == ("resumed", UNIT)
    assert " s: restored in " in words
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}", f"thaw {UNIT}"]  # thawed, then restored
    assert host.bed.holds(a) and host.bed.holds(b)
    assert [host.bed.state_of(a), host.bed.state_of(b)] == ["running", "running"]
    assert UNIT not in host.ladder.suspensions


@pytest.mark.parametrize(
    ("arrange", "why"),
    [
        (lambda h: setattr(h, "nvml", False), "NVML is not available"),
        (lambda h: h.marker.unlink(), "cgroup v1 (hybrid hierarchy)"),
        (lambda h: h.mine.clear(), "NVML shows no process of it on a GPU"),
        (lambda h: setattr(h, "unknown_memory", True), "NVML does not report the memory of PID"),
        (lambda h: setattr(h, "host_memory", 3 * GIB), "not enough host memory: 2 GiB to move"),
        (lambda h: setattr(h, "host_memory", None), "not enough host memory: MemAvailable"),
        (lambda h: h.moved.update(h.mine), "is no longer a process of it"),
        (
            lambda h: setattr(h, "settings", dataclasses.replace(h.settings, tool="/nonexistent")),
            "cuda_checkpoint /nonexistent is not an executable file",
        ),
        (  # the stub is in the test's temporary directory: anyone may make files in /tmp
            lambda h: setattr(h, "settings", dataclasses.replace(h.settings, root_only=True)),
            "is not run: gpuslice runs it as root, and someone other than root can change it",
        ),
    ],
)
def test_what_is_checked_before_anything_is_done(
    host: Host, arrange: Callable[[Host], None], why: str
) -> None:
    pid = host.job("2G")
    host.settings = dataclasses.replace(host.settings, host_memory_margin=2 * GIB)
    arrange(host)
    run(host.ladder.suspend(UNIT))
    [(event, _, words)] = host.said()
    assert event == "suspend_failed"
    assert why in words, words
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"
    assert set(host.freezer.calls) <= {LOOK}  # nothing sent to systemd (a read at most)


def test_a_frozen_unit_is_thawed_before_its_processes_are_locked(host: Host) -> None:
    host.job()
    run(host.ladder.suspend(UNIT, thaw_first=True))
    assert host.said()[0][0] == "suspended"
    assert host.freezer.calls == [f"thaw {UNIT}", f"freeze {UNIT}"]


def test_a_frozen_unit_that_cannot_be_thawed_is_not_suspended(host: Host) -> None:
    pid = host.job()
    host.freezer.fail.add("thaw")
    run(host.ladder.suspend(UNIT, thaw_first=True))
    assert host.said() == [("suspend_failed", UNIT, "ThawUnit failed: thaw refused")]
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"


def test_a_failed_freeze_after_the_checkpoint_undoes_it(host: Host) -> None:
    pid = host.job()
    host.freezer.fail.add("freeze")
    run(host.ladder.suspend(UNIT))
    [(event, _, words)] = host.said()
    assert (event, words) == ("suspend_failed", "FreezeUnit failed: freeze refused")
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"
    assert UNIT not in host.ladder.suspensions


def test_memory_still_shown_after_the_checkpoint_is_not_believed_gone(host: Host) -> None:
    pid = host.job()
    real = host.processes
    calls = 0

    def stale() -> list[GpuUse] | None:  # the second sample still shows the process
        nonlocal calls
        calls += 1
        shown = real()
        return shown if calls == 1 else [GpuUse(pid, 0, GIB, UNIT, "gpu-alloc")]

    host.ladder.processes = stale
    run(host.ladder.suspend(UNIT))
    [(event, _, words)] = host.said()
    assert (event, words) == (
        "suspend_failed",
        f"NVML still shows PID {pid} on GPU 0 after the checkpoint",
    )
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}", f"thaw {UNIT}"]  # looked at frozen


def test_a_lock_timeout_leaves_the_job_running(host: Host) -> None:
    pid = host.job()
    host.bed.inject("lock-timeout")
    run(host.ladder.suspend(UNIT))
    [(event, _, words)] = host.said()
    assert (event, words) == ("suspend_failed", f"lock of PID {pid} timed out after 0.3 s")
    assert host.bed.state_of(pid) == "running"


def test_a_restore_that_runs_out_of_memory_is_reported_as_fatal(host: Host) -> None:
    pid = host.job()
    run(host.ladder.suspend(UNIT))
    host.bed.inject("restore-oom")
    run(host.ladder.resume(UNIT))
    event, _, words = host.said()[-1]
    assert event == "resume_failed"
    assert words.startswith(f"restore of PID {pid} ran out of GPU memory")


def test_a_resume_leaves_alone_a_pid_another_unit_s_process_has_now(host: Host) -> None:
    """b was killed while vlm.service was suspended, and the host gave its PID to another
    unit's process, suspended by a ladder of its own (here: b itself, now in another unit's
    cgroup). The resume restored it by the PID its suspend had recorded: another unit's
    memory back on a GPU given away, or a frozen process whose restore never returns."""
    a, b = host.job("1G"), host.job("1G")
    run(host.ladder.suspend(UNIT))
    # b's cgroup is another unit's now; a's is still its own
    host.ladder.unit_of_pid = {a: UNIT, b: "other.service"}.get
    run(host.ladder.resume(UNIT))
    event, _, words = host.said()[-1]
    assert (event, UNIT) == ("resumed", UNIT) and " s: restored in " in words
    assert host.bed.holds(a) and host.bed.state_of(a) == "running"
    assert not host.bed.holds(b) and host.bed.state_of(b) == "checkpointed"


def test_a_resume_leaves_alone_a_pid_whose_cgroup_cannot_be_read_as_its_own(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """a was killed while vlm.service was suspended, and the host gave its PID to a user's
    process in a delegated cgroup whose name holds a newline: its /proc/PID/cgroup then
    parses as no unit's, and the PID was kept, so root ran cuda-checkpoint on the user's
    process (here: a itself, its cgroup unreadable). A PID still there whose cgroup is not
    the unit's is left alone, with a warning; one that is gone is passed by, said at debug
    level."""
    a, b = host.job("1G"), host.job("1G")
    run(host.ladder.suspend(UNIT))
    gone = 4194305  # past the kernel's largest pid_max: never a process
    suspension = host.ladder.suspensions[UNIT]
    host.ladder.suspensions[UNIT] = dataclasses.replace(suspension, pids=(*suspension.pids, gone))
    host.ladder.unit_of_pid = {b: UNIT}.get
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        run(host.ladder.resume(UNIT))
    event, _, words = host.said()[-1]
    assert (event, UNIT) == ("resumed", UNIT) and " s: restored in " in words
    assert not host.bed.holds(a) and host.bed.state_of(a) == "checkpointed"
    assert host.bed.holds(b) and host.bed.state_of(b) == "running"
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (
        logging.WARNING,
        f"resuming {UNIT}: the cgroup of PIDs [{a}] cannot be read as its own: not resumed",
    ) in said
    assert (logging.DEBUG, f"resuming {UNIT}: PIDs [{gone}] are gone") in said


def test_two_suspends_at_once_count_each_other_s_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One waiter's two victims are suspended at once: each task checked MemAvailable before
    either had moved anything, so both found the 10 GiB free and 12 GiB went to host memory.
    The second is refused, saying why; once the first has moved its memory (MemAvailable
    shows it), it counts no more."""
    tool = tmp_path / "cuda-checkpoint"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    marker = tmp_path / "cgroup.controllers"
    marker.touch()
    units = {11: "a.service", 12: "b.service"}
    shown = [GpuUse(pid, pid - 11, 6 * GIB, unit, "job") for pid, unit in units.items()]
    available = [10 * GIB]

    async def suspend(tool: str, pids: list[int], s: object, owned: object = None) -> float:
        await asyncio.sleep(0)  # the other task runs its checks meanwhile
        shown[:] = [p for p in shown if p.pid not in pids]
        available[0] -= 6 * GIB
        return 0.1

    monkeypatch.setattr(checkpoint, "suspend", suspend)
    events = Events()
    settings = dataclasses.replace(FAST, tool=str(tool), host_memory_margin=0)

    def report(event: Callable[[], list[Action]]) -> None:
        event()

    ladder = Ladder(
        Freezer(),
        events,
        lambda: list(shown),
        lambda: settings,
        report,
        unified_marker=marker,
        host_memory=lambda: available[0],
        unit_of_pid=units.get,
    )

    async def both() -> None:
        await asyncio.gather(ladder.suspend("a.service"), ladder.suspend("b.service"))

    run(both())
    assert events.said == [
        (
            "suspend_failed",
            "b.service",
            "not enough host memory: 6 GiB to move but 4 GiB of host memory available "
            "(margin 0 B); other suspends under way are moving 6 GiB there",
        ),
        ("suspended", "a.service", "6 GiB to host memory in 0.1 s"),
    ]
    assert ladder.moving == 0
    available[0] = 10 * GIB  # a resumed meanwhile: b alone, and nothing under way
    run(ladder.suspend("b.service"))
    assert events.said[-1] == ("suspended", "b.service", "6 GiB to host memory in 0.1 s")


def test_resume_after_a_controller_restart_finds_the_processes_itself(host: Host) -> None:
    a = host.job()
    run(host.ladder.suspend(UNIT))
    fresh = host.restarted_ladder()
    # systemd lists the unit's processes: the CUDA one and a shell that is no CUDA process
    host.freezer.pids = [a, 1]
    run(fresh.resume(UNIT))
    event, _, words = host.said()[-1]
    assert event == "resumed"
    assert words.startswith("a controller restart: restored in ")
    assert host.bed.holds(a) and host.bed.state_of(a) == "running"


def _restart_resume_failed(host: Host, tmp_path: Path, answer: str) -> tuple[int, str]:
    """A suspended job's resume after a controller restart, the tool running `answer` (sh)
    for the job's `--get-state`: the job's PID and what the failed resume said."""
    a = host.job()
    run(host.ladder.suspend(UNIT))
    real = host.settings.tool
    tool = tmp_path / "answering-tool"
    tool.write_text(f'#!/bin/sh\n[ "$1 $3" = "--get-state {a}" ] && {answer}\nexec {real} "$@"\n')
    tool.chmod(0o755)
    host.settings = dataclasses.replace(host.settings, tool=str(tool))
    host.freezer.pids = [a, 1]
    run(host.restarted_ladder().resume(UNIT))
    event, _, words = host.said()[-1]
    assert event == "resume_failed", words
    assert host.bed.state_of(a) == "checkpointed"
    return a, words


def test_a_resume_after_a_restart_fails_on_a_process_whose_state_got_no_answer(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a controller restart the tool is asked which processes are checkpointed; one
    whose state it gave no answer for (timed out; systemd-run failing as systemd
    re-executes) counted as no CUDA process: skipped, the resume said nothing restored, and
    the unit ran on, blocked in its next CUDA call for good. Now the resume fails (and the
    core stops the unit, as after any failed resume)."""
    monkeypatch.setattr(checkpoint, "STATE_TIMEOUT", 0.3)
    a, words = _restart_resume_failed(host, tmp_path, "exec sleep 60")
    assert words == (
        f"the state of PID {a} could not be read: cuda-checkpoint did not return within 0.3 s "
        "and was killed: it may be checkpointed"
    )


def test_a_resume_after_a_restart_fails_on_a_process_whose_state_it_cannot_read(
    host: Host, tmp_path: Path
) -> None:
    """An answer of the tool that says no state (it exited 0 with words this version of
    gpuslice does not know) is no refusal: the process has CUDA, and may be checkpointed.
    Taken for a process with no CUDA, it was skipped, the resume said nothing restored,
    and the unit ran on, blocked in its next CUDA call for good."""
    answer = '{ echo "State: checkpointed (1)"; exit 0; }'
    a, words = _restart_resume_failed(host, tmp_path, answer)
    assert words == (
        f'cuda-checkpoint gave an unknown state for PID {a}: "State: checkpointed (1)": it '
        "may be checkpointed"
    )


def test_a_resume_after_a_restart_asks_the_state_of_a_bounded_number_of_processes(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each process's state is one run of the tool, one after another, up to 30 s each: a
    unit whose user forked thousands held its reserved GPUs for hours. Past the cap the
    resume fails at once, asking none."""
    a = host.job()
    run(host.ladder.suspend(UNIT))
    monkeypatch.setattr(ladder, "MAX_RECOVERED_PIDS", 2)
    host.freezer.pids = [a, 1, 2]
    run(host.restarted_ladder().resume(UNIT))
    assert host.said()[-1] == (
        "resume_failed",
        UNIT,
        "it has 3 processes, more than the 2 whose state cuda-checkpoint is asked after a "
        "controller restart",
    )
    assert host.bed.state_of(a) == "checkpointed"
    host.freezer.pids = [a, 1]
    run(host.restarted_ladder().resume(UNIT))
    assert host.said()[-1][0] == "resumed"


@contextlib.contextmanager
def restore_left_running(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A job suspended; the last controller's systemd-run restore of it still runs (its
    transient service's pid file names a sleep, killed on the way out); cuda-checkpoint
    runs go through systemd now. Yields the job's PID and that run."""
    a = host.job()
    run(host.ladder.suspend(UNIT))
    fake_systemd(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    left = subprocess.Popen(["sleep", "60"])  # the old controller's restore, still running
    try:
        (tmp_path / f"gpuslice-checkpoint-restore-{a}-900-7.service.pid").write_text(str(left.pid))
        host.settings = dataclasses.replace(host.settings, via_systemd=True)
        yield a, left
    finally:
        left.kill()
        left.wait(TIMEOUT)


def test_a_resume_after_a_controller_restart_first_stops_what_the_last_one_left_running(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services: None
) -> None:
    """The last controller was killed while it restored a (or locked it): its systemd-run
    client died with it, the transient service did not. The next controller's resume reads
    the process and settles it; a run of the old one landing after that (a lock, a
    checkpoint) would leave the job locked or checkpointed, its CUDA calls blocked for good,
    while it counted as resumed and held its GPU. Those runs are stopped, and down, before
    the resume runs anything on the process."""
    with restore_left_running(host, tmp_path, monkeypatch) as (a, left):
        fresh = host.restarted_ladder()
        host.freezer.pids = [a]
        run(fresh.resume(UNIT))
        assert host.said()[-1][0] == "resumed"
        log = calls(tmp_path)
        assert log[0].startswith("stop ") and f"gpuslice-checkpoint-restore-{a}-*" in log[0]
        assert log[1].startswith(f"run gpuslice-checkpoint-get-state-{a}-")
        assert left.wait(TIMEOUT) == -signal.SIGKILL
        assert host.bed.holds(a) and host.bed.state_of(a) == "running"


def recalled_ladder(host: Host) -> Ladder:
    """The ladder of a controller restarted since, given what the last one's suspends
    checkpointed, as the state file kept it (Controller._persist, then its start's recall);
    every PID's cgroup names UNIT (`given_away_after` for one another unit's)."""
    saved = host.ladder.checkpointed({UNIT})
    fresh = host.restarted_ladder()
    fresh.unit_of_pid = lambda pid: UNIT
    fresh.recall(saved)
    return fresh


def given_away_after(pid: int, looks: int) -> Callable[[int], str | None]:
    """A ladder's `unit_of_pid`: every PID is UNIT's, `pid` another unit's once it was
    looked at `looks` times (freed and given to another unit's process meanwhile)."""
    seen: list[int] = []

    def owner(looked: int) -> str | None:
        seen.append(looked)
        return "other.service" if looked == pid and seen.count(pid) > looks else UNIT

    return owner


def test_a_resume_after_a_restart_restores_the_pids_the_last_controller_checkpointed(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PIDs its suspend checkpointed are saved: a restarted controller resumes those,
    and asks no state of every process of the unit. Asked, a unit of more processes than
    MAX_RECOVERED_PIDS (a user may fork thousands) failed its resume and was stopped, its
    work lost."""
    a = host.job()
    run(host.ladder.suspend(UNIT))
    [(pids, vram, wall)] = host.ladder.checkpointed({UNIT}).values()
    assert (pids, vram) == ((a,), 2 * GIB) and abs(wall - time.time()) < 60
    assert host.ladder.checkpointed({"other.service"}) == {}
    monkeypatch.setattr(ladder, "MAX_RECOVERED_PIDS", 2)
    host.freezer.pids = [a, 1, 2]  # systemd's list: never asked
    fresh = recalled_ladder(host)
    assert fresh.suspensions[UNIT].vram == 2 * GIB
    run(fresh.resume(UNIT))
    event, _, words = host.said()[-1]
    assert event == "resumed", words
    assert " s: restored in " in words
    assert host.bed.holds(a) and host.bed.state_of(a) == "running"
    assert UNIT not in fresh.suspensions


@pytest.mark.parametrize("looks", [0, 1], ids=["before_the_restart", "after_the_first_look"])
def test_a_recalled_pid_given_to_another_unit_is_left_alone(host: Host, looks: int) -> None:
    """A PID saved before the restart may have been freed since (a frozen process dies of
    SIGKILL) and given to another unit's process, which its own suspend may have
    checkpointed: that one is not restored by this resume. Its cgroup is looked at again
    right before each cuda-checkpoint run on it: looked at once (`looks` 1), before the
    earlier controller's runs were stopped and the restores of the PIDs before it ran
    (seconds to minutes), a PID given away meanwhile was restored or unlocked beside that
    unit's own ladder."""
    a, b = host.job(), host.job()
    run(host.ladder.suspend(UNIT))
    fresh = recalled_ladder(host)
    fresh.unit_of_pid = given_away_after(b, looks)
    run(fresh.resume(UNIT))
    assert host.said()[-1][0] == "resumed"
    assert host.bed.state_of(a) == "running"
    assert host.bed.state_of(b) == "checkpointed"


def test_a_pid_given_to_another_unit_after_the_suspends_look_is_never_locked(
    host: Host,
) -> None:
    """The same look before each lock and checkpoint of a suspend: the job runs until it
    is frozen, after the checkpoints, and a process of it that exits frees its PID."""
    a, b = host.job(), host.job()
    host.ladder.unit_of_pid = given_away_after(b, 1)
    run(host.ladder.suspend(UNIT))
    event, _, why = host.said()[-1]
    assert event == "suspend_failed" and why == f"PID {b} is no longer a process of it"
    assert host.bed.state_of(a) == "running" and host.bed.state_of(b) == "running"


def test_a_pid_given_to_another_unit_between_its_lock_and_checkpoint_is_said_once(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """Found another unit's before its checkpoint, then again by the undo of the locks:
    one process, one line."""
    a, b = host.job(), host.job()
    host.ladder.unit_of_pid = given_away_after(b, 2)
    with caplog.at_level(logging.INFO):
        run(host.ladder.suspend(UNIT))
    event, _, why = host.said()[-1]
    assert event == "suspend_failed" and why == f"PID {b} is no longer a process of it"
    assert host.bed.state_of(a) == "running"
    said = [r.getMessage() for r in caplog.records if "no longer a process" in r.getMessage()]
    assert said == [f"{UNIT}: PID {b} is no longer a process of it: left alone"]


def test_a_pid_given_to_another_unit_before_the_undo_of_a_failed_freeze_is_left_alone(
    host: Host,
) -> None:
    """The freeze after the checkpoints failed: the undo's restores look again at each PID
    (`Ladder._owned_by`), as any resume's: a PID freed and given to another unit's process
    since its checkpoint is not restored or unlocked beside that unit's own ladder."""
    a, b = host.job(), host.job()
    # its looks: before the suspend, before its lock, before its checkpoint
    host.ladder.unit_of_pid = given_away_after(b, 3)
    host.freezer.fail.add("freeze")
    run(host.ladder.suspend(UNIT))
    assert host.said()[-1][0] == "suspend_failed"
    assert host.bed.state_of(a) == "running"
    assert host.bed.state_of(b) == "checkpointed"


def test_a_recalled_resume_first_stops_what_the_last_controller_left_running(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services: None
) -> None:
    """As a resume that asks each process's state: the last controller may have been killed
    mid-resume before it saved the unit resuming, its cuda-checkpoint run still going."""
    with restore_left_running(host, tmp_path, monkeypatch) as (a, left):
        fresh = recalled_ladder(host)
        run(fresh.resume(UNIT))
        assert host.said()[-1][0] == "resumed"
        log = calls(tmp_path)
        assert log[0].startswith("stop ") and f"gpuslice-checkpoint-restore-{a}-*" in log[0]
        assert left.wait(TIMEOUT) == -signal.SIGKILL
        assert host.bed.holds(a) and host.bed.state_of(a) == "running"


def test_freeze_and_its_failures(host: Host) -> None:
    host.freezer.states[UNIT] = "running"
    run(host.ladder.freeze(UNIT))
    assert host.freezer.calls == [f"state {UNIT}", f"freeze {UNIT}"] and host.said() == []
    host.freezer.fail.add("freeze")
    run(host.ladder.freeze(UNIT))
    assert host.said() == [("freeze_failed", UNIT, "FreezeUnit failed: freeze refused")]
    host.marker.unlink()
    run(host.ladder.freeze(UNIT))
    assert host.said()[-1][2] == "cgroup v1 (hybrid hierarchy): systemd cannot freeze units"


def test_a_thaw_that_fails_is_logged_not_raised(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    host.freezer.fail.add("thaw")
    run(host.ladder.thaw(UNIT))
    assert f"thawing {UNIT}: ThawUnit failed: thaw refused" in caplog.text


def test_a_thaw_that_failed_is_tried_again_until_systemd_shows_the_unit_running(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """A ThawUnit that fails left the unit frozen while the core holds it running: each
    check of the thaws owed (the sampling pace) reads its FreezerState and thaws it again,
    warning once, until one works; the core hears when it is done, and a unit shown running
    is owed nothing without a ThawUnit."""
    host.freezer.fail.add("thaw")
    host.freezer.states[UNIT] = "frozen"
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        run(host.ladder.thaw(UNIT))
        assert host.said() == []
        run(host.ladder.thaw_owed([UNIT]))  # still frozen, still failing
        assert host.freezer.calls == [f"thaw {UNIT}", f"state {UNIT}", f"thaw {UNIT}"]
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 1, [r.getMessage() for r in warned]  # said once, not per sample
        host.freezer.fail.clear()
        host.freezer.states[UNIT] = "freezing"
        run(host.ladder.thaw_owed([UNIT]))
    assert host.freezer.calls[-2:] == [f"state {UNIT}", f"thaw {UNIT}"]
    assert host.said() == [("thaw_done", UNIT, "")]
    assert (
        f"thawed {UNIT}: systemd showed it freezing, and gpuslice, which froze it, no longer "
        "holds it frozen"
    ) in caplog.text
    assert host.ladder.busy == {}
    host.freezer.states[UNIT] = "running"
    host.freezer.calls.clear()
    run(host.ladder.thaw_owed([UNIT]))
    assert host.freezer.calls == [f"state {UNIT}"]
    assert host.said()[-1] == ("thaw_done", UNIT, "")
    busy = host.ladder.freeze(UNIT)  # frozen again meanwhile: the freeze's, not asked
    run(host.ladder.thaw_owed([UNIT]))
    assert host.freezer.calls == [f"state {UNIT}"]
    run(busy)


def test_a_thaw_that_works_is_no_thaw_owed(host: Host) -> None:
    run(host.ladder.thaw(UNIT))
    assert host.said() == [("thaw_done", UNIT, "")]


def test_a_bug_while_suspending_is_a_failed_suspend_not_a_stuck_unit(host: Host) -> None:
    def broken() -> list[GpuUse] | None:
        raise KeyError("bug")

    host.ladder.processes = broken
    run(host.ladder.suspend(UNIT))
    [(event, _, words)] = host.said()
    assert event == "suspend_failed"
    assert words == "gpuslice failed while suspending (KeyError: 'bug')"


def test_a_thaw_by_hand_is_found_by_asking_systemd(host: Host) -> None:
    host.freezer.states = {"a.service": "running", "b.service": "frozen", "c.service": "running"}
    busy = host.ladder.freeze("c.service")  # ours, not yet sent: busy from now on
    run(host.ladder.check_thawed(["a.service", "b.service", "c.service"]))
    assert host.said() == [("thawed_outside", "a.service", "")]
    assert "state c.service" not in host.freezer.calls
    run(busy)
    assert host.ladder.busy == {}
    host.freezer.fail.add("state")
    run(host.ladder.check_thawed(["a.service"]))  # an error is no thaw
    assert len(host.said()) == 1


@pytest.mark.parametrize("active", ["deactivating", "inactive", "failed"])
def test_a_thaw_found_as_its_stop_begins_is_no_thaw_by_hand(host: Host, active: str) -> None:
    """systemd thaws a frozen unit to stop it, and answers a FreezerState read before it
    signals `deactivating`: a read sent before that signal found the unit `running`, and
    taken for a thaw by hand, the frozen unit being stopped counted as running (ended owed
    nothing by our stop; failed on its 143, not held, by someone's). Read again, it is no
    longer `active`: no thaw by hand. One whose second read fails is asked again later;
    one `reloading` (a reload thaws it too) runs."""
    host.freezer.states = {"a.service": "running"}
    host.freezer.active = {"a.service": active}
    run(host.ladder.check_thawed(["a.service"]))
    assert host.said() == []
    assert host.freezer.calls == ["state a.service", "active a.service"]
    host.freezer.active = {}
    host.freezer.fail.add("active")
    run(host.ladder.check_thawed(["a.service"]))
    assert host.said() == []
    host.freezer.fail.clear()
    host.freezer.active = {"a.service": "reloading"}
    run(host.ladder.check_thawed(["a.service"]))
    assert host.said() == [("thawed_outside", "a.service", "")]
    # an operation of ours begun while ActiveState was read: left to it
    ours: list[Coroutine[Any, Any, None]] = []
    host.freezer.on_active = lambda: ours.append(host.ladder.freeze("a.service"))
    run(host.ladder.check_thawed(["a.service"]))
    assert len(host.said()) == 1
    run(ours[0])


def run_within(coro: object, seconds: float = 10.0) -> None:
    """`run`, failing (not hanging) when it takes longer than `seconds`."""

    async def bounded() -> None:
        await asyncio.wait_for(coro, seconds)  # type: ignore[arg-type]

    run(bounded())


def test_nvml_gone_after_the_checkpoint_is_no_confirmation(host: Host) -> None:
    pid = host.job()
    real = host.processes
    samples = iter([real(), None])  # NVML stops answering during the checkpoint
    host.ladder.processes = lambda: next(samples)
    run(host.ladder.suspend(UNIT))
    assert host.said() == [
        (
            "suspend_failed",
            UNIT,
            "NVML is not available: the memory could not be confirmed gone after the checkpoint",
        )
    ]
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}", f"thaw {UNIT}"]
    assert UNIT not in host.ladder.suspensions


def test_a_process_of_the_unit_that_reached_a_gpu_during_the_checkpoint_fails_it(
    host: Host,
) -> None:
    pid = host.job()
    real = host.processes
    late: list[int] = []

    def sample() -> list[GpuUse] | None:
        shown = real()
        if not late:  # the first sample: then the unit starts another CUDA process
            late.append(host.job())
        return shown

    host.ladder.processes = sample
    run(host.ladder.suspend(UNIT))
    [(event, _, words)] = host.said()
    assert (event, words) == (
        "suspend_failed",
        f"NVML shows PID {late[0]} of it on GPU 0 after the checkpoint: a process started on a "
        "GPU meanwhile",
    )
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}", f"thaw {UNIT}"]
    assert UNIT not in host.ladder.suspensions


class LateFreezer(Freezer):
    """FreezeUnit on its way (one bus round trip) while a process of the unit makes its
    CUDA context: `late` starts it, and the freeze then catches it on its GPU. ThawUnit
    records which of the unit's processes are on the GPU at that moment (`at_thaw`)."""

    def __init__(self, host: Host) -> None:
        super().__init__()
        self.host = host
        self.late: list[int] = []
        self.at_thaw: dict[int, bool] = {}

    async def freeze_unit(self, name: str) -> None:
        self.late.append(self.host.job())
        await super().freeze_unit(name)

    async def thaw_unit(self, name: str) -> None:
        self.at_thaw = {p: self.host.bed.holds(p) for p in self.host.mine}
        await super().thaw_unit(name)


def test_a_process_that_reached_a_gpu_just_before_the_freeze_fails_the_suspend(
    host: Host,
) -> None:
    """NVML was asked before FreezeUnit: a process of the unit that made a CUDA context in
    between was not seen, and stayed frozen on the GPU given to the more urgent unit. The
    look comes after the freeze now; the suspend fails and is undone, thawed before the
    restore (it runs in the process)."""
    pid = host.job()
    host.ladder.systemd = host.freezer = LateFreezer(host)
    run(host.ladder.suspend(UNIT))
    [late] = host.freezer.late
    assert host.said() == [
        (
            "suspend_failed",
            UNIT,
            f"NVML shows PID {late} of it on GPU 0 after the checkpoint: a process started on "
            "a GPU meanwhile",
        )
    ]
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}", f"thaw {UNIT}"]
    assert host.freezer.at_thaw == {pid: False, late: True}  # thawed, then restored
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"
    assert UNIT not in host.ladder.suspensions and host.ladder.busy == {}


def test_a_suspend_asks_nvml_twice_the_second_time_once_frozen(host: Host) -> None:
    """The look after the freeze is the one that confirms the memory gone: no sample more
    than before per suspend."""
    host.job()
    real = host.processes
    seen: list[list[str]] = []

    def sample() -> list[GpuUse] | None:
        seen.append(list(host.freezer.calls))
        return real()

    host.ladder.processes = sample
    run(host.ladder.suspend(UNIT))
    assert host.said()[0][0] == "suspended"
    assert seen == [[LOOK], [LOOK, f"freeze {UNIT}"]]


def test_a_thaw_that_fails_before_the_undo_says_so(host: Host) -> None:
    pid = host.job()
    host.ladder.systemd = host.freezer = LateFreezer(host)
    host.freezer.fail.add("thaw")
    run(host.ladder.suspend(UNIT))
    [(_, _, words)] = host.said()
    assert (
        f"a GPU meanwhile; and ThawUnit failed: thaw refused (thaw it with systemctl thaw {UNIT})"
    ) in words
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}", f"thaw {UNIT}"]  # a refusal: not again
    assert host.bed.state_of(pid) == "running"  # the fake's processes were never frozen


def test_a_process_lost_by_the_undo_inside_the_checkpoint_step_is_reported_lost(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint.suspend undoes its own failures (a checkpoint that timed out after another
    process was checkpointed): a restore that fails there loses that process too, and the
    core must hear it (it stops the unit), not only the words."""
    pid = host.job()
    why = (
        f"checkpoint of PID 9 timed out after 1 s; and restore of PID {pid} failed: boom; "
        "the process cannot be resumed and must be stopped"
    )

    async def suspend(tool: str, pids: list[int], s: object, owned: object = None) -> float:
        raise checkpoint.CheckpointError(why, lost=(pid,))

    monkeypatch.setattr(checkpoint, "suspend", suspend)
    run(host.ladder.suspend(UNIT))
    assert host.said() == [("suspend_failed_lost", UNIT, why)]
    assert host.freezer.calls == [LOOK, LOOK] and host.ladder.moving == 0


def test_a_process_the_undo_leaves_locked_after_a_failed_freeze_is_reported_lost(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FreezeUnit failed after the checkpoint; the undo restored the process but could not
    unlock it: its CUDA calls block for good. Told as a plain failure, the core kept the unit
    running (with `Preempt=suspend` alone, never chosen again), stuck on its GPU."""
    pid = host.job()
    host.freezer.fail = {"freeze"}

    async def unlock(tool: str, target: int, s: object) -> None:
        raise checkpoint.CheckpointError(f"PID {target} could not be unlocked: busy")

    monkeypatch.setattr(checkpoint, "_unlock", unlock)
    run(host.ladder.suspend(UNIT))
    [(event, unit, words)] = host.said()
    assert (event, unit) == ("suspend_failed_lost", UNIT)
    assert words.endswith(
        f"; and undoing the checkpoint failed: PID {pid} could not be unlocked: busy"
    )
    assert host.bed.state_of(pid) == "locked"


class HungFreezer(Freezer):
    """FreezeUnit (or ThawUnit) never answered, as systemd does while a process of the unit
    cannot be frozen (stuck in the kernel)."""

    def __init__(self, hangs: str) -> None:
        super().__init__()
        self.hangs = hangs

    async def _do(self, what: str, name: str) -> None:
        await super()._do(what, name)
        if what == self.hangs:
            await asyncio.Event().wait()


def test_a_freeze_that_is_never_answered_fails_the_suspend_and_is_undone(host: Host) -> None:
    pid = host.job()
    host.ladder.systemd = host.freezer = HungFreezer("freeze")
    host.ladder.freezer_timeout = 0.2
    run_within(host.ladder.suspend(UNIT))
    assert host.said() == [
        ("suspend_failed", UNIT, "FreezeUnit did not answer within 0.2 s: thawed again")
    ]
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}", f"thaw {UNIT}"]  # thawed, then restored
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"
    assert UNIT not in host.ladder.suspensions and host.ladder.busy == {}


def test_a_freeze_beside_that_is_never_answered_fails_and_is_thawed(host: Host) -> None:
    host.ladder.systemd = host.freezer = HungFreezer("freeze")
    host.freezer.states[UNIT] = "running"
    host.ladder.freezer_timeout = 0.2
    run_within(host.ladder.freeze(UNIT))
    assert host.said() == [
        ("freeze_failed", UNIT, "FreezeUnit did not answer within 0.2 s: thawed again")
    ]
    assert host.freezer.calls == [f"state {UNIT}", f"freeze {UNIT}", f"thaw {UNIT}"]
    assert host.ladder.busy == {}


def test_a_thaw_that_is_never_answered_ends_resume_and_thaw(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    pid = host.job()
    run(host.ladder.suspend(UNIT))
    host.ladder.systemd = host.freezer = HungFreezer("thaw")
    host.ladder.freezer_timeout = 0.2
    run_within(host.ladder.resume(UNIT))  # the fake's processes were never frozen
    assert host.said()[-1][0] == "resumed"
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"
    assert f"resuming {UNIT}: ThawUnit did not answer within 0.2 s" in caplog.text
    run_within(host.ladder.thaw(UNIT))
    assert f"thawing {UNIT}: ThawUnit did not answer within 0.2 s" in caplog.text
    assert host.ladder.busy == {}


NO_REPLY = SystemdError(
    "org.freedesktop.DBus.Error.NoReply",
    "Message recipient disconnected from message bus without replying",
)


class BlinkingFreezer(Freezer):
    """systemd re-executing (`systemctl daemon-reexec`, as Debian's upgrade of it does): its
    next `blips` ThawUnit calls fail with `error` (NoReply, an error that passes), the unit
    left frozen; then they thaw it. FreezeUnit freezes it."""

    def __init__(self, blips: int, error: SystemdError = NO_REPLY) -> None:
        super().__init__()
        self.blips = blips
        self.error = error

    async def _do(self, what: str, name: str) -> None:
        await super()._do(what, name)
        if what == "thaw" and self.blips:
            self.blips -= 1
            raise self.error
        self.states[name] = "running" if what == "thaw" else "frozen"


def blinking(host: Host, blips: int, error: SystemdError = NO_REPLY) -> list[float]:
    """The host's freezer made a BlinkingFreezer; the list the ladder's waits go to (the
    Host's, given to the Ladder as it is made: recorded, not waited)."""
    host.ladder.systemd = host.freezer = BlinkingFreezer(blips, error)
    return host.waits


class FreezeThenBlink(Freezer):
    """systemd re-executing while it freezes the unit: FreezeUnit writes the cgroup's freeze
    (the unit is frozen), then its answer is lost (NoReply, an error that passes). `frozen`
    is a file the tool below reads: a restore in a frozen process never returns (the fake's
    processes are never frozen for real)."""

    def __init__(self, frozen: Path) -> None:
        super().__init__()
        self.frozen = frozen

    async def _do(self, what: str, name: str) -> None:
        await super()._do(what, name)
        if what == "thaw":
            self.frozen.unlink(missing_ok=True)
            self.states[name] = "running"
        if what == "freeze":
            self.frozen.touch()
            self.states[name] = "frozen"
            raise NO_REPLY


def test_a_freeze_whose_answer_is_lost_is_thawed_before_the_undo_restores(
    host: Host, tmp_path: Path
) -> None:
    """A FreezeUnit that fails for an error that passes may have frozen the unit (systemd
    re-executing after it froze the cgroup). Taken for a refusal, its suspend's undo restored
    the process frozen: the restore never returned, the process was lost and the unit
    stopped, its work gone for a blip of the bus. It is thawed first, as after a freeze that
    worked, and the job runs on."""
    pid = host.job()
    frozen = tmp_path / "frozen"
    real = host.settings.tool
    tool = tmp_path / "freezer-aware-tool"
    tool.write_text(
        f'#!/bin/sh\n[ "$2" = restore ] && [ -e {frozen} ] && '
        '{ echo "restore never returns in a frozen process" >&2; exit 1; }\n'
        f'exec {real} "$@"\n'
    )
    tool.chmod(0o755)
    host.settings = dataclasses.replace(host.settings, tool=str(tool))
    host.ladder.systemd = host.freezer = FreezeThenBlink(frozen)
    run_within(host.ladder.suspend(UNIT))
    [(event, _, words)] = host.said()
    assert event == "suspend_failed", words
    assert words == f"FreezeUnit failed: {NO_REPLY}"
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}", f"thaw {UNIT}"]
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"


def test_a_resume_sends_a_thaw_that_failed_for_a_moment_again(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """The ThawUnit before the restore fails as systemd re-executes. Taken for a refusal (as
    it was), the process stayed frozen, its restore failed and the job was stopped: its work
    lost for a blip of the bus. It is sent again after a wait, as the controller sends a job
    call again, and the restore finds the process running."""
    pid = host.job()
    waits = blinking(host, 2)
    run(host.ladder.suspend(UNIT))
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        run(host.ladder.resume(UNIT))
    assert host.said()[-1][0] == "resumed"
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}"] + [f"thaw {UNIT}"] * 3
    assert host.freezer.states[UNIT] == "running"  # thawed before the restore
    assert waits == [1.0, 2.0]
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert f"resuming {UNIT}: ThawUnit failed: {NO_REPLY}; sent again in 1 s" in caplog.messages
    assert host.ladder.busy == {}


def test_a_resume_sends_a_thaw_that_keeps_failing_for_a_moment_a_bounded_number_of_times(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """A bus that keeps failing does not hold the resume (and the unit's reserved GPUs)
    forever: after THAW_RETRY's waits the resume goes on, with a warning that says why its
    restore may fail."""
    host.job()
    waits = blinking(host, 1000)
    run(host.ladder.suspend(UNIT))
    run(host.ladder.resume(UNIT))
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}"] + [f"thaw {UNIT}"] * (len(THAW_RETRY) + 1)
    assert waits == list(THAW_RETRY) == [1.0, 2.0, 4.0, 8.0]
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [f"resuming {UNIT}: ThawUnit failed: {NO_REPLY} (sent 5 times)"]
    assert host.said()[-1][0] == "resumed"  # the fake's restore does not mind the freezer
    assert host.ladder.busy == {}


def test_a_frozen_unit_whose_thaw_fails_for_a_moment_is_still_suspended(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """A unit frozen beside another, then suspended for a waiter: its ThawUnit failing as
    systemd re-executes failed the suspend, and Preempt= fell to stop: its work lost. The
    debug line says what the thaw was sent again for."""
    pid = host.job()
    waits = blinking(host, 1)
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        run(host.ladder.suspend(UNIT, thaw_first=True))
    assert f"suspending {UNIT}: ThawUnit failed: {NO_REPLY}; sent again in 1 s" in caplog.messages
    assert host.said()[0][0] == "suspended"
    assert host.freezer.calls == [f"thaw {UNIT}", f"thaw {UNIT}", f"freeze {UNIT}"]
    assert waits == [1.0]
    assert not host.bed.holds(pid)
    blinking(host, 1000)
    host.ladder.suspensions.clear()
    run(host.ladder.suspend(UNIT, thaw_first=True))  # failing still: the next rung
    assert host.said()[-1] == (
        "suspend_failed",
        UNIT,
        f"ThawUnit failed: {NO_REPLY} (sent 5 times)",
    )


@pytest.mark.parametrize(
    "error",
    [
        SystemdError("org.freedesktop.systemd1.UnitInactive", "Unit is inactive."),
        SystemdError("org.freedesktop.DBus.Error.AccessDenied", "denied"),
    ],
)
def test_a_thaw_systemd_refused_is_not_sent_again(
    host: Host, caplog: pytest.LogCaptureFixture, error: SystemdError
) -> None:
    """systemd's own refusal (the unit stopped meanwhile) would only be repeated: the resume
    goes on at once, as before, with a debug line; a suspend fails at once."""
    host.job()
    run(host.ladder.suspend(UNIT))
    waits = blinking(host, 1000, error)
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        run(host.ladder.resume(UNIT))
    assert host.freezer.calls == [f"thaw {UNIT}"] and waits == []
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, f"resuming {UNIT}: ThawUnit failed: {error}")
    ]
    run(host.ladder.suspend(UNIT, thaw_first=True))
    assert host.said()[-1] == ("suspend_failed", UNIT, f"ThawUnit failed: {error}")
    assert waits == []


def test_a_thaw_after_a_freeze_that_fails_for_a_moment_is_left_to_the_next_sample(
    host: Host,
) -> None:
    """The plain thaw (the unit it gave way to left) holds nothing back: it is owed, and the
    next check of the thaws owed sends it again (at each sample): no waits of its own."""
    waits = blinking(host, 1)
    host.freezer.states[UNIT] = "frozen"
    run(host.ladder.thaw(UNIT))
    assert host.freezer.calls == [f"thaw {UNIT}"] and waits == []
    assert UNIT in host.ladder.thaw_failing and host.said() == []
    run(host.ladder.thaw_owed([UNIT]))
    assert host.freezer.calls == [f"thaw {UNIT}", f"state {UNIT}", f"thaw {UNIT}"]
    assert host.said() == [("thaw_done", UNIT, "")]


def test_a_thaw_before_a_restore_that_is_never_answered_is_not_sent_again(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """No answer: a process stuck in the kernel, which a second ThawUnit would not thaw
    either; the resume goes on after one FREEZER_TIMEOUT, as before."""
    host.job()
    run(host.ladder.suspend(UNIT))
    waits = blinking(host, 0)
    host.ladder.systemd = host.freezer = HungFreezer("thaw")
    host.ladder.freezer_timeout = 0.2
    run_within(host.ladder.resume(UNIT))
    assert host.freezer.calls == [f"thaw {UNIT}"] and waits == []
    assert f"resuming {UNIT}: ThawUnit did not answer within 0.2 s" in caplog.text


# -- a step of the ladder whose run ends (R3b) ---------------------------------------------------


def test_a_unit_restarted_during_the_thaw_before_its_suspend_is_not_suspended(host: Host) -> None:
    """Frozen beside another, then suspended: `systemctl restart` as its ThawUnit is under
    way (THAW_RETRY spreads it over 15 s). The step went on with the unit's name alone: it
    checkpointed and froze the new run (NVML shows its processes as the unit's), and its
    report, ignored by the core (no longer suspending), left that run frozen with nobody
    owing it a thaw, and a suspension status showed."""
    pid = host.job()
    thaw = host.freezer.thaw_unit

    async def restarted(name: str) -> None:
        await thaw(name)
        host.ladder.went_down(UNIT)  # the controller hears of the restart meanwhile

    host.freezer.thaw_unit = restarted  # type: ignore[method-assign]
    run(host.ladder.suspend(UNIT, thaw_first=True))
    assert host.freezer.calls == [f"thaw {UNIT}"]
    assert host.said() == []
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"
    assert UNIT not in host.ladder.suspensions
    assert host.ladder.busy == {} and host.ladder.runs == {}


def test_a_unit_that_went_down_during_the_checkpoint_is_not_frozen(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    host.job()
    real = checkpoint.suspend

    async def slow(
        tool: str, pids: list[int], s: checkpoint.CheckpointSettings, owned: object = None
    ) -> float:
        seconds = await real(tool, pids, s)
        host.ladder.went_down(UNIT)  # stopped (and maybe started again) meanwhile
        return seconds

    monkeypatch.setattr(checkpoint, "suspend", slow)
    run(host.ladder.suspend(UNIT))
    assert host.freezer.calls == [LOOK]  # no FreezeUnit for a run that is not the one asked
    assert host.said() == []
    assert UNIT not in host.ladder.suspensions


def test_a_freeze_answered_after_the_unit_went_down_owes_a_thaw(host: Host) -> None:
    """The FreezeUnit of a suspend (or of the freeze rung) is answered after the unit went
    down and came back: it may have frozen the new run. The core is told (a thaw owed, as
    after a freeze that failed half way); no suspend is reported, none is kept."""
    host.job()
    freeze = host.freezer.freeze_unit

    async def restarted(name: str) -> None:
        await freeze(name)
        host.ladder.went_down(UNIT)

    host.freezer.freeze_unit = restarted  # type: ignore[method-assign]
    run(host.ladder.suspend(UNIT))
    assert host.said() == [("froze_after_end", UNIT, "")]
    assert UNIT not in host.ladder.suspensions
    host.freezer.states[UNIT] = "running"
    run(host.ladder.freeze(UNIT))
    assert host.said()[1:] == [("froze_after_end", UNIT, "")]
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}", f"state {UNIT}", f"freeze {UNIT}"]


def test_a_resume_whose_unit_went_down_during_its_thaws_sends_and_reports_nothing_more(
    host: Host,
) -> None:
    """The ThawUnit before a restore failing as systemd re-executes, sent again over 15 s:
    the unit stopped and started again meanwhile. The old resume thawed the new run (one
    the core may hold frozen by then) and reported on it: a failed restore stops the unit."""
    host.job()
    waits = blinking(host, 1000)
    run(host.ladder.suspend(UNIT))
    wait = host.ladder.sleep

    async def restarted(seconds: float) -> None:
        await wait(seconds)
        host.ladder.went_down(UNIT)

    host.ladder.sleep = restarted
    run(host.ladder.resume(UNIT))
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}", f"thaw {UNIT}"]
    assert waits == [1.0]
    assert host.said() == [("suspended", UNIT, host.said()[0][2])]
    assert host.ladder.busy == {} and host.ladder.runs == {}


def test_a_step_started_after_the_unit_went_down_acts_for_the_new_run(host: Host) -> None:
    host.job()
    host.ladder.went_down(UNIT)  # the last run's end: none of its steps under way
    run(host.ladder.suspend(UNIT))
    assert host.said()[0][0] == "suspended"
    run(host.ladder.resume(UNIT))
    assert host.said()[-1][0] == "resumed"


# -- a unit someone else froze (R3b) -------------------------------------------------------------


@pytest.mark.parametrize("state", ["frozen", "freezing"])
def test_a_unit_someone_froze_is_not_frozen_again_nor_owed_a_thaw(host: Host, state: str) -> None:
    """An admin froze a Preempt=freeze unit (`systemctl freeze`). systemd takes a FreezeUnit
    of a frozen unit for done: gpuslice held it frozen as its own, and thawed it when the
    unit it gave way to left, undoing the admin's freeze. It is told to the core as a
    freeze that failed for that reason, not owed a thaw."""
    host.freezer.states[UNIT] = state
    run(host.ladder.freeze(UNIT))
    assert host.freezer.calls == [f"state {UNIT}"]
    assert host.said() == [
        (
            "freeze_failed_not_ours",
            UNIT,
            f"{state} already, by someone else (systemctl freeze): theirs to thaw",
        )
    ]


def test_a_unit_owed_a_thaw_of_ours_is_frozen_whatever_its_state(host: Host) -> None:
    """Thawed by gpuslice, frozen again before that thaw is seen done: frozen, it is ours
    still; so too when FreezerState cannot be read (taken for running)."""
    run(host.ladder.freeze(UNIT, thaw_owed=True))
    assert host.freezer.calls == [f"freeze {UNIT}"] and host.said() == []
    host.freezer.fail.add("state")
    run(host.ladder.freeze(UNIT))
    assert host.freezer.calls[1:] == [f"state {UNIT}", f"freeze {UNIT}"] and host.said() == []


def test_a_unit_that_went_down_as_its_freezer_state_was_read_is_told_nothing(host: Host) -> None:
    """The state read may be its next run's (frozen by someone since): the core, holding that
    run, is told nothing of it by the ended run's freeze."""
    host.freezer.states[UNIT] = "frozen"
    read = host.freezer.freezer_state

    async def restarted(name: str) -> str:
        state = await read(name)
        host.ladder.went_down(UNIT)
        return state

    host.freezer.freezer_state = restarted  # type: ignore[method-assign]
    run(host.ladder.freeze(UNIT))
    assert host.said() == [] and host.freezer.calls == [f"state {UNIT}"]


@pytest.mark.parametrize("state", ["frozen", "freezing"])
def test_a_unit_someone_froze_is_not_suspended_nor_thawed(
    host: Host, monkeypatch: pytest.MonkeyPatch, state: str
) -> None:
    """The suspend rung: an admin froze the unit (`systemctl freeze`) whose memory a more
    urgent unit needs. Its lock timed out in the frozen processes, and the undo thawed it,
    undoing their freeze. Found frozen by someone, nothing is run or sent (no lock, no
    FreezeUnit or ThawUnit): the core hears a suspend that failed, not ours, and falls to
    the next rung of Preempt=."""
    pid = host.job()
    host.freezer.states[UNIT] = state
    locked: list[list[int]] = []
    real = checkpoint.suspend

    async def suspend(
        tool: str, pids: list[int], s: checkpoint.CheckpointSettings, owned: object = None
    ) -> float:
        locked.append(list(pids))
        return await real(tool, pids, s)

    monkeypatch.setattr(checkpoint, "suspend", suspend)
    run(host.ladder.suspend(UNIT))
    assert host.said() == [
        (
            "suspend_failed_not_ours",
            UNIT,
            f"{state} already, by someone else (systemctl freeze): theirs to thaw",
        )
    ]
    assert host.freezer.calls == [LOOK] and locked == []
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"
    assert UNIT not in host.ladder.suspensions and host.ladder.moving == 0
    assert host.ladder.busy == {}


@pytest.mark.parametrize("lost", [False, True])
def test_a_unit_someone_froze_after_the_look_is_owed_no_thaw(
    host: Host, monkeypatch: pytest.MonkeyPatch, lost: bool
) -> None:
    """An admin froze the unit (`systemctl freeze`) after the suspend's look, before its
    lock: the lock timed out in the frozen processes, and the suspend failed before any
    FreezeUnit. Told to the core as a plain failure, it was owed a thaw, and the sample's
    thaws-owed check thawed their freeze. Found frozen once the lock failed, it is theirs
    (nothing of gpuslice's froze it), still lost when the undo lost a process."""
    pid = host.job()
    why = f"lock of PID {pid} timed out after 1 s"

    async def suspend(tool: str, pids: list[int], s: object, owned: object = None) -> float:
        host.freezer.states[UNIT] = "frozen"
        raise checkpoint.CheckpointError(why, lost=(pid,) if lost else ())

    monkeypatch.setattr(checkpoint, "suspend", suspend)
    run(host.ladder.suspend(UNIT))
    event = "suspend_failed_lost_not_ours" if lost else "suspend_failed_not_ours"
    theirs = "frozen since, by someone else (systemctl freeze): theirs to thaw"
    assert host.said() == [(event, UNIT, f"{why}; {theirs}")]
    assert host.freezer.calls == [LOOK, LOOK] and host.ladder.moving == 0


def test_a_lock_that_failed_in_a_running_unit_or_one_owed_a_thaw_is_a_plain_failure(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Still running once its lock failed: a plain failed suspend. Owed a thaw of ours
    (`thaw_owed`, no look): frozen, it may be frozen by gpuslice still, not read again."""
    host.job()

    async def suspend(tool: str, pids: list[int], s: object, owned: object = None) -> float:
        raise checkpoint.CheckpointError("lock refused")

    monkeypatch.setattr(checkpoint, "suspend", suspend)
    run(host.ladder.suspend(UNIT))
    assert host.said() == [("suspend_failed", UNIT, "lock refused")]
    assert host.freezer.calls == [LOOK, LOOK]
    host.freezer.states[UNIT] = "frozen"
    run(host.ladder.suspend(UNIT, thaw_owed=True))
    assert host.said()[1:] == [("suspend_failed", UNIT, "lock refused")]
    assert host.freezer.calls == [LOOK, LOOK]


def test_a_unit_frozen_beside_a_more_urgent_one_is_thawed_by_its_suspend(host: Host) -> None:
    """Frozen by gpuslice beside a more urgent unit (`thaw_first`): that freeze is ours to
    undo before the lock, and its FreezerState (frozen) is not read as someone else's."""
    host.job()
    host.freezer.states[UNIT] = "frozen"
    run(host.ladder.suspend(UNIT, thaw_first=True))
    assert host.said()[0][0] == "suspended"
    assert host.freezer.calls == [f"thaw {UNIT}", f"freeze {UNIT}"]


def test_a_unit_owed_a_thaw_of_ours_is_suspended_whatever_its_state(host: Host) -> None:
    """Thawed by gpuslice, chosen for a suspend before that thaw is seen done (the ThawUnit
    still under way): frozen, it is ours still, not someone else's (as for a freeze)."""
    host.job()
    host.freezer.states[UNIT] = "frozen"
    run(host.ladder.suspend(UNIT, thaw_owed=True))
    assert host.said()[0][0] == "suspended"
    assert host.freezer.calls == [f"freeze {UNIT}"]
