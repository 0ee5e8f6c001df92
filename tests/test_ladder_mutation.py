"""Edge tests for the Preempt= ladder (gpuslice/checkpoint.py and gpuslice/ladder.py) that
mutation testing asked for.

The exact words each failure puts in a reason or the journal (an admin reads them to know
what to do), the exact command line and pipes of every run of cuda-checkpoint and systemctl,
each deadline applied and each killed run reaped (or given up on in time), what a resume
after a controller restart acts on, and the ladder's count of the operations under way. Each
test pins a rule that tests/test_checkpoint.py and tests/test_ladder_adapter.py left open.
Stub scripts, the fake cuda-checkpoint of tests/fakenvml, a fake systemd-run and systemctl:
no GPU, no container.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpuslice import checkpoint
from gpuslice import clock as clock_module
from gpuslice.checkpoint import (
    CheckpointError,
    CheckpointSettings,
    get_state,
    host_memory_available,
    require_tool,
    resume,
    suspend,
)
from gpuslice.inventory import GpuUse
from gpuslice.ladder import THAW_RETRY, Ladder
from tests.test_checkpoint import (
    FAST,
    TIMEOUT,
    calls,
    failure,
    fake_systemd,
    run,
    stub,
)
from tests.test_ladder_adapter import (
    LOOK,
    UNIT,
    BlinkingFreezer,
    Freezer,
    Host,
    HungFreezer,
    hosted,
)

Runs = list[tuple[tuple[Any, ...], dict[str, Any], asyncio.subprocess.Process]]


def record_runs(monkeypatch: pytest.MonkeyPatch) -> Runs:
    """asyncio.create_subprocess_exec, recorded: each run's argv, keywords and process."""
    runs: Runs = []
    create = asyncio.create_subprocess_exec

    async def recorded(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        proc = await create(*args, **kwargs)
        runs.append((args, kwargs, proc))
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recorded)
    return runs


def bounded(coro: Any, seconds: float = 10.0) -> Any:
    """`run`, failing (not hanging) when it takes longer than `seconds`: a deadline a mutant
    drops would otherwise hang the test."""
    return run(asyncio.wait_for(coro, seconds))


def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")


# ---------------------------------------------------------------------------------------------
# gpuslice/checkpoint.py: running the tool


def test_each_run_has_no_stdin_a_session_of_its_own_and_pipes_only_for_what_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services: None
) -> None:
    """A run never reads the controller's stdin (a terminal when it runs by hand: the tool
    would wait on it); it leads a process group of its own, killed whole at its deadline
    (whatever it started goes too); it has a pipe only for what is read: cuda-checkpoint's
    stdout is its state, systemctl's stdout goes to /dev/null (nobody reads it, and a full
    pipe would block it) and its stderr is the reason's words; `systemctl stop --quiet`."""
    fake_systemd(tmp_path)
    on_path(tmp_path, monkeypatch)
    tool = stub(tmp_path, "echo running")
    runs = record_runs(monkeypatch)
    assert run(get_state(tool, 11)) == "running"
    assert run(checkpoint.stop_earlier_runs([11])) == ""
    pipe, null = asyncio.subprocess.PIPE, asyncio.subprocess.DEVNULL
    names = [f"gpuslice-checkpoint-{a}-11-*.service" for a in checkpoint._CHANGING]
    assert [(args, kwargs) for args, kwargs, _ in runs] == [
        (
            (tool, "--get-state", "--pid", "11"),
            {"stdin": null, "stdout": pipe, "stderr": pipe, "start_new_session": True},
        ),
        (
            ("systemctl", "stop", "--quiet", "--", *names),
            {"stdin": null, "stdout": null, "stderr": pipe, "start_new_session": True},
        ),
    ]


def test_a_tool_path_exec_refuses_is_named_with_why() -> None:
    """exec refuses a path with a NUL with a ValueError, which has no strerror: the reason
    gives its text, escaped, and the error says its detail wherever it is shown."""
    with pytest.raises(checkpoint._ToolFailed) as caught:
        run(checkpoint._call("/opt/cuda\0checkpoint", ("--get-state", "--pid", "11"), 1.0, False))
    assert caught.value.detail == (
        "cuda-checkpoint /opt/cuda\\x00checkpoint could not be run: embedded null byte"
    )
    assert caught.value.not_run and str(caught.value) == caught.value.detail
    assert str(CheckpointError("why", [3])) == "why"  # a traceback shows the reason


