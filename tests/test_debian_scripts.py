"""The hand-written parts of the Debian maintainer scripts (debian/gpuslice.*), read and run
with stubs: what `apt remove` must stop, and what it must leave alone.

debhelper adds the controller's own steps at #DEBHELPER# (stop on remove, restart after
upgrade, daemon-reload after remove); tests/integration/test_debian.py installs, upgrades and
removes the built package in a booted Debian 12.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

DEBIAN = Path(__file__).resolve().parent.parent / "debian"


# Every command the hand-written parts run that acts on the system: stubs that only record.
STUBS = ("deb-systemd-invoke", "systemctl", "systemd-sysusers", "busctl", "rm")


def _run(tmp_path: Path, script: str, *args: str, dpkg_root: str = "") -> list[str]:
    """`script ARGS` with the STUBS; the calls they got. /run/systemd/system is taken as
    present (a host booted with systemd); DPKG_ROOT is `dpkg_root` if given."""
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in STUBS:
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
        stub.chmod(0o755)
    text = (DEBIAN / script).read_text().replace("[ -d /run/systemd/system ]", "true")
    subprocess.run(
        ["/bin/sh", "-c", text, script, *args],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", **({"DPKG_ROOT": dpkg_root} if dpkg_root else {})},
        check=True,
    )
    return calls.read_text().splitlines() if calls.exists() else []


def test_remove_stops_the_metrics_socket(tmp_path: Path) -> None:
    """Installed with --no-start, the socket gets no stop from debhelper: an enabled one
    would listen on for a service that is gone."""
    assert _run(tmp_path, "gpuslice.prerm", "remove") == [
        "deb-systemd-invoke stop gpuslice-metrics.socket"
    ]


@pytest.mark.parametrize("args", [("upgrade", "0.1.0"), ("deconfigure", "in-favour", "x")])
def test_other_prerm_calls_stop_nothing(tmp_path: Path, args: tuple[str, ...]) -> None:
    assert _run(tmp_path, "gpuslice.prerm", *args) == []


@pytest.mark.parametrize("root", ["", "/srv/target"])
def test_configure_makes_the_exporters_user_in_the_system_installed(
    tmp_path: Path, root: str
) -> None:
    """With DPKG_ROOT (dpkg --root, chrootless), the user goes into that system's
    /etc/passwd, not the host's."""
    option = f"--root={root} " if root else ""
    assert f"systemd-sysusers {option}gpuslice-metrics.conf" in _run(
        tmp_path, "gpuslice.postinst", "configure", dpkg_root=root
    )


@pytest.mark.parametrize("root", ["", "/srv/target"])
def test_purge_removes_the_directories_of_the_system_installed(tmp_path: Path, root: str) -> None:
    """With DPKG_ROOT, purge removes that system's state and config, never the host's."""
    assert _run(tmp_path, "gpuslice.postrm", "purge", dpkg_root=root) == [
        f"rm -rf {root}/var/lib/gpuslice {root}/etc/gpuslice {root}/run/gpuslice"
    ]


@pytest.mark.parametrize("args", [("remove",), ("upgrade", "0.1.0")])
def test_remove_and_upgrade_remove_no_directory(tmp_path: Path, args: tuple[str, ...]) -> None:
    assert _run(tmp_path, "gpuslice.postrm", *args) == []


@pytest.mark.parametrize("script", ["gpuslice.prerm", "gpuslice.postinst", "gpuslice.postrm"])
def test_each_script_is_sh_and_keeps_debhelpers_part(script: str) -> None:
    text = (DEBIAN / script).read_text()
    assert text.startswith("#!/bin/sh\n")
    assert text.count("\n#DEBHELPER#\n") == 1
    subprocess.run(["/bin/sh", "-n", str(DEBIAN / script)], check=True)
