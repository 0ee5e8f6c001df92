"""A booted systemd in a systemd-nspawn container, for integration tests and the demo.

The tree is a minimal Debian 12 built once by mmdebstrap, cached as tar.zst and unpacked once;
every container boots it with ``--volatile=overlay`` so the tree itself is never written and
many containers can share it. Facts this relies on: /work/shared/notes/systemd-in-a-container.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

SUITE = "bookworm"
# Every runtime dependency must be in the tree: the container has no network.
PACKAGES: tuple[str, ...] = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "python3-dbus-next",
    "python3-yaml",
    "python3-sdnotify",
    "python3-click",
    "python3-prometheus-client",
    "make",
    "procps",
    "iproute2",
    "less",
)
# Units that only slow the boot down or poke at the missing network / console.
MASKED_UNITS: tuple[str, ...] = (
    "getty.target",
    "getty@.service",
    "serial-getty@.service",
    "console-getty.service",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
)
# Host-side commands run by mmdebstrap with the new root as $1. Part of the cache key.
CUSTOMIZE_HOOKS: tuple[str, ...] = (
    'rm -f "$1/etc/hostname"',
    'chroot "$1" passwd -d root',
    *(f'ln -sf /dev/null "$1/etc/systemd/system/{unit}"' for unit in MASKED_UNITS),
)
REPO = Path(__file__).resolve().parents[2]
BOOT_TIMEOUT = 30.0
_names = itertools.count(1)
_runs = itertools.count(1)


def _cgroup_roots() -> tuple[Path, ...]:
    """Hybrid (these machines): cgroup2 at unified/ plus name=systemd; else pure cgroup2."""
    unified = Path("/sys/fs/cgroup/unified")
    if unified.is_dir():
        return (unified, Path("/sys/fs/cgroup/systemd"))
    return (Path("/sys/fs/cgroup"),)


T = TypeVar("T")


class BedError(RuntimeError):
    """The test bed could not be built, booted or driven: a broken environment, never a skip."""


class WaitTimeout(BedError):
    """`wait_until` ran out of time."""


def wait_until(
    predicate: Callable[[], T | None],
    timeout: float,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll `predicate` until it returns a truthy value and return that value.

    Tests wait on observable state rather than sleeping a guessed time; the message names what
    was awaited and the last value seen so a timeout explains itself.
    """
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def cache_dir() -> Path:
    """Where trees are cached: $GPUSLICE_BED_CACHE or /var/cache/gpuslice-bed."""
    return Path(os.environ.get("GPUSLICE_BED_CACHE") or "/var/cache/gpuslice-bed")


def tree_key() -> str:
    """Cache key: changes whenever what goes into the tree changes."""
    text = "\n".join([SUITE, *PACKAGES, *CUSTOMIZE_HOOKS])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TreeTimings:
    """Seconds spent getting the tree; 0.0 where the step was cached."""

    build_s: float
    unpack_s: float


def ensure_tree(directory: Path | None = None) -> tuple[Path, TreeTimings]:
    """Build (if not cached) and unpack (if not unpacked) the tree; return its path.

    A lock file serialises concurrent callers; the tarball and the tree appear under their final
    names only when complete (rename), so an interrupted build is redone, not reused.
    """
    base = directory or cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    name = f"{SUITE}-{tree_key()}"
    tarball = base / f"{name}.tar.zst"
    tree = base / name
    build_s = unpack_s = 0.0
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not tarball.exists():
            start = time.monotonic()
            _build_tarball(tarball)
            build_s = time.monotonic() - start
        if not (tree / "usr/lib/systemd/systemd").exists():
            start = time.monotonic()
            _unpack(tarball, tree)
            unpack_s = time.monotonic() - start
    return tree, TreeTimings(build_s, unpack_s)


def _require(*programs: str) -> None:
    missing = [p for p in programs if shutil.which(p) is None]
    if missing:
        raise BedError(
            f"missing {', '.join(missing)}: run `make bed-deps` "
            "(apt-get install systemd-container mmdebstrap zstd)"
        )


def _build_tarball(tarball: Path) -> None:
    _require("mmdebstrap", "zstd")
    partial = tarball.with_name(tarball.name + ".partial.tar.zst")
    partial.unlink(missing_ok=True)
    cmd = ["mmdebstrap", "--variant=minbase", "--include=" + ",".join(PACKAGES)]
    cmd += [f"--customize-hook={hook}" for hook in CUSTOMIZE_HOOKS]
    cmd += [SUITE, str(partial)]
    result = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BedError(
            f"mmdebstrap failed (exit {result.returncode}): {shlex.join(cmd)}\n"
            f"{result.stdout[-4000:]}{result.stderr[-8000:]}"
        )
    partial.rename(tarball)


