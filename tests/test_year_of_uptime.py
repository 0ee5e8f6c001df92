"""A year of uptime in a few seconds: nothing the controller keeps grows with history.

The controller runs as root for months while a job queue starts an instance per recording
(`tx@REC.service`), timers start background instances, units preempt each other, unit files
come and go, gates ask over D-Bus and clients ask for the status. Every container reachable
from the Controller (its modules' dicts, sets, lists, deques) is measured after a warm-up and
again after many more cycles of all of that: none may have grown, nor may `runtime_dir` or
the state file. One kept per instance, unit file, PID or caller grew without bound.
"""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path
from typing import Any

import pytest

from gpuslice import controller as controller_module
from gpuslice import gates as gates_module
from gpuslice.controller import Controller
from tests.test_controller import (
    UNIT_DIR,
    Bed,
    at_gate,
    run,
    saved_record,
    settle,
    state,
    write_unit,
)

WARM_UP = 8
CYCLES = 48
# Entries a container may hold more at the end than after the warm-up without growing with
# history: a read or call of the last cycle still in flight on a loaded host. One entry kept
# per unit file removed, the rarest churn here (every 4th cycle), grows by 10.
NOISE = 4
SENDER_PID = 5000  # the PID of cycle i's gate that asks over D-Bus: SENDER_PID + i


