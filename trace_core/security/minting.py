"""The credential-minter port and its local (lite profile) implementation.

The Dispatcher exchanges a task's capability for short-lived credentials
limited to the task's :class:`~trace_core.security.scopes.Scope`. In the aws
profile an adapter calls ``sts:AssumeRole`` with
:func:`~trace_core.security.policy.packed_policy`; in the lite profile
:class:`LocalCredentialMinter` issues credentials that the local object store
checks with :meth:`LocalCredentialMinter.check`, which evaluates the very
same session policy with the same evaluator, so both profiles grant exactly
the same requests.

Secrets never reach logs or ``repr()``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from typing import Literal, Protocol

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security.evaluator import PolicyEvaluator
from trace_core.security.policy import (
    LIST_ACTION,
    bucket_arn,
    object_arn,
    packed_policy,
    session_policy,
    validate_duration_seconds,
)
from trace_core.security.scopes import InvalidScope, Scope, parse_object_uri

__all__ = [
    "CredentialMinter",
    "LocalCredentialMinter",
    "MintedCredentials",
    "StoreAction",
    "checked_mint_request",
    "scope_allows",
    "validate_session_name",
    "wire_credentials",
]

_log = logging.getLogger(__name__)

StoreAction = Literal["read", "write", "list"]
# The object action each store operation needs; listing is handled apart
# because it is a bucket action with an s3:prefix condition.
_OBJECT_ACTIONS = {"read": "s3:GetObject", "write": "s3:PutObject"}
# STS RoleSessionName: 2-64 of [A-Za-z0-9_+=,.@-].
_SESSION_NAME_RE = re.compile(r"[\w+=,.@-]{2,64}", re.ASCII)
_TOKEN_VERSION = "tl1"
_MIN_KEY_BYTES = 32


def validate_session_name(session_name: object) -> str:
    """Return ``session_name`` if STS would accept it as a RoleSessionName; else raise."""
    if not isinstance(session_name, str) or not _SESSION_NAME_RE.fullmatch(session_name):
        raise InvalidInput(
            "session_name", "must be 2-64 characters of letters, digits and _+=,.@- (rule: sts)"
        )
    return session_name


def checked_mint_request(
    scope: object, session_name: object, duration_seconds: object
) -> tuple[str, int]:
    """The session policy (:func:`packed_policy`) and the duration in seconds
    of a mint request, once the request is one STS would take: a
    RoleSessionName, a duration within STS's bounds, a :class:`Scope` whose
    policy fits STS's size limit; else raise naming what is wrong. Every
    minter checks the same, so a scope that works in lite works on AWS."""
    validate_session_name(session_name)
    duration = validate_duration_seconds(duration_seconds)
    if not isinstance(scope, Scope):
        raise InvalidScope("scope", "type", "must be a Scope")
    return packed_policy(scope), duration


def wire_credentials(values: object) -> dict[str, str]:
    """The three secret values of credentials in wire form (a task context's
    ``credentials``); :class:`InvalidInput` naming a missing or empty one,
    never quoting a value."""
    if not isinstance(values, Mapping):
        raise InvalidInput("credentials", "must be an object")
    wire: dict[str, str] = {}
    for name in ("access_key_id", "secret_access_key", "session_token"):
        value = values.get(name)
        if not isinstance(value, str) or not value:
            raise InvalidInput(f"credentials.{name}", "is required (a non-empty string)")
        wire[name] = value
    return wire


@dataclass(frozen=True, slots=True, repr=False)
class MintedCredentials:
    """Short-lived credentials limited to ``scope``; ``repr()`` redacts the secrets."""

    access_key_id: str
    secret_access_key: str
    session_token: str
    expiration: datetime
    scope: Scope

    def __repr__(self) -> str:
        # The access key id is an identifier (it appears in CloudTrail), not a secret.
        return (
            f"MintedCredentials(access_key_id={self.access_key_id!r}, "
            f"secret_access_key='<redacted>', session_token='<redacted>', "
            f"expiration={self.expiration.isoformat()!r}, scope={self.scope.as_dict()!r})"
        )


class CredentialMinter(Protocol):
    """Turns a scope into short-lived object-store credentials (STS in production)."""

    async def mint(
        self, scope: Scope, *, session_name: str, duration_seconds: int
    ) -> MintedCredentials:
        """Return credentials that allow exactly :func:`session_policy` of ``scope``.

        Implementations validate ``duration_seconds`` (900..43200) and
        ``session_name`` (STS RoleSessionName) and refuse a scope whose packed
        policy exceeds 2048 characters, all before any request is made. They
        never log the secret access key or the session token.
        """
        ...


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _raw(text: str) -> bytes:
    # surrogatepass: a forged value with a lone surrogate must compare unequal, not raise.
    return text.encode("utf-8", "surrogatepass")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@lru_cache(maxsize=256)
def _evaluator(scope: Scope) -> PolicyEvaluator:
    # Scopes are frozen and canonical, so equal scopes share one parsed policy.
    return PolicyEvaluator(session_policy(scope))


def _check_action(action: object) -> None:
    if action not in ("read", "write", "list"):
        raise InvalidInput("action", f"must be 'read', 'write' or 'list', not {action!r}")


def scope_allows(scope: Scope, action: StoreAction, key_or_prefix: str) -> bool:
    """Whether the session policy of ``scope`` allows ``action`` on ``key_or_prefix``.

    The request as an object store sends it: ``s3://bucket/key`` for
    ``read``/``write``, ``s3://bucket/prefix`` for ``list`` (``s3://bucket/``
    lists the whole bucket and is denied). Keys breaking the canonical path
    rules are denied. Every store checks through here, so a scope grants the
    same requests in the lite store, as a client-side check of the S3 store,
    and (through :func:`session_policy`) in IAM. Raises only for an unknown
    ``action``.
    """
    _check_action(action)
    try:
        bucket, key = parse_object_uri(key_or_prefix, field="key", allow_empty=action == "list")
    except InvalidScope:
        return False
    evaluator = _evaluator(scope)
    if action == "list":
        return evaluator.allows(LIST_ACTION, bucket_arn(bucket), s3_prefix=key or None)
    return evaluator.allows(_OBJECT_ACTIONS[action], object_arn(bucket, key))


class LocalCredentialMinter:
    """Lite-profile minter: HMAC-signed session tokens that a local store can check.

    The session token carries the canonical scope, the access key id and the
    expiry, signed with a key only this minter holds; the secret access key
    is derived from the access key id with that key. :meth:`check` accepts a
    request only if all three values are genuine, the credentials have not
    expired on the injected clock, and the session policy of the token's scope
    allows the request.
    """

    def __init__(self, key: bytes | None = None, *, clock: Clock | None = None) -> None:
        """Use ``key`` (at least 32 bytes; random if omitted) and ``clock`` (system clock)."""
        if key is None:
            key = secrets.token_bytes(_MIN_KEY_BYTES)
        if not isinstance(key, bytes) or len(key) < _MIN_KEY_BYTES:
            raise ConfigurationError(f"LocalCredentialMinter key must be >= {_MIN_KEY_BYTES} bytes")
        # Separate subkeys so a token MAC can never be replayed as a secret.
        self._token_key = hmac.digest(key, b"trace-local-sts/token/v1", hashlib.sha256)
        self._secret_key = hmac.digest(key, b"trace-local-sts/secret/v1", hashlib.sha256)
        self._clock: Clock = clock or SystemClock()

    def __repr__(self) -> str:
        return "LocalCredentialMinter(key='<redacted>')"

    async def mint(
        self, scope: Scope, *, session_name: str, duration_seconds: int
    ) -> MintedCredentials:
        """Issue credentials for ``scope``, valid ``duration_seconds`` from now (see the port)."""
        _, duration = checked_mint_request(scope, session_name, duration_seconds)
        issued = int(self._clock.now().timestamp())
        expires = issued + duration
        access_key_id = "LSIA" + base64.b32encode(secrets.token_bytes(10)).decode("ascii")
        payload = {
            "akid": access_key_id,
            "exp": expires,
            "iat": issued,
            "scope": scope.as_dict(),
            "sn": session_name,
            "v": _TOKEN_VERSION,
        }
        body = _b64(json.dumps(payload, separators=(",", ":"), sort_keys=True).encode())
        token = f"{_TOKEN_VERSION}.{body}.{self._token_mac(body)}"
        expiration = datetime.fromtimestamp(expires, UTC)
        _log.info(
            "minted local credentials access_key_id=%s session=%s expires=%s scope=%s",
            access_key_id,
            session_name,
            expiration.isoformat(),
            scope.as_dict(),
        )
        return MintedCredentials(
            access_key_id=access_key_id,
            secret_access_key=self._secret_for(access_key_id),
            session_token=token,
            expiration=expiration,
            scope=scope,
        )

    def check(
        self, credentials: MintedCredentials, action: StoreAction, key_or_prefix: str
    ) -> bool:
        """Whether ``credentials`` may ``action`` on ``key_or_prefix`` (deny by default).

        ``key_or_prefix`` is ``s3://bucket/key`` for ``read``/``write`` and
        ``s3://bucket/prefix`` for ``list`` (the list request's prefix, as is;
        ``s3://bucket/`` lists the whole bucket and is denied). Keys breaking
        the canonical path rules (``..``, ``a//b``, ``%``, ``\\``) are denied.
        Raises only for an unknown ``action``.
        """
        _check_action(action)
        scope = self._verified_scope(credentials)
        return scope is not None and scope_allows(scope, action, key_or_prefix)

    def restore(self, values: Mapping[str, str]) -> MintedCredentials:
        """Rebuild credentials this minter issued from their wire form
        (``access_key_id``, ``secret_access_key``, ``session_token``,
        ``expiration`` as a ``/v1/task/credentials`` answer has them).

        The session token's MAC is verified (in constant time) before
        anything of its body is parsed: the body of a forged token is never
        read, so no crafted value (a huge number, a deeply nested document)
        can reach the parser. The scope is then read from the authenticated
        body. Forged, tampered, malformed or expired values raise
        :class:`InvalidInput` naming the field (never quoting a secret), and
        nothing else.
        """
        wire = wire_credentials(values)
        token = wire["session_token"]
        body = self._authentic_body(token)
        if body is None:
            raise InvalidInput("credentials.session_token", "forged or tampered with")
        # Authentic from here on; parsed strictly all the same.
        _, expires, scope = _token_claims(body)
        restored = MintedCredentials(
            wire["access_key_id"],
            wire["secret_access_key"],
            token,
            datetime.fromtimestamp(expires, UTC),
            scope,
        )
        if self._verified_scope(restored) is None:
            raise InvalidInput("credentials", "forged, tampered with or expired")
        return restored

    def _authentic_body(self, token: str) -> str | None:
        """The body of ``token`` if its MAC is this minter's (constant-time
        comparison); ``None`` for anything else. Nothing is parsed before."""
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != _TOKEN_VERSION:
            return None
        _, body, mac = parts
        if not body.isascii():
            return None
        if not hmac.compare_digest(self._token_mac(body).encode(), _raw(mac)):
            return None
        return body

    def _token_mac(self, body: str) -> str:
        return _b64(hmac.digest(self._token_key, body.encode("ascii"), hashlib.sha256))

    def _secret_for(self, access_key_id: str) -> str:
        return _b64(hmac.digest(self._secret_key, _raw(access_key_id), hashlib.sha256))

    def _verified_scope(self, credentials: object) -> Scope | None:
        """The token's scope if the credentials are genuine, consistent and unexpired."""
        if not isinstance(credentials, MintedCredentials) or not all(
            isinstance(v, str)
            for v in (
                credentials.session_token,
                credentials.access_key_id,
                credentials.secret_access_key,
            )
        ):
            return None
        body = self._authentic_body(credentials.session_token)
        if body is None:
            return None
        try:
            access_key_id, expires, scope = _token_claims(body)
        except InvalidInput:
            return None
        secret = self._secret_for(access_key_id).encode()
        if not (
            hmac.compare_digest(_raw(access_key_id), _raw(credentials.access_key_id))
            and hmac.compare_digest(secret, _raw(credentials.secret_access_key))
        ):
            return None
        if self._clock.now().timestamp() >= expires:
            return None
        # The scope field of the dataclass is informative; refuse a mismatch
        # rather than letting anyone believe it is what is enforced.
        if credentials.scope != scope:
            return None
        return scope


