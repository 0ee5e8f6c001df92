"""The core under random histories in which NVML numbers the GPUs anew, judged by UUID.

The core books GPUs by NVML index; a unit's processes run on the GPUs its env file names by
UUID. NVML numbers GPUs only in its order of enumeration, and may number them anew (a card
off the bus and back, the driver reloaded, a controller restart): the same index is then
another GPU. `RenumberMachine` plays the rules of tests/test_core_ladder_properties.py (busy
hosts, the Preempt= ladder at work) on hosts of 2-3 GPUs of known size, and between them NVML
lists its GPUs in another order, loses one off the bus, lists it again at another index, also
across a controller restart (one killed before a gate read its grant among them), while
units run, are frozen, being suspended or resumed, suspended, waiting or preempted.

The GPUs the core is given are what the real `Inventory` makes of a stub NVML that lists
the host's GPUs in the order of the moment (`Inventory._as_booked`: an index held whose
UUID changed, and the index its GPU has now, are lost while held), with each GPU's reserve,
foreign use and NVML's own lost state carried by its UUID. A sample follows every change
of the numbering (NVML numbers GPUs anew only at its init, which a sample follows), every
unit the core knew going down (`Controller._apply`: the sample that releases its GPUs) and,
at random, the sampling pace. A restarted controller opens NVML afresh, reads its holders'
and suspended units' env files (`Restore.remember_told`), then samples, as it does.

`Sim` (tests/core_builders.py) judges every batch as in the other machines, by index: the
core's books. `RenumberSim` adds the host as it is, by UUID: where each unit's processes
run (the GPUs it was granted by UUID, as its env file told it; a suspended unit's processes
wake on the GPUs they were suspended from, whatever their index), and checks after every
step, and at every Grant and Resume, that no two units are on one GPU beyond what
`Memory=` allows (a whole-GPU unit alone; the memory declared within the GPU's room), that
a suspended unit is resumed only onto the GPUs it was suspended from, and that one whose
GPUs are all listed and answering is never stopped for want of them (a renumbered index is
lost only for new work while held: its GPU is there).

`GPUSLICE_FUZZ_EXAMPLES` sets the number of histories here too (half of it; `make fuzz` runs
more).

Below the machine: what these histories found in the core, each as the shortest history
that shows it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from gpuslice.config import Config
from gpuslice.core.decisions import Code
from gpuslice.core.model import Gpu, Rung, UnitKind, UnitSpec
from gpuslice.core.scheduler import Action, Grant, Outcome, Phase, Resume, Scheduler, Stop
from gpuslice.inventory import Inventory
from gpuslice.nvml import GpuInfo, GpuLostError
from tests.core_builders import GIB, InvariantError, Sim, brief, spec
from tests.test_core_ladder_properties import LADDER_UNIT, LadderMachine
from tests.test_core_properties import EXAMPLES, SAMPLE, HostMachine, machine_settings
from tests.test_inventory import StubNvml

TOTAL = 24 * GIB  # every GPU of these hosts
INVENTORY_LOG = logging.getLogger("gpuslice")
NOWHERE = Path("/nonexistent/gpuslice-renumber")  # no /proc, no driver: NVML is the stub

# NVML's numbering anew: the GPU each new index names, by its index before (never the
# same order, on 2 GPUs as on 3); or none
ANEW = st.sampled_from([(1, 0, 2), (1, 2, 0), (2, 1, 0)])
NUMBERING = st.one_of(st.none(), ANEW)
# reserve, foreign memory, whether a foreign process computes there, lost (NVML's own word)
Sampled = tuple[int, int, bool, bool]


class RenumberSim(Sim):
    """`Sim` on a host whose GPUs NVML may number anew, and the oracle of where units run.

    `order` is NVML's numbering now (index -> UUID), `off` the GPUs off the bus; `on` says
    which GPUs, by UUID, each unit's processes run on (granted, frozen, being stopped,
    being suspended, resumed), `home` those a suspended unit was suspended from, `told` each
    unit's env file (index -> UUID: what it was granted, or resumed on elsewhere)."""

    def __init__(
        self,
        gpus: int,
        specs: Sequence[UnitSpec] = (),
        *,
        yield_to_foreign: bool = True,
        requeue_at_gate: bool = False,
    ) -> None:
        self.order = [f"GPU-{chr(ord('A') + i)}" for i in range(gpus)]
        self.off: list[str] = []
        self.sampled: dict[str, Sampled] = {u: (0, 0, False, False) for u in self.order}
        self.on: dict[str, tuple[str, ...]] = {}
        self.home: dict[str, tuple[str, ...]] = {}
        self.told: dict[str, dict[int, str]] = {}
        self.inventory = self._open()
        first = self._nvml_sample({})
        super().__init__(
            first, specs, yield_to_foreign=yield_to_foreign, requeue_at_gate=requeue_at_gate
        )

    # -- NVML and the inventory -----------------------------------------------------------------

    def _open(self) -> Inventory:
        """The controller's inventory, NVML opened afresh (a start or restart)."""
        inventory = Inventory(
            Config(gpus=len(self.order) + len(self.off)),
            nvml=StubNvml(0),
            clock=lambda: 100.0,
            proc=NOWHERE,
            driver_root=NOWHERE,
        )
        inventory.open()
        return inventory

    def _nvml_sample(self, holding: Mapping[str, Iterable[int]]) -> list[Gpu]:
        """What the inventory shows the core: the GPUs NVML lists in today's order, each
        with what its UUID carries (reserve, foreign use, lost); held indices renumbered
        or gone marked lost by the inventory itself."""
        nvml = self.inventory.nvml
        assert isinstance(nvml, StubNvml)
        nvml.infos = [GpuInfo(i, u, "NVIDIA Fake 24GB", TOTAL, 0) for i, u in enumerate(self.order)]
        nvml.procs = {i: [] for i in range(len(self.order))}
        nvml.raises = {
            i: GpuLostError("nvmlDeviceGetComputeRunningProcesses", 15, "GPU is lost", i)
            for i, u in enumerate(self.order)
            if self.sampled[u][3]
        }
        held = {n: list(g) for n, g in holding.items()}
        quiet, INVENTORY_LOG.disabled = INVENTORY_LOG.disabled, True  # its errors, by the 1000
        try:
            gpus = self.inventory.sample((), held).gpus
        finally:
            INVENTORY_LOG.disabled = quiet
        return [self._as_sampled(g) for g in gpus]

    def _as_sampled(self, gpu: Gpu) -> Gpu:
        if gpu.lost or not gpu.uuid:
            return gpu
        reserve, foreign, with_pid, _ = self.sampled[gpu.uuid]
        pids = (4000 + ord(gpu.uuid[-1]),) if foreign and with_pid else ()
        return dataclasses.replace(gpu, reserve=reserve, foreign=foreign, foreign_pids=pids)

    def resample(self) -> list[Action]:
        """A sample of NVML as it is now, with the GPUs every unit holds (the core's books)."""
        return self.sample(self._nvml_sample(self.sched.grants()))

    def renumber(self, order: Sequence[str]) -> list[Action]:
        """NVML opened afresh lists the GPUs in `order`; a sample follows."""
        self.order = list(order)
        return self.resample()

    # -- units going down: the sample that releases their GPUs ----------------------------------

    def _released(self, name: str, had: bool) -> list[Action]:
        """The controller samples when a unit it knew goes down (`Controller._apply`), so
        that an index renumbered under it is no longer lost; taken here once the core knows."""
        if had and self.sched.phase(name) is None:
            return self.resample()
        return []

    def exit(self, name: str, outcome: Outcome = Outcome.EXITED) -> list[Action]:
        had = self.sched.phase(name) is not None
        return super().exit(name, outcome) + self._released(name, had)

    def exit_while_stopping(self, name: str, outcome: Outcome = Outcome.EXITED) -> list[Action]:
        had = self.sched.phase(name) is not None
        return super().exit_while_stopping(name, outcome) + self._released(name, had)

    def stop(self, name: str) -> list[Action]:
        had = self.sched.phase(name) is not None
        return super().stop(name) + self._released(name, had)

    def finish_stop(self, name: str | None = None) -> list[Action]:
        name = self.pending_stops[0] if name is None else name
        had = self.sched.phase(name) is not None
        return super().finish_stop(name) + self._released(name, had)

    # -- a controller restart -----------------------------------------------------------------

    def restart(self) -> list[Action]:
        """The new controller opens NVML afresh; its first sample is taken before it knows
        any unit (none held: nothing renumbered is marked). A start of gpuslice's whose
        place the state file kept stays known since it was (`Holder.seq`): its place lost
        to a renumbering, it waits from then, and what was granted after is not its to
        preempt (the thrash rule; `Sim.restart` forgets when starts became known)."""
        self.inventory = self._open()
        self.devices = {g.index: g for g in self._nvml_sample({})}
        ours = {n: self.known_at[n] for n in self.ours if n in self.known_at}
        actions = super().restart()
        for name, known in ours.items():
            if name in self.pending_starts and self.sched.phase(name) is Phase.STARTING:
                self.known_at[name] = known
        return actions

    def _loaded(self) -> None:
        """`Controller.start`: the env files of holders past their gate teach the inventory
        what their indices were granted as, those of suspended units the core what they were
        suspended from; then a sample with the books, before anything is decided."""
        for name, gpus in self.sched.grants().items():
            told = self.told.get(name, {})
            if self.sched.phase(name) is not Phase.STARTING and set(told) == gpus:
                self.inventory.remember(told)
                self.sched.remember_uuids(name, told)
        for name in self.sched.suspended_units():
            self.sched.remember_uuids(name, self.told.get(name, {}))
        self.devices = {g.index: g for g in self._nvml_sample(self.sched.grants())}
        self._follow()
        with self.sched.deferred():
            self.sched.set_gpus(self.devices.values())

    def unanswered(self) -> list[str]:
        """Units granted whose gate may not have read its grant yet: running, not frozen,
        stopping, suspending or resumed, none frozen for them, no victim stopping for them."""
        owners = {u for those in self.frozen.values() for u in those}
        return sorted(
            n
            for n, gpus in self.running.items()
            if n in self.annotations
            and len(gpus) == self.annotations[n].gpus  # GPUs= as granted (a reload)
            and self.runs(n)
            and n not in self.pending_resumes
            and n not in owners
            and not self.victims_of.get(n)
        )

    def restart_before_its_gate_read(self, name: str) -> list[Action]:
        """The controller restarted (NVML may number the GPUs otherwise) before the unit's
        gate read its grant: the saved state says it holds its GPUs, and its gate asks again
        once the new controller is up (`Gates.serve_gate`). Its processes start on the
        GPUs its answer's env file names, or, not answered at once, it waits like any start."""
        actions = self.restart()
        if name not in self.unanswered() or self.sched.phase(name) is not Phase.RUNNING:
            return actions  # given way meanwhile: its gate is the adapter's (PREEMPTED_IN_PLACE)
        spec = self.annotations[name]
        answer = self.sched.request(spec)
        again = [a for a in answer if isinstance(a, Grant) and a.unit == name]
        if again and tuple(sorted(again[0].gpus)) == tuple(sorted(self.running[name])):
            grant = again[0]
            for index in grant.gpus:
                gpu = self.devices.get(index)
                if gpu is None or gpu.lost:
                    raise InvariantError(f"{name} granted GPU {index} again: unknown or lost")
            uuids = self._uuids(grant.gpus, f"Grant {name} again")
            self.on[name] = uuids  # its processes start there (by UUID), checked as a holder
            self.told[name] = dict(zip(grant.gpus, uuids, strict=True))
            return [*actions, grant, *self._feed([a for a in answer if a is not grant])]
        # moved back to waiting: it never ran (nor froze anyone: `unanswered`)
        del self.running[name]
        self.on.pop(name, None)
        self.at_gate.add(name)
        self.known_at.setdefault(name, next(self._clock))
        return actions + self._feed(answer)

    # -- the host by UUID ---------------------------------------------------------------------

    def _feed(self, actions: list[Action]) -> list[Action]:
        self._follow()
        for action in actions:
            if isinstance(action, Resume) and action.unit not in self._caught:
                self._check_resume(action)
            elif isinstance(action, Stop) and action.unit in self.suspended:
                self._check_stopped_suspended(action)
        done = super()._feed(actions)
        for action in actions:  # not `done`: a failed freeze's actions were fed on their own
            if isinstance(action, Grant):
                uuids = self._uuids(action.gpus, f"Grant {action.unit}")
                self._check_room_by_uuid(action.unit, uuids, "Grant")
                self.on[action.unit] = uuids
                self.told[action.unit] = dict(zip(action.gpus, uuids, strict=True))
            elif isinstance(action, Resume) and action.unit in self.home:
                uuids = self.home.pop(action.unit)
                self._check_room_by_uuid(action.unit, uuids, "Resume")
                self.on[action.unit] = uuids
                told = self.told.get(action.unit, {})
                if told and sorted(told) != sorted(action.gpus):  # Delivery.tell_again
                    self.told[action.unit] = {g: self.devices[g].uuid for g in action.gpus}
        self._follow()
        return done

    def _follow(self) -> None:
        """Bring `on` and `home` up to the model: a unit that began to run without a Grant
        (adopted when annotated) runs where the core counts it; one just suspended is off
        its GPUs; one gone is nowhere. Each suspended unit comes back where its GPUs are
        listed now (`Sim.suspended`, by index: none for a GPU NVML does not list)."""
        for name in sorted(self.suspended):
            if name not in self.home:
                self.home[name] = self.on.pop(name)
        for name, gpus in sorted(self.running.items()):
            if name not in self.on:
                self.on[name] = tuple(self.devices[g].uuid for g in gpus)
        for name in [n for n in self.on if n not in self.running]:
            del self.on[name]
        for name in [n for n in self.home if n not in self.suspended]:
            del self.home[name]
        at = {g.uuid: g.index for g in self.devices.values() if g.uuid}
        for name, uuids in self.home.items():
            self.suspended[name] = tuple(sorted(at.get(u, -1 - k) for k, u in enumerate(uuids)))

    def _uuids(self, gpus: Iterable[int], what: str) -> tuple[str, ...]:
        uuids = tuple(self.devices[g].uuid if g in self.devices else "" for g in gpus)
        if not all(uuids):
            raise InvariantError(f"{what} on {tuple(gpus)}: a GPU with no UUID ({uuids})")
        return uuids

    def _check_resume(self, resume: Resume) -> None:
        home = self.home.get(resume.unit)
        if home is None:
            return  # Sim says why
        uuids = tuple(self.devices[g].uuid if g in self.devices else "?" for g in resume.gpus)
        if sorted(uuids) != sorted(home):
            raise InvariantError(
                f"Resume {resume.unit} on GPUs {resume.gpus} ({', '.join(uuids)}): it was "
                f"suspended from {', '.join(home)} (NVML numbers them {self.order})"
            )

    def _check_stopped_suspended(self, stop: Stop) -> None:
        """A suspended unit is stopped only when a GPU it was suspended from is gone or lost
        by NVML's own word: a renumbering's lost mark is for new work, its GPU is there."""
        home = self.home.get(stop.unit, ())
        d = stop.decision
        if d is None or d.code is not Code.RESUME_FAILED or not home:
            return
        if all(u in self.order and not self.sampled[u][3] for u in home):
            raise InvariantError(
                f"Stop {stop.unit}, suspended from {', '.join(home)}, all listed and answering "
                f"(NVML numbers them {self.order}): {stop.reason}"
            )

    def _room_of(self, uuid: str) -> int:
        reserve, foreign, _, _ = self.sampled[uuid]
        return TOTAL - reserve - foreign

    def _beside(self, name: str, uuid: str) -> list[str]:
        return sorted(n for n, on in self.on.items() if uuid in on and n != name)

    def _check_room_by_uuid(self, name: str, uuids: Sequence[str], what: str) -> None:
        """Where it goes by UUID, next to every unit whose processes are there."""
        memory = self._memory_of(name)
        for uuid in uuids:
            others = self._beside(name, uuid)
            declared = [self._memory_of(n) for n in others]
            if others and (memory is None or None in declared):
                raise InvariantError(
                    f"{what} {name} on {uuid} (GPU {self._index(uuid)}), where {others} run: "
                    "a whole-GPU unit shares it"
                )
            total = (memory or 0) + sum(m or 0 for m in declared)
            if total > self._room_of(uuid):
                raise InvariantError(
                    f"{what} {name} on {uuid}: {total} bytes declared with {others}, "
                    f"{self._room_of(uuid)} free"
                )

    def _index(self, uuid: str) -> int | None:
        return self.order.index(uuid) if uuid in self.order else None

    def check_physical(self) -> None:
        """After every step: no GPU, by UUID, holds a whole-GPU unit beside another, or more
        declared memory than it has; every unit that runs is somewhere, every suspended one
        has a home."""
        self._follow()
        for uuid in sorted({u for on in self.on.values() for u in on}):
            there = self._beside("", uuid)
            declared = [self._memory_of(n) for n in there]
            if len(there) > 1 and None in declared:
                raise InvariantError(f"{uuid} (GPU {self._index(uuid)}) runs {there} at once")
            if sum(m or 0 for m in declared) > TOTAL:
                raise InvariantError(f"{uuid} runs {there}: more declared than it has")
        missing = sorted(set(self.suspended) - set(self.home))
        if missing:
            raise InvariantError(f"suspended with no GPU to come back on: {missing}")


