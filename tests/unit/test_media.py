"""domain.media makes real, reproducible WAV and PNG files from text."""

from __future__ import annotations

import hashlib
import io
import random
import struct
import wave
import zlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from animastor_tasks.generators.media import (
    CutShort,
    NotMedia,
    check_known_media,
    png_size,
    render_png,
    synthesize_wav,
    wav_duration_seconds,
)
from tests.unit.test_audio_frames import adts_stream, mp3_stream, ogg_stream


def _pcm(data: bytes) -> tuple[Any, list[int]]:
    with wave.open(io.BytesIO(data), "rb") as wav:
        params = wav.getparams()
        frames = wav.readframes(wav.getnframes())
    return params, list(struct.unpack(f"<{len(frames) // 2}h", frames))


def _rgb_pixels(data: bytes) -> list[tuple[int, int, int]]:
    """Decode our own PNG layout (one IDAT, filter 0) to check the picture is not blank."""
    width, height = png_size(data)
    start = data.index(b"IDAT")
    (length,) = struct.unpack(">I", data[start - 4 : start])
    raw = zlib.decompress(data[start + 4 : start + 4 + length])
    stride = 1 + 3 * width
    pixels = []
    for y in range(height):
        row = raw[y * stride : (y + 1) * stride]
        assert row[0] == 0
        pixels.extend(tuple(row[1 + 3 * x : 4 + 3 * x]) for x in range(width))
    return pixels


def test_wav_is_mono_16bit_pcm_and_audible() -> None:
    params, samples = _pcm(synthesize_wav("Once upon a time there was a dragon."))
    assert (params.nchannels, params.sampwidth, params.framerate) == (1, 2, 16000)
    assert max(abs(s) for s in samples) > 5000


@pytest.mark.parametrize(("words", "expected"), [(1, 0.3), (10, 1.2), (100, 12.0)])
def test_wav_duration_follows_word_count(words: int, expected: float) -> None:
    text = " ".join(f"word{i}" for i in range(words))
    assert wav_duration_seconds(synthesize_wav(text)) == pytest.approx(expected, abs=1 / 16000)


def test_wav_duration_grows_with_text_and_honours_settings() -> None:
    short = wav_duration_seconds(synthesize_wav("a b c d e"))
    long = wav_duration_seconds(synthesize_wav("a b c d e " * 10))
    assert long > short * 5
    data = synthesize_wav("one two", sample_rate=8000, seconds_per_word=0.5, min_seconds=0.1)
    assert _pcm(data)[0].framerate == 8000
    assert wav_duration_seconds(data) == pytest.approx(1.0)
    assert wav_duration_seconds(synthesize_wav("")) == pytest.approx(0.3)


def test_wav_is_deterministic_and_text_dependent() -> None:
    assert synthesize_wav("the same words") == synthesize_wav("the same words")
    assert synthesize_wav("the same words") != synthesize_wav("other same words")
    # Each word gets its own tone: the halves of a two-word clip differ.
    _, samples = _pcm(synthesize_wav("alpha omega", seconds_per_word=0.2))
    half = len(samples) // 2
    assert samples[:half] != samples[half:]


def test_wav_rejects_bad_arguments_and_bad_input() -> None:
    with pytest.raises(ValueError, match="sample_rate"):
        synthesize_wav("x", sample_rate=10)
    with pytest.raises(ValueError):
        synthesize_wav("x", seconds_per_word=0)
    with pytest.raises(ValueError, match="not a WAV"):
        wav_duration_seconds(b"RIFF nonsense")


def test_png_has_requested_size_and_valid_structure() -> None:
    data = render_png("a castle at dusk")
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert png_size(data) == (64, 64)
    assert png_size(render_png("a castle at dusk", width=10, height=7)) == (10, 7)
    assert png_size(render_png("tiny", width=1, height=1)) == (1, 1)


def test_png_is_deterministic_and_prompt_dependent() -> None:
    assert render_png("a castle at dusk") == render_png("a castle at dusk")
    assert render_png("a castle at dusk") != render_png("a castle at dawn")
    assert _rgb_pixels(render_png("a castle at dusk")) != _rgb_pixels(render_png("a castle at dawn"))


