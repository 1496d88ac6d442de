"""Security: capability tokens (ES256 JWT), JWKS and rotation, and credential scoping.

This package imports ``cryptography`` and ``jwt`` (the ``http`` extra);
``import trace_core`` never imports it, so the core stays light.

Issuing side: a :class:`KeyRing` of :class:`Signer` keys (rotated with a
publish lead) feeds a :class:`TokenIssuer`; ``KeyRing.jwks()`` is the
document served at ``GET /internal/jwks/task``. Verifying side: a
:class:`JwksCache` over that endpoint feeds a :class:`TokenVerifier`, which
raises :class:`InvalidCapability` (with a machine-readable ``reason``) for
every refusal. Credential scoping: canonical :class:`S3Prefix` scopes, the
deny-by-default STS :func:`session_policy`, its :class:`PolicyEvaluator`, and
the :class:`CredentialMinter` port with a local implementation.
"""

from typing import TYPE_CHECKING

from trace_core.lazy_exports import attach

if TYPE_CHECKING:
    from trace_core.security.claims import (
        CAPABILITY_FAILURES,
        CapabilityClaims,
        CapabilityFailure,
        DatasetInput,
        InvalidCapability,
        task_subject,
    )
    from trace_core.security.evaluator import PolicyEvaluator, UnsupportedPolicy
    from trace_core.security.jwk import ec_public_jwk, jwk_thumbprint, public_key_from_jwk
    from trace_core.security.jwks import KeyRing, KeySchedule, KeyState, RotationPolicy
    from trace_core.security.jwks_cache import JwksCache, JwksFetch, JwksUnavailable, parse_jwks
    from trace_core.security.minting import (
        CredentialMinter,
        LocalCredentialMinter,
        MintedCredentials,
        validate_session_name,
    )
    from trace_core.security.policy import (
        MAX_DURATION_SECONDS,
        MAX_PACKED_POLICY_CHARS,
        MIN_DURATION_SECONDS,
        PolicyTooLarge,
        packed_policy,
        session_policy,
        validate_duration_seconds,
    )
    from trace_core.security.scopes import InvalidScope, S3Prefix, Scope, parse_object_uri
    from trace_core.security.signing import (
        MalformedSignature,
        PrivateKeySigner,
        Signer,
        check_raw_signature,
        der_to_raw,
        raw_to_der,
    )
    from trace_core.security.tokens import DEFAULT_MAX_TOKEN_BYTES, TokenIssuer, sign_jws
    from trace_core.security.verifier import REQUIRED_CLAIMS, PublicKeySource, TokenVerifier

__all__ = [
    "CAPABILITY_FAILURES",
    "DEFAULT_MAX_TOKEN_BYTES",
    "MAX_DURATION_SECONDS",
    "MAX_PACKED_POLICY_CHARS",
    "MIN_DURATION_SECONDS",
    "REQUIRED_CLAIMS",
    "CapabilityClaims",
    "CapabilityFailure",
    "CredentialMinter",
    "DatasetInput",
    "InvalidCapability",
    "InvalidScope",
    "JwksCache",
    "JwksFetch",
    "JwksUnavailable",
    "KeyRing",
    "KeySchedule",
    "KeyState",
    "LocalCredentialMinter",
    "MalformedSignature",
    "MintedCredentials",
    "PolicyEvaluator",
    "PolicyTooLarge",
    "PrivateKeySigner",
    "PublicKeySource",
    "RotationPolicy",
    "S3Prefix",
    "Scope",
    "Signer",
    "TokenIssuer",
    "TokenVerifier",
    "UnsupportedPolicy",
    "check_raw_signature",
    "der_to_raw",
    "ec_public_jwk",
    "jwk_thumbprint",
    "packed_policy",
    "parse_jwks",
    "parse_object_uri",
    "public_key_from_jwk",
    "raw_to_der",
    "session_policy",
    "sign_jws",
    "task_subject",
    "validate_duration_seconds",
    "validate_session_name",
]

__getattr__, __dir__ = attach(__name__, __file__)
