"""gpuslice/calls.py: refusals held for jobs under way, what mutation testing found untested.

The fakes are tests/test_calls.py's (Kit): the core, the tracker and systemd stand-ins that
record what they were asked. Each test says the rule a user relies on.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from gpuslice import calls as calls_module
from gpuslice.core.scheduler import Phase
from gpuslice.systemd import SystemdError, job_path
from gpuslice.tracker import UnitState
from tests.test_calls import (
    D_QUEUED,
    MASKED,
    OWN_JOB,
    A,
    D,
    Kit,
    U,
    _held_for_d,
    _refused_while_d_is_read,
    _stopping_for_a,
    answering,
    run,
)

NAMING_D = SystemdError(
    "org.freedesktop.systemd1.TransactionIsDestructive",
    "Transaction for low.service/stop is destructive (d.service has 'start' job queued",
)
V = "other.service"
E = "e.service"


def test_a_stop_that_goes_through_starts_the_count_of_stops_asked_again_anew(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ASKED_AGAIN_MAX bounds the refusals *in a row*: a stop that reached systemd ends the
    row, and the next refusal for a job gone by the read is asked again (the journal says
    for whose job), not held for the waiter's whole wait."""
    caplog.set_level(logging.INFO, logger="gpuslice")
    again = f"stop_failed {U}: {NAMING_D.text} refused=False"

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.systemd.needed[A] = {"Requires": []}
        for _ in range(calls_module.ASKED_AGAIN_MAX):
            kit.calls.send(answering([NAMING_D], []), U, "stop")
            await kit.done()
            assert kit.executed[-1] == again
        kit.calls.send(answering([job_path(9)], []), U, "stop")
        await kit.done()
        kit.calls.send(answering([NAMING_D], []), U, "stop")
        await kit.done()
        assert kit.executed[-1] == again

    run(test)
    said = f"stopping {U} refused for a job of {D}, ended since: asked again"
    assert said in caplog.messages


def test_a_stop_refused_for_its_own_job_reads_no_jobs_where_no_unit_needs_it() -> None:
    """Nobody needs the victim, and the refusal names no other unit: no jobs to read, so no
    second call to systemd (each one delays the waiter's stop, and may fail or hang)."""

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.systemd.answers = [OWN_JOB, job_path(9)]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()
        assert kit.systemd.read == [f"needed_by {U}"]
        assert kit.systemd.stops[-1] == f"{U} replace"

    run(test)


def test_as_many_units_needing_the_victim_as_needed_by_max_are_read() -> None:
    """NEEDED_BY_MAX is the most read, not one fewer: that many, none with a job, and the
    stop is sent again in mode "replace"."""

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        many = [f"u{i}.service" for i in range(calls_module.NEEDED_BY_MAX)]
        kit.systemd.needers[U] = {"RequiredBy": many}
        kit.systemd.answers = [OWN_JOB, job_path(9)]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()
        assert kit.systemd.stops[-1] == f"{U} replace"
        assert kit.executed == []

    run(test)


