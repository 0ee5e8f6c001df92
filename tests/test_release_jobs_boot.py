"""`gpuslice release-jobs` acts only on a state of this boot, told as the controller tells it
(`state.same_boot` on `Systemd.boot_id`: the kernel's boot id and when systemd started). A
container restarted without its host keeps the kernel's boot id: its last boot's state names
units whose processes are gone, and a unit of that name now (started since, frozen by someone
else) is not the one gpuslice froze or suspended. When systemd cannot say when it started,
nothing is touched and each unit is named. No systemd and no container: the state, systemctl,
the resume and the bus are stand-ins (tests/release_jobs_standins.py,
tests/test_release_jobs_resume.py).

And one fault found in a container (the tests from `CONTAINER`): the controller's sandbox
(ProtectKernelTunables=, ProtectControlGroups=: a fresh /proc/sys) reads the host kernel's boot
id where release-jobs, outside it, reads the container's own (nspawn mounts it over the
file), so no state was ever this boot's, and `apt remove` left every frozen unit frozen. The
controller records this boot as it tells it (paths.BOOT_RECORD, in /run, emptied at every
boot), and release-jobs judges by that record while it can."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dbus_next.errors import DBusError

from gpuslice import cli as cli_module
from gpuslice.core.scheduler import SavedState
from gpuslice.state import BOOT_ID_MAX, StateStore, read_recorded_boot, record_boot, same_boot
from gpuslice.systemd import Systemd
from tests.release_jobs_standins import release_jobs, systemctl_and_resume
from tests.test_release_jobs_resume import STARTED, _Systemd, _systemd_started, _this_boot

WHERE = "gpuslice is being removed:"
RECORD = "run/gpuslice/runtime-dir.boot"  # below tmp_path: paths.BOOT_RECORD
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
    (each connection failing with `no_bus`), showing units as SHOWN, no controller having
    recorded this boot (RECORD, unless a test puts one there): what it did in order
    (("thaw" | "stop" | "resume", unit)), its stderr, the connections it made."""
    monkeypatch.setattr(StateStore, "load", lambda self: (saved, saved_boot))
    # the state is this stand-in, in no file: nothing on the host to save over or
    # to find saved since (a /var/lib/gpuslice left by another run made it so)
    monkeypatch.setattr(StateStore, "saved_since", lambda self: None)
    monkeypatch.setattr(cli_module, "THIS_BOOT_RECORD", tmp_path / RECORD)
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


# ---- in a container: this boot as the controller recorded it (paths.BOOT_RECORD) ----

# the kernel boot id the controller's sandbox reads in a container: the host's, not the one
# nspawn mounted for the container, which release-jobs reads (the stand-in's, from /proc)
HOST_KERNEL = "5f1e0b6c-0c7d-4e4b-9a53-3d9a2a1b7c00"
CONTAINER = f"{HOST_KERNEL}/{STARTED}"  # the controller's Systemd.boot_id in the container
ACTED_ON = [
    ("thaw", "frozen.service"),
    ("thaw", "owed.service"),
    ("resume", "caught.service"),
    ("resume", "suspended.service"),
]


def _recorded(tmp_path: Path, boot: str) -> Path:
    """This boot recorded as the controller of this boot records it (record_boot)."""
    (tmp_path / RECORD).parent.mkdir(parents=True, exist_ok=True)
    assert record_boot(tmp_path / RECORD, boot)
    return tmp_path / RECORD


def test_in_a_container_the_controllers_record_tells_this_boot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state was saved with the boot the controller read in its sandbox (the host's
    kernel boot id), release-jobs reads the container's: judged by release-jobs' own
    reading, the state was never this boot's and nothing was thawed or resumed. Judged by
    what the controller recorded this boot, it is acted on, and systemd is not asked."""
    assert _this_boot() != CONTAINER  # what release-jobs would read itself
    _recorded(tmp_path, CONTAINER)
    done, stderr, made = _release(tmp_path, monkeypatch, CONTAINER)
    assert done == ACTED_ON
    assert stderr.splitlines()[2:] == [
        _preempted("preempted.service"),
        _preempted("stopping.service"),
    ]
    assert made == []


def test_a_state_of_an_earlier_boot_is_not_this_boots_by_the_record_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The container restarted without its host: the controller of this boot recorded
    another start of systemd than the state's. Nothing is touched, as for any earlier boot,
    and systemd is not asked (it would say this boot is the state's: the same start)."""
    _recorded(tmp_path, CONTAINER)
    earlier = f"{HOST_KERNEL}/{STARTED - 60_000_000}"
    done, stderr, made = _release(tmp_path, monkeypatch, earlier)
    assert (done, made) == ([], [])
    assert stderr.splitlines() == [_preempted("preempted.service")]


