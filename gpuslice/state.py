"""What systemd cannot tell a restarted controller, kept in one JSON file written atomically.

Holds, the preempted set and GPU assignments must survive `kill -9` and reboots; a torn
write must never lose them, so the file is replaced with rename(2). A power cut must not
lose them either, but a disk flush before every StartUnit/StopUnit would cost each decision
milliseconds on a real disk (issue 10): `flush()` makes the file durable, and the controller
calls it off the event loop at most FLUSH_DELAY after a save. A power cut may then lose the
decisions of the last second, never the file (holders are rebuilt from systemd at boot).

Never the file: a rename(2) over the state file reaches the disk before the new file's data
on a file system that does not flush them at a rename (XFS; ext4 with auto_da_alloc and
btrfs do), so a power cut within the second after a save may leave `state.json` empty. Each
flush therefore keeps what it made durable as `state.json.prev`, a hard link made once the
file's data are synced, and `load()` takes it in place of a state file that is there but
unusable (empty, torn, or bad in any other way), after setting that one aside as
`state.json.bad` and putting the copy back in its place. It is the state of at most a
second before, never newer than a state file that can be read: a good state file always
wins over it; the stand-in (below) is ranked against it as against the state file; and it
is hostile input like the state file (the same owner, mode and entry checks). A state file
that is not there at all is no torn one: no copy is taken then.

Every GPU job waits on the controller, so no content of the file may stop it: `load()`
never raises. A file that is not exactly what `save()` writes costs one error line, and:
- the file itself is bad (not a regular file, over 16 MiB, another user's or writable by
  others, not UTF-8 JSON, not an object, another format version): it is moved to
  `state.json.bad` and the controller starts from what systemd reports;
- some entries are bad (a holder with an unknown phase, an invalid unit name, a negative
  seq, ...): those entries are dropped and the valid ones kept, since holds are what users
  care about; the original is copied to `state.json.bad` and the kept entries replace it
  at once (a restart before the next save must not lose them). When no entry is valid, the
  file is moved aside as a bad one.
One `.bad` file is kept, replaced each time. A file that cannot be read (EIO) is left alone.

A state directory that cannot be written (a full or read-only disk) must not make a restarted
controller forget what it preempted: the state then goes to a stand-in in runtime_dir (a
tmpfs, so it lasts until the next reboot), which `load()` prefers while it is the later saved
of the two; the first save that reaches the state directory again removes it.

Which of two state files was saved later is told by their save generation, a number each save
writes one higher than any the store has seen (`generation`), never by their modification
times: a clock stepped back between two saves (an NTP correction at boot, a board without a
real-time clock that starts in 1970) made the stale file the newer, and the units the other
owed a restart or a resume were lost (or a long-finished preemption replayed). A file without
one (an older gpuslice's) is generation 0; of two files of one generation, the later modified
wins. Each file is read once (`Found`): the bytes that rank it are the bytes loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import math
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NoReturn

from gpuslice import safefile
from gpuslice.core.model import PRIORITY_MAX, UnitKind
from gpuslice.core.scheduler import Phase, SavedState
from gpuslice.paths import STATE_FILE_NAME
from gpuslice.sizes import SIZE_MAX
from gpuslice.unitfiles import is_template, is_valid_unit_name, printable

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
STATE_FILE_MAX = 16 << 20  # save() writes kilobytes; a bigger file is not ours
GPU_INDEX_MAX = 1023
SEQ_MAX = (1 << 63) - 1
BOOT_ID_MAX = 256  # "<kernel boot id>/<systemd's UserspaceTimestamp>"
GENERATION_MAX = SEQ_MAX  # a save a microsecond would take 292,000 years to reach it
PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT: no process has a higher PID
# a suspended unit holds no GPU: it is listed under "suspended", never as a holder
PHASES = tuple(p.value for p in Phase if p is not Phase.SUSPENDED)
FIELDS = ("boot_id", "failed", "finished", "held", "holders", "preempted", "seq", "version")
# written since the Preempt= ladder, since starts are saved before they are sent, since
# the terms of units whose annotation goes are kept, since thaws owed are, since saves are
# numbered, since requeues at the gate and their failed waits are, since background
# instances the shutdown stopped are, since refills are told from comebacks, since the
# PIDs a suspend checkpointed are, and since units kept active after their job ended are
# released; a file without them (an older controller's) is complete
LATER_FIELDS = (
    "checkpointed",
    "frozen_for",
    "generation",
    "refills",
    "remained",
    "requeued",
    "started",
    "stopped_by_shutdown",
    "suspended",
    "terms",
    "thaw_owed",
    "wait_failed",
)
# the phases of a holder that may be owed a thaw (Scheduler.thaws_owed)
THAW_OWED_PHASES = (Phase.RUNNING.value, Phase.STOPPING.value)
KINDS = tuple(k.value for k in UnitKind)
_SHOWN_PROBLEMS = 5


class BadFile(Exception):
    """The file as a whole is unusable: nothing in it is kept."""


class Problems:
    """What was wrong with a file's entries: the first few words, and how many in all (a
    16 MiB file may hold millions of bad entries; their words would not fit a log line)."""

    def __init__(self) -> None:
        self.shown: list[str] = []
        self.count = 0

    def add(self, text: str) -> None:
        self.count += 1
        if len(self.shown) < _SHOWN_PROBLEMS:
            self.shown.append(text)

    def __bool__(self) -> bool:
        return self.count > 0

    def __str__(self) -> str:
        more = self.count - len(self.shown)
        return "; ".join(self.shown) + (f"; and {more} more" if more else "")


def _object(data: dict[str, Any], key: str, problems: Problems) -> dict[Any, Any]:
    """The file's object under `key` ({} when absent, or when it is no object: said)."""
    value = data.get(key, {})
    if isinstance(value, dict):
        return value
    problems.add(f"{key}: expected an object, got {_show(value)}")
    return {}


