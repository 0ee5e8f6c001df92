"""gpuslice/delivery.py on its own: a grant's env file written before its gate passes.

Small fakes stand for the core's books, the gate pipes and the gate calls in wait (no
controller, no bus); the env files are real, in a temporary runtime_dir, and a runtime_dir
that is a plain file makes every write fail as a full /run does (removing it makes room).
Timers are never waited for: a test reads the timer a withheld grant armed, checks its delay
and runs its callback itself (`fire`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import pytest

from gpuslice import envfiles
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Phase, Scheduler
from gpuslice.counters import Counters
from gpuslice.delivery import ENV_RETRY, Delivery
from gpuslice.gatepipes import GatePipes
from gpuslice.paths import env_file
from tests.test_envfiles import fill_run
from tests.timers import armed_for

U = "a.service"
UUID_A = "GPU-aaaa"
UUID_B = "GPU-bbbb"
UUID_C = "GPU-cccc"
UUID_D = "GPU-dddd"


class FakeScheduler:
    """The core's books: who holds which GPUs, in which phase, and each GPU by UUID."""

    def __init__(self) -> None:
        self.holders: dict[str, frozenset[int]] = {}
        self.phases: dict[str, Phase] = {}
        self.uuids = {0: UUID_A, 1: UUID_B, 2: UUID_C}

    def grants(self) -> dict[str, frozenset[int]]:
        return dict(self.holders)

    def phase(self, name: str) -> Phase | None:
        return self.phases.get(name)

    def device(self, index: int) -> Gpu:
        return Gpu(index, self.uuids.get(index, ""))

    def told(self, name: str) -> list[Gpu]:
        return [self.device(g) for g in sorted(self.holders.get(name, ()))]


class FakeGates:
    """The gate pipes: which units were granted at theirs, and which count as answered."""

    def __init__(self) -> None:
        self.granted: list[str] = []
        self.answered_units: set[str] = set()

    def grant(self, unit: str) -> bool:
        self.granted.append(unit)
        return True

    def answered(self, unit: str) -> bool:
        return unit in self.answered_units


class FakeService:
    """The gate calls in wait: how many each unit has; each grant answers them all."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.granted: list[tuple[str, str]] = []

    def grant(self, unit: str, gpus: str) -> int:
        self.granted.append((unit, gpus))
        return self.calls.pop(unit, 0)

    def pending(self, unit: str) -> bool:
        return bool(self.calls.get(unit))


class Kit:
    """A Delivery with its fakes, writing under `run`; `full()` makes every write fail."""

    def __init__(self, tmp_path: Path) -> None:
        self.run = tmp_path / "run"
        self.scheduler = FakeScheduler()
        self.gates = FakeGates()
        self.service = FakeService()
        self.counters = Counters()
        self.asked: list[str] = []
        self.delivery = Delivery(
            cast(Scheduler, self.scheduler),
            cast(GatePipes, self.gates),
            self.service,
            self.counters,
            str(self.run),
            self.asked.append,
        )

    def full(self) -> None:
        self.run.write_text("")  # no directory can be made under it

    def room(self) -> None:
        self.run.unlink()

    def holds(self, unit: str, *gpus: int, phase: Phase = Phase.RUNNING) -> None:
        self.scheduler.holders[unit] = frozenset(gpus)
        self.scheduler.phases[unit] = phase

    def path(self, unit: str = U) -> Path:
        return env_file(str(self.run), unit)

    def file(self, unit: str = U) -> str:
        return self.path(unit).read_text()

    def timer(self, unit: str = U) -> asyncio.TimerHandle:
        handle = self.delivery.withheld[unit]
        assert not handle.cancelled()
        assert armed_for(handle) == ENV_RETRY
        return handle


def fire(handle: asyncio.TimerHandle) -> None:
    """Run a timer's callback now, as the loop would once its delay is over."""
    timer = cast(Any, handle)  # asyncio has no public way to fire a timer
    callback, args = timer._callback, timer._args
    handle.cancel()  # clears them
    callback(*args)


def run(tmp_path: Path, test: Callable[[Kit], Coroutine[Any, Any, None]]) -> Kit:
    kit = Kit(tmp_path)
    asyncio.run(test(kit))
    return kit


def run_heard(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    test: Callable[[Kit], Coroutine[Any, Any, None]],
) -> Kit:
    """`run`, with all that gpuslice says taken (`said`)."""
    caplog.set_level(logging.DEBUG, "gpuslice")
    return run(tmp_path, test)


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "gpuslice"]


def text(*gpus: Gpu) -> str:
    return envfiles.text(list(gpus))


# ---- deliver: the file, then the gate ----


