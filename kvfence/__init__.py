"""kvfence: multi-tenant, disaggregated, OpenAI-compatible LLM serving. ``from kvfence import LLM, SamplingParams``
runs the engine in this process (``kvfence/llm.py``); they load on first use, so importing kvfence stays light."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfence.llm import LLM, SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvfence import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'kvfence' has no attribute {name!r}")
