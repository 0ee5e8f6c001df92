"""The in-container half of bench/day.py (a day on one GPU): `python3 /src/bench/day_probe.py`.

Stdlib only (the container's Debian python3). Two commands:

- `work UNIT`: the job every day unit runs (its ExecStart execs it after bash stamped the main
  process's start). It "loads a model" (sleeps), then works through items, persisting its
  progress after each, so a stopped job resumes where it was but redoes the item it was in and
  loads again. Every step is one line appended to WORKDIR/UNIT.log with a CLOCK_REALTIME stamp
  (one write(2) each, O_APPEND: a stop never leaves half a line). It sleeps in slices of
  SLICE_S and counts only its own running time: a slice that ends GAP_S or more late means the
  process was frozen (systemd's freezer, Preempt=suspend or freeze) or not run meanwhile, and
  becomes a `pause` and a `resume` line, written when it runs again, the load or item in hand
  then going on where it was. With $BENCH_DAY_ALLOC set (gpu-alloc, tests/fakenvml) it first
  starts that program as a child holding $BENCH_DAY_VRAM on its granted GPU ($GPUSLICE_GPUS):
  the simulated VRAM that gpuslice sees through the fake NVML and cuda-checkpoint moves.
- `drive`: the day's clock. Reads the schedule (JSON) on stdin, enrols the background jobs at
  t0, asks for each on-demand job at its time (stamped just before `systemctl start
  --no-block`), stops every day unit at the end and prints the stamps and every log as JSON.

Log lines, `KIND STAMP [ITEM]`: start (bash, main process began), load, ready (model loaded),
begin N, end N (item N done, progress persisted), done (all items done), stop (SIGTERM),
pause and resume (the process did not run from the one to the other).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

WORKDIR = Path("/var/lib/bench-day")
PLAN = WORKDIR / "plan.json"
SLICE_S = 0.01
GAP_S = 0.25  # frozen jobs are frozen for 0.5 s or more; scheduling delays are far shorter


def _now() -> str:
    return f"{time.time():.6f}"


class Clock:
    """The worker's own running time: wall time less the gaps in which it did not run."""

    def __init__(self, say: Callable[..., None]) -> None:
        self.say = say
        self.last = time.time()  # when it last saw itself run

    def run(self, seconds: float) -> None:
        """Sleep until SECONDS of running time have passed, saying each gap seen."""
        left = seconds
        while left > 0:
            step = min(SLICE_S, left)
            time.sleep(step)
            left -= self.check(step)

    def check(self, step: float = 0.0) -> float:
        """How much of the time since the last look it ran (a slept STEP counts in full, a
        gap not); a gap is said as `pause` (when it would have woken) and `resume` (now)."""
        now = time.time()
        ran = now - self.last
        if ran > step + GAP_S:
            self.say("pause", f"{self.last + step:.6f}")
            self.say("resume", f"{now:.6f}")
            ran = step
        self.last = now
        return ran


def _hold_vram() -> subprocess.Popen[bytes] | None:
    """$BENCH_DAY_ALLOC --gpu (the first of $GPUSLICE_GPUS) --bytes $BENCH_DAY_VRAM, once it
    says it holds the memory; None without $BENCH_DAY_ALLOC."""
    alloc = os.environ.get("BENCH_DAY_ALLOC")
    if not alloc:
        return None
    gpu = os.environ.get("GPUSLICE_GPUS", "0").split(",")[0]
    vram = os.environ.get("BENCH_DAY_VRAM", "1G")
    child = subprocess.Popen([alloc, "--gpu", gpu, "--bytes", vram], stdout=subprocess.PIPE)
    assert child.stdout is not None
    if not child.stdout.readline().startswith(b"ready"):
        raise SystemExit(f"{alloc} did not allocate {vram} on GPU {gpu}")
    return child


def cmd_work(unit: str) -> int:
    """Load, then items; the progress file (items done) survives a stop, the item in hand not."""
    spec = json.loads(PLAN.read_text())[unit]
    load_s, item_s, items = float(spec["load_s"]), float(spec["item_s"]), int(spec["items"])
    fd = os.open(WORKDIR / f"{unit}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def say(*parts: object) -> None:
        os.write(fd, (" ".join(map(str, parts)) + "\n").encode())

    clock = Clock(say)

    def on_term(signum: int, frame: FrameType | None) -> None:
        clock.check()  # frozen, then stopped: systemd thaws it first
        say("stop", _now())
        # die of the signal itself: systemd counts that as a clean stop, an exit code not
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    progress = WORKDIR / f"{unit}.progress"
    vram = _hold_vram()
    clock.check()
    say("load", _now())
    clock.run(load_s)
    say("ready", _now())
    try:
        done = int(progress.read_text())
    except (FileNotFoundError, ValueError):
        done = 0
    partial = progress.with_name(progress.name + ".new")
    while done < items:
        clock.check()
        say("begin", _now(), done)
        clock.run(item_s)
        partial.write_text(f"{done + 1}\n")
        os.replace(partial, progress)
        say("end", _now(), done)
        done += 1
    say("done", _now())
    if vram is not None:
        vram.terminate()
        vram.wait()
    return 0


def _start(unit: str) -> float:
    """Ask systemd to start the unit without waiting; when it was asked (CLOCK_REALTIME)."""
    asked = time.time()
    subprocess.run(["systemctl", "start", "--no-block", unit], check=True, capture_output=True)
    return asked


def cmd_drive(day: dict[str, Any]) -> dict[str, Any]:
    """The day: enrol the background jobs (write their units, daemon-reload; systemd alone
    also starts them), ask for each on-demand job at its time, stop everything at the end."""
    t0 = time.time()
    for path, text in day["background_files"].items():
        Path(path).write_text(text)
    subprocess.run(["systemctl", "daemon-reload"], check=True)
    if day["start_background"]:
        subprocess.run(["systemctl", "start", "--no-block", *day["start_background"]], check=True)
    requests: dict[str, float] = {}
    for at_s, unit in sorted(day["arrivals"]):
        time.sleep(max(0.0, t0 + at_s - time.time()))
        requests[unit] = _start(unit)
    time.sleep(max(0.0, t0 + day["window_s"] - time.time()))
    t_end = time.time()
    subprocess.run(["systemctl", "stop", *day["units"]], capture_output=True, timeout=60)
    logs = {p.name[: -len(".log")]: p.read_text() for p in sorted(WORKDIR.glob("*.log"))}
    lateness = [requests[u] - (t0 + at) for at, u in day["arrivals"] if u in requests]
    return {
        "t0": t0,
        "t_end": t_end,
        "requests": requests,
        "logs": logs,
        "max_late_s": max(lateness, default=0.0),
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["work"] and len(argv) == 2:
        return cmd_work(argv[1])
    if argv == ["drive"]:
        json.dump(cmd_drive(json.load(sys.stdin)), sys.stdout)
        return 0
    print("usage: day_probe.py work UNIT | drive < day.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
