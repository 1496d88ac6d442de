"""People: authentication of persons and management of users, org roles and visibility.

Sits beside the dispatcher in the layers (it uses the dataset registry of
``dag`` and the token verifier of ``security``); the API's people router
(:mod:`trace_core.api.people`) and the lite CLI are its callers.
"""

from trace_core.people.access import (
    Caller,
    NotAllowed,
    Permission,
    PlatformRole,
    UnknownPerson,
    allows,
)
from trace_core.people.service import PeopleService, check_slug, parse_role

__all__ = [
    "Caller",
    "NotAllowed",
    "PeopleService",
    "Permission",
    "PlatformRole",
    "UnknownPerson",
    "allows",
    "check_slug",
    "parse_role",
]
