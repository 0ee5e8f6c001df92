"""Who may change config.yaml, and the runtime_dir the generator's gates name: what mutation
testing showed no test held.

config.yaml steers a root daemon, which runs the cuda_checkpoint it names as root, so
`config._changeable_by_others` refuses a file that anyone but root (or the user running the
program) could change: the file, every directory above it, every directory above a symlink
that leads to it. The tests pin each owner and group that counts, for root and for another
user, the directories above the parent, and the words of a check that could not be made. The
generator's part: the runtime_dir gpuslice.service recorded this boot wins over config.yaml,
and the warnings an admin reads say so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuslice import generator, safefile
from gpuslice.config import Config, ConfigError, load_config, read_config_text
from tests.test_config import ROOTS_ALONE, write
from tests.test_generator import ETC, gate, run, written
from tests.test_generator import write as put

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")


def refused(path: Path) -> list[str]:
    """What load_config says of a file it will not read."""
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return caught.value.problems


@AS_ROOT
def test_a_file_of_any_other_uid_than_root_s_is_not_read_uid_1_too(tmp_path: Path) -> None:
    """UID 1 (daemon) is a user like any other: only root's own files are trusted."""
    path = write(tmp_path, "gpus: 2\n")
    os.chown(path, 1, 0)
    assert refused(path) == [f"{path}: not read: {path} is owned by UID 1{ROOTS_ALONE}"]


@AS_ROOT
def test_a_file_of_a_group_but_root_s_is_read_when_that_group_cannot_write(
    tmp_path: Path,
) -> None:
    """Only a group's write bit counts: a file or directory of group 1000 that the group
    may only read is root's to change."""
    sub = tmp_path / "etc"
    sub.mkdir(mode=0o755)
    os.chown(sub, 0, 1000)
    path = write(sub, "gpus: 2\n")
    os.chown(path, 0, 1000)
    path.chmod(0o644)
    assert load_config(path) == Config(gpus=2)
    sub.chmod(0o775)
    assert refused(path) == [
        f"{path}: not read: {sub} is writable by group GID 1000 (mode 0775){ROOTS_ALONE}"
    ]


@AS_ROOT
def test_root_trusts_group_root_alone_whatever_its_effective_gid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon runs as root: a group it happens to be in (its effective GID) is a group of
    users, who could write a file of that group."""
    path = write(tmp_path, "gpus: 2\n")
    os.chown(path, 0, 1000)
    path.chmod(0o664)
    monkeypatch.setattr(os, "getegid", lambda: 1000)
    assert refused(path) == [
        f"{path}: not read: {path} is writable by group GID 1000 (mode 0664){ROOTS_ALONE}"
    ]


@AS_ROOT
def test_another_user_reads_a_file_of_its_own_or_of_group_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpuslice check` run by user 1000 on a file of theirs: their own user and group count
    as root's do (they could change it anyway); group root may write too; another user not."""
    home = tmp_path / "home"
    home.mkdir(mode=0o775)
    os.chown(home, 1000, 1000)
    path = write(home, "gpus: 2\n")
    os.chown(path, 1000, 1000)
    path.chmod(0o664)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getegid", lambda: 1000)
    assert load_config(path) == Config(gpus=2)
    os.chown(path, 1000, 0)
    assert load_config(path) == Config(gpus=2)
    os.chown(path, 1001, 1000)
    assert refused(path) == [f"{path}: not read: {path} is owned by UID 1001{ROOTS_ALONE}"]
    os.chown(path, 1000, 1001)
    assert refused(path) == [
        f"{path}: not read: {path} is writable by group GID 1001 (mode 0664){ROOTS_ALONE}"
    ]


