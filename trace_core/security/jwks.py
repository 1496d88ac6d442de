"""The signing key ring: which key signs now, which keys the JWKS publishes.

A key's state is a pure function of its schedule and the clock, so every
replica that holds the same schedules agrees on the signer without talking:

    published ──(published_at + verifier cache)──▶ active ──(retired_at)──▶
    retiring ──(retired_at + max token ttl + leeway + verifier cache)──▶ removed

:meth:`KeyRing.rotate` publishes the new key now and schedules the switch
one verifier-cache lifetime later: at that instant the new key becomes
active and the old one retiring, so exactly one key signs at any time, and
no verifier can meet a kid its cached JWKS has not had the chance to see.
A retiring key stays in the JWKS until the last token it signed has expired,
plus leeway, plus the cache lifetime (SECURITY-NOTES "Capability tokens");
the last term also absorbs a replica whose clock lags ours and signs with
the old key a moment past the switch.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum

from cryptography.hazmat.primitives.asymmetric import ec

from trace_core.clock import Clock
from trace_core.errors import ConfigurationError, NotFound
from trace_core.security.jwk import public_key_from_jwk
from trace_core.security.signing import Signer

__all__ = ["KeyRing", "KeySchedule", "KeyState", "RotationPolicy"]

MAX_LEEWAY_SECONDS = 60.0


class KeyState(StrEnum):
    """Where a key is in its life."""

    PUBLISHED = "published"
    """In the JWKS, not signing yet (verifier caches are catching up)."""
    ACTIVE = "active"
    """The one key that signs new tokens; in the JWKS."""
    RETIRING = "retiring"
    """No longer signs; in the JWKS until every token it signed has expired."""
    REMOVED = "removed"
    """Out of the JWKS; tokens it signed fail with ``unknown_kid``."""


@dataclass(frozen=True)
class RotationPolicy:
    """Timing rules of the key ring.

    ``verifier_cache_seconds`` must be at least the ``max_age_seconds`` of
    every verifier's :class:`~trace_core.security.jwks_cache.JwksCache`,
    ``max_token_ttl_seconds`` at least every issuer's ``ttl_seconds`` (the
    issuer checks), and ``leeway_seconds`` at least every verifier's leeway.
    """

    verifier_cache_seconds: float = 300.0
    max_token_ttl_seconds: float = 3600.0
    leeway_seconds: float = 60.0

    def __post_init__(self) -> None:
        if not self.verifier_cache_seconds > 0:
            raise ConfigurationError("RotationPolicy.verifier_cache_seconds must be > 0")
        if not self.max_token_ttl_seconds > 0:
            raise ConfigurationError("RotationPolicy.max_token_ttl_seconds must be > 0")
        if not 0 <= self.leeway_seconds <= MAX_LEEWAY_SECONDS:
            raise ConfigurationError(
                f"RotationPolicy.leeway_seconds must be within 0..{MAX_LEEWAY_SECONDS:g}"
            )

    @property
    def publish_lead(self) -> timedelta:
        """How long a key is published before it may sign."""
        return timedelta(seconds=self.verifier_cache_seconds)

    @property
    def retention(self) -> timedelta:
        """How long a retired key stays in the JWKS."""
        return timedelta(
            seconds=self.max_token_ttl_seconds + self.leeway_seconds + self.verifier_cache_seconds
        )


@dataclass(frozen=True)
class KeySchedule:
    """The recorded life of one key (what a key store persists).

    ``bootstrap`` marks the first key of a ring, the only one allowed to sign
    from the moment it is published: no verifier can hold a cached JWKS that
    predates every key, and a kid miss makes verifiers refetch.
    """

    kid: str
    published_at: datetime
    activated_at: datetime | None = None
    retired_at: datetime | None = None
    bootstrap: bool = False

    def removed_at(self, policy: RotationPolicy) -> datetime | None:
        """When the key leaves the JWKS, if it is retired."""
        return None if self.retired_at is None else self.retired_at + policy.retention

    def state_at(self, now: datetime, policy: RotationPolicy) -> KeyState:
        """The key's state at ``now``."""
        if self.retired_at is not None and now >= self.retired_at:
            removed_at = self.retired_at + policy.retention
            return KeyState.REMOVED if now >= removed_at else KeyState.RETIRING
        if self.activated_at is not None and now >= self.activated_at:
            return KeyState.ACTIVE
        return KeyState.PUBLISHED


