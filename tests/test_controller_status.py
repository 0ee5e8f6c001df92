"""What anyone on the host sees (`gpuslice status`, metrics, the journal) tells the truth.

Status is built once per change (Controller.status_json) and read by every local user and
by the metrics exporter; these cases are changes that decide nothing and so once left it
stale, and a holder whose annotation went, which status showed on terms the scheduler did
not hold it on.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import types
from pathlib import Path

import pytest

from gpuslice import answers
from gpuslice import controller as controller_module
from gpuslice.config import Config
from gpuslice.controller import JournalFormatter
from gpuslice.counters import ERRORS
from gpuslice.journal import Journal
from gpuslice.metrics import exposition
from gpuslice.status import render
from tests.test_controller import (
    GIB,
    HOUR,
    Bed,
    StubNvml,
    at_gate,
    auto_restart,
    crash_loop_bed,
    crashes,
    due_now,
    exits_clean,
    goes_down,
    low_holds_gpu_0,
    restart_always_bed,
    restart_timers_by_hand,
    run,
    settle,
    signal,
    started,
    started_with_an_instance_running,
    state,
    unannotate,
    until,
    write_unit,
)
from tests.test_controller import cgroup_of as cgroup_of


def test_status_shows_a_problem_a_rescan_found_though_nothing_was_decided(
    tmp_path: Path,
) -> None:
    """A daemon-reload brings a unit with a typo (Priority=high): the controller logs the
    problem, decides nothing, and status (and gpuslice_annotation_problems) said there was
    none until some later decision happened to rebuild it."""
    bed = Bed(tmp_path, {"a.service": "Priority=10\n"}, [state("a.service", "inactive", "dead")])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert json.loads(ctl.status_json())["problems"] == []
        write_unit(tmp_path, "b.service", "Priority=high\n")
        ctl.rescans.request()
        await until(lambda: ctl.rescans.task is None and bool(ctl.scan.problems))
        [problem] = json.loads(ctl.status_json())["problems"]
        assert 'Priority: expected an integer 0-999, got "high"' in problem
        assert b"gpuslice_annotation_problems 1.0" in exposition(json.loads(ctl.status_json()))

    run(test)


def test_status_drops_an_instance_forgotten_without_a_decision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """t@1 fails and waits in auto-restart (told failed, kept: its restart job may come),
    longer than its GPU is kept for it (RESTART_KEEP); its restarts then end, failed for
    good, which decides nothing more, and the core forgets it. Status still listed it under
    Failed until the next decision."""
    # ended by the test: a bound of 10 ms ran out, on a loaded machine, before the status
    # that must not show it failed yet was looked at
    monkeypatch.setattr(controller_module, "RESTART_KEEP", HOUR)
    bed = Bed(tmp_path, {"t@.service": "Priority=50\n"}, [])
    unit = "t@1.service"

    async def test() -> None:
        ctl = await started_with_an_instance_running(bed, unit)
        signal(
            bed, unit, {"ActiveState": "activating", "SubState": "auto-restart", "Job": (0, "/")}
        )
        await settle()
        assert json.loads(ctl.status_json())["failed"] == []  # its GPU kept for its restart
        assert await due_now(ctl._restart_overdue) == 1
        assert json.loads(ctl.status_json())["failed"] == [unit]
        signal(bed, unit, {"ActiveState": "failed", "SubState": "failed", "Job": (0, "/")})
        await settle()
        assert ctl.scheduler.annotated() == set()  # forgotten
        assert json.loads(ctl.status_json())["failed"] == []

    run(test)


def test_status_shows_the_memory_a_unit_whose_annotation_went_is_still_held_on(
    tmp_path: Path,
) -> None:
    """small.service (Memory=8G) runs beside other.service on GPU 0; its annotation goes. It
    keeps its GPU on the terms it was granted (8 GiB: other.service stays beside it), but
    status read its memory from the annotations: `whole GPU` (memory_declared null), two
    jobs on one whole GPU as far as anyone could tell, and its
    gpuslice_job_memory_declared_bytes series vanished."""
    bed = Bed(
        tmp_path,
        {"small.service": "Priority=50\nMemory=8G\n", "other.service": "Priority=50\nMemory=8G\n"},
        [],
        config=Config(gpus=1, state_dir=str(tmp_path / "state"), runtime_dir=str(tmp_path / "run")),
        nvml=StubNvml(),
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        for n, unit in enumerate(("small.service", "other.service"), start=1):
            ctl.on_job_new(n, f"/org/freedesktop/systemd1/job/{n}", unit)
            signal(bed, unit, at_gate(bytes([n]) * 16))
            await settle()
            signal(bed, unit, {"ActiveState": "active", "SubState": "running", "Job": (0, "/")})
            await settle()
        assert ctl.scheduler.grants() == {
            "small.service": frozenset({0}),
            "other.service": frozenset({0}),
        }
        await unannotate(ctl, tmp_path, "small.service")
        assert ctl.scheduler.declared_memory()["small.service"] == 8 * GIB
        status = json.loads(ctl.status_json())
        holders = {h["unit"]: h["memory_declared"] for h in status["gpus"][0]["holders"]}
        assert holders == {"small.service": 8 * GIB, "other.service": 8 * GIB}
        text = exposition(status).decode()
        assert 'gpuslice_job_memory_declared_bytes{gpu="0",unit="small.service"}' in text

    run(test)


def test_the_controllers_log_keeps_tracebacks_and_each_lines_level() -> None:
    """Under systemd the controller's log is a stream journald reads a line at a time: a
    traceback was dropped (only the message was written), and a line after a newline in a
    message took journald's default level, or a "<N>" it began with."""
    formatter = JournalFormatter()
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "gpuslice", logging.ERROR, __file__, 1, "internal error\n<0>%s", ("x",), sys.exc_info()
        )
    lines = formatter.format(record).split("\n")
    assert lines[:2] == ["<3>internal error", "<3><0>x"]
    assert lines[2] == "<3>Traceback (most recent call last):"
    assert lines[-1] == "<3>ValueError: boom"
    assert all(line.startswith("<3>") for line in lines)
    info = logging.LogRecord("gpuslice", logging.INFO, __file__, 1, "", (), None)
    assert formatter.format(info) == "<6>"


