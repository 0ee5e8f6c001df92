"""`gpuslice metrics`: the status JSON mapped to Prometheus families (pure), the controller's
counters, and the exposition parsed back by the Prometheus client's own parser."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuslice.annotations import Scan
from gpuslice.core.decisions import Code
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import Scheduler
from gpuslice.counters import ERRORS, WAIT_BUCKETS, Counters, Histogram
from gpuslice.inventory import Sample
from gpuslice.metrics import PENDING_REASONS, exposition
from gpuslice.status import snapshot_to_json

GIB = 1 << 30


def status() -> dict[str, Any]:
    """A status as the controller answers it: two GPUs, a holder on each, one of them on
    both; a waiter; a preempted, a held, a finished and a failed unit; counters."""
    counters = Counters()
    for code in (Code.PREEMPT, Code.PREEMPT, Code.YIELD, Code.REFILL, Code.HOLD, Code.GRANT):
        counters.decided(code)
    counters.error("dbus_call_errors", 3)
    counters.gate_answers.update(pipe=7, dbus=2)
    for waited in (0.0, 0.02, 7.0, 99999.0):
        counters.admission_wait.observe(waited)
    return {
        "version": 1,
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-aaaa",
                "name": "NVIDIA Fake 24GB",
                "memory_total": 24 * GIB,
                "memory_reserved": GIB,
                "memory_used": 12 * GIB,
                "lost": False,
                "holders": [
                    {
                        "unit": "vlm.service",
                        "priority": 90,
                        "state": "running",
                        "memory_declared": 10 * GIB,
                        "memory_used": 9 * GIB,
                    },
                    {
                        "unit": "big.service",
                        "priority": 20,
                        "state": "stopping",
                        "memory_declared": None,
                        "memory_used": None,
                    },
                ],
                "foreign": [
                    {
                        "pid": 7,
                        "command": "python",
                        "memory": 2 * GIB,
                        "owner": {"kind": "slurm", "id": "881"},
                    },
                    # a kind this version does not know counts as other
                    {"pid": 8, "command": "x", "memory": None, "owner": {"kind": "k\n"}},
                ],
            },
            {
                "index": 1,
                "uuid": "GPU-bbbb",
                "name": "NVIDIA Fake 24GB",
                "memory_total": 24 * GIB,
                "memory_reserved": 0,
                "memory_used": 0,
                "lost": True,
                "holders": [
                    {
                        "unit": "big.service",
                        "priority": 20,
                        "state": "stopping",
                        "memory_declared": None,
                        "memory_used": None,
                    }
                ],
                "foreign": [],
            },
        ],
        "waiting": [
            {"unit": "voice.service", "priority": 10, "reason": "r", "decision": None},
            {
                "unit": "w2.service",
                "priority": 10,
                "reason": "r",
                "decision": {"code": "wait", "cause": "victims-stopping"},
            },
        ],
        "preempted": [{"unit": "p.service", "priority": 50, "requeue": True}],
        "held": ["h.service"],
        "finished": ["f.service"],
        "failed": ["x.service"],
        "priorities": {"h.service": 70, "f.service": 80},
        "problems": ["/etc/systemd/system/bad.service:3: [X-GPUSlice] Priority: bad"],
        "nvml": {"state": "ready", "since": 1.0, "detail": "", "driver_version": "550"},
        "controller": {"version": "0.1.0", "start_time": 1700000000.5},
        "counters": counters.to_json([("dbus_signals_dropped", 5)]),
        "admission_wait_seconds": counters.admission_wait.to_json(),
    }


def parse(data: dict[str, Any] | None) -> dict[str, tuple[str, dict[tuple[Any, ...], float]]]:
    """family name -> (type, {(sample name, sorted labels): value}), via the client's parser."""
    text = exposition(data).decode("utf-8")
    out = {}
    parsed = text_string_to_metric_families(text)  # type: ignore[no-untyped-call, unused-ignore]
    for family in parsed:
        samples = {(s.name, *sorted(s.labels.items())): s.value for s in family.samples}
        out[family.name] = (family.type, samples)
    return out


