"""`gpuslice release-jobs` acts only on a state of this boot, told as the controller tells it
(`state.same_boot` on `Systemd.boot_id`: the kernel's boot id and when systemd started). A
container restarted without its host keeps the kernel's boot id: its last boot's state names
units whose processes are gone, and a unit of that name now (started since, frozen by someone
else) is not the one gpuslice froze or suspended. When systemd cannot say when it started,
nothing is touched and each unit is named. No systemd and no container: the state, systemctl,
the resume and the bus are stand-ins (tests/release_jobs_standins.py,
tests/test_release_jobs_resume.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dbus_next.errors import DBusError

from gpuslice import cli as cli_module
from gpuslice.core.scheduler import SavedState
from gpuslice.state import StateStore, same_boot
from gpuslice.systemd import Systemd
from tests.release_jobs_standins import release_jobs, systemctl_and_resume
from tests.test_release_jobs_resume import STARTED, _Systemd, _systemd_started, _this_boot

WHERE = "gpuslice is being removed:"
FROZEN = ("active", "frozen")
# one of each kind a state of its boot alone says: frozen beside a more urgent unit, owed a
# thaw, caught between suspend and resume, being stopped for a more urgent one, suspended;
# and one preempted, which is so in any boot
SAVED = SavedState(
    holders={
        "frozen.service": ((0,), "frozen", 1, ""),
        "owed.service": ((0,), "running", 2, ""),
        "caught.service": ((1,), "suspending", 3, ""),
        "stopping.service": ((1,), "stopping", 4, "urgent.service"),
    },
    suspended={"suspended.service": ((2,), 5)},
    preempted={"preempted.service": 6},
    thaw_owed=["owed.service"],
)
SHOWN = {
    "frozen.service": FROZEN,
    "owed.service": FROZEN,
    "caught.service": FROZEN,
    "suspended.service": FROZEN,
    "stopping.service": ("inactive", "running"),
    "preempted.service": ("inactive", "running"),
}


def _release(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    saved_boot: str,
    started: int | BaseException | None = STARTED,
    saved: SavedState = SAVED,
    no_bus: OSError | None = None,
) -> tuple[list[tuple[str, str]], str, list[tuple[str | None, _Systemd]]]:
    """release-jobs on `saved`, saved in boot `saved_boot`, systemd on the bus having started
    at `started` (or failing with it when asked; None: never answering), or no bus at all
    (each connection failing with `no_bus`), showing units as SHOWN: what it did in order
    (("thaw" | "stop" | "resume", unit)), its stderr, the connections it made."""
    monkeypatch.setattr(StateStore, "load", lambda self: (saved, saved_boot))
    made = _systemd_started(monkeypatch, started)
    if no_bus is not None:

        async def refused(address: str | None = None, timeout: float | None = None) -> Systemd:
            raise no_bus

        monkeypatch.setattr(Systemd, "connect", refused)
    done, _ = systemctl_and_resume(monkeypatch, SHOWN)
    stderr = release_jobs(tmp_path, "log_level: info\n")
    assert all(systemd.bus.disconnected for _, systemd in made), made
    return done, stderr, made


def _preempted(unit: str) -> str:
    return (
        f"{WHERE} {unit} was preempted and nothing will start it again: "
        f"`systemctl start {unit}` if it is still wanted"
    )


def test_a_state_of_the_containers_last_boot_is_not_acted_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The container restarted, its host did not: the kernel's boot id is the one the state
    was saved with, systemd's start is later. release-jobs took the kernel's id alone for
    the boot, thawed a unit of that name frozen now (someone else's freeze), resumed one
    suspended then (its processes long gone) and called a fresh unit being stopped then
    preempted. Judged as the controller judges it: another boot, nothing touched, the
    suspended unit preempted (forget_boot), as for a reboot."""
    earlier = _this_boot(STARTED - 60_000_000)
    assert earlier.split("/")[0] == _this_boot().split("/")[0]  # the same kernel boot id
    done, stderr, made = _release(tmp_path, monkeypatch, earlier)
    assert done == []
    # suspended.service runs (active): a unit of that name started since needs nothing
    assert stderr.splitlines() == [_preempted("preempted.service")]
    assert len(made) == 1  # asked systemd once when it started


