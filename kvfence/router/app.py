"""The OpenAI-compatible HTTP API: auth, templating, length admission, streaming, errors.

Contracts:

- Every error leaves in OpenAI's ``{"error": {...}}`` shape with an honest
  status (I3): 4xx for the client's fault, 5xx for ours, never a 200. No
  error body names an internal address (``exposure.redact``).
- The edge (``router/edge.py``) caps and times each body and routes on the
  path as sent; there are no redirects (a trailing slash is a 404).
- A generation request is authenticated first; then its body is read, parsed
  strictly (``schemas.parse_body``), templated and tokenized off the event
  loop, fairly across tenants (``router/fair.py``).
- Length admission (L1) runs here, on the real token count, before the
  engine sees the request: ``prompt + max_tokens > max_context`` is a 400
  ``context_length_exceeded``.
- A stream's HTTP status is settled by the engine's first output: a request
  the engine rejects before its first token gets a 4xx/5xx response, not a
  200 stream carrying an error. Errors after that are a ``data: {"error":
  ...}`` event, then ``[DONE]``.
- When the client goes away, the engine iterator is not pulled again and is
  closed (``aclose``, shielded from cancellation), which aborts the request.
  An await on the engine that is in progress is cancelled.
- Each generation request of an authenticated tenant ends in exactly one
  ledger entry (log line, metrics, audit record), whether its body was too
  large, slow or invalid, the model was unknown, admission rejected it, the
  engine failed it, it finished, or the client left (status 499).
- A model an admin made private is, to every tenant not allowed, an unknown
  model (404 ``model_not_found``). ``/admin`` is the admin API
  (``router/admin.py``). Who may read ``/health``'s detail and ``/metrics``:
  ``router/exposure.py``. ``/docs``, ``/redoc`` and ``/openapi.json`` exist
  only with ``EdgeLimits.docs``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfence.auditlog import AuditLog
from kvfence.core import (
    ContextLengthExceeded,
    FinishReason,
    IntegrityError,
    InvalidRequest,
    KvfenceError,
    NotFound,
    RequestOutput,
    ServiceUnavailable,
    new_request_id,
)
from kvfence.core import Request as EngineRequest
from kvfence.engine.client import EngineClient
from kvfence.engine.grammar import grammar_for
from kvfence.router.admin import ManagedEngine, ModelAccess, admin_router, managed
from kvfence.router.edge import EdgeGuard, error_headers, path_param
from kvfence.router.exposure import FailedLogins, Gate, public_body
from kvfence.router.fair import FairPool
from kvfence.router.ledger import Ledger, RequestEnd
from kvfence.router.limits import EdgeLimits
from kvfence.router.metrics import CONTENT_TYPE, Metrics
from kvfence.router.prefixes import PublicPrefixes
from kvfence.router.responses import DONE, Format, Tokens, error_body, finish_with_calls, sse
from kvfence.router.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    GenerateBody,
    PublishPrefixRequest,
    TokenizeRequest,
    invalid_request,
    parse_body,
)
from kvfence.router.tenants import Tenants
from kvfence.router.tools import CallStream, ToolCall, ToolUse, knows_tools
from kvfence.safety import Safety

log = logging.getLogger("kvfence.router")
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; only logged and recorded, never sent
PENDING_BODIES_PER_TENANT = 8  # a tenant's bodies waiting for tokenization, in units of the largest allowed


def create_app(engine: EngineClient, tokenizer: Any, tenants: Tenants, audit: AuditLog | None = None,
               limits: EdgeLimits | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` under the OpenAI API, keys checked by ``tenants``.

    Each generation request's end is appended to ``audit`` (default: no audit log). ``limits``: the edge's
    (default ``EdgeLimits()``); the connection-level ones apply only under ``edge.uvicorn_config``.
    """
    limits = limits or EdgeLimits()
    engine = managed(engine)
    metrics = Metrics(engine, () if tenants.is_open else tenants.names)
    access = ModelAccess()
    max_bytes = limits.request_bytes(engine.max_context)
    server = OpenAIServer(engine, tokenizer, access, Ledger(engine, metrics, audit or AuditLog.null()),
                          FairPool(PENDING_BODIES_PER_TENANT * max_bytes), PublicPrefixes())
    docs: dict[str, Any] = {} if limits.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="kvfence", summary="Multi-tenant OpenAI-compatible LLM serving", redirect_slashes=False,
                  **docs)
    gate = app.state.gate = Gate(tenants, FailedLogins(metrics.auth_failures))
    app.state.tenants = tenants
    app.include_router(admin_router(engine, access, server.prefixes, server.prefix_ids))
    app.add_middleware(EdgeGuard, max_request_bytes=max_bytes, body_timeout=limits.body_timeout)
    app.add_middleware(InternalErrors)
    app.add_exception_handler(KvfenceError, _on_kvfence_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)

    @app.get("/health")
    async def health(http: Request) -> JSONResponse:
        """200 when the engine is ready, else 503; the detail only to an admin key (or in open mode)."""
        body = {"status": "ok", **engine.health(), "safety_layers_off": Safety.from_env().disabled}
        ready = body["status"] == "ok"
        if not gate.sees_detail(http):
            body = {"status": "ok" if ready else "unavailable"}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus_metrics(http: Request) -> Response:
        """Prometheus text, for an admin or metrics key (anyone in open mode); labels name tenants, never keys."""
        gate.metrics_reader(http)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(tenant: Tenant) -> dict:
        return {"object": "list", "data": server.model_cards(tenant)}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, tenant: Tenant) -> dict:
        server.check_model(path_param(model_id), tenant)
        return server.model_card()

    @app.post("/v1/chat/completions", openapi_extra=_body_doc(ChatCompletionRequest))
    async def chat_completions(http: Request, tenant: Tenant) -> Response:
        return await server.serve(http, Call(tenant, chat=True))

    @app.post("/v1/completions", openapi_extra=_body_doc(CompletionRequest))
    async def completions(http: Request, tenant: Tenant) -> Response:
        return await server.serve(http, Call(tenant, chat=False))

    @app.post("/tokenize")
    async def tokenize(http: Request, tenant: Tenant) -> dict:
        """vLLM's: the token ids a prompt (or chat) would have here, without generating."""
        raw = await http.body()
        return await server.prepare.run(tenant, len(raw), partial(server.tokenize, tenant, raw))

    @app.post("/detokenize")
    async def detokenize(http: Request, tenant: Tenant) -> dict:
        raw = await http.body()
        return await server.prepare.run(tenant, len(raw), partial(server.detokenize, tenant, raw))

    _document_bodies(app, ChatCompletionRequest, CompletionRequest)
    return app


