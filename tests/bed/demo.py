"""`make demo`: the gpuslice story told by a real systemd in a throwaway container.

vlm-analysis (background, priority 90) starts by itself; voice-pipeline (on demand, priority 10)
preempts it; when voice-pipeline ends (~5 s) vlm-analysis comes back by itself. A second act
restarts gpuslice on two simulated 24 GiB GPUs (tests/bed/fakegpu): two 10 GiB background units
share GPU 0, and yield to a process gpuslice does not manage while it uses that GPU. A third
act, in a second container on pure cgroup v2 (systemd can freeze units only there), has the
background job say `Preempt=suspend stop`: the urgent job's arrival suspends it (the fake
cuda-checkpoint moves its VRAM to host memory, systemd freezes it) and when the GPU is free
again it is thawed and restored, the same process counting on from where it was. Every step
waits on systemd's own state, never on a guessed sleep.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from tests.bed import fakegpu
from tests.bed.container import BedError, Container, ensure_tree, wait_until

BACKGROUND = "vlm-analysis.service"
ON_DEMAND = "voice-pipeline.service"
STEP_TIMEOUT = 30.0
PACKED = ("photo-tagging.service", "embeddings.service")
FOREIGN = "notebook-kernel.service"  # CUDA work nobody annotated (a display server would not count)
# act three: the fake cuda-checkpoint configured, no host memory kept back (the bed's is small)
SUSPEND_CONFIG = (
    fakegpu.TEST_CONFIG + f"cuda_checkpoint: {fakegpu.CHECKPOINT}\nsuspend_host_memory_margin: 0\n"
)
PROGRESS = "/run/progress"


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
    # "active" comes at the fork; the job saves its work on SIGTERM only once its shell has
    # set the trap, which it says by its first line (without this wait, a fast machine
    # preempted it before, and act two's "saves its work" window never came)
    wait_until(
        lambda: "started on GPU" in container.journal(BACKGROUND, "-o", "cat") or None,
        STEP_TIMEOUT,
        what=f"{BACKGROUND} to say it started",
    )
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


def play_suspend(container: Container) -> None:
    """Act three, in a unified container: the background job is suspended, not stopped."""
    say("installing gpuslice on one simulated 24 GiB GPU, cuda-checkpoint configured")
    container.install_gpuslice()
    fakegpu.install(container, 1, config=SUSPEND_CONFIG)
    print(container.run(["cat", fakegpu.CONFIG]).stdout.rstrip(), flush=True)
    _write_counting_job(container)
    _write_urgent_job(container, seconds=5)
    container.systemctl("daemon-reload")
    print(container.run(["systemctl", "cat", BACKGROUND]).stdout.rstrip(), flush=True)

    say(f"8. gpuslice starts {BACKGROUND} (Preempt=suspend stop) by itself: it counts its work")
    container.wait_active_state(BACKGROUND, "active", STEP_TIMEOUT)
    _counting(container, _progress(container))
    pid = _prop(container, BACKGROUND, "MainPID")
    print(f"(MainPID {pid}, progress {_progress(container)})")
    show_status(container)

    say(f"9. systemctl start {ON_DEMAND} (priority 10): {BACKGROUND} is suspended, not stopped")
    before = len(container.journal("gpuslice.service", "-o", "cat").splitlines())
    container.systemctl("start", "--no-block", ON_DEMAND)
    container.wait_active_state(ON_DEMAND, "active", STEP_TIMEOUT)
    _journal_line(container, f"suspending {BACKGROUND}")
    paused = _progress(container)
    time.sleep(1)  # a frozen job does no work: its counter must not move in this second
    still = _progress(container)
    print(
        f"(FreezerState {_prop(container, BACKGROUND, 'FreezerState')}, "
        f"ActiveState {container.active_state(BACKGROUND)}; progress {paused}, "
        f"a second later {still})"
    )
    if still != paused:
        raise BedError(f"{BACKGROUND} counted on while suspended ({paused} -> {still})")
    show_status(container)

    say(f"10. {ON_DEMAND} finishes (~5 s): {BACKGROUND} is thawed and restored, and carries on")
    started = time.monotonic()
    _journal_line(container, f"resuming {BACKGROUND}")
    print(f"(back after {time.monotonic() - started:.1f} s)")
    after = _counting(container, paused)
    same = _prop(container, BACKGROUND, "MainPID")
    restarts = _prop(container, BACKGROUND, "NRestarts")
    print(f"(MainPID {same}, NRestarts {restarts}; progress {paused} -> {after}, not from 1)")
    if same != pid or after <= paused:
        raise BedError(f"{BACKGROUND} did not carry on: MainPID {pid} -> {same}")
    show_status(container)

    say("what gpuslice said in act three (journalctl -u gpuslice)")
    lines = container.journal("gpuslice.service", "-o", "cat").splitlines()
    print("\n".join(lines[before:]), flush=True)


def _write_counting_job(container: Container) -> None:
    """BACKGROUND: a shell counting its work in PROGRESS/vlm-analysis every 50 ms while a
    gpu-alloc child holds 10 GiB on the GPU it was granted."""
    loop = (
        f"{fakegpu.ALLOC} --gpu $$GPUSLICE_GPUS --bytes 10G & "
        f"n=0; while :; do n=$$((n+1)); echo $$n > {PROGRESS}/%N; sleep 0.05; done"
    )
    container.write_file(
        f"{fakegpu.UNIT_DIR}/{BACKGROUND}",
        "[Unit]\nDescription=Photo analysis (VLM), suspended rather than stopped\n\n"
        f"[Service]\nEnvironment=FAKE_NVML_DIR={fakegpu.STATE}\n"
        f"ExecStartPre=/bin/mkdir -p {PROGRESS}\nExecStart=/bin/sh -c '{loop}'\n\n"
        "[X-GPUSlice]\nPriority=90\nType=background\nPreempt=suspend stop\n",
    )


def _write_urgent_job(container: Container, seconds: int) -> None:
    """ON_DEMAND: holds 10 GiB on its GPU for SECONDS, then exits successfully."""
    command = (
        f"{fakegpu.ALLOC} --gpu $$GPUSLICE_GPUS --bytes 10G & "
        f"sleep {seconds}; kill $$!; wait $$!; exit 0"
    )
    container.write_file(
        f"{fakegpu.UNIT_DIR}/{ON_DEMAND}",
        "[Unit]\nDescription=Transcribe recordings, now\n\n"
        f"[Service]\nEnvironment=FAKE_NVML_DIR={fakegpu.STATE}\n"
        f"ExecStart=/bin/sh -c '{command}'\n\n"
        "[X-GPUSlice]\nPriority=10\nType=on-demand\n",
    )


def _prop(container: Container, unit: str, name: str) -> str:
    return container.systemctl("show", "-P", name, unit).stdout.strip()


def _progress(container: Container) -> int:
    out = container.run(f"cat {PROGRESS}/vlm-analysis 2>/dev/null || echo 0").stdout
    return int(out.strip() or 0)


def _counting(container: Container, since: int) -> int:
    """Wait until the background job's counter is past SINCE; its value then."""
    return wait_until(
        lambda: ((n := _progress(container)) > since and n) or None,
        STEP_TIMEOUT,
        what=f"{BACKGROUND} to count past {since}",
    )