_MAX_EXPIRY = int(datetime(9999, 12, 31, tzinfo=UTC).timestamp())


def _token_claims(body: str) -> tuple[str, int, Scope]:
    """``(akid, exp, scope)`` of an authenticated token body, parsed strictly.

    Only ever called on a body whose MAC verified; a body this minter did not
    write in this shape (an old version, a changed key schedule) is still
    refused as :class:`InvalidInput`, never an arbitrary exception.
    """
    field = "credentials.session_token"
    try:
        payload = json.loads(_unb64(body))
    except (ValueError, RecursionError):
        raise InvalidInput(field, "is not a session token body") from None
    if not isinstance(payload, dict):
        raise InvalidInput(field, "is not a session token body")
    akid, expires = payload.get("akid"), payload.get("exp")
    if not isinstance(akid, str) or not akid:
        raise InvalidInput(f"{field}.akid", "must be a non-empty string")
    if isinstance(expires, bool) or not isinstance(expires, int):
        raise InvalidInput(f"{field}.exp", "must be an integer")
    if not 0 <= expires <= _MAX_EXPIRY:
        raise InvalidInput(f"{field}.exp", "is out of range")
    try:
        scope = Scope.from_dict(payload.get("scope"))
    except (InvalidScope, ValueError, KeyError, TypeError):
        raise InvalidInput(f"{field}.scope", "is not a scope") from None
    return akid, expires, scope
