"""The "day on one GPU" case's arithmetic (bench/day.py), on hand-made logs: what counts as
a wait, busy time, an item redone or interrupted, a load, a preemption; and the oracle's own
schedule. No container: these run in `make test`'s fast layer."""

from __future__ import annotations

import pytest

from bench import day_probe
from bench.day import (
    EMBED,
    NIGHTLY,
    ORACLES,
    POLICIES,
    TRANSCRIBE,
    VLM,
    VRAM_PER_JOB,
    Day,
    Job,
    Replay,
    analyse,
    day_plan,
    day_table,
    parse_log,
    percentile,
    preemptions,
    rows_of,
    shared_s,
    simulate,
    union_s,
    unit_files,
    unit_text,
    walk,
    with_oracles,
)
from bench.day_probe import GAP_S, Clock
from tests.bed import fakegpu

BG = "bg.service"
OD = "od.service"
OD2 = "od2.service"


def log(*lines: str) -> str:
    return "\n".join(lines) + "\n"


def small_day(*on_demand: Job, bg_items: int = 5, window_s: float = 10.0) -> Day:
    """A background job (1 s load, 1 s items) and the given on-demand jobs."""
    return Day(window_s, (Job(BG, 90, "background", 1.0, 1.0, bg_items), *on_demand))


def od(at_s: float, unit: str = OD, items: int = 1, priority: int = 10) -> Job:
    return Job(unit, priority, "on-demand", 0.0, 1.0, items, at_s=at_s)


# ------------------------------------------------------------------------------- the logs


def test_a_line_a_kill_cut_short_is_skipped() -> None:
    text = "start 1.5\nbegin 2.0 3\nend 2.5 3\nbegin\nend x 4\nbegin 3.0"
    assert parse_log(text) == [
        ("start", 1.5, None),
        ("begin", 2.0, 3),
        ("end", 2.5, 3),
        ("begin", 3.0, None),
    ]


def test_a_stop_mid_item_interrupts_it_and_the_next_run_redoes_it() -> None:
    events = parse_log(
        log(
            "start 0", "load 0", "ready 1", "begin 1 0", "end 2 0", "begin 2 1", "stop 2.5",
            "start 4", "load 4", "ready 5", "begin 5 1", "end 6 1", "done 6",
        )
    )  # fmt: skip
    w = walk(events, t_end=10)
    assert (w.loads, w.stops, w.interrupted, w.redone, w.done_items) == (2, 1, 1, 1, 2)
    assert w.work == [(1, 2), (5, 6)]  # the half item lost to the stop is no work
    assert w.active == [(0, 2.5), (4, 6)]
    assert w.starts == [0, 4]


def test_the_stop_at_the_end_of_the_day_is_no_preemption() -> None:
    events = parse_log(log("start 0", "load 0", "ready 1", "begin 1 0", "stop 10.2"))
    w = walk(events, t_end=10)
    assert (w.stops, w.interrupted, w.redone) == (0, 0, 0)


def test_a_paused_item_counts_only_the_time_it_was_worked_on() -> None:
    events = parse_log(
        log("start 0", "load 0", "ready 1", "begin 1 0", "pause 1.5", "resume 3", "end 3.5 0")
    )
    w = walk(events, t_end=10)
    assert w.work == [(1, 1.5), (3, 3.5)]
    assert w.active == [(0, 1.5), (3, 3.5)]
    assert (w.stops, w.interrupted, w.redone, w.done_items) == (1, 0, 0, 1)


def test_a_suspended_job_loads_once_and_redoes_nothing_while_its_pause_is_no_work() -> None:
    day = small_day(od(2.5))
    replay = Replay(
        t0=0.0,
        t_end=10.0,
        requests={OD: 2.5},
        logs={
            BG: log("start 0", "load 0", "ready 1", "begin 1 0", "end 2 0", "begin 2 1",
                    "pause 2.6", "resume 4", "end 4.4 1", "begin 4.4 2", "end 5.4 2", "stop 10.1"),
            OD: log("start 2.7", "load 2.7", "ready 2.7", "begin 2.7 0", "end 3.7 0", "done 3.7"),
        },
        preemptions=preemptions({"suspend": 1, "suspended": 1, "resume": 1, "grant": 3}),
    )  # fmt: skip
    m = analyse(day, replay)
    assert (m["loads"], m["items_redone"], m["items_interrupted"]) == (2, 0, 0)
    assert (m["preemptions"], m["pauses"], m["stops_in_logs"]) == (1, 1, 1)
    assert m["shared_s"] == 0  # paused at 2.6: not on the GPU with OD from 2.7
    # bg's item 1 was worked on 2-2.6 and 4-4.4: 1 s, as its items take
    assert m["bg_work_s"] == pytest.approx(3)


