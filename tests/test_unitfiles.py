"""Unit search path, fragments, drop-ins in systemd's order, and the unit-file text reader."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpuslice.annotations import scan
from gpuslice.unitfiles import (
    MAX_FILE_SIZE,
    SYSTEM_UNIT_PATH,
    Entry,
    TextIssue,
    UnitFile,
    UnitIndex,
    find_dropins,
    find_fragment,
    is_instance,
    is_template,
    list_unit_names,
    parse_sections,
    template_of,
)

ETC = "/etc/systemd/system"
RUN = "/run/systemd/system"
LIB = "/usr/lib/systemd/system"
GEN = "/run/systemd/generator"


def write(root: Path, path: str, text: str = "[Unit]\n") -> Path:
    real = root / path.lstrip("/")
    real.parent.mkdir(parents=True, exist_ok=True)
    real.write_text(text)
    return real


def link(root: Path, path: str, target: str) -> None:
    real = root / path.lstrip("/")
    real.parent.mkdir(parents=True, exist_ok=True)
    real.symlink_to(target)


# ---------------------------------------------------------------------------------------------
# the text reader


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("[A]\nk=v\n", [Entry("A", "k", "v", 2)], id="simple"),
        pytest.param(
            "[Service]\nExecStart=/bin/a\nExecStart=/bin/b\n",
            [
                Entry("Service", "ExecStart", "/bin/a", 2),
                Entry("Service", "ExecStart", "/bin/b", 3),
            ],
            id="repeated-keys",
        ),
        pytest.param(
            "[S]\n  Key =  spaced value  \n", [Entry("S", "Key", "spaced value", 2)], id="strip"
        ),
        pytest.param(
            "# c\n; c\n[S]\n  # indented comment\nk=v # not a comment\n",
            [Entry("S", "k", "v # not a comment", 5)],
            id="comments",
        ),
        pytest.param(
            "[S]\nExecStart=/bin/echo \\\n  a \\\n  b\nNext=1\n",
            [Entry("S", "ExecStart", "/bin/echo    a    b", 2), Entry("S", "Next", "1", 5)],
            id="continuation",
        ),
        pytest.param(
            "[S]\nk=a \\\n# comment inside continuation\n b\n",
            [Entry("S", "k", "a   b", 2)],
            id="comment-inside-continuation",
        ),
        pytest.param(
            "[S]\nk=ends in backslash\\\\\nj=2\n",
            [Entry("S", "k", "ends in backslash\\\\", 2), Entry("S", "j", "2", 3)],
            id="escaped-backslash-is-no-continuation",
        ),
        pytest.param(
            "[S]\nExecStart=/bin/sh -c \"echo '%n' ; exit 0\"\n",
            [Entry("S", "ExecStart", "/bin/sh -c \"echo '%n' ; exit 0\"", 2)],
            id="quotes-and-specifiers-verbatim",
        ),
        pytest.param("[S]\nk=a=b\n", [Entry("S", "k", "a=b", 2)], id="equals-in-value"),
        pytest.param("[S]\nk=\n", [Entry("S", "k", "", 2)], id="empty-value"),
        pytest.param("\ufeff[S]\nk=v\n", [Entry("S", "k", "v", 2)], id="bom"),
        pytest.param(
            "[A]\nk=1\n[B]\nk=2\n",
            [Entry("A", "k", "1", 2), Entry("B", "k", "2", 4)],
            id="sections",
        ),
        pytest.param("[S]\nk=last \\", [Entry("S", "k", "last", 2)], id="continuation-at-eof"),
    ],
)
def test_parse_sections(text: str, expected: list[Entry]) -> None:
    assert parse_sections(text) == expected


def test_parse_sections_reports_ignored_lines() -> None:
    issues: list[TextIssue] = []
    entries = parse_sections("k=outside\n[S]\nnoequals\n=novalue\n[]\nx=1\n", issues)
    assert entries == []
    assert issues == [
        TextIssue(None, 1, "assignment outside of any section, ignored"),
        TextIssue("S", 3, "missing '=', line ignored"),
        TextIssue("S", 4, "missing key before '=', line ignored"),
        TextIssue("S", 5, "invalid section header '[]'"),
        TextIssue(None, 6, "assignment outside of any section, ignored"),
    ]


@pytest.mark.parametrize("bad", ["[broken", "[", "[S]x", "k=caf\udce9"])
def test_parse_sections_stops_where_systemd_stops(bad: str) -> None:
    """systemd 252's config_parse fails at a section header without its `]` or a line that is
    not UTF-8 and reads no further: a drop-in's later lines never apply (its ExecStartPre=
    lines, copied into the gate, would run), a fragment fails to load."""
    issues: list[TextIssue] = []
    text = f"[S]\nk=1\n{bad}\n[S]\nExecStartPre=/bin/never\n"
    assert parse_sections(text, issues) == [Entry("S", "k", "1", 2)]
    assert [i.line for i in issues] == [3]
    assert issues[0].message.endswith(": systemd ignores the rest of the file")


# ---------------------------------------------------------------------------------------------
# names


@pytest.mark.parametrize(
    ("name", "template", "instance", "tmpl"),
    [
        ("foo.service", False, False, "foo.service"),
        ("foo@.service", True, False, "foo@.service"),
        ("foo@a.service", False, True, "foo@.service"),
        ("foo\\x2dbar@a\\x2db.service", False, True, "foo\\x2dbar@.service"),
        ("foo@a.b.service", False, True, "foo@.service"),
        ("x@.y.service", False, True, "x@.service"),  # an instance starting with a dot
        ("foo@.b@.service", False, True, "foo@.service"),
    ],
)
def test_names(name: str, template: bool, instance: bool, tmpl: str) -> None:
    assert is_template(name) is template
    assert is_instance(name) is instance
    assert template_of(name) == tmpl


def test_search_path_is_systemd_252s() -> None:
    # `systemd-analyze unit-paths` of systemd 252 (Debian 12)
    assert SYSTEM_UNIT_PATH == (
        "/etc/systemd/system.control",
        "/run/systemd/system.control",
        "/run/systemd/transient",
        "/run/systemd/generator.early",
        "/etc/systemd/system",
        "/etc/systemd/system.attached",
        "/run/systemd/system",
        "/run/systemd/system.attached",
        "/run/systemd/generator",
        "/usr/local/lib/systemd/system",
        "/lib/systemd/system",
        "/usr/lib/systemd/system",
        "/run/systemd/generator.late",
    )


# ---------------------------------------------------------------------------------------------
# fragments


@pytest.mark.parametrize(
    ("files", "name", "expected"),
    [
        pytest.param([f"{LIB}/a.service"], "a.service", f"{LIB}/a.service", id="vendor"),
        pytest.param(
            [f"{LIB}/a.service", f"{ETC}/a.service"], "a.service", f"{ETC}/a.service", id="etc-wins"
        ),
        pytest.param(
            [f"{ETC}/a.service", "/run/systemd/transient/a.service"],
            "a.service",
            "/run/systemd/transient/a.service",
            id="transient-before-etc",
        ),
        pytest.param([f"{LIB}/t@.service"], "t@x.service", f"{LIB}/t@.service", id="instance"),
        pytest.param(
            [f"{ETC}/t@.service", f"{LIB}/t@x.service"],
            "t@x.service",
            f"{LIB}/t@x.service",
            id="instance-file-beats-template-anywhere",
        ),
        pytest.param([f"{LIB}/t@.service"], "t@.service", f"{LIB}/t@.service", id="template"),
        pytest.param(
            [f"{LIB}/foo\\x2dbar@.service"],
            "foo\\x2dbar@a.service",
            f"{LIB}/foo\\x2dbar@.service",
            id="escaped",
        ),
        pytest.param([f"{LIB}/a.service"], "b.service", None, id="not-found"),
    ],
)
def test_find_fragment(tmp_path: Path, files: list[str], name: str, expected: str | None) -> None:
    for f in files:
        write(tmp_path, f)
    fragment = find_fragment(name, tmp_path)
    assert (fragment.path if fragment else None) == expected
    if fragment:
        assert not fragment.masked
        assert fragment.real == str(tmp_path / expected.lstrip("/"))  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["dev-null", "empty-file"])
def test_masked_fragment(tmp_path: Path, how: str) -> None:
    write(tmp_path, f"{LIB}/a.service")
    if how == "dev-null":
        link(tmp_path, f"{ETC}/a.service", "/dev/null")
    else:
        write(tmp_path, f"{ETC}/a.service", "")
    fragment = find_fragment("a.service", tmp_path)
    assert fragment is not None
    assert fragment.path == f"{ETC}/a.service"
    assert fragment.masked


def test_symlinked_fragment_resolves_inside_root(tmp_path: Path) -> None:
    write(tmp_path, "/opt/app/a.service", "[Unit]\nDescription=x\n")
    link(tmp_path, f"{ETC}/a.service", "/opt/app/a.service")  # absolute: inside the root
    fragment = find_fragment("a.service", tmp_path)
    assert fragment is not None
    assert fragment.path == f"{ETC}/a.service"
    assert fragment.real == str(tmp_path / "opt/app/a.service")
    assert "Description=x" in fragment.read_text()


def test_list_unit_names(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/a.service")
    write(tmp_path, f"{ETC}/a.service")
    write(tmp_path, f"{LIB}/t@.service")
    write(tmp_path, f"{LIB}/t@x.service")
    write(tmp_path, f"{LIB}/foo\\x2dbar.service")
    write(tmp_path, f"{LIB}/b.socket")
    write(tmp_path, f"{LIB}/a.service.d/x.conf")
    (tmp_path / ETC.lstrip("/") / "multi-user.target.wants").mkdir()
    (tmp_path / ETC.lstrip("/") / "dir.service").mkdir()  # a directory is no unit
    link(tmp_path, f"{ETC}/alias.service", f"{LIB}/a.service")
    link(tmp_path, f"{ETC}/masked.service", "/dev/null")
    assert list_unit_names(tmp_path) == [
        "a.service",
        "foo\\x2dbar.service",
        "masked.service",
        "t@.service",
        "t@x.service",
    ]


@pytest.mark.parametrize(
    "target",
    [
        "/opt/vlm/vlm-prod.service",  # absolute
        "../../../opt/vlm/vlm-prod.service",  # relative to the search directory
        "/opt/vlm/link.service",  # a link itself, into the search path: not followed
    ],
)
def test_a_link_out_of_the_search_path_is_the_units_file_under_the_links_name(
    tmp_path: Path, target: str
) -> None:
    # systemd 252 (unit_file_build_name_map): a linked unit file, whatever the target's name
    write(tmp_path, "/opt/vlm/vlm-prod.service", "[Unit]\nDescription=x\n")
    write(tmp_path, f"{LIB}/other.service")
    link(tmp_path, "/opt/vlm/link.service", f"{LIB}/other.service")
    link(tmp_path, f"{ETC}/vlm.service", target)
    index = UnitIndex(tmp_path)
    assert index.unit_names() == ["other.service", "vlm.service"]
    fragment = index.fragment("vlm.service")
    assert fragment is not None
    assert fragment.path == f"{ETC}/vlm.service"


@pytest.mark.parametrize(
    "target",
    [f"{LIB}/a.service", "../../../usr/lib/systemd/system/a.service", "/opt/units/a.service"],
)
def test_a_link_into_the_search_path_is_an_alias(tmp_path: Path, target: str) -> None:
    write(tmp_path, f"{LIB}/a.service")
    link(tmp_path, "/opt/units", LIB)  # a directory link: resolved, as systemd does
    link(tmp_path, f"{ETC}/b.service", target)
    assert UnitIndex(tmp_path).unit_names() == ["a.service"]


def test_a_link_to_a_name_in_its_own_directory_is_an_alias(tmp_path: Path) -> None:
    # `b.service -> a.service`: relative to the link's directory, not to the root
    write(tmp_path, f"{ETC}/a.service")
    link(tmp_path, f"{ETC}/b.service", "a.service")
    assert UnitIndex(tmp_path).unit_names() == ["a.service"]


@pytest.mark.parametrize("between", [True, False])
def test_a_link_to_its_own_name_in_another_directory_is_ignored(
    tmp_path: Path, between: bool
) -> None:
    """/etc's a.service points at /usr/lib's a.service: systemd 252 ignores an alias to its
    own name (unit_validate_alias_symlink_or_warn: -ELOOP), so the next directory's a.service
    is the unit's, /run's when it has one, quietly."""
    write(tmp_path, f"{LIB}/a.service")
    if between:
        write(tmp_path, f"{RUN}/a.service")
    link(tmp_path, f"{ETC}/a.service", f"{LIB}/a.service")
    index = UnitIndex(tmp_path)
    assert index.unit_names() == ["a.service"]
    fragment = index.fragment("a.service")
    assert fragment is not None and fragment.path == f"{RUN if between else LIB}/a.service"
    assert index.issues == []


@pytest.mark.parametrize(
    ("links", "name", "primary"),
    [
        ([("b.service", f"{LIB}/a.service")], "b.service", "a.service"),
        ([("b.service", "a.service")], "b.service", "a.service"),  # in its own directory
        ([("c.service", f"{ETC}/b.service"), ("b.service", "a.service")], "c.service", "a.service"),
        ([("b.service", f"{LIB}/a.service")], "a.service", "a.service"),  # no alias
        ([("b.service", "/opt/a.service")], "b.service", "b.service"),  # a linked unit file
        ([("b.service", f"{LIB}/b.service")], "b.service", "b.service"),  # the same name
        ([("t@x.service", f"{LIB}/t@.service")], "t@x.service", "t@x.service"),  # an instance
        # an instance's alias of another template is that template's instance
        ([("u@x.service", f"{LIB}/t@.service")], "u@x.service", "t@x.service"),
        ([("u@x.service", f"{LIB}/t@x.service")], "u@x.service", "t@x.service"),
        # links systemd refuses as aliases: the name stays its own
        ([("b.service", f"{LIB}/t@.service")], "b.service", "b.service"),
        ([("u@.service", f"{LIB}/a.service")], "u@.service", "u@.service"),
        ([("u@x.service", f"{LIB}/t@y.service")], "u@x.service", "u@x.service"),
        ([("b.service", f"{LIB}/a.socket")], "b.service", "b.service"),
        # a refused link is no file of the instance's own: its template's alias decides
        (
            [("u@.service", f"{LIB}/t@.service"), ("u@x.service", f"{LIB}/t@y.service")],
            "u@x.service",
            "t@x.service",
        ),
        ([("u@.service", f"{LIB}/t@.service")], "u@x.service", "t@x.service"),
        ([("u@.service", f"{LIB}/t@.service")], "u@.service", "t@.service"),
        # an instance with a file of its own is not its template's, nor its template's alias
        (
            [("u@.service", f"{LIB}/t@.service"), ("u@x.service", "/opt/a.service")],
            "u@x.service",
            "u@x.service",
        ),
        ([("x.service", "y.service"), ("y.service", "x.service")], "x.service", "x.service"),
        ([], "none.service", "none.service"),
    ],
)
def test_the_primary_name_follows_aliases_as_systemd_does(
    tmp_path: Path, links: list[tuple[str, str]], name: str, primary: str
) -> None:
    """`gpuslice enroll` annotates a unit under the name systemd loads it by: a drop-in
    directory named for an alias is one the scan of the unit does not read."""
    write(tmp_path, f"{LIB}/a.service")
    write(tmp_path, f"{LIB}/t@.service")
    write(tmp_path, "/opt/a.service")
    for alias, target in links:
        link(tmp_path, f"{ETC}/{alias}", target)
    assert UnitIndex(tmp_path).primary_name(name) == primary


def test_an_alias_hides_its_name_in_lower_directories(tmp_path: Path) -> None:
    # systemd maps each name once, in the first directory that has it: b.service is a.service
    write(tmp_path, f"{LIB}/a.service")
    write(tmp_path, f"{LIB}/b.service")
    link(tmp_path, f"{ETC}/b.service", f"{LIB}/a.service")
    assert UnitIndex(tmp_path).unit_names() == ["a.service"]


@pytest.mark.parametrize(
    ("name", "target", "why"),
    [
        ("t@.service", f"{LIB}/a.service", "a template to a plain name"),
        ("t@.service", f"{LIB}/b@x.service", "a template to an instance"),
        ("p.service", f"{LIB}/b@.service", "a plain name to a template"),
        ("p.service", f"{LIB}/b@x.service", "a plain name to an instance"),
        ("t@x.service", f"{LIB}/a.service", "an instance to a plain name"),
        ("t@y.service", f"{LIB}/b@x.service", "another instance"),
        ("p.service", f"{LIB}/b.socket", "another unit type"),
        ("t@x.service", f"{LIB}/b@x.socket", "another unit type"),
        ("p.service", f"{LIB}/b!.service", "not a valid unit name"),
        ("p.service", "/opt/units/b@.service", "a plain name to a template"),  # via a dir link
    ],
)
def test_a_link_systemd_refuses_as_an_alias_hides_nothing(
    tmp_path: Path, name: str, target: str, why: str
) -> None:
    """systemd 252 ignores a link into the search path that it refuses as an alias
    (unit_validate_alias_symlink_or_warn: another kind of name, another instance, another
    type, no unit name): the name stays unmapped, and the next directory's file of that name
    is the unit's. Taken for an alias, the link hid that file: its unit ran ungated."""
    for unit in ("a.service", "b@.service", "b@x.service", "b.socket", "b@x.socket", "b!.service"):
        write(tmp_path, f"{LIB}/{unit}")
    link(tmp_path, "/opt/units", LIB)
    write(tmp_path, f"{RUN}/{name}")
    link(tmp_path, f"{ETC}/{name}", target)
    write(tmp_path, f"{ETC}/zz.service")  # after the link, in the same directory
    index = UnitIndex(tmp_path)
    assert {name, "zz.service"} <= set(index.unit_names())
    fragment = index.fragment(name)
    assert fragment is not None and fragment.path == f"{RUN}/{name}"
    assert index.primary_name(name) == name
    assert name not in index.names_of(os.path.basename(target))
    assert [i.message for i in index.issues if i.path == f"{ETC}/{name}"] == [
        f"a symlink to {LIB}/{os.path.basename(target)}, which systemd refuses as an alias"
        f" ({why}) and ignores: a lower directory's file of this name is the unit's"
    ]


