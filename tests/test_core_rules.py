"""The product's scheduling rules, one table row or test per rule, on the pure core.

Each row plays steps against `Sim` (the core inside a well-behaved systemd) and compares
the actions of every step, without their words; the words are asserted exactly in the
tests after the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from gpuslice.core.decisions import Blocker
from gpuslice.core.model import Gpu, Restart, UnitSpec
from gpuslice.core.scheduler import Action, Log, Outcome, Phase, SavedState, Scheduler, Stop
from tests.core_builders import BG, GIB, OD, InvariantError, Sim, brief, sized, spec, words

VLM = spec("vlm-analysis", 90, BG)
VOICE = spec("voice-pipeline", 10)
V, VO = VLM.name, VOICE.name

OPS: dict[str, Callable[[Sim, str], list[Action]]] = {
    "boot": lambda sim, _: sim.boot(),
    "start": lambda sim, name: sim.start(name),
    "exit": lambda sim, name: sim.exit(name),
    # Restart=no: the controller's wait for a restart ends with none
    "fail": lambda sim, name: sim.exit(name, Outcome.FAILED) + sim.restart_not_seen(name),
    "stop": lambda sim, name: sim.stop(name),
    "finish_stop": lambda sim, name: sim.finish_stop(name or None),
    "finish_start": lambda sim, name: sim.finish_start(name or None),
    "settle": lambda sim, _: sim.settle(),
}


@dataclass(frozen=True)
class Case:
    name: str
    gpus: int
    specs: tuple[UnitSpec, ...]
    steps: tuple[tuple[str, str, list[str]], ...]


CASES = [
    Case(
        "seed timeline: vlm runs, voice preempts it, voice exits, vlm is restarted",
        1,
        (VLM, VOICE),
        (
            ("boot", "", [f"start {V}"]),
            ("settle", "", [f"grant {V} 0"]),
            ("start", VO, [f"stop {V}"]),
            ("settle", "", [f"grant {VO} 0"]),
            ("exit", VO, [f"start {V}"]),
            ("settle", "", [f"grant {V} 0"]),
        ),
    ),
    Case(
        "equal priority never preempts: the later unit waits, then runs",
        1,
        (spec("a", 50), spec("b", 50)),
        (
            ("start", "a.service", ["grant a.service 0"]),
            ("start", "b.service", []),
            ("exit", "a.service", ["grant b.service 0"]),
        ),
    ),
    Case(
        "equal priority waiters are served in arrival order",
        1,
        (spec("a", 10), spec("c", 50), spec("b", 50), spec("d", 30)),
        (
            ("start", "a.service", ["grant a.service 0"]),
            ("start", "c.service", []),
            ("start", "b.service", []),
            ("start", "d.service", []),
            ("exit", "a.service", ["grant d.service 0"]),
            ("exit", "d.service", ["grant c.service 0"]),
            ("exit", "c.service", ["grant b.service 0"]),
        ),
    ),
    Case(
        "three levels: 50 preempts 90, 10 preempts 50; 50 then 90 come back",
        1,
        (spec("bg", 90, BG), spec("mid", 50), spec("top", 10)),
        (
            ("boot", "", ["start bg.service"]),
            ("settle", "", ["grant bg.service 0"]),
            ("start", "mid.service", ["stop bg.service"]),
            ("settle", "", ["grant mid.service 0"]),
            ("start", "top.service", ["stop mid.service"]),
            ("settle", "", ["grant top.service 0"]),
            ("exit", "top.service", ["start mid.service"]),
            ("settle", "", ["grant mid.service 0"]),
            ("exit", "mid.service", ["start bg.service"]),
            ("settle", "", ["grant bg.service 0"]),
        ),
    ),
    Case(
        "boot on one GPU starts the most urgent background unit",
        1,
        (spec("a", 70, BG), spec("b", 30, BG), spec("c", 50, BG), spec("od", 1)),
        (
            ("boot", "", ["start b.service"]),
            ("settle", "", ["grant b.service 0"]),
        ),
    ),
    Case(
        "boot on two GPUs starts the two most urgent background units",
        2,
        (spec("a", 70, BG), spec("b", 30, BG), spec("c", 50, BG)),
        (
            ("boot", "", ["start b.service", "start c.service"]),
            ("settle", "", ["grant b.service 0", "grant c.service 1"]),
        ),
    ),
    Case(
        "a manually stopped background unit is held until started again",
        1,
        (VLM, VOICE),
        (
            ("boot", "", [f"start {V}"]),
            ("settle", "", [f"grant {V} 0"]),
            ("stop", V, []),
            ("start", VO, [f"grant {VO} 0"]),
            ("exit", VO, []),
            ("start", V, [f"grant {V} 0"]),
            ("exit", V, []),
        ),
    ),
    Case(
        "a background unit stopped by a person before its gate is held too",
        1,
        (VLM, VOICE),
        (
            ("boot", "", [f"start {V}"]),
            ("stop", V, []),
            ("start", VO, [f"grant {VO} 0"]),
            ("exit", VO, []),
        ),
    ),
    Case(
        "a failing background unit is not restarted (no restart storm)",
        1,
        (VLM, VOICE),
        (
            ("boot", "", [f"start {V}"]),
            ("settle", "", [f"grant {V} 0"]),
            ("fail", V, []),
            ("start", VO, [f"grant {VO} 0"]),
            ("exit", VO, []),
            ("start", V, [f"grant {V} 0"]),
        ),
    ),
    Case(
        "a background unit that exits successfully is finished, not restarted",
        1,
        (VLM, spec("other", 95, BG)),
        (
            ("boot", "", [f"start {V}"]),
            ("settle", "", [f"grant {V} 0"]),
            ("exit", V, ["start other.service"]),
            ("settle", "", ["grant other.service 0"]),
            ("exit", "other.service", []),
        ),
    ),
    Case(
        "a 2-GPU unit preempts two 1-GPU units of lower priority; both come back",
        2,
        (spec("a", 90, BG), spec("b", 80, BG), spec("big", 10, gpus=2)),
        (
            ("boot", "", ["start b.service", "start a.service"]),
            ("settle", "", ["grant b.service 0", "grant a.service 1"]),
            ("start", "big.service", ["stop b.service", "stop a.service"]),
            ("finish_stop", "b.service", []),
            ("finish_stop", "a.service", ["grant big.service 0,1"]),
            ("exit", "big.service", ["start b.service", "start a.service"]),
            ("settle", "", ["grant b.service 0", "grant a.service 1"]),
        ),
    ),
    Case(
        "victims: the least urgent unit goes",
        2,
        (spec("x", 60), spec("y", 70), spec("w", 10)),
        (
            ("start", "x.service", ["grant x.service 0"]),
            ("start", "y.service", ["grant y.service 1"]),
            ("start", "w.service", ["stop y.service"]),
            ("settle", "", ["grant w.service 1"]),
        ),
    ),
    Case(
        "victims: two least urgent units rather than one more urgent",
        4,
        (spec("p", 50, gpus=2), spec("q1", 90), spec("q2", 90), spec("w", 10, gpus=2)),
        (
            ("start", "p.service", ["grant p.service 0,1"]),
            ("start", "q1.service", ["grant q1.service 2"]),
            ("start", "q2.service", ["grant q2.service 3"]),
            ("start", "w.service", ["stop q1.service", "stop q2.service"]),
            ("settle", "", ["grant w.service 2,3"]),
        ),
    ),
    Case(
        "victims: among equally urgent units, the fewest",
        4,
        (spec("p", 80, gpus=2), spec("q1", 80), spec("q2", 80), spec("w", 10, gpus=2)),
        (
            ("start", "q1.service", ["grant q1.service 0"]),
            ("start", "p.service", ["grant p.service 1,2"]),
            ("start", "q2.service", ["grant q2.service 3"]),
            ("start", "w.service", ["stop p.service"]),
            ("settle", "", ["grant w.service 1,2"]),
        ),
    ),
    Case(
        "victims: never a unit of equal priority, even when it would suffice",
        2,
        (spec("eq", 10), spec("low", 90), spec("w", 10, gpus=2)),
        (
            ("start", "eq.service", ["grant eq.service 0"]),
            ("start", "low.service", ["grant low.service 1"]),
            ("start", "w.service", []),
            ("exit", "eq.service", ["stop low.service"]),
            ("settle", "", ["grant w.service 0,1"]),
        ),
    ),
    Case(
        "Requeue=no: a preempted unit is not restarted",
        1,
        (spec("vlm-analysis", 90, BG, requeue=False), VOICE),
        (
            ("boot", "", [f"start {V}"]),
            ("settle", "", [f"grant {V} 0"]),
            ("start", VO, [f"stop {V}"]),
            ("settle", "", [f"grant {VO} 0"]),
            ("exit", VO, []),
            ("start", V, [f"grant {V} 0"]),
        ),
    ),
    Case(
        "a waiter cancelled while waiting leaves nothing reserved",
        1,
        (spec("a", 50), spec("b", 50), spec("c", 60)),
        (
            ("start", "a.service", ["grant a.service 0"]),
            ("start", "b.service", []),
            ("start", "c.service", []),
            ("stop", "b.service", []),
            ("exit", "a.service", ["grant c.service 0"]),
        ),
    ),
    Case(
        "a waiter cancelled while its victim stops: the victim is requeued",
        1,
        (VLM, VOICE),
        (
            ("boot", "", [f"start {V}"]),
            ("settle", "", [f"grant {V} 0"]),
            ("start", VO, [f"stop {V}"]),
            ("stop", VO, []),
            ("finish_stop", V, [f"start {V}"]),
            ("settle", "", [f"grant {V} 0"]),
        ),
    ),
    Case(
        "a more urgent unit arriving while victims stop gets the freed GPU",
        1,
        (VLM, spec("mid", 50), spec("top", 10)),
        (
            ("boot", "", [f"start {V}"]),
            ("settle", "", [f"grant {V} 0"]),
            ("start", "mid.service", [f"stop {V}"]),
            ("start", "top.service", []),
            ("finish_stop", V, ["grant top.service 0"]),
            ("exit", "top.service", ["grant mid.service 0"]),
            ("exit", "mid.service", [f"start {V}"]),
        ),
    ),
    Case(
        "a less urgent unit arriving while victims stop does not get the freed GPU",
        1,
        (VLM, spec("mid", 50), spec("low", 70)),
        (
            ("boot", "", [f"start {V}"]),
            ("settle", "", [f"grant {V} 0"]),
            ("start", "mid.service", [f"stop {V}"]),
            ("start", "low.service", []),
            ("finish_stop", V, ["grant mid.service 0"]),
            ("exit", "mid.service", ["grant low.service 0"]),
            ("exit", "low.service", [f"start {V}"]),
        ),
    ),
    Case(
        "no more victims for a waiter whose victims are still stopping",
        2,
        (spec("a", 90, BG), spec("b", 80), spec("w", 10, gpus=2)),
        (
            ("boot", "", ["start a.service"]),
            ("settle", "", ["grant a.service 0"]),
            ("start", "w.service", ["stop a.service"]),
            ("start", "b.service", []),
            ("finish_stop", "a.service", ["grant w.service 0,1"]),
        ),
    ),
    Case(
        "a blocked wide waiter keeps free GPUs from equal and less urgent waiters",
        2,
        (spec("a", 10), spec("wide", 10, gpus=2), spec("b", 10), spec("c", 20)),
        (
            ("start", "a.service", ["grant a.service 0"]),
            ("start", "wide.service", []),
            ("start", "b.service", []),
            ("start", "c.service", []),  # granting it GPU 1 would let b preempt it next
            ("exit", "a.service", ["grant wide.service 0,1"]),
            ("exit", "wide.service", ["grant b.service 0", "grant c.service 1"]),
        ),
    ),
    Case(
        "a unit that can never fit keeps nothing back from its equals",
        1,
        (spec("huge", 10, gpus=2), spec("a", 10)),
        (
            ("start", "huge.service", []),
            ("start", "a.service", ["grant a.service 0"]),
        ),
    ),
    Case(
        "a preempted on-demand unit is requeued when the GPU frees up",
        1,
        (spec("job", 50), spec("top", 10)),
        (
            ("start", "job.service", ["grant job.service 0"]),
            ("start", "top.service", ["stop job.service"]),
            ("settle", "", ["grant top.service 0"]),
            ("exit", "top.service", ["start job.service"]),
            ("settle", "", ["grant job.service 0"]),
        ),
    ),
    Case(
        "a unit needing more GPUs than exist waits; others still run",
        2,
        (spec("huge", 10, gpus=3), spec("small", 50), VLM),
        (
            ("boot", "", [f"start {V}"]),
            ("start", "huge.service", []),
            ("start", "small.service", ["grant small.service 1"]),
            ("settle", "", [f"grant {V} 0"]),
        ),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rules(case: Case) -> None:
    sim = Sim(case.gpus, case.specs)
    for number, (op, arg, want) in enumerate(case.steps):
        got = brief(OPS[op](sim, arg))
        assert got == want, f"step {number}: {op} {arg}"
    sim.settle()
    sim.check_quiet()


# -- the words, exactly --------------------------------------------------------------------


def test_seed_timeline_words() -> None:
    sim = Sim(1, [VLM, VOICE])
    assert words(sim.boot()) == [
        "starting background vlm-analysis.service (priority 90) on free GPU 0"
    ]
    assert words(sim.settle()) == ["starting vlm-analysis.service (priority 90) on GPU 0"]
    preempt = sim.start(VO)
    assert [a.reason for a in preempt if isinstance(a, Stop)] == [
        "preempting vlm-analysis.service (priority 90) for voice-pipeline.service "
        "(priority 10) on GPU 0"
    ]
    assert sim.sched.snapshot().waiting == [
        (VO, 10, "waiting for vlm-analysis.service (priority 90) to stop on GPU 0")
    ]
    assert words(sim.settle()) == ["starting voice-pipeline.service (priority 10) on GPU 0"]
    assert sim.sched.snapshot().preempted == [(V, 90, True)]
    assert words(sim.exit(VO)) == [
        "voice-pipeline.service finished: released GPU 0",
        "restarting preempted vlm-analysis.service (priority 90) on GPU 0",
    ]


def test_waiter_reason_names_the_holder() -> None:
    sim = Sim(1, [VOICE, spec("other", 10)])
    sim.start(VO)
    assert words(sim.start("other.service")) == [
        "other.service waiting: GPU 0 held by voice-pipeline.service, priority 10"
    ]
    assert sim.sched.snapshot().waiting == [
        ("other.service", 10, "waiting: GPU 0 held by voice-pipeline.service, priority 10")
    ]


def test_a_waiter_is_told_once_while_its_gpus_stay_busy_and_status_names_the_holder_now() -> None:
    """Another unit taking the GPU it waits for is no new line in its journal (at 200
    waiters that would be 200 lines per handover); `gpuslice status` says who holds it now."""
    sim = Sim(1, [VOICE, spec("first", 10), spec("other", 20)])
    sim.start(VO)
    sim.start("first.service")
    said = "waiting: GPU 0 held by voice-pipeline.service, priority 10"
    assert words(sim.start("other.service")) == [f"other.service {said}"]
    assert words(sim.exit(VO)) == [
        "voice-pipeline.service finished: released GPU 0",
        "starting first.service (priority 10) on GPU 0",
    ]
    now = "waiting: GPU 0 held by first.service, priority 10"
    assert sim.sched.snapshot().waiting == [("other.service", 20, now)]
    assert sim.sched.snapshot().reasons["other.service"].parts[0].unit == "first.service"
    assert sim.sched.snapshot(reasons=False).waiting == [("other.service", 20, said)]


def test_status_names_no_thrash_rule_for_an_equal_holder_granted_later() -> None:
    """`even` (as urgent as `wide`) was granted beside `top` while `wide` waited; once `top`
    is gone `wide` still waits for it, which equal priority explains: status does not say
    that the thrash rule protects it."""
    top, even = spec("top", 5, mem_gib=16), spec("even", 20, mem_gib=8)
    wide = spec("wide", 20, mem_gib=20)
    sim = Sim([sized(0)], [top, even, wide])
    sim.start("top.service")
    sim.start("wide.service")
    assert brief(sim.start("even.service")) == ["grant even.service 0"]
    sim.exit("top.service")
    [part] = sim.sched.snapshot().reasons["wide.service"].parts
    assert (part.unit, part.granted_after) == ("even.service", False)


def test_a_waiter_is_told_again_when_the_cause_changes() -> None:
    """From busy GPUs to too few usable GPUs and back: each change is said."""
    sim = Sim([sized(0), sized(1)], [spec("a", 10), spec("big", 20, gpus=2)])
    sim.start("a.service")
    busy = "big.service waiting: needs 2 GPUs; GPU 0 held by a.service, priority 10"
    assert words(sim.start("big.service")) == [busy]
    assert words(sim.sample([sized(0), sized(1, lost=True)]))[-1] == (
        "big.service waiting: needs 2 GPUs; only 1 of this host's GPUs may run it (Devices=, "
        "lost GPUs, or processes gpuslice does not manage)"
    )
    assert words(sim.sample([sized(0), sized(1)])) == [busy]


def test_waiter_reason_while_a_victim_stops_for_someone_else() -> None:
    sim = Sim(1, [VLM, spec("mid", 50), spec("low", 70)])
    sim.boot()
    sim.settle()
    sim.start("mid.service")
    assert words(sim.start("low.service")) == [
        "low.service waiting: GPU 0 being freed by vlm-analysis.service (stopping)"
    ]
    assert [p.rung for p in sim.sched.snapshot().reasons["low.service"].parts] == [""]


def test_same_priority_keeps_free_gpus_for_the_earlier_unit() -> None:
    sim = Sim(2, [spec("eq", 10), spec("wide", 20, gpus=2), spec("late", 20)])
    sim.start("eq.service")
    assert brief(sim.start("wide.service")) == []
    assert words(sim.start("late.service")) == [
        "late.service waiting: GPU 0 held by eq.service, priority 10; "
        "GPU 1 kept for an earlier unit of priority 20"
    ]
    assert brief(sim.exit("eq.service")) == ["grant wide.service 0,1"]


def test_unit_needing_more_gpus_than_exist_says_so() -> None:
    sim = Sim(2, [spec("huge", 10, gpus=3)])
    assert words(sim.start("huge.service")) == [
        "huge.service (priority 10) needs 3 GPUs but this host has 2: "
        "it waits until the configuration changes",
        "huge.service waiting: needs 3 GPUs, this host has 2",
    ]
    assert sim.sched.snapshot().waiting == [
        ("huge.service", 10, "waiting: needs 3 GPUs, this host has 2")
    ]


def test_outcome_words() -> None:
    sim = Sim(1, [VLM, VOICE, spec("a", 50), spec("b", 50)])
    sim.boot()
    sim.settle()
    assert words(sim.stop(V)) == [
        "vlm-analysis.service was stopped outside gpuslice: held until started again"
    ]
    sim.start(V)
    assert words(sim.exit(V, Outcome.FAILED)) == [
        "vlm-analysis.service failed: gpuslice will not start it by itself "
        "(its own Restart= policy applies)"
    ]
    sim.restart_not_seen(V)  # Restart=no: the wait for a restart ends with none
    sim.start("a.service")
    sim.start("b.service")
    assert words(sim.stop("b.service"))[0] == (
        "b.service: start cancelled while waiting; nothing reserved"
    )
    snap = sim.sched.snapshot()
    assert (snap.held, snap.failed, snap.waiting) == (["b.service"], [V], [])


def test_requeue_no_words() -> None:
    sim = Sim(1, [spec("vlm-analysis", 90, BG, requeue=False), VOICE])
    sim.boot()
    sim.settle()
    sim.start(VO)
    assert "vlm-analysis.service (priority 90) preempted; Requeue=no, not restarting" in words(
        sim.settle()
    )
    assert sim.sched.snapshot().preempted == [(V, 90, False)]
    assert brief(sim.exit(VO)) == []


def test_a_unit_that_ends_by_itself_while_it_is_stopped_is_done_not_owed_a_comeback() -> None:
    """Its main process ended before our stop took effect (or it was in its ExecStopPost=):
    finished (or failed), never restarted as a preempted unit; the waiter gets its GPU."""
    for outcome, said in (
        (Outcome.EXITED, "vlm-analysis.service finished: released GPU 0"),
        (Outcome.FAILED, "vlm-analysis.service failed: gpuslice will not start it by itself"),
    ):
        sim = Sim(1, [VLM, VOICE])
        sim.boot()
        sim.settle()
        assert brief(sim.start(VO)) == [f"stop {V}"]
        ended = sim.exit_while_stopping(V, outcome)
        assert words(ended)[0].startswith(said)
        assert brief(ended) == [f"grant {VO} 0"]
        assert brief(sim.exit(VO)) == []  # not restarted: its work is done
        snap = sim.sched.snapshot()
        assert snap.preempted == [] and V in (
            snap.finished if outcome is Outcome.EXITED else snap.failed
        )


# -- a person's stop and start while gpuslice's own jobs run ---------------------------------


def test_person_starts_a_victim_while_it_stops_it_queues_again() -> None:
    sim = Sim(1, [spec("job", 50), VOICE])
    sim.start("job.service")
    sim.start(VO)
    assert sim.start("job.service") == []  # queued behind the stop job
    assert brief(sim.finish_stop("job.service")) == [f"grant {VO} 0"]
    assert brief(sim.finish_start("job.service")) == []
    assert sim.sched.snapshot().waiting[0][0] == "job.service"
    assert brief(sim.exit(VO)) == ["grant job.service 0"]


def test_a_background_unit_not_yet_at_its_gate_waits_again_instead_of_being_stopped() -> None:
    sim = Sim(1, [VLM, VOICE])
    sim.boot()  # vlm's start job is on its way to the gate
    assert brief(sim.start(VO)) == [f"grant {VO} 0"]  # nothing of vlm ran: no stop
    assert brief(sim.settle()) == []  # vlm's gate asks: it waits
    assert brief(sim.exit(VO)) == [f"grant {V} 0"]


def test_a_start_known_before_its_gate_asks_is_served_in_priority_order() -> None:
    sim = Sim(1, [VLM, VOICE, spec("nightly", 50)])
    sim.boot()
    sim.settle()
    assert sim.running == {V: (0,)}
    assert brief(sim.announce("nightly.service")) == [f"stop {V}"]
    sim.finish_stop(V)
    # voice's start job is announced before nightly's gate asks: the GPU is kept for voice
    assert brief(sim.announce(VO)) == []
    assert brief(sim.finish_start("nightly.service")) == []  # it waits: no grant to stop later
    assert brief(sim.finish_start(VO)) == [f"grant {VO} 0"]
    assert brief(sim.exit(VO)) == ["grant nightly.service 0"]


def test_a_unit_granted_while_a_request_was_known_is_not_stopped_for_it() -> None:
    big = spec("big", 10, gpus=2)
    sim = Sim(2, [spec("eq", 10), big, spec("b", 50)])
    sim.start("eq.service")  # GPU 0
    assert brief(sim.start("big.service")) == []  # needs both GPUs; eq is as urgent
    # b fits only where big cannot go yet: GPU 1 is kept for big
    assert brief(sim.start("b.service")) == []
    assert brief(sim.exit("eq.service")) == ["grant big.service 0,1"]
    assert brief(sim.exit("big.service")) == ["grant b.service 0"]


def test_a_place_kept_and_taken_back_counts_anew_for_the_thrash_rule() -> None:
    """A background unit started by refill, moved back to waiting for a more urgent start,
    given a place again and moved back again is known anew for the thrash rule each time it
    loses its place: a unit granted while its place was kept was not granted before it, and
    once that unit's priority is lowered below it, it is stopped for it."""
    bg = spec("bg", 20, BG)
    a, c, d = spec("a", 10), spec("c", 10), spec("d", 10)
    sim = Sim(2, [bg, a, c, d])
    assert brief(sim.boot()) == ["start bg.service"]  # GPU 0, its gate not asking yet
    assert brief(sim.start("a.service")) == ["grant a.service 1"]  # bg's place kept
    assert brief(sim.start("c.service")) == ["grant c.service 0"]  # bg waits again
    assert brief(sim.exit("c.service")) == []  # GPU 0 kept for bg
    assert brief(sim.start("d.service")) == ["grant d.service 0"]  # bg waits again
    lowered = [bg, spec("a", 50), c, d]
    assert brief(sim.annotate(lowered)) == ["stop a.service"]
    reason = sim.sched.snapshot().waiting[0][2]
    assert reason == "waiting for a.service (priority 50) to stop on GPU 1", reason