def test_a_state_of_this_boot_is_acted_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same kernel boot id and the same start of systemd: thaws, then resumes (the one
    caught between suspend and resume first), and the preempted named."""
    done, stderr, _ = _release(tmp_path, monkeypatch, _this_boot())
    assert done == [
        ("thaw", "frozen.service"),
        ("thaw", "owed.service"),
        ("resume", "caught.service"),
        ("resume", "suspended.service"),
    ]
    assert stderr.splitlines()[2:] == [
        _preempted("preempted.service"),
        _preempted("stopping.service"),
    ]


def test_the_boot_is_asked_of_the_systemd_on_the_bus_gpuslice_is_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUSLICE_BUS_ADDRESS", "unix:path=/run/test-bus")
    _, _, made = _release(tmp_path, monkeypatch, _this_boot())
    assert made[0][0] == "unix:path=/run/test-bus"


LEFT_ALONE = [
    f"{WHERE} caught.service is left as it is (suspended by cuda-checkpoint in a state that "
    "may be an earlier boot's); if systemd shows it frozen, `systemctl stop caught.service` "
    "ends it",
    f"{WHERE} frozen.service is left as it is (frozen beside a more urgent unit in a state "
    "that may be an earlier boot's); if systemd shows it frozen, `systemctl thaw "
    "frozen.service`",
    f"{WHERE} owed.service is left as it is (frozen beside a more urgent unit in a state that "
    "may be an earlier boot's); if systemd shows it frozen, `systemctl thaw owed.service`",
    f"{WHERE} stopping.service is left as it is (preempted in a state that may be an earlier "
    "boot's); if it is down, `systemctl start stopping.service` if it is still wanted",
    f"{WHERE} suspended.service is left as it is (suspended by cuda-checkpoint in a state "
    "that may be an earlier boot's); if systemd shows it frozen, `systemctl stop "
    "suspended.service` ends it",
    _preempted("preempted.service"),  # preempted in any boot: said as ever
]


@pytest.mark.parametrize(
    ("started", "why"),
    [
        (
            DBusError("org.freedesktop.DBus.Error.AccessDenied", "denied"),
            "denied",
        ),
        (ConnectionRefusedError(111, "Connection refused"), "Connection refused"),
    ],
    ids=["refused", "no-bus"],
)
def test_a_start_of_systemd_that_cannot_be_read_leaves_every_unit_alone_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: BaseException, why: str
) -> None:
    """Without systemd's start, a state of this kernel boot may be the container's last
    boot's: no unit is thawed, resumed or stopped on its word, and each is named with what
    to do if it is still frozen (or down)."""
    done, stderr, _ = _release(tmp_path, monkeypatch, _this_boot(), started)
    assert done == []
    assert stderr.splitlines() == [
        f"gpuslice release-jobs: cannot tell whether the saved state is of this boot ({why}): "
        "a container restarted without its host has the kernel boot id of its last boot, "
        "whose units are others now; no unit the state names is thawed, resumed or stopped",
        *LEFT_ALONE,
    ]


def test_no_bus_at_all_leaves_every_unit_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Systemd.connect itself failing (no bus socket) is a boot that cannot be told."""
    no_socket = FileNotFoundError(2, "No such file or directory")
    done, stderr, _ = _release(tmp_path, monkeypatch, _this_boot(), no_bus=no_socket)
    assert done == []
    assert stderr.splitlines() == [
        "gpuslice release-jobs: cannot tell whether the saved state is of this boot (No such "
        "file or directory): a container restarted without its host has the kernel boot id "
        "of its last boot, whose units are others now; no unit the state names is thawed, "
        "resumed or stopped",
        *LEFT_ALONE,
    ]


def test_a_systemd_that_never_answers_is_given_up_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`apt remove` waits on release-jobs: a Get that is never answered ends after
    BUS_TIMEOUT, and the units are left alone."""
    assert cli_module.BUS_TIMEOUT == 30.0
    monkeypatch.setattr(cli_module, "BUS_TIMEOUT", 0.01)
    done, stderr, _ = _release(tmp_path, monkeypatch, _this_boot(), None)
    assert done == []
    assert stderr.splitlines()[0].startswith(
        "gpuslice release-jobs: cannot tell whether the saved state is of this boot "
        "(systemd did not answer within 0.01 s): "
    )


@pytest.mark.parametrize(
    "saved",
    [SavedState(), SavedState(preempted={"preempted.service": 6})],
    ids=["empty", "preempted-only"],
)
def test_a_state_naming_no_unit_of_a_boot_asks_no_bus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved: SavedState
) -> None:
    """Nothing to thaw or resume: systemd is not asked (a bus down costs nothing), and a
    preempted unit is named as in any boot."""
    done, stderr, made = _release(
        tmp_path, monkeypatch, _this_boot(), DBusError("x.Y", "never"), saved
    )
    assert (done, made) == ([], [])
    assert stderr.splitlines() == [_preempted(n) for n in saved.preempted]


def test_a_state_without_a_boot_is_of_no_boot_and_asks_no_bus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done, stderr, made = _release(tmp_path, monkeypatch, "", DBusError("x.Y", "never"))
    assert (done, made) == ([], [])
    # suspended.service runs (active): a unit of that name started since needs nothing
    assert stderr.splitlines() == [_preempted("preempted.service")]


def test_the_controller_and_release_jobs_share_one_judgment_of_the_boot() -> None:
    """The controller at its start (Controller.start) and release-jobs both ask same_boot."""
    boot = _this_boot()
    assert same_boot(boot, boot)
    assert not same_boot(_this_boot(STARTED - 1), boot)  # the container restarted
    assert not same_boot("another-kernel/" + str(STARTED), boot)  # the host rebooted
    assert not same_boot("", boot)
    assert not same_boot("", "")  # a state without a boot is no boot's, not "this" one
    assert not same_boot(boot, "")  # nor is a boot that could not be told
