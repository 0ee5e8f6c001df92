"""The optional metrics exporter: one HTTP/1.0 exchange on a connection systemd accepted.

`gpuslice-metrics.socket` (Accept=yes) starts one `gpuslice-metrics@.service` per connection
with the connection as its standard input; `gpuslice metrics --serve` answers it here and
exits. The request is hostile input: its head is read up to `MAX_HEAD` bytes within
`HEAD_TIMEOUT` seconds (else 431 or 408), only `GET /metrics` is served (another path 404,
another method on /metrics 405), anything malformed is a 400, and an error of ours is a 500
with one line on stderr (the unit's journal), never a traceback to the client.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

from gpuslice.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)

MAX_HEAD = 8192  # bytes: request line and headers
HEAD_TIMEOUT = 5.0  # seconds to receive them, all together
SEND_TIMEOUT = 10.0  # seconds to send the answer
PATH = "/metrics"

REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}


class _TooLarge(Exception):
    pass


def _read_head(sock: socket.socket, limit: int, timeout: float) -> bytes | None:
    """The request head (up to its blank line); None when the client closed first. Raises
    TimeoutError after `timeout` seconds in all, _TooLarge for a head over `limit` bytes.
    Whether a head fits is decided by its length alone, never by how its bytes arrived (a
    head within 4 bytes of `limit` was once served or refused by where the client's writes
    happened to split it, and one ending in a bare blank line served 2 bytes over it)."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        end = min((i for i in (data.find(b"\r\n\r\n"), data.find(b"\n\n")) if i >= 0), default=-1)
        if end > limit:
            raise _TooLarge
        if end >= 0:
            return data[:end]
        if len(data) >= limit + 4:  # a blank line found now would begin past `limit`
            raise _TooLarge
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(min(4096, limit + 4 - len(data)))
        if not chunk:
            return None
        data += chunk


def _route(head: bytes) -> int:
    """The status code for a request head: 200 for `GET /metrics` (a query is ignored)."""
    line = head.split(b"\n", 1)[0].rstrip(b"\r")
    try:
        words = line.decode("ascii").split(" ")
    except UnicodeDecodeError:
        return 400
    if len(words) != 3 or not words[2].startswith("HTTP/1.") or not words[0].isalpha():
        return 400
    method, target = words[0], words[1]
    if target.split("?", 1)[0] != PATH:
        return 404
    return 200 if method == "GET" else 405


def _answer(code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    headers = [
        f"HTTP/1.0 {code} {REASONS[code]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if code == 405:
        headers.append("Allow: GET")
    return ("\r\n".join(headers) + "\r\n\r\n").encode("ascii") + body


def respond(
    sock: socket.socket,
    metrics: Callable[[], bytes],
    *,
    max_head: int = MAX_HEAD,
    head_timeout: float = HEAD_TIMEOUT,
    send_timeout: float = SEND_TIMEOUT,
) -> int:
    """Answer one request on `sock` (then shut it down); the status code sent, 0 for none
    (the client left, or went away while we answered)."""
    try:
        try:
            head = _read_head(sock, max_head, head_timeout)
        except TimeoutError:
            code = 408
        except _TooLarge:
            code = 431
        else:
            if head is None:
                return 0
            code = _route(head)
        if code == 200:
            try:
                reply = _answer(200, metrics(), CONTENT_TYPE)
            except Exception as e:  # ours: one line in the journal, no traceback to anyone
                log.error("cannot build the metrics: %s: %s", type(e).__name__, e)
                code = 500
        if code != 200:
            reply = _answer(code, f"{code} {REASONS[code]}\n".encode())
        sock.settimeout(send_timeout)
        sock.sendall(reply)
        sock.shutdown(socket.SHUT_WR)
        _drain(sock)
        return code
    except OSError as e:  # the client went away or stalled while we answered
        log.info("client gone: %s", e)
        return 0


def _drain(sock: socket.socket, limit: int = 65536, timeout: float = 1.0) -> None:
    """Read what the client still sends (a body, the rest of an oversized head) for a
    moment, so that closing with unread data does not reset the connection before the
    client has read our answer."""
    deadline = time.monotonic() + timeout
    read = 0
    try:
        while read < limit and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(4096)
            if not chunk:
                return
            read += len(chunk)
    except OSError:
        return


def serve_stdin(metrics: Callable[[], bytes]) -> int:
    """Answer the connection systemd passed as standard input (Accept=yes)."""
    sock = socket.socket(fileno=os.dup(0))
    try:
        return respond(sock, metrics)
    finally:
        sock.close()
