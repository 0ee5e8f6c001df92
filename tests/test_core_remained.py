"""A unit systemd keeps active after its job ended (`RemainAfterExit=yes`, SubState
`exited`): its GPUs go to its waiters at once (`Scheduler.exited`), said once; it is no
holder while systemd shows it so, its later stop releases nothing, and a restart waits at
its gate as any start."""

from __future__ import annotations

from gpuslice.core.decisions import Cause, Code
from gpuslice.core.model import UnitSpec
from gpuslice.core.plan import Verdict, plan_start, summary
from gpuslice.core.scheduler import Log, Outcome, Phase, SavedState, Scheduler
from gpuslice.journal import decision_fields
from tests.core_builders import BG, brief, spec, words

A = spec("a", 50)
B = spec("b", 50)


def one_gpu(*specs: UnitSpec) -> Scheduler:
    return Scheduler([0], {s.name: s for s in specs})


def bg_running_beside_urgent() -> tuple[Scheduler, UnitSpec, UnitSpec]:
    """bg (90, background) refilled and past its gate on the one GPU; urgent (10) known,
    not yet asking. Returns the scheduler, bg and urgent."""
    bg = spec("bg", 90, BG)
    urgent = spec("urgent", 10)
    s = one_gpu(bg, urgent)
    s.schedule()
    s.request(bg)
    return s, bg, urgent


def test_its_gpus_go_to_its_waiter_and_it_is_recorded_finished_once() -> None:
    s = one_gpu(A, B)
    assert brief(s.request(A)) == ["grant a.service 0"]
    assert brief(s.request(B)) == []  # equal priority: it waits
    done = s.exited("a.service")
    assert brief(done) == ["grant b.service 0"]
    told = [a for a in done if isinstance(a, Log)]
    assert [(a.decision.code, a.decision.cause) for a in told if a.decision] == [
        (Code.FINISHED, Cause.REMAINS)
    ]
    assert words(told) == [
        "a.service finished: released GPU 0; systemd keeps it active (RemainAfterExit=yes) "
        "until it is stopped, and a restart waits at its gate again"
    ]
    decision = told[0].decision
    assert decision is not None  # its unit's own journal shows it (journalctl -u a.service)
    fields = decision_fields(decision, told[0].message, told[0].level)
    assert ("OBJECT_SYSTEMD_UNIT", "a.service") in fields
    assert ("GPUSLICE_CAUSE", "remains-active") in fields
    assert s.phase("a.service") is None
    snap = s.snapshot()
    assert (snap.finished, snap.remained) == (["a.service"], ["a.service"])
    assert s.exited("a.service") == []  # said once: every later signal of it says the same


def test_systemd_showing_it_active_adopts_it_no_more_until_it_runs_again() -> None:
    """Only a run that starts again (its ExecReload=, systemd shows it running) holds
    GPUs again; its signals as it stays `exited` are not told the core (the tracker)."""
    s = one_gpu(A)
    s.request(A)
    s.exited("a.service")
    assert s.remained == {"a.service"}
    s.running("a.service")
    assert (s.phase("a.service"), s.remained) == (Phase.RUNNING, set())


def test_its_later_stop_releases_nothing_and_is_no_hold() -> None:
    s = one_gpu(A)
    s.request(A)
    s.exited("a.service")
    assert s.inactive("a.service", Outcome.STOPPED) == []
    assert (s.held, s.finished, s.remained) == (set(), {"a.service"}, set())


def test_a_restart_waits_at_its_gate_as_any_start() -> None:
    s = one_gpu(A, B)
    s.request(A)
    s.exited("a.service")
    s.request(B)
    assert brief(s.announce(A)) == []  # `systemctl restart`: its start job
    assert brief(s.request(A)) == []  # its gate: b holds the GPU now
    assert s.is_waiting("a.service")
    assert (s.finished, s.remained) == (set(), set())
    assert brief(s.inactive("b.service", Outcome.EXITED)) == ["grant a.service 0"]


def test_a_background_unit_kept_active_is_not_started_again_by_refill() -> None:
    bg = spec("bg", 90, BG)
    s = one_gpu(bg)
    assert brief(s.schedule()) == ["start bg.service"]
    assert brief(s.request(bg)) == ["grant bg.service 0"]
    assert brief(s.exited("bg.service")) == []
    assert brief(s.schedule()) == []
    assert brief(s.inactive("bg.service", Outcome.STOPPED)) == []  # finished: as any end


def test_one_that_exits_while_being_preempted_keeps_its_gpus_then_is_owed_nothing() -> None:
    """Our stop is on its way: its waiter waits for its down (soon: nothing runs in it), and
    that down, though our stop's, ends finished work: no comeback that would run it again."""
    s, _, urgent = bg_running_beside_urgent()
    assert brief(s.request(urgent)) == ["stop bg.service"]
    assert s.exited("bg.service") == []
    assert s.phase("bg.service") is Phase.STOPPING
    done = s.inactive("bg.service", Outcome.EXITED)
    assert brief(done) == ["grant urgent.service 0"]
    assert (s.preempted, s.finished, s.remained) == ({}, {"bg.service"}, set())


