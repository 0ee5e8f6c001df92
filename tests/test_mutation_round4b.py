"""Rules of this session's shutdown, comeback and dormant-instance code that mutation
testing (round 4, second half) found untested: comebacks waiting at their gate as saved and
loaded, what a shutdown owes a start of someone's or of ours, dormant instances, and the
tracker's stamp of shutdown jobs heard."""

from __future__ import annotations

import json
from dataclasses import asdict

from gpuslice.core.scheduler import Outcome, Phase, SavedState, Scheduler
from gpuslice.state import FORMAT_VERSION, Problems, validate
from gpuslice.tracker import Ledger, Tracker
from tests.core_builders import BG, brief, sized, spec, words

LOW = spec("low", 60, preempt="stop")
VOICE = spec("voice", 10)
L, VO = LOW.name, VOICE.name


def reread(saved: SavedState) -> SavedState:
    """The state as the next controller reads it from the file: nothing is dropped."""
    data = {"version": FORMAT_VERSION, "boot_id": "b" * 32, "generation": 1, **asdict(saved)}
    problems = Problems()
    got, _ = validate(json.loads(json.dumps(data)), problems)
    assert not problems, str(problems)
    return got


def at_gate() -> Scheduler:
    """requeue_at_gate: low.service, stopped for voice.service, restarted by gpuslice to wait
    at its gate (its start sent, its gate not asked yet)."""
    s = Scheduler([sized(0)], {L: LOW, VO: VOICE}, requeue_at_gate=True)
    assert brief(s.request(LOW)) == [f"grant {L} 0"]
    assert brief(s.request(VOICE)) == [f"stop {L}"]
    assert brief(s.inactive(L, Outcome.STOPPED)) == [f"grant {VO} 0", f"start {L}"]
    return s


def waiting_at_gate_restarted() -> Scheduler:
    """A controller restarted while low.service waited at its gate: it has not asked the
    new one yet."""
    first = at_gate()
    assert brief(first.request(LOW)) == []  # it waits for voice at its gate
    fresh = Scheduler([sized(0)], {L: LOW, VO: VOICE}, requeue_at_gate=True)
    fresh.load(reread(first.save()))
    fresh.running(VO, [0])
    return fresh


def test_a_comeback_sent_is_not_taken_for_one_waiting_at_its_gate_nor_any_other_unit() -> None:
    s = at_gate()
    assert s.phase(L) is Phase.STARTING  # a place of none kept until its gate asks
    assert s.requeued_away() == []
    assert not s.awaits_gate(L)
    assert not s.awaits_gate(VO)
    assert not s.awaits_gate("other.service")


def test_a_restarted_controller_keeps_a_comeback_at_its_gate_while_its_annotation_stays() -> None:
    fresh = waiting_at_gate_restarted()
    assert fresh.requeued_away() == [L]
    assert fresh.awaits_gate(L)
    assert brief(fresh.set_specs({L: LOW, VO: VOICE})) == []  # a reload: nothing withdrawn
    assert fresh.requeued_away() == [L]
    assert brief(fresh.request(LOW)) == []  # its gate asks: it waits for voice
    assert fresh.is_waiting(L)


def test_a_comeback_at_its_gate_withdrawn_is_saved_as_a_holder_being_stopped() -> None:
    fresh = waiting_at_gate_restarted()
    assert brief(fresh.set_specs({VO: VOICE})) == [f"stop {L}"]
    assert fresh.phase(L) is Phase.STOPPING
    saved = reread(fresh.save())  # a holder with no stamp would be dropped from the file
    assert saved.holders[L][1] == Phase.STOPPING.value
    again = Scheduler([sized(0)], {VO: VOICE}, requeue_at_gate=True)
    again.load(saved)
    assert again.phase(L) is Phase.STOPPING


def test_a_comeback_granted_is_saved_as_no_longer_waiting_at_its_gate() -> None:
    s = at_gate()
    assert brief(s.request(LOW)) == []
    assert brief(s.inactive(VO, Outcome.EXITED)) == [f"grant {L} 0"]
    assert s.save().requeued == []  # the next controller said it dropped it, else
    reread(s.save())


