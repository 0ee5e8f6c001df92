"""The numbers README promises (a delay, a bound, a limit) are the numbers the code uses.

An admin sizes a disk's loss window, a watchdog or a scrape by these sentences, and the
behaviour tests mostly scale the constants down (a 30 s audit is driven by hand, a 1 s
retry patched to 0.02 s): a constant changed, or a sentence edited, passed them all. Each
row names a README sentence and the value it states; both must agree, so changing either
changes this test too.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from gpuslice import (
    busread,
    callers,
    calls,
    checkpoint,
    cli,
    controller,
    delivery,
    envsafety,
    exporter,
    instances,
    journal,
    ladder,
    rereads,
    restore,
    service,
    status,
    stopjournal,
    systemd,
)
from gpuslice.cli import status as status_command
from gpuslice.unitfiles import parse_sections

ROOT = Path(__file__).resolve().parent.parent
README = " ".join((ROOT / "README.md").read_text().split())  # sentences across line breaks


def _freezer_timeout() -> object:
    """The FreezeUnit deadline the controller's Ladder gets (it passes none of its own)."""
    return inspect.signature(ladder.Ladder.__init__).parameters["freezer_timeout"].default


def _journal_seconds() -> object:
    """How long a start-up waits for the journal's answers (stopjournal.ask's default)."""
    return inspect.signature(stopjournal.ask).parameters["seconds"].default


def _interval_default() -> object:
    return next(p.default for p in status_command.params if p.name == "interval")


def _socket(key: str) -> str:
    text = (ROOT / "units" / "gpuslice-metrics.socket").read_text()
    values = [e.value for e in parse_sections(text) if e.section == "Socket" and e.key == key]
    return values[-1]


