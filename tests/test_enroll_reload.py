"""`gpuslice enroll` whose daemon-reload fails, as `gpuslice new`'s (test_newunit_leftovers.py):
the drop-in was left on disk, unloaded, for some later reload to bring in, and the error did
not say so. Now the reload runs under the unit directory's lock and a failed one undoes the
write. systemctl is stood in for: nothing here depends on the machine."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import Result

from tests.test_cli_hostile import SYSTEM, files, invoke, plain_unit
from tests.test_newunit_leftovers import (
    _fails,
    reload_fails_after_a_rewrite,
    reload_noting_the_lock,
    systemctl,
)

DROPIN = f"{SYSTEM}/plain.service.d/gpuslice.conf"
FAILED = "Error: systemctl daemon-reload failed (exit status 1), so systemd has not loaded "


def enroll(root: Path, *args: str, reload: bool = True) -> Result:
    """`gpuslice enroll plain ARGS`; with `reload`, systemctl (stood in for) runs."""
    no_reload = [] if reload else ["--no-reload"]
    return invoke("enroll", "plain", *args, *no_reload, "--root", str(root))


def test_a_failed_reload_removes_the_dropin_and_the_directory_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain_unit(tmp_path)
    ran = systemctl(monkeypatch, _fails("daemon-reload"))
    result = enroll(tmp_path, "--priority", "5")
    assert result.exit_code == 1, result.output
    assert f"{FAILED}plain.service's drop-in: removed {tmp_path / DROPIN}\n" in result.output
    assert "enrolled" not in result.output
    assert files(tmp_path) == [f"{SYSTEM}/plain.service"]
    assert not (tmp_path / DROPIN).parent.exists()
    assert ran == [["systemctl", "daemon-reload"]]


def test_a_failed_reload_keeps_a_directory_it_did_not_make_and_its_other_dropins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain_unit(tmp_path)
    other = tmp_path / SYSTEM / "plain.service.d/override.conf"
    other.parent.mkdir()
    other.write_text("[Service]\nEnvironment=A=1\n")
    systemctl(monkeypatch, _fails("daemon-reload"))
    result = enroll(tmp_path, "--priority", "5")
    assert result.exit_code == 1, result.output
    assert f"removed {tmp_path / DROPIN}\n" in result.output
    assert files(tmp_path) == [f"{SYSTEM}/plain.service", f"{SYSTEM}/plain.service.d/override.conf"]


def test_a_failed_reload_puts_back_the_dropin_enroll_had_written_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain_unit(tmp_path)
    assert enroll(tmp_path, "--priority", "5", reload=False).exit_code == 0
    dropin = tmp_path / DROPIN
    before = dropin.read_bytes()
    systemctl(monkeypatch, _fails("daemon-reload"))
    result = enroll(tmp_path, "--priority", "6")
    assert result.exit_code == 1, result.output
    assert f"{FAILED}plain.service's drop-in: put back the previous {dropin}\n" in result.output
    assert dropin.read_bytes() == before


def test_a_systemctl_that_cannot_run_removes_the_dropin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(command: list[str]) -> int:
        raise FileNotFoundError(2, "No such file or directory", "systemctl")

    plain_unit(tmp_path)
    systemctl(monkeypatch, missing)
    result = enroll(tmp_path, "--priority", "5")
    assert result.exit_code == 1, result.output
    assert "Error: cannot run systemctl: " in result.output
    assert f"removed {tmp_path / DROPIN}" in result.output
    assert files(tmp_path) == [f"{SYSTEM}/plain.service"]


def test_a_failed_reload_leaves_a_dropin_another_writer_put_there_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The undo removes the file this run wrote (its device and inode), never one an admin's
    editor (`systemctl edit`) renamed over it while the reload ran."""
    plain_unit(tmp_path)
    dropin = tmp_path / DROPIN
    theirs = "[X-GPUSlice]\nPriority=9\n"
    systemctl(monkeypatch, reload_fails_after_a_rewrite(dropin, theirs))
    result = enroll(tmp_path, "--priority", "5")
    assert result.exit_code == 1, result.output
    assert f"left {dropin} as it is: another program replaced it since it was written" in (
        result.output
    )
    assert dropin.read_text() == theirs


@pytest.mark.parametrize("status", [0, 1])
def test_the_reload_and_its_undo_hold_the_unit_directory_s_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    """Another `gpuslice new` or `enroll` waits until the reload is done or undone: the undo
    never meets its write. A reload that succeeds keeps the drop-in and says it enrolled."""
    plain_unit(tmp_path)
    held: list[bool] = []
    systemctl(monkeypatch, reload_noting_the_lock(tmp_path, held, status))
    result = enroll(tmp_path, "--priority", "5")
    assert result.exit_code == status, result.output
    assert held == [True]
    assert ("enrolled plain.service (priority 5) via" in result.output) is (status == 0)
    assert (tmp_path / DROPIN).exists() is (status == 0)
