"""JSON for the per-frame message path: orjson, with the strictness the protocol needs.

Every 80 ms a session's event loop decodes one ``input_audio_buffer.append`` (~10 kB) and
encodes an audio delta (~6 kB) and a transcript delta; at 128 sessions that is ~4,800
messages a second on one interpreter.  Measured on the 2-core dev VM (2026-12-01): decoding
an append 11.4 -> 6.6 us, encoding an audio delta 30.1 -> 1.9 us (docs/PERFORMANCE.md, "What
the front end costs per message": timeit figures, no raw file kept).

Strictness, as before for anything a client can send: NaN, Infinity and out-of-range numbers
(``1e999``) are not JSON numbers and are refused, and so is nesting deeper than 1024 and any
string that is not valid Unicode (a lone surrogate).  One difference from the standard
library: an integer beyond 64 bits is read as a float (the settings that take integers then
refuse it as not an integer).  ``dumps`` is only given what the server built from parsed,
finite values and its own clocks.
"""

from __future__ import annotations

from typing import Any

import orjson


class InvalidJSON(ValueError):
    """The text is not strict JSON; the message says why (without quoting it at length)."""


def loads(text: str | bytes) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(str(exc)) from None


def dumps(value: Any) -> str:
    """Compact JSON text (no spaces), as a ``str`` for a websocket text frame.  numpy scalars
    are written as numbers (the standard library took ``numpy.float64``, a float subclass;
    orjson needs the option).  Unlike ``json.dumps(allow_nan=False)`` a non-finite float would
    become ``null`` rather than raise: none reaches here (see above)."""
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode("utf-8")
