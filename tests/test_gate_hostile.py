"""The gate's pipes and the env files against what piles up or is put in their place."""

from __future__ import annotations

import functools
import os
import stat
import threading
from pathlib import Path

from gpuslice import envfiles
from gpuslice.core.model import Gpu
from gpuslice.paths import env_file
from tests.test_controller import START, Bed, at_gate, read_pipe, run, settle, until

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
    finished = done.wait(5)
    if not finished:  # let the thread go: open a writer, which ends its wait
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert finished, "remove() waited on the FIFO"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # not ours to remove
