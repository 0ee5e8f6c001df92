"""What an asyncio timer was armed for, read back robustly on a loaded machine."""

from __future__ import annotations

import asyncio
import math


def armed_for(handle: asyncio.TimerHandle) -> float:
    """The whole seconds a timer was armed for (every delay the tests read is whole): its
    `when()` less the loop's time now is that less the time since it was armed, which a
    loaded machine (a mutation run beside) made 4 ms, and rounding to the millisecond read
    as a wrong delay. Up to a second late still reads right; a delay a second off does not."""
    left = handle.when() - asyncio.get_running_loop().time()
    return float(math.ceil(round(left, 6)))
