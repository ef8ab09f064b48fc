"""The node labels of a node's GPUs (drasil.driver.nvidia.nodelabels): drasil's names,
GPU Feature Discovery's with gfd, valid label values, and the keys that are ours."""

from __future__ import annotations

from dataclasses import replace

import pytest

from drasil.driver.devices import Device
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.nvidia.nodelabels import OWN_KEY, label_value, node_labels
from drasil.driver.simulated.nvml import simulated_library


def _devices(profile: str, *, mig_mode: str = "static") -> list[Device]:
    lib = simulated_library(profile, node_name="n")
    return list(discover(lib, node_name="n", mig_mode=mig_mode).devices)


def test_whole_gpus_are_labelled_as_gfd_would() -> None:
    labels = node_labels(_devices("h100-80gb:8"), mig_mode="static", gpu_sharing="exclusive")
    assert labels["drasil.dev/gpu.present"] == "true"
    assert labels["drasil.dev/gpu.count"] == "8"
    assert labels["drasil.dev/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["drasil.dev/gpu.memory"] == "81920"  # MiB
    assert labels["drasil.dev/gpu.family"] == "hopper"
    assert (labels["drasil.dev/gpu.compute.major"], labels["drasil.dev/gpu.compute.minor"]) == (
        "9",
        "0",
    )
    assert labels["drasil.dev/mps.capable"] == "true"
    assert labels["drasil.dev/gpu.sharing-strategy"] == "none"
    assert labels["drasil.dev/mig.mode"] == "static"
    assert "drasil.dev/mig.capable" not in labels  # whole GPUs: not known to be
    assert {k.rsplit(".", 1)[-1] for k in labels if "cuda.driver" in k} == {"major", "minor", "rev"}
    assert not [k for k in labels if not k.startswith("drasil.dev/")]


def test_gfd_names_mirror_drasils_where_gfd_has_them() -> None:
    labels = node_labels(
        _devices("h100-80gb:2"), mig_mode="static", gpu_sharing="consumable", gfd=True
    )
    gfd = {k.removeprefix("nvidia.com/"): v for k, v in labels.items() if k.startswith("nvidia")}
    ours = {k.removeprefix("drasil.dev/"): v for k, v in labels.items() if k.startswith("drasil")}
    assert gfd == {k: v for k, v in ours.items() if k != "mig.mode"}
    assert gfd["gpu.sharing-strategy"] == "mps"


def test_static_mig_layouts_are_counted_by_profile_dynamic_ones_are_not() -> None:
    static = node_labels(_devices("a100-40gb-mig:2"), mig_mode="static", gpu_sharing="exclusive")
    counts = {k: v for k, v in static.items() if k.endswith(".count") and "mig-" in k}
    assert counts == {
        "drasil.dev/mig-1g.5gb.count": "4",
        "drasil.dev/mig-2g.10gb.count": "2",
        "drasil.dev/mig-3g.20gb.count": "2",
    }
    assert static["drasil.dev/mig.capable"] == "true"
    assert static["drasil.dev/gpu.count"] == "2"  # GPUs, not MIG devices
    assert "drasil.dev/gpu.memory" not in static  # no GPU is published whole
    dynamic = node_labels(
        _devices("h100-80gb:1", mig_mode="dynamic"), mig_mode="dynamic", gpu_sharing="exclusive"
    )
    assert dynamic["drasil.dev/mig.capable"] == "true"
    assert not [k for k in dynamic if k.endswith(".count") and "mig-" in k]


def test_a_node_without_nvidia_gpus_gets_no_labels() -> None:
    assert node_labels([], mig_mode="static", gpu_sharing="exclusive") == {}


def test_every_label_is_valid_and_every_key_is_ours() -> None:
    devices = _devices("l4:1,a100-40gb-mig:1")
    odd = replace(devices[0], attributes={**devices[0].attributes, "productName": " A/B (x) "})
    labels = node_labels([odd, *devices[1:]], mig_mode="static", gpu_sharing="exclusive", gfd=True)
    assert labels["drasil.dev/gpu.product"] == "A-B-x"  # the first GPU speaks for the node
    for key, value in labels.items():
        assert OWN_KEY.match(key), key
        assert value == label_value(value), (key, value)
        assert len(value) <= 63, (key, value)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
        ("  --weird__name!!  ", "weird__name"),
        ("x" * 80, "x" * 63),
        ("!!!", ""),
    ],
)
def test_label_values(text: str, value: str) -> None:
    assert label_value(text) == value


@pytest.mark.parametrize(
    "key",
    [
        "drasil.dev/mig-mode",
        "drasil.dev/dra",
        "nvidia.com/gpu.deploy.device-plugin",
        "nvidia.com/gpu",
    ],
)
def test_the_operators_labels_are_never_ours(key: str) -> None:
    assert not OWN_KEY.match(key)
