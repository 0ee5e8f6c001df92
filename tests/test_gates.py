"""gpuslice/gates.py on its own: what a gate that asks is answered.

Small fakes stand for the core, the tracker, systemd, the gate calls waiting on D-Bus and at
their pipes, the rescans, start-up's restore, NVML's sample, the ladder, our calls to systemd
and a grant's way to its gate (no controller, no bus): each notes what it was asked, in order,
in one list (`Kit.did`), and answers what the test set. Env files are real, in a temporary
runtime_dir; the coroutines `Gates` spawns are kept (`Kit.spawned`) and run by the test.

README ("Security model"): a gate's call is served only from a process in the unit it names;
("The rules in short"): a unit whose annotation went passes its gate, on the GPUs still held
for it, and a start whose gate a daemon-reload took out is restarted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest

from gpuslice import envfiles
from gpuslice import gates as gates_module
from gpuslice.calls import Calls
from gpuslice.core.decisions import Cause, Code, Decision, render
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import Action, Log, Outcome, Phase, Scheduler
from gpuslice.counters import Counters
from gpuslice.delivery import Delivery
from gpuslice.gatepipes import GatePipes
from gpuslice.gates import Gates
from gpuslice.gpuwatch import FRESH_SAMPLE, GpuWatch
from gpuslice.ladder import Ladder
from gpuslice.paths import GATE_NAME, env_file
from gpuslice.rescans import Rescans
from gpuslice.restore import Restore
from gpuslice.service import ACCESS_DENIED, SchedulerService
from gpuslice.systemd import NO_REPLY, Systemd, SystemdError
from gpuslice.tracker import Tracker, UnitState

A = "a.service"
SENDER = ":1.9"
# what serving A's gate does: passed, a fresh sample, its request decided in one batch
SERVED = [
    f"passed_gate {A}",
    f"refresh_if_older {FRESH_SAMPLE}",
    "batch",
    f"request {A}",
    f"execute request {A}",
    "decide",
]
TRANSIENT = SystemdError(NO_REPLY, "no reply")
REFUSED = SystemdError("org.freedesktop.systemd1.OperationRefused", "refused")
GATE_LINE = (f"/usr/lib/gpuslice/{GATE_NAME}", [GATE_NAME])
OWN_LINE = ("/usr/bin/fetch-model", ["fetch-model"])


def at_gate(name: str = A) -> UnitState:
    return UnitState(name, "activating", "start-pre", 9, "start")


def running(name: str = A) -> UnitState:
    return UnitState(name, "active", "running", 0)


def down(name: str = A) -> UnitState:
    return UnitState(name, "inactive", "dead", 0)


class FakeScheduler:
    """The core's books as the test sets them; each question that changes something noted in
    `did`, its answer a Log naming it."""

    def __init__(self, did: list[str]) -> None:
        self.did = did
        self.phases: dict[str, Phase] = {}
        self.holders: dict[str, frozenset[int]] = {}
        self.let_go: set[str] = set()  # units `let_through` lets go of their GPUs
        self.waiters: set[str] = set()  # units waiting whose gate asked (`asked`)

    def _said(self, what: str) -> list[Action]:
        self.did.append(what)
        return [Log(what)]

    def phase(self, name: str) -> Phase | None:
        return self.phases.get(name)

    def grants(self) -> dict[str, frozenset[int]]:
        return dict(self.holders)

    def asked(self, name: str) -> bool:
        return name in self.waiters

    def request(self, spec: UnitSpec) -> list[Action]:
        self.waiters.add(spec.name)
        return self._said(f"request {spec.name}")

    def let_through(self, name: str) -> list[Action]:
        if name in self.let_go:
            self.holders.pop(name, None)
        return self._said(f"let_through {name}")

    def inactive(self, name: str, outcome: Outcome) -> list[Action]:
        return self._said(f"inactive {name} {outcome.value}")


class FakeTracker:
    def __init__(self, did: list[str]) -> None:
        self.did = did
        self.states: dict[str, UnitState] = {}
        self.counts: dict[str, int] = {}
        self.ended = Outcome.STOPPED  # what `outcome` says of any state
        self.stopped_at_gate: set[str] = set()  # `leaving`: someone stops them at their gate

    def state(self, name: str) -> UnitState:
        return self.states.get(name, down(name))

    def leaving(self, name: str) -> bool:
        return name in self.stopped_at_gate

    def signals(self, name: str) -> int:
        return self.counts.get(name, 0)

    def passed_gate(self, unit: str) -> None:
        self.did.append(f"passed_gate {unit}")

    def outcome(self, state: UnitState) -> Outcome:
        self.did.append(f"outcome {state.name} {state.sub}")
        return self.ended


class FakeSystemd:
    def __init__(self, did: list[str]) -> None:
        self.did = did
        self.pids: dict[str, int] = {SENDER: 7}
        self.invocations: dict[str, str | None] = {}
        self.invocation_error: SystemdError | None = None
        self.commands: dict[str, list[tuple[str, list[str]]]] = {}
        self.commands_error: SystemdError | None = None
        self.restart_error: SystemdError | None = None

    async def caller_pid(self, sender: str) -> int:
        self.did.append(f"caller_pid {sender}")
        if sender not in self.pids:
            raise SystemdError("org.freedesktop.DBus.Error.NameHasNoOwner", "gone")
        return self.pids[sender]

    async def invocation(self, name: str) -> str | None:
        self.did.append(f"invocation {name}")
        if self.invocation_error is not None:
            raise self.invocation_error
        return self.invocations.get(name)

    async def exec_start_pre(self, name: str) -> list[tuple[str, list[str]]]:
        self.did.append(f"exec_start_pre {name}")
        if self.commands_error is not None:
            raise self.commands_error
        return self.commands.get(name, [])

    async def try_restart_unit(self, name: str) -> str:
        self.did.append(f"try_restart_unit {name}")
        if self.restart_error is not None:
            raise self.restart_error
        return "/job/1"

    async def stop_unit(self, name: str) -> str:  # passed to Calls.send, never awaited here
        raise AssertionError("sent through calls")


class FakeService:
    """The gate calls waiting on D-Bus: `pending` those the test set; a grant answers one."""

    def __init__(self, did: list[str]) -> None:
        self.did = did
        self.waiting: set[str] = set()
        self.grants_answer = 1  # how many calls a grant answers

    def pending(self, unit: str) -> bool:
        return unit in self.waiting

    def refuse(self, unit: str, sender: str, error: str, text: str) -> None:
        self.did.append(f"refuse {unit} {sender} {error} {text}")
        self.waiting.discard(unit)

    def forget(self, unit: str) -> None:
        self.did.append(f"forget {unit}")
        self.waiting.discard(unit)

    def grant(self, unit: str, gpus: str) -> int:
        self.did.append(f"grant {unit} {gpus!r}")
        self.waiting.discard(unit)
        return self.grants_answer


class FakePipes:
    def __init__(self, did: list[str]) -> None:
        self.did = did
        self.granted_at: dict[str, str | None] = {}  # answered at their pipe, with the start

    def answered(self, unit: str) -> bool:
        return unit in self.granted_at

    def granted(self, unit: str) -> str | None:
        return self.granted_at.get(unit)

    def close(self, unit: str) -> bool:
        self.did.append(f"close {unit}")
        return True

    def at_gate_unknown(self, unit: str) -> None:
        self.did.append(f"at_gate_unknown {unit}")


class FakeRescans:
    def __init__(self, did: list[str]) -> None:
        self.did = did
        self.task: object | None = None
        self.rescans_for: set[str] = set()  # units `for_gate` starts a rescan of its own for

    def for_gate(self, unit: str) -> bool:
        self.did.append(f"for_gate {unit}")
        return unit in self.rescans_for

    def park(self, unit: str) -> None:
        self.did.append(f"park {unit}")


class FakeRestore:
    def __init__(self) -> None:
        self.again: set[str] = set()

    def started_again(self, name: str, state: UnitState) -> bool:
        return name in self.again


class FakeWatch:
    def __init__(self, did: list[str]) -> None:
        self.did = did
        self.available = True

    def refresh(self, released: str = "") -> None:
        self.did.append(f"refresh released={released}")

    def refresh_if_older(self, age: float) -> None:
        self.did.append(f"refresh_if_older {age}")


class FakeLadder:
    def __init__(self, did: list[str]) -> None:
        self.did = did

    def went_down(self, unit: str) -> None:
        self.did.append(f"went_down {unit}")


class FakeCalls:
    def __init__(self, kit: Kit) -> None:
        self.kit = kit

    def send(self, method: Any, unit: str, what: str) -> None:
        assert method == self.kit.systemd.stop_unit
        self.kit.did.append(f"send {what} {unit}")


class FakeDelivery:
    def __init__(self, did: list[str]) -> None:
        self.did = did
        self.withheld: set[str] = set()
        self.named = True  # what `names_held` answers

    def withdraw(self, unit: str) -> bool:
        self.did.append(f"withdraw {unit}")
        return unit in self.withheld

    def names_held(self, unit: str, held: Sequence[int], again: bool) -> bool:
        self.did.append(f"names_held {unit} {list(held)} again={again}")
        return self.named


class Kit:
    """A Gates with its fakes."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.did: list[str] = []
        self.scheduler = FakeScheduler(self.did)
        self.tracker = FakeTracker(self.did)
        self.systemd = FakeSystemd(self.did)
        self.service = FakeService(self.did)
        self.pipes = FakePipes(self.did)
        self.counters = Counters()
        self.specs: dict[str, UnitSpec] = {A: UnitSpec(A, 5)}
        self.rescans = FakeRescans(self.did)
        self.restore = FakeRestore()
        self.watch = FakeWatch(self.did)
        self.ladder = FakeLadder(self.did)
        self.calls = FakeCalls(self)
        self.delivery = FakeDelivery(self.did)
        self.runtime_dir = str(tmp_path / "run")
        self.spawned: list[Coroutine[Any, Any, None]] = []
        self.waits: list[str] = []  # gates whose first ask was served (Controller._gate_waits)
        self.cgroups: dict[int, str] = {7: A}  # PID -> the unit its cgroup says
        monkeypatch.setattr(gates_module, "unit_of_pid", self.cgroups.get)
        self.gates = Gates(
            cast(Scheduler, self.scheduler),
            cast(Tracker, self.tracker),
            cast(Systemd, self.systemd),
            cast(SchedulerService, self.service),
            cast(GatePipes, self.pipes),
            self.counters,
            self.specs.get,
            cast(Rescans, self.rescans),
            cast(Restore, self.restore),
            cast(GpuWatch, self.watch),
            cast(Ladder, self.ladder),
            cast(Calls, self.calls),
            cast(Delivery, self.delivery),
            lambda: self.runtime_dir,
            self.batched,
            self.execute,
            self.spawned.append,
            self.say,
            lambda unit: self.did.append(f"queued {unit}"),
            self.waits.append,
        )

    @contextmanager
    def batched(self) -> Iterator[None]:
        self.did.append("batch")
        yield
        self.did.append("decide")

    def execute(self, actions: list[Action]) -> None:
        self.did.extend(f"execute {a.message}" for a in cast(list[Log], actions))

    def say(self, message: str, level: str, decision: Decision | None) -> None:
        self.did.append(f"say {level} {message}")
        assert decision is not None and render(decision) == message

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run(coro)

    def run_spawned(self) -> None:
        while self.spawned:
            asyncio.run(self.spawned.pop(0))

    def asking(self, unit: str = A, state: UnitState | None = None) -> None:
        """The unit's gate call waits on D-Bus, and systemd last showed `state`."""
        self.service.waiting.add(unit)
        self.tracker.states[unit] = state or at_gate(unit)


