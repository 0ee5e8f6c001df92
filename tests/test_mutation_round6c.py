"""The ladder's check of thaws by hand (each unit asked, whatever the one before it showed or
failed with; the failed ActiveState read said at debug level in its words), a unit's
`Before=` names gathered from every line and file, a background instance the shutdown
stopped kept through a rescan that leaves its annotation as it was, a rescan that changes
nothing writing no state, and an instance with a job queued not forgotten when the rescan
that turns its template on-demand owes it nothing more."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice.annotations import Problem, load_spec
from gpuslice.annotations import scan as scan_units
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Outcome, SavedState, Scheduler
from gpuslice.systemd import SystemdError
from gpuslice.tracker import UnitState
from tests.core_builders import BG, brief, spec
from tests.test_annotations import ETC, X, unit, write
from tests.test_background_instances import run_then_stopped_by_a_reboot
from tests.test_controller import Bed, run, settle, until, write_unit
from tests.test_ladder_adapter import Freezer, Host, hosted
from tests.test_ladder_adapter import run as run_ladder

DOWN = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
EMBED = {"a.service": "Priority=50\n", "embed@.service": "Priority=90\nType=background\n"}


@pytest.fixture
def host(fake_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    yield from hosted(fake_build, tmp_path, monkeypatch)


class Unreadable(Freezer):
    """A freezer whose ActiveState read fails for the units named."""

    def __init__(self, *unreadable: str) -> None:
        super().__init__()
        self.unreadable = set(unreadable)

    async def unit_state(self, name: str) -> UnitState:
        if name in self.unreadable:
            self.calls.append(f"active {name}")
            raise SystemdError("org.freedesktop.DBus.Error.NoReply", "no answer")
        return await super().unit_state(name)


def test_a_check_of_thaws_asks_each_unit_past_a_frozen_one_and_a_failed_read(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """a.service still frozen, b.service's ActiveState unreadable: neither ends the check,
    c.service, thawed by hand, is found; the failed read is said at debug level, naming the
    unit and the error."""
    freezer = Unreadable("b.service")
    freezer.states = {"a.service": "frozen", "b.service": "running", "c.service": "running"}
    host.ladder.systemd = host.freezer = freezer
    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        run_ladder(host.ladder.check_thawed(["a.service", "b.service", "c.service"]))
    assert host.said() == [("thawed_outside", "c.service", "")]
    assert freezer.calls == [
        "state a.service",
        "state b.service",
        "active b.service",
        "state c.service",
        "active c.service",
    ]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG] == [
        "ActiveState of b.service: org.freedesktop.DBus.Error.NoReply: no answer"
    ]


def test_before_names_of_every_line_and_file_are_gathered(tmp_path: Path) -> None:
    """`Before=gpuslice.service` in the unit's file, then other `Before=` lines after it (its
    own and a drop-in's): systemd adds each line's names to the others', so the unit is
    still ordered before the controller."""
    text = unit("Priority=1\n").replace(
        "[Unit]\n", "[Unit]\nBefore=gpuslice.service\nBefore=y.service\n"
    )
    write(tmp_path, X, text)
    write(tmp_path, f"{ETC}/x.service.d/order.conf", "[Unit]\nBefore=shutdown.target\n")
    spec_, problems = load_spec("x.service", tmp_path)
    assert spec_ is None
    assert problems == [
        Problem(
            X,
            2,
            "Before",
            "gpuslice.service: this unit is ordered before gpuslice.service, which its gate "
            "would wait for (left unmanaged, ungated)",
            "error",
            "x.service",
            "Unit",
        )
    ]


def test_a_background_instance_the_shutdown_stopped_is_kept_through_a_rescan() -> None:
    """A daemon-reload that leaves its annotation as it was (still a background instance)
    forgets nothing: the cancelled shutdown's refill starts it again."""
    s = Scheduler([Gpu(0)], {})
    embed = spec("embed@a", 90, BG)
    s.request(embed)
    s.set_shutting_down(True)
    s.inactive(embed.name, Outcome.SHUTDOWN)
    s.set_specs({embed.name: embed})
    assert s.stopped_by_shutdown == {embed.name}
    assert s.save().stopped_by_shutdown == [embed.name]
    assert not s.forget_instance(embed.name)
    assert brief(s.set_shutting_down(False)) == [f"start {embed.name}"]


def test_a_rescan_that_changes_nothing_writes_no_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every daemon-reload rescans the annotations: one that changes no decision, no record
    and no instance kept, leaves the state file alone."""
    bed = Bed(tmp_path, EMBED, [])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        saves: list[SavedState] = []
        save = ctl.store.save

        def counted(state: SavedState, boot_id: str) -> Path:
            saves.append(state)
            return save(state, boot_id)

        monkeypatch.setattr(ctl.store, "save", counted)
        ctl._apply_scan(scan_units(str(tmp_path / "root")))
        await settle()
        assert saves == []

    run(test)


def test_an_instance_with_a_job_queued_is_not_forgotten_when_no_longer_kept(
    tmp_path: Path,
) -> None:
    """embed@a, stopped by a shutdown, is turned on-demand by a rescan while a start job of
    someone's is queued for it (down, a job pending): not down with no job, it is not
    forgotten, by the core or the tracker, until that job is done with."""
    bed = Bed(tmp_path, EMBED, [])
    embed = "embed@a.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await run_then_stopped_by_a_reboot(ctl, embed)
        queued = (4, "/org/freedesktop/systemd1/job/4")
        ctl.on_job_new(*queued, embed)
        ctl.on_unit_changed(embed, {"ActiveState": "inactive", "SubState": "dead", "Job": queued})
        await settle()
        heard = ctl.tracker.heard(embed)
        write_unit(tmp_path, "embed@.service", "Priority=90\n")  # Type= gone: on-demand
        ctl.rescans.request()
        await until(lambda: ctl.rescans.task is None)
        await settle()
        assert ctl.scheduler.stopped_by_shutdown == set()
        assert embed in ctl.scheduler.annotated()
        assert ctl.tracker.heard(embed) == heard > 0

    run(test)
