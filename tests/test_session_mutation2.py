"""What mutation testing of this session's new code showed no test held (the second run).

- `lock_unit_dir(wait=False)` while another command holds the lock fails at once, never
  waits (a test that waited hung until its timeout, which mutmut does not count as killed);
- `gpuslice enroll ALIAS` says on stderr, not with the result on stdout, that it enrolls the
  unit the alias names (`_enroll`);
- a unit whose annotation went while it held two GPUs, restarted, passes its gate over D-Bus
  with both GPUs named as the gate reads them, "0,1" (`Gates.let_through`);
- `safefile`'s Unreadable carries the file as last looked at, whatever the step that refused
  it: the look (not a regular file), the open (a file that can be looked at but not opened)
  or the read (an I/O error): `state.read_found` takes a refused file with no stat for one
  gone since the look;
- the generator's writes: `write_whole` raises the write's own error, and the runtime_dir
  drop-in that cannot be written is one error line in its own words (`generate`).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from gpuslice import generator, safefile
from gpuslice.core.scheduler import SavedState
from gpuslice.newunit import lock_unit_dir
from gpuslice.paths import env_file
from gpuslice.safefile import Unreadable, Why, read_with_stat
from tests.test_cli_hostile import SYSTEM, enroll
from tests.test_controller import (
    Bed,
    at_gate,
    bed_config,
    messages,
    run,
    signal,
    state,
    unannotate,
    until,
)
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_generator import ANNOTATION, ETC, LIBEXEC, gate, write, written

LIMIT = 100

# ---- the unit directory's lock, not waited for ------------------------------------------------


def test_a_lock_taken_without_waiting_fails_at_once_while_another_holds_it(
    tmp_path: Path,
) -> None:
    """`gpuslice new` and `enroll` try first without waiting, to say that they wait: a try
    that waited said nothing while the other command held the lock."""
    held = lock_unit_dir(tmp_path)
    got: list[object] = []

    def take() -> None:
        try:
            got.append(lock_unit_dir(tmp_path, wait=False))
        except BaseException as e:  # handed to the test
            got.append(e)

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    taker.join(30)  # a loaded machine may start it late: let go early, it took the lock
    os.close(held)  # lets a taker that waits go
    taker.join(5)
    for fd in got:
        if isinstance(fd, int):
            os.close(fd)
    assert len(got) == 1 and isinstance(got[0], BlockingIOError), got


# ---- gpuslice enroll ALIAS ---------------------------------------------------------------------


def test_enroll_of_an_alias_says_which_unit_it_enrolls_on_stderr(tmp_path: Path) -> None:
    """stdout is the command's result (`enrolled ...`), which a script may read; the note
    that the name given is an alias is a message to the admin, as the warnings are."""
    (tmp_path / SYSTEM).mkdir(parents=True)
    (tmp_path / SYSTEM / "real.service").write_text("[Service]\nExecStart=/bin/true\n")
    (tmp_path / SYSTEM / "alias.service").symlink_to("real.service")
    result = enroll(tmp_path, "alias", "--priority", "5")
    assert result.exit_code == 0, result.output
    assert result.stderr == "alias.service is an alias of real.service: enrolling real.service\n"
    dropin = tmp_path / SYSTEM / "real.service.d/gpuslice.conf"
    assert result.stdout.startswith("enrolled real.service ")
    assert result.stdout.endswith(f" via {dropin}\n")
    assert "is an alias of" not in result.stdout


# ---- a unit let through on two GPUs still held for it ------------------------------------------


def test_a_restarted_unit_whose_annotation_went_passes_on_both_its_gpus(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """low.service held GPUs 0 and 1 when its annotation went, and `systemctl restart` ran
    it again: its gate (still in place until the next daemon-reload) asks over D-Bus and is
    answered with the GPUs the core still holds for it, as a grant's answer names them."""
    bed = Bed(
        tmp_path,
        {"low.service": "Priority=90\nGPUs=2\n"},
        [state("low.service", "active", "running")],
        SavedState(holders={"low.service": ((0, 1), "running", 1, "")}, seq=1),
        config=bed_config(tmp_path, gpus=2),
    )
    cgroup_of[4343] = "low.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await unannotate(ctl, tmp_path, "low.service")
        assert ctl.scheduler.grants() == {"low.service": frozenset({0, 1})}
        bed.systemd.units["low.service"] = state("low.service", "activating", "start-pre")
        signal(bed, "low.service", at_gate(invocation=b"next"))
        await bed.acquire("low.service", ":1.10", 4343)
        await until(lambda: bed.service.granted != [])
        assert bed.service.granted == [("low.service", "0,1")]
        assert "GPUSLICE_GPUS=0,1\n" in env_file(bed.config.runtime_dir, "low.service").read_text()

    caplog.set_level(logging.INFO, "gpuslice")
    run(test)
    assert (
        "low.service passed the gate on GPUs 0,1, which it keeps until it ends: no longer annotated"
    ) in messages(caplog)


# ---- safefile: the stat a refused file carries -------------------------------------------------


def refused(path: Path | str, *, follow_links: bool) -> Unreadable:
    with pytest.raises(Unreadable) as raised:
        read_with_stat(path, LIMIT, follow_links=follow_links)
    return raised.value


