"""``kvfence soak``: the whole disaggregated system under mixed multi-tenant traffic while faults are injected.

It starts ``kvfence serve`` twice on this host. First without faults, to learn each prompt's greedy answer in
isolation (the reference). Then with ``KVFENCE_FAULTS`` (control messages dropped, duplicated and delayed; one
byte of some landed KV transfers flipped), and while it runs:

- tenants send chats carrying their own secret codes, normal chats, and token-id prompts at and around the
  context limit (context - max_tokens fits exactly; one over it, context - 1, context, context + 1, twice it);
- some clients disconnect during the KV handoff, others after their first streamed chunk;
- ``--kills`` times, evenly spread over the requests, a prefill or a decode worker is SIGKILLed, while a
  transfer is in flight if one comes within two seconds; the supervisor restarts it, and no new request is
  sent until it is back (those in flight when it died must end with a clean error, or be retried);
- ``--pauses`` times, between the kills, a decode or a prefill worker is SIGSTOPped for ``--worker-timeout``
  plus 5 seconds while traffic goes on, then SIGCONTed: the router must suspect it, fence it, and take it back
  once it has dropped what it held.

Afterwards it checks, and reports as findings:

- ``leak``: an answer holds another tenant's code, or its word or digits (as ``kvfence probe`` judges);
- ``wrong status``: an over-length request not answered 400, or a request that fits answered 4xx;
- ``incoherent``: a 200 whose text (or a streamed prefix before an error) differs from the reference;
- ``hung``: a request that got no status within ``--timeout``;
- ``page leak``: once idle, a worker still holds pages, or quarantines pages without a reason;
- ``unexpected restart``: a worker process changed that the soak did not kill;
- ``fencing``: a paused worker was not fenced, did not come back, or a request sent to it before it was
  fenced still got a 200 after (the audit log's ``decode_epoch`` says which epoch served each request);
- ``shm leak``: a KV segment in ``/dev/shm`` outlives its server;
- ``audit``: the audit log does not hold exactly one record per request;
- ``not serving``: after the faults, plain requests no longer get correct answers.

Exit status: 0 nothing found, 1 findings, 2 usage or start-up error. JSON report with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvfence import env
from kvfence.auditlog import read_records
from kvfence.tools.probe import NORMAL_PROMPTS, Canary, new_canary, specific_fragments

if TYPE_CHECKING:  # imported where used: 'kvfence serve' needs no HTTP client
    import httpx

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
DEFAULT_FAULTS = "drop=0.002,dup=0.005,delay=0.01,delay_s=0.5,flip=0.02"
PAD_TOKEN = 42  # token id that fills over-length prompts (every vocabulary has it)
ADMIN_KEY = "sk-soak-admin"  # reads /health's detail (worker pids) and /metrics
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass(frozen=True)
class SoakSettings:
    requests: int = 2000
    concurrency: int = 16
    tenants: int = 3
    model: str = "smollm2-135m"
    max_context: int = 512
    faults: str = DEFAULT_FAULTS
    kills: int = 4  # workers SIGKILLed, alternating prefill and decode
    pauses: int = 2  # workers SIGSTOPped past the worker timeout, alternating decode and prefill
    worker_timeout: float = 15.0  # as kvfence serve
    disconnect: float = 0.05  # share of requests whose client leaves mid-handoff, and again mid-stream
    max_tokens: int = 16
    handoff_timeout: float = 30.0  # as kvfence serve
    timeout: float = 180.0  # seconds a client waits for its whole answer (past the router's 4 x handoff timeout)
    seed: int | None = None
    serve_args: tuple[str, ...] = ()
    unsafe: str = ""  # KVFENCE_UNSAFE for the server under faults (mutation rows)


@dataclass(frozen=True)
class Prompt:
    """A distinct in-limit prompt (``key``) with its owner; ``messages`` for chat, ``token_ids`` for completions."""

    key: str
    tenant: str | None  # None: any tenant may send it
    messages: tuple[tuple[str, str], ...] = ()
    token_ids: tuple[int, ...] = ()
    canary: Canary | None = None  # the secret a tenant's chat asks the model to repeat

    def body(self, model: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
        common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        if self.token_ids:
            return "/v1/completions", {**common, "prompt": list(self.token_ids)}
        return "/v1/chat/completions", {**common, "messages": [{"role": r, "content": c} for r, c in self.messages]}


@dataclass(frozen=True)
class Job:
    i: int
    tenant: str
    prompt: Prompt
    stream: bool
    over_length: bool = False
    max_tokens: int = 16
    leave: str | None = None  # "handoff" | "stream": the client disconnects then


@dataclass
class Outcome:
    job: int
    tenant: str
    prompt: str
    ended: str  # "answered" | "disconnected" | "hung" | "transport error"
    status: int | None = None
    text: str = ""
    finish: str | None = None
    error_code: str | None = None  # from the body, or from an error event mid-stream
    rid: str | None = None  # the request id in hex, from a 200's ``id`` ("chatcmpl-<rid>")


@dataclass(frozen=True)
class Finding:
    kind: str
    detail: str


@dataclass
class Report:
    settings: dict
    seconds: float = 0.0
    outcomes: dict = field(default_factory=dict)  # summary counts
    kills: list = field(default_factory=list)
    pauses: list = field(default_factory=list)
    verification_failures: dict = field(default_factory=dict)  # layer -> count, from /metrics
    pools: dict = field(default_factory=dict)  # worker -> pages after the soak
    canaries_repeated: float = 0.0  # share of canary references that repeat their code
    findings: list = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.findings


# -- the traffic ---------------------------------------------------------------------------------


def make_prompts(tenants: list[str], rng: random.Random, context: int, max_tokens: int) -> list[Prompt]:
    """Three secret-code chats per tenant, the shared normal chats, and a token-id prompt that fits exactly."""
    prompts: list[Prompt] = []
    words: list[str] = []  # the canaries' words so far
    for t in tenants:
        for _ in range(3):
            c = new_canary(t, rng, words)
            words.append(c.word)
            prompts.append(Prompt(f"{t}:{c.code}", t, (("user", c.sentence),), canary=c))
    prompts += [Prompt(f"normal:{i}", None, (("user", p),)) for i, p in enumerate(NORMAL_PROMPTS)]
    prompts.append(Prompt("fits exactly", None, token_ids=(PAD_TOKEN,) * (context - max_tokens)))
    return prompts


def over_length_prompts(context: int, max_tokens: int) -> list[Prompt]:
    """Token-id prompts that must each get 400: one over with max_tokens, and the context's own edges."""
    sizes = {"one over with max_tokens": context - max_tokens + 1, "context - 1": context - 1, "context": context,
             "context + 1": context + 1, "twice the context": 2 * context}
    return [Prompt(f"over: {name} ({n})", None, token_ids=(PAD_TOKEN,) * n) for name, n in sizes.items()]


