"""Edges of the core that the rule tables do not reach: a start on its way when the GPUs
change under it, units adopted after a controller restart or a new annotation, GPUs removed
while held, stops that fail for a unit nobody waits for. Each test pins one promise that a
mutation of the scheduler broke without any other test noticing (`make mutate`)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

from gpuslice.core.decisions import Blocker, Cause, Code, Decision
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import (
    Action,
    Log,
    Outcome,
    Phase,
    SavedState,
    Scheduler,
    Start,
    Stop,
)
from tests.core_builders import BG, GIB, brief, sized, spec, words


def log_levels(actions: Sequence[Action]) -> list[tuple[str, str]]:
    return [(a.level, a.message) for a in actions if isinstance(a, Log)]


# -- a start on its way: its GPUs are checked again when its gate asks -----------------------


def test_a_start_on_its_way_keeps_its_gpu_when_nothing_changed() -> None:
    bg = spec("bg", 90, BG, mem_gib=10)
    s = Scheduler([sized(0)], {bg.name: bg})
    assert brief(s.schedule()) == ["start bg.service"]
    assert brief(s.request(bg)) == ["grant bg.service 0"]


def test_a_start_on_its_way_is_judged_next_to_the_others_not_itself() -> None:
    """bg (14 GiB) was started onto GPU 0, where a 4 GiB unit joined it; GPU 1 (16 GiB,
    a tighter fit) is free by the time its gate asks. It still fits where it was started."""
    whole = spec("whole", 10, devices=("1",))
    bg = spec("bg", 90, BG, mem_gib=14)
    s = Scheduler([sized(0), sized(1, 16)], {bg.name: bg})
    assert brief(s.request(whole)) == ["grant whole.service 1", "start bg.service"]
    assert brief(s.request(spec("small", 10, mem_gib=4))) == ["grant small.service 0"]
    s.inactive("whole.service", Outcome.EXITED)
    assert brief(s.request(bg)) == ["grant bg.service 0"]


def test_a_start_on_its_way_queues_when_its_neighbours_no_longer_leave_room() -> None:
    """Two units started onto one GPU; the reserve grows before their gates ask: the first
    to ask no longer fits next to the other and waits; the other then fits alone."""
    a = spec("a", 90, BG, mem_gib=10)
    b = spec("b", 90, BG, mem_gib=10)
    s = Scheduler([sized(0)], {a.name: a, b.name: b})
    assert brief(s.schedule()) == ["start a.service", "start b.service"]
    s.set_gpus([sized(0, reserve=6 * GIB)])
    assert brief(s.request(a)) == []
    assert s.is_waiting("a.service")
    assert brief(s.request(b)) == ["grant b.service 0"]


def test_a_start_on_its_way_to_a_removed_gpu_queues_for_another() -> None:
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0), sized(1)], {bg.name: bg})
    assert brief(s.request(spec("first", 10))) == ["grant first.service 0", "start bg.service"]
    assert s.grants()["bg.service"] == frozenset({1})
    s.inactive("first.service", Outcome.EXITED)
    s.set_gpus([sized(0)])  # GPU 1 removed (manage_gpus edited, card pulled)
    assert brief(s.request(bg)) == ["grant bg.service 0"]


def test_a_start_on_its_way_that_now_asks_for_more_gpus_is_not_granted_its_one() -> None:
    """bg (GPUs=1) was started onto GPU 0; a daemon-reload makes it GPUs=2 before its gate
    asks. It used to be granted the one GPU kept for it (CUDA_VISIBLE_DEVICES=0 for a unit
    of two): it queues for two, and gets them once the second is free."""
    bg, first = spec("bg", 90, BG), spec("first", 10, devices=("1",))
    s = Scheduler([sized(0), sized(1)], {bg.name: bg, first.name: first})
    assert brief(s.request(first)) == ["grant first.service 1", "start bg.service"]
    assert s.grants()["bg.service"] == frozenset({0})
    wide = spec("bg", 90, BG, gpus=2)
    s.set_specs({wide.name: wide, first.name: first})
    assert brief(s.request(wide)) == []
    assert s.is_waiting("bg.service")
    assert brief(s.inactive("first.service", Outcome.EXITED)) == ["grant bg.service 0,1"]


# -- units found running: adopted where they run ----------------------------------------------


def test_a_unit_adopted_after_a_restart_keeps_the_gpu_it_was_granted() -> None:
    """Not the lowest free index: the GPU it was granted before the restart."""
    r = spec("r", 50)
    s = Scheduler([sized(0), sized(1)], {r.name: r})
    assert brief(s.running("r.service", [1])) == []
    assert s.grants() == {"r.service": frozenset({1})}
    assert s.phase("r.service") is Phase.RUNNING


def test_a_memory_unit_adopted_after_a_restart_keeps_its_gpu() -> None:
    r = spec("r", 50, mem_gib=8)
    s = Scheduler([sized(0), sized(1)], {r.name: r})
    s.running("r.service", [1])
    assert s.grants() == {"r.service": frozenset({1})}


def test_a_unit_adopted_while_stopping_counts_as_stopping() -> None:
    r = spec("r", 50)
    s = Scheduler([sized(0)], {r.name: r})
    s.running("r.service", [0], stopping=True)
    assert s.phase("r.service") is Phase.STOPPING


def test_a_started_unit_seen_running_is_running() -> None:
    """Started by gpuslice, then seen running before its gate asked (a controller
    restart in between): it runs where it was started."""
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0)], {bg.name: bg})
    s.schedule()
    assert s.phase("bg.service") is Phase.STARTING
    s.running("bg.service")
    assert s.phase("bg.service") is Phase.RUNNING
    assert s.grants() == {"bg.service": frozenset({0})}


def test_a_waiter_seen_running_no_longer_waits_and_is_counted_on_none() -> None:
    """Its start passed the gate without a grant (the gate was removed by a drop-in, say):
    it runs, so it no longer waits; there is no free GPU to count it on, and it says so."""
    w = spec("w", 50)
    s = Scheduler([sized(0)], {w.name: w})
    s.request(spec("first", 10))
    s.request(w)
    assert s.is_waiting("w.service")
    actions = s.running("w.service")
    assert not s.is_waiting("w.service")
    assert s.grants()["w.service"] == frozenset()
    assert log_levels(actions) == [
        (
            "warning",
            "w.service (priority 50) is running without enough free GPUs to account for it; "
            "counting it on none",
        )
    ]


def test_an_annotated_running_unit_never_preempts_to_be_counted() -> None:
    """Adoption counts a unit where there is room; it never makes room by preempting."""
    bg = spec("bg", 90, BG)
    r = spec("r", 10)
    s = Scheduler([sized(0)], {bg.name: bg, r.name: r})
    s.schedule()
    s.request(bg)
    assert brief(s.running("r.service")) == []
    assert s.grants()["r.service"] == frozenset()
    assert s.phase("bg.service") is Phase.RUNNING


def test_the_most_recently_adopted_of_equals_is_preempted_first() -> None:
    a = spec("a", 90)
    b = spec("b", 90)
    s = Scheduler([sized(0), sized(1)], {a.name: a, b.name: b})
    s.running("a.service", [0])
    s.running("b.service", [1])
    assert brief(s.request(spec("top", 10))) == ["stop b.service"]


# -- GPUs that disappear while held ------------------------------------------------------------


def test_a_gpu_removed_while_held_leaves_the_scheduler_working() -> None:
    """Holders of a GPU that is no longer listed keep counting on it (they still run), and
    scheduling, status and stops go on."""
    a = spec("a", 50)
    b = spec("b", 60)
    s = Scheduler([sized(0), sized(1)], {})
    s.request(a)
    assert brief(s.request(b)) == ["grant b.service 1"]
    s.set_gpus([sized(0)])
    assert s.snapshot().gpus[1] == [("b.service", 60, "running")]
    assert brief(s.request(spec("c", 70))) == []
    assert brief(s.inactive("a.service", Outcome.EXITED)) == ["grant c.service 0"]


def test_a_restart_that_sees_fewer_gpus_keeps_their_holders_on_the_others() -> None:
    """The controller restarts while NVML does not answer: it sees `gpus:` from config.yaml
    (1), not the host's 2. b still runs on GPU 1: it used to be loaded holding nothing, so
    that once NVML showed GPU 1 again it was granted to c beside b. It keeps GPU 1."""
    a, b, c = spec("a", 50), spec("b", 60), spec("c", 70)
    specs = {u.name: u for u in (a, b, c)}
    s = Scheduler([sized(0), sized(1)], specs)
    s.request(a)
    assert brief(s.request(b)) == ["grant b.service 1"]
    fresh = Scheduler([Gpu(0)], specs)
    fresh.load(s.save())
    assert fresh.grants() == {"a.service": frozenset({0}), "b.service": frozenset({1})}
    fresh.set_gpus([sized(0), sized(1)])  # NVML answers again
    assert brief(fresh.request(c)) == []
    assert fresh.is_waiting("c.service")
    assert brief(fresh.inactive("b.service", Outcome.EXITED)) == ["grant c.service 1"]


def test_device_of_an_unknown_index_is_a_gpu_of_unknown_size() -> None:
    s = Scheduler([sized(0)], {})
    assert s.device(0) == sized(0)
    assert s.device(5) == Gpu(5)


def test_a_holder_is_told_the_gpus_it_was_granted_by_uuid_though_nvml_numbered_them_anew() -> None:
    """What a unit's env file, written again (Gates.let_through), names: the GPU it was
    granted, GPU-A, though NVML now numbers that GPU 2 and calls GPU-B 0, which another
    unit may run on; a GPU known by no UUID when granted, by what `device` says now;
    nobody's, none."""
    a, b = spec("a", 50, gpus=2), spec("b", 50)
    s = Scheduler([Gpu(0, "GPU-A"), Gpu(1), Gpu(2, "GPU-B")], {a.name: a, b.name: b})
    assert brief(s.request(a)) == ["grant a.service 0,1"]
    assert s.told("a.service") == [Gpu(0, "GPU-A"), Gpu(1)]
    s.set_gpus(
        [
            Gpu(0, "GPU-B", lost=True, renumbered=True),
            Gpu(1, "GPU-C"),
            Gpu(2, "GPU-A", lost=True, renumbered=True),
        ]
    )
    assert s.told("a.service") == [Gpu(0, "GPU-A"), Gpu(1, "GPU-C")]
    assert s.told("b.service") == []


