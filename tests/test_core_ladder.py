"""The Preempt= ladder in the core: suspend, freeze, and what happens when a rung fails.

Played on the pure scheduler: the adapter's reports (`suspended_done`, `suspend_failed`,
`resumed`, `resume_failed`, `freeze_failed`) are called as the controller would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from gpuslice.core.decisions import Code, Decision, render
from gpuslice.core.model import Gpu, UnitKind, UnitSpec
from gpuslice.core.scheduler import (
    Freeze,
    Grant,
    Log,
    Outcome,
    Phase,
    Resume,
    SavedState,
    Scheduler,
    Stop,
    Suspend,
    Thaw,
)
from tests.core_builders import BG, GIB, OD, brief, sized, spec, words

VLM = spec("vlm", 90, BG, preempt="suspend stop")
VOICE = spec("voice", 10)
V, VO = VLM.name, VOICE.name


def host(*specs: UnitSpec, gpus: list[Gpu] | None = None) -> Scheduler:
    return Scheduler(gpus if gpus is not None else [sized(0)], {s.name: s for s in specs})


def codes(actions: Sequence[object]) -> list[Code]:
    return [a.decision.code for a in actions if isinstance(a, Log) and a.decision is not None]


def running(s: Scheduler, *specs: UnitSpec) -> None:
    for unit in specs:
        assert brief(s.request(unit))[0].startswith(f"grant {unit.name}")


def frozen_beside_voice(
    preempt: str = "freeze stop",
    *,
    kind: UnitKind = BG,
    others: Sequence[UnitSpec] = (),
    later: Sequence[UnitSpec] = (),
) -> tuple[Scheduler, UnitSpec, UnitSpec]:
    """emb.service (8 GiB, `preempt`) runs on GPU 0 and `others` on a GPU each after it;
    voice.service (8 GiB) is granted GPU 0 beside emb.service, which is frozen for it.
    `later` are known, not yet asked for."""
    emb = spec("emb", 90, kind, mem_gib=8, preempt=preempt)
    voice = spec("voice", 10, mem_gib=8)
    s = host(emb, *others, voice, *later, gpus=[sized(i) for i in range(1 + len(others))])
    running(s, emb, *others)
    acts = brief(s.request(voice))
    assert acts[0] == f"grant {VO} 0" and acts[-1] == "freeze emb.service", acts
    return s, emb, voice


def test_a_unit_with_suspend_first_is_suspended_not_stopped_and_resumed_on_its_gpu() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    acts = s.request(VOICE)
    assert brief(acts) == [f"suspend {V} 0"]
    assert s.phase(V) is Phase.SUSPENDING
    assert words(acts)[0] == (
        "moving the VRAM of vlm.service (priority 90) on GPU 0 to host memory for "
        "voice.service (priority 10)"
    )
    assert s.snapshot().waiting[0][2] == (
        "waiting for vlm.service (priority 90) to be suspended on GPU 0"
    )
    acts = s.suspended_done(V, "14.2 GiB to host memory in 2.1 s")
    assert brief(acts) == [f"grant {VO} 0"]
    assert words(acts)[0] == (
        "suspending vlm.service (priority 90) for voice.service (priority 10): "
        "14.2 GiB to host memory in 2.1 s"
    )
    assert s.phase(V) is Phase.SUSPENDED
    assert s.snapshot().suspended == [(V, 90, (0,))]
    acts = s.inactive(VO, Outcome.EXITED)
    assert brief(acts) == [f"resume {V} 0"]  # never a Start: it is still running
    assert s.phase(V) is Phase.RESUMING
    acts = s.resumed(V, "6 s: restored in 1.3 s")
    assert words(acts) == ["resuming vlm.service on GPU 0 after 6 s: restored in 1.3 s"]
    assert s.phase(V) is Phase.RUNNING
    assert s.preempted == {}
    assert s.thaws_owed() == [V]  # its ThawUnit may have failed: until systemd shows it running
    s.thaw_done(V)
    assert s.thaws_owed() == []


def test_a_failed_suspend_falls_to_stop_with_one_line_saying_why() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    acts = s.suspend_failed(V, "cuda-checkpoint is not installed")
    assert brief(acts) == [f"stop {V}"]
    assert words(acts)[0] == (
        "cannot suspend vlm.service (priority 90) for voice.service (priority 10): "
        "cuda-checkpoint is not installed; trying stop instead"
    )
    assert codes(acts) == [Code.RUNG_FAILED, Code.WAIT]  # and its waiter's new reason
    assert brief(s.inactive(V, Outcome.STOPPED)) == [f"grant {VO} 0"]
    assert brief(s.inactive(VO, Outcome.EXITED)) == [f"start {V}"]  # requeued as today


def test_a_waiter_whose_victim_s_suspend_fell_to_stop_is_told_it_waits_for_the_stop() -> None:
    """Told it waits for a suspend, the waiter is told (and status shows) that it waits for
    a stop once the suspend failed and the unit is stopped, as if the stop was the rung the
    pass chose; before, it went on saying "to be suspended" while vlm.service was stopped."""
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    stopping = "voice.service waiting for vlm.service (priority 90) to stop on GPU 0"
    assert words(s.suspend_failed(V, "cuda-checkpoint is not installed"))[-1] == stopping
    assert s.snapshot().waiting == [(VO, 10, stopping.removeprefix(f"{VO} "))]
    only = dataclasses.replace(VLM, preempt=VLM.preempt[1:])  # the stop rung alone
    plain = host(only, VOICE)
    running(plain, only)
    assert brief(plain.request(VOICE)) == [f"stop {V}"]
    assert s.waiting(VO).decision == plain.waiting(VO).decision


def test_a_ladder_without_stop_keeps_its_gpus_when_suspend_fails() -> None:
    only = spec("vlm", 90, BG, preempt="suspend")
    s = host(only, VOICE)
    running(s, only)
    s.request(VOICE)
    acts = s.suspend_failed(V, "lock of PID 7 timed out after 10 s")
    assert brief(acts) == []
    assert words(acts)[0].endswith(
        "lock of PID 7 timed out after 10 s; it keeps GPU 0 (Preempt= names no other way)"
    )
    assert s.phase(V) is Phase.RUNNING
    assert "vlm.service, priority 90 (refused to stop)" in s.snapshot().waiting[0][2]
    assert brief(s.schedule()) == []  # not tried again while it runs


def test_a_unit_that_may_only_freeze_is_never_a_victim_for_memory() -> None:
    frozen_only = spec("vlm", 90, BG, preempt="freeze")
    s = host(frozen_only, VOICE)
    running(s, frozen_only)
    assert brief(s.request(VOICE)) == []
    assert s.is_waiting(VO)


def test_freeze_when_the_urgent_unit_fits_beside_and_thaw_when_it_leaves() -> None:
    emb = spec("emb", 90, BG, mem_gib=8, preempt="freeze stop")
    voice = spec("voice", 10, mem_gib=8)
    s = host(emb, voice)
    running(s, emb)
    acts = s.request(voice)
    assert brief(acts) == [f"grant {VO} 0", "freeze emb.service"]
    assert words(acts)[1] == (
        "freezing emb.service (priority 90) on GPU 0 for voice.service (priority 10): "
        "it keeps its VRAM and runs again when that unit has left"
    )
    assert s.phase("emb.service") is Phase.FROZEN
    acts = s.inactive(VO, Outcome.EXITED)
    assert brief(acts) == ["thaw emb.service"]
    assert s.phase("emb.service") is Phase.RUNNING


def test_a_thawed_unit_is_owed_its_thaw_until_systemd_shows_it_running() -> None:
    """The core takes a Thaw as done when it decides it; systemd may not have done it (a
    ThawUnit that failed, or that a controller killed after its save never sent). Until the
    adapter reports the unit running (`thaw_done`) it is owed one, across a restart too;
    one frozen again is the freeze's, and one that ends is owed nothing."""
    s, emb, voice = frozen_beside_voice()
    assert s.thaws_owed() == []  # held frozen: not owed
    assert brief(s.inactive(VO, Outcome.EXITED)) == ["thaw emb.service"]
    assert s.thaws_owed() == ["emb.service"]
    assert s.save().thaw_owed == ["emb.service"]
    after = host(emb, voice)
    after.load(s.save())
    assert after.thaws_owed() == ["emb.service"]
    assert after.thaw_done("emb.service") == []
    assert after.thaws_owed() == [] and after.save().thaw_owed == []
    s.request(voice)  # frozen again: the freeze's now
    assert s.phase("emb.service") is Phase.FROZEN and s.thaws_owed() == []
    s.inactive("emb.service", Outcome.STOPPED)  # systemd thaws a unit to stop it
    assert s.thaws_owed() == [] and "emb.service" not in s.thaw_owed


def test_a_freeze_answered_after_its_run_ended_owes_the_next_run_a_thaw() -> None:
    """The ladder's FreezeUnit answered after the unit went down (a restart): it may have
    frozen the new run, which the core holds running. Owed a thaw, so that the adapter
    looks; a unit the core no longer knows is owed nothing (not kept for ever)."""
    s, _, _ = frozen_beside_voice()
    s.inactive("emb.service", Outcome.STOPPED)
    assert s.froze_after_end("emb.service") == []
    assert s.thaws_owed() == [] and "emb.service" not in s.thaw_owed
    s, emb, _ = frozen_beside_voice()
    s.inactive("emb.service", Outcome.STOPPED)
    running(s, emb)  # its new run
    assert s.froze_after_end("emb.service") == []
    assert s.thaws_owed() == ["emb.service"]


def test_a_unit_someone_else_froze_is_owed_no_thaw_and_runs_in_the_books() -> None:
    """The adapter found the unit frozen by someone (`systemctl freeze`) before its freeze:
    held as running (it keeps its GPUs and VRAM), not frozen again while it runs, and owed
    no thaw: gpuslice thaws only what it froze."""
    s, _, _ = frozen_beside_voice()
    acts = s.freeze_failed("emb.service", "frozen already, by someone else", not_ours=True)
    assert codes(acts) == [Code.RUNG_FAILED]
    assert s.phase("emb.service") is Phase.RUNNING
    assert s.thaws_owed() == [] and "emb.service" not in s.thaw_owed
    assert "emb.service" in s.unfreezable
    assert brief(s.inactive(VO, Outcome.EXITED)) == []  # no thaw when voice leaves


def test_a_freeze_of_a_unit_owed_a_thaw_says_so() -> None:
    """Thawed (voice left), then frozen again before the thaw was seen done: the adapter
    must not take its frozen state for someone else's."""
    s, _, voice = frozen_beside_voice()
    assert brief(s.inactive(VO, Outcome.EXITED)) == ["thaw emb.service"]
    [_, freeze] = [a for a in s.request(voice) if isinstance(a, (Grant, Freeze))]
    assert isinstance(freeze, Freeze) and freeze.thaw_owed
    s.thaw_done("emb.service")
    s.inactive(VO, Outcome.EXITED)
    s.thaw_done("emb.service")
    [freeze] = [a for a in s.request(voice) if isinstance(a, Freeze)]
    assert not freeze.thaw_owed


def test_a_failed_freeze_or_suspend_leaves_a_thaw_owed() -> None:
    """A FreezeUnit not answered, or a suspend that failed after its freeze or before its
    thaw, may have left the unit frozen while the core holds it running: owed a thaw, so
    that the adapter looks."""
    s, _, _ = frozen_beside_voice()
    s.freeze_failed("emb.service", "FreezeUnit did not answer within 30 s")
    assert s.thaws_owed() == ["emb.service"]
    only_suspend = spec("vlm", 90, BG, preempt="suspend")
    s = host(only_suspend, VOICE)
    running(s, only_suspend)
    s.request(VOICE)
    s.suspend_failed(V, "FreezeUnit failed")
    assert s.phase(V) is Phase.RUNNING and s.thaws_owed() == [V]


