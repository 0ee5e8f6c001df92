"""gpuslice.checkpoint: suspend and resume through cuda-checkpoint, no GPU.

Two kinds of tool: shell-script stubs written per test (argument order, timeouts, hostile
output, a missing tool), and the fake cuda-checkpoint of tests/fakenvml acting on gpu-alloc
jobs, built into a temporary directory as test_nvml_fake.py builds the fake NVML. Tests wait
for output lines and process exits, never for a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpuslice import checkpoint
from gpuslice.checkpoint import (
    CheckpointError,
    CheckpointSettings,
    check_tool,
    find_tool,
    get_state,
    host_memory_available,
    host_memory_fits,
    require_tool,
    resume,
    suspend,
)
from gpuslice.config import Config
from gpuslice.envsafety import EnvFileChecker

GIB = 1 << 30
TIMEOUT = 30.0  # ceiling for a line or an exit; a pass never waits this long
FAST = CheckpointSettings(
    tool="",
    lock_timeout=0.3,
    checkpoint_timeout=5.0,
    restore_timeout=5.0,
    host_memory_margin=2 * GIB,
)
T = TypeVar("T")


def run(awaitable: Awaitable[T]) -> T:
    async def main() -> T:
        return await awaitable

    return asyncio.run(main())


def failure(awaitable: Awaitable[object]) -> CheckpointError:
    with pytest.raises(CheckpointError) as caught:
        run(awaitable)
    return caught.value


def wait_gone(pid: int) -> None:
    """Until `pid` has exited (a zombie counts: its parent is gone or has not reaped it)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)  # polling a condition, with a deadline
    raise AssertionError(f"PID {pid} still runs")


# ---------------------------------------------------------------------------------------------
# stubs


def stub(tmp_path: Path, body: str, name: str = "cuda-checkpoint") -> str:
    """An executable script that logs its arguments to tmp_path/log, then runs `body`."""
    path = tmp_path / name
    path.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/log\n{body}\n')
    path.chmod(0o755)
    return str(path)


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "log"
    return log.read_text().splitlines() if log.exists() else []


def hangs(tmp_path: Path) -> str:
    """What a stub runs to hang: it says so (its PID, a line of tmp_path/hangs), then sleeps
    in place of its shell."""
    return f"echo $$ >> {tmp_path}/hangs; exec sleep 60"


def hung(tmp_path: Path) -> list[int]:
    """The PIDs of the stubs that hang, in the order they began to."""
    path = tmp_path / "hangs"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def timed_once_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run of a tool reaches the code under test (whose deadline for it starts then)
    only once it has ended or hangs (`hangs`): with a deadline of 0.3 s, a stub a loaded
    machine had not run yet was killed before it logged its call or wrote its PID, and an
    unlock given 0.5 s was killed before it answered."""
    create = asyncio.create_subprocess_exec

    async def there(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        before = len(hung(tmp_path))
        proc = await create(*args, **kwargs)
        deadline = time.monotonic() + TIMEOUT
        while len(hung(tmp_path)) == before and not _ended(proc.pid):
            assert time.monotonic() < deadline, f"{args[0]} neither ended nor hung"
            await asyncio.sleep(0.01)
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", there)


def _ended(pid: int) -> bool:
    """Whether the child `pid` has exited (left unreaped for asyncio, or reaped by it)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def me() -> int:
    """A PID that exists, for stubs that never look at it: the test's own, asked when the
    test runs (mutmut imports the tests once and forks a process per mutant: a PID taken at
    import was mutmut's own, which a mutant of `os.kill(pid, 0)` then killed)."""
    return os.getpid()


def test_suspend_locks_every_process_before_it_checkpoints_any(tmp_path: Path) -> None:
    tool = stub(tmp_path, "exit 0")
    s = CheckpointSettings("", 2.5, 60.0, 60.0, 0)
    seconds = run(suspend(tool, [11, 12, 11], s))
    assert 0 <= seconds < TIMEOUT
    assert calls(tmp_path) == [
        "--action lock --pid 11 --timeout 2500",
        "--action lock --pid 12 --timeout 2500",
        "--action checkpoint --pid 11",
        "--action checkpoint --pid 12",
    ]


def test_resume_restores_every_checkpointed_process_then_unlocks(tmp_path: Path) -> None:
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--get-state --pid 11") echo checkpointed ;;\n'
        '  "--get-state --pid 12") echo locked ;;\n'
        '  "--get-state --pid 13") echo running ;;\n'
        '  "--get-state --pid 14") echo "State: checkpointed" ;;\n'
        "esac",
    )
    run(resume(tool, [11, 12, 13, 14], FAST))
    assert calls(tmp_path) == [
        "--get-state --pid 11",
        "--action restore --pid 11",
        "--get-state --pid 12",
        "--get-state --pid 13",
        "--get-state --pid 14",
        "--action restore --pid 14",
        "--action unlock --pid 11",
        "--action unlock --pid 12",
        "--action unlock --pid 14",
    ]


def test_nothing_to_do() -> None:
    assert run(suspend("/nonexistent", [], FAST)) >= 0
    assert run(resume("/nonexistent", [], FAST)).seconds >= 0


@pytest.mark.parametrize("pid", [0, -1, True])
def test_a_pid_must_be_a_pid(pid: int) -> None:
    with pytest.raises(ValueError, match="not a PID"):
        run(suspend("/nonexistent", [pid], FAST))