def test_a_held_unit_whose_annotation_went_is_let_go_at_its_gate_on_a_gpu_told_by_no_uuid() -> None:
    """a.service holds GPU 0, granted as GPU-A, and GPU 1, known by no UUID then; its
    annotation goes, and it is restarted (Gates.let_through). Its books name GPU 0 by
    GPU-A, lost or not: it keeps both. Once GPU 1 is lost too, they name it by no GPU: told
    as NVML numbers it now, it ran on another GPU than its own, so the core lets it go. An
    annotated unit's gate is `request`'s, and a unit the core does not hold has nothing to
    let go."""
    a, b = spec("a", 50, gpus=2), spec("b", 50)
    s = Scheduler([Gpu(0, "GPU-A"), Gpu(1), Gpu(2)], {a.name: a, b.name: b})
    assert brief(s.request(a)) == ["grant a.service 0,1"]
    assert brief(s.request(b)) == ["grant b.service 2"]
    s.set_specs({b.name: b})
    assert s.let_through("a.service") == []
    moved = [
        Gpu(0, "GPU-B", lost=True, renumbered=True),
        Gpu(2, "GPU-A", lost=True, renumbered=True),
    ]
    s.set_gpus([moved[0], Gpu(1), moved[1]])
    assert s.let_through("a.service") == []
    assert s.grants()["a.service"] == {0, 1}
    s.set_gpus([moved[0], Gpu(1, lost=True), moved[1]])
    assert s.let_through("b.service") == []
    assert s.let_through("c.service") == []
    assert words(s.let_through("a.service")) == [
        "a.service is no longer annotated: released its GPUs"
    ]
    assert s.grants() == {"b.service": {2}}


def test_a_unit_whose_annotation_went_being_stopped_is_not_let_go_at_its_gate() -> None:
    """a.service, its annotation gone, is stopped for urgent.service on GPU 0, known by no
    UUID, which is then lost: its processes still run there until the stop ends, so its
    books keep GPU 0 (the controller stops its gate again, `Gates.serve_gate`)."""
    a, urgent = spec("a", 90), spec("urgent", 10)
    s = Scheduler([Gpu(0)], {a.name: a, urgent.name: urgent})
    assert brief(s.request(a)) == ["grant a.service 0"]
    s.set_specs({urgent.name: urgent})
    assert brief(s.request(urgent)) == ["stop a.service"]
    s.set_gpus([Gpu(0, lost=True)])
    assert s.let_through("a.service") == []
    assert s.phase("a.service") is Phase.STOPPING


# -- preempted units coming back ---------------------------------------------------------------


