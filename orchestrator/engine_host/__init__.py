"""The engine side of the server: one process per device running its lockstep scheduler.

``host.py`` is the engine host: started by the first front-end worker of a server, it starts
one engine process per device (``engine_process.py``), restarts one that dies and stops them
all when the server's hypercorn process has gone.  ``launch.py`` is what a worker calls to
find (or start) the host of its server.  The front end's side of the wire is
``orchestrator/frontend/engine_link.py``.
"""
