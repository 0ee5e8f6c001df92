"""Template instances under random histories: the invariants of tests/test_core_properties.py,
and the instance rules of the README, judged by an independent oracle.

`InstanceMachine` plays every rule of `HostMachine` on a host with 1-3 plain units and 1-3
templates (`t0@.service`: on-demand or background, with or without `Devices=%i`), each with
1-3 instance names: for `Devices=%i`, GPU indices (some past the host's GPUs) and UUIDs (the
host's, when NVML knows them, and one no GPU has); else job names. Besides: someone starts
every instance of a template at once (a queue of jobs), and `urgent@.service` (`Devices=%i`,
more urgent than any other unit) starts on the GPU of an instance that runs, which then gives
way. The controller's part is played as it plays it (gpuslice/controller.py, instances.py):
an instance is learnt with its template's annotation (`UnitSpec.for_instance`) from any signal
of it (`Scheduler.learn`), every daemon-reload passes the instances the core knows and those
that run (`_concrete_specs`), one seen down is asked to be forgotten (`Instances.forget`, once
systemd's SystemState confirmed a hold: `_holds_read`), preempted instances past a cap are
dropped (`Instances._cap_preempted`, PREEMPTED_INSTANCES_MAX) and each then forgotten; a
template's `Type=` may change at a reload; the host's shutdown stops what runs, and is cancelled.

The oracle, `InstanceSim`, is `Sim` (tests/core_builders.py) with the README's instance rules
(README, "The rules in short"): refill starts a background instance only once someone started
it since it was learnt (a preempted one comes back all the same); an instance is forgotten
once down and owed nothing (on-demand: not waiting, running, suspended, or preempted with
`Requeue=yes`; background likewise, not held, and not stopped by a shutdown that was then
cancelled, which refill may start again), and never while owed; while the host goes down
nothing is started, granted or stopped; past the cap, those that would come back last (least
urgent, then last preempted) are dropped, each said once, and no others; a pinned instance is
granted only the GPU its name gives. The core and the model know the same units throughout.

`GPUSLICE_FUZZ_EXAMPLES` sets the number of histories here too.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from gpuslice.core.decisions import Code
from gpuslice.core.model import (
    INSTANCE_DEVICE,
    Gpu,
    UnitKind,
    UnitSpec,
    is_instance,
    is_template,
)
from gpuslice.core.scheduler import Action, Log, Outcome, Scheduler, Start
from tests.core_builders import BG, GIB, OD, InvariantError, Sim, brief, drawn, drawn_host, spec
from tests.test_core_properties import (
    EXAMPLES,
    LADDER,
    RESTART,
    UNIT,
    HostMachine,
    machine_settings,
)

# `Devices=%i`: GPU 0-2 (those of the host, maybe), 3 and 7 (none), the UUIDs `sized` gives
# GPUs 0 and 1 (a host without NVML knows none), one that no GPU has
PINNED_NAMES = st.lists(
    st.sampled_from(["0", "1", "2", "3", "7", "GPU-0", "GPU-1", "GPU-9"]),
    min_size=1,
    max_size=3,
    unique=True,
)
JOB_NAMES = st.lists(st.sampled_from(["a", "b", "job-1", "0"]), min_size=1, max_size=3, unique=True)

# as urgent as most plain units, or more: instances run, and `urgent@` preempts them
TEMPLATE_PRIORITIES = st.sampled_from([10, 20, 50])
# instances mostly share a GPU (of known size): a more urgent job preempts several at once
TEMPLATE_MEMORY = st.sampled_from([8 * GIB, 4 * GIB, 12 * GIB, None])
# jobs more urgent than any other, each on the whole GPU its name gives: `urgent@1.service`
# preempts what runs on GPU 1
URGENT = UnitSpec("urgent@.service", 5, OD, 1, False, devices=(INSTANCE_DEVICE,))

# its [Service] Restart= is each instance's (`for_instance`): a clean exit's GPUs kept too
TEMPLATE = st.builds(
    lambda prio, kind, gpus, requeue, memory, ladder, pinned, annotated, names, restart: (
        drawn(
            prio,
            kind,
            gpus,
            requeue,
            memory,
            ladder,
            (INSTANCE_DEVICE,) if pinned else (),
            restart=restart,
        ),
        annotated,
        names[0] if pinned else names[1],
    ),
    TEMPLATE_PRIORITIES,
    st.sampled_from(list(UnitKind)),
    st.sampled_from([1, 1, 1, 1, 2]),
    st.booleans(),
    TEMPLATE_MEMORY,
    LADDER,
    st.booleans(),
    st.sampled_from([True, True, True, False]),
    st.tuples(PINNED_NAMES, JOB_NAMES),
    RESTART,
)

REFILL = "starting background "


class InstanceSim(Sim):
    """`Sim` that also knows which instances nobody started since they were learnt, and
    judges what the core forgets and drops."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        # instances known with no start of them seen since they were learnt
        self.dormant: set[str] = {n for n in self.annotations if is_instance(n)}
        # background instances the host's shutdown stopped (one that was cancelled): kept
        # until they are down again, for refill to start them as plain background units
        self.by_shutdown: set[str] = set()

    # -- what the controller tells the core -----------------------------------------------

    def learn(self, spec: UnitSpec) -> None:
        """A signal of an instance the core does not know (`Controller.on_unit_changed`)."""
        if spec.name in self.annotations:
            return
        self.annotations[spec.name] = spec
        self.dormant.add(spec.name)
        self.sched.learn(spec)

    def annotate(self, specs: Iterable[UnitSpec]) -> list[Action]:
        specs = list(specs)
        names = {s.name for s in specs}
        new = {n for n in names if is_instance(n)} - self.annotations.keys()
        self.dormant = (self.dormant & names) | new
        actions = super().annotate(specs)
        self.dormant -= self.running.keys()  # adopted: someone started it
        # on-demand now (or no longer annotated): owed no refill
        self.by_shutdown = {n for n in self.by_shutdown if n in self._background()}
        return actions

    def announce(self, name: str) -> list[Action]:
        if name not in self.pending_stops and not self.active(name):
            self.dormant.discard(name)
        return super().announce(name)

    def _request(self, name: str) -> list[Action]:
        self.dormant.discard(name)
        return super()._request(name)

    def _loaded(self) -> None:
        """A new controller learns every instance anew: those that run (or whose start of
        ours it saved, or whose gate asks again) were started by someone."""
        super()._loaded()
        active = self.running.keys() | self.suspended.keys() | set(self.pending_starts)
        self.dormant = {n for n in self.annotations if is_instance(n)} - active - self.by_shutdown

    def _went_out(self, name: str) -> int:
        self.by_shutdown.discard(name)  # down again: kept no longer
        return super()._went_out(name)

    def _background(self) -> set[str]:
        return {n for n, s in self.annotations.items() if s.kind is BG and is_instance(n)}

    def shutdown_cancelled(self) -> list[Action]:
        """systemd takes the host down (nothing pending, nothing frozen or suspended): each
        unit that runs is stopped by the shutdown, and gpuslice starts, grants or stops
        nothing meanwhile; then the shutdown is cancelled. A background instance it stopped
        is kept, and refill may start it again (it ran: someone started it)."""
        assert self.quiet and not (self.at_gate or self.frozen or self.suspended)
        self.sched.set_shutting_down(True)
        for name in sorted(self.running):
            instance = name in self._background()
            del self.running[name]
            self._went_out(name)
            moved = [
                a
                for a in self._feed(self.sched.inactive(name, Outcome.SHUTDOWN))
                if not isinstance(a, Log)
            ]
            if moved:
                raise InvariantError(f"{name} stopped by the shutdown: {brief(moved)}")
            if instance:
                self.by_shutdown.add(name)
        return self._feed(self.sched.set_shutting_down(False))

    def idle_background(self) -> set[str]:
        return super().idle_background() - self.dormant

    def _on_start(self, start: Start) -> None:
        if start.reason.startswith(REFILL) and start.unit in self.dormant:
            raise InvariantError(f"refill started {start.unit}: nobody started it since learnt")
        super()._on_start(start)

    # -- forgetting -----------------------------------------------------------------------

    def _owed(self, name: str) -> bool:
        """Down, what keeps an instance known: its comeback, or a background one's hold, or
        its refill after a shutdown that was cancelled."""
        spec = self.annotations[name]
        return (
            (name in self.preempted and spec.requeue)
            or (spec.kind is BG and name in self.held)
            or name in self.by_shutdown
        )

    def forget_instance(self, name: str) -> bool:
        """Seen down, an instance owed nothing is forgotten, one owed something never."""
        assert is_instance(name), name
        if self.active(name):
            return False
        if name not in self.annotations:
            if self.sched.forget_instance(name):
                raise InvariantError(f"{name} forgotten: not annotated, nothing to forget")
            return False
        self.sched.holds_confirmed([name])  # systemd's SystemState: the host runs on
        forgot = self.sched.forget_instance(name)
        owed = self._owed(name)
        if forgot and owed:
            raise InvariantError(f"{name} forgotten while gpuslice owes it")
        if not forgot and not owed:
            raise InvariantError(f"{name} down and owed nothing, but kept")
        if forgot:
            del self.annotations[name]
            for ended in (self.held, self.finished, self.failed, self.paused, self.dormant):
                ended.discard(name)
            self.preempted.pop(name, None)
            self.out_since.pop(name, None)
        return forgot

    def preempted_down(self) -> list[str]:
        """Instances kept preempted and down: those the cap may drop."""
        return [
            n
            for n in self.preempted
            if is_instance(n) and n in self.annotations and not self.active(n)
        ]

    def cap_preempted(self, limit: int) -> None:
        """`Instances._cap_preempted`: past `limit` instances kept preempted, those down
        that would come back last are dropped (each said once, as a warning), then forgotten."""
        kept = {n for n in self.preempted if is_instance(n) and n in self.annotations}
        books = {n for n in self.sched.preempted if is_instance(n)}
        if kept != books:
            raise InvariantError(f"preempted instances: {sorted(kept)}; the core's {sorted(books)}")
        down = sorted(
            self.preempted_down(), key=lambda n: (self.annotations[n].priority, self.preempted[n])
        )
        last = down[len(down) - max(0, min(len(down), len(kept) - limit)) :]
        actions = self._feed(self.sched.drop_preempted_instances(limit))
        said = [
            a.decision.unit
            for a in actions
            if isinstance(a, Log) and a.decision is not None and a.decision.code is Code.DROPPED
        ]
        if len(said) != len(actions) or sorted(said) != sorted(last):
            raise InvariantError(f"dropped {said} of {down} past {limit}; expected {last}")
        for name in said:
            del self.preempted[name]
            self.dormant.add(name)
        for name in said:
            if not self.forget_instance(name):
                raise InvariantError(f"{name} dropped but kept")