@pytest.mark.parametrize(
    ("name", "target", "primary"),
    [
        ("u@x.service", f"{LIB}/b@x.service", "b@x.service"),  # one instance, two templates
        ("u@x.service", f"{LIB}/b@.service", "b@x.service"),  # an instance to a template
        ("u@.service", f"{LIB}/b@.service", "b@.service"),
        ("p.service", f"{LIB}/a.service", "a.service"),
        # an instance is all that follows the first `@`, up to the type's dot
        ("u@x@y.service", f"{LIB}/b@x@y.service", "b@x@y.service"),
        ("u@x@y.service", f"{LIB}/b@.service", "b@x@y.service"),
        ("u@x.y.service", f"{LIB}/b@x.y.service", "b@x.y.service"),
        ("u.v@x.service", f"{LIB}/b@x.service", "b@x.service"),
    ],
)
def test_a_link_systemd_takes_as_an_alias_hides_its_name(
    tmp_path: Path, name: str, target: str, primary: str
) -> None:
    for unit in ("a.service", "b@.service", "b@x.service", "b@x@y.service", "b@x.y.service"):
        write(tmp_path, f"{LIB}/{unit}")
    write(tmp_path, f"{RUN}/{name}")
    link(tmp_path, f"{ETC}/{name}", target)
    index = UnitIndex(tmp_path)
    assert name not in index.unit_names()
    assert index.primary_name(name) == primary
    assert index.names_of(primary) == [primary, name]
    assert index.issues == []


