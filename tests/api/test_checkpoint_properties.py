"""Properties of the checkpoint reader for ANY stored bytes (hypothesis).

The checkpoint is the plugin's own file, but a disk, a crash or a careless hand can
leave anything there: ``decode_checkpoint`` returns a checkpoint or raises
``CheckpointError``, which the plugin quarantines, and never anything else.
"""

from __future__ import annotations

import contextlib
import json
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drasil.api.checkpoint import Checkpoint, CheckpointError, decode_checkpoint

BOUNDED = settings(
    max_examples=300,
    deadline=timedelta(milliseconds=500),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=30,
)
KEYS = st.sampled_from(["version", "bootId", "claims", "checksum", "devices", "state"])


def _decoded(data: bytes) -> None:
    with contextlib.suppress(CheckpointError):
        assert isinstance(decode_checkpoint(data), Checkpoint)


@BOUNDED
@given(st.binary(max_size=2000))
def test_any_bytes_are_a_checkpoint_or_a_checkpoint_error(data: bytes) -> None:
    _decoded(data)


@BOUNDED
@given(st.dictionaries(KEYS, JSON, max_size=5))
def test_any_document_of_the_right_keys_is_a_checkpoint_or_a_checkpoint_error(
    document: dict[str, Any],
) -> None:
    _decoded(json.dumps(document).encode())


@BOUNDED
@given(st.integers(min_value=1, max_value=20_000))
def test_deep_documents_are_a_checkpoint_error(depth: int) -> None:
    _decoded(b'{"claims": ' + b"[" * depth + b"]" * depth + b"}")
