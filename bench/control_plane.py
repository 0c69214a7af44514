"""What CurveZMQ costs a control message: plain ZeroMQ vs the cluster's CURVE sockets, one PUSH -> PULL link.

Output messages stream once per generated token per request, so they are the
control plane's bulk. The sender runs in a spawned process (as a decode worker
does) and sends bursts of a typical one-token ``Output``; this process receives
them (as the router does). Each round times both variants, in alternating
order; the figures are medians over rounds of wall time per message and of the
CPU time both processes spent per message (ZeroMQ's I/O threads included, where
the encryption runs).

    .venv/bin/python bench/control_plane.py [--messages 20000] [--rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfence.channel import Channel, connect_push  # noqa: E402
from kvfence.cluster import ClusterKey  # noqa: E402
from kvfence.protocol.messages import Output, encode_message  # noqa: E402

MESSAGE = encode_message("tcp://10.0.0.2:5551", Output(2**127 + 12345, [1234], " token", completion_tokens=17))


def sender(address: str, key: ClusterKey | None, messages: int, go, done) -> None:
    ctx = zmq.Context()
    sock = connect_push(ctx, address, key)
    sock.send(b"ready")  # the receiver starts the clock once this arrived: connected, handshake done
    go.wait()
    t0 = time.process_time()
    for _ in range(messages):
        sock.send(MESSAGE)
    sock.close(linger=-1)
    ctx.term()  # every message handed to the kernel: the I/O thread's work is in
    done.put(time.process_time() - t0)


def one_burst(key: ClusterKey | None, messages: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of both processes) to move ``messages`` over a fresh, connected link."""
    inbox = Channel("tcp://127.0.0.1:0", key=key)
    ctx = mp.get_context("spawn")
    go, done = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=sender, args=(inbox.me, key, messages, go, done))
    proc.start()
    inbox.inbox.recv()  # the sender's "ready"
    c0, t0 = time.process_time(), time.perf_counter()
    go.set()
    for _ in range(messages):
        inbox.inbox.recv()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0 + done.get()
    proc.join()
    inbox.close()
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    variants = {"plain": None, "curve": ClusterKey.generate()}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for r in range(args.rounds + 1):
        order = list(variants) if r % 2 else list(reversed(variants))
        for name in order:
            result = one_burst(variants[name], args.messages)
            if r:  # the first round warms up
                samples[name].append(result)
    us = {name: {"wall_us": statistics.median(w for w, _ in s) / args.messages * 1e6,
                 "cpu_us": statistics.median(c for _, c in s) / args.messages * 1e6} for name, s in samples.items()}
    print(f"{len(MESSAGE)}-byte Output messages, {args.messages} per burst, medians of {args.rounds} rounds")
    print("| variant | wall us/msg | CPU us/msg (both processes) |\n|---|---|---|")
    for name, v in us.items():
        print(f"| {name} | {v['wall_us']:.2f} | {v['cpu_us']:.2f} |")
    print(f"curve/plain: wall {us['curve']['wall_us'] / us['plain']['wall_us']:.2f}x, "
          f"CPU {us['curve']['cpu_us'] / us['plain']['cpu_us']:.2f}x; "
          f"extra CPU {us['curve']['cpu_us'] - us['plain']['cpu_us']:.2f} us per message")
    if args.json:
        meta = {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                "zmq": zmq.zmq_version(), "messages": args.messages, "rounds": args.rounds, "bytes": len(MESSAGE)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "us_per_message": us}, indent=2) + "\n")


if __name__ == "__main__":
    main()