def test_a_killed_run_that_does_not_exit_is_given_up_in_time_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tool stuck in the driver (uninterruptible) outlives SIGKILL: it is waited for
    REAP_TIMEOUT and no longer (every job waits while the ladder does), and the reason says
    it had not exited. Here the kill and the close of our pipes do nothing, as for such a
    process; they run for real afterwards."""
    kill, close = checkpoint._kill_group, checkpoint._close_pipes
    monkeypatch.setattr(checkpoint, "_kill_group", lambda proc: None)
    monkeypatch.setattr(checkpoint, "_close_pipes", lambda proc: None)
    monkeypatch.setattr(checkpoint, "REAP_TIMEOUT", 0.1)
    runs = record_runs(monkeypatch)
    tool = stub(tmp_path, "exec sleep 60")

    async def scenario() -> checkpoint._ToolFailed:
        try:
            await asyncio.wait_for(
                checkpoint._call(tool, ("--action", "checkpoint", "--pid", "11"), 0.2, False), 10
            )
        except checkpoint._ToolFailed as e:
            return e
        finally:
            # given up on, its transport is closed all the same (else a ResourceWarning)
            closed.extend(proc._transport.is_closing() for _, _, proc in runs)  # type: ignore[attr-defined]
            for _, _, proc in runs:
                kill(proc)
                close(proc)
                await proc.wait()
        raise AssertionError("the hung run returned")

    closed: list[bool] = []
    error = run(scenario())
    assert error.detail == (
        "cuda-checkpoint did not return within 0.2 s and was killed, and it had not exited "
        "0.1 s after SIGKILL"
    )
    assert error.timed_out
    assert closed == [True]


def test_a_tool_killed_by_a_signal_says_which_and_what_it_wrote(tmp_path: Path) -> None:
    """A signal without a name (a real-time one) is given by its number; what the tool wrote
    before it died is kept beside how it ended."""
    assert failure(get_state(stub(tmp_path, "kill -36 $$"), 11)).reason == (
        "the state of PID 11 could not be read: killed by 36"
    )
    assert failure(get_state(stub(tmp_path, "echo stuck >&2; kill -SEGV $$"), 11)).reason == (
        "the state of PID 11 could not be read: stuck (killed by SIGSEGV)"
    )


def test_the_tool_s_own_lock_timeout_in_either_words(tmp_path: Path) -> None:
    """The tool's own --timeout left the process running (no undo needed): it says so as
    "timed out" or as "timeout", in any case."""
    tool = stub(
        tmp_path, "echo 'Error locking CUDA in process ID 11: \"Lock Timeout\"' >&2; exit 1"
    )
    assert failure(suspend(tool, [11], FAST)).reason == "lock of PID 11 timed out after 0.3 s"
    assert calls(tmp_path) == ["--action lock --pid 11 --timeout 300"]  # nothing to undo


def test_a_restore_that_fails_says_why_and_that_the_process_is_lost(tmp_path: Path) -> None:
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--get-state --pid 11") echo checkpointed ;;\n'
        '  "--action restore --pid 11") echo "device busy" >&2; exit 1 ;;\n'
        "esac",
    )
    error = failure(resume(tool, [11], FAST))
    assert error.reason == (
        "restore of PID 11 failed: device busy; the process cannot be resumed and must be stopped"
    )
    assert error.lost == (11,)


def test_a_resume_goes_on_past_a_process_that_has_exited(tmp_path: Path) -> None:
    """An exited process needs nothing, and the others of the unit still do."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        f'  "--get-state --pid {gone.pid}") echo "no such process" >&2; exit 1 ;;\n'
        '  "--get-state --pid 11") echo locked ;;\n'
        "esac",
    )
    assert 0 <= run(resume(tool, [gone.pid, 11], FAST)).seconds < TIMEOUT  # seconds taken
    assert calls(tmp_path)[1:] == ["--get-state --pid 11", "--action unlock --pid 11"]


def test_an_undo_whose_restore_fails_names_the_lost_process(tmp_path: Path) -> None:
    """A suspend whose undo lost a process (its restore failed) says which: the controller
    must stop it, it can never run again."""
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--action checkpoint --pid 12") echo busy >&2; exit 1 ;;\n'
        '  "--get-state --pid 11") echo checkpointed ;;\n'
        '  "--get-state --pid 12") echo locked ;;\n'
        "  \"--action restore --pid 11\") echo 'out of memory' >&2; exit 2 ;;\n"
        "esac",
    )
    error = failure(suspend(tool, [11, 12], FAST))
    assert error.reason == (
        "cuda-checkpoint refused to checkpoint PID 12: busy; and restore of PID 11 ran out of "
        "GPU memory; the process cannot be resumed and must be stopped"
    )
    assert error.lost == (11,)


def test_via_systemd_every_step_and_every_undo_runs_as_a_transient_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services: None
) -> None:
    """Under via_systemd the controller's sandbox denies what the tool needs: a checkpoint,
    restore or unlock run directly would fail (and only the lock was ever seen to go
    through systemd-run)."""
    fake_systemd(tmp_path)
    on_path(tmp_path, monkeypatch)
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--action checkpoint --pid 12") echo busy >&2; exit 1 ;;\n'
        '  "--get-state --pid 11") echo checkpointed ;;\n'
        '  "--get-state --pid 12") echo locked ;;\n'
        "esac",
    )
    s = dataclasses.replace(FAST, via_systemd=True)
    assert failure(suspend(tool, [11, 12], s)).reason == (
        "cuda-checkpoint refused to checkpoint PID 12: busy"
    )
    log = calls(tmp_path)
    units = [line.split()[1].rsplit("-", 2)[0] for line in log if line.startswith("run ")]
    steps = [line for line in log if not line.startswith("run ")]
    assert units == [
        f"gpuslice-checkpoint-{step}"
        for step in (
            "lock-11",
            "lock-12",
            "checkpoint-11",
            "checkpoint-12",
            "get-state-11",
            "restore-11",
            "get-state-12",
            "unlock-11",
            "unlock-12",
        )
    ]
    assert len(steps) == len(units)  # each run of the tool was its service's


def test_drain_keeps_the_first_bytes_over_several_reads() -> None:
    """Output that arrives in pieces is kept up to MAX_OUTPUT bytes in all, not per piece."""

    class Pieces:
        def __init__(self, *pieces: bytes) -> None:
            self.pieces = list(pieces)

        async def read(self, n: int) -> bytes:
            return self.pieces.pop(0) if self.pieces else b""

    kept = run(checkpoint._drain(Pieces(b"a" * 10, b"b" * 600, b"c" * 10)))  # type: ignore[arg-type]
    assert kept == b"a" * 10 + b"b" * (checkpoint.MAX_OUTPUT - 10)


