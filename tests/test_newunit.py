"""`gpuslice new` and `gpuslice enroll` with every annotation key: what they write is read back
by the same parser `gpuslice check` uses, bad values are refused with the key's own words, and
a unit gpuslice new did not write is never overwritten."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.annotations import KEYS, check_file, load_spec
from gpuslice.cli import main
from gpuslice.core.model import Rung, UnitKind
from gpuslice.envsyntax import extract_first_word
from gpuslice.newunit import exec_quote, option_name, resolve_command, unit_text
from gpuslice.unitfiles import parse_sections

GIB = 1 << 30


def run(tmp_path: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [*args, "--no-reload", "--root", str(tmp_path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def new(tmp_path: Path, *args: str) -> tuple[int, str]:
    """`gpuslice new` with its options before `--` and the command after it."""
    head, sep, tail = list(args), [], []
    if "--" in head:
        i = head.index("--")
        head, sep, tail = head[:i], ["--"], head[i + 1 :]
    result = CliRunner().invoke(
        main, ["new", *head, "--no-reload", "--root", str(tmp_path), *sep, *tail]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def unit_file(tmp_path: Path, name: str) -> Path:
    return tmp_path / "etc/systemd/system" / name


def test_every_annotation_key_is_an_option_of_new_and_enroll() -> None:
    for command in ("new", "enroll"):
        params = {o for p in main.commands[command].params for o in getattr(p, "opts", [])}
        assert {option_name(k) for k in KEYS} <= params, command


def test_new_writes_a_complete_unit_that_the_parser_reads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gpuslice.cli.user_exists", lambda user: user == "asr")  # not the host's
    code, out = new(
        tmp_path,
        "voice",
        "--priority", "10", "--memory", "8G", "--devices", "0", "--user", "asr",
        "--workdir", "/srv/voice 100%",
        "--", "/usr/bin/python3", "serve.py", "--port", "$PORT", 'say "hi"',
    )  # fmt: skip
    assert code == 0, out
    path = unit_file(tmp_path, "voice.service")
    text = path.read_text()
    assert text.startswith("# Written by `gpuslice new`")
    assert 'ExecStart="/usr/bin/python3" "serve.py" "--port" "$$PORT" "say \\"hi\\""\n' in text
    assert "User=asr\nWorkingDirectory=/srv/voice 100%%\n" in text
    assert "KillSignal=SIGTERM\n" in text and "TimeoutStopSec=30\n" in text
    assert "Restart=" not in text  # on-demand: a person decides
    spec, problems = load_spec("voice.service", tmp_path)
    assert problems == []
    assert spec is not None
    assert (spec.priority, spec.memory, spec.devices) == (10, 8 * GIB, ("0",))
    assert check_file(path) == []
    assert f"wrote {path}: voice.service (priority 10)" in out


def test_a_background_job_is_restarted_by_systemd_when_it_fails(tmp_path: Path) -> None:
    code, out = new(tmp_path, "vlm", "--priority", "90", "--type", "background", "--", "true")
    assert code == 0, out
    text = unit_file(tmp_path, "vlm.service").read_text()
    assert "Restart=on-failure\nRestartSec=30\n" in text
    assert "Type=background\n" in text
    assert 'ExecStart="/' in text  # true found in PATH: an absolute path


def test_new_rewrites_its_own_unit_but_no_other(tmp_path: Path) -> None:
    assert new(tmp_path, "job", "--priority", "5", "--", "/bin/true")[0] == 0
    assert new(tmp_path, "job", "--priority", "6", "--", "/bin/true")[0] == 0
    assert "Priority=6\n" in unit_file(tmp_path, "job.service").read_text()
    mine = unit_file(tmp_path, "mine.service")
    mine.write_text("[Service]\nExecStart=/bin/true\n")
    code, out = new(tmp_path, "mine", "--priority", "5", "--", "/bin/true")
    assert code == 1
    assert "was not written by gpuslice new: not overwritten" in out
    assert mine.read_text() == "[Service]\nExecStart=/bin/true\n"
    vendor = tmp_path / "usr/lib/systemd/system/pkg.service"
    vendor.parent.mkdir(parents=True)
    vendor.write_text("[Service]\nExecStart=/bin/true\n")
    assert new(tmp_path, "pkg", "--priority", "5", "--", "/bin/true")[0] == 1
    assert not unit_file(tmp_path, "pkg.service").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--priority", "1000"], "an integer 0-999"),
        (["--priority", "5", "--memory", "lots"], "Memory=lots (allowed: a size such as 512M"),
        (["--priority", "5", "--devices", "MIG-1"], "MIG"),
        (["--priority", "5", "--gpus", "0"], "an integer 1-64"),
        (
            ["--priority", "5", "--type", "urgent"],
            "'urgent' is not one of 'on-demand', 'background'.",
        ),
        (["--priority", "5", "--preempt", "pause"], "Preempt=pause (allowed: stop, freeze and"),
        (["--priority", "5", "--user", "root\nExecStartPre=/bin/evil"], "not a user name"),
        (["--priority", "5", "--workdir", "relative"], "not an absolute path"),
        (["--priority", "5", "--workdir", "/a\nExecStartPre=/bin/evil"], "not an absolute path"),
        (["--priority", "5", "--workdir", "/srv/job\\"], "not an absolute path"),
        # systemd would refuse the unit (not normalized, a name too long), or strip the blank
        (["--priority", "5", "--workdir", "/srv/job/../data"], "not an absolute path"),
        (["--priority", "5", "--workdir", "/srv/" + "d" * 256], "not an absolute path"),
        (["--priority", "5", "--workdir", "/srv/job "], "not an absolute path"),
    ],
)
def test_new_refuses_bad_values_and_writes_nothing(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    code, out = new(tmp_path, "job", *args, "--", "/bin/true")
    assert code == 2, out
    assert expected in out
    assert not unit_file(tmp_path, "job.service").exists()


@pytest.mark.parametrize("name", ["a@b", "x.socket", "../etc/passwd", "a" * 300])
def test_new_refuses_names_that_are_not_plain_services(tmp_path: Path, name: str) -> None:
    code, out = new(tmp_path, name, "--priority", "5", "--", "/bin/true")
    assert code == 2, out
    assert "not a service name" in out


def test_new_needs_a_command_it_can_find(tmp_path: Path) -> None:
    assert new(tmp_path, "job", "--priority", "5")[0] == 2
    code, out = new(tmp_path, "job", "--priority", "5", "--", "no-such-program-here")
    assert code == 2 and "not found in PATH" in out


def test_enroll_memory_and_devices_round_trip_through_check(tmp_path: Path) -> None:
    unit = unit_file(tmp_path, "plain.service")
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/bin/true\n")
    code, out = run(
        tmp_path, "enroll", "plain", "--priority", "20", "--memory", "12GiB", "--devices", "1"
    )
    assert code == 0, out
    dropin = unit.parent / "plain.service.d/gpuslice.conf"
    assert "Memory=12GiB\nDevices=1\n" in dropin.read_text()
    assert check_file(dropin) == []
    spec, _ = load_spec("plain.service", tmp_path)
    assert spec is not None and (spec.memory, spec.devices) == (12 * GIB, ("1",))


def test_enroll_preempt_round_trips_through_check(tmp_path: Path) -> None:
    unit = unit_file(tmp_path, "plain.service")
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/bin/true\n")
    code, out = run(tmp_path, "enroll", "plain", "--priority", "90", "--preempt", "suspend stop")
    assert code == 0, out
    dropin = unit.parent / "plain.service.d/gpuslice.conf"
    assert "Preempt=suspend stop\n" in dropin.read_text()
    assert check_file(dropin) == []
    spec, _ = load_spec("plain.service", tmp_path)
    assert spec is not None and spec.preempt == (Rung.SUSPEND, Rung.STOP)


@pytest.mark.parametrize(
    ("arg", "quoted"),
    [
        ("a b", '"a b"'),
        ("100%", '"100%%"'),
        ("$HOME", '"$$HOME"'),
        ("a\\b", '"a\\\\b"'),
        ("a\r\nb", '"a\\r\\nb"'),
    ],
)
def test_exec_quote(arg: str, quoted: str) -> None:
    assert exec_quote(arg) == quoted


@pytest.mark.parametrize("end", ["\n", "\r", "\r\n"])
def test_no_argument_of_the_command_starts_a_line_of_its_own(tmp_path: Path, end: str) -> None:
    """systemd ends a unit-file line at "\\r" as at "\\n": an argument that held one raw
    would add a setting of its own, here a root ExecStartPre=+ to a job that runs as nobody."""
    evil = f"x{end}ExecStartPre=+/bin/sh -c id{end}"
    code, out = new(tmp_path, "job", "--priority", "5", "--user", "nobody", "--", "/bin/echo", evil)
    assert code == 0, out
    text = unit_file(tmp_path, "job.service").read_bytes().decode()  # no newline translation
    service = [e.key for e in parse_sections(text) if e.section == "Service"]
    assert service.count("ExecStart") == 1 and "ExecStartPre" not in service, service


def test_devices_from_the_instance_name_only_in_a_template(tmp_path: Path) -> None:
    """`--devices %i` makes sense for a template (each instance pinned to the GPU it names):
    `enroll` takes it there, and `new`, which writes a plain unit, refuses it, saying where."""
    code, out = new(tmp_path, "job", "--priority", "5", "--devices", "%i", "--", "/bin/true")
    assert code == 1, out
    assert "job.service:14: [X-GPUSlice] Devices: %i names the GPU by the unit's instance" in out
    assert not unit_file(tmp_path, "job.service").exists()

    template = unit_file(tmp_path, "worker@.service")
    template.parent.mkdir(parents=True, exist_ok=True)
    template.write_text("[Service]\nExecStart=/bin/true\n")
    code, out = run(tmp_path, "enroll", "worker@", "--priority", "30", "--devices", "%i")
    assert code == 0, out
    spec, problems = load_spec("worker@3.service", tmp_path)
    assert problems == [] and spec is not None and spec.devices == ("3",)


def _undoubled(word: str, sign: str) -> str:
    """`word` with each doubled `sign` made one, as systemd does with `%%` (specifiers, at
    load) and `$$` (variables, at exec); a single one is a specifier or variable systemd
    would expand, which exec_quote must never leave."""
    parts = word.split(sign + sign)
    assert all(sign not in part for part in parts), word
    return sign.join(parts)


def _argv_systemd_runs(value: str) -> list[str]:
    """ExecStart='s value as systemd reads it (config_parse_exec: each word unquoted and
    C-unescaped by extract_first_word, an unquoted `;` a separator, then specifiers
    resolved) and then runs it (variables expanded)."""
    argv: list[str] = []
    pos: int | None = 0
    while True:
        word, pos = extract_first_word(value, pos, unquote=True, cunescape=True)
        if word is None:
            return argv
        argv.append(_undoubled(_undoubled(word, "%"), "$"))
        assert pos is None or value[pos] == '"', value  # no bare `;` nor prefix between


# what systemd's syntax gives a meaning to (three times in four), or any character but NUL
_SYNTAX = st.sampled_from(
    " \t\n\r\"'\\$%;{}@-+!:|#=\x01\x1b\x7f\x85\xa0\u200b\u202e\u2028\ufeff\U0001fffe"
)
_WORDS = st.text(
    st.one_of(_SYNTAX, _SYNTAX, _SYNTAX, st.characters(exclude_categories=["Cs"], min_codepoint=1))
)


@settings(max_examples=300)
@given(st.lists(_WORDS, min_size=1, max_size=4), st.lists(_WORDS, min_size=1, max_size=6))
def test_systemd_runs_exactly_the_words_given(path: list[str], args: list[str]) -> None:
    """words -> the unit's ExecStart= -> read back by systemd's rules == the words: no
    quote, escape, `;`, specifier, variable or line end in a word changes what runs (checked
    against systemd 252 itself too, its `systemd --test` dump of such units)."""
    try:
        command = resolve_command(["/" + "/".join(path), *args])
    except click.BadParameter:
        # a program path systemd refuses: refused before anything is written
        command = ["/bin/echo", *path, *args]
    text = unit_text("job.service", command, "", kind=UnitKind.ON_DEMAND)
    starts = [
        e.value for e in parse_sections(text) if (e.section, e.key) == ("Service", "ExecStart")
    ]
    assert len(starts) == 1, text
    assert _argv_systemd_runs(starts[0]) == command
