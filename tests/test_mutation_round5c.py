"""Mutation round 5c: the core's bookkeeping of holds the shutdown may have made (booked,
then confirmed or undone by SystemState), of instances dropped past the bound of preempted
ones, and of a saved state's instances kept for a cancelled shutdown's refill."""

from __future__ import annotations

from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Log, Outcome, SavedState, Scheduler
from tests.core_builders import BG, brief, spec

TX = spec("tx@a", 50)  # an on-demand instance: a name per job


def _comeback_stopped_by_hand(s: Scheduler) -> None:
    """tx@a is preempted, its comeback started, and a person stops that start before its
    gate asks: held, its hold booked as owing the comeback should the stop be the
    shutdown's (SystemState not read yet)."""
    s.request(TX)
    assert brief(s.request(spec("u", 10))) == ["stop tx@a.service"]
    s.inactive(TX.name, Outcome.STOPPED)
    assert brief(s.inactive("u.service", Outcome.EXITED)) == ["start tx@a.service"]
    s.inactive(TX.name, Outcome.STOPPED)
    assert s.save().held == [TX.name]


def test_an_instance_started_again_before_its_hold_is_read_is_forgotten_once_done() -> None:
    """Someone started it again: how it last went down (its booked hold with it) no longer
    matters. Kept, the hold's comeback still counted as owed, and the instance, finished,
    was never forgotten."""
    s = Scheduler([Gpu(0)], {})
    s.learn(TX)
    _comeback_stopped_by_hand(s)
    assert brief(s.request(TX)) == ["grant tx@a.service 0"]
    s.inactive(TX.name, Outcome.EXITED, by_itself=True)
    assert s.forget_instance(TX.name)


def test_a_hold_whose_unit_was_started_again_is_confirmed_without_a_crash() -> None:
    """SystemState's answer comes after someone started the unit again (its booked hold
    gone with its new start): nothing to confirm, and no KeyError in the controller."""
    s = Scheduler([Gpu(0)], {})
    s.learn(TX)
    _comeback_stopped_by_hand(s)
    s.request(TX)
    s.holds_confirmed([TX.name])
    assert s.holds_of_shutdown([TX.name]) == []


def test_a_suspended_unit_no_longer_annotated_stopped_by_hand_leaves_no_booked_hold() -> None:
    """Its annotation went while it was suspended (kept: nobody else would resume it); a
    person stops it: forgotten as any unannotated unit's end, its booked hold too. Kept,
    once annotated again and down, it was taken for owed a comeback and never forgotten."""
    s = Scheduler([Gpu(0)], {})
    s.load(SavedState(suspended={TX.name: ((0,), 1)}, seq=1))
    s.inactive(TX.name, Outcome.STOPPED)
    assert s.save().held == []
    s.set_specs({TX.name: TX})
    assert s.forget_instance(TX.name)


def test_holds_of_the_shutdown_past_a_name_not_held_are_taken_in() -> None:
    """SystemState says the host is going down: every unit named whose hold was booked is
    freed, whatever other names come before it."""
    s = Scheduler([Gpu(0)], {})
    b = spec("b", 80)
    s.request(b)
    s.inactive(b.name, Outcome.STOPPED)
    assert s.holds_of_shutdown(["a.service", b.name]) == [b.name]


def test_a_hold_undone_by_the_shutdown_comes_back_in_the_order_it_went_down() -> None:
    """Two units of one priority preempted: the one whose stop turned out the shutdown's
    (`holds_of_shutdown`) went down first, and comes back first."""
    s = Scheduler([Gpu(0), Gpu(1)], {})
    a, b = spec("a", 60), spec("b", 60)
    s.request(a)
    s.request(b)
    assert brief(s.request(spec("u", 10, gpus=2))) == ["stop a.service", "stop b.service"]
    s.inactive(b.name, Outcome.STOPPED, not_ours=True)  # the shutdown's, as it turns out
    s.inactive(a.name, Outcome.STOPPED)
    assert s.holds_of_shutdown([b.name]) == [b.name]
    saved = s.save().preempted
    assert saved[b.name] < saved[a.name]
    assert brief(s.inactive("u.service", Outcome.EXITED)) == ["start b.service", "start a.service"]


def test_a_dropped_background_instance_is_not_refilled() -> None:
    """Past the bound, a preempted background instance someone had started is no longer
    brought back, and refill does not start it either (dormant): exactly what it is told,
    in its journal."""
    s = Scheduler([Gpu(0)], {})
    embed, urgent = spec("embed@a", 90, BG), spec("urgent", 10)
    s.request(embed)
    assert brief(s.request(urgent)) == ["stop embed@a.service"]
    s.inactive(embed.name, Outcome.STOPPED)
    [said] = [a for a in s.drop_preempted_instances(0) if isinstance(a, Log)]
    assert said.message == (
        "embed@a.service (priority 90) will not be restarted after its preemption: more "
        "than 0 preempted instances are kept, and it would have come back last; start it "
        "yourself if its work is still wanted"
    )
    assert brief(s.inactive(urgent.name, Outcome.EXITED)) == []


def test_a_preempted_instance_that_runs_again_is_not_dropped() -> None:
    """Seen running again (`running`: started while no controller ran) it is no longer
    down: neither dropped nor told it will not be restarted."""
    s = Scheduler([Gpu(0)], {})
    s.set_specs({TX.name: TX})
    s.load(SavedState(preempted={TX.name: 1}, seq=1))
    s.running(TX.name, [0])
    assert s.drop_preempted_instances(0) == []


def test_a_saved_instance_both_finished_and_stopped_by_the_shutdown_is_forgotten() -> None:
    """A state file (an older controller's) that names a background instance finished and
    also stopped by the host's shutdown: its record wins, and owed nothing, it is forgotten
    at the next word of it, not kept for a refill that would run a finished job again."""
    embed = spec("embed@a", 90, BG)
    s = Scheduler([Gpu(0)], {})
    s.set_specs({embed.name: embed})
    s.load(SavedState(finished=[embed.name], stopped_by_shutdown=[embed.name], seq=1))
    assert s.forget_instance(embed.name)
