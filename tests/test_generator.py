"""The systemd generator: gate drop-ins, ExecStartPre= order, problems on stderr, paths."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuslice import generator
from gpuslice.annotations import Loader, Scan
from gpuslice.config import SETTINGS_BY_NAME
from gpuslice.core.model import UnitSpec
from gpuslice.paths import DEFAULT_LIBEXEC_DIR, find_libexec_dir
from gpuslice.unitfiles import UnitIndex, parse_sections
from tests.test_envsafety import Hang
from tests.test_unitfiles import write as write  # re-exported: tests import it from here

ETC = "/etc/systemd/system"
LIB = "/usr/lib/systemd/system"
LIBEXEC = "/usr/lib/gpuslice"
ANNOTATION = "[X-GPUSlice]\nPriority=1\n"


def gate(
    *pre: str, runtime: str = "/run/gpuslice", libexec: str = LIBEXEC, retry: str = "0.5"
) -> str:
    return (
        "# Added by gpuslice-generator: the GPU gate for this unit.\n"
        "[Unit]\n"
        "Wants=gpuslice.service\n"
        "After=gpuslice.service\n"
        "\n"
        "[Service]\n"
        "ExecStartPre=\n"
        f"ExecStartPre=+{libexec}/gpuslice-gate %n 0.5 {runtime}/gate/%n\n"
        + "".join(f"ExecStartPre={p}\n" for p in pre)
        + f"Environment=GPUSLICE_GATE_RETRY={retry}\n"
        f"EnvironmentFile=-{runtime}/env/%n/gpuslice.env\n"
        "TimeoutStartSec=infinity\n"
    )


def run(root: Path, libexec: str | None = LIBEXEC) -> Path:
    out = root / "run/systemd/generator"
    generator.generate(out, root=root, libexec_dir=libexec)
    return out


def written(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): p.read_text() for p in sorted(out.glob("*.d/gpuslice-gate.conf"))
    }


def test_plain_unit(tmp_path: Path) -> None:
    write(tmp_path, f"{ETC}/a.service", "[Service]\nExecStart=/bin/a\n[X-GPUSlice]\nPriority=1\n")
    write(tmp_path, f"{ETC}/plain.service", "[Service]\nExecStart=/bin/b\n")
    assert written(run(tmp_path)) == {"a.service.d/gpuslice-gate.conf": gate()}


def test_the_controllers_own_unit_is_never_gated(tmp_path: Path) -> None:
    """Its gate would wait for the controller it starts (gpuslice/annotations.NEVER_GATED)."""
    write(tmp_path, f"{LIB}/gpuslice.service", "[Service]\nExecStart=/bin/gpuslice\n")
    write(tmp_path, f"{ETC}/gpuslice.service.d/prio.conf", ANNOTATION)
    write(
        tmp_path, f"{LIB}/nvidia-persistenced.service", f"[Service]\nExecStart=/bin/a\n{ANNOTATION}"
    )
    assert written(run(tmp_path)) == {}


def test_a_unit_linked_from_outside_the_search_path_under_another_name(tmp_path: Path) -> None:
    # `ln -s /opt/vlm/vlm-prod.service /etc/systemd/system/vlm.service`: systemd loads it as
    # vlm.service, so the gate goes to vlm.service
    write(tmp_path, "/opt/vlm/vlm-prod.service", f"[Service]\nExecStart=/bin/a\n{ANNOTATION}")
    (tmp_path / ETC.lstrip("/")).mkdir(parents=True)
    (tmp_path / ETC.lstrip("/") / "vlm.service").symlink_to("/opt/vlm/vlm-prod.service")
    assert written(run(tmp_path)) == {"vlm.service.d/gpuslice-gate.conf": gate()}


def test_unit_with_its_own_exec_start_pre_lines(tmp_path: Path) -> None:
    write(
        tmp_path,
        f"{LIB}/job.service",
        "[Service]\n"
        "ExecStartPre=/bin/early\n"  # dropped by the reset in 05-reset.conf
        "ExecStart=/bin/job\n"
        "[X-GPUSlice]\nPriority=10\n",
    )
    write(
        tmp_path,
        f"{LIB}/job.service.d/05-reset.conf",
        "[Service]\nExecStartPre=\nExecStartPre=-/bin/mkdir -p /var/tmp/job\n",
    )
    write(
        tmp_path,
        f"{ETC}/job.service.d/10-more.conf",
        "[Service]\nExecStartPre=/bin/sh -c 'echo \\\n  %n'\n[Unit]\nExecStartPre=/not/service\n",
    )
    # sorts after gpuslice-gate.conf: systemd appends it after ours, nothing to re-emit
    write(tmp_path, f"{ETC}/job.service.d/override.conf", "[Service]\nExecStartPre=/bin/late\n")
    assert written(run(tmp_path)) == {
        "job.service.d/gpuslice-gate.conf": gate(
            "-/bin/mkdir -p /var/tmp/job", "/bin/sh -c 'echo    %n'"
        )
    }


def test_template_covers_its_instances(tmp_path: Path) -> None:
    write(
        tmp_path,
        f"{LIB}/train@.service",
        "[Service]\nExecStartPre=/bin/prep %i\n[X-GPUSlice]\nPriority=50\n",
    )
    write(tmp_path, f"{ETC}/train@big.service.d/gpus.conf", "[X-GPUSlice]\nGPUs=2\n")
    write(tmp_path, f"{ETC}/train@env.service.d/env.conf", "[Service]\nEnvironment=A=1\n")
    write(tmp_path, f"{ETC}/train@pre.service.d/10-pre.conf", "[Service]\nExecStartPre=/bin/own\n")
    # sorts after gpuslice-gate.conf: applied after the template's gate, nothing to do
    write(tmp_path, f"{ETC}/train@late.service.d/pre.conf", "[Service]\nExecStartPre=/bin/own\n")
    write(tmp_path, f"{ETC}/train@bad.service.d/bad.conf", "[X-GPUSlice]\nGPUs=0\n")
    write(tmp_path, f"{ETC}/plain@x.service.d/pre.conf", "[Service]\nExecStartPre=/bin/own\n")
    write(tmp_path, f"{LIB}/plain@.service", "[Service]\nExecStart=/bin/x\n")
    # instance files of their own: annotated with own ExecStartPre=, annotated alike, not annotated
    write(
        tmp_path,
        f"{LIB}/train@file.service",
        "[Service]\nExecStartPre=/bin/f\n[X-GPUSlice]\nPriority=5\n",
    )
    write(
        tmp_path,
        f"{LIB}/train@same.service",
        "[Service]\nExecStartPre=/bin/prep %i\n[X-GPUSlice]\nPriority=5\n",
    )
    write(tmp_path, f"{LIB}/train@none.service", "[Service]\nExecStartPre=/bin/prep %i\n")
    out = written(run(tmp_path))
    assert out == {
        "train@.service.d/gpuslice-gate.conf": gate("/bin/prep %i"),
        # an instance whose own drop-ins add ExecStartPre= lines before the gate gets a gate that
        # keeps them and hides the template's (same file name, same directory level)
        "train@pre.service.d/gpuslice-gate.conf": gate("/bin/prep %i", "/bin/own"),
        # an instance made invalid by its own drop-in: the template's gate is hidden
        "train@bad.service.d/gpuslice-gate.conf": generator.MASK_TEXT,
        "train@file.service.d/gpuslice-gate.conf": gate("/bin/f"),
        "train@none.service.d/gpuslice-gate.conf": generator.MASK_TEXT,
    }


def test_exec_start_pre_lines_of_prefix_and_alias_dirs_are_kept(tmp_path: Path) -> None:
    """systemd applies `job-@big.service.d/` to `job-train@big.service` and an alias's
    directory to its unit: the ExecStartPre= lines there come before the gate's reset, so the
    gate must carry them (they were dropped: the unit started without its own preparation)."""
    write(tmp_path, f"{LIB}/job-train@.service", f"[Service]\nExecStart=/bin/t\n{ANNOTATION}")
    write(tmp_path, f"{ETC}/job-@big.service.d/10-pre.conf", "[Service]\nExecStartPre=/bin/big\n")
    write(tmp_path, f"{ETC}/job-@.service.d/10-all.conf", "[Service]\nExecStartPre=/bin/all\n")
    write(tmp_path, f"{LIB}/real.service", f"[Service]\nExecStart=/bin/r\n{ANNOTATION}")
    (tmp_path / ETC.lstrip("/") / "web.service").symlink_to(f"{LIB}/real.service")
    write(tmp_path, f"{ETC}/web.service.d/10-pre.conf", "[Service]\nExecStartPre=/bin/web\n")
    assert written(run(tmp_path)) == {
        "job-train@.service.d/gpuslice-gate.conf": gate("/bin/all"),
        "job-train@big.service.d/gpuslice-gate.conf": gate("/bin/all", "/bin/big"),
        "real.service.d/gpuslice-gate.conf": gate("/bin/web"),
    }


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_unit_run_as_a_user_who_can_change_its_environment_file_is_not_gated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gate runs as root with the unit's environment (tests/test_envsafety.py)."""
    tmp_path.chmod(0o755)
    write(tmp_path, "/etc/asr/ours.env", "A=1\n")
    write(tmp_path, "/srv/asr/theirs.env", "LD_PRELOAD=/srv/asr/evil.so\n")
    os.chown(tmp_path / "srv/asr", 1000, 1000)
    for name, env in (("ours", "/etc/asr/ours.env"), ("theirs", "/srv/asr/theirs.env")):
        write(
            tmp_path,
            f"{ETC}/{name}.service",
            f"[Service]\nUser=asr\nEnvironmentFile={env}\n{ANNOTATION}",
        )
    # an instance whose own drop-in names such a file: its template's gate is hidden
    write(tmp_path, f"{ETC}/job@.service", f"[Service]\nUser=asr\n{ANNOTATION}")
    write(
        tmp_path,
        f"{ETC}/job@x.service.d/env.conf",
        "[Service]\nEnvironmentFile=-/srv/asr/theirs.env\n",
    )
    assert written(run(tmp_path)) == {
        "job@.service.d/gpuslice-gate.conf": gate(),
        "job@x.service.d/gpuslice-gate.conf": generator.MASK_TEXT,
        "ours.service.d/gpuslice-gate.conf": gate(),
    }
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"gpuslice-generator: error: {ETC}/theirs.service:3: [Service] EnvironmentFile: "
        "/srv/asr/theirs.env: its directory /srv/asr is owned by UID 1000, who can change it; "
        "gpuslice's gate runs as root with this unit's environment, so gpuslice does not "
        "manage theirs.service until only root can change that file and its directories "
        "(unit not managed)",
        f"gpuslice-generator: error: {ETC}/job@x.service.d/env.conf:2: [Service] "
        "EnvironmentFile: /srv/asr/theirs.env: its directory /srv/asr is owned by UID 1000, "
        "who can change it; gpuslice's gate runs as root with this unit's environment, so "
        "gpuslice does not manage job@x.service until only root can change that file and its "
        "directories (unit not managed)",
    ]


