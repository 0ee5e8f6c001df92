"""gpuslice.driver on fake /sys and /proc trees: which hosts count as "NVIDIA here"."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from gpuslice.driver import (
    DriverProbe,
    device_access_problems,
    device_denied,
    frontend_registered,
    missing_device_nodes,
    probe,
)

VERSION_LINE = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)


def pci(root: Path, address: str, vendor: str, cls: str) -> None:
    device = root / "sys" / "bus" / "pci" / "devices" / address
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    (device / "class").write_text(cls + "\n")


def test_no_sysfs_at_all_is_no_nvidia(tmp_path: Path) -> None:
    assert probe(tmp_path) == DriverProbe()
    assert not probe(tmp_path).hardware
    assert probe(tmp_path).describe() == "no NVIDIA PCI device, no nvidia module"


@pytest.mark.parametrize(
    ("vendor", "cls", "found"),
    [
        ("0x10de", "0x030200", True),  # 3D controller (data-centre GPUs)
        ("0x10de", "0x030000", True),  # VGA controller
        ("0x10DE", "0x030000", True),
        ("0x10de", "0x040300", False),  # the GPU's HDMI audio function
        ("0x10de", "0x068000", False),  # an NVSwitch / bridge
        ("0x8086", "0x030000", False),  # Intel graphics
        ("0x1002", "0x038000", False),  # AMD
    ],
)
def test_nvidia_display_devices_only(tmp_path: Path, vendor: str, cls: str, found: bool) -> None:
    pci(tmp_path, "0000:00:02.0", "0x8086", "0x060000")
    pci(tmp_path, "0000:65:00.0", vendor, cls)
    result = probe(tmp_path)
    assert result.devices == (("0000:65:00.0",) if found else ())
    assert result.hardware is found


def test_hardware_without_module_is_waiting_material(tmp_path: Path) -> None:
    pci(tmp_path, "0000:65:00.0", "0x10de", "0x030200")
    pci(tmp_path, "0000:17:00.0", "0x10de", "0x030200")
    result = probe(tmp_path)
    assert result == DriverProbe(("0000:17:00.0", "0000:65:00.0"), False, None)
    assert result.describe() == (
        "2 NVIDIA PCI devices (0000:17:00.0, 0000:65:00.0), nvidia module not loaded"
    )


def test_module_version_from_proc(tmp_path: Path) -> None:
    (tmp_path / "proc" / "driver" / "nvidia").mkdir(parents=True)
    (tmp_path / "proc" / "driver" / "nvidia" / "version").write_text(VERSION_LINE)
    pci(tmp_path, "0000:65:00.0", "0x10de", "0x030200")
    result = probe(tmp_path)
    assert (result.module_loaded, result.version) == (True, "550.54.15")
    assert result.describe() == "1 NVIDIA PCI device (0000:65:00.0), nvidia module 550.54.15"


def test_module_from_sys_module(tmp_path: Path) -> None:
    """A loaded module counts even where the PCI bus is hidden (some VMs, containers)."""
    (tmp_path / "sys" / "module" / "nvidia").mkdir(parents=True)
    (tmp_path / "sys" / "module" / "nvidia" / "version").write_text("535.104.05\n")
    result = probe(tmp_path)
    assert result == DriverProbe((), True, "535.104.05")
    assert result.hardware


def test_unreadable_files_are_not_nvidia(tmp_path: Path) -> None:
    device = tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:65:00.0"
    device.mkdir(parents=True)
    (device / "vendor").mkdir()  # a read fails: skipped, never raised
    assert probe(tmp_path).devices == ()


def test_a_probe_is_cheap(tmp_path: Path) -> None:
    for i in range(128):
        pci(tmp_path, f"0000:{i:02x}:00.0", "0x8086" if i % 8 else "0x10de", "0x030200")
    start = time.process_time()  # its CPU time: a loaded machine stretches the wall time
    for _ in range(10):
        assert len(probe(tmp_path).devices) == 16
    assert (time.process_time() - start) / 10 < 0.05


def test_missing_device_nodes(tmp_path: Path) -> None:
    assert missing_device_nodes(tmp_path) == []  # no module: nothing is expected
    (tmp_path / "sys" / "module" / "nvidia").mkdir(parents=True)
    assert missing_device_nodes(tmp_path) == ["nvidiactl", "nvidia[0-9]*"]
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidiactl").touch()
    (tmp_path / "dev" / "nvidia0").touch()
    assert missing_device_nodes(tmp_path) == []


def test_frontend_registered(tmp_path: Path) -> None:
    assert not frontend_registered(tmp_path)
    (tmp_path / "proc").mkdir()
    devices = "Character devices:\n  1 mem\n508 nvidia-uvm\n511 nvidia-caps\n"
    (tmp_path / "proc" / "devices").write_text(devices)
    assert not frontend_registered(tmp_path)  # uvm and caps are not the GPUs' major
    (tmp_path / "proc" / "devices").write_text(devices + "195 nvidia-frontend\n")
    assert frontend_registered(tmp_path)


@pytest.mark.parametrize("names", [("nvidia", "nvidiactl"), ("nvidia",), ("nvidiactl",)])
def test_frontend_registered_by_its_names_since_driver_550(
    tmp_path: Path, names: tuple[str, ...]
) -> None:
    """Since driver 545 (550.40) /proc/devices names major 195 "nvidia" and "nvidiactl", no
    longer "nvidia-frontend": taken for absent, a driver there from boot was one loaded
    after gpuslice started, and each controller whose NVML the sandbox refused exited 75
    to be restarted, for ever."""
    (tmp_path / "proc").mkdir()
    lines = "".join(f"195 {name}\n" for name in names)
    (tmp_path / "proc" / "devices").write_text(f"Character devices:\n  1 mem\n{lines}")
    assert frontend_registered(tmp_path)


def test_device_denied_only_on_eperm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EPERM on /dev/nvidiactl is the device cgroup saying no (root is never denied by file
    permissions with EPERM); a missing node or other errors are not."""
    assert not device_denied(tmp_path)  # no node
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidiactl").touch()
    assert not device_denied(tmp_path)

    def refuse(path: object, flags: int, mode: int = 0o777) -> int:
        raise PermissionError(errno.EPERM, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "open", refuse)
    assert device_denied(tmp_path)


