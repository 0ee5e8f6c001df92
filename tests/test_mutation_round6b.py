"""gpuslice/envsafety.py's fstab user mount points at their edges (a line's first field
after blanks alone, an `x-` option, a file of exactly MAX_ENV_FILE bytes), the refusals of
an fstab not read (not answering, not readable) or of a user mount point through a symlink
at their exact words and fixes, a point leading into a user tree, and a root template's
EnvironmentFile= by its instance (optional, relative, cut at 200 characters, a specifier
of root's own, a NUL)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice import envsafety
from gpuslice.envsafety import (
    FIX_ANSWER,
    FIX_FSTAB,
    FIX_INSTANCE,
    FIX_USER_POINT,
    Assignment,
    EnvFileChecker,
    Refusal,
    RunAs,
)
from tests.test_envsafety import ASR, ETC, GATE, Hang, errors, install, put
from tests.test_envsafety import root as root  # a fixture
from tests.test_envsafety_mutation import fresh_covered as fresh_covered  # autouse
from tests.test_envsafety_mutation import hang as hang  # a fixture
from tests.test_unitfiles import link

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")

LEADS = "where a symlink someone but root may put on its way leads as they mount"


def test_an_fstab_lines_first_field_is_a_comment_only_after_spaces_and_tabs() -> None:
    """libmount skips spaces and tabs alone before a line's `#`: a form feed, or any other
    character (`X`), before it makes the line an entry, its point a user mount point (taken
    for a comment, it was none)."""
    text = b"\x0c#/dev/sdy /mnt/c auto user 0 0\nX#/dev/sdz /mnt/d auto user 0 0\n"
    assert envsafety._fstab_points(text) == {"/mnt/c", "/mnt/d"}


def test_an_fstab_option_ending_in_a_user_option_clears_nothing() -> None:
    """Only `no` before user, users, owner or group clears it: `x-user` (a userspace
    option) leaves `user` a user mount."""
    assert envsafety._fstab_points(b"/dev/sda /mnt/a auto user,x-user 0 0\n") == {"/mnt/a"}


def test_an_fstab_of_exactly_max_env_file_bytes_is_read_whole(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MAX_ENV_FILE bytes is read whole: its user mount point is found, not every walk
    refused as for a larger file."""
    monkeypatch.setattr(envsafety, "MAX_ENV_FILE", 100)
    entry = "/dev/sdb1 /mnt/usb auto noauto,user 0 0\n"
    put(root, "/etc/fstab", "#" * (99 - len(entry)) + "\n" + entry)
    assert (root / "etc/fstab").stat().st_size == 100
    put(root, "/mnt/usb/job.env")
    put(root, "/etc/job/job.env")
    checker = EnvFileChecker(root)
    assert checker.refusal("x.service", "/etc/job/job.env") is None
    refusal = checker.refusal("x.service", "/mnt/usb/job.env")
    assert refusal is not None
    assert "/mnt/usb is where /etc/fstab lets users mount" in refusal.reason


def test_an_fstab_that_cannot_be_read_refuses_every_walk_in_exact_words(root: Path) -> None:
    put(root, "/etc/job/job.env")
    (root / "etc/fstab").mkdir()
    assert EnvFileChecker(root).refusal("x.service", "/etc/job/job.env") == Refusal(
        "/etc/job/job.env cannot be checked: /etc/fstab cannot be read: not a regular file",
        FIX_FSTAB,
    )