@pytest.fixture
def kit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Kit]:
    kit = Kit(tmp_path, monkeypatch)
    yield kit
    for coro in kit.spawned:  # spawned, not run by the test
        coro.close()


# ---- verify_acquire: who may ask, and when ----


def test_a_caller_that_cannot_be_identified_is_refused(kit: Kit) -> None:
    kit.asking()
    kit.run(kit.gates.verify_acquire(A, ":1.404", 0))
    assert kit.did == [
        "caller_pid :1.404",
        f"refuse {A} :1.404 {ACCESS_DENIED} cannot identify the caller: "
        "org.freedesktop.DBus.Error.NameHasNoOwner: gone",
    ]
    assert kit.counters.errors["dbus_acquire_refused"] == 1


@pytest.mark.parametrize(("unit_of_7", "said"), [("b.service", "b.service"), (None, "no unit")])
def test_a_caller_that_runs_in_another_unit_is_refused(
    kit: Kit, caplog: pytest.LogCaptureFixture, unit_of_7: str | None, said: str
) -> None:
    kit.asking()
    del kit.cgroups[7]
    if unit_of_7 is not None:
        kit.cgroups[7] = unit_of_7
    with caplog.at_level(logging.WARNING, "gpuslice"):
        kit.run(kit.gates.verify_acquire(A, SENDER, 0))
    assert kit.did == [
        f"caller_pid {SENDER}",
        f"refuse {A} {SENDER} {ACCESS_DENIED} PID 7 does not run in {A}",
    ]
    assert kit.counters.errors["dbus_acquire_refused"] == 1
    assert caplog.messages == [f"refused an Acquire for {A} from PID 7, which runs in {said}"]


