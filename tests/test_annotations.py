"""[X-GPUSlice] parsing, merging over drop-ins, validation messages word for word, scanning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuslice.annotations import KEYS, Problem, load_spec, scan
from gpuslice.core.model import UnitKind, UnitSpec

ETC = "/etc/systemd/system"
LIB = "/usr/lib/systemd/system"

SERVICE = "[Unit]\nDescription=job\n\n[Service]\nExecStart=/bin/true\n"


def write(root: Path, path: str, text: str) -> None:
    real = root / path.lstrip("/")
    real.parent.mkdir(parents=True, exist_ok=True)
    real.write_text(text)


def unit(section: str) -> str:
    """A unit whose [X-GPUSlice] header is on line 7 and its first key on line 8."""
    return SERVICE + "\n[X-GPUSlice]\n" + section


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        pytest.param(
            "Priority=90\n", UnitSpec("x.service", 90, source=f"{ETC}/x.service"), id="defaults"
        ),
        pytest.param(
            "Priority=0\nType=background\nGPUs=2\nRequeue=no\n",
            UnitSpec("x.service", 0, UnitKind.BACKGROUND, 2, False, f"{ETC}/x.service"),
            id="all-keys",
        ),
        pytest.param(
            "Priority=999\nType=on-demand\n",
            UnitSpec("x.service", 999, source=f"{ETC}/x.service"),
            id="max",
        ),
        pytest.param(
            "Priority=5\nPriority=7\n",
            UnitSpec("x.service", 7, source=f"{ETC}/x.service"),
            id="repeated-key-last-wins",
        ),
        pytest.param(
            "Priority=\\\n 42\n",
            UnitSpec("x.service", 42, source=f"{ETC}/x.service"),
            id="continuation",
        ),
        pytest.param(
            "Priority=20\nMemory=20GiB\nDevices=0, GPU-8f6c-aa\n",
            UnitSpec(
                "x.service",
                20,
                source=f"{ETC}/x.service",
                memory=20 << 30,
                devices=("0", "GPU-8f6c-aa"),
            ),
            id="memory-and-devices",
        ),
        pytest.param(
            "Priority=20\nMemory=512M\n",
            UnitSpec("x.service", 20, source=f"{ETC}/x.service", memory=512 << 20),
            id="memory-megabytes",
        ),
        pytest.param(
            "# Priority=1\n; GPUs=3\nPriority=8\n",
            UnitSpec("x.service", 8, source=f"{ETC}/x.service"),
            id="comments",
        ),
    ],
)
def test_valid(tmp_path: Path, section: str, expected: UnitSpec) -> None:
    write(tmp_path, f"{ETC}/x.service", unit(section))
    assert load_spec("x.service", tmp_path) == (expected, [])


@pytest.mark.parametrize(
    ("value", "requeue"),
    [(v, True) for v in ("yes", "true", "on", "1", "YES", "y", "t")]
    + [(v, False) for v in ("no", "false", "off", "0", "Off", "n", "f")],
)
def test_requeue_accepts_systemd_booleans(tmp_path: Path, value: str, requeue: bool) -> None:
    write(tmp_path, f"{ETC}/x.service", unit(f"Priority=1\nRequeue={value}\n"))
    spec, problems = load_spec("x.service", tmp_path)
    assert problems == []
    assert spec is not None
    assert spec.requeue is requeue


X = f"{ETC}/x.service"


@pytest.mark.parametrize(
    ("section", "messages"),
    [
        pytest.param(
            "Priority=high\n",
            [f'{X}:8: [X-GPUSlice] Priority: expected an integer 0-999, got "high"'],
            id="priority-high",
        ),
        pytest.param(
            "Priority=1000\n",
            [f'{X}:8: [X-GPUSlice] Priority: expected an integer 0-999, got "1000"'],
            id="priority-too-big",
        ),
        pytest.param(
            "Priority=-1\n",
            [f'{X}:8: [X-GPUSlice] Priority: expected an integer 0-999, got "-1"'],
            id="priority-negative",
        ),
        pytest.param(
            "Priority=1\nType=sometimes\n",
            [f'{X}:9: [X-GPUSlice] Type: expected one of on-demand, background, got "sometimes"'],
            id="type-sometimes",
        ),
        pytest.param(
            "Priority=1\nMemory=lots\n",
            [
                f"{X}:9: [X-GPUSlice] Memory: expected a size such as 512M, 20G or 20GiB "
                '(binary units), got "lots"'
            ],
            id="memory-lots",
        ),
        pytest.param(
            "Priority=1\nDevices=first\n",
            [
                f"{X}:9: [X-GPUSlice] Devices: expected GPU indices or UUIDs separated by "
                'commas or spaces (e.g. 0,1 or GPU-8f6c...), got "first"'
            ],
            id="devices-first",
        ),
        pytest.param(
            "Priority=1\nGPUs=0\n",
            [f'{X}:9: [X-GPUSlice] GPUs: expected an integer >= 1, got "0"'],
            id="gpus-0",
        ),
        pytest.param(
            "Priority=1\nRequeue=maybe\n",
            [
                f"{X}:9: [X-GPUSlice] Requeue: expected a boolean (yes/no, true/false, on/off, "
                f'1/0), got "maybe"'
            ],
            id="requeue-maybe",
        ),
        pytest.param(
            "Type=background\n",
            [f"{X}:7: [X-GPUSlice] Priority: missing, expected an integer 0-999"],
            id="missing-priority",
        ),
        pytest.param(
            "",
            [f"{X}:7: [X-GPUSlice] Priority: missing, expected an integer 0-999"],
            id="empty-section",
        ),
        pytest.param(
            "Priority=high\nType=sometimes\nGPUs=0\nRequeue=maybe\n",
            [
                f'{X}:8: [X-GPUSlice] Priority: expected an integer 0-999, got "high"',
                f'{X}:9: [X-GPUSlice] Type: expected one of on-demand, background, got "sometimes"',
                f'{X}:10: [X-GPUSlice] GPUs: expected an integer >= 1, got "0"',
                f"{X}:11: [X-GPUSlice] Requeue: expected a boolean (yes/no, true/false, on/off, "
                f'1/0), got "maybe"',
            ],
            id="every-problem-collected",
        ),
        pytest.param(
            "Priority=1\nPriority=\n",
            [f"{X}:7: [X-GPUSlice] Priority: missing, expected an integer 0-999"],
            id="empty-assignment-resets",
        ),
    ],
)
def test_errors(tmp_path: Path, section: str, messages: list[str]) -> None:
    write(tmp_path, X, unit(section))
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is None
    assert [str(p) for p in problems] == messages
    assert {p.severity for p in problems} == {"error"}
    assert {p.unit for p in problems} == {"x.service"}


def test_problem_fields(tmp_path: Path) -> None:
    write(tmp_path, X, unit("Priority=high\n"))
    _spec, problems = load_spec("x.service", tmp_path)
    assert problems == [
        Problem(X, 8, "Priority", 'expected an integer 0-999, got "high"', "error", "x.service")
    ]


@pytest.mark.parametrize(
    ("section", "messages"),
    [
        pytest.param(
            "Priority=1\nColour=blue\n",
            [
                f"{X}:9: [X-GPUSlice] Colour: unknown key, ignored "
                "(known keys: Priority, Type, GPUs, Requeue, Memory, Devices)"
            ],
            id="unknown-key",
        ),
        pytest.param(
            "Priority=1\njunk line\n",
            [f"{X}:9: [X-GPUSlice] missing '=', line ignored"],
            id="line-without-equals",
        ),
        pytest.param(
            "Priority=high\nPriority=3\n",
            [
                f'{X}:8: [X-GPUSlice] Priority: expected an integer 0-999, got "high" '
                f"(overridden at {X}:9)"
            ],
            id="bad-value-overridden",
        ),
    ],
)
def test_warnings_keep_the_unit_managed(tmp_path: Path, section: str, messages: list[str]) -> None:
    write(tmp_path, X, unit(section))
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is not None
    assert [str(p) for p in problems] == messages
    assert {p.severity for p in problems} == {"warning"}


def test_not_annotated_masked_or_missing(tmp_path: Path) -> None:
    write(tmp_path, f"{ETC}/plain.service", SERVICE + "[X-Other]\nPriority=1\n")
    write(tmp_path, f"{LIB}/masked.service", unit("Priority=1\n"))
    (tmp_path / ETC.lstrip("/") / "masked.service").symlink_to("/dev/null")
    for name in ("plain.service", "masked.service", "absent.service"):
        assert load_spec(name, tmp_path) == (None, [])


def test_key_table_matches_unit_spec() -> None:
    fields = set(UnitSpec.__dataclass_fields__) - {"name", "source"}
    assert {k.field for k in KEYS} == fields


# ---------------------------------------------------------------------------------------------
# drop-ins


def test_dropins_override_key_by_key_in_systemd_order(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/x.service", unit("Priority=50\nType=background\nGPUs=2\n"))
    write(tmp_path, f"{LIB}/x.service.d/10-vendor.conf", "[X-GPUSlice]\nGPUs=4\nPriority=40\n")
    # override.conf sorts after 10-vendor.conf: it wins for Priority; GPUs stays 4
    write(tmp_path, f"{ETC}/x.service.d/override.conf", "[X-GPUSlice]\nPriority=10\n")
    spec, problems = load_spec("x.service", tmp_path)
    assert problems == []
    assert spec == UnitSpec(
        "x.service", 10, UnitKind.BACKGROUND, 4, True, f"{ETC}/x.service.d/override.conf"
    )


def test_annotation_only_in_dropin(tmp_path: Path) -> None:
    # what `systemctl edit x.service` produces
    write(tmp_path, f"{LIB}/x.service", SERVICE)
    write(tmp_path, f"{ETC}/x.service.d/override.conf", "[X-GPUSlice]\nPriority=5\n")
    spec, _ = load_spec("x.service", tmp_path)
    assert spec == UnitSpec("x.service", 5, source=f"{ETC}/x.service.d/override.conf")


def test_masked_dropin_contributes_nothing(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/x.service", unit("Priority=50\n"))
    write(tmp_path, f"{LIB}/x.service.d/gpus.conf", "[X-GPUSlice]\nGPUs=8\n")
    (tmp_path / ETC.lstrip("/") / "x.service.d").mkdir(parents=True)
    (tmp_path / ETC.lstrip("/") / "x.service.d" / "gpus.conf").symlink_to("/dev/null")
    spec, _ = load_spec("x.service", tmp_path)
    assert spec is not None
    assert spec.gpus == 1


def test_error_in_dropin_names_the_dropin(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/x.service", unit("Priority=50\n"))
    write(tmp_path, f"{ETC}/x.service.d/override.conf", "# mine\n[X-GPUSlice]\nType=sometimes\n")
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is None
    assert [str(p) for p in problems] == [
        f"{ETC}/x.service.d/override.conf:3: [X-GPUSlice] Type: expected one of on-demand, "
        'background, got "sometimes"'
    ]


def test_missing_priority_points_at_first_section(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/x.service", SERVICE)
    write(tmp_path, f"{ETC}/x.service.d/a.conf", "\n[X-GPUSlice]\nGPUs=2\n")
    write(tmp_path, f"{ETC}/x.service.d/b.conf", "[X-GPUSlice]\nType=background\n")
    _spec, problems = load_spec("x.service", tmp_path)
    assert [str(p) for p in problems] == [
        f"{ETC}/x.service.d/a.conf:2: [X-GPUSlice] Priority: missing, expected an integer 0-999"
    ]


# ---------------------------------------------------------------------------------------------
# templates, instances, escaped names, scan


def test_templates_and_instances(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/train@.service", unit("Priority=70\nType=background\n"))
    write(tmp_path, f"{ETC}/train@big.service.d/gpus.conf", "[X-GPUSlice]\nGPUs=4\n")
    write(tmp_path, f"{ETC}/train@.service.d/p.conf", "[X-GPUSlice]\nPriority=60\n")
    template, _ = load_spec("train@.service", tmp_path)
    assert template == UnitSpec(
        "train@.service", 60, UnitKind.BACKGROUND, source=f"{ETC}/train@.service.d/p.conf"
    )
    big, _ = load_spec("train@big.service", tmp_path)
    assert big is not None
    assert (big.name, big.priority, big.gpus) == ("train@big.service", 60, 4)

    result = scan(tmp_path)
    assert set(result.specs) == {"train@.service", "train@big.service"}
    assert template is not None
    assert result.spec_for("train@small.service") == template.for_instance("train@small.service")
    assert result.spec_for("train@big.service") == big
    assert result.spec_for("train@.service") == template
    assert result.spec_for("other@x.service") is None


def test_instance_dropin_without_annotation_is_not_listed(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/t@.service", unit("Priority=70\n"))
    write(tmp_path, f"{ETC}/t@a.service.d/env.conf", "[Service]\nEnvironment=A=1\n")
    result = scan(tmp_path)
    assert set(result.specs) == {"t@.service"}
    assert result.spec_for("t@a.service") == UnitSpec("t@a.service", 70, source=f"{LIB}/t@.service")


def test_instance_made_invalid_by_its_dropin(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/t@.service", unit("Priority=70\n"))
    write(tmp_path, f"{ETC}/t@bad.service.d/x.conf", "[X-GPUSlice]\nGPUs=0\n")
    result = scan(tmp_path)
    assert result.invalid == {"t@bad.service"}
    assert result.spec_for("t@bad.service") is None
    assert result.spec_for("t@good.service") is not None
    assert [str(p) for p in result.problems] == [
        f'{ETC}/t@bad.service.d/x.conf:2: [X-GPUSlice] GPUs: expected an integer >= 1, got "0"'
    ]


def test_escaped_names(tmp_path: Path) -> None:
    name = "foo\\x2dbar@.service"
    write(tmp_path, f"{LIB}/{name}", unit("Priority=3\n"))
    write(tmp_path, f"{ETC}/foo\\x2dbar@a\\x2db.service.d/o.conf", "[X-GPUSlice]\nPriority=2\n")
    result = scan(tmp_path)
    assert result.spec_for("foo\\x2dbar@z.service") == UnitSpec(
        "foo\\x2dbar@z.service", 3, source=f"{LIB}/{name}"
    )
    spec = result.spec_for("foo\\x2dbar@a\\x2db.service")
    assert spec is not None
    assert spec.priority == 2


def test_scan_collects_every_unit_and_problem(tmp_path: Path) -> None:
    write(tmp_path, f"{ETC}/good.service", unit("Priority=1\n"))
    write(tmp_path, f"{ETC}/bad.service", unit("Priority=high\nGPUs=0\n"))
    write(tmp_path, f"{ETC}/warn.service", unit("Priority=2\nColour=red\n"))
    write(tmp_path, f"{ETC}/plain.service", SERVICE)
    write(tmp_path, f"{ETC}/other.socket", unit("Priority=1\n"))
    result = scan(tmp_path)
    assert sorted(result.specs) == ["good.service", "warn.service"]
    assert result.invalid == {"bad.service"}
    assert [(p.path, p.line, p.key, p.severity) for p in result.problems] == [
        (f"{ETC}/bad.service", 8, "Priority", "error"),
        (f"{ETC}/bad.service", 9, "GPUs", "error"),
        (f"{ETC}/warn.service", 9, "Colour", "warning"),
    ]
    assert result.spec_for("bad.service") is None


def test_repeated_keys_in_other_sections_are_fine(tmp_path: Path) -> None:
    text = (
        '[Service]\nExecStart=/bin/a\nExecStart=/bin/b\nEnvironment="A=1 2" B=%n\n'
        "ExecStartPre=/bin/sh -c 'echo \\\n  hi'\n[X-GPUSlice]\nPriority=4\n"
    )
    write(tmp_path, X, text)
    spec, problems = load_spec("x.service", tmp_path)
    assert problems == []
    assert spec is not None
    assert spec.priority == 4


def test_importable_without_optional_dependencies() -> None:
    code = (
        "import sys\n"
        "for m in ('dbus_next', 'pynvml', 'yaml', 'click'):\n    sys.modules[m] = None\n"
        "import gpuslice.annotations, gpuslice.unitfiles\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_instance_file_of_its_own_does_not_inherit_the_template(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/t@.service", unit("Priority=70\n"))
    write(tmp_path, f"{LIB}/t@own.service", SERVICE)
    write(tmp_path, f"{LIB}/t@ann.service", unit("Priority=3\n"))
    result = scan(tmp_path)
    assert result.unannotated_instances == {"t@own.service"}
    assert result.spec_for("t@own.service") is None
    assert result.spec_for("t@ann.service") == UnitSpec(
        "t@ann.service", 3, source=f"{LIB}/t@ann.service"
    )
    assert result.spec_for("t@other.service") is not None
