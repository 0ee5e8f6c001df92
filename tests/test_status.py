"""`gpuslice status`: the snapshot as JSON (a documented interface) and as a table, word for
word and column for column (gpuslice/status.py)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from gpuslice import clock as clock_module
from gpuslice.annotations import Problem, Scan
from gpuslice.clock import STEP_SEEN
from gpuslice.core.decisions import Blocker, Cause, Code, Decision, Part
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import Snapshot
from gpuslice.inventory import GpuUse, Health, Sample
from gpuslice.owners import Owner
from gpuslice.status import (
    REBUILD_FACTOR,
    SLOW_BUILD,
    STALE_SAID,
    CachedStatus,
    FullStatus,
    _duration,
    _gpu_line,
    _holder_memory,
    _owner_label,
    problems_json,
    render,
    snapshot_to_json,
)

GIB = 1 << 30
MIB = 1 << 20

HEADER = "GPU  UNIT                                     PRIORITY  STATE     MEMORY"
IDLE_TAIL = [
    "",
    "Waiting:",
    "  -",
    "Suspended: -",
    "Preempted: -",
    "Held (stopped by hand): -",
    "Finished: -",
    "Failed: -",
]


# A GPU's counts of the foreign processes its "foreign" list leaves out: none
NONE_LEFT_OUT = {
    "foreign_left_out": 0,
    "foreign_left_out_memory": 0,
    "foreign_left_out_unknown": 0,
    "foreign_left_out_by_kind": {},
}


def free_line(index: int) -> str:
    """A GPU nobody holds: the index in 4 columns, `(free)` in 40, an empty PRIORITY of 8."""
    return f"{index}    (free)" + " " * 43


def snapshot(**fields: Any) -> Snapshot:
    """A snapshot with nothing in it but `fields`."""
    empty: dict[str, Any] = {
        "gpus": {},
        "waiting": [],
        "suspended": [],
        "preempted": [],
        "held": [],
        "finished": [],
        "failed": [],
    }
    return Snapshot(**(empty | fields))


def empty_data(**fields: Any) -> dict[str, Any]:
    """The JSON of a host with no GPUs and nothing in it, as an older controller wrote it."""
    data: dict[str, Any] = {
        "gpus": [],
        "waiting": [],
        "suspended": [],
        "preempted": [],
        "held": [],
        "finished": [],
        "failed": [],
    }
    return data | fields


# ---------------------------------------------------------------------------------------------
# snapshot_to_json: every key of the documented interface


def test_json_of_an_idle_host_without_nvml() -> None:
    """Without NVML only the index is known, and there is no "nvml" key at all."""
    data = snapshot_to_json(snapshot(gpus={0: []}), Scan(), Sample([Gpu(0)]))
    assert data == {
        "version": 1,
        "gpus": [
            {
                "index": 0,
                "uuid": None,
                "name": None,
                "memory_total": None,
                "memory_reserved": 0,
                "memory_used": None,
                "lost": False,
                "renumbered": False,
                "holders": [],
                "foreign": [],
                **NONE_LEFT_OUT,
            }
        ],
        "waiting": [],
        "suspended": [],
        "preempted": [],
        "held": [],
        "finished": [],
        "remained": [],
        "failed": [],
        "priorities": {},
        "problems": [],
    }


WAIT_A = Decision(
    Code.WAIT,
    "a.service",
    20,
    cause=Cause.BUSY,
    parts=(Part(Blocker.HELD, (0,), "voice.service", 10),),
)
WAIT_C = Decision(Code.WAIT, "c.service", 5, cause=Cause.PAUSED, detail="driver not ready")
PROBLEM = Problem("/etc/systemd/system/bad.service", 3, "Priority", "not a number")


def rich_json() -> dict[str, Any]:
    """Two named GPUs with holders in every state, a lost GPU, one the sample does not know,
    waiters, preempted, held, finished and failed units, a problem and NVML's health."""
    specs = [
        UnitSpec("voice.service", 10, memory=10 * GIB),
        UnitSpec("train.service", 40, gpus=2),  # the whole GPU
        UnitSpec("small.service", 30, memory=512 * MIB),
        UnitSpec("h1.service", 5),
        UnitSpec("f.service", 7),
        UnitSpec("x@.service", 9),  # instances get their template's priority
    ]
    snap = snapshot(
        gpus={
            1: [("train.service", 40, "stopping"), ("small.service", 30, "starting")],
            0: [("voice.service", 10, "running"), ("train.service", 40, "stopping")],
            2: [],
            5: [],
        },
        waiting=[
            ("a.service", 20, "waiting: a"),
            ("b.service", 30, "waiting: b"),
            ("c.service", 5, "waiting: c"),
        ],
        preempted=[("p.service", 3, True), ("q.service", 4, False)],
        held=["h1.service", "nobody.service"],  # the second is no longer annotated
        finished=["f.service"],
        failed=["x@1.service"],
        reasons={"a.service": WAIT_A, "c.service": WAIT_C},
    )
    sample = Sample(
        # not in index order, so that only the GPU with the right index is taken
        [
            Gpu(2, "GPU-2", "Lost 40GB", 40 * GIB, lost=True),
            Gpu(1, "GPU-1", "Fake 80GB", 80 * GIB, 0, used=None),
            Gpu(0, "GPU-0", "Fake 24GB", 24 * GIB, 2 * GIB, used=13 * GIB),
        ],
        [
            GpuUse(10, 0, 11 * GIB, "voice.service", "python3"),
            GpuUse(20, 0, 3 * GIB, "train.service", "train"),
            GpuUse(21, 1, 5 * GIB, "train.service", "train"),
            GpuUse(22, 1, None, "train.service", "train"),
            GpuUse(23, 1, 1 * GIB, "train.service", "train"),
            GpuUse(77, 0, 2 * GIB, None, "Xorg", Owner("unit", "gdm.service"), compute=False),
            GpuUse(78, 1, None, None, "python3", Owner("slurm", "881")),
            GpuUse(79, 1, 300 * MIB, None, "nvtop"),
        ],
        health=Health("ready", 1700000000.12345, "NVML answers", "550.54"),
    )
    scan = Scan(specs={s.name: s for s in specs}, problems=[PROBLEM, PROBLEM])
    since = {"a.service": 1700000000.5, "c.service": 1699805000.0, "nobody.service": 1.0}
    return snapshot_to_json(snap, scan, sample, since)


