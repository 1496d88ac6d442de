"""The STS :class:`~trace_core.security.minting.CredentialMinter`: ``AssumeRole``
with the task's deny-by-default session policy.

The Dispatcher (``/v1/task/credentials``) exchanges a capability token for
credentials limited to the token's :class:`~trace_core.security.scopes.Scope`.
This minter sends exactly :func:`~trace_core.security.policy.packed_policy`
of that scope as the session ``Policy``: the effective permissions are the
intersection of the role's own policies and that document, so the role may be
broad (the bucket) while each session is confined to its task's prefixes.
The session name (``task-<task id>-<attempt>``, chosen by the caller) shows
up in CloudTrail next to every request the task makes.

Everything STS would refuse (duration outside 900..43200, a bad session name,
a policy over 2048 characters) is refused here before any request, because
moto accepts all of them. AWS failures become
:class:`~trace_aws.errors.AwsUnavailable` (retryable) or
:class:`~trace_aws.errors.AwsRequestFailed`; the secret access key and the
session token never reach a message, a log or a ``repr()``.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from trace_aws.errors import AwsRequestFailed, aws_error
from trace_core.errors import ConfigurationError
from trace_core.security.minting import MintedCredentials, checked_mint_request
from trace_core.security.scopes import Scope

if TYPE_CHECKING:
    from mypy_boto3_sts import STSClient

__all__ = ["StsCredentialMinter"]

_log = logging.getLogger(__name__)
_OPERATION = "sts:AssumeRole"


class StsCredentialMinter:
    """Mints task credentials with ``sts:AssumeRole`` on one role (see the module doc).

    The minter's own identity (the Dispatcher's task role) needs
    ``sts:AssumeRole`` on ``role_arn``; the role's trust policy must name that
    identity, and its ``MaxSessionDuration`` must cover the longest duration
    asked for (1 hour when the Dispatcher itself runs on an assumed role: STS
    caps chained sessions at 1 hour).
    """

    def __init__(
        self,
        role_arn: str,
        *,
        region: str,
        endpoint_url: str | None = None,
        external_id: str | None = None,
        client: STSClient | None = None,
    ) -> None:
        """Assume ``role_arn`` through one STS client in ``region``.

        ``endpoint_url`` overrides the endpoint (a moto server, LocalStack, a
        VPC endpoint); ``external_id`` is passed when the role's trust policy
        requires one; ``client`` replaces the client built here (tests).
        """
        if not isinstance(role_arn, str) or not role_arn.startswith("arn:"):
            raise ConfigurationError(
                "role_arn: must be an IAM role ARN (arn:aws:iam::...:role/...)"
            )
        if not isinstance(region, str) or not region:
            raise ConfigurationError("region: is required (an AWS region such as us-east-1)")
        self.role_arn = role_arn
        self._external_id = external_id
        # Regional endpoint (not the global one), so minting keeps working in
        # a region where the global endpoint is unreachable; standard retry
        # mode backs off on throttling before we give up.
        self._client: STSClient = client or boto3.client(
            "sts",
            region_name=region,
            endpoint_url=endpoint_url,
            config=Config(retries={"mode": "standard", "max_attempts": 3}),
        )

    def __repr__(self) -> str:
        return f"StsCredentialMinter(role_arn={self.role_arn!r})"

    @property
    def client(self) -> STSClient:
        """The STS client (thread-safe; shared by every mint)."""
        return self._client

    async def mint(
        self, scope: Scope, *, session_name: str, duration_seconds: int
    ) -> MintedCredentials:
        """``AssumeRole`` with the session policy of ``scope`` (see the port)."""
        policy, duration = checked_mint_request(scope, session_name, duration_seconds)
        params: dict[str, Any] = {
            "RoleArn": self.role_arn,
            "RoleSessionName": session_name,
            "Policy": policy,
            "DurationSeconds": duration,
        }
        if self._external_id is not None:
            params["ExternalId"] = self._external_id
        # boto3 blocks: keep it off the event loop.
        response = await anyio.to_thread.run_sync(self._assume_role, params)
        credentials = response.get("Credentials")
        if not isinstance(credentials, dict):
            raise AwsRequestFailed(_OPERATION, "MissingCredentials")
        minted = MintedCredentials(
            access_key_id=credentials["AccessKeyId"],
            secret_access_key=credentials["SecretAccessKey"],
            session_token=credentials["SessionToken"],
            expiration=_utc(credentials["Expiration"]),
            scope=scope,
        )
        _log.info(
            "minted STS credentials access_key_id=%s session=%s expires=%s scope=%s",
            minted.access_key_id,
            session_name,
            minted.expiration.isoformat(),
            scope.as_dict(),
        )
        return minted

    def _assume_role(self, params: dict[str, Any]) -> Any:
        try:
            return self._client.assume_role(**params)
        except (ClientError, BotoCoreError) as exc:
            raise aws_error(_OPERATION, exc) from None


def _utc(value: datetime) -> datetime:
    # botocore parses Expiration as an aware datetime; a stub may not.
    aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    return aware.astimezone(UTC)