def test_refused_checkpoint_is_undone(tmp_path: Path) -> None:
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--action checkpoint --pid 12")\n'
        '    echo \'Error checkpointing CUDA in process ID 12: "operation not supported" '
        "(UVM)' >&2\n"
        "    exit 33 ;;\n"
        '  "--get-state --pid 11") echo checkpointed ;;\n'
        '  "--get-state --pid 12") echo locked ;;\n'
        "esac",
    )
    error = failure(suspend(tool, [11, 12], FAST))
    assert (
        error.reason
        == "cuda-checkpoint refused to checkpoint PID 12: operation not supported (UVM)"
    )
    assert error.lost == ()
    assert calls(tmp_path)[4:] == [
        "--get-state --pid 11",
        "--action restore --pid 11",
        "--get-state --pid 12",
        "--action unlock --pid 11",
        "--action unlock --pid 12",
    ]


def test_an_undo_that_fails_is_said(tmp_path: Path) -> None:
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--action checkpoint --pid 11") echo busy >&2; exit 1 ;;\n'
        '  "--get-state --pid 11") echo locked ;;\n'
        '  "--action unlock --pid 11") echo "device lost" >&2; exit 999 ;;\n'
        "esac",
    )
    error = failure(suspend(tool, [11], FAST))
    assert error.reason == (
        "cuda-checkpoint refused to checkpoint PID 11: busy; "
        "and PID 11 could not be unlocked: device lost"
    )


def test_an_undo_that_leaves_a_process_locked_or_unknown_loses_it(tmp_path: Path) -> None:
    """An undo that could not bring a process back to running (its unlock failed; its state
    unreadable while it lives) may have left it locked or checkpointed: its CUDA calls
    block for good. Not named lost, the core kept the unit running as the suspend's
    failure (with `Preempt=suspend` alone: on its GPUs, never chosen again), stuck."""
    pid = me()
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--action checkpoint --pid 11") echo busy >&2; exit 1 ;;\n'
        '  "--get-state --pid 11") echo locked ;;\n'
        '  "--action unlock --pid 11") echo "device lost" >&2; exit 9 ;;\n'
        f'  "--get-state --pid {pid}") echo garbage ;;\n'
        "esac",
    )
    error = failure(suspend(tool, [11, pid], FAST))
    assert sorted(error.lost) == sorted([11, pid])
    assert error.reason.startswith("cuda-checkpoint refused to checkpoint PID 11: busy; and ")


def test_refused_lock_changes_nothing_and_is_not_undone(tmp_path: Path) -> None:
    tool = stub(
        tmp_path,
        '[ "$1" = --get-state ] && echo locked\n'
        '[ "$2" = lock ] && [ "$4" = 12 ] && { echo nope >&2; exit 3; }\n'
        "exit 0",
    )
    error = failure(suspend(tool, [11, 12], FAST))
    assert error.reason == "cuda-checkpoint refused to lock PID 12: nope"
    # 11 was locked: found as it is and unlocked; 12 refused, so not asked about
    assert calls(tmp_path)[2:] == ["--get-state --pid 11", "--action unlock --pid 11"]


def test_the_tool_s_own_lock_timeout(tmp_path: Path) -> None:
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--action lock --pid 11 --timeout 300")\n'
        "    echo 'Error locking CUDA in process ID 11: \"the operation timed out\"' >&2\n"
        "    exit 141 ;;\n"
        "esac",
    )
    error = failure(suspend(tool, [11], FAST))
    assert error.reason == "lock of PID 11 timed out after 0.3 s"
    assert calls(tmp_path) == ["--action lock --pid 11 --timeout 300"]


def test_a_hung_lock_is_killed_and_undone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint, "LOCK_GRACE", 0.2)
    timed_once_there(tmp_path, monkeypatch)
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        f'  "--action lock --pid 11 --timeout 300") {hangs(tmp_path)} ;;\n'
        '  "--get-state --pid 11") echo locked ;;\n'
        "esac",
    )
    start = time.monotonic()
    error = failure(suspend(tool, [11], FAST))
    assert time.monotonic() - start < 10
    assert error.reason == (
        "lock of PID 11 timed out after 0.3 s: cuda-checkpoint did not return within 0.5 s and "
        "was killed"
    )
    assert calls(tmp_path)[1:] == ["--get-state --pid 11", "--action unlock --pid 11"]
    [pid] = hung(tmp_path)
    wait_gone(pid)


def test_a_hung_checkpoint_is_killed_with_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the background sleep holds stderr open: killing the script alone would not end the read
    timed_once_there(tmp_path, monkeypatch)
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--action checkpoint --pid 11")\n'
        f"    sleep 60 & echo $! > {tmp_path}/child; echo $$ >> {tmp_path}/hangs; wait ;;\n"
        '  "--get-state --pid 11") echo checkpointed ;;\n'
        "esac",
    )
    s = CheckpointSettings("", 1.0, 0.3, 5.0, 0)
    error = failure(suspend(tool, [11], s))
    assert error.reason == (
        "checkpoint of PID 11 timed out after 0.3 s: cuda-checkpoint did not return within 0.3 s "
        "and was killed"
    )
    assert calls(tmp_path)[2:] == [
        "--get-state --pid 11",
        "--action restore --pid 11",
        "--action unlock --pid 11",
    ]
    wait_gone(int((tmp_path / "child").read_text()))


