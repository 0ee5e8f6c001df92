"""Simulated GPUs inside a test-bed container: the fake NVML (tests/fakenvml) put in place.

The library and gpu-alloc are built on the host once per process (gcc is on the host and in CI,
not in the container) into tests/fakenvml/build/, which is git-ignored and visible inside at
/src/tests/fakenvml/build/; the host venv's pynvml.py is copied there too (as pynvml.py.copy).
`install` copies them into the container, describes the GPUs in $FAKE_NVML_DIR/gpus and
restarts gpuslice with a drop-in that points pynvml at the fake. Production code is unchanged:
pynvml dlopens "libnvidia-ml.so.1" and finds ours through LD_LIBRARY_PATH.

Jobs are gpu-alloc processes ("allocating" VRAM until they exit); `write_alloc_job` writes an
annotated unit that allocates on the GPUs gpuslice granted it (GPUSLICE_GPUS), `start_foreign`
starts one in an unannotated transient unit, `lose` makes a GPU fall off the bus.
"""

from __future__ import annotations

import fcntl
import functools
import shlex
import shutil
import subprocess
from pathlib import Path

from tests.bed.container import REPO, BedError, Container, wait_until

SRC = REPO / "tests" / "fakenvml"
BUILD = SRC / "build"  # git-ignored; /src/tests/fakenvml/build inside the container
BUILD_IN_BED = "/src/tests/fakenvml/build"
# The host's pynvml.py, under a name that mypy (files = tests) and pytest do not pick up.
PYNVML_COPY = "pynvml.py.copy"

LIB_DIR = "/usr/local/lib/fakenvml"  # libnvidia-ml.so.1 and gpu-alloc
ALLOC = f"{LIB_DIR}/gpu-alloc"
WORKERS = f"{LIB_DIR}/workers"  # gpu-alloc under other names (what /proc/PID/comm shows)
WORKER_NAMES = ("python3", "Xorg", "ollama", "asr-worker")
STATE = "/run/fakenvml"  # $FAKE_NVML_DIR
# the fake cuda-checkpoint, behind a wrapper that points it at STATE: gpuslice runs the tool as
# a transient service (systemd-run), which does not inherit the controller's environment
CHECKPOINT = f"{LIB_DIR}/cuda-checkpoint"
PYDIR = "/usr/local/lib/gpuslice/python"
DROPIN = "/etc/systemd/system/gpuslice.service.d/fakenvml.conf"
CONFIG = "/etc/gpuslice/config.yaml"
UNIT_DIR = "/etc/systemd/system"

GIB = 1 << 30
UUIDS = (
    "GPU-11111111-1111-1111-1111-111111111111",
    "GPU-22222222-2222-2222-2222-222222222222",
    "GPU-33333333-3333-3333-3333-333333333333",
    "GPU-44444444-4444-4444-4444-444444444444",
)
GPU_NAME = "NVIDIA Fake 24GB"
# Fast sampling so foreign processes are seen within a fraction of a second.
TEST_CONFIG = "gpus: 1\nsample_interval: 0.2\nvram_release_timeout: 5\n"
SETTLE_TIMEOUT = 30.0