def test_every_directory_above_counts_not_only_the_parent(tmp_path: Path) -> None:
    """A directory anyone can write two levels up: a user renames the file's directory away
    and puts their own in its place. So above the file a symlink leads to, and above the
    symlink."""
    deep = tmp_path / "open" / "srv" / "gpuslice"
    deep.mkdir(parents=True)
    path = write(deep, "gpus: 2\n")
    (tmp_path / "open").chmod(0o777)
    assert refused(path) == [
        f"{path}: not read: {tmp_path}/open is writable by anyone (mode 0777){ROOTS_ALONE}"
    ]
    (tmp_path / "open").chmod(0o755)
    assert load_config(path) == Config(gpus=2)
    etc = tmp_path / "links" / "etc" / "gpuslice"
    etc.mkdir(parents=True)
    (etc / "config.yaml").symlink_to(path)
    assert load_config(etc / "config.yaml") == Config(gpus=2)
    (tmp_path / "links").chmod(0o777)
    assert refused(etc / "config.yaml") == [
        f"{etc}/config.yaml: not read: {tmp_path}/links is writable by anyone (mode 0777)"
        f"{ROOTS_ALONE}"
    ]


def test_a_file_gone_before_it_could_be_checked_is_not_read_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removed between its read and the check of who may change it: not trusted, in the
    system's words (not Python's "[Errno 2] ..." with the path said twice)."""
    path = write(tmp_path, "gpus: 2\n")
    read_bytes = safefile.read_bytes

    def read_then_removed(
        file: str | os.PathLike[str], limit: int | None, *, follow_links: bool
    ) -> bytes:
        data = read_bytes(file, limit, follow_links=follow_links)
        path.unlink()
        return data

    monkeypatch.setattr(safefile, "read_bytes", read_then_removed)
    with pytest.raises(ConfigError) as caught:
        read_config_text(path)
    assert caught.value.problems == [
        f"{path}: not read: {path} cannot be checked: No such file or directory{ROOTS_ALONE}"
    ]


# ---- the generator: the runtime_dir of this boot --------------------------------------------

RECORD = "/run/gpuslice/runtime-dir"


def test_a_config_naming_another_runtime_dir_is_told_to_wait_for_the_next_boot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """config.yaml now says b; gpuslice.service runs with a this boot: the gates keep a, and
    the admin reads, at the line of the setting, when b takes effect."""
    put(tmp_path, RECORD, "/run/gpuslice/a\n")
    put(tmp_path, "/etc/gpuslice/config.yaml", "gpus: 2\nruntime_dir: /run/gpuslice/b\n")
    put(tmp_path, f"{ETC}/a.service", "[X-GPUSlice]\nPriority=1\n")
    out = run(tmp_path)
    assert written(out) == {"a.service.d/gpuslice-gate.conf": gate(runtime="/run/gpuslice/a")}
    config_path = tmp_path / "etc/gpuslice/config.yaml"
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: warning: {config_path}:2: runtime_dir: /run/gpuslice/b takes "
        "effect at the next boot: gpuslice.service runs with /run/gpuslice/a this boot, which "
        "the gates keep naming"
    ]


def test_a_config_naming_the_runtime_dir_of_this_boot_says_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    put(tmp_path, RECORD, "/run/gpuslice/a\n")
    put(tmp_path, "/etc/gpuslice/config.yaml", "runtime_dir: /run/gpuslice/a\n")
    put(tmp_path, f"{ETC}/a.service", "[X-GPUSlice]\nPriority=1\n")
    assert written(run(tmp_path)) == {
        "a.service.d/gpuslice-gate.conf": gate(runtime="/run/gpuslice/a")
    }
    assert capsys.readouterr().err == ""


def test_a_config_that_could_not_be_read_at_all_keeps_the_runtime_dir_of_this_boot_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generator's belt and braces (config.py raising what it never should): the gates
    still name the runtime_dir gpuslice.service runs with, and the warning says whose it is,
    not "the defaults"."""

    def broken(path: object) -> object:
        raise RuntimeError("a bug")

    monkeypatch.setattr(generator, "load_config_with_warnings", broken)
    put(tmp_path, RECORD, "/run/gpuslice/a\n")
    put(tmp_path, f"{ETC}/a.service", "[X-GPUSlice]\nPriority=1\n")
    out = run(tmp_path)
    assert written(out) == {"a.service.d/gpuslice-gate.conf": gate(runtime="/run/gpuslice/a")}
    config_path = tmp_path / "etc/gpuslice/config.yaml"
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: warning: {config_path}: a bug (using runtime_dir "
        "/run/gpuslice/a, gpuslice.service's this boot, and gate_retry_seconds 0.5: the "
        "file's if valid, else the default)"
    ]