def _instance(template: UnitSpec, name: str) -> UnitSpec:
    """The instance's annotation as the controller gives it the core (`for_instance`), its
    pin checked against the README's rule: `Devices=%i` pins it to the GPU its name gives."""
    spec = template.for_instance(name)
    given = name[name.index("@") + 1 : -len(".service")]
    pin = (given,) if template.devices == (INSTANCE_DEVICE,) else template.devices
    assert (spec.name, spec.devices, spec.restart) == (name, pin, template.restart), spec
    return spec


class InstanceMachine(HostMachine):
    """Plain units, templates and their instances (`_unit` learns an instance, as any
    signal of it teaches the controller)."""

    sim: InstanceSim

    def __init__(self) -> None:
        super().__init__()
        self.instances: dict[str, list[str]] = {}  # template -> its instances' names
        self.names: list[str] = []  # what the rules pick from: instances, then plain units

    @initialize(
        whole=st.booleans(),
        gpus=st.integers(1, 4),
        units=st.lists(UNIT, min_size=1, max_size=3),
        templates=st.lists(TEMPLATE, min_size=1, max_size=3),
        listed=st.booleans(),
        started=st.lists(st.integers(0, 7), max_size=6),
        yield_to_foreign=st.booleans(),
        requeue_at_gate=st.booleans(),
    )
    def boot(
        self,
        whole: bool,
        gpus: int,
        units: list[tuple[UnitSpec, bool]],
        templates: list[tuple[UnitSpec, bool, list[str]]],
        listed: bool,
        started: list[int],
        yield_to_foreign: bool,
        requeue_at_gate: bool,
    ) -> None:
        host = drawn_host(whole, gpus)
        self.specs = [replace(s, name=f"u{i}.service") for i, (s, _) in enumerate(units)]
        self.annotated = [on for _, on in units]
        instances: list[str] = []
        for j, (template, on, names) in enumerate(templates):
            name = f"t{j}@.service"
            self.specs.append(replace(template, name=name))
            self.annotated.append(on)
            self.instances[name] = [f"t{j}@{n}.service" for n in names]
            instances += self.instances[name]
        plain = [s.name for s in self.specs if not is_template(s.name)]
        self.names = instances[: 8 - len(plain)] + plain  # the rules pick among 8
        self.specs.append(URGENT)  # started by `urgent_job_starts` alone
        self.annotated.append(True)
        self.instances[URGENT.name] = [f"urgent@{g}.service" for g in range(len(host))]
        self.sim = InstanceSim(
            host,
            self._annotations(),
            yield_to_foreign=yield_to_foreign,
            requeue_at_gate=requeue_at_gate,
        )
        if listed:  # the controller's start lists one down, which nobody started since
            for template, on in zip(self.specs, self.annotated, strict=True):
                if on and is_template(template.name):
                    self.sim.learn(_instance(template, self.instances[template.name][0]))
        self.sim.boot()
        for index in started:  # people start jobs right away: most histories run instances
            self.person_starts(index)

    def _annotations(self) -> list[UnitSpec]:
        """Plain units' annotations; each annotated template's for the instances the core
        knows and those systemd shows active (`Controller._concrete_specs`)."""
        specs: list[UnitSpec] = []
        for unit, on in zip(self.specs, self.annotated, strict=True):
            if not on:
                continue
            if not is_template(unit.name):
                specs.append(unit)
                continue
            for name in self.instances[unit.name]:
                if name in self.sim.annotations or self.sim.active(name):
                    specs.append(_instance(unit, name))
        return specs

    def _template(self, name: str) -> UnitSpec | None:
        """The annotated template of an instance."""
        at = name.find("@")
        for unit, on in zip(self.specs, self.annotated, strict=True):
            if on and unit.name == name[: at + 1] + ".service":
                return unit
        return None

    def _unit(self, index: int) -> str:
        name = self.names[index % len(self.names)]
        template = self._template(name) if is_instance(name) else None
        if template is not None and name not in self.sim.annotations:
            self.sim.learn(_instance(template, name))
        return name

    @rule(index=st.integers(0, 7))
    def seen_down_as_an_instance(self, index: int) -> None:
        """The controller asks the core to forget each instance it sees down."""
        sim = self.sim
        down = sorted(n for n in sim.annotations if is_instance(n) and not sim.active(n))
        if down:
            sim.forget_instance(down[index % len(down)])

    def _running_instances(self) -> list[str]:
        sim = self.sim
        return sorted(
            n
            for n, on in sim.running.items()
            if is_instance(n) and on and sim.runs(n) and not n.startswith("urgent@")
        )

    @rule(index=st.integers(0, 7))
    def a_template_floods(self, index: int) -> None:
        """Someone starts every instance of a template at once (a queue of jobs)."""
        templates = [s for s, on in zip(self.specs, self.annotated, strict=True) if on]
        templates = [s for s in templates if is_template(s.name) and s.name != URGENT.name]
        if templates:
            template = templates[index % len(templates)]
            for name in self.instances[template.name]:
                self.sim.learn(_instance(template, name))
                self.sim.start(name)

    @precondition(lambda self: bool(self._running_instances()))
    @rule(index=st.integers(0, 7))
    def urgent_job_starts(self, index: int) -> None:
        """The most urgent job starts on the GPU of an instance that runs: what runs there
        is preempted (or suspended, or frozen), and comes back once it ends."""
        running = self._running_instances()
        name = f"urgent@{self.sim.running[running[index % len(running)]][0]}.service"
        sim = self.sim
        template = self._template(name)
        if template is not None:
            sim.learn(_instance(template, name))
            sim.start(name)

    @precondition(lambda self: bool(self.sim.preempted_down()))
    @rule(limit=st.integers(0, 2))
    def preempted_instances_capped(self, limit: int) -> None:
        """An instance kept went down: past `limit` kept preempted, some are dropped."""
        self.sim.cap_preempted(limit)

    @rule(index=st.integers(0, 7))
    def annotation_toggles(self, index: int) -> None:
        """As `HostMachine`'s, for a template: its annotation goes for all its instances
        (or comes back for those systemd shows active), unless one is where the adapter's
        part decides."""
        index %= len(self.specs)
        sim = self.sim
        for name in self.instances.get(self.specs[index].name, [self.specs[index].name]):
            if name in sim.unmanaged or name in sim.suspended:
                return
            if name in sim.pending_stops or name in sim.pending_resumes:
                return
            if name in sim.pending_suspends:
                return
        self.annotated[index] = not self.annotated[index]
        sim.annotate(self._annotations())

    @rule(index=st.integers(0, 7))
    def template_kind_flips(self, index: int) -> None:
        """A daemon-reload gives a template the other `Type=`: its instances with it."""
        templates = [i for i, s in enumerate(self.specs) if is_template(s.name)]
        i = templates[index % len(templates)]
        kind = OD if self.specs[i].kind is BG else BG
        self.specs[i] = replace(self.specs[i], kind=kind)
        self.sim.annotate(self._annotations())

    @precondition(
        lambda self: (
            self.sim.quiet
            and bool(self.sim.running)
            and not (self.sim.at_gate or self.sim.frozen or self.sim.suspended)
        )
    )
    @rule()
    def host_shutdown_cancelled(self) -> None:
        self.sim.shutdown_cancelled()

    @invariant()
    def core_knows_what_the_model_knows(self) -> None:
        known = self.sim.sched.annotated()
        model = frozenset(self.sim.annotations)
        assert known == model, f"core {sorted(known - model)}, model {sorted(model - known)}"