@functools.cache
def build() -> Path:
    """Build libnvidia-ml.so.1 and gpu-alloc, and copy pynvml.py next to them (once per process;
    a lock file serialises concurrent test runs sharing the checkout)."""
    if shutil.which("make") is None or shutil.which("gcc") is None:
        raise BedError("make and gcc are needed on the host to build tests/fakenvml")
    try:
        import pynvml
    except ImportError as e:
        raise BedError(f"pynvml is not importable on the host ({e}): run `make venv`") from e
    BUILD.mkdir(parents=True, exist_ok=True)
    with open(BUILD / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = subprocess.run(
            ["make", "-s", "-C", str(SRC), f"BUILD={BUILD}"], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise BedError(f"building tests/fakenvml failed:\n{result.stdout}{result.stderr}")
        source = Path(pynvml.__file__)
        target = BUILD / PYNVML_COPY
        if not target.exists() or target.read_bytes() != source.read_bytes():
            partial = BUILD / f".{PYNVML_COPY}.partial"
            shutil.copyfile(source, partial)
            partial.rename(target)
    return BUILD


def gpus_text(count: int = 2, total: str = "24GiB") -> str:
    """The fake's `gpus` file: COUNT GPUs of TOTAL each, with the fixed UUIDS."""
    lines = ["# index uuid total name"]
    lines += [f"{i} {UUIDS[i]} {total} {GPU_NAME}" for i in range(count)]
    return "\n".join(lines) + "\n"


def put_files(bed: Container) -> None:
    """Copy the fake NVML, gpu-alloc (and its worker aliases) and pynvml.py into the container."""
    build()
    workers = " ".join(shlex.quote(f"{WORKERS}/{name}") for name in WORKER_NAMES)
    bed.run(
        f"set -e; install -d {LIB_DIR} {WORKERS} {PYDIR}; "
        f"install -m 755 {BUILD_IN_BED}/libnvidia-ml.so.1 {BUILD_IN_BED}/gpu-alloc {LIB_DIR}/; "
        f"install -m 755 {BUILD_IN_BED}/cuda-checkpoint {CHECKPOINT}.bin; "
        f"printf '#!/bin/sh\\nFAKE_NVML_DIR={STATE} exec {CHECKPOINT}.bin \"$@\"\\n' "
        f"> {CHECKPOINT}; chmod 755 {CHECKPOINT}; "
        f"install -m 644 {BUILD_IN_BED}/{PYNVML_COPY} {PYDIR}/pynvml.py; "
        f"for w in {workers}; do ln -sf {ALLOC} $w; done"
    )


def install(
    bed: Container, gpus: int = 2, *, config: str = TEST_CONFIG, total: str = "24GiB"
) -> None:
    """Simulate GPUS GPUs of TOTAL in a container where gpuslice is installed, and restart
    gpuslice on them; returns once gpuslice is active and `gpuslice status` shows them."""
    put_files(bed)
    bed.write_file(f"{STATE}/gpus", gpus_text(gpus, total))
    bed.run(["install", "-d", f"{STATE}/alloc", f"{STATE}/lost"])
    bed.write_file(CONFIG, config)
    bed.write_file(
        DROPIN,
        f"[Service]\nEnvironment=LD_LIBRARY_PATH={LIB_DIR} FAKE_NVML_DIR={STATE}\n",
    )
    bed.systemctl("daemon-reload")
    restart_gpuslice(bed)
    wait_until(
        lambda: _gpu_names(bed) == [GPU_NAME] * gpus or None,
        SETTLE_TIMEOUT,
        what=f"gpuslice status to show {gpus} fake GPUs (shows {_gpu_names(bed)})",
    )


def restart_gpuslice(bed: Container) -> None:
    bed.systemctl("restart", "gpuslice.service")
    bed.wait_active_state("gpuslice.service", "active", SETTLE_TIMEOUT)


def _gpu_names(bed: Container) -> list[str | None]:
    import json

    result = bed.run(["gpuslice", "status", "--json"], check=False)
    if result.returncode != 0:
        return []
    return [g["name"] for g in json.loads(result.stdout)["gpus"]]


def alloc_command(
    memory: str, *, gpus: int = 1, ignore_term: float = 0, workers: tuple[str, ...] = ()
) -> str:
    """An ExecStart= that allocates MEMORY on each GPU in $GPUSLICE_GPUS.

    One GPU and no workers: gpu-alloc itself is the main process (systemd expands
    ${GPUSLICE_GPUS}). Otherwise a small sh starts one gpu-alloc per GPU, or one per entry of
    WORKERS (gpu-alloc under that name, for a one-GPU unit), and waits for them.
    """
    term = f" --ignore-term {ignore_term:g}" if ignore_term else ""
    if gpus == 1 and not workers:
        return f"{ALLOC} --gpu ${{GPUSLICE_GPUS}} --bytes {memory}{term}"
    if workers:
        starts = " ".join(
            f"{WORKERS}/{w} --gpu ${{GPUSLICE_GPUS}} --bytes {memory}{term} &" for w in workers
        )
        return f"/bin/sh -c '{starts} wait'"
    return (
        "/bin/sh -c 'IFS=,; for g in $$GPUSLICE_GPUS; do "
        f"{ALLOC} --gpu $$g --bytes {memory}{term} & done; wait'"
    )


def write_alloc_job(
    bed: Container,
    name: str,
    priority: int,
    kind: str = "on-demand",
    *,
    memory: str | None = "10G",
    alloc: str | None = None,
    gpus: int = 1,
    devices: str | None = None,
    ignore_term: float = 0,
    workers: tuple[str, ...] = (),
    extra_service: str = "",
) -> None:
    """An annotated unit whose main process allocates on its granted GPU(s).

    MEMORY is what it declares (`Memory=`; None: the whole GPU); ALLOC what it actually
    allocates (default: MEMORY, or 1G for a whole-GPU unit)."""
    annotation = f"[X-GPUSlice]\nPriority={priority}\nType={kind}\nGPUs={gpus}\n"
    if memory is not None:
        annotation += f"Memory={memory}\n"
    if devices is not None:
        annotation += f"Devices={devices}\n"
    command = alloc_command(
        alloc or memory or "1G", gpus=gpus, ignore_term=ignore_term, workers=workers
    )
    bed.write_file(
        f"{UNIT_DIR}/{name}",
        f"[Unit]\nDescription=fake GPU job {name}\n\n[Service]\n"
        f"Environment=FAKE_NVML_DIR={STATE}\n"
        f"ExecStart={command}\n{extra_service}\n\n{annotation}",
    )


def allocations(bed: Container) -> dict[int, tuple[int, int]]:
    """Live allocation files: PID -> (GPU, bytes)."""
    out = bed.run(f"cat {STATE}/alloc/* 2>/dev/null || true").stdout
    found: dict[int, tuple[int, int]] = {}
    for line in out.splitlines():
        gpu, pid, size = line.split()[:3]  # a 4th field says `graphics`
        found[int(pid)] = (int(gpu), 0 if size == "-" else int(size))
    return found


def start_foreign(
    bed: Container, name: str, gpu: int, memory: str = "2G", *, graphics: bool = False
) -> int:
    """gpu-alloc in an unannotated transient unit NAME (systemd-run): a process gpuslice does
    not manage (with GRAPHICS, a graphics-only one: a display server). Returns its PID once
    its allocation is visible."""
    bed.run(
        [
            "systemd-run",
            "--quiet",
            f"--unit={name}",
            f"--setenv=FAKE_NVML_DIR={STATE}",
            ALLOC,
            "--gpu",
            str(gpu),
            "--bytes",
            memory,
            *(["--graphics"] if graphics else []),
        ]
    )
    unit = name if name.endswith(".service") else f"{name}.service"

    def allocated() -> int | None:
        pid = int(bed.systemctl("show", "-P", "MainPID", unit).stdout.strip() or 0)
        return pid if pid and pid in allocations(bed) else None

    return wait_until(allocated, SETTLE_TIMEOUT, what=f"{unit} to allocate on GPU {gpu}")


def start_slurm_step(bed: Container, job: int, gpu: int, memory: str = "2G") -> int:
    """gpu-alloc where slurmstepd puts a job step with cgroup v2 (a `Delegate=yes` scope it
    registers with systemd, the job's cgroups created inside it):
    /system.slice/slurmstepd.scope/job_JOB/step_0. Returns its PID once it allocates; stop
    it with `stop_foreign(bed, "slurmstepd.scope")`."""
    step = f"/sys/fs/cgroup/system.slice/slurmstepd.scope/job_{job}/step_0"
    # sh moves itself into the step, then forks the job (which keeps neither the death signal
    # `run` sets nor its cgroup) and exits: the scope lives on with the job alone in it
    script = (
        f"mkdir -p {step} && echo $$ > {step}/cgroup.procs && FAKE_NVML_DIR={STATE} "
        f"setsid -f {ALLOC} --gpu {gpu} --bytes {memory} </dev/null >/dev/null 2>&1"
    )
    bed.run(
        ["systemd-run", "--quiet", "--scope", "--unit=slurmstepd", "-p", "Delegate=yes",
         "sh", "-c", script]
    )  # fmt: skip

    def allocated() -> int | None:
        pids = bed.run(f"cat {step}/cgroup.procs", check=False).stdout.split()
        found = [int(p) for p in pids if int(p) in allocations(bed)]
        return found[0] if found else None

    return wait_until(allocated, SETTLE_TIMEOUT, what=f"Slurm job {job} to allocate on GPU {gpu}")


def stop_foreign(bed: Container, name: str) -> None:
    bed.systemctl("stop", name)


def lose(bed: Container, index: int) -> None:
    """GPU INDEX falls off the bus: every NVML call on it returns GPU_IS_LOST from now on."""
    bed.run(["touch", f"{STATE}/lost/{index}"])


# -- the driver's life: not loaded yet, loaded, a GPU added, gone and back ---------------------

# A fake /sys and /proc for gpuslice.driver ($GPUSLICE_DRIVER_ROOT): the container's own /sys
# is the host's, read-only, and shows no NVIDIA device on the machines tests run on.
DRIVER_ROOT = f"{STATE}/root"
PCI_DEVICES = f"{DRIVER_ROOT}/sys/bus/pci/devices"
MODULE_VERSION = f"{DRIVER_ROOT}/proc/driver/nvidia/version"
FAKE_DRIVER_VERSION = "550.54.15"


def install_driver_pending(
    bed: Container, pci_devices: int = 2, *, config: str = TEST_CONFIG
) -> None:
    """NVIDIA hardware on the PCI bus (PCI_DEVICES display functions) but the driver not loaded
    yet: no `gpus` file (nvmlInit says DRIVER_NOT_LOADED), no module. gpuslice is restarted on
    it and is active when this returns; `load_driver` then brings the GPUs."""
    put_files(bed)
    bed.run(["rm", "-rf", f"{STATE}/gpus", f"{STATE}/unloaded", DRIVER_ROOT])
    bed.run(["install", "-d", f"{STATE}/alloc", f"{STATE}/lost"])
    set_pci_devices(bed, pci_devices)
    bed.write_file(CONFIG, config)
    bed.write_file(
        DROPIN,
        f"[Service]\nEnvironment=LD_LIBRARY_PATH={LIB_DIR} FAKE_NVML_DIR={STATE} "
        f"GPUSLICE_DRIVER_ROOT={DRIVER_ROOT}\n",
    )
    bed.systemctl("daemon-reload")
    restart_gpuslice(bed)


def set_pci_devices(bed: Container, count: int) -> None:
    """COUNT NVIDIA 3D controllers (vendor 0x10de, class 0x030200) on the fake PCI bus, next
    to a non-NVIDIA device."""
    script = [f"rm -rf {PCI_DEVICES}", f"mkdir -p {PCI_DEVICES}/0000:00:02.0"]
    script.append(f"echo 0x8086 > {PCI_DEVICES}/0000:00:02.0/vendor")
    script.append(f"echo 0x030000 > {PCI_DEVICES}/0000:00:02.0/class")
    for i in range(count):
        device = f"{PCI_DEVICES}/0000:{0x17 + i:02x}:00.0"
        script += [f"mkdir -p {device}", f"echo 0x10de > {device}/vendor"]
        script.append(f"echo 0x030200 > {device}/class")
    bed.run("set -e; " + "; ".join(script))


def load_driver(bed: Container, gpus: int = 2, total: str = "24GiB") -> None:
    """The nvidia module loads: /proc/driver/nvidia/version appears and the `gpus` file is
    renamed into place at once (the fake reads it at nvmlInit: never half-written)."""
    bed.write_file(
        MODULE_VERSION,
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {FAKE_DRIVER_VERSION}  "
        "Tue Mar  5 22:23:56 UTC 2024\n",
    )
    set_gpus(bed, gpus, total)


def set_gpus(bed: Container, gpus: int, total: str = "24GiB") -> None:
    """Describe GPUS GPUs (a GPU added or removed): real NVML sees it at its next init."""
    bed.write_file(f"{STATE}/.gpus.tmp", gpus_text(gpus, total))
    bed.run(["mv", f"{STATE}/.gpus.tmp", f"{STATE}/gpus"])


def unload_driver(bed: Container) -> None:
    """The driver goes away (module unloaded, `nvidia-smi -r`): NVML says DRIVER_NOT_LOADED to
    every call until `reload_driver`."""
    bed.run(["touch", f"{STATE}/unloaded"])
    bed.run(["rm", "-f", MODULE_VERSION])


def reload_driver(bed: Container) -> None:
    bed.write_file(
        MODULE_VERSION,
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {FAKE_DRIVER_VERSION}  "
        "Tue Mar  5 22:23:56 UTC 2024\n",
    )
    bed.run(["rm", "-f", f"{STATE}/unloaded"])
