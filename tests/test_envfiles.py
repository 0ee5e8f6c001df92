"""A granted unit's env file: what it says, replaced whole, read back only as a plain file."""

from __future__ import annotations

import errno
import os
import threading
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


def test_no_gpu_is_named_so_that_cuda_and_the_container_runtime_see_none() -> None:
    """A released unit kept active (Delivery.tell_none): CUDA sees no device with the
    variable empty, the NVIDIA container runtime none with `void` (empty or unset, some of
    its versions gave every GPU); the file is read back as naming no GPU."""
    assert envfiles.text([]) == (
        "CUDA_VISIBLE_DEVICES=\nNVIDIA_VISIBLE_DEVICES=void\nGPUSLICE_GPUS=\n"
    )


def test_a_file_naming_no_gpu_is_told_back_as_none(tmp_path: Path) -> None:
    envfiles.write(str(tmp_path), "a.service", [Gpu(0, "GPU-a")])
    envfiles.write(str(tmp_path), "a.service", [])
    assert envfiles.told_gpus(str(tmp_path), "a.service") == []
    assert envfiles.told_uuids(str(tmp_path), "a.service") == {}


def test_written_then_told_back(tmp_path: Path) -> None:
    envfiles.write(str(tmp_path), "a.service", [Gpu(0), Gpu(3)])
    assert envfiles.told_gpus(str(tmp_path), "a.service") == [0, 3]
    envfiles.write(str(tmp_path), "a.service", [Gpu(1)])  # replaced, no temporary left
    assert envfiles.told_gpus(str(tmp_path), "a.service") == [1]
    assert os.listdir(env_file(str(tmp_path), "a.service").parent) == ["gpuslice.env"]


def fill_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full /run: every write of a file's bytes fails (ENOSPC)."""

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)


def rewritten_on_a_full_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: list[Gpu], **keep_old: bool
) -> list[str]:
    """a.service's file names GPU 0; its rewrite to name `gpus` (`keep_old` passed on only
    where given: its default is under test too) fails on a full /run. Returns what its
    folder holds then."""
    envfiles.write(str(tmp_path), "a.service", [Gpu(0)])
    fill_run(monkeypatch)
    with pytest.raises(OSError):
        envfiles.write(str(tmp_path), "a.service", gpus, **keep_old)
    return os.listdir(env_file(str(tmp_path), "a.service").parent)


def test_a_file_that_cannot_be_replaced_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale file would give the unit its last grant's GPUs: gone, it sees a missing file,
    and the controller says so."""
    assert rewritten_on_a_full_run(tmp_path, monkeypatch, [Gpu(1)]) == []  # no temporary left


def test_a_file_kept_if_it_cannot_be_replaced_is_left_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`keep_old`: the file names GPUs its unit still holds (Delivery.tell_none); gone, its
    next command saw every GPU."""
    assert rewritten_on_a_full_run(tmp_path, monkeypatch, [], keep_old=True) == ["gpuslice.env"]
    assert envfiles.told_gpus(str(tmp_path), "a.service") == [0]


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
    """What a restarted controller checks its books against (Restore.remember_told): the
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


def _listed_in_a_thread(runtime_dir: str, limit: int) -> tuple[list[str], bool]:
    """envfiles.present, failing (not hanging the run) if it waits: a FIFO opened would wait
    for a writer, and the controller's start-up with it."""
    found: list[tuple[list[str], bool]] = []
    worker = threading.Thread(
        target=lambda: found.append(envfiles.present(runtime_dir, limit)), daemon=True
    )
    worker.start()
    worker.join(30)  # a pass never waits this long: a loaded machine may start it late
    assert found, "envfiles.present waited (30 s)"
    return found[0]


def test_the_units_present_are_the_real_directories_named_as_units(tmp_path: Path) -> None:
    """What a restarted controller sweeps: a directory per unit (`a@1.service`, written as the
    controller writes them, a directory left empty included). A link, FIFO or file in a
    unit's place, or a name no unit has, is not listed, so never removed, and never opened."""
    runtime_dir = str(tmp_path)
    envfiles.write(runtime_dir, "a@1.service", [Gpu(0)])
    envfiles.write(runtime_dir, "b.service", [Gpu(0)])
    env = tmp_path / "env"
    (env / "empty.service").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (env / "link@1.service").symlink_to(elsewhere)
    (env / "dangling@1.service").symlink_to(tmp_path / "nowhere")
    os.mkfifo(env / "fifo@1.service")
    (env / "file@1.service").write_text("x")
    for name in ("no-suffix", ".gpuslice.env.tmp", "a b.service", "\u00e9.service", "a.service.d"):
        (env / name).mkdir()
    os.mkdir(os.fsencode(env) + b"/\xff.service")  # not UTF-8
    assert _listed_in_a_thread(runtime_dir, 100) == (
        ["a@1.service", "b.service", "empty.service"],
        False,
    )


@pytest.mark.parametrize("kind", ["missing", "link", "fifo", "file"])
def test_no_env_directory_lists_nothing(tmp_path: Path, kind: str) -> None:
    """RUNTIME_DIR/env missing (no unit granted since boot), or not a directory: nothing
    through a link, nothing waited on."""
    elsewhere = tmp_path / "elsewhere"
    envfiles.write(str(elsewhere), "a.service", [Gpu(0)])
    env = tmp_path / "env"
    if kind == "link":
        env.symlink_to(elsewhere / "env")
    elif kind == "fifo":
        os.mkfifo(env)
    elif kind == "file":
        env.write_text("x")
    assert _listed_in_a_thread(str(tmp_path), 100) == ([], False)


def test_the_listing_stops_after_its_limit_of_entries_and_says_so(tmp_path: Path) -> None:
    """A /run filled with units' directories costs a start `limit` entries, whatever they
    are (entries not listed count too): the rest wait for the next start."""
    runtime_dir = str(tmp_path)
    jobs = [f"job@{i}.service" for i in range(5)]
    for job in jobs:
        envfiles.write(runtime_dir, job, [Gpu(0)])
    units, more = envfiles.present(runtime_dir, 3)
    assert (len(units), more) == (3, True) and set(units) <= set(jobs), units
    assert envfiles.present(runtime_dir, 4)[1] is True
    assert envfiles.present(runtime_dir, 5) == (jobs, False)  # every entry, none left
    assert envfiles.present(runtime_dir, 0) == ([], True)
    other = tmp_path / "other"
    (other / "env" / "not a unit").mkdir(parents=True)
    assert envfiles.present(str(other), 0) == ([], True)
    assert envfiles.present(str(other), 1) == ([], False)


def test_removing_says_whether_the_units_directory_went(tmp_path: Path) -> None:
    """What the start-up sweep counts: a directory that held only our file goes; one that
    holds anything else, a link, or nothing there at all, does not count."""
    runtime_dir = str(tmp_path)
    envfiles.write(runtime_dir, "a.service", [Gpu(0)])
    envfiles.write(runtime_dir, "b.service", [Gpu(0)])
    (env_file(runtime_dir, "b.service").parent / "other").write_text("x")
    (tmp_path / "env" / "c.service").symlink_to(tmp_path)
    assert envfiles.remove(runtime_dir, "a.service") is True
    assert envfiles.remove(runtime_dir, "a.service") is False
    assert envfiles.remove(runtime_dir, "b.service") is False
    assert not env_file(runtime_dir, "b.service").exists()
    assert envfiles.remove(runtime_dir, "c.service") is False
    assert (tmp_path / "env" / "c.service").is_symlink()