@dataclass(frozen=True)
class _Entry:
    signer: Signer
    schedule: KeySchedule
    jwk: dict[str, str]
    public_key: ec.EllipticCurvePublicKey


class KeyRing:
    """The signing keys of one issuer, their schedules, and the JWKS they give.

    Thread-safe. Also a public-key source for
    :class:`~trace_core.security.verifier.TokenVerifier`, for verifying in the
    process that issues (no JWKS round trip).
    """

    def __init__(self, clock: Clock, policy: RotationPolicy | None = None) -> None:
        self._clock = clock
        self._policy = policy or RotationPolicy()
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    @property
    def policy(self) -> RotationPolicy:
        """The timing rules in force."""
        return self._policy

    def bootstrap(self, signer: Signer) -> KeySchedule:
        """Add the first key of an empty ring, active at once."""
        now = self._clock.now()
        schedule = KeySchedule(signer.kid, published_at=now, activated_at=now, bootstrap=True)
        with self._lock:
            if self._entries:
                raise ConfigurationError("KeyRing.bootstrap needs an empty ring; use rotate()")
            self._install({signer.kid: self._entry(signer, schedule)})
        return schedule

    def rotate(self, signer: Signer) -> KeySchedule:
        """Publish ``signer``'s key now; it replaces the active key after the publish lead.

        Raises :class:`ConfigurationError` when the ring has no active key
        (bootstrap first) or a rotation is already pending.
        """
        now = self._clock.now()
        switch = now + self._policy.publish_lead
        with self._lock:
            states = {
                kid: e.schedule.state_at(now, self._policy) for kid, e in self._entries.items()
            }
            active = [kid for kid, state in states.items() if state is KeyState.ACTIVE]
            if not active:
                raise ConfigurationError("KeyRing.rotate needs an active key; bootstrap first")
            current = self._entries[active[0]]
            if current.schedule.retired_at is not None:
                raise ConfigurationError(
                    f"a rotation is already pending until {current.schedule.retired_at.isoformat()}"
                )
            new = KeySchedule(signer.kid, published_at=now, activated_at=switch)
            entries = dict(self._entries)
            entries[current.schedule.kid] = replace(
                current, schedule=replace(current.schedule, retired_at=switch)
            )
            entries[signer.kid] = self._entry(signer, new)
            self._install(entries)
        return new

    def restore(self, keys: Iterable[tuple[Signer, KeySchedule]]) -> None:
        """Add or update keys with schedules recorded earlier (a key store loading state).

        All of ``keys`` are applied at once (a kid already in the ring gets
        the new schedule) and the resulting ring is checked as a whole: the
        publish lead honoured by every non-bootstrap key, at most one
        bootstrap key, active periods that never overlap. A violation
        raises :class:`ConfigurationError` and leaves the ring unchanged.
        """
        with self._lock:
            entries = dict(self._entries)
            for signer, schedule in keys:
                entries[schedule.kid] = self._entry(signer, schedule)
            self._install(entries)

    def schedules(self) -> list[KeySchedule]:
        """Every key's schedule, oldest published first (including removed keys)."""
        with self._lock:
            return sorted((e.schedule for e in self._entries.values()), key=_published_order)

    def state(self, kid: str) -> KeyState:
        """The state of key ``kid`` now; :class:`NotFound` if the ring never had it."""
        with self._lock:
            entry = self._entries.get(kid)
        if entry is None:
            raise NotFound(f"no key {kid!r} in the key ring")
        return entry.schedule.state_at(self._clock.now(), self._policy)

    def active_signer(self) -> Signer:
        """The signer of the key that is active now."""
        now = self._clock.now()
        with self._lock:
            for entry in self._entries.values():
                if entry.schedule.state_at(now, self._policy) is KeyState.ACTIVE:
                    return entry.signer
        raise ConfigurationError("the key ring has no active signing key")

    def jwks(self) -> dict[str, list[dict[str, str]]]:
        """The JWKS document ``{"keys": [...]}``: published, active and retiring keys."""
        now = self._clock.now()
        with self._lock:
            listed = [
                e
                for e in self._entries.values()
                if e.schedule.state_at(now, self._policy) is not KeyState.REMOVED
            ]
        listed.sort(key=lambda e: _published_order(e.schedule))
        return {"keys": [dict(e.jwk) for e in listed]}

    async def public_key(self, kid: str) -> ec.EllipticCurvePublicKey | None:
        """The public key of ``kid`` if the JWKS lists it now, else ``None``."""
        now = self._clock.now()
        with self._lock:
            entry = self._entries.get(kid)
        if entry is None or entry.schedule.state_at(now, self._policy) is KeyState.REMOVED:
            return None
        return entry.public_key

    def prune(self) -> list[str]:
        """Forget removed keys; return their kids (a key store deletes their files)."""
        now = self._clock.now()
        with self._lock:
            gone = [
                kid
                for kid, e in self._entries.items()
                if e.schedule.state_at(now, self._policy) is KeyState.REMOVED
            ]
            for kid in gone:
                del self._entries[kid]
        return gone

    def _entry(self, signer: Signer, schedule: KeySchedule) -> _Entry:
        if schedule.kid != signer.kid:
            raise ConfigurationError(
                f"schedule kid {schedule.kid!r} does not match signer kid {signer.kid!r}"
            )
        jwk = dict(signer.public_jwk())
        if jwk.get("kid") != signer.kid:
            raise ConfigurationError(f"signer {signer.kid!r} publishes a JWK with another kid")
        try:
            public_key = public_key_from_jwk(jwk)
        except ValueError as exc:
            raise ConfigurationError(f"signer {signer.kid!r} publishes a bad JWK: {exc}") from exc
        return _Entry(signer, schedule, jwk, public_key)

    def _install(self, entries: dict[str, _Entry]) -> None:
        """Validate the whole ring, then swap it in (caller holds the lock)."""
        _validate([e.schedule for e in entries.values()], self._policy)
        self._entries = entries


