"""Canonical S3 prefixes and the read/write scope of one task attempt.

Credential minting is a privilege boundary (dispatcher spec, "Scope derivation
and canonicalization"): every prefix is normalized here, once, before any
policy is derived from it, and anything ambiguous is rejected rather than
repaired. A canonical prefix is ``s3://bucket/prefix/``: the trailing ``/``
makes it a directory, so ``t1/`` can never grant ``t10/``.

The same path rules check the object keys and list prefixes a local object
store is asked for (:func:`parse_object_uri`), so a key the policy would match
can never resolve outside its prefix on a filesystem.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

from trace_core.errors import InvalidInput

__all__ = ["InvalidScope", "S3Prefix", "Scope", "parse_object_uri"]

_SCHEME = "s3://"
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IPV4_RE = re.compile(r"\d{1,3}(\.\d{1,3}){3}")
# Names AWS reserves for access points, Object Lambda, MRAP, directory and
# table buckets: their ARNs are not arn:aws:s3:::NAME, so a policy for them
# would silently grant nothing (or something else).
_RESERVED_BUCKET_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_RESERVED_BUCKET_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")
_MAX_KEY_BYTES = 1024  # S3's limit on a key; a prefix longer than that grants nothing.
_CANONICAL_MEMO = 4096
"""Canonical prefixes remembered by :meth:`S3Prefix.parse_canonical`."""
_VALUE_ECHO = 120  # characters of the offending value quoted in an error


class InvalidScope(InvalidInput):
    """A prefix or scope violates a canonicalization rule.

    ``field`` names the input (``inputs[2]``, ``output_prefix``) and ``rule``
    is a short stable identifier (``dot-dot``, ``wildcard``, ``bucket-name``)
    that tests and callers can match on; both appear in the message.
    """

    def __init__(self, field: str, rule: str, detail: str, value: object = None) -> None:
        shown = "" if value is None else f"; got {_echo(value)}"
        super().__init__(field, f"{detail} (rule: {rule}{shown})")
        self.rule = rule


def _echo(value: object) -> str:
    # repr() keeps control characters visible and inert in logs.
    text = repr(value)
    return text if len(text) <= _VALUE_ECHO else text[: _VALUE_ECHO - 3] + "..."


def _split_uri(text: object, field: str) -> tuple[str, str]:
    """Check scheme and bucket of ``s3://bucket/rest``; return ``(bucket, rest)``."""
    if not isinstance(text, str):
        raise InvalidScope(field, "type", "must be a string", type(text).__name__)
    if not text.startswith(_SCHEME):
        scheme = text.split("://", 1)[0] if "://" in text else "(none)"
        raise InvalidScope(
            field, "scheme", f"scheme must be 's3' (s3a/s3n/https are not accepted), not {scheme!r}"
        )
    bucket, _, rest = text[len(_SCHEME) :].partition("/")
    _check_bucket(bucket, field)
    return bucket, rest


def _check_bucket(bucket: str, field: str) -> None:
    if not bucket:
        raise InvalidScope(field, "empty-bucket", "bucket must be non-empty")
    if "*" in bucket or "?" in bucket:
        raise InvalidScope(field, "wildcard", "wildcards '*' and '?' are forbidden", bucket)
    if not _BUCKET_RE.fullmatch(bucket):
        raise InvalidScope(
            field,
            "bucket-name",
            "bucket must be 3-63 characters of lowercase letters, digits, '.' and '-', "
            "starting and ending with a letter or digit",
            bucket,
        )
    if ".." in bucket:
        raise InvalidScope(field, "bucket-name", "bucket must not contain '..'", bucket)
    if _IPV4_RE.fullmatch(bucket):
        raise InvalidScope(
            field, "bucket-ip", "bucket must not be formatted as an IP address", bucket
        )
    if bucket.startswith(_RESERVED_BUCKET_PREFIXES) or bucket.endswith(_RESERVED_BUCKET_SUFFIXES):
        raise InvalidScope(
            field, "bucket-reserved", "bucket uses a prefix or suffix AWS reserves", bucket
        )


