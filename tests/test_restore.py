"""gpuslice/restore.py on its own: what start-up rebuilds from the saved state and systemd.

Small fakes stand for the core, the tracker, systemd's record of main processes and the
journal (no controller, no bus): each records what it was asked, in order, in one list
(`Kit.did`), and answers what the test set. Env files are real, in a temporary runtime_dir.

README ("The rules in short"): "A unit you stop by hand (`systemctl stop`) is **held** [...]
across controller restarts and reboots", also when it was stopped while no controller ran;
"Units that ended while no controller ran [...] lose their env files at the controller's next
start [...] A start looks at up to 8,192 entries of `runtime_dir/env`".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from signal import SIGTERM
from typing import cast

import pytest

from gpuslice import envfiles, stopjournal
from gpuslice import restore as restore_module
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import Action, Log, Outcome, Phase, Scheduler
from gpuslice.counters import Counters
from gpuslice.paths import ENV_DIR_NAME
from gpuslice.restore import Restore
from gpuslice.systemd import SystemdError
from gpuslice.tracker import CLD_EXITED, CLD_KILLED, MainExit, Tracker, UnitState

A, B, C, D = "a.service", "b.service", "c.service", "d.service"
NO_REPLY = SystemdError("org.freedesktop.DBus.Error.NoReply", "no reply")
KILLED = MainExit(CLD_KILLED, SIGTERM, "success")
EXITED = MainExit(CLD_EXITED, 0, "success")
UUID0 = "GPU-00000000-aaaa-0000-0000-000000000000"
UUID1 = "GPU-11111111-bbbb-0000-0000-000000000000"


def down(name: str, active: str = "inactive", job: int = 0) -> UnitState:
    return UnitState(name, active, "dead" if active == "inactive" else "failed", job)


def running(name: str, job: int = 0) -> UnitState:
    return UnitState(name, "active", "running", job)


def at_gate(name: str) -> UnitState:
    return UnitState(name, "activating", "start-pre", 9, "start")


class FakeScheduler:
    """The core's books as the test sets them; every question that changes something, and
    the deferral around them, noted in `did`; each answer a Log naming what was asked."""

    def __init__(self, did: list[str]) -> None:
        self.did = did
        self.holders: dict[str, frozenset[int]] = {}
        self.phases: dict[str, Phase] = {}
        self.suspended: list[str] = []
        self.requeued: list[str] = []
        self.waiting: set[str] = set()
        self.lost: dict[str, list[Action]] = {}
        self.unconfirmed_holds: dict[str, bool] = {}
        self.remained: set[str] = set()  # finished, kept active by systemd: hold nothing

    def _said(self, what: str) -> list[Action]:
        self.did.append(what)
        return [Log(what)]

    def grants(self) -> dict[str, frozenset[int]]:
        return dict(self.holders)

    def phase(self, name: str) -> Phase | None:
        return self.phases.get(name)

    def suspended_units(self) -> list[str]:
        return sorted(self.suspended)

    def requeued_away(self) -> list[str]:
        return list(self.requeued)

    def is_waiting(self, name: str) -> bool:
        return name in self.waiting

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self.did.append("defer")
        yield
        self.did.append("decide")

    def start_lost(self, name: str) -> list[Action]:
        self.did.append(f"start_lost {name}")
        return self.lost.get(name, [])

    def inactive(self, name: str, outcome: Outcome) -> list[Action]:
        return self._said(f"inactive {name} {outcome.value}")

    def stop_failed(self, name: str, why: str, *, refused: bool) -> list[Action]:
        return self._said(f"stop_failed {name}: {why} refused={refused!r}")

    def running(self, name: str, gpus: Iterable[int] | None = None) -> list[Action]:
        return self._said(f"running {name} {gpus!r}")

    def set_gpus(self, gpus: Iterable[Gpu]) -> list[Action]:
        self.did.append(f"set_gpus {[g.index for g in gpus]}")
        return []

    def request(self, spec: UnitSpec) -> list[Action]:
        return self._said(f"request {spec.name}")

    def keeps_place(self, name: str) -> bool:
        return self.phases.get(name) is Phase.STARTING and bool(self.holders.get(name))

    def start_waits(self, name: str) -> list[Action]:
        return self._said(f"start_waits {name}") if self.keeps_place(name) else []

    def recover(self) -> list[Action]:
        return self._said("recover")

    def holds_confirmed(self, names: Iterable[str]) -> None:
        self.did.append(f"holds_confirmed {list(names)}")

    def schedule(self) -> list[Action]:
        return self._said("schedule")

    def remember_uuids(self, name: str, told: Mapping[int, str]) -> None:
        self.did.append(f"remember_uuids {name} {dict(told)}")


class FakeTracker:
    """Systemd's word as signals and the list told it; `outcome` says stopped when told so,
    failed for a failed unit, exited otherwise."""

    def __init__(self) -> None:
        self.states: dict[str, UnitState] = {}
        self.heard_at: dict[str, int] = {}
        self.stopped_at_gate: set[str] = set()  # someone's stop listed there (`leaving`)

    def state(self, name: str) -> UnitState:
        return self.states.get(name, UnitState(name, "inactive", "dead", 0))

    def leaving(self, name: str) -> bool:
        return name in self.stopped_at_gate

    def heard(self, name: str) -> int:
        return self.heard_at.get(name, 1)

    def outcome(self, state: UnitState, *, stopped: bool = False) -> Outcome:
        if stopped:
            return Outcome.STOPPED
        return Outcome.FAILED if state.active == "failed" else Outcome.EXITED


class FakeSystemd:
    """Systemd's record of each main process (`exits`: a MainExit, or the error a read
    raises), read on a later turn of the loop, as the bus answers; `overtaken`: units a
    signal names while their read is in flight."""

    def __init__(self, kit: Kit) -> None:
        self.kit = kit
        self.exits: dict[str, MainExit | Exception] = {}
        self.overtaken: set[str] = set()
        # the jobs each job waits for (Job.GetBefore), by id (else none), or the read's
        # error; ids whose read never answers
        self.waited_for: dict[int, list[tuple[int, str, str]] | Exception] = {}
        self.hangs: set[int] = set()

    async def main_exit(self, name: str) -> MainExit:
        self.kit.did.append(f"main_exit {name}")
        await asyncio.sleep(0)
        if name in self.overtaken:
            self.kit.tracker.heard_at[name] = 99
        answer = self.exits[name]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def jobs_waited_for(self, job_id: int) -> list[tuple[int, str, str]]:
        self.kit.did.append(f"jobs_waited_for {job_id}")
        await asyncio.sleep(0)
        if job_id in self.hangs:
            try:
                await asyncio.Event().wait()
            finally:  # cancelled: said when its cancel is over
                self.kit.did.append(f"jobs_waited_for {job_id} over")
        found = self.waited_for.get(job_id, [])
        if isinstance(found, Exception):
            raise found
        return found


class Kit:
    """A Restore with its fakes."""

    def __init__(self, tmp_path: Path) -> None:
        self.did: list[str] = []
        self.scheduler = FakeScheduler(self.did)
        self.tracker = FakeTracker()
        self.systemd = FakeSystemd(self)
        self.counters = Counters()
        self.runtime_dir = str(tmp_path / "run")
        self.specs: dict[str, UnitSpec] = {}
        self.learns = False  # what the inventory answers: it learned a GPU otherwise booked
        self.rescan = False
        self.held_for_rescan: list[str] = []
        # the journal's answers; None: no journal to ask (not run under systemd)
        self.journal: dict[str, stopjournal.Answer] | None = {}
        self.journal_overtakes: set[str] = set()
        self.restore = Restore(
            cast(Scheduler, self.scheduler),
            cast(Tracker, self.tracker),
            self.systemd,
            self.counters,
            lambda: None if self.journal is None else self.ask,
            self.runtime_dir,
            self.specs.get,
            self.remember,
            self.resample,
            lambda: self.rescan,
            self.held_for_rescan.append,
        )

    async def ask(self, names: Sequence[str]) -> Mapping[str, stopjournal.Answer]:
        self.did.append(f"journal {list(names)}")
        await asyncio.sleep(0)
        for name in self.journal_overtakes:
            self.tracker.heard_at[name] = 99
        assert self.journal is not None
        return {n: self.journal[n] for n in names if n in self.journal}

    def remember(self, told: Mapping[int, str]) -> bool:
        self.did.append(f"remember {dict(told)}")
        return self.learns

    def resample(self) -> list[Gpu]:
        self.did.append("resample")
        return [Gpu(0), Gpu(1)]

    def hold(self, name: str, gpus: Iterable[int], phase: Phase, state: UnitState) -> None:
        self.scheduler.holders[name] = frozenset(gpus)
        self.scheduler.phases[name] = phase
        self.tracker.states[name] = state

    def told(self, unit: str, *gpus: Gpu) -> None:
        """The unit's env file, as a grant of an earlier controller wrote it."""
        envfiles.write(self.runtime_dir, unit, list(gpus))

    def stopped_while_away(self) -> set[str]:
        return asyncio.run(self.restore.stopped_while_away())


