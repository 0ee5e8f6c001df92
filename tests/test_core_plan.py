"""`gpuslice plan`'s core: what a start would do now, told by a copy of the scheduler.

The property test (tests/test_core_properties.py, `person_plans_then_starts`) checks on
random histories that a plan moves nothing and says what the start then does; these pin
each verdict's words and the copy's independence."""

from __future__ import annotations

import pytest

from gpuslice.core.decisions import render
from gpuslice.core.model import UnitSpec
from gpuslice.core.plan import Verdict, plan_start, summary, trial_copy
from gpuslice.core.scheduler import Action, Outcome, Phase, Scheduler
from tests.core_builders import BG, spec

VLM = spec("vlm-analysis", 90, BG)
VOICE = spec("voice-pipeline", 10)


def host(*specs: UnitSpec, gpus: int = 1) -> Scheduler:
    return Scheduler(range(gpus), {s.name: s for s in specs})


def test_on_an_idle_gpu_it_would_start_now() -> None:
    s = host(VOICE)
    plan = plan_start(s, VOICE)
    assert plan.verdict is Verdict.STARTS
    assert plan.gpus == (0,)
    assert [render(d) for d in plan.decisions] == [
        "starting voice-pipeline.service (priority 10) on GPU 0"
    ]
    assert summary(plan) == "voice-pipeline.service (priority 10) would start now on GPU 0"
    assert s.phase(VOICE.name) is None and not s.is_waiting(VOICE.name)


def test_a_less_urgent_holder_would_be_preempted_and_is_not() -> None:
    s = host(VLM, VOICE)
    s.request(VLM)
    plan = plan_start(s, VOICE)
    assert plan.verdict is Verdict.PREEMPTS
    assert (plan.gpus, plan.victims) == ((0,), (VLM.name,))
    assert [render(d) for d in plan.decisions] == [
        "preempting vlm-analysis.service (priority 90) for voice-pipeline.service "
        "(priority 10) on GPU 0",
        "voice-pipeline.service waiting for vlm-analysis.service (priority 90) to stop on GPU 0",
    ]
    assert summary(plan) == (
        "voice-pipeline.service (priority 10) would start on GPU 0 once "
        "vlm-analysis.service gave way"
    )
    assert s.phase(VLM.name) is Phase.RUNNING  # the live state did not move
    assert not s.is_waiting(VOICE.name)


def test_equal_priority_would_wait_and_says_why() -> None:
    a, b = spec("a", 10), spec("b", 10)
    s = host(a, b)
    s.request(a)
    plan = plan_start(s, b)
    assert plan.verdict is Verdict.WAITS
    assert plan.victims == ()
    assert (
        summary(plan)
        == "b.service (priority 10) would be waiting: GPU 0 held by a.service, priority 10"
    )
    assert plan.to_json()["reason"] == "waiting: GPU 0 held by a.service, priority 10"
    assert plan.to_json()["decision"]["cause"] == "gpus-busy"
    # what the journal would say: the wait, in its words
    assert [render(d) for d in plan.decisions] == [
        "b.service waiting: GPU 0 held by a.service, priority 10"
    ]


def test_a_unit_that_holds_or_waits_already_is_said_so() -> None:
    a, b = spec("a", 10), spec("b", 10)
    s = host(a, b)
    s.request(a)
    s.request(b)
    held = plan_start(s, a)
    assert (held.verdict, held.phase, held.gpus) == (Verdict.HOLDS, "running", (0,))
    assert (
        summary(held)
        == "a.service (priority 10) is already running on GPU 0: a start would change nothing"
    )
    queued = plan_start(s, b)
    assert queued.verdict is Verdict.QUEUED
    assert summary(queued) == (
        "b.service (priority 10) is already waiting: GPU 0 held by a.service, priority 10"
    )
    assert held.decisions == queued.decisions == ()


