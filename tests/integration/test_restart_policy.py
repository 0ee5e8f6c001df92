"""A unit that crash-loops under its own `Restart=`, against a real systemd: the GPU it ran on
is kept for each restart (a background unit is not started for a moment at each crash, its
model loaded for nothing), until systemd's start limit gives up on it; then refill runs."""

from __future__ import annotations

from tests.bed.container import Container
from tests.integration.jobs import (
    always_for,
    holders,
    reload,
    start_count,
    wait_journal,
    wait_state,
    write_job,
)

CRASH = "crash.service"
BG = "bg.service"


def test_a_unit_that_crash_loops_keeps_its_gpu_until_its_start_limit_then_refill_runs(
    container: Container,
) -> None:
    write_job(
        container,
        CRASH,
        10,
        exec_start="/bin/sh -c 'sleep 1; exit 1'",
        # longer than the controller's 1 s wait for systemd 252's `auto-restart` signal (it
        # comes after `failed`): the keep, taken on then, is said
        extra_service="Restart=always\nRestartSec=2",
        extra_unit="StartLimitIntervalSec=300\nStartLimitBurst=3",
    )
    write_job(container, BG, 90, "background", seconds=600)
    reload(container)
    wait_state(container, BG, "active", timeout=30)  # refill starts it
    container.systemctl("start", "--no-block", CRASH)
    wait_journal(
        container,
        f"GPU 0 kept for {CRASH}'s restart (its Restart=)",
        timeout=30,
    )
    started = start_count(container, BG)

    def bg_waits() -> None:
        assert holders(container) in ({0: [CRASH]}, {0: []}), holders(container)

    always_for(bg_waits, 2.5)  # a restart or two
    wait_state(container, CRASH, "failed", timeout=60)  # its start limit: given up on
    wait_state(container, BG, "active", timeout=30)
    assert start_count(container, BG) == started + 1  # once, after the start limit
    assert holders(container) == {0: [BG]}


def test_a_unit_that_exits_cleanly_under_restart_always_keeps_its_gpu_for_each_restart(
    container: Container,
) -> None:
    """Systemd 252 signals a clean exit `inactive/dead`, then `activating/auto-restart`: a
    worker that exits 0 and is restarted by `Restart=always` (its queue drained) keeps its
    GPU for each restart, said `finished: its own Restart= policy starts it again`, and the
    background unit is started once, after systemd's start limit, never between runs."""
    worker = "worker.service"
    write_job(
        container,
        worker,
        10,
        exec_start="/bin/sh -c 'sleep 1; exit 0'",
        extra_service="Restart=always\nRestartSec=2",
        extra_unit="StartLimitIntervalSec=300\nStartLimitBurst=3",
    )
    write_job(container, BG, 90, "background", seconds=600)
    reload(container)
    wait_state(container, BG, "active", timeout=30)  # refill starts it
    container.systemctl("start", "--no-block", worker)
    wait_journal(
        container,
        f"{worker} finished: its own Restart= policy starts it again, GPU 0 kept for it",
        timeout=30,
    )
    started = start_count(container, BG)

    def bg_waits() -> None:
        assert holders(container) in ({0: [worker]}, {0: []}), holders(container)

    always_for(bg_waits, 2.5)  # a restart or two
    wait_state(container, worker, "failed", timeout=60)  # its start limit: given up on
    wait_state(container, BG, "active", timeout=30)
    assert start_count(container, BG) == started + 1  # once, after the start limit
    assert holders(container) == {0: [BG]}
