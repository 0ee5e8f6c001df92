"""A suspended unit and GPUs that NVML loses or numbers anew: what mutation testing showed no
test held.

A suspended unit comes back on its own GPU, found by the UUID it was suspended from
(`Scheduler._where_now`). The tests pin: a UUID a lost GPU reports is no word of what the unit
ran on, and a GPU gone from the list while the suspend ran is no error (`suspended_done`);
a unit that can never come back keeps no room from a less urgent waiter (`_suspended_room`);
while NVML is not ready, a unit whose GPU NVML no longer lists waits rather than crash the
core, and its own GPU, wherever NVML numbers it now, decides whether it is known lost
(`_gpus_a_guess`). Played on the pure scheduler, as tests/test_core_ladder.py does.
"""

from __future__ import annotations

import dataclasses

from gpuslice.core.decisions import Code
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Outcome, Phase, SavedState
from tests.core_builders import GIB, brief, sized, spec, words
from tests.test_core_ladder import (
    VLM,
    VO,
    VOICE,
    V,
    decisions,
    host,
    numbered,
    running,
    suspended_from_gpu_b,
)


def test_a_lost_gpu_s_uuid_is_not_taken_for_the_one_a_unit_was_suspended_from() -> None:
    """GPU 0 goes lost while vlm.service's VRAM moves off it, reporting another GPU's UUID
    (NVML numbered a card anew under it); in the same batch GPU-A, its own, is back at 0.
    Taken as its GPU, GPU-X (listed nowhere now) stopped it: its work was lost. Its GPU is
    the one it was granted (Holder.uuids)."""
    s = host(VLM, VOICE, gpus=numbered("GPU-A"))
    running(s, VLM)
    assert brief(s.request(VOICE)) == [f"suspend {V} 0"]
    with s.deferred():
        s.set_gpus([Gpu(0, "GPU-X", "Fake", 24 * GIB, lost=True)])
        s.suspended_done(V, "")
        s.set_gpus(numbered("GPU-A"))
    assert s.suspended[V].uuids == {0: "GPU-A"}  # as granted, not GPU-X
    assert brief(s.schedule()) == [f"grant {VO} 0"]
    assert brief(s.inactive(VO, Outcome.EXITED)) == [f"resume {V} 0"]


def test_a_suspend_done_on_a_gpu_no_longer_listed_stops_the_unit_with_its_reason() -> None:
    """NVML stopped listing GPU 1 while the unit's VRAM left it: no crash of the core (every
    GPU job waits while the controller is down); the unit cannot come back there."""
    two = spec("two", 20, gpus=2, preempt="suspend stop")
    one = spec("one", 10)
    s = host(two, one, gpus=[sized(0), sized(1)])
    running(s, two)
    assert brief(s.request(one)) == ["suspend two.service 0,1"]
    s.set_gpus([sized(0)])
    acts = s.suspended_done(two.name, "")
    assert s.phase(two.name) is Phase.STOPPING
    assert words(acts)[-1] == (
        "two.service (priority 20) could not be resumed on GPUs 0,1: its GPU 1 was GPU-1, "
        "which NVML no longer lists: its memory cannot be restored on another GPU; stopping it "
        "(Requeue= decides whether it starts again)"
    )


def test_a_suspended_unit_that_can_never_come_back_keeps_no_room_from_a_less_urgent_one() -> None:
    """two.service is suspended from GPUs 0 and 1; GPU 0 is lost. It is stopped, and in the
    same pass a less urgent waiter kept out of GPU 1 for it gets GPU 1: kept, the waiter
    waited for a unit that would never come back."""
    two = spec("two", 20, gpus=2, preempt="suspend stop")
    one = spec("one", 10, devices=("0",))
    low = spec("low", 30)
    s = host(two, one, low, gpus=[sized(0), sized(1)])
    running(s, two)
    assert brief(s.request(one)) == ["suspend two.service 0,1"]
    assert brief(s.suspended_done(two.name, "")) == ["grant one.service 0"]
    assert brief(s.request(low)) == []  # GPU 1 is kept for two.service
    acts = s.set_gpus([sized(0, lost=True), sized(1)])
    assert sorted(brief(acts)) == ["grant low.service 1", "stop two.service"]


