"""A daemon-reload that comes while the controller starts.

Start-up subscribes to systemd's signals, reads the unit files, lists the units, rebuilds
what it knew from the state file, and only then judges a start. The unit files were read
when the controller was built, before it subscribed: a daemon-reload in between (its
Reloading signal sent to nobody) was never read, and the controller judged on the
annotations before it until the next reload. And a daemon-reload heard during start-up was
read only after start-up had judged, on the annotations before it, the starts it found at
their gate (listed, signalled, or asking over D-Bus): low.service was stopped for a start
that reload had made less urgent, or no longer managed. And an instance whose start job
was announced during start-up, after ListUnits, was not matched once start-up was done.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from gpuslice import controller as controller_module
from gpuslice.annotations import Scan, scan
from gpuslice.core.scheduler import SavedState
from gpuslice.tracker import UnitState
from tests.test_controller import (
    Bed,
    at_gate,
    run,
    settle,
    state,
    until,
    write_unannotated,
    write_unit,
)
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import cgroup_of as cgroup_of  # a fixture

URGENT = "urgent.service"
JOB = "/org/freedesktop/systemd1/job/7"
EDITS = ["less urgent", "unannotated"]


def low_holds_gpu_0(tmp_path: Path, cgroup_of: dict[int, str], urgent: UnitState) -> Bed:
    """low.service (90) runs on the one GPU (saved); urgent.service (10) is shown as
    `urgent`; its gate asks from PID 4242."""
    bed = Bed(
        tmp_path,
        {"low.service": "Priority=90\n", URGENT: "Priority=10\n"},
        [state("low.service", "active", "running"), urgent],
        SavedState(holders={"low.service": ((0,), "running", 1, "")}, seq=1),
    )
    cgroup_of[4242] = URGENT
    return bed


def at_its_gate() -> UnitState:
    return state(URGENT, "activating", "start-pre", 7, "start")


def edit(tmp_path: Path, how: str) -> None:
    """`gpuslice enroll urgent --priority 95`, or its annotation taken out."""
    if how == "less urgent":
        write_unit(tmp_path, URGENT, "Priority=95\n")
    else:
        write_unannotated(tmp_path, URGENT)


def judged_on_the_edit(bed: Bed, how: str) -> None:
    """low.service kept its GPU; urgent.service waits behind it, or is no longer managed."""
    ctl = bed.controller
    assert ("stop", "low.service") not in bed.systemd.calls
    assert ctl.scheduler.grants() == {"low.service": frozenset({0})}
    assert ctl.scheduler.is_waiting(URGENT) is (how == "less urgent")
    if how == "less urgent":
        spec = ctl.spec_for(URGENT)
        assert spec is not None and spec.priority == 95
    else:
        assert ctl.spec_for(URGENT) is None


@pytest.mark.parametrize("how", EDITS)
def test_a_daemon_reload_before_start_up_subscribed_is_read(
    tmp_path: Path, cgroup_of: dict[int, str], how: str
) -> None:
    """The daemon was built (gpuslice.service's ExecStart=, its config read), then an admin
    edited urgent.service and ran daemon-reload before the controller subscribed: its
    Reloading signal reached nobody. Start-up reads the unit files after it subscribes."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of, at_its_gate())
    edit(tmp_path, how)

    async def test() -> None:
        await bed.controller.start()
        await settle()
        judged_on_the_edit(bed, how)

    run(test)


@pytest.mark.parametrize("how", EDITS)
def test_a_daemon_reload_while_start_up_reads_the_unit_files_is_read_again(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The daemon-reload ends while start-up reads the unit files, after the read of
    urgent.service's: its Reloading signal is newer than that read, which the rescan it asks
    for replaces, not the other way round; urgent.service's start, at its gate, waits for
    that rescan."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of, at_its_gate())
    scans: list[Scan] = []

    async def test() -> None:
        ctl = bed.controller
        loop = asyncio.get_running_loop()

        def reloaded_meanwhile(root: str) -> Scan:
            result = scan(root)
            if not scans:
                edit(tmp_path, how)
                loop.call_soon_threadsafe(ctl.on_reloading, False)
                threading.Event().wait(0.02)  # the signal is read before this scan ends
            scans.append(result)
            return result

        monkeypatch.setattr(controller_module, "scan", reloaded_meanwhile)
        await ctl.start()
        await until(lambda: len(scans) == 2 and ctl.rescans.task is None)
        await settle()
        judged_on_the_edit(bed, how)

    run(test)


@pytest.mark.parametrize("way", ["listed", "signal", "dbus"])
@pytest.mark.parametrize("how", EDITS)
def test_a_start_at_its_gate_during_start_up_waits_for_the_reload_start_up_heard(
    tmp_path: Path, cgroup_of: dict[int, str], way: str, how: str
) -> None:
    """urgent.service is at its gate while the controller starts (shown in ListUnits, its
    gate asking over D-Bus too, or signalled after ListUnits) and an admin's daemon-reload
    ends during ListUnits, after start-up read the unit files. Judged at start-up on the
    annotations before the reload, urgent.service (10) had low.service (90) stopped. It is
    judged once the rescan that reload asks for is read, as a start is once the controller
    runs."""
    shown = state(URGENT, "inactive", "dead") if way == "signal" else at_its_gate()
    bed = low_holds_gpu_0(tmp_path, cgroup_of, shown)
    ctl = bed.controller
    list_units = bed.systemd.list_units

    async def reloaded_while_listing() -> list[UnitState]:
        units = await list_units()
        edit(tmp_path, how)
        ctl.on_reloading(False)
        bed.systemd.units[URGENT] = at_its_gate()
        if way == "signal":
            ctl.on_unit_changed(URGENT, {**at_gate(), "Job": (7, JOB)})
        elif way == "dbus":
            bed.systemd.pids[":1.9"] = 4242
            bed.service.call(URGENT, ":1.9")
            ctl.on_acquire(URGENT, ":1.9")
        return units

    bed.systemd.list_units = reloaded_while_listing  # type: ignore[method-assign]

    async def test() -> None:
        await ctl.start()
        await until(lambda: ctl.rescans.task is None)
        await settle()
        judged_on_the_edit(bed, how)
        if how == "unannotated" and way == "dbus":
            assert bed.service.granted == [(URGENT, "")]  # let through, no longer managed

    run(test)


def test_a_start_at_its_gate_at_start_up_with_no_reload_is_judged_at_once(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """No daemon-reload during start-up: urgent.service, at its gate, is judged by start-up
    itself (its victim stopped before READY=1), not held back for a rescan."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of, at_its_gate())

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ("stop", "low.service") in bed.systemd.calls
        assert ctl.rescans.task is None and ctl.scheduler.is_waiting(URGENT)

    run(test)


INSTANCE = "job@a.service"


@pytest.mark.parametrize("ends", [False, True])
def test_an_instance_whose_start_came_during_start_up_is_still_heard_once_it_is_ready(
    tmp_path: Path, ends: bool
) -> None:
    """job@a.service's start job is announced (JobNew) after ListUnits answered, before
    start-up is done: systemd's signals of every unit reach the controller until then, and
    start-up ends by matching those of the units that matter only (_rewatch). Taken in
    only once ready, that JobNew never made the instance one of them: its gate, asking over
    D-Bus, was granted GPU 0, and its end was never heard (nor read: the audits read matched
    units only), its GPU held until the next re-match. One that ended before start-up was
    done (its down buffered with its other signals) is not kept matched."""
    bed = Bed(tmp_path, {"job@.service": "Priority=50\n"}, [])
    ctl = bed.controller
    list_units = bed.systemd.list_units

    async def announced_after_listing() -> list[UnitState]:
        units = await list_units()
        ctl.on_job_new(7, JOB, INSTANCE)
        if ends:
            ctl.on_unit_changed(INSTANCE, {**at_gate(), "Job": (7, JOB)})
            ctl.on_unit_changed(INSTANCE, {"ActiveState": "failed", "SubState": "failed"})
            ctl.on_unit_changed(INSTANCE, {"Job": (0, "/")})
        return units

    bed.systemd.list_units = announced_after_listing  # type: ignore[method-assign]

    async def test() -> None:
        await ctl.start()
        await settle()
        assert bed.systemd.watched is not None
        assert (INSTANCE in bed.systemd.watched) is not ends
        assert (INSTANCE in ctl.instances.announced) is not ends

    run(test)
