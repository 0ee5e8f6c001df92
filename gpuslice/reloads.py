"""When config.yaml is read: once it has settled, and once for a burst of SIGHUPs.

An admin's editor, `cp` or a configuration tool may still be writing the file when its
SIGHUP comes (or when the controller starts): read half-way, it is valid YAML whose missing
settings are the defaults (config.SETTLE_SECONDS). So it is read once it has been left
alone for CONFIG_SETTLE s, read again when it changed while it was read, and, after
CONFIG_SETTLE_WAITS waits, read as it is (a file rewritten without end is not waited for
without end). The signals that come meanwhile are that reload: each read parses the file,
takes an NVML sample and logs its warnings on the loop, and a thousand signals at once cost
a thousand of each. What a read changes stays the controller's (Controller.reload_config).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from gpuslice.config import (
    SETTLE_SECONDS,
    Config,
    Settling,
    load_config_with_warnings,
    read_unchanged,
)

log = logging.getLogger("gpuslice")

# config.yaml is read once it has been left alone this long (config.SETTLE_SECONDS says
# why), and a reload waits for that at most CONFIG_SETTLE_WAITS times before it reads the
# file as it is (a file rewritten without end is not waited for without end).
CONFIG_SETTLE = SETTLE_SECONDS
CONFIG_SETTLE_WAITS = 10


class Reloads:
    """The reload asked for and not made yet, and the waits of the one under way. Given:
    what reads and applies the file (`reload(recheck)`, Controller.reload_config: False,
    nothing applied, when `recheck` and the file changed while it was read) and whether
    start-up is done (`ready`)."""

    def __init__(
        self, config_path: Path, reload: Callable[[bool], bool], ready: Callable[[], bool]
    ) -> None:
        self.config_path = config_path
        self.reload = reload
        self.ready = ready
        self.due = False  # a reload is queued, or waits for the file to settle
        self._settling: Settling | None = None  # the waits of the reload under way

    def request(self) -> None:
        """SIGHUP: reload config.yaml once for every signal that came in this turn of the
        loop. Before start-up is done, once it is (`started`): as for a rescan, a reload's
        sample decides, and its decisions would leave before start-up's own, on a core not
        yet rebuilt."""
        if not self.due:
            self.due = True
            if self.ready():
                asyncio.get_running_loop().call_soon(self._reload_now)

    def started(self) -> None:
        """Start-up is done: a SIGHUP that came meanwhile is served now."""
        if self.due:
            self._reload_now()

    def _reload_now(self) -> None:
        """Reload config.yaml once it has been left alone for CONFIG_SETTLE s, and again if it
        changed while it was read (config.SETTLE_SECONDS: a file written in place, read
        half-way, is valid YAML whose missing settings are the defaults). Signals meanwhile
        are this reload; after CONFIG_SETTLE_WAITS waits the file is read as it is."""
        loop = asyncio.get_running_loop()
        if self._settling is None:
            self._settling = Settling(self.config_path, CONFIG_SETTLE, CONFIG_SETTLE_WAITS)
        settling = self._settling
        wait = settling.wait()
        if wait > 0:
            if settling.waits == 1:
                log.info(
                    "%s changed less than %g s ago: reloading it once it has been left alone "
                    "that long (a file written in place may be cut short)",
                    self.config_path,
                    CONFIG_SETTLE,
                )
            loop.call_later(wait, self._reload_now)
            return
        if settling.last:
            log.warning(
                "%s kept changing for %g s: reloading it as it is now",
                self.config_path,
                CONFIG_SETTLE_WAITS * CONFIG_SETTLE,
            )
        self._settling = None  # the next reload waits anew
        self.due = False  # a signal from now on reads the file again
        if self.reload(not settling.last):
            return
        self.due = True  # changed while it was read: read again once left alone
        settling.changed()
        self._settling = settling
        loop.call_later(CONFIG_SETTLE, self._reload_now)


async def load_settled(config_path: Path) -> tuple[Config, list[str]]:
    """config.yaml once it has been left alone for CONFIG_SETTLE s, read again if it changed
    while it was read (Reloads._reload_now); as it is after CONFIG_SETTLE_WAITS waits."""
    settling = Settling(config_path, CONFIG_SETTLE, CONFIG_SETTLE_WAITS)
    while True:
        wait = settling.wait()
        if wait > 0:
            await asyncio.sleep(wait)
            continue
        if settling.last:
            return load_config_with_warnings(config_path)
        loaded = read_unchanged(config_path, load_config_with_warnings)
        if loaded is not None:
            return loaded
        settling.changed()  # looked at again at once (a reload waits CONFIG_SETTLE first)
