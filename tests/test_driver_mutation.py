"""gpuslice.driver's promises that mutation testing showed no test held.

Which root the controller probes ($GPUSLICE_DRIVER_ROOT), how `device_denied` opens exactly
/dev/nvidiactl (non-blocking, never a controlling tty, never inherited), which /dev entries
`gpuslice check` weighs against DeviceAllow= (every one of them, not up to the first skipped),
and how /proc/devices is read (character majors only, at most 16 KiB).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gpuslice.driver import (
    ROOT_ENV,
    device_access_problems,
    device_denied,
    missing_device_nodes,
    root_from_env,
)

REFUSED = "is not in gpuslice.service's DeviceAllow=: NVML would be refused"


@pytest.mark.parametrize(
    ("value", "root"), [(None, "/"), ("", "/"), ("/srv/fake-root", "/srv/fake-root")]
)
def test_the_driver_root_comes_from_the_environment_empty_meaning_slash(
    monkeypatch: pytest.MonkeyPatch, value: str | None, root: str
) -> None:
    if value is None:
        monkeypatch.delenv(ROOT_ENV, raising=False)
    else:
        monkeypatch.setenv(ROOT_ENV, value)
    assert root_from_env() == Path(root)


def test_device_denied_opens_exactly_the_control_node_non_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only EPERM on /dev/nvidiactl itself counts, and the open is the one every NVML client
    makes first: read-only and non-blocking (a probe must never hang the controller), no
    controlling tty, close-on-exec (no child inherits it)."""
    opened: list[tuple[str, int]] = []

    def refuse_nvidiactl(path: object, flags: int, mode: int = 0o777) -> int:
        opened.append((str(path), flags))
        if str(path) == str(tmp_path / "dev" / "nvidiactl"):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))

    monkeypatch.setattr(os, "open", refuse_nvidiactl)
    assert device_denied(tmp_path)
    assert opened == [
        (
            str(tmp_path / "dev" / "nvidiactl"),
            os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY,
        )
    ]


def test_a_control_node_without_any_gpu_node_is_missing_the_gpu_nodes(tmp_path: Path) -> None:
    """nvidiactl and the uvm nodes are not GPU nodes: only nvidia<digits> are."""
    (tmp_path / "sys" / "module" / "nvidia").mkdir(parents=True)
    (tmp_path / "dev").mkdir()
    for name in ("nvidiactl", "nvidia-uvm", "hidraw0"):
        (tmp_path / "dev" / name).touch()
    assert missing_device_nodes(tmp_path) == ["nvidia[0-9]*"]


def _host(root: Path, devices: str, nodes: dict[str, int | None]) -> None:
    """A host with the nvidia module, /proc/devices, and /dev nodes of the given majors (None:
    the node vanished between listing and stat)."""
    (root / "sys" / "module" / "nvidia").mkdir(parents=True)
    (root / "proc").mkdir()
    (root / "proc" / "devices").write_text(devices)
    (root / "dev").mkdir()
    for name in nodes:
        (root / "dev" / name).touch()


@pytest.fixture
def majors(monkeypatch: pytest.MonkeyPatch) -> dict[str, int | None]:
    """Device numbers for fake /dev nodes (regular files here): name -> major."""
    table: dict[str, int | None] = {}
    real_stat = os.stat

    class St:
        def __init__(self, major: int) -> None:
            self.st_rdev = os.makedev(major, 0)

    def fake_stat(path: object, *args: object, **kwargs: object) -> object:
        name = Path(str(path)).name
        if name not in table:
            return real_stat(path)  # type: ignore[arg-type]
        major = table[name]
        if major is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        return St(major)

    monkeypatch.setattr(os, "stat", fake_stat)
    return table


