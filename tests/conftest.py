"""Hypothesis profiles, the fakes of tests/fakenvml built once, and the unit tests' own host.

`make test` (and CI, and `make mutate`) replays the same examples on every run, so a red run
means a change broke something, never chance; `make fuzz` explores new ones
(GPUSLICE_HYPOTHESIS=explore) and prints a replayable failure when it finds one.

No unit test reads or writes the host's gpuslice (tests/hostpaths.py): each runs with every
default path re-rooted below its tmp_path, and one that makes /var/lib/gpuslice, /run/gpuslice
or /etc/gpuslice on the host all the same fails, named, rather than the next run that finds it
there. tests/integration boots its own hosts, and is left alone."""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import pkgutil
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from gpuslice import clock
from tests import hostpaths

FAKE_SRC = Path(__file__).parent / "fakenvml"


def _ignored_here(signum: int, frame: object) -> None:
    """A signal the tests' starter had ignored: still ignored by this process, but, a handler
    rather than SIG_IGN, not by what it starts (exec resets a caught signal to its default)."""


def _signals_as_a_shell_leaves_them() -> None:
    """Undo, for what the tests start, signals ignored by whatever started the tests: bash
    without job control starts a background command (`make test &` in a script, a CI runner's
    shell) with SIGINT and SIGQUIT ignored, mutmut's runner with SIGINT ignored, nohup with
    SIGHUP ignored, and an ignored signal stays ignored through exec: the gate shell the tests
    run could not trap SIGINT (POSIX: ignored on entry stays ignored), and its test failed
    only there. Systemd resets every signal of what it starts, the gate included; the tests
    start theirs as systemd does. This process keeps ignoring SIGQUIT, SIGTERM and SIGHUP
    (`_ignored_here`): reset to their default, a `nohup make mutate &` of hours died with the
    terminal it was started from. SIGINT raises KeyboardInterrupt, as in a shell (the CLI's
    Ctrl-C test sends it)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, _ignored_here)


_signals_as_a_shell_leaves_them()

# no deadline: an example that a loaded machine ran 300 ms late, and at once when replayed,
# failed its test ("Unreliable test timings", hypothesis's 200 ms default); what each test
# checks is its outcome, never its speed
settings.register_profile(
    "repeatable", derandomize=True, database=None, print_blob=True, deadline=None
)
settings.register_profile("explore", derandomize=False, print_blob=True, deadline=None)
settings.load_profile(os.environ.get("GPUSLICE_HYPOTHESIS", "repeatable"))


def _import_local_modules() -> None:
    """Every module of gpuslice and bench imported before any test draws: Hypothesis draws,
    now and then, constants from the source of the local modules imported so far (not
    site-packages, not tests/). Imported by a test (tests/test_bench_day.py imports bench.day)
    or lazily by gpuslice, a module added its constants then, and every property test after
    it drew other examples: a file alone, `make test` and mutmut's subsets each replayed
    different histories, and a failure found in one was not drawn in another (its printed
    blob still replays it). Imported here, the pool is the code's, whatever ran before.
    `make mutate` copies no bench/ (pyproject.toml, [tool.mutmut]): there, gpuslice alone."""
    for name in ("gpuslice", "bench"):
        if importlib.util.find_spec(name) is None:
            continue
        package = importlib.import_module(name)
        for module in pkgutil.walk_packages(package.__path__, f"{name}."):
            importlib.import_module(module.name)


_import_local_modules()

INTEGRATION = Path(__file__).parent / "integration"
# the host's own gpuslice directories, as they were when this session started, and those a
# test was failed for making
_HOST_BEFORE = pytest.StashKey[frozenset[str]]()
_HOST_SAID = pytest.StashKey[set[str]]()


def _unit_test(item: pytest.Item) -> bool:
    return INTEGRATION not in Path(item.path).parents


@pytest.fixture(autouse=True)
def _clock_offset_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test takes the wall clock's offset anew (gpuslice/clock.py keeps it until it moves
    by more than a second): one a test's fake clock left is not another test's."""
    monkeypatch.setattr(clock, "_offset", None)


@pytest.fixture(autouse=True)
def _garbage_said_by_its_test() -> Iterator[None]:
    """The young garbage collected as each test ends (0.1 ms): a task or coroutine the test
    left unfinished ("Task was destroyed but it is pending", "never awaited") fails that
    test, named, not whichever test the collector next happened to run in."""
    yield
    gc.collect(1)


@pytest.fixture(autouse=True)
def own_host(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A unit test's host: every default path of gpuslice's below tmp_path/host (the root it
    yields), none of the host's environment for gpuslice; and the test fails if the host's
    own gpuslice directories (hostpaths.WATCHED) appeared while it ran, whoever made them."""
    if not _unit_test(request.node):
        yield Path("/")
        return
    root = request.getfixturevalue("tmp_path") / "host"
    before = hostpaths.present()
    hostpaths.isolate(monkeypatch, root)
    yield root
    made = hostpaths.present() - before
    if made:
        request.session.stash.setdefault(_HOST_SAID, set()).update(made)
        pytest.fail(hostpaths.leaked(made, [request.node.nodeid]), pytrace=False)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[_HOST_BEFORE] = hostpaths.present()
    session.stash[_HOST_SAID] = set()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Made during a session of unit tests alone, and not yet said by own_host (before the
    first test, after the last, by a process a test left behind): the session fails, naming
    the test files that ran. A session with tests/integration in it is not judged: its
    containers' hosts are their own, but this one is not shown to be untouched by them."""
    items = session.items if hasattr(session, "items") else []
    if any(not _unit_test(item) for item in items):
        return
    before: frozenset[str] = session.stash.get(_HOST_BEFORE, frozenset())
    said: set[str] = session.stash.get(_HOST_SAID, set())
    made = hostpaths.present() - before - said
    if not made:
        return
    files = sorted({item.nodeid.partition("::")[0] for item in items})
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")  # after the progress line
        reporter.write_sep("!", "unit tests reached the host", red=True)
        reporter.write_line(hostpaths.leaked(made, files))
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def fake_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fakes of tests/fakenvml (libnvidia-ml.so.1, gpu-alloc, cuda-checkpoint), built once
    with the project's Makefile into a temp dir, for the tests that run them without a
    container."""
    if shutil.which("make") is None or shutil.which("gcc") is None:
        pytest.skip("make and gcc are needed to build tests/fakenvml")
    build = tmp_path_factory.mktemp("fakenvml-build")
    subprocess.run(
        ["make", "-s", "-C", str(FAKE_SRC), f"BUILD={build}"], check=True, capture_output=True
    )
    return build


@pytest.fixture
def services(tmp_path: Path) -> Iterator[None]:
    """Whatever ran as a fake transient service (tests/test_checkpoint.py's fake_systemd) is
    killed after the test, passed or not."""
    yield
    for pid_file in tmp_path.glob("*.service.pid"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
