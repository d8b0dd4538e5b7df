"""The wire between the front-end workers and the engine processes.

One engine process per device binds a ZeroMQ ROUTER socket on a Unix-domain endpoint of the
server's run directory (``endpoints.py``); every front-end worker connects one DEALER to
each engine.  A message is a multipart frame list: its kind, a small JSON header and, for
audio, raw numpy buffers that cross without a copy into JSON or base64 (``wire.py``).
"""