def _body_doc(schema: type[GenerateBody]) -> dict:
    """The request body for the OpenAPI document: handlers read and validate bodies themselves."""
    ref = {"$ref": f"#/components/schemas/{schema.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _document_bodies(app: FastAPI, *schemas: type[GenerateBody]) -> None:
    """Add ``schemas`` (and the models they use) to the components of ``app``'s OpenAPI document."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            components = build().setdefault("components", {}).setdefault("schemas", {})
            for schema in schemas:
                doc = schema.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(doc.pop("$defs", {}))
                components[schema.__name__] = doc
        assert app.openapi_schema is not None  # build() stored it
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _tenant_of(http: Request) -> str:
    gate: Gate = http.app.state.gate
    return gate.tenant(http)


# Dependencies run before the body is read: without a valid key, nothing about the body is read or said.
Tenant = Annotated[str, Depends(_tenant_of)]


# -- serving -------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One tenant's generation request as it arrived, before its body is read."""

    tenant: str
    chat: bool
    rid: int = field(default_factory=new_request_id)
    created: int = field(default_factory=lambda: int(time.time()))
    arrived: float = field(default_factory=time.monotonic)

    @property
    def param(self) -> str:
        """The field a length error points at."""
        return "messages" if self.chat else "prompt"

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def schema(self) -> type[ChatCompletionRequest] | type[CompletionRequest]:
        return ChatCompletionRequest if self.chat else CompletionRequest


@dataclass
class Job:
    """A call being prepared: its body once parsed, its prompt once tokenized and its grammar once compiled (filled
    in on a worker thread)."""

    call: Call
    body: ChatCompletionRequest | CompletionRequest | None = None
    prompt_ids: list[int] = field(default_factory=list)
    grammar: str | None = None  # from response_format or a required tool call (engine/grammar.py)
    echo: str | None = None  # the prompt's text, when the completion starts with it
    tools: ToolUse | None = None  # set when the output is read for tool calls


class OpenAIServer:
    """Turns request bodies into engine requests and engine outputs into responses."""

    def __init__(self, engine: ManagedEngine, tokenizer: Any, access: ModelAccess, ledger: Ledger,
                 prepare: FairPool, prefixes: PublicPrefixes) -> None:
        self.engine = engine
        self.prefixes = prefixes
        self.tokenizer = tokenizer
        self.access = access
        self.ledger = ledger
        self.started = int(time.time())
        # Parsing, templating and tokenizing run off the event loop, one job per tenant at a time and round-robin
        # across tenants: a huge body stalls neither the loop nor another tenant. The tokenizer and the chat
        # template must be safe to call from two threads (tokenizers' Rust encoder and jinja2 are).
        self.prepare = prepare

    def model_card(self) -> dict:
        name = self.engine.model_name
        return {"id": name, "object": "model", "created": self.started, "owned_by": "kvfence", "root": name,
                "parent": None, "max_model_len": self.engine.max_context}

    def model_cards(self, tenant: str) -> list[dict]:
        """The models ``tenant`` may use: the served one, unless it is private to others."""
        return [self.model_card()] if self.access.visible(self.engine.model_name, tenant) else []

    def check_model(self, model: str | None, tenant: str) -> None:
        """``None`` (omitted) means the served model; anything else must name it. Either way ``tenant`` must be
        allowed to use it, else it does not exist for them."""
        name = self.engine.model_name
        if (model is not None and model != name) or not self.access.visible(name, tenant):
            raise NotFound(f"The model `{model or name}` does not exist.", param="model")

    async def serve(self, http: Request, call: Call) -> Response:
        """Read, prepare and admit ``call``, run it on the engine, and answer as JSON or as an SSE stream.

        A call that fails before the engine gets it ends in its ledger entry here; one that reaches the engine,
        in ``Generation.close``.
        """
        job = Job(call)
        try:
            raw = await http.body()
            await self.prepare.run(call.tenant, len(raw), partial(self._prepare, job, raw))
            request = self.admit(job)
        except (ClientDisconnect, asyncio.CancelledError) as err:
            self.ledger.record(replace(self._end(job), status=CLIENT_CLOSED))
            if isinstance(err, ClientDisconnect):
                return Response(status_code=CLIENT_CLOSED)  # nobody reads it
            raise
        except Exception as err:
            self.ledger.record(self._end(job).rejected(_as_kvfence(err)))
            raise
        assert job.body is not None
        spell = self.tokenizer.token_bytes if job.body.logprobs_wanted is not None else None
        fmt = Format.for_request(call.chat, call.rid, call.created, self.engine.model_name, job.body.include_usage,
                                 spell)
        gen = Generation(self.engine, request, self._end(job), self.ledger)
        if job.body.stream:
            return await self._stream(http, gen, fmt, job)
        return await self._complete(http, gen, fmt, job)

    def _end(self, job: Job) -> RequestEnd:
        """The ledger entry of ``job`` as far as it got, to be completed with its outcome."""
        call, body = job.call, job.body
        model = body.model if body is not None and body.model else self.engine.model_name
        prompt_tokens = len(job.prompt_ids)
        max_tokens = self._max_tokens(body, prompt_tokens) if body is not None else 0
        return RequestEnd(call.tenant, call.rid, model, call.endpoint, call.arrived, prompt_tokens, max_tokens)

    def _prepare(self, job: Job, raw: bytes) -> None:
        """On a worker thread: parse and check ``raw``, then template and tokenize it into ``job``."""
        job.body = body = parse_body(raw, job.call.schema)
        self.check_model(body.model, job.call.tenant)
        if isinstance(body, ChatCompletionRequest):
            tools = body.tool_use()
            if body.response_format is not None:
                job.grammar = grammar_for(body.response_format.as_dict(), self.tokenizer)
            if tools is not None and tools.parses:
                job.tools, job.grammar = tools, job.grammar or tools.grammar()
            job.prompt_ids = self._encode(self._chat_text(body.messages, tools))
        elif isinstance(body.prompt, str):
            job.prompt_ids = self._encode(body.prompt)
            job.echo = body.prompt if body.echo else None
        else:
            job.prompt_ids = self._checked_ids(body.prompt)
            job.echo = self.tokenizer.decode(body.prompt) if body.echo else None

    def tokenize(self, tenant: str, raw: bytes) -> dict:
        """On a worker thread: ``/tokenize``'s answer for ``raw`` (a ``TokenizeRequest``)."""
        body = parse_body(raw, TokenizeRequest)
        self.check_model(body.model, tenant)
        if body.messages is not None:
            text = self._chat_text(body.messages, None, body.add_generation_prompt)
        else:
            text = body.prompt or ""
        ids = self._encode(text)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if not body.add_special_tokens and ids and ids[0] == bos:
            ids = ids[1:]
        strs = [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.engine.max_context, "tokens": ids, "token_strs": strs}

    def prefix_ids(self, body: PublishPrefixRequest) -> list[int]:
        """On a worker thread: the tokens of a ``POST /admin/prefixes`` body, as a request that starts with the
        prefix would begin (see ``PublishPrefixRequest``); checked against the context."""
        if body.messages is not None:
            ids = self._encode(self._chat_text(body.messages, None, add_generation_prompt=False))
        elif isinstance(body.prompt, str):
            ids = self._encode(body.prompt)
        else:
            assert body.prompt is not None  # check(): a prompt where there are no messages
            ids = self._checked_ids(body.prompt)
        if len(ids) >= self.engine.max_context:
            raise InvalidRequest(f"The prefix has {len(ids)} tokens; a request must fit it and at least one more "
                                 f"in the context of {self.engine.max_context}.", param="prompt")
        return ids

    def detokenize(self, tenant: str, raw: bytes) -> dict:
        """On a worker thread: ``/detokenize``'s answer for ``raw`` (a ``DetokenizeRequest``)."""
        body = parse_body(raw, DetokenizeRequest)
        self.check_model(body.model, tenant)
        if body.tokens:
            self._checked_ids(body.tokens, param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def admit(self, job: Job) -> EngineRequest:
        """L1: settle ``max_tokens`` and reject what cannot fit the context, before any engine work.

        An omitted ``max_tokens`` means "up to the context limit", which needs at least one free token.
        """
        call, body = job.call, job.body
        assert body is not None
        prompt_len, limit = len(job.prompt_ids), self.engine.max_context
        if prompt_len == 0:
            raise InvalidRequest("The prompt is empty.", param=call.param)
        max_tokens = self._max_tokens(body, prompt_len)
        if prompt_len + max_tokens > limit:
            err = ContextLengthExceeded(prompt_len, max_tokens, limit)
            err.param = call.param
            raise err
        params = body.sampling_params(max_tokens, job.grammar)
        if params.min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({max_tokens}).",
                                 param="min_tokens")
        named = {"logit_bias": [t for t, _ in params.logit_bias], "stop_token_ids": params.stop_token_ids}
        for param, ids in named.items():
            if ids:
                self._checked_ids(list(ids), param=param)
        return EngineRequest(job.prompt_ids, params, tenant=call.tenant, rid=call.rid, cache_salt=body.cache_salt,
                             public_tokens=self.prefixes.match(job.prompt_ids))

    async def _complete(self, http: Request, gen: Generation, fmt: Format, job: Job) -> Response:
        gone = False
        try:
            outs = await unless_disconnected(http.receive, gen.run_to_end)
            gen.succeeded()
        except ClientGone:
            gone = True
            return Response(status_code=CLIENT_CLOSED)  # nobody reads it
        except Exception as err:
            gen.failed(err)
            raise
        finally:
            await gen.close(client_gone=gone)
        n = gen.request.params.n
        choices = [_choice(fmt, job, i, [o for o in outs if o.index == i], outs[0]) for i in range(n)]
        return JSONResponse(fmt.completion(choices, *gen.usage()))

    async def _stream(self, http: Request, gen: Generation, fmt: Format, job: Job) -> Response:
        try:
            first = await unless_disconnected(http.receive, gen.next)
        except ClientGone:
            await gen.close(client_gone=True)
            return Response(status_code=CLIENT_CLOSED)
        except BaseException as err:
            gen.failed(err)
            await gen.close()
            raise
        return EventStream(_events(gen, fmt, first, job), on_close=gen.close)

    def _max_tokens(self, body: GenerateBody, prompt_len: int) -> int:
        """The request's ``max_tokens``, or when omitted "up to the context limit" (at least one)."""
        requested = body.requested_max_tokens
        return requested if requested is not None else max(self.engine.max_context - prompt_len, 1)

    def _chat_text(self, messages: list[ChatMessage], tools: ToolUse | None, add_generation_prompt: bool = True) -> str:
        """The chat as the model reads it: its template, with the tools (see ``router/tools.py``)."""
        template = getattr(self.tokenizer, "chat_template", None)
        rendered = [m.for_template(knows_tools(template)) for m in messages]
        note = tools.system_note(template) if tools is not None else None
        if note is not None and rendered[0]["role"] == "system":
            rendered[0] = rendered[0] | {"content": rendered[0]["content"] + "\n\n" + note}
        elif note is not None:
            rendered.insert(0, {"role": "system", "content": note})
        extra = tools.template_kwargs(template) if tools is not None else {}
        return self._render(rendered, add_generation_prompt, **extra)

    def _render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        except (TemplateError, ValueError) as e:
            raise InvalidRequest(f"The messages could not be rendered with the chat template: {e}",
                                 param="messages") from e

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)  # the body's strings are valid Unicode (schemas.parse_body)

    def _checked_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if isinstance(vocab, int) and max(ids) >= vocab:
            raise InvalidRequest(f"Token id {max(ids)} is out of range; the vocabulary has {vocab} tokens.",
                                 param=param)
        return ids