def test_a_byte_order_mark_hides_no_environment_file_from_the_check(tmp_path: Path) -> None:
    """systemd drops the first line-leading byte order mark wherever it is (a file pasted
    together from one saved with a mark): that line's EnvironmentFile= is read, the gate runs
    as root with what the user put there, and gpuslice must see it too."""
    tmp_path.chmod(0o755)
    write(tmp_path, "/srv/asr/theirs.env", "LD_PRELOAD=/srv/asr/evil.so\n")
    os.chown(tmp_path / "srv/asr", 1000, 1000)
    write(
        tmp_path,
        f"{ETC}/theirs.service",
        f"[Service]\nUser=asr\n\ufeffEnvironmentFile=/srv/asr/theirs.env\n{ANNOTATION}",
    )
    assert written(run(tmp_path)) == {}


def test_exec_start_pre_lines_are_copied_as_systemd_reads_the_files(tmp_path: Path) -> None:
    """The gate resets ExecStartPre= and writes back the lines systemd had: those of systemd's
    reading. "\n\r" is one line end to systemd (the backslash joins the next line: one echo,
    no rm), a drop-in's line that is not UTF-8 ends systemd's reading of that drop-in (its
    later reset and /bin/other never apply), and a drop-in name hides lower ones whatever it
    is."""
    write(
        tmp_path,
        f"{ETC}/a.service",
        "[Service]\nExecStartPre=/bin/echo cleaning \\\n\r"
        f"ExecStartPre=/bin/rm -rf /var/tmp/a\nExecStart=/bin/a\n{ANNOTATION}",
    )
    write(tmp_path, f"{ETC}/b.service", f"[Service]\nExecStartPre=/bin/prep\n{ANNOTATION}")
    (tmp_path / ETC.lstrip("/") / "b.service.d").mkdir()
    (tmp_path / ETC.lstrip("/") / "b.service.d/10-desc.conf").write_bytes(
        b"[Unit]\nDescription=caf\xe9\n[Service]\nExecStartPre=\nExecStartPre=/bin/other\n"
    )
    # a dangling link in /etc hides /usr/lib's drop-in of its name (systemd lists it by name)
    write(tmp_path, f"{LIB}/c.service", f"[Service]\nExecStart=/bin/c\n{ANNOTATION}")
    write(tmp_path, f"{LIB}/c.service.d/10-x.conf", "[Service]\nExecStartPre=/bin/y\n")
    (tmp_path / ETC.lstrip("/") / "c.service.d").mkdir()
    (tmp_path / ETC.lstrip("/") / "c.service.d/10-x.conf").symlink_to("/opt/gone.conf")
    assert written(run(tmp_path)) == {
        "a.service.d/gpuslice-gate.conf": gate(
            "/bin/echo cleaning  ExecStartPre=/bin/rm -rf /var/tmp/a"
        ),
        "b.service.d/gpuslice-gate.conf": gate("/bin/prep"),
        "c.service.d/gpuslice-gate.conf": gate(),
    }


