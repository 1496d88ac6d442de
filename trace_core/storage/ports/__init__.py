"""The areas of the repository port, one Protocol per area.

A :class:`~trace_core.storage.protocol.Transaction` exposes each area as an
attribute (``tx.registry``, ``tx.deploy``, ``tx.tasks``). Each module here
holds one area's Protocol and the frozen dataclasses it takes and returns;
its SQL implementation is ``trace_core/storage/sql_<area>.py``. Nothing here
imports SQLAlchemy. See docs/architecture.md, "The storage seam".
"""

from trace_core.storage.ports.deploy import (
    DagVersionRef,
    DagVersionRow,
    DeployOps,
    JobOutputs,
    JobRecord,
    LiveVersion,
    LiveVersionJob,
    NewDagVersion,
    Pointers,
)
from trace_core.storage.ports.events import (
    EventKey,
    EventOps,
    NewEvent,
    ProducerAttempt,
    ProgressFold,
    StoredEvents,
)
from trace_core.storage.ports.journal import JournalOps, JournalRecord
from trace_core.storage.ports.registry import (
    NewDataset,
    NewDatasetVersion,
    RegisteredDataset,
    RegistryOps,
    VersionProgress,
)
from trace_core.storage.ports.routing import (
    RouteOutcome,
    RoutingOps,
    SetRoute,
    SingleInputJob,
    StoredEvent,
    TaskInput,
)
from trace_core.storage.ports.tasks import RuntimeRoute, TaskOps

__all__ = [
    "DagVersionRef",
    "DagVersionRow",
    "DeployOps",
    "EventKey",
    "EventOps",
    "JobOutputs",
    "JobRecord",
    "JournalOps",
    "JournalRecord",
    "LiveVersion",
    "LiveVersionJob",
    "NewDagVersion",
    "NewDataset",
    "NewDatasetVersion",
    "NewEvent",
    "Pointers",
    "ProducerAttempt",
    "ProgressFold",
    "RegisteredDataset",
    "RegistryOps",
    "RouteOutcome",
    "RoutingOps",
    "RuntimeRoute",
    "SetRoute",
    "SingleInputJob",
    "StoredEvent",
    "StoredEvents",
    "TaskInput",
    "TaskOps",
    "VersionProgress",
]
