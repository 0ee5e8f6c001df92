"""A granted unit's env file: what it says, replaced whole, read back only as a plain file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuslice import envfiles
from gpuslice.core.model import Gpu
from gpuslice.paths import env_file


def test_with_uuids_every_name_of_the_gpus_is_given() -> None:
    gpus = [Gpu(0, "GPU-a"), Gpu(2, "GPU-c")]
    assert envfiles.text(gpus) == (
        "CUDA_VISIBLE_DEVICES=GPU-a,GPU-c\nCUDA_DEVICE_ORDER=PCI_BUS_ID\n"
        "NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-c\nGPUSLICE_GPUS=0,2\n"
    )


def test_without_uuids_cuda_is_told_nvmls_order() -> None:
    assert envfiles.text([Gpu(1)]) == (
        "CUDA_VISIBLE_DEVICES=1\nCUDA_DEVICE_ORDER=PCI_BUS_ID\nGPUSLICE_GPUS=1\n"
    )


def test_written_then_told_back(tmp_path: Path) -> None:
    envfiles.write(str(tmp_path), "a.service", [Gpu(0), Gpu(3)])
    assert envfiles.told_gpus(str(tmp_path), "a.service") == [0, 3]
    envfiles.write(str(tmp_path), "a.service", [Gpu(1)])  # replaced, no temporary left
    assert envfiles.told_gpus(str(tmp_path), "a.service") == [1]
    assert os.listdir(env_file(str(tmp_path), "a.service").parent) == ["gpuslice.env"]


def test_a_file_that_cannot_be_replaced_is_removed(tmp_path: Path) -> None:
    """A stale file would give the unit its last grant's GPUs: gone, it sees a missing file,
    and the controller says so."""
    envfiles.write(str(tmp_path), "a.service", [Gpu(0)])
    env_file(str(tmp_path), "a.service").with_name(".gpuslice.env.tmp").mkdir()  # in the way
    with pytest.raises(OSError):
        envfiles.write(str(tmp_path), "a.service", [Gpu(1)])
    assert not env_file(str(tmp_path), "a.service").exists()


@pytest.mark.parametrize(
    "kind",
    ["missing", "link", "fifo", "directory", "no line", "garbage", "part", "huge", "line, huge"],
)
def test_only_a_plain_file_of_ours_is_told_back(tmp_path: Path, kind: str) -> None:
    path = env_file(str(tmp_path), "a.service")
    path.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("GPUSLICE_GPUS=3\n")
    if kind == "link":
        path.symlink_to(elsewhere)
    elif kind == "fifo":
        os.mkfifo(path)  # never waited on
    elif kind == "directory":
        path.mkdir()
    elif kind == "no line":
        path.write_text("CUDA_VISIBLE_DEVICES=3\n")
    elif kind == "garbage":
        path.write_text("GPUSLICE_GPUS=x,-1,\u0663,\n")
    elif kind == "part":  # one index then garbage: not a file of ours, no part of it taken
        path.write_text("GPUSLICE_GPUS=1,2=\n")
    elif kind == "huge":
        path.write_text("#" * envfiles.MAX_BYTES + "\nGPUSLICE_GPUS=3\n")
    elif kind == "line, huge":  # larger than any file of ours: not one, whatever it begins with
        path.write_text("GPUSLICE_GPUS=3\n" + "#" * envfiles.MAX_BYTES)
    assert envfiles.told_gpus(str(tmp_path), "a.service") == []


def test_the_uuids_told_are_read_back_by_index(tmp_path: Path) -> None:
    """What a restarted controller checks its books against (Controller._remember_told): the
    GPU each index a unit holds named when it was granted. A file without UUIDs (written
    before NVML answered) or not of ours tells none."""
    envfiles.write(str(tmp_path), "a.service", [Gpu(0, "GPU-a"), Gpu(2, "GPU-c")])
    assert envfiles.told_uuids(str(tmp_path), "a.service") == {0: "GPU-a", 2: "GPU-c"}
    envfiles.write(str(tmp_path), "a.service", [Gpu(1)])
    assert envfiles.told_uuids(str(tmp_path), "a.service") == {}
    path = env_file(str(tmp_path), "a.service")
    for text in (
        "NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b\nGPUSLICE_GPUS=0\n",  # not one UUID per index
        "NVIDIA_VISIBLE_DEVICES=GPU-a\x1b[2J\nGPUSLICE_GPUS=0\n",  # no UUID
        "NVIDIA_VISIBLE_DEVICES=1\nGPUSLICE_GPUS=1\n",
        "NVIDIA_VISIBLE_DEVICES=GPU-a\nGPUSLICE_GPUS=x\n",
    ):
        path.write_text(text)
        assert envfiles.told_uuids(str(tmp_path), "a.service") == {}


def test_a_key_is_told_by_its_first_line_up_to_its_first_equals_sign(tmp_path: Path) -> None:
    """As systemd reads the file, a value runs from the first `=` to the end of the line: a
    first GPUSLICE_GPUS= or NVIDIA_VISIBLE_DEVICES= whose value holds one is no file of ours,
    and a later line of the same key does not stand in for it (read from the last `=`, the
    first line was no key at all, and the second one's GPUs were taken)."""
    path = env_file(str(tmp_path), "a.service")
    path.parent.mkdir(parents=True)
    path.write_text("NVIDIA_VISIBLE_DEVICES=GPU-a\nGPUSLICE_GPUS=0=1\nGPUSLICE_GPUS=1\n")
    assert envfiles.told_gpus(str(tmp_path), "a.service") == []
    assert envfiles.told_uuids(str(tmp_path), "a.service") == {}
    path.write_text(
        "NVIDIA_VISIBLE_DEVICES=GPU-a=b\nNVIDIA_VISIBLE_DEVICES=GPU-b\nGPUSLICE_GPUS=0\n"
    )
    assert envfiles.told_gpus(str(tmp_path), "a.service") == [0]
    assert envfiles.told_uuids(str(tmp_path), "a.service") == {}
