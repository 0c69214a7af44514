"""API keys and the tenants they belong to.

A tenants file maps each tenant to its API keys::

    [tenants.alice]
    api_keys = ["sk-alice-1", "sk-alice-2"]

    [tenants.bob]
    api_keys = ["sk-bob"]
    weight = 2                     # optional quotas (protocol/capacity.py); default: weight 1, no limits
    max_concurrent_requests = 16   # requests on the workers at once; the rest wait in bob's queue
    max_queued = 64                # requests waiting at once; one more gets 429
    tokens_per_minute = 200000     # prompt + completion tokens; beyond, 429 with Retry-After

    [admin]                    # optional: keys for the /admin API, /health's detail and /metrics
    api_keys = ["sk-admin-1"]

    [metrics]                  # optional: keys that may only scrape /metrics
    api_keys = ["sk-prometheus"]

Keys are kept only as SHA-256 digests and looked up by digest, so a lookup's
timing says nothing about how much of a guessed key was right. A key never
appears in an error message or a log line; an admin or metrics key is named in
logs by its digest's first hex digits (``admin-1a2b3c4d``). Each key has one
kind: admin keys are not tenants (they cannot generate), tenant keys cannot
administer, and metrics keys can do nothing else. Every refusal says why in
``reason`` (``missing_key``, ``unknown_key``, ``wrong_key_kind``), for the
count of failed logins.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from kvfence.core import AuthenticationError, KvfenceError
from kvfence.protocol.capacity import TenantQuota

OPEN_TENANT = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # tenant names go into log lines: keep them plain
Kind = Literal["tenant", "admin", "metrics"]
_SECTIONS: tuple[Kind, ...] = ("admin", "metrics")  # optional tables beside [tenants.NAME]
_QUOTA_KEYS = ("weight", "max_concurrent_requests", "max_queued", "tokens_per_minute")
MAX_WEIGHT = 1e6  # weights are relative; beyond this a typo is likelier than a need


class TenantConfigError(ValueError):
    """The tenants file is malformed; raised at load time, never per request."""


class MissingKey(AuthenticationError):
    reason = "missing_key"


class UnknownKey(AuthenticationError):
    reason = "unknown_key"


class PermissionDenied(KvfenceError):
    """A valid key used where its kind is not allowed: a tenant key on /admin, an admin key on /v1."""

    status = 403
    type = "permission_error"
    code = "permission_denied"
    reason = "wrong_key_kind"


_MISSING_KEY = ("Missing API key. Send it in an Authorization header using Bearer auth "
                "(i.e. Authorization: Bearer YOUR_KEY).")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """Authenticates an ``Authorization`` header to a tenant name, an admin, or a metrics reader.

    Built with ``from_toml`` (keys required) or ``open`` (one tenant, ``default``, that accepts any key or none,
    and no admin).
    """

    def __init__(self, keys: Mapping[str, list[str]] | None, admin_keys: list[str] | None = None,
                 metrics_keys: list[str] | None = None, quotas: Mapping[str, TenantQuota] | None = None) -> None:
        """``keys`` maps tenant name to its API keys (``None``: open mode); ``admin_keys`` may use /admin,
        ``metrics_keys`` may only read /metrics; ``quotas`` holds the tenants whose file sets any."""
        self._open = keys is None
        self.quotas: dict[str, TenantQuota] = dict(quotas or {})
        self.names: tuple[str, ...] = (OPEN_TENANT,) if keys is None else tuple(keys)
        self._by_digest: dict[bytes, tuple[Kind, str]] = {} if keys is None else _index(keys)
        sections: tuple[tuple[Kind, list[str] | None], ...] = (("admin", admin_keys), ("metrics", metrics_keys))
        for kind, section_keys in sections:
            _add_section(self._by_digest, kind, section_keys)

    @classmethod
    def open(cls) -> Tenants:
        """No tenants file: a single tenant ``default`` that needs no key."""
        return cls(None)

    @classmethod
    def from_toml(cls, path: str | Path) -> Tenants:
        """Load ``[tenants.NAME] api_keys = [...]`` (and optional quotas) and the optional ``[admin]`` and
        ``[metrics]`` tables.

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

    @property
    def has_admins(self) -> bool:
        return any(kind == "admin" for kind, _ in self._by_digest.values())

    def authenticate(self, authorization: str | None) -> str:
        """Return the tenant owning the header's bearer key.

        Raises ``MissingKey`` or ``UnknownKey`` (401), ``PermissionDenied`` (403) for a key of another kind.
        """
        if self._open:
            return OPEN_TENANT
        return self.authenticate_as(authorization, "tenant")

    def authenticate_admin(self, authorization: str | None) -> str:
        """Return the name of the admin owning the header's bearer key (``admin-`` and a digest prefix).

        Raises ``MissingKey`` or ``UnknownKey`` (401), ``PermissionDenied`` (403) for a key of another kind.
        """
        try:
            return self.authenticate_as(authorization, "admin")
        except UnknownKey:
            if self.has_admins:
                raise
            raise UnknownKey("The admin API is off: the tenants file has no [admin] api_keys.") from None

    def authenticate_metrics(self, authorization: str | None) -> str:
        """The admin or metrics reader owning the header's key; errors as ``authenticate_admin``."""
        kind, name = self.identify(authorization)
        if kind == "tenant":
            raise PermissionDenied("This API key belongs to a tenant; /metrics needs an admin or metrics key.")
        return name

    def authenticate_as(self, authorization: str | None, wanted: Kind) -> str:
        """The name owning the header's key, which must be of kind ``wanted``."""
        kind, name = self.identify(authorization)
        if kind != wanted:
            raise PermissionDenied(_wrong_kind_message(kind, wanted))
        return name

    def identify(self, authorization: str | None) -> tuple[Kind, str]:
        """(kind, name) of the header's bearer key; ``MissingKey`` or ``UnknownKey`` (401) otherwise."""
        found = self._by_digest.get(_digest(_required_key(authorization)))
        if found is None:
            raise UnknownKey("Incorrect API key provided.")
        return found


