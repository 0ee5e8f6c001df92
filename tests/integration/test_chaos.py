"""Chaos against systemd's truth: hundreds of preemptions and refills on one GPU while the
controller is killed (-9), restarted and systemd reloaded at random moments, and one background
unit's annotation is taken out and put back.

Seeded: GPUSLICE_CHAOS_SEED (printed) replays a run; GPUSLICE_CHAOS_CYCLES sets its length.
Every cycle hands one script to the container's systemd (`systemd-run`, so it runs on while
the test samples): on-demand starts with --no-block, sometimes a stop or start by hand of a
background unit, sometimes kill -9 / daemon-reload / restart of the controller after a random
delay, sometimes TOGGLED's annotation taken out or put back (and systemd reloaded). While it
plays, every sample of systemd's state must show at most one managed unit past its gate and
no held unit running; once it settles (no job queued, controller active) the
controller's status must match systemd: the same holder, nobody waiting, the same holds, and
the GPU in use whenever a background unit may run.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from gpuslice.core.decisions import Code
from tests.bed.container import Container
from tests.integration.jobs import describe, holding, reload, unit_states, write_job

SEED = int(os.environ.get("GPUSLICE_CHAOS_SEED", "20261130"))
CYCLES = int(os.environ.get("GPUSLICE_CHAOS_CYCLES", "200"))
BACKGROUND = {
    "bg80a.service": 80,
    "bg80b.service": 80,
    "bg75.service": 75,
    "bg90.service": 90,
}
# Its annotation comes and goes (never stopped or started by hand, so that it only ever runs
# from a start gpuslice granted): while it runs unannotated it keeps the GPU until it ends,
# and a start of gpuslice's on its way is stopped, so "at most one unit past its gate"
# counts it either way; unannotated and down, it is not gpuslice's to start. The most
# urgent background unit: it is the one that usually runs, or is being started.
TOGGLED = "bg75.service"
TOGGLE_DIR = "/var/lib/chaos"
ON_DEMAND = {"od10.service": (10, "0.1"), "od20.service": (20, "0.3"), "od30.service": (30, "0.6")}
UNITS = [*BACKGROUND, *ON_DEMAND]
PRIORITY = {**BACKGROUND, **{u: p for u, (p, _) in ON_DEMAND.items()}}
CTL = "gpuslice.service"
SETTLE_TIMEOUT = 25.0  # seconds for a cycle to settle (a controller restart takes ~1.5 s)
CTL_SPACING = 2.5  # seconds between controller restarts: StartLimitBurst=5 in 10 s
GATE_LATENCY = 1.0  # seconds
MAX_VIOLATIONS = 8  # enough to diagnose; stop early rather than spend CI time on more


@dataclass
class Chaos:
    bed: Container
    rng: random.Random
    cycle: int = 0
    script: str = ""
    held: set[str] = field(default_factory=set)  # stopped by hand, seen inactive since
    stopping: set[str] = field(default_factory=set)  # stopped by hand, stop not seen yet
    counts: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    last_ctl_restart: float = 0.0
    samples: int = 0
    start_pre_since: dict[str, float] = field(default_factory=dict)  # first seen at its gate
    annotated: bool = True  # TOGGLED's annotation, once this cycle's script has run
    running: list[str] = field(default_factory=list)  # past their gate at the last sample

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def violation(self, kind: str, detail: str = "") -> None:
        key = f"cycle {self.cycle}: {kind}"
        if key in self.violations:
            return  # one report per cycle and kind
        text = (
            f"VIOLATION seed={SEED} cycle={self.cycle}: {kind}\n{detail}\n"
            f"cycle script: {self.script}\n{describe(self.bed, UNITS)}\n"
            f"journal (last 60 lines, all units):\n{self.journal_tail()}"
        )
        print(text, flush=True)
        self.violations.append(key)

    def journal_tail(self) -> str:
        self.bed.run(["journalctl", "--sync"], check=False)
        out = self.bed.run(
            ["journalctl", "-n", "60", "--no-pager", "-o", "short-monotonic"], check=False
        )
        return out.stdout

    # -- one cycle ------------------------------------------------------------------------

    def plan(self, table: dict[str, dict[str, str]]) -> list[str]:
        """Shell commands for this cycle, chosen by the seeded generator."""
        rng, steps = self.rng, []
        running = holding({u: table[u] for u in BACKGROUND if u != TOGGLED})
        roll = rng.random()
        if roll < 0.08 and running and len(self.held) + len(self.stopping) < 2:
            unit = running[0]  # a stop by hand: a hold
            steps.append(f"systemctl stop --no-block {unit}")
            self.stopping.add(unit)
            self.count("hand stops")
        elif roll < 0.16 and self.held:
            unit = rng.choice(sorted(self.held))  # started by hand again: the hold lifts
            steps.append(f"systemctl start --no-block {unit}")
            self.held.discard(unit)
            self.count("hand starts")
        if rng.random() < 0.9:
            for unit in rng.sample(sorted(ON_DEMAND), rng.choice((1, 1, 1, 2))):
                if steps and rng.random() < 0.5:
                    steps.append(f"sleep 0.{rng.randint(0, 3)}")
                steps.append(f"systemctl start --no-block {unit}")
                self.count("on-demand starts")
        if rng.random() < 0.1:
            self.annotated = not self.annotated
            which = "annotated" if self.annotated else "plain"
            if steps:
                steps.append(f"sleep {rng.uniform(0, 0.5):.2f}")
            steps += [
                f"cp {TOGGLE_DIR}/{which} /etc/systemd/system/{TOGGLED}",
                "systemctl daemon-reload",
            ]
            self.count("annotation toggles")
        chaos = rng.random()
        spaced = time.monotonic() - self.last_ctl_restart >= CTL_SPACING
        delay = f"sleep {rng.uniform(0, 0.7):.2f}"
        if chaos < 0.12 and spaced:
            pid = f"$(systemctl show -P MainPID {CTL})"
            steps += [delay, f'pid={pid}; [ "$pid" -gt 0 ] && kill -9 "$pid"']
            self.last_ctl_restart = time.monotonic()
            self.count("kills")
        elif chaos < 0.20:
            steps += [delay, "systemctl daemon-reload"]
            self.count("daemon-reloads")
        elif chaos < 0.26 and spaced:
            steps += [delay, f"systemctl restart {CTL}"]
            self.last_ctl_restart = time.monotonic()
            self.count("controller restarts")
        return steps

    def play(self) -> None:
        table = unit_states(self.bed, UNITS)
        steps = self.plan(table)
        self.script = "; ".join(steps) or "true"
        unit = f"chaos-{self.cycle}.service"
        self.bed.run(
            ["systemd-run", "--quiet", "--no-block", "--collect", f"--unit={unit}",
             "sh", "-c", self.script],
        )  # fmt: skip
        self.settle(unit)

    # -- checks -----------------------------------------------------------------------------

    def sample(self, chaos_unit: str) -> dict[str, dict[str, str]]:
        """One look at systemd's truth; the invariants that hold at every instant."""
        self.samples += 1
        now = time.monotonic()
        table = unit_states(self.bed, [*UNITS, CTL, chaos_unit])
        managed = {u: table[u] for u in UNITS}
        running = holding(managed)
        if len(running) > 1:
            self.violation("two units past their gate on the one GPU", show(managed))
        for unit in sorted(self.stopping):
            if managed[unit]["ActiveState"] in ("inactive", "failed"):
                self.stopping.discard(unit)
                self.held.add(unit)
        for unit in sorted(self.held):
            if managed[unit]["ActiveState"] != "inactive":
                self.violation(f"hold lost: {unit} stopped by hand runs again", show(managed))
                self.held.discard(unit)  # reported once
        # Waiters first, by priority then arrival: a unit that passes its gate while a unit at
        # least as urgent has waited at its gate since well before it (GATE_LATENCY: the
        # time a gate may take to reach the controller) was served out of order.
        for unit in running:
            if unit in self.running:
                continue
            since = self.start_pre_since.get(unit, now)
            older = [
                w
                for w, t in self.start_pre_since.items()
                if w != unit
                and t < since - GATE_LATENCY
                and managed[w]["SubState"] == "start-pre"
                and PRIORITY[w] <= PRIORITY[unit]
            ]
            if older:
                self.violation(
                    f"{unit} (priority {PRIORITY[unit]}) went ahead of waiting "
                    + ", ".join(f"{w} (priority {PRIORITY[w]})" for w in older),
                    show(managed),
                )
        self.running = running
        for unit in UNITS:
            if managed[unit]["SubState"] == "start-pre":
                self.start_pre_since.setdefault(unit, now)
            else:
                self.start_pre_since.pop(unit, None)
        return table

    def waiters(self, table: dict[str, dict[str, str]]) -> list[str]:
        return [u for u in UNITS if table[u]["SubState"] == "start-pre"]

    def settled(self, table: dict[str, dict[str, str]], chaos_unit: str) -> bool:
        """Systemd's side is quiet: the script is done, the controller up, the GPU in use if a
        unit may use it, and the only jobs are starts waiting behind a unit at least as urgent
        (equal priority never preempts)."""
        if table[chaos_unit]["ActiveState"] in ("active", "activating", "deactivating"):
            return False
        if table[CTL]["ActiveState"] != "active" or table[CTL]["Job"] not in ("", "0"):
            return False
        if self.stopping:
            return False
        managed = {u: table[u] for u in UNITS}
        running = holding(managed)
        if any(u in ON_DEMAND for u in running):
            return False
        waiters = self.waiters(table)
        if any(table[u]["Job"] not in ("", "0") for u in UNITS if u not in waiters):
            return False
        if waiters and not (running and all(PRIORITY[running[0]] <= PRIORITY[w] for w in waiters)):
            return False
        eligible = [
            u
            for u in BACKGROUND
            if u not in self.held
            and table[u]["ActiveState"] != "failed"
            and (u != TOGGLED or self.annotated)
        ]
        return bool(running) or not eligible

    def agrees(self, table: dict[str, dict[str, str]]) -> str:
        """What the controller's status gets wrong about systemd's settled state ("" if
        nothing). Status is only read here: it costs a process start."""
        res = self.bed.run(
            ["timeout", "10", "gpuslice", "status", "--json"], check=False, timeout=30
        )
        if res.returncode != 0:
            return f"gpuslice status failed: {res.stderr.strip()}"
        data: dict[str, Any] = json.loads(res.stdout)
        running = holding({u: table[u] for u in UNITS})
        holders = [h["unit"] for g in data["gpus"] for h in g["holders"]]
        problems = []
        if sorted(holders) != sorted(running):
            problems.append(f"controller's holders {holders} != systemd's running {running}")
        waiting = sorted(w["unit"] for w in data["waiting"])
        if waiting != sorted(self.waiters(table)):
            problems.append(
                f"controller's waiting {waiting} != at their gate {self.waiters(table)}"
            )
        held = sorted(set(data["held"]) & set(BACKGROUND))
        if held != sorted(self.held):
            problems.append(f"controller's held {held} != stopped by hand {sorted(self.held)}")
        failed = [u for u in UNITS if table[u]["ActiveState"] == "failed"]
        if failed:
            problems.append(f"failed units {failed}")
        return "; ".join(problems)

    def settle(self, chaos_unit: str) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT
        disagreement = ""
        while True:
            table = self.sample(chaos_unit)
            now = time.monotonic()
            if self.settled(table, chaos_unit):
                disagreement = self.agrees(table)
                if not disagreement:
                    jobs = self.bed.systemctl("list-jobs", "--no-legend", "--no-pager").stdout
                    queued = {line.split()[1] for line in jobs.splitlines() if line.strip()}
                    if queued <= set(self.waiters(table)):
                        return
                    disagreement = f"jobs queued: {jobs.strip()}"
            if now >= deadline:
                break
            time.sleep(0.05)
        waiting = {u: round(now - t, 1) for u, t in self.start_pre_since.items()}
        self.violation(
            f"not settled within {SETTLE_TIMEOUT:g} s",
            f"at their gate (seconds): {waiting}\nlast disagreement: {disagreement or '-'}",
        )
        self.recover(table)

    def recover(self, table: dict[str, dict[str, str]]) -> None:
        """Put the bed back in order so that later cycles still test something."""
        if table[CTL]["ActiveState"] != "active":
            self.bed.systemctl("reset-failed", CTL, check=False)
            self.bed.systemctl("start", CTL, check=False, timeout=30)
        for unit in UNITS:
            if table[unit]["SubState"] == "start-pre" or table[unit]["ActiveState"] == "failed":
                self.bed.systemctl("stop", unit, check=False, timeout=30)  # a hold now
                self.bed.systemctl("reset-failed", unit, check=False)
                if unit in BACKGROUND:
                    self.held.add(unit)
        self.held = {
            u
            for u in self.held
            if self.bed.systemctl("is-active", u, check=False).stdout.strip() != "active"
        }
        self.stopping.clear()
        self.count("recoveries")


