"""The unit tests' own host: every default path by which gpuslice reaches the host it runs on
(its config.yaml, state_dir, runtime_dir and their records, the journal's socket, the system
bus, the root `gpuslice new` writes units below), and the variables of its environment that
systemd sets for it, taken away from each unit test (tests/conftest.py).

A test that read the host's /var/lib/gpuslice passed or failed by what another run had left
there (27 failed in a fresh clone of a CI run after mutants left one), and a test that wrote
there overwrote a real controller's state. Each default is re-rooted below a directory of the
test's own (`/var/lib/gpuslice` -> ROOT/var/lib/gpuslice), where nothing is made unless the
code under test writes it: a default read finds nothing, a default written lands in the
test's tmp_path. `REAL` keeps the real values, for the tests of the defaults themselves.

The rules that name the defaults are not moved: config.yaml's state_dir must still be below
/var/lib/gpuslice, and a Config made without one still says /var/lib/gpuslice (a value the
generator writes into gates below a test's own root). Only what is opened by default moves.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from gpuslice import cli, config, controller, journal, paths

# (module, name) of every default path gpuslice opens on its host, read where it is used:
# the names `cli` and `controller` copied at import are their own bindings
BINDINGS: tuple[tuple[Any, str], ...] = (
    (paths, "CONFIG_PATH"),
    (paths, "DEFAULT_STATE_DIR"),  # release-jobs: an older controller's state
    (paths, "DEFAULT_RUNTIME_DIR"),  # release-gates: the default's gate pipes
    (paths, "RUNTIME_DIR_RECORD"),
    (paths, "STATE_DIR_RECORD"),
    (paths, "BOOT_RECORD"),
    (cli, "THIS_BOOT_RECORD"),  # release-jobs: this boot as the controller recorded it
    (controller, "RUNTIME_RECORD"),
    (controller, "STATE_RECORD"),
    (controller, "THIS_BOOT_RECORD"),
    (journal, "SOCKET"),
)
# functions whose default argument is the host's config.yaml (no caller in gpuslice leaves it
# out; a test might)
CONFIG_LOADERS = ((config, "load_config"), (config, "load_config_with_warnings"))
# what systemd tells gpuslice.service through its environment, and gpuslice's own settings
# there: a test run from a unit (a CI runner's service) or a shell that set one would write
# to the host's journal or notify socket, or ask its bus
UNSET = (
    "GPUSLICE_BUS_ADDRESS",
    paths.RUNTIME_DIR_ENV,
    "JOURNAL_STREAM",
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
)
SYSTEM_BUS = "run/dbus/system_bus_socket"  # below the root: where no bus daemon listens

# the real values, by module and name ("paths.DEFAULT_STATE_DIR"): for the tests of the defaults
REAL: dict[str, Any] = {
    f"{m.__name__.rpartition('.')[2]}.{name}": getattr(m, name) for m, name in BINDINGS
}
# the host's own gpuslice directories: a unit test that makes one fails (tests/conftest.py)
WATCHED = (
    os.path.dirname(paths.CONFIG_PATH),
    paths.DEFAULT_STATE_DIR,
    paths.DEFAULT_RUNTIME_DIR,
)


def present(watched: tuple[str, ...] = WATCHED) -> frozenset[str]:
    """Those of `watched` that are there now (a link that leads nowhere too)."""
    return frozenset(p for p in watched if os.path.lexists(p))


def leaked(made: frozenset[str], tests: list[str]) -> str:
    """What a run that made `made` on the host says: which, by which tests, what to do."""
    return (
        f"unit tests made {', '.join(sorted(made))} on this host (not there before), which "
        f"every later run reads as the host's gpuslice: remove it (rm -r), and find the "
        f"default path they still reach (tests/hostpaths.py). Ran: {' '.join(tests)}"
    )


def _commands(group: click.Group) -> Iterator[click.Command]:
    for command in group.commands.values():
        yield command
        if isinstance(command, click.Group):
            yield from _commands(command)


def _copies(module: Any, name: str) -> Iterator[Any]:
    """The function `name` of `module`, and under mutmut (`make mutate`) the original and each
    mutant its trampoline calls: each has the default of its own."""
    yield getattr(module, name)
    yield from getattr(module, f"mutants_x_{name}__mutmut", {}).values()


def rerooted(value: str | Path, root: Path) -> str | Path:
    """`value`, an absolute path of the host, below `root` instead, of the same type."""
    moved = root / os.fspath(value).lstrip("/")
    return moved if isinstance(value, Path) else str(moved)


def isolate(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Point every default of BINDINGS, of the CLI's --config and --root and of the config
    loaders below `root`, as they are now, and take away the environment that would lead
    gpuslice to the host (UNSET; the system bus is a socket below `root` no daemon opened)."""
    was = paths.CONFIG_PATH
    for module, name in BINDINGS:
        monkeypatch.setattr(module, name, rerooted(getattr(module, name), root))
    config_path = paths.CONFIG_PATH  # as moved above
    for module, name in CONFIG_LOADERS:
        for function in _copies(module, name):
            defaults = function.__defaults__ or ()
            moved = tuple(config_path if d == was else d for d in defaults)
            monkeypatch.setattr(function, "__defaults__", moved or None)
    for command in _commands(cli.main):
        for param in command.params:
            if param.name == "config_path":
                monkeypatch.setattr(param, "default", config_path)
            elif param.name == "root" and isinstance(param.default, str):
                monkeypatch.setattr(param, "default", rerooted(param.default, root))
    for name in UNSET:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={root / SYSTEM_BUS}")
