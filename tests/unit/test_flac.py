"""The whole-file check of FLAC answers: a body cut short anywhere (inside a frame, between two frames, in its
metadata) is refused, a whole one passes, another format under the type is refused.

The streams are built here from RFC 9639, with CONSTANT subframes (a frame's samples all one value) and both
CRCs computed bit by bit, so the check is not tested against itself; where `flac` is installed its output is
checked too (test_audio_frames.py)."""

from __future__ import annotations

import pytest

from animastor_tasks.generators.flac import check_flac, crc8, crc16
from animastor_tasks.generators.media import check_known_media, synthesize_wav

BLOCK = 192  # block size code 1
FRAME_SIZE = 11  # header (6 bytes), one CONSTANT subframe of 16 bits (3), CRC-16 (2)


def bitwise_crc(data: bytes, polynomial: int, width: int) -> int:
    crc, top, mask = 0, 1 << (width - 1), (1 << width) - 1
    for byte in data:
        for bit in range(7, -1, -1):
            feedback = bool(crc & top) ^ bool(byte >> bit & 1)
            crc = ((crc << 1) & mask) ^ (polynomial if feedback else 0)
    return crc


def utf8_coded(number: int) -> bytes:
    """A frame or sample number as FLAC codes it: UTF-8's scheme, stretched to 36 bits."""
    if number < 0x80:
        return bytes([number])
    length = next(n for n in range(2, 8) if number < 1 << (5 * n + 1))
    tail = [0x80 | (number >> (6 * i)) & 0x3F for i in range(length - 2, -1, -1)]
    return bytes([(0xFF << (8 - length)) & 0xFF | number >> (6 * (length - 1))]) + bytes(tail)


def frame(number: int, value: int = 1000, *, variable: bool = False) -> bytes:
    """A mono 16-bit 44.1 kHz frame of `BLOCK` samples all `value`: frame `number` (a fixed-blocksize stream) or
    the one starting at sample `number` (variable)."""
    header = bytes([0xFF, 0xF9 if variable else 0xF8, 0x19, 0x08]) + utf8_coded(number)
    header += bytes([bitwise_crc(header, 0x07, 8)])
    body = header + b"\x00" + value.to_bytes(2, "big")  # a CONSTANT subframe, no wasted bits
    return body + bitwise_crc(body, 0x8005, 16).to_bytes(2, "big")


def streaminfo(total: int, *, last: bool = False) -> bytes:
    fields = BLOCK.to_bytes(2, "big") * 2 + FRAME_SIZE.to_bytes(3, "big") * 2
    # 20 bits of sample rate, 3 of channels - 1, 5 of bits per sample - 1, 36 of total samples
    fields += ((44100 << 44) | (0 << 41) | (15 << 36) | total).to_bytes(8, "big") + bytes(16)  # and an MD5
    return bytes([0x80 if last else 0x00]) + len(fields).to_bytes(3, "big") + fields


def flac(frames: int = 6, *, total: int | None = None, variable: bool = False) -> bytes:
    """STREAMINFO, a VORBIS_COMMENT block of 8 bytes and a last PADDING block of 20, then the frames."""
    comment = b"\x04" + (8).to_bytes(3, "big") + bytes(8)
    padding = b"\x81" + (20).to_bytes(3, "big") + bytes(20)
    numbers = [i * BLOCK if variable else i for i in range(frames)]
    audio = b"".join(frame(n, variable=variable) for n in numbers)
    return b"fLaC" + streaminfo(BLOCK * frames if total is None else total) + comment + padding + audio


HEAD = len(flac(0))


def test_the_crcs_match_their_catalogue_values_and_a_bitwise_crc() -> None:
    # CRC-8/SMBUS and CRC-16/UMTS (what FLAC's are) of "123456789": 0xF4 and 0xFEE8.
    assert (crc8(b"123456789"), crc16(b"123456789")) == (0xF4, 0xFEE8)
    sample = bytes(range(256)) * 3
    assert crc8(sample) == bitwise_crc(sample, 0x07, 8)
    assert crc16(sample) == bitwise_crc(sample, 0x8005, 16)


@pytest.mark.parametrize("variable", [False, True], ids=["fixed-blocksize", "variable-blocksize"])
def test_a_flac_stream_passes_whole_and_is_refused_wherever_it_is_cut(variable: bool) -> None:
    whole = flac(variable=variable)
    check_flac(whole)
    check_known_media("audio/flac", whole)
    check_flac(b"ID3\x04\x00\x00\x00\x00\x00\x0a" + bytes(10) + whole + b"TAG" + bytes(125))  # tags around it
    for cut in range(1, len(whole)):
        with pytest.raises(ValueError, match="FLAC cut short"):
            check_flac(whole[:cut])


def test_a_flac_cut_between_two_frames_is_refused_by_its_total_and_passes_without_one() -> None:
    for frames in range(1, 6):
        with pytest.raises(ValueError, match=f"frames end at sample {frames * BLOCK}, its STREAMINFO declares 1152"):
            check_flac(flac()[: HEAD + frames * FRAME_SIZE])
    unknown = flac(total=0)  # an encoder that did not know its total: between two frames is all it cannot tell
    check_flac(unknown[: HEAD + 3 * FRAME_SIZE])
    with pytest.raises(ValueError, match="last frame fails its CRC"):
        check_flac(unknown[: HEAD + 3 * FRAME_SIZE + 5])


def test_frame_numbers_past_127_are_read_from_their_utf8_coding() -> None:
    """Frame 128 on takes two bytes or more: a stream of 300 frames, cut after frame 200."""
    whole = flac(300)
    check_flac(whole)
    end = HEAD + sum(len(frame(n)) for n in range(201))
    with pytest.raises(ValueError, match="frames end at sample 38592, its STREAMINFO declares 57600"):
        check_flac(whole[:end])


def test_a_frame_whose_crc_fails_is_refused() -> None:
    whole = bytearray(flac())
    whole[-3] ^= 0x01  # the last frame's sample value
    with pytest.raises(ValueError, match="last frame fails its CRC"):
        check_flac(bytes(whole))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": "CUDA out of memory"}', "not a FLAC file: no fLaC marker"),
        (synthesize_wav("one two"), "not a FLAC file: no fLaC marker"),
        (b"fLaC" + b"\x04" + (8).to_bytes(3, "big") + bytes(8), "its first metadata block is no STREAMINFO"),
        (b"fLaC" + streaminfo(BLOCK, last=True) + b"junk that is no frame", "no frame header after its metadata"),
        (b"fLaC" + streaminfo(BLOCK, last=True), "FLAC cut short: no audio frame after its metadata"),
        (b"", "not a FLAC file"),
    ],
)
def test_another_format_or_no_audio_under_a_flac_type_is_refused(body: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_known_media("audio/flac", body)
