"""The handover area of the repository port: taking back the leases of a holder known to be gone.

Reached as ``tx.handover`` on any :class:`~trace_core.storage.protocol.Transaction`.
A lease normally ends by expiry: nobody can tell a dead holder from a slow
one, so the reaper waits for the TTL. Some embedders *can* tell: the lite
platform holds an OS lock on its data directory, and a process that gets it
has proved that the previous holder is gone. This area ends that holder's
leases at once, through the same fence every write of the ownership protocol
carries; the failures that follow are the protocol's own fenced writes
(:meth:`~trace_core.leasing.LeaseQueue.reclaim_held_by`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from trace_core.model import Fence, QueueSpec

__all__ = ["HandoverOps"]


class HandoverOps(Protocol):
    """Revoking the leases of a gone holder, inside one transaction."""

    async def revoke_leases(
        self, queue: QueueSpec, *, worker_prefix: str, now: datetime, limit: int
    ) -> list[Fence]:
        """End, at ``now``, up to ``limit`` leases of ``queue`` whose holder's
        worker id starts with ``worker_prefix`` (a non-empty literal prefix, no
        wildcards); the fences that now hold them.

        Each revoked row gets ``lease_expires_at = now`` and its
        ``claim_version`` bumped: a fence its old holder presents (with its
        claim_version) no longer matches, so a ghost of that holder could not
        heartbeat, complete or fail it. Rows not in a leased status are left
        alone; an empty prefix raises ``ValueError`` (it would match every holder).
        """
        ...
