"""Instances of a background template (`embed@.service`, `Type=background`): one name per
job (a timer's, a path unit's, an `Accept=yes` socket's connection). Each that ends owed
nothing is forgotten, as an on-demand instance is: kept, every instance ever started stayed
in memory, in the tracker, in the match rules and in the state file, which past 16 MiB is
refused whole at the next start, preemptions with it. Forgotten, an instance learnt again
(a signal: `systemctl status` loads it; the next controller's start lists it) is dormant:
refill starts none until someone starts it, so a finished job never runs again."""

from __future__ import annotations

import logging
from collections.abc import Sized
from pathlib import Path
from typing import cast

import pytest

from gpuslice import instances as instances_module
from gpuslice.controller import Controller
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Log, Outcome, SavedState, Scheduler
from tests.core_builders import BG, brief, sized, spec
from tests.test_controller import (
    Bed,
    at_gate,
    goes_down,
    run,
    run_instance,
    saved_record,
    settle,
    state,
    until,
    write_unit,
)

DOWN = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
EMBED = {"a.service": "Priority=50\n", "embed@.service": "Priority=90\nType=background\n"}


REBOOTS_STOP = (3, "/org/freedesktop/systemd1/job/3")  # the shutdown's stop of the instance


def runs_as_a_reboot_begins(ctl: Controller, embed: str) -> None:
    """`embed` passes its gate and runs; reboot.target's job (2) comes."""
    ctl.on_job_new(1, "/org/freedesktop/systemd1/job/1", embed)
    ctl.on_unit_changed(embed, at_gate())
    ctl.on_unit_changed(embed, {"ActiveState": "active", "SubState": "running"})
    ctl.on_job_new(2, "/org/freedesktop/systemd1/job/2", "reboot.target")


def the_reboot_stops(ctl: Controller, embed: str, sub: str = "stop-sigterm") -> None:
    """The reboot's stop of `embed` (job 3) begins: deactivating (SubState `sub`), not down
    yet."""
    ctl.on_job_new(*REBOOTS_STOP, embed)
    ctl.on_unit_changed(
        embed, {"ActiveState": "deactivating", "SubState": sub, "Job": REBOOTS_STOP}
    )


async def run_then_stopped_by_a_reboot(ctl: Controller, embed: str) -> None:
    """`embed` passes its gate and runs; reboot.target's job comes, and its stop (job 3)
    takes it down: kept as stopped by the shutdown, for a cancel's refill."""
    runs_as_a_reboot_begins(ctl, embed)
    the_reboot_stops(ctl, embed, "stop")
    ctl.on_unit_changed(embed, DOWN)
    ctl.on_job_removed(*REBOOTS_STOP, embed, "done")
    await settle()
    assert embed in ctl.scheduler.stopped_by_shutdown


# -- the core ---------------------------------------------------------------------------------


def test_a_background_instance_only_learnt_is_not_refilled() -> None:
    """Learnt from a signal of it down (or listed at start-up), nobody started it: its name
    is one job, maybe one that finished and was forgotten."""
    s = Scheduler([Gpu(0)], {})
    s.learn(spec("embed@a", 90, BG))
    assert brief(s.schedule()) == []
    assert brief(s.set_specs({"embed@b.service": spec("embed@b", 90, BG)})) == []


def test_a_finished_background_instance_is_forgotten_and_learnt_again_not_refilled() -> None:
    s = Scheduler([Gpu(0)], {})
    embed = spec("embed@a", 90, BG)
    assert brief(s.request(embed)) == ["grant embed@a.service 0"]
    s.inactive(embed.name, Outcome.EXITED)
    assert s.finished == {embed.name}
    assert s.forget_instance(embed.name)
    assert (s.specs, s.finished, s.out_since, s.dormant) == ({}, set(), {}, set())
    assert s.save().finished == []
    s.learn(embed)  # `systemctl status embed@a` loads it again: a signal of it down
    assert brief(s.schedule()) == []
    assert brief(s.request(embed)) == ["grant embed@a.service 0"]  # someone starts it


def test_a_failed_background_instance_is_forgotten_a_held_one_kept() -> None:
    s = Scheduler([Gpu(0), Gpu(1)], {})
    failed, held = spec("embed@f", 90, BG), spec("embed@h", 90, BG)
    s.request(failed)
    s.request(held)
    s.inactive(failed.name, Outcome.FAILED)
    s.inactive(held.name, Outcome.STOPPED)
    assert s.forget_instance(failed.name)
    assert not s.forget_instance(held.name)  # an admin's stop: shown held until started
    assert s.snapshot().held == [held.name] and s.snapshot().failed == []


