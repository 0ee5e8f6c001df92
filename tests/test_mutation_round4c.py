"""gpuslice/envsafety.py's refusals at their exact words where a value or path is long (cut
at 200 characters, as every other value a refusal quotes), cuda-checkpoint's path checked as
a path, FUSE file systems of users reached through a symlink or named with a doubled `/`,
and the mount table's lines as the kernel writes them (`/` first, an empty source)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuslice import envsafety
from gpuslice.envsafety import FIX_OWNERS, FIX_PATH, EnvFileChecker, Refusal
from tests.test_envsafety import ASR, ETC, GATE, errors, install, put
from tests.test_envsafety import root as root  # a fixture
from tests.test_envsafety_mutation import fresh_covered as fresh_covered  # autouse
from tests.test_unitfiles import link

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")

OUTPUT = "until it names, by an absolute path, a place only root can change"
FUSE = (
    "is a FUSE file system that UID 1000 mounted, whose files show whatever owner its program likes"
)


def fuse_of_asr(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """asr's sshfs on the system path `point` under root, in the mount table read."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_bytes(
        b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        + f"60 22 0:60 / {root}{point} rw - fuse.sshfs asr@h:/ "
        "rw,user_id=1000,group_id=1000,allow_other\n".encode()
    )
    monkeypatch.setattr(envsafety, "MOUNTINFO", str(mountinfo))


def test_a_path_of_roots_that_cannot_be_checked_is_named_cut_as_any_value(root: Path) -> None:
    """`path_refusal` (cuda-checkpoint's path) names a path it cannot check, cut at 200
    characters: a path of 4,200 bytes is not one journal line of 4,200 characters."""
    checker = EnvFileChecker(root)
    long = "/opt/" + "x" * 4200
    assert checker.path_refusal(long) == Refusal(
        f"/opt/{'x' * 195}... cannot be checked: longer than 4095 bytes", FIX_PATH
    )
    assert checker.path_refusal("opt/cuda-checkpoint") == Refusal(
        "opt/cuda-checkpoint is not an absolute path, which gpuslice cannot check", FIX_PATH
    )
    relative = "o" * 201  # one character over: cut all the same
    assert checker.path_refusal(relative) == Refusal(
        f"{'o' * 200}... is not an absolute path, which gpuslice cannot check", FIX_PATH
    )


def test_a_long_environment_file_with_specifiers_is_named_as_written_cut_then_expanded(
    root: Path,
) -> None:
    """`EnvironmentFile=%E/<250 a's>/env`: the value as written, cut at 200 characters as
    every quoted value, then the whole path it names."""
    directory = "a" * 250
    put(root, f"/etc/{directory}/env", uid=ASR)
    checker = EnvFileChecker(root)
    refusal = checker.refusal("x.service", f"%E/{directory}/env")
    assert refusal == Refusal(
        f"%E/{'a' * 197}... (/etc/{directory}/env) is owned by UID {ASR}, who can change it",
        FIX_OWNERS,
    )
    # 201 characters as written: cut too
    put(root, f"/etc/{'b' * 194}/env", uid=ASR)
    refusal = checker.refusal("x.service", f"%E/{'b' * 194}/env")
    assert refusal == Refusal(
        f"%E/{'b' * 194}/en... (/etc/{'b' * 194}/env) is owned by UID {ASR}, who can change it",
        FIX_OWNERS,
    )


def test_a_long_relative_environment_file_is_named_once_as_written(root: Path) -> None:
    """`EnvironmentFile=` of 150 `%%` (150 `%`, a relative path): refused as written, cut at
    200 characters, and not named a second time with what its specifiers made of it."""
    refusal = EnvFileChecker(root).refusal("x.service", "%%" * 150)
    assert refusal == Refusal(
        f"{'%' * 200}... is not an absolute path, which gpuslice cannot check", FIX_PATH
    )
    refusal = EnvFileChecker(root).refusal("x.service", "%%" * 101)  # 202: cut as well
    assert refusal == Refusal(
        f"{'%' * 200}... is not an absolute path, which gpuslice cannot check", FIX_PATH
    )


