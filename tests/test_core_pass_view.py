"""The scheduling pass's shortcuts for blocked waiters (Scheduler._blocked_too), idle
background units (_refill_blocked_too) and preempted units (_requeue_blocked_too): each
saves work and never changes a decision.

A waiter found blocked (no placement, even preempting) changes nothing, so a later waiter in
the same pass that asks no less and may preempt no more is blocked too without being placed
again. The histories of tests/test_core_properties.py run on a scheduler that checks every
answer against a twin that places every waiter; the examples below pin each condition of the
dominance rule with a case where dropping it would block a waiter that can run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

import gpuslice.core.scheduler as scheduler_module
from gpuslice.core.model import Gpu, UnitKind, UnitSpec
from gpuslice.core.scheduler import Grant, Outcome, Scheduler, Waiter, _PassView
from tests import core_builders
from tests.core_builders import brief, drawn_host, sized, spec
from tests.test_core_ladder_properties import LadderMachine
from tests.test_core_properties import (
    UNIT,
    CoreMachine,
    HostMachine,
    machine_settings,
)

# under `make mutate` a few histories each: the cases below pin every condition
EXAMPLES = (
    20
    if "MUTANT_UNDER_TEST" in os.environ
    else int(os.environ.get("GPUSLICE_FUZZ_EXAMPLES", "300")) // 2
)


class FullPass(Scheduler):
    """The rules without the shortcuts: every waiter, every idle background unit is placed."""

    def _blocked_too(self, waiter: Waiter, view: _PassView) -> bool:
        return False

    def _refill_blocked_too(self, spec: UnitSpec, unplaced: list[UnitSpec]) -> bool:
        return False

    def _requeue_blocked_too(self, spec: UnitSpec, unplaced: list[UnitSpec]) -> bool:
        return False


# every event and question the Sim asks: answered alike by both, or the test fails
_TWINNED = [
    "set_gpus",
    "announce",
    "request",
    "inactive",
    "running",
    "exited",
    "stop_failed",
    "start_failed",
    "retry_start",
    "stop_overdue",
    "restart_overdue",
    "suspended_done",
    "suspend_failed",
    "resumed",
    "resume_failed",
    "freeze_failed",
    "thawed_outside",
    "frozen_units",
    "recover",
    "pause_refill",
    "set_specs",
    "schedule",
    "phase",
    "suspended_units",
    "waiting_units",
    "grants",
    "snapshot",
    "save",
    "load",
    "forget_boot",
    "forget_instance",
    "thaw_done",
    "thaws_owed",
]


class Twinned(Scheduler):
    """A scheduler with the shortcut whose every answer must equal its twin's."""

    def __init__(self, gpus: Iterable[int | Gpu], specs: Mapping[str, UnitSpec], **kw: Any) -> None:
        listed = list(gpus)
        super().__init__(listed, specs, **kw)
        self.full = FullPass(listed, specs, **kw)
        self.inside = False  # an event's own calls (its `schedule`) are not twinned again

    @contextmanager
    def deferred(self) -> Iterator[None]:
        with super().deferred(), self.full.deferred():
            yield


def _twin(name: str) -> Callable[..., Any]:
    mine = getattr(Scheduler, name)

    def call(self: Twinned, *args: Any, **kw: Any) -> Any:
        if self.inside:
            return mine(self, *args, **kw)
        self.inside = True
        try:
            ours = mine(self, *args, **kw)
        finally:
            self.inside = False
        theirs = getattr(self.full, name)(*args, **kw)
        assert ours == theirs, f"{name}{args}: shortcut {ours!r} != full pass {theirs!r}"
        if isinstance(ours, list):  # the words too (an action's decision is not compared)
            assert [getattr(a, "decision", None) for a in ours] == [
                getattr(a, "decision", None) for a in theirs
            ], name
        return ours

    return call


for _name in _TWINNED:
    setattr(Twinned, _name, _twin(_name))


class TwinnedMachine(CoreMachine):
    """The core's random histories, each answer checked against the full pass."""


class TwinnedLadder(LadderMachine):
    """The same on the hosts where the Preempt= ladder matters most."""