def messages(actions: list[Action]) -> list[str]:
    return [a.message for a in actions if isinstance(a, Log)]


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records]


def found_down(
    tmp_path: Path,
    exits: dict[str, MainExit | Exception],
    journal: dict[str, stopjournal.Answer] | None = None,
) -> Kit:
    """A Kit whose holders, each running on a GPU of its own in the books (GPU 0 the
    first in `exits`), systemd shows down, their main processes ended as `exits` says;
    `journal`: the journal's answers (None: no journal to ask)."""
    kit = Kit(tmp_path)
    for gpu, name in enumerate(exits):
        kit.hold(name, [gpu], Phase.RUNNING, down(name))
    kit.journal = journal
    kit.systemd.exits = exits
    return kit


# ---- stopped_while_away: which holders found down are asked, and what decides ----------


def test_nothing_down_asks_nothing_and_defers_nothing(tmp_path: Path) -> None:
    """Holders systemd shows running, or stopping with a job, and a suspended unit found
    inactive (held already), are not asked of: no journal, no read, no deferral."""
    kit = Kit(tmp_path)
    kit.hold(A, [0], Phase.RUNNING, running(A))
    kit.hold(B, [1], Phase.RUNNING, UnitState(B, "deactivating", "stop-sigterm", 4, "stop"))
    kit.scheduler.suspended = [C]
    kit.tracker.states[C] = down(C)
    assert kit.stopped_while_away() == set()
    assert kit.did == []


