"""The bytes of a webhook body: one canonical rendering of the stored event.

``job_outbox_events.payload`` is a JSON document (``JSONB`` on Postgres,
which keeps neither key order nor spacing), so the deliverer does not post
"the text that was inserted" but this rendering of the stored document:
sorted keys, no spaces, UTF-8. It is a function of the stored document
alone, so every attempt of an event, from any deliverer on either engine,
posts the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["CONTENT_TYPE", "webhook_body_bytes"]

CONTENT_TYPE = "application/json"


def webhook_body_bytes(payload: Mapping[str, Any]) -> bytes:
    """The canonical JSON bytes of ``payload``."""
    return json.dumps(
        payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")