def test_a_call_answered_while_its_caller_was_checked_is_left(kit: Kit) -> None:
    kit.tracker.states[A] = at_gate()
    kit.run(kit.gates.verify_acquire(A, SENDER, 0))
    assert kit.did == [f"caller_pid {SENDER}"]
    assert kit.counters.errors["dbus_acquire_refused"] == 0


def test_a_start_cancelled_while_its_caller_was_checked_is_forgotten(kit: Kit) -> None:
    kit.asking(state=down())
    kit.tracker.counts[A] = 3  # signals since the call came
    kit.run(kit.gates.verify_acquire(A, SENDER, 2))
    assert kit.did == [f"caller_pid {SENDER}", f"forget {A}"]


def test_the_gate_of_a_start_someone_stops_there_is_told_to_ask_again_not_served(
    kit: Kit,
) -> None:
    """Told down at its gate as someone's stop of it was seen (Tracker.stopped_at_gate),
    the unit's gate, asking before systemd kills it, is not served: served, the start being
    stopped waited again, preempting for nothing. Told to ask again, it is killed first."""
    kit.asking(state=at_gate())
    kit.tracker.stopped_at_gate.add(A)
    kit.gates.serve_gate(A)
    assert kit.did == [f"forget {A}"]


@pytest.mark.parametrize(("seen", "state"), [(3, down()), (2, at_gate())])
def test_a_start_down_with_no_signal_since_or_still_at_its_gate_is_served(
    kit: Kit, seen: int, state: UnitState
) -> None:
    kit.asking(state=state)
    kit.tracker.counts[A] = 3
    kit.run(kit.gates.verify_acquire(A, SENDER, seen))
    assert kit.did == [f"caller_pid {SENDER}", f"queued {A}"]
    kit.gates.acquire_verified(A, placed=True)
    assert kit.did == [f"caller_pid {SENDER}", f"queued {A}", *SERVED]


