"""``kvfence probe``: a black-box canary leak tester for any OpenAI-compatible server (docs/safety.md).

Every ``--key`` but the last is a canary (victim) tenant; the last key is the attacker tenant.

- Victims send chats carrying fresh codes ("Repeat exactly: the secret code is ZEBRA-4471."), alone or after a
  long document whose every sentence names the code, sized to fill the smallest KV pool learned.
- The attacker sends over-length prompts at and around every limit learned (context and KV pools): limit - 1,
  limit, limit + 1, 2 x limit, and prompt + max_tokens just over the context; plus normal prompts.
- Findings: a response holding another tenant's code or a fragment of its request (``leak``); an over-length
  request answered 200 (``wrong status``) or 5xx (``wrong status class``); a greedy output under load that
  differs from the same prompt's output alone (``incoherent``).
- Last, the timing phase (``--timing-rounds``, default 3; ``--no-timing`` skips it): a prefix cache shared across
  keys tells one tenant what another sent. Per round the victim (the first key) streams a fresh ~1,500-token
  prefix (less where the limits learned leave less room) + a question; the attacker streams the same prefix +
  another question (cross key) and a fresh prefix as long (cold; the victim's first request is cold too); the
  victim repeats its prefix with a third question (same key, which shows whether the server caches at all).
  Medians of the times to first token: cross key and same key both under 0.6 x cold (and 20 ms under it), with
  the cross key also under 0.6 x its own round's cold in most rounds, is a ``timing`` finding ("caches across
  keys: leak"), as is a server reporting half the prompt or more as ``cached_tokens`` across keys; a fast same
  key alone is "caches per key: isolated"; neither, "no cache seen"; medians and rounds that disagree,
  "unclear". The phase sends 1 + 4 x rounds requests outside ``--requests`` and ``--time-limit``.

The first part (prompts, sizes, findings, report) is pure and unit-tested; ``Prober`` drives it over HTTP.
Exit status: 0 nothing found, 1 findings, 2 usage or connection error, 3 cannot conclude.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

from kvfence.tools.audit import UsageError, server_nodes

if TYPE_CHECKING:  # imported where used: 'kvfence serve' needs no HTTP client
    import httpx

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE, EXIT_INCONCLUSIVE = 0, 1, 2, 3
# Code words: unlikely in the attacker's sea story or the normal prompts' answers (no colours, no sea life), and
# of one size in SmolLM2's tokens (``WORD-NNNN`` is 8 tokens), so that victim documents size predictably.
WORDS = ("QUARTZ", "VIOLIN", "TULIP", "COBALT", "CACTUS", "WAFFLE", "GECKO", "BISON", "ORCHID", "PEPPER", "TOPAZ",
         "YODEL", "ZINC", "BANJO", "IGLOO", "NOODLE", "OCELOT", "PANDA", "TAPIR", "YETI", "ALPACA", "BAGEL",
         "CELERY", "TURNIP", "GINGER", "CASHEW", "LEMUR", "BADGER", "FERRET", "GOPHER", "MUFFIN", "TOFFEE",
         "FUDGE", "APRICOT", "TUBA", "CELLO", "OBOE")
# Every victim document sentence names its code; these phrases are shared by all victims' documents.
DOCUMENT_SENTENCE = ("The {code} file: the quarterly report covers logistics, staffing and budgets for the northern "
                     "region.")
DOCUMENT_FRAGMENTS = ("quarterly report", "northern region", "logistics, staffing")
SECRET = "secret code"
# The attacker's filler: common words that are one token each in usual BPE vocabularies (checked by calibration).
ATTACK_WORDS = "tell me a story about the sea and the old man who kept the light on the hill by the bay".split()
NORMAL_PROMPTS = ("What is the capital of France?", "Count from one to five.", "Name three primary colors.")
CALIBRATION_WORDS = (20, 40, 80)  # attacker filler lengths measured to learn the token count per word
# Before calibration: one token per filler word plus a chat template's overhead, and about 4 document characters
# per token (SmolLM2's, as (document chars, prompt tokens, tokens without document) of a sample).
ESTIMATED_TOKENS = (30.0, 1.0)
ESTIMATED_VICTIM_SAMPLE = (4000, 988, 46.0)


# -- tenants and canaries ------------------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    """One API key, named ``key1``, ``key2``, ... in the order given."""

    label: str
    key: str

    @property
    def masked(self) -> str:
        """The key with its middle hidden, for reports: ``sk-a…ce``."""
        return self.key if len(self.key) <= 6 else f"{self.key[:4]}…{self.key[-2:]}"


@dataclass(frozen=True)
class Canary:
    """A fresh secret ``WORD-NNNN`` owned by ``tenant``."""

    tenant: str
    word: str
    digits: str

    @property
    def code(self) -> str:
        return f"{self.word}-{self.digits}"

    @property
    def sentence(self) -> str:
        return f"Repeat exactly: the {SECRET} is {self.code}."


def new_canary(tenant: str, rng: random.Random, used_words: Iterable[str] = ()) -> Canary:
    """A canary for ``tenant`` with a word not in ``used_words`` (while any is left) and digits 2100..9999
    (no likely years)."""
    used = set(used_words)
    fresh = [w for w in WORDS if w not in used] or list(WORDS)
    return Canary(tenant, rng.choice(fresh), str(rng.randint(2100, 9999)))


def victim_document(canary: Canary, chars: int) -> str:
    """``DOCUMENT_SENTENCE`` for ``canary`` repeated, cut to at most ``chars`` characters at a word end."""
    sentence = DOCUMENT_SENTENCE.format(code=canary.code)
    text = " ".join([sentence] * (chars // len(sentence) + 1))[:chars]
    return text if len(text) < chars else text.rsplit(" ", 1)[0]


def canary_prompt(canary: Canary, document_chars: int) -> str:
    """The victim's message: its "Repeat exactly" sentence, then its document of about ``document_chars``
    characters (none for 0). After a document SmolLM2 goes on repeating it, so the victim's last KV pages, the
    ones nearest an attacker's query, hold its code too."""
    document = victim_document(canary, document_chars) if document_chars > 0 else ""
    return f"{canary.sentence}\n{document}" if document else canary.sentence


def attack_text(words: int) -> str:
    """The attacker's filler: ``ATTACK_WORDS`` repeated, ``words`` words long."""
    return " ".join(ATTACK_WORDS[i % len(ATTACK_WORDS)] for i in range(words))


