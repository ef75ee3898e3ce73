"""A book's audio and images made through the OpenAI-compatible generators by the real generate flow."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.generators.media import png_size, wav_duration_seconds

from .helpers import advertise, make_book, states
from .test_generate import drain, with_stage
from .test_http_generator import start_server  # noqa: F401  (fixture: the real reference server)


def test_openai_stages_make_every_scene_through_503s_with_retry_after(rt, tmp_path, start_server) -> None:  # noqa: F811
    url = start_server("--fail-first", "3", "--retry-after", "0.2")
    registry = rt.settings.registry
    audio = replace(registry.get("audio"), generator="openai-speech", endpoint=f"{url}/v1", params={"model": "tts-1"})
    image = replace(
        registry.get("image"), generator="openai-images", endpoint=f"{url}/v1", params={"model": "x", "size": "32x32"}
    )
    with_stage(rt, audio, tmp_path)
    with_stage(rt, image, tmp_path)
    rt.catalog.import_book(make_book("b", chapters=2, scenes=2))
    advertise(rt, "gpu.audio")
    advertise(rt, "gpu.image")
    regenerate_flow.regenerate(rt.ports, "b", ["all"])
    results = drain(rt, "b")
    assert {r["outcome"] for r in results} == {"ready"}, results
    assert set(states(rt, "b").values()) == {"ready"}
    with rt.db.transaction() as conn:
        rows = conn.execute("SELECT stage, path FROM artifacts WHERE book_id = 'b'").fetchall()
    assert sorted(stage for stage, _ in rows) == ["audio"] * 4 + ["image"] * 4
    for stage, path in rows:
        data = Path(path).read_bytes()
        if stage == "audio":
            assert wav_duration_seconds(data) > 0
        else:
            assert png_size(data) == (32, 32)