def test_an_instances_alias_of_its_own_aliased_template_is_the_aliass_instance(
    tmp_path: Path,
) -> None:
    """`t@x.service -> t@.service` with `t@.service -> b@.service`: systemd follows the names,
    t@.service to b@.service, and loads `b@x.service`."""
    write(tmp_path, f"{LIB}/b@.service")
    write(tmp_path, f"{LIB}/t@.service")
    link(tmp_path, f"{ETC}/t@.service", f"{LIB}/b@.service")
    link(tmp_path, f"{ETC}/t@x.service", f"{LIB}/t@.service")
    assert UnitIndex(tmp_path).primary_name("t@x.service") == "b@x.service"


def test_an_instance_too_long_for_its_aliased_template_keeps_its_name(tmp_path: Path) -> None:
    """`u@<240 x>.service -> a-longer-template@.service`: the instance's name under that
    template would pass 255 characters, no unit name (systemd cannot build it either)."""
    write(tmp_path, f"{LIB}/a-longer-template@.service")
    link(tmp_path, f"{ETC}/u@.service", f"{LIB}/a-longer-template@.service")
    long = f"u@{'x' * 240}.service"
    link(tmp_path, f"{ETC}/{long}", f"{LIB}/a-longer-template@.service")
    index = UnitIndex(tmp_path)
    assert index.primary_name(long) == long
    assert index.primary_name(f"u@{'y' * 240}.service") == f"u@{'y' * 240}.service"


def test_an_aliased_templates_prefix_dir_is_read_by_its_units_instances(tmp_path: Path) -> None:
    """`foo-bar@.service -> other@.service` makes `foo-bar@a.service` a name of
    `other@a.service`, which so reads `foo-@a.service.d/` (foo-bar@'s dash prefix)."""
    write(tmp_path, f"{LIB}/other@.service")
    link(tmp_path, f"{ETC}/foo-bar@.service", f"{LIB}/other@.service")
    (tmp_path / ETC.lstrip("/") / "foo-@a.service.d").mkdir()
    assert UnitIndex(tmp_path).instance_dropin_names() == ["foo-@a.service", "other@a.service"]
    assert dirs_of(tmp_path, "other@a.service") == [f"{ETC}/foo-@a.service.d"]


def test_the_scan_sees_the_file_a_refused_link_does_not_hide(tmp_path: Path) -> None:
    """The reported case: `/etc/.../t@.service -> /usr/lib/.../a.service` is no alias for
    systemd, which runs t@'s instances from /usr/lib's t@.service: the scan manages them by
    its annotation, and says why the link is ignored."""
    write(tmp_path, f"{LIB}/a.service", "[Service]\nExecStart=/bin/a\n")
    source = f"{LIB}/t@.service"
    write(tmp_path, source, "[Service]\nExecStart=/bin/t\n[X-GPUSlice]\nPriority=3\n")
    link(tmp_path, f"{ETC}/t@.service", f"{LIB}/a.service")
    result = scan(tmp_path)
    assert {n: (s.priority, s.source) for n, s in result.specs.items()} == {
        "t@.service": (3, source)
    }
    assert [(p.path, p.severity) for p in result.problems] == [(f"{ETC}/t@.service", "warning")]
    assert "refuses as an alias" in result.problems[0].message