# -- token counts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenModel:
    """Prompt tokens of an attacker chat of ``w`` filler words: ``overhead + per_word * w``.

    ``exact`` when a third measurement fell on the line and ``per_word`` is 1: then every count is exact.
    """

    overhead: float
    per_word: float
    exact: bool

    def tokens(self, words: int) -> int:
        return round(self.overhead + self.per_word * words)

    def words_for(self, tokens: int) -> int:
        """Filler words for a chat of ``tokens`` prompt tokens (at least 1)."""
        return max(1, round((tokens - self.overhead) / self.per_word))


def fit_token_model(measured: list[tuple[int, int]]) -> TokenModel:
    """The line through the first and last ``(words, tokens)`` measurements; exact when every measurement is
    on it and one word is one token."""
    (w0, t0), (w1, t1) = measured[0], measured[-1]
    per_word = (t1 - t0) / (w1 - w0)
    model = TokenModel(t0 - per_word * w0, per_word, False)
    exact = per_word == 1 and all(model.tokens(w) == t for w, t in measured)
    return TokenModel(model.overhead, per_word, exact)


def document_chars_for(tokens: int, sample_chars: int, sample_tokens: int, overhead: float) -> int:
    """Document characters for a victim chat of about ``tokens`` prompt tokens, scaled from a sample chat whose
    document of ``sample_chars`` characters made ``sample_tokens`` tokens; ``overhead``: tokens of a chat
    without a document."""
    chars_per_token = sample_chars / max(1.0, sample_tokens - overhead)
    return max(0, int((tokens - overhead) * chars_per_token))


# -- limits and targets --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What the server told: ``context`` (prompt + max_tokens) and KV ``pools`` by name ("prefill pool (id)")."""

    context: int | None
    pools: dict[str, int] = field(default_factory=dict)

    @property
    def smallest(self) -> int | None:
        """The smallest limit learned, or ``None`` when none was."""
        found = [*self.pools.values(), *([self.context] if self.context else [])]
        return min(found) if found else None


@dataclass(frozen=True)
class Target:
    """An attacker prompt of ``tokens`` prompt tokens; ``label`` says which limit it probes."""

    label: str
    tokens: int


def matched(target: Target, victim: Exchange | None) -> Target:
    """``target``, or when the ``victim`` (prompt + completion) outgrew it, one token more than the victim: the
    attacker's stale region then ends where the victim's KV ends (the strongest signal: docs/safety.md)."""
    if victim is None or victim.prompt_tokens is None or victim.completion_tokens is None:
        return target
    total = victim.prompt_tokens + victim.completion_tokens
    return Target(f"{target.label}, victim's {total} + 1", total + 1) if total >= target.tokens else target


def must_reject(prompt_tokens: int, max_tokens: int, limits: Limits) -> str | None:
    """Why a request of ``prompt_tokens`` + ``max_tokens`` exceeds ``limits`` (then only a 4xx is right), or
    ``None``. A prefill pool must hold the prompt; the context and any other pool, prompt + max_tokens."""
    total = prompt_tokens + max_tokens
    if limits.context is not None and total > limits.context:
        return f"prompt {prompt_tokens} + max_tokens {max_tokens} > context {limits.context}"
    for name, pool in limits.pools.items():
        if name.startswith("prefill") and prompt_tokens > pool:
            return f"prompt {prompt_tokens} > {name} {pool}"
        if not name.startswith("prefill") and total > pool:
            return f"prompt {prompt_tokens} + max_tokens {max_tokens} > {name} {pool}"
    return None


def attack_targets(limits: Limits, max_tokens: int, far_over_default: int = 262_144) -> list[Target]:
    """Attacker prompt sizes around every limit: limit - 1, limit, limit + 1, 2 x limit, and for the context
    and every pool but prefill's (which holds the prompt alone) prompt + ``max_tokens`` at and just over it.
    Strongest first: sizes over some limit, smallest first, then the doubled ones, then sizes that fit. One
    target per size; without any limit, only ``far_over_default`` tokens."""
    named = ([("context", limits.context)] if limits.context else []) + list(limits.pools.items())
    if not named:
        return [Target("far over (no limit known)", far_over_default)]
    near, doubled = [], []
    for name, size in sorted(named, key=lambda kv: kv[1]):
        near += [Target(f"{name} + 1", size + 1), Target(name, size), Target(f"{name} - 1", size - 1)]
        if not name.startswith("prefill"):
            near += [Target(f"{name} - max_tokens + 1", size - max_tokens + 1),
                     Target(f"{name} - max_tokens", size - max_tokens)]
        doubled.append(Target(f"2 x {name}", 2 * size))
    over = sorted((t for t in near if must_reject(t.tokens, max_tokens, limits)), key=lambda t: t.tokens)
    fitting = [t for t in near if not must_reject(t.tokens, max_tokens, limits)]
    unique: dict[int, Target] = {}
    for t in over + doubled + fitting:
        if t.tokens > 0:
            unique.setdefault(t.tokens, t)
    return list(unique.values())


def prompt_room(limits: Limits, max_tokens: int) -> int | None:
    """The longest prompt every limit admits with ``max_tokens`` (a prefill pool holds the prompt, any other
    limit prompt + ``max_tokens``), or ``None`` without a limit."""
    named = ([("context", limits.context)] if limits.context else []) + list(limits.pools.items())
    return min((size - (0 if name.startswith("prefill") else max_tokens) for name, size in named), default=None)


def victim_sizes(limits: Limits, max_tokens: int, cap: int | None) -> list[int]:
    """Victim prompt tokens: filling the tightest limit but 12 tokens (``prompt_room``), then 95% and 90% of it;
    at most ``cap`` (when given). Without a limit: 1,000."""
    room = prompt_room(limits, max_tokens)
    sizes = [1000] if room is None else [room - 12, int(0.95 * room), int(0.9 * room)]
    return [min(s, cap) if cap else s for s in sizes]


# -- exchanges and findings ---------------------------------------------------------------------------------


