"""The whole-file checks of MP3, ADTS AAC and Ogg answers: a body cut short (a close-delimited answer whose
connection dropped) is refused, a whole one passes, another format under the type is refused.

The streams are built here by hand from the formats' specifications, with frame lengths written out and the Ogg
CRC computed bit by bit, so the checks are not tested against themselves; where an encoder is installed its
output is checked too."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from animastor_tasks.generators.audio_frames import _mpeg_frame_length, check_adts, check_mpeg_audio, check_ogg, ogg_crc
from animastor_tasks.generators.media import check_known_media, synthesize_wav
from tests.support import missing

# --- MP3 ---------------------------------------------------------------------------------------------------

# Frame headers with the frame length their fields give, worked out from ISO 11172-3 / 13818-3 by hand.
MPEG1_L3_128K_44K = b"\xff\xfb\x90\x64"  # MPEG 1 layer III, 128 kbit/s, 44.1 kHz: 144 * 128000 / 44100 = 417
MPEG1_L3_128K_44K_PADDED = b"\xff\xfb\x92\x64"  # the same with the padding bit: 418
MP3_HEADERS = [
    pytest.param(MPEG1_L3_128K_44K, 417, id="mpeg1-layer3-128k-44.1k"),
    pytest.param(MPEG1_L3_128K_44K_PADDED, 418, id="mpeg1-layer3-padded"),
    pytest.param(b"\xff\xf3\x80\xc4", 208, id="mpeg2-layer3-64k-22.05k"),  # 72 * 64000 / 22050 = 208.98
    pytest.param(b"\xff\xe3\x18\xc4", 72, id="mpeg2.5-layer3-8k-8k"),  # 72 * 8000 / 8000
    pytest.param(b"\xff\xfd\xa4\x00", 576, id="mpeg1-layer2-192k-48k"),  # 144 * 192000 / 48000
    pytest.param(b"\xff\xff\xc4\x00", 384, id="mpeg1-layer1-384k-48k"),  # (12 * 384000 / 48000) * 4
    pytest.param(b"\xff\xfa\x90\x64", 417, id="mpeg1-layer3-with-crc"),  # protection bit 0: the CRC is inside
]


def mp3_frame(header: bytes = MPEG1_L3_128K_44K, length: int = 417) -> bytes:
    return header + bytes(length - 4)


def id3v2(payload_size: int = 300, *, footer: bool = False) -> bytes:
    """An ID3v2.4 tag of `payload_size` bytes after its header (synchsafe size: 7 bits a byte)."""
    size = bytes((payload_size >> shift) & 0x7F for shift in (21, 14, 7, 0))
    tag = b"ID3\x04\x00" + (b"\x10" if footer else b"\x00") + size + b"\x00" * payload_size
    return tag + (b"3DI\x04\x00\x10" + size if footer else b"")


ID3V1 = b"TAG" + b"A title".ljust(30, b"\x00") + bytes(95)


def mp3_stream(frames: int = 3) -> bytes:
    """ID3v2 tag, frames (the first one a Xing header frame as LAME writes it), ID3v1 tag."""
    xing = MPEG1_L3_128K_44K + bytes(32) + b"Xing" + bytes(417 - 4 - 32 - 4)
    return id3v2() + xing + mp3_frame() * (frames - 1) + ID3V1


@pytest.mark.parametrize(("header", "length"), MP3_HEADERS)
def test_mp3_frames_of_each_version_and_layer_pass_whole_and_are_refused_one_byte_short(
    header: bytes, length: int
) -> None:
    whole = mp3_frame(header, length) * 3
    check_mpeg_audio(whole)
    with pytest.raises(ValueError, match="MP3 cut short"):
        check_mpeg_audio(whole[:-1])


def test_an_mp3_with_its_tags_passes_whole() -> None:
    check_mpeg_audio(mp3_stream())
    check_mpeg_audio(id3v2(footer=True) + mp3_frame() * 2)
    check_mpeg_audio(mp3_frame() * 2)  # no tags at all


@pytest.mark.parametrize(
    "cut",
    [
        pytest.param(len(id3v2()) - 100, id="mid-id3v2"),
        pytest.param(len(id3v2()), id="after-id3v2"),
        pytest.param(len(id3v2()) + 2, id="mid-first-header"),
        pytest.param(len(id3v2()) + 200, id="mid-first-frame"),
        pytest.param(len(id3v2()) + 417 + 3, id="mid-second-header"),
        pytest.param(len(id3v2()) + 2 * 417 + 400, id="mid-last-frame"),
        pytest.param(len(id3v2()) + 3 * 417 + 2, id="mid-id3v1-marker"),
        pytest.param(len(id3v2()) + 3 * 417 + 60, id="mid-id3v1"),
        pytest.param(len(mp3_stream()) - 1, id="one-byte-short"),
    ],
)
def test_an_mp3_cut_short_is_refused(cut: int) -> None:
    with pytest.raises(ValueError, match="MP3 cut short"):
        check_mpeg_audio(mp3_stream()[:cut])


MPEG2_L3_64K_22K_MONO = b"\xff\xf3\x80\xc4"  # 208 bytes a frame; mono MPEG 2: 9 bytes of side information


def header_frame(tag: bytes, frames: int, header: bytes = MPEG1_L3_128K_44K, length: int = 417) -> bytes:
    """A first frame holding a Xing/Info tag (after the side information: 32 bytes in MPEG 1 stereo, 9 in MPEG 2
    mono) or a VBRI tag (32 bytes in), each declaring `frames` frames and their bytes, as LAME, FFmpeg and
    Fraunhofer's encoder write them."""
    size = (length * (frames + 1)).to_bytes(4, "big")
    if tag == b"VBRI":  # version, delay, quality, bytes, frames
        body = bytes(32) + b"VBRI" + b"\x00\x01" + bytes(2) + b"\x00\x50" + size + frames.to_bytes(4, "big")
    else:  # flags (frames, bytes), frames, bytes
        body = bytes(32 if header == MPEG1_L3_128K_44K else 9) + tag + b"\x00\x00\x00\x03"
        body += frames.to_bytes(4, "big") + size
    return (header + body).ljust(length, b"\x00")


