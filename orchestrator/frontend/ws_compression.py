"""permessage-deflate off: every websocket message arrives as sent.

hypercorn offers the permessage-deflate extension to every client that asks (it has no
setting for it), and its message size limit, like ours, applies to the *inflated* bytes: a
client could send 1.7 MiB that inflate to 1.7 GiB, and the worker spends the memory and the
CPU before any limit sees a byte (issue 18).  What our clients send is base64 PCM or Opus
pages, which deflate little, so nothing is lost by refusing it: the handshake then answers
without ``Sec-WebSocket-Extensions``, the client sends plain frames, and a compressed frame
(RSV1 set) is a protocol error that closes the connection before it is inflated.

hypercorn builds its extension list from ``hypercorn.protocol.ws_stream.PerMessageDeflate``
on each handshake; ``refuse_permessage_deflate`` puts a subclass there that declines every
offer.  It is called when the app is built, in every worker process.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def refuse_permessage_deflate() -> bool:
    """Make hypercorn decline permessage-deflate; False (and a warning) if this hypercorn
    is not laid out as expected."""
    try:
        from hypercorn.protocol import ws_stream
        from wsproto.extensions import PerMessageDeflate
    except ImportError:  # not served by hypercorn: nothing to patch
        return False
    current = getattr(ws_stream, "PerMessageDeflate", None)
    if current is None or not (isinstance(current, type) and issubclass(current, PerMessageDeflate)):
        log.warning("could not turn permessage-deflate off: hypercorn.protocol.ws_stream has no PerMessageDeflate")
        return False
    if getattr(current, "declines_every_offer", False):
        return True

    class DeclinedDeflate(PerMessageDeflate):
        declines_every_offer = True

        def accept(self, offer: Any) -> bool:  # not enabled: frames with RSV1 are refused
            return False

    ws_stream.PerMessageDeflate = DeclinedDeflate
    return True
