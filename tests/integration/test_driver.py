"""Booting on a real NVIDIA host, simulated: the controller starts before the driver, the
driver loads, a GPU is added, the driver goes away and comes back (tests/bed/fakegpu).

The fake PCI bus ($GPUSLICE_DRIVER_ROOT) shows NVIDIA hardware from the start, so NVML
failing means "not ready yet": background units wait, on-demand units run on the guessed
GPUs, and gpuslice switches to NVML without a restart when the driver appears.
"""

from __future__ import annotations

import time

from tests.bed import fakegpu
from tests.bed.container import Container, wait_until
from tests.integration.jobs import (
    always_for,
    holders,
    main_pid,
    prop,
    reload,
    start_count,
    status,
    wait_answer,
    wait_journal,
    wait_state,
    write_job,
)

UUID0, UUID1, UUID2 = fakegpu.UUIDS[:3]
TIMEOUT = 20.0
WINDOW = 2.0  # seconds over which "not started" is checked


def env_of(bed: Container, unit: str) -> str:
    return bed.run(f"cat /run/gpuslice/env/{unit}/gpuslice.env").stdout


def nvml_state(bed: Container) -> str:
    state: str = status(bed)["nvml"]["state"]
    return state


def wait_nvml(bed: Container, state: str) -> None:
    # the last answer in a timeout's message (asked up front, it cost a Python start before
    # the first look and showed the state at the start)
    wait_answer(lambda: nvml_state(bed), lambda now: now == state, TIMEOUT, f"nvml {state}")


def never_started(bed: Container, *units: str) -> None:
    def check() -> None:
        for unit in units:
            assert prop(bed, unit, "ActiveState") == "inactive", unit
            assert start_count(bed, unit) == 0, unit

    always_for(check, WINDOW, interval=0.25)


def test_controller_starts_before_the_driver(container: Container) -> None:
    bed = container
    fakegpu.install_driver_pending(bed, 2)
    controller = main_pid(bed, "gpuslice.service")
    wait_journal(bed, "NVIDIA hardware present (2 NVIDIA PCI devices")
    fakegpu.write_alloc_job(bed, "bg.service", 90, "background", memory="10G")
    write_job(bed, "od.service", 10)  # on-demand, whole GPU, no GPU memory of its own
    reload(bed)
    assert nvml_state(bed) == "waiting"
    assert "nvidia module not loaded" in status(bed)["nvml"]["detail"]
    assert "NVML waiting: " in bed.run(["gpuslice", "status"]).stdout

    # nothing urgent waits on the driver: the on-demand unit runs on the guessed GPU 0
    bed.systemctl("start", "od.service")
    assert (
        env_of(bed, "od.service")
        == "CUDA_VISIBLE_DEVICES=0\nCUDA_DEVICE_ORDER=PCI_BUS_ID\nGPUSLICE_GPUS=0\n"
    )
    # background units are not started on guessed GPUs, nor when started by hand
    never_started(bed, "bg.service")
    bed.systemctl("start", "--no-block", "bg.service")
    reason = wait_until(
        lambda: [w["reason"] for w in status(bed)["waiting"]] or None,
        TIMEOUT,
        what="bg.service waiting with a reason",
    )
    assert reason == [
        "waiting: NVIDIA hardware is present but NVML is not ready yet: background units wait "
        "for it, at most 120 s (driver_wait)"
    ]
    assert prop(bed, "bg.service", "SubState") == "start-pre"

    appeared = time.monotonic()  # CLOCK_MONOTONIC: the container's clock too
    fakegpu.load_driver(bed, 2)
    wait_state(bed, "bg.service", "active")
    granted = int(prop(bed, "bg.service", "ExecMainStartTimestampMonotonic")) / 1e6
    journal = wait_journal(bed, "NVML ready (driver 550.54.15): switched to 2 GPUs")
    assert "holders keep their GPUs by index: od.service on GPU 0" in journal
    assert main_pid(bed, "gpuslice.service") == controller, "switched without a restart"
    assert nvml_state(bed) == "ready"
    # the on-demand unit keeps GPU 0 (by index); the background unit gets the free GPU 1
    assert holders(bed) == {0: ["od.service"], 1: ["bg.service"]}
    assert f"CUDA_VISIBLE_DEVICES={UUID1}\n" in env_of(bed, "bg.service")
    assert [g["memory_total"] for g in status(bed)["gpus"]] == [24 << 30, 24 << 30]
    print(f"driver appears -> first NVML-based grant started: {granted - appeared:.3f} s")


