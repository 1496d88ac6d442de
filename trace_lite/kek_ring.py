"""The lite profile's key ring for Euterpe's stored credentials.

Each key-encryption key (KEK) is a 32-byte owner-only file
``<data dir>/keks/<kek_id>.key`` (:func:`~trace_lite.secret_files.read_or_create_secret`
checks its mode, owner and size), wrapped by
:class:`~trace_lite.envelope.LocalKeyEncryption`. :func:`load_credential_vault`
builds the :class:`~trace_core.euterpe.credentials.CredentialVault`: the
active KEK is created on first use; an older id of the compatibility window
must already exist (a fresh key under an old id would open nothing), so a
missing one is a configuration error naming its file.

Rotation: start with a new ``active`` id and the old one in ``accepted``,
run the re-wrap command (:func:`~trace_core.euterpe.credentials.rewrap_credentials`),
then drop the old id from ``accepted`` and, once no blob remains under it,
delete its file.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from trace_core.errors import ConfigurationError
from trace_core.euterpe.credentials import CredentialVault, check_kek_id
from trace_core.security.envelope import KeyEncryption
from trace_lite.envelope import LocalKeyEncryption
from trace_lite.secret_files import read_or_create_secret

__all__ = ["DEFAULT_KEK_ID", "KEK_DIR", "kek_path", "load_credential_vault"]

KEK_DIR = "keks"
DEFAULT_KEK_ID = "kek-1"


def kek_path(data_dir: Path, kek_id: str) -> Path:
    """The file of ``kek_id`` under ``data_dir``."""
    return data_dir / KEK_DIR / f"{check_kek_id(kek_id)}.key"


def load_credential_vault(
    data_dir: Path, *, active: str = DEFAULT_KEK_ID, accepted: Iterable[str] = ()
) -> CredentialVault:
    """The vault over the local KEK files (see the module docstring)."""
    ring: dict[str, KeyEncryption] = {}
    for kek_id in [active, *accepted]:
        path = kek_path(data_dir, kek_id)
        if kek_id != active and not path.exists():
            raise ConfigurationError(
                f"key-encryption key {kek_id!r} ({path}) is in the accepted window but missing"
            )
        ring[kek_id] = LocalKeyEncryption(
            read_or_create_secret(path, f"key-encryption key {kek_id!r}")
        )
    return CredentialVault(ring, active=active, accepted=accepted)
