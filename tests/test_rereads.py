"""gpuslice/rereads.py on its own: a real Tracker, a systemd that answers reads from a table.

The controller's tests drive the same reads through whole scenarios (a victim whose end only a
read tells, a lost signal); these pin each rule of the module in milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Coroutine
from typing import Any, cast

import pytest

from gpuslice import rereads as rereads_module
from gpuslice.counters import Counters
from gpuslice.rereads import Rereads
from gpuslice.systemd import Systemd, SystemdError
from gpuslice.tracker import Ledger, Tracker, UnitState
from tests.test_controller import end_quietly

UNIT = "a.service"
RUNNING = {"ActiveState": "active", "SubState": "running"}


class Reads:
    """Systemd's reads: each answers the state in `now`, after `answered` is set."""

    def __init__(self) -> None:
        self.now: dict[str, UnitState] = {UNIT: UnitState(UNIT, "inactive", "dead", 0)}
        self.count = 0
        self.fail = False
        self.before_answer: Callable[[], None] = lambda: None
        self.unwatched: set[str] = set()
        self.owner_moved: bool | Exception = False  # what check_owner says, or raises
        self.system: str | Exception = "running"  # the manager's SystemState, or its error
        self.before_system: Callable[[], object] = lambda: None

    async def check_owner(self) -> bool:
        if isinstance(self.owner_moved, Exception):
            raise self.owner_moved
        return self.owner_moved

    async def system_state(self) -> str:
        self.before_system()
        if isinstance(self.system, Exception):
            raise self.system
        return self.system

    async def unit_state(self, name: str) -> UnitState:
        self.count += 1
        self.before_answer()
        if self.fail:
            raise SystemdError("org.freedesktop.DBus.Error.NoReply", "no reply")
        return self.now[name]

    async def units_state(self, names: Collection[str]) -> list[UnitState]:
        self.count += 1
        self.before_answer()
        if self.fail:
            raise SystemdError("org.freedesktop.DBus.Error.NoReply", "no reply")
        return [self.now[n] for n in sorted(names) if n in self.now]

    def watches(self, unit: str) -> bool:
        return unit not in self.unwatched


class Bed:
    def __init__(self) -> None:
        self.systemd = Reads()
        self.tracker = Tracker(lambda _: True, Ledger(lambda _: None, lambda _: False))
        self.counters = Counters()
        self.taken: list[tuple[str, dict[str, Any]]] = []
        self.shutdown_over = 0
        self.tasks: list[asyncio.Task[None]] = []

        def take(unit: str, props: dict[str, Any]) -> None:
            self.taken.append((unit, props))
            self.tracker.unit_changed(unit, props, read=True)

        def spawn(coro: Coroutine[Any, Any, None]) -> None:
            self.tasks.append(asyncio.get_running_loop().create_task(coro))

        def shutdown_over() -> None:
            self.shutdown_over += 1

        self.holds: list[tuple[list[str], bool]] = []  # what each SystemState read told

        self.reads = Rereads(
            cast(Systemd, self.systemd),
            self.tracker,
            self.counters,
            take,
            lambda: [UNIT],
            spawn,
            shutdown_over=shutdown_over,
            holds_read=lambda units, down: self.holds.append((units, down)),
        )

    def signal(self, props: dict[str, Any]) -> None:
        self.tracker.unit_changed(UNIT, props)


