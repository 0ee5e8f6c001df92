"""Remains: a unit systemd keeps active after its job ended is released only once systemd
counts (or, not knowing the count, lists) no process left in it, by an answer no later
signal of the unit overtook."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import pytest

from gpuslice.remains import Remains
from gpuslice.systemd import SystemdError

A = "once.service"


class Kit:
    """Remains on fakes: systemd's task counts (`count`: None where it does not know, or an
    error) and process lists (`pids`, or an error), the tracker's stamp, whether the unit
    still shows `active (exited)`, and what was released."""

    def __init__(self) -> None:
        self.count: int | SystemdError | None = None
        self.counted: list[str] = []
        self.pids: list[int] | SystemdError = []
        self.asked: list[str] = []
        self.stamp = 1
        self.exited = True
        self.released: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.remains = Remains(
            self,
            lambda _: self.stamp,
            lambda _: self.exited,
            self.released.append,
            self.spawn,
        )

    async def tasks_current(self, name: str) -> int | None:
        self.counted.append(name)
        await asyncio.sleep(0)
        if isinstance(self.count, SystemdError):
            raise self.count
        return self.count

    async def unit_pids(self, name: str) -> list[int]:
        self.asked.append(name)
        await asyncio.sleep(0)  # answered on a later turn of the loop, as the bus does
        if isinstance(self.pids, SystemdError):
            raise self.pids
        return self.pids

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(coro))

    async def done(self) -> None:
        await asyncio.gather(*self.tasks)
        self.tasks.clear()


def test_released_when_no_process_is_left() -> None:
    async def test() -> None:
        kit = Kit()
        kit.remains.exited(A)
        assert kit.released == []  # not before systemd answered
        await kit.done()
        assert (kit.asked, kit.released) == ([A], [A])

    asyncio.run(test())


def test_an_answer_overtaken_by_a_later_signal_or_a_change_decides_nothing() -> None:
    """A signal of the unit came while its processes were listed: that signal's own check
    decides. One that no longer shows it `active (exited)` (stopped, restarted, released
    meanwhile) is released by nothing."""

    async def test() -> None:
        kit = Kit()
        kit.remains.exited(A)
        kit.stamp = 2
        await kit.done()
        assert kit.released == []
        kit.remains.exited(A)
        kit.exited = False
        await kit.done()
        assert kit.released == []
        kit.exited = True
        kit.remains.exited(A)
        await kit.done()
        assert kit.released == [A]

    asyncio.run(test())


def test_a_process_left_keeps_its_gpus_said_once_per_run(caplog: pytest.LogCaptureFixture) -> None:
    async def test() -> None:
        kit = Kit()
        kit.pids = [41, 42]
        for _ in range(3):
            kit.remains.exited(A)
            await kit.done()
        assert kit.released == []
        kit.remains.went_down(A)
        kit.remains.exited(A)
        await kit.done()
        kit.pids = []
        kit.remains.exited(A)
        await kit.done()
        assert kit.released == [A]
        kit.pids = [43]
        kit.remains.exited(A)  # a next run's leftover: said again
        await kit.done()

    with caplog.at_level(logging.INFO, logger="gpuslice"):
        asyncio.run(test())
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"{A} stays active after its job ended (RemainAfterExit=yes), and {n} process(es) "
        "are left in it (KillMode=): it keeps its GPUs until none is left (asked again every "
        "30 s) or it is stopped (systemctl stop)"
        for n in (2, 2, 1)
    ]
    assert {r.levelno for r in caplog.records} == {logging.WARNING}


def test_processes_that_cannot_be_listed_keep_its_gpus(caplog: pytest.LogCaptureFixture) -> None:
    """Said once per run, though asked again at each audit (a systemd without
    GetUnitProcesses said so every 30 s for each such unit); released once an answer
    comes. A next run's (a restart whose down no signal showed) is said again."""

    async def test() -> None:
        kit = Kit()
        busy = SystemdError("org.freedesktop.DBus.Error.TimedOut", "no answer")
        kit.pids = busy
        for _ in range(3):
            kit.remains.exited(A)
            await kit.done()
        assert kit.released == []
        kit.pids = []
        kit.remains.exited(A)
        await kit.done()
        assert kit.released == [A]
        kit.pids = busy
        kit.remains.exited(A)  # its next run's: said again
        await kit.done()

    with caplog.at_level(logging.INFO, logger="gpuslice"):
        asyncio.run(test())
    said = (
        logging.WARNING,
        f"{A} stays active after its job ended (RemainAfterExit=yes), but its processes "
        "cannot be listed (no answer): it keeps its GPUs until they can be (asked again "
        "every 30 s) or it is stopped",
    )
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [said, said]


