"""The gate's pipes and the env files against what piles up or is put in their place."""

from __future__ import annotations

import functools
import logging
import os
import stat
import threading
from pathlib import Path

import pytest

from gpuslice import envfiles
from gpuslice import restore as restore_module
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Phase, SavedState
from gpuslice.paths import env_file
from gpuslice.tracker import UnitState
from tests.test_controller import START, Bed, at_gate, read_pipe, run, settle, state, until
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse

DOWN = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
RUNNING = {"ActiveState": "active", "SubState": "running", "Job": (0, "/")}


def test_instances_that_ended_leave_no_env_file_behind(tmp_path: Path) -> None:
    """A job per instance (`tx@JOB.service`, or a socket with Accept=yes that any local user
    may connect to): each granted one wrote RUNTIME_DIR/env/INSTANCE/gpuslice.env, kept
    until reboot (RuntimeDirectoryPreserve=yes), a directory and a page of /run each, until
    /run was full: then no env file could be written and every gated start waited."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n", "tx@.service": "Priority=50\n"}, [])
    runtime_dir = bed.config.runtime_dir

    def heard(unit: str) -> bool:
        return unit in (bed.systemd.watched or ())

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await until(lambda: bed.systemd.watched == {"a.service"})
        for i in range(20):
            unit = f"tx@{i}.service"
            ctl.on_job_new(i + 1, f"/org/freedesktop/systemd1/job/{i + 1}", unit)
            await until(functools.partial(heard, unit))
            ctl.on_unit_changed(unit, at_gate())
            await settle()
            assert read_pipe(bed, unit) == START.hex() + "\n"
            assert env_file(runtime_dir, unit).is_file()
            ctl.on_unit_changed(unit, RUNNING)
            ctl.on_unit_changed(unit, DOWN)
            await settle()
        assert list((Path(runtime_dir) / "env").iterdir()) == []

    run(test)


def test_removing_an_env_file_leaves_what_else_is_there_and_follows_no_link(
    tmp_path: Path,
) -> None:
    runtime_dir = str(tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "gpuslice.env").write_text("kept\n")
    envfiles.write(runtime_dir, "a@1.service", [Gpu(0)])
    envfiles.remove(runtime_dir, "a@1.service")
    assert list((Path(runtime_dir) / "env").iterdir()) == []
    envfiles.remove(runtime_dir, "a@1.service")  # twice, or none: nothing to say
    # a link in the unit directory's place: removed as a link, its target untouched
    (Path(runtime_dir) / "env" / "b@1.service").symlink_to(elsewhere)
    envfiles.remove(runtime_dir, "b@1.service")
    assert (elsewhere / "gpuslice.env").read_text() == "kept\n"
    # a directory holding something not ours is left, with it
    envfiles.write(runtime_dir, "c@1.service", [Gpu(0)])
    (Path(runtime_dir) / "env" / "c@1.service" / "other").write_text("x")
    envfiles.remove(runtime_dir, "c@1.service")
    assert not env_file(runtime_dir, "c@1.service").exists()
    assert (Path(runtime_dir) / "env" / "c@1.service" / "other").exists()


def test_removing_an_env_file_never_waits_on_a_fifo_in_the_directorys_place(
    tmp_path: Path,
) -> None:
    """Opened as anything but a directory, a FIFO where the unit's directory should be would
    hold the controller's loop until a writer came: every gated start would wait."""
    unit = "job@7.service"
    fifo = env_file(str(tmp_path), unit).parent
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    done = threading.Event()

    def remove() -> None:
        envfiles.remove(str(tmp_path), unit)
        done.set()

    worker = threading.Thread(target=remove, daemon=True)
    worker.start()
    finished = done.wait(30)  # a pass never waits this long (5 s: short under load)
    if not finished:  # let the thread go: open a writer, which ends its wait
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert finished, "remove() waited on the FIFO"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # not ours to remove


# ---- the env files of units that ended while no controller ran: swept at start-up ----


def _granted_before(bed: Bed, *units: str) -> None:
    """Each unit's env file, as the last controller wrote it when it granted GPU 0."""
    for unit in units:
        envfiles.write(bed.config.runtime_dir, unit, [Gpu(0)])


