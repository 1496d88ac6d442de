"""The body of ``POST /transcode`` (euterpe-contract.md §6, §7, §9).

:class:`TranscodeRequest` is validated strictly: unknown fields, wrong types,
unknown presets, over-long values and malformed URLs are refused, and
:func:`parse_transcode_request` turns the first problem into an
:class:`~trace_core.errors.InvalidInput` whose ``field`` names it
(``storage_credentials.secret_access_key``, ``presets[1]``) and whose reason
never quotes a submitted value. Object locations use Trace's canonical
``s3://bucket/key`` form (:mod:`trace_core.security.scopes`), so the worker's
scoped credentials (read the source, write under the output prefix) are
checked by the same rules as everywhere else.

**Webhook and refresh URLs (SSRF stance).** Euterpe's deliverer and worker
call these URLs from inside the deployment, so a URL must not be a way to
reach what only the deployment can reach. :class:`UrlPolicy` decides:
``http``/``https`` only, no user info, a host; an operator may restrict
hosts to an allow-list (``hooks.example.com``, ``*.example.com``); IP
literals and names in loopback (``localhost``) are refused unless
``allow_loopback``, private ranges unless ``allow_private``, and link-local
(cloud metadata at 169.254.169.254), multicast, reserved and unspecified
addresses always. A name's DNS answer can change after validation, so the
caller that connects checks the resolved address again with
:meth:`UrlPolicy.address_allowed`.

**The request hash (§9).** :func:`request_hash` is ``sha256`` over method,
route and the canonical JSON of the request *without* its storage
credentials. Credentials are short-lived: a client that retries after
minting fresh ones is retrying the same transcode and must get the same job,
not a conflict (the first credentials stay with the job; newer ones go
through the credential refresh). Leaving them out also keeps any digest of a
secret out of ``idempotency_keys``. :meth:`TranscodeRequest.job_request` is
the same credential-free document, stored as ``inbox_jobs.request``.
"""

from __future__ import annotations

import ipaddress
import socket
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any
from urllib.parse import urlsplit

import anyio
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
)

from trace_core.errors import InvalidInput
from trace_core.euterpe.credentials import StorageCredentials
from trace_core.euterpe.presets import get_preset
from trace_core.idempotency import request_fingerprint
from trace_core.security.scopes import S3Prefix, parse_object_uri

__all__ = [
    "MAX_PRESETS",
    "MAX_URL_LENGTH",
    "TRANSCODE_ROUTE",
    "CredentialsBody",
    "TranscodeRequest",
    "UrlPolicy",
    "parse_transcode_request",
    "request_hash",
]

TRANSCODE_ROUTE = "/transcode"
MAX_PRESETS = 8
"""Presets one request may ask for (each is one ffmpeg run of the same source)."""
MAX_URL_LENGTH = 2048
_MAX_LOCATION = 1100  # s3:// + a 63-character bucket + a 1024-byte key
_MAX_ACCESS_KEY_ID = 128
_MAX_SECRET = 512
_MAX_SESSION_TOKEN = 8192


def _plain_text(value: str) -> str:
    """Refuse control characters (NUL included) and lone surrogates."""
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in value):
        raise ValueError("must not contain control characters or lone surrogates")
    return value


def _secret(limit: int) -> AfterValidator:
    """A non-empty secret of at most ``limit`` characters of plain text."""

    def check(value: SecretStr) -> SecretStr:
        text = value.get_secret_value()
        if not 1 <= len(text) <= limit:
            raise ValueError(f"must be 1..{limit} characters")
        _plain_text(text)
        return value

    return AfterValidator(check)


def _without_value(exc: InvalidInput) -> str:
    """The reason of a scope rule without the quoted value (nothing submitted is echoed)."""
    head, _, _ = exc.reason.partition("; got ")
    return head if head.endswith(")") else head + ")"


