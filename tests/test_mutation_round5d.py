"""gpuslice/envsafety.py's fstab user mount points (comments, mount points as written, the
real directory a symlink leads to), the mount table's FUSE file systems of root's (an empty
or `-` source), the refusals of those mount points at their exact words (reached through a
symlink, or named as the directory itself), and a unit run as root whose environment skips
the gate after a loader variable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuslice import envsafety
from gpuslice.envsafety import FIX_LOADER, FIX_OWNERS, FIX_TREE, EnvFileChecker, Refusal
from tests.test_envsafety import ETC, GATE, errors, install, mount_table, put
from tests.test_envsafety import root as root  # a fixture
from tests.test_envsafety_mutation import fresh_covered as fresh_covered  # autouse
from tests.test_unitfiles import link

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")

USERS_MOUNT = (
    "is where /etc/fstab lets users mount a file system of theirs (user, users, owner or "
    "group), whose files show whatever owner they were made with"
)
ROOTS_FUSE = (
    "is a FUSE file system mounted allow_other without default_permissions, whose program, "
    "not the kernel, decides who writes there, whatever owner it shows"
)


def test_an_fstab_comment_without_a_blank_after_its_hash_is_no_entry() -> None:
    """`#/dev/sdz /mnt/c auto user`: a comment all the same (libmount skips a line whose
    first field starts with `#`); its fields, shifted by none, would name a user mount."""
    text = (
        b"#/dev/sdz /mnt/c auto user 0 0\n  #/dev/sdy /mnt/d auto user\n/dev/sda /mnt/a auto user\n"
    )
    assert envsafety._fstab_points(text) == {"/mnt/a"}


def test_an_fstab_mount_point_starting_with_x_keeps_it() -> None:
    """Only the `/`s before a mount point are taken away: /Xfer is /Xfer."""
    assert envsafety._fstab_points(b"/dev/sda //Xfer auto user\n") == {"/Xfer"}


def fstab(root: Path, *points: str) -> None:
    """/etc/fstab under root, letting users mount a USB stick on each of `points`."""
    lines = [
        f"/dev/sd{chr(ord('b') + i)}1 {p} auto noauto,user 0 0\n" for i, p in enumerate(points)
    ]
    put(root, "/etc/fstab", "".join(lines))


def test_an_fstab_mount_point_at_the_top_is_itself_alone(root: Path) -> None:
    """/usb, whose directory is / itself: /usb is refused, a directory elsewhere whose last
    component is usb is not."""
    fstab(root, "/usb")
    put(root, "/usb/job.env")
    put(root, "/XX/XX/usb/job.env")
    checker = EnvFileChecker(root)
    assert checker.refusal("x.service", "/usb/job.env") == Refusal(
        f"/usb/job.env: its directory /usb {USERS_MOUNT}", FIX_TREE
    )
    assert checker.refusal("x.service", "/XX/XX/usb/job.env") is None


def test_an_fstab_mount_point_is_found_where_its_directorys_symlink_leads_as_named(
    root: Path,
) -> None:
    """/srv/a/usb and /srv/b/usb, whose directories are symlinks to /dataX and to `/data `
    (a name ending in a blank): mount(8) mounts on /dataX/usb and `/data /usb`, refused by
    those names, and /data/usb, nothing of fstab's, is not."""
    fstab(root, "/srv/a/usb", "/srv/b/usb")
    for directory in ("/dataX", "/data ", "/data"):
        put(root, f"{directory}/usb/job.env")
    link(root, "/srv/a", "/dataX")
    link(root, "/srv/b", "/data ")
    checker = EnvFileChecker(root)
    assert checker.refusal("x.service", "/dataX/usb/job.env") == Refusal(
        f"/dataX/usb/job.env: its directory /dataX/usb {USERS_MOUNT}", FIX_TREE
    )
    assert checker.refusal("x.service", "/data /usb/job.env") == Refusal(
        f"/data /usb/job.env: its directory /data /usb {USERS_MOUNT}", FIX_TREE
    )
    assert checker.refusal("x.service", "/data/usb/job.env") is None


def test_an_fstab_mount_point_reached_through_a_symlink_names_the_symlink(root: Path) -> None:
    """/etc/asr/usb, root's symlink to /mnt/usb, where asr may mount a USB stick: the
    refusal names the mount point and the symlink that led there."""
    fstab(root, "/mnt/usb")
    put(root, "/mnt/usb/job.env")
    link(root, "/etc/asr/usb", "/mnt/usb")
    assert EnvFileChecker(root).refusal("x.service", "/etc/asr/usb/job.env") == Refusal(
        f"/etc/asr/usb/job.env: /mnt/usb, reached through the symlink /etc/asr/usb, {USERS_MOUNT}",
        FIX_TREE,
    )


