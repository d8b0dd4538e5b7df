"""personaplex-serve orchestrator: the Realtime duplex websocket server.

``hypercorn orchestrator:app`` serves it; configuration comes from ``PERSONAPLEX_*``
environment variables (see ``orchestrator.settings``), read when serving starts.
"""

from .routes import create_app

app = create_app()

__all__ = ["app", "create_app"]