def test_processes_that_cannot_be_listed_are_said_again_after_the_units_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Stopped while they could not be listed (no release came between): its next run's
    are said again, not taken for the run before."""

    async def test() -> None:
        kit = Kit()
        kit.pids = SystemdError("org.freedesktop.DBus.Error.TimedOut", "no answer")
        kit.remains.exited(A)
        await kit.done()
        kit.remains.went_down(A)
        kit.remains.exited(A)
        await kit.done()

    with caplog.at_level(logging.INFO, logger="gpuslice"):
        asyncio.run(test())
    assert len([r for r in caplog.records if "cannot be listed" in r.getMessage()]) == 2


def test_a_check_under_way_since_the_units_last_signal_is_not_sent_again() -> None:
    """Asked again at each audit while systemd's answer is slow (thousands of processes
    listed): one call, not one more per audit behind it; a later signal asks anew, and so
    does the next audit once the answer came."""

    async def test() -> None:
        kit = Kit()
        kit.pids = [41]
        for _ in range(3):
            kit.remains.exited(A)
        assert len(kit.tasks) == 1
        kit.stamp = 2  # a signal of it: its own check
        kit.remains.exited(A)
        await kit.done()
        assert kit.asked == [A, A]
        kit.remains.exited(A)
        await kit.done()
        assert kit.asked == [A, A, A]

    asyncio.run(test())


def test_no_task_counted_releases_it_without_listing_its_processes() -> None:
    """TasksCurrent 0: no list asked (each process's command line, up to the bus's message
    limit, decoded on the loop)."""

    async def test() -> None:
        kit = Kit()
        kit.count = 0
        kit.pids = [41]  # what a list would wrongly say: never asked
        kit.remains.exited(A)
        await kit.done()
        assert (kit.counted, kit.asked, kit.released) == ([A], [], [A])

    asyncio.run(test())


def test_tasks_counted_keep_its_gpus_without_listing_them_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A unit's user may leave up to TasksMax processes with long command lines: their
    count keeps the GPUs, at every audit, and no list is ever asked. A count read before a
    later signal of the unit decides nothing; that signal's own one does."""

    async def test() -> None:
        kit = Kit()
        kit.count = 200_000
        kit.pids = []  # what a list would wrongly say: never asked
        for _ in range(3):
            kit.remains.exited(A)
            await kit.done()
        assert (kit.counted, kit.asked, kit.released) == ([A] * 3, [], [])
        kit.count = 0
        kit.remains.exited(A)
        kit.stamp = 2  # a signal of it while its count was read
        await kit.done()
        assert kit.released == []
        kit.remains.exited(A)
        await kit.done()
        assert (kit.asked, kit.released) == ([], [A])

    with caplog.at_level(logging.INFO, logger="gpuslice"):
        asyncio.run(test())
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            f"{A} stays active after its job ended (RemainAfterExit=yes), and 200000 task(s) "
            "(processes and threads) are left in it (KillMode=): it keeps its GPUs until none "
            "is left (asked again every 30 s) or it is stopped (systemctl stop)",
        )
    ]


def test_a_count_not_read_is_said_in_the_debug_log_with_the_unit_and_the_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Why its processes were listed instead (no Service interface, systemd busy) is told
    to one who debugs it, naming the unit and systemd's error."""
    error = SystemdError("org.freedesktop.DBus.Error.UnknownProperty", "no TasksCurrent")

    async def test() -> None:
        kit = Kit()
        kit.count = error
        kit.remains.exited(A)
        await kit.done()
        assert kit.released == [A]

    with caplog.at_level(logging.DEBUG, logger="gpuslice"):
        asyncio.run(test())
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.DEBUG,
            f"TasksCurrent of {A} not read (org.freedesktop.DBus.Error.UnknownProperty: no "
            "TasksCurrent): its processes are listed",
        )
    ]


@pytest.mark.parametrize(
    "count",
    [None, SystemdError("org.freedesktop.DBus.Error.UnknownProperty", "no TasksCurrent")],
    ids=["unknown", "error"],
)
def test_a_count_not_known_or_not_read_lists_its_processes(
    count: SystemdError | None, caplog: pytest.LogCaptureFixture
) -> None:
    """UINT64_MAX (tasks accounting off, its cgroup gone) or an error (no Service
    interface, systemd busy): the list decides, as before TasksCurrent was asked, and
    nothing more is said than its answer says."""

    async def test() -> None:
        kit = Kit()
        kit.count = count
        kit.pids = [41]
        kit.remains.exited(A)
        await kit.done()
        assert (kit.counted, kit.asked, kit.released) == ([A], [A], [])
        kit.pids = []
        kit.remains.exited(A)
        await kit.done()
        assert (kit.counted, kit.asked, kit.released) == ([A, A], [A, A], [A])

    with caplog.at_level(logging.INFO, logger="gpuslice"):
        asyncio.run(test())
    assert [r.getMessage() for r in caplog.records] == [
        f"{A} stays active after its job ended (RemainAfterExit=yes), and 1 process(es) are "
        "left in it (KillMode=): it keeps its GPUs until none is left (asked again every 30 s) "
        "or it is stopped (systemctl stop)"
    ]