def _journal_line(container: Container, text: str) -> None:
    """Print gpuslice's first journal line containing TEXT, once there is one."""

    def line() -> str | None:
        lines = container.journal("gpuslice.service", "-o", "cat").splitlines()
        return next((x for x in lines if text in x), None)

    print(wait_until(line, STEP_TIMEOUT, what=f"journal line {text!r}"), flush=True)


def _gpu0(container: Container) -> dict[str, Any]:
    data = json.loads(container.run(["gpuslice", "status", "--json"]).stdout)
    gpu: dict[str, Any] = data["gpus"][0]
    return gpu


def perform(container: Container, *acts: Callable[[Container], None]) -> bool:
    """Boot CONTAINER, play ACTS in it and stop it; False (the reason printed) if one fails."""
    try:
        container.start()
        print(f"booted {container.name} in {container.boot_s:.2f} s")
        for act in acts:
            act(container)
    except BedError as exc:
        print(f"\ndemo FAILED: {exc}", file=sys.stderr)
        if container.leader is not None:  # every unit's lines, to the millisecond
            whole = container.journal(None, "-o", "short-precise").splitlines()
            print("\n".join(whole[-150:]), file=sys.stderr)
        return False
    finally:
        container.stop()
    return True


def main() -> int:
    say("preparing the container tree (cached after the first run)")
    tree, timings = ensure_tree()
    print(f"tree {tree} (build {timings.build_s:.1f} s, unpack {timings.unpack_s:.1f} s)")
    if not perform(Container(tree), play, play_gpus):
        return 1
    say("act three: a second container, on pure cgroup v2 (systemd can freeze units there)")
    if not perform(Container(tree, unified=True), play_suspend):
        return 1
    say("done; containers stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
