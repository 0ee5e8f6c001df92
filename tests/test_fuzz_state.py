"""Hypothesis over the state file: whatever it holds, `StateStore.load()` starts the controller.

Properties: load() never raises; it returns a SavedState of the right types whose names are
all valid unit names, which the scheduler takes; a second load() agrees with the first and
logs nothing (a bad file was moved aside or cleaned up); save() then load() is the identity
on valid states. `GPUSLICE_FUZZ_EXAMPLES` sets the examples per property (default 200;
`make fuzz` runs 10000).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice.core.model import PRIORITY_MAX
from gpuslice.core.scheduler import SavedState, Scheduler
from gpuslice.sizes import SIZE_MAX
from gpuslice.state import FIELDS, GPU_INDEX_MAX, KINDS, PHASES, SEQ_MAX, StateStore
from gpuslice.unitfiles import UNIT_NAME_MAX, is_valid_unit_name
from tests.core_builders import spec

EXAMPLES = int(os.environ.get("GPUSLICE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- strategies -------------------------------------------------------------------------------

_PREFIX = "abcxyzABZ019:_.-\\"
_INSTANCE = _PREFIX + "@"
_TYPES = ("service", "scope", "socket", "target", "timer", "slice", "mount")


@st.composite
def unit_names(draw: st.DrawFn) -> str:
    """Valid unit names (no templates) of every length up to the longest systemd allows."""
    suffix = "." + draw(st.sampled_from(_TYPES))
    room = UNIT_NAME_MAX - len(suffix)
    long = draw(st.integers(0, 9)) == 0  # one in ten: up to the longest name systemd allows
    size = draw(st.integers(1, room) | st.just(room)) if long else draw(st.integers(1, 12))
    cut = draw(st.integers(1, size))
    if size - cut >= 2 and draw(st.booleans()):
        name = draw(st.text(_PREFIX, min_size=cut, max_size=cut)) + "@"
        name += draw(st.text(_INSTANCE, min_size=size - cut - 1, max_size=size - cut - 1))
    else:
        name = draw(st.text(_PREFIX, min_size=size, max_size=size))
    name += suffix
    assert is_valid_unit_name(name) and name.find("@") + 1 != name.rfind("."), name
    return name


NAMES = unit_names()
# what a unit whose annotation goes holds its GPUs on: (priority, kind, GPUs, memory)
TERMS = st.tuples(
    st.integers(0, PRIORITY_MAX),
    st.sampled_from(KINDS),
    st.integers(1, GPU_INDEX_MAX + 1),
    st.none() | st.integers(1, SIZE_MAX),
)
SEQS = st.integers(0, SEQ_MAX)
GPU_LISTS = st.lists(st.integers(0, GPU_INDEX_MAX), unique=True, max_size=8).map(tuple)
KEYS = NAMES | st.text(max_size=20)  # JSON object keys: strings only
BOOT_IDS = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)


@st.composite
def valid_states(draw: st.DrawFn) -> SavedState:
    holders = draw(
        st.dictionaries(
            NAMES,
            st.tuples(GPU_LISTS, st.sampled_from(PHASES), SEQS, st.just("") | NAMES),
            max_size=4,
        )
    )
    preempted = draw(st.dictionaries(NAMES, SEQS, max_size=3))
    lists = [draw(st.lists(NAMES, unique=True, max_size=3)) for _ in range(3)]
    floor = max([0, *(h[2] for h in holders.values()), *preempted.values()])
    seq = draw(st.integers(floor, SEQ_MAX))
    terms = {n: draw(TERMS) for n in holders if draw(st.booleans())}
    return SavedState(holders, preempted, lists[0], lists[1], lists[2], seq, terms=terms)


# any JSON value, NaN and infinities included (json.dumps writes them as NaN/Infinity)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | NAMES,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


def near(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the right shape, sometimes anything: where validation bugs hide."""
    return valid | JSON


