"""The Quart application: HTTP status routes and the websocket routes (``/v1/realtime``,
``/v1/duplex``: the Realtime protocol; ``/api/chat``: PersonaPlex's native protocol).

Handlers here only read bookkeeping and hand websockets to ``Connection``; no tensor and no
engine call is ever made on the event loop.
"""

from __future__ import annotations

import json
import logging
import time

from quart import Quart, Response, jsonify, request, websocket

from engines.interface import shown

from ..protocol.errors import ProtocolError
from ..settings import Settings, StartupError
from .access import Caller
from .connection import Connection
from .inbound import bounded_websocket_class
from .memory_bound import describe, inbound_limit
from .native_connection import NativeConnection
from .services import Services
from .start_failure import end_start_up
from .transport_bounds import bound_message_assembly, bound_transport_close, live_connections
from .web import register_web
from .ws_compression import refuse_permessage_deflate
from .ws_drain import DrainAfterClose

log = logging.getLogger(__name__)

_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def create_app(settings: Settings | None = None, *, exit_on_start_failure: bool = False) -> Quart:
    """Build the server.  ``settings=None`` reads ``PERSONAPLEX_*`` when serving starts, so
    importing ``orchestrator:app`` has no side effects.  ``exit_on_start_failure``: a start-up that
    cannot succeed ends this process with one line and a nonzero status (the served app,
    ``orchestrator:app``); otherwise it raises (an app embedded in a test or a tool)."""
    refuse_permessage_deflate()  # client bytes are limited as sent, never inflated (ws_compression.py)
    app = Quart("personaplex")
    app.asgi_app = DrainAfterClose(app.asgi_app)  # no connection task left waiting on a closed socket
    holder: dict[str, Services] = {}
    started_at = int(time.time())

    def services() -> Services:
        return holder["services"]

    @app.before_serving
    async def start() -> None:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            resolved = settings or Settings.from_env()
            resolved.check_checkpoint_available()
            holder["services"] = Services(resolved)
            services().start()
            await services().wait_engines()
        except StartupError as exc:
            if exit_on_start_failure:
                end_start_up(str(exc))
            raise
        _bound_host_memory(app, services())

    @app.after_serving
    async def stop() -> None:
        if "services" in holder:
            services().stop()

    @app.get("/health")
    async def health() -> Response:
        await services().refresh()
        status, body = services().health()
        return jsonify(body), status

    @app.get("/ready")
    async def ready() -> Response:
        # ?require_free_slot=1: also 503 "full" when a new session would be refused for
        # capacity, so that a balancer's health check stops sending a full replica clients.
        require_free_slot = request.args.get("require_free_slot", "").lower() in _ON
        await services().refresh()
        status, body = services().readiness(require_free_slot=require_free_slot)
        return jsonify(body), status

    @app.get("/v1/models")
    async def models() -> Response:
        svc = services()
        info = svc.pool.info
        if info is None:
            return jsonify({"error": {"type": "server_error", "code": "engine_unavailable",
                                      "message": "the model is still loading"}}), 503
        return jsonify({"object": "list", "data": [{
            "id": svc.model_name, "object": "model", "created": started_at, "owned_by": "personaplex-serve",
            "root": info.model, "backend": info.backend, "device": info.device, "demo": info.is_demo,
            "devices": [engine.label for engine in svc.pool.engines], "max_sessions": svc.max_sessions,
        }]})

    @app.get("/metrics")
    async def metrics() -> Response:
        await services().refresh()
        return Response(services().metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.websocket("/v1/realtime")
    async def realtime():
        if request_arg("duplex", "1").lower() in _OFF:
            caller = _gate(services())
            if isinstance(caller, Response):
                return caller
            refused = _connection_gate(services())
            if refused is not None:
                return refused
            # Only the duplex handler is mounted here (reference: turn-based is "not available").
            await Connection(websocket, services(), url_model=None, autostart=False).refuse_unsupported()
            return None
        return await serve_duplex()

    @app.websocket("/v1/duplex")
    async def duplex():
        return await serve_duplex()

    async def serve_duplex():
        svc = services()
        client = await _accept(svc)
        if isinstance(client, Response):
            return client
        model = request_arg("model", "") or None
        autostart = request_arg("autostart", "").lower() in _ON
        await Connection(websocket, svc, url_model=model, autostart=autostart, client=client).run()
        return None

    @app.websocket("/api/chat")
    async def native_chat():
        """NVIDIA's PersonaPlex protocol: the same gate as the Realtime route (origin, API key,
        ``PERSONAPLEX_REFUSE_WHEN_FULL=http``), then ``NativeConnection``."""
        svc = services()
        client = await _accept(svc)
        if isinstance(client, Response):
            return client
        await NativeConnection(websocket, svc, client=client).run(websocket.args)
        return None

    register_web(app, services)  # the browser page and /v1/voices (web.py)
    return app


def _bound_host_memory(app: Quart, svc: Services) -> None:
    """What a client can make this worker hold (docs/ORCHESTRATOR.md, "Host memory"): the
    messages its handler has not read, the message hypercorn assembles, a closed connection's
    transport; the bound is logged once per server."""
    settings = svc.settings
    app.asgi_websocket_class = bounded_websocket_class(inbound_limit(settings))
    bound_message_assembly(settings.max_event_bytes)
    bound_transport_close(settings.close_timeout_s)
    if svc.speaks_for_server:
        log.info("%s", describe(settings))


def request_arg(name: str, default: str) -> str:
    return websocket.args.get(name, default)


async def _accept(svc: Services) -> tuple[str, str | None] | Response:
    """Both websocket routes: the gate, then (``PERSONAPLEX_REFUSE_WHEN_FULL=http``) the
    placement check, then the upgrade.  The caller (address, API key digest) for the
    per-client limits, or the HTTP reply that refuses it."""
    caller = _gate(svc)
    if isinstance(caller, Response):
        return caller
    refused = _connection_gate(svc)
    if refused is not None:
        return refused
    if svc.settings.refuse_when_full == "http":
        refused = _placement_gate(svc)
        if refused is not None:
            return refused
    await websocket.accept(subprotocol=caller.subprotocol)
    return svc.access.client_address(websocket.scope, websocket.headers), caller.key_id


def _gate(svc: Services) -> Caller | Response:
    """Origin and API key checks before the websocket is accepted: a refused caller gets one
    HTTP reply (403 or 401) and never a websocket."""
    headers = websocket.headers
    client = websocket.scope.get("client")
    if not svc.access.origin_allowed(headers, str(client[0]) if client else None):
        svc.metrics.inc("connections_refused", "origin")
        return _http_error(403, "origin_not_allowed", f"origin {shown(headers.get('Origin'))} is not allowed here "
                           "(PERSONAPLEX_ALLOWED_ORIGINS)")
    caller = svc.access.authenticate(headers, websocket.args, websocket.requested_subprotocols)
    if caller is None:
        svc.metrics.inc("connections_refused", "auth")
        return _http_error(401, "invalid_api_key", "missing or unknown API key (send Authorization: Bearer <key>, "
                           "the subprotocol openai-insecure-api-key.<key>, or ?api_key=<key>)")
    return caller


def _connection_gate(svc: Services) -> Response | None:
    """Past ``max_connections_per_worker`` connections held by this worker (this one, and
    those still closing, included) a websocket gets an HTTP 503 with ``Retry-After``: what a
    worker holds is bounded by that many connections' worth (memory_bound.py)."""
    limit = svc.settings.max_connections_per_worker
    if live_connections() <= limit:
        return None
    svc.metrics.inc("connections_refused", "worker_full")
    response = _http_error(503, "connection_limit_exceeded", f"this server worker already holds {limit} "
                           "connections (PERSONAPLEX_MAX_CONNECTIONS_PER_WORKER); try again later")
    response.headers["Retry-After"] = "1"
    return response


def _placement_gate(svc: Services) -> Response | None:
    """``PERSONAPLEX_REFUSE_WHEN_FULL=http``: a handshake whose session.update would be
    refused now (full, draining, no engine serving) gets an HTTP 503 with ``Retry-After``
    instead of a websocket, so a balancer can retry it on another replica.  The check at
    session.update still applies (another client may take the last slot in between)."""
    refusal = svc.open_refusal()
    if refusal is None:
        return None
    error, reason = refusal
    svc.count_refusal(reason)
    response = _http_error(503, error.code, error.message)
    response.headers["Retry-After"] = "1"
    return response


def _http_error(status: int, code: str, message: str) -> Response:
    body = {"error": ProtocolError(code, message).payload()}
    return Response(json.dumps(body), status=status, content_type="application/json")
