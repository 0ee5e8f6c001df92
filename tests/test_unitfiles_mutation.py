"""Edges of the unit-file model that mutation testing found open: which names are aliases of a
unit (systemd 252's unit_file_build_name_map and unit_validate_alias_symlink_and_warn), which
drop-in directories a unit reads, and which instances read a directory named for an instance.

Each test pins what the scan sees: a unit's names, its drop-in directories, the instances it
scans on their own, the name `gpuslice enroll` writes under.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpuslice.annotations import scan
from gpuslice.unitfiles import UnitIndex, _dash_prefixes
from tests.test_unitfiles import ETC, LIB, RUN, link, write


def mkdir(root: Path, path: str) -> None:
    (root / path.lstrip("/")).mkdir(parents=True, exist_ok=True)


def dirs_of(root: Path, name: str) -> list[str]:
    return [path for path, _real in UnitIndex(root).dropin_dirs(name)]


class _BoundedStr(str):
    """A stem whose rfind fails past a bound: a search that never moves left ends the test
    instead of filling memory."""

    calls = 0

    def rfind(self, *args: object) -> int:
        type(self).calls += 1
        if type(self).calls > 50:
            raise AssertionError("rfind called without end: the search does not move left")
        return super().rfind(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stem", "prefixes"),
    [
        ("foo-bar-baz", ["foo-bar-", "foo-"]),
        ("a-b", ["a-"]),
        ("-a-b", ["-a-"]),  # a leading dash gives no prefix of its own
        ("foo-", []),  # its trailing dash is chopped once
        ("foo--bar", ["foo--", "foo-"]),
        ("plain", []),
    ],
)
def test_dash_prefixes_end_and_walk_left(stem: str, prefixes: list[str]) -> None:
    _BoundedStr.calls = 0
    assert _dash_prefixes(_BoundedStr(stem)) == prefixes


# ---------------------------------------------------------------------------------------------
# aliases: systemd refuses a link between names of different kinds or types


@pytest.mark.parametrize(
    ("alias", "target", "unit"),
    [
        # a plain name to an instance: "symlink target name type does not match source"
        ("a.service", f"{LIB}/t@x.service", "t@x.service"),
        # a template to an instance: the same
        ("a@.service", f"{LIB}/t@x.service", "t@x.service"),
        # a socket to a service: "incompatible suffix"
        ("a.socket", f"{LIB}/b.service", "b.service"),
    ],
)
def test_a_link_between_names_systemd_refuses_adds_no_dropin_dirs(
    tmp_path: Path, alias: str, target: str, unit: str
) -> None:
    write(tmp_path, f"{LIB}/t@x.service")
    write(tmp_path, f"{LIB}/b.service")
    link(tmp_path, f"{ETC}/{alias}", target)
    mkdir(tmp_path, f"{ETC}/{alias}.d")
    index = UnitIndex(tmp_path)
    assert index.names_of(unit) == [unit]
    assert index.dropin_dirs(unit) == []


def test_a_link_with_an_invalid_name_is_no_alias(tmp_path: Path) -> None:
    """systemd skips a name that is not a valid unit name: `b!.service.d` is no directory of
    a.service's."""
    write(tmp_path, f"{LIB}/a.service")
    link(tmp_path, f"{ETC}/b!.service", f"{LIB}/a.service")
    mkdir(tmp_path, f"{ETC}/b!.service.d")
    index = UnitIndex(tmp_path)
    assert index.names_of("a.service") == ["a.service"]
    assert index.dropin_dirs("a.service") == []


def test_a_link_to_an_invalid_name_leaves_the_name_as_it_is(tmp_path: Path) -> None:
    """`gpuslice enroll a.service` must not write under a name that is no unit name."""
    write(tmp_path, f"{LIB}/b!d.service")
    link(tmp_path, f"{ETC}/a.service", f"{LIB}/b!d.service")
    assert UnitIndex(tmp_path).primary_name("a.service") == "a.service"


def test_an_alias_in_a_lower_directory_is_found(tmp_path: Path) -> None:
    """The first directory that names the link decides, however many come before it without
    that name."""
    write(tmp_path, f"{LIB}/a.service")
    write(tmp_path, f"{ETC}/other.service")  # /etc exists, without b.service
    link(tmp_path, f"{RUN}/b.service", f"{LIB}/a.service")
    mkdir(tmp_path, f"{ETC}/b.service.d")
    index = UnitIndex(tmp_path)
    assert index.primary_name("b.service") == "a.service"
    assert index.names_of("a.service") == ["a.service", "b.service"]
    assert dirs_of(tmp_path, "a.service") == [f"{ETC}/b.service.d"]


def test_every_alias_of_a_directory_is_found_whatever_else_it_holds(tmp_path: Path) -> None:
    """Links with invalid names, met in any order among the aliases, hide none of them."""
    write(tmp_path, f"{LIB}/a.service")
    aliases = [f"alias{i}.service" for i in range(10)]
    for i in range(10):
        link(tmp_path, f"{ETC}/bad!{i}.service", f"{LIB}/a.service")
        link(tmp_path, f"{ETC}/{aliases[i]}", f"{LIB}/a.service")
    assert UnitIndex(tmp_path).names_of("a.service") == ["a.service", *sorted(aliases)]


# ---------------------------------------------------------------------------------------------
# instances whose instance part holds an `@`: `x@a@b.service` is an instance `a@b` of `x@.service`