def _show(value: object) -> str:
    """A value from the file, short and safe for the journal (no repr of deep structures)."""
    if isinstance(value, str):
        return '"' + printable(value, 60) + '"'
    if value is None or isinstance(value, bool | float):
        return json.dumps(value)
    if isinstance(value, int):
        text = str(value)
        return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} digits)"
    return "a list" if isinstance(value, list) else "an object"


def _is_int(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _is_unit(value: object) -> bool:
    """A valid name of a concrete unit: `foo@.service` is a template, `foo@..service` not."""
    return is_valid_unit_name(value) and not is_template(str(value))


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number")


def parse(raw: bytes, problems: Problems) -> dict[str, Any]:
    """The file's top-level object and its duplicated keys (the last value counts, as in
    every JSON reader); BadFile with the reason when it is no object of our format."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in items:
            if key in obj:
                problems.add(f"key {_show(key)} appears more than once; kept the last")
            obj[key] = value
        return obj

    try:
        data = json.loads(
            raw.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=pairs
        )
    except UnicodeDecodeError as e:
        raise BadFile(f"not UTF-8 (byte {e.start})") from None
    except ValueError as e:  # json.JSONDecodeError, or an integer over Python's digit limit
        raise BadFile(f"not JSON ({printable(str(e), 120)})") from None
    except RecursionError:
        raise BadFile("not JSON this controller can read (nested too deeply)") from None
    if not isinstance(data, dict):
        raise BadFile(f"expected a JSON object, got {_show(data)}")
    version = data.get("version")
    if not _is_int(version, FORMAT_VERSION, FORMAT_VERSION):
        raise BadFile(f"format version {_show(version)}, expected {FORMAT_VERSION}")
    # a bad one leaves no way to tell this file from an older or a newer one: the file is bad
    generation = data.get("generation", 0)
    if not _is_int(generation, 0, GENERATION_MAX):
        raise BadFile(
            f"save generation {_show(generation)}, expected an integer 0-{GENERATION_MAX}"
        )
    return data


def _read_error(e: safefile.Unreadable) -> BadFile | OSError:
    """Why a state file gave no bytes: BadFile for a path that is no regular file or too big,
    the OSError when it cannot be read (FileNotFoundError: there is none yet)."""
    if e.error is not None:
        return e.error
    if e.why is safefile.Why.TOO_LARGE:
        return BadFile(f"larger than {STATE_FILE_MAX >> 20} MiB")
    return BadFile(f"not a regular file ({e.kind or 'an unknown kind of file'})")


@dataclass
class Found:
    """A state file read once: one bounded read, parsed once. Which of two files was saved
    later (`rank`) and the state loaded come from these same bytes: read again for each (up
    to three reads of 16 MiB at a start), a file replaced between the reads was ranked by
    one content and loaded with another."""

    path: Path
    # when it was modified: the fstat of the descriptor `raw` was read from (else the look
    # that refused it); None: none was there, or it could not be looked at
    mtime_ns: int | None
    raw: bytes | None = None  # None: it could not be read (`error`)
    data: dict[str, Any] | None = None  # its object (`parse`); None: `error` says why not
    error: BadFile | OSError | None = None
    # what parse found wrong (a key twice): the first of what validate adds to
    problems: Problems = field(default_factory=Problems)

    def rank(self) -> tuple[int, int]:
        """How late it was saved: of two files, the higher ranked was saved after the other.
        Its save generation (0 when it has none, an older gpuslice's, or is bad: then only
        its modification time tells it from another file of generation 0), then, for two of
        one generation, its modification time."""
        generation = int(self.data.get("generation", 0)) if self.data is not None else 0
        return generation, self.mtime_ns or 0

    def parsed(self) -> tuple[bytes, dict[str, Any]]:
        """Its bytes and its object; its `error` raised when it has none."""
        if self.error is not None:
            raise self.error
        assert self.raw is not None and self.data is not None  # read_found set them
        return self.raw, self.data


def read_found(path: Path) -> Found:
    """The state file at `path`, read and parsed once (`Found`). One open: its time is the
    open file's, never a look at the path just before, which may be of a file replaced since
    (ranked by one file's time, loaded with another's bytes). Never raises; never follows a
    symlink or blocks on a FIFO (`safefile`)."""
    found = Found(path, None)
    try:
        found.raw, st = safefile.read_with_stat(path, STATE_FILE_MAX, follow_links=False)
    except safefile.Unreadable as e:
        found.mtime_ns = None if e.stat is None else e.stat.st_mtime_ns
        found.error = _read_error(e)
        return found
    found.mtime_ns = st.st_mtime_ns
    others = _others_could_write(st)
    if others:
        found.error = BadFile(others)
        return found
    try:
        found.data = parse(found.raw, found.problems)
    except BadFile as e:
        found.error = e
    return found


def _others_could_write(st: os.stat_result) -> str:
    """Why a state file may hold what another user wrote ("" when only root, or the
    controller's own user, could write it): one another user owns, or that others may write
    (`chmod 666`, a backup restored so). Its holders, suspended units and grants were trusted:
    a forged one booked a GPU for a unit that runs on another, and that GPU was granted to a
    second job. save() writes a new file, mode 0644, so the controller's own never is."""
    if st.st_uid != os.geteuid():
        return f"owned by UID {st.st_uid}, not the controller's"
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and st.st_gid not in (0, os.getegid())):
        return f"writable by others (mode {mode:04o})"
    return ""


def validate(data: dict[str, Any], problems: Problems) -> tuple[SavedState, str]:
    """The valid entries of a parsed file and its boot id; what was dropped (and why) goes
    to `problems`."""
    boot_id = data.get("boot_id", "")
    if not (isinstance(boot_id, str) and len(boot_id) <= BOOT_ID_MAX and boot_id.isprintable()):
        problems.add(f"boot_id: {_show(boot_id)} is no boot id")
        boot_id = ""

    holders: dict[str, tuple[tuple[int, ...], str, int, str]] = {}
    raw_holders = _object(data, "holders", problems)
    for name, entry in raw_holders.items():
        why = _holder_problem(name, entry)
        if why:
            problems.add(f"holders: dropped {_show(name)}: {why}")
        else:
            gpus, phase, seq, *rest = entry
            holders[name] = (tuple(gpus), phase, seq, rest[0] if rest else "")

    preempted: dict[str, int] = {}
    raw_preempted = _object(data, "preempted", problems)
    for name, seq in raw_preempted.items():
        if not _is_unit(name):
            problems.add(f"preempted: dropped {_show(name)}: not a unit name")
        elif not _is_int(seq, 0, SEQ_MAX):
            problems.add(f"preempted: dropped {_show(name)}: seq {_show(seq)}")
        else:
            preempted[name] = seq

    lists: dict[str, list[str]] = {}
    for key in (
        "held",
        "finished",
        "failed",
        "started",
        "thaw_owed",
        "requeued",
        "wait_failed",
        "stopped_by_shutdown",
        "refills",
        "remained",
    ):
        lists[key] = []
        names = data.get(key, [])
        if not isinstance(names, list):
            problems.add(f"{key}: expected a list, got {_show(names)}")
            continue
        seen: set[str] = set()
        for name in names:
            if not _is_unit(name):
                problems.add(f"{key}: dropped {_show(name)}: not a unit name")
            elif name in seen:
                problems.add(f"{key}: dropped {_show(name)}: listed twice")
            else:
                seen.add(name)
                lists[key].append(name)

    suspended: dict[str, tuple[tuple[int, ...], int]] = {}
    raw_suspended = _object(data, "suspended", problems)
    for name, entry in raw_suspended.items():
        why = _suspended_problem(name, entry)
        if why or name in holders:
            problems.add(f"suspended: dropped {_show(name)}: {why or 'also a holder'}")
        else:
            suspended[name] = (tuple(entry[0]), entry[1])

    checkpointed: dict[str, tuple[tuple[int, ...], int, float]] = {}
    raw_checkpointed = _object(data, "checkpointed", problems)
    for name, entry in raw_checkpointed.items():
        why = _checkpointed_problem(entry)
        if not why and name not in suspended:
            why = "not a suspended unit"
        if why:
            problems.add(f"checkpointed: dropped {_show(name)}: {why}")
        else:
            pids, vram, wall = entry
            checkpointed[name] = (tuple(pids), vram, float(wall))

    frozen_for: dict[str, list[str]] = {}
    raw_frozen = _object(data, "frozen_for", problems)
    for name, units in raw_frozen.items():
        if name not in holders or holders[name][1] != Phase.FROZEN.value:
            problems.add(f"frozen_for: dropped {_show(name)}: not a frozen holder")
        elif not isinstance(units, list) or not all(_is_unit(u) for u in units):
            problems.add(f"frozen_for: dropped {_show(name)}: expected a list of unit names")
        else:
            frozen_for[name] = list(dict.fromkeys(units))

    terms: dict[str, tuple[int, str, int, int | None]] = {}
    raw_terms = _object(data, "terms", problems)
    for name, entry in raw_terms.items():
        why = _terms_problem(name, entry)
        if not why and name not in holders and name not in suspended:
            why = "neither a holder nor a suspended unit"
        if why:
            problems.add(f"terms: dropped {_show(name)}: {why}")
        else:
            priority, kind, gpus, memory = entry
            terms[name] = (priority, kind, gpus, memory)

    started: list[str] = []
    for name in lists["started"]:
        if name in holders and holders[name][1] == Phase.STARTING.value:
            started.append(name)
        else:
            problems.add(f"started: dropped {_show(name)}: not a starting holder")

    refills: list[str] = []
    ours = set(started)
    for name in lists["refills"]:
        if name in ours:
            refills.append(name)
        else:
            problems.add(f"refills: dropped {_show(name)}: not a start of ours")

    thaw_owed: list[str] = []
    for name in lists["thaw_owed"]:
        if name in holders and holders[name][1] in THAW_OWED_PHASES:
            thaw_owed.append(name)
        else:
            problems.add(f"thaw_owed: dropped {_show(name)}: not a running or stopping holder")

    requeued: list[str] = []
    for name in lists["requeued"]:
        if name not in holders or holders[name][1] == Phase.STARTING.value:
            requeued.append(name)  # a waiter is no holder
        else:
            problems.add(f"requeued: dropped {_show(name)}: a holder past its gate")

    wait_failed: list[str] = []
    for name in lists["wait_failed"]:
        if name in preempted:
            wait_failed.append(name)
        else:
            problems.add(f"wait_failed: dropped {_show(name)}: not a preempted unit")

    remained: list[str] = []
    for name in lists["remained"]:
        # a stopping holder keeps its GPUs until our stop ends it (Scheduler.exited)
        holding = name in holders and holders[name][1] != Phase.STOPPING.value
        if holding or name in suspended:
            problems.add(f"remained: dropped {_show(name)}: it holds GPUs, not being stopped")
        elif name in preempted:
            # its comeback, sent to a unit systemd shows active, is a no-op: the comeback's
            # holder stayed starting, and its waiter waited, for ever
            problems.add(
                f"remained: dropped {_show(name)}: a preempted unit (owed a comeback, which "
                "systemd would take as a no-op while the unit shows active)"
            )
        else:
            remained.append(name)

    seq = data.get("seq", 0)
    if not _is_int(seq, 0, SEQ_MAX):
        problems.add(f"seq: {_show(seq)} is no sequence number")
        seq = 0
    # the counter numbers every holder and preemption: it is never behind them (a counter
    # behind them would order new arrivals before old ones)
    highest = max(
        [
            seq,
            *(h[2] for h in holders.values()),
            *preempted.values(),
            *(s[1] for s in suspended.values()),
        ]
    )
    if highest > seq:
        problems.add(f"seq: {seq} is below the entries it numbered; using {highest}")
        seq = highest

    missing = [k for k in FIELDS if k not in data]
    if missing:
        problems.add("no " + ", ".join(repr(k) for k in missing))
    for key in sorted(set(data) - set(FIELDS) - set(LATER_FIELDS)):
        problems.add(f"unknown key {_show(key)}")
    saved = SavedState(
        holders=holders,
        preempted=preempted,
        held=lists["held"],
        finished=lists["finished"],
        failed=lists["failed"],
        seq=seq,
        suspended=suspended,
        frozen_for=frozen_for,
        started=started,
        thaw_owed=thaw_owed,
        terms=terms,
        requeued=requeued,
        wait_failed=wait_failed,
        stopped_by_shutdown=lists["stopped_by_shutdown"],
        refills=refills,
        checkpointed=checkpointed,
        remained=remained,
    )
    return saved, boot_id


def same_boot(saved: str, current: str) -> bool:
    """Whether a state saved in boot `saved` was saved in this one, `current`: both as
    `Systemd.boot_id` tells a boot (the kernel's boot id and when systemd started: a
    container restarted without its host keeps the first and changes the second). The one
    judgment of the controller at its start (holders and suspended units of another boot
    ran no process in this one) and of `gpuslice release-jobs` (nothing of another boot is
    thawed or resumed: a unit of that name now is someone else's). A file without a boot
    ("": an empty or moved-aside state) is of no boot."""
    return bool(saved) and saved == current


def record_boot(record: Path, boot_id: str) -> bool:
    """Record this boot as the controller tells it (paths.BOOT_RECORD), replaced at once, as
    config.pin_runtime_dir records the runtime_dir: a restart writes the same. False, and
    nothing written, when the record's directory does not exist: not started by
    gpuslice.service, whose RuntimeDirectory= makes it. OSError when it cannot be written."""
    if not record.parent.is_dir():
        return False
    write_durably(record, f"{boot_id}\n".encode())
    return True


def read_recorded_boot(record: Path) -> str | None:
    """This boot as a controller of this boot told it (record_boot); None when none recorded
    it (no controller ran this boot, or one of a gpuslice without the record), or what is
    there is no record of its: a link or no regular file (never followed or opened), not the
    reader's own (root's: only root writes there) or writable by others, longer than a boot
    id (`state.validate`'s bound), or not one line of printable ASCII."""
    try:
        data, st = safefile.read_with_stat(record, BOOT_ID_MAX + 1, follow_links=False)
    except safefile.Unreadable:
        return None
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    if not data.endswith(b"\n"):
        return None
    boot = data[:-1].decode("ascii", "replace")
    return boot if boot and boot.isascii() and boot.isprintable() else None


def _terms_problem(name: str, entry: object) -> str:
    """Why a terms entry is invalid ("" when it is valid): what a unit whose annotation
    went is judged by must be what an annotation could have said."""
    if not _is_unit(name):
        return "not a unit name"
    if not isinstance(entry, list) or len(entry) != 4:
        return "expected [priority, kind, GPUs, memory]"
    priority, kind, gpus, memory = entry
    if not _is_int(priority, 0, PRIORITY_MAX):
        return f"priority {_show(priority)} is not an integer 0-{PRIORITY_MAX}"
    if kind not in KINDS:
        return f"kind {_show(kind)} is not one of {', '.join(KINDS)}"
    if not _is_int(gpus, 1, GPU_INDEX_MAX + 1):
        return f"GPUs {_show(gpus)} is not an integer 1-{GPU_INDEX_MAX + 1}"
    if memory is not None and not _is_int(memory, 1, SIZE_MAX):
        return f"memory {_show(memory)} is neither null nor 1-{SIZE_MAX} bytes"
    return ""


def _suspended_problem(name: str, entry: object) -> str:
    """Why a suspended entry is invalid ("" when it is valid)."""
    if not _is_unit(name):
        return "not a unit name"
    if not isinstance(entry, list) or len(entry) != 2:
        return "expected [GPUs, seq]"
    gpus, seq = entry
    if not isinstance(gpus, list) or not all(_is_int(g, 0, GPU_INDEX_MAX) for g in gpus):
        return f"GPUs must be a list of indices 0-{GPU_INDEX_MAX}"
    if not gpus or len(set(gpus)) != len(gpus):
        return "no GPU, or a GPU listed twice"
    if not _is_int(seq, 0, SEQ_MAX):
        return f"seq {_show(seq)}"
    return ""


def _checkpointed_problem(entry: object) -> str:
    """Why a checkpointed entry is invalid ("" when it is valid): root runs cuda-checkpoint
    on each PID (those still the unit's processes: Ladder._still_its_own)."""
    if not isinstance(entry, list) or len(entry) != 3:
        return "expected [PIDs, bytes, time]"
    pids, vram, wall = entry
    if not isinstance(pids, list) or not all(_is_int(p, 1, PID_MAX) for p in pids):
        return f"PIDs must be a list of integers 1-{PID_MAX}"
    if not pids or len(set(pids)) != len(pids):
        return "no PID, or a PID listed twice"
    if not _is_int(vram, 0, SIZE_MAX):
        return f"bytes {_show(vram)} is not an integer 0-{SIZE_MAX}"
    # float(10**400) would raise: an integer is bounded first
    finite = type(wall) is float and math.isfinite(wall) and wall >= 0
    if not (finite or _is_int(wall, 0, SEQ_MAX)):
        return f"time {_show(wall)} is no time"
    return ""


def _holder_problem(name: str, entry: object) -> str:
    """Why a holders entry is invalid ("" when it is valid)."""
    if not _is_unit(name):
        return "not a unit name"
    if not isinstance(entry, list) or len(entry) not in (3, 4):
        return "expected [GPUs, phase, seq, stopping_for]"
    gpus, phase, seq, *rest = entry
    if not isinstance(gpus, list) or not all(_is_int(g, 0, GPU_INDEX_MAX) for g in gpus):
        return f"GPUs must be a list of indices 0-{GPU_INDEX_MAX}"
    if len(set(gpus)) != len(gpus):
        return "a GPU listed twice"
    if phase not in PHASES:
        return f"phase {_show(phase)} is not one of {', '.join(PHASES)}"
    if not _is_int(seq, 0, SEQ_MAX):
        return f"seq {_show(seq)}"
    if rest and rest[0] != "" and not _is_unit(rest[0]):
        return f"stopping for {_show(rest[0])}, not a unit name"
    return ""


# Every file of the state written whole (safefile.write_atomic: a temporary file of the
# writer's own, renamed; no fsync, StateStore.flush follows off the loop); a name of this
# module's, for the tests that stand in for it.
_write_atomic = safefile.write_atomic


def write_durably(path: Path, data: bytes) -> None:
    """`_write_atomic`, then on disk before this returns (`_flush`): for a file written once
    in a while, such as the records of the state_dir and runtime_dir in use (config.py). The
    temporary files of its writers killed mid-write go first (`safefile.remove_stale`): once
    a write, it costs little."""
    safefile.remove_stale(path)
    _write_atomic(path, data)
    _flush(path)


def _flush(path: Path) -> None:
    """Make `path` durable: its data, then the directory entry a rename changed. Blocks on the
    disk. A file not there is nothing to flush."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _sync_directory(path.parent)


def _sync_directory(directory: Path) -> None:
    """Make the entries a rename or a link changed in `directory` durable."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _write_new(path: Path, data: bytes) -> None:
    """`_write_atomic`, making the directory the first time (made once, not at every save)."""
    try:
        _write_atomic(path, data)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, data)