def _left(bed: Bed) -> set[str]:
    env = Path(bed.config.runtime_dir) / "env"
    return {p.name for p in env.iterdir()} if env.exists() else set()


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the controller's journal says of the env files it removed: a count, in one line,
    never a file's path."""
    said = [r.getMessage() for r in caplog.records if r.name == "gpuslice"]
    assert [m for m in said if "/env/" in m] == []
    return [m for m in said if "removed env files" in m]


def test_a_restart_removes_the_env_files_of_units_that_ended_while_it_was_away(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """tx@1 and tx@2 (instances of a job queue's template) and gone.service ran, granted, when
    the controller stopped (a crash, a restart, an upgrade), and ended meanwhile: tx@1 is
    unloaded (systemd lists it no more), tx@2 failed, gone.service finished. The start-up
    forgot them without removing their env files: a queue, or an Accept=yes socket any local
    user may connect to, still filled /run across restarts, until no env file could be
    written and every gated start waited. pre.service, preempted and down, is owed a restart
    that waits for GPU 0: its file goes too (nothing reads it: that restart's gate passes
    only once its grant wrote the file anew). One journal line says how many went, none
    names a file."""
    bed = Bed(
        tmp_path,
        {
            "tx@.service": "Priority=50\n",
            "gone.service": "Priority=50\nType=background\n",
            "pre.service": "Priority=90\n",
            "run.service": "Priority=10\n",
        },
        [
            state("tx@2.service", "failed", "failed"),
            state("gone.service", "inactive", "dead"),
            state("pre.service", "inactive", "dead"),
            state("run.service", "active", "running"),
        ],
        SavedState(
            holders={
                "tx@1.service": ((0,), "running", 1, ""),
                "tx@2.service": ((0,), "running", 2, ""),
                "gone.service": ((0,), "running", 3, ""),
                "run.service": ((0,), "running", 4, ""),
            },
            preempted={"pre.service": 5},
            seq=5,
        ),
    )
    _granted_before(bed, "tx@1.service", "tx@2.service", "gone.service", "pre.service")
    _granted_before(bed, "run.service")

    async def test() -> None:
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.controller.start()
            await settle()
        assert "pre.service" in bed.controller.scheduler.preempted
        assert _left(bed) == {"run.service"}
        assert envfiles.told_gpus(bed.config.runtime_dir, "run.service") == [0]

    run(test)
    assert _said(caplog) == ["removed env files of units no longer running: 4"]


# units at hand in every case: the unit the case keeps the file of, and a stale one
_KEPT_UNITS = {
    "a.service": "Priority=50\n",
    "bg.service": "Priority=90\nType=background\nPreempt=suspend stop\n",
    "tx@.service": "Priority=50\n",
    "hi.service": "Priority=10\n",
}
UP = ("active", "running")


@pytest.mark.parametrize(
    ("case", "unit", "states", "saved"),
    [
        (
            "running, its grant saved",
            "a.service",
            [state("a.service", "active", "running")],
            SavedState(holders={"a.service": ((0,), "running", 1, "")}, seq=1),
        ),
        (  # the state file lost: its grant is read back from its file (Restore._told_gpus)
            "running, its grant read back from its env file",
            "a.service",
            [state("a.service", "active", "running")],
            None,
        ),
        (  # its annotation went while it ran, and the state file too: nobody but systemd knows
            "running, unknown to the core",
            "other.service",
            [state("other.service", "active", "running")],
            None,
        ),
        (
            "an instance running",
            "tx@7.service",
            [state("tx@7.service", "active", "running")],
            None,
        ),
        (  # its gate waits behind hi.service: the file is an earlier run's, a grant replaces it
            "waiting at its gate",
            "a.service",
            [state("a.service", "activating", "start-pre", 3, "start"), state("hi.service", *UP)],
            SavedState(holders={"hi.service": ((0,), "running", 1, "")}, seq=1),
        ),
        (  # behind hi.service, which holds the one GPU: it waits, granted nothing
            "its start job queued",
            "a.service",
            [state("a.service", "inactive", "dead", 9, "start"), state("hi.service", *UP)],
            SavedState(holders={"hi.service": ((0,), "running", 1, "")}, seq=1),
        ),
        (  # Restart=: its RestartSec= runs, no job yet; its next run is systemd's own
            "waiting to restart",
            "tx@7.service",
            [state("tx@7.service", "activating", "auto-restart")],
            SavedState(holders={"tx@7.service": ((0,), "running", 1, "")}, seq=1),
        ),
        (  # the state file lost: ExecStop=/ExecStopPost= still run, with its environment
            "stopping",
            "a.service",
            [state("a.service", "deactivating", "stop-sigterm", 5, "stop")],
            None,
        ),
        (  # frozen, its memory on the host: its resume reads and rewrites the file
            "suspended",
            "bg.service",
            [state("bg.service", "active", "running")],
            SavedState(suspended={"bg.service": ((0,), 1)}, seq=1),
        ),
        (  # restarted by refill at start-up: GPU 0 kept for it, its gate granted soon
            "preempted, restarted at start-up",
            "a.service",
            [state("a.service", "inactive", "dead")],
            SavedState(preempted={"a.service": 1}, seq=1),
        ),
    ],
)
def test_a_restart_keeps_the_env_file_of_every_unit_that_may_read_it(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    case: str,
    unit: str,
    states: list[UnitState],
    saved: SavedState | None,
) -> None:
    """The sweep at start-up removes only what nothing can read: a file removed under a
    running unit is missing when systemd's Restart= starts it again, or when its
    ExecStop= runs; a suspended unit's file says the GPU, by UUID, it wakes on. Beside each,
    tx@1.service's stale file goes (unloaded: it ended while the controller was away)."""
    bed = Bed(tmp_path, _KEPT_UNITS, states, saved)
    _granted_before(bed, unit, "tx@1.service")

    async def test() -> None:
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.controller.start()
        if case == "running, its grant read back from its env file":
            assert bed.controller.scheduler.grants() == {unit: frozenset({0})}
        if case in ("waiting at its gate", "its start job queued"):
            assert bed.controller.scheduler.is_waiting(unit)
        if case == "preempted, restarted at start-up":
            assert bed.controller.scheduler.phase(unit) is Phase.STARTING
        assert _left(bed) == {unit}, case
        assert envfiles.told_gpus(bed.config.runtime_dir, unit) == [0], case

    run(test)
    assert _said(caplog) == ["removed env files of units no longer running: 1"]


def test_a_restart_removes_nothing_through_a_link_nor_waits_on_a_fifo(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a directory named as a unit is swept, through envfiles.remove: a link in a unit's
    place is left (its target untouched), a FIFO is never opened (the start-up would wait for
    a writer, and every gated start with it), a file or a name no unit has is left, and a
    directory holding something not ours loses our file only."""
    bed = Bed(tmp_path, {"tx@.service": "Priority=50\n"}, [])
    _granted_before(bed, "tx@1.service", "tx@2.service")
    env = Path(bed.config.runtime_dir) / "env"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "gpuslice.env").write_text("kept\n")
    (env / "tx@3.service").symlink_to(elsewhere)
    os.mkfifo(env / "tx@4.service")
    (env / "tx@5.service").write_text("x")
    (env / "not a unit").mkdir()
    (env / "tx@2.service" / "other").write_text("x")

    async def test() -> None:
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.controller.start()

    run(test)
    assert _left(bed) == {"tx@2.service", "tx@3.service", "tx@4.service", "tx@5.service"} | {
        "not a unit"
    }
    assert os.listdir(env / "tx@2.service") == ["other"]
    assert (elsewhere / "gpuslice.env").read_text() == "kept\n"
    assert stat.S_ISFIFO(os.lstat(env / "tx@4.service").st_mode)
    assert _said(caplog) == ["removed env files of units no longer running: 1"]


def test_a_restart_looks_at_a_bounded_number_of_entries_the_rest_at_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A /run filled before instances lost their file when they went down (an upgrade from
    such a version) costs a start ENV_SWEEP_MAX entries, not all of them: the journal says
    more are left, and each start removes its share."""
    monkeypatch.setattr(restore_module, "ENV_SWEEP_MAX", 2)
    units = {"tx@.service": "Priority=50\n"}
    bed = Bed(tmp_path, units, [])
    _granted_before(bed, *(f"tx@{i}.service" for i in range(5)))

    async def test() -> None:
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.controller.start()
        assert len(_left(bed)) == 3
        again = Bed(tmp_path, units, [])
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await again.controller.start()
        assert len(_left(bed)) == 1

    run(test)
    more = (
        f"removed env files of units no longer running: 2; {tmp_path}/run/env holds more "
        "than 2 entries, the rest are looked at when gpuslice starts again"
    )
    assert _said(caplog) == [more, more]
