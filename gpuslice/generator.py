"""systemd generator: give every annotated unit the GPU gate drop-in.

systemd runs this at boot and at every daemon-reload as
`gpuslice-generator NORMAL_DIR [EARLY_DIR LATE_DIR]`. For each valid annotated unit it writes
`NORMAL_DIR/UNIT.d/gpuslice-gate.conf`. The drop-in resets ExecStartPre= so the gate runs first,
then puts back the unit's own ExecStartPre= lines from the files applied before it. It also
writes `NORMAL_DIR/gpuslice.service.d/gpuslice-runtime-dir.conf`, which tells the controller
the runtime_dir the gates name (paths.RUNTIME_DIR_RECORD says why).

If the generator failed, every annotated unit would start ungated, so nothing stops it: each unit
is planned and written on its own, and a problem with one (an unreadable file, a name too long
for a drop-in directory, a line that would not be one line) is one line on stderr while every
other unit still gets its gate. A bad config.yaml means a warning, and its settings that are
valid (the running controller keeps the last good config), else the defaults. `main`
always exits 0 once it has written what it could.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice import safefile
from gpuslice.annotations import Loader, Scan, scan
from gpuslice.config import (
    Config,
    ConfigError,
    load_config_with_warnings,
    located,
    read_pinned_runtime_dir,
)
from gpuslice.envsyntax import NAME_MAX
from gpuslice.paths import (
    CONFIG_PATH,
    ENV_FILE_SPECIFIER,
    GATE_DROPIN_NAME,
    GATE_NAME,
    GATE_PIPE_SPECIFIER,
    GATE_RETRY_ENV,
    RUNTIME_DIR_DROPIN,
    RUNTIME_DIR_ENV,
    RUNTIME_DIR_RECORD,
)
from gpuslice.unitfiles import (
    UnitIndex,
    fits_dropin_dir,
    has_control_character,
    is_instance,
    is_valid_unit_name,
    printable,
    template_of,
)

_PROG = "gpuslice-generator"
DEFAULTS = Config()

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
        if i > 0 and name >= GATE_DROPIN_NAME:
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


def _one_line(line: str) -> str:
    """`line`, or ValueError when it holds a newline or another control character (a tab is
    whitespace to systemd and stays): a drop-in line must never become two."""
    if has_control_character(line):
        raise ValueError(f"refusing to write a line with a control character: {printable(line)}")
    return line


def _no_continuation(value: str) -> str:
    """A copied value as a line that ends where systemd ended it. A value may end in an odd
    number of backslashes (its line ended in one and a blank, `ExecStartPre=/bin/a \\ `,
    which systemd strips after seeing no continuation): written bare, the backslash joined
    the gate's next line to it (the unit's next ExecStartPre=, which then never ran, or the
    gate's retry). A blank after it ends the line as it did in the unit's file."""
    trailing = len(value) - len(value.rstrip("\\"))
    return value + " " if trailing % 2 == 1 else value


def _seconds(value: float) -> str:
    """`0.5`, `2`: plain decimals (milliseconds at most), as the gate reads them."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"gate_retry_seconds must be a number > 0, got {value!r}")
    return f"{value:.3f}".rstrip("0").rstrip(".")


# The gate's second argument, the same in every drop-in whatever gate_retry_seconds is: its
# retry comes in GATE_RETRY_ENV, which the gate reads first. systemd matches the command a
# start runs by its whole command line at a daemon-reload: one that changed (a new retry) had
# vanished, and the start, once its gate passed, skipped the unit's own ExecStartPre= lines.
# "0.5" is what drop-ins of versions before GATE_RETRY_ENV wrote with the default retry, so
# that a start waiting at its gate while the upgrade's daemon-reload runs keeps its lines too.
# Never change it.
GATE_LINE_RETRY = "0.5"


def gate_dropin(
    libexec_dir: str,
    runtime_dir: str,
    exec_start_pre: list[str],
    retry: float = DEFAULTS.gate_retry_seconds,
) -> str:
    """The text of one gate drop-in. The retry is always written out (GATE_RETRY_ENV), so
    its default lives only in config.py's SETTINGS."""
    lines = [
        HEADER.rstrip("\n"),
        "[Unit]",
        "Wants=gpuslice.service",
        "After=gpuslice.service",
        "",
        "[Service]",
        "ExecStartPre=",
        f"ExecStartPre=+{_escape_specifiers(libexec_dir)}/{GATE_NAME} %n {GATE_LINE_RETRY} "
        f"{_escape_specifiers(runtime_dir)}/{GATE_PIPE_SPECIFIER}",
        *(f"ExecStartPre={_no_continuation(v)}" for v in exec_start_pre),
        f"Environment={GATE_RETRY_ENV}={_seconds(retry)}",
        f"EnvironmentFile=-{_escape_specifiers(runtime_dir)}/{ENV_FILE_SPECIFIER}",
        "TimeoutStartSec=infinity",
    ]
    return "\n".join(_one_line(line) for line in lines) + "\n"