def test_a_long_output_path_in_a_users_directory_is_named_cut(root: Path) -> None:
    """LD_DEBUG_OUTPUT= of 250 characters in asr's /srv/asr: the file written is named cut at
    200 characters, as the assignment is."""
    put(root, "/srv/asr/keep", uid=ASR)
    os.chown(root / "srv/asr", ASR, ASR)
    value = "/srv/asr/" + "d" * 241
    install(root, "x.service", "User=asr", f"Environment=LD_DEBUG=all LD_DEBUG_OUTPUT={value}")
    cut = value[:200] + "..."
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] Environment: LD_DEBUG_OUTPUT={cut}: the gate's "
        f"programs would write {cut} as root, and /srv/asr is owned by UID {ASR}, who can "
        f"change it; {GATE} x.service {OUTPUT}"
    ]
    value = "/srv/asr/" + "e" * 188  # 197, written 201: cut at 200 too
    install(root, "y.service", "User=asr", f"Environment=LD_DEBUG=all LD_DEBUG_OUTPUT={value}")
    assert errors(root, "y.service") == [
        f"{ETC}/y.service:5: [Service] Environment: LD_DEBUG_OUTPUT={value}: the gate's "
        f"programs would write {value}.PI... as root, and /srv/asr is owned by UID {ASR}, "
        f"who can change it; {GATE} y.service {OUTPUT}"
    ]


def test_a_users_fuse_file_system_reached_through_a_symlink_names_the_symlink(
    root: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/srv/job, root's symlink to /mnt/asr, where asr mounted sshfs: the refusal names the
    FUSE mount point and the symlink that led there, as for any other refused directory."""
    put(root, "/mnt/asr/job.env")
    link(root, "/srv/job", "/mnt/asr")
    fuse_of_asr(root, tmp_path_factory.mktemp("proc"), monkeypatch, "/mnt/asr")
    refusal = EnvFileChecker(root).refusal("x.service", "/srv/job/job.env")
    assert refusal == Refusal(
        f"/srv/job/job.env: /mnt/asr, reached through the symlink /srv/job, {FUSE}", FIX_OWNERS
    )


def test_a_users_fuse_file_system_named_with_a_doubled_slash_is_no_directory_of_itself(
    root: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LD_DEBUG_OUTPUT=/srv//asr/d, asr's sshfs on /srv/asr: the directory written in is the
    FUSE mount itself, named so (not "its directory /srv/asr")."""
    put(root, "/srv/asr/keep")
    fuse_of_asr(root, tmp_path_factory.mktemp("proc"), monkeypatch, "/srv/asr")
    install(root, "x.service", "User=asr", "Environment=LD_DEBUG=all LD_DEBUG_OUTPUT=/srv//asr/d")
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] Environment: LD_DEBUG_OUTPUT=/srv//asr/d: the gate's "
        f"programs would write /srv//asr/d.PID as root, and /srv//asr: /srv/asr {FUSE}; "
        f"{GATE} x.service {OUTPUT}"
    ]


def test_a_users_fuse_mount_after_the_root_file_system_is_found() -> None:
    """The real table starts with / (ext4, no FUSE), under the root "" (/) as every line:
    the FUSE mounts after it are looked at all the same."""
    table = (
        b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        b"23 22 0:5 / /dev rw - devtmpfs udev rw\n"
        b"60 22 0:60 / /srv/asr rw - fuse.sshfs asr@h:/ rw,user_id=1000,group_id=1000\n"
    )
    assert envsafety._user_mounts(table, "") == {"/srv/asr": ASR}


def test_a_users_fuse_mount_with_an_empty_source_is_found() -> None:
    """fsname= empty: the kernel writes the empty source between two spaces (`fuse.x  rw,..`);
    the options are still the third field after the separator."""
    table = b"60 22 0:60 / /r/a rw - fuse.x  rw,user_id=1000,group_id=1000\n"
    assert envsafety._user_mounts(table, "/r") == {"/a": ASR}
