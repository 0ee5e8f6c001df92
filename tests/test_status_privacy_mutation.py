"""The redacted Status answer's edges (mutation run of the code that hides what /proc hides,
tests/test_status_privacy.py): what the controller tells the admin when /proc's mount
changes, and the caller it could not name; which state a redacted answer's status_time
says; a caller's credentials at their bound and of a value not of its type; owners of
kind `other` and of a kind this version does not know, in the table and the metrics; the
cache's bounds (a build that took exactly SLOW_BUILD, a slow build at its deadline, a clock
near its zero) and the table's age line at exactly STALE_SAID."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from dbus_next import Variant

from gpuslice import procmount, status
from gpuslice.annotations import Scan
from gpuslice.core.model import Gpu
from gpuslice.inventory import GpuUse, Sample
from gpuslice.metrics import exposition
from gpuslice.owners import Owner, kind_said
from gpuslice.status import (
    REBUILD_FACTOR,
    SLOW_BUILD,
    STALE_SAID,
    CachedStatus,
    render,
    snapshot_to_json,
)
from gpuslice.systemd import _GROUPS_MAX, SystemdError, credentials_of
from tests.test_controller import run
from tests.test_status import snapshot
from tests.test_status_privacy import _answer, _foreign_bed, mountinfo, proc_line

GIB = 1 << 30

# ---------------------------------------------------------------------------------------------
# the controller: what it says, and which state an answer shows


def _proc_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "gpuslice" and r.getMessage().startswith("/proc")
    ]


def test_the_admin_is_told_when_proc_starts_or_stops_hiding_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """At start and at each reload that finds /proc's mount changed, one info line says who
    sees other users' processes in Status now (the group only where gid= names one);
    nothing when it hides as before, or still hides nothing."""
    bed = _foreign_bed(tmp_path, monkeypatch, "rw,hidepid=invisible,gid=27")
    hides = "/proc hides other users' processes ({}): Status shows them only to callers that are "

    async def test() -> None:
        ctl = bed.controller
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await ctl.start()
            assert _proc_lines(caplog) == [
                (logging.INFO, hides.format("hidepid=invisible,gid=27") + "root, or of group 27")
            ]
            caplog.clear()
            ctl.reload_config()  # the same mount: nothing said
            assert _proc_lines(caplog) == []
            for options, said in [
                ("rw,hidepid=2", [hides.format("hidepid=2") + "root"]),
                ("rw,hidepid=2", []),
                ("rw", ["/proc no longer hides other users' processes: Status shows them all"]),
                ("rw,hidepid=0", []),  # another mount that hides nothing: nothing to say
                ("rw,subset=pid,gid=5", []),  # it hides /proc's other files, no process
                ("rw,hidepid=2,gid=5", [hides.format("hidepid=2,gid=5") + "root, or of group 5"]),
            ]:
                caplog.clear()
                procmount.MOUNTINFO.write_text(mountinfo(proc_line(options)))
                ctl.reload_config()
                assert _proc_lines(caplog) == [(logging.INFO, line) for line in said], options

    run(test)


def test_a_caller_the_bus_daemon_did_not_name_is_said_at_debug_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Why a caller got the redacted answer: its bus name and the bus daemon's error."""
    bed = _foreign_bed(tmp_path, monkeypatch, "rw,hidepid=2")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            assert (await _answer(ctl, ":1.9"))["redacted"] is True
        error = SystemdError("org.freedesktop.DBus.Error.NameHasNoOwner", ":1.9")
        said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "gpuslice"]
        assert said == [
            (logging.DEBUG, f"Status from :1.9, whom the bus daemon did not name: {error}")
        ]

    run(test)


def test_a_redacted_answer_says_the_time_of_the_state_it_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each cached text has its own time: a redacted answer built now says now, though the
    full one was last built long ago."""
    bed = _foreign_bed(tmp_path, monkeypatch, "rw,hidepid=2")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.status_json()
        ctl.answers.changed()  # the full text not built since: its state is of its build
        ctl.answers._status.built = 1000.0
        before = time.time()
        data = await _answer(ctl, ":1.1")
        assert data["redacted"] is True
        assert before <= data["controller"]["status_time"] <= time.time()

    run(test)


# ---------------------------------------------------------------------------------------------
# a caller's credentials


def test_a_caller_with_as_many_groups_as_the_bound_keeps_them() -> None:
    """_GROUPS_MAX groups are read; one more, and none are."""
    at = {"UnixUserID": Variant("u", 7), "UnixGroupIDs": Variant("au", list(range(_GROUPS_MAX)))}
    assert credentials_of(at) == (7, frozenset(range(_GROUPS_MAX)))
    past = {
        "UnixUserID": Variant("u", 7),
        "UnixGroupIDs": Variant("au", list(range(_GROUPS_MAX + 1))),
    }
    assert credentials_of(past) == (7, frozenset())


def test_a_uid_whose_value_is_not_an_integer_is_no_uid() -> None:
    """The variant's value is checked, not only its signature: `"0"` is not root."""
    uid = Variant("u", 1000)
    uid.value = "0"
    assert credentials_of({"UnixUserID": uid}) == (None, frozenset())


# ---------------------------------------------------------------------------------------------
# owners of kind other, and of a kind unknown here


