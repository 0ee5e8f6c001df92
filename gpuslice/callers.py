"""Who is behind each bus connection that called Status, as the bus daemon said it, kept.

Where /proc hides other users' processes, Status asks the bus daemon who each caller is
(GetConnectionCredentials, one of the controller's calls in flight: service.MAX_STATUS_ASKING).
A connection's credentials are those the bus daemon saw when it connected, and a dbus-daemon
never gives a unique name (`:1.42`) twice in its life, which the controller's own connection
does not outlive (it exits with its bus). So the answer for a unique name stays true as long
as it is kept, and it is keyed by the sender the bus daemon stamped on the message, which a
client cannot set: nothing a caller sends puts an answer under another's name.

Kept: answers that name a UID, of unique names only; the CALLERS_KEPT used last (a user who
connects 10,000 times, each to call once, pushes out the oldest names, and the one whose
name was pushed out is asked about again). A lookup that failed, or said no UID, is not
kept: such a caller is answered as one /proc hides everything from, and asked about again
next time (fail closed). A name that left the bus is not looked for (NameOwnerChanged of
every connection would be a signal per connect and disconnect on the host): it is pushed
out like any other, and never comes back to be found.
"""

from __future__ import annotations

from collections import OrderedDict

# Unique names whose credentials are kept: a few hundred bytes each
CALLERS_KEPT = 256

Credentials = tuple[int | None, frozenset[int]]  # UID, group IDs: systemd.credentials_of


class KnownCallers:
    """The bus daemon's word on each unique name that called, the CALLERS_KEPT used last."""

    def __init__(self) -> None:
        self._known: OrderedDict[str, Credentials] = OrderedDict()

    def __len__(self) -> int:
        return len(self._known)

    def get(self, sender: str) -> Credentials | None:
        found = self._known.get(sender)
        if found is not None:
            self._known.move_to_end(sender)
        return found

    def put(self, sender: str, credentials: Credentials) -> None:
        """Keep what the bus daemon said of `sender`: only of a unique name, and only when
        it named a UID."""
        if not sender.startswith(":") or credentials[0] is None:
            return
        self._known[sender] = credentials
        self._known.move_to_end(sender)
        while len(self._known) > CALLERS_KEPT:
            self._known.popitem(last=False)