def test_a_killed_runs_pipes_are_closed_though_another_process_holds_them(
    tmp_path: Path,
) -> None:
    """A process outside the tool's group (setsid here; the transient service in
    production) keeps the pipes' other ends: our ends are closed when the run is killed,
    not left open with their transport as long as the controller runs."""
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--action checkpoint --pid 11")\n'
        f"    setsid sleep 60 & echo $! > {tmp_path}/child; sleep 60 ;;\n"
        '  "--get-state --pid 11") echo locked ;;\n'
        "esac",
    )
    s = CheckpointSettings("", 1.0, 0.3, 5.0, 0)
    left: list[asyncio.SubprocessTransport] = []
    create = asyncio.create_subprocess_exec

    async def recorded(*args: object, **kwargs: object) -> asyncio.subprocess.Process:
        proc = await create(*args, **kwargs)  # type: ignore[arg-type]
        left.append(proc._transport)  # type: ignore[attr-defined]
        return proc

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(asyncio, "create_subprocess_exec", recorded)
            error = failure(suspend(tool, [11], s))
        assert left and all(t.is_closing() for t in left)
        # reaped at once: asyncio's wait() waited for the held pipes too (REAP_TIMEOUT)
        assert error.reason == (
            "checkpoint of PID 11 timed out after 0.3 s: cuda-checkpoint did not return "
            "within 0.3 s and was killed"
        )
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((tmp_path / "child").read_text()), signal.SIGKILL)


def test_a_cancelled_suspend_kills_the_tool(tmp_path: Path) -> None:
    tool = stub(
        tmp_path,
        f"echo $$ > {tmp_path}/hung.tmp; mv {tmp_path}/hung.tmp {tmp_path}/hung; exec sleep 60",
    )

    async def cancel_when_started() -> None:
        task = asyncio.create_task(suspend(tool, [11], FAST))
        deadline = time.monotonic() + TIMEOUT
        while not (tmp_path / "hung").exists():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel_when_started())
    wait_gone(int((tmp_path / "hung").read_text()))
    assert calls(tmp_path) == ["--action lock --pid 11 --timeout 300"]  # no undo


def test_huge_output_is_cut(tmp_path: Path) -> None:
    tool = stub(tmp_path, "head -c 20000000 /dev/zero | tr '\\0' x >&2; exit 1")
    start = time.monotonic()
    error = failure(suspend(tool, [11], FAST))
    assert time.monotonic() - start < 10
    assert error.reason == "cuda-checkpoint refused to lock PID 11: " + "x" * 200 + "..."


def test_output_that_is_not_utf8_is_escaped(tmp_path: Path) -> None:
    tool = stub(tmp_path, "printf 'bad \\377\\376 \\033[2J\\n\\tmore\\r\\n' >&2; exit 1")
    error = failure(suspend(tool, [11], FAST))
    assert error.reason == (
        "cuda-checkpoint refused to lock PID 11: bad \\ufffd\\ufffd \\x1b[2J more"
    )
    assert error.reason.isascii() and error.reason.isprintable()


def test_silent_failures_say_how_the_tool_ended(tmp_path: Path) -> None:
    assert failure(suspend(stub(tmp_path, "exit 7"), [11], FAST)).reason == (
        "cuda-checkpoint refused to lock PID 11: exit status 7"
    )
    assert failure(suspend(stub(tmp_path, "kill -SEGV $$"), [11], FAST)).reason == (
        "cuda-checkpoint refused to lock PID 11: killed by SIGSEGV"
    )
    assert failure(suspend(stub(tmp_path, "echo why; exit 1"), [11], FAST)).reason == (
        "cuda-checkpoint refused to lock PID 11: why"  # stdout when stderr says nothing
    )


def test_missing_tool(tmp_path: Path) -> None:
    pid = me()
    tool = str(tmp_path / "cuda-checkpoint")
    assert failure(suspend(tool, [pid], FAST)).reason == (
        f"cuda-checkpoint is not installed ({tool} not found)"
    )
    # resume cannot read the state of a live process
    assert failure(resume(tool, [pid], FAST)).reason == (
        f"the state of PID {pid} could not be read: cuda-checkpoint is not installed "
        f"({tool} not found)"
    )


def test_tool_that_cannot_be_run(tmp_path: Path) -> None:
    tool = tmp_path / "cuda-checkpoint"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o644)
    if os.access(tool, os.X_OK):
        pytest.skip("root may run anything")
    assert failure(suspend(str(tool), [11], FAST)).reason == (
        f"cuda-checkpoint {tool} could not be run: Permission denied"
    )


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("running", "running"),
        ("checkpointed\n", "checkpointed"),
        ("\nState: LOCKED\n", "locked"),
        ("failed", "failed"),
    ],
)
def test_get_state(tmp_path: Path, output: str, expected: str) -> None:
    tool = stub(tmp_path, f"printf '{output}'")
    assert run(get_state(tool, 11)) == expected


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        ("echo suspended", "suspended"),
        ("true", ""),
        ("printf 'run\\033[2Jning'", "run\\x1b[2Jning"),
        ("yes nonsense | head -c 10000000", "nonsense"),
    ],
)
def test_unknown_state(tmp_path: Path, body: str, shown: str) -> None:
    error = failure(get_state(stub(tmp_path, body), 11))
    assert error.reason == f'cuda-checkpoint gave an unknown state for PID 11: "{shown}"'
    # exited 0: an answer about a CUDA process, not the refusal a process with no CUDA gets
    assert isinstance(error, checkpoint.StateUnread)