def test_the_status_line_fits_in_one_notify_datagram(tmp_path: Path) -> None:
    """STATUS= goes to systemd in one datagram, READY=1 with it at start-up, and systemd
    ignores a datagram past 4,096 bytes whole (NOTIFY_BUFFER_MAX). The line named every
    running unit: 32 of 250-character names made it 8 KiB, so the controller's READY=1
    never counted and systemd killed it at TimeoutStartSec, to restart into the same line.
    The names stop at STATUS_NAMES_MAX characters; the rest are counted."""
    names = [f"{i:02d}{'x' * 240}.service" for i in range(33)]
    bed = Bed(
        tmp_path,
        {name: "Priority=10\n" for name in names},
        [state(name, "activating", "start-pre", i + 1, "start") for i, name in enumerate(names)],
        config=Config(
            gpus=32, state_dir=str(tmp_path / "state"), runtime_dir=str(tmp_path / "run")
        ),
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        line = ctl.status_line()
        assert len(f"READY=1\nSTATUS={line}".encode()) <= 4096
        assert line.startswith(f"32 GPUs: {names[0]}, {names[1]}, ")
        assert line.endswith(" more running; 1 waiting")
        shown = line.removeprefix("32 GPUs: ").split(" and ")[0].split(", ")
        assert line.endswith(f" and {32 - len(shown)} more running; 1 waiting")

    run(test)


def test_a_status_of_the_moment_says_so_however_long_ago_it_was_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an idle host nothing changes for hours and the status built once stays the state
    of the moment: its status_time is now, not the time of that build, or `gpuslice status`
    said "As of 3 h ago (a large status is built less often)" on every small host."""
    bed = Bed(tmp_path, {"a.service": "Priority=10\n"}, [state("a.service", "inactive", "dead")])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        first = json.loads(ctl.status_json())
        later = time.time() + 3 * 3600
        monkeypatch.setattr(time, "time", lambda: later)
        data = json.loads(ctl.status_json())
        assert data["controller"]["status_time"] == later
        assert not render(data, later).startswith("As of")
        assert data["gpus"] == first["gpus"]

    run(test)


def test_the_status_counts_what_the_adapters_counted(tmp_path: Path) -> None:
    """The counts kept outside the controller's own counters (signals the bus adapter
    dropped, NVML calls failed or timed out, journal entries and sd_notify messages not
    taken) are the status's and so `gpuslice metrics`': each from its own source."""
    bed = Bed(tmp_path, {"a.service": "Priority=10\n"}, [state("a.service", "inactive", "dead")])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        bed.systemd.dropped = 3
        ctl.watch.inventory.errors = 5
        ctl.watch.nvml.timeouts = 7
        ctl.journal = Journal()
        ctl.journal.failures = 11
        ctl.notifier.failures = 13
        ctl.counters.error("state_save_errors", 2)
        counters = json.loads(ctl.status_json())["counters"]
        assert {k: counters[k] for k in ERRORS} == {
            **dict.fromkeys(ERRORS, 0),
            "dbus_signals_dropped": 3,
            "nvml_errors": 5,
            "nvml_timeouts": 7,
            "journal_write_errors": 11,
            "notify_errors": 13,
            "state_save_errors": 2,
        }
        ctl.journal.close()

    run(test)


def test_the_status_line_says_what_each_holder_is_doing(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """A victim being stopped is "stopping", not "running": `systemctl status gpuslice` said
    "low.service running" for as long as its stop took (and a frozen unit was "running" for
    hours)."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.status_line() == "1 GPU: low.service running; 0 waiting"
        await bed.acquire("urgent.service")
        assert ctl.status_line() == "1 GPU: low.service stopping; 1 waiting"
        goes_down(bed, "low.service")
        await until(lambda: ctl.status_line() == "1 GPU: urgent.service running; 0 waiting")

    run(test)


