"""The mutation matrix (issue #5): which safety layers stop the incident, shown by ``kvfence probe``.

For each row: start a real ``kvfence serve`` (SmolLM2, CPU) with some layers off (``KVFENCE_UNSAFE``), on the
normal or the incident deployment (docs/safety.md), run ``kvfence probe`` against it with a fixed seed, stop the
server, and compare the verdict with the row's expectation:

- ``clean``: the probe found nothing (over-length requests got 400);
- ``harm detected``: a leak, an over-length request answered 200, or greedy output changed under load;
- ``contained (5xx)``: only over-length requests answered 5xx (a landing check's 500 ``kv_integrity``, not 400);
- ``contained, then unavailable``: no harm, but a landing check's quarantined pages stayed quarantined (their
  writer never acknowledged the abort), so the decode pool is left too small and later requests get 503 (the probe
  may then stop early, exit 2);
- ``refused to start (L0)``: the server exited with status 2 at preflight;
- ``inconclusive`` / ``error``: the probe could not conclude, or something broke.

    .venv/bin/python bench/mutation_matrix.py                      # every row (~25 min on 2 cores)
    .venv/bin/python bench/mutation_matrix.py --list
    .venv/bin/python bench/mutation_matrix.py --only incident-all-off tags-alone

Writes ``bench/results/mutation_matrix.json`` (rows rerun with ``--only`` replace their earlier results), prints a
table, and rewrites the table in docs/safety.md between the mutation-matrix markers. Exits 1 when any row's verdict
differs from its expectation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvfence.safety import LAYERS  # noqa: E402
from tests.server import Server  # noqa: E402

INCIDENT_ARGS = ("--emulate-incident", "--prefill-pool-tokens", "1024", "--max-context", "4096",
                 "--decode-pool-tokens", "1088")
KEYS = ("sk-alice", "sk-carol", "sk-bob")  # two canary tenants, then the attacker
TENANTS_TOML = "".join(f'[tenants.{k[3:]}]\napi_keys = ["{k}"]\n\n' for k in KEYS)
# requests bind, not time; the layers here guard the KV path, so the prefix cache's timing phase is left out
PROBE_FLAGS = ("--seed", "7", "--requests", "24", "--time-limit", "240", "--timeout", "120", "--no-timing")
CHECKS = ("admission", "propagation", "tags", "coverage", "checksum")  # L1-L5: what the probe can exercise
DOC = ROOT / "docs" / "safety.md"
START, END = "<!-- mutation-matrix:start -->", "<!-- mutation-matrix:end -->"

CLEAN, HARM, CONTAINED, REFUSED = "clean", "harm detected", "contained (5xx)", "refused to start (L0)"
UNAVAILABLE = "contained, then unavailable"
KINDS = ("leak", "wrong status", "wrong status class", "incoherent")  # the probe's finding kinds
HARM_KINDS = ("leak", "wrong status", "incoherent")


@dataclass(frozen=True)
class Row:
    """One configuration: ``off`` layers (``KVFENCE_UNSAFE``), on the incident deployment or not, and the
    verdict expected."""

    name: str
    off: tuple[str, ...]
    incident: bool
    expect: str
    note: str = ""
    probe_args: tuple[str, ...] = ()  # besides PROBE_FLAGS

    def server_args(self, tenants: str) -> list[str]:
        return [*(INCIDENT_ARGS if self.incident else ()), "--tenants", tenants]


ALONE_NOTES = {
    "admission": "the router rejects over-length prompts before any grant",
    "propagation": "prefill's rejection reaches the client",
    "tags": "caught on landing (500, not 400); its 65 pages come back once prefill acks the abort",
    "coverage": "prefill refuses the 1-token placeholder for the granted pages: 500 kv_integrity, not 400",
    "checksum": "caught on landing (500, not 400); its 65 pages come back once prefill acks the abort",
}
ALONE_EXPECT = {"admission": CLEAN, "propagation": CLEAN, "tags": CONTAINED, "coverage": CONTAINED,
                "checksum": CONTAINED}

ROWS: list[Row] = [
    # Victims of 1,000 tokens: near-context (8k) ones outlast the 30 s handoff timeout on 2 CPU cores (503).
    Row("defaults", (), False, CLEAN, "kvfence serve defaults, every layer on", ("--victim-tokens", "1000")),
    Row("incident", (), True, REFUSED, "L0: the 1,024-token prefill pool cannot hold the 4,096 context"),
    Row("incident-preflight-off", ("preflight",), True, CLEAN, "L1 answers over-length prompts 400"),
    Row("incident-all-off", LAYERS, True, HARM, "the incident: 200 with another tenant's text"),
    *[Row(f"{layer}-alone", tuple(x for x in LAYERS if x != layer), True, ALONE_EXPECT[layer], ALONE_NOTES[layer])
      for layer in CHECKS],
    *[Row(f"{layer}-off", ("preflight", layer), True, CLEAN, "defence in depth: the other layers catch it")
      for layer in CHECKS],
]


@dataclass
class Result:
    """What one row did. ``server_exit``: the server's status when it exited before serving."""

    name: str
    layers_off: list[str]
    incident: bool
    server_args: list[str]
    expect: str
    verdict: str = "error"
    server_exit: int | None = None
    probe_exit: int | None = None
    findings: dict[str, int] = field(default_factory=dict)
    first_leak: str | None = None
    statuses: dict[str, int] = field(default_factory=dict)
    server: dict = field(default_factory=dict)  # the server's own count: statuses, caught_by layer, quarantined
    detail: str = ""
    startup_seconds: float = 0.0
    seconds: float = 0.0
    note: str = ""
    commit: str = ""
    finished_at: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == self.expect


