"""The cluster secret: who belongs to a kvfence deployment (torch-free).

One random 32-byte secret, shared by every process of a cluster, is the only
credential. From it each plane derives what it needs (``ClusterKey.derive``):

- **control plane** (ZeroMQ): one CurveZMQ keypair for the whole cluster
  (``curve``). Every inbox is a CURVE server with it, every outbox a CURVE
  client with it, and each inbox admits only clients that prove they hold its
  secret half (``channel.py``). Messages are encrypted.
- **data plane** (tcp): a secret for a mutual challenge-response before any
  byte lands, and for the per-connection keys that encrypt KV crossing hosts
  (``data_plane_secret``, used by ``transfer/tcp.py``).

Every member holds the same secret, so every member is trusted alike: the key
fences the cluster off from everyone else, not members from each other.

The key file (``kvfence cluster-key FILE``) is text, mode 0600::

    # kvfence cluster key ...
    kvfence-cluster-key-v1 <64 hex digits>
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from kvfence import env

ENV = "KVFENCE_CLUSTER_KEY"  # names the key file when --cluster-key is not given
FLAG = "--cluster-key"
KEY_BYTES = 32
HEADER = "kvfence-cluster-key-v1"
_COMMENT = "# kvfence cluster key: copy it to every host of this cluster, keep it secret (mode 0600)\n"


class ClusterKeyError(ValueError):
    """A key file that is missing, unreadable, malformed or readable by others, or a deployment that needs a key."""


@dataclass(frozen=True)
class CurveKeys:
    """The cluster's CurveZMQ keypair, Z85-encoded as ZeroMQ takes it."""

    public: bytes
    secret: bytes = field(repr=False)


@dataclass(frozen=True)
class ClusterKey:
    """A cluster's secret. Picklable (``WorkerSettings`` carries it to spawned workers); never printed."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise ClusterKeyError(f"a cluster key is {KEY_BYTES} bytes, not {len(self.secret)}")

    @classmethod
    def generate(cls) -> ClusterKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    def derive(self, purpose: str) -> bytes:
        """32 bytes for ``purpose`` alone (HMAC-SHA256 of the secret): knowing one reveals neither the secret nor
        any other purpose's."""
        return hmac.new(self.secret, b"kvfence/" + purpose.encode(), hashlib.sha256).digest()

    @cached_property
    def curve(self) -> CurveKeys:
        """The cluster's Curve25519 keypair (any 32 bytes make a secret key; ZeroMQ derives the public one)."""
        import zmq
        from zmq.utils import z85

        secret = z85.encode(self.derive("curve"))
        return CurveKeys(zmq.curve_public(secret), secret)

    @property
    def data_plane_secret(self) -> bytes:
        return self.derive("data-plane")

    @property
    def fingerprint(self) -> str:
        """A short public name for the cluster, for logs: the same on every member, useless to an attacker."""
        return hashlib.sha256(self.derive("fingerprint")).hexdigest()[:12]

    # -- files

    def write(self, path: str | Path, overwrite: bool = False) -> None:
        """Write the key to ``path`` with mode 0600; refuse an existing file unless ``overwrite`` (then the new
        file replaces it atomically)."""
        path = Path(path)
        if path.exists() and not overwrite:
            raise ClusterKeyError(f"{path} exists; remove it or choose another path (a cluster key is never "
                                  "overwritten silently)")
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise ClusterKeyError(f"cannot write {path}: {e.strerror}") from None
        try:
            os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
            os.write(fd, f"{_COMMENT}{HEADER} {self.secret.hex()}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            if overwrite:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)  # fails if the name appeared meanwhile: never clobbers
        except OSError as e:
            raise ClusterKeyError(f"cannot write {path}: {e.strerror}") from None
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> ClusterKey:
        """Read a key file; ``ClusterKeyError`` names the file and the fix if it is missing, unreadable,
        malformed, not a regular file, or readable or writable by anyone but its owner."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOCTTY)
        except OSError as e:
            raise ClusterKeyError(f"cluster key {path}: {e.strerror}; make one with `kvfence cluster-key {path}`") \
                from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ClusterKeyError(f"cluster key {path} is not a regular file")
            if st.st_mode & 0o077:
                raise ClusterKeyError(f"cluster key {path} is accessible by others (mode {st.st_mode & 0o777:04o}); "
                                      f"run `chmod 600 {path}`")
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        return cls(_parse(raw, path))


def _parse(raw: bytes, path: Path) -> bytes:
    lines = [line.strip() for line in raw.decode("ascii", "replace").splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    words = lines[0].split() if len(lines) == 1 else []
    if len(words) != 2 or words[0] != HEADER:
        raise ClusterKeyError(f"cluster key {path} is malformed: expected one line '{HEADER} <hex>' "
                              f"(made by `kvfence cluster-key`)")
    try:
        secret = bytes.fromhex(words[1])
    except ValueError:
        secret = b""
    if len(secret) != KEY_BYTES:
        raise ClusterKeyError(f"cluster key {path} is malformed: the key must be {2 * KEY_BYTES} hex digits")
    return secret


def key_from(path: str | None) -> ClusterKey | None:
    """The key named by ``path`` (``--cluster-key``), else by ``$KVFENCE_CLUSTER_KEY``, else None; an error says
    which of the two named the file."""
    origin = FLAG if path else f"${ENV}"
    path = path or env.cluster_key_file()
    if path is None:
        return None
    try:
        return ClusterKey.load(path)
    except ClusterKeyError as e:
        raise ClusterKeyError(f"{e} (named by {origin})") from None


# -- where a key is required


def is_local(address: str) -> bool:
    """Whether a ZeroMQ address stays on this host: ``ipc://``, ``inproc://``, or tcp on a loopback address."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = tcp_host(address)
    return host is not None and is_loopback(host)


def tcp_host(address: str) -> str | None:
    """The host of a ZeroMQ ``tcp://HOST:PORT`` address (brackets of an IPv6 host removed); None for other kinds."""
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://") :].rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


def is_loopback(host: str) -> bool:
    """A loopback name or address (a wildcard, a name or an interface is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_key_beyond_loopback(key: ClusterKey | None, addresses: dict[str, str | None]) -> None:
    """Raise ``ClusterKeyError`` naming ``--cluster-key`` if any of ``addresses`` (option name -> ZeroMQ address)
    leaves this host while ``key`` is None: without a key anyone who reaches it could join the cluster."""
    if key is not None:
        return
    wide = {name: a for name, a in addresses.items() if a is not None and not is_local(a)}
    if wide:
        shown = ", ".join(f"{name} {a}" for name, a in wide.items())
        raise ClusterKeyError(
            f"{shown} reaches beyond this host, and without {FLAG} any process that reaches it could join the "
            f"cluster and read every prompt. Make a key with `kvfence cluster-key FILE`, copy it to every host, "
            f"and pass {FLAG} FILE (or set {ENV}=FILE); or use loopback addresses (tcp://127.0.0.1:PORT) on one host")


# -- logging refusals


class Throttle:
    """At most one warning per ``every_s`` seconds per kind of event on ``logger``; a line says how many were held
    back since the last one. For refusals: a rogue peer retries forever and must not flood the log."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.log = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.every_s) < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        self.log.warning(message + (f" ({held} more like it since the last such line)" if held else ""), *args)
