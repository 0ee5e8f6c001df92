"""Hypothesis profiles: `make test` (and CI, and `make mutate`) replays the same examples on
every run, so a red run means a change broke something, never chance; `make fuzz` explores
new ones (GPUSLICE_HYPOTHESIS=explore) and prints a replayable failure when it finds one."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("repeatable", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("GPUSLICE_HYPOTHESIS", "repeatable"))
