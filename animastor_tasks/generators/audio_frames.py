"""Whole-file checks for the compressed audio formats TTS servers answer with: MP3, ADTS AAC and Ogg.

An answer without a Content-Length, ended by the server closing the connection, reads as whole to HTTP even when
the connection dropped halfway; a WAV or a PNG tells that from its own lengths, and these formats are made of
frames or pages that do too. Each check walks the file's frames and raises NotMedia when the first is missing
(an error text or another format under this type), CutShort when the last runs past the end of the data (a body
cut short).

A body cut exactly at a frame boundary is a shorter whole stream to a walk. An MP3 whose first frame is a
Xing/Info or VBRI header (what LAME and FFmpeg write to a file) declares its frame count there, so one cut
between frames is caught too; an MP3 without one (an encoder writing to a pipe cannot go back to fill it in)
and ADTS AAC have no end marker or total. Ogg has one, its end-of-stream page, so an Ogg body cut between pages
is caught too. Bytes that are no frame where the next frame should start end the walk and are accepted: servers
and taggers append padding and tags this does not know, and a body cut short never grows bytes of its own, so
refusing them would fail good files without catching any cut one.

Pure functions: no I/O, no third-party code.
"""

from __future__ import annotations

import struct
import zlib

# MPEG audio bitrates in kbit/s by bitrate index 1-14 (0 is free format, 15 is reserved).
_MPEG1_KBPS = {
    3: (32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),  # layer I
    2: (32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),  # layer II
    1: (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),  # layer III
}
_MPEG2_KBPS = {
    3: (32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),  # layer I
    2: (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),  # layers II and III
    1: (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
# Sample rates by version bits (3: MPEG 1, 2: MPEG 2, 0: MPEG 2.5; 1 is reserved) and sample-rate index 0-2.
_MPEG_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
_ID3V1_SIZE = 128
_APE_SIZE = 32  # an APEv2 header or footer
_TRAILERS = (b"TAG", b"APETAGEX", b"LYRICSBEGIN", b"ID3")
_FREE_FORMAT = -1


class CutShort(ValueError):
    """A file whose own lengths or end marker say its body stops short: a dropped connection's doing (or a proxy's
    that re-framed a cut answer), not the scene's, so worth another attempt. Each check here and in `flac` and
    `media` raises it for a cut, NotMedia for what is no file of its format at all, and a plain ValueError for a
    file of its format that is broken or empty (a WAV with no samples: a TTS given only punctuation)."""


class NotMedia(ValueError):
    """Data that does not even begin as a file of its format (no RIFF, PNG, fLaC... signature): a server's error text
    or nothing under the media type, its answer to whatever it is sent, so the server's doing rather than the scene's.
    *Why apart:* taken as the scene's verdict, a server whose model broke failed every pair of its lane for good,
    and its breaker never heard of it."""


def skip_id3v2(data: bytes, what: str) -> int:
    """Where the audio starts after any ID3v2 tags (several may follow one another); the tag's size is
    synchsafe (7 bits a byte) and a footer flag adds 10 bytes. A tag longer than the data is a body cut short."""
    at = 0
    while data.startswith(b"ID3", at):
        if len(data) - at < 10:
            raise CutShort(f"{what} cut short: in its ID3v2 header")
        major, flags, size_bytes = data[at + 3], data[at + 5], data[at + 6 : at + 10]
        if major == 0xFF or any(b & 0x80 for b in size_bytes):
            raise ValueError(f"not an {what} file: a broken ID3v2 header")
        end = at + 10 + ((size_bytes[0] << 21) | (size_bytes[1] << 14) | (size_bytes[2] << 7) | size_bytes[3])
        end += 10 if major >= 4 and flags & 0x10 else 0
        if end > len(data):
            raise CutShort(f"{what} cut short: its ID3v2 tag declares {end - at} bytes, {len(data) - at} are there")
        at = end
    return at


def _trailer(data: bytes, at: int, what: str) -> bool:
    """True when a tag that ends the audio starts at `at` (ID3v1, APEv2, Lyrics3, an appended ID3v2) and is
    whole; ValueError when it is cut short; False when something else is there."""
    rest = len(data) - at
    tail = data[at:]
    if any(len(tail) < len(marker) and marker.startswith(tail) for marker in _TRAILERS):
        raise CutShort(f"{what} cut short: {rest} bytes of a tag's marker after the last frame")
    if data.startswith(b"TAG", at):
        if rest < _ID3V1_SIZE:
            raise CutShort(f"{what} cut short: an ID3v1 tag of {rest} bytes, it has {_ID3V1_SIZE}")
        return True
    if data.startswith(b"APETAGEX", at):
        if rest < _APE_SIZE:
            raise CutShort(f"{what} cut short: an APEv2 header of {rest} bytes, it has {_APE_SIZE}")
        size, _, flags = struct.unpack_from("<III", data, at + 12)
        if flags & 0x20000000 and _APE_SIZE + size > rest:  # a header: `size` counts the items and the footer
            raise CutShort(f"{what} cut short: its APEv2 tag declares {_APE_SIZE + size} bytes, {rest} are there")
        return True
    if data.startswith(b"LYRICSBEGIN", at):  # Lyrics3 carries no length before its end: accepted from here
        return True
    if data.startswith(b"ID3", at):
        skip_id3v2(data[at:], what)
        return True
    return False


def _mpeg_frame_length(header: bytes) -> int | None:
    """The length of the MPEG audio frame this 4-byte header opens, `_FREE_FORMAT` for a free-format frame,
    None when it is no frame header (no sync, or a reserved version, layer, bitrate or sample rate)."""
    if header[0] != 0xFF or header[1] & 0xE0 != 0xE0:
        return None
    version, layer = (header[1] >> 3) & 3, (header[1] >> 1) & 3
    bitrate_index, rate_index, padding = header[2] >> 4, (header[2] >> 2) & 3, (header[2] >> 1) & 1
    if version == 1 or layer == 0 or bitrate_index == 15 or rate_index == 3:
        return None
    if bitrate_index == 0:
        return _FREE_FORMAT
    bitrate = 1000 * (_MPEG1_KBPS if version == 3 else _MPEG2_KBPS)[layer][bitrate_index - 1]
    rate = _MPEG_RATES[version][rate_index]
    if layer == 3:  # layer I: 4-byte slots
        return (12 * bitrate // rate + padding) * 4
    if layer == 1 and version != 3:  # layer III of MPEG 2 and 2.5: half the samples a frame
        return 72 * bitrate // rate + padding
    return 144 * bitrate // rate + padding


def check_mpeg_audio(data: bytes) -> None:
    """ValueError unless `data` is an MPEG audio file (MP3, or layer I/II) whose last frame is whole, and which
    has as many frames as its Xing/Info or VBRI header declares, where it has one.

    A leading ID3v2 tag is skipped; the walk stops, accepting, at an ID3v1/APEv2/Lyrics3 tag, at a free-format
    frame (its length is not in its header) and at bytes that are no frame header. A tail too short for a header
    that begins like one is a header cut short.
    """
    at = skip_id3v2(data, "MP3")
    first = data[at : at + 4]
    length = _mpeg_frame_length(first) if len(first) == 4 else None
    if length is None:
        if at and at == len(data):
            raise CutShort("MP3 cut short: no audio after its ID3v2 tag")
        if len(first) < 4 and first[:1] == b"\xff":
            raise CutShort(f"MP3 cut short: {len(first)} bytes of its first frame header")
        raise NotMedia("not an MP3 file: no MPEG audio frame header at its start")
    declared = _declared_frames(data[at : at + length]) if length > 0 else None
    walked = _walk_mpeg_frames(data, at)
    # LAME and FFmpeg count the frames after the header frame; one frame of slack, so a writer that counts the
    # header frame too is never refused whole.
    if declared is not None and walked is not None and walked < declared[1]:
        raise CutShort(
            f"MP3 cut short: its {declared[0]} header declares {declared[1]} frames after it, {walked - 1} are there"
        )


def _walk_mpeg_frames(data: bytes, at: int) -> int | None:
    """The number of whole frames from `at` on, None when a free-format frame ends the walk (its length, and so
    the count, unknown); ValueError when the last runs past the end of the data."""
    frames = 0
    while at < len(data):
        head = data[at : at + 4]
        if len(head) < 4:
            if head[0] == 0xFF and (len(head) == 1 or head[1] & 0xE0 == 0xE0):
                raise CutShort(f"MP3 cut short: {len(head)} bytes of a frame header at byte {at}")
            _trailer(data, at, "MP3")
            return frames  # a known tag, or a byte or two of padding
        length = _mpeg_frame_length(head)
        if length is None:
            _trailer(data, at, "MP3")
            return frames  # a known tag, or bytes that are no frame: see the module's docstring
        if length == _FREE_FORMAT:
            return None
        if at + length > len(data):
            raise CutShort(f"MP3 cut short: the frame at byte {at} declares {length} bytes, {len(data) - at} are there")
        at += length
        frames += 1
    return frames


def _declared_frames(frame: bytes) -> tuple[str, int] | None:
    """The frame count a layer III header frame declares (its tag, the count): a Xing/Info tag after the side
    information (17 or 32 bytes in MPEG 1, 9 or 17 in MPEG 2 and 2.5, mono or not; 2 more after a CRC) with its
    frames flag set, or a VBRI tag 32 bytes in. None without one, or with a count of 0 (a header never filled)."""
    if (frame[1] >> 1) & 3 != 1:
        return None
    mpeg1, mono = (frame[1] >> 3) & 3 == 3, frame[3] >> 6 == 3
    side = (17 if mono else 32) if mpeg1 else (9 if mono else 17)
    for at in (4 + side, 6 + side):
        if frame[at : at + 4] in (b"Xing", b"Info") and len(frame) >= at + 12:
            flags, count = struct.unpack_from(">II", frame, at + 4)
            return (frame[at : at + 4].decode(), count) if flags & 1 and count else None
    if frame[36:40] == b"VBRI" and len(frame) >= 54:
        (count,) = struct.unpack_from(">I", frame, 50)
        return ("VBRI", count) if count else None
    return None


def check_adts(data: bytes) -> None:
    """ValueError unless `data` is an ADTS AAC stream (what `audio/aac` names) whose last frame is whole.

    Each ADTS frame header states the frame's whole length (13 bits), so the walk is as for MP3: a leading ID3v2
    tag skipped, a trailing tag or bytes that are no frame header accepted, a frame past the end refused.
    """
    at = skip_id3v2(data, "AAC")
    if at and at == len(data):
        raise CutShort("AAC cut short: no audio after its ID3v2 tag")
    if not data:
        raise NotMedia("not an ADTS AAC file: it is empty")
    start = at
    while at < len(data):
        length = _adts_frame_length(data, at)
        if length is None and at == start:
            raise NotMedia("not an ADTS AAC file: no ADTS frame header at its start")
        if length is None:
            _trailer(data, at, "AAC")
            return  # a known tag, or bytes that are no frame: see the module's docstring
        if at + length > len(data):
            raise CutShort(
                f"AAC cut short: the ADTS frame at byte {at} declares {length} bytes, {len(data) - at} are there"
            )
        at += length


def _adts_frame_length(data: bytes, at: int) -> int | None:
    """The length of the ADTS frame whose header starts at `at` (sync 0xFFF, layer 0, a sample-rate index in
    use, a length no shorter than the header), None when none does; ValueError when the data ends inside what
    begins like one."""
    head = data[at : at + 7]
    syncs = head[:1] == b"\xff" and (len(head) == 1 or head[1] & 0xF6 == 0xF0)
    if len(head) < 7:
        if syncs:
            raise CutShort(f"AAC cut short: {len(head)} bytes of an ADTS frame header at byte {at}")
        return None
    length = ((head[3] & 3) << 11) | (head[4] << 3) | (head[5] >> 5)
    header = 7 if head[1] & 1 else 9  # protection_absent = 0: a 16-bit CRC follows the header
    return length if syncs and (head[2] >> 2) & 0xF < 13 and length >= header else None


def _bit_reversed_bytes() -> bytes:
    return bytes(int(f"{i:08b}"[::-1], 2) for i in range(256))


_REVERSE_BITS = _bit_reversed_bytes()


def ogg_crc(data: bytes) -> int:
    """Ogg's page CRC: CRC-32 with polynomial 0x04C11DB7, MSB first (not reflected), initial value 0, no final
    xor. Computed with zlib's CRC-32, which is the same polynomial reflected: the reflected CRC of the input's
    bits reversed in each byte is this CRC's bits reversed. zlib's starting value 0xFFFFFFFF and its final xor
    make a register that starts and ends unxored. Runs in C (a byte-at-a-time loop in Python took about 0.1 s
    per megabyte, on every Ogg answer)."""
    register = zlib.crc32(data.translate(_REVERSE_BITS), 0xFFFFFFFF) ^ 0xFFFFFFFF
    return int(f"{register:032b}"[::-1], 2)


def check_ogg(data: bytes) -> None:
    """ValueError unless `data` is an Ogg stream (Opus, Vorbis, ...) whose pages are whole, carry the right CRC,
    and close every logical stream they open with an end-of-stream page.

    The end-of-stream page is what makes a body cut between two pages tell: its pages are all whole, but the
    stream has no last page. A chained file (one stream after another) ends each. Bytes that are no page after
    the pages end the walk, as for MP3.
    """
    if data and b"OggS".startswith(data):
        raise CutShort(f"Ogg cut short: {len(data)} bytes of its first page's capture pattern")
    if not data.startswith(b"OggS"):
        raise NotMedia("not an Ogg file: no OggS page at its start")
    at = 0
    open_streams: set[int] = set()
    while at < len(data):
        if not data.startswith(b"OggS", at):
            if b"OggS".startswith(data[at:]):
                raise CutShort(f"Ogg cut short: {len(data) - at} bytes of a page's capture pattern")
            break
        if len(data) - at < 27:
            raise CutShort(f"Ogg cut short: {len(data) - at} bytes of the page header at byte {at}")
        version, flags, serial, crc, segments = struct.unpack_from("<BB8xI4xIB", data, at + 4)
        if version != 0:
            raise ValueError(f"not an Ogg file: the page at byte {at} has stream structure version {version}")
        if at + 27 + segments > len(data):
            raise CutShort(f"Ogg cut short: in the segment table of the page at byte {at}")
        end = at + 27 + segments + sum(data[at + 27 : at + 27 + segments])
        if end > len(data):
            raise CutShort(
                f"Ogg cut short: the page at byte {at} declares {end - at} bytes, {len(data) - at} are there"
            )
        page = data[at:end]
        if ogg_crc(page[:22] + b"\0\0\0\0" + page[26:]) != crc:
            raise ValueError(f"Ogg page at byte {at} fails its CRC")
        if flags & 0x04:
            open_streams.discard(serial)
        else:
            open_streams.add(serial)
        at = end
    if open_streams:
        raise CutShort(
            f"Ogg cut short: {len(open_streams)} logical stream(s) with no end-of-stream page (the last page of "
            f"{at} bytes of pages is not one)"
        )
