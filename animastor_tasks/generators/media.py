"""Tiny, real media files made from text, with no I/O and no third-party code.

The builtin generator and the reference inference server both need output that a
player or an image viewer accepts, that is reproducible byte for byte (so tests
and input hashes can rely on it), and that costs nothing to produce. Nothing here
touches the disk or the network.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
import struct
import sys
import wave
import zlib
from array import array

from animastor_tasks.domain.media_types import (
    AAC_TYPES,
    FLAC_TYPES,
    JPEG_TYPES,
    MP3_TYPES,
    OGG_TYPES,
    WAV_TYPES,
    base_type,
)
from animastor_tasks.generators.audio_frames import CutShort, NotMedia, check_adts, check_mpeg_audio, check_ogg
from animastor_tasks.generators.flac import check_flac

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_PNG_SIDE = 4096
MAX_CHECKED_PIXELS = 64 * 2**20  # the largest image a stage stores (8192 x 8192); checked before it is inflated
_AMPLITUDE = 0.35 * 32767
_FADE_SECONDS = 0.005
# Samples per pixel for each PNG colour type at bit depth 8 (grey, RGB, palette, grey+alpha, RGBA).
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_INFLATE_STEP = 1 << 20  # the most of an image's pixels held at once while they are counted


def _tone_hz(token: str) -> float:
    """A pitch for a word: stable across processes (crc32, not the salted `hash`)."""
    return 180.0 + zlib.crc32(token.encode("utf-8")) % 640


@functools.lru_cache(maxsize=512)
def _tone(hz: float, n: int, sample_rate: int) -> array[int]:
    """`n` samples of one word's tone with its fades. Cached: a word comes back in scene after scene,
    and the samples cost a sine each (0.7 ms of CPU per 0.3 s WAV before the cache, 0.01-0.12 ms after)."""
    step = 2.0 * math.pi * hz / sample_rate
    segment = [_AMPLITUDE * math.sin(step * j) for j in range(n)]
    fade = min(n // 2, int(sample_rate * _FADE_SECONDS))
    for j in range(fade):  # short ramps so word boundaries do not click
        gain = j / fade
        segment[j] *= gain
        segment[n - 1 - j] *= gain
    return array("h", map(int, segment))


def synthesize_wav(
    text: str, *, sample_rate: int = 16000, seconds_per_word: float = 0.12, min_seconds: float = 0.3
) -> bytes:
    """Return a mono 16-bit PCM WAV "reading" `text`: one short tone per word.

    The duration is `max(min_seconds, words * seconds_per_word)`, so longer scenes
    give longer audio, and the same text always gives the same bytes.
    """
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or not 1000 <= sample_rate <= 192000:
        raise ValueError(f"sample_rate must be an integer between 1000 and 192000, got {sample_rate!r}")
    if not seconds_per_word > 0 or not min_seconds > 0:
        raise ValueError("seconds_per_word and min_seconds must be positive")
    words = text.split()
    seconds = max(min_seconds, len(words) * seconds_per_word)
    total = max(1, round(seconds * sample_rate))
    tones = [_tone_hz(w) for w in words] or [_tone_hz(text)]
    samples = array("h")
    count = len(tones)
    for index, hz in enumerate(tones):
        samples.extend(_tone(hz, (index + 1) * total // count - index * total // count, sample_rate))
    if sys.byteorder == "big":
        samples.byteswap()  # WAV is little-endian
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(samples.tobytes())
    return buffer.getvalue()


# Data lengths a WAV writer puts down when it cannot seek back to write the real one: 0, or anything from about
# 2 GiB up, a length no answer is (max_bytes defaults to 512 MiB). *Why a range:* writers each pick their own
# (0xFFFFFFFF, 0xFFFFFFFF - 36, 0x7FFFFFFF; 0x7FFFF000 from SoX and espeak-ng writing to a pipe), and each one
# not listed had every scene of its lane failed for good as a WAV cut short.
_UNKNOWN_DATA_LENGTH_FROM = 0x7FFF0000


def wav_duration_seconds(data: bytes) -> float:
    """Duration of a WAV file in seconds, whatever its sample format; ValueError if `data` is not a WAV file.

    Read from the RIFF chunks rather than with `wave`, which knows integer PCM alone: a server writing 32-bit
    float or extensible-format WAV (torchaudio, scipy) had every pair of its stage failed as not a WAV file.
    A data chunk of unknown length (0, or a placeholder of 2 GiB or more: 0xFFFFFFFF and its like, written by a
    streaming server; 0x7FFFF000, written by SoX and espeak-ng to a pipe) runs to the end, which must end a sample
    frame (one cut exactly between two frames still reads as whole). No samples at all (a TTS given only
    punctuation) or fewer bytes than the chunk declares (a body cut short) is no audio.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise NotMedia("not a WAV file: no RIFF/WAVE header")
    rate = block = 0
    at = 12
    while at + 8 <= len(data):
        kind, size = data[at : at + 4], struct.unpack_from("<I", data, at + 4)[0]
        body = at + 8
        if kind == b"fmt " and size >= 16 and body + 16 <= len(data):
            _, _, rate, _, block = struct.unpack_from("<HHIIH", data, body)
        elif kind == b"data":
            if not rate or not block:
                raise ValueError("not a WAV file: no usable fmt chunk before the data")
            available = len(data) - body
            unknown = size == 0 or size >= _UNKNOWN_DATA_LENGTH_FROM
            if not unknown and size > available:
                raise CutShort(f"WAV cut short: its data chunk declares {size} bytes, {available} are there")
            if unknown and available % block:
                raise CutShort(f"WAV cut short: its data of unknown length ends inside a {block}-byte sample frame")
            frames = (available if unknown else size) // block
            if not frames:
                raise ValueError("WAV holds no samples")
            return frames / rate
        at = body + size + (size & 1)  # chunks are padded to an even size
    if at != len(data):  # the last chunk runs past the end: the body stops inside the header
        raise CutShort(f"WAV cut short: {len(data)} bytes, its chunks before the data run on past them")
    raise ValueError("not a WAV file: no data chunk")