@pytest.mark.parametrize(
    ("tag", "header", "length"),
    [
        pytest.param(b"Info", MPEG1_L3_128K_44K, 417, id="info"),
        pytest.param(b"Xing", MPEG1_L3_128K_44K, 417, id="xing"),
        pytest.param(b"Xing", MPEG2_L3_64K_22K_MONO, 208, id="xing-mpeg2-mono"),
        pytest.param(b"VBRI", MPEG1_L3_128K_44K, 417, id="vbri"),
    ],
)
def test_an_mp3_cut_between_frames_is_refused_where_its_header_frame_declares_their_count(
    tag: bytes, header: bytes, length: int
) -> None:
    """A walk alone reads an MP3 cut between two frames as a shorter whole one; its header frame's count tells."""
    frames = [mp3_frame(header, length)] * 5
    whole = id3v2() + header_frame(tag, 5, header, length) + b"".join(frames) + ID3V1
    check_mpeg_audio(whole)
    for kept in range(4):  # the header frame and `kept` frames after it: the rest lost between two frames
        cut = len(id3v2()) + length * (kept + 1)
        with pytest.raises(ValueError, match=f"declares 5 frames after it, {kept} are there"):
            check_mpeg_audio(whole[:cut])
    # One frame short passes: the slack for a writer that counts its header frame too, which passes whole.
    check_mpeg_audio(whole[: len(id3v2()) + length * 5])
    check_mpeg_audio(header_frame(tag, 6, header, length) + b"".join(frames))
    check_mpeg_audio(header_frame(tag, 0, header, length) + frames[0])  # a count never filled in: no count


@pytest.mark.parametrize(
    "body",
    [
        b'{"error": "CUDA out of memory"}',
        synthesize_wav("one two"),
        bytes(2000),
        b"",
        b"\xff\xef\x90\x64" + bytes(500),  # sync bits, but version bits 01 are reserved
        b"\xff\xfb\xf0\x64" + bytes(500),  # bitrate index 15 is reserved
        b"\xff\xfb\x9c\x64" + bytes(500),  # sample-rate index 3 is reserved
        b"\xff\xf9\x90\x64" + bytes(500),  # layer bits 00 are reserved
        b"\xff\xf1\x50\x80" + bytes(500),  # an ADTS AAC frame
        id3v2() + b"RIFF" + bytes(500),
    ],
)
def test_another_format_under_an_mp3_type_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError, match="not an MP3 file"):
        check_mpeg_audio(body)