def test_json_of_a_busy_host() -> None:
    """Each GPU's holders with their declared and used memory, its foreign processes (not
    those of units), waiters in queue order with since and decision, priorities of annotated
    units only, problems as text, NVML's health."""
    assert rich_json() == {
        "version": 1,
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-0",
                "name": "Fake 24GB",
                "memory_total": 24 * GIB,
                "memory_reserved": 2 * GIB,
                "memory_used": 13 * GIB,
                "lost": False,
                "renumbered": False,
                "holders": [
                    {
                        "unit": "voice.service",
                        "priority": 10,
                        "state": "running",
                        "memory_declared": 10 * GIB,
                        "memory_used": 11 * GIB,
                        "reason": None,
                        "since": None,
                    },
                    {
                        "unit": "train.service",
                        "priority": 40,
                        "state": "stopping",
                        "memory_declared": None,
                        "memory_used": 3 * GIB,
                        "reason": None,
                        "since": None,
                    },
                ],
                "foreign": [
                    {
                        "pid": 77,
                        "command": "Xorg",
                        "memory": 2 * GIB,
                        "owner": {"kind": "unit", "id": "gdm.service"},
                        "compute": False,
                    }
                ],
                **NONE_LEFT_OUT,
            },
            {
                "index": 1,
                "uuid": "GPU-1",
                "name": "Fake 80GB",
                "memory_total": 80 * GIB,
                "memory_reserved": 0,
                "memory_used": None,
                "lost": False,
                "renumbered": False,
                "holders": [
                    {
                        "unit": "train.service",
                        "priority": 40,
                        "state": "stopping",
                        "memory_declared": None,
                        "memory_used": 6 * GIB,
                        "reason": None,
                        "since": None,
                    },
                    {
                        "unit": "small.service",
                        "priority": 30,
                        "state": "starting",
                        "memory_declared": 512 * MIB,
                        "memory_used": None,
                        "reason": None,
                        "since": None,
                    },
                ],
                "foreign": [
                    {
                        "pid": 78,
                        "command": "python3",
                        "memory": None,
                        "owner": {"kind": "slurm", "id": "881"},
                        "compute": True,
                    },
                    {
                        "pid": 79,
                        "command": "nvtop",
                        "memory": 300 * MIB,
                        "owner": {"kind": "other", "id": ""},
                        "compute": True,
                    },
                ],
                **NONE_LEFT_OUT,
            },
            {
                "index": 2,
                "uuid": "GPU-2",
                "name": "Lost 40GB",
                "memory_total": 40 * GIB,
                "memory_reserved": 0,
                "memory_used": None,
                "lost": True,
                "renumbered": False,
                "holders": [],
                "foreign": [],
                **NONE_LEFT_OUT,
            },
            {
                "index": 5,
                "uuid": None,
                "name": None,
                "memory_total": None,
                "memory_reserved": 0,
                "memory_used": None,
                "lost": False,
                "renumbered": False,
                "holders": [],
                "foreign": [],
                **NONE_LEFT_OUT,
            },
        ],
        "waiting": [
            {
                "unit": "a.service",
                "priority": 20,
                "reason": "waiting: a",
                "position": 1,
                "since": 1700000000.5,
                "decision": WAIT_A.to_json(),
            },
            {
                "unit": "b.service",
                "priority": 30,
                "reason": "waiting: b",
                "position": 2,
                "since": None,
                "decision": None,
            },
            {
                "unit": "c.service",
                "priority": 5,
                "reason": "waiting: c",
                "position": 3,
                "since": 1699805000.0,
                "decision": WAIT_C.to_json(),
            },
        ],
        "suspended": [],
        "preempted": [
            {"unit": "p.service", "priority": 3, "requeue": True},
            {"unit": "q.service", "priority": 4, "requeue": False},
        ],
        "held": ["h1.service", "nobody.service"],
        "finished": ["f.service"],
        "remained": [],
        "failed": ["x@1.service"],
        "priorities": {"h1.service": 5, "f.service": 7, "x@1.service": 9},
        "problems": [
            "/etc/systemd/system/bad.service:3: [X-GPUSlice] Priority: not a number",
            "/etc/systemd/system/bad.service:3: [X-GPUSlice] Priority: not a number",
        ],
        "nvml": {
            "state": "ready",
            "since": 1700000000.123,
            "detail": "NVML answers",
            "driver_version": "550.54",
        },
    }