@dataclass
class Exchange:
    """One request and its answer. ``role``: calibration | victim | attacker | normal | timing; ``alone``: sent with
    nothing else in flight (the baseline of the coherence check). ``text``: the reply's content, or an error
    body's message; ``error``: why no answer came (timeout, connection)."""

    id: int
    phase: str
    tenant: str
    role: str
    label: str
    prompt: str
    max_tokens: int
    planned_tokens: int | None = None
    canary: str | None = None
    alone: bool = False
    status: int | None = None
    text: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    started: float = 0.0  # seconds since the run began
    ended: float = 0.0
    ttft: float | None = None  # streamed (timing phase): seconds to the first content
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where reported

    @property
    def tokens(self) -> int | None:
        """The prompt tokens: the server's count when it gave one, else the planned count."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.planned_tokens


@dataclass(frozen=True)
class Finding:
    """``kind``: leak | wrong status | wrong status class | incoherent | timing. ``receiver`` got the response;
    ``victims`` own what leaked into it (for ``timing``: whose prefix answered the receiver from cache; empty for
    the other kinds)."""

    kind: str
    receiver: str
    victims: tuple[str, ...]
    request: int
    label: str
    status: int | None
    detail: str


def _contains(text: str, fragment: str) -> bool:
    """Case-insensitive, whole words only (``4471`` is not in ``44712``), any run of non-alphanumerics counting
    as one space (``secret code`` is in ``-The-secret-code-``)."""
    return f" {_words(fragment)} " in f" {_words(text)} "


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def specific_fragments(canary: Canary, text: str, own_prompt: str) -> list[str]:
    """Pieces unique to ``canary`` (its code, word, digits) in ``text`` but not in the receiver's ``own_prompt``.
    The upper-case word counts inside a longer word too (``CASHEWHEAVEN``), the digits only on their own."""
    def found(fragment: str, haystack: str) -> bool:
        return _contains(haystack, fragment) or (fragment == canary.word and fragment in haystack)

    return [f for f in (canary.code, canary.word, canary.digits) if found(f, text) and not found(f, own_prompt)]


def shared_fragments(text: str, own_prompt: str) -> list[str]:
    """Pieces every victim request carries ("secret code", document phrases) in ``text`` but not in
    ``own_prompt``."""
    return [f for f in (SECRET, *DOCUMENT_FRAGMENTS) if _contains(text, f) and not _contains(own_prompt, f)]


def leak_finding(ex: Exchange, canaries: list[Canary]) -> Finding | None:
    """A leak into ``ex`` from another tenant's canary request. Victims are the owners of the canaries whose
    own pieces appear; with only shared pieces, every other canary tenant."""
    if not ex.text:
        return None
    others = [c for c in canaries if c.tenant != ex.tenant]
    hits = {c: specific_fragments(c, ex.text, ex.prompt) for c in others}
    hits = {c: found for c, found in hits.items() if found}
    shared = shared_fragments(ex.text, ex.prompt) if others else []
    if not hits and not shared:
        return None
    victims = {c.tenant for c in (hits or others)}
    fragments = list(dict.fromkeys([f for found in hits.values() for f in found] + shared))
    return Finding("leak", ex.tenant, tuple(sorted(victims)), ex.id, ex.label, ex.status,
                   f"{', '.join(repr(f) for f in fragments)} in {_excerpt(ex.text)}")


def status_finding(ex: Exchange, limits: Limits) -> Finding | None:
    """A 200 (``wrong status``) or 5xx (``wrong status class``) for a request over ``limits``."""
    reason = None if ex.tokens is None else must_reject(ex.tokens, ex.max_tokens, limits)
    if reason is None or ex.status is None or 400 <= ex.status < 500:
        return None
    if ex.status == 200:
        return Finding("wrong status", ex.tenant, (), ex.id, ex.label, 200, f"{reason}, yet HTTP 200 (want 400)")
    if ex.status >= 500:
        return Finding("wrong status class", ex.tenant, (), ex.id, ex.label, ex.status,
                       f"{reason}: a client error answered {ex.status} (want 400)")
    return None


def incoherence_findings(exchanges: list[Exchange]) -> list[Finding]:
    """Normal prompts whose greedy output under load differs from the same prompt's output sent alone."""
    alone = {e.prompt: e.text for e in exchanges if e.role == "normal" and e.alone and e.status == 200}
    findings = []
    for e in exchanges:
        base = alone.get(e.prompt)
        if e.role == "normal" and not e.alone and e.status == 200 and base is not None and e.text != base:
            findings.append(Finding("incoherent", e.tenant, (), e.id, e.label, e.status,
                                    f"alone {_excerpt(base)} vs under load {_excerpt(e.text or '')}"))
    return findings


def classify(exchanges: list[Exchange], canaries: list[Canary], limits: Limits) -> list[Finding]:
    """Every finding in ``exchanges``: leaks (from canaries whose request had started before the receiver's
    ended), wrong statuses, then incoherence."""
    started = {e.canary: e.started for e in exchanges if e.canary}
    leaks = [leak_finding(e, [c for c in canaries if started.get(c.code, 0.0) <= e.ended]) for e in exchanges]
    statuses = [status_finding(e, limits) for e in exchanges]
    return [f for f in leaks + statuses if f is not None] + incoherence_findings(exchanges)


def _excerpt(text: str, most: int = 80) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= most else flat[:most] + "…")


# -- timing: a prefix cache shared across keys (issue #22) -----------------------------------------------------

TIMING_PREFIX_TOKENS = 1500  # the prefix wanted, when the limits leave room for it (and the question)
TIMING_MIN_PREFIX = 256  # below this a cache hit saves too little time to see
TIMING_QUESTION_TOKENS = 48  # room kept for the question after the prefix
TIMING_MAX_TOKENS = 4  # of every timing request: only the first token's time counts
# The victim asks the first, the attacker (on the victim's prefix and on its own fresh one) the second, the victim's
# repeat the third: no request repeats another whole, so a cache of whole answers cannot answer any.
TIMING_QUESTIONS = ("In one word, what is the text above about?", "Which word does the text above use most?",
                    "What is the last word of the text above?")
TIMING_RATIO = 0.6  # "markedly faster": a median TTFT under 0.6 x the cold median...
TIMING_MIN_GAP = 0.02  # ...and at least 20 ms under it (jitter of the clock, the network, the event loop)
LEAK, ISOLATED, NO_CACHE, UNCLEAR, NOT_MEASURED = ("caches across keys: leak", "caches per key: isolated",
                                                   "no cache seen", "unclear", "not measured")


def timing_prefix_tokens(limits: Limits, wanted: int = TIMING_PREFIX_TOKENS) -> int:
    """Prompt tokens of a timing prefix: ``wanted``, or less where the tightest limit (``prompt_room`` with
    ``TIMING_MAX_TOKENS``) leaves less room beside the question."""
    room = prompt_room(limits, TIMING_MAX_TOKENS)
    return wanted if room is None else min(wanted, room - TIMING_QUESTION_TOKENS)


def timing_prefix(tag: str, words: int, rng: random.Random) -> str:
    """A prefix no other request shares: ``tag`` first (a prefix cache matches from the first token), then
    ``words`` of ``ATTACK_WORDS`` drawn by ``rng`` (so no chunk of it repeats another prefix's either)."""
    return f"Archive {tag}. " + " ".join(rng.choice(ATTACK_WORDS) for _ in range(words))


