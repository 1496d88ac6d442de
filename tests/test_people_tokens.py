"""People's tokens: the IdP verifier's refusals by reason, and the local issuer round trip.

Keys come from a real :class:`KeyRing` through the real :class:`JwksCache`
(with an in-process fetch); times from a manual clock.
"""

from __future__ import annotations

import json
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError
from trace_core.security import InvalidCapability, JwksCache, KeyRing, PrivateKeySigner, sign_jws
from trace_core.security.b64url import b64url_decode, b64url_encode
from trace_core.security.people_tokens import (
    PeopleTokenSettings,
    PeopleTokenVerifier,
    PersonClaims,
)
from trace_lite.people_keys import LOCAL_AUDIENCE, LOCAL_ISSUER, issue_person_token

pytestmark = pytest.mark.anyio

ISS = "https://idp.example/"
AUD = "trace-api"


class Issuer:
    """An IdP: one ES256 key in a ring, and a verifier reading its JWKS through the cache."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.ring = KeyRing(clock)
        self.signer = PrivateKeySigner.generate()
        self.ring.bootstrap(self.signer)

        async def fetch() -> dict[str, Any]:
            return self.ring.jwks()

        self.cache = JwksCache(fetch, clock)
        self.verifier = PeopleTokenVerifier(self.cache, issuer=ISS, audience=AUD, clock=clock)

    def claims(self, **changes: Any) -> dict[str, Any]:
        now = int(self.clock.now().timestamp())
        base: dict[str, Any] = {
            "iss": ISS,
            "aud": AUD,
            "sub": "alice",
            "iat": now,
            "exp": now + 300,
        }
        base.update(changes)
        return {k: v for k, v in base.items() if v is not None}

    async def token(self, header: dict[str, Any] | None = None, **changes: Any) -> str:
        head = {"alg": "ES256", "typ": "JWT", "kid": self.signer.kid, **(header or {})}
        return await sign_jws(self.signer, head, self.claims(**changes))


async def _refused(verifier: PeopleTokenVerifier, token: str) -> str:
    with pytest.raises(InvalidCapability) as info:
        await verifier.verify(token)
    assert token not in str(info.value)
    return info.value.reason


async def test_a_good_token_names_its_subject(clock: ManualClock) -> None:
    idp = Issuer(clock)
    claims = await idp.verifier.verify(await idp.token())
    assert isinstance(claims, PersonClaims)
    assert (claims.subject, claims.issuer) == ("alice", ISS)
    # an IdP's access token (RFC 9068 typ) without nbf/jti is fine too
    assert (await idp.verifier.verify(await idp.token({"typ": "at+jwt"}))).subject == "alice"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"iss": "https://evil.example/"}, "wrong_issuer"),
        ({"aud": "another-api"}, "wrong_audience"),
        ({"sub": None}, "missing_claim"),
        ({"exp": None}, "missing_claim"),
        ({"sub": ""}, "invalid_claim"),
        ({"exp": "soon"}, "invalid_claim"),
    ],
)
async def test_claim_refusals(clock: ManualClock, changes: dict[str, Any], reason: str) -> None:
    idp = Issuer(clock)
    assert await _refused(idp.verifier, await idp.token(**changes)) == reason


async def test_time_refusals_with_bounded_leeway(clock: ManualClock) -> None:
    idp = Issuer(clock)
    expired = await idp.token()
    soon = await idp.token(nbf=int(clock.now().timestamp()) + 120)
    future_iat = await idp.token(iat=int(clock.now().timestamp()) + 120)
    assert await _refused(idp.verifier, soon) == "not_yet_valid"
    assert await _refused(idp.verifier, future_iat) == "not_yet_valid"
    clock.advance(300 + 29)
    assert (await idp.verifier.verify(expired)).subject == "alice"  # within the 30 s leeway
    clock.advance(2)
    assert await _refused(idp.verifier, expired) == "expired"


async def test_unknown_kid_and_tampered_payload(clock: ManualClock) -> None:
    idp = Issuer(clock)
    other = PrivateKeySigner.generate()
    unknown = await sign_jws(other, {"alg": "ES256", "typ": "JWT", "kid": other.kid}, idp.claims())
    assert await _refused(idp.verifier, unknown) == "unknown_kid"
    fetches = idp.cache.fetches
    for _ in range(20):  # a flood of unknown kids costs no more fetches within the interval
        assert await _refused(idp.verifier, unknown) == "unknown_kid"
    assert idp.cache.fetches == fetches
    # another key claiming the published kid
    spoofed = await sign_jws(
        other, {"alg": "ES256", "typ": "JWT", "kid": idp.signer.kid}, idp.claims()
    )
    assert await _refused(idp.verifier, spoofed) == "bad_signature"
    head, _, sig = (await idp.token()).split(".")
    tampered = b64url_encode(json.dumps(idp.claims(sub="admin")).encode())
    assert await _refused(idp.verifier, f"{head}.{tampered}.{sig}") == "bad_signature"


async def test_alg_games(clock: ManualClock) -> None:
    idp = Issuer(clock)
    claims = idp.claims()
    kid = idp.signer.kid
    none = (
        b64url_encode(json.dumps({"alg": "none", "typ": "JWT", "kid": kid}).encode())
        + "."
        + b64url_encode(json.dumps(claims).encode())
        + "."
    )
    assert await _refused(idp.verifier, none) == "unsupported_alg"
    # HS256 with the issuer's public key (PEM) as the HMAC secret
    pem = idp.signer.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    hs = jwt.PyJWT()
    hs_token = hs.encode(claims, pem.hex(), algorithm="HS256", headers={"kid": kid})
    assert await _refused(idp.verifier, hs_token) == "unsupported_alg"
    # RS256 where ES256 is pinned (RS vs ES confusion)
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rs_token = jwt.encode(claims, rsa_key, algorithm="RS256", headers={"kid": kid})
    assert await _refused(idp.verifier, rs_token) == "unsupported_alg"
    # ES256 header over a signature of the wrong shape
    head, payload, _ = (await idp.token()).split(".")
    assert (
        await _refused(idp.verifier, f"{head}.{payload}.{b64url_encode(bytes(64))}")
        == "malformed_signature"
    )
    crit = await idp.token({"crit": ["b64"]})
    assert await _refused(idp.verifier, crit) == "unknown_crit"
    embedded = await idp.token({"jwk": {"kty": "EC"}})
    assert await _refused(idp.verifier, embedded) == "bad_header"
    duplicated = (await idp.token()).split(".")
    dup_payload = b64url_encode(b'{"sub":"alice","sub":"admin"}')
    assert await _refused(idp.verifier, f"{duplicated[0]}.{dup_payload}.{duplicated[2]}") == (
        "malformed"
    )
    assert b64url_decode(duplicated[0])  # the header stayed strict JSON


def test_configuration_pins_algorithms_and_needs_an_audience() -> None:
    clock = ManualClock()
    ring = KeyRing(clock)
    for algorithms in (["none"], ["HS256"], ["RS512"], []):
        with pytest.raises(ConfigurationError, match="algorithm"):
            PeopleTokenVerifier(ring, issuer=ISS, audience=AUD, clock=clock, algorithms=algorithms)
    with pytest.raises(ConfigurationError, match="audience"):
        PeopleTokenVerifier(ring, issuer=ISS, audience="", clock=clock)
    with pytest.raises(ConfigurationError, match="leeway"):
        PeopleTokenVerifier(ring, issuer=ISS, audience=AUD, clock=clock, leeway_seconds=600)
    with pytest.raises(ConfigurationError, match="TRACE_PEOPLE_AUDIENCE"):
        PeopleTokenSettings.from_env({"TRACE_PEOPLE_ISSUER": ISS})
    settings = PeopleTokenSettings.from_env(
        {"TRACE_PEOPLE_ISSUER": ISS, "TRACE_PEOPLE_AUDIENCE": AUD}
    )
    assert settings is not None
    assert settings.effective_jwks_url == "https://idp.example/.well-known/jwks.json"
    assert PeopleTokenSettings.from_env({}) is None


async def test_local_issuer_round_trip_and_ttl_bounds(clock: ManualClock) -> None:
    ring = KeyRing(clock)
    ring.bootstrap(PrivateKeySigner.generate())
    verifier = PeopleTokenVerifier(ring, issuer=LOCAL_ISSUER, audience=LOCAL_AUDIENCE, clock=clock)
    token = await issue_person_token(ring, "alice", clock, ttl_seconds=60)
    assert (await verifier.verify(token)).subject == "alice"
    clock.advance(60 + 31)
    assert await _refused(verifier, token) == "expired"
    for ttl in (0, 3601):
        with pytest.raises(ConfigurationError, match="--ttl"):
            await issue_person_token(ring, "alice", clock, ttl_seconds=ttl)


async def test_an_unreachable_jwks_is_retryable_not_a_refusal(clock: ManualClock) -> None:
    idp = Issuer(clock)
    token = await idp.token()

    async def down() -> dict[str, Any]:
        raise OSError("connection refused")

    verifier = PeopleTokenVerifier(JwksCache(down, clock), issuer=ISS, audience=AUD, clock=clock)
    assert await _refused(verifier, token) == "jwks_unavailable"