def test_a_start_whose_kept_gpu_is_lost_preempts_what_was_granted_meanwhile() -> None:
    """Its place kept on GPU 0 before its gate asked, GPU 0 falls off the bus: the more urgent
    start is not left waiting behind a less urgent unit granted GPU 1 while its place was
    kept (found by the renumbering machine at 20,000 examples): that one was not granted
    before it, so the thrash rule does not hold it back."""
    w, h = spec("w", 10), spec("h", 50)
    s = Scheduler([sized(0), sized(1)], {w.name: w, h.name: h})
    assert brief(s.announce(w)) == []  # GPU 0 kept for w
    assert brief(s.request(h)) == ["grant h.service 1"]
    assert brief(s.set_gpus([dataclasses.replace(sized(0), lost=True), sized(1)])) == []
    assert brief(s.request(w)) == ["stop h.service"]
    assert s.waiting(w.name).victims == ("h.service",)


def test_a_start_that_lost_its_kept_place_keeps_its_place_in_the_queue() -> None:
    """Known anew for the thrash rule only: among starts of its own priority it still comes
    first, from when it was started."""
    w1, w2, u = spec("w1", 20), spec("w2", 20), spec("u", 10)
    s = Scheduler([sized(0)], {n.name: n for n in (w1, w2, u)})
    assert brief(s.announce(w1)) == []  # GPU 0 kept for w1
    assert brief(s.request(w2)) == []  # started after w1
    assert brief(s.request(u)) == ["grant u.service 0"]  # w1 waits again
    assert brief(s.request(w1)) == []
    assert brief(s.inactive(u.name, Outcome.EXITED)) == ["grant w1.service 0"]


def test_the_thrash_rule_is_said_in_the_waiters_reason() -> None:
    a, b = spec("a", 10, mem_gib=20), spec("b", 50, mem_gib=8)
    s = Scheduler([sized(0, foreign=10 * GIB)], {})
    s.request(a)  # 14 GiB free: a does not fit, b does
    assert brief(s.request(b)) == ["grant b.service 0"]
    assert brief(s.set_gpus([sized(0)])) == []  # the foreign process left: a fits without b
    reason = s.snapshot().waiting[0][2]
    assert "(granted while this unit was known: not stopped for it)" in reason, reason


# -- controller restart, persistence, new annotations ---------------------------------------


def _busy_two_gpus() -> tuple[Sim, list[UnitSpec]]:
    specs = [VLM, VOICE, spec("asr", 20), spec("held-bg", 95, BG)]
    sim = Sim(2, specs)
    sim.boot()
    sim.settle()  # vlm on GPU 0, held-bg on GPU 1
    sim.stop("held-bg.service")
    sim.settle()  # nothing: held-bg is held
    sim.start(VO)  # GPU 1
    sim.start("asr.service")  # preempts vlm
    sim.settle()
    assert sim.running == {VO: (1,), "asr.service": (0,)}
    return sim, specs


