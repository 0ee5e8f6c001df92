"""Suspending a GPU job with NVIDIA's cuda-checkpoint, and resuming it: the only module that runs
the tool.

A suspend locks every process of the job before it checkpoints any (CRIU found that otherwise
cuda-checkpoint can hang), and a failure undoes what was done: after a raise the job runs as
before unless the undo itself failed, and then the reason says so. A resume reads each process's
state first, so it is idempotent and is also the recovery after a controller crash in the middle
of a suspend. There is no D-Bus, NVML or systemd here: the controller decides whom to suspend,
freezes and thaws units, and reserves the GPU memory a restore needs.

cuda-checkpoint's output is input from outside: only `MAX_OUTPUT` bytes of each stream are kept
and they are decoded leniently and escaped before they reach a reason; a run that outlasts its
timeout is killed with its process group and reaped, waiting at most `REAP_TIMEOUT` for a process
stuck in the driver. Run as a transient service (`via_systemd`), that service is named and
stopped first (`_stop_service`): killing systemd-run does not end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import re
import shutil
import signal
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpuslice.envsafety import EnvFileChecker
from gpuslice.sizes import format_size
from gpuslice.unitfiles import printable

if TYPE_CHECKING:
    from gpuslice.config import Config

TOOL_NAME = "cuda-checkpoint"
# Where the driver packages install it, searched after PATH (a unit's PATH may lack the last).
TOOL_LOCATIONS = ("/usr/bin", "/usr/local/bin", "/usr/local/cuda/bin")
# A lock is given `--timeout`; the tool itself is killed this much later if it has not returned.
LOCK_GRACE = 5.0
# --get-state alone took 0.4-7 s for a 2 GiB process on some drivers.
STATE_TIMEOUT = 30.0
# After SIGKILL a tool stuck in the driver (uninterruptible) is not waited for longer than this.
REAP_TIMEOUT = 5.0
# A transient service's stop (systemd's TimeoutStopSec=): SIGTERM, SIGKILL after this, and
# after as long again systemd gives up on a process that does not die; `systemctl stop` is
# waited for that long and a little more.
SERVICE_STOP_TIMEOUT = 5.0
SERVICE_STOP_WAIT = 2 * SERVICE_STOP_TIMEOUT + 5.0
MAX_OUTPUT = 512  # bytes kept of each stream; the rest is read and dropped
MAX_MESSAGE = 200  # characters of the tool's message in a reason
SYSTEMCTL_NOT_LOADED = 5  # `systemctl stop` of a unit systemd does not know (gone, or never made)

RUNNING = "running"
LOCKED = "locked"
CHECKPOINTED = "checkpointed"
FAILED = "failed"  # a restore failed: the process can never run on the GPU again
STATES = (RUNNING, LOCKED, CHECKPOINTED, FAILED)

_MEMINFO_MAX = 1 << 16


@dataclass(frozen=True)
class CheckpointSettings:
    """What a suspend and a resume need from config.yaml, so that this module does not depend on
    the whole `Config`."""

    tool: str  # configured path, "" = look up PATH
    lock_timeout: float
    checkpoint_timeout: float
    restore_timeout: float
    host_memory_margin: int  # bytes
    # run the tool as a transient systemd service (systemd-run), outside the controller's
    # sandbox: it needs what the controller is denied (no capabilities, a read-only system)
    via_systemd: bool = False
    # run it only when root alone can change it (`check_tool`): the controller's settings
    # (tests run stub tools from their temporary directories)
    root_only: bool = False

    @classmethod
    def from_config(cls, config: Config) -> CheckpointSettings:
        return cls(
            tool=config.cuda_checkpoint,
            lock_timeout=config.checkpoint_lock_timeout,
            checkpoint_timeout=config.checkpoint_timeout,
            restore_timeout=config.restore_timeout,
            host_memory_margin=config.suspend_host_memory_margin,
            via_systemd=True,
            root_only=True,
        )


class CheckpointError(Exception):
    """A suspend or resume failed. `reason` is one line for the journal and `gpuslice status`;
    `lost` names the processes whose restore failed: they cannot run again and must be
    stopped; `restored` those a resume restored all the same (their memory is back on a GPU:
    frozen again, the unit would hold it); `unsettled` those a resume did not bring back to
    running (lost, left checkpointed or locked, their state unread while they live): their
    CUDA calls may block for good, so an undo that leaves any must stop the unit too."""

    def __init__(
        self,
        reason: str,
        lost: Sequence[int] = (),
        restored: Sequence[int] = (),
        unsettled: Sequence[int] = (),
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.lost = tuple(lost)
        self.restored = tuple(restored)
        self.unsettled = tuple(unsettled)


@dataclass(frozen=True)
class Resumed:
    """What a resume did, so that nobody says more: `restored` the checkpointed processes
    whose memory went back to a GPU, `unlocked` the locked ones only unlocked (a suspend cut
    short). Both empty: cuda-checkpoint found nothing to do (every process running, exited,
    or none it could read), and "restored" would be a claim nothing backs."""

    seconds: float
    restored: tuple[int, ...] = ()
    unlocked: tuple[int, ...] = ()


# ---------------------------------------------------------------------------------------------
# finding the tool


def _is_executable_file(path: str) -> bool:
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return False
    return stat.S_ISREG(mode) and os.access(path, os.X_OK)


def find_tool(configured: str, *, locations: Sequence[str] = TOOL_LOCATIONS) -> str | None:
    """The cuda-checkpoint to run: the configured absolute path if it is an executable regular
    file (never a search instead: an admin who named one meant it), else with `configured` ""
    the first found on PATH or in `locations`; None when there is none. A relative PATH match
    is skipped: a root daemon must not run whatever its working directory holds."""
    if configured:
        return configured if os.path.isabs(configured) and _is_executable_file(configured) else None
    found = shutil.which(TOOL_NAME)
    if found is not None and os.path.isabs(found) and _is_executable_file(found):
        return found
    for directory in locations:
        path = os.path.join(directory, TOOL_NAME)
        if _is_executable_file(path):
            return path
    return None


def require_tool(
    configured: str, *, locations: Sequence[str] = TOOL_LOCATIONS, root_only: bool = False
) -> str:
    """`find_tool`, or CheckpointError saying why there is none (the job is then stopped), or
    why it is not run (`check_tool`, with `root_only`)."""
    tool = find_tool(configured, locations=locations)
    if tool is not None:
        check_tool(tool, root_only)
        return tool
    if configured:
        raise CheckpointError(f"cuda_checkpoint {printable(configured)} is not an executable file")
    raise CheckpointError(f"{TOOL_NAME} is not installed")


def check_tool(tool: str, root_only: bool) -> None:
    """CheckpointError when `root_only` and someone other than root can change the tool.
    gpuslice runs it as root: a cuda-checkpoint that an admin cloned and built as a user,
    or put in a directory a group can write, was any such user's way to root at the next
    suspend or resume."""
    if not root_only:
        return
    # a path, not an EnvironmentFile= value: a `%` in it is no systemd specifier, a `*` or
    # `[` no wildcard
    refusal = EnvFileChecker().path_refusal(tool)
    if refusal is not None:
        raise CheckpointError(
            f"{printable(tool)} is not run: gpuslice runs it as root, and someone other than "
            f"root can change it ({refusal.reason}); give it to root, or set cuda_checkpoint "
            "to a copy only root can change"
        )


# ---------------------------------------------------------------------------------------------
# running it


class _ToolFailed(Exception):
    """One run failed; `detail` is the tool's message (escaped) or what happened to it.
    `timed_out`: it was killed, so what it did is unknown; `not_run`: it never started."""

    def __init__(self, detail: str, *, timed_out: bool = False, not_run: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.timed_out = timed_out
        self.not_run = not_run


async def _drain(stream: asyncio.StreamReader | None) -> bytes:
    """The first `MAX_OUTPUT` bytes; the rest is read and dropped so the tool never blocks."""
    kept = bytearray()
    if stream is None:
        return b""
    while chunk := await stream.read(1 << 16):
        if len(kept) < MAX_OUTPUT:
            kept += chunk[: MAX_OUTPUT - len(kept)]
    return bytes(kept)


# The tool's own error line: `Error locking CUDA in process ID 123: "operation not supported"`;
# the reason names the action and the PID already, so only the CUDA error (and any more) is kept.
_TOOL_ERROR = re.compile(r'Error [a-z]+ CUDA in process ID [0-9]+: "([^"]*)"(.*)', re.ASCII)


def _message(data: bytes) -> str:
    """Output as one escaped line: white space runs become one space."""
    text = " ".join(data.decode("utf-8", "replace").split())
    match = _TOOL_ERROR.fullmatch(text)
    if match is not None:
        text = match.group(1) + match.group(2)
    return printable(text, MAX_MESSAGE)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    # start_new_session made the tool a group leader: whatever it started goes too
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


_runs = itertools.count(1)


def _service_name(args: Sequence[str]) -> str:
    """The transient service of one run: `gpuslice-checkpoint-ACTION-PID-CONTROLLER-N.service`,
    unique to this controller's process (a stuck one an earlier controller left cannot clash)
    and named so that the journal says what ran. Only [a-z0-9-]: nothing to escape, under
    100 characters."""
    action = args[1] if args[0] == "--action" else args[0].lstrip("-")
    pid = args[args.index("--pid") + 1] if "--pid" in args[:-1] else "0"
    return f"gpuslice-checkpoint-{action}-{pid}-{os.getpid()}-{next(_runs)}.service"


def _command(tool: str, args: Sequence[str], timeout: float, service: str | None) -> list[str]:
    """The tool's command line; with a `service` name: run as that transient service, which
    systemd itself ends after `timeout` (a backstop should the controller die), its output
    piped back. Killing the client would not end the service: `_stop_service` does."""
    if service is None:
        return [tool, *args]
    return [
        "systemd-run",
        "--quiet",
        "--wait",
        "--pipe",
        "--collect",
        "--service-type=exec",
        f"--unit={service}",
        "--description=gpuslice: cuda-checkpoint " + " ".join(args),
        f"--property=RuntimeMaxSec={math.ceil(timeout)}",
        f"--property=TimeoutStopSec={SERVICE_STOP_TIMEOUT:g}",
        "--",
        tool,
        *args,
    ]


async def _stop_service(service: str) -> str:
    """Stop a run's transient service after its client was killed, and wait until it is down:
    a lock that ends after the undo would leave the job locked with nobody responsible for
    it. "" when it is down (or was never started, or has ended and been collected); else
    what to add to the reason."""
    problem = await _systemctl_stop([service])
    return f"; its service {service} {problem}" if problem else ""


async def _systemctl_stop(units: Sequence[str]) -> str:
    """`systemctl stop` of these units (globs match the loaded ones), waited for until they
    are down: "" when they are (or none was loaded); else what went wrong, in words."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "systemctl",
            "stop",
            "--quiet",
            "--",
            *units,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except (OSError, ValueError) as e:
        return f"could not be stopped: {printable(str(e), MAX_MESSAGE)}"
    try:
        err, code = await asyncio.wait_for(
            asyncio.gather(_drain(proc.stderr), proc.wait()), SERVICE_STOP_WAIT
        )
    except BaseException as e:
        _kill_group(proc)
        _close_pipes(proc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), REAP_TIMEOUT)
        _close_transport(proc)
        if isinstance(e, TimeoutError):
            return f"was not down {SERVICE_STOP_WAIT:g} s after a stop"
        raise
    if code in (0, SYSTEMCTL_NOT_LOADED):
        return ""
    detail = _message(err) or f"exit status {code}"
    return f"could not be stopped: {detail}"


