"""The in-container half of bench/day.py (a day on one GPU): `python3 /src/bench/day_probe.py`.

Stdlib only (the container's Debian python3). Two commands:

- `work UNIT`: the job every day unit runs (its ExecStart execs it after bash stamped the main
  process's start). It "loads a model" (sleeps), then works through items, persisting its
  progress after each, so a stopped job resumes where it was but redoes the item it was in and
  loads again. Every step is one line appended to WORKDIR/UNIT.log with a CLOCK_REALTIME stamp
  (one write(2) each, O_APPEND: a stop never leaves half a line).
- `drive`: the day's clock. Reads the schedule (JSON) on stdin, enrols the background jobs at
  t0, asks for each on-demand job at its time (stamped just before `systemctl start
  --no-block`), stops every day unit at the end and prints the stamps and every log as JSON.

Log lines, `KIND STAMP [ITEM]`: start (bash, main process began), load, ready (model loaded),
begin N, end N (item N done, progress persisted), done (all items done), stop (SIGTERM).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

WORKDIR = Path("/var/lib/bench-day")
PLAN = WORKDIR / "plan.json"


def _now() -> str:
    return f"{time.time():.6f}"


def cmd_work(unit: str) -> int:
    """Load, then items; the progress file (items done) survives a stop, the item in hand not."""
    spec = json.loads(PLAN.read_text())[unit]
    load_s, item_s, items = float(spec["load_s"]), float(spec["item_s"]), int(spec["items"])
    fd = os.open(WORKDIR / f"{unit}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def say(*parts: object) -> None:
        os.write(fd, (" ".join(map(str, parts)) + "\n").encode())

    def on_term(signum: int, frame: FrameType | None) -> None:
        say("stop", _now())
        # die of the signal itself: systemd counts that as a clean stop, an exit code not
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    progress = WORKDIR / f"{unit}.progress"
    say("load", _now())
    time.sleep(load_s)
    say("ready", _now())
    try:
        done = int(progress.read_text())
    except (FileNotFoundError, ValueError):
        done = 0
    partial = progress.with_name(progress.name + ".new")
    while done < items:
        say("begin", _now(), done)
        time.sleep(item_s)
        partial.write_text(f"{done + 1}\n")
        os.replace(partial, progress)
        say("end", _now(), done)
        done += 1
    say("done", _now())
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
