"""The version lives in pyproject.toml; debian/changelog and gpuslice.__version__ must agree."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import gpuslice

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert isinstance(version, str)
    return version


def _changelog_version() -> str:
    first = (ROOT / "debian" / "changelog").read_text().splitlines()[0]
    match = re.match(r"^gpuslice \(([^)]+)\) ", first)
    assert match, f"debian/changelog:1: expected `gpuslice (VERSION) ...`, got {first!r}"
    return match[1]


def test_package_version_matches_pyproject() -> None:
    assert gpuslice.__version__ == _pyproject_version()


def test_debian_changelog_matches_pyproject() -> None:
    # A native package: no Debian revision, so the versions are equal, not just the upstream part.
    assert _changelog_version() == _pyproject_version()
