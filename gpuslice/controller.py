"""The controller daemon: the composition root that wires systemd's signals into the core.

Systemd is the source of truth. The controller subscribes first, then reads every unit's
state, restores what only it knew (holds, preemptions, grants), then claims its bus name
and tells systemd it is ready. From then on each signal becomes one core event whose
actions are carried out here: a reply to a gate, StartUnit/StopUnit, one journal line.
Nothing polls; a lost bus connection exits non-zero so that Restart= brings us back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gpuslice.annotations import Problem, Scan, scan
from gpuslice.config import Config, ConfigError, load_config_with_warnings
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import Action, Grant, Log, Outcome, Phase, Scheduler, Start, Stop
from gpuslice.inventory import Inventory, Sample
from gpuslice.notify import Notifier
from gpuslice.service import SchedulerService
from gpuslice.sizes import format_size
from gpuslice.state import StateStore
from gpuslice.status import snapshot_to_json
from gpuslice.systemd import SHUTDOWN_TARGETS, Systemd, SystemdError, UnitState

log = logging.getLogger("gpuslice")

DOWN_STATES = frozenset({"inactive", "failed"})
FRESH_SAMPLE = 0.25  # seconds: a gate request re-samples NVML when the last sample is older


def env_file_text(gpus: Sequence[Gpu]) -> str:
    """What a granted unit's processes see. CUDA numbers GPUs by its own order unless told
    PCI_BUS_ID, so UUIDs (when NVML gave them) name exactly the GPUs granted."""
    indices = ",".join(str(g.index) for g in gpus)
    if not all(g.uuid for g in gpus):
        return f"CUDA_VISIBLE_DEVICES={indices}\nGPUSLICE_GPUS={indices}\n"
    uuids = ",".join(g.uuid for g in gpus)
    return (
        f"CUDA_VISIBLE_DEVICES={uuids}\nCUDA_DEVICE_ORDER=PCI_BUS_ID\n"
        f"NVIDIA_VISIBLE_DEVICES={uuids}\nGPUSLICE_GPUS={indices}\n"
    )


class Controller:
    def __init__(
        self,
        config: Config,
        config_path: Path,
        systemd: Systemd,
        root: str = "/",
        inventory: Inventory | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.systemd = systemd
        self.root = root
        self.scan: Scan = scan(root)
        self.inventory = inventory or Inventory(config)
        self.sample = Sample([Gpu(i) for i in range(config.gpus)])
        self.scheduler = Scheduler(
            self.sample.gpus, {}, yield_to_foreign=config.foreign_processes == "yield"
        )
        self.store = StateStore(Path(config.state_dir))
        self.notifier = Notifier()
        self.service = SchedulerService(
            systemd.bus, self.on_acquire, self.status_json, self.reload_annotations
        )
        self.boot_id = ""
        self.states: dict[str, UnitState] = {}
        # Who stopped a unit: jobs systemd announced for it since it last passed the gate,
        # and which of those are ours (paths from our own StartUnit/StopUnit replies).
        self.unit_jobs: dict[str, set[str]] = {}
        self.own_jobs: set[str] = set()
        self.in_flight: dict[str, int] = {}
        self.deferred: set[str] = set()
        self._signals: dict[str, int] = {}  # signals seen per unit (see _refresh)
        self.shutting_down = False
        self.ready = False
        self._buffered: list[tuple[str, dict[str, Any]]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._sampler: asyncio.TimerHandle | None = None
        self._overusing: set[tuple[str, int]] = set()

    # -- start-up ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.systemd.on_unit_changed = self.on_unit_changed
        self.systemd.on_job_new = self.on_job_new
        self.systemd.on_job_removed = self.on_job_removed
        self.systemd.on_reloading = self.on_reloading
        await self.systemd.subscribe()
        self.boot_id = await self.systemd.boot_id()
        for problem in self.scan.problems:
            self._log_problem(problem)
        self.inventory.open()
        self._take_sample()
        self.scheduler.devices = {g.index: g for g in self.sample.gpus}
        saved, saved_boot = self.store.load()
        units = await self.systemd.list_units()
        self.states = {u.name: u for u in units}
        self.scheduler.specs = self._concrete_specs(self.states)
        if saved_boot != self.boot_id:
            saved.holders = {}  # nothing runs after a reboot that we granted before it
        self.scheduler.load(saved)
        if saved_boot != self.boot_id:
            self.scheduler.forget_boot()
        actions = self._rebuild()
        await self.service.claim_name()
        self.ready = True
        self.execute(actions)
        for name, props in self._buffered:
            self.on_unit_changed(name, props)
        self._buffered.clear()
        self.notifier.ready(self.status_line())
        log.info("gpuslice ready: %s", self.status_line())

    def _rebuild(self) -> list[Action]:
        """Restored holders that ended while we were away are recorded as finished,
        failed or preempted; running units we did not know are adopted."""
        actions: list[Action] = []
        for name in list(self.scheduler.holders):
            state = self.states.get(name, UnitState(name, "inactive", "dead", 0))
            if self._classify(state) == "down":
                actions += self.scheduler.inactive(name, self._outcome(name, state))
        for state in self.states.values():
            if (
                self.spec_for(state.name) is not None
                and self._classify(state) == "running"
                and state.name not in self.scheduler.holders
            ):
                actions += self.scheduler.running(state.name)
        return actions + self.scheduler.schedule()

    # -- signals from systemd ---------------------------------------------------------------

    def spec_for(self, name: str) -> UnitSpec | None:
        return self.scan.spec_for(name)

    def on_job_new(self, job_id: int, path: str, unit: str) -> None:
        if unit in SHUTDOWN_TARGETS:
            self.shutting_down = True
        if self.spec_for(unit) is not None:
            self.unit_jobs.setdefault(unit, set()).add(path)
            self._signals[unit] = self._signals.get(unit, 0) + 1

    def on_job_removed(self, job_id: int, path: str, unit: str, result: str) -> None:
        if path not in self.unit_jobs.get(unit, ()):
            self.own_jobs.discard(path)  # already accounted for: keep the set small
        if self.spec_for(unit) is not None:
            self._signals[unit] = self._signals.get(unit, 0) + 1
            self._spawn(self._refresh(unit))

    async def _refresh(self, unit: str) -> None:
        """Read a unit's state when no signal may come (a job that changed nothing).

        dbus-next runs signal handlers as messages are read but resumes this coroutine
        later, so signals that arrived after the reply may already have been applied: then
        the reply is older than what we know, and is dropped.
        """
        seen = self._signals.get(unit, 0)
        try:
            state = await self.systemd.unit_state(unit)
        except SystemdError as e:
            log.debug("cannot read %s: %s", unit, e)
            return
        if self._signals.get(unit, 0) != seen:
            return
        self.on_unit_changed(
            unit, {"ActiveState": state.active, "SubState": state.sub, "Job": (state.job_id, "/")}
        )

    def on_unit_changed(self, name: str, props: dict[str, Any]) -> None:
        if self.spec_for(name) is None:
            return
        self._signals[name] = self._signals.get(name, 0) + 1
        if not self.ready:
            self._buffered.append((name, props))
            return
        old = self.states.get(name, UnitState(name, "inactive", "dead", 0))
        job = props.get("Job")
        state = UnitState(
            name,
            props.get("ActiveState", old.active),
            props.get("SubState", old.sub),
            job[0] if job is not None else old.job_id,
        )
        self.states[name] = state
        if name not in self.scheduler.specs:
            spec = self.spec_for(name)
            if spec is not None:
                self.scheduler.specs[name] = spec
        kind = self._classify(state)
        if kind == "down":
            if self.in_flight.get(name):
                self.deferred.add(name)  # decide once we know which of its jobs are ours
            elif self._tracked(name) or self._stopped_by_others(name):
                if self.inventory.available and name in self.scheduler.holders:
                    # VRAM release: what NVML still shows of it now counts against its GPUs
                    self._take_sample(released=name)
                    self.execute(self.scheduler.set_gpus(self.sample.gpus))
                self.execute(self.scheduler.inactive(name, self._outcome(name, state)))
                self.service.forget(name)
                self._forget_jobs(name)
        elif kind == "running":
            holder = self.scheduler.holders.get(name)
            if holder is None or holder.phase is Phase.STARTING:
                self.execute(self.scheduler.running(name))

    def _tracked(self, name: str) -> bool:
        return name in self.scheduler.holders or name in self.scheduler.waiters

    @staticmethod
    def _classify(state: UnitState) -> str:
        """running: past the gate; gate: in ExecStartPre=; down: released; else in between."""
        if state.active in ("active", "reloading"):
            return "running"
        if state.active == "activating":
            if state.sub == "auto-restart":
                return "down"
            return "gate" if state.sub in ("start-pre", "condition") else "running"
        if state.active in DOWN_STATES and state.job_id == 0:
            return "down"
        return "transition"

    def _outcome(self, name: str, state: UnitState) -> Outcome:
        if state.active == "failed" or state.sub == "auto-restart":
            return Outcome.FAILED
        if self.shutting_down:
            return Outcome.SHUTDOWN
        if self._stopped_by_others(name):
            return Outcome.STOPPED
        return Outcome.EXITED

    def on_reloading(self, active: bool) -> None:
        if not active:
            self.reload_annotations()

    def reload_annotations(self) -> None:
        self.scan = scan(self.root)
        for problem in self.scan.problems:
            self._log_problem(problem)
        self.execute(self.scheduler.set_specs(self._concrete_specs(self.states)))

    def reload_config(self) -> None:
        try:
            config, warnings = load_config_with_warnings(self.config_path)
        except ConfigError as e:
            log.error("keeping the last good configuration: %s", e)
            return
        for warning in warnings:
            log.warning("%s", warning)
        self.config = config
        self.inventory.config = config
        self.scheduler.yield_to_foreign = config.foreign_processes == "yield"
        logging.getLogger().setLevel(config.log_level.upper())
        self._take_sample()
        self.execute(self.scheduler.set_gpus(self.sample.gpus))
        self.reload_annotations()

    def _concrete_specs(self, states: dict[str, UnitState]) -> dict[str, UnitSpec]:
        specs = {n: s for n, s in self.scan.specs.items() if "@." not in n}
        for name in states:
            if "@" in name and "@." not in name and name not in specs:
                spec = self.spec_for(name)
                if spec is not None:
                    specs[name] = spec
        return specs

    # -- the gate ---------------------------------------------------------------------------

    def on_acquire(self, unit: str) -> None:
        spec = self.spec_for(unit)
        if spec is None:
            log.info("%s passed the gate: not managed by gpuslice", unit)
            self.service.grant(unit, "")
            return
        self._forget_jobs(unit)
        holder = self.scheduler.holders.get(unit)
        if holder is not None and holder.phase is Phase.STOPPING:
            # its start job outran our stop job: stop it again rather than leave it waiting
            self._spawn(self._call(self.systemd.stop_unit, unit))
            return
        if self.inventory.available and self.sample.age(self.inventory.clock()) > FRESH_SAMPLE:
            self._take_sample()  # grant against what is on the GPUs now
            self.execute(self.scheduler.set_gpus(self.sample.gpus))
        self.execute(self.scheduler.request(spec))

    # -- actions ------------------------------------------------------------------------------

    def execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Grant):
                self._write_env(action.unit, action.gpus)
                log.info("%s", action.reason)
                self.service.grant(action.unit, ",".join(map(str, action.gpus)))
            elif isinstance(action, Stop):
                log.info("%s", action.reason)
                self._spawn(self._call(self.systemd.stop_unit, action.unit))
            elif isinstance(action, Start):
                log.info("%s", action.reason)
                self._spawn(self._call(self.systemd.restart_preempted, action.unit))
            elif isinstance(action, Log):
                log.log(logging.getLevelName(action.level.upper()), "%s", action.message)
        if actions:
            self._persist()
        self._arm_sampler()

    # -- NVML sampling --------------------------------------------------------------------------

    def _take_sample(self, released: str = "") -> None:
        holding = {n: h.gpus for n, h in self.scheduler.holders.items() if n != released}
        self.sample = self.inventory.sample(self._managed_units(), holding)
        self._report_overuse()

    def _managed_units(self) -> set[str]:
        names = set(self.scheduler.specs) | set(self.scheduler.holders)
        return names | {n for n in self.states if self.spec_for(n) is not None}

    def _needs_sampling(self) -> bool:
        """Something to protect: a waiter, a holder, a unit to bring back, or a GPU that a
        foreign process uses. An idle host is never sampled (no polling)."""
        return self.inventory.available and bool(
            self.scheduler.waiters
            or self.scheduler.holders
            or self.scheduler.preempted
            or any(g.foreign_pids for g in self.sample.gpus)
        )

    def _arm_sampler(self) -> None:
        if self._sampler is None and self._needs_sampling():
            loop = asyncio.get_running_loop()
            self._sampler = loop.call_later(self.config.sample_interval, self._sample_tick)

    def _sample_tick(self) -> None:
        self._sampler = None
        self._take_sample()
        self.execute(self.scheduler.set_gpus(self.sample.gpus))

    def _report_overuse(self) -> None:
        now: set[tuple[str, int]] = set()
        for name, holder in self.scheduler.holders.items():
            declared = holder.spec.memory
            if declared is None:
                continue
            for gpu, used in self.sample.used_by(name).items():
                if used > declared:
                    now.add((name, gpu))
                    if (name, gpu) not in self._overusing:
                        log.warning(
                            "%s uses %s on GPU %d, more than its Memory=%s",
                            name,
                            format_size(used),
                            gpu,
                            format_size(declared),
                        )
        self._overusing = now

    async def _call(self, method: Any, unit: str) -> None:
        self.in_flight[unit] = self.in_flight.get(unit, 0) + 1
        try:
            self.own_jobs.add(await method(unit))
        except SystemdError as e:
            log.error("%s %s failed: %s", method.__name__, unit, e.text)
            if method == self.systemd.restart_preempted:
                self.execute(self.scheduler.inactive(unit, Outcome.FAILED))
        finally:
            self.in_flight[unit] -= 1
            if not self.in_flight[unit]:
                del self.in_flight[unit]
                if unit in self.deferred:
                    self.deferred.discard(unit)
                    await self._refresh(unit)

    def _stopped_by_others(self, name: str) -> bool:
        return any(path not in self.own_jobs for path in self.unit_jobs.get(name, ()))

    def _forget_jobs(self, name: str) -> None:
        self.own_jobs -= self.unit_jobs.pop(name, set())

    def _write_env(self, unit: str, gpus: Iterable[int]) -> None:
        env_dir = Path(self.config.runtime_dir) / "env"
        env_dir.mkdir(parents=True, exist_ok=True)
        tmp = env_dir / f".{unit}.tmp"
        devices = [self.scheduler.devices.get(g, Gpu(g)) for g in sorted(gpus)]
        tmp.write_text(env_file_text(devices))
        os.replace(tmp, env_dir / f"{unit}.env")

    def _persist(self) -> None:
        try:
            self.store.save(self.scheduler.save(), self.boot_id)
        except OSError as e:
            log.error("cannot save state to %s: %s", self.store.path, e)
        self.notifier.status(self.status_line())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _log_problem(self, problem: Problem) -> None:
        level = logging.ERROR if problem.severity == "error" else logging.WARNING
        log.log(level, "%s", problem)

    # -- status -------------------------------------------------------------------------------

    def status_line(self) -> str:
        snap = self.scheduler.snapshot()
        count = len(snap.gpus)
        running = sorted({name for holders in snap.gpus.values() for name, _, _ in holders})
        what = ", ".join(running) + " running" if running else "idle"
        return f"{count} GPU{'s' if count != 1 else ''}: {what}; {len(snap.waiting)} waiting"

    def status_json(self) -> str:
        snapshot = snapshot_to_json(self.scheduler.snapshot(), self.scan, self.sample)
        return json.dumps(snapshot, sort_keys=True)


def _journal_logging(level: str) -> None:
    """Plain sentences on stderr with <N> syslog prefixes that journald understands."""
    prefixes = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}

    class Prefix(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"<{prefixes.get(record.levelname, 6)}>{record.getMessage()}"

    handler = logging.StreamHandler()
    handler.setFormatter(
        Prefix()
        if os.environ.get("JOURNAL_STREAM")
        else logging.Formatter("%(levelname)s %(message)s")
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


async def run(config_path: Path, bus_address: str | None = None) -> int:
    try:
        config, warnings = load_config_with_warnings(config_path)
    except ConfigError as e:
        _journal_logging("info")
        log.error("%s", e)
        return 78  # EX_CONFIG: systemd shows it; Restart=on-failure retries
    _journal_logging(config.log_level)
    for warning in warnings:
        log.warning("%s", warning)
    systemd = await Systemd.connect(bus_address)
    controller = Controller(config, config_path, systemd)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()

    def request_stop() -> None:
        if not stop.done():
            stop.set_result(0)

    loop.add_signal_handler(signal.SIGTERM, request_stop)
    loop.add_signal_handler(signal.SIGINT, request_stop)
    loop.add_signal_handler(signal.SIGHUP, controller.reload_config)
    await controller.start()
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
    controller.notifier.send("STOPPING=1")
    log.info("gpuslice stopping; running jobs are left alone")
    return 0