def saved_fields(saved: SavedState) -> dict[str, Any]:
    """The saved state's fields as json.dumps takes them. Not `dataclasses.asdict`, which
    deep-copies every container (30 of a save's ~50 us at a handover, issue 10): the
    scheduler builds a fresh SavedState for each save, and json writes a tuple as a list,
    as asdict's copy would have been written."""
    return {f.name: getattr(saved, f.name) for f in fields(saved)}


def saved_in(configured: Path, recorded: Path) -> Path:
    """The state_dir whose state a stopped controller left: `recorded` (paths.STATE_DIR_RECORD,
    where it last ran) while its state file is there and not saved after `configured`'s
    (config.yaml's state_dir, where its next start moves it: StateStore.take_over)."""
    return find_saved(configured, recorded)[0]


def find_saved(configured: Path, recorded: Path) -> tuple[Path, Found | None]:
    """`saved_in`, and its state file as read to choose it (None: none was read): a
    StateStore's `read_ahead`, for `load` to load without reading it again. A torn one is
    ranked, and read, as the copy its last flush kept (`_read_or_prev`)."""
    found, saved = recorded / STATE_FILE_NAME, configured / STATE_FILE_NAME
    # a look first: with one of them not there, the other is chosen unread (its store reads
    # it); their times are read with their bytes, below
    try:
        os.lstat(found)
    except OSError:
        return configured, None
    try:
        os.lstat(saved)
    except OSError:
        return recorded, None
    theirs, mine = _read_or_prev(found), _read_or_prev(saved)
    # one gone since the look (removed, or moved to the other by root): the other, never an
    # empty directory chosen over a file that is there
    if theirs.mtime_ns is None:
        return configured, mine
    if mine.mtime_ns is None:
        return recorded, theirs
    return (configured, mine) if mine.rank() > theirs.rank() else (recorded, theirs)


