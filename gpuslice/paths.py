"""Where gpuslice's installed pieces live."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

GATE_NAME = "gpuslice-gate"
DEFAULT_LIBEXEC_DIR = "/usr/lib/gpuslice"
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
