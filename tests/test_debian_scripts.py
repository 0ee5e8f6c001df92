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


# Where the scripts' paths on the host lead in these tests (below tmp_path): prerm's runtime
# drop-in that keeps the controller from starting during a removal, and a `make install`
# copy's unit.
REMOVAL_DIR = "/run/systemd/system/gpuslice.service.d"
LOCAL_UNIT = "/usr/local/lib/systemd/system/gpuslice.service"


def _removal_dropin(tmp_path: Path) -> Path:
    return tmp_path / "run" / "gpuslice.service.d" / "gpuslice-removal.conf"


def _run_full(
    tmp_path: Path,
    script: str,
    *args: str,
    dpkg_root: str = "",
    text: str | None = None,
) -> tuple[list[str], str]:
    """`script ARGS` (or `text`, named `script`) with the STUBS; the calls they got, and
    what it said on stderr. /run/systemd/system is taken as present (a host booted with
    systemd); DPKG_ROOT is `dpkg_root` if given. debhelper's part (#DEBHELPER#) is one call,
    `debhelper-part`. The package's own command (/usr/bin/gpuslice) is a stub of its own,
    told apart from the `gpuslice` first in PATH, and says whether Python may write bytecode
    (tmp_path/bytecode)."""
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in (*STUBS, "debhelper-part"):
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
        stub.chmod(0o755)
    own = tmp_path / "usr-bin-gpuslice"
    own.write_text(
        f'#!/bin/sh\necho "/usr/bin/gpuslice $*" >> {calls}\n'
        f'echo "${{PYTHONDONTWRITEBYTECODE:-}}" > {tmp_path / "bytecode"}\n'
    )
    own.chmod(0o755)
    if text is None:
        text = (DEBIAN / script).read_text()
    text = (
        text.replace("[ -d /run/systemd/system ]", "true")
        .replace("\n#DEBHELPER#\n", '\ndebhelper-part "$@"\n')
        .replace(REMOVAL_DIR, str(_removal_dropin(tmp_path).parent))
        .replace(LOCAL_UNIT, str(tmp_path / "local-gpuslice.service"))
        .replace("/usr/bin/gpuslice ", f"{own} ")
    )
    done = subprocess.run(
        ["/bin/sh", "-c", text, script, *args],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", **({"DPKG_ROOT": dpkg_root} if dpkg_root else {})},
        check=True,
        stderr=subprocess.PIPE,
        text=True,
    )
    return (calls.read_text().splitlines() if calls.exists() else []), done.stderr


def _run(
    tmp_path: Path,
    script: str,
    *args: str,
    dpkg_root: str = "",
    text: str | None = None,
) -> list[str]:
    """The calls of `_run_full`, debhelper's part left out."""
    calls, _ = _run_full(tmp_path, script, *args, dpkg_root=dpkg_root, text=text)
    return [c for c in calls if not c.startswith("debhelper-part")]


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
    calls, _ = _run_full(tmp_path, "gpuslice.prerm", "remove")
    assert calls[-2:] == ["debhelper-part remove", "/usr/bin/gpuslice release-jobs"]


def test_remove_runs_the_packages_own_release_jobs_without_bytecode(tmp_path: Path) -> None:
    """release-jobs is the package's /usr/bin/gpuslice, not a `gpuslice` first in PATH
    (/usr/local/bin: a `make install` or pip copy); and it writes no bytecode: dh_python3's
    py3clean runs in prerm before it, and the __pycache__ Python wrote then, in no package's
    file list, kept /usr/lib/gpuslice/python/gpuslice after `apt purge`."""
    calls = _run(tmp_path, "gpuslice.prerm", "remove")
    assert "/usr/bin/gpuslice release-jobs" in calls
    assert not [c for c in calls if c.startswith("gpuslice ")], calls
    assert (tmp_path / "bytecode").read_text().strip() == "1"


