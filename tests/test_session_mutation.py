"""What mutation testing of this session's changes showed no test held.

- `gpuslice new`'s choice options (`EscapedChoice`): a value is quoted cut at 100 characters
  in click's error, and the choice is click.Choice in every other way: the context's token
  normalization, and the error naming its option and context;
- `Controller.reload_config` without `recheck` (every caller but the settling reload) applies
  what it read, even when the file changed meanwhile;
- a suspended unit stopped because NVML no longer lists its GPU (`Scheduler._stop_suspended`):
  a GPU of its that had no UUID when it was suspended is not named, and no crash of the core.
"""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from gpuslice.controller import Controller
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Outcome, Phase
from gpuslice.newunit import EscapedChoice
from tests.core_builders import GIB, brief, sized, spec, words
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import run
from tests.test_controller_reload_mutation import Script, a_bed, said
from tests.test_controller_reload_mutation import logs as logs  # fixture
from tests.test_core_ladder import host, running
from tests.test_newunit_leftovers import files, new

KINDS = ["on-demand", "background"]

# ---- gpuslice new --type: EscapedChoice ---------------------------------------------------------


def test_a_long_type_is_quoted_cut_at_100_characters(tmp_path: Path) -> None:
    """A value of any length reached the admin's terminal whole in click's error."""
    result = new(tmp_path, "job", "--priority", "5", "--type", "x" * 150)
    assert result.exit_code == 2, result.output
    assert (
        f"Invalid value for '--type': '{'x' * 100}...' is not one of 'on-demand', 'background'."
    ) in result.output
    assert "x" * 101 not in result.output
    assert files(tmp_path) == []


def test_a_type_of_100_characters_is_quoted_whole(tmp_path: Path) -> None:
    result = new(tmp_path, "job", "--priority", "5", "--type", "y" * 100)
    assert result.exit_code == 2, result.output
    assert f"'{'y' * 100}' is not one of" in result.output


def test_escaped_choice_is_click_s_choice_for_its_context_and_its_option() -> None:
    """The context's token_normalize_func applies, as for click.Choice; a refusal names the
    option and the context it came with (click's usage line, its `Invalid value for`)."""
    option = click.Option(["--type"], type=EscapedChoice(KINDS))
    ctx = click.Context(click.Command("new", params=[option]), token_normalize_func=str.lower)
    choice = EscapedChoice(KINDS)
    assert choice.convert("ON-DEMAND", option, ctx) == "on-demand"
    assert choice.convert("background", option, ctx) == "background"
    with pytest.raises(click.BadParameter) as caught:
        choice.convert("urgent\x1b", option, ctx)
    assert caught.value.param is option and caught.value.ctx is ctx
    assert caught.value.format_message() == (
        "Invalid value for '--type': 'urgent\\\\x1b' is not one of 'on-demand', 'background'."
    )


# ---- Controller.reload_config -------------------------------------------------------------------


def test_reload_config_by_default_applies_what_it_read_even_if_the_file_changed_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    """Only the settling reload (`_reload_now`) asks for `recheck`; a plain call reads once."""
    bed, path = a_bed(tmp_path)
    script = Script(monkeypatch, path)

    async def test() -> None:
        ctl: Controller = bed.controller
        await ctl.start()
        path.write_text("gpus: 3\n")
        script.changes = [True]
        logs.clear()
        assert ctl.reload_config() is True
        assert ctl.config.gpus == 3
        assert script.reads == 1
        assert said(logs) == [f"INFO configuration reloaded from {path}"]

    run(test)


# ---- Scheduler._stop_suspended ------------------------------------------------------------------


def test_a_suspended_unit_s_gpu_without_a_uuid_is_not_named_when_it_is_stopped() -> None:
    """two.service was suspended from GPUs 0 (GPU-0) and 1 (no UUID then). NVML no longer
    lists GPU-0: it is stopped, the line naming GPU 0 alone."""
    two = spec("two", 20, gpus=2, preempt="suspend stop")
    one = spec("one", 10)
    s = host(two, one, gpus=[sized(0), Gpu(1, "", "Fake", 24 * GIB)])
    running(s, two)
    assert brief(s.request(one)) == ["suspend two.service 0,1"]
    s.suspended_done(two.name, "")
    assert s.suspended[two.name].uuids == {0: "GPU-0"}
    with s.deferred():
        s.inactive(one.name, Outcome.EXITED)
        s.set_gpus([Gpu(0, "GPU-9", "Fake", 24 * GIB), Gpu(1, "", "Fake", 24 * GIB)])
    acts = s.schedule()
    assert brief(acts) == ["stop two.service"]
    assert s.phase(two.name) is Phase.STOPPING
    assert words(acts) == [
        "two.service (priority 20) could not be resumed on GPUs 0,1: its GPU 0 was GPU-0, "
        "which NVML no longer lists: its memory cannot be restored on another GPU; stopping it "
        "(Requeue= decides whether it starts again)"
    ]