def test_the_scan_reads_an_instance_aliass_dropins_for_the_instance(tmp_path: Path) -> None:
    """`u@x.service -> t@.service` makes `u@x.service` a name of `t@x.service`, whose
    drop-ins systemd reads in `u@x.service.d/` too."""
    write(tmp_path, f"{LIB}/t@.service", "[Service]\nExecStart=/bin/t\n[X-GPUSlice]\nPriority=1\n")
    link(tmp_path, f"{ETC}/u@x.service", f"{LIB}/t@.service")
    write(tmp_path, f"{ETC}/u@x.service.d/gpus.conf", "[X-GPUSlice]\nGPUs=2\n")
    assert UnitIndex(tmp_path).names_of("t@x.service") == ["t@x.service", "u@x.service"]
    result = scan(tmp_path)
    assert result.problems == []
    assert {n: s.gpus for n, s in result.specs.items()} == {"t@.service": 1, "t@x.service": 2}


def test_a_link_to_a_directory_is_taken_by_its_text(tmp_path: Path) -> None:
    """systemd 252 maps a symlink by its text, whatever it leads to: out of the search path,
    a link to a directory is the unit's fragment, which systemd then fails to read (the unit
    does not load), and hides the name's lower files; into it, it is an alias."""
    annotated = "[Service]\nExecStart=/bin/x\n[X-GPUSlice]\nPriority=3\n"
    write(tmp_path, f"{LIB}/x.service", annotated)
    (tmp_path / "opt/x.service").mkdir(parents=True)
    # relative targets: scandir follows a link on this machine's root, not the test's
    link(tmp_path, f"{ETC}/x.service", "../../../opt/x.service")
    assert UnitIndex(tmp_path).unit_names() == ["x.service"]
    result = scan(tmp_path)
    assert result.specs == {}
    assert result.invalid == {"x.service"}
    assert [(p.path, p.severity) for p in result.problems] == [(f"{ETC}/x.service", "error")]
    # an alias: of b.service, whose file is /run's
    (tmp_path / "opt/x.service").rmdir()
    (tmp_path / LIB.lstrip("/") / "b.service").mkdir()
    write(tmp_path, f"{RUN}/b.service", annotated)
    (tmp_path / ETC.lstrip("/") / "x.service").unlink()
    link(tmp_path, f"{ETC}/x.service", "../../../usr/lib/systemd/system/b.service")
    index = UnitIndex(tmp_path)
    assert index.unit_names() == ["b.service"]
    assert index.primary_name("x.service") == "b.service"
    assert index.names_of("b.service") == ["b.service", "x.service"]


def test_a_link_through_a_directory_loop_is_ignored(tmp_path: Path) -> None:
    """systemd cannot resolve `a.service -> loop/a.service` (`loop -> loop`) and ignores it:
    /usr/lib's a.service is the unit's. Every question about the name gets that answer; an
    instance with no other file of its own is its template's."""
    write(tmp_path, f"{LIB}/a.service", "[Service]\nExecStart=/bin/a\n[X-GPUSlice]\nPriority=3\n")
    link(tmp_path, f"{ETC}/loop", "loop")
    link(tmp_path, f"{ETC}/a.service", "loop/a.service")
    index = UnitIndex(tmp_path)
    assert index.primary_name("a.service") == "a.service"
    assert index.names_of("a.service") == ["a.service"]
    fragment = index.fragment("a.service")
    assert fragment is not None and fragment.path == f"{LIB}/a.service"
    result = scan(tmp_path)
    assert {n: s.source for n, s in result.specs.items()} == {"a.service": f"{LIB}/a.service"}
    write(tmp_path, f"{LIB}/b@.service")
    link(tmp_path, f"{ETC}/t@.service", f"{LIB}/b@.service")
    link(tmp_path, f"{ETC}/t@x.service", "loop/t@x.service")
    assert UnitIndex(tmp_path).primary_name("t@x.service") == "b@x.service"


def test_same_directory_twice_is_searched_once(tmp_path: Path) -> None:
    # merged /usr: /lib -> usr/lib; systemd 252 on Debian names such files /lib/systemd/system/...
    write(tmp_path, f"{LIB}/a.service")
    write(tmp_path, f"{LIB}/a.service.d/x.conf", "[Unit]\n")
    os.symlink("usr/lib", tmp_path / "lib")
    index = UnitIndex(tmp_path)
    assert [p for p, _r in index.dropin_dirs("a.service")] == ["/lib/systemd/system/a.service.d"]
    assert [f.path for f in index.dropins("a.service")] == [
        "/lib/systemd/system/a.service.d/x.conf"
    ]
    fragment = index.fragment("a.service")
    assert fragment is not None
    assert fragment.path == "/lib/systemd/system/a.service"
    assert index.unit_names() == ["a.service"]


# ---------------------------------------------------------------------------------------------
# drop-ins


@pytest.mark.parametrize(
    ("files", "name", "expected"),
    [
        pytest.param(
            [
                f"{LIB}/a.service.d/20-b.conf",
                f"{ETC}/a.service.d/10-a.conf",
                f"{RUN}/a.service.d/30-c.conf",
            ],
            "a.service",
            [
                f"{ETC}/a.service.d/10-a.conf",
                f"{LIB}/a.service.d/20-b.conf",
                f"{RUN}/a.service.d/30-c.conf",
            ],
            id="sorted-by-file-name-across-dirs",
        ),
        pytest.param(
            [f"{LIB}/a.service.d/override.conf", f"{ETC}/a.service.d/override.conf"],
            "a.service",
            [f"{ETC}/a.service.d/override.conf"],
            id="same-name-higher-dir-wins",
        ),
        pytest.param(
            [
                f"{ETC}/a.service.d/x.txt",
                f"{ETC}/a.service.d/.hidden.conf",
                f"{ETC}/a.service.d/y.conf",
            ],
            "a.service",
            [f"{ETC}/a.service.d/y.conf"],
            id="only-conf-files",
        ),
        pytest.param(
            [
                f"{LIB}/t@.service.d/10-t.conf",
                f"{ETC}/t@x.service.d/20-x.conf",
                f"{ETC}/t@y.service.d/30-y.conf",
            ],
            "t@x.service",
            [f"{LIB}/t@.service.d/10-t.conf", f"{ETC}/t@x.service.d/20-x.conf"],
            id="instance-and-template",
        ),
        pytest.param(
            [f"{ETC}/t@.service.d/override.conf", f"{ETC}/t@x.service.d/override.conf"],
            "t@x.service",
            [f"{ETC}/t@x.service.d/override.conf"],
            id="instance-hides-template-same-name-same-dir",
        ),
        pytest.param(
            [f"{ETC}/t@.service.d/override.conf", f"{LIB}/t@x.service.d/override.conf"],
            "t@x.service",
            [f"{ETC}/t@.service.d/override.conf"],
            id="higher-dir-wins-over-instance",
        ),
        pytest.param(
            [f"{ETC}/t@.service.d/a.conf", f"{ETC}/t@x.service.d/b.conf"],
            "t@.service",
            [f"{ETC}/t@.service.d/a.conf"],
            id="template-alone",
        ),
        pytest.param(
            [f"{ETC}/foo\\x2dbar@.service.d/a.conf", f"{ETC}/foo\\x2dbar@a.service.d/b.conf"],
            "foo\\x2dbar@a.service",
            [f"{ETC}/foo\\x2dbar@.service.d/a.conf", f"{ETC}/foo\\x2dbar@a.service.d/b.conf"],
            id="escaped-names",
        ),
        pytest.param(
            [
                f"{ETC}/foo-.service.d/a.conf",
                f"{ETC}/foo-bar-.service.d/b.conf",
                f"{ETC}/service.d/c.conf",
                f"{ETC}/fo-.service.d/no.conf",
            ],
            "foo-bar-baz.service",
            [
                f"{ETC}/foo-.service.d/a.conf",
                f"{ETC}/foo-bar-.service.d/b.conf",
                f"{ETC}/service.d/c.conf",
            ],
            id="dash-prefix-and-type-level",
        ),
        pytest.param(
            [f"{LIB}/a.service.d/same.conf", f"{ETC}/service.d/same.conf"],
            "a.service",
            [f"{LIB}/a.service.d/same.conf"],
            id="unit-dir-beats-type-level-dir",
        ),
    ],
)
def test_find_dropins(tmp_path: Path, files: list[str], name: str, expected: list[str]) -> None:
    write(tmp_path, f"{LIB}/{template_of(name)}")
    for f in files:
        write(tmp_path, f)
    assert [d.path for d in find_dropins(name, tmp_path)] == expected