def test_every_nvidia_node_is_weighed_whatever_comes_before_it(
    tmp_path: Path, majors: dict[str, int | None]
) -> None:
    """Each node is checked on its own: one that is not an NVIDIA node (fuse, hidraw0, a
    nvidia-modeset node NVML does not open), one that vanished, or one that is allowed never
    ends the check of those after it; a block device sharing a major is not the char one."""
    majors.update(
        {
            "fuse": 10,
            "hidraw0": 240,
            "nvidia-modeset": 195,
            "nvidia-uvm": 508,
            "nvidia-uvm-tools": None,
            "nvidia0": 195,
            "nvidia1": 511,
            "nvidia2": 195,
            "nvidiactl": 195,
        }
    )
    _host(
        tmp_path,
        "Character devices:\n  1 mem\n 10 misc\n195 nvidia-frontend\n240 hidraw\n"
        "508 nvidia-uvm\n\nBlock devices:\n195 blk\n508 blk\n",
        majors,
    )
    allow = ["char-nvidia-uvm rw", "/dev/nvidia0 rw", "/dev/nvidiactl rw"]
    assert device_access_problems(allow, tmp_path) == [
        f"/dev/nvidia1 (char-511) {REFUSED}",
        f"/dev/nvidia2 (char-nvidia-frontend) {REFUSED}",
    ]
    assert device_access_problems([*allow, "char-nvidia-frontend rw"], tmp_path) == [
        f"/dev/nvidia1 (char-511) {REFUSED}"
    ]


@pytest.mark.parametrize(("cut", "group"), [(0, "nvidia-uv"), (1, "nvidia-uvm")])
def test_proc_devices_is_read_up_to_16_kib(
    tmp_path: Path, majors: dict[str, int | None], cut: int, group: str
) -> None:
    """/proc/devices is read through a bounded reader: what lies past its first 16384 bytes
    is not seen (here, the last letter of a major's name)."""
    majors.update({"nvidia-uvm": 508, "nvidia0": 195, "nvidiactl": 195})
    head = "Character devices:\n" + "  1 mem\n" * 300  # far past the 256 bytes read by default
    line = "508 nvidia-uvm"
    padding = 16384 - len(head) - len(line) + 1 - cut
    text = head + "# " + "x" * (padding - 3) + "\n" + line + "\n"
    assert text.index("nvidia-uvm") + len("nvidia-uv") == 16384 - cut
    _host(tmp_path, text, majors)
    expected = [] if group == "nvidia-uvm" else [f"/dev/nvidia-uvm (char-{group}) {REFUSED}"]
    allow = ["char-nvidia-uvm rw", "/dev/nvidia0 rw", "/dev/nvidiactl rw"]
    assert device_access_problems(allow, tmp_path) == expected


UNIT = Path(__file__).resolve().parent.parent / "units" / "gpuslice.service"
NODES_550 = {"nvidiactl": 195, "nvidia0": 195, "nvidia1": 195, "nvidia-uvm": 508}


def _unit_device_allow() -> list[str]:
    """gpuslice.service's DeviceAllow= entries, as `systemctl show -P DeviceAllow` lists them."""
    prefix = "DeviceAllow="
    return [
        line[len(prefix) :] for line in UNIT.read_text().splitlines() if line.startswith(prefix)
    ]


@pytest.mark.parametrize(
    "devices",
    [
        "195 nvidia-frontend\n508 nvidia-uvm\n",  # drivers before 545
        "195 nvidia\n195 nvidiactl\n508 nvidia-uvm\n",  # 545 (550.40) and later
    ],
)
def test_the_units_sandbox_lets_nvml_open_the_gpus_of_old_and_new_drivers(
    tmp_path: Path, majors: dict[str, int | None], devices: str
) -> None:
    """Since driver 545 (550.40) /proc/devices names major 195 "nvidia" and "nvidiactl":
    `DeviceAllow=char-nvidia-frontend` alone allowed nothing there, so the controller's
    NVML was refused on every current driver."""
    majors.update(NODES_550)
    _host(tmp_path, f"Character devices:\n  1 mem\n{devices}\nBlock devices:\n8 sd\n", majors)
    assert device_access_problems(_unit_device_allow(), tmp_path) == []


def test_a_major_of_several_names_is_allowed_by_any_and_by_globs(
    tmp_path: Path, majors: dict[str, int | None]
) -> None:
    """systemd allows a major whose name, any of them, a `char-` entry matches as a glob; the
    check said "refused" for a major allowed by its other name, or by `char-nvidia*`."""
    majors.update(NODES_550)
    _host(tmp_path, "Character devices:\n195 nvidia\n195 nvidiactl\n508 nvidia-uvm\n", majors)
    assert device_access_problems(["char-nvidia rw", "char-nvidia-uvm rw"], tmp_path) == []
    assert device_access_problems(["char-nvidia* rw"], tmp_path) == []
    old_unit = ["char-nvidia-frontend rw", "char-nvidia-uvm rw"]
    assert device_access_problems(old_unit, tmp_path) == [
        f"/dev/{node} (char-nvidiactl) {REFUSED}" for node in ("nvidia0", "nvidia1", "nvidiactl")
    ]