def test_a_users_loader_path_or_a_mount_over_the_gates_path_leaves_the_unit_ungated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gate runs as root with the unit's environment and mounts (tests/test_envsafety.py):
    under `User=asr`, a root-written `LD_LIBRARY_PATH=` of asr's had the gate's /bin/sh load
    asr's libc.so.6 as root; a bind over /usr/local/bin, first in the gate's PATH, ran asr's
    dbus-send as root."""
    tmp_path.chmod(0o755)
    write(
        tmp_path,
        f"{ETC}/cuda.service",
        f"[Service]\nUser=asr\nEnvironment=LD_LIBRARY_PATH=/home/asr/cuda/lib64\n{ANNOTATION}",
    )
    write(
        tmp_path,
        f"{ETC}/bind.service",
        f"[Service]\nBindPaths=/home/asr/bin:/usr/local/bin\n{ANNOTATION}",
    )
    write(
        tmp_path,
        f"{ETC}/ok.service",
        "[Service]\nUser=asr\nEnvironment=LD_LIBRARY_PATH=/opt/cuda/lib64\n"
        f"BindPaths=/data/models:/models\n{ANNOTATION}",
    )
    assert written(run(tmp_path)) == {"ok.service.d/gpuslice-gate.conf": gate()}
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: error: {ETC}/bind.service:2: [Service] BindPaths: "
        "/home/asr/bin:/usr/local/bin: its mount at /usr/local/bin lands on, in or above "
        "/usr/local/bin, where gpuslice's gate finds the programs and libraries it runs as "
        "root, or its way to the controller; gpuslice's gate runs as root with this unit's "
        "mounts (ExecStartPre=+ keeps them), so gpuslice does not manage bind.service until "
        "none of its mounts lands on, in or above a path the gate uses (unit not managed)",
        f"gpuslice-generator: error: {ETC}/cuda.service:3: [Service] Environment: "
        "LD_LIBRARY_PATH=/home/asr/cuda/lib64: /home/asr/cuda/lib64 is under /home, where "
        "users make files or file systems are mounted after systemd runs gpuslice's generator "
        "at boot; gpuslice's gate runs as root with this unit's environment, so gpuslice does "
        "not manage cuda.service until only root can change each path it names (a directory "
        "and everything in it), named by an absolute path (unit not managed)",
    ]


def test_escaped_template_name(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/foo\\x2dbar@.service", "[X-GPUSlice]\nPriority=1\n")
    assert written(run(tmp_path)) == {"foo\\x2dbar@.service.d/gpuslice-gate.conf": gate()}


def test_problems_go_to_stderr_and_the_rest_is_generated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, f"{ETC}/bad.service", "[X-GPUSlice]\nPriority=high\n")
    write(tmp_path, f"{ETC}/warn.service", "[X-GPUSlice]\nPriority=1\nColour=red\n")
    write(tmp_path, f"{ETC}/good.service", "[X-GPUSlice]\nPriority=2\n")
    out = run(tmp_path)
    assert sorted(written(out)) == [
        "good.service.d/gpuslice-gate.conf",
        "warn.service.d/gpuslice-gate.conf",
    ]
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: error: {ETC}/bad.service:2: [X-GPUSlice] Priority: expected an "
        'integer 0-999, got "high" (unit not managed)',
        f"gpuslice-generator: warning: {ETC}/warn.service:3: [X-GPUSlice] Colour: unknown key, "
        "ignored (known keys: Priority, Type, GPUs, Requeue, Memory, Devices, Preempt)",
    ]


@pytest.mark.parametrize("argc", [1, 3])
def test_main_reads_argv_and_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argc: int
) -> None:
    monkeypatch.setenv("GPUSLICE_LIBEXEC_DIR", "/opt/gs")
    monkeypatch.setattr("gpuslice.paths.LIBEXEC_DIR", "/opt/gs")
    write(
        tmp_path,
        "/etc/gpuslice/config.yaml",
        "runtime_dir: /run/gpuslice/other\ngate_retry_seconds: 2\n",
    )
    write(tmp_path, f"{ETC}/a.service", "[X-GPUSlice]\nPriority=1\n")
    normal = tmp_path / "out/normal"
    args = [str(normal), str(tmp_path / "out/early"), str(tmp_path / "out/late")][:argc]
    assert generator.main(args, root=str(tmp_path)) == 0
    assert written(normal) == {
        "a.service.d/gpuslice-gate.conf": gate(
            runtime="/run/gpuslice/other", libexec="/opt/gs", retry="2"
        )
    }


def test_bad_config_uses_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, "/etc/gpuslice/config.yaml", 'runtime_dir: "/run/gpuslice\\nX=y"\n')
    write(tmp_path, f"{ETC}/a.service", "[X-GPUSlice]\nPriority=1\n")
    out = run(tmp_path)
    assert written(out) == {"a.service.d/gpuslice-gate.conf": gate()}
    config = tmp_path / "etc/gpuslice/config.yaml"
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: warning: {config}:1: runtime_dir: invalid value "
        '"/run/gpuslice\\x0aX=y" '
        f"(allowed: {SETTINGS_BY_NAME['runtime_dir'].allowed}) "
        "(using the defaults runtime_dir /run/gpuslice, gate_retry_seconds 0.5)"
    ]


def test_a_config_on_a_file_system_not_mounted_yet_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At boot, config.yaml links to /srv, mounted later: the gates use the defaults, as
    before, but the generator says why (the controller, started after the mount, may well
    read another runtime_dir there)."""
    (tmp_path / "etc/gpuslice").mkdir(parents=True)
    (tmp_path / "etc/gpuslice/config.yaml").symlink_to(tmp_path / "srv/gpuslice.yaml")
    write(tmp_path, f"{ETC}/a.service", "[X-GPUSlice]\nPriority=1\n")
    out = run(tmp_path)
    assert written(out) == {"a.service.d/gpuslice-gate.conf": gate()}
    config = tmp_path / "etc/gpuslice/config.yaml"
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: warning: {config}: cannot read: {config} is a symbolic link "
        f"that leads nowhere (to {tmp_path}/srv/gpuslice.yaml: a file system not mounted yet, "
        "a file moved?); not taken for a missing file, which would mean the defaults "
        "(using the defaults runtime_dir /run/gpuslice, gate_retry_seconds 0.5)"
    ]


