"""Whether systemd ran a stop job on a unit, as PID 1 itself wrote it to the journal: asked at
start-up of the holders the last controller saw running that are down with no job now (they
ended while no controller ran), where systemd's record of the unit's main process cannot tell
(a unit that traps SIGTERM and exits 0 looks as one that ended by itself) or is gone (a unit
systemd unloaded once down, its record with it).

What systemd 252 writes (read from systemd-stable v252.31):
- src/core/job.c job_emit_start_message, called by job_perform_on_unit when the unit's start
  did something (r > 0; service.c service_start returns 1 from dead or failed): "Starting
  UNIT..." with MESSAGE_ID=SD_MESSAGE_UNIT_STARTING, at every start of a service that was down.
- job.c job_emit_done_message, called by job_finish_and_invalidate unless the job did nothing
  to the unit (`already`): "Stopped UNIT." with MESSAGE_ID=SD_MESSAGE_UNIT_STOPPED and
  JOB_RESULT=done when a stop (or restart) job's unit went down (unit.c unit_process_job).
  Written at every such end, where "Stopping UNIT..." (SD_MESSAGE_UNIT_STOPPING) is not:
  service_stop returns 0, and job_perform_on_unit writes nothing, for a service still
  activating (a Type=oneshot job for its whole run, Type=notify before READY=1, a unit at
  its gate).
- both carry UNIT= (unit.h log_unit_struct, LOG_UNIT_ID) and are at LOG_INFO: a unit's
  LogLevelMax= or journald's MaxLevelStore= keeps both or neither.
- a unit whose main process ended by itself, or by someone's `kill`, ran no job: no "Stopped".
_PID is set by journald from the socket's credentials: only PID 1 writes as _PID=1 (a user's
entries carry the user's PID, and journald drops any field a client names with a `_`).

The latest of those for the unit in this boot answers: "Stopped", a stop job ended its last
run; "Starting", its last start has no stop job's end after it. The order is the journal's
(sequence numbers, within the boot the monotonic clock), not the wall clock, so no clock step
since matters, and the unit's own start bounds the search: the state file records no time of
a holder (the core orders by sequence numbers), and its save time is wall clock. Neither entry:
the journal holds no word (Storage=none, vacuumed, LogLevelMax=), and cannot tell. journald
drops a source's messages beyond RateLimitBurst= and says so once one passes again
(journal/journald-server.c server_dispatch_message: "Suppressed N messages from init.scope",
MESSAGE_ID=SD_MESSAGE_JOURNAL_DROPPED, _TRANSPORT=driver, OBJECT_PID=1): one after the latest
entry found means a later entry may be lost, and the journal cannot tell either.

"This boot" is journald's, not `-b`'s: journalctl takes `-b` from
/proc/sys/kernel/random/boot_id (journalctl.c add_boot, add_match_this_boot), and in a
container (systemd-nspawn overmounts that file with the container's id; LXC likely too) the
fresh /proc/sys that ProtectKernelTunables= or ProtectControlGroups= mounts for this service
shows the host kernel's id, where journald (outside the sandbox) wrote the container's: `-b`
matched no entry. So under systemd (which sets $INVOCATION_ID for each start of a service),
the journal's own entry of this controller's start gives the boot: PID 1's entries of a unit's
start carry INVOCATION_ID= (job.c job_emit_start_message, unit.h LOG_UNIT_INVOCATION_ID), an id
of this start only, sent as the process is forked (long before the controller, up and on the
bus, asks; a journald behind by that much loses only this answer), and `-o json` prints each
entry's _BOOT_ID (logs-show.c output_json, the id journald stamped it with). Each unit's
question then names that _BOOT_ID. Without $INVOCATION_ID (not run by systemd) `-b` it is;
with one but no such entry (the controller's own LogLevelMax= below info), the journal cannot
tell.

journalctl is input from outside: it runs off the event loop, `AT_ONCE` at a time, all within
`ASK_SECONDS` (then killed and reaped), and an answer over `OUTPUT_MAX` bytes, or of another
form than asked, is no answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuslice.unitfiles import printable

JOURNALCTL = "journalctl"  # found on PATH: root's, under systemd
# SD_MESSAGE_UNIT_STARTING, SD_MESSAGE_UNIT_STOPPED, SD_MESSAGE_JOURNAL_DROPPED
# (src/systemd/sd-messages.h)
STARTING = "7d4958e842da4a758f6c1cdc7b36dcc5"
STOPPED = "9d1aaa27d60140bd96365438aad20286"
DROPPED = "a596d6fe7bfa4994828e72309e95d61e"
ASK_SECONDS = 3.0  # for every unit asked together: a start-up waits for them
AT_ONCE = 4  # journalctl processes at a time
OUTPUT_MAX = 4096  # bytes of one answer: one entry of the few fields asked for is ~500
REAP_SECONDS = 2.0  # after SIGKILL: journalctl holds no lock a kill could leave behind
_SHOWN = 3  # units named in the line that says which the journal could not tell
_FIELDS = ("MESSAGE_ID", "JOB_RESULT", "UNIT", "_PID", "_TRANSPORT", "OBJECT_PID")
_ID = re.compile(r"[0-9a-f]{32}")  # sd_id128_to_string: a boot's, an invocation's
# every question asks for the latest matching entry alone, as one JSON object (`_entry`)
_LATEST = ("-q", "--no-pager", "-o", "json", "-n", "1")


@dataclass(frozen=True)
class Answer:
    """`stopped`: True, a stop job ended the unit's last run; False, its last start has no
    stop job's end after it (it ended by itself, or by someone's kill); None, the journal
    cannot tell, `why` says why, and `failed` whether asking failed (not a journal that
    simply holds no word)."""

    stopped: bool | None
    why: str = ""
    failed: bool = False


def command(name: str, boot: str | None = None) -> list[str]:
    """The latest entry this boot of: PID 1's "Starting" of `name`, its "Stopped" of `name`
    after a stop job that did its work, and journald's word that it dropped PID 1's messages.
    This boot: `boot` (journald's id of it, `boot_command`) in each group of matches, or
    without one `-b` alone (the next word is no boot's name); the matches are argv words: no
    shell, and no word of them is "+" or a path."""
    this = [f"_BOOT_ID={boot}"] if boot is not None else []
    return [
        JOURNALCTL,
        *([] if boot is not None else ["-b"]),
        *_LATEST,
        "--output-fields=" + ",".join(_FIELDS),
        *this,
        "_PID=1",
        f"UNIT={name}",
        f"MESSAGE_ID={STARTING}",
        "+",
        *this,
        "_PID=1",
        f"UNIT={name}",
        f"MESSAGE_ID={STOPPED}",
        "JOB_RESULT=done",
        "+",
        *this,
        "_TRANSPORT=driver",
        f"MESSAGE_ID={DROPPED}",
        "OBJECT_PID=1",
    ]


def boot_command(invocation: str) -> list[str]:
    """The latest of PID 1's entries of the start `invocation` ($INVOCATION_ID: this
    controller's); its _BOOT_ID, always printed, is this boot as journald wrote it."""
    return [
        JOURNALCTL,
        *_LATEST,
        "--output-fields=_PID,INVOCATION_ID",
        "_PID=1",
        f"INVOCATION_ID={invocation}",
    ]


def _entry(text: str) -> dict[str, object] | Answer:
    """The one JSON entry of `-n 1 -o json` (two would not parse as one value); anything else
    is no answer (a failure)."""
    try:
        entry = json.loads(text)
    except (ValueError, RecursionError):  # 4 KiB of "[" nests deeper than the parser goes
        return Answer(None, f"journalctl said {printable(text, 80)}", failed=True)
    if not isinstance(entry, dict):
        return Answer(None, f"journalctl said {printable(text, 80)}", failed=True)
    return entry


def read_boot(invocation: str, out: bytes) -> str | Answer:
    """This boot's id from journalctl's output (`boot_command`): the _BOOT_ID of PID 1's entry
    of `invocation`; no entry, or any other answer, is no boot (every unit cannot tell)."""
    text = out.decode("utf-8", "replace").strip()
    if not text:
        return Answer(
            None,
            f"the journal holds no word of this controller's start (INVOCATION_ID={invocation}"
            "), so not which boot is this one",
        )
    entry = _entry(text)
    if isinstance(entry, Answer):
        return entry
    boot = entry.get("_BOOT_ID")
    ours = entry.get("_PID") == "1" and entry.get("INVOCATION_ID") == invocation
    if ours and isinstance(boot, str) and _ID.fullmatch(boot):
        return boot
    return Answer(None, f"journalctl gave an entry not asked for: {printable(text, 80)}", True)


def read_answer(name: str, out: bytes) -> Answer:
    """What journalctl's output (`command`) says of `name`: one JSON entry of those asked
    for, or none. Anything else is no answer (a failure)."""
    text = out.decode("utf-8", "replace").strip()
    if not text:
        return Answer(None, "the journal holds no word of its start or stop this boot")
    entry = _entry(text)
    if isinstance(entry, Answer):
        return entry
    said = {k: entry.get(k) for k in _FIELDS}
    by_pid1 = said["_PID"] == "1" and said["UNIT"] == name
    if by_pid1 and said["MESSAGE_ID"] == STOPPED and said["JOB_RESULT"] == "done":
        return Answer(True)
    if by_pid1 and said["MESSAGE_ID"] == STARTING:
        return Answer(False)
    if said["MESSAGE_ID"] == DROPPED and said["_TRANSPORT"] == "driver":
        return Answer(None, "journald dropped messages of systemd's since its last word of it")
    return Answer(None, f"journalctl gave an entry not asked for: {printable(text, 80)}", True)


async def ask(names: Sequence[str], seconds: float = ASK_SECONDS) -> dict[str, Answer]:
    """An answer for each of `names`, all within `seconds` (this boot's id first, then the
    units): a unit not answered by then is not known (its journalctl killed and reaped).
    Never raises but for cancellation."""
    answers: dict[str, Answer] = {}
    if not names:
        return answers
    work = asyncio.create_task(_ask_all(list(dict.fromkeys(names)), answers))
    try:
        await asyncio.wait([work], timeout=seconds)
    finally:
        work.cancel()  # a finished one ignores it; else its journalctl are killed and reaped
        await asyncio.gather(work, return_exceptions=True)
    late = Answer(None, f"journalctl did not answer within {seconds:g} s", failed=True)
    return {n: answers.get(n, late) for n in names}


async def _ask_all(names: list[str], answers: dict[str, Answer]) -> None:
    """Each unit's answer into `answers` as it comes, `AT_ONCE` at a time, once this boot is
    known; when it is not, that is every unit's answer."""
    boot = await _this_boot()
    if isinstance(boot, Answer):
        answers.update(dict.fromkeys(names, boot))
        return
    room = asyncio.Semaphore(AT_ONCE)

    async def one(name: str) -> None:
        async with room:
            out = await _run(command(name, boot))
            answers[name] = out if isinstance(out, Answer) else read_answer(name, out)

    tasks = [asyncio.create_task(one(n)) for n in names]
    try:
        await asyncio.wait(tasks)
    finally:  # the time for all ran out: each unfinished one kills its journalctl
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _this_boot() -> str | Answer | None:
    """Journald's id of this boot (from PID 1's entry of this controller's start, as systemd
    gave $INVOCATION_ID), None for `-b` (not run by systemd), or why it is not known."""
    invocation = os.environ.get("INVOCATION_ID")
    if invocation is None:
        return None
    if not _ID.fullmatch(invocation):
        why = f"INVOCATION_ID is not an id systemd gives: {printable(invocation, 40)}"
        return Answer(None, why, failed=True)
    out = await _run(boot_command(invocation))
    return out if isinstance(out, Answer) else read_boot(invocation, out)


async def _run(argv: list[str]) -> bytes | Answer:
    """journalctl's output, or why there is none to read (a failure)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError:
        return Answer(None, f"{JOURNALCTL} not found", failed=True)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return Answer(None, f"{JOURNALCTL} could not be run: {printable(reason, 80)}", True)
    try:
        out, err = await asyncio.gather(_read(proc, proc.stdout), _read(proc, proc.stderr))
        code = await proc.wait()
    except BaseException:  # cancelled: the time for all ran out, or the controller stops
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        # reaped, and its pipes read to their end: asyncio closes them, and the process's
        # transport, only then (left open, each warned when collected)
        ends = asyncio.gather(_read(proc, proc.stdout), _read(proc, proc.stderr), proc.wait())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ends, REAP_SECONDS)
        raise
    if len(out) > OUTPUT_MAX or len(err) > OUTPUT_MAX:
        return Answer(None, f"journalctl wrote more than {OUTPUT_MAX} bytes", failed=True)
    if code != 0:
        said = " ".join(err.decode("utf-8", "replace").split())
        detail = printable(said, 120) if said else "no message"
        return Answer(None, f"journalctl exited with status {code}: {detail}", failed=True)
    return out


async def _read(proc: asyncio.subprocess.Process, stream: asyncio.StreamReader | None) -> bytes:
    """The stream to its end, but only its first OUTPUT_MAX + 1 bytes kept: past those,
    journalctl is killed (its answer is no answer, and it must not write on for long) and the
    rest read and dropped (its pipe reaches its end, and asyncio closes it)."""
    if stream is None:
        return b""
    kept = bytearray()
    while chunk := await stream.read(1 << 16):
        if len(kept) <= OUTPUT_MAX:
            kept += chunk[: OUTPUT_MAX + 1 - len(kept)]
            if len(kept) > OUTPUT_MAX:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
    return bytes(kept)


def unknown_line(answers: Mapping[str, Answer]) -> tuple[bool, str] | None:
    """One line for the units the journal could not tell of, and whether any of those was a
    failure to ask (a warning) rather than a journal with no word (information); None when
    it told of every unit."""
    unknown = [(n, a) for n, a in sorted(answers.items()) if a.stopped is None]
    if not unknown:
        return None
    shown = "; ".join(f"{n}: {a.why}" for n, a in unknown[:_SHOWN])
    more = f"; and {len(unknown) - _SHOWN} more" if len(unknown) > _SHOWN else ""
    return any(a.failed for _, a in unknown), shown + more