# Names one `systemctl stop` is given at most: a unit's processes may be thousands, four
# patterns each, and one command line is limited (E2BIG).
MAX_STOP_NAMES = 512
# The actions whose run changes a process's state (a --get-state changes nothing).
_CHANGING = ("lock", "checkpoint", "restore", "unlock")


async def stop_earlier_runs(pids: Sequence[int]) -> str:
    """Stop the runs on these processes that an earlier controller left as transient
    services, and wait until they are down: killed in the middle of a suspend or resume,
    its systemd-run clients died with it but their services did not, and a lock, checkpoint
    or restore that ended after the next controller's resume had read the process left it
    locked or checkpointed (its CUDA calls blocked for good) while it counted as resumed, or
    ran a second restore beside one under way. Only runs named for these PIDs (`_service_name`):
    another unit's runs of this controller are never touched. "" when none is left; else
    what went wrong, in words."""
    names = [f"gpuslice-checkpoint-{a}-{pid}-*.service" for pid in _unique(pids) for a in _CHANGING]
    for first in range(0, len(names), MAX_STOP_NAMES):  # a unit of 10,000 processes: E2BIG
        problem = await _systemctl_stop(names[first : first + MAX_STOP_NAMES])
        if problem:
            return problem
    return ""


async def _call(tool: str, args: Sequence[str], timeout: float, via_systemd: bool = False) -> bytes:
    """Run the tool once; its kept stdout, or _ToolFailed. Killed and reaped on timeout and on
    cancellation, and its transient service (`via_systemd`) stopped: what the reason says
    it did, it did, and nothing more is done later."""
    service = _service_name(args) if via_systemd else None
    try:
        proc = await asyncio.create_subprocess_exec(
            *_command(tool, args, timeout, service),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except FileNotFoundError:
        if via_systemd:  # what was not found is systemd-run: the tool was found before
            raise _ToolFailed(
                f"systemd-run not found: {TOOL_NAME} cannot be run as a transient service",
                not_run=True,
            ) from None
        raise _ToolFailed(
            f"{TOOL_NAME} is not installed ({printable(tool)} not found)", not_run=True
        ) from None
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise _ToolFailed(
            f"{TOOL_NAME} {printable(tool)} could not be run: {printable(reason)}", not_run=True
        ) from None
    try:
        out, err, code = await asyncio.wait_for(
            asyncio.gather(_drain(proc.stdout), _drain(proc.stderr), proc.wait()), timeout
        )
    except BaseException as e:  # TimeoutError, or the caller cancelled: never leave it running
        _kill_group(proc)
        # systemd-run's death does not end the service, which holds our pipes (--pipe)
        stopped = await _stop_service(service) if service is not None else ""
        _close_pipes(proc)
        try:
            await asyncio.wait_for(proc.wait(), REAP_TIMEOUT)
            gone = stopped
        except TimeoutError:
            gone = f", and it had not exited {REAP_TIMEOUT:g} s after SIGKILL{stopped}"
        _close_transport(proc)
        if isinstance(e, TimeoutError):
            raise _ToolFailed(
                f"{TOOL_NAME} did not return within {timeout:g} s and was killed{gone}",
                timed_out=True,
            ) from None
        raise
    if code == 0:
        return out
    detail = _message(err) or _message(out)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        detail = f"{detail} (killed by {name})" if detail else f"killed by {name}"
    raise _ToolFailed(detail or f"exit status {code}")


def _close_pipes(proc: asyncio.subprocess.Process) -> None:
    """Close our ends of a killed run's pipes, before it is reaped. Its readers were
    cancelled, and a process outside its group (the transient service) may hold the other
    ends: asyncio's wait() waits for the pipes too, so the reap waited REAP_TIMEOUT and
    said the run "had not exited" when it had, and the pipes and transport stayed open as
    long as the controller ran (tests saw them closed with their loop: ResourceWarning).
    The pipes alone: the transport's close() polls the process too, and one already dead
    was reaped there, behind asyncio's child watcher, which then logged a warning and took
    255 for its exit status (`_close_transport` follows the reap)."""
    transport = getattr(proc, "_transport", None)
    if transport is None:
        return
    for fd in (0, 1, 2):
        pipe = transport.get_pipe_transport(fd)
        if pipe is not None:
            pipe.close()


def _close_transport(proc: asyncio.subprocess.Process) -> None:
    """After the reap (or giving up on it): the transport itself, which asyncio's Process
    does not close (else a ResourceWarning when it is collected)."""
    transport = getattr(proc, "_transport", None)
    if transport is not None:
        transport.close()


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        pass
    return True


def _says_timeout(detail: str) -> bool:
    text = detail.lower()
    return "timeout" in text or "timed out" in text


class _LockHung(CheckpointError):
    """The lock was killed: the process may be locked after all."""


async def _lock(tool: str, pid: int, s: CheckpointSettings) -> None:
    ms = max(1, round(s.lock_timeout * 1000))
    args = ("--action", "lock", "--pid", str(pid), "--timeout", str(ms))
    try:
        await _call(tool, args, s.lock_timeout + LOCK_GRACE, s.via_systemd)
    except _ToolFailed as e:
        if e.timed_out:
            raise _LockHung(
                f"lock of PID {pid} timed out after {s.lock_timeout:g} s: {e.detail}"
            ) from None
        if _says_timeout(e.detail):  # the tool's own --timeout: the process was left running
            raise CheckpointError(
                f"lock of PID {pid} timed out after {s.lock_timeout:g} s"
            ) from None
        raise CheckpointError(_refused("lock", pid, e)) from None


async def _checkpoint(tool: str, pid: int, s: CheckpointSettings) -> None:
    try:
        await _call(
            tool, ("--action", "checkpoint", "--pid", str(pid)), s.checkpoint_timeout, s.via_systemd
        )
    except _ToolFailed as e:
        if e.timed_out:
            raise CheckpointError(
                f"checkpoint of PID {pid} timed out after {s.checkpoint_timeout:g} s: {e.detail}"
            ) from None
        raise CheckpointError(_refused("checkpoint", pid, e)) from None


def _refused(action: str, pid: int, e: _ToolFailed) -> str:
    if e.not_run:  # not installed, not executable: nothing about the PID
        return e.detail
    return f"{TOOL_NAME} refused to {action} PID {pid}: {e.detail}"


async def _restore(tool: str, pid: int, s: CheckpointSettings) -> None:
    """Raises CheckpointError naming the process as lost: a failed restore is permanent."""
    try:
        await _call(
            tool, ("--action", "restore", "--pid", str(pid)), s.restore_timeout, s.via_systemd
        )
    except _ToolFailed as e:
        if "out of memory" in e.detail.lower():
            what = f"restore of PID {pid} ran out of GPU memory"
        elif e.timed_out:
            what = f"restore of PID {pid} timed out after {s.restore_timeout:g} s: {e.detail}"
        else:
            what = f"restore of PID {pid} failed: {e.detail}"
        raise CheckpointError(
            f"{what}; the process cannot be resumed and must be stopped", lost=(pid,)
        ) from None


async def _unlock(tool: str, pid: int, s: CheckpointSettings) -> None:
    try:
        await _call(
            tool,
            ("--action", "unlock", "--pid", str(pid)),
            s.lock_timeout + LOCK_GRACE,
            s.via_systemd,
        )
    except _ToolFailed as e:
        raise CheckpointError(f"PID {pid} could not be unlocked: {e.detail}") from None


class StateUnread(CheckpointError):
    """`get_state` got no answer of the tool: it did not return in time, or did not run (not
    installed, systemd-run failing as systemd re-executes), or exited 0 with words that name
    no state (another version's). Unlike the tool's refusal (what it says of a process with
    no CUDA), nothing is known of the process: it may be checkpointed."""


# What systemd-run itself says when it could not run the tool (run.c, bus_log_connect_error):
# its exit status is 1, as the tool's may be; its words are its own.
_SYSTEMD_RUN_FAILED = (
    "Failed to start transient service unit",
    "Failed to connect to ",
    "Failed to create bus connection",
)


async def get_state(tool: str, pid: int, via_systemd: bool = False) -> str:
    """One of `STATES`; CheckpointError when the tool refuses (StateUnread when it gave no
    answer, or one that names no state)."""
    try:
        out = await _call(tool, ("--get-state", "--pid", str(pid)), STATE_TIMEOUT, via_systemd)
    except _ToolFailed as e:
        unread = e.timed_out or e.not_run
        unread |= via_systemd and e.detail.startswith(_SYSTEMD_RUN_FAILED)
        error = StateUnread if unread else CheckpointError
        raise error(f"the state of PID {pid} could not be read: {e.detail}") from None
    lines = [line for line in out.decode("utf-8", "replace").splitlines() if line.strip()]
    words = lines[0].split() if lines else []
    state = words[-1].lower() if words else ""  # "running", or "State: running"
    if state not in STATES:
        shown = printable(" ".join(words), 60)
        raise StateUnread(f'{TOOL_NAME} gave an unknown state for PID {pid}: "{shown}"')
    return state


# ---------------------------------------------------------------------------------------------
# suspend and resume


def _unique(pids: Sequence[int]) -> list[int]:
    for pid in pids:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"not a PID: {pid!r}")
    return list(dict.fromkeys(pids))


