"""What gpuslice writes where others read it (the journal), when what it writes is large.

journald keeps an entry of at most 1,024 fields (ENTRY_FIELD_COUNT_MAX, journald-native.c)
and drops a larger one without a word: the datagram was sent, so gpuslice counted it written
and wrote no plain line either.
"""

from __future__ import annotations

import socket

from gpuslice.core.decisions import Code, Decision
from gpuslice.journal import decision_fields
from tests.test_journal import Make, parse
from tests.test_journal import journald as journald
from tests.test_journal import make as make

JOURNALD_FIELDS_MAX = 1024  # ENTRY_FIELD_COUNT_MAX


def _received(server: socket.socket) -> list[list[tuple[str, bytes]]]:
    """Every datagram sent so far, as journald reads it."""
    out = []
    server.settimeout(0.2)
    try:
        while True:
            out.append(parse(server.recv(1 << 22)))
    except TimeoutError:
        return out


def test_a_gpu_lost_under_many_units_reaches_every_units_journal(
    make: Make, journald: tuple[str, socket.socket]
) -> None:
    """An admin's Memory= slices: 600 units on the GPU that was lost. The one entry had 1,205
    fields, which journald dropped: no unit's journal and not gpuslice's said the GPU was lost."""
    path, server = journald
    units = tuple(f"slice@{i}.service" for i in range(600))
    lost = Decision(Code.LOST_GPU, gpus=(1,), units=units)
    journal = make(path)
    assert journal.send(decision_fields(lost, "GPU 1 is lost", "error"))
    got = _received(server)
    assert got and all(len(entry) <= JOURNALD_FIELDS_MAX for entry in got)
    named = [v.decode() for entry in got for k, v in entry if k == "OBJECT_SYSTEMD_UNIT"]
    assert named == list(units)
    for entry in got:  # each a whole entry, each unit's two fields together
        fields = dict(entry)
        assert fields["MESSAGE"] == b"GPU 1 is lost"
        assert fields["PRIORITY"] == b"3"
        assert fields["GPUSLICE_DECISION"] == Code.LOST_GPU.value.encode()
        assert fields["GPUSLICE_GPUS"] == b"1"
        pairs = [(k, v) for k, v in entry if k in ("OBJECT_SYSTEMD_UNIT", "GPUSLICE_UNIT")]
        assert pairs[0::2] == [("OBJECT_SYSTEMD_UNIT", v) for _, v in pairs[1::2]]
        assert [k for k, _ in pairs[1::2]] == ["GPUSLICE_UNIT"] * (len(pairs) // 2)
    assert journal.failures == 0


def test_an_entry_journald_would_drop_is_a_failure_not_a_success(
    make: Make, journald: tuple[str, socket.socket]
) -> None:
    """Too many different fields to spread: not sent, counted, and False (the caller's plain
    line says it), never True for an entry journald drops."""
    path, server = journald
    journal = make(path)
    fields = [("MESSAGE", "m"), *((f"F{i}", "x") for i in range(1100))]
    assert not journal.send(fields)
    assert journal.failures == 1
    assert _received(server) == []