def test_a_preempted_unit_comes_back_by_preempting_a_less_urgent_background_unit() -> None:
    """p (two GPUs) was preempted by u; bg took the GPU p left; when u ends, p comes back:
    its gate will preempt bg (the requeue is started with no GPUs held for it)."""
    p = spec("p", 20, gpus=2)
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0), sized(1)], {p.name: p, bg.name: bg})
    s.request(p)
    assert brief(s.request(spec("u", 10))) == ["stop p.service"]
    assert brief(s.inactive("p.service", Outcome.STOPPED)) == [
        "grant u.service 0",
        "start bg.service",
    ]
    s.request(bg)
    actions = s.inactive("u.service", Outcome.EXITED)
    assert brief(actions) == ["start p.service"]
    assert s.grants()["p.service"] == frozenset()
    assert brief(s.request(p)) == ["stop bg.service"]


def test_every_preempted_unit_that_can_come_back_does_whatever_the_ones_before_it() -> None:
    """Sorted by priority: the first preempted unit cannot come back (no requeue, or too big
    for what is free); the next ones still do."""
    no_requeue = spec("a", 20, requeue=False)
    too_big = spec("b", 30, gpus=2)
    c = spec("c", 40)
    s = Scheduler([sized(0), sized(1)], {u.name: u for u in (no_requeue, too_big, c)})
    s.request(no_requeue)
    s.request(c)
    s.request(spec("top1", 10))
    s.request(spec("top2", 10))
    s.inactive("a.service", Outcome.STOPPED)
    s.inactive("c.service", Outcome.STOPPED)
    s.request(too_big)  # waits behind top1/top2, then they preempt nothing more
    s.inactive("top1.service", Outcome.EXITED)
    assert "c.service" in [a.split()[1] for a in brief(s.inactive("b.service", Outcome.STOPPED))]


def test_a_waiter_keeps_capacity_only_from_units_as_or_less_urgent_than_itself() -> None:
    """w (two GPUs) waits for GPU 0, held by x which it cannot preempt, and keeps GPU 1 from
    less urgent units; p, more urgent than w and preempted earlier, still comes back on it."""
    x = spec("x", 30, devices=("0",))
    p = spec("p", 20, devices=("1",))
    w = spec("w", 50, gpus=2)
    s = Scheduler([sized(0), sized(1)], {u.name: u for u in (x, p, w)})
    s.request(x)
    s.request(p)
    assert brief(s.request(spec("u", 10, devices=("1",)))) == ["stop p.service"]
    s.inactive("p.service", Outcome.STOPPED)
    s.request(w)
    assert brief(s.inactive("u.service", Outcome.EXITED)) == ["start p.service"]


def test_equally_urgent_preempted_units_come_back_in_the_order_they_were_preempted() -> None:
    a = spec("a", 50, devices=("0",))
    b = spec("b", 50, devices=("1",))
    both = spec("both", 10, gpus=2)
    s = Scheduler([sized(0), sized(1)], {a.name: a, b.name: b})
    s.request(a)
    s.request(b)
    s.request(both)
    s.inactive("b.service", Outcome.STOPPED)
    s.inactive("a.service", Outcome.STOPPED)
    assert brief(s.inactive("both.service", Outcome.EXITED)) == [
        "start b.service",
        "start a.service",
    ]


# -- the words of a wait and of a stop ---------------------------------------------------------


def test_a_waiter_for_several_victims_names_each() -> None:
    a = spec("a", 80, devices=("0",))
    b = spec("b", 90, devices=("1",))
    s = Scheduler([sized(0), sized(1)], {})
    s.request(a)
    s.request(b)
    s.request(spec("top", 10, gpus=2))
    assert s.snapshot().waiting == [
        (
            "top.service",
            10,
            "waiting for a.service (priority 80) to stop on GPU 0, "
            "b.service (priority 90) to stop on GPU 1",
        )
    ]


def test_a_background_waiter_is_told_that_foreign_processes_keep_it_off() -> None:
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0, foreign_pids=(4242,))], {bg.name: bg})
    s.request(bg)
    (reason,) = [r for _, _, r in s.snapshot().waiting]
    assert reason.startswith("waiting: only 0 of this host's GPUs may run it")


def test_memory_overcommitted_by_others_reads_as_none_free() -> None:
    s = Scheduler([sized(0, foreign=30 * GIB)], {})
    s.request(spec("m", 10, mem_gib=4))
    (reason,) = [r for _, _, r in s.snapshot().waiting]
    assert "GPU 0 has 0 B free after the reserve" in reason


def test_only_a_waiter_going_inactive_is_a_cancelled_start() -> None:
    s = Scheduler([sized(0)], {})
    said = [m for _, m in log_levels(s.inactive("nobody.service", Outcome.EXITED))]
    assert not any("start cancelled" in m for m in said), said
    s.request(spec("first", 10))
    s.request(spec("w", 20))
    said = [m for _, m in log_levels(s.inactive("w.service", Outcome.STOPPED))]
    assert "w.service: start cancelled while waiting; nothing reserved" in said


# -- stops that fail or overrun, for a waiter or for nobody -------------------------------------


def test_a_stop_lost_for_nobody_is_said_without_a_waiter_or_a_promise() -> None:
    """A background unit yielding to a foreign process has no waiter; its stop is lost."""
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0)], {bg.name: bg})
    s.schedule()
    s.request(bg)
    s.set_gpus([sized(0, foreign_pids=(4242,))])
    actions = s.stop_failed("bg.service", "its stop job was cancelled", refused=False)
    assert log_levels(actions) == [
        (
            "warning",
            "bg.service (priority 90) did not stop: its stop job was cancelled; it keeps GPU 0",
        )
    ]


def test_an_overdue_stop_for_nobody_names_no_waiter() -> None:
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0)], {bg.name: bg})
    s.schedule()
    s.request(bg)
    s.set_gpus([sized(0, foreign_pids=(4242,))])
    (message,) = [m for _, m in log_levels(s.stop_overdue("bg.service", "90 s"))]
    assert "waits for it" not in message
    assert message.startswith("bg.service (priority 90) has not stopped 90 s after gpuslice asked")


def test_an_overdue_stop_of_an_unknown_unit_is_ignored() -> None:
    assert Scheduler([sized(0)], {}).stop_overdue("nobody.service", "90 s") == []


def test_a_failed_stop_forgets_that_it_was_overdue() -> None:
    """Asked again later, its waiter's reason does not carry the old overrun."""
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0)], {bg.name: bg})
    s.schedule()
    s.request(bg)
    s.request(spec("v", 10))
    s.stop_overdue("bg.service", "90 s")
    s.stop_failed("bg.service", "its stop job was cancelled", refused=False)
    assert s.snapshot().waiting == [
        ("v.service", 10, "waiting for bg.service (priority 90) to stop on GPU 0")
    ]