def test_save_load_round_trip() -> None:
    sim, specs = _busy_two_gpus()
    saved = sim.sched.save()
    assert {n: (g, p) for n, (g, p, *_) in saved.holders.items()} == {
        VO: ((1,), "running"),
        "asr.service": ((0,), "running"),
    }
    fresh = Scheduler(range(2), {s.name: s for s in specs})
    fresh.load(saved)
    assert fresh.save() == saved
    snap = fresh.snapshot()
    assert (snap.preempted, snap.held) == ([(V, 90, True)], ["held-bg.service"])


def test_adoption_after_controller_restart_keeps_gpus_and_order() -> None:
    sim, specs = _busy_two_gpus()
    saved = sim.sched.save()
    fresh = Scheduler(range(2), {s.name: s for s in specs})
    fresh.load(saved)
    adopted = []
    for name, (gpus, *_) in sorted(saved.holders.items()):
        adopted += fresh.running(name, gpus)
    adopted += fresh.schedule()
    assert brief(adopted) == []  # nothing started on GPUs that running units hold
    assert {n: sorted(h.gpus) for n, h in fresh.holders.items()} == {
        VO: [1],
        "asr.service": [0],
    }
    assert all(h.phase is Phase.RUNNING for h in fresh.holders.values())
    assert brief(fresh.inactive(VO, Outcome.EXITED)) == [f"start {V}"]
    # held-bg stays held across the restart: GPU 1 went to the preempted unit, not to it
    assert brief(fresh.inactive("asr.service", Outcome.EXITED)) == []


def test_restart_while_a_victim_stops_keeps_it_preempted() -> None:
    sim = Sim(1, [VLM, VOICE])
    sim.boot()
    sim.settle()
    sim.start(VO)  # vlm's stop job runs; the controller restarts now
    fresh = Scheduler(range(1), sim.annotations)
    fresh.load(sim.sched.save())
    assert fresh.running(V, (0,)) == []
    # the gate retries: voice asks again and must not stop vlm a second time
    assert brief(fresh.request(VOICE)) == []
    assert brief(fresh.inactive(V, Outcome.STOPPED)) == [f"grant {VO} 0"]
    assert fresh.snapshot().preempted == [(V, 90, True)]
    assert brief(fresh.inactive(VO, Outcome.EXITED)) == [f"start {V}"]


def test_running_unit_whose_annotation_appears_is_counted() -> None:
    sim = Sim(2, [VOICE])
    sim.start(VO)
    actions = sim.sched.running("late.service")  # not annotated: ignored
    assert actions == []
    sim.annotate([VOICE, spec("late", 50)])
    assert sim.sched.running("late.service", (0,)) == []  # GPU 0 is voice's: take GPU 1
    assert sorted(sim.sched.holders["late.service"].gpus) == [1]


def test_set_specs_new_priorities_preempt_and_reorder() -> None:
    sim = Sim(1, [spec("a", 50), spec("b", 60), spec("c", 70)])
    sim.start("a.service")
    sim.start("b.service")
    sim.start("c.service")
    # c becomes the most urgent: it preempts a, and is served before b
    actions = sim.annotate([spec("a", 50), spec("b", 60), spec("c", 5)])
    assert [a.reason for a in actions if isinstance(a, Stop)] == [
        "preempting a.service (priority 50) for c.service (priority 5) on GPU 0"
    ]
    assert brief(sim.settle()) == ["grant c.service 0"]
    # a now waits as a preempted unit; lowering b below a decides who comes back first
    sim.annotate([spec("a", 50), spec("b", 40), spec("c", 5)])
    assert brief(sim.exit("c.service")) == ["grant b.service 0"]
    assert brief(sim.exit("b.service")) == ["start a.service"]


def test_set_specs_removing_an_annotation_keeps_its_gpus_until_it_ends_then_forgets() -> None:
    sim = Sim(1, [VLM, VOICE])
    sim.boot()
    sim.settle()
    actions = sim.annotate([VOICE])
    assert words(actions) == [
        "vlm-analysis.service is no longer annotated: it keeps GPU 0 until it ends, "
        "then gpuslice forgets it"
    ]
    # still more urgent than what it was granted on: it gives way, and is not brought back
    assert brief(sim.start(VO)) == [f"stop {V}"]
    assert brief(sim.settle()) == [f"grant {VO} 0"]
    assert brief(sim.exit(VO)) == []
    # annotated again while idle: a background unit is started again
    assert brief(sim.annotate([VLM, VOICE])) == [f"start {V}"]


FORGOTTEN = (
    "vlm-analysis.service is no longer annotated: gpuslice forgets that it preempted it and "
    "will not start it again; start it yourself if its work is still wanted"
)


def test_a_preempted_unit_whose_annotation_goes_is_forgotten_and_said_so() -> None:
    """vlm, preempted for voice, waits to come back when its annotation goes: gpuslice
    manages only annotated units, so it never brings it back. Kept, status showed it
    preempted for ever (at priority 1000), its comeback kept the GPUs sampled, and annotated
    again days later it was restarted by itself. Its journal and the controller's say once
    that its work is not brought back; annotated again, it is a new unit."""
    sim = Sim(1, [VLM, VOICE])
    sim.boot()
    sim.settle()
    sim.start(VO)
    sim.settle()
    assert sim.sched.snapshot().preempted == [(V, 90, True)]
    actions = sim.annotate([VOICE])
    [said] = [a for a in actions if isinstance(a, Log)]
    assert (said.message, said.level) == (FORGOTTEN, "warning")
    assert said.decision is not None and said.decision.unit == V
    assert sim.sched.snapshot().preempted == []
    assert V not in sim.sched.save().preempted
    assert brief(sim.exit(VO)) == []
    assert not sim.sched.has_work()  # nothing owed: the GPUs need no sampling
    # annotated again: on-demand, it is not restarted by itself; background, it is a new
    # background unit, started on free capacity as any newly annotated one
    assert brief(sim.annotate([dataclasses.replace(VLM, kind=OD), VOICE])) == []
    assert brief(sim.annotate([VLM, VOICE])) == [f"start {V}"]


@pytest.mark.parametrize("ended", ["stop", "exit", "fail"])
def test_how_a_unit_down_ended_goes_silently_with_its_annotation(ended: str) -> None:
    """Held, finished or failed: nothing was owed, nothing is said; status no longer shows
    it, and the state file no longer keeps it."""
    sim = Sim(1, [VLM, VOICE])
    sim.boot()
    sim.settle()
    OPS[ended](sim, V)
    assert sim.sched.recorded() == {V}
    assert words(sim.annotate([VOICE])) == []
    snap = sim.sched.snapshot()
    assert (snap.held, snap.finished, snap.failed) == ([], [], [])
    saved = sim.sched.save()
    assert (saved.held, saved.finished, saved.failed) == ([], [], [])


def test_a_restarted_controller_forgets_records_of_units_no_longer_annotated() -> None:
    """Annotations taken out while no controller ran: the records the state file kept of
    them are forgotten at load, a preemption said once (no spec: no priority to name)."""
    sched = Scheduler(range(1), {VO: VOICE})
    saved = SavedState(
        preempted={V: 1, VO: 2}, held=["h.service"], finished=["f.service"], failed=["x.service"]
    )
    forgotten = sched.load(saved)
    assert [(a.message, a.level) for a in forgotten if isinstance(a, Log)] == [
        (FORGOTTEN, "warning")
    ]
    assert sched.recorded() == {VO}
    assert sched.snapshot().preempted == [(VO, 10, True)]


def test_set_specs_fixing_a_too_wide_unit_lets_it_run() -> None:
    sim = Sim(2, [spec("huge", 10, gpus=3)])
    sim.start("huge.service")
    assert brief(sim.annotate([spec("huge", 10, gpus=2)])) == ["grant huge.service 0,1"]


def test_sim_catches_a_grant_on_a_busy_gpu() -> None:
    sim = Sim(1, [VOICE, spec("x", 50)])
    sim.start(VO)
    sim.at_gate.add("x.service")
    sim.sched.holders.clear()  # the core forgets voice: the Sim must notice the double use
    with pytest.raises(InvariantError):
        sim._feed(sim.sched.request(spec("x", 50)))


def test_restart_keeps_a_waiters_victims() -> None:
    sim = Sim(3, [spec("a", 20), spec("b", 20), spec("w", 10, gpus=2)])
    sim.start("a.service")
    sim.start("b.service")
    assert brief(sim.start("w.service")) == ["stop b.service"]
    fresh = Scheduler(range(3), sim.annotations)
    fresh.load(sim.sched.save())
    for name, gpus in sim.running.items():
        fresh.running(name, gpus)
    # w's gate asks again: b is still stopping for it, so nothing more may be stopped
    assert brief(fresh.request(sim.annotations["w.service"])) == []


def test_removing_the_annotation_of_a_unit_being_stopped_keeps_its_gpus() -> None:
    sim = Sim(1, [VLM, VOICE])
    sim.boot()
    sim.settle()
    sim.start(VO)  # vlm is being stopped
    assert brief(sim.annotate([VOICE])) == []  # voice may not run until vlm is gone
    assert brief(sim.finish_stop(V)) == [f"grant {VO} 0"]


# -- order of what comes back: preempted units first, then background units -----------------


def test_preempted_units_come_back_before_background_units_are_started() -> None:
    """bg-new (50) is more urgent than the preempted vlm (90), yet vlm comes back first."""
    sim = Sim(1, [VLM, VOICE])
    sim.boot()
    sim.settle()
    sim.start(VO)
    sim.settle()
    assert brief(sim.annotate([VLM, VOICE, spec("bg-new", 50, BG)])) == []
    assert brief(sim.exit(VO)) == [f"start {V}"]
    sim.settle()
    assert brief(sim.exit(V)) == ["start bg-new.service"]


def test_a_waiter_that_cannot_run_yet_keeps_its_gpu_from_an_equally_urgent_preempted_unit() -> None:
    """Waiters before preempted units of their own priority, with no backfill: w (50, two GPUs
    of 20 GiB) cannot run while a foreign process takes 10 GiB of GPU 1, and keeps GPU 0 from
    p (50, background, which avoids GPU 1's foreign process): once p ran there, w could not
    preempt it (equal priority never preempts). Found by the ladder's property test."""
    w, p = spec("w", 50, gpus=2, mem_gib=20), spec("p", 50, BG)
    busy = sized(1, foreign=10 * GIB, foreign_pids=(7,))
    s = Scheduler([sized(0), busy], {w.name: w, p.name: p}, yield_to_foreign=True)
    s.load(SavedState(preempted={p.name: 1}))
    assert brief(s.request(w)) == []
    assert p.name in s.preempted  # not restarted onto the GPU kept for w
    assert brief(s.set_gpus([sized(0), sized(1)])) == ["grant w.service 0,1"]
    assert brief(s.inactive(w.name, Outcome.EXITED)) == ["start p.service"]


def test_a_preempted_unit_more_urgent_than_a_waiter_comes_back_before_it_is_granted() -> None:
    """Seed 000's ping-pong: nightly (50), preempted for voice (10), and w (70), which
    started while voice ran and waited. When voice ended, w was granted GPU 0 and nightly
    restarted in the same pass, whose gate then stopped w: a start of w's made only to be
    stopped (and restarted later, Requeue=yes). Now nightly comes back and w waits on."""
    nightly, w = spec("nightly", 50), spec("w", 70)
    sim = Sim(1, [nightly, VOICE, w])
    sim.start(nightly.name)
    sim.start(VO)
    sim.settle()
    assert brief(sim.start(w.name)) == []
    assert brief(sim.exit(VO)) == [f"start {nightly.name}"]
    assert brief(sim.settle()) == [f"grant {nightly.name} 0"]
    assert sim.sched.waiting_units() == [w.name]
    assert brief(sim.exit(nightly.name)) == [f"grant {w.name} 0"]
    assert not any(r.victim == w.name for r in sim.stops)


def _p_comes_back(other: UnitSpec, *, waits: bool = True) -> tuple[Scheduler, UnitSpec, UnitSpec]:
    """p (20, two GPUs), preempted, comes back to preempt bg (95, GPU 1) once u (10, GPU 0)
    ends; `other` is known, and waits (asked before u ends) unless `waits` is false.
    Returns the scheduler, p and bg."""
    p, bg = spec("p", 20, gpus=2), spec("bg", 95, BG, devices=("1",))
    s = Scheduler(range(2), {p.name: p, other.name: other, bg.name: bg})
    s.load(SavedState(preempted={p.name: 1}))
    s.request(spec("u", 10, devices=("0",)))
    s.request(bg)
    if waits:
        assert brief(s.request(other)) == []  # u (more urgent) holds GPU 0
    assert brief(s.inactive("u.service", Outcome.EXITED)) == [f"start {p.name}"]
    return s, p, bg


def test_a_comeback_that_must_preempt_keeps_its_gpus_from_later_waiters_of_the_pass() -> None:
    """p (20, two GPUs) comes back preempting bg (95, GPU 1) once u (10, GPU 0) ends; w (50,
    two GPUs), served after it in that pass, was given GPU 0 and bg's stop, and p's gate then
    preempted w in turn."""
    w = spec("w", 50, gpus=2)
    s, _, bg = _p_comes_back(w)
    assert s.phase(bg.name) is Phase.RUNNING  # p's gate preempts it, not w
    assert s.waiting_units() == [w.name]