def make_jobs(s: SoakSettings, tenants: list[str], prompts: list[Prompt], over: list[Prompt],
              rng: random.Random) -> list[Job]:
    jobs = []
    for i in range(s.requests):
        tenant = rng.choice(tenants)
        stream = rng.random() < 0.5
        if rng.random() < 0.2:
            jobs.append(Job(i, tenant, rng.choice(over), stream, over_length=True, max_tokens=s.max_tokens))
            continue
        mine = [p for p in prompts if p.tenant in (None, tenant) and p.key != "fits exactly"]
        prompt = next(p for p in prompts if p.key == "fits exactly") if rng.random() < 0.03 else rng.choice(mine)
        r = rng.random()
        leave = "handoff" if r < s.disconnect else "stream" if stream and r < 2 * s.disconnect else None
        jobs.append(Job(i, tenant, prompt, stream, max_tokens=s.max_tokens, leave=leave))
    return jobs


async def run_job(client: httpx.AsyncClient, job: Job, key: str, model: str, timeout: float,
                  rng: random.Random) -> Outcome:
    import httpx
    out = Outcome(job.i, job.tenant, job.prompt.key, "answered")
    path, body = job.prompt.body(model, job.max_tokens, job.stream)
    call = _call(client, path, body, key, job, out)
    try:
        if job.leave == "handoff":
            await asyncio.wait_for(call, rng.uniform(0.01, 0.3))
        else:
            await asyncio.wait_for(call, timeout)
    except TimeoutError:
        out.ended = "disconnected" if job.leave == "handoff" else "hung"
    except _LeftMidStream:
        out.ended = "disconnected"
    except httpx.HTTPError as exc:
        out.ended, out.text = "transport error", f"{type(exc).__name__}: {exc}"
    return out


