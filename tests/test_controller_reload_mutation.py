"""config.yaml's reload, its read at start and the runtime_dir of this boot, step by step.

Mutation testing showed that no test held these promises of gpuslice/controller.py
(Reloads._reload_now, Controller.reload_config, load_settled, _runtime_dir_of_this_boot):

- a reload or a start reads config.yaml only once the file has been left alone for
  CONFIG_SETTLE s, waits for that at most CONFIG_SETTLE_WAITS times, and reads it again (after
  CONFIG_SETTLE s) when it changed while it was read: how many looks and reads, in which
  order, is what an admin's `cp new.yaml config.yaml` meets;
- what the admin reads in the journal about it, word for word and at its level: the wait (said
  once per reload, at INFO), the file read as it is after so many waits (WARNING), the reload
  done (INFO), the last good configuration kept (ERROR);
- a SIGHUP while a changed file waits to be read again is that read, not a second reload;
- reload_config's answer (False: the file changed while read, nothing applied);
- the runtime_dir of this boot: GPUSLICE_RUNTIME_DIR (the generator's word) over the record
  over config.yaml; an invalid value in the environment said and ignored; the one chosen
  recorded; a record that cannot be written said.

config.yaml's clock and version are scripted (`Script`): which look finds it unsettled, which
read finds it changed; nothing waits on a real file's age.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuslice import config as config_module
from gpuslice import controller as controller_module
from gpuslice import reloads as reloads_module
from gpuslice.config import Config, ConfigError, load_config_with_warnings, pin_runtime_dir
from gpuslice.controller import Controller
from gpuslice.paths import RUNTIME_DIR_ENV
from tests.test_controller import Bed, run, settle, until
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller_run import kept_logging

SETTLE = 0.02  # CONFIG_SETTLE in these tests: "%g" shows it as 0.02
WAITS = 3  # CONFIG_SETTLE_WAITS: the warning says 3 * 0.02 = 0.06 s
RELOAD_FUNCTIONS = ("_reload_now", "reload_config")


class Script:
    """config.yaml as the controller sees it. Each look (`unsettled`) finds the file changed
    `waits[0]` s ago (popped; `then` once the list is empty); each read
    (`load_config_with_warnings`, the real one) finds the file changed while it was read when
    `changes[0]` (popped; `changes_then` once empty), which bumps its stamp; `on_read(n)` runs
    after the n-th read. `events` is what the controller did, in order."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        path: Path,
        waits: list[float] | None = None,
        then: float = 0.0,
        changes: list[bool] | None = None,
        changes_then: bool = False,
    ) -> None:
        self.path = path
        self.waits = waits or []
        self.then = then
        self.changes = changes or []
        self.changes_then = changes_then
        self.on_read: Callable[[int], None] | None = None
        self.version = 0
        self.reads = 0
        self.events: list[str] = []
        monkeypatch.setattr(reloads_module, "CONFIG_SETTLE", SETTLE)
        monkeypatch.setattr(reloads_module, "CONFIG_SETTLE_WAITS", WAITS)
        monkeypatch.setattr(config_module, "unsettled", self.unsettled)  # Settling's look
        monkeypatch.setattr(config_module, "stamp", self.stamp)  # read_unchanged's
        monkeypatch.setattr(controller_module, "load_config_with_warnings", self.load)
        monkeypatch.setattr(reloads_module, "load_config_with_warnings", self.load)

    def unsettled(self, path: Path, now: float, settle: float) -> float:
        assert path == self.path
        assert abs(now - time.time()) < 5, f"now={now!r} is not the time"
        assert settle == SETTLE, f"settle={settle!r} is not CONFIG_SETTLE"
        wait = self.waits.pop(0) if self.waits else self.then
        self.events.append(f"look {wait:g}")
        return wait

    def stamp(self, path: Path) -> tuple[int]:
        assert path == self.path
        return (self.version,)

    def load(self, path: Path) -> tuple[Config, list[str]]:
        assert path == self.path
        self.reads += 1
        self.events.append("read")
        try:
            return load_config_with_warnings(path)
        finally:
            if self.changes.pop(0) if self.changes else self.changes_then:
                self.version += 1
            if self.on_read is not None:
                self.on_read(self.reads)


def said(
    caplog: pytest.LogCaptureFixture, functions: tuple[str, ...] = RELOAD_FUNCTIONS
) -> list[str]:
    """`LEVEL message` of each line the named functions logged, in order."""
    return [f"{r.levelname} {r.getMessage()}" for r in caplog.records if _named(r) in functions]


