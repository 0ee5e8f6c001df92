"""When config.yaml is read (gpuslice/reloads.py), driven directly: the reload given is a
recorder that answers as told, the file's age is scripted (config.unsettled), and CONFIG_SETTLE
is a few milliseconds. A burst of SIGHUPs is one read; none before start-up is done; a file
not left alone is waited for, then read as it is; one changed while it was read is read
again, and the signals meanwhile are that read."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from gpuslice import config as config_module
from gpuslice import reloads as reloads_module
from gpuslice.reloads import Reloads, load_settled

SETTLE = 0.01  # CONFIG_SETTLE here
WAITS = 3  # CONFIG_SETTLE_WAITS here


class Kit:
    """Reloads of `tmp_path/config.yaml`: each look at the file finds it changed `ages[0]` s
    ago (popped; 0 once empty: left alone), each reload is recorded with its `recheck` and
    answers `answers[0]` (popped; True once empty: read unchanged)."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path = tmp_path / "config.yaml"
        self.path.write_text("gpus: 2\n")
        self.ages: list[float] = []
        self.answers: list[bool] = []
        self.rechecks: list[bool] = []
        self.ready = True
        monkeypatch.setattr(reloads_module, "CONFIG_SETTLE", SETTLE)
        monkeypatch.setattr(reloads_module, "CONFIG_SETTLE_WAITS", WAITS)
        monkeypatch.setattr(config_module, "unsettled", self.unsettled)
        self.reloads = Reloads(self.path, self.reload, lambda: self.ready)

    def unsettled(self, path: Path, now: float, settle: float) -> float:
        assert (path, settle) == (self.path, SETTLE)
        return self.ages.pop(0) if self.ages else 0.0

    def reload(self, recheck: bool) -> bool:
        self.rechecks.append(recheck)
        return self.answers.pop(0) if self.answers else True


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 5))


async def turns() -> None:
    """Let the loop run the callbacks due now."""
    for _ in range(3):
        await asyncio.sleep(0)


async def until(done: Callable[[], bool]) -> None:
    """Let the loop run until `done` (its timers fire late on a loaded machine), then a few
    turns more: nothing else is due."""
    while not done():
        await asyncio.sleep(SETTLE / 2)
    await asyncio.sleep(3 * SETTLE)


def test_the_signals_of_one_turn_of_the_loop_are_one_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kit = Kit(tmp_path, monkeypatch)

    async def test() -> None:
        for _ in range(100):
            kit.reloads.request()
        assert kit.rechecks == []  # on the loop, not in the signal handler
        await turns()
        assert kit.rechecks == [True]  # read unchanged, or read again
        assert not kit.reloads.due
        kit.reloads.request()  # after the read: the file is read again
        await turns()
        assert kit.rechecks == [True, True]

    run(test)


def test_a_signal_before_start_up_is_done_is_one_reload_once_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kit = Kit(tmp_path, monkeypatch)
    kit.ready = False

    async def test() -> None:
        kit.reloads.request()
        kit.reloads.request()
        await turns()
        assert kit.rechecks == [] and kit.reloads.due
        kit.ready = True
        kit.reloads.started()
        assert kit.rechecks == [True]
        kit.reloads.started()  # no signal came: nothing read
        await turns()
        assert kit.rechecks == [True]

    run(test)


def test_a_file_not_left_alone_is_waited_for_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    kit = Kit(tmp_path, monkeypatch)
    kit.ages = [SETTLE, SETTLE]
    caplog.set_level(logging.INFO, logger="gpuslice")

    async def test() -> None:
        kit.reloads.request()
        await turns()
        assert kit.rechecks == []
        kit.reloads.request()  # meanwhile: this reload
        await until(lambda: bool(kit.rechecks))
        assert kit.rechecks == [True]
        assert not kit.reloads.due

    run(test)
    assert [r.getMessage() for r in caplog.records] == [
        f"{kit.path} changed less than 0.01 s ago: reloading it once it has been left alone "
        "that long (a file written in place may be cut short)"
    ]


def test_a_file_that_keeps_changing_is_read_as_it_is_after_so_many_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Changed while it was read (the reload answers False): read again after CONFIG_SETTLE,
    signals meanwhile being that read; after CONFIG_SETTLE_WAITS such waits it is read as
    it is (no recheck), with a warning."""
    kit = Kit(tmp_path, monkeypatch)
    kit.answers = [False] * WAITS
    caplog.set_level(logging.WARNING, logger="gpuslice")

    async def test() -> None:
        kit.reloads.request()
        await turns()
        assert kit.rechecks == [True] and kit.reloads.due
        kit.reloads.request()  # this read again, not one more
        await until(lambda: not kit.reloads.due)
        assert kit.rechecks == [True] * WAITS + [False]
        assert not kit.reloads.due

    run(test)
    assert [r.getMessage() for r in caplog.records] == [
        f"{kit.path} kept changing for 0.03 s: reloading it as it is now"
    ]


def test_the_start_reads_the_file_once_it_has_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kit = Kit(tmp_path, monkeypatch)
    kit.ages = [SETTLE]
    config, warnings = asyncio.run(load_settled(kit.path))
    assert (config.gpus, warnings, kit.ages) == (2, [], [])