def log(msg: str) -> None:
    print(f"[matrix {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def layers_off_text(off: list[str]) -> str:
    """``none``, ``all``, ``all but tags`` or ``preflight, tags``."""
    if not off:
        return "none"
    if set(off) == set(LAYERS):
        return "all"
    on = [x for x in LAYERS if x not in off]
    return f"all but {', '.join(on)}" if len(on) < len(off) else ", ".join(off)


# -- one row ------------------------------------------------------------------------------------------------


def run_row(row: Row, tenants: str, work: Path, verbose: bool, position: str) -> Result:
    """Start the row's server, probe it, stop it, judge."""
    started = time.monotonic()
    shown_args = row.server_args("tenants.toml")
    result = Result(row.name, list(row.off), row.incident, shown_args, row.expect, note=row.note,
                    commit=git("rev-parse", "--short", "HEAD"))
    log(f"{position} {row.name}: starting kvfence serve {' '.join(shown_args)} "
        f"(KVFENCE_UNSAFE={','.join(row.off) or '-'})")
    server = Server(*row.server_args(tenants), env={"KVFENCE_UNSAFE": ",".join(row.off)}, wait_ready=False)
    try:
        if start_server(server, result):
            result.startup_seconds = round(time.monotonic() - started, 1)
            log(f"{row.name}: server up in {result.startup_seconds:.0f}s; probing")
            probe(server.url, work / f"{row.name}.json", row.probe_args, result, verbose)
            result.server = server_view(server.url)
            result.verdict = verdict(result.probe_exit, result.findings, result.server)
    finally:
        server.stop()
    result.seconds = round(time.monotonic() - started, 1)
    result.finished_at = datetime.now(UTC).isoformat(timespec="seconds")
    mark = "as expected" if result.ok else f"EXPECTED {row.expect}"
    log(f"{row.name}: {result.verdict} ({mark}); probe exit {result.probe_exit}, {findings_text(result.findings)}, "
        f"{result.seconds:.0f}s")
    return result


def start_server(server: Server, result: Result) -> bool:
    """Wait for the server; when it exits or hangs instead, record why and return False."""
    try:
        server.wait_ready(300)
        return True
    except RuntimeError:  # exited before serving
        result.server_exit = server.proc.poll()
        lines = [ln for ln in server.output().splitlines() if ln.startswith("kvfence:")]
        result.detail = (lines[-1] if lines else server.output()[-300:]).strip()
        result.verdict = REFUSED if result.server_exit == 2 else "error"
    except TimeoutError as e:
        result.detail = str(e)[:300]
    return False


def probe(url: str, out: Path, args: tuple[str, ...], result: Result, verbose: bool) -> None:
    """Run ``kvfence probe`` against ``url`` and record its exit status and findings."""
    cmd = [sys.executable, "-m", "kvfence.cli", "probe", "--url", url, *[a for k in KEYS for a in ("--key", k)],
           *PROBE_FLAGS, *args, "--json", str(out)]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=not verbose, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        result.detail = "probe timed out after 900s"
        return
    result.probe_exit = done.returncode
    report = json.loads(out.read_text()) if out.exists() else {}
    kinds = [f["kind"] for f in report.get("findings", [])]
    result.findings = {k: kinds.count(k) for k in KINDS if k in kinds}
    leak = next((f for f in report.get("findings", []) if f["kind"] == "leak"), None)
    if leak:
        result.first_leak = f"{leak['receiver']} got {','.join(leak['victims'])}'s {leak['detail']}"[:200]
    for r in report.get("requests", []):
        key = str(r["status"] if r["status"] is not None else "no answer")
        result.statuses[key] = result.statuses.get(key, 0) + 1
    last = (done.stderr or "").strip().splitlines()[-1:] if not report else []
    result.detail = report.get("inconclusive") or (last[0][-300:] if last else "")


def server_view(url: str) -> dict:
    """What the server itself counted: requests by status, verification failures by layer, quarantined pages."""
    try:
        metrics = httpx.get(url + "/metrics", timeout=10).text
        health = httpx.get(url + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError) as e:
        return {"error": str(e)}
    view: dict = {"statuses": {}, "caught_by": {}}
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == "kvfence_requests_total":
                key = s.labels["status"]
                view["statuses"][key] = view["statuses"].get(key, 0) + int(s.value)
            elif s.name == "kvfence_kv_verification_failures_total" and s.value:
                view["caught_by"][s.labels["layer"]] = int(s.value)
    view["quarantined_pages"] = sum(w.get("quarantined_pages") or 0 for w in health.get("workers", {}).values())
    return view


def verdict(probe_exit: int | None, findings: dict[str, int], server: dict) -> str:
    """Harm found by the probe first; then a pool left quarantined (503s); then the probe's own outcome."""
    if any(k in findings for k in HARM_KINDS):
        return HARM
    if server.get("quarantined_pages") and server.get("statuses", {}).get("503"):
        return UNAVAILABLE
    if findings:
        return CONTAINED
    return {0: CLEAN, 3: "inconclusive"}.get(probe_exit, "error")


def findings_text(findings: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in findings.items()) or "no findings"


def server_text(server: dict) -> str:
    """``200: 17, 500: 1; caught by checksum: 1; 65 pages quarantined``, or ``-``."""
    parts = [", ".join(f"{k}: {n}" for k, n in sorted(server.get("statuses", {}).items()))]
    parts += [f"caught by {k}: {n}" for k, n in server.get("caught_by", {}).items()]
    parts += [f"{server['quarantined_pages']} pages quarantined"] if server.get("quarantined_pages") else []
    return "; ".join(p for p in parts if p) or "-"


# -- output -------------------------------------------------------------------------------------------------


def merge(path: Path, results: list[Result]) -> list[dict]:
    """This run's rows in place of the same rows in ``path``; rows in ``ROWS`` order."""
    old = json.loads(path.read_text()).get("rows", []) if path.exists() else []
    by_name = {r["name"]: r for r in old} | {r.name: asdict(r) | {"ok": r.ok} for r in results}
    return [by_name[row.name] for row in ROWS if row.name in by_name]


def text_table(rows: list[dict]) -> str:
    head = ("row", "verdict", "expected", "exit", "findings", "s")
    body = [(r["name"], r["verdict"], "ok" if r["ok"] else f"EXPECTED {r['expect']}",
             str(r["probe_exit"] if r["probe_exit"] is not None else f"server {r['server_exit']}"),
             findings_text(r["findings"]), f"{r['seconds']:.0f}") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)) for x in [head, *body])


