"""How long one local user's `Status` calls hold the controller's event loop (not part of
`make bench`: a check of gpuslice/busread.py's limits, outside any container).

    python -m bench.flood          # the reader as shipped
    python -m bench.flood --old    # without its limits (every message read in one go,
                                   # any call's arguments read): as before 2026-12-03

A private dbus-daemon (tests/test_dbus_adapter.py's policy: anyone may call Status), the
controller's connection (`Systemd`, which installs the reader) serving the Scheduler1 object,
and a ticker every 10 ms on its loop. Another process then (a) sends as many small Status
calls as its socket takes for 4 s, marshalled once, or (b) sends one call with ~8 MiB of
variants. Printed: the loop's longest stall in each case. Any local user can do both on the
system bus; past WatchdogSec= (30 s) systemd kills the controller, and every GPU job waits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from dbus_next import BusType
from dbus_next.aio import MessageBus

from gpuslice import busread
from gpuslice.service import BUS_NAME, INTERFACE, OBJECT_PATH, SchedulerService
from gpuslice.systemd import Systemd
from tests.test_dbus_adapter import BUS_CONFIG, _accepts

FLOOD_S = 4
CALLER = """
import asyncio, sys, time
from dbus_next import BusType, Message, MessageFlag, Variant
from dbus_next.aio import MessageBus

async def main() -> None:
    bus = await MessageBus(bus_address=sys.argv[1], bus_type=BusType.SYSTEM).connect()
    def call(*body):
        return Message(destination=%(name)r, path=%(path)r, interface=%(interface)r,
                       member="Status", flags=MessageFlag.NO_REPLY_EXPECTED,
                       signature="av" if body else "", body=list(body))
    if sys.argv[2] == "big":
        bus.send(call([Variant("y", 1)] * (1 << 20)))
        await asyncio.sleep(1)
        return
    msg = call()
    msg.serial = 7
    data = msg._marshall() * 500
    bus._sock.setblocking(True)
    end, sent = time.monotonic() + %(seconds)d, 0
    while time.monotonic() < end:
        bus._sock.sendall(data)
        sent += 500
    print(f"{sent} calls in %(seconds)d s", file=sys.stderr)

asyncio.run(main())
""" % {"name": BUS_NAME, "path": OBJECT_PATH, "interface": INTERFACE, "seconds": FLOOD_S}  # noqa: UP031 (the script holds braces)


@contextlib.contextmanager
def private_bus() -> Iterator[str]:
    """A private dbus-daemon with tests/test_dbus_adapter.py's policy, for the time of the
    block: its address. DaemonMissing when there is no dbus-daemon."""
    daemon_path = shutil.which("dbus-daemon")
    if daemon_path is None:
        raise DaemonMissing("dbus-daemon is needed (Debian package dbus-daemon)")
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "bus.conf"
        config.write_text(BUS_CONFIG.format(socket=Path(tmp) / "bus", limits=""))
        daemon = subprocess.Popen(
            [daemon_path, f"--config-file={config}", "--nofork", "--nopidfile"],
            stderr=subprocess.DEVNULL,
        )
        try:
            while not _accepts(Path(tmp) / "bus"):
                time.sleep(0.01)
            yield f"unix:path={tmp}/bus"
        finally:
            daemon.terminate()
            daemon.wait(timeout=5)


class DaemonMissing(Exception):
    pass


async def longest_stall(address: str, mode: str) -> float:
    """The controller's side: serve Status, tick, let the caller run, drain."""
    bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()
    systemd = Systemd(bus)
    service = SchedulerService(systemd.bus, lambda u, s: None, lambda: "{}", lambda: None)
    await service.claim_name()
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    last = [loop.time()]

    def tick() -> None:
        now = loop.time()
        gaps.append(now - last[0])
        last[0] = now
        loop.call_later(0.01, tick)

    loop.call_later(0.01, tick)
    caller = await asyncio.create_subprocess_exec(sys.executable, "-c", CALLER, address, mode)
    await caller.wait()
    await asyncio.sleep(3 if mode == "big" else 15)  # whatever is still queued is read
    bus.disconnect()
    await bus.wait_for_disconnect()
    return max(gaps)


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--old", action="store_true", help="without the reader's limits")
    old = args.parse_args(argv).old
    if old:
        busread.MAX_PER_TURN = 10**9
        busread.MAX_CALL_BODY = 1 << 40
    try:
        with private_bus() as address:
            for mode, what in (("flood", f"{FLOOD_S} s of small calls"), ("big", "one 8 MiB call")):
                stall = asyncio.run(longest_stall(address, mode))
                reader = "without limits" if old else "as shipped"
                print(f"reader {reader}, {what}: the loop's longest stall {stall:.3f} s")
    except DaemonMissing as e:
        print(f"bench.flood: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
