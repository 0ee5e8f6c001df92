"""The exporter's HTTP responder (gpuslice/exporter.py) against a real TCP connection: one
request per connection, as gpuslice-metrics@.service gets it from the socket unit."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuslice import exporter
from gpuslice.metrics import exposition
from gpuslice.unitfiles import parse_sections

STATUS: dict[str, Any] = {
    "version": 1,
    "gpus": [],
    "waiting": [],
    "preempted": [],
    "held": [],
    "finished": [],
    "failed": [],
}


def good() -> bytes:
    return exposition(STATUS)


@contextmanager
def server(
    metrics: Callable[[], bytes] = good, **limits: Any
) -> Iterator[tuple[socket.socket, list[int]]]:
    """A client socket connected to a responder running in a thread; the codes it sent."""
    listener = socket.create_server(("127.0.0.1", 0))
    codes: list[int] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            codes.append(exporter.respond(conn, metrics, **limits))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = socket.create_connection(listener.getsockname(), timeout=10)
    try:
        yield client, codes
    finally:
        client.close()
        thread.join(10)
        listener.close()
        assert not thread.is_alive()


def receive(client: socket.socket) -> bytes:
    data = b""
    while chunk := client.recv(65536):
        data += chunk
    return data


def exchange(
    request: bytes, metrics: Callable[[], bytes] = good
) -> tuple[str, dict[str, str], bytes]:
    with server(metrics) as (client, _):
        client.sendall(request)
        answer = receive(client)
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode("ascii").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    assert int(headers["Content-Length"]) == len(body)
    assert headers["Connection"] == "close"
    return status, headers, body


def test_get_metrics() -> None:
    status, headers, body = exchange(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n")
    assert status == "HTTP/1.0 200 OK"
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    parsed = text_string_to_metric_families(body.decode())  # type: ignore[no-untyped-call, unused-ignore]
    names = {f.name for f in parsed}
    assert {"gpuslice_up", "gpuslice_jobs", "gpuslice_pending_jobs"} <= names


@pytest.mark.parametrize(
    "request_line",
    [b"GET /metrics?x=1 HTTP/1.0\n\n", b"GET /metrics HTTP/1.0\r\n\r\nbody after the head"],
)
def test_get_metrics_variants(request_line: bytes) -> None:
    assert exchange(request_line)[0] == "HTTP/1.0 200 OK"


@pytest.mark.parametrize(
    "path", [b"/", b"/metrics/", b"/metricsx", b"/../metrics", b"http://x/metrics", b"*"]
)
def test_other_paths_are_404(path: bytes) -> None:
    status, _, body = exchange(b"GET " + path + b" HTTP/1.1\r\n\r\n")
    assert status == "HTTP/1.0 404 Not Found"
    assert body == b"404 Not Found\n"


@pytest.mark.parametrize("method", [b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"get"])
def test_other_methods_are_405(method: bytes) -> None:
    status, headers, _ = exchange(method + b" /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    assert status == "HTTP/1.0 405 Method Not Allowed"
    assert headers["Allow"] == "GET"


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /metrics\r\n\r\n",  # HTTP/0.9
        b"GET  /metrics HTTP/1.1\r\n\r\n",
        b"GET /metrics HTTP/2.0\r\n\r\n",
        b"G\xc3\xa9T /metrics HTTP/1.1\r\n\r\n",
        b"GET /m\xffetrics HTTP/1.1\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # TLS hello-ish
        b"GE/T /metrics HTTP/1.1\r\n\r\n",
        b"\r\n\r\n",
    ],
)
def test_malformed_requests_are_400(request_bytes: bytes) -> None:
    assert exchange(request_bytes)[0] == "HTTP/1.0 400 Bad Request"


def test_an_oversized_head_is_431_and_bounded() -> None:
    with server(max_head=1024) as (client, codes):
        client.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 200_000)
        answer = receive(client)
    assert answer.startswith(b"HTTP/1.0 431 Request Header Fields Too Large\r\n")
    assert codes == [431]


def test_a_slow_client_is_cut_off() -> None:
    with server(head_timeout=0.5) as (client, codes):
        start = time.monotonic()
        client.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the blank line
        answer = receive(client)
        took = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.0 408 Request Timeout\r\n")
    assert codes == [408]
    assert took < 5


def test_a_trickling_client_is_cut_off_all_the_same() -> None:
    """The deadline is for the whole head, not per read."""
    with server(head_timeout=0.5) as (client, codes):
        start = time.monotonic()
        for _ in range(20):
            try:
                client.sendall(b"X")
            except OSError:
                break
            time.sleep(0.05)
        answer = receive(client)
        took = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.0 408")
    assert codes == [408]
    assert took < 5


def test_a_client_that_leaves_gets_nothing() -> None:
    with server() as (client, codes):
        client.sendall(b"GET /met")
        client.shutdown(socket.SHUT_WR)
        assert receive(client) == b""
    assert codes == [0]


def test_an_error_of_ours_is_500_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> bytes:
        raise RuntimeError("secret detail")

    status, _, body = exchange(b"GET /metrics HTTP/1.1\r\n\r\n", broken)
    assert status == "HTTP/1.0 500 Internal Server Error"
    assert body == b"500 Internal Server Error\n"
    assert [r.getMessage() for r in caplog.records] == [
        "cannot build the metrics: RuntimeError: secret detail"
    ]


def test_serve_stdin_answers_the_socket_on_fd_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """As systemd passes it with Accept=yes: the connection is standard input."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        monkeypatch.setattr(os, "dup", lambda fd: theirs.detach() if fd == 0 else -1)
        ours.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert exporter.serve_stdin(good) == 200
        assert receive(ours).startswith(b"HTTP/1.0 200 OK\r\n")


SOCKET_UNIT = Path(__file__).resolve().parent.parent / "units/gpuslice-metrics.socket"


def test_a_connection_flood_cannot_fail_the_socket_for_good() -> None:
    """Systemd counts every connection it accepts against a socket's trigger limit, those
    beyond MaxConnections= that it drops too, and one over it (by default 200 in 2 s with
    Accept=yes) fails the socket until an admin restarts it: any local user's connection loop
    would end the exporter. The shipped socket has none, and still bounds the processes.
    tests/integration/test_metrics.py floods a real one as nobody."""
    socket_section = {
        e.key: e.value for e in parse_sections(SOCKET_UNIT.read_text()) if e.section == "Socket"
    }
    assert socket_section.get("TriggerLimitIntervalSec") == "0" or (
        socket_section.get("TriggerLimitBurst") == "0"
    ), socket_section
    assert socket_section["Accept"] == "yes" and int(socket_section["MaxConnections"]) <= 64