def test_without_a_record_this_boot_is_asked_of_systemd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No controller recorded this boot (none ran since the boot, or a gpuslice without the
    record did): release-jobs asks systemd, as ever; its directory there changes nothing."""
    (tmp_path / RECORD).parent.mkdir(parents=True)
    done, _, made = _release(tmp_path, monkeypatch, _this_boot())
    assert done == ACTED_ON
    assert len(made) == 1


def _odd(tmp_path: Path, kind: str) -> None:
    """At the record's place, something no controller wrote there, each saying CONTAINER
    where it can be read."""
    record = tmp_path / RECORD
    record.parent.mkdir(parents=True)
    line = f"{CONTAINER}\n".encode()
    if kind == "link":
        (tmp_path / "elsewhere").write_bytes(line)
        record.symlink_to(tmp_path / "elsewhere")
    elif kind == "fifo":
        os.mkfifo(record)
    elif kind == "directory":
        record.mkdir()
    elif kind == "others-write":
        record.write_bytes(line)
        record.chmod(0o646)
    elif kind == "group-writes":
        record.write_bytes(line)
        record.chmod(0o664)
    elif kind == "another-owner":
        record.write_bytes(line)
        if os.geteuid() != 0:
            pytest.skip("only root gives a file away")
        os.chown(record, 1, 0)
    elif kind == "too-long":
        record.write_bytes(CONTAINER.encode() + b"0" * (BOOT_ID_MAX - len(CONTAINER) + 1) + b"\n")
    elif kind == "no-line-end":
        record.write_bytes(CONTAINER.encode())
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "link",
        "fifo",
        "directory",
        "others-write",
        "group-writes",
        "another-owner",
        "too-long",
        "no-line-end",
    ],
)
def test_what_is_no_record_of_the_controllers_is_not_believed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A link (never followed), a FIFO (never opened: release-jobs would wait for ever), a
    directory, a file someone else may have written, one longer than a boot id or not one
    line: no record, and systemd is asked, which in a container tells another boot than the
    state's. Nothing is touched, as before there was a record; a FIFO is not waited on."""
    _odd(tmp_path, kind)
    done, stderr, made = _release(tmp_path, monkeypatch, CONTAINER)
    assert done == []
    assert stderr.splitlines() == [_preempted("preempted.service")]
    assert len(made) == 1


def test_the_record_is_one_line_of_this_boot_replaced_at_once(tmp_path: Path) -> None:
    """record_boot writes the boot and a line end, 0644, replacing whatever was there (a
    restart writes the same; no temporary file left); without its directory (no
    RuntimeDirectory=: not started by gpuslice.service) it writes nothing."""
    record = tmp_path / "gpuslice" / "runtime-dir.boot"
    assert not record_boot(record, CONTAINER)
    assert not record.parent.exists()
    record.parent.mkdir()
    record.write_text("left by a controller killed mid-save\n")
    assert record_boot(record, CONTAINER)
    assert record_boot(record, CONTAINER)
    assert record.read_bytes() == f"{CONTAINER}\n".encode()
    assert record.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in record.parent.iterdir()) == ["runtime-dir.boot"]
    assert read_recorded_boot(record) == CONTAINER


@pytest.mark.parametrize(
    "data",
    [b"\n", b"boot\x00/1\n", b"boot\xff/1\n", "boot\u00e9/1\n".encode(), b"a\nb\n", b""],
    ids=["empty-line", "nul", "not-utf8", "not-ascii", "two-lines", "empty"],
)
def test_a_record_that_is_no_printable_line_is_none(tmp_path: Path, data: bytes) -> None:
    record = tmp_path / "runtime-dir.boot"
    record.write_bytes(data)
    record.chmod(0o644)
    assert read_recorded_boot(record) is None


def test_a_record_as_long_as_a_boot_id_may_be_is_read(tmp_path: Path) -> None:
    """BOOT_ID_MAX characters, the bound a state file's boot is read with."""
    record = tmp_path / "runtime-dir.boot"
    record.write_bytes(b"b" * BOOT_ID_MAX + b"\n")
    record.chmod(0o644)
    assert read_recorded_boot(record) == "b" * BOOT_ID_MAX
    assert read_recorded_boot(tmp_path / "none") is None