# -- yielding, reloads, saved state ------------------------------------------------------------


def test_every_background_unit_on_a_gpu_taken_by_a_foreign_process_yields() -> None:
    """The first background unit (by name) is on a clean GPU; the second still yields."""
    a = spec("a", 90, BG)
    b = spec("b", 90, BG)
    s = Scheduler([sized(0), sized(1)], {a.name: a, b.name: b})
    s.schedule()
    s.request(a)
    s.request(b)
    assert brief(s.set_gpus([sized(0), sized(1, foreign_pids=(4242,))])) == ["stop b.service"]


def test_a_reload_forgets_every_unit_no_longer_annotated_after_one_still_stopping() -> None:
    a = spec("a", 90, devices=("0",))
    b = spec("b", 90, devices=("1",))
    s = Scheduler([sized(0), sized(1)], {a.name: a, b.name: b})
    s.request(a)
    s.request(b)
    s.request(spec("top", 10, devices=("0",)))  # a is stopping
    logs = [x.decision for x in s.set_specs({}) if isinstance(x, Log)]
    assert logs == [
        Decision(Code.UNMANAGED, "b.service", 90, gpus=(1,), cause=Cause.RUNS),
        Decision(Code.UNMANAGED, "top.service", 10),  # its start, not yet answered
    ]
    assert s.phase("a.service") is Phase.STOPPING


def test_saved_holders_without_a_waiter_load() -> None:
    a = spec("a", 90)
    s = Scheduler([sized(0)], {a.name: a})
    s.request(a)
    saved = s.save()
    fresh = Scheduler([sized(0)], {a.name: a})
    fresh.load(saved)
    assert fresh.grants() == {"a.service": frozenset({0})}
    assert fresh.phase("a.service") is Phase.RUNNING


# -- decisions carry their data (what the journal fields and status JSON are made of) -----------


def test_every_action_of_a_preemption_carries_its_decision() -> None:
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0)], {bg.name: bg})
    (start,) = s.schedule()
    assert start.decision == Decision(Code.REFILL, "bg.service", 90, gpus=(0,))
    (grant,) = s.request(bg)
    assert grant.decision is not None and grant.decision.code is Code.GRANT
    stop, wait = s.request(spec("v", 10))
    assert stop.decision == Decision(
        Code.PREEMPT, "bg.service", 90, for_unit="v.service", for_priority=10, gpus=(0,)
    )
    assert isinstance(wait, Log) and wait.decision is not None
    assert (wait.decision.code, wait.decision.cause) == (Code.WAIT, Cause.STOPPING)
    assert wait.decision.gpus == (0,)
    assert s.snapshot().reasons["v.service"] == wait.decision
    assert s.waiting_units() == ["v.service"]
    actions = s.inactive("bg.service", Outcome.STOPPED)
    assert [a.decision.code for a in actions if a.decision is not None] == [Code.GRANT]


def test_a_victim_on_several_gpus_is_preempted_on_the_one_the_waiter_needs() -> None:
    s = Scheduler([sized(0), sized(1)], {})
    s.request(spec("big", 90, gpus=2))
    (stop, _) = s.request(spec("one", 10, devices=("1",)))
    assert isinstance(stop, Stop)
    assert stop.reason == (
        "preempting big.service (priority 90) for one.service (priority 10) on GPU 1"
    )
    assert stop.decision is not None and stop.decision.gpus == (1,)


def test_a_requeue_says_whether_it_lands_on_free_gpus_or_must_preempt() -> None:
    p = spec("p", 20, gpus=2)
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0), sized(1)], {p.name: p, bg.name: bg})
    s.request(p)
    s.request(spec("u", 10))
    s.inactive("p.service", Outcome.STOPPED)
    s.request(bg)
    (start,) = [a for a in s.inactive("u.service", Outcome.EXITED) if isinstance(a, Start)]
    assert start.decision is not None
    assert (start.decision.code, start.decision.cause) == (Code.REQUEUE, Cause.PREEMPTS)
    q = spec("q", 20)
    s2 = Scheduler([sized(0)], {q.name: q})
    s2.request(q)
    s2.request(spec("u", 10))
    s2.inactive("q.service", Outcome.STOPPED)
    (start,) = [a for a in s2.inactive("u.service", Outcome.EXITED) if isinstance(a, Start)]
    assert start.decision is not None
    assert (start.decision.code, start.decision.cause, start.decision.gpus) == (
        Code.REQUEUE,
        Cause.FREE,
        (0,),
    )


def test_a_preempted_unit_that_cannot_fit_lets_the_next_one_come_back() -> None:
    """b (two GPUs) cannot come back while top holds one of them; c, after it in order,
    still does on the free GPU."""
    b = spec("b", 30, gpus=2, devices=("0", "1"))
    c = spec("c", 40, devices=("2", "1"))
    s = Scheduler([sized(0), sized(1), sized(2)], {b.name: b, c.name: c})
    s.request(b)
    s.request(c)
    assert brief(s.request(spec("top", 10, gpus=2, devices=("0", "2")))) == [
        "stop b.service",
        "stop c.service",
    ]
    s.inactive("b.service", Outcome.STOPPED)
    actions = s.inactive("c.service", Outcome.STOPPED)
    assert brief(actions) == ["grant top.service 0,2", "start c.service"]


def test_preempted_units_paused_for_the_driver_do_not_hold_back_on_demand_ones() -> None:
    bg = spec("bg", 20, BG)
    od = spec("od", 30)
    s = Scheduler([sized(0), sized(1)], {bg.name: bg, od.name: od})
    s.request(bg)
    s.request(od)
    s.request(spec("top", 10, gpus=2))
    s.inactive("bg.service", Outcome.STOPPED)
    s.inactive("od.service", Outcome.STOPPED)
    s.refill_paused = "NVML is not ready yet"
    assert brief(s.inactive("top.service", Outcome.EXITED)) == ["start od.service"]


def test_a_stop_overdue_names_its_waiter_and_gpus_as_data() -> None:
    bg = spec("bg", 90, BG)
    s = Scheduler([sized(0)], {bg.name: bg})
    s.schedule()
    s.request(bg)
    s.request(spec("v", 10))
    (log, *_) = s.stop_overdue("bg.service", "90 s")
    assert log.decision == Decision(
        Code.STOP_OVERDUE,
        "bg.service",
        90,
        for_unit="v.service",
        for_priority=10,
        gpus=(0,),
        detail="90 s",
    )


