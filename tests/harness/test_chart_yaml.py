"""The e2e harness reads the rendered chart strictly: a key twice in one mapping (a
label emitted twice) is an error, as ArgoCD makes it, not the last value silently."""

from __future__ import annotations

import pytest

from e2e.harness.chart import DuplicateKeyError, load_rendered

TWICE = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: a
  labels:
    app.kubernetes.io/name: drasil
    app.kubernetes.io/name: drasil
"""


def test_a_label_given_twice_is_an_error_that_names_it() -> None:
    with pytest.raises(DuplicateKeyError, match=r"duplicate key 'app\.kubernetes\.io/name'"):
        load_rendered(TWICE)


def test_documents_without_duplicates_load_and_empty_ones_are_dropped() -> None:
    text = "---\n" + TWICE.replace("    app.kubernetes.io/name: drasil\n", "", 1) + "---\n"
    objs = load_rendered(text)
    assert [o["metadata"]["labels"] for o in objs] == [{"app.kubernetes.io/name": "drasil"}]