def test_remove_keeps_the_controller_from_starting_again(tmp_path: Path) -> None:
    """Every gated unit Wants= gpuslice.service (its gate's drop-in) until postrm's reload:
    a gated start after debhelper's stop (a Restart=, a timer) started the controller again,
    release-jobs then left every unit to it, and it ran on from removed files. prerm writes
    a runtime drop-in whose condition fails while it exists, and reloads, before the stop."""
    calls, _ = _run_full(tmp_path, "gpuslice.prerm", "remove")
    assert calls[1:3] == ["systemctl daemon-reload", "debhelper-part remove"]
    dropin = _removal_dropin(tmp_path)
    condition = f"ConditionPathExists=!{dropin}"
    assert dropin.read_text().splitlines()[1:] == ["[Unit]", condition]
    if shutil.which("systemd-analyze") is not None:  # unmet while the file exists
        checked = subprocess.run(["systemd-analyze", "condition", condition], capture_output=True)
        assert checked.returncode != 0, checked


def test_postrm_lifts_the_removal_dropin_before_its_reload(tmp_path: Path) -> None:
    """Gone before debhelper's daemon-reload: that reload must show gpuslice.service not
    found, the sign a waiting gate lets its start go on by."""
    _run(tmp_path, "gpuslice.prerm", "remove")
    (tmp_path / "calls").unlink()
    calls, _ = _run_full(tmp_path, "gpuslice.postrm", "remove")
    assert calls == [f"rm -f {_removal_dropin(tmp_path)}", "debhelper-part remove"]


