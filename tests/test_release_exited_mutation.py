"""A unit kept active after its job ended (RemainAfterExit=yes) releasing its GPUs
(Controller._release_exited), under mutation: what NVML still shows of it counts against
them, a GPU configured away while it held it is lost no more, a sample is taken only
when it releases GPUs, and a unit it does not release keeps the env file naming its GPUs."""

from __future__ import annotations

import json
from pathlib import Path

from gpuslice import envfiles
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Phase
from tests.test_controller import (
    EXITED,
    GIB,
    _no_notify_socket,  # noqa: F401  (autouse: as in tests/test_controller.py)
    frozen_beside_voice,
    goes_down,
    job_ended,
    run,
    settle,
    started,
    state,
)
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_controller_gates import a_and_b_of_16_gib, a_and_b_on_lingering_vram, running
from tests.test_controller_reload import gpu_1_configured_away, reloaded_with_gpu_1_lost


def test_a_released_units_vram_nvml_still_shows_counts_against_its_gpu(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """a.service (Memory=16G) ends its job and systemd keeps it active: no task is left,
    but NVML still shows its 16 GiB on GPU 0 (the driver frees VRAM a moment later). Its
    release samples anew with a.service no longer counted as holding GPU 0: b.service
    (Memory=16G) waits until NVML shows them freed. Granted on the sample before, its job
    ran out of memory on a GPU with 8 GiB free."""
    bed, nvml = a_and_b_of_16_gib(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await bed.acquire("a.service", ":1.9", 4242)
        nvml.shown = [(300, 16 * GIB)]
        bed.systemd.units["a.service"] = state("a.service", "active", "running")
        ctl.on_unit_changed("a.service", running())
        await bed.acquire("b.service", ":1.10", 4243)
        assert ctl.scheduler.is_waiting("b.service")
        bed.systemd.tasks["a.service"] = 0
        job_ended(bed, "a.service")
        await settle()
        assert ctl.scheduler.remained == {"a.service"}
        assert ctl.scheduler.grants() == {}
        assert ctl.scheduler.is_waiting("b.service")
        nvml.shown = []  # released
        ctl.watch.refresh()
        await settle()
        assert bed.service.granted == [("a.service", "0"), ("b.service", "0")]

    run(test)


def test_a_gpu_configured_away_is_lost_no_more_once_its_holder_is_released(
    tmp_path: Path,
) -> None:
    """Without NVML, `gpus:` made 1 while once.service holds GPU 1: lost while it runs
    there. Its job ends, systemd keeps it active, and no task is left: GPU 1 goes with it,
    as at its down. Not sampled again, it stayed lost in status (and in `gpuslice_gpu_lost`,
    an alert) until the next reload."""
    units = {"keep.service": "Priority=10\n", "once.service": "Priority=20\n"}
    bed = gpu_1_configured_away(tmp_path, units)

    async def test() -> None:
        ctl = await reloaded_with_gpu_1_lost(bed)
        bed.systemd.tasks["once.service"] = 0
        job_ended(bed, "once.service")
        await settle()
        assert ctl.scheduler.remained == {"once.service"}
        assert [(g.index, g.lost) for g in ctl.watch.sample.gpus] == [(0, False)]
        assert [g["index"] for g in json.loads(ctl.status_json())["gpus"]] == [0]

    run(test)


def test_a_victim_whose_job_ends_before_our_stop_takes_no_nvml_sample_until_that_stop_ends(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """A sample costs NVML calls on the controller's loop (issue 10): a.service, being
    stopped for b.service, keeps GPU 0 until our stop ends it, so its job's end (systemd
    keeps it active, no task left) releases nothing to sample for; that stop's end does."""
    bed, nvml = a_and_b_on_lingering_vram(tmp_path, cgroup_of, "Priority=90\n", "Priority=10\n")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await bed.acquire("a.service", ":1.9", 4242)
        bed.systemd.units["a.service"] = state("a.service", "active", "running")
        ctl.on_unit_changed("a.service", running())
        await bed.acquire("b.service", ":1.10", 4243)
        await settle()
        assert ctl.scheduler.phase("a.service") is Phase.STOPPING
        scans = nvml.scans
        job = "/org/freedesktop/systemd1/job/1"
        bed.systemd.tasks["a.service"] = 0
        bed.systemd.units["a.service"] = state("a.service", "active", "exited", 1)
        ctl.on_job_new(1, job, "a.service")
        ctl.on_unit_changed("a.service", {**EXITED, "Job": (1, job)})
        await settle()
        assert ctl.scheduler.remained == {"a.service"}
        assert ctl.scheduler.phase("a.service") is Phase.STOPPING
        assert nvml.scans == scans
        goes_down(bed, "a.service")
        ctl.on_job_removed(1, job, "a.service", "done")
        await settle()
        assert nvml.scans == scans + 1
        assert bed.service.granted == [("a.service", "0"), ("b.service", "0")]

    run(test)


def test_a_frozen_unit_shown_exited_keeps_the_env_file_naming_its_gpu(tmp_path: Path) -> None:
    """emb.service, frozen beside voice.service, still holds GPU 0: a late `active (exited)`
    of it, no task counted, releases nothing (Scheduler.exited), so its env file is not
    rewritten to name no GPU: it keeps naming GPU 0, which systemd gives the commands it
    spawns for the unit (ExecReload=, ExecStop=) while it holds it."""
    bed = frozen_beside_voice(tmp_path)
    runtime = bed.config.runtime_dir
    envfiles.write(runtime, "emb.service", [Gpu(0, "GPU-0")])  # its grant's

    async def test() -> None:
        ctl = await started(bed)
        assert ctl.scheduler.phase("emb.service") is Phase.FROZEN
        bed.systemd.tasks["emb.service"] = 0
        job_ended(bed, "emb.service")
        await settle()
        assert ("tasks_current", "emb.service") in bed.systemd.calls  # its check ran
        assert ctl.scheduler.phase("emb.service") is Phase.FROZEN
        assert ctl.scheduler.remained == set()
        assert envfiles.told_gpus(runtime, "emb.service") == [0]

    run(test)