def test_the_holders_asked_of_are_the_services_down_in_phases_whose_end_matters(
    tmp_path: Path,
) -> None:
    """Asked, in name order: running, starting or frozen holders found inactive; frozen or
    suspended ones found failed. Not asked: a running holder found failed (it failed), one
    being stopped (preempted however it went), a frozen one whose job still runs, a scope."""
    kit = Kit(tmp_path)
    kit.hold("h.service", [0], Phase.RUNNING, down("h.service"))
    kit.hold("g.service", [1], Phase.STARTING, down("g.service"))
    kit.hold("f.service", [2], Phase.FROZEN, down("f.service"))
    kit.hold("e.service", [3], Phase.FROZEN, down("e.service", "failed"))
    kit.scheduler.suspended = ["d.service", "c.service"]
    kit.scheduler.phases.update({"d.service": Phase.SUSPENDED, "c.service": Phase.SUSPENDED})
    kit.tracker.states["d.service"] = down("d.service", "failed")
    kit.tracker.states["c.service"] = down("c.service")  # held already
    kit.hold("b.service", [4], Phase.RUNNING, down("b.service", "failed"))
    kit.hold("a.service", [5], Phase.STOPPING, down("a.service"))
    kit.hold("i.service", [6], Phase.FROZEN, down("i.service", job=3))
    kit.hold("j.scope", [7], Phase.RUNNING, down("j.scope"))
    kit.journal = {f"{n}.service": stopjournal.Answer(True) for n in "defgh"}
    asked = ["d.service", "e.service", "f.service", "g.service", "h.service"]
    assert kit.stopped_while_away() == set(asked)
    assert kit.did == ["defer", f"journal {asked}", "decide"]


def test_the_journal_decides_and_the_main_process_decides_where_it_cannot_tell(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The journal's word decides: stopped, or not (a unit killed by SIGTERM outside a stop
    job is not read). Where it cannot tell, the record of a loaded, inactive unit's main
    process decides: killed by a signal with Result=success is stopped; exited is not. A
    failed one, or one systemd no longer loads, is not read. All of it while deferred; the
    journal's unknown answers said in one line, at INFO when none failed to be asked."""
    kit = Kit(tmp_path)
    for name in (A, B, C, D, "e.service"):
        kit.hold(name, [0], Phase.RUNNING, down(name))
    kit.hold("f.service", [1], Phase.FROZEN, down("f.service", "failed"))
    del kit.tracker.states["e.service"]  # unloaded: shown inactive, no record to read
    kit.journal = {
        A: stopjournal.Answer(True),
        B: stopjournal.Answer(False),
        C: stopjournal.Answer(None, "no word"),
        "f.service": stopjournal.Answer(None, "no word"),
    }
    kit.systemd.exits = {C: KILLED, D: EXITED, B: KILLED}
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        assert kit.stopped_while_away() == {A, C}
    names = [A, B, C, D, "e.service", "f.service"]
    assert kit.did == ["defer", f"journal {names}", f"main_exit {C}", f"main_exit {D}", "decide"]
    assert said(caplog) == [
        (
            logging.INFO,
            "the journal cannot tell whether systemd stopped c.service: no word; f.service: no "
            "word: judged by how systemd recorded the main process ending (a unit it no longer "
            "loads: ended by itself)",
        ),
        (
            logging.DEBUG,
            "a.service was stopped while no controller ran (the journal shows systemd's stop "
            "job ending it)",
        ),
        (
            logging.DEBUG,
            "c.service was stopped while no controller ran (its main process was killed by "
            "signal 15)",
        ),
    ]


