"""Invariants of the core under random histories, judged by an independent oracle.

A hypothesis state machine draws a host, either 1-4 GPUs of unknown size (no NVML: every unit
takes a whole GPU) or 1-3 GPUs of known size with a reserve, foreign use and lost GPUs mixed
in, and 2-8 units (priorities with ties, kinds, 1-3 GPUs, whole GPU or `Memory=`,
Requeue=yes/no, a Preempt= ladder, some not yet annotated). It then interleaves what people
and units do (start; a start job seen before its gate asks; exit, fail, manual stop), what
systemd and the ladder's adapter do with gpuslice's work (a pending stop, start, suspend or
resume completes, in any order; a suspend or resume fails; a freeze fails; a start of
gpuslice's does not reach systemd, and is sent again once its delay ends), daemon-reloads (a
priority or GPUs= changes, an annotation is removed or added), controller restarts (save, load,
`recover()`) and, on hosts with NVML, new samples (reserve, foreign processes, a GPU lost or
back). tests/test_core_ladder_properties.py runs the same rules on hosts where the ladder
matters most.

The oracle is `Sim` (tests/core_builders.py): its model of the host is built only from the
events fed in and the Grant, Stop and Start actions that came back, and every batch of actions
is checked against it: whole-GPU exclusivity, never a grant on a lost GPU, declared memory
within total - reserve - foreign, no grant while its victims run, no waiter passed over by a
less urgent unit, equal priority never preempts, no victim stopped twice, no unit stopped
before its gate was answered or for a request known when it was granted (thrash), no
spontaneous start, preempted units back before background units are refilled, both in their order
(priority, then preempted first; priority, then out longest); the ladder's rules (who is
suspended, stopped, resumed, frozen or thawed, when, and where: see tests/core_builders.py).
At rest nothing is left undone and nothing frozen without a reason; at the end every unit ends
until nothing runs, and then every waiter that fits on the host has been granted, the others
were told why, and every preempted unit with Requeue=yes and every suspended unit came back.

`GPUSLICE_FUZZ_EXAMPLES` sets the number of histories (default 300; `make fuzz` runs more).
"""

from __future__ import annotations

import copy
import os
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

from gpuslice.core.decisions import render
from gpuslice.core.model import Gpu, Restart, Rung, UnitKind, UnitSpec
from gpuslice.core.plan import Verdict, plan_start
from gpuslice.core.scheduler import Action, Grant, Outcome, Scheduler
from tests.core_builders import BG, GIB, OD, InvariantError, Sim, drawn, drawn_host, sized

EXAMPLES = int(os.environ.get("GPUSLICE_FUZZ_EXAMPLES", "300"))

PRIORITIES = st.sampled_from([10, 20, 20, 50, 90])  # few values: ties are common
MEMORY = st.sampled_from([None, None, 4 * GIB, 8 * GIB, 12 * GIB, 20 * GIB, 30 * GIB])
# Preempt=: every ladder the annotation allows that behaves differently
LADDER = st.sampled_from(
    [
        "stop",
        "stop",
        "suspend stop",
        "suspend stop",
        "freeze stop",
        "freeze suspend stop",
        "suspend",
        "freeze",
    ]
)

# [Service] Restart=: `always` and `on-success` keep a clean exit's GPUs for its restart
RESTART = st.sampled_from([Restart.NO, Restart.ON_FAILURE, Restart.ALWAYS, Restart.ON_SUCCESS])

UNIT = st.builds(
    lambda prio, kind, gpus, requeue, memory, ladder, annotated, restart: (
        drawn(prio, kind, gpus, requeue, memory, ladder, restart=restart),
        annotated,
    ),
    PRIORITIES,
    st.sampled_from(list(UnitKind)),
    st.sampled_from([1, 1, 1, 2, 3]),
    st.booleans(),
    MEMORY,
    LADDER,
    st.sampled_from([True, True, True, False]),
    RESTART,
)

EXITS = st.sampled_from([Outcome.EXITED, Outcome.FAILED])

# One GPU as NVML may report it: 24 GiB, a reserve, foreign use (with or without a process
# gpuslice does not manage), lost.
SAMPLE = st.tuples(
    st.sampled_from([0, 0, GIB]),
    st.sampled_from([0, 0, 0, 2 * GIB, 10 * GIB]),
    st.booleans(),
    st.sampled_from([False, False, False, False, True]),
)