def _check_path(path: str, field: str, what: str) -> None:
    """Apply the path rules shared by prefixes, object keys and list prefixes.

    ``path`` may end with one ``/``; everything else must be non-empty
    segments. Each rule closes a way for text to mean more than it says.
    """
    for char in path:
        # Category C: controls, format characters (bidi overrides, zero-width),
        # surrogates, private use, unassigned. None belong in a storage path.
        if unicodedata.category(char)[0] == "C":
            raise InvalidScope(
                field, "control-character", f"{what} must not contain control characters", path
            )
    if "*" in path or "?" in path:
        raise InvalidScope(field, "wildcard", "wildcards '*' and '?' are forbidden", path)
    if "\\" in path:
        raise InvalidScope(field, "backslash", f"{what} must not contain '\\'", path)
    if "%" in path:
        # Percent-escapes would let '%2e%2e' or '%2f' turn into '..' or '/' in
        # any layer that decodes; Trace's own prefixes never need '%'.
        raise InvalidScope(
            field, "percent-encoding", f"{what} must not contain '%' (e.g. '%2e%2e')", path
        )
    if "${" in path:
        # IAM substitutes ${...} policy variables inside Resource and
        # Condition values, so the grant would not be the text we wrote.
        raise InvalidScope(
            field, "policy-variable", f"{what} must not contain '${{' (IAM variable)", path
        )
    if unicodedata.normalize("NFKC", path) != path:
        # Fullwidth or leader dots (U+FF0E, U+2024) become '.' under NFKC.
        raise InvalidScope(
            field, "unicode-normalization", f"{what} must be NFKC-normalized text", path
        )
    if ".." in path:
        raise InvalidScope(field, "dot-dot", f"{what} must not contain '..'", path)
    body = path[:-1] if path.endswith("/") else path
    segments = body.split("/")
    if "" in segments:
        raise InvalidScope(
            field,
            "empty-segment",
            f"{what} must not start with '/' or contain empty segments ('a//b')",
            path,
        )
    if "." in segments:
        raise InvalidScope(field, "dot-segment", f"{what} must not contain a '.' segment", path)
    if len(path.encode()) > _MAX_KEY_BYTES:
        raise InvalidScope(
            field, "too-long", f"{what} must be at most {_MAX_KEY_BYTES} bytes of UTF-8"
        )


@dataclass(frozen=True, order=True, slots=True)
class S3Prefix:
    """A canonical, directory-shaped S3 prefix: ``s3://bucket/prefix/``.

    Build it with :meth:`parse`; ``prefix`` always ends with ``/`` and is
    never empty, so it grants exactly the keys below that directory.
    """

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, text: object, *, field: str = "prefix") -> S3Prefix:
        """Normalize ``text`` or raise :class:`InvalidScope` naming ``field`` and the rule.

        The only repair is adding the trailing ``/``: ``s3://b/p`` and
        ``s3://b/p/`` are the same scope. Everything else that is not already
        canonical (wrong scheme, bad bucket, ``..``, ``%``, ``a//b``, ``*``,
        ``?``, backslashes, control characters) is rejected.
        """
        bucket, path = _split_uri(text, field)
        if not path or path == "/":
            raise InvalidScope(
                field, "empty-prefix", "prefix must be non-empty (a whole bucket is never granted)"
            )
        canonical = path if path.endswith("/") else path + "/"
        _check_path(canonical, field, "prefix")
        return cls(bucket, canonical)

    @classmethod
    def parse_canonical(cls, text: object, *, field: str = "prefix") -> S3Prefix:
        """Parse ``text`` and require it to be canonical already (as tokens must encode it)."""
        # A claim's prefixes are parsed when its token is issued, again when the
        # claims are built and when the token is verified: the text is all
        # the outcome depends on, so a prefix found canonical is remembered
        # (the value is immutable; a refusal is never remembered and always
        # names its own field).
        known = _canonical.get(text) if type(text) is str else None
        if known is not None:
            return known
        parsed = cls.parse(text, field=field)
        if parsed.uri != text:
            raise InvalidScope(
                field, "not-canonical", f"prefix must be written as {parsed.uri!r}", text
            )
        if len(_canonical) >= _CANONICAL_MEMO:
            _canonical.clear()
        _canonical[parsed.uri] = parsed
        return parsed

    @property
    def uri(self) -> str:
        """The canonical ``s3://bucket/prefix/`` text."""
        return f"{_SCHEME}{self.bucket}/{self.prefix}"

    def covers(self, other: S3Prefix) -> bool:
        """Whether every key under ``other`` is also under this prefix."""
        return self.bucket == other.bucket and other.prefix.startswith(self.prefix)

    def __str__(self) -> str:
        return self.uri


_canonical: dict[str, S3Prefix] = {}
"""Prefix text found canonical -> its parse (see :meth:`S3Prefix.parse_canonical`)."""


