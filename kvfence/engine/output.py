"""Turning a request's new tokens into text deltas and deciding when it ends."""

from __future__ import annotations

from kvfence.core import FinishReason, Request, RequestOutput, TokenLogprob
from kvfence.engine.grammar import Guide
from kvfence.model.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputTracker:
    """Per-request text state: detokenizes, applies stop strings, finishes.

    Text that could still be the start of a stop string is held back, so a
    stop string never reaches the client, not even in part.
    """

    def __init__(self, req: Request, tokenizer: Tokenizer, max_context: int, guide: Guide | None = None) -> None:
        """``max_context``: the most tokens (prompt + output) the request may reach; it ends there ("length").
        ``guide``: the request's grammar state; it consumes each token, and the request ends once it is done."""
        self.req = req
        self.guide = guide
        self.prompt_logprobs: list[TokenLogprob] = []  # prompt tokens 2..n, as prefill computes them (if asked)
        eos = frozenset() if req.params.ignore_eos else tokenizer.eos_token_ids
        self.end_ids = eos | frozenset(req.params.stop_token_ids)  # end the request, without text
        self.detok = IncrementalDetokenizer(tokenizer)
        self.max_context = max_context
        self.text = ""
        self.sent = 0  # chars of self.text already emitted

    def append(self, token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        """Record ``token``. Stop strings apply once ``min_tokens`` were generated (the sampler bans end tokens
        until then)."""
        req = self.req
        req.output_ids.append(token)
        if self.guide is not None:
            self.guide.accept(token)
        finish = None
        if token in self.end_ids:
            finish = FinishReason.STOP
        else:
            self.text += self.detok.push(token)
            if len(req.output_ids) >= req.params.min_tokens:
                finish = self._find_stop()
            if finish is None and self.guide is not None and self.guide.done:
                finish = FinishReason.STOP
        if finish is None and (len(req.output_ids) >= req.params.max_tokens or
                               req.prompt_len + len(req.output_ids) >= self.max_context):
            finish = FinishReason.LENGTH
        out = self._emit([token], finish)
        out.logprobs = None if logprob is None else [logprob]
        if len(req.output_ids) == 1 and req.params.prompt_logprobs is not None:
            out.prompt_logprobs = self.prompt_logprobs
        return out

    def _find_stop(self) -> FinishReason | None:
        stops = self.req.params.stop
        if not stops:
            return None
        window = max(len(s) for s in stops) + 16
        lo = max(0, self.sent - window)
        hits = [i for i in (self.text.find(s, lo) for s in stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return FinishReason.STOP
        return None

    def _emit(self, tokens: list[int], finish: FinishReason | None) -> RequestOutput:
        end = len(self.text) if finish else len(self.text) - self._held_back()
        delta, self.sent = self.text[self.sent : end], max(self.sent, end)
        return RequestOutput(
            self.req.rid, tokens, delta, finish,
            prompt_tokens=self.req.prompt_len, completion_tokens=len(self.req.output_ids),
        )

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for stop in self.req.params.stop:
            for k in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:k]):
                    best = k
                    break
        return best