def test_one_whose_stop_is_lost_after_it_exited_is_released_then() -> None:
    s, _, urgent = bg_running_beside_urgent()
    s.request(urgent)
    s.exited("bg.service")
    done = s.stop_failed("bg.service", "no stop job runs", refused=False)
    assert brief(done) == ["grant urgent.service 0"]
    assert (s.phase("bg.service"), s.remained) == (None, {"bg.service"})


def test_a_preempted_unit_adopted_then_released_is_owed_no_comeback() -> None:
    """Preempted, then found running (started by someone) and adopted, its job ends kept
    active: its work is done. Still owed a comeback, that start was a no-op to systemd (the
    unit active): its holder stayed starting, its waiter waited, for ever."""
    s = one_gpu(A, B)
    s.load(SavedState(preempted={"a.service": 1}, wait_failed=["a.service"], seq=2))
    s.running("a.service")
    assert brief(s.exited("a.service")) == []  # its comeback's start: none
    assert s.phase("a.service") is None
    assert (s.preempted, s.wait_failed, s.remained) == ({}, set(), {"a.service"})
    assert brief(s.schedule()) == []
    assert s.save().preempted == {}


def test_a_frozen_or_suspending_holder_is_not_released() -> None:
    """Its processes are frozen, or its VRAM moves: it cannot have ended (a signal read
    late says nothing of it now)."""
    frozen = spec("f", 90, preempt="freeze")
    s = one_gpu(frozen, A)
    s.request(frozen)
    s.holders["f.service"].phase = Phase.FROZEN
    assert s.exited("f.service") == []
    assert (s.phase("f.service"), s.remained) == (Phase.FROZEN, set())


def test_a_unit_found_so_with_nothing_known_holds_nothing() -> None:
    s = one_gpu(A)
    assert s.exited("a.service") == []
    assert (s.remained, s.finished) == ({"a.service"}, set())
    assert s.exited("nobody.service") == []  # not annotated: not the core's
    assert s.remained == {"a.service"}


def test_a_restarted_controller_remembers_it_and_a_new_boot_forgets_it() -> None:
    s = one_gpu(A, B)
    s.request(A)
    s.exited("a.service")
    saved = s.save()
    assert saved.remained == ["a.service"]
    again = one_gpu(A, B)
    again.load(saved)
    assert (again.remained, again.phase("a.service")) == ({"a.service"}, None)
    assert brief(again.request(B)) == ["grant b.service 0"]
    assert one_gpu(A, B).ended_with_boot(saved).remained == []
    again.forget_boot()
    assert again.remained == set()


def test_its_annotation_going_forgets_it() -> None:
    s = one_gpu(A)
    s.request(A)
    s.exited("a.service")
    s.set_specs({})
    assert (s.remained, s.finished) == (set(), set())


def test_gpuslice_plan_says_a_start_would_change_nothing() -> None:
    """`systemctl start` of a unit systemd shows active is a no-op: no gate asks."""
    s = one_gpu(A)
    s.request(A)
    s.exited("a.service")
    plan = plan_start(s, A)
    assert (plan.verdict, plan.phase, plan.gpus) == (Verdict.HOLDS, "exited", ())
    said = "a.service (priority 50) is already exited: a start would change nothing"
    assert summary(plan) == said


def test_a_restarted_controller_still_takes_our_stops_end_for_its_own_end() -> None:
    s, bg, urgent = bg_running_beside_urgent()
    s.request(urgent)
    s.exited("bg.service")
    again = one_gpu(bg, urgent)
    again.load(s.save())
    assert (again.phase("bg.service"), again.remained) == (Phase.STOPPING, {"bg.service"})
    again.inactive("bg.service", Outcome.EXITED)
    assert (again.preempted, again.finished) == ({}, {"bg.service"})


def test_a_waiter_shown_exited_is_no_remained_unit_and_is_granted_later() -> None:
    """Only a unit that holds nothing and waits for nothing is recorded remained: a waiter
    told `exited` (a stale signal) still waits, and is granted when the GPU frees."""
    s = one_gpu(A, B)
    s.request(A)
    s.request(B)
    assert s.exited("b.service") == []
    assert (s.snapshot().remained, s.is_waiting("b.service")) == ([], True)
    assert brief(s.inactive("a.service", Outcome.EXITED)) == ["grant b.service 0"]


def test_its_end_clears_every_mark_of_its_run() -> None:
    """A run that ended keeps none of its marks (refused stop, failed freeze or suspend,
    thaw owed, started by us): its next run starts clean, and it left the GPUs last."""
    s = one_gpu(A)
    s.request(A)
    before = s.out_since.get("a.service", -1)
    marks = (s.unstoppable, s.unfreezable, s.unsuspendable, s.thaw_owed)
    ours = (s.started, s.refills, s.requeued)
    for marked in (*marks, *ours):
        marked.add("a.service")
    s.exited("a.service")
    assert [("a.service" in m) for m in (*marks, *ours)] == [False] * 7
    assert s.out_since["a.service"] > before