def test_a_frozen_unit_whose_stop_fails_is_owed_a_thaw() -> None:
    """emb.service, frozen beside voice.service, must go for a more urgent unit: its stop
    is refused (RefuseManualStop=yes) or cancelled. The core holds it running again, and
    systemd, which thaws a unit only once it stops it, still has it frozen: owed a thaw,
    or it stays frozen for good, a stuck job that status shows running."""
    big = spec("big", 5, mem_gib=16)
    s, _, _ = frozen_beside_voice(later=[big])
    assert s.phase("emb.service") is Phase.FROZEN
    assert "stop emb.service" in brief(s.request(big))
    assert s.phase("emb.service") is Phase.STOPPING
    s.stop_failed("emb.service", "refused", refused=True)
    assert s.phase("emb.service") is Phase.RUNNING
    assert s.thaws_owed() == ["emb.service"]
    # a suspend that failed half way, then its stop rung, which fails too
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    assert brief(s.suspend_failed(V, "FreezeUnit did not answer within 30 s"))[-1] == f"stop {V}"
    s.stop_failed(V, "refused", refused=True)
    assert s.phase(V) is Phase.RUNNING and s.thaws_owed() == [V]


THEIRS = "frozen already, by someone else (systemctl freeze): theirs to thaw"


def test_a_unit_someone_else_froze_chosen_for_suspend_is_stopped_and_owed_no_thaw() -> None:
    """The adapter found the unit to suspend frozen by someone (`systemctl freeze`) and sent
    nothing: its suspend failed, and it falls to the next rung of Preempt= as for any
    failed suspend (a stop, which systemd begins with a thaw); owed no thaw by gpuslice,
    also should that stop fail (the thaw owed after a failed suspend undid their freeze)."""
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    acts = s.suspend_failed(V, THEIRS, not_ours=True)
    assert brief(acts) == [f"stop {V}"]
    assert words(acts)[0] == (
        f"cannot suspend vlm.service (priority 90) for voice.service (priority 10): {THEIRS}; "
        "trying stop instead"
    )
    s.stop_failed(V, "refused", refused=True)
    assert s.phase(V) is Phase.RUNNING and s.thaws_owed() == [] and V not in s.thaw_owed


def test_a_unit_someone_else_froze_with_suspend_alone_keeps_its_gpus_owed_no_thaw() -> None:
    only = spec("vlm", 90, BG, preempt="suspend")
    s = host(only, VOICE)
    running(s, only)
    s.request(VOICE)
    acts = s.suspend_failed(V, THEIRS, not_ours=True)
    assert brief(acts) == []
    assert words(acts)[0].endswith(f"{THEIRS}; it keeps GPU 0 (Preempt= names no other way)")
    assert s.phase(V) is Phase.RUNNING and s.thaws_owed() == [] and V not in s.thaw_owed


def test_a_unit_someone_else_froze_whose_undo_lost_a_process_is_owed_no_thaw() -> None:
    """Frozen by someone after the adapter's look, during the lock, whose undo then left a
    process locked (lost): stopped as after any lost undo, and owed no thaw should that stop
    fail (the sample's thaws-owed check undid their freeze)."""
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    acts = s.suspend_failed(V, THEIRS, lost=True, not_ours=True)
    assert brief(acts) == [f"stop {V}"]
    s.stop_failed(V, "refused", refused=True)
    assert s.phase(V) is Phase.RUNNING and s.thaws_owed() == [] and V not in s.thaw_owed
    # ours (a freeze that hung): owed one
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    assert brief(s.suspend_failed(V, "FreezeUnit hung", lost=True)) == [f"stop {V}"]
    s.stop_failed(V, "refused", refused=True)
    assert s.thaws_owed() == [V]


def test_a_suspend_of_a_unit_owed_a_thaw_says_so() -> None:
    """Thawed (voice left), then chosen for a suspend before the thaw was seen done (its
    ThawUnit under way, or failed): the adapter must not take its frozen state for someone
    else's, which fell to a stop a suspend that would have worked."""
    big = spec("big", 5, mem_gib=20)
    s, _, _ = frozen_beside_voice("freeze suspend stop", later=[big])
    assert brief(s.inactive(VO, Outcome.EXITED)) == ["thaw emb.service"]
    [suspend] = [a for a in s.request(big) if isinstance(a, Suspend)]
    assert suspend.thaw_owed and not suspend.thaw_first
    s, _, _ = frozen_beside_voice("freeze suspend stop", later=[big])
    s.inactive(VO, Outcome.EXITED)
    s.thaw_done("emb.service")
    [suspend] = [a for a in s.request(big) if isinstance(a, Suspend)]
    assert not suspend.thaw_owed


@pytest.mark.parametrize(
    ("mem_gib", "preempt", "expected"),
    [
        pytest.param(
            8,
            "suspend stop",
            [f"grant {VO} 0"],
            id="a_unit_without_freeze_shares_its_gpu_as_before",
        ),
        pytest.param(
            20,
            "freeze stop",
            ["stop emb.service"],
            id="freeze_does_not_apply_when_the_memory_is_needed_the_next_rung_does",
        ),
    ],
)
def test_a_running_unit_when_an_urgent_one_asks_for_its_gpu(
    mem_gib: int, preempt: str, expected: list[str]
) -> None:
    """emb.service runs on GPU 0 when voice.service (8 GiB) asks for it: a unit without
    freeze shares its GPU as before; freeze does not apply when the memory is needed, the
    next rung does."""
    emb = spec("emb", 90, BG, mem_gib=mem_gib, preempt=preempt)
    voice = spec("voice", 10, mem_gib=8)
    s = host(emb, voice)
    running(s, emb)
    assert brief(s.request(voice)) == expected


def test_a_frozen_unit_whose_memory_is_needed_is_suspended() -> None:
    big = spec("big", 5, mem_gib=16)
    s, _, _ = frozen_beside_voice("freeze suspend stop", later=[big])
    assert s.phase("emb.service") is Phase.FROZEN
    assert brief(s.request(big)) == ["suspend emb.service 0"]


def test_a_failed_freeze_leaves_it_running_beside_and_is_not_tried_again() -> None:
    voice2 = spec("voice2", 10, mem_gib=8)
    s, _, _ = frozen_beside_voice(later=[voice2])
    acts = s.freeze_failed("emb.service", "the unit is not active")
    assert brief(acts) == []
    assert words(acts) == [
        "cannot freeze emb.service (priority 90) for voice.service (priority 10): "
        "the unit is not active; it keeps running beside it"
    ]
    assert s.phase("emb.service") is Phase.RUNNING
    assert brief(s.request(voice2)) == [f"grant {voice2.name} 0"]


def test_a_waiter_kept_out_by_a_suspended_unit_is_told_which() -> None:
    """A suspended unit that cannot come back yet (a process gpuslice does not manage took
    memory where it was) keeps its room from less urgent units: a waiter's reason names it
    instead of saying nothing ("waiting: ")."""
    vlm = spec("vlm", 20, mem_gib=20, preempt="suspend stop")
    late = spec("late", 50)
    s = host(vlm, VOICE, late)
    running(s, vlm)
    assert brief(s.request(VOICE)) == ["suspend vlm.service 0"]
    assert brief(s.suspended_done("vlm.service", "20 GiB to host memory in 3 s")) == [
        f"grant {VO} 0"
    ]
    assert brief(s.set_gpus([sized(0, foreign=10 * GIB)])) == []
    assert brief(s.inactive(VO, Outcome.EXITED)) == []  # 14 GiB free: vlm cannot come back
    acts = s.request(late)
    assert brief(acts) == []
    assert words(acts) == [
        "late.service waiting: GPU 0 kept for suspended vlm.service, priority 20"
    ]


def test_a_suspended_unit_comes_back_though_a_waiter_as_urgent_cannot_run_yet() -> None:
    """README: a suspended unit comes back as soon as its memory fits and no more urgent
    unit waits. A waiter of its own priority that cannot run yet (foreign memory) keeps
    nothing from it: it ran before that waiter came."""
    vlm = spec("vlm", 20, mem_gib=8, preempt="suspend stop")
    big = spec("big", 20, gpus=2, mem_gib=20)
    voice = spec("voice", 10, devices=("0",))
    s = host(vlm, big, voice, gpus=[sized(0), sized(1)])
    assert brief(s.request(vlm)) == ["grant vlm.service 0"]
    assert brief(s.request(big)) == []  # 8 + 20 GiB do not fit on GPU 0; equal: it waits
    assert brief(s.request(voice)) == ["suspend vlm.service 0"]
    assert brief(s.suspended_done("vlm.service", "8 GiB to host memory in 1 s")) == [
        "grant voice.service 0"
    ]
    assert brief(s.set_gpus([sized(0), sized(1, foreign=10 * GIB)])) == []
    # GPU 1 has 14 GiB free: big cannot run anywhere; vlm fits where it was
    assert brief(s.inactive("voice.service", Outcome.EXITED)) == ["resume vlm.service 0"]


def frozen_in_turn(low: str, mid: str) -> Scheduler:
    """`low` (90, background) frozen for `mid` (20), then `mid` frozen for top (10); all
    three declare 4 GiB on one GPU, `low` and `mid` give way by freeze, then stop."""
    bg = spec(low, 90, BG, mem_gib=4, preempt="freeze stop")
    between = spec(mid, 20, mem_gib=4, preempt="freeze stop")
    top = spec("top", 10, mem_gib=4)
    s = host(bg, between, top)
    running(s, bg)
    assert brief(s.request(between)) == [f"grant {mid}.service 0", f"freeze {low}.service"]
    assert brief(s.request(top)) == ["grant top.service 0", f"freeze {mid}.service"]
    return s


def test_a_unit_frozen_beside_one_whose_own_freeze_failed_stays_frozen_while_it_runs() -> None:
    """emb is frozen for mid; top comes, and mid's own freeze for it fails: mid runs on.
    When top leaves, emb stays frozen: mid, more urgent, still runs beside it."""
    s = frozen_in_turn("emb", "mid")
    assert brief(s.freeze_failed("mid.service", "the unit is not active")) == []
    assert brief(s.inactive("top.service", Outcome.EXITED)) == []
    assert s.phase("emb.service") is Phase.FROZEN
    assert brief(s.inactive("mid.service", Outcome.EXITED)) == ["thaw emb.service"]


def test_units_frozen_in_turn_are_thawed_most_urgent_first() -> None:
    """Both frozen for top (b also for a, a for top): when top leaves, a is thawed first,
    and b, frozen for a, which runs again, stays frozen, whatever the names' order."""
    s = frozen_in_turn("a-bg", "z-mid")
    assert brief(s.inactive("top.service", Outcome.EXITED)) == ["thaw z-mid.service"]
    assert s.phase("a-bg.service") is Phase.FROZEN


def test_a_unit_thawed_by_hand_counts_as_running_and_is_not_frozen_again() -> None:
    voice2 = spec("voice2", 10, mem_gib=4)
    s, _, _ = frozen_beside_voice(later=[voice2])
    assert s.frozen_units() == ["emb.service"]
    assert words(s.thawed_outside("emb.service")) == [
        "emb.service (priority 90) was thawed outside gpuslice: it runs beside the units it "
        "was frozen for and is not frozen again while it runs"
    ]
    assert s.phase("emb.service") is Phase.RUNNING
    assert brief(s.request(voice2)) == [f"grant {voice2.name} 0"]  # no freeze again
    assert brief(s.inactive(VO, Outcome.EXITED)) == []  # and no thaw
    assert s.thawed_outside("emb.service") == []  # running: nothing to say


