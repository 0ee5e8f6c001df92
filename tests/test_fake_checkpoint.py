"""The fake cuda-checkpoint (tests/fakenvml/cuda-checkpoint.c) on gpu-alloc jobs, no GPU.

The fake mirrors the real tool's command line and its state machine (running, locked,
checkpointed, failed); a checkpointed job's allocation file moves from alloc/ to checkpointed/,
so the fake NVML stops counting it. Every failure prints the real tool's `Error <doing> CUDA in
process ID PID: "<CUDA error>"` line and exits with the CUDA error code (its low 8 bits).
Tests wait for output lines and exits, never for a fixed time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_nvml_fake import Alloc as Job
from tests.test_nvml_fake import reap

GIB = 1 << 30
GPUS = (
    "0 GPU-11111111-1111-1111-1111-111111111111 4GiB NVIDIA Fake 4GB\n"
    "1 GPU-22222222-2222-2222-2222-222222222222 4GiB NVIDIA Fake 4GB\n"
)
TIMEOUT = 30.0  # generous ceiling for a child or a line; a pass never waits this long

# Exit statuses: the CUDA error codes, as exit() keeps their low 8 bits.
INVALID_VALUE = 1
OUT_OF_MEMORY = 2
NOT_INITIALIZED = 3
OPERATING_SYSTEM = 304 & 0xFF
ILLEGAL_STATE = 401 & 0xFF
NOT_SUPPORTED = 801 & 0xFF
TIMED_OUT = 909 & 0xFF

ILLEGAL = '"the operation cannot be performed in the present state"'

# What the fake NVML reports, through pynvml, in a fresh process (pynvml loads the library
# once per process): per GPU, used bytes and the compute processes' PIDs.
NVML_PROBE = """
import json, pynvml
pynvml.nvmlInit()
out = []
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    pids = sorted(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h))
    out.append([pynvml.nvmlDeviceGetMemoryInfo(h).used, pids])
