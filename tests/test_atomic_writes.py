"""Two writers of one file at once (safefile.write_atomic): the controller and `gpuslice
release-jobs` saving the state, two generators, two writers of an env file. With one temporary
name for all (`.NAME.tmp`), the second removed (or truncated) the first's temporary file and
wrote its own there, and the first's rename put the second's half-written file at NAME.
Each writer now has names of its own (`.NAME.tmp-PID-N`), and the temporary files of writers
killed mid-write are removed where the one name was replaced before (`safefile.remove_stale`)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import gpuslice
from gpuslice import envfiles, generator, safefile
from gpuslice.config import pin_runtime_dir
from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import SavedState
from gpuslice.paths import env_file
from gpuslice.state import StateStore

# The other writer, another process: it writes half of its file and waits (or, for a writer
# that writes through a file object, waits before its rename) until the first is done.
_OTHER = r"""
import os, sys
real_write, real_replace = os.write, os.replace
paused = False

def pause():
    global paused
    paused = True
    real_write(1, b"paused\n")
    sys.stdin.readline()

def write(fd, data):
    if paused or fd <= 2:
        return real_write(fd, data)
    done = real_write(fd, bytes(data[: len(data) // 2]))
    pause()
    return done

def replace(src, dst, **kwargs):
    if not paused:
        pause()
    return real_replace(src, dst, **kwargs)

os.write, os.replace = write, replace
exec(sys.argv[1])
"""


class OtherWriter:
    """Another process that runs `code` (a write of the same file) once this process's own
    write reaches its rename, up to the middle of that other write; `finish` lets it end."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.child: subprocess.Popen[bytes] | None = None

    def at_rename(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = os.replace

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            if self.child is None:
                self._start()
            real(src, dst, **kwargs)

        monkeypatch.setattr(os, "replace", replace)

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(gpuslice.__file__).parent.parent)}
        self.child = subprocess.Popen(
            [sys.executable, "-c", _OTHER, self.code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert self.child.stdout is not None
        said = self.child.stdout.readline()
        assert said == b"paused\n", self._ended()

    def _ended(self) -> str:
        assert self.child is not None
        _, err = self.child.communicate(timeout=30)
        return f"the other writer ended ({self.child.returncode}): {err.decode()}"

    def finish(self) -> None:
        """Let the other writer end; it must have succeeded."""
        assert self.child is not None, "the other writer never ran"
        self.child.communicate(b"\n", timeout=30)
        assert self.child.returncode == 0, self._ended()

    def kill(self) -> None:
        if self.child is not None and self.child.returncode is None:
            self.child.kill()
            self.child.communicate(timeout=30)


@contextlib.contextmanager
def other_writer(code: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[OtherWriter]:
    other = OtherWriter(code)
    # both writers take the same first number: only their process ids tell their names apart
    monkeypatch.setattr(safefile, "_numbers", itertools.count(), raising=False)
    other.at_rename(monkeypatch)
    try:
        yield other
    finally:
        other.kill()


def _state(path: Path) -> Any:
    return json.loads(path.read_bytes())["held"]


def _save(path: Path, unit: str) -> None:
    StateStore(path.parent).save(SavedState(held=[unit]), "b")


def _save_code(path: Path, unit: str) -> str:
    return (
        "from pathlib import Path\n"
        "from gpuslice.core.scheduler import SavedState\n"
        "from gpuslice.state import StateStore\n"
        f"StateStore(Path({str(path.parent)!r})).save(SavedState(held=[{unit!r}]), 'b')\n"
    )


def _drop_in(path: Path, word: str) -> None:
    generator.write_whole(path, f"# {word}\n" * 2000)


def _drop_in_code(path: Path, word: str) -> str:
    return (
        "from pathlib import Path\n"
        "from gpuslice.generator import write_whole\n"
        f"write_whole(Path({str(path)!r}), {f'# {word}' + chr(10)!r} * 2000)\n"
    )


def _env(path: Path, gpu: str) -> None:
    envfiles.write(str(path.parents[2]), path.parent.name, [Gpu(int(gpu))])


def _env_code(path: Path, gpu: str) -> str:
    return (
        "from gpuslice import envfiles\n"
        "from gpuslice.core.model import Gpu\n"
        f"envfiles.write({str(path.parents[2])!r}, {path.parent.name!r}, [Gpu({gpu})])\n"
    )


def _record(path: Path, word: str) -> None:
    assert pin_runtime_dir(path, f"/run/gpuslice/{word}")


def _record_code(path: Path, word: str) -> str:
    return (
        "from gpuslice.config import pin_runtime_dir\n"
        f"assert pin_runtime_dir({str(path)!r}, '/run/gpuslice/{word}')\n"
    )


WRITERS: dict[str, tuple[str, Callable[[Path, str], None], Callable[[Path, str], str]]] = {
    # the controller's save and release-jobs' (_record_released), or a controller started
    # while release-jobs ran
    "state": ("state/state.json", _save, _save_code),
    # gpuslice-generator run by hand into the directory systemd's run writes
    "generator": ("gen/a.service.d/gpuslice-gate.conf", _drop_in, _drop_in_code),
    "env file": ("run/env/a.service/gpuslice.env", _env, _env_code),
    "record": ("run/runtime-dir", _record, _record_code),
}
WORDS = {"state": ("mine.service", "theirs.service"), "env file": ("1", "2")}


def _read(kind: str, path: Path) -> Any:
    return _state(path) if kind == "state" else path.read_text()


@pytest.mark.parametrize("kind", WRITERS)
def test_a_second_writer_in_the_middle_never_puts_its_half_file_in_place(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first writer's rename comes while the other is halfway through its file: the
    file is the first's, whole, until the other's rename puts the other's, whole. Before,
    the first renamed the other's half-written file into place (a torn state.json that the
    next start moved aside, every hold lost), or its own temporary file truncated and
    rewritten by the other (a drop-in or env file of the other's, or cut short)."""
    name, write, code = WRITERS[kind]
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    mine, theirs = WORDS.get(kind, ("a", "b"))
    expected: dict[str, Any] = {}
    for word in (mine, theirs):  # each writer's whole file, written alone
        write(path, word)
        expected[word] = _read(kind, path)
    path.unlink()
    assert expected[mine] != expected[theirs]
    with other_writer(code(path, theirs), monkeypatch) as other:
        write(path, mine)
        assert _read(kind, path) == expected[mine]  # the other is halfway through its own
        other.finish()
    assert _read(kind, path) == expected[theirs]  # renamed last: its whole file
    assert os.listdir(path.parent) == [path.name]  # no temporary file left by either


# ---- the temporary files of writers killed mid-write --------------------------------------


def dead_pid() -> int:
    """The id of a process that has ended (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_only_the_temporary_files_of_writers_gone_are_removed(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    gone = [f".state.json.tmp-{dead_pid()}-0", f".state.json.tmp-{os.getpid()}-99999"]
    legacy = [".state.json.tmp"]  # an older gpuslice's one name
    live = [".state.json.tmp-1-3", f".state.json.tmp-{os.getppid()}-0"]
    not_ours = [
        "state.json",
        ".state.json.tmpx",
        ".state.json.tmp-",
        ".state.json.tmp-12",
        ".state.json.tmp-12-",
        ".state.json.tmp--1",
        ".state.json.tmp-0-1",
        ".state.json.tmp-01-1",
        ".state.json.tmp-12345678-1",  # longer than any process id
        ".state.json.tmp-1-2-3",
        ".state.json.tmp-\u0661-1",  # not an ASCII digit
        f".state.json.bad.tmp-{dead_pid()}-0",  # another file's
        f".state.jsonx.tmp-{dead_pid()}-0",
    ]
    for name in gone + legacy + live + not_ours:
        (tmp_path / name).write_text("x")
    assert safefile.remove_stale(path) == 3
    assert sorted(os.listdir(tmp_path)) == sorted(live + not_ours)
    assert safefile.remove_stale(path) == 0
    assert safefile.remove_stale(tmp_path / "none" / "state.json") == 0  # no directory


def test_a_relative_path_is_swept_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / f".f.tmp-{dead_pid()}-0").write_text("x")
    assert safefile.remove_stale("f") == 1
    assert os.listdir(tmp_path) == []


def test_a_write_under_way_in_this_process_is_not_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep on another thread while this process writes: its temporary file stays."""
    path = tmp_path / "f"
    real = os.write
    swept: list[int] = []

    def write(fd: int, data: Any) -> int:
        swept.append(safefile.remove_stale(path))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    safefile.write_atomic(path, b"whole\n")
    assert swept == [0] and path.read_bytes() == b"whole\n"
    assert os.listdir(tmp_path) == ["f"]


def test_a_leftover_at_the_writers_own_name_is_removed_never_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left by a writer killed mid-write that had this process's id, or a link: removed."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    monkeypatch.setattr(safefile, "_numbers", itertools.count(5))
    (tmp_path / f".f.tmp-{os.getpid()}-5").symlink_to(victim)
    old = os.umask(0o077)
    try:
        safefile.write_atomic(tmp_path / "f", b"new\n")
    finally:
        os.umask(old)
    assert victim.read_text() == "keep"
    assert (tmp_path / "f").read_bytes() == b"new\n"
    assert oct((tmp_path / "f").stat().st_mode & 0o777) == oct(0o644)
    assert sorted(os.listdir(tmp_path)) == ["f", "victim"]


def _plant(directory: Path, name: str, pid: int) -> Path:
    planted = directory / f".{name}.tmp-{pid}-0"
    planted.write_text("half")
    return planted


def test_a_load_removes_the_temporary_files_of_killed_saves(tmp_path: Path) -> None:
    """Each start of the controller (or release-jobs) removes those of the state file, its
    bad copy and the stand-in, whose writers are gone: killed saves leave no pile; a live
    writer's (release-jobs' while the controller starts) is left to it."""
    state_dir, run = tmp_path / "state", tmp_path / "run"
    store = StateStore(state_dir, run)
    store.save(SavedState(held=["a.service"]), "b")
    run.mkdir()
    gone = [
        *(_plant(state_dir, "state.json", dead_pid()) for _ in range(3)),
        _plant(state_dir, "state.json.bad", dead_pid()),
        _plant(run, "state.json", dead_pid()),
        state_dir / ".state.json.tmp",
    ]
    gone[-1].write_text("an older gpuslice's")
    live = _plant(state_dir, "state.json", os.getppid())
    assert StateStore(state_dir, run).load() == (SavedState(held=["a.service"]), "b")
    assert not any(p.exists() for p in gone)
    assert live.exists()


def test_a_record_written_removes_those_of_killed_writes(tmp_path: Path) -> None:
    record = tmp_path / "runtime-dir"
    planted = _plant(tmp_path, "runtime-dir", dead_pid())
    assert pin_runtime_dir(record, "/run/gpuslice/a")
    assert os.listdir(tmp_path) == ["runtime-dir"]
    assert not planted.exists()


def test_an_env_file_written_or_removed_takes_those_of_killed_writes_with_it(
    tmp_path: Path,
) -> None:
    """A controller killed mid-write left its temporary file in the unit's directory: the
    next write removes it, and so does the unit's end, whose directory then goes."""
    runtime_dir = str(tmp_path)
    envfiles.write(runtime_dir, "a.service", [Gpu(0)])
    directory = env_file(runtime_dir, "a.service").parent
    _plant(directory, "gpuslice.env", dead_pid())
    envfiles.write(runtime_dir, "a.service", [Gpu(1)])
    assert os.listdir(directory) == ["gpuslice.env"]
    _plant(directory, "gpuslice.env", dead_pid())
    _plant(directory, "gpuslice.env", os.getpid())
    assert envfiles.remove(runtime_dir, "a.service") is True
    assert not directory.exists()