def test_a_suspended_unit_thawed_by_hand_still_waits_for_its_memory() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    s.suspended_done(V, "")
    assert s.frozen_units() == [V]
    assert words(s.thawed_outside(V)) == [
        "vlm.service (priority 90) was thawed outside gpuslice while suspended: its CUDA calls "
        "wait until its memory is restored on GPU 0, as soon as it fits there"
    ]
    assert s.phase(V) is Phase.SUSPENDED
    assert brief(s.inactive(VO, Outcome.EXITED)) == [f"resume {V} 0"]


def test_a_suspended_unit_thawed_by_hand_is_said_once_per_suspend() -> None:
    """The controller reads the FreezerState of every suspended unit at each sample (2 s):
    one found thawed was said again at each, a journal line (and a state save) every
    sample for as long as its memory did not fit. Said once; suspended anew, once again."""
    vlm = spec("vlm", 90, BG, mem_gib=8, preempt="suspend stop")
    voice = spec("voice", 10, mem_gib=8)
    s = host(vlm, voice, gpus=[sized(0, 12)])
    running(s, vlm)
    s.request(voice)
    s.suspended_done(V, "")
    assert codes(s.thawed_outside(V)) == [Code.THAWED_OUTSIDE]
    assert s.thawed_outside(V) == []  # the next sample's look: said already
    assert s.thawed_outside(V) == []
    assert brief(s.inactive(VO, Outcome.EXITED)) == [f"resume {V} 0"]
    s.resumed(V, "")
    s.request(voice)
    s.suspended_done(V, "")
    assert codes(s.thawed_outside(V)) == [Code.THAWED_OUTSIDE]  # a new suspend: said again


def test_the_thaw_waits_for_every_unit_it_was_frozen_for() -> None:
    emb = spec("emb", 90, BG, mem_gib=4, preempt="freeze stop")
    a, b = spec("a", 10, mem_gib=4), spec("b", 20, mem_gib=4)
    s = host(emb, a, b)
    running(s, emb, a, b)
    assert s.holders["emb.service"].frozen_for == {a.name, b.name}
    assert brief(s.inactive(a.name, Outcome.EXITED)) == []
    assert brief(s.inactive(b.name, Outcome.EXITED)) == ["thaw emb.service"]


def test_suspended_units_come_back_most_urgent_first_as_memory_frees() -> None:
    a = spec("a", 80, BG, mem_gib=10, preempt="suspend stop")
    b = spec("b", 90, BG, mem_gib=10, preempt="suspend stop")
    u1, u2 = spec("u1", 10, mem_gib=12), spec("u2", 20, mem_gib=12)
    s = host(a, b, u1, u2)
    running(s, a, b)
    assert brief(s.request(u1)) == ["suspend b.service 0"]
    assert brief(s.suspended_done(b.name, "")) == [f"grant {u1.name} 0"]
    assert brief(s.request(u2)) == ["suspend a.service 0"]
    assert brief(s.suspended_done(a.name, "")) == [f"grant {u2.name} 0"]
    # u1 leaves: 12 GiB free, room for one of them: the more urgent
    assert brief(s.inactive(u1.name, Outcome.EXITED)) == ["resume a.service 0"]
    s.resumed(a.name, "")
    assert brief(s.inactive(u2.name, Outcome.EXITED)) == ["resume b.service 0"]


def test_a_suspended_unit_keeps_its_room_from_less_urgent_background_units() -> None:
    filler = spec("filler", 95, BG)
    s = host(VLM, VOICE, filler)
    s.preempted = {}
    running(s, VLM)
    s.request(VOICE)
    s.suspended_done(V, "")
    acts = s.inactive(VO, Outcome.EXITED)
    assert brief(acts) == [f"resume {V} 0"]  # not the filler


def suspending_two(first: UnitSpec, second: UnitSpec) -> tuple[Scheduler, UnitSpec]:
    """FIRST and SECOND (10 GiB each, Preempt=suspend) run on GPU 0 and u (20 GiB,
    priority 10) starts: both are being suspended for it, FIRST named first."""
    u = spec("u", 10, mem_gib=20)
    s = host(first, second, u)
    running(s, first, second)
    assert brief(s.request(u)) == [f"suspend {first.name} 0", f"suspend {second.name} 0"]
    return s, u


def test_a_priority_edited_while_suspended_orders_the_resume() -> None:
    a = spec("a", 80, BG, mem_gib=10, preempt="suspend stop")
    b = spec("b", 90, BG, mem_gib=10, preempt="suspend stop")
    s, u = suspending_two(a, b)
    s.suspended_done(a.name, "")
    s.suspended_done(b.name, "")
    s.set_specs({a.name: a, b.name: dataclasses.replace(b, priority=70), u.name: u})
    # u leaves: both come back, now b (70) before a (80)
    assert brief(s.inactive(u.name, Outcome.EXITED)) == ["resume b.service 0", "resume a.service 0"]


def test_no_resume_while_a_more_urgent_unit_waits() -> None:
    other = spec("other", 20, devices=("1",))
    s = host(VLM, VOICE, other, gpus=[sized(0), sized(1)])
    blocker = spec("blocker", 5, devices=("1",))
    s.specs[blocker.name] = blocker
    running(s, VLM, blocker)
    s.request(VOICE)
    s.suspended_done(V, "")
    assert brief(s.request(other)) == []  # waits for GPU 1
    assert brief(s.inactive(VO, Outcome.EXITED)) == []
    assert s.phase(V) is Phase.SUSPENDED
    assert brief(s.inactive(blocker.name, Outcome.EXITED)) == [
        f"grant {other.name} 1",
        f"resume {V} 0",
    ]


def test_a_failed_resume_stops_the_unit_and_requeue_restarts_it() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    s.suspended_done(V, "")
    s.inactive(VO, Outcome.EXITED)
    acts = s.resume_failed(V, "restore of PID 7 ran out of GPU memory")
    assert brief(acts) == [f"stop {V}"]
    assert words(acts) == [
        "vlm.service (priority 90) could not be resumed on GPU 0: restore of PID 7 ran out "
        "of GPU memory; stopping it (Requeue= decides whether it starts again)"
    ]
    assert brief(s.inactive(V, Outcome.STOPPED)) == [f"start {V}"]


def test_a_suspend_whose_undo_lost_a_process_stops_the_unit_with_suspend_alone() -> None:
    """Undoing a failed suspend (restore, unlock) failed for a process of it: that process
    can never run again. With `Preempt=suspend` alone the unit kept its GPUs and ran on,
    that process dead, its work broken: it is stopped, as after a failed resume, and
    Requeue= decides whether it starts again; its waiter waits for that stop."""
    only = spec("vlm", 90, BG, preempt="suspend")
    s = host(only, VOICE)
    running(s, only)
    s.request(VOICE)
    why = (
        "FreezeUnit failed: refused; and undoing the checkpoint failed: restore of PID 7 ran "
        "out of GPU memory; the process cannot be resumed and must be stopped"
    )
    acts = s.suspend_failed(V, why, lost=True)
    assert brief(acts) == [f"stop {V}"]
    [stop] = [a for a in acts if isinstance(a, Stop)]
    assert stop.decision is not None
    assert stop.decision.code is Code.RESUME_FAILED
    assert stop.reason == (
        f"vlm.service (priority 90) could not be resumed on GPU 0: undoing its suspend: {why}; "
        "stopping it (Requeue= decides whether it starts again)"
    )
    assert s.phase(V) is Phase.STOPPING and V not in s.unstoppable
    assert s.holders[V].stopping_for == VO  # the waiter waits for this stop
    assert brief(s.inactive(V, Outcome.STOPPED)) == [f"grant {VO} 0"]
    assert brief(s.inactive(VO, Outcome.EXITED)) == [f"start {V}"]


@pytest.mark.parametrize("preempt", ["suspend", "suspend stop", "freeze suspend", "suspend freeze"])
def test_a_lost_process_after_an_undo_stops_the_unit_whatever_its_ladder(preempt: str) -> None:
    """Not only `suspend` alone: a ladder with stop after it stopped it only for a waiter
    still more urgent (a reload made the unit as urgent: it ran on, broken). Whoever waits,
    the unit is stopped; a waiter no longer more urgent plans anew, not behind it."""
    unit = spec("vlm", 90, BG, preempt=preempt)
    s = host(unit, VOICE)
    running(s, unit)
    s.request(VOICE)
    s.set_specs({V: dataclasses.replace(unit, priority=10), VO: VOICE})
    acts = s.suspend_failed(V, "restore of PID 7 failed", lost=True)
    assert brief(acts)[0] == f"stop {V}"
    assert s.phase(V) is Phase.STOPPING
    assert s.holders[V].stopping_for is None and s.waiters[VO].target == ()
    assert s.thaws_owed() == [V]  # a freeze that hung: a failed stop leaves it running


def test_a_suspend_failed_without_a_lost_process_keeps_the_ladder() -> None:
    only = spec("vlm", 90, BG, preempt="suspend")
    s = host(only, VOICE)
    running(s, only)
    s.request(VOICE)
    assert brief(s.suspend_failed(V, "FreezeUnit failed: refused", lost=False)) == []
    assert s.phase(V) is Phase.RUNNING


def test_a_suspended_unit_stopped_by_hand_is_held() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    s.suspended_done(V, "")
    acts = s.inactive(V, Outcome.STOPPED)
    assert codes(acts) == [Code.HOLD]
    assert s.phase(V) is None
    assert brief(s.inactive(VO, Outcome.EXITED)) == []  # held: not resumed, not started


def test_a_suspended_unit_that_ended_was_stopped_by_someone_it_cannot_end_by_itself() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    s.suspended_done(V, "")
    assert codes(s.inactive(V, Outcome.EXITED)) == [Code.HOLD]
    assert s.held == {V}


def test_a_frozen_victim_is_thawed_before_it_is_suspended() -> None:
    big = spec("big", 5, mem_gib=16)
    s, _, _ = frozen_beside_voice("freeze suspend stop", later=[big])
    [suspend] = [a for a in s.request(big) if isinstance(a, Suspend)]
    assert suspend.thaw_first
    s2 = host(VLM, VOICE)
    running(s2, VLM)
    [plain] = [a for a in s2.request(VOICE) if isinstance(a, Suspend)]
    assert not plain.thaw_first


def test_a_controller_restart_keeps_suspended_and_frozen_units_and_recovers_the_rest() -> None:
    emb = spec("emb", 90, BG, mem_gib=8, preempt="freeze stop")
    voice = spec("voice", 10, mem_gib=8)
    ocr = spec("ocr", 95, BG, mem_gib=8, preempt="suspend stop")
    big = spec("big", 5, mem_gib=8)
    s = host(emb, voice, ocr, big)
    running(s, emb, voice, ocr)
    s.request(big)  # ocr is suspended for big (24 GiB: 8 + 8 + 8)
    assert s.phase(ocr.name) is Phase.SUSPENDING
    after = host(emb, voice, ocr, big)
    after.load(s.save())
    assert after.phase("emb.service") is Phase.FROZEN
    assert after.holders["emb.service"].frozen_for == {voice.name}
    assert brief(after.recover()) == ["resume ocr.service 0"]
    assert after.phase(ocr.name) is Phase.RESUMING
    s.suspended_done(ocr.name, "")
    again = host(emb, voice, ocr, big)
    again.load(s.save())
    assert again.phase(ocr.name) is Phase.SUSPENDED
    assert brief(again.recover()) == []


def test_a_gate_asking_again_leaves_a_frozen_or_suspending_unit_alone() -> None:
    s, emb, _ = frozen_beside_voice()
    assert s.request(emb) == []
    assert s.phase("emb.service") is Phase.FROZEN


def test_an_unannotated_frozen_unit_is_thawed_and_holds_its_gpu_until_it_ends() -> None:
    """Thawed, it runs beside the unit it was frozen for (as if thawed by hand); its GPU is
    not handed out while it runs, even once that unit has left."""
    s, _, voice = frozen_beside_voice(later=[VLM])
    acts = s.set_specs({voice.name: voice})
    assert "thaw emb.service" in brief(acts)
    assert s.phase("emb.service") is Phase.RUNNING
    s.inactive(voice.name, Outcome.EXITED)
    assert s.phase("emb.service") is Phase.RUNNING
    assert brief(s.inactive("emb.service", Outcome.EXITED)) == []
    assert s.phase("emb.service") is None