def test_a_comeback_that_must_preempt_keeps_its_gpus_until_its_gate_asks() -> None:
    """As above, w (50) on GPU 0 alone: a pass between p's start and its gate's call (any
    event) granted w GPU 0, and p's gate then stopped w: the ping-pong, one pass later."""
    w = spec("w", 50, devices=("0",))
    s, p, bg = _p_comes_back(w)
    assert brief(s.schedule()) == []  # w still waits
    assert brief(s.request(p)) == ["stop bg.service"]
    assert s.phase(w.name) is None and s.waiting_units() == [w.name, p.name]
    assert brief(s.inactive(bg.name, Outcome.STOPPED)) == [f"grant {p.name} 0,1"]


def test_a_comeback_that_must_preempt_whose_start_failed_keeps_no_gpus() -> None:
    """As above, p's start failed before its gate asked: nothing comes to ask for the GPUs
    kept for it, so w (50) is granted GPU 0 at once instead of waiting on for p."""
    w = spec("w", 50, devices=("0",))
    s, p, _ = _p_comes_back(w)
    assert brief(s.inactive(p.name, Outcome.FAILED)) == [f"grant {w.name} 0"]


def test_a_comeback_that_must_preempt_seen_running_past_its_gate_keeps_no_gpus() -> None:
    """As above, systemd shows p running past its gate without a grant (found so, its
    GPUs unknown): it holds what it runs on, and no place is kept for a gate that will not
    ask, so w (50) is granted GPU 0 at once."""
    w = spec("w", 50, devices=("0",))
    s, p, _ = _p_comes_back(w)
    assert brief(s.running(p.name)) == [f"grant {w.name} 0"]


def test_a_place_kept_is_lost_to_a_comeback_that_must_preempt_before_its_gate_asks() -> None:
    """w's place on GPU 0 was kept while top (5) held GPU 1 and p (20, two GPUs) could not
    come back; once top ended p came back naming w's place, and w's gate, asking first, was
    granted it, to be stopped by p's gate a moment later. Nothing of w ran: it waits."""
    p, w = spec("p", 20, gpus=2), spec("w", 50, devices=("0",))
    top = spec("top", 5, devices=("1",))
    s = Scheduler(range(2), {p.name: p, w.name: w, top.name: top})
    s.request(p)
    assert brief(s.request(top)) == [f"stop {p.name}"]
    s.announce(w)
    assert brief(s.inactive(p.name, Outcome.STOPPED)) == [f"grant {top.name} 1"]
    assert s.phase(w.name) is Phase.STARTING  # its place kept
    assert brief(s.inactive(top.name, Outcome.EXITED)) == [f"start {p.name}"]
    assert brief(s.request(w)) == []
    assert brief(s.request(p)) == [f"grant {p.name} 0,1"]


def test_a_comeback_that_must_preempt_is_known_since_its_start_for_the_thrash_rule() -> None:
    """p (20) comes back preempting bg on GPU 0; before its gate asks, z (10) takes GPU 0
    and w (50), on GPU 1, is granted knowing that gpuslice started p. Counted known only
    from its gate's call, p stopped w a moment after its grant; w is protected as from any
    start known when it was granted."""
    p, x, bg = spec("p", 20), spec("x", 90, devices=("1",)), spec("bg", 95, BG, devices=("0",))
    z, w = spec("z", 10, devices=("0",)), spec("w", 50, devices=("1",))
    s = Scheduler(range(2), {n.name: n for n in (p, x, bg, z, w)})
    running: dict[str, tuple[tuple[int, ...], str, int, str]] = {
        bg.name: ((0,), "running", 1, ""),
        x.name: ((1,), "running", 2, ""),
    }
    s.load(SavedState(holders=running, preempted={p.name: 3}, seq=3))
    assert brief(s.schedule()) == [f"start {p.name}"]
    assert brief(s.request(z)) == [f"stop {bg.name}"]
    assert brief(s.inactive(bg.name, Outcome.STOPPED)) == [f"grant {z.name} 0"]
    assert brief(s.request(w)) == [f"stop {x.name}"]
    assert brief(s.inactive(x.name, Outcome.STOPPED)) == [f"grant {w.name} 1"]
    assert brief(s.request(p)) == []
    assert s.phase(w.name) is Phase.RUNNING and s.waiting_units() == [p.name]


def test_a_comeback_keeps_its_gpus_when_one_started_before_it_runs_past_its_gate() -> None:
    """p (20) and q (30) come back in one pass, p naming GPUs 2-3, q GPUs 0-1, each to
    preempt background units; w (50) waits for GPU 0. p seen running past its gate keeps no
    place, but q's gate still will ask: w waits on, and b0 is not stopped for it."""
    p, q, w = spec("p", 20, gpus=2), spec("q", 30, gpus=2), spec("w", 50, devices=("0",))
    bgs = [spec(f"b{i}", 95, BG, devices=(str(i),)) for i in range(4)]
    s = Scheduler(range(4), {n.name: n for n in (p, q, w, *bgs)})
    running: dict[str, tuple[tuple[int, ...], str, int, str]] = {
        n.name: ((i,), "running", i + 1, "") for i, n in enumerate(bgs)
    }
    s.load(SavedState(holders=running, preempted={p.name: 5, q.name: 6}, seq=6))
    assert brief(s.schedule()) == [f"start {p.name}", f"start {q.name}"]
    assert brief(s.request(w)) == []
    assert brief(s.running(p.name)) == []
    assert s.waiting_units() == [w.name]


def test_a_comeback_keeps_its_gpus_from_units_less_urgent_than_its_priority_now() -> None:
    """As above, p (20) came back naming GPUs 0-1 and w (50) waits for GPU 0; a reload
    before p's gate asks makes p 60: w is more urgent now and is granted GPU 0; made 40, p
    still keeps it from w."""
    w = spec("w", 50, devices=("0",))
    for now, granted in ((60, [f"grant {w.name} 0"]), (40, [])):
        s, p, bg = _p_comes_back(w)
        reloaded = {p.name: spec("p", now, gpus=2), w.name: w, bg.name: bg}
        assert brief(s.set_specs(reloaded)) == granted


def test_a_comeback_whose_annotation_goes_before_its_gate_asks_keeps_no_gpus() -> None:
    """As above, p's annotation goes before its gate asks: gpuslice starts no unannotated
    unit, so p's start is stopped and w (50) is granted GPU 0 at once."""
    w = spec("w", 50, devices=("0",))
    s, p, bg = _p_comes_back(w)
    reloaded = {w.name: w, bg.name: bg}
    assert brief(s.set_specs(reloaded)) == [f"stop {p.name}", f"grant {w.name} 0"]
    assert brief(s.inactive(p.name, Outcome.STOPPED)) == []


def test_a_comeback_keeps_nothing_from_a_more_urgent_waiter() -> None:
    """The GPUs a comeback that must preempt will ask for bind only the less urgent."""
    top = spec("top", 5, devices=("0",))
    s, _, _ = _p_comes_back(top, waits=False)
    assert brief(s.request(top)) == [f"grant {top.name} 0"]


def test_preempted_units_come_back_by_priority_then_the_one_preempted_first() -> None:
    """The state file lists them in any order: priority, then when it was preempted, decide."""
    specs = [spec("late", 50), spec("early", 50), spec("low", 60), spec("top", 10)]
    sched = Scheduler(range(1), {s.name: s for s in specs})
    sched.load(SavedState(preempted={"low.service": 1, "late.service": 9, "early.service": 4}))
    assert brief(sched.schedule()) == ["start early.service"]
    assert brief(sched.request(specs[1])) == ["grant early.service 0"]
    assert brief(sched.inactive("early.service", Outcome.EXITED)) == ["start late.service"]
    sched.request(specs[0])
    assert brief(sched.inactive("late.service", Outcome.EXITED)) == ["start low.service"]


def test_background_units_start_by_priority_then_the_one_out_longest() -> None:
    """x and y (same priority) both ran and finished, y first; at the next boot y starts
    first though x comes first in the annotations."""
    x, y = spec("x", 50, BG), spec("y", 50, BG)
    sim = Sim(1, [x, y, spec("z", 60, BG)])
    assert brief(sim.boot()) == ["start x.service"]  # never out: in annotation order
    sim.settle()
    assert brief(sim.exit("x.service")) == ["start y.service"]
    sim.settle()
    sim.start("x.service")  # waits behind y (equal priority)
    assert brief(sim.exit("y.service")) == ["grant x.service 0"]
    assert brief(sim.exit("x.service")) == ["start z.service"]  # x and y are finished
    sim.settle()
    sim.exit("z.service")
    assert brief(sim.new_boot()) == ["start y.service"]  # out since before x
    sim.settle()
    assert brief(sim.exit("y.service")) == ["start x.service"]
    sim.settle()
    assert brief(sim.exit("x.service")) == ["start z.service"]


def test_a_background_unit_never_out_starts_before_one_that_was() -> None:
    sim = Sim(1, [spec("a", 50, BG), spec("job", 10)])
    sim.boot()
    sim.settle()
    sim.exit("a.service")  # finished
    sim.start("job.service")
    sim.annotate([spec("a", 50, BG), spec("b", 50, BG), spec("job", 10)])  # GPU busy
    sim.finished.clear()  # the host rebooted meanwhile, as far as the core knows
    sim.sched.forget_boot()
    assert brief(sim.exit("job.service")) == ["start b.service"]


def test_new_boot_forgets_finished_and_failed_units_not_held_or_preempted() -> None:
    specs = [
        spec("done", 50, BG),
        spec("broke", 50, BG),
        spec("held", 50, BG),
        spec("pre", 50, BG, requeue=False),
    ]
    sched = Scheduler(range(4), {s.name: s for s in specs})
    sched.load(
        SavedState(
            preempted={"pre.service": 3},
            held=["held.service"],
            finished=["done.service"],
            failed=["broke.service"],
        )
    )
    assert brief(sched.schedule()) == []
    sched.forget_boot()
    assert brief(sched.schedule()) == ["start done.service", "start broke.service"]
    snap = sched.snapshot()
    assert (snap.held, snap.finished, snap.failed) == (["held.service"], [], [])
    assert snap.preempted == [("pre.service", 50, False)]


def test_a_start_request_clears_held_finished_failed_and_preempted() -> None:
    specs = [spec("a", 50, BG), spec("b", 50, BG), spec("c", 50, BG), spec("d", 50, BG)]
    sched = Scheduler(range(4), {s.name: s for s in specs})
    sched.load(
        SavedState(
            preempted={"d.service": 3},
            held=["a.service"],
            finished=["b.service"],
            failed=["c.service"],
        )
    )
    for s in specs:
        sched.request(s)
    snap = sched.snapshot()
    assert (snap.held, snap.finished, snap.failed, snap.preempted) == ([], [], [], [])
    assert sorted(sched.holders) == [s.name for s in specs]


def test_for_instance_names_the_instance_and_keeps_the_rest() -> None:
    template = spec("train@", 40, BG, gpus=2, requeue=False)
    assert template.for_instance("train@a.service") == UnitSpec("train@a.service", 40, BG, 2, False)


def test_a_unit_counted_on_no_gpu_releases_no_gpu() -> None:
    sim = Sim(1, [VOICE])
    sim.start(VO)
    sim.annotate([VOICE, spec("late", 50)])
    assert words(sim.sched.running("late.service")) == [
        "late.service (priority 50) is running without enough free GPUs to account for it; "
        "counting it on none"
    ]
    sim.running["late.service"] = ()
    assert words(sim.exit("late.service")) == ["late.service finished: released no GPU"]


def test_templates_are_never_started_as_background_units() -> None:
    sim = Sim(1, [spec("train@", 40, BG), spec("bg", 50, BG)])
    assert brief(sim.boot()) == ["start bg.service"]


def test_shutdown_releases_without_holding() -> None:
    sim = Sim(1, [VLM])
    sim.boot()
    sim.settle()
    assert words(sim.sched.inactive(V, Outcome.SHUTDOWN))[0] == (
        "vlm-analysis.service stopped for shutdown: released GPU 0"
    )
    snap = sim.sched.snapshot()
    assert (snap.held, snap.finished, snap.failed) == ([], [], [])


def test_what_the_adapters_ask_the_scheduler() -> None:
    """The queries the controller, inventory and status use, on a busy host."""
    sim = Sim(2, [VLM, VOICE, spec("late", 95)])
    sched = sim.sched
    assert not sched.has_work()
    sim.boot()
    assert sched.has_work() and sched.phase(V) is Phase.STARTING
    sim.settle()
    sim.start(VO)
    sim.start("late.service")
    assert (sched.phase(V), sched.phase(VO), sched.phase("late.service")) == (
        Phase.RUNNING,
        Phase.RUNNING,
        None,
    )
    assert sched.is_waiting("late.service") and not sched.is_waiting(VO)
    assert sched.grants() == {V: frozenset({0}), VO: frozenset({1})}
    assert sched.declared_memory() == {}
    assert sched.device(1) == Gpu(1) and sched.device(7) == Gpu(7)
    sched.learn(spec("train@a", 30))
    sched.learn(spec("vlm-analysis", 5))  # known already: kept as it is
    assert sched.specs["train@a.service"].priority == 30 and sched.specs[V].priority == 90
    sim.stop("late.service")
    sim.exit(VO)
    sim.exit(V)
    assert not sched.has_work()
    sched.preempted["x.service"] = 1
    assert sched.has_work()


def test_declared_memory_lists_holders_with_memory() -> None:
    sched = Scheduler([Gpu(0, total=24 << 30)], {})
    sched.request(spec("a", 10, mem_gib=4))
    sched.request(spec("b", 10, mem_gib=2))
    assert sched.declared_memory() == {"a.service": 4 << 30, "b.service": 2 << 30}


