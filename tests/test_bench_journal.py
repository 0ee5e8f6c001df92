"""The benchmark reads the controller's decisions as data (GPUSLICE_* journal fields), not its
sentences: what `make bench` counts as a priority inversion in the burst case."""

from __future__ import annotations

import json
from typing import Any

from bench.run import QUICK, analyse_burst, breakdown, burst_rows, decisions


def entry(when: float, code: str, unit: str, cause: str = "") -> str:
    fields = {
        "__REALTIME_TIMESTAMP": str(int(when * 1e6)),
        "MESSAGE": "words the benchmark does not read",
        "GPUSLICE_DECISION": code,
        "GPUSLICE_UNIT": unit,
    }
    if cause:
        fields["GPUSLICE_CAUSE"] = cause
    return json.dumps(fields)


def burst(*lines: str, b_started: float = 100.2) -> dict[str, Any]:
    """Two units' burst; b.service's last start stamp is `b_started`."""
    result = {
        "t0": 100.0,
        "enqueued": 100.01,
        "never_ended": [],
        "starts": {"a.service": 100.3, "b.service": b_started},
        "ends": {"a.service": 100.5, "b.service": 100.4},
        "gate_began": {"a.service": 100.05, "b.service": 100.15},
    }
    return analyse_burst(result, "\n".join(lines), {"a.service": 10, "b.service": 50}, QUICK)


def test_a_finished_unit_started_again_is_counted() -> None:
    """Each start stamp overwrites the last, and the first end seen is kept: a last start
    after that end is a finished job run again (what a stop that came after its end did)."""
    assert burst()["finished_then_run_again"] == []
    assert burst(b_started=101.2)["finished_then_run_again"] == ["b.service"]


def test_decisions_are_read_from_their_fields_in_journal_order() -> None:
    journal = "\n".join(
        [
            entry(99.0, "grant", "before.service"),  # before the burst: left out
            entry(100.1, "wait", "a.service", "gpus-busy"),
            "not json",
            json.dumps({"MESSAGE": "a line that is no decision"}),
            entry(100.2, "grant", "b.service"),
        ]
    )
    assert decisions(journal, 100.0) == [
        (100.1, "wait", "a.service", "gpus-busy"),
        (100.2, "grant", "b.service", ""),
    ]


def test_a_grant_while_a_more_urgent_unit_is_blocked_is_an_inversion() -> None:
    out = burst(
        entry(100.1, "wait", "a.service", "gpus-busy"),
        entry(100.2, "grant", "b.service"),
        entry(100.3, "grant", "a.service"),
    )
    assert (out["priority_inversions"], out["inversion_pairs"]) == (1, [("a.service", "b.service")])


def test_a_grant_while_a_more_urgent_unit_waits_for_its_victims_is_counted_apart() -> None:
    out = burst(
        entry(100.1, "wait", "a.service", "victims-stopping"),
        entry(100.2, "grant", "b.service"),
        entry(100.3, "grant", "a.service"),
    )
    assert (
        out["priority_inversions"],
        out["grants_while_a_more_urgent_unit_was_being_served"],
    ) == (
        0,
        1,
    )


def test_gpus_kept_for_a_waiter_are_its_grant_decision() -> None:
    """The controller decides when it keeps GPUs for a unit whose gate has not asked yet;
    the grant that follows when the gate asks is no new decision."""
    out = burst(
        entry(100.1, "wait", "b.service", "gpus-busy"),
        entry(100.15, "keep", "b.service"),
        entry(100.2, "wait", "a.service", "gpus-busy"),
        entry(100.25, "grant", "b.service"),  # b's gate asks: decided at 100.15
        entry(100.3, "grant", "a.service"),
    )
    assert (out["priority_inversions"], out["grants_seen"]) == (0, 2)


def test_a_waiter_whose_kept_gpus_went_to_a_more_urgent_unit_waits_again_until_granted() -> None:
    """GPUs kept for a unit whose gate has not asked yet may go to a more urgent unit: the
    unit waits again ("wait" after its "keep"), and its later grant ends that wait. The
    analysis once skipped that grant as the kept one's and counted every later grant to a
    less urgent unit as an inversion (142 in one burst of 2026-12-03, none real)."""
    out = burst(
        entry(100.1, "keep", "a.service"),
        entry(100.15, "wait", "a.service", "gpus-busy"),  # its GPU went elsewhere
        entry(100.2, "grant", "a.service"),  # decided now
        entry(100.3, "grant", "b.service"),
    )
    assert (out["priority_inversions"], out["inversion_pairs"]) == (0, [])


def _burst_stats(done_s: float, inversions: int, never: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "units": 200,
        "all_done_s": done_s,
        "ideal_s": 5.0,
        "never_ended": list(never),
        "priority_inversions": inversions,
        "fifo_inversions": 0,
        "preemptions": 3,
        "grants_while_a_more_urgent_unit_was_being_served": 0,
        "max_concurrent": 8,
        "enqueue_s": 2.2,
    }


def test_the_burst_is_judged_by_the_median_of_its_repetitions() -> None:
    """One burst's time moves by a second between runs of the VM: the median of several is
    judged, and an inversion in any one of them fails the inversions row."""
    time_row, inversion_row = burst_rows(
        [_burst_stats(7.9, 0), _burst_stats(5.9, 0), _burst_stats(5.8, 0)], QUICK
    )
    assert time_row.ratio == 5.9 / 5.0 and time_row.ok is True
    assert "median of 3" in time_row.note
    assert (inversion_row.gpuslice, inversion_row.ok) == (0.0, True)
    time_row, inversion_row = burst_rows([_burst_stats(5.5, 0), _burst_stats(5.6, 2)], QUICK)
    assert (inversion_row.gpuslice, inversion_row.ok) == (2.0, False)
    assert "each: 0/2" in inversion_row.note
    assert "finished units run again 0/0" in inversion_row.note
    time_row, inversion_row = burst_rows([_burst_stats(5.5, 0, ("b.service",))], QUICK)
    assert (time_row.ok, time_row.ratio, inversion_row.ok) == (False, None, False)


def test_a_handover_is_broken_down_by_the_journal_of_the_whole_container() -> None:
    """asked -> preempt decided -> systemd stopped the victim -> grant -> main runs, in ms;
    systemd's own entries carry their source's time, which is preferred."""
    stopped = {
        "__REALTIME_TIMESTAMP": str(int(100.050 * 1e6)),
        "_SOURCE_REALTIME_TIMESTAMP": str(int(100.030 * 1e6)),
        "UNIT": "bench-bg.service",
        "JOB_TYPE": "stop",
        "JOB_RESULT": "done",
    }
    journal = "\n".join(
        [
            entry(100.020, "preempt", "bench-bg.service"),
            json.dumps(stopped),
            entry(100.035, "grant", "bench-od.service"),
            entry(100.500, "grant", "bench-od.service"),  # a later handover's
        ]
    )
    sample = {"t0": 100.0, "od_start": 100.045}
    got = breakdown(journal, [sample])
    assert {k: round(v, 1) for k, v in got.items()} == {
        "asked->preempt": 20.0,
        "preempt->victim stopped": 10.0,
        "victim stopped->grant": 5.0,
        "grant->main runs": 10.0,
    }
    assert breakdown(journal, [{"t0": 101.0, "od_start": 101.01}]) == {}  # nothing after it
