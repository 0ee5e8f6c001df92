"""A unit whose annotation went is no longer gpuslice's once the core has let it go.

The controller follows a unit while it is annotated or the core still knows it (a holder, a
waiter, a suspended unit: `Controller._followed`); the tracker kept systemd's last word on
every unit it ever followed, and every name it kept counted as managed (`_managed_units`):
the GPU processes of such a unit, run again ungated after the daemon-reload that took its
gate out, were taken for a managed unit's leftovers, never foreign. Under
`foreign_processes: yield` a background unit then stayed on that process's GPU, and was
granted it (README, "GPUs, memory and processes gpuslice does not manage": background units
step aside while a foreign compute process uses their GPU). And the tracker's entry of such
a unit, released at its down, was never dropped: one for each instance ever so released
(`_apply`'s WentDown).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import cast

import pytest

from gpuslice.core.model import UnitSpec
from gpuslice.core.scheduler import SavedState
from gpuslice.journal import Journal
from gpuslice.metrics import exposition
from gpuslice.nvml import GpuProcess
from gpuslice.state import StateStore
from gpuslice.systemd import SystemdError
from tests.test_controller import (
    GIB,
    Bed,
    StubNvml,
    _no_notify_socket,  # noqa: F401  (autouse: as in tests/test_controller.py)
    at_gate,
    bed_config,
    goes_down,
    late_stops,
    low_holds_gpu_0,
    messages,
    process_in,
    run,
    settle,
    signal,
    state,
    unannotate,
    until,
    write_unit,
)
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_controller_calls import FakeJournal
from tests.test_controller_gates import (
    DOWN,
    INSTANCE,
    instance_down_before_our_stop_is_answered,
    instance_holds_gpu_0,
    template_unannotated,
)

JOB = "job.service"
BG = "bg.service"


class Shown(StubNvml):
    """The two GPUs, with the processes `shown` on each (none until a test puts some)."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: dict[int, list[GpuProcess]] = {}

    def processes(self, index: int) -> list[GpuProcess]:
        return self.shown.get(index, [])


def job_beside_bg(tmp_path: Path, nvml: Shown, *, held: bool) -> Bed:
    """bg.service (background) runs on GPU 1; job.service (50) runs on GPU 0 (`held`), or
    is down. PID 300, on /proc, runs in job.service's cgroup."""
    process_in(tmp_path, 300, f"/system.slice/{JOB}")
    holders: dict[str, tuple[tuple[int, ...], str, int, str]] = {BG: ((1,), "running", 1, "")}
    states = [state(BG, "active", "running")]
    if held:
        holders[JOB] = ((0,), "running", 2, "")
        states.append(state(JOB, "active", "running"))
    else:
        states.append(state(JOB, "inactive", "dead"))
    return Bed(
        tmp_path,
        {BG: "Priority=90\nType=background\n", JOB: "Priority=50\n"},
        states,
        SavedState(holders=holders, seq=2),
        config=bed_config(tmp_path, gpus=2),
        nvml=nvml,
    )


@pytest.mark.parametrize("held", [True, False], ids=["held-when-it-went", "down-when-it-went"])
def test_a_process_of_a_unit_whose_annotation_went_is_foreign_once_it_is_let_go(
    tmp_path: Path, held: bool
) -> None:
    """job.service's annotation goes (daemon-reload, its gate with it) while it runs on GPU
    0, and it ends; or while it is down. Later it runs, ungated, and its process (PID 300)
    uses GPU 1, where bg.service (background) runs: a process of no managed unit, so
    bg.service yields GPU 1 to it, and status shows it foreign. Taken for job.service's
    because the tracker still had its last state, bg.service ran on beside it."""
    nvml = Shown()
    bed = job_beside_bg(tmp_path, nvml, held=held)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await unannotate(ctl, tmp_path, JOB)
        if held:
            assert ctl.scheduler.grants() == {BG: frozenset({1}), JOB: frozenset({0})}
            goes_down(bed, JOB)
            await settle()
        assert ctl.scheduler.grants() == {BG: frozenset({1})}
        assert JOB not in ctl._managed_units()
        bed.systemd.units[JOB] = state(JOB, "active", "running")
        signal(bed, JOB, {"ActiveState": "active", "SubState": "running", "Job": (0, "/")})
        nvml.shown[1] = [GpuProcess(300, 1, 2 * GIB, compute=True)]
        ctl.watch.refresh()
        await settle()
        [foreign] = json.loads(ctl.status_json())["gpus"][1]["foreign"]
        assert foreign["pid"] == 300
        assert ("stop", BG) in bed.systemd.calls

    run(test)


