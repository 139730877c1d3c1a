"""Ray's worker exit types, as its exporter reports them, and what each means as a
departure: the protocol's ``expected`` and last ``status``, and whether the reason names a
crash (the run page's cause, ``storage.runs.runlogs.cause_of``). A crash's reason starts
with its exit type (``SYSTEM_ERROR: ...``).

This module is Ray's vocabulary alone: it imports nothing, and generic readers of stored
departures may read it."""

from __future__ import annotations

#: Exit types of a worker that crashed or was killed.
LOST_EXITS = ("SYSTEM_ERROR", "USER_ERROR", "NODE_OUT_OF_MEMORY")
#: Each exit type as a departure's ``expected`` and last ``status``.
DEPARTURES: dict[str, tuple[bool | None, str | None]] = {
    "INTENDED_SYSTEM_EXIT": (True, None),  # Ray let it go (idle, or its job ended): retired
    "INTENDED_USER_EXIT": (False, "closed"),  # it exited on purpose (exit_actor, sys.exit)
    **dict.fromkeys(LOST_EXITS, (False, "running")),  # crashed or killed: lost
}


def crashed(reason: str | None) -> bool:
    """Whether a departure's reason names a crash's exit type."""
    return (reason or "").partition(":")[0] in LOST_EXITS
