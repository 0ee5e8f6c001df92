"""Mutation-driven tests of stopjournal's asking (ask, _ask_all, _this_boot, _run, _read): the
lines that say why the journal could not tell (each cut at its length), a journalctl given no
input of ours, a name it cannot be run with, its stderr as bytes, and the bounds kept when the
time for all runs out: every journalctl killed and reaped before `ask` returns, its pipes read
to their end, a reap bounded by REAP_SECONDS (one stuck in the kernel is not waited for), and
only OUTPUT_MAX + 1 bytes of a stream kept, however they come.

Processes that must not answer are stand-ins that never do (an event never set), and the
chunks a pipe delivers are scripted: nothing here races the wall clock."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuslice import stopjournal
from gpuslice.stopjournal import OUTPUT_MAX, Answer, ask, read_answer

# A `journalctl` that answers each unit from ANSWERS (unit -> [status, stdout hex, stderr hex])
# and writes down, one line each, its argv and whether its stdin is /dev/null.
STAND_IN = """#!{python}
import json, os, stat, sys
args = sys.argv[1:]
here = os.path.dirname(os.path.abspath(__file__))
st, null = os.fstat(0), os.stat("/dev/null")
devnull = stat.S_ISCHR(st.st_mode) and st.st_rdev == null.st_rdev
with open(os.path.join(here, "calls"), "a") as f:
    f.write(json.dumps({{"args": args, "stdin_devnull": devnull}}) + "\\n")
unit = next((a[5:] for a in args if a.startswith("UNIT=")), "(boot)")
with open(os.path.join(here, "answers")) as f:
    code, out, err = json.load(f).get(unit, [0, "", ""])
sys.stdout.buffer.write(bytes.fromhex(out))
sys.stderr.buffer.write(bytes.fromhex(err))
sys.exit(code)
"""


class StandIn:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = tmp_path / "bin"
        self.dir.mkdir()
        script = self.dir / "journalctl"
        script.write_text(STAND_IN.format(python=sys.executable))
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{self.dir}{os.pathsep}{os.environ.get('PATH', '')}")
        monkeypatch.delenv("INVOCATION_ID", raising=False)

    def ask(self, answers: dict[str, tuple[int, bytes, bytes]], names: list[str]) -> Any:
        said = {n: [code, out.hex(), err.hex()] for n, (code, out, err) in answers.items()}
        (self.dir / "answers").write_text(json.dumps(said))
        return asyncio.run(ask(names, 30))

    def calls(self) -> list[dict[str, Any]]:
        path = self.dir / "calls"
        return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def journalctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StandIn:
    return StandIn(tmp_path, monkeypatch)


# ---- the lines, each cut at its length --------------------------------------------------------


def test_an_answer_not_json_is_shown_cut_at_80_characters() -> None:
    assert read_answer("a.service", b"n" * 100) == Answer(
        None, "journalctl said " + "n" * 80 + "...", failed=True
    )


def test_json_not_an_entry_is_shown_cut_at_80_characters() -> None:
    text = json.dumps(["l" * 100])
    assert read_answer("a.service", text.encode()) == Answer(
        None, f"journalctl said {text[:80]}...", failed=True
    )


def test_an_invocation_id_not_systemds_is_shown_cut_at_40_characters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("INVOCATION_ID", "x" * 50)
    why = "INVOCATION_ID is not an id systemd gives: " + "x" * 40 + "..."
    assert asyncio.run(ask(["a.service"], 30)) == {"a.service": Answer(None, why, True)}


def test_why_journalctl_could_not_be_run_is_cut_at_80_characters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def refused(*argv: str, **kwargs: object) -> None:
        raise OSError(5, "w" * 100)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", refused)
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    why = "journalctl could not be run: " + "w" * 80 + "..."
    assert asyncio.run(ask(["a.service"], 30)) == {"a.service": Answer(None, why, True)}


def test_a_name_no_process_can_be_given_is_said_not_a_crash(journalctl: StandIn) -> None:
    """A NUL in a name (the state file is ours, but a crash is never safe): the exec refuses
    it with a ValueError, which has no strerror; its own words say why."""
    answers = journalctl.ask({}, ["a\0.service"])
    why = "journalctl could not be run: embedded null byte"
    assert answers == {"a\0.service": Answer(None, why, failed=True)}


def test_stderr_of_output_max_bytes_exactly_is_read_and_cut_at_120_characters(
    journalctl: StandIn,
) -> None:
    err = b"e" * OUTPUT_MAX
    answers = journalctl.ask({"a.service": (1, b"", err)}, ["a.service"])
    why = "journalctl exited with status 1: " + "e" * 120 + "..."
    assert answers == {"a.service": Answer(None, why, failed=True)}


def test_stderr_not_utf8_is_said_with_replacement_not_a_crash(journalctl: StandIn) -> None:
    answers = journalctl.ask({"a.service": (1, b"", b"Failed \xff\xfe\n")}, ["a.service"])
    why = "journalctl exited with status 1: Failed \\ufffd\\ufffd"
    assert answers == {"a.service": Answer(None, why, failed=True)}


def test_journalctl_reads_no_input_of_ours(journalctl: StandIn) -> None:
    """Its stdin is /dev/null, not the controller's (a terminal, a pipe): here a pipe."""
    saved = os.dup(0)
    read_end, write_end = os.pipe()
    try:
        os.dup2(read_end, 0)
        assert stat.S_ISFIFO(os.fstat(0).st_mode)
        journalctl.ask({}, ["a.service"])
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read_end, write_end):
            os.close(fd)
    [call] = journalctl.calls()
    assert call["stdin_devnull"] is True


