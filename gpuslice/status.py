"""`gpuslice status`: the scheduler's snapshot as stable JSON, and as a table for people.

The JSON (version 1) is a documented interface: keys are only ever added.
  {"version": 1,
   "gpus": [{"index": 0, "holders": [{"unit": str, "priority": int, "state": str}]}],
   "waiting": [{"unit": str, "priority": int, "reason": str}],
   "preempted": [{"unit": str, "priority": int, "requeue": bool}],
   "held": [str], "finished": [str], "failed": [str],
   "problems": [str]}
`state` is "running", "starting" (gpuslice started it; its gate has not asked yet) or
"stopping" (being preempted).
"""

from __future__ import annotations

from typing import Any

from gpuslice.annotations import Scan
from gpuslice.core.scheduler import Snapshot

JSON_VERSION = 1


def snapshot_to_json(snap: Snapshot, scan: Scan) -> dict[str, Any]:
    return {
        "version": JSON_VERSION,
        "gpus": [
            {
                "index": index,
                "holders": [
                    {"unit": unit, "priority": prio, "state": state}
                    for unit, prio, state in holders
                ],
            }
            for index, holders in sorted(snap.gpus.items())
        ],
        "waiting": [
            {"unit": unit, "priority": prio, "reason": reason}
            for unit, prio, reason in snap.waiting
        ],
        "preempted": [
            {"unit": unit, "priority": prio, "requeue": requeue}
            for unit, prio, requeue in snap.preempted
        ],
        "held": snap.held,
        "finished": snap.finished,
        "failed": snap.failed,
        "problems": [str(p) for p in scan.problems],
    }


def render(data: dict[str, Any]) -> str:
    """A table a person reads at a glance; every list is shown, empty ones as "-"."""
    lines = [f"{'GPU':<4} {'UNIT':<40} {'PRIORITY':>8}  STATE"]
    for gpu in data["gpus"]:
        if not gpu["holders"]:
            lines.append(f"{gpu['index']:<4} {'(free)':<40} {'':>8}")
        for h in gpu["holders"]:
            lines.append(f"{gpu['index']:<4} {h['unit']:<40} {h['priority']:>8}  {h['state']}")
    lines.append("")
    lines.append("Waiting:")
    lines += [f"  {w['unit']} (priority {w['priority']}): {w['reason']}" for w in data["waiting"]]
    if not data["waiting"]:
        lines.append("  -")
    preempted = [
        f"{p['unit']} (priority {p['priority']}, "
        + ("returns when capacity frees)" if p["requeue"] else "Requeue=no)")
        for p in data["preempted"]
    ]
    for title, items in (
        ("Preempted", preempted),
        ("Held (stopped by hand)", data["held"]),
        ("Finished", data["finished"]),
        ("Failed", data["failed"]),
    ):
        lines.append(f"{title}: {', '.join(items) if items else '-'}")
    if data.get("problems"):
        lines.append("")
        lines.append("Annotation problems:")
        lines += [f"  {p}" for p in data["problems"]]
    return "\n".join(lines)