def test_an_fstab_that_does_not_answer_refuses_every_walk_in_exact_words(
    root: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/etc on a network file system that does not answer as /etc/fstab is read: where users
    may mount is not known, every walk is refused until it answers."""
    put(root, "/etc/fstab", "")
    put(root, "/etc/job/job.env")
    hang.mounts("/etc")
    fstab = str(root / "etc/fstab")
    read_head: Callable[[str], bytes] = envsafety._read_head

    def stuck(path: str) -> bytes:
        if path == fstab:
            hang.block()
        return read_head(path)

    monkeypatch.setattr(envsafety, "_read_head", stuck)
    checker = EnvFileChecker(root)
    for path in ("/etc/job/job.env", "/srv/x.env"):
        assert checker.refusal("x.service", path) == Refusal(
            f"{path} cannot be checked: /etc did not answer within 1 s as /etc/fstab was read "
            "(a network file system not answering?)",
            FIX_ANSWER,
        )


def test_a_user_mount_points_directory_that_does_not_answer_waits_for_it(
    root: Path, hang: Hang
) -> None:
    """/srv/nas/usb, a user mount point whose directory, on a network file system, does not
    answer: every walk is refused until it answers (the fix says so), not until the point
    is moved."""
    put(root, "/etc/fstab", "/dev/sdb1 /srv/nas/usb auto noauto,user 0 0\n")
    put(root, "/etc/job/job.env")
    (root / "srv/nas").mkdir(parents=True)
    hang.mounts("/srv/nas")
    hang.at = ("/srv/nas",)
    refusal = EnvFileChecker(root).refusal("x.service", "/etc/job/job.env")
    assert refusal == Refusal(
        "/etc/job/job.env cannot be checked: /etc/fstab lets users mount on /srv/nas/usb, "
        f"{LEADS}: /srv/nas cannot be checked: /srv/nas did not answer within 1 s (a network "
        "file system not answering?)",
        FIX_ANSWER,
    )


def test_a_user_mount_point_landing_under_another_names_where_it_lands(root: Path) -> None:
    """/srv/a/usb, whose directory /srv/a is root's symlink to /data, another user mount
    point: the stick lands on /data/usb, on whatever asr mounted on /data. The refusal names
    where it lands and the point above it."""
    put(root, "/etc/fstab", "/dev/sdb1 /data auto user 0 0\n/dev/sdc1 /srv/a/usb auto user 0 0\n")
    put(root, "/etc/job/job.env")
    (root / "data/usb").mkdir(parents=True)
    link(root, "/srv/a", "/data")
    assert EnvFileChecker(root).refusal("x.service", "/etc/job/job.env") == Refusal(
        "/etc/job/job.env cannot be checked: /etc/fstab lets users mount on /srv/a/usb, "
        f"{LEADS}: /data/usb: its directory /data is where /etc/fstab lets users mount a file "
        "system of theirs",
        FIX_USER_POINT,
    )


def test_a_user_mount_point_whose_symlink_leads_into_a_user_tree_is_walked_there(
    root: Path,
) -> None:
    """/cdrom, root's symlink to /media/cdrom0 (root's): mount(8) lands there, a directory
    root's alone; the point changes nothing else (its target not refused as in /media)."""
    put(root, "/etc/fstab", "/dev/sr0 /cdrom udf,iso9660 user,noauto 0 0\n")
    put(root, "/etc/job/job.env")
    (root / "media/cdrom0").mkdir(parents=True)
    link(root, "/cdrom", "/media/cdrom0")
    assert EnvFileChecker(root).refusal("x.service", "/etc/job/job.env") is None


def test_a_root_templates_optional_environment_file_by_its_instance_is_refused(
    root: Path,
) -> None:
    """`-` (optional) before the path changes nothing: %i may be `..`, and the path leads out
    of /etc/job."""
    put(root, "/etc/job/a.env")
    install(root, "opt@.service", "EnvironmentFile=-/etc/job/%i/x.env")
    assert errors(root, "opt@.service") == [
        f"{ETC}/opt@.service:4: [Service] EnvironmentFile: -/etc/job/%i/x.env cannot be "
        "checked: %i is the instance's name, which whoever starts an instance of opt@.service "
        "chooses: it may be `.` or `..` (opt@...service), and the path then leads out of "
        f"/etc/job; {GATE} opt@.service {FIX_INSTANCE}"
    ]


def test_a_root_templates_long_environment_file_is_cut_at_200_characters(root: Path) -> None:
    directory = "/etc/" + "x" * 250
    install(root, "long@.service", f"EnvironmentFile={directory}/%I.env")
    [error] = errors(root, "long@.service")
    cut = f"{directory}/%I.env"[:200] + "..."
    assert error.startswith(
        f"{ETC}/long@.service:4: [Service] EnvironmentFile: {cut} cannot be checked: %I is "
    ), error


def test_a_root_templates_relative_or_root_own_environment_file_is_not_said(
    root: Path,
) -> None:
    """A relative path by the instance (systemd refuses it) and a root's own specifier (%h)
    are the unit's own business, as before, whatever is under / (asr's /srv/asr)."""
    (root / "srv/asr").mkdir(parents=True)
    os.chown(root / "srv/asr", ASR, ASR)
    install(root, "rel@.service", "EnvironmentFile=%i.env")
    install(root, "home@.service", "EnvironmentFile=%h/job.env")
    assert errors(root, "rel@.service") == []
    assert errors(root, "home@.service") == []


def test_a_root_templates_environment_file_holding_a_nul_is_not_taken_for_its_instance(
    root: Path,
) -> None:
    """The instance's name stands as a NUL while the path is worked out: a value's own NUL
    (none from a unit file) is no instance that may be `..`."""
    run_as = RunAs(env_files=[Assignment(f"{ETC}/x@.service", 4, "/srv/\0/%i.env")])
    assert EnvFileChecker(root).check("x@.service", run_as) == []
