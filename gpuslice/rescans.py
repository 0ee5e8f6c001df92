"""Rescans: the annotations read again after a daemon-reload, and the starts held back meanwhile.

Each daemon-reload (systemd's Reloading signal, or its re-execution) may change what is
annotated. The unit files are read again off the loop, one scan at a time: requests while one
runs make one more run after it (`request`). Systemd already runs on the unit files that scan
reads, so the starts it may concern wait for it: a start systemd shows at its gate
(`hold_gate`, `hold_for_rescan`), a gate's call of a unit the scan may not know yet (`park`,
`for_gate`), a queued start (`scanned`). Once a scan is applied they are judged on it, and on
the scan before when one fails; not at all when the controller stops meanwhile (its task
cancelled): the next controller takes them in.

The controller applies each scan and judges the starts held back; everything else is given:
the read itself (`read`: annotations.scan of the controller's root), whether start-up is done
(`ready`), the tracker, the core's word on a unit (`known`, `unanswered`), and where a failed
task is said (`report_failure`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Protocol

from gpuslice.annotations import Scan
from gpuslice.tracker import Kind, UnitState, at_condition, classify

# Units whose gate got a rescan of its own kept at most (`for_gate`): 0.3 MiB at 255 characters
RESCANNED_KEPT = 1024


class States(Protocol):
    """What systemd last showed of each unit (Tracker.state)."""

    def state(self, name: str) -> UnitState: ...


class Rescans:
    """The scan under way (`task`), whether one more is due (`again`), and the starts held back
    until it is applied: at their gate (`after_scan`, with the InvocationID last named), gate
    calls (`parked`), queued starts (`waits`)."""

    def __init__(
        self,
        read: Callable[[], Scan],
        ready: Callable[[], bool],
        tracker: States,
        known: Callable[[str], bool],
        unanswered: Callable[[str], bool],
        apply: Callable[[Scan], None],
        judge_gates: Callable[[dict[str, str | None]], None],
        acquire: Callable[[str], None],
        report_failure: Callable[[asyncio.Task[None]], None],
    ) -> None:
        self.read = read
        self.ready = ready
        self.tracker = tracker
        self.known = known
        self.unanswered = unanswered
        self.apply = apply
        self.judge_gates = judge_gates
        self.acquire = acquire
        self.report_failure = report_failure
        # rescans run off the loop, one at a time; Acquire calls of units the running scan
        # may not know yet wait for it
        self.task: asyncio.Task[None] | None = None
        self.again = False
        self.parked: list[str] = []
        # starts not answered yet that systemd showed at their gate while a rescan ran:
        # taken in once it is applied (Controller._gates_after_scan), with the InvocationID
        # last named
        self.after_scan: dict[str, str | None] = {}
        self.waits: list[asyncio.Future[None]] = []  # queued starts' (Controller._announce_queued)
        # units whose gate asked while neither the scan nor the core knew them, each
        # rescanned for once until the next daemon-reload (`for_gate`)
        self.rescanned_for_gate: set[str] = set()

    def reloaded(self) -> None:
        """The unit files changed (a daemon-reload ended, systemd re-executed): read them
        again, and each unknown gate may ask for a rescan of its own again."""
        self.rescanned_for_gate.clear()
        self.request()

    def request(self) -> None:
        """Read the annotations again, off the loop; requests while one runs make one
        more run after it (a flood of daemon-reloads costs two scans, not a thousand).
        Before start-up is done, one run once it is: applied while start-up claimed its
        name, a scan's decisions left before start-up's own (a stop withdrawing a start
        sent after it, which systemd's start job then replaced)."""
        if self.task is not None or not self.ready():
            self.again = True
            return
        self.task = asyncio.get_running_loop().create_task(self._run())
        self.task.add_done_callback(self.report_failure)

    async def _run(self) -> None:
        """Scan until no daemon-reload came during a scan. The starts held back before a
        scan began (`hold_gate`, `park`) are judged once it is applied: it read the unit
        files after their reload. Held back until the last scan, a start waited as long as
        daemon-reloads kept coming."""
        gates: dict[str, str | None] = {}
        parked: list[str] = []
        waits: list[asyncio.Future[None]] = []
        try:
            while True:
                self.again = False
                gates, self.after_scan = self.after_scan, {}
                parked, self.parked = self.parked, []
                waits, self.waits = self.waits, []
                result = await asyncio.to_thread(self.read)
                self.apply(result)
                # theirs now, judged once even if a step raises (`finally` judges the rest)
                held, (gates, parked, waits) = (gates, parked, waits), ({}, [], [])
                self._judge_held_back(*held)
                if not self.again:
                    break
        except asyncio.CancelledError:
            # the controller stops (asyncio.run cancels its tasks once run() returns): judged
            # here on the scan before, a start whose annotation the reload took out or made
            # less urgent was granted, and preempted others, by a controller on its way out.
            # Left to the next one, read on the unit files of then (Restore.rebuild), whose
            # gates ask it again; a queued start's wait is cancelled, as its task is.
            for wait in waits + self.waits:
                wait.cancel()
            gates, parked, waits = {}, [], []
            self.after_scan, self.parked, self.waits = {}, [], []
            raise
        finally:
            self.task = None
            # those of the last scan (or of one that failed: judged on the scan before)
            gates, self.after_scan = {**gates, **self.after_scan}, {}
            parked, self.parked = parked + self.parked, []
            waits, self.waits = waits + self.waits, []
            self._judge_held_back(gates, parked, waits)

    def _judge_held_back(
        self, gates: dict[str, str | None], parked: list[str], waits: list[asyncio.Future[None]]
    ) -> None:
        """The gates, then the parked calls, then the queued starts' waits: each step runs
        whatever an earlier one raised (a bug: the first error then reaches the task's
        report). Stopped at the first, the parked calls went unanswered and the queued
        starts' announcements waited for ever."""
        errors: list[Exception] = []
        steps: list[Callable[[], None]] = [partial(self.judge_gates, gates)]
        steps += [partial(self.acquire, unit) for unit in parked]
        for step in steps:
            try:
                step()
            except Exception as e:
                errors.append(e)
        for wait in waits:
            if not wait.done():
                wait.set_result(None)
        if errors:
            raise errors[0]

    async def scanned(self) -> None:
        """Return once a scan begun after now is applied, at once when none is under way:
        a start systemd shows now runs on the unit files of the last daemon-reload."""
        if self.task is not None:
            wait = asyncio.get_running_loop().create_future()
            self.waits.append(wait)
            await wait

    def hold_gate(self, name: str, invocation: str | None) -> bool:
        """Whether a start systemd shows at its gate, not answered yet, waits for the rescan
        under way (Controller._gates_after_scan takes it in once it is applied). Systemd
        already runs on the unit files that rescan reads (a daemon-reload, and a `systemctl
        start` right after it): decided on the scan before, a start whose annotation was just
        taken out, or its priority made less urgent, preempted units with the priority it no
        longer has, and their work was lost for it."""
        state = self.tracker.state(name)
        if self.task is None or classify(state) is not Kind.GATE or at_condition(state):
            return False  # one in its ExecCondition= is known only at its gate, if ever
        if not self.unanswered(name):
            return False  # answered: its gate asks again, as after a controller restart
        self.after_scan[name] = invocation or self.after_scan.get(name)
        return True

    def hold_for_rescan(self, name: str) -> None:
        """A start start-up found at its gate waits for the rescan due (Restore.rebuild)."""
        self.after_scan[name] = None

    def park(self, unit: str) -> None:
        """A gate's call waits for the scan under way (or due: `for_gate`), judged then."""
        self.parked.append(unit)

    def for_gate(self, unit: str) -> bool:
        """Whether a rescan was asked for the gate of a unit that neither the scan nor the
        core knows. Only the generator gives a unit its gate, from the same annotations, at
        each daemon-reload: the scan may be older than that reload, its Reloading signal
        lost (the bus daemon drops signals for a connection whose queue is full, and anyone
        can fill it). Let through on that scan, a unit newly annotated ran ungated, on GPUs
        that others held. Once per unit until the next daemon-reload: a gate left in place
        when its annotation went (no reload since) costs one scan, not one per start. Only a
        service has a gate (ExecStartPre=): a caller in a login's scope (a new name at each
        login; root's alone, as the bus policy lets root alone call Acquire) asks for none.
        At most RESCANNED_KEPT names are kept, then forgotten all at once: a template's gate
        left in place gives each instance (a name per job) a scan of its own, as its own
        drop-in directory may annotate it, and kept until the next reload, a name per job
        piled up without bound (forgotten early, a unit only asks for one more scan)."""
        if not unit.endswith(".service") or self.known(unit) or unit in self.rescanned_for_gate:
            return False
        if len(self.rescanned_for_gate) >= RESCANNED_KEPT:
            self.rescanned_for_gate.clear()
        self.rescanned_for_gate.add(unit)
        self.request()
        return True
