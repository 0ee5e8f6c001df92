"""`make demo`: the gpuslice story told by a real systemd in a throwaway container.

vlm-analysis (background, priority 90) starts by itself; voice-pipeline (on demand, priority 10)
preempts it; when voice-pipeline ends (~5 s) vlm-analysis comes back by itself. Every step waits
on systemd's own state, never on a guessed sleep.
"""

from __future__ import annotations

import sys
import time

from tests.bed.container import BedError, Container, ensure_tree

BACKGROUND = "vlm-analysis.service"
ON_DEMAND = "voice-pipeline.service"
STEP_TIMEOUT = 30.0


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


def main() -> int:
    say("preparing the container tree (cached after the first run)")
    tree, timings = ensure_tree()
    print(f"tree {tree} (build {timings.build_s:.1f} s, unpack {timings.unpack_s:.1f} s)")
    container = Container(tree)
    try:
        container.start()
        print(f"booted {container.name} in {container.boot_s:.2f} s")
        play(container)
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
