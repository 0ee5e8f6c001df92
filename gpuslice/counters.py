"""What the controller counts since it started: decisions, errors and how long waiters waited.

A plain class the controller increments where it carries decisions out (`Controller.execute`)
and where errors happen; `gpuslice status --json` carries it (`counters`,
`admission_wait_seconds`) and `gpuslice metrics` turns it into Prometheus counters and a
histogram. Like every Prometheus counter these start again from zero when the controller
restarts; `controller.start_time` in the status says when that was.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpuslice.core.decisions import Code

# Upper bounds (seconds) of the admission wait histogram: a handover takes tens of
# milliseconds, a job behind a long one waits hours.
WAIT_BUCKETS: tuple[float, ...] = (
    0.01,
    0.05,
    0.1,
    0.5,
    1.0,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    1800.0,
    3600.0,
    7200.0,
    14400.0,
    43200.0,
    86400.0,
)


@dataclass
class Histogram:
    """Counts per upper bound (not cumulative here), plus +Inf, the sum and the count."""

    bounds: tuple[float, ...] = WAIT_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        value = max(value, 0.0)
        index = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[index] += 1
        self.total += value
        self.count += 1

    def to_json(self) -> dict[str, Any]:
        """{"buckets": [[upper bound, cumulative count], ..., ["+Inf", count]], "sum", "count"}"""
        cumulative = 0
        buckets: list[list[Any]] = []
        for bound, n in zip((*self.bounds, "+Inf"), self.counts, strict=True):
            cumulative += n
            buckets.append([bound, cumulative])
        return {"buckets": buckets, "sum": self.total, "count": self.count}


# The error counters: status JSON key -> what each counts.
ERRORS: dict[str, str] = {
    "dbus_signals_dropped": "D-Bus signals not believed (not systemd's own, malformed)",
    "dbus_call_errors": "calls to systemd over D-Bus that failed",
    "dbus_signals_lost": "unit states systemd's signals did not tell (found by a read)",
    "dbus_acquire_refused": "Acquire calls refused (the caller does not run in its unit)",
    "nvml_errors": "NVML calls that failed",
    "nvml_timeouts": "NVML calls that did not answer within their deadline",
    "journal_write_errors": "decision entries journald did not take",
    "state_save_errors": "state file writes that failed",
    "notify_errors": "sd_notify messages systemd did not take (READY=1, STATUS=, WATCHDOG=1)",
}


class Counters:
    """Monotonic counts since the controller started."""

    def __init__(self) -> None:
        self.decisions: dict[str, int] = {code.value: 0 for code in Code}
        self.errors: dict[str, int] = dict.fromkeys(ERRORS, 0)
        self.admission_wait = Histogram()
        # how gates were let through: their pipe (gpuslice/gatepipes.py) or a D-Bus reply
        self.gate_answers = {"pipe": 0, "dbus": 0}

    def decided(self, code: Code) -> None:
        self.decisions[code.value] += 1

    def error(self, key: str, n: int = 1) -> None:
        self.errors[key] += n

    def to_json(self, external: Iterable[tuple[str, int]] = ()) -> dict[str, Any]:
        """`external`: counts kept elsewhere (the D-Bus adapter's, the journal's), added."""
        errors = dict(self.errors)
        for key, n in external:
            errors[key] += n
        gates = dict(self.gate_answers)
        return {"decisions": dict(self.decisions), **errors, "gate_answers": gates}
