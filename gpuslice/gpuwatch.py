"""The GPUs as NVML shows them, kept current for the controller, and the NVIDIA driver's
lifecycle: not ready yet, gone, back.

`GpuWatch` owns the Inventory, the worker thread NVML calls run on (`OffLoop`) and two
timers: the sampler, armed only while something needs protecting (an idle host is never
sampled: no polling), and the NVML retry, armed while NVIDIA hardware is present and NVML is
not ready. It knows the controller only through `Holdings` (who holds what, and the switch
that holds background units back: the core's `Scheduler` is one) and three callbacks:
`managed` (the units whose processes are not foreign), `decide` (new GPUs: decide again) and
`ready` (the controller has started up and may act).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Protocol, TypeVar

from gpuslice.config import Config
from gpuslice.core.decisions import listed
from gpuslice.core.model import Gpu
from gpuslice.inventory import ABSENT, FALLBACK, WAITING, Inventory, Sample
from gpuslice.offloop import OffLoop
from gpuslice.sizes import format_size

log = logging.getLogger("gpuslice")

FRESH_SAMPLE = 0.25  # seconds: a gate request re-samples NVML when the last sample is older
NVML_DEADLINE = 2.0  # seconds a sample may take on the loop before it counts as hung
NVML_OPEN_DEADLINE = 10.0  # nvmlInit, before READY=1 (TimeoutStartSec is 90 s)
# While NVIDIA hardware is present but NVML is not ready: retry after FIRST seconds, doubling
# up to MAX while background units wait for it, up to SLOW once they no longer do
# (driver_wait ran out). A failing nvmlInit costs well under a millisecond.
NVML_RETRY_FIRST = 0.25
NVML_RETRY_MAX = 2.0
NVML_RETRY_SLOW = 30.0
EX_TEMPFAIL = 75

T = TypeVar("T")


class Holdings(Protocol):
    """What the watch asks of the scheduling state (gpuslice.core.scheduler.Scheduler)."""

    def grants(self) -> dict[str, frozenset[int]]: ...

    def declared_memory(self) -> dict[str, int]: ...

    def has_work(self) -> bool: ...

    def pause_refill(self, reason: str) -> None: ...


class Timer(Protocol):
    def cancel(self) -> None: ...


CallLater = Callable[[float, Callable[[], None]], Timer]


def _loop_call_later(delay: float, callback: Callable[[], None]) -> Timer:
    return asyncio.get_running_loop().call_later(delay, callback)


class GpuWatch:
    """Samples NVML while something needs protecting; follows NVML's case (see the module)."""

    def __init__(
        self,
        config: Config,
        inventory: Inventory,
        holdings: Holdings,
        *,
        managed: Callable[[], Collection[str]],
        decide: Callable[[list[Gpu]], None],
        ready: Callable[[], bool],
        call_later: CallLater = _loop_call_later,
        alive: Callable[[], None] | None = None,
        longest_wait: float | None = None,
    ) -> None:
        self.config = config
        self.inventory = inventory
        self.holdings = holdings
        self._managed = managed
        self._decide = decide
        self._ready = ready
        self._call_later = call_later
        # `alive`, `longest_wait`: systemd's watchdog (WATCHDOG=1, half WatchdogSec=)
        self.nvml = OffLoop(NVML_DEADLINE, alive, longest_wait)
        self.sample = Sample(inventory.fallback_gpus())
        self.stale = False  # the last sample was not taken: NVML is hung
        self._sampler: Timer | None = None
        self._overusing: set[tuple[str, int]] = set()
        self._nvml_retry: Timer | None = None
        self._nvml_delay = NVML_RETRY_FIRST
        self._nvml_waiting_since: float | None = None  # monotonic; while background units wait
        self._nvml_was_ready: bool | None = None  # NVML ready, as last acted on (None: not yet)

    @property
    def available(self) -> bool:
        """NVML answers: samples show real GPUs, their memory and their processes."""
        return self.inventory.available

    def open(self) -> None:
        """Start-up: the first nvmlInit (on the worker thread, with a deadline), then the
        first sample, acted on like every other (`_nvml_settle`). The caller takes
        `sample.gpus` in itself: nothing is decided before the state is rebuilt."""
        if self._call(_open_nvml, NVML_OPEN_DEADLINE) is None:
            self.inventory.open_hung(NVML_OPEN_DEADLINE)  # hung: schedule `gpus:` from config
        self._take_sample()

    def resample(self) -> list[Gpu]:
        """Start-up, once the units are known: a sample that knows whose processes are whose.
        The first one (`open`) was taken before any unit was, and took every running job's
        process for foreign. The caller takes the GPUs in, as after `open`."""
        self._take_sample()
        return self.sample.gpus

    def reconfigure(self, config: Config) -> None:
        """A reloaded config.yaml: the next sample applies it (manage_gpus, reserve, ...).
        A sampler armed with another sample_interval is armed anew: left, a reload from
        3600 s to 2 s sampled again only an hour later, and a foreign process that came
        meanwhile went unseen that long."""
        interval = self.config.sample_interval
        self.config = config
        self.inventory.config = config
        if self._sampler is not None and config.sample_interval != interval:
            self._sampler.cancel()
            self._sampler = None
            self.arm_sampler()

    def refresh(self, released: str = "") -> None:
        """Sample now and decide again on what NVML shows; `released`: a unit that just went
        down, whose memory NVML still shows counts against its GPUs as foreign."""
        self._take_sample(released)
        self._decide(self.sample.gpus)

    def refresh_if_older(self, age: float) -> None:
        """Sample again when NVML answers and the last sample is older than `age` seconds."""
        if self.inventory.available and self.sample.age(self.inventory.clock()) > age:
            self.refresh()

    # -- NVML sampling --------------------------------------------------------------------------

    def _take_sample(self, released: str = "") -> None:
        holding = {n: gpus for n, gpus in self.holdings.grants().items() if n != released}
        declared = self.holdings.declared_memory()  # to tell a holder's use beyond it
        managed = self._managed()
        sample = self._call(lambda inventory: inventory.sample(managed, holding, declared))
        self.stale = sample is None
        if sample is None:  # the last one, its processes told by the units known now
            self.sample = self.inventory.reattribute(self.sample, managed, holding, declared)
        else:  # with the inventory's Health, which the loop keeps current (not the fork's)
            self.sample = dataclasses.replace(sample, health=self.inventory.health)
            self._report_overuse(declared)
        self._nvml_settle()

    def _call(self, fn: Callable[[Inventory], T], deadline: float | None = None) -> T | None:
        """fn on a fork of the inventory, on the worker thread (`OffLoop`), its state taken
        back on the loop: at once when it answers in time, else (`Inventory.adopt`, late)
        before the next call once it returned. Run on the inventory itself, a call that
        outlived its deadline changed it from the thread while the loop used it."""
        if self.nvml.hung:  # a late call's state is taken back first (`OffLoop.hung`)
            return None
        twin = self.inventory.fork()
        result = self.nvml.call(
            lambda: fn(twin), deadline, late=lambda: self.inventory.adopt(twin, late=True)
        )
        if result is not None:
            self.inventory.adopt(twin)
        return result

    def _needs_sampling(self) -> bool:
        """Something to protect: a waiter, a holder, a unit to bring back, or a GPU that a
        foreign process uses. An idle host is never sampled (no polling)."""
        return self.inventory.available and (
            self.holdings.has_work() or any(g.foreign_pids for g in self.sample.gpus)
        )

    def arm_sampler(self) -> None:
        """Sample again after `sample_interval` if something needs protecting."""
        if self._sampler is None and self._needs_sampling():
            self._sampler = self._call_later(self.config.sample_interval, self._sample_tick)

    def _sample_tick(self) -> None:
        self._sampler = None
        self.refresh()

    # -- the NVIDIA driver: NVML not ready yet, gone, back ------------------------------------

    def _nvml_settle(self) -> None:
        """Act on the inventory's NVML case after every NVML call: on the switch to NVML say
        so; while NVIDIA hardware is present and NVML is not ready, hold background units
        back (at most driver_wait) and retry with a back-off; without NVIDIA, nothing."""
        inventory = self.inventory
        ready = inventory.available
        was = self._nvml_was_ready
        self._nvml_was_ready = ready
        if ready:
            self._cancel_nvml_retry()
            self._nvml_delay = NVML_RETRY_FIRST
            self._nvml_waiting_since = None
            self.holdings.pause_refill("")
            if was is False:
                self._log_nvml_switch()
            return
        now = inventory.clock()
        if inventory.health.state == WAITING:
            if self._nvml_waiting_since is None:
                self._nvml_waiting_since = now
            waited = now - self._nvml_waiting_since
            if waited >= self.config.driver_wait:
                inventory.give_up_waiting(round(waited, 1))
        state = inventory.health.state
        if state == WAITING:
            self.holdings.pause_refill(
                "NVIDIA hardware is present but NVML is not ready yet: background units wait "
                f"for it, at most {self.config.driver_wait:g} s (driver_wait)"
            )
        else:
            self.holdings.pause_refill("")
        if state in (WAITING, FALLBACK):
            self._arm_nvml_retry()
        elif state == ABSENT:
            self._cancel_nvml_retry()

    def _arm_nvml_retry(self) -> None:
        if self._nvml_retry is not None:
            return
        delay = self._nvml_delay
        if self.inventory.health.state == WAITING and self._nvml_waiting_since is not None:
            left = self.config.driver_wait - (self.inventory.clock() - self._nvml_waiting_since)
            delay = max(min(delay, left), 0.0)  # wake up when driver_wait runs out
        self._nvml_retry = self._call_later(delay, self._nvml_retry_tick)

    def _cancel_nvml_retry(self) -> None:
        if self._nvml_retry is not None:
            self._nvml_retry.cancel()
            self._nvml_retry = None

    def _nvml_retry_tick(self) -> None:
        """nvmlInit again (on the worker thread, with a deadline); NVML's GPUs replace the
        guessed ones at once, and background units may start on them."""
        self._nvml_retry = None
        if not self._ready():  # still starting up: start() acts on the outcome
            self._arm_nvml_retry()
            return
        self._call(Inventory.retry)  # None when hung: retried after the back-off
        if self.inventory.restart_needed:
            log.error(
                "%s: exiting so that systemd restarts gpuslice with the devices allowed "
                "(running jobs are left alone)",
                self.inventory.restart_needed,
            )
            raise SystemExit(EX_TEMPFAIL)  # asyncio lets it through: Restart=on-failure
        slow = self.inventory.health.state == FALLBACK
        self._nvml_delay = min(self._nvml_delay * 2, NVML_RETRY_SLOW if slow else NVML_RETRY_MAX)
        self.refresh()  # settles: the switch, or the next retry

    def _log_nvml_switch(self) -> None:
        gpus = [g for g in self.sample.gpus if not g.lost]
        names = sorted({g.name for g in gpus if g.name})
        held = listed(
            tuple(
                f"{name} on GPU {','.join(map(str, sorted(held)))}"
                for name, held in sorted(self.holdings.grants().items())
                if held
            )
        )
        log.info(
            "NVML ready (%s): switched to %d GPU%s%s without a restart; memory packing and "
            "foreign-process protection from now on; background units may start%s",
            self.inventory.health.detail,
            len(gpus),
            "" if len(gpus) == 1 else "s",
            f" ({', '.join(names)})" if names else "",
            f"; holders keep their GPUs by index: {held}" if held else "",
        )

    def _report_overuse(self, memory: Mapping[str, int]) -> None:
        """Warn once of each holder using more on a GPU than `memory` (its Memory=) says."""
        now: set[tuple[str, int]] = set()
        for name, declared in memory.items():
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


def _open_nvml(inventory: Inventory) -> bool:
    inventory.open()
    return True
