"""A unit systemd stops along with a victim of gpuslice's (it `Requires=`, `BindsTo=` or is
`PartOf=` it) was stopped by gpuslice's stop, not someone's: preempted, not held, on the
fakes of tests/test_controller.py (Controller._stopped_with, Scheduler.stopped_with).

README, "Dependencies between GPU units". Held, the more urgent unit that needs a less
urgent victim never came back, and the victim came back on its GPU.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from gpuslice import controller as controller_module
from gpuslice import rereads as rereads_module
from gpuslice.controller import Controller
from gpuslice.core.scheduler import Phase, SavedState
from gpuslice.systemd import SystemdError
from gpuslice.tracker import UnitState
from tests.test_controller import (
    NO_REPLY,
    Bed,
    _no_notify_socket,  # noqa: F401  (autouse: as in tests/test_controller.py)
    bed_config,
    goes_down,
    holding_a_gpu_each,
    messages,
    run,
    settle,
    state,
    until,
)
from tests.test_controller import cgroup_of as cgroup_of  # a fixture

B, C, A = "b.service", "c.service", "a.service"
NEEDS_NONE: dict[str, list[str]] = {"Requires": [], "BindsTo": [], "PartOf": []}
STOP_OF_C = "/org/freedesktop/systemd1/job/77"


def _bed(tmp_path: Path, cgroups: dict[int, str], c_section: str = "") -> Bed:
    """Two GPUs: B (50) on GPU 0, C (40, `c_section`) on GPU 1; A (10) down, its gate's
    process (4242) in its cgroup."""
    cgroups[4242] = A
    return holding_a_gpu_each(
        tmp_path,
        {B: "Priority=50\n", C: f"Priority=40\n{c_section}"},
        down={A: "Priority=10\n"},
        config=bed_config(tmp_path, gpus=2),
    )


async def _a_preempts_b_and_c_goes_down(bed: Bed) -> None:
    """A's gate asks: B, the least urgent, is stopped for it; systemd stops C first (its
    stop job announced, then its down), as it does a unit that needs B and is `After=` it."""
    ctl = bed.controller
    await ctl.start()
    await settle()
    await bed.acquire(A, ":1.9", 4242)
    assert bed.systemd.calls[-1] == ("stop", B)
    ctl.on_job_new(77, STOP_OF_C, C)
    goes_down(bed, C)
    await settle()


def _started(bed: Bed) -> list[str]:
    return [unit for what, unit in bed.systemd.calls if what == "start"]


@pytest.mark.parametrize("prop", ["Requires", "BindsTo", "PartOf"])
def test_a_unit_stopped_with_a_victim_it_needs_is_preempted_and_comes_back_first(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture, prop: str
) -> None:
    """systemd says C needs B (`prop`): C is preempted, not held, and said so. It is not
    started while B's stop runs (its start would pull B's start along, which cancels that
    stop); once B is down and A runs on GPU 0, C, more urgent than B, comes back on GPU 1
    (B after it)."""
    bed = _bed(tmp_path, cgroup_of)
    bed.systemd.needed[C] = {**NEEDS_NONE, prop: ["x.service", B]}

    async def test() -> None:
        ctl = bed.controller
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await _a_preempts_b_and_c_goes_down(bed)
        assert ("needs", C) in bed.systemd.calls
        assert C not in ctl.scheduler.held
        assert C in ctl.scheduler.preempted
        assert (
            f"{C} (priority 40) was stopped with {B} (its {prop}=), which gpuslice preempted "
            f"for {A} (priority 10): preempted with it, not held"
        ) in messages(caplog)
        assert _started(bed) == []  # not while B's stop runs: C's start would cancel it
        goes_down(bed, B)
        await settle()
        assert bed.service.granted == [(A, "0")]
        assert _started(bed) == [C]
        assert B in ctl.scheduler.preempted
        assert ctl.scheduler.snapshot().held == []

    run(test)


def test_a_unit_stopped_with_a_victim_and_requeue_no_is_preempted_not_brought_back(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Requeue=no: preempted like its victim, so not brought back (and said so), as any
    preempted unit with Requeue=no; not held either."""
    bed = _bed(tmp_path, cgroup_of, "Requeue=no\n")
    bed.systemd.needed[C] = {**NEEDS_NONE, "Requires": [B]}

    async def test() -> None:
        ctl = bed.controller
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await _a_preempts_b_and_c_goes_down(bed)
        assert C not in ctl.scheduler.held
        assert f"{C} (priority 40) preempted; Requeue=no, not restarting" in messages(caplog)
        goes_down(bed, B)
        await settle()
        assert _started(bed) == [B]  # C is not brought back: B comes back on GPU 1

    run(test)


