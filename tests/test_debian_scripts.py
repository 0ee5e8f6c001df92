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


def _run(tmp_path: Path, script: str, *args: str) -> list[str]:
    """`script ARGS` with deb-systemd-invoke and systemctl as stubs; the calls they got.
    /run/systemd/system is taken as present (a host booted with systemd)."""
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("deb-systemd-invoke", "systemctl"):
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
        stub.chmod(0o755)
    text = (DEBIAN / script).read_text().replace("[ -d /run/systemd/system ]", "true")
    subprocess.run(
        ["/bin/sh", "-c", text, script, *args],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
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


@pytest.mark.parametrize("script", ["gpuslice.prerm", "gpuslice.postinst", "gpuslice.postrm"])
def test_each_script_is_sh_and_keeps_debhelpers_part(script: str) -> None:
    text = (DEBIAN / script).read_text()
    assert text.startswith("#!/bin/sh\n")
    assert text.count("\n#DEBHELPER#\n") == 1
    subprocess.run(["/bin/sh", "-n", str(DEBIAN / script)], check=True)
