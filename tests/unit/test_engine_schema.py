"""kvctl/schemas/engine_entry.json is a valid schema and names exactly the values the code can report."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from kvcached.node.clean.cleanup import Action
from kvcached.node.clean.decide import State
from kvcached.node.clean.leftovers.decide import REASONS
from kvcached.node.clean.leftovers.families import Engine, EngineKind
from kvcached.node.clean.scan import FileType

SCHEMA = json.loads((Path(__file__).parents[2] / "kvctl/schemas/engine_entry.json").read_text())


def test_it_is_a_valid_draft_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_its_enums_are_the_codes() -> None:
    props = SCHEMA["properties"]
    for key, enum in (("kind", EngineKind), ("engine", Engine), ("reason", REASONS), ("state", State),
                      ("action", Action), ("type", FileType)):
        assert props[key]["enum"] == [str(m) for m in enum], key


def test_an_entry_without_engine_or_bytes_is_rejected() -> None:
    entry = {"kind": "vllm-shm", "engine": "vllm", "path": "/dev/shm/psm_0a1b2c3d", "deployment": None,
             "state": "stale", "action": "removed", "reason": "unused", "detail": "", "pids": [], "uid": 0,
             "mtime": 1.0, "type": "regular", "bytes": 4096}
    jsonschema.validate(entry, SCHEMA)
    for key in ("engine", "bytes"):
        bad = dict(entry)
        del bad[key]
        try:
            jsonschema.validate(bad, SCHEMA)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"an entry without {key} validated")
