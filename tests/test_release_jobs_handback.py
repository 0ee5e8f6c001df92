"""`gpuslice release-jobs` hands the preempted units it names back to the admin (`_released`).

`apt remove gpuslice` printed "job.service was preempted and nothing will start it again:
`systemctl start job.service` if it is still wanted"; the admin did, and the job finished.
The state file release-jobs left still named it preempted (with its wait at the gate that
failed, for one requeued; and a unit being stopped for a more urgent one, down since, was
still a holder being stopped), so a gpuslice installed again, in the same boot or a later
one, started each of them again once a GPU was free: a finished job ran twice. So did a
unit suspended in an earlier boot, which release-jobs names preempted as the controller
takes it (forget_boot). A background unit needs no preemption record: refill starts it
again. No systemd: release-jobs runs on the stand-ins of tests/test_release_jobs_state.py,
the next controller on the fakes of tests/test_controller.py, both on one state file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuslice import cli as cli_module
from gpuslice.config import Config
from gpuslice.core.scheduler import SavedState
from gpuslice.state import StateStore
from tests.test_controller import BOOT, Bed, run, settle, state
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_release_jobs_state import _loaded, _release

WHERE = "gpuslice is being removed:"
UNITS = {
    "job.service": "Priority=50\n",
    "waited.service": "Priority=50\n",
    "stopped.service": "Priority=60\n",
    "suspended.service": "Priority=70\nPreempt=suspend stop\n",
    "bg.service": "Priority=90\nType=background\n",
}
# as the last controller saved them: job.service and bg.service preempted, waited.service
# preempted after its wait at the gate failed, stopped.service being stopped for a more
# urgent unit (down since; frozen before, so owed a thaw)
SAVED = SavedState(
    holders={"stopped.service": ((1,), "stopping", 4, "urgent.service")},
    preempted={"job.service": 1, "waited.service": 2, "bg.service": 3},
    wait_failed=["waited.service"],
    seq=4,
    thaw_owed=["stopped.service"],
    terms={"stopped.service": (60, "on-demand", 1, None)},
)


def _named(unit: str) -> str:
    return (
        f"{WHERE} {unit} was preempted and nothing will start it again: "
        f"`systemctl start {unit}` if it is still wanted"
    )


def _next_controller_starts(tmp_path: Path, config: Config, boot: str | None = None) -> list[str]:
    """The units a controller started on the state file release-jobs left with `config`
    (saved again as of the earlier boot `boot`, as after a reboot, when given), every unit
    down and every GPU free."""
    if boot is not None:
        StateStore(Path(config.state_dir)).save(_loaded(config)[0], boot)
    bed = Bed(tmp_path, UNITS, [state(n, "inactive", "dead") for n in UNITS], config=config)
    starts: list[str] = []

    async def test() -> None:
        await bed.controller.start()
        await settle()
        starts.extend(u for verb, u in bed.systemd.calls if verb == "start")

    run(test)
    return starts


@pytest.mark.parametrize("later", [False, True], ids=["same-boot", "later-boot"])
def test_a_unit_named_preempted_is_not_started_again_after_a_reinstall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, later: bool
) -> None:
    """This boot's state: each preempted unit down is named, and the state left owes none of
    them a comeback, nor the one being stopped that is down now. The next controller, of
    this boot or after a reboot, starts only the background unit (refill)."""
    config, done, stderr = _release(tmp_path, monkeypatch, SAVED, {})
    assert done == []
    assert stderr.splitlines() == [
        _named(n) for n in ("stopped.service", "bg.service", "job.service", "waited.service")
    ]
    assert _loaded(config) == (SavedState(seq=4), BOOT, 2)
    starts = _next_controller_starts(tmp_path, config, "boot-0" if later else None)
    assert starts == ["bg.service"]


def test_a_unit_being_stopped_is_kept_until_systemd_shows_it_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Still deactivating, stopped.service holds its GPU: kept a holder being stopped, so that
    no unit is granted that GPU beside it."""
    shown = {"stopped.service": ("deactivating", "running")}
    config, _, _ = _release(tmp_path, monkeypatch, SAVED, shown)
    saved = _loaded(config)[0]
    assert saved.holders == SAVED.holders
    assert saved.terms == SAVED.terms
    assert saved.preempted == {}