def test_a_running_unit_whose_annotation_went_keeps_its_processes_until_it_ends(
    tmp_path: Path,
) -> None:
    """While job.service, its annotation gone, still holds GPU 0 (the core keeps it until it
    ends), its process there is its own, not foreign: bg.service on GPU 1 is not stopped."""
    nvml = Shown()
    bed = job_beside_bg(tmp_path, nvml, held=True)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await unannotate(ctl, tmp_path, JOB)
        nvml.shown[0] = [GpuProcess(300, 0, 2 * GIB, compute=True)]
        ctl.watch.refresh()
        await settle()
        assert JOB in ctl._managed_units()
        assert json.loads(ctl.status_json())["gpus"][0]["foreign"] == []
        assert ("stop", BG) not in bed.systemd.calls

    run(test)


def test_a_plain_unit_whose_annotation_went_leaves_the_tracker_at_its_down(
    tmp_path: Path,
) -> None:
    """job.service, its annotation gone while it ran on GPU 0, ends: the core lets it go and
    its signals are no longer taken in, so the tracker forgets it too."""
    bed = job_beside_bg(tmp_path, Shown(), held=True)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await unannotate(ctl, tmp_path, JOB)
        assert JOB in ctl.tracker.states  # followed while the core holds GPU 0 for it
        goes_down(bed, JOB)
        await settle()
        assert JOB not in ctl.tracker.states
        assert ctl.tracker.signals(JOB) == 0

    run(test)


@pytest.mark.parametrize(
    "down",
    [DOWN, {"ActiveState": "failed", "SubState": "failed", "Job": (0, "/")}],
    ids=["dead", "failed"],
)
def test_an_instance_whose_annotation_went_leaves_the_tracker_at_its_down(
    tmp_path: Path, down: dict[str, object]
) -> None:
    """t@1.service's template loses its annotation while it runs on GPU 0; it ends: its
    entry goes from the tracker, as an annotated instance's does (`Instances.forget`). Kept,
    the tracker held one for every such instance, whose names may never come again."""
    bed, _ = instance_holds_gpu_0(tmp_path)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await template_unannotated(bed, tmp_path)
        assert INSTANCE in ctl.tracker.states
        signal(bed, INSTANCE, down)
        await settle()
        assert ctl.scheduler.grants() == {}
        assert INSTANCE not in ctl.tracker.states
        assert INSTANCE not in ctl._managed_units()

    run(test)


def test_an_instance_waiting_to_restart_stays_in_the_tracker_but_is_not_managed(
    tmp_path: Path,
) -> None:
    """t@1.service, its template's annotation gone, fails and waits to restart by its
    Restart=: the tracker, which told it down once, keeps it (as `Instances.forget` does),
    but its processes are no longer a managed unit's."""
    bed, _ = instance_holds_gpu_0(tmp_path)
    restarting = {"ActiveState": "activating", "SubState": "auto-restart", "Job": (0, "/")}

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await template_unannotated(bed, tmp_path)
        signal(bed, INSTANCE, restarting)
        await settle()
        assert ctl.scheduler.grants() == {}
        assert INSTANCE in ctl.tracker.states
        assert INSTANCE not in ctl._managed_units()

    run(test)


