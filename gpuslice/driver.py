"""Is there NVIDIA hardware or an NVIDIA driver on this host? Asked when NVML does not answer.

NVML failing means one of two different things: there is no NVIDIA GPU here (no driver, no
device: CI, a CPU box) and `gpus:` from config.yaml is all there is; or the hardware is there
and the driver is not ready yet (kernel module loading, device nodes missing,
nvidia-persistenced starting), and the real GPUs will show up. The PCI bus tells them apart:
an NVIDIA device (vendor 0x10de) of display class (0x03xxxx: VGA or 3D controller) is there
from early boot, whatever the driver does. /proc/driver/nvidia (or /sys/module/nvidia) says
whether the kernel module is loaded.

Only small sysfs/procfs files are read (no device is opened, nothing is executed), so a probe
costs well under a millisecond and never blocks. `root` lets tests put a fake /sys and /proc
in place; the controller takes it from $GPUSLICE_DRIVER_ROOT, empty meaning "/".
"""

from __future__ import annotations

import errno
import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

NVIDIA_VENDOR = "0x10de"
DISPLAY_CLASS = "0x03"  # PCI base class 03: display controller (VGA 0300, 3D 0302)
ROOT_ENV = "GPUSLICE_DRIVER_ROOT"
# Device nodes NVML opens: the control node, one per GPU, and the unified-memory nodes that
# CUDA (and NVML's process queries on some drivers) use.
DEVICE_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
# What /proc/devices names the nvidia module's major (195, /dev/nvidiactl and /dev/nvidiaN):
# "nvidia-frontend" before driver 545 (550.40 in the production branch), "nvidia" and
# "nvidiactl" since. gpuslice.service's DeviceAllow= names all three.
FRONTEND_GROUPS = ("nvidia-frontend", "nvidia", "nvidiactl")


@dataclass(frozen=True)
class DriverProbe:
    """What the host shows of NVIDIA hardware and its driver."""

    devices: tuple[str, ...] = ()  # PCI addresses of NVIDIA display devices
    module_loaded: bool = False
    version: str | None = None  # the kernel module's version, when loaded

    @property
    def hardware(self) -> bool:
        """NVIDIA hardware or driver present: NVML failing then means "not ready yet"."""
        return bool(self.devices) or self.module_loaded

    def describe(self) -> str:
        parts = []
        if self.devices:
            shown = ", ".join(self.devices[:4]) + (" ..." if len(self.devices) > 4 else "")
            count = len(self.devices)
            parts.append(f"{count} NVIDIA PCI device{'s' if count != 1 else ''} ({shown})")
        if self.module_loaded:
            parts.append(f"nvidia module {self.version or 'loaded'}")
        elif self.devices:
            parts.append("nvidia module not loaded")
        return ", ".join(parts) if parts else "no NVIDIA PCI device, no nvidia module"


def root_from_env() -> Path:
    return Path(os.environ.get(ROOT_ENV) or "/")


def _read(path: Path, limit: int = 256) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("ascii", "replace").strip()
    except (OSError, ValueError):
        return ""


def nvidia_pci_devices(root: Path = Path("/")) -> tuple[str, ...]:
    """PCI addresses of NVIDIA display-class devices, sorted."""
    base = root / "sys" / "bus" / "pci" / "devices"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return ()
    found = []
    for name in names:
        if _read(base / name / "vendor").lower() != NVIDIA_VENDOR:
            continue
        if _read(base / name / "class").lower().startswith(DISPLAY_CLASS):
            found.append(name)
    return tuple(found)


def module_version(root: Path = Path("/")) -> tuple[bool, str | None]:
    """(loaded, version) of the nvidia kernel module."""
    text = _read(root / "proc" / "driver" / "nvidia" / "version", 4096)
    if text:
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..."
        words = text.splitlines()[0].split()
        version = next((w for w in words if w[:1].isdigit() and "." in w), None)
        return True, version
    module = root / "sys" / "module" / "nvidia"
    if module.is_dir():
        return True, _read(module / "version") or None
    return False, None


