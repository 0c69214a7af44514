"""What picking tokens costs per step, by sampling mode, at batch 1 and 32, over SmolLM2's 49,152-token vocabulary.

The engine samples row by row (each request with its own generator, penalties, logprobs and grammar), so these
are the sampler's whole cost per decode step. Modes: greedy and temperature/top-p (the baseline); penalties
(presence, frequency and repetition over a 300-token prompt and 200 output tokens); a 10-entry logit_bias;
logprobs with the top 5; a JSON-schema mask (llguidance, walking the schema as the sampler picks; llguidance's
cost depends on where in the document it is, so this is an average over whole documents). One torch thread, this
thread's CPU time, best of ``--rounds``.

    .venv/bin/python bench/sampling.py [--rounds 3] [--json bench/results/sampling.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu  # noqa: E402
from kvfence.core import Request, SamplingParams  # noqa: E402
from kvfence.engine.grammar import Guide, grammar_for, ll_tokenizer  # noqa: E402
from kvfence.engine.sampler import make_generator, sample, token_logprobs  # noqa: E402
from kvfence.model.loader import read_gguf_metadata, smollm2_gguf_path  # noqa: E402
from kvfence.model.tokenizer import Tokenizer  # noqa: E402

VOCAB = 49152
BATCHES = (1, 32)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
BASE = {"max_tokens": 512}
MODES = {
    "greedy": SamplingParams(**BASE, temperature=0.0),
    "temperature 0.7, top_p 0.9": SamplingParams(**BASE, temperature=0.7, top_p=0.9, seed=1),
    "greedy + penalties": SamplingParams(**BASE, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5,
                                         repetition_penalty=1.1),
    "greedy + logit_bias (10)": SamplingParams(**BASE, temperature=0.0,
                                               logit_bias=tuple((i * 997, 1.0) for i in range(10))),
    "greedy + logprobs (top 5)": SamplingParams(**BASE, temperature=0.0, logprobs=5),
    "greedy + json_schema": SamplingParams(**BASE, temperature=0.0, grammar="json_schema"),
}


class Rows:
    """``batch`` requests in ``mode``, with histories, and their grammar state; ``step`` samples once."""

    def __init__(self, p: SamplingParams, batch: int, tokenizer: Tokenizer, grammar: str) -> None:
        self.p = p if p.grammar is None else SamplingParams(**{**BASE, "temperature": 0.0, "grammar": grammar})
        self.tokenizer, self.grammar = tokenizer, grammar
        prompt = [(i * 7919) % VOCAB for i in range(300)]
        self.requests = [Request(prompt, self.p, output_ids=[(i * 31) % VOCAB for i in range(200)])
                         for _ in range(batch)]
        self.generators = [make_generator(self.p) for _ in range(batch)]
        self.guides = [self._guide() for _ in range(batch)]
        self.logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(0)) * 3

    def _guide(self) -> Guide | None:
        return Guide(self.grammar, ll_tokenizer(self.tokenizer, VOCAB)) if self.p.grammar else None

    def step(self) -> None:
        guides = self.guides if self.p.grammar else None
        tokens = sample(self.logits, self.requests, self.generators, self.tokenizer.eos_token_ids, guides)
        if self.p.logprobs is not None:
            token_logprobs(self.logits, self.requests, tokens)
        if guides:
            for i, (guide, token) in enumerate(zip(guides, tokens, strict=True)):
                guide.accept(token)
                if guide.done:
                    self.guides[i] = self._guide()


def per_step_ms(rows: Rows, steps: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.thread_time()
        for _ in range(steps):
            rows.step()
        best = min(best, (time.thread_time() - t) / steps)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="bench/results/sampling.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_gguf_fields(read_gguf_metadata(smollm2_gguf_path())[0])
    grammar = grammar_for({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, tokenizer)
    table: dict[str, dict[str, float]] = {}
    for name, p in MODES.items():
        table[name] = {f"b{b}": per_step_ms(Rows(p, b, tokenizer, grammar), 60 if b == 1 else 8, args.rounds)
                       for b in BATCHES}
    base = table["greedy"]
    print(f"{'mode':<30}" + "".join(f" {'ms/step b' + str(b):>12} {'vs greedy':>10}" for b in BATCHES))
    for name, row in table.items():
        print(f"{name:<30}" + "".join(f" {row[f'b{b}']:>12.3f} {row[f'b{b}'] - base[f'b{b}']:>+10.3f}"
                                      for b in BATCHES))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    host = cpu()
    out.write_text(json.dumps({"cpu": host, "vocab": VOCAB, "rounds": args.rounds, "ms_per_step": table},
                              indent=2))
    print(f"cpu: {host['model']}\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