def _choice(fmt: Format, job: Job, index: int, outs: list[RequestOutput], first: RequestOutput) -> dict:
    """Choice ``index`` of a whole response, from its outputs ``outs`` (``first``: the request's first output, which
    carries the prompt's logprobs)."""
    text = "".join(o.text for o in outs)
    content: str | None = text
    calls: list[ToolCall] = []
    if job.tools is not None:
        content, calls = job.tools.parse(text)
    tokens = tokens_of(outs)
    if job.echo is not None:
        assert content is not None  # an echo is a completion's, tool calls a chat's
        echoed = echo_tokens(job, first)
        content, tokens = job.echo + content, Tokens(echoed.ids + tokens.ids, [*echoed.logprobs, *tokens.logprobs])
    finish = next(o.choice_finish for o in reversed(outs) if o.choice_finish is not None)
    return fmt.choice(index, content, finish, tokens, calls)


def echo_tokens(job: Job, first: RequestOutput) -> Tokens:
    """The echoed prompt's tokens, with their logprobs (from the first output) when the request asked."""
    scores = first.prompt_logprobs
    return Tokens(job.prompt_ids, [None, *scores] if scores is not None else [])


def tokens_of(outs: list[RequestOutput], offset: int = 0) -> Tokens:
    """The tokens of ``outs`` and the logprobs they carry (each token has one when the request asked)."""
    return Tokens([t for o in outs for t in o.token_ids], [lp for o in outs for lp in o.logprobs or ()], offset)


