"""Prometheus metrics of one app, served at ``GET /metrics`` (labels carry tenant names, never keys; who may read
them: ``router/exposure.py``).

Counters and histograms are updated as requests run (``request_ended``, ``first_token``, ``later_tokens``);
KV pool gauges and transfers in flight are read from the engine's ``health()`` at scrape time. Each app has its
own ``CollectorRegistry``, so several apps in one process do not clash.

Metrics:

- ``kvfence_requests_total{tenant,status}``: requests that ended, by HTTP status (499: the client left).
- ``kvfence_rejections_total{layer,reason}``: requests that ended with an error; ``layer`` is the deciding safety
  layer (``none`` if no layer decided), ``reason`` the OpenAI error code (else its type).
- ``kvfence_kv_verification_failures_total{layer}``: rejections by the tags, coverage or checksum layer.
- ``kvfence_output_tokens_total{tenant}``: tokens generated.
- ``kvfence_auth_failures_total{reason}``: requests refused for their key (401 and 403): ``missing_key``,
  ``unknown_key`` or ``wrong_key_kind``.
- ``kvfence_time_to_first_token_seconds{tenant}``, ``kvfence_time_per_output_token_seconds``: histograms,
  measured at the router from admission (queue time included).
- ``kvfence_queue_time_seconds{tenant}``: histogram of the time requests waited in the router's queue for a
  worker (observed when they start; requests that never started are not in it).
- ``kvfence_queue_length{tenant}``: requests waiting in the router's queue now (every tenant of the tenants file,
  and any other seen).
- ``kvfence_rate_limited_total{tenant,reason}``: 429s, by the limit that refused: ``tenant_queue_full``,
  ``server_queue_full``, ``tokens_per_minute``, ``tokenization_backlog``.
- ``kvfence_preemptions_total{tenant}``: times a worker preempted a request of the tenant (counted when the
  request ends, from its last output's ``preemptions``; decode workers report them).
- ``kvfence_kv_pages_total{worker,role}``, ``kvfence_kv_pages_in_use{worker,role}``,
  ``kvfence_kv_pages_quarantined{worker,role}``: each worker's KV pool, from its latest heartbeat (prefix-cache
  pages no request reads count as free, as vLLM counts them: they are evicted when a grant needs them).
- ``kvfence_kv_transfers_in_flight``: requests sent to a prefill/decode pair whose KV has not yet landed.
- ``kvfence_prompt_tokens_computed_total{worker,role}``: prompt positions whose KV each worker computed since it
  started (from its latest heartbeat; recomputes after preemption included). The ``n`` choices of one request
  compute their prompt once.

vLLM's names, under ``kvfence:`` (a dashboard built for vLLM reads them as they are):

- ``kvfence:prompt_tokens_total{tenant}``, ``kvfence:generation_tokens_total{tenant}``: of requests that reached
  the engine, counted when they end.
- ``kvfence:prefix_cache_queries_total{tenant}``, ``kvfence:prefix_cache_hits_total{tenant}``: prompt tokens of
  requests that got a first output, and how many of them were read from the tenant's prefix cache.
- ``kvfence:prefix_cache_pages{worker,role}``: pages each prefix cache holds (the colocated engine's, or a
  prefill worker's), and ``kvfence:prefix_cache_evictions_total{worker,role}``: pages it evicted, from the latest
  heartbeat.
- ``kvfence:num_requests_running``, ``kvfence:num_requests_waiting``: on the workers (or the colocated engine's
  batch) now, and waiting for them (the router's queue, and the colocated engine's own).
- ``kvfence:e2e_request_latency_seconds{tenant}``: arrival to end; ``kvfence:request_queue_time_seconds{tenant}``:
  in the router's queue; ``kvfence:request_prefill_time_seconds{tenant}``: leaving the queue to the first token;
  ``kvfence:request_decode_time_seconds{tenant}``: first token to the last; ``kvfence:time_to_first_token_seconds
  {tenant}``: arrival to the first token (the same as ``kvfence_time_to_first_token_seconds``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfence.core import KvfenceError, TooManyRequests
from kvfence.engine.client import EngineClient
from kvfence.router.admin import LOCAL_WORKER

VERIFICATION_LAYERS = ("tags", "coverage", "checksum")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
PHASES = {  # vLLM's histograms, as kvfence:NAME_seconds{tenant}
    "e2e_request_latency": "From arrival to the end of the request.",
    "request_queue_time": "Time in the router's queue.",
    "request_prefill_time": "From leaving the queue to the first token.",
    "request_decode_time": "From the first token to the last.",
    "time_to_first_token": "From arrival to the first token.",
}


class Metrics:
    """The app's registry and the request-level instruments."""

    def __init__(self, engine: EngineClient, tenants: tuple[str, ...] = ()) -> None:
        """``tenants``: names whose queue length is shown even before their first request."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvfence_requests", "Requests that ended, by tenant and HTTP status.",
                                ["tenant", "status"], registry=r)
        self.rejections = Counter("kvfence_rejections", "Requests that ended with an error, by deciding safety "
                                  "layer and error code.", ["layer", "reason"], registry=r)
        self.verification_failures = Counter("kvfence_kv_verification_failures", "Requests failed by KV "
                                             "verification (tags, coverage, checksum).", ["layer"], registry=r)
        self.output_tokens = Counter("kvfence_output_tokens", "Tokens generated.", ["tenant"], registry=r)
        self.auth_failures = Counter("kvfence_auth_failures", "Requests refused for their API key (401 and 403), "
                                     "by reason.", ["reason"], registry=r)
        self.ttft = Histogram("kvfence_time_to_first_token_seconds", "From admission to the first token.",
                              ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvfence_time_per_output_token_seconds", "Between tokens after the first.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("kvfence_queue_time_seconds", "Time a request waited in the router's queue "
                                    "for a worker.", ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.rate_limited = Counter("kvfence_rate_limited", "Requests refused with 429, by the limit that refused.",
                                    ["tenant", "reason"], registry=r)
        self.preemptions = Counter("kvfence_preemptions", "Times a worker preempted a request of the tenant.",
                                   ["tenant"], registry=r)
        self.prompt_tokens = Counter("kvfence:prompt_tokens", "Prompt tokens of requests that reached the engine.",
                                     ["tenant"], registry=r)
        self.generation_tokens = Counter("kvfence:generation_tokens", "Tokens generated.", ["tenant"], registry=r)
        self.cache_queries = Counter("kvfence:prefix_cache_queries", "Prompt tokens looked up in the tenant's "
                                     "prefix cache.", ["tenant"], registry=r)
        self.cache_hits = Counter("kvfence:prefix_cache_hits", "Prompt tokens read from the tenant's prefix cache.",
                                  ["tenant"], registry=r)
        self.phases = {name: Histogram(f"kvfence:{name}_seconds", text, ["tenant"], buckets=LATENCY_BUCKETS,
                                       registry=r) for name, text in PHASES.items()}
        r.register(EngineCollector(engine, tenants))

    def request_ended(self, tenant: str, status: int, error: KvfenceError | None, output_tokens: int,
                      preemptions: int = 0, prompt_tokens: int = 0, seconds: float | None = None) -> None:
        """A request ended; ``prompt_tokens`` if the engine worked on it, ``seconds`` since it arrived."""
        self.requests.labels(tenant, str(status)).inc()
        self.output_tokens.labels(tenant).inc(output_tokens)
        self.generation_tokens.labels(tenant).inc(output_tokens)
        self.prompt_tokens.labels(tenant).inc(prompt_tokens)
        if seconds is not None:
            self.phases["e2e_request_latency"].labels(tenant).observe(seconds)
        if preemptions:
            self.preemptions.labels(tenant).inc(preemptions)
        if error is None:
            return
        if isinstance(error, TooManyRequests):
            self.rate_limited.labels(tenant, error.reason).inc()
        layer = error.layer or "none"
        self.rejections.labels(layer, error.code or error.type).inc()
        if layer in VERIFICATION_LAYERS:
            self.verification_failures.labels(layer).inc()

    def prefix_cache(self, tenant: str, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's first output: ``cached_tokens`` of its ``prompt_tokens`` came from the prefix cache."""
        self.cache_queries.labels(tenant).inc(prompt_tokens)
        self.cache_hits.labels(tenant).inc(cached_tokens)

    def first_token(self, tenant: str, seconds: float) -> None:
        self.ttft.labels(tenant).observe(seconds)
        self.phases["time_to_first_token"].labels(tenant).observe(seconds)

    def queued(self, tenant: str, seconds: float) -> None:
        self.queue_time.labels(tenant).observe(seconds)
        self.phases["request_queue_time"].labels(tenant).observe(seconds)

    def served(self, tenant: str, prefill_seconds: float, decode_seconds: float) -> None:
        """A request that had its first token ended: its prefill (queue exit to first token) and decode phases."""
        self.phases["request_prefill_time"].labels(tenant).observe(prefill_seconds)
        self.phases["request_decode_time"].labels(tenant).observe(decode_seconds)

    def later_tokens(self, seconds: float, tokens: int) -> None:
        """``tokens`` arrived together ``seconds`` after the previous ones: each took ``seconds / tokens``."""
        for _ in range(tokens):
            self.tpot.observe(seconds / tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """KV pool gauges per worker, transfers in flight and queue lengths, read from ``engine.health()`` at each scrape.

    Disaggregated health lists ``workers`` with ``total_pages``, ``free_pages`` and ``quarantined_pages``;
    colocated health has ``kv_pages_total`` and ``kv_pages_free`` for its one engine (worker ``local``). Both have
    ``queued_by_tenant`` behind the queue.
    """

    def __init__(self, engine: EngineClient, tenants: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.tenants = tenants

    def collect(self) -> Iterator[Metric]:
        health = self.engine.health()
        labels = ["worker", "role"]
        total = GaugeMetricFamily("kvfence_kv_pages_total", "KV pool pages.", labels=labels)
        in_use = GaugeMetricFamily("kvfence_kv_pages_in_use", "KV pool pages granted to requests.", labels=labels)
        quarantined = GaugeMetricFamily("kvfence_kv_pages_quarantined", "KV pool pages kept out of use until a "
                                        "write that may still land is known to have ended.", labels=labels)
        for worker, role, pages in _pools(health):
            n_total, n_free, n_quarantined = pages
            total.add_metric([worker, role], n_total)
            in_use.add_metric([worker, role], n_total - n_free - n_quarantined)
            quarantined.add_metric([worker, role], n_quarantined)
        yield from (total, in_use, quarantined)
        computed = CounterMetricFamily("kvfence_prompt_tokens_computed", "Prompt positions whose KV the worker "
                                       "computed (each request's choices share one prefill).", labels=labels)
        for worker, role, tokens in _prompt_tokens_computed(health):
            computed.add_metric([worker, role], tokens)
        yield computed
        yield from _prefix_caches(health, labels)
        yield GaugeMetricFamily("kvfence_kv_transfers_in_flight", "Requests whose KV transfer has not yet ended.",
                                value=health.get("transfers_in_flight", 0))
        queued = GaugeMetricFamily("kvfence_queue_length", "Requests waiting in the router's queue for a worker.",
                                   labels=["tenant"])
        lengths = {**dict.fromkeys(self.tenants, 0), **health.get("queued_by_tenant", {})}
        for tenant, n in sorted(lengths.items()):
            queued.add_metric([tenant], n)
        yield queued
        running, waiting = _running_waiting(health)
        yield GaugeMetricFamily("kvfence:num_requests_running", "Requests on the workers (or in the colocated "
                                "engine's batch).", value=running)
        yield GaugeMetricFamily("kvfence:num_requests_waiting", "Requests waiting for a worker or a batch slot.",
                                value=waiting)


def _running_waiting(health: dict) -> tuple[int, int]:
    """(running, waiting): colocated health counts its engine's batch and waiting list; disaggregated health
    counts requests sent to workers (``in_flight``). Both add the router's queue (``queued``) to waiting."""
    queued = health.get("queued", 0)
    if "running" in health:
        return health["running"], health.get("waiting", 0) + queued
    return health.get("in_flight", 0), queued


def _prompt_tokens_computed(health: dict) -> Iterator[tuple[str, str, int]]:
    """(worker, role, prompt tokens computed) for each engine ``health`` describes."""
    if "prompt_tokens_computed" in health:
        yield LOCAL_WORKER, "colocated", health["prompt_tokens_computed"]
    for worker, info in health.get("workers", {}).items():
        yield worker, info["role"], info.get("prompt_tokens_computed", 0)


def _prefix_caches(health: dict, labels: list[str]) -> Iterator[Metric]:
    """Each engine's prefix cache: pages held now, pages evicted so far."""
    pages = GaugeMetricFamily("kvfence:prefix_cache_pages", "KV pages the prefix cache holds.", labels=labels)
    evictions = CounterMetricFamily("kvfence:prefix_cache_evictions", "KV pages the prefix cache evicted.",
                                    labels=labels)
    engines = [(LOCAL_WORKER, "colocated", health)] if "cached_pages" in health else []
    engines += [(worker, info["role"], info) for worker, info in health.get("workers", {}).items()
                if info["role"] == "prefill"]
    for worker, role, info in engines:
        pages.add_metric([worker, role], info.get("cached_pages", 0))
        evictions.add_metric([worker, role], info.get("cache_evictions", 0))
    yield from (pages, evictions)


def _pools(health: dict) -> Iterator[tuple[str, str, tuple[int, int, int]]]:
    """(worker, role, (total, free, quarantined)) for each pool ``health`` describes."""
    if "kv_pages_total" in health:
        pages = (health["kv_pages_total"], health["kv_pages_free"], health.get("kv_pages_quarantined", 0))
        yield LOCAL_WORKER, "colocated", pages
    for worker, info in health.get("workers", {}).items():
        if info.get("total_pages"):  # 0: a worker from before heartbeats carried pool sizes
            yield worker, info["role"], (info["total_pages"], info["free_pages"], info["quarantined_pages"])
