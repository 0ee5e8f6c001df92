"""Where gpuslice's installed pieces live."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

GATE_NAME = "gpuslice-gate"
# The gate's retry (gate_retry_seconds), set by its drop-in's `Environment=` and read by the
# gate first: passed in the gate's command line, a new retry changed that line, and systemd,
# at the daemon-reload that applied it, did not go on with the ExecStartPre= list of a start
# waiting at its gate (its running command had "vanished"): granted, the start skipped the
# unit's own ExecStartPre= lines.
GATE_RETRY_ENV = "GPUSLICE_GATE_RETRY"
# The gate drop-in's file name: drop-ins that sort after it are applied after it.
GATE_DROPIN_NAME = "gpuslice-gate.conf"
CONFIG_PATH = "/etc/gpuslice/config.yaml"
# Where the unit's StateDirectory=/RuntimeDirectory= put them, the only places its sandbox
# (ProtectSystem=strict) lets it write.
DEFAULT_STATE_DIR = "/var/lib/gpuslice"
DEFAULT_RUNTIME_DIR = "/run/gpuslice"
DEFAULT_LIBEXEC_DIR = "/usr/lib/gpuslice"
# The runtime_dir of this boot. The gates' drop-ins name it (EnvironmentFile=, the pipe), and
# the controller writes there: the two must never disagree, or a unit starts reading no env
# file (every GPU visible) or a stale one (another unit's GPUs). So the controller records the
# one it runs with here at start (gpuslice.service's RuntimeDirectory=, kept until reboot), the
# generator names that one in the gates while it is recorded, and tells gpuslice.service which
# one its gates name (RUNTIME_DIR_ENV, in a drop-in of its own): a runtime_dir changed in
# config.yaml takes effect at the next boot.
RUNTIME_DIR_RECORD_NAME = "runtime-dir"
RUNTIME_DIR_RECORD = f"{DEFAULT_RUNTIME_DIR}/{RUNTIME_DIR_RECORD_NAME}"
RUNTIME_DIR_ENV = "GPUSLICE_RUNTIME_DIR"
# This boot as the controller tells it (`Systemd.boot_id`), recorded at its start for
# `gpuslice release-jobs` (apt remove), which runs outside the unit's sandbox and judges the
# saved state's boot by it. In a container the two read different kernel boot ids: nspawn
# mounts the container's own over /proc/sys/kernel/random/boot_id, and the sandbox's fresh
# /proc/sys (ProtectKernelTunables=, ProtectControlGroups=) shows the host's; asked by
# release-jobs itself, every state was "not this boot's", and its frozen units stayed frozen.
# /run is emptied at every boot (a tmpfs), so a record here was written this boot. Named as
# the runtime_dir record's own names are (`runtime-dir.`, config._own_name_below), which no
# runtime_dir may be, then as now: a runtime_dir pinned before an upgrade is never this file.
BOOT_RECORD_NAME = f"{RUNTIME_DIR_RECORD_NAME}.boot"
BOOT_RECORD = f"{DEFAULT_RUNTIME_DIR}/{BOOT_RECORD_NAME}"
# The state_dir the controller last ran with. A state_dir edited in config.yaml takes effect at
# the next start, which would read an empty directory and forget every unit owed a restart or
# a resume: the controller moves the state there from the one recorded here. Kept across
# reboots (preempted units are owed a restart after one), in the directory every state_dir is
# in (StateDirectory=), so that config.yaml can name none that holds it.
STATE_DIR_RECORD_NAME = "state-dir"
STATE_DIR_RECORD = f"{DEFAULT_STATE_DIR}/{STATE_DIR_RECORD_NAME}"
# The state file (gpuslice/state.py), in every state_dir, beside the copy of a bad one
# (`state.json.bad`), and in runtime_dir while state_dir cannot be written.
STATE_FILE_NAME = "state.json"
# Every name gpuslice writes in a state_dir, DEFAULT_STATE_DIR included, is one of these, or one
# of them followed by "." or "-" (the record, the state file, its bad copy), each also after a "."
# (config._own_name_below): their temporary files, `.NAME.tmp-PID-N` (safefile.write_atomic). A
# state_dir named so below DEFAULT_STATE_DIR would be one of those files
# (`/var/lib/gpuslice/state.json` cannot be made while the default's state file is there: every
# save went to runtime_dir, lost at a reboot), or be made where one of them is written, which
# then fails.
OWN_STATE_NAMES = (STATE_DIR_RECORD_NAME, STATE_FILE_NAME)
# gpuslice.service's drop-in that the generator writes with RUNTIME_DIR_ENV
RUNTIME_DIR_DROPIN = "gpuslice.service.d/gpuslice-runtime-dir.conf"
PACKAGE_DIR = Path(__file__).resolve().parent


def find_libexec_dir(
    environ: Mapping[str, str] = os.environ, package_dir: Path = PACKAGE_DIR
) -> str:
    """GPUSLICE_LIBEXEC_DIR if set; else two levels above the package when the gate is there
    (installed layout: `PREFIX/lib/gpuslice/python/gpuslice/` -> `PREFIX/lib/gpuslice/`);
    else /usr/lib/gpuslice."""
    configured = environ.get("GPUSLICE_LIBEXEC_DIR")
    if configured:
        return configured
    installed = package_dir.parent.parent
    if (installed / GATE_NAME).is_file():
        return str(installed)
    return DEFAULT_LIBEXEC_DIR


LIBEXEC_DIR = find_libexec_dir()

# A granted unit's environment: one directory per unit, so that every valid unit name (up to
# systemd's 255 characters) fits in one path component. The generator writes the specifier
# form into each gate drop-in; the controller writes the file before it answers the gate.
ENV_DIR_NAME = "env"
ENV_FILE_NAME = "gpuslice.env"
ENV_FILE_SPECIFIER = f"{ENV_DIR_NAME}/%n/{ENV_FILE_NAME}"


def env_file(runtime_dir: str, unit: str) -> Path:
    """RUNTIME_DIR/env/UNIT/gpuslice.env, the file `EnvironmentFile=` names."""
    return Path(runtime_dir) / ENV_DIR_NAME / unit / ENV_FILE_NAME


# The gate's pipes (gpuslice/gatepipes.py): one per unit, named by the unit, in one directory
# the controller alone may open (0700). The generator names the pipe in each gate drop-in.
GATE_PIPE_DIR_NAME = "gate"
GATE_PIPE_SPECIFIER = f"{GATE_PIPE_DIR_NAME}/%n"


def gate_pipe_dir(runtime_dir: str) -> Path:
    """RUNTIME_DIR/gate, where the pipe of each unit at its gate is."""
    return Path(runtime_dir) / GATE_PIPE_DIR_NAME


# Every name gpuslice writes in a runtime_dir, DEFAULT_RUNTIME_DIR included, is one of these, or
# one of them followed by "." or "-", each also after a "." (config._own_name_below): the record
# of this boot's runtime_dir, the stand-in state file, the directories of the env files and of the
# gates' pipes, and their temporary or moved-aside names (`.NAME.tmp-PID-N`,
# `.gate.released-PID`). The runtime_dir of this boot is pinned, but `gpuslice release-gates`
# empties RUNTIME_DIR/gate of config.yaml's runtime_dir too (and of DEFAULT_RUNTIME_DIR's while
# config.yaml is bad): a runtime_dir of /run/gpuslice/gate lost its env files and its stand-in
# (the units owed a restart) there, and one of /run/gpuslice/.runtime-dir.tmp kept the record
# from being written.
OWN_RUNTIME_NAMES = (
    RUNTIME_DIR_RECORD_NAME,
    STATE_FILE_NAME,
    ENV_DIR_NAME,
    GATE_PIPE_DIR_NAME,
)
