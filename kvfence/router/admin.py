"""The admin API: private models and drained workers, for holders of an ``[admin]`` key.

Routes (all under ``/admin``, ``Authorization: Bearer <admin key>``; 401 without a valid key, 403 for a tenant's
key; errors in OpenAI's format):

- ``GET /admin/models``; ``POST /admin/models/{model}/private`` with an optional body ``{"tenants": [...]}``
  naming the tenants still allowed; ``POST /admin/models/{model}/public``.
- ``GET /admin/workers``; ``POST /admin/workers/{worker}/drain`` and ``.../undrain``, where ``worker`` is a
  worker id (URL-encoded: ids are ZeroMQ addresses) or its ``index`` in ``GET /admin/workers``.
- ``GET /admin/prefixes``; ``POST /admin/prefixes`` with ``{"messages": [...]}`` (rendered with the chat template,
  no generation prompt) or ``{"prompt": text or token ids}`` publishes a prefix every tenant's cached pages may
  share (``router/prefixes.py``); ``DELETE /admin/prefixes/{id}`` withdraws it.

Contracts:

- A private model is, to every tenant not allowed, exactly an unknown model: 404 ``model_not_found``, and
  absent from ``/v1/models``.
- A drained worker gets no new request; requests it already has finish normally. With every worker of a role
  drained (colocated: the one engine), a new request gets 503.
- Every change is logged with the admin's name, never the key.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, NamedTuple, Protocol, runtime_checkable

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from kvfence.core import InvalidRequest, NotFound, RequestOutput, ServiceUnavailable
from kvfence.core import Request as EngineRequest
from kvfence.engine.client import EngineClient
from kvfence.router.edge import path_param
from kvfence.router.prefixes import PublicPrefixes
from kvfence.router.schemas import PublishPrefixRequest, invalid_request, parse_body, strict_json
from kvfence.router.tenants import Tenants

log = logging.getLogger("kvfence.admin")
LOCAL_WORKER = "local"  # the id of a colocated engine in GET /admin/workers
ROUTES_KEPT = 65536


class ModelAccess:
    """Which tenants may use which model. A model not made private is open to every tenant."""

    def __init__(self) -> None:
        self._private: dict[str, frozenset[str]] = {}  # model -> the tenants still allowed

    def visible(self, model: str, tenant: str) -> bool:
        allowed = self._private.get(model)
        return allowed is None or tenant in allowed

    def make_private(self, model: str, allowed: frozenset[str]) -> None:
        self._private[model] = allowed

    def make_public(self, model: str) -> None:
        self._private.pop(model, None)

    def describe(self, model: str) -> dict:
        """``tenants``: the tenants allowed, or ``None`` when the model is public."""
        allowed = self._private.get(model)
        return {"id": model, "private": allowed is not None, "tenants": None if allowed is None else sorted(allowed)}


@runtime_checkable
class ManagedEngine(EngineClient, Protocol):
    """An engine whose workers can be listed and drained, and that says where each request ran."""

    def worker_table(self) -> list[dict]:
        """One entry per worker, ordered by ``id``: at least ``id``, ``role`` and ``drained``."""
        ...

    def set_drained(self, worker: str, drained: bool) -> None:
        """Take ``worker`` out of rotation or put it back; ``KeyError`` if it is unknown."""
        ...

    def route(self, rid: int) -> Route | None:
        """The workers a recent request was sent to (its last attempt's); ``None`` if it never reached one."""
        ...


class Route(NamedTuple):
    prefill: str
    decode: str
    decode_epoch: int = 0  # the decode worker's membership epoch when the request was sent to it


class RecentRoutes:
    """The routes of the last ``ROUTES_KEPT`` requests: bounded, whoever forgets to look them up."""

    def __init__(self) -> None:
        self._routes: OrderedDict[int, Route] = OrderedDict()

    def add(self, rid: int, route: Route) -> None:
        self._routes[rid] = route
        if len(self._routes) > ROUTES_KEPT:
            self._routes.popitem(last=False)

    def get(self, rid: int) -> Route | None:
        return self._routes.get(rid)


class Colocated:
    """A one-engine client (colocated) as a ``ManagedEngine``, with the one worker ``local``.

    Drained, every new request gets 503 before the engine sees it; otherwise ``generate`` is the engine's own
    iterator. A request the engine saw ran on (``local``, ``local``).
    """

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.drained = False
        self._routes = RecentRoutes()

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if self.drained:
            return _refused(ServiceUnavailable("The engine is drained; try again later."))
        self._routes.add(request.rid, Route(LOCAL_WORKER, LOCAL_WORKER))
        return self.engine.generate(request)

    def health(self) -> dict:
        return self.engine.health()

    def worker_table(self) -> list[dict]:
        return [{"id": LOCAL_WORKER, "role": "colocated", "drained": self.drained}]

    def set_drained(self, worker: str, drained: bool) -> None:
        if worker != LOCAL_WORKER:
            raise KeyError(worker)
        self.drained = drained

    def route(self, rid: int) -> Route | None:
        return self._routes.get(rid)


async def _refused(err: ServiceUnavailable) -> AsyncIterator[RequestOutput]:
    """An engine iterator that raises ``err`` before any output."""
    raise err
    yield  # an async generator


def managed(engine: EngineClient) -> ManagedEngine:
    """``engine`` itself if it is a ``ManagedEngine`` (disaggregated), else ``Colocated(engine)``."""
    return engine if isinstance(engine, ManagedEngine) else Colocated(engine)


class PrivateBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    tenants: list[str] = []


def admin_router(engine: ManagedEngine, access: ModelAccess, prefixes: PublicPrefixes,
                 prefix_ids: Callable[[PublishPrefixRequest], list[int]]) -> APIRouter:
    """The ``/admin`` routes over ``engine``'s workers, the ``access`` rules of its model and its published
    ``prefixes``; ``prefix_ids`` turns a publish body into tokens (called off the event loop)."""
    router = APIRouter(prefix="/admin")

    @router.get("/models")
    async def list_models(_: Admin) -> dict:
        return {"object": "list", "data": [access.describe(engine.model_name)]}

    @router.post("/models/{model:path}/private")
    async def make_private(model: str, http: Request, admin: Admin) -> dict:
        model = path_param(model)
        _check_model(engine, model)
        allowed = frozenset((await _private_body(http)).tenants)
        _check_tenants(http.app.state.tenants, allowed)
        access.make_private(model, allowed)
        log.info("admin %s made model %s private (allowed tenants: %s)", admin, model,
                 ", ".join(sorted(allowed)) or "none")
        return access.describe(model)

    @router.post("/models/{model:path}/public")
    async def make_public(model: str, admin: Admin) -> dict:
        model = path_param(model)
        _check_model(engine, model)
        access.make_public(model)
        log.info("admin %s made model %s public", admin, model)
        return access.describe(model)

    @router.get("/workers")
    async def list_workers(_: Admin) -> dict:
        return {"object": "list", "data": _indexed(engine.worker_table())}

    @router.post("/workers/{worker:path}/drain")
    async def drain(worker: str, admin: Admin) -> dict:
        return _set_drained(engine, worker, True, admin)

    @router.post("/workers/{worker:path}/undrain")
    async def undrain(worker: str, admin: Admin) -> dict:
        return _set_drained(engine, worker, False, admin)

    @router.get("/prefixes")
    async def list_prefixes(_: Admin) -> dict:
        return {"object": "list", "data": [p.describe() for p in prefixes]}

    @router.post("/prefixes")
    async def publish(http: Request, admin: Admin) -> dict:
        body = parse_body(await http.body(), PublishPrefixRequest)
        if body.model is not None:
            _check_model(engine, body.model)
        ids = await asyncio.to_thread(prefix_ids, body)
        prefix = prefixes.publish(ids, admin)
        log.info("admin %s published prefix %s (%d tokens)", admin, prefix.id, len(ids))
        return prefix.describe()

    @router.delete("/prefixes/{prefix_id}")
    async def withdraw(prefix_id: str, admin: Admin) -> dict:
        try:
            prefix = prefixes.withdraw(prefix_id)
        except KeyError:
            raise NotFound(f"No published prefix `{prefix_id}`; see GET /admin/prefixes.", param="prefix_id",
                           code="prefix_not_found") from None
        log.info("admin %s withdrew prefix %s", admin, prefix.id)
        return {"id": prefix.id, "object": "prefix", "deleted": True}

    return router


async def _admin_of(http: Request) -> str:
    return http.app.state.gate.admin(http)


async def _private_body(http: Request) -> PrivateBody:
    """The optional body of ``.../private``, read within the edge's limits and parsed as strictly as /v1's."""
    raw = await http.body()
    if not raw.strip():
        return PrivateBody()
    try:
        return PrivateBody.model_validate(strict_json(raw))
    except ValidationError as e:
        raise invalid_request(e.errors()) from None


Admin = Annotated[str, Depends(_admin_of)]


def _check_model(engine: EngineClient, model: str) -> None:
    if model != engine.model_name:
        raise NotFound(f"The model `{model}` does not exist.", param="model")


def _check_tenants(tenants: Tenants, allowed: frozenset[str]) -> None:
    unknown = sorted(allowed - set(tenants.names))
    if unknown:
        raise InvalidRequest(f"Unknown tenants: {', '.join(unknown)}.", param="tenants")


def _indexed(table: list[dict]) -> list[dict[str, Any]]:
    return [{"index": i, **entry} for i, entry in enumerate(table)]


def _resolve(engine: ManagedEngine, ref: str) -> str:
    """A worker id from an id (URL-encoded) or an index into ``GET /admin/workers``; 404 when neither names a
    worker."""
    ref = path_param(ref)
    ids = [entry["id"] for entry in engine.worker_table()]
    if ref.isdigit() and int(ref) < len(ids):
        return ids[int(ref)]
    if ref in ids:
        return ref
    raise NotFound(f"No worker `{ref}`; see GET /admin/workers.", param="worker", code="worker_not_found")


def _set_drained(engine: ManagedEngine, ref: str, drained: bool, admin: str) -> dict:
    """Drain or undrain; the worker's new entry (a gone worker, once undrained, has left the table)."""
    worker = _resolve(engine, ref)
    engine.set_drained(worker, drained)
    log.info("admin %s %s worker %s", admin, "drained" if drained else "undrained", worker)
    entries = [e for e in _indexed(engine.worker_table()) if e["id"] == worker]
    return entries[0] if entries else {"id": worker, "drained": drained, "live": False}
