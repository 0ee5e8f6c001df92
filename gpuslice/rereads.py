"""Reads of units' states that take in what systemd's signals did not say.

Systemd's PropertiesChanged signals are the controller's view of every unit (the tracker).
Three cases need a read instead:
- a job that changed nothing sends no PropertiesChanged: the unit is read REFRESH_DELAY after
  its JobRemoved, unless systemd said more of it meanwhile (`job_ended`);
- an answer of systemd's or a re-match may have outrun a change: read at once (`refresh`);
- the bus daemon drops signals for a connection whose queue is full, and says nothing: every
  AUDIT_INTERVAL the units the core knows are read in one call (`audit`), and the bus daemon
  is asked who owns systemd's name (its NameOwnerChanged is a signal too: Systemd.check_owner);
  a gate that waits on its pipe for a start no signal told is woken (`wake_unheard`).
A read is never taken in over a later word of systemd's (`read_fresh`). And because systemd
holds its PropertiesChanged back while its own bus queue is long but answers a read at once, a
read that shows a change is first taken for a signal on its way: it is taken in only when a
second look, with nothing heard of the unit between, still shows it (CONFIRM_DELAY after a
job's end; the next audit for the periodic read). Taken in at once, how a unit left running
was lost (one that ended by itself while we stopped it counted as preempted, and its finished
work ran again).

The controller takes what a read says as it takes a signal (`take`), marked as a read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from gpuslice.counters import Counters
from gpuslice.systemd import Systemd, SystemdError
from gpuslice.tracker import Tracker, UnitState

log = logging.getLogger("gpuslice")

# How long after a JobRemoved the unit is read if systemd said nothing more of it meanwhile.
# Read at once, the answer came after the PropertiesChanged that follows a JobRemoved and was
# dropped as stale: a round trip through systemd for nothing at every job's end (issue 10:
# the read of the victim's stop job was answered while systemd forked the waiter's process).
REFRESH_DELAY = 0.02
# How long that read waits for the signal of a change it shows before it is taken in itself.
CONFIRM_DELAY = 0.5
# How often the units the core knows (holders, waiters, suspended) are read in one call.
# Anyone can fill the controller's bus queue with calls or signals while its loop is busy; a
# holder whose end was lost would keep its GPUs, and its waiters wait, for ever.
AUDIT_INTERVAL = 30.0

Spawn = Callable[[Coroutine[Any, Any, None]], None]


class Rereads:
    """`take(unit, props)`: a read taken in, as PropertiesChanged-like props; `known()`: the
    units the core knows, for the periodic read; `spawn`: runs a read as the controller's
    task (its failures logged)."""

    def __init__(
        self,
        systemd: Systemd,
        tracker: Tracker,
        counters: Counters,
        take: Callable[[str, dict[str, Any]], None],
        known: Callable[[], Iterable[str]],
        spawn: Spawn,
        wake_unheard: Callable[[], None] = lambda: None,
        shutdown_over: Callable[[], None] = lambda: None,
        holds_read: Callable[[list[str], bool], None] = lambda units, down: None,
        recheck: Callable[[], None] = lambda: None,
    ) -> None:
        """`wake_unheard`: at each audit, wake the gates that wait where no read of the
        audit's looks (GatePipes.wake_unheard). `recheck`: at each audit too, ask again
        what no signal would tell (Controller._at_audit). `shutdown_over`: an audit
        found the host's shutdown cancelled, which no signal told (`audit_shutdown`).
        `holds_read`: whether the host was going down when these units were held
        (`hold_booked`)."""
        self.systemd = systemd
        self.tracker = tracker
        self.counters = counters
        self.take = take
        self.known = known
        self.spawn = spawn
        self.wake_unheard = wake_unheard
        self.shutdown_over = shutdown_over
        self.holds_read = holds_read
        self.recheck = recheck
        # held since the last SystemState read was sent, each with the tracker's
        # (`shutdown_jobs_heard`, `shutdown_queued`) at its hold
        self._holds: dict[str, tuple[int, int]] = {}
        self._asking = False  # a read for them is under way
        # units a periodic read showed otherwise than their signals: (that state, the stamp of
        # systemd's last word then), taken in if the next read finds the same
        self._suspects: dict[str, tuple[UnitState, int]] = {}

    # -- a job's end --------------------------------------------------------------------------

    def job_ended(self, unit: str) -> None:
        seen = self.tracker.heard(unit)
        asyncio.get_running_loop().call_later(REFRESH_DELAY, self._unheard, unit, seen)

    def _unheard(self, unit: str, seen: int, again: bool = False) -> None:
        """Read a unit whose job ended, unless systemd said more of it since: a job that
        changed the unit is followed by its PropertiesChanged at once."""
        if self.tracker.heard(unit) == seen:
            self.spawn(self.refresh(unit, confirm=not again))

    async def refresh(self, unit: str, *, confirm: bool = False) -> None:
        """Read a unit's state when no signal may come. dbus-next runs signal handlers as
        messages are read but resumes this coroutine later: a reply older than what we know
        is dropped (`read_fresh`). With `confirm`, a change it shows waits CONFIRM_DELAY for
        its signal, and is read again then if none came."""
        state = await self.read_fresh(unit, self.tracker.heard(unit))
        if state is None:
            return
        known = self.tracker.state(unit)
        if confirm and (state.active, state.sub) != (known.active, known.sub):
            self.confirm(unit)
            return
        props = {"ActiveState": state.active, "SubState": state.sub, "Job": (state.job_id, "/")}
        self.take(unit, props)

    def confirm(self, unit: str) -> None:
        """A read showed the unit otherwise than its signals: read again CONFIRM_DELAY later
        and taken in, unless systemd said more of it meanwhile (the signal on its way)."""
        seen = self.tracker.heard(unit)
        asyncio.get_running_loop().call_later(CONFIRM_DELAY, self._unheard, unit, seen, True)

    async def read_fresh(self, unit: str, seen: int) -> UnitState | None:
        """The unit's state read from systemd; None when it cannot be read, or when a signal
        about the unit (or an answer to our call) came after `seen` (then the answer may be
        older than what we know)."""
        try:
            state = await self.systemd.unit_state(unit)
        except SystemdError as e:
            self.counters.error("dbus_call_errors")
            log.debug("cannot read %s: %s", unit, e)
            return None
        return state if self.tracker.heard(unit) == seen else None

    # -- lost signals ---------------------------------------------------------------------------

    def start_audits(self) -> None:
        asyncio.get_running_loop().call_later(AUDIT_INTERVAL, self._audit_due)

    def _audit_due(self) -> None:
        self.spawn(self.audit())

    async def audit(self) -> None:
        """Read every unit the core knows in one call, and take in a state its signals did
        not tell. A unit systemd said anything of since the call was sent is skipped: the
        answer may be older than that. The next audit follows AUDIT_INTERVAL later, unless this
        one was cancelled: a timer set while the loop ends would spawn a task it never runs."""
        try:
            self.wake_unheard()  # first: nothing awaited before it can hold it back
            self.recheck()
            try:  # systemd's name changed hands unheard: its signals were all dropped since
                if await self.systemd.check_owner():
                    self.counters.error("dbus_signals_lost")
            except SystemdError as e:
                self.counters.error("dbus_call_errors")
                log.debug("cannot ask who owns systemd's name: %s", e)
            await self.audit_shutdown()
            # holds whose read failed: asked again now. Left for the next hold, maybe hours
            # later, one said `stopping` of a person's old stop: undone, that unit came back
            # after the reboot
            self._ask_holds()
            names = sorted(n for n in set(self.known()) if self.systemd.watches(n))
            if not names:
                return
            seen = {n: self.tracker.heard(n) for n in names}
            try:
                states = await self.systemd.units_state(names)
            except SystemdError as e:
                self.counters.error("dbus_call_errors")
                log.debug("cannot read the units gpuslice knows: %s", e)
                return
            suspects, self._suspects = self._suspects, {}
            for state in states:
                if state.name in seen and self.tracker.heard(state.name) == seen[state.name]:
                    self._take_audited(state, suspects.get(state.name))
        finally:
            task = asyncio.current_task()
            if task is None or not task.cancelling():  # cancelled: the controller is ending
                self.start_audits()

    async def audit_shutdown(self) -> None:
        """While the host is taken to be going down, nothing is started: had the JobRemoved
        of its cancelled shutdown been lost, no preempted unit would come back and no
        background unit start again until the controller restarts. systemd's SystemState
        says `stopping` while its shutdown target is active or queued."""
        if not self.tracker.shutting_down:
            return
        stamp = self.tracker.shutdown_jobs_heard()
        try:
            state = await self.systemd.system_state()
        except SystemdError as e:
            self.counters.error("dbus_call_errors")
            log.debug("cannot ask whether the host is going down: %s", e)
            return
        if state != "stopping" and self.tracker.shutdown_unheard(stamp):
            self.counters.error("dbus_signals_lost")
            log.warning(
                "systemd says the host is %s, not going down: the signal of its cancelled "
                "shutdown was lost on the bus; units are started again",
                state,
            )
            self.shutdown_over()

    def hold_booked(self, unit: str) -> None:
        """Someone's stop took the unit down and it is held, the host taken to run: the
        shutdown's stops are someone's when the bus lost its JobNew, and the hold outlived
        the reboot. systemd's SystemState, read now, says `stopping` once the shutdown is
        queued: it was queued before, with its stops (one transaction). Units held while a
        read is under way wait for the next."""
        tracker = self.tracker
        self._holds[unit] = (tracker.shutdown_jobs_heard(), tracker.shutdown_queued())
        self._ask_holds()

    def _ask_holds(self) -> None:
        if self._holds and not self._asking:
            self._asking = True
            self.spawn(self._read_holds())

    async def _read_holds(self) -> None:
        try:
            while self._holds:
                asked, self._holds = dict(sorted(self._holds.items())), {}
                try:
                    state = await self.systemd.system_state()
                except SystemdError as e:
                    self.counters.error("dbus_call_errors")
                    log.debug("cannot ask whether the host is going down: %s", e)
                    # asked again with the next hold, or audit (a hold since is the later)
                    self._holds = {**asked, **self._holds}
                    return
                # one held again since the read was sent (started, then stopped meanwhile)
                # waits for the next: this answer may be older than its new stop, and taken
                # for it, the next read found that hold confirmed (a shutdown's, kept)
                told = {u: at for u, at in asked.items() if u not in self._holds}
                held: list[str] = []
                ended: list[str] = []
                for unit, at in told.items():
                    (ended if self._shutdowns(state, *at) else held).append(unit)
                if held:
                    self.holds_read(held, False)
                if ended:
                    self.holds_read(ended, True)
        finally:
            self._asking = False

    def _shutdowns(self, state: str, heard: int, queued: int) -> bool:
        """Whether SystemState `state`, read after a unit was held (the tracker's stamps then,
        `heard` and `queued`), says that the hold was a shutdown's stop whose JobNew was lost.
        Not when shutdown.target was queued since (its JobNew heard): the stop came before that
        shutdown, whose jobs are announced before they run (a person's stop, then a reboot).
        Nor when the answer is older than a shutdown's cancel heard since (its JobRemoved read
        before the answer was taken up): believed, it took the host for going down
        (`audit_shutdown`). A shutdown heard since with no shutdown.target JobNew was merged
        into one queued before, unheard (`systemctl poweroff` after a lost reboot): that one's
        stop took the unit down."""
        if state != "stopping" or queued != self.tracker.shutdown_queued():
            return False
        return heard == self.tracker.shutdown_jobs_heard() or self.tracker.shutting_down

    def _take_audited(self, state: UnitState, suspect: tuple[UnitState, int] | None) -> None:
        """A state its signals did not tell is taken in when the next read still shows it and
        no word of systemd's on the unit came between."""
        known = self.tracker.state(state.name)
        if (known.active, known.sub, known.job_id) == (state.active, state.sub, state.job_id):
            return
        heard = self.tracker.heard(state.name)
        if suspect != (state, heard):
            self._suspects[state.name] = (state, heard)
            return
        self.counters.error("dbus_signals_lost")
        log.warning(
            "%s: systemd shows it %s (%s), job %d, where its signals left it %s (%s), job "
            "%d: a signal was lost on the bus; taken in now",
            state.name,
            state.active,
            state.sub,
            state.job_id,
            known.active,
            known.sub,
            known.job_id,
        )
        props: dict[str, Any] = {"ActiveState": state.active, "SubState": state.sub}
        if state.job_id != known.job_id:  # else the path its signal named is kept
            props["Job"] = (state.job_id, "/")
        self.take(state.name, props)
