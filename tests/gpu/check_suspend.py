"""A real-GPU check of Preempt=suspend: run by hand, never by `make test`.

    sudo .venv/bin/python -m tests.gpu.check_suspend [--gib 4] [--gpu 0] [--python PY]

Needs an NVIDIA driver with cuda-checkpoint (570 or later; `cuda_checkpoint:` lookup as the
controller does it), nvidia-ml-py for this interpreter and PyTorch with CUDA for PY. It starts a
CUDA process that fills --gib GiB on --gpu with a seeded pattern and computes its checksum, then
does what gpuslice does to suspend it (gpuslice.checkpoint: lock, checkpoint), checks through
NVML that the process left the GPU, resumes it (restore, unlock), checks that NVML shows it
again, and has the process compute its checksum again: the same one means its memory came back
intact. It prints seconds and seconds per GiB both ways. Exit 0 when all of it held, 1 on a
failure, 2 when it cannot run here (no driver, no tool, no torch, no CUDA).

Written on machines without a GPU: it has not been run against real hardware by its author.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Sequence

from gpuslice import checkpoint
from gpuslice.checkpoint import CheckpointError, CheckpointSettings
from gpuslice.config import Config
from gpuslice.nvml import Nvml, NvmlError
from gpuslice.sizes import format_size
from tests.gpu.check_real_gpu import CANNOT_RUN, GIB, find, poll, read_line

# The CUDA job: fill, checksum, then answer "sum" with the checksum again until stdin closes.
CHILD = """
import sys, torch
n = int(sys.argv[1])
g = torch.Generator(device="cuda").manual_seed(1234)
x = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
def checksum():  # per 256 MiB chunk, weighted by its place: no copy of x is made
    total = 0
    for i, chunk in enumerate(x.split(1 << 28)):
        spread = int(chunk[::4099].sum(dtype=torch.int64))
        total += (i + 1) * int(chunk.sum(dtype=torch.int64)) + spread
    return total
print("ready", checksum(), flush=True)
for line in sys.stdin:
    print("sum", checksum(), flush=True)
"""


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--python", default=sys.executable)
    opts = parser.parse_args(args)
    tool = checkpoint.find_tool(Config().cuda_checkpoint)
    if tool is None:
        print("cuda-checkpoint not found: cannot run", file=sys.stderr)
        return CANNOT_RUN
    nvml = Nvml()
    if not nvml.open(fallback="nothing: this check needs NVML").available:
        print("NVML not available: cannot run", file=sys.stderr)
        return CANNOT_RUN
    size = int(opts.gib * GIB)
    env = {"CUDA_VISIBLE_DEVICES": str(opts.gpu), "PATH": "/usr/bin:/bin"}
    child = subprocess.Popen(
        [opts.python, "-c", CHILD, str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    settings = CheckpointSettings(tool, 30.0, 600.0, 600.0, 0)
    try:
        ready = read_line(child, 300).split()
        if not ready or ready[0] != "ready":
            print(f"the CUDA job did not start: {ready}", file=sys.stderr)
            return CANNOT_RUN
        before = ready[1]
        seen = poll(lambda: find(nvml, opts.gpu, child.pid), 10)
        if seen is None:
            print(f"FAIL: NVML never listed PID {child.pid}")
            return 1
        print(f"PID {child.pid} holds {format_size(seen.used_memory or 0)} on GPU {opts.gpu}")
        try:
            down = asyncio.run(checkpoint.suspend(tool, [child.pid], settings))
        except CheckpointError as e:
            print(f"FAIL: suspend: {e.reason}")
            return 1
        gone = poll(lambda: find(nvml, opts.gpu, child.pid) is None or None, 10)
        print(f"suspended in {down:.2f} s ({down / opts.gib:.3f} s/GiB); left NVML: {bool(gone)}")
        time.sleep(1)
        try:
            up = asyncio.run(checkpoint.resume(tool, [child.pid], settings)).seconds
        except CheckpointError as e:
            print(f"FAIL: resume: {e.reason}")
            return 1
        back = poll(lambda: find(nvml, opts.gpu, child.pid), 10)
        print(f"resumed in {up:.2f} s ({up / opts.gib:.3f} s/GiB); back in NVML: {bool(back)}")
        assert child.stdin is not None
        child.stdin.write("sum\n")
        child.stdin.flush()
        after = read_line(child, 300).split()
        same = after[1:] == [before]
        verdict = "same" if same else "DIFFERENT"
        print(f"checksum before {before}, after {' '.join(after[1:])}: {verdict}")
        return 0 if gone and back and same else 1
    except NvmlError as e:
        print(f"NVML failed: {e}", file=sys.stderr)
        return 1
    finally:
        child.kill()
        child.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
