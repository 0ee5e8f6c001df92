"""Invariants of the core under random histories, played through `Sim`.

A hypothesis state machine draws a host (1-4 GPUs) and 2-8 units (priorities with ties,
kinds, 1-3 GPUs, Requeue=yes/no, some not yet annotated), then interleaves what people
and units do (start, exit, fail, manual stop), what systemd does with gpuslice's jobs
(a pending stop or start completes, in any order), and daemon-reloads that change a
priority, remove or add an annotation. `Sim` checks every action as it comes back (see
tests/core_builders.py): no GPU with two units, no Grant while that unit's victims still
run, every Stop's victim strictly less urgent than its waiter and never stopped twice, no
spontaneous Start of a unit a person stopped or that failed or finished, no waiter left
waiting while a less urgent one is granted GPUs it fits on. Whenever all jobs have played
out, nothing is left undone and no preempted unit with Requeue=yes is forgotten.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from gpuslice.core.model import UnitKind, UnitSpec
from gpuslice.core.scheduler import Action, Outcome, Scheduler
from tests.core_builders import Sim

PRIORITIES = st.sampled_from([10, 20, 20, 50, 90])  # few values: ties are common

UNIT = st.builds(
    lambda prio, kind, gpus, requeue, annotated: (
        UnitSpec("", prio, kind, gpus, requeue),
        annotated,
    ),
    PRIORITIES,
    st.sampled_from(list(UnitKind)),
    st.integers(1, 3),
    st.booleans(),
    st.sampled_from([True, True, True, False]),
)


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.specs: list[UnitSpec] = []
        self.annotated: list[bool] = []
        self.sim = Sim(1)

    @initialize(gpus=st.integers(1, 4), units=st.lists(UNIT, min_size=2, max_size=8))
    def boot(self, gpus: int, units: list[tuple[UnitSpec, bool]]) -> None:
        self.specs = [replace(s, name=f"u{i}.service") for i, (s, _) in enumerate(units)]
        self.annotated = [annotated for _, annotated in units]
        self.sim = Sim(gpus, self._annotations())
        self.sim.boot()

    def _annotations(self) -> list[UnitSpec]:
        return [s for s, on in zip(self.specs, self.annotated, strict=True) if on]

    def _unit(self, index: int) -> str:
        return self.specs[index % len(self.specs)].name

    # -- people and units -------------------------------------------------------------------

    @rule(index=st.integers(0, 7))
    def person_starts(self, index: int) -> None:
        name = self._unit(index)
        if name in self.sim.annotations:
            self.sim.start(name)

    @rule(index=st.integers(0, 7), outcome=st.sampled_from([Outcome.EXITED, Outcome.FAILED]))
    def unit_exits(self, index: int, outcome: Outcome) -> None:
        running = sorted(n for n in self.sim.running if n not in self.sim.pending_stops)
        if running:
            self.sim.exit(running[index % len(running)], outcome)

    @rule(index=st.integers(0, 7))
    def person_stops(self, index: int) -> None:
        self.sim.stop(self._unit(index))

    # -- systemd plays gpuslice's jobs ------------------------------------------------------

    @precondition(lambda self: bool(self.sim.pending_stops))
    @rule(index=st.integers(0, 7))
    def stop_completes(self, index: int) -> None:
        self.sim.finish_stop(self.sim.pending_stops[index % len(self.sim.pending_stops)])

    @precondition(lambda self: bool(self.sim.pending_starts))
    @rule(index=st.integers(0, 7))
    def start_reaches_gate(self, index: int) -> None:
        self.sim.finish_start(self.sim.pending_starts[index % len(self.sim.pending_starts)])

    @rule()
    def quiesce(self) -> None:
        self.sim.settle()
        self.sim.check_quiet()

    # -- daemon-reload ----------------------------------------------------------------------

    @rule(index=st.integers(0, 7), prio=PRIORITIES)
    def priority_changes(self, index: int, prio: int) -> None:
        index %= len(self.specs)
        self.specs[index] = replace(self.specs[index], priority=prio)
        self.sim.annotate(self._annotations())

    @rule(index=st.integers(0, 7))
    def annotation_toggles(self, index: int) -> None:
        """Only for units at rest: removing the annotation of an active unit makes gpuslice
        forget it by design (tests/test_core_rules.py covers that)."""
        index %= len(self.specs)
        name = self.specs[index].name
        sim = self.sim
        if name in sim.running or name in sim.at_gate or name in sim.pending_starts:
            return
        if name in sim.pending_stops or name in sim.unmanaged:
            return
        self.annotated[index] = not self.annotated[index]
        self.sim.annotate(self._annotations())

    @precondition(lambda self: not self.sim.pending_stops)
    @rule()
    def controller_restarts(self) -> None:
        """A fresh Scheduler loads the saved state; running units are adopted on their
        saved GPUs and every gate still waiting asks again (a gate that asks late may find
        its unit started by refill meanwhile: systemd merges that start into its job).
        Not while a stop job runs:
        the saved state does not say which waiter it is for (see the xfail in
        tests/test_core_rules.py)."""
        sim = self.sim
        saved = sim.sched.save()
        sim.sched = Scheduler(sim.sched.gpus, sim.annotations)
        sim.sched.load(saved)
        gates = sorted(sim.at_gate)
        sim.at_gate.clear()
        for name in gates:
            if name in sim.pending_starts:  # started by refill before its gate asked again
                sim.pending_starts.remove(name)  # one start job: the one at the gate
            sim.start(name)
        adopted: list[Action] = []
        for name, gpus in sorted(sim.running.items()):
            if name in sim.annotations:
                adopted += sim.sched.running(name, gpus)
        sim._feed(adopted + sim.sched.schedule())

    @invariant()
    def books_balance(self) -> None:
        self.sim._check_books()

    def teardown(self) -> None:
        if self.specs:
            self.sim.settle()
            self.sim.check_quiet()


CoreMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
TestCore = CoreMachine.TestCase