def test_a_config_bad_elsewhere_keeps_its_runtime_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo in another key, then a daemon-reload: the running controller keeps its last
    good config and writes env files under /run/gpuslice/other. Gates pointed at the
    default's env files found none: the unit started with every GPU visible."""
    write(
        tmp_path,
        "/etc/gpuslice/config.yaml",
        "runtime_dir: /run/gpuslice/other\ngpus: 0\ngate_retry_seconds: 99\n",
    )
    write(tmp_path, f"{ETC}/a.service", "[X-GPUSlice]\nPriority=1\n")
    out = run(tmp_path)
    assert written(out) == {"a.service.d/gpuslice-gate.conf": gate(runtime="/run/gpuslice/other")}
    config = tmp_path / "etc/gpuslice/config.yaml"
    kept = (
        "(using runtime_dir /run/gpuslice/other, gate_retry_seconds 0.5: the file's where "
        "valid, else the defaults)"
    )
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": invalid value")[0] for line in lines] == [
        f"gpuslice-generator: warning: {config}:2: gpus",
        f"gpuslice-generator: warning: {config}:3: gate_retry_seconds",
    ]
    assert all(line.endswith(kept) for line in lines)


def test_the_controller_is_told_the_runtime_dir_its_gates_name(tmp_path: Path) -> None:
    """gpuslice.service reads it when it starts (controller._runtime_dir_of_this_boot):
    config.yaml may say another by then (edited after the boot's generator run, and the
    controller not started yet, or failed on a bad file at boot)."""
    write(tmp_path, "/etc/gpuslice/config.yaml", "runtime_dir: /run/gpuslice/other\n")
    out = run(tmp_path)
    assert (out / "gpuslice.service.d/gpuslice-runtime-dir.conf").read_text() == (
        "# Added by gpuslice-generator: the runtime_dir the GPU gates name.\n"
        "[Service]\n"
        "Environment=GPUSLICE_RUNTIME_DIR=/run/gpuslice/other\n"
    )


