"""L0 preflight (docs/safety.md): every node's KV pool must hold one request of the full context it serves.

The incident in docs/safety.md began with a prefill pool of 681,280 tokens serving a context of 1,048,576.

- ``usable_pool_tokens`` and ``pool_tokens_for_memory``: what a worker really allocates. A pool holds whole
  pages only, and in memory each page is its K/V bytes plus its tag record (``kvcache/layout.py``).
- ``preflight``: the check every engine runs when it is built (colocated, prefill, decode, ``LLM``); it raises
  ``PreflightError``. ``refuse_to_start_unless_fits``: the same check on the command line, before a model loads.
- ``kvfence audit`` (``tools/audit.py``) runs it over whole deployments.
"""

from __future__ import annotations

import sys

from kvfence.config import ModelConfig
from kvfence.core import KvfenceError
from kvfence.kvcache.layout import KVLayout
from kvfence.safety import Safety

ROLE_POOL_FLAGS = {"prefill": "--prefill-pool-tokens", "decode": "--decode-pool-tokens"}


def usable_pool_tokens(pool_tokens: int, page_size: int) -> int:
    """Tokens a pool configured for ``pool_tokens`` really holds: ``pool_tokens // page_size`` whole pages."""
    return pool_tokens // page_size * page_size


def pool_tokens_for_memory(nbytes: int, cfg: ModelConfig, page_size: int, dtype_bytes: int) -> int:
    """Usable tokens of the largest pool whose region fits in ``nbytes``.

    A region of n pages takes ``KVLayout.nbytes``: per page, ``page_size * cfg.kv_bytes_per_token(dtype_bytes)``
    bytes of K/V plus one ``TAG_BYTES`` tag record.
    """
    per_page = KVLayout.of(cfg, 1, page_size, dtype_bytes).nbytes
    return nbytes // per_page * page_size


class PreflightError(KvfenceError):
    """A node's KV pool cannot hold one request of the full context (L0); the node must not start."""

    layer = "preflight"

    def __init__(self, role: str, pool_tokens: int, max_context: int, page_size: int = 1) -> None:
        self.role, self.pool_tokens, self.max_context = role, pool_tokens, max_context
        super().__init__(f"L0 preflight: the {role} KV pool holds {pool_tokens} tokens, fewer than the context of "
                         f"{max_context} tokens, so a request of the full context cannot fit. Fix: "
                         f"{fix_for(role, pool_tokens, max_context, page_size)}.")


def fix_for(role: str, pool_tokens: int, max_context: int, page_size: int = 1) -> str:
    """How to make a ``role`` pool of ``pool_tokens`` hold ``max_context``: the flags, with the numbers."""
    need = -(-max_context // page_size) * page_size
    return (f"raise {ROLE_POOL_FLAGS.get(role, '--kv-pool-tokens')} to at least {need} "
            f"or lower --max-context to at most {pool_tokens}")


def preflight(role: str, usable_pool_tokens: int, max_context: int, *, page_size: int = 1) -> None:
    """Raise ``PreflightError`` unless a ``role`` node's pool of ``usable_pool_tokens`` (whole pages, see
    ``usable_pool_tokens``) holds ``max_context`` tokens. ``page_size`` only rounds the fix it suggests."""
    if usable_pool_tokens < max_context:
        raise PreflightError(role, usable_pool_tokens, max_context, page_size)


def refuse_to_start_unless_fits(role: str, pool_tokens: int, page_size: int, max_context: int) -> None:
    """L0 at start: exit with status 2 and the fix when a ``role`` node's pool cannot hold ``max_context``.

    With ``KVFENCE_UNSAFE=preflight`` the node starts anyway and only warns.
    """
    try:
        preflight(role, usable_pool_tokens(pool_tokens, page_size), max_context, page_size=page_size)
    except PreflightError as err:
        if Safety.from_env().preflight:
            print(f"kvfence: {err.message}", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"kvfence: WARNING (preflight off): {err.message}", file=sys.stderr)