@pytest.mark.parametrize(
    ("how", "listed"),
    [("dev-null", []), ("empty-file", [f"{ETC}/a.service.d/50-vendor.conf"])],
)
def test_masked_dropin_hides_lower_one(tmp_path: Path, how: str, listed: list[str]) -> None:
    write(tmp_path, f"{LIB}/a.service")
    write(tmp_path, f"{LIB}/a.service.d/50-vendor.conf")
    write(tmp_path, f"{LIB}/a.service.d/60-kept.conf")
    if how == "dev-null":
        link(tmp_path, f"{ETC}/a.service.d/50-vendor.conf", "/dev/null")
    else:
        write(tmp_path, f"{ETC}/a.service.d/50-vendor.conf", "")
    assert [d.path for d in find_dropins("a.service", tmp_path)] == [
        *listed,
        f"{LIB}/a.service.d/60-kept.conf",
    ]


def test_dropins_are_applied_in_the_byte_order_of_their_names(tmp_path: Path) -> None:
    """systemd sorts drop-ins by strcmp(3) of their names, byte by byte. A name that is not
    UTF-8 is a lone surrogate to Python (U+DC80 for the byte 0x80), which sorted after any
    other character below U+DC80 (`é`, 0xC3 0xA9, sorts after 0x80 as bytes): the other
    drop-in's `User=` or `[X-GPUSlice]` won in gpuslice's reading, this one's in systemd's."""
    write(tmp_path, f"{LIB}/a.service")
    latin = os.fsdecode(b"\x80.conf")
    for name in ("b.conf", "\u00e9.conf", latin, "\u4e00.conf"):
        write(tmp_path, f"{ETC}/a.service.d/{name}")
    assert [os.fsencode(d.path) for d in find_dropins("a.service", tmp_path)] == [
        f"{ETC}/a.service.d/".encode() + name
        for name in (b"b.conf", b"\x80.conf", "\u00e9.conf".encode(), "\u4e00.conf".encode())
    ]


