"""The lists of modules agree with the tree: a module left out of the mutation run's lists is
never mutated, and nobody notices (remains.py was in only_mutate and in no MUTATE_* list of
the Makefile for a session); one left out of DEVELOPERS.md's module map is found by no reader
(clock.py, notify.py and paths.py were)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# no code to mutate: package markers, and the paths every module imports
NOT_MUTATED = {"gpuslice/__init__.py", "gpuslice/core/__init__.py", "gpuslice/paths.py"}


def _mutmut() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["mutmut"]  # type: ignore[no-any-return]


def _makefile_selection() -> str:
    """The Makefile's MUTATE_core/adapters/controller/outer lists, joined."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    found = re.findall(r"^MUTATE_(?:core|adapters|controller|outer) :=(.*)$", text, re.M)
    assert len(found) == 4, found
    return " ".join(found)


def test_every_module_is_in_only_mutate() -> None:
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "gpuslice").rglob("*.py")}
    assert modules - NOT_MUTATED - set(_mutmut()["only_mutate"]) == set()


def test_every_mutated_module_is_in_a_makefile_selection() -> None:
    selection = _makefile_selection().split()
    missing = []
    for path in _mutmut()["only_mutate"]:
        module = path.removesuffix(".py").replace("/", ".")
        if not any(name.startswith(module + ".") for name in selection):
            missing.append(path)
    assert missing == []


def test_every_fast_test_file_is_in_the_mutation_selection() -> None:
    """Each test file either kills mutants (in the selection) or is slow or about something
    mutmut does not mutate (the bench, the package's scripts, the fuzzers)."""
    selection = set(_mutmut()["pytest_add_cli_args_test_selection"])
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py")}
    unselected = {
        f for f in files - selection if not re.match(r"tests/test_(bench_|fuzz_|debian_)", f)
    }
    assert unselected == {
        "tests/test_dashboard.py",
        "tests/test_fake_checkpoint.py",
        "tests/test_gate_removed.py",
        "tests/test_mutation_lists.py",
        "tests/test_own_host.py",
        "tests/test_readme_numbers.py",
        "tests/test_units.py",
        "tests/test_user_generator.py",
        "tests/test_version.py",
    }


def test_every_module_is_in_the_developers_module_map() -> None:
    text = (ROOT / "DEVELOPERS.md").read_text()
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "gpuslice").rglob("*.py")}
    packages = {m for m in modules if m.endswith("__init__.py")}
    assert sorted(m for m in modules - packages if f"| `{m}` |" not in text) == []