def test_an_owner_of_an_unknown_kind_is_said_as_other() -> None:
    """A newer controller's kind, or junk: `other owner`, as `other` itself."""
    assert kind_said("fpga") == kind_said("other") == "other owner"
    assert kind_said("slurm") == "Slurm job"


def test_the_table_says_no_owner_for_a_redacted_process_of_kind_other() -> None:
    """A process of no known owner: its memory only (as in the full table); one of a kind
    this version does not know (a newer controller's): `other owner`."""
    uses = [
        GpuUse(50, 0, GIB, None, "x", None),
        GpuUse(51, 0, 2 * GIB, None, "y", Owner("slurm", "9")),
    ]
    sample = Sample([Gpu(0, "GPU-0", "Fake 24GB", 24 * GIB)], uses)
    data = snapshot_to_json(snapshot(gpus={0: []}), Scan(), sample, redact=True)
    data["gpus"][0]["foreign"].append(
        {"pid": None, "command": None, "memory": 3 * GIB, "owner": {"kind": "fpga", "id": None}}
    )
    hidden = f"0    {'foreign: ' + status.HIDDEN:<40} {'':>8}  {'':<9} "
    assert [line for line in render(data).split("\n") if line.startswith("0    foreign")] == [
        hidden + "1 GiB",
        hidden + "2 GiB  (Slurm job)",
        hidden + "3 GiB  (other owner)",
    ]


def test_metrics_of_the_left_out_count_each_kind_from_nothing_and_unknown_kinds_as_other() -> None:
    """`foreign_left_out_by_kind` of kinds not listed: each its own bytes; a kind this
    version does not know is `other` (the label keeps its few values); a value that is no
    number, or 0, adds nothing."""
    sample = Sample([Gpu(0, "GPU-0", "Fake 80GB", 80 * GIB)], [])
    data = snapshot_to_json(snapshot(gpus={0: []}), Scan(), sample)
    data["controller"] = {"version": "1", "start_time": 0.0, "status_time": 0.0}
    data["gpus"][0]["foreign_left_out_by_kind"] = {
        "docker": 3 * GIB,
        "fpga": GIB,
        "podman": 0,
        "slurm": "x",
        "machine": None,
    }
    values: dict[str, float] = {}
    for line in exposition(data).decode().splitlines():
        if line.startswith("gpuslice_gpu_foreign_memory_bytes{"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    where = 'gpu="0",owner="{}",uuid="GPU-0"'
    assert values == {
        "gpuslice_gpu_foreign_memory_bytes{" + where.format(kind) + "}": memory
        for kind, memory in [
            ("docker", 3 * GIB),
            ("machine", 0.0),
            ("other", GIB),
            ("podman", 0.0),
            ("slurm", 0.0),
        ]
    }


# ---------------------------------------------------------------------------------------------
# the cache's bounds, and the table's age line


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _cached(
    monkeypatch: pytest.MonkeyPatch, cost: float, start: float = 100.0
) -> tuple[CachedStatus[str], list[int], _Clock]:
    """A CachedStatus whose builds take `cost` of the loop's CPU (its clock from 0, so that
    the cost is exactly `cost`), the monotonic clock from `start`."""
    clock, cpu = _Clock(start), _Clock(0.0)
    monkeypatch.setattr(time, "monotonic", clock)  # only CachedStatus runs meanwhile
    monkeypatch.setattr(time, "thread_time", cpu)
    builds: list[int] = []

    def build() -> str:
        builds.append(len(builds))
        clock.now += cost
        cpu.now += cost
        return f"{{{len(builds)}}}"

    return CachedStatus(build), builds, clock


def test_a_build_that_took_exactly_slow_build_is_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    cached, builds, _ = _cached(monkeypatch, SLOW_BUILD)
    assert cached.text() == "{1}"
    cached.changed()
    assert cached.text() == "{2}" and len(builds) == 2


def test_a_fast_build_is_of_the_moment_whatever_the_clock_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The monotonic clock's zero is arbitrary (boot, on Linux): near it too."""
    cached, builds, _ = _cached(monkeypatch, SLOW_BUILD / 4, start=0.0)
    assert cached.text() == "{1}"
    cached.changed()
    assert cached.text() == "{2}" and len(builds) == 2


def test_a_slow_build_is_built_again_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reused before start + REBUILD_FACTOR times its cost; at that moment, built again."""
    cached, builds, clock = _cached(monkeypatch, 0.25)
    assert cached.text() == "{1}"
    cached.changed()
    clock.now = 100.0 + 0.25 * REBUILD_FACTOR - 0.125
    assert cached.text() == "{1}"
    clock.now = 100.0 + 0.25 * REBUILD_FACTOR
    assert cached.text() == "{2}" and len(builds) == 2


def test_render_says_the_age_of_a_state_exactly_stale_said_behind() -> None:
    data = snapshot_to_json(snapshot(gpus={0: []}), Scan(), Sample([Gpu(0)]))
    data["controller"] = {"version": "1", "start_time": 0.0, "status_time": 1000.0}
    lines = render(data, now=1000.0 + STALE_SAID).split("\n")
    assert lines[0] == "As of 2 s ago (a large status is built less often)"