def test_symlinked_dropin_and_dropin_dir(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/a.service")
    write(tmp_path, "/opt/conf/x.conf", "[Unit]\n")
    write(tmp_path, "/opt/dir/y.conf", "[Unit]\n")
    link(tmp_path, f"{ETC}/a.service.d/x.conf", "/opt/conf/x.conf")
    link(tmp_path, f"{RUN}/a.service.d", "/opt/dir")
    link(tmp_path, f"{ETC}/a.service.d/dangling.conf", "/opt/none.conf")
    assert [(d.path, d.real) for d in find_dropins("a.service", tmp_path)] == [
        (f"{ETC}/a.service.d/x.conf", str(tmp_path / "opt/conf/x.conf")),
        (f"{RUN}/a.service.d/y.conf", str(tmp_path / "opt/dir/y.conf")),
    ]


@pytest.mark.parametrize("kind", ["directory", "fifo", "dangling", "loop", "link to a fifo"])
def test_a_dropin_that_is_no_file_still_hides_its_name(tmp_path: Path, kind: str) -> None:
    """systemd 252 lists drop-ins by name with no check of their kind (conf_files_list_strv,
    flags 0): `x.conf` in /etc hides /usr/lib's `x.conf` whatever it is, and applies nothing.
    Read here, /usr/lib's ExecStartPre= lines went into the gate, which systemd then ran; and
    such an entry named gpuslice-gate.conf hid the gate without a word."""
    write(tmp_path, f"{LIB}/a.service")
    write(tmp_path, f"{LIB}/a.service.d/x.conf", "[Service]\nExecStartPre=/bin/y\n")
    write(tmp_path, f"{LIB}/a.service.d/z.conf")
    hider = tmp_path / ETC.lstrip("/") / "a.service.d" / "x.conf"
    hider.parent.mkdir(parents=True)
    if kind == "directory":
        hider.mkdir()
    elif kind == "fifo":
        os.mkfifo(hider)
    elif kind == "dangling":
        hider.symlink_to("/opt/none.conf")
    elif kind == "loop":
        hider.symlink_to("x.conf")
    else:
        os.mkfifo(tmp_path / "pipe")
        hider.symlink_to("/pipe")
    index = UnitIndex(tmp_path)
    assert [d.path for d in index.dropins("a.service")] == [f"{LIB}/a.service.d/z.conf"]
    assert [i.path for i in index.issues] == [f"{ETC}/a.service.d/x.conf"]
    assert index.issues[0].message.endswith(
        "it hides the drop-ins of its name in the directories after it"
    )


def test_the_hiding_dropins_are_found_asked_first_and_beside_other_names(tmp_path: Path) -> None:
    """`hiding_dropins` asked before `dropins` reads the drop-ins itself; and names that are
    no drop-in (not `*.conf`), listed in any order among the drop-ins, end nothing."""
    write(tmp_path, f"{LIB}/a.service")
    for n in range(10):
        write(tmp_path, f"{LIB}/a.service.d/{n}.conf")
        write(tmp_path, f"{LIB}/a.service.d/{n}.txt")
    (tmp_path / ETC.lstrip("/") / "a.service.d").mkdir(parents=True)
    (tmp_path / ETC.lstrip("/") / "a.service.d" / "9.conf").symlink_to("/dev/null")
    index = UnitIndex(tmp_path)
    assert index.hiding_dropins("a.service") == [f"{ETC}/a.service.d/9.conf"]
    dropins = [d.path for d in index.dropins("a.service")]
    assert dropins == [f"{LIB}/a.service.d/{n}.conf" for n in range(9)]


def test_a_shared_dropin_directory_is_read_once_per_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`service.d/`, a dash prefix's and a template's directories are read by every unit they
    name: at 10,000 units, listing them again for each unit was four in five of a scan's
    listings. One index lists each once (and follows a linked one once), and every unit
    still gets the same drop-ins, in the same order, and each ignored file is said once."""
    units = [f"app-{i}.service" for i in range(30)] + [f"job@{i}.service" for i in range(10)]
    for name in units:
        write(tmp_path, f"{LIB}/{name}")
    write(tmp_path, f"{LIB}/job@.service")
    write(tmp_path, f"{ETC}/service.d/10-x.conf")
    os.mkfifo(tmp_path / f"{ETC.lstrip('/')}/service.d/15-fifo.conf")
    write(tmp_path, f"{LIB}/service.d/10-x.conf")  # hidden by /etc's
    write(tmp_path, "/opt/shared/30-linked.conf")
    link(tmp_path, f"{RUN}/service.d", "/opt/shared")
    write(tmp_path, f"{ETC}/app-.service.d/20-y.conf")
    link(tmp_path, f"{ETC}/job@.service.d/25-masked.conf", "/dev/null")
    write(tmp_path, f"{LIB}/job@.service.d/25-masked.conf")
    write(tmp_path, f"{LIB}/job@.service.d/26-w.conf")
    listed: dict[str, int] = {}
    statted: dict[str, int] = {}
    real_scandir, real_stat = os.scandir, os.stat

    def counting(path: str) -> Any:
        listed[path] = listed.get(path, 0) + 1
        return real_scandir(path)

    def counting_stat(path: str, **kwargs: Any) -> os.stat_result:
        statted[path] = statted.get(path, 0) + 1
        return real_stat(path, **kwargs)

    shared = [f"{ETC}/service.d/10-x.conf", f"{RUN}/service.d/30-linked.conf"]
    found: dict[str, list[str]] = {}
    with monkeypatch.context() as patched:
        patched.setattr(os, "scandir", counting)
        patched.setattr(os, "stat", counting_stat)
        index = UnitIndex(tmp_path)
        for name in units:
            found[name] = [d.path for d in index.dropins(name)]
    for name in units:
        expected = (
            [f"{ETC}/app-.service.d/20-y.conf"]
            if name.startswith("app-")
            else [f"{LIB}/job@.service.d/26-w.conf"]
        )
        by_file_name = sorted([*expected, *shared], key=lambda p: p.rsplit("/", 1)[1])
        assert found[name] == by_file_name
    assert [(i.path, i.message) for i in index.issues] == [
        (
            f"{ETC}/service.d/15-fifo.conf",
            "not a regular file or a symlink, ignored; it hides the drop-ins of its name in the "
            "directories after it",
        )
    ]
    assert {p: n for p, n in listed.items() if n != 1} == {}
    # the link `service.d` is followed once too
    assert listed[str(tmp_path / "opt/shared")] == statted[str(tmp_path / "opt/shared")] == 1


def test_a_shared_dropin_directory_gone_after_the_listing_is_skipped_by_every_unit(
    tmp_path: Path,
) -> None:
    """A drop-in directory removed between the search path's listing and a unit's question
    is skipped (as systemd skips a directory it cannot read), for each unit alike."""
    for name in ("a-1.service", "a-2.service"):
        write(tmp_path, f"{LIB}/{name}")
    write(tmp_path, f"{ETC}/service.d/10-x.conf")
    write(tmp_path, f"{LIB}/a-.service.d/20-y.conf")
    index = UnitIndex(tmp_path)
    (tmp_path / f"{ETC.lstrip('/')}/service.d/10-x.conf").unlink()
    (tmp_path / f"{ETC.lstrip('/')}/service.d").rmdir()
    for name in ("a-1.service", "a-2.service"):
        assert [d.path for d in index.dropins(name)] == [f"{LIB}/a-.service.d/20-y.conf"]
    assert index.issues == []


def test_a_new_scan_reads_a_shared_dropin_directory_again(tmp_path: Path) -> None:
    """Each scan (one at start-up, one per daemon-reload) has its own index: a drop-in that a
    shared directory gained since the last scan is read by the next one."""
    write(tmp_path, f"{LIB}/a.service", "[X-GPUSlice]\nPriority=10\n")
    write(tmp_path, f"{ETC}/service.d/10-x.conf", "[Unit]\n")
    assert scan(tmp_path).specs["a.service"].priority == 10
    write(tmp_path, f"{ETC}/service.d/20-y.conf", "[X-GPUSlice]\nPriority=20\n")
    assert scan(tmp_path).specs["a.service"].priority == 20


# ---------------------------------------------------------------------------------------------
# hostile text and files (issue 8)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "[S]\r\nk=v\r\nj=w\r\n", [Entry("S", "k", "v", 2), Entry("S", "j", "w", 3)], id="crlf"
        ),
        pytest.param("[S]\rk=v\rj=w", [Entry("S", "k", "v", 2), Entry("S", "j", "w", 3)], id="cr"),
        pytest.param(
            "[S]\nk=v\x00j=w\n",
            [Entry("S", "k", "v", 2), Entry("S", "j", "w", 3)],
            id="nul-ends-a-line",
        ),
        pytest.param(
            "[S]\nk=a\x0cb\x1cc\u2028d\n",
            [Entry("S", "k", "a\x0cb\x1cc\u2028d", 2)],
            id="no-other-line-ends",
        ),
        pytest.param("[S]\nk=v\\", [Entry("S", "k", "v", 2)], id="backslash-at-eof"),
        pytest.param("[S]\nk=v\\\n", [Entry("S", "k", "v", 2)], id="continuation-then-eof"),
        pytest.param(
            "[S]\nk=v \\\n# comment\n",
            [Entry("S", "k", "v", 2)],
            id="continuation-into-comment-at-eof",
        ),
        pytest.param("[S]\n\\", [], id="lone-backslash"),
        pytest.param(
            "[S]\nk=\u00a0v\u00a0\n",
            [Entry("S", "k", "\u00a0v\u00a0", 2)],
            id="only-systemd-whitespace-stripped",
        ),
        pytest.param(
            "[S]\n" + "k=v\n" * 3, [Entry("S", "k", "v", n) for n in (2, 3, 4)], id="keys-repeat"
        ),
        pytest.param(
            "[S]\nk=1\n[T]\n[S]\nk=2\n",
            [Entry("S", "k", "1", 2), Entry("S", "k", "2", 5)],
            id="section-repeats",
        ),
    ],
)
def test_parse_sections_line_ends_and_edges(text: str, expected: list[Entry]) -> None:
    assert parse_sections(text) == expected


@pytest.mark.parametrize(
    "bad",
    [b"bad=\xff\xfe", b"[T\xc0]", b"k=\xef\xbf\xbe", b"k=\xef\xb7\x90", b"k=\xf4\x8f\xbf\xbf"],
)
def test_parse_sections_stops_at_a_line_that_is_not_utf8(bad: bytes) -> None:
    """Undecodable bytes, or a noncharacter (U+FFFE, U+FDD0, U+10FFFF) that Python decodes and
    systemd's utf8_is_valid refuses: systemd reads no further (config_parse fails)."""
    raw = b"[S]\nk=caf\xc3\xa9\n" + bad + b"\n[T]\nj=1\n"
    text = raw.decode("utf-8", "surrogateescape")
    issues: list[TextIssue] = []
    headers: list[tuple[str, int]] = []
    assert parse_sections(text, issues, headers) == [Entry("S", "k", "caf\u00e9", 2)]
    assert issues == [
        TextIssue("S", 3, "line is not valid UTF-8: systemd ignores the rest of the file")
    ]
    assert headers == [("S", 1)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(  # systemd: one line end, and the next line continues this one
            "[S]\nk=a \\\n\rExecStartPre=/bin/rm\n",
            [Entry("S", "k", "a  ExecStartPre=/bin/rm", 2)],
            id="lf-cr",
        ),
        pytest.param("[S]\nk=a \\\r\n\x00j=b\n", [Entry("S", "k", "a  j=b", 2)], id="cr-lf-nul"),
        pytest.param("[S]\nk=a \\\r\x00j=b\n", [Entry("S", "k", "a  j=b", 2)], id="cr-nul"),
        pytest.param(  # a NUL ends the line end: the next "\n" is an empty line
            "[S]\nk=a \\\x00\nj=b\n",
            [Entry("S", "k", "a", 2), Entry("S", "j", "b", 4)],
            id="nul-lf",
        ),
        pytest.param(
            "[S]\nk=a \\\n\nj=b\n",
            [Entry("S", "k", "a", 2), Entry("S", "j", "b", 4)],
            id="lf-lf",
        ),
    ],
)
def test_parse_sections_line_ends_as_systemds_read_line(text: str, expected: list[Entry]) -> None:
    """read_line ends a line at a run of "\n", "\r", NUL, each at most once, ended by a NUL."""
    assert parse_sections(text) == expected


