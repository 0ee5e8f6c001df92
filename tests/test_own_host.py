"""No unit test reads or writes the host's gpuslice (tests/hostpaths.py, tests/conftest.py).

A /var/lib/gpuslice left on the CI machine by mutants made 27 tests of release-jobs fail in a
fresh clone: what a unit test reads must be its own. These tests never touch the host's own
paths either. The bindings' values inside a test stand in for the host: what is planted there
is read by gpuslice's readers as they would read the host's (the control), and once
`hostpaths.isolate` has moved the defaults as the autouse fixture moves the host's, nothing
planted is read.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuslice import cli as cli_module
from gpuslice import config as config_module
from gpuslice import paths
from gpuslice.cli import main
from gpuslice.config import Config
from gpuslice.core.scheduler import SavedState
from gpuslice.state import StateStore
from tests import hostpaths
from tests.release_jobs_standins import systemctl_and_resume

BOOT = "planted-boot"


def test_every_default_inside_a_unit_test_is_below_its_own_root(
    tmp_path: Path, own_host: Path
) -> None:
    """Each default is the host's path below the test's root (tmp_path/host), the CLI's
    --config and --root and the config loaders' included; the real values are kept."""
    assert own_host == tmp_path / "host"
    moved = {f"{m.__name__.rpartition('.')[2]}.{n}": getattr(m, n) for m, n in hostpaths.BINDINGS}
    assert moved == {
        name: type(real)(own_host / os.fspath(real).lstrip("/"))
        for name, real in hostpaths.REAL.items()
    }
    assert hostpaths.REAL["paths.DEFAULT_STATE_DIR"] == "/var/lib/gpuslice"
    assert hostpaths.REAL["paths.DEFAULT_RUNTIME_DIR"] == "/run/gpuslice"
    assert hostpaths.REAL["paths.CONFIG_PATH"] == "/etc/gpuslice/config.yaml"
    assert hostpaths.REAL["journal.SOCKET"] == "/run/systemd/journal/socket"
    config = str(own_host / "etc/gpuslice/config.yaml")
    assert config_module.load_config.__defaults__ == (config,)
    assert config_module.load_config_with_warnings.__defaults__ == (config,)
    defaults = {
        (name, p.name): p.default
        for name, command in main.commands.items()
        for p in command.params
        if p.name in ("config_path", "root")
    }
    assert defaults["check", "config_path"] == config
    assert defaults["release-jobs", "config_path"] == config
    assert {defaults[c, "root"] for c in ("check", "new", "enroll")} == {str(own_host)}
    assert set(defaults.values()) == {config, str(own_host)}
    for name in hostpaths.UNSET:
        assert name not in os.environ
    bus = os.environ["DBUS_SYSTEM_BUS_ADDRESS"]
    assert bus == f"unix:path={own_host}/run/dbus/system_bus_socket"


def _on_the_host(path: str | Path) -> bool:
    return any(Path(path).is_relative_to(own) for own in hostpaths.WATCHED)


def _plant(path: str | Path, text: str) -> None:
    assert not _on_the_host(path), f"{path}: never planted on this host"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    os.chmod(path, 0o644)  # as root leaves it: a record others may write is not believed


def _check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    """A config.yaml gpuslice refuses, at the default `gpuslice check` reads."""
    _plant(paths.CONFIG_PATH, "gpus: 0\n")
    return lambda: CliRunner().invoke(main, ["check", "--config-only"]).exit_code


def _load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    """A config.yaml with gpus: 3, at the default of config.load_config."""
    _plant(paths.CONFIG_PATH, "gpus: 3\n")
    return lambda: config_module.load_config().gpus


def _boot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    """This boot as a controller recorded it, where release-jobs reads it (else it asks the
    system bus, which is no daemon's here)."""
    _plant(cli_module.THIS_BOOT_RECORD, f"{BOOT}\n")
    monkeypatch.setattr(cli_module, "BUS_TIMEOUT", 5.0)

    def boot() -> Any:
        told = cli_module._this_boot()[0]
        gc.collect()  # the socket of the connection that failed is said unclosed here
        return told

    return boot


def _pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    """The runtime_dir this boot's controller ran with, recorded where release-gates reads
    it: the gates it wakes (stood in: none of them is opened)."""
    from gpuslice import gatepipes

    _plant(paths.RUNTIME_DIR_RECORD, "/run/gpuslice/planted\n")
    woken: list[str] = []
    monkeypatch.setattr(gatepipes, "wake_and_remove", lambda d: woken.append(str(d)))
    (tmp_path / "config.yaml").write_text("runtime_dir: /run/gpuslice/configured\n")

    def release() -> Any:
        CliRunner().invoke(main, ["release-gates", "--config", str(tmp_path / "config.yaml")])
        return "/run/gpuslice/planted/gate" in woken

    return release


def _saved(state_dir: str | Path) -> None:
    assert not _on_the_host(state_dir), f"{state_dir}: never planted on this host"
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    StateStore(Path(state_dir)).save(SavedState(preempted={"planted.service": 1}, seq=1), BOOT)


def _release_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    """release-jobs with config.yaml's state_dir empty: whether it names the unit of a state
    found elsewhere (no systemd: stand-ins)."""
    config = Config(state_dir=str(tmp_path / "lib"), runtime_dir=str(tmp_path / "run"))
    (tmp_path / "lib").mkdir()
    monkeypatch.setattr(cli_module, "load_config_with_warnings", lambda path: (config, []))
    systemctl_and_resume(monkeypatch, {})

    def release() -> Any:
        result = CliRunner().invoke(main, ["release-jobs"])
        return "planted.service" in result.stderr

    return release


