"""The controller daemon: the composition root that wires systemd's signals into the core.

Systemd is the source of truth. The controller claims its bus name, subscribes to systemd's
signals, then reads the unit files and every unit's state, restores what only it knew
(holds, preemptions, grants), and tells systemd it is ready. From then on each signal
becomes one core event whose actions are carried out here: a reply to a gate,
StartUnit/StopUnit, one journal line.
Nothing polls; a lost bus connection exits non-zero so that Restart= brings us back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
from collections.abc import (
    Callable,
    Collection,
    Coroutine,
    Iterable,
    Iterator,
)
from pathlib import Path
from typing import Any

from gpuslice import clock, restartresult, stopjournal
from gpuslice.annotations import Problem, Scan, scan
from gpuslice.answers import StatusAnswers
from gpuslice.calls import Calls, JobCall
from gpuslice.checkpoint import CheckpointSettings
from gpuslice.config import (
    Config,
    ConfigError,
    load_config_with_warnings,
    located,
    pin_runtime_dir,
    read_recorded_state_dir,
    read_unchanged,
    record_state_dir,
    runtime_dir_value,
    runtime_dirs_of_this_boot,
)
from gpuslice.core.decisions import Code, Decision, listed
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.plan import plan_start
from gpuslice.core.scheduler import (
    Action,
    Freeze,
    Grant,
    Log,
    Outcome,
    Phase,
    Resume,
    SavedState,
    Scheduler,
    Start,
    Stop,
    Suspend,
    Thaw,
    kept_for_restart_said,
)
from gpuslice.counters import Counters
from gpuslice.delivery import Delivery
from gpuslice.gatepipes import GatePipes, raise_fd_limit
from gpuslice.gates import Gates
from gpuslice.gpuwatch import GpuWatch
from gpuslice.instances import Instances
from gpuslice.inventory import GpuUse, Inventory
from gpuslice.journal import Journal, decision_fields
from gpuslice.ladder import Ladder
from gpuslice.notify import Notifier
from gpuslice.paths import (
    BOOT_RECORD,
    RUNTIME_DIR_ENV,
    RUNTIME_DIR_RECORD,
    STATE_DIR_RECORD,
    gate_pipe_dir,
)
from gpuslice.queued import QueuedStarts, starts_waited_for
from gpuslice.reloads import Reloads, load_settled
from gpuslice.remains import Remains
from gpuslice.rereads import Rereads
from gpuslice.rescans import Rescans
from gpuslice.restartresult import RestartResults
from gpuslice.restore import AskJournal, Restore
from gpuslice.service import (
    BUS_NAME,
    NameTaken,
    NotManaged,
    SchedulerService,
    Starting,
)
from gpuslice.state import Flusher, StateStore, record_boot, same_boot
from gpuslice.systemd import Systemd, SystemdError
from gpuslice.tracker import (
    CameUp,
    Change,
    Exited,
    Kind,
    Ledger,
    ReachedGate,
    Tracker,
    WentDown,
    at_condition,
    bound_for_gate,
    classify,
    job_number,
    remains_active,
    restart_coming,
)
from gpuslice.unitfiles import is_instance, is_template, printable

log = logging.getLogger("gpuslice")

# How many times a waiter told down at its gate is read for its job's type while signals
# since make the answer stale or the read fails (Controller._read_leaving), and how long
# after a failed read it is tried again
LEAVING_READS = 3
LEAVING_RETRY_DELAY = 1.0
# How long a unit systemd showed at its gate in a state read may go without a signal naming
# its start, before its gate is sent to D-Bus (gpuslice/gatepipes.py).
GATE_UNSEEN_DELAY = 1.0
# STATUS= (`systemctl status gpuslice`) is sent this long after a change, once for all the
# changes meanwhile: each STATUS= makes systemd send a PropertiesChanged of gpuslice.service
# that the controller itself receives and unmarshals, and a handover changes the line four
# times within ~50 ms, just when the signal it waits for is due (issue 10).
STATUS_DELAY = 0.25
# How long a start job systemd announced (JobNew) may go without its unit reaching its gate
# before the controller reads whether it is a queued start (Controller._queued): a start
# that runs at once shows at its gate within milliseconds, and a read sent at JobNew would
# cost every such start a call that systemd answers before it runs the start.
QUEUED_DELAY = 0.02
# How long a start of ours whose GPUs are kept (a refill, a comeback, a restart kept for) may
# go without reaching its gate before its job's waits are read (Controller._kept_queued):
# one queued behind a GPU unit's start keeps nothing. Such a start reaches its gate in tens
# of milliseconds (`make bench`: refill); read at QUEUED_DELAY, every refill cost a
# Job.GetBefore read, a tenth of the controller's CPU per handover and refill (issue 10).
KEPT_WALK_DELAY = 0.5
# How long after a save the state file is made durable (gpuslice/state.py: Flusher): a
# power cut may lose the decisions of this last stretch, never the file.
FLUSH_DELAY = 1.0
# Where the controller records the runtime_dir it runs with (paths.RUNTIME_DIR_RECORD)
RUNTIME_RECORD = Path(RUNTIME_DIR_RECORD)
# Where the controller records the state_dir it runs with (paths.STATE_DIR_RECORD)
STATE_RECORD = Path(STATE_DIR_RECORD)
# Where the controller records this boot as it tells it (paths.BOOT_RECORD)
THIS_BOOT_RECORD = Path(BOOT_RECORD)
# While `gpuslice release-jobs` holds our name, each try of it extends systemd's start timeout
# by this (EXTEND_TIMEOUT_USEC=): systemd's default TimeoutStartSec=, so that the rest of the
# start-up, once the name is ours, has as long as a start that waited for nothing.
START_EXTENSION = 90.0
# How long a unit that failed keeps its GPUs for the start its Restart= sends after
# RestartSec= (Scheduler._keep_for_restart): past it, a long RestartSec= does not keep them idle.
RESTART_KEEP = 30.0
# How long one that failed with no restart seen keeps them, for the signal of its
# `auto-restart`: systemd 252 sends it after `failed`, at the same instant, so this covers the
# bus's delivery on a loaded host. The cost: a unit that fails for good gives them this late.
RESTART_SIGNAL_WAIT = 1.0


class Controller:
    # where the runtime_dir the controller runs with is recorded for the generator to keep
    # naming it this boot (_record_runtime_dir); run() sets RUNTIME_RECORD, None: not kept
    runtime_record: Path | None = None
    # where the state_dir the controller runs with is recorded for the next start, which
    # moves the state from it (_load_state); run() sets STATE_RECORD, None: not kept
    state_record: Path | None = None
    # where this boot as it tells it is recorded for `gpuslice release-jobs`, which cannot
    # tell it so in a container (paths.BOOT_RECORD); run() sets THIS_BOOT_RECORD, None: not
    # recorded
    boot_record: Path | None = None

    def __init__(
        self,
        config: Config,
        config_path: Path,
        systemd: Systemd,
        root: str = "/",
        inventory: Inventory | None = None,
        journal: Journal | None = None,
        service: SchedulerService | None = None,
        ask_journal: AskJournal | None = None,
    ) -> None:
        self.config = config
        # decisions go there, into their units' own journals too; None: plain log lines
        self.journal = journal
        # asks the journal how holders found down at start-up ended
        # (Restore.stopped_while_away); run() gives stopjournal.ask, None: not asked, each main
        # process's record decides
        self.ask_journal = ask_journal
        # decisions, errors and admission waits since we started (status, `gpuslice metrics`)
        self.counters = Counters()
        self.started = clock.moment()  # shown as a Unix time (clock.unix_time)
        # when each waiter started waiting (clock.moment): its wait, and status's "since"
        self.waiting_since: dict[str, float] = {}
        self.config_path = config_path
        self.systemd = systemd
        self.root = root
        # the annotations: read by start() once systemd's signals reach us (read here, a
        # daemon-reload before the subscription was never read), then at each rescan
        self.scan = Scan(root=root)
        self.scheduler = Scheduler(
            [Gpu(i) for i in range(config.gpus)],
            {},
            yield_to_foreign=config.foreign_processes == "yield",
            requeue_at_gate=config.requeue_at_gate,
        )
        self.notifier = Notifier()
        watchdog = self.notifier.watchdog_interval()
        # NVML: samples, the driver's lifecycle, their timers; under systemd's watchdog no
        # NVML wait outlasts half WatchdogSec= and each begins with WATCHDOG=1
        self.watch = GpuWatch(
            config,
            inventory or Inventory(config),
            self.scheduler,
            managed=self._managed_units,
            decide=self._decide_on,
            ready=lambda: self.ready,
            alive=self.notifier.watchdog if watchdog else None,
            longest_wait=watchdog,
        )
        self.tracker = Tracker(
            self._followed,
            Ledger(
                self.scheduler.phase,
                self.scheduler.is_waiting,
                self.scheduler.awaits_gate,
                lambda name: name in self.scheduler.remained,  # load() sets a new set
            ),
        )
        # reads that take in what signals did not say (a job that changed nothing, a lost
        # signal), each taken in as a signal would be
        self.reads = Rereads(
            systemd,
            self.tracker,
            self.counters,
            lambda unit, props: self.on_unit_changed(unit, props, read=True),
            self._known_units,
            self._spawn,
            self._wake_unheard_gates,
            self._follow_shutdown,
            self._holds_read,
            self._at_audit,
        )
        # our StartUnit/StopUnit calls: answers, those sent again, the stops' timers
        self.calls = Calls(
            self.scheduler,
            self.tracker,
            self.reads,
            self.counters,
            systemd,
            self.execute,
            self._spawn,
            self.on_unit_changed,
            lambda name: self.instances.down(name),
            lambda name: self.instances.forget(name),
            lambda: self.config.stop_timeout,
        )
        # freeze, suspend and resume (the Preempt= ladder), carried out as tasks
        self.ladder = Ladder(
            systemd,
            self.scheduler,
            self._gpu_processes,
            lambda: CheckpointSettings.from_config(self.config),
            self._report,
        )
        self.store = StateStore(Path(config.state_dir), Path(config.runtime_dir))
        self._flusher = Flusher(self.store, FLUSH_DELAY, self._flushed)
        # the readers of status (Status, STATUS=): each answer built once per change
        self.answers = StatusAnswers(
            self.scheduler,
            scan=lambda: self.scan,
            sample=lambda: self.watch.sample,
            waiting_since=lambda: {n: clock.unix_time(m) for n, m in self.waiting_since.items()},
            suspensions=lambda: {
                n: (s.vram, clock.unix_time(s.since)) for n, s in self.ladder.suspensions.items()
            },
            restart_since=lambda: {n: clock.unix_time(m) for n, m in self._restart_since.items()},
            counters=self.counters,
            adapter_counts=self._adapter_counts,
            started=lambda: clock.unix_time(self.started),
            credentials=lambda sender: self.systemd.caller_credentials(sender),
        )
        # the annotations read again after each daemon-reload, one scan at a time, and the
        # starts held back until it is applied
        self.rescans = Rescans(
            lambda: scan(self.root),
            lambda: self.ready,
            self.tracker,
            self._known,
            lambda unit: self.judge.unanswered(unit),
            self._apply_scan,
            self._gates_after_scan,
            lambda unit: self.judge.acquire_verified(unit),
            _log_failure,
        )
        # the gate calls in wait; the bus adapter unless one is given (tests)
        self.service = service or SchedulerService(
            systemd.bus,
            self.on_acquire,
            self.status_json,
            self.rescans.request,
            self.plan_json,
            self.status_for,
        )
        # the gates' fast way: answered through a pipe when systemd shows them at the gate
        self.gates = GatePipes(gate_pipe_dir(config.runtime_dir))
        # instances of annotated templates: those announced, and the letting go of those down
        self.instances = Instances(
            self.scheduler,
            self.tracker,
            self.gates,
            lambda: self.config.runtime_dir,
            self.answers.changed,
            self.execute,
            lambda name: self.delivery.went_down(name),
        )
        # a grant's way to its gate: its env file written first, withheld while it cannot be
        self.delivery = Delivery(
            self.scheduler,
            self.gates,
            self.service,
            self.counters,
            config.runtime_dir,
            lambda unit: self.judge.acquire_verified(unit),
        )
        # start-up's restore: the saved state checked against what systemd shows
        self.restore = Restore(
            self.scheduler,
            self.tracker,
            systemd,
            self.counters,
            lambda: self.ask_journal,
            config.runtime_dir,
            self.spec_for,
            self.watch.inventory.remember,
            self.watch.resample,
            lambda: self.rescans.again,
            self.rescans.hold_for_rescan,
        )
        # downs a bare `auto-restart` told under Restart=always, told once Result= is read
        self.restart_results = RestartResults(
            systemd, self.counters, self._spawn, self._result_read
        )
        # gate calls of starts the core has not answered, held until systemd's queued starts
        # are read: the starts of one transaction are served in priority order
        self.queued = QueuedStarts(
            systemd,
            self.tracker,
            self.counters,
            self.spec_for,
            self._known,
            lambda: self.rescans.task is not None,
            self._spawn,
            self._starts_read,
        )
        # the gate's judgement: what each gate that asks is answered
        self.judge = Gates(
            self.scheduler,
            self.tracker,
            systemd,
            self.service,
            self.gates,
            self.counters,
            self.spec_for,
            self.rescans,
            self.restore,
            self.watch,
            self.ladder,
            self.calls,
            self.delivery,
            lambda: self.config.runtime_dir,
            self._batched,
            self.execute,
            self._spawn,
            self._say,
            self.queued.wait,
            self._gate_waits,
        )
        self.boot_id = ""
        self.ready = False
        self._buffered: list[tuple[str, dict[str, Any]]] = []
        # systemd's jobs announced or ended while start-up, subscribed, reads the unit files:
        # taken in once they are read (which units are ours is not known before). Dropped,
        # a `systemctl stop` announced then was never heard: its unit, down, was taken for
        # ended by itself, finished, not held
        self._unscanned: list[tuple[int, str, str, str | None]] | None = None
        # Acquire calls taken before start-up was done: (unit, sender, its signals then),
        # served once it is (on_acquire)
        self._early_acquires: list[tuple[str, str, int]] = []
        # units whose GPUs are kept for their Restart= (Scheduler.restart_kept): the timer
        # that releases them after RESTART_KEEP
        self._restart_timers: dict[str, asyncio.TimerHandle] = {}
        # when each keep began (clock.moment): status's "since" of a holder `restarting`
        self._restart_since: dict[str, float] = {}
        # unit -> the job of a start kept for (Scheduler.keeps_place) walked now
        # (`_unkeep_queued`), until the walk or that job ends: a walk of a job gone since
        # says nothing of the start kept for then (a restart's, once that start ran)
        self._kept_walks: dict[str, int] = {}
        # units whose walk under way is followed by one more (`_walk_kept`): a gate asked
        # since it began, and waits on GPUs kept for them (`_kept_in_the_way`)
        self._kept_again: set[str] = set()
        # units told down at their gate whose job's type is to be read (`_read_leaving`),
        # with the reads tried for each so far
        self._leaving_reads: dict[str, int] = {}
        # unit -> the job of a start kept for (Scheduler.keeps_place), from its JobNew until
        # that job ends: walked again when a gate waits on what is kept for it
        self._kept_jobs: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # units kept active after their job ended (RemainAfterExit=yes): released once
        # systemd counts (or lists) no process left in them
        self.remains = Remains(
            systemd,
            self.tracker.heard,
            self._still_exited,
            self._release_exited,
            self._spawn,
        )
        # match rules change one set at a time (_rewatch)
        self._rewatching = False
        self._rewatch_again = False
        self._decision_due = False  # a scheduling pass is queued for this turn of the loop
        self._batching = 0  # depth of _batched: the state its events change is saved once
        self._save_due = False  # changed, and saved by the scheduling pass due this turn
        self._save_failing = False
        self._flush_failing = False
        self._checking_thaws = False  # a check of FreezerState is under way
        self._status_due = False  # a STATUS= update is scheduled
        # SIGHUP's reloads of config.yaml, each once the file has settled
        self.reloads = Reloads(config_path, self.reload_config, lambda: self.ready)
        self._release_wait_said = ""  # _await_release_jobs' words, logged once
        self.name_claimed = False  # the bus name is ours: start() reads and writes from then on

    # -- start-up ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.answers.read_proc_mount()  # before anyone's Status reaches us by our name
        # Our bus name before anything is written or removed: a second controller (one run
        # by hand beside gpuslice.service) is refused it (NameTaken) and ends here. Claimed
        # later, it had by then recorded its runtime_dir and boot, moved or rewritten the
        # running controller's state file, and removed its gate pipes. Gates that ask
        # meanwhile wait for the state to be loaded (on_acquire). Held by `gpuslice
        # release-jobs`, it is waited for (_await_release_jobs), no longer than RELEASE_WAIT.
        await self.service.claim_name(self._await_release_jobs)
        self.name_claimed = True
        if self.runtime_record is not None:  # before any gate is answered
            _record_runtime_dir(self.runtime_record, self.config.runtime_dir, self.config_path)
        self.systemd.on_unit_changed = self.on_unit_changed
        self.systemd.on_job_new = self.on_job_new
        self.systemd.on_job_removed = self.on_job_removed
        self.systemd.on_reloading = self.on_reloading
        self.systemd.on_systemd_restarted = self.on_systemd_restarted
        self.gates.reset()  # gates left waiting by an earlier controller ask over D-Bus
        self._unscanned = []
        await self.systemd.subscribe()
        # the unit files, read once a daemon-reload's Reloading signal reaches us: one that
        # ended before is in this read, one that ends during or after it asks for a rescan
        # (on_reloading), and the starts start-up finds at their gate wait for that
        # (Restore.rebuild)
        self.rescans.again = False
        self.scan = await asyncio.to_thread(scan, self.root)
        jobs, self._unscanned = self._unscanned, None
        for job_id, path, unit, result in jobs:
            if result is None:
                self.on_job_new(job_id, path, unit)
            else:
                self.on_job_removed(job_id, path, unit, result)
        self.boot_id = await self.systemd.boot_id()
        self._record_boot()
        for problem in self.scan.problems:
            self._log_problem(problem)
        self.watch.open()  # and acts on NVML's case
        self.scheduler.set_gpus(self.watch.sample.gpus)
        saved, saved_boot = self._load_state()
        units = await self.systemd.list_units()
        remembered = set(saved.preempted) | set(saved.holders) | set(saved.held)
        remembered |= set(saved.suspended)  # stopped by hand while we were away: held
        remembered |= set(saved.requeued)  # a comeback at its gate: owed if its wait ended
        remembered |= set(saved.stopped_by_shutdown)  # refilled if its shutdown was cancelled
        shown = {u.name for u in units}  # instances among them are annotated by templates
        with self.scheduler.deferred():  # nobody holds or waits yet: Restore.rebuild decides
            self.scheduler.set_specs(self._concrete_specs(remembered | shown))
        this_boot = same_boot(saved_boot, self.boot_id)
        if not this_boot:  # nothing runs after a reboot that we granted before it
            saved = self.scheduler.ended_with_boot(saved)
        forgotten = self.scheduler.load(saved)  # said with the first decisions
        # records of units no longer annotated, forgotten: saved once ready, even unsaid
        recorded = {*saved.preempted, *saved.held, *saved.finished, *saved.failed}
        forgets = bool(recorded - self.scheduler.recorded())
        if not this_boot:
            self.scheduler.forget_boot()
        # once the core knows what it kept without an annotation (a suspended unit whose
        # annotation went): read before, such a unit, still active and frozen, was taken
        # for stopped by hand and left frozen
        self.tracker.listed(units)
        self.restore.remember_told()  # before a sample decides: NVML may number the GPUs anew
        with self.scheduler.deferred():  # the first sample took every job's process for foreign
            self.scheduler.set_gpus(self.watch.resample())
        # what the suspends of this boot checkpointed (another boot's PIDs are other
        # processes), for the resumes rebuild decides
        kept = set(self.scheduler.suspended_units()) if this_boot else set()
        self.ladder.recall({n: c for n, c in saved.checkpointed.items() if n in kept})
        stopped = await self.restore.stopped_while_away()
        actions = forgotten + self.restore.rebuild(stopped, await self.restore.queued_free())
        for name in kept - set(self.scheduler.suspended_units()):
            if self.scheduler.phase(name) is not Phase.RESUMING:  # ended while we were away
                self.ladder.went_down(name)
        self.restore.sweep_env_files(units)  # ours alone (our name): no other controller writes one
        self.ready = True
        self.execute(actions)
        self._recheck_exited()  # a job that ended while we were away: released soon
        if forgets and not actions:
            self._persist()
        self._check_freezer()  # a thaw the last controller owed: at once, not at a sample
        if self.rescans.again:  # a daemon-reload ended during start-up
            # under way before the signals and calls that came meanwhile are taken in: a
            # start among them is judged once it is read (Rescans.hold_gate, Gates.verify_acquire)
            self.rescans.request()
        for name, props in self._buffered:
            self.on_unit_changed(name, props)
        self._buffered.clear()
        early, self._early_acquires = self._early_acquires, []
        for unit, sender, seen in early:
            self._spawn(self.judge.verify_acquire(unit, sender, seen))
        self.reloads.started()  # a SIGHUP that came during start-up
        for name in sorted(self.scheduler.annotated()):  # down since, or kept by a version
            if self.instances.down(name):
                self.instances.forget(name)
        self.notifier.ready(self.status_line())
        log.info("gpuslice ready: %s", self.status_line())
        self._rewatch()
        self.reads.start_audits()

    def _await_release_jobs(self, pid: int) -> None:
        """Said at each try while `gpuslice release-jobs` (PID `pid`) holds our name: systemd
        is told the start goes on (EXTEND_TIMEOUT_USEC=), or Type=notify's TimeoutStartSec=
        (90 s by default) killed the wait, which may last RELEASE_WAIT s, and why (STATUS=)."""
        words = f"waiting for gpuslice release-jobs (PID {pid}) to finish"
        if words != self._release_wait_said:
            self._release_wait_said = words
            log.info("%s: %s is held by it until then", words, BUS_NAME)
        self.notifier.send(f"EXTEND_TIMEOUT_USEC={round(START_EXTENSION * 1e6)}")
        self.notifier.status(words)

    def _record_boot(self) -> None:
        """Record this boot (`boot_record`) before any state is saved with it: release-jobs
        judges the saved state's boot by it. Unrecorded, it asks systemd itself, which in a
        container reads another kernel boot id than this sandbox does."""
        record = self.boot_record
        if record is None:
            return
        try:
            record_boot(record, self.boot_id)
        except OSError as e:
            log.error(
                "cannot record this boot in %s (%s): in a container, `gpuslice release-jobs` "
                "(apt remove) takes this boot's state for an earlier boot's and leaves its "
                "frozen and suspended units as they are",
                record,
                e,
            )

    def _load_state(self) -> tuple[SavedState, str]:
        """The saved state and its boot, from where the last controller saved it. After
        state_dir was edited in config.yaml, a restart (Restart= after a crash, the exit a
        driver loaded late asks for, by hand) read the new one, empty: units preempted and
        owed a restart were never started again, suspended ones stayed frozen with their
        memory on the host. The state moves (StateStore.take_over), and the state_dir it is
        in is recorded (`state_record`, across reboots: preempted units outlive one) for the
        next start."""
        record = self.state_record
        if record is None:
            return self.store.load()
        state_dir = self.config.state_dir
        found = read_recorded_state_dir(record)
        # none recorded (a gpuslice of a version without the record ran last): the default
        # state_dir, the record's directory
        recorded = found or str(record.parent)
        moved = recorded == state_dir or self.store.take_over(Path(recorded))
        if not moved:  # read there, saved here; recorded there until it moves
            there = StateStore(Path(recorded), Path(self.config.runtime_dir))
            there.read_ahead, self.store.read_ahead = self.store.read_ahead, None  # read once
            return there.load()
        if found != state_dir:
            try:
                record_state_dir(record, state_dir)
            except OSError as e:
                log.error(
                    "cannot record the state_dir in %s (%s): a restart after state_dir is "
                    "changed in %s starts without the state",
                    record,
                    e,
                    self.config_path,
                )
        return self.store.load()

    def _watched(self) -> set[str]:
        """The units whose signals matter: every annotated unit; the instances of annotated
        templates, from their start's JobNew on (on_job_new) and while the core knows them;
        and any other unit the core still knows (its annotation went while it holds, waits or
        is suspended). An annotated template once meant every unit's signals, which cost
        each handover the reading of every unit's changes (issue 10), and every host has one
        (gpuslice-claim@.service). Beyond MAX_UNIT_RULES units it still does (Systemd.watch)."""
        names = {n for n in self.scan.specs if not is_template(n)} | self.instances.announced
        core = self.scheduler
        names |= set(core.specs) | set(core.grants()) | set(core.waiting_units())
        # a suspended unit whose annotation went: unmatched, a stop of it by hand was never
        # heard (nor read: the audit reads matched units only), and once it was resumed
        # neither was its end, and its GPUs stayed held until the controller restarted
        return names | set(core.suspended_units())

    def _rewatch(self) -> None:
        """Match anew the signals of the units that matter (`_watch_units`): one change at a
        time, and one more after it for every request meanwhile. A task per request, each
        computing the set of every unit that matters, cost a flood of new instances (one
        JobNew each) time quadratic in their number, on the loop."""
        if self._rewatching:
            self._rewatch_again = True
            return
        self._rewatching = True
        self._spawn(self._rewatch_until_done())

    async def _rewatch_until_done(self) -> None:
        try:
            while True:
                self._rewatch_again = False
                await self._watch_units()
                if not self._rewatch_again:
                    return
        finally:
            self._rewatching = False

    async def _watch_units(self) -> None:
        """Match the signals of the units that matter only; read the state of those newly
        matched, whose changes before their rule went unseen. Those the rule for every unit
        matches instead, when the bus daemon refuses a rule each, are read as well: left
        unread, a unit annotated while it ran was never adopted, and its GPU was granted
        beside it."""
        wanted = self._watched()
        unmatched = sorted(n for n in wanted if not self.systemd.watches(n))
        try:
            added = await self.systemd.watch(wanted)
        except SystemdError as e:
            log.warning("cannot match each unit's signals (%s): reading every unit's", e.text)
            try:
                await self.systemd.watch(None)
            except SystemdError:
                return
            added = unmatched
        for name in added:
            # a gate waiting on a pipe an earlier start left, its start unseen while the unit
            # was not matched, asks over D-Bus (a later signal names only later starts)
            self.gates.at_gate_unknown(name)
            self._spawn(self.reads.refresh(name))  # not awaited: the next re-match need not wait

    # -- signals from systemd ---------------------------------------------------------------

    def spec_for(self, name: str) -> UnitSpec | None:
        return self.scan.spec_for(name)

    def _known(self, name: str) -> bool:
        """Whether the core still knows the unit: it holds GPUs, waits or is suspended."""
        return self.scheduler.phase(name) is not None or self.scheduler.is_waiting(name)

    def _followed(self, name: str) -> bool:
        """Whether systemd's word on the unit is taken in: it is annotated, or the core still
        knows it. A unit whose annotation went while it was being stopped, waited or was
        suspended is kept by the core until it ends (Scheduler.set_specs), and only its
        signals tell that: dropped, a victim whose stop ended held its GPUs, and its waiter
        waited, until the controller restarted."""
        return self.spec_for(name) is not None or self._known(name)

    def on_job_new(self, job_id: int, path: str, unit: str) -> None:
        if self._unscanned is not None:
            self._unscanned.append((job_id, path, unit, None))
            return
        self.tracker.job_new(path, unit)
        self._follow_shutdown()
        if not self.ready:
            if is_instance(unit) and self.spec_for(unit) is not None:
                # matched once start-up narrows the rules to the units that matter (_rewatch):
                # announced after ListUnits, its start was not among them, and its end was
                # never heard. Its down, if it came before ready, takes it out (_follow_gate)
                self.instances.announced.add(unit)
            return
        if self.spec_for(unit) is None:
            if self.rescans.task is not None:  # the scan under way may annotate it
                self.queued.unseen()
            return
        self._follow_instance(unit)
        watched = self.systemd.watches(unit)
        if watched:  # else its gate's signal may not reach us: no pipe
            self.gates.expect(unit)  # before its gate looks for its pipe
        if self.scheduler.phase(unit) is None and not self.scheduler.is_waiting(unit):
            # a start the scheduler does not know yet (not its own, not one at its gate)
            if not watched:  # not seen at its gate, as those started with it are
                self.queued.unseen()
            seen = self.tracker.heard(unit)
            asyncio.get_running_loop().call_later(QUEUED_DELAY, self._queued, unit, job_id, seen)
        elif self.scheduler.keeps_place(unit):  # a start of ours (refill, comeback)
            self._kept_jobs[unit] = job_id
            asyncio.get_running_loop().call_later(KEPT_WALK_DELAY, self._kept_queued, unit, job_id)
        # someone's stop of a waiter at its gate, its start's end heard: down for the core
        # now, not once its PropertiesChanged comes (the signals of a later call may come
        # first: a refusal's job that ends, which decides again for it). Any other job
        # decides nothing: a pass over every waiter for each job of a burst was the cost
        changes = self.tracker.stopped_at_gate(unit)
        if changes:
            with self._batched():
                for change in changes:
                    self._apply(change)

    def _follow_instance(self, unit: str) -> None:
        """An instance of an annotated template, new to us, is heard from now on (its gate,
        without a pipe this time, asks over D-Bus; the unit is read once matched). One
        still matched (it ended and was forgotten, its rule not removed yet) is kept
        matched too: a re-match meanwhile would drop the rule, and its gate, waiting on
        the pipe made at its JobNew, would never be seen at start-pre. A re-match under way
        was computed without it and may drop its rule: one more follows it."""
        if is_instance(unit) and unit not in self.instances.announced:
            self.instances.announced.add(unit)
            if not self.systemd.watches(unit) or self._rewatching:
                self._rewatch()

    def _starts_read(self, starts: list[UnitSpec], units: list[str], gates: dict[str, str]) -> None:
        """systemd's queued starts, read for the gate calls and the starts at their gate
        that waited (gpuslice/queued.py): those the core did not know are announced, in the
        order systemd made them (an instance is matched from now on, as at its JobNew), and
        the starts at their gate, then the calls, judged, all in one scheduling pass. Not
        held back again by a rescan begun since (Rescans.park): each was judged on a scan
        begun after it came, and parked again, it waited as long as daemon-reloads kept
        coming."""
        with self._batched():
            for spec in starts:
                self._follow_instance(spec.name)
                self.execute(self.scheduler.announce(spec))
            self._gates_after_scan(dict(gates), placed=True)
            for unit in units:
                self.judge.acquire_verified(unit, placed=True)

    def _queued(self, unit: str, job_id: int, seen: int) -> None:
        """A job systemd announced for an annotated unit has not reached its gate: it may be
        a start waiting in systemd's queue (behind an `After=` unit that is starting)."""
        if self.tracker.heard(unit) == seen:
            self._spawn(self._announce_queued(unit, job_id, seen))

    async def _announce_queued(self, unit: str, job_id: int, seen: int) -> None:
        """A start job queued for an annotated unit is known before its gate runs: the unit
        is served in priority order from now on (Scheduler.announce), so that its victims
        start stopping now and no less urgent unit is granted the GPUs it takes later.
        JobNew names no job type, so systemd's queue is read first: a stop job must preempt
        nothing. Any word of systemd's on the unit since JobNew makes the answer stale
        (signals read after it may be applied before this resumes): its gate decides then.
        Nor is a start held behind the start of a GPU unit (queued.starts_waited_for): the
        GPUs kept for it would keep that unit's gate waiting, and neither would run."""
        state = await self.reads.read_fresh(unit, seen)
        await self.rescans.scanned()  # judged on the annotations of now (Rescans.hold_gate)
        if self.tracker.heard(unit) != seen:
            return  # systemd said more of it meanwhile: its gate decides
        spec = self.spec_for(unit)
        if spec is None or state is None or state.job_id != job_id or not bound_for_gate(state):
            return
        if self.tracker.leaving(unit):
            return  # someone's stop at its gate (Tracker.stopped_at_gate): no start
        if at_condition(state):
            return  # its ExecCondition= may skip it: known at its gate (tracker.at_condition)
        waited = await starts_waited_for(self.systemd, job_id)
        await self.rescans.scanned()
        if waited is None or any(self.spec_for(u) is not None for u in waited):
            return  # held behind a GPU unit's start (or not known): known at its gate
        spec = self.spec_for(unit)
        if spec is None or self.tracker.heard(unit) != seen:
            return
        with self._batched():
            self.execute(self.scheduler.announce(spec))

    def _kept_queued(self, unit: str, job_id: int) -> None:
        """A job for a unit whose GPUs are kept until its gate asks (gpuslice's own start)
        has not reached its gate: it may wait in systemd's queue for a GPU unit's start."""
        self._walk_kept(unit, job_id)

    def _walk_kept(self, unit: str, job_id: int, *, again: bool = False) -> None:
        """Walk the job of a start of ours not at its gate yet (`_unkeep_queued`), one walk
        a unit at a time: a flood of gate calls costs one. `again`: a gate asked since the
        walk under way began, which may have read the jobs before that gate's start was
        made: one more walk follows it, if it found the start free."""
        if not self.scheduler.keeps_place(unit) or classify(self.tracker.state(unit)) in (
            Kind.GATE,
            Kind.RUNNING,
        ):
            return
        if self._kept_walks.get(unit) == job_id:
            if again:
                self._kept_again.add(unit)
            return
        self._kept_walks[unit] = job_id
        self._spawn(self._unkeep_queued(unit, job_id))

    def _gate_waits(self, unit: str) -> None:
        """A gate asked, the unit's first ask of this start (Gates.serve_gate): once the
        scheduling pass due this turn has decided (queued before this), a start of ours
        whose GPUs it waits on is walked again (`_kept_in_the_way`)."""
        asyncio.get_running_loop().call_soon(self._kept_in_the_way, unit)

    def _kept_in_the_way(self, unit: str) -> None:
        """The unit's gate waits, and GPUs it may use are kept for a start of ours not at its
        gate yet: that start's job, walked free of any GPU unit's start before, may wait for
        one made since (this unit's: C `After=` B, B started after C's walk), and then
        neither would run. Walked again (`_walk_kept`), and keeps nothing if it does."""
        for name in self.scheduler.kept_in_the_way(unit):
            job = self._kept_jobs.get(name)
            if job is None:  # kept since start-up (Restore.queued_free): systemd's word
                state = self.tracker.state(name)
                job = state.job_id if bound_for_gate(state) else 0
            if job:
                self._walk_kept(name, job, again=True)

    async def _unkeep_queued(self, unit: str, job_id: int) -> None:
        """A start of ours (a refill, a comeback: C `Requires=` and `After=` B) whose job
        waits for the start of a GPU unit keeps no GPUs for its gate (Scheduler.start_waits):
        on one GPU, GPU 0 kept for C kept B's gate waiting while C's start waited for B's,
        and neither ran. The job's own id is walked, not the unit's state read: the answer to
        our call, and the signals after it, come meanwhile. A walk that fails keeps nothing
        either (a job gone has passed its gate, which asked: nothing is kept then). One whose
        job ended meanwhile (`_kept_walks`) says nothing of the start kept for now: the
        walk of a restart's job, slow, ended after that start ran and crashed, and dropped
        the GPUs kept for the next restart. One that reached its gate meanwhile asks
        (Scheduler.request): untouched. Found free, it is walked once more where a gate
        asked meanwhile (`_walk_kept`)."""
        try:
            waited = await starts_waited_for(self.systemd, job_id)
            await self.rescans.scanned()  # judged on the annotations of now
        finally:
            current = self._kept_walks.get(unit)
            if current == job_id:
                del self._kept_walks[unit]
                again = unit in self._kept_again
                self._kept_again.discard(unit)
        if current != job_id:
            return  # its job ended, or a newer one is walked
        if classify(self.tracker.state(unit)) in (Kind.GATE, Kind.RUNNING):
            return
        if waited is None or any(self.spec_for(u) is not None for u in waited):
            with self._batched():
                self.execute(self.scheduler.start_waits(unit))
        elif again:
            self._walk_kept(unit, job_id)

    def on_job_removed(self, job_id: int, path: str, unit: str, result: str) -> None:
        if self._unscanned is not None:
            self._unscanned.append((job_id, path, unit, result))
            return
        if self._kept_walks.get(unit) == job_id:
            del self._kept_walks[unit]  # its walk judges a start no longer queued
            self._kept_again.discard(unit)
        if self._kept_jobs.get(unit) == job_id:
            del self._kept_jobs[unit]
        if self.tracker.job_removed(path, unit, result):
            self.reads.job_ended(unit)
        self.calls.job_ended(job_id, unit)  # a refusal held for it ends
        if self.tracker.shutdown_in_doubt():  # its end told by SystemState alone
            self._spawn(self.reads.audit_shutdown())
        self._follow_shutdown()

    def _follow_shutdown(self) -> None:
        """Tell the core that the host is going down, or that its shutdown was cancelled
        (the tracker reads it from the shutdown targets' jobs): meanwhile it starts nothing
        (Scheduler.set_shutting_down). Before start-up is done, its first pass decides."""
        down = self.tracker.shutting_down
        if down == self.scheduler.shutting_down:
            return
        if not self.ready:
            with self.scheduler.deferred():
                self.scheduler.set_shutting_down(down)
            return
        with self._batched():
            self.execute(self.scheduler.set_shutting_down(down))

    def _holds_read(self, units: list[str], down: bool) -> None:
        """systemd's SystemState, read after these units were held (Rereads.hold_booked):
        the host going down, its shutdown's JobNew was lost on the bus, and their stops were
        the shutdown's (Scheduler.holds_of_shutdown), which is now taken in; else the holds
        stand (Rereads._shutdowns says which)."""
        if not down:
            self.scheduler.holds_confirmed(units)
            for name in units:  # kept for this answer (forget_instance), owed nothing now
                if self.instances.down(name):
                    self.instances.forget(name)
            return
        if not self.tracker.shutting_down:
            self.counters.error("dbus_signals_lost")
            self.tracker.shutdown_read()
            self._follow_shutdown()
        freed = self.scheduler.holds_of_shutdown(units)
        if freed:
            log.warning(
                "systemd says the host is going down, which no signal told (lost on the "
                "bus): %s stopped with the shutdown, not held",
                listed(tuple(freed)),  # a shutdown's thousands of instances: one bounded line
            )
            self.answers.changed()
            self._persist()

    def on_unit_changed(self, name: str, props: dict[str, Any], *, read: bool = False) -> None:
        spec = self.spec_for(name)
        if spec is None and not self._known(name):
            self._unmanaged_gate(name, props)  # its annotation went while it waited there
            return
        if not self.ready:
            self.tracker.unit_changed(name, props)  # counts it; judged after start-up
            self._buffered.append((name, props))
            return
        if spec is not None:
            self.scheduler.learn(spec)
        with self._batched():
            self.restart_results.heard(name)  # a down held for its Result=: told first
            # told down at its gate: shown there still, it may wait again (Tracker._job_at_gate)
            leaving = self.tracker.leaving(name)
            leaving &= classify(self.tracker.state(name)) is Kind.GATE
            changes = self.tracker.unit_changed(name, props, read=read)
            # one being stopped at its gate (Tracker.stopped_at_gate) waits for no rescan
            held = spec is not None and not self.tracker.leaving(name)
            if held and self.rescans.hold_gate(name, props.get("InvocationID")):
                return
            for change in changes:
                self._apply(change)
            if leaving and not self.tracker.leaving(name):
                self._waits_again(name)
            self.calls.unit_heard(name)  # its job gone, its JobRemoved lost
            if spec is not None:
                self._follow_gate(name, props.get("InvocationID"))
            else:
                self._unmanaged_gate(name, props)  # known to the core only until it ends

    def _gates_after_scan(self, pending: dict[str, str | None], *, placed: bool = False) -> None:
        """The starts `Rescans.hold_gate` held back (or QueuedStarts.hold_gate, `placed`
        once systemd's queued starts are read), judged on the annotations of now: as
        their last signal would have been, if they are still at their gate (one that left
        it meanwhile was told by the signals that said so)."""
        for name, invocation in pending.items():
            if classify(self.tracker.state(name)) is not Kind.GATE or self.tracker.leaving(name):
                continue  # left it, or being stopped there (Tracker.stopped_at_gate)
            spec = self.spec_for(name)
            if spec is None:  # its annotation went: its gate, if any, passes over D-Bus
                self._unmanaged_gate(name, {"SubState": "start-pre"})
                continue
            with self._batched():
                self.scheduler.learn(spec)
                if not self._known(name):
                    self._apply(ReachedGate(name))
                self._follow_gate(name, invocation, placed=placed)

    def _unmanaged_gate(self, name: str, props: dict[str, Any]) -> None:
        """A gate of an unannotated unit, which systemd runs while its drop-in stays (a start
        spawned before the daemon-reload that took the annotation out, or a rescan that read
        the file before the reload): at its gate, one that waits on a pipe nobody will write
        (the controller opens only annotated units' pipes) is sent to D-Bus, where it passes
        (`Gates.serve_gate`); once the unit has left its gate, its pipe is closed (no gate of it
        will read it again)."""
        sub = props.get("SubState", "start-pre")
        if sub == "start-pre" and "SubState" in props:
            self.gates.at_gate_unknown(name)  # but one whose pipe we hold: granted, it passes
        elif sub != "start-pre" and self.gates.holds(name):
            self.gates.close(name)

    def _follow_gate(self, name: str, invocation: str | None, *, placed: bool = False) -> None:
        """A start systemd shows at the gate, with the InvocationID that names it, is taken
        in as if its gate had asked, and answered through its pipe (gpuslice/gatepipes.py):
        no D-Bus round trip and no dbus-send. Told of a start at the gate without its
        InvocationID (a state read, not a signal), its gate is sent to D-Bus unless a signal
        names the start within GATE_UNSEEN_DELAY. One the core has not answered waits for a
        read of systemd's queued starts while a start no signal shows may be unknown
        (QueuedStarts.unplaced; `placed` once read)."""
        kind = classify(self.tracker.state(name))
        if kind is not Kind.GATE:
            if self.gates.close(name):
                self.counters.gate_answers["pipe"] += 1
            if kind is Kind.DOWN and is_instance(name):
                self.instances.went_down(name)
                self.instances.forget(name)
        elif at_condition(self.tracker.state(name)):
            return  # its gate has not run, and may never (tracker.at_condition)
        elif invocation is None:
            if not self.gates.holds(name):
                loop = asyncio.get_running_loop()
                loop.call_later(GATE_UNSEEN_DELAY, self._gate_unseen, name)
        elif not placed and self.queued.unplaced and self.judge.unanswered(name):
            self.queued.hold_gate(name, invocation)
        elif self.gates.at_gate(name, invocation):
            self.judge.serve_gate(name)

    def _unfollowed_down(self, name: str) -> None:
        """A unit no longer followed is down: the tracker forgets it, as `Instances.forget`
        has it forget an annotated instance, and on the same terms (no call of ours about it
        unanswered; not waiting to restart, whose down was told once, should its annotation
        come back before the restart). Kept, it held one entry for every such unit until
        the controller restarted (an instance's name may never come again). Annotated
        again, a plain unit is read anew by the rescan (`_apply_scan`), an instance at its
        next start, as any instance forgotten."""
        if not restart_coming(self.tracker.state(name)):
            self.tracker.forget(name)

    def _gate_unseen(self, name: str) -> None:
        """A state read showed the unit at its gate and no signal has named that start since
        (a read answered just before the start's signal is the usual case, and the signal
        has come by now): its gate, if it waits on the pipe, asks over D-Bus."""
        if classify(self.tracker.state(name)) is Kind.GATE:
            self.gates.at_gate_unknown(name)

    def _apply(self, change: Change) -> None:
        if isinstance(change, WentDown):
            name = change.unit
            spec, state = self.spec_for(name), self.tracker.state(name)
            if restartresult.unknown(change, spec, state, self.scheduler.phase(name)):
                self.restart_results.hold(change)  # told once its Result= is read
            else:
                self._went_down(change)
            if self.tracker.leaving(name):  # told at its gate: systemd says which job
                self._read_leaving(name)
        elif isinstance(change, CameUp):
            self.execute(self.scheduler.running(change.unit))
        elif isinstance(change, Exited):
            self.remains.exited(change.unit)
        elif isinstance(change, ReachedGate):
            spec = self.spec_for(change.unit)
            if spec is not None:
                self.execute(self.scheduler.announce(spec))
        else:
            self.calls.cancel_stop_timer(change.unit)
            self.execute(self.scheduler.stop_failed(change.unit, change.why, refused=False))

    def _read_leaving(self, unit: str, tries: int = 0) -> None:
        """A waiter told down at its gate for a job that replaced its start there
        (Tracker.stopped_at_gate) is read, for its job's type, which no signal says: a start
        job shown there (a start that replaced the stop before it ran, its signal lost, or
        the start itself where the signal that showed it at its gate was lost), or none (the
        stop cancelled before it ran, that signal lost), has it wait again. The units told
        so in one turn of the loop are read in one call (a shutdown, or `systemctl stop` of
        thousands of instances waiting, is one read, not thousands)."""
        if not self._leaving_reads:
            asyncio.get_running_loop().call_soon(lambda: self._spawn(self._leaving_read()))
        self._leaving_reads[unit] = tries

    async def _leaving_read(self) -> None:
        """Read the units `_read_leaving` gathered. One that systemd said more of meanwhile
        (the answer may be older) and that is still told down at its gate is read again,
        LEAVING_READS times at most, as is one whose read failed (LEAVING_RETRY_DELAY later:
        left as told, a start that replaced the stop, its signals lost, waited at its gate
        for ever)."""
        units, self._leaving_reads = self._leaving_reads, {}
        seen = {unit: self.tracker.heard(unit) for unit in units}
        try:
            states = await self.systemd.units_state(sorted(units))
        except SystemdError as e:
            self.counters.error("dbus_call_errors")
            log.debug("cannot read the jobs of units stopped at their gate: %s", e)
            loop = asyncio.get_running_loop()
            loop.call_later(LEAVING_RETRY_DELAY, self._read_leaving_again, units)
            return
        for state in states:
            name = str(state.name)
            if name not in seen or not self.tracker.leaving(name):
                continue  # down, or at a gate again: its signals told
            if self.tracker.heard(name) != seen[name]:
                self._read_once_more(name, units[name])
            elif self.tracker.leaving_read(name, state):
                self._waits_again(name)

    def _read_leaving_again(self, units: dict[str, int]) -> None:
        """Read again the units of a failed read still told down at their gate."""
        for unit, tries in units.items():
            self._read_once_more(unit, tries)

    def _read_once_more(self, unit: str, tries: int) -> None:
        """One read more of a unit still told down at its gate, LEAVING_READS in all."""
        if self.tracker.leaving(unit) and tries + 1 < LEAVING_READS:
            self._read_leaving(unit, tries + 1)

    def _waits_again(self, unit: str) -> None:
        """A unit told down at its gate waits there again (its stop replaced by a start
        before it ran): its gate is served as a new start's."""
        if classify(self.tracker.state(unit)) is Kind.GATE and self.spec_for(unit) is not None:
            log.info("%s waits at its gate again: a start replaced its stop", unit)
            with self._batched():
                self.judge.serve_gate(unit)

    def _result_read(self, change: WentDown) -> None:
        """A down held for its Result= (gpuslice/restartresult.py), taken in now."""
        with self._batched():
            self._went_down(change)

    def _went_down(self, change: WentDown) -> None:
        """The unit is down (its outcome known): the core is told, and what it held goes."""
        name = change.unit
        self.calls.cancel_stop_timer(name)
        held = self.scheduler.grants().get(name, frozenset())
        if self.scheduler.phase(name) is not None and (
            self.watch.available or self._holds_lost(held)
        ):
            # VRAM release: what NVML still shows of it now counts against its GPUs;
            # without NVML, a GPU no longer configured that it held goes with it
            self.watch.refresh(released=name)
        # stops of ours under way that may have taken it down with them (`_stopped_with`),
        # read where the core holds it: a stop's outcome, or a suspended unit's (frozen, it
        # cannot have ended by itself) seen down with no job
        stopping = {
            v: w
            for v, w in self.scheduler.stopping().items()
            if v != name and not self._stop_before(change.job, v)
        }
        self.execute(
            self.scheduler.inactive(
                name,
                change.outcome,
                by_itself=change.by_itself,
                not_ours=change.not_ours,
                in_shutdown=change.in_shutdown,
                restarting=restart_coming(self.tracker.state(name)),
            )
        )
        if stopping and name in self.scheduler.held:
            self.scheduler.hold_in_doubt(name, stopping)
            since = self.scheduler.out_since[name]
            self._spawn(self._stopped_with(name, stopping, since))
        self._time_restart(name)
        if name in self.scheduler.unconfirmed_holds:
            self.reads.hold_booked(name)  # held: unless the shutdown's JobNew was lost
        self.service.forget(name)
        self.ladder.went_down(name)
        self.remains.went_down(name)
        if self.spec_for(name) is None and not self._known(name):
            # its annotation went while it held GPUs (let through since on them, maybe):
            # released now, it is no longer followed, and no later signal of it comes
            # to _follow_gate, which only annotated units reach. Its pipe, env file and
            # tracker entry go here, at the down that released it, even when that down
            # is our stop's, whose end (its job gone) is no longer heard
            if is_instance(name):
                self.instances.went_down(name)
            self._unfollowed_down(name)

    def _stop_before(self, job: str, victim: str) -> bool:
        """The job that took a unit down (`job`, its path) was made before the stop job that
        `victim` shows: systemd numbers its jobs as it makes them, and the stop it makes of
        a unit that needs `victim` along with ours is made after ours; one made before
        (someone's stop, still under way) is kept, and the one ours made merged into it."""
        return 0 < job_number(job) < self.tracker.state(victim).job_id

    async def _stopped_with(self, name: str, stopping: dict[str, str], since: int) -> None:
        """The unit went down by a stop not ours while ours of `stopping` were under way, and
        is held: systemd stops with a unit every unit that `Requires=`, `BindsTo=` or is
        `PartOf=` it, which systemd says now (a round trip, on this path only). One of ours
        among them took it down: it is preempted, not held (Scheduler.stopped_with). Not
        read, or held again since (`since`: its down), the hold stands (`hold_stands`). The
        victims are not brought back meanwhile (Scheduler.hold_in_doubt)."""
        try:
            needs = await self.systemd.needs(name)
        except Exception as e:  # whatever failed, the hold stands (in doubt, no victim came back)
            self.counters.error("dbus_call_errors")
            log.debug("cannot read what %s needs: %s", printable(name), e)
            needs = {}
        found = [
            (victim, f"{prop}=")
            for prop, units in needs.items()
            for victim in sorted(stopping.keys() & set(units))
        ]
        if found and self.scheduler.out_since.get(name) == since:
            victim, why = found[0]
            self.execute(self.scheduler.stopped_with(name, victim, why, stopping[victim]))
        else:
            self.execute(self.scheduler.hold_stands(name))

    def _time_restart(self, name: str) -> None:
        """A unit whose GPUs the core keeps for its Restart= has them for RESTART_KEEP at
        most (Scheduler.restart_overdue), or, no restart seen yet (systemd 252 signals
        `failed` first), for RESTART_SIGNAL_WAIT (`_restart_unseen`); a timer of an earlier
        keep goes."""
        timer = self._restart_timers.pop(name, None)
        if timer is not None:
            timer.cancel()
        self._restart_since.pop(name, None)
        if name in self.scheduler.restart_kept:
            self._restart_since[name] = clock.moment()
            loop = asyncio.get_running_loop()
            if restart_coming(self.tracker.state(name)):
                timer = loop.call_later(RESTART_KEEP, self._restart_overdue, name)
            else:
                timer = loop.call_later(RESTART_SIGNAL_WAIT, self._restart_unseen, name)
            self._restart_timers[name] = timer

    def _restart_unseen(self, name: str) -> None:
        """RESTART_SIGNAL_WAIT after a down with no restart seen then: kept on, said once,
        until RESTART_KEEP after it if systemd now shows its Restart= under way (waiting in
        `auto-restart`, its restart job queued, or its gate run); else they go, as after any
        failure (its `failed` said no restart) or clean exit (said, its keep was)."""
        self._restart_timers.pop(name, None)
        if name not in self.scheduler.restart_kept:
            return
        state = self.tracker.state(name)
        # a clean exit's keep was said with it (its Restart= restarts one): said again only
        # if it ends; a failure's `failed` claimed no restart: said only if it goes on
        clean = self.scheduler.restart_kept[name] is Outcome.EXITED
        if not (restart_coming(state) or bound_for_gate(state)):
            self._restart_overdue(name, said=clean, within=RESTART_SIGNAL_WAIT)
            return
        gpus = self.scheduler.grants().get(name)
        if gpus and not clean:  # else its place was taken by a more urgent start: it waits
            log.info("%s", kept_for_restart_said(printable(name), sorted(gpus)))
        loop = asyncio.get_running_loop()
        self._restart_timers[name] = loop.call_later(
            RESTART_KEEP - RESTART_SIGNAL_WAIT, self._restart_overdue, name
        )

    def _restart_overdue(
        self, name: str, *, said: bool = True, within: float = RESTART_KEEP
    ) -> None:
        """RESTART_KEEP (`within`) is over: GPUs still kept for the unit's restart go (said
        once, if the keep was; it is failed, or finished, now, which no decision may show, so
        status and the state file are told). An instance down for good, owed nothing now, is
        forgotten here: no later signal of it comes to (`Instances.forget`; one in
        `auto-restart` is kept)."""
        self._restart_timers.pop(name, None)
        self._restart_since.pop(name, None)
        kept = name in self.scheduler.restart_kept
        actions = self.scheduler.restart_overdue(name)
        if kept and (name in self.scheduler.failed or name in self.scheduler.finished):
            if said:
                log.info(
                    "%s was not started again by its Restart= within %.0f s: its GPUs are no "
                    "longer kept for it",
                    printable(name),
                    within,
                )
            self.answers.changed()  # failed now, where nothing else may be decided
            if not actions:
                self._persist()
        self.execute(actions)
        if kept and self.instances.down(name):
            self.instances.forget(name)

    def _still_exited(self, unit: str) -> bool:
        """The unit still shows `active (exited)`, and the core has not released it."""
        known = remains_active(self.tracker.state(unit))
        return known and unit not in self.scheduler.remained

    def _at_audit(self) -> None:
        """What each audit asks again that no signal would tell: holders shown `active
        (exited)`, and waiters still told down at their gate (their reads failed each time:
        a start that replaced the stop, its signals lost, is found at the next audit, not
        left waiting at its gate for ever)."""
        self._recheck_exited()
        for unit in self.tracker.leaving_units():
            self._read_leaving(unit)

    def _recheck_exited(self) -> None:
        """At each audit, every holder systemd shows `active (exited)` is asked about again:
        systemd signals nothing when its last leftover process ends (KillMode=), nor does a
        unit frozen or being suspended when its check came (Scheduler.exited) change when
        it runs again, nor does a failed GetUnitProcesses answer again. Left at that, its
        GPUs stayed reserved, and its waiters waited, until someone stopped it."""
        for name in sorted(self.scheduler.grants()):
            if self.scheduler.phase(name) is Phase.RUNNING and self._still_exited(name):
                self.remains.exited(name)

    def _release_exited(self, unit: str) -> None:
        """No process is left in a unit systemd keeps active (Remains): its GPUs go now,
        as at its down (what NVML still shows of it counts against them meanwhile), or,
        being stopped by us, at that stop's end. Saved at once either way: a restarted
        controller must not adopt it again, nor take that stop's end for a preemption. Its
        env file names no GPU first (its later commands, ExecReload= and ExecStop=, ran on
        GPUs granted since to another unit); until that is written it keeps its GPUs."""
        phase = self.scheduler.phase(unit)
        released = (None, Phase.RUNNING, Phase.STARTING, Phase.STOPPING)  # Scheduler.exited
        told = unit not in self.scheduler.specs or phase not in released
        if not (told or self.delivery.tell_none(unit)):
            return  # asked again at the next audit (_recheck_exited)
        held = self.scheduler.grants().get(unit, frozenset())
        if phase in (Phase.RUNNING, Phase.STARTING) and (
            self.watch.available or self._holds_lost(held)
        ):
            self.watch.refresh(released=unit)
        with self._batched():  # deferred: exited's actions are a journal line at most
            self.execute(self.scheduler.exited(unit))
        if unit in self.scheduler.remained:
            self._persist()  # now, not left to the pass due this turn

    def _holds_lost(self, gpus: Collection[int]) -> bool:
        """Whether any of these GPUs is lost in the last sample. Without NVML, one is only
        while units hold it (`gpus:` or `manage_gpus` made fewer by a reload, or a restart):
        not sampled again at the holder's end, it stayed lost in status and in
        `gpuslice_gpu_lost` until the next reload."""
        return any(g.lost for g in self.watch.sample.gpus if g.index in gpus)

    def on_reloading(self, active: bool) -> None:
        if not active:
            self.rescans.reloaded()

    def on_systemd_restarted(self) -> None:
        """systemd re-executed: signals may have been lost meanwhile; read every unit we
        track again, and the unit files."""
        for name in list(self.tracker.states):
            self._spawn(self.reads.refresh(name))
        self.rescans.reloaded()

    def _apply_scan(self, result: Scan) -> None:
        # plain units this scan annotates, that the tracker did not follow: their signals
        # were dropped, and a re-match reads only the units it matches anew, none while the
        # rule for every unit is in force (beyond MAX_UNIT_RULES): a unit annotated while it
        # ran was never adopted then, and its GPU was granted beside it
        fresh = [
            n
            for n in sorted(result.specs)
            if not is_template(n) and self.spec_for(n) is None and not self._known(n)
        ]
        self.scan = result
        self.answers.changed()  # its problems and priorities, even if nothing is decided
        for problem in result.problems:
            self._log_problem(problem)
        starts = set(self.scheduler.waiting_units()) | set(self.scheduler.grants())
        specs = self._concrete_specs()
        # records of units no longer annotated, forgotten: saved now, even where nothing is
        # said (a hold, an end), lest a restarted controller find them again once annotated
        forgets = bool(self.scheduler.recorded() - specs.keys())
        kept = set(self.scheduler.stopped_by_shutdown)
        actions = self.scheduler.set_specs(specs)
        self.execute(actions)
        # instances the shutdown stopped, no longer background (owed no refill): forgotten
        # as any instance owed nothing, and not saved until the next reboot
        unkept = kept - self.scheduler.stopped_by_shutdown
        if (forgets or unkept) and not actions:
            self._persist()
        for name in sorted(unkept):
            if self.instances.down(name):
                self.instances.forget(name)
        for unit in sorted(starts):
            if self.spec_for(unit) is None and not self._known(unit):
                self.judge.let_through(unit)  # its start, not yet answered, is forgotten
        self._forget_unannotated_down()
        for unit in fresh:
            if self.systemd.watches(unit):  # else read once matched (_watch_units)
                self._spawn(self._read_unheard(unit, self.tracker.heard(unit)))
        self._rewatch()

    def _forget_unannotated_down(self) -> None:
        """Units down whose annotation went (their file removed, or its `[X-GPUSlice]`)
        and that the core no longer knows are forgotten by the tracker (`_unfollowed_down`)
        and lose their gate's pipe and env file, as an instance's down does
        (`Instances.went_down`): no signal of theirs comes to do it, and no gated start of theirs
        (its drop-in went with the annotation) removes them. Kept, each unit file ever
        removed (a job queue's `gpuslice new` per job) held a tracker entry, a file, and a
        pipe every audit opened (`GatePipes.wake_unheard`), until the controller restarted."""
        for name in sorted(self.tracker.states):
            if not self._followed(name) and classify(self.tracker.state(name)) is Kind.DOWN:
                self.instances.went_down(name)
                self._unfollowed_down(name)

    async def _read_unheard(self, unit: str, seen: int) -> None:
        """Read a unit newly followed, unless a signal of it told its state meanwhile."""
        if self.tracker.heard(unit) == seen:
            await self.reads.refresh(unit)

    def reload_config(self, recheck: bool = False) -> bool:
        """Read config.yaml and apply it, or keep the last good one. With `recheck`, False
        and nothing done when the file changed while it was read. /proc's mount is read
        again whatever the file holds (an admin who remounted it with hidepid= sends SIGHUP)."""
        self.answers.read_proc_mount()
        try:
            if recheck:
                loaded = read_unchanged(self.config_path, load_config_with_warnings)
            else:
                loaded = load_config_with_warnings(self.config_path)
        except ConfigError as e:
            log.error("keeping the last good configuration: %s", e)
            return True
        if loaded is None:
            return False
        config, warnings = loaded
        for warning in warnings:
            log.warning("%s", warning)
        config = self._keep_paths(config)
        self.config = config
        self.watch.reconfigure(config)
        self.scheduler.set_policy(
            yield_to_foreign=config.foreign_processes == "yield",
            requeue_at_gate=config.requeue_at_gate,
        )
        logging.getLogger().setLevel(config.log_level.upper())
        # said: a reload takes effect up to a few seconds after the signal (Reloads)
        log.info("configuration reloaded from %s", self.config_path)
        self.watch.refresh()
        self.rescans.request()
        return True

    def _keep_paths(self, config: Config) -> Config:
        """`config` with the paths this controller started with. The gates' drop-ins name
        runtime_dir, which is this boot's (paths.RUNTIME_DIR_RECORD), and the state file was
        read from state_dir at start: env files written elsewhere on a reload alone would
        leave a unit reading a stale one (its last grant's GPUs) or none (every GPU)."""
        kept = dataclasses.replace(
            config, runtime_dir=self.config.runtime_dir, state_dir=self.config.state_dir
        )
        if config.runtime_dir != kept.runtime_dir:
            _runtime_dir_not_yet(self.config_path, config.runtime_dir, kept.runtime_dir)
        if config.state_dir != kept.state_dir:
            log.warning(
                "%s: state_dir: %s takes effect when gpuslice.service restarts (until then %s)",
                located(self.config_path, "state_dir"),
                config.state_dir,
                kept.state_dir,
            )
        return kept

    def _concrete_specs(self, remembered: Iterable[str] = ()) -> dict[str, UnitSpec]:
        """Specs of plain units, and of the instances systemd shows or we remember (a
        preempted instance that systemd garbage-collected must still come back)."""
        specs = {n: s for n, s in self.scan.specs.items() if not is_template(n)}
        names = set(self.tracker.states) | set(remembered) | self.scheduler.annotated()
        for name in names:
            if is_instance(name) and name not in specs:
                spec = self.spec_for(name)
                if spec is not None:
                    specs[name] = spec
        return specs

    # -- the gate ---------------------------------------------------------------------------

    def on_acquire(self, unit: str, sender: str) -> None:
        """A gate's call, judged in gpuslice/gates.py (`Gates.verify_acquire`). One that
        comes before start-up is done (our name is claimed first) waits for it: served on a
        core the saved state is not loaded into yet, a unit preempted or granted before the
        restart could be granted GPUs that others hold. Its call waits in the service
        meanwhile (MAX_PENDING_PER_UNIT)."""
        seen = self.tracker.signals(unit)
        if not self.ready:
            self._early_acquires.append((unit, sender, seen))
            return
        self._spawn(self.judge.verify_acquire(unit, sender, seen))

    @contextlib.contextmanager
    def _batched(self) -> Iterator[None]:
        """Take in an event now and decide once for every event handled before the loop
        turns: dbus-next hands over all the signals of one read in a row, and a burst of
        starts would otherwise cost a scheduling pass over every waiter for each of them.
        What the event itself answers (a gate whose GPUs were kept for it) goes at once."""
        self._batching += 1
        try:
            with self.scheduler.deferred():
                yield
        finally:  # even after a bug in handling the event: nothing is left undecided
            self._batching -= 1
            if not self._decision_due:
                self._decision_due = True
                asyncio.get_running_loop().call_soon(self._decide)

    def _decide(self) -> None:
        """The scheduling pass after a batch of events: decides, then saves what the batch
        changed if its decisions sent nothing (a call is sent only after a save). Nothing
        when a plan already ran this turn's pass (plan_json)."""
        if not self._decision_due:
            return
        self._decision_due = False
        self.execute(self.scheduler.schedule())
        if self._save_due:
            self._persist()

    def save_now(self) -> None:
        """Save what is not saved yet (the controller stops before its pass ran)."""
        if self._save_due:
            self._persist()

    # -- actions ------------------------------------------------------------------------------

    def execute(self, actions: list[Action]) -> None:
        """Carry out the core's actions, the waiting unit's first: gates are answered, then
        the state is saved, then the calls to systemd and the ladder's tasks leave (a
        controller killed after a StopUnit knows its victim was preempted; after a FreezeUnit
        or a cuda-checkpoint lock, that it froze or was suspending the unit), and only then
        is each decision written to the journal, whose write would delay them (issue 10).
        Only a batch of events that answered no gate and sent nothing leaves its save to
        the pass due this turn: a grant saved a turn later left a killed controller's
        successor to take a start it had granted for one never sent (`start_lost`)."""
        calls: list[tuple[JobCall, str, str]] = []
        urgent = False  # a grant, or a ladder step: saved now, not by the pass due this turn
        for action in actions:
            if action.decision is not None:
                self.counters.decided(action.decision.code)
            if isinstance(action, (Grant, Suspend, Resume, Freeze, Thaw)):
                urgent = True
            if isinstance(action, Grant):
                self.counters.admission_wait.observe(self._waited(action.unit))
                self.delivery.deliver(action.unit, action.gpus)
            elif isinstance(action, Stop):
                calls.append((self.systemd.stop_unit, action.unit, "stop"))
            elif isinstance(action, Start):
                calls.append((self.systemd.restart_preempted, action.unit, "start"))
        if actions:
            self.answers.changed()
            if calls or urgent or not self._batching:
                self._persist()
            else:  # the pass due this turn saves once for its batch (a unit's end, then
                self._save_due = True  # the refill it allows: one save, not two, issue 10)
        for method, unit, what in calls:
            self.calls.send(method, unit, what)
            if what == "stop":
                self.calls.arm_stop_timer(unit)
        for action in actions:
            if isinstance(action, Log):
                self._say(action.message, action.level, action.decision)
            else:
                self._say(action.reason, "info", action.decision)
            if isinstance(action, Suspend):
                self._spawn(self.ladder.suspend(action.unit, action.thaw_first, action.thaw_owed))
            elif isinstance(action, Resume):
                self.delivery.tell_again(action.unit, action.gpus)
                self._spawn(self.ladder.resume(action.unit))
            elif isinstance(action, Freeze):
                self._spawn(self.ladder.freeze(action.unit, action.thaw_owed))
            elif isinstance(action, Thaw):
                self._spawn(self.ladder.thaw(action.unit))
        if actions:
            self._track_waiters()
        self.watch.arm_sampler()

    def _report(self, event: Callable[[], list[Action]]) -> None:
        """The ladder reports the outcome of a freeze, suspend or resume: a core event,
        saved at once. Left to the pass due this turn, the save came after the grants that
        pass makes, and `execute` answers gates first: a suspend done frees its waiter's
        GPUs, and a controller killed between that grant and its save left its successor
        the unit saved as suspending, which `recover` resumes on the GPUs it held, now the
        granted unit's (two jobs on one GPU; a restore that runs out of memory is
        permanent). A suspend takes seconds; one more save, far less."""
        with self._batched():
            self.execute(event())
        self.save_now()

    def _gpu_processes(self) -> list[GpuUse] | None:
        """Every GPU process with its unit, from a sample taken now; None without NVML."""
        if not self.watch.available:
            return None
        self.watch.refresh()
        return None if self.watch.stale else list(self.watch.sample.processes)

    def _decide_on(self, gpus: list[Gpu]) -> None:
        """New GPUs from NVML (a sample, the driver back or gone): decide again; and, at the
        sampling pace, whether someone thawed a unit gpuslice froze (nothing signals it)."""
        self.answers.changed()
        self.execute(self.scheduler.set_gpus(gpus))
        self._check_freezer()

    def _check_freezer(self) -> None:
        """Ask systemd for the FreezerState of the units gpuslice froze: held frozen, was one
        thawed by hand? No longer held frozen, is one still frozen (a ThawUnit that failed,
        or that a killed controller never sent)? Then it is thawed. One check at a time. Not
        one being stopped: systemd thaws a unit to stop it, and taken for thawed by hand, a
        frozen unit ended running (owed nothing; failed on a 143, not held:
        Tracker._stopped_frozen) where its stop took longer than a sample."""
        frozen = [
            n
            for n in self.scheduler.frozen_units()
            if self.tracker.state(n).active != "deactivating"
        ]
        owed = self.scheduler.thaws_owed()
        if (frozen or owed) and self.ready and not self._checking_thaws:
            self._checking_thaws = True
            self._spawn(self._check_thaws(frozen, owed))

    async def _check_thaws(self, frozen: list[str], owed: list[str]) -> None:
        try:
            await self.ladder.check_thawed(frozen)
            await self.ladder.thaw_owed(owed)
        finally:
            self._checking_thaws = False

    def _say(self, message: str, level: str, decision: Decision | None) -> None:
        """One line per decision: as a journal entry that its unit's journal shows too, or,
        without a journal (or when it cannot be written), as a plain log line."""
        number = logging.getLevelName(level.upper())
        if not log.isEnabledFor(number):
            return
        if decision is not None and self.journal is not None:
            waited = self._waited_usec(decision)
            if self.journal.send(decision_fields(decision, message, level, waited)):
                return
        log.log(number, "%s", message)

    def _waited_usec(self, decision: Decision) -> int | None:
        """How long a granted unit waited at its gate (0: granted at once); None otherwise."""
        if decision.code is not Code.GRANT:
            return None
        return int(self._waited(decision.unit) * 1_000_000)

    def _waited(self, unit: str) -> float:
        """Seconds the unit has waited at its gate so far (0: not waiting)."""
        since = self.waiting_since.get(unit)
        return 0.0 if since is None else clock.moment() - since

    def _track_waiters(self) -> None:
        """Note when each waiter started waiting; forget those that no longer wait."""
        waiting = set(self.scheduler.waiting_units())
        for name in list(self.waiting_since):
            # GPUs kept for it until its gate asks: it still waits, until its grant
            if name not in waiting and self.scheduler.phase(name) is not Phase.STARTING:
                del self.waiting_since[name]
        for name in waiting:
            self.waiting_since.setdefault(name, clock.moment())

    def _known_units(self) -> set[str]:
        """The units the core knows (holders, waiters, suspended, and those released while
        systemd keeps them active, whose lost stop left them shown `(still active)`, and
        `gpuslice plan` saying a start would change nothing): what the periodic read checks
        against their signals."""
        core = self.scheduler
        return {*core.grants(), *core.waiting_units(), *core.suspended_units(), *core.remained}

    def _wake_unheard_gates(self) -> None:
        """Gates that wait on their pipe for a start whose signals were all lost, of units the
        core does not know (the audit reads those it knows), ask over D-Bus instead: nothing
        else would ever open their pipe. Not before a whole audit interval passed with no
        signal of that start (GatePipes.wake_unheard): one read late is no loss. Nor a start
        held back while a rescan runs (`Rescans.hold_gate`): its signal was heard, and it is
        taken in at its pipe once the scan is read; woken, each start of a burst held back
        was said lost."""
        rescanning = self.rescans.task is not None

        def unheard(name: str) -> bool:
            if self._known(name):
                return False
            return not (rescanning and classify(self.tracker.state(name)) is Kind.GATE)

        for unit in self.gates.wake_unheard(unheard):
            self.counters.error("dbus_signals_lost")
            log.warning(
                "%s waits at its gate on its pipe, yet no word of that start reached gpuslice "
                "(its signals were lost on the bus): it asks over D-Bus now",
                printable(unit),
            )

    def _managed_units(self) -> set[str]:
        """Units whose GPU processes are not foreign: annotated, holding, or tracked and still
        followed (an instance not learned yet, a waiter or suspended unit whose annotation
        went). The tracker also keeps units no longer followed (one unannotated while down,
        until the rescan applied, `_forget_unannotated_down`; one waiting to restart, left
        at its down: `_unfollowed_down`): counted, an ungated run's processes were a
        managed unit's, never foreign, and a background unit kept (or was granted) their GPU
        under `foreign_processes: yield`."""
        names = set(self.scheduler.annotated()) | set(self.scheduler.grants())
        # asked of the others only: taken at every sample (each holder's down, a handover,
        # among them), `_followed` of every tracked unit built an instance's spec anew for
        # each (46 ms a sample at 10,000 instances running or waiting)
        return names | {n for n in self.tracker.states.keys() - names if self._followed(n)}

    def _persist(self) -> None:
        """Save what systemd cannot tell a restarted controller. A full disk is reported
        once, not at every decision, and again when saving works."""
        self._save_due = False
        try:
            saved = self.scheduler.save()
            saved.checkpointed = self.ladder.checkpointed(saved.suspended)
            where = self.store.save(saved, self.boot_id)
        except OSError as e:
            self._save_failed(e)
        else:
            if where != self.store.path:
                self._save_failed(self.store.failure, f"; kept in {where} meanwhile (until reboot)")
            else:
                if self._save_failing:
                    log.info("state saved to %s again", self.store.path)
                self._save_failing = False
                self._flusher.saved(asyncio.get_running_loop())
        if not self._status_due:  # STATUS= at most once per STATUS_DELAY: see there
            self._status_due = True
            asyncio.get_running_loop().call_later(STATUS_DELAY, self._send_status)

    def _save_failed(self, error: OSError | None, meanwhile: str = "") -> None:
        self.counters.error("state_save_errors")
        if not self._save_failing:
            log.error(
                "cannot save state to %s: %s (said once until it works)%s",
                self.store.path,
                error,
                meanwhile,
            )
        self._save_failing = True

    def _flushed(self, error: OSError | None) -> None:
        """A flush of the state file ended: a failing disk is reported once, as saves are."""
        if error is None:
            if self._flush_failing:
                log.info("state flushed to disk again (%s)", self.store.path)
            self._flush_failing = False
            return
        self.counters.error("state_save_errors")
        if not self._flush_failing:
            log.error(
                "cannot flush the state in %s to disk: %s (said once until it works); "
                "a power cut may lose it",
                self.store.path,
                error.strerror or error,
            )
        self._flush_failing = True

    def _send_status(self) -> None:
        self._status_due = False
        self.notifier.status(self.status_line())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    def _log_problem(self, problem: Problem) -> None:
        level = logging.ERROR if problem.severity == "error" else logging.WARNING
        log.log(level, "%s", problem)

    # -- status -------------------------------------------------------------------------------

    def status_line(self) -> str:
        """STATUS=: the holders by what they are doing (StatusAnswers.status_line)."""
        return self.answers.status_line()

    def status_json(self, redacted: bool = False, uid: int | None = None) -> str:
        """The Status answer (StatusAnswers.status_json); `Starting` before start-up is done
        (`_not_before_ready`)."""
        self._not_before_ready()
        return self.answers.status_json(redacted, uid)

    def status_for(self, sender: str) -> str | Coroutine[Any, Any, str]:
        """The Status answer for the caller of this unique bus name (StatusAnswers);
        `Starting` before start-up is done (`_not_before_ready`)."""
        self._not_before_ready()
        return self.answers.status_for(sender)

    def _not_before_ready(self) -> None:
        """Status and Plan wait for start-up: our name is claimed first (`start`), and until
        the saved state and systemd's units are read in, the core would say "idle" of GPUs
        that jobs hold."""
        if not self.ready:
            raise Starting("gpuslice is starting: ask again in a moment")

    def plan_json(self, unit: str) -> str:
        """`gpuslice plan UNIT`: what a start of it would do now, changing nothing (root
        only, by the bus policy: a copy of the state costs tens of ms at 10,000 units). Not
        before start-up is done: the core does not hold the saved state yet."""
        self._not_before_ready()
        spec = self.spec_for(unit)
        if spec is None:
            raise NotManaged(
                f"{unit} is not managed by gpuslice: no [X-GPUSlice] annotation in force "
                "(`gpuslice check` says why)"
            )
        if self._decision_due:
            self._decide()  # events taken in this turn are decided first, as they will be
        return json.dumps(plan_start(self.scheduler, spec).to_json(), sort_keys=True)

    def _adapter_counts(self) -> list[tuple[str, int]]:
        """What the adapters count, for status's "counters" (StatusAnswers.status_counters)."""
        return [
            ("dbus_signals_dropped", self.systemd.dropped),
            ("nvml_errors", self.watch.inventory.errors),
            ("nvml_timeouts", self.watch.nvml.timeouts),
            ("journal_write_errors", self.journal.failures if self.journal is not None else 0),
            ("notify_errors", self.notifier.failures),
        ]