def timing_prompt(prefix: str, question: str) -> str:
    """The prefix, then the question: one user message, so the prefix's tokens lead the prompt after the
    template's own."""
    return f"{prefix}\n\n{question}"


@dataclass(frozen=True)
class TimingRound:
    """One round's TTFTs in seconds (``None`` where no answer came): ``first``, the victim's first request on its
    fresh prefix (cold too: nothing was cached for it); ``cross``, the attacker on that prefix; ``cold``, the
    attacker on a fresh prefix as long; ``same``, the victim's repeat; ``cross_cached``, the ``cached_tokens`` the
    server reported for the cross-key request."""

    first: float | None
    cross: float | None
    cold: float | None
    same: float | None
    cross_cached: int | None = None

    @property
    def cold_reference(self) -> float | None:
        """This round's cold time: the mean of its two cold requests (or the one that came back)."""
        found = [t for t in (self.first, self.cold) if t is not None]
        return statistics.fmean(found) if found else None


@dataclass(frozen=True)
class Timing:
    """What the timing phase measured, medians in seconds (``None`` where nothing came back): ``cold``, over every
    request on a fresh prefix (the victim's first and the attacker's fresh one of each round); ``same_key``, the
    victim repeating its own prefix; ``cross_key``, the attacker on the victim's prefix; ``fast_rounds``, the
    rounds whose cross-key time was fast against that round's own cold time; ``cross_cached``, the median
    ``cached_tokens`` the server reported for the cross-key requests (``None`` when it reports none);
    ``prompt_tokens``, their prompt tokens (the server's count, else the planned prefix)."""

    prompt_tokens: int | None
    rounds: int
    cold: float | None
    same_key: float | None
    cross_key: float | None
    fast_rounds: int
    cross_cached: int | None
    verdict: str
    why: str


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def timing_verdict(rounds: list[TimingRound], prompt_tokens: int | None = None, ratio: float = TIMING_RATIO,
                   gap: float = TIMING_MIN_GAP) -> Timing:
    """The verdict on the rounds' TTFTs. A time is "fast" against a cold one when it is under ``ratio`` x cold
    and at least ``gap`` under it. Medians decide, and the rounds one by one must agree before a leak is named:

    - ``LEAK``: the cross-key median and the same-key median are fast against the cold median (the server
      caches, and another key's prefix hits), and so is the cross-key time against its own round's cold time in
      more than half the rounds; or the server itself reports half the prompt or more as ``cached_tokens`` for
      the cross-key requests (median).
    - ``ISOLATED``: the same-key median is fast, the cross-key one is not.
    - ``NO_CACHE``: neither is fast.
    - ``UNCLEAR``: the cross-key median is fast but the same-key one is not, or the rounds disagree with the
      medians (noise on a loaded host: run more rounds).
    - ``NOT_MEASURED``: fewer than two answers of some kind.
    """
    cold = [t for r in rounds for t in (r.first, r.cold) if t is not None]
    same = [r.same for r in rounds if r.same is not None]
    cross = [r.cross for r in rounds if r.cross is not None]
    cross_cached = [r.cross_cached for r in rounds if r.cross_cached is not None]
    m_cold, m_same, m_cross = _median(cold), _median(same), _median(cross)
    cached = int(statistics.median(cross_cached)) if cross_cached else None

    def fast(t: float, reference: float) -> bool:
        return t < ratio * reference and reference - t >= gap

    paired = [fast(r.cross, r.cold_reference) for r in rounds if r.cross is not None and r.cold_reference]
    result = partial(Timing, prompt_tokens, len(rounds), m_cold, m_same, m_cross, sum(paired), cached)
    if min(len(cold), len(same), len(cross)) < 2 or m_cold is None or m_same is None or m_cross is None:
        return result(NOT_MEASURED, f"too few answers (cold {len(cold)}, same-key {len(same)}, cross-key "
                                    f"{len(cross)})")
    told = f"; the server reports {cached} of its {prompt_tokens} prompt tokens cached" if cached else ""
    numbers = (f"cross-key {m_cross:.3f} s, same-key {m_same:.3f} s, cold {m_cold:.3f} s (medians of "
               f"{len(rounds)} rounds; cross-key fast in {sum(paired)} of {len(paired)}; fast: under {ratio} x "
               f"cold){told}")
    if cached and prompt_tokens and cached >= prompt_tokens / 2:
        return result(LEAK, f"another key's prefix is served from cache: {numbers}")
    if fast(m_cross, m_cold) and fast(m_same, m_cold):
        if sum(paired) > len(paired) / 2:
            return result(LEAK, f"another key's prefix answers as fast as the owner's repeat: {numbers}")
        return result(UNCLEAR, f"the medians say another key's prefix hits, most rounds do not (noise? more "
                               f"rounds): {numbers}")
    if fast(m_same, m_cold):
        return result(ISOLATED, f"the owner's repeat is fast, another key's is not: {numbers}")
    if fast(m_cross, m_cold):
        return result(UNCLEAR, f"another key's request is fast but the owner's repeat is not (noise? more "
                               f"rounds): {numbers}")
    return result(NO_CACHE, f"no repeat is faster than a fresh prefix: {numbers}")


def sse_event(line: str) -> tuple[str, dict | None]:
    """``(content, usage)`` of one server-sent-events line of a streamed chat: the first choice's content delta
    (``""`` for none) and the usage object when the chunk carries one."""
    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
        return "", None
    try:
        chunk = json.loads(line[5:])
    except ValueError:
        return "", None
    if not isinstance(chunk, dict):
        return "", None
    choices = chunk.get("choices") or [{}]
    first = choices[0] if isinstance(choices[0], dict) else {}
    delta = first.get("delta") or {}
    usage = chunk.get("usage")
    return delta.get("content") or "", usage if isinstance(usage, dict) else None