def test_a_state_the_tool_gave_no_answer_for_is_unread_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted controller's resume skips the processes the tool refuses (no CUDA
    process): one whose state it gave no answer for (timed out, not run) may be
    checkpointed, and is told apart (checkpoint.StateUnread). The short timeout is the hung
    call's alone: the stub that answers, run past it on a loaded host, read as unread."""
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "STATE_TIMEOUT", 0.3)
        error = failure(get_state(stub(tmp_path, hangs(tmp_path)), 11))
    assert isinstance(error, checkpoint.StateUnread), error.reason
    assert error.reason.startswith("the state of PID 11 could not be read: cuda-checkpoint did")
    no_cuda = stub(
        tmp_path,
        """echo 'Error getting CUDA in process ID 11: "not initialized"' >&2
exit 3""",
    )
    error = failure(get_state(no_cuda, 11))
    assert not isinstance(error, checkpoint.StateUnread), error.reason
    error = failure(get_state(str(tmp_path / "gone"), 11))
    assert isinstance(error, checkpoint.StateUnread), error.reason


@pytest.mark.parametrize(
    ("said", "unread"),
    [
        ("Failed to start transient service unit: Connection reset by peer", True),
        ("Failed to connect to bus: No such file or directory", True),
        ('Error getting CUDA in process ID 11: \\"not initialized\\"', False),
    ],
)
def test_systemd_run_failing_is_no_answer_of_the_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, said: str, unread: bool
) -> None:
    """systemd-run failing (systemd re-executing) exits 1, as the tool may for a process with
    no CUDA: its own words tell the two apart."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir, f'echo "{said}" >&2; exit 1', name="systemd-run")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    tool = stub(tmp_path, "echo running")
    error = failure(get_state(tool, 11, via_systemd=True))
    assert isinstance(error, checkpoint.StateUnread) is unread, error.reason


def test_resume_skips_processes_that_have_exited(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    tool = stub(tmp_path, '[ "$1" = --get-state ] && { echo "no such process" >&2; exit 1; }')
    run(resume(tool, [gone.pid], FAST))
    pid = me()
    assert failure(resume(tool, [pid], FAST)).reason == (
        f"the state of PID {pid} could not be read: no such process"
    )


def test_resume_lists_every_problem_and_the_lost(tmp_path: Path) -> None:
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--get-state --pid 11") echo locked ;;\n'
        '  "--get-state --pid 12") echo checkpointed ;;\n'
        "  \"--action restore --pid 12\") echo 'out of memory' >&2; exit 2 ;;\n"
        '  "--get-state --pid 13") echo checkpointed ;;\n'
        '  "--get-state --pid 14") echo failed ;;\n'
        '  "--action unlock --pid 11") echo busy >&2; exit 1 ;;\n'
        "esac",
    )
    error = failure(resume(tool, [11, 12, 13, 14], FAST))
    assert error.reason == (
        "restore of PID 12 ran out of GPU memory; the process cannot be resumed and must be "
        "stopped; PID 13 left checkpointed: a restore failed before it; PID 14 cannot be "
        "resumed: an earlier restore failed (state failed); it must be stopped; PID 11 could "
        "not be unlocked: busy"
    )
    assert error.lost == (12, 14)
    assert error.unsettled == (12, 14, 13, 11)  # and those left checkpointed or locked
    assert "--action restore --pid 13" not in calls(tmp_path)


def test_a_restore_that_hangs_is_fatal(tmp_path: Path) -> None:
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        '  "--get-state --pid 11") echo checkpointed ;;\n'
        '  "--action restore --pid 11") exec sleep 60 ;;\n'
        "esac",
    )
    s = CheckpointSettings("", 1.0, 1.0, 0.2, 0)
    error = failure(resume(tool, [11], s))
    assert error.reason == (
        "restore of PID 11 timed out after 0.2 s: cuda-checkpoint did not return within 0.2 s "
        "and was killed; the process cannot be resumed and must be stopped"
    )
    assert error.lost == (11,)


# ---------------------------------------------------------------------------------------------
# finding the tool


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_a_tool_someone_other_than_root_can_change_is_not_run_as_root(tmp_path: Path) -> None:
    """gpuslice runs cuda-checkpoint as root: one an admin cloned and built as a user, or
    put where a group can write, gave that user root at the next suspend or resume."""
    tool = tmp_path / "cuda-checkpoint"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert require_tool(str(tool)) == str(tool)  # a stub of the tests' own: not checked
    with pytest.raises(CheckpointError) as e:
        require_tool(str(tool), root_only=True)
    assert e.value.reason == (
        f"{tool} is not run: gpuslice runs it as root, and someone other than root can "
        f"change it ({tool} is under /tmp, where users make files or file systems are "
        "mounted after systemd runs gpuslice's generator at boot); give it to root, or set "
        "cuda_checkpoint to a copy only root can change"
    )
    true = shutil.which("true")
    assert true is not None and require_tool(true, root_only=True) == true  # root's alone
    check_tool(str(tool), root_only=False)
    odd = tmp_path / "cuda%h-checkpoint"  # a literal %, no specifier: the path walked is this
    odd.write_text("#!/bin/sh\n")
    odd.chmod(0o755)
    with pytest.raises(CheckpointError, match="is under /tmp") as e:
        require_tool(str(odd), root_only=True)
    assert e.value.reason.startswith(f"{odd} is not run: ")
    assert f"({odd} is under /tmp" in e.value.reason
    assert CheckpointSettings.from_config(Config()).root_only  # the controller's settings


def test_a_tool_whose_path_has_a_percent_or_a_bracket_is_checked_as_that_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuda_checkpoint is a path, not an EnvironmentFile= value: `[12]` is no wildcard (it
    was refused as one: a root's tool never ran, each suspend failed), `100%` no specifier
    (nor named `100%%`). Walked under a root of the test's, as the controller's is /."""
    tmp_path.chmod(0o755)
    root_tool = executable(tmp_path / "opt/cuda[12]/100%/cuda-checkpoint")
    users_tool = executable(tmp_path / "opt/100%/cuda-checkpoint")
    os.chown(users_tool, 1000, 1000)
    monkeypatch.setattr(checkpoint, "EnvFileChecker", lambda: EnvFileChecker(tmp_path))
    check_tool("/opt/cuda[12]/100%/cuda-checkpoint", root_only=True)
    assert root_tool.exists()
    with pytest.raises(CheckpointError) as e:
        check_tool("/opt/100%/cuda-checkpoint", root_only=True)
    assert e.value.reason == (
        "/opt/100%/cuda-checkpoint is not run: gpuslice runs it as root, and someone other "
        "than root can change it (/opt/100%/cuda-checkpoint is owned by UID 1000, who can "
        "change it); give it to root, or set cuda_checkpoint to a copy only root can change"
    )


