"""Fixtures shared by the unit and component tests."""

from __future__ import annotations

import jsonschema
import pytest

from drasil.kubeletplugin.gpucheck import cdicheck


@pytest.fixture(scope="session")
def schema_validator() -> jsonschema.Draft7Validator:
    """The official CDI JSON Schema (kubeletplugin/gpucheck/cdi-schema.md says which)."""
    validator: jsonschema.Draft7Validator = cdicheck.schema_validator()
    return validator