@pytest.mark.parametrize("broken", ["fails", "bad-job", "too-many"])
def test_the_journal_says_why_the_jobs_of_units_needing_the_victim_went_unread(
    broken: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The refusal held for a read that failed: the journal names the victim and the cause
    (systemd's error, a job in a form not systemd's, how many units need it)."""
    error = SystemdError("org.freedesktop.DBus.Error.NoReply", "no reply")

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        if broken == "fails":
            kit.systemd.needers[U] = error
        elif broken == "bad-job":
            kit.systemd.needers[U] = {"RequiredBy": [D]}
            kit.systemd.states[D] = UnitState(D, "inactive", "dead", "12", "start")  # type: ignore[arg-type]
        else:
            many = [f"u{i}.service" for i in range(calls_module.NEEDED_BY_MAX + 1)]
            kit.systemd.needers[U] = {"RequiredBy": many}
        kit.systemd.answers = [OWN_JOB]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()

    run(test)
    why = {
        "fails": str(error),
        "bad-job": "job '12' is no number",
        "too-many": f"{calls_module.NEEDED_BY_MAX + 1} units need it, more than "
        f"{calls_module.NEEDED_BY_MAX}",
    }[broken]
    said = f"cannot read the jobs of the units that need {U}: {why}; not stopped"
    assert said in caplog.messages


def test_the_journal_names_every_unit_whose_job_holds_the_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.systemd.needers[U] = {"RequiredBy": [D, E]}
        kit.systemd.states[D] = D_QUEUED
        kit.systemd.states[E] = UnitState(E, "inactive", "dead", 20, "start")
        kit.systemd.answers = [OWN_JOB]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        await kit.done()

    run(test)
    said = f"stopping {U} would cancel the jobs of {D}, {E}, which need it: not stopped"
    assert said in caplog.messages


def test_a_job_ending_while_two_victims_are_read_ends_the_refusal_read_last() -> None:
    """Two refusals read at once: the first read over, a job that ends during the second is
    still told to the refusal it holds (else that one held for the victim's whole run)."""

    async def test(kit: Kit) -> None:
        _stopping_for_a(kit)
        kit.scheduler.phases[V] = Phase.STOPPING
        kit.scheduler.waiter[V] = A
        kit.systemd.needers[U] = {"RequiredBy": [D]}
        kit.systemd.states[D] = D_QUEUED
        u_read = asyncio.Event()
        needed_by = kit.systemd.needed_by

        async def blocking(name: str) -> dict[str, list[str]]:
            if name == U:
                await u_read.wait()
            return await needed_by(name)

        kit.systemd.needed_by = blocking  # type: ignore[method-assign]
        v_own = SystemdError(OWN_JOB.name, OWN_JOB.text.replace(U, V))
        kit.systemd.answers = [OWN_JOB, v_own, job_path(9)]
        kit.calls.send(kit.systemd.stop_unit, U, "stop")
        kit.calls.send(kit.systemd.stop_unit, V, "stop")
        for _ in range(20):
            await asyncio.sleep(0)
        assert kit.systemd.stops[-1] == f"{V} replace"  # V's read is over
        kit.calls.job_ended(12, D)  # D's start, during U's read
        u_read.set()
        await kit.done()
        assert kit.executed[-1] == f"jobs_ended {U}"

    run(test)


def test_job_ends_remembered_during_a_read_are_bounded_past_it_the_refusal_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ENDED_MAX ends at most are remembered while reads are under way (a flood of signals
    costs no memory): past it, a refusal held for a job that ended meanwhile holds (the
    safe side)."""
    monkeypatch.setattr(calls_module, "ENDED_MAX", 1)

    async def test(kit: Kit) -> None:
        await _refused_while_d_is_read(kit)
        kit.calls.job_ended(30, "flood.service")
        kit.calls.job_ended(12, D)
        assert len(kit.calls._ended) == 1
        kit.systemd.jobs_read.set()
        await kit.done()
        assert kit.executed == [f"stop_failed {U}: {OWN_JOB.text} refused=True while_waits for {D}"]

    run(test)


async def _held_for_e(kit: Kit) -> None:
    """V's stop, for A, refused for its own start (job 21) with E's start (job 20) queued
    behind it: held for both."""
    kit.scheduler.phases[V] = Phase.STOPPING
    kit.scheduler.waiter[V] = A
    kit.tracker.states[V] = UnitState(V, "activating", "start-post", 21, "start")
    kit.systemd.needers[V] = {"RequiredBy": [E]}
    kit.systemd.states[E] = UnitState(E, "inactive", "dead", 20, "start")
    text = OWN_JOB.text.replace(U, V)
    kit.systemd.answers = [SystemdError(OWN_JOB.name, text)]
    kit.calls.send(kit.systemd.stop_unit, V, "stop")
    await kit.done()
    assert kit.executed[-1].endswith(f"refused=True while_waits for {E},{V}")


def test_the_end_of_a_job_ends_the_refusal_held_for_it_whichever_victim_was_held_first() -> None:
    async def test(kit: Kit) -> None:
        await _held_for_d(kit)
        await _held_for_e(kit)
        kit.executed.clear()
        kit.calls.job_ended(20, E)
        assert kit.executed == [f"jobs_ended {V}"]
        kit.calls.job_ended(12, D)
        assert kit.executed[1:] == [f"jobs_ended {U}"]

    run(test)


def test_a_stop_sent_again_after_a_hold_is_not_ended_by_the_jobs_the_hold_was_for() -> None:
    """The stop sent anew (its gate asked while the core stops it) decides anew: the jobs
    the last refusal held for end nothing."""

    async def test(kit: Kit) -> None:
        await _held_for_d(kit)
        kit.calls.send(answering([job_path(9)], []), U, "stop")
        await kit.done()
        kit.calls.job_ended(12, D)
        assert kit.executed == []

    run(test)


def test_a_stop_refused_after_a_hold_since_it_was_sent_leaves_that_hold_to_its_jobs() -> None:
    """Two stops of the victim under way (its gate asked while the core stopped it): the
    first one refused for jobs under way holds for them; the second, refused so it takes
    no new stop (the core, no longer stopping the unit, ignores it), leaves that hold be:
    the end of D's job still ends it, not the victim's whole run."""

    async def test(kit: Kit) -> None:
        later: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        kit.calls.send(lambda unit, queued: later, U, "stop")
        answer, kit.tasks = kit.tasks, set()  # awaited once answered
        await _held_for_d(kit)
        later.set_exception(MASKED)
        await asyncio.gather(*answer)
        assert kit.executed == [f"stop_failed {U}: {MASKED.text} refused=True"]
        kit.calls.job_ended(12, D)
        assert kit.executed[1:] == [f"jobs_ended {U}"]

    run(test)