def show(table: dict[str, dict[str, str]]) -> str:
    """The sampled states, as seen at that instant."""
    return ", ".join(
        f"{u} {f['ActiveState']}/{f['SubState']} job={f['Job'] or '-'}" for u, f in table.items()
    )


@pytest.mark.timeout(600)
def test_chaos_against_systemds_truth(container: Container) -> None:
    bed = container
    print(f"chaos: GPUSLICE_CHAOS_SEED={SEED} GPUSLICE_CHAOS_CYCLES={CYCLES}", flush=True)
    for unit, priority in BACKGROUND.items():
        write_job(bed, unit, priority, "background")
    for unit, (priority, seconds) in ON_DEMAND.items():
        write_job(bed, unit, priority, exec_start=f"/bin/sleep {seconds}")
    bed.run(["mkdir", "-p", TOGGLE_DIR])
    bed.run(["cp", f"/etc/systemd/system/{TOGGLED}", f"{TOGGLE_DIR}/annotated"])
    write_job(bed, TOGGLED, None)
    bed.run(["cp", f"/etc/systemd/system/{TOGGLED}", f"{TOGGLE_DIR}/plain"])
    bed.run(["cp", f"{TOGGLE_DIR}/annotated", f"/etc/systemd/system/{TOGGLED}"])
    reload(bed)
    chaos = Chaos(bed, random.Random(SEED))
    chaos.settle("chaos-setup.service")  # a background unit fills the GPU
    started = time.monotonic()
    for cycle in range(1, CYCLES + 1):
        chaos.cycle = cycle
        chaos.play()
        if len(chaos.violations) >= MAX_VIOLATIONS:
            print(f"stopping early after {len(chaos.violations)} violations", flush=True)
            break
    took = time.monotonic() - started
    decided = [e.get("GPUSLICE_DECISION") for e in bed.journal_entries(f"_SYSTEMD_UNIT={CTL}")]
    chaos.counts["preemptions"] = decided.count(Code.PREEMPT.value)
    chaos.counts["refills"] = decided.count(Code.REQUEUE.value) + decided.count(Code.REFILL.value)
    summary = ", ".join(f"{k} {v}" for k, v in sorted(chaos.counts.items()))
    print(
        f"chaos seed {SEED}: {chaos.cycle} cycles in {took:.0f} s, {chaos.samples} samples; "
        f"{summary}; violations {len(chaos.violations)}",
        flush=True,
    )
    assert not chaos.violations, (
        f"seed {SEED} (replay: GPUSLICE_CHAOS_SEED={SEED}): "
        f"{len(chaos.violations)} violations:\n" + "\n".join(chaos.violations)
    )