def sizes(root: object) -> dict[str, int]:
    """The length of each container reachable from `root` through gpuslice's own objects,
    by the path of attribute names that reaches it (the first 64 items of each followed)."""
    found: dict[str, int] = {}
    seen: set[int] = set()
    todo: list[tuple[str, Any]] = [("ctl", root)]
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen or isinstance(obj, str | bytes | int | float | type(None)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            found[path] = len(obj)
            todo += [(f"{path}[]", v) for v in list(obj.values())[:64]]
        elif isinstance(obj, list | set | frozenset | collections.deque | tuple):
            found[path] = len(obj)
            todo += [(f"{path}[]", v) for v in list(obj)[:64]]
        elif type(obj).__module__.startswith("gpuslice"):
            attrs = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
            for klass in type(obj).__mro__:
                for slot in getattr(klass, "__slots__", ()):
                    if hasattr(obj, slot):
                        attrs[slot] = getattr(obj, slot)
            todo += [(f"{path}.{name}", value) for name, value in attrs.items()]
    return found


def shown(bed: Bed, unit: str, active: str, sub: str, job: int = 0) -> None:
    """Systemd shows `unit` so, and signals it (with the job it names)."""
    path = f"/org/freedesktop/systemd1/job/{job}" if job else "/"
    bed.systemd.units[unit] = state(unit, active, sub, job, "start" if job else "")
    bed.controller.on_unit_changed(
        unit, {"ActiveState": active, "SubState": sub, "Job": (job, path)}
    )


def job_new(ctl: Controller, job: int, unit: str) -> None:
    ctl.on_job_new(job, f"/org/freedesktop/systemd1/job/{job}", unit)


def job_removed(ctl: Controller, job: int, unit: str, result: str = "done") -> None:
    ctl.on_job_removed(job, f"/org/freedesktop/systemd1/job/{job}", unit, result)


async def granted_and_running(bed: Bed, unit: str, job: int) -> None:
    """Someone starts `unit` (start job `job`): granted at its pipe, it runs."""
    ctl = bed.controller
    job_new(ctl, job, unit)
    shown(bed, unit, "activating", "start-pre", job)
    ctl.on_unit_changed(unit, at_gate(job.to_bytes(16, "big")))
    await settle()
    shown(bed, unit, "active", "running")
    job_removed(ctl, job, unit)


async def gated_run(bed: Bed, unit: str, job: int, end: str = "dead") -> None:
    """Someone starts `unit`: granted at its pipe, it runs, and ends by itself (`end`)."""
    await granted_and_running(bed, unit, job)
    shown(bed, unit, "failed" if end == "failed" else "inactive", end)
    await settle()
    del bed.systemd.units[unit]


async def preempted(bed: Bed, unit: str, job: int) -> None:
    """`unit` (60) runs, u.service (10) preempts it, ends; a unit with Requeue=yes comes
    back, and then ends by itself."""
    ctl = bed.controller
    await granted_and_running(bed, unit, job)
    shown(bed, "u.service", "activating", "start-pre", job + 1)
    ctl.on_unit_changed("u.service", at_gate((job + 1).to_bytes(16, "big")))
    await settle()
    assert ("stop", unit) in bed.systemd.calls[-4:], bed.systemd.calls[-4:]
    stop = bed.systemd._jobs  # the job its StopUnit queued
    job_new(ctl, stop, unit)
    shown(bed, unit, "deactivating", "stop", stop)
    shown(bed, unit, "inactive", "dead")
    job_removed(ctl, stop, unit)
    await settle()
    job_removed(ctl, job + 1, "u.service")
    shown(bed, "u.service", "active", "running")
    shown(bed, "u.service", "inactive", "dead")
    await settle()
    if ("start", unit) in bed.systemd.calls[-4:]:
        await granted_and_running(bed, unit, bed.systemd._jobs)
        shown(bed, unit, "inactive", "dead")
        await settle()
    bed.systemd.units.pop(unit, None)


async def cycle(bed: Bed, tmp_path: Path, i: int) -> None:
    """A day's worth of churn, one of each."""
    ctl = bed.controller
    job = 100 * (i + 1)
    await gated_run(bed, f"tx@rec-{i:06d}.service", job)
    await gated_run(bed, f"tx@bad-{i:06d}.service", job + 2, end="failed")
    await gated_run(bed, f"bg@day-{i:06d}.service", job + 4)
    await preempted(bed, f"p@job-{i:06d}.service", job + 10)
    await preempted(bed, f"q@job-{i:06d}.service", job + 20)
    # a gate that asks over D-Bus, from a caller that then vanishes
    unit, sender = f"tx@dbus-{i:06d}.service", f":1.{1000 + i}"
    job_new(ctl, job + 30, unit)
    shown(bed, unit, "activating", "start-pre", job + 30)
    await bed.acquire(unit, sender, SENDER_PID + i)
    job_removed(ctl, job + 30, unit)
    shown(bed, unit, "inactive", "dead")
    await settle()
    del bed.systemd.units[unit], bed.systemd.pids[sender]
    # starts that never reach their gate: a dependency failed, a cancel, a stop of one down
    for k, result in enumerate(("dependency", "canceled", "done")):
        unit = f"tx@odd{k}-{i:06d}.service"
        job_new(ctl, job + 40 + k, unit)
        await settle()
        job_removed(ctl, job + 40 + k, unit, result)
        await settle()
    # `systemctl status` loads a finished one again; callers ask for the status
    shown(bed, f"tx@rec-{i:06d}.service", "inactive", "dead")
    del bed.systemd.units[f"tx@rec-{i:06d}.service"]
    for k in range(3):
        answer = ctl.status_for(f":1.{90000 + 3 * i + k}")
        if not isinstance(answer, str):
            answer.close()
    # a job queue's own unit file, run and removed (a daemon-reload each time)
    if i % 4 == 0:
        unit = f"job-{i:06d}.service"
        write_unit(tmp_path, unit, "Priority=70\n")
        ctl.on_reloading(False)
        await until_scanned(ctl, unit, True)
        await gated_run(bed, unit, job + 50)
        (tmp_path / "root" / UNIT_DIR / unit).unlink()
        ctl.on_reloading(False)
        await until_scanned(ctl, unit, False)


async def until_scanned(ctl: Controller, unit: str, annotated: bool) -> None:
    for _ in range(3000):
        scanned = (ctl.spec_for(unit) is not None) == annotated and ctl.rescans.task is None
        if scanned and not ctl._rewatching:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{unit} not scanned")


async def quiet() -> None:
    """The reads and calls the last cycle sent are answered (the fakes answer at once)."""
    for _ in range(5):
        await asyncio.sleep(0.01)
        await settle()


def files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_a_year_of_churn_grows_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a failure's GPUs are kept for a restart's signal that never comes here: not a second
    monkeypatch.setattr(controller_module, "RESTART_SIGNAL_WAIT", 0.0)
    monkeypatch.setattr(
        gates_module, "unit_of_pid", lambda pid: f"tx@dbus-{pid - SENDER_PID:06d}.service"
    )
    bed = Bed(
        tmp_path,
        {
            "a.service": "Priority=50\n",
            "u.service": "Priority=10\n",
            "tx@.service": "Priority=50\n",
            "bg@.service": "Priority=90\nType=background\n",
            "p@.service": "Priority=60\n",
            "q@.service": "Priority=60\nRequeue=no\n",
        },
        [],
    )
    runtime = Path(bed.config.runtime_dir)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        for i in range(WARM_UP):
            await cycle(bed, tmp_path, i)
        await quiet()
        before, kept, record = sizes(ctl), files(runtime), saved_record(bed)
        for i in range(WARM_UP, CYCLES):
            await cycle(bed, tmp_path, i)
        await quiet()
        after = sizes(ctl)
        grown = {p: (before.get(p, 0), n) for p, n in after.items() if n - before.get(p, 0) > NOISE}
        assert grown == {}
        assert files(runtime) == kept
        assert saved_record(bed) == record
        assert ctl.scheduler.annotated() == {"a.service", "u.service"}

    run(test)