def test_snapshot_and_save_exactly() -> None:
    specs = [spec("a", 90, BG), spec("b", 20), spec("w1", 30), spec("w2", 25), spec("gone", 40)]
    sim = Sim(2, specs)
    sim.boot()
    sim.settle()  # a on GPU 0
    sim.start("b.service")  # GPU 1
    sim.start("w1.service")  # preempts a
    sim.start("w2.service")
    snap = sim.sched.snapshot()
    assert snap.gpus == {0: [("a.service", 90, "stopping")], 1: [("b.service", 20, "running")]}
    assert [(n, p) for n, p, _ in snap.waiting] == [("w1.service", 30), ("w2.service", 25)][::-1]
    saved = sim.sched.save()
    assert saved.holders["a.service"][::3] == ((0,), "w1.service")
    assert saved.holders["b.service"][3] == "" and saved.seq == sim.sched._seq > 0
    sim.finish_stop("a.service")
    sched = Scheduler(range(2), {s.name: s for s in specs})
    saved = SavedState(preempted={"gone.service": 1, "old.service": 2, "a.service": 3})
    forgotten = sched.load(saved)
    assert sched.snapshot().preempted == [("gone.service", 40, True), ("a.service", 90, True)]
    # old.service is no longer annotated: forgotten, said once (never shown at priority 1000)
    assert [a.decision.unit for a in forgotten if a.decision] == ["old.service"]


def test_journal_levels() -> None:
    sim = Sim([Gpu(0), Gpu(1)], [VLM, spec("huge", 10, gpus=3), VOICE, spec("late", 50)])
    assert [a for a in sim.boot() if isinstance(a, Log)] == []
    sim.settle()
    acts = sim.start("huge.service") + sim.exit(V, Outcome.FAILED)
    acts += sim.sample([Gpu(0, lost=True), Gpu(1)])
    sim.start(VO)
    sim.annotate([VLM, spec("huge", 10, gpus=3), VOICE, spec("late", 50)])
    acts += sim.sched.running("late.service")
    got = [(a.level, a.message.split(" ")[0]) for a in acts if isinstance(a, Log)]
    assert ("warning", "huge.service") in got and ("warning", V) in got
    assert ("error", "GPU") in got


def test_gpus_kept_for_a_unit_told_to_wait_are_said_and_its_gate_is_answered() -> None:
    s = Scheduler([Gpu(0)], {})
    s.request(spec("a", 10))
    told = s.announce(spec("c", 60))
    assert next(a for a in told if isinstance(a, Log)).message.startswith("c.service waiting")
    s.announce(spec("b", 50))
    freed = s.inactive("a.service", Outcome.EXITED)
    said = [a.message for a in freed if isinstance(a, Log)]
    assert "keeping GPU 0 for b.service (priority 50): it starts when its gate asks" in said
    assert brief(s.request(spec("b", 50))) == ["grant b.service 0"]


def test_a_kept_place_asked_for_in_the_turn_a_more_urgent_start_is_seen_goes_to_it() -> None:
    """The controller takes in a turn's signals before deciding: a background unit's gate
    asks for its kept place in the turn an urgent start is seen. Granting it would let the
    thrash rule keep the urgent unit waiting behind it (seen in CI: a start lost)."""
    vlm, quick = spec("vlm", 90, BG), spec("quick", 10)
    s = Scheduler([Gpu(0)], {vlm.name: vlm})
    assert brief(s.schedule()) == ["start vlm.service"]  # kept for vlm until its gate asks
    with s.deferred():
        s.announce(quick)
        assert brief(s.request(vlm)) == []  # not past quick, seen first
    assert brief(s.schedule()) == []  # GPU 0 kept for quick; vlm waits at its gate
    assert brief(s.request(quick)) == ["grant quick.service 0"]
    assert brief(s.inactive("quick.service", Outcome.EXITED)) == ["grant vlm.service 0"]


def test_a_unit_adopted_while_a_request_waits_was_not_granted_and_may_be_preempted() -> None:
    """The thrash rule protects what this controller granted knowing of the waiter, not a
    unit it found running (annotated while it ran, or after a restart)."""
    w, x = spec("w", 10, gpus=2), spec("x", 50)
    s = Scheduler([Gpu(0), Gpu(1)], {x.name: x})
    s.request(spec("e", 10))  # GPU 0
    assert brief(s.request(w)) == []  # needs both GPUs; e is as urgent
    s.running("x.service")  # found running: counted on the free GPU 1
    assert brief(s.inactive("e.service", Outcome.EXITED)) == ["stop x.service"]


# -- what the mutation run of 2026-12-01 (second session) found untested --------------------


def test_the_thrash_rule_is_said_for_a_whole_gpu_holder() -> None:
    """A background waiter could not use GPU 0 (a foreign process) when b was granted it;
    once the process has gone, b keeps it and the reason says why, in words and as data."""
    a, b = spec("a", 10, BG), spec("b", 50)
    s = Scheduler([sized(0, foreign_pids=(7,)), sized(1)], {})
    s.request(spec("e", 5, devices=("1",)))  # GPU 1, more urgent than a
    assert brief(s.request(a)) == []
    assert brief(s.request(b)) == ["grant b.service 0"]
    assert brief(s.set_gpus([sized(0), sized(1)])) == []
    part = s.snapshot().reasons["a.service"].parts[0]
    assert (part.kind, part.unit, part.granted_after) == (Blocker.HELD, "b.service", True)
    assert (
        s.snapshot()
        .waiting[0][2]
        .startswith(
            "waiting: GPU 0 held by b.service, priority 50 (granted while this unit was known"
        )
    )


def test_a_reason_names_the_most_urgent_of_a_gpus_holders_and_the_first_among_equals() -> None:
    x, y, z = spec("x", 20, mem_gib=8), spec("y", 60, mem_gib=8), spec("z", 20, mem_gib=4)
    s = Scheduler([sized(0)], {})
    for unit in (x, y, z):
        s.request(unit)
    s.request(spec("w", 70, mem_gib=20))
    assert s.snapshot().waiting[0][2] == (
        "waiting: needs 20 GiB on one GPU; GPU 0 has 4 GiB free after the reserve, "
        "held by x.service, priority 20"
    )


def test_a_background_instance_seen_running_is_refilled_like_any_background_unit() -> None:
    """Only learnt (a signal of it down), it is dormant: nobody started it, and its name is
    one job, maybe one that finished and was forgotten. Seen running, someone did: ended
    with no record of how, refill starts it again as any background unit."""
    s = Scheduler([Gpu(0)], {})
    s.learn(spec("worker@1", 90, BG))
    assert brief(s.schedule()) == []
    assert brief(s.running("worker@1.service")) == []
    assert brief(s.inactive("worker@1.service", Outcome.SHUTDOWN)) == ["start worker@1.service"]


def test_a_start_announced_again_changes_nothing() -> None:
    a, b = spec("a", 50), spec("b", 50)
    s = Scheduler([Gpu(0)], {})
    s.request(spec("e", 50))
    s.announce(a)
    s.announce(b)
    assert s.announce(a) == []  # still the first of its priority
    assert brief(s.inactive("e.service", Outcome.EXITED)) == []  # kept for a, silently
    assert s.phase("a.service") is Phase.STARTING and s.is_waiting("b.service")
    assert s.announce(a) == []  # a holder's start job: nothing new
    assert s.phase("a.service") is Phase.STARTING


def test_a_gate_asking_keeps_its_place_in_the_queue() -> None:
    """Announced first, a asks after b: it is still served first among equals."""
    a, b = spec("a", 50), spec("b", 50)
    s = Scheduler([Gpu(0)], {})
    s.request(spec("e", 50))
    s.announce(a)
    s.announce(b)
    s.request(b)
    s.request(a)
    assert brief(s.inactive("e.service", Outcome.EXITED)) == ["grant a.service 0"]


def test_gpus_kept_for_a_unit_never_told_to_wait_are_kept_silently() -> None:
    s = Scheduler([Gpu(0)], {})
    assert s.announce(spec("a", 50)) == []
    assert brief(s.request(spec("a", 50))) == ["grant a.service 0"]


def test_a_gate_asking_while_its_unit_is_stopped_for_another_waits_for_the_stop() -> None:
    """Its start job outran gpuslice's stop job: nothing is granted; a hold is forgotten."""
    low = spec("low", 90)
    s = Scheduler([Gpu(0)], {})
    s.request(low)
    s.request(spec("urgent", 10))  # low is asked to stop
    assert s.phase("low.service") is Phase.STOPPING
    assert s.request(low) == []
    assert s.phase("low.service") is Phase.STOPPING


# -- requeue_at_gate: a preempted unit waits at its gate ---------------------------------------

QUEUED = (
    "restarting preempted vlm-analysis.service (priority 90): it waits at its gate for more "
    "urgent units"
)


def _codes(actions: list[Action]) -> list[str]:
    """The decisions of every action, as their codes' values."""
    return [a.decision.code.value for a in actions if a.decision is not None]


def _preempted_at_gate() -> Sim:
    """vlm ran, voice preempted it; vlm was restarted at once and now asks at its gate."""
    sim = Sim(1, [VLM, VOICE], requeue_at_gate=True)
    sim.boot()
    sim.settle()
    sim.start(VO)
    assert words(sim.settle()) == [
        "starting voice-pipeline.service (priority 10) on GPU 0",
        QUEUED,
        "vlm-analysis.service waiting: GPU 0 held by voice-pipeline.service, priority 10",
    ]
    return sim


def test_with_requeue_at_gate_a_preempted_unit_comes_back_by_a_grant() -> None:
    """Its gate already runs when the GPU frees: it comes back without a start job."""
    sim = _preempted_at_gate()
    assert sim.sched.waiting_units() == [V]
    assert sim.sched.snapshot().preempted == []
    assert words(sim.exit(VO)) == [
        "voice-pipeline.service finished: released GPU 0",
        "starting vlm-analysis.service (priority 90) on GPU 0",
    ]
    sim.check_quiet()


def test_without_requeue_at_gate_a_preempted_unit_is_restarted_once_its_gpus_are_free() -> None:
    sim = Sim(1, [VLM, VOICE])
    sim.boot()
    sim.settle()
    sim.start(VO)
    assert brief(sim.settle()) == [f"grant {VO} 0"]
    assert brief(sim.exit(VO)) == [f"start {V}"]


def test_a_reload_turns_requeue_at_gate_on_for_the_next_preemption() -> None:
    """set_policy (config.yaml reloaded) changes how the next preemption is brought back."""
    sim = Sim(1, [VLM, VOICE])
    sim.sched.set_policy(yield_to_foreign=True, requeue_at_gate=True)
    sim.boot()
    sim.settle()
    sim.start(VO)
    assert QUEUED in words(sim.settle())
    assert sim.sched.waiting_units() == [V]
    sim.sched.set_policy(yield_to_foreign=True, requeue_at_gate=False)
    assert sim.sched.requeue_at_gate is False


def test_annotated_names_the_units_with_a_spec_in_force() -> None:
    sched = Scheduler([0], {V: VLM, VO: VOICE})
    assert sched.annotated() == {V, VO}
    sched.set_specs({VO: VOICE})
    assert sched.annotated() == {VO}


def test_a_requeue_whose_wait_at_the_gate_fails_comes_back_once_its_gpus_are_free() -> None:
    """A TimeoutStartSec= of the admin's ended the wait: it never ran, so it is still owed a
    comeback, the other way (and not queued at its gate again, or it would time out again)."""
    sched = _preempted_at_gate().sched
    acts = sched.inactive(V, Outcome.FAILED)
    assert _codes(acts) == ["cancelled", "requeue-failed"]
    assert words(acts)[-1] == (
        "vlm-analysis.service (priority 90) failed while it waited at its gate to come back "
        "from a preemption: it is restarted when its GPUs are free"
    )
    assert sched.snapshot().preempted == [(V, 90, True)]
    assert sched.schedule() == []  # the GPU is still taken: not queued at its gate again
    back = sched.inactive(VO, Outcome.EXITED)
    assert brief(back) == [f"start {V}"]
    assert words(back)[-1] == "restarting preempted vlm-analysis.service (priority 90) on GPU 0"


def test_a_requeue_stopped_by_hand_while_it_waits_at_its_gate_is_held() -> None:
    sim = _preempted_at_gate()
    assert words(sim.stop(V))[-1] == (
        "vlm-analysis.service was stopped outside gpuslice: held until started again"
    )
    assert brief(sim.exit(VO)) == []


def test_a_requeue_that_fails_after_its_grant_is_a_failure_like_any_other() -> None:
    sim = _preempted_at_gate()
    sim.exit(VO)
    assert words(sim.exit(V, Outcome.FAILED))[-1] == (
        "vlm-analysis.service failed: gpuslice will not start it by itself "
        "(its own Restart= policy applies)"
    )
    assert sim.sched.snapshot().preempted == []
    assert brief(sim.sched.schedule()) == []


def test_a_requeue_that_fails_before_its_gate_asks_comes_back_once_its_gpus_are_free() -> None:
    """Its start failed before the gate ran (a dependency): the same as a failed wait."""
    sched = Scheduler([0], {V: VLM, VO: VOICE}, requeue_at_gate=True)
    assert brief(sched.schedule()) == [f"start {V}"]
    assert brief(sched.request(VLM)) == [f"grant {V} 0"]
    assert brief(sched.request(VOICE)) == [f"stop {V}"]
    assert brief(sched.inactive(V, Outcome.STOPPED)) == [f"grant {VO} 0", f"start {V}"]
    acts = sched.inactive(V, Outcome.FAILED)
    assert _codes(acts) == ["requeue-failed"]
    assert sched.snapshot().preempted == [(V, 90, True)]
    assert brief(sched.inactive(VO, Outcome.EXITED)) == [f"start {V}"]