def test_a_suspended_unit_whose_gpu_is_lost_is_stopped_not_left_frozen_for_good() -> None:
    """Found by the ladder's property machine: it kept its room on a GPU it could never come
    back to, and a unit of its priority waited for ever."""
    two = spec("two", 20, gpus=2, preempt="suspend stop")
    one, other = spec("one", 10), spec("other", 20)
    s = host(two, one, other, gpus=[sized(0), sized(1)])
    running(s, two)
    assert brief(s.request(one)) == ["suspend two.service 0,1"]  # all its VRAM moves
    s.suspended_done(two.name, "")
    assert brief(s.request(other)) == [f"grant {other.name} 1"]  # as urgent: not kept from it
    acts = s.set_gpus([sized(0), sized(1, lost=True)])
    assert brief(acts) == [f"stop {two.name}"]
    assert words(acts)[-1] == (
        "two.service (priority 20) could not be resumed on GPUs 0,1: GPU 1 lost or gone: its "
        "memory cannot be restored there; stopping it (Requeue= decides whether it starts again)"
    )
    assert s.phase(two.name) is Phase.STOPPING and s.grants()[two.name] == frozenset()
    s.inactive(two.name, Outcome.STOPPED)
    assert two.name in s.preempted


def test_a_waiter_s_reason_says_its_gpu_is_freed_by_a_suspend() -> None:
    s = host(VLM, VOICE, spec("later", 10))
    running(s, VLM)
    s.request(VOICE)
    s.request(spec("later", 10))
    reasons = {name: reason for name, _, reason in s.snapshot().waiting}
    assert reasons["later.service"] == (
        "waiting: GPU 0 being freed by vlm.service (being suspended)"
    )


def test_a_place_kept_before_a_priority_edit_leaves_a_suspended_unit_its_room() -> None:
    """Found by the property machines: a start job seen while it was urgent got its place;
    edited to be less urgent than a suspended unit, its gate must not take that room."""
    two = spec("two", 20, gpus=2, preempt="suspend stop")
    one, late = spec("one", 10), spec("late", 10)
    s = host(two, one, late, gpus=[sized(0), sized(1)])
    running(s, two)
    s.request(one)
    s.suspended_done(two.name, "")  # one runs on GPU 0, GPU 1 is free
    s.announce(late)  # its place on GPU 1 is kept
    s.set_specs({two.name: two, one.name: one, late.name: dataclasses.replace(late, priority=50)})
    s.inactive(one.name, Outcome.EXITED)  # two could come back but for late's kept place
    acts = s.request(s.specs[late.name])
    assert f"grant {late.name} 1" not in brief(acts)


def test_equally_urgent_suspended_units_come_back_in_the_order_they_left() -> None:
    """No backfill among suspended units: a later one that fits does not pass an earlier one
    of the same priority that does not fit yet."""
    big = spec("big", 50, BG, mem_gib=16, preempt="suspend stop")
    small = spec("small", 50, BG, mem_gib=6, preempt="suspend stop")
    u1, u2 = spec("u1", 10, mem_gib=20), spec("u2", 10, mem_gib=10)
    s = host(big, small, u1, u2)
    running(s, big)
    s.request(u1)
    s.suspended_done(big.name, "")  # big suspended first
    s.inactive(u1.name, Outcome.EXITED)
    s.resumed(big.name, "")
    running(s, small)
    s.request(u1)
    for name in (big.name, small.name):
        s.suspended_done(name, "")
    s.request(u2)
    # u1 leaves, u2 runs: 14 GiB free, room for small (6) but not big (16), suspended earlier
    assert brief(s.inactive(u1.name, Outcome.EXITED)) == [f"grant {u2.name} 0"]
    assert brief(s.inactive(u2.name, Outcome.EXITED)) == [
        "resume big.service 0",
        "resume small.service 0",
    ]


# -- the decisions as data, and events that come when they no longer apply -----------------


def decisions(actions: Sequence[object]) -> list[Decision]:
    return [a.decision for a in actions if getattr(a, "decision", None) is not None]  # type: ignore[attr-defined]


def test_every_ladder_decision_carries_its_data() -> None:
    s, emb, voice = frozen_beside_voice(later=[VLM])
    thawed = decisions(s.thawed_outside("emb.service"))
    assert [(d.code, d.unit, d.priority, d.gpus) for d in thawed] == [
        (Code.THAWED_OUTSIDE, "emb.service", 90, (0,))
    ]
    s2 = host(emb, voice)
    running(s2, emb, voice)
    failed = decisions(s2.freeze_failed("emb.service", "no cgroup"))[0]
    assert (failed.code, failed.gpus, failed.for_unit, failed.for_priority, failed.rung) == (
        Code.RUNG_FAILED,
        (0,),
        VOICE.name,
        10,
        "freeze",
    )
    assert (failed.detail, failed.fallback) == ("no cgroup", "")
    s3 = host(VLM, VOICE)
    running(s3, VLM)
    [suspend] = decisions(s3.request(VOICE))[:1]
    assert (suspend.code, suspend.gpus, suspend.for_unit, suspend.for_priority) == (
        Code.SUSPEND,
        (0,),
        VO,
        10,
    )
    [done] = decisions(s3.suspended_done(V, "2 GiB"))[:1]
    assert (done.code, done.gpus, done.for_unit, done.for_priority, done.detail) == (
        Code.SUSPENDED,
        (0,),
        VO,
        10,
        "2 GiB",
    )
    [resume] = [d for d in decisions(s3.inactive(VO, Outcome.EXITED)) if d.code is Code.RESUME]
    assert (resume.code, resume.unit, resume.gpus, resume.detail) == (Code.RESUME, V, (0,), "")
    [resumed] = decisions(s3.resumed(V, "3 s: restored in 1 s"))
    assert (resumed.code, resumed.gpus, resumed.detail) == (
        Code.RESUMED,
        (0,),
        "3 s: restored in 1 s",
    )


def test_recover_resumes_with_its_reason_and_gpus() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    after = host(VLM, VOICE)
    after.load(s.save())
    [resume] = after.recover()
    assert isinstance(resume, Resume) and resume.gpus == (0,)
    d = resume.decision
    assert d is not None and (d.code, d.gpus, d.detail) == (
        Code.RESUME,
        (0,),
        "after a controller restart",
    )
    assert resume.reason == (
        "restoring the VRAM of vlm.service (priority 90) on GPU 0 (after a controller restart)"
    )
    assert after.holders[V].stopping_for is None
    assert after.save().holders[V] == ((0,), "resuming", after.holders[V].seq, "")


def test_events_that_no_longer_apply_change_nothing() -> None:
    emb = spec("emb", 90, BG, mem_gib=8, preempt="freeze stop")
    s = host(VLM, emb)
    running(s, VLM)
    before = (s.save(), s.snapshot())
    for event in (
        s.suspended_done,
        s.suspend_failed,
        s.resumed,
        s.resume_failed,
        s.freeze_failed,
    ):
        assert event(V, "late") == []  # it runs: nothing of the ladder is under way
        assert event("unknown.service", "late") == []
    assert s.thawed_outside(V) == []
    assert s.thawed_outside("unknown.service") == []
    assert (s.save(), s.snapshot()) == before
    assert s.phase(V) is Phase.RUNNING


def test_a_unit_stopped_for_a_lost_gpu_is_a_holder_on_no_gpu_until_it_ends() -> None:
    two = spec("two", 20, gpus=2, preempt="suspend stop")
    one = spec("one", 10)
    s = host(two, one, gpus=[sized(0), sized(1)])
    running(s, two)
    s.request(one)
    s.suspended_done(two.name, "")
    s.set_gpus([sized(0), sized(1, lost=True)])
    holder = s.holders[two.name]
    assert (holder.spec, holder.gpus, holder.phase) == (two, frozenset(), Phase.STOPPING)
    assert isinstance(holder.seq, int) and holder.seq > 0
    assert s.snapshot().gpus == {0: [(one.name, 10, "running")], 1: []}
    assert s.save().holders[two.name][:2] == ((), "stopping")


def test_a_failed_freeze_of_a_unit_whose_neighbour_left_in_the_same_batch() -> None:
    """The neighbour it was frozen for ended in the same batch of events (nothing decided
    yet): the line names it without its priority; a frozen unit loaded without the units it
    was frozen for names none."""
    s, emb, voice = frozen_beside_voice()
    with s.deferred():
        s.inactive(VO, Outcome.EXITED)
        failed = decisions(s.freeze_failed("emb.service", "gone"))[0]
    assert (failed.for_unit, failed.for_priority) == (VO, None)
    saved = s.save()
    saved.holders["emb.service"] = ((0,), "frozen", 1, "")
    after = host(emb, voice)
    after.load(saved)
    assert after.holders["emb.service"].frozen_for == set()
    failed = decisions(after.freeze_failed("emb.service", "gone"))[0]
    assert (failed.for_unit, failed.for_priority) == ("", None)
    assert failed.unit == "emb.service"


def test_suspended_units_are_listed_by_name() -> None:
    s = host(VLM, VOICE)
    assert s.suspended_units() == []
    running(s, VLM)
    s.request(VOICE)
    s.suspended_done(V, "")
    assert s.suspended_units() == [V]


def test_a_failed_suspend_of_a_unit_no_longer_annotated_falls_by_the_ladder_it_had() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    s.set_specs({VO: VOICE})  # its annotation goes while it is being suspended
    assert s.phase(V) is Phase.SUSPENDING
    assert brief(s.suspend_failed(V, "no tool")) == [f"stop {V}"]


def test_a_failed_suspend_never_stops_a_unit_a_reload_made_as_urgent_as_its_waiter() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    s.set_specs({V: dataclasses.replace(VLM, priority=10), VO: VOICE})
    acts = s.suspend_failed(V, "no tool")
    assert "stop vlm.service" not in brief(acts)
    assert s.phase(V) is Phase.RUNNING


def test_the_fallback_stop_names_the_gpus_the_waiter_needs_of_it() -> None:
    wide = spec("wide", 90, gpus=2, preempt="suspend stop")
    two = spec("two", 10, gpus=2)
    s = host(wide, two, gpus=[sized(0), sized(1), sized(2)])
    running(s, wide)  # on GPUs 0,1
    filler = spec("filler", 95, devices=("2",))
    s.specs[filler.name] = filler
    running(s, filler)
    assert brief(s.request(two)) == ["suspend wide.service 0,1", "stop filler.service"]
    # two takes GPUs 0 and 2: the fallback stop names the GPU it needs of wide, not both
    [stop] = [a for a in s.suspend_failed(wide.name, "no tool") if isinstance(a, Stop)]
    assert stop.decision is not None and stop.decision.gpus == (0,)


def test_a_fallback_stop_after_the_waiter_re_planned_names_all_the_victims_gpus() -> None:
    """Another victim's stop failed and the waiter re-planned (its target is cleared): the
    suspend that then fails still names where the unit is stopped."""
    a = spec("a", 90, devices=("0",))
    b = spec("b", 90, preempt="suspend stop", devices=("1",))
    w = spec("w", 10, gpus=2)
    s = host(a, b, w, gpus=[sized(0), sized(1)])
    running(s, a, b)
    assert brief(s.request(w)) == ["stop a.service", "suspend b.service 1"]
    s.stop_failed(a.name, "refused", refused=False)
    [stop] = [x for x in s.suspend_failed(b.name, "no tool") if isinstance(x, Stop)]
    assert stop.decision is not None and stop.decision.gpus == (1,)