def test_an_aliased_templates_instance_keeps_its_whole_instance(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/t@.service")
    link(tmp_path, f"{ETC}/u@.service", f"{LIB}/t@.service")
    mkdir(tmp_path, f"{ETC}/u@x@y.service.d")
    index = UnitIndex(tmp_path)
    assert index.primary_name("u@x@y.service") == "t@x@y.service"
    assert index.names_of("t@x@y.service") == ["t@x@y.service", "u@x@y.service"]
    assert dirs_of(tmp_path, "t@x@y.service") == [f"{ETC}/u@x@y.service.d"]


def test_a_prefix_dir_of_an_instance_with_an_at_names_the_whole_instance(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/foo-bar@.service")
    mkdir(tmp_path, f"{ETC}/foo-@a@b.service.d")
    assert UnitIndex(tmp_path).instance_dropin_names() == [
        "foo-@a@b.service",
        "foo-bar@a@b.service",
    ]


# ---------------------------------------------------------------------------------------------
# instance drop-in directories


def test_an_instance_dir_without_a_template_is_listed_under_its_own_name(tmp_path: Path) -> None:
    mkdir(tmp_path, f"{ETC}/lonely@a.service.d")
    write(tmp_path, f"{LIB}/other@.service")
    assert UnitIndex(tmp_path).instance_dropin_names() == ["lonely@a.service"]


def test_only_template_files_and_links_read_a_prefix_dir_for_their_instances(
    tmp_path: Path,
) -> None:
    """An instance file (`foo-bar@x.service`) has no other instances, and a directory named
    like a template is no unit: neither makes `foo-...@a.service` read `foo-@a.service.d`."""
    write(tmp_path, f"{LIB}/foo-bar@x.service")
    mkdir(tmp_path, f"{LIB}/foo-baz@.service")
    mkdir(tmp_path, f"{ETC}/foo-@a.service.d")
    assert UnitIndex(tmp_path).instance_dropin_names() == ["foo-@a.service"]


@pytest.mark.parametrize("target", [f"{LIB}/a.service", f"{LIB}/b@x.service"])
def test_a_template_linked_to_another_kind_of_name_reads_nothing_for_its_instances(
    tmp_path: Path, target: str
) -> None:
    """`t@.service -> a.service` is no alias (systemd refuses the link): the instances of
    `t@` are no one's, and the scan goes on. It raised ValueError ("substring not found")
    on the plain name, and took `b@y.service` for a reader of `t@y.service.d`."""
    write(tmp_path, f"{LIB}/a.service", "[Service]\nExecStart=/bin/a\n[X-GPUSlice]\nPriority=1\n")
    write(tmp_path, f"{LIB}/b@x.service")
    write(tmp_path, f"{LIB}/b@.service")
    link(tmp_path, f"{ETC}/t@.service", target)
    write(tmp_path, f"{ETC}/t@y.service.d/gpus.conf", "[X-GPUSlice]\nGPUs=2\n")
    assert UnitIndex(tmp_path).instance_dropin_names() == ["t@y.service"]
    result = scan(tmp_path)
    assert sorted(result.specs) == ["a.service"]


def test_a_dash_prefix_shared_by_two_aliases_is_listed_once(tmp_path: Path) -> None:
    """A name met again adds nothing: `web-.service.d` is read once for real.service, though
    both its aliases `web-front` and `web-back` have it."""
    write(tmp_path, f"{LIB}/real.service")
    link(tmp_path, f"{ETC}/web-front.service", f"{LIB}/real.service")
    link(tmp_path, f"{ETC}/web-back.service", f"{LIB}/real.service")
    mkdir(tmp_path, f"{ETC}/web-.service.d")
    mkdir(tmp_path, f"{LIB}/web-.service.d")
    assert dirs_of(tmp_path, "real.service") == [f"{ETC}/web-.service.d", f"{LIB}/web-.service.d"]


# ---------------------------------------------------------------------------------------------
# what a drop-in directory's entries cost


def test_a_plain_drop_in_is_not_stat_ed_only_a_linked_or_masked_one_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory listing says a plain file is one: only a symlink's target is stat()ed (a
    regular file, or a device such as /dev/null: masked), not a mask's /dev/null either. At
    10,000 units, a stat per plain drop-in is a syscall per file the scan has no use for."""
    write(tmp_path, f"{LIB}/a.service")
    write(tmp_path, f"{ETC}/a.service.d/10-plain.conf")
    write(tmp_path, "/opt/20-target.conf")
    link(tmp_path, f"{ETC}/a.service.d/20-linked.conf", "/opt/20-target.conf")
    link(tmp_path, f"{ETC}/a.service.d/30-masked.conf", "/dev/null")
    statted: list[str] = []
    real_stat = os.stat

    def counting_stat(path: Any, **kwargs: Any) -> os.stat_result:
        statted.append(os.fspath(path))
        return real_stat(path, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(os, "stat", counting_stat)
        dropins = UnitIndex(tmp_path).dropins("a.service")
    assert [d.path for d in dropins] == [
        f"{ETC}/a.service.d/10-plain.conf",
        f"{ETC}/a.service.d/20-linked.conf",
    ]
    assert [p for p in statted if p.endswith((".conf", "/dev/null"))] == [
        str(tmp_path / "opt/20-target.conf")
    ]
