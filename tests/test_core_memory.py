"""The core with GPUs of known size: packing by declared memory, pinning, foreign use, lost GPUs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.core.model import Gpu, UnitKind, UnitSpec
from gpuslice.core.scheduler import Grant, Log, Outcome, Phase, Scheduler, Start, Stop
from tests.core_builders import GIB, Sim, brief, words

BG = UnitKind.BACKGROUND


def gpu(index: int, total_gib: int = 24, **kw: object) -> Gpu:
    return Gpu(index, f"GPU-{index}", "Fake 24GB", total_gib * GIB, **kw)  # type: ignore[arg-type]


def unit(
    name: str, prio: int, mem_gib: float | None, kind: UnitKind = UnitKind.ON_DEMAND, **kw: object
) -> UnitSpec:
    memory = None if mem_gib is None else int(mem_gib * GIB)
    return UnitSpec(f"{name}.service", prio, kind, memory=memory, **kw)  # type: ignore[arg-type]


def two_gpus(*specs: UnitSpec, **kw: object) -> Scheduler:
    return Scheduler([gpu(0), gpu(1)], {s.name: s for s in specs}, **kw)  # type: ignore[arg-type]


def settle_starts(s: Scheduler, actions: list[object]) -> list[str]:
    """Play Start actions back as gate requests; returns every brief action seen."""
    seen = brief(a for a in actions if isinstance(a, Grant | Stop | Start))
    for a in list(actions):
        if isinstance(a, Start):
            more = s.request(s.specs[a.unit])
            seen += settle_starts(s, list(more))
    return seen


def test_two_10g_background_units_pack_on_one_gpu() -> None:
    a, b = unit("a", 90, 10, BG), unit("b", 91, 10, BG)
    s = two_gpus(a, b)
    assert settle_starts(s, list(s.schedule())) == [
        "start a.service",
        "start b.service",
        "grant a.service 0",
        "grant b.service 0",
    ]


def test_tightest_fit_keeps_a_large_hole() -> None:
    small, big = unit("small", 20, 4), unit("big", 20, 20)
    s = two_gpus(small, big)
    s.holders.clear()
    assert brief(s.request(unit("first", 30, 10))) == ["grant first.service 0"]
    assert brief(s.request(small)) == ["grant small.service 0"]  # 14 GiB hole on GPU 0
    assert brief(s.request(big)) == ["grant big.service 1"]


def test_20g_unit_preempts_exactly_the_right_victim() -> None:
    bg1, bg2, bg3 = unit("bg1", 90, 10, BG), unit("bg2", 80, 10, BG), unit("bg3", 95, 4, BG)
    s = two_gpus(bg1, bg2, bg3)
    settle_starts(s, list(s.schedule()))
    # bg2 and bg1 pack on GPU 0 (20 GiB), bg3 fits there too (24 GiB)
    assert {n: sorted(h.gpus) for n, h in s.holders.items()} == {
        "bg2.service": [0],
        "bg1.service": [0],
        "bg3.service": [0],
    }
    big = unit("big", 10, 20)
    actions = s.request(big)
    assert brief(actions) == ["grant big.service 1"]  # GPU 1 is free: nobody goes
    other = unit("other", 10, 10)
    actions = s.request(other)
    # GPU 0 is full and 10 GiB must go: bg2 (80) is the most urgent and is spared; bg1 (90,
    # 10 GiB) suffices alone; bg3 (95, 4 GiB) is less urgent but alone frees too little, and
    # stopping it as well as bg1 would free more than needed
    assert brief(actions) == ["stop bg1.service"]
    assert "preempting bg1.service (priority 90) for other.service (priority 10) on GPU 0" in (
        words(actions)
    )


def test_waiting_reason_names_memory() -> None:
    holder, waiter = unit("voice-pipeline", 10, 10), unit("big", 20, 20)
    s = Scheduler([gpu(0, reserve=int(0.8 * GIB))], {})
    s.request(holder)
    actions = s.request(waiter)
    assert s.waiters["big.service"].reason == (
        "waiting: needs 20 GiB on one GPU; GPU 0 has 13.2 GiB free after the reserve, "
        "held by voice-pipeline.service, priority 10"
    )
    assert not [a for a in actions if isinstance(a, Stop)]


def test_devices_pin_by_index_and_uuid() -> None:
    s = two_gpus()
    assert brief(s.request(unit("one", 10, 4, devices=("1",)))) == ["grant one.service 1"]
    assert brief(s.request(unit("uu", 10, 4, devices=("GPU-1",)))) == ["grant uu.service 1"]
    s.request(unit("hog", 5, None, devices=("0",)))
    pinned = unit("pin", 50, None, devices=("GPU-0",))
    assert brief(s.request(pinned)) == []
    assert s.waiters["pin.service"].reason == "waiting: GPU 0 held by hog.service, priority 5"


def test_background_units_yield_to_a_foreign_process_and_return() -> None:
    bg = unit("bg", 90, 10, BG)
    s = Scheduler([gpu(0)], {bg.name: bg})
    settle_starts(s, list(s.schedule()))
    actions = s.set_gpus([gpu(0, foreign=2 * GIB, foreign_pids=(4242,))])
    assert brief(actions) == ["stop bg.service"]
    assert words(actions)[0] == (
        "yielding GPU 0: stopping background bg.service (priority 90) while a process "
        "gpuslice does not manage uses it (PID 4242)"
    )
    assert brief(s.inactive("bg.service", Outcome.STOPPED)) == []  # stays out while it runs
    assert s.snapshot().preempted == [("bg.service", 90, True)]
    assert brief(s.set_gpus([gpu(0)])) == ["start bg.service"]


def test_a_yield_names_whose_processes_it_yields_to() -> None:
    """Beside Slurm or Kubernetes the line says whose the processes are, each owner once,
    over every GPU the unit yields."""
    bg = unit("bg", 90, None, BG, gpus=2)
    s = Scheduler([gpu(0), gpu(1)], {bg.name: bg})
    settle_starts(s, list(s.schedule()))
    slurm = ("Slurm job 881",)
    actions = s.set_gpus(
        [
            gpu(0, foreign=GIB, foreign_pids=(7,), foreign_owners=slurm),
            gpu(1, foreign=GIB, foreign_pids=(8, 9), foreign_owners=("UID 1000", *slurm)),
        ]
    )
    assert words(actions) == [
        "yielding GPUs 0,1: stopping background bg.service (priority 90) while a process "
        "gpuslice does not manage uses it (PID 7, 8, 9; Slurm job 881, UID 1000)"
    ]


def test_a_waiter_kept_off_by_foreign_memory_is_told_whose_it_is() -> None:
    """Seed 001's question, "busy, or only with my own workers?", answered in the reason."""
    slurm = gpu(0, foreign=20 * GIB, foreign_pids=(7,), foreign_owners=("Slurm job 881",))
    s = Scheduler([slurm], {})
    s.request(unit("asr", 10, 8))
    assert s.waiters["asr.service"].reason == (
        "waiting: needs 8 GiB on one GPU; GPU 0 has 4 GiB free after the reserve, "
        "20 GiB used by processes of no holder (Slurm job 881)"
    )