def test_a_suspend_that_failed_with_no_rung_left_clears_the_waiter_s_target() -> None:
    only = spec("vlm", 90, BG, preempt="suspend")
    s = host(only, VOICE)
    running(s, only)
    s.request(VOICE)
    s.suspend_failed(V, "no tool")
    assert s.waiters[VO].target == ()


# -- what the mutation pass of the ladder's functions found untested -------------------------


def test_a_thaw_says_so_with_its_data_and_reaches_units_named_after_others() -> None:
    late = spec("z-emb", 90, BG, mem_gib=8, preempt="freeze stop")  # sorts after "voice"
    voice = spec("voice", 10, mem_gib=8)
    s = host(late, voice)
    running(s, late, voice)
    [thaw] = [a for a in s.inactive(VO, Outcome.EXITED) if isinstance(a, Thaw)]
    assert thaw.unit == "z-emb.service"
    assert thaw.reason == (
        "thawing z-emb.service (priority 90) on GPU 0: the units it was frozen for have left"
    )
    assert thaw.decision is not None
    assert (thaw.decision.code, thaw.decision.gpus) == (Code.THAW, (0,))


def test_a_reload_to_equal_priority_thaws_a_frozen_unit() -> None:
    s, emb, voice = frozen_beside_voice()
    acts = s.set_specs({"emb.service": emb, VO: dataclasses.replace(voice, priority=90)})
    assert "thaw emb.service" in brief(acts)


def test_the_freeze_names_only_the_gpus_it_shares_with_the_urgent_unit() -> None:
    wide = spec("wide", 90, BG, gpus=2, mem_gib=8, preempt="freeze stop")
    voice = spec("voice", 10, mem_gib=8, devices=("1",))
    s = host(wide, voice, gpus=[sized(0), sized(1)])
    running(s, wide)
    [freeze] = [a for a in s.request(voice) if isinstance(a, Freeze)]
    assert freeze.decision is not None and freeze.decision.gpus == (1,)


def test_a_suspended_unit_that_cannot_come_back_does_not_hold_back_the_next() -> None:
    two = spec("two", 20, gpus=2, mem_gib=10, preempt="suspend stop")
    one = spec("one", 30, mem_gib=10, preempt="suspend stop", devices=("0",))
    w = spec("w", 10, gpus=2, mem_gib=20)
    s = host(two, one, w, gpus=[sized(0), sized(1)])
    running(s, two, one)
    assert brief(s.request(w)) == ["suspend two.service 0,1", "suspend one.service 0"]
    s.suspended_done(one.name, "")
    s.suspended_done(two.name, "")
    with s.deferred():  # w ends and GPU 1 is lost, decided at once
        s.inactive(w.name, Outcome.EXITED)
        s.set_gpus([sized(0), sized(1, lost=True)])
    assert brief(s.schedule()) == [f"stop {two.name}", f"resume {one.name} 0"]


def test_a_unit_no_longer_annotated_while_suspended_comes_back_and_is_let_go_when_it_ends() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    s.suspended_done(V, "")
    s.set_specs({VO: VOICE})
    [resume] = [d for d in decisions(s.inactive(VO, Outcome.EXITED)) if d.code is Code.RESUME]
    assert (resume.unit, resume.priority) == (V, 90)
    acts = s.resumed(V, "1 s: restored in 0.1 s")
    assert [(d.code, d.unit, d.gpus) for d in decisions(acts)] == [
        (Code.RESUMED, V, (0,)),
        (Code.UNMANAGED, V, (0,)),
    ]
    assert words(acts)[1] == (
        "vlm.service is no longer annotated: it keeps GPU 0 until it ends, then gpuslice forgets it"
    )
    assert s.phase(V) is Phase.RUNNING  # its job runs on GPU 0 again
    s.inactive(V, Outcome.EXITED)
    assert s.phase(V) is None


def test_a_resume_carries_the_priority_of_the_annotation_now() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    s.suspended_done(V, "")
    s.set_specs({V: dataclasses.replace(VLM, priority=70), VO: VOICE})
    [resume] = [d for d in decisions(s.inactive(VO, Outcome.EXITED)) if d.code is Code.RESUME]
    assert resume.priority == 70
    assert s.holders[V].spec.priority == 70


def test_a_suspended_background_unit_waits_while_a_foreign_process_uses_its_gpu() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    s.suspended_done(V, "")
    s.set_gpus([sized(0, foreign=GIB, foreign_pids=(77,))])
    assert brief(s.inactive(VO, Outcome.EXITED)) == []
    assert s.phase(V) is Phase.SUSPENDED
    assert brief(s.set_gpus([sized(0)])) == [f"resume {V} 0"]


def test_a_suspend_done_after_its_waiter_left_still_says_so() -> None:
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    s.inactive(VO, Outcome.STOPPED)  # the waiter's start was cancelled
    done = decisions(s.suspended_done(V, "1 GiB"))[0]
    assert (done.code, done.for_unit, done.for_priority) == (Code.SUSPENDED, VO, None)


def test_a_thaw_reaches_a_frozen_unit_listed_after_running_ones() -> None:
    late = spec("z-emb", 90, BG, mem_gib=4, preempt="freeze stop")
    first = spec("a-first", 95, BG, mem_gib=4)  # runs beside, not frozen (no freeze rung)
    voice = spec("voice", 10, mem_gib=4)
    s = host(late, first, voice)
    running(s, late, first, voice)
    assert s.phase("z-emb.service") is Phase.FROZEN
    assert brief(s.inactive(VO, Outcome.EXITED)) == ["thaw z-emb.service"]


def test_a_suspended_unit_that_must_wait_does_not_hold_back_one_on_another_gpu() -> None:
    a = spec("a", 40, mem_gib=20, preempt="suspend stop", devices=("0",))
    b = spec("b", 60, mem_gib=20, preempt="suspend stop", devices=("1",))
    ua, ub = spec("ua", 10, mem_gib=20, devices=("0",)), spec("ub", 10, mem_gib=20, devices=("1",))
    s = host(a, b, ua, ub, gpus=[sized(0), sized(1)])
    running(s, a, b)
    s.request(ua)
    s.suspended_done(a.name, "")
    s.request(ub)
    s.suspended_done(b.name, "")
    # ub ends: b (GPU 1) comes back although a (GPU 0, more urgent) still cannot
    assert brief(s.inactive(ub.name, Outcome.EXITED)) == [f"resume {b.name} 1"]


@pytest.mark.parametrize("priority", [51, 80])
def test_a_suspended_unit_s_room_is_kept_from_any_less_urgent_unit(priority: int) -> None:
    sus = spec("sus", 50, mem_gib=20, preempt="suspend stop")
    urgent = spec("urgent", 10, mem_gib=20)
    other = spec("other", priority, mem_gib=20)
    s = host(sus, urgent, other)
    running(s, sus)
    s.request(urgent)
    s.suspended_done(sus.name, "")
    s.request(other)
    assert brief(s.inactive(urgent.name, Outcome.EXITED)) == [f"resume {sus.name} 0"]


def test_a_suspended_unit_s_room_follows_a_priority_edit() -> None:
    sus = spec("sus", 90, mem_gib=20, preempt="suspend stop")
    urgent = spec("urgent", 10, mem_gib=20)
    other = spec("other", 70, mem_gib=20)
    s = host(sus, urgent, other)
    running(s, sus)
    s.request(urgent)
    s.suspended_done(sus.name, "")
    s.set_specs(
        {sus.name: dataclasses.replace(sus, priority=50), urgent.name: urgent, other.name: other}
    )
    s.request(other)  # 70: now less urgent than sus (50)
    assert brief(s.inactive(urgent.name, Outcome.EXITED)) == [f"resume {sus.name} 0"]


# ---- what the complete mutation re-run of the core asked for ----


def test_a_frozen_unit_whose_annotation_goes_is_thawed_with_its_reason() -> None:
    s, _, voice = frozen_beside_voice()
    acts = s.set_specs({VO: voice})
    thaws = [a for a in acts if isinstance(a, Thaw)]
    assert len(thaws) == 1
    assert thaws[0].unit == "emb.service"
    assert thaws[0].decision is not None
    assert thaws[0].decision.code is Code.THAW
    assert thaws[0].decision.gpus == (0,)
    assert thaws[0].reason == render(thaws[0].decision)
    assert thaws[0].reason.startswith("thawing emb.service")
    assert s.thaws_owed() == ["emb.service"]  # until systemd shows it running


def test_suspended_units_are_shown_most_urgent_first_then_in_the_order_they_left() -> None:
    a, b, c = (spec(n, p, BG, preempt="suspend stop") for n, p in (("a", 80), ("b", 70), ("c", 80)))
    s = host(a, b, c, VOICE, gpus=[sized(0), sized(1), sized(2)])
    s.load(
        dataclasses.replace(
            s.save(),
            suspended={"c.service": ((2,), 5), "a.service": ((0,), 7), "b.service": ((1,), 9)},
            seq=9,
        )
    )
    assert [name for name, _, _ in s.snapshot().suspended] == [
        "b.service",
        "c.service",
        "a.service",
    ]


def test_a_saved_suspended_unit_no_longer_annotated_is_kept_least_urgent_in_its_order() -> None:
    """A file of a controller before `terms`: the priority it was suspended at is not known."""
    s = host(VOICE, gpus=[sized(0), sized(1)])
    s.load(
        dataclasses.replace(
            s.save(), suspended={"gone.service": ((1,), 4), "old.service": ((0,), 3)}, seq=4
        )
    )
    assert s.snapshot().suspended == [("old.service", 999, (0,)), ("gone.service", 999, (1,))]
    assert s.suspended["gone.service"].spec == UnitSpec("gone.service", 999, requeue=False)
    assert s.suspended["gone.service"].seq == 4


def test_a_rung_that_failed_is_tried_again_at_the_units_next_run() -> None:
    """unsuspendable/unfreezable hold for one run of the unit: once it has gone down, its
    next run is suspended (or frozen) again."""
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    s.suspend_failed(V, "cuda-checkpoint is not installed")
    s.inactive(V, Outcome.STOPPED)
    assert brief(s.inactive(VO, Outcome.EXITED)) == [f"start {V}"]
    running(s, VLM)
    assert brief(s.request(VOICE)) == [f"suspend {V} 0"]

    s, emb, voice = frozen_beside_voice()
    s.freeze_failed("emb.service", "the unit is not active")
    s.inactive(VO, Outcome.EXITED)
    s.inactive("emb.service", Outcome.EXITED)
    running(s, emb)
    assert brief(s.request(voice)) == [f"grant {VO} 0", "freeze emb.service"]


# ---- what the mutation pass of the suspend/resume rules asked for ----


def test_suspended_units_keep_the_order_they_left_across_a_controller_restart() -> None:
    """Equally urgent suspended units come back in the order they left, also after a
    restart: state.json lists them by name, so the order is their saved sequence numbers."""
    z = spec("z", 50, BG, mem_gib=10, preempt="suspend stop")
    a = spec("a", 50, BG, mem_gib=10, preempt="suspend stop")
    s, u = suspending_two(z, a)
    s.suspended_done(z.name, "")  # z leaves first
    assert brief(s.suspended_done(a.name, "")) == [f"grant {u.name} 0"]
    saved = s.save()
    saved.suspended = dict(sorted(saved.suspended.items()))  # as json.dumps(sort_keys=True)
    after = host(z, a, u)
    after.load(saved)
    assert [name for name, _, _ in after.snapshot().suspended] == [z.name, a.name]
    assert brief(after.inactive(u.name, Outcome.EXITED)) == [
        "resume z.service 0",
        "resume a.service 0",
    ]


