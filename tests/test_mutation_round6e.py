"""gpuslice/envsafety.py's check of a directory a file is named in by its own name alone
(`_names_in`, `_entries_of`): which directory that is, which of its entries are looked at,
and a listing that fails or is too long a refusal, never an exception."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gpuslice import envsafety
from gpuslice.envsafety import EnvFileChecker
from tests.test_envsafety import ASR, errors, install, put
from tests.test_envsafety import root as root  # a fixture
from tests.test_envsafety_mutation import fresh_covered as fresh_covered  # autouse

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")

DEPENDS = "EnvironmentFile: /etc/job/%i.conf cannot be checked: %i depends"


def test_a_directory_not_there_or_no_directory_names_nothing(root: Path) -> None:
    """A file's directory that is not there (only root can make it) or is a file of
    root's holds nothing a user could have put there: managed."""
    put(root, "/etc/plain")
    install(root, "gone@.service", "EnvironmentFile=/etc/gone/%i.conf")
    install(root, "plain@.service", "EnvironmentFile=/etc/plain/%i.conf")
    assert errors(root, "gone@.service") == []
    assert errors(root, "plain@.service") == []


def test_each_entry_after_a_directory_is_looked_at(root: Path) -> None:
    """A directory in it is passed over, not the entries after it: a user's file sorted
    after one is refused."""
    (root / "etc/job/a").mkdir(parents=True, mode=0o755)
    put(root, "/etc/job/b.conf", uid=ASR)
    install(root, "theirs@.service", "EnvironmentFile=/etc/job/%i.conf")
    [error] = errors(root, "theirs@.service")
    assert DEPENDS in error


def test_an_entry_of_any_kind_of_roots_is_no_refusal(root: Path) -> None:
    """A FIFO or a symlink to a directory of root's right in it cannot be read by systemd
    as an environment file, and only root can change it: managed."""
    put(root, "/etc/job/a.conf")
    os.mkfifo(root / "etc/job/fifo")
    (root / "etc/job/dir").symlink_to("/etc")
    install(root, "fine@.service", "EnvironmentFile=/etc/job/%i.conf")
    assert errors(root, "fine@.service") == []


@pytest.mark.parametrize("end", [" ", "X", "/X"])
def test_the_entries_are_those_of_the_directory_as_named(root: Path, end: str) -> None:
    """A directory whose name ends in a space or an `X` is itself, not the one its name
    without that end names: a user's file in it is refused, though the other is root's."""
    name = f"/etc/job{end}"
    put(root, "/etc/job/a.conf")
    put(root, f"{name}/theirs.conf", uid=ASR)
    install(root, "theirs@.service", f"EnvironmentFile={name}/%i.conf")
    assert len(errors(root, "theirs@.service")) == 1


def test_a_file_right_in_slash_is_judged_by_slashs_own_entries(root: Path) -> None:
    """/%i.conf names an entry of / alone: a user's file deeper down leaves it managed."""
    put(root, "/srv/asr/deep/x.conf", uid=ASR)
    os.chown(root / "srv/asr", ASR, ASR)
    install(root, "top@.service", "EnvironmentFile=/%i.conf")
    assert errors(root, "top@.service") == []


def test_a_directory_of_exactly_max_tree_entries_is_listed(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`MAX_TREE` entries are checked; one more is a refusal, not an exception."""
    monkeypatch.setattr(envsafety, "MAX_TREE", 3)
    for n in range(3):
        put(root, f"/etc/job/{n}.conf")
    install(root, "fine@.service", "EnvironmentFile=/etc/job/%i.conf")
    assert errors(root, "fine@.service") == []
    put(root, "/etc/job/3.conf")
    [error] = errors(root, "fine@.service")
    assert DEPENDS in error


@pytest.mark.parametrize(
    "answer", [OSError(errno.EIO, "Input/output error"), envsafety._Unanswered("/etc")]
)
def test_a_listing_that_fails_is_a_refusal_not_an_exception(
    root: Path, monkeypatch: pytest.MonkeyPatch, answer: object
) -> None:
    """A directory that cannot be listed, or does not answer, is refused as the template's
    own refusal says, not as an exception raised checking it."""
    put(root, "/etc/job/a.conf")
    install(root, "r@.service", "EnvironmentFile=/etc/job/%i.conf")
    real = EnvFileChecker._listdir

    def listdir(self: EnvFileChecker, path: str) -> object:
        return answer if path.endswith("/etc/job") else real(self, path)

    monkeypatch.setattr(EnvFileChecker, "_listdir", listdir)
    [error] = errors(root, "r@.service")
    assert DEPENDS in error
