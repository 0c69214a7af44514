"""``kvfence verify``: an exhaustive, breadth-first model check of the transfer protocol.

It drives the production protocol cores (``kvfence/protocol``) through every interleaving of a small
configuration under an adversarial environment, and checks the invariants of docs/protocol.md in every
state. ``world.py`` is the checked world, ``invariants.py`` the state checks, ``explorer.py`` the search,
``cli.py`` the command. ``cache.py`` checks the prefix cache's page bookkeeping the same way, over the
production ``PageTable``, ``PrefixCache`` and ``Scheduler`` (``kvfence verify --cache``). docs/protocol.md
describes what is and is not covered.
"""

from kvfence.verify.cache import CacheConfig, CacheRequest, CacheResult, explore_cache
from kvfence.verify.explorer import Result, explore
from kvfence.verify.world import CheckConfig, Faults, RequestSpec, World

__all__ = ["CacheConfig", "CacheRequest", "CacheResult", "CheckConfig", "Faults", "RequestSpec", "Result", "World",
           "explore", "explore_cache"]