def test_the_status_line_groups_holders_by_phase_and_counts_those_past_its_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the order running, starting, stopping, frozen, suspending, resuming; the names
    past STATUS_NAMES_MAX counted with their group, or by phase when none of it is shown."""
    bed = Bed(tmp_path, {}, [])
    ctl = bed.controller
    holders = {
        0: [("b.service", 50, "frozen"), ("a.service", 10, "running")],
        1: [("c.service", 90, "stopping"), ("d.service", 90, "running")],
        2: [("e.service", 20, "starting"), ("f.service", 20, "resuming")],
    }
    snap = types.SimpleNamespace(gpus=holders, waiting=["w.service"])
    monkeypatch.setattr(ctl.scheduler, "snapshot", lambda reasons=True: snap)
    assert ctl.status_line() == (
        "3 GPUs: a.service, d.service running; e.service starting; c.service stopping; "
        "b.service frozen; f.service resuming; 1 waiting"
    )
    monkeypatch.setattr(answers, "STATUS_NAMES_MAX", 33)  # three names of 9, each + 2
    assert ctl.status_line() == (
        "3 GPUs: a.service, d.service running; e.service starting; 1 more stopping; "
        "1 more frozen; 1 more resuming; 1 waiting"
    )
    monkeypatch.setattr(answers, "STATUS_NAMES_MAX", 11)
    assert ctl.status_line() == (
        "3 GPUs: a.service and 1 more running; 1 more starting; 1 more stopping; "
        "1 more frozen; 1 more resuming; 1 waiting"
    )


def test_status_shows_a_unit_whose_gpu_is_kept_for_its_restart_as_restarting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """u.service crashes and its Restart= starts it again: its GPU is kept for that start.
    Status showed it `starting`, a start on its way to its gate, where nothing of it runs and
    its GPU waits for a restart that may never come: it is `restarting`, with why and since
    when, in the JSON, the table, STATUS= and the metrics. Its restart granted, it runs."""
    restart_timers_by_hand(monkeypatch)
    bed = crash_loop_bed(tmp_path)
    kept = "GPU 0 kept for u.service's restart (its Restart=)"

    async def test() -> None:
        ctl = await started(bed)
        before = time.time()
        crashes(bed, "u.service")
        assert await due_now(ctl._restart_unseen) == 1  # its restart seen: kept on
        status = json.loads(ctl.status_json())
        [holder] = status["gpus"][0]["holders"]
        assert (holder["unit"], holder["state"], holder["reason"]) == (
            "u.service",
            "restarting",
            kept,
        )
        assert before - 1 <= holder["since"] <= time.time() + 1
        assert f"     {kept} (for 3 s)" in render(status, now=holder["since"] + 3).split("\n")
        assert ctl.status_line() == "1 GPU: u.service restarting; 0 waiting"
        metrics = exposition(status).decode()
        assert 'gpuslice_jobs{priority="10",state="restarting"} 1.0' in metrics
        assert 'state="starting"' not in metrics
        ctl.on_job_new(2, "/org/freedesktop/systemd1/job/2", "u.service")
        bed.systemd.units["u.service"] = state("u.service", "activating", "start-pre", 2)
        signal(bed, "u.service", at_gate(bytes([2]) * 16))
        await until(lambda: ctl.status_line() == "1 GPU: u.service running; 0 waiting")
        [holder] = json.loads(ctl.status_json())["gpus"][0]["holders"]
        assert (holder["state"], holder["reason"], holder["since"]) == ("running", None, None)

    run(test)


def test_status_shows_a_clean_exit_whose_gpu_is_kept_for_its_restart_as_restarting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """u.service (Restart=always) exits 0 and systemd 252 starts it again (`inactive`, then
    `auto-restart`): its GPU kept for that start, it is `restarting`, with why, in the JSON
    and STATUS=, and not finished (its restart comes)."""
    restart_timers_by_hand(monkeypatch)
    bed = restart_always_bed(tmp_path)

    async def test() -> None:
        ctl = await started(bed)
        exits_clean(bed, "u.service")
        auto_restart(bed, "u.service")
        await settle()
        assert await due_now(ctl._restart_unseen) == 1
        status = json.loads(ctl.status_json())
        [holder] = status["gpus"][0]["holders"]
        assert (holder["unit"], holder["state"], holder["reason"]) == (
            "u.service",
            "restarting",
            "GPU 0 kept for u.service's restart (its Restart=)",
        )
        assert status["finished"] == [] and status["failed"] == []
        assert ctl.status_line() == "1 GPU: u.service restarting; 0 waiting"

    run(test)
