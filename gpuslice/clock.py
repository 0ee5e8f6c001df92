"""Moments that status and metrics show as Unix times, kept so that no clock step and no
host sleep makes what they show wrong.

A moment is CLOCK_BOOTTIME's reading (`moment`), turned into a Unix time only when shown
(`unix_time`: the wall clock now, less the time since). A wall-clock reading kept instead was
wrong by every step since: NTP correcting at boot an RTC hours off (after the controller
started), `date -s`; so a job that waited a minute showed hours, or a negative wait (0), and
`gpuslice_controller_start_time_seconds` kept the wrong clock's start. CLOCK_MONOTONIC, which
no step moves either, stops while the host sleeps: a job that waited through a night's
suspend showed minutes. CLOCK_BOOTTIME counts that time and is never stepped.
"""

from __future__ import annotations

import time


def moment() -> float:
    """Now, as a moment to measure from (seconds of CLOCK_BOOTTIME)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


# A step of the wall clock by more than this (NTP correcting an RTC hours off, `date -s`)
# moves what is shown; less, a slew or the microseconds between two reads, does not: two
# answers with nothing changed between them are the same (a status compared before and
# after a hostile call, a Prometheus start time that does not jitter).
STEP_SEEN = 1.0
_offset: float | None = None  # the wall clock less CLOCK_BOOTTIME, as last taken


def unix_time(at: float) -> float:
    """The Unix time of the moment `at`, as the wall clock tells it: by the wall clock's
    offset from CLOCK_BOOTTIME, taken again only once it moved by more than STEP_SEEN."""
    global _offset
    offset = time.time() - moment()
    if _offset is None or abs(offset - _offset) > STEP_SEEN:
        _offset = offset
    return _offset + at