def check_known_media(media_type: str, data: bytes) -> None:
    """ValueError when `data` is not a file of the format `media_type` names, for the formats read here: a
    server's error text sent under the right type is not a result (NotMedia, no signature of the format: the
    server's doing), nor a file with no samples, and neither is a body cut short that HTTP cannot tell from a whole
    one (an answer without a length, ended by closing the connection, whose connection dropped): CutShort, that one,
    the connection's doing rather than the scene's.

    Known: WAV, PNG, JPEG, WebP, FLAC (in `flac`) and (in `audio_frames`) MP3, ADTS AAC and Ogg (Opus, Vorbis).
    An AAC, an MP3 without a Xing/Info or VBRI frame count, or a WAV of unknown data length (streamed), cut
    exactly between two frames still reads as whole, and so does a FLAC whose STREAMINFO gives no total. Raw PCM
    (`audio/pcm`) is not checked: it has no structure at all. Any other type is taken as it is."""
    kind = base_type(media_type)
    if kind in WAV_TYPES:
        wav_duration_seconds(data)
    elif kind == "image/png":
        png_size(data)
    elif kind in JPEG_TYPES:
        check_jpeg(data)
    elif kind == "image/webp":
        check_webp(data)
    elif kind in MP3_TYPES:
        check_mpeg_audio(data)
    elif kind in AAC_TYPES:
        check_adts(data)
    elif kind in OGG_TYPES:
        check_ogg(data)
    elif kind in FLAC_TYPES:
        check_flac(data)


def check_jpeg(data: bytes) -> None:
    """ValueError unless `data` opens with a JPEG's start-of-image marker and closes with its end-of-image one
    (padding aside): the entropy-coded data never holds that end marker, so a JPEG cut short has none there."""
    if not data.startswith(b"\xff\xd8\xff"):
        raise NotMedia("not a JPEG file: no start-of-image marker")
    if not data.rstrip(b"\x00").endswith(b"\xff\xd9"):
        raise CutShort("JPEG cut short: it does not end with the end-of-image marker")