# longer histories than `HostMachine`'s: an instance must be learnt, started, preempted and
# seen down before the rules on forgetting it have anything to judge
InstanceMachine.TestCase.settings = settings(machine_settings(EXAMPLES), stateful_step_count=60)
TestInstances = InstanceMachine.TestCase


def test_the_constants_hypothesis_draws_are_the_codes_whatever_ran_before() -> None:
    """Hypothesis draws, now and then, constants from the source of the local modules imported
    so far: after tests/test_bench_day.py (it imports bench.day), `InstanceMachine` drew other
    histories than in this file alone. tests/conftest.py imports every module of gpuslice and
    bench first: a process that loads it has them all, whatever it runs next."""
    repo = Path(__file__).resolve().parent.parent
    local = sorted(
        ".".join(path.relative_to(repo).with_suffix("").parts).removesuffix(".__init__")
        for package in ("gpuslice", "bench")
        for path in (repo / package).rglob("*.py")
    )
    script = "import sys, tests.conftest; print(*sys.modules)"
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, check=True
    )
    assert [name for name in local if name not in run.stdout.split()] == []


# -- what the machine found in the core (fixed since) -----------------------------------------


def test_an_instance_annotated_again_while_it_runs_is_refilled_after_a_cancelled_shutdown() -> None:
    """Found by `InstanceMachine`: a background instance runs; a daemon-reload takes its
    template's annotation out (it keeps its GPU until it ends) and the next puts it back. The
    core took the name, new to its annotations, for one learnt with no start seen (dormant),
    though it held that GPU: stopped by a shutdown that was then cancelled, it was kept for
    its refill (`stopped_by_shutdown`), which refill never sent, and kept from being
    forgotten, until a controller restart."""
    s = Scheduler([Gpu(0)], {})
    embed = spec("embed@a", 90, BG)
    assert brief(s.request(embed)) == ["grant embed@a.service 0"]
    s.set_specs({})
    s.set_specs({embed.name: embed})
    s.set_shutting_down(True)
    assert brief(s.inactive(embed.name, Outcome.SHUTDOWN)) == []
    assert brief(s.set_shutting_down(False)) == ["start embed@a.service"]