def test_a_preempted_background_instance_comes_back_then_is_forgotten_once_done() -> None:
    s = Scheduler([Gpu(0)], {})
    embed, urgent = spec("embed@a", 90, BG), spec("urgent", 10)
    s.request(embed)
    assert brief(s.request(urgent)) == ["stop embed@a.service"]
    s.inactive(embed.name, Outcome.STOPPED)
    assert embed.name in s.preempted
    assert not s.forget_instance(embed.name)  # owed its comeback
    assert brief(s.inactive(urgent.name, Outcome.EXITED)) == ["start embed@a.service"]
    assert brief(s.request(embed)) == ["grant embed@a.service 0"]
    s.inactive(embed.name, Outcome.EXITED)
    assert s.forget_instance(embed.name)


def test_a_preempted_background_instance_learnt_at_start_up_comes_back() -> None:
    """A restarted controller learns it from its state file (dormant: nobody started it in
    its time): its comeback is owed all the same."""
    s = Scheduler([Gpu(0)], {})
    s.set_specs({"embed@a.service": spec("embed@a", 90, BG)})
    assert brief(s.load(SavedState(preempted={"embed@a.service": 1}, seq=1))) == []
    assert brief(s.schedule()) == ["start embed@a.service"]
    assert brief(s.request(spec("embed@a", 90, BG))) == ["grant embed@a.service 0"]
    s.inactive("embed@a.service", Outcome.EXITED)
    assert s.forget_instance("embed@a.service")


def test_a_background_instance_a_restarted_controller_finds_running_is_not_dormant() -> None:
    """Saved as a holder, it was started by someone: ended with no record of how (the
    host going down), refill may start it like any background unit."""
    s = Scheduler([Gpu(0)], {})
    s.set_specs({"embed@a.service": spec("embed@a", 90, BG)})
    s.load(SavedState(holders={"embed@a.service": ((0,), "running", 1, "")}, seq=1))
    assert brief(s.inactive("embed@a.service", Outcome.SHUTDOWN)) == ["start embed@a.service"]


# -- the controller ---------------------------------------------------------------------------


def test_ten_thousand_background_instances_that_ended_leave_nothing_behind(
    tmp_path: Path,
) -> None:
    """A timer's or a socket's instances (`embed@N.service`), each started, finished and
    unloaded by systemd: afterwards the controller knows, tracks, watches and saves what it
    did before the first of them."""
    bed = Bed(tmp_path, EMBED, [])
    state_file = Path(bed.config.state_dir) / "state.json"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await until(lambda: bed.systemd.watched == {"a.service"})
        run_instance(ctl, "embed@first.service", 1)
        await settle()
        before = saved_record(bed)
        for i in range(10_000):
            run_instance(ctl, f"embed@{i}.service", i + 2)
            if i % 50 == 0:
                await settle()
        await settle()
        core = ctl.scheduler
        assert core.annotated() == {"a.service"}
        assert (core.finished, core.out_since, core.dormant) == (set(), {}, set())
        assert ctl.tracker.states == {}
        assert ctl.instances.announced == set()
        for table in (
            core,
            ctl.tracker,
            ctl.gates,
            ctl.reads,
            ctl.answers,
            ctl.ladder,
            ctl.instances,
            ctl,
        ):
            grown = {
                k: len(v)
                for k, v in vars(table).items()
                if isinstance(v, Sized) and not isinstance(v, str | bytes) and len(v) > 16
            }
            assert grown == {}, (type(table).__name__, grown)
        assert saved_record(bed) == before
        assert state_file.stat().st_size < 4096
        await until(lambda: bed.systemd.watched == {"a.service"})
        assert not [c for c in bed.systemd.calls if c[0] == "start"]

    run(test)