def test_json_decisions_are_the_reasons_as_data() -> None:
    """The decision of a waiter is its Decision's JSON: the parts, the cause, the detail."""
    waiting = rich_json()["waiting"]
    assert waiting[0]["decision"]["parts"] == [
        {
            "kind": "held",
            "gpus": [0],
            "unit": "voice.service",
            "priority": 10,
            "free": None,
            "refused": False,
            "granted_after": False,
            "overdue": None,
            "rung": None,
            "others": 0,
            "beyond": 0,
            "owners": [],
            "owners_left_out": 0,
        }
    ]
    assert (waiting[2]["decision"]["cause"], waiting[2]["decision"]["detail"]) == (
        "paused",
        "driver not ready",
    )


@pytest.mark.parametrize("since", [None, {}])
def test_json_waiters_without_since(since: dict[str, float] | None) -> None:
    """Without (or with an empty) mapping, every waiter's `since` is null."""
    snap = snapshot(gpus={0: []}, waiting=[("a.service", 1, "r1"), ("b.service", 2, "r2")])
    waiting = snapshot_to_json(snap, Scan(), Sample([Gpu(0)]), since)["waiting"]
    assert waiting == [
        {
            "unit": "a.service",
            "priority": 1,
            "reason": "r1",
            "position": 1,
            "since": None,
            "decision": None,
        },
        {
            "unit": "b.service",
            "priority": 2,
            "reason": "r2",
            "position": 2,
            "since": None,
            "decision": None,
        },
    ]


# a problem that quotes root's environment file (gpuslice/envsafety.py)
SECRET = Problem(
    "/etc/systemd/system/w.service",
    5,
    "EnvironmentFile",
    "TOKEN=s3cret (set in /etc/job/x.env): ...",
    unit="w.service",
    section="Service",
    public_message="TOKEN=... (set in /etc/job/x.env; its value is shown to root alone)",
)