@pytest.mark.parametrize("follow_links", [True, False])
def test_a_fifo_refused_at_the_look_carries_that_look(tmp_path: Path, follow_links: bool) -> None:
    """A FIFO at the path is there (state.read_found gives it a time: not taken for a file
    gone since the look), though never opened."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    error = refused(fifo, follow_links=follow_links)
    assert error.why is Why.NOT_REGULAR
    assert error.stat is not None and stat.S_ISFIFO(error.stat.st_mode)
    assert error.stat.st_ino == os.lstat(fifo).st_ino


def test_a_fifo_swapped_in_after_the_look_carries_the_open_files_stat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look saw a regular file; the open one is a FIFO: the stat is the FIFO's."""
    (tmp_path / "regular").touch()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    regular = os.lstat(tmp_path / "regular")
    real_lstat = os.lstat

    def lstat(file: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        return regular if file == fifo else real_lstat(file, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    error = refused(fifo, follow_links=False)
    assert error.why is Why.NOT_REGULAR
    assert error.stat is not None and stat.S_ISFIFO(error.stat.st_mode)


def test_a_file_that_cannot_be_opened_carries_the_look(tmp_path: Path) -> None:
    """/proc/sys/vm/drop_caches is a regular file that no one may open for reading (root
    neither: /proc/sys reads its mode bits for root too): there, not gone."""
    path = "/proc/sys/vm/drop_caches"
    if not os.path.exists(path):
        pytest.skip(f"no {path}")
    error = refused(path, follow_links=False)
    assert error.why is Why.FAILED
    assert error.error is not None and error.error.errno == errno.EACCES
    assert error.stat is not None and stat.S_ISREG(error.stat.st_mode)
    assert error.stat.st_ino == os.lstat(path).st_ino


def test_a_symlink_swapped_in_before_the_open_carries_the_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look saw a regular file; O_NOFOLLOW refuses the link found at the open (ELOOP)."""
    (tmp_path / "regular").write_bytes(b"mine")
    path = tmp_path / "f"
    path.symlink_to(tmp_path / "regular")
    regular = os.lstat(tmp_path / "regular")
    real_lstat = os.lstat

    def lstat(file: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        return regular if file == path else real_lstat(file, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    error = refused(path, follow_links=False)
    assert error.error is not None and error.error.errno == errno.ELOOP
    assert error.stat is regular


def test_a_file_whose_read_fails_carries_the_open_files_stat() -> None:
    """/proc/self/mem is a regular file whose read at offset 0 fails (EIO: nothing is mapped
    there), as a disk's I/O error fails the read of a state file that is there."""
    error = refused("/proc/self/mem", follow_links=False)
    assert error.why is Why.FAILED
    assert error.error is not None and error.error.errno == errno.EIO
    assert error.stat is not None and stat.S_ISREG(error.stat.st_mode)
    assert error.stat.st_ino == os.stat("/proc/self/mem").st_ino


# ---- the generator's writes --------------------------------------------------------------------


def test_write_whole_raises_the_writes_own_error(tmp_path: Path) -> None:
    """Nothing was made, so there is nothing to remove: the error is the open's, which the
    generator's message names ("No such file or directory"), not one of the clean-up."""
    with pytest.raises(FileNotFoundError):
        generator.write_whole(tmp_path / "none" / "gpuslice-gate.conf", "text\n")
    assert os.listdir(tmp_path) == []


def test_a_runtime_dir_drop_in_that_cannot_be_written_is_one_error_in_its_own_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory at its temporary name (left there by hand, say): the open fails, so does
    the unlink of what is in the way, and the message names that error; the units' gates are
    written all the same."""
    write(tmp_path, f"{ETC}/a.service", ANNOTATION)
    out = tmp_path / "run/systemd/generator"
    monkeypatch.setattr(safefile, "_numbers", itertools.count(7))  # its next temporary name
    (out / f"gpuslice.service.d/.gpuslice-runtime-dir.conf.tmp-{os.getpid()}-7").mkdir(parents=True)
    assert generator.generate(out, root=tmp_path, libexec_dir=LIBEXEC) == 1
    assert written(out) == {"a.service.d/gpuslice-gate.conf": gate()}
    assert capsys.readouterr().err.splitlines() == [
        "gpuslice-generator: error: cannot write gpuslice.service.d/gpuslice-runtime-dir.conf: "
        "Is a directory (gpuslice.service takes the runtime_dir it recorded this boot, else "
        "config.yaml's)"
    ]
    assert not (out / "gpuslice.service.d/gpuslice-runtime-dir.conf").exists()


def test_an_output_directory_that_is_a_dangling_link_gets_nothing_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The directory systemd names, a link to nowhere: no drop-in can be written, and each
    line says the one reason, the name taken by something that is no directory (mkdir's
    "File exists"), not a missing parent."""
    write(tmp_path, f"{ETC}/a.service", ANNOTATION)
    out = tmp_path / "generator"
    out.symlink_to(tmp_path / "nowhere")
    assert generator.generate(out, root=tmp_path, libexec_dir=LIBEXEC) == 0
    assert not (tmp_path / "nowhere").exists()
    assert capsys.readouterr().err.splitlines() == [
        "gpuslice-generator: error: cannot write gpuslice.service.d/gpuslice-runtime-dir.conf: "
        "File exists (gpuslice.service takes the runtime_dir it recorded this boot, else "
        "config.yaml's)",
        "gpuslice-generator: error: a.service: cannot write its gate: File exists (unit not gated)",
    ]