def test_names_types_and_labels() -> None:
    families = parse(status())
    assert {name: kind for name, (kind, _) in families.items()} == {
        "gpuslice_up": "gauge",
        "gpuslice_build_info": "gauge",
        "gpuslice_controller_start_time_seconds": "gauge",
        "gpuslice_nvml_state": "gauge",
        "gpuslice_annotation_problems": "gauge",
        "gpuslice_jobs": "gauge",
        "gpuslice_pending_jobs": "gauge",
        "gpuslice_gpu_memory_total_bytes": "gauge",
        "gpuslice_gpu_memory_used_bytes": "gauge",
        "gpuslice_gpu_memory_reserved_bytes": "gauge",
        "gpuslice_gpu_memory_unmanaged_bytes": "gauge",
        "gpuslice_gpu_foreign_memory_bytes": "gauge",
        "gpuslice_gpu_lost": "gauge",
        "gpuslice_gpu_renumbered": "gauge",
        "gpuslice_job_memory_declared_bytes": "gauge",
        "gpuslice_job_memory_used_bytes": "gauge",
        # the parser names counter families without _total; their samples keep it
        "gpuslice_preemptions": "counter",
        "gpuslice_requeues": "counter",
        "gpuslice_refills": "counter",
        "gpuslice_holds": "counter",
        "gpuslice_decisions": "counter",
        "gpuslice_gate_answers": "counter",
        "gpuslice_dbus_signals_dropped": "counter",
        "gpuslice_dbus_call_errors": "counter",
        "gpuslice_dbus_signals_lost": "counter",
        "gpuslice_dbus_acquire_refused": "counter",
        "gpuslice_nvml_errors": "counter",
        "gpuslice_nvml_timeouts": "counter",
        "gpuslice_journal_write_errors": "counter",
        "gpuslice_state_save_errors": "counter",
        "gpuslice_notify_errors": "counter",
        "gpuslice_admission_wait_time_seconds": "histogram",
    }
    assert families["gpuslice_up"][1] == {("gpuslice_up",): 1.0}
    assert families["gpuslice_build_info"][1] == {
        ("gpuslice_build_info", ("version", "0.1.0")): 1.0
    }
    assert families["gpuslice_controller_start_time_seconds"][1] == {
        ("gpuslice_controller_start_time_seconds",): 1700000000.5
    }
    assert families["gpuslice_nvml_state"][1] == {
        ("gpuslice_nvml_state", ("state", s)): float(s == "ready")
        for s in ("absent", "fallback", "ready", "waiting")
    }
    assert families["gpuslice_annotation_problems"][1] == {("gpuslice_annotation_problems",): 1}


def test_jobs_by_state_and_priority_and_pending_by_reason() -> None:
    families = parse(status())

    def job(state: str, priority: str) -> tuple[Any, ...]:
        return ("gpuslice_jobs", ("priority", priority), ("state", state))

    # big.service holds two GPUs and counts once; x.service's priority is not known
    assert families["gpuslice_jobs"][1] == {
        job("running", "90"): 1,
        job("stopping", "20"): 1,
        job("waiting", "10"): 2,
        job("preempted", "50"): 1,
        job("held", "70"): 1,
        job("finished", "80"): 1,
        job("failed", "unknown"): 1,
    }
    pending = families["gpuslice_pending_jobs"][1]
    assert set(pending) == {("gpuslice_pending_jobs", ("reason", r)) for r in PENDING_REASONS}
    assert pending[("gpuslice_pending_jobs", ("reason", "undecided"))] == 1
    assert pending[("gpuslice_pending_jobs", ("reason", "victims-stopping"))] == 1
    assert pending[("gpuslice_pending_jobs", ("reason", "gpus-busy"))] == 0


def test_suspended_jobs_are_counted_as_suspended() -> None:
    """A unit suspended by the Preempt= ladder holds no GPU and is neither waiting nor
    preempted: it is in the status's "suspended" list alone (active for systemd, its memory
    in the host's). It vanished from gpuslice_jobs while it lasted (hours, behind a long
    job); it counts there as `suspended`. A frozen holder counts as its state says."""
    data = status()
    data["suspended"] = [
        {"unit": "s.service", "priority": 60, "gpus": [0], "host_memory": GIB, "since": 1.0},
        {"unit": "t.service", "priority": 60, "gpus": [1], "host_memory": None, "since": None},
        "not an entry",
    ]
    data["gpus"][0]["holders"][0]["state"] = "frozen"
    jobs = parse(data)["gpuslice_jobs"][1]
    assert jobs[("gpuslice_jobs", ("priority", "60"), ("state", "suspended"))] == 2
    assert jobs[("gpuslice_jobs", ("priority", "90"), ("state", "frozen"))] == 1
    assert sum(jobs.values()) == 10


