"""API keys and the tenants they belong to.

A tenants file maps each tenant to its API keys::

    [tenants.alice]
    api_keys = ["sk-alice-1", "sk-alice-2"]

    [tenants.bob]
    api_keys = ["sk-bob"]

    [admin]                    # optional: keys for the /admin API
    api_keys = ["sk-admin-1"]

Keys are kept only as SHA-256 digests and looked up by digest, so a lookup's
timing says nothing about how much of a guessed key was right. A key never
appears in an error message or a log line; an admin key is named in logs by
its digest's first hex digits (``admin-1a2b3c4d``). Admin keys are not
tenants: they cannot generate, and tenant keys cannot administer.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path

from kvfence.core import AuthenticationError, KvfenceError

OPEN_TENANT = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # tenant names go into log lines: keep them plain


class TenantConfigError(ValueError):
    """The tenants file is malformed; raised at load time, never per request."""


class PermissionDenied(KvfenceError):
    """A valid key used where its kind is not allowed: a tenant key on /admin, an admin key on /v1."""

    status = 403
    type = "permission_error"
    code = "permission_denied"


_MISSING_KEY = ("Missing API key. Send it in an Authorization header using Bearer auth "
                "(i.e. Authorization: Bearer YOUR_KEY).")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """Authenticates an ``Authorization`` header to a tenant name, or to an admin.

    Built with ``from_toml`` (keys required) or ``open`` (one tenant,
    ``default``, that accepts any key or none, and no admin).
    """

    def __init__(self, keys: Mapping[str, list[str]] | None, admin_keys: list[str] | None = None) -> None:
        """``keys`` maps tenant name to its API keys (``None``: open mode); ``admin_keys`` may use /admin."""
        self._open = keys is None
        self.names: tuple[str, ...] = (OPEN_TENANT,) if keys is None else tuple(keys)
        self._by_digest: dict[bytes, str] = {} if keys is None else _index(keys)
        self._admins: dict[bytes, str] = _admin_index(admin_keys, self._by_digest)

    @classmethod
    def open(cls) -> Tenants:
        """No tenants file: a single tenant ``default`` that needs no key."""
        return cls(None)

    @classmethod
    def from_toml(cls, path: str | Path) -> Tenants:
        """Load ``[tenants.NAME] api_keys = [...]`` and ``[admin] api_keys = [...]``.

        Raises ``TenantConfigError`` on any mistake.
        """
        try:
            with open(path, "rb") as f:
                return cls(*_parse(tomllib.load(f)))
        except tomllib.TOMLDecodeError as e:
            raise TenantConfigError(f"{path}: not valid TOML: {e}") from e
        except TenantConfigError as e:
            raise TenantConfigError(f"{path}: {e}") from None

    @property
    def is_open(self) -> bool:
        return self._open

    def authenticate(self, authorization: str | None) -> str:
        """Return the tenant owning the header's bearer key.

        Raises ``AuthenticationError`` (401) for a missing or unknown key, ``PermissionDenied`` (403) for an
        admin key.
        """
        if self._open:
            return OPEN_TENANT
        digest = _digest(_required_key(authorization))
        tenant = self._by_digest.get(digest)
        if tenant is not None:
            return tenant
        if digest in self._admins:
            raise PermissionDenied("An admin key cannot be used for generation; use a tenant's API key.")
        raise AuthenticationError("Incorrect API key provided.")

    def authenticate_admin(self, authorization: str | None) -> str:
        """Return the name of the admin owning the header's bearer key (``admin-`` and a digest prefix).

        Raises ``AuthenticationError`` (401) for a missing or unknown key, ``PermissionDenied`` (403) for a
        tenant's key.
        """
        digest = _digest(_required_key(authorization))
        admin = self._admins.get(digest)
        if admin is not None:
            return admin
        if digest in self._by_digest:
            raise PermissionDenied("This API key belongs to a tenant; the admin API needs an admin key.")
        if not self._admins:
            raise AuthenticationError("The admin API is off: the tenants file has no [admin] api_keys.")
        raise AuthenticationError("Incorrect API key provided.")


def _required_key(authorization: str | None) -> str:
    key = bearer_key(authorization)
    if key is None:
        raise AuthenticationError(_MISSING_KEY)
    return key


def bearer_key(authorization: str | None) -> str | None:
    """The key of ``Bearer KEY`` (scheme case-insensitive), or ``None`` when absent or not Bearer."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return key


def _parse(data: dict) -> tuple[dict[str, list[str]], list[str] | None]:
    """The file's structure: [tenants.NAME] tables and an optional [admin] table, each holding only api_keys."""
    unknown = set(data) - {"tenants", "admin"}
    if unknown:
        raise TenantConfigError(f"unknown top-level keys {sorted(unknown)}; expected [tenants.NAME] tables and "
                                "an optional [admin] table")
    tenants = data.get("tenants", {})
    if not isinstance(tenants, dict):
        raise TenantConfigError("'tenants' must be a table of [tenants.NAME] tables")
    parsed = {}
    for name, table in tenants.items():
        if not isinstance(table, dict) or set(table) != {"api_keys"}:
            raise TenantConfigError(f"tenant {name!r}: expected a table [tenants.{name}] with only api_keys")
        parsed[name] = table["api_keys"]
    if "admin" not in data:
        return parsed, None
    admin = data["admin"]
    if not isinstance(admin, dict) or set(admin) != {"api_keys"}:
        raise TenantConfigError("expected an [admin] table with only api_keys")
    return parsed, admin["api_keys"]


def _check(tenant: str, keys: object) -> None:
    if not _NAME.fullmatch(tenant):
        raise TenantConfigError(f"tenant {tenant!r}: a tenant name must be letters, digits, '_', '.' or '-'")
    _check_keys(f"tenant {tenant!r}", keys)


def _check_keys(owner: str, keys: object) -> None:
    if not isinstance(keys, list) or not keys:
        raise TenantConfigError(f"{owner}: api_keys must be a non-empty list of strings")
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not key or any(c.isspace() for c in key):
            raise TenantConfigError(f"{owner}: api_keys[{i}] must be a non-empty string without spaces")


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


def _admin_index(keys: list[str] | None, tenant_index: Mapping[bytes, str]) -> dict[bytes, str]:
    """Digest -> admin name (``admin-`` and 8 hex digits of the digest); no key may also be a tenant's.

    ``None`` means no admin; an empty list is a mistake.
    """
    if keys is None:
        return {}
    _check_keys("[admin]", keys)
    index: dict[bytes, str] = {}
    for i, key in enumerate(keys):
        d = _digest(key)
        if d in tenant_index or d in index:
            owner = f"tenant {tenant_index[d]!r}" if d in tenant_index else "[admin]"
            raise TenantConfigError(f"[admin] api_keys[{i}] is already a key of {owner}; "
                                    "each API key must belong to exactly one tenant or admin")
        index[d] = f"admin-{d.hex()[:8]}"
    return index
