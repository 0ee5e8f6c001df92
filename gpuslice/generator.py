"""systemd generator: give every annotated unit the GPU gate drop-in.

systemd runs this at boot and at every daemon-reload as
`gpuslice-generator NORMAL_DIR [EARLY_DIR LATE_DIR]`. For each valid annotated unit it writes
`NORMAL_DIR/UNIT.d/gpuslice-gate.conf`. The drop-in resets ExecStartPre= so the gate runs first,
then puts back the unit's own ExecStartPre= lines from the files applied before it. Problems go
to stderr one line each; a bad unit never makes the generator fail.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gpuslice.annotations import Loader, Scan, scan
from gpuslice.unitfiles import UnitIndex, is_instance, template_of

DROPIN_NAME = "gpuslice-gate.conf"
DEFAULT_RETRY = 0.5  # seconds; config.yaml gate_retry_seconds
DEFAULT_RUNTIME_DIR = "/run/gpuslice"
CONFIG_PATH = "/etc/gpuslice/config.yaml"
_PROG = "gpuslice-generator"

HEADER = "# Added by gpuslice-generator: the GPU gate for this unit.\n"
# An instance that is not managed although its template is (its own drop-ins make it invalid, or
# its own unit file has no annotation) gets this file in place of its template's gate: a drop-in
# with the same file name in the same directory level hides the template's.
MASK_TEXT = (
    "# Added by gpuslice-generator: this instance is not managed by gpuslice\n"
    "# (see the generator's messages), so this file hides its template's GPU gate.\n"
)


def _escape_specifiers(path: str) -> str:
    return path.replace("%", "%%")


def exec_start_pre_before_gate(loader: Loader, unit: str) -> list[str]:
    """ExecStartPre= values in effect just before gpuslice-gate.conf is applied."""
    files = loader.files(unit) or []
    values: list[str] = []
    for i, unit_file in enumerate(files):
        name = unit_file.path.rsplit("/", 1)[-1]
        if i > 0 and name >= DROPIN_NAME:
            break
        try:
            entries = loader.parsed(unit_file).entries
        except OSError:
            continue
        for entry in entries:
            if entry.section == "Service" and entry.key == "ExecStartPre":
                if entry.value == "":
                    values.clear()
                else:
                    values.append(entry.value)
    return values


def gate_dropin(
    libexec_dir: str, runtime_dir: str, exec_start_pre: list[str], retry: float = DEFAULT_RETRY
) -> str:
    lines = [
        HEADER.rstrip("\n"),
        "[Unit]",
        "Wants=gpuslice.service",
        "After=gpuslice.service",
        "",
        "[Service]",
        "ExecStartPre=",
        f"ExecStartPre=+{_escape_specifiers(libexec_dir)}/gpuslice-gate %n"
        + ("" if retry == DEFAULT_RETRY else f" {retry:g}"),
        *(f"ExecStartPre={v}" for v in exec_start_pre),
        f"EnvironmentFile=-{_escape_specifiers(runtime_dir)}/env/%n.env",
        "TimeoutStartSec=infinity",
    ]
    return "\n".join(lines) + "\n"


def plan(
    loader: Loader,
    result: Scan,
    libexec_dir: str,
    runtime_dir: str,
    retry: float = DEFAULT_RETRY,
) -> dict[str, str]:
    """Unit name -> text of its gpuslice-gate.conf.

    A template's gate covers every instance: systemd applies `foo@.service.d/` to `foo@a.service`.
    An instance gets a gate of its own only when the template's would be wrong for it: when its
    own files add ExecStartPre= lines applied before the gate (the template's gate would reset
    them). Its file has the same name, so it hides the template's. An unmanaged instance of a
    managed template gets a file that only hides the template's gate.
    """
    out: dict[str, str] = {}

    def gate_for(unit: str) -> str:
        return gate_dropin(
            libexec_dir, runtime_dir, exec_start_pre_before_gate(loader, unit), retry
        )

    for unit in sorted(result.specs):
        if not is_instance(unit) or template_of(unit) not in result.specs:
            out[unit] = gate_for(unit)
    instances = {u for u in result.specs if is_instance(u)}
    instances.update(
        loader.index.instance_dropin_names(), result.invalid, result.unannotated_instances
    )
    for unit in sorted(instances):
        template = template_of(unit)
        if not is_instance(unit) or template not in result.specs:
            continue
        if unit in result.invalid or unit in result.unannotated_instances:
            out[unit] = MASK_TEXT
            continue
        text = gate_for(unit)
        if text != out[template]:
            out[unit] = text
    return out


def _settings(root: Path) -> tuple[str, float]:
    """runtime_dir and gate_retry_seconds from config.yaml; the defaults if it is bad."""
    path = root / CONFIG_PATH.lstrip("/")
    if not path.exists():
        return DEFAULT_RUNTIME_DIR, DEFAULT_RETRY
    from gpuslice.config import ConfigError, load_config_with_warnings  # yaml only when needed

    try:
        config, warnings = load_config_with_warnings(path)
    except ConfigError as e:
        for problem in e.problems:
            _warn(f"{problem} (using the default runtime_dir {DEFAULT_RUNTIME_DIR})")
        return DEFAULT_RUNTIME_DIR, DEFAULT_RETRY
    for warning in warnings:
        _warn(warning)
    return config.runtime_dir, config.gate_retry_seconds


def _warn(message: str, severity: str = "warning") -> None:
    print(f"{_PROG}: {severity}: {message}", file=sys.stderr)


def generate(
    normal_dir: str | os.PathLike[str],
    root: str | os.PathLike[str] = "/",
    libexec_dir: str | None = None,
    runtime_dir: str | None = None,
) -> int:
    """Write the gate drop-ins; returns how many files were written."""
    if libexec_dir is None:
        from gpuslice.paths import LIBEXEC_DIR

        libexec_dir = LIBEXEC_DIR
    configured_runtime_dir, retry = _settings(Path(root))
    runtime_dir = runtime_dir or configured_runtime_dir
    loader = Loader(UnitIndex(root))
    result = scan(root, loader)
    for problem in result.problems:
        suffix = " (unit not managed)" if problem.severity == "error" else ""
        _warn(f"{problem}{suffix}", problem.severity)
    out_dir = Path(normal_dir)
    planned = plan(loader, result, libexec_dir, runtime_dir, retry)
    for unit, text in planned.items():
        dropin_dir = out_dir / f"{unit}.d"
        dropin_dir.mkdir(parents=True, exist_ok=True)
        (dropin_dir / DROPIN_NAME).write_text(text, encoding="utf-8")
    return len(planned)


def main(argv: list[str] | None = None, root: str = "/") -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 3):
        print(f"usage: {_PROG} NORMAL_DIR [EARLY_DIR LATE_DIR]", file=sys.stderr)
        return 2
    generate(args[0], root=root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
