"""`gpuslice new` and `gpuslice enroll`: the annotation keys as command-line options, and a
complete unit written for a command.

The options come from annotations.KEYS, the table the parser uses, so the CLI accepts every
key the parser knows and validates it the same way. Files are written to a temporary name and
renamed, then read back through the parser: what is written is exactly what `gpuslice check`
and the controller will see.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import os
import pwd
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from gpuslice import safefile
from gpuslice.annotations import KEYS, SECTION, Key, is_our_gate
from gpuslice.core.model import UnitKind
from gpuslice.envsyntax import NAME_MAX, PATH_MAX
from gpuslice.unitfiles import (
    SYSTEM_UNIT_PATH,
    UNIT_NAME_MAX,
    find_dropins,
    is_valid_unit_name,
    printable,
)

NEW_MARKER = "# Written by `gpuslice new`"
# `gpuslice new` and `enroll` hold this lock from the look at what is there to the read-back
# (and the undo): two of them at once (two admins, a script in a loop) each read the unit,
# then wrote, then validated what was there; one's undo put back the file the other had just
# replaced, and each could report the other's unit as its own. Hidden and with no unit
# suffix, so that systemd never reads it; 0600, so that no other user can open it (flock
# needs only an open file) and hold every `gpuslice new` waiting.
LOCK_NAME = ".gpuslice.lock"
# Where a unit of this name would already be found: every directory of systemd's system
# search path. A subset (/etc, /run, /usr/lib, /lib) missed /usr/local/lib/systemd/system,
# where `make install` puts gpuslice.service itself: `gpuslice new gpuslice ...` shadowed the
# controller's unit with a GPU job, and at its next restart no controller ran at all. It
# missed the generators' units too (a SysV script's, from /etc/init.d), portable services'
# (system.attached) and the transient and control units that would shadow the one written.
UNIT_DIRS = tuple(d.lstrip("/") for d in SYSTEM_UNIT_PATH)
# A directory made for a unit or a drop-in (`enroll`'s `UNIT.d/`): root's to write, whatever
# the umask gpuslice runs with, as the files in it are 0644 whatever it is. Made with the
# umask's mode, a root shell or script with `umask 0` made it 0777: any local user could add a
# drop-in (`ExecStartPre=+...`, run as root at the unit's next start) or replace the annotation.
DIR_MODE = 0o755
STOP_TIMEOUT = 30  # seconds between KillSignal= and SIGKILL: time to save work and exit
# A numeric User= as systemd's parse_uid() takes it: decimal, no sign, blank or leading 0.
_UID = re.compile(r"0|[1-9][0-9]{0,9}", re.ASCII)
# What no name may hold: systemd's relaxed rule refuses `:` (passwd's field separator) and
# `/` (a path's); gpuslice refuses `%` too, which starts a specifier (systemd expands User=),
# so the name could not be written as it is.
_NOT_IN_NAME = frozenset(":/%")
# `-` then digits, which systemd refuses (some write UID 65535 as -1)
_NEGATIVE = re.compile(r"-[0-9]*", re.ASCII)


def is_user_name(user: str) -> bool:
    """A User= systemd's unit loader takes (`valid_user_group_name()`, relaxed, numeric
    allowed) and gpuslice can write as it is. Relaxed as systemd is for the names other
    databases make (SSSD's, Samba's: `john.doe`, `John`, `1st`, `DOM\\john`): anything but
    the empty name, `.`, `..`, all digits (but a valid UID), `-` then digits, a space at
    either end, a control character, `:`, `/`, or text that is not UTF-8; no length limit, as
    systemd's relaxed rule sets none. Refused beyond systemd's rule: `%` (`_NOT_IN_NAME`)
    and a `\\` at the end, which joins the next line to the `User=` line."""
    if user.isascii() and user.isdigit():  # a UID, or no name at all (`0123`, `65535`)
        return bool(_UID.fullmatch(user)) and int(user) < 0xFFFFFFFF and int(user) != 0xFFFF
    return (
        user not in ("", ".", "..")
        and not user.startswith(" ")
        and not user.endswith((" ", "\\"))
        and not _NEGATIVE.fullmatch(user)
        and all(_name_character(c) for c in user)
    )


def _name_character(c: str) -> bool:
    """Whether `c` may be in a name (`is_user_name`): not a C0 control, DEL or one of
    `_NOT_IN_NAME`; UTF-8, so not a lone surrogate (what argv's bytes that were not UTF-8
    become); and a character systemd's unichar_is_valid() takes (no non-character such as
    U+FFFE)."""
    point = ord(c)
    return (
        " " <= c != "\x7f"
        and c not in _NOT_IN_NAME
        and not 0xD800 <= point <= 0xDFFF
        and not 0xFDD0 <= point <= 0xFDEF
        and point & 0xFFFE != 0xFFFE
    )


def user_exists(user: str) -> bool:
    """Whether the host's user database (NSS) knows User=: systemd looks it up at each start
    and fails the start ("Failed to determine user credentials") for a user it does not know,
    a numeric UID too (it needs the user's group), and `gpuslice new` had reported the unit
    written. root and nobody (0, 65534) it makes up without a lookup. Looked up through `pwd`
    when called, so that a test can stand in for the host's users."""
    if user in ("root", "0", "nobody", "65534"):
        return True
    try:
        if _UID.fullmatch(user):  # as systemd: a UID when it parses as one, else a name
            pwd.getpwuid(int(user))
        else:
            pwd.getpwnam(user)
    except (KeyError, OverflowError):
        return False
    return True


def printable_path(path: str) -> bool:
    """Printable ASCII only, so that no line break or control character reaches the unit,
    and no backslash at the end: systemd joins such a line with the next one, and
    `WorkingDirectory=/srv/job\\` named /srv/job. No blank at the end either (systemd strips
    it: `/srv/job ` named /srv/job), and no `..` component nor one over 255 characters:
    systemd refuses such a WorkingDirectory= (not normalized, not a valid path) and with it
    the whole unit, which `gpuslice new` had reported written. At most 4095 characters:
    systemd's PATH_MAX (4096) counts the NUL, and it refused a 4096-character one ("Failed to
    resolve unit specifiers"), the whole unit with it."""
    parts = path.split("/")
    return (
        0 < len(path) < PATH_MAX
        and all(32 <= ord(c) < 127 for c in path)
        and path[-1] not in "\\ "
        and ".." not in parts
        and max(map(len, parts)) <= NAME_MAX
    )


def option_name(key: Key) -> str:
    return "--" + key.name.lower()


class EscapedChoice(click.Choice):  # type: ignore[type-arg]
    """click.Choice, its error quoting a value that is not printable ASCII escaped
    (`printable`): a line break or a terminal's escape sequence in it is not echoed raw."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        shown = printable(str(value), 100)
        # never one of the choices (printable ASCII, no backslash): refused in click's words
        return super().convert(shown if shown != value else value, param, ctx)


def _validator(key: Key) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def validate(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None or isinstance(value, bool):
            return value
        try:
            # The value is written as given: the parser strips the blanks around a size, and
            # `--memory $'\n8G'` wrote `Memory=` (whole GPU) above a stray line `8G`.
            if any(c != "\t" and not c.isprintable() for c in str(value)):
                raise ValueError("a line end or control character")
            key.parse(str(value))
        except ValueError as e:
            detail = "" if str(e) in ("", str(value)) else f": {e}"
            # printable: a line break or a terminal's escape sequence is echoed escaped
            raise click.BadParameter(
                printable(f"{key.name}={value}{detail}", 300) + f" (allowed: {key.allowed})"
            ) from None
        return str(value)

    return validate


def annotation_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """One option per annotation key, validated by the key's own parser: `--priority`
    (required), `--type`, `--gpus`, `--requeue/--no-requeue`, `--memory`, `--devices`,
    `--preempt`. A key that takes one of an enum's values (`--type`) is a click choice: a
    value outside it is refused in click's words, not in the enum's."""
    for key in reversed(KEYS):
        name = option_name(key)
        if key.name == "Requeue":
            func = click.option(
                f"{name}/--no-{name[2:]}",
                "requeue",
                default=None,
                help="Restart the unit when capacity returns after it was preempted "
                "(default: yes).",
            )(func)
            continue
        func = click.option(
            name,
            key.field,
            required=key.required,
            type=EscapedChoice([e.value for e in type(key.default)])
            if isinstance(key.default, enum.Enum)
            else None,
            callback=_validator(key),
            help=f"{key.name}=: {key.allowed}"
            + ("" if key.required or key.default in (None, ()) else f" (default: {_shown(key)})"),
        )(func)
    return func


def _shown(key: Key) -> str:
    default = key.default
    if isinstance(default, tuple):
        return " ".join(d.value if isinstance(d, enum.Enum) else str(d) for d in default)
    return default.value if isinstance(default, enum.Enum) else str(default)


def annotation_text(values: Mapping[str, Any]) -> str:
    """The `[X-GPUSlice]` section for the options given (keyed by UnitSpec field); keys left
    out keep their defaults."""
    lines = [f"[{SECTION}]"]
    for key in KEYS:
        value = values.get(key.field)
        if value is None:
            continue
        if isinstance(value, bool):
            value = "yes" if value else "no"
        lines.append(f"{key.name}={value}")
    return "\n".join(lines) + "\n"


def unit_name(name: str) -> str:
    """NAME or NAME.service; a plain service name, not a template or another unit type."""
    if "." not in name:
        name += ".service"
    if len(name) > UNIT_NAME_MAX and is_valid_unit_name(name[-UNIT_NAME_MAX:]):
        raise click.BadParameter(
            f"'{printable(name, 60)}': not a service name: {len(name)} characters, "
            f"systemd takes at most {UNIT_NAME_MAX}",
            param_hint="NAME",
        )
    if not is_valid_unit_name(name) or not name.endswith(".service") or "@" in name:
        raise click.BadParameter(
            f"'{printable(name, 100)}': not a service name (letters, digits and :-_.\\, no @)",
            param_hint="NAME",
        )
    # systemd takes `-H.service`, systemctl does not: `--now` ran `systemctl start --no-block
    # -H.service`, which went to connect to a host named ".service", and every later
    # `systemctl stop NAME` an admin types is an option too
    if name.startswith("-"):
        raise click.BadParameter(
            f"'{printable(name, 100)}': a name that starts with '-' is an option to systemctl",
            param_hint="NAME",
        )
    return name


# What exec_quote replaces, in one pass. systemd's read_line ends a unit-file line at "\r"
# as at "\n" (gpuslice/unitfiles.py, _LINE_END): a raw one in an argument would start a line
# of its own, e.g. `ExecStartPre=+...`, run as root whatever User= says.
# Every other control character as \\xNN (a C escape systemd decodes): the file stays text
# that `systemctl cat` shows an admin without sending their terminal a sequence.
_EXEC_ESCAPES = str.maketrans(
    {
        **{chr(c): f"\\x{c:02x}" for c in (*range(1, 32), 127)},
        **{"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t", "$": "$$", "%": "%%"},
    }
)


def _utf8_escaped(char: str) -> str:
    """A character as its UTF-8 bytes, each `\\xNN`: systemd copies each such byte as it is,
    so the argument it decodes is the one given, whatever the character (a `\\U` escape of
    a noncharacter such as U+1FFFE is refused, and with it the whole ExecStart=)."""
    return "".join(f"\\x{b:02x}" for b in char.encode("utf-8"))


def exec_quote(arg: str) -> str:
    """One ExecStart= argument in systemd's syntax: double-quoted with C escapes (`\\n` and
    `\\r` among them: an argument never ends its line; other control characters as `\\xNN`),
    `$` and `%` doubled so that systemd expands neither variables nor specifiers. A NUL
    cannot come: no argv holds one.

    Beyond ASCII, every character Python does not call printable goes as its UTF-8 bytes
    (`_utf8_escaped`): a C1 control (U+009B is CSI, U+009D OSC to a terminal that honours
    them in UTF-8), a BiDi override (U+202E shows the arguments after it reversed), a
    zero-width character, a line separator. `systemctl cat` then shows the admin what runs."""
    quoted = arg.translate(_EXEC_ESCAPES)
    if not quoted.isascii():
        quoted = "".join(c if c.isprintable() else _utf8_escaped(c) for c in quoted)
    return f'"{quoted}"'


def is_utf8(arg: str) -> bool:
    """False for an argument the shell passed as bytes that are no UTF-8 (Python holds them
    as lone surrogates): systemd ignores a unit-file line that is not UTF-8."""
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown_bytes(arg: str) -> str:
    """`arg` for a message, its undecodable bytes as `\\xff`."""
    return printable(arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"), 80)


COMMAND_AFTER_DASHES = "give the command after --, e.g. -- /usr/bin/python3 job.py"


class CommandAfterDashes(click.Command):
    """`gpuslice new`, which takes each word of its COMMAND only after `--`. click takes an
    option wherever it stands among the positional words: `gpuslice new job --priority 5
    python3 train.py --gpus 2` wrote a unit that ran `python3 train.py` with GPUs=2, and a
    job's own `--user`, `--workdir`, `--now` or `--priority` became gpuslice's in the same
    way: systemd did not run the command typed. After `--` click takes no option at all."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        after = len(args) - args.index("--") - 1 if "--" in args else 0
        rest = super().parse_args(ctx, args)
        # every word after `--` is positional, and COMMAND the last of those: its words all
        # came after `--` if there are at least as many there
        if not ctx.resilient_parsing and len(ctx.params.get("command") or ()) > after:
            raise click.UsageError(
                f"{COMMAND_AFTER_DASHES} (an option of the command before it is taken for "
                "gpuslice's own)",
                ctx,
            )
        return rest


