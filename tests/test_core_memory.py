"""The core with GPUs of known size: packing by declared memory, pinning, foreign use, lost GPUs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.core.model import Gpu, UnitKind, UnitSpec
from gpuslice.core.scheduler import Grant, Log, Outcome, Phase, Scheduler, Start, Stop
from tests.core_builders import brief, words

GIB = 1 << 30
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


def test_ignore_policy_only_counts_foreign_memory() -> None:
    bg = unit("bg", 90, 10, BG)
    s = Scheduler(
        [gpu(0, foreign=20 * GIB, foreign_pids=(7,))], {bg.name: bg}, yield_to_foreign=False
    )
    assert brief(s.schedule()) == []  # 4 GiB free: does not fit
    assert brief(s.set_gpus([gpu(0, foreign=10 * GIB, foreign_pids=(7,))])) == ["start bg.service"]


def test_lost_gpu_is_reported_and_never_granted() -> None:
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
            st.sampled_from(["request", "exit", "finish"]),
            st.integers(0, 5),
            st.integers(0, 99),
            st.integers(1, 16),
        ),
        max_size=40,
    )
)
def test_declared_memory_never_exceeds_capacity(events: list[tuple[str, int, int, int]]) -> None:
    """Whatever arrives, the declared memory of the units holding a GPU fits in it."""
    s = two_gpus()
    specs: dict[str, UnitSpec] = {}
    for op, n, prio, mem in events:
        name = f"u{n}.service"
        if op == "request":
            spec = specs.setdefault(name, UnitSpec(name, prio, memory=mem * GIB))
            if name not in s.holders:
                s.request(spec)
        elif op == "exit" and name in s.holders and s.holders[name].phase is Phase.RUNNING:
            s.inactive(name, Outcome.EXITED)
        elif op == "finish":
            for victim, h in list(s.holders.items()):
                if h.phase is Phase.STOPPING:
                    s.inactive(victim, Outcome.STOPPED)
        for index, device in s.devices.items():
            declared = sum(
                h.spec.memory or device.total or 0
                for h in s.holders.values()
                if index in h.gpus and h.phase is Phase.RUNNING
            )
            assert declared <= (device.total or 0) - device.reserve
