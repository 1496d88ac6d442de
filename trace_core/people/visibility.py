"""Who may see what inside an org: the one visibility rule, and what follows from it.

**The rule** (:func:`may_read`): a dataset whose ``read_roles`` is empty is
visible to every member of its org; one with ``read_roles`` is visible to
the members of at least one of those org roles, and to the org's admins.
Nothing of another org is ever visible (the storage reads are org-scoped,
:mod:`trace_core.storage.ports.catalog`).

**What follows**, so that no answer names or counts an invisible dataset:

* a job (and so its tasks, their attempts and errors, and its explanation)
  is visible only when every dataset it reads and writes is
  (:meth:`Visible.job`): its errors and events may speak of any of them;
* a DAG's name is visible to every member; of its versions, only the
  visible datasets are listed;
* lineage is followed only *through* visible datasets
  (:meth:`Visible.lineage`): an edge to an invisible dataset is cut, and so
  is everything reached only across one;
* the query service attaches only visible datasets (:meth:`Visible.views`).

An invisible object answers exactly as a missing one
(:class:`~trace_core.errors.NotFound` with the same message).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from trace_core.errors import NotFound
from trace_core.people.access import Caller, PlatformRole
from trace_core.security.claims import DatasetInput
from trace_core.storage.ports.catalog import CatalogDataset, CatalogJob
from trace_core.storage.ports.lineage import LineageRow
from trace_core.storage.protocol import Transaction

__all__ = ["Visible", "may_read", "missing_dataset", "visible_to"]


def may_read(caller: Caller, read_roles: Collection[str]) -> bool:
    """Whether ``caller`` (a member of the dataset's org) may see a dataset with
    ``read_roles`` (the rule of the module docstring)."""
    if caller.role is PlatformRole.ADMIN or not read_roles:
        return True
    return not set(read_roles).isdisjoint(caller.org_roles)


def missing_dataset(name: str) -> NotFound:
    """The one answer for a dataset that is missing *or* invisible."""
    return NotFound(f"no dataset {name!r}")


@dataclass(frozen=True)
class Visible:
    """The datasets of the caller's org the caller may see, by id."""

    caller: Caller
    datasets: Mapping[uuid.UUID, CatalogDataset]

    def named(self, name: str) -> CatalogDataset:
        """The visible dataset ``name``; :func:`missing_dataset` otherwise."""
        for dataset in self.datasets.values():
            if dataset.name == name:
                return dataset
        raise missing_dataset(name)

    def job(self, job: CatalogJob) -> bool:
        """Whether every dataset ``job`` reads and writes is visible."""
        return all(d in self.datasets for d in (*job.inputs, *job.outputs))

    def views(self) -> dict[str, DatasetInput]:
        """The query service's inputs: each visible dataset with a live version,
        by its name (lowercase)."""
        live = [
            d
            for d in self.datasets.values()
            if d.current_version is not None and d.location is not None
        ]
        # Names are case-insensitive in queries: two that differ only by case name neither.
        names = Counter(d.name.lower() for d in live)
        return {
            d.name.lower(): DatasetInput(d.dataset_uuid, d.current_version, d.location)
            for d in live
            if names[d.name.lower()] == 1 and d.current_version and d.location
        }

    def lineage(
        self, subject: uuid.UUID, rows: Iterable[LineageRow], direction: Literal["up", "down"]
    ) -> list[LineageRow]:
        """``rows`` (upstream or downstream of ``subject``) followed only through
        visible datasets: a row is kept when both its datasets are visible and
        its near end is ``subject`` or the far end of a kept row."""
        candidates = [
            r
            for r in rows
            if r.output_dataset in self.datasets and r.input_dataset in self.datasets
        ]
        reached = {subject}
        kept: set[LineageRow] = set()
        grew = True
        while grew:  # a fixpoint: at most one pass per level of the answer
            grew = False
            for row in candidates:
                near, far = (
                    (row.output_dataset, row.input_dataset)
                    if direction == "up"
                    else (row.input_dataset, row.output_dataset)
                )
                if row not in kept and near in reached:
                    kept.add(row)
                    grew = grew or far not in reached
                    reached.add(far)
        return sorted(kept)


async def visible_to(tx: Transaction, caller: Caller) -> Visible:
    """What ``caller`` may see of their org, read in ``tx``."""
    found = await tx.catalog.datasets(caller.org_id)
    return Visible(caller, {d.dataset_uuid: d for d in found if may_read(caller, d.read_roles)})
