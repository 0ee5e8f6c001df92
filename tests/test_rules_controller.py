"""Promises of README.md's "The rules in short" and "While the controller is down" that rest
on the controller (the state file it reads at start, the boot it tells apart, its calls to
systemd), on the fakes of tests/test_controller.py: one test per promise that no fast test
held on its own.
"""

from __future__ import annotations

from pathlib import Path
from signal import SIGTERM

import pytest

from gpuslice import calls as calls_module
from gpuslice.controller import Controller
from gpuslice.core.scheduler import SavedState
from gpuslice.state import StateStore
from gpuslice.systemd import SystemdError
from gpuslice.tracker import CLD_KILLED, MainExit
from tests.test_controller import BOOT, Bed, bed_config, failing_calls, run, settle, state, until

BACKGROUND = {
    "held.service": "Priority=50\nType=background\n",
    "done.service": "Priority=60\nType=background\n",
}


def _bed(tmp_path: Path, saved_in_boot: str) -> Bed:
    """Two GPUs; held.service stopped by hand and done.service finished, as the state file a
    controller of boot `saved_in_boot` left says; systemd shows both down."""
    config = bed_config(tmp_path, gpus=2)
    saved = SavedState(held=["held.service"], finished=["done.service"], seq=2)
    StateStore(Path(config.state_dir)).save(saved, saved_in_boot)
    down = [state(n, "inactive", "dead") for n in BACKGROUND]
    return Bed(tmp_path, BACKGROUND, down, config=config)


def _started(bed: Bed) -> list[str]:
    return [unit for what, unit in bed.systemd.calls if what == "start"]


@pytest.mark.parametrize("saved_in_boot", [BOOT, "boot-0"], ids=["restart", "reboot"])
def test_a_held_unit_stays_held_across_a_controller_restart_and_a_reboot(
    tmp_path: Path, saved_in_boot: str
) -> None:
    """README: "A unit you stop by hand (systemctl stop) is held: gpuslice will not start it again
    until someone starts it, across controller restarts and reboots. A background unit that ends
    successfully is finished until it is started again (by hand, a timer, or the next boot)." Read
    back from the state file: after a restart in the same boot neither is started; after a reboot
    (the file was saved in another boot) the finished one is, the held one is not."""
    bed = _bed(tmp_path, saved_in_boot)

    async def test() -> None:
        ctl: Controller = bed.controller
        await ctl.start()
        await settle()
        snap = ctl.scheduler.snapshot()
        assert snap.held == ["held.service"]
        if saved_in_boot == BOOT:
            assert _started(bed) == []
            assert snap.finished == ["done.service"]
        else:
            assert _started(bed) == ["done.service"]
            assert snap.finished == []

    run(test)


NO_REPLY = SystemdError(
    "org.freedesktop.DBus.Error.NoReply",
    "Message recipient disconnected from message bus without replying",
)


def test_a_start_not_reaching_systemd_is_sent_again_after_a_delay_doubling_to_its_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: "A start or stop of its own that systemd never got (the bus answered NoReply or
    ServiceUnknown while systemd re-executed) is sent again after 1 s, doubling up to 30 s": the
    delays themselves (scaled down), as the controller sets them, not as a clock reads them. Without
    its cap, a start that failed through a long re-execution waited minutes once systemd was back.
    """
    monkeypatch.setattr(calls_module, "CALL_RETRY_FIRST", 0.01)
    monkeypatch.setattr(calls_module, "CALL_RETRY_MAX", 0.03)
    bed = Bed(
        tmp_path,
        {"low.service": "Priority=90\n"},
        [state("low.service", "inactive", "dead")],
        SavedState(preempted={"low.service": 1}, seq=1),
    )
    sent = failing_calls(bed, "start", [NO_REPLY] * 5)
    ctl = bed.controller
    delays: list[float] = []
    not_taken = ctl.calls._call_not_taken

    def recorded(unit: str, what: str, error: SystemdError) -> None:
        not_taken(unit, what, error)
        delays.append(ctl.calls._retry_delays[(unit, what)])

    monkeypatch.setattr(ctl.calls, "_call_not_taken", recorded)

    async def test() -> None:
        await ctl.start()
        await until(lambda: len(sent) == 6)
        await settle()
        assert delays == [0.01, 0.02, 0.03, 0.03, 0.03]
        assert "low.service" not in ctl.scheduler.preempted  # the sixth went through

    run(test)


def test_a_background_unit_stopped_by_hand_while_no_controller_ran_stays_held_after_a_reboot(
    tmp_path: Path,
) -> None:
    """README: "A unit you stop by hand (systemctl stop) is held [...] across controller restarts
    and reboots": also one stopped while no controller ran (gpuslice.service restarting, failed, or
    stopped for an upgrade). Found down at start-up with no job, a unit the last controller saw
    running was recorded finished (its Result= is "success" either way, the state a unit that
    ended by itself leaves), and the first refill after the next boot started it again.
    Systemd's record of its main process tells them apart: killed by the stop's SIGTERM."""
    config = bed_config(tmp_path)
    saved = SavedState(holders={"bg.service": ((0,), "running", 1, "")}, seq=1)
    StateStore(Path(config.state_dir)).save(saved, BOOT)
    units = {"bg.service": "Priority=50\nType=background\n"}

    async def restarted(bed: Bed) -> list[str]:
        bed.systemd.main_exits["bg.service"] = MainExit(CLD_KILLED, SIGTERM, "success")
        await bed.controller.start()
        await settle()
        return [unit for what, unit in bed.systemd.calls if what == "start"]

    async def test() -> None:
        bed = Bed(tmp_path, units, [state("bg.service", "inactive", "dead")], config=config)
        assert await restarted(bed) == []
        bed.controller.save_now()
        # the host reboots: the file was saved in the last boot
        store = StateStore(Path(config.state_dir))
        kept, _ = store.load()
        store.save(kept, "boot-0")
        again = Bed(tmp_path, units, [state("bg.service", "inactive", "dead")], config=config)
        assert await restarted(again) == []

    run(test)
