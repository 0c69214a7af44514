"""``kvfence verify``: the exhaustive check of the transfer protocol, from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time

from kvfence.safety import LAYERS, Safety
from kvfence.verify.cache import DEFAULT_CACHE_REQUESTS, CacheConfig, CacheRequest
from kvfence.verify.world import DECODE, FAULT_ORDER, PREFILL, CheckConfig, Faults, RequestSpec

DEFAULT_REQUESTS = "C=bob:5+2,A=alice:4+2,B=bob:4+2"
FAULT_HELP = {
    "drop": "lose a control message (between live processes: beyond what ZeroMQ over TCP does)",
    "dup": "deliver a control message twice (beyond what ZeroMQ does)",
    "crash": "kill a worker; the router notices, the supervisor restarts it",
    "disconnect": "a client leaves before its request ends",
    "fail": "a data-plane write fails and the runner sees the error",
    "lose": "a data-plane write reports success but never lands",
    "short": "the prefill runner computes one token fewer than the prompt (an engine bug like the incident's)",
    "corrupt": "a data-plane write lands with corrupted bytes",
    "fence": "the router declares a live worker dead (paused past --worker-timeout) and fences it; it runs on, "
             "then learns it was fenced and rejoins",
}
DEFAULT_FAULTS = Faults()
DEFAULT_CACHE = CacheConfig()


def add_verify_parser(sub) -> None:
    p = sub.add_parser(
        "verify", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="model-check the prefill/decode transfer protocol exhaustively (the real protocol cores)",
        description="Explore breadth-first every state that the real router, prefill and decode protocol cores "
                    "can reach in a small configuration, under an environment that reorders, delays, duplicates "
                    "and drops messages, crashes workers, disconnects clients, and lands, fails or loses KV "
                    "writes in any order. Checks the invariants I1-I7 (docs/protocol.md; I7: fencing) in every "
                    "state and prints a shortest trace to any violation. Then the same for the page bookkeeping "
                    "of the prefix cache (the real PageTable, PrefixCache and Scheduler; invariants C1-C6): "
                    "--cache runs only that, --no-cache skips it. Exit status: 0 no violation, 1 violation, "
                    "2 stopped at --max-states.")
    g = p.add_argument_group("configuration")
    g.add_argument("--requests", default=DEFAULT_REQUESTS,
                   help="NAME=TENANT:PROMPT+MAX_TOKENS, comma separated, in arrival order")
    g.add_argument("--arrival", choices=("ordered", "any"), default="ordered",
                   help="ordered: clients submit in the order given (any other event may come between); "
                        "any: in every order")
    g.add_argument("--pages", type=int, default=3, help="decode KV pool pages")
    g.add_argument("--page-size", type=int, default=2, help="tokens per page")
    g.add_argument("--max-context", type=int, default=6, help="context limit of router and workers")
    g.add_argument("--prefill-pool-tokens", type=int, default=0, help="prefill KV pool in tokens; 0: the max context")
    g.add_argument("--prefill-max-context", type=int, default=0,
                   help="the prefill worker's own context limit; 0: the max context (less: a misconfigured prefill)")
    g.add_argument("--network", choices=("fifo", "any"), default="fifo",
                   help="fifo: each sender->receiver channel keeps its order, as ZeroMQ does; any: every message "
                        "may overtake every other")
    g.add_argument("--timing", choices=("bounded", "async"), default="bounded",
                   help="bounded: a message in flight arrives before any timeout fires (or is lost); async: "
                        "timeouts may fire while messages are still on their way")
    g.add_argument("--unsafe", default="none", metavar="LAYER[,LAYER]",
                   help=f"switch safety layers off inside the explored cores: {', '.join(LAYERS)}, all")
    g.add_argument("--emulate-incident", action="store_true",
                   help="prefill replaces an over-length prompt by a 1-token placeholder when admission is off")
    f = p.add_argument_group("faults (how many of each the environment may cause in one run)")
    for name in FAULT_ORDER:
        f.add_argument(f"--{name}", type=int, default=getattr(DEFAULT_FAULTS, name), metavar="N",
                       help=FAULT_HELP[name])
    f.add_argument("--max-faults", type=int, default=DEFAULT_FAULTS.total, metavar="N",
                   help="faults of any kind in one run, at most")
    f.add_argument("--crash-roles", default="prefill,decode", help="which workers may crash")
    f.add_argument("--quick-restart", action="store_true",
                   help="a crashed worker may restart before the router notices its death (a remote worker "
                        "back within the heartbeat timeout), so the router never calls worker_down for it")
    e = p.add_argument_group("exploration")
    e.add_argument("--max-states", type=int, default=2_000_000, help="stop after this many states")
    e.add_argument("--no-liveness", action="store_true",
                   help="skip the graph check that every request can still end from every state")
    e.add_argument("--progress", action="store_true", help="show progress on stderr")
    e.add_argument("--check", default="all", metavar="I1,I6",
                   help="count only these invariants; all: I1-I7 and E (a core raising)")
    e.add_argument("--json", action="store_true", help="print the results as one JSON object")
    add_cache_arguments(p)
    p.set_defaults(func=cmd_verify)


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("prefix-cache pages (kvfence/verify/cache.py)")
    which = c.add_mutually_exclusive_group()
    which.add_argument("--cache", action="store_true", help="check only the prefix cache's page bookkeeping")
    which.add_argument("--no-cache", action="store_true", help="skip the prefix cache's page bookkeeping")
    c.add_argument("--cache-requests", default=format_cache_requests(DEFAULT_CACHE_REQUESTS),
                   help="NAME=TENANT[/SALT]:TOKEN.TOKEN...+MAX_TOKENS[xN], comma separated, in arrival order")
    c.add_argument("--cache-pages", type=int, default=DEFAULT_CACHE.pages, help="KV pool pages")
    c.add_argument("--cache-page-size", type=int, default=DEFAULT_CACHE.page_size, help="tokens per page")
    c.add_argument("--cache-arrival", choices=("ordered", "any"), default=DEFAULT_CACHE.arrival,
                   help="ordered: requests arrive in the order given (other events may come between); any: in "
                        "every order")
    c.add_argument("--cache-evict-any-time", action="store_true",
                   help="the cache may also evict a page no request holds at any point, not only for room")
    c.add_argument("--cache-max-preemptions", type=int, default=DEFAULT_CACHE.max_preemptions,
                   help="runs with more preemptions are cut off (bounds the state space)")
    c.add_argument("--cache-max-states", type=int, default=500_000, help="stop after this many states")
    c.add_argument("--cache-published", default="", metavar="TOKEN.TOKEN...",
                   help="a prefix an admin published: prompts that start with it read its pages across tenants")
    c.add_argument("--cache-mutant", choices=("careless-evict", "overmark-public"), default=None,
                   help="test-only mutation: eviction that ignores refcounts (must be caught as C2), or a router "
                        "that marks whole prompts public (C3, with --cache-published)")


def format_cache_requests(requests: tuple[CacheRequest, ...]) -> str:
    return ",".join(r.describe() for r in requests)


def parse_cache_requests(text: str) -> tuple[CacheRequest, ...]:
    specs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"(\w+)=(\w[\w-]*)(?:/([\w-]+))?:(\d+(?:\.\d+)*)\+(\d+)(?:x(\d+))?", item)
        if m is None:
            raise argparse.ArgumentTypeError(f"bad request {item!r}: want NAME=TENANT[/SALT]:1.2.3+MAX_TOKENS[xN]")
        name, tenant, salt, prompt, max_tokens, n = m.groups()
        specs.append(CacheRequest(name, tenant, tuple(map(int, prompt.split("."))), int(max_tokens),
                                  n=int(n or 1), salt=salt))
    return tuple(specs)


def cache_config_from_args(args: argparse.Namespace) -> CacheConfig:
    return dataclasses.replace(
        DEFAULT_CACHE, requests=parse_cache_requests(args.cache_requests), pages=args.cache_pages,
        page_size=args.cache_page_size, chunk_size=args.cache_page_size, step_tokens=args.cache_page_size,
        arrival=args.cache_arrival, evict_any_time=args.cache_evict_any_time,
        max_preemptions=args.cache_max_preemptions, careless_evict=args.cache_mutant == "careless-evict",
        published=tuple(int(t) for t in args.cache_published.split(".") if t),
        overmark_public=args.cache_mutant == "overmark-public",
        safety=Safety.from_env("" if args.unsafe == "none" else args.unsafe))


def parse_requests(text: str) -> tuple[RequestSpec, ...]:
    specs = []
    for i, item in enumerate(filter(None, (s.strip() for s in text.split(",")))):
        m = re.fullmatch(r"(\w+)=(\w[\w-]*):(\d+)\+(\d+)", item)
        if m is None:
            raise argparse.ArgumentTypeError(f"bad request {item!r}: want NAME=TENANT:PROMPT+MAX_TOKENS")
        name, tenant, prompt, max_tokens = m.groups()
        specs.append(RequestSpec(name, tenant, int(prompt), int(max_tokens), rid=i + 1))
    return tuple(specs)


def config_from_args(args: argparse.Namespace) -> CheckConfig:
    roles = {"prefill": PREFILL, "decode": DECODE}
    crash_roles = tuple(roles[r.strip()] for r in args.crash_roles.split(",") if r.strip())
    faults = Faults(**{name: getattr(args, name) for name in FAULT_ORDER}, total=args.max_faults)
    return CheckConfig(
        requests=parse_requests(args.requests), pages=args.pages, page_size=args.page_size,
        max_context=args.max_context, prefill_pool_tokens=args.prefill_pool_tokens or args.max_context,
        prefill_max_context=args.prefill_max_context,
        faults=faults, network=args.network, timing=args.timing, arrival=args.arrival, crash_roles=crash_roles,
        quick_restart=args.quick_restart,
        safety=Safety.from_env("" if args.unsafe == "none" else args.unsafe), emulate_incident=args.emulate_incident)


def progress_printer(stream=sys.stderr):
    """A progress callback for ``explore``: one line, rewritten in place on a terminal."""
    tty = stream.isatty()
    last = [0.0]

    def show(res, frontier: int) -> None:
        now = time.monotonic()
        if now - last[0] < 0.5 and tty:
            return
        last[0] = now
        rate = res.states / res.seconds if res.seconds else 0.0
        line = (f"  {res.states:>10,} states  depth {res.depth:>3}  frontier {frontier:>9,}  "
                f"{rate:>7,.0f} states/s  {res.seconds:>6.0f}s")
        stream.write(("\r" + line) if tty else line + "\n")
        stream.flush()

    return show


def cmd_verify(args: argparse.Namespace) -> int:
    """Run the protocol check and the prefix-cache check (or one of them); print each report (or JSON)."""
    results = {}
    if not args.cache:
        results["protocol"] = _verify_protocol(args)
    if not args.no_cache:
        from kvfence.verify.cache import explore_cache

        results["cache"] = explore_cache(cache_config_from_args(args), max_states=args.cache_max_states)
    if args.json:
        print(json.dumps({name: _as_dict(res) for name, res in results.items()}, indent=2))
    else:
        print("\n\n".join(res.report() for res in results.values()))
    if any(res.violation is not None for res in results.values()):
        return 1
    return 0 if all(res.complete for res in results.values()) else 2


def _verify_protocol(args: argparse.Namespace):
    from kvfence.verify.explorer import explore

    cfg = config_from_args(args)
    show = progress_printer() if args.progress else None
    wanted = None if args.check == "all" else frozenset(i.strip().upper() for i in args.check.split(",") if i.strip())
    result = explore(cfg, max_states=args.max_states, liveness=not args.no_liveness, progress=show,
                     invariants=wanted)
    if show is not None and sys.stderr.isatty():
        sys.stderr.write("\n")
    return result


def _as_dict(res) -> dict:
    """A result (either check's) as JSON-ready data: counts, time, completeness, the violation and its trace."""
    if hasattr(res, "as_dict"):
        return res.as_dict()
    v = res.violation
    return {"states": res.states, "transitions": res.transitions, "depth": res.depth,
            "seconds": round(res.seconds, 3), "complete": res.complete, "quiescent": res.quiescent,
            "violation": None if v is None else {"invariant": v.invariant, "message": v.message,
                                                 "trace": [step.lines for step in res.trace]}}
