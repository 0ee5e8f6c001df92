"""The Preempt= ladder under random histories, and what those histories found in the core.

`LadderMachine` plays every rule of tests/test_core_properties.py on hosts where the ladder
matters: 1-2 GPUs of known size and 3-6 units that mostly declare `Memory=` (so that units
share GPUs: freeze) and mostly give way by suspend or freeze (so that suspends, resumes,
freezes and thaws happen in most histories, and fail: `suspend_completes`,
`resume_completes`, `freeze_fails`; a suspend whose undo loses a process of the unit, which
is then stopped, `undo_loses_a_process`; a stop that fails or is refused, `stop_fails`). The
oracle is `Sim` (tests/core_builders.py), as there.

`GPUSLICE_FUZZ_EXAMPLES` sets the number of histories here too (two thirds of it).

Below the machine: the core bugs the machine found (fixed since), each as the shortest
history that shows it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from gpuslice.core.model import UnitKind, UnitSpec
from gpuslice.core.scheduler import Outcome, Scheduler
from tests.core_builders import BG, GIB, brief, drawn, sized, spec
from tests.test_core_properties import EXAMPLES, EXITS, HostMachine, machine_settings

LADDER_UNIT = st.builds(
    lambda prio, kind, gpus, requeue, memory, ladder, devices: (
        drawn(prio, kind, gpus, requeue, memory, ladder, devices if gpus == 1 else ()),
        True,
    ),
    st.sampled_from([10, 20, 20, 50, 70, 90]),
    st.sampled_from(list(UnitKind)),
    st.sampled_from([1, 1, 1, 2]),
    st.booleans(),
    st.sampled_from([None, 4 * GIB, 4 * GIB, 8 * GIB, 8 * GIB, 12 * GIB, 20 * GIB]),
    st.sampled_from(
        [
            "suspend stop",
            "suspend stop",
            "freeze stop",
            "freeze suspend stop",
            "freeze suspend stop",
            "suspend",
            "freeze",
            "stop",
        ]
    ),
    st.sampled_from([(), (), (), ("0",), ("1",)]),  # pinned: it waits while others fit
)


class LadderMachine(HostMachine):
    @initialize(
        gpus=st.integers(1, 2),
        units=st.lists(LADDER_UNIT, min_size=3, max_size=6),
        yield_to_foreign=st.booleans(),
        requeue_at_gate=st.booleans(),
        started=st.lists(st.integers(0, 5), max_size=6),
        freeze_fails=st.sets(st.integers(0, 5), max_size=2),
    )
    def boot(
        self,
        gpus: int,
        units: list[tuple[UnitSpec, bool]],
        yield_to_foreign: bool,
        requeue_at_gate: bool,
        started: list[int],
        freeze_fails: set[int],
    ) -> None:
        """The host boots and people start a few units at once: the histories begin busy.
        FreezeUnit fails for some units (as soon as the core freezes them)."""
        self._boot([sized(i) for i in range(gpus)], units, yield_to_foreign, requeue_at_gate)
        self.sim.freeze_fails = {self._unit(i) for i in freeze_fails}
        for index in started:
            self.sim.start(self._unit(index))

    def annotation_toggles(self, index: int) -> None:
        """Not a rule here: every unit stays annotated (tests/test_core_properties.py)."""

    # Drawn as often as a start, these would keep the host nearly empty (a unit gives way only
    # to another while both want its GPUs): here they happen a third as often.

    def controller_restarts(self) -> None:
        """Not a rule here: `restarts_now_and_then`."""

    def unit_exits(self, index: int, outcome: Outcome) -> None:
        """Not a rule here: `exits_now_and_then`."""

    def person_stops(self, index: int) -> None:
        """Not a rule here: `stops_now_and_then`."""

    @rule(now=st.integers(0, 2))
    def restarts_now_and_then(self, now: int) -> None:
        if now == 0:
            HostMachine.controller_restarts(self)

    @rule(index=st.integers(0, 7), outcome=EXITS, now=st.integers(0, 2))
    def exits_now_and_then(self, index: int, outcome: Outcome, now: int) -> None:
        if now == 0:
            HostMachine.unit_exits(self, index, outcome)

    @rule(index=st.integers(0, 7), now=st.integers(0, 2))
    def stops_now_and_then(self, index: int, now: int) -> None:
        if now == 0:
            HostMachine.person_stops(self, index)

    @precondition(lambda self: bool(self.sim.pending_suspends))
    @rule(index=st.integers(0, 7), as_urgent=st.booleans())
    def undo_loses_a_process(self, index: int, as_urgent: bool) -> None:
        """The suspend failed, and undoing it (restore, unlock) failed for a process of the
        unit, which can never run again: the unit is stopped whatever its Preempt=. Half the
        time a reload made it as urgent as its waiter meanwhile (then the waiter plans anew,
        not behind its stop). Drawn only while a suspend is on its way, which is rare."""
        sim = self.sim
        name = sim.pending_suspends[index % len(sim.pending_suspends)]
        waiter = sim.annotations.get(sim.suspend_for[name])
        if as_urgent and waiter is not None:
            at = [s.name for s in self.specs].index(name)
            self.specs[at] = replace(self.specs[at], priority=waiter.priority)
            sim.annotate(self._annotations())
        if name in sim.pending_suspends:
            why = "FreezeUnit failed; and undoing the checkpoint failed: restore of PID 7 failed"
            sim.finish_suspend(name, False, why, lost=True)

    @precondition(lambda self: bool(self.sim.failing_stops()))
    @rule(index=st.integers(0, 7), refused=st.booleans(), now=st.integers(0, 2))
    def stop_fails(self, index: int, refused: bool, now: int) -> None:
        """A stop of gpuslice's fails or is refused: the unit runs on. Most often that of a
        unit whose suspend's undo lost a process (then it runs on broken), when one is being
        stopped; now and then any stop of a unit that runs on GPUs."""
        failing = self.sim.failing_stops()
        lost = [n for n in failing if n in self.sim.undo_lost]
        if now != 0 and not lost:
            return
        names = failing if now == 0 else lost
        self.sim.fail_stop(names[index % len(names)], refused=refused)


LadderMachine.TestCase.settings = machine_settings(EXAMPLES * 2 // 3)
TestLadder = LadderMachine.TestCase


# -- what the histories found -----------------------------------------------------------------


def _host(*units: UnitSpec, gpus: int = 1) -> Scheduler:
    return Scheduler([sized(i) for i in range(gpus)], {u.name: u for u in units})


def test_refill_never_starts_a_suspended_background_unit() -> None:
    b = spec("b", 20, BG, preempt="suspend stop")
    u1, u2 = spec("u1", 10), spec("u2", 10)
    s = _host(b, u1, u2, gpus=2)
    assert brief(s.schedule()) == ["start b.service"]
    assert brief(s.request(b)) == ["grant b.service 0"]
    assert brief(s.request(u1)) == ["grant u1.service 1"]
    assert brief(s.request(u2)) == ["suspend b.service 0"]
    assert brief(s.suspended_done(b.name, "")) == ["grant u2.service 0"]
    # GPU 1 is free, GPU 0 still u2's: b waits for GPU 0, suspended (a Start merges with
    # its running job: nothing would ask, and the core would count it on GPU 1 too)
    assert brief(s.inactive(u1.name, Outcome.EXITED)) == []


def test_a_less_urgent_waiter_does_not_take_the_room_of_a_suspended_unit() -> None:
    s50 = spec("s", 50, BG, mem_gib=10, preempt="suspend stop")
    v10, w90 = spec("v", 10, mem_gib=20), spec("w", 90, mem_gib=20)
    s = _host(s50, v10, w90)
    assert brief(s.request(s50)) == ["grant s.service 0"]
    assert brief(s.request(v10)) == ["suspend s.service 0"]
    assert brief(s.suspended_done(s50.name, "")) == ["grant v.service 0"]
    assert brief(s.request(w90)) == []  # waits: 20 + 20 GiB do not fit in 24
    # v leaves: s (priority 50) comes back before w (priority 90) is granted its room
    assert brief(s.inactive(v10.name, Outcome.EXITED)) == ["resume s.service 0"]


def test_a_failed_suspend_is_not_tried_again_while_the_unit_runs() -> None:
    v = spec("v", 90, BG, mem_gib=20, preempt="suspend stop")
    w = spec("w", 10, mem_gib=20)
    s = _host(v, w)
    assert brief(s.request(v)) == ["grant v.service 0"]
    assert brief(s.request(w)) == ["suspend v.service 0"]
    s.inactive(w.name, Outcome.STOPPED)  # its start is cancelled while v is being suspended
    assert brief(s.suspend_failed(v.name, "the lock timed out")) == []
    assert brief(s.request(w)) == ["stop v.service"]  # the next rung, as with its waiter there


def test_a_reload_that_ends_the_reason_to_freeze_thaws() -> None:
    emb = spec("emb", 90, BG, mem_gib=8, preempt="freeze stop")
    voice = spec("voice", 10, mem_gib=8)
    s = _host(emb, voice)
    assert brief(s.request(emb)) == ["grant emb.service 0"]
    assert brief(s.request(voice)) == ["grant voice.service 0", "freeze emb.service"]
    assert brief(s.set_specs({emb.name: emb, voice.name: replace(voice, priority=95)})) == [
        "thaw emb.service"
    ]


def test_a_failed_suspend_does_not_stop_a_unit_for_a_waiter_no_longer_more_urgent() -> None:
    v = spec("v", 20, BG, mem_gib=20, preempt="suspend stop")
    w = spec("w", 10, mem_gib=20)
    s = _host(v, w)
    assert brief(s.request(v)) == ["grant v.service 0"]
    assert brief(s.request(w)) == ["suspend v.service 0"]
    assert brief(s.set_specs({v.name: v, w.name: replace(w, priority=50)})) == []
    # equal or lower priority never preempts: v keeps its GPU, w waits
    assert brief(s.suspend_failed(v.name, "the lock timed out")) == []


def test_a_failed_freeze_is_followed_by_what_it_allows() -> None:
    emb = spec("emb", 90, BG, mem_gib=4, preempt="freeze")
    voice = spec("voice", 10, mem_gib=4)
    s = _host(emb, voice)
    assert brief(s.request(emb)) == ["grant emb.service 0"]
    assert brief(s.request(voice)) == ["grant voice.service 0", "freeze emb.service"]
    assert brief(s.set_gpus([sized(0, foreign=2 * GIB, foreign_pids=(7,))])) == []  # frozen
    assert brief(s.freeze_failed(emb.name, "the unit is not active")) == ["stop emb.service"]


def test_a_thaw_that_a_freeze_allows_is_not_left_for_the_next_event() -> None:
    mid = spec("mid", 50, mem_gib=12, preempt="freeze stop")
    wide = spec("wide", 20, gpus=2, mem_gib=12, preempt="freeze stop")
    top = spec("top", 10, mem_gib=4)
    s = _host(mid, wide, top, gpus=2)
    assert brief(s.request(mid)) == ["grant mid.service 0"]
    assert brief(s.request(wide)) == ["grant wide.service 0,1", "freeze mid.service"]
    # top fits beside wide on GPU 1: wide is frozen, so mid (frozen for wide) may run again
    assert brief(s.request(top)) == [
        "grant top.service 1",
        "freeze wide.service",
        "thaw mid.service",
    ]
    assert brief(s.schedule()) == []  # nothing left undone at rest


@pytest.mark.parametrize("as_urgent", [False, True])
@pytest.mark.parametrize("then", ["stopped", "exits", "stop fails", "stop refused"])
def test_the_model_follows_a_unit_whose_suspend_undo_lost_a_process(
    as_urgent: bool, then: str
) -> None:
    """`undo_loses_a_process` needs a suspend on its way, which few histories at the default
    count have: each way it goes, played once. u0 (`Preempt=suspend` alone) is suspended for
    u1; undoing its failed suspend loses a process: it is stopped, u1 waiting for that stop
    unless a reload made u0 as urgent (then u1 plans anew: u2's GPU is free, it is granted
    there). The stop completes, u0 ends by itself first, or the stop fails or is refused (u0
    runs on; refused, it is never a victim again while it runs)."""
    state = LadderMachine()
    units = [
        (spec("", 90, preempt="suspend", requeue=False), True),
        (spec("", 10, preempt="stop"), True),
        (spec("", 50, preempt="stop"), True),
    ]
    state.boot(
        gpus=2,
        units=units,
        yield_to_foreign=False,
        requeue_at_gate=False,
        started=[0, 2],
        freeze_fails=set(),
    )
    sim = state.sim
    assert sim.running == {"u0.service": (0,), "u2.service": (1,)}
    state.person_starts(index=1)
    assert sim.pending_suspends == ["u0.service"]
    if as_urgent:
        sim.exit("u2.service")  # GPU 1 free: u1 waits for u0 all the same, as for its suspend
    state.undo_loses_a_process(index=0, as_urgent=as_urgent)
    assert sim.pending_stops == ["u0.service"]
    if as_urgent:
        assert sim.running["u1.service"] == (1,)  # planned anew: granted the free GPU
    else:
        assert sim.victims_of["u1.service"] == {"u0.service"}
    if then == "stopped":
        state.stop_completes(index=0)
    elif then == "exits":
        state.unit_exits_before_its_stop(index=0, outcome=Outcome.FAILED)
    else:
        state.stop_fails(index=0, refused=then == "stop refused", now=1)
        assert sim.runs("u0.service")
    state.quiesce()
    state.teardown()