def test_device_access_problems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    allow = ["char-nvidia-frontend rw", "char-nvidia-uvm rw"]
    assert device_access_problems(allow, tmp_path) == []  # no driver: nothing to check
    (tmp_path / "sys" / "module" / "nvidia").mkdir(parents=True)
    assert device_access_problems(allow, tmp_path) == [
        "/dev/nvidiactl is missing: NVML cannot start (run nvidia-modprobe, or check udev)",
        "/dev/nvidia[0-9]* is missing: NVML cannot start (run nvidia-modprobe, or check udev)",
    ]
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "devices").write_text(
        "Character devices:\n195 nvidia-frontend\n508 nvidia-uvm\n\nBlock devices:\n8 sd\n"
    )
    (tmp_path / "dev").mkdir()
    majors = {"nvidiactl": 195, "nvidia0": 195, "nvidia-uvm": 508, "sda": 8}
    for name in majors:
        (tmp_path / "dev" / name).touch()
    real_stat = os.stat

    def fake_stat(path: object, *args: object, **kwargs: object) -> object:
        name = Path(str(path)).name
        if name in majors:

            class St:
                st_rdev = os.makedev(majors[name], 0)

            return St()
        return real_stat(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", fake_stat)
    assert device_access_problems(allow, tmp_path) == []
    assert device_access_problems(["char-nvidia-frontend rw"], tmp_path) == [
        "/dev/nvidia-uvm (char-nvidia-uvm) is not in gpuslice.service's DeviceAllow=: "
        "NVML would be refused"
    ]