def test_a_gate_the_scan_does_not_know_is_parked_for_a_rescan_of_its_own(kit: Kit) -> None:
    del kit.specs[A]
    kit.rescans.rescans_for.add(A)
    kit.asking()
    kit.run(kit.gates.verify_acquire(A, SENDER, 0))
    assert kit.did == [f"caller_pid {SENDER}", f"for_gate {A}", f"park {A}"]


def test_an_unknown_gate_with_no_rescan_running_or_due_is_let_through(kit: Kit) -> None:
    del kit.specs[A]
    kit.asking()
    kit.run(kit.gates.verify_acquire(A, SENDER, 0))
    assert kit.did[:3] == [f"caller_pid {SENDER}", f"for_gate {A}", f"withdraw {A}"]


@pytest.mark.parametrize(
    ("annotated", "phase"), [(False, Phase.RUNNING), (True, None), (True, Phase.STARTING)]
)
def test_while_a_rescan_runs_an_unknown_or_unanswered_gate_is_parked(
    kit: Kit, annotated: bool, phase: Phase | None
) -> None:
    if not annotated:
        del kit.specs[A]
    if phase is not None:
        kit.scheduler.phases[A] = phase
    kit.rescans.task = object()
    kit.asking()
    kit.run(kit.gates.verify_acquire(A, SENDER, 0))
    assert kit.did[-1] == f"park {A}"
    assert f"request {A}" not in kit.did


def test_while_a_rescan_runs_an_annotated_gate_already_answered_is_served(kit: Kit) -> None:
    kit.scheduler.phases[A] = Phase.RUNNING
    kit.scheduler.holders[A] = frozenset({1})
    kit.rescans.task = object()
    kit.asking()
    kit.run(kit.gates.verify_acquire(A, SENDER, 0))
    assert kit.did == [
        f"caller_pid {SENDER}",
        *SERVED,
    ]


@pytest.mark.parametrize(
    ("phase", "unanswered"),
    [(None, True), (Phase.STARTING, True), (Phase.RUNNING, False), (Phase.STOPPING, False)],
)
def test_unanswered_is_unknown_or_starting(kit: Kit, phase: Phase | None, unanswered: bool) -> None:
    if phase is not None:
        kit.scheduler.phases[A] = phase
    assert kit.gates.unanswered(A) is unanswered


