"""The check every CDI spec of the tests passes: the official schema, then our rules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jsonschema

from drasil.driver.cdi.spec import validate_spec


def assert_valid_cdi(validator: jsonschema.Draft7Validator, spec: Mapping[str, Any]) -> None:
    validator.validate(spec)
    # The schema does not check env items; this is the rule it means.
    for edits in _every_edits(spec):
        for entry in edits.get("env", []):
            name, eq, _ = entry.partition("=")
            assert eq, f"env entry {entry!r} has no '='"
            assert name, f"env entry {entry!r} has an empty name"
    validate_spec(spec)


def _every_edits(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    edits = [d["containerEdits"] for d in spec["devices"]]
    return [*edits, spec.get("containerEdits", {})]