@dataclass
class Plan:
    """Unit name -> text of its gpuslice-gate.conf, and one line per unit left without the
    gate it needs."""

    dropins: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def _reason(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def plan(
    loader: Loader,
    result: Scan,
    libexec_dir: str,
    runtime_dir: str,
    retry: float = DEFAULTS.gate_retry_seconds,
) -> Plan:
    """The drop-ins to write, each unit planned on its own (never raises).

    A template's gate covers every instance: systemd applies `foo@.service.d/` to `foo@a.service`.
    An instance gets a gate of its own only when the template's would be wrong for it: when its
    own files add ExecStartPre= lines applied before the gate (the template's gate would reset
    them). Its file has the same name, so it hides the template's. An unmanaged instance of a
    managed template gets a file that only hides the template's gate. An instance whose name is
    too long for a drop-in directory can only have its template's gate: an error when that is
    not the right one for it.
    """
    out = Plan()

    def gate_for(unit: str) -> str:
        return gate_dropin(
            libexec_dir, runtime_dir, exec_start_pre_before_gate(loader, unit), retry
        )

    def fail(unit: str, message: str) -> None:
        out.errors.append(f"{printable(unit)}: {message}")

    for unit in sorted(result.specs):
        if is_instance(unit) and template_of(unit) in result.specs:
            continue
        try:
            if not is_valid_unit_name(unit):
                fail(unit, "not a valid unit name (unit not gated)")
            elif not fits_dropin_dir(unit):
                fail(
                    unit,
                    f"name too long for a drop-in directory ({len(unit)} characters; at most "
                    f"{NAME_MAX - 2}) (unit not gated)",
                )
            else:
                out.dropins[unit] = gate_for(unit)
        except Exception as e:
            fail(unit, f"cannot plan its gate: {_reason(e)} (unit not gated)")

    instances = {u for u in result.specs if is_instance(u)}
    instances.update(result.invalid, result.unannotated_instances)
    try:
        instances.update(loader.index.instance_dropin_names())
    except Exception as e:
        out.errors.append(f"cannot list the instances' drop-in directories: {_reason(e)}")
    for unit in sorted(instances):
        template = template_of(unit)
        if not is_instance(unit) or template not in result.specs:
            continue
        try:
            unmanaged = unit in result.invalid or unit in result.unannotated_instances
            text = MASK_TEXT if unmanaged else gate_for(unit)
            template_gate = out.dropins.get(template)
            if not unmanaged and text == template_gate:
                continue
            if not is_valid_unit_name(unit):
                fail(unit, "not a valid unit name (unit not gated correctly)")
            elif not fits_dropin_dir(unit):
                what = (
                    "its template's gate applies although the unit is not managed"
                    if unmanaged
                    else "its template's gate applies and resets its own ExecStartPre= lines"
                )
                fail(
                    unit,
                    f"name too long for a drop-in directory of its own ({len(unit)} "
                    f"characters; at most {NAME_MAX - 2}): {what} (unit not gated correctly)",
                )
            else:
                out.dropins[unit] = text
        except Exception as e:
            fail(unit, f"cannot plan its gate: {_reason(e)} (unit not gated correctly)")
    return out


def gate_errors(loader: Loader, result: Scan) -> list[str]:
    """What gpuslice-generator says of the units it cannot gate as they must be (`plan`'s
    errors), for `gpuslice check` to say the same: which gates differ does not depend on the
    directories and retry they name, only on the lines they copy."""
    from gpuslice.paths import LIBEXEC_DIR

    return plan(loader, result, LIBEXEC_DIR, DEFAULTS.runtime_dir).errors


def _settings(root: Path) -> tuple[str, float]:
    """runtime_dir and gate_retry_seconds. runtime_dir is the one gpuslice.service recorded
    this boot (paths.RUNTIME_DIR_RECORD), whatever config.yaml says: gates naming another
    than the running controller's sent its units to read no env file (every GPU visible) or
    a stale one (another unit's GPUs). Else, and for the retry, config.yaml's. A file with
    errors gives those of the two it sets validly, the defaults for the rest: the running
    controller keeps the last good config, so a typo in another key must not point the
    gates' EnvironmentFile= away from where it writes."""
    path = root / CONFIG_PATH.lstrip("/")
    pinned = read_pinned_runtime_dir(root / RUNTIME_DIR_RECORD.lstrip("/"))
    try:
        config, warnings = load_config_with_warnings(path)
    except ConfigError as e:
        runtime_dir = pinned or e.valid.get("runtime_dir", DEFAULTS.runtime_dir)
        retry = e.valid.get("gate_retry_seconds", DEFAULTS.gate_retry_seconds)
        kept = _kept(runtime_dir, retry, pinned is not None)
        for problem in e.problems:
            _warn(f"{problem} ({kept})")
        return runtime_dir, retry
    except Exception as e:  # belt and braces: config.py raises only ConfigError
        runtime_dir = pinned or DEFAULTS.runtime_dir
        retry = DEFAULTS.gate_retry_seconds
        _warn(f"{path}: {_reason(e)} ({_kept(runtime_dir, retry, pinned is not None)})")
        return runtime_dir, retry
    for warning in warnings:
        _warn(warning)
    if pinned is not None and pinned != config.runtime_dir:
        _warn(
            f"{located(path, 'runtime_dir')}: runtime_dir: {config.runtime_dir} takes effect "
            f"at the next boot: gpuslice.service runs with {pinned} this boot, which the "
            "gates keep naming"
        )
    return pinned or config.runtime_dir, config.gate_retry_seconds


def _kept(runtime_dir: str, retry: float, pinned: bool = False) -> str:
    """What a generator run with a bad config.yaml uses, in words."""
    if pinned:
        return (
            f"using runtime_dir {runtime_dir}, gpuslice.service's this boot, and "
            f"gate_retry_seconds {retry:g}: the file's if valid, else the default"
        )
    if (runtime_dir, retry) == (DEFAULTS.runtime_dir, DEFAULTS.gate_retry_seconds):
        return f"using the defaults runtime_dir {runtime_dir}, gate_retry_seconds {retry:g}"
    return (
        f"using runtime_dir {runtime_dir}, gate_retry_seconds {retry:g}: "
        "the file's where valid, else the defaults"
    )


def runtime_dir_dropin(runtime_dir: str) -> str:
    """gpuslice.service's drop-in that tells the controller, when it starts, which runtime_dir
    the gates name (config.yaml may say another by then)."""
    lines = [
        "# Added by gpuslice-generator: the runtime_dir the GPU gates name.",
        "[Service]",
        f"Environment={RUNTIME_DIR_ENV}={_escape_specifiers(runtime_dir)}",
    ]
    return "\n".join(_one_line(line) for line in lines) + "\n"


def _warn(message: str, severity: str = "warning") -> None:
    print(f"{_PROG}: {severity}: {printable(message, 2000)}", file=sys.stderr)


def write_whole(path: Path, text: str) -> None:
    """Write `path` whole or not at all (`safefile.write_atomic`): the text goes to a hidden
    name without `.conf` (which systemd never reads) in the same directory, renamed over
    `path` once all of it is there, and removed when anything fails. Written in place, a
    drop-in cut short by a full /run (ENOSPC after the first pages) or by systemd killing the
    generator at its timeout stayed and was applied: its gate without the EnvironmentFile=
    line after it (every GPU visible), or a unit's own ExecStartPre= line cut mid-word and
    run, while the message said the unit was not gated. One killed leaves its temporary file,
    which systemd removes with the rest of the generator's directory before its next run
    (lookup_paths_flush_generator)."""
    safefile.write_atomic(path, text.encode("utf-8"))


def generate(
    normal_dir: str | os.PathLike[str],
    root: str | os.PathLike[str] = "/",
    libexec_dir: str | None = None,
    runtime_dir: str | None = None,
) -> int:
    """Write the gate drop-ins; returns how many files were written. Never raises: what cannot
    be done for one unit is reported on stderr and the others are still written."""
    if libexec_dir is None:
        from gpuslice.paths import LIBEXEC_DIR

        libexec_dir = LIBEXEC_DIR
    configured_runtime_dir, retry = _settings(Path(root))
    runtime_dir = runtime_dir or configured_runtime_dir
    try:
        loader = Loader(UnitIndex(root))
        result = scan(root, loader)
    except Exception as e:
        _warn(f"cannot read the unit files: {_reason(e)} (no unit gated)", "error")
        return 0
    for problem in result.problems:
        suffix = " (unit not managed)" if problem.severity == "error" else ""
        # what anyone may read (`public`): at boot a generator's stderr goes to the kernel's
        # log, which any user reads where dmesg_restrict is 0; `gpuslice check` tells root all
        _warn(f"{problem.public()}{suffix}", problem.severity)
    planned = plan(loader, result, libexec_dir, runtime_dir, retry)
    for error in planned.errors:
        _warn(error, "error")
    out_dir = Path(normal_dir)
    try:
        own = out_dir / RUNTIME_DIR_DROPIN
        own.parent.mkdir(parents=True, exist_ok=True)
        write_whole(own, runtime_dir_dropin(runtime_dir))
    except Exception as e:
        _warn(
            f"cannot write {RUNTIME_DIR_DROPIN}: {_reason(e)} (gpuslice.service takes the "
            "runtime_dir it recorded this boot, else config.yaml's)",
            "error",
        )
    written = 0
    for unit, text in planned.dropins.items():
        try:
            dropin_dir = out_dir / f"{unit}.d"
            dropin_dir.mkdir(parents=True, exist_ok=True)
            write_whole(dropin_dir / GATE_DROPIN_NAME, text)
            written += 1
        except Exception as e:
            gated = "not gated correctly" if is_instance(unit) else "not gated"
            _warn(f"{printable(unit)}: cannot write its gate: {_reason(e)} (unit {gated})", "error")
    return written


def main(argv: list[str] | None = None, root: str = "/") -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 3):
        print(f"usage: {_PROG} NORMAL_DIR [EARLY_DIR LATE_DIR]", file=sys.stderr)
        return 2
    try:
        generate(args[0], root=root)
    except Exception as e:  # belt and braces: generate reports and goes on by itself
        _warn(f"{_reason(e)}", "error")
    return 0


if __name__ == "__main__":
    sys.exit(main())
