"""What gpuslice/metrics.py, gpuslice/exporter.py and gpuslice/counters.py promise that no
test held until mutation testing asked.

The exposition is what a Prometheus scraper and a Grafana dashboard read: every HELP line's
words, a state the status did not give, a count of several jobs alike (not 1), a GPU or a
holder the status spoils that must not hide the next one, the histogram's sum and bounds, and
one collection per scrape. The exporter answers any local user's connection: the bytes of
every answer, a head limit decided by the head's length whatever way its bytes arrive (and
never more than the limit read), a deadline that is exact, a send that cannot block forever,
the words it logs when the client goes, and how long and how much it drains after answering.
A fake connection and a fake clock make those deterministic. The counters: a wait on a bucket
bound counts in that bucket (Prometheus' `le`), and counts kept elsewhere add to ours.
"""

from __future__ import annotations

import logging
import math
import socket
from typing import Any

import pytest

from gpuslice import exporter
from gpuslice import metrics as metrics_module
from gpuslice.core.decisions import Code
from gpuslice.counters import WAIT_BUCKETS, Counters, Histogram
from gpuslice.metrics import PENDING_REASONS, exposition
from tests.test_metrics import GIB, parse, status
from tests.test_metrics_http import good

# -- the exposition -----------------------------------------------------------------------

HELP = {
    "gpuslice_up": "Whether the gpuslice controller answered its Status call.",
    "gpuslice_build_info": "The controller's version: always 1.",
    "gpuslice_controller_start_time_seconds": (
        "When the controller started (Unix time): its counters count from then."
    ),
    "gpuslice_nvml_state": (
        "Which NVML case applies: ready, waiting (driver not ready), fallback, absent."
    ),
    "gpuslice_annotation_problems": "Problems found in unit annotations (see gpuslice check).",
    "gpuslice_jobs": (
        "Managed jobs by state (running, starting, restarting, stopping, frozen, suspending, "
        "resuming, waiting, suspended, preempted, held, finished, failed) and priority."
    ),
    "gpuslice_pending_jobs": "Jobs waiting at their gate, by the reason of their wait decision.",
    "gpuslice_gpu_memory_total_bytes": "GPU memory in all (NVML).",
    "gpuslice_gpu_memory_used_bytes": "GPU memory in use, by any process (NVML).",
    "gpuslice_gpu_memory_reserved_bytes": "GPU memory never handed out (config reserve).",
    "gpuslice_gpu_memory_unmanaged_bytes": "GPU memory used by processes of no managed unit.",
    "gpuslice_gpu_foreign_memory_bytes": (
        "GPU memory used by processes of no managed unit, by whose they are (owner: slurm, "
        "kubernetes, docker, podman, machine, user, unit, other)."
    ),
    "gpuslice_gpu_lost": "Whether the GPU stopped answering NVML.",
    "gpuslice_gpu_renumbered": (
        "Whether the GPU takes no new work because NVML numbered the GPUs anew under units "
        "that hold it (it answers; they run on)."
    ),
    "gpuslice_job_memory_declared_bytes": (
        "GPU memory a running job declared (Memory=); absent for a whole-GPU job."
    ),
    "gpuslice_job_memory_used_bytes": "GPU memory a running job's processes use (NVML).",
    "gpuslice_preemptions_total": (
        "Jobs stopped by gpuslice: for a more urgent waiter, or to yield to processes it "
        "does not manage."
    ),
    "gpuslice_requeues_total": "Preempted jobs brought back.",
    "gpuslice_refills_total": "Background jobs started on free capacity.",
    "gpuslice_holds_total": "Jobs stopped by hand, then held.",
    "gpuslice_decisions_total": "Decisions by code (GPUSLICE_DECISION= in the journal).",
    "gpuslice_gate_answers_total": (
        "Starts let through their gate: by its pipe (the fast way) or by D-Bus."
    ),
    "gpuslice_dbus_signals_dropped_total": (
        "D-Bus signals dropped: not systemd's own, or malformed."
    ),
    "gpuslice_dbus_call_errors_total": "Calls to systemd over D-Bus that returned an error.",
    "gpuslice_dbus_signals_lost_total": (
        "Unit states systemd's signals did not tell, found by the periodic read: lost on the bus."
    ),
    "gpuslice_dbus_acquire_refused_total": (
        "Acquire calls refused because the caller does not run in the unit it names."
    ),
    "gpuslice_nvml_errors_total": "NVML calls that failed while sampling the GPUs.",
    "gpuslice_nvml_timeouts_total": "NVML calls that did not answer within their deadline.",
    "gpuslice_journal_write_errors_total": "Decision entries that journald did not take.",
    "gpuslice_state_save_errors_total": "Writes of the state file that failed.",
    "gpuslice_notify_errors_total": (
        "sd_notify messages (READY=1, STATUS=, WATCHDOG=1) that systemd did not take."
    ),
    "gpuslice_admission_wait_time_seconds": (
        "How long each job waited at its gate before it was granted its GPUs (0: at once)."
    ),
}