@pytest.mark.parametrize(
    "tail",
    [
        pytest.param(b"APETAGEX" + bytes(24), id="apev2-footer"),
        pytest.param(b"LYRICSBEGIN" + b"words" + b"LYRICS200", id="lyrics3"),
        pytest.param(bytes(700), id="zero-padding"),
        pytest.param(b"junk that is no frame", id="junk"),
        pytest.param(b"\xff\xfb\x00\x64" + bytes(100), id="a-free-format-frame"),
        pytest.param(b"\x00", id="one-byte"),
    ],
)
def test_what_follows_the_last_whole_frame_and_is_no_frame_is_accepted(tail: bytes) -> None:
    """Servers and taggers append what this does not know; a body cut short never grows bytes of its own, so
    refusing them would fail good files and catch no cut one (the module's docstring)."""
    check_mpeg_audio(mp3_frame() * 2 + tail)


def test_an_apev2_tag_cut_short_is_refused() -> None:
    header = b"APETAGEX" + (2000).to_bytes(4, "little") + (400).to_bytes(4, "little") + bytes(4)
    header += (0xA0000000).to_bytes(4, "little") + bytes(8)  # flags: has a header, this is the header
    with pytest.raises(ValueError, match="MP3 cut short"):
        check_mpeg_audio(mp3_frame() * 2 + header + bytes(300))
    check_mpeg_audio(mp3_frame() * 2 + header + bytes(400))


# --- ADTS AAC ----------------------------------------------------------------------------------------------


def adts_frame(length: int = 100, *, crc: bool = False) -> bytes:
    """An AAC-LC, 44.1 kHz, stereo ADTS frame of `length` bytes in all (header included)."""
    header = bytes(
        [
            0xFF,
            0xF0 if crc else 0xF1,  # sync, MPEG-4, layer 0, protection_absent
            (1 << 6) | (4 << 2),  # profile LC, sampling frequency index 4 (44.1 kHz), channel config bit 2 = 0
            (2 << 6) | (length >> 11),  # channel config 2, frame length bits 12-11
            (length >> 3) & 0xFF,  # frame length bits 10-3
            ((length & 7) << 5) | 0x1F,  # frame length bits 2-0, buffer fullness 0x7FF
            0xFC,  # buffer fullness, one raw data block
        ]
    ) + (b"\x12\x34" if crc else b"")
    return header + bytes(length - len(header))


def adts_stream() -> bytes:
    return adts_frame(100) + adts_frame(371) + adts_frame(2000, crc=True) + adts_frame(8191)


def test_an_adts_stream_passes_whole_with_or_without_an_id3v2_tag() -> None:
    assert adts_frame(100)[:4] == b"\xff\xf1\x50\x80"  # what AAC-LC 44.1 kHz stereo ADTS frames open with
    check_adts(adts_stream())
    check_adts(id3v2() + adts_stream() + ID3V1)


@pytest.mark.parametrize("cut", [1, 5, 50, 99, 103, 200, 471 + 4, 471 + 1000, 2471 + 8, 2471 + 8000])
def test_an_adts_stream_cut_short_is_refused(cut: int) -> None:
    with pytest.raises(ValueError, match="AAC cut short"):
        check_adts(adts_stream()[:cut] if cut != 1 else adts_stream()[:-1])
    with pytest.raises(ValueError, match="AAC cut short"):
        check_adts((id3v2() + adts_stream())[: len(id3v2()) + cut] if cut != 1 else id3v2() + b"\xff")


@pytest.mark.parametrize(
    "body", [b'{"error": "busy"}', mp3_frame() * 3, synthesize_wav("one"), b"", id3v2() + bytes(50)]
)
def test_another_format_under_an_aac_type_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError, match="not an ADTS AAC file"):
        check_adts(body)


# --- Ogg ---------------------------------------------------------------------------------------------------


def crc_bitwise(data: bytes) -> int:
    """Ogg's CRC one bit at a time, as its specification (RFC 3533) describes it: the reference the module's
    zlib-based one is checked against."""
    register = 0
    for byte in data:
        register ^= byte << 24
        for _ in range(8):
            register = ((register << 1) ^ 0x04C11DB7 if register & 0x80000000 else register << 1) & 0xFFFFFFFF
    return register