def test_driver_wait_runs_out_then_nvml_still_switches(container: Container) -> None:
    bed = container
    fakegpu.install_driver_pending(bed, 1, config="gpus: 1\nsample_interval: 0.2\ndriver_wait: 1\n")
    write_job(bed, "bg.service", 90, "background")  # no CUDA: a job that needs no driver
    reload(bed)
    wait_state(bed, "bg.service", "active")  # after driver_wait, on the guessed GPU 0
    wait_journal(bed, "NVML still not ready after")
    assert nvml_state(bed) == "fallback"
    assert (
        env_of(bed, "bg.service")
        == "CUDA_VISIBLE_DEVICES=0\nCUDA_DEVICE_ORDER=PCI_BUS_ID\nGPUSLICE_GPUS=0\n"
    )
    fakegpu.load_driver(bed, 1)
    wait_nvml(bed, "ready")
    wait_journal(bed, "holders keep their GPUs by index: bg.service on GPU 0")
    assert holders(bed) == {0: ["bg.service"]}


def test_gpu_added_at_runtime_is_used(container: Container) -> None:
    bed = container
    fakegpu.install(bed, 2)
    for name in ("bg0.service", "bg1.service", "bg2.service"):
        fakegpu.write_alloc_job(bed, name, 90, "background", memory="20G")
    reload(bed)
    wait_until(
        lambda: sum(map(len, holders(bed).values())) == 2 or None, TIMEOUT, what="two running"
    )
    waiting = next(n for n in ("bg0.service", "bg1.service", "bg2.service")
                   if prop(bed, n, "ActiveState") == "inactive")  # fmt: skip
    controller = main_pid(bed, "gpuslice.service")
    fakegpu.set_gpus(bed, 3)
    bed.systemctl("reload", "gpuslice.service")  # NVML counts GPUs at init: enumerate again
    wait_state(bed, waiting, "active")
    assert holders(bed)[2] == [waiting]
    assert f"CUDA_VISIBLE_DEVICES={UUID2}\n" in env_of(bed, waiting)
    wait_journal(bed, "GPUs changed: now 0, 1, 2 (were 0, 1)")
    assert main_pid(bed, "gpuslice.service") == controller


def test_driver_gone_and_back(container: Container) -> None:
    bed = container
    fakegpu.install(bed, 2)
    fakegpu.write_alloc_job(bed, "bg-a.service", 90, "background", memory="10G")
    reload(bed)
    wait_state(bed, "bg-a.service", "active")
    running = main_pid(bed, "bg-a.service")
    controller = main_pid(bed, "gpuslice.service")
    # the GPU's env file existed before the driver went
    assert f"CUDA_VISIBLE_DEVICES={UUID0}\n" in env_of(bed, "bg-a.service")

    fakegpu.unload_driver(bed)
    wait_journal(bed, "NVML went away (")
    wait_nvml(bed, "waiting")
    gpus = status(bed)["gpus"]
    assert [(g["uuid"], g["memory_total"]) for g in gpus] == [(UUID0, None), (UUID1, None)]
    fakegpu.write_alloc_job(bed, "bg-b.service", 91, "background", memory="10G")
    reload(bed)
    never_started(bed, "bg-b.service")
    assert main_pid(bed, "bg-a.service") == running, "a holder is left alone"

    fakegpu.reload_driver(bed)
    wait_state(bed, "bg-b.service", "active")
    wait_journal(bed, "NVML ready (driver 550.54.15): switched to 2 GPUs")
    assert nvml_state(bed) == "ready"
    assert holders(bed) == {0: ["bg-a.service", "bg-b.service"], 1: []}  # packing again
    assert main_pid(bed, "gpuslice.service") == controller
    assert main_pid(bed, "bg-a.service") == running
