"""The controller's calls to systemd, their retries, its timers and its own books.

Mutation testing of gpuslice/controller.py showed rules that no test held: the journal's
exact words when a StopUnit is refused or does not reach systemd (an admin reads them with
`journalctl -u gpuslice`, DEBUG lines included); a call sent again that cancels the timer
that was to send it; two calls of one unit in flight at once; the delay forgotten once a
call is no longer wanted; the stop timer of a victim that went down; how long a unit waited
at its gate (the journal's GPUSLICE_WAITED_USEC, the admission-wait histogram); one check
of FreezerState at a time; the state file that cannot be written; STATUS= at most once per
STATUS_DELAY; a unit's processes taken for its own, not for foreign; a task kept until it
ends. Each test here pins one such rule through what the controller sends, says or saves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import socket
import threading
import time
import weakref
from collections.abc import Awaitable
from pathlib import Path
from typing import cast

import pytest

from gpuslice import calls as calls_module
from gpuslice import clock as clock_module
from gpuslice import controller as controller_module
from gpuslice import gpuwatch as gpuwatch_module
from gpuslice import rereads as rereads_module
from gpuslice import state as state_module
from gpuslice.core.scheduler import Phase, SavedState
from gpuslice.journal import Journal
from gpuslice.nvml import GpuProcess
from gpuslice.systemd import Queued, SystemdError
from gpuslice.tracker import UnitState
from tests.test_controller import (
    GIB,
    HOUR,
    NO_REPLY,
    Bed,
    StubNvml,
    at_gate,
    bed_config,
    due_now,
    frozen_beside_voice,
    goes_down,
    hang_until,
    low_holds_gpu_0,
    messages,
    patient_nvml,
    process_in,
    run,
    settle,
    state,
    until,
    write_unannotated,
    write_unit,
)
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import cgroup_of as cgroup_of  # a fixture

JOB = "/org/freedesktop/systemd1/job/"
REFUSED = SystemdError(
    "org.freedesktop.systemd1.OnlyByDependency",
    "Operation refused, unit low.service may be requested by dependency only (it is "
    "configured to refuse manual start/stop).",
)


@dataclasses.dataclass
class Answer:
    """How systemd answers one StopUnit or StartUnit of ours."""

    error: SystemdError | None = None  # raised as the answer is read; None: a job queued
    job: str = ""  # the job's path ("": a new job of its own)
    read: asyncio.Event | None = None  # the answer is read once this is set (None: at once)
    resume: asyncio.Event | None = None  # the call resumes once set, after `queued` is told


def scripted(bed: Bed, what: str, answers: list[Answer]) -> list[float]:
    """The next StopUnits (`what` "stop") or StartUnits ("start") are answered as `answers`
    say, one each; the fake's own answers after those. Returns when each was sent."""
    attribute = "restart_preempted" if what == "start" else "stop_unit"
    method = getattr(bed.systemd, attribute)
    sent: list[float] = []

    def call(name: str, queued: Queued | None = None) -> Awaitable[str]:
        sent.append(asyncio.get_running_loop().time())
        if not answers:
            return cast(Awaitable[str], method(name, queued))
        answer = answers.pop(0)
        bed.systemd.calls.append((what, name))
        path = answer.job or f"{JOB}{900 + len(sent)}"

        async def answered() -> str:
            if answer.read is not None:
                await answer.read.wait()
            if answer.error is not None:
                raise answer.error
            if queued is not None:
                queued(path)
            if answer.resume is not None:
                await answer.resume.wait()
            return path

        return answered()

    setattr(bed.systemd, attribute, call)
    return sent


def stops(bed: Bed, unit: str = "low.service") -> int:
    return bed.systemd.calls.count(("stop", unit))


