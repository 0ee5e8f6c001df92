"""A unit systemd stopped along with a victim of gpuslice's, in the core alone
(Scheduler.hold_in_doubt, hold_stands, stopped_with, and what they keep back in `_requeue`):
the cases tests/test_controller_stopped_with.py does not reach. README, "Dependencies between
GPU units"."""

from __future__ import annotations

from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Outcome, Scheduler
from tests.core_builders import BG, brief, spec, words

B, C, D, A = "b.service", "c.service", "d.service", "a.service"


def _held_in_doubt() -> tuple[Scheduler, list[str]]:
    """Three GPUs: B (50) on 0, C (40) on 1; D (60, pinned to 2) was preempted by E
    (20, on 2). A (10, pinned to GPU 0) preempts B, and someone's stop takes C down while
    B's stop runs: C is held, in doubt (systemd is asked whether it needs B)."""
    units = [
        spec("b", 50),
        spec("c", 40),
        spec("d", 60, devices=("2",)),
        spec("e", 20, devices=("2",)),
        spec("a", 10, devices=("0",)),
    ]
    s = Scheduler(range(3), {u.name: u for u in units})
    for unit in units[:3]:
        s.request(unit)
    assert brief(s.request(units[3])) == ["stop d.service"]
    s.inactive(D, Outcome.STOPPED)
    assert brief(s.request(units[4])) == ["stop b.service"]
    said = words(s.inactive(C, Outcome.STOPPED))
    s.hold_in_doubt(C, {v: w for v, w in s.stopping().items() if v != C})
    return s, said


def test_the_victims_of_a_hold_in_doubt_wait_for_the_answer_and_others_come_back() -> None:
    """B is down while systemd is asked about C: B is not brought back (C may need it), but
    D, less urgent, comes back on GPU 2 once E ends; the answer (C needed nothing) then
    brings B back, and asked again, the hold stands quietly."""
    s, said = _held_in_doubt()
    assert said == [f"{C} was stopped outside gpuslice: held until started again"]
    assert brief(s.inactive(B, Outcome.STOPPED)) == ["grant a.service 0"]
    assert B in s.preempted
    assert brief(s.inactive("e.service", Outcome.EXITED, by_itself=True)) == ["start d.service"]
    assert brief(s.hold_stands(C)) == ["start b.service"]
    assert s.snapshot().held == [C]
    assert s.hold_stands(C) == []  # no longer in doubt: nothing to decide


def test_a_unit_started_again_before_the_answer_is_not_preempted_and_its_victim_comes_back() -> (
    None
):
    """C is started again before systemd answers that it needs B, and B is down meanwhile:
    C runs, not preempted; the answer lets B come back (it waited for it), on GPU 1."""
    s, _ = _held_in_doubt()
    s.inactive(B, Outcome.STOPPED)
    assert brief(s.request(s.specs[C])) == ["grant c.service 1"]
    actions = s.stopped_with(C, B, "Requires=", A)
    assert C not in s.preempted
    assert brief(actions) == []  # no room for B yet: it is preempted, considered again
    assert s.snapshot().held == []
    assert brief(s.inactive("e.service", Outcome.EXITED, by_itself=True)) == ["start b.service"]


def test_a_late_answer_brings_back_the_victim_it_kept_back() -> None:
    """As above, with room for B: the answer, deciding nothing about C, brings B back."""
    s, _ = _held_in_doubt()
    s.inactive("e.service", Outcome.EXITED, by_itself=True)  # D back on GPU 2
    s.inactive(B, Outcome.STOPPED)
    s.request(s.specs[C])
    assert brief(s.stopped_with(C, B, "Requires=", A)) == ["start b.service"]
    assert C not in s.preempted


