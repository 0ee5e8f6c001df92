"""Where gpuslice's time goes: `python -m bench.profile` (a companion to bench.run).

Boots one bed container with the 1,000-unit scale set (`gpus: 8`) and prints the figures
behind the bench table's gpuslice/floor gaps: the gate's parts (sh, dbus-send, a D-Bus round
trip to the controller), the controller's Python import time, the annotation scan, and the
controller's start-up split into systemd's exec and our own work up to READY=1.
"""

from __future__ import annotations

import datetime
import json
import shlex
import sys

from bench.run import QUICK, SCALE_GPUS, prepare, scale_units, wait_bg_running
from tests.bed.container import Container, ensure_tree

PYDIR = "/usr/local/lib/gpuslice/python"
GATE = "/usr/local/lib/gpuslice/gpuslice-gate"
RUN = "systemd-run --wait --quiet --collect --unit=gate-probe"
N = 30

# Runs inside the container (python3 -c): each command N times, median in ms.
TIMER = r"""
import json, statistics, subprocess, sys, time
cmds = json.loads(sys.argv[1]); n = int(sys.argv[2]); out = {}
for name, cmd in cmds.items():
    ts = []
    for _ in range(n):
        t = time.perf_counter(); subprocess.run(cmd, shell=True, check=True)
        ts.append((time.perf_counter() - t) * 1000)
    out[name] = {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts)}
print(json.dumps(out))
"""

SCAN = f"""
import cProfile, io, pstats, sys, time
sys.path.insert(0, {PYDIR!r})
from gpuslice.annotations import scan
t = time.perf_counter(); s = scan("/"); dt = time.perf_counter() - t
print(f"scan('/'): {{dt * 1000:.1f}} ms for {{len(s.specs)}} annotated units")
pr = cProfile.Profile(); pr.enable(); scan("/"); pr.disable()
buf = io.StringIO(); pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(8)
print("\\n".join(buf.getvalue().splitlines()[:24]))
"""

IMPORT = f"import sys; sys.path.insert(0, {PYDIR!r}); import gpuslice.controller"


def main() -> int:
    tree, _ = ensure_tree()
    with Container(tree) as c:
        prepare(c, scale_units(1000, QUICK, burst=200), gpus=SCALE_GPUS)
        wait_bg_running(c, SCALE_GPUS)
        bus = "org.gpuslice.Scheduler1 /org/gpuslice/Scheduler1 org.gpuslice.Scheduler1"
        cmds = {
            "sh -c true": "sh -c true",
            "busctl GetId (dbus-daemon round trip)": "busctl call org.freedesktop.DBus / "
            "org.freedesktop.DBus GetId >/dev/null",
            "busctl Status (controller round trip)": f"busctl call {bus} Status >/dev/null",
            # Acquire is served only to a process of the unit it names: run it as a unit
            "systemd-run --wait true": f"{RUN} /bin/true",
            "systemd-run --wait gate, unmanaged unit": f"{RUN} {GATE} gate-probe.service",
            "python3 -c pass": "python3 -c pass",
            "python3 -c 'import gpuslice.controller'": f"python3 -c {shlex.quote(IMPORT)}",
        }
        timer = c.run(["python3", "-c", TIMER, json.dumps(cmds), str(N)], timeout=300).stdout
        print(f"== command costs inside the container (median of {N}, ms)")
        for name, fig in json.loads(timer).items():
            print(
                f"  {name:45s} {fig['median_ms']:7.1f}  ({fig['min_ms']:.1f}-{fig['max_ms']:.1f})"
            )
        print("\n== python3 -X importtime: slowest cumulative imports (us)")
        imp = c.run(["python3", "-X", "importtime", "-c", IMPORT]).stderr.splitlines()
        rows = []
        for line in imp[1:]:
            parts = line.split("|")
            if len(parts) == 3:
                rows.append((int(parts[1]), parts[2].rstrip()))
        for cum, name in sorted(rows, reverse=True)[:15]:
            print(f"  {cum:8d} {name}")
        print("\n== annotation scan of 1,000 units")
        print(c.run(["python3", "-c", SCAN], timeout=120).stdout)
        print("== controller start split (systemctl start gpuslice, 5 times)")
        script = (
            "for i in 1 2 3 4 5; do systemctl stop gpuslice; t0=$EPOCHREALTIME; "
            "systemctl start gpuslice; t1=$EPOCHREALTIME; "
            "m=$(systemctl show --timestamp=us+utc -P ExecMainStartTimestamp gpuslice); "
            'echo "$t0 $t1 $m"; done'
        )
        # ExecMainStartTimestamp (exec of our process) vs t0: systemd's part; the rest is ours.
        out = c.run(["bash", "-c", script], timeout=120).stdout
        for line in out.splitlines():
            t0, t1, when = line.split(" ", 2)
            exec_at = (
                datetime.datetime.strptime(when.strip(), "%a %Y-%m-%d %H:%M:%S.%f UTC")
                .replace(tzinfo=datetime.UTC)
                .timestamp()
            )
            print(
                f"  total {1000 * (float(t1) - float(t0)):6.1f} ms: systemd to exec "
                f"{1000 * (exec_at - float(t0)):6.1f} ms, exec to READY=1 "
                f"{1000 * (float(t1) - exec_at):6.1f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