def test_a_forgotten_finished_instance_seen_again_by_a_signal_is_not_started(
    tmp_path: Path,
) -> None:
    """embed@a finished under this controller and was forgotten; `systemctl status
    embed@a` loads it again, and its signal reaches the controller (beyond 200 units every
    unit's does). Learnt as new, refill started it: a finished job ran again."""
    bed = Bed(tmp_path, EMBED, [])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        run_instance(ctl, "embed@a.service", 1)
        await settle()
        assert ctl.scheduler.annotated() == {"a.service"}
        ctl.on_unit_changed("embed@a.service", DOWN)
        await settle()
        assert ("start", "embed@a.service") not in bed.systemd.calls
        assert ctl.scheduler.annotated() == {"a.service"}  # and forgotten again

    run(test)


def test_an_instance_finished_before_a_restart_seen_again_by_a_signal_is_not_started(
    tmp_path: Path,
) -> None:
    """The last controller saved embed@a finished; systemd unloaded it since, so the next
    start does not know it. A later signal of it (`systemctl status`) made it new: started
    by refill."""
    bed = Bed(tmp_path, EMBED, [], SavedState(finished=["embed@a.service"], seq=1))

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_unit_changed("embed@a.service", DOWN)
        await settle()
        assert ("start", "embed@a.service") not in bed.systemd.calls

    run(test)


@pytest.mark.parametrize("shown", ["failed", "inactive"])
def test_an_instance_systemd_lists_down_at_start_up_is_not_started(
    tmp_path: Path, shown: str
) -> None:
    """No record of how embed@a ended (forgotten by the last controller, or saved in the
    boot before): listed down at start-up, it is forgotten, not started by refill."""
    sub = "failed" if shown == "failed" else "dead"
    bed = Bed(tmp_path, EMBED, [state("embed@a.service", shown, sub)])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert ("start", "embed@a.service") not in bed.systemd.calls
        assert ctl.scheduler.annotated() == {"a.service"}

    run(test)


def test_a_preempted_background_instance_is_brought_back_and_then_forgotten(
    tmp_path: Path,
) -> None:
    bed = Bed(tmp_path, {**EMBED, "u.service": "Priority=10\n"}, [])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_job_new(1, "/org/freedesktop/systemd1/job/1", "embed@1.service")
        await settle()
        ctl.on_unit_changed("embed@1.service", at_gate())
        ctl.on_unit_changed("embed@1.service", {"ActiveState": "active", "SubState": "running"})
        ctl.on_unit_changed("u.service", at_gate(bytes(16)))
        await settle()
        assert bed.systemd.calls[-1] == ("stop", "embed@1.service")
        ctl.on_job_new(50, "/org/freedesktop/systemd1/job/50", "embed@1.service")  # our stop
        ctl.on_unit_changed("embed@1.service", {"ActiveState": "deactivating", "SubState": "stop"})
        ctl.on_unit_changed("embed@1.service", DOWN)
        ctl.on_job_removed(50, "/org/freedesktop/systemd1/job/50", "embed@1.service", "done")
        await settle()
        assert "embed@1.service" in ctl.scheduler.preempted
        ctl.on_unit_changed("embed@1.service", DOWN)  # a late signal: still kept
        ctl.on_unit_changed("u.service", {"ActiveState": "active", "SubState": "running"})
        goes_down(bed, "u.service")
        await settle()
        assert bed.systemd.calls[-1] == ("start", "embed@1.service")
        ctl.on_unit_changed("embed@1.service", at_gate(bytes(range(16))))
        ctl.on_unit_changed("embed@1.service", {"ActiveState": "active", "SubState": "running"})
        ctl.on_unit_changed("embed@1.service", DOWN)
        await settle()
        assert ctl.scheduler.annotated() == {"a.service", "u.service"}

    run(test)