def test_a_unit_forgotten_in_doubt_keeps_nothing_back() -> None:
    """C's annotation goes while systemd is asked: B, down, comes back at once, and the late
    answer (either) decides nothing."""
    s, _ = _held_in_doubt()
    s.set_specs({n: u for n, u in s.specs.items() if n != C})
    s.inactive("e.service", Outcome.EXITED, by_itself=True)
    assert brief(s.inactive(B, Outcome.STOPPED)) == ["grant a.service 0", "start b.service"]
    assert s.hold_stands(C) == []
    assert s.stopped_with(C, B, "Requires=", A) == []


def test_a_comeback_kept_back_by_its_victims_stop_does_not_keep_back_the_next() -> None:
    """C, preempted with B, waits for B's stop; D, less urgent, comes back on GPU 2 when E
    ends meanwhile."""
    s, _ = _held_in_doubt()
    said = words(s.stopped_with(C, B, "Requires=", A))
    assert said == [
        f"{C} (priority 40) was stopped with {B} (its Requires=), which gpuslice preempted "
        f"for {A} (priority 10): preempted with it, not held"
    ]
    assert brief(s.inactive("e.service", Outcome.EXITED, by_itself=True)) == ["start d.service"]
    assert C in s.preempted


def test_a_unit_stopped_with_a_victim_someone_stopped_is_held_and_the_next_comes_back() -> None:
    """Two GPUs: B (50) preempted D (60) on GPU 0, both pinned there; C (40) runs on 1. A
    (10, pinned to 0) preempts B, and C, stopped with B, is preempted with it. A's start is
    cancelled, then B's stop is found someone's (not ours): C is held like B, and said so,
    and D comes back on GPU 0 in that pass."""
    units = {
        u.name: u
        for u in (
            spec("d", 60, devices=("0",)),
            spec("b", 50, devices=("0",)),
            spec("c", 40),
            spec("a", 10, devices=("0",)),
        )
    }
    s = Scheduler(range(2), units)
    s.request(units[D])
    assert brief(s.request(units[B])) == ["stop d.service"]
    s.inactive(D, Outcome.STOPPED)
    s.request(units[C])
    assert brief(s.request(units[A])) == ["stop b.service"]
    s.inactive(C, Outcome.STOPPED)
    s.hold_in_doubt(C, s.stopping())
    s.stopped_with(C, B, "Requires=", A)
    assert C in s.preempted
    s.inactive(A, Outcome.STOPPED)  # A's start was cancelled while B stops
    actions = s.inactive(B, Outcome.STOPPED, not_ours=True)
    assert f"{C} was stopped outside gpuslice: held until started again" in words(actions)
    assert "start d.service" in brief(actions)
    assert {B, C} <= s.held


def test_a_unit_forgotten_after_it_was_preempted_with_a_victim_is_not_held_for_it() -> None:
    """C, preempted with B, loses its annotation, and B's stop turns out someone's (B
    held). Someone starts C (no gate: unannotated), then annotates it again as it runs on
    GPU 1. Preempted for X, C comes back once X ends: what it was stopped with before was
    forgotten with it."""
    s, _ = _held_in_doubt()
    s.stopped_with(C, B, "Requires=", A)
    specs = dict(s.specs)
    s.set_specs({n: u for n, u in specs.items() if n != C})
    s.inactive(B, Outcome.STOPPED, not_ours=True)
    assert s.snapshot().held == [B]
    s.set_specs(specs)
    s.running(C, [1])
    assert s.grants()[C] == frozenset({1})
    x = spec("x", 5, devices=("1",))
    assert brief(s.request(x)) == ["stop c.service"]
    s.inactive(C, Outcome.STOPPED)
    assert brief(s.inactive(x.name, Outcome.EXITED, by_itself=True)) == ["start c.service"]
    assert s.snapshot().held == [B]