def ogg_page(body: bytes, *, flags: int = 0, serial: int = 0x1234, sequence: int = 0) -> bytes:
    lacing = [255] * (len(body) // 255) + [len(body) % 255]
    head = b"OggS\x00" + bytes([flags]) + (sequence * 960).to_bytes(8, "little") + serial.to_bytes(4, "little")
    head += sequence.to_bytes(4, "little")
    tail = bytes([len(lacing), *lacing]) + body
    crc = crc_bitwise(head + bytes(4) + tail)
    return head + crc.to_bytes(4, "little") + tail


def ogg_stream(serial: int = 0x1234) -> bytes:
    """An Opus-shaped stream: its head page (beginning of stream), a tags page, audio, the end-of-stream page."""
    return (
        ogg_page(b"OpusHead\x01\x01\x38\x01\x80\xbb\x00\x00\x00\x00\x00", flags=0x02, serial=serial)
        + ogg_page(b"OpusTags" + bytes(20), serial=serial, sequence=1)
        + ogg_page(bytes(range(256)) * 3, serial=serial, sequence=2)
        + ogg_page(bytes(300), flags=0x04, serial=serial, sequence=3)
    )


def _page_starts(data: bytes) -> list[int]:
    starts, at = [], 0
    while at < len(data):
        starts.append(at)
        at += 27 + data[at + 26] + sum(data[at + 27 : at + 27 + data[at + 26]])
    return starts


def test_the_ogg_crc_matches_its_catalogue_value_a_bitwise_crc_and_a_real_encoders_page() -> None:
    # CRC-32/CKSUM (poly 0x04C11DB7, init 0, not reflected) has check value 0x765E7680 with its final xor of
    # 0xFFFFFFFF; Ogg's CRC is the same without that xor.
    assert ogg_crc(b"123456789") == crc_bitwise(b"123456789") == 0x765E7680 ^ 0xFFFFFFFF == 0x89A1897F
    noise = os.urandom(5000)
    assert ogg_crc(noise) == crc_bitwise(noise)
    assert ogg_crc(b"") == 0
    # The first page opusenc 0.2 (libopus 1.3.1) wrote for a mono 48 kHz WAV: its CRC is bytes 22-25.
    page = bytes.fromhex(
        "4f67675300020000000000000000d3408f7c000000000cbc0d9b01134f707573486561640101380180bb0000000000"
    )
    assert ogg_crc(page[:22] + bytes(4) + page[26:]) == int.from_bytes(page[22:26], "little") == 0x9B0DBC0C


def test_an_ogg_stream_passes_whole_chained_and_multiplexed() -> None:
    check_ogg(ogg_stream())
    check_ogg(ogg_stream(1) + ogg_stream(2))  # chained: one stream after another, each ended
    first, second = ogg_stream(1), ogg_stream(2)
    a, b = _page_starts(first), _page_starts(second)
    # Multiplexed: both streams open, then their pages interleaved.
    check_ogg(first[: a[1]] + second[: b[1]] + first[a[1] :] + second[b[1] :])


def test_an_ogg_stream_cut_short_is_refused_wherever_it_is_cut_even_between_pages() -> None:
    """Cut between two pages, every page is whole and carries its CRC: only the missing end-of-stream page
    tells, and that is the case a close-delimited answer whose connection dropped leaves most often."""
    whole = ogg_stream()
    starts = _page_starts(whole)
    assert len(starts) == 4
    for cut in range(1, len(whole)):
        with pytest.raises(ValueError, match="Ogg cut short"):
            check_ogg(whole[:cut])
    for boundary in starts[1:]:
        with pytest.raises(ValueError, match="end-of-stream"):
            check_ogg(whole[:boundary])


def test_a_multiplexed_ogg_cut_after_one_stream_ended_is_refused() -> None:
    """The last page present is an end-of-stream page, but of the other stream: the second is still open."""
    first, second = ogg_stream(1), ogg_stream(2)
    a, b = _page_starts(first), _page_starts(second)
    interleaved = first[: a[1]] + second[: b[1]] + second[b[1] : b[3]] + first[a[1] :]
    with pytest.raises(ValueError, match="1 logical stream"):
        check_ogg(interleaved)


def test_an_ogg_page_whose_crc_fails_is_refused() -> None:
    broken = bytearray(ogg_stream())
    broken[_page_starts(bytes(broken))[2] + 100] ^= 0x01
    with pytest.raises(ValueError, match="fails its CRC"):
        check_ogg(bytes(broken))


@pytest.mark.parametrize(
    "body",
    [b'{"error": "busy"}', synthesize_wav("one"), mp3_frame() * 2, b"", b"OggS\x01" + bytes(40)],
)
def test_another_format_under_an_ogg_type_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError, match="not an Ogg file"):
        check_ogg(body)


# --- real encoders -----------------------------------------------------------------------------------------

