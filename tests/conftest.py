"""Hooks and fixtures shared by the unit and component tests."""

from __future__ import annotations

import jsonschema
import pytest

from drasil.api.limits import allow_nesting
from drasil.kubeletplugin.gpucheck import cdicheck


def pytest_sessionstart(session: pytest.Session) -> None:
    # What every drasil process does where it starts: tests compile selectors and
    # decode objects as deep as the API server stores.
    allow_nesting()


@pytest.fixture(scope="session")
def schema_validator() -> jsonschema.Draft7Validator:
    """The official CDI JSON Schema (kubeletplugin/gpucheck/cdi-schema.md says which)."""
    validator: jsonschema.Draft7Validator = cdicheck.schema_validator()
    return validator