def test_a_journal_that_failed_to_answer_is_said_as_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kit = found_down(
        tmp_path, {A: EXITED}, {A: stopjournal.Answer(None, "journalctl failed", failed=True)}
    )
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        assert kit.stopped_while_away() == set()
    assert [level for level, _ in said(caplog)] == [logging.WARNING]
    assert "a.service: journalctl failed" in said(caplog)[0][1]


def test_no_journal_leaves_every_loaded_unit_to_its_main_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a journal to ask (ask_journal None), and with one that leaves a unit out of
    its answer, each is read; nothing is said of the journal."""
    kit = found_down(tmp_path, {A: KILLED, B: EXITED})
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        assert kit.stopped_while_away() == {A}
    assert kit.did == ["defer", f"main_exit {A}", f"main_exit {B}", "decide"]
    assert said(caplog) == []
    again = found_down(tmp_path, {A: KILLED}, {})  # the journal answers nothing of a.service
    assert again.stopped_while_away() == {A}
    assert again.did == ["defer", f"journal {[A]}", f"main_exit {A}", "decide"]


def test_a_failed_read_is_said_counted_and_taken_for_an_end_by_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """a.service's read fails: said with its name and the error's text, counted once in
    dbus_call_errors, and a.service is not stopped; b.service's read still decides."""
    kit = found_down(tmp_path, {A: NO_REPLY, B: KILLED})
    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        assert kit.stopped_while_away() == {B}
    assert said(caplog) == [
        (
            logging.WARNING,
            "cannot read how the main process of a.service ended (no reply): taken for ended "
            "by itself",
        )
    ]
    assert kit.counters.errors["dbus_call_errors"] == 1


def test_a_unit_whose_signal_overtook_the_answer_is_left_as_it_was(tmp_path: Path) -> None:
    """A signal heard of the unit while the journal or its record was read: the answer is
    of a run that may no longer be the one down; not taken for stopped."""
    kit = Kit(tmp_path)
    for name in (A, B, C):
        kit.hold(name, [0], Phase.RUNNING, down(name))
    kit.journal = {A: stopjournal.Answer(True), B: stopjournal.Answer(True)}
    kit.journal_overtakes = {A}
    kit.systemd.exits = {C: KILLED}
    kit.systemd.overtaken = {C}
    assert kit.stopped_while_away() == {B}


# ---- rebuild: what systemd shows, taken in and decided once -----------------------------


def test_holders_found_down_end_as_the_stops_found_say_unless_our_start_was_lost(
    tmp_path: Path,
) -> None:
    """Down with no job: a start of ours that died with the last controller is sent again
    (start_lost's actions, not an end); else it ended, stopped if found so. Down between
    restarts (auto-restart) with a start job: no start of ours was lost."""
    kit = Kit(tmp_path)
    kit.hold(A, [0], Phase.RUNNING, down(A))
    kit.hold(B, [1], Phase.STARTING, down(B))
    kit.hold(C, [2], Phase.RUNNING, down(C, "failed"))
    kit.hold(D, [3], Phase.RUNNING, UnitState(D, "activating", "auto-restart", 5, "start"))
    kit.scheduler.lost[B] = [Log("start again b.service")]
    actions = kit.restore.rebuild(stopped={A, C})
    assert messages(actions) == [
        "inactive a.service stopped",
        "start again b.service",
        "inactive c.service stopped",
        "inactive d.service exited",
        "recover",
        "schedule",
    ]
    assert kit.did == [
        "defer",
        f"start_lost {A}",
        "inactive a.service stopped",
        f"start_lost {B}",
        f"start_lost {C}",
        "inactive c.service stopped",
        "inactive d.service exited",
        "recover",
        "decide",
        "holds_confirmed []",
        "schedule",
    ]