def test_a_unit_no_longer_annotated_keeps_its_gpus_while_it_runs_as_data() -> None:
    """Its job still runs on GPU 0: handed to v.service, two jobs would share it. Once it
    ends, the GPU is v.service's and the unit is forgotten (not refilled, not requeued)."""
    a = spec("a", 50, BG)
    v = spec("v", 50)
    s = Scheduler([sized(0)], {a.name: a, v.name: v})
    s.request(a)
    (log,) = [x for x in s.set_specs({v.name: v}) if isinstance(x, Log)]
    assert log.decision == Decision(Code.UNMANAGED, "a.service", 50, gpus=(0,), cause=Cause.RUNS)
    assert s.set_specs({v.name: v}) == []  # said once, not at every reload
    assert brief(s.request(v)) == []
    assert s.grants() == {"a.service": frozenset({0})}
    assert brief(s.inactive("a.service", Outcome.EXITED)) == ["grant v.service 0"]
    assert brief(s.inactive("v.service", Outcome.EXITED)) == []
    assert s.phase("a.service") is None


def test_a_unit_no_longer_annotated_gives_way_only_by_a_stop_and_does_not_come_back() -> None:
    """Frozen or suspended, nothing would bring it back once its annotation is gone."""
    a = spec("a", 50, mem_gib=4, preempt="suspend freeze stop")
    v = spec("v", 10)
    s = Scheduler([sized(0)], {a.name: a, v.name: v})
    s.request(a)
    s.set_specs({v.name: v})
    assert brief(s.request(v)) == ["stop a.service"]
    acts = s.inactive("a.service", Outcome.STOPPED)
    assert brief(acts) == ["grant v.service 0"]
    assert "a.service (priority 50) preempted; Requeue=no, not restarting" in words(acts)
    assert brief(s.inactive("v.service", Outcome.EXITED)) == []


def test_a_reload_goes_on_past_a_running_unit_whose_annotation_went() -> None:
    a, b = spec("a", 50), spec("b", 50)
    s = Scheduler([sized(0), sized(1)], {a.name: a, b.name: b})
    s.request(a)
    s.request(b)
    s.set_specs({"b.service": spec("b", 5)})  # a's annotation went; b's priority rose
    assert brief(s.request(spec("v", 10, devices=("1",)))) == []  # b is more urgent now


def restarted(s: Scheduler, specs: Sequence[UnitSpec] = ()) -> Scheduler:
    """The controller restarts: a fresh scheduler on the same GPUs loads what `s` saved."""
    fresh = Scheduler(s.devices.values(), {x.name: x for x in specs})
    fresh.load(s.save())
    return fresh


def test_a_restart_keeps_a_running_unit_whose_annotation_went_on_the_terms_it_held() -> None:
    """Before the restart a.service holds its GPUs at priority 50: v.service (60) does not
    preempt it, and w.service (40) does. A restarted controller kept it at 999, so v.service
    stopped it there (only there); and a restart after that one keeps the same terms."""
    a = spec("a", 50, gpus=2)
    s = Scheduler([sized(0), sized(1)], {a.name: a})
    s.request(a)
    s.set_specs({})
    v, w = spec("v", 60, gpus=2), spec("w", 40, gpus=2)
    for holder in (s, restarted(s), restarted(restarted(s))):
        assert holder.grants() == {"a.service": frozenset({0, 1})}
        assert holder.holders["a.service"].spec == UnitSpec("a.service", 50, gpus=2, requeue=False)
        assert brief(copy.deepcopy(holder).request(v)) == []
        assert brief(copy.deepcopy(holder).request(w)) == ["stop a.service"]
    fresh = restarted(restarted(s))
    fresh.request(w)
    acts = fresh.inactive("a.service", Outcome.STOPPED)
    assert brief(acts) == ["grant w.service 0,1"]
    assert "a.service (priority 50) preempted; Requeue=no, not restarting" in words(acts)


def test_a_restart_keeps_the_memory_and_kind_an_unannotated_holder_held_its_gpu_by() -> None:
    """bg.service declared 8 GiB and is a background unit: x.service (8 GiB, less urgent)
    fits beside it, and a foreign process makes it yield, before and after a restart (which
    took it for a whole GPU of an on-demand unit: x.service stopped it, and it stayed)."""
    bg = spec("bg", 50, BG, mem_gib=8)
    x = spec("x", 60, mem_gib=8)
    s = Scheduler([sized(0)], {bg.name: bg})
    s.request(bg)
    s.set_specs({})
    for holder in (s, restarted(s)):
        assert brief(copy.deepcopy(holder).request(x)) == ["grant x.service 0"]
        foreign = copy.deepcopy(holder).set_gpus([sized(0, foreign=GIB, foreign_pids=(7,))])
        assert brief(foreign) == ["stop bg.service"]


def test_a_restart_keeps_the_terms_of_a_unit_whose_annotation_went_while_it_was_away() -> None:
    """The last controller saved a.service annotated at priority 50; a daemon-reload took its
    annotation out before the next one read it: it holds its GPU at 50, as set_specs keeps it."""
    a = spec("a", 50)
    s = Scheduler([sized(0)], {a.name: a})
    s.request(a)
    fresh = restarted(s)
    assert fresh.holders["a.service"].spec == UnitSpec("a.service", 50, requeue=False)
    assert brief(fresh.request(spec("v", 60))) == []


def test_a_restart_after_an_older_controller_keeps_an_unannotated_holder_least_urgent() -> None:
    """Its file has no terms: the priority the holder was granted at is not known."""
    saved = SavedState(holders={"a.service": ((0,), "running", 1, "")}, seq=1)
    fresh = Scheduler([sized(0)], {})
    fresh.load(saved)
    assert fresh.holders["a.service"].spec == UnitSpec("a.service", 999, requeue=False)
    assert brief(fresh.request(spec("v", 998))) == ["stop a.service"]


def test_a_unit_whose_annotation_went_while_it_was_being_suspended_survives_a_restart() -> None:
    """Caught between suspend and resume with no annotation, it was dropped: its GPU handed
    out while its memory was still there, and nobody resumed it (left frozen, locked)."""
    a = spec("a", 50, mem_gib=4, preempt="suspend stop")
    s = Scheduler([sized(0)], {a.name: a})
    s.request(a)
    s.request(spec("v", 10))
    assert s.phase("a.service") is Phase.SUSPENDING
    s.set_specs({})
    fresh = restarted(s)
    assert brief(fresh.recover()) == ["resume a.service 0"]
    assert fresh.holders["a.service"].spec == UnitSpec(
        "a.service", 50, memory=4 * GIB, requeue=False
    )
    assert "a.service is no longer annotated" in words(fresh.resumed("a.service", "after 1 s"))[1]