def _published_order(schedule: KeySchedule) -> tuple[datetime, str]:
    return (schedule.published_at, schedule.kid)


def _validate(schedules: list[KeySchedule], policy: RotationPolicy) -> None:
    if sum(s.bootstrap for s in schedules) > 1:
        raise ConfigurationError("a key ring has at most one bootstrap key")
    for s in schedules:
        if s.published_at.tzinfo is None:
            raise ConfigurationError(f"key {s.kid!r}: timestamps must be timezone-aware")
        if s.activated_at is not None:
            earliest = s.published_at if s.bootstrap else s.published_at + policy.publish_lead
            if s.activated_at < earliest:
                raise ConfigurationError(
                    f"key {s.kid!r} would sign before it was published for "
                    f"{policy.verifier_cache_seconds:g}s (the verifier cache lifetime)"
                )
        if s.retired_at is not None and (s.activated_at is None or s.retired_at < s.activated_at):
            raise ConfigurationError(f"key {s.kid!r} is retired before it was activated")
    activated = sorted(
        (s for s in schedules if s.activated_at is not None),
        key=lambda s: (s.activated_at, s.kid),
    )
    for earlier, later in itertools.pairwise(activated):
        assert later.activated_at is not None  # sorted from the activated ones
        if earlier.retired_at is None or earlier.retired_at > later.activated_at:
            raise ConfigurationError(
                f"keys {earlier.kid!r} and {later.kid!r} would both be active at once"
            )
