"""Prometheus metrics from the controller's status (`gpuslice metrics`, the socket exporter).

Pure: the status JSON (gpuslice/status.py) in, metric families out, rendered by the
Prometheus client library's own `generate_latest` (text format 0.0.4). Names follow Kueue's
and kube-scheduler's conventions: prefix `gpuslice_`, base units (seconds, bytes), counters
end in `_total`, waits are a histogram. Counters count since the controller started (a
restart resets them, as Prometheus' `rate()` expects); `gpuslice_controller_start_time_seconds`
says when. The status is the controller's answer, but every value is checked here anyway:
a missing key, a wrong type, a number too large for a float or a name with quotes, newlines
or invalid UTF-8 drops that sample or is escaped; it never breaks the exposition.
"""

from __future__ import annotations

import math
from collections import Counter as Tally
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gpuslice.core.decisions import Cause, Code
from gpuslice.core.scheduler import HOLDER_STATES
from gpuslice.owners import KINDS, OTHER

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_LABEL = 512  # characters of a label value (a unit name has at most 255)

# Job states: a holder's (status "state": the Preempt= ladder's "frozen", "suspending" and
# "resuming" too), then the lists of the status.
JOB_STATES = (
    *HOLDER_STATES,
    "waiting",
    "suspended",
    "preempted",
    "held",
    "finished",
    "failed",
)
# Why a job is pending: its wait decision's cause; "undecided" before its first decision.
PENDING_REASONS = (
    Cause.BUSY.value,
    Cause.STOPPING.value,
    Cause.UNUSABLE.value,
    Cause.HOST.value,
    Cause.PAUSED.value,
    "undecided",
)
NVML_STATES = ("ready", "waiting", "fallback", "absent")
# Decision counters of their own (also in gpuslice_decisions_total{decision=}).
PREEMPTION_REASONS = {"waiter": Code.PREEMPT.value, "yield-to-foreign": Code.YIELD.value}
# status "counters" key -> (metric name without _total, help)
ERROR_COUNTERS = {
    "dbus_signals_dropped": (
        "gpuslice_dbus_signals_dropped",
        "D-Bus signals dropped: not systemd's own, or malformed.",
    ),
    "dbus_call_errors": (
        "gpuslice_dbus_call_errors",
        "Calls to systemd over D-Bus that returned an error.",
    ),
    "dbus_signals_lost": (
        "gpuslice_dbus_signals_lost",
        "Unit states systemd's signals did not tell, found by the periodic read: lost on the bus.",
    ),
    "dbus_acquire_refused": (
        "gpuslice_dbus_acquire_refused",
        "Acquire calls refused because the caller does not run in the unit it names.",
    ),
    "nvml_errors": ("gpuslice_nvml_errors", "NVML calls that failed while sampling the GPUs."),
    "nvml_timeouts": (
        "gpuslice_nvml_timeouts",
        "NVML calls that did not answer within their deadline.",
    ),
    "journal_write_errors": (
        "gpuslice_journal_write_errors",
        "Decision entries that journald did not take.",
    ),
    "state_save_errors": ("gpuslice_state_save_errors", "Writes of the state file that failed."),
    "notify_errors": (
        "gpuslice_notify_errors",
        "sd_notify messages (READY=1, STATUS=, WATCHDOG=1) that systemd did not take.",
    ),
}