def test_a_preempted_in_place_holder_shown_starting_afresh_ended(tmp_path: Path) -> None:
    """Frozen (or suspending) and now at its gate: stopped while we were away and started
    again; that run ended, as systemd says (a stop found is not its word: the unit runs)."""
    kit = Kit(tmp_path)
    kit.hold(A, [0], Phase.FROZEN, at_gate(A))
    kit.hold(B, [1], Phase.RUNNING, at_gate(B))  # past its gate in the books: not this
    kit.hold(C, [2], Phase.SUSPENDING, UnitState(C, "inactive", "dead", 4, "start"))
    assert messages(kit.restore.rebuild(stopped={A, C})) == [
        "inactive a.service exited",
        "inactive c.service exited",
        "recover",
        "schedule",
    ]


def test_a_stop_systemd_no_longer_runs_is_given_up(tmp_path: Path) -> None:
    kit = Kit(tmp_path)
    kit.hold(A, [0], Phase.STOPPING, running(A))
    kit.hold(B, [1], Phase.STOPPING, running(B, job=7))  # its stop job still runs
    kit.hold(C, [2], Phase.RUNNING, running(C))
    assert messages(kit.restore.rebuild()) == [
        "stop_failed a.service: its stop was lost while the controller was away refused=False",
        "recover",
        "schedule",
    ]


def test_suspended_units_down_or_started_again_end_and_comebacks_down_are_owed(
    tmp_path: Path,
) -> None:
    """A suspended unit found down, or at its gate (started afresh), ends as the stops found
    say; one still there (active, frozen) is kept. A comeback whose wait at its gate ended
    while we were away ends as systemd says, never stopped; one still at its gate is kept."""
    kit = Kit(tmp_path)
    kit.scheduler.suspended = [A, B, C]
    for name in (A, B, C):
        kit.scheduler.phases[name] = Phase.SUSPENDED
    kit.tracker.states.update({A: down(A), B: at_gate(B), C: running(C)})
    kit.scheduler.requeued = [D, "e.service"]
    kit.tracker.states.update({D: down(D, "failed"), "e.service": at_gate("e.service")})
    assert messages(kit.restore.rebuild(stopped={A, B, D})) == [
        "inactive a.service stopped",
        "inactive b.service stopped",
        "inactive d.service failed",
        "recover",
        "schedule",
    ]


