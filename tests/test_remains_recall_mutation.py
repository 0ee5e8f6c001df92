"""What mutation testing of a unit's down, the audit of units kept active, the state file's
trust, start-up's rebuild of released units and the ladder's recall showed no test held.

- a leftover of a unit kept active is said again in its next run (Remains.went_down at
  the down the controller applies);
- the audit asks systemd about units shown `active (exited)` alone, not about every holder;
- a state file group-writable by a group other than root's or the controller's is not
  trusted, one only the owner may write is, whatever its group;
- start-up keeps what the earlier facts of its rebuild decided when a released unit was
  stopped while no controller ran, tells the core systemd's outcome of it, and adopts the
  running units listed after a released one;
- a resume after a controller restart says how long the unit was away, by the wall clock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest

from gpuslice.core.scheduler import Outcome, Phase, SavedState
from gpuslice.state import StateStore
from gpuslice.tracker import UnitState
from tests.test_cli_ladder_state_mutation import _stopped, _via_systemd
from tests.test_controller import (
    _no_notify_socket,  # noqa: F401  (autouse: as in tests/test_controller.py)
    goes_down,
    holding_a_gpu_each,
    job_ended,
    messages,
    run,
    settle,
    started,
    state,
)
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_controller_gates import running
from tests.test_restore import A, B, Kit, down
from tests.test_restore import messages as said
from tests.test_restore import running as runs
from tests.test_session_mutation3 import UNIT, Stubbed
from tests.test_session_mutation3 import stubbed as stubbed  # a fixture
from tests.test_state import GOOD_STATE, good

GIB = 1 << 30
LEFT = "process(es) are left in it"

# ---- the controller: a down, the audit ------------------------------------------------------


def test_a_leftover_is_said_again_in_the_units_next_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cgroup_of: dict[int, str]
) -> None:
    """once.service's job ends with a process left (KillMode=process): said once. It is
    stopped, started again, and its next run leaves one too: said again (not taken for the
    run before, whose warning was said)."""
    bed = holding_a_gpu_each(tmp_path, {"once.service": "Priority=50\n"})
    cgroup_of[4242] = "once.service"

    async def ends_with_a_leftover() -> None:
        bed.systemd.processes["once.service"] = [4242]
        job_ended(bed, "once.service")
        await settle()

    async def test() -> None:
        ctl = bed.controller
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await ctl.start()
            await settle()
            await ends_with_a_leftover()
            goes_down(bed, "once.service")
            await settle()
            assert ctl.scheduler.phase("once.service") is None
            await bed.acquire("once.service", ":1.9", 4242)
            bed.systemd.units["once.service"] = state("once.service", "active", "running")
            ctl.on_unit_changed("once.service", running())
            await settle()
            assert ctl.scheduler.phase("once.service") is Phase.RUNNING
            await ends_with_a_leftover()
            assert ctl.scheduler.phase("once.service") is Phase.RUNNING

    run(test)
    assert len([m for m in messages(caplog) if LEFT in m]) == 2, messages(caplog)


def test_the_audit_asks_systemd_about_no_holder_that_still_runs(tmp_path: Path) -> None:
    """Every 30 s, a question per running GPU job (its processes listed, on the loop) would
    be asked for nothing: only a unit shown `active (exited)` can have ended."""
    bed = holding_a_gpu_each(tmp_path, {"job.service": "Priority=50\n"})

    async def test() -> None:
        ctl = await started(bed)
        await ctl.reads.audit()
        await settle()
        assert ctl.scheduler.phase("job.service") is Phase.RUNNING
        asked = [c for c in bed.systemd.calls if c[0] in ("tasks_current", "unit_pids")]
        assert asked == []

    run(test)


# ---- the state file's trust -------------------------------------------------------------------


def test_a_state_file_only_its_owner_may_write_is_trusted_whatever_its_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mode 0644 of a group neither root's nor the controller's: nobody of that group may
    write it (a restored backup keeps its group)."""
    path = tmp_path / "state.json"
    path.write_bytes(good())
    path.chmod(0o644)
    if os.geteuid() == 0:
        os.chown(path, -1, 1234)
    gid = path.stat().st_gid
    monkeypatch.setattr(os, "getegid", lambda: gid + 1)
    if gid == 0:
        pytest.skip("the file's group is root's (chown needs root)")
    assert StateStore(tmp_path).load() == (GOOD_STATE, "0f6c/1234")


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of group 0 or 1 needs root")
def test_a_group_writable_state_file_is_trusted_for_roots_group_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group 0 (root's) may write it: trusted, though the controller runs with another
    group. Group 1 (daemon) may not."""
    monkeypatch.setattr(os, "getegid", lambda: 4321)
    path = tmp_path / "state.json"
    path.write_bytes(good())
    path.chmod(0o664)
    os.chown(path, -1, 0)
    assert StateStore(tmp_path).load() == (GOOD_STATE, "0f6c/1234")
    os.chown(path, -1, 1)
    assert StateStore(tmp_path).load() == (SavedState(), "")
    assert (tmp_path / "state.json.bad").read_bytes() == good()


# ---- start-up's rebuild -----------------------------------------------------------------------


def test_a_released_unit_stopped_while_away_keeps_what_the_holders_found_decided(
    tmp_path: Path,
) -> None:
    """a.service ended while no controller ran, and b.service, released (finished, kept
    active), was stopped: both ends are told, with systemd's outcome of each."""
    kit = Kit(tmp_path)
    kit.hold(A, [0], Phase.RUNNING, down(A))
    kit.scheduler.remained = {B}
    kit.tracker.states[B] = down(B, "failed")
    assert said(kit.restore.rebuild(stopped={A})) == [
        "inactive a.service stopped",
        f"inactive b.service {Outcome.FAILED.value}",
        "recover",
        "schedule",
    ]


def test_running_units_listed_after_a_released_one_are_adopted(tmp_path: Path) -> None:
    """a.service, released and still `active (exited)`, holds nothing; b.service, running
    and not booked, is adopted all the same."""
    kit = Kit(tmp_path)
    kit.scheduler.remained = {A}
    kit.tracker.states[A] = UnitState(A, "active", "exited", 0)
    kit.tracker.states[B] = runs(B)
    assert said(kit.restore.rebuild()) == ["running b.service []", "recover", "schedule"]


# ---- the ladder's recall ----------------------------------------------------------------------


@pytest.mark.parametrize(("ago", "words"), [(100.0, "100 s: "), (-50.0, "0 s: ")])
def test_a_recalled_resume_says_how_long_the_unit_was_away_by_the_wall_clock(
    stubbed: Stubbed, monkeypatch: pytest.MonkeyPatch, ago: float, words: str
) -> None:
    """Suspended 100 s before (by the wall clock the state file keeps): "100 s". A wall
    clock stepped back since says no time away, never a negative one."""
    _stopped(monkeypatch)
    _via_systemd(stubbed, False)
    stubbed.owners[11] = UNIT
    stubbed.ladder.recall({UNIT: ((11,), 2 * GIB, time.time() - ago)})
    asyncio.run(stubbed.ladder.resume(UNIT))
    [(event, _, said_words)] = stubbed.events.said
    assert event == "resumed" and said_words.startswith(words), said_words
