"""API keys and the tenants they belong to.

A tenants file maps each tenant to its API keys::

    [tenants.alice]
    api_keys = ["sk-alice-1", "sk-alice-2"]

    [tenants.bob]
    api_keys = ["sk-bob"]

Keys are kept only as SHA-256 digests and looked up by digest, so a lookup's
timing says nothing about how much of a guessed key was right. A key never
appears in an error message or a log line.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path

from kvfence.core import AuthenticationError

OPEN_TENANT = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # tenant names go into log lines: keep them plain


class TenantConfigError(ValueError):
    """The tenants file is malformed; raised at load time, never per request."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """Authenticates an ``Authorization`` header to a tenant name.

    Built with ``from_toml`` (keys required) or ``open`` (one tenant,
    ``default``, that accepts any key or none).
    """

    def __init__(self, keys: Mapping[str, list[str]] | None) -> None:
        """``keys`` maps tenant name to its API keys; ``None`` means open mode."""
        self._open = keys is None
        self.names: tuple[str, ...] = (OPEN_TENANT,) if keys is None else tuple(keys)
        self._by_digest: dict[bytes, str] = {} if keys is None else _index(keys)

    @classmethod
    def open(cls) -> Tenants:
        """No tenants file: a single tenant ``default`` that needs no key."""
        return cls(None)

    @classmethod
    def from_toml(cls, path: str | Path) -> Tenants:
        """Load ``[tenants.NAME] api_keys = [...]``; raises ``TenantConfigError`` on any mistake."""
        try:
            with open(path, "rb") as f:
                return cls(_parse(tomllib.load(f)))
        except tomllib.TOMLDecodeError as e:
            raise TenantConfigError(f"{path}: not valid TOML: {e}") from e
        except TenantConfigError as e:
            raise TenantConfigError(f"{path}: {e}") from None

    @property
    def is_open(self) -> bool:
        return self._open

    def authenticate(self, authorization: str | None) -> str:
        """Return the tenant owning the header's bearer key, or raise ``AuthenticationError`` (401)."""
        if self._open:
            return OPEN_TENANT
        key = bearer_key(authorization)
        if key is None:
            raise AuthenticationError(
                "Missing API key. Send it in an Authorization header using Bearer auth "
                "(i.e. Authorization: Bearer YOUR_KEY)."
            )
        tenant = self._by_digest.get(_digest(key))
        if tenant is None:
            raise AuthenticationError("Incorrect API key provided.")
        return tenant


def bearer_key(authorization: str | None) -> str | None:
    """The key of ``Bearer KEY`` (scheme case-insensitive), or ``None`` when absent or not Bearer."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return key


def _parse(data: dict) -> dict[str, list[str]]:
    """The file's structure: [tenants.NAME] tables holding only api_keys."""
    unknown = set(data) - {"tenants"}
    if unknown:
        raise TenantConfigError(f"unknown top-level keys {sorted(unknown)}; expected only [tenants.NAME] tables")
    tenants = data.get("tenants", {})
    if not isinstance(tenants, dict):
        raise TenantConfigError("'tenants' must be a table of [tenants.NAME] tables")
    parsed = {}
    for name, table in tenants.items():
        if not isinstance(table, dict) or set(table) != {"api_keys"}:
            raise TenantConfigError(f"tenant {name!r}: expected a table [tenants.{name}] with only api_keys")
        parsed[name] = table["api_keys"]
    return parsed


def _check(tenant: str, keys: object) -> None:
    if not _NAME.fullmatch(tenant):
        raise TenantConfigError(f"tenant {tenant!r}: a tenant name must be letters, digits, '_', '.' or '-'")
    if not isinstance(keys, list) or not keys:
        raise TenantConfigError(f"tenant {tenant!r}: api_keys must be a non-empty list of strings")
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not key or any(c.isspace() for c in key):
            raise TenantConfigError(f"tenant {tenant!r}: api_keys[{i}] must be a non-empty string without spaces")


def _index(keys: Mapping[str, list[str]]) -> dict[bytes, str]:
    """Digest -> tenant, after checking names and keys.

    A key listed twice (under one tenant or two) is a load error, never a silent pick.
    """
    if not keys:
        raise TenantConfigError("no tenants defined; expected [tenants.NAME] tables with api_keys")
    index: dict[bytes, str] = {}
    for tenant, tenant_keys in keys.items():
        _check(tenant, tenant_keys)
        for i, key in enumerate(tenant_keys):
            d = _digest(key)
            if d in index:
                raise TenantConfigError(
                    f"api_keys[{i}] of tenant {tenant!r} is already a key of tenant {index[d]!r}; "
                    "each API key must belong to exactly one tenant"
                )
            index[d] = tenant
    return index