def _log_failure(task: asyncio.Task[None]) -> None:
    """A bug in a task must show in the journal, not vanish with the task."""
    if not task.cancelled() and task.exception() is not None:
        log.error("internal error", exc_info=task.exception())


_PRIORITIES = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}  # syslog's


class JournalFormatter(logging.Formatter):
    """Plain sentences with the <N> syslog prefix journald reads, on every line: journald
    makes each line of a stream an entry, so a traceback (`log.exception`, "internal error")
    is kept, at its record's level, and no line of a message can set its own level."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        prefix = f"<{_PRIORITIES.get(record.levelname, 6)}>"
        return "\n".join(prefix + line for line in text.splitlines() or [""])


def _journal_logging(level: str) -> None:
    """Plain sentences on stderr that journald files at their levels."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        JournalFormatter()
        if os.environ.get("JOURNAL_STREAM")
        else logging.Formatter("%(levelname)s %(message)s")
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _runtime_dir_not_yet(config_path: Path, configured: str, kept: str) -> None:
    log.warning(
        "%s: runtime_dir: %s takes effect at the next boot: the gates' drop-ins name %s, "
        "where gpuslice writes until then",
        located(config_path, "runtime_dir"),
        configured,
        kept,
    )


def _runtime_dir_of_this_boot(config: Config, config_path: Path) -> Config:
    """`config` with the runtime_dir the gates' drop-ins name, which the controller records
    once its bus name is its own (`_record_runtime_dir`) for the generator to keep naming it:
    the one gpuslice-generator told this start (RUNTIME_DIR_ENV), else the one recorded by a
    controller earlier this boot, else config.yaml's. Taken from config.yaml alone, a restart
    (Restart=, a driver loaded late) after runtime_dir was edited wrote env files where no
    unit read them (every GPU visible), and a daemon-reload while the controller ran pointed
    the gates where it did not write."""
    told = os.environ.get(RUNTIME_DIR_ENV)
    if told is not None and runtime_dir_value(told) is None:
        log.error("%s=%s is not a valid runtime_dir: ignored", RUNTIME_DIR_ENV, printable(told))
    runtime_dir = runtime_dirs_of_this_boot(told, RUNTIME_RECORD, config.runtime_dir)[0]
    if runtime_dir != config.runtime_dir:
        _runtime_dir_not_yet(config_path, config.runtime_dir, runtime_dir)
    return dataclasses.replace(config, runtime_dir=runtime_dir)


