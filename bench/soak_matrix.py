"""The soak's half of the mutation matrix: which layers stop the harms that only faults bring.

``bench/mutation_matrix.py`` covers the incident with ``kvfence probe``. The probe never flips bytes, kills a
worker or leaves mid-transfer, so the layers against those (L5 checksums, L6 deferred release, L7 deferred
abort, and L3 against late writes) get their rows here: ``kvfence soak`` on a tiny random-weight model, with
some layers off, each row once with its own seed. A row's verdict is **harm detected** (the soak found leaks,
wrong statuses or incoherent answers), or **clean**. Each row states what it expects; the script exits 1 when
any verdict differs, and rewrites the table in docs/safety.md.

    .venv/bin/python bench/soak_matrix.py [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.tiny_models import tiny_model_dir  # noqa: E402

DOC = ROOT / "docs" / "safety.md"
START, END = "<!-- soak-matrix:start -->", "<!-- soak-matrix:end -->"
HARM = {"leak", "wrong status", "incoherent"}
EVERY_FAULT = "drop=0.004,dup=0.01,delay=0.02,delay_s=0.3,flip=0.15"
# clients leave often; control messages lag (a late Abort widens the window); two prefills write in parallel
LATE_WRITES = ("--kills", "0", "--disconnect", "0.4", "--faults", "delay=0.5,delay_s=1.0",
               "--serve-args", "--chunk-size 16 --prefill 2")


@dataclass(frozen=True)
class Row:
    name: str
    unsafe: str  # KVFENCE_UNSAFE
    flags: tuple[str, ...]  # kvfence soak flags
    expected: str  # "clean" | "harm detected"
    why: str


ROWS = [
    Row("every-fault", "", ("--kills", "2", "--disconnect", "0.08", "--faults", EVERY_FAULT), "clean",
        "drops, dups, delays, flips, kills mid-transfer, clients leaving: every request ends honestly"),
    Row("checksum-off", "checksum", ("--kills", "0", "--disconnect", "0", "--faults", "flip=0.5"), "harm detected",
        "L5 alone stands between a flipped byte and the client"),
    Row("late-writes", "deferred_release,deferred_abort", LATE_WRITES, "clean",
        "with L6 and L7 off, an aborted write may land in reused pages; L3-L5 stand in its way"),
    Row("late-writes-unchecked", "deferred_release,deferred_abort,tags,coverage,checksum", LATE_WRITES,
        "harm detected", "with L3-L7 off, a late write reaches another request's answer"),
]


def run_row(row: Row, workdir: Path, requests: int) -> dict:
    report = workdir / f"{row.name}.json"
    cmd = [sys.executable, "-m", "kvfence.cli", "soak", "--model", str(tiny_model_dir("llama")), "--seed", "5",
           "--requests", str(requests), "--concurrency", "12", "--max-context", "512", "--handoff-timeout", "5",
           "--workdir", str(workdir / row.name), "--json", str(report), *row.flags]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "KVFENCE_UNSAFE": row.unsafe}, capture_output=True,
                          text=True)
    seconds = time.monotonic() - started
    if not report.exists():
        raise RuntimeError(f"row {row.name}: soak exited {proc.returncode} without a report:\n{proc.stderr[-3000:]}")
    data = json.loads(report.read_text())
    kinds: dict[str, int] = {}
    for f in data["findings"]:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    verdict = "harm detected" if HARM & set(kinds) else "clean"
    caught = {k: int(v) for k, v in data["verification_failures"].items()}
    return {**asdict(row), "verdict": verdict, "exit": proc.returncode, "findings": kinds, "caught": caught,
            "statuses": data["outcomes"]["statuses"], "seconds": round(seconds)}


def table(results: list[dict], when: str) -> str:
    lines = [f"Last run: {when}; each row `kvfence soak` on the tiny random-weight model, seed 5, 12 clients, "
             "context 512, `--handoff-timeout 5`.", "",
             "| row | layers off | faults | expected | verdict | findings | caught on landing | s | why |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        faults = " ".join(r["flags"])
        findings = ", ".join(f"{v} {k}" for k, v in r["findings"].items()) or "-"
        caught = ", ".join(f"{v} {k}" for k, v in r["caught"].items()) or "-"
        ok = r["verdict"] if r["verdict"] == r["expected"] else f"{r['verdict']} (expected {r['expected']})"
        lines.append(f"| `{r['name']}` | {r['unsafe'] or 'none'} | `{faults}` | {r['expected']} | **{ok}** | "
                     f"{findings} | {caught} | {r['seconds']} | {r['why']} |")
    return "\n".join(lines)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    block = f"{START}\n{text}\n{END}"
    if not pattern.search(doc):
        raise RuntimeError(f"{DOC} has no {START} ... {END} markers")
    DOC.write_text(pattern.sub(lambda _: block, doc))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", default=None, help="row names to run")
    ap.add_argument("--list", action="store_true", help="print the rows and exit")
    ap.add_argument("--requests", type=int, default=300, help="requests per row")
    ap.add_argument("--json", default="bench/results/soak_matrix.json")
    args = ap.parse_args()
    if args.list:
        for r in ROWS:
            print(f"{r.name:24} off: {r.unsafe or 'none':55} expects {r.expected}")
        return 0
    rows = [r for r in ROWS if args.only is None or r.name in args.only]
    results = []
    with tempfile.TemporaryDirectory(prefix="kvfence-soak-matrix-") as tmp:
        for row in rows:
            print(f"{row.name}: KVFENCE_UNSAFE={row.unsafe or '-'} kvfence soak {' '.join(row.flags)} ...",
                  file=sys.stderr, flush=True)
            results.append(run_row(row, Path(tmp), args.requests))
            r = results[-1]
            print(f"  {r['verdict']} (expected {r['expected']}) in {r['seconds']}s: {r['findings'] or 'no findings'}",
                  file=sys.stderr, flush=True)
    when = time.strftime("%Y-%m-%d %H:%M")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"date": when, "rows": results}, indent=1))
    text = table(results, when)
    print(text)
    if args.only is None:
        write_doc(text)
    return int(any(r["verdict"] != r["expected"] for r in results))


if __name__ == "__main__":
    sys.exit(main())