def run(test: Callable[[Bed], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        try:
            await test(Bed())
        finally:
            await end_quietly()

    asyncio.run(main())


async def turns(seconds: float) -> None:
    await asyncio.sleep(seconds)
    for _ in range(5):
        await asyncio.sleep(0)


async def second_looks() -> None:
    """CONFIRM_DELAY is over: each second look armed runs now, then what it spawned. Left to
    the clock (0.2 s), one came before the test's check of the time before it when a loaded
    machine ran the test late."""
    loop = asyncio.get_running_loop()
    for handle in sorted(getattr(loop, "_scheduled", ()), key=lambda h: h.when()):
        look = handle._callback  # the timer's own: asyncio has no public way to fire it
        if not handle.cancelled() and getattr(look, "__name__", "") == "_unheard":
            args = handle._args
            handle.cancel()
            look(*args)
    await turns(0)


@pytest.fixture(autouse=True)
def _short_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rereads_module, "REFRESH_DELAY", 0.001)
    monkeypatch.setattr(rereads_module, "CONFIRM_DELAY", 3600.0)  # driven by hand
    monkeypatch.setattr(rereads_module, "AUDIT_INTERVAL", 3600.0)  # driven by hand


def test_a_job_that_changed_nothing_is_read_and_the_same_state_taken_in() -> None:
    async def test(bed: Bed) -> None:
        bed.signal(RUNNING)
        bed.systemd.now[UNIT] = UnitState(UNIT, "active", "running", 0)
        bed.reads.job_ended(UNIT)
        await turns(0.05)
        assert bed.taken == [(UNIT, {**RUNNING, "Job": (0, "/")})]

    run(test)


def test_a_job_whose_signal_came_is_not_read() -> None:
    async def test(bed: Bed) -> None:
        bed.reads.job_ended(UNIT)
        bed.signal(RUNNING)  # systemd said more of it before the read was due
        await turns(0.05)
        assert bed.systemd.count == 0 and bed.taken == []

    run(test)


def test_a_change_a_read_shows_waits_for_its_signal_then_a_second_look() -> None:
    """Systemd answers a read at once and holds its PropertiesChanged back while its queue is
    long: the change is taken in only when nothing was heard by the second look."""

    async def test(bed: Bed) -> None:
        bed.signal(RUNNING)
        bed.systemd.now[UNIT] = UnitState(UNIT, "inactive", "dead", 0)
        bed.reads.job_ended(UNIT)
        await turns(0.005)
        assert bed.systemd.count == 1 and bed.taken == []
        await second_looks()
        assert bed.systemd.count == 2
        assert bed.taken == [
            (UNIT, {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")})
        ]

    run(test)


def test_a_change_whose_signal_comes_meanwhile_is_left_to_it() -> None:
    async def test(bed: Bed) -> None:
        bed.signal(RUNNING)
        bed.systemd.now[UNIT] = UnitState(UNIT, "inactive", "dead", 0)
        bed.reads.job_ended(UNIT)
        await turns(0.005)
        bed.signal({"ActiveState": "inactive", "SubState": "dead"})  # the held-back signal
        await second_looks()
        assert bed.systemd.count == 1 and bed.taken == []

    run(test)


def test_a_read_answered_after_a_later_word_is_dropped() -> None:
    """dbus-next applies signals as it reads them, before the read's coroutine resumes."""

    async def test(bed: Bed) -> None:
        bed.systemd.before_answer = lambda: bed.signal(RUNNING)
        await bed.reads.refresh(UNIT)
        assert bed.taken == []
        seen = bed.tracker.heard(UNIT)
        bed.systemd.before_answer = lambda: None
        assert await bed.reads.read_fresh(UNIT, seen) == bed.systemd.now[UNIT]

    run(test)


def test_a_read_that_fails_is_counted_and_takes_nothing() -> None:
    async def test(bed: Bed) -> None:
        bed.systemd.fail = True
        await bed.reads.refresh(UNIT)
        assert bed.taken == [] and bed.counters.errors["dbus_call_errors"] == 1

    run(test)


def test_a_lost_signal_is_taken_in_when_two_audits_in_a_row_show_it() -> None:
    async def test(bed: Bed) -> None:
        bed.signal(RUNNING)
        bed.systemd.now[UNIT] = UnitState(UNIT, "inactive", "dead", 0)
        await bed.reads.audit()
        assert bed.taken == []  # perhaps only ahead of a signal on its way
        await bed.reads.audit()
        assert bed.taken == [(UNIT, {"ActiveState": "inactive", "SubState": "dead"})]
        assert bed.counters.errors["dbus_signals_lost"] == 1

    run(test)


def test_an_audit_asks_who_owns_systemds_name_and_counts_a_change_unheard(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Systemd's NameOwnerChanged is a signal too, and lost like one: every audit asks the
    bus daemon (Systemd.check_owner follows it); a failed question costs no audit."""
    caplog.set_level(logging.DEBUG, "gpuslice")

    async def test(bed: Bed) -> None:
        bed.systemd.owner_moved = True
        await bed.reads.audit()
        assert bed.counters.errors["dbus_signals_lost"] == 1
        bed.systemd.owner_moved = SystemdError("org.freedesktop.DBus.Error.NoReply", "no")
        bed.signal(RUNNING)
        bed.systemd.now[UNIT] = UnitState(UNIT, "inactive", "dead", 0)
        await bed.reads.audit()
        await bed.reads.audit()
        assert bed.counters.errors["dbus_call_errors"] == 2
        assert bed.taken == [(UNIT, {"ActiveState": "inactive", "SubState": "dead"})]

    run(test)
    said = [r.getMessage() for r in caplog.records if "owns" in r.getMessage()]
    assert said == 2 * [
        "cannot ask who owns systemd's name: org.freedesktop.DBus.Error.NoReply: no"
    ]


SHUTDOWN_JOB = "/org/freedesktop/systemd1/job/9"


def test_an_audit_takes_in_a_shutdown_cancelled_unheard(caplog: pytest.LogCaptureFixture) -> None:
    """The host was going down and no JobRemoved said its shutdown was cancelled: an audit
    that finds systemd's SystemState no longer `stopping` says so and lets units start."""

    async def test(bed: Bed) -> None:
        await bed.reads.audit()
        assert bed.shutdown_over == 0  # not going down: not even asked
        bed.tracker.job_new(SHUTDOWN_JOB, "reboot.target")
        bed.systemd.system = "stopping"
        await bed.reads.audit()
        assert bed.shutdown_over == 0 and bed.tracker.shutting_down
        bed.systemd.system = SystemdError("org.freedesktop.DBus.Error.NoReply", "no reply")
        await bed.reads.audit()
        assert bed.shutdown_over == 0 and bed.counters.errors["dbus_call_errors"] == 1
        bed.systemd.system = "degraded"
        await bed.reads.audit()
        assert bed.shutdown_over == 1 and not bed.tracker.shutting_down
        assert bed.counters.errors["dbus_signals_lost"] == 1
        await bed.reads.audit()
        assert bed.shutdown_over == 1  # told once

    run(test)
    said = [r.getMessage() for r in caplog.records if "going down" in r.getMessage()]
    assert said == [
        "systemd says the host is degraded, not going down: the signal of its cancelled "
        "shutdown was lost on the bus; units are started again"
    ]


def test_a_shutdown_heard_while_the_audit_asked_is_not_undone() -> None:
    """A new shutdown's JobNew read before the audit's answer is taken: that answer may be
    older than it, so the host stays taken to be going down."""

    async def test(bed: Bed) -> None:
        bed.tracker.job_new(SHUTDOWN_JOB, "reboot.target")
        bed.systemd.before_system = lambda: bed.tracker.job_new(SHUTDOWN_JOB + "0", "halt.target")
        await bed.reads.audit()
        assert bed.shutdown_over == 0 and bed.tracker.shutting_down
        bed.systemd.before_system = lambda: bed.tracker.job_removed(
            SHUTDOWN_JOB + "0", "halt.target", "done"
        )
        await bed.reads.audit()
        assert bed.shutdown_over == 0 and bed.tracker.shutting_down

    run(test)


def test_an_audit_suspect_heard_of_between_is_not_taken_in() -> None:
    async def test(bed: Bed) -> None:
        bed.signal(RUNNING)
        bed.systemd.now[UNIT] = UnitState(UNIT, "inactive", "dead", 0)
        await bed.reads.audit()
        bed.signal({"ActiveState": "deactivating", "SubState": "stop-sigterm"})
        await bed.reads.audit()  # a new suspect, not the old one confirmed
        assert bed.taken == [] and bed.counters.errors["dbus_signals_lost"] == 0

    run(test)


def test_an_audit_schedules_the_next_whatever_happened() -> None:
    async def test(bed: Bed) -> None:
        bed.systemd.before_answer = lambda: (_ for _ in ()).throw(RuntimeError("a bug"))
        loop = asyncio.get_running_loop()
        before = len(getattr(loop, "_scheduled", ()))
        with pytest.raises(RuntimeError):
            await bed.reads.audit()
        assert len(getattr(loop, "_scheduled", ())) == before + 1

    run(test)


def test_a_read_asked_for_at_once_takes_a_change_in_at_once() -> None:
    """An answer of systemd's or a re-match may have outrun a change: no second look."""

    async def test(bed: Bed) -> None:
        bed.signal(RUNNING)
        await bed.reads.refresh(UNIT)
        dead = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
        assert bed.taken == [(UNIT, dead)] and bed.systemd.count == 1

    run(test)


def test_a_read_that_fails_is_said_at_debug_level(caplog: pytest.LogCaptureFixture) -> None:
    async def test(bed: Bed) -> None:
        bed.systemd.fail = True
        with caplog.at_level(logging.DEBUG, "gpuslice"):
            await bed.reads.refresh(UNIT)
            await bed.reads.audit()
        assert [r.getMessage() for r in caplog.records] == [
            f"cannot read {UNIT}: org.freedesktop.DBus.Error.NoReply: no reply",
            "cannot read the units gpuslice knows: org.freedesktop.DBus.Error.NoReply: no reply",
        ]
        assert bed.counters.errors["dbus_call_errors"] == 2 and bed.taken == []

    run(test)


def test_audits_follow_one_another_on_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rereads_module, "AUDIT_INTERVAL", 0.01)

    async def test(bed: Bed) -> None:
        bed.reads.start_audits()
        deadline = asyncio.get_running_loop().time() + 30  # a pass never waits this long
        while bed.systemd.count < 2:  # polled: a loaded host may stretch each turn
            assert asyncio.get_running_loop().time() < deadline, "timed out"
            await asyncio.sleep(0.005)

    run(test)


def test_an_audit_cancelled_as_the_controller_ends_sets_no_next_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop's end cancels an audit still waiting on systemd. Had its `finally` set the
    next one, that timer fired while asyncio.run shut the loop down (its executor's threads
    joined), spawned an audit the closed loop never ran, and "Task was destroyed but it is
    pending" failed whichever test the garbage collector ran in next."""
    monkeypatch.setattr(rereads_module, "AUDIT_INTERVAL", 3600.0)

    async def test(bed: Bed) -> None:
        never = asyncio.Event()

        async def unanswered() -> bool:
            await never.wait()
            return False

        bed.systemd.check_owner = unanswered  # type: ignore[method-assign]
        task = asyncio.get_running_loop().create_task(bed.reads.audit())
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        before = len([h for h in getattr(loop, "_scheduled", ()) if not h.cancelled()])
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = len([h for h in getattr(loop, "_scheduled", ()) if not h.cancelled()])
        assert after == before

    run(test)


def test_an_audit_reads_only_the_units_whose_signals_are_matched() -> None:
    """A unit whose signals are not matched would always look lost."""

    async def test(bed: Bed) -> None:
        bed.systemd.unwatched = {UNIT}
        await bed.reads.audit()
        assert bed.systemd.count == 0

    run(test)


def test_a_lost_signal_is_said_and_a_new_job_taken_in_with_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The warning says what systemd shows and where the signals left the unit; a job that
    changed goes in with it (a path it cannot know: "/"), an unchanged one keeps its path."""

    async def test(bed: Bed) -> None:
        bed.signal(RUNNING)
        bed.systemd.now[UNIT] = UnitState(UNIT, "activating", "start-pre", 7, "start")
        with caplog.at_level(logging.WARNING, "gpuslice"):
            await bed.reads.audit()
            await bed.reads.audit()
        assert [r.getMessage() for r in caplog.records] == [
            f"{UNIT}: systemd shows it activating (start-pre), job 7, where its signals left "
            "it active (running), job 0: a signal was lost on the bus; taken in now"
        ]
        taken = {"ActiveState": "activating", "SubState": "start-pre", "Job": (7, "/")}
        assert bed.taken == [(UNIT, taken)]

    run(test)


def test_an_audit_whose_answer_a_signal_outran_judges_nothing() -> None:
    """A word of systemd's on the unit while the read was on its way makes the answer old:
    the unit is neither taken in nor kept as a suspect."""

    async def test(bed: Bed) -> None:
        bed.signal(RUNNING)
        bed.systemd.now[UNIT] = UnitState(UNIT, "inactive", "dead", 0)
        await bed.reads.audit()  # a suspect
        bed.systemd.before_answer = lambda: bed.signal(RUNNING)  # the same, said again
        await bed.reads.audit()  # judged nothing: the suspect is gone
        bed.systemd.before_answer = lambda: None
        await bed.reads.audit()  # a suspect again, not yet taken in
        assert bed.taken == []
        await bed.reads.audit()
        assert [unit for unit, _ in bed.taken] == [UNIT]

    run(test)


def test_a_hold_is_told_whether_the_host_was_going_down() -> None:
    """systemd's SystemState is read once a unit is held (the bus may have lost the
    shutdown's JobNew); units held while it is asked wait for one more read, not one each.
    A read that fails counts, and its units are asked again with the next hold."""

    async def test(bed: Bed) -> None:
        asked: list[str] = []

        def before() -> None:
            asked.append(bed.systemd.system if isinstance(bed.systemd.system, str) else "!")
            if len(asked) == 1:
                bed.reads.hold_booked("b.service")
                bed.reads.hold_booked("c.service")

        bed.systemd.before_system = before
        bed.reads.hold_booked(UNIT)
        bed.reads.hold_booked(UNIT)
        await turns(0)
        assert bed.holds == [([UNIT], False), (["b.service", "c.service"], False)]
        assert len(asked) == 2
        bed.systemd.system = SystemdError("org.freedesktop.DBus.Error.NoReply", "no reply")
        bed.reads.hold_booked("d.service")
        await turns(0)
        assert bed.counters.errors["dbus_call_errors"] == 1 and len(bed.holds) == 2
        bed.systemd.system = "stopping"
        bed.reads.hold_booked("e.service")
        await turns(0)
        assert bed.holds[2:] == [(["d.service", "e.service"], True)]

    run(test)


def test_a_unit_held_again_while_its_hold_is_read_waits_for_the_next_read() -> None:
    """b.service was held (someone's stop), then started again and stopped again while the
    SystemState read its first hold asked for was out; the bus lost the JobNew of the
    shutdown whose stop that was. The first answer (`running`) is older than the second
    stop: taken for it, it confirmed the new hold, and the next read's `stopping` found
    nothing left to undo (held across the reboot)."""

    async def test(bed: Bed) -> None:
        asked: list[int] = []

        def before() -> None:
            asked.append(1)
            if len(asked) == 1:
                bed.reads.hold_booked("b.service")  # started, then the shutdown stopped it
            else:
                bed.systemd.system = "stopping"

        bed.systemd.system = "running"
        bed.systemd.before_system = before
        bed.reads.hold_booked("b.service")
        bed.reads.hold_booked(UNIT)
        await turns(0)
        assert bed.holds == [([UNIT], False), (["b.service"], True)]

    run(test)


def test_a_hold_read_older_than_a_shutdown_job_heard_since_is_not_believed() -> None:
    """The bus lost reboot.target's JobNew; a unit is held and SystemState read: systemd
    answers `stopping`, then the shutdown is cancelled, and the cancel's JobRemoved is taken
    in before the answer (dbus-next runs signal handlers as messages are read, the reading
    coroutine later). Believed, the answer took the host for going down after its cancel was
    heard: nothing served, and someone's stop taken for the shutdown's (not held), until an
    audit read the host running again. A read older than a shutdown job heard is not
    believed, as an audit's is not (`shutdown_unheard`): the holds stand."""

    async def test(bed: Bed) -> None:
        bed.systemd.system = "stopping"
        bed.systemd.before_system = lambda: bed.tracker.job_removed(
            SHUTDOWN_JOB, "reboot.target", "canceled"
        )
        bed.reads.hold_booked(UNIT)
        await turns(0)
        assert bed.holds == [([UNIT], False)]
        bed.systemd.before_system = lambda: None
        bed.reads.hold_booked(UNIT)  # nothing heard meanwhile: believed
        await turns(0)
        assert bed.holds[1:] == [([UNIT], True)]

    run(test)


@pytest.mark.parametrize(
    ("queued", "held"), [("poweroff.target", False), ("shutdown.target", True)]
)
def test_a_hold_read_while_another_shutdown_is_heard(queued: str, held: bool) -> None:
    """A hold, its SystemState read out, and a JobNew of a shutdown target heard before the
    answer `stopping` is taken up. shutdown.target's: a shutdown queued since, after the hold
    (someone's stop, then a reboot), which stands. poweroff.target's alone (`systemctl
    poweroff` merged into a reboot queued before, whose JobNews the bus lost): the hold was
    that reboot's stop, and kept, it outlived the reboot."""

    async def test(bed: Bed) -> None:
        bed.systemd.system = "stopping"
        bed.systemd.before_system = lambda: bed.tracker.job_new(SHUTDOWN_JOB, queued)
        bed.reads.hold_booked(UNIT)
        await turns(0)
        assert bed.holds == [([UNIT], not held)]

    run(test)


def test_a_hold_whose_read_failed_is_read_again_at_the_next_audit() -> None:
    """The SystemState read that follows a hold (someone's stop, the host running) failed,
    and its unit waited for the next hold's read, maybe hours later: if that one says
    `stopping` (a shutdown whose JobNew the bus lost), the old hold was taken for the
    shutdown's and undone: a unit a person stopped came back after the reboot. The next
    audit asks again."""

    async def test(bed: Bed) -> None:
        bed.systemd.system = SystemdError("org.freedesktop.DBus.Error.NoReply", "no reply")
        bed.reads.hold_booked(UNIT)
        await turns(0)
        assert bed.holds == []
        bed.systemd.system = "running"
        await bed.reads.audit()
        await turns(0)
        assert bed.holds == [([UNIT], False)]
        bed.systemd.system = "stopping"
        bed.reads.hold_booked("b.service")  # the shutdown's stop, hours later
        await turns(0)
        assert bed.holds[1:] == [(["b.service"], True)]

    run(test)
