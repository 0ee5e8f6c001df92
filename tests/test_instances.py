"""The instances of annotated templates (gpuslice/instances.py), driven directly: a real
core and tracker, the gates' pipes in a temporary directory, the controller's `execute` and
status's `changed` recorded. What is let go of at an instance's down, what is kept while
gpuslice owes it something, and the bounds on what is kept."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gpuslice import envfiles
from gpuslice import instances as instances_module
from gpuslice.core.decisions import Code
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import Action, Log, SavedState, Scheduler
from gpuslice.gatepipes import GatePipes
from gpuslice.instances import Instances
from gpuslice.paths import env_file
from gpuslice.tracker import Ledger, Tracker, UnitState
from tests.core_builders import BG, spec

JOB = "job@a.service"


class Kit:
    """Instances with what it is given: the core (`specs`, then `saved` loaded), a tracker
    that follows every unit, pipes and env files under `tmp_path`."""

    def __init__(
        self, tmp_path: Path, specs: list[UnitSpec], saved: SavedState | None = None
    ) -> None:
        self.scheduler = Scheduler([Gpu(0)], {s.name: s for s in specs})
        if saved is not None:
            self.scheduler.load(saved)
        self.tracker = Tracker(
            lambda _: True, Ledger(self.scheduler.phase, self.scheduler.is_waiting)
        )
        self.gates = GatePipes(tmp_path / "gate")
        self.runtime_dir = str(tmp_path / "run")
        self.changes = 0
        self.executed: list[list[Action]] = []
        self.undelivered: list[str] = []
        self.instances = Instances(
            self.scheduler,
            self.tracker,
            self.gates,
            lambda: self.runtime_dir,
            self.changed,
            self.executed.append,
            self.undelivered.append,
        )

    def changed(self) -> None:
        self.changes += 1

    def show(self, name: str, active: str = "inactive", sub: str = "dead", job: int = 0) -> None:
        """Systemd's word on the unit, as a listing gives it (the others' kept)."""
        others = [s for n, s in self.tracker.states.items() if n != name]
        self.tracker.listed([*others, UnitState(name, active, sub, job)])


def test_down_is_an_instance_systemd_shows_down_with_no_job(tmp_path: Path) -> None:
    kit = Kit(tmp_path, [])
    assert kit.instances.down(JOB)  # never heard of: inactive, no job
    assert not kit.instances.down("plain.service")  # not an instance: its name comes again
    kit.show(JOB, "active", "running")
    assert not kit.instances.down(JOB)
    kit.show(JOB, "inactive", "dead", job=7)  # a start queued: not down for good
    assert not kit.instances.down(JOB)
    kit.show(JOB, "activating", "auto-restart")  # down; its restart comes (forget waits)
    assert kit.instances.down(JOB)
    kit.show(JOB, "failed", "failed")
    assert kit.instances.down(JOB)


def test_an_instance_down_leaves_no_pipe_env_file_or_announcement(tmp_path: Path) -> None:
    """Its pipe and env file go (in the runtime_dir of now, the config's, read at the down),
    and it is no longer watched as announced; another instance's are kept."""
    kit = Kit(tmp_path, [])
    kit.runtime_dir = str(tmp_path / "run2")  # read at each down, not at construction
    for name in (JOB, "job@b.service"):
        kit.gates.expect(name)
        envfiles.write(kit.runtime_dir, name, [Gpu(0)])
        kit.instances.announced.add(name)
    kit.instances.went_down(JOB)
    assert not (tmp_path / "gate" / JOB).exists()
    assert not env_file(kit.runtime_dir, JOB).exists()
    assert kit.instances.announced == {"job@b.service"}
    assert kit.undelivered == [JOB]  # Delivery forgets its unwritten file
    assert (tmp_path / "gate" / "job@b.service").exists()
    assert env_file(kit.runtime_dir, "job@b.service").exists()


def test_an_instance_owed_nothing_is_forgotten_by_the_core_and_the_tracker(
    tmp_path: Path,
) -> None:
    kit = Kit(tmp_path, [spec("job@a", 10), spec("plain", 10)])
    kit.show(JOB, "failed", "failed")
    kit.instances.forget(JOB)
    assert JOB not in kit.scheduler.annotated()
    assert JOB not in kit.tracker.states
    assert kit.changes == 1  # status no longer shows it (held, finished, failed)
    assert kit.executed == []


def test_an_instance_is_not_forgotten_while_a_call_of_ours_or_its_restart_is_due(
    tmp_path: Path,
) -> None:
    """A call unanswered: its answer is judged with what is known. In auto-restart: its
    restart job comes, and the tracker must still know it was told down."""
    kit = Kit(tmp_path, [spec("job@a", 10), spec("job@b", 10)])
    kit.show(JOB, "failed", "failed")
    kit.tracker.call_sent(JOB)
    kit.instances.forget(JOB)
    kit.show("job@b.service", "activating", "auto-restart")
    kit.instances.forget("job@b.service")
    assert {JOB, "job@b.service"} <= kit.scheduler.annotated()
    assert {JOB, "job@b.service"} <= kit.tracker.states.keys()
    assert (kit.changes, kit.executed) == (0, [])


def test_past_the_bound_preempted_instances_that_come_back_last_are_dropped_and_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance kept (preempted, owed its comeback) goes down: past
    PREEMPTED_INSTANCES_MAX, the core drops those that would come back last, each said, and
    each is forgotten as any instance owed nothing."""
    monkeypatch.setattr(instances_module, "PREEMPTED_INSTANCES_MAX", 1)
    names = [f"job@{i}.service" for i in range(3)]
    preempted = {name: i + 1 for i, name in enumerate(names)}
    kit = Kit(tmp_path, [spec(n, 10) for n in names], SavedState(preempted=preempted, seq=4))
    kit.instances.forget(names[0])  # owed its comeback: kept
    [dropped] = kit.executed
    assert all(isinstance(a, Log) for a in dropped)
    said = [a.decision.unit for a in dropped if a.decision is not None]
    assert all(a.decision.code is Code.DROPPED for a in dropped if a.decision is not None)
    assert sorted(said) == names[1:]  # the last preempted come back last
    assert set(kit.scheduler.preempted) == {names[0]}
    assert kit.scheduler.annotated() == {names[0]}
    assert kit.changes == 2  # once for each forgotten


def test_below_the_bound_nothing_is_dropped(tmp_path: Path) -> None:
    names = [f"job@{i}.service" for i in range(3)]
    preempted = {name: i + 1 for i, name in enumerate(names)}
    kit = Kit(tmp_path, [spec(n, 10) for n in names], SavedState(preempted=preempted, seq=4))
    kit.instances.forget(names[0])
    assert kit.executed == []
    assert set(kit.scheduler.preempted) == set(names)


def test_instances_kept_past_the_bound_are_said_once_until_they_are_fewer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Held background instances are kept (a hold is someone's wish): past
    KEPT_INSTANCES_WARN instances the journal says how many, once; said again only after
    they were no more than the bound. Plain units held are not counted."""
    caplog.set_level(logging.WARNING, logger="gpuslice")
    monkeypatch.setattr(instances_module, "KEPT_INSTANCES_WARN", 2)
    names = [f"job@{i}.service" for i in range(3)]
    specs = [spec(n, 10, BG) for n in [*names, "plain"]]

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "instances are kept" in r.message]

    plain = Kit(tmp_path, specs, SavedState(held=[*names[:2], "plain.service"]))
    plain.instances.forget(names[0])
    assert said() == []  # three held, two of them instances: not past the bound

    kit = Kit(tmp_path, specs, SavedState(held=names))
    kit.instances.forget(names[0])
    kit.instances.forget(names[1])
    assert said() == [
        "3 instances are kept held or preempted (more than 2): gpuslice forgets a held one "
        "only once it is started again and has ended, a preempted one once it is back; each "
        "is saved in the state file, which is refused whole past 16 MiB"
    ]
    monkeypatch.setattr(instances_module, "KEPT_INSTANCES_WARN", 3)
    kit.instances.forget(names[0])  # no more than the bound: said again once past it
    monkeypatch.setattr(instances_module, "KEPT_INSTANCES_WARN", 2)
    kit.instances.forget(names[0])
    assert len(said()) == 2
    assert kit.scheduler.held == set(names)  # a hold is kept
