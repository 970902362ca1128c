"""kvctl's JSON Schemas as the tests validate against them: every file of kvctl/schemas/, references resolved offline.

gc.json and inspect.json refer to engine_entry.json by its $id; a registry of
all of them resolves that without the network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource

SCHEMAS = Path(__file__).resolve().parents[1] / "kvctl" / "schemas"


def registry() -> Registry:
    """Every schema of kvctl/schemas/ under its $id."""
    docs = [json.loads(p.read_text()) for p in sorted(SCHEMAS.glob("*.json"))]
    return Registry().with_resources((d["$id"], Resource.from_contents(d)) for d in docs)


def validate(doc: Any, name: str) -> None:
    """Check `doc` against kvctl/schemas/<name>.json (the documented contract)."""
    schema = json.loads((SCHEMAS / f"{name}.json").read_text())
    jsonschema.Draft202012Validator(schema, registry=registry()).validate(doc)