def test_find_tool_configured(tmp_path: Path) -> None:
    tool = executable(tmp_path / "bin" / "cuda-checkpoint")
    assert find_tool(str(tool)) == str(tool)
    plain = tmp_path / "plain"
    plain.write_text("")
    for absent in (plain, tmp_path / "bin", tmp_path / "absent"):
        assert find_tool(str(absent)) is None
    # an admin who named one meant it: no search instead
    assert find_tool(str(tmp_path / "absent"), locations=[str(tool.parent)]) is None
    assert find_tool("bin/cuda-checkpoint") is None


def test_find_tool_searches_path_then_the_driver_s_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path = executable(tmp_path / "path" / "cuda-checkpoint")
    driver = executable(tmp_path / "cuda" / "bin" / "cuda-checkpoint")
    (tmp_path / "empty").mkdir()
    locations = [str(tmp_path / "empty"), str(driver.parent)]
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_tool("", locations=locations) == str(on_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_tool("", locations=locations) == str(driver)
    assert find_tool("", locations=[str(tmp_path / "empty")]) is None
    # a relative PATH entry is never searched: the daemon's working directory is not the admin's
    monkeypatch.chdir(on_path.parent.parent)
    monkeypatch.setenv("PATH", "path")
    assert find_tool("", locations=[]) is None
    assert checkpoint.TOOL_LOCATIONS == ("/usr/bin", "/usr/local/bin", "/usr/local/cuda/bin")


def test_require_tool_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CheckpointError) as caught:
        require_tool("", locations=[])
    assert caught.value.reason == "cuda-checkpoint is not installed"
    with pytest.raises(CheckpointError) as caught:
        require_tool("/opt/cuda-checkpoint\n", locations=[])
    assert caught.value.reason == (
        "cuda_checkpoint /opt/cuda-checkpoint\\x0a is not an executable file"
    )
    tool = executable(tmp_path / "cuda-checkpoint")
    assert require_tool("", locations=[]) == str(tool)


# ---------------------------------------------------------------------------------------------
# host memory


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("MemTotal:       65536000 kB\nMemAvailable:   12345678 kB\n", 12345678 * 1024),
        ("MemAvailable: 0 kB\n", 0),
        ("MemAvailable: 4096\n", 4096),
        ("MemTotal: 1 kB\n", None),
        ("MemAvailable: lots kB\n", None),
        ("MemAvailable: 12 MB\n", None),
        ("MemAvailable: " + "9" * 400 + " kB\n", None),
        ("", None),
    ],
)
def test_host_memory_available(tmp_path: Path, text: str, expected: int | None) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(text)
    assert host_memory_available(meminfo) == expected


def test_host_memory_available_unreadable(tmp_path: Path) -> None:
    assert host_memory_available(tmp_path / "absent") is None
    assert host_memory_available(tmp_path) is None  # a directory
    assert isinstance(host_memory_available(), int)  # this host's /proc/meminfo


def test_host_memory_fits() -> None:
    s = CheckpointSettings("", 10.0, 300.0, 300.0, 2 * GIB)
    assert host_memory_fits(6 * GIB, s, 8 * GIB) == ""
    assert host_memory_fits(6 * GIB + 1, s, 8 * GIB) == (
        "6.0 GiB to move but 8 GiB of host memory available (margin 2 GiB)"
    )
    assert host_memory_fits(14 * GIB + GIB // 5, s, 8 * GIB) == (
        "14.2 GiB to move but 8 GiB of host memory available (margin 2 GiB)"
    )
    assert host_memory_fits(0, s, None) == "MemAvailable unknown"


# ---------------------------------------------------------------------------------------------
# the fake cuda-checkpoint on gpu-alloc jobs