def test_gpu_memory_and_job_memory() -> None:
    families = parse(status())

    def on(name: str, gpu: str, uuid: str) -> tuple[Any, ...]:
        return (name, ("gpu", gpu), ("uuid", uuid))

    name = "gpuslice_gpu_memory_total_bytes"
    assert families[name][1] == {
        on(name, "0", "GPU-aaaa"): 24 * GIB,
        on(name, "1", "GPU-bbbb"): 24 * GIB,
    }
    name = "gpuslice_gpu_memory_reserved_bytes"
    assert families[name][1] == {on(name, "0", "GPU-aaaa"): GIB, on(name, "1", "GPU-bbbb"): 0}
    name = "gpuslice_gpu_memory_used_bytes"
    assert families[name][1] == {on(name, "0", "GPU-aaaa"): 12 * GIB, on(name, "1", "GPU-bbbb"): 0}
    name = "gpuslice_gpu_memory_unmanaged_bytes"  # an unknown process memory adds nothing
    assert families[name][1] == {on(name, "0", "GPU-aaaa"): 2 * GIB, on(name, "1", "GPU-bbbb"): 0}
    name = "gpuslice_gpu_foreign_memory_bytes"  # by owner kind, only the kinds present
    assert families[name][1] == {
        (name, ("gpu", "0"), ("owner", "other"), ("uuid", "GPU-aaaa")): 0,
        (name, ("gpu", "0"), ("owner", "slurm"), ("uuid", "GPU-aaaa")): 2 * GIB,
    }
    name = "gpuslice_gpu_lost"
    assert families[name][1] == {on(name, "0", "GPU-aaaa"): 0, on(name, "1", "GPU-bbbb"): 1}
    assert families["gpuslice_job_memory_declared_bytes"][1] == {
        ("gpuslice_job_memory_declared_bytes", ("gpu", "0"), ("unit", "vlm.service")): 10 * GIB
    }
    assert families["gpuslice_job_memory_used_bytes"][1] == {
        ("gpuslice_job_memory_used_bytes", ("gpu", "0"), ("unit", "vlm.service")): 9 * GIB
    }


def test_counters_and_the_admission_wait_histogram() -> None:
    families = parse(status())
    assert families["gpuslice_preemptions"][1] == {
        ("gpuslice_preemptions_total", ("reason", "waiter")): 2,
        ("gpuslice_preemptions_total", ("reason", "yield-to-foreign")): 1,
    }
    assert families["gpuslice_refills"][1] == {("gpuslice_refills_total",): 1}
    assert families["gpuslice_holds"][1] == {("gpuslice_holds_total",): 1}
    assert families["gpuslice_requeues"][1] == {("gpuslice_requeues_total",): 0}
    assert families["gpuslice_gate_answers"][1] == {
        ("gpuslice_gate_answers_total", ("way", "pipe")): 7,
        ("gpuslice_gate_answers_total", ("way", "dbus")): 2,
    }
    decisions = families["gpuslice_decisions"][1]
    assert set(decisions) == {("gpuslice_decisions_total", ("decision", c.value)) for c in Code}
    assert decisions[("gpuslice_decisions_total", ("decision", "grant"))] == 1
    assert families["gpuslice_dbus_call_errors"][1] == {("gpuslice_dbus_call_errors_total",): 3}
    assert families["gpuslice_dbus_signals_dropped"][1] == {
        ("gpuslice_dbus_signals_dropped_total",): 5
    }
    samples = families["gpuslice_admission_wait_time_seconds"][1]
    bucket = "gpuslice_admission_wait_time_seconds_bucket"
    assert samples[(bucket, ("le", "0.01"))] == 1  # granted at once
    assert samples[(bucket, ("le", "0.05"))] == 2
    assert samples[(bucket, ("le", "5.0"))] == 2
    assert samples[(bucket, ("le", "10.0"))] == 3
    assert samples[(bucket, ("le", "86400.0"))] == 3
    assert samples[(bucket, ("le", "+Inf"))] == 4
    assert samples[("gpuslice_admission_wait_time_seconds_count",)] == 4
    assert samples[("gpuslice_admission_wait_time_seconds_sum",)] == pytest.approx(100006.02)
    assert len([k for k in samples if k[0] == bucket]) == len(WAIT_BUCKETS) + 1


def test_counters_count_from_zero_and_add_what_is_kept_elsewhere() -> None:
    counters = Counters()
    data = counters.to_json([("journal_write_errors", 2)])
    assert data["decisions"] == {c.value: 0 for c in Code}
    assert {k: v for k, v in data.items() if k != "decisions"} == {
        **dict.fromkeys(ERRORS, 0),
        "journal_write_errors": 2,
        "gate_answers": {"pipe": 0, "dbus": 0},
    }
    histogram = Histogram()
    for value in (-1.0, math.nan, math.inf, 0.5):  # a clock step back counts as 0
        histogram.observe(value)
    assert histogram.to_json()["count"] == 2
    assert histogram.to_json()["buckets"][0] == [0.01, 1]


def test_controller_down_is_up_zero_only() -> None:
    assert parse(None) == {"gpuslice_up": ("gauge", {("gpuslice_up",): 0.0})}
    assert parse([1, 2]) == parse(None)  # type: ignore[arg-type]