def probe(root: Path = Path("/")) -> DriverProbe:
    loaded, version = module_version(root)
    return DriverProbe(nvidia_pci_devices(root), loaded, version)


def frontend_registered(root: Path = Path("/")) -> bool:
    """Whether the nvidia character-device major is registered (/proc/devices), by any of
    its names (`FRONTEND_GROUPS`): systemd resolves `DeviceAllow=char-NAME` from it once,
    when the service starts. Known by its old name only, a driver of 550 or later was never
    there at start, and a controller whose NVML it refused exited to be restarted, again and
    again."""
    text = _read(root / "proc" / "devices", 16384)
    return any(line.split()[1:2] in ([g] for g in FRONTEND_GROUPS) for line in text.splitlines())


def device_denied(root: Path = Path("/")) -> bool:
    """/dev/nvidiactl exists but opening it fails with EPERM: the service's device cgroup
    does not allow it (as root, file permissions would not say EPERM). A non-blocking
    open of the control node is what every NVML client does first."""
    path = root / "dev" / "nvidiactl"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        return e.errno == errno.EPERM
    os.close(fd)
    return False


def missing_device_nodes(root: Path = Path("/")) -> list[str]:
    """Device nodes NVML needs that are absent on a host with a loaded nvidia module (nodes
    are made by nvidia-modprobe or udev; gpuslice's sandbox cannot create them)."""
    loaded, _ = module_version(root)
    if not loaded:
        return []
    dev = root / "dev"
    missing = [n for n in ("nvidiactl",) if not (dev / n).exists()]
    if not any(n.startswith("nvidia") and n[6:].isdigit() for n in _listdir(dev)):
        missing.append("nvidia[0-9]*")
    return missing


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _major_names(root: Path) -> dict[int, list[str]]:
    """Character-device majors -> their names, from /proc/devices: one major may have
    several (since driver 550, 195 is "nvidia" and "nvidiactl")."""
    text = _read(root / "proc" / "devices", 16384)
    names: dict[int, list[str]] = {}
    for line in text.split("Block devices:")[0].splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            names.setdefault(int(parts[0]), []).append(parts[1])
    return names


def device_access_problems(device_allow: list[str], root: Path = Path("/")) -> list[str]:
    """For `gpuslice check` on a host with the driver: each NVIDIA node NVML may open that
    the unit's sandbox (DeviceAllow= as `systemctl show -P DeviceAllow gpuslice.service`
    prints it: "char-nvidia-frontend rw" ...) would refuse, and missing nodes. Empty when
    the driver is not loaded: nothing to check yet."""
    if not module_version(root)[0]:
        return []
    problems = [
        f"/dev/{node} is missing: NVML cannot start (run nvidia-modprobe, or check udev)"
        for node in missing_device_nodes(root)
    ]
    allowed = {entry.split()[0] for entry in device_allow if entry.split()}
    # systemd allows a major whose name, any of them, a `char-` glob matches (fnmatch)
    globs = [entry[len("char-") :] for entry in allowed if entry.startswith("char-")]
    majors = _major_names(root)
    dev = root / "dev"
    for name in sorted(_listdir(dev)):
        if not (name in DEVICE_NODES or (name.startswith("nvidia") and name[6:].isdigit())):
            continue
        try:
            major = os.major(os.stat(dev / name).st_rdev)
        except OSError:
            continue
        groups = majors.get(major, [])
        if f"/dev/{name}" in allowed or any(
            fnmatch.fnmatchcase(group, glob) for group in groups for glob in globs
        ):
            continue
        problems.append(
            f"/dev/{name} (char-{groups[-1] if groups else major}) is not in gpuslice.service's "
            "DeviceAllow=: NVML would be refused"
        )
    return problems
