"""docs/schemas/ against what the runtime really produces (flows and CLI on the real stores), the
sample book against the book schema, bad documents refused, and the contract's TypedDicts in step."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from animastor_tasks import contract
from animastor_tasks.dev.samples import load_sample_book
from animastor_tasks.domain.book import book_to_dict
from animastor_tasks.errors import InvalidCommand
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import layers as layers_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow import status as status_flow
from animastor_tasks.worker import tasks

from .helpers import advertise, make_book
from .test_cli_reads import cli
from .test_generate import dispatched_jobs

SCHEMAS = Path(__file__).resolve().parents[2] / "docs" / "schemas"
BASE = "https://animastor.dev/schemas/v1/"


def _load() -> dict[str, dict[str, Any]]:
    return {p.name.removesuffix(".schema.json"): json.loads(p.read_text()) for p in sorted(SCHEMAS.glob("*.json"))}


ALL = _load()
REGISTRY: Registry = Registry().with_resources((s["$id"], Resource.from_contents(s)) for s in ALL.values())


def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator(ALL[name], registry=REGISTRY)


def check(name: str, document: object) -> None:
    errors = sorted(validator(name).iter_errors(document), key=lambda e: list(e.path))
    assert not errors, f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


def refused(name: str, document: object) -> bool:
    return not validator(name).is_valid(document)


@pytest.mark.parametrize("name", sorted(ALL))
def test_each_schema_is_valid_2020_12_with_its_id(name: str) -> None:
    schema = ALL[name]
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"{BASE}{name}.schema.json" and schema["description"]


def test_sample_book_and_its_round_trip_match_the_book_schema() -> None:
    raw = json.loads((Path(tasks.__file__).parents[1] / "dev" / "data" / "sample_book.json").read_text())
    check("book", raw)
    check("book", book_to_dict(load_sample_book()))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.pop("title"),
        lambda b: b.update(chapters=[]),
        lambda b: b["chapters"][0].update(scenes=[]),
        lambda b: b.update(book_id=""),
        lambda b: b.update(book_id="   "),
        lambda b: b.update(book_id="x" * 201),
        lambda b: b["chapters"][0].update(chapter_id="a\nb"),
        lambda b: b["chapters"][0]["scenes"][0].update(scene_id="bidi\u202e"),
        lambda b: b["chapters"][0]["scenes"][0].update(text=" \n\t"),
        lambda b: b["chapters"][0]["scenes"][0].update(text="nul\x00"),
        lambda b: b["chapters"][0]["scenes"][0].update(text=1),
        lambda b: b["chapters"][0]["scenes"][0].update(prompt=None),
        lambda b: b["chapters"][0].update(title="two\nlines"),
        lambda b: b.update(chapters={"ch1": {}}),
    ],
)
def test_bad_books_are_refused(mutate: Any) -> None:
    book = book_to_dict(make_book("b", chapters=1, scenes=2))
    mutate(book)
    assert refused("book", book)


def test_book_schema_allows_what_the_parser_allows() -> None:
    book = book_to_dict(make_book("глава: *?[]", chapters=1, scenes=1))
    book["future_field"] = {"kept": False}
    book["chapters"][0]["scenes"][0]["text"] = "line one\n\tline two 第一章 🙂"
    check("book", book)


def test_regenerate_kwargs_and_results_of_the_real_flow(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=2, scenes=2))
    advertise(rt, "gpu.audio", "gpu.image", host="w@box")
    kwargs: contract.RegenerateKwargs = {
        "book_id": "b",
        "stages": ["all"],
        "scenes": [["ch1", "s1"], ["ch2", "s2"]],
        "command_id": "7f0c4a52-3a57-4d7e-9d36-5b2a3c1f0e11",
        "force": True,
        "priority": "interactive",
    }
    check("regenerate-kwargs", kwargs)
    first = tasks.regenerate.run(**kwargs)
    check("regenerate-result", first)
    assert len(first["commands"]) == 2 and first["skipped"] == []
    replay = tasks.regenerate.run(**kwargs)
    check("regenerate-result", replay)
    assert replay["replayed"] is True
    layers_flow.set_layers(rt.ports, "b", [], ["image"])
    whole = regenerate_flow.regenerate(rt.ports, "b", ["all"], None, None, False, "bulk")
    check("regenerate-result", whole)
    assert whole["skipped"] == [{"stage": "image", "reason": "layer_disabled"}]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stages": ["audio"]},
        {"book_id": "b", "stages": []},
        {"book_id": "b", "stages": "audio"},
        {"book_id": "b", "stages": ["audio"], "scenes": []},
        {"book_id": "b", "stages": ["audio"], "scenes": [["ch1"]]},
        {"book_id": "b", "stages": ["audio"], "command_id": "not-a-uuid"},
        {"book_id": "b", "stages": ["audio"], "force": "yes"},
        {"book_id": "b", "stages": ["audio"], "priority": "urgent"},
        {"book_id": "b", "stages": ["audio"], "colour": "red"},
    ],
)
def test_bad_regenerate_kwargs_are_refused(kwargs: dict[str, Any]) -> None:
    assert refused("regenerate-kwargs", kwargs)


def test_cancel_and_gate_of_the_real_tasks(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    advertise(rt, "gpu.audio", host="w@box")
    regenerate_flow.regenerate(rt.ports, "b", ["all"])  # image has no consumer: BLOCKED
    check("gate-kwargs", {"book_id": "b", "lane": "gpu.audio"})
    check("gate-result", tasks.gate_task.run("b", lane="gpu.audio"))
    check("cancel-kwargs", {"book_id": "b", "reason": "test"})
    done = tasks.cancel.run("b", reason="test")
    check("cancel-result", done)
    assert done["cancelled_commands"] and done["released"] >= 1
    check("cancel-result", cancel_flow.cancel(rt.ports, "b"))  # idempotent: nothing left to cancel
    assert refused("cancel-kwargs", {"book_id": "b", "reason": 3})
    assert refused("cancel-kwargs", {"book_id": "b", "reason": "x" * 1_001})
    assert refused("cancel-kwargs", {"book_id": "b", "reason": "a\nb\x1b[31m"})  # the task refuses it too
    check("cancel-kwargs", {"book_id": "b", "reason": None})
    assert refused("gate-result", {"book_id": "b", "authorized": 0, "released": 0, "outcomes": {"x": 1}, "error": None})


def test_status_commands_and_queues_json_from_the_cli(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    advertise(rt, "gpu.audio", host="audio@box")
    regenerate_flow.regenerate(rt.ports, "b", ["all"])
    check("status", status_flow.status(rt.ports, "b"))
    check("status", json.loads(cli("status", "b", "--json").stdout))
    check("commands", json.loads(cli("commands", "b", "--json").stdout))
    check("queues", json.loads(cli("queues", "--json").stdout))
    broken = status_flow.status(rt.ports, "b")
    broken["commands"][0]["progress"].pop("released")
    assert refused("status", broken)


def test_status_says_why_a_failed_pair_failed(rt) -> None:
    """Old code: `status` showed `failed` and nothing of why; the error was in Postgres, the journal and a log."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio", host="audio@box")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    job = next(j for j in dispatched_jobs(rt, "b") if j.scene_id == "s1")
    assert rt.ports.jobs.fail_job(*job.owned, "stage 'audio': inference endpoint answered 400: no voice", "gpu.audio")
    shown = json.loads(cli("status", "b", "--json").stdout)
    check("status", shown)
    cells = {s["scene_id"]: s["stages"]["audio"] for s in shown["scenes"]}
    assert cells["s1"]["state"] == "failed" and cells["s1"]["error"].endswith("answered 400: no voice")
    assert cells["s2"]["error"] is None and cells["s2"]["state"] == "generating"