def _source(value: str) -> str:
    try:
        bucket, key = parse_object_uri(value, field="source")
    except InvalidInput as exc:
        raise ValueError(_without_value(exc)) from None
    return f"s3://{bucket}/{key}"


def _output_prefix(value: str) -> str:
    try:
        return S3Prefix.parse(value, field="output_prefix").uri
    except InvalidInput as exc:
        raise ValueError(_without_value(exc)) from None


def _preset(value: str) -> str:
    try:
        return get_preset(value).name
    except InvalidInput as exc:
        raise ValueError(exc.reason) from None


def _unique(values: list[str]) -> list[str]:
    if len(set(values)) != len(values):
        raise ValueError("must not name a preset twice")
    return values


def _url_shape(value: str) -> str:
    """The syntax part of the URL rules; :class:`UrlPolicy` adds the host rules."""
    _plain_text(value)
    if any(ch.isspace() for ch in value):
        raise ValueError("must not contain whitespace")
    try:
        parts = urlsplit(value)
        _ = parts.port  # read for its check: a malformed port raises here
    except ValueError:
        raise ValueError("must be an absolute http or https URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an absolute http or https URL")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry user info (user:password@)")
    if parts.fragment:
        raise ValueError("must not have a fragment")
    return value


Text = Annotated[str, AfterValidator(_plain_text)]
Url = Annotated[str, Field(max_length=MAX_URL_LENGTH), AfterValidator(_url_shape)]


class CredentialsBody(BaseModel):
    """``storage_credentials``: scoped object-store credentials (§7: read the
    source, write under the output prefix). Secrets are :class:`SecretStr`,
    so no ``repr()`` or log line of the model shows them."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    access_key_id: Annotated[Text, Field(min_length=1, max_length=_MAX_ACCESS_KEY_ID)]
    secret_access_key: Annotated[SecretStr, _secret(_MAX_SECRET)]
    session_token: Annotated[SecretStr, _secret(_MAX_SESSION_TOKEN)] | None = None
    expiration: Annotated[AwareDatetime | None, Field(strict=False)] = None
    """When the credentials expire (ISO 8601 with a time zone), if they do."""

    def to_credentials(self) -> StorageCredentials:
        """The neutral value the vault seals."""
        return StorageCredentials(
            self.access_key_id,
            self.secret_access_key.get_secret_value(),
            self.session_token.get_secret_value() if self.session_token else None,
            self.expiration,
        )


class TranscodeRequest(BaseModel):
    """The body of ``POST /transcode``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    source: Annotated[Text, Field(min_length=1, max_length=_MAX_LOCATION), AfterValidator(_source)]
    """The source object, ``s3://bucket/key`` in the requester's store."""
    output_prefix: Annotated[
        Text, Field(min_length=1, max_length=_MAX_LOCATION), AfterValidator(_output_prefix)
    ]
    """Where outputs go, ``s3://bucket/prefix/`` (normalized to end with ``/``)."""
    presets: Annotated[
        list[Annotated[str, Field(max_length=64), AfterValidator(_preset)]],
        Field(min_length=1, max_length=MAX_PRESETS),
        AfterValidator(_unique),
    ]
    """Names from :data:`~trace_core.euterpe.presets.PRESETS`; one output each."""
    status_webhook_url: Url | None = None
    """Where signed status events are posted; none: the requester polls."""
    refresh_url: Url | None = None
    """Called (signed) when the object store refuses the credentials (§7)."""
    storage_credentials: CredentialsBody

    def job_request(self) -> dict[str, Any]:
        """The request without its credentials: what is hashed and stored."""
        return self.model_dump(mode="json", exclude={"storage_credentials"})


def request_hash(request: TranscodeRequest) -> str:
    """The idempotency hash of ``request`` (module docstring: credentials excluded)."""
    return request_fingerprint("POST", TRANSCODE_ROUTE, request.job_request())