def test_a_suspended_unit_whose_gpu_nvml_no_longer_lists_waits_while_nvml_is_not_ready() -> None:
    """GPU-B, which vlm.service was suspended from, is not in NVML's list while refills are
    paused (NVML not ready): the unit waits for NVML, neither stopped nor a crash of the core;
    once NVML is ready it is stopped, the line naming the GPU it lost."""
    s, voice = suspended_from_gpu_b()
    with s.deferred():
        s.inactive(voice.name, Outcome.EXITED)
        s.pause_refill("NVML is not ready yet")
        s.set_gpus(numbered("GPU-A", "GPU-C"))
    assert brief(s.schedule()) == []
    assert s.phase(V) is Phase.SUSPENDED
    s.pause_refill("")
    acts = s.schedule()
    assert brief(acts) == [f"stop {V}"]
    assert words(acts) == [
        "vlm.service (priority 90) could not be resumed on GPU 1: its GPU 1 was GPU-B, which "
        "NVML no longer lists: its memory cannot be restored on another GPU; stopping it "
        "(Requeue= decides whether it starts again)"
    ]


def test_while_nvml_is_not_ready_a_unit_s_own_gpu_lost_at_its_new_index_stops_it() -> None:
    """vlm.service was suspended from GPU 1 (GPU-B); NVML numbers GPU-B 0 now and it is
    lost, GPU 1 (GPU-C) is fine. Its own GPU counts, not the index it had: it is stopped even
    while NVML is not ready (it can never be restored there)."""
    s, voice = suspended_from_gpu_b()
    b, c = numbered("GPU-B", "GPU-C")
    with s.deferred():
        s.inactive(voice.name, Outcome.EXITED)
        s.pause_refill("NVML is not ready yet")
        s.set_gpus([dataclasses.replace(b, lost=True), c])
    acts = s.schedule()
    assert brief(acts) == [f"stop {V}"]
    assert words(acts) == [
        "vlm.service (priority 90) could not be resumed on GPU 0: GPU 0 lost or gone: its "
        "memory cannot be restored there; stopping it (Requeue= decides whether it starts "
        "again)"
    ]


def test_a_suspend_done_for_a_holder_that_names_no_waiter_names_none() -> None:
    """A state file of an older controller names no waiter for a unit caught suspending
    (SavedState.holders' fourth field empty): its suspended line names no unit."""
    s = host(VLM, VOICE)
    s.load(SavedState(holders={V: ((0,), Phase.SUSPENDING.value, 1, "")}, seq=1))
    done = decisions(s.suspended_done(V, ""))[0]
    assert (done.code, done.for_unit, done.for_priority) == (Code.SUSPENDED, "", None)


def test_a_unit_granted_before_nvml_named_its_gpu_takes_the_uuid_its_gpu_has_at_the_suspend() -> (
    None
):
    """Granted while the GPUs were config.yaml's guess (no UUID), a unit has no UUID of its
    own: its suspend takes the one its GPU answers with then, never a lost GPU's (which may be
    another card's, numbered anew under it)."""
    guess = [Gpu(0, "", "Fake", 24 * GIB)]
    s = host(VLM, VOICE, gpus=guess)
    running(s, VLM)
    assert brief(s.request(VOICE)) == [f"suspend {V} 0"]
    with s.deferred():
        s.set_gpus(numbered("GPU-A"))
        s.suspended_done(V, "")
    assert s.suspended[V].uuids == {0: "GPU-A"}
    lost = host(VLM, VOICE, gpus=guess)
    running(lost, VLM)
    assert brief(lost.request(VOICE)) == [f"suspend {V} 0"]
    with lost.deferred():
        lost.set_gpus([Gpu(0, "GPU-X", "Fake", 24 * GIB, lost=True)])
        lost.suspended_done(V, "")
        lost.set_gpus(numbered("GPU-A"))
    assert lost.suspended[V].uuids == {}
