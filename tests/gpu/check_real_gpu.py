"""A real-GPU check of gpuslice's NVML side: run by hand, never by `make test`.

    sudo .venv/bin/python -m tests.gpu.check_real_gpu [--gib 2] [--gpu 0] [--python PY]

Needs an NVIDIA driver (libnvidia-ml.so.1), nvidia-ml-py for this interpreter and PyTorch with
CUDA for PY (default: this interpreter). It
  1. discovers the GPUs through gpuslice.nvml (index, UUID, name, memory);
  2. starts a CUDA process that allocates --gib GiB on --gpu and holds it:
     (a) in a transient systemd unit (systemd-run --pipe), when systemd is PID 1 and we are
         root: gpuslice's inventory must attribute it to that unit;
     (b) as a plain child process: the inventory must flag it as foreign;
  3. prints per case: what NVML reports for the process vs what was requested, how long until
     NVML lists it after the allocation finished, and how long until it is gone after exit;
  4. records the boot facts: driver version (NVML and /proc/driver/nvidia), whether
     nvidia-persistenced is installed and active, how long nvmlInit takes here, the device
     nodes and gpuslice.service's DeviceAllow= (gpuslice.driver.device_access_problems), and,
     when gpuslice.service runs, how long after its start NVML answered (from its journal).
Exit 0 when every case behaved, 1 on a clear failure (never seen, wrong attribution, less
memory than requested, never gone), 2 when it cannot run here (no driver, no torch, no CUDA).

The suspend/resume round trip of Preempt=suspend (cuda-checkpoint) is tests/gpu/check_suspend.py.

NVML reports host PIDs: run it on the host, not inside a container with its own PID namespace.
The CUDA context itself takes a few hundred MiB, so "used" exceeds "requested"; the table shows
the difference. Written on machines without a GPU: it has not been run against real hardware
by its author, so read its figures with that in mind.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gpuslice.config import Config
from gpuslice.driver import device_access_problems
from gpuslice.driver import probe as driver_probe
from gpuslice.inventory import GpuUse, Inventory, unit_of_pid
from gpuslice.nvml import GpuProcess, Nvml, NvmlError
from gpuslice.sizes import format_size

GIB = 1 << 30
CANNOT_RUN = 2
T = TypeVar("T")

# The CUDA job: allocate, touch, report, hold until stdin closes.
CHILD = """
import os, sys, time
import torch
n = int(sys.argv[1])
t0 = time.monotonic()
x = torch.empty(n, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
print("ready", os.getpid(), torch.cuda.memory_reserved(), time.monotonic() - t0, flush=True)
sys.stdin.read()
"""

PROBE = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"


@dataclass
class Case:
    name: str
    pid: int = 0
    unit: str | None = None  # the unit the inventory attributed it to (None: foreign)
    expected_unit: str | None = None
    requested: int = 0
    torch_reserved: int = 0
    nvml_used: int | None = None
    alloc_s: float = 0.0
    appear_s: float | None = None
    vanish_s: float | None = None
    problems: list[str] | None = None


def poll(predicate: Callable[[], T | None], timeout: float, interval: float = 0.01) -> T | None:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value is not None or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no output from the CUDA process within {timeout:g} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the CUDA process exited early (status {proc.wait()})")
    return line.strip()


def show_gpus(nvml: Nvml) -> list[str]:
    scan = nvml.devices()
    rows = [("GPU", "UUID", "NAME", "TOTAL", "USED", "FREE")]
    for g in scan.gpus:
        total, used, free = (
            "?" if b is None else format_size(b)  # a unified-memory GPU (GB10) tells none
            for b in (g.memory_total, g.memory_used, g.memory_free)
        )
        rows.append((str(g.index), g.uuid, g.name, total, used, free))
    rows += [(str(i), "-", "LOST", "-", "-", "-") for i in scan.lost]
    table(rows)
    return [g.uuid for g in sorted(scan.gpus, key=lambda g: g.index)]


def table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def controller_nvml_delay() -> str:
    """How long after gpuslice.service's (last) start NVML answered, from its journal: the
    "NVML ready" line of a switch, else "gpuslice ready" when NVML answered at once."""
    import json

    if not shutil.which("journalctl") or _run(["systemctl", "is-active", "gpuslice.service"]) != (
        "active"
    ):
        return "gpuslice.service not running"
    started = _run(["systemctl", "show", "-P", "ExecMainStartTimestampMonotonic", "gpuslice"])
    if not started.isdigit() or int(started) == 0:
        return "unknown (no start time)"
    since = int(started)
    waited = False
    cmd = ["journalctl", "-b", "-u", "gpuslice.service", "-o", "json", "--no-pager"]
    for line in _run(cmd).splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        at = int(entry.get("__MONOTONIC_TIMESTAMP", 0))
        message = entry.get("MESSAGE")
        if at < since or not isinstance(message, str):
            continue
        if message.startswith("NVIDIA hardware present") or "NVML unavailable" in message:
            waited = True
        at_once = message.startswith("gpuslice ready") and not waited
        if message.startswith("NVML ready") or at_once:
            return f"{(at - since) / 1e6:.3f} s ({message[:60]}...)"
    return "NVML has not answered since gpuslice.service started"


def boot_facts(nvml_version: str | None) -> list[tuple[str, str]]:
    driver = driver_probe()
    persistenced = shutil.which("nvidia-persistenced")
    active = _run(["systemctl", "is-active", "nvidia-persistenced.service"]) or "?"
    allow = _run(["systemctl", "show", "-P", "DeviceAllow", "gpuslice.service"])
    problems = device_access_problems(allow.split(", ") if allow else [])
    started = time.monotonic()
    again = Nvml()
    available = again.open().available
    init_s = time.monotonic() - started
    again.close()
    return [
        ("driver (NVML)", nvml_version or "?"),
        ("driver (kernel module)", driver.version or ("loaded" if driver.module_loaded else "no")),
        ("NVIDIA PCI devices", ", ".join(driver.devices) or "none"),
        ("nvidia-persistenced", f"{persistenced or 'not installed'} ({active})"),
        ("nvmlInit here", f"{init_s * 1000:.0f} ms ({'ok' if available else 'failed'})"),
        ("gpuslice.service DeviceAllow", allow or "(not installed)"),
        ("device access", "; ".join(problems) or "ok"),
        ("controller start -> NVML answered", controller_nvml_delay()),
    ]


def find(nvml: Nvml, gpu: int, pid: int) -> GpuProcess | None:
    return next((p for p in nvml.processes(gpu) if p.pid == pid), None)


def run_case(
    case: Case,
    argv: list[str],
    env: dict[str, str],
    nvml: Nvml,
    gpu: int,
    managed: set[str],
    timeout: float,
) -> None:
    problems: list[str] = []
    case.problems = problems
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1
    )
    try:
        words = read_line(proc, timeout).split()
        if words[:1] != ["ready"]:
            raise RuntimeError(f"unexpected output from the CUDA process: {words}")
        ready_at = time.monotonic()
        case.pid, case.torch_reserved, case.alloc_s = int(words[1]), int(words[2]), float(words[3])
        seen = poll(lambda: find(nvml, gpu, case.pid), timeout)
        if seen is None:
            problems.append(f"NVML never listed PID {case.pid} on GPU {gpu}")
        else:
            case.appear_s = time.monotonic() - ready_at
            case.nvml_used = seen.used_memory
            if seen.used_memory is not None and seen.used_memory < case.requested:
                problems.append("NVML reports less memory than was allocated")
            inventory = Inventory(Config(), nvml=nvml)
            inventory.open()
            sample = inventory.sample(managed)
            use: GpuUse | None = next((p for p in sample.processes if p.pid == case.pid), None)
            case.unit = use.unit if use is not None else None
            if use is None:
                problems.append("the inventory did not list the process")
            elif case.unit != case.expected_unit:
                problems.append(
                    f"attributed to {case.unit or 'nobody (foreign)'}, expected "
                    f"{case.expected_unit or 'nobody (foreign)'}; /proc says "
                    f"{unit_of_pid(case.pid)}"
                )
            foreign = next(g for g in sample.gpus if g.index == gpu).foreign_pids
            if (case.pid in foreign) != (case.expected_unit is None):
                problems.append(f"foreign PIDs on GPU {gpu} are {list(foreign)}")
        assert proc.stdin is not None
        proc.stdin.close()  # the job ends; CUDA frees its memory at exit
        proc.wait(timeout)
        exited_at = time.monotonic()
        if poll(lambda: True if find(nvml, gpu, case.pid) is None else None, timeout):
            case.vanish_s = time.monotonic() - exited_at
        else:
            problems.append(f"NVML still lists PID {case.pid} {timeout:g} s after it exited")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="GiB to allocate (default 2)")
    parser.add_argument("--gpu", type=int, default=0, help="GPU index (default 0)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with torch")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per wait")
    opts = parser.parse_args(args)

    nvml = Nvml()
    status = nvml.open(fallback="nothing: this check needs NVML")
    if not status.available:
        print(status.warning)
        return CANNOT_RUN
    print(f"NVIDIA driver {status.driver_version}")
    table([("FACT", "VALUE"), *boot_facts(status.driver_version)])
    print()
    try:
        uuids = show_gpus(nvml)
    except NvmlError as e:
        print(f"NVML discovery failed: {e}")
        return 1
    if opts.gpu >= len(uuids):
        print(f"no GPU {opts.gpu} (found {len(uuids)})")
        return CANNOT_RUN
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuids[opts.gpu], "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    probe = subprocess.run([opts.python, "-c", PROBE], env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"{opts.python}: no torch with CUDA ({probe.stderr.strip()[-300:] or 'no CUDA'})")
        return CANNOT_RUN

    requested = int(opts.gib * GIB)
    child = [opts.python, "-c", CHILD, str(requested)]
    cases: list[tuple[Case, list[str]]] = []
    systemd_pid1 = Path("/proc/1/comm").read_text().strip() == "systemd"
    if systemd_pid1 and os.geteuid() == 0 and shutil.which("systemd-run"):
        unit = f"gpuslice-check-{os.getpid()}.service"
        run = ["systemd-run", "--quiet", "--pipe", f"--unit={unit}", "--collect"]
        run += [f"--setenv={k}={env[k]}" for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")]
        cases.append((Case("(a) in a unit", expected_unit=unit, requested=requested), run + child))
    else:
        print("(a) skipped: needs systemd as PID 1, root and systemd-run")
    cases.append((Case("(b) plain process", requested=requested), child))
    managed = {c.expected_unit for c, _ in cases if c.expected_unit}

    failed = False
    for case, argv in cases:
        try:
            run_case(case, argv, env, nvml, opts.gpu, managed, opts.timeout)
        except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired, NvmlError) as e:
            case.problems = [*(case.problems or []), f"could not run: {e}"]
        failed = failed or bool(case.problems)

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    print()
    header = "CASE|PID|ATTRIBUTED TO|REQUESTED|TORCH RESERVED|NVML USED|OVERHEAD|ALLOC|SEEN AFTER"
    rows: list[tuple[str, ...]] = [(*header.split("|"), "GONE AFTER EXIT")]
    for case, _ in cases:
        used = case.nvml_used
        rows.append(
            (
                case.name,
                str(case.pid or "-"),
                case.unit or "foreign",
                format_size(case.requested),
                format_size(case.torch_reserved),
                "?" if used is None else format_size(used),
                "?" if used is None else format_size(used - case.requested),
                ms(case.alloc_s),
                ms(case.appear_s),
                ms(case.vanish_s),
            )
        )
    table(rows)
    for case, _ in cases:
        for problem in case.problems or []:
            print(f"FAIL {case.name}: {problem}")
    nvml.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
