"""Membership for the ``tcp`` data plane: a mutual challenge-response, and sealed records for KV crossing hosts.

With the cluster's data-plane secret (``ClusterKey.data_plane_secret``) the
hello becomes (after the initiator's ``b"KVFM" + target id + nonce_i``)::

    target    -> b"KVFC" + nonce_t (16) + sealed (1) + HMAC(auth, "target"    | transcript)
    initiator ->                              HMAC(auth, "initiator" | transcript)
    target    -> b"KVOK"
    transcript = target id + nonce_i + nonce_t + sealed

Each side proves it holds the secret before the other goes on: the target
reads no batch (so lands no byte) from an initiator that has not, and the
initiator sends no KV to a target that has not. Fresh nonces on both sides
make a recorded exchange worthless, and the role labels stop a reflected one.

``sealed`` (the target's choice, authenticated by the transcript) encrypts
everything after the hello with AES-256-GCM under a key of this connection
alone (``HMAC(seal, transcript)``), as records of at most ``RECORD`` bytes
with one nonce counter per direction. A record is decrypted into scratch
memory and copied into the region only once its tag verified, so a tampered
record lands nothing and fails the write.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

MEMBER_HELLO = struct.Struct("<4s16s16s")  # b"KVFM", target id, initiator nonce
CHALLENGE = struct.Struct("<4s16sB32s")  # b"KVFC", target nonce, sealed, target's proof
PROOF_BYTES = 32
TAG = 16  # AES-GCM tag per record
RECORD = 1 << 20  # most plaintext bytes per sealed record
_TO_TARGET, _TO_INITIATOR = b"I>T\0", b"T>I\0"  # nonce prefixes: each direction counts on its own


class Refused(ConnectionError):
    """A peer failed the hello or a record's tag: not a member of this cluster, or tampered with."""


class MemberKeys:
    """What one side derives from the data-plane secret: the proof key and the root of the sealing keys."""

    def __init__(self, secret: bytes) -> None:
        self.auth = _mac(secret, b"tcp auth")
        self.seal = _mac(secret, b"tcp seal")

    def proof(self, role: bytes, transcript: bytes) -> bytes:
        return _mac(self.auth, role + b"|" + transcript)

    def check(self, role: bytes, transcript: bytes, proof: bytes) -> None:
        """Raise ``Refused`` unless ``proof`` is ``role``'s for ``transcript`` (compared in constant time)."""
        if not hmac.compare_digest(proof, self.proof(role, transcript)):
            raise Refused(f"the {role.decode()} does not hold this cluster's key")

    def session(self, transcript: bytes, initiator: bool) -> Seal:
        return Seal(_mac(self.seal, transcript), initiator)


def transcript(target_id: bytes, nonce_i: bytes, nonce_t: bytes, sealed: bool) -> bytes:
    return target_id + nonce_i + nonce_t + bytes([sealed])


def nonce() -> bytes:
    return os.urandom(16)


class Seal:
    """AES-256-GCM over one connection (needs the ``cryptography`` package): ``seal``/``seal_into`` what this side
    sends, ``open``/``open_into`` what it receives, each direction with its own counter so that no nonce repeats
    under the key. ``open*`` raise ``Refused`` for a record that fails its tag."""

    def __init__(self, key: bytes, initiator: bool) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.aead = AESGCM(key)
        self._out, self._in = (_TO_TARGET, _TO_INITIATOR) if initiator else (_TO_INITIATOR, _TO_TARGET)
        self._sent = self._received = 0

    def seal(self, data: bytes) -> bytes:
        return self.aead.encrypt(self._next_out(), data, None)

    def seal_into(self, data: memoryview, out: memoryview) -> None:
        """Encrypt ``data`` into ``out`` (exactly ``len(data) + TAG`` bytes)."""
        self.aead.encrypt_into(self._next_out(), data, None, out)

    def open(self, record: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        try:
            return self.aead.decrypt(self._next_in(), record, None)
        except InvalidTag:
            raise Refused("a sealed record failed its tag") from None

    def open_into(self, record: memoryview, out: memoryview) -> None:
        """Decrypt ``record`` into ``out`` (exactly ``len(record) - TAG`` bytes), checking its tag: ``out`` must be
        scratch memory, copied where it belongs only once this returned (a failed tag may leave bytes in it)."""
        from cryptography.exceptions import InvalidTag

        try:
            self.aead.decrypt_into(self._next_in(), record, None, out)
        except InvalidTag:
            raise Refused("a sealed record failed its tag") from None

    def _next_out(self) -> bytes:
        self._sent += 1
        return self._out + self._sent.to_bytes(8, "little")

    def _next_in(self) -> bytes:
        self._received += 1
        return self._in + self._received.to_bytes(8, "little")


def _mac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()