def _prev_of(path: Path) -> Path:
    """The copy of the state file at `path` as the last flush made it durable (`flush`): for
    when it is found torn."""
    return path.with_name(f"{path.name}.prev")


def _bad_of(path: Path) -> Path:
    """Where the state file at `path` is set aside when it cannot be loaded."""
    return path.with_name(f"{path.name}.bad")


def _read_or_prev(path: Path, mine: Found | None = None) -> Found:
    """The state file at `path` (`mine` when already read, else `read_found`), or when it is
    there and unusable (a power cut's empty file, torn, bad in any other way, or unreadable)
    the copy its last flush kept (`_prev_of`), when that is there and usable itself
    (`read_found`: owner, mode, format; its entries are validated as the state file's are):
    the torn file is set aside (`_bad_of`) and the copy put in its place (each by a link
    renamed over the other: the state file is always the torn one or the copy), and loaded
    as the state file. `find_saved` and `StateStore.take_over` rank and move it so too: a
    torn file was generation 0, so an older file in the other state_dir won over it; moved,
    it went without its copy (removed), and was loaded torn."""
    if mine is None:
        mine = read_found(path)
    gone = (FileNotFoundError, NotADirectoryError)
    if mine.error is None or isinstance(mine.error, gone):
        return mine
    prev_path, bad_path = _prev_of(path), _bad_of(path)
    prev = read_found(prev_path)
    if prev.error is not None:
        if not isinstance(prev.error, gone):
            why = prev.error.strerror if isinstance(prev.error, OSError) else prev.error
            log.error("%s: %s; not used in place of %s", prev_path, why, path)
        return mine
    try:
        safefile.link_atomic(path, bad_path)
    except OSError:  # no file to link (a directory): moved, as a bad file is
        aside = _move_aside(path)
    else:
        aside = f"kept it as {bad_path}"
    try:
        safefile.link_atomic(prev_path, path)
    except OSError as e:  # loaded all the same: the next save writes it there
        aside += f"; could not put the copy in its place ({e.strerror or e})"
    why = mine.error.strerror if isinstance(mine.error, OSError) else mine.error
    log.error(
        "%s: %s (a power cut just after a save?); %s; loading %s, the state as its last "
        "flush made it durable: the decisions of the second before may be lost",
        path,
        why,
        aside,
        prev_path,
    )
    return replace(prev, path=path)


