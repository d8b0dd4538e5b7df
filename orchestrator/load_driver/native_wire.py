"""The native ``/api/chat`` protocol as the load driver speaks it (``--protocol native``):
the URL, the input frames as Ogg/Opus messages, and the duration of each Opus packet that
comes back (read from its TOC byte, RFC 6716 section 3.1, so a packet's arrival counts
its samples without decoding it on the clock: ``opus_packet_samples``, shared with the server)."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

from orchestrator.protocol.ogg_opus import OggOpusEncoder, opus_packet_samples

__all__ = ["chat_url", "frame_messages", "opus_packet_samples", "page_packets"]

AUDIO_KIND = 1
OPUS_HEADER_MAGICS = (b"OpusHead", b"OpusTags")


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