def test_the_public_text_is_roots_but_for_the_problems() -> None:
    """Anyone but root reads root's text, byte for byte, with the problems as it may read
    them: the same stable JSON (keys sorted at every level), not the snapshot's own order;
    one text, the same object, where no problem withholds anything."""
    snap = snapshot(gpus={0: [("a.service", 10, "running")]}, waiting=[("b.service", 1, "r")])
    scan = Scan(problems=[PROBLEM, SECRET])
    data = snapshot_to_json(snap, scan, Sample([Gpu(0, "GPU-0", "Fake", 24 * GIB)]))
    public = problems_json(scan, public=True)
    full = FullStatus(data, public)
    assert full.withholds
    assert full.text == json.dumps(data, sort_keys=True)
    assert full.public == full.text.replace(json.dumps(data["problems"]), json.dumps(public))
    assert "s3cret" in full.text and "s3cret" not in full.public
    plain = FullStatus(data, data["problems"] + [])  # equal, not the same list
    assert not plain.withholds and plain.public is plain.text


# ---------------------------------------------------------------------------------------------
# render: the table, column for column


def test_render_an_idle_host_without_nvml() -> None:
    """One free GPU, every list "-", no NVML headline and no problems block."""
    data = snapshot_to_json(snapshot(gpus={0: []}), Scan(), Sample([Gpu(0)]))
    assert render(data) == "\n".join([HEADER, free_line(0), *IDLE_TAIL])
    assert render(data, now=1e9) == render(data)


def test_render_says_how_old_a_state_built_a_while_ago_is() -> None:
    """A large status is rebuilt less often (CachedStatus): the table says when it shows a
    state STALE_SAID or more behind, and nothing when it is of the moment."""
    data = snapshot_to_json(snapshot(gpus={0: []}), Scan(), Sample([Gpu(0)]))
    data["controller"] = {"version": "1", "start_time": 0.0, "status_time": 1000.0}
    table = "\n".join([HEADER, free_line(0), *IDLE_TAIL])
    assert render(data, now=1000.0 + STALE_SAID - 0.1) == table
    assert render(data) == table
    assert render(data, now=1000.0 + 75) == (
        "As of 1 min 15 s ago (a large status is built less often)\n" + table
    )


def test_render_a_busy_host() -> None:
    """Named, unknown-use, lost and free GPUs; holders' memory; foreign processes; waiters
    numbered by position, with how long they waited; every list; the problems."""
    data = rich_json()
    data["nvml"] = {"state": "waiting", "since": 0.0, "detail": "no driver yet"}
    assert render(data, now=1700000125.9).split("\n") == [
        "NVML waiting: no driver yet",
        HEADER,
        "GPU 0: Fake 24GB, 13 GiB / 24 GiB used, 2 GiB reserved",
        "0    voice.service                                  10  running   "
        "10 GiB declared, 11 GiB used (MORE THAN DECLARED)",
        "0    train.service                                  40  stopping  whole GPU, 3 GiB used",
        "0    foreign: PID 77 Xorg                                         2 GiB  "
        "(graphics only; gdm.service)",
        "GPU 1: Fake 80GB, ? / 80 GiB used",
        "1    train.service                                  40  stopping  whole GPU, 6 GiB used",
        "1    small.service                                  30  starting  512 MiB declared",
        "1    foreign: PID 78 python3                                      ?  (Slurm job 881)",
        "1    foreign: PID 79 nvtop                                        300 MiB",
        "GPU 2: LOST (stopped answering NVML)",
        free_line(2),
        free_line(5),
        "",
        "Waiting:",
        "  1. a.service (priority 20): waiting: a (for 2 min 5 s)",
        "  2. b.service (priority 30): waiting: b",
        "  3. c.service (priority 5): waiting: c (for 54 h 12 min)",
        "Suspended: -",
        "Preempted: p.service (priority 3, returns when capacity frees), "
        "q.service (priority 4, Requeue=no)",
        "Held (stopped by hand): h1.service, nobody.service",
        "Finished: f.service",
        "Failed: x@1.service",
        "",
        "Annotation problems:",
        "  /etc/systemd/system/bad.service:3: [X-GPUSlice] Priority: not a number",
        "  /etc/systemd/system/bad.service:3: [X-GPUSlice] Priority: not a number",
    ]


