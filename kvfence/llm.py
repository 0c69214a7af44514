"""``LLM``: the colocated engine in this process, as vLLM's offline API has it::

    from kvfence import LLM, SamplingParams

    llm = LLM("smollm2-135m")
    for out in llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8)):
        print(out.outputs[0].text)

The same engine, safety layers and batch invariance as ``kvfence serve --mode colocated``: a prompt's greedy
tokens do not depend on the other prompts of the call. The L0 preflight runs when the engine is built (a pool
too small for the context raises ``ValueError``) and L1 admission for each prompt (``ContextLengthExceeded``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfence import core
from kvfence.config import EngineConfig, default_pool_tokens
from kvfence.core import MAX_CHOICES, FinishReason, KvfenceError

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from Python 3.13

Prompt = str | list[int]
Chat = list[dict[str, str]]


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's defaults: 16 tokens at temperature 1. ``temperature=0`` is greedy; ``top_k`` 0 or -1 is off.
    ``core.SamplingParams`` says how the penalties, bias and bans shape the logits, and where logprobs come from,
    and how ``n`` choices (1..16) share one prefill."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def for_engine(self) -> core.SamplingParams:
        if (not 1 <= self.n <= MAX_CHOICES or self.max_tokens < 1 or self.temperature < 0
                or not 0 < self.top_p <= 1 or self.top_k < -1
                or not 0 <= self.min_p <= 1 or not 0 <= self.min_tokens <= self.max_tokens
                or self.repetition_penalty <= 0 or min(self.logprobs or 0, self.prompt_logprobs or 0) < 0):
            raise ValueError(f"invalid sampling parameters: {self}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return core.SamplingParams(
            self.max_tokens, self.temperature, self.top_p, max(self.top_k, 0), self.seed, stop, self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=tuple(sorted((self.logit_bias or {}).items())),
            min_tokens=self.min_tokens, min_p=self.min_p, stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs, n=self.n)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[core.TokenLogprob] | None = None  # one per token, when ``SamplingParams.logprobs`` is set


@dataclass
class RequestOutput:
    """One prompt's result, shaped like vLLM's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[core.TokenLogprob] | None = None  # prompt tokens 2..n, with SamplingParams.prompt_logprobs
    finished: bool = True


class LLM:
    """A model and its engine in this process. Not thread-safe: one call at a time."""

    def __init__(self, model: str = "smollm2-135m", *, dtype: str = "bfloat16", device: str = "cpu",
                 max_model_len: int | None = None, kv_pool_tokens: int | None = None, max_batch: int = 64,
                 page_size: int = 16, chunk_size: int = 512, enable_prefix_caching: bool = True) -> None:
        import torch

        from kvfence.engine.engine import Engine
        from kvfence.model import kernels
        from kvfence.model.loader import load_model
        from kvfence.preflight import PreflightError

        torch_dtype = getattr(torch, dtype)
        self.loaded = load_model(model, dtype=torch_dtype, device=device)
        self.tokenizer = self.loaded.tokenizer
        limit = self.loaded.config.max_context
        max_context = max_model_len or limit
        if not 0 < max_context <= limit:
            raise ValueError(f"max_model_len {max_context} must be between 1 and the model's context ({limit})")
        pool = kv_pool_tokens or default_pool_tokens(max_context, "colocated")
        config = EngineConfig(max_context=max_context, kv_pool_tokens=pool, page_size=page_size,
                              max_batch=max_batch, chunk_size=chunk_size, step_tokens=chunk_size,
                              prefix_caching=enable_prefix_caching)
        try:
            self.engine = Engine(self.loaded.model, self.tokenizer, config, torch_dtype, device)
        except PreflightError as err:  # L0, run by the engine
            raise ValueError(err.message) from None
        kernels.release_thread_pool()  # generate() may run in another thread than this one

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Complete each prompt (text, or token ids); results in the prompts' order."""
        params = (sampling_params or SamplingParams()).for_engine()
        batch = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        texts = [p if isinstance(p, str) else None for p in batch]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        return self._run(texts, ids, params)

    def chat(self, messages: Chat | Sequence[Chat],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or several, through the chat template."""
        chats = [messages] if _is_chat(messages) else list(messages)
        texts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True) for c in chats]
        return self.generate(texts, sampling_params)

    def _run(self, texts: list[str | None], ids: list[list[int]], params: core.SamplingParams) -> list[RequestOutput]:
        requests = [core.Request(p, params) for p in ids]
        for req in requests:
            self.engine.add(req)  # raises (ContextLengthExceeded, ...) before any page is granted
        results = {r.rid: RequestOutput(f"{r.rid:032x}", t, r.prompt_ids,
                                        [CompletionOutput(i, "", [], None) for i in range(params.n)])
                   for r, t in zip(requests, texts, strict=True)}
        pending = set(results)
        try:
            while pending:
                for out in self.engine.step():
                    if out.error is not None:
                        raise out.error
                    if out.prompt_logprobs is not None:
                        results[out.rid].prompt_logprobs = out.prompt_logprobs
                    done = results[out.rid].outputs[out.index]
                    done.text += out.text
                    done.token_ids += out.token_ids
                    if out.logprobs is not None:
                        done.logprobs = (done.logprobs or []) + out.logprobs
                    if out.choice_finish is not None:
                        done.finish_reason = out.choice_finish.value
                    if out.finished:
                        pending.discard(out.rid)
                        if out.finish_reason is FinishReason.ERROR:
                            raise KvfenceError(f"the engine failed request {out.rid:032x}")
        finally:
            for rid in pending:
                self.engine.abort(rid)
        return [results[r.rid] for r in requests]


def _is_ids(prompt: object) -> TypeIs[list[int]]:
    return isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and bool(prompt)


def _is_chat(messages: Chat | Sequence[Chat]) -> TypeIs[Chat]:
    return bool(messages) and isinstance(messages[0], dict)
