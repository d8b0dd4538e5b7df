"""personaplex-serve orchestrator: the Realtime duplex websocket server, its command-line
client (``orchestrator.client``) and its load driver (``orchestrator.load_driver``).

``hypercorn orchestrator:app`` serves it; configuration comes from ``PERSONAPLEX_*``
environment variables (see ``orchestrator.settings``), read when serving starts.

``app`` is built on its first ASGI call, not at import: the client and the load driver live
in this package and must import without Quart, hypercorn or torch.  (hypercorn looks ``app``
up with ``eval`` over the module's namespace, so a module ``__getattr__`` would not do.)
"""

from __future__ import annotations

from typing import Any


def create_app(*args: Any, **kwargs: Any) -> Any:
    """The Quart app (``orchestrator.frontend.routes.create_app``); imported here on demand."""
    from .frontend.routes import create_app as build

    return build(*args, **kwargs)


class _AppOnDemand:
    """An ASGI callable that builds the server's app once, on the first call (lifespan
    start-up under hypercorn), and forwards every call to it."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:
            self._app = create_app(exit_on_start_failure=True)
        await self._app(scope, receive, send)


app = _AppOnDemand()

__all__ = ["app", "create_app"]