# ---- acquire_verified: a call of a start already answered, or of the next ----


@pytest.mark.parametrize("phase", [None, Phase.STARTING])
def test_a_call_the_core_has_not_answered_waits_for_the_starts_systemd_queued(
    kit: Kit, phase: Phase | None
) -> None:
    """Served only among the starts of its transaction (gpuslice/queued.py), then at once."""
    if phase is not None:
        kit.scheduler.phases[A] = phase
    kit.asking()
    kit.gates.acquire_verified(A)
    assert kit.did == [f"queued {A}"]
    kit.gates.acquire_verified(A, placed=True)
    assert kit.did == [f"queued {A}", *SERVED]


def test_a_call_of_an_unannotated_unit_does_not_wait_for_the_starts_queued(kit: Kit) -> None:
    del kit.specs[A]
    kit.asking()
    kit.gates.acquire_verified(A)
    assert f"queued {A}" not in kit.did
    assert kit.did[:1] == [f"withdraw {A}"]


def test_a_verified_call_answered_meanwhile_is_left(kit: Kit) -> None:
    kit.gates.acquire_verified(A)
    assert kit.did == []


def test_a_granted_unit_past_its_gate_has_the_call_of_its_next_start_forgotten(kit: Kit) -> None:
    kit.scheduler.phases[A] = Phase.RUNNING
    kit.asking(state=running())
    kit.gates.acquire_verified(A)
    assert kit.did == [f"forget {A}"]


def test_a_unit_granted_at_its_pipe_that_asks_is_checked_for_its_start(kit: Kit) -> None:
    kit.scheduler.phases[A] = Phase.RUNNING
    kit.pipes.granted_at[A] = "inv1"
    kit.asking()
    kit.gates.acquire_verified(A)
    assert kit.did == []
    assert len(kit.spawned) == 1
    kit.scheduler.holders[A] = frozenset({1, 0})
    kit.systemd.invocations[A] = "inv1"
    kit.run_spawned()
    assert kit.did == [f"invocation {A}", f"grant {A} '0,1'"]


@pytest.mark.parametrize("phase", [Phase.STARTING, None])
def test_a_unit_answered_at_its_pipe_but_not_running_is_served(
    kit: Kit, phase: Phase | None
) -> None:
    if phase is not None:
        kit.scheduler.phases[A] = phase
    kit.pipes.granted_at[A] = "inv1"
    kit.asking()
    kit.gates.acquire_verified(A)
    assert kit.did == [f"queued {A}"]  # among the starts queued (gpuslice/queued.py)
    kit.gates.acquire_verified(A, placed=True)
    assert kit.spawned == []
    assert kit.did[1] == f"passed_gate {A}"
    assert kit.did[-2] == f"execute request {A}"


def test_a_running_unit_at_its_gate_not_answered_at_its_pipe_is_served(kit: Kit) -> None:
    kit.scheduler.phases[A] = Phase.RUNNING
    kit.asking()
    kit.gates.acquire_verified(A)
    assert kit.spawned == []
    assert kit.did[-2] == f"execute request {A}"


# ---- _grant_again ----


def again(kit: Kit, current: str | None = "inv1", granted: str | None = "inv1") -> None:
    kit.scheduler.phases[A] = Phase.RUNNING
    kit.scheduler.holders[A] = frozenset({2, 0})
    kit.pipes.granted_at[A] = "inv1"
    kit.systemd.invocations[A] = current
    kit.asking()
    kit.run(kit.gates._grant_again(A, granted))


def test_the_same_start_granted_at_its_pipe_is_granted_again_over_dbus(kit: Kit) -> None:
    again(kit)
    assert kit.did == [f"invocation {A}", f"grant {A} '0,2'"]
    assert kit.counters.gate_answers == {"pipe": 0, "dbus": 1}


def test_a_grant_again_that_answers_no_call_is_not_counted(kit: Kit) -> None:
    kit.service.grants_answer = 0
    again(kit)
    assert kit.did[-1] == f"grant {A} '0,2'"
    assert kit.counters.gate_answers["dbus"] == 0


@pytest.mark.parametrize(
    ("current", "granted"), [("inv2", "inv1"), (None, "inv1"), ("inv2", "inv2")]
)
def test_the_next_start_is_told_to_ask_again(kit: Kit, current: str | None, granted: str) -> None:
    again(kit, current, granted)  # the last of them: the pipe granted inv1, not inv2
    assert kit.did == [f"invocation {A}", f"forget {A}"]
    assert kit.counters.gate_answers["dbus"] == 0


