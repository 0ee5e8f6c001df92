"""bench/flood.py's private bus (`python -m bench.flood`, a check of busread.py's limits)."""

from __future__ import annotations

import asyncio

from bench import flood
from tests.test_dbus_adapter import connect, run


def test_the_flood_bench_starts_its_private_bus() -> None:
    """Its bus configuration is tests/test_dbus_adapter.py's, whose `{limits}` it must fill
    in: left out, every run of the bench ended in a KeyError before it measured anything."""
    with flood.private_bus() as address:

        async def scenario() -> None:
            bus = await connect(address)
            assert bus.unique_name.startswith(":")
            await asyncio.sleep(0)

        run(scenario)