def resolve_command(command: Sequence[str]) -> list[str]:
    """The command with its program as an absolute path (systemd runs no shell)."""
    if not command:
        raise click.UsageError(COMMAND_AFTER_DASHES)
    for number, arg in enumerate(command, start=1):
        if not is_utf8(arg):
            raise click.BadParameter(
                f"argument {number} ('{shown_bytes(arg)}') is not UTF-8, and a unit file is",
                param_hint="COMMAND",
            )
    program = command[0]
    if not os.path.isabs(program):
        found = shutil.which(program)
        if found is None:
            raise click.BadParameter(f"{program!r}: not found in PATH", param_hint="COMMAND")
        program = os.path.abspath(found)
    why = _unrunnable(program)
    if why:
        raise click.BadParameter(f"'{shown_bytes(program)}': {why}", param_hint="COMMAND")
    return [program, *command[1:]]


def missing_program(program: str) -> bool:
    """Whether the absolute `program` is not there (no such file, a component not a
    directory, a dangling link, a loop of links): each start of the unit fails (203/EXEC).
    Not refused, only said: it may be on a file system mounted later (a network home, a data
    disk). False where it cannot be told (a directory that cannot be searched)."""
    try:
        os.stat(program)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError as e:
        return e.errno == errno.ELOOP
    except ValueError:
        return False
    return False


