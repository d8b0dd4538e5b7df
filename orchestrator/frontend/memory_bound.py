"""The host memory one connection can make a front-end worker hold, and a worker in all.

Computed here, from the settings, and nowhere else (docs/ORCHESTRATOR.md, "Host memory",
states it; the worker logs it at start).  Every term is enforced where it is named; a
connection that would go past one is closed (``output_backpressure``, ``input_backpressure``)
or the event refused.  With O = ``max_output_buffer_bytes``, E = ``max_event_bytes``,
P = ``max_pending_input_bytes`` and W = E + 1 MiB (the largest message hypercorn assembles
for the app, ``transport_bounds.largest_message``), all counted as ``protocol.held_bytes``:

- ``outbox`` = 2·O + 2·M (``session_core.Outbox``): queued events once, the one being sent
  ``IN_FLIGHT_COPIES`` (3) times, errors and endings up to 2·O; moving an event into flight
  adds twice its cost, and no event is larger than M, the session object echoed in
  ``session.updated`` (at most O/8 of client fields plus ``SESSION_FIXED_BYTES``) or an audio
  delta.
- ``inbound`` = (P + E) + 2.5·W: the messages the handler has not read (``inbound.py``: as
  much as a client may send before its session opens, and one event more), and the one
  hypercorn is assembling (``transport_bounds.py``: its buffer, with room to grow, and the
  message made of it).
- ``input`` = 2·P (+ 2 × ``max_native_message_bytes``): the events held before
  ``session.update`` (at most P, as their text, ``connection.py``) and the frames waiting
  for the model (P); on ``/api/chat`` those frames, the decoded audio not yet taken (at most
  P: the decoder's budget) and the Opus bytes waiting for the decoding thread
  (``native_session.py``).
- ``session`` = O/8: the client's fields of the session object, objects included
  (``session_config.client_fields_bytes``; more is ``session_too_large``).
- ``fixed`` = ``CONNECTION_BYTES``: the connection's own objects (hypercorn's, Quart's, the
  session's, its resampler and codec state).

A worker holds at most ``max_connections_per_worker`` connections (the routes refuse more,
counting those still closing: ``transport_bounds.live_connections``), so at most that many
times the bound, plus ``handling``: the one event being handled at a time (a handler never
awaits while it runs: the message, its parse, the decoded and converted audio).  Nothing of a
message or an event stays referenced while a handler awaits the next one.
"""

from __future__ import annotations

from engines.config import FRAME_SAMPLES

from ..protocol.client_events import MAX_EVENT_VALUES
from ..protocol.session_config import VALUE_BYTES
from ..settings import Settings
from .session_core import IN_FLIGHT_COPIES
from .transport_bounds import largest_message

# The session object besides the client's fields (ids, capabilities, the server's own
# settings: ~2.5 KB), at four bytes a character when a client field makes it wide.
SESSION_FIXED_BYTES = 16 * 1024
# An audio delta besides its PCM: ids, metadata, timing (~700 bytes).
DELTA_FIXED_BYTES = 2 * 1024
# A connection's own objects: measured ~35 KB for a streaming Realtime session or a handshake
# (tiny model, 8 and 32 of them); a native session's Opus coders add tens of KB.
CONNECTION_BYTES = 1024 * 1024
ASSEMBLY_FACTOR = 2.5  # hypercorn's buffer (grown by up to a quarter) and the message made of it


def inbound_limit(settings: Settings) -> int:
    """What a websocket's client messages not yet read may cost (``inbound.py``): a client may
    pipeline what the server holds before its session opens, and one event more."""
    return settings.max_pending_input_bytes + settings.max_event_bytes


def max_session_object_bytes(settings: Settings) -> int:
    """The client's fields of a session object (persona, model, voice, audio and every echoed
    field) may cost this much, encoded: past it a ``session.update`` gets ``session_too_large``."""
    return settings.max_output_buffer_bytes // 8


def largest_event(settings: Settings) -> int:
    """The most one server event costs."""
    delta = settings.frames_per_delta * FRAME_SAMPLES * 2 * 4 // 3 + DELTA_FIXED_BYTES
    return max(max_session_object_bytes(settings) + SESSION_FIXED_BYTES, delta)


def connection_terms(settings: Settings) -> dict[str, int]:
    """The bound of one connection, term by term (bytes)."""
    largest = largest_message(settings.max_event_bytes)
    return {
        "outbox": 2 * settings.max_output_buffer_bytes + (IN_FLIGHT_COPIES - 1) * largest_event(settings),
        "inbound": max(inbound_limit(settings), largest) + int(ASSEMBLY_FACTOR * largest),
        "input": 2 * settings.max_pending_input_bytes + 2 * settings.max_native_message_bytes,
        "session": max_session_object_bytes(settings),
        "fixed": CONNECTION_BYTES,
    }


def connection_bound(settings: Settings) -> int:
    return sum(connection_terms(settings).values())


def handling_bytes(settings: Settings) -> int:
    """The one event a worker handles at a time: the message and its parse (E each, and the
    objects of up to ``MAX_EVENT_VALUES`` values), the decoded audio (3/4 E) as float32 (up to
    3 E, from G.711), and the frames it becomes (P)."""
    return 6 * settings.max_event_bytes + MAX_EVENT_VALUES * VALUE_BYTES + settings.max_pending_input_bytes


def worker_bound(settings: Settings) -> int:
    """What ``max_connections_per_worker`` connections can make one worker hold."""
    return settings.max_connections_per_worker * connection_bound(settings) + handling_bytes(settings)


def describe(settings: Settings) -> str:
    """One log line: the bound per connection, its terms, and the worker's."""
    terms = ", ".join(f"{name} {value / 2**20:.1f}" for name, value in connection_terms(settings).items())
    return (f"host memory bound: {connection_bound(settings) / 2**20:.1f} MiB per connection ({terms}); "
            f"{settings.max_connections_per_worker} connections per worker: {worker_bound(settings) / 2**30:.2f} GiB")
