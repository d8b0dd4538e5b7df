"""Ogg pages (RFC 3533) of one logical stream, written one packet per page.

The page checksum is Ogg's CRC-32 (polynomial 0x04C11DB7, most significant bit first, no
reflection, initial value and final XOR 0).  ``zlib.crc32`` computes the bit-reflected form
of the same polynomial, so it gives Ogg's value over the bytes with their bits reversed, read
back reversed: the loop runs in C, a page costs a few microseconds of the interpreter lock.
"""

from __future__ import annotations

import struct
import zlib

_REVERSED_BITS = bytes(int(f"{byte:08b}"[::-1], 2) for byte in range(256))
_HEADER = struct.Struct("<4sBBqIIIB")  # capture, version, flags, granule, serial, sequence, crc, segments

FLAG_CONTINUED = 0x01
FLAG_FIRST = 0x02  # beginning of stream
FLAG_LAST = 0x04  # end of stream
MAX_PACKET_BYTES = 255 * 255 - 1  # what one page's 255 lacing values can hold (and end)


def ogg_crc(data: bytes) -> int:
    reflected = zlib.crc32(data.translate(_REVERSED_BITS), 0xFFFFFFFF) ^ 0xFFFFFFFF
    return int(f"{reflected:032b}"[::-1], 2)


def page(packet: bytes, *, granule: int, serial: int, sequence: int, flags: int = 0) -> bytes:
    """One page holding exactly ``packet`` (at most ``MAX_PACKET_BYTES``)."""
    if len(packet) > MAX_PACKET_BYTES:
        raise ValueError(f"a packet of {len(packet)} bytes does not fit one page")
    full, rest = divmod(len(packet), 255)
    lacing = b"\xff" * full + bytes((rest,))
    header = _HEADER.pack(b"OggS", 0, flags, granule, serial, sequence, 0, len(lacing)) + lacing
    crc = ogg_crc(header + packet)
    return header[:22] + crc.to_bytes(4, "little") + header[26:] + packet


class OggWriter:
    """Pages of one stream: the first carries the beginning-of-stream flag, sequence numbers
    count up from 0."""

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self._sequence = 0

    def page(self, packet: bytes, granule: int) -> bytes:
        flags = FLAG_FIRST if self._sequence == 0 else 0
        out = page(packet, granule=granule, serial=self.serial, sequence=self._sequence, flags=flags)
        self._sequence += 1
        return out
