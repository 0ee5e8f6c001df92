"""Mutation-driven tests of how journalctl's answers are judged (stopjournal.read_answer,
read_boot) and of StateStore.saved_since: hostile bytes are no answer, never a crash, the
entry shown in a line is cut at its length, and a stand-in saved since counts as a save."""

from __future__ import annotations

import json
from pathlib import Path

from gpuslice.core.scheduler import SavedState
from gpuslice.state import StateStore
from gpuslice.stopjournal import STARTING, Answer, read_answer, read_boot

INVOCATION = "0123456789abcdef0123456789abcdef"
STATE = SavedState(holders={"asr.service": ((0,), "running", 4, "")}, preempted={}, held=[])


def test_answer_not_utf8_is_no_answer_not_a_crash() -> None:
    """journalctl's bytes are not ours to trust: invalid UTF-8 is read with replacement,
    and the entry, not one asked for, is a failure to ask."""
    out = b'{"MESSAGE_ID": "\xff\xfe", "UNIT": "a.service"}'
    answer = read_answer("a.service", out)
    assert answer.stopped is None and answer.failed
    assert answer.why.startswith("journalctl gave an entry not asked for: ")
    assert "\\ufffd" in answer.why  # the replacement character, escaped for the line


def test_answer_not_utf8_outside_json_is_no_answer() -> None:
    answer = read_answer("a.service", b"\x80\x81 not json")
    assert answer == Answer(None, "journalctl said \\ufffd\\ufffd not json", failed=True)


def test_boot_not_utf8_is_no_boot_not_a_crash() -> None:
    entry = {"_PID": "1", "INVOCATION_ID": INVOCATION, "_BOOT_ID": "x"}
    out = json.dumps(entry).encode()[:-1] + b', "X": "\xc3"}'
    boot = read_boot(INVOCATION, out)
    assert isinstance(boot, Answer) and boot.stopped is None and boot.failed
    assert boot.why.startswith("journalctl gave an entry not asked for: ")


def test_boot_not_utf8_outside_json_is_no_boot() -> None:
    assert read_boot(INVOCATION, b"\xff") == Answer(None, "journalctl said \\ufffd", failed=True)


def test_entry_not_asked_for_is_shown_cut_at_80_characters() -> None:
    """The line that says so shows the first 80 characters of the entry, then "..."."""
    entry = {"MESSAGE_ID": STARTING, "UNIT": "other.service", "_PID": "1", "X": "y" * 200}
    text = json.dumps(entry)
    answer = read_answer("a.service", text.encode())
    assert answer == Answer(
        None, f"journalctl gave an entry not asked for: {text[:80]}...", failed=True
    )


def test_saved_since_without_standin_reads_the_state_file(tmp_path: Path) -> None:
    """No runtime directory: only the state file is looked at."""
    store = StateStore(tmp_path)
    assert store.saved_since() is None
    store.save(STATE, "b")
    assert store.saved_since() == ""
    StateStore(tmp_path).save(STATE, "b")  # another writer, its generation 1 as ours
    other = StateStore(tmp_path)
    assert other.saved_since() == f"{store.path} was saved again since it was read"


def test_saved_since_sees_a_standin_saved_since(tmp_path: Path) -> None:
    """A controller that saved to the stand-in since (its state directory not writable)
    saved again: release-jobs must not write over it."""
    state_dir, runtime_dir = tmp_path / "state", tmp_path / "run"
    state_dir.mkdir()
    runtime_dir.mkdir()
    store = StateStore(state_dir, runtime_dir)
    assert store.standin == runtime_dir / store.path.name
    assert store.saved_since() is None
    StateStore(runtime_dir).save(STATE, "b")  # written where the stand-in goes
    assert store.saved_since() == f"{store.standin} was saved again since it was read"