def _gpu(index: int, sample: tuple[int, int, bool, bool]) -> Gpu:
    reserve, foreign, with_pid, lost = sample
    pids = (4000 + index,) if foreign and with_pid else ()
    return sized(index, reserve=reserve, foreign=foreign, foreign_pids=pids, lost=lost)


def _fields(scheduler: Scheduler) -> dict[str, object]:
    """The scheduler's state, to compare: not a twin scheduler beside it (it has no
    equality), nor the cache of each GPU's top holder, which a status read fills too."""
    return {
        k: v
        for k, v in vars(scheduler).items()
        if not isinstance(v, Scheduler) and k != "_tops_cache"
    }


class HostMachine(RuleBasedStateMachine):
    """Every rule; a subclass draws the host and its units (`@initialize`, then `_boot`)."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: list[UnitSpec] = []
        self.annotated: list[bool] = []
        self.sim = Sim(1)

    def _boot(
        self,
        host: list[int] | list[Gpu],
        units: list[tuple[UnitSpec, bool]],
        yield_to_foreign: bool,
        requeue_at_gate: bool = False,
    ) -> None:
        # no NVML (GPUs of unknown size): units keep their `Memory=`, which must change
        # nothing there (each such GPU holds one unit: the oracle's `_no_room`)
        self.specs = [replace(s, name=f"u{i}.service") for i, (s, _) in enumerate(units)]
        self.annotated = [annotated for _, annotated in units]
        self.sim = Sim(
            host,
            self._annotations(),
            yield_to_foreign=yield_to_foreign,
            requeue_at_gate=requeue_at_gate,
        )
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

    @rule(index=st.integers(0, 7))
    def person_plans_then_starts(self, index: int) -> None:
        """`gpuslice plan`: it moves nothing, and what it says is what the start then does."""
        sim = self.sim
        spec = sim.annotations.get(self._unit(index))
        if spec is None:
            return
        before = copy.deepcopy(_fields(sim.sched))
        plan = plan_start(sim.sched, spec)
        assert _fields(sim.sched) == before, f"gpuslice plan {spec.name} changed the scheduler"
        if plan.verdict in (Verdict.HOLDS, Verdict.QUEUED):
            assert sim.active(spec.name), plan
            return
        if sim.active(spec.name):
            return  # its start job is on its way (announced before a restart), not yet seen
        actions = sim.start(spec.name)
        done = [render(a.decision) for a in actions if a.decision is not None]
        planned = [render(d) for d in plan.decisions]
        # then what the adapter answers at once (a FreezeUnit that fails, in `Sim`)
        assert done[: len(planned)] == planned
        granted = any(isinstance(a, Grant) and a.unit == spec.name for a in actions)
        assert granted == (plan.verdict is Verdict.STARTS), plan
        assert bool(plan.victims) == (plan.verdict is Verdict.PREEMPTS), plan

    @rule(index=st.integers(0, 7))
    def more_urgent_starts(self, index: int) -> None:
        """A person starts a unit more urgent than the least urgent one that runs: someone
        must give way (a plain start is as often of a unit no more urgent, or too big)."""
        sim = self.sim
        running = [sim.annotations[n].priority for n in sim.running if n in sim.annotations]
        least = max(running, default=0)
        idle = sorted(
            n for n, s in sim.annotations.items() if not sim.active(n) and s.priority < least
        )
        if idle:
            sim.start(idle[index % len(idle)])

    @rule(index=st.integers(0, 7))
    def start_job_announced(self, index: int) -> None:
        """`systemctl start`, seen by the controller before the unit's gate asks."""
        name = self._unit(index)
        if name in self.sim.annotations:
            self.sim.announce(name)

    @precondition(lambda self: bool(self.sim.pending_starts))
    @rule(index=st.integers(0, 7), other=st.integers(0, 7))
    def seen_and_asked_in_one_turn(self, index: int, other: int) -> None:
        """The controller takes in every signal of one read of the bus before deciding: a
        start job is seen and another unit's gate asks, then one pass decides."""
        sim = self.sim
        asking = sim.pending_starts[other % len(sim.pending_starts)]
        name = self._unit(index)
        seen = name in sim.annotations and not sim.active(name)
        answered: list[Action] = []
        with sim.sched.deferred():
            if seen:
                sim.announce(name)
            if asking in sim.pending_starts:
                answered = sim.finish_start(asking)
        # nothing is decided for the unit just seen yet: no gate may be answered past it
        for grant in [a for a in answered if isinstance(a, Grant)] if seen else []:
            first, later = sim.annotations[name], sim.annotations[grant.unit]
            if first.priority < later.priority and sim._fits_wherever(first, later):
                raise InvariantError(f"{grant.unit} granted in the turn {name} was seen in")
        sim._feed(sim.sched.schedule())

    @rule(index=st.integers(0, 7), outcome=EXITS)
    def unit_exits(self, index: int, outcome: Outcome) -> None:
        """Also while it is being suspended or resumed; a frozen unit cannot end by itself."""
        sim = self.sim
        running = sorted(n for n in sim.running if n not in sim.pending_stops | sim.frozen.keys())
        if running:
            self.sim.exit(running[index % len(running)], outcome)

    @precondition(lambda self: bool(self.sim.sched.restart_kept))
    @rule(index=st.integers(0, 7))
    def restart_does_not_come(self, index: int) -> None:
        """A unit's GPUs were kept for its Restart= (it failed, or exited 0 under `always`
        or `on-success`), which does not start it."""
        kept = sorted(self.sim.sched.restart_kept)
        self.sim.restart_not_seen(kept[index % len(kept)])

    @rule(index=st.integers(0, 7))
    def unit_exits_and_remains_active(self, index: int) -> None:
        """RemainAfterExit=yes: its job ends, systemd keeps it active, no process left."""
        ending = self.sim.ends_remaining()
        if ending:
            self.sim.exit_remaining(ending[index % len(ending)])

    @rule(index=st.integers(0, 7), outcome=EXITS)
    def unit_exits_before_its_stop(self, index: int, outcome: Outcome) -> None:
        """Its main process ends by itself while gpuslice's stop of it is on its way."""
        ending = self.sim.ends_before_its_stop()
        if ending:
            self.sim.exit_while_stopping(ending[index % len(ending)], outcome)

    @rule(index=st.integers(0, 7))
    def person_stops(self, index: int) -> None:
        self.sim.stop(self._unit(index))

    @rule(index=st.integers(0, 7))
    def seen_down_as_an_instance(self, index: int) -> None:
        """The controller forgets an instance it sees down that is owed nothing; any unit
        here may be one (`Sim.forget_instance` checks what went against the model). Units
        owed a comeback first: they are down only until their GPUs are free."""
        sim = self.sim
        down = [s.name for s in self.specs if not sim.active(s.name)]
        down.sort(key=lambda name: name not in sim.preempted)
        if down:
            sim.forget_instance(down[index % len(down)])

    # -- systemd plays gpuslice's jobs ------------------------------------------------------

    @precondition(lambda self: bool(self.sim.pending_stops))
    @rule(index=st.integers(0, 7))
    def stop_completes(self, index: int) -> None:
        self.sim.finish_stop(self.sim.pending_stops[index % len(self.sim.pending_stops)])

    @precondition(lambda self: bool(self.sim.pending_starts))
    @rule(index=st.integers(0, 7))
    def start_reaches_gate(self, index: int) -> None:
        self.sim.finish_start(self.sim.pending_starts[index % len(self.sim.pending_starts)])

    @precondition(lambda self: bool(self.sim.ours & set(self.sim.pending_starts)))
    @rule(index=st.integers(0, 7))
    def start_does_not_reach_systemd(self, index: int) -> None:
        """A StartUnit of gpuslice's fails on the bus (systemd re-executing, its name without
        an owner for a moment): owed as before, its GPUs released, not sent again at once."""
        ours = sorted(self.sim.ours & set(self.sim.pending_starts))
        self.sim.fail_start(ours[index % len(ours)])

    @precondition(lambda self: bool(self.sim.paused))
    @rule(index=st.integers(0, 7))
    def delay_after_a_failed_start_ends(self, index: int) -> None:
        """The adapter's delay is over: the core may start the unit again, if it still wants."""
        paused = sorted(self.sim.paused)
        self.sim.retry_start(paused[index % len(paused)])

    # -- the adapter plays the Preempt= ladder ----------------------------------------------

    @precondition(lambda self: bool(self.sim.pending_suspends))
    @rule(index=st.integers(0, 7), ok=st.booleans())
    def suspend_completes(self, index: int, ok: bool) -> None:
        """Its VRAM left its GPUs, or the tool failed (no tool, a lock timed out...)."""
        self.sim.finish_suspend(
            self.sim.pending_suspends[index % len(self.sim.pending_suspends)], ok
        )

    @precondition(lambda self: bool(self.sim.pending_resumes))
    @rule(index=st.integers(0, 7), ok=st.sampled_from([True, True, False]))
    def resume_completes(self, index: int, ok: bool) -> None:
        """It runs again, or its restore failed (then it is stopped)."""
        self.sim.finish_resume(self.sim.pending_resumes[index % len(self.sim.pending_resumes)], ok)

    @precondition(lambda self: bool(self.sim.frozen))
    @rule(index=st.integers(0, 7))
    def freeze_fails(self, index: int) -> None:
        """FreezeUnit failed (its answer comes after the core froze it)."""
        frozen = sorted(self.sim.frozen)
        self.sim.fail_freeze(frozen[index % len(frozen)])

    @rule()
    def quiesce(self) -> None:
        self.sim.settle()
        self.sim.check_quiet()

    # -- NVML samples (hosts with GPUs of known size) ----------------------------------------

    @precondition(lambda self: self.sim.devices[0].total is not None)
    @rule(samples=st.lists(SAMPLE, min_size=3, max_size=3))
    def nvml_samples(self, samples: list[tuple[int, int, bool, bool]]) -> None:
        """Reserve, foreign use and lost GPUs change, also while a start job of gpuslice's
        is on its way (its gate then queues if its GPUs no longer take it)."""
        self.sim.sample([_gpu(i, samples[i]) for i in sorted(self.sim.devices)])

    # -- daemon-reload ----------------------------------------------------------------------

    @rule(index=st.integers(0, 7), prio=PRIORITIES)
    def priority_changes(self, index: int, prio: int) -> None:
        index %= len(self.specs)
        self.specs[index] = replace(self.specs[index], priority=prio)
        self.sim.annotate(self._annotations())

    @rule(index=st.integers(0, 7), gpus=st.sampled_from([1, 2, 3]))
    def gpus_change(self, index: int, gpus: int) -> None:
        """GPUs= edited, also while the unit's place is kept for its gate (a refill, a
        requeue, a start job seen): its gate is granted as many GPUs as it asks for now."""
        index %= len(self.specs)
        self.specs[index] = replace(self.specs[index], gpus=gpus)
        self.sim.annotate(self._annotations())

    @rule(index=st.integers(0, 7))
    def annotation_toggles(self, index: int) -> None:
        """For units at rest, running ones, and starts not answered yet: a running unit
        whose annotation went keeps its GPUs on the terms it was granted them on until it
        ends (no second job on them meanwhile), also across controller restarts, is never
        brought back, and is forgotten when it ends; annotated again while it runs, it holds
        them on its annotation's terms again. A start on its way (gpuslice's, or one
        systemd announced) or waiting at its gate is forgotten: it runs ungated, on no GPUs
        of gpuslice's (`Sim.annotate`, `Sim.finish_start`); annotated again before its gate
        runs, it asks there. A unit down loses how it went down (preempted, held, finished,
        failed): a preempted one is not brought back, and the core says so (`Sim.annotate`).
        Elsewhere (its stop, suspend or resume on its way, suspended)
        the adapter's part decides, which the controller's tests cover."""
        index %= len(self.specs)
        name = self.specs[index].name
        sim = self.sim
        if name in sim.unmanaged or name in sim.suspended:
            return
        if name in sim.pending_stops or name in sim.pending_resumes:
            return
        if name in sim.pending_suspends:
            return
        self.annotated[index] = not self.annotated[index]
        self.sim.annotate(self._annotations())

    @rule()
    def controller_restarts(self) -> None:
        """A fresh Scheduler loads the saved state and rebuilds (`Sim.restart`): units are
        adopted, gates queue, units caught between suspend and resume are resumed."""
        self.sim.restart()

    @invariant()
    def books_balance(self) -> None:
        self.sim._check_books()

    @invariant()
    def no_record_without_an_annotation(self) -> None:
        """How a unit went down is kept only while it is annotated: one whose annotation
        went is neither shown preempted, held, finished or failed for ever, nor brought back
        by itself once annotated again."""
        sched = self.sim.sched
        kept = sorted(sched.recorded() - sched.specs.keys())
        assert not kept, f"records of units no longer annotated: {kept}"

    def teardown(self) -> None:
        if self.specs:
            self.sim.drain()