def test_kill_group_of_a_run_already_reaped_does_nothing() -> None:
    """The run may end and be reaped between its deadline and the kill: no error then."""

    async def scenario() -> None:
        proc = await asyncio.create_subprocess_exec("true", start_new_session=True)
        await proc.wait()
        checkpoint._kill_group(proc)

    run(scenario())


def test_a_killed_runs_pipes_close_without_reaping_it_behind_asyncio() -> None:
    """The transport's close() polls the process: one already dead was reaped there, behind
    asyncio's child watcher, which logged "Unknown child process pid N" into the journal and
    took 255 for its exit status (a loaded machine let the poll come first). Only the pipes
    close before the reap; the transport after it."""

    async def scenario() -> None:
        proc = await asyncio.create_subprocess_exec(
            "sleep", "60", stdout=asyncio.subprocess.PIPE, start_new_session=True
        )
        popen = proc._transport._proc  # type: ignore[attr-defined]
        poll = popen.poll
        polled: list[int | None] = []

        def recorded() -> int | None:
            polled.append(poll())
            return polled[-1]

        popen.poll = recorded
        checkpoint._kill_group(proc)
        checkpoint._close_pipes(proc)
        assert polled == []
        assert proc._transport.get_pipe_transport(1).is_closing()  # type: ignore[attr-defined]
        assert await asyncio.wait_for(proc.wait(), TIMEOUT) == -signal.SIGKILL
        checkpoint._close_transport(proc)
        assert proc._transport.is_closing()  # type: ignore[attr-defined]

    run(scenario())


def test_pid_exists_sends_no_signal() -> None:
    """Signal 0 only asks: whatever else it sent would reach the job's process."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert checkpoint._pid_exists(proc.pid)
    finally:
        proc.terminate()
    assert proc.wait(TIMEOUT) == -signal.SIGTERM  # not ended by an earlier signal
    assert not checkpoint._pid_exists(proc.pid)


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        ("printf 'st\\377te\\n'", "st\\ufffdte"),  # not UTF-8: replaced, then escaped
        ("echo " + "word " * 20, ("word " * 12)[:60] + "..."),  # cut at 60 characters
    ],
)
def test_an_unknown_state_is_shown_decoded_leniently_and_cut(
    tmp_path: Path, body: str, shown: str
) -> None:
    error = failure(get_state(stub(tmp_path, body), 11))
    assert error.reason == f'cuda-checkpoint gave an unknown state for PID 11: "{shown}"'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("MemAvailable: " + "1" * 20 + "\n", int("1" * 20)),  # 20 digits: read
        ("MemAvailable: " + "1" * 21 + "\n", None),  # 21: refused
        ("x" * 70000 + "\nMemAvailable: 4096\n", None),  # past the first 64 KiB: not read
    ],
)
def test_host_memory_available_bounds(tmp_path: Path, text: str, expected: int | None) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(text)
    assert host_memory_available(meminfo) == expected


def test_require_tool_searches_the_locations_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    tool = stub(tmp_path, "exit 0")
    assert require_tool("", locations=[str(tmp_path)]) == tool


# ---------------------------------------------------------------------------------------------
# gpuslice/checkpoint.py: systemctl stop


def test_a_systemctl_stop_that_hangs_is_killed_reaped_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services: None
) -> None:
    """`systemctl stop` waits for the unit to go down; one that never returns (systemd busy,
    a unit that does not die) is waited for SERVICE_STOP_WAIT, then killed with its group
    and reaped, and our ends of its pipes closed although a process outside its group holds
    the others."""
    monkeypatch.setattr(checkpoint, "SERVICE_STOP_WAIT", 0.2)
    # far over bounded()'s 10 s: a reap that waited for the pipes the setsid child holds
    # (ours not closed first) fails the test instead of passing slowly
    monkeypatch.setattr(checkpoint, "REAP_TIMEOUT", 60.0)
    fake_systemd(tmp_path)
    (tmp_path / "bin" / "systemctl").write_text(
        f"#!/bin/sh\nsetsid sleep 60 & echo $! > {tmp_path}/child\nexec sleep 60\n"
    )
    on_path(tmp_path, monkeypatch)
    runs = record_runs(monkeypatch)
    try:
        assert bounded(checkpoint.stop_earlier_runs([11])) == "was not down 0.2 s after a stop"
        [(_, _, proc)] = runs
        assert proc.returncode == -signal.SIGKILL  # reaped
        assert proc._transport.is_closing()  # type: ignore[attr-defined]
    finally:
        child = tmp_path / "child"
        if child.exists():
            os.kill(int(child.read_text()), signal.SIGKILL)


def test_a_systemctl_stop_that_outlives_its_kill_is_given_up_in_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services: None
) -> None:
    """As for the tool: a systemctl that SIGKILL does not end is waited for REAP_TIMEOUT,
    then left, and the stop still said not done."""
    kill, close = checkpoint._kill_group, checkpoint._close_pipes
    monkeypatch.setattr(checkpoint, "_kill_group", lambda proc: None)
    monkeypatch.setattr(checkpoint, "_close_pipes", lambda proc: None)
    monkeypatch.setattr(checkpoint, "SERVICE_STOP_WAIT", 0.2)
    monkeypatch.setattr(checkpoint, "REAP_TIMEOUT", 0.1)
    fake_systemd(tmp_path)
    (tmp_path / "bin" / "systemctl").write_text("#!/bin/sh\nexec sleep 60\n")
    on_path(tmp_path, monkeypatch)
    runs = record_runs(monkeypatch)

    closed: list[bool] = []

    async def scenario() -> str:
        try:
            return await asyncio.wait_for(checkpoint.stop_earlier_runs([11]), 10)
        finally:
            closed.extend(proc._transport.is_closing() for _, _, proc in runs)  # type: ignore[attr-defined]
            for _, _, proc in runs:
                kill(proc)
                close(proc)
                await proc.wait()

    assert run(scenario()) == "was not down 0.2 s after a stop"
    assert closed == [True]


def test_a_systemctl_that_cannot_be_run_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert run(checkpoint.stop_earlier_runs([11])) == (
        "could not be stopped: [Errno 2] No such file or directory: 'systemctl'"
    )


# ---------------------------------------------------------------------------------------------
# gpuslice/ladder.py


@pytest.fixture
def host(fake_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    yield from hosted(fake_build, tmp_path, monkeypatch)


class Recorded(Freezer):
    """The recording freezer, which also records whose processes are listed and what the
    ladder counts as busy at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.ladder: Ladder | None = None
        self.busy: list[dict[str, int]] = []
        self.unreadable: set[str] = set()  # units whose FreezerState read fails

    async def _do(self, what: str, name: str) -> None:
        assert self.ladder is not None
        self.busy.append(dict(self.ladder.busy))
        await super()._do(what, name)

    async def unit_pids(self, name: str) -> list[int]:
        self.calls.append(f"pids {name}")
        return await super().unit_pids(name)

    async def freezer_state(self, name: str) -> str:
        if name in self.unreadable:
            raise RuntimeError(f"unit {name} not loaded")
        return await super().freezer_state(name)