# Whether a PID is still a process of the job, asked right before each run of the tool on it
# (Ladder: its cgroup is the unit's). Asked once up front, a PID freed meanwhile (a frozen
# process dies of SIGKILL; a thawed one may exit) and given to another unit's process was
# acted on minutes later, after the runs on the PIDs before it and the stop of an earlier
# controller's runs: that process restored or unlocked beside its own ladder's work, or
# locked. The tool takes a PID, not a pidfd: a reuse between the look and the tool's own
# start (milliseconds) is left.
Owned = Callable[[int], bool]


def _any_process(pid: int) -> bool:
    return True


async def _settle(
    tool: str, pids: Sequence[int], s: CheckpointSettings, owned: Owned = _any_process
) -> tuple[CheckpointError | None, Resumed]:
    """Bring every process back to running: restore the checkpointed ones, then unlock the
    locked ones, in the order a suspend did its steps. After a restore fails, the other
    checkpointed processes are left so (a second out-of-memory restore would lose them too);
    the rest goes on. A PID that is not `owned` when its turn comes is left alone, as one
    that has exited (it is gone from the job: nothing of the job's is there to bring back).
    Returns the problems (None when there were none; `restored` and `unsettled` set on them)
    and what was done (its `seconds` 0: the callers time their whole step)."""
    problems: list[str] = []
    lost: list[int] = []
    unsettled: list[int] = []  # not known back to running
    restored: list[int] = []
    locked: list[int] = []
    to_unlock: list[int] = []
    for pid in pids:
        if not owned(pid):
            continue
        try:
            state = await get_state(tool, pid, s.via_systemd)
        except CheckpointError as e:
            if _pid_exists(pid):
                problems.append(e.reason)
                unsettled.append(pid)
            continue  # a process that has exited needs nothing
        if state == FAILED:
            lost.append(pid)
            problems.append(
                f"PID {pid} cannot be resumed: an earlier restore failed (state failed); it "
                "must be stopped"
            )
        elif state == CHECKPOINTED and lost:
            unsettled.append(pid)
            problems.append(f"PID {pid} left checkpointed: a restore failed before it")
        elif state == CHECKPOINTED:
            if not owned(pid):  # asked once more: the state's read may take seconds
                continue
            try:
                await _restore(tool, pid, s)
                restored.append(pid)
                to_unlock.append(pid)
            except CheckpointError as e:
                lost.extend(e.lost)
                problems.append(e.reason)
        elif state == LOCKED:
            to_unlock.append(pid)
    for pid in to_unlock:
        if not owned(pid):
            continue
        try:
            await _unlock(tool, pid, s)
            if pid not in restored:
                locked.append(pid)
        except CheckpointError as e:
            unsettled.append(pid)
            problems.append(e.reason)
    done = Resumed(0.0, tuple(restored), tuple(locked))
    if not problems:
        return None, done
    left = dict.fromkeys([*lost, *unsettled])  # lost first, each once
    return CheckpointError("; ".join(problems), lost, restored, tuple(left)), done