GPUS = "# index uuid total name\n0 GPU-00000000-0000-0000-0000-000000000000 24GiB Fake\n"


class Bed:
    """A fake GPU (24 GiB), the fake tool, and gpu-alloc jobs on it."""

    def __init__(self, build: Path, state: Path) -> None:
        self.build = build
        self.state = state
        self.tool = str(build / "cuda-checkpoint")
        self.procs: list[subprocess.Popen[bytes]] = []
        state.mkdir()
        (state / "gpus").write_text(GPUS)
        (state / "inject").mkdir()

    def alloc(self, size: str) -> int:
        proc = subprocess.Popen(
            [str(self.build / "gpu-alloc"), "--gpu", "0", "--bytes", size],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT)
        assert ready, "gpu-alloc printed nothing"
        assert proc.stdout.readline().startswith(b"ready")
        return proc.pid

    def inject(self, name: str) -> Path:
        path = self.state / "inject" / name
        path.touch()
        return path

    def state_of(self, pid: int) -> str:
        return run(get_state(self.tool, pid))

    def tool_run(self, *args: str) -> None:
        subprocess.run([self.tool, *args], check=True, capture_output=True, timeout=TIMEOUT)

    def holds(self, pid: int) -> bool:
        """Whether the job's memory is on the GPU (its allocation file in alloc/)."""
        return (self.state / "alloc" / str(pid)).exists()

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def bed(fake_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bed]:
    state = tmp_path / "nvml"
    monkeypatch.setenv("FAKE_NVML_DIR", str(state))  # the tool inherits the daemon's environment
    bed = Bed(fake_build, state)
    yield bed
    bed.close()


def test_round_trip(bed: Bed) -> None:
    a, b = bed.alloc("8G"), bed.alloc("4G")
    assert run(suspend(bed.tool, [a, b], FAST)) >= 0
    assert [bed.state_of(a), bed.state_of(b)] == ["checkpointed", "checkpointed"]
    assert not bed.holds(a) and not bed.holds(b)
    assert run(resume(bed.tool, [a, b], FAST)).seconds >= 0
    assert [bed.state_of(a), bed.state_of(b)] == ["running", "running"]
    assert bed.holds(a) and bed.holds(b)
    run(resume(bed.tool, [a, b], FAST))  # idempotent
    assert [bed.state_of(a), bed.state_of(b)] == ["running", "running"]


def test_lock_timeout_undoes_nothing_harmful(bed: Bed) -> None:
    a, b = bed.alloc("1G"), bed.alloc("1G")
    bed.inject(f"lock-timeout-{b}")
    error = failure(suspend(bed.tool, [a, b], FAST))
    assert error.reason == f"lock of PID {b} timed out after 0.3 s"
    assert [bed.state_of(a), bed.state_of(b)] == ["running", "running"]
    bed.inject(f"lock-timeout-{a}")
    assert failure(suspend(bed.tool, [a, b], FAST)).reason == (
        f"lock of PID {a} timed out after 0.3 s"
    )
    assert [bed.state_of(a), bed.state_of(b)] == ["running", "running"]


def test_refused_lock_of_the_second_unlocks_the_first(bed: Bed) -> None:
    a, b = bed.alloc("1G"), bed.alloc("1G")
    bed.inject(f"refuse-{b}")
    error = failure(suspend(bed.tool, [a, b], FAST))
    assert error.reason.startswith(
        f"cuda-checkpoint refused to lock PID {b}: operation not supported ("
    )
    assert ";" not in error.reason
    assert [bed.state_of(a), bed.state_of(b)] == ["running", "running"]


def wrapped(bed: Bed, tmp_path: Path, body: str) -> str:
    """A tool that runs `body` around the fake one (`$FAKE` runs it with the arguments)."""
    path = tmp_path / "wrapped-cuda-checkpoint"
    path.write_text(f'#!/bin/sh\nFAKE="{bed.tool}"\n{body}\n')
    path.chmod(0o755)
    return str(path)


def test_refused_checkpoint_of_the_second_restores_the_first(bed: Bed, tmp_path: Path) -> None:
    a, b = bed.alloc("8G"), bed.alloc("1G")
    refuse = bed.state / "inject" / f"refuse-{b}"
    tool = wrapped(
        bed,
        tmp_path,
        f'if [ "$*" = "--action checkpoint --pid {b}" ]; then\n'
        f'  touch {refuse}; "$FAKE" "$@"; rc=$?; rm {refuse}; exit $rc\n'
        "fi\n"
        'exec "$FAKE" "$@"',
    )
    error = failure(suspend(tool, [a, b], FAST))
    assert error.reason.startswith(
        f"cuda-checkpoint refused to checkpoint PID {b}: operation not supported ("
    )
    assert ";" not in error.reason
    assert [bed.state_of(a), bed.state_of(b)] == ["running", "running"]
    assert bed.holds(a) and bed.holds(b)


def test_an_undo_that_is_refused_too(bed: Bed, tmp_path: Path) -> None:
    a, b = bed.alloc("8G"), bed.alloc("1G")
    refuse = bed.state / "inject" / f"refuse-{b}"
    tool = wrapped(
        bed,
        tmp_path,
        f'"$FAKE" "$@"; rc=$?\n'
        f'[ "$*" = "--action lock --pid {b} --timeout 300" ] && touch {refuse}\n'
        "exit $rc",
    )
    error = failure(suspend(tool, [a, b], FAST))
    assert error.reason.startswith(
        f"cuda-checkpoint refused to checkpoint PID {b}: operation not supported ("
    )
    assert f"; and PID {b} could not be unlocked: operation not supported (" in error.reason
    assert [bed.state_of(a), bed.state_of(b)] == ["running", "locked"]
    refuse.unlink()
    run(resume(bed.tool, [a, b], FAST))
    assert [bed.state_of(a), bed.state_of(b)] == ["running", "running"]


