"""Each decision as one journal entry that the unit's own journal shows too.

journald's native protocol (systemd.io/JOURNAL_NATIVE_PROTOCOL): one datagram to
/run/systemd/journal/socket of `KEY=VALUE\\n` fields; a value that holds a newline goes as
`KEY\\n`, its length as a little-endian 64-bit integer, the bytes, `\\n`, so no value can start
another field whatever it contains. `OBJECT_SYSTEMD_UNIT=` from a root process puts the entry
in `journalctl -u UNIT` and in `systemctl status UNIT`; the same entry stays in
`journalctl -u gpuslice` (its sender is gpuslice.service), so the controller's story is
unchanged: the entry replaces the plain log line, it does not repeat it.

A journal that cannot be written never reaches the controller: the socket is non-blocking
(a journald that lags drops the entry rather than stalling the event loop), every failure is
counted, said once, and the caller falls back to its plain log line.
"""

from __future__ import annotations

import logging
import re
import socket
import struct
from collections.abc import Iterable, Sequence

from gpuslice.core.decisions import Code, Decision, until

log = logging.getLogger("gpuslice")

SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "gpuslice"
MAX_VALUE = 16 * 1024  # bytes of one value; longer ones are cut, ending in "..."
MAX_ENTRY = 128 * 1024  # bytes of one datagram (journald reads up to its socket buffer)
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

    def __init__(self, path: str = SOCKET, max_entry: int = MAX_ENTRY) -> None:
        self.path = path
        self.max_entry = max_entry
        self.failures = 0
        self._failing = False
        self._sock: socket.socket | None = None

    def send(self, fields: Fields) -> bool:
        """Whether journald took the entry; a failure is counted and said once."""
        try:
            data = encode(fields)
            if len(data) > self.max_entry:
                # cut the long values further, so that the sentence and the fields still go
                data = encode(fields, max(self.max_entry // (2 * max(len(fields), 1)), 64))
            if self._sock is None:
                self._sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
                )
            self._sock.sendto(data, self.path)
        except (OSError, ValueError) as e:
            self.failures += 1
            if not self._failing:
                log.warning(
                    "cannot write to the journal at %s: %s; decisions are logged as plain lines, "
                    "not in their units' own journals (said once until it works)",
                    self.path,
                    e,
                )
            self._failing = True
            return False
        if self._failing:
            log.info(
                "writing to the journal works again (%d entries were not written)", self.failures
            )
            self._failing = False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
