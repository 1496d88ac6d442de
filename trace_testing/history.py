"""The history checker: a ledger of effects and a report of what went wrong.

A handler under test records its effect in :class:`EffectLedger` *in the same
transaction* as the fenced completion of the item it works on. If the
completion is refused (the fence is stale), the transaction rolls back and
the effect vanishes with it; if it commits, the effect is there. After a run,
:func:`check_history` compares the ledger with what the database says
finished, and reports

- **lost** effects: an item that finished with no effect recorded;
- **duplicated** effects: an item with more than one effect (under fenced
  completions, a protocol violation; for at-least-once side effects such as
  the outbox relay's, a count to report);
- **out-of-fence** effects: an effect recorded under another attempt than the
  one that completed the item (a stale holder's write that committed);
- **unexpected** effects: of items the run did not create.

The ledger's unique constraint is one effect per (item, attempt): a holder
cannot record twice under one lease, while effects of different attempts
stay visible to the report.

The ledger is a table of the test's own database (``trace_effects``),
created by :meth:`EffectLedger.create`; a pooled Postgres database whose
schema a test changed is dropped afterwards, not reused.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from trace_core.errors import NotFound
from trace_core.leasing import LeaseQueue
from trace_core.model import Fence, ItemId
from trace_core.storage.sql import SqlRepository
from trace_core.storage.sql_errors import translate_errors
from trace_core.tasks import TaskQueue

__all__ = [
    "Effect",
    "EffectLedger",
    "HistoryReport",
    "check_history",
    "committed_fences",
]

_METADATA = sa.MetaData()

EFFECTS = sa.Table(
    "trace_effects",
    _METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("item_id", sa.Text, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("lease_token", sa.Text, nullable=False),
    sa.Column("holder", sa.Text, nullable=False),
    sa.UniqueConstraint("item_id", "attempt", name="trace_effects_one_per_attempt"),
)
"""The ledger table: one row per effect that committed."""


@dataclass(frozen=True)
class Effect:
    """One committed effect: the item, and the fence it was recorded under."""

    item_id: str
    attempt: int
    lease_token: str
    holder: str


def _key(item_id: ItemId) -> str:
    return str(item_id)


def _token(token: uuid.UUID | str | None) -> str:
    if isinstance(token, uuid.UUID):
        return token.hex
    return str(token or "")


class EffectLedger:
    """The ``trace_effects`` table of one database, written inside the
    transactions of the handler under test."""

    table = EFFECTS

    def __init__(self, repo: SqlRepository) -> None:
        """The ledger in ``repo``'s database (call :meth:`create` once)."""
        self.repo = repo

    async def create(self) -> None:
        """Create the ledger table if it does not exist yet."""
        async with self.repo.transaction() as tx:
            await tx.connection.run_sync(_METADATA.create_all, checkfirst=True)

    @staticmethod
    async def record(tx: Any, fence: Fence, holder: str) -> None:
        """Record the effect of the attempt ``fence`` names, in the handler's
        transaction ``tx`` (a :class:`~trace_core.storage.sql.SqlRepository`
        transaction), before its fenced completion.

        A second effect under the same attempt raises
        :class:`~trace_core.errors.DuplicateItem`.
        """
        with translate_errors("effect ledger insert"):
            await tx.connection.execute(
                sa.insert(EFFECTS).values(
                    item_id=_key(fence.item_id),
                    attempt=fence.attempt,
                    lease_token=_token(fence.lease_token),
                    holder=holder,
                )
            )

    async def effects(self) -> list[Effect]:
        """Every committed effect, in the order they were recorded."""
        t = EFFECTS
        async with self.repo.read() as tx:
            rows = (
                await tx.connection.execute(
                    sa.select(t.c.item_id, t.c.attempt, t.c.lease_token, t.c.holder).order_by(
                        t.c.id
                    )
                )
            ).all()
        return [Effect(str(r[0]), int(r[1]), str(r[2]), str(r[3])) for r in rows]

    async def check(self, committed: Mapping[ItemId, Fence | None]) -> HistoryReport:
        """:func:`check_history` of this ledger against ``committed``."""
        return check_history(await self.effects(), committed)

    async def check_tasks(self, task_ids: Iterable[ItemId]) -> HistoryReport:
        """:meth:`check` against the attempts that completed ``task_ids``
        (each task must have exactly one effect, of that attempt)."""
        ids = list(task_ids)
        fences = await committed_fences(TaskQueue(self.repo).leases, ids)
        # An unfinished task matches no attempt: no effect is lost, any is
        # out of fence.
        unfinished = uuid.UUID(int=0)
        return await self.check(
            {item: fences.get(item, Fence(item, 0, unfinished)) for item in ids}
        )


