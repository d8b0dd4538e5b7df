"""The browser page and what it needs from the server: ``GET /`` (the talk page),
``GET /static/<file>`` (its scripts) and ``GET /v1/voices`` (the voice and persona pickers).

The page is plain files in ``orchestrator/static`` (no build step, nothing from a CDN) and
speaks the same websocket protocol as every other client; nothing here touches a session.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from quart import Quart, Response, abort, jsonify, send_from_directory

from engines.config import DEFAULT_PERSONA, DEFAULT_VOICE

from ..protocol.errors import ProtocolError
from .services import Services

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
SERVED_FILES = frozenset(path.relative_to(STATIC_DIR).as_posix() for path in STATIC_DIR.rglob("*") if path.is_file())

# Persona presets offered by the page (free text is always possible).  The default persona
# is the model's own (what an empty ``instructions`` gets); the others are the reference
# load driver's personas, so a page session can be compared with a driver run.
PERSONA_PRESETS = (
    DEFAULT_PERSONA,
    "You are a concise and helpful assistant.",
    "You are a calm and precise assistant.",
    "You are a cheerful travel assistant.",
)


def register_web(app: Quart, services: Callable[[], Services]) -> None:
    """Add the page routes to ``app``; ``services`` gives the running server's state."""

    @app.get("/")
    async def index() -> Response:
        return await static_file("index.html")

    async def static_file(filename: str) -> Response:
        # Only the files shipped are served: a client's name never reaches the file system
        # (a name too long for it was a 500; one leaving STATIC_DIR, a 404 anyway).
        if filename not in SERVED_FILES:
            abort(404)
        response = await send_from_directory(STATIC_DIR, filename)
        # The page is tiny and changes with the server version: never serve a stale one.
        response.headers["Cache-Control"] = "no-cache"
        return response

    # Quart mounts its own "static" endpoint at /static/<filename>, reading ./static of the
    # working directory with a 12 h cache: serve the package's files there instead.
    if "static" in app.view_functions:
        app.view_functions["static"] = static_file
    else:
        app.add_url_rule("/static/<path:filename>", "static", static_file)

    @app.get("/v1/voices")
    async def voices() -> Response:
        svc = services()
        info = svc.pool.info
        if info is None:  # the voices are known once the engine has loaded
            loading = ProtocolError("engine_unavailable", "the model is still loading; retry shortly", retryable=True)
            return jsonify({"error": loading.payload()}), 503
        names = list(svc.pool.voices)
        default = DEFAULT_VOICE if DEFAULT_VOICE in names or not names else names[0]
        return jsonify({
            "object": "list",
            "data": [{"id": name, "object": "voice", "name": name.removesuffix(".pt"), "default": name == default}
                     for name in names],
            "default_voice": default,
            "default_persona": DEFAULT_PERSONA,
            "personas": list(PERSONA_PRESETS),
            "model": svc.model_name,
            "demo": info.is_demo,
            "max_sessions": svc.max_sessions,
        })
