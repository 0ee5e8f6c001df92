"""`gpuslice status`'s table names at most LISTED_MAX foreign processes per GPU, the largest,
and how many more and their memory: a user of the host can run thousands (gpuslice/status.py).
The JSON names the same ones, and counts the rest (`foreign_left_out`); the table of an older
controller's JSON, which named every one, is the same (tests/test_status_privacy.py)."""

from __future__ import annotations

from typing import Any

from gpuslice.annotations import Scan
from gpuslice.core.decisions import LISTED_MAX
from gpuslice.core.model import Gpu
from gpuslice.inventory import GpuUse, Sample
from gpuslice.owners import Owner
from gpuslice.status import render, snapshot_to_json
from tests.test_status import GIB, HEADER, IDLE_TAIL, MIB, free_line, snapshot

BIG = {17: 30 * GIB, 250: 20 * GIB, 499: 10 * GIB}  # their place among the 500: memory


def _status(uses: list[GpuUse], gpus: int) -> dict[str, Any]:
    named = [Gpu(i, f"GPU-{i}", "Fake 80GB", 80 * GIB, used=None) for i in range(gpus)]
    sample = Sample(named, uses)
    return snapshot_to_json(snapshot(gpus={i: [] for i in range(gpus)}), Scan(), sample)


def _line(gpu: int, pid: int, command: str, memory: str, whose: str = "") -> str:
    return f"{gpu:<4} {f'foreign: PID {pid} {command}':<40} {'':>8}  {'':<9} {memory}" + (
        f"  ({whose})" if whose else ""
    )


def _lines_of(table: str, gpu: int) -> list[str]:
    return [line for line in table.split("\n") if line.startswith((f"GPU {gpu}:", f"{gpu} "))]


def test_thousands_of_foreign_processes_are_the_largest_and_how_many_more() -> None:
    """500 on GPU 0: its lines are the GPU, (free), the 8 largest (largest first, then by
    PID), and one line for the other 492 and the memory they use; the 3 on GPU 1 are shown
    as before, each, in PID order; the JSON names the same 8 and counts the other 492."""
    uses = [
        GpuUse(1000 + i, 0, BIG.get(i, 100 * MIB), None, "worker", Owner("slurm", str(i)))
        for i in range(500)
    ]
    uses += [
        GpuUse(7, 1, 100 * MIB, None, "a"),
        GpuUse(8, 1, None, None, "b"),
        GpuUse(9, 1, 3 * GIB, None, "c"),
    ]
    data = _status(uses, 2)
    assert len(data["gpus"][0]["foreign"]) == LISTED_MAX
    assert data["gpus"][0]["foreign_left_out"] == 492
    table = render(data)
    assert _lines_of(table, 0) == [
        "GPU 0: Fake 80GB, ? / 80 GiB used",
        free_line(0),
        _line(0, 1017, "worker", "30 GiB", "Slurm job 17"),
        _line(0, 1250, "worker", "20 GiB", "Slurm job 250"),
        _line(0, 1499, "worker", "10 GiB", "Slurm job 499"),
        *(_line(0, 1000 + i, "worker", "100 MiB", f"Slurm job {i}") for i in range(5)),
        # 492 * 100 MiB = 48.05 GiB
        "0    ... and 492 more foreign processes using 48.0 GiB",
    ]
    assert len(_lines_of(table, 0)) <= LISTED_MAX + 3
    assert _lines_of(table, 1) == [
        "GPU 1: Fake 80GB, ? / 80 GiB used",
        free_line(1),
        _line(1, 7, "a", "100 MiB"),
        _line(1, 8, "b", "?"),
        _line(1, 9, "c", "3 GiB"),
    ]
    assert table.split("\n")[0] == HEADER
    assert table.split("\n")[-len(IDLE_TAIL) :] == IDLE_TAIL


def test_the_cap_is_listed_max_and_unknown_memory_goes_last() -> None:
    """Exactly LISTED_MAX on GPU 0 are all shown; one more on GPU 1 leaves one out: of those
    whose memory is unknown, the last by PID. The line says "at least" when some of the left
    out's memory is unknown, and no memory when none of it is known."""
    uses = [GpuUse(100 + i, 0, None, None, "p") for i in range(LISTED_MAX)]
    uses += [GpuUse(200 + i, 1, None if i % 2 else MIB, None, "q") for i in range(LISTED_MAX + 1)]
    uses += [GpuUse(300 + i, 2, None if i < 3 else GIB, None, "r") for i in range(LISTED_MAX + 3)]
    uses += [GpuUse(400 + i, 3, GIB if i < LISTED_MAX else None, None, "s") for i in range(10)]
    table = render(_status(uses, 4))
    assert _lines_of(table, 0)[2:] == [_line(0, 100 + i, "p", "?") for i in range(LISTED_MAX)]
    # known first (200, 202, 204, 206, 208), then unknown by PID (201, 203, 205; 207 left out)
    assert _lines_of(table, 1)[2:] == [
        *(_line(1, pid, "q", "1 MiB") for pid in (200, 202, 204, 206, 208)),
        *(_line(1, pid, "q", "?") for pid in (201, 203, 205)),
        "1    ... and 1 more foreign process",
    ]
    # 8 known (303..310), then the unknown 300, 301, 302 left out
    assert _lines_of(table, 2)[-1] == "2    ... and 3 more foreign processes"
    assert _lines_of(table, 3)[-1] == "3    ... and 2 more foreign processes"
    uses[-1] = GpuUse(409, 3, 512 * MIB, None, "s")  # one known, one unknown left out
    table = render(_status(uses, 4))
    assert _lines_of(table, 3)[-1] == "3    ... and 2 more foreign processes using at least 512 MiB"
