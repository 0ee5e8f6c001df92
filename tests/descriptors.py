"""The files below a directory that this process holds open, for tests that a call closed
what it opened."""

from __future__ import annotations

import os
from pathlib import Path


def open_below(directory: Path) -> list[str]:
    """The paths below `directory` this process has descriptors open on. Not all of its
    descriptors, counted: a thread an earlier test left (a state flush in its fsync) or the
    garbage collector may open or close others meanwhile, and the test failed for them."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        if target.startswith(f"{directory}/"):
            held.append(target)
    return sorted(held)