@st.composite
def near_valid_files(draw: st.DrawFn) -> dict[str, Any]:
    """A valid state's JSON with some values, keys and entries replaced by anything."""
    state = draw(valid_states())
    data: dict[str, Any] = json.loads(
        json.dumps({"version": 1, "boot_id": draw(BOOT_IDS), **vars(state)})
    )
    for key in FIELDS:
        choice = draw(st.integers(0, 9))
        if choice == 0:
            del data[key]
        elif choice == 1:
            data[key] = draw(JSON)
    holder = st.lists(near(GPU_LISTS.map(list)) | near(st.sampled_from(PHASES)) | near(SEQS))
    if isinstance(data.get("holders"), dict) and draw(st.booleans()):
        data["holders"][draw(KEYS)] = draw(near(holder))
    if isinstance(data.get("held"), list) and draw(st.booleans()):
        data["held"].append(draw(near(NAMES)))
    if isinstance(data.get("preempted"), dict) and draw(st.booleans()):
        data["preempted"][draw(KEYS)] = draw(near(SEQS))
    if draw(st.integers(0, 9)) == 0:
        data["terms"] = draw(JSON)
    if isinstance(data["terms"], dict) and draw(st.booleans()):
        holders = data.get("holders")
        names = sorted(holders) if isinstance(holders, dict) and holders else [draw(KEYS)]
        name = draw(st.sampled_from(names) | KEYS)  # a holder's, mostly
        term = st.lists(near(st.integers(-1, 1000)) | near(st.sampled_from(KINDS)))
        data["terms"][name] = draw(near(TERMS.map(list)) | near(term))
    if draw(st.booleans()):
        data[draw(st.text(max_size=8))] = draw(JSON)
    return data


# ---- properties ---------------------------------------------------------------------------------


def check_load(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = StateStore(Path(tmp))
        store.path.write_bytes(content)
        records = Records()
        saved, boot_id = records.around(store.load)
        assert len(records.seen) <= 1
        assert all(r.levelno == logging.ERROR and r.exc_info is None for r in records.seen)
        check_types(saved, boot_id)
        names = set(saved.holders) | set(saved.preempted)
        Scheduler(range(4), {n: spec(n, 10) for n in names}).load(saved)
        Scheduler(range(4), {}).load(saved)  # no longer annotated: held on their terms
        again = Records()
        assert again.around(store.load) == (saved, boot_id)
        assert again.seen == []


def check_types(saved: SavedState, boot_id: str) -> None:
    assert isinstance(saved, SavedState) and isinstance(boot_id, str)

    def unit(name: object) -> bool:
        return is_valid_unit_name(name) and str(name).find("@") + 1 != str(name).rfind(".")

    assert isinstance(saved.holders, dict)
    for name, (gpus, phase, seq, stopping_for) in saved.holders.items():
        assert unit(name)
        assert isinstance(gpus, tuple) and len(set(gpus)) == len(gpus)
        assert all(type(g) is int and 0 <= g <= GPU_INDEX_MAX for g in gpus)
        assert phase in PHASES
        assert type(seq) is int and 0 <= seq <= saved.seq
        assert stopping_for == "" or unit(stopping_for)
    assert isinstance(saved.preempted, dict)
    for name, seq in saved.preempted.items():
        assert unit(name) and type(seq) is int and 0 <= seq <= saved.seq
    for names in (saved.held, saved.finished, saved.failed):
        assert isinstance(names, list) and len(set(names)) == len(names)
        assert all(unit(n) for n in names)
    assert type(saved.seq) is int and 0 <= saved.seq <= SEQ_MAX
    assert isinstance(saved.terms, dict)
    for name, (priority, kind, count, memory) in saved.terms.items():
        assert name in saved.holders or name in saved.suspended
        assert type(priority) is int and 0 <= priority <= PRIORITY_MAX and kind in KINDS
        assert type(count) is int and 1 <= count <= GPU_INDEX_MAX + 1
        assert memory is None or (type(memory) is int and 1 <= memory <= SIZE_MAX)


class Records(logging.Handler):
    """The records of the state logger during one call (caplog is per test, not per example)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record)

    def around(self, call: Any) -> Any:
        logger = logging.getLogger("gpuslice")
        old = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.DEBUG)
        try:
            return call()
        finally:
            logger.removeHandler(self)
            logger.setLevel(old)


@FUZZ
@given(JSON)
def test_any_json_value(value: Any) -> None:
    check_load(json.dumps(value).encode())


@FUZZ
@given(near_valid_files())
def test_near_valid_files(data: dict[str, Any]) -> None:
    check_load(json.dumps(data).encode())


@FUZZ
@given(st.binary(max_size=300) | near_valid_files().map(lambda d: json.dumps(d).encode()))
def test_any_bytes(content: bytes) -> None:
    check_load(content)


@FUZZ
@given(valid_states(), BOOT_IDS)
def test_round_trip(state: SavedState, boot_id: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = StateStore(Path(tmp))
        store.save(state, boot_id)
        records = Records()
        assert records.around(store.load) == (state, boot_id)
        assert records.seen == []