def _as_kvfence(err: Exception) -> KvfenceError:
    """``err`` as the ledger records it: a ``KvfenceError`` as is, anything else an internal error (500)."""
    return err if isinstance(err, KvfenceError) else KvfenceError("Internal server error.")


async def _events(gen: Generation, fmt: Format, first: RequestOutput, job: Job) -> AsyncGenerator[bytes, None]:
    """The SSE body: for each choice, an opening chunk and the echoed prompt; then text deltas (and tool-call
    deltas, each call whole once its block closed) and a finish chunk per choice, each chunk naming its choice's
    ``index``; the usage chunk; ``[DONE]``.

    Settles ``gen``'s outcome; closing the engine iterator is ``EventStream``'s job.
    """
    n = gen.request.params.n
    calls = [CallStream(job.tools) for _ in range(n)] if job.tools is not None else None
    offsets, called = [0] * n, [0] * n
    try:
        for i in range(n):
            for chunk in fmt.opening(i):
                yield sse(chunk)
            if job.echo is not None:
                yield sse(fmt.delta(job.echo, echo_tokens(job, first), i))
                offsets[i] = len(job.echo)
        out = first
        while True:
            i = out.index
            pieces: list[str | ToolCall] = [out.text] if calls is None else calls[i].feed(out.text)
            if out.choice_finish is not None and calls is not None:
                pieces += calls[i].finish()
            text = "".join(p for p in pieces if isinstance(p, str))
            if text or out.logprobs:
                yield sse(fmt.delta(text, tokens_of([out], offsets[i]), i))
                offsets[i] += len(out.text)
            for call in (p for p in pieces if isinstance(p, ToolCall)):
                yield sse(fmt.tool_call(called[i], call, i))
                called[i] += 1
            if out.choice_finish is not None:
                yield sse(fmt.finish(finish_with_calls(out.choice_finish, called[i] > 0), i))
            if out.finished:
                break
            out = await gen.next()
        if fmt.include_usage:
            yield sse(fmt.usage_chunk(*gen.usage()))
        gen.succeeded()
    except KvfenceError as err:
        gen.failed(err)
        yield sse(public_body(err))
    except Exception as err:
        log.exception("stream of rid=%032x failed", gen.request.rid)
        gen.failed(err)
        yield sse(public_body(KvfenceError("Internal server error.")))
    yield DONE


