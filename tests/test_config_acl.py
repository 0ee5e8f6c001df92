"""config.yaml, or a directory above it, with a POSIX access ACL that lets others write.

`setfacl -m u:bob:rw /etc/gpuslice/config.yaml` leaves the file root's, st_gid 0, and shows
the ACL's mask as the group bits (0664): owner and group checks alone trusted the file, and bob
could make the root controller run a cuda_checkpoint of his. `safefile.has_access_acl` is the
one ACL reader, shared with `envsafety` (EnvironmentFile=s, the cuda_checkpoint tool), and
`config._changeable_by_others` decides as envsafety does: group bits with `w` and an access ACL
are refused. The first tests set a real ACL (the kernel's binary form, no setfacl needed) and
skip where the file system takes none; the others inject what getxattr(2) answers.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

import pytest

from gpuslice import envsafety, safefile
from gpuslice.config import Config, ConfigError, load_config
from tests.test_config import ROOTS_ALONE, write

BOB = 1000
ACL_MAY_WRITE = "is group-writable with an access ACL, which may let others write it"


def _acl(path: Path, perm: int) -> None:
    """The access ACL `setfacl -m u:BOB:PERM` makes (perm 6 for rw, 7 for rwx): owner rw(x),
    group r(x), BOB `perm`, the mask `perm` with the group's r, other r(x)."""
    x = 1 if path.is_dir() else 0

    def entry(tag: int, perm: int, ident: int = 0xFFFFFFFF) -> bytes:
        return struct.pack("<HHI", tag, perm, ident)

    blob = struct.pack("<I", 2) + b"".join(
        [
            entry(0x01, 6 | x),  # USER_OBJ
            entry(0x02, perm, BOB),  # USER
            entry(0x04, 4 | x),  # GROUP_OBJ
            entry(0x10, perm | 4 | x),  # MASK
            entry(0x20, 4 | x),  # OTHER
        ]
    )
    try:
        os.setxattr(path, safefile.ACCESS_ACL, blob)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            pytest.skip(f"the file system of {path} takes no POSIX ACLs")
        raise


def _getxattr_says(monkeypatch: pytest.MonkeyPatch, answers: dict[str, int | None]) -> None:
    """os.getxattr answering, for each path in `answers`, an ACL (None) or that errno;
    ENODATA (no ACL) for any other path."""

    def fake(path: str, attribute: str, *, follow_symlinks: bool = True) -> bytes:
        assert attribute == safefile.ACCESS_ACL and not follow_symlinks
        answer = answers.get(os.fspath(path), errno.ENODATA)
        if answer is not None:
            raise OSError(answer, os.strerror(answer), path)
        return b"\x02\x00\x00\x00"

    monkeypatch.setattr(os, "getxattr", fake)


def test_a_config_file_with_an_acl_that_lets_a_user_write_is_not_read(tmp_path: Path) -> None:
    """A real ACL: `setfacl -m u:bob:rw` is refused; `u:bob:r` (the mask without w) lets no
    one else write, and the file is read."""
    path = write(tmp_path, "cuda_checkpoint: /home/bob/pwn\n")
    path.chmod(0o644)
    _acl(path, 6)
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o664 and st.st_gid == os.getegid()
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [
        f"{path}: not read: {path} {ACL_MAY_WRITE} (mode 0664){ROOTS_ALONE}"
    ]
    _acl(path, 4)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert load_config(path).cuda_checkpoint == "/home/bob/pwn"


def test_a_directory_with_an_acl_that_lets_a_user_write_is_refused(tmp_path: Path) -> None:
    """`setfacl -m u:bob:rwx /etc/gpuslice`: bob can put a config.yaml of his in its place."""
    etc = tmp_path / "gpuslice"
    etc.mkdir(mode=0o755)
    path = write(etc, "gpus: 2\n")
    _acl(etc, 7)
    assert stat.S_IMODE(etc.stat().st_mode) == 0o775
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [
        f"{path}: not read: {etc} {ACL_MAY_WRITE} (mode 0775){ROOTS_ALONE}"
    ]
    _acl(etc, 5)  # bob may list it, not change it
    assert load_config(path) == Config(gpus=2)


def test_the_shared_reader_does_not_follow_a_symlink(tmp_path: Path) -> None:
    """A symlink has no ACL of its own: its target's is not taken for the link's (the walks
    check the target where they reach it); a file without one has none."""
    target = tmp_path / "target"
    target.write_text("")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert safefile.has_access_acl(str(target)) is False
    _acl(target, 6)
    assert safefile.has_access_acl(str(target)) is True
    assert safefile.has_access_acl(str(link)) is False


def test_an_acl_above_a_symlink_that_led_to_the_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected: the directory holding the link /etc/gpuslice/config.yaml (its group bits the
    mask, with w) has an ACL; the file it leads to and that one's directory have none."""
    srv = tmp_path / "srv"
    srv.mkdir(mode=0o755)
    target = write(srv, "gpus: 2\n")
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "config.yaml").symlink_to(target)
    for each in (etc, srv):
        each.chmod(0o775)
    target.chmod(0o664)
    _getxattr_says(monkeypatch, {str(etc): None})
    with pytest.raises(ConfigError) as caught:
        load_config(etc / "config.yaml")
    assert caught.value.problems == [
        f"{etc}/config.yaml: not read: {etc} {ACL_MAY_WRITE} (mode 0775){ROOTS_ALONE}"
    ]
    _getxattr_says(monkeypatch, {})  # no ACL anywhere: group root's, or this user's, may write
    assert load_config(etc / "config.yaml") == Config(gpus=2)


@pytest.mark.parametrize(
    "error", [errno.ENODATA, errno.EOPNOTSUPP], ids=["no ACL", "file system without ACLs"]
)
def test_a_file_system_without_acls_is_no_acl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    path = write(tmp_path, "gpus: 2\n")
    path.chmod(0o664)
    _getxattr_says(monkeypatch, {str(path): error})
    assert load_config(path) == Config(gpus=2)


def test_an_acl_that_cannot_be_asked_for_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """getxattr failing otherwise (EIO) answers nothing: the file may let anyone write."""
    path = write(tmp_path, "gpus: 2\n")
    path.chmod(0o664)
    _getxattr_says(monkeypatch, {str(path): errno.EIO})
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [
        f"{path}: not read: {path} cannot be checked: {os.strerror(errno.EIO)}{ROOTS_ALONE}"
    ]
    path.chmod(0o644)  # the mask has no w: no one named in an ACL may write, nothing asked
    assert load_config(path) == Config(gpus=2)


@pytest.mark.skipif(os.geteuid() != 0, reason="the file must be root's (chown needs root)")
def test_envsafety_refuses_a_file_whose_acl_cannot_be_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared reader in envsafety (EnvironmentFile=s, the cuda_checkpoint tool): an
    error but "no ACL" refuses, "no ACL" does not."""
    tmp_path.chmod(0o755)
    (tmp_path / "etc").mkdir(mode=0o755)
    env = tmp_path / "etc" / "asr.env"
    env.write_text("X=1\n")
    env.chmod(0o664)
    _getxattr_says(monkeypatch, {str(env): errno.EIO})
    refusal = envsafety.EnvFileChecker(tmp_path).refusal("asr.service", "/etc/asr.env")
    assert refusal is not None and refusal.reason == f"/etc/asr.env {ACL_MAY_WRITE}"
    _getxattr_says(monkeypatch, {str(env): errno.ENOTSUP})
    assert envsafety.EnvFileChecker(tmp_path).refusal("asr.service", "/etc/asr.env") is None