def test_an_older_controller_without_counters() -> None:
    data = status()
    for key in ("counters", "admission_wait_seconds", "controller", "priorities", "nvml"):
        del data[key]
    families = parse(data)
    assert "gpuslice_preemptions" not in families
    assert "gpuslice_admission_wait_time_seconds" not in families
    assert families["gpuslice_build_info"][1] == {
        ("gpuslice_build_info", ("version", "unknown")): 1.0
    }
    assert (
        families["gpuslice_jobs"][1][("gpuslice_jobs", ("priority", "unknown"), ("state", "held"))]
        == 1
    )


def test_status_json_from_the_scheduler_maps() -> None:
    """The real snapshot_to_json output (priorities of held units included) maps and parses."""
    sched = Scheduler([Gpu(0)], {})
    sched.request(UnitSpec("a.service", 20))
    sched.request(UnitSpec("b.service", 30))
    snap = dataclasses.replace(sched.snapshot(), held=["h.service", "gone.service"])
    scan = Scan(specs={"h.service": UnitSpec("h.service", 70)})
    data = snapshot_to_json(snap, scan, Sample([Gpu(0)]))
    assert data["priorities"] == {"h.service": 70}  # gone.service is no longer annotated
    families = parse(json.loads(json.dumps(data)))
    assert families["gpuslice_jobs"][1] == {
        ("gpuslice_jobs", ("priority", "20"), ("state", "running")): 1,
        ("gpuslice_jobs", ("priority", "30"), ("state", "waiting")): 1,
        ("gpuslice_jobs", ("priority", "70"), ("state", "held")): 1,
        ("gpuslice_jobs", ("priority", "unknown"), ("state", "held")): 1,
    }


HOSTILE_NAMES = [
    'a"b.service',
    "new\nline.service",
    "back\\slash.service",
    "\ud800lone-surrogate.service",
    "x" * 5000,
    "} 1\ngpuslice_up 0\n#",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_unit_names_are_escaped(name: str) -> None:
    data = status()
    data["gpus"][0]["holders"][0]["unit"] = name
    data["gpus"][0]["uuid"] = name
    data["nvml"]["state"] = name
    data["controller"]["version"] = name
    data["counters"]["decisions"][name] = 4
    data["waiting"][1]["decision"]["cause"] = name
    families = parse(data)  # parses: every line is well formed
    assert families["gpuslice_up"][1] == {("gpuslice_up",): 1.0}
    (unit,) = [dict(k[1:])["unit"] for k in families["gpuslice_job_memory_used_bytes"][1] if k[1:]]
    expected = name[:512].encode("utf-8", "replace").decode("utf-8")
    assert unit == expected


@pytest.mark.parametrize(
    "value",
    [10**400, -(10**400), math.nan, math.inf, "12", None, True, [1], {"a": 1}],
)
def test_hostile_numbers_drop_their_sample(value: Any) -> None:
    data = status()
    data["gpus"][0]["memory_total"] = value
    data["gpus"][0]["holders"][0]["memory_used"] = value
    data["gpus"][0]["holders"][0]["priority"] = value
    data["counters"]["dbus_call_errors"] = value
    data["counters"]["decisions"]["preempt"] = value
    data["controller"]["start_time"] = value
    data["admission_wait_seconds"]["sum"] = value
    families = parse(data)
    total = families["gpuslice_gpu_memory_total_bytes"][1]
    assert all(dict(k[1:])["gpu"] == "1" for k in total)
    assert "gpuslice_dbus_call_errors" not in families
    assert ("gpuslice_jobs", ("priority", "unknown"), ("state", "running")) in (
        families["gpuslice_jobs"][1]
    )


@pytest.mark.parametrize(
    "buckets",
    [
        [],
        [[1.0, 1]],  # no +Inf
        [[2.0, 1], [1.0, 1], ["+Inf", 1]],  # bounds not increasing
        [[1.0, 2], ["+Inf", 1]],  # counts decreasing
        [[1.0, 1, 3], ["+Inf", 1]],
        [["x", 1], ["+Inf", 1]],
        "buckets",
    ],
)
def test_a_malformed_histogram_is_left_out(buckets: Any) -> None:
    data = status()
    data["admission_wait_seconds"]["buckets"] = buckets
    assert "gpuslice_admission_wait_time_seconds" not in parse(data)


@pytest.mark.parametrize(
    "key,value",
    [
        ("gpus", "x"),
        ("gpus", [1, None, {"index": "0"}]),
        ("waiting", {"a": 1}),
        ("held", [1, 2]),
        ("priorities", [1]),
        ("counters", [1]),
        ("controller", "x"),
        ("nvml", 5),
        ("problems", None),
    ],
)
def test_wrong_types_never_break_the_exposition(key: str, value: Any) -> None:
    data = status()
    data[key] = value
    assert parse(data)["gpuslice_up"][1] == {("gpuslice_up",): 1.0}