def test_a_bad_config_keeps_the_runtime_dir_the_controller_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The controller of this boot runs with /run/gpuslice/a; config.yaml now says b, with a
    typo elsewhere: the gates keep a, and the warning says so."""
    write(tmp_path, "/run/gpuslice/runtime-dir", "/run/gpuslice/a\n")
    write(tmp_path, "/etc/gpuslice/config.yaml", "runtime_dir: /run/gpuslice/b\ngpus: 0\n")
    write(tmp_path, f"{ETC}/a.service", "[X-GPUSlice]\nPriority=1\n")
    out = run(tmp_path)
    assert written(out) == {"a.service.d/gpuslice-gate.conf": gate(runtime="/run/gpuslice/a")}
    [line] = capsys.readouterr().err.splitlines()
    assert line.endswith(
        ': gpus: invalid value "0" (allowed: an integer 1-1024) (using runtime_dir '
        "/run/gpuslice/a, gpuslice.service's this boot, and gate_retry_seconds 0.5: the "
        "file's if valid, else the default)"
    )


def test_a_config_bad_elsewhere_keeps_its_gate_retry(tmp_path: Path) -> None:
    write(tmp_path, "/etc/gpuslice/config.yaml", "gate_retry_seconds: 2\ngpus: 0\n")
    write(tmp_path, f"{ETC}/a.service", "[X-GPUSlice]\nPriority=1\n")
    assert written(run(tmp_path)) == {"a.service.d/gpuslice-gate.conf": gate(retry="2")}


def test_a_setting_given_twice_in_a_bad_config_is_not_taken(tmp_path: Path) -> None:
    write(
        tmp_path,
        "/etc/gpuslice/config.yaml",
        "runtime_dir: /run/gpuslice/a\nruntime_dir: /run/gpuslice/b\n",
    )
    write(tmp_path, f"{ETC}/a.service", "[X-GPUSlice]\nPriority=1\n")
    assert written(run(tmp_path)) == {"a.service.d/gpuslice-gate.conf": gate()}


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert generator.main([]) == 2
    assert "usage:" in capsys.readouterr().err


def test_percent_in_paths_is_escaped() -> None:
    assert "ExecStartPre=+/opt/a%%b/gpuslice-gate %n 0.5 /r%%/gate/%n\n" in generator.gate_dropin(
        "/opt/a%b", "/r%", []
    )


def test_thousand_units(tmp_path: Path) -> None:
    for i in range(1000):
        write(
            tmp_path,
            f"{ETC}/job{i}.service",
            f"[Service]\nExecStartPre=/bin/prep {i}\nExecStart=/bin/job\n"
            f"[X-GPUSlice]\nPriority={i % 1000}\nType=background\n",
        )
    start = time.process_time()  # its CPU time: a loaded machine stretches the wall time
    out = run(tmp_path)
    elapsed = time.process_time() - start
    assert len(written(out)) == 1000
    assert elapsed < 10  # measured ~0.1 s; this only catches something quadratic


def test_a_file_system_that_does_not_answer_leaves_every_other_unit_gated(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An EnvironmentFile= on an NFS mount whose server is gone: the generator's lstat there
    never returned, systemd killed it at its timeout, and as it plans every unit before
    writing any drop-in, no unit was gated (every GPU job then ran ungated, several on one
    GPU). Now the mount costs one deadline: its 500 units are refused (not managed, said on
    stderr) and the 501 others are gated."""
    tmp_path.chmod(0o755)
    write(tmp_path, "/etc/asr/ok.env", "A=1\n")
    (tmp_path / "srv/nfs/jobs").mkdir(parents=True)
    for i in range(500):
        env = f"EnvironmentFile=/srv/nfs/jobs/{i}.env"
        write(tmp_path, f"{ETC}/n{i}.service", f"[Service]\nUser=asr\n{env}\n{ANNOTATION}")
        write(tmp_path, f"{ETC}/p{i}.service", f"[Service]\nUser=asr\n{ANNOTATION}")
    write(
        tmp_path,
        f"{ETC}/ok.service",
        f"[Service]\nUser=asr\nEnvironmentFile=/etc/asr/ok.env\n{ANNOTATION}",
    )
    hang = Hang(tmp_path, monkeypatch, tmp_path_factory.mktemp("proc") / "mountinfo")
    hang.mounts("/srv/nfs")
    hang.at = ("/srv/nfs",)
    try:
        out = run(tmp_path)
    finally:
        hang.release()
    assert len(hang.blocked) == 1 and hang.timeouts == 1, hang.blocked  # one deadline waited
    assert sorted(written(out)) == sorted(
        [f"p{i}.service.d/gpuslice-gate.conf" for i in range(500)]
        + ["ok.service.d/gpuslice-gate.conf"]
    )
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 500
    assert err[0] == (
        f"gpuslice-generator: error: {ETC}/n0.service:3: [Service] EnvironmentFile: "
        "/srv/nfs/jobs/0.env cannot be checked: /srv/nfs did not answer within 1 s (a "
        "network file system not answering?); gpuslice's gate runs as root with this unit's "
        "environment, so gpuslice does not manage n0.service until that file system answers "
        "at a later scan (systemctl daemon-reload) (unit not managed)"
    )