def test_every_help_line_says_what_the_metric_is() -> None:
    """The HELP text is what Grafana shows beside a metric and what an admin reads in the raw
    exposition: its exact words, for every family."""
    text = exposition(status()).decode("utf-8")
    found = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, words = line.removeprefix("# HELP ").partition(" ")
            found[name] = words
    assert found == HELP


def samples(data: dict[str, Any], family: str) -> dict[tuple[Any, ...], float]:
    return parse(data)[family][1]


def test_an_nvml_state_not_given_is_the_empty_label_not_a_made_up_word() -> None:
    """Exactly one NVML series is 1, also when the status gives no state: the empty label,
    not "None" or another word a dashboard would show as a state."""
    data = status()
    data["nvml"] = {"since": 1.0}
    assert samples(data, "gpuslice_nvml_state") == {
        ("gpuslice_nvml_state", ("state", s)): float(s == "")
        for s in ("", "absent", "fallback", "ready", "waiting")
    }


def test_a_holder_without_a_unit_name_or_a_state_is_not_counted() -> None:
    data = status()
    holders = data["gpus"][0]["holders"]
    holders.append({"unit": "nostate.service", "priority": 5, "state": None})
    holders.append({"unit": None, "priority": 6, "state": "running"})
    jobs = samples(data, "gpuslice_jobs")
    assert [k for k in jobs if ("priority", "5") in k or ("priority", "6") in k] == []


def test_jobs_alike_are_counted_not_just_seen() -> None:
    """Several jobs in one state at one priority, several waiting for one reason: the gauge
    says how many."""
    data = status()
    data["waiting"] += [
        {"unit": f"w{i}.service", "priority": 10, "decision": {"cause": "victims-stopping"}}
        for i in range(3, 6)
    ]
    data["preempted"].append({"unit": "p2.service", "priority": 50, "requeue": True})
    data["held"].append("h2.service")
    data["priorities"]["h2.service"] = 70
    jobs = samples(data, "gpuslice_jobs")
    assert jobs[("gpuslice_jobs", ("priority", "10"), ("state", "waiting"))] == 5
    assert jobs[("gpuslice_jobs", ("priority", "50"), ("state", "preempted"))] == 2
    assert jobs[("gpuslice_jobs", ("priority", "70"), ("state", "held"))] == 2
    pending = samples(data, "gpuslice_pending_jobs")
    assert pending == {
        ("gpuslice_pending_jobs", ("reason", r)): {"victims-stopping": 4, "undecided": 1}.get(r, 0)
        for r in PENDING_REASONS
    }


