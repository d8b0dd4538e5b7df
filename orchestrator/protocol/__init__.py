"""What crosses the client's websocket: event parsing and building, session configuration,
audio formats and the client-visible errors.  Pure data in, pure data out: no sockets, no
engine, no threads (so the front end, the tests and the fuzzers use it alike).
"""