def test_a_grant_writes_the_env_file_by_uuid_then_answers_the_pipe_and_the_calls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The file names the GPUs granted by the UUIDs the core booked (`Scheduler.told`), then
    the gate passes at its pipe and its calls over D-Bus are answered with the indices the
    grant names, counted once; nothing is said (the decision is the journal's line)."""

    async def test(kit: Kit) -> None:
        kit.holds(U, 0, 2)
        kit.service.calls[U] = 2
        kit.delivery.deliver(U, [0, 2])
        assert kit.file() == text(Gpu(0, UUID_A), Gpu(2, UUID_C))
        assert kit.gates.granted == [U]
        assert kit.service.granted == [(U, "0,2")]
        assert kit.counters.gate_answers["dbus"] == 1
        assert kit.delivery.withheld == {}

    run_heard(tmp_path, caplog, test)
    assert said(caplog) == []


def test_a_grant_with_no_call_waiting_counts_no_answer_over_d_bus(tmp_path: Path) -> None:
    """A gate waiting on its pipe alone: granted there (counted when its gate takes it,
    elsewhere), and no D-Bus answer is counted."""

    async def test(kit: Kit) -> None:
        kit.holds(U, 1)
        kit.delivery.deliver(U, [1])
        assert kit.gates.granted == [U]
        assert kit.service.granted == [(U, "1")]
        assert kit.counters.gate_answers["dbus"] == 0

    run(tmp_path, test)


def test_a_grant_whose_file_cannot_be_written_waits_and_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full /run: the gate is not answered (started without the file, its processes saw
    every GPU), the write is tried again in ENV_RETRY s, and the journal says so once, in
    these words."""

    async def test(kit: Kit) -> None:
        kit.holds(U, 0)
        kit.service.calls[U] = 1
        kit.full()
        kit.delivery.deliver(U, [0])
        assert kit.gates.granted == []
        assert kit.service.granted == []
        assert kit.counters.gate_answers["dbus"] == 0
        kit.timer()

    kit = run_heard(tmp_path, caplog, test)
    path = kit.path()
    assert said(caplog) == [
        (
            "ERROR",
            f"cannot write {path} ([Errno 20] Not a directory: '{path.parent}'): "
            f"{U} waits at its gate until it can (tried again every 1 s)",
        )
    ]


def test_a_withheld_grant_goes_through_at_its_retry_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its retries fail quietly (said once already); the first that writes the file lets
    the gate through on the GPUs the core books for it then, in order (a set of GPUs 1
    and 8 iterates 8 first), and says so."""

    async def test(kit: Kit) -> None:
        kit.scheduler.uuids[8] = UUID_D
        kit.holds(U, 1, 8)
        assert list(kit.scheduler.holders[U]) == [8, 1]
        kit.service.calls[U] = 1
        kit.full()
        kit.delivery.deliver(U, [1, 8])
        first = kit.timer()
        fire(first)  # still full
        second = kit.timer()
        assert second is not first
        assert kit.service.granted == []
        kit.room()
        fire(second)
        assert kit.delivery.withheld == {}
        assert kit.file() == text(Gpu(1, UUID_B), Gpu(8, UUID_D))
        assert kit.gates.granted == [U]
        assert kit.service.granted == [(U, "1,8")]
        assert kit.counters.gate_answers["dbus"] == 1

    kit = run_heard(tmp_path, caplog, test)
    path = kit.path()
    assert [level for level, _ in said(caplog)] == ["ERROR", "INFO"]
    assert said(caplog)[1] == ("INFO", f"wrote {path}: {U} goes past its gate")


def test_a_grant_decided_again_while_withheld_keeps_one_retry_and_says_nothing_more(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its gate asked again while the grant waited (the core grants it again): the retry
    armed before goes, one is armed instead, and nothing more is said until the file is
    written; a unit's process calling in a loop wrote an error line per call."""

    async def test(kit: Kit) -> None:
        kit.holds(U, 0)
        kit.full()
        kit.delivery.deliver(U, [0])
        first = kit.timer()
        kit.delivery.deliver(U, [0])
        assert first.cancelled()
        assert list(kit.delivery.withheld) == [U]
        kit.timer()
        kit.room()
        kit.delivery.deliver(U, [0])  # withheld before: said when it goes through
        assert kit.delivery.withheld == {}
        assert kit.gates.granted == [U]

    run_heard(tmp_path, caplog, test)
    assert [level for level, _ in said(caplog)] == ["ERROR", "INFO"]


@pytest.mark.parametrize(
    ("phase", "held", "answered"),
    [
        (Phase.STOPPING, True, False),  # being preempted meanwhile
        (Phase.RUNNING, False, False),  # its start cancelled: holds nothing
        (Phase.RUNNING, True, True),  # let through meanwhile (asked again after a restart)
    ],
)
def test_a_withheld_grant_is_dropped_when_it_no_longer_stands(
    tmp_path: Path, phase: Phase, held: bool, answered: bool
) -> None:
    """At its retry, a grant whose unit no longer holds its GPUs running, or whose gate
    passed meanwhile, is dropped: no file names GPUs the unit no longer holds, and no gate
    passes onto them."""

    async def test(kit: Kit) -> None:
        kit.holds(U, 0)
        kit.service.calls[U] = 1
        kit.full()
        kit.delivery.deliver(U, [0])
        handle = kit.timer()
        kit.room()
        kit.scheduler.phases[U] = phase
        if not held:
            del kit.scheduler.holders[U]
        if answered:
            kit.gates.answered_units.add(U)
        fire(handle)
        assert kit.delivery.withheld == {}
        assert kit.gates.granted == []
        assert kit.service.granted == []
        assert not kit.path().exists()

    run(tmp_path, test)


def test_withdraw_cancels_the_retry_and_tells_whether_there_was_one(tmp_path: Path) -> None:
    async def test(kit: Kit) -> None:
        assert kit.delivery.withdraw(U) is False
        kit.holds(U, 0)
        kit.full()
        kit.delivery.deliver(U, [0])
        handle = kit.timer()
        assert kit.delivery.withdraw(U) is True
        assert handle.cancelled()
        assert kit.delivery.withheld == {}
        assert kit.delivery.withdraw(U) is False

    run(tmp_path, test)


# ---- names_held: a unit let through on GPUs still held for it ----


def test_a_file_that_names_the_gpus_held_stays_as_it_is(tmp_path: Path) -> None:
    """The word its last run was told (by UUID) stays: nothing is written."""

    async def test(kit: Kit) -> None:
        kit.holds(U, 0, 1)
        envfiles.write(str(kit.run), U, [Gpu(0, UUID_C), Gpu(1, UUID_A)])
        assert kit.delivery.names_held(U, [0, 1], again=False)
        assert kit.file() == text(Gpu(0, UUID_C), Gpu(1, UUID_A))
        assert kit.delivery.withheld == {}

    run(tmp_path, test)


@pytest.mark.parametrize("before", [None, [Gpu(1, UUID_B)], [Gpu(0, UUID_A)]])
def test_a_file_missing_or_naming_other_gpus_is_written_from_the_books(
    tmp_path: Path, before: list[Gpu] | None
) -> None:
    async def test(kit: Kit) -> None:
        kit.holds(U, 0, 1)
        if before is not None:
            envfiles.write(str(kit.run), U, before)
        assert kit.delivery.names_held(U, [0, 1], again=False)
        assert kit.file() == text(Gpu(0, UUID_A), Gpu(1, UUID_B))
        assert kit.delivery.withheld == {}

    run(tmp_path, test)


@pytest.mark.parametrize("again", [False, True])
def test_a_gate_let_through_waits_while_its_file_cannot_be_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, again: bool
) -> None:
    """The gate waits and is judged again in ENV_RETRY s (`ask_again`, while its call
    waits); the journal says so unless it was said already (`again`)."""

    async def test(kit: Kit) -> None:
        kit.holds(U, 0)
        kit.full()
        assert not kit.delivery.names_held(U, [0], again=again)
        assert kit.gates.granted == []
        assert kit.service.granted == []
        kit.service.calls[U] = 1
        fire(kit.timer())
        assert kit.asked == [U]

    run_heard(tmp_path, caplog, test)
    assert [level for level, _ in said(caplog)] == ([] if again else ["ERROR"])


def test_a_gate_judged_again_that_waits_again_keeps_its_new_retry(tmp_path: Path) -> None:
    """Judged again, the gate is let through once more and its file still cannot be
    written: the retry that judgement armed stays."""

    async def test(kit: Kit) -> None:
        kit.holds(U, 0)
        kit.full()
        kit.delivery.names_held(U, [0], again=False)
        kit.service.calls[U] = 1

        def let_through_again(unit: str) -> None:
            kit.asked.append(unit)
            assert kit.delivery.withdraw(unit)
            assert not kit.delivery.names_held(unit, [0], again=True)

        kit.delivery.ask_again = let_through_again
        fire(kit.timer())
        assert kit.asked == [U]
        kit.timer()  # the new one

    run(tmp_path, test)


@pytest.mark.parametrize("pending", [False, True])
def test_a_gate_judged_otherwise_leaves_nothing_to_retry(tmp_path: Path, pending: bool) -> None:
    """Its call gone (answered or cancelled), the gate is not judged again; judged and
    granted, preempted or down meanwhile, no retry is left behind either."""

    async def test(kit: Kit) -> None:
        kit.holds(U, 0)
        kit.full()
        kit.delivery.names_held(U, [0], again=False)
        if pending:
            kit.service.calls[U] = 1
        fire(kit.timer())
        assert kit.asked == ([U] if pending else [])
        assert kit.delivery.withheld == {}

    run(tmp_path, test)


# ---- tell_again: a unit resumed on GPUs numbered anew ----


def test_a_unit_resumed_on_other_indices_has_its_file_written_anew(tmp_path: Path) -> None:
    """Suspended from GPU 0 (GPU-aaaa), resumed on it as index 2 (NVML numbered it anew):
    the file names index 2, by the UUID the core gives it now, in order."""

    async def test(kit: Kit) -> None:
        envfiles.write(str(kit.run), U, [Gpu(0, UUID_A), Gpu(1, UUID_B)])
        kit.scheduler.uuids = {1: UUID_B, 2: UUID_A}
        kit.delivery.tell_again(U, [2, 1])
        assert kit.file() == text(Gpu(1, UUID_B), Gpu(2, UUID_A))

    run(tmp_path, test)


@pytest.mark.parametrize("before", [None, [Gpu(0), Gpu(1)], [Gpu(1, UUID_B), Gpu(0, UUID_A)]])
def test_a_resume_leaves_a_file_without_uuids_or_naming_the_same_indices(
    tmp_path: Path, before: list[Gpu] | None
) -> None:
    """No file, one written before NVML answered (no UUIDs: nothing to check it against),
    or one that names the indices it resumes on: left as it is."""

    async def test(kit: Kit) -> None:
        if before is not None:
            envfiles.write(str(kit.run), U, before)
        kit.scheduler.uuids = {0: UUID_C, 1: UUID_C}
        kit.delivery.tell_again(U, [1, 0])
        if before is None:
            assert not kit.path().exists()
        else:
            assert kit.file() == text(*before)

    run(tmp_path, test)


def test_a_resume_whose_file_cannot_be_written_anew_says_which_indices_it_still_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def test(kit: Kit) -> None:
        envfiles.write(str(kit.run), U, [Gpu(0, UUID_A)])

        def refused(runtime_dir: str, unit: str, gpus: list[Gpu]) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(envfiles, "write", refused)
        kit.delivery.tell_again(U, [2])

    kit = run_heard(tmp_path, caplog, test)
    assert kit.file() == text(Gpu(0, UUID_A))
    assert said(caplog) == [
        (
            "WARNING",
            f"cannot write {kit.path()} ([Errno 28] No space left on device): "
            f"it still names the GPUs of {U} by the indices they had before NVML numbered "
            "them anew (GPU 0)",
        )
    ]


# ---- tell_none: a unit released while systemd keeps it active ----


def test_a_released_unit_is_told_no_gpu_and_a_failed_write_keeps_its_old_file_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its file names no GPU (systemd reads it for its ExecReload= and ExecStop=); while it
    cannot be written (a full /run), the old one stays (it keeps its GPUs meanwhile: gone,
    its commands saw every GPU), said once however often it is tried."""
    written = os.write

    async def test(kit: Kit) -> None:
        kit.holds(U, 0)
        kit.delivery.deliver(U, [0])
        old = kit.file()
        fill_run(monkeypatch)
        assert kit.delivery.tell_none(U) is False
        assert kit.delivery.tell_none(U) is False
        monkeypatch.setattr(os, "write", written)
        assert kit.file() == old
        assert kit.delivery.tell_none(U) is True
        assert kit.file() == text()

    kit = run_heard(tmp_path, caplog, test)
    path = kit.path()
    assert said(caplog) == [
        (
            "WARNING",
            f"cannot write {path} ([Errno 28] No space left on device): {U} keeps its GPUs "
            "until it can (tried again every 30 s) or it is stopped",
        )
    ]


def test_a_released_units_file_that_cannot_be_written_again_later_is_said_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Said once while it cannot be written; once it was, a later release of the unit (a
    new run's, /run full again) that cannot write it is said anew: the unit keeps its GPUs
    again, and the journal must say why."""
    written = os.write

    async def test(kit: Kit) -> None:
        kit.holds(U, 0)
        kit.delivery.deliver(U, [0])
        fill_run(monkeypatch)
        assert kit.delivery.tell_none(U) is False
        monkeypatch.setattr(os, "write", written)
        assert kit.delivery.tell_none(U) is True
        kit.delivery.deliver(U, [0])  # its next run, granted GPU 0 again
        fill_run(monkeypatch)
        assert kit.delivery.tell_none(U) is False
        monkeypatch.setattr(os, "write", written)

    kit = run_heard(tmp_path, caplog, test)
    full = (
        "WARNING",
        f"cannot write {kit.path()} ([Errno 28] No space left on device): {U} keeps its "
        "GPUs until it can (tried again every 30 s) or it is stopped",
    )
    assert [s for s in said(caplog) if s[0] == "WARNING"] == [full, full]
