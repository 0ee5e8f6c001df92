"""The in-container half of the benchmark: runs inside the bed as `python3 /src/bench/probe.py`.

Stdlib only (the container's Debian python3). Every figure is taken inside the container from
CLOCK_REALTIME stamps: the driver's stamp right before `systemctl start`, and the stamps each
benchmark unit's main process writes itself (bash's $EPOCHREALTIME, no fork). The host only
collects the JSON printed on stdout, so the host-to-container call cost is never measured.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

STAMPS = Path("/run/bench")
BG_LOG = STAMPS / "bg.log"
POLL_S = 0.002


def _read_stamp(path: Path) -> float | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    if not text.endswith("\n"):
        return None  # still being written
    return float(text.split()[-1])


def _wait(pred, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"probe: timed out after {timeout:g} s waiting for {what}")
        time.sleep(POLL_S)


def _bg_starts() -> list[tuple[str, float]]:
    try:
        lines = BG_LOG.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) == 2:
            out.append((parts[0], float(parts[1])))
    return out


def _systemctl(*args: str) -> None:
    result = subprocess.run(["systemctl", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"probe: systemctl {' '.join(args)}: {result.stderr.strip()}")


# The tight method: the "asked" stamp is taken in a shell that then execs a non-blocking
# `systemctl start`; no Python and no waiting client between the stamp and the start job.
TIGHT_START = 'echo $EPOCHREALTIME; exec systemctl start --no-block "$1"'


def _ask(unit: str, tight: bool) -> float:
    """Ask systemd to start the unit; when it was asked (CLOCK_REALTIME).

    Client method: a blocking `systemctl start` from Python, stamped before the call (a
    start's cost as a user sees it, but ~10-15 ms of client on both sides of a ratio).
    Tight method: see TIGHT_START."""
    if not tight:
        t0 = time.time()
        _systemctl("start", unit)
        return t0
    result = subprocess.run(["bash", "-c", TIGHT_START, "-", unit], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"probe: systemctl start --no-block {unit}: {result.stderr.strip()}")
    return float(result.stdout.split()[0])


def cmd_handover(od: str, settle: float, timeout: float, tight: bool) -> dict[str, float]:
    """Start OD while a background unit holds the GPU: OD's main process start (handover),
    then OD's exit until a background unit's main process runs again (refill)."""
    start_f, end_f = STAMPS / f"{od}.start", STAMPS / f"{od}.end"
    start_f.unlink(missing_ok=True)
    end_f.unlink(missing_ok=True)
    t0 = _ask(od, tight)
    od_start = _wait(lambda: _read_stamp(start_f), timeout, f"{od} to start")
    od_end = _wait(lambda: _read_stamp(end_f), timeout, f"{od} to end")

    def refilled() -> float | None:
        later = [t for _, t in _bg_starts() if t > od_end]
        return min(later) if later else None

    bg_start = _wait(refilled, timeout, "a background unit to run again")
    time.sleep(settle)  # let the background unit (and the controller) settle before the next rep
    return {
        "t0": t0,
        "od_start": od_start,
        "od_end": od_end,
        "bg_start": bg_start,
        "handover_s": od_start - t0,
        "refill_s": bg_start - od_end,
    }


def cmd_trivial(unit: str, timeout: float, tight: bool) -> dict[str, float]:
    """Start UNIT (Type=oneshot, writes its stamp and exits) until its main runs."""
    start_f = STAMPS / f"{unit}.start"
    start_f.unlink(missing_ok=True)
    t0 = _ask(unit, tight)
    stamp = _wait(lambda: _read_stamp(start_f), timeout, f"{unit} to start")
    return {"t0": t0, "start": stamp, "start_s": stamp - t0}


def cmd_ready(unit: str) -> dict[str, float]:
    """Stop the controller, then time `systemctl start` (Type=notify: returns at READY=1)."""
    _systemctl("stop", unit)
    t0 = time.time()
    _systemctl("start", unit)
    t1 = time.time()
    return {"t0": t0, "t1": t1, "ready_s": t1 - t0}


def cmd_proc(unit: str) -> dict[str, float]:
    """The controller's peak/current RSS and CPU time so far."""
    pid = subprocess.run(
        ["systemctl", "show", "-P", "MainPID", unit], capture_output=True, text=True, check=True
    ).stdout.strip()
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    stat = Path(f"/proc/{pid}/stat").read_text()
    after_comm = stat.rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    utime, stime = int(after_comm[11]), int(after_comm[12])
    return {
        "pid": int(pid),
        "vmhwm_kib": int(fields["VmHWM"].split()[0]),
        "vmrss_kib": int(fields["VmRSS"].split()[0]),
        "utime_s": utime / tck,
        "stime_s": stime / tck,
        "cpu_s": (utime + stime) / tck,
        "time": time.time(),
    }


def cmd_burst(units: list[str], timeout: float) -> dict[str, object]:
    """Start every unit in one `systemctl start --no-block`, wait until all have ended."""
    for u in units:
        (STAMPS / f"{u}.start").unlink(missing_ok=True)
        (STAMPS / f"{u}.end").unlink(missing_ok=True)
    t0 = time.time()
    _systemctl("start", "--no-block", *units)
    t_enqueued = time.time()
    pending = set(units)
    ends: dict[str, float] = {}

    def all_ended() -> bool | None:
        for u in list(pending):
            stamp = _read_stamp(STAMPS / f"{u}.end")
            if stamp is not None:
                ends[u] = stamp
                pending.discard(u)
        return True if not pending else None

    deadline = time.monotonic() + timeout
    while not all_ended() and time.monotonic() < deadline:
        time.sleep(POLL_S * 5)
    # Units that never ran are reported, not fatal: their journal tells why.
    starts = {u: _read_stamp(STAMPS / f"{u}.start") for u in units}
    never = sorted(pending)
    journals = {}
    for u in never[:5]:
        journals[u] = subprocess.run(
            ["journalctl", "-b", "--no-pager", "-o", "short-precise", "--grep", u.split(".")[0]],
            capture_output=True,
            text=True,
        ).stdout[-6000:]
    # When each unit left "inactive" (its gate began), realtime with microseconds.
    shown = subprocess.run(
        ["systemctl", "show", "--timestamp=us+utc", "-p", "Id", "-p", "InactiveExitTimestamp",
         *units],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    gate_began: dict[str, float] = {}
    for block in shown.strip().split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if not props.get("InactiveExitTimestamp"):
            continue
        when = datetime.datetime.strptime(
            props["InactiveExitTimestamp"], "%a %Y-%m-%d %H:%M:%S.%f UTC"
        )
        gate_began[props["Id"]] = when.replace(tzinfo=datetime.UTC).timestamp()
    return {
        "t0": t0,
        "enqueued": t_enqueued,
        "starts": starts,
        "ends": ends,
        "gate_began": gate_began,
        "never_ended": never,
        "never_ended_journal": journals,
    }


def cmd_write(files: dict[str, str]) -> dict[str, int]:
    """Write many files at once (unit files): {path: text} on stdin."""
    for path, text in files.items():
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return {"written": len(files)}


def main(argv: list[str]) -> int:
    cmd, args = argv[0], argv[1:]
    STAMPS.mkdir(parents=True, exist_ok=True)
    if cmd == "handover":
        out: object = cmd_handover(args[0], float(args[1]), float(args[2]), args[3] == "tight")
    elif cmd == "trivial":
        out = cmd_trivial(args[0], float(args[1]), args[2] == "tight")
    elif cmd == "ready":
        out = cmd_ready(args[0])
    elif cmd == "proc":
        out = cmd_proc(args[0])
    elif cmd == "burst":
        out = cmd_burst(args[1:], float(args[0]))
    elif cmd == "write":
        out = cmd_write(json.load(sys.stdin))
    else:
        print(f"probe: unknown command {cmd}", file=sys.stderr)
        return 2
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