def test_an_instance_whose_annotation_went_stays_in_the_tracker_while_our_stop_is_unanswered(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """urgent.service takes GPU 0 from t@1.service, whose template lost its annotation, and
    t@1.service shows down before systemd answered our stop: the tracker waits for the
    answer to judge that down, so it keeps what it knows of t@1.service until then, and
    forgets it at the down the answer's read takes in."""
    bed, _ = instance_holds_gpu_0(tmp_path)
    cgroup_of[4242] = "urgent.service"
    answer = late_stops(bed)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await instance_down_before_our_stop_is_answered(bed, tmp_path)
        assert INSTANCE in ctl.tracker.states
        answer.set()
        await until(lambda: bed.service.granted != [])
        assert bed.service.granted == [("urgent.service", "0")]
        assert INSTANCE not in ctl.tracker.states

    run(test)


def test_the_managed_set_builds_no_spec_for_a_tracked_unit_the_core_knows_annotated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The managed set is taken at every NVML sample, each holder's down among them (a
    handover). Asking `_followed` of every tracked unit built a spec anew for each instance
    (its template's, renamed): 46 ms a sample at 10,000 instances running or waiting, where
    the whole set took 0.4 ms. A unit the core knows annotated, or holding, is managed
    without asking."""
    bed, _ = instance_holds_gpu_0(tmp_path)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert INSTANCE in ctl.tracker.states
        asked: list[str] = []
        spec_for = ctl.scan.spec_for

        def counted(name: str) -> UnitSpec | None:
            asked.append(name)
            return spec_for(name)

        monkeypatch.setattr(ctl.scan, "spec_for", counted)
        assert INSTANCE in ctl._managed_units()
        assert asked == []

    run(test)


# ---- a start at a gate that a daemon-reload took out, of a unit with lines of its own ----

URGENT = "urgent.service"
GATE_LINE = (
    "/usr/lib/gpuslice/gpuslice-gate",
    ["/usr/lib/gpuslice/gpuslice-gate", URGENT, "0.5", "/run/gpuslice/gate/urgent.service"],
)
TOUCH = ("/bin/touch", ["/bin/touch", "/tmp/x"])
RESTARTED = (
    "urgent.service is no longer annotated: its start, which waited at the gate a "
    "daemon-reload took out, is restarted unless it was stopped meanwhile (then it stays "
    "stopped); let through, it would skip its own ExecStartPre= lines"
)


async def waits_then_unannotated(bed: Bed, tmp_path: Path) -> None:
    """urgent.service waits at its gate for low.service to stop; a daemon-reload takes its
    annotation out, and with it its gate's drop-in; its gate asks over D-Bus."""
    ctl = bed.controller
    await ctl.start()
    bed.systemd.units[URGENT] = state(URGENT, "activating", "start-pre", 7, "start")
    ctl.on_unit_changed(URGENT, at_gate())
    await settle()
    await unannotate(ctl, tmp_path, URGENT)
    await bed.acquire(URGENT, ":1.9", 4242)


def test_a_start_whose_gate_a_reload_took_out_is_restarted_with_its_own_lines(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """urgent.service has `ExecStartPre=/bin/touch /tmp/x` of its own. systemd, at the
    daemon-reload that took its gate out, no longer finds the gate's command in the new
    ExecStartPre= list, and does not go on with that list: let through, the start went on to
    ExecStart= without its own line (README claimed it ran "as any unannotated unit's
    does"). It is restarted instead (one job, stopped then started from the unit file of
    now, every line of it run), and both journals say why; its gate's call is told to ask
    again (its shell is being stopped), never granted."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    bed.systemd.exec_start_pres[URGENT] = [TOUCH]

    async def test() -> None:
        await waits_then_unannotated(bed, tmp_path)
        await until(lambda: ("restart", URGENT) in bed.systemd.calls)
        await settle()
        assert bed.service.granted == [] and bed.service.sent_back == [URGENT]
        assert bed.systemd.calls.count(("restart", URGENT)) == 1
        assert not bed.controller.judge._passing

    caplog.set_level(logging.INFO, "gpuslice")
    run(test)
    assert RESTARTED in messages(caplog)


def test_a_start_stopped_while_its_list_is_read_is_not_started_again(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """`systemctl stop urgent.service` while the controller reads its ExecStartPre= (or its
    TimeoutStartSec= ends then): its gate is killed and the unit is down, which the
    controller no longer hears (not annotated, not known), and the dead gate's call still
    waits in the service. RestartUnit started the unit again over that stop (systemd
    collapses a restart of an inactive unit into a start, and one of a unit being stopped
    replaces its stop job); TryRestartUnit is a no-op there, and the unit stays stopped.
    systemd answers with a (no-op) job all the same: the journal's line says the start is
    restarted unless it was stopped meanwhile, never that a restart runs (it said
    "restarting its start" of a unit that stayed stopped)."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    bed.systemd.exec_start_pres[URGENT] = [TOUCH]
    read = bed.systemd.exec_start_pre

    async def stopped_while_read(name: str) -> list[tuple[str, list[str]]]:
        commands = await read(name)
        goes_down(bed, name)  # its answer, then systemd's stop, reach us in this order
        return commands

    bed.systemd.exec_start_pre = stopped_while_read  # type: ignore[method-assign]

    async def test() -> None:
        await waits_then_unannotated(bed, tmp_path)
        await until(lambda: ("exec_start_pre", URGENT) in bed.systemd.calls)
        await settle()
        assert ("restart", URGENT) not in bed.systemd.calls
        assert ("try-restart-nop", URGENT) in bed.systemd.calls
        assert bed.service.granted == []
        assert not bed.controller.judge._passing

    caplog.set_level(logging.INFO, "gpuslice")
    run(test)
    assert RESTARTED in messages(caplog)
    assert not [m for m in messages(caplog) if "restarting" in m]


@pytest.mark.parametrize(
    "pre", [[GATE_LINE, TOUCH], []], ids=["gate-still-there", "no-lines-of-its-own"]
)
def test_a_gate_let_through_that_systemd_still_runs_or_with_nothing_to_skip_passes(
    tmp_path: Path, cgroup_of: dict[int, str], pre: list[tuple[str, list[str]]]
) -> None:
    """No daemon-reload took the gate out yet (the rescan read the file first): systemd goes
    on after it with the unit's own lines. Or the unit has none: nothing is skipped. Either
    way its gate passes, and nothing is restarted."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    bed.systemd.exec_start_pres[URGENT] = pre

    async def test() -> None:
        await waits_then_unannotated(bed, tmp_path)
        await until(lambda: bed.service.granted != [])
        assert bed.service.granted == [(URGENT, "")]
        assert ("restart", URGENT) not in bed.systemd.calls

    run(test)


def test_a_restart_systemd_refuses_lets_the_gate_through_and_says_what_that_costs(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """RefuseManualStart=, say: the start is let through as before, never left waiting."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    bed.systemd.exec_start_pres[URGENT] = [TOUCH]
    bed.systemd.refused_restarts[URGENT] = SystemdError(
        "org.freedesktop.systemd1.OnlyByDependency", "Operation refused"
    )

    async def test() -> None:
        await waits_then_unannotated(bed, tmp_path)
        await until(lambda: bed.service.granted != [])
        assert bed.service.granted == [(URGENT, "")]

    caplog.set_level(logging.INFO, "gpuslice")
    run(test)
    assert (
        "cannot restart urgent.service, whose gate a daemon-reload took out: Operation "
        "refused; letting it through, and systemd skips its own ExecStartPre= lines"
    ) in messages(caplog)
    assert RESTARTED not in messages(caplog)


@pytest.mark.parametrize("failing", ["read", "restart"])
def test_a_read_or_restart_that_did_not_reach_systemd_has_the_gate_ask_again(
    tmp_path: Path, cgroup_of: dict[int, str], failing: str
) -> None:
    """systemd re-executing: neither let through on a list not read, nor left waiting. Its
    gate asks again, and is judged then."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    lost = SystemdError("org.freedesktop.DBus.Error.NoReply", "no reply")
    if failing == "read":
        bed.systemd.exec_start_pres[URGENT] = lost
    else:
        bed.systemd.exec_start_pres[URGENT] = [TOUCH]
        bed.systemd.refused_restarts[URGENT] = lost

    async def test() -> None:
        await waits_then_unannotated(bed, tmp_path)
        await until(lambda: bed.service.sent_back != [])
        assert bed.service.granted == []
        assert bed.service.sent_back == [URGENT]
        assert not bed.controller.judge._passing

    run(test)


# -- a unit down whose annotation goes: how it went down is forgotten --------------------------

P, URGENT_UNIT = "p.service", "urgent.service"
P_FORGOTTEN = (
    "p.service is no longer annotated: gpuslice forgets that it preempted it and will not "
    "start it again; start it yourself if its work is still wanted"
)


def p_preempted(tmp_path: Path, *, annotated: bool = True) -> Bed:
    """p.service (50) was preempted for urgent.service (10), which runs on the one GPU;
    `annotated`: p.service's annotation is still there when the controller starts."""
    units = {URGENT_UNIT: "Priority=10\n"} | ({P: "Priority=50\n"} if annotated else {})
    bed = Bed(
        tmp_path,
        units,
        [state(URGENT_UNIT, "active", "running")],
        SavedState(holders={URGENT_UNIT: ((0,), "running", 2, "")}, preempted={P: 1}, seq=2),
    )
    bed.controller.journal = cast(Journal, FakeJournal())
    return bed


def saved_state(bed: Bed) -> SavedState:
    saved, _ = StateStore(Path(bed.config.state_dir)).load()
    return saved


def test_a_preempted_unit_whose_annotation_goes_is_forgotten_with_a_word_in_both_journals(
    tmp_path: Path,
) -> None:
    """p.service waits to come back from its preemption when its annotation goes: gpuslice
    manages only annotated units, so it will never bring it back. Its journal and the
    controller's say so once (a warning); the state file and status no longer keep it (they
    showed it preempted for ever); urgent.service's end starts nothing, nor does p.service's
    annotation coming back days later (it was restarted by itself then)."""
    bed = p_preempted(tmp_path)
    journal = cast(FakeJournal, bed.controller.journal)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert P in saved_state(bed).preempted
        await unannotate(ctl, tmp_path, P)
        [said] = journal.of(P, "unmanaged")
        assert said["MESSAGE"] == P_FORGOTTEN
        assert said["PRIORITY"] == "4"  # warning
        assert said["OBJECT_SYSTEMD_UNIT"] == P  # its own journal
        assert said["GPUSLICE_CAUSE"] == "preemption-forgotten"
        assert said["GPUSLICE_PRIORITY"] == "50"
        assert saved_state(bed).preempted == {}
        assert json.loads(ctl.status_json())["preempted"] == []
        assert b'state="preempted"' not in exposition(json.loads(ctl.status_json()))
        goes_down(bed, URGENT_UNIT)
        await settle()
        write_unit(tmp_path, P, "Priority=50\n")
        ctl.rescans.request()
        await until(lambda: ctl.spec_for(P) is not None)
        await settle()
        assert ("start", P) not in bed.systemd.calls
        assert len(journal.of(P, "unmanaged")) == 1

    run(test)


def test_a_restarted_controller_forgets_the_preemption_of_a_unit_no_longer_annotated(
    tmp_path: Path,
) -> None:
    """p.service's annotation went while no controller ran: the state file still names it
    preempted. The new controller says so once, in both journals, saves the state without
    it and shows it nowhere."""
    bed = p_preempted(tmp_path, annotated=False)
    journal = cast(FakeJournal, bed.controller.journal)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        [said] = journal.of(P, "unmanaged")
        assert said["MESSAGE"] == P_FORGOTTEN
        assert said["OBJECT_SYSTEMD_UNIT"] == P
        assert saved_state(bed).preempted == {}
        assert json.loads(ctl.status_json())["preempted"] == []

    run(test)


@pytest.mark.parametrize("gone", ["while-it-runs", "before-it-starts"])
def test_a_held_unit_whose_annotation_goes_is_forgotten_silently_and_saved_so(
    tmp_path: Path, gone: str
) -> None:
    """bg.service (background) was stopped by hand: held. Its annotation goes, while the
    controller runs or before it starts: nothing was owed, so nothing is said, but the state
    file no longer holds it (saved at once: a controller restarted once it is annotated
    again found it held)."""
    at_start = gone == "before-it-starts"
    bed = Bed(
        tmp_path,
        {} if at_start else {BG: "Priority=90\nType=background\n"},
        [state(BG, "inactive", "dead")],
        SavedState(held=[BG], seq=2),
    )
    journal = FakeJournal()
    bed.controller.journal = cast(Journal, journal)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        if not at_start:
            assert saved_state(bed).held == [BG]
            await unannotate(ctl, tmp_path, BG)
        await settle()
        assert journal.entries == []
        assert saved_state(bed).held == []
        assert json.loads(ctl.status_json())["held"] == []

    run(test)