def _move_aside(path: Path) -> str:
    """Set the state file at `path` aside (`_bad_of`); what was done, as said in a log line."""
    bad_path = _bad_of(path)
    try:
        os.replace(path, bad_path)
    except OSError as e:
        return f"could not move it to {bad_path} ({e.strerror or e})"
    return f"moved it to {bad_path}"


class StateStore:
    def __init__(self, state_dir: Path, runtime_dir: Path | None = None) -> None:
        self.path = state_dir / STATE_FILE_NAME
        self.bad_path = _bad_of(self.path)
        self.prev_path = _prev_of(self.path)
        # where the state goes while state_dir cannot be written; none in the same directory
        self.standin: Path | None = None
        if runtime_dir is not None and os.path.abspath(runtime_dir) != os.path.abspath(state_dir):
            self.standin = runtime_dir / STATE_FILE_NAME
        self.failure: OSError | None = None  # why the last save went to the stand-in
        self._standin_left = self.standin is not None  # a stand-in may exist: removed once
        # the highest save generation seen in a file (load, take_over) or written: the next
        # save writes one more, so that it is the later saved of any two files, whatever
        # the clock said
        self.generation = 0
        # the state file to load as already read: by take_over (here, or in the old
        # state_dir when it could not be moved here), or find_saved; load reads it no
        # second time (a Found of another path is not used)
        self.read_ahead: Found | None = None

    def load(self) -> tuple[SavedState, str]:
        """The saved state and the boot id it was written in ("" when there is none). The
        state file is read here unless `read_ahead` holds it (take_over, find_saved): each
        file is read once.

        Never raises: whatever the file holds, the controller must start."""
        try:
            self._remove_stale()
            found, self.read_ahead = self.read_ahead, None
            mine = found if found is not None and found.path == self.path else None
            mine = _read_or_prev(self.path, mine)
            standin = self._load_standin(mine)
            if standin is not None:
                return standin
            return self._load(mine)
        except Exception:  # a bug here must not keep every GPU job waiting: log it, go on
            log.exception(
                "%s: cannot load the state; starting from what systemd reports", self.path
            )
            return SavedState(), ""

    def _remove_stale(self) -> None:
        """Remove the temporary files of saves killed mid-write (`safefile.remove_stale`),
        once a load: at each start of the controller or of release-jobs, not at every save,
        which comes before each StartUnit and StopUnit the controller sends."""
        for path in (self.path, self.bad_path, self.prev_path, self.standin):
            if path is not None:
                safefile.remove_stale(path)

    def _load(self, mine: Found) -> tuple[SavedState, str]:
        """The state in the state file, as read once (`mine`)."""
        problems = mine.problems
        try:
            raw, data = mine.parsed()
        except FileNotFoundError:
            return SavedState(), ""
        except BadFile as e:
            log.error(
                "%s: %s; %s; starting from what systemd reports",
                self.path,
                e,
                _move_aside(self.path),
            )
            return SavedState(), ""
        except OSError as e:  # EIO, EACCES: the content may be fine, and the next save()
            # replaced it: its units preempted and owed a restart were lost for good; moved
            # aside (a rename reads nothing), it is there for an admin to look at
            log.error(
                "%s: cannot read the state (%s); %s; starting from what systemd reports",
                self.path,
                e.strerror or e,
                _move_aside(self.path),
            )
            return SavedState(), ""
        self._seen(data)
        saved, boot_id = validate(data, problems)
        if problems and saved == SavedState():
            boot_id = ""  # the file is moved aside: nothing was written in that boot
        if problems:
            start = "the valid ones and " if saved != SavedState() else ""
            log.error(
                "%s: invalid entries (%s); %s; starting from %swhat systemd reports",
                self.path,
                problems,
                self._keep_valid(raw, saved, boot_id),
                start,
            )
        return saved, boot_id

    def take_over(self, old_dir: Path) -> bool:
        """Move here the state file of `old_dir`, the state_dir the controller last ran with:
        state_dir was edited in config.yaml since. Read from here alone (empty), the state was
        lost: units preempted and owed a restart never started again, suspended ones stayed
        frozen with their memory on the host.

        The later saved of the two files is kept (`Found.rank`: by their save generation;
        a file moved keeps its modification time too, as `mv` does, for a file of an older
        gpuslice, and the stand-in is judged against it). The other is removed once
        the kept one is on disk: left, it would be read again if state_dir came back to that
        directory without the record, and its units restarted long after. A file that cannot
        be moved is said and left there. True when the state to load is here; False when
        the one in `old_dir` is the newer but could not be written here: load it there.
        Each file is read once: the one to load is left in `read_ahead` for `load`. One gone
        between the look at it and its read was never there: the state here is loaded; one
        gone after it, before the move, is loaded as read."""
        self.read_ahead = None
        old = old_dir / self.path.name
        if os.path.abspath(old) == os.path.abspath(self.path):
            return True
        try:
            found = os.lstat(old)
        except (FileNotFoundError, NotADirectoryError):
            return True  # never saved there, or moved already
        except OSError as e:
            log.error("%s: cannot look at it (%s); left there, starting from %s", old, e, self.path)
            return True
        if not stat.S_ISREG(found.st_mode):
            log.error("%s: not a regular file; left there, not moved to %s", old, self.path)
            return True
        try:
            here = os.lstat(self.path)
        except OSError:  # none yet, or none to look at (EIO): the move replaces it
            mine = None
        else:
            if (here.st_dev, here.st_ino) == (found.st_dev, found.st_ino):
                return True  # one directory by two names (a link): nothing to move
            mine = _read_or_prev(self.path)
        theirs = _read_or_prev(old)
        if theirs.mtime_ns is None:  # gone since the look (removed, or moved here by root):
            # chosen again, as if never there; load reads what is here now (the read above
            # may be of a file it replaced), never the old state_dir, empty
            why = theirs.error.strerror if isinstance(theirs.error, OSError) else theirs.error
            log.warning("%s: not there to read (%s); starting from %s", old, why, self.path)
            return True
        # whichever is kept, the next save is numbered after both (after the one left in
        # old_dir when the move fails too)
        self.generation = max(
            self.generation, theirs.rank()[0], 0 if mine is None else mine.rank()[0]
        )
        if mine is not None and mine.rank() > theirs.rank():
            log.warning(
                "%s: older than %s, saved since, which holds the state; removed", old, self.path
            )
            self._remove_moved(old)
            self._remove_moved(old_dir / self.prev_path.name)
            self.read_ahead = mine
            return True
        try:
            self._move_here(theirs)
        except BadFile as e:
            log.error("%s: cannot move it to %s (%s); left there", old, self.path, e)
            self.read_ahead = mine
            return True
        except OSError as e:
            log.error(
                "cannot move the state from %s to %s (%s); read from %s, saved to %s",
                old,
                self.path,
                e.strerror or e,
                old,
                self.path,
            )
            self.read_ahead = theirs
            return False
        # its last copy goes with it: left, a torn state file there later took it up
        self._remove_moved(old_dir / self.prev_path.name)
        # the file here now is the one read there (renamed, or copied with its time)
        self.read_ahead = replace(theirs, path=self.path)
        if mine is None:
            log.info("state moved from %s to %s", old, self.path)
        else:
            log.warning("state moved from %s to %s, replacing an older state there", old, self.path)
        return True

    def _move_here(self, theirs: Found) -> None:
        """rename(2) on one file system: atomic, and the file keeps the time it was saved at.
        Across two, a copy of the bytes read (`theirs`) given that time, on disk before the
        old one is removed."""
        old = theirs.path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(old, self.path)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            if theirs.raw is None:  # not read: its error, as a read now would say
                assert theirs.error is not None
                raise theirs.error from None
            _write_new(self.path, theirs.raw)
            saved_ns = theirs.mtime_ns or 0
            os.utime(self.path, ns=(saved_ns, saved_ns), follow_symlinks=False)
            if self._flushed():
                self._remove_moved(old)
        else:
            self._flushed()

    def _flushed(self) -> bool:
        """`flush()`; False, said, when the disk failed it (the file is there all the same)."""
        try:
            self.flush()
        except OSError as e:
            log.error("cannot flush %s to disk (%s): a power cut may lose it", self.path, e)
            return False
        return True

    def _remove_moved(self, old: Path) -> None:
        try:
            os.unlink(old)
        except FileNotFoundError:
            pass
        except OSError as e:  # the record names the new one: this one is not read again
            log.error("cannot remove %s: %s", old, e.strerror or e)

    def _load_standin(self, mine: Found) -> tuple[SavedState, str] | None:
        """The stand-in's state when it is there, valid and not saved before the state file
        (`mine`, as read once for `_load` too; `Found.rank`: the stand-in's generation is
        read from it, so a stand-in that cannot be parsed is said as an invalid one). One
        saved before it is the trace of a controller killed between a save that reached
        state_dir again and the stand-in's removal; an invalid one is removed (it is ours,
        in a directory only root writes, and the state file is the better guess)."""
        if self.standin is None:
            return None
        try:
            os.lstat(self.standin)  # a look first: most starts have none, and read nothing
        except OSError as e:
            gone: BadFile | OSError | None = e
        else:  # its time is read with its bytes: None, it went since the look
            standin = read_found(self.standin)
            gone = standin.error if standin.mtime_ns is None else None
        if isinstance(gone, (FileNotFoundError, NotADirectoryError)):
            self._standin_left = False
            return None
        if gone is not None:
            log.error("%s: cannot look at the stand-in (%s); not used", self.standin, gone)
            return None
        problems = standin.problems
        try:
            data = standin.parsed()[1]
        except (BadFile, OSError) as e:
            problems.add(str(e))
        else:
            if mine.mtime_ns is not None:  # a state file is there (else the stand-in is kept)
                self.generation = max(self.generation, mine.rank()[0])
                if mine.rank() > standin.rank():
                    log.info("%s: older than %s; removed", self.standin, self.path)
                    self._remove_standin()
                    return None
            saved, boot_id = validate(data, problems)
        if problems:
            log.error("%s: %s; removed, using %s", self.standin, problems, self.path)
            self._remove_standin()
            return None
        self._seen(data)
        log.warning(
            "%s: the state saved while %s could not be written (newer than it); "
            "it goes back there at the next save",
            self.standin,
            self.path,
        )
        return saved, boot_id

    def _remove_standin(self) -> None:
        assert self.standin is not None
        try:
            os.unlink(self.standin)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:  # kept for the next save to try again (load prefers the newer)
            log.error("cannot remove %s: %s", self.standin, e)
            return
        self._standin_left = False

    def _seen(self, data: dict[str, Any]) -> None:
        """Number the next save after the file `data` was parsed from (`parse` checked it)."""
        self.generation = max(self.generation, int(data.get("generation", 0)))

    def _keep_valid(self, raw: bytes, saved: SavedState, boot_id: str) -> str:
        """Copy the original aside, then replace it with its valid entries: at every moment
        state.json is either the original or the cleaned file."""
        if saved == SavedState():
            return _move_aside(self.path)
        try:
            _write_atomic(self.bad_path, raw)
        except OSError as e:
            return f"could not copy it to {self.bad_path} ({e.strerror or e}); left it as it is"
        try:
            where = self.save(saved, boot_id)
        except OSError as e:
            return f"copied it to {self.bad_path}; could not rewrite it ({e.strerror or e})"
        if where != self.path:
            return f"copied it to {self.bad_path}; kept the valid entries in {where}"
        return f"copied it to {self.bad_path} and kept the valid entries"

    def save(self, saved: SavedState, boot_id: str) -> Path:
        """Write the state atomically; where it went: the state file, or the stand-in when
        the state file cannot be written (`failure` says why). An OSError reaches the caller
        (the controller logs it) when neither can be written."""
        # one more than any seen, whichever file it goes to (at the bound: as high as that)
        self.generation = min(self.generation + 1, GENERATION_MAX)
        self.read_ahead = None  # a file read before this save is no longer the one to load
        data = {
            "version": FORMAT_VERSION,
            "boot_id": boot_id,
            "generation": self.generation,
            **saved_fields(saved),
        }
        text = json.dumps(data, sort_keys=True, allow_nan=False).encode()
        try:
            _write_new(self.path, text)
        except OSError as e:
            if self.standin is None:
                raise
            try:
                _write_new(self.standin, text)
            except OSError:
                raise e from None
            self.failure = e
            self._standin_left = True
            return self.standin
        self.failure = None
        if self._standin_left:
            self._remove_standin()
        return self.path

    def saved_since(self) -> str | None:
        """Why the state on disk may not be what this store last loaded or saved ("" when it
        is): a state file or stand-in numbered beyond `generation` (another writer saved
        since: a controller started meanwhile), or one that cannot be read or parsed now.
        None when neither is there: nothing to replace. Read anew, for a writer that is not
        the controller (`gpuslice release-jobs`): no lock is shared with the controller, so
        its save between this look and a save of ours is not seen."""
        files = [self.path] if self.standin is None else [self.path, self.standin]
        gone = (FileNotFoundError, NotADirectoryError)
        there = [f for f in map(read_found, files) if not isinstance(f.error, gone)]
        if not there:
            return None
        for f in there:
            if isinstance(f.error, OSError):
                return f"{f.path}: {f.error.strerror or f.error}"
            if f.error is not None:
                return f"{f.path}: {f.error}"
            if f.rank()[0] > self.generation:
                return f"{f.path} was saved again since it was read"
        return ""

    def flush(self) -> None:
        """Make the last save durable, and keep it as `prev_path` (see the module's words):
        the file is linked there, synced, renamed over the last copy, then the directory is
        synced. The file linked is the one synced, whatever save the loop made meanwhile: the
        copy is always a durable file. Blocks on the disk: the controller calls it on a
        worker thread. A state file not there (never saved) is nothing to flush. No copy can
        be kept (a file system without hard links): the file is flushed all the same, and
        the OSError says why no copy is there."""
        try:
            safefile.link_atomic(self.path, self.prev_path, sync=True)
        except FileNotFoundError:
            return
        except OSError as e:
            _flush(self.path)
            raise OSError(e.errno, f"{self.prev_path} not kept: {e.strerror or e}") from None
        _sync_directory(self.path.parent)