def test_a_frozen_unit_whose_annotation_went_while_the_controller_was_away_is_thawed() -> None:
    """As set_specs thaws one whose annotation goes: never left frozen with nobody's
    annotation to thaw it, nor dropped with its GPU handed out while its memory is there."""
    a = spec("a", 50, mem_gib=4, preempt="freeze stop")
    v = spec("v", 10, mem_gib=4)
    s = Scheduler([sized(0)], {a.name: a, v.name: v})
    s.request(a)
    assert brief(s.request(v)) == ["grant v.service 0", "freeze a.service"]
    fresh = restarted(s, [v])
    assert brief(fresh.recover()) == ["thaw a.service"]
    assert fresh.phase("a.service") is Phase.RUNNING
    assert fresh.grants() == {"a.service": frozenset({0}), "v.service": frozenset({0})}


def test_a_suspended_unit_keeps_its_terms_across_a_restart() -> None:
    """Its annotation went while it was suspended: it comes back in the order of the
    priority it was suspended at (before gone.service, 60), before and after a restart."""
    a = spec("a", 50, mem_gib=4, preempt="suspend stop")
    g = spec("gone", 60, mem_gib=4, preempt="suspend stop")
    v = spec("v", 10)
    s = Scheduler([sized(0)], {a.name: a, g.name: g, v.name: v})
    s.request(a)
    s.request(g)
    s.request(v)
    s.suspended_done("a.service", "")
    s.suspended_done("gone.service", "")
    s.set_specs({v.name: v})
    for holder in (s, restarted(s, [v])):
        assert holder.snapshot().suspended == [("a.service", 50, (0,)), ("gone.service", 60, (0,))]


def test_a_unit_being_suspended_whose_annotation_went_falls_back_to_a_stop() -> None:
    """Once unannotated it gives way by a stop only (as after a restart): its suspend failed,
    it is stopped for the waiter, not left running with no rung of its ladder left."""
    a = spec("a", 50, preempt="suspend")
    v = spec("v", 10)
    s = Scheduler([sized(0)], {a.name: a, v.name: v})
    s.request(a)
    assert brief(s.request(v)) == ["suspend a.service 0"]
    s.set_specs({v.name: v})
    assert brief(s.suspend_failed("a.service", "no cuda-checkpoint")) == ["stop a.service"]


def test_a_suspended_unit_whose_annotation_went_gives_way_by_a_stop_once_resumed() -> None:
    """Resumed on the terms it kept (`_unannotated`): suspended again, nobody's annotation
    would bring it back, so a more urgent unit stops it."""
    a = spec("a", 50, mem_gib=4, preempt="suspend stop")
    v = spec("v", 10, mem_gib=22)
    w = spec("w", 20, mem_gib=22)
    s = Scheduler([sized(0)], {a.name: a, v.name: v, w.name: w})
    s.request(a)
    assert brief(s.request(v)) == ["suspend a.service 0"]
    s.suspended_done("a.service", "")
    s.set_specs({v.name: v, w.name: w})
    assert brief(s.inactive("v.service", Outcome.EXITED)) == ["resume a.service 0"]
    s.resumed("a.service", "after 1 s")
    assert brief(s.request(w)) == ["stop a.service"]


def test_someone_elses_start_on_its_way_whose_annotation_went_is_forgotten() -> None:
    """a.service's start was seen and GPU 0 kept for it when its annotation went: it runs
    ungated now (its gate is let through), so GPU 0 is free for the next unit."""
    a, b = spec("a", 50), spec("b", 60)
    s = Scheduler([sized(0)], {a.name: a, b.name: b})
    s.announce(a)
    assert s.phase("a.service") is Phase.STARTING
    (log,) = [x for x in s.set_specs({b.name: b}) if isinstance(x, Log)]
    assert log.decision == Decision(Code.UNMANAGED, "a.service", 50, gpus=(0,))
    assert s.grants() == {}
    assert brief(s.request(b)) == ["grant b.service 0"]


def requeue_waiting_at_its_gate() -> Scheduler:
    """With requeue_at_gate: a.service (50) preempted by v.service (10) was restarted by
    gpuslice to wait at its gate, and its gate asked: a waiter of gpuslice's start."""
    a, v = spec("a", 50), spec("v", 10)
    s = Scheduler([sized(0)], {a.name: a, v.name: v}, requeue_at_gate=True)
    s.request(a)
    s.request(v)
    assert brief(s.inactive("a.service", Outcome.STOPPED)) == [
        "grant v.service 0",
        "start a.service",
    ]
    assert brief(s.request(a)) == []
    assert s.is_waiting("a.service")
    return s


def test_a_requeue_waiting_at_its_gate_whose_annotation_went_is_stopped() -> None:
    """gpuslice restarted a.service to wait at its gate: once unannotated that start is
    stopped, not let through beside v.service (gpuslice starts no unannotated unit). Held
    as being stopped, on no GPU, so that its gate is stopped again should it ask; once down
    it is forgotten."""
    s = requeue_waiting_at_its_gate()
    v = spec("v", 10)
    actions = s.set_specs({v.name: v})
    assert brief(actions) == ["stop a.service"]
    (stop,) = [x for x in actions if isinstance(x, Stop)]
    assert stop.decision == Decision(Code.UNMANAGED, "a.service", 50, cause=Cause.WITHDRAWN)
    assert not s.is_waiting("a.service") and s.phase("a.service") is Phase.STOPPING
    assert s.grants()["a.service"] == frozenset()
    gpus, phase, seq, _ = s.save().holders["a.service"]  # saved as any holder being stopped
    assert (gpus, phase, isinstance(seq, int) and seq > 0) == ((), "stopping", True)
    assert brief(s.inactive("a.service", Outcome.STOPPED)) == []
    assert "a.service" not in s.preempted and "a.service" not in s.held


def test_a_requeue_withdrawn_and_annotated_again_before_it_is_down_is_still_owed() -> None:
    """It was preempted, and its comeback was stopped only for its annotation: annotated
    again, it is owed that comeback still, and waits at its gate again."""
    s = requeue_waiting_at_its_gate()
    a, v = spec("a", 50), spec("v", 10)
    s.set_specs({v.name: v})
    s.set_specs({a.name: a, v.name: v})
    assert brief(s.inactive("a.service", Outcome.STOPPED)) == ["start a.service"]
    assert s.save().started == ["a.service"]