def test_a_grant_again_of_a_unit_no_longer_running_is_told_to_ask_again(kit: Kit) -> None:
    kit.scheduler.phases[A] = Phase.FROZEN
    kit.pipes.granted_at[A] = "inv1"
    kit.systemd.invocations[A] = "inv1"
    kit.asking()
    kit.run(kit.gates._grant_again(A, "inv1"))
    assert kit.did == [f"invocation {A}", f"forget {A}"]


def test_an_invocation_that_cannot_be_read_has_the_call_ask_again(kit: Kit) -> None:
    kit.systemd.invocation_error = TRANSIENT
    again(kit)
    assert kit.did == [f"invocation {A}", f"forget {A}"]
    assert kit.counters.errors["dbus_call_errors"] == 1


def test_a_grant_again_answered_meanwhile_is_left(kit: Kit) -> None:
    kit.scheduler.phases[A] = Phase.RUNNING
    kit.systemd.invocations[A] = "inv1"
    kit.pipes.granted_at[A] = "inv1"
    kit.run(kit.gates._grant_again(A, "inv1"))
    assert kit.did == [f"invocation {A}"]


# ---- serve_gate ----


def test_an_annotated_gate_passes_and_asks_the_core_on_a_fresh_sample(kit: Kit) -> None:
    kit.asking()
    kit.gates.serve_gate(A)
    assert kit.did == SERVED


def test_only_a_gates_first_ask_of_its_start_is_looked_at_for_starts_kept_in_its_way(
    kit: Kit,
) -> None:
    """Each first ask has the controller walk again the starts of ours whose kept GPUs the
    gate waits on (Controller._kept_in_the_way); a gate that calls again and again, its
    start still waiting, costs no more walks."""
    kit.asking()
    for _ in range(3):
        kit.gates.serve_gate(A)
    assert kit.waits == [A]


@pytest.mark.parametrize("available", [True, False])
def test_a_run_ended_by_a_restart_while_kept_in_its_phase_is_taken_in_first(
    kit: Kit, available: bool
) -> None:
    kit.restore.again.add(A)
    kit.watch.available = available
    kit.tracker.ended = Outcome.EXITED
    kit.asking()
    kit.gates.serve_gate(A)
    refresh = [f"refresh released={A}"] if available else []
    assert kit.did == [
        *refresh,
        "batch",
        f"outcome {A} start-pre",
        f"inactive {A} exited",
        f"execute inactive {A} exited",
        "decide",
        f"went_down {A}",
        *SERVED,
    ]


def test_a_run_started_again_whose_gate_was_answered_is_not_ended_again(kit: Kit) -> None:
    kit.restore.again.add(A)
    kit.pipes.granted_at[A] = "inv1"
    kit.asking()
    kit.gates.serve_gate(A)
    assert kit.did[0] == f"passed_gate {A}"
    assert not any(d.startswith(("inactive", "went_down", "refresh released")) for d in kit.did)


@pytest.mark.parametrize("phase", [Phase.FROZEN, Phase.SUSPENDING, Phase.SUSPENDED, Phase.RESUMING])
def test_a_gate_of_a_unit_preempted_in_place_asks_again(kit: Kit, phase: Phase) -> None:
    kit.scheduler.phases[A] = phase
    kit.asking()
    kit.gates.serve_gate(A)
    assert kit.did == [f"passed_gate {A}", f"forget {A}"]


def test_a_start_that_outran_our_stop_is_stopped_again(kit: Kit) -> None:
    kit.scheduler.phases[A] = Phase.STOPPING
    kit.asking()
    kit.gates.serve_gate(A)
    assert kit.did == [f"passed_gate {A}", f"send stop {A}"]


def test_an_unannotated_gate_is_let_through_without_passing_in_the_tracker(kit: Kit) -> None:
    del kit.specs[A]
    kit.asking()
    kit.gates.serve_gate(A)
    assert kit.did[:2] == [f"withdraw {A}", f"let_through {A}"]
    assert f"passed_gate {A}" not in kit.did
    assert f"request {A}" not in kit.did


# ---- let_through, _pass_gate, _restart_ungated ----


