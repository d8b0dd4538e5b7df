"""The lockstep: one engine thread that advances every live session of a device by one frame
per tick (``scheduler.py``), with its engine's loading (``loading.py``) and prefill jobs
(``joins.py``), and the decision of when to tick as a pure function (``tick_policy.py``).  Runs in the engine process (``engine_host/``); the front end reaches it
through ``engine_port.EnginePort``.
"""