def test_a_saved_comeback_of_a_unit_no_longer_annotated_is_not_waited_for() -> None:
    s = Scheduler([sized(0)], {L: LOW}, requeue_at_gate=True)
    s.load(SavedState(seq=9, requeued=["gone.service", L]))
    assert s.requeued_away() == [L]
    assert not s.awaits_gate("gone.service")


def test_after_a_boot_no_comeback_waits_at_its_gate() -> None:
    """A background unit's comeback at its gate when the host went down is owed nothing
    (refill starts it): the new boot's controller waits for no gate of it, and withdraws
    nothing of it when its annotation goes."""
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0)], {L: LOW, bg.name: bg, VO: VOICE})
    ended = s.ended_with_boot(SavedState(seq=9, requeued=[L, bg.name]))
    assert ended.requeued == []
    assert ended.preempted == {L: 9}
    s.load(ended)
    assert s.requeued_away() == []
    assert brief(s.set_specs({L: LOW, VO: VOICE})) == [f"start {L}"]


def test_a_start_of_someones_that_the_shutdown_cancels_is_owed_nothing() -> None:
    """Someone's start waiting for GPUs (or granted, not yet running) when the host goes
    down: systemd cancels it; gpuslice did not start it and does not after the boot."""
    x = spec("x", 5)
    s = Scheduler([sized(0), sized(1)], {L: LOW, VO: VOICE, x.name: x})
    assert brief(s.request(x)) == ["grant x.service 0"]
    assert brief(s.request(VOICE)) == [f"grant {VO} 1"]
    assert brief(s.request(LOW)) == []  # it waits
    s.set_shutting_down(True)
    s.inactive(L, Outcome.SHUTDOWN)
    assert s.save().preempted == {}
    assert brief(s.set_shutting_down(False)) == []


def test_a_comeback_the_shutdown_ended_is_saved_owed_in_its_order() -> None:
    """Two on-demand comebacks whose starts the shutdown cancelled: both owed, saved with
    the stamps of their ends (the order they come back in), and brought back once the
    shutdown is cancelled."""
    other = spec("other", 60, preempt="stop")
    s = Scheduler([sized(0), sized(1)], {L: LOW, other.name: other, VO: VOICE})
    assert brief(s.request(LOW)) == [f"grant {L} 0"]
    assert brief(s.request(other)) == [f"grant {other.name} 1"]
    big = spec("voice", 10, gpus=2)
    s.set_specs({L: LOW, other.name: other, VO: big})
    assert sorted(brief(s.request(big))) == [f"stop {L}", f"stop {other.name}"]
    s.inactive(L, Outcome.STOPPED)
    assert brief(s.inactive(other.name, Outcome.STOPPED)) == [f"grant {VO} 0,1"]
    s.running(VO)
    assert sorted(brief(s.inactive(VO, Outcome.EXITED))) == [f"start {L}", f"start {other.name}"]
    s.set_shutting_down(True)
    s.inactive(other.name, Outcome.SHUTDOWN)
    s.inactive(L, Outcome.SHUTDOWN)
    saved = reread(s.save())
    assert set(saved.preempted) == {L, other.name}
    assert saved.preempted[other.name] < saved.preempted[L]
    assert sorted(brief(s.set_shutting_down(False))) == [f"start {L}", f"start {other.name}"]


def test_a_refill_the_shutdown_cut_short_is_owed_nothing_refill_starts_it_again() -> None:
    """A plain background unit gpuslice started whose start the shutdown cancelled: no
    comeback is owed (refill starts it anyway once the host is up), nor is it a
    preemption to show."""
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0)], {bg.name: bg})
    assert brief(s.schedule()) == [f"start {bg.name}"]
    s.set_shutting_down(True)
    s.inactive(bg.name, Outcome.SHUTDOWN)
    assert s.save().preempted == {}
    assert brief(s.set_shutting_down(False)) == [f"start {bg.name}"]