def test_resume_after_a_half_done_suspend(bed: Bed) -> None:
    a, b, c = bed.alloc("4G"), bed.alloc("4G"), bed.alloc("4G")
    for pid in (a, b):
        bed.tool_run("--action", "lock", "--pid", str(pid))
    bed.tool_run("--action", "checkpoint", "--pid", str(a))  # then the controller crashed
    assert [bed.state_of(a), bed.state_of(b), bed.state_of(c)] == [
        "checkpointed",
        "locked",
        "running",
    ]
    run(resume(bed.tool, [a, b, c], FAST))
    assert [bed.state_of(a), bed.state_of(b), bed.state_of(c)] == ["running"] * 3
    assert bed.holds(a)


def test_restore_out_of_memory_is_fatal(bed: Bed) -> None:
    a, b = bed.alloc("12G"), bed.alloc("4G")
    run(suspend(bed.tool, [a, b], FAST))
    bed.alloc("16G")  # takes the memory while they are suspended
    error = failure(resume(bed.tool, [a, b], FAST))
    assert error.reason == (
        f"restore of PID {a} ran out of GPU memory; the process cannot be resumed and must be "
        f"stopped; PID {b} left checkpointed: a restore failed before it"
    )
    assert error.lost == (a,)
    assert [bed.state_of(a), bed.state_of(b)] == ["failed", "checkpointed"]
    error = failure(resume(bed.tool, [a], FAST))
    assert error.reason == (
        f"PID {a} cannot be resumed: an earlier restore failed (state failed); it must be stopped"
    )
    assert error.lost == (a,)


def test_injected_restore_oom(bed: Bed) -> None:
    a = bed.alloc("1G")
    run(suspend(bed.tool, [a], FAST))
    bed.inject(f"restore-oom-{a}")
    error = failure(resume(bed.tool, [a], FAST))
    assert error.reason == (
        f"restore of PID {a} ran out of GPU memory; the process cannot be resumed and must be "
        "stopped"
    )
    assert bed.state_of(a) == "failed"


def test_not_a_cuda_process(bed: Bed) -> None:
    pid = me()
    error = failure(suspend(bed.tool, [pid], FAST))
    assert error.reason.startswith(f"cuda-checkpoint refused to lock PID {pid}: ")
    assert ";" not in error.reason


def test_a_suspended_job_that_is_killed_needs_no_resume(bed: Bed) -> None:
    a = bed.alloc("1G")
    run(suspend(bed.tool, [a], FAST))
    proc = bed.procs[0]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=TIMEOUT)
    run(resume(bed.tool, [a], FAST))


def test_via_systemd_the_tool_runs_as_a_transient_service_that_systemd_ends_in_time() -> None:
    assert checkpoint._command("/t", ["--get-state", "--pid", "7"], 2.5, None) == [
        "/t",
        "--get-state",
        "--pid",
        "7",
    ]
    assert checkpoint._command("/t", ["--get-state", "--pid", "7"], 2.5, "x.service") == [
        "systemd-run",
        "--quiet",
        "--wait",
        "--pipe",
        "--collect",
        "--service-type=exec",
        "--unit=x.service",
        "--description=gpuslice: cuda-checkpoint --get-state --pid 7",
        "--property=RuntimeMaxSec=3",
        "--property=TimeoutStopSec=5",
        "--",
        "/t",
        "--get-state",
        "--pid",
        "7",
    ]


def test_each_run_s_service_has_its_own_name_that_says_what_ran() -> None:
    me = os.getpid()
    first = checkpoint._service_name(["--action", "checkpoint", "--pid", "4194304"])
    second = checkpoint._service_name(["--get-state", "--pid", "7"])
    assert first.startswith(f"gpuslice-checkpoint-checkpoint-4194304-{me}-")
    assert second.startswith(f"gpuslice-checkpoint-get-state-7-{me}-")
    assert int(second.split("-")[-1].removesuffix(".service")) > int(
        first.split("-")[-1].removesuffix(".service")
    )
    assert all(c.isascii() and (c.isalnum() or c in "-.") for c in first + second)