def _named(record: logging.LogRecord) -> str:
    """The function that logged, also under mutmut, whose copies of a method run as
    `xǁClassǁname__mutmut_orig` (or `_N`), of a module function as `x_name__mutmut_orig`."""
    name = record.funcName.split("__mutmut")[0]
    if "ǁ" in name:
        return name.split("ǁ")[-1]
    return name.removeprefix("x_") if name != record.funcName else name


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog at DEBUG for gpuslice; the root logger's level (a reload sets it) as it was."""
    with kept_logging(), caplog.at_level(logging.DEBUG, logger="gpuslice"):
        yield caplog


def a_bed(tmp_path: Path, text: str = "gpus: 2\n") -> tuple[Bed, Path]:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return Bed(tmp_path, {"a.service": "Priority=50\n"}, []), path


def reloads(caplog: pytest.LogCaptureFixture, path: Path) -> int:
    return said(caplog).count(f"INFO configuration reloaded from {path}")


def waiting(path: Path) -> str:
    return (
        f"INFO {path} changed less than 0.02 s ago: reloading it once it has been left alone "
        "that long (a file written in place may be cut short)"
    )


def kept_changing(path: Path) -> str:
    return f"WARNING {path} kept changing for 0.06 s: reloading it as it is now"


# ---- Reloads._reload_now ---------------------------------------------------------------------


def test_a_reload_looks_until_the_file_is_left_alone_says_so_once_and_does_so_each_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    """Twice found changed, then left alone: two waits, said once, then one read, applied.
    The next reload starts its count anew: its wait is said again."""
    bed, path = a_bed(tmp_path)
    script = Script(monkeypatch, path, waits=[0.01, 0.01])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.reloads.request()
        await until(lambda: reloads(logs, path) == 1)
        assert script.events == ["look 0.01", "look 0.01", "look 0", "read"]
        assert ctl.scheduler.gpus == {0, 1}
        assert said(logs) == [waiting(path), f"INFO configuration reloaded from {path}"]

        script.waits = [0.01]
        path.write_text("gpus: 3\n")
        ctl.reloads.request()
        await until(lambda: reloads(logs, path) == 2)
        assert script.events[4:] == ["look 0.01", "look 0", "read"]
        assert ctl.scheduler.gpus == {0, 1, 2}
        assert said(logs) == [waiting(path), f"INFO configuration reloaded from {path}"] * 2

    run(test)


def test_a_file_never_left_alone_is_read_as_it_is_after_so_many_waits_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    """CONFIG_SETTLE_WAITS waits, then the file is read as it is (even though it changed while
    read: there is no end to wait for), and the warning says for how long it kept changing."""
    bed, path = a_bed(tmp_path)
    script = Script(monkeypatch, path, then=0.01, changes_then=True)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.reloads.request()
        await until(lambda: script.reads > 0)
        await until(lambda: reloads(logs, path) == 1)
        assert script.events == ["look 0.01"] * (WAITS + 1) + ["read"]
        assert ctl.scheduler.gpus == {0, 1}
        assert said(logs) == [
            waiting(path),
            kept_changing(path),
            f"INFO configuration reloaded from {path}",
        ]

    run(test)


def test_a_file_changed_while_read_is_read_again_after_the_settle_up_to_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    """Each read that the file changed under counts as a wait: after CONFIG_SETTLE_WAITS of
    them the file is read as it is, with the warning; nothing read meanwhile is applied."""
    bed, path = a_bed(tmp_path)
    script = Script(monkeypatch, path, changes_then=True)
    applied: list[int] = []

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        script.on_read = lambda n: applied.append(ctl.config.gpus)
        ctl.reloads.request()
        await until(lambda: reloads(logs, path) == 1)
        assert script.events == ["look 0", "read"] * (WAITS + 1)
        assert applied == [1] * (WAITS + 1)  # none of the reads before the last applied
        assert ctl.scheduler.gpus == {0, 1}
        assert said(logs) == [kept_changing(path), f"INFO configuration reloaded from {path}"]

    run(test)


def test_a_sighup_while_a_changed_file_waits_to_be_read_again_is_that_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    """The file changed while it was read; signals before it is read again are that read
    (one more read, one reload), not a second reload beside it."""
    bed, path = a_bed(tmp_path)
    script = Script(monkeypatch, path, changes=[True])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()

        def sighups() -> None:
            for _ in range(3):
                ctl.reloads.request()

        def signals(n: int) -> None:
            if n == 1:  # run right after this read's _reload_now, before its timer
                asyncio.get_running_loop().call_soon(sighups)

        script.on_read = signals
        ctl.reloads.request()
        await until(lambda: reloads(logs, path) == 1)
        await asyncio.sleep(3 * SETTLE)  # a second reload's timer would have fired
        await settle()
        assert script.events == ["look 0", "read", "look 0", "read"]
        assert said(logs) == [f"INFO configuration reloaded from {path}"]

    run(test)


