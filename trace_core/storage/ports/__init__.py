"""The areas of the repository port, one Protocol per area.

A :class:`~trace_core.storage.protocol.Transaction` exposes each area as an
attribute (``tx.registry``, ``tx.deploy``, ``tx.tasks``, ...). Each module here
holds one area's Protocol and the frozen dataclasses it takes and returns;
its SQL implementation is ``trace_core/storage/sql_<area>.py``. Nothing here
imports SQLAlchemy. See docs/architecture.md, "The storage seam".
"""

from trace_core.storage.ports.api_keys import (
    ApiKeyOps,
    ApiKeyRecord,
    DigestMatch,
)
from trace_core.storage.ports.attempts import AttemptOps, AttemptRecord
from trace_core.storage.ports.catalog import (
    CatalogDag,
    CatalogDagVersion,
    CatalogDataset,
    CatalogDatasetVersion,
    CatalogJob,
    CatalogOps,
    CatalogTask,
)
from trace_core.storage.ports.concurrency import (
    ConcurrencyOps,
    JobClaimSettings,
    QueuedTasks,
)
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
from trace_core.storage.ports.explain import (
    ExplainedJob,
    ExplainOps,
    FailedAttempt,
    InputEvent,
    JobStateFlags,
)
from trace_core.storage.ports.handover import HandoverOps
from trace_core.storage.ports.inbox import (
    EventDelivery,
    HistoryEntry,
    InboxJobRecord,
    InboxOps,
    JobSnapshot,
    JobStatusRecord,
    NewInboxJob,
    NewJobEvent,
    RefreshCount,
    Tombstone,
)
from trace_core.storage.ports.inbox_credentials import (
    InboxCredentialOps,
    JobCredentials,
    SealedCredentials,
)
from trace_core.storage.ports.job_states import (
    JobStateOps,
    ScaleState,
)
from trace_core.storage.ports.journal import (
    JournalOps,
    JournalRecord,
)
from trace_core.storage.ports.launch import (
    LaunchOps,
    StartableTask,
)
from trace_core.storage.ports.lineage import (
    LineageOps,
    LineageRow,
    NewLineageEdge,
    TaskOutputs,
)
from trace_core.storage.ports.operator_state import (
    OperatorStateKey,
    OperatorStateOps,
    StoredState,
)
from trace_core.storage.ports.payload import (
    ClaimedView,
    PayloadOps,
    VersionPointer,
)
from trace_core.storage.ports.people import (
    OrgRoleRecord,
    PeopleOps,
    UserRecord,
)
from trace_core.storage.ports.reaper import (
    HeldLease,
    ReaperOps,
    TimedOutAttempt,
)
from trace_core.storage.ports.registry import (
    NewDataset,
    NewDatasetVersion,
    RegisteredDataset,
    RegistryOps,
    VersionProgress,
)
from trace_core.storage.ports.routing import (
    LockedRoute,
    RouteOutcome,
    RoutingOps,
    SetRoute,
    SingleInputJob,
    StoredEvent,
    TaskInput,
    Wakeup,
)
from trace_core.storage.ports.sources import (
    CronState,
    SourceOps,
    SourceRun,
    SourceState,
    SourceStatus,
)
from trace_core.storage.ports.standalone import (
    StandaloneJob,
    StandaloneOps,
)
from trace_core.storage.ports.status import (
    DagDataset,
    OutputVersion,
    StatusOps,
    TaskListing,
)
from trace_core.storage.ports.tasks import (
    RuntimeRoute,
    TaskOps,
)
from trace_core.storage.ports.webhook_delivery import (
    WebhookDeliveryOps,
    WebhookTarget,
)
from trace_core.storage.ports.webhook_receipts import (
    WebhookReceiptOps,
)

__all__ = [
    "ApiKeyOps",
    "ApiKeyRecord",
    "AttemptOps",
    "AttemptRecord",
    "CatalogDag",
    "CatalogDagVersion",
    "CatalogDataset",
    "CatalogDatasetVersion",
    "CatalogJob",
    "CatalogOps",
    "CatalogTask",
    "ClaimedView",
    "ConcurrencyOps",
    "CronState",
    "DagDataset",
    "DagVersionRef",
    "DagVersionRow",
    "DeployOps",
    "DigestMatch",
    "EventDelivery",
    "EventKey",
    "EventOps",
    "ExplainOps",
    "ExplainedJob",
    "FailedAttempt",
    "HandoverOps",
    "HeldLease",
    "HistoryEntry",
    "InboxCredentialOps",
    "InboxJobRecord",
    "InboxOps",
    "InputEvent",
    "JobClaimSettings",
    "JobCredentials",
    "JobOutputs",
    "JobRecord",
    "JobSnapshot",
    "JobStateFlags",
    "JobStateOps",
    "JobStatusRecord",
    "JournalOps",
    "JournalRecord",
    "LaunchOps",
    "LineageOps",
    "LineageRow",
    "LiveVersion",
    "LiveVersionJob",
    "LockedRoute",
    "NewDagVersion",
    "NewDataset",
    "NewDatasetVersion",
    "NewEvent",
    "NewInboxJob",
    "NewJobEvent",
    "NewLineageEdge",
    "OperatorStateKey",
    "OperatorStateOps",
    "OrgRoleRecord",
    "OutputVersion",
    "PayloadOps",
    "PeopleOps",
    "Pointers",
    "ProducerAttempt",
    "ProgressFold",
    "QueuedTasks",
    "ReaperOps",
    "RefreshCount",
    "RegisteredDataset",
    "RegistryOps",
    "RouteOutcome",
    "RoutingOps",
    "RuntimeRoute",
    "ScaleState",
    "SealedCredentials",
    "SetRoute",
    "SingleInputJob",
    "SourceOps",
    "SourceRun",
    "SourceState",
    "SourceStatus",
    "StandaloneJob",
    "StandaloneOps",
    "StartableTask",
    "StatusOps",
    "StoredEvent",
    "StoredEvents",
    "StoredState",
    "TaskInput",
    "TaskListing",
    "TaskOps",
    "TaskOutputs",
    "TimedOutAttempt",
    "Tombstone",
    "UserRecord",
    "VersionPointer",
    "VersionProgress",
    "Wakeup",
    "WebhookDeliveryOps",
    "WebhookReceiptOps",
    "WebhookTarget",
]
