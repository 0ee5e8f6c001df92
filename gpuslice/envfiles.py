"""A granted unit's environment file (RUNTIME_DIR/env/UNIT/gpuslice.env): what its processes
see, written before its gate is answered, and read back when the saved state does not say
which GPUs a running unit was granted. A unit's file and directory go when it can no longer
need them (`remove`): an instance seen going down, and at start-up every unit listed (`present`)
that neither runs nor holds anything.

The gate drop-in names the file with `EnvironmentFile=-`, so a missing file starts the unit
with every GPU visible: the controller lets no gate through before its unit's file is written
(Delivery.deliver; Gates.let_through for a unit it still holds GPUs for whose
annotation went).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

from gpuslice import safefile
from gpuslice.core.model import GPU_ID, Gpu
from gpuslice.paths import ENV_DIR_NAME, env_file
from gpuslice.unitfiles import is_valid_unit_name

MAX_BYTES = 4096  # an env file is three lines: more is not ours


def text(gpus: Sequence[Gpu]) -> str:
    """What a granted unit's processes see. CUDA numbers GPUs by its own order (fastest
    first) unless told PCI_BUS_ID, so UUIDs (when NVML gave them) name exactly the GPUs
    granted; without them (NVML not ready yet) an index is NVML's, which is PCI bus order,
    and CUDA is told so: else on a host of mixed GPUs, index 1 was another GPU for CUDA, one
    granted by UUID to another unit once NVML answered. No GPU (a unit released while
    systemd keeps it active: Delivery.tell_none): CUDA sees none with the variable empty,
    the NVIDIA container runtime with `void`; unset (the file gone), both saw every GPU."""
    if not gpus:
        return "CUDA_VISIBLE_DEVICES=\nNVIDIA_VISIBLE_DEVICES=void\nGPUSLICE_GPUS=\n"
    indices = ",".join(str(g.index) for g in gpus)
    if not all(g.uuid for g in gpus):
        return (
            f"CUDA_VISIBLE_DEVICES={indices}\nCUDA_DEVICE_ORDER=PCI_BUS_ID\n"
            f"GPUSLICE_GPUS={indices}\n"
        )
    uuids = ",".join(g.uuid for g in gpus)
    return (
        f"CUDA_VISIBLE_DEVICES={uuids}\nCUDA_DEVICE_ORDER=PCI_BUS_ID\n"
        f"NVIDIA_VISIBLE_DEVICES={uuids}\nGPUSLICE_GPUS={indices}\n"
    )


def write(runtime_dir: str, unit: str, gpus: Sequence[Gpu], keep_old: bool = False) -> None:
    """Replace the unit's file at once (`safefile.write_atomic`: a reader sees the old or the
    new one); OSError if it cannot be written, the stale one removed if it could not be
    replaced, unless `keep_old` (it names GPUs the unit still holds; gone, it saw every GPU).
    The temporary files of writes killed mid-way go first (`safefile.remove_stale`: a
    directory of one file, listed in microseconds), as they go with the unit's directory."""
    path = env_file(runtime_dir, unit)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        safefile.remove_stale(path)
        safefile.write_atomic(path, text(gpus).encode())
    except OSError:
        if not keep_old:
            with contextlib.suppress(OSError):
                path.unlink()
        raise


def remove(runtime_dir: str, unit: str) -> bool:
    """Remove the unit's file and its directory, if they are there: an instance's name may
    never come again (`transcribe@RECORDING`, a socket's Accept=yes instance per connection),
    and /run would keep a directory and a file for every instance ever granted until reboot.
    A directory holding anything else is left, and nothing is removed through a link.
    Whether the unit's directory was removed."""
    path = env_file(runtime_dir, unit)
    try:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        with contextlib.suppress(OSError):
            os.unlink(path.name, dir_fd=fd)
        safefile.remove_stale(path, dir_fd=fd)  # a write killed mid-way left its own
    finally:
        os.close(fd)
    try:
        path.parent.rmdir()
    except OSError:
        return False
    return True


def present(runtime_dir: str, limit: int) -> tuple[list[str], bool]:
    """The units that have a directory in RUNTIME_DIR/env (sorted), among its first `limit`
    entries, and whether there were more: what a restarted controller sweeps (the files of
    units that ended while it was away). Only a real directory named as a unit counts: a
    link, FIFO or file in its place, or a name no unit has, is not listed (nor ever opened:
    a FIFO opened would wait for a writer). Nothing at RUNTIME_DIR/env, or a link there:
    none."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(os.path.join(runtime_dir, ENV_DIR_NAME), flags)
    except OSError:
        return [], False
    units: list[str] = []
    try:
        with os.scandir(fd) as entries:
            for seen, entry in enumerate(entries):
                if seen == limit:
                    return sorted(units), True
                with contextlib.suppress(OSError):  # gone meanwhile
                    if entry.is_dir(follow_symlinks=False) and is_valid_unit_name(entry.name):
                        units.append(entry.name)
    except OSError:  # read as far as it could be
        pass
    finally:
        os.close(fd)
    return sorted(units), False


def told_gpus(runtime_dir: str, unit: str) -> list[int]:
    """The GPU indices the unit's file names (GPUSLICE_GPUS=), [] if none can be read or the
    file is larger than one of ours (MAX_BYTES). Never follows a link or waits on a FIFO."""
    return _indices(_told(runtime_dir, unit))


def told_uuids(runtime_dir: str, unit: str) -> dict[int, str]:
    """Each GPU index the unit's file names, with the UUID it names that GPU by: the GPU the
    unit's processes see, whatever NVML numbers it now. {} when the file names no UUIDs
    (written before NVML answered) or is no file of ours."""
    told = _told(runtime_dir, unit)
    indices = _indices(told)
    uuids = told.get("NVIDIA_VISIBLE_DEVICES", "").split(",")
    ours = all(u.startswith("GPU-") and GPU_ID.fullmatch(u) for u in uuids)
    return dict(zip(indices, uuids, strict=True)) if ours and len(uuids) == len(indices) else {}


def _told(runtime_dir: str, unit: str) -> dict[str, str]:
    """The file's KEY=VALUE lines, the first of each key; {} if it cannot be read."""
    try:
        data = safefile.read_bytes(env_file(runtime_dir, unit), MAX_BYTES, follow_links=False)
    except safefile.Unreadable:
        return {}
    told: dict[str, str] = {}
    for line in data.decode("ascii", "replace").splitlines():
        key, _, value = line.partition("=")
        told.setdefault(key, value)
    return told


def _indices(told: dict[str, str]) -> list[int]:
    value = told.get("GPUSLICE_GPUS")
    if value is None:
        return []
    parts = value.split(",")
    ours = all(p.isascii() and p.isdigit() for p in parts)
    return [int(p) for p in parts] if ours else []  # anything else is no file of ours
