"""Data-plane throughput per backend, against memcpy and each backend's own raw baseline.

The target runs in another process (as in serving). For each size, every
round times, in rotating order:

- ``memcpy``: a plain ``memmove`` of the same size between two regions of this process;
- ``raw``: the backend's bare baseline. tcp: a loopback socket send/recv_into with a
  1-byte ack (same socket options); mooncake: one ``transfer_sync_write`` of one block;
  nixl: one single-descriptor WRITE request through NIXL's bindings (descriptor lists built per call, posted,
  polled to success, released), the calls kvfence's nixl write makes;
  shm: none (memcpy is its baseline);
- ``write``: a kvfence ``write`` of one contiguous segment;
- ``paged``: a kvfence ``write`` of the same bytes as ``--page``-sized segments
  (default: one 16-token page of SmolLM2-135M in bf16) scattered to permuted pages;
- ``sealed`` (tcp only): a kvfence ``write`` of one contiguous segment between cluster
  members over a sealed connection (AES-256-GCM records, as tcp does beyond loopback),
  to a second target process: what encrypting KV that crosses hosts costs against ``write``.

The variants interleave finely: a sample's repetitions run in 16 slices, each
slice running every variant in turn.

Two modes: ``hot`` moves the same bytes every repetition (small sizes stay in
cache), ``cold`` steps source and destination through a 64 MiB window (what
moving freshly computed pages looks like once they left the caches). Medians
over rounds; a first round warms up and is dropped.

Placements: where the scheduler puts the two processes decides a small write's
time on this 2-core machine, and it puts each of the target's threads (one per
connection: the raw baseline's and kvfence's) on its own, so unpinned runs can
time kvfence and its baseline in different conditions (a loopback 64 KiB
round trip takes ~15 us on one core, ~85 us across two, either of them when
unpinned). Each round therefore runs every variant in each placement, pinning
every thread of both processes: ``split`` puts the initiator on one CPU and the
target on another (as serving's prefill and decode workers), ``shared`` puts
both on one CPU (every microsecond either side spends shows). ``free`` pins
nothing.

    .venv/bin/python bench/transfer.py [--backends shm,tcp,mooncake,nixl] [--rounds 5] \\
        [--placements split,shared] [--json bench/results/transfer.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfence.transfer import BACKENDS, KVInitiator, PeerHandle, available, make_initiator  # noqa: E402
from kvfence.transfer.base import Region  # noqa: E402
from kvfence.transfer.harness import TargetProcess, pin_threads  # noqa: E402
from kvfence.transfer.tcp import _recv_exact, _tune  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
SIZES = (64 * KIB, 1 * MIB, 64 * MIB)
WINDOW = 64 * MIB  # regions on both sides; cold mode walks through all of it
SMOLLM2_PAGE = 16 * 30 * 2 * 3 * 64 * 2  # tokens x layers x (K,V) x kv_heads x head_dim x bf16 = 368,640 B
BYTES_PER_SAMPLE = 256 * MIB  # each timed sample moves about this much (at least 8 repetitions)
BLOCKS = 16  # slices of a sample, each running every variant in turn
MODES = ("hot", "cold")
PLACEMENTS = ("split", "shared", "free")
CPUS = sorted(os.sched_getaffinity(0))  # the CPUs this process may use, read before any pinning
Op = Callable[[int], None]  # one transfer of the variant's size at this source/destination offset


def reps_for(size: int) -> int:
    return max(8, min(1024, BYTES_PER_SAMPLE // size))


def offsets(mode: str, size: int, reps: int) -> list[int]:
    if mode == "hot":
        return [0] * reps
    slots = WINDOW // size
    return [(i % slots) * size for i in range(reps)]


def gbps(ops: dict[str, Op], size: int, offs: list[int], start: int) -> dict[str, float]:
    """GB/s of each op over ``offs``, interleaved: the offsets run in ``BLOCKS`` slices, and each slice runs every
    op in turn (the order rotating from slice to slice, from ``start``), so that a drift of the machine's speed
    lasting longer than a slice hits every op alike."""
    names = list(ops)
    spent = dict.fromkeys(names, 0.0)
    step = -(-len(offs) // BLOCKS)
    for b, lo in enumerate(range(0, len(offs), step)):
        block = offs[lo : lo + step]
        k = (start + b) % len(names)
        for name in names[k:] + names[:k]:
            op = ops[name]
            t = time.perf_counter()
            for off in block:
                op(off)
            spent[name] += time.perf_counter() - t
    return {name: size * len(offs) / spent[name] / 1e9 for name in names}


# ---------------------------------------------------------------------------- baselines


def memcpy_op(src: Region, dst: Region, size: int) -> Op:
    return lambda off: ctypes.memmove(dst.address + off, src.address + off, size)


def raw_tcp(target: TargetProcess, ini: KVInitiator, peer: PeerHandle) -> Callable[[int], Op]:
    sock = socket.create_connection(target.raw_sink())
    _tune(sock)
    local = ini.buffer

    def make(size: int) -> Op:
        def op(off: int) -> None:
            head = off.to_bytes(8, "little") + size.to_bytes(8, "little")
            if sock.sendmsg([head, local[off : off + size]]) != 16 + size:  # a blocking socket sends it all
                raise RuntimeError("raw tcp: partial send")
            _recv_exact(sock, 1)

        return op

    return make


def raw_mooncake(target: TargetProcess, ini: KVInitiator, peer: PeerHandle) -> Callable[[int], Op]:
    engine, src, dst = ini._engine, ini.region.address, peer.base

    def make(size: int) -> Op:
        def op(off: int) -> None:
            if engine.transfer_sync_write(peer.session, src + off, dst + off, size) != 0:
                raise RuntimeError("raw mooncake write failed")

        return op

    return make


def raw_nixl(target: TargetProcess, ini: KVInitiator, peer: PeerHandle) -> Callable[[int], Op]:
    """NIXL's bindings, as kvfence's nixl write calls them, with nothing around them."""
    core, dlist, op_write, src, dst = ini._core, ini._dlist, ini._write_op, ini.region.address, peer.base
    in_progress, success = ini._in_progress, ini._success

    def make(size: int) -> Op:
        def op(off: int) -> None:
            request = core.createXferReq(op_write, dlist([(src + off, size, 0)]), dlist([(dst + off, size, 0)]),
                                         peer.remote_name, b"", [])
            status = core.postXferReq(request, b"")
            while status == in_progress:
                status = core.getXferStatus(request)
            core.releaseXferReq(request)
            if status != success:
                raise RuntimeError(f"raw nixl write ended {status}")

        return op

    return make


RAW = {"tcp": ("socket", raw_tcp), "mooncake": ("engine", raw_mooncake), "nixl": ("engine", raw_nixl)}


# ---------------------------------------------------------------------------- one backend


def paged_segments(size: int, page: int, rng: np.random.Generator) -> list[tuple[int, int, int]]:
    """``size`` bytes as whole ``page``-sized segments to permuted destination pages, plus the short tail."""
    full = size // page
    segs = [(i * page, int(d) * page, page) for i, d in enumerate(rng.permutation(full))]
    if size % page:
        segs.append((full * page, full * page, size % page))
    return segs


def variants(
    kind: str,
    size: int,
    ini: KVInitiator,
    peer: PeerHandle,
    memcpy: tuple[Region, Region],
    raw: Callable[[int], Op] | None,
    page: int,
    sealed: tuple[KVInitiator, PeerHandle] | None = None,
) -> dict[str, Op]:
    paged = paged_segments(size, page, np.random.default_rng(size))
    lists: dict[int, list[tuple[int, int, int]]] = {}  # per offset, built once (outside the later rounds' timing)

    def paged_at(off: int) -> list[tuple[int, int, int]]:
        segs = lists.get(off)
        if segs is None:
            segs = lists[off] = [(s + off, d + off, n) for s, d, n in paged]
        return segs

    out: dict[str, Op] = {
        "memcpy": memcpy_op(*memcpy, size),
        "write": lambda off: ini.write(peer, [(off, off, size)]),
        "paged": lambda off: ini.write(peer, paged_at(off)),
    }
    if raw is not None:
        out["raw"] = raw(size)
    if sealed is not None:
        out["sealed"] = lambda off: sealed[0].write(sealed[1], [(off, off, size)])
    return out


def place(placement: str, targets: list[TargetProcess]) -> None:
    """Pin every thread of this process and of the targets for ``placement`` (``free``: any CPU this process may
    use). With one CPU, ``split`` is ``shared``."""
    mine, theirs = {
        "split": ({CPUS[0]}, {CPUS[1 % len(CPUS)]}),
        "shared": ({CPUS[0]}, {CPUS[0]}),
        "free": (set(CPUS), set(CPUS)),
    }[placement]
    pin_threads(os.getpid(), mine)
    for target in targets:
        target.pin(theirs)


SEALED_SECRET = bytes(32)  # a benchmark's cluster secret


def sealed_pair(kind: str) -> tuple[TargetProcess, KVInitiator, PeerHandle] | None:
    """For tcp: a second target that admits cluster members and seals, and a member initiator connected to it."""
    if kind != "tcp":
        return None
    target = TargetProcess("tcp", WINDOW, secret=SEALED_SECRET, sealed=True)
    ini = make_initiator("tcp", WINDOW, secret=SEALED_SECRET)
    return target, ini, ini.connect(target.descriptor)


def bench_backend(
    kind: str, rounds: int, page: int, memcpy: tuple[Region, Region], placements: list[str]
) -> list[dict]:
    target = TargetProcess(kind, WINDOW)
    ini = make_initiator(kind, WINDOW)
    sealed = sealed_pair(kind)
    targets = [target] + ([sealed[0]] if sealed else [])
    try:
        peer = ini.connect(target.descriptor)
        raw_name, raw_factory = RAW.get(kind, (None, None))
        raw = raw_factory(target, ini, peer) if raw_factory else None
        table = {size: variants(kind, size, ini, peer, memcpy, raw, page, sealed and sealed[1:]) for size in SIZES}
        samples: dict[tuple[str, str, int, str], list[float]] = {}
        for r in range(rounds + 1):
            for placement in placements:
                place(placement, targets)
                for mode in MODES:
                    for size in SIZES:
                        offs = offsets(mode, size, reps_for(size))
                        for name, value in gbps(table[size], size, offs, r).items():
                            if r:  # round 0 warms caches, connections and page tables
                                samples.setdefault((placement, mode, size, name), []).append(value)
        return [
            row(kind, placement, mode, size, raw_name, page, samples)
            for placement in placements
            for mode in MODES
            for size in SIZES
        ]
    finally:
        place("free", targets)
        ini.close()
        target.close()
        if sealed:
            sealed[1].close()
            sealed[0].close()


def row(kind: str, placement: str, mode: str, size: int, raw_name: str | None, page: int, samples: dict) -> dict:
    key = (placement, mode, size)
    med = {name: statistics.median(v) for (*k, name), v in samples.items() if tuple(k) == key}
    out = {
        "backend": kind,
        "placement": placement,
        "mode": mode,
        "size": size,
        "page": page,
        "raw": raw_name,
        "memcpy_gbs": med["memcpy"],
        "raw_gbs": med.get("raw"),
        "write_gbs": med["write"],
        "paged_gbs": med["paged"],
        "write_vs_memcpy": med["write"] / med["memcpy"],
        "paged_vs_memcpy": med["paged"] / med["memcpy"],
    }
    if "raw" in med:
        out["write_vs_raw"] = med["write"] / med["raw"]
        out["paged_vs_raw"] = med["paged"] / med["raw"]
    if "sealed" in med:
        out["sealed_gbs"] = med["sealed"]
        out["sealed_vs_write"] = med["sealed"] / med["write"]
    return out


# ---------------------------------------------------------------------------- report


def human(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def pct(r: dict, key: str) -> str:
    return f"{r[key]:.0%}" if key in r else "-"


def table(rows: list[dict]) -> str:
    head = (
        "placement",
        "mode",
        "backend",
        "size",
        "memcpy",
        "raw",
        "write",
        "paged",
        "write/memcpy",
        "write/raw",
        "paged/memcpy",
        "paged/raw",
        "sealed",
        "sealed/write",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        raw = f"{r['raw_gbs']:.2f} ({r['raw']})" if r["raw_gbs"] is not None else "-"
        lines.append(
            "| "
            + " | ".join(
                [
                    r["placement"],
                    r["mode"],
                    r["backend"],
                    human(r["size"]),
                    f"{r['memcpy_gbs']:.2f}",
                    raw,
                    f"{r['write_gbs']:.2f}",
                    f"{r['paged_gbs']:.2f}",
                    pct(r, "write_vs_memcpy"),
                    pct(r, "write_vs_raw"),
                    pct(r, "paged_vs_memcpy"),
                    pct(r, "paged_vs_raw"),
                    f"{r['sealed_gbs']:.2f}" if "sealed_gbs" in r else "-",
                    pct(r, "sealed_vs_write"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--page", type=int, default=SMOLLM2_PAGE, help="segment size of the paged variant")
    ap.add_argument("--placements", default="split,shared", help=f"comma-separated, of {', '.join(PLACEMENTS)}")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    placements = args.placements.split(",")
    if not set(placements) <= set(PLACEMENTS):
        ap.error(f"--placements: choose from {', '.join(PLACEMENTS)}")
    memcpy = (Region.anonymous(WINDOW), Region.anonymous(WINDOW))
    rows: list[dict] = []
    for kind in args.backends.split(","):
        ok, why = available(kind)
        if not ok:
            print(f"{kind}: unavailable: {why}", file=sys.stderr)
            continue
        t = time.perf_counter()
        rows += bench_backend(kind, args.rounds, args.page, memcpy, placements)
        print(f"{kind}: done in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    rows.sort(key=lambda r: (r["placement"], MODES.index(r["mode"]), BACKENDS.index(r["backend"]), r["size"]))
    print(
        f"GB/s (1e9 B/s), medians of {args.rounds} interleaved rounds; target in another process; "
        f"paged = {args.page}-byte segments"
    )
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "rounds": args.rounds,
            "placements": placements,
            "page": args.page,
            "window": WINDOW,
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