class Generation:
    """One request's engine iterator, consumed by exactly one handler.

    ``next`` returns the outputs in order and raises the engine's error as
    ``KvfenceError``, whether the iterator raised it or an output carried it;
    it times the first token and each later one. Handlers settle the outcome
    with ``succeeded`` or ``failed`` (unsettled, it is a 500). ``close``
    closes the iterator (which aborts an unfinished request in the engine)
    shielded from cancellation, and records the request's end in the ledger.
    It runs its effects once; later calls do nothing.
    """

    def __init__(self, engine: EngineClient, request: EngineRequest, end: RequestEnd, ledger: Ledger) -> None:
        self.request = request
        self.prompt_len = request.prompt_len  # as admitted; the engine may not change it
        self.end = end
        self.ledger = ledger
        self._it = engine.generate(request)
        self._tokens = 0
        self._last: RequestOutput | None = None
        self._closed = False
        self._started = self._token_at = time.monotonic()
        self._first_at: float | None = None  # when the first token came
        self._queue_time = 0.0
        self._cached = 0  # prompt tokens read from the prefix cache

    async def next(self) -> RequestOutput:
        try:
            out = await anext(self._it)
        except StopAsyncIteration:
            raise KvfenceError("The engine ended the request without finishing it.") from None
        self._check(out)
        if out.queue_time is not None:
            self._queue_time = out.queue_time
            self.ledger.metrics.queued(self.request.tenant, out.queue_time)
        if self._last is None:
            self._cached = out.cached_tokens
            self.ledger.metrics.prefix_cache(self.request.tenant, self.prompt_len, out.cached_tokens)
        self._time(len(out.token_ids))
        self._tokens += len(out.token_ids)
        self._last = out
        return out

    async def run_to_end(self) -> list[RequestOutput]:
        outs = [await self.next()]
        while not outs[-1].finished:
            outs.append(await self.next())
        return outs

    def usage(self) -> tuple[int, int, int]:
        """(prompt_tokens, completion_tokens, cached_tokens): the admitted prompt; the engine's completion count,
        else ours; the prompt tokens the engine read from the prefix cache (its first output says)."""
        return self.prompt_len, (self._last.completion_tokens if self._last else 0) or self._tokens, self._cached

    def succeeded(self) -> None:
        self.end = replace(self.end, status=200)

    def failed(self, err: BaseException) -> None:
        """The request ends with ``err``; anything but a ``KvfenceError`` is an internal error."""
        if not isinstance(err, KvfenceError):
            err = KvfenceError("Internal server error.")
        self.end = self.end.rejected(err)

    async def close(self, client_gone: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        aclose = getattr(self._it, "aclose", None)
        with anyio.CancelScope(shield=True):
            try:
                if aclose is not None:
                    await aclose()
            except Exception:  # the engine's cleanup failed; the handler's own outcome still stands
                log.exception("closing the engine iterator of rid=%032x failed", self.request.rid)
        if self._first_at is not None:
            self.ledger.metrics.served(self.request.tenant, self._first_at - self._started - self._queue_time,
                                       time.monotonic() - self._first_at)
        end = replace(self.end, output_tokens=self.usage()[1], last=self._last)
        self.ledger.record(replace(end, status=CLIENT_CLOSED, error=None) if client_gone else end)

    def _time(self, tokens: int) -> None:
        if not tokens:
            return
        now = time.monotonic()
        if self._tokens == 0:
            self._first_at = now
            self.ledger.metrics.first_token(self.request.tenant, now - self._started)
        else:
            self.ledger.metrics.later_tokens(now - self._token_at, tokens)
        self._token_at = now

    def _check(self, out: RequestOutput) -> None:
        if out.error is not None:
            raise out.error
        if out.finish_reason is FinishReason.ERROR:
            raise KvfenceError("The engine failed the request.")
        if out.finish_reason is FinishReason.ABORT:
            raise ServiceUnavailable("The request was aborted by the server.")
        if out.prompt_tokens and out.prompt_tokens != self.prompt_len:
            # The engine computed another prompt than the one admitted (the incident's 1-token placeholder).
            raise IntegrityError(f"The engine reported {out.prompt_tokens} prompt tokens for a "
                                 f"{self.prompt_len}-token prompt.")


# -- disconnects ---------------------------------------------------------------


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, fn: Callable[[], Awaitable[T]]) -> T:
    """Await ``fn()``; if the client disconnects first, cancel it and raise ``ClientGone``.

    Only call once the request body has been read: this consumes ``receive``.
    Exceptions from ``fn`` propagate unchanged (not as an exception group).
    """
    results: list[T] = []
    errors: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await _until_disconnect(receive)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            results.append(await fn())
        except Exception as e:
            errors.append(e)
        tg.cancel_scope.cancel()
    if errors:
        raise errors[0]
    if not results:
        raise ClientGone()
    return results[0]