def test_parse_sections_drops_the_first_byte_order_mark_wherever_it_is() -> None:
    """systemd drops the mark from the first line (not a comment) that starts with one, not
    only from the file's first line: `\ufeffEnvironmentFile=` names a file systemd reads."""
    text = "[S]\n# \ufeffnot this\n\ufeffk=v\n\ufeffj=w\n"
    assert parse_sections(text) == [Entry("S", "k", "v", 3), Entry("S", "\ufeffj", "w", 4)]


def test_parse_sections_a_line_behind_a_byte_order_mark_is_no_comment() -> None:
    """systemd looks for `#` before it drops the mark: the line is read, and its trailing
    backslash takes the next line with it (here the header: `k=v` is outside any section)."""
    text = "\ufeff# comment \\\n[S]\nk=v\n"
    assert all(e.key != "k" for e in parse_sections(text))


def test_parse_sections_quotes_a_bad_line_briefly() -> None:
    issues: list[TextIssue] = []
    parse_sections("[" + "\x1b" * 100_000 + "\n", issues)
    assert len(issues) == 1
    assert len(issues[0].message) < 400
    assert issues[0].message.isascii() and issues[0].message.isprintable()


def test_parse_sections_on_a_long_line_and_many_lines() -> None:
    text = "[S]\nk=" + "v" * MAX_FILE_SIZE + "\n" + "j=1\n" * 100_000
    entries = parse_sections(text)
    assert len(entries) == 100_001
    assert entries[-1] == Entry("S", "j", "1", 100_002)


def test_read_text_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "loop").symlink_to("loop")
    for name, message in [
        ("fifo", "a FIFO, not a regular file"),
        ("dir", "a directory, not a regular file"),
    ]:
        with pytest.raises(OSError) as raised:
            UnitFile(name, str(tmp_path / name)).read_text()  # never blocks on the FIFO
        assert raised.value.strerror == message
    with pytest.raises(OSError):
        UnitFile("loop", str(tmp_path / "loop")).read_text()


def test_read_text_size_cap(tmp_path: Path) -> None:
    edge = tmp_path / "edge"
    edge.write_bytes(b"#" * MAX_FILE_SIZE)
    assert len(UnitFile("edge", str(edge)).read_text()) == MAX_FILE_SIZE
    over = tmp_path / "over"
    over.write_bytes(b"#" * (MAX_FILE_SIZE + 1))
    with pytest.raises(OSError) as raised:
        UnitFile("over", str(over)).read_text()
    assert raised.value.strerror == "larger than 1 MiB, which no unit file needs"


def test_read_text_keeps_bad_bytes_for_the_parser(tmp_path: Path) -> None:
    path = tmp_path / "x"
    path.write_bytes(b"[S]\nk=\xff\n")
    text = UnitFile("x", str(path)).read_text()  # never UnicodeDecodeError
    assert parse_sections(text) == []


def test_index_skips_fifos_invalid_names_and_loops(tmp_path: Path) -> None:
    write(tmp_path, f"{ETC}/good.service")
    etc = tmp_path / ETC.lstrip("/")
    os.mkfifo(etc / "fifo.service")
    (etc / "bad name.service").write_text("[Unit]\n")
    (etc / "loop.service").symlink_to("loop.service")
    (etc / "loop.service.d").symlink_to("loop.service.d")
    (etc / "x@bad name.service.d").mkdir()
    link(tmp_path, f"{RUN}", "/run/systemd/system")  # a search directory that is a loop
    index = UnitIndex(tmp_path)
    assert index.unit_names() == ["good.service"]
    assert index.instance_dropin_names() == []
    assert index.fragment("fifo.service") is None
    assert index.fragment("loop.service") is None
    assert index.dropins("loop.service") == []
    assert sorted(i.path for i in index.issues) == [
        f"{ETC}/bad name.service",
        f"{ETC}/fifo.service",
        f"{ETC}/loop.service",
    ]


def test_chase_gives_up_after_32_links(tmp_path: Path) -> None:
    etc = tmp_path / ETC.lstrip("/")
    write(tmp_path, f"{ETC}/target.service")
    for i in range(33):
        (etc / f"l{i}").symlink_to(f"l{i + 1}" if i < 32 else "target.service")
    index = UnitIndex(tmp_path)
    assert index.chase(f"{ETC}/l1") == str(etc / "target.service")  # 32 links
    assert index.chase(f"{ETC}/l0") is None  # 33 links


# ---------------------------------------------------------------------------------------------
# drop-in directories of every name of a unit (systemd 252: src/shared/dropin.c
# unit_file_find_dirs, src/basic/unit-file.c unit_file_find_fragment)


def dirs_of(root: Path, name: str) -> list[str]:
    return [path for path, _real in UnitIndex(root).dropin_dirs(name)]


def test_an_instances_dash_prefixes_keep_the_instance(tmp_path: Path) -> None:
    """systemd builds the prefix name with the instance: `foo-bar@a.service` reads
    `foo-@a.service.d` and `foo-@.service.d` too, after its template's prefix `foo-.service.d`,
    each search directory in turn. Other instances' and other prefixes' directories do not apply."""
    for name in ("foo-bar@a", "foo-bar@", "foo-", "foo-@a", "foo-@", "foo-@b", "fo-@a", "foo-b@a"):
        (tmp_path / ETC.lstrip("/") / f"{name}.service.d").mkdir(parents=True, exist_ok=True)
    (tmp_path / LIB.lstrip("/") / "foo-@a.service.d").mkdir(parents=True)
    assert dirs_of(tmp_path, "foo-bar@a.service") == [
        f"{ETC}/foo-bar@a.service.d",
        f"{ETC}/foo-bar@.service.d",
        f"{ETC}/foo-.service.d",
        f"{ETC}/foo-@a.service.d",
        f"{ETC}/foo-@.service.d",
        f"{LIB}/foo-@a.service.d",
    ]
    # the template stands for every instance: what no one instance's name adds
    assert dirs_of(tmp_path, "foo-bar@.service") == [
        f"{ETC}/foo-bar@.service.d",
        f"{ETC}/foo-.service.d",
        f"{ETC}/foo-@.service.d",
    ]


def test_a_longer_instance_prefix_chain_is_systemds_order(tmp_path: Path) -> None:
    """Each step reads the name, its template's names, then its prefix's (recursively)."""
    names = ["a-b-c@i", "a-b-c@", "a-b-", "a-", "a-b-@i", "a-b-@", "a-@i", "a-@"]
    for name in names:
        (tmp_path / ETC.lstrip("/") / f"{name}.service.d").mkdir(parents=True)
    assert dirs_of(tmp_path, "a-b-c@i.service") == [f"{ETC}/{n}.service.d" for n in names]
    assert dirs_of(tmp_path, "a-b-c@.service") == [
        f"{ETC}/{n}.service.d" for n in names if not n.endswith("@i")
    ]


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            [f"{ETC}/foo-@a.service.d/x.conf", f"{ETC}/foo-.service.d/x.conf"],
            [f"{ETC}/foo-.service.d/x.conf"],
            id="template-prefix-before-instance-prefix",
        ),
        pytest.param(
            [f"{ETC}/foo-@a.service.d/x.conf", f"{LIB}/foo-bar@a.service.d/x.conf"],
            [f"{ETC}/foo-@a.service.d/x.conf"],
            id="higher-directory-first",
        ),
        pytest.param(
            [f"{ETC}/foo-@.service.d/10-pre.conf", f"{ETC}/foo-@a.service.d/20-user.conf"],
            [f"{ETC}/foo-@.service.d/10-pre.conf", f"{ETC}/foo-@a.service.d/20-user.conf"],
            id="both-read",
        ),
    ],
)
def test_instance_prefix_dropins(tmp_path: Path, files: list[str], expected: list[str]) -> None:
    write(tmp_path, f"{LIB}/foo-bar@.service")
    for f in files:
        write(tmp_path, f)
    assert [d.path for d in find_dropins("foo-bar@a.service", tmp_path)] == expected


