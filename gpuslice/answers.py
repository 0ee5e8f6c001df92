"""Answering the readers of status: Status over D-Bus, each caller as /proc would, and STATUS=.

Anyone may ask for the status, as often as they like, so the answer is built once per change
(gpuslice/status.py: CachedStatus), the redacted one alike, and the counters, which move
without a change of state, are added at each call. Where /proc hides other users'
processes, a caller sees them only when /proc shows them to it (root, the mount's gid=
group); else its own processes and no one else's (RedactedStatus). Anyone but root reads
the problems without what only root may read, an environment file's values (FullStatus).
Who a caller is, the bus daemon says, asked once per unique bus name (gpuslice/callers.py).

The controller decides and wires: it says when the state changed (`changed`) and when to
read /proc's mount again (`read_proc_mount`); this module reads what it shows through the
callables it was given, each when an answer is built.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, Protocol

from gpuslice import __version__
from gpuslice.annotations import Scan
from gpuslice.callers import Credentials, KnownCallers
from gpuslice.core.scheduler import HOLDER_STATES, Snapshot
from gpuslice.counters import Counters
from gpuslice.inventory import Sample
from gpuslice.procmount import ProcHiding, read_proc_hiding, sees_every_process
from gpuslice.status import (
    CachedStatus,
    FullStatus,
    RedactedStatus,
    problems_json,
    snapshot_to_json,
)

log = logging.getLogger("gpuslice")

# Characters of running units' names STATUS= lists; the rest are counted ("and 37 more").
# sd_notify is one datagram, and systemd ignores one past 4,096 bytes whole
# (NOTIFY_BUFFER_MAX): with 16 running units of 255-character names, or ~80 of 50 sharing
# GPUs, the line was missing from `systemctl status gpuslice`, and at start-up so was the
# READY=1 sent with it: the controller was killed at TimeoutStartSec and restarted into the
# same line, again and again.
STATUS_NAMES_MAX = 1024
# The order STATUS= names holders in, by what they are doing (StatusAnswers.status_line).
_LINE_PHASES = HOLDER_STATES


class Core(Protocol):
    """What the answers read of the scheduling state (gpuslice.core.scheduler.Scheduler)."""

    def snapshot(self, *, reasons: bool = True) -> Snapshot: ...

    def declared_memory(self) -> dict[str, int]: ...


class StatusAnswers:
    """The status as each reader is to see it: built once per change, counters added."""

    def __init__(
        self,
        core: Core,
        *,
        scan: Callable[[], Scan],
        sample: Callable[[], Sample],
        waiting_since: Callable[[], Mapping[str, float]],
        suspensions: Callable[[], Mapping[str, tuple[int, float]]],
        restart_since: Callable[[], Mapping[str, float]] = lambda: {},
        counters: Counters,
        adapter_counts: Callable[[], Iterable[tuple[str, int]]],
        started: Callable[[], float],
        credentials: Callable[[str], Awaitable[Credentials]],
        read_hiding: Callable[[], ProcHiding] = read_proc_hiding,
        sees_all: Callable[[], bool] = sees_every_process,
    ) -> None:
        """`waiting_since`: Unix time each waiter started waiting; `suspensions`: the bytes
        each suspended unit moved to host memory, and when (Unix time); `restart_since`:
        Unix time the GPUs of each unit kept for its Restart= began to be; `adapter_counts`:
        the counters the adapters keep (status's "counters" keys); `started`: Unix time the
        controller started, as the wall clock tells it now (clock.unix_time: a clock step
        since moves it too); `credentials`: the bus daemon's word on a unique bus name."""
        self.core = core
        self._scan = scan
        self._sample = sample
        self._waiting_since = waiting_since
        self._suspensions = suspensions
        self._restart_since = restart_since
        self.counters = counters
        self._adapter_counts = adapter_counts
        self.started = started
        self._credentials = credentials
        self._read_hiding = read_hiding
        self._sees_all = sees_all
        self._blind = False  # whether /proc hides other users' processes from us too
        # whether /proc hides other users' processes, read at start and at each reload:
        # Status then hides them from callers /proc hides them from (status_for)
        self.proc_hiding = ProcHiding()
        # who each unique bus name that called Status is, as the bus daemon said
        self.callers = KnownCallers()
        self._status = CachedStatus(self._status_snapshot)
        self._redacted = self._status.variant(self._redacted_snapshot)

    def changed(self) -> None:
        """The state the answers show changed: each is built anew when next asked for."""
        self._status.changed()

    def read_proc_mount(self) -> None:
        """Whether /proc hides other users' processes now (said when it changes)."""
        hiding = self._read_hiding()
        if hiding != self.proc_hiding:
            if hiding.hides:
                group = f", or of group {hiding.gid}" if hiding.gid is not None else ""
                log.info(
                    "/proc hides other users' processes (%s): Status shows them only to "
                    "callers that are root%s",
                    hiding.said,
                    group,
                )
            elif self.proc_hiding.hides:
                log.info("/proc no longer hides other users' processes: Status shows them all")
        self.proc_hiding = hiding
        blind = hiding.hides and not self._sees_all()
        if blind and not self._blind:
            # the jobs' and other users' GPU processes taken for gone: not counted, not
            # attributed, never yielded to
            remedy = (
                f"give it the mount's group: `systemctl edit gpuslice`, [Service] "
                f"SupplementaryGroups={hiding.gid}, then restart it"
                if hiding.gid is not None
                else "mount /proc with hidepid=invisible,gid=GROUP and give it that group "
                "(SupplementaryGroups=)"
            )
            log.error(
                "/proc hides other users' processes from the controller too (%s): it cannot "
                "see the processes on the GPUs, whose unit or owner they are, nor their "
                "memory; %s",
                hiding.said,
                remedy,
            )
        self._blind = blind

    def status_line(self) -> str:
        """`N GPUs: a.service running; b.service stopping; 1 waiting`: the holders by what
        they are doing (a victim being stopped, a unit frozen beside a more urgent one, once
        all said "running" for as long as that lasted, hours for a frozen one), names up to
        STATUS_NAMES_MAX characters and the rest counted."""
        snap = self.core.snapshot(reasons=False)
        count = len(snap.gpus)
        phase_of = {name: phase for holders in snap.gpus.values() for name, _, phase in holders}
        order = {phase: i for i, phase in enumerate(_LINE_PHASES)}
        names = sorted(phase_of, key=lambda n: (order.get(phase_of[n], len(order)), n))
        shown: list[str] = []
        length = 0  # of the names shown, with their separators
        for name in names:
            length += len(name) + 2
            if shown and length > STATUS_NAMES_MAX:
                break
            shown.append(name)
        groups: dict[str, list[str]] = {}
        for name in shown:
            groups.setdefault(phase_of[name], []).append(name)
        unshown: dict[str, int] = {}
        for name in names[len(shown) :]:
            unshown[phase_of[name]] = unshown.get(phase_of[name], 0) + 1
        parts = []
        for phase, group in groups.items():  # only the last one's may go on unshown
            more = unshown.pop(phase, 0)
            parts.append(", ".join(group) + (f" and {more} more" if more else "") + f" {phase}")
        parts += [f"{n} more {phase}" for phase, n in unshown.items()]
        what = "; ".join(parts) if parts else "idle"
        return f"{count} GPU{'s' if count != 1 else ''}: {what}; {len(snap.waiting)} waiting"

    def status_json(
        self, redacted: bool = False, uid: int | None = None, public: bool = False
    ) -> str:
        """Anyone may ask, as often as they like: the answer is built once per change, and a
        slow one less often (gpuslice/status.py: CachedStatus); `redacted`, without what
        /proc hides from other users (status_for), cached alike, but the processes of `uid`
        (RedactedStatus: the caller's own); `public` (implied by `redacted`), without what
        only root may read in its problems (FullStatus: an environment file's values)."""
        if redacted:
            cached, as_of = self._redacted.text().text_for(uid), self._redacted.as_of
        else:
            full = self._status.text()
            cached, as_of = (full.public if public else full.text), self._status.as_of
        # the counters move without a change of state: added at each call (a few hundred
        # bytes) to the cached snapshot's object, whose last character is its closing brace
        extra = json.dumps(self.status_counters(as_of), sort_keys=True)
        return f"{cached[:-1]}, {extra[1:]}"

    def status_for(self, sender: str) -> str | Coroutine[Any, Any, str]:
        """The Status answer for the caller of this unique bus name: where /proc hides other
        users' processes, without them (but the caller's own: RedactedStatus) unless /proc
        shows them to it (root, the mount's gid= group), and to anyone but root without what
        only root may read in the problems (FullStatus.public), as the bus daemon says who
        it is, asked once per unique name (gpuslice/callers.py). Now (a string) where /proc
        hides none and no problem withholds anything, and for a caller named before; else
        once the bus daemon has answered."""
        if not self.proc_hiding.hides and not self._status.text().withholds:
            return self.status_json()
        known = self.callers.get(sender)  # asked before (gpuslice/callers.py)
        if known is not None:
            return self._status_of(*known)
        return self._status_for_caller(sender)

    async def _status_for_caller(self, sender: str) -> str:
        try:
            uid, groups = await self._credentials(sender)
        except Exception as e:  # not said who it is: hidden from it (fail closed), not kept
            log.debug("Status from %s, whom the bus daemon did not name: %s", sender, e)
            return self._status_of(None, frozenset())
        self.callers.put(sender, (uid, groups))
        return self._status_of(uid, groups)

    def _status_of(self, uid: int | None, groups: frozenset[int]) -> str:
        """The answer for a caller of this UID and these groups (as of /proc's mount now)."""
        if self.proc_hiding.exempts(uid, groups):
            return self.status_json(public=uid != 0)
        return self.status_json(redacted=True, uid=uid)

    def _status_snapshot(self) -> FullStatus:
        scan = self._scan()  # the one it is built of, read once
        data = self._snapshot_json(scan, self._sample(), False)
        return FullStatus(data, problems_json(scan, public=True))

    def _redacted_snapshot(self) -> RedactedStatus:
        sample = self._sample()  # the one it is built of, read once
        return RedactedStatus(self._snapshot_json(self._scan(), sample, True), sample)

    def _snapshot_json(self, scan: Scan, sample: Sample, redact: bool) -> dict[str, Any]:
        return snapshot_to_json(
            self.core.snapshot(),
            scan,
            sample,
            self._waiting_since(),
            self._suspensions(),
            self.core.declared_memory(),
            redact,
            self._restart_since(),
        )

    def status_counters(self, as_of: float) -> dict[str, Any]:
        """The status keys that count since the controller started (gpuslice/status.py);
        `as_of`: the Unix time of the state the answer shows (each cached text has its own)."""
        return {
            "admission_wait_seconds": self.counters.admission_wait.to_json(),
            "controller": {
                "version": __version__,
                "start_time": self.started(),
                "status_time": as_of,
            },
            "counters": self.counters.to_json(self._adapter_counts()),
        }