def test_many_held_instances_are_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held instances are kept (an admin's stop), each saved: past the bound the journal
    says how many, once."""
    monkeypatch.setattr(instances_module, "KEPT_INSTANCES_WARN", 3)
    bed = Bed(tmp_path, EMBED, [])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            for i in range(6):
                name = f"embed@{i}.service"
                ctl.on_job_new(i + 1, f"/org/freedesktop/systemd1/job/{i + 1}", name)
                ctl.on_unit_changed(name, at_gate())
                ctl.on_job_new(i + 100, f"/org/freedesktop/systemd1/job/{i + 100}", name)
                ctl.on_unit_changed(name, {"ActiveState": "deactivating", "SubState": "stop"})
                ctl.on_unit_changed(name, DOWN)
                await settle()
        assert len(ctl.scheduler.held) == 6
        said = [r.getMessage() for r in caplog.records if "kept held or preempted" in r.message]
        assert said == [said[0]] and said[0].startswith("4 instances are kept held")

    run(test)


def test_a_background_instances_comeback_the_shutdown_cancelled_is_still_owed() -> None:
    """Refill brings back a plain background unit anyway, never an instance: ended with no
    record, it was forgotten at its down and, learnt again after the boot, dormant. Its work,
    preempted by gpuslice, was lost without a word."""
    s = Scheduler([Gpu(0)], {})
    embed, urgent = spec("embed@a", 90, BG), spec("urgent", 10)
    s.request(embed)
    assert brief(s.request(urgent)) == ["stop embed@a.service"]
    s.inactive(embed.name, Outcome.STOPPED)
    assert brief(s.inactive(urgent.name, Outcome.EXITED)) == ["start embed@a.service"]
    s.set_shutting_down(True)
    assert brief(s.inactive(embed.name, Outcome.SHUTDOWN)) == []
    assert embed.name in s.preempted
    assert not s.forget_instance(embed.name)
    assert brief(s.set_shutting_down(False)) == ["start embed@a.service"]  # cancelled


def test_a_background_instances_comeback_under_way_in_the_last_boot_is_owed() -> None:
    """No controller saw the host go down: a background instance whose comeback gpuslice had
    started (a place kept, or waiting at its gate) is preempted, as an on-demand unit's."""
    s = Scheduler([Gpu(0)], {})
    s.set_specs({f"embed@{i}.service": spec(f"embed@{i}", 90, BG) for i in "ab"})
    holders: dict[str, tuple[tuple[int, ...], str, int, str]] = {
        "embed@a.service": ((0,), "starting", 5, "")
    }
    saved = SavedState(
        holders=holders, seq=7, started=["embed@a.service"], requeued=["embed@b.service"]
    )
    ended = s.ended_with_boot(saved)
    assert ended.preempted == {"embed@a.service": 5, "embed@b.service": 7}
    s.load(ended)
    assert brief(s.schedule()) == ["start embed@a.service"]


def test_a_background_instances_comeback_that_did_not_reach_systemd_is_still_owed() -> None:
    """Its StartUnit failed on the bus (`start_failed`): idle again, a plain background unit
    is refilled anyway, never an instance once a controller restart learnt it again
    (dormant), nor one forgotten at a signal of it down meanwhile."""
    s = Scheduler([Gpu(0)], {})
    embed, urgent = spec("embed@a", 90, BG), spec("urgent", 10)
    s.request(embed)
    assert brief(s.request(urgent)) == ["stop embed@a.service"]
    s.inactive(embed.name, Outcome.STOPPED)
    assert brief(s.inactive(urgent.name, Outcome.EXITED)) == ["start embed@a.service"]
    s.start_failed(embed.name, "the bus went away")
    assert not s.forget_instance(embed.name)
    fresh = Scheduler([Gpu(0)], {})
    fresh.set_specs({embed.name: embed})  # listed, or remembered from the state file
    fresh.load(s.save())
    assert brief(fresh.schedule()) == ["start embed@a.service"]


# -- preempted instances past the bound -------------------------------------------------------


def test_preempted_instances_past_the_bound_those_last_to_come_back_are_dropped() -> None:
    """Any local user may start instances (an `Accept=yes` socket: one per connection), each
    preempted in turn: kept without bound, they grew the core and the state file. Past the
    bound, those that would come back last (least urgent, then preempted last) are no longer
    brought back, each said once as a warning; a plain unit is neither counted nor dropped."""
    s = Scheduler([Gpu(0)], {})
    specs = {
        "embed@old.service": spec("embed@old", 90, BG),
        "embed@new.service": spec("embed@new", 90, BG),
        "embed@urgent.service": spec("embed@urgent", 20, BG),
        "tx@a.service": spec("tx@a", 50),
        "plain.service": spec("plain", 95, BG),
    }
    s.set_specs(specs)
    seqs = {"embed@old": 1, "embed@urgent": 2, "plain": 3, "tx@a": 4, "embed@new": 5}
    s.load(SavedState(preempted={f"{n}.service": q for n, q in seqs.items()}, seq=5))
    assert s.drop_preempted_instances(4) == []  # 4 instances: not past it
    dropped = [a for a in s.drop_preempted_instances(2) if isinstance(a, Log) and a.decision]
    said = [(a.decision.unit, a.decision.code.value, a.level) for a in dropped if a.decision]
    assert said == [
        ("embed@new.service", "preemption-dropped", "warning"),
        ("embed@old.service", "preemption-dropped", "warning"),
    ]
    assert "more than 2 preempted instances are kept" in dropped[0].message
    assert set(s.preempted) == {"embed@urgent.service", "plain.service", "tx@a.service"}
    assert s.drop_preempted_instances(2) == []  # said once
    assert s.forget_instance("embed@new.service")  # owed nothing now: forgotten
    assert "embed@new.service" not in s.save().preempted
    assert "embed@old.service" in s.dormant  # not forgotten yet: never refilled
    assert "start embed@old.service" not in brief(s.schedule())


def test_preempted_instances_past_the_bound_are_dropped_by_the_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state file names more preempted instances than the bound (or they pile up while a
    more urgent unit runs): the last to come back are dropped, forgotten by the core and the
    tracker, gone from the state file, and named in their journal and the controller's."""
    from gpuslice.journal import Journal
    from gpuslice.state import StateStore
    from tests.test_controller_calls import FakeJournal

    monkeypatch.setattr(instances_module, "PREEMPTED_INSTANCES_MAX", 2)
    preempted = {f"embed@{i}.service": i + 1 for i in range(3)}
    saved = SavedState(holders={"a.service": ((0,), "running", 4, "")}, preempted=preempted, seq=4)
    bed = Bed(tmp_path, EMBED, [state("a.service", "active", "running")], saved)
    journal = FakeJournal()
    bed.controller.journal = cast(Journal, journal)

    def on_file() -> set[str]:
        return set(StateStore(Path(bed.config.state_dir)).load()[0].preempted)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        [said] = journal.of("embed@2.service", "preemption-dropped")
        assert said["PRIORITY"] == "4"  # warning
        assert said["OBJECT_SYSTEMD_UNIT"] == "embed@2.service"  # its own journal
        assert set(ctl.scheduler.preempted) == {"embed@0.service", "embed@1.service"}
        assert "embed@2.service" not in ctl.scheduler.annotated()
        assert "embed@2.service" not in ctl.tracker.states
        assert on_file() == {"embed@0.service", "embed@1.service"}
        monkeypatch.setattr(instances_module, "PREEMPTED_INSTANCES_MAX", 1)
        ctl.on_unit_changed("embed@0.service", DOWN)  # an instance kept goes down (again)
        await settle()
        assert len(journal.of("embed@1.service", "preemption-dropped")) == 1
        assert len(journal.of("embed@2.service", "preemption-dropped")) == 1  # once
        assert on_file() == {"embed@0.service"}
        goes_down(bed, "a.service")
        await settle()
        assert [c for c in bed.systemd.calls if c[0] == "start"] == [("start", "embed@0.service")]

    run(test)


def test_a_background_instance_the_shutdown_stopped_is_refilled_when_it_is_cancelled() -> None:
    """Owed nothing (no preemption), it was forgotten at its down: a cancelled shutdown left
    it down for good, where refill starts a plain background unit again. Kept until it is
    down again, then forgotten as any instance."""
    s = Scheduler([Gpu(0)], {})
    embed = spec("embed@a", 90, BG)
    assert brief(s.request(embed)) == ["grant embed@a.service 0"]
    s.set_shutting_down(True)
    assert brief(s.inactive(embed.name, Outcome.SHUTDOWN)) == []
    assert not s.forget_instance(embed.name)
    assert brief(s.set_shutting_down(False)) == ["start embed@a.service"]
    assert brief(s.request(embed)) == ["grant embed@a.service 0"]
    s.inactive(embed.name, Outcome.EXITED)
    assert s.forget_instance(embed.name)


def test_an_instance_whose_instance_starts_with_a_dot_is_refilled_and_comes_back() -> None:
    """`x@.y.service` is an instance (valid for systemd), not the template `x@.service`:
    taken for one (`"@." in name`), the cancelled shutdown's refill never started it."""
    s = Scheduler([Gpu(0)], {})
    dotted, urgent = spec("x@.y.service", 90, BG), spec("urgent", 10)
    assert brief(s.request(dotted)) == ["grant x@.y.service 0"]
    s.set_shutting_down(True)
    assert brief(s.inactive(dotted.name, Outcome.SHUTDOWN)) == []
    assert brief(s.set_shutting_down(False)) == ["start x@.y.service"]
    assert brief(s.request(dotted)) == ["grant x@.y.service 0"]
    assert brief(s.request(urgent)) == ["stop x@.y.service"]
    s.inactive(dotted.name, Outcome.STOPPED)
    assert brief(s.inactive(urgent.name, Outcome.EXITED)) == ["start x@.y.service"]
    assert brief(s.request(dotted)) == ["grant x@.y.service 0"]
    s.inactive(dotted.name, Outcome.EXITED)
    assert s.forget_instance(dotted.name)
    s.learn(dotted)  # learnt again: dormant, as any instance
    assert brief(s.schedule()) == []


def test_a_background_instance_whose_hold_was_the_shutdowns_is_kept() -> None:
    """The bus lost the shutdown's JobNew: its stop of embed@a.service booked a hold, which
    SystemState's `stopping` undid (`holds_of_shutdown`). Owed nothing, it was then forgotten
    at the next word of it (a late signal, a read), and the cancelled shutdown left it down
    for good: kept, as when the shutdown is heard, until it is down again."""
    s = Scheduler([Gpu(0)], {})
    embed = spec("embed@a", 90, BG)
    assert brief(s.request(embed)) == ["grant embed@a.service 0"]
    s.inactive(embed.name, Outcome.STOPPED)
    s.set_shutting_down(True)
    assert s.holds_of_shutdown([embed.name]) == [embed.name]
    assert not s.forget_instance(embed.name)
    assert brief(s.set_shutting_down(False)) == ["start embed@a.service"]


def test_a_background_instance_that_ended_by_itself_in_a_shutdown_is_forgotten() -> None:
    """Its work may be done: not started again after a cancelled shutdown. Nor is an
    on-demand instance, which nothing but its caller starts: forgotten as before."""
    s = Scheduler([Gpu(0), Gpu(1)], {})
    embed, tx = spec("embed@a", 90, BG), spec("tx@a", 50)
    s.request(embed)
    s.request(tx)
    s.set_shutting_down(True)
    s.inactive(embed.name, Outcome.SHUTDOWN, by_itself=True)
    s.inactive(tx.name, Outcome.SHUTDOWN)
    assert s.forget_instance(embed.name)
    assert s.forget_instance(tx.name)
    assert brief(s.set_shutting_down(False)) == []


def test_a_background_instance_the_shutdown_stopped_is_refilled_after_a_restart(
    tmp_path: Path,
) -> None:
    """The shutdown stopped embed@a and gpuslice.service too; someone cancelled it and
    started gpuslice again. Not saved, the instance (unloaded by systemd) was unknown to the
    next controller, or learnt dormant: never started again, where a plain background unit
    is refilled."""
    bed = Bed(tmp_path, EMBED, [])
    embed = "embed@a.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await run_then_stopped_by_a_reboot(ctl, embed)

    run(test)
    again = Bed(tmp_path / "again", EMBED, [], bed.controller.scheduler.save())

    async def restarted() -> None:
        await again.controller.start()
        await settle()
        assert ("start", embed) in again.systemd.calls

    run(restarted)


def test_a_background_instance_the_shutdown_stopped_is_dormant_after_the_reboot() -> None:
    """The host went down: learnt again, it is dormant as any instance (`ended_with_boot`)."""
    s = Scheduler([Gpu(0)], {})
    embed = spec("embed@a", 90, BG)
    s.request(embed)
    s.set_shutting_down(True)
    s.inactive(embed.name, Outcome.SHUTDOWN)
    saved = s.save()
    fresh = Scheduler([Gpu(0)], {})
    fresh.set_specs({embed.name: embed})
    fresh.load(fresh.ended_with_boot(saved))
    assert brief(fresh.schedule()) == []
    assert fresh.forget_instance(embed.name)


def refilled_after_a_cancel(requeue: bool) -> tuple[Scheduler, str]:
    """embed@a.service (background, `Requeue=` as told) ran, the host's shutdown stopped it,
    and the shutdown's cancel refilled it: its start is sent, not yet at its gate."""
    s = Scheduler([Gpu(0)], {})
    embed = spec("embed@a", 90, BG, requeue=requeue)
    s.request(embed)
    s.set_shutting_down(True)
    s.inactive(embed.name, Outcome.SHUTDOWN)
    assert brief(s.set_shutting_down(False)) == [f"start {embed.name}"]
    return s, embed.name


@pytest.mark.parametrize("restarted", [False, True])
@pytest.mark.parametrize("requeue", [True, False])
def test_a_cancels_refill_that_did_not_reach_systemd_is_refills_again(
    requeue: bool, restarted: bool
) -> None:
    """Its StartUnit did not reach systemd (start_failed): a refill, not a comeback, so
    refill sends it again once the delay is over, as a plain background unit's. Kept
    preempted, with `Requeue=no` it never started again and was saved until the reboot;
    with `Requeue=yes` it came back preempting, which no refill does. The same where the
    controller restarted meanwhile and sent the lost start again (`start_lost`)."""
    s, embed = refilled_after_a_cancel(requeue)
    if restarted:
        saved = s.save()
        s = Scheduler([Gpu(0)], {})
        s.set_specs({embed: spec("embed@a", 90, BG, requeue=requeue)})
        s.load(saved)
        assert brief(s.start_lost(embed)) == [f"start {embed}"]
    s.start_failed(embed, "systemd is re-executing")
    assert s.preempted == {}
    assert s.stopped_by_shutdown == {embed}  # kept: its call's failed answer forgets nothing
    assert not s.forget_instance(embed)
    assert brief(s.retry_start(embed)) == [f"start {embed}"]


@pytest.mark.parametrize("requeue", [True, False])
@pytest.mark.parametrize("outcome", [Outcome.SHUTDOWN, Outcome.FAILED])
def test_a_cancels_refill_cut_short_by_another_shutdown_is_kept_for_refill(
    requeue: bool, outcome: Outcome
) -> None:
    """A second shutdown stops it before it ran (its gate killed: failed, 143): kept for the
    next cancel's refill as after the first, not preempted (a comeback `Requeue=no` never
    made), and dormant after the reboot as any instance the shutdown stopped, whose refill
    was under way when the controller went down."""
    s, embed = refilled_after_a_cancel(requeue)
    saved = s.save()
    s.set_shutting_down(True)
    s.inactive(embed, outcome)
    assert s.preempted == {} and s.failed == set()
    assert s.stopped_by_shutdown == {embed}
    assert brief(s.set_shutting_down(False)) == [f"start {embed}"]
    fresh = Scheduler([Gpu(0)], {})
    fresh.set_specs({embed: spec("embed@a", 90, BG, requeue=requeue)})
    assert fresh.ended_with_boot(saved).preempted == {}


def test_a_cancels_refill_frozen_once_it_ran_is_owed_its_comeback() -> None:
    """Its refill ran (the name is kept until its next down), then it was frozen for a more
    urgent unit: the shutdown that ends it cut preempted work, owed after the reboot as any
    frozen unit's; only a refill's start that did not happen is refill's again."""
    s = Scheduler([sized(0)], {})
    embed = spec("embed@a", 90, BG, mem_gib=8, preempt="freeze stop")
    s.request(embed)
    s.set_shutting_down(True)
    s.inactive(embed.name, Outcome.SHUTDOWN)
    assert brief(s.set_shutting_down(False)) == [f"start {embed.name}"]
    assert brief(s.request(embed)) == [f"grant {embed.name} 0"]
    voice = spec("voice", 10, mem_gib=8)
    assert brief(s.request(voice))[-1] == f"freeze {embed.name}"
    s.set_shutting_down(True)
    s.inactive(embed.name, Outcome.FAILED)  # 143 on the shutdown's SIGTERM
    assert embed.name in s.preempted and s.stopped_by_shutdown == set()


def test_a_background_instance_the_shutdown_stopped_is_forgotten_with_its_annotation() -> None:
    """Its template's annotation went: nothing keeps it, nor saves it for ever."""
    s = Scheduler([Gpu(0)], {})
    embed = spec("embed@a", 90, BG)
    s.request(embed)
    s.set_shutting_down(True)
    s.inactive(embed.name, Outcome.SHUTDOWN)
    s.set_specs({})
    assert s.stopped_by_shutdown == set()


def test_a_background_instance_the_shutdown_stopped_is_forgotten_once_on_demand() -> None:
    """Its template turned on-demand (a daemon-reload with another `Type=`): its refill was
    owed only as a background unit's, so nothing keeps it, nor saves it until the reboot."""
    s = Scheduler([Gpu(0)], {})
    embed = spec("embed@a", 90, BG)
    s.request(embed)
    s.set_shutting_down(True)
    s.inactive(embed.name, Outcome.SHUTDOWN)
    assert s.stopped_by_shutdown == {embed.name}
    on_demand = spec("embed@a", 90)
    s.set_specs({embed.name: on_demand})
    assert s.stopped_by_shutdown == set()
    assert s.save().stopped_by_shutdown == []
    assert s.forget_instance(embed.name)
    again = Scheduler([Gpu(0)], {})
    again.set_specs({embed.name: on_demand})
    again.load(s.save())
    assert again.stopped_by_shutdown == set()
    s.set_shutting_down(False)
    assert brief(s.schedule()) == []


def test_a_shutdown_stopped_instance_turned_on_demand_is_forgotten_at_the_rescan(
    tmp_path: Path,
) -> None:
    """The daemon-reload that turned its template on-demand forgets it, down and owed
    nothing, as its down would have: kept, it was saved until the next reboot."""
    bed = Bed(tmp_path, EMBED, [])
    embed = "embed@a.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await run_then_stopped_by_a_reboot(ctl, embed)
        write_unit(tmp_path, "embed@.service", "Priority=90\n")  # Type= gone: on-demand
        ctl.rescans.request()
        await until(lambda: ctl.rescans.task is None)
        await settle()
        assert embed not in ctl.scheduler.annotated()
        assert ctl.scheduler.stopped_by_shutdown == set()
        files = [f for f in (tmp_path / "state").rglob("*") if f.is_file()]
        assert files
        assert all(embed not in f.read_text() for f in files)

    run(test)


@pytest.mark.parametrize("by_itself", [False, True])
def test_a_background_instance_failing_on_the_reboots_sigterm_is_refilled_at_its_cancel(
    tmp_path: Path, by_itself: bool
) -> None:
    """The reboot's stop (job 3) takes embed@a down and its main process exits 143 on the
    SIGTERM: systemd shows it failed. Recorded failed, it was forgotten, and the cancelled
    reboot left it down for good, where one that exited 0 is refilled. One that failed by
    itself (no job as it left running) failed: forgotten, not started again."""
    bed = Bed(tmp_path, EMBED, [])
    embed = "embed@a.service"
    failed = {"ActiveState": "failed", "SubState": "failed", "Job": (0, "/")}

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        runs_as_a_reboot_begins(ctl, embed)
        if by_itself:
            ctl.on_unit_changed(embed, failed)
        else:
            the_reboot_stops(ctl, embed)
            ctl.on_unit_changed(embed, failed)
            ctl.on_job_removed(*REBOOTS_STOP, embed, "done")
        await settle()
        assert ctl.scheduler.failed == set()  # one that failed is forgotten, as any instance
        assert (embed in ctl.scheduler.stopped_by_shutdown) is not by_itself
        ctl.on_job_removed(2, "/org/freedesktop/systemd1/job/2", "reboot.target", "canceled")
        await settle()
        started = [c for c in bed.systemd.calls if c[0] == "start"]
        assert started == ([] if by_itself else [("start", embed)])

    run(test)


def test_a_background_instance_failed_on_the_reboots_sigterm_told_after_its_cancel_is_refilled(
    tmp_path: Path,
) -> None:
    """The reboot's stop (job 3) takes embed@a down, 143 on the SIGTERM, and the reboot is
    cancelled while systemd still shows that job: its down is told after the cancel. The
    shutdown's all the same (Tracker._down_in_shutdown), as one that exited 0 is: taken for a
    failed job, it was forgotten, never refilled (a preempted unit's work was lost so)."""
    bed = Bed(tmp_path, EMBED, [])
    embed = "embed@a.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        runs_as_a_reboot_begins(ctl, embed)
        the_reboot_stops(ctl, embed)
        ctl.on_unit_changed(
            embed, {"ActiveState": "failed", "SubState": "failed", "Job": REBOOTS_STOP}
        )
        await settle()
        ctl.on_job_removed(2, "/org/freedesktop/systemd1/job/2", "reboot.target", "canceled")
        await settle()
        ctl.on_job_removed(*REBOOTS_STOP, embed, "done")
        ctl.on_unit_changed(embed, {"ActiveState": "failed", "SubState": "failed", "Job": (0, "/")})
        await settle()
        assert ctl.scheduler.failed == set()
        started = [c for c in bed.systemd.calls if c[0] == "start"]
        assert started == [("start", embed)]

    run(test)