def test_a_unit_no_longer_annotated_stopped_for_another_is_forgotten() -> None:
    """It is not brought back (Requeue=no, its journal line says): no preemption of it is
    kept, which a.service's annotation coming back (Requeue=yes) would have restarted, and
    which status showed for ever."""
    a = spec("a", 50)
    v = spec("v", 10)
    s = Scheduler([sized(0)], {a.name: a, v.name: v})
    s.request(a)
    s.set_specs({v.name: v})
    assert brief(s.request(v)) == ["stop a.service"]
    acts = s.inactive("a.service", Outcome.STOPPED)
    assert "a.service (priority 50) preempted; Requeue=no, not restarting" in words(acts)
    assert s.snapshot().preempted == [] and "a.service" not in s.save().preempted
    s.inactive("v.service", Outcome.EXITED)
    assert not s.has_work()
    assert brief(s.set_specs({a.name: a, v.name: v})) == []


def test_a_unit_whose_annotation_went_while_it_stopped_is_forgotten_too() -> None:
    a = spec("a", 50)
    v = spec("v", 10)
    s = Scheduler([sized(0)], {a.name: a, v.name: v})
    s.request(a)
    s.request(v)
    s.set_specs({v.name: v})
    acts = s.inactive("a.service", Outcome.STOPPED)
    assert brief(acts) == ["grant v.service 0"]
    assert "a.service (priority 50) preempted; Requeue=no, not restarting" in words(acts)
    assert s.preempted == {}


def test_how_a_unit_no_longer_annotated_ended_is_not_kept() -> None:
    """Stopped by hand, finished or failed: forgotten, so that a background unit annotated
    again is refilled as any new one."""
    units = [spec(n, 50, BG, devices=(str(i),)) for i, n in enumerate(("held", "done", "bad"))]
    s = Scheduler([sized(0), sized(1), sized(2)], {u.name: u for u in units})
    for unit in units:
        s.request(unit)
    s.set_specs({})
    s.inactive("held.service", Outcome.STOPPED)
    s.inactive("done.service", Outcome.EXITED)
    s.inactive("bad.service", Outcome.FAILED)
    snap = s.snapshot()
    assert (snap.held, snap.finished, snap.failed) == ([], [], [])
    started = brief(s.set_specs({u.name: u for u in units}))
    assert started == ["start held.service", "start done.service", "start bad.service"]


def test_a_waiter_whose_annotation_went_is_forgotten_not_granted_later() -> None:
    """Its gate is let through (the controller), its start goes on ungated: granted later,
    it would hold GPUs its process is not told of, after a unit was stopped for it."""
    low = spec("low", 50)
    w = spec("w", 10)
    s = Scheduler([sized(0)], {low.name: low, w.name: w})
    s.request(low)
    assert brief(s.request(w)) == ["stop low.service"]
    (log,) = [a for a in s.set_specs({low.name: low}) if isinstance(a, Log)]
    assert log.decision == Decision(Code.UNMANAGED, "w.service", 10)
    assert not s.is_waiting("w.service")
    assert brief(s.inactive("low.service", Outcome.STOPPED)) == ["start low.service"]


def test_a_start_job_seen_whose_annotation_went_preempts_nothing() -> None:
    """Announced before its gate ran, it would have waited in the queue for ever (no gate
    asks once its drop-in went), stopping less urgent units for an unmanaged one."""
    low = spec("low", 50)
    w = spec("w", 10)
    s = Scheduler([sized(0)], {low.name: low, w.name: w})
    s.request(low)
    s.request(spec("top", 5))  # low stops for top; w's start job is seen meanwhile
    s.announce(w)
    s.set_specs({low.name: low, "top.service": spec("top", 5)})
    assert brief(s.inactive("low.service", Outcome.STOPPED)) == ["grant top.service 0"]
    assert brief(s.inactive("top.service", Outcome.EXITED)) == ["start low.service"]
    assert s.grants() == {"low.service": frozenset({0})}


def test_a_requeue_whose_annotation_went_is_not_taken_for_ours_after_it_comes_back() -> None:
    """a.service's requeue was withdrawn with its annotation (stopped); annotated again before
    it is down, a restarted controller must not send that start again as its own."""
    a = spec("a", 50)
    v = spec("v", 10)
    s = Scheduler([sized(0)], {a.name: a, v.name: v})
    s.request(a)
    s.request(v)
    s.inactive("a.service", Outcome.STOPPED)
    assert brief(s.inactive("v.service", Outcome.EXITED)) == ["start a.service"]
    assert brief(s.set_specs({v.name: v})) == ["stop a.service"]
    s.set_specs({a.name: a, v.name: v})
    assert s.phase("a.service") is Phase.STOPPING
    assert s.save().started == []


def test_a_restart_forgets_a_start_on_its_way_whose_annotation_went() -> None:
    """Only a unit that runs is kept: a start still on its way runs ungated now, with no
    GPUs of gpuslice's (as set_specs does)."""
    saved = SavedState(
        holders={"a.service": ((0,), "starting", 1, ""), "b.service": ((1,), "running", 2, "")},
        seq=2,
    )
    b = spec("b", 50)
    fresh = Scheduler([sized(0), sized(1)], {b.name: b})
    fresh.load(saved)
    assert fresh.grants() == {"b.service": frozenset({1})}  # the holders after it are kept


def test_a_start_of_gpuslices_own_whose_annotation_went_is_stopped_keeping_its_gpu() -> None:
    """A refill on its way (its place kept) when the annotation goes: gpuslice starts no
    unannotated unit, so its start is stopped; let through, it would run ungated on GPU 0
    while the GPU went to the next unit. GPU 0 stays its until it is down; then it is
    forgotten, not restarted, and the GPU goes on."""
    a, b = spec("a", 50, BG), spec("b", 60, BG)
    s = Scheduler([sized(0)], {a.name: a, b.name: b})
    assert brief(s.schedule()) == ["start a.service"]
    actions = s.set_specs({b.name: b})
    assert brief(actions) == ["stop a.service"]
    (stop,) = [x for x in actions if isinstance(x, Stop)]
    assert stop.decision == Decision(
        Code.UNMANAGED, "a.service", 50, gpus=(0,), cause=Cause.WITHDRAWN
    )
    assert stop.reason == (
        "a.service is no longer annotated: stopping the start gpuslice gave it; "
        "it keeps GPU 0 until it is down"
    )
    assert s.grants() == {"a.service": frozenset({0})}
    assert s.save().started == []
    down = s.inactive("a.service", Outcome.STOPPED)
    assert brief(down) == ["start b.service"]
    assert not [x for x in down if isinstance(x, Log)]  # no "Requeue=no, not restarting"
    assert "a.service" not in s.preempted and "a.service" not in s.held


