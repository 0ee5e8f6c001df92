"""What one move of a process into another cgroup costs on this host, for the bench's header.

Systemd before 256 (Debian 12 has 252) forks each process it runs for a unit and then moves
it into the unit's cgroup, and PID 1 waits for that move. A move takes the kernel's global
cgroup_threadgroup_rwsem for writing, which waits for an RCU grace period unless one passed
a moment ago, or the cgroup2 mount has `favordynmods`: 7.9 ms here after an idle gap (0.3 ms
with it; on kernel 6.18 the option cannot be taken back until a reboot). Every process a
start costs, the floor's and gpuslice's gate alike, pays it, so the bench's figures are only
comparable between hosts that pay the same: its JSON's `machine` and its header say which.
Systemd 256 and later with glibc 2.39 spawn into the cgroup directly (CLONE_INTO_CGROUP).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Cgroup2:
    path: str
    favordynmods: bool


def cgroup2_mount(mountinfo: str) -> Cgroup2 | None:
    """The first cgroup2 mount in /proc/self/mountinfo's text, and whether its superblock
    options (after the ` - ` separator: type, source, options) have favordynmods."""
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, after = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(after) < 3 or after[0] != "cgroup2":
            continue
        return Cgroup2(fields[4], "favordynmods" in after[2].split(","))
    return None


def migration_ms(root: str, moves: int = 6, gap_s: float = 0.1) -> float:
    """Median milliseconds of moving a sleeping process between two new cgroups under
    `root`, `gap_s` apart (a grace period passes between moves, as between starts)."""
    dirs = [Path(root) / f"gpuslice-bench-{os.getpid()}-{x}" for x in "ab"]
    sleeper: subprocess.Popen[bytes] | None = None
    took = []
    try:  # what was made is removed even when a mkdir or the spawn fails
        for d in dirs:
            d.mkdir()
        sleeper = subprocess.Popen(["sleep", "60"])
        for i in range(moves):
            time.sleep(gap_s)
            t = time.perf_counter()
            (dirs[i % 2] / "cgroup.procs").write_text(str(sleeper.pid))
            took.append((time.perf_counter() - t) * 1000)
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        for d in dirs:
            # a killed process leaves its cgroup a moment later
            for _ in range(50 if d.exists() else 0):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)
    return statistics.median(took)


def host_cgroup_cost() -> dict[str, object]:
    """For the JSON's `machine`: the cgroup2 mount, favordynmods, the move's median cost
    (None where it cannot be measured: no cgroup2, not root)."""
    try:
        mount = cgroup2_mount(Path("/proc/self/mountinfo").read_text())
    except OSError:
        mount = None
    if mount is None:
        return {"cgroup2": None, "favordynmods": None, "cgroup_move_ms": None}
    try:
        cost: float | None = round(migration_ms(mount.path), 2)
    except OSError:
        cost = None
    return {"cgroup2": mount.path, "favordynmods": mount.favordynmods, "cgroup_move_ms": cost}


def describe_cgroup_cost(host: dict[str, object]) -> str:
    """One line for the table's header: what each process systemd spawns costs PID 1 here."""
    if host.get("cgroup_move_ms") is None:
        return "a cgroup move: not measured (no writable cgroup2)"
    fdm = "on" if host["favordynmods"] else "off"
    return (
        f"a cgroup move (systemd < 256 makes one per process it spawns, PID 1 waiting): "
        f"{host['cgroup_move_ms']:.2f} ms after an idle gap; cgroup2 favordynmods {fdm} "
        "(bench/cgroupcost.py)"
    )