# ---------------------------------------------------------------------------------------------
# paths


def test_libexec_dir(tmp_path: Path) -> None:
    package = tmp_path / "lib/gpuslice/python/gpuslice"
    package.mkdir(parents=True)
    assert find_libexec_dir({}, package) == DEFAULT_LIBEXEC_DIR
    (tmp_path / "lib/gpuslice/gpuslice-gate").write_text("#!/bin/sh\n")
    assert find_libexec_dir({}, package) == str(tmp_path / "lib/gpuslice")
    assert find_libexec_dir({"GPUSLICE_LIBEXEC_DIR": "/x"}, package) == "/x"


def test_the_gate_is_told_the_retry_it_is_given_or_config_defaults() -> None:
    assert "\nEnvironment=GPUSLICE_GATE_RETRY=2\n" in generator.gate_dropin(
        "/l", "/run/g", [], retry=2.0
    )
    assert "\nEnvironment=GPUSLICE_GATE_RETRY=0.05\n" in generator.gate_dropin(
        "/l", "/run/g", [], retry=0.05
    )
    # the default is config.py's, always written out: the gate's own default is not relied on
    default = SETTINGS_BY_NAME["gate_retry_seconds"].default
    assert f"\nEnvironment=GPUSLICE_GATE_RETRY={default:g}\n" in generator.gate_dropin(
        "/l", "/run/g", []
    )


@pytest.mark.parametrize("retry", [0.05, 0.5, 2.0, 60.0])
def test_the_gates_command_line_is_the_same_whatever_the_retry(retry: float) -> None:
    """An admin changes gate_retry_seconds and runs daemon-reload while a unit waits at its
    gate. systemd matches the command a start runs by its whole command line: with the retry
    in it, the gate's had vanished from the new ExecStartPre= list, and the start, once
    granted, skipped the unit's own lines (a model download, a mount check) and went on to
    ExecStart=. The line is the one older versions wrote with the default retry, so an
    upgrade's daemon-reload finds it too."""
    text = generator.gate_dropin("/usr/lib/gpuslice", "/run/gpuslice", ["/bin/touch /tmp/x"], retry)
    [line, own] = [x for x in text.splitlines() if x.startswith("ExecStartPre=") and x[13:]]
    assert line == "ExecStartPre=+/usr/lib/gpuslice/gpuslice-gate %n 0.5 /run/gpuslice/gate/%n"
    assert own == "ExecStartPre=/bin/touch /tmp/x"


# ---------------------------------------------------------------------------------------------
# trust: one unit's trouble never costs the others their gate


def test_a_drop_in_line_with_a_control_character_is_refused_and_the_rest_is_generated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, f"{ETC}/bad.service", "[Service]\nExecStartPre=/bin/a\x1bb\n" + ANNOTATION)
    write(tmp_path, f"{ETC}/tab.service", "[Service]\nExecStartPre=/bin/a\tb\n" + ANNOTATION)
    write(tmp_path, f"{ETC}/good.service", ANNOTATION)
    assert written(run(tmp_path)) == {
        "good.service.d/gpuslice-gate.conf": gate(),
        "tab.service.d/gpuslice-gate.conf": gate("/bin/a\tb"),  # a tab is whitespace
    }
    # the scan leaves it unmanaged, as `gpuslice check` and the controller see it
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: error: {ETC}/bad.service:2: [Service] ExecStartPre: /bin/a\\x1bb: "
        "a control character in a line the gate's drop-in would copy, which gpuslice-generator "
        "does not write (left unmanaged, ungated) (unit not managed)"
    ]


def test_a_copied_line_that_ends_in_a_backslash_ends_there(tmp_path: Path) -> None:
    """`ExecStartPre=/bin/a \\ ` (a blank after the backslash, an editor's leftover) is no
    continuation to systemd, which strips the blank: copied bare, its backslash joined the
    gate drop-in's next line to it, and the unit's next ExecStartPre= never ran. Each line
    reads back as the unit's file says it (the parser is systemd's)."""
    write(
        tmp_path,
        f"{ETC}/a.service",
        "[Service]\nExecStartPre=/bin/a \\ \nExecStartPre=/bin/b \\\\\n"
        "ExecStartPre=/bin/c \\\\\\\t\nExecStartPre=/bin/d\n" + ANNOTATION,
    )
    text = written(run(tmp_path))["a.service.d/gpuslice-gate.conf"]
    entries = [(e.key, e.value) for e in parse_sections(text) if e.section == "Service"]
    assert entries == [
        ("ExecStartPre", ""),
        ("ExecStartPre", f"+{LIBEXEC}/gpuslice-gate %n 0.5 /run/gpuslice/gate/%n"),
        ("ExecStartPre", "/bin/a \\"),
        ("ExecStartPre", "/bin/b \\\\"),
        ("ExecStartPre", "/bin/c \\\\\\"),
        ("ExecStartPre", "/bin/d"),
        ("Environment", "GPUSLICE_GATE_RETRY=0.5"),
        ("EnvironmentFile", "-/run/gpuslice/env/%n/gpuslice.env"),
        ("TimeoutStartSec", "infinity"),
    ]
    assert text == gate("/bin/a \\ ", "/bin/b \\\\", "/bin/c \\\\\\ ", "/bin/d")