def _unrunnable(program: str) -> str | None:
    """Why systemd would not run this absolute program path, if it would not. It refuses
    the whole unit for a quote, a backslash or a control character in it ("Executable name
    contains special characters"), a trailing `/`, a name over 255 bytes, or a path of
    PATH_MAX (4096) bytes or more: `gpuslice new` had reported written a unit that never
    loaded. And it expands no `$` in the path (only in the arguments): the `$$` that keeps an
    argument's `$` made the path another file."""
    if any(c < " " or c in "\"'\\\x7f" for c in program):
        return (
            "a quote, a backslash or a control character in the program's path: systemd refuses it"
        )
    if "$" in program:
        return "'$' in the program's path: systemd keeps it there, but expands it in argv[0]"
    if program.endswith("/") or max(len(p.encode("utf-8")) for p in program.split("/")) > NAME_MAX:
        return (
            f"a directory, or a name over {NAME_MAX} bytes: systemd refuses such a program's path"
        )
    if len(program.encode("utf-8")) >= PATH_MAX:  # which counts the NUL
        return f"a path of {PATH_MAX} bytes or more: systemd refuses such a program's path"
    return None


def unit_text(
    name: str,
    command: Sequence[str],
    annotation: str,
    *,
    kind: UnitKind,
    user: str | None = None,
    workdir: str | None = None,
) -> str:
    """A complete service for COMMAND: stopped gracefully (SIGTERM, then SIGKILL after
    STOP_TIMEOUT s); a background unit that fails is restarted by systemd after 30 s, an
    on-demand one is not (a person or a timer started it and decides)."""
    service = [
        "Type=exec",
        "ExecStart=" + " ".join(exec_quote(a) for a in command),
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={STOP_TIMEOUT}",
    ]
    if kind is UnitKind.BACKGROUND:
        service += ["Restart=on-failure", "RestartSec=30"]
    if user:
        service.append(f"User={user}")
    if workdir:
        service.append("WorkingDirectory=" + workdir.replace("%", "%%"))
    return (
        f"{NEW_MARKER}; gpuslice new refuses to overwrite a unit it did not write.\n"
        f"[Unit]\nDescription={name.removesuffix('.service')} (GPU job, gpuslice new)\n\n"
        "[Service]\n" + "\n".join(service) + "\n\n" + annotation
    )


