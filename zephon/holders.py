"""Who holds a deletion claim, as far as this host can tell: gc takes over at once the claims of
a holder it proves dead instead of waiting out their lease, and names the ones it cannot judge.

A claim token made with the default actor names its process (``user@host:pid``, see
``catalog.claim_holder``). On the same host the process is provably gone when no process has
its pid, when that pid is a zombie (killed, not yet reaped), or when the process now holding it
started after the claim was made (the pid was reused). A claim of another host, or of a token
with a custom actor, cannot be judged: only its lease ends it. Hosts are told apart by their
host name, so two machines (or containers with separate pid namespaces) sharing a host name
could take each other's live claims for dead ones; that costs a second, harmless storage delete
(deletes are idempotent and exactly one claimant marks the row deleted), never a checkpoint.
"""

from __future__ import annotations

import datetime as dt
import enum
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zephon.catalog import Catalog, CheckpointRecord, claim_holder

__all__ = ["HeldClaims", "Holder", "held_claims", "judge_holder", "still_held"]

#: how much later than the claim a process may seem to start and still be its holder: the
#: boot time the kernel reports moves with the wall clock, and is given in whole seconds
_START_SLACK = dt.timedelta(seconds=2)


class Holder(enum.Enum):
    """What this host knows about a claim's holder."""

    GONE = "gone"  # provably dead: its claim can be taken over now
    ALIVE = "alive"  # a live process on this host: it is deleting right now
    UNKNOWN = "unknown"  # another host's, or a custom actor's: only the lease tells


def judge_holder(token: str, claimed_at: dt.datetime) -> Holder:
    """Whether the process that made claim ``token`` at ``claimed_at`` is gone, alive or
    beyond this host's sight."""
    holder = claim_holder(token)
    if holder is None or holder[0] != socket.gethostname():
        return Holder.UNKNOWN
    pid = holder[1]
    if pid == os.getpid():
        return Holder.ALIVE  # this very process (another thread's claim, a retention of ours)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return Holder.GONE
    except PermissionError:
        pass  # a process of another user has the pid
    except OverflowError:
        return Holder.UNKNOWN  # not a pid this kernel can have
    status = _process_status(pid)
    if status is None:
        return Holder.ALIVE  # no /proc to look closer (macOS): a process has the pid
    state, started = status
    if state in {"Z", "X"} or started > claimed_at + _START_SLACK:
        return Holder.GONE
    return Holder.ALIVE


def _process_status(pid: int) -> tuple[str, dt.datetime] | None:
    """The state letter and start time of process ``pid`` from Linux's /proc, None elsewhere
    (or if it exited meanwhile)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            # "pid (comm) state ... starttime(22nd)": comm may hold spaces and parentheses
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/stat", encoding="ascii") as system:
            boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
        started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return fields[0], dt.datetime.fromtimestamp(started, dt.UTC)


@dataclass(frozen=True, slots=True)
class HeldClaims:
    """The run's ``deleting`` rows as a pass found them."""

    #: steps this pass may claim: lease over, released, or a holder proved gone
    takeable: set[int]
    #: rows whose holder this host cannot judge, with their lease still running
    unknown: list[CheckpointRecord]


def held_claims(
    catalog: Catalog,
    name: str,
    lease: dt.timedelta,
    dry_run: bool,
    held: Sequence[int] | None = None,
) -> HeldClaims:
    """Sort the run's claims: the ones a pass may take over now (the claims of a holder proved
    dead are released first, so that the claim re-takes them whatever its lease), the ones a
    live process of this host is finishing, and the ones only their lease can end.

    ``held``: the run's ``deleting`` steps as a read just made found them (the retention
    plan's ``held``); empty, there is nothing to sort and the catalog is not asked again (a
    claim made since belongs to a gc running now, whose lease is fresh)."""
    if held is not None and not held:
        return HeldClaims(set(), [])
    now = dt.datetime.now(dt.UTC)
    takeable: set[int] = set()
    gone: dict[str, list[int]] = {}
    unknown: list[CheckpointRecord] = []
    judged: dict[str, Holder] = {}
    for row in catalog.list_checkpoints(name, states="deleting"):
        if row.claimed_at is None or row.claimed_by is None or row.claimed_at < now - lease:
            takeable.add(row.step)
            continue
        token = row.claimed_by
        if token not in judged:
            judged[token] = judge_holder(token, row.claimed_at)
        if judged[token] is Holder.GONE:
            gone.setdefault(token, []).append(row.step)
        elif judged[token] is Holder.UNKNOWN:
            unknown.append(row)
    if gone and dry_run:
        takeable.update(step for steps in gone.values() for step in steps)
    elif gone:
        takeable.update(catalog.release_claims(name, list(gone), "its holder process is gone"))
    return HeldClaims(takeable, unknown)


def still_held(
    catalog: Catalog, name: str, unknown: list[CheckpointRecord], lease: dt.timedelta
) -> list[dict[str, Any]]:
    """The claims among ``unknown`` that their holder has not finished by now."""
    before = {(row.step, row.claimed_by, row.claimed_at) for row in unknown}
    return [
        {
            "run": name,
            "step": row.step,
            "claimed_by": row.claimed_by,
            "lease_expires": (row.claimed_at + lease).isoformat(timespec="seconds"),
        }
        for row in catalog.list_checkpoints(name, states="deleting")
        if row.claimed_at is not None and (row.step, row.claimed_by, row.claimed_at) in before
    ]