def _default_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    """A state where a controller that recorded no state_dir left it: the default."""
    _saved(paths.DEFAULT_STATE_DIR)
    return _release_jobs(tmp_path, monkeypatch)


def _recorded_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    """A state in the state_dir the last controller recorded."""
    moved = f"{paths.DEFAULT_STATE_DIR}/moved"
    _plant(paths.STATE_DIR_RECORD, f"{moved}\n")
    _saved(moved)
    return _release_jobs(tmp_path, monkeypatch)


# what each reader finds of what is planted at the defaults, and of nothing
READERS: dict[str, tuple[Callable[[Path, pytest.MonkeyPatch], Callable[[], Any]], Any, Any]] = {
    "check": (_check, 1, 0),
    "load_config": (_load, 3, 1),
    "boot record": (_boot, BOOT, ""),
    "runtime_dir record": (_pinned, True, False),
    "default state_dir": (_default_state_dir, True, False),
    "state_dir record": (_recorded_state_dir, True, False),
}


# dbus-next leaves the socket of a connection that failed unclosed (message_bus.py,
# _setup_socket): harmless in a command that exits, a ResourceWarning here.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("isolated", [False, True], ids=["planted", "isolated"])
@pytest.mark.parametrize("reader", READERS)
def test_what_is_at_the_defaults_is_read_only_until_they_are_isolated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str, isolated: bool
) -> None:
    """Planted at the defaults (here, the test's own), a reader finds it: this is what it
    would find on the host. After `isolate`, as the autouse fixture does to the host's
    defaults, it finds nothing of it."""
    plant, found, nothing = READERS[reader]
    read = plant(tmp_path, monkeypatch)
    if isolated:
        hostpaths.isolate(monkeypatch, tmp_path / "isolated")
    assert read() == (nothing if isolated else found)


def test_under_mutmut_each_copy_of_a_loader_defaults_to_the_tests_own_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mutmut (`make mutate`) calls the original and each mutant of a function, each with a
    default of its own, from a trampoline that has none: every one of them is moved."""

    def load(path: str = paths.CONFIG_PATH) -> str:
        return path

    def mutant(path: str = paths.CONFIG_PATH, other: str = "x") -> str:
        return path

    def trampoline(*args: Any, **kwargs: Any) -> str:
        return load(*args, **kwargs)

    module = types.ModuleType("mutated")
    module.load = trampoline  # type: ignore[attr-defined]
    module.mutants_x_load__mutmut = {"_mutmut_orig": load, "x_load__mutmut_1": mutant}  # type: ignore[attr-defined]
    monkeypatch.setattr(hostpaths, "CONFIG_LOADERS", ((module, "load"),))
    hostpaths.isolate(monkeypatch, tmp_path / "isolated")
    assert trampoline.__defaults__ is None
    assert load.__defaults__ == (paths.CONFIG_PATH,)
    assert mutant.__defaults__ == (paths.CONFIG_PATH, "x")
    assert load().startswith(f"{tmp_path}/isolated/")


def test_a_host_directory_made_during_a_test_is_named_with_the_tests(tmp_path: Path) -> None:
    """The watch (tests/conftest.py): which of the host's directories are there now, and what
    a run that made one says. Here on the test's own directories, not the host's."""
    assert hostpaths.WATCHED == ("/etc/gpuslice", "/var/lib/gpuslice", "/run/gpuslice")
    watched = (str(tmp_path / "etc/gpuslice"), str(tmp_path / "var/lib/gpuslice"))
    (tmp_path / "etc").mkdir()
    before = hostpaths.present(watched)
    Path(watched[1]).mkdir(parents=True)
    assert (before, hostpaths.present(watched)) == (frozenset(), frozenset({watched[1]}))
    os.symlink("nowhere", watched[0])  # a link that leads nowhere is there too
    assert hostpaths.present(watched) == frozenset(watched)
    said = hostpaths.leaked(frozenset({watched[1]}), ["tests/test_a.py", "tests/test_b.py"])
    assert said.startswith(f"unit tests made {watched[1]} on this host (not there before)")
    assert said.endswith("Ran: tests/test_a.py tests/test_b.py")


# run with SIGHUP, SIGTERM and SIGQUIT ignored, as `nohup` or a shell without job control
# starts it: what it starts traps each (one line each), and it outlives each sent to itself
_STARTED_IGNORING = """
import os, signal, subprocess, sys
from tests.conftest import _signals_as_a_shell_leaves_them
_signals_as_a_shell_leaves_them()
trap = 'trap "echo trapped" HUP TERM QUIT; for s in HUP TERM QUIT; do kill -$s $$; done'
print(subprocess.run(["/bin/sh", "-c", trap], capture_output=True, text=True).stdout, end="")
for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT):
    os.kill(os.getpid(), sig)
print("still here")
"""


def test_signals_ignored_by_the_tests_starter_stay_ignored_here_and_not_in_what_they_start() -> (
    None
):
    """`nohup make mutate &` (hours, over ssh): SIGHUP, SIGTERM and SIGQUIT ignored by whatever
    started the tests stay ignored by the test process, which the terminal's hangup killed
    when conftest reset them to their default; what the tests start (the gate shell) can
    trap them all the same, as under systemd."""
    root = Path(__file__).parent.parent
    done = subprocess.run(
        [
            "/bin/sh",
            "-c",
            'trap "" HUP TERM QUIT; exec "$0" -c "$1"',
            sys.executable,
            _STARTED_IGNORING,
        ],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, "trapped\n" * 3 + "still here\n"), done.stderr