ROWS = [
    # Faults: "a power cut loses at most that last second"
    (
        "flushed to disk off the event loop within a second (`FLUSH_DELAY`)",
        controller.FLUSH_DELAY,
        1.0,
    ),
    ("until the file is written (tried every second)", delivery.ENV_RETRY, 1.0),
    ("A start looks at up to 8,192 entries of `runtime_dir/env`", restore.ENV_SWEEP_MAX, 8192),
    # Dependencies between GPU units: starts queued behind a GPU unit's start
    ("job has not reached its gate within 0.5 s", controller.KEPT_WALK_DELAY, 0.5),
    ("at most 64 queued starts are read", restore.QUEUED_READ_MAX, 64),
    ("first, for at most 5 s in all", restore.QUEUED_READ_WAIT, 5.0),
    ("no `journalctl`, no answer within 3 s", _journal_seconds(), 3.0),
    ("`journalctl`'s answer is read up to 4 KiB", stopjournal.OUTPUT_MAX, 4096),
    ("Each of these gives up on the bus after 30 s", cli.BUS_TIMEOUT, 30.0),
    # Remove: a controller started while release-jobs holds its name
    ("waits for it, asking again every half second", service.CLAIM_RETRY, 0.5),
    ("starts once release-jobs ends (after 150 s it exits 1", service.RELEASE_WAIT, 150.0),
    ("left of the removal's first 120 s", cli.RELEASE_DEADLINE, 120.0),
    ("at most 60 s, and 5 s past them", cli.THAW_TIMEOUT, 60.0),
    ("at most 60 s, and 5 s past them", cli.THAW_LATE, 5.0),
    ("preempted units are looked at 500 to a `systemctl show`", cli.SHOW_AT_ONCE, 500),
    ("left of those 120 s, at least 5 s; those it does not show", cli.SHOW_LATE, 5.0),
    # Background instances
    ("At most 10,000 instances are kept preempted", instances.PREEMPTED_INSTANCES_MAX, 10_000),
    ("past 10,000 of them `journalctl -u gpuslice` says", instances.KEPT_INSTANCES_WARN, 10_000),
    # While the controller is down: a call systemd never got
    ("is sent again after 1 s, doubling up to 30 s", calls.CALL_RETRY_FIRST, 1.0),
    ("is sent again after 1 s, doubling up to 30 s", calls.CALL_RETRY_MAX, 30.0),
    # Security model: lost signals
    ("So every 30 s the units gpuslice knows", rereads.AUDIT_INTERVAL, 30.0),
    ("found by two reads 30 s apart", rereads.AUDIT_INTERVAL, 30.0),
    ("a call not answered within 60 s fails as unanswered", systemd.CALL_TIMEOUT, 60.0),
    ("once 64 had been lost the controller sent", systemd.MAX_CALLS_IN_FLIGHT, 64),
    # Security model: floods of calls
    ("longer than any method takes (4 KiB) are refused unread", busread.MAX_CALL_BODY, 4096),
    ("a call whose header is longer than 4 KiB", busread.MAX_CALL_HEADER, 4096),
    ("at most 64 messages are read per turn", busread.MAX_PER_TURN, 64),
    ("while 16 MiB of answers are still being written", service.MAX_STATUS_UNSENT, 16 << 20),
    ("while 64 MiB of them may still wait in dbus-daemon", service.MAX_STATUS_HELD, 64 << 20),
    ("asked every 4 MiB of", service.READ_EVERY, 4 << 20),
    ("again at most every 0.1 s; a bus daemon", service.READ_AGAIN, 0.1),
    ("at most 8 KiB each until dbus-daemon says", service.ANSWER_BYTES, 8 << 10),
    ("and 8 MiB past those 64 a call", service.MAX_REFUSALS_HELD, 8 << 20),
    ("An answer over 32 MiB", service.MAX_STATUS_ANSWER + 4096, 32 << 20),
    ("a build over 20 ms of CPU is made again", status.SLOW_BUILD, 0.02),
    ("at most once per ten times its cost", status.REBUILD_FACTOR, 10),
    ("at most 8 such lookups in flight", service.MAX_STATUS_ASKING, 8),
    ("(the 4 asked for last kept)", status.OWN_KEPT, 4),
    ("(the 256 names used last;", callers.CALLERS_KEPT, 256),
    # Security model: the gate's environment
    (
        "or a directory and everything in it, at any depth (at most 10,000 entries)",
        envsafety.MAX_TREE,
        10_000,
    ),
    # A unit's own journal
    ("entries wait in order, up to 2,000 (4 MiB)", journal.MAX_BACKLOG, 2000),
    ("entries wait in order, up to 2,000 (4 MiB)", journal.MAX_BACKLOG_BYTES, 4 << 20),
    # Preemption that loses no work
    ("`FreezeUnit` failing or not answered within 30 s", _freezer_timeout(), 30.0),
    ("is sent again after 1, 2, 4 and 8 s; then the resume", ladder.THAW_RETRY, (1, 2, 4, 8)),
    ("(`systemctl stop`, `TimeoutStopSec=5`)", checkpoint.SERVICE_STOP_TIMEOUT, 5.0),
    # Reading it, Metrics
    ("redrawn in place every 2 s (-n SECONDS)", _interval_default(), 2.0),
    ("a request head over 8 KiB or not complete within 5 s", exporter.MAX_HEAD, 8192),
    ("a request head over 8 KiB or not complete within 5 s", exporter.HEAD_TIMEOUT, 5.0),
    ("serves `GET /metrics` on **127.0.0.1:9848**", _socket("ListenStream"), "127.0.0.1:9848"),
    ("at most 8 connections at once, 4 from one address", _socket("MaxConnections"), "8"),
    ("at most 8 connections at once, 4 from one address", _socket("MaxConnectionsPerSource"), "4"),
]


@pytest.mark.parametrize(("sentence", "actual", "promised"), ROWS, ids=lambda v: str(v)[:40])
def test_the_readme_says_the_number_the_code_uses(
    sentence: str, actual: object, promised: object
) -> None:
    assert sentence in README, f"README no longer says: {sentence}"
    assert actual == promised, f"README says {sentence!r}: the code uses {actual!r}"