def test_a_holder_kept_for_its_restart_says_why_and_since_when() -> None:
    """A holder whose GPUs are kept for its Restart= (Snapshot.restarting) is `restarting`
    in the JSON, with why and since when (Unix time), and the table says so under it; every
    other holder's "reason" and "since" are null, and the table's line for it is as before."""
    kept = "GPU 0 kept for crash.service's restart (its Restart=)"
    snap = snapshot(
        gpus={0: [("crash.service", 20, "restarting"), ("small.service", 30, "running")]},
        restarting={"crash.service": kept},
    )
    since = {"crash.service": 1700000000.0, "small.service": 1.0}
    data = snapshot_to_json(snap, Scan(), Sample([Gpu(0)]), restart_since=since)
    crash, small = data["gpus"][0]["holders"]
    assert (crash["state"], crash["reason"], crash["since"]) == ("restarting", kept, 1700000000.0)
    assert (small["state"], small["reason"], small["since"]) == ("running", None, None)
    row = "0    crash.service                                  20  restarting whole GPU"
    assert render(data, now=1700000012.5).split("\n")[1:5] == [
        row,
        f"     {kept} (for 12 s)",
        "0    small.service                                  30  running   whole GPU",
        "",
    ]
    assert render(data).split("\n")[2] == f"     {kept}"  # no `now`: no time said


def test_render_without_now_says_no_waiting_time() -> None:
    """`(for ...)` needs both the waiter's since and now."""
    lines = render(rich_json()).split("\n")
    assert lines[15:18] == [
        "  1. a.service (priority 20): waiting: a",
        "  2. b.service (priority 30): waiting: b",
        "  3. c.service (priority 5): waiting: c",
    ]


def test_render_columns_are_fixed_width() -> None:
    """GPU 4 wide, UNIT 40 (a longer name pushes the rest), PRIORITY right-aligned in 8, STATE 9."""
    data = empty_data(
        gpus=[
            {
                "index": 12345,
                "holders": [
                    {"unit": "u" * 40, "priority": 12345678, "state": "s" * 9},
                    {"unit": "v" * 41, "priority": -1, "state": "s"},
                ],
            }
        ]
    )
    assert render(data).split("\n")[:3] == [
        HEADER,
        "12345 " + "u" * 40 + " 12345678  sssssssss whole GPU",
        "12345 " + "v" * 41 + "       -1  s         whole GPU",
    ]


@pytest.mark.parametrize(
    ("nvml", "headline"),
    [
        (None, []),
        ({"state": "ready", "detail": "fine"}, []),
        ({"state": "absent", "detail": "no NVIDIA GPU"}, []),
        ({"state": "waiting", "detail": "no driver"}, ["NVML waiting: no driver"]),
        ({"state": "fallback", "detail": "gave up"}, ["NVML fallback: gave up"]),
        ({"state": "waiting"}, ["NVML waiting: "]),
        ({}, []),
    ],
)
def test_render_nvml_headline(nvml: dict[str, Any] | None, headline: list[str]) -> None:
    """Only "waiting" and "fallback" get a headline, above the table."""
    data = empty_data() if nvml is None else empty_data(nvml=nvml)
    assert render(data).split("\n") == [*headline, HEADER, *IDLE_TAIL]


def test_render_json_of_an_older_controller() -> None:
    """No position (waiters numbered in order), no foreign key, no problems, no nvml, no
    suspended list (before the Preempt= ladder); a since without now (or now without since)
    says no waiting time."""
    data = empty_data(
        gpus=[{"index": 0, "holders": [{"unit": "a.service", "priority": 1, "state": "running"}]}],
        waiting=[
            {"unit": "w.service", "priority": 5, "reason": "waiting: x", "since": 100.0},
            {"unit": "v.service", "priority": 6, "reason": "waiting: y"},
        ],
    )
    del data["suspended"]
    expected = [
        HEADER,
        "0    a.service                                       1  running   whole GPU",
        "",
        "Waiting:",
        "  1. w.service (priority 5): waiting: x",
        "  2. v.service (priority 6): waiting: y",
        *IDLE_TAIL[3:],
    ]
    assert render(data).split("\n") == expected
    expected[4] += " (for 59 s)"
    assert render(data, now=159.99).split("\n") == expected


def test_render_lists_with_several_items() -> None:
    """Each list is its items joined by ", ", or "-" when empty; no problems block when empty."""
    data = empty_data(
        suspended=[{"unit": "s.service", "priority": 2, "gpus": [0, 1]}],
        preempted=[{"unit": "p.service", "priority": 1, "requeue": False}],
        held=[],
        finished=["a.service", "b.service", "c.service"],
        failed=["d.service"],
        problems=[],
    )
    assert render(data).split("\n")[-5:] == [
        "Suspended: s.service (priority 2, returns to GPU 0,1)",
        "Preempted: p.service (priority 1, Requeue=no)",
        "Held (stopped by hand): -",
        "Finished: a.service, b.service, c.service",
        "Failed: d.service",
    ]


