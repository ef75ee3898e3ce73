"""The whole-file check of a FLAC answer (`audio/flac`, what OpenAI-style speech servers give for `flac`).

FLAC frames carry no length, so unlike MP3 a FLAC file cannot be walked frame by frame without decoding it. Each
frame ends with a CRC-16 of all of it, though, and opens with a header (sync code, the frame's position in the
stream, its block size) guarded by a CRC-8. So the check finds the last frame from the end: the latest header
whose CRC-8 holds and from which the CRC-16 holds up to the end of the data. A body cut inside a frame has no
such header (the cut frame's CRC-16 fails, and so does every earlier one's over the bytes after it); a body cut
between two frames ends before the stream's total of samples (STREAMINFO), where the encoder wrote one.

Pure functions: no I/O, no third-party code.
"""

from __future__ import annotations

import struct

from animastor_tasks.generators.audio_frames import CutShort, NotMedia, skip_id3v2

_STREAMINFO_SIZE = 34
_ID3V1_SIZE = 128
_LONGEST_HEADER = 16  # sync and codes (4), a 7-byte number, a 16-bit block size and sample rate, the CRC-8
_HEADERS_TRIED = 4  # a false sync code with a good CRC-8 inside the last frame is rare; four in a row is none
_FIXED_BLOCK_SIZES = {1: 192, **{c: 576 << (c - 2) for c in range(2, 6)}, **{c: 256 << (c - 8) for c in range(8, 16)}}


def _crc_table(polynomial: int, width: int) -> tuple[int, ...]:
    top, mask = 1 << (width - 1), (1 << width) - 1
    table = []
    for byte in range(256):
        crc = byte << (width - 8)
        for _ in range(8):
            crc = ((crc << 1) ^ polynomial) & mask if crc & top else (crc << 1) & mask
        table.append(crc)
    return tuple(table)


_CRC8 = _crc_table(0x07, 8)
_CRC16 = _crc_table(0x8005, 16)


def crc8(data: bytes) -> int:
    """FLAC's frame header CRC: polynomial 0x07, initial value 0, not reflected."""
    crc = 0
    for byte in data:
        crc = _CRC8[crc ^ byte]
    return crc


def crc16(data: bytes) -> int:
    """FLAC's frame CRC: polynomial 0x8005, initial value 0, not reflected. Over a frame and its own CRC: 0."""
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[(crc >> 8) ^ byte]
    return crc


def check_flac(data: bytes) -> None:
    """ValueError unless `data` is a FLAC stream whose metadata is whole, whose last frame is whole (its CRC-16
    holds up to the end, an ID3v1 tag after it aside), and which ends on the last sample its STREAMINFO declares
    (where that total is known: an encoder may write 0)."""
    at = skip_id3v2(data, "FLAC")
    if not data.startswith(b"fLaC", at):
        if b"fLaC".startswith(data[at:]) and len(data) > at:
            raise CutShort(f"FLAC cut short: {len(data) - at} bytes of its fLaC marker")
        raise NotMedia("not a FLAC file: no fLaC marker at its start")
    at += 4
    max_block, total, at = _metadata(data, at)
    if _frame_header(data, at, len(data), max_block) is None:
        rest = data[at : at + 2]
        if at == len(data):
            raise CutShort("FLAC cut short: no audio frame after its metadata")
        if len(data) - at < _LONGEST_HEADER and rest[0] == 0xFF and (len(rest) == 1 or rest[1] & 0xFE == 0xF8):
            raise CutShort(f"FLAC cut short: {len(data) - at} bytes of its first frame")
        raise ValueError(f"not a FLAC file: no frame header after its metadata (byte {at})")
    end = len(data)
    last = _last_frame(data, at, end, max_block)
    if last is None and data[-_ID3V1_SIZE:].startswith(b"TAG") and end - _ID3V1_SIZE > at:
        end -= _ID3V1_SIZE
        last = _last_frame(data, at, end, max_block)
    if last is None:
        raise CutShort("FLAC cut short: no whole frame ends where the data does (its last frame fails its CRC)")
    if total and last < total:
        raise CutShort(f"FLAC cut short: its frames end at sample {last}, its STREAMINFO declares {total}")