def test_the_json_form() -> None:
    s = host(VLM, VOICE)
    s.request(VLM)
    data = plan_start(s, VOICE).to_json()
    assert set(data) == {
        "unit", "priority", "summary", "verdict", "gpus", "victims", "reason", "decision",
        "phase", "decisions",
    }  # fmt: skip
    assert (data["verdict"], data["victims"], data["reason"]) == ("preempts", [VLM.name], None)
    assert data["decisions"][0]["decision"]["code"] == "preempt"
    assert data["decisions"][0]["message"].startswith("preempting vlm-analysis.service")


def test_the_trial_copy_shares_nothing_that_can_change() -> None:
    """Whatever fields the scheduler gains: a table of lists, a tuple holding a list, a set."""
    s = host(VLM, VOICE)
    s.request(VLM)
    s.extra_table = {"a": [1]}  # type: ignore[attr-defined]
    s.extra_pair = ([1], 2)  # type: ignore[attr-defined]
    t = trial_copy(s)
    t.extra_table["a"].append(2)  # type: ignore[attr-defined]
    t.extra_pair[0].append(2)  # type: ignore[attr-defined]
    t.held.add("x.service")
    t.specs["x.service"] = VOICE
    t.holders[VLM.name].phase = Phase.STOPPING
    assert s.extra_table == {"a": [1]}  # type: ignore[attr-defined]
    assert s.extra_pair == ([1], 2)  # type: ignore[attr-defined]
    assert s.held == set() and "x.service" not in s.specs
    assert s.phase(VLM.name) is Phase.RUNNING
    assert t.specs[VLM.name] is s.specs[VLM.name]  # immutable: shared, not copied


def test_a_waiter_is_said_to_wait_for_who_holds_its_gpus_now() -> None:
    """Its journal line named the holder when it began to wait; the plan names today's."""
    first, other, late = spec("first", 10), spec("other", 10), spec("late", 20)
    s = host(first, other, late)
    s.request(first)
    s.request(other)
    s.request(late)  # told: GPU 0 held by first.service
    s.inactive(first.name, Outcome.EXITED)  # other runs now
    assert summary(plan_start(s, late)) == (
        "late.service (priority 20) is already waiting: GPU 0 held by other.service, priority 10"
    )


def test_the_json_form_gives_a_holders_phase_and_none_for_others() -> None:
    """`phase` is the holder's phase; a plan for a unit that holds nothing has null."""
    s = host(VLM, VOICE)
    s.request(VLM)
    assert plan_start(s, VLM).to_json()["phase"] == "running"
    assert plan_start(s, VOICE).to_json()["phase"] is None


def test_a_waiter_whose_victims_still_stop_is_queued_for_their_gpus() -> None:
    """A unit already waiting for victims to give way: the plan names its target and them."""
    s = host(VLM, VOICE)
    s.request(VLM)
    s.request(VOICE)  # VLM is being stopped for it
    plan = plan_start(s, VOICE)
    assert plan.verdict is Verdict.QUEUED
    assert (plan.gpus, plan.victims) == ((0,), (VLM.name,))
    assert (plan.to_json()["gpus"], plan.to_json()["victims"]) == ([0], [VLM.name])
    assert summary(plan) == (
        "voice-pipeline.service (priority 10) is already waiting for vlm-analysis.service "
        "(priority 90) to stop on GPU 0"
    )


def test_a_waiter_not_told_why_yet_is_said_to_be_waiting() -> None:
    """Known while decisions are deferred (a controller restart), it has no reason yet."""
    a, b = spec("a", 10), spec("b", 10)
    s = host(a, b)
    s.request(a)
    with s.deferred():
        s.request(b)
    plan = plan_start(s, b)
    assert (plan.verdict, plan.reason) == (Verdict.QUEUED, None)
    assert summary(plan) == "b.service (priority 10) is already waiting"
    assert plan.to_json()["reason"] is None