def test_a_failed_refill_of_an_instance_turned_background_is_no_comeback() -> None:
    """Found by `InstanceMachine`: an on-demand instance (`Requeue=yes`) runs, the host's
    shutdown stops it (owed nothing) and is cancelled; a daemon-reload makes its template
    background, and refill starts it (someone started it before). That start does not
    reach systemd: a refill's start that does not happen is no comeback (README), so the
    core leaves it to refill, which starts it again once the delay is over. The model took
    every failed start of an instance for a comeback and judged that refill a background
    start before a preempted unit (itself), then the instance preempted and never brought
    back."""
    job = spec("t0@b", 20, OD)
    sim = InstanceSim(1, [job])
    sim.boot()
    sim.start(job.name)
    sim.shutdown_cancelled()
    flipped = replace(job, kind=BG)
    assert [a.unit for a in sim.annotate([flipped]) if isinstance(a, Start)] == [job.name]
    sim.fail_start(job.name)
    assert [a.unit for a in sim.retry_start(job.name) if isinstance(a, Start)] == [job.name]
    sim.drain()


def test_a_failed_refill_of_an_instance_turned_background_is_refill_again() -> None:
    """The core's side of the case above: the refill's failed start leaves the instance
    idle, not preempted, and refill (not a comeback) starts it again after the delay."""
    s = Scheduler([Gpu(0)], {})
    job = spec("t0@b", 20, OD)
    s.set_specs({job.name: job})
    assert brief(s.request(job)) == ["grant t0@b.service 0"]
    s.set_shutting_down(True)
    s.inactive(job.name, Outcome.SHUTDOWN)
    assert brief(s.set_shutting_down(False)) == []
    flipped = replace(job, kind=BG)
    assert brief(s.set_specs({job.name: flipped})) == ["start t0@b.service"]
    s.start_failed(job.name, "no reply (NoReply)")
    assert job.name not in s.preempted
    started = [a for a in s.retry_start(job.name) if isinstance(a, Start)]
    assert [(a.unit, a.reason.startswith(REFILL)) for a in started] == [(job.name, True)]