class CoreMachine(HostMachine):
    @initialize(
        whole=st.booleans(),
        gpus=st.integers(1, 4),
        units=st.lists(UNIT, min_size=2, max_size=8),
        yield_to_foreign=st.booleans(),
        requeue_at_gate=st.booleans(),
    )
    def boot(
        self,
        whole: bool,
        gpus: int,
        units: list[tuple[UnitSpec, bool]],
        yield_to_foreign: bool,
        requeue_at_gate: bool,
    ) -> None:
        self._boot(drawn_host(whole, gpus), units, yield_to_foreign, requeue_at_gate)


def machine_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        # under `make mutate` (mutmut names the mutant in MUTANT_UNDER_TEST) a failure is a
        # kill: shrinking it would only cost time
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
        + ([] if "MUTANT_UNDER_TEST" in os.environ else [Phase.shrink]),
    )


CoreMachine.TestCase.settings = machine_settings(EXAMPLES)
TestCore = CoreMachine.TestCase


def test_a_background_start_whose_kept_gpu_was_lost_at_a_restart_preempts_a_later_grant() -> None:
    """Found at 20,000 examples (`make fuzz`): a refill's start of a background unit, its
    place kept on GPU 0, the controller restarts, NVML then says GPUs 0 and 1 are lost, and a
    less urgent start is granted GPU 2. Once the background unit's gate asks, its place is
    gone: it waited behind the less urgent unit (the thrash rule counted it known since its
    first start), and is now new for that rule (`Scheduler._unkept`)."""
    state = CoreMachine()
    stop = (Rung.STOP,)
    units = [(UnitSpec("", 10, BG, 1, False, preempt=stop), True)]
    units += [(UnitSpec("", p, OD, 1, False, preempt=stop), True) for p in (20, 10, 10, 10)]
    state.boot(whole=False, gpus=3, units=units, yield_to_foreign=False, requeue_at_gate=False)
    state.controller_restarts()
    state.nvml_samples(samples=[(0, 0, False, True), (0, 0, False, True), (0, 0, False, False)])
    state.person_plans_then_starts(index=1)
    state.quiesce()
    state.teardown()