def test_finished_units_systemd_keeps_active_are_said_so() -> None:
    """A finished unit that systemd still shows active (RemainAfterExit=yes) holds no GPU:
    listed in "remained" too, and the table says it is still active; an older controller's
    answer, without "remained", shows its finished units as before."""
    snap = snapshot(finished=["a.service", "b.service"], remained=["b.service"])
    data = snapshot_to_json(snap, Scan(), Sample([]))
    assert (data["finished"], data["remained"]) == (["a.service", "b.service"], ["b.service"])
    shown = render(empty_data(**{k: data[k] for k in ("finished", "remained")}))
    assert "Finished: a.service, b.service (still active)" in shown.split("\n")
    assert "Finished: a.service, b.service" in render(empty_data(finished=data["finished"]))


# ---------------------------------------------------------------------------------------------
# the pieces


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-5, "0 s"),
        (0, "0 s"),
        (1, "1 s"),
        (59, "59 s"),
        (59.9, "59 s"),
        (60, "1 min 0 s"),
        (61, "1 min 1 s"),
        (119, "1 min 59 s"),
        (3599, "59 min 59 s"),
        (3600, "1 h 0 min"),
        (3659, "1 h 0 min"),
        (3660, "1 h 1 min"),
        (7140, "1 h 59 min"),
        (7199, "1 h 59 min"),
        (7200, "2 h 0 min"),
        (7322, "2 h 2 min"),
        (90061, "25 h 1 min"),
    ],
)
def test_duration(seconds: float, text: str) -> None:
    """Whole seconds under a minute, minutes and seconds under an hour, then hours and minutes."""
    assert _duration(seconds) == text


@pytest.mark.parametrize(
    ("gpu", "line"),
    [
        (
            {"index": 3, "name": "Fake", "lost": True, "memory_total": GIB},
            "GPU 3: LOST (stopped answering NVML)",
        ),
        ({"index": 0, "name": "Fake", "lost": False, "memory_total": None}, "GPU 0: Fake"),
        ({"index": 0, "name": "Fake"}, "GPU 0: Fake"),
        (
            {"index": 1, "name": "Fake", "memory_total": 24 * GIB, "memory_used": 13 * GIB},
            "GPU 1: Fake, 13 GiB / 24 GiB used",
        ),
        (
            {
                "index": 1,
                "name": "Fake",
                "memory_total": 24 * GIB,
                "memory_used": 0,
                "memory_reserved": 0,
            },
            "GPU 1: Fake, 0 B / 24 GiB used",
        ),
        (
            {
                "index": 1,
                "name": "Fake",
                "memory_total": 24 * GIB,
                "memory_used": None,
                "memory_reserved": 512 * MIB,
            },
            "GPU 1: Fake, ? / 24 GiB used, 512 MiB reserved",
        ),
        (
            {
                "index": 1,
                "name": "Fake",
                "memory_total": 24 * GIB,
                "memory_used": 1536 * MIB,
                "memory_reserved": 1,
            },
            "GPU 1: Fake, 1.5 GiB / 24 GiB used, 1 B reserved",
        ),
    ],
)
def test_gpu_line(gpu: dict[str, Any], line: str) -> None:
    """A lost GPU says so; otherwise its name, then memory used / total when the total is
    known, then the reserve unless it is 0."""
    assert _gpu_line(gpu) == line


@pytest.mark.parametrize(
    ("declared", "used", "text"),
    [
        (None, None, "whole GPU"),
        (None, 3 * GIB, "whole GPU, 3 GiB used"),
        (None, 0, "whole GPU, 0 B used"),
        (4 * GIB, None, "4 GiB declared"),
        (4 * GIB, 3 * GIB, "4 GiB declared, 3 GiB used"),
        (4 * GIB, 4 * GIB, "4 GiB declared, 4 GiB used"),
        (4 * GIB, 4 * GIB + 1, "4 GiB declared, 4.0 GiB used (MORE THAN DECLARED)"),
        (0, 1, "0 B declared, 1 B used (MORE THAN DECLARED)"),
    ],
)
def test_holder_memory(declared: int | None, used: int | None, text: str) -> None:
    """Whole GPU or the declared size, what it uses, and a warning only above the declaration."""
    assert _holder_memory({"memory_declared": declared, "memory_used": used}) == text