def parse_object_uri(
    text: object, *, field: str = "key", allow_empty: bool = False
) -> tuple[str, str]:
    """Split ``s3://bucket/key`` into ``(bucket, key)`` under the prefix path rules.

    Used for object keys and list prefixes a store is asked for, so a key
    with ``..``, ``a//b``, ``%`` or a backslash is refused before any policy
    is consulted. ``allow_empty`` admits ``s3://bucket/`` (listing a whole
    bucket, which a scope then denies). Raises :class:`InvalidScope`.
    """
    bucket, key = _split_uri(text, field)
    if not key:
        if allow_empty:
            return bucket, key
        raise InvalidScope(field, "empty-key", "key must be non-empty")
    _check_path(key, field, "key")
    return bucket, key


def _minimal(prefixes: Iterable[S3Prefix]) -> tuple[S3Prefix, ...]:
    """Sorted, without duplicates or prefixes inside another (same grant, shorter policy)."""
    kept: list[S3Prefix] = []
    for prefix in sorted(set(prefixes)):
        # Sorting puts a covering prefix before everything under it.
        if not any(outer.covers(prefix) for outer in kept):
            kept.append(prefix)
    return tuple(kept)


@dataclass(frozen=True, slots=True)
class Scope:
    """What one task attempt may read and write: canonical prefixes only.

    Construction normalizes to a canonical form (sorted, deduplicated, with
    prefixes nested inside another dropped), so equal grants compare equal
    and always produce the same policy. Write does not imply read: a prefix
    is readable only if it is in ``read``.
    """

    read: tuple[S3Prefix, ...] = ()
    write: tuple[S3Prefix, ...] = ()

    def __post_init__(self) -> None:
        for name in ("read", "write"):
            values = getattr(self, name)
            if not all(isinstance(p, S3Prefix) for p in values):
                raise InvalidScope(name, "type", "must hold S3Prefix values (use S3Prefix.parse)")
            object.__setattr__(self, name, _minimal(values))
        if not self.read and not self.write:
            raise InvalidScope("scope", "empty-scope", "a scope must grant at least one prefix")

    @classmethod
    def from_capability(
        cls,
        inputs_locations: Iterable[str | S3Prefix],
        output_prefix: str | S3Prefix,
        scratch_prefix: str | S3Prefix,
    ) -> Scope:
        """Derive the scope of a capability: read inputs and scratch, write output and scratch.

        Errors name the field: ``inputs[i]``, ``output_prefix`` or ``scratch_prefix``.
        """
        if isinstance(inputs_locations, str):
            # A lone string would iterate as characters; refuse it clearly.
            raise InvalidScope("inputs", "type", "must be a list of s3:// prefixes")
        inputs = [_coerce(loc, f"inputs[{i}]") for i, loc in enumerate(inputs_locations)]
        output = _coerce(output_prefix, "output_prefix")
        scratch = _coerce(scratch_prefix, "scratch_prefix")
        return cls(read=(*inputs, scratch), write=(output, scratch))

    def as_dict(self) -> dict[str, list[str]]:
        """``{"read": [...], "write": [...]}`` of canonical URIs (token and log form)."""
        return {"read": [p.uri for p in self.read], "write": [p.uri for p in self.write]}

    @classmethod
    def from_dict(cls, data: object, *, field: str = "scope") -> Scope:
        """Inverse of :meth:`as_dict`; every prefix must already be canonical."""
        if not isinstance(data, dict) or set(data) - {"read", "write"}:
            raise InvalidScope(field, "shape", "must be an object with 'read' and 'write' lists")
        parts: dict[str, tuple[S3Prefix, ...]] = {}
        for name in ("read", "write"):
            values = data.get(name, [])
            if not isinstance(values, list):
                raise InvalidScope(f"{field}.{name}", "shape", "must be a list")
            parts[name] = tuple(
                S3Prefix.parse_canonical(v, field=f"{field}.{name}[{i}]")
                for i, v in enumerate(values)
            )
        return cls(read=parts["read"], write=parts["write"])

    def buckets(self) -> tuple[str, ...]:
        """Every bucket the scope touches, sorted."""
        return tuple(sorted({p.bucket for p in (*self.read, *self.write)}))


def _coerce(value: str | S3Prefix, field: str) -> S3Prefix:
    return value if isinstance(value, S3Prefix) else S3Prefix.parse(value, field=field)