# ---- Controller.reload_config ----------------------------------------------------------------


def test_reload_config_applies_nothing_and_answers_false_when_the_file_changed_while_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    """With `recheck`: a read the file changed under, good or bad, is neither applied nor
    said (the caller reads it again); one it did not change under is applied, or, bad, said
    with the last good configuration kept; both answer True. Without `recheck` what was read
    is applied."""
    bed, path = a_bed(tmp_path)
    script = Script(monkeypatch, path)
    bad = "gpus: 0\n"
    path.write_text(bad)
    with pytest.raises(ConfigError) as error:
        load_config_with_warnings(path)
    path.write_text("gpus: 2\n")

    async def test() -> None:
        ctl: Controller = bed.controller
        await ctl.start()
        script.changes = [True]
        assert ctl.reload_config(recheck=True) is False
        assert ctl.config.gpus == 1 and said(logs) == []

        assert ctl.reload_config(recheck=True) is True
        assert ctl.config.gpus == 2
        assert said(logs) == [f"INFO configuration reloaded from {path}"]
        logs.clear()

        path.write_text(bad)
        script.changes = [True]
        assert ctl.reload_config(recheck=True) is False
        assert said(logs) == []
        assert ctl.reload_config(recheck=True) is True
        assert said(logs) == [f"ERROR keeping the last good configuration: {error.value}"]
        assert ctl.config.gpus == 2
        logs.clear()

        path.write_text("gpus: 3\n")
        script.changes = [True]
        assert ctl.reload_config(recheck=False) is True
        assert ctl.config.gpus == 3
        assert said(logs) == [f"INFO configuration reloaded from {path}"]
        assert script.events == ["read"] * 5

    run(test)


# ---- load_settled (the read at start) --------------------------------------------------------


def load_settled(path: Path) -> tuple[Config, list[str]]:
    return asyncio.run(reloads_module.load_settled(path))


def test_the_start_reads_the_file_once_it_is_left_alone_and_once_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("gpus: 2\n")
    script = Script(monkeypatch, path, waits=[0.01, 0.01])
    config, warnings = load_settled(path)
    assert (config.gpus, warnings) == (2, [])
    assert script.events == ["look 0.01", "look 0.01", "look 0", "read"]

    script.events.clear()
    assert load_settled(path)[0].gpus == 2
    assert script.events == ["look 0", "read"]


def test_the_start_reads_a_file_never_left_alone_as_it_is_after_so_many_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("gpus: 2\n")
    script = Script(monkeypatch, path, then=0.01, changes_then=True)
    assert load_settled(path)[0].gpus == 2
    assert script.events == ["look 0.01"] * (WAITS + 1) + ["read"]


def test_the_start_reads_again_a_file_changed_while_read_and_takes_the_last_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("gpus: 2\n")
    script = Script(monkeypatch, path, changes_then=True)
    assert load_settled(path)[0].gpus == 2
    assert script.events == ["look 0", "read"] * (WAITS + 1)


def test_a_bad_file_at_start_fails_it_unless_the_file_changed_while_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad file left alone is the start's error at once (exit 78); one that changed while
    it was read (a writer half-way) is read again, and its next version counts; one that
    keeps changing fails at the last read."""
    path = tmp_path / "config.yaml"
    path.write_text("gpus: 0\n")
    with pytest.raises(ConfigError) as expected:
        load_config_with_warnings(path)
    script = Script(monkeypatch, path)
    with pytest.raises(ConfigError) as error:
        load_settled(path)
    assert str(error.value) == str(expected.value)
    assert script.events == ["look 0", "read"]

    script.events.clear()
    script.changes = [True]

    def rewritten(n: int) -> None:
        path.write_text("gpus: 2\n")

    script.on_read = rewritten
    assert load_settled(path)[0].gpus == 2
    assert script.events == ["look 0", "read", "look 0", "read"]

    path.write_text("gpus: 0\n")
    script.events.clear()
    script.on_read = None
    script.changes_then = True
    with pytest.raises(ConfigError) as error:
        load_settled(path)
    assert str(error.value) == str(expected.value)
    assert script.events == ["look 0", "read"] * (WAITS + 1)


# ---- _runtime_dir_of_this_boot ---------------------------------------------------------------


class Boot:
    """The record of this boot under tmp_path, config.yaml naming runtime_dir on its line 2."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.record = tmp_path / "gpuslice" / "runtime-dir"
        self.record.parent.mkdir()
        self.config_path = tmp_path / "config.yaml"
        self.monkeypatch = monkeypatch
        monkeypatch.setattr(controller_module, "RUNTIME_RECORD", self.record)
        monkeypatch.delenv(RUNTIME_DIR_ENV, raising=False)

    def pick(self, configured: str, env: str | None = None) -> str:
        self.config_path.write_text(f"gpus: 2\nruntime_dir: {configured}\n")
        if env is not None:
            self.monkeypatch.setenv(RUNTIME_DIR_ENV, env)
        config = Config(gpus=2, runtime_dir=configured, log_level="debug")
        picked = controller_module._runtime_dir_of_this_boot(config, self.config_path)
        # recorded as Controller.start records it, once the bus name is ours
        controller_module._record_runtime_dir(self.record, picked.runtime_dir, self.config_path)
        assert (picked.gpus, picked.log_level) == (2, "debug")  # the rest as it was
        return picked.runtime_dir

    def not_yet(self, configured: str, kept: str) -> str:
        return (
            f"WARNING {self.config_path}:2: runtime_dir: {configured} takes effect at the "
            f"next boot: the gates' drop-ins name {kept}, where gpuslice writes until then"
        )