def test_running_units_not_booked_running_are_adopted_on_the_gpus_their_file_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Running units the books do not name, or name starting: adopted, on the GPUs their
    env file names (said), else anywhere ([]), in name order; one booked running is not."""
    kit = Kit(tmp_path)
    kit.tracker.states.update({B: running(B), A: running(A), D: running(D)})
    kit.hold(C, [1], Phase.STARTING, running(C))
    kit.hold(D, [0], Phase.RUNNING, running(D))
    kit.told(B, Gpu(2), Gpu(3))
    kit.told(C, Gpu(1))
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        actions = kit.restore.rebuild()
    assert messages(actions) == [
        "running a.service []",
        "running b.service [2, 3]",
        "running c.service [1]",
        "recover",
        "schedule",
    ]
    assert said(caplog) == [
        (logging.INFO, "b.service runs without a saved grant: GPUs [2, 3] from its env file"),
        (logging.INFO, "c.service runs without a saved grant: GPUs [1] from its env file"),
    ]


def test_a_gpu_learned_from_the_files_takes_a_new_sample_before_anything_is_granted(
    tmp_path: Path,
) -> None:
    kit = Kit(tmp_path)
    kit.hold(A, [0], Phase.RUNNING, running(A))
    kit.told(A, Gpu(0, UUID0))
    kit.learns = True
    kit.restore.rebuild()
    assert kit.did == [
        "defer",
        f"remember {{0: '{UUID0}'}}",
        f"remember_uuids a.service {{0: '{UUID0}'}}",
        "resample",
        "set_gpus [0, 1]",
        "recover",
        "decide",
        "holds_confirmed []",
        "schedule",
    ]
    kit.did.clear()
    kit.learns = False
    kit.restore.rebuild()
    assert "resample" not in kit.did


def test_starts_at_their_gate_queue_at_once_or_wait_for_a_rescan_due(tmp_path: Path) -> None:
    """Annotated, unknown to the core, at their gate or with a start job queued (read free
    of GPU units' starts: `queued_free`): requested, in name order, after the adoptions; not
    one the core knows or has waiting, nor one not annotated. While a rescan is due they are
    held for it instead."""
    kit = Kit(tmp_path)
    gate = {n: at_gate(n) for n in (B, A, "e.service", "f.service")}
    gate[C] = UnitState(C, "inactive", "dead", 3, "start")
    kit.tracker.states.update(gate)
    kit.tracker.states[D] = running(D)
    for name in (A, B, C, "e.service", "f.service"):
        kit.specs[name] = UnitSpec(name, 10)
    kit.scheduler.waiting.add("e.service")
    kit.scheduler.phases["f.service"] = Phase.STARTING
    del kit.specs[B]
    kit.scheduler.unconfirmed_holds = {"x.service": True, "y.service": False}
    actions = kit.restore.rebuild(free={C: 3})
    assert messages(actions) == [
        "running d.service []",
        "request a.service",
        "request c.service",
        "recover",
        "schedule",
    ]
    assert kit.did[-2:] == ["holds_confirmed ['x.service', 'y.service']", "schedule"]
    assert kit.held_for_rescan == []
    kit.rescan = True
    kit.did.clear()
    assert messages(kit.restore.rebuild(free={C: 3})) == [
        "running d.service []",
        "recover",
        "schedule",
    ]
    assert kit.held_for_rescan == [A, C]


def test_a_unit_someone_stops_at_its_gate_is_held_not_requested(tmp_path: Path) -> None:
    """Annotated, at its gate with someone's stop (Tracker.listed: leaving), with no phase
    and not waiting: held (told down as stopped), not requested nor held for a rescan due,
    as a waiter told down at its gate is; one the core has a phase for, or has waiting, or
    not annotated, is left as it was."""
    kit = Kit(tmp_path)
    before, after = "0.service", "z.service"  # starts at their gates, around A (by name)
    stop = {n: UnitState(n, "activating", "start-pre", 21, "stop") for n in (A, B, C, D)}
    kit.tracker.states[before] = at_gate(before)
    kit.tracker.states.update(stop)
    kit.tracker.states[after] = at_gate(after)
    kit.tracker.stopped_at_gate.update(stop)
    for name in (A, B, C, before, after):
        kit.specs[name] = UnitSpec(name, 10)
    kit.scheduler.phases[B] = Phase.STARTING
    kit.scheduler.waiting.add(C)
    kit.rescan = False
    assert messages(kit.restore.rebuild()) == [
        f"request {before}",
        f"inactive {A} stopped",
        f"request {after}",
        "recover",
        "schedule",
    ]
    for name in (before, after):
        del kit.tracker.states[name]
    kit.rescan = True
    assert messages(kit.restore.rebuild()) == [f"inactive {A} stopped", "recover", "schedule"]
    assert kit.held_for_rescan == []


def queued(name: str, job: int) -> UnitState:
    """A start job queued for the inactive unit, not at its gate yet."""
    return UnitState(name, "inactive", "dead", job, "start")


def test_queued_free_names_the_queued_starts_that_wait_for_no_gpu_units_start(
    tmp_path: Path,
) -> None:
    """Read, most urgent first, for every annotated queued start the core neither has
    waiting nor keeps nothing for: a (10) waits for b's start (a GPU unit: not free), c
    (20) for a plain unit's start, which waits for nothing, d's (30) read fails (not free,
    counted), f (40, a start of ours keeping GPU 0) waits for nothing, h's read (90) gets a
    reply of no form the adapter knows (not free, counted, said: start-up goes on). Not
    read: one at its gate (e), not annotated (p), waiting in the core (w), starting keeping
    nothing (g)."""
    kit = Kit(tmp_path)
    plain, e, f, g, h, p, w = (f"{n}.service" for n in ("plain", "e", "f", "g", "h", "p", "w"))
    for name, job in ((A, 3), (C, 5), (D, 8), (f, 10), (g, 11), (p, 12), (w, 13), (h, 14)):
        kit.tracker.states[name] = queued(name, job)
    kit.tracker.states[B] = at_gate(B)
    kit.tracker.states[e] = at_gate(e)
    for prio, name in enumerate((A, B, C, D, e, f, g, w, h), start=1):
        kit.specs[name] = UnitSpec(name, prio * 10)
    kit.specs[B] = UnitSpec(B, 5)
    kit.hold(f, [0], Phase.STARTING, queued(f, 10))
    kit.hold(g, [], Phase.STARTING, queued(g, 11))
    kit.scheduler.waiting.add(w)
    kit.systemd.waited_for = {
        3: [(9, B, "start")],
        5: [(6, plain, "start")],
        6: [(7, "x.service", "stop")],
        8: NO_REPLY,
        14: TypeError("a reply of no known form"),
    }
    free = asyncio.run(kit.restore.queued_free())
    assert free == {C: 5, f: 10}
    assert sorted(d for d in kit.did if d.startswith("jobs_waited_for")) == [
        f"jobs_waited_for {j}" for j in ("10", "14", "3", "5", "6", "7", "8", "9")
    ]
    assert kit.counters.errors["dbus_call_errors"] == 2


def test_a_queued_start_not_read_free_is_left_to_its_gate_and_ours_keeps_no_place(
    tmp_path: Path,
) -> None:
    """a (10) Requires= and After= b (50), one GPU: a's start is queued behind b's, at its
    gate. Queued at once, a was granted GPU 0 and b's gate waited for it, while a's start
    waited for b's: neither ran. Not free, a is left to its gate; c, a start of ours
    (refill, comeback) keeping GPU 1, keeps nothing (`start_waits`); one read free but for
    another job than systemd shows now (d) is not taken for free."""
    kit = Kit(tmp_path)
    kit.tracker.states.update({A: queued(A, 3), B: at_gate(B), D: queued(D, 8)})
    kit.specs.update({A: UnitSpec(A, 10), B: UnitSpec(B, 50), C: UnitSpec(C, 40)})
    kit.specs[D] = UnitSpec(D, 60)
    kit.hold(C, [1], Phase.STARTING, queued(C, 5))
    assert messages(kit.restore.rebuild(free={D: 7})) == [
        "request b.service",
        "start_waits c.service",
        "recover",
        "schedule",
    ]
    kit.did.clear()
    assert messages(kit.restore.rebuild(free={A: 3, C: 5, D: 8})) == [
        "request a.service",
        "request b.service",
        "request d.service",
        "recover",
        "schedule",
    ]


def test_start_up_reads_so_many_queued_starts_so_long_at_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A job queue of thousands, or a systemd that does not answer, holds start-up no longer
    than QUEUED_READ_WAIT: the QUEUED_READ_MAX most urgent are read, all at once; one not
    answered by then, and those beyond, are not free, and the journal says how many."""
    monkeypatch.setattr(restore_module, "QUEUED_READ_MAX", 3)
    monkeypatch.setattr(restore_module, "QUEUED_READ_WAIT", 0.05)
    kit = Kit(tmp_path)
    names = [f"u{i}.service" for i in range(6)]
    for i, name in enumerate(names):
        kit.tracker.states[name] = queued(name, 100 + i)
        kit.specs[name] = UnitSpec(name, 10 + i)
    kit.systemd.hangs = {101}

    async def read() -> tuple[dict[str, int], list[str]]:
        return await kit.restore.queued_free(), list(kit.did)  # what was over on return

    with caplog.at_level(logging.INFO, logger="gpuslice"):
        free, did = asyncio.run(read())
    assert free == {"u0.service": 100, "u2.service": 102}
    assert [d for d in did if d.startswith("jobs_waited_for")] == [
        "jobs_waited_for 100",
        "jobs_waited_for 101",
        "jobs_waited_for 102",
        "jobs_waited_for 101 over",  # the hung read cancelled, and its cancel over
    ]
    assert said(caplog) == [
        (
            logging.INFO,
            "cannot tell whether 4 queued starts wait for a GPU unit's start (u1.service): "
            "each is judged when its gate asks",
        )
    ]


def test_reads_of_no_known_form_are_each_said_and_so_many_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every read answered in no form the adapter knows is said with its unit and error;
    with none beyond QUEUED_READ_MAX, the journal still says how many are left to their
    gates, naming the first eight of them."""
    kit = Kit(tmp_path)
    names = [f"u{i}.service" for i in range(9)]
    for i, name in enumerate(names):
        kit.tracker.states[name] = queued(name, 100 + i)
        kit.specs[name] = UnitSpec(name, 10 + i)
        kit.systemd.waited_for[100 + i] = TypeError(f"form {i}")
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        assert asyncio.run(kit.restore.queued_free()) == {}
    assert said(caplog) == [
        *(
            (logging.WARNING, f"cannot read the jobs {n} waits for: TypeError('form {i}')")
            for i, n in enumerate(names)
        ),
        (
            logging.INFO,
            "cannot tell whether 9 queued starts wait for a GPU unit's start ("
            + ", ".join(names[:8])
            + "): each is judged when its gate asks",
        ),
    ]
    assert kit.counters.errors["dbus_call_errors"] == 9


# ---- remember_told, started_again ---------------------------------------------------------


def test_remember_told_reads_the_uuids_of_holders_past_their_gate_and_suspended_units(
    tmp_path: Path,
) -> None:
    """A holder past its gate whose file names the GPUs it is booked on: the inventory and
    the core learn their UUIDs; one whose file names others, or a starting one (its file is
    an earlier run's), not. Each suspended unit: the core learns what its file names, {} for
    none. Learned: what the inventory answered for any of them."""
    kit = Kit(tmp_path)
    kit.hold(A, [0], Phase.RUNNING, running(A))
    kit.hold(B, [1], Phase.FROZEN, running(B))
    kit.hold(C, [0], Phase.STARTING, running(C))
    kit.hold(D, [1], Phase.RUNNING, running(D))
    kit.scheduler.suspended = ["e.service", "f.service"]
    kit.told(A, Gpu(0, UUID0))
    kit.told(B, Gpu(1, UUID1))
    kit.told(C, Gpu(0, UUID0))
    kit.told(D, Gpu(0, UUID0))
    kit.told("e.service", Gpu(1, UUID1))
    kit.learns = True
    assert kit.restore.remember_told() is True
    assert kit.did == [
        f"remember {{0: '{UUID0}'}}",
        f"remember_uuids a.service {{0: '{UUID0}'}}",
        f"remember {{1: '{UUID1}'}}",
        f"remember_uuids b.service {{1: '{UUID1}'}}",
        f"remember_uuids e.service {{1: '{UUID1}'}}",
        "remember_uuids f.service {}",
    ]
    kit.learns = False
    assert kit.restore.remember_told() is False


def test_remember_told_is_true_if_any_holder_taught_the_inventory(tmp_path: Path) -> None:
    kit = Kit(tmp_path)
    kit.hold(A, [0], Phase.RUNNING, running(A))
    kit.hold(B, [1], Phase.RUNNING, running(B))
    kit.told(A, Gpu(0, UUID0))
    kit.told(B, Gpu(1, UUID1))
    answers = [True, False]
    kit.remember = lambda told: answers.pop(0)  # type: ignore[method-assign]
    fresh = Restore(
        cast(Scheduler, kit.scheduler),
        cast(Tracker, kit.tracker),
        kit.systemd,
        kit.counters,
        lambda: None,
        kit.runtime_dir,
        kit.specs.get,
        kit.remember,
        kit.resample,
        lambda: False,
        kit.held_for_rescan.append,
    )
    assert fresh.remember_told() is True


@pytest.mark.parametrize(
    ("phase", "state", "again"),
    [
        (Phase.FROZEN, at_gate(A), True),
        (Phase.SUSPENDING, at_gate(A), True),
        (Phase.SUSPENDED, UnitState(A, "inactive", "dead", 3, "start"), True),
        (Phase.RESUMING, at_gate(A), True),
        (Phase.RUNNING, at_gate(A), False),
        (Phase.FROZEN, running(A), False),
        (Phase.FROZEN, down(A), False),
        (None, at_gate(A), False),
    ],
)
def test_started_again_is_a_preempted_in_place_unit_bound_for_its_gate(
    tmp_path: Path, phase: Phase | None, state: UnitState, again: bool
) -> None:
    kit = Kit(tmp_path)
    if phase is not None:
        kit.scheduler.phases[A] = phase
    assert kit.restore.started_again(A, state) is again


# ---- sweep_env_files -----------------------------------------------------------------------


def _left(kit: Kit) -> list[str]:
    return sorted(p.name for p in (Path(kit.runtime_dir) / ENV_DIR_NAME).iterdir())


def test_the_files_of_units_that_ended_meanwhile_go_and_the_rest_stay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Kept: units listed other than inactive or failed, or with a job; those the core holds
    GPUs for or keeps suspended. Removed: the rest, counted in one line."""
    kit = Kit(tmp_path)
    names = [f"u{i}.service" for i in range(8)]
    for name in names:
        kit.told(name, Gpu(0))
    kit.scheduler.holders["u4.service"] = frozenset({0})
    kit.scheduler.suspended = ["u5.service"]
    units = [
        running("u0.service"),
        at_gate("u1.service"),
        down("u2.service", job=6),
        down("u3.service", "failed", job=2),
        down("u6.service"),
        down("u7.service", "failed"),
    ]
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        kit.restore.sweep_env_files(units)
    assert _left(kit) == names[:6]
    assert said(caplog) == [(logging.INFO, "removed env files of units no longer running: 2")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        kit.restore.sweep_env_files(units)
    assert said(caplog) == []  # none removed: nothing said


def test_a_sweep_looks_at_env_sweep_max_entries_and_says_more_are_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(restore_module, "ENV_SWEEP_MAX", 2)
    kit = Kit(tmp_path)
    for i in range(5):
        kit.told(f"u{i}.service", Gpu(0))
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        kit.restore.sweep_env_files([])
    assert len(_left(kit)) == 3
    assert said(caplog) == [
        (
            logging.WARNING,
            "removed env files of units no longer running: 2; "
            f"{Path(kit.runtime_dir) / ENV_DIR_NAME} holds more than 2 entries, the rest are "
            "looked at when gpuslice starts again",
        )
    ]