def test_an_exception_for_one_unit_is_reported_and_the_others_are_gated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b", "c"):
        write(tmp_path, f"{ETC}/{name}.service", ANNOTATION)
    real = generator.exec_start_pre_before_gate

    def broken(loader: Loader, unit: str) -> list[str]:
        if unit == "b.service":
            raise RuntimeError("boom")
        return real(loader, unit)

    monkeypatch.setattr(generator, "exec_start_pre_before_gate", broken)
    assert sorted(written(run(tmp_path))) == [
        "a.service.d/gpuslice-gate.conf",
        "c.service.d/gpuslice-gate.conf",
    ]
    assert capsys.readouterr().err.splitlines() == [
        "gpuslice-generator: error: b.service: cannot plan its gate: boom (unit not gated)"
    ]


def test_a_write_error_for_one_unit_is_reported_and_the_others_are_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("a", "b", "c"):
        write(tmp_path, f"{ETC}/{name}.service", ANNOTATION)
    out = tmp_path / "run/systemd/generator"
    write(out, "b.service.d", "a file where the directory should be\n")
    assert generator.generate(out, root=tmp_path, libexec_dir=LIBEXEC) == 2
    assert sorted(written(out)) == [
        "a.service.d/gpuslice-gate.conf",
        "c.service.d/gpuslice-gate.conf",
    ]
    assert capsys.readouterr().err.splitlines() == [
        "gpuslice-generator: error: b.service: cannot write its gate: File exists (unit not gated)"
    ]


# A child that can write no file past 4 KiB: the kernel cuts a longer write short, then
# refuses the rest (EFBIG), as a full /run does (ENOSPC after the pages it found room for).
_SMALL_FILES = """
import resource, signal, sys
from gpuslice import generator
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
generator.generate(sys.argv[1], root=sys.argv[2], libexec_dir=sys.argv[3])
"""


def test_a_gate_cut_short_by_a_full_disk_is_not_left_behind(tmp_path: Path) -> None:
    """Written in place, a gate drop-in that /run had room for only part of stayed, and
    systemd applied it: the gate and the unit's first ExecStartPre= lines, the last of them
    cut mid-word (`+/bin/rm -rf /var/cache/job/0066/scratch/ol`, run as root), and no
    EnvironmentFile= (the job saw every GPU), while the generator said the unit was not gated.
    Now a drop-in is there whole or not at all, and no piece of it is left under another
    name either."""
    pre = "".join(f"ExecStartPre=+/bin/rm -rf /var/cache/job/{i:04d}/old\n" for i in range(200))
    write(tmp_path, f"{ETC}/big.service", f"[Service]\n{pre}ExecStart=/bin/a\n{ANNOTATION}")
    write(tmp_path, f"{ETC}/small.service", ANNOTATION)
    out = tmp_path / "run/systemd/generator"
    package_root = Path(generator.__file__).parent.parent
    done = subprocess.run(
        [sys.executable, "-B", "-c", _SMALL_FILES, str(out), str(tmp_path), LIBEXEC],
        env={**os.environ, "PYTHONPATH": str(package_root)},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert len(pre) > 4096  # big's gate holds these lines: longer than the child may write
    assert written(out) == {"small.service.d/gpuslice-gate.conf": gate()}
    assert os.listdir(out / "big.service.d") == []
    assert done.stderr.splitlines() == [
        "gpuslice-generator: error: big.service: cannot write its gate: File too large "
        "(unit not gated)"
    ]


def test_main_never_raises(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("scan failed")

    monkeypatch.setattr(generator, "scan", broken)
    assert generator.main([str(tmp_path / "out")], root=str(tmp_path)) == 0
    assert capsys.readouterr().err.splitlines() == [
        "gpuslice-generator: error: cannot read the unit files: scan failed (no unit gated)"
    ]


def instance(length: int) -> str:
    """`train@xxx.service`, `length` characters."""
    return "train@" + "x" * (length - len("train@.service")) + ".service"


@pytest.mark.parametrize("length", [251, 252, 253])
def test_long_instance_names_that_fit_get_their_own_gate(tmp_path: Path, length: int) -> None:
    name = instance(length)
    write(tmp_path, f"{LIB}/train@.service", ANNOTATION)
    write(tmp_path, f"{LIB}/{name}", "[Service]\nExecStartPre=/bin/own\n" + ANNOTATION)
    assert written(run(tmp_path)) == {
        "train@.service.d/gpuslice-gate.conf": gate(),
        f"{name}.d/gpuslice-gate.conf": gate("/bin/own"),
    }


@pytest.mark.parametrize("length", [254, 255])
def test_instance_names_too_long_for_a_drop_in_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], length: int
) -> None:
    own = instance(length)  # its own ExecStartPre=: the template's gate would reset it
    same = instance(length).replace("train@x", "train@y")  # the template's gate is right
    unmanaged = instance(length).replace("train@x", "train@z")  # no annotation of its own
    write(tmp_path, f"{LIB}/train@.service", ANNOTATION)
    write(tmp_path, f"{LIB}/{own}", "[Service]\nExecStartPre=/bin/own\n" + ANNOTATION)
    write(tmp_path, f"{LIB}/{same}", ANNOTATION)
    write(tmp_path, f"{LIB}/{unmanaged}", "[Service]\nExecStart=/bin/x\n")
    write(tmp_path, f"{ETC}/other.service", ANNOTATION)
    assert written(run(tmp_path)) == {
        "other.service.d/gpuslice-gate.conf": gate(),
        "train@.service.d/gpuslice-gate.conf": gate(),
    }
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: error: {own}: name too long for a drop-in directory of its own "
        f"({length} characters; at most 253): its template's gate applies and resets its own "
        "ExecStartPre= lines (unit not gated correctly)",
        f"gpuslice-generator: error: {unmanaged}: name too long for a drop-in directory of its "
        f"own ({length} characters; at most 253): its template's gate applies although the "
        "unit is not managed (unit not gated correctly)",
    ]