# ---- the time for all runs out: nothing left running -----------------------------------------


def test_ask_returns_only_once_every_unfinished_journalctl_is_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A journalctl that never answers takes a while to be killed and reaped; `ask` returns
    after that, also when another unit's question had not started (its cancel is at once)."""
    monkeypatch.setattr(stopjournal, "AT_ONCE", 1)
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    started: list[str] = []
    reaped: list[str] = []

    async def run(argv: list[str]) -> bytes:
        name = next(a[5:] for a in argv if a.startswith("UNIT="))
        started.append(name)
        try:
            await asyncio.Event().wait()  # never answers
        except asyncio.CancelledError:
            for _ in range(20):  # killed, then reaped: a few turns of the loop
                await asyncio.sleep(0)
            reaped.append(name)
            raise
        raise AssertionError("not reached")

    monkeypatch.setattr(stopjournal, "_run", run)

    async def main() -> tuple[dict[str, Answer], list[str]]:
        answers = await ask(["a.service", "b.service"], 0.01)
        return answers, list(reaped)

    answers, reaped_by_then = asyncio.run(main())
    late = Answer(None, "journalctl did not answer within 0.01 s", failed=True)
    assert answers == {"a.service": late, "b.service": late}
    assert started == ["a.service"]
    assert reaped_by_then == ["a.service"]


class FakeProc:
    """A journalctl as asyncio gives it: `kill` makes it write its last bytes (more than
    OUTPUT_MAX on each pipe), close its pipes and exit, unless it is stuck (`dies` False: in
    the kernel, SIGKILL waits) or already gone (`gone`: asyncio raises ProcessLookupError)."""

    def __init__(self, dies: bool = True, gone: bool = False) -> None:
        self.stdout = asyncio.StreamReader()
        self.stderr = asyncio.StreamReader()
        self.dies, self.gone = dies, gone
        self.kills = 0
        self.exited = asyncio.Event()
        self.waited = False

    def kill(self) -> None:
        self.kills += 1
        if self.kills == 1 and self.dies and not self.gone:
            for stream in (self.stdout, self.stderr):
                stream.feed_data(b"x" * (OUTPUT_MAX + 100))
                stream.feed_eof()
            self.exited.set()
        if self.gone:  # its exit already seen: wait() returns
            self.exited.set()
            raise ProcessLookupError

    async def wait(self) -> int:
        await self.exited.wait()
        self.waited = True
        return -9


def cancelled_run(
    monkeypatch: pytest.MonkeyPatch, **how: bool
) -> tuple[BaseException | None, FakeProc]:
    """_run of a FakeProc(**how), cancelled while it waits on it; what the cancelled _run
    raised (None if it never ended: a reap waited for without bound), and the process."""
    procs: list[FakeProc] = []

    async def spawn(*argv: str, **kwargs: object) -> FakeProc:
        return procs[0]

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn)

    async def main() -> BaseException | None:
        proc = FakeProc(**how)  # its streams are of this loop
        procs.append(proc)
        if proc.gone:
            proc.stdout.feed_eof()
            proc.stderr.feed_eof()
        task = asyncio.create_task(stopjournal._run(["journalctl"]))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not task.done() and proc.kills == 0
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=20)  # only a bound on a hang
        if not done:
            return None
        try:
            await task
        except BaseException as e:  # what it raised is the answer
            return e
        return AssertionError("returned")

    return asyncio.run(main()), procs[0]