def test_a_place_kept_on_a_gpu_a_reload_tells_it_to_avoid_is_not_given_at_its_gate() -> None:
    """A background unit was started onto GPU 0, where a process gpuslice does not manage
    runs, before a reload turned `yield_to_foreign` on; its gate asks before the reload's
    pass: it is not granted GPU 0, and waits saying why."""
    sched = Scheduler([0], {V: VLM})
    sched.set_policy(yield_to_foreign=False, requeue_at_gate=False)
    assert brief(sched.schedule()) == [f"start {V}"]
    assert brief(sched.set_gpus([Gpu(0, foreign_pids=(4242,))])) == []
    sched.set_policy(yield_to_foreign=True, requeue_at_gate=False)
    acts = sched.request(VLM)
    assert brief(acts) == [] and sched.is_waiting(V)
    assert "only 0 of this host's GPUs may run it" in words(acts)[0]


def test_a_place_kept_on_a_gpu_that_is_gone_is_not_given_at_its_gate() -> None:
    """Two background units started onto GPUs 0 and 1; GPU 1 leaves the host's list (a
    reload to `gpus: 1`) before vlm's gate asks: it waits for GPU 0."""
    w = spec("w", 80, BG)
    sched = Scheduler([0, 1], {V: VLM, w.name: w})
    assert brief(sched.schedule()) == ["start w.service", f"start {V}"]
    assert sched.grants()[V] == frozenset({1})
    assert brief(sched.set_gpus([Gpu(0)])) == []
    acts = sched.request(VLM)
    assert brief(acts) == [] and sched.is_waiting(V)
    assert words(acts) == [f"{V} waiting: GPU 0 held by w.service, priority 80"]


def test_a_failed_wait_is_forgotten_once_the_unit_runs_again() -> None:
    """After its wait failed, the unit came back by a plain start and ran: preempted once
    more, it waits at its gate again."""
    sched = Scheduler([0], {V: VLM, VO: VOICE}, requeue_at_gate=True)
    sched.schedule()
    sched.request(VLM)
    sched.request(VOICE)
    assert brief(sched.inactive(V, Outcome.STOPPED)) == [f"grant {VO} 0", f"start {V}"]
    assert _codes(sched.inactive(V, Outcome.FAILED)) == ["requeue-failed"]
    assert brief(sched.inactive(VO, Outcome.EXITED)) == [f"start {V}"]
    assert brief(sched.request(VLM)) == [f"grant {V} 0"]
    assert brief(sched.request(VOICE)) == [f"stop {V}"]
    assert brief(sched.inactive(V, Outcome.STOPPED)) == [f"grant {VO} 0", f"start {V}"]


def test_a_comeback_its_condition_skips_is_said_skipped_and_never_started_again() -> None:
    """A comeback systemd skipped (a `Condition*=` of the unit unmet: nothing of it ran,
    systemd leaves it inactive): not a wait that failed (`requeue-failed`, started again
    once its GPUs are free, skipped again while the condition is false), nor finished. It
    is failed, in the words of a skip, and not started again, also once its GPUs are free."""
    sched = Scheduler([0], {V: VLM, VO: VOICE}, requeue_at_gate=True)
    sched.schedule()
    sched.request(VLM)
    sched.request(VOICE)
    assert brief(sched.inactive(V, Outcome.STOPPED)) == [f"grant {VO} 0", f"start {V}"]
    acts = sched.inactive(V, Outcome.SKIPPED)
    assert _codes(acts) == ["failed"]
    assert words(acts) == [
        f"{V} skipped: its Condition*= or ExecCondition= said no (systemd left it inactive, "
        "its job never ran); gpuslice will not start it by itself"
    ]
    assert sched.save().failed == [V] and not sched.save().preempted
    assert brief(sched.inactive(VO, Outcome.EXITED)) == []


def test_a_requeue_whose_wait_failed_loses_its_place_to_units_waiting_at_their_gates() -> None:
    """`first` comes back to its gate and its wait fails; `second`, preempted later, waits at
    its gate: a GPU that frees goes to `second`, and `first` is restarted at the next."""
    first, second = spec("first", 90, BG), spec("second", 90, BG)
    voice2 = spec("voice2", 10)
    specs = {s.name: s for s in (first, second, VOICE, voice2)}
    sched = Scheduler([0, 1], specs, requeue_at_gate=True)
    assert brief(sched.schedule()) == ["start first.service", "start second.service"]
    sched.request(first)
    sched.request(second)
    assert brief(sched.request(VOICE)) == ["stop second.service"]  # the one started last
    assert brief(sched.inactive("second.service", Outcome.STOPPED)) == [
        f"grant {VO} 1",
        "start second.service",
    ]
    sched.request(second)  # its gate asks: it waits for voice
    assert _codes(sched.inactive("second.service", Outcome.FAILED)) == [
        "cancelled",
        "requeue-failed",
    ]
    assert brief(sched.request(voice2)) == ["stop first.service"]
    # both preempted now, at one priority: `second` (out first) is not queued at its gate again
    assert brief(sched.inactive("first.service", Outcome.STOPPED)) == [
        "grant voice2.service 0",
        "start first.service",
    ]
    sched.request(first)
    assert brief(sched.inactive(VO, Outcome.EXITED)) == ["grant first.service 1"]
    assert brief(sched.inactive("voice2.service", Outcome.EXITED)) == ["start second.service"]


@pytest.mark.parametrize("asked", [False, True])
def test_a_requeue_and_its_failed_wait_outlive_a_controller_restart(asked: bool) -> None:
    """A controller restarts while a preempted unit waits at its gate (requeue_at_gate),
    its gate asking or not yet: its wait that fails then is its requeue's, not a failed job
    (forgotten, it was recorded failed and never brought back). Another restart keeps that
    its wait failed: it comes back once its GPUs are free, not to its gate again."""
    sched = Scheduler([0], {V: VLM, VO: VOICE}, requeue_at_gate=True)
    sched.schedule()
    sched.request(VLM)
    sched.request(VOICE)
    assert brief(sched.inactive(V, Outcome.STOPPED)) == [f"grant {VO} 0", f"start {V}"]
    if asked:
        assert brief(sched.request(VLM)) == []  # it waits for voice
    fresh = Scheduler([0], {V: VLM, VO: VOICE}, requeue_at_gate=True)
    fresh.load(sched.save())
    assert brief(fresh.request(VLM)) == []  # its gate asks the new controller
    assert _codes(fresh.inactive(V, Outcome.FAILED))[-1] == "requeue-failed"
    assert fresh.snapshot().preempted == [(V, 90, True)]
    again = Scheduler([0], {V: VLM, VO: VOICE}, requeue_at_gate=True)
    again.load(fresh.save())
    assert brief(again.schedule()) == []  # not queued at its gate again
    assert brief(again.inactive(VO, Outcome.EXITED)) == [f"start {V}"]


def test_a_requeue_at_its_gate_whose_annotation_goes_after_a_restart_is_withdrawn() -> None:
    """Its gate asked before the controller restarted: a waiter, which is not saved as a
    start of ours. Its annotation gone, it is still stopped, not let through ungated beside
    the unit it waited for."""
    sched = Scheduler([0], {V: VLM, VO: VOICE}, requeue_at_gate=True)
    sched.schedule()
    sched.request(VLM)
    sched.request(VOICE)
    assert brief(sched.inactive(V, Outcome.STOPPED)) == [f"grant {VO} 0", f"start {V}"]
    assert brief(sched.request(VLM)) == []
    fresh = Scheduler([0], {V: VLM, VO: VOICE}, requeue_at_gate=True)
    fresh.load(sched.save())
    assert brief(fresh.request(VLM)) == []
    assert brief(fresh.set_specs({VO: VOICE})) == [f"stop {V}"]


def test_a_unit_started_by_hand_after_its_requeue_ran_fails_as_its_own_start() -> None:
    """Brought back through its gate, it ran and finished; started again by a person, its
    wait fails: that failure is the person's start, and gpuslice does not restart it."""
    sched = Scheduler([0], {V: VLM, VO: VOICE}, requeue_at_gate=True)
    sched.schedule()
    sched.request(VLM)
    sched.request(VOICE)
    assert brief(sched.inactive(V, Outcome.STOPPED)) == [f"grant {VO} 0", f"start {V}"]
    sched.request(VLM)
    assert brief(sched.inactive(VO, Outcome.EXITED)) == [f"grant {V} 0"]
    sched.inactive(V, Outcome.EXITED)
    sched.request(VOICE)
    sched.request(VLM)  # by hand: it waits for voice
    assert _codes(sched.inactive(V, Outcome.FAILED)) == ["cancelled", "failed"]
    assert brief(sched.inactive(VO, Outcome.EXITED)) == []


# -- a start of ours lost with the controller --------------------------------------------------


def test_a_start_of_ours_that_a_restarted_controller_cannot_find_is_sent_again_once() -> None:
    """Saved before it was sent: after a restart, a refill or requeue systemd does not show
    is started again, keeping its place; a start announced by systemd is not (someone's)."""
    other = spec("other", 50)
    sched = Scheduler([0, 1], {V: VLM, "other.service": other})
    assert brief(sched.schedule()) == [f"start {V}"]
    sched.announce(other)  # a person's start job, its GPU kept for it (STARTING too)
    assert sched.phase("other.service") is Phase.STARTING
    saved = sched.save()
    assert saved.started == [V]
    again = Scheduler([0, 1], {V: VLM, "other.service": other})
    again.load(saved)
    lost = again.start_lost(V)
    assert brief(lost) == [f"start {V}"]
    assert words(lost) == [
        "starting vlm-analysis.service (priority 90) again: the start gpuslice decided on "
        "before the controller restarted is not in systemd's queue"
    ]
    assert again.phase(V) is Phase.STARTING  # its place is kept
    assert again.save().started == [V]  # still gpuslice's own start
    assert again.start_lost(V) == []  # once
    assert again.start_lost("other.service") == []
    assert again.start_lost("nobody.service") == []
    assert brief(again.request(VLM)) == [f"grant {V} 0"]


def test_a_start_of_ours_that_ended_is_not_taken_for_a_persons_start_after_it() -> None:
    """Our refill of V ended before its gate asked (a failed condition, say); a person's
    start of V, its GPU kept for it, is someone's: not saved as ours to send again."""
    sched = Scheduler([0], {V: VLM})
    assert brief(sched.schedule()) == [f"start {V}"]
    sched.inactive(V, Outcome.FAILED)
    sched.announce(VLM)
    assert sched.phase(V) is Phase.STARTING
    assert sched.save().started == []


def test_a_start_whose_gate_asked_is_no_longer_one_to_send_again() -> None:
    sched = Scheduler([0], {V: VLM})
    sched.schedule()
    sched.request(VLM)
    assert sched.save().started == []
    assert sched.start_lost(V) == []


# -- a start of ours that did not reach systemd (an error of the bus) ------------------------

LOW = spec("low", 90)
L = LOW.name
NO_REPLY = "Message recipient disconnected from message bus without replying (NoReply)"


def _low_requeued() -> Scheduler:
    """low.service was preempted by voice, which ended: low's requeue is on its way."""
    sched = Scheduler([0], {L: LOW, VO: VOICE})
    sched.request(LOW)
    assert brief(sched.request(VOICE)) == [f"stop {L}"]
    assert brief(sched.inactive(L, Outcome.STOPPED)) == [f"grant {VO} 0"]
    assert brief(sched.inactive(VO, Outcome.EXITED)) == [f"start {L}"]
    return sched


def test_a_requeue_that_did_not_reach_systemd_is_owed_again_and_sent_when_its_delay_ends() -> None:
    """A StartUnit that systemd never got (it was re-executing) was taken for a failure:
    the preempted unit was never brought back. It is preempted again, its GPU released, not
    started again until the adapter's delay is over; the journal says so once."""
    sched = _low_requeued()
    acts = sched.start_failed(L, NO_REPLY)
    assert _codes(acts) == ["start-retry"]
    assert words(acts) == [
        f"starting low.service (priority 90) did not reach systemd: {NO_REPLY}; it is started "
        "again in a moment, until systemd takes the start; GPU 0 released meanwhile"
    ]
    assert acts[0].level == "warning"  # type: ignore[union-attr]
    assert sched.phase(L) is None and sched.grants() == {}
    assert sched.snapshot().preempted == [(L, 90, True)] and sched.snapshot().failed == []
    assert sched.schedule() == []  # not at once: the bus may still fail it
    assert brief(sched.retry_start(L)) == [f"start {L}"]
    assert sched.retry_start(L) == []  # once per delay
    assert sched.start_failed(L, NO_REPLY) == []  # failed again: said once already
    assert brief(sched.retry_start(L)) == [f"start {L}"]
    assert brief(sched.request(LOW)) == [f"grant {L} 0"]  # it went through
    assert sched.start_retries == {}


def test_a_requeue_that_did_not_reach_systemd_then_went_down_is_said_again_at_its_failure() -> None:
    """low's comeback did not reach systemd (said), was sent again and reached it, then the
    host's shutdown, cancelled, ended it before its gate: the next comeback's failure to
    reach systemd is a new one, said again (and sent again at its delay's end). Kept past the
    down, the note of the last string of failures silenced it."""
    sched = _low_requeued()
    assert _codes(sched.start_failed(L, NO_REPLY)) == ["start-retry"]
    assert brief(sched.retry_start(L)) == [f"start {L}"]
    sched.set_shutting_down(True)
    sched.inactive(L, Outcome.FAILED, in_shutdown=True)
    assert sched.snapshot().preempted == [(L, 90, True)]
    assert brief(sched.set_shutting_down(False)) == [f"start {L}"]
    assert _codes(sched.start_failed(L, NO_REPLY)) == ["start-retry"]
    assert sched.schedule() == []
    assert brief(sched.retry_start(L)) == [f"start {L}"]