def test_plain_unit_name_too_long_for_a_drop_in_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "x" * (254 - len(".service")) + ".service"
    write(tmp_path, f"{ETC}/{name}", ANNOTATION)
    write(tmp_path, f"{ETC}/other.service", ANNOTATION)
    assert written(run(tmp_path)) == {"other.service.d/gpuslice-gate.conf": gate()}
    # the scan leaves it unmanaged, as `gpuslice check` and the controller see it
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: error: {ETC}/{name}:1: [X-GPUSlice] the unit's name is too long "
        "for its gate's drop-in directory UNIT.d (254 characters; at most 253): "
        "gpuslice-generator cannot gate it (left unmanaged, ungated) (unit not managed)"
    ]


def test_a_unit_the_scan_took_that_cannot_be_gated_is_still_refused_by_the_plan() -> None:
    """Belt and braces behind the scan's errors: a spec whose name has no drop-in directory,
    or whose copied line holds a control character, gets no gate, and says so."""
    root = Path("/nonexistent")
    long_name = "x" * (254 - len(".service")) + ".service"
    loader = Loader(UnitIndex(root, search_path=()))
    result = Scan(specs={long_name: UnitSpec(name=long_name, priority=1)})
    planned = generator.plan(loader, result, LIBEXEC, "/run/gpuslice")
    assert planned.dropins == {}
    assert planned.errors == [
        f"{long_name}: name too long for a drop-in directory (254 characters; at most 253) "
        "(unit not gated)"
    ]


def test_refuses_control_characters_in_paths() -> None:
    with pytest.raises(ValueError, match="control character"):
        generator.gate_dropin("/usr/lib/gpuslice", "/run/gpuslice\nExecStartPre=/bin/evil", [])
    with pytest.raises(ValueError, match="control character"):
        generator.gate_dropin("/usr/lib/gpu\rslice", "/run/gpuslice", [])


@pytest.mark.parametrize("text", ["gpus: " + "[" * 3000 + "]" * 3000 + "\n", "gpus: \xff\n"])
def test_a_hostile_config_means_the_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setattr("gpuslice.paths.LIBEXEC_DIR", LIBEXEC)
    real = tmp_path / "etc/gpuslice/config.yaml"
    real.parent.mkdir(parents=True)
    real.write_bytes(text.encode("latin-1"))
    write(tmp_path, f"{ETC}/a.service", ANNOTATION)
    assert generator.main([str(tmp_path / "out")], root=str(tmp_path)) == 0
    assert written(tmp_path / "out") == {"a.service.d/gpuslice-gate.conf": gate()}
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"gpuslice-generator: warning: {real}:1: ")
    assert line.endswith("(using the defaults runtime_dir /run/gpuslice, gate_retry_seconds 0.5)")


def test_a_value_of_an_environment_file_is_not_written_to_the_boot_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At boot a generator's stderr goes to the kernel's log, which any user may read where
    dmesg_restrict is 0: a value read from root's 0600 environment file is said as Status
    says it to anyone (`Problem.public`); `gpuslice check` shows root the rest."""
    tmp_path.chmod(0o755)
    write(tmp_path, "/etc/job/debug.env", "LD_DEBUG=help,s3cret\n")
    (tmp_path / "etc/job/debug.env").chmod(0o600)
    write(
        tmp_path,
        f"{ETC}/job.service",
        "[Service]\nEnvironmentFile=/etc/job/debug.env\nExecStart=/bin/a\n" + ANNOTATION,
    )
    run(tmp_path)
    [line] = capsys.readouterr().err.splitlines()
    assert "LD_DEBUG=... (set in /etc/job/debug.env; its value is shown to root alone)" in line
    assert "s3cret" not in line


def test_a_timeout_the_gate_overrides_is_said_and_the_unit_gated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gate's drop-in keeps `TimeoutStartSec=infinity` (a start may wait hours at its
    gate), which overrides the unit's own: the generator says so at its line, as `gpuslice
    check` and the journal do, and gates the unit. Its own gate drop-in, read at the next run
    (a daemon-reload), is no timeout of the unit's; one of the admin's named after it wins,
    unsaid."""
    text = "[Service]\nType=notify\nTimeoutStartSec=5min\nExecStart=/bin/a\n" + ANNOTATION
    write(tmp_path, f"{ETC}/a.service", text)
    said = (
        f"gpuslice-generator: warning: {ETC}/a.service:3: [Service] TimeoutStartSec: 5min: "
        "overridden by the gate's TimeoutStartSec=infinity (gpuslice-gate.conf: a start may "
        "wait hours at its gate): nothing bounds its start until READY=1 any more"
    )
    for _ in range(2):
        assert written(run(tmp_path)) == {"a.service.d/gpuslice-gate.conf": gate()}
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(said)
    write(tmp_path, f"{ETC}/a.service.d/zz-timeout.conf", "[Service]\nTimeoutStartSec=2h\n")
    assert written(run(tmp_path)) == {"a.service.d/gpuslice-gate.conf": gate()}
    assert capsys.readouterr().err == ""
