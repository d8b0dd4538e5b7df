"""What one copy of a websocket message costs the worker to hold, at most.

Every bound on what a session makes the server hold (its outbox, the client messages not yet
read, the session object it has echoed back) counts messages this way: ``bytes`` as their
length; a ``str`` of ASCII as its length (one byte a character in memory and on the wire); any
other ``str`` as four bytes a character.  That is what Python may store for it (a single
character beyond U+FFFF makes every character of the string four bytes wide) and what its
UTF-8 encoding may take, so a client cannot make a message cost more than it is counted by
choosing its characters.  ``str.isascii`` is O(1): nothing is encoded to count.
"""

from __future__ import annotations

WIDE_CHAR_BYTES = 4
# What a queued message's own objects take besides its text, in any of the worker's queues:
# the string or bytes header, the queue's tuple and slot, its bookkeeping (~170 bytes on
# CPython 3.11), rounded up.  Many tiny messages cost this each, not nothing.
ITEM_BYTES = 256


def held_bytes(message: str | bytes | bytearray | memoryview | None) -> int:
    """(None, which Quart hands on for an empty binary message, costs nothing.)"""
    if isinstance(message, str):
        return len(message) if message.isascii() else WIDE_CHAR_BYTES * len(message)
    return 0 if message is None else len(message)