def check_webp(data: bytes) -> None:
    """ValueError unless `data` is a RIFF/WEBP file holding all the bytes its RIFF header declares."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        raise NotMedia("not a WebP file: no RIFF/WEBP header")
    declared = struct.unpack_from("<I", data, 4)[0] + 8
    if declared > len(data):
        raise CutShort(f"WebP cut short: its RIFF header declares {declared} bytes, {len(data)} are there")


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def render_png(prompt: str, *, width: int = 64, height: int = 64) -> bytes:
    """Return an RGB PNG "illustrating" `prompt`: a gradient with a checker pattern.

    Colours and pattern come from sha256 of the prompt, so the same prompt always
    gives the same bytes and different prompts give visibly different images.
    """
    for label, side in (("width", width), ("height", height)):
        if isinstance(side, bool) or not isinstance(side, int) or not 1 <= side <= MAX_PNG_SIDE:
            raise ValueError(f"{label} must be an integer between 1 and {MAX_PNG_SIDE}, got {side!r}")
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    left, right, bottom = digest[0:3], digest[3:6], digest[6:9]
    pattern = digest[9:]
    cell = max(1, min(width, height) // 8)
    fxs = [x / (width - 1) if width > 1 else 0.0 for x in range(width)]
    # The gradient across a row, per channel: computed once per column, not once per pixel (5 ms of CPU
    # per 64x64 image before). Each value is the same float expression as ever, so the bytes are too.
    across = [[left[ch] * (1.0 - fx) + right[ch] * fx for fx in fxs] for ch in range(3)]
    columns = [x // cell for x in range(width)]
    checkers = {  # the checker's lift across a row, per row of cells
        cy: [96 if (pattern[(cx + 8 * cy) % len(pattern)] >> ((cx + cy) % 8)) & 1 else 0 for cx in columns]
        for cy in range((height - 1) // cell + 1)
    }
    raw = bytearray()
    row = bytearray(3 * width)
    for y in range(height):
        fy = y / (height - 1) if height > 1 else 0.0
        down, lit = 1.0 - 0.5 * fy, checkers[y // cell]
        for ch in range(3):
            lift = bottom[ch] * 0.5 * fy
            row[ch::3] = bytes([(int(v * down + lift) + extra) % 256 for v, extra in zip(across[ch], lit, strict=True)])
        raw.append(0)  # filter type "None" for every scanline
        raw += row
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(bytes(raw), 9)) + _chunk(b"IEND", b"")
    )


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG after checking its structure; ValueError if it is broken.

    Checks the signature, every chunk CRC, IHDR first and IEND last, and that the
    image data inflates to exactly the size IHDR promises (8-bit, non-interlaced).
    """
    if not data.startswith(PNG_SIGNATURE):
        raise NotMedia("not a PNG file: bad signature")
    pos = len(PNG_SIGNATURE)
    kinds: list[bytes] = []
    idat: list[memoryview] = []  # views of the image, not copies: an image of 500 MB was held four times over
    header = b""
    view = memoryview(data)
    while pos < len(data):
        if pos + 12 > len(data):
            raise CutShort("truncated PNG chunk")
        (length,) = struct.unpack_from(">I", data, pos)
        kind = bytes(view[pos + 4 : pos + 8])
        payload = view[pos + 8 : pos + 8 + length]
        if len(payload) != length or pos + 12 + length > len(data):
            raise CutShort(f"truncated PNG chunk {kind!r}")
        (crc,) = struct.unpack_from(">I", data, pos + 8 + length)
        if crc != zlib.crc32(payload, zlib.crc32(kind)):
            raise ValueError(f"bad CRC in PNG chunk {kind!r}")
        kinds.append(kind)
        if kind == b"IHDR":
            header = bytes(payload)
        elif kind == b"IDAT":
            idat.append(payload)
        pos += 12 + length
    if not kinds or kinds[0] != b"IHDR" or len(header) != 13:
        raise ValueError("PNG does not start with a valid IHDR chunk")
    if kinds[-1] != b"IEND":
        raise CutShort("PNG cut short: no IEND chunk after its last one")
    if not any(idat):  # none, or only empty ones
        raise ValueError("PNG has no image data")
    width, height, depth, colour, _compression, _filter, interlace = struct.unpack(">IIBBBBB", header)
    if width * height > MAX_CHECKED_PIXELS:
        raise ValueError(f"PNG of {width}x{height} is larger than {MAX_CHECKED_PIXELS} pixels")
    exact = depth == 8 and interlace == 0 and colour in _PNG_CHANNELS
    # What any PNG of this size may inflate to (8 bytes a pixel: 16-bit RGBA; a filter byte a row, per pass).
    expected = height * (1 + width * _PNG_CHANNELS[colour]) if exact else (height + 7) * (1 + width * 8)
    try:
        # Inflated no further than that: a small PNG whose data inflates to gigabytes (a bomb) took the worker down.
        inflated, ended = _inflated_size(idat, expected)
    except zlib.error as err:
        raise ValueError(f"PNG image data does not inflate: {err}") from err
    if inflated > expected:
        raise ValueError(f"PNG image data inflates past the {expected} bytes IHDR promises")
    if not ended:
        raise ValueError("PNG image data does not inflate: incomplete or truncated stream")
    if exact and inflated != expected:
        raise ValueError(f"PNG image data is {inflated} bytes, IHDR promises {expected}")
    return width, height


def _inflated_size(parts: list[memoryview], most: int) -> tuple[int, bool]:
    """How many bytes the zlib stream in `parts` inflates to, counted (past `most` no further) without keeping
    them, and whether the stream ends. *Why counted:* the pixels of a 8192 x 8192 image were held whole, 256 MB."""
    inflater = zlib.decompressobj()
    total = 0
    for part in parts:
        pending: memoryview | bytes = part
        while True:
            step = min(_INFLATE_STEP, most + 1 - total)  # never past `most` + 1: what follows is not read at all
            out = inflater.decompress(pending, step)
            total += len(out)
            if total > most:
                return total, inflater.eof
            pending = inflater.unconsumed_tail
            if not pending and len(out) < step:  # a full step may leave output inside zlib: asked again
                break
    return total, inflater.eof