def recorded(host: Host, ladder: Ladder | None = None) -> Recorded:
    freezer = Recorded()
    freezer.ladder = ladder or host.ladder
    host.freezer = freezer
    freezer.ladder.systemd = freezer
    return freezer


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_each_operation_counts_its_unit_busy_from_its_start(host: Host) -> None:
    """From the moment an operation is asked for (before its task first runs), a check of
    thaws by hand must not read the unit, and until it is done."""
    freezer = recorded(host)
    host.job()
    starts: list[Callable[[str], Coroutine[Any, Any, None]]] = [
        host.ladder.suspend,
        host.ladder.resume,
        host.ladder.freeze,
        host.ladder.thaw,
    ]
    for start in starts:
        work = start(UNIT)
        assert host.ladder.busy == {UNIT: 1}
        run(work)
        assert host.ladder.busy == {}
    assert [c.split()[0] for c in freezer.calls] == [
        *("state", "freeze", "thaw"),  # the suspend reads it first too
        *("state", "freeze", "thaw"),
    ]
    assert freezer.busy == [{UNIT: 1}] * 4
    assert [e for e, _, _ in host.said()] == ["suspended", "resumed", "thaw_done"]


def test_two_operations_on_one_unit_keep_it_busy_until_both_are_done(host: Host) -> None:
    gates = [asyncio.Event(), asyncio.Event()]

    class Gated(Freezer):
        async def freeze_unit(self, name: str) -> None:
            await super().freeze_unit(name)
            await gates[len(self.calls) - 1].wait()

    host.ladder.systemd = host.freezer = Gated()

    async def scenario() -> None:
        # (owed a thaw: sent without a look at FreezerState first)
        first = asyncio.create_task(host.ladder.freeze(UNIT, thaw_owed=True))
        second = asyncio.create_task(host.ladder.freeze(UNIT, thaw_owed=True))
        assert host.ladder.busy == {UNIT: 2}
        while len(host.freezer.calls) < 2:
            await asyncio.sleep(0)
        gates[0].set()
        await first
        assert host.ladder.busy == {UNIT: 1}
        await host.ladder.check_thawed([UNIT])  # still ours: not read
        assert host.freezer.calls == [f"freeze {UNIT}"] * 2
        gates[1].set()
        await second
        assert host.ladder.busy == {}

    bounded(scenario())