def test_a_thaw_reaches_a_frozen_unit_after_a_more_urgent_running_one() -> None:
    """Frozen units are thawed most urgent first, and a more urgent unit that runs (here on
    another GPU) does not end the look: the frozen one after it is thawed too."""
    emb = spec("emb", 90, BG, mem_gib=4, preempt="freeze stop", devices=("0",))
    other = spec("other", 50, devices=("1",))
    voice = spec("voice", 10, mem_gib=4, devices=("0",))
    s = host(emb, other, voice, gpus=[sized(0), sized(1)])
    running(s, other, emb)
    assert brief(s.request(voice)) == [f"grant {VO} 0", "freeze emb.service"]
    assert brief(s.inactive(VO, Outcome.EXITED)) == ["thaw emb.service"]
    assert s.phase("emb.service") is Phase.RUNNING


def test_a_suspended_unit_does_not_take_the_room_of_an_equal_waiter_s_victims() -> None:
    """A waiter as urgent as a suspended unit, placed where it was (its room is not kept
    from an equal), has a victim stopping on its other GPU: the suspended unit does not
    come back into the room that waiter is promised, and comes back once it has left."""
    sus = spec("sus", 20, mem_gib=16, preempt="suspend stop", devices=("0",))
    urgent = spec("urgent", 10, mem_gib=12, devices=("0",))
    low = spec("low", 90, mem_gib=16, devices=("1",))
    pair = spec("pair", 20, gpus=2, mem_gib=12)
    s = host(sus, urgent, low, pair, gpus=[sized(0), sized(1)])
    running(s, low, sus)
    assert brief(s.request(urgent)) == ["suspend sus.service 0"]
    assert brief(s.suspended_done(sus.name, "")) == [f"grant {urgent.name} 0"]
    assert brief(s.request(pair)) == ["stop low.service"]  # 12 GiB of GPU 0 are its
    assert brief(s.inactive(urgent.name, Outcome.EXITED)) == []  # 16 + 12 > 24 GiB
    assert s.phase(sus.name) is Phase.SUSPENDED
    assert brief(s.inactive(low.name, Outcome.STOPPED))[0].startswith(f"grant {pair.name}")
    assert brief(s.inactive(pair.name, Outcome.EXITED)) == [
        f"start {low.name}",  # requeued on GPU 1
        f"resume {sus.name} 0",
    ]


def left_out(s: Scheduler, urgent: UnitSpec, *units: str) -> None:
    """`urgent` suspends `units` (done in this order) and runs; a process gpuslice does not
    manage then takes 16 GiB of its GPU and it leaves: none of them fits to come back."""
    s.request(urgent)
    for name in units:
        s.suspended_done(name, "")
    [gpu] = s.grants()[urgent.name]
    s.set_gpus([sized(i, foreign=16 * GIB) if i == gpu else sized(i) for i in sorted(s.devices)])
    assert brief(s.inactive(urgent.name, Outcome.EXITED)) == []
    assert all(s.phase(name) is Phase.SUSPENDED for name in units)


SUS = spec("sus", 20, mem_gib=20, preempt="suspend stop")
LATE = spec("late", 50)


def test_a_waiter_kept_out_is_told_the_suspended_unit_s_priority_now() -> None:
    """The suspended unit named in a waiter's reason carries its annotation now (a reload
    edited its priority while it was suspended)."""
    s = host(SUS, VOICE, LATE)
    running(s, SUS)
    left_out(s, VOICE, SUS.name)
    s.set_specs({SUS.name: dataclasses.replace(SUS, priority=30), VO: VOICE, LATE.name: LATE})
    assert words(s.request(LATE)) == [
        "late.service waiting: GPU 0 kept for suspended sus.service, priority 30"
    ]


def test_a_waiter_kept_out_by_a_suspended_unit_no_longer_annotated_is_told_which() -> None:
    """A suspended unit whose annotation went is kept (nobody else would resume it) with
    the annotation it had: its room, and the waiter's reason, carry that priority."""
    s = host(SUS, VOICE, LATE)
    running(s, SUS)
    left_out(s, VOICE, SUS.name)
    s.set_specs({VO: VOICE, LATE.name: LATE})
    assert words(s.request(LATE)) == [
        "late.service waiting: GPU 0 kept for suspended sus.service, priority 20"
    ]


def test_a_suspended_unit_is_named_only_on_the_gpu_it_comes_back_to() -> None:
    """A pair waits for GPU 1, kept for a suspended unit; GPU 0, free, is kept for the
    pair: its reason names the suspended unit on GPU 1 alone."""
    sus = dataclasses.replace(SUS, devices=("1",))
    voice = dataclasses.replace(VOICE, devices=("1",))
    pair = spec("pair", 50, gpus=2)
    s = host(sus, voice, pair, gpus=[sized(0), sized(1)])
    running(s, sus)
    left_out(s, voice, sus.name)
    assert words(s.request(pair)) == [
        "pair.service waiting: needs 2 GPUs; GPU 1 kept for suspended sus.service, priority 20"
    ]


def test_a_suspended_unit_keeps_nothing_from_a_waiter_as_urgent_and_is_not_named() -> None:
    """A suspended unit's room is kept only from less urgent units: a waiter of its own
    priority, kept out by a more urgent holder on its other GPU, is not told of it."""
    top = spec("top", 5, devices=("1",))
    pair = spec("pair", 20, gpus=2)
    s = host(SUS, VOICE, top, pair, gpus=[sized(0), sized(1)])
    running(s, top, SUS)
    left_out(s, VOICE, SUS.name)
    assert words(s.request(pair)) == [
        "pair.service waiting: needs 2 GPUs; GPU 1 held by top.service, priority 5"
    ]


def test_a_waiter_is_told_of_the_most_urgent_suspended_unit_on_its_gpu() -> None:
    """Two suspended units keep their room on GPU 0 (b left first): the reason names the
    more urgent, a."""
    a = spec("a", 30, mem_gib=10, preempt="suspend stop")
    b = spec("b", 40, mem_gib=10, preempt="suspend stop")
    urgent = spec("urgent", 10, mem_gib=20)
    s = host(a, b, urgent, LATE)
    running(s, a, b)
    left_out(s, urgent, b.name, a.name)
    assert words(s.request(LATE)) == [
        "late.service waiting: GPU 0 kept for suspended a.service, priority 30"
    ]


def test_a_suspended_unit_waits_for_its_gpu_while_nvml_is_not_ready() -> None:
    """After a controller restart while NVML does not answer yet, the GPUs are a guess
    (gpus: from config.yaml). A suspended unit on a GPU not in that guess waits for NVML:
    stopped, it lost its work. Once NVML answers without its GPU, it is stopped."""
    two = spec("two", 20, mem_gib=16, devices=("1",), preempt="suspend stop")
    one = spec("one", 10, mem_gib=16, devices=("1",))
    s = host(two, one, gpus=[sized(0), sized(1)])
    running(s, two)
    assert brief(s.request(one)) == ["suspend two.service 1"]
    assert brief(s.suspended_done(two.name, "")) == ["grant one.service 1"]
    saved = s.save()
    for answered in ([sized(0), sized(1)], [sized(0)]):
        fresh = host(two, one)  # one GPU listed: config.yaml's guess
        fresh.pause_refill("NVML is not ready yet")
        fresh.load(saved)
        assert brief(fresh.inactive(one.name, Outcome.EXITED)) == []
        assert fresh.phase(two.name) is Phase.SUSPENDED
        fresh.pause_refill("")  # NVML answers (as gpuwatch says so, then samples)
        outcome = brief(fresh.set_gpus(answered))
        assert outcome == (["resume two.service 1"] if len(answered) == 2 else ["stop two.service"])


def test_a_unit_suspended_when_the_host_went_down_is_preempted_after_the_reboot() -> None:
    """Its processes and host memory went with the boot: it lost its work as a stopped unit
    does, and comes back as one (Requeue=), not held as if stopped by hand (which a
    suspended unit that systemd shows down was); one whose annotation went is owed nothing."""
    s = host(VLM, VOICE)
    s.load(SavedState(suspended={V: ((0,), 1), "gone.service": ((0,), 2)}, seq=2))
    s.forget_boot()
    assert s.suspended_units() == []
    assert s.snapshot().preempted == [(V, 90, True)]
    assert brief(s.schedule()) == [f"start {V}"]


def started_after_reboot(
    s: Scheduler, *specs: UnitSpec, gpus: list[Gpu] | None = None
) -> list[str]:
    """What the controller of the next boot starts (sorted), from what `s` saved."""
    after = host(*specs, gpus=gpus)
    after.load(s.save())
    after.forget_boot()
    return sorted(brief(after.schedule()))


def test_a_unit_preempted_while_it_runs_that_the_shutdown_ends_comes_back_after_it() -> None:
    """Systemd stops the units gpuslice gates before gpuslice (After=gpuslice.service), so
    the controller sees a frozen or suspended unit end with the shutdown. Its work went with
    the boot, as a stopped unit's: preempted, it comes back after the reboot (Requeue=), as
    one suspended when no controller saw the shutdown (`forget_boot`). Told ended by the
    shutdown, no on-demand unit came back. One the shutdown found running ended with the
    boot, as any unit does."""
    vlm = spec("vlm", 80, preempt="suspend stop")
    urgent = spec("urgent", 10)
    s, emb, voice = frozen_beside_voice(kind=OD, others=[vlm], later=[urgent])
    assert brief(s.request(urgent)) == ["suspend vlm.service 1"]
    s.suspended_done(vlm.name, "")
    assert s.set_shutting_down(True) == []
    for unit in (emb, vlm, voice, urgent):  # in parallel: the frozen one first, say
        s.inactive(unit.name, Outcome.SHUTDOWN)
    assert sorted(s.save().preempted) == ["emb.service", "vlm.service"]
    assert started_after_reboot(s, emb, vlm, voice, urgent, gpus=[sized(0), sized(1)]) == [
        "start emb.service",
        "start vlm.service",
    ]


def test_a_preempted_unit_that_fails_on_the_shutdowns_sigterm_is_still_owed() -> None:
    """A main process that exits non-zero on SIGTERM (143, or 1 from its own handler):
    systemd records the unit failed, which the tracker tells before the shutdown. Frozen,
    suspended, being suspended, or its comeback under way, its work went with the boot all
    the same: recorded failed, the new boot cleared it, and it never came back."""
    vlm = spec("vlm", 80, preempt="suspend stop")
    mid = spec("mid", 70, preempt="suspend stop")
    urgent, top = spec("urgent", 10), spec("top", 10)
    s, emb, voice = frozen_beside_voice(kind=OD, others=[vlm, mid], later=[urgent, top])
    assert brief(s.request(urgent)) == ["suspend vlm.service 1"]
    s.suspended_done(vlm.name, "")
    assert brief(s.request(top)) == ["suspend mid.service 2"]  # being suspended
    assert s.set_shutting_down(True) == []
    for unit in (emb, vlm, mid):
        acts = s.inactive(unit.name, Outcome.FAILED)
        assert Code.FAILED not in codes(acts)
    for unit in (voice, urgent, top):
        s.inactive(unit.name, Outcome.SHUTDOWN)
    assert sorted(s.save().preempted) == ["emb.service", "mid.service", "vlm.service"]
    assert s.save().failed == []
    assert started_after_reboot(
        s, emb, vlm, mid, voice, urgent, top, gpus=[sized(0), sized(1), sized(2)]
    ) == [
        "start emb.service",
        "start mid.service",
        "start vlm.service",
    ]


def test_a_comeback_whose_start_fails_as_the_host_goes_down_is_still_owed() -> None:
    """A preempted unit that exited non-zero on our stop's SIGTERM stays failed for systemd;
    its comeback's start job, cancelled by the shutdown, leaves it failed. Its comeback is
    still owed, as when it shows inactive."""
    low = spec("low", 60, preempt="stop")
    s = host(low, VOICE)
    running(s, low)
    s.request(VOICE)
    s.inactive(low.name, Outcome.FAILED)  # our stop's SIGTERM: exit 143
    assert list(s.save().preempted) == ["low.service"]
    s.running(VO)
    assert brief(s.inactive(VO, Outcome.EXITED)) == ["start low.service"]
    s.set_shutting_down(True)
    assert codes(s.inactive(low.name, Outcome.FAILED)) == [Code.SHUTDOWN]
    assert list(s.save().preempted) == ["low.service"]
    assert s.save().failed == []