class _LeftMidStream(Exception):
    pass


def error_name(body: dict) -> str | None:
    """An OpenAI error body's code, else its type."""
    err = body.get("error") or {}
    return err.get("code") or err.get("type")


async def _call(client: httpx.AsyncClient, path: str, body: dict, key: str, job: Job, out: Outcome) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    if not job.stream:
        resp = await client.post(path, json=body, headers=headers)
        out.status = resp.status_code
        data = resp.json()
        if resp.status_code == 200:
            out.rid = data["id"].rsplit("-", 1)[1]
            choice = data["choices"][0]
            out.text = choice.get("text") if "text" in choice else choice["message"]["content"] or ""
            out.finish = choice["finish_reason"]
        else:
            out.error_code = error_name(data)
        return
    async with client.stream("POST", path, json=body, headers=headers) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            out.error_code = error_name(json.loads(await resp.aread()))
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error_code = error_name(event)
                return
            out.rid = out.rid or event.get("id", "-").rsplit("-", 1)[1]
            for choice in event.get("choices", []):
                out.text += choice.get("text") or choice.get("delta", {}).get("content") or ""
                out.finish = choice.get("finish_reason") or out.finish
            if job.leave == "stream" and out.text:
                raise _LeftMidStream


# -- the server ----------------------------------------------------------------------------------