async def suspend(
    tool: str, pids: Sequence[int], s: CheckpointSettings, owned: Owned = _any_process
) -> float:
    """Lock every process, only then checkpoint each: the job's GPU memory moves to host memory
    and its GPU is released. Returns the seconds taken. On a failure what was done is undone
    and CheckpointError names the process and why (and what could not be undone, if anything):
    a PID no longer `owned` when its lock or checkpoint comes is one. A cancelled suspend
    kills the running tool and undoes nothing: call `resume` for that."""
    start = time.monotonic()
    todo = _unique(pids)
    locked: list[int] = []  # and a lock that was killed: it may have locked
    try:
        for pid in todo:
            _require_owned(pid, owned)
            try:
                await _lock(tool, pid, s)
            except _LockHung as e:
                locked.append(pid)
                raise CheckpointError(e.reason) from None
            locked.append(pid)
        for pid in todo:
            _require_owned(pid, owned)
            await _checkpoint(tool, pid, s)
    except CheckpointError as e:
        # A refused step changed nothing; every locked process is found as it is and brought
        # back, a timed-out checkpoint's too.
        undo, _ = await _settle(tool, locked, s, owned)
        if undo is None:
            raise
        # one left locked or checkpointed blocks in its next CUDA call for good: lost too
        raise CheckpointError(f"{e.reason}; and {undo.reason}", undo.unsettled) from None
    return time.monotonic() - start