def test_a_unit_failing_outside_a_preemption_at_the_shutdown_is_failed() -> None:
    """Only a preempted unit's (or a background one's: tests/test_core_refills.py) failure
    at the shutdown is its end with the boot: an on-demand one that ran, or one that failed
    by itself while frozen for nothing, is failed as before."""
    solo = spec("solo", 50)
    s = host(solo)
    running(s, solo)
    s.set_shutting_down(True)
    assert codes(s.inactive(solo.name, Outcome.FAILED)) == [Code.FAILED]
    assert s.save().failed == ["solo.service"]
    assert s.save().preempted == {}


def test_a_unit_that_fails_on_our_stops_sigterm_is_preempted_and_comes_back() -> None:
    """Preempted by stop (no shutdown), a main process that exits non-zero on the SIGTERM
    is recorded failed by systemd: it is preempted all the same and comes back (Requeue=),
    not taken for a failed job."""
    low = spec("low", 60, preempt="stop")
    s = host(low, VOICE)
    running(s, low)
    assert brief(s.request(VOICE)) == ["stop low.service"]
    assert Code.FAILED not in codes(s.inactive(low.name, Outcome.FAILED))
    assert list(s.save().preempted) == ["low.service"]
    assert s.save().failed == []
    s.running(VO)
    assert brief(s.inactive(VO, Outcome.EXITED)) == ["start low.service"]


def test_a_suspended_unit_is_not_resumed_while_the_host_goes_down() -> None:
    """The unit it gave way to ends with the shutdown first: resumed, its VRAM came back
    for nothing, the restore raced the shutdown's stop, and once it ran it was owed
    nothing after the reboot. It stays suspended and owed; a cancelled shutdown resumes it."""
    s = host(VLM, VOICE)
    running(s, VLM)
    s.request(VOICE)
    s.suspended_done(V, "")
    s.set_shutting_down(True)
    assert brief(s.inactive(VO, Outcome.SHUTDOWN)) == []
    assert s.phase(V) is Phase.SUSPENDED
    assert brief(s.set_shutting_down(False)) == [f"resume {V} 0"]  # cancelled
    s.resumed(V, "")
    s.request(VOICE)
    s.suspended_done(V, "")
    s.set_shutting_down(True)
    s.inactive(VO, Outcome.SHUTDOWN)
    assert brief(s.inactive(V, Outcome.SHUTDOWN)) == []
    assert list(s.save().preempted) == [V]


def test_a_frozen_unit_is_not_thawed_while_the_host_goes_down() -> None:
    """The unit it was frozen for ends with the shutdown first: thawed, it ended running
    and was owed nothing after the reboot. It stays frozen and owed (systemd thaws it for
    its stop); a cancelled shutdown thaws it."""
    s, emb, voice = frozen_beside_voice(kind=OD)
    s.set_shutting_down(True)
    assert brief(s.inactive(voice.name, Outcome.SHUTDOWN)) == []
    assert s.phase(emb.name) is Phase.FROZEN
    down = host(emb, voice)
    down.load(s.save())
    assert brief(s.set_shutting_down(False)) == ["thaw emb.service"]  # cancelled
    down.set_shutting_down(True)
    assert brief(down.inactive(emb.name, Outcome.SHUTDOWN)) == []
    assert list(down.save().preempted) == [emb.name]


def test_a_frozen_unit_the_shutdowns_stop_thaws_is_still_owed() -> None:
    """systemd thaws a frozen unit before it stops it: the look at its FreezerState while
    the shutdown stops it finds it thawed. Taken for thawed by hand, it ran again and ended
    owed nothing; it stays frozen in the books, and once the shutdown is cancelled the next
    look takes it for thawed."""
    s, emb, voice = frozen_beside_voice(kind=OD)
    s.set_shutting_down(True)
    assert s.thawed_outside(emb.name) == []
    assert s.phase(emb.name) is Phase.FROZEN
    cancelled = host(emb, voice)
    cancelled.load(s.save())
    assert brief(s.inactive(emb.name, Outcome.SHUTDOWN)) == []
    assert list(s.save().preempted) == [emb.name]
    assert codes(cancelled.thawed_outside(emb.name)) == [Code.THAWED_OUTSIDE]
    assert cancelled.phase(emb.name) is Phase.RUNNING


def test_the_last_boots_holders_owed_a_comeback_are_preempted_the_others_go() -> None:
    """No controller saw the host go down: of the holders its state names, a unit preempted
    while it ran, or whose comeback gpuslice started, is preempted; one no longer annotated
    is owed nothing, nor a background unit gpuslice started (refill starts it anyway), nor
    one that ran, nor a start job of anyone's."""
    bg = spec("bg", 90, BG)
    s = host(VLM, VOICE, bg, spec("up", 50), spec("back", 50), spec("kept", 50))
    holders: dict[str, tuple[tuple[int, ...], str, int, str]] = {
        V: ((0,), "frozen", 3, ""),
        "gone.service": ((0,), "frozen", 4, ""),
        bg.name: ((0,), "starting", 5, ""),
        "up.service": ((0,), "running", 6, ""),
        "back.service": ((0,), "starting", 7, ""),
        "kept.service": ((0,), "starting", 8, ""),
    }
    started = [bg.name, "back.service"]
    saved = SavedState(holders=holders, preempted={VO: 2}, seq=8, started=started)
    ended = s.ended_with_boot(saved)
    assert ended.holders == {}
    assert ended.preempted == {V: 3, "back.service": 7, VO: 2}


def test_a_comeback_waiting_at_its_gate_when_the_host_went_down_is_owed_after_it() -> None:
    """requeue_at_gate: a preempted unit restarted to wait at its gate is no holder once its
    gate asked, its requeue alone says it is a comeback: owed after the boot, whether no
    controller saw the shutdown or one restarted meanwhile saw it (as a background unit,
    refill starts it anyway; one no longer annotated is owed nothing)."""
    low, bg = spec("low", 60, preempt="stop"), spec("bg", 90, BG)
    s = host(low, VOICE, bg)
    saved = SavedState(seq=9, requeued=[low.name, bg.name, "gone.service"])
    assert s.ended_with_boot(saved).preempted == {low.name: 9}
    first = Scheduler([sized(0)], {low.name: low, VO: VOICE}, requeue_at_gate=True)
    running(first, low)
    assert brief(first.request(VOICE)) == ["stop low.service"]
    assert brief(first.inactive(low.name, Outcome.STOPPED)) == [
        f"grant {VO} 0",
        "start low.service",
    ]
    assert brief(first.request(low)) == []  # it waits for voice at its gate
    fresh = Scheduler([sized(0)], {low.name: low, VO: VOICE}, requeue_at_gate=True)
    fresh.load(first.save())
    assert brief(fresh.request(low)) == []  # its gate asks the new controller
    fresh.set_shutting_down(True)
    assert codes(fresh.inactive(low.name, Outcome.SHUTDOWN)) == [Code.CANCELLED]
    assert list(fresh.save().preempted) == [low.name]


def test_a_comeback_the_shutdown_cancelled_is_still_owed() -> None:
    """A preempted unit restarted by gpuslice just before the host went down: systemd
    cancels its start job. Forgotten then (its preemption went with the restart), it was
    never started again."""
    low = spec("low", 60, preempt="stop")
    s = host(low, VOICE)
    running(s, low)
    s.request(VOICE)
    s.inactive(low.name, Outcome.STOPPED)
    s.running(VO)
    assert brief(s.inactive(VO, Outcome.EXITED)) == ["start low.service"]
    s.set_shutting_down(True)
    assert brief(s.inactive(low.name, Outcome.SHUTDOWN)) == []
    assert list(s.save().preempted) == ["low.service"]
    assert brief(s.set_shutting_down(False)) == ["start low.service"]  # the shutdown cancelled


def numbered(*uuids: str) -> list[Gpu]:
    """The GPUs as NVML numbers them once opened afresh: 0, 1, ... in this order (a card
    gone off the bus shifts the ones after it)."""
    return [Gpu(i, u, "Fake", 24 * GIB) for i, u in enumerate(uuids)]


def suspended_from_gpu_b() -> tuple[Scheduler, UnitSpec]:
    """vlm.service suspended from GPU 1, GPU-B, for voice.service (pinned to GPU-B), which
    then runs there; GPU 0 (GPU-A) and GPU 2 (GPU-C) are free."""
    voice = spec("voice", 10, devices=("GPU-B",))
    first = spec("first", 50)
    s = host(VLM, voice, first, gpus=numbered("GPU-A", "GPU-B", "GPU-C"))
    running(s, first, VLM)
    s.inactive(first.name, Outcome.EXITED)
    assert brief(s.request(voice)) == [f"suspend {V} 1"]
    assert brief(s.suspended_done(V, "")) == [f"grant {voice.name} 1"]
    return s, voice


def voice_ends_as_nvml_numbers_anew(s: Scheduler, voice: UnitSpec, gpus: list[Gpu]) -> None:
    """voice.service ends in the batch that takes in NVML's new numbering."""
    with s.deferred():
        s.inactive(voice.name, Outcome.EXITED)
        s.set_gpus(gpus)


def test_a_suspended_unit_comes_back_on_its_own_gpu_at_the_index_nvml_gives_it_now() -> None:
    """GPU-A goes off the bus while vlm.service is suspended from GPU 1 (GPU-B), and NVML,
    opened afresh, numbers GPU-B 0 and GPU-C 1. A restore wakes its processes on GPU-B (their
    environment and CUDA context name it by UUID): resumed by index onto GPU 1, the books
    said GPU-C was its and GPU 0 free, and the next unit granted GPU 0 ran beside it."""
    s, voice = suspended_from_gpu_b()
    voice_ends_as_nvml_numbers_anew(s, voice, numbered("GPU-B", "GPU-C"))
    assert s.snapshot().suspended == [(V, 90, (0,))]
    acts = s.schedule()
    assert brief(acts) == [f"resume {V} 0"]
    assert words(acts) == [
        "restoring the VRAM of vlm.service (priority 90) on GPU 0 (GPU-B was GPU 1 when it was "
        "suspended: NVML numbered the GPUs anew)"
    ]
    assert s.grants() == {V: frozenset({0})}
    assert brief(s.request(spec("other", 50))) == ["grant other.service 1"]


def test_a_suspended_unit_keeps_its_room_on_its_own_gpu_wherever_nvml_numbers_it() -> None:
    """While vlm.service waits to come back (a foreign process on GPU-B), the room kept for
    it is on GPU-B, now GPU 0: a less urgent unit is granted GPU-C, now GPU 1."""
    s, voice = suspended_from_gpu_b()
    b, c = numbered("GPU-B", "GPU-C")
    voice_ends_as_nvml_numbers_anew(s, voice, [dataclasses.replace(b, foreign_pids=(7,)), c])
    assert brief(s.schedule()) == []
    assert s.phase(V) is Phase.SUSPENDED
    assert brief(s.request(spec("other", 95))) == ["grant other.service 1"]