def test_json_of_a_holder_no_longer_annotated() -> None:
    """A holder whose annotation went away (its stop still runs) declares nothing: null."""
    snap = snapshot(gpus={0: [("gone.service", 30, "stopping")]})
    (holder,) = snapshot_to_json(snap, Scan(), Sample([Gpu(0)]))["gpus"][0]["holders"]
    assert holder == {
        "unit": "gone.service",
        "priority": 30,
        "state": "stopping",
        "memory_declared": None,
        "memory_used": None,
        "reason": None,
        "since": None,
    }


def test_render_a_lost_gpu_without_a_name() -> None:
    """A GPU lost before NVML ever named it still gets its LOST line."""
    gpu: dict[str, Any] = {"index": 3, "name": None, "lost": True, "holders": []}
    lines = render(empty_data(gpus=[gpu])).splitlines()
    assert lines[1:3] == ["GPU 3: LOST (stopped answering NVML)", free_line(3)]


def test_render_numbers_waiters_by_the_controllers_position() -> None:
    """The number shown is the queue position the controller gave, not the list's order."""
    waiter = {"unit": "w.service", "priority": 20, "reason": "waiting", "position": 4}
    lines = render(empty_data(waiting=[waiter])).splitlines()
    assert "  4. w.service (priority 20): waiting" in lines


def test_suspended_units_in_json_and_table() -> None:
    snap = Snapshot({0: [("voice.service", 10, "running")]}, [], [], [], [], [])
    snap.suspended = [("vlm.service", 90, (0,)), ("old.service", 95, (1,))]
    data = snapshot_to_json(snap, Scan(), Sample([Gpu(0)]), {}, {"vlm.service": (14 * GIB, 100.0)})
    assert data["suspended"] == [
        {
            "unit": "vlm.service",
            "priority": 90,
            "gpus": [0],
            "host_memory": 14 * GIB,
            "since": 100.0,
        },
        {"unit": "old.service", "priority": 95, "gpus": [1], "host_memory": None, "since": None},
    ]
    assert (
        "Suspended: vlm.service (priority 90, 14 GiB in host memory for 42 s, returns to GPU 0), "
        "old.service (priority 95, returns to GPU 1)"
    ) in render(data, now=142.0).splitlines()


@pytest.mark.parametrize(
    ("owner", "label"),
    [
        ({"kind": "kubernetes", "id": "1b4e"}, "Kubernetes pod 1b4e"),
        ({"kind": "user", "id": "1000"}, "UID 1000"),
        ({"kind": "other", "id": ""}, ""),
        (None, ""),  # an older controller's JSON has no owner
        ({"kind": "slurm"}, ""),
        ({"kind": 5, "id": "1"}, ""),
        ("slurm", ""),
    ],
)
def test_a_foreign_processs_owner_as_the_table_says_it(owner: object, label: str) -> None:
    assert _owner_label(owner) == label


def test_a_holder_shows_the_memory_it_is_held_on_not_its_annotation() -> None:
    """`declared` (Scheduler.declared_memory) wins over the annotations: a unit whose
    annotation went is still held on its Memory=, and another unit may share its GPU."""
    snap = snapshot(gpus={0: [("gone.service", 30, "running"), ("other.service", 40, "running")]})
    declared = {"gone.service": 4 << 30}
    holders = snapshot_to_json(snap, Scan(), Sample([Gpu(0)]), declared=declared)["gpus"][0][
        "holders"
    ]
    assert [(h["unit"], h["memory_declared"]) for h in holders] == [
        ("gone.service", 4 << 30),
        ("other.service", None),
    ]


