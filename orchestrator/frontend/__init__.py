"""The front-end worker: HTTP routes, websockets, sessions, access and limits, and the links
to the engines.

Runs on one asyncio event loop per hypercorn worker and never touches tensors.  A session's
frames go to its engine, in an engine process, through its ``EnginePort``
(``engine_link.py``); ``engine_pool.py`` places sessions over the engines, one per device.
"""
