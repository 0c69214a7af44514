"""The safety layers (docs/safety.md) and their one test switch.

Every layer is on. ``KVFENCE_UNSAFE=tags,coverage`` (or ``all``) turns layers
off, for tests that prove each layer is needed; whoever starts a server with
any layer off announces it loudly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvfence import env

LAYERS = ("preflight", "admission", "propagation", "tags", "coverage", "checksum", "deferred_release",
          "deferred_abort", "shared_write", "prefix_scope")


@dataclass(frozen=True)
class Safety:
    preflight: bool = True  # L0: pool >= context at start
    admission: bool = True  # L1: reject over-length input before any grant
    propagation: bool = True  # L2: an error on either leg reaches the client
    tags: bool = True  # L3: owner/epoch checked on landing and before every decode read
    coverage: bool = True  # L4: tokens written == tokens expected
    checksum: bool = True  # L5: xxh3 per page and per transfer
    deferred_release: bool = True  # L6: no page freed before Done or AbortAck
    deferred_abort: bool = True  # L7: a disconnect mid-transfer waits for the handoff
    shared_write: bool = True  # n > 1: the prompt's partial last page is copied per branch; no write hits a shared page
    prefix_scope: bool = True  # tenant and cache_salt are in every prefix-cache key: no tenant reads another's pages

    @classmethod
    def from_env(cls, value: str | None = None) -> Safety:
        value = env.unsafe() if value is None else value
        names = {n.strip() for n in value.split(",") if n.strip()}
        if "all" in names:
            names = set(LAYERS)
        unknown = names - set(LAYERS)
        if unknown:
            raise ValueError(f"KVFENCE_UNSAFE: unknown layer(s) {sorted(unknown)}; known: {', '.join(LAYERS)}, all")
        return cls(**{n: False for n in names})

    @property
    def disabled(self) -> list[str]:
        return [f.name for f in fields(self) if not getattr(self, f.name)]

    def banner(self) -> str | None:
        if not self.disabled:
            return None
        return ("!" * 72 + f"\n!!! KVFENCE_UNSAFE: safety layers OFF: {', '.join(self.disabled)}\n"
                "!!! Tenants are NOT isolated. Test use only.\n" + "!" * 72)


def layer_of(problem: str) -> str | None:
    """The layer named at the start of a verification problem ("tags: page 3: ..." -> "tags")."""
    head = problem.split(":", 1)[0]
    return head if head in LAYERS else None