# (tool, arguments after it with {wav} and {out} in them, the media type its output is checked as): Debian's lame,
# opus-tools, vorbis-tools and flac, which .ci/run installs (ffmpeg, the one that writes ADTS, brings a hundred
# packages).
ENCODERS = [
    pytest.param("lame", ["--quiet", "{wav}", "{out}"], "audio/mpeg", id="lame"),
    pytest.param("lame", ["--quiet", "--add-id3v2", "--tt", "A title", "{wav}", "{out}"], "audio/mpeg", id="lame-tags"),
    pytest.param("opusenc", ["--quiet", "{wav}", "{out}"], "audio/ogg", id="opusenc"),
    pytest.param("oggenc", ["-Q", "-o", "{out}", "{wav}"], "audio/ogg", id="oggenc"),
    pytest.param("flac", ["--silent", "-o", "{out}", "{wav}"], "audio/flac", id="flac"),
    pytest.param("flac", ["--silent", "-8", "--blocksize=1152", "-o", "{out}", "{wav}"], "audio/flac", id="flac-8"),
]  # fmt: skip


@pytest.mark.parametrize(("tool", "arguments", "media_type"), ENCODERS)
def test_a_real_encoders_output_passes_whole_and_is_refused_cut_short(
    tool: str, arguments: list[str], media_type: str, tmp_path: Path
) -> None:
    """On a real encoder's files, not only on the frames these tests build."""
    if shutil.which(tool) is None:
        missing(f"{tool} is not installed: nothing to encode {media_type} with")
    wav, out = tmp_path / "in.wav", tmp_path / "out"
    wav.write_bytes(synthesize_wav("one two three four five six seven eight", sample_rate=48000))
    done = subprocess.run(
        [tool, *(a.format(wav=wav, out=out) for a in arguments)], capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-300:]
    whole = out.read_bytes()
    check_known_media(media_type, whole)
    cuts = range(1, len(whole), 7)
    refused = 0
    for cut in cuts:
        try:
            check_known_media(media_type, whole[:cut])
        except ValueError:
            refused += 1
    if media_type in ("audio/ogg", "audio/flac"):
        assert refused == len(cuts)  # Ogg's end-of-stream page, FLAC's CRCs and total: wherever it is cut
    else:
        # A cut exactly between two frames passes where no header frame declares their count (see below).
        # Frames are hundreds of bytes long, so those are few.
        assert refused >= 0.95 * len(cuts), f"{refused} of {len(cuts)} cuts refused"
        with pytest.raises(ValueError, match="cut short"):
            check_known_media(media_type, whole[:-1])


@pytest.mark.parametrize(
    ("arguments", "declared"),
    [
        pytest.param(["--quiet"], True, id="cbr-info"),
        pytest.param(["--quiet", "-V", "2", "--add-id3v2", "--tt", "A title"], True, id="vbr-xing-tags"),
        pytest.param(["--quiet", "-t"], False, id="no-header-frame"),
    ],
)
def test_lames_mp3_cut_between_two_frames(arguments: list[str], declared: bool, tmp_path: Path) -> None:
    """With its Info/Xing frame (a file, LAME's default), every cut between two frames but after the last but
    one is refused; without one (`-t`, or an encoder writing to a pipe) the walk cannot tell such a cut."""
    if shutil.which("lame") is None:
        missing("lame is not installed: nothing to encode audio/mpeg with")
    wav, out = tmp_path / "in.wav", tmp_path / "out.mp3"
    wav.write_bytes(synthesize_wav("one two three four five six seven eight", sample_rate=48000))
    subprocess.run(["lame", *arguments, str(wav), str(out)], capture_output=True, timeout=60, check=True)
    whole = out.read_bytes()
    check_mpeg_audio(whole)
    synchsafe = whole[6:10]
    at = 10 + sum(b << (7 * (3 - i)) for i, b in enumerate(synchsafe)) if whole.startswith(b"ID3") else 0
    boundaries = []  # the end of each frame, the header frame first
    while len(whole) - at >= 4 and (length := _mpeg_frame_length(whole[at : at + 4])) and at + length <= len(whole):
        at += length
        boundaries.append(at)
    assert len(boundaries) > 30, boundaries
    passed = [i for i, cut in enumerate(boundaries[:-1]) if _passes(whole[:cut])]
    if declared:
        assert passed == [len(boundaries) - 2], passed  # the one frame of slack, and no other
    else:
        assert passed == list(range(len(boundaries) - 1))


def _passes(body: bytes) -> bool:
    try:
        check_mpeg_audio(body)
    except ValueError:
        return False
    return True
