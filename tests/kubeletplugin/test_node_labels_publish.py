"""The node's GPU labels put in place (kubeletplugin/dra/nodelabels.py): a patch of the
plugin's own Node that changes only drasil's keys, or NFD's local feature file."""

from __future__ import annotations

from pathlib import Path

import pytest

from drasil.driver.nvidia.nodelabels import OWN_KEY
from drasil.kubeletplugin.dra.nodelabels import NFD_FILE, NodeLabels, label_patch

WANTED = {"drasil.dev/gpu.product": "NVIDIA-L4", "drasil.dev/gpu.count": "2"}


def test_the_patch_sets_what_differs_and_removes_only_own_keys_no_longer_wanted() -> None:
    current = {
        "kubernetes.io/hostname": "n",
        "drasil.dev/mig-mode": "dynamic",  # the operator's: never touched
        "drasil.dev/gpu.product": "NVIDIA-L4",
        "drasil.dev/mig-1g.10gb.count": "7",  # a layout gone
        "nvidia.com/gpu.deploy.device-plugin": "false",  # the GPU Operator's
    }
    assert label_patch(current, WANTED, owned=OWN_KEY.match) == {
        "drasil.dev/gpu.count": "2",
        "drasil.dev/mig-1g.10gb.count": None,
    }
    current.pop("drasil.dev/mig-1g.10gb.count")
    assert label_patch({**current, **WANTED}, WANTED, owned=OWN_KEY.match) == {}


class _Api:
    def __init__(self, labels: dict[str, str] | None) -> None:
        self.labels = labels
        self.patches: list[dict[str, str | None]] = []

    def get_node_labels(self, name: str) -> dict[str, str] | None:
        return None if self.labels is None else dict(self.labels)

    def patch_node_labels(self, name: str, labels: dict[str, str | None]) -> bool:
        assert self.labels is not None
        self.patches.append(dict(labels))
        for key, value in labels.items():
            if value is None:
                self.labels.pop(key, None)
            else:
                self.labels[key] = value
        return True


def test_labels_are_patched_once_and_then_left_alone() -> None:
    api = _Api({"kubernetes.io/hostname": "n"})
    labeler = NodeLabels(api, node_name="n", wanted=WANTED, owned=OWN_KEY.match)  # type: ignore[arg-type]
    assert labeler.apply_once() == 2
    assert labeler.apply_once() == 0
    assert api.patches == [WANTED]
    del api.labels["drasil.dev/gpu.count"]  # someone removed one
    assert labeler.apply_once() == 1


def test_a_node_not_there_yet_is_an_error_to_retry() -> None:
    labeler = NodeLabels(_Api(None), node_name="n", wanted=WANTED, owned=OWN_KEY.match)  # type: ignore[arg-type]
    with pytest.raises(LookupError, match="Node n not found"):
        labeler.apply_once()


def test_with_nfd_the_labels_go_to_its_feature_file_and_the_node_is_left_alone(
    tmp_path: Path,
) -> None:
    api = _Api({})
    labeler = NodeLabels(api, node_name="n", wanted=WANTED, owned=OWN_KEY.match, nfd_dir=tmp_path)  # type: ignore[arg-type]
    assert labeler.apply_once() == 2
    lines = (tmp_path / NFD_FILE).read_text().splitlines()
    assert lines[1:] == ["drasil.dev/gpu.count=2", "drasil.dev/gpu.product=NVIDIA-L4"]
    assert lines[0].startswith("#")
    assert labeler.apply_once() == 0  # the same file: not written again
    assert api.patches == []
