"""``kvfence audit``: the L0 preflight (``kvfence/preflight.py``) over a planned deployment (flags), a running
kvfence server (``/health``), or a running SGLang server or PD load balancer (its server info).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlparse

from kvfence.config import POOL_DEFAULTS, ModelConfig, default_pool_tokens
from kvfence.kvcache.layout import TAG_BYTES, KVLayout
from kvfence.preflight import fix_for, pool_tokens_for_memory, usable_pool_tokens

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}  # the KV dtypes of ``kvfence serve --dtype``
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class NodeCheck:
    """One node's verdict: its usable pool against the context it must hold."""

    role: str  # "prefill" | "decode" | "colocated"
    node: str
    pool_tokens: int  # usable: whole pages
    max_context: int
    page_size: int = 1

    @property
    def shortfall(self) -> int:
        return max(0, self.max_context - self.pool_tokens)

    @property
    def ok(self) -> bool:
        return self.shortfall == 0

    @property
    def fix(self) -> str | None:
        return None if self.ok else fix_for(self.role, self.pool_tokens, self.max_context, self.page_size)


class UsageError(Exception):
    """Flags that do not make sense, or a server that cannot be reached or read: exit status 2."""


# -- nodes of a planned deployment (flags) -----------------------------------------------------


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` or plain bytes ``"1073741824"`` -> bytes (KiB.. binary, KB.. decimal)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m and m.group(2).lower()
    if m is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: want e.g. 512MiB, 2GiB, 1.5GB or plain bytes")
    return int(float(m.group(1)) * _BYTE_UNITS[unit])


@functools.cache
def describe(model: str) -> tuple[str, ModelConfig]:
    """``(name, config)`` of ``model`` from its metadata only (no weights are read)."""
    from kvfence.model.describe import describe_model

    try:
        name, cfg, _ = describe_model(model)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"cannot describe model {model!r}: {e}") from e
    return name, cfg


def planned_nodes(args: argparse.Namespace) -> tuple[str, list[NodeCheck]]:
    """The nodes ``kvfence serve`` would start with these flags (same defaults as serve for the pools)."""
    name, cfg = describe(args.model)
    max_context = args.max_context or cfg.max_context
    if not 0 < max_context <= cfg.max_context:
        raise UsageError(f"--max-context {max_context} must be between 1 and the model's context length "
                         f"({cfg.max_context})")
    dtype_bytes = DTYPE_BYTES[args.dtype]
    roles = [("colocated", 1)] if args.mode == "colocated" else [("prefill", args.prefill), ("decode", args.decode)]
    nodes = []
    for role, count in roles:
        pool = role_pool_tokens(args, role, cfg, max_context, dtype_bytes)
        nodes += [NodeCheck(role, f"{role}-{i}", pool, max_context, args.page_size) for i in range(count)]
    page = KVLayout.of(cfg, 1, args.page_size, dtype_bytes)
    source = (f"planned {args.mode}: model {name} ({cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x "
              f"{cfg.head_dim}, {args.dtype}); page {args.page_size} tokens = {page.page_bytes:,} bytes + "
              f"{TAG_BYTES}-byte tag")
    return source, nodes


def role_pool_tokens(args: argparse.Namespace, role: str, cfg: ModelConfig, max_context: int,
                     dtype_bytes: int) -> int:
    """Usable pool tokens of a ``role`` node: its own pool flag, else the one for every node, else the default."""
    tokens, memory = pool_setting(args, role)
    if memory is not None:
        return pool_tokens_for_memory(memory, cfg, args.page_size, dtype_bytes)
    return usable_pool_tokens(default_pool_tokens(max_context, role) if tokens is None else tokens, args.page_size)


def pool_setting(args: argparse.Namespace, role: str) -> tuple[int | None, int | None]:
    """``(tokens, bytes)`` set for ``role``'s pool, the most specific flags first; at most one of them is set."""
    for tokens_dest, memory_dest in ((f"{role}_pool_tokens", f"{role}_pool_memory"), ("kv_pool_tokens", "pool_memory")):
        tokens, memory = getattr(args, tokens_dest, None), getattr(args, memory_dest, None)
        if tokens is not None and memory is not None:
            raise UsageError(f"give the {role} pool in tokens or in memory, not both")
        if tokens is not None or memory is not None:
            return tokens, memory
    return None, None


# -- nodes of a running server ----------------------------------------------------------------------


def fetch_json(url: str, key: str | None, timeout: float) -> tuple[int, Any]:
    """GET ``url``: ``(HTTP status, its JSON body or None)``. Raises ``UsageError`` when nothing answers."""
    headers = {"Accept": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            return resp.status, _json_or_none(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, _json_or_none(e.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise UsageError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from e


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def server_nodes(url: str, key: str | None, timeout: float, page_size: int,
                 max_context: int | None) -> tuple[str, list[NodeCheck]]:
    """The nodes behind a running kvfence (its ``/health`` has ``mode``) or SGLang server at ``url``.

    ``max_context``, when given, replaces the context each node reports.
    """
    url = url.rstrip("/")
    _, health = fetch_json(url + "/health", key, timeout)
    if health in ({"status": "ok"}, {"status": "unavailable"}):  # kvfence's answer without an admin key
        raise UsageError(f"{url}/health shows no detail to this key: a kvfence server with a tenants file shows it "
                         "only to an admin key; pass one with --key")
    try:
        if isinstance(health, dict) and "mode" in health:
            source = f"kvfence ({health['mode']}, status {health.get('status')!r}) at {url}"
            return source, kvfence_nodes(url, health, page_size, max_context)
        info = sglang_server_info(url, key, timeout)
        return f"SGLang {info.get('version', '')} at {url}", sglang_nodes(url, info, key, timeout, max_context)
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"unexpected server info from {url}: {type(e).__name__} {e}") from e


def kvfence_nodes(url: str, health: dict, page_size: int, max_context: int | None) -> list[NodeCheck]:
    """Nodes from a kvfence ``/health``. A worker must hold the larger of the router's and its own context.

    Workers report their configured pool but no page size: ``page_size`` rounds it down to whole pages unless
    a worker reports ``page_size`` itself.
    """
    if health["mode"] == "colocated":
        context = max_context or health["max_context"]
        return [NodeCheck("colocated", urlparse(url).netloc, health["kv_pool_tokens"], context, page_size)]
    workers = health.get("workers") or {}
    if not workers:
        raise UsageError(f"no workers have joined the kvfence router at {url} yet (status: {health.get('status')})")
    nodes = []
    for wid, w in sorted(workers.items(), key=lambda kv: (kv[1]["role"] != "prefill", kv[0])):
        ps = w.get("page_size", page_size)
        context = max_context or max(health["max_context"], w["max_context"])
        nodes.append(NodeCheck(w["role"], wid, usable_pool_tokens(w["pool_tokens"], ps), context, ps))
    return nodes


# SGLang's server info, as read in sgl-project/sglang:
# - python/sglang/srt/entrypoints/http_server.py: GET /get_server_info (newer versions: /server_info, the old
#   path kept as an alias) returns ``dataclasses.asdict(server_args)`` merged with ``scheduler_info`` and
#   ``internal_states``; GET /v1/models returns cards with ``max_model_len`` (``model_config.context_len``).
# - python/sglang/srt/managers/scheduler.py, ``get_init_info``: scheduler_info holds ``max_total_num_tokens`` (the
#   KV pool in tokens) and ``max_req_input_len``.
# - python/sglang/srt/server_args.py: ``context_length`` (None unless set), ``page_size``, ``disaggregation_mode``
#   ("null" | "prefill" | "decode"), ``host``, ``port``.
# - python/sglang/srt/disaggregation/mini_lb.py: the PD load balancer's /get_server_info returns
#   ``{"prefill": [info, ...], "decode": [info, ...], ...}``, one server info per backend.
SGLANG_INFO_PATHS = ("/server_info", "/get_server_info")


def sglang_server_info(url: str, key: str | None, timeout: float) -> dict:
    """The server info of the SGLang server (or PD load balancer) at ``url``."""
    for path in SGLANG_INFO_PATHS:
        status, body = fetch_json(url + path, key, timeout)
        if status in (401, 403):
            raise UsageError(f"{url}{path} answered {status}: pass the server's API key with --key")
        if status == 200 and isinstance(body, dict):
            return body
    raise UsageError(f"{url} is neither a kvfence server (its /health has no 'mode') nor an SGLang server "
                     f"(no JSON at {' or '.join(SGLANG_INFO_PATHS)})")


def sglang_nodes(url: str, info: dict, key: str | None, timeout: float, max_context: int | None) -> list[NodeCheck]:
    """Nodes from SGLang server info: one per backend of a PD load balancer, else the one server."""
    if isinstance(info.get("prefill"), list) or isinstance(info.get("decode"), list):
        entries = [(role, f"{role}-{i}", e) for role in ("prefill", "decode") for i, e in enumerate(info.get(role, []))]
    else:
        mode = info.get("disaggregation_mode") or "null"
        entries = [("colocated" if mode == "null" else mode, urlparse(url).netloc, info)]
    served_context = functools.cache(lambda: sglang_model_context(url, key, timeout))
    nodes = []
    for role, fallback_name, e in entries:
        name = f"{e['host']}:{e['port']}" if e.get("host") and e.get("port") else fallback_name
        ps = e.get("page_size") or 1
        context = max_context or e.get("context_length") or served_context()
        nodes.append(NodeCheck(role, name, usable_pool_tokens(e["max_total_num_tokens"], ps), context, ps))
    return nodes


def sglang_model_context(url: str, key: str | None, timeout: float) -> int:
    """The context length SGLang serves when started without ``--context-length``: /v1/models ``max_model_len``."""
    status, body = fetch_json(url + "/v1/models", key, timeout)
    cards = body.get("data") if isinstance(body, dict) else None
    if status == 200 and cards and cards[0].get("max_model_len"):
        return int(cards[0]["max_model_len"])
    raise UsageError(f"SGLang at {url} reports no context_length and no /v1/models max_model_len: "
                     "pass the context it serves with --max-context")


# -- report ---------------------------------------------------------------------------------------------


def report_table(sources: list[str], nodes: list[NodeCheck]) -> str:
    """A table with one row per node, then a summary line and one fix per distinct undersized pool."""
    rows = [("role", "node", "pool tokens", "context", "verdict")]
    rows += [(n.role, n.node, f"{n.pool_tokens:,}", f"{n.max_context:,}",
              "OK" if n.ok else f"UNDERSIZED ({n.shortfall:,} short)") for n in nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"audit: {s}" for s in sources]
    for r in rows:
        lines.append(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}")
    bad = [n for n in nodes if not n.ok]
    if not bad:
        lines.append(f"OK: all {len(nodes)} nodes hold one request of the full context")
        return "\n".join(lines)
    lines.append(f"UNDERSIZED: {len(bad)} of {len(nodes)} nodes cannot hold one request of the full context "
                 "(L0 preflight would refuse to start them)")
    lines += [f"fix ({role}): {fix}" for role, fix in dict.fromkeys((n.role, n.fix) for n in bad)]
    return "\n".join(lines)


def report_json(sources: list[str], nodes: list[NodeCheck]) -> str:
    return json.dumps({"ok": all(n.ok for n in nodes), "sources": sources,
                       "nodes": [asdict(n) | {"ok": n.ok, "shortfall": n.shortfall, "fix": n.fix} for n in nodes]},
                      indent=2)


# -- command ---------------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def add_audit_parser(sub) -> None:
    p = sub.add_parser(
        "audit", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="check that every node's KV pool holds one request of the full context (L0 preflight)",
        description="Check, before a deployment or against a running one, that every prefill, decode or colocated "
                    "node's usable KV pool (whole pages) holds one request of the full context it serves.\n"
                    "The incident this prevents: a prefill KV pool of 681,280 tokens served a 1,048,576-token "
                    "context.\n\n"
                    "Three forms:\n"
                    "  kvfence audit [--model M] [--max-context N] [--prefill N --decode M] [pool flags]\n"
                    f"      a planned deployment, with kvfence serve's defaults (pool {POOL_DEFAULTS})\n"
                    "  kvfence audit --url http://HOST:PORT [--key KEY]\n"
                    "      a running kvfence server (its /health) or SGLang server or PD load balancer (its server\n"
                    "      info), told apart automatically; repeat --url to audit several servers together\n\n"
                    "Exit status: 0 every node holds the context, 1 some node is undersized, 2 usage or "
                    "connection error.")
    plan = p.add_argument_group("a planned deployment (without --url)")
    plan.add_argument("--model", default="smollm2-135m", help="as for kvfence serve; only its metadata is read")
    plan.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bfloat16", help="KV cache precision")
    plan.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    plan.add_argument("--prefill", type=non_negative_int, metavar="N", default=1, help="prefill workers")
    plan.add_argument("--decode", type=non_negative_int, metavar="N", default=1, help="decode workers")
    pool = p.add_argument_group("pools (without --url): tokens or memory per node; a role's own flag wins")
    pool.add_argument("--kv-pool-tokens", type=non_negative_int, metavar="N",
                      help=f"every node's pool in tokens (default: {POOL_DEFAULTS})")
    pool.add_argument("--prefill-pool-tokens", type=non_negative_int, metavar="N")
    pool.add_argument("--decode-pool-tokens", type=non_negative_int, metavar="N")
    pool.add_argument("--pool-memory", type=parse_bytes, metavar="SIZE",
                      help="every node's pool region in bytes, e.g. 512MiB, 2GiB (K/V plus page tags)")
    pool.add_argument("--prefill-pool-memory", type=parse_bytes, metavar="SIZE")
    pool.add_argument("--decode-pool-memory", type=parse_bytes, metavar="SIZE")
    both = p.add_argument_group("either form")
    both.add_argument("--max-context", type=positive_int, default=None, metavar="N",
                      help="the context served (default: the model's; with --url: what the server reports)")
    both.add_argument("--page-size", type=positive_int, default=16, metavar="N",
                      help="tokens per KV page (with --url: for kvfence workers, which do not report it)")
    both.add_argument("--json", action="store_true", help="print JSON instead of a table")
    url = p.add_argument_group("a running server")
    url.add_argument("--url", action="append", default=[], metavar="URL",
                     help="http://HOST:PORT of a kvfence or SGLang server; repeat for several servers")
    url.add_argument("--key", default=None, help="API key, sent as 'Authorization: Bearer KEY'")
    url.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each HTTP answer")
    p.set_defaults(func=cmd_audit)


POOL_DESTS = ("kv_pool_tokens", "prefill_pool_tokens", "decode_pool_tokens", "pool_memory", "prefill_pool_memory",
              "decode_pool_memory")


def collect(args: argparse.Namespace) -> tuple[list[str], list[NodeCheck]]:
    """``(sources, nodes)`` to audit: the servers at ``--url``, else the deployment the flags describe."""
    if not args.url:
        source, nodes = planned_nodes(args)
        return [source], nodes
    if any(getattr(args, d) is not None for d in POOL_DESTS):
        raise UsageError("pool flags describe a planned deployment; with --url the servers report their pools")
    sources, nodes = [], []
    for url in args.url:
        source, found = server_nodes(url, args.key, args.timeout, args.page_size, args.max_context)
        sources.append(source)
        nodes += found
    return sources, nodes


def cmd_audit(args: argparse.Namespace) -> int:
    try:
        sources, nodes = collect(args)
        if not nodes:
            raise UsageError("no nodes to audit")
    except UsageError as e:
        print(f"kvfence audit: {e}", file=sys.stderr)
        return 2
    print(report_json(sources, nodes) if args.json else report_table(sources, nodes))
    return 0 if all(n.ok for n in nodes) else 1