def test_an_fstab_mount_point_named_with_a_trailing_slash_is_no_directory_of_itself(
    root: Path,
) -> None:
    """LD_LIBRARY_PATH=/mnt/usb/, where asr may mount a USB stick: the directory named is
    the mount point itself, named so (not "its directory /mnt/usb")."""
    fstab(root, "/mnt/usb")
    (root / "mnt/usb").mkdir(parents=True)
    install(root, "x.service", "User=asr", "Environment=LD_LIBRARY_PATH=/mnt/usb/")
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] Environment: LD_LIBRARY_PATH=/mnt/usb/: /mnt/usb/: "
        f"/mnt/usb {USERS_MOUNT}; {GATE} x.service {FIX_LOADER}"
    ]


def roots_fuse(
    root: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """root's sshfs on /srv/nas under root, allow_other without default_permissions."""
    mount_table(
        tmp_path_factory,
        monkeypatch,
        b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        + f"60 22 0:60 / {root}/srv/nas rw - fuse.sshfs h:/ "
        "rw,user_id=0,group_id=0,allow_other\n".encode(),
    )


def test_a_roots_fuse_file_system_reached_through_a_symlink_names_the_symlink(
    root: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/etc/asr/nas, root's symlink to /srv/nas, root's sshfs that any user writes as its
    remote user: the refusal names the mount point and the symlink that led there."""
    put(root, "/srv/nas/job.env")
    link(root, "/etc/asr/nas", "/srv/nas")
    roots_fuse(root, tmp_path_factory, monkeypatch)
    assert EnvFileChecker(root).refusal("x.service", "/etc/asr/nas/job.env") == Refusal(
        f"/etc/asr/nas/job.env: /srv/nas, reached through the symlink /etc/asr/nas, {ROOTS_FUSE}",
        FIX_OWNERS,
    )


def test_a_roots_fuse_file_system_named_with_a_trailing_slash_is_no_directory_of_itself(
    root: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LD_LIBRARY_PATH=/srv/nas/, root's sshfs mounted allow_other: the directory named is
    the mount itself, named so (not "its directory /srv/nas")."""
    put(root, "/srv/nas/keep")
    roots_fuse(root, tmp_path_factory, monkeypatch)
    install(root, "x.service", "User=asr", "Environment=LD_LIBRARY_PATH=/srv/nas/")
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] Environment: LD_LIBRARY_PATH=/srv/nas/: /srv/nas/: "
        f"/srv/nas {ROOTS_FUSE}; {GATE} x.service {FIX_LOADER}"
    ]


def test_a_roots_fuse_mount_with_an_empty_or_dash_source_is_found() -> None:
    """fsname= empty (the kernel writes it between two spaces: `fuse.x  rw,..`) or `-` (the
    separator's own word, after it): the options are still the third field after the
    first ` - `."""
    table = (
        b"60 22 0:60 / /r/a rw - fuse.x  rw,user_id=0,group_id=0,allow_other\n"
        b"61 22 0:61 / /r/b rw - fuse.sshfs - rw,user_id=0,group_id=0,allow_other\n"
    )
    found = envsafety._unchecked_mounts(table, "/r")
    assert found == {"/a": ROOTS_FUSE[3:], "/b": ROOTS_FUSE[3:]}


def test_a_unit_run_as_root_is_refused_for_what_skips_the_gate_after_a_loader_variable(
    root: Path,
) -> None:
    """A unit run as root: its loader variables, and a value not worked out, are its own
    business, and the variables after them are still looked at (SHELLOPTS=onecmd skips the
    gate)."""
    install(root, "x.service", "Environment=LD_LIBRARY_PATH=/home/asr/lib LD_DEBUG=%h")
    put(
        root,
        f"{ETC}/x.service.d/skip.conf",
        "[Service]\nEnvironment=LD_PRELOAD=/home/asr/x.so SHELLOPTS=onecmd\n",
    )
    assert errors(root, "x.service") == [
        f"{ETC}/x.service.d/skip.conf:2: [Service] Environment: SHELLOPTS=onecmd: a /bin/sh "
        "that is bash reads the gate without running it (noexec), or runs its first command "
        "alone (onecmd), and exits 0, so gpuslice's gate would let the start through without "
        f"asking for its GPUs; {GATE} x.service until its environment does not set it so"
    ]