class LocalServer:
    """``kvfence serve ARGS`` on a free port, its output in ``log_path``; ``stop`` ends it and its workers."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, log_path: Path | None = None,
                 cwd: Path | None = None) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"kvfence-serve-{self.port}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115
        cmd = [sys.executable, "-m", "kvfence.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        """Wait for /health to say ok; stop the server and raise if it exits or takes longer."""
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.output()}")

    def model_id(self, key: str) -> str:
        """The first model ``key`` may use."""
        import httpx
        models = httpx.get(self.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        return models.json()["data"][0]["id"]

    def health(self, key: str | None = None) -> dict:
        """/health; with a tenants file, only an admin ``key`` gets its detail."""
        import httpx
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + "/health", headers=headers, timeout=10).json()

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()[-6000:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode


# -- the soak ------------------------------------------------------------------------------------


class Soak:
    def __init__(self, s: SoakSettings, workdir: Path) -> None:
        self.s, self.workdir = s, workdir
        self.rng = random.Random(s.seed)
        self.tenants = [f"tenant{i + 1}" for i in range(s.tenants)]
        self.keys = {t: f"sk-soak-{t}" for t in self.tenants}
        (workdir / "tenants.toml").write_text("".join(f'[tenants.{t}]\napi_keys = ["{k}"]\n\n'
                                                      for t, k in self.keys.items())
                                              + f'[admin]\napi_keys = ["{ADMIN_KEY}"]\n')
        self.prompts = make_prompts(self.tenants, self.rng, s.max_context, s.max_tokens)
        self.over = over_length_prompts(s.max_context, s.max_tokens)
        self.reference: dict[str, str] = {}
        self.model_id = s.model
        self.report = Report(settings=asdict(s))

    def serve_args(self, audit_log: Path) -> list[str]:
        s = self.s
        return ["--model", s.model, "--max-context", str(s.max_context),
                "--tenants", str(self.workdir / "tenants.toml"), "--handoff-timeout", str(s.handoff_timeout),
                "--worker-timeout", str(s.worker_timeout), "--audit-log", str(audit_log), *s.serve_args]

    def run(self) -> Report:
        started = time.monotonic()
        self.learn_reference()
        self.soak_under_faults()
        self.report.seconds = round(time.monotonic() - started, 1)
        return self.report

    # -- phase 1 ---------------------------------------------------------------------------------

    def learn_reference(self) -> None:
        say("starting a server without faults to learn each prompt's answer alone...")
        server = LocalServer(self.serve_args(self.workdir / "reference-audit.jsonl"),
                             log_path=self.workdir / "reference-serve.log")
        try:
            server.wait_ready(600)
            self.model_id = server.model_id(self.keys[self.tenants[0]])
            self.reference = asyncio.run(self._reference(server.url))
        finally:
            server.stop()
        canaries = [(p.key, p.canary) for p in self.prompts if p.canary]
        repeated = sum(1 for key, c in canaries if c.code in self.reference[key])
        self.report.canaries_repeated = round(repeated / len(canaries), 3)
        say(f"reference learned for {len(self.reference)} prompts; the model repeats {repeated}/{len(canaries)} "
            "codes" + ("" if repeated else " (leak checks then rest on coherence alone)"))

    async def _reference(self, url: str) -> dict[str, str]:
        import httpx
        async with httpx.AsyncClient(base_url=url, timeout=self.s.timeout) as client:
            answers = {}
            for p in self.prompts:
                job = Job(-1, p.tenant or self.tenants[0], p, stream=False, max_tokens=self.s.max_tokens)
                out = await run_job(client, job, self.keys[job.tenant], self.model_id, self.s.timeout, self.rng)
                if out.status != 200:
                    raise RuntimeError(f"reference for {p.key!r} failed: {out}")
                answers[p.key] = out.text
            return answers

    # -- phase 2 ---------------------------------------------------------------------------------

    def soak_under_faults(self) -> None:
        s = self.s
        audit = self.workdir / "soak-audit.jsonl"
        env = {"KVFENCE_FAULTS": s.faults}
        if s.unsafe:
            env["KVFENCE_UNSAFE"] = s.unsafe
        say(f"starting a server with KVFENCE_FAULTS={s.faults}" + (f" KVFENCE_UNSAFE={s.unsafe}" if s.unsafe else ""))
        segments = set(stale_segments())
        server = LocalServer(self.serve_args(audit), env=env, log_path=self.workdir / "soak-serve.log")
        try:
            server.wait_ready(600)
            pids = self.worker_pids(server)
            jobs = make_jobs(s, self.tenants, self.prompts, self.over, self.rng)
            outcomes = asyncio.run(self._traffic(server, jobs))
            self.check_outcomes(jobs, outcomes)
            self.check_pools(server)
            self.check_restarts(pids, self.worker_pids(server))
            answered = sum(o.ended == "answered" for o in outcomes) + self.check_still_serves(server)
            self.report.verification_failures = verification_failures(server)
        finally:
            for pause in self.report.pauses:  # a failed run may leave one stopped
                _signal(pause["pid"], signal.SIGCONT)
            server.stop()
        self.check_audit(audit, outcomes, answered)
        self.check_shm(segments)

    async def _traffic(self, server: LocalServer, jobs: list[Job]) -> list[Outcome]:
        import httpx
        s = self.s
        limits = httpx.Limits(max_connections=s.concurrency * 2)
        async with httpx.AsyncClient(base_url=server.url, timeout=s.timeout, limits=limits) as client:
            gate = asyncio.Semaphore(s.concurrency)
            outcomes: list[Outcome] = []
            serving = asyncio.Event()  # cleared from a kill until the worker is back: no request is sent meanwhile
            serving.set()

            async def one(job: Job) -> None:
                async with gate:
                    await serving.wait()
                    key = self.keys[job.tenant]
                    outcomes.append(await run_job(client, job, key, self.model_id, s.timeout, self.rng))

            killer = asyncio.create_task(self._inject(client, outcomes, len(jobs), serving))
            progress = asyncio.create_task(self._progress(outcomes, len(jobs)))
            await asyncio.gather(*(one(j) for j in jobs))
            killer.cancel()
            progress.cancel()
            return sorted(outcomes, key=lambda o: o.job)

    async def _progress(self, outcomes: list[Outcome], total: int) -> None:
        started = time.monotonic()
        while True:
            await asyncio.sleep(10)
            counts = Counter(o.status if o.ended == "answered" else o.ended for o in outcomes)
            say(f"  {len(outcomes)}/{total} requests in {time.monotonic() - started:.0f}s: "
                + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=str)))

    async def _inject(self, client: httpx.AsyncClient, outcomes: list[Outcome], total: int,
                      serving: asyncio.Event) -> None:
        """The kills and pauses, one at a time, evenly over the requests (``fault_plan``)."""
        plan = fault_plan(self.s.kills, self.s.pauses)
        for i, (what, role) in enumerate(plan):
            while len(outcomes) < (i + 1) * total // (len(plan) + 1):
                await asyncio.sleep(0.05)
            if what == "kill":
                await self._kill(client, role, serving)
            else:
                await self._pause(client, role)

    async def _pause(self, client: httpx.AsyncClient, role: str) -> None:
        """SIGSTOP a worker of ``role`` past the worker timeout while traffic goes on, then SIGCONT it; note when the
        router fenced it (it left the worker table) and when it was back under a new epoch."""
        health = (await client.get("/health", headers=ADMIN)).json()
        victims = [(w, i["pid"], i["epoch"]) for w, i in health["workers"].items() if i["role"] == role]
        if not victims:
            return
        worker, pid, epoch = self.rng.choice(victims)
        pause = {"role": role, "worker": worker, "pid": pid, "epoch": epoch, "fenced_at": None, "back_at": None,
                 "seconds": self.s.worker_timeout + 5}
        self.report.pauses.append(pause)
        say(f"  pausing {role} worker {worker} (pid {pid}) for {pause['seconds']:.0f}s")
        os.kill(pid, signal.SIGSTOP)
        resume = time.monotonic() + pause["seconds"]
        try:
            while time.monotonic() < resume:
                await asyncio.sleep(0.2)
                listed = (await client.get("/health", headers=ADMIN)).json()["workers"]
                if pause["fenced_at"] is None and worker not in listed:
                    pause["fenced_at"] = time.time()
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            info = (await client.get("/health", headers=ADMIN)).json()["workers"].get(worker)
            if info is not None and info["epoch"] > epoch:
                pause["back_at"] = time.time()
                break
        say(f"  {role} worker {worker}: " + ("fenced, then back under a new epoch" if pause["back_at"] else
                                              "not back under a new epoch"))

    async def _kill(self, client: httpx.AsyncClient, role: str, serving: asyncio.Event) -> None:
        """SIGKILL a worker of ``role``, mid-transfer when one comes within 2 s; hold new requests until it is back
        (those in flight then must fail cleanly, or be retried)."""
        health, deadline = (await client.get("/health", headers=ADMIN)).json(), time.monotonic() + 2
        while not health.get("transfers_in_flight") and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            health = (await client.get("/health", headers=ADMIN)).json()
        victims = [(w, i["pid"]) for w, i in health["workers"].items() if i["role"] == role]
        if not victims:  # none up at this moment (one died of a fault): pick the next kind
            return
        worker, pid = self.rng.choice(victims)
        os.kill(pid, signal.SIGKILL)
        serving.clear()
        in_flight = health.get("transfers_in_flight", 0)
        self.report.kills.append({"role": role, "worker": worker, "pid": pid, "transfers_in_flight": in_flight})
        say(f"  killed {role} worker {worker} (pid {pid}) with {in_flight} transfers in flight")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            health = (await client.get("/health", headers=ADMIN)).json()
            back = health["workers"].get(worker, {}).get("pid") not in (None, pid)
            if back and health["status"] == "ok":
                break
        else:
            self.find("not serving", f"{role} worker {worker} was not back 300s after it was killed")
        serving.set()

    # -- checks ----------------------------------------------------------------------------------

    def find(self, kind: str, detail: str) -> None:
        self.report.findings.append(Finding(kind, detail))

    def check_outcomes(self, jobs: list[Job], outcomes: list[Outcome]) -> None:
        canaries = [p.canary for p in self.prompts if p.canary]
        for job, out in zip(jobs, outcomes, strict=True):
            self.check_one(job, out, canaries)
        self.report.outcomes = {
            "requests": len(outcomes),
            "ended": dict(Counter(o.ended for o in outcomes)),
            "statuses": {str(k): v for k, v in sorted(Counter(o.status for o in outcomes if o.status).items())},
            "error_codes": dict(Counter(o.error_code for o in outcomes if o.error_code)),
            "over_length": sum(j.over_length for j in jobs),
            "client_left": dict(Counter(j.leave for j in jobs if j.leave)),
        }

    def check_one(self, job: Job, out: Outcome, canaries: list[Canary]) -> None:
        where = f"request {job.i} ({job.tenant}, {job.prompt.key!r})"
        own_prompt = " ".join(c for _, c in job.prompt.messages)
        for c in canaries:
            found = specific_fragments(c, out.text, own_prompt) if c.tenant != job.tenant else []
            if found:
                self.find("leak", f"{where} got {c.tenant}'s {', '.join(found)}: {out.text[:120]!r}")
        if out.ended == "hung":
            self.find("hung", f"{where}: no status within {self.s.timeout}s")
        if out.ended != "answered" and out.status is None:
            return
        if job.over_length:
            if out.status != 400:
                self.find("wrong status", f"{where} over the context answered {out.status}")
            return
        if out.status is not None and 400 <= out.status < 500:
            self.find("wrong status", f"{where} fits yet answered {out.status} ({out.error_code})")
        if out.status == 200:
            ref = self.reference[job.prompt.key]
            complete = out.ended == "answered" and out.error_code is None
            if (complete and out.text != ref) or not ref.startswith(out.text):
                self.find("incoherent", f"{where}: {out.text[:80]!r} but alone {ref[:80]!r}")

    def check_pools(self, server: LocalServer) -> None:
        """Once idle, no worker holds a page; every quarantined page has a reason."""
        deadline = time.monotonic() + 4 * self.s.handoff_timeout + 30
        while True:
            health = server.health(ADMIN_KEY)
            busy = {w: i for w, i in health.get("workers", {}).items()
                    if i["total_pages"] - i["free_pages"] - i["quarantined_pages"]}
            if not health.get("in_flight") and not busy and health.get("status") == "ok":
                break
            if time.monotonic() > deadline:
                for w, i in busy.items():
                    self.find("page leak", f"{i['role']} worker {w} still holds "
                                           f"{i['total_pages'] - i['free_pages'] - i['quarantined_pages']} pages idle")
                if health.get("in_flight"):
                    self.find("hung", f"the router still tracks {health['in_flight']} requests when idle")
                break
            time.sleep(0.5)
        for w, i in health.get("workers", {}).items():
            reasons = i.get("quarantine_reasons", {})
            self.report.pools[w] = {k: i[k] for k in ("role", "total_pages", "free_pages", "quarantined_pages")} | {
                "quarantine_reasons": reasons}
            if sum(reasons.values()) != i["quarantined_pages"]:
                self.find("page leak", f"{w}: {i['quarantined_pages']} pages quarantined, "
                                       f"{sum(reasons.values())} with a reason")

    def worker_pids(self, server: LocalServer) -> dict[str, int]:
        return {w: i["pid"] for w, i in server.health(ADMIN_KEY).get("workers", {}).items()}

    def check_restarts(self, before: dict[str, int], after: dict[str, int]) -> None:
        """Each worker's pid changes once per kill of it; more changes mean a crash (e.g. a failed integrity check)."""
        kills = Counter(k["worker"] for k in self.report.kills)
        for worker, pid in after.items():
            if before.get(worker) not in (None, pid) and not kills[worker]:  # None: it joined after the start
                self.find("unexpected restart", f"worker {worker} restarted (pid {before.get(worker)} -> {pid}) "
                                                "though the soak did not kill it")

    def check_still_serves(self, server: LocalServer) -> int:
        """Plain chats after the storm. Faults are still on, so each may fail and is retried up to 3 times (a drained
        or dead server fails every try; a 200 with a wrong answer is never retried). Returns requests sent."""
        prompts = [p for p in self.prompts if p.tenant is None and not p.token_ids]

        async def ask() -> tuple[int, list[bool]]:
            import httpx
            sent, ok = 0, []
            async with httpx.AsyncClient(base_url=server.url, timeout=self.s.timeout) as client:
                for p in prompts:
                    for _ in range(4):
                        job = Job(-1, self.tenants[0], p, stream=False, max_tokens=self.s.max_tokens)
                        out = await run_job(client, job, self.keys[job.tenant], self.model_id, self.s.timeout,
                                            self.rng)
                        sent += 1
                        if out.status == 200:
                            break
                    ok.append(out.status == 200 and out.text == self.reference[p.key])
            return sent, ok

        sent, ok = asyncio.run(ask())
        if not all(ok):
            self.find("not serving", f"after the soak only {sum(ok)}/{len(ok)} plain chats came back right")
        return sent

    def check_fencing(self, records: list) -> None:
        """Each pause fenced its worker and the worker came back; no request sent to a decode worker before it was
        fenced got its 200 after (that would be output of a fenced epoch reaching a client)."""
        for p in self.report.pauses:
            where = f"{p['role']} worker {p['worker']} paused {p['seconds']:.0f}s"
            if p["fenced_at"] is None or p["back_at"] is None:
                self.find("fencing", f"{where}: " + ("never fenced" if p["fenced_at"] is None else "never back"))
                continue
            if p["role"] != "decode":
                continue
            late = [r.rid for r in records if r.decode == p["worker"] and r.decode_epoch <= p["epoch"]
                    and r.status == 200 and r.time > p["fenced_at"]]
            if late:
                self.find("fencing", f"{where}: {len(late)} requests sent to it before its fence got a 200 after, "
                                     f"e.g. {late[:3]}")

    def check_shm(self, before: set[Path]) -> None:
        """Once the server has stopped, none of the KV segments it made is left in ``/dev/shm``."""
        left = sorted(set(stale_segments()) - before)
        if left:
            self.find("shm leak", f"{len(left)} KV segments outlive the server: {[str(p) for p in left[:3]]}")

    def check_audit(self, path: Path, outcomes: list[Outcome], answered: int) -> None:
        """One record per request: each 200's under its id; in all, one per answered request plus at most one per
        client that left (none if it left before its request reached the server)."""
        problems: list[str] = []
        with open(path, "rb") as f:
            records = list(read_records(f, problems))
        left = sum(o.ended == "disconnected" for o in outcomes)
        by_rid = Counter(r.rid for r in records)
        missing = [o.job for o in outcomes if o.ended == "answered" and o.rid and by_rid[o.rid] != 1]
        if problems or missing or not answered <= len(records) <= answered + left:
            self.find("audit", f"{len(records)} audit records for {answered} answered requests and {left} clients "
                               f"that left; 200s without exactly one record: {missing[:5]}; malformed: {problems[:3]}")
        self.report.outcomes["audit_statuses"] = {str(k): v for k, v in sorted(Counter(r.status for r in records)
                                                                                .items())}
        self.check_fencing(records)


