"""More of gpuslice.driver's promises that mutation testing showed no test held (the rest of
tests/test_driver_mutation.py's).

What an admin reads in "waiting for NVML (...)": at most four PCI addresses, then " ...",
and "nvidia module loaded" when the module gives no version. The files under the driver
root are read through a bounded reader: 256 bytes by default, 4096 of
/proc/driver/nvidia/version, 16384 of /proc/devices, and nothing past that is seen; a byte
that is no ASCII costs the line nothing but itself. The module's version is the first word
that starts with a digit and holds a dot; a line with none gives no version, not an error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.driver import DriverProbe, _read, frontend_registered, module_version

ADDRESSES = tuple(f"0000:{n:02x}:00.0" for n in range(1, 6))


@pytest.mark.parametrize(
    ("count", "shown"),
    [
        (4, "4 NVIDIA PCI devices (0000:01:00.0, 0000:02:00.0, 0000:03:00.0, 0000:04:00.0)"),
        (
            5,
            "5 NVIDIA PCI devices (0000:01:00.0, 0000:02:00.0, 0000:03:00.0, 0000:04:00.0 ...)",
        ),
    ],
)
def test_at_most_four_pci_addresses_are_shown(count: int, shown: str) -> None:
    probe = DriverProbe(ADDRESSES[:count], module_loaded=True, version=None)
    assert probe.describe() == f"{shown}, nvidia module loaded"


def test_a_file_is_read_no_further_than_its_limit(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("a" * 300)
    assert _read(path) == "a" * 256
    assert _read(path, 10) == "a" * 10


def _version_file(root: Path, text: str) -> None:
    path = root / "proc" / "driver" / "nvidia" / "version"
    path.parent.mkdir(parents=True)
    path.write_bytes(text.encode("latin-1"))


@pytest.mark.parametrize(
    ("line", "version"),
    [
        # a byte that is no ASCII (a build host's name) is one replacement character
        ("NVRM version: NVIDIA UNIX Kernel Module  550.54.15  Built on h\xf4te", "550.54.15"),
        ("NVRM version: NVIDIA UNIX Kernel Module (dvs.builder)  550.54.15", "550.54.15"),
        ("NVRM version: NVIDIA UNIX Kernel Module  9.1  Tue Mar  5", "9.1"),
        ("NVRM version: NVIDIA UNIX Kernel Module, version unknown", None),
        ("NVRM " + "x" * 300 + " 550.54.15", "550.54.15"),  # past 256 bytes, within 4096
        ("x" * 4094 + " 1.", None),  # the dot is the 4097th byte
    ],
)
def test_the_modules_version_is_its_first_dotted_number_within_4_kib(
    tmp_path: Path, line: str, version: str | None
) -> None:
    _version_file(tmp_path, line + "\n")
    assert module_version(tmp_path) == (True, version)


@pytest.mark.parametrize(("cut", "found"), [(0, False), (1, True)])
def test_proc_devices_is_read_up_to_16_kib_for_the_frontend(
    tmp_path: Path, cut: int, found: bool
) -> None:
    """The frontend's line after the first 256 bytes is seen; a letter past the first 16384
    bytes is not (here it would make the name another)."""
    head = "Character devices:\n" + "  1 mem\n" * 300
    line = "195 nvidia-frontend"
    text = head + "#" * (16382 - len(head) - len(line) + cut) + "\n" + line + "x\n"
    assert text.index("x\n") == 16384 - 1 + cut
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "devices").write_text(text)
    assert frontend_registered(tmp_path) is found