def _schema_keys(schema: dict[str, Any]) -> tuple[set[str], set[str]]:
    return set(schema["properties"]), set(schema.get("required", []))


PAIRS: list[tuple[Any, dict[str, Any]]] = [
    (contract.RegenerateKwargs, ALL["regenerate-kwargs"]),
    (contract.RegenerateResult, ALL["regenerate-result"]),
    (contract.CommandCreated, ALL["regenerate-result"]["properties"]["commands"]["items"]),
    (contract.CancelKwargs, ALL["cancel-kwargs"]),
    (contract.CancelResult, ALL["cancel-result"]),
    (contract.GateKwargs, ALL["gate-kwargs"]),
    (contract.GateResult, ALL["gate-result"]),
    (contract.BookStatus, ALL["status"]),
    (contract.CommandStatusRow, ALL["status"]["properties"]["commands"]["items"]),
    (contract.SceneStatus, ALL["status"]["properties"]["scenes"]["items"]),
    (
        contract.StageState,
        ALL["status"]["properties"]["scenes"]["items"]["properties"]["stages"]["additionalProperties"],
    ),
    (contract.Progress, ALL["common"]["$defs"]["progress"]),
    (contract.CommandListRow, ALL["commands"]["items"]),
    (contract.QueueRow, ALL["queues"]["items"]),
]


@pytest.mark.parametrize(("typed", "schema"), PAIRS, ids=[t.__name__ for t, _ in PAIRS])
def test_typed_dict_keys_match_the_schema(typed: Any, schema: dict[str, Any]) -> None:
    properties, required = _schema_keys(schema)
    assert set(typing.get_type_hints(typed)) == properties
    assert set(typed.__required_keys__) == required


@pytest.mark.parametrize(
    ("book_id", "lane", "needle"),
    [(42, None, "book_id"), ("", None, "book_id"), ("nope", None, "unknown book"), ("b", "gpu.nope", "lane")],
)
def test_a_gate_task_of_no_such_book_or_lane_is_refused(rt, book_id: Any, lane: Any, needle: str) -> None:
    """`animastor.gate` of a number was a TypeError from the Redis key builder; of an empty or unknown book it
    answered an empty pass, as if the book had been looked at."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    with pytest.raises(InvalidCommand, match=needle):
        tasks.gate_task.run(book_id, lane=lane)