def fault_plan(kills: int, pauses: int) -> list[tuple[str, str]]:
    """(``"kill"`` or ``"pause"``, role), interleaved: kills alternate prefill and decode, pauses decode and
    prefill."""
    kill = [("kill", ("prefill", "decode")[k % 2]) for k in range(kills)]
    pause = [("pause", ("decode", "prefill")[k % 2]) for k in range(pauses)]
    plan = [f for pair in zip(kill, pause, strict=False) for f in pair]
    return plan + kill[len(plan) // 2:] + pause[len(plan) // 2:]


def stale_segments() -> list[Path]:
    """This user's shm KV segments whose owner is gone."""
    from kvfence.transfer.shm import DEFAULT_DIR, sweep_stale

    return sweep_stale(DEFAULT_DIR, unlink=False)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def verification_failures(server: LocalServer) -> dict[str, float]:
    import httpx
    text = httpx.get(server.url + "/metrics", headers=ADMIN, timeout=10).text
    found = re.findall(r'^kvfence_kv_verification_failures_total\{layer="(\w+)"\} ([\d.e+]+)$', text, re.M)
    return {layer: float(n) for layer, n in found}


# -- report and command --------------------------------------------------------------------------


def render(report: Report) -> str:
    o = report.outcomes
    lines = [f"kvfence soak: {o.get('requests', 0)} requests in {report.seconds:.0f}s",
             f"  ended:         {o.get('ended')}",
             f"  statuses:      {o.get('statuses')}",
             f"  error codes:   {o.get('error_codes')}",
             f"  over-length:   {o.get('over_length')}   clients left: {o.get('client_left')}",
             f"  kills:         {len(report.kills)} "
             f"({sum(1 for k in report.kills if k['transfers_in_flight'])} with transfers in flight)",
             f"  pauses:        {len(report.pauses)} "
             f"({sum(1 for p in report.pauses if p['fenced_at'] and p['back_at'])} fenced and back)",
             f"  caught on landing: {report.verification_failures}",
             f"  canary codes repeated by the model alone: {report.canaries_repeated:.0%}"]
    for w, p in report.pools.items():
        lines.append(f"  {p['role']:7} {w}: {p['free_pages']}/{p['total_pages']} free, {p['quarantined_pages']} "
                     f"quarantined {p['quarantine_reasons'] or ''}")
    kinds = Counter(f.kind for f in report.findings)
    lines.append("findings: " + (", ".join(f"{k}: {v}" for k, v in kinds.items()) if kinds else "none"))
    lines += [f"  [{f.kind}] {f.detail}" for f in report.findings[:20]]
    return "\n".join(lines)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def add_soak_parser(sub) -> None:
    d = SoakSettings()
    p = sub.add_parser("soak", help="run the whole system under mixed traffic with injected faults, then check it",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=d.requests, help="requests under faults")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight")
    p.add_argument("--tenants", type=int, default=d.tenants, help="tenants, each with its own key and codes")
    p.add_argument("--model", default=d.model, help="model to serve (name or Hugging Face directory)")
    p.add_argument("--max-context", type=int, default=d.max_context, help="served context length")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max_tokens of every request")
    p.add_argument("--faults", default=d.faults, help="KVFENCE_FAULTS for the server under test")
    p.add_argument("--kills", type=int, default=d.kills, help="workers to SIGKILL, evenly over the requests")
    p.add_argument("--pauses", type=int, default=d.pauses,
                   help="workers to SIGSTOP for --worker-timeout + 5 s (then SIGCONT), between the kills")
    p.add_argument("--worker-timeout", type=float, default=d.worker_timeout, metavar="S",
                   help="the server's --worker-timeout")
    p.add_argument("--disconnect", type=float, default=d.disconnect,
                   help="share of clients that leave mid-handoff (and again, of streams, mid-stream)")
    p.add_argument("--handoff-timeout", type=float, default=d.handoff_timeout, metavar="S",
                   help="the servers' --handoff-timeout")
    p.add_argument("--timeout", type=float, default=d.timeout, metavar="S", help="a client's patience")
    p.add_argument("--seed", type=int, default=None, help="seed for traffic, codes, kills (default: fresh)")
    p.add_argument("--serve-args", default="", help="more 'kvfence serve' arguments, e.g. '--transfer tcp'")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    p.add_argument("--workdir", default=None, help="keep server logs and audit logs here (default: a temp dir)")
    p.set_defaults(func=cmd_soak)


def cmd_soak(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_USAGE))  # unwind, so that the servers are stopped
    settings = SoakSettings(args.requests, args.concurrency, args.tenants, args.model, args.max_context, args.faults,
                            args.kills, args.pauses, args.worker_timeout, args.disconnect, args.max_tokens,
                            args.handoff_timeout, args.timeout, args.seed, tuple(args.serve_args.split()),
                            env.unsafe())
    if settings.tenants < 2 or settings.requests < 1 or settings.max_tokens < 2:
        print("kvfence soak: needs at least 2 tenants, 1 request and max_tokens 2", file=sys.stderr)
        return EXIT_USAGE
    with tempfile.TemporaryDirectory(prefix="kvfence-soak-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            report = Soak(settings, workdir).run()
        except (RuntimeError, TimeoutError) as exc:
            print(f"kvfence soak: {exc}", file=sys.stderr)
            return EXIT_USAGE
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=1, default=str))
    return EXIT_CLEAN if report.clean else EXIT_FINDINGS
