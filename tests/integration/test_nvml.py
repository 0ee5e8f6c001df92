"""GPU awareness against a real systemd with two simulated 24 GiB GPUs (tests/bed/fakegpu).

The controller runs its production NVML code on the fake libnvidia-ml.so.1; every job is a
gpu-alloc process holding "VRAM" while it runs. Tests drive `systemctl`, `systemd-run`,
`journalctl` and `gpuslice` inside the container and wait on observable state.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.bed import fakegpu
from tests.bed.container import Container, WaitTimeout, wait_until
from tests.integration.jobs import (
    always_for,
    holders,
    main_pid,
    prop,
    reload,
    status,
    wait_answer,
    wait_journal,
    wait_state,
    wait_sub,
    write_job,
)
from tests.integration.test_metrics import samples

GIB = fakegpu.GIB
UUID0, UUID1 = fakegpu.UUIDS[:2]
TIMEOUT = 20.0


@pytest.fixture
def bed(container: Container) -> Container:
    """gpuslice on two simulated 24 GiB GPUs, sampling every 0.2 s."""
    fakegpu.install(container, 2)
    return container


def gpu(bed: Container, index: int) -> dict[str, Any]:
    entry: dict[str, Any] = status(bed)["gpus"][index]
    return entry


def holder(bed: Container, index: int, unit: str) -> dict[str, Any]:
    found: dict[str, Any] = next(h for h in gpu(bed, index)["holders"] if h["unit"] == unit)
    return found


def wait_used(bed: Container, index: int, unit: str, used: int) -> dict[str, Any]:
    """Wait until a sample attributes USED bytes on GPU INDEX to UNIT; returns its entry."""

    def seen() -> dict[str, Any] | None:
        h = next((h for h in gpu(bed, index)["holders"] if h["unit"] == unit), None)
        return h if h is not None and h["memory_used"] == used else None

    return wait_until(seen, TIMEOUT, what=f"{unit} sampled using {used} B on GPU {index}")


def monotonic_s(bed: Container, unit: str, name: str) -> float:
    return int(prop(bed, unit, f"{name}Monotonic")) / 1e6


def logged_at(bed: Container, unit: str, text: str) -> float:
    """CLOCK_MONOTONIC seconds of UNIT's first journal line containing TEXT (systemd's own
    timestamps are gone once an inactive unit is unloaded)."""
    bed.run(["journalctl", "--sync"])
    out = bed.run(["journalctl", "-b", "-u", unit, "-o", "json", "--no-pager"]).stdout
    for line in out.splitlines():
        entry = json.loads(line)
        message = entry.get("MESSAGE")
        if isinstance(message, str) and text in message:
            return int(entry["__MONOTONIC_TIMESTAMP"]) / 1e6
    raise AssertionError(f"no journal line of {unit} contains {text!r}:\n{out[-4000:]}")


def test_two_background_units_pack_on_one_gpu(bed: Container) -> None:
    fakegpu.write_alloc_job(bed, "bg-a.service", 90, "background", memory="10G")
    reload(bed)
    wait_state(bed, "bg-a.service", "active")
    fakegpu.write_alloc_job(bed, "bg-b.service", 91, "background", memory="10G")
    reload(bed)
    wait_state(bed, "bg-b.service", "active")
    assert holders(bed) == {0: ["bg-a.service", "bg-b.service"], 1: []}
    for unit in ("bg-a.service", "bg-b.service"):
        entry = wait_used(bed, 0, unit, 10 * GIB)
        assert entry["memory_declared"] == 10 * GIB
        assert entry["state"] == "running"
    gpu0 = gpu(bed, 0)
    assert (gpu0["memory_total"], gpu0["memory_used"], gpu0["foreign"]) == (24 * GIB, 20 * GIB, [])
    assert gpu0["uuid"] == UUID0
    text = bed.run(["gpuslice", "status"]).stdout
    assert "bg-a.service" in text and "10 GiB declared, 10 GiB used" in text


def test_background_units_enrolled_together_pack(bed: Container) -> None:
    """Both placed in one scheduling pass (the controller's start-up), each counted once."""
    bed.systemctl("stop", "gpuslice.service")
    fakegpu.write_alloc_job(bed, "bg-a.service", 90, "background", memory="10G")
    fakegpu.write_alloc_job(bed, "bg-b.service", 91, "background", memory="10G")
    reload(bed)
    bed.systemctl("start", "gpuslice.service")
    wait_state(bed, "bg-a.service", "active")
    wait_state(bed, "bg-b.service", "active")
    assert holders(bed) == {0: ["bg-a.service", "bg-b.service"], 1: []}


def test_on_demand_unit_preempts_exactly_the_right_victim(bed: Container) -> None:
    """20 GiB needed: stopping A (priority 50) on GPU 0 or B (priority 90) on GPU 1 would do;
    B is less urgent, and C (4 GiB, priority 40) next to it may stay."""
    fakegpu.write_alloc_job(bed, "a.service", 50, memory="12G", devices="0")
    fakegpu.write_alloc_job(bed, "b.service", 90, memory="12G", devices="1")
    fakegpu.write_alloc_job(bed, "c.service", 40, memory="4G", devices="1")
    fakegpu.write_alloc_job(bed, "big.service", 10, memory="20G")
    reload(bed)
    bed.systemctl("start", "a.service", "b.service", "c.service")
    pids = {u: main_pid(bed, u) for u in ("a.service", "c.service")}
    bed.systemctl("start", "big.service")
    assert prop(bed, "b.service", "ActiveState") == "inactive"
    assert {u: main_pid(bed, u) for u in pids} == pids
    assert holders(bed) == {0: ["a.service"], 1: ["big.service", "c.service"]}
    assert status(bed)["preempted"] == [{"unit": "b.service", "priority": 90, "requeue": True}]
    journal = wait_journal(
        bed, "preempting b.service (priority 90) for big.service (priority 10) on GPU 1"
    )
    assert journal.count("preempting ") == 1
    wait_used(bed, 1, "big.service", 20 * GIB)


def test_two_gpu_unit(bed: Container) -> None:
    """GPUs=2 takes both GPUs: the 22 GiB unit on GPU 0 must go, the 10 GiB one on GPU 1 not."""
    fakegpu.write_alloc_job(bed, "big0.service", 90, "background", memory="22G", devices="0")
    fakegpu.write_alloc_job(bed, "small1.service", 90, "background", memory="10G", devices="1")
    fakegpu.write_alloc_job(bed, "two.service", 10, memory="4G", gpus=2)
    reload(bed)
    wait_state(bed, "big0.service", "active")
    wait_state(bed, "small1.service", "active")
    small = main_pid(bed, "small1.service")
    bed.systemctl("start", "two.service")
    assert prop(bed, "big0.service", "ActiveState") == "inactive"
    assert main_pid(bed, "small1.service") == small
    assert holders(bed) == {0: ["two.service"], 1: ["small1.service", "two.service"]}
    env = bed.run("cat /run/gpuslice/env/two.service/gpuslice.env").stdout
    assert f"CUDA_VISIBLE_DEVICES={UUID0},{UUID1}\n" in env
    assert "GPUSLICE_GPUS=0,1\n" in env
    wait_used(bed, 0, "two.service", 4 * GIB)
    wait_used(bed, 1, "two.service", 4 * GIB)


def test_devices_pin_by_index_and_by_uuid(bed: Container) -> None:
    fakegpu.write_alloc_job(bed, "by-index.service", 20, memory="2G", devices="1")
    # Unpinned, the tightest fit would be GPU 1 (next to by-index); the UUID pins it to 0.
    fakegpu.write_alloc_job(bed, "by-uuid.service", 20, memory="2G", devices=UUID0)
    reload(bed)
    bed.systemctl("start", "by-index.service")
    bed.systemctl("start", "by-uuid.service")
    assert holders(bed) == {0: ["by-uuid.service"], 1: ["by-index.service"]}
    env = bed.run("cat /run/gpuslice/env/by-uuid.service/gpuslice.env").stdout
    assert f"CUDA_VISIBLE_DEVICES={UUID0}\n" in env


def test_foreign_process_makes_background_units_yield_and_return(bed: Container) -> None:
    fakegpu.write_alloc_job(bed, "bg0.service", 90, "background", memory="10G", devices="0")
    fakegpu.write_alloc_job(bed, "bg1.service", 90, "background", memory="10G", devices="1")
    reload(bed)
    wait_state(bed, "bg0.service", "active")
    wait_state(bed, "bg1.service", "active")
    bg0 = main_pid(bed, "bg0.service")

    pid = fakegpu.start_foreign(bed, "foreign-x", 1, "2G")
    wait_state(bed, "bg1.service", "inactive")
    wait_journal(
        bed,
        "yielding GPU 1: stopping background bg1.service (priority 90) while a process "
        f"gpuslice does not manage uses it (PID {pid}; foreign-x.service)",
    )
    assert status(bed)["preempted"] == [{"unit": "bg1.service", "priority": 90, "requeue": True}]
    owner = {"kind": "unit", "id": "foreign-x.service"}
    assert gpu(bed, 1)["foreign"] == [
        {"pid": pid, "command": "gpu-alloc", "memory": 2 * GIB, "owner": owner, "compute": True}
    ]
    assert main_pid(bed, "bg0.service") == bg0, "GPU 0 has no foreign process"
    assert f"foreign: PID {pid} gpu-alloc" in bed.run(["gpuslice", "status"]).stdout

    fakegpu.stop_foreign(bed, "foreign-x.service")
    wait_state(bed, "bg1.service", "active")
    wait_journal(bed, "restarting preempted bg1.service (priority 90)")
    assert status(bed)["preempted"] == []
    assert gpu(bed, 1)["foreign"] == []
    assert main_pid(bed, "bg0.service") == bg0


def test_a_slurm_job_on_a_gpu_is_named_and_yielded_to(unified_container: Container) -> None:
    """Beside Slurm: a job step in the cgroup slurmstepd makes (a delegated scope; Slurm's
    cgroup/v2 plugin, so pure cgroup v2) is foreign, and the journal, status and metrics say
    it is that Slurm job."""
    bed = unified_container
    fakegpu.install(bed, 2)
    fakegpu.write_alloc_job(bed, "bg1.service", 90, "background", memory="10G", devices="1")
    reload(bed)
    wait_state(bed, "bg1.service", "active")

    pid = fakegpu.start_slurm_step(bed, 881, 1, "2G")
    wait_state(bed, "bg1.service", "inactive")
    wait_journal(
        bed,
        "yielding GPU 1: stopping background bg1.service (priority 90) while a process "
        f"gpuslice does not manage uses it (PID {pid}; Slurm job 881)",
    )
    owner = {"kind": "slurm", "id": "881"}
    assert gpu(bed, 1)["foreign"] == [
        {"pid": pid, "command": "gpu-alloc", "memory": 2 * GIB, "owner": owner, "compute": True}
    ]
    assert "2 GiB  (Slurm job 881)" in bed.run(["gpuslice", "status"]).stdout
    got = samples(bed.run(["gpuslice", "metrics"]).stdout)
    on_gpu1 = (("gpu", "1"), ("owner", "slurm"), ("uuid", UUID1))
    assert got[("gpuslice_gpu_foreign_memory_bytes", *on_gpu1)] == 2 * GIB
    # an on-demand unit kept off by the job's memory is told whose it is
    fakegpu.write_alloc_job(bed, "big.service", 10, memory="23G", devices="1")
    reload(bed)
    bed.systemctl("start", "--no-block", "big.service")
    wait_sub(bed, "big.service", "start-pre")
    reason = (
        "waiting: needs 23 GiB on one GPU; GPU 1 has 22 GiB free after the reserve, "
        "2 GiB used by processes of no holder (Slurm job 881)"
    )
    # the controller decides from systemd's signals, which may reach it after `systemctl`
    wait_answer(
        lambda: [w["reason"] for w in status(bed)["waiting"]],
        lambda reasons: reasons == [reason],
        TIMEOUT,
        "big.service waiting, told why",
    )
    bed.systemctl("stop", "big.service")

    fakegpu.stop_foreign(bed, "slurmstepd.scope")
    wait_state(bed, "bg1.service", "active")


# The README's Slurm prolog ("Claiming a GPU for work gpuslice does not run")
SLURM_PROLOG = """[ -n "$SLURM_JOB_GPUS" ] || exit 0
exec systemctl start $(echo "$SLURM_JOB_GPUS" | tr ',' '\\n' | sed 's/.*/gpuslice-claim@&.service/')
"""


def test_a_claim_takes_one_gpu_from_gpuslice_until_it_ends(bed: Container) -> None:
    """gpuslice-claim@.service, as a Slurm prolog and epilog use it: starting the claim of
    GPU 1 returns once the units there have left; while it holds, nothing of gpuslice runs
    there (the other GPU stays gpuslice's), and its end brings them back. A claim of a name
    that is no GPU of the host waits, saying why, and takes nothing."""
    fakegpu.write_alloc_job(bed, "bg1.service", 90, "background", memory="10G", devices="1")
    reload(bed)
    wait_state(bed, "bg1.service", "active")

    bed.run(["env", "SLURM_JOB_GPUS=1", "sh", "-c", SLURM_PROLOG])  # blocks until the grant
    assert prop(bed, "bg1.service", "ActiveState") == "inactive"
    assert holders(bed)[1] == ["gpuslice-claim@1.service"]
    wait_journal(
        bed,
        "preempting bg1.service (priority 90) for gpuslice-claim@1.service (priority 0)",
    )
    assert status(bed)["preempted"] == [{"unit": "bg1.service", "priority": 90, "requeue": True}]
    # the other GPU is still gpuslice's
    fakegpu.write_alloc_job(bed, "job.service", 50, memory=None)
    reload(bed)
    bed.systemctl("start", "job.service")
    assert holders(bed)[0] == ["job.service"]
    bed.systemctl("stop", "job.service")
    # the job the claim was for runs beside it, foreign to gpuslice, and nobody yields
    pid = fakegpu.start_foreign(bed, "slurm-job", 1, "2G")
    wait_until(lambda: gpu(bed, 1)["foreign"] or None, TIMEOUT, what="the job sampled")
    assert [f["pid"] for f in gpu(bed, 1)["foreign"]] == [pid]
    assert prop(bed, "gpuslice-claim@1.service", "ActiveState") == "active"
    fakegpu.stop_foreign(bed, "slurm-job.service")

    bed.run(["env", "SLURM_JOB_GPUS=1", "sh", "-c", SLURM_PROLOG.replace("start", "stop")])
    wait_state(bed, "bg1.service", "active")

    bed.systemctl("start", "--no-block", "gpuslice-claim@7.service")
    wait_sub(bed, "gpuslice-claim@7.service", "start-pre")
    wait_until(
        lambda: [w["unit"] for w in status(bed)["waiting"]] == ["gpuslice-claim@7.service"] or None,
        TIMEOUT,
        what="the claim of GPU 7 waiting",
    )
    (waiting,) = status(bed)["waiting"]
    assert "only 0 of this host's GPUs may run it" in waiting["reason"]
    assert prop(bed, "bg1.service", "ActiveState") == "active"
    bed.systemctl("stop", "gpuslice-claim@7.service")


def test_a_display_server_takes_memory_and_nobody_yields_to_it(bed: Container) -> None:
    """A desktop's GPU: the display server is a graphics process. Its memory counts, but a
    background unit does not step aside for it (it would never run on that GPU)."""
    fakegpu.write_alloc_job(bed, "bg1.service", 90, "background", memory="10G", devices="1")
    reload(bed)
    wait_state(bed, "bg1.service", "active")
    bg1 = main_pid(bed, "bg1.service")

    pid = fakegpu.start_foreign(bed, "xorg", 1, "2G", graphics=True)
    owner = {"kind": "unit", "id": "xorg.service"}
    seen = {"pid": pid, "command": "gpu-alloc", "memory": 2 * GIB, "owner": owner}
    wait_until(
        lambda: gpu(bed, 1)["foreign"] == [{**seen, "compute": False}] or None,
        TIMEOUT,
        what="the display server in status",
    )
    fakegpu.write_alloc_job(bed, "big.service", 95, memory="13G", devices="1")  # no preemption
    reload(bed)
    bed.systemctl("start", "--no-block", "big.service")
    wait_sub(bed, "big.service", "start-pre")
    reason = (
        "waiting: needs 13 GiB on one GPU; GPU 1 has 12 GiB free after the reserve, held by "
        "bg1.service, priority 90, 2 GiB used by processes of no holder"
    )
    # the controller decides from systemd's signals, which may reach it after `systemctl`
    wait_answer(
        lambda: [w["reason"] for w in status(bed)["waiting"]],
        lambda reasons: reasons == [reason],
        TIMEOUT,
        "big.service waiting, told why",
    )
    bed.systemctl("stop", "big.service")
    assert main_pid(bed, "bg1.service") == bg1
    assert "yielding" not in bed.journal("gpuslice.service")
    assert "(graphics only; xorg.service)" in bed.run(["gpuslice", "status"]).stdout


def test_workers_of_a_managed_unit_are_never_foreign(bed: Container) -> None:
    """Seed 001: a unit's own workers, whatever their names, are its own use of the GPU."""
    fakegpu.write_alloc_job(
        bed, "asr.service", 90, "background", memory="10G", alloc="4G", workers=("python3", "Xorg")
    )
    reload(bed)
    wait_state(bed, "asr.service", "active")
    pid = main_pid(bed, "asr.service")
    wait_used(bed, 0, "asr.service", 8 * GIB)  # both workers sampled, attributed to it
    commands = bed.run("ps -o comm= --ppid " + str(pid)).stdout.split()
    assert sorted(commands) == ["Xorg", "python3"]
    assert [g["foreign"] for g in status(bed)["gpus"]] == [[], []]
    assert main_pid(bed, "asr.service") == pid
    assert status(bed)["preempted"] == []
    assert "yielding" not in bed.journal("gpuslice.service")


def test_slow_victim_delays_the_grant_until_its_memory_is_gone(bed: Container) -> None:
    fakegpu.write_alloc_job(
        bed,
        "slow.service",
        90,
        "background",
        memory="20G",
        devices="0",
        # it stops 5 s after SIGTERM: the wait below must see urgent still waiting for it
        # after a poll of urgent's state and a status (a Python start) on a loaded host
        ignore_term=5,
        extra_service="TimeoutStopSec=30",
    )
    fakegpu.write_alloc_job(bed, "urgent.service", 10, memory="20G", devices="0")
    reload(bed)
    wait_state(bed, "slow.service", "active")
    victim = main_pid(bed, "slow.service")
    bed.systemctl("start", "--no-block", "urgent.service")
    wait_sub(bed, "urgent.service", "start-pre")
    wait_answer(
        lambda: [w["reason"] for w in status(bed)["waiting"]][:1],
        lambda first: first == ["waiting for slow.service (priority 90) to stop on GPU 0"],
        TIMEOUT,
        "urgent.service waiting for slow.service to stop",
    )
    wait_state(bed, "urgent.service", "active")

    preempted = logged_at(bed, "slow.service", "ignoring SIGTERM for 5 s")
    exited = logged_at(bed, "slow.service", "Deactivated successfully")
    started = monotonic_s(bed, "urgent.service", "ExecMainStartTimestamp")
    assert started > exited >= preempted + 4.9
    assert victim not in fakegpu.allocations(bed)
    assert holders(bed)[0] == ["urgent.service"]
    print(
        f"slow victim: stop asked -> exit {exited - preempted:.3f} s; "
        f"victim exit -> urgent main process {(started - exited) * 1000:.1f} ms"
    )


def test_nvml_missing_falls_back_to_configured_count_with_one_warning(
    container: Container,
) -> None:
    """Default container: no pynvml at all; then pynvml without libnvidia-ml.so.1."""
    journal = wait_journal(container, "NVML unavailable (pynvml not importable")
    container.write_file("/etc/gpuslice/config.yaml", "gpus: 2\nsample_interval: 0.2\n")
    fakegpu.put_files(container)  # pynvml.py, but no drop-in: no library on the path
    write_job(container, "job.service", 10, seconds=1)
    reload(container)
    fakegpu.restart_gpuslice(container)
    container.systemctl("start", "job.service")
    wait_state(container, "job.service", "inactive")
    journal = container.journal("gpuslice.service", "-o", "cat")
    warnings = [line for line in journal.splitlines() if "NVML" in line]
    assert warnings == [
        "NVML unavailable (pynvml not importable: No module named 'pynvml'): using gpus: 1 "
        "from config.yaml. Hint: install nvidia-ml-py",
        "NVML unavailable (libnvidia-ml.so.1 not found): using gpus: 2 from config.yaml. "
        "Hint: install the NVIDIA driver or set gpus: in config.yaml",
    ]
    gpus = status(container)["gpus"]
    assert [(g["index"], g["uuid"], g["memory_total"]) for g in gpus] == [
        (0, None, None),
        (1, None, None),
    ]
    env = container.run("cat /run/gpuslice/env/job.service/gpuslice.env").stdout
    assert env == "CUDA_VISIBLE_DEVICES=0\nCUDA_DEVICE_ORDER=PCI_BUS_ID\nGPUSLICE_GPUS=0\n"


def test_gpu_lost_at_runtime(bed: Container) -> None:
    fakegpu.write_alloc_job(bed, "on1.service", 20, memory="2G", devices="1")
    fakegpu.write_alloc_job(bed, "later.service", 20, memory="2G")
    fakegpu.write_alloc_job(bed, "pinned1.service", 20, memory="2G", devices="1")
    reload(bed)
    bed.systemctl("start", "on1.service")
    controller = main_pid(bed, "gpuslice.service")
    fakegpu.lose(bed, 1)
    wait_journal(bed, "GPU 1 is lost; it was held by on1.service")
    journal = wait_journal(bed, "GPU 1 is lost (it stopped answering NVML)")
    assert journal.count("GPU 1 is lost (it stopped answering NVML)") == 1
    assert gpu(bed, 1)["lost"] is True
    assert "GPU 1: LOST" in bed.run(["gpuslice", "status"]).stdout
    assert prop(bed, "gpuslice.service", "ActiveState") == "active"
    assert main_pid(bed, "gpuslice.service") == controller, "the controller did not restart"
    bed.systemctl("start", "later.service")
    assert holders(bed)[0] == ["later.service"]
    bed.systemctl("start", "--no-block", "pinned1.service")
    wait_sub(bed, "pinned1.service", "start-pre")
    reason = wait_until(
        lambda: status(bed)["waiting"], TIMEOUT, what="pinned1.service waiting with a reason"
    )[0]["reason"]
    assert "only 0 of this host's GPUs may run it" in reason
    assert main_pid(bed, "gpuslice.service") == controller


def test_environment_of_a_granted_unit(bed: Container) -> None:
    annotation = "[X-GPUSlice]\nPriority=10\nDevices=1\nMemory=1G\n"
    write_job(
        bed,
        "env.service",
        None,
        exec_start="/bin/sh -c 'env | grep -E \"^(CUDA|NVIDIA|GPUSLICE)_\" | sort > /run/env-seen'",
        extra_service="Type=oneshot",
        annotation=annotation,
    )
    reload(bed)
    bed.systemctl("start", "env.service")
    seen = bed.run("cat /run/env-seen").stdout
    assert seen == (
        "CUDA_DEVICE_ORDER=PCI_BUS_ID\n"
        f"CUDA_VISIBLE_DEVICES={UUID1}\n"
        "GPUSLICE_GATE_RETRY=0.5\n"  # the gate's, from its drop-in (gate_retry_seconds)
        "GPUSLICE_GPUS=1\n"
        f"NVIDIA_VISIBLE_DEVICES={UUID1}\n"
    )


def test_leftover_process_of_a_victim_delays_the_grant(bed: Container) -> None:
    """KillMode=process leaves a preempted unit's worker alive with its VRAM: no grant on
    that memory until the worker is gone."""
    fakegpu.write_alloc_job(
        bed,
        "leaky.service",
        90,
        "background",
        memory="20G",
        devices="0",
        workers=("python3",),
        extra_service="KillMode=process",
    )
    fakegpu.write_alloc_job(bed, "urgent.service", 10, memory="20G", devices="0")
    reload(bed)
    wait_state(bed, "leaky.service", "active")
    worker = wait_until(
        lambda: next(iter(fakegpu.allocations(bed)), None), TIMEOUT, what="the leaky worker"
    )
    bed.systemctl("start", "--no-block", "urgent.service")
    wait_state(bed, "leaky.service", "inactive")
    reason = (
        "waiting: needs 20 GiB on one GPU; GPU 0 has 4 GiB free after the reserve, "
        "20 GiB used by processes of no holder"
    )
    wait_until(
        lambda: [w["reason"] for w in status(bed)["waiting"]] == [reason] or None,
        TIMEOUT,
        what="urgent.service waiting on the leftover memory",
    )
    assert prop(bed, "urgent.service", "SubState") == "start-pre"
    assert worker in fakegpu.allocations(bed)
    bed.run(["kill", str(worker)])
    wait_state(bed, "urgent.service", "active")
    assert holders(bed)[0] == ["urgent.service"]


def test_a_controller_restart_leaves_running_background_units_alone(bed: Container) -> None:
    """The first NVML sample after a restart (an upgrade, a crash) was taken before the
    controller knew any unit: every running job's process was foreign, and background units
    yielded their GPUs to themselves, stopped for nothing."""
    fakegpu.write_alloc_job(bed, "asr.service", 90, "background", memory="10G", alloc="4G")
    reload(bed)
    wait_state(bed, "asr.service", "active")
    pid = main_pid(bed, "asr.service")
    wait_used(bed, 0, "asr.service", 4 * GIB)
    fakegpu.restart_gpuslice(bed)
    try:  # a sample of the new controller's (a guessed sleep once stood here)
        wait_used(bed, 0, "asr.service", 4 * GIB)
    except WaitTimeout as e:
        raise AssertionError(f"{e}\n{bed.journal('gpuslice.service')}") from None

    def left_alone() -> None:
        journal = bed.journal("gpuslice.service")
        assert "yielding" not in journal, journal
        assert main_pid(bed, "asr.service") == pid

    always_for(left_alone, 1.0)  # several samples more (every 0.2 s)
    assert [g["foreign"] for g in status(bed)["gpus"]] == [[], []]