def test_ignore_policy_only_counts_foreign_memory() -> None:
    bg = unit("bg", 90, 10, BG)
    s = Scheduler(
        [gpu(0, foreign=20 * GIB, foreign_pids=(7,))], {bg.name: bg}, yield_to_foreign=False
    )
    assert brief(s.schedule()) == []  # 4 GiB free: does not fit
    assert brief(s.set_gpus([gpu(0, foreign=10 * GIB, foreign_pids=(7,))])) == ["start bg.service"]


def test_a_reload_to_the_yield_policy_makes_background_units_yield() -> None:
    """set_policy (config.yaml's foreign_processes reloaded) applies from the next decision."""
    bg = unit("bg", 90, 10, BG)
    s = Scheduler([gpu(0)], {bg.name: bg}, yield_to_foreign=False)
    settle_starts(s, list(s.schedule()))
    s.set_policy(yield_to_foreign=True, requeue_at_gate=False)
    actions = s.set_gpus([gpu(0, foreign=2 * GIB, foreign_pids=(4242,))])
    assert brief(actions) == ["stop bg.service"]


def test_lost_gpu_is_reported_and_its_holder_keeps_it() -> None:
    a = unit("a", 10, None)
    s = two_gpus(a)
    s.request(a)
    actions = s.set_gpus([gpu(0, lost=True), gpu(1)])
    assert [a.message for a in actions if isinstance(a, Log)] == [
        "GPU 0 is lost; it was held by a.service"
    ]
    assert brief(s.request(unit("b", 10, None))) == ["grant b.service 1"]
    assert s.holders["a.service"].phase is Phase.RUNNING  # nothing is stopped for it