class RenumberMachine(LadderMachine):
    """The rules of LadderMachine (busy hosts, the ladder at work) on hosts whose GPUs NVML
    numbers anew."""

    sim: RenumberSim

    @initialize(
        gpus=st.sampled_from([2, 2, 3]),
        units=st.lists(LADDER_UNIT, min_size=3, max_size=6),
        yield_to_foreign=st.booleans(),
        requeue_at_gate=st.booleans(),
        started=st.lists(st.integers(0, 5), min_size=2, max_size=6),
        freeze_fails=st.sets(st.integers(0, 5), max_size=2),
    )
    def boot(
        self,
        gpus: int,
        units: list[tuple[UnitSpec, bool]],
        yield_to_foreign: bool,
        requeue_at_gate: bool,
        started: list[int],
        freeze_fails: set[int],
    ) -> None:
        """The host boots and people start a few units, less urgent ones first: the histories
        begin busy. FreezeUnit fails for some units (as soon as the core freezes them)."""
        self.specs = [
            dataclasses.replace(s, name=f"u{i}.service") for i, (s, _) in enumerate(units)
        ]
        self.annotated = [annotated for _, annotated in units]
        self.sim = RenumberSim(
            gpus,
            self._annotations(),
            yield_to_foreign=yield_to_foreign,
            requeue_at_gate=requeue_at_gate,
        )
        self.sim.freeze_fails = {self._unit(i) for i in freeze_fails}
        self.sim.boot()
        # the least urgent first: those after them take their places (the ladder at work)
        for index in sorted(started, key=lambda i: -self.specs[i % len(self.specs)].priority):
            self.sim.start(self._unit(index))

    def nvml_samples(self, samples: list[tuple[int, int, bool, bool]]) -> None:
        """Not a rule here: `samples_by_uuid` (these GPUs carry what NVML says of them)."""

    # Not rules here: the other machines play them, and drawn here they would make the
    # moments that matter (a unit being suspended, suspended, frozen) rarer still.

    def person_plans_then_starts(self, index: int) -> None:
        """Not a rule here."""

    def seen_down_as_an_instance(self, index: int) -> None:
        """Not a rule here."""

    def start_does_not_reach_systemd(self, index: int) -> None:
        """Not a rule here."""

    def delay_after_a_failed_start_ends(self, index: int) -> None:
        """Not a rule here."""

    def seen_and_asked_in_one_turn(self, index: int, other: int) -> None:
        """Not a rule here."""

    def gpus_change(self, index: int, gpus: int) -> None:
        """Not a rule here."""

    @rule(samples=st.lists(SAMPLE, min_size=3, max_size=3))
    def samples_by_uuid(self, samples: list[Sampled]) -> None:
        """Reserve, foreign use and NVML's lost GPUs change, GPU by GPU (by UUID)."""
        sim = self.sim
        for uuid, sampled in zip(sim.order, samples, strict=False):
            sim.sampled[uuid] = sampled
        sim.resample()

    @rule()
    def nvml_sampled_again(self) -> None:
        """The sampling pace: nothing changed on NVML's side."""
        self.sim.resample()

    # NVML numbering anew now and then: the lost marks it leaves while units hold their GPUs
    # keep new work off them, and drawn as often as the rest they left little to preempt

    def _numbers_anew(self, order: tuple[int, ...]) -> None:
        """The same GPUs, listed in another order (NVML opened afresh)."""
        sim = self.sim
        sim.renumber([sim.order[i] for i in order if i < len(sim.order)])

    def _falls_off_the_bus(self, index: int) -> None:
        """A card NVML no longer lists: those after it take the indices before them."""
        sim = self.sim
        order = list(sim.order)
        sim.off.append(order.pop(index % len(order)))
        sim.renumber(order)

    @rule(order=ANEW, now=st.integers(0, 2))
    def nvml_numbers_anew(self, order: tuple[int, ...], now: int) -> None:
        if now == 0:
            self._numbers_anew(order)

    @precondition(lambda self: len(self.sim.order) > 1)
    @rule(index=st.integers(0, 2), now=st.integers(0, 2))
    def gpu_falls_off_the_bus(self, index: int, now: int) -> None:
        if now == 0:
            self._falls_off_the_bus(index)

    @precondition(
        lambda self: bool(
            self.sim.pending_suspends
            or self.sim.pending_resumes
            or self.sim.suspended
            or self.sim.frozen
        )
    )
    @rule(order=ANEW, off=st.booleans())
    def nvml_numbers_anew_mid_ladder(self, order: tuple[int, ...], off: bool) -> None:
        """NVML numbers the GPUs anew (or a card goes off the bus, `off`) while a unit is
        being suspended or resumed, is suspended or frozen: rare moments, drawn every time."""
        if off and len(self.sim.order) > 1:
            self._falls_off_the_bus(order[0])
        else:
            self._numbers_anew(order)

    @precondition(lambda self: bool(self.sim.pending_suspends))
    @rule(index=st.integers(0, 7), ok=st.booleans(), order=NUMBERING)
    def suspend_completes(self, index: int, ok: bool, order: tuple[int, ...] | None) -> None:
        """As in HostMachine, NVML numbering the GPUs anew first as often as not: a suspend
        takes along what its unit runs on, whatever the indices say when it is done."""
        if order is not None:
            self._numbers_anew(order)
        HostMachine.suspend_completes(self, index, ok)

    @precondition(lambda self: bool(self.sim.off))
    @rule(at=st.integers(0, 2))
    def gpu_back_on_the_bus(self, at: int) -> None:
        """A card listed again, maybe at another index than it had (NVML opened afresh)."""
        sim = self.sim
        order = list(sim.order)
        order.insert(at % (len(order) + 1), sim.off.pop(0))
        sim.renumber(order)

    @rule(order=ANEW, now=st.integers(0, 2))
    def controller_restarts_renumbered(self, order: tuple[int, ...], now: int) -> None:
        """The controller restarts, and the NVML it opens numbers the GPUs otherwise (now
        and then, as `restarts_now_and_then`)."""
        if now:
            return
        sim = self.sim
        sim.order = [sim.order[i] for i in order if i < len(sim.order)]
        sim.restart()

    @precondition(lambda self: bool(self.sim.unanswered()))
    @rule(index=st.integers(0, 7), order=ANEW, now=st.integers(0, 2))
    def controller_restarts_before_a_gate_read_its_grant(
        self, index: int, order: tuple[int, ...], now: int
    ) -> None:
        """The controller is killed once it saved a grant and before the gate read it; the
        NVML the new one opens numbers the GPUs otherwise, and the gate asks again (now
        and then, as `restarts_now_and_then`)."""
        if now:
            return
        sim = self.sim
        name = sim.unanswered()[index % len(sim.unanswered())]
        sim.order = [sim.order[i] for i in order if i < len(sim.order)]
        sim.restart_before_its_gate_read(name)

    @invariant()
    def by_uuid(self) -> None:
        self.sim.check_physical()