@pytest.mark.parametrize("args", [("abort-remove",), ("configure", "0.1.0")])
def test_postinst_lifts_the_removal_dropin_before_the_start(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    """A removal undone (abort-remove), or cut short after prerm and installed again: left,
    the drop-in skipped debhelper's start, and every gate waited until the next boot."""
    _run(tmp_path, "gpuslice.prerm", "remove")
    (tmp_path / "calls").unlink()
    calls, _ = _run_full(tmp_path, "gpuslice.postinst", *args)
    rm = calls.index(f"rm -f {_removal_dropin(tmp_path)}")
    assert rm < calls.index(f"debhelper-part {' '.join(args)}")


def test_configure_says_a_make_install_copy_hides_the_package(tmp_path: Path) -> None:
    """/usr/local/lib/systemd/system/gpuslice.service (`make install`) comes before the
    package's: its controller is the one started, restarted at each upgrade and stopped at
    removal. Said at install, not silently."""
    _, quiet = _run_full(tmp_path, "gpuslice.postinst", "configure")
    assert "make install" not in quiet
    (tmp_path / "local-gpuslice.service").touch()
    _, said = _run_full(tmp_path, "gpuslice.postinst", "configure")
    assert "(`make install`) hides this package's controller" in said


def test_configure_says_a_config_this_version_refuses_and_goes_on(tmp_path: Path) -> None:
    """A config.yaml the new version refuses keeps the controller from starting (exit 78) and
    every gated start waiting, where apt showed only systemctl's "Job ... failed": the
    package's own check says which file, line and key, then the install goes on (a failed
    configure would leave the package half-installed, the gates waiting all the same)."""
    calls, quiet = _run_full(tmp_path, "gpuslice.postinst", "configure")
    assert "/usr/bin/gpuslice check --config-only" in calls
    assert calls.index("/usr/bin/gpuslice check --config-only") < calls.index(
        "debhelper-part configure"
    )
    assert (tmp_path / "bytecode").read_text() == "1\n"  # nothing written under /usr/lib
    assert "config.yaml" not in quiet
    refused = (
        (DEBIAN / "gpuslice.postinst")
        .read_text()
        .replace(
            "/usr/bin/gpuslice check --config-only",
            "sh -c 'echo \"error: /etc/gpuslice/config.yaml:3: gpus: bad\" >&2; exit 1' --",
        )
    )
    calls, said = _run_full(tmp_path, "gpuslice.postinst", "configure", text=refused)
    assert said.splitlines() == [
        "error: /etc/gpuslice/config.yaml:3: gpus: bad",
        "gpuslice: the controller will not start until /etc/gpuslice/config.yaml is fixed "
        "(above), and gated units wait for it: fix it, then `systemctl restart gpuslice.service`",
    ]
    assert calls[-1] == "debhelper-part configure"
    _, elsewhere = _run_full(
        tmp_path, "gpuslice.postinst", "configure", dpkg_root="/t", text=refused
    )
    assert "config.yaml" not in elsewhere  # another root's /etc is not the one read here


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


def test_make_uninstall_keeps_the_controller_from_starting_again() -> None:
    """As prerm: the removal drop-in is written and read (a reload) before the controller's
    stop, and goes before the last reload, which must show gpuslice.service gone."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    commands = subprocess.run(
        ["make", "-n", "--no-print-directory", "uninstall", "PREFIX=/usr/local"],
        cwd=DEBIAN.parent,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    written = next(i for i, c in enumerate(commands) if c.startswith(f"mkdir -p {REMOVAL_DIR}"))
    reloads = [i for i, c in enumerate(commands) if c == "systemctl daemon-reload"]
    stop = commands.index("systemctl disable --now gpuslice.service")
    lifted = commands.index(f"rm -f {REMOVAL_DIR}/gpuslice-removal.conf")
    assert written < reloads[0] < stop < lifted < reloads[-1]


def _make_install(tmp_path: Path, dpkg_query: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`make install` into a temporary prefix with systemctl, systemd-sysusers and busctl
    stubbed (each call written to the returned file) and `dpkg_query` as dpkg-query's body."""
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("systemctl", "systemd-sysusers", "busctl"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
    (bin_dir / "dpkg-query").write_text(f"#!/bin/sh\n{dpkg_query}\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    done = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "install",
            f"PREFIX={tmp_path / 'prefix'}",
            f"SYSCONFDIR={tmp_path / 'etc'}",
            f"REMOVAL_DROPIN_DIR={tmp_path / 'run'}",
        ],
        cwd=DEBIAN.parent,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, calls


@pytest.mark.parametrize(
    ("status", "refused"),
    [
        ("install ok installed", True),
        ("install ok half-configured", True),
        ("deinstall ok config-files", False),
        ("", False),  # no such package, or no dpkg at all
    ],
)
def test_make_install_refuses_beside_the_package(
    tmp_path: Path, status: str, refused: bool
) -> None:
    """`make install` beside the installed package made two copies of gpuslice.service, this
    one first in systemd's search path: the package's upgrades restarted it and its removal
    stopped it, its own code never ran. Refused before anything is written or called."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done, calls = _make_install(tmp_path, f"printf '%s' '{status}'")
    prefix = tmp_path / "prefix"
    if refused:
        assert done.returncode != 0
        assert "the gpuslice Debian package is installed" in done.stderr
        assert not prefix.exists()
        assert not calls.exists()
    else:
        assert done.returncode == 0, done.stderr
        assert "systemctl enable gpuslice.service" in calls.read_text()


def test_make_install_over_an_earlier_copy_restarts_the_controller(tmp_path: Path) -> None:
    """`make install` run again (a `git pull`, then the install as README says) replaced
    the gate, the generator and the code, and `systemctl enable --now` left the controller
    of the earlier copy running (a start of an active unit does nothing): its old code ran
    on beside the new gate and drop-ins until the next reboot. It is restarted once the new
    files are in place and read, as the package's upgrade restarts it; on a first install,
    the restart starts it."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done, calls = _make_install(tmp_path, "exit 1")  # no dpkg database
    assert done.returncode == 0, done.stderr
    systemctl = [c for c in calls.read_text().splitlines() if c.startswith("systemctl ")]
    assert systemctl[-3:] == [
        "systemctl daemon-reload",
        "systemctl enable gpuslice.service",
        "systemctl restart gpuslice.service",
    ]