def test_preemptions_count_each_way_of_giving_way_once() -> None:
    assert preemptions({}) == 0
    assert preemptions({"preempt": 2, "suspend": 3, "freeze": 1, "grant": 9}) == 6
    # a suspend that failed fell to a stop: one preemption, not two
    assert preemptions({"suspend": 1, "rung-failed": 1, "preempt": 1}) == 1


class SleepsExactly:
    """day_probe's `time`: a clock moved only by its own sleeps (each as long as asked, a
    microsecond at least, as a real one takes) and by the test. On the real one, a loaded
    machine that ran the test late made a gap of its own, said as a pause."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 1e-6)


def test_the_workers_clock_says_a_gap_as_a_pause_and_counts_only_the_time_it_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exact = SleepsExactly()
    monkeypatch.setattr(day_probe, "time", exact)
    lines: list[str] = []
    clock = Clock(lambda *parts: lines.append(" ".join(map(str, parts))))
    ran = clock.check(0.01)
    assert lines == [] and 0 <= ran < GAP_S
    frozen_from = exact.time() - 3.0
    clock.last = frozen_from  # as if frozen for 3 s right after its last look
    assert clock.check(0.01) == 0.01
    (pause, p_at, _), (resume, r_at, _) = parse_log("\n".join(lines))
    assert (pause, resume) == ("pause", "resume")
    assert p_at == pytest.approx(frozen_from + 0.01, abs=1e-5)
    assert r_at - p_at > 2.9
    lines.clear()
    clock.run(0.03)  # no gap: only running time, and nothing said
    assert lines == []


def test_a_run_that_died_without_a_word_ends_at_the_next_start() -> None:
    events = parse_log(log("start 0", "load 0", "ready 1", "begin 1 0", "start 3", "load 3"))
    w = walk(events, t_end=10)
    assert (w.interrupted, w.active) == (1, [(0, 3), (3, 3)])


def test_a_run_killed_before_it_said_anything_after_its_start_never_held_the_gpu() -> None:
    """bash stamps `start`, then execs the worker, which takes SIGTERM before anything else
    and holds VRAM only after: a stop in between leaves no `stop` line. Such a run held
    nothing, and is not a job on the GPU until the next start (the day of 2026-12-03 00:33
    counted 3.8 s of "two jobs at once" for gpuslice from one: a refill preempted at once)."""
    events = parse_log(log("start 0", "start 4", "load 4", "ready 5", "done 6"))
    w = walk(events, t_end=10)
    assert (w.interrupted, w.active) == (0, [(0, 0), (4, 6)])


def test_spans_are_counted_once_and_only_within_the_window() -> None:
    assert union_s([(1, 3), (2, 4), (6, 7), (9, 12)], lo=0, hi=10) == pytest.approx(5)
    assert union_s([(1, 3), (1.5, 2)], lo=2, hi=10) == pytest.approx(1)
    assert union_s([], lo=0, hi=10) == 0


def test_shared_time_is_where_two_units_ran_at_once() -> None:
    spans = {"a": [(0.0, 4.0)], "b": [(3.0, 6.0)], "c": [(3.5, 5.0)], "d": [(8.0, 9.0)]}
    assert shared_s(spans, 0, 10) == pytest.approx(2.0)  # 3-5: two or three at once
    assert shared_s({"a": [(0.0, 4.0)], "b": [(4.0, 6.0)]}, 0, 10) == 0  # a handover


def test_percentiles_are_values_that_occurred() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert (percentile(xs, 0.5), percentile(xs, 0.99), percentile([], 0.5)) == (3.0, 5.0, None)


def test_analyse_waits_busy_loads_and_preemptions_from_the_logs() -> None:
    day = small_day(od(2.0), od(5.0, OD2))
    replay = Replay(
        t0=100.0,
        t_end=110.0,
        requests={OD: 102.0, OD2: 105.0},
        logs={
            BG: log(
                "start 100", "load 100", "ready 101", "begin 101 0", "end 102 0",
                "begin 102 1", "stop 102.1",
                "start 103.5", "load 103.5", "ready 104.5", "begin 104.5 1", "end 105.5 1",
                "stop 110.1",
            ),
            OD: log("start 102.2", "load 102.2", "ready 102.2", "begin 102.2 0",
                    "end 103.2 0", "done 103.2"),
            # OD2 asked at 105, never started: unserved
        },
        preemptions=None,
    )  # fmt: skip
    m = analyse(day, replay)
    assert (m["od_requests"], m["od_served"], m["unserved"]) == (2, 1, [OD2])
    assert m["wait_p50_ms"] == m["wait_p99_ms"] == pytest.approx(200)
    # completed items: 101-102, 102.2-103.2, 104.5-105.5: 3 s of 10
    assert m["busy_pct"] == pytest.approx(30)
    assert m["bg_work_s"] == pytest.approx(2)
    assert (m["loads"], m["preemptions"], m["items_interrupted"], m["items_redone"]) == (
        3,
        1,
        1,
        1,
    )
    assert m["shared_s"] == 0
    journal = Replay(replay.t0, replay.t_end, replay.requests, replay.logs, preemptions=4)
    assert analyse(day, journal)["preemptions"] == 4  # the controller's own count wins


# ------------------------------------------------------------------------------- the oracle


def test_the_stop_oracle_preempts_at_once_and_pays_a_load_and_the_item_in_hand() -> None:
    r = simulate(small_day(od(2.5)), "stop")
    assert r.logs[BG].split("\n") == [
        "start 0.000000", "load 0.000000", "ready 1.000000",
        "begin 1.000000 0", "end 2.000000 0", "begin 2.000000 1", "stop 2.500000",
        "start 3.500000", "load 3.500000", "ready 4.500000",
        "begin 4.500000 1", "end 5.500000 1", "begin 5.500000 2", "end 6.500000 2",
        "begin 6.500000 3", "end 7.500000 3", "begin 7.500000 4", "end 8.500000 4",
        "done 8.500000", "",
    ]  # fmt: skip
    assert r.logs[OD].split("\n")[:2] == ["start 2.500000", "load 2.500000"]
    m = analyse(small_day(od(2.5)), r)
    assert (m["wait_p99_ms"], m["preemptions"], m["loads"], m["items_redone"]) == (0, 1, 3, 1)
    assert m["busy_pct"] == pytest.approx(60)  # 5 bg items + 1 od item in 10 s


def test_the_free_oracle_resumes_where_it_was() -> None:
    day = small_day(od(2.5))
    r = simulate(day, "suspend")
    assert "pause 2.500000" in r.logs[BG] and "resume 3.500000" in r.logs[BG]
    m = analyse(day, r)
    assert (m["preemptions"], m["loads"], m["items_redone"], m["items_interrupted"]) == (1, 2, 0, 0)
    assert m["busy_pct"] == pytest.approx(60)  # all done by 7 s: work ran out, not time
    assert m["shared_s"] == 0


def test_the_oracle_serves_on_demand_jobs_by_priority_then_arrival() -> None:
    day = small_day(od(2.0, items=2), od(2.5, OD2), od(2.2, "n.service", priority=50))
    m = analyse(day, simulate(day, "stop"))
    # OD runs 2-4; OD2 (priority 10) waits 1.5 s and runs 4-5; n (50) waits 2.8 s
    assert m["waits_ms"] == pytest.approx({OD: 0, OD2: 1500, "n.service": 2800})


def test_the_oracle_cuts_the_day_at_its_end() -> None:
    day = small_day(bg_items=100, window_s=4.5)
    r = simulate(day, "stop")
    assert r.logs[BG].splitlines()[-2:] == ["begin 4.000000 3", "stop 4.500000"]
    m = analyse(day, r)
    assert (m["preemptions"], m["items_interrupted"], m["busy_pct"]) == (
        0,
        0,
        pytest.approx(300 / 4.5),
    )


def test_an_unknown_oracle_mode_is_refused() -> None:
    with pytest.raises(ValueError):
        simulate(small_day(), "freeze")


# ------------------------------------------------------------------------------- the day


def test_the_day_is_the_same_every_run_and_ends_in_its_window() -> None:
    a, b = day_plan(), day_plan()
    assert a == b and day_plan(seed=8) != a
    arrivals = [j.at_s for j in a.on_demand]
    assert arrivals == sorted(arrivals) and max(arrivals) <= a.window_s - 10
    assert [j.unit for j in a.background] == [EMBED, VLM]
    assert sum(j.unit == NIGHTLY for j in a.jobs) == 1
    assert len(a.on_demand) >= 5


def test_units_gpuslice_annotates_and_systemd_alone_orders_and_conflicts() -> None:
    day = day_plan()
    gated_od, gated_bg = unit_files(day, gated=True)
    assert "Priority=80\nType=background" in gated_bg[f"/etc/systemd/system/{EMBED}"]
    plain_od, plain_bg = unit_files(day, gated=False)
    assert set(gated_od) == set(plain_od) == {TRANSCRIBE, NIGHTLY}
    assert "[X-GPUSlice]\nPriority=10\nType=on-demand" in gated_od[TRANSCRIBE]
    assert "Conflicts=" not in gated_od[TRANSCRIBE]
    assert f"Conflicts={EMBED} {VLM}\nAfter={EMBED} {VLM}" in plain_od[NIGHTLY]
    vlm = next(j for j in day.jobs if j.unit == VLM)
    assert "Type=background" in unit_text(vlm, gated=True)
    assert f"After={EMBED}" in plain_bg[f"/etc/systemd/system/{VLM}"]
    assert "Type=oneshot" in plain_bg[f"/etc/systemd/system/{VLM}"]
    assert "X-GPUSlice" not in "".join(plain_bg.values()) + "".join(plain_od.values())
    assert all("$$EPOCHREALTIME" in text for text in [*gated_od.values(), *plain_bg.values()])
    assert "Preempt=" not in "".join(gated_od.values()) + "".join(gated_bg.values())
    assert "BENCH_DAY_ALLOC" not in "".join(gated_od.values()) + "".join(gated_bg.values())


def test_the_suspend_policy_annotates_every_job_and_gives_it_vram_to_move() -> None:
    policy = next(p for p in POLICIES if p.key == "gpuslice-suspend")
    assert (policy.suspends, policy.oracle, policy.preempt) == (True, "suspend", "suspend stop")
    assert [p.suspends for p in POLICIES if p is not policy] == [False, False]
    assert policy.config is not None
    assert f"cuda_checkpoint: {fakegpu.CHECKPOINT}\n" in policy.config
    assert "suspend_host_memory_margin: 0\n" in policy.config
    on_demand, background = unit_files(day_plan(), gated=True, preempt=policy.preempt)
    for text in [*on_demand.values(), *background.values()]:
        assert text.endswith("Preempt=suspend stop\n"), text
        assert f"BENCH_DAY_ALLOC={fakegpu.ALLOC} BENCH_DAY_VRAM={VRAM_PER_JOB}\n" in text
        assert f"FAKE_NVML_DIR={fakegpu.STATE}" in text


# ------------------------------------------------------------------------------- output


def test_the_table_takes_a_new_policy_as_one_more_column() -> None:
    day = small_day(od(2.5))
    measured = {p.title: analyse(day, simulate(day, "stop")) for p in POLICIES}
    results = with_oracles(day, measured, POLICIES)
    assert list(results) == [*(p.title for p in POLICIES), *ORACLES.values()]
    assert results[POLICIES[1].title]["busy_vs_oracle"] == pytest.approx(1.0)
    assert results[POLICIES[2].title]["busy_vs_oracle"] == pytest.approx(
        results[POLICIES[2].title]["busy_pct"] / results[ORACLES["suspend"]]["busy_pct"]
    )
    results["gpuslice (freeze)"] = analyse(day, simulate(day, "suspend"))
    text = day_table(results)
    head = text.splitlines()[0]
    assert head.split(" | ")[1:] == [*(p.title for p in POLICIES), *ORACLES.values(),
                                     "gpuslice (freeze)"]  # fmt: skip
    assert "on-demand wait p99" in text and "model loads" in text
    assert "runs paused (frozen), from the jobs" in text


def test_rows_put_gpuslice_against_systemd_alone_and_carry_the_table() -> None:
    day = small_day(od(2.5))
    stop, free = simulate(day, "stop"), simulate(day, "suspend")
    measured = {POLICIES[0].title: analyse(day, free), POLICIES[1].title: analyse(day, stop)}
    rows = rows_of(with_oracles(day, measured, POLICIES))
    loads = next(r for r in rows if r.case == "day: model loads")
    assert (loads.gpuslice, loads.floor, loads.target, loads.ok) == (3, 2, "(info)", None)
    assert loads.note == "oracle 3"
    assert set(rows[0].extra["policies"]) == {*measured, *ORACLES.values()}
    assert all(r.case.startswith("day: ") for r in rows)
    assert not any("pause" in r.case for r in rows)  # the table's, not a row


def test_rows_note_the_suspend_column_where_it_was_measured() -> None:
    day = small_day(od(2.5))
    stop, free = simulate(day, "stop"), simulate(day, "suspend")
    measured = {POLICIES[0].title: analyse(day, stop), POLICIES[1].title: analyse(day, stop)}
    measured[POLICIES[2].title] = analyse(day, free)
    rows = rows_of(with_oracles(day, measured, POLICIES))
    loads = next(r for r in rows if r.case == "day: model loads")
    redone = next(r for r in rows if r.case == "day: work items redone")
    assert (loads.note, redone.note) == ("oracle 3; suspend 2", "oracle 1; suspend 0")