def test_a_cancelled_journalctl_is_killed_its_pipes_read_to_their_end_and_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Left unread, a pipe's transport stays open (and warned of when collected); what the
    reap reads past OUTPUT_MAX kills it again, harmlessly; the cancel goes on."""
    monkeypatch.setattr(stopjournal, "REAP_SECONDS", 60.0)
    raised, proc = cancelled_run(monkeypatch)
    assert isinstance(raised, asyncio.CancelledError)
    assert proc.kills >= 1 and proc.waited
    assert proc.stdout.at_eof() and proc.stderr.at_eof()


def test_a_journalctl_that_does_not_die_is_waited_for_reap_seconds_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In the kernel (a stuck disk), SIGKILL waits: the reap gives up after REAP_SECONDS (a
    start-up does not hang on it) and the cancel goes on."""
    monkeypatch.setattr(stopjournal, "REAP_SECONDS", 0.01)
    raised, proc = cancelled_run(monkeypatch, dies=False)
    assert isinstance(raised, asyncio.CancelledError)
    assert proc.kills == 1 and not proc.waited


def test_a_journalctl_already_gone_when_cancelled_is_no_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It exited, and asyncio let go of it, while _run waited to run again: the kill finds
    no process, and the cancel goes on."""
    monkeypatch.setattr(stopjournal, "REAP_SECONDS", 60.0)
    raised, proc = cancelled_run(monkeypatch, gone=True)
    assert isinstance(raised, asyncio.CancelledError)
    assert proc.kills == 1 and proc.waited


# ---- a stream's bytes, however the pipe delivers them ------------------------------------------


class Chunks:
    """A stream that delivers these chunks, then its end."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)

    async def read(self, n: int) -> bytes:
        return self.chunks.pop(0)[:n] if self.chunks else b""


class Kills:
    def __init__(self, gone: bool = False) -> None:
        self.kills, self.gone = 0, gone

    def kill(self) -> None:
        self.kills += 1
        if self.gone:
            raise ProcessLookupError


def read(proc: Kills, *chunks: bytes) -> bytes:
    return asyncio.run(stopjournal._read(proc, Chunks(*chunks)))  # type: ignore[arg-type]


def test_a_stream_in_chunks_is_kept_whole() -> None:
    proc = Kills()
    assert read(proc, b"a" * 10, b"b" * 10, b"c") == b"a" * 10 + b"b" * 10 + b"c"
    assert proc.kills == 0


def test_output_max_bytes_exactly_are_kept_and_nothing_killed() -> None:
    proc = Kills()
    assert read(proc, b"x" * (OUTPUT_MAX - 1), b"y") == b"x" * (OUTPUT_MAX - 1) + b"y"
    assert proc.kills == 0


def test_a_byte_past_output_max_in_its_own_chunk_is_kept_and_kills() -> None:
    """The first OUTPUT_MAX bytes came alone (a valid entry, padded): one more byte after
    them makes the answer over the limit, and journalctl is killed."""
    proc = Kills()
    kept = read(proc, b"x" * OUTPUT_MAX, b"y", b"z" * 100)
    assert kept == b"x" * OUTPUT_MAX + b"y"
    assert proc.kills == 1


def test_only_the_first_output_max_plus_one_bytes_are_kept() -> None:
    """A journalctl that writes on: the rest is read and dropped, not kept."""
    proc = Kills()
    kept = read(proc, b"x" * 4000, b"y" * 4000, b"z" * 10)
    assert kept == b"x" * 4000 + b"y" * (OUTPUT_MAX + 1 - 4000)
    assert proc.kills == 1


def test_a_kill_of_a_journalctl_gone_is_no_error() -> None:
    proc = Kills(gone=True)
    assert read(proc, b"x" * (OUTPUT_MAX + 10)) == b"x" * (OUTPUT_MAX + 1)
    assert proc.kills == 1