def test_a_refill_that_did_not_reach_systemd_is_idle_again_and_its_gpu_goes_to_others() -> None:
    other = spec("other", 95, BG)
    sched = Scheduler([0], {V: VLM, other.name: other})
    assert brief(sched.schedule()) == [f"start {V}"]
    acts = sched.start_failed(V, NO_REPLY)
    assert _codes(acts) == ["start-retry", "refill"]  # the GPU released, refilled at once
    assert brief(acts) == [f"start {other.name}"]
    assert sched.snapshot().preempted == [] and sched.snapshot().failed == []
    assert sched.retry_start(V) == []  # GPU 0 is taken now: nothing to send
    sched.request(other)
    assert brief(sched.inactive(other.name, Outcome.STOPPED)) == [f"start {V}"]


def test_a_start_no_longer_wanted_when_its_delay_ends_is_not_sent() -> None:
    """A more urgent unit took the GPU meanwhile; someone else started the unit; its
    annotation went: the delay's end sends nothing."""
    sched = _low_requeued()
    sched.start_failed(L, NO_REPLY)
    assert brief(sched.request(VOICE)) == [f"grant {VO} 0"]
    assert sched.retry_start(L) == []
    assert sched.snapshot().preempted == [(L, 90, True)]  # still owed: back once voice ends
    assert brief(sched.inactive(VO, Outcome.EXITED)) == [f"start {L}"]
    sched.start_failed(L, NO_REPLY)
    assert brief(sched.request(LOW)) == [f"grant {L} 0"]  # a person's start, let through
    assert sched.retry_start(L) == []
    gone = _low_requeued()
    gone.start_failed(L, NO_REPLY)
    gone.set_specs({VO: VOICE})
    assert gone.retry_start(L) == []


def test_a_start_that_reached_systemd_after_all_is_not_taken_back() -> None:
    """Its gate asked before the error came (the answer was lost, not the call), or the
    start is not one of ours: the error changes nothing."""
    sched = _low_requeued()
    sched.request(LOW)
    assert sched.start_failed(L, NO_REPLY) == []
    assert sched.phase(L) is Phase.RUNNING
    person = Scheduler([0], {VO: VOICE})
    person.announce(VOICE)
    assert person.start_failed(VO, NO_REPLY) == []
    assert person.phase(VO) is Phase.STARTING


def test_a_start_of_ours_moved_back_to_waiting_that_did_not_reach_systemd_waits_no_more() -> None:
    """Its place was taken back for a more urgent start: it waited for a gate that will
    never ask, keeping others behind it. Preempted again instead."""
    sched = _low_requeued()
    sched.announce(VOICE)  # the place kept for low goes to voice, low waits again
    assert sched.is_waiting(L)
    acts = sched.start_failed(L, NO_REPLY)
    assert words(acts)[0].endswith("until systemd takes the start")  # it held no GPU
    assert not sched.is_waiting(L)
    assert sched.snapshot().preempted == [(L, 90, True)]


def test_a_start_that_did_not_reach_systemd_is_saved_as_owed_not_as_sent() -> None:
    """Kept as started, a restarted controller took it for a start systemd had lost and
    sent it again at once; kept as a requeue, its end was taken for a requeue's. It is
    preempted again, after the units preempted before it."""
    sched = _low_requeued()
    before = sched.save().seq
    sched.start_failed(L, NO_REPLY)
    saved = sched.save()
    assert saved.started == [] and L not in sched.requeued
    assert saved.preempted[L] > before


def test_after_a_start_that_did_not_reach_systemd_a_persons_start_is_theirs() -> None:
    """Nothing of the start that failed stays on the unit: a person's start of it whose
    annotation goes while it waits is let through, not stopped as a withdrawn start of
    ours; one that fails at its gate failed, it was no requeue whose wait failed."""
    sched = _low_requeued()
    sched.start_failed(L, NO_REPLY)
    assert brief(sched.request(VOICE)) == [f"grant {VO} 0"]
    sched.request(LOW)  # someone starts it by hand: it waits behind voice
    assert "stop" not in " ".join(brief(sched.set_specs({VO: VOICE})))
    at_gate = Scheduler([0], {L: LOW, VO: VOICE}, requeue_at_gate=True)
    at_gate.request(LOW)
    at_gate.request(VOICE)
    assert brief(at_gate.inactive(L, Outcome.STOPPED)) == [f"grant {VO} 0", f"start {L}"]
    at_gate.start_failed(L, NO_REPLY)  # its requeue to wait at the gate
    at_gate.announce(LOW)
    assert _codes(at_gate.inactive(L, Outcome.FAILED)) == ["cancelled", "failed"]


def test_a_forgotten_instance_leaves_no_start_to_retry() -> None:
    """An instance is forgotten once nothing is owed to it: a delay kept for it was a
    record that outlived it, one per name."""
    job = spec("t@1", 50, requeue=False)  # on-demand: owed no comeback once out
    sched = Scheduler([0], {job.name: job})
    sched.load(SavedState(holders={job.name: ((0,), "starting", 1, "")}, seq=1, started=[job.name]))
    assert brief(sched.start_lost(job.name)) == [f"start {job.name}"]
    sched.start_failed(job.name, NO_REPLY)
    assert job.name in sched.start_retries
    assert sched.forget_instance(job.name)
    assert sched.start_retries == {}


def test_a_restarted_controller_does_not_wait_for_the_last_ones_delay() -> None:
    sched = _low_requeued()
    sched.start_failed(L, NO_REPLY)
    again = Scheduler([0], {L: LOW, VO: VOICE})
    again.load(sched.save())
    assert brief(again.schedule()) == [f"start {L}"]


def test_an_on_demand_instance_that_ended_is_forgotten_with_how_it_ended() -> None:
    """One name per job (`transcribe@REC.service`): kept, each would be saved and watched
    for ever. Finished, failed or stopped by hand, nothing of it is kept."""
    s = Scheduler([Gpu(0)], {})
    for name, outcome in (("t@1", Outcome.EXITED), ("t@2", Outcome.FAILED), ("t@3", None)):
        s.learn(spec(name, 50))
        s.request(spec(name, 50))
        s.inactive(f"{name}.service", outcome or Outcome.STOPPED, by_itself=outcome is not None)
        s.restart_overdue(f"{name}.service")  # failed: no restart seen in the controller's wait
        assert s.forget_instance(f"{name}.service")
    saved = s.save()
    assert (saved.finished, saved.failed, saved.held) == ([], [], [])
    assert s.annotated() == frozenset() and s.out_since == {}
    assert not s.forget_instance("t@1.service")  # not known now


@pytest.mark.parametrize("restarting", [True, False])
def test_a_failed_units_gpu_is_not_kept_for_its_restart_from_an_equal_unit_waiting_first(
    restarting: bool,
) -> None:
    """w waits for u's GPU (equal priority never preempts). u fails into its Restart= (or
    may: systemd 252's `failed` first): w came first, the restart is a new arrival, so w gets
    the GPU and the restart waits behind it. Kept, a unit that crash-loops with a RestartSec=
    under its start limit had it for ever, w waiting for ever. A less urgent waiter does not
    get it."""
    u, w, lo = spec("u", 50), spec("w", 50), spec("lo", 60)
    s = Scheduler([Gpu(0)], {})
    assert brief(s.request(u)) == ["grant u.service 0"]
    s.request(lo)
    s.request(w)
    down = s.inactive(u.name, Outcome.FAILED, by_itself=True, restarting=restarting)
    assert brief(down) == ["grant w.service 0"]
    assert not s.restart_kept
    assert brief(s.request(u)) == []
    assert list(s.waiters) == ["lo.service", "u.service"]
    # w fails in turn: u, as urgent and waiting, gets it; lo, less urgent, never did
    assert brief(s.inactive(w.name, Outcome.FAILED, by_itself=True)) == ["grant u.service 0"]


@pytest.mark.parametrize("restarting", [True, False])
def test_a_background_unit_kept_for_its_restart_is_not_stopped_for_a_foreign_process(
    restarting: bool,
) -> None:
    """bg failed, its GPU kept for its Restart=; a foreign process appears there. Nothing of
    it runs: no stop (it cancelled the restart, and its failure, taken for a yield, was
    started again by gpuslice, as if preempted). Its restart waits at its gate; none comes:
    failed, not started by gpuslice."""
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0)], {bg.name: bg})
    assert brief(s.schedule()) == ["start bg.service"]
    assert brief(s.request(bg)) == ["grant bg.service 0"]
    s.inactive(bg.name, Outcome.FAILED, by_itself=True, restarting=restarting)
    assert bg.name in s.restart_kept
    assert brief(s.set_gpus([sized(0, foreign_pids=(4242,))])) == []
    assert brief(s.restart_overdue(bg.name)) == []
    assert s.failed == {bg.name}
    assert s.preempted == {}
    assert brief(s.set_gpus([sized(0)])) == []


@pytest.mark.parametrize("restarting", [True, False])
def test_a_refilled_unit_whose_restart_does_not_come_gives_its_gpu(restarting: bool) -> None:
    """bg, started by refill (a start of gpuslice's), runs and fails; its GPU is kept for its
    Restart=, which does not start it. Once the controller's wait is over it is failed and
    the GPU goes to od. Taken for a refill still on its way (`started`), the keep was never
    released: the GPU held by a dead unit for ever, od waiting for ever; and a controller
    restarted meanwhile took it for a StartUnit of its own lost, and started it again."""
    bg, od = spec("bg", 90, BG), spec("od", 50)
    s = Scheduler([Gpu(0)], {bg.name: bg})
    assert brief(s.schedule()) == ["start bg.service"]
    assert brief(s.request(bg)) == ["grant bg.service 0"]
    s.inactive(bg.name, Outcome.FAILED, by_itself=True, restarting=restarting)
    assert bg.name in s.restart_kept
    restored = Scheduler([Gpu(0)], {bg.name: bg})
    restored.load(s.save())
    assert brief(restored.start_lost(bg.name)) == []  # Restore: down, no job
    s.restart_overdue(bg.name)
    assert s.failed == {bg.name}
    assert brief(s.request(od)) == ["grant od.service 0"]


def test_a_unit_whose_gpus_are_kept_for_its_restart_is_shown_restarting() -> None:
    """u fails into its Restart=, its GPUs kept for the restart. The snapshot showed it
    `starting`, a start on its way to its gate, where nothing of it runs: it is `restarting`,
    said as the journal says it. Its place taken by a more urgent start, it waits, and says
    why there; its restart granted, it runs."""
    u, v, lo = spec("u", 50, gpus=2), spec("v", 10, gpus=2), spec("lo", 60)
    s = Scheduler([Gpu(0), Gpu(1)], {})
    assert brief(s.request(u)) == ["grant u.service 0,1"]
    s.request(lo)
    s.inactive(u.name, Outcome.FAILED, by_itself=True, restarting=True)
    snap = s.snapshot()
    assert snap.gpus == {0: [("u.service", 50, "restarting")], 1: [("u.service", 50, "restarting")]}
    assert snap.restarting == {"u.service": "GPUs 0,1 kept for u.service's restart (its Restart=)"}
    assert s.restart_keeps() == snap.restarting
    assert brief(s.request(v)) == ["grant v.service 0,1"]
    assert s.snapshot().restarting == {}
    assert [name for name, _, _ in s.snapshot().waiting] == ["u.service", "lo.service"]
    s.inactive(v.name, Outcome.EXITED, by_itself=True)
    assert brief(s.request(u)) == ["grant u.service 0,1"]
    assert s.snapshot().gpus[0] == [("u.service", 50, "running")]
    assert s.snapshot().restarting == {}


def test_a_waiter_made_more_urgent_takes_a_place_kept_for_a_restart_however_long_it_waited() -> (
    None
):
    """w waited first (the first thing the core knew, with no GPU yet), less urgent than u,
    which got GPU 0 and fails into its Restart=: kept. A rescan makes w more urgent: it takes
    the kept place, as any place not answered yet (the thrash rule protects only a grant made
    after w was known; the restart is no grant), and u's restart waits."""
    u, w = spec("u", 50), spec("w", 60)
    s = Scheduler([], {})
    s.request(w)
    s.request(u)
    assert brief(s.set_gpus([Gpu(0)])) == ["grant u.service 0"]
    s.inactive(u.name, Outcome.FAILED, by_itself=True, restarting=True)
    assert u.name in s.restart_kept
    urgent = dataclasses.replace(w, priority=5)
    assert brief(s.set_specs({u.name: u, w.name: urgent})) == ["grant w.service 0"]
    assert list(s.waiters) == [u.name]


def test_a_unit_owed_a_thaw_that_fails_into_its_restart_is_owed_none_when_restarted() -> None:
    """A FreezeUnit answered late may have frozen u's run: u is owed a thaw. That run
    failed by itself (a frozen one cannot): nothing of it was frozen. Its restart, granted
    the kept GPU, is owed no thaw (no FreezerState read, no thaw saved for a next controller)."""
    u = spec("u", 50)
    s = Scheduler([Gpu(0)], {})
    assert brief(s.request(u)) == ["grant u.service 0"]
    s.froze_after_end(u.name)
    assert s.thaws_owed() == [u.name]
    s.inactive(u.name, Outcome.FAILED, by_itself=True, restarting=True)
    assert brief(s.request(u)) == ["grant u.service 0"]
    assert s.thaws_owed() == [] and s.save().thaw_owed == []