RenumberMachine.TestCase.settings = machine_settings(EXAMPLES // 2)
TestRenumber = RenumberMachine.TestCase


# -- what the histories found -----------------------------------------------------------------


def _gpu(index: int, uuid: str) -> Gpu:
    """A GPU NVML lists at `index` now, as the inventory shows it."""
    return Gpu(index, uuid, "NVIDIA Fake 24GB", TOTAL)


def _renumbered(index: int, uuid: str) -> Gpu:
    """An index units hold by another GPU's number, or the one their GPU has now: lost for
    new work while they hold it (`Inventory._as_booked`), the GPU itself there."""
    return Gpu(index, uuid, "NVIDIA Fake 24GB", lost=True, renumbered=True)


def test_a_suspended_unit_waits_for_its_gpu_renumbered_under_a_holder_rather_than_stop() -> None:
    """s.service was suspended from GPU 1, GPU-B, for v.service, which holds it now. GPU-A,
    GPU 0 (h.service's), falls off the bus: NVML numbers GPU-B 0. Both indices are lost for
    new work while h.service and v.service hold them, and s.service was stopped, its
    suspended work lost, though GPU-B is there: it waits until they are released, as for a
    GPU in use, and comes back on GPU-B at its index now."""
    h, s_, v = spec("h", 5), spec("s", 20, preempt="suspend stop"), spec("v", 10)
    s = Scheduler([_gpu(0, "GPU-A"), _gpu(1, "GPU-B")], {u.name: u for u in (h, s_, v)})
    assert brief(s.request(h) + s.request(s_) + s.request(v)) == [
        "grant h.service 0",
        "grant s.service 1",
        "suspend s.service 1",
    ]
    assert brief(s.suspended_done(s_.name, "")) == ["grant v.service 1"]
    assert brief(s.set_gpus([_renumbered(0, "GPU-B"), Gpu(1, lost=True)])) == []
    assert brief(s.inactive(v.name, Outcome.EXITED)) == []
    assert brief(s.set_gpus([_renumbered(0, "GPU-B")])) == []  # h.service still holds 0
    assert brief(s.inactive(h.name, Outcome.EXITED)) == []
    assert brief(s.set_gpus([_gpu(0, "GPU-B")])) == ["resume s.service 0"]


def _suspended_while_renumbered(s: Scheduler) -> None:
    """s.service (GPU 0, GPU-A) is suspended for v.service while x.service holds GPU 1
    (GPU-B); NVML numbers the two GPUs anew meanwhile: both indices are lost when the
    suspend is done. x.service ends, and a sample shows the GPUs free."""
    assert brief(s.request(spec("v", 10))) == ["suspend s.service 0"]
    assert brief(s.set_gpus([_renumbered(0, "GPU-B"), _renumbered(1, "GPU-A")])) == []
    assert brief(s.suspended_done("s.service", "")) == []
    assert brief(s.inactive("x.service", Outcome.EXITED)) == []


SUSPENDED_WHILE_RENUMBERED = (spec("s", 20, preempt="suspend stop"), spec("x", 5), spec("v", 10))


def test_a_unit_suspended_from_a_renumbered_gpu_comes_back_on_the_one_it_was_granted() -> None:
    """Its suspend took along the UUIDs its indices named then, but for lost ones: those
    NVML had renumbered under it, so it knew none, and came back by index: on GPU 0, GPU-B,
    while its processes woke on GPU-A, which the books said was free. The UUIDs it was
    granted go along: it comes back on GPU-A, GPU 1 now, and v.service is granted GPU-B."""
    s = Scheduler(
        [_gpu(0, "GPU-A"), _gpu(1, "GPU-B")], {u.name: u for u in SUSPENDED_WHILE_RENUMBERED}
    )
    assert brief(s.request(SUSPENDED_WHILE_RENUMBERED[0]) + s.request(spec("x", 5))) == [
        "grant s.service 0",
        "grant x.service 1",
    ]
    _suspended_while_renumbered(s)
    assert brief(s.set_gpus([_gpu(0, "GPU-B"), _gpu(1, "GPU-A")])) == [
        "grant v.service 0",
        "resume s.service 1",
    ]


def test_a_holder_adopted_at_a_restart_is_told_the_gpus_its_env_file_names() -> None:
    """As above, after a controller restart that adopted s.service and x.service: the state
    file names their GPUs by index only; their env files name the UUIDs they run on
    (`Restore.remember_told`), and a later suspend takes them along."""
    before = Scheduler(
        [_gpu(0, "GPU-A"), _gpu(1, "GPU-B")], {u.name: u for u in SUSPENDED_WHILE_RENUMBERED}
    )
    before.request(SUSPENDED_WHILE_RENUMBERED[0])
    before.request(spec("x", 5))
    s = Scheduler(
        [_gpu(0, "GPU-A"), _gpu(1, "GPU-B")], {u.name: u for u in SUSPENDED_WHILE_RENUMBERED}
    )
    s.load(before.save())
    s.remember_uuids("s.service", {0: "GPU-A"})
    s.remember_uuids("x.service", {1: "GPU-B"})
    _suspended_while_renumbered(s)
    assert brief(s.set_gpus([_gpu(0, "GPU-B"), _gpu(1, "GPU-A")])) == [
        "grant v.service 0",
        "resume s.service 1",
    ]


def test_a_gate_asking_again_after_a_restart_gets_no_gpu_renumbered_meanwhile() -> None:
    """a.service was granted GPU 0, GPU-A, and the controller was killed before its gate read
    the answer; b.service runs on GPU 1, GPU-B. The new controller's NVML numbers GPU-B 0:
    both indices are lost while held. a.service's gate asks again and was granted GPU 0
    again, its env file written anew with GPU 0's UUID now: GPU-B, where b.service runs.
    Its processes have not started: it waits like any start, and is granted once b.service
    has ended."""
    a, b = spec("a", 50), spec("b", 50)
    before = Scheduler([_gpu(0, "GPU-A"), _gpu(1, "GPU-B")], {a.name: a, b.name: b})
    assert brief(before.request(a) + before.request(b)) == [
        "grant a.service 0",
        "grant b.service 1",
    ]
    s = Scheduler([_renumbered(0, "GPU-B"), _renumbered(1, "GPU-A")], {a.name: a, b.name: b})
    s.load(before.save())
    assert brief(s.request(a)) == []
    assert s.is_waiting(a.name)
    assert brief(s.inactive(b.name, Outcome.EXITED)) == []
    assert brief(s.set_gpus([_gpu(0, "GPU-B"), _gpu(1, "GPU-A")])) == ["grant a.service 0"]


def test_a_start_displaced_in_a_grants_wake_is_not_protected_from_by_that_grant() -> None:
    """Found at 20,000 examples (the thrash rule for a start that lost its kept place): places
    kept for a refill's u0 (GPUs 0-1) and u3 (GPU 2); u2, pinned to GPU 0, is granted it, u0
    is placed again on GPUs 1-2 and u3 loses its place, in the same pass, after u2's grant.
    u2 was granted while u3's place was kept: once u2 is made less urgent than u3, u3 may
    suspend it (`Scheduler._unkept`; the model counts u3 as known from that batch)."""

    def unit(
        prio: int, kind: UnitKind, gpus: int, devices: tuple[str, ...] = ()
    ) -> tuple[UnitSpec, bool]:
        ladder = (Rung.SUSPEND, Rung.STOP)
        return (UnitSpec("", prio, kind, gpus, False, devices=devices, preempt=ladder), True)

    state = RenumberMachine()
    bg, od = UnitKind.BACKGROUND, UnitKind.ON_DEMAND
    units = [unit(20, bg, 2), unit(10, od, 1), unit(10, od, 1, ("0",)), unit(50, bg, 1)]
    state.boot(
        gpus=3,
        units=units,
        yield_to_foreign=False,
        requeue_at_gate=False,
        started=[0, 0],
        freeze_fails=set(),
    )
    state.person_starts(index=2)
    state.priority_changes(index=2, prio=90)
    assert "suspend u2.service 0" in brief(state.sim.actions)
    state.teardown()