def _wrong_kind_message(kind: Kind, wanted: Kind) -> str:
    article = "An" if kind == "admin" else "A"
    if wanted == "tenant":
        return f"{article} {kind} key cannot be used for generation; use a tenant's API key."
    if kind == "tenant":
        return "This API key belongs to a tenant; the admin API needs an admin key."
    return f"This is a {kind} key; the admin API needs an admin key."


def _required_key(authorization: str | None) -> str:
    key = bearer_key(authorization)
    if key is None:
        raise MissingKey(_MISSING_KEY)
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


def _parse(data: dict) -> tuple[dict[str, list[str]], list[str] | None, list[str] | None, dict[str, TenantQuota]]:
    """The file's structure: [tenants.NAME] tables (api_keys and optional quotas) and optional [admin] and
    [metrics] tables holding only api_keys. Returns (tenant keys, admin keys, metrics keys, quotas)."""
    unknown = set(data) - {"tenants", *_SECTIONS}
    if unknown:
        raise TenantConfigError(f"unknown top-level keys {sorted(unknown)}; expected [tenants.NAME] tables and "
                                "optional [admin] and [metrics] tables")
    tenants = data.get("tenants", {})
    if not isinstance(tenants, dict):
        raise TenantConfigError("'tenants' must be a table of [tenants.NAME] tables")
    parsed, quotas = {}, {}
    for name, table in tenants.items():
        if not isinstance(table, dict):
            raise TenantConfigError(f"tenant {name!r}: expected a table [tenants.{name}] with api_keys")
        unknown = set(table) - {"api_keys", *_QUOTA_KEYS}
        if unknown:
            raise TenantConfigError(f"tenant {name!r}: unknown keys {sorted(unknown)}; a tenant's table holds "
                                    f"api_keys and optionally {', '.join(_QUOTA_KEYS)}")
        if "api_keys" not in table:
            raise TenantConfigError(f"tenant {name!r}: expected a table [tenants.{name}] with api_keys")
        parsed[name] = table["api_keys"]
        if set(table) != {"api_keys"}:
            quotas[name] = _quota(name, table)
    return parsed, _section(data, "admin"), _section(data, "metrics"), quotas


def _quota(tenant: str, table: dict) -> TenantQuota:
    """A tenant's quotas: ``weight`` a positive number, the limits positive integers."""
    weight = table.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= MAX_WEIGHT:
        raise TenantConfigError(f"tenant {tenant!r}: weight must be a number above 0 and at most {MAX_WEIGHT:g}, "
                                f"not {weight!r}")
    limits = {}
    for key in _QUOTA_KEYS[1:]:
        value = table.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TenantConfigError(f"tenant {tenant!r}: {key} must be a whole number of at least 1, not {value!r}")
        limits[key] = value
    return TenantQuota(float(weight), **limits)


def _section(data: dict, kind: Kind) -> list[str] | None:
    if kind not in data:
        return None
    table = data[kind]
    if not isinstance(table, dict) or set(table) != {"api_keys"}:
        raise TenantConfigError(f"expected an [{kind}] table with only api_keys")
    return table["api_keys"]


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


def _index(keys: Mapping[str, list[str]]) -> dict[bytes, tuple[Kind, str]]:
    """Digest -> ("tenant", tenant), after checking names and keys.

    A key listed twice (under one tenant or two) is a load error, never a silent pick.
    """
    if not keys:
        raise TenantConfigError("no tenants defined; expected [tenants.NAME] tables with api_keys")
    index: dict[bytes, tuple[Kind, str]] = {}
    for tenant, tenant_keys in keys.items():
        _check(tenant, tenant_keys)
        for i, key in enumerate(tenant_keys):
            d = _digest(key)
            if d in index:
                raise TenantConfigError(
                    f"api_keys[{i}] of tenant {tenant!r} is already a key of tenant {index[d][1]!r}; "
                    "each API key must belong to exactly one tenant"
                )
            index[d] = ("tenant", tenant)
    return index


def _add_section(index: dict[bytes, tuple[Kind, str]], kind: Kind, keys: list[str] | None) -> None:
    """Add ``[kind]`` keys to ``index``, each named ``kind-`` and 8 hex digits of its digest; no key may already
    be another's. ``None`` means no such section; an empty list is a mistake."""
    if keys is None:
        return
    _check_keys(f"[{kind}]", keys)
    for i, key in enumerate(keys):
        d = _digest(key)
        if d in index:
            owner_kind, owner = index[d]
            owner = f"tenant {owner!r}" if owner_kind == "tenant" else f"[{owner_kind}]"
            raise TenantConfigError(f"[{kind}] api_keys[{i}] is already a key of {owner}; "
                                    "each API key must belong to exactly one tenant, admin or metrics reader")
        index[d] = (kind, f"{kind}-{d.hex()[:8]}")