@pytest.mark.parametrize("restart", [Restart.ALWAYS, Restart.ON_SUCCESS])
@pytest.mark.parametrize("restarting", [True, False])
def test_a_clean_exit_its_restart_restarts_keeps_its_gpu_and_is_finished(
    restart: Restart, restarting: bool
) -> None:
    """u exits 0 and its Restart= (always, on-success) starts it again: its GPU is kept for
    that start as for a failure (released, lo got it and the restart stopped lo a moment
    later), said finished (not failed); seen in `auto-restart` or not yet (systemd 252's
    `inactive` first). Its restart is granted it; one that does not come leaves it finished,
    not failed, and lo gets the GPU."""
    u, lo = dataclasses.replace(spec("u", 50), restart=restart), spec("lo", 60)
    for comes in (True, False):
        s = Scheduler([Gpu(0)], {})
        assert brief(s.request(u)) == ["grant u.service 0"]
        s.request(lo)
        down = s.inactive(u.name, Outcome.EXITED, by_itself=True, restarting=restarting)
        assert brief(down) == []
        assert words(down) == [
            "u.service finished: its own Restart= policy starts it again, GPU 0 kept for it "
            "meanwhile"
        ]
        assert s.restart_kept == {u.name: Outcome.EXITED}
        assert s.snapshot().gpus == {0: [("u.service", 50, "restarting")]}
        if comes:
            assert brief(s.request(u)) == ["grant u.service 0"]
            assert not s.restart_kept and s.finished == set()
        else:
            assert brief(s.restart_overdue(u.name)) == ["grant lo.service 0"]
            assert (s.finished, s.failed) == ({u.name}, set())


@pytest.mark.parametrize("restart", [Restart.NO, Restart.ON_FAILURE, Restart.ON_ABNORMAL])
def test_a_clean_exit_its_restart_does_not_restart_releases_its_gpu_at_once(
    restart: Restart,
) -> None:
    """u exits 0 by itself and its Restart= does not start it again: no keep, nor a wait for
    an `auto-restart` (a failure waits for one: systemd 252 signals it after `failed`): lo
    gets its GPU at once, u finished. A clean exit not by itself (someone's stop on its way)
    is no keep either."""
    u, lo = dataclasses.replace(spec("u", 50), restart=restart), spec("lo", 60)
    s = Scheduler([Gpu(0)], {})
    s.request(u)
    s.request(lo)
    down = s.inactive(u.name, Outcome.EXITED, by_itself=True)
    assert brief(down) == ["grant lo.service 0"]
    assert words(down)[0] == "u.service finished: released GPU 0"
    assert not s.restart_kept and s.finished == {u.name}
    always = dataclasses.replace(u, restart=Restart.ALWAYS)
    s = Scheduler([Gpu(0)], {})
    s.request(always)
    s.request(lo)
    assert brief(s.inactive(u.name, Outcome.EXITED, not_ours=True, by_itself=True)) == [
        "grant lo.service 0"
    ]


def test_a_bare_auto_restart_under_restart_on_success_is_a_clean_exit() -> None:
    """RestartMode=direct: `auto-restart` alone, told FAILED (how it ended is unknown). Under
    Restart=on-success only a clean exit is restarted: said finished, recorded finished if
    its restart does not come."""
    u = dataclasses.replace(spec("u", 50), restart=Restart.ON_SUCCESS)
    s = Scheduler([Gpu(0)], {})
    s.request(u)
    down = s.inactive(u.name, Outcome.FAILED, restarting=True)
    assert words(down)[0].startswith("u.service finished: its own Restart= policy starts it")
    s.restart_overdue(u.name)
    assert (s.finished, s.failed) == ({u.name}, set())


def test_units_no_longer_annotated_leave_no_time_out_behind() -> None:
    """When each unit went out orders refill among annotated units alone: kept for a unit
    whose annotation went while it ran (and ended since), or for any name the core was told
    ended, an entry stayed for every such name until the controller restarted (instances'
    names may never come again)."""
    s = Scheduler([Gpu(0)], {})
    for i in range(1000):
        job = spec(f"t@{i}", 50)
        s.learn(job)
        s.request(job)
        s.set_specs({})  # the template's annotation went while the instance ran
        s.inactive(job.name, Outcome.EXITED, by_itself=True)
        s.inactive(f"u@{i}.service", Outcome.STOPPED)  # a name the core never knew
    assert s.out_since == {}
    kept = spec("bg", 50, BG)
    s.set_specs({kept.name: kept})
    s.inactive(kept.name, Outcome.EXITED)
    gone = spec("t@x", 50)
    s.learn(gone)
    s.inactive(gone.name, Outcome.EXITED)  # a start cancelled before it queued: no record
    s.set_specs({kept.name: kept})  # t@x's annotation went while it was down
    assert list(s.out_since) == [kept.name]


def test_an_instance_owed_something_or_refilled_is_not_forgotten() -> None:
    """Waiting, holding, suspended, owed a comeback, or background and held (an admin's
    stop, shown in status until someone starts it): kept."""
    s = Scheduler([Gpu(0)], {})
    urgent, late, back = spec("u@1", 10), spec("w@1", 50), spec("b@1", 90, BG)
    for unit in (spec("p@1", 60), back, urgent, late):
        s.learn(unit)
    s.request(spec("p@1", 60))
    s.request(urgent)  # p@1 is stopped for it
    s.request(late)
    assert s.phase("p@1.service") is Phase.STOPPING
    assert not s.forget_instance("p@1.service")  # holding, being stopped
    assert not s.forget_instance("w@1.service")  # waiting
    s.inactive("p@1.service", Outcome.STOPPED)
    assert not s.forget_instance("p@1.service")  # owed its comeback
    assert not s.forget_instance("u@1.service")  # running
    s.inactive("b@1.service", Outcome.STOPPED)
    assert not s.forget_instance("b@1.service")
    assert {"p@1.service", "b@1.service"} <= s.annotated()


def test_an_instance_preempted_without_a_comeback_is_forgotten() -> None:
    s = Scheduler([Gpu(0)], {})
    s.learn(spec("p@1", 60, requeue=False))
    s.request(spec("p@1", 60, requeue=False))
    s.request(spec("u", 10))
    s.inactive("p@1.service", Outcome.STOPPED)
    assert s.forget_instance("p@1.service")
    assert s.save().preempted == {}


def test_a_suspended_instance_is_not_forgotten() -> None:
    s = Scheduler([sized(0)], {})
    p = spec("p@1", 60, mem_gib=8, preempt="suspend stop")
    s.learn(p)
    s.request(p)
    s.request(spec("u", 10, mem_gib=20))
    assert s.phase("p@1.service") is Phase.SUSPENDING
    assert not s.forget_instance("p@1.service")
    s.suspended_done("p@1.service", "")
    assert s.phase("p@1.service") is Phase.SUSPENDED
    assert not s.forget_instance("p@1.service")


def test_a_start_of_ours_whose_place_went_before_its_gate_asked_queues_from_its_start() -> None:
    """b1 is started by refill on the free GPU; b2, as urgent, asks after; a more urgent
    start (w) is known in the same turn as b1's gate asks, so b1 cannot keep its place: it
    waits, ahead of b2, from when it was started, and has the GPU once w is done."""
    b1, b2, w = spec("b1", 50, BG), spec("b2", 50), spec("w", 10)
    s = Scheduler([Gpu(0)], {"b1.service": b1})
    assert brief(s.schedule()) == ["start b1.service"]
    s.request(b2)
    with s.deferred():  # one turn of the controller's loop: decided once, after
        s.announce(w)
        s.request(b1)
    assert s.is_waiting("b1.service") and s.is_waiting("b2.service")
    assert brief(s.schedule()) == []
    assert brief(s.request(w)) == ["grant w.service 0"]
    assert brief(s.inactive("w.service", Outcome.EXITED, by_itself=True)) == ["grant b1.service 0"]


def test_an_instance_forgotten_after_its_failed_wait_leaves_no_trace_of_it() -> None:
    """Its wait at the gate failed (a requeue), it was started again and a person stopped
    that start: held, owed nothing once SystemState says the host runs (a shutdown's stop
    owes the comeback: `holds_of_shutdown`), forgotten, with nothing of its failed wait
    kept."""
    p = spec("p@1", 60)
    s = Scheduler([Gpu(0)], {}, requeue_at_gate=True)
    s.learn(p)
    s.request(p)
    s.request(spec("u", 10))
    assert brief(s.inactive("p@1.service", Outcome.STOPPED)) == [
        "grant u.service 0",
        "start p@1.service",
    ]
    s.inactive("p@1.service", Outcome.FAILED)  # its wait at the gate failed
    assert brief(s.inactive("u.service", Outcome.EXITED, by_itself=True)) == ["start p@1.service"]
    s.inactive("p@1.service", Outcome.STOPPED)  # a person stopped that start
    assert not s.forget_instance("p@1.service")  # its hold is not yet checked
    s.holds_confirmed(["p@1.service"])
    assert s.forget_instance("p@1.service")
    assert "p@1.service" not in s.wait_failed


def test_a_lost_start_sent_again_whose_annotation_goes_before_its_gate_asks_is_withdrawn() -> None:
    """Sent again after a restart, the start is still gpuslice's: its annotation gone
    before its gate asks, it is stopped, not let through onto a GPU that goes to others."""
    sched = Scheduler([0], {V: VLM})
    assert brief(sched.schedule()) == [f"start {V}"]
    again = Scheduler([0], {V: VLM})
    again.load(sched.save())
    assert brief(again.start_lost(V)) == [f"start {V}"]
    withdrawn = again.set_specs({})
    assert [a for a in withdrawn if isinstance(a, Stop)] != []
    assert again.phase(V) is Phase.STOPPING


def test_a_requeue_at_its_gate_unheard_since_a_restart_is_withdrawn_with_its_annotation() -> None:
    """A restarted controller knows the comeback the last one sent to wait at its gate by
    its requeue alone (a waiter is not saved) until its gate asks again. Its annotation
    taken out meanwhile (a daemon-reload during start-up, whose rescan the gates found
    then wait for), it is stopped as a holder or waiter of ours is: let through, gpuslice's
    own start ran ungated beside the unit it was preempted for."""
    low, urgent = spec("low", 60), spec("urgent", 10)
    first = Scheduler([sized(0)], {low.name: low, urgent.name: urgent}, requeue_at_gate=True)
    first.request(low)
    assert brief(first.request(urgent)) == ["stop low.service"]
    assert brief(first.inactive(low.name, Outcome.STOPPED)) == [
        "grant urgent.service 0",
        "start low.service",
    ]
    assert brief(first.request(low)) == []  # it waits for urgent at its gate
    fresh = Scheduler([sized(0)], {low.name: low, urgent.name: urgent}, requeue_at_gate=True)
    fresh.load(first.save())
    assert fresh.requeued_away() == [low.name]
    assert brief(fresh.set_specs({urgent.name: urgent})) == ["stop low.service"]
    assert fresh.phase(low.name) is Phase.STOPPING  # its gate, should it ask, is stopped
    fresh.inactive(low.name, Outcome.STOPPED)
    assert (fresh.requeued, fresh.started, fresh.recorded()) == (set(), set(), frozenset())


def test_a_comeback_kept_for_its_restart_is_no_requeue_at_its_gate_any_more() -> None:
    """Found by `InstanceMachine`: vlm, preempted, came back by a grant at its gate
    (requeue_at_gate), ran and failed; its GPU was kept for its Restart=, which did not
    come. Its requeue's record, left from its comeback, stayed: the core took it for a
    comeback still waiting at its gate (`requeued_away`), stopped it (down) when its
    annotation went, and a failure of its restart for a failed wait (preempted again)."""
    sim = _preempted_at_gate()
    sim.exit(VO)
    sim.settle()
    sim.exit(V, Outcome.FAILED)
    assert V in sim.sched.restart_kept
    sim.restart_not_seen(V)
    assert sim.sched.requeued_away() == []
    assert brief(sim.annotate([VOICE])) == []
    sim.check_quiet()


def test_a_background_instance_refilled_after_a_cancelled_shutdown_is_forgotten_once_done() -> None:
    """Found by `InstanceMachine`: the host's shutdown stopped a background instance and
    was cancelled; refill started it again, it finished and systemd kept it active
    (RemainAfterExit=yes), then someone stopped it. Its refill had come, but its record of
    the shutdown's stop (`stopped_by_shutdown`) stayed: never forgotten, it stayed in
    memory, saved and watched, until a controller restart."""
    embed = spec("embed@a", 90, BG)
    s = Scheduler([Gpu(0)], {embed.name: embed})
    assert brief(s.request(embed)) == ["grant embed@a.service 0"]
    s.set_shutting_down(True)
    assert brief(s.inactive(embed.name, Outcome.SHUTDOWN)) == []
    assert brief(s.set_shutting_down(False)) == ["start embed@a.service"]
    assert brief(s.request(embed)) == ["grant embed@a.service 0"]
    s.exited(embed.name)
    assert brief(s.inactive(embed.name, Outcome.STOPPED)) == []
    s.holds_confirmed([embed.name])
    assert s.forget_instance(embed.name)


def test_a_unit_kept_for_its_restart_whose_annotation_goes_is_kept_no_more() -> None:
    """u failed, its GPU kept for its Restart=; its annotation goes (the GPU is released)
    and its restart runs unmanaged; annotated again, it is adopted running. Its keep's
    record stayed: a clean exit at a stop of it was taken for the end of that keep
    (`restart_overdue`, which found nothing kept), and it held GPU 0 for ever, though down,
    and x waited for it; meanwhile it never yielded to a foreign process."""
    u, x = spec("u", 50, BG), spec("x", 70)
    s = Scheduler([Gpu(0)], {u.name: u})
    assert brief(s.request(u)) == ["grant u.service 0"]
    s.inactive(u.name, Outcome.FAILED, by_itself=True)
    assert u.name in s.restart_kept
    s.set_specs({})
    assert not s.restart_kept
    s.set_specs({u.name: u, x.name: x})
    s.running(u.name, [0])
    s.inactive(u.name, Outcome.EXITED)
    assert u.name not in s.holders
    assert brief(s.request(x)) == ["grant x.service 0"]