def test_foreign_memory_sums_per_owner_kind_and_a_malformed_owner_is_other() -> None:
    data = status()
    data["gpus"][0]["foreign"] = [
        {"pid": 1, "memory": GIB, "owner": {"kind": "docker"}},
        {"pid": 2, "memory": 2 * GIB, "owner": {"kind": "docker"}},
        {"pid": 3, "memory": 4 * GIB, "owner": "docker"},
        {"pid": 4, "memory": 8 * GIB, "owner": None},
    ]
    name = "gpuslice_gpu_foreign_memory_bytes"
    assert samples(data, name) == {
        (name, ("gpu", "0"), ("owner", "docker"), ("uuid", "GPU-aaaa")): 3 * GIB,
        (name, ("gpu", "0"), ("owner", "other"), ("uuid", "GPU-aaaa")): 12 * GIB,
    }
    unmanaged = "gpuslice_gpu_memory_unmanaged_bytes"
    assert samples(data, unmanaged)[(unmanaged, ("gpu", "0"), ("uuid", "GPU-aaaa"))] == 15 * GIB


def test_a_spoilt_gpu_or_holder_hides_only_itself() -> None:
    """A GPU entry without an index, a holder without a unit name: that one is left out, the
    ones after it are still shown; a GPU without a uuid has the empty uuid label."""
    data = status()
    first, second = data["gpus"]
    del second["uuid"]
    first["holders"].insert(0, {"unit": 7, "memory_declared": GIB, "memory_used": GIB})
    data["gpus"] = [{"index": "0", "memory_total": GIB}, first, second]
    total = "gpuslice_gpu_memory_total_bytes"
    assert samples(data, total) == {
        (total, ("gpu", "0"), ("uuid", "GPU-aaaa")): 24 * GIB,
        (total, ("gpu", "1"), ("uuid", "")): 24 * GIB,
    }
    used = "gpuslice_job_memory_used_bytes"
    assert samples(data, used) == {(used, ("gpu", "0"), ("unit", "vlm.service")): 9 * GIB}


def test_decisions_not_a_mapping_count_every_code_as_zero() -> None:
    data = status()
    data["counters"]["decisions"] = ["grant", "grant"]
    decisions = samples(data, "gpuslice_decisions")
    assert decisions == {("gpuslice_decisions_total", ("decision", c.value)): 0 for c in Code}


def test_a_gate_way_not_given_counts_zero() -> None:
    data = status()
    data["counters"]["gate_answers"] = {"pipe": 3}
    assert samples(data, "gpuslice_gate_answers") == {
        ("gpuslice_gate_answers_total", ("way", "pipe")): 3,
        ("gpuslice_gate_answers_total", ("way", "dbus")): 0,
    }


def test_a_histogram_whose_first_buckets_are_empty_is_shown() -> None:
    """No job granted at once (the first buckets empty) is a normal histogram, not a
    malformed one."""
    histogram = Histogram()
    histogram.observe(7.0)
    data = status()
    data["admission_wait_seconds"] = histogram.to_json()
    bucket = "gpuslice_admission_wait_time_seconds_bucket"
    found = samples(data, "gpuslice_admission_wait_time_seconds")
    assert found[(bucket, ("le", "0.01"))] == 0
    assert found[(bucket, ("le", "10.0"))] == 1
    assert found[("gpuslice_admission_wait_time_seconds_sum",)] == 7.0


def test_a_histogram_with_a_bound_twice_is_left_out() -> None:
    data = status()
    data["admission_wait_seconds"]["buckets"] = [[1.0, 1], [1.0, 1], ["+Inf", 1]]
    assert "gpuslice_admission_wait_time_seconds" not in parse(data)


@pytest.mark.parametrize(
    "total,shown",
    [(0.5, 0.5), (0, 0.0), (-5.0, 0.0), (None, 0.0), ("3", 0.0), (math.inf, 0.0)],
)
def test_the_histogram_sum_is_kept_unless_it_is_not_a_number_or_negative(
    total: Any, shown: float
) -> None:
    data = status()
    data["admission_wait_seconds"]["sum"] = total
    found = samples(data, "gpuslice_admission_wait_time_seconds")
    assert found[("gpuslice_admission_wait_time_seconds_sum",)] == shown