def _require_owned(pid: int, owned: Owned) -> None:
    if not owned(pid):
        raise CheckpointError(f"PID {pid} is no longer a process of it")


async def resume(
    tool: str, pids: Sequence[int], s: CheckpointSettings, owned: Owned = _any_process
) -> Resumed:
    """Bring every process back as `get_state` finds it: checkpointed ones are restored, then
    every locked one is unlocked; running ones and processes that have exited are left alone.
    Idempotent, so it is also the recovery after a crash in the middle of a suspend. Returns
    the seconds taken and which processes were restored or unlocked (none: nothing was to be
    done); CheckpointError lists every problem, `lost` the processes whose restore failed
    (fatal: they must be stopped), `restored` those restored all the same. `owned`: see
    `_settle`."""
    start = time.monotonic()
    problem, done = await _settle(tool, _unique(pids), s, owned)
    if problem is not None:
        raise problem
    return Resumed(time.monotonic() - start, done.restored, done.unlocked)


# ---------------------------------------------------------------------------------------------
# host memory


def host_memory_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes; None when it cannot be read (then nothing is suspended)."""
    try:
        with meminfo.open("rb") as f:
            data = f.read(_MEMINFO_MAX)
    except OSError:
        return None
    for line in data.splitlines():
        fields = line.split()
        if len(fields) in (2, 3) and fields[0] == b"MemAvailable:":
            number = fields[1]
            unit = fields[2] if len(fields) == 3 else b""
            if not (number.isdigit() and number.isascii() and len(number) <= 20):
                return None
            factor = {b"": 1, b"kB": 1024}.get(unit)
            return int(number) * factor if factor is not None else None
    return None


def host_memory_fits(vram: int, s: CheckpointSettings, available: int | None) -> str:
    """The empty string when `vram` can move to host memory and leave the margin; else the
    reason not to suspend."""
    if available is None:
        return "MemAvailable unknown"
    if vram + s.host_memory_margin <= available:
        return ""
    return (
        f"{format_size(vram)} to move but {format_size(available)} of host memory available "
        f"(margin {format_size(s.host_memory_margin)})"
    )