def test_a_suspended_unit_whose_gpu_is_gone_is_stopped_not_resumed_on_another() -> None:
    """GPU-B itself went: GPU 1 names GPU-C now. By index it was resumed onto GPU 1, booked
    as if GPU-C were its GPU; it is stopped instead, the line naming the GPU it lost, and
    comes back as a preempted unit (Requeue=)."""
    s, voice = suspended_from_gpu_b()
    voice_ends_as_nvml_numbers_anew(s, voice, numbered("GPU-A", "GPU-C"))
    acts = s.schedule()
    assert brief(acts) == [f"stop {V}"]
    assert words(acts) == [
        "vlm.service (priority 90) could not be resumed on GPU 1: its GPU 1 was GPU-B, which "
        "NVML no longer lists: its memory cannot be restored on another GPU; stopping it "
        "(Requeue= decides whether it starts again)"
    ]
    assert s.grants() == {V: frozenset()}
    assert brief(s.inactive(V, Outcome.STOPPED)) == [f"start {V}"]


def test_a_restarted_controller_resumes_a_suspended_unit_on_the_gpu_its_env_file_names() -> None:
    """The state file names a suspended unit's GPUs by index only; its env file says GPU-B.
    The NVML a restarted controller opened numbers GPU-B 0."""
    s, voice = suspended_from_gpu_b()
    after = host(VLM, voice, gpus=numbered("GPU-B", "GPU-C"))
    after.load(s.save())
    after.remember_uuids(V, {0: "GPU-A"})  # not its GPUs: another file's word, ignored
    after.remember_uuids(V, {1: "GPU-B"})
    with after.deferred():
        after.inactive(voice.name, Outcome.EXITED)
    assert brief(after.schedule()) == [f"resume {V} 0"]
    told_nothing = host(VLM, voice, gpus=numbered("GPU-B", "GPU-C"))
    told_nothing.load(s.save())  # no env file to tell: by index, as before
    with told_nothing.deferred():
        told_nothing.inactive(voice.name, Outcome.EXITED)
    assert brief(told_nothing.schedule()) == [f"resume {V} 1"]


def two_gpus_suspended_from_gpu_b_and_c() -> tuple[Scheduler, UnitSpec]:
    """vlm2.service suspended from GPUs 1,2 (GPU-B, GPU-C) for voice.service (pinned to
    both), which then runs there; GPU 0 (GPU-A) is free."""
    vlm2 = spec("vlm2", 90, BG, gpus=2, preempt="suspend stop")
    voice = spec("voice", 10, gpus=2, devices=("GPU-B", "GPU-C"))
    first = spec("first", 50)
    s = host(vlm2, voice, first, gpus=numbered("GPU-A", "GPU-B", "GPU-C"))
    running(s, first, vlm2)
    assert s.grants()[vlm2.name] == frozenset({1, 2})
    s.inactive(first.name, Outcome.EXITED)
    assert brief(s.request(voice)) == ["suspend vlm2.service 1,2"]
    assert brief(s.suspended_done(vlm2.name, "")) == ["grant voice.service 1,2"]
    return s, voice


def test_a_two_gpu_unit_moved_by_nvml_is_said_with_both_its_gpus() -> None:
    """The resume's line names each GPU it was suspended from and the indices they had
    ("were", GPUs joined by ", "), as an admin reads them in the journal."""
    s, voice = two_gpus_suspended_from_gpu_b_and_c()
    # GPU-A went: B and C are 0 and 1 now
    voice_ends_as_nvml_numbers_anew(s, voice, numbered("GPU-B", "GPU-C"))
    acts = s.schedule()
    assert brief(acts) == ["resume vlm2.service 0,1"]
    assert words(acts) == [
        "restoring the VRAM of vlm2.service (priority 90) on GPUs 0,1 (GPU-B, GPU-C were "
        "GPUs 1,2 when it was suspended: NVML numbered the GPUs anew)"
    ]


def test_a_two_gpu_unit_whose_gpus_are_gone_names_each_gpu_it_lost() -> None:
    """Each GPU NVML no longer lists is named, joined by "; ", and only those: one still
    listed (at another index) is not said to be gone."""
    s, voice = two_gpus_suspended_from_gpu_b_and_c()
    voice_ends_as_nvml_numbers_anew(s, voice, numbered("GPU-A", "GPU-D"))  # B and C both gone
    acts = s.schedule()
    assert brief(acts) == ["stop vlm2.service"]
    assert words(acts) == [
        "vlm2.service (priority 90) could not be resumed on GPUs 1,2: its GPU 1 was GPU-B, "
        "which NVML no longer lists; its GPU 2 was GPU-C, which NVML no longer lists: its "
        "memory cannot be restored on another GPU; stopping it (Requeue= decides whether it "
        "starts again)"
    ]
    s2, voice = two_gpus_suspended_from_gpu_b_and_c()
    voice_ends_as_nvml_numbers_anew(s2, voice, numbered("GPU-C", "GPU-D"))  # B gone, C now GPU 0
    acts = s2.schedule()
    assert words(acts) == [
        "vlm2.service (priority 90) could not be resumed on GPUs 1,2: its GPU 1 was GPU-B, "
        "which NVML no longer lists: its memory cannot be restored on another GPU; stopping "
        "it (Requeue= decides whether it starts again)"
    ]


def test_uuids_told_of_a_unit_not_suspended_or_of_other_gpus_are_no_word_of_it() -> None:
    """remember_uuids takes an env file's word only for a suspended unit and only when it
    names exactly the unit's GPUs, each with a UUID."""
    s, _ = suspended_from_gpu_b()
    s.remember_uuids("nobody.service", {1: "GPU-X"})  # not suspended: nothing, no error
    s.remember_uuids(V, {1: "GPU-X", 2: "GPU-Y"})  # more GPUs than its own
    s.remember_uuids(V, {1: ""})  # its GPU, but no UUID
    assert s.suspended[V].uuids == {1: "GPU-B"}


def test_a_unit_frozen_by_one_frozen_in_turn_at_a_gate_runs_again_at_once() -> None:
    """u3 is frozen for u0; u2, more urgent, started by the core into a kept place, asks at
    its gate and freezes u0 on GPU 0. u0 no longer runs on GPU 1: u3 runs again in the same
    answer. The gate's grant of a kept place froze without the end-of-pass thaw, and u3 stayed
    frozen until the next event of any kind (found by the ladder machine at 20,000 examples)."""
    u3 = spec("u3", 50, mem_gib=4, preempt="freeze stop", devices=("1",))
    u0 = spec("u0", 20, gpus=2, mem_gib=4, preempt="freeze stop")
    u2 = spec("u2", 10, BG, mem_gib=4, preempt="suspend stop", devices=("0",))
    s = host(u3, u0, gpus=[sized(0), sized(1)])
    assert brief(s.request(u3)) == ["grant u3.service 1"]
    assert brief(s.request(u0)) == ["grant u0.service 0,1", "freeze u3.service"]
    assert brief(s.set_specs({u.name: u for u in (u3, u0, u2)})) == ["start u2.service"]
    assert brief(s.request(u2)) == [
        "grant u2.service 0",
        "freeze u0.service",
        "thaw u3.service",
    ]
    assert s.phase(u3.name) is Phase.RUNNING
    assert brief(s.schedule()) == []


def test_no_waiter_is_served_while_the_host_goes_down() -> None:
    """A gate that asked before the shutdown job was heard, or asks after it: nothing is
    granted, and no unit is stopped, frozen or suspended for it. Its victim's preemption
    raced the shutdown's stop (a suspend's checkpoint under the SIGTERM), and a grant
    started a job the shutdown stopped at once. It waits, and the shutdown ends it; a
    cancelled shutdown serves it."""
    low = spec("low", 60, preempt="stop")
    emb = spec("emb", 90, mem_gib=8, preempt="freeze stop")
    beside = spec("beside", 10, mem_gib=8)
    for victim, expected in ((low, "stop low.service"), (VLM, f"suspend {V} 0")):
        s = host(victim, VOICE)
        running(s, victim)
        assert s.set_shutting_down(True) == []
        assert brief(s.request(VOICE)) == []
        assert s.is_waiting(VO)
        assert s.phase(victim.name) is Phase.RUNNING
        assert brief(s.set_shutting_down(False)) == [expected]  # cancelled
    s = host(emb, beside)
    running(s, emb)
    s.set_shutting_down(True)
    assert brief(s.request(beside)) == []  # neither granted nor a freeze beside it
    assert s.phase(emb.name) is Phase.RUNNING
    assert brief(s.set_shutting_down(False)) == [f"grant {beside.name} 0", "freeze emb.service"]


def test_a_victim_down_while_the_host_goes_down_grants_nothing() -> None:
    """Its waiter asked before the shutdown: the victim's stop (ours, or the shutdown's that
    joined it) frees its GPUs as the host goes down, and a grant then started a job the
    shutdown stopped at once. A suspend done meanwhile grants nothing either."""
    low = spec("low", 60, preempt="stop")
    s = host(low, VOICE)
    running(s, low)
    assert brief(s.request(VOICE)) == ["stop low.service"]
    s.set_shutting_down(True)
    assert brief(s.inactive(low.name, Outcome.SHUTDOWN)) == []
    assert s.is_waiting(VO)
    assert list(s.save().preempted) == [low.name]
    s = host(VLM, VOICE)
    running(s, VLM)
    assert brief(s.request(VOICE)) == [f"suspend {V} 0"]
    s.set_shutting_down(True)
    assert brief(s.suspended_done(V, "")) == []
    assert s.is_waiting(VO)
    assert brief(s.set_shutting_down(False)) == [f"grant {VO} 0"]


def test_a_place_kept_is_not_given_while_the_host_goes_down() -> None:
    """A start known before its gate asked had its place kept; its gate asks as the host
    goes down: it waits like any start (granted, its job began only to be stopped), and is
    served once the shutdown is cancelled."""
    s = host(VOICE)
    assert brief(s.announce(VOICE)) == []
    assert s.phase(VO) is Phase.STARTING
    s.set_shutting_down(True)
    assert brief(s.request(VOICE)) == []
    assert s.is_waiting(VO)
    assert brief(s.set_shutting_down(False)) == [f"grant {VO} 0"]


def test_holds_the_shutdowns_stops_made_when_its_jobnew_was_lost_are_undone() -> None:
    """The bus lost the shutdown target's JobNew: the tracker takes the shutdown's stops for
    someone's, and the core books holds, which outlived the reboot (a background unit never
    ran again until someone started it; a frozen unit lost its comeback). Once systemd
    says the host is going down they are undone: a unit preempted while it ran (or being
    stopped by gpuslice) is owed its comeback, one that ran is neither held nor owed. A
    hold systemd confirmed (the host not going down) stands, as one booked again later."""
    low = spec("low", 60, preempt="stop")
    urgent = spec("urgent", 10)
    s, emb, voice = frozen_beside_voice(kind=OD, others=[low], later=[urgent])
    assert brief(s.request(urgent)) == ["stop low.service"]
    for unit in (emb, low):
        assert Code.HOLD in codes(s.inactive(unit.name, Outcome.STOPPED, not_ours=True))
    assert s.holds_of_shutdown([low.name, emb.name, "other.service"]) == [emb.name, low.name]
    assert s.save().held == []
    assert sorted(s.save().preempted) == [emb.name, low.name]
    s.set_shutting_down(True)
    for unit in (voice, urgent):
        s.inactive(unit.name, Outcome.SHUTDOWN)
    assert started_after_reboot(s, emb, low, voice, urgent, gpus=[sized(0), sized(1)]) == [
        "start emb.service",
        "start low.service",
    ]
    bg = spec("bg", 80, BG)
    s = host(bg)
    running(s, bg)
    s.inactive(bg.name, Outcome.STOPPED)
    assert s.holds_of_shutdown([bg.name]) == [bg.name]
    assert s.save().held == [] and s.save().preempted == {}
    s.set_shutting_down(True)
    assert started_after_reboot(s, bg) == ["start bg.service"]
    s.set_shutting_down(False)  # cancelled
    running(s, bg)
    s.inactive(bg.name, Outcome.STOPPED)
    s.holds_confirmed([bg.name])
    assert s.holds_of_shutdown([bg.name]) == []
    assert s.save().held == [bg.name]