def test_a_unit_suspended_in_an_earlier_boot_is_not_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An earlier boot's state: its suspended unit is named preempted (its processes went
    with that boot), and the state left, still of that boot, no longer names it: the next
    controller does not start it (forget_boot made it preempted)."""
    saved_state = SavedState(
        suspended={"suspended.service": ((2,), 5)},
        seq=5,
        terms={"suspended.service": (70, "on-demand", 1, None)},
    )
    config, done, stderr = _release(tmp_path, monkeypatch, saved_state, {}, boot="boot-0")
    assert done == []
    assert stderr.splitlines() == [_named("suspended.service")]
    assert _loaded(config) == (SavedState(seq=5), "boot-0", 2)
    assert "suspended.service" not in _next_controller_starts(tmp_path, config)


def test_a_state_that_cannot_be_written_says_the_units_still_owed_a_comeback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left as it was (here: not writable), the state still owes the units named preempted
    a comeback: said, counted with the first of them (an instance per job: thousands)."""

    def refused(self: StateStore, saved: SavedState, boot: str) -> Path:
        raise PermissionError(13, "Permission denied")

    released = cli_module._released

    def then_refused(*args: Any) -> SavedState:  # once the test's own state is saved
        monkeypatch.setattr(StateStore, "save", refused)
        return released(*args)

    monkeypatch.setattr(cli_module, "_released", then_refused)
    _, _, stderr = _release(tmp_path, monkeypatch, SAVED, {})
    assert stderr.splitlines()[-1] == (
        f"gpuslice release-jobs: the saved state {tmp_path / 'state' / 'state.json'} is left as "
        "it was (cannot write it: Permission denied): a gpuslice started again brings back 4 "
        "units named preempted above (the first bg.service), even one started by hand since"
    )


def test_a_unit_being_stopped_that_failed_is_handed_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop that ended in `failed` is down as one that ended `inactive`: its GPU is free,
    it is named, and the state left holds it no more (nor owes it the thaw)."""
    shown = {"stopped.service": ("failed", "running")}
    config, _, stderr = _release(tmp_path, monkeypatch, SAVED, shown)
    assert _named("stopped.service") in stderr.splitlines()
    assert _loaded(config)[0] == SavedState(seq=4)


def test_a_unit_requeued_and_named_preempted_is_handed_back_from_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state that names job.service both preempted and requeued (state.validate keeps both;
    the controller's load takes it for preempted): named, it leaves both, or a controller
    after a reboot took it for a comeback the boot ended (`ended_with_boot`) and started it
    again. waited.service, requeued alone (its comeback at its gate), is not named and stays
    requeued."""
    saved = SavedState(
        preempted={"job.service": 1}, requeued=["job.service", "waited.service"], seq=1
    )
    config, _, stderr = _release(tmp_path, monkeypatch, saved, {})
    assert stderr.splitlines() == [_named("job.service")]
    assert _loaded(config)[0] == SavedState(requeued=["waited.service"], seq=1)
    assert "job.service" not in _next_controller_starts(tmp_path, config, "boot-0")


def test_a_state_left_says_both_what_it_takes_and_what_it_brings_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved again meanwhile (a controller started and stopped), the state is left: said with
    both of what it holds wrong, joined, and why, cut at 300 characters as the path is
    (a state_dir of 250 characters makes both longer)."""
    saved = SavedState(
        holders={"emb.service": ((0,), "frozen", 1, "")}, preempted={"job.service": 2}, seq=2
    )
    path = tmp_path / ("s" * 250) / "state.json"
    other = SavedState(preempted={"other.service": 3}, seq=3)
    released = cli_module._released

    def then_saved(*args: Any) -> SavedState:  # once release-jobs read the state
        controller = StateStore(path.parent)
        controller.load()
        controller.save(other, BOOT)
        return released(*args)

    monkeypatch.setattr(cli_module, "_released", then_saved)
    shown = {"emb.service": ("active", "frozen")}
    config, _, stderr = _release(tmp_path, monkeypatch, saved, shown, state_dir=path.parent)
    why = f"{path} was saved again since it was read"
    assert len(str(path)) > 301
    assert stderr.splitlines()[-1] == (
        f"gpuslice release-jobs: the saved state {str(path)[:300]}... is left as it was "
        f"({why[:300]}...): a gpuslice started again this boot takes emb.service for still "
        "frozen or suspended and brings back 1 units named preempted above (the first "
        "job.service), even one started by hand since"
    )
    assert _loaded(config)[0] == other
