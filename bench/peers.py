"""kvfence beside vLLM's CPU build and llama.cpp's llama-server, on the same weights, the same load, in one run.

Each server is started alone and timed to healthy, then all stay up (idle) while the load of ``bench/serve.py``
(closed loop, streaming, greedy, unique ~204-token prompts, 128 output tokens) visits them one at a time: per
concurrency level and repeat, every server takes its turn, in an order that rotates each repeat, so drift on a
shared host hits all alike. Idle servers are checked to stay idle. Then one ~2,000-token prompt each (prefill
tok/s = prompt tokens / TTFT), the process tree's memory (peak RSS and PSS over the run), the host's read bandwidth
and kvfence's batch-1 decode against the limit it sets, and the issue #20 targets, each with its margin.

The peers come from ``../shared/peers/peer`` (``peer setup vllm`` and ``peer setup llama`` once per machine):

    .venv/bin/python bench/peers.py             # kvfence, kvfence-colocated, vllm, llama-bf16, llama-q4_1
    .venv/bin/python bench/peers.py --servers kvfence,kvfence-avx512,kvfence-avx2,vllm,llama-bf16
    .venv/bin/python bench/peers.py --servers kvfence,llama-bf16 --repeats 1 --concurrency 1 16

Writes JSON (``--json``) with the CPU model and flags, and prints the table that docs/performance.md opens with.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import serve as load  # noqa: E402  (bench/serve.py: the load generator)
from capabilities import TORCH_CAPS  # noqa: E402
from machine import cpu  # noqa: E402

PEER = ROOT.parent / "shared" / "peers" / "peer"
# kvfence's variants: serve arguments and environment. The forced flavours run an AMX host's kvfence (torch capped
# too) as a CPU without AMX would (the peers keep what they found: a conservative comparison).
KVFENCE: dict[str, tuple[list[str], dict[str, str]]] = {
    "kvfence": ([], {}),
    "kvfence-colocated": (["--mode", "colocated"], {}),
    **{f"kvfence-{f}": ([], {"KVFENCE_CPU": f, **caps}) for f, caps in TORCH_CAPS.items()},
}
# llama.cpp repacks Q4_1 weights for AMX where the CPU has it, and that build dies of SIGILL at start on this project's
# Xeon guests; with repacking off it runs Q4_1 on its AVX-512 kernels
PEER_ENV = {"llama-q4_1": {"LLAMA_ARG_REPACK": "0"}} if "amx_int8" in Path("/proc/cpuinfo").read_text() else {}
DEFAULT_SERVERS = ("kvfence", "kvfence-colocated", "vllm", "llama-bf16", "llama-q4_1")
PEERS = ("vllm", "llama-bf16", "llama-q4_1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def memory_mib(pids: list[int]) -> tuple[float, float]:
    """(RSS, PSS) summed over ``pids``, MiB. RSS counts shared libraries and memory once per process; PSS splits
    them between the processes that map them."""
    rss = pss = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            continue
    return rss / 1024, pss / 1024


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far."""
    total = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    """One server under test: started in its own session, stopped with its process group."""

    name: str
    args: list[str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    pids: list[int] = field(default_factory=list)  # the process tree, once healthy
    ready_s: float = float("nan")
    rss_mib: float = 0.0
    pss_mib: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> None:
        env = dict(os.environ)
        if self.name in KVFENCE:
            args, extra = KVFENCE[self.name]
            cmd = [sys.executable, "-m", "kvfence.cli", "serve", "--port", str(self.port), *args, *self.args]
            env |= extra
        else:
            cmd = [str(PEER), "serve", self.name, str(self.port)]
            env |= PEER_ENV.get(self.name, {})
        log = open(Path("/tmp") / f"bench-peers-{self.name}.log", "w")  # noqa: SIM115
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.ready_s = time.perf_counter() - t0
                    self.pids = tree(self.proc.pid)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy in {timeout:.0f} s; see {log.name}")

    def sample_memory(self) -> None:
        rss, pss = memory_mib(self.pids)
        self.rss_mib, self.pss_mib = max(self.rss_mib, rss), max(self.pss_mib, pss)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def idle_cpu(servers: list[Server], seconds: float = 3.0) -> dict[str, float]:
    """Fraction of one core each server burns while nothing is asked of it."""
    before = {s.name: cpu_seconds(s.pids) for s in servers}
    time.sleep(seconds)
    return {s.name: (cpu_seconds(s.pids) - before[s.name]) / seconds for s in servers}


def bandwidth_limit() -> dict:
    """The host's read bandwidth, the batch-1 decode limit it sets for kvfence's default model, and that model's
    batch-1 decode in this process: the engine alone, with no router, HTTP or client on the cores (a 128-token
    prompt, 128 tokens). Bandwidth and decode alternate three times, best of each, after the servers have stopped."""
    import torch
    from decode import KvfenceRunner, memory_bandwidth_gbs, weight_bytes_per_token

    from kvfence.model.loader import load_model
    from kvfence.model.memory import freeze_loaded_objects

    loaded = load_model("smollm2-135m", dtype=torch.bfloat16, device="cpu")
    engine = KvfenceRunner(loaded, torch.bfloat16, "cpu")
    loaded.model.backend.prepare_decode_rows()
    freeze_loaded_objects()
    gbs, decode = [], []
    for _ in range(3):
        gbs.append(memory_bandwidth_gbs("cpu"))
        decode.append(engine.decode_tok_s(1, 128))
    wbytes = weight_bytes_per_token(loaded.model)
    return {"read_gb_s": max(gbs), "weight_bytes_per_token": wbytes, "batch1_limit_tok_s": max(gbs) * 1e9 / wbytes,
            "engine_batch1_tok_s": max(decode)}


def sample_memory(servers: list[Server], stop: threading.Event) -> None:
    """Every half second until ``stop``: each server's peak memory (a peak between runs would be missed)."""
    while not stop.wait(0.5):
        for s in servers:
            s.sample_memory()


def run(args: argparse.Namespace) -> dict:
    servers = [Server(name, args.server_args.split() if name in KVFENCE else []) for name in args.servers]
    stop_sampling = threading.Event()
    try:
        for s in servers:
            print(f"starting {s.name}...", file=sys.stderr, flush=True)
            s.start(args.start_timeout)
            s.sample_memory()
            print(f"  {s.name} healthy in {s.ready_s:.1f} s, RSS {s.rss_mib:.0f} MiB", file=sys.stderr, flush=True)
        clients = {s.name: load.Client(s.url + "/v1", None, "none") for s in servers}
        busy = {name: round(frac, 2) for name, frac in idle_cpu(servers).items() if frac > 0.05}
        if busy:
            print(f"WARNING: servers busy while idle (fraction of a core): {busy}", file=sys.stderr)
        threading.Thread(target=sample_memory, args=(servers, stop_sampling), daemon=True).start()
        words = {name: load.calibrate(c, args.prompt_tokens) for name, c in clients.items()}
        levels, next_id = [], 1
        for conc in args.concurrency:
            n = args.requests or max(4, 2 * conc)
            runs: dict[str, list[load.Run]] = {s.name: [] for s in servers}
            for rep in range(args.repeats):
                for s in servers[rep % len(servers):] + servers[: rep % len(servers)]:
                    r = asyncio.run(load.closed_loop(clients[s.name], s.name, conc, n, words[s.name],
                                                     args.max_tokens, next_id))
                    next_id += n
                    runs[s.name].append(r)
                    print(f"  {s.name} c={conc} run {rep + 1}/{args.repeats}: {r.output_tok_s:.1f} tok/s, TTFT p99 "
                          f"{r.ttft_p99:.2f} s, {r.failures} failed", file=sys.stderr, flush=True)
            levels += [load.median_run(r) for r in runs.values()]
        prefill = {}
        for s in servers if args.long_prompt else []:  # best of --repeats: one prompt is at the host's mercy
            words = load.calibrate(clients[s.name], args.long_prompt)
            prefill[s.name] = min((load.long_prompt(clients[s.name], args.long_prompt, rep, words)
                                   for rep in range(args.repeats)), key=lambda p: p["ttft_s"])
            print(f"  {s.name}: {prefill[s.name]['prompt_tokens']}-token prompt, TTFT {prefill[s.name]['ttft_s']:.2f} "
                  "s", file=sys.stderr, flush=True)
    finally:
        stop_sampling.set()
        for s in servers:
            s.stop()
    memory = {s.name: {"ready_s": s.ready_s, "rss_mib": s.rss_mib, "pss_mib": s.pss_mib} for s in servers}
    return {"levels": levels, "long_prompt": prefill, "servers": memory}


def level(report: dict, name: str, conc: int) -> dict | None:
    return next((lv for lv in report["levels"] if lv["label"] == name and lv["concurrency"] == conc), None)


def targets(report: dict, ours: str) -> list[dict]:
    """Issue #20's targets for server ``ours``, each with the figure, the bar and whether it holds."""
    peers = [n for n in report["servers"] if n not in KVFENCE]
    out = []

    def add(what: str, value: float, bar: float, higher: bool) -> None:
        out.append({"target": what, "value": value, "bar": bar, "met": value >= bar if higher else value <= bar})

    def best_peer(conc: int, key: str, pick) -> float | None:
        rows = [level(report, p, conc) for p in peers]
        return pick(r[key] for r in rows) if peers and all(rows) and level(report, ours, conc) else None

    for conc in (1, 16, 32):
        if (best := best_peer(conc, "output_tok_s", max)) is not None:
            add(f"output tok/s c={conc} >= 1.2x best peer", level(report, ours, conc)["output_tok_s"], 1.2 * best,
                True)
    if (best := best_peer(16, "ttft_p99", min)) is not None:
        add("p99 TTFT c=16 (s) <= best peer", level(report, ours, 16)["ttft_p99"], best, False)
    long = report["long_prompt"]
    if ours in long and peers and all(p in long for p in peers):
        add("~2k prefill tok/s >= 1.2x best peer", long[ours]["prefill_tok_s"],
            1.2 * max(long[p]["prefill_tok_s"] for p in peers), True)
    add("RSS (MiB) < 1536", report["servers"][ours]["rss_mib"], 1536, False)
    add("healthy (s) <= 20", report["servers"][ours]["ready_s"], 20, False)
    bandwidth = report.get("bandwidth")
    if bandwidth and level(report, ours, 1):
        add("batch-1 decode tok/s (1 / TPOT at c=1) >= 85% of the read-bandwidth limit",
            1 / level(report, ours, 1)["tpot_mean"], 0.85 * bandwidth["batch1_limit_tok_s"], True)
    if bandwidth and ours == "kvfence" and "engine_batch1_tok_s" in bandwidth:  # the host's own flavour
        add("batch-1 decode tok/s of the engine in process >= 85% of that limit", bandwidth["engine_batch1_tok_s"],
            0.85 * bandwidth["batch1_limit_tok_s"], True)
    return out


def print_report(report: dict) -> None:
    c = report["cpu"]
    print(f"\n{c['model']}, {c['cores']} cores; flags {' '.join(c['flags'])}")
    concs = report["workload"]["concurrency"]
    head = "".join(f"{'c=' + str(x):>9}" for x in concs)
    print(f"{'server':<19}{head}{'p99 TTFT c=16':>15}{'2k prefill':>12}{'RSS MiB':>9}{'PSS MiB':>9}{'ready':>7}")
    for name, mem in report["servers"].items():
        cells = "".join(f"{lv['output_tok_s']:>9.0f}" if (lv := level(report, name, x)) else f"{'-':>9}"
                        for x in concs)
        p99 = f"{lv['ttft_p99']:.2f} s" if (lv := level(report, name, 16)) else "-"
        pf = report["long_prompt"].get(name)
        prefill = f"{pf['prefill_tok_s']:.0f} tok/s" if pf else "-"
        print(f"{name:<19}{cells}{p99:>15}{prefill:>12}{mem['rss_mib']:>9.0f}{mem['pss_mib']:>9.0f}"
              f"{mem['ready_s']:>6.1f}s")
    if "bandwidth" in report:
        b = report["bandwidth"]
        print(f"read bandwidth {b['read_gb_s']:.1f} GB/s, {b['weight_bytes_per_token'] / 1e6:.0f} MB of weights per "
              f"token: batch-1 limit {b['batch1_limit_tok_s']:.0f} tok/s; kvfence's engine in process "
              f"{b.get('engine_batch1_tok_s', 0):.0f} tok/s")
    for name, rows in report["targets"].items():
        print(f"{name} against issue #20's targets:")
        for t in rows:
            print(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']:.2f} against {t['bar']:.2f} "
                  f"({t['value'] / t['bar']:.2f}x the bar)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                    help=f"comma-separated, from {', '.join([*KVFENCE, *PEERS])}")
    ap.add_argument("--server-args", default="", help="extra 'kvfence serve' arguments")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--requests", type=int, help="requests per run (default: max(4, 2 x concurrency))")
    ap.add_argument("--repeats", type=int, default=3, help="runs per level and server; medians are reported")
    ap.add_argument("--prompt-tokens", type=int, default=204)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=2000, help="prefill check prompt tokens (0: skip)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--json", default="bench/results/peers.json")
    args = ap.parse_args()
    args.servers = args.servers.split(",")
    unknown = set(args.servers) - {*KVFENCE, *PEERS}
    if unknown:
        ap.error(f"unknown servers: {', '.join(sorted(unknown))}")
    if set(args.servers) & set(PEERS) and not PEER.exists():
        ap.error(f"{PEER} not found: the peers need ../shared/peers")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers started here stop too

    workload = ("prompt_tokens", "max_tokens", "repeats", "concurrency", "long_prompt", "server_args")
    report = {"cpu": cpu(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "workload": {k: getattr(args, k) for k in workload}}
    report |= run(args)
    if any(name in KVFENCE for name in args.servers):
        report["bandwidth"] = bandwidth_limit()
    report["targets"] = {name: targets(report, name) for name in args.servers if name in KVFENCE}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print_report(report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
