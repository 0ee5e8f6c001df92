"""Side by side: gpuslice at an older commit against the working tree, in one run.

    python -m bench.ab COMMIT [--case burst|latency|ready] [--reps N] [--units N] [FILE...]

Two bed containers with the same units; in the first, the package files that differ from
COMMIT (or only the FILEs named) are replaced by COMMIT's and the controller restarted. The
cases alternate between the two, so the drift of this shared VM hits both alike: on it, the
same code gave figures 50% apart an hour apart, and only a ratio taken side by side tells a
change from the weather. `burst`: 200 on-demand units onto 8 virtual GPUs among `--units`
annotated units (bench.run's burst), with the controller's CPU time; `ready`: controller
start to READY=1 among them; `latency`: handover, refill gap (tight method) and the gate on
an idle GPU (bench.run's cases 1-3).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

from bench.run import (
    CONTROLLER,
    QUICK,
    SCALE_GPUS,
    alternate,
    analyse_burst,
    burst_names,
    burst_priorities,
    latency_units,
    prepare,
    probe,
    scale_units,
    wait_bg_running,
)
from tests.bed.container import REPO, Container, ensure_tree

INSTALLED = "/usr/local/lib/gpuslice/python"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
    ).stdout


def install_old(c: Container, commit: str, only: list[str]) -> list[str]:
    """COMMIT's version of each package file that differs (or of `only`), then a restart."""
    files = _git("diff", "--name-only", commit, "--", "gpuslice").split()
    files = [f for f in files if not only or f in only]
    old = set(_git("ls-tree", "-r", "--name-only", commit, "--", "gpuslice").split())
    for name in files:
        if name in old:
            c.run(f"cat > {INSTALLED}/{name}", input=_git("show", f"{commit}:{name}"))
        else:  # new since COMMIT: the old code never imports it
            c.run(["rm", "-f", f"{INSTALLED}/{name}"])
    c.run("systemctl restart gpuslice && sleep 2")
    return files


def _median(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> float:
    return round(float(statistics.median(r[key] for r in rows)) * scale, 2)


def case_burst(old: Container, new: Container, reps: int, units: int) -> None:
    for c in (old, new):
        c.run(["systemctl", "stop", *[f"bench-bg-{i}.service" for i in range(SCALE_GPUS)]])
    n = 200
    rows: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for rep in range(reps):
        order = [("old", old), ("new", new)] if rep % 2 == 0 else [("new", new), ("old", old)]
        for key, c in order:
            time.sleep(1.0)
            cpu = probe(c, "proc", CONTROLLER)["cpu_s"]
            result = probe(c, "burst", QUICK.timeout_s, *burst_names(n), timeout=300)
            cpu = probe(c, "proc", CONTROLLER)["cpu_s"] - cpu
            st = analyse_burst(
                result, c.journal(CONTROLLER, "-o", "json"), burst_priorities(n), QUICK
            )
            row = {
                "done_s": st["all_done_s"],
                "controller_cpu_s": cpu,
                "preemptions": st["preemptions"],
                "inversions": st["priority_inversions"],
                "run_again": len(st["finished_then_run_again"]),
            }
            rows[key].append(row)
            print(key, rep, {k: round(v, 2) for k, v in row.items()}, flush=True)
    for key, got in rows.items():
        print(
            f"{key}: burst of {n} among {units} units, median of {reps}: "
            f"{_median(got, 'done_s')} s (ideal 5.0), controller CPU "
            f"{_median(got, 'controller_cpu_s')} s, preemptions {_median(got, 'preemptions')}, "
            f"inversions {max(r['inversions'] for r in got)}, finished units run again "
            + "/".join(str(r["run_again"]) for r in got)
        )


def case_latency(old: Container, new: Container, reps: int) -> None:
    p = QUICK
    for c in (old, new):
        wait_bg_running(c, 1)

    def handover(c: Container) -> Callable[[], dict[str, Any]]:
        return lambda: probe(c, "handover", "bench-od.service", p.settle_s, p.timeout_s, "tight")

    def trivial(c: Container) -> Callable[[], dict[str, Any]]:
        return lambda: probe(c, "trivial", "bench-trivial.service", p.timeout_s, "tight")

    cpu = {k: probe(c, "proc", CONTROLLER)["cpu_s"] for k, c in (("old", old), ("new", new))}
    ho = alternate([("old", handover(old)), ("new", handover(new))], reps, 2)
    for k, c in (("old", old), ("new", new)):
        cpu[k] = (probe(c, "proc", CONTROLLER)["cpu_s"] - cpu[k]) * 1000 / (reps + 2)
        c.systemctl("stop", "bench-bg.service")
    tr = alternate([("old", trivial(old)), ("new", trivial(new))], reps, 2)
    for k in ("old", "new"):
        print(
            f"{k}: handover {_median(ho[k], 'handover_s', 1000)} ms, refill "
            f"{_median(ho[k], 'refill_s', 1000)} ms, gate {_median(tr[k], 'start_s', 1000)} ms, "
            f"controller CPU per handover+refill {cpu[k]:.1f} ms (medians of {reps})"
        )


def case_ready(old: Container, new: Container, reps: int, units: int) -> None:
    def ready(c: Container) -> Callable[[], dict[str, Any]]:
        return lambda: probe(c, "ready", CONTROLLER)

    got = alternate([("old", ready(old)), ("new", ready(new))], reps, 1)
    for k in ("old", "new"):
        print(
            f"{k}: controller start to READY=1 at {units} units "
            f"{_median(got[k], 'ready_s', 1000)} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("commit")
    ap.add_argument("files", nargs="*", help="only these package files from COMMIT")
    ap.add_argument("--case", choices=("burst", "latency", "ready"), default="burst")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--units", type=int, default=10_000, help="annotated units (burst)")
    args = ap.parse_args()
    tree = ensure_tree()[0]
    with Container(tree) as old, Container(tree) as new:
        for c in (old, new):
            if args.case in ("burst", "ready"):
                prepare(c, scale_units(args.units, QUICK, burst=200), gpus=SCALE_GPUS)
                wait_bg_running(c, SCALE_GPUS)
            else:
                prepare(c, latency_units(True, QUICK), gpus=1)
        print(f"old = {args.commit}: {' '.join(install_old(old, args.commit, args.files))}")
        new.run("systemctl restart gpuslice && sleep 2")  # both controllers fresh
        if args.case == "burst":
            case_burst(old, new, args.reps, args.units)
        elif args.case == "ready":
            case_ready(old, new, args.reps, args.units)
        else:
            case_latency(old, new, args.reps)


if __name__ == "__main__":
    main()
