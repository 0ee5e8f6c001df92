"""Instances of annotated templates: what the controller keeps of each, and when it lets go.

An instance's name is one job's (`transcribe@RECORDING.service`, one per connection of an
`Accept=yes` socket) and may never come again, and any local user may start them. Each
name kept costs a gate pipe and an env file in /run, a tracker entry, a match rule and,
while held or preempted, a line of the state file saved with every decision: kept until
the controller restarts, a flood of instances grew all of them without bound. So an
instance down is let go of here (its pipe and env file at once, the core's and the
tracker's record once gpuslice owes it nothing), and what is kept of them is bounded. The
core says what it still owes (Scheduler.forget_instance, drop_preempted_instances); the
controller says when one is down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpuslice import envfiles
from gpuslice.core.scheduler import Action, Scheduler
from gpuslice.gatepipes import GatePipes
from gpuslice.state import STATE_FILE_MAX
from gpuslice.tracker import Kind, Tracker, classify, restart_coming
from gpuslice.unitfiles import is_instance

log = logging.getLogger("gpuslice")

# Held or preempted instances kept (Scheduler.forget_instance keeps those alone): past this
# many the journal says so once, until they are fewer again. Each is saved with every change
# of state; a state file past STATE_FILE_MAX (16 MiB, some 60,000 long names) is refused whole
# at the next start, its preemptions with it
KEPT_INSTANCES_WARN = 10_000
# Preempted instances kept at most (Scheduler.drop_preempted_instances): past this many, those
# that would come back last are no longer brought back, each named in the journal. Any local
# user may start instances (an `Accept=yes` socket: one per connection), so this bounds the
# core's tables and the state file, saved with every decision, whatever they start
PREEMPTED_INSTANCES_MAX = 10_000


class Instances:
    """The instances announced and not seen down since, and the letting go of those down.
    Given: the core and the tracker (shared with the controller), the gates' pipes, the
    runtime_dir env files are written in (the config's, read at each down), what tells
    status readers that something changed, the controller's `execute` for the core's
    actions, and what forgets a name's undelivered env file (`Delivery.went_down`)."""

    def __init__(
        self,
        scheduler: Scheduler,
        tracker: Tracker,
        gates: GatePipes,
        runtime_dir: Callable[[], str],
        changed: Callable[[], None],
        execute: Callable[[list[Action]], None],
        undelivered: Callable[[str], None],
    ) -> None:
        self.scheduler = scheduler
        self.tracker = tracker
        self.gates = gates
        self.runtime_dir = runtime_dir
        self.changed = changed
        self.execute = execute
        self.undelivered = undelivered  # Delivery.went_down
        # instances of annotated templates whose start systemd announced (JobNew) and that
        # have not been seen down since: watched (Controller._watched) before the core knows
        # them
        self.announced: set[str] = set()
        self._kept_said = False  # KEPT_INSTANCES_WARN was said, and still holds

    def went_down(self, name: str) -> None:
        """An instance is down: its pipe and env file go. Kept, /run would hold one of each
        for every instance ever started until the controller restarts. The next start's gate
        passes only once `Delivery.deliver` wrote its file anew (or, no longer annotated, once
        `Gates.let_through` removed or wrote it)."""
        self.gates.retire(name)
        envfiles.remove(self.runtime_dir(), name)
        self.undelivered(name)  # a file it could not be told: said again, if ever
        self.announced.discard(name)  # watched while the core knows it (Controller._watched)

    def forget(self, name: str) -> None:
        """An instance down that gpuslice owes nothing is forgotten by the core and the
        tracker, as systemd unloads it (Scheduler.forget_instance says why); its signals are
        no longer matched from the next change of the matched set on. Not while a call of
        ours about it is unanswered: the answer is judged with what we know. Nor while
        it waits in auto-restart (or just before it): its restart job comes, and the
        tracker, which told it down once, must still know that (a second WentDown, a second
        "failed")."""
        if self.tracker.in_flight(name) or restart_coming(self.tracker.state(name)):
            return
        if self.scheduler.forget_instance(name):
            self.tracker.forget(name)
            self.changed()  # gone from held, finished and failed
        else:
            self._cap_preempted()
            self._count_kept()

    def down(self, name: str) -> bool:
        """An instance its signals show down, with no job."""
        return is_instance(name) and classify(self.tracker.state(name)) is Kind.DOWN

    def _cap_preempted(self) -> None:
        """Past PREEMPTED_INSTANCES_MAX instances kept preempted, those that would come back
        last are no longer brought back (Scheduler.drop_preempted_instances, which says so of
        each) and forgotten as any instance owed nothing. Asked as each instance kept goes
        down, the only way preemptions of instances pile up (at a controller's start too,
        for those a state file names), and cheap below the bound."""
        dropped = self.scheduler.drop_preempted_instances(PREEMPTED_INSTANCES_MAX)
        if dropped:
            self.execute(dropped)
            for action in dropped:
                if action.decision is not None:
                    self.forget(action.decision.unit)

    def _count_kept(self) -> None:
        """Say once, as a warning, that more than KEPT_INSTANCES_WARN instances are kept
        down, held or preempted: nothing forgets them until someone starts them (or their
        template's annotation goes), and each is saved with every change of state. Counted
        only past the bound's sum of every held and preempted unit, so cheap below it."""
        core = self.scheduler
        if len(core.held) + len(core.preempted) <= KEPT_INSTANCES_WARN:
            self._kept_said = False
            return
        if self._kept_said:
            return
        kept = sum(1 for n in core.held | core.preempted.keys() if is_instance(n))
        if kept > KEPT_INSTANCES_WARN:
            self._kept_said = True
            log.warning(
                "%d instances are kept held or preempted (more than %d): gpuslice forgets a "
                "held one only once it is started again and has ended, a preempted one once it "
                "is back; each is saved in the state file, which is refused whole past %d MiB",
                kept,
                KEPT_INSTANCES_WARN,
                STATE_FILE_MAX >> 20,
            )