def test_a_unit_let_through_on_no_gpus_loses_its_env_file_and_passes(kit: Kit) -> None:
    del kit.specs[A]
    envfiles.write(kit.runtime_dir, A, [Gpu(0)])
    kit.asking()
    kit.gates.let_through(A)
    assert kit.did == [
        f"withdraw {A}",
        f"let_through {A}",
        f"execute let_through {A}",
        f"close {A}",
        f"at_gate_unknown {A}",
    ]
    assert not env_file(kit.runtime_dir, A).exists()
    assert kit.gates._passing == {A}
    kit.run_spawned()
    assert kit.did[5:] == [f"exec_start_pre {A}", f"grant {A} ''"]
    assert kit.gates._passing == set()


@pytest.mark.parametrize("withheld", [True, False])
def test_a_unit_let_through_on_gpus_held_passes_once_its_file_names_them(
    kit: Kit, withheld: bool
) -> None:
    del kit.specs[A]
    kit.scheduler.holders[A] = frozenset({3, 1})
    if withheld:
        kit.delivery.withheld.add(A)
    envfiles.write(kit.runtime_dir, A, [Gpu(1), Gpu(3)])
    kit.asking()
    kit.gates.let_through(A)
    assert kit.did[3:] == [
        f"close {A}",
        f"at_gate_unknown {A}",
        f"names_held {A} [1, 3] again={withheld}",
    ]
    assert env_file(kit.runtime_dir, A).exists()
    kit.run_spawned()
    assert kit.did[-1] == f"grant {A} '1,3'"


def test_a_unit_let_through_whose_file_cannot_name_its_gpus_waits(kit: Kit) -> None:
    del kit.specs[A]
    kit.scheduler.holders[A] = frozenset({1})
    kit.delivery.named = False
    kit.asking()
    kit.gates.let_through(A)
    assert kit.did[-1] == f"names_held {A} [1] again=False"
    assert kit.spawned == []
    assert kit.gates._passing == set()


def test_a_unit_the_core_lets_go_of_passes_on_no_gpus(kit: Kit) -> None:
    del kit.specs[A]
    kit.scheduler.holders[A] = frozenset({1})
    kit.scheduler.let_go.add(A)  # its GPUs cannot be named: let go first
    envfiles.write(kit.runtime_dir, A, [Gpu(1)])
    kit.asking()
    kit.gates.let_through(A)
    assert not any(d.startswith("names_held") for d in kit.did)
    assert not env_file(kit.runtime_dir, A).exists()


def test_a_unit_let_through_with_no_call_waiting_or_one_being_passed_spawns_nothing(
    kit: Kit,
) -> None:
    del kit.specs[A]
    kit.tracker.states[A] = at_gate()
    kit.gates.let_through(A)  # its gate waits on its pipe: sent to D-Bus
    assert kit.spawned == []
    kit.service.waiting.add(A)
    kit.gates._passing.add(A)
    kit.gates.let_through(A)
    assert kit.spawned == []


def passing(kit: Kit, held: Sequence[int] = ()) -> None:
    """A let-through's call, its ExecStartPre= read (`_pass_gate`)."""
    del kit.specs[A]
    if held:
        kit.scheduler.holders[A] = frozenset(held)
    kit.asking()
    kit.gates._passing.add(A)
    kit.run(kit.gates._pass_gate(A, list(held)))
    assert kit.gates._passing == set()


@pytest.mark.parametrize("commands", [[GATE_LINE, OWN_LINE], []])
def test_a_gate_that_systemd_still_runs_or_nothing_to_skip_passes(
    kit: Kit, caplog: pytest.LogCaptureFixture, commands: list[tuple[str, list[str]]]
) -> None:
    kit.systemd.commands[A] = commands
    with caplog.at_level(logging.INFO, "gpuslice"):
        passing(kit)
    assert kit.did == [f"exec_start_pre {A}", f"grant {A} ''"]
    assert caplog.messages == [f"{A} passed the gate: not managed by gpuslice"]


def test_a_unit_let_through_on_gpus_held_says_which(
    kit: Kit, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "gpuslice"):
        passing(kit, [0, 2])
    assert kit.did == [f"exec_start_pre {A}", f"grant {A} '0,2'"]
    assert caplog.messages == [
        f"{A} passed the gate on GPUs 0,2, which it keeps until it ends: no longer annotated"
    ]


def test_a_grant_that_answers_no_call_says_nothing(
    kit: Kit, caplog: pytest.LogCaptureFixture
) -> None:
    kit.service.grants_answer = 0
    with caplog.at_level(logging.INFO, "gpuslice"):
        passing(kit)
    assert caplog.messages == []


