"""The reference server's OpenAI routes driven by the official `openai` client: real WAV and PNG come back.

This is what lets a demo or a developer point any OpenAI-shaped tool at the reference server,
and what keeps its routes honest about the shape real servers answer in.
"""

from __future__ import annotations

import base64

import pytest

from animastor_tasks.generators.media import png_size, wav_duration_seconds

from .test_http_generator import SECRET, StartServer, start_server  # noqa: F401

openai = pytest.importorskip("openai")


def test_official_client_gets_a_real_wav_and_png(start_server: StartServer) -> None:  # noqa: F811
    url = start_server("--api-key", SECRET)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=SECRET, max_retries=0, timeout=20.0)
    text = " ".join(["lantern"] * 30)

    speech = client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="wav")
    wav = speech.content
    seconds = wav_duration_seconds(wav)
    assert seconds == pytest.approx(30 * 0.12)

    images = client.images.generate(
        model="dall-e-2", prompt="a lighthouse in fog", size="256x256", response_format="b64_json"
    )
    assert images.data is not None and len(images.data) == 1
    encoded = images.data[0].b64_json
    assert encoded is not None
    png = base64.b64decode(encoded)
    assert png_size(png) == (256, 256)
    print(
        f"\nopenai {openai.__version__}: speech {len(wav)} bytes WAV, {seconds:.2f} s; "
        f"image {len(png)} bytes PNG, {png_size(png)[0]}x{png_size(png)[1]}"
    )


def test_official_client_sees_our_errors_in_its_own_shape(start_server: StartServer) -> None:  # noqa: F811
    url = start_server("--api-key", SECRET)
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong-key", max_retries=0, timeout=20.0)
    with pytest.raises(openai.AuthenticationError) as denied:
        wrong.audio.speech.create(model="tts-1", voice="alloy", input="hello", response_format="wav")
    assert "missing or invalid API key" in str(denied.value)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=SECRET, max_retries=0, timeout=20.0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model="dall-e-2", prompt="a lighthouse", response_format="url")
    assert "use 'b64_json'" in str(refused.value)