async def past_time(moment: float) -> None:
    """The loop's clock is past `moment`, and what its timers due by then spawned has run."""
    await until(lambda: asyncio.get_running_loop().time() > moment)
    await settle()


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every ERROR line, of any logger (asyncio's "Exception in callback" among them)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# ---- a StopUnit systemd refuses ----


def test_a_stop_systemd_refuses_is_said_with_its_error_and_the_victim_not_chosen_again(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """RefuseManualStop=yes: systemd refuses our StopUnit of low.service. The journal names
    the call, the unit and systemd's words; the core takes low.service back as running and
    never picks it as a victim again while it runs (else the waiter asks for the same refused
    stop in a loop), so no second StopUnit; its stop timer goes with it: no "overdue" line
    later about a stop nobody is running."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of, stop_timeout=0.05)
    scripted(bed, "stop", [Answer(error=REFUSED)])
    caplog.set_level(logging.DEBUG, logger="gpuslice")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        caplog.clear()
        await bed.acquire("urgent.service", ":1.9", 4242)
        await settle()
        assert ctl.scheduler.phase("low.service") is Phase.RUNNING
        assert ctl.calls._stop_timers == {}
        await past_time(asyncio.get_running_loop().time() + bed.config.stop_timeout * 2)
        assert stops(bed) == 1
        assert bed.service.granted == []
        assert ctl.scheduler.is_waiting("urgent.service")

    run(test)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "preempting low.service (priority 90) for urgent.service (priority 10) on GPU 0"),
        ("INFO", "urgent.service waiting for low.service (priority 90) to stop on GPU 0"),
        ("ERROR", f"stop low.service failed: {REFUSED.text}"),
        (
            "WARNING",
            "low.service (priority 90) did not stop for urgent.service (priority 10): "
            f"{REFUSED.text}; it keeps GPU 0; gpuslice will not try to stop it again while "
            "it runs",
        ),
        (
            "INFO",
            "urgent.service waiting: GPU 0 held by low.service, priority 90 (refused to stop)",
        ),
    ]


# ---- a StopUnit that did not reach systemd ----


def low_runs_urgent_asks(tmp_path: Path, cgroup_of: dict[int, str]) -> Bed:
    """low.service (90) runs on the one GPU; urgent.service (10) asks from PID 4242, and
    low.service's own gate (its start job outran our stop) from PID 4243. A stop is overdue
    only after a minute: no "overdue" line in these tests."""
    bed = Bed(
        tmp_path,
        {"low.service": "Priority=90\n", "urgent.service": "Priority=10\n"},
        [state("low.service", "active", "running")],
        SavedState(holders={"low.service": ((0,), "running", 1, "")}, seq=1),
        config=bed_config(tmp_path, stop_timeout=60.0),
    )
    cgroup_of[4242] = "urgent.service"
    cgroup_of[4243] = "low.service"
    return bed


def job_77_queued(bed: Bed, job: str) -> None:
    """Job 77 (`job`), a stop, is queued for low.service, as its signals tell: its JobNew,
    then low.service still running with it."""
    ctl = bed.controller
    ctl.on_job_new(77, job, "low.service")
    queued = {"ActiveState": "active", "SubState": "running", "Job": (77, job)}
    ctl.on_unit_changed("low.service", queued)


def stopped_by_job_77(bed: Bed, job: str) -> None:
    """Job 77 (`job`) takes low.service down, as its signals tell: deactivating with it, down,
    then its JobRemoved."""
    ctl = bed.controller
    stopping = {"ActiveState": "deactivating", "SubState": "stop-sigterm", "Job": (77, job)}
    ctl.on_unit_changed("low.service", stopping)
    bed.systemd.units["low.service"] = state("low.service", "inactive", "dead")
    down = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
    ctl.on_unit_changed("low.service", down)
    ctl.on_job_removed(77, job, "low.service", "done")


async def preempted_and_back(bed: Bed) -> None:
    """urgent.service got the GPU, low.service is booked preempted (not finished), and is
    started again once urgent.service ends."""
    ctl = bed.controller
    assert bed.service.granted == [("urgent.service", "0")]
    assert "low.service" in ctl.scheduler.preempted
    assert "low.service" not in ctl.scheduler.snapshot().finished
    goes_down(bed, "urgent.service")
    await settle()
    assert bed.systemd.calls[-1] == ("start", "low.service")


def stopped_by_job_77_and_back(
    bed: Bed, announced: bool = False, read: asyncio.Event | None = None
) -> None:
    """urgent.service asks, and job 77 takes low.service down (`announced` by its JobNew
    first, `read` let go after): low.service is booked preempted, and started again once
    urgent.service ends."""
    job = f"{JOB}77"

    async def test() -> None:
        await urgent_asks(bed)
        await settle()
        if announced:
            bed.controller.on_job_new(77, job, "low.service")
        stopped_by_job_77(bed, job)
        if read is not None:
            read.set()
        await settle()
        await preempted_and_back(bed)

    run(test)


def lost_stop(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    *later: Answer,
    retry_max: float | None = None,
    read: asyncio.Event | None = None,
) -> Bed:
    """low_runs_urgent_asks, our first StopUnit of low.service answered NoReply (once `read`
    is set, if given; `later`: the answers to the StopUnits after it) and sent again after an
    hour, a delay the test ends (retry_fires); `retry_max`: the longest delay, if the test
    doubles it."""
    monkeypatch.setattr(calls_module, "CALL_RETRY_FIRST", HOUR)
    if retry_max is not None:
        monkeypatch.setattr(calls_module, "CALL_RETRY_MAX", retry_max)
    bed = low_runs_urgent_asks(tmp_path, cgroup_of)
    scripted(bed, "stop", [Answer(NO_REPLY, read=read), *later])
    return bed


def lost_answer_read(answer_lost: str) -> asyncio.Event:
    """What lets our lost stop's NoReply be read (lost_stop's `read`): set already when the
    answer is lost "before-its-end" of low.service, left for the test to set otherwise."""
    read = asyncio.Event()
    if answer_lost == "before-its-end":
        read.set()
    return read


async def urgent_asks(bed: Bed) -> None:
    """The controller starts and urgent.service's gate asks (low_runs_urgent_asks): low.service
    is stopped for it."""
    await bed.controller.start()
    await bed.acquire("urgent.service", ":1.9", 4242)


def held_reads(bed: Bed, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Every read of a unit's state by bed's controller waits until the event returned is set."""
    unit_state = bed.systemd.unit_state
    read = asyncio.Event()

    async def slow_read(name: str) -> UnitState:
        await read.wait()
        return await unit_state(name)

    monkeypatch.setattr(bed.systemd, "unit_state", slow_read)
    return read


NOT_REACHED = (
    "did not reach systemd: Message recipient disconnected from message bus without "
    "replying (org.freedesktop.DBus.Error.NoReply); sent again in"
)


def test_two_stops_in_flight_that_did_not_reach_systemd_are_sent_again_once_after_the_longer_delay(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Our StopUnit of low.service, and a second one sent when its gate asked (its start job
    had outran our stop), both get NoReply: systemd re-executing. Each failure says, at
    DEBUG, which call, which unit, why and when it goes again (the delay doubling); the
    journal warns once. One StopUnit follows, after the longer delay: the second failure's
    timer replaces the first's, which would have sent one more, and then another. (Delays
    of an hour, each ended by the test: 50 ms ran out under load before the second failure.)"""
    monkeypatch.setattr(calls_module, "CALL_RETRY_FIRST", HOUR)
    monkeypatch.setattr(calls_module, "CALL_RETRY_MAX", 2 * HOUR)
    bed = low_runs_urgent_asks(tmp_path, cgroup_of)
    read = asyncio.Event()
    sent = scripted(bed, "stop", [Answer(NO_REPLY, read=read), Answer(NO_REPLY, read=read)])
    caplog.set_level(logging.DEBUG, logger="gpuslice")

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        await bed.acquire("low.service", ":1.8", 4243)
        assert stops(bed) == 2
        caplog.clear()
        read.set()
        await settle()
        assert ctl.calls._retry_delays[("low.service", "stop")] == 2 * HOUR  # doubled
        assert await due_now(ctl.calls._send_again) == 1  # the second's: the first's replaced
        assert len(sent) == 3
        assert await due_now(ctl.calls._send_again) == 0
        assert ctl.scheduler.phase("low.service") is Phase.STOPPING

    run(test)
    assert [(r.levelname, r.getMessage()) for r in caplog.records if "reach" in r.getMessage()] == [
        ("DEBUG", f"stop low.service {NOT_REACHED} 3600 s"),
        (
            "WARNING",
            f"stopping low.service {NOT_REACHED} 3600 s, and until systemd takes it (said once)",
        ),
        ("DEBUG", f"stop low.service {NOT_REACHED} 7200 s"),
        ("INFO", "stopping low.service reached systemd: sent again, it went through"),
    ]


def test_a_stop_sent_anew_cancels_the_timer_that_was_to_send_it_again(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Our StopUnit of low.service got NoReply; before its delay is over, low.service's gate
    asks and the stop is sent anew (it goes through). That call is the one sent again: the
    timer goes, or it sent a third StopUnit, which systemd merges into the running job and
    the tracker takes for someone else's stop (a hold, not a preemption)."""
    bed = lost_stop(tmp_path, cgroup_of, monkeypatch, retry_max=HOUR)
    caplog.set_level(logging.INFO, logger="gpuslice")

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        await bed.acquire("low.service", ":1.8", 4243)
        assert stops(bed) == 2
        assert await due_now(ctl.calls._send_again) == 0  # the timer went with the stop sent anew
        assert stops(bed) == 2
        assert ctl.calls._retry_timers == {}

    run(test)
    assert [m for m in messages(caplog) if "reach" in m] == [
        f"stopping low.service {NOT_REACHED} 3600 s, and until systemd takes it (said once)",
        "stopping low.service reached systemd: sent again, it went through",
    ]


def test_a_stop_not_sent_again_for_a_job_systemd_shows_is_a_new_story_the_next_time(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Our StopUnit got NoReply, yet systemd shows low.service still running with a job (our
    stop reached it after all, queued behind another job): nothing is sent again, since a
    second StopUnit would merge into that job and be taken for someone else's. The delay
    is forgotten: once low.service is back and stopped again, that stop is not said to be
    one "sent again", and a failing one is warned of anew."""
    bed = lost_stop(tmp_path, cgroup_of, monkeypatch, retry_max=HOUR)
    caplog.set_level(logging.INFO, logger="gpuslice")
    job = f"{JOB}77"

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        job_77_queued(bed, job)
        assert await due_now(ctl.calls._send_again) == 1
        assert stops(bed) == 1
        assert ctl.calls._retry_delays == {}
        stopping = {"ActiveState": "deactivating", "SubState": "stop-sigterm", "Job": (77, job)}
        ctl.on_unit_changed("low.service", stopping)
        down = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
        ctl.on_unit_changed("low.service", down)
        ctl.on_job_removed(77, job, "low.service", "done")
        await settle()
        await preempted_and_back(bed)
        ctl.on_unit_changed("low.service", {"ActiveState": "active", "SubState": "running"})
        await settle()
        await bed.acquire("urgent.service", ":1.10", 4242)
        await settle()
        assert stops(bed) == 2

    run(test)
    assert [m for m in messages(caplog) if "reach" in m] == [
        f"stopping low.service {NOT_REACHED} 3600 s, and until systemd takes it (said once)",
    ]
    assert errors(caplog) == []


def test_a_stop_that_went_through_beside_one_that_did_not_leaves_no_error_when_its_delay_ends(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two StopUnits of low.service in flight: the first gets NoReply, the second goes
    through (its job runs). When the first one's delay ends, nothing is sent (systemd shows
    the job), and the delay the second one's answer already forgot is not an error."""
    first, second = asyncio.Event(), asyncio.Event()
    job = f"{JOB}78"
    bed = lost_stop(tmp_path, cgroup_of, monkeypatch, Answer(job=job, read=second), read=first)
    caplog.set_level(logging.INFO, logger="gpuslice")

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        await bed.acquire("low.service", ":1.8", 4243)
        first.set()
        await settle()
        assert ctl.calls._retry_timers
        ctl.on_job_new(78, job, "low.service")
        second.set()
        await settle()
        stopping = {"ActiveState": "deactivating", "SubState": "stop-sigterm", "Job": (78, job)}
        ctl.on_unit_changed("low.service", stopping)
        assert await due_now(ctl.calls._send_again) == 1
        assert stops(bed) == 2
        assert ctl.calls._retry_timers == {} and ctl.calls._retry_delays == {}

    run(test)
    assert errors(caplog) == []


def test_a_start_refused_after_it_was_sent_again_ends_its_retries_for_good(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The requeue of low.service got NoReply; sent again, systemd refused it (an admin
    masked the unit meanwhile): low.service failed, said as an ERROR with systemd's words.
    That ends the story of the call that did not reach systemd: when low.service, started
    by hand later, is preempted and brought back, that start is not said to be one "sent
    again, it went through"."""
    monkeypatch.setattr(calls_module, "CALL_RETRY_FIRST", 0.02)
    bed = Bed(
        tmp_path,
        {"low.service": "Priority=90\n", "urgent.service": "Priority=10\n"},
        [state("low.service", "inactive", "dead"), state("urgent.service", "inactive", "dead")],
        SavedState(preempted={"low.service": 1}, seq=1),
        config=bed_config(tmp_path, stop_timeout=60.0),
    )
    cgroup_of[4242] = "urgent.service"
    cgroup_of[4243] = "low.service"
    masked = SystemdError("org.freedesktop.systemd1.UnitMasked", "Unit low.service is masked.")
    scripted(bed, "start", [Answer(NO_REPLY), Answer(masked)])
    caplog.set_level(logging.INFO, logger="gpuslice")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await until(lambda: ctl.scheduler.snapshot().failed == ["low.service"])
        await bed.acquire("low.service", ":1.8", 4243)  # unmasked, started by hand
        assert bed.service.granted == [("low.service", "0")]
        ctl.on_unit_changed("low.service", {"ActiveState": "active", "SubState": "running"})
        await bed.acquire("urgent.service", ":1.9", 4242)
        goes_down(bed, "low.service")
        await settle()
        assert bed.service.granted[-1] == ("urgent.service", "0")
        goes_down(bed, "urgent.service")
        await settle()
        assert bed.systemd.calls.count(("start", "low.service")) == 3

    run(test)
    said = messages(caplog)
    assert "start low.service failed: Unit low.service is masked." in said
    assert [m for m in said if "reached systemd" in m] == []


def test_a_start_no_longer_wanted_when_its_delay_ends_is_a_new_story_when_it_comes(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The requeue of low.service got NoReply, and urgent.service took the GPU before the
    delay was over: nothing is sent then, and that call's story ends. low.service comes
    back once urgent.service has ended, with a start that is its own: not said to be one
    "sent again, it went through", and no error on the way."""
    monkeypatch.setattr(calls_module, "CALL_RETRY_FIRST", HOUR)  # ended by the test
    bed = Bed(
        tmp_path,
        {"low.service": "Priority=90\n", "urgent.service": "Priority=10\n"},
        [state("low.service", "inactive", "dead"), state("urgent.service", "inactive", "dead")],
        SavedState(preempted={"low.service": 1}, seq=1),
    )
    cgroup_of[4242] = "urgent.service"
    sent = scripted(bed, "start", [Answer(NO_REPLY)])
    caplog.set_level(logging.INFO)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        await bed.acquire("urgent.service", ":1.9", 4242)
        assert bed.service.granted == [("urgent.service", "0")]
        assert await due_now(ctl.calls._send_again) == 1
        assert len(sent) == 1 and ctl.calls._retry_timers == {}
        goes_down(bed, "urgent.service")
        await settle()
        assert len(sent) == 2
        assert ctl.scheduler.phase("low.service") is Phase.STARTING

    run(test)
    assert [m for m in messages(caplog) if "reached systemd" in m] == []
    assert errors(caplog) == []


# ---- whose job ended the victim: the answers to our calls ----


def test_a_victim_down_while_our_failed_stop_was_in_flight_is_read_again_when_it_fails(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """low.service goes down while our StopUnit of it is unanswered: the tracker waits for
    the answer to know whose job ended it. The answer is an error (NoReply): the unit is
    read again and its end taken in, and urgent.service, waiting for that GPU, is granted.
    Unread, the end was never taken in and urgent.service waited for a victim long gone."""
    monkeypatch.setattr(calls_module, "CALL_RETRY_FIRST", 0.05)
    bed = low_runs_urgent_asks(tmp_path, cgroup_of)
    read = asyncio.Event()
    scripted(bed, "stop", [Answer(NO_REPLY, read=read)])

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        goes_down(bed, "low.service")
        await settle()
        assert bed.service.granted == [] and ctl.tracker.in_flight("low.service")
        read.set()
        await settle()
        assert bed.systemd.reads == ["low.service"]
        assert bed.service.granted == [("urgent.service", "0")]
        await past_time(asyncio.get_running_loop().time() + 0.05 * 2)
        assert stops(bed) == 1

    run(test)


def test_our_stop_merged_into_a_persons_stop_leaves_the_victim_held_not_preempted(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Someone queued a stop of low.service (`systemctl stop`) just before we preempted it:
    systemd merges our StopUnit into that job and answers with its path. The stop is theirs:
    low.service is held as they wanted once down, not brought back later as a unit we
    preempted (which would undo an admin's stop)."""
    bed = low_runs_urgent_asks(tmp_path, cgroup_of)
    job = f"{JOB}77"
    scripted(bed, "stop", [Answer(job=job)])
    caplog.set_level(logging.INFO)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        job_77_queued(bed, job)
        await bed.acquire("urgent.service", ":1.9", 4242)
        assert stops(bed) == 1
        stopping = {"ActiveState": "deactivating", "SubState": "stop-sigterm", "Job": (77, job)}
        ctl.on_unit_changed("low.service", stopping)
        down = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
        ctl.on_unit_changed("low.service", down)
        ctl.on_job_removed(77, job, "low.service", "done")
        await settle()
        assert bed.service.granted == [("urgent.service", "0")]
        assert "low.service" not in ctl.scheduler.preempted
        assert "low.service" in ctl.scheduler.held

    run(test)
    assert errors(caplog) == []  # an answer that found no delay to forget is no error


def retry_fires(bed: Bed, what: str, unit: str = "low.service") -> None:
    """The retry timer of our call (`what`) of `unit`, an hour long, fires now."""
    ctl = bed.controller
    ctl.calls._retry_timers[(unit, what)].cancel()
    ctl.calls._send_again(unit, what)


@pytest.mark.parametrize("job_new_heard", [True, False])
@pytest.mark.parametrize("shown", [("deactivating", "stop-sigterm"), ("active", "running")])
def test_a_stop_whose_answer_was_lost_is_not_sent_again_over_its_own_job(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    job_new_heard: bool,
    shown: tuple[str, str],
) -> None:
    """Someone floods our bus queue: systemd takes our StopUnit of low.service (its job 77
    runs, or waits its turn) but the bus daemon drops the answer (NO_REPLY after
    CALL_TIMEOUT) and the unit's PropertiesChanged with it (its JobNew too, or not). The
    signals show low.service running with no job; systemd is read before the stop is sent
    again, and the job it shows is taken in as ours. Sent again, the StopUnit merged into
    job 77, announced before it, and low.service was held as stopped by someone, never
    brought back; or, its JobNew lost too, its end was taken for one by itself (a job never
    announced, or, its deactivating dropped too, none shown before the end): finished,
    never brought back."""
    job = f"{JOB}77"
    read = asyncio.Event()
    bed = lost_stop(tmp_path, cgroup_of, monkeypatch, Answer(job=job), read=read)  # merged, if sent
    caplog.set_level(logging.INFO)

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        assert stops(bed) == 1
        bed.systemd.units["low.service"] = state("low.service", *shown, 77, "stop")
        if job_new_heard:
            ctl.on_job_new(77, job, "low.service")
        read.set()
        await settle()
        assert ctl.tracker.state("low.service").job_id == 0  # the signals' stale view
        retry_fires(bed, "stop")
        await settle()
        assert stops(bed) == 1
        assert bed.systemd.reads[-1] == "low.service"
        assert ctl.calls._retry_timers == {} and ctl.calls._retry_delays == {}
        bed.systemd.units["low.service"] = state("low.service", "inactive", "dead")
        if shown[0] == "active":  # signalled (the read showed its job still queued)
            stopping = {"ActiveState": "deactivating", "SubState": "stop-sigterm", "Job": (77, job)}
            ctl.on_unit_changed("low.service", stopping)
        down = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
        ctl.on_unit_changed("low.service", down)
        ctl.on_job_removed(77, job, "low.service", "done")
        await settle()
        assert bed.service.granted == [("urgent.service", "0")]
        assert "low.service" in ctl.scheduler.preempted
        assert "low.service" not in ctl.scheduler.held
        goes_down(bed, "urgent.service")
        await settle()
        assert bed.systemd.calls[-1] == ("start", "low.service")

    run(test)
    assert "stopping low.service reached systemd: its answer was lost, its job 77 runs" in (
        messages(caplog)
    )
    assert errors(caplog) == []


def test_a_stop_whose_answer_was_lost_and_whose_job_ended_unheard_is_not_sent_again(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, but our stop's job 77 has run and ended by the time the delay is over, its
    signals all dropped but its JobNew: the read shows low.service down. Nothing is sent;
    a second look, no signal having come, takes the end in: a preemption, its GPU granted
    to urgent.service, rather than left until the audits see it."""
    monkeypatch.setattr(rereads_module, "CONFIRM_DELAY", 0.0)  # the second look, next turn
    bed = lost_stop(tmp_path, cgroup_of, monkeypatch)
    job = f"{JOB}77"

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        ctl.on_job_new(77, job, "low.service")
        bed.systemd.units["low.service"] = state("low.service", "inactive", "dead")
        retry_fires(bed, "stop")
        await settle()
        assert stops(bed) == 1
        assert ctl.calls._retry_timers == {} and ctl.calls._retry_delays == {}
        assert bed.systemd.reads[-2:] == ["low.service", "low.service"]
        assert bed.service.granted == [("urgent.service", "0")]
        assert "low.service" in ctl.scheduler.preempted

    run(test)


def test_a_stop_whose_answer_was_lost_is_not_sent_again_over_its_job_waiting_at_the_gate(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, but someone restarted low.service before our StopUnit reached systemd: it
    waits at its gate (start job 76) when our stop replaces that job, and our stop's job 77
    waits its turn, its JobNew heard, its PropertiesChanged and our answer dropped. The read
    shows low.service at its gate with the stop job: that is taken in as ours, not a gate to
    stop. Sent again, the StopUnit merged into job 77, announced before it, and low.service
    was held as stopped by someone, never brought back."""
    restart, job = f"{JOB}76", f"{JOB}77"
    bed = lost_stop(tmp_path, cgroup_of, monkeypatch, Answer(job=job))  # merged, if sent

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        ctl.on_job_new(76, restart, "low.service")
        gate = {"ActiveState": "activating", "SubState": "start-pre", "Job": (76, restart)}
        ctl.on_unit_changed("low.service", gate)
        ctl.on_job_removed(76, restart, "low.service", "canceled")
        ctl.on_job_new(77, job, "low.service")
        bed.systemd.units["low.service"] = state(
            "low.service", "activating", "start-pre", 77, "stop"
        )
        await settle()
        retry_fires(bed, "stop")
        await settle()
        assert stops(bed) == 1
        assert ctl.calls._retry_timers == {} and ctl.calls._retry_delays == {}
        stopped_by_job_77(bed, job)
        await settle()
        assert bed.service.granted == [("urgent.service", "0")]
        assert "low.service" in ctl.scheduler.preempted
        assert "low.service" not in ctl.scheduler.held

    run(test)


def test_a_stop_to_send_again_whose_read_fails_is_read_again_after_the_next_delay(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Our StopUnit of low.service got NoReply; when its delay ends, the read of low.service
    fails too (the flood goes on): nothing is sent on the signals' word, and the read is
    tried again after the doubled delay. It shows low.service running with no job then (our
    stop never reached systemd): the stop is sent again, and its end is a preemption."""
    bed = lost_stop(tmp_path, cgroup_of, monkeypatch, retry_max=4 * HOUR)
    unit_state = bed.systemd.unit_state
    failing = [NO_REPLY]

    async def read(name: str) -> UnitState:
        if failing:
            raise failing.pop()
        return await unit_state(name)

    monkeypatch.setattr(bed.systemd, "unit_state", read)
    key = ("low.service", "stop")

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        assert stops(bed) == 1 and ctl.calls._retry_delays == {key: HOUR}
        retry_fires(bed, "stop")
        await settle()
        assert stops(bed) == 1 and not failing
        assert ctl.calls._retry_delays == {key: 2 * HOUR} and key in ctl.calls._retry_timers
        retry_fires(bed, "stop")
        await settle()
        assert stops(bed) == 2
        assert ctl.calls._retry_timers == {} and ctl.calls._retry_delays == {}
        goes_down(bed, "low.service")
        await settle()
        assert bed.service.granted == [("urgent.service", "0")]
        assert "low.service" in ctl.scheduler.preempted

    run(test)


def test_a_stop_sent_anew_while_the_read_before_its_resend_is_out_is_the_one_sent_again(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Our StopUnit of low.service got NoReply; its delay over, low.service is read first.
    Before the answer, low.service's gate asks and the stop is sent anew (not answered yet).
    The read then shows low.service running with no job: no third StopUnit follows, which
    would merge into the second's job, announced before it, and be taken for someone's."""
    answered = asyncio.Event()
    bed = lost_stop(tmp_path, cgroup_of, monkeypatch, Answer(job=f"{JOB}78", read=answered))
    read = held_reads(bed, monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        retry_fires(bed, "stop")
        await settle()
        await bed.acquire("low.service", ":1.8", 4243)
        assert stops(bed) == 2
        read.set()
        await settle()
        assert stops(bed) == 2
        answered.set()
        await settle()
        assert stops(bed) == 2
        assert ctl.calls._retry_timers == {} and ctl.calls._retry_delays == {}

    run(test)


def test_an_answer_told_as_it_was_read_is_not_counted_again_when_its_call_resumes(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """Two StopUnits of low.service: the first one's answer was read (its job is known to be
    ours) and the second, sent when low.service's gate asked, is unanswered. When the first
    call resumes, it must not count as answered a second time: that took the second call's
    place, and low.service's end, seen before the second answer, was judged without knowing
    whose job ended it. It waits for that answer; then urgent.service gets the GPU."""
    bed = low_runs_urgent_asks(tmp_path, cgroup_of)
    resume, read = asyncio.Event(), asyncio.Event()
    scripted(bed, "stop", [Answer(resume=resume), Answer(read=read)])

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        await bed.acquire("low.service", ":1.8", 4243)
        assert stops(bed) == 2
        resume.set()
        await settle()
        assert ctl.tracker.in_flight("low.service")
        goes_down(bed, "low.service")
        await settle()
        assert bed.service.granted == []
        read.set()
        await settle()
        assert bed.service.granted == [("urgent.service", "0")]
        assert "low.service" in ctl.scheduler.preempted

    run(test)


@pytest.mark.parametrize("answer_lost", ["before-its-end", "after-its-end"])
def test_a_persons_stop_ours_joined_is_theirs_when_our_answer_is_lost(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    answer_lost: str,
) -> None:
    """An admin's `systemctl stop low.service` is queued (job 77, its JobNew and every
    signal of it heard) just before we preempt low.service; our StopUnit joins that job,
    and the bus daemon drops systemd's answer (NO_REPLY), before or after the admin's stop
    ends the unit. The job that took low.service down was announced before ours was sent:
    the admin's, so low.service is held as they wanted, not brought back once urgent.service
    ends. Booked our preemption, it was restarted over the admin's stop."""
    job = f"{JOB}77"
    read = lost_answer_read(answer_lost)
    bed = lost_stop(tmp_path, cgroup_of, monkeypatch, read=read)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        job_77_queued(bed, job)
        await bed.acquire("urgent.service", ":1.9", 4242)
        await settle()
        assert stops(bed) == 1
        stopped_by_job_77(bed, job)
        read.set()
        await settle()
        assert bed.service.granted == [("urgent.service", "0")]
        assert "low.service" not in ctl.scheduler.preempted
        assert "low.service" in ctl.scheduler.held
        goes_down(bed, "urgent.service")
        await settle()
        assert ("start", "low.service") not in bed.systemd.calls
        assert stops(bed) == 1

    run(test)
    assert errors(caplog) == []


def test_a_stop_job_announced_after_our_unanswered_stop_was_sent_is_ours_its_end_a_preemption(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but job 77 is announced after our StopUnit was sent, every signal of it
    heard, systemd's answer dropped: systemd takes calls in the order they reach it, so
    that is the job ours queued (a person's stop that came later joined it). Its end is a
    preemption, and low.service comes back once urgent.service ends."""
    stopped_by_job_77_and_back(lost_stop(tmp_path, cgroup_of, monkeypatch), announced=True)


@pytest.mark.parametrize("answer", ["heard", "lost"])
def test_a_victim_down_with_every_signal_lost_is_preempted_once_two_audits_show_it(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    """Our StopUnit of low.service ran, and every signal of its job was dropped (JobNew,
    PropertiesChanged, JobRemoved), its answer too or not: two audits find low.service
    down. A stop of ours was sent: its end is a preemption (not an end by itself), and it
    comes back once urgent.service ends."""
    monkeypatch.setattr(calls_module, "CALL_RETRY_FIRST", HOUR)
    monkeypatch.setattr(rereads_module, "AUDIT_INTERVAL", HOUR)  # driven by hand here
    bed = low_runs_urgent_asks(tmp_path, cgroup_of)
    if answer == "lost":
        scripted(bed, "stop", [Answer(NO_REPLY)])

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        await settle()
        bed.systemd.units["low.service"] = state("low.service", "inactive", "dead")
        await ctl.reads.audit()
        assert bed.service.granted == []  # a first look may be ahead of a signal
        await ctl.reads.audit()
        await settle()
        await preempted_and_back(bed)

    run(test)


def test_our_stop_whose_job_new_was_lost_is_no_end_by_itself(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """Our StopUnit of low.service is answered (job 77, told as the answer is read), but the
    bus daemon dropped the job's JobNew; its PropertiesChanged come. low.service leaves
    running with job 77, which no JobNew announced: that job is ours, as its answer said,
    not a oneshot's start job. Its end is a preemption: taken for an end by itself, low.service
    was booked finished and never brought back."""
    bed = low_runs_urgent_asks(tmp_path, cgroup_of)
    job = f"{JOB}77"
    scripted(bed, "stop", [Answer(job=job)])
    stopped_by_job_77_and_back(bed)


@pytest.mark.parametrize("answer_lost", ["before-its-end", "after-its-end"])
def test_our_stop_whose_answer_and_job_new_were_lost_is_a_preemption(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch, answer_lost: str
) -> None:
    """The bus daemon drops our StopUnit's answer and its job's JobNew, not the job's
    PropertiesChanged: low.service leaves running with job 77, which nothing announced, while
    our stop has no answer. That job is taken for ours, as a read finding it is: its end is a
    preemption, and low.service comes back once urgent.service ends. Taken for the end of a
    unit that ended by itself, low.service was booked finished, never brought back."""
    read = lost_answer_read(answer_lost)
    stopped_by_job_77_and_back(lost_stop(tmp_path, cgroup_of, monkeypatch, read=read), read=read)


# ---- the stop timer ----


def test_a_victims_stop_timer_ends_with_it_and_its_next_stop_is_timed_afresh(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """low.service, preempted, goes down in time: its stop timer goes with it. Brought back
    and preempted again after an admin raised stop_timeout, its new stop is overdue only
    once the new timeout has passed, said once: the first stop's timer, left running, said
    a stop overdue that had just begun. (Timeouts of hours, ended by the test: one of 0.2 s
    ran out under load before the test had the victim go down.)"""
    bed = low_runs_urgent_asks(tmp_path, cgroup_of)
    ctl = bed.controller
    ctl.config = dataclasses.replace(ctl.config, stop_timeout=HOUR)
    caplog.set_level(logging.INFO, logger="gpuslice")

    async def test() -> None:
        loop = asyncio.get_running_loop()
        await urgent_asks(bed)
        goes_down(bed, "low.service")
        await settle()
        assert bed.service.granted == [("urgent.service", "0")]
        assert ctl.calls._stop_timers == {}
        goes_down(bed, "urgent.service")
        await settle()
        assert bed.systemd.calls[-1] == ("start", "low.service")
        ctl.on_unit_changed("low.service", {"ActiveState": "active", "SubState": "running"})
        ctl.config = dataclasses.replace(ctl.config, stop_timeout=2 * HOUR)
        second = loop.time()
        await bed.acquire("urgent.service", ":1.10", 4242)
        assert stops(bed) == 2
        assert ctl.calls._stop_timers["low.service"].when() >= second + 2 * HOUR
        caplog.clear()
        assert await due_now(ctl.calls._stop_overdue) == 1  # the new stop's only
        assert ctl.calls._stop_timers == {}  # it fired: nothing left to cancel

    run(test)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "low.service (priority 90) has not stopped 7200 s after gpuslice asked "
            "(urgent.service waits for it): see its TimeoutStopSec= and ExecStop=",
        ),
        (
            "INFO",
            "urgent.service waiting for low.service (priority 90) to stop on GPU 0 (still "
            "running 7200 s after the stop)",
        ),
    ]


def test_a_stop_timer_left_by_a_withdrawn_start_is_replaced_by_the_next_stops(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The requeue of low.service is in flight when a daemon-reload takes its annotation
    out: the start is withdrawn (a StopUnit, timed); systemd then refuses the start (the
    unit was masked) and low.service is forgotten, its stop timer still running. Annotated
    again, started by hand and preempted after an admin raised stop_timeout, that new
    stop is timed by the new timeout: arming it replaces the old timer, which would have
    called the new stop overdue as it began."""
    bed = Bed(
        tmp_path,
        {"low.service": "Priority=90\n", "urgent.service": "Priority=10\n"},
        [state("low.service", "inactive", "dead"), state("urgent.service", "inactive", "dead")],
        SavedState(preempted={"low.service": 1}, seq=1),
        # an hour: the old timer is still armed when the new stop begins, however slow the
        # machine (at 0.3 s, then 2 s, it fired first on one busy with other tests)
        config=bed_config(tmp_path, stop_timeout=3600.0),
    )
    cgroup_of[4242] = "urgent.service"
    cgroup_of[4243] = "low.service"
    masked = SystemdError("org.freedesktop.systemd1.UnitMasked", "Unit low.service is masked.")
    read = asyncio.Event()
    scripted(bed, "start", [Answer(masked, read=read)])
    caplog.set_level(logging.INFO, logger="gpuslice")

    async def test() -> None:
        ctl = bed.controller
        loop = asyncio.get_running_loop()
        await ctl.start()
        await settle()
        write_unannotated(tmp_path, "low.service")
        ctl.rescans.request()
        await until(lambda: stops(bed) == 1)
        old = ctl.calls._stop_timers["low.service"]
        read.set()
        await settle()
        assert ctl.scheduler.phase("low.service") is None
        write_unit(tmp_path, "low.service", "Priority=90\n")
        ctl.rescans.request()
        await until(lambda: ctl.spec_for("low.service") is not None and ctl.rescans.task is None)
        ctl.config = dataclasses.replace(ctl.config, stop_timeout=60.0)
        await bed.acquire("low.service", ":1.8", 4243)
        assert bed.service.granted == [("low.service", "0")]
        ctl.on_unit_changed("low.service", {"ActiveState": "active", "SubState": "running"})
        began = loop.time()
        await bed.acquire("urgent.service", ":1.9", 4242)
        assert stops(bed) == 2
        new = ctl.calls._stop_timers["low.service"]
        # left armed, the old timer would call the new stop overdue at its own moment
        assert old.cancelled() and new is not old
        assert new.when() >= began + 60.0  # timed by the new timeout
        assert ctl.scheduler.phase("low.service") is Phase.STOPPING

    run(test)
    assert [m for m in messages(caplog) if "has not stopped" in m] == []


# ---- how long a unit waited at its gate ----


class Clock:
    """The controller's clock (gpuslice.clock's `time`), moved by the test."""

    CLOCK_BOOTTIME = time.CLOCK_BOOTTIME

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return 1_700_000_000.0 + self.now

    def clock_gettime(self, which: int) -> float:
        assert which == time.CLOCK_BOOTTIME
        return self.now


class FakeJournal:
    """gpuslice.journal.Journal's side the controller uses: each entry sent, as fields."""

    def __init__(self) -> None:
        self.entries: list[list[tuple[str, str]]] = []
        self.failures = 0

    def send(self, fields: list[tuple[str, str]]) -> bool:
        self.entries.append(list(fields))
        return True

    def of(self, unit: str, decision: str) -> list[dict[str, str]]:
        """The entries of `unit`'s decisions of that code, each as a dict of its fields."""
        return [
            dict(e)
            for e in self.entries
            if ("GPUSLICE_UNIT", unit) in e and ("GPUSLICE_DECISION", decision) in e
        ]


def test_a_grant_says_how_long_its_unit_waited_at_its_gate_from_when_it_began_to_wait(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The journal entry of a grant carries GPUSLICE_WAITED_USEC, and the admission-wait
    histogram (`gpuslice metrics`) the same seconds: 0 for a unit granted at once, and for
    one that waited, the time since its gate first asked, not since the last decision that
    touched it (another unit's arrival). A waiter's own "waiting" entry is a decision of its
    unit's journal too, with no wait of its own. Once granted, a unit no longer counts as
    waiting (status's "waiting since")."""
    clock = Clock()
    monkeypatch.setattr(clock_module, "time", clock)
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=90\n", "b.service": "Priority=95\n", "c.service": "Priority=99\n"},
        [],
    )
    journal = FakeJournal()
    ctl = bed.controller
    ctl.journal = cast(Journal, journal)
    for pid, name in enumerate(("a.service", "b.service", "c.service"), start=4242):
        cgroup_of[pid] = name
    caplog.set_level(logging.INFO, logger="gpuslice")

    async def test() -> None:
        await ctl.start()
        await bed.acquire("a.service", ":1.1", 4242)
        ctl.on_unit_changed("a.service", {"ActiveState": "active", "SubState": "running"})
        await bed.acquire("b.service", ":1.2", 4243)
        clock.now += 5
        await bed.acquire("c.service", ":1.3", 4244)
        clock.now += 5
        goes_down(bed, "a.service")
        await settle()
        assert bed.service.granted == [("a.service", "0"), ("b.service", "0")]
        assert set(ctl.waiting_since) == {"c.service"}
        assert ctl.waiting_since["c.service"] == 1005.0

    run(test)
    [at_once] = journal.of("a.service", "grant")
    assert at_once["GPUSLICE_WAITED_USEC"] == "0"
    [waited] = journal.of("b.service", "grant")
    assert waited["GPUSLICE_WAITED_USEC"] == "10000000"
    [wait] = journal.of("b.service", "wait")
    assert "GPUSLICE_WAITED_USEC" not in wait
    assert wait["MESSAGE"] == "b.service waiting: GPU 0 held by a.service, priority 90"
    histogram = ctl.counters.admission_wait
    assert (histogram.count, histogram.total) == (2, 10.0)
    assert not [m for m in messages(caplog) if "waiting:" in m]  # the journal took them


# ---- the freezer ----


def emb_frozen_beside_voice(tmp_path: Path) -> Bed:
    """emb.service (90, Preempt=freeze suspend stop) frozen beside voice.service (10) on
    GPU 0; urgent.service (5) may ask for the whole GPU."""
    return frozen_beside_voice(
        tmp_path, preempt="freeze suspend stop", others={"urgent.service": "Priority=5\n"}
    )


def test_one_check_of_the_freezer_at_a_time_however_many_samples_come_meanwhile(
    tmp_path: Path,
) -> None:
    """Each NVML sample asks whether someone thawed a unit gpuslice froze (systemd signals
    no FreezerState change). A check whose answer is slow (a busy systemd) is not joined by
    one more per sample: one at a time, and the next sample after it asks again."""
    bed = emb_frozen_beside_voice(tmp_path)
    answer = asyncio.Event()
    asked: list[str] = []
    read = bed.systemd.freezer_state

    async def slow(name: str) -> str:
        asked.append(name)
        await answer.wait()
        return await read(name)

    bed.systemd.freezer_state = slow  # type: ignore[method-assign]

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert asked == ["emb.service"]  # at start-up
        ctl.watch.refresh()
        ctl.watch.refresh()
        await settle()
        assert asked == ["emb.service"]
        answer.set()
        await until(lambda: not ctl._checking_thaws)
        ctl.watch.refresh()
        await settle()
        assert asked == ["emb.service", "emb.service"]
        assert bed.systemd.calls.count(("thaw", "emb.service")) == 0  # frozen, as held

    run(test)


def test_a_frozen_unit_given_way_by_suspend_is_thawed_before_its_memory_is_moved(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """emb.service, frozen beside voice.service, must give its VRAM to urgent.service: its
    next rung is suspend, and cuda-checkpoint can neither lock nor checkpoint a frozen
    process, so it is thawed first (here the suspend then fails, no cuda-checkpoint being
    installed, and it is stopped instead)."""
    bed = emb_frozen_beside_voice(tmp_path)
    cgroup_of[4242] = "urgent.service"
    caplog.set_level(logging.INFO, logger="gpuslice")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await until(lambda: not ctl._checking_thaws)
        await bed.acquire("urgent.service", ":1.9", 4242)
        await until(lambda: ("stop", "emb.service") in bed.systemd.calls)
        calls = [c for c in bed.systemd.calls if c[1] == "emb.service" and c[0] != "freezer_state"]
        assert calls[:2] == [("thaw", "emb.service"), ("stop", "emb.service")], calls

    run(test)
    assert "cuda-checkpoint is not installed" in caplog.text


# ---- whose processes are on the GPUs ----


class TwoJobs(StubNvml):
    """The two GPUs: PID 200 on GPU 0, PID 201 on GPU 1 (1 GiB each); once `hang` is set,
    each listing hangs (a driver that stops answering) until `release` is."""

    def __init__(self) -> None:
        super().__init__()
        self.hang = threading.Event()
        self.release = threading.Event()

    def processes(self, index: int) -> list[GpuProcess]:
        if self.hang.is_set():
            hang_until(self.release)
        return [GpuProcess(200 + index, index, GIB, compute=True)]


def processes_of(tmp_path: Path, units: dict[int, str]) -> None:
    """/proc for each PID: its cgroup (its unit's), its command."""
    for pid, unit in units.items():
        process_in(tmp_path, pid, f"/system.slice/{unit}")


def test_the_processes_of_a_unit_annotated_or_holding_gpus_or_followed_are_not_foreign(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """A process is foreign (counted against its GPU, yielded to by background units) only
    if its unit is none of: annotated, holding GPUs, followed. Each alone is enough:
    a.service was granted over D-Bus, and systemd's signals of its start were dropped (a
    full queue: anyone can fill it), so nothing of it is followed; b.service is annotated
    and runs, and has not been read yet (annotated while it ran, say)."""
    processes_of(tmp_path, {200: "a.service", 201: "b.service"})
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n", "b.service": "Priority=50\n"},
        [],
        config=bed_config(tmp_path, gpus=2),
        nvml=TwoJobs(),
    )
    cgroup_of[4242] = "a.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await bed.acquire("a.service", ":1.9", 4242)
        assert bed.service.granted == [("a.service", "0")]
        assert "a.service" not in ctl.tracker.states and "b.service" not in ctl.tracker.states
        ctl.watch.refresh()
        gpus = json.loads(ctl.status_json())["gpus"]
        assert [g["foreign"] for g in gpus] == [[], []]

    run(test)


def test_the_ladder_is_given_the_processes_of_a_sample_taken_now_or_none_it_can_trust(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a suspend checks its unit's processes against (and confirms gone after the
    checkpoint) is a sample taken now, each process with its unit; with NVML hung, the last
    sample is stale and the ladder gets None (a suspend is then refused, never run on an old
    list), as without NVML."""
    monkeypatch.setattr(gpuwatch_module, "NVML_DEADLINE", 0.05)
    patient_nvml(monkeypatch)
    processes_of(tmp_path, {200: "a.service", 201: "b.service"})
    nvml = TwoJobs()
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n"},
        [state("a.service", "active", "running")],
        SavedState(holders={"a.service": ((0,), "running", 1, "")}, seq=1),
        config=bed_config(tmp_path, gpus=2),
        nvml=nvml,
    )
    without = Bed(tmp_path / "no-nvml", {}, [])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        seen = ctl.ladder.processes()
        assert seen is not None
        assert [(p.pid, p.gpu, p.unit) for p in seen] == [(200, 0, "a.service"), (201, 1, None)]
        nvml.hang.set()
        assert ctl.ladder.processes() is None
        nvml.release.set()
        await without.controller.start()
        assert without.controller.ladder.processes() is None

    try:
        run(test)
    finally:
        nvml.release.set()


# ---- the state file and STATUS= ----


def test_a_state_file_that_cannot_be_written_is_said_once_with_its_error_and_when_it_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Neither state_dir nor runtime_dir can be written (a read-only /var, a full /run): the
    journal says so once, with the path and the error, however many saves fail (each is
    counted), and says when a save works again."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    ctl = bed.controller
    write = state_module._write_atomic
    broken = [OSError(30, "Read-only file system")]

    def read_only(path: Path, data: bytes) -> None:
        if broken:
            raise broken[0]
        write(path, data)

    monkeypatch.setattr(state_module, "_write_atomic", read_only)
    caplog.set_level(logging.INFO, logger="gpuslice")

    async def test() -> None:
        await ctl.start()
        for n in range(1, 4):
            ctl._save_due = True
            ctl.save_now()
            assert ctl.counters.errors["state_save_errors"] == n
        broken.clear()
        ctl._save_due = True
        ctl.save_now()
        assert ctl.counters.errors["state_save_errors"] == 3

    run(test)
    assert [(r.levelname, r.getMessage()) for r in caplog.records if "save" in r.getMessage()] == [
        (
            "ERROR",
            f"cannot save state to {ctl.store.path}: [Errno 30] Read-only file system (said "
            "once until it works)",
        ),
        ("INFO", f"state saved to {ctl.store.path} again"),
    ]


def test_status_goes_to_systemd_once_per_delay_for_every_change_meanwhile(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """STATUS= (`systemctl status gpuslice`) is sent STATUS_DELAY after a change, once for
    every change meanwhile (each one costs a PropertiesChanged of gpuslice.service that the
    controller itself reads, issue 10), with the line of that moment; and again after the
    next change. (A delay of an hour, ended by the test: one of 0.4 s ran out under load
    between the two changes.)"""
    monkeypatch.setattr(controller_module, "STATUS_DELAY", HOUR)
    bed = Bed(tmp_path, {"a.service": "Priority=50\n", "b.service": "Priority=60\n"}, [])
    ctl = bed.controller
    cgroup_of[4242], cgroup_of[4243] = "a.service", "b.service"
    sent: list[str] = []
    ctl.notifier.status = sent.append  # type: ignore[method-assign, assignment]
    saves: list[float] = []
    persist = ctl._persist

    def counted() -> None:
        saves.append(asyncio.get_running_loop().time())
        persist()

    ctl._persist = counted  # type: ignore[method-assign]

    async def test() -> None:
        await ctl.start()
        saves.clear()
        await bed.acquire("a.service", ":1.1", 4242)
        await bed.acquire("b.service", ":1.2", 4243)
        assert bed.service.granted == [("a.service", "0")]
        assert len(saves) == 2  # the grant's, then the wait's
        assert sent == []
        assert await due_now(ctl._send_status) == 1  # one for both
        assert await due_now(ctl._send_status) == 0
        assert sent == ["1 GPU: a.service running; 1 waiting"]
        goes_down(bed, "a.service")
        await settle()
        assert await due_now(ctl._send_status) == 1
        assert sent[1:] == ["1 GPU: b.service running; 0 waiting"]

    run(test)


# ---- the controller's tasks ----


def test_a_call_whose_answer_is_pending_is_kept_through_a_garbage_collection(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """asyncio keeps only a weak reference to a task: one that nothing else holds, waiting
    on an answer nothing else holds either, is collected, "destroyed but it is pending", and
    the answer it awaited is never taken in. The controller holds each task it starts until
    it ends: the StopUnit still in flight when the collector runs is answered and its job
    taken for ours (low.service is preempted, and urgent.service gets the GPU)."""
    bed = low_runs_urgent_asks(tmp_path, cgroup_of)
    answers: list[weakref.ref[asyncio.Future[str]]] = []
    stop = bed.systemd.stop_unit

    def unheld(name: str, queued: Queued | None = None) -> Awaitable[str]:
        bed.systemd.calls.append(("stop", name))
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        answers.append(weakref.ref(answer))

        async def answered() -> str:
            path = await answer
            if queued is not None:
                queued(path)
            return path

        return answered()

    bed.systemd.stop_unit = unheld  # type: ignore[method-assign]
    caplog.set_level(logging.INFO)

    async def test() -> None:
        ctl = bed.controller
        await urgent_asks(bed)
        bed.systemd.stop_unit = stop  # type: ignore[method-assign]
        gc.collect()
        await settle()
        [answer] = [ref() for ref in answers]
        assert answer is not None, "the call's task was collected"
        job = f"{JOB}79"
        ctl.on_job_new(79, job, "low.service")
        answer.set_result(job)
        await settle()
        assert not ctl.tracker.in_flight("low.service")
        stopping = {"ActiveState": "deactivating", "SubState": "stop-sigterm", "Job": (79, job)}
        ctl.on_unit_changed("low.service", stopping)
        goes_down(bed, "low.service")
        ctl.on_job_removed(79, job, "low.service", "done")
        await settle()
        assert bed.service.granted == [("urgent.service", "0")]
        assert "low.service" in ctl.scheduler.preempted

    run(test)
    assert errors(caplog) == []


def test_a_retry_whose_pass_decides_a_signal_of_the_same_turn_ends_the_retry_quietly(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The requeue of low.service got NoReply, and mid.service took GPU 0 meanwhile. The
    delay ends in the same turn of the loop in which a signal shows urgent.service at its
    gate: the pass of that signal's batch, not run yet, is the retry's own; it stops
    mid.service for urgent.service, says so, and starts nothing of low.service's. The
    retry's story ends there, without an error; low.service comes back later with a start
    of its own, not said to be one "sent again"."""
    # never due by itself: the test ends the delay (a delay of 0.1 s ended, on a loaded
    # machine, before the test had put the signal in the socket, or even read the timer)
    monkeypatch.setattr(calls_module, "CALL_RETRY_FIRST", 3600.0)
    bed = Bed(
        tmp_path,
        {
            "low.service": "Priority=90\n",
            "mid.service": "Priority=50\n",
            "urgent.service": "Priority=10\n",
        },
        [state("low.service", "inactive", "dead")],
        SavedState(preempted={"low.service": 1}, seq=1),
        config=bed_config(tmp_path, stop_timeout=60.0),
    )
    cgroup_of[4242] = "mid.service"
    sent = scripted(bed, "start", [Answer(NO_REPLY)])
    caplog.set_level(logging.INFO)
    reader, writer = socket.socketpair()

    async def test() -> None:
        ctl = bed.controller
        loop = asyncio.get_running_loop()
        await ctl.start()
        await settle()
        ctl.calls._retry_timers[("low.service", "start")].cancel()
        await bed.acquire("mid.service", ":1.9", 4242)
        ctl.on_unit_changed("mid.service", {"ActiveState": "active", "SubState": "running"})

        def signal_read() -> None:  # the bus's socket: read before the turn's timers run
            reader.recv(1)
            loop.remove_reader(reader)
            ctl.on_job_new(5, f"{JOB}5", "urgent.service")
            ctl.on_unit_changed("urgent.service", at_gate())

        loop.add_reader(reader, signal_read)
        writer.send(b"x")  # the signal is in the socket as the delay ends: one turn has both
        loop.call_at(loop.time(), ctl.calls._send_again, "low.service", "start")
        await until(lambda: not ctl.calls._retry_timers)
        await settle()
        assert len(sent) == 1
        assert bed.systemd.calls[-1] == ("stop", "mid.service")
        goes_down(bed, "mid.service")
        await settle()
        assert ctl.scheduler.grants() == {"urgent.service": frozenset({0})}
        goes_down(bed, "urgent.service")
        await settle()
        assert bed.systemd.calls[-1] == ("start", "mid.service")  # preempted, it comes first
        goes_down(bed, "mid.service")
        await settle()
        assert bed.systemd.calls.count(("start", "low.service")) == 2

    try:
        run(test)
    finally:
        reader.close()
        writer.close()
    assert [m for m in messages(caplog) if "reached systemd" in m] == []
    assert errors(caplog) == []