def _metadata(data: bytes, at: int) -> tuple[int, int, int]:
    """(the largest block size, the total of samples or 0, where the first frame starts) from the metadata blocks
    after the fLaC marker, the first of which must be STREAMINFO."""
    first = True
    while True:
        if len(data) - at < 4:
            raise CutShort(f"FLAC cut short: in the metadata block header at byte {at}")
        kind, size = data[at] & 0x7F, int.from_bytes(data[at + 1 : at + 4], "big")
        last = data[at] & 0x80
        if first:
            if kind != 0 or size != _STREAMINFO_SIZE:
                raise ValueError("not a FLAC file: its first metadata block is no STREAMINFO")
            if len(data) - at - 4 < size:
                raise CutShort("FLAC cut short: in its STREAMINFO block")
            max_block = struct.unpack_from(">H", data, at + 6)[0]
            total = int.from_bytes(data[at + 17 : at + 22], "big") & 0xFFFFFFFFF  # the low 36 of 40 bits
            first = False
        if at + 4 + size > len(data):
            raise CutShort(f"FLAC cut short: the metadata block at byte {at} declares {size + 4} bytes")
        at += 4 + size
        if last:
            return max_block, total, at


def _last_frame(data: bytes, start: int, end: int, max_block: int) -> int | None:
    """The sample the frame that ends at `end` ends on, None when no frame between `start` and `end` does."""
    tried = 0
    at = end
    while tried < _HEADERS_TRIED:
        at = data.rfind(b"\xff", start, at)
        if at < 0:
            return None
        header = _frame_header(data, at, end, max_block)
        if header is not None:
            tried += 1
            if crc16(data[at:end]) == 0:
                first_sample, block = header
                return first_sample + block
    return None


def _frame_header(data: bytes, at: int, end: int, max_block: int) -> tuple[int, int] | None:
    """(the frame's first sample, its block size) when a frame header whose CRC-8 holds starts at `at` and ends
    before `end`, else None. A fixed-blocksize stream numbers its frames: all but the last hold the largest
    block size."""
    head = data[at : min(at + _LONGEST_HEADER, end)]
    if len(head) < 6 or head[0] != 0xFF or head[1] & 0xFE != 0xF8:
        return None
    variable, block_code, rate_code = head[1] & 1, head[2] >> 4, head[2] & 0xF
    channels, size_code = head[3] >> 4, (head[3] >> 1) & 7
    if block_code == 0 or rate_code == 15 or channels > 10 or size_code == 3 or head[3] & 1:
        return None
    number, length = _coded_number(head, 4)
    if number is None:
        return None
    pos = 4 + length
    if block_code in (6, 7):
        width = 1 if block_code == 6 else 2
        block = int.from_bytes(head[pos : pos + width], "big") + 1
        pos += width
    else:
        block = _FIXED_BLOCK_SIZES[block_code]
    pos += {12: 1, 13: 2, 14: 2}.get(rate_code, 0)
    if pos >= len(head) or crc8(head[:pos]) != head[pos]:
        return None
    return (number if variable else number * max_block), block


def _coded_number(head: bytes, at: int) -> tuple[int | None, int]:
    """The frame or sample number coded as UTF-8 is (up to 7 bytes, 36 bits) at `at`, and its length in bytes."""
    lead = head[at] if at < len(head) else 0xFF
    if lead < 0x80:
        return lead, 1
    length = 8 - (lead ^ 0xFF).bit_length() if lead != 0xFF else 0
    if not 2 <= length <= 7 or at + length > len(head):
        return None, 0
    value = lead & (0x7F >> length)
    for byte in head[at + 1 : at + length]:
        if byte & 0xC0 != 0x80:
            return None, 0
        value = (value << 6) | (byte & 0x3F)
    return value, length