def markdown(rows: list[dict], meta: dict) -> str:
    """The docs table: one line per row, then the first leak of each row that had one."""
    commits = ", ".join(sorted({r["commit"] for r in rows}))
    minutes = sum(r["seconds"] for r in rows) / 60
    lines = [f"Last run: {meta['date']} at commit {commits}; {minutes:.0f} min in all on this machine "
             f"(probe `{' '.join(PROBE_FLAGS)}`).", "",
             "| row | layers off | deployment | expected | verdict | probe exit | probe findings | server saw | s "
             "| why |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict_cell = f"**{r['verdict']}**" if r["ok"] else f"**{r['verdict']}** (differs)"
        exit_cell = r["probe_exit"] if r["probe_exit"] is not None else f"server exit {r['server_exit']}"
        lines.append(f"| `{r['name']}` | {layers_off_text(r['layers_off'])} | "
                     f"{'incident' if r['incident'] else 'normal'} | {r['expect']} | {verdict_cell} | {exit_cell} | "
                     f"{findings_text(r['findings']) if r['probe_exit'] is not None else '-'} | "
                     f"{server_text(r.get('server') or {})} | {r['seconds']:.0f} | {r['note']} |")
    leaks = [f"- `{r['name']}`: {r['first_leak']}".replace("|", "\\|") for r in rows if r["first_leak"]]
    return "\n".join(lines + (["", "First leak per row:", "", *leaks] if leaks else []))


def rewrite_doc(table: str) -> None:
    text = DOC.read_text()
    if START not in text or END not in text:
        log(f"{DOC}: no {START} ... {END} markers; table not written")
        return
    head, rest = text.split(START, 1)
    DOC.write_text(f"{head}{START}\n{table}\n{END}{rest.split(END, 1)[1]}")


# -- command ------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these rows (see --list)")
    ap.add_argument("--list", action="store_true", help="print the row names and exit")
    ap.add_argument("--json", default=str(ROOT / "bench/results/mutation_matrix.json"))
    ap.add_argument("--no-doc", action="store_true", help="do not rewrite the table in docs/safety.md")
    ap.add_argument("-v", "--verbose", action="store_true", help="show the probe's own progress and table")
    args = ap.parse_args()
    if args.list:
        for row in ROWS:
            print(f"{row.name:24} off: {layers_off_text(list(row.off)):40} expect: {row.expect}")
        return 0
    unknown = set(args.only or ()) - {r.name for r in ROWS}
    if unknown:
        ap.error(f"unknown row(s) {sorted(unknown)}; see --list")
    rows = [r for r in ROWS if not args.only or r.name in args.only]

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvfence-matrix-") as tmp:
        (Path(tmp) / "tenants.toml").write_text(TENANTS_TOML)
        results = [run_row(row, str(Path(tmp) / "tenants.toml"), Path(tmp), args.verbose, f"[{i + 1}/{len(rows)}]")
                   for i, row in enumerate(rows)]
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
            "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": git("status", "--porcelain", "--", "kvfence").splitlines(),
            "seconds": round(time.monotonic() - started, 1), "rows_run": [r.name for r in rows],
            "probe_flags": list(PROBE_FLAGS)}
    path = Path(args.json)
    merged = merge(path, results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta | {"rows": merged}, indent=2) + "\n")
    print(text_table(merged))
    print(f"wrote {path}")
    if not args.no_doc:
        rewrite_doc(markdown(merged, meta))
    wrong = [r.name for r in results if not r.ok]
    if wrong:
        log(f"verdict differs from the expectation: {', '.join(wrong)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
