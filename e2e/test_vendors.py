"""A third vendor on the real node, registered through the vendor seam alone.

`e2e/harness/thirdvendor/` is a package of a few dozen lines (Acme NPUs, simulated)
with an entry point in the group `drasil.vendors`; put on the node plugin's
`PYTHONPATH` and named in its simulated profile beside an H100, its NPUs are published
in the node's ResourceSlices and a Pod's claim of one is prepared: containerd gives
the container the NPU's device node and its variable, from the claim's CDI spec.
No line of drasil names the vendor (kubeletplugin.vendors.registry finds it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.harness.cluster.node import Node
from e2e.harness.kube import Kube, device_classes
from e2e.harness.pluginproc import DRIVER
from e2e.harness.pods import (
    cdi_spec,
    container_env,
    device_variable,
    pod,
    template,
    wait_running,
)
from e2e.test_amd import published
from e2e.test_node import pod_claim

THIRD_VENDOR = Path(__file__).parent / "harness" / "thirdvendor"
PROFILE = "h100-80gb:1,acme-npu:2"
NPU_CLASS = "npu.acme.example.com"
# The NPU's node by its numbers (hex, as stat prints them), then the env; then waits.
COMMAND = "stat -c \"DEV %n %t %T\" /dev/acme*; env | sort; trap 'exit 0' TERM; sleep 3600 & wait"


@pytest.fixture(scope="module")
def acme(kube: Kube, node: Node) -> Iterator[Node]:
    """The node's plugin serving one H100 and two Acme NPUs; its own profile after."""
    original = node.plugin.profile
    node.plugin.profile = PROFILE
    node.restart_plugin_with({"PYTHONPATH": str(THIRD_VENDOR)}, published=3, reset_gpus=True)
    selector = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "acme-npu"'
    try:
        with device_classes(kube, {NPU_CLASS: {"selectors": [{"cel": {"expression": selector}}]}}):
            yield node
    finally:
        node.plugin.profile = original
        node.restart_plugin_with({"PYTHONPATH": None}, published=8, reset_gpus=True)


def test_a_third_vendors_npu_is_published_and_prepared_for_a_pod(
    kube: Kube, ns: str, acme: Node
) -> None:
    devices = published(kube, acme)
    npus = {n: d["attributes"] for n, d in devices.items() if n.startswith("acme-")}
    assert sorted(npus) == ["acme-0", "acme-1"], sorted(devices)
    assert {a["type"] for a in npus.values()} == {"acme-npu"}
    assert devices["gpu-0"]["attributes"]["type"] == "gpu"  # drasil's own vendor beside it

    name = pod(
        kube, ns, acme, template_name=template(kube, ns, device_class=NPU_CLASS), command=COMMAND
    )
    wait_running(kube, ns, name)
    claim = pod_claim(kube, ns, name)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    device = result["device"]
    env = container_env(kube, ns, name)
    assert env[device_variable(device)] == npus[device]["uuid"]
    log = kube.core.read_namespaced_pod_log(name, ns, container="c")
    index = device.removeprefix("acme-")
    assert f"DEV /dev/acme{index} 1 3" in log.splitlines(), log
    spec = json.loads(cdi_spec(acme, claim["metadata"]["uid"]).read_text())
    nodes = [n for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes") or []]
    assert [(n["path"], n["major"], n["minor"]) for n in nodes] == [(f"/dev/acme{index}", 1, 3)]
    assert not [k for k in env if k.startswith("NVIDIA_")], env  # no NVIDIA edits in its spec