def test_multi_gpu_unit_with_memory_gets_gpus_that_all_fit() -> None:
    s = two_gpus()
    s.request(unit("x", 50, 20, devices=("0",)))
    assert brief(s.request(unit("pair", 10, 10, gpus=2))) == ["stop x.service"]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["request", "request", "exit", "finish", "sample"]),
            st.integers(0, 5),
            st.sampled_from([10, 20, 50, 90]),
            st.sampled_from([None, 1, 4, 10, 16, 23]),
            st.tuples(st.sampled_from([0, GIB]), st.sampled_from([0, 0, 3 * GIB]), st.booleans()),
        ),
        max_size=40,
    )
)
def test_declared_memory_never_exceeds_capacity(
    events: list[tuple[str, int, int, int | None, tuple[int, int, bool]]],
) -> None:
    """Whatever arrives (whole-GPU and Memory= units, reserves, foreign use, lost GPUs), no
    GPU holds more declared memory than total - reserve - foreign, a whole-GPU unit shares
    with nobody and nothing is granted on a lost GPU: `Sim` checks every Grant. Once every
    unit has ended, every unit that fits has run."""
    specs: dict[str, UnitSpec] = {}
    sim = Sim([gpu(0), gpu(1)])
    for op, n, prio, mem, (reserve, foreign, lost) in events:
        name = f"u{n}.service"
        if op == "request":
            unit_spec = specs.setdefault(name, unit(f"u{n}", prio, mem))
            if unit_spec.name not in sim.annotations:
                sim.annotate(specs.values())
            sim.start(name)
        elif op == "exit" and name in sim.running and name not in sim.pending_stops:
            sim.exit(name)
        elif op == "finish":
            sim.settle()
        elif op == "sample":
            lost_one = gpu(n % 2, reserve=reserve, foreign=foreign, lost=lost)
            sim.sample([lost_one if g.index == n % 2 else g for g in sim.devices.values()])
    sim.drain()


# -- whole GPUs next to Memory= units -------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second"),
    [
        pytest.param(None, 4, id="a Memory= unit never joins a whole-GPU holder"),
        pytest.param(4, None, id="a whole-GPU unit never joins a Memory= holder"),
        pytest.param(None, None, id="two whole-GPU units never share"),
    ],
)
def test_whole_gpu_unit_never_shares_its_gpu(first: float | None, second: float | None) -> None:
    s = Scheduler([gpu(0)], {})
    assert brief(s.request(unit("a", 10, first))) == ["grant a.service 0"]
    assert brief(s.request(unit("b", 10, second))) == []
    assert list(s.waiters) == ["b.service"]
    assert brief(s.inactive("a.service", Outcome.EXITED)) == ["grant b.service 0"]


def test_whole_gpu_unit_takes_the_free_gpu_next_to_a_packed_one() -> None:
    s = two_gpus()
    assert brief(s.request(unit("small", 10, 4))) == ["grant small.service 0"]
    assert brief(s.request(unit("whole", 10, None))) == ["grant whole.service 1"]
    assert brief(s.request(unit("more", 10, 4))) == ["grant more.service 0"]


def test_a_whole_gpu_unit_takes_an_idle_gpu_over_one_a_foreign_job_fills() -> None:
    """Seed 001's question, "is the GPU really busy?": a unit without Memory= has its GPU to
    itself, so of two it may take it gets the one no foreign process uses (it got GPU 0, the
    lower index, beside a Slurm job's 20 GiB, and ran out of memory there with GPU 1 idle)."""
    slurm = gpu(0, foreign=20 * GIB, foreign_pids=(7,), foreign_owners=("Slurm job 881",))
    s = Scheduler([slurm, gpu(1)], {})
    assert brief(s.request(unit("voice", 10, None))) == ["grant voice.service 1"]
    # with no idle GPU left it is granted the busy one, as before: nothing counts it there
    assert brief(s.request(unit("asr", 10, None))) == ["grant asr.service 0"]


