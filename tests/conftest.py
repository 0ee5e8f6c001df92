"""Hypothesis profiles, and the fakes of tests/fakenvml built once.

`make test` (and CI, and `make mutate`) replays the same examples on every run, so a red run
means a change broke something, never chance; `make fuzz` explores new ones
(GPUSLICE_HYPOTHESIS=explore) and prints a replayable failure when it finds one."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

FAKE_SRC = Path(__file__).parent / "fakenvml"


def _signals_as_a_shell_leaves_them() -> None:
    """Undo signals ignored by whatever started the tests: bash without job control starts a
    background command (`make test &` in a script, a CI runner's shell) with SIGINT and SIGQUIT
    ignored, mutmut's runner with SIGINT ignored, and an ignored signal stays ignored through
    exec: the gate shell the tests run could not trap SIGINT (POSIX: ignored on entry stays
    ignored), and its test failed only there. Systemd resets every signal of what it starts,
    the gate included; the tests start theirs as systemd does."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)


_signals_as_a_shell_leaves_them()

settings.register_profile("repeatable", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("GPUSLICE_HYPOTHESIS", "repeatable"))


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