def test_a_unit_started_again_after_it_was_preempted_with_a_victim_comes_back_later() -> None:
    """C, preempted with B, is started again by someone, and B's stop turns out someone's
    (B held). Preempted later for X, C is owed its comeback like any preempted unit, and
    gets it once X ends: what it was stopped with before is over with its new start."""
    s, _ = _held_in_doubt()
    s.stopped_with(C, B, "Requires=", A)
    assert brief(s.request(s.specs[C])) == ["grant c.service 1"]
    s.inactive(B, Outcome.STOPPED, not_ours=True)
    x = spec("x", 5, devices=("1",))
    assert brief(s.request(x)) == ["stop c.service"]
    assert words(s.inactive(C, Outcome.STOPPED)) == ["starting x.service (priority 5) on GPU 1"]
    assert brief(s.inactive(x.name, Outcome.EXITED, by_itself=True)) == ["start c.service"]
    assert s.snapshot().held == [B]


def test_a_unit_stopped_with_a_withdrawn_start_says_gpuslice_stopped_it() -> None:
    """R's start, gpuslice's refill, is withdrawn (its annotation went): its stop is for no
    unit. C, stopped with it, was stopped by gpuslice, for no one."""
    r, c = spec("r", 90, BG), spec("c", 40)
    s = Scheduler(range(2), {r.name: r, c.name: c})
    assert "start r.service" in brief(s.request(c))
    assert brief(s.set_specs({c.name: c})) == ["stop r.service"]
    stopping = s.stopping()
    assert stopping == {r.name: ""}
    s.inactive(C, Outcome.STOPPED)
    s.hold_in_doubt(C, stopping)
    said = words(s.stopped_with(C, r.name, "BindsTo=", stopping[r.name]))
    assert said[0] == (
        f"{C} (priority 40) was stopped with {r.name} (its BindsTo=), which gpuslice "
        "stopped: preempted with it, not held"
    )
    assert C in s.preempted


def test_an_instance_preempted_with_its_victim_and_requeue_no_is_forgotten() -> None:
    """C@x (Requeue=no), being stopped by gpuslice itself, went down by someone's stop while
    B's ran, and needs B: preempted with Requeue=no, gpuslice owes it nothing, and it is
    forgotten (no hold left to confirm)."""
    b, c = spec("b", 50), spec("c@x", 60, requeue=False)
    a = spec("a", 10, gpus=2)
    s = Scheduler(range(2), {u.name: u for u in (b, c, a)})
    s.request(b)
    s.request(c)
    assert brief(s.request(a)) == ["stop b.service", "stop c@x.service"]
    s.inactive(c.name, Outcome.STOPPED, not_ours=True)
    s.hold_in_doubt(c.name, {v: w for v, w in s.stopping().items() if v != c.name})
    s.stopped_with(c.name, B, "Requires=", A)
    assert s.forget_instance(c.name)


def test_a_unit_that_ran_to_its_end_is_no_longer_refused_for_the_waiter_it_was_needed_by() -> None:
    """V's stop for W (2 GPUs) was refused (W's start needs V), then V ran to its end and
    stays active (RemainAfterExit=yes) while W still waits (a GPU lost meanwhile). Shown
    running again (a restart whose down went unheard), V is preempted for W once the GPU is
    back, and a stop of it that fails now is a plain failure, not a refusal for W."""
    v, w, u = spec("v", 50), spec("w", 10, gpus=2), spec("u", 60, requeue=False)
    s = Scheduler(range(2), {x.name: x for x in (v, w, u)})
    s.request(v)
    s.request(u)
    assert brief(s.request(w)) == ["stop v.service", "stop u.service"]
    s.stop_failed(v.name, "needed", refused=True, while_waits=True)
    s.inactive(u.name, Outcome.STOPPED)
    s.set_gpus([Gpu(0)])
    s.exited(v.name)
    s.running(v.name, [0])
    assert brief(s.set_gpus([Gpu(0), Gpu(1)])) == ["stop v.service"]
    said = words(s.stop_failed(v.name, "canceled", refused=False))
    assert said[0] == (
        "v.service (priority 50) did not stop for w.service (priority 10): canceled; it keeps GPU 0"
    )