def test_a_whole_gpu_background_unit_takes_the_gpu_with_the_least_foreign_memory() -> None:
    """A display server (graphics only: no yield) still fills part of its GPU."""
    bg = unit("bg", 90, None, BG)
    desktop = gpu(0, foreign=3 * GIB)
    s = Scheduler([desktop, gpu(1, foreign=GIB), gpu(2, foreign=2 * GIB)], {bg.name: bg})
    assert brief(s.schedule()) == ["start bg.service"]
    assert s.holders["bg.service"].gpus == frozenset({1})
    pair = unit("pair", 10, None, gpus=2)
    assert brief(s.request(pair)) == ["grant pair.service 0,2"]


def test_a_whole_gpu_unit_that_preempts_stops_the_one_on_the_gpu_foreign_jobs_use_least() -> None:
    """Shunning foreign memory holds for a place made by preemption too: of two equal victims
    it stops the one on the idle GPU, not the most recently started one beside 20 GiB."""
    s = Scheduler([gpu(0, foreign=20 * GIB), gpu(1)], {})
    assert brief(s.request(unit("early", 90, None))) == ["grant early.service 1"]
    assert brief(s.request(unit("late", 90, None))) == ["grant late.service 0"]
    assert brief(s.request(unit("urgent", 10, None))) == ["stop early.service"]


def test_a_whole_gpu_unit_found_running_is_booked_by_index_not_away_from_its_own_memory() -> None:
    """Annotated while it ran ungated (CUDA's GPU 0), its own 10 GiB there count as foreign
    until it is booked: shunned, it was booked on GPU 1, and GPU 0 granted to the next job."""
    mine = gpu(0, foreign=10 * GIB)
    vlm = unit("vlm", 50, None)
    s = Scheduler([mine, gpu(1)], {vlm.name: vlm})
    s.running(vlm.name)
    assert s.holders[vlm.name].gpus == frozenset({0})


# -- lost GPUs ------------------------------------------------------------------------------


def test_a_lost_gpu_is_never_granted_even_when_free() -> None:
    s = two_gpus()
    s.request(unit("a", 10, None))  # GPU 0
    assert words(s.set_gpus([gpu(0), gpu(1, lost=True)])) == [
        "GPU 1 is lost; it was held by no unit"
    ]
    assert brief(s.request(unit("b", 10, 4))) == []
    assert brief(s.request(unit("pair", 20, None, gpus=2))) == []
    assert s.waiters["pair.service"].reason == (
        "waiting: needs 2 GPUs; only 1 of this host's GPUs may run it "
        "(Devices=, lost GPUs, or processes gpuslice does not manage)"
    )
    assert brief(s.set_gpus([gpu(0), gpu(1)])) == ["grant b.service 1"]


def test_a_lost_gpu_is_reported_once_and_again_after_it_came_back() -> None:
    s = two_gpus()
    assert words(s.set_gpus([gpu(0, lost=True), gpu(1)])) == [
        "GPU 0 is lost; it was held by no unit"
    ]
    assert words(s.set_gpus([gpu(0, lost=True), gpu(1)])) == []
    assert words(s.set_gpus([gpu(0), gpu(1)])) == []
    assert words(s.set_gpus([gpu(0, lost=True), gpu(1, lost=True)])) == [
        "GPU 0 is lost; it was held by no unit",
        "GPU 1 is lost; it was held by no unit",
    ]


def test_a_new_gpu_that_is_lost_from_the_start_is_reported() -> None:
    s = Scheduler([gpu(0)], {})
    assert words(s.set_gpus([gpu(0), gpu(1, lost=True)])) == [
        "GPU 1 is lost; it was held by no unit"
    ]


def test_a_lost_gpu_names_every_unit_that_held_it() -> None:
    s = two_gpus()
    s.request(unit("b", 10, 4))
    s.request(unit("a", 10, 4))
    assert words(s.set_gpus([gpu(0, lost=True), gpu(1)])) == [
        "GPU 0 is lost; it was held by a.service, b.service"
    ]