def test_one_scrape_builds_the_families_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry is made per answer and never asked for names up front: describing the
    collector by collecting it would build every family twice per scrape."""
    calls = []
    real = metrics_module.families

    def counted(data: Any) -> Any:
        calls.append(data)
        return real(data)

    monkeypatch.setattr(metrics_module, "families", counted)
    data = status()
    assert b"gpuslice_up 1.0" in exposition(data)
    assert calls == [data]


# -- the counters -------------------------------------------------------------------------


def test_a_wait_on_a_bucket_bound_counts_in_that_bucket_and_waits_alike_add_up() -> None:
    """Prometheus' buckets are `le`: a wait of exactly 10 ms was at most 10 ms."""
    histogram = Histogram()
    for value in (0.01, 0.01, 7.0, 8.0, 10.0):
        histogram.observe(value)
    buckets = dict((str(b), n) for b, n in histogram.to_json()["buckets"])
    assert buckets["0.01"] == 2
    assert buckets["5.0"] == 2
    assert buckets["10.0"] == 5
    assert buckets["+Inf"] == 5
    assert len(buckets) == len(WAIT_BUCKETS) + 1


def test_counts_kept_elsewhere_add_to_the_controllers_own() -> None:
    counters = Counters()
    counters.error("journal_write_errors", 3)
    data = counters.to_json([("journal_write_errors", 2), ("dbus_signals_dropped", 4)])
    assert data["journal_write_errors"] == 5
    assert data["dbus_signals_dropped"] == 4
    assert counters.errors["journal_write_errors"] == 3  # the own count is not changed


# -- the exporter -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The exporter's clock, moved only by the fake connection's waits."""
    fake = Clock()
    monkeypatch.setattr(exporter, "time", fake)
    return fake


Script = list[bytes | float]


class Peer:
    """The exporter's end of one connection. `script` is what the client sends: pieces of
    bytes as they arrive (a read never returns more than one piece), and silences (a float:
    seconds the client sends nothing). After the script the client closes (`closes`) or stays
    silent for good. `stalled`: the client never reads, so a send waits for its timeout."""

    def __init__(
        self, clock: Clock, script: Script, *, closes: bool = True, stalled: bool = False
    ) -> None:
        self.clock = clock
        self.script = list(script)
        self.closes = closes
        self.stalled = stalled
        self.timeout: float | None = None
        self.received = b""
        self.read_before_answer: int | None = None
        self.sent = b""
        self.shut: int | None = None
        self.eof_seen = False
        self.reads = 0

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout

    def _wait(self, seconds: float) -> None:
        """Wait up to `seconds` for the client; raise as a socket does at its timeout."""
        if self.timeout is None:
            if math.isinf(seconds):
                raise AssertionError("blocks for good: no timeout set")
        elif self.timeout < seconds:
            if self.timeout == 0:
                raise BlockingIOError(11, "Resource temporarily unavailable")
            self.clock.now += self.timeout
            raise TimeoutError("timed out")
        self.clock.now += seconds

    def recv(self, size: int) -> bytes:
        self.reads += 1
        assert self.reads < 10_000, "reads without end"
        assert not self.eof_seen, "read again after the end of the stream"
        assert size > 0
        while self.script and isinstance(self.script[0], float):
            silence = self.script[0]
            try:
                self._wait(silence)
            except OSError:
                assert self.timeout is not None
                self.script[0] = silence - self.timeout
                raise
            self.script.pop(0)
        if not self.script:
            if self.closes:
                self.eof_seen = True
                return b""
            self._wait(math.inf)
        piece = self.script[0]
        assert isinstance(piece, bytes)
        out, rest = piece[:size], piece[size:]
        if rest:
            self.script[0] = rest
        else:
            self.script.pop(0)
        self.received += out
        return out

    def sendall(self, data: bytes) -> None:
        self.read_before_answer = len(self.received)
        if self.stalled:
            self._wait(math.inf)
        self.sent += data

    def shutdown(self, how: int) -> None:
        self.shut = how


