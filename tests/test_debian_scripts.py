"""The hand-written parts of the Debian maintainer scripts (debian/gpuslice.*), read and run
with stubs: what `apt remove` must stop, and what it must leave alone.

debhelper adds the controller's own steps at #DEBHELPER# (stop on remove, restart after
upgrade, daemon-reload after remove); tests/integration/test_debian.py installs, upgrades and
removes the built package in a booted Debian 12.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

DEBIAN = Path(__file__).resolve().parent.parent / "debian"


# Every command the hand-written parts (and debhelper's snippets) run that acts on the
# system: stubs that only record.
STUBS = (
    "deb-systemd-invoke",
    "deb-systemd-helper",
    "systemctl",
    "systemd-sysusers",
    "busctl",
    "rm",
    "gpuslice",
)


def _run(
    tmp_path: Path,
    script: str,
    *args: str,
    dpkg_root: str = "",
    text: str | None = None,
) -> list[str]:
    """`script ARGS` (or `text`, named `script`) with the STUBS; the calls they got.
    /run/systemd/system is taken as present (a host booted with systemd); DPKG_ROOT is
    `dpkg_root` if given."""
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in STUBS:
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
        stub.chmod(0o755)
    if text is None:
        text = (DEBIAN / script).read_text()
    text = text.replace("[ -d /run/systemd/system ]", "true")
    subprocess.run(
        ["/bin/sh", "-c", text, script, *args],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", **({"DPKG_ROOT": dpkg_root} if dpkg_root else {})},
        check=True,
    )
    return calls.read_text().splitlines() if calls.exists() else []


def test_remove_stops_the_metrics_socket(tmp_path: Path) -> None:
    """Installed with --no-start, the socket gets no stop from debhelper: an enabled one
    would listen on for a service that is gone."""
    assert _run(tmp_path, "gpuslice.prerm", "remove")[0] == (
        "deb-systemd-invoke stop gpuslice-metrics.socket"
    )


def test_remove_releases_the_jobs_once_the_controller_is_stopped(tmp_path: Path) -> None:
    """After debhelper's stop of the controller (at #DEBHELPER#), nothing would ever thaw a
    unit it froze, resume one it suspended or start one it preempted: `gpuslice
    release-jobs` thaws the first and names the others. After the stop, never before."""
    text = (DEBIAN / "gpuslice.prerm").read_text()
    assert text.index("#DEBHELPER#") < text.index("gpuslice release-jobs")
    assert _run(tmp_path, "gpuslice.prerm", "remove")[1:] == ["gpuslice release-jobs"]


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
        f" {root}/etc/systemd/system/.gpuslice.lock"
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


def _debhelper_snippets(tmp_path: Path) -> dict[str, str]:
    """The maintainer script snippets debian/rules' override_dh_installsystemd makes
    debhelper write for the two units it names, by script (preinst, postinst, prerm,
    postrm)."""
    if shutil.which("dh_installsystemd") is None or shutil.which("make") is None:
        pytest.skip("debhelper is not installed")
    build = tmp_path / "build"
    units = build / "debian" / "gpuslice" / "lib" / "systemd" / "system"
    units.mkdir(parents=True)
    for name in ("control", "changelog", "rules", "nvidia-ml-py.sha256"):
        shutil.copy(DEBIAN / name, build / "debian" / name)
    for unit in ("gpuslice.service", "gpuslice-metrics.socket"):
        shutil.copy(DEBIAN.parent / "units" / unit, units / unit)
    subprocess.run(
        ["make", "-s", "-f", "debian/rules", "override_dh_installsystemd"],
        cwd=build,
        check=True,
        capture_output=True,
    )
    snippets: dict[str, str] = {}
    for path in sorted((build / "debian").rglob("*")):
        for script in ("preinst", "postinst", "prerm", "postrm"):
            if path.is_file() and path.name.startswith((script + ".", f"gpuslice.{script}.")):
                snippets[script] = snippets.get(script, "") + path.read_text()
    return snippets


def test_upgrade_keeps_an_enabled_metrics_socket_listening(tmp_path: Path) -> None:
    """With --no-start alone, debhelper stops the socket in preinst at every upgrade and
    starts it nowhere: an exporter the admin enabled stopped answering after each upgrade
    until the next boot. An upgrade must only try-restart it (a stopped one stays stopped)."""
    snippets = _debhelper_snippets(tmp_path)
    preinst = _run(tmp_path, "preinst", "upgrade", "0.1.0", text=snippets.get("preinst", ""))
    assert not [c for c in preinst if "gpuslice-metrics.socket" in c], preinst
    (tmp_path / "calls").unlink(missing_ok=True)
    postinst = _run(tmp_path, "postinst", "configure", "0.1.0", text=snippets["postinst"])
    assert "deb-systemd-invoke try-restart gpuslice-metrics.socket" in postinst
    assert "deb-systemd-invoke restart gpuslice.service" in postinst
    starts = [c for c in postinst if "gpuslice-metrics.socket" in c and "invoke" in c]
    assert starts == ["deb-systemd-invoke try-restart gpuslice-metrics.socket"]


def test_make_uninstall_releases_the_jobs_after_the_controllers_stop() -> None:
    """`make uninstall`, the other way gpuslice goes, leaves no unit frozen for ever either:
    `gpuslice release-jobs` once the controller is stopped, before its files go."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    commands = subprocess.run(
        ["make", "-n", "--no-print-directory", "uninstall", "PREFIX=/usr/local"],
        cwd=DEBIAN.parent,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    stop = commands.index("systemctl disable --now gpuslice.service")
    release = commands.index("/usr/local/bin/gpuslice release-jobs")
    removal = next(i for i, c in enumerate(commands) if c.startswith("rm "))
    assert stop < release < removal
