"""What readers of the status cost the controller (not part of `make bench`: checks of
gpuslice/status.py's CachedStatus and gpuslice/service.py's Status limits, outside any container).

    python -m bench.status_load cost 10000        # a `--watch`-like reader at 10,000 waiters
    python -m bench.status_load flood 2200000 reply 2 8
    python -m bench.status_load flood 8000 noreply 2

`cost N`: a controller on the unit tests' fakes (tests/test_controller.py's Bed) with N
annotated units at their gate on 8 GPUs; a Status call every 0.5 s and a change every 2 s (a
GPU sample, while anything waits) for 60 s. Printed: the share of the time spent building
answers.

`flood SIZE MODE SECONDS [CONNECTIONS]`: a private dbus-daemon (tests/test_dbus_adapter.py's
policy: anyone may call Status), the controller's SchedulerService answering a status of SIZE
bytes, and another process that sends Status calls as fast as its sockets take them for
SECONDS: with MODE `noreply` (NO_REPLY_EXPECTED) or `reply` (ordinary calls whose answers it
never reads). Printed: answers built, how long a call of the controller's own waited behind
them (a GetId to the bus daemon, as a StopUnit to systemd would), and its peak RSS.
"""

from __future__ import annotations

import asyncio
import resource
import sys
import tempfile
import time
from pathlib import Path

from dbus_next import BusType, Message
from dbus_next.aio import MessageBus

from bench.flood import private_bus
from gpuslice.config import Config
from gpuslice.service import SchedulerService
from gpuslice.systemd import Systemd
from tests.test_controller import Bed, settle, state

# The flooding process: marshals 100 calls at a time and writes them as its sockets take them.
CALLER = r"""
import asyncio, sys, time
from dbus_next import BusType, Message, MessageFlag
from dbus_next.aio import MessageBus
from gpuslice.service import BUS_NAME, INTERFACE, OBJECT_PATH

async def main():
    conns = [
        await MessageBus(bus_address=sys.argv[1], bus_type=BusType.SYSTEM).connect()
        for _ in range(int(sys.argv[3]))
    ]
    for bus in conns:  # never reads an answer
        asyncio.get_running_loop().remove_reader(bus._fd)
    flags = MessageFlag.NO_REPLY_EXPECTED if sys.argv[2] == "noreply" else MessageFlag.NONE
    end = time.monotonic() + float(sys.argv[4])
    serial = 100
    while time.monotonic() < end:
        for bus in conns:
            data = b""
            for _ in range(100):
                serial += 1
                data += Message(destination=BUS_NAME, path=OBJECT_PATH, interface=INTERFACE,
                                member="Status", flags=flags, serial=serial)._marshall()
            try:
                bus._sock.settimeout(0.05)
                bus._sock.sendall(data)
            except OSError:
                pass
    await asyncio.sleep(1)

asyncio.run(main())
"""


async def _cost(units: int, seconds: float = 60.0) -> None:
    tmp = Path(tempfile.mkdtemp())
    names = {f"job-{i:05d}.service": f"Priority={i % 1000}\n" for i in range(units)}
    states = [state(u, "activating", "start-pre", i + 1, "start") for i, u in enumerate(names)]
    config = Config(gpus=8, state_dir=str(tmp / "state"), runtime_dir=str(tmp / "run"))
    ctl = Bed(tmp, names, states, config=config).controller
    await ctl.start()
    await settle()
    spent, calls, begin, changed = 0.0, 0, time.monotonic(), 0.0
    while time.monotonic() - begin < seconds:
        if time.monotonic() - changed >= 2:
            ctl.answers.changed()
            changed = time.monotonic()
        start = time.perf_counter()
        ctl.status_json()
        spent += time.perf_counter() - start
        calls += 1
        await asyncio.sleep(0.5)
    wall = time.monotonic() - begin
    print(
        f"units={units} gpus=8 calls={calls}: building answers took {spent:.2f} s of "
        f"{wall:.1f} s = {spent / wall:.0%}"
    )


async def _flood(address: str, size: int, mode: str, seconds: float, conns: int) -> None:
    bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()
    body = "{" + "x" * (size - 2) + "}"
    built = [0]

    def on_status() -> str:
        built[0] += 1
        return body

    service = SchedulerService(Systemd(bus).bus, lambda u, s: None, on_status, lambda: None)
    await service.claim_name()
    loop = asyncio.get_running_loop()
    waits: list[float] = []

    async def probe() -> None:
        while True:
            start = loop.time()
            get_id = Message(
                destination="org.freedesktop.DBus",
                path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus",
                member="GetId",
            )
            await bus.call(get_id)
            waits.append(loop.time() - start)
            await asyncio.sleep(0.1)

    probing = loop.create_task(probe())
    caller = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CALLER, address, mode, str(conns), str(seconds)
    )
    await caller.wait()
    await asyncio.sleep(2)  # what was queued drains
    probing.cancel()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"size={size / 1e6:.1f} MB mode={mode} connections={conns}: {built[0]} answers built; "
        f"the controller's own call waited up to {max(waits) * 1e3:.0f} ms; peak RSS {rss:.0f} MiB"
    )


def _flood_on_a_private_bus(size: int, mode: str, seconds: float, conns: int) -> None:
    with private_bus() as address:
        asyncio.run(_flood(address, size, mode, seconds, conns))


def main(argv: list[str]) -> None:
    if argv[:1] == ["cost"] and len(argv) == 2:
        asyncio.run(_cost(int(argv[1])))
    elif argv[:1] == ["flood"] and len(argv) in (4, 5):
        conns = int(argv[4]) if len(argv) == 5 else 1
        _flood_on_a_private_bus(int(argv[1]), argv[2], float(argv[3]), conns)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