def test_a_background_instance_someone_started_is_refilled_like_any_other() -> None:
    """An instance learnt is dormant until someone starts it; once its gate asked, it is a
    background unit like any: ended by a shutdown that was then cancelled, refill starts it."""
    inst = spec("embed@a", 90, BG)
    s = Scheduler([sized(0)], {})
    s.learn(inst)
    assert inst.name in s.dormant
    assert brief(s.schedule()) == []
    assert brief(s.request(inst)) == [f"grant {inst.name} 0"]
    assert inst.name not in s.dormant
    s.set_shutting_down(True)
    s.inactive(inst.name, Outcome.SHUTDOWN)
    assert brief(s.set_shutting_down(False)) == [f"start {inst.name}"]


def test_an_instance_forgotten_leaves_nothing_of_it_behind() -> None:
    """Kept, every instance ever seen would stay in memory (issue 10)."""
    inst = spec("transcribe@rec1", 50)
    s = Scheduler([sized(0)], {})
    s.learn(inst)
    assert inst.name in s.dormant
    assert s.forget_instance(inst.name)
    assert inst.name not in s.specs
    assert inst.name not in s.dormant


def test_a_frozen_unit_whose_neighbours_left_is_thawed_before_waiters_are_served() -> None:
    """Its journal says each turn: thawed when the units it was frozen for have left, then
    frozen for the waiter served in the same pass. Served first, the waiter left it frozen
    for a unit no line named, as if still for the one that left."""
    emb = spec("emb", 90, BG, mem_gib=8, preempt="freeze")
    voice, w = spec("voice", 10, mem_gib=8), spec("w", 50, mem_gib=12)
    s = Scheduler([sized(0)], {u.name: u for u in (emb, voice, w)})
    assert brief(s.request(emb)) == [f"grant {emb.name} 0"]
    assert brief(s.request(voice)) == [f"grant {VO} 0", f"freeze {emb.name}"]
    assert brief(s.request(w)) == []  # beside both it does not fit
    acts = s.inactive(VO, Outcome.EXITED)
    assert brief(acts) == [f"thaw {emb.name}", f"grant {w.name} 0", f"freeze {emb.name}"]
    assert words(acts)[3] == (
        "freezing emb.service (priority 90) on GPU 0 for w.service (priority 50): it keeps its "
        "VRAM and runs again when that unit has left"
    )
    assert brief(s.inactive(w.name, Outcome.EXITED)) == [f"thaw {emb.name}"]


SHUTDOWN_JOB = "/org/freedesktop/systemd1/job/70"
REBOOT_JOB = "/org/freedesktop/systemd1/job/71"


def tracker() -> Tracker:
    return Tracker(lambda n: n == L, Ledger(lambda _: None, lambda _: False))


def test_a_read_of_the_host_answered_before_a_shutdown_job_ended_is_not_believed() -> None:
    """systemd's answer that the host is not going down is believed only if no job of a
    shutdown target was heard while it was on its way: here the shutdown's job ended done
    meanwhile, and the answer is older than that end."""
    t = tracker()
    t.job_new(SHUTDOWN_JOB, "shutdown.target")
    stamp = t.shutdown_jobs_heard()
    t.job_removed(SHUTDOWN_JOB, "shutdown.target", "done")
    assert not t.shutdown_unheard(stamp)
    assert t.shutting_down


def test_a_read_answered_before_another_shutdown_job_came_and_went_is_not_believed() -> None:
    """A second shutdown job queued and ended while the answer was on its way: two jobs
    heard since, the answer is stale."""
    t = tracker()
    t.job_new(SHUTDOWN_JOB, "shutdown.target")
    stamp = t.shutdown_jobs_heard()
    t.job_new(REBOOT_JOB, "reboot.target")
    t.job_removed(REBOOT_JOB, "reboot.target", "done")
    assert not t.shutdown_unheard(stamp)
    assert t.shutting_down


def test_a_read_with_no_shutdown_job_heard_since_is_believed() -> None:
    """The JobRemoved of a cancelled shutdown was lost: the read says the host runs."""
    t = tracker()
    t.job_new(SHUTDOWN_JOB, "shutdown.target")
    stamp = t.shutdown_jobs_heard()
    assert t.shutdown_unheard(stamp)
    assert t.shutting_down is False