BOOT_FUNCTIONS = ("_runtime_dir_of_this_boot", "_runtime_dir_not_yet", "_record_runtime_dir")


def test_the_generators_word_goes_before_the_record_and_config_yaml_and_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    """GPUSLICE_RUNTIME_DIR names what the gates' drop-ins name (the generator wrote both):
    it wins over an older record (a record written before a reboot that /run survived is not
    expected, but the generator knows best) and over config.yaml, whose different value is
    said to take effect at the next boot."""
    boot = Boot(tmp_path, monkeypatch)
    boot.record.write_text("/run/gpuslice/rec\n")
    assert boot.pick("/run/gpuslice/cfg", env="/run/gpuslice/told/") == "/run/gpuslice/told"
    assert boot.record.read_text() == "/run/gpuslice/told\n"
    assert said(logs, BOOT_FUNCTIONS) == [boot.not_yet("/run/gpuslice/cfg", "/run/gpuslice/told")]
    logs.clear()

    assert boot.pick("/run/gpuslice/told", env="/run/gpuslice/told") == "/run/gpuslice/told"
    assert said(logs, BOOT_FUNCTIONS) == []  # config.yaml says the same: nothing to say


def test_without_the_generators_word_the_record_goes_before_config_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    boot = Boot(tmp_path, monkeypatch)
    assert boot.pick("/run/gpuslice/a") == "/run/gpuslice/a"  # no record: config.yaml's
    assert boot.record.read_text() == "/run/gpuslice/a\n"
    assert said(logs, BOOT_FUNCTIONS) == []

    assert boot.pick("/run/gpuslice/b") == "/run/gpuslice/a"
    assert boot.record.read_text() == "/run/gpuslice/a\n"
    assert said(logs, BOOT_FUNCTIONS) == [boot.not_yet("/run/gpuslice/b", "/run/gpuslice/a")]


def test_an_invalid_runtime_dir_in_the_environment_is_said_escaped_and_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    boot = Boot(tmp_path, monkeypatch)
    boot.record.write_text("/run/gpuslice/rec\n")
    assert boot.pick("/run/gpuslice/rec", env="/etc\x1b[2J") == "/run/gpuslice/rec"
    assert said(logs, BOOT_FUNCTIONS) == [
        "ERROR GPUSLICE_RUNTIME_DIR=/etc\\x1b[2J is not a valid runtime_dir: ignored"
    ]


def test_a_record_that_cannot_be_written_is_said_and_the_runtime_dir_still_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    """The record is a directory (a file cannot replace it): the controller runs with the
    runtime_dir it chose, and says that the generator may point the gates elsewhere."""
    boot = Boot(tmp_path, monkeypatch)
    boot.record.mkdir()
    with pytest.raises(OSError) as error:
        pin_runtime_dir(boot.record, "/run/gpuslice/a")
    assert boot.pick("/run/gpuslice/a") == "/run/gpuslice/a"

    def numbered(text: str) -> str:  # each write takes a temporary name of its own
        return re.sub(r"(\.runtime-dir\.tmp-[0-9]+-)[0-9]+", r"\1N", text)

    assert [numbered(line) for line in said(logs, BOOT_FUNCTIONS)] == [
        numbered(
            f"ERROR cannot record the runtime_dir in {boot.record} ({error.value}): a "
            f"daemon-reload after runtime_dir is changed in {boot.config_path} points the "
            "gates elsewhere"
        )
    ]
