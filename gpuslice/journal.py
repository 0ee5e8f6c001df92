"""Each decision as one journal entry that the unit's own journal shows too.

journald's native protocol (systemd.io/JOURNAL_NATIVE_PROTOCOL): one datagram to
/run/systemd/journal/socket of `KEY=VALUE\\n` fields; a value that holds a newline goes as
`KEY\\n`, its length as a little-endian 64-bit integer, the bytes, `\\n`, so no value can start
another field whatever it contains. `OBJECT_SYSTEMD_UNIT=` from a root process puts the entry
in `journalctl -u UNIT` and in `systemctl status UNIT`; the same entry stays in
`journalctl -u gpuslice` (its sender is gpuslice.service), so the controller's story is
unchanged: the entry replaces the plain log line, it does not repeat it.

A journal that cannot be written never reaches the controller: the socket is non-blocking,
every failure is counted, said once, and the caller falls back to its plain log line. A
journald that lags (its queue full: EAGAIN) neither stalls the event loop nor costs an entry
its fields: entries wait, in order, in a bounded backlog that is written as journald takes
them (a burst of decisions is when they matter most in `journalctl -u UNIT`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import socket
import struct
from collections import Counter, deque
from collections.abc import Iterable, Sequence

from gpuslice.core.decisions import Code, Decision, until

log = logging.getLogger("gpuslice")

SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "gpuslice"
MAX_VALUE = 16 * 1024  # bytes of one value; longer ones are cut, ending in "..."
MAX_ENTRY = 128 * 1024  # bytes of one datagram (journald reads up to its socket buffer)
# Entries held while journald's queue is full (a burst of 200 starts decides ~1,000 times),
# and their bytes; beyond either, the caller's plain log line.
MAX_BACKLOG = 2_000
MAX_BACKLOG_BYTES = 4 << 20
RETRY_DELAY = 0.005  # seconds between tries to write the backlog
# Fields of one entry. journald drops an entry of more than 1,024 without a word
# (ENTRY_FIELD_COUNT_MAX in journald-native.c; the send succeeds), and adds its own fields
# (_PID=, _SYSTEMD_UNIT=, ...) to those it keeps. A lost GPU's entry names each unit that held
# it twice: past ~510 units it was lost from every journal, gpuslice's own too.
MAX_FIELDS = 960
# Field names as journald accepts them: A-Z, 0-9 and _, not starting with _ or a digit.
FIELD_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,63}", re.ASCII)
SYSLOG = {"critical": 2, "error": 3, "warning": 4, "info": 6, "debug": 7}

Fields = Sequence[tuple[str, str]]


def encode(fields: Iterable[tuple[str, str]], max_value: int = MAX_VALUE) -> bytes:
    """One native-protocol datagram. Values are UTF-8 (anything unencodable replaced),
    cut to `max_value` bytes; a value with a newline goes in the binary form."""
    out = bytearray()
    for key, value in fields:
        if not FIELD_NAME.fullmatch(key):
            raise ValueError(f"not a journal field name: {key!r}")
        data = value.encode("utf-8", "replace")
        if len(data) > max_value:
            data = data[: max(max_value - 3, 0)].decode("utf-8", "ignore").encode() + b"..."
        name = key.encode("ascii")
        if b"\n" in data:
            out += name + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name + b"=" + data + b"\n"
    return bytes(out)


def entries(fields: Fields, max_fields: int = MAX_FIELDS) -> list[list[tuple[str, str]]]:
    """`fields` as entries journald keeps: the one entry, or past `max_fields` several, each
    with every field given once and its share of those given several times (a decision's
    units, whose OBJECT_SYSTEMD_UNIT= and GPUSLICE_UNIT= stay together). ValueError when the
    fields given once alone are too many."""
    if len(fields) <= max_fields:
        return [list(fields)]
    counts = Counter(key for key, _ in fields)
    once = [field for field in fields if counts[field[0]] == 1]
    many = [field for field in fields if counts[field[0]] > 1]
    keys = len({key for key, _ in many})
    room = (max_fields - len(once)) // keys * keys if keys else 0
    if room <= 0:
        raise ValueError(f"an entry of {len(fields)} fields, {len(once)} of them different")
    return [once + many[i : i + room] for i in range(0, len(many), room)]


def decision_fields(
    decision: Decision, message: str, level: str, waited_usec: int | None = None
) -> list[tuple[str, str]]:
    """The entry for one decision: the sentence, and the data it was rendered from."""
    fields = [
        ("MESSAGE", message),
        ("PRIORITY", str(SYSLOG.get(level, 6))),
        ("SYSLOG_IDENTIFIER", IDENTIFIER),
        ("GPUSLICE_DECISION", decision.code.value),
    ]
    for unit in decision.subjects():
        fields.append(("OBJECT_SYSTEMD_UNIT", unit))
        fields.append(("GPUSLICE_UNIT", unit))
    if decision.priority is not None:
        fields.append(("GPUSLICE_PRIORITY", str(decision.priority)))
    if decision.for_unit:
        fields.append(("GPUSLICE_FOR", decision.for_unit))
    if decision.for_priority is not None:
        fields.append(("GPUSLICE_FOR_PRIORITY", str(decision.for_priority)))
    if decision.gpus:
        fields.append(("GPUSLICE_GPUS", ",".join(str(g) for g in decision.gpus)))
    if decision.cause is not None:
        fields.append(("GPUSLICE_CAUSE", decision.cause.value))
    if decision.code is Code.WAIT:
        fields.append(("GPUSLICE_UNTIL", until(decision)))
    if waited_usec is not None:
        fields.append(("GPUSLICE_WAITED_USEC", str(max(waited_usec, 0))))
    return fields


class Journal:
    """Writes entries to journald; never raises. `failures` counts entries not written."""

    def __init__(
        self, path: str = SOCKET, max_entry: int = MAX_ENTRY, max_backlog: int = MAX_BACKLOG
    ) -> None:
        self.path = path
        self.max_entry = max_entry
        self.max_backlog = max_backlog
        self.failures = 0
        self._failing = False
        self._failures_before = 0  # `failures` when the failure under way began
        self._sock: socket.socket | None = None
        self.backlog: deque[bytes] = deque()  # taken, not yet written (journald lagged)
        self._held = 0  # bytes in the backlog
        self._retry: asyncio.TimerHandle | None = None

    def send(self, fields: Fields) -> bool:
        """Whether the entry was taken: written, or held until journald takes it (only
        within an event loop, which writes it later). A failure is counted and said once.
        Too many fields for one entry go as several (`entries`); False once one is not taken
        (the caller's plain line then says it all)."""
        try:
            parts = entries(fields)
        except ValueError as e:
            return self._failed(e)
        return all(self._send(part) for part in parts)

    def _send(self, fields: Fields) -> bool:
        try:
            data = encode(fields)
            if len(data) > self.max_entry:
                # cut the long values further, so that the sentence and the fields still go
                data = encode(fields, max(self.max_entry // (2 * max(len(fields), 1)), 64))
            if self.backlog:  # after the entries that wait: in order
                return self._hold(data) or self._failed(BlockingIOError("journald lags"))
            self._socket().sendto(data, self.path)
        except BlockingIOError as e:  # journald's queue is full
            return self._hold(data) or self._failed(e)
        except (OSError, ValueError) as e:
            return self._failed(e)
        self._works()
        return True

    def _socket(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.socket(
                socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
            )
        return self._sock

    def _hold(self, data: bytes) -> bool:
        """Keep an entry journald cannot take now; False when none can be kept (backlog
        full, or no event loop to write it from later)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if len(self.backlog) >= self.max_backlog or self._held + len(data) > MAX_BACKLOG_BYTES:
            return False
        self.backlog.append(data)
        self._held += len(data)
        if self._retry is None:
            self._retry = loop.call_later(RETRY_DELAY, self._drain)
        return True

    def _drain(self) -> None:
        """Write the backlog, oldest first, while journald takes it."""
        self._retry = None
        error = self._write_backlog()
        if error is None:
            self._works()
        elif isinstance(error, BlockingIOError):
            self._retry = asyncio.get_running_loop().call_later(RETRY_DELAY, self._drain)
        else:  # journald is gone: what waits is lost, and counted
            lost = len(self.backlog)
            self._drop_backlog()
            self._failed(error, lost)

    def _write_backlog(self) -> OSError | None:
        """Send held entries, oldest first, until none is left (None) or one is refused
        (the error; that entry and those after it stay held)."""
        while self.backlog:
            try:
                self._socket().sendto(self.backlog[0], self.path)
            except OSError as e:
                if e.errno != errno.EMSGSIZE:
                    return e
                # that one entry is too big for the socket (held without being tried): it
                # alone is lost and counted, never the entries held with it
                self._failed(e)
            self._held -= len(self.backlog.popleft())
        return None

    def _drop_backlog(self) -> None:
        self.backlog.clear()
        self._held = 0

    def _failed(self, error: Exception, lost: int = 1) -> bool:
        if not self._failing:
            self._failures_before = self.failures
        self.failures += lost
        if not self._failing:
            log.warning(
                "cannot write to the journal at %s: %s; decisions are logged as plain lines, "
                "not in their units' own journals (said once until it works)",
                self.path,
                error,
            )
        self._failing = True
        return False

    def _works(self) -> None:
        """Said when a failure ends, with the entries lost to that failure (not since start:
        a second outage said the first one's losses again)."""
        if self._failing:
            log.info(
                "writing to the journal works again (%d entries were not written)",
                self.failures - self._failures_before,
            )
            self._failing = False

    def close(self) -> None:
        """Write what waits if journald takes it now (never waiting); the rest is counted."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._write_backlog()
        self.failures += len(self.backlog)
        self._drop_backlog()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