class EventStream(StreamingResponse):
    """An SSE response that stops pulling events once the client disconnects.

    Afterwards, whatever happened, it closes the event generator and then
    awaits ``on_close(client_gone)``, both shielded from cancellation.
    """

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[bool], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events  # body_iterator, as the generator it is
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = False
        try:
            await unless_disconnected(receive, partial(self.stream_response, send))
        except (ClientGone, OSError):
            gone = True
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
                await self._on_close(gone)


# -- errors --------------------------------------------------------------------


def _error_response(err: KvfenceError) -> JSONResponse:
    return JSONResponse(public_body(err), status_code=err.status, headers=error_headers(err))


async def _on_kvfence_error(_: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, KvfenceError)
    return _error_response(err)


async def _on_validation_error(_: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, RequestValidationError)
    return _error_response(invalid_request(list(err.errors())))


async def _on_http_error(http: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, StarletteHTTPException)
    if err.status_code in (404, 405):
        message = f"Invalid URL ({http.method} {http.url.path})"
    else:
        message = str(err.detail)
    return JSONResponse(error_body(message, "invalid_request_error"), status_code=err.status_code,
                        headers=err.headers)


class InternalErrors:
    """ASGI middleware: an unexpected exception becomes a logged 500 in OpenAI's format.

    If the response has already started, the exception is logged and re-raised:
    the server then drops the connection.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await _error_response(KvfenceError("Internal server error."))(scope, receive, send)
