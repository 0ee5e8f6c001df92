"""Fuzzing the unit-file reader and the [X-GPUSlice] loader (issue 8): no input crashes anything.

Every outcome is a documented one: a value or ValueError from `parse_size`; entries and issues
from `parse_sections`; a spec and/or located `Problem`s from the loader and `scan()`, never
another exception; and a valid unit next to a hostile one still gets its spec.

GPUSLICE_FUZZ_EXAMPLES sets the number of examples per test (default 200; `make fuzz`: 10000).
"""

from __future__ import annotations

import os
import shutil
import string
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice.annotations import KEYS, SECTION, Loader, Problem, scan
from gpuslice.core.model import UnitSpec
from gpuslice.paths import GATE_DROPIN_NAME
from gpuslice.sizes import SIZE_MAX, parse_size
from gpuslice.unitfiles import Entry, TextIssue, UnitFile, UnitIndex, parse_sections

EXAMPLES = int(os.environ.get("GPUSLICE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ETC = "/etc/systemd/system"
LIB = "/usr/lib/systemd/system"

# ---------------------------------------------------------------------------------------------
# strategies

# digits of many scripts (what `\d` and str.isdigit take), look-alikes, separators
ODD_CHARS = "0123456789\u0660\u0663\u06f5\u0966\uff11\u00b2\u00b9\u2155\u212a\u0130\u0131"
ODD_CHARS += ".,+-_ \t\u00a0\u2003\x00\x1b\r\n\\\"'%@=[]#;\udcff"
odd_text = st.text(alphabet=st.sampled_from(ODD_CHARS) | st.characters(), max_size=40)
numbers = st.one_of(
    st.integers(min_value=0, max_value=10**30).map(str),
    st.integers(min_value=0, max_value=600).map(lambda n: "9" * n),  # up to 600 nines
    st.from_regex(r"[0-9]{1,5}\.[0-9]{1,12}", fullmatch=True),
    st.text(alphabet=st.characters(categories=["Nd"]), min_size=1, max_size=6),
)
suffixes = st.sampled_from(
    [
        "",
        "B",
        "K",
        "k",
        "KB",
        "KiB",
        "M",
        "MiB",
        "G",
        "g",
        "GiB",
        "T",
        "P",
        "E",
        "iB",
        "X",
        "\u212a",
    ]
)
size_texts = st.one_of(
    st.tuples(st.sampled_from(["", " ", "\t", "\u00a0"]), numbers, st.sampled_from(["", " "]),
              suffixes).map("".join),
    odd_text,
)  # fmt: skip


def boundary_values(key: str) -> st.SearchStrategy[str]:
    """Values at and around the edges of every [X-GPUSlice] key, plus junk."""
    special = {
        "Priority": ["0", "999", "1000", "-1", "007", "\u0665", "9" * 400, "1e3", "+1"],
        "GPUs": ["0", "1", "64", "65", "\u0662", "9" * 400, "2 "],
        "Type": ["on-demand", "background", "Background", "on_demand", ""],
        "Requeue": ["yes", "no", "2", "YES", "on", "of", ""],
        "Memory": ["1", "0", "1P", "1025P", "1.5", "0.0001K", "9" * 400, "\u0663G", "20 GiB"],
        "Devices": [
            "0",
            "9999",
            "12345",
            ",",
            " , ",
            "MIG-1/2/3",
            "GPU-" + "a" * 80,
            "GPU-" + "a" * 81,
            ",".join(map(str, range(64))),
            ",".join(map(str, range(65))),
            "0 0 1",
        ],
        "Preempt": ["stop", "suspend stop", "freeze,suspend,stop", "stop stop", "Stop", ",", ""],
    }[key]
    return st.sampled_from(special) | odd_text


@st.composite
def annotation_lines(draw: st.DrawFn) -> str:
    key = draw(st.sampled_from([k.name for k in KEYS] + ["Colour", "priority", ""]))
    value = draw(boundary_values(key)) if key in {k.name for k in KEYS} else draw(odd_text)
    return f"{key}={value}"


section_names = st.sampled_from([SECTION, "Service", "Unit", "X-GPUSLICE", "", "X-GPUSlice "])
lines = st.one_of(
    annotation_lines(),
    section_names.map(lambda s: f"[{s}]"),
    st.sampled_from(
        ["ExecStartPre=", "ExecStartPre=/bin/true", "# c", "; c", "\\", "k=v \\", "[", "=", "x"]
    ),
    odd_text,
)


@st.composite
def unit_texts(draw: st.DrawFn) -> str:
    body = draw(st.lists(lines, max_size=30))
    if draw(st.booleans()):
        body = [f"[{SECTION}]", *body]
    if draw(st.integers(0, 9)) == 0:  # now and then a huge repeat
        body += [draw(lines)] * draw(st.integers(1000, 5000))
    sep = draw(st.sampled_from(["\n", "\r\n", "\r", "\x00"]))
    return sep.join(body) + draw(st.sampled_from(["", sep, "\\"]))


def to_bytes(text: str) -> bytes:
    """`text` as file bytes: lone surrogates become bad bytes (U+DCxx) or bad UTF-8 (others)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


unit_bytes = st.one_of(
    unit_texts().map(to_bytes),
    st.binary(max_size=300),
    st.tuples(unit_texts(), st.binary(max_size=20)).map(lambda t: to_bytes(t[0]) + t[1]),
)

# ---------------------------------------------------------------------------------------------
# helpers


def check_problems(problems: list[Problem]) -> None:
    for problem in problems:
        assert isinstance(problem, Problem)
        assert problem.path
        assert problem.line >= 0
        assert problem.severity in ("error", "warning")
        text = str(problem)  # never raises (no lone surrogates reach a message)
        text.encode("utf-8")
        assert "\n" not in text


def check_spec(spec: UnitSpec | None) -> None:
    if spec is None:
        return
    assert 0 <= spec.priority <= 999
    assert 1 <= spec.gpus <= 64
    assert spec.memory is None or 0 < spec.memory <= SIZE_MAX
    assert len(spec.devices) <= 64
    assert all(d.isascii() for d in spec.devices)


# ---------------------------------------------------------------------------------------------
# properties


@FUZZ
@given(size_texts)
def test_parse_size_gives_a_bounded_value_or_value_error(text: str) -> None:
    try:
        value = parse_size(text)
    except ValueError:
        return
    assert 0 < value <= SIZE_MAX
    assert text.strip(" \t\n\r")[0] in string.digits


@FUZZ
@given(st.one_of(unit_texts(), st.text(), odd_text))
def test_parse_sections_never_raises(text: str) -> None:
    issues: list[TextIssue] = []
    headers: list[tuple[str, int]] = []
    entries = parse_sections(text, issues, headers)
    for entry in entries:
        assert isinstance(entry, Entry)
        assert entry.line >= 1
        assert entry.key
        assert "\n" not in entry.value and "\x00" not in entry.value
    for issue in issues:
        assert issue.line >= 1
        issue.message.encode("utf-8")


@FUZZ
@given(st.lists(unit_bytes, min_size=1, max_size=4))
def test_load_files_gives_a_spec_or_located_problems(datas: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, data in enumerate(datas):
            real = Path(tmp) / f"{i}.conf"
            real.write_bytes(data)
            files.append(UnitFile(f"{ETC}/x.service.d/{i}.conf", str(real)))
        loader = Loader(UnitIndex(tmp, search_path=()))
        spec, problems = loader.load_files("x.service", files)
    check_problems(problems)
    check_spec(spec)
    if spec is not None:
        assert not any(p.severity == "error" for p in problems)


HOSTILE_NAMES = st.one_of(
    st.sampled_from(
        [
            "x.service",
            "x@.service",
            "x@a.service",
            "bad name.service",
            "caf\u00e9.service",
            "@x.service",
            "\n.service",
            "x.service.d",
            "a" * 247 + ".service",
        ]
    ),
    st.text(alphabet=string.ascii_letters + "@.-\\:_ \u00e9", min_size=1, max_size=20)
    .map(lambda s: s + ".service")
    .filter(lambda s: s != "goodunit.service"),
)
KINDS = st.sampled_from(["file", "fifo", "dir", "loop", "dangling", "devnull", "huge", "link"])


@st.composite
def hostile_trees(draw: st.DrawFn) -> list[tuple[str, str, bytes]]:
    """(relative path, kind, content) entries for one root."""
    out = []
    for _ in range(draw(st.integers(0, 6))):
        name = draw(HOSTILE_NAMES)
        where = draw(st.sampled_from([ETC, LIB, "/run/systemd/generator"]))
        if draw(st.booleans()):  # a drop-in
            dropin = draw(st.sampled_from(["a.conf", "override.conf", GATE_DROPIN_NAME, "zz.conf"]))
            path = f"{where}/{name}.d/{dropin}"
        else:
            path = f"{where}/{name}"
        out.append((path, draw(KINDS), draw(unit_bytes)))
    return out


GOOD = b"[Service]\nExecStart=/bin/true\n[X-GPUSlice]\nPriority=5\nGPUs=2\n"


def build(root: Path, entries: list[tuple[str, str, bytes]]) -> None:
    good = root / ETC.lstrip("/") / "goodunit.service"
    good.parent.mkdir(parents=True, exist_ok=True)
    good.write_bytes(GOOD)
    for path, kind, data in entries:
        real = root / path.lstrip("/")
        try:
            real.parent.mkdir(parents=True, exist_ok=True)
            if real.exists() or real.is_symlink():
                continue
            if kind == "file":
                real.write_bytes(data)
            elif kind == "fifo":
                os.mkfifo(real)
            elif kind == "dir":
                real.mkdir()
            elif kind == "loop":
                real.symlink_to(real.name)
            elif kind == "dangling":
                real.symlink_to("nowhere")
            elif kind == "devnull":
                real.symlink_to("/dev/null")
            elif kind == "huge":
                real.write_bytes(data + b"#" * (1 << 20))
            else:  # a link to the good unit
                real.symlink_to(f"{ETC}/goodunit.service")
        except OSError:  # a name the file system refuses (too long, ...)
            continue


@settings(FUZZ, max_examples=max(EXAMPLES // 4, 20))
@given(hostile_trees())
def test_scan_survives_hostile_trees(entries: list[tuple[str, str, bytes]]) -> None:
    root = Path(tempfile.mkdtemp())
    try:
        build(root, entries)
        result = scan(root)  # never raises, never blocks on a FIFO
    finally:
        shutil.rmtree(root)
    check_problems(result.problems)
    for spec in result.specs.values():
        check_spec(spec)
    # the valid unit next to the hostile ones still gets its spec (no generated name is one of
    # its drop-in directories: it has no dash, and `service.d` is never generated)
    good = result.specs.get("goodunit.service")
    assert good is not None
    assert (good.priority, good.gpus) == (5, 2)