def test_a_resume_beside_a_start_withdrawn_at_its_gate_is_judged_without_it() -> None:
    """Found at 20,000 examples (`make fuzz`): a background unit's start waits at its gate
    for all three GPUs, a suspended unit waits to be resumed; the waiting unit's annotation
    goes, so the core stops its start (ours, withdrawn: Code.UNMANAGED) and, in the same
    batch, resumes the suspended one. The model took the withdrawn start, at its gate until
    its stop ends, for a more urgent waiter and looked up an annotation it no longer has."""
    state = CoreMachine()
    stop, suspend = (Rung.STOP,), (Rung.SUSPEND, Rung.STOP)
    units = [(UnitSpec("", 10, OD, 1, False, preempt=stop), True) for _ in range(5)]
    units += [
        (UnitSpec("", 50, BG, 1, False, preempt=suspend), True),
        (UnitSpec("", 20, BG, 3, True, preempt=stop), True),
        (UnitSpec("", 20, BG, 1, True, preempt=stop), True),
    ]
    state.boot(whole=False, gpus=3, units=units, yield_to_foreign=True, requeue_at_gate=True)
    state.annotation_toggles(index=0)
    state.quiesce()
    state.annotation_toggles(index=0)
    state.person_plans_then_starts(index=0)
    state.quiesce()
    free, foreign = (0, 0, False, False), (0, 2 * GIB, True, False)
    state.nvml_samples(samples=[free, foreign, free])
    state.nvml_samples(samples=[free, free, free])
    state.quiesce()
    state.annotation_toggles(index=6)
    state.books_balance()
    state.teardown()