@pytest.mark.parametrize(
    "sample",
    [
        pytest.param(gpu(0, lost=True), id="lost"),
        pytest.param(gpu(0, foreign=20 * GIB), id="filled by leftovers"),
    ],
)
def test_a_start_on_its_way_is_not_granted_a_gpu_that_no_longer_takes_it(sample: Gpu) -> None:
    bg = unit("bg", 90, 10, BG)
    s = two_gpus(bg)
    assert brief(s.schedule()) == ["start bg.service"]  # counted on GPU 0 until its gate asks
    s.set_gpus([sample, gpu(1)])
    assert brief(s.request(bg)) == ["grant bg.service 1"]


# -- which GPU's units are preempted ----------------------------------------------------------


@pytest.mark.parametrize(
    ("on0", "on1", "victims"),
    [
        pytest.param(
            [("p80", 80, 20)],
            [("q90", 90, 10), ("r90", 90, 10)],
            ["q90.service", "r90.service"],
            id="two less urgent units rather than one more urgent",
        ),
        pytest.param(
            [("q90", 90, 10), ("r90", 90, 10)],
            [("p90", 90, 20)],
            ["p90.service"],
            id="among equally urgent sets, the fewest units",
        ),
        pytest.param(
            [("p70", 70, 20)],
            [("q80", 80, 20)],
            ["q80.service"],
            id="one unit each: the least urgent",
        ),
        pytest.param(
            [("p90", 90, 24)],
            [("q90", 90, 20)],
            ["q90.service"],
            id="equal victims: the one that frees least beyond need",
        ),
    ],
)
def test_victims_between_gpus(
    on0: list[tuple[str, int, int]], on1: list[tuple[str, int, int]], victims: list[str]
) -> None:
    s = two_gpus()
    for index, holders in enumerate((on0, on1)):
        for name, prio, mem in holders:
            s.request(unit(name, prio, mem, devices=(str(index),)))
    assert sorted(s.holders) == sorted(n + ".service" for n, _, _ in on0 + on1)
    actions = s.request(unit("top", 10, 20))
    assert sorted(a.unit for a in actions if isinstance(a, Stop)) == victims


def test_victims_among_equals_are_the_most_recently_started() -> None:
    s = two_gpus()
    s.request(unit("old", 90, 20, devices=("1",)))
    s.request(unit("new", 90, 20, devices=("0",)))
    assert brief(s.request(unit("top", 10, 20))) == ["stop new.service"]


def test_victims_on_one_gpu_spare_the_most_urgent_first() -> None:
    s = Scheduler([gpu(0)], {})
    for name, prio, mem in [("a", 50, 8), ("b", 60, 8), ("c", 70, 4), ("d", 80, 4)]:
        s.request(unit(name, prio, mem))
    # 12 GiB needed, none free: a (50) is spared, b (60) must go, then c (70) is spared: d
    # (80) and b free exactly 12 GiB
    assert sorted(a.unit for a in s.request(unit("top", 10, 12)) if isinstance(a, Stop)) == [
        "b.service",
        "d.service",
    ]


def test_victims_on_one_gpu_are_the_fewest_among_equals() -> None:
    s = Scheduler([gpu(0)], {})
    for name, mem in [("b", 8), ("c", 4), ("d", 4), ("e", 4)]:
        s.request(unit(name, 60, mem))
    assert brief(s.request(unit("top", 10, 12))) == ["stop b.service"]


def test_waiting_reason_behind_a_whole_gpu_holder_does_not_claim_free_memory() -> None:
    s = Scheduler([gpu(0)], {})
    s.request(unit("a", 10, None))
    s.request(unit("b", 10, 4))
    assert "24 GiB free" not in s.waiters["b.service"].reason


# -- tightest fit, GPU sets, the words of a wait ------------------------------------------------


def test_tightest_fit_wins_over_the_lower_index() -> None:
    s = two_gpus()
    s.request(unit("first", 30, 10, devices=("1",)))
    assert brief(s.request(unit("small", 20, 4))) == ["grant small.service 1"]
    assert brief(s.request(unit("big", 20, 20))) == ["grant big.service 0"]


