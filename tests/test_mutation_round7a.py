"""Mutants of this session's changes that the suite let live (mutmut, late 2026-12-06): a
bracket after a wildcard that may match nothing, an instance's name after a bracket with no
end, a dropped Environment= word before one that is refused, and a comeback saved across a
controller restart that is no refill."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice import controller as controller_module
from gpuslice.config import Config
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Outcome, Scheduler
from gpuslice.envsafety import _may_be_up
from gpuslice.paths import RUNTIME_DIR_ENV
from tests.core_builders import BG, brief, spec
from tests.test_envsafety import errors, install
from tests.test_envsafety import reaches_up as reaches_up  # a fixture
from tests.test_envsafety import root as root  # a fixture


def test_a_bracket_after_a_wildcard_that_may_match_nothing_may_be_the_second_dot(
    reaches_up: Callable[[str], bool],
) -> None:
    """`.*[.]`: `*` matches nothing, the bracket the second dot: `..` to glibc's glob(3)."""
    for part in (".*[.]", ".*[!a]", ".\\*[.]"):
        assert _may_be_up(part) == reaches_up(part), part


def test_an_instance_name_after_a_bracket_with_no_end_may_be_dot_dot() -> None:
    """Where the instance's name (a NUL) follows a `[` with no `]` yet, the name says where
    the bracket ends: `..` maybe."""
    assert _may_be_up(".[\0")
    assert _may_be_up(".[a\0x")


def test_a_dropped_word_does_not_end_the_line_before_a_word_that_is_refused(root: Path) -> None:
    """`LD_%i` is dropped (no `=`, whatever the instance); the word after it on the same
    line is still judged: `LD_%I` may make an assignment, refused."""
    install(root, "a@.service", "Environment=LD_%i LD_%I")
    [error] = errors(root, "a@.service")
    assert "Environment: LD_%I cannot be checked: its name is not worked out" in error


def test_a_comeback_saved_across_a_restart_is_still_owed_when_its_start_fails() -> None:
    """`refills` is the saved refills among the saved starts, not every saved start: a
    preempted on-demand unit's comeback, under way at a restart, whose start then does not
    reach systemd is preempted again, owed its comeback."""
    voice = spec("voice", 50)
    urgent = spec("urgent", 10)
    s = Scheduler([Gpu(0)], {})
    assert brief(s.request(voice)) == ["grant voice.service 0"]
    assert brief(s.request(urgent)) == ["stop voice.service"]
    s.inactive(voice.name, Outcome.STOPPED)
    assert brief(s.inactive(urgent.name, Outcome.EXITED)) == ["start voice.service"]
    saved = s.save()
    assert (saved.started, saved.refills) == ([voice.name], [])
    fresh = Scheduler([Gpu(0)], {voice.name: voice})
    fresh.load(saved)
    fresh.start_failed(voice.name, "systemd is re-executing")
    assert list(fresh.preempted) == [voice.name]


def test_a_controller_told_no_runtime_dir_says_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Started by hand (no generator told it a runtime_dir), the controller takes config.yaml's
    and says nothing wrong; only a value told that is no runtime_dir is an error. (The
    equivalent-mutant list excused a mutant that logged an error for the unset variable.)"""
    monkeypatch.delenv(RUNTIME_DIR_ENV, raising=False)
    monkeypatch.setattr(controller_module, "RUNTIME_RECORD", tmp_path / "runtime-dir")
    config = Config(runtime_dir=str(tmp_path / "run"))
    with caplog.at_level(logging.DEBUG):
        picked = controller_module._runtime_dir_of_this_boot(config, tmp_path / "config.yaml")
    assert picked.runtime_dir == config.runtime_dir
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    monkeypatch.setenv(RUNTIME_DIR_ENV, "relative/dir")
    with caplog.at_level(logging.DEBUG):
        controller_module._runtime_dir_of_this_boot(config, tmp_path / "config.yaml")
    assert "is not a valid runtime_dir: ignored" in caplog.text


def test_a_start_of_ours_found_running_with_no_gpus_told_keeps_those_kept_for_it() -> None:
    """A refill placed on GPU 1 (GPU 0 busy) is found running past its gate with no GPUs
    told (its grant's word lost): it runs where its GPUs were kept, not where a placement
    made now would put it (GPU 0, freed meanwhile), nor renumbered in the queue."""
    busy = spec("busy", 10)
    bg = spec("bg", 90, BG)
    s = Scheduler([Gpu(0), Gpu(1)], {bg.name: bg})
    assert brief(s.request(busy)) == ["grant busy.service 0", "start bg.service"]
    assert s.grants()[bg.name] == frozenset({1})
    s.inactive(busy.name, Outcome.EXITED)
    seq = s.holders[bg.name].seq
    assert brief(s.running(bg.name)) == []
    assert (s.grants()[bg.name], s.holders[bg.name].seq) == (frozenset({1}), seq)
