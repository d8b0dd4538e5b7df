"""The native ``/api/chat`` protocol as the load driver speaks it (``--protocol native``):
the URL, the input frames as Ogg/Opus messages, and the duration of each Opus packet that
comes back (read from its TOC byte, RFC 6716 section 3.1, so a packet's arrival counts
its samples without decoding it on the clock)."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

from orchestrator.protocol.ogg_opus import OggOpusEncoder

from .wire import SAMPLE_RATE_HZ

AUDIO_KIND = 1
OPUS_HEADER_MAGICS = (b"OpusHead", b"OpusTags")
# Frame duration of each TOC configuration, in units of 1/400 s (2.5 ms): SILK 10/20/40/60 ms,
# hybrid 10/20 ms, CELT 2.5/5/10/20 ms.
_CONFIG_QUARTER_MS = (4, 8, 16, 24) * 3 + (4, 8) * 2 + (1, 2, 4, 8) * 4


def chat_url(base_url: str, *, voice: str, persona: str) -> str:
    """``ws(s)://HOST:PORT/api/chat?text_prompt=...&voice_prompt=...`` on the host of ``base_url``
    (which may name the Realtime route: only its scheme and host are kept)."""
    parts = urlsplit(base_url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    keep = {key: value for key, value in query.items() if key == "api_key"}
    return urlunsplit((parts.scheme, parts.netloc, "/api/chat",
                       urlencode({**keep, "text_prompt": persona, "voice_prompt": voice}), ""))


def frame_messages(frames: np.ndarray) -> list[bytes]:
    """One ``0x01`` message per 80 ms input frame (float32 [n, 1920]), the first with the Ogg
    stream's header pages: every session of a run sends the same bytes, encoded once."""
    encoder = OggOpusEncoder()
    return [bytes([AUDIO_KIND]) + b"".join(encoder.encode(frame)) for frame in frames]


def opus_packet_samples(packet: bytes, rate: int = SAMPLE_RATE_HZ) -> int:
    """Samples at ``rate`` that one Opus packet decodes to (0 for an empty or malformed one)."""
    if not packet:
        return 0
    toc = packet[0]
    code = toc & 3
    if code == 0:
        count = 1
    elif code in (1, 2):
        count = 2
    elif len(packet) > 1:
        count = packet[1] & 0x3F
    else:
        return 0
    return _CONFIG_QUARTER_MS[toc >> 3] * count * rate // 400


def page_packets(page: bytes) -> list[bytes] | None:
    """The packets that complete on one whole Ogg page (a packet continued from an earlier
    page is not handled: the server writes one or more whole packets per page); None when
    ``page`` is not one whole Ogg page."""
    if len(page) < 27 or not page.startswith(b"OggS"):
        return None
    segments = page[26]
    lacing = page[27:27 + segments]
    if len(lacing) != segments or len(page) != 27 + segments + sum(lacing):
        return None
    packets, start, size = [], 27 + segments, 0
    for value in lacing:
        size += value
        if value < 255:
            packets.append(page[start:start + size])
            start, size = start + size, 0
    return packets