_ALWAYS_REFUSED = ("is_link_local", "is_multicast", "is_reserved", "is_unspecified")


@dataclass(frozen=True)
class UrlPolicy:
    """Which hosts webhook and refresh URLs may name (module docstring)."""

    allowed_hosts: frozenset[str] | None = None
    """Exact host names or ``*.suffix`` patterns; None: any host not refused below."""
    allow_loopback: bool = False
    """Admit ``localhost`` and loopback addresses (development, tests)."""
    allow_private: bool = False
    """Admit private-range addresses (a webhook receiver inside the same network)."""
    _patterns: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if self.allowed_hosts is not None:
            patterns = tuple(h.lower().rstrip(".") for h in self.allowed_hosts)
            object.__setattr__(self, "_patterns", patterns)

    def check(self, url: str | None, field: str) -> None:
        """Nothing if ``url`` (already of the right shape) may be called;
        :class:`InvalidInput` naming ``field`` otherwise."""
        if url is None:
            return
        host = (urlsplit(url).hostname or "").rstrip(".")
        if self.allowed_hosts is not None and not any(
            host == p or (p.startswith("*.") and host.endswith(p[1:])) for p in self._patterns
        ):
            raise InvalidInput(field, "host is not in the allowed webhook hosts")
        if host == "localhost" or host.endswith(".localhost"):
            if not self.allow_loopback:
                raise InvalidInput(field, "loopback hosts are not allowed")
            return
        address = _ip_literal(host)
        if address is None:
            return  # a name: its resolved address is checked when connecting
        if not self.address_allowed(address):
            raise InvalidInput(field, "the host's address range is not allowed")

    async def refusal_when_connecting(self, url: str, field: str) -> str | None:
        """Why ``url`` must not be called now, or None: :meth:`check` again (the
        policy may have changed since intake), then every address its host
        resolves to now must be allowed (a name that resolved to a public
        address at intake may point inward later). For callers about to connect:
        the refresh call and the webhook deliverer."""
        parts = urlsplit(url)
        try:
            self.check(url, field)
        except InvalidInput as exc:
            return str(exc)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            answers = await anyio.getaddrinfo(parts.hostname or "", port)
        except (OSError, ValueError):
            return f"the {field} host does not resolve"
        for *_, sockaddr in answers:
            address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if not self.address_allowed(address):
                return f"the {field} host resolves to an address that is not allowed"
        return None

    def address_allowed(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        """Whether a connection to ``address`` (a resolved host) is allowed."""
        mapped = getattr(address, "ipv4_mapped", None)
        if mapped is not None:
            address = mapped
        if address.is_loopback:
            return self.allow_loopback
        if any(getattr(address, flag) for flag in _ALWAYS_REFUSED):
            return False
        if address.is_private or not address.is_global:
            return self.allow_private
        return True


def _ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` spells, including the legacy IPv4 forms resolvers
    still accept (``2130706433``, ``127.1``, ``0x7f.0.0.1``: all 127.0.0.1);
    None for a host name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _field_path(loc: Sequence[int | str]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not (part.startswith("function-") or part in ("json-or-python[json=...]",)):
            path += f".{part}" if path else part
    return path or "body"


def parse_transcode_request(
    body: bytes | str | Mapping[str, Any], *, policy: UrlPolicy
) -> TranscodeRequest:
    """``body`` (raw JSON or a parsed object) as a :class:`TranscodeRequest`
    whose URLs ``policy`` allows; the first problem as :class:`InvalidInput`."""
    try:
        if isinstance(body, (bytes, str)):
            request = TranscodeRequest.model_validate_json(body)
        else:
            request = TranscodeRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False, include_context=False)[0]
        reason = str(first["msg"]).removeprefix("Value error, ")
        raise InvalidInput(_field_path(first["loc"]), reason) from None
    policy.check(request.status_webhook_url, "status_webhook_url")
    policy.check(request.refresh_url, "refresh_url")
    return request