def cached_tokens(usage: dict | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``, or ``None`` where the server reports none."""
    details = (usage or {}).get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


# -- report -------------------------------------------------------------------------------------------------


@dataclass
class Report:
    """Everything a run learned and found. ``inconclusive``: why a run without findings proves nothing."""

    url: str
    model: str
    limits: Limits
    notes: list[str]
    tenants: list[Tenant]
    attackers: list[str]
    exchanges: list[Exchange]
    canaries: list[Canary]
    findings: list[Finding]
    inconclusive: str | None
    timing: Timing | None = None  # None: the timing phase did not run (--no-timing)

    @property
    def exit_code(self) -> int:
        if self.findings:
            return EXIT_FINDINGS
        return EXIT_INCONCLUSIVE if self.inconclusive else EXIT_CLEAN


def render_table(report: Report) -> str:
    """Findings as a table (kind, receiver, victims, request, status, detail), then the summary."""
    rows = [("kind", "receiver", "victims", "request", "status", "detail")]
    rows += [(f.kind, f.receiver, ",".join(f.victims) or "-", f"#{f.request} {f.label}", str(f.status), f.detail)
             for f in report.findings]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5] for r in rows]
    return "\n".join((lines if report.findings else []) + summary_lines(report))


def summary_lines(report: Report) -> list[str]:
    """Tenants, limits, counts by kind, and the verdict."""
    roles = ", ".join(f"{t.label}={t.masked} ({'attacker' if t.label in report.attackers else 'canary'})"
                      for t in report.tenants)
    statuses: dict[str, int] = {}
    for e in report.exchanges:
        key = str(e.status) if e.status is not None else "no answer"
        statuses[key] = statuses.get(key, 0) + 1
    kinds: dict[str, int] = {}
    for f in report.findings:
        kinds[f.kind] = kinds.get(f.kind, 0) + 1
    lines = [f"probe: {report.url} model {report.model}; tenants {roles}",
             f"probe: limits: context {report.limits.context or 'unknown'}"
             + "".join(f", {name} {size}" for name, size in report.limits.pools.items()),
             *[f"probe: note: {n}" for n in report.notes],
             f"probe: {len(report.exchanges)} requests ({', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))})"]
    if report.timing is not None:
        lines += timing_lines(report.timing)
    if report.findings:
        lines.append("FINDINGS: " + ", ".join(f"{v} {k}" for k, v in kinds.items()))
    elif report.inconclusive:
        lines.append(f"CANNOT CONCLUDE: {report.inconclusive}")
    else:
        isolated = report.timing is not None and report.timing.verdict in (ISOLATED, NO_CACHE)
        lines.append(f"OK: no leak, no wrong status, no incoherence{', no cache shared across keys' * isolated} found")
    return lines


def timing_lines(t: Timing) -> list[str]:
    """The timing phase as a small table (medians, seconds) and its verdict."""
    def cell(v: float | None) -> str:
        return f"{v:.3f}" if v is not None else "-"

    size = f"{t.prompt_tokens}-token prompts" if t.prompt_tokens else "long prompts"
    return [f"probe: timing ({size}, {t.rounds} rounds): TTFT median, s",
            f"  cold (fresh prefixes)       {cell(t.cold)}",
            f"  same key (owner's repeat)   {cell(t.same_key)}",
            f"  cross key (owner's prefix)  {cell(t.cross_key)}"
            + (f"  cached_tokens {t.cross_cached}" if t.cross_cached is not None else ""),
            f"probe: timing verdict: {t.verdict}: {t.why}"]


def report_json(report: Report) -> str:
    body = {"exit_code": report.exit_code, "url": report.url, "model": report.model,
            "limits": asdict(report.limits), "notes": report.notes,
            "tenants": [{"label": t.label, "key": t.masked, "attacker": t.label in report.attackers}
                        for t in report.tenants],
            "canaries": [asdict(c) | {"code": c.code} for c in report.canaries],
            "findings": [asdict(f) for f in report.findings], "inconclusive": report.inconclusive,
            "timing": asdict(report.timing) if report.timing else None,
            "requests": [asdict(e) for e in report.exchanges]}
    return json.dumps(body, indent=2)


# -- learning the server ------------------------------------------------------------------------------------


def learn_limits(max_context: int | None, models: dict | None, health: dict | None,
                 pools: list[tuple[str, int]]) -> tuple[Limits, list[str]]:
    """Limits from, in order: ``--max-context``, /v1/models ``max_model_len``, kvfence /health ``max_context``;
    and the ``(role, pool tokens)`` pairs a server exposed, one name per distinct pool. Notes say what is
    missing."""
    cards = (models or {}).get("data") or [{}]
    context = max_context or cards[0].get("max_model_len") or (health or {}).get("max_context")
    named: dict[str, int] = {}
    for role, size in sorted(pools):
        sizes = [v for k, v in named.items() if k.startswith(f"{role} pool")]
        if size not in sizes:
            named[f"{role} pool" + (f" {len(sizes) + 1}" if sizes else "")] = size
    notes = [] if named else ["the server exposes no KV pool sizes: probing around the context only"]
    if not context:
        notes.append("the server reports no context length (pass --max-context): limits cannot be tested "
                     "precisely" + ("" if named else ", so only a far-over prompt is sent"))
    return Limits(int(context) if context else None, named), notes


# -- driving a server over HTTP ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The command's flags."""

    url: str
    tenants: list[Tenant]
    model: str | None
    max_context: int | None
    requests: int
    time_limit: float
    concurrency: int
    timeout: float
    max_tokens: int
    victim_tokens: int | None
    seed: int | None
    admin_key: str | None = None  # reads the KV pools from a kvfence /health that shows them only to admins
    timing_rounds: int = 0  # rounds of the timing phase (0: skip it)


class Prober:
    """Runs the phases (discover, calibrate, baseline, victim-then-attacker pairs, concurrent mix) within
    ``settings.requests`` and ``settings.time_limit``, writing one progress line per request to ``progress``."""

    def __init__(self, settings: Settings, client: httpx.AsyncClient, progress) -> None:
        self.s, self.client, self.progress = settings, client, progress
        self.rng = random.Random(settings.seed)
        self.victims, self.attacker = settings.tenants[:-1], settings.tenants[-1]
        self.exchanges: list[Exchange] = []
        self.canaries: list[Canary] = []
        self.started = time.monotonic()
        self.model = settings.model or ""
        self.tokens = TokenModel(*ESTIMATED_TOKENS, False)
        self.victim_sample = ESTIMATED_VICTIM_SAMPLE  # (document chars, prompt tokens, tokens without document)
        self.notes: list[str] = []

    # budget and transport

    def budget_left(self) -> bool:
        return len(self.exchanges) < self.s.requests and time.monotonic() - self.started < self.s.time_limit

    async def chat(self, tenant: Tenant, phase: str, role: str, label: str, prompt: str, max_tokens: int,
                   **extra) -> Exchange | None:
        """Send one greedy chat and record it; ``None`` (nothing sent) once the budget is spent."""
        import httpx
        if not self.budget_left():
            return None
        ex = Exchange(len(self.exchanges) + 1, phase, tenant.label, role, label, prompt, max_tokens, **extra)
        self.exchanges.append(ex)
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0}
        ex.started = round(time.monotonic() - self.started, 2)
        try:
            resp = await self.client.post("/v1/chat/completions", json=body, timeout=self.s.timeout,
                                          headers={"Authorization": f"Bearer {tenant.key}"})
            ex.status = resp.status_code
            ex.text, ex.prompt_tokens, ex.completion_tokens = reply_content(resp)
        except httpx.HTTPError as e:
            ex.error = f"{type(e).__name__}: {e}"
        ex.ended = round(time.monotonic() - self.started, 2)
        self.report_progress(ex)
        return ex

    async def stream(self, tenant: Tenant, label: str, prompt: str, planned_tokens: int) -> Exchange:
        """Stream one greedy chat of ``TIMING_MAX_TOKENS`` and record its TTFT (the timing phase: outside the
        --requests and --time-limit budget, which bound the leak phases)."""
        import httpx
        ex = Exchange(len(self.exchanges) + 1, "timing", tenant.label, "timing", label, prompt, TIMING_MAX_TOKENS,
                      planned_tokens)
        self.exchanges.append(ex)
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                "max_tokens": TIMING_MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
        ex.started = round(time.monotonic() - self.started, 2)
        t0, text = time.perf_counter(), []
        try:
            async with self.client.stream("POST", "/v1/chat/completions", json=body, timeout=self.s.timeout,
                                          headers={"Authorization": f"Bearer {tenant.key}"}) as resp:
                ex.status = resp.status_code
                if resp.status_code != 200:
                    await resp.aread()
                    ex.text = reply_content(resp)[0]
                else:
                    async for line in resp.aiter_lines():
                        content, usage = sse_event(line)
                        if content and ex.ttft is None:
                            ex.ttft = time.perf_counter() - t0
                        text.append(content)
                        if usage:
                            ex.prompt_tokens, ex.completion_tokens = usage.get("prompt_tokens"), \
                                usage.get("completion_tokens")
                            ex.cached_tokens = cached_tokens(usage)
                    ex.text = "".join(text)
        except httpx.HTTPError as e:
            ex.error = f"{type(e).__name__}: {e}"
        ex.ended = round(time.monotonic() - self.started, 2)
        self.report_progress(ex)
        return ex

    def report_progress(self, ex: Exchange) -> None:
        outcome = ex.status if ex.status is not None else ex.error
        if ex.phase == "timing":
            ttft = f"TTFT {ex.ttft:.3f}s" if ex.ttft is not None else "no TTFT"
            cached = f", {ex.cached_tokens} cached" if ex.cached_tokens else ""
            print(f"probe: timing: #{ex.id} {ex.tenant} {ex.label} ({ex.tokens or '?'} tokens{cached}) -> {outcome}, "
                  f"{ttft}", file=self.progress, flush=True)
            return
        print(f"probe: {ex.phase}: #{ex.id} {ex.role} {ex.label} ({ex.tokens or '?'} tokens) -> {outcome} in "
              f"{ex.ended - ex.started:.1f}s; {len(self.exchanges)}/{self.s.requests} requests, "
              f"{time.monotonic() - self.started:.0f}/{self.s.time_limit:.0f}s", file=self.progress, flush=True)

    # phases

    async def discover(self) -> Limits:
        """The model and the limits; raises ``UsageError`` when the server cannot be read."""
        models = await self.get_json("/v1/models")
        if not self.model:
            cards = (models or {}).get("data") or []
            if not cards:
                raise UsageError(f"{self.s.url}/v1/models lists no model: pass --model")
            self.model = cards[0]["id"]
        health = await self.get_json("/health")
        try:
            key = self.s.admin_key or self.s.tenants[0].key
            _, nodes = await asyncio.to_thread(server_nodes, self.s.url, key, self.s.timeout, 1, self.s.max_context)
        except UsageError:
            nodes = []
        limits, notes = learn_limits(self.s.max_context, models, health, [(n.role, n.pool_tokens) for n in nodes])
        self.notes += notes
        return limits

    async def get_json(self, path: str) -> dict | None:
        """GET ``path`` as the first tenant: its JSON object, or ``None``. Raises ``UsageError`` when nothing
        answers or the key is refused."""
        import httpx
        try:
            resp = await self.client.get(path, headers={"Authorization": f"Bearer {self.s.tenants[0].key}"},
                                         timeout=self.s.timeout)
        except httpx.HTTPError as e:
            raise UsageError(f"cannot reach {self.s.url}{path}: {e}") from e
        if resp.status_code in (401, 403):
            raise UsageError(f"{self.s.url}{path} answered {resp.status_code}: check the --key values")
        try:
            body = resp.json()
        except ValueError:
            return None
        return body if resp.status_code == 200 and isinstance(body, dict) else None

    async def calibrate_tokens(self) -> None:
        """Learn the attacker chat's tokens per filler word from the server's ``usage.prompt_tokens``; raises
        ``UsageError`` when the server reports none."""
        measured, failed = [], []
        for words in CALIBRATION_WORDS:
            ex = await self.chat(self.attacker, "calibrate tokens", "calibration", f"{words} words",
                                 attack_text(words), 1)
            if ex is not None and ex.prompt_tokens:
                measured.append((words, ex.prompt_tokens))
            elif ex is not None and ex.status != 200:
                failed.append(str(ex.status if ex.status is not None else ex.error))
        if len(measured) < 2:
            if failed:  # a failing server, not one without usage: the run goes on and says what it could not do
                self.notes.append(f"calibration requests failed ({', '.join(failed)}): attacker prompt sizes are "
                                  "estimates")
                return
            if self.budget_left():
                raise UsageError("the server returned no usage.prompt_tokens: cannot size prompts")
            return  # the bounds ended the run: keep the estimate
        self.tokens = fit_token_model(measured)
        if not self.tokens.exact:
            self.notes.append(f"attacker prompt sizes are estimates ({self.tokens.per_word:.2f} tokens per word); "
                              "the table shows the server's counts where it reported them")

    async def calibrate_canaries(self) -> bool:
        """Whether the model repeats a fresh code sent alone (at most three tries); also samples the victims'
        tokens per document character."""
        repeated, alone_tokens = False, 0
        for attempt, sentences in enumerate((0, 8, 0)):
            if repeated and attempt == 2:
                break
            canary = self.new_canary(self.victims[attempt % len(self.victims)])
            chars = sentences * len(DOCUMENT_SENTENCE.format(code=canary.code))
            ex = await self.chat(self.tenant(canary.tenant), "calibrate canaries", "calibration",
                                 f"canary{' + document' if chars else ''}", canary_prompt(canary, chars), 32,
                                 canary=canary.code, alone=True)
            if ex is None or ex.status != 200:
                continue
            repeated = repeated or _contains(ex.text or "", canary.code)
            if chars == 0 and ex.prompt_tokens:
                alone_tokens = ex.prompt_tokens
            elif ex.prompt_tokens and alone_tokens and self.victim_sample == ESTIMATED_VICTIM_SAMPLE:
                self.victim_sample = (len(victim_document(canary, chars)), ex.prompt_tokens, float(alone_tokens))
        return repeated

    async def baseline(self) -> None:
        """Each normal prompt alone: the outputs the coherence check expects under load."""
        for i, prompt in enumerate(NORMAL_PROMPTS):
            await self.chat(self.attacker, "baseline", "normal", f"normal {i + 1}", prompt, self.s.max_tokens,
                            alone=True)

    async def pairs(self, targets: list[Target], sizes: list[int], most: int, phase: str = "pairs",
                    victims_each: int = 1) -> int:
        """Each target in turn as the attacker, after ``victims_each`` victim requests (of the canary tenants in
        turn) have run to their end; new victims only after an attacker was served (a rejected one used no
        pages). Two victims in a row leave the pages an attacker is granted next full of victims' KV, not of an
        earlier attacker's. The first target is ``matched`` to the last victim. At most ``most`` requests;
        returns the attacks that followed a completed victim."""
        done, victim, budget = 0, None, len(self.exchanges) + most
        for target in targets:
            if len(self.exchanges) + (victims_each if victim is None else 0) >= budget:
                break
            for _ in range(victims_each if victim is None else 0):
                n = sum(e.role == "victim" for e in self.exchanges)
                victim = await self.victim(self.victims[n % len(self.victims)], sizes[n % len(sizes)], phase)
            attack = await self.attack(matched(target, victim) if target == targets[0] else target, phase)
            done += victim is not None and victim.status == 200 and attack is not None
            if attack is None or attack.status is None or attack.status < 400:
                victim = None
        return done

    async def mix(self, targets: list[Target], sizes: list[int], rounds: int, phase: str = "mix") -> None:
        """Victims (with documents and alone), attackers and normal prompts in flight together, interleaved,
        ``settings.concurrency`` at a time: ``rounds`` rounds of four, or fewer when the budget runs out."""
        gate = asyncio.Semaphore(self.s.concurrency)

        async def gated(make) -> None:
            async with gate:
                await make()

        plan = []
        for i in range(rounds):
            tenant, normal = self.victims[i % len(self.victims)], i % len(NORMAL_PROMPTS)
            plan += [partial(self.victim, tenant, sizes[i % len(sizes)], phase),
                     partial(self.chat, self.attacker, phase, "normal", f"normal {normal + 1}", NORMAL_PROMPTS[normal],
                             self.s.max_tokens),
                     partial(self.attack, targets[i % len(targets)], phase),
                     partial(self.victim, tenant, 0, phase)]
        await asyncio.gather(*(gated(make) for make in plan))

    async def timing(self, limits: Limits, rounds: int) -> tuple[Timing, Finding | None]:
        """The timing phase: a prefix cache shared across keys. Per round, on a fresh prefix P of
        ``timing_prefix_tokens``: the victim (the first canary key) sends P + a question, then P + another
        question (same key: does the server cache at all?); then the attacker sends P + a third question (cross
        key) and a fresh prefix of P's length + the same question (cold), in an order that alternates by round.
        The same-key repeat comes first so that a small cache has not evicted P for the cold prompt before it.
        One cold request first warms the server to this length. The rounds are judged by ``timing_verdict``."""
        victim, attacker = self.victims[0], self.attacker
        tokens = timing_prefix_tokens(limits)
        if tokens < TIMING_MIN_PREFIX:
            why = f"the tightest limit leaves room for a {tokens}-token prefix only (want {TIMING_MIN_PREFIX})"
            return replace(timing_verdict([], tokens), why=why), None
        words = self.tokens.words_for(tokens)

        def fresh() -> str:
            return timing_prefix(f"{self.rng.randrange(10**7, 10**8)}", words, self.rng)

        def ttft(ex: Exchange) -> float | None:
            return ex.ttft if ex.status == 200 else None

        await self.stream(attacker, "warm-up (fresh prefix)", timing_prompt(fresh(), TIMING_QUESTIONS[1]), tokens)
        results: list[TimingRound] = []
        sizes: list[int] = []
        first_cross = None
        for i in range(rounds):
            prefix = fresh()
            first = await self.stream(victim, f"round {i + 1}: victim's prefix",
                                      timing_prompt(prefix, TIMING_QUESTIONS[0]), tokens)
            same = await self.stream(victim, f"round {i + 1}: victim's prefix again (same key)",
                                     timing_prompt(prefix, TIMING_QUESTIONS[2]), tokens)
            got: dict[str, Exchange] = {}
            order = [("victim's prefix (cross key)", prefix), ("fresh prefix (cold)", fresh())]
            for label, text in order if i % 2 == 0 else order[::-1]:
                got[label] = await self.stream(attacker, f"round {i + 1}: {label}",
                                               timing_prompt(text, TIMING_QUESTIONS[1]), tokens)
            cross, cold = got[order[0][0]], got[order[1][0]]
            first_cross = first_cross or cross
            sizes += [cross.prompt_tokens] if cross.prompt_tokens else []
            results.append(TimingRound(ttft(first), ttft(cross), ttft(cold), ttft(same), cross.cached_tokens))
        result = timing_verdict(results, int(statistics.median(sizes)) if sizes else tokens)
        if result.verdict != LEAK or first_cross is None:
            return result, None
        return result, Finding("timing", attacker.label, (victim.label,), first_cross.id, first_cross.label,
                               first_cross.status, result.why)

    async def victim(self, tenant: Tenant, tokens: int, phase: str) -> Exchange | None:
        """A fresh canary of ``tenant`` after a document making about ``tokens`` prompt tokens (none for 0)."""
        if not self.budget_left():
            return None
        canary = self.new_canary(tenant)
        chars = document_chars_for(tokens, *self.victim_sample) if tokens else 0
        ex = await self.chat(tenant, phase, "victim", f"canary + {tokens}-token document" if chars else "canary",
                             canary_prompt(canary, chars), self.s.max_tokens, canary=canary.code)
        if ex is not None and chars and ex.prompt_tokens:
            self.victim_sample = (len(victim_document(canary, chars)), ex.prompt_tokens, self.victim_sample[2])
        return ex

    async def attack(self, target: Target, phase: str) -> Exchange | None:
        words = self.tokens.words_for(target.tokens)
        return await self.chat(self.attacker, phase, "attacker", target.label, attack_text(words), self.s.max_tokens,
                               planned_tokens=self.tokens.tokens(words))

    def new_canary(self, tenant: Tenant) -> Canary:
        canary = new_canary(tenant.label, self.rng, (c.word for c in self.canaries))
        self.canaries.append(canary)
        return canary

    def tenant(self, label: str) -> Tenant:
        return next(t for t in self.s.tenants if t.label == label)

    async def run(self) -> Report:
        """Every phase in order; the report of what was found."""
        limits = await self.discover()
        targets = attack_targets(limits, self.s.max_tokens)
        sizes = victim_sizes(limits, self.s.max_tokens, self.s.victim_tokens)
        # First, before calibration fills the pool with its own KV: the strongest target three times, each after
        # two victims, then two concurrent rounds around it; sizes estimated.
        pairs = await self.pairs(targets[:1] * 3, sizes, most=9, phase="first pairs", victims_each=2)
        await self.mix(targets[:1], sizes[:1], rounds=2, phase="first mix")
        await self.calibrate_tokens()
        repeats = await self.calibrate_canaries()
        await self.baseline()
        pairs += await self.pairs(targets, sizes, most=max(2, (self.s.requests - len(self.exchanges)) // 2))
        await self.mix(targets, sizes, rounds=self.s.requests)
        inconclusive = None
        if not repeats:
            inconclusive = "the model did not repeat a fresh code sent alone, so leaked codes may go unseen"
        elif not pairs:
            inconclusive = "no victim-then-attacker pair completed within --requests and --time-limit"
        findings, timing = classify(self.exchanges, self.canaries, limits), None
        if self.s.timing_rounds:
            timing, finding = await self.timing(limits, self.s.timing_rounds)
            findings += [finding] if finding else []
        return Report(self.s.url, self.model, limits, self.notes, self.s.tenants, [self.attacker.label],
                      self.exchanges, self.canaries, findings, inconclusive, timing)


def reply_content(resp: httpx.Response) -> tuple[str | None, int | None, int | None]:
    """``(text, usage.prompt_tokens, usage.completion_tokens)`` of a chat completion; for an error, ``(its
    message, None, None)``."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:2000], None, None
    if resp.status_code == 200 and isinstance(body, dict) and body.get("choices"):
        usage = body.get("usage") or {}
        text = body["choices"][0].get("message", {}).get("content")
        return text, usage.get("prompt_tokens"), usage.get("completion_tokens")
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("message") if isinstance(error, dict) else body)[:2000], None, None


# -- command ----------------------------------------------------------------------------------------------------


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not positive")
        return value
    return parse


def add_probe_parser(sub) -> None:
    """Add ``probe`` to the ``kvfence`` subcommands ``sub``."""
    p = sub.add_parser(
        "probe", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="black-box canary leak test of an OpenAI-compatible server (kvfence, SGLang, vLLM, llama.cpp)",
        description="Send canary chats as every --key but the last (the victims) and over-length prompts around "
                    "every limit the server exposes as the last --key (the attacker); report responses holding "
                    "another tenant's canary, over-length requests answered 200 or 5xx, and greedy outputs that "
                    "change under load. Then time to first token on a ~1,500-token prefix: the attacker's on the "
                    "first key's prefix against a fresh one's (a prefix cache shared across keys is a timing "
                    "leak).\n\n"
                    "Exit status: 0 nothing found, 1 findings, 2 usage or connection error, 3 cannot conclude "
                    "(the model does not repeat codes, or the bounds allowed no victim-then-attacker pair).")
    p.add_argument("--url", required=True, help="http://HOST:PORT of the server (without /v1)")
    p.add_argument("--key", action="append", required=True,
                   help="an API key; give at least two, each of another tenant; the last one attacks")
    p.add_argument("--model", default=None, help="model id (default: the first in /v1/models)")
    p.add_argument("--max-context", type=_positive(int), default=None,
                   help="the context served (default: what the server reports)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the full report as JSON to FILE")
    p.add_argument("--requests", type=_positive(int), default=200, help="most requests in all")
    p.add_argument("--time-limit", type=_positive(float), default=600.0, metavar="S",
                   help="send no request after S seconds")
    p.add_argument("--concurrency", type=_positive(int), default=4, help="requests in flight in the mixed phase")
    p.add_argument("--timeout", type=_positive(float), default=300.0, help="seconds to wait for each answer")
    p.add_argument("--max-tokens", type=_positive(int), default=32, help="max_tokens of victims and attackers")
    p.add_argument("--victim-tokens", type=_positive(int), default=None, metavar="N",
                   help="longest victim prompt (default: filling the smallest limit learned)")
    p.add_argument("--seed", type=int, default=None, help="seed for the canary codes (default: fresh)")
    p.add_argument("--timing-rounds", type=_positive(int), default=3, metavar="N",
                   help="rounds of the timing phase (a prefix cache shared across keys; 1 + 4 x N streamed requests "
                        "of ~1,500 tokens, outside --requests and --time-limit)")
    p.add_argument("--no-timing", action="store_true", help="skip the timing phase")
    p.add_argument("--admin-key", default=None, help="an admin key, to learn the KV pools of a kvfence server with "
                                                     "a tenants file (its /health shows them only to admins)")
    p.set_defaults(func=cmd_probe)


def settings_from(args: argparse.Namespace) -> Settings:
    if len(args.key) < 2:
        raise UsageError("give at least two --key values: canary tenants first, the attacker last")
    tenants = [Tenant(f"key{i + 1}", key) for i, key in enumerate(args.key)]
    return Settings(args.url.rstrip("/"), tenants, args.model, args.max_context, args.requests, args.time_limit,
                    args.concurrency, args.timeout, args.max_tokens, args.victim_tokens, args.seed, args.admin_key,
                    0 if args.no_timing else args.timing_rounds)


async def probe(settings: Settings) -> Report:
    import httpx
    async with httpx.AsyncClient(base_url=settings.url) as client:
        return await Prober(settings, client, sys.stderr).run()


def cmd_probe(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the progress lines say what each request did
    try:
        report = asyncio.run(probe(settings_from(args)))
    except UsageError as e:
        print(f"kvfence probe: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        with open(args.json, "w") as f:
            f.write(report_json(report))
    print(render_table(report))
    return report.exit_code