def _record_runtime_dir(record: Path, runtime_dir: str, config_path: Path) -> None:
    """Record the runtime_dir the controller runs with (`_runtime_dir_of_this_boot`) at
    `record`, by the controller that owns our bus name only: a second one's record, of
    another config.yaml, pointed the gates away from the one that runs."""
    try:
        pin_runtime_dir(record, runtime_dir)
    except OSError as e:
        log.error(
            "cannot record the runtime_dir in %s (%s): a daemon-reload after runtime_dir is "
            "changed in %s points the gates elsewhere",
            record,
            e,
            config_path,
        )


async def run(config_path: Path, bus_address: str | None = None) -> int:
    loop = asyncio.get_running_loop()
    # SIGHUP's default action ends the process: a `kill -HUP` while this connects to the
    # bus or reads the unit files failed the start (before READY=1), which systemd restarts
    # a second later and counts against its start limit (five in ten seconds: then failed,
    # every gate waiting). One that comes before the controller exists is a reload once it
    # has started (the file may have changed since it was read below).
    early_reload: list[None] = []
    loop.add_signal_handler(signal.SIGHUP, early_reload.append, None)
    try:
        config, warnings = await load_settled(config_path)
    except ConfigError as e:
        _journal_logging("info")
        log.error("%s", e)
        return 78  # EX_CONFIG: systemd shows it; the unit's RestartPreventExitStatus= ends there
    _journal_logging(config.log_level)
    for warning in warnings:
        log.warning("%s", warning)
    raise_fd_limit()  # before anything opens: gatepipes.MAX_OPEN
    systemd = await Systemd.connect(bus_address)
    config = _runtime_dir_of_this_boot(config, config_path)  # recorded by start()
    # under systemd (stderr to the journal) decisions also go to their units' journals
    journal = Journal() if os.environ.get("JOURNAL_STREAM") else None
    controller = Controller(
        config, config_path, systemd, journal=journal, ask_journal=stopjournal.ask
    )
    stop = loop.create_future()

    def request_stop() -> None:
        if not stop.done():
            stop.set_result(0)

    loop.add_signal_handler(signal.SIGTERM, request_stop)
    loop.add_signal_handler(signal.SIGINT, request_stop)
    loop.add_signal_handler(signal.SIGHUP, controller.reloads.request)
    if early_reload:
        controller.reloads.request()
    controller.runtime_record = RUNTIME_RECORD
    controller.state_record = STATE_RECORD
    controller.boot_record = THIS_BOOT_RECORD
    starting = loop.create_task(controller.start())
    await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done() and not controller.name_claimed:
        # stopped while it waits for `gpuslice release-jobs` to let go of the bus name, which
        # may take RELEASE_WAIT: nothing is read or written yet. Left to wait, a `systemctl
        # stop` (apt remove's prerm among them) waited for it until TimeoutStopSec= killed it.
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, NameTaken):
            await starting
        log.info(
            "stopped while waiting for its bus name; this controller exits, having changed nothing"
        )
        return 0
    try:
        await starting
    except NameTaken as e:  # claimed before anything was written: nothing to undo
        log.error("%s; this controller exits, having changed nothing", e)
        return 1
    interval = controller.notifier.watchdog_interval()
    if interval:

        async def feed() -> None:
            while True:
                controller.notifier.watchdog()
                await asyncio.sleep(interval)

        controller._spawn(feed())
    disconnected = loop.create_task(systemd.bus.wait_for_disconnect())
    done, _ = await asyncio.wait({stop, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    if disconnected in done:
        log.error("lost the system bus; exiting so that systemd restarts the controller")
        return 1
    controller.save_now()
    controller.notifier.send("STOPPING=1")
    log.info("gpuslice stopping; running jobs are left alone")
    if journal is not None:
        journal.close()  # what journald had not taken yet, if it takes it now
    return 0