@pytest.mark.parametrize(
    "target", [f"{LIB}/real.service", "../../../usr/lib/systemd/system/real.service"]
)
def test_an_aliass_dropin_dirs_are_the_units(tmp_path: Path, target: str) -> None:
    """`systemctl enable` of a unit with `Alias=alias.service` links it into /etc: systemd reads
    `alias.service.d/` for real.service, after every directory of real.service's own names
    (load-dropin.c: the unit's id, then its aliases), so a file of the same name in real's
    directory wins even from a lower search directory."""
    write(tmp_path, f"{LIB}/real.service")
    link(tmp_path, f"{ETC}/alias.service", target)
    link(tmp_path, f"{ETC}/alias2.service", "alias.service")  # an alias of the alias
    write(tmp_path, f"{ETC}/alias.service.d/x.conf")
    write(tmp_path, f"{ETC}/alias.service.d/y.conf")
    write(tmp_path, f"{ETC}/alias2.service.d/w.conf")
    write(tmp_path, f"{LIB}/real.service.d/x.conf")
    write(tmp_path, f"{RUN}/real.service.d/z.conf")
    write(tmp_path, f"{ETC}/service.d/y.conf")
    write(tmp_path, f"{ETC}/other.service.d/v.conf")
    expected_dirs = [
        f"{RUN}/real.service.d",
        f"{LIB}/real.service.d",
        f"{ETC}/alias.service.d",
        f"{ETC}/alias2.service.d",
        f"{ETC}/service.d",
    ]
    index = UnitIndex(tmp_path)
    assert index.names_of("real.service") == ["real.service", "alias.service", "alias2.service"]
    assert [p for p, _r in index.dropin_dirs("real.service")] == expected_dirs
    # asked by an alias: the same unit, the same directories
    assert [p for p, _r in index.dropin_dirs("alias2.service")] == expected_dirs
    assert [f.path for f in index.dropins("real.service")] == [
        f"{ETC}/alias2.service.d/w.conf",
        f"{LIB}/real.service.d/x.conf",
        f"{ETC}/alias.service.d/y.conf",
        f"{RUN}/real.service.d/z.conf",
    ]


def test_an_aliass_dash_prefixes_are_read_too(tmp_path: Path) -> None:
    """Each name of the unit has its own prefix directories."""
    write(tmp_path, f"{LIB}/real.service")
    link(tmp_path, f"{ETC}/web-front.service", f"{LIB}/real.service")
    (tmp_path / ETC.lstrip("/") / "web-.service.d").mkdir()
    assert dirs_of(tmp_path, "real.service") == [f"{ETC}/web-.service.d"]


def test_an_instance_of_an_aliased_template_reads_the_aliass_dirs(tmp_path: Path) -> None:
    """`a@.service -> b@.service` makes `a@x.service` a name of `b@x.service` (with its
    template `a@.service`), unless `a@x.service` is a unit of its own."""
    write(tmp_path, f"{LIB}/b@.service")
    link(tmp_path, f"{ETC}/a@.service", f"{LIB}/b@.service")
    for name in ("a@x", "a@", "b@", "a@y"):
        (tmp_path / ETC.lstrip("/") / f"{name}.service.d").mkdir(exist_ok=True)
    assert dirs_of(tmp_path, "b@x.service") == [
        f"{ETC}/b@.service.d",
        f"{ETC}/a@x.service.d",
        f"{ETC}/a@.service.d",
    ]
    assert dirs_of(tmp_path, "a@x.service") == dirs_of(tmp_path, "b@x.service")
    assert dirs_of(tmp_path, "b@.service") == [f"{ETC}/b@.service.d", f"{ETC}/a@.service.d"]
    write(tmp_path, f"{ETC}/a@x.service")  # now a unit of its own
    assert dirs_of(tmp_path, "b@x.service") == [f"{ETC}/b@.service.d"]


@pytest.mark.parametrize(
    ("target", "unit"),
    [
        # a linked unit file: the unit itself, under the link's name, whatever the target's
        ("/opt/real.service", "real.service"),
        (f"{LIB}/t@.service", "t@.service"),  # a plain name to a template: systemd refuses it
    ],
)
def test_a_link_that_is_no_alias_adds_no_dropin_dirs(
    tmp_path: Path, target: str, unit: str
) -> None:
    write(tmp_path, f"{LIB}/t@.service")
    write(tmp_path, "/opt/real.service")
    link(tmp_path, f"{ETC}/x.service", target)
    (tmp_path / ETC.lstrip("/") / "x.service.d").mkdir()
    index = UnitIndex(tmp_path)
    assert index.names_of(unit) == [unit]
    assert index.dropin_dirs(unit) == []
    assert index.names_of("x.service") == ["x.service"]


def test_instances_that_read_a_prefix_or_an_aliass_instance_dir_are_listed(tmp_path: Path) -> None:
    """The scan reads a template once for all its instances: an instance that reads a
    directory named for it (`foo-@a.service.d`, `alias@b.service.d`) is scanned on its own,
    under the name systemd loads it by."""
    for template in ("foo-bar@", "foo-baz@", "other@"):
        write(tmp_path, f"{LIB}/{template}.service")
    link(tmp_path, f"{ETC}/alias@.service", f"{LIB}/other@.service")
    for name in ("foo-@a", "alias@b", "foo-@", "plain-x"):
        (tmp_path / ETC.lstrip("/") / f"{name}.service.d").mkdir(exist_ok=True)
    assert UnitIndex(tmp_path).instance_dropin_names() == [
        "foo-@a.service",  # its own name, as before: its template is no unit
        "foo-bar@a.service",
        "foo-baz@a.service",
        "other@b.service",
    ]


def test_the_scan_sees_annotations_in_prefix_and_alias_dirs(tmp_path: Path) -> None:
    """End to end: an annotation in `job-@big.service.d/` manages `job-train@big.service`
    (GPUs=2) apart from its template, and one in an alias's directory manages the unit."""
    write(tmp_path, f"{LIB}/job-train@.service", "[Service]\nExecStart=/bin/t\n")
    write(tmp_path, f"{LIB}/job-.service.d/prio.conf", "[X-GPUSlice]\nPriority=5\n")
    source = f"{ETC}/job-@big.service.d/gpus.conf"
    write(tmp_path, source, "[X-GPUSlice]\nGPUs=2\n")
    write(tmp_path, f"{LIB}/real.service", "[Service]\nExecStart=/bin/r\n")
    link(tmp_path, f"{ETC}/web.service", f"{LIB}/real.service")
    write(tmp_path, f"{ETC}/web.service.d/gpu.conf", "[X-GPUSlice]\nPriority=7\n")
    result = scan(tmp_path)
    assert result.problems == []
    assert {n: (s.priority, s.gpus) for n, s in result.specs.items()} == {
        "job-train@.service": (5, 1),
        "job-train@big.service": (5, 2),
        "real.service": (7, 1),
    }
    assert result.specs["real.service"].source == f"{ETC}/web.service.d/gpu.conf"
