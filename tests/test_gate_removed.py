"""The shipped gate (data/gpuslice-gate) while the controller is away, and after gpuslice is
removed.

`apt remove gpuslice` stops the controller (prerm), deletes its files, and daemon-reloads
(postrm): every later start of an annotated unit runs ungated (README). A start that was
already waiting at its gate keeps its gate process, which asks a controller that will never
come back. It must notice that gpuslice is gone and end, and only then: a stopped, failed
or masked controller is waited for while the gate's file is there or its unit still lists it
(a mask, or a copy in /etc, that outlives the package is not gpuslice installed). It lets
the start go when the unit has no ExecStartPre= lines of its own: systemd does not go on
with a command list whose running command (the gate) a reload removed, so the unit's own
lines would be skipped; a unit that has some fails this start instead. `dbus-send` and
`systemctl` are stubs first in the PATH of a copy of the gate (tests/test_gatepipes.py), as
systemd would show each case.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.test_gatepipes import gate_with_stubs

# systemctl's own reading of its arguments (getopt_long): an argument that starts with `-`
# is an option, wherever it stands, until `--`; one it does not know fails the command.
SYSTEMCTL_ARGS = """verb=$1; shift; prop=; unit=
while [ $# -gt 0 ]; do
    case $1 in
        -p) prop=$2; shift 2 ;;
        --value) shift ;;
        --) unit=$2; shift $# ;;
        -*) echo "systemctl: invalid option -- '${1#-}'" >&2; exit 1 ;;
        *) unit=$1; shift ;;
    esac