def test_a_start_whose_gate_a_reload_took_out_is_restarted(kit: Kit) -> None:
    kit.systemd.commands[A] = [OWN_LINE]
    passing(kit)
    decision = Decision(Code.UNMANAGED, A, cause=Cause.RESTARTED)
    assert kit.did == [
        f"exec_start_pre {A}",
        f"try_restart_unit {A}",
        f"forget {A}",
        f"say info {render(decision)}",
    ]


def test_a_restart_that_did_not_reach_systemd_has_the_gate_ask_again(kit: Kit) -> None:
    kit.systemd.commands[A] = [OWN_LINE]
    kit.systemd.restart_error = TRANSIENT
    passing(kit)
    assert kit.did == [f"exec_start_pre {A}", f"try_restart_unit {A}", f"forget {A}"]
    assert kit.counters.errors["dbus_call_errors"] == 1


def test_a_restart_refused_lets_the_gate_through_and_says_what_that_costs(
    kit: Kit, caplog: pytest.LogCaptureFixture
) -> None:
    kit.systemd.commands[A] = [OWN_LINE]
    kit.systemd.restart_error = REFUSED
    with caplog.at_level(logging.WARNING, "gpuslice"):
        passing(kit)
    assert kit.did == [f"exec_start_pre {A}", f"try_restart_unit {A}", f"grant {A} ''"]
    assert kit.counters.errors["dbus_call_errors"] == 1
    assert caplog.messages == [
        f"cannot restart {A}, whose gate a daemon-reload took out: refused; letting it "
        "through, and systemd skips its own ExecStartPre= lines"
    ]


def test_an_exec_start_pre_that_did_not_reach_systemd_has_the_gate_ask_again(kit: Kit) -> None:
    kit.systemd.commands_error = TRANSIENT
    passing(kit)
    assert kit.did == [f"exec_start_pre {A}", f"forget {A}"]
    assert kit.counters.errors["dbus_call_errors"] == 1


def test_an_exec_start_pre_that_cannot_be_read_lets_the_gate_through(kit: Kit) -> None:
    kit.systemd.commands_error = REFUSED
    passing(kit)
    assert kit.did == [f"exec_start_pre {A}", f"grant {A} ''"]
    assert kit.counters.errors["dbus_call_errors"] == 1


def test_a_call_answered_while_the_exec_start_pre_was_read_is_left(kit: Kit) -> None:
    del kit.specs[A]
    kit.gates._passing.add(A)
    kit.systemd.commands[A] = [OWN_LINE]
    kit.run(kit.gates._pass_gate(A, []))
    assert kit.did == [f"exec_start_pre {A}"]
    assert kit.gates._passing == set()


def test_a_unit_annotated_again_meanwhile_is_told_to_ask_again(kit: Kit) -> None:
    kit.gates._passing.add(A)
    kit.asking()
    kit.run(kit.gates._pass_gate(A, []))
    assert kit.did == [f"exec_start_pre {A}", f"forget {A}"]
    assert kit.gates._passing == set()


def test_a_unit_whose_gpus_held_changed_meanwhile_is_told_to_ask_again(kit: Kit) -> None:
    del kit.specs[A]
    kit.scheduler.holders[A] = frozenset({1})
    kit.asking()
    kit.run(kit.gates._pass_gate(A, [0]))
    assert kit.did == [f"exec_start_pre {A}", f"forget {A}"]


def test_a_gate_passed_is_no_longer_passing_even_after_a_bug(kit: Kit) -> None:
    del kit.specs[A]
    kit.asking()
    kit.gates._passing.add(A)

    def broken(unit: str) -> bool:
        raise RuntimeError("a bug")

    kit.service.pending = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        kit.run(kit.gates._pass_gate(A, []))
    assert kit.gates._passing == set()


def test_held_for_is_the_gpus_booked_in_order(kit: Kit) -> None:
    assert kit.gates.held_for(A) == []
    kit.scheduler.holders[A] = frozenset({3, 0, 2})
    assert kit.gates.held_for(A) == [0, 2, 3]


def test_the_runtime_dir_is_read_at_each_let_through(kit: Kit, tmp_path: Path) -> None:
    del kit.specs[A]
    kit.runtime_dir = str(tmp_path / "other")  # a reload's config, as the controller reads it
    envfiles.write(kit.runtime_dir, A, [Gpu(0)])
    kit.gates.let_through(A)
    assert not env_file(kit.runtime_dir, A).exists()