@pytest.mark.parametrize(
    "needed",
    [NEEDS_NONE, SystemdError("org.freedesktop.DBus.Error.TimedOut", "no answer")],
    ids=["needs-nothing-of-it", "read-fails"],
)
def test_a_unit_someone_stops_while_gpuslice_stops_another_is_still_held(
    tmp_path: Path, cgroup_of: dict[int, str], needed: dict[str, list[str]] | SystemdError
) -> None:
    """C needs nothing of B (a person's `systemctl stop C` as B is preempted), or what it
    needs cannot be read: the stop was someone's, C is held as before, never brought back."""
    bed = _bed(tmp_path, cgroup_of)
    bed.systemd.needed[C] = needed

    async def test() -> None:
        ctl = bed.controller
        await _a_preempts_b_and_c_goes_down(bed)
        assert ("needs", C) in bed.systemd.calls
        assert ctl.scheduler.snapshot().held == [C]
        goes_down(bed, B)
        await settle()
        assert _started(bed) == [B]

    run(test)


def test_a_unit_stopped_while_gpuslice_stops_nothing_is_held_with_no_read(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """No stop of gpuslice's under way: a unit's stop is someone's, and nothing is read."""
    bed = _bed(tmp_path, cgroup_of)
    bed.systemd.needed[C] = {**NEEDS_NONE, "Requires": [B]}

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        ctl.on_job_new(77, STOP_OF_C, C)
        goes_down(bed, C)
        await settle()
        assert ctl.scheduler.snapshot().held == [C]
        assert ("needs", C) not in bed.systemd.calls

    run(test)


@pytest.mark.parametrize(
    ("needed", "back"), [({"Requires": [B]}, C), ({"Requires": []}, B)], ids=["needs-it", "not"]
)
def test_a_victim_down_before_the_read_answers_comes_back_only_after_the_answer(
    tmp_path: Path, cgroup_of: dict[int, str], needed: dict[str, list[str]], back: str
) -> None:
    """B stops at once, before systemd answers what C needs: B is not brought back
    meanwhile (back first, it took GPU 1, and C, more urgent, waited for it); once the
    answer comes, C comes back if it needs B, else B does (C held)."""
    bed = _bed(tmp_path, cgroup_of)
    answer = asyncio.Event()

    async def slow_needs(name: str) -> dict[str, list[str]]:
        bed.systemd.calls.append(("needs", name))
        await answer.wait()
        return {**NEEDS_NONE, **needed}

    bed.systemd.needs = slow_needs  # type: ignore[method-assign]

    async def test() -> None:
        await _a_preempts_b_and_c_goes_down(bed)
        goes_down(bed, B)
        await settle()
        assert bed.service.granted == [(A, "0")]
        assert _started(bed) == []
        answer.set()
        await settle()
        assert _started(bed) == [back]

    run(test)


def test_a_unit_someone_stopped_before_gpuslice_stopped_what_it_needs_is_held(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """A person's `systemctl stop C` is under way (job 5) when A preempts B (job 11):
    systemd merges the stop of C that ours makes into the person's, made before ours. The
    job that took C down is older than B's stop: someone's; C is held, nothing is read."""
    bed = _bed(tmp_path, cgroup_of)
    bed.systemd.needed[C] = {**NEEDS_NONE, "Requires": [B]}
    bed.systemd._jobs = 10
    theirs = "/org/freedesktop/systemd1/job/5"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        ctl.on_job_new(5, theirs, C)
        ctl.on_unit_changed(
            C, {"ActiveState": "deactivating", "SubState": "stop-sigterm", "Job": (5, theirs)}
        )
        await bed.acquire(A, ":1.9", 4242)
        assert bed.systemd.calls[-1] == ("stop", B)
        ours = "/org/freedesktop/systemd1/job/11"
        ctl.on_job_new(11, ours, B)
        ctl.on_unit_changed(B, {"Job": (11, ours)})
        down = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
        ctl.on_unit_changed(C, down)
        await settle()
        assert ctl.scheduler.snapshot().held == [C]
        assert ("needs", C) not in bed.systemd.calls

    run(test)


def test_a_unit_stopped_with_a_victim_someone_stopped_is_held_like_it(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """gpuslice's stop of B merged into a person's stop of B, made before it: B is held
    (README), and C, which systemd stopped with B, is held like it, not brought back (its
    start would start B again)."""
    bed = _bed(tmp_path, cgroup_of)
    bed.systemd.needed[C] = {**NEEDS_NONE, "Requires": [B]}
    theirs = "/org/freedesktop/systemd1/job/5"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        ctl.on_job_new(5, theirs, B)  # the person's stop
        bed.systemd.stop_jobs[B] = theirs  # ours joins it
        await bed.acquire(A, ":1.9", 4242)
        assert bed.systemd.calls[-1] == ("stop", B)
        ctl.on_job_new(77, STOP_OF_C, C)
        goes_down(bed, C)
        await settle()
        goes_down(bed, B)
        await settle()
        assert ctl.scheduler.snapshot().held == [B, C]
        assert _started(bed) == []

    run(test)


OWN_JOB = (
    "Transaction for b.service/stop is destructive (b.service has 'start' job queued, but 'stop'"
    " is included in transaction)."
)


@pytest.mark.parametrize(
    "needed",
    [{"Requires": [B]}, NEEDS_NONE, {"third": [B]}],
    ids=["needs-it", "not", "a-third-start-needs-it"],
)
def test_a_stop_refused_for_the_victims_own_start_is_not_forced_over_its_waiters_start(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    caplog: pytest.LogCaptureFixture,
    needed: dict[str, list[str]],
) -> None:
    """Systemd refuses B's stop in mode "fail" naming B's own start job, queued in one
    transaction with the start of A (A `Requires=` B, `After=` it). Sent again in mode
    "replace", it cancelled A's start too, which was then taken for someone's stop (the bed's
    test_a_unit_needed_by_a_start_is_preempted_again_once_that_start_is_gone). Systemd says A
    needs B: the refusal holds while A waits, as one naming A's start. A needs nothing of B:
    the stop is sent again in mode "replace", and A is granted once B is down. Unless a
    third unit D that needs B has a job (its start queued behind B's): the stop sent again
    cancelled it (the bed's test_a_unit_still_starting_is_not_preempted_over_a_start_...),
    so the refusal holds as one naming D's start would."""
    d = "d.service"
    third = "third" in needed
    # not annotated, D's start queued behind B's (`Requires=` + `After=` B)
    bed = _b_refused(tmp_path, cgroup_of, d if third else None, NEEDS_NONE if third else needed)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.acquire(A, ":1.9", 4242)
            await settle()
        assert ("needs", A) in bed.systemd.calls
        if needed is not NEEDS_NONE:  # the jobs of the units that need B, read
            assert ("units_state", d if third else A) in bed.systemd.calls
        if needed is NEEDS_NONE:
            assert bed.systemd.calls[-1] == ("stop-replacing", B)
            goes_down(bed, B)
            await settle()
            assert bed.service.granted == [(A, "0")]
            return
        assert ("stop-replacing", B) not in bed.systemd.calls
        assert ctl.scheduler.unstoppable_while == {B: A}
        assert bed.service.granted == []
        if not third:
            assert f"will not try to stop it again while {A} waits" in " ".join(messages(caplog))
            return
        said = f"stopping {B} would cancel the jobs of {d}, which need it: not stopped"
        assert said in messages(caplog)
        assert f"will try to stop it again once a job of {d} ends" in " ".join(messages(caplog))
        # D's start ends (it runs now): the refusal was for that job alone, so A's
        # preemption is decided again, not left to wait for B's whole run
        stops = bed.systemd.calls.count(("stop", B))
        bed.systemd.units[d] = UnitState(d, "active", "running", 0)
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            ctl.on_job_removed(12, "/org/freedesktop/systemd1/job/12", d, "done")
            await settle()
        said = f"job 12 of {d} ended, for which stopping {B} was refused: it may be stopped again"
        assert said in messages(caplog)
        assert bed.systemd.calls.count(("stop", B)) == stops + 1
        for _ in range(10):  # told again: nothing more
            ctl.on_job_removed(12, "/org/freedesktop/systemd1/job/12", d, "done")
        await settle()
        assert bed.systemd.calls.count(("stop", B)) == stops + 1
        goes_down(bed, B)
        await settle()
        assert bed.service.granted == [(A, "0")]

    run(test)


def test_a_unit_whose_stop_job_is_newer_than_gpuslices_stop_of_what_it_needs_is_preempted(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """B's stop (ours) shows as job 11, and C goes down by job 77, made after it: the stop
    systemd made of C along with ours, not someone's older one. C needs B: preempted with
    it, not held (Controller._stop_before compares the two jobs' numbers)."""
    bed = _bed(tmp_path, cgroup_of)
    bed.systemd.needed[C] = {**NEEDS_NONE, "Requires": [B]}

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        await bed.acquire(A, ":1.9", 4242)
        assert bed.systemd.calls[-1] == ("stop", B)
        ours = "/org/freedesktop/systemd1/job/11"
        ctl.on_job_new(11, ours, B)
        ctl.on_unit_changed(B, {"Job": (11, ours)})
        ctl.on_job_new(77, STOP_OF_C, C)
        goes_down(bed, C)
        await settle()
        assert ("needs", C) in bed.systemd.calls
        assert C in ctl.scheduler.preempted
        assert ctl.scheduler.snapshot().held == []

    run(test)


def test_a_failed_read_of_what_a_unit_needs_is_said_in_the_debug_log(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """What C needs cannot be read: the journal's debug level says which unit and why (the
    hold stands: tests above)."""
    bed = _bed(tmp_path, cgroup_of)
    bed.systemd.needed[C] = SystemdError("org.freedesktop.DBus.Error.TimedOut", "no answer")

    async def test() -> None:
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            await _a_preempts_b_and_c_goes_down(bed)
        assert (
            f"cannot read what {C} needs: org.freedesktop.DBus.Error.TimedOut: no answer"
        ) in messages(caplog)
        assert bed.controller.counters.errors["dbus_call_errors"] >= 1

    run(test)


def test_a_suspended_unit_seen_down_while_gpuslice_stops_what_it_needs_is_preempted(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """C, suspended by gpuslice (frozen: it cannot end by itself), is seen down with no job
    while gpuslice stops B, which C needs: booked as someone's stop (held), as a suspended
    unit's down is, and then read like any other such hold (README): preempted with B."""
    cgroup_of[4242] = A
    D = "d.service"
    bed = Bed(
        tmp_path,
        {B: "Priority=50\n", C: "Priority=40\n", D: "Priority=45\n", A: "Priority=10\n"},
        [
            state(B, "active", "running"),
            state(C, "active", "running"),
            state(D, "active", "running"),
            state(A, "inactive", "dead"),
        ],
        SavedState(
            holders={B: ((0,), "running", 1, ""), D: ((1,), "running", 2, "")},
            suspended={C: ((1,), 3)},
            seq=3,
        ),
        config=bed_config(tmp_path, gpus=2),
    )
    bed.systemd.needed[C] = {**NEEDS_NONE, "Requires": [B]}

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert ctl.scheduler.suspended_units() == [C]
        await bed.acquire(A, ":1.9", 4242)
        assert bed.systemd.calls[-1] == ("stop", B)
        goes_down(bed, C)
        await settle()
        assert ("needs", C) in bed.systemd.calls
        assert C in ctl.scheduler.preempted
        assert ctl.scheduler.snapshot().held == []

    run(test)


def _job(number: int) -> str:
    return f"/org/freedesktop/systemd1/job/{number}"


AT_GATE = {"ActiveState": "activating", "SubState": "start-pre"}


def _b_refused(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    d: str | None,
    a_needs: dict[str, list[str]] = NEEDS_NONE,
) -> Bed:
    """B (50) holds the one GPU, A (10, needing `a_needs`) down; B's stop is refused for
    B's own job while `d` (`Requires=` B), if any, has a start (job 12) queued behind B's."""
    cgroup_of[4242] = A
    bed = holding_a_gpu_each(
        tmp_path,
        {B: "Priority=50\n"},
        down={A: "Priority=10\n"},
        config=bed_config(tmp_path, gpus=1),
    )
    destructive = "org.freedesktop.systemd1.TransactionIsDestructive"
    bed.systemd.refused_stops[B] = [SystemdError(destructive, OWN_JOB)]
    bed.systemd.needed[A] = a_needs
    if d is not None:
        bed.systemd.needed[d] = {**NEEDS_NONE, "Requires": [B]}
        bed.systemd.units[d] = UnitState(d, "inactive", "dead", 12, "start")
    return bed


def _a_behind_b(tmp_path: Path, cgroup_of: dict[int, str]) -> Bed:
    """B (50) holds the one GPU; A (60, less urgent) down, its gate's process 4242."""
    cgroup_of[4242] = A
    return holding_a_gpu_each(
        tmp_path,
        {B: "Priority=50\n"},
        down={A: "Priority=60\n"},
        config=bed_config(tmp_path, gpus=1),
    )


async def _waits_at_its_gate(bed: Bed) -> Controller:
    """The controller started; someone's start of A (job 20) at its gate, which asks."""
    ctl = bed.controller
    await ctl.start()
    await settle()
    ctl.on_job_new(20, _job(20), A)
    bed.systemd.units[A] = state(A, "activating", "start-pre", 20, "start")
    ctl.on_unit_changed(A, {**AT_GATE, "Job": (20, _job(20))})
    await bed.acquire(A, ":1.9", 4242)
    return ctl


@pytest.mark.parametrize("shown", ["before", "after"], ids=["shown-first", "shown-late"])
def test_a_waiter_someone_stops_at_its_gate_preempts_no_one_when_a_refusals_job_ends(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture, shown: str
) -> None:
    """B's stop was refused for D's start (D `Requires=` + `After=` B), which A, waiting at
    its gate, does not need: the refusal holds until D's job ends. `systemctl stop a d b`:
    A's stop replaces A's start at its gate (JobRemoved `canceled`, JobNew, then A's
    PropertiesChanged naming the stop job, still `start-pre` until its gate is killed), then
    D's stop cancels D's start, which ends the refusal. A is leaving: someone stopped it, so
    it preempts no one, whether its PropertiesChanged comes before D's job ends (`shown`) or
    after. It preempted B (the bed's `systemctl stop a d b`, CI), and B came back after."""
    d = "d.service"
    bed = _b_refused(tmp_path, cgroup_of, d)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        ctl.on_job_new(20, _job(20), A)  # someone's `systemctl start a`
        bed.systemd.units[A] = state(A, "activating", "start-pre", 20, "start")
        ctl.on_unit_changed(A, {**AT_GATE, "Job": (20, _job(20))})
        await bed.acquire(A, ":1.9", 4242)
        await settle()
        assert f"will try to stop it again once a job of {d} ends" in " ".join(messages(caplog))
        stops = [call for call in bed.systemd.calls if call[1] == B]
        # `systemctl stop a d b`: A's stop replaces its start at its gate
        ctl.on_job_removed(20, _job(20), A, "canceled")
        ctl.on_job_new(21, _job(21), A)
        bed.systemd.units[A] = state(A, "activating", "start-pre", 21, "stop")
        if shown == "before":
            ctl.on_unit_changed(A, {**AT_GATE, "Job": (21, _job(21))})
        # D's stop cancels D's start: the refusal's job ends
        bed.systemd.units[d] = UnitState(d, "inactive", "dead", 0)
        ctl.on_job_removed(12, _job(12), d, "canceled")
        await settle()
        if shown == "after":
            ctl.on_unit_changed(A, {**AT_GATE, "Job": (21, _job(21))})
            await settle()
        assert [call for call in bed.systemd.calls if call[1] == B] == stops
        assert not ctl.scheduler.is_waiting(A)
        # A's gate is killed, A goes down; B's stop (b's, from the same command) too
        ctl.on_unit_changed(A, {"ActiveState": "deactivating", "SubState": "stop-sigterm"})
        bed.systemd.units[A] = state(A, "inactive", "dead")
        ctl.on_unit_changed(A, {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")})
        ctl.on_job_removed(21, _job(21), A, "done")
        ctl.on_job_new(22, _job(22), B)
        goes_down(bed, B)
        ctl.on_job_removed(22, _job(22), B, "done")
        await settle()
        assert [call for call in bed.systemd.calls if call[1] == B] == stops
        assert _started(bed) == []  # nobody brought back
        assert sorted(ctl.scheduler.snapshot().held) == [A, B]

    run(test)


def test_a_refusal_held_for_the_victims_own_start_ends_when_its_signal_shows_it_gone(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """B's stop was refused for B's own start (job 11, a long ExecStartPost=) and D's
    queued behind it (D `Requires=` + `After=` B): the refusal holds for both jobs. B's
    start ends, its JobRemoved lost on the bus: B's signal showing it running with no job
    ends the refusal, and A's preemption is decided again (B's stop asked again), not left
    to wait for B's whole run."""
    d = "d.service"
    bed = _b_refused(tmp_path, cgroup_of, d)
    bed.systemd.units[B] = state(B, "activating", "start-post", 11, "start")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        await bed.acquire(A, ":1.9", 4242)
        await settle()
        stops = bed.systemd.calls.count(("stop", B))
        ctl.on_unit_changed(B, {"ActiveState": "activating", "SubState": "start-post"})
        await settle()
        assert bed.systemd.calls.count(("stop", B)) == stops  # its start still under way
        bed.systemd.units[B] = state(B, "active", "running")
        ctl.on_unit_changed(B, {"ActiveState": "active", "SubState": "running", "Job": (0, "/")})
        await settle()
        assert bed.systemd.calls.count(("stop", B)) == stops + 1

    run(test)


def test_a_waiter_told_down_at_its_gate_waits_again_when_systemd_shows_a_start_there(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """A waits at its gate behind B (more urgent). Its start ends `canceled` and a job of
    someone's comes: taken for a stop, A is told down at once. The read that follows names
    the job a start (a start replaced the stop before it ran, its signals lost): A waits
    again, and is granted once B is down. Left told down, its gate waited for ever."""
    bed = _a_behind_b(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = await _waits_at_its_gate(bed)
        assert ctl.scheduler.is_waiting(A)
        ctl.on_job_removed(20, _job(20), A, "canceled")
        ctl.on_job_new(21, _job(21), A)
        bed.systemd.units[A] = state(A, "activating", "start-pre", 22, "start")
        assert not ctl.scheduler.is_waiting(A)
        await settle()
        assert ctl.scheduler.is_waiting(A)
        assert not ctl.tracker.leaving(A)
        goes_down(bed, B)
        await settle()
        # granted, not a place kept until a gate asks that waits on its pipe
        assert ctl.scheduler.phase(A) is Phase.RUNNING
        assert ctl.scheduler.grants() == {A: frozenset({0})}

    run(test)


@pytest.mark.parametrize("failed", [2, 3])
def test_a_waiter_told_down_at_its_gate_is_read_again_when_the_read_fails(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch, failed: int
) -> None:
    """As above, but the read of A's job fails (the bus is saturated, as when its signals
    were lost): it is tried again LEAVING_RETRY_DELAY later, LEAVING_READS reads in all, and
    A waits again. Where every one of them failed, the next audit reads A again. Left as
    told after a failed read, its gate waited for ever."""
    monkeypatch.setattr(controller_module, "LEAVING_RETRY_DELAY", 0.01)
    monkeypatch.setattr(rereads_module, "AUDIT_INTERVAL", 3600)  # driven by hand here
    bed = _a_behind_b(tmp_path, cgroup_of)
    read = bed.systemd.units_state
    failures = [NO_REPLY] * failed

    async def failing_read(names: Any) -> list[UnitState]:
        if failures:
            bed.systemd.calls.append(("units_state", ",".join(sorted(names))))
            raise failures.pop()
        return await read(names)

    async def test() -> None:
        ctl = await _waits_at_its_gate(bed)
        bed.systemd.units_state = failing_read  # type: ignore[method-assign]
        ctl.on_job_removed(20, _job(20), A, "canceled")
        ctl.on_job_new(21, _job(21), A)
        bed.systemd.units[A] = state(A, "activating", "start-pre", 22, "start")
        if failed == 3:
            await until(lambda: ctl.counters.errors["dbus_call_errors"] == 3)
            await asyncio.sleep(0.2)  # 20 retry delays: no fourth read comes
            assert bed.systemd.calls.count(("units_state", A)) == 3
            assert ctl.tracker.leaving(A)  # until the next audit
            await ctl.reads.audit()
        await until(lambda: ctl.scheduler.is_waiting(A))
        assert bed.systemd.calls.count(("units_state", A)) == failed + 1
        assert ctl.counters.errors["dbus_call_errors"] == failed
        goes_down(bed, B)
        await settle()
        assert ctl.scheduler.grants() == {A: frozenset({0})}

    run(test)


def test_a_waiter_someone_stops_at_its_gate_during_a_rescan_is_told_down_at_once(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rescan under way holds back what systemd shows of a start at its gate not answered
    yet (Rescans.hold_gate), but not someone's stop of a waiter there: held back, the
    waiter's down was dropped and A waited on, preempting for a start being stopped."""
    bed = _a_behind_b(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = await _waits_at_its_gate(bed)
        assert ctl.scheduler.is_waiting(A)
        monkeypatch.setattr(ctl.rescans, "hold_gate", lambda name, invocation: True)
        ctl.on_job_new(21, _job(21), A)  # its start's end lost
        bed.systemd.units[A] = state(A, "activating", "start-pre", 21, "stop")
        ctl.on_unit_changed(A, {**AT_GATE, "Job": (21, _job(21))})
        assert not ctl.scheduler.is_waiting(A)
        assert A in ctl.scheduler.snapshot().held

    run(test)


def test_a_waiter_whose_stop_a_start_replaced_before_it_ran_waits_again(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """`systemctl stop a; systemctl start a` while A waits at its gate: systemd runs its
    queue after the calls it has read, so the start may replace the stop before it ran, and
    A never leaves its gate. Told down at the stop, A waits again at the start's signal, its
    gate served: granted once B is down. Left told down, its gate waited for ever."""
    bed = _a_behind_b(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = await _waits_at_its_gate(bed)
        ctl.on_job_removed(20, _job(20), A, "canceled")
        ctl.on_job_new(21, _job(21), A)
        bed.systemd.units[A] = state(A, "activating", "start-pre", 21, "stop")
        ctl.on_unit_changed(A, {**AT_GATE, "Job": (21, _job(21))})
        assert not ctl.scheduler.is_waiting(A)
        ctl.on_job_removed(21, _job(21), A, "canceled")
        ctl.on_job_new(22, _job(22), A)
        bed.systemd.units[A] = state(A, "activating", "start-pre", 22, "start")
        ctl.on_unit_changed(A, {**AT_GATE, "Job": (22, _job(22))})
        await settle()
        assert ctl.scheduler.is_waiting(A)
        goes_down(bed, B)
        await settle()
        # granted, not a place kept until a gate asks that waits on its pipe
        assert ctl.scheduler.phase(A) is Phase.RUNNING
        assert ctl.scheduler.grants() == {A: frozenset({0})}

    run(test)


def test_a_job_made_before_the_victims_own_is_the_one_before_ours(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """`_stop_before`: systemd numbers jobs as it makes them, from 1. The job that took a
    unit down was made before the stop job the victim shows only where its number is lower:
    job 1 (the first of a boot) is; the victim's own job, a later one, and a path naming no
    job are not."""
    bed = _a_behind_b(tmp_path, cgroup_of)
    ctl = bed.controller
    ctl.tracker.states[B] = state(B, "deactivating", "stop-sigterm", 5, "stop")
    assert ctl._stop_before(_job(1), B) and ctl._stop_before(_job(4), B)
    assert not ctl._stop_before(_job(5), B) and not ctl._stop_before(_job(6), B)
    assert not ctl._stop_before("/", B)