class Flusher:
    """Calls `store.flush()` on a daemon thread at most once per `delay`, after saves.

    A thread of its own, not the loop's executor: a disk that hangs an fsync then holds
    one thread, never the loop, the watchdog or the controller's exit. A save made while a
    flush runs is flushed by the next one; each flush's outcome (None or its OSError) goes
    to `flushed`, on the loop."""

    def __init__(
        self, store: StateStore, delay: float, flushed: Callable[[OSError | None], None]
    ) -> None:
        self.store = store
        self.delay = delay
        self.flushed = flushed
        self._due = False  # a flush is scheduled or running
        self._dirty = False  # saved since the running flush began

    def saved(self, loop: asyncio.AbstractEventLoop) -> None:
        self._dirty = True
        if not self._due:
            self._due = True
            loop.call_later(self.delay, self._begin, loop)

    def _begin(self, loop: asyncio.AbstractEventLoop) -> None:
        self._dirty = False
        thread = threading.Thread(target=self._work, args=(loop,), name="state-flush", daemon=True)
        try:
            thread.start()
        except RuntimeError as e:  # no thread to be had (TasksMax=, memory): tried again
            self._dirty = True
            self._done(loop, OSError(errno.EAGAIN, f"cannot start a thread to flush: {e}"))

    def _work(self, loop: asyncio.AbstractEventLoop) -> None:
        error: OSError | None = None
        try:
            self.store.flush()
        except OSError as e:
            error = e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing to tell
            loop.call_soon_threadsafe(self._done, loop, error)

    def _done(self, loop: asyncio.AbstractEventLoop, error: OSError | None) -> None:
        self._due = False
        self.flushed(error)
        if self._dirty:
            self.saved(loop)
