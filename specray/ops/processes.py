"""Process sessions: a launched node is one session, so stopping it stops exactly its processes.

Each ``ray start --block`` runs in a new session (``setsid``); the GCS, raylet, agents and every
worker process it spawns inherit that session id, and nothing else on the machine has it. Linux
only: sessions are read from ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


def session_members(session_ids: set[int]) -> dict[int, int]:
    """pid -> session id of every live process in ``session_ids`` (zombies excluded)."""
    members = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name may hold spaces and parentheses: split after the last ")".
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        state, session = fields[0], int(fields[3])
        if session in session_ids and state != "Z":
            members[int(entry.name)] = session
    return members


def pid_alive(pid: int) -> bool:
    try:
        state = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@dataclass(frozen=True)
class Stopped:
    session: int
    processes: int  # how many processes the session had when asked to stop
    seconds: float
    killed: int  # how many needed SIGKILL after the grace period


def stop_session(session: int, grace_s: float = 10.0) -> Stopped:
    """Stop every process of ``session``: SIGTERM to all of them at once (as ``ray stop``
    does: ``ray start --block`` itself does not stop its node on a SIGTERM, so signalling it
    first only waited), SIGKILL to what is left after ``grace_s``. Returns when none is left
    (RuntimeError if one survives)."""
    start = time.monotonic()
    members = session_members({session})
    count = len(members)
    _signal_all(members, signal.SIGTERM)
    killed = 0
    while members and time.monotonic() - start < grace_s:
        time.sleep(0.2)
        members = session_members({session})
    if members:
        killed = len(members)
        _signal_all(members, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while members and time.monotonic() < deadline:
            time.sleep(0.2)
            members = session_members({session})
    if members:
        raise RuntimeError(f"processes {sorted(members)} of session {session} survived SIGKILL")
    return Stopped(session, count, time.monotonic() - start, killed)


def _signal_all(pids, signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
