"""A unit that crash-loops under its own `Restart=`, against a real systemd: the GPU it ran on
is kept for each restart (a background unit is not started for a moment at each crash, its
model loaded for nothing), until systemd's start limit gives up on it; then refill runs."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize(
    ("code", "kept"),
    [
        # 252 signals `failed`, then `auto-restart` (after the controller's 1 s wait for it,
        # shorter than RestartSec=: the keep, taken on then, is said)
        (1, f"GPU 0 kept for {CRASH}'s restart (its Restart=)"),
        # a clean exit: `inactive/dead`, then `auto-restart` (a worker whose queue drained)
        (0, f"{CRASH} finished: its own Restart= policy starts it again, GPU 0 kept for it"),
    ],
    ids=["failure", "clean-exit"],
)
def test_a_unit_that_its_restart_starts_again_keeps_its_gpu_until_its_start_limit(
    container: Container, code: int, kept: str
) -> None:
    """A unit whose `Restart=always` starts it again after each end, a failure or a clean
    exit, keeps its GPU for each restart; the background unit beside it is started once,
    after systemd's start limit gives up on it, never between runs (before the clean exit's
    keep, each exit 0 was told failed and the background unit ran between)."""
    write_job(
        container,
        CRASH,
        10,
        exec_start=f"/bin/sh -c 'sleep 1; exit {code}'",
        extra_service="Restart=always\nRestartSec=2",
        extra_unit="StartLimitIntervalSec=300\nStartLimitBurst=3",
    )
    write_job(container, BG, 90, "background", seconds=600)
    reload(container)
    wait_state(container, BG, "active", timeout=30)  # refill starts it
    container.systemctl("start", "--no-block", CRASH)
    wait_journal(container, kept, timeout=30)
    started = start_count(container, BG)

    def bg_waits() -> None:
        assert holders(container) in ({0: [CRASH]}, {0: []}), holders(container)

    always_for(bg_waits, 2.5)  # a restart or two
    wait_state(container, CRASH, "failed", timeout=60)  # its start limit: given up on
    wait_state(container, BG, "active", timeout=30)
    assert start_count(container, BG) == started + 1  # once, after the start limit
    assert holders(container) == {0: [BG]}
