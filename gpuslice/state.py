"""What systemd cannot tell a restarted controller, kept in one JSON file written atomically.

Holds, the preempted set and GPU assignments must survive `kill -9` and reboots; a torn
write must never lose them, so the file is replaced with rename(2). It is not fsynced: a
power cut may lose the last decisions (holders are rebuilt from systemd at boot anyway).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

from gpuslice.core.scheduler import SavedState

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


class StateStore:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "state.json"

    def load(self) -> tuple[SavedState, str]:
        """The saved state and the boot id it was written in ("" when there is none)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return SavedState(), ""
        except (OSError, ValueError) as e:
            log.error("%s: unreadable state (%s); starting from what systemd reports", self.path, e)
            return SavedState(), ""
        if data.get("version") != FORMAT_VERSION:
            log.warning(
                "%s: unknown format version %r; ignoring it", self.path, data.get("version")
            )
            return SavedState(), ""
        holders = {
            name: (tuple(gpus), phase, seq, rest[0] if rest else "")
            for name, (gpus, phase, seq, *rest) in data["holders"].items()
        }
        saved = SavedState(
            holders=holders,
            preempted=dict(data["preempted"]),
            held=list(data["held"]),
            finished=list(data["finished"]),
            failed=list(data["failed"]),
            seq=int(data["seq"]),
        )
        return saved, str(data.get("boot_id", ""))

    def save(self, saved: SavedState, boot_id: str) -> None:
        data = {"version": FORMAT_VERSION, "boot_id": boot_id, **asdict(saved)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, sort_keys=True)
        # rename(2) makes the replacement atomic for a crashed or killed controller; no
        # fsync, which would put a disk flush before every StartUnit/StopUnit we send
        os.replace(tmp, self.path)