class _Clock:
    """time.monotonic (or time.thread_time) for CachedStatus, moved by the builds it times."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _cached(
    monkeypatch: pytest.MonkeyPatch, cost: float, waited: float = 0.0
) -> tuple[CachedStatus[str], list[int], _Clock]:
    """A CachedStatus whose builds take `cost` of the loop's CPU, and `waited` more of the
    wall clock (a busy host: the loop waited for a CPU meanwhile)."""
    clock, cpu = _Clock(), _Clock()
    monkeypatch.setattr(time, "monotonic", clock)  # only CachedStatus runs meanwhile
    monkeypatch.setattr(time, "thread_time", cpu)
    builds: list[int] = []

    def build() -> str:
        builds.append(len(builds))
        clock.now += cost + waited
        cpu.now += cost
        return f"{{{len(builds)}}}"

    return CachedStatus(build), builds, clock


def test_a_fast_status_is_built_again_at_every_change_and_only_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cached, builds, _ = _cached(monkeypatch, SLOW_BUILD / 2)
    assert [cached.text() for _ in range(3)] == ["{1}"] * 3
    cached.changed()
    assert cached.text() == "{2}" and len(builds) == 2


def test_a_status_is_built_again_once_the_wall_clock_is_stepped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its Unix times (a waiter's `since`, gpuslice/clock.py) are the wall clock's at its
    build: an idle host's status, built once, kept them wrong by a step since (NTP correcting
    at boot an RTC hours off, `date -s`) until something changed, a wait shown hours long or
    0 s. Time passing, the host sleeping (both clocks move alike) or a step of a second at most
    (a leap second) is no reason to build it again."""
    cached, builds, clock = _cached(monkeypatch, SLOW_BUILD / 2)
    step = [0.0]
    monkeypatch.setattr(
        clock_module,
        "time",
        SimpleNamespace(
            CLOCK_BOOTTIME=time.CLOCK_BOOTTIME,
            clock_gettime=lambda _: clock.now,
            time=lambda: 1_700_000_000.0 + clock.now + step[0],
        ),
    )
    assert cached.text() == "{1}"
    clock.now += 8 * 3600
    step[0] += STEP_SEEN
    assert cached.text() == "{1}" and len(builds) == 1
    step[0] += 6 * 3600
    assert [cached.text() for _ in range(2)] == ["{2}"] * 2
    step[0] -= 12 * 3600
    assert cached.text() == "{3}" and len(builds) == 3


def test_a_fast_status_is_of_the_moment_on_a_busy_host_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cost is what the build took of the loop's CPU, not of the wall clock: on a host
    whose CPUs GPU jobs' data loaders keep busy (or a CI's shared cores), a 1 ms build that
    waited 50 ms for a CPU made every reader see the state of half a second before, e.g.
    `gpuslice status` right after a start, and tests that read status after a change."""
    cached, builds, _ = _cached(monkeypatch, SLOW_BUILD / 20, waited=SLOW_BUILD * 2.5)
    assert cached.text() == "{1}"
    cached.changed()
    assert cached.text() == "{2}" and len(builds) == 2


def test_a_slow_status_is_built_at_most_once_per_ten_times_its_cost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 10,000 waiting units a build takes ~1.2 s of the loop: rebuilt at each change for
    anyone who asks, one `gpuslice status --watch` held the controller half of its time."""
    cached, builds, clock = _cached(monkeypatch, 1.0)
    assert cached.text() == "{1}"
    built = cached.built
    clock.now += REBUILD_FACTOR * 1.0 - 1.5  # the build began 1 s before it ended
    cached.changed()
    assert cached.text() == "{1}" and cached.built == built  # the state of a moment ago
    assert cached.as_of == built  # what status_time says
    clock.now += 1.0
    assert cached.text() == "{2}" and len(builds) == 2
    assert cached.text() == "{2}" and len(builds) == 2  # unchanged since: not built again


def test_a_unix_time_shown_twice_is_the_same_until_the_clock_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wall clock and CLOCK_BOOTTIME are read apart, microseconds between them: a start
    time worked out at each answer jittered, and a status compared before and after a hostile
    call (tests/integration/test_attacker.py) differed with nothing changed. A step past
    STEP_SEEN moves it; a slew within it, or of STEP_SEEN itself, does not."""
    now = [100.0, 1_700_000_000.0]
    monkeypatch.setattr(
        clock_module,
        "time",
        SimpleNamespace(
            CLOCK_BOOTTIME=time.CLOCK_BOOTTIME,
            clock_gettime=lambda _: now[0],
            time=lambda: now[1],
        ),
    )
    first = clock_module.unix_time(40.0)
    assert first == 1_700_000_000.0 - 60.0
    now[1] = 1_700_000_000.0 + STEP_SEEN  # moved by the bound itself, no more
    assert clock_module.unix_time(40.0) == first
    now[1] = 1_700_000_000.0 + 0.000_003  # read a few microseconds apart
    assert clock_module.unix_time(40.0) == first
    now[1] += STEP_SEEN / 2  # slewed
    assert clock_module.unix_time(40.0) == first
    now[1] += 3600.0  # stepped
    assert clock_module.unix_time(40.0) == first + 3600.0 + STEP_SEEN / 2 + 0.000_003