def _pixel_by_pixel(prompt: str, width: int, height: int) -> bytes:
    """The picture's definition, one pixel at a time: what `render_png`'s rows must hold, byte for byte
    (input hashes and stored artifacts of earlier releases rely on the bytes)."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    left, right, bottom, pattern = digest[0:3], digest[3:6], digest[6:9], digest[9:]
    cell = max(1, min(width, height) // 8)
    raw = bytearray()
    for y in range(height):
        raw.append(0)
        fy = y / (height - 1) if height > 1 else 0.0
        for x in range(width):
            fx = x / (width - 1) if width > 1 else 0.0
            cx, cy = x // cell, y // cell
            lit = (pattern[(cx + 8 * cy) % len(pattern)] >> ((cx + cy) % 8)) & 1
            for ch in range(3):
                value = left[ch] * (1.0 - fx) + right[ch] * fx
                value = value * (1.0 - 0.5 * fy) + bottom[ch] * 0.5 * fy
                raw.append((int(value) + (96 if lit else 0)) % 256)
    return bytes(raw)


@given(st.text(max_size=40), st.integers(1, 70), st.integers(1, 70))
def test_png_rows_are_the_picture_s_definition_byte_for_byte(prompt: str, width: int, height: int) -> None:
    data = render_png(prompt, width=width, height=height)
    start = data.index(b"IDAT")
    (length,) = struct.unpack(">I", data[start - 4 : start])
    assert zlib.decompress(data[start + 4 : start + 4 + length]) == _pixel_by_pixel(prompt, width, height)


def test_png_is_a_picture_not_a_flat_fill() -> None:
    pixels = _rgb_pixels(render_png("a forest"))
    assert len(pixels) == 64 * 64
    assert len(set(pixels)) > 50


def test_png_size_rejects_corruption() -> None:
    data = bytearray(render_png("a castle"))
    data[data.index(b"IDAT") + 10] ^= 0xFF
    with pytest.raises(ValueError, match="CRC"):
        png_size(bytes(data))
    with pytest.raises(ValueError, match="signature"):
        png_size(b"GIF89a")
    with pytest.raises(ValueError):
        png_size(render_png("a castle")[:-12])  # IEND cut off


def test_png_rejects_bad_size() -> None:
    with pytest.raises(ValueError, match="width"):
        render_png("x", width=0)
    with pytest.raises(ValueError, match="height"):
        render_png("x", height=100_000)


def _wav(format_tag: int, channels: int, rate: int, bits: int, seconds: float, data_size: int | None = None) -> bytes:
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", format_tag, channels, rate, rate * block, block, bits)
    if format_tag == 0xFFFE:  # WAVE_FORMAT_EXTENSIBLE: cbSize, valid bits, channel mask, sub-format GUID
        fmt += struct.pack("<HHI", 22, bits, 3) + b"\x03\x00\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    frames = b"\0" * (int(rate * seconds) * block)
    size = len(frames) if data_size is None else data_size
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", size) + frames
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


@pytest.mark.parametrize(
    ("wav", "seconds"),
    [
        (_wav(3, 1, 24000, 32, 1.5), 1.5),  # 32-bit float (torchaudio, scipy): `wave` refused it
        (_wav(0xFFFE, 2, 48000, 24, 0.5), 0.5),  # extensible
        (_wav(1, 1, 16000, 16, 2.0, data_size=0xFFFFFFFF), 2.0),  # streamed: length unknown
        (_wav(1, 1, 22050, 16, 1.0, data_size=0x7FFFF000), 1.0),  # SoX or espeak-ng writing to a pipe
    ],
)
def test_a_wav_of_any_sample_format_has_its_duration(wav: bytes, seconds: float) -> None:
    assert wav_duration_seconds(wav) == pytest.approx(seconds)


@pytest.mark.parametrize("placeholder", [0xFFFFFFFF - 36, 0xFFFFFFFF - 100, 0x7FFFFFFF, 0x80000000])
def test_a_streamed_wav_whose_placeholder_length_no_body_could_hold_runs_to_its_end(placeholder: int) -> None:
    """Streaming TTS servers write the header before they know the length, with placeholders of their own
    (`0xFFFFFFFF - 36`, `0x7FFFFFFF`): read as true lengths, every whole answer was a WAV cut short, and the
    stage failed each scene for good. A true length larger than the body is still a cut."""
    assert wav_duration_seconds(_wav(1, 1, 24000, 16, 1.0, data_size=placeholder)) == pytest.approx(1.0)
    whole = _wav(1, 1, 24000, 16, 1.0)
    with pytest.raises(ValueError, match="cut short"):
        wav_duration_seconds(whole[: len(whole) // 2])


@pytest.mark.parametrize("unknown", [0, 0x7FFFF000, 0xFFFFFFFF, 0xFFFFFFFF - 36])
def test_a_streamed_wav_cut_inside_a_sample_frame_is_cut_short(unknown: int) -> None:
    """A streaming server writes no data length; a body of such a WAV cut short (a connection closed cleanly halfway,
    no Content-Length) read as whole. Cut inside a frame it is known now; cut between two frames it still is not."""
    whole = _wav(1, 2, 16000, 16, 1.0, data_size=unknown)  # 4-byte frames after a 44-byte header
    half = 44 + 8000 * 4
    with pytest.raises(ValueError, match="cut short"):
        wav_duration_seconds(whole[: half + 1])
    assert wav_duration_seconds(whole[:half]) == pytest.approx(0.5)


def test_a_wav_with_no_sample_rate_is_not_a_wav_file() -> None:
    """A frame rate of 0 was a ZeroDivisionError: a generator bug rather than a refused scene."""
    with pytest.raises(ValueError, match="not a WAV file"):
        wav_duration_seconds(_wav(1, 1, 0, 16, 1.0))


def _png_with(width: int, height: int, idat: bytes) -> bytes:
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_a_png_whose_data_inflates_to_far_more_than_its_size_is_refused_without_inflating_it() -> None:
    """A decompression bomb: a 64x64 PNG whose 64 KB of data inflate to 64 MB (to gigabytes, for real). Old code
    inflated all of it before comparing, and a big enough one took the worker process down."""
    import tracemalloc

    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(bytes(2**20)) for _ in range(64)) + packer.flush()
    bomb = _png_with(64, 64, idat)
    assert len(bomb) < 2**20
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="inflates past"):
            png_size(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"{peak} bytes"


def _noisy_png(width: int, height: int, parts: int) -> bytes:
    """A PNG of pixels that barely compress, its data in `parts` IDAT chunks."""
    rows = b"".join(b"\0" + random.Random(y).randbytes(width * 3) for y in range(height))
    data = zlib.compress(rows, 1)
    step = -(-len(data) // parts)

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idats = b"".join(chunk(b"IDAT", data[i : i + step]) for i in range(0, len(data), step))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + idats + chunk(b"IEND", b"")


def test_a_png_is_checked_without_copies_of_its_data_or_its_pixels() -> None:
    """Each chunk was sliced out (a copy), joined to its kind for the CRC (a copy), gathered (a copy) and joined
    again for zlib (a copy), and its pixels were inflated whole: an image answer of 500 MB held about five times
    its size in the worker."""
    import tracemalloc

    image = _noisy_png(1024, 1024, parts=3)
    tracemalloc.start()
    try:
        assert png_size(image) == (1024, 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.5 * len(image) + 2**21, f"peak {peak / len(image):.2f} times the image"


@pytest.mark.parametrize("step", [1, 7, 4096])
def test_pixels_counted_in_any_step_are_the_same(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    monkeypatch.setattr("animastor_tasks.generators.media._INFLATE_STEP", step)
    assert png_size(_noisy_png(40, 30, parts=4)) == (40, 30)
    packer = zlib.compressobj(9)
    bomb = _png_with(8, 8, packer.compress(bytes(8 * (1 + 8 * 3) + 1)) + packer.flush())
    with pytest.raises(ValueError, match="inflates past"):
        png_size(bomb)
    short = _png_with(8, 8, zlib.compress(bytes(8 * (1 + 8 * 3) - 1)))
    with pytest.raises(ValueError, match="IHDR promises"):
        png_size(short)


def test_the_png_checks_say_what_they_said_before_the_pixels_were_counted() -> None:
    """An image whose only IDAT is empty has no image data (it read as a stream cut short), and one that inflates past
    its size before its data turns corrupt inflates past it (it read as corrupt: the count went a step beyond)."""
    with pytest.raises(ValueError, match="has no image data"):
        png_size(_png_with(8, 8, b""))
    stored = zlib.compressobj(0)
    data = bytearray(stored.compress(bytes(8 * 25 * 4)) + stored.flush())
    data[len(data) // 2 :] = b"\xff" * (len(data) - len(data) // 2)
    with pytest.raises(ValueError, match="inflates past"):
        png_size(_png_with(8, 8, bytes(data)))


def test_a_png_larger_than_any_stage_stores_is_refused_from_its_header() -> None:
    with pytest.raises(ValueError, match="larger than"):
        png_size(_png_with(100_000, 100_000, zlib.compress(b"")))


def test_a_png_whose_data_stops_short_is_refused() -> None:
    whole = zlib.compress(bytes(64 * (1 + 64 * 3)))
    with pytest.raises(ValueError, match=r"incomplete or truncated|IHDR promises"):
        png_size(_png_with(64, 64, whole[: len(whole) // 2]))


# The shapes the checks read: a JPEG's start- and end-of-image markers around its segments, a WebP's RIFF size.
JPEG = (
    b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    + b"\xff\xda\x00\x08"
    + bytes(64)
    + b"\xff\xd9"
)
WEBP = b"RIFF" + struct.pack("<I", 4 + 8 + 40) + b"WEBP" + b"VP8L" + struct.pack("<I", 40) + bytes(40)


@pytest.mark.parametrize(
    ("media_type", "whole"), [("image/jpeg", JPEG), ("image/webp", WEBP), ("image/png", render_png("x"))]
)
@pytest.mark.parametrize("cut", [1, 7, 30])
def test_an_image_cut_short_is_refused_and_a_whole_one_passes(media_type: str, whole: bytes, cut: int) -> None:
    check_known_media(media_type, whole)
    check_known_media(media_type, whole + (b"\x00\x00" if media_type == "image/jpeg" else b""))  # padding
    with pytest.raises(CutShort, match=r"cut short|truncated"):  # the connection's, not the scene's
        check_known_media(media_type, whole[:-cut])


@pytest.mark.parametrize(
    ("media_type", "whole"),
    [
        *((kind, mp3_stream()) for kind in ("audio/mpeg", "audio/mp3", "audio/mpeg3", "audio/x-mpeg")),
        *((kind, adts_stream()) for kind in ("audio/aac", "audio/aacp", "audio/x-aac")),
        *((kind, ogg_stream()) for kind in ("audio/ogg", "audio/opus", "application/ogg; codecs=opus")),
        ("audio/x-wav", synthesize_wav("one two")),
    ],
)
@pytest.mark.parametrize("cut", [1, 7, 30])
def test_compressed_audio_cut_short_is_refused_and_a_whole_one_passes(media_type: str, whole: bytes, cut: int) -> None:
    """MP3, AAC and Ogg answers were taken as they came: one cut short by a dropped connection was stored."""
    check_known_media(media_type, whole)
    with pytest.raises(CutShort, match="cut short"):
        check_known_media(media_type, whole[:-cut])
    with pytest.raises(NotMedia, match="not a"):  # no file of the format at all: the server's, not the scene's
        check_known_media(media_type, b'{"error": "CUDA out of memory"}')


def test_pcm_is_not_checked() -> None:
    """PCM has no structure: there is nothing to tell a cut one by."""
    check_known_media("audio/pcm", bytes(3))


def test_another_format_under_an_image_type_is_refused() -> None:
    with pytest.raises(ValueError, match="not a JPEG"):
        check_known_media("image/jpeg", render_png("x"))
    with pytest.raises(ValueError, match="not a WebP"):
        check_known_media("image/webp", JPEG)


@pytest.mark.parametrize(
    "media_type",
    ["audio/wav", "image/png", "image/jpeg", "image/webp", "audio/mpeg", "audio/aac", "audio/ogg", "audio/flac"],
)
def test_a_server_error_text_is_no_file_at_all_and_a_broken_file_of_the_format_is_not_that(media_type: str) -> None:
    """NotMedia (no signature of the format) is the server's doing; a file that has one but is broken or holds no
    samples is a plain ValueError, the scene's verdict. *Why apart:* both were the scene's, and a broken model's
    error text failed every pair of its lane for good."""
    with pytest.raises(NotMedia):
        check_known_media(media_type, b"RuntimeError: CUDA error: out of memory")
    broken = {"audio/wav": synthesize_wav("one")[:40] + bytes(4), "image/png": render_png("x")[:-1] + b"\x00"}
    if media_type in broken:
        with pytest.raises(ValueError) as info:
            check_known_media(media_type, broken[media_type])
        assert not isinstance(info.value, NotMedia | CutShort), info.value