_INSPECT_CHUNK = 500
"""Items :func:`committed_fences` reads per transaction."""


async def committed_fences(queue: LeaseQueue, item_ids: Iterable[ItemId]) -> dict[ItemId, Fence]:
    """The fence of the attempt that finished each item, read through the
    repository's ``inspect`` (what :meth:`~trace_core.leasing.LeaseQueue.inspect`
    reads), many items per read transaction. :class:`NotFound` for an item
    that does not exist.

    An item that is not finished is left out: :func:`check_history` reports
    it lost (its effect, if any, is out of fence)."""
    fences: dict[ItemId, Fence] = {}
    ids = list(item_ids)
    # Many reads per transaction: a transaction each costs more than its read
    # (10,000 items took ~50 s on a busy machine, one read transaction each).
    for start in range(0, len(ids), _INSPECT_CHUNK):
        async with queue.repo.read() as tx:
            for item_id in ids[start : start + _INSPECT_CHUNK]:
                state = await tx.inspect(queue.queue, item_id)
                if state is None:
                    raise NotFound(f"{queue.queue.name} item {item_id} does not exist")
                if state.status == queue.queue.done and state.lease_token is not None:
                    fences[item_id] = Fence(item_id, state.attempt, state.lease_token)
    return fences


@dataclass(frozen=True)
class HistoryReport:
    """What :func:`check_history` found; :attr:`ok` when nothing is wrong."""

    expected: int
    """Items that should each have exactly one effect."""
    effects: int
    """Effects in the ledger."""
    lost: tuple[str, ...] = ()
    duplicated: Mapping[str, int] = field(default_factory=dict)
    """Item -> number of effects, for items with more than one."""
    out_of_fence: tuple[Effect, ...] = ()
    unexpected: tuple[Effect, ...] = ()

    @property
    def duplicate_effects(self) -> int:
        """Effects beyond the first, summed over the duplicated items."""
        return sum(n - 1 for n in self.duplicated.values())

    @property
    def ok(self) -> bool:
        """Nothing lost, duplicated, out of fence or unexpected."""
        return not (self.lost or self.duplicated or self.out_of_fence or self.unexpected)

    def summary(self) -> dict[str, int]:
        """The counts, machine-readable (for a benchmark's or a test's report)."""
        return {
            "expected": self.expected,
            "effects": self.effects,
            "lost": len(self.lost),
            "duplicated_items": len(self.duplicated),
            "duplicate_effects": self.duplicate_effects,
            "out_of_fence": len(self.out_of_fence),
            "unexpected": len(self.unexpected),
        }

    def __str__(self) -> str:
        """The counts and the first few items of each finding."""
        parts = [", ".join(f"{k}={v}" for k, v in self.summary().items())]
        if self.lost:
            parts.append(f"lost: {list(self.lost[:5])}")
        if self.duplicated:
            parts.append(f"duplicated: {dict(list(self.duplicated.items())[:5])}")
        if self.out_of_fence:
            parts.append(f"out of fence: {list(self.out_of_fence[:5])}")
        if self.unexpected:
            parts.append(f"unexpected: {list(self.unexpected[:5])}")
        return "; ".join(parts)


def check_history(
    effects: Sequence[Effect], committed: Mapping[ItemId, Fence | None]
) -> HistoryReport:
    """Compare the ledger's ``effects`` with ``committed``: each item that must
    have had its effect, mapped to the fence of the attempt that completed it
    (``None`` when only loss and duplication are checked, e.g. for
    at-least-once effects)."""
    expected = {_key(item): fence for item, fence in committed.items()}
    per_item = Counter(effect.item_id for effect in effects)
    lost = tuple(sorted(item for item in expected if per_item[item] == 0))
    duplicated = {item: n for item, n in sorted(per_item.items()) if n > 1 and item in expected}
    out_of_fence: list[Effect] = []
    unexpected: list[Effect] = []
    for effect in effects:
        if effect.item_id not in expected:
            unexpected.append(effect)
            continue
        fence = expected[effect.item_id]
        if fence is not None and (effect.attempt, effect.lease_token) != (
            fence.attempt,
            _token(fence.lease_token),
        ):
            out_of_fence.append(effect)
    return HistoryReport(
        expected=len(expected),
        effects=len(effects),
        lost=lost,
        duplicated=duplicated,
        out_of_fence=tuple(out_of_fence),
        unexpected=tuple(unexpected),
    )
