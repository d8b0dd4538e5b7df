"""The front-end worker: HTTP routes, websockets, sessions, access and limits, and the links
to the engines.

Runs on one asyncio event loop per hypercorn worker and never touches tensors.  A session's
frames go to its engine through ``engine_link.py`` (the engine in an engine process, the
default) or straight to a ``TickScheduler`` of this process (``PERSONAPLEX_ENGINE_HOST=thread``);
``engine_pool.py`` places sessions over the engines, one per device.
"""
