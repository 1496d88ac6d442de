"""People's tokens signed with RS256 (an identity provider's RSA keys).

Real keys (cryptography), real JWKS documents through the real
:class:`JwksCache`, tokens signed by PyJWT as an IdP's library would; a
manual clock. The configuration decides the algorithm, never the token: an
ES256-pinned verifier refuses RS256 and the reverse, a key verifies only its
own algorithm, HS*/none are always refused, and the capability-token
verifier stays ES256-only.
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
from trace_core.security import InvalidCapability, JwksCache, PrivateKeySigner, sign_jws
from trace_core.security.b64url import b64url_decode, b64url_encode
from trace_core.security.jwks_cache import parse_jwks
from trace_core.security.people_tokens import (
    PeopleTokenSettings,
    PeopleTokenVerifier,
    people_jwks_cache,
)
from trace_core.security.verifier import TokenVerifier

pytestmark = pytest.mark.anyio

ISS = "https://idp.example/"
AUD = "trace-api"


def rsa_key(bits: int = 2048) -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=bits)


def rsa_jwk(key: rsa.RSAPrivateKey, kid: str, **members: Any) -> dict[str, Any]:
    """The public JWK an IdP publishes for ``key`` (members override or, as
    ``None``, drop the defaults)."""
    numbers = key.public_key().public_numbers()
    n = numbers.n.to_bytes((numbers.n.bit_length() + 7) // 8, "big")
    e = numbers.e.to_bytes((numbers.e.bit_length() + 7) // 8, "big")
    jwk = {
        "kty": "RSA",
        "use": "sig",
        "alg": "RS256",
        "kid": kid,
        "n": b64url_encode(n),
        "e": b64url_encode(e),
    }
    jwk.update(members)
    return {k: v for k, v in jwk.items() if v is not None}


def _modulus(key: rsa.RSAPrivateKey) -> bytes:
    n = key.public_key().public_numbers().n
    return n.to_bytes((n.bit_length() + 7) // 8, "big")


class Idp:
    """An identity provider publishing an RSA key (and an EC key) in its JWKS."""

    def __init__(self, clock: ManualClock, *extra: dict[str, Any]) -> None:
        self.clock = clock
        self.rsa = rsa_key()
        self.ec = PrivateKeySigner.generate()
        self.keys: list[dict[str, Any]] = [
            rsa_jwk(self.rsa, "rsa-1"),
            self.ec.public_jwk(),
            *extra,
        ]

    async def fetch(self) -> dict[str, Any]:
        return {"keys": self.keys}

    def verifier(self, *algorithms: str) -> PeopleTokenVerifier:
        cache = people_jwks_cache(self.fetch, self.clock, algorithms)
        return PeopleTokenVerifier(
            cache, issuer=ISS, audience=AUD, clock=self.clock, algorithms=algorithms
        )

    def claims(self) -> dict[str, Any]:
        now = int(self.clock.now().timestamp())
        return {"iss": ISS, "aud": AUD, "sub": "alice", "iat": now, "exp": now + 300}

    def rs256(self, key: rsa.RSAPrivateKey | None = None, kid: str = "rsa-1") -> str:
        return jwt.encode(self.claims(), key or self.rsa, algorithm="RS256", headers={"kid": kid})

    async def es256(self, kid: str | None = None) -> str:
        head = {"alg": "ES256", "typ": "JWT", "kid": kid or self.ec.kid}
        return await sign_jws(self.ec, head, self.claims())


async def _refused(verifier: Any, token: str) -> str:
    with pytest.raises(InvalidCapability) as info:
        await verifier.verify(token)
    assert token not in str(info.value)
    return str(info.value.reason)


async def test_an_rs256_token_verifies_against_the_idps_rsa_key(clock: ManualClock) -> None:
    idp = Idp(clock)
    verifier = idp.verifier("RS256")
    assert (await verifier.verify(idp.rs256())).subject == "alice"
    # some providers publish RSA keys without alg (and with a certificate chain)
    bare = rsa_key()
    idp.keys.append(rsa_jwk(bare, "rsa-2", alg=None, use=None, x5c=["MIIB"]))
    assert (await idp.verifier("RS256").verify(idp.rs256(bare, "rsa-2"))).subject == "alice"


async def test_an_rs256_pinned_verifier_refuses_every_other_alg(clock: ManualClock) -> None:
    idp = Idp(clock)
    verifier = idp.verifier("RS256")
    claims = idp.claims()
    # an ES256 token, whether it names the EC key or the RSA key
    assert await _refused(verifier, await idp.es256()) == "unsupported_alg"
    assert await _refused(verifier, await idp.es256("rsa-1")) == "unsupported_alg"
    # HS256 with the IdP's RSA public key (PEM) as the HMAC secret: the classic confusion
    pem = idp.rsa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    hs_token = jwt.PyJWT().encode(claims, pem.hex(), algorithm="HS256", headers={"kid": "rsa-1"})
    assert await _refused(verifier, hs_token) == "unsupported_alg"
    none = (
        b64url_encode(json.dumps({"alg": "none", "kid": "rsa-1"}).encode())
        + "."
        + b64url_encode(json.dumps(claims).encode())
        + "."
    )
    assert await _refused(verifier, none) == "unsupported_alg"
    # RS512 with the right key: another algorithm than the configured one
    rs512 = jwt.encode(claims, idp.rsa, algorithm="RS512", headers={"kid": "rsa-1"})
    assert await _refused(verifier, rs512) == "unsupported_alg"


async def test_an_es256_pinned_verifier_refuses_rs256_even_with_rsa_keys_published(
    clock: ManualClock,
) -> None:
    idp = Idp(clock)
    verifier = idp.verifier("ES256")
    assert (await verifier.verify(await idp.es256())).subject == "alice"
    assert await _refused(verifier, idp.rs256()) == "unsupported_alg"
    # its cache never imported the RSA key
    assert verifier._keys.kids() == {idp.ec.kid}  # type: ignore[attr-defined]


async def test_with_both_configured_a_key_verifies_only_its_own_alg(clock: ManualClock) -> None:
    idp = Idp(clock)
    verifier = idp.verifier("ES256", "RS256")
    assert (await verifier.verify(idp.rs256())).subject == "alice"
    assert (await verifier.verify(await idp.es256())).subject == "alice"
    # the header names the other configured algorithm than its key's
    assert await _refused(verifier, await idp.es256("rsa-1")) == "unsupported_alg"
    forged = jwt.encode(idp.claims(), rsa_key(), algorithm="RS256", headers={"kid": idp.ec.kid})
    assert await _refused(verifier, forged) == "unsupported_alg"
    # another RSA key claiming the published kid; a cut signature; a tampered payload
    assert await _refused(verifier, idp.rs256(rsa_key())) == "bad_signature"
    head, payload, signature = idp.rs256().split(".")
    cut = b64url_encode(b64url_decode(signature)[:-1])
    assert await _refused(verifier, f"{head}.{payload}.{cut}") == "malformed_signature"
    tampered = b64url_encode(json.dumps({**idp.claims(), "sub": "admin"}).encode())
    assert await _refused(verifier, f"{head}.{tampered}.{signature}") == "bad_signature"
    # the time and claim checks are the same for RSA tokens
    clock.advance(300 + 31)
    assert await _refused(verifier, f"{head}.{payload}.{signature}") == "expired"


def test_rsa_jwks_entries_are_imported_strictly() -> None:
    good = rsa_key()
    bad: list[dict[str, Any]] = [
        rsa_jwk(rsa_key(1024), "small"),  # under 2048 bits
        rsa_jwk(good, "enc", use="enc"),
        rsa_jwk(good, "rs512", alg="RS512"),
        rsa_jwk(good, "hs", alg="HS256"),
        rsa_jwk(good, "private", d="AAAA"),
        rsa_jwk(good, ""),
        rsa_jwk(good, "padded-n", n=b64url_encode(b"\0" + _modulus(good))),
        rsa_jwk(good, "even-e", e=b64url_encode((65536).to_bytes(3, "big"))),
        rsa_jwk(good, "no-e", e=None),
        rsa_jwk(good, "number-n", n=12345),
    ]
    document = {"keys": [rsa_jwk(good, "good"), *bad]}
    keys = parse_jwks(document, algorithms=("RS256",))
    assert set(keys) == {"good"}
    assert isinstance(keys["good"], rsa.RSAPublicKey)
    # by default (and for capability tokens) RSA entries are not imported at all
    assert parse_jwks(document) == {}


async def test_the_capability_verifier_stays_es256_only(clock: ManualClock) -> None:
    idp = Idp(clock)
    cache = JwksCache(idp.fetch, clock)  # as the worker side builds it
    verifier = TokenVerifier(cache, issuer=ISS, audience=AUD, clock=clock)
    assert await _refused(verifier, idp.rs256()) == "unsupported_alg"
    assert "rsa-1" not in {kid for kid in await _kids(cache)}
    with pytest.raises(ConfigurationError, match="algorithms"):
        JwksCache(idp.fetch, clock, algorithms=("HS256",))


async def _kids(cache: JwksCache) -> frozenset[str]:
    await cache.refresh()
    return cache.kids()


def test_configuration_accepts_rs256_and_refuses_hs_and_none() -> None:
    clock = ManualClock()

    async def fetch() -> dict[str, Any]:
        return {"keys": []}

    for algorithms in (["RS256"], ["ES256", "RS256"]):
        PeopleTokenVerifier(
            people_jwks_cache(fetch, clock, algorithms),
            issuer=ISS,
            audience=AUD,
            clock=clock,
            algorithms=algorithms,
        )
    for algorithms in (["none"], ["HS256"], ["RS256", "HS512"], ["RS512"], []):
        with pytest.raises(ConfigurationError, match="algorithm"):
            people_jwks_cache(fetch, clock, algorithms)
    # a cache that would drop the RSA keys is caught at configuration time
    with pytest.raises(ConfigurationError, match="people_jwks_cache"):
        PeopleTokenVerifier(
            JwksCache(fetch, clock), issuer=ISS, audience=AUD, clock=clock, algorithms=["RS256"]
        )
    settings = PeopleTokenSettings.from_env(
        {
            "TRACE_PEOPLE_ISSUER": ISS,
            "TRACE_PEOPLE_AUDIENCE": AUD,
            "TRACE_PEOPLE_ALGORITHMS": "RS256, ES256",
        }
    )
    assert settings is not None and settings.algorithms == ("RS256", "ES256")