def _unpack(tarball: Path, tree: Path) -> None:
    _require("zstd")
    partial = tree.with_name(tree.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(tree, ignore_errors=True)
    partial.mkdir()
    cmd = ["tar", "--zstd", "--xattrs", "--xattrs-include=*", "-xpf", str(tarball), "-C"]
    result = subprocess.run([*cmd, str(partial)], capture_output=True, text=True)
    if result.returncode != 0:
        raise BedError(f"unpacking {tarball} failed: {result.stderr[-4000:]}")
    partial.rename(tree)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class Container:
    """One booted container; drive it with `run`, `systemctl`, `journal`, `write_file`.

    Host has no systemd, so nothing registers or supervises the container: we own the nspawn
    process, put it in a cgroup of our own and end the container by killing its PID 1.
    """

    def __init__(
        self, tree: Path, name: str | None = None, repo: Path = REPO, *, unified: bool = False
    ) -> None:
        """`unified`: the container gets the pure cgroup v2 hierarchy (systemd's freezer works
        only there); by default it gets this host's hybrid one, as CI's machines have."""
        self.tree = tree
        self.unified = unified
        self.repo = repo
        self.name = name or f"gpuslice-bed-{os.getpid()}-{next(_names)}"
        self.leader: int | None = None
        self.boot_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self._log = self._workdir / "nspawn.log"
        roots = _cgroup_roots()
        self._cgroups = [root / "gpuslice-bed" / self.name for root in roots]
        # cgroup2 parent of one cgroup per `run`: cgroup.kill reaches every process it started.
        self._exec_cgroup = roots[0] / "gpuslice-bed" / f"{self.name}.exec"

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = BOOT_TIMEOUT) -> Container:
        """Boot and wait until systemd says running or degraded; raise with nspawn's output."""
        _require("systemd-nspawn", "nsenter", "setpriv")
        if self._proc is not None:
            raise BedError(f"{self.name}: already started")
        started = time.monotonic()
        for cgroup in self._cgroups:
            cgroup.mkdir(parents=True, exist_ok=True)
        # The shell moves itself into our cgroups, then becomes nspawn: otherwise nspawn puts
        # payload/ and supervisor/ at the host's cgroup root.
        procs = " ".join(shlex.quote(str(c / "cgroup.procs")) for c in self._cgroups)
        nspawn = [
            "systemd-nspawn",
            f"--directory={self.tree}",
            "--volatile=overlay",
            "--register=no",
            "--keep-unit",
            "--private-network",
            "--console=read-only",
            "--link-journal=no",
            f"--machine={self.name}",
            f"--bind-ro={self.repo}:/src",
            "--boot",
        ]
        script = f'for f in {procs}; do echo $$ > "$f"; done; exec {shlex.join(nspawn)}'
        env = {k: v for k, v in os.environ.items() if k != "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY"}
        if self.unified:
            env["SYSTEMD_NSPAWN_UNIFIED_HIERARCHY"] = "1"
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                ["sh", "-c", script],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        try:
            self.leader = wait_until(self._find_leader, timeout, what=f"{self.name}: PID 1")
            remaining = max(1.0, timeout - (time.monotonic() - started))
            state = wait_until(self._system_state, remaining, 0.05, f"{self.name}: boot")
            if state not in ("running", "degraded"):
                raise BedError(f"{self.name}: systemd reached state {state!r}")
        except BaseException as exc:
            output = self.nspawn_output()
            self.stop()
            if isinstance(exc, Exception):
                raise BedError(
                    f"{self.name}: boot failed: {exc}\n--- nspawn ---\n{output}"
                ) from exc
            raise
        self.boot_s = time.monotonic() - started
        return self

    def _find_leader(self) -> int | None:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise BedError(f"systemd-nspawn exited with {self._proc.returncode}")
        for child in _children(self._proc.pid):
            if _comm(child) == "systemd":
                return child
        return None

    def _system_state(self) -> str | None:
        """`is-system-running --wait`'s answer, or None while the bus is not up yet."""
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise BedError(f"systemd-nspawn exited with {self._proc.returncode}")
        result = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=30)
        state = result.stdout.strip()
        # "offline": systemctl reached neither the bus nor PID 1's private socket yet (seen
        # here under load, once in a few dozen boots); the boot timeout still bounds it
        if "Failed to connect to bus" in result.stderr or state in ("", "offline"):
            return None
        return state

    def stop(self, timeout: float = 10.0) -> None:
        """Kill the container's PID 1 (the kernel ends its PID namespace) and reap nspawn.

        SIGKILL to nspawn itself would orphan the container, so it is only the last resort.
        """
        proc, self._proc = self._proc, None
        if proc is not None:
            leader = self.leader or next(iter(_children(proc.pid)), None)
            if leader is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(leader, signal.SIGKILL)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.leader = None
        for cgroup in [*self._cgroups, self._exec_cgroup]:
            _remove_cgroup(cgroup)

    def __enter__(self) -> Container:
        return self.start() if self._proc is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def nspawn_output(self) -> str:
        """Console and nspawn messages so far (for error reports)."""
        try:
            return self._log.read_text(errors="replace")[-20000:]
        except OSError:
            return ""

    # -- driving it ------------------------------------------------------------------------

    def run(
        self,
        cmd: str | Sequence[str],
        check: bool = True,
        timeout: float = 60,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside (a str goes through `sh -c`); text output captured.

        nsenter forwards no signals and a killed shell leaves its children running, so the
        command runs in a cgroup of its own that is killed when `run` returns (timeout or not):
        nothing it started outlives it, except what it handed to the container's systemd.
        """
        if self.leader is None:
            raise BedError(f"{self.name}: not running")
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        cgroup = self._exec_cgroup / f"run-{next(_runs)}"
        cgroup.mkdir(parents=True)
        full = [
            "sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"),
            "setpriv", "--pdeathsig", "KILL", "--",
            "nsenter", "-t", str(self.leader), "-a", "--",
            *argv,
        ]  # fmt: skip
        try:
            result = subprocess.run(
                full,
                input=input,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=None if input is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise BedError(f"{self.name}: timed out after {timeout:g} s: {_show(cmd)}") from exc
        finally:
            _kill_cgroup(cgroup)
        if check and result.returncode != 0:
            raise BedError(
                f"{self.name}: exit {result.returncode}: {_show(cmd)}\n"
                f"--- stdout ---\n{result.stdout[-4000:]}--- stderr ---\n{result.stderr[-4000:]}"
            )
        return result

    def systemctl(
        self, *args: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """`systemctl ARGS...` inside."""
        return self.run(["systemctl", *args], check=check, timeout=timeout)

    def active_state(self, unit: str) -> str:
        """ActiveState of `unit` (active, inactive, activating, failed, ...)."""
        return self.systemctl("show", "-P", "ActiveState", unit).stdout.strip()

    def wait_active_state(self, unit: str, state: str, timeout: float = 30) -> None:
        """Wait until `unit` reaches ActiveState `state`."""
        wait_until(
            lambda: self.active_state(unit) == state,
            timeout,
            what=f"{unit} to be {state} (is {self.active_state(unit)!r})",
        )

    def journal(self, unit: str | None = None, *args: str) -> str:
        """This boot's journal, for one unit or all; journald is flushed first."""
        self.run(["journalctl", "--sync"], check=False)
        cmd = ["journalctl", "-b", "--no-pager", *(["-u", unit] if unit else []), *args]
        return self.run(cmd, check=False).stdout

    def journal_entries(self, *matches: str) -> list[dict[str, Any]]:
        """This boot's journal entries with every field, as journalctl's JSON, that match
        `matches` (FIELD=VALUE, as journalctl takes them)."""
        out = self.journal(None, "-o", "json", *matches)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def write_file(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write `text` to `path` inside, creating parent directories."""
        quoted = shlex.quote(path)
        script = f'mkdir -p "$(dirname {quoted})" && cat > {quoted} && chmod {mode:o} {quoted}'
        self.run(script, input=text)

    def install_gpuslice(self, targets: Sequence[str] = ("install",), timeout: float = 60) -> None:
        """`make -C /src install` inside (read-only /src), then wait for gpuslice.service."""
        self.run(["make", "--no-print-directory", "-C", "/src", *targets], timeout=timeout)
        self.systemctl("daemon-reload")

        def settled() -> str | None:
            state = self.active_state("gpuslice.service")
            return state if state in ("active", "failed") else None

        try:
            state = wait_until(settled, 30, what="gpuslice.service to be active")
            if state != "active":
                raise BedError("gpuslice.service failed to start")
        except BedError as exc:
            status = self.systemctl("status", "--no-pager", "gpuslice.service", check=False)
            raise BedError(f"{exc}\n{status.stdout}\n{self.journal('gpuslice.service')}") from exc


def _show(cmd: str | Sequence[str]) -> str:
    return cmd if isinstance(cmd, str) else shlex.join(cmd)


def _kill_cgroup(path: Path, timeout: float = 5.0) -> None:
    """SIGKILL everything in a cgroup2 group, wait until it is empty, remove it."""
    with contextlib.suppress(FileNotFoundError):
        if "populated 1" in (path / "cgroup.events").read_text():
            (path / "cgroup.kill").write_text("1")
            wait_until(
                lambda: "populated 0" in (path / "cgroup.events").read_text(),
                timeout,
                0.01,
                f"{path} to empty",
            )
        path.rmdir()


def _remove_cgroup(path: Path) -> None:
    """rmdir the cgroup and whatever nspawn created below it, deepest first."""
    if not path.exists():
        return
    for sub in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            sub.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()


def collect_journal(container: Container) -> str:
    """The whole journal of this boot plus failed units: what a failing test report needs."""
    if container.leader is None:
        return f"(container {container.name} not running)\n{container.nspawn_output()}"
    try:
        failed = container.systemctl("--failed", "--no-pager", check=False).stdout
        return f"{failed}\n{container.journal()}"
    except BedError as exc:
        return f"(could not read journal: {exc})"


@contextlib.contextmanager
def booted(tree: Path | None = None) -> Iterator[Container]:
    """A container booted on the cached tree (built if needed); stopped on exit."""
    with Container(tree or ensure_tree()[0]) as container:
        yield container


if __name__ == "__main__":
    # `make bed`: build/unpack the tree outside pytest, whose per-test timeout would count it.
    path, timings = ensure_tree()
    print(f"{path} (build {timings.build_s:.1f} s, unpack {timings.unpack_s:.1f} s)")
