"""What `gpuslice new` promises an admin, pinned where mutation testing found no test holding
it: the unit text written, line for line; the `[X-GPUSlice]` section each option writes
(`--no-requeue` among them); the help that names each key and its default; the exact words of
each refusal of a name, a value or a WorkingDirectory=; and the bounds of the paths it takes,
which are systemd's own (a path systemd refuses makes it refuse the whole unit, which `gpuslice
new` would have reported written)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gpuslice.annotations import load_spec
from gpuslice.cli import main
from gpuslice.core.model import Rung
from gpuslice.newunit import printable_path

SYSTEM = "etc/systemd/system"


def new(root: Path, name: str, *args: str, command: tuple[str, ...] = ("/bin/true",)) -> Result:
    result = CliRunner().invoke(
        main, ["new", name, *args, "--no-reload", "--root", str(root), "--", *command]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return result


def refusal(result: Result) -> str:
    """The error line of a usage error (exit status 2)."""
    assert result.exit_code == 2, result.output
    return result.output.splitlines()[-1]


def written(root: Path, name: str = "job.service") -> str:
    return (root / SYSTEM / name).read_text()


# ---------------------------------------------------------------------------------------------
# the unit text


def test_new_writes_exactly_this_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every line is what systemd runs: Type=exec (a missing program fails the start, not
    later), KillMode=mixed (SIGTERM to the main process, SIGKILL to all at the timeout), the
    Description an admin sees in `systemctl status`, then the annotation in the key table's
    order."""
    monkeypatch.setattr("gpuslice.cli.user_exists", lambda user: user == "asr")  # not the host's
    result = new(
        tmp_path,
        "vlm",
        "--priority", "90", "--type", "background", "--gpus", "2", "--no-requeue",
        "--memory", "8G", "--preempt", "suspend stop", "--user", "asr", "--workdir", "/srv/vlm",
        command=("/bin/echo", "a b"),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert written(tmp_path, "vlm.service") == (
        "# Written by `gpuslice new`; gpuslice new refuses to overwrite a unit it did not write.\n"
        "[Unit]\n"
        "Description=vlm (GPU job, gpuslice new)\n"
        "\n"
        "[Service]\n"
        "Type=exec\n"
        'ExecStart="/bin/echo" "a b"\n'
        "KillMode=mixed\n"
        "KillSignal=SIGTERM\n"
        "TimeoutStopSec=30\n"
        "Restart=on-failure\n"
        "RestartSec=30\n"
        "User=asr\n"
        "WorkingDirectory=/srv/vlm\n"
        "\n"
        "[X-GPUSlice]\n"
        "Priority=90\n"
        "Type=background\n"
        "GPUs=2\n"
        "Requeue=no\n"
        "Memory=8G\n"
        "Preempt=suspend stop\n"
    )


@pytest.mark.parametrize(
    ("flag", "line", "requeue"),
    [("--no-requeue", "Requeue=no", False), ("--requeue", "Requeue=yes", True)],
)
def test_requeue_and_no_requeue_write_the_boolean_the_parser_reads(
    tmp_path: Path, flag: str, line: str, requeue: bool
) -> None:
    result = new(tmp_path, "job", "--priority", "5", flag)
    assert result.exit_code == 0, result.output
    assert written(tmp_path).endswith(f"[X-GPUSlice]\nPriority=5\n{line}\n")
    spec, problems = load_spec("job.service", tmp_path)
    assert problems == [] and spec is not None and spec.requeue is requeue


def test_a_tab_in_a_value_is_taken_as_a_separator_and_written_as_given(tmp_path: Path) -> None:
    """The parser separates Devices= and Preempt= at tabs as at blanks: a tab is no control
    character to refuse."""
    result = new(tmp_path, "job", "--priority", "5", "--preempt", "suspend\tstop")
    assert result.exit_code == 0, result.output
    assert "Preempt=suspend\tstop\n" in written(tmp_path)
    spec, _ = load_spec("job.service", tmp_path)
    assert spec is not None and spec.preempt == (Rung.SUSPEND, Rung.STOP)


def test_priority_is_required(tmp_path: Path) -> None:
    """A unit without Priority= is no GPU job the controller schedules."""
    assert refusal(new(tmp_path, "job")) == "Error: Missing option '--priority'."
    assert not (tmp_path / SYSTEM / "job.service").exists()


def test_help_names_each_key_what_it_allows_and_its_default() -> None:
    result = CliRunner().invoke(main, ["new", "--help"], terminal_width=400, max_content_width=400)
    assert result.exit_code == 0, result.output
    lines = [" ".join(line.split()) for line in result.output.splitlines()]
    for expected in (
        "--priority TEXT Priority=: an integer 0-999 [required]",
        "--type [on-demand|background] Type=: one of on-demand, background (default: on-demand)",
        "--gpus TEXT GPUs=: an integer 1-64 (default: 1)",
        "--requeue / --no-requeue Restart the unit when capacity returns after it was "
        "preempted (default: yes).",
        "--memory TEXT Memory=: a size such as 512M, 20G or 20GiB (binary units, at most 1P)",
        "--devices TEXT Devices=: up to 64 GPU indices or UUIDs separated by commas or spaces "
        "(e.g. 0,1 or GPU-8f6c...), or %i in a template (each instance names its GPU)",
        "--preempt TEXT Preempt=: stop, freeze and suspend, in the order to try them, each once "
        "(e.g. suspend stop) (default: stop)",
    ):
        assert expected in lines, result.output


# ---------------------------------------------------------------------------------------------
# the words of each refusal


def test_a_value_with_a_control_character_is_refused_saying_so(tmp_path: Path) -> None:
    assert refusal(new(tmp_path, "job", "--priority", "5", "--memory", "\n8G")) == (
        "Error: Invalid value for '--memory': Memory=\\x0a8G: a line end or control character "
        "(allowed: a size such as 512M, 20G or 20GiB (binary units, at most 1P))"
    )


def test_a_long_bad_value_is_shown_cut_at_300_characters(tmp_path: Path) -> None:
    shown = ("Memory=" + "x" * 400)[:300]
    assert refusal(new(tmp_path, "job", "--priority", "5", "--memory", "x" * 400)) == (
        f"Error: Invalid value for '--memory': {shown}... "
        "(allowed: a size such as 512M, 20G or 20GiB (binary units, at most 1P))"
    )


def test_a_name_too_long_for_systemd_is_refused_saying_how_long(tmp_path: Path) -> None:
    assert refusal(new(tmp_path, "a" * 300, "--priority", "5")) == (
        f"Error: Invalid value for NAME: '{'a' * 60}...': not a service name: 308 characters, "
        "systemd takes at most 255"
    )


def test_a_name_systemd_would_refuse_is_refused_saying_what_a_name_holds(tmp_path: Path) -> None:
    assert refusal(new(tmp_path, "x" * 150 + "!", "--priority", "5")) == (
        f"Error: Invalid value for NAME: '{'x' * 100}...': not a service name "
        "(letters, digits and :-_.\\, no @)"
    )


def test_a_name_that_starts_with_a_dash_is_refused_saying_why(tmp_path: Path) -> None:
    """The name comes after `--`: `gpuslice new --priority 5 -- -H... /bin/true`."""
    result = CliRunner().invoke(
        main, ["new", "--priority", "5", "--root", str(tmp_path), "--", "-" + "x" * 120, "true"]
    )
    assert refusal(result) == (
        f"Error: Invalid value for NAME: '-{'x' * 99}...': a name that starts with '-' is an "
        "option to systemctl"
    )
    assert not (tmp_path / "etc").exists()


# ---------------------------------------------------------------------------------------------
# WorkingDirectory=: what systemd takes, and nothing else


def _long_path(length: int) -> str:
    """An absolute path of `length` characters, each name at most 200."""
    path = "/" + "/".join(["d" * 200] * 20)
    return path + "/" + "e" * (length - len(path) - 1)


@pytest.mark.parametrize(
    "workdir",
    [
        "/",  # the shortest absolute path
        "/srv/JOBX",  # an X at the end is no blank nor backslash
        "/srv/" + "d" * 255,  # a name of NAME_MAX characters
        _long_path(4095),  # PATH_MAX less the NUL
    ],
)
def test_new_takes_every_workdir_systemd_takes(tmp_path: Path, workdir: str) -> None:
    """systemd 252 (`systemd-analyze verify`) takes each of these."""
    result = new(tmp_path, "job", "--priority", "5", "--workdir", workdir)
    assert result.exit_code == 0, result.output
    assert f"\nWorkingDirectory={workdir}\n" in written(tmp_path)


@pytest.mark.parametrize(
    "workdir",
    [
        # systemd: "Failed to resolve unit specifiers in working directory path": PATH_MAX
        # (4096) counts the NUL; it refused the whole unit, which new had reported written
        _long_path(4096),
        _long_path(4097),
        "/srv/a\x7fb",  # DEL: systemd takes it, but `systemctl cat` would send it to a terminal
    ],
)
def test_new_refuses_a_workdir_systemd_refuses_or_that_is_not_printable(
    tmp_path: Path, workdir: str
) -> None:
    error = refusal(new(tmp_path, "job", "--priority", "5", "--workdir", workdir))
    assert error.startswith("Error: Invalid value for --workdir: '")
    assert error.endswith(
        "': not an absolute path (printable ASCII, no backslash or blank at the end, no '..', "
        "names of at most 255 characters)"
    )
    assert not (tmp_path / SYSTEM / "job.service").exists()


def test_an_empty_path_is_not_a_printable_path() -> None:
    """A predicate: False, not an IndexError, whatever the caller checked before."""
    assert printable_path("") is False