def _number(value: Any) -> float | None:
    """A finite float, or None (not a number, a bool, NaN, too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


def _label(value: Any) -> str:
    """Any value as a label value that encodes as UTF-8 (lone surrogates replaced)."""
    text = str(value)[:MAX_LABEL]
    return text.encode("utf-8", "replace").decode("utf-8")


def _dicts(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _priority(value: Any) -> str:
    number = _number(value)
    return str(int(number)) if number is not None and number == int(number) else "unknown"


def families(status: Mapping[str, Any] | None) -> list[Metric]:
    """The metric families of one status; None (the controller did not answer) gives only
    `gpuslice_up 0`."""
    up = GaugeMetricFamily(
        "gpuslice_up", "Whether the gpuslice controller answered its Status call."
    )
    if not isinstance(status, Mapping):
        status = None
    up.add_metric([], 0.0 if status is None else 1.0)
    if status is None:
        return [up]
    return [up, *_controller(status), *_jobs(status), *_gpus(status), *_counters(status)]


def _controller(status: Mapping[str, Any]) -> Iterator[Metric]:
    controller = status.get("controller")
    controller = controller if isinstance(controller, Mapping) else {}
    info = GaugeMetricFamily(
        "gpuslice_build_info",
        "The controller's version: always 1.",
        labels=["version"],
    )
    info.add_metric([_label(controller.get("version", "unknown"))], 1.0)
    yield info
    started = _number(controller.get("start_time"))
    if started is not None:
        start = GaugeMetricFamily(
            "gpuslice_controller_start_time_seconds",
            "When the controller started (Unix time): its counters count from then.",
        )
        start.add_metric([], started)
        yield start
    nvml = status.get("nvml")
    if isinstance(nvml, Mapping):
        state = _label(nvml.get("state", ""))
        family = GaugeMetricFamily(
            "gpuslice_nvml_state",
            "Which NVML case applies: ready, waiting (driver not ready), fallback, absent.",
            labels=["state"],
        )
        for name in sorted({*NVML_STATES, state}):
            family.add_metric([name], 1.0 if name == state else 0.0)
        yield family
    problems = GaugeMetricFamily(
        "gpuslice_annotation_problems",
        "Problems found in unit annotations (see gpuslice check).",
    )
    problems.add_metric([], float(len(_strings(status.get("problems")))))
    yield problems


def _jobs(status: Mapping[str, Any]) -> Iterator[Metric]:
    """Jobs by state and priority, pending jobs by reason."""
    jobs: Tally[tuple[str, str]] = Tally()
    holding: dict[str, tuple[str, str]] = {}  # a unit on several GPUs counts once
    for gpu in _dicts(status.get("gpus")):
        for holder in _dicts(gpu.get("holders")):
            state = holder.get("state")
            unit = holder.get("unit")
            if isinstance(unit, str) and isinstance(state, str):
                holding.setdefault(unit, (_label(state), _priority(holder.get("priority"))))
    jobs.update(holding.values())
    pending = Tally(dict.fromkeys(PENDING_REASONS, 0))
    for waiter in _dicts(status.get("waiting")):
        jobs[("waiting", _priority(waiter.get("priority")))] += 1
        decision = waiter.get("decision")
        cause = decision.get("cause") if isinstance(decision, Mapping) else None
        pending[_label(cause) if isinstance(cause, str) else "undecided"] += 1
    # a suspended unit holds no GPU and waits for none: the status's "suspended" names it
    # alone (it vanished from here while it lasted)
    for state in ("suspended", "preempted"):
        for entry in _dicts(status.get(state)):
            jobs[(state, _priority(entry.get("priority")))] += 1
    priorities = status.get("priorities")
    priorities = priorities if isinstance(priorities, Mapping) else {}
    for state in ("held", "finished", "failed"):
        for unit in _strings(status.get(state)):
            jobs[(state, _priority(priorities.get(unit)))] += 1
    family = GaugeMetricFamily(
        "gpuslice_jobs",
        "Managed jobs by state (running, starting, restarting, stopping, frozen, suspending, "
        "resuming, waiting, suspended, preempted, held, finished, failed) and priority.",
        labels=["state", "priority"],
    )
    for (state, priority), count in sorted(jobs.items()):
        family.add_metric([state, priority], float(count))
    yield family
    family = GaugeMetricFamily(
        "gpuslice_pending_jobs",
        "Jobs waiting at their gate, by the reason of their wait decision.",
        labels=["reason"],
    )
    for reason, count in sorted(pending.items()):
        family.add_metric([reason], float(count))
    yield family


def _foreign_by_owner(gpu: Mapping[str, Any]) -> dict[str, float]:
    """Bytes the GPU's foreign processes use, summed per owner kind (a known kind or
    `other`: the label's values stay the few of gpuslice/owners.py): those listed, and
    those the controller left out of the list (`foreign_left_out_by_kind`)."""
    out: dict[str, float] = {}
    for p in _dicts(gpu.get("foreign")):
        owner = p.get("owner")
        kind = owner.get("kind") if isinstance(owner, Mapping) else None
        kind = kind if kind in KINDS else OTHER
        out[kind] = out.get(kind, 0.0) + (_number(p.get("memory")) or 0.0)
    left_out = gpu.get("foreign_left_out_by_kind")
    for kind, memory in left_out.items() if isinstance(left_out, Mapping) else ():
        kind = kind if kind in KINDS else OTHER
        out[kind] = out.get(kind, 0.0) + (_number(memory) or 0.0)
    return out


def _gpus(status: Mapping[str, Any]) -> Iterator[Metric]:
    labels = ["gpu", "uuid"]
    memory = {
        key: GaugeMetricFamily(f"gpuslice_gpu_memory_{key}_bytes", text, labels=labels)
        for key, text in (
            ("total", "GPU memory in all (NVML)."),
            ("used", "GPU memory in use, by any process (NVML)."),
            ("reserved", "GPU memory never handed out (config reserve)."),
            ("unmanaged", "GPU memory used by processes of no managed unit."),
        )
    }
    # A GPU lost only to a renumbering answers, and its units run on: `lost` pages an admin
    # for a broken GPU, `renumbered` says it takes no new work for now (status "renumbered").
    lost = GaugeMetricFamily(
        "gpuslice_gpu_lost", "Whether the GPU stopped answering NVML.", labels=labels
    )
    renumbered = GaugeMetricFamily(
        "gpuslice_gpu_renumbered",
        "Whether the GPU takes no new work because NVML numbered the GPUs anew under units "
        "that hold it (it answers; they run on).",
        labels=labels,
    )
    by_owner = GaugeMetricFamily(
        "gpuslice_gpu_foreign_memory_bytes",
        "GPU memory used by processes of no managed unit, by whose they are (owner: "
        + ", ".join(KINDS)
        + ").",
        labels=[*labels, "owner"],
    )
    unit_labels = ["unit", "gpu"]
    declared = GaugeMetricFamily(
        "gpuslice_job_memory_declared_bytes",
        "GPU memory a running job declared (Memory=); absent for a whole-GPU job.",
        labels=unit_labels,
    )
    used = GaugeMetricFamily(
        "gpuslice_job_memory_used_bytes",
        "GPU memory a running job's processes use (NVML).",
        labels=unit_labels,
    )
    for gpu in _dicts(status.get("gpus")):
        index = _number(gpu.get("index"))
        if index is None:
            continue
        where = [str(int(index)), _label(gpu.get("uuid") or "")]
        total = _number(gpu.get("memory_total"))
        values = {
            "total": total,
            "used": _number(gpu.get("memory_used")),
            "reserved": _number(gpu.get("memory_reserved")),
        }
        if total is not None:
            by_kind = _foreign_by_owner(gpu)
            values["unmanaged"] = math.fsum(by_kind.values())
            for kind, used_by_kind in sorted(by_kind.items()):
                by_owner.add_metric([*where, kind], used_by_kind)
        for key, value in values.items():
            if value is not None:
                memory[key].add_metric(where, value)
        moved = gpu.get("renumbered") is True
        lost.add_metric(where, 1.0 if gpu.get("lost") is True and not moved else 0.0)
        renumbered.add_metric(where, 1.0 if moved else 0.0)
        for holder in _dicts(gpu.get("holders")):
            unit = holder.get("unit")
            if not isinstance(unit, str):
                continue
            for family, key in ((declared, "memory_declared"), (used, "memory_used")):
                value = _number(holder.get(key))
                if value is not None:
                    family.add_metric([_label(unit), where[0]], value)
    yield from memory.values()
    yield by_owner
    yield lost
    yield renumbered
    yield declared
    yield used


def _counters(status: Mapping[str, Any]) -> Iterator[Metric]:
    counters = status.get("counters")
    if isinstance(counters, Mapping):
        decisions = counters.get("decisions")
        decisions = decisions if isinstance(decisions, Mapping) else {}

        def count(code: str) -> float:
            return _number(decisions.get(code)) or 0.0

        family = CounterMetricFamily(
            "gpuslice_preemptions",
            "Jobs stopped by gpuslice: for a more urgent waiter, or to yield to processes "
            "it does not manage.",
            labels=["reason"],
        )
        for reason, code in PREEMPTION_REASONS.items():
            family.add_metric([reason], count(code))
        yield family
        for name, single_code, text in (
            ("gpuslice_requeues", Code.REQUEUE, "Preempted jobs brought back."),
            ("gpuslice_refills", Code.REFILL, "Background jobs started on free capacity."),
            ("gpuslice_holds", Code.HOLD, "Jobs stopped by hand, then held."),
        ):
            single = CounterMetricFamily(name, text)
            single.add_metric([], count(single_code.value))
            yield single
        family = CounterMetricFamily(
            "gpuslice_decisions",
            "Decisions by code (GPUSLICE_DECISION= in the journal).",
            labels=["decision"],
        )
        for code in sorted({*(c.value for c in Code), *map(_label, decisions)}):
            family.add_metric([code], count(code))
        yield family
        answers = counters.get("gate_answers")
        if isinstance(answers, Mapping):
            gates = CounterMetricFamily(
                "gpuslice_gate_answers",
                "Starts let through their gate: by its pipe (the fast way) or by D-Bus.",
                labels=["way"],
            )
            for way in ("pipe", "dbus"):
                gates.add_metric([way], _number(answers.get(way)) or 0.0)
            yield gates
        for key, (name, text) in ERROR_COUNTERS.items():
            value = _number(counters.get(key))
            if value is not None:
                error = CounterMetricFamily(name, text)
                error.add_metric([], value)
                yield error
    histogram = _histogram(status.get("admission_wait_seconds"))
    if histogram is not None:
        yield histogram


def _histogram(value: Any) -> Metric | None:
    """The admission wait histogram, or None unless its buckets are well formed: bounds
    increasing and ending in +Inf, cumulative counts not decreasing."""
    if not isinstance(value, Mapping) or not isinstance(value.get("buckets"), list):
        return None
    buckets: list[tuple[str, float]] = []
    last_bound, last_count = -math.inf, 0.0
    for pair in value["buckets"]:
        if not isinstance(pair, list) or len(pair) != 2:
            return None
        bound = math.inf if pair[0] == "+Inf" else _number(pair[0])
        count = _number(pair[1])
        if bound is None or count is None or bound <= last_bound or count < last_count:
            return None
        buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), count))
        last_bound, last_count = bound, count
    if not buckets or last_bound != math.inf:
        return None
    total = _number(value.get("sum"))
    return HistogramMetricFamily(
        "gpuslice_admission_wait_time_seconds",
        "How long each job waited at its gate before it was granted its GPUs (0: at once).",
        buckets=buckets,
        sum_value=total if total is not None and total >= 0 else 0.0,
    )


class StatusCollector(Collector):
    """A collector over one status (a registry per answer: nothing kept between scrapes)."""

    def __init__(self, status: Mapping[str, Any] | None) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        yield from families(self.status)


def registry(status: Mapping[str, Any] | None) -> CollectorRegistry:
    out = CollectorRegistry(auto_describe=False)
    out.register(StatusCollector(status))
    return out


def exposition(status: Mapping[str, Any] | None) -> bytes:
    """The Prometheus text exposition (format 0.0.4) of one status."""
    return generate_latest(registry(status))