def test_a_check_of_thaws_reads_every_unit_not_busy(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """A busy unit, or one whose FreezerState cannot be read (gone meanwhile), is skipped,
    not the end of the check; the failed read is said at debug level."""
    freezer = recorded(host)
    freezer.unreadable.add("gone.service")
    freezer.states = {"a.service": "running", "b.service": "running"}
    busy = host.ladder.freeze("busy.service")
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        run(host.ladder.check_thawed(["busy.service", "gone.service", "a.service", "b.service"]))
    assert host.said() == [("thawed_outside", "a.service", ""), ("thawed_outside", "b.service", "")]
    assert messages(caplog, logging.DEBUG) == [
        "FreezerState of gone.service: unit gone.service not loaded"
    ]
    run(busy)


def test_a_unit_left_frozen_is_thawed_with_one_warning_per_spell_of_failures(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """Each check of the thaws owed tries again: the first failure of a spell is a warning
    that says how to thaw it by hand, the next ones are debug lines (not one warning per
    sample), and once the unit is thawed, or seen running, a new failure warns again. The
    state systemd gave is shown cut."""
    freezer = recorded(host)
    odd = "frozen-by-parent-and-more"  # a state longer than 20 characters
    freezer.states[UNIT] = odd
    freezer.fail.add("thaw")
    failed = (
        f"thawing {UNIT}, {odd[:20]}... though gpuslice no longer holds it frozen: ThawUnit "
        f"failed: thaw refused (tried again at each sample; systemctl thaw {UNIT} thaws it)"
    )
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        run(host.ladder.thaw_owed([UNIT]))
        run(host.ladder.thaw_owed([UNIT]))
        assert messages(caplog, logging.WARNING) == [failed]
        assert messages(caplog, logging.DEBUG) == [failed]
        assert freezer.busy == [{UNIT: 1}] * 2  # its thaw counts it busy
        freezer.states[UNIT] = "running"  # thawed by hand: owed nothing more
        run(host.ladder.thaw_owed([UNIT]))
        freezer.states[UNIT] = odd  # frozen again, and its thaw fails again: a new spell
        run(host.ladder.thaw_owed([UNIT]))
        assert messages(caplog, logging.WARNING) == [failed] * 2
        freezer.fail.clear()
        run(host.ladder.thaw_owed([UNIT]))
        assert messages(caplog, logging.INFO) == [
            f"thawed {UNIT}: systemd showed it {odd[:20]}..., and gpuslice, which froze it, no "
            "longer holds it frozen"
        ]
        freezer.fail.add("thaw")  # thawed, then failing again: a new spell
        run(host.ladder.thaw_owed([UNIT]))
        assert messages(caplog, logging.WARNING) == [failed] * 3
    assert host.said() == [("thaw_done", UNIT, "")] * 2


def test_a_thaw_that_fails_says_how_to_thaw_by_hand(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    host.freezer.fail.add("thaw")
    run(host.ladder.thaw(UNIT))
    assert messages(caplog, logging.WARNING) == [
        f"thawing {UNIT}: ThawUnit failed: thaw refused (tried again at each sample; "
        f"systemctl thaw {UNIT} thaws it)"
    ]


def test_a_hung_freeze_whose_thaw_fails_says_how_to_thaw_by_hand(host: Host) -> None:
    """The freezer's deadline is the one the ladder was made with."""
    freezer = HungFreezer("freeze")
    freezer.fail.add("thaw")
    freezer.states[UNIT] = "running"
    ladder = Ladder(
        freezer,
        host.events,
        host.processes,
        lambda: host.settings,
        host.report,
        unified_marker=host.marker,
        freezer_timeout=0.2,
    )
    bounded(ladder.freeze(UNIT))
    assert host.said() == [
        (
            "freeze_failed",
            UNIT,
            f"FreezeUnit did not answer within 0.2 s; and ThawUnit failed: thaw refused (thaw it "
            f"with systemctl thaw {UNIT})",
        )
    ]


def test_a_bug_is_a_reason_and_an_error_with_its_traceback(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """What no rule foresaw (a bug, an OSError of the cgroup marker) fails the operation
    with words that say what was being done, and the journal gets the traceback."""

    class Unreadable:
        def exists(self) -> bool:
            raise PermissionError("denied")

    host.ladder.unified_marker = Unreadable()  # type: ignore[assignment]
    run(host.ladder.freeze(UNIT))
    assert host.said() == [
        ("freeze_failed", UNIT, "gpuslice failed while freezing (PermissionError: denied)")
    ]
    [record] = caplog.records
    assert (record.levelno, record.getMessage()) == (logging.ERROR, "freezing failed unexpectedly")
    assert record.exc_info is not None and isinstance(record.exc_info[1], PermissionError)

    def broken() -> CheckpointSettings:
        raise KeyError("bug")

    host.ladder.settings = broken
    run(host.ladder.resume(UNIT))
    assert host.said()[-1] == (
        "resume_failed",
        UNIT,
        "gpuslice failed while resuming (KeyError: 'bug')",
    )


def test_a_bug_after_the_checkpoint_is_a_failed_suspend_and_undone(host: Host) -> None:
    pid = host.job()
    real = host.processes
    samples: list[int] = []

    def sample() -> list[GpuUse] | None:
        samples.append(1)
        if len(samples) == 2:  # the confirmation after the checkpoint
            raise KeyError("bug")
        return real()

    host.ladder.processes = sample
    run(host.ladder.suspend(UNIT))
    assert host.said() == [
        ("suspend_failed", UNIT, "gpuslice failed while suspending (KeyError: 'bug')")
    ]
    assert host.bed.holds(pid) and host.bed.state_of(pid) == "running"


def test_a_failed_freeze_whose_undo_fails_says_both(host: Host) -> None:
    pid = host.job()
    host.freezer.fail.add("freeze")
    host.bed.inject("restore-oom")
    run(host.ladder.suspend(UNIT))
    assert host.said() == [
        (  # lost: the core stops the unit, whatever its ladder
            "suspend_failed_lost",
            UNIT,
            f"FreezeUnit failed: freeze refused; and undoing the checkpoint failed: restore of "
            f"PID {pid} ran out of GPU memory; the process cannot be resumed and must be stopped",
        )
    ]


@pytest.mark.parametrize(
    ("arrange", "why"),
    [
        (
            lambda h: setattr(h, "nvml", False),
            "NVML is not available: the memory could not be confirmed",
        ),
        (lambda h: h.mine.clear(), "NVML shows no process of it on a GPU: nothing to suspend"),
        (
            lambda h: setattr(h, "unknown_memory", True),
            "NVML does not report the memory of PID {pid}: the memory could not be confirmed",
        ),
    ],
)
def test_what_nvml_must_show_before_a_suspend_in_exact_words(
    host: Host, arrange: Callable[[Host], None], why: str
) -> None:
    pid = host.job()
    arrange(host)
    run(host.ladder.suspend(UNIT))
    assert host.said() == [("suspend_failed", UNIT, why.format(pid=pid))]


def test_a_suspension_records_what_moved_and_when(host: Host) -> None:
    """NVML's 0 bytes are 0 bytes moved (status shows it); the wall-clock time is status's
    "since"; the time away is measured from the suspend."""
    pid = host.job()
    real = host.processes
    samples = iter([[GpuUse(pid, 0, 0, UNIT, "gpu-alloc")]])
    host.ladder.processes = lambda: next(samples, None) or real()
    before = time.time()
    run(host.ladder.suspend(UNIT))
    assert host.said() == [("suspended", UNIT, host.said()[0][2])]
    assert host.said()[0][2].startswith("0 B to host memory in ")
    suspension = host.ladder.suspensions[UNIT]
    assert suspension.vram == 0
    assert before <= suspension.wall <= time.time()
    run(host.ladder.resume(UNIT))
    event, _, detail = host.said()[-1]
    match = re.fullmatch(r"([0-9]+) s: restored in [0-9]+\.[0-9] s", detail)
    assert event == "resumed" and match is not None, detail
    assert int(match.group(1)) < TIMEOUT


def test_the_time_away_a_resume_says_counts_a_host_sleep(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured on CLOCK_BOOTTIME (gpuslice/clock.py): on CLOCK_MONOTONIC, which stops while
    the host sleeps, a unit suspended before a night's suspend-to-RAM was said resumed after
    the seconds it was away awake, not the hours."""
    host.job()
    run(host.ladder.suspend(UNIT))
    assert host.said()[-1][0] == "suspended"
    slept = 8 * 3600
    awake = time.clock_gettime(time.CLOCK_BOOTTIME) + slept
    monkeypatch.setattr(
        clock_module,
        "time",
        SimpleNamespace(
            CLOCK_BOOTTIME=time.CLOCK_BOOTTIME,
            clock_gettime=lambda _: awake,
            time=lambda: time.time() + slept,
        ),
    )
    run(host.ladder.resume(UNIT))
    event, _, detail = host.said()[-1]
    match = re.fullmatch(r"([0-9]+) s: restored in [0-9]+\.[0-9] s", detail)
    assert event == "resumed" and match is not None, detail
    assert slept <= int(match.group(1)) < slept + TIMEOUT


def test_a_resume_whose_thaw_fails_goes_on_with_a_debug_line(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """A ThawUnit that fails (unlike one not answered) is no warning: the unit was stopped
    meanwhile, or was not frozen; the resume goes on."""
    host.job()
    run(host.ladder.suspend(UNIT))
    host.freezer.fail.add("thaw")
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        run(host.ladder.resume(UNIT))
    assert host.said()[-1][0] == "resumed"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, f"resuming {UNIT}: ThawUnit failed: thaw refused")
    ]


def test_a_resume_without_the_tool_says_what_it_means(host: Host) -> None:
    """Without the tool nothing can be restored: the resume fails (the core stops the unit),
    after a controller restart too. Taken there for "nothing to restore", the unit whose
    processes the last controller checkpointed was said resumed and held its GPUs as
    running, its processes blocked in their next CUDA call for good."""
    pid = host.job()
    run(host.ladder.suspend(UNIT))
    host.settings = dataclasses.replace(host.settings, tool="/nonexistent")
    run(host.restarted_ladder().resume(UNIT))
    assert host.said()[-1] == (
        "resume_failed",
        UNIT,
        "cuda-checkpoint is not installed any more: cannot restore",
    )
    assert host.bed.state_of(pid) == "checkpointed"
    run(host.ladder.resume(UNIT))
    assert host.said()[-1] == (
        "resume_failed",
        UNIT,
        "cuda-checkpoint is not installed any more: cannot restore",
    )


def test_a_resume_runs_no_tool_that_someone_other_than_root_can_change(host: Host) -> None:
    """Checked at each run, not only at the suspend: the tool may have changed hands since."""
    pid = host.job()
    run(host.ladder.suspend(UNIT))
    host.settings = dataclasses.replace(host.settings, root_only=True)
    run(host.ladder.resume(UNIT))
    event, unit, why = host.said()[-1]
    assert (event, unit) == ("resume_failed", UNIT)
    assert why.startswith(f"{host.bed.tool} is not run: gpuslice runs it as root"), why
    assert host.bed.state_of(pid) == "checkpointed"  # nothing was run


def test_a_resume_after_a_restart_acts_on_the_unit_s_processes_through_systemd(
    host: Host,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    services: None,
) -> None:
    """After a controller restart the unit's processes are listed (its own: the name is
    asked), the runs an earlier controller left on them are stopped (a stop that fails is a
    warning that says what becomes of them), each is read through systemd-run like every
    other run, and a process that is no CUDA process is passed over, not the end of the
    list."""
    a = host.job()
    run(host.ladder.suspend(UNIT))
    fake_systemd(tmp_path, "echo 'Access denied' >&2; exit 4")
    on_path(tmp_path, monkeypatch)
    host.settings = dataclasses.replace(host.settings, via_systemd=True)
    fresh = host.restarted_ladder()
    freezer = recorded(host, fresh)
    freezer.pids = [1, a]  # a shell of the unit first: no CUDA process
    run(fresh.resume(UNIT))
    assert host.said()[-1][:2] == ("resumed", UNIT)
    assert host.bed.holds(a) and host.bed.state_of(a) == "running"
    assert freezer.calls == [f"thaw {UNIT}", f"pids {UNIT}"]
    log = calls(tmp_path)
    assert log[0].startswith("stop ")
    assert [line.split()[1].rsplit("-", 2)[0] for line in log[1:]] == [
        "gpuslice-checkpoint-get-state-1",
        f"gpuslice-checkpoint-get-state-{a}",
        f"gpuslice-checkpoint-get-state-{a}",
        f"gpuslice-checkpoint-restore-{a}",
        f"gpuslice-checkpoint-unlock-{a}",
    ]
    assert messages(caplog, logging.WARNING) == [
        f"resuming {UNIT}: cuda-checkpoint runs an earlier controller left on its processes "
        "could not be stopped: Access denied (systemd ends them at their RuntimeMaxSec=)"
    ]


def test_a_resume_that_cannot_list_the_processes_says_why(host: Host) -> None:
    class Unlisted(Freezer):
        async def unit_pids(self, name: str) -> list[int]:
            raise RuntimeError("no such unit")

    fresh = host.restarted_ladder()
    fresh.systemd = Unlisted()
    run(fresh.resume(UNIT))
    assert host.said() == [("resume_failed", UNIT, "cannot list its processes: no such unit")]


# -- a step whose run ends: what it still sends, undoes and says -----------------------------

ENDED = f"{UNIT} went down during a step of its ladder: that step ends there"


def ends_run_after(ladder: Ladder, what: str) -> None:
    """The ladder's freezer call `what` (thaw_unit, unit_pids) ends the unit's run once it
    is answered: the controller hears of a stop (or restart) meanwhile."""
    call = getattr(ladder.systemd, what)

    async def ended(name: str) -> Any:
        answer = await call(name)
        ladder.went_down(UNIT)
        return answer

    setattr(ladder.systemd, what, ended)


def test_a_freeze_whose_run_ends_during_the_thaw_after_it_hung_reports_nothing(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """The thaw after a FreezeUnit with no answer is a step of the same run: ended meanwhile,
    the core (holding the next run) is told no failed freeze of it; the journal says why."""
    host.ladder.systemd = host.freezer = HungFreezer("freeze")
    host.freezer.states[UNIT] = "running"
    host.ladder.freezer_timeout = 0.2
    ends_run_after(host.ladder, "thaw_unit")
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        bounded(host.ladder.freeze(UNIT))
    assert host.freezer.calls == [f"state {UNIT}", f"freeze {UNIT}", f"thaw {UNIT}"]
    assert host.said() == []
    assert messages(caplog, logging.INFO) == [ENDED]
    assert host.ladder.busy == {} and host.ladder.runs == {}


@pytest.mark.parametrize("freeze", ["hung", "answered"])
def test_a_suspend_whose_run_ends_during_the_thaw_of_its_undo_undoes_nothing(
    host: Host, caplog: pytest.LogCaptureFixture, freeze: str
) -> None:
    """A suspend failing after its checkpoint thaws the unit before its undo (a FreezeUnit
    with no answer, or one answered and then NVML not there to confirm): the run ended
    during that ThawUnit. Its processes went with it (their PIDs may be anyone's by now):
    no restore is run, nothing is reported; the journal says why."""
    pid = host.job()
    if freeze == "hung":
        host.ladder.systemd = host.freezer = HungFreezer("freeze")
        host.ladder.freezer_timeout = 0.2
    else:
        real = host.freezer.freeze_unit

        async def frozen(name: str) -> None:
            await real(name)
            host.nvml = False  # the memory cannot be confirmed gone

        host.freezer.freeze_unit = frozen  # type: ignore[method-assign]
    ends_run_after(host.ladder, "thaw_unit")
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        bounded(host.ladder.suspend(UNIT))
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}", f"thaw {UNIT}"]
    assert host.said() == []
    assert host.bed.state_of(pid) == "checkpointed"  # not restored
    assert messages(caplog, logging.INFO) == [ENDED]
    assert UNIT not in host.ladder.suspensions
    assert host.ladder.busy == {} and host.ladder.runs == {}


def test_a_thaw_sent_again_is_not_sent_a_last_time_for_a_run_that_ended(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """The run ends during the last of THAW_RETRY's waits: the last ThawUnit would land on
    the next run (one the core may hold frozen)."""
    host.job()
    run(host.ladder.suspend(UNIT))
    host.ladder.systemd = host.freezer = BlinkingFreezer(1000)

    async def wait(seconds: float) -> None:
        if seconds == THAW_RETRY[-1]:
            host.ladder.went_down(UNIT)

    host.ladder.sleep = wait
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        run(host.ladder.resume(UNIT))
    assert host.freezer.calls == [f"thaw {UNIT}"] * len(THAW_RETRY)
    assert [e for e, _, _ in host.said()] == ["suspended"]
    assert messages(caplog, logging.INFO) == [ENDED]


def test_a_resume_after_a_restart_whose_run_ends_during_its_thaws_sends_no_more(
    host: Host,
) -> None:
    """As above, without a suspension of this controller (the restart's path)."""
    fresh = host.restarted_ladder()
    fresh.systemd = host.freezer = BlinkingFreezer(1000)

    async def wait(seconds: float) -> None:
        fresh.went_down(UNIT)

    fresh.sleep = wait
    run(fresh.resume(UNIT))
    assert host.freezer.calls == [f"thaw {UNIT}"]
    assert host.said() == []


def test_a_resume_after_a_restart_whose_run_ends_as_its_processes_are_listed_restores_none(
    host: Host, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Those listed may be the next run's processes, and one its own suspend checkpointed
    meanwhile would be restored under it (a restart's list and its states take up to
    MAX_RECOVERED_PIDS reads)."""
    a = host.job()
    run(host.ladder.suspend(UNIT))
    fresh = host.restarted_ladder()
    host.freezer.pids = [a]
    ends_run_after(fresh, "unit_pids")
    resumed: list[tuple[int, ...]] = []

    async def restore(
        tool: str, pids: list[int], s: CheckpointSettings, owned: object = None
    ) -> checkpoint.Resumed:
        resumed.append(tuple(pids))
        raise AssertionError("restored")

    monkeypatch.setattr(checkpoint, "resume", restore)
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        run(fresh.resume(UNIT))
    assert resumed == [] and host.bed.state_of(a) == "checkpointed"
    assert [e for e, _, _ in host.said()] == ["suspended"]
    assert messages(caplog, logging.INFO) == [ENDED]


@pytest.mark.parametrize("fails", [False, True])
def test_a_resume_whose_run_ends_during_its_restore_reports_nothing(
    host: Host, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    """Ended while cuda-checkpoint ran: neither `resumed` nor `resume_failed` is of the run
    the core now holds (a failed resume stops the unit)."""
    host.job()
    run(host.ladder.suspend(UNIT))
    real = checkpoint.resume

    async def restore(
        tool: str, pids: list[int], s: CheckpointSettings, owned: object = None
    ) -> checkpoint.Resumed:
        done = await real(tool, pids, s)
        host.ladder.went_down(UNIT)
        if fails:
            raise CheckpointError("PID 1 could not be restored")
        return done

    monkeypatch.setattr(checkpoint, "resume", restore)
    run(host.ladder.resume(UNIT))
    assert [e for e, _, _ in host.said()] == ["suspended"]
    assert host.ladder.busy == {} and host.ladder.runs == {}


def test_a_suspend_whose_run_ends_during_its_checkpoint_reports_no_failure(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    host.job()

    async def checkpointed(
        tool: str, pids: list[int], s: CheckpointSettings, owned: object = None
    ) -> float:
        host.ladder.went_down(UNIT)
        raise CheckpointError("PID 1 could not be locked")

    monkeypatch.setattr(checkpoint, "suspend", checkpointed)
    run(host.ladder.suspend(UNIT))
    assert host.said() == [] and host.freezer.calls == [LOOK]


def test_a_step_keeps_its_run_only_while_it_is_under_way(host: Host) -> None:
    """Nothing is kept of a unit once its steps are done (instances without end)."""
    host.job()
    run(host.ladder.suspend(UNIT))
    assert host.ladder.runs == {} and host.ladder.busy == {}
    run(host.ladder.freeze(UNIT))
    assert host.ladder.runs == {} and host.ladder.busy == {}


def test_a_restart_s_resume_passes_over_a_process_that_exited_unread(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One the tool gave no answer for that has exited needs nothing; the ones after it in
    the list are still asked after and restored."""
    gone = 4_194_304  # above the largest pid_max: never a process

    async def state(tool: str, pid: int, via_systemd: bool = False) -> str:
        if pid == gone:
            raise checkpoint.StateUnread("no answer")
        return "checkpointed"

    monkeypatch.setattr(checkpoint, "get_state", state)
    host.freezer.pids = [gone, 11, gone, 12]
    assert run(host.ladder._recovered_pids(UNIT, "tool", False)) == [11, 12]


class StuckState(Freezer):
    """FreezerState never answered."""

    async def freezer_state(self, name: str) -> str:
        self.calls.append(f"state {name}")
        await asyncio.Event().wait()
        return "frozen"


def test_a_freezer_state_read_before_a_freeze_that_fails_or_hangs_is_taken_for_running(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """Read only to leave an admin's freeze alone: one that fails (with a debug line) or gets
    no answer within the freezer's deadline does not hold the freeze back."""
    host.freezer.fail.add("state")
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        run(host.ladder.freeze(UNIT))
    assert messages(caplog, logging.DEBUG) == [f"FreezerState of {UNIT}: no such unit"]
    assert host.freezer.calls == [f"state {UNIT}", f"freeze {UNIT}"] and host.said() == []
    host.ladder.systemd = host.freezer = StuckState()
    host.ladder.freezer_timeout = 0.2
    bounded(host.ladder.freeze(UNIT), 5)
    assert host.freezer.calls == [f"state {UNIT}", f"freeze {UNIT}"] and host.said() == []


def test_a_freezer_state_read_before_a_suspend_that_fails_or_hangs_is_taken_for_running(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """As before a freeze: one that fails (a debug line) or gets no answer within the
    freezer's deadline does not hold the suspend back."""
    host.job()
    host.freezer.fail.add("state")
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        run(host.ladder.suspend(UNIT))
    assert f"FreezerState of {UNIT}: no such unit" in messages(caplog, logging.DEBUG)
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}"]
    assert [e for e, _, _ in host.said()] == ["suspended"]
    run(host.ladder.resume(UNIT))
    host.ladder.systemd = host.freezer = StuckState()
    host.ladder.freezer_timeout = 0.2
    bounded(host.ladder.suspend(UNIT), 5)
    assert host.freezer.calls == [LOOK, f"freeze {UNIT}"]
    assert [e for e, _, _ in host.said()] == ["suspended", "resumed", "suspended"]


@pytest.mark.parametrize("state", ["frozen", "running"])
def test_a_suspend_whose_run_ends_as_its_freezer_state_is_read_locks_and_reports_nothing(
    host: Host, caplog: pytest.LogCaptureFixture, state: str
) -> None:
    """The state read may be the next run's (frozen by someone since, or not), and so may
    the processes a sample would show now: nothing is locked, nothing reported; the journal
    says why."""
    pid = host.job()
    host.freezer.states[UNIT] = state
    ends_run_after(host.ladder, "freezer_state")
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        bounded(host.ladder.suspend(UNIT))
    assert host.said() == [] and host.freezer.calls == [LOOK]
    assert host.bed.state_of(pid) == "running"  # not locked, nor checkpointed
    assert messages(caplog, logging.INFO) == [ENDED]
    assert host.ladder.busy == {} and host.ladder.runs == {}
