"""The Quart application: HTTP status routes and the realtime websocket routes.

Handlers here only read bookkeeping and hand websockets to ``Connection``; no tensor and no
engine call is ever made on the event loop.
"""

from __future__ import annotations

import hmac
import logging
import time

from quart import Quart, Response, jsonify, websocket

from engines.factory import create_engine

from .connection import Connection
from .services import EngineFactory, Services
from .settings import Settings

log = logging.getLogger(__name__)

_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def create_app(settings: Settings | None = None, engine_factory: EngineFactory = create_engine) -> Quart:
    """Build the server.  ``settings=None`` reads ``PERSONAPLEX_*`` when serving starts, so
    importing ``orchestrator:app`` has no side effects."""
    app = Quart("personaplex")
    holder: dict[str, Services] = {}
    started_at = int(time.time())

    def services() -> Services:
        return holder["services"]

    @app.before_serving
    async def start() -> None:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        holder["services"] = Services(settings or Settings.from_env(), engine_factory)
        services().start()

    @app.after_serving
    async def stop() -> None:
        if "services" in holder:
            services().stop()

    @app.get("/health")
    async def health() -> Response:
        status, body = services().health()
        return jsonify(body), status

    @app.get("/ready")
    async def ready() -> Response:
        status, body = services().readiness()
        return jsonify(body), status

    @app.get("/v1/models")
    async def models() -> Response:
        svc = services()
        info = svc.scheduler.info
        if info is None:
            return jsonify({"error": {"type": "server_error", "code": "engine_unavailable",
                                      "message": "the model is still loading"}}), 503
        return jsonify({"object": "list", "data": [{
            "id": svc.model_name, "object": "model", "created": started_at, "owned_by": "personaplex-serve",
            "root": info.model, "backend": info.backend, "device": info.device, "demo": info.is_demo,
            "max_sessions": svc.max_sessions,
        }]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(services().metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.websocket("/v1/realtime")
    async def realtime():
        if request_arg("duplex", "1").lower() in _OFF:
            # Only the duplex handler is mounted here (reference: turn-based is "not available").
            await Connection(websocket, services(), url_model=None, autostart=False).refuse_unsupported()
            return None
        return await serve_duplex()

    @app.websocket("/v1/duplex")
    async def duplex():
        return await serve_duplex()

    async def serve_duplex():
        svc = services()
        if svc.settings.api_keys and not _authorized(svc.settings.api_keys):
            return Response('{"error":{"type":"authentication_error","code":"invalid_api_key",'
                            '"message":"missing or unknown API key (Authorization: Bearer <key>)"}}',
                            status=401, content_type="application/json")
        await websocket.accept()
        model = request_arg("model", "") or None
        autostart = request_arg("autostart", "").lower() in _ON
        await Connection(websocket, svc, url_model=model, autostart=autostart).run()
        return None

    return app


def request_arg(name: str, default: str) -> str:
    return websocket.args.get(name, default)


def _authorized(keys: tuple[str, ...]) -> bool:
    header = websocket.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return any(hmac.compare_digest(token.strip().encode(), key.encode()) for key in keys)