def test_every_victim_is_named_once() -> None:
    """A unit that would preempt several: they are listed, comma-separated, in order."""
    x, y, big = spec("x", 90, BG), spec("y", 90, BG), spec("big", 10, gpus=2)
    s = host(x, y, big, gpus=2)
    s.request(x)
    s.request(y)
    plan = plan_start(s, big)
    assert (plan.verdict, plan.victims) == (Verdict.PREEMPTS, (x.name, y.name))
    assert summary(plan) == (
        "big.service (priority 10) would start on GPUs 0,1 once x.service, y.service gave way"
    )


@pytest.mark.parametrize("count", [8, 9, 300])
def test_the_summary_names_the_first_8_victims_and_the_json_all(count: int) -> None:
    """A unit that would preempt hundreds (small units packed on many GPUs): the summary
    is one bounded line, as the journal's (`listed`), and the JSON names every victim."""
    small = [spec(f"v{i:03}", 90, BG) for i in range(count)]
    big = spec("big", 10, gpus=count)
    s = host(*small, big, gpus=count)
    for unit in small:
        s.request(unit)
    plan = plan_start(s, big)
    names = [u.name for u in small]
    assert (plan.verdict, list(plan.victims)) == (Verdict.PREEMPTS, names)
    more = f" and {count - 8} more" if count > 8 else ""
    assert summary(plan).endswith(f" once {', '.join(names[:8])}{more} gave way")
    assert plan.to_json()["victims"] == names
    assert plan.to_json()["summary"] == summary(plan)


def test_a_suspended_unit_holds_but_names_no_gpus() -> None:
    """Suspended, it holds no GPU: the summary names its phase and no GPUs."""
    vlm = spec("vlm-analysis", 90, BG, preempt="suspend stop")
    s = host(vlm, VOICE)
    s.request(vlm)
    s.request(VOICE)
    s.suspended_done(vlm.name, "moved 1 GiB")
    plan = plan_start(s, vlm)
    assert (plan.verdict, plan.phase, plan.gpus) == (Verdict.HOLDS, "suspended", ())
    assert summary(plan) == (
        "vlm-analysis.service (priority 90) is already suspended: a start would change nothing"
    )


class _Broken(Scheduler):
    """A scheduler whose request neither grants nor queues: a broken rule."""

    def request(self, spec: UnitSpec) -> list[Action]:
        return []


def test_a_trial_request_that_neither_grants_nor_queues_is_a_broken_rule() -> None:
    """No plan is made up: the assertion names the unit (the trial copy keeps the class)."""
    s = _Broken(range(1), {VOICE.name: VOICE})
    with pytest.raises(AssertionError) as raised:
        plan_start(s, VOICE)
    assert str(raised.value) == (
        "a trial request of voice-pipeline.service neither granted nor queued it"
    )


def test_the_trial_copy_copies_flat_tables_and_shares_their_values() -> None:
    """A table (dict or set) of immutable values is a new table holding the same values,
    even a frozenset; one holding a tuple that holds a list is copied deeply."""
    s = host(VLM, VOICE)
    s.request(VLM)
    pair = frozenset({1, 2})
    s.extra_flat = {"a": pair}  # type: ignore[attr-defined]
    s.extra_set = {pair}  # type: ignore[attr-defined]
    s.extra_deep = {"a": ([1], 2)}  # type: ignore[attr-defined]
    t = trial_copy(s)
    assert t.extra_flat == {"a": pair} and t.extra_flat is not s.extra_flat  # type: ignore[attr-defined]
    assert t.extra_flat["a"] is pair  # type: ignore[attr-defined]
    assert t.extra_set == {pair} and t.extra_set is not s.extra_set  # type: ignore[attr-defined]
    assert next(iter(t.extra_set)) is pair  # type: ignore[attr-defined]
    t.extra_deep["a"][0].append(2)  # type: ignore[attr-defined]
    assert s.extra_deep == {"a": ([1], 2)}  # type: ignore[attr-defined]