def fake_systemd(tmp_path: Path, stop_body: str = "") -> None:
    """systemd-run and systemctl on PATH, as systemd behaves for them: the tool runs as the
    named service, in a session of its own, so that killing systemd-run leaves it running
    (holding the client's pipes, as with --pipe); `systemctl stop NAME` kills it (then
    `stop_body`). Both log what they were asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    run_stub = bin_dir / "systemd-run"
    run_stub.write_text(
        "#!/bin/sh\n"
        'for a; do case "$a" in --unit=*) unit="${a#--unit=}" ;; esac; done\n'
        f'echo "run $unit" >> {tmp_path}/log\n'
        'while [ "$1" != "--" ]; do shift; done; shift\n'
        'setsid "$@" < /dev/null &\n'
        f"echo $! > {tmp_path}/$unit.pid\n"
        "wait $!\n"
    )
    stop_stub = bin_dir / "systemctl"
    stop_stub.write_text(
        "#!/bin/sh\n"
        'verb="$1"; while [ "$1" != "--" ]; do shift; done; shift\n'
        f'echo "$verb $*" >> {tmp_path}/log\n'
        "for unit; do\n"  # a glob matches the services running (loaded), as systemctl's
        f'  for f in {tmp_path}/$unit.pid; do [ ! -f "$f" ] || kill -KILL "$(cat "$f")"; done\n'
        "done\n"
        f"{stop_body}\n"
    )
    for path in (run_stub, stop_stub):
        path.chmod(0o755)


def test_a_hung_lock_s_service_is_stopped_before_the_undo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services: None
) -> None:
    """The lock's client (systemd-run) is killed at its deadline; the transient service it
    started would go on, and a lock that succeeds after the undo read the process running
    would leave the job's CUDA locked with nobody responsible for it. The service is
    stopped, and is down, before the undo looks at the process."""
    monkeypatch.setattr(checkpoint, "LOCK_GRACE", 0.2)
    fake_systemd(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    timed_once_there(tmp_path, monkeypatch)
    tool = stub(
        tmp_path,
        'case "$*" in\n'
        f'  "--action lock --pid 11 --timeout 300") {hangs(tmp_path)} ;;\n'
        '  "--get-state --pid 11") echo running ;;\n'
        "esac",
    )
    s = dataclasses.replace(FAST, via_systemd=True)
    error = failure(suspend(tool, [11], s))
    assert error.reason == (
        "lock of PID 11 timed out after 0.3 s: cuda-checkpoint did not return within 0.5 s and "
        "was killed"
    )
    log = calls(tmp_path)
    lock = log[0].removeprefix("run ")
    assert lock.startswith("gpuslice-checkpoint-lock-11-")
    assert log[1:4] == ["--action lock --pid 11 --timeout 300", f"stop {lock}", log[3]]
    assert log[3].startswith("run gpuslice-checkpoint-get-state-11-")
    assert log[4:] == ["--get-state --pid 11"]
    wait_gone(int((tmp_path / lock).with_suffix(".service.pid").read_text()))


def test_a_service_that_cannot_be_stopped_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services: None
) -> None:
    monkeypatch.setattr(checkpoint, "LOCK_GRACE", 0.2)
    fake_systemd(tmp_path, "echo 'Failed to stop it: Access denied' >&2; exit 4")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    timed_once_there(tmp_path, monkeypatch)
    tool = stub(tmp_path, hangs(tmp_path))
    s = dataclasses.replace(FAST, via_systemd=True)
    with pytest.raises(checkpoint._ToolFailed) as caught:
        run(checkpoint._call(tool, ("--action", "lock", "--pid", "11"), 0.3, True))
    unit = calls(tmp_path)[0].removeprefix("run ")
    assert caught.value.detail == (
        f"cuda-checkpoint did not return within 0.3 s and was killed; its service {unit} could "
        "not be stopped: Failed to stop it: Access denied"
    )
    assert caught.value.timed_out and s.via_systemd


def test_runs_an_earlier_controller_left_on_the_processes_are_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services: None
) -> None:
    """A controller killed in the middle of a suspend leaves its lock, checkpoint, restore or
    unlock running as a transient service: each of those named for the PIDs is stopped and
    down before the call returns; another process's runs and a --get-state are left."""
    fake_systemd(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    left = {}
    for name in ("lock-11-900-3", "restore-11-901-1", "lock-12-900-4", "get-state-11-900-5"):
        left[name] = subprocess.Popen(["sleep", "60"])
        pid_file = tmp_path / f"gpuslice-checkpoint-{name}.service.pid"
        pid_file.write_text(str(left[name].pid))
    assert run(checkpoint.stop_earlier_runs([11, 11])) == ""
    assert calls(tmp_path) == [
        "stop "
        + " ".join(
            f"gpuslice-checkpoint-{a}-11-*.service"
            for a in ("lock", "checkpoint", "restore", "unlock")
        )
    ]
    assert left["lock-11-900-3"].wait(TIMEOUT) == -signal.SIGKILL
    assert left["restore-11-901-1"].wait(TIMEOUT) == -signal.SIGKILL
    assert left["lock-12-900-4"].poll() is None
    assert left["get-state-11-900-5"].poll() is None
    for proc in left.values():
        proc.kill()
        proc.wait(TIMEOUT)
    assert run(checkpoint.stop_earlier_runs([])) == ""


def test_the_runs_of_a_unit_of_many_processes_are_stopped_in_several_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services: None
) -> None:
    """Four patterns per process: 10,000 processes in one command line was E2BIG."""
    fake_systemd(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setattr(checkpoint, "MAX_STOP_NAMES", 8)
    assert run(checkpoint.stop_earlier_runs([1, 2, 3])) == ""
    assert [len(c.split()) - 1 for c in calls(tmp_path)] == [8, 4]


def test_without_systemd_run_the_reason_names_it_not_the_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = stub(tmp_path, "exit 0")  # installed: what is missing is systemd-run
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    s = CheckpointSettings("", 0.3, 5.0, 5.0, 0, via_systemd=True)
    assert failure(suspend(tool, [11], s)).reason == (
        "systemd-run not found: cuda-checkpoint cannot be run as a transient service"
    )
    assert calls(tmp_path) == []