# Devices=: the shortcuts compare pins (and key the usable GPUs by them), which the core's
# histories never draw: some units pinned, alike or apart, on GPUs that may be lost
PINS = st.sampled_from([(), (), ("0",), ("0",), ("1",), ("0", "1"), ("1", "2")])


class TwinnedPins(HostMachine):
    """The core's random histories with pinned units, checked against the full pass."""

    @initialize(
        whole=st.booleans(),
        gpus=st.integers(2, 3),
        units=st.lists(st.tuples(UNIT, PINS), min_size=2, max_size=8),
        yield_to_foreign=st.booleans(),
        requeue_at_gate=st.booleans(),
    )
    def boot(
        self,
        whole: bool,
        gpus: int,
        units: list[tuple[tuple[UnitSpec, bool], tuple[str, ...]]],
        yield_to_foreign: bool,
        requeue_at_gate: bool,
    ) -> None:
        pinned = [(replace(u, devices=pins), on) for (u, on), pins in units]
        self._boot(drawn_host(whole, gpus), pinned, yield_to_foreign, requeue_at_gate)


TwinnedMachine.TestCase.settings = machine_settings(EXAMPLES)
TwinnedLadder.TestCase.settings = machine_settings(EXAMPLES // 2)
TwinnedPins.TestCase.settings = machine_settings(EXAMPLES // 2)


@pytest.mark.parametrize(
    "machine", [TwinnedMachine, TwinnedLadder, TwinnedPins], ids=["core", "ladder", "pins"]
)
def test_random_histories_decide_as_the_full_pass(
    monkeypatch: pytest.MonkeyPatch, machine: type[HostMachine]
) -> None:
    monkeypatch.setattr(core_builders, "Scheduler", Twinned)
    machine.TestCase("runTest").runTest()


# -- each condition of the dominance rule -----------------------------------------------------


def _placements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = scheduler_module.place  # type: ignore[attr-defined]

    def counted(spec: UnitSpec, *args: Any, **kw: Any) -> Any:
        calls.append(spec.name)
        return real(spec, *args, **kw)

    monkeypatch.setattr(scheduler_module, "place", counted)
    return calls


def _busy(sched: Scheduler, holders: Iterable[UnitSpec]) -> None:
    for holder in holders:
        assert any(isinstance(a, Grant) for a in sched.request(holder)), holder.name


def test_a_burst_of_blocked_waiters_is_placed_once_per_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the shortcut is for: 40 waiters behind two more urgent holders cost one
    placement per pass, the first waiter's; each is still told why it waits."""
    holders = [spec(f"h{i}", 10) for i in range(2)]
    waiters = [spec(f"w{i:02d}", 20 + i % 3) for i in range(40)]
    sched = Scheduler([0, 1], {s.name: s for s in holders + waiters})
    _busy(sched, holders)
    for waiter in waiters:
        sched.request(waiter)
    calls = _placements(monkeypatch)
    assert sched.schedule() == []
    assert calls == ["w00.service"]
    assert sorted(sched.waiting_units()) == [w.name for w in waiters]
    assert all(sched.waiters[w.name].reason for w in waiters)


def test_a_burst_of_blocked_waiters_is_judged_once_each_per_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rest of a blocked waiter's cost, paid once per pass rather than per waiter
    (issue 10): the GPUs it may ever run on are listed once for its pins, and one found
    blocked too is not compared with the blocked waiters again to be kept among them."""
    holders = [spec(f"h{i}", 10) for i in range(2)]
    waiters = [spec(f"w{i:02d}", 20 + i % 3) for i in range(40)]
    sched = Scheduler([0, 1], {s.name: s for s in holders + waiters})
    _busy(sched, holders)
    for waiter in waiters:
        sched.request(waiter)
    asked: list[str] = []
    real_allowed = scheduler_module.allowed  # type: ignore[attr-defined]

    def allowed(unit: UnitSpec, *args: Any) -> bool:
        asked.append(unit.name)
        return real_allowed(unit, *args)

    judged: list[str] = []
    real_blocked_too = sched._blocked_too

    def blocked_too(waiter: Waiter, view: _PassView) -> bool:
        judged.append(waiter.spec.name)
        return real_blocked_too(waiter, view)

    monkeypatch.setattr(scheduler_module, "allowed", allowed)
    sched._blocked_too = blocked_too  # type: ignore[method-assign]
    assert sched.schedule() == []
    assert asked == ["w00.service"] * 4  # 2 GPUs: placing it, then its reason
    assert sorted(judged) == [w.name for w in waiters]  # once each, in priority order
    assert all(sched.waiters[w.name].reason for w in waiters)


def test_waiters_asking_the_same_memory_are_placed_once_per_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No less memory includes as much: 20 waiters of 20 GiB behind a 16 GiB holder."""
    holder = spec("holder", 10, mem_gib=16)
    waiters = [spec(f"w{i:02d}", 20, mem_gib=20) for i in range(20)]
    sched = Scheduler([sized(0, 24)], {s.name: s for s in [holder, *waiters]})
    _busy(sched, [holder])
    for waiter in waiters:
        sched.request(waiter)
    calls = _placements(monkeypatch)
    assert sched.schedule() == []
    assert calls == ["w00.service"]


def test_a_waiter_known_after_a_grant_may_preempt_what_an_earlier_one_may_not() -> None:
    """Known later is a condition unless nothing was granted since (the thrash rule): `small`
    was granted beside `top` while `first` waited, so it is not stopped for `first`; `later`,
    known after that grant, asks as much as `first`, is less urgent, and may stop it."""
    top, small = spec("top", 5, mem_gib=16), spec("small", 50, mem_gib=8)
    first, later = spec("first", 20, mem_gib=20), spec("later", 30, mem_gib=20)
    sched = Scheduler([sized(0, 24)], {s.name: s for s in (top, small, first, later)})
    _busy(sched, [top])
    assert brief(sched.request(first)) == []
    _busy(sched, [small])
    assert brief(sched.request(later)) == []
    assert brief(sched.inactive("top.service", Outcome.EXITED)) == ["stop small.service"]
    assert "first.service" in sched.waiting_units()


def test_a_smaller_waiter_after_a_blocked_one_is_still_placed() -> None:
    """No less memory asked is a condition: a 4 GiB unit fits beside the holder where a
    blocked 20 GiB one does not."""
    holder = spec("holder", 10, mem_gib=12)
    big, small = spec("big", 20, mem_gib=20), spec("small", 30, mem_gib=4)
    sched = Scheduler([sized(0, 24)], {s.name: s for s in (holder, big, small)})
    _busy(sched, [holder])
    with sched.deferred():
        sched.request(big)
        sched.request(small)
    assert brief(sched.schedule()) == ["grant small.service 0"]


def test_a_whole_gpu_and_a_size_are_judged_apart() -> None:
    """A unit without Memory= fits an empty GPU too small for a blocked 30 GiB one; a 4 GiB
    one fits beside a holder where a blocked whole-GPU one does not."""
    big, whole = spec("big", 10, mem_gib=30), spec("whole", 20)
    sched = Scheduler([sized(0, 24)], {s.name: s for s in (big, whole)})
    with sched.deferred():
        sched.request(big)
        sched.request(whole)
    assert brief(sched.schedule()) == ["grant whole.service 0"]

    holder = spec("holder", 10, mem_gib=12)
    whole, small = spec("whole", 20), spec("small", 30, mem_gib=4)
    sched = Scheduler([sized(0, 24)], {s.name: s for s in (holder, whole, small)})
    _busy(sched, [holder])
    with sched.deferred():
        sched.request(whole)
        sched.request(small)
    assert brief(sched.schedule()) == ["grant small.service 0"]


def test_pinned_waiters_are_judged_on_their_own_gpus() -> None:
    """The same GPUs allowed is a condition: a waiter pinned to a free GPU after one pinned
    to a busy GPU is placed."""
    holder = spec("holder", 10, devices=("0",))
    busy, free = spec("busy", 20, devices=("0",)), spec("free", 30, devices=("1",))
    sched = Scheduler([0, 1], {s.name: s for s in (holder, busy, free)})
    _busy(sched, [holder])
    with sched.deferred():
        sched.request(busy)
        sched.request(free)
    assert brief(sched.schedule()) == ["grant free.service 1"]


def test_more_urgent_waiters_are_never_judged_by_a_less_urgent_one() -> None:
    """No more urgent is a condition: a displaced waiter served again in the same pass
    comes after the blocked ones, in priority order, and may preempt what they may not."""
    low, mid = spec("low", 50), spec("mid", 10)
    waiter, urgent = spec("waiter", 60), spec("urgent", 20)
    sched = Scheduler([0], {s.name: s for s in (low, mid, waiter, urgent)})
    _busy(sched, [mid])
    sched.request(waiter)
    view = _PassView({0: []})
    first = sched.waiters["waiter.service"]
    view.blocked.append(first)
    assert sched._blocked_too(first, view)
    sched.request(urgent)
    assert not sched._blocked_too(sched.waiters["urgent.service"], view)


def test_a_waiter_of_fewer_gpus_after_a_blocked_one_is_still_placed() -> None:
    """No fewer GPUs asked is a condition: a pair cannot take GPU 1 alone, a single may."""
    top, low = spec("top", 5), spec("low", 50)
    pair, single = spec("pair", 20, gpus=2), spec("single", 30)
    sched = Scheduler([0, 1], {s.name: s for s in (top, low, pair, single)})
    _busy(sched, [top, low])
    with sched.deferred():
        sched.request(pair)
        sched.request(single)
    assert brief(sched.schedule()) == ["stop low.service"]


def test_background_and_on_demand_waiters_are_judged_apart() -> None:
    """The same GPUs allowed is a condition: a background unit avoids a GPU with a foreign
    process, an on-demand unit does not."""
    holder = spec("holder", 10, devices=("1",))
    background, on_demand = spec("bg", 20, UnitKind.BACKGROUND), spec("od", 30)
    gpus = [Gpu(0, foreign_pids=(4000,)), Gpu(1)]
    sched = Scheduler(gpus, {s.name: s for s in (holder, background, on_demand)})
    with sched.deferred():
        sched.request(holder)
    assert brief(sched.schedule()) == ["grant holder.service 1"]
    with sched.deferred():
        sched.request(background)
        sched.request(on_demand)
    assert brief(sched.schedule()) == ["grant od.service 0"]


# -- refill's shortcut (Scheduler._refill_blocked_too): each condition pinned ---------------


def _refilled(gpus: list[Gpu], busy: UnitSpec, *idle: UnitSpec) -> list[str]:
    """`busy` runs; then a pass over the idle background units: what it starts."""
    s = Scheduler(gpus, {u.name: u for u in (busy, *idle)})
    s.pause_refill("not yet")
    s.request(busy)
    s.pause_refill("")
    return brief(s.schedule())


def test_refill_tries_a_unit_pinned_elsewhere_after_one_that_did_not_fit() -> None:
    pinned = spec("a", 50, UnitKind.BACKGROUND, devices=("0",))
    other = spec("b", 60, UnitKind.BACKGROUND, devices=("1",))
    busy = spec("busy", 10, devices=("0",))
    assert _refilled([Gpu(0), Gpu(1)], busy, pinned, other) == ["start b.service"]


def test_refill_tries_a_unit_asking_fewer_gpus_after_one_that_did_not_fit() -> None:
    wide = spec("a", 50, UnitKind.BACKGROUND, gpus=2)
    narrow = spec("b", 60, UnitKind.BACKGROUND)
    assert _refilled([Gpu(0), Gpu(1)], spec("busy", 10), wide, narrow) == ["start b.service"]


def test_refill_tries_a_unit_asking_less_memory_after_one_that_did_not_fit() -> None:
    big = spec("a", 50, UnitKind.BACKGROUND, mem_gib=20)
    small = spec("b", 60, UnitKind.BACKGROUND, mem_gib=4)
    busy = spec("busy", 10, mem_gib=10)
    assert _refilled([sized(0)], busy, big, small) == ["start b.service"]


def test_refill_skips_units_that_ask_no_less_than_one_that_did_not_fit() -> None:
    """At 2,000 idle background units and no free GPU, one placement, not 2,000."""
    idle = [spec(f"bg{i}", 50 + i % 7, UnitKind.BACKGROUND) for i in range(2000)]
    s = Scheduler([Gpu(0)], {u.name: u for u in [spec("busy", 10), *idle]})
    s.pause_refill("not yet")
    s.request(spec("busy", 10))
    placed: list[str] = []
    place = s._place

    def counted(unit: UnitSpec, *args: Any, **kw: Any) -> Any:
        placed.append(unit.name)
        return place(unit, *args, **kw)

    s._place = counted  # type: ignore[method-assign, assignment]
    s.pause_refill("")
    assert brief(s.schedule()) == []
    assert placed == ["bg0.service"]


def test_refill_goes_on_past_a_unit_it_skipped_to_a_smaller_one() -> None:
    """A unit skipped as blocked too (b asks as much as a, which did not fit) does not end
    the refill: c, later and smaller, fits beside the holder and is started."""
    a = spec("a", 50, UnitKind.BACKGROUND, mem_gib=20)
    b = spec("b", 55, UnitKind.BACKGROUND, mem_gib=20)
    c = spec("c", 60, UnitKind.BACKGROUND, mem_gib=4)
    busy = spec("busy", 10, mem_gib=10)
    assert _refilled([sized(0)], busy, a, b, c) == ["start c.service"]


# -- requeue's shortcut (Scheduler._requeue_blocked_too): each condition pinned -------------


def _requeued(gpus: list[Gpu], busy: list[UnitSpec], *preempted: UnitSpec) -> list[str]:
    """`busy` run; `preempted` were preempted (in this order); then a pass: what it starts."""
    s = Scheduler(gpus, {u.name: u for u in (*busy, *preempted)})
    with s.deferred():
        for unit in busy:
            s.request(unit)
    s.schedule()
    for n, unit in enumerate(preempted):
        s.preempted[unit.name] = n
    return brief(s.schedule())


def test_requeue_skips_units_that_ask_no_less_than_one_that_did_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst's 8 preempted background units behind more urgent holders of every GPU: one
    placement per pass, not 8 (issue 10: a fifth of the controller's CPU in a burst)."""
    busy = [spec(f"od{i}", 10) for i in range(8)]
    preempted = [spec(f"bg{i}", 90, UnitKind.BACKGROUND) for i in range(8)]
    s = Scheduler([Gpu(i) for i in range(8)], {u.name: u for u in busy + preempted})
    with s.deferred():
        for unit in busy:
            s.request(unit)
    s.schedule()
    for n, unit in enumerate(preempted):
        s.preempted[unit.name] = n
    calls = _placements(monkeypatch)
    assert brief(s.schedule()) == []
    assert calls == ["bg0.service"]
    assert sorted(s.preempted) == [u.name for u in preempted]


def test_requeue_tries_a_unit_pinned_elsewhere_after_one_that_did_not_fit() -> None:
    pinned = spec("a", 50, devices=("0",))
    other = spec("b", 60, devices=("1",))
    busy = spec("busy", 10, devices=("0",))
    assert _requeued([Gpu(0), Gpu(1)], [busy], pinned, other) == ["start b.service"]


def test_requeue_tries_a_unit_asking_fewer_gpus_after_one_that_did_not_fit() -> None:
    wide = spec("a", 50, gpus=2)
    narrow = spec("b", 60)
    assert _requeued([Gpu(0), Gpu(1)], [spec("busy", 10)], wide, narrow) == ["start b.service"]


def test_requeue_tries_a_unit_asking_less_memory_after_one_that_did_not_fit() -> None:
    big = spec("a", 50, mem_gib=20)
    small = spec("b", 60, mem_gib=4)
    busy = spec("busy", 10, mem_gib=10)
    assert _requeued([sized(0)], [busy], big, small) == ["start b.service"]


def test_requeue_judges_a_unit_that_avoids_foreign_processes_apart() -> None:
    """A background unit avoids a GPU with a foreign process, an on-demand unit does not:
    the background one not fitting says nothing of the on-demand one after it."""
    background, on_demand = spec("a", 50, UnitKind.BACKGROUND), spec("b", 60)
    gpus = [Gpu(0, foreign_pids=(4000,)), Gpu(1)]
    busy = spec("busy", 10, devices=("1",))
    assert _requeued(gpus, [busy], background, on_demand) == ["start b.service"]


def test_requeue_goes_on_past_a_unit_it_skipped_to_a_smaller_one() -> None:
    """A unit skipped as blocked too does not end the requeue: c, later and smaller, fits
    beside the holder and is started."""
    a = spec("a", 50, mem_gib=20)
    b = spec("b", 55, mem_gib=20)
    c = spec("c", 60, mem_gib=4)
    busy = spec("busy", 10, mem_gib=10)
    assert _requeued([sized(0)], [busy], a, b, c) == ["start c.service"]


# -- requeue's shortcut against the full pass: the histories above seldom hold two preempted
# units in one pass, so a pass with many is drawn here: pins, sizes, kinds, lost GPUs and
# foreign processes, the places blocked waiters keep

_GIB = 1 << 30
_REQUEUED_UNIT = st.tuples(
    st.sampled_from([10, 20, 50, 50, 90]),
    st.sampled_from(list(UnitKind)),
    st.sampled_from([1, 1, 2, 3]),
    st.sampled_from([None, None, 4, 8, 12, 20]),
    PINS,
)
_GPU = st.tuples(
    st.sampled_from([0, 0, 2 * _GIB, 10 * _GIB]),
    st.booleans(),
    st.sampled_from([False, False, False, True]),
)


def _unit(name: str, drawn: tuple[int, UnitKind, int, int | None, tuple[str, ...]]) -> UnitSpec:
    prio, kind, gpus, mem, pins = drawn
    return spec(name, prio, kind, gpus, mem_gib=mem, devices=pins)


@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(
    host=st.lists(_GPU, min_size=1, max_size=3),
    whole=st.booleans(),
    running=st.lists(_REQUEUED_UNIT, max_size=4),
    waiting=st.lists(_REQUEUED_UNIT, max_size=3),
    preempted=st.lists(_REQUEUED_UNIT, min_size=2, max_size=6),
    yield_to_foreign=st.booleans(),
    requeue_at_gate=st.booleans(),
)
def test_a_pass_with_many_preempted_units_requeues_as_the_full_pass(
    host: list[tuple[int, bool, bool]],
    whole: bool,
    running: list[tuple[int, UnitKind, int, int | None, tuple[str, ...]]],
    waiting: list[tuple[int, UnitKind, int, int | None, tuple[str, ...]]],
    preempted: list[tuple[int, UnitKind, int, int | None, tuple[str, ...]]],
    yield_to_foreign: bool,
    requeue_at_gate: bool,
) -> None:
    gpus = [
        Gpu(i, lost=lost)
        if whole
        else sized(i, foreign=foreign, foreign_pids=(4000 + i,) if pid else (), lost=lost)
        for i, (foreign, pid, lost) in enumerate(host)
    ]
    run = [_unit(f"r{i}", u) for i, u in enumerate(running)]
    wait = [_unit(f"w{i}", u) for i, u in enumerate(waiting)]
    back = [_unit(f"p{i}", u) for i, u in enumerate(preempted)]
    specs = {u.name: u for u in run + wait + back}
    passes: list[object] = []
    for kind in (Scheduler, FullPass):
        s = kind(gpus, specs, yield_to_foreign=yield_to_foreign, requeue_at_gate=requeue_at_gate)
        for unit in run:
            s.request(unit)
        with s.deferred():
            for unit in wait:
                s.request(unit)
        for n, unit in enumerate(back):
            s.preempted[unit.name] = n
        actions = s.schedule()
        passes.append((brief(actions), [getattr(a, "decision", None) for a in actions]))
        passes.append(sorted(s.preempted))
    assert passes[:2] == passes[2:]


def test_each_pins_have_their_own_usable_gpus_in_one_pass() -> None:
    """The GPUs a blocked waiter may run on are listed once per pass for each pins: one
    pinned to GPU 0 and one pinned to GPU 1, both behind more urgent holders, are each told
    of their own GPU's holder (the second was told of GPU 0's, the first one's list)."""
    holders = [spec(f"h{i}", 10) for i in range(2)]
    on0 = spec("on0", 20, devices=("0",))
    on1 = spec("on1", 30, devices=("1",))
    sched = Scheduler([0, 1], {s.name: s for s in [*holders, on0, on1]})
    _busy(sched, holders)
    sched.request(on0)
    sched.request(on1)
    sched.schedule()
    assert sched.waiters["on0.service"].reason == "waiting: GPU 0 held by h0.service, priority 10"
    assert sched.waiters["on1.service"].reason == "waiting: GPU 1 held by h1.service, priority 10"
