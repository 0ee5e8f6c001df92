"""The annotation scan's cost at scale, with no container: `python -m bench.scan_cost [UNITS]`.

Builds a temporary root of UNITS annotated units (default 10,000) in /etc/systemd/system, with
the shared drop-ins every unit reads (`service.d/`, the dash prefix `fill-.service.d/`, a
template's `job@.service.d/` for a few instances) and each unit's gate drop-in written by
gpuslice-generator under /run/systemd/generator, as at boot. Prints `scan`'s median time of 5,
the file-system calls one scan makes (counted by wrapping the `os` functions), and with
`--profile` the scan's costliest functions (cProfile, by own time). `--root DIR` keeps the
tree in DIR for the next run (building it takes longer than the scan).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.run import filler_unit
from gpuslice import generator
from gpuslice.annotations import scan

# the calls that reach the file system while a scan reads the search path and the files
COUNTED = ("scandir", "listdir", "stat", "lstat", "readlink", "open")


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def build(root: Path, units: int) -> None:
    """`units` annotated units: fill-NNNN.service, and a template `job@.service` with ten
    instance files of its own; the shared drop-ins; the generator's gate drop-ins."""
    etc = root / "etc/systemd/system"
    for i in range(units - 11):
        write(etc / f"fill-{i:05d}.service", filler_unit(i))
    write(etc / "job@.service", filler_unit(0))
    for i in range(10):
        write(etc / f"job@{i}.service", filler_unit(i))
    write(etc / "service.d/10-x.conf", "[Service]\nEnvironment=X=1\n")
    write(root / "run/systemd/system/service.d/20-y.conf", "[Service]\nEnvironment=Y=1\n")
    write(etc / "fill-.service.d/30-z.conf", "[Service]\nEnvironment=Z=1\n")
    write(etc / "job@.service.d/40-w.conf", "[Service]\nEnvironment=W=1\n")
    with contextlib.redirect_stderr(io.StringIO()):
        generator.generate(root / "run/systemd/generator", root, "/usr/libexec/gpuslice")


@contextlib.contextmanager
def counted() -> Iterator[collections.Counter[str]]:
    """Counts the calls of `COUNTED` while inside."""
    counts: collections.Counter[str] = collections.Counter()
    saved = {name: getattr(os, name) for name in COUNTED}

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real(*args, **kwargs)

        return call

    for name, real in saved.items():
        setattr(os, name, wrap(name, real))
    try:
        yield counts
    finally:
        for name, real in saved.items():
            setattr(os, name, real)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("units", type=int, nargs="?", default=10_000)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    parser.add_argument("--root", help="build the tree here once and keep it (a building is slow)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        root = Path(args.root or stack.enter_context(tempfile.TemporaryDirectory()))
        if not (root / "etc").exists():
            build(root, args.units)
        times, cpu = [], []
        for _ in range(5):
            t, c = time.perf_counter(), time.process_time()
            result = scan(root)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        print(
            f"scan of {args.units} units: median {statistics.median(times) * 1000:.0f} ms"
            f" (min {min(times) * 1000:.0f}, max {max(times) * 1000:.0f}), CPU median"
            f" {statistics.median(cpu) * 1000:.0f} ms, for {len(result.specs)} specs,"
            f" {len(result.problems)} problems"
        )
        with counted() as counts:
            scan(root)
        print("calls in one scan: " + ", ".join(f"{n} {counts[n]}" for n in COUNTED))
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            scan(root)
            profile.disable()
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(15)
            print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