def existing_unit(name: str, root: Path) -> Path | None:
    """Where systemd would already find a unit of this name, if anywhere."""
    for directory in UNIT_DIRS:
        path = root / directory / name
        if os.path.lexists(path):
            return path
    return None


def own_dropins(name: str, root: Path) -> list[str]:
    """The drop-ins in a directory named for this unit (`NAME.d/`, anywhere in the search
    path), but the generator's gate (`is_our_gate`): what a unit of this name gets besides
    its own file. Before `gpuslice new` makes the unit, they were left by an earlier one (an
    enroll's `gpuslice.conf`, a `systemctl edit` override), and they change the job it
    writes."""
    return [
        f.path
        for f in find_dropins(name, root)
        if os.path.basename(os.path.dirname(f.path)) == name + ".d" and not is_our_gate(f.path)
    ]


def written_by_new(path: Path) -> bool:
    previous = read_regular(path, len(NEW_MARKER))
    return previous is not None and previous.decode("ascii", "replace") == NEW_MARKER


def read_regular(path: Path, limit: int | None = None) -> bytes | None:
    """A regular file's bytes (symlinks followed), the first `limit` only if given; None for
    anything else. A FIFO or a device is never opened (`safefile`)."""
    try:
        return safefile.read_bytes(path, limit, follow_links=True, prefix=True)
    except safefile.Unreadable:
        return None