done
"""


def _gate(
    tmp_path: Path,
    active: str,
    load: str,
    pre: str = "",
    unit: str = "job.service",
    unit_env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """The gate for `unit` with the controller away (every Acquire fails), while
    `systemctl` says gpuslice.service is `active` (ActiveState) and `load` (LoadState), and
    the unit's ExecStartPre= is `pre`; `unit_env`, the unit's environment. Its systemctl
    prints nothing and exits 0 with SYSTEMD_OFFLINE=1 set, as systemd's does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "dbus-send": f"echo >> {tmp_path}/asks; exit 1\n",  # one line per ask
        "systemctl": (
            '[ -z "${SYSTEMD_OFFLINE:-}" ] || exit 0\n'
            + SYSTEMCTL_ARGS
            + 'case "$verb $prop $unit" in\n'
            f"  is-active*) echo {active}; exit 3 ;;\n"
            f'  "show LoadState gpuslice.service") echo {load} ;;\n'
            f"  \"show ExecStartPre {unit}\") echo '{pre}' ;;\n"
            "  *) exit 1 ;;\nesac\n"
        ),
    }
    for name, body in stubs.items():
        stub = bin_dir / name
        stub.write_text("#!/bin/sh\n" + body)
        stub.chmod(0o755)
    return subprocess.Popen(
        ["/bin/sh", str(gate_with_stubs(tmp_path, bin_dir)), unit, "0.05"],
        env={"PATH": "/usr/bin:/bin", **(unit_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ended(gate: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _out, err = gate.communicate(timeout=30)  # a pass never waits this long
    except subprocess.TimeoutExpired:
        gate.kill()
        gate.communicate()
        raise AssertionError(
            "the gate still waits for a controller that is not installed"
        ) from None
    return gate.returncode, err


@pytest.mark.parametrize("unit_env", [{}, {"SYSTEMD_OFFLINE": "1"}], ids=["", "offline"])
@pytest.mark.parametrize("active", ["inactive", "failed"])
def test_a_start_waiting_when_gpuslice_is_removed_goes_on_ungated(
    tmp_path: Path, active: str, unit_env: dict[str, str]
) -> None:
    """`failed`: a controller that had failed (a config.yaml it rejects, its start limit)
    when the package was removed; prerm's stop and postrm's reload leave it failed, its
    record kept by systemd until reset-failed. `offline`: the unit's SYSTEMD_OFFLINE=1 made
    the gate's systemctl print nothing, and the gate waited for ever."""
    assert _ended(_gate(tmp_path, active, "not-found", unit_env=unit_env)) == (
        0,
        "gpuslice.service is not installed any more: starting without waiting for GPUs\n",
    )


# `-job.service` is a valid unit name (systemd's own `-.mount` and `-.slice` start so): given
# to systemctl before `--`, it was read as options (`-j`: refused; `-Hhost`: a remote host)
@pytest.mark.parametrize("unit", ["job.service", "-job.service"])
def test_a_unit_with_its_own_exec_start_pre_fails_that_start_instead(
    tmp_path: Path, unit: str
) -> None:
    pre = "{ path=/bin/mkdir ; argv[]=/bin/mkdir -p /var/tmp/job ; ignore_errors=no }"
    assert _ended(_gate(tmp_path, "inactive", "not-found", pre, unit)) == (
        1,
        "gpuslice.service is not installed any more: failing this start, so that the next "
        "one runs ungated with its own ExecStartPre= lines\n",
    )


@pytest.mark.parametrize(
    ("active", "load"),
    [("inactive", "loaded"), ("failed", "loaded"), ("inactive", "masked"), ("inactive", "")],
)
def test_a_controller_that_is_only_away_is_waited_for(
    tmp_path: Path, active: str, load: str
) -> None:
    gate = _gate(tmp_path, active, load)
    asks = tmp_path / "asks"
    try:
        # past several asks (0.05 s, doubling), each after the last one's `systemctl`: a
        # fixed 1.5 s was, on a loaded machine, before the gate had said it waits
        deadline = time.monotonic() + 30  # a pass never waits this long
        while len(asks.read_text().splitlines() if asks.exists() else []) < 3:
            assert gate.poll() is None, "the gate ended instead of waiting"
            assert time.monotonic() < deadline, "the gate never asked three times"
            time.sleep(0.02)
    finally:
        gate.kill()
        _out, err = gate.communicate()
    assert err == (
        f"waiting for gpuslice.service, which is {active}: see 'systemctl status gpuslice'\n"
    )


def _remove_the_gate_once_it_asked(tmp_path: Path, gate: subprocess.Popen[str]) -> None:
    """`apt remove`'s deletion of the gate's file, once the gate runs (it asked once): the
    shell goes on reading the file it opened, as a waiting gate does."""
    asks = tmp_path / "asks"
    deadline = time.monotonic() + 30  # a pass never waits this long
    while not asks.exists():
        assert gate.poll() is None, "the gate ended before it asked"
        assert time.monotonic() < deadline, "the gate never asked"
        time.sleep(0.01)
    (tmp_path / "gpuslice-gate").unlink()


# what the unit's ExecStartPre= holds once the removal's reload took the gate's drop-in away
# (none, or its own line), and before it (the gate, as systemd 252 shows it)
OWN_LINE = "{ path=/bin/mkdir ; argv[]=/bin/mkdir -p /var/tmp/job ; ignore_errors=no }"
GATE_LISTED = (
    "{ path=/usr/lib/gpuslice/gpuslice-gate ; argv[]=/usr/lib/gpuslice/gpuslice-gate "
    "job.service 0.5 /run/gpuslice/gate/job.service ; ignore_errors=no }"
)


@pytest.mark.parametrize(
    ("pre", "code", "said"),
    [
        ("", 0, "starting without waiting for GPUs"),
        (
            OWN_LINE,
            1,
            "failing this start, so that the next one runs ungated with its own "
            "ExecStartPre= lines",
        ),
    ],
)
@pytest.mark.parametrize("load", ["masked", "loaded"])
def test_a_controller_that_outlives_the_package_is_not_waited_for(
    tmp_path: Path, load: str, pre: str, code: int, said: str
) -> None:
    """gpuslice.service masked by an admin (a link to /dev/null in /etc), or copied whole
    to /etc (`systemctl edit --full`): `apt remove` leaves it masked or loaded, never
    not-found, and a start that was waiting at its gate waited for ever. The gate's own
    file gone and its drop-in taken out of the unit by the removal's reload say it too."""
    gate = _gate(tmp_path, "inactive", load, pre)
    _remove_the_gate_once_it_asked(tmp_path, gate)
    returncode, err = _ended(gate)
    assert (returncode, err.splitlines()[-1]) == (
        code,
        f"gpuslice.service is not installed any more: {said}",
    )


def test_a_gate_still_listed_is_waited_for_though_its_file_is_gone(tmp_path: Path) -> None:
    """Between dpkg's deletion of the gate's file and postrm's reload, the unit's drop-in
    still names it: gpuslice is not gone yet for this start (the controller may be only
    away, a `make install` of another copy replacing the file)."""
    gate = _gate(tmp_path, "inactive", "masked", GATE_LISTED)
    _remove_the_gate_once_it_asked(tmp_path, gate)
    asks = tmp_path / "asks"
    try:
        deadline = time.monotonic() + 30
        while len(asks.read_text().splitlines()) < 4:
            assert gate.poll() is None, "the gate ended instead of waiting"
            assert time.monotonic() < deadline, "the gate never asked four times"
            time.sleep(0.02)
    finally:
        gate.kill()
        gate.communicate()