def test_a_multi_gpu_unit_takes_the_tightest_set_of_gpus() -> None:
    s = Scheduler([gpu(0), gpu(1), gpu(2)], {})
    s.request(unit("x", 30, 10, devices=("1",)))
    s.request(unit("y", 30, 10, devices=("2",)))
    assert brief(s.request(unit("pair", 20, 10, gpus=2))) == ["grant pair.service 1,2"]


def test_memory_unit_on_gpus_of_unknown_size_takes_a_whole_gpu() -> None:
    s = Scheduler(range(2), {})
    assert brief(s.request(unit("a", 10, 4))) == ["grant a.service 0"]
    assert brief(s.request(unit("b", 10, 4))) == ["grant b.service 1"]
    assert brief(s.request(unit("c", 10, 4))) == []
    assert s.waiters["c.service"].reason == (
        "waiting: needs 4 GiB on one GPU; GPU 0 held by a.service, priority 10; "
        "GPU 1 held by b.service, priority 10"
    )


def test_waiting_reason_of_a_multi_gpu_memory_unit() -> None:
    s = two_gpus()
    s.request(unit("x", 10, 20, devices=("0",)))
    s.request(unit("pair", 20, 10, gpus=2))
    assert s.waiters["pair.service"].reason == (
        "waiting: needs 10 GiB on each of 2 GPUs; GPU 0 has 4 GiB free after the reserve, "
        "held by x.service, priority 10; GPU 1 has 14 GiB free after the reserve"
    )


def test_waiting_reason_of_a_multi_gpu_whole_unit() -> None:
    s = Scheduler(range(2), {})
    s.request(unit("x", 10, None))
    s.request(unit("pair", 20, None, gpus=2))
    assert s.waiters["pair.service"].reason == (
        "waiting: needs 2 GPUs; GPU 0 held by x.service, priority 10"
    )


def test_waiting_reason_names_the_most_urgent_holder_of_a_packed_gpu() -> None:
    s = Scheduler([gpu(0)], {})
    s.request(unit("low", 50, 10))
    s.request(unit("high", 20, 10))
    s.request(unit("c", 60, 10))
    assert s.waiters["c.service"].reason == (
        "waiting: needs 10 GiB on one GPU; GPU 0 has 4 GiB free after the reserve, "
        "held by high.service, priority 20"
    )


def test_on_a_host_too_large_to_weigh_every_gpu_set_gpus_are_chosen_one_by_one() -> None:
    """15 GPUs, 8 wanted: C(15, 8) = 6435 sets is past the limit (5000). The 8 most recently
    started single-GPU units go, not the 7-GPU unit and one more (which weighing sets finds)."""
    s = Scheduler(range(15), {})
    s.request(unit("wide", 90, None, gpus=7, devices=tuple(str(i) for i in range(7))))
    for i in range(7, 15):
        s.request(unit(f"one{i}", 90, None, devices=(str(i),)))
    stops = [a.unit for a in s.request(unit("top", 10, None, gpus=8)) if isinstance(a, Stop)]
    assert sorted(stops) == sorted(f"one{i}.service" for i in range(7, 15))


def test_a_victim_holding_several_gpus_frees_them_all() -> None:
    s = Scheduler(range(4), {})
    s.request(unit("wide", 90, None, gpus=2, devices=("0", "1")))
    s.request(unit("one", 90, None, devices=("2",)))
    s.request(unit("two", 90, None, devices=("3",)))
    stops = [a.unit for a in s.request(unit("top", 10, None, gpus=2)) if isinstance(a, Stop)]
    assert stops == ["wide.service"]


def test_no_background_unit_yields_while_the_host_goes_down() -> None:
    """The shutdown stops it anyway: a yield's stop only raced it. A cancelled shutdown
    yields it then."""
    bg = unit("bg", 90, 10, BG)
    s = Scheduler([gpu(0)], {bg.name: bg})
    settle_starts(s, list(s.schedule()))
    s.set_shutting_down(True)
    assert brief(s.set_gpus([gpu(0, foreign=2 * GIB, foreign_pids=(4242,))])) == []
    assert s.phase(bg.name) is Phase.RUNNING
    assert brief(s.set_shutting_down(False)) == ["stop bg.service"]