pynvml.nvmlShutdown()
print(json.dumps(out))
"""


class Bed:
    """A fake NVML state dir with two 4 GiB GPUs, gpu-alloc jobs and the fake cuda-checkpoint."""

    def __init__(self, build: Path, state: Path) -> None:
        self.build = build
        self.state = state
        self.jobs: list[Job] = []
        state.mkdir()
        (state / "gpus").write_text(GPUS)
        (state / "inject").mkdir()

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_DIR")}
        env["FAKE_NVML_DIR"] = str(self.state)
        return env

    def job(self, gpu: int, size: str) -> Job:
        cmd = [str(self.build / "gpu-alloc"), "--gpu", str(gpu), "--bytes", size]
        job = Job(subprocess.Popen(cmd, env=self.env(), stdout=subprocess.PIPE, bufsize=0))
        self.jobs.append(job)  # before waiting, so close() reaps it even on failure
        assert job.read_line().startswith("ready ")
        return job

    def ckpt(self, *args: str | int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.build / "cuda-checkpoint"), *map(str, args)],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )

    def ok(self, *args: str | int) -> str:
        run = self.ckpt(*args)
        assert (run.returncode, run.stderr) == (0, ""), run
        return run.stdout

    def act(self, action: str, pid: int, *extra: str | int) -> None:
        assert self.ok("--action", action, "--pid", pid, *extra) == ""

    def get_state(self, pid: int) -> str:
        return self.ok("--get-state", "--pid", pid)

    def error(self, code: int, *args: str | int) -> str:
        """Run a failing command: its exit status and its one stderr line."""
        run = self.ckpt(*args)
        assert (run.returncode, run.stdout, run.stderr.count("\n")) == (code, "", 1), run
        return run.stderr.rstrip("\n")

    def files(self, sub: str) -> list[str]:
        path = self.state / sub
        return sorted(p.name for p in path.iterdir()) if path.exists() else []

    def inject(self, name: str) -> Path:
        path = self.state / "inject" / name
        path.touch()
        return path

    def nvml(self) -> list[list[object]]:
        env = self.env() | {"LD_LIBRARY_PATH": str(self.build)}
        run = subprocess.run(
            [sys.executable, "-c", NVML_PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=True,
        )
        result: list[list[object]] = json.loads(run.stdout)
        return result

    def close(self) -> None:
        reap(self.jobs)


@pytest.fixture
def bed(fake_build: Path, tmp_path: Path) -> Iterator[Bed]:
    b = Bed(fake_build, tmp_path / "nvml")
    yield b
    b.close()


# ---- the command line ----


def test_help_lists_the_real_tools_operations(bed: Bed) -> None:
    for flag in ("--help", "-h"):
        text = bed.ok(flag)
        for line in (
            "--get-state --pid <pid>",
            "--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>]",
            "--toggle --pid <pid>",
            "--get-restore-tid --pid <pid>",
            "--pid|-p <pid>",
            "--timeout|-t <timeout>",
            "--help|-h",
        ):
            assert f"\n{line}\n" in text


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ((), "usage: cuda-checkpoint"),
        (("--get-state",), "usage: cuda-checkpoint"),
        (("--action", "freeze", "--pid", "1"), "--action: expected lock, checkpoint, restore or"),
        (("--get-state", "--toggle", "--pid", "1"), "give one operation"),
        (("--get-state", "--pid", "x"), '--pid: expected a process ID, got "x"'),
        (("--action", "lock", "-p", "1", "-t", "-5"), '--timeout: expected milliseconds, got "-5"'),
    ],
)
def test_bad_command_lines_exit_1(bed: Bed, args: tuple[str, ...], why: str) -> None:
    run = bed.ckpt(*args)
    assert run.returncode == INVALID_VALUE
    assert run.stderr.startswith("cuda-checkpoint: ")
    assert why in run.stderr


# ---- the state machine ----


def test_suspend_and_resume_step_by_step(bed: Bed) -> None:
    job = bed.job(0, "3G")
    pid = str(job.pid)
    assert bed.get_state(job.pid) == "running\n"
    assert bed.files("alloc") == [pid]
    assert bed.nvml() == [[3 * GIB, [job.pid]], [0, []]]

    bed.act("lock", job.pid, "--timeout", 1000)
    assert bed.get_state(job.pid) == "locked\n"
    assert bed.files("alloc") == [pid], "a locked process still holds its memory"
    assert (bed.state / "checkpoint" / pid).read_text().startswith("locked ")

    bed.act("checkpoint", job.pid)
    assert bed.get_state(job.pid) == "checkpointed\n"
    assert (bed.files("alloc"), bed.files("checkpointed")) == ([], [pid])
    assert bed.nvml() == [[0, []], [0, []]], "the memory left the GPU"

    bed.act("restore", job.pid)
    assert bed.get_state(job.pid) == "locked\n"
    assert (bed.files("alloc"), bed.files("checkpointed")) == ([pid], [])
    assert bed.nvml() == [[3 * GIB, [job.pid]], [0, []]]

    bed.act("unlock", job.pid)
    assert bed.get_state(job.pid) == "running\n"
    assert bed.files("checkpoint") == [".lock"], "running is the absence of a state file"
    assert bed.ok("--get-restore-tid", "-p", job.pid) == f"{job.pid}\n"
    assert job.stop() == -signal.SIGTERM
    assert bed.files("alloc") == []


def test_toggle_suspends_then_resumes(bed: Bed) -> None:
    job = bed.job(1, "1G")
    assert bed.ok("--toggle", "--pid", job.pid) == ""
    assert bed.get_state(job.pid) == "checkpointed\n"
    assert bed.files("alloc") == []
    assert bed.ok("--toggle", "-p", job.pid) == ""
    assert bed.get_state(job.pid) == "running\n"
    assert bed.files("alloc") == [str(job.pid)]


def test_every_allocation_of_the_process_moves_and_only_its_own(bed: Bed) -> None:
    job = bed.job(0, "1G")
    other = bed.job(0, "1G")
    (bed.state / "alloc" / "second").write_text(f"1 {job.pid} 2G\n")
    bed.ok("--toggle", "--pid", job.pid)
    assert bed.files("checkpointed") == sorted([str(job.pid), "second"])
    assert bed.files("alloc") == [str(other.pid)]
    assert bed.nvml() == [[GIB, [other.pid]], [0, []]]
    bed.ok("--toggle", "--pid", job.pid)
    assert bed.files("alloc") == sorted([str(job.pid), str(other.pid), "second"])


# Per state: actions that are refused, with what they needed.
WRONG = [
    ("running", "checkpoint", "locked"),
    ("running", "restore", "checkpointed"),
    ("running", "unlock", "locked"),
    ("locked", "lock", "running"),
    ("locked", "restore", "checkpointed"),
    ("checkpointed", "lock", "running"),
    ("checkpointed", "checkpoint", "locked"),
    ("checkpointed", "unlock", "locked"),
]
DOING = {
    "lock": "locking",
    "checkpoint": "checkpointing",
    "restore": "restoring",
    "unlock": "unlocking",
}


@pytest.mark.parametrize(("state", "action", "needed"), WRONG)
def test_action_in_the_wrong_state_fails_and_changes_nothing(
    bed: Bed, state: str, action: str, needed: str
) -> None:
    job = bed.job(0, "1G")
    for step in {"running": [], "locked": ["lock"], "checkpointed": ["lock", "checkpoint"]}[state]:
        bed.act(step, job.pid)
    files = (bed.files("alloc"), bed.files("checkpointed"))
    assert bed.error(ILLEGAL_STATE, "--action", action, "--pid", job.pid) == (
        f"Error {DOING[action]} CUDA in process ID {job.pid}: {ILLEGAL} "
        f"(cannot {action}: process {job.pid} is {state}, not {needed})"
    )
    assert bed.get_state(job.pid) == f"{state}\n"
    assert (bed.files("alloc"), bed.files("checkpointed")) == files


def test_toggle_of_a_locked_process_fails(bed: Bed) -> None:
    job = bed.job(0, "1G")
    bed.act("lock", job.pid)
    assert bed.error(ILLEGAL_STATE, "--toggle", "--pid", job.pid) == (
        f"Error toggling CUDA in process ID {job.pid}: {ILLEGAL} "
        f"(cannot toggle: process {job.pid} is locked, not running or checkpointed)"
    )
    assert bed.get_state(job.pid) == "locked\n"


# ---- processes that are not there, or not CUDA processes ----


def test_dead_zombie_and_non_cuda_processes(bed: Bed) -> None:
    killed = bed.job(0, "1G")
    assert killed.stop(signal.SIGKILL) == -signal.SIGKILL
    assert bed.files("alloc") == [str(killed.pid)], "SIGKILL leaves a stale file"
    for args in (("--get-state",), ("--toggle",), ("--action", "lock")):
        doing = {"--get-state": "getting the state of", "--toggle": "toggling"}.get(
            args[0], "locking"
        )
        assert bed.error(INVALID_VALUE, *args, "--pid", killed.pid) == (
            f'Error {doing} CUDA in process ID {killed.pid}: "invalid argument" '
            f"(no such process {killed.pid})"
        )

    zombie = bed.job(1, "1G")
    zombie.proc.kill()
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    assert "(no such process" in bed.error(INVALID_VALUE, "--get-state", "--pid", zombie.pid)
    zombie.proc.wait()

    me = os.getpid()  # alive, without an allocation
    assert bed.error(NOT_INITIALIZED, "--toggle", "--pid", me) == (
        f'Error toggling CUDA in process ID {me}: "initialization error" '
        f"(process {me} is not a CUDA process)"
    )


def test_a_job_ended_while_checkpointed_leaves_nothing_that_counts(bed: Bed) -> None:
    termed = bed.job(0, "1G")
    killed = bed.job(0, "2G")
    for job in (termed, killed):
        bed.ok("--toggle", "--pid", job.pid)
    assert termed.stop() == -signal.SIGTERM, "gpu-alloc's unlink of a moved file is harmless"
    assert killed.stop(signal.SIGKILL) == -signal.SIGKILL
    assert bed.files("checkpointed") == sorted([str(termed.pid), str(killed.pid)])
    assert bed.nvml() == [[0, []], [0, []]]
    assert "(no such process" in bed.error(INVALID_VALUE, "--toggle", "--pid", killed.pid)
    # A later job restores into the whole GPU: the stale checkpointed files take no room.
    job = bed.job(0, "4G")
    bed.ok("--toggle", "--pid", job.pid)
    bed.ok("--toggle", "--pid", job.pid)
    assert bed.get_state(job.pid) == "running\n"


def test_a_state_left_by_a_dead_process_with_the_same_pid_is_ignored(bed: Bed) -> None:
    job = bed.job(0, "1G")
    (bed.state / "checkpoint").mkdir()
    (bed.state / "checkpoint" / str(job.pid)).write_text("failed 1\n")  # another start time
    assert bed.get_state(job.pid) == "running\n"
    bed.ok("--toggle", "--pid", job.pid)
    assert bed.get_state(job.pid) == "checkpointed\n"


# ---- restore and GPU memory ----


def test_restore_out_of_memory_fails_for_good(bed: Bed) -> None:
    job = bed.job(0, "3G")
    bed.ok("--toggle", "--pid", job.pid)
    intruder = bed.job(0, "2G")  # took the memory meanwhile: 2 GiB free, 3 GiB needed
    assert bed.error(OUT_OF_MEMORY, "--action", "restore", "--pid", job.pid) == (
        f'Error restoring CUDA in process ID {job.pid}: "out of memory" '
        f"(restore of process {job.pid} needs {3 * GIB} bytes on GPU 0, {2 * GIB} free; "
        "the process is now failed)"
    )
    assert bed.get_state(job.pid) == "failed\n"
    assert bed.files("checkpointed") == [str(job.pid)]
    assert bed.nvml() == [[2 * GIB, [intruder.pid]], [0, []]]

    assert intruder.stop() == -signal.SIGTERM  # the memory is free again: too late
    why = f"(cannot restore: process {job.pid} failed an earlier restore; only killing it helps)"
    assert bed.error(OPERATING_SYSTEM, "--action", "restore", "--pid", job.pid) == (
        f"Error restoring CUDA in process ID {job.pid}: "
        f'"OS call failed or operation not supported on this OS" {why}'
    )
    assert bed.error(OPERATING_SYSTEM, "--toggle", "--pid", job.pid).endswith(why)
    for action in ("lock", "checkpoint", "unlock"):
        assert bed.error(ILLEGAL_STATE, "--action", action, "--pid", job.pid).endswith(
            f"(cannot {action}: process {job.pid} failed an earlier restore; only killing it helps)"
        )
    assert bed.get_state(job.pid) == "failed\n"
    assert job.stop() == -signal.SIGTERM, "killing it is what helps"


def test_toggle_back_runs_out_of_memory_on_any_gpu_of_the_process(bed: Bed) -> None:
    job = bed.job(0, "1G")
    (bed.state / "alloc" / "second").write_text(f"1 {job.pid} 3G\n")
    bed.ok("--toggle", "--pid", job.pid)
    bed.job(1, "2G")
    assert bed.error(OUT_OF_MEMORY, "--toggle", "--pid", job.pid).endswith(
        f"needs {3 * GIB} bytes on GPU 1, {2 * GIB} free; the process is now failed)"
    )
    assert bed.get_state(job.pid) == "failed\n"


def test_restore_counts_only_live_allocations(bed: Bed) -> None:
    job = bed.job(0, "2G")
    bed.ok("--toggle", "--pid", job.pid)
    dead = bed.job(0, "4G")
    dead.stop(signal.SIGKILL)  # its file stays, and does not count
    alloc = bed.state / "alloc"
    (alloc / "unknown").write_text(f"0 {os.getpid()} -\n")  # live, bytes unknown: counts 0
    (alloc / ".partial").write_text(f"0 {os.getpid()} 4G\n")  # a dot file: a write in progress
    (alloc / "near-full").write_text(f"0 {os.getpid()} 2G\n")  # exactly 2 GiB left
    bed.ok("--toggle", "--pid", job.pid)
    assert bed.get_state(job.pid) == "running\n"


# ---- failure injection ----


def test_lock_timeout_waits_the_timeout_then_fails_and_stays_running(bed: Bed) -> None:
    job = bed.job(0, "1G")
    bed.inject("lock-timeout")
    started = time.monotonic()
    assert bed.error(TIMED_OUT, "--action", "lock", "--pid", job.pid, "--timeout", 300) == (
        f'Error locking CUDA in process ID {job.pid}: "the operation timed out" '
        f"(lock of process {job.pid} timed out after 300 ms (inject/lock-timeout))"
    )
    assert time.monotonic() - started >= 0.3
    assert bed.get_state(job.pid) == "running\n"
    assert bed.error(TIMED_OUT, "--toggle", "--pid", job.pid, "-t", 50).startswith(
        f"Error toggling CUDA in process ID {job.pid}:"
    )
    assert (bed.get_state(job.pid), bed.files("alloc")) == ("running\n", [str(job.pid)])


def test_lock_completes_once_the_injected_wait_is_removed(bed: Bed) -> None:
    job = bed.job(0, "1G")
    blocker = bed.inject(f"lock-timeout-{job.pid}")
    lock = subprocess.Popen(
        [str(bed.build / "cuda-checkpoint"), "--action", "lock", "-p", str(job.pid), "-t", "20000"],
        env=bed.env(),
    )
    blocker.unlink()  # the GPU work drained
    assert lock.wait(timeout=TIMEOUT) == 0
    assert bed.get_state(job.pid) == "locked\n"


def test_lock_timeout_for_one_pid_spares_the_others(bed: Bed) -> None:
    stuck = bed.job(0, "1G")
    free = bed.job(0, "1G")
    bed.inject(f"lock-timeout-{stuck.pid}")
    bed.act("lock", free.pid, "--timeout", 50)
    assert "timed out after 50 ms" in bed.error(
        TIMED_OUT, "--action", "lock", "--pid", stuck.pid, "--timeout", 50
    )


@pytest.mark.parametrize("scope", ["all", "pid"])
def test_refuse_fails_every_action_but_get_state_answers(bed: Bed, scope: str) -> None:
    job = bed.job(0, "1G")
    spared = bed.job(0, "1G")
    bed.inject("refuse" if scope == "all" else f"refuse-{job.pid}")
    for args in (("--toggle",), *(("--action", a) for a in DOING)):
        message = bed.error(NOT_SUPPORTED, *args, "--pid", job.pid)
        assert message.endswith(
            f'"operation not supported" (process {job.pid} cannot be checkpointed (inject/refuse))'
        )
    assert (bed.get_state(job.pid), bed.files("checkpoint")) == ("running\n", [])
    spared_run = bed.ckpt("--toggle", "--pid", spared.pid)
    assert spared_run.returncode == (NOT_SUPPORTED if scope == "all" else 0)


def test_restore_oom_injection_fails_a_restore_that_fits(bed: Bed) -> None:
    job = bed.job(0, "1G")
    bed.ok("--toggle", "--pid", job.pid)
    bed.inject("restore-oom")
    assert bed.error(OUT_OF_MEMORY, "--toggle", "--pid", job.pid) == (
        f'Error toggling CUDA in process ID {job.pid}: "out of memory" (restore of process '
        f"{job.pid} ran out of GPU memory (inject/restore-oom); the process is now failed)"
    )
    (bed.state / "inject" / "restore-oom").unlink()
    assert bed.get_state(job.pid) == "failed\n"
    assert bed.error(OPERATING_SYSTEM, "--action", "restore", "--pid", job.pid)


def test_slow_injection_delays_each_action(bed: Bed) -> None:
    job = bed.job(0, "1G")
    bed.inject("slow-0.2")
    started = time.monotonic()
    bed.ok("--toggle", "--pid", job.pid)  # lock and checkpoint: two delays
    assert time.monotonic() - started >= 0.4
    assert bed.get_state(job.pid) == "checkpointed\n"