def make_dir(directory: Path) -> None:
    """`directory`, and each missing one above it, made `DIR_MODE` whatever the umask.
    `mkdir(DIR_MODE)` alone left the umask to take bits off it (0700 under `umask 077`, the
    files in it 0644), and `parents=` made those above it with the umask's mode (0777 under
    `umask 0`: any user could swap `system/` for a directory of their own)."""
    old = os.umask(0o022)
    try:
        directory.mkdir(DIR_MODE, parents=True, exist_ok=True)
    finally:
        os.umask(old)


def lock_unit_dir(directory: Path, *, wait: bool = True) -> int:
    """An open descriptor of `directory`'s LOCK_NAME, locked (flock, exclusive; closing it
    unlocks), the directory made first if needed (`make_dir`). Waits while another holds it,
    or, without `wait`, raises BlockingIOError."""
    make_dir(directory)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(directory / LOCK_NAME, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_atomically(path: Path, data: str | bytes, *, exclusive: bool = False) -> os.stat_result:
    """Write `data` to a new file next to `path`, then rename it over `path`: systemd, which
    may reload meanwhile, sees the old file or the new one, never half of one. With
    `exclusive`, link it to `path` instead, which fails (FileExistsError) if anything is
    there: a unit an admin wrote after the look that found none is not replaced. The temporary
    name is short (a 253-character unit name leaves no room for a suffix within NAME_MAX),
    made with O_EXCL, and has no unit or `.conf` suffix, so systemd never reads it; it is
    removed when anything fails (OSError).

    The data is on disk before the rename, and the rename before this returns (fsync of the
    file, then of its directory): without them a power cut soon after could leave the name
    on an empty file (a filesystem may commit the rename before the delayed data), and
    systemd takes an empty unit file for a masked unit: the job, or the drop-in's
    annotation, gone.

    Returns the written file's status (`os.fstat`): its st_dev and st_ino tell an undo whether
    `path` is still this file or one another writer put there since."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    make_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=".gpuslice-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            written = os.fstat(f.fileno())
        if exclusive:
            os.link(tmp, path)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # The file is in place: a directory this filesystem cannot sync does not make it unwritten.
    with contextlib.suppress(OSError):
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    return written