def answer_for(
    clock: Clock, script: Script, metrics: Any = good, **limits: Any
) -> tuple[int, Peer]:
    peer = Peer(clock, script)
    code = exporter.respond(peer, metrics, **limits)  # type: ignore[arg-type]
    return code, peer


def error_answer(line: str, *extra: str) -> bytes:
    body = f"{line}\n".encode()
    head = [
        f"HTTP/1.0 {line}",
        "Content-Type: text/plain; charset=utf-8",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@pytest.mark.parametrize(
    "request_bytes,answer",
    [
        (b"GET / HTTP/1.1\r\n\r\n", error_answer("404 Not Found")),
        (b"PUT /metrics HTTP/1.1\r\n\r\n", error_answer("405 Method Not Allowed", "Allow: GET")),
        (b"GET /metrics HTTP/1.1 \r\n\r\n", error_answer("400 Bad Request")),
        (b"\rGET /metrics HTTP/1.1\r\n\r\n", error_answer("400 Bad Request")),
    ],
)
def test_an_error_answer_byte_for_byte(clock: Clock, request_bytes: bytes, answer: bytes) -> None:
    """Whitespace other than the single spaces of a request line (a trailing space, a leading
    carriage return) is malformed, not stripped into a request we serve."""
    code, peer = answer_for(clock, [request_bytes])
    assert peer.sent == answer
    assert code == int(answer.split(b" ")[1])


def test_a_query_is_ignored_whatever_it_holds(clock: Clock) -> None:
    code, peer = answer_for(clock, [b"GET /metrics?a=1?b=/x HTTP/1.1\r\n\r\n"])
    assert code == 200
    assert peer.sent == exporter._answer(200, good(), metrics_module.CONTENT_TYPE)
    assert peer.sent.startswith(
        b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
    )


def test_a_head_that_arrives_in_pieces_is_put_together(clock: Clock) -> None:
    pieces: Script = [b"GET /met", 0.5, b"rics HTTP/1.1\r\n", b"Host: x\r\n", 1.0, b"\r", b"\n"]
    code, peer = answer_for(clock, pieces)
    assert code == 200
    assert peer.shut == socket.SHUT_WR


LIMIT = 64


def head_of(size: int) -> bytes:
    """A request head (request line and headers, no blank line) of `size` bytes."""
    line = b"GET /metrics HTTP/1.1\r\nX-Pad: "
    out = line + b"a" * (size - len(line))
    assert len(out) == size
    return out


def splits(data: bytes) -> list[Script]:
    """`data` sent at once, in two pieces cut at each of its last 6 places, byte by byte."""
    out: list[Script] = [[data]]
    out += [[data[:cut], data[cut:]] for cut in range(len(data) - 6, len(data))]
    out.append([data[i : i + 1] for i in range(len(data))])
    return out


@pytest.mark.parametrize("blank", [b"\r\n\r\n", b"\n\n"])
def test_a_head_fits_by_its_length_however_it_arrives(clock: Clock, blank: bytes) -> None:
    """A head of `max_head` bytes is served and one byte more is 431, whatever way the
    client's writes split it; once, a head a few bytes under the limit was served when it
    came at once and refused when its blank line came in a later read, and a head ending in
    a bare blank line two bytes over the limit was served."""
    for size, expected in ((LIMIT - 4, 200), (LIMIT, 200), (LIMIT + 1, 431), (LIMIT + 2, 431)):
        for script in splits(head_of(size) + blank):
            code, peer = answer_for(clock, script, max_head=LIMIT)
            assert (code, size, script) == (expected, size, script)
            assert peer.read_before_answer is not None
            assert peer.read_before_answer <= LIMIT + 4


@pytest.mark.parametrize(
    "script,code",
    [
        ([head_of(LIMIT) + b"a" * 10_000], 431),
        ([b"GET /metrics HTTP/1.1\r\n", b"X: " + b"a" * 10_000], 431),
        ([b"GET /", b"X" * 10_000], 431),
        ([b"GET /metrics HTTP/1.0\n\n" + b"a" * (LIMIT - 21) + b"\n\n"], 200),
    ],
)
def test_no_more_than_the_limit_of_a_head_is_read(clock: Clock, script: Script, code: int) -> None:
    """However the bytes arrive, at most `max_head` + 4 (its blank line) are read before the
    answer; a blank line further on (in a body sent with the head) does not move the head's
    end."""
    answered, peer = answer_for(clock, script, max_head=LIMIT)
    assert answered == code
    assert peer.read_before_answer is not None
    assert peer.read_before_answer <= LIMIT + 4


@pytest.mark.parametrize(
    "script,code",
    [
        # the last piece comes at the deadline's last instant: read
        ([1.0, b"GET /metrics HTTP/1.1\r\n\r\n"], 200),
        ([0.5, b"GET /metrics HTTP/1.1\r\n", 0.5, b"\r\n\r\n"], 200),
        # the head is still incomplete at the deadline: nothing more is read
        ([1.0, b"GET /metrics HTTP/1.1\r\n", b"\r\n"], 408),
        ([0.5, b"GET /metrics HTTP/1.1\r\n", 0.5, b"X: 1\r\n", b"\r\n"], 408),
        ([b"GET /metrics HTTP/1.1\r\n", 2.0, b"\r\n"], 408),
    ],
)
def test_the_head_deadline_is_exact(clock: Clock, script: Script, code: int) -> None:
    assert answer_for(clock, script, head_timeout=1.0)[0] == code


def test_a_client_that_never_reads_cannot_hold_the_exporter(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """The answer is sent under `send_timeout`; past it the client is gone: code 0 (no answer
    was delivered) and one INFO line in the unit's journal."""
    peer = Peer(clock, [b"GET /metrics HTTP/1.1\r\n\r\n"], stalled=True)
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        assert exporter.respond(peer, good, send_timeout=3.0) == 0  # type: ignore[arg-type]
    assert clock.now == 1003.0
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("gpuslice.exporter", logging.INFO, "client gone: timed out")
    ]
    peer = Peer(clock, [b"GET /metrics HTTP/1.1\r\n\r\n"], stalled=True)
    assert exporter.respond(peer, good) == 0  # type: ignore[arg-type]
    assert clock.now == 1003.0 + exporter.SEND_TIMEOUT


AFTER = b"GET /metrics HTTP/1.0\r\n\r\n"


@pytest.mark.parametrize(
    "rest,drained",
    [
        ([b"x" * 4096] * 20, 16 * 4096),  # 64 KiB exactly: no read more
        ([b"x" * 4095] + [b"x" * 4096] * 20, 17 * 4096 - 1),  # a byte short: one read more
        ([b"x" * 100, b"y" * 200], 300),  # all of it, then the end of the stream
        ([1.0, b"late", b"later"], 4),  # what comes at the deadline's instant, nothing after
        ([0.5, b"x", 0.6, b"too late"], 1),
    ],
)
def test_after_the_answer_at_most_64_kib_are_drained_for_at_most_a_second(
    clock: Clock, rest: Script, drained: int
) -> None:
    """Draining keeps a close with unread data from resetting the connection before the
    client read the answer; it is bounded so that a client sending without end cannot keep
    the exporter reading."""
    peer = Peer(clock, [AFTER, *rest], closes=False)
    assert exporter.respond(peer, good) == 200  # type: ignore[arg-type]
    assert peer.read_before_answer == len(AFTER)
    assert len(peer.received) - len(AFTER) == drained


def test_a_silent_client_is_waited_for_one_second_after_the_answer(clock: Clock) -> None:
    peer = Peer(clock, [AFTER], closes=False)
    assert exporter.respond(peer, good) == 200  # type: ignore[arg-type]
    assert clock.now == 1001.0
    assert peer.shut == socket.SHUT_WR