def test_a_start_of_gpuslices_own_whose_annotation_went_while_it_was_away_is_stopped() -> None:
    """The same after a controller restart: the saved start of its own is withdrawn at load
    (its gate, when it asks, is stopped by the controller), keeping its GPU until it is down."""
    saved = SavedState(
        holders={"a.service": ((0,), "starting", 1, "")}, seq=1, started=["a.service"]
    )
    fresh = Scheduler([sized(0)], {})
    fresh.load(saved)
    assert fresh.phase("a.service") is Phase.STOPPING
    assert fresh.grants() == {"a.service": frozenset({0})}
    assert fresh.start_lost("a.service") == []  # never sent again
    assert brief(fresh.inactive("a.service", Outcome.STOPPED)) == []
    assert "a.service" not in fresh.preempted


def test_a_wait_behind_a_unit_stopping_for_another_is_data() -> None:
    s = Scheduler([sized(0)], {})
    s.request(spec("y", 50))
    s.request(spec("z", 10))  # y stops for z
    s.request(spec("w", 30))
    reason = s.snapshot().reasons["w.service"]
    assert (reason.code, reason.cause) == (Code.WAIT, Cause.BUSY)
    assert [(p.kind, p.gpus, p.unit, p.priority) for p in reason.parts] == [
        (Blocker.STOPPING, (0,), "y.service", 50)
    ]


def test_a_wait_behind_an_earlier_equal_is_kept_data() -> None:
    s = Scheduler([sized(0), sized(1)], {})
    s.request(spec("x", 10, devices=("0",)))
    s.request(spec("first", 30, gpus=2))  # waits for x, keeps GPU 1
    s.request(spec("second", 30))
    reason = s.snapshot().reasons["second.service"]
    assert [(p.kind, p.gpus, p.priority) for p in reason.parts] == [
        (Blocker.HELD, (0,), 10),
        (Blocker.KEPT, (1,), 30),
    ]


def test_decisions_about_units_known_only_by_name() -> None:
    a = spec("a", 50)
    s = Scheduler([sized(0)], {a.name: a})
    (log,) = s.inactive("nobody.service", Outcome.STOPPED)
    assert isinstance(log, Log) and log.decision == Decision(Code.HOLD, "nobody.service")
    s.request(a)
    (log, *_) = s.inactive("a.service", Outcome.STOPPED)
    assert isinstance(log, Log) and log.decision == Decision(Code.HOLD, "a.service", 50)


def test_a_background_unit_too_big_for_the_host_does_not_stop_the_refill() -> None:
    big = spec("a-big", 10, BG, gpus=2)
    small = spec("b-small", 20, BG)
    s = Scheduler([sized(0)], {big.name: big, small.name: small})
    assert brief(s.schedule()) == ["start b-small.service"]


def test_a_unit_brought_back_is_the_most_recently_started_of_equal_victims() -> None:
    p = spec("p", 50, devices=("0",))
    q = spec("q", 50, devices=("1",))
    s = Scheduler([sized(0), sized(1)], {p.name: p, q.name: q})
    s.request(q)
    s.request(p)
    s.request(spec("u1", 10, devices=("0",)))
    s.inactive("p.service", Outcome.STOPPED)
    assert brief(s.inactive("u1.service", Outcome.EXITED)) == ["start p.service"]
    s.request(p)  # its gate asked: it runs again, the most recently started
    assert brief(s.request(spec("u2", 10))) == ["stop p.service"]


def test_a_unit_whose_gate_was_not_answered_waits_again_instead_of_being_stopped() -> None:
    p = spec("p", 50)
    s = Scheduler([sized(0)], {p.name: p})
    s.request(spec("u1", 10))
    s.request(p)
    s.inactive("u1.service", Outcome.EXITED)  # p is granted: its gate is answered
    s.request(spec("u2", 10))  # p is stopped for u2
    s.inactive("p.service", Outcome.STOPPED)
    assert brief(s.inactive("u2.service", Outcome.EXITED)) == ["start p.service"]
    # p's start job runs, its gate has not asked: nothing of it ran, so it is not stopped
    assert brief(s.request(spec("u3", 10))) == ["grant u3.service 0"]
    assert s.is_waiting("p.service") and s.phase("p.service") is None
    assert brief(s.request(p)) == []  # its gate asks: it waits for u3
    assert brief(s.inactive("u3.service", Outcome.EXITED)) == ["grant p.service 0"]


def test_a_background_unit_yields_even_after_an_on_demand_one_listed_before_it() -> None:
    bg = spec("b", 90, BG)
    s = Scheduler([sized(0), sized(1)], {bg.name: bg})
    s.request(spec("a", 10, devices=("0",)))
    s.request(bg)
    foreign = sized(1, foreign_pids=(4242,))
    assert brief(s.set_gpus([sized(0, foreign_pids=(4243,)), foreign])) == ["stop b.service"]


def test_memory_exactly_used_up_reads_as_none_free() -> None:
    s = Scheduler([sized(0, foreign=24 * GIB)], {})
    s.request(spec("m", 10, mem_gib=4))
    (reason,) = [r for _, _, r in s.snapshot().waiting]
    assert "GPU 0 has 0 B free after the reserve" in reason


def test_a_background_waiter_kept_off_by_foreign_processes_keeps_no_gpu_back() -> None:
    """It cannot run while a foreign process uses one of the two GPUs it needs, so it keeps
    nothing from a less urgent unit that fits on the other GPU now."""
    wide, narrow = spec("wide", 50, BG, gpus=2), spec("narrow", 60, BG)
    s = Scheduler([sized(0, foreign_pids=(4242,)), sized(1)], {wide.name: wide})
    s.request(wide)
    assert brief(s.request(narrow)) == ["grant narrow.service 1"]


def test_a_preempted_unit_started_by_hand_is_no_longer_preempted() -> None:
    """Started by hand while it waits to come back, it queues like any start; once it has run
    and finished, nothing brings it back a second time."""
    p, u = spec("p", 50), spec("u", 10)
    s = Scheduler([sized(0)], {p.name: p, u.name: u})
    s.request(p)
    assert brief(s.request(u)) == ["stop p.service"]
    assert brief(s.inactive("p.service", Outcome.STOPPED)) == ["grant u.service 0"]
    assert brief(s.request(p)) == []  # waits behind u
    assert [name for name, _, _ in s.snapshot().preempted] == []
    assert brief(s.inactive("u.service", Outcome.EXITED)) == ["grant p.service 0"]
    assert brief(s.inactive("p.service", Outcome.EXITED)) == []
