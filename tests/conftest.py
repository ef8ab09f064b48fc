"""Fixtures shared by the unit and component tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

CDI_SCHEMA_DIR = Path(__file__).resolve().parent / "data" / "cdi-schema"


@pytest.fixture(scope="session")
def schema_validator() -> jsonschema.Draft7Validator:
    """The official CDI JSON Schema (tests/data/cdi-schema), with its defs resolved."""
    schema_file, defs_file = CDI_SCHEMA_DIR / "schema.json", CDI_SCHEMA_DIR / "defs.json"
    if not (schema_file.is_file() and defs_file.is_file()):
        pytest.fail(
            f"official CDI schema not found: expected schema.json and defs.json in "
            f"{CDI_SCHEMA_DIR} (see its README.md for where it comes from)"
        )
    defs = json.loads(defs_file.read_text())
    registry: Registry[Any] = Registry().with_resource(
        "defs.json", Resource.from_contents(defs, default_specification=DRAFT7)
    )
    schema = json.loads(schema_file.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema, registry=registry)
