"""`make demo`: the gpuslice story told by a real systemd in a throwaway container.

vlm-analysis (background, priority 90) starts by itself; voice-pipeline (on demand, priority 10)
preempts it; when voice-pipeline ends (~5 s) vlm-analysis comes back by itself. A second act
restarts gpuslice on two simulated 24 GiB GPUs (tests/bed/fakegpu): two 10 GiB background units
share GPU 0, and yield to a process gpuslice does not manage while it uses that GPU. Every step
waits on systemd's own state, never on a guessed sleep.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from tests.bed import fakegpu
from tests.bed.container import BedError, Container, ensure_tree, wait_until

BACKGROUND = "vlm-analysis.service"
ON_DEMAND = "voice-pipeline.service"
STEP_TIMEOUT = 30.0
PACKED = ("photo-tagging.service", "embeddings.service")
FOREIGN = "desktop-session.service"


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def show_status(container: Container) -> None:
    print(container.run(["gpuslice", "status"], check=False).stdout.rstrip(), flush=True)


def play(container: Container) -> None:
    """The three steps; raises BedError (with the state seen) if one does not happen."""
    # Examples first: gpuslice then starts with every annotated unit already in place.
    say("installing the example units and gpuslice (make -C /src install-examples install)")
    container.install_gpuslice(("install-examples", "install"))
    show_status(container)

    say(f"1. boot: gpuslice starts {BACKGROUND} (background, priority 90) by itself")
    container.wait_active_state(BACKGROUND, "active", STEP_TIMEOUT)
    show_status(container)

    say(f"2. systemctl start {ON_DEMAND} (on demand, priority 10) preempts {BACKGROUND}")
    container.systemctl("start", "--no-block", ON_DEMAND)
    say(f"while {BACKGROUND} saves its work: systemctl status {ON_DEMAND}")

    def waiting() -> str | None:
        out = container.run(
            ["systemctl", "status", "--no-pager", "-n", "3", ON_DEMAND], check=False
        ).stdout
        return out if "waiting for" in out else None

    print(wait_until(waiting, STEP_TIMEOUT, what=f"{ON_DEMAND} to say why it waits"), flush=True)
    container.wait_active_state(ON_DEMAND, "active", STEP_TIMEOUT)
    container.wait_active_state(BACKGROUND, "inactive", STEP_TIMEOUT)
    show_status(container)

    say(f"3. {ON_DEMAND} finishes (~5 s): {BACKGROUND} comes back by itself")
    started = time.monotonic()
    container.wait_active_state(ON_DEMAND, "inactive", STEP_TIMEOUT)
    container.wait_active_state(BACKGROUND, "active", STEP_TIMEOUT)
    print(f"(back after {time.monotonic() - started:.1f} s)")
    show_status(container)

    say("what gpuslice said (journalctl -u gpuslice)")
    print(container.journal("gpuslice.service", "-o", "cat"), flush=True)


def play_gpus(container: Container) -> None:
    """Act two: VRAM packing and a foreign process on two simulated GPUs."""
    say(f"4. systemctl stop {BACKGROUND} (held), then restart gpuslice on two simulated GPUs")
    container.systemctl("stop", BACKGROUND)
    before = len(container.journal("gpuslice.service", "-o", "cat").splitlines())
    fakegpu.install(container, 2)
    show_status(container)

    say(f"5. two background units needing 10 GiB each on GPU 0: {' and '.join(PACKED)}")
    for priority, unit in enumerate(PACKED, start=80):
        fakegpu.write_alloc_job(container, unit, priority, "background", memory="10G", devices="0")
    container.systemctl("daemon-reload")
    for unit in PACKED:
        container.wait_active_state(unit, "active", STEP_TIMEOUT)
    wait_until(
        lambda: (
            [h["memory_used"] for h in _gpu0(container)["holders"]].count(10 << 30) == 2 or None
        ),
        STEP_TIMEOUT,
        what="a sample of the packed units' memory",
    )
    show_status(container)

    say(f"6. a program gpuslice does not manage ({FOREIGN}) takes 3 GiB on GPU 0: they yield")
    pid = fakegpu.start_foreign(container, FOREIGN, 0, "3G")
    for unit in PACKED:
        container.wait_active_state(unit, "inactive", STEP_TIMEOUT)
    print(f"(foreign PID {pid})")
    show_status(container)

    say(f"7. {FOREIGN} ends: both come back by themselves")
    started = time.monotonic()
    fakegpu.stop_foreign(container, FOREIGN)
    for unit in PACKED:
        container.wait_active_state(unit, "active", STEP_TIMEOUT)
    print(f"(back after {time.monotonic() - started:.1f} s)")
    show_status(container)

    say("what gpuslice said in act two (journalctl -u gpuslice)")
    lines = container.journal("gpuslice.service", "-o", "cat").splitlines()
    print("\n".join(lines[before:]), flush=True)


def _gpu0(container: Container) -> dict[str, Any]:
    data = json.loads(container.run(["gpuslice", "status", "--json"]).stdout)
    gpu: dict[str, Any] = data["gpus"][0]
    return gpu


def main() -> int:
    say("preparing the container tree (cached after the first run)")
    tree, timings = ensure_tree()
    print(f"tree {tree} (build {timings.build_s:.1f} s, unpack {timings.unpack_s:.1f} s)")
    container = Container(tree)
    try:
        container.start()
        print(f"booted {container.name} in {container.boot_s:.2f} s")
        play(container)
        play_gpus(container)
    except BedError as exc:
        print(f"\ndemo FAILED: {exc}", file=sys.stderr)
        if container.leader is not None:
            print(container.journal("gpuslice.service"), file=sys.stderr)
        return 1
    finally:
        container.stop()
    say("done; container stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
