"""`nvidia-smi -L` in a claim's container lists exactly the claim's devices.

On real hardware NVML (and nvidia-smi, built on it) inside a container lists the GPUs
whose `/dev/nvidia<minor>` the container was given and the MIG devices whose two
capability nodes (`/dev/nvidia-caps/nvidia-cap<N>`) it was given. Here the node's plugin
runs for this module with `--backend nvml` over our C mock NVML (e2e.harness.mocknvml),
profile `h100-80gb:2,a100-40gb-mig:1` (two whole H100s, an A100 in MIG mode with its
static layout), and the real `nvidia-cdi-hook`. The driver root's `libnvidia-ml.so` is
the mock with the node's config embedded (`mocknvml.install_mock`) and its
`usr/bin/nvidia-smi` our C program (e2e/harness/driverroot/nvidia_smi.c); drasil's CDI
spec mounts both into the container, whose glibc image (`versions.PROBE_IMAGE`) runs
`nvidia-smi -L`. In the container the node's dev root is absent, so the mock looks at the
container's /dev: what it lists is decided by the device nodes the spec gave, as on a
GPU. Afterwards the plugin runs the node's simulated profile again.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from drasil.driver.simulated.gpus import simulated_gpus
from e2e.harness import mocknvml, versions
from e2e.harness.cluster.node import Node
from e2e.harness.driverroot import DEFAULT_VERSION, MULTIARCH_LIB_DIR
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.nvidiatoolkit import cdi_hook_path
from e2e.harness.pluginproc import DRIVER
from e2e.harness.pods import POD_TIMEOUT, template

PROFILE = "h100-80gb:2,a100-40gb-mig:1"
MIG_CLASS = f"mig-smi-e2e.{DRIVER}"
# The container runs nvidia-smi -L once and prints its output and exit code, prefixed.
COMMAND = (
    'out=$(nvidia-smi -L 2>&1); code=$?; echo "$out" | sed "s/^/SMI:/"; '
    'echo "SMI-EXIT:$code"; trap "exit 0" TERM; sleep 3600 & wait'
)


def _published(profile: str, node_name: str) -> int:
    """Devices static mode publishes: each GPU whole, or its MIG devices in MIG mode."""
    gpus = simulated_gpus(profile, node_name=node_name)
    return sum(len(g.migs) if g.model.mig_enabled else 1 for g in gpus)


@pytest.fixture(scope="module")
def smi_node(node: Node, kube: Kube) -> Iterator[Node]:
    plugin = node.plugin
    original = plugin.profile
    kube.delete(RESOURCE, "DeviceClass", MIG_CLASS)
    expression = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "mig"'
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "DeviceClass",
            "metadata": {"name": MIG_CLASS},
            "spec": {"selectors": [{"cel": {"expression": expression}}]},
        }
    )
    plugin.stop()
    shutil.rmtree(plugin.root / "nvml", ignore_errors=True)
    plugin.backend, plugin.profile, plugin._mock = "nvml", PROFILE, None
    mock = plugin.mock_root()
    library = mock.root / MULTIARCH_LIB_DIR.lstrip("/") / f"libnvidia-ml.so.{DEFAULT_VERSION}"
    mocknvml.install_mock(library, mock.node)
    try:
        node.restart_plugin_with(
            {"NVIDIA_CDI_HOOK_PATH": str(cdi_hook_path())},
            published=_published(PROFILE, node.name),
        )
        yield node
    finally:
        plugin.backend, plugin.profile, plugin._mock = "simulated", original, None
        node.restart_plugin_with(
            {"NVIDIA_CDI_HOOK_PATH": None}, published=_published(original, node.name)
        )
        shutil.rmtree(plugin.root / "nvml", ignore_errors=True)
        kube.delete(RESOURCE, "DeviceClass", MIG_CLASS)


def _smi_pod(kube: Kube, ns: str, node: Node, template_name: str) -> str:
    """A Pod of the probe image whose container has the claim and runs nvidia-smi -L."""
    name = f"smi-{secrets.token_hex(3)}"
    spec = {
        "nodeSelector": {"kubernetes.io/hostname": node.name},
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template_name}],
        "containers": [
            {
                "name": "c",
                "image": versions.PROBE_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", COMMAND],
                "resources": {"claims": [{"name": "gpu"}]},
            }
        ],
    }
    kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}, ns)
    return name


def _smi_output(kube: Kube, ns: str, name: str) -> str:
    """What nvidia-smi -L printed in the Pod's container; fails unless it exited 0."""

    def printed() -> Any:
        pod = kube.get("v1", "Pod", name, ns)
        if pod["status"].get("phase") not in ("Running", "Succeeded", "Failed"):
            return NotYet(pod["status"])
        log = kube.core.read_namespaced_pod_log(name, ns, container="c")
        return log if "SMI-EXIT:" in log else NotYet(log)

    log: str = wait_for(printed, timeout=POD_TIMEOUT, what=f"nvidia-smi -L in {ns}/{name}")
    lines = log.splitlines()
    assert "SMI-EXIT:0" in lines, log
    return "".join(line[len("SMI:") :] + "\n" for line in lines if line.startswith("SMI:"))


def _allocated(kube: Kube, ns: str, node: Node, pod: str) -> list[dict[str, Any]]:
    """The published attributes of the devices allocated to the Pod's claim "gpu"."""
    statuses = kube.get("v1", "Pod", pod, ns)["status"]["resourceClaimStatuses"]
    claim_name = next(s["resourceClaimName"] for s in statuses if s["name"] == "gpu")
    claim = kube.get(RESOURCE, "ResourceClaim", claim_name, ns)
    devices = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
    slices = kube.resource(RESOURCE, "ResourceSlice").get(
        field_selector=f"spec.nodeName={node.name},spec.driver={DRIVER}"
    )
    published = {
        d["name"]: {k: next(iter(v.values())) for k, v in d["attributes"].items()}
        for s in slices.items
        for d in s.to_dict()["spec"].get("devices") or []
    }
    return [published[d] for d in devices]


def _gpu_lines(gpus: list[dict[str, Any]]) -> str:
    """`nvidia-smi -L` of a container given these whole GPUs: indices from 0, by minor."""
    ordered = sorted(gpus, key=lambda g: int(g["minor"]))
    return "".join(
        f"GPU {i}: {g['productName']} (UUID: {g['uuid']})\n" for i, g in enumerate(ordered)
    )


def test_a_container_with_one_gpu_lists_that_gpu(kube: Kube, ns: str, smi_node: Node) -> None:
    name = _smi_pod(kube, ns, smi_node, template(kube, ns))
    output = _smi_output(kube, ns, name)
    (gpu,) = _allocated(kube, ns, smi_node, name)
    assert output == _gpu_lines([gpu])


def test_a_container_with_two_gpus_lists_both_and_nothing_else(
    kube: Kube, ns: str, smi_node: Node
) -> None:
    two = [{"name": "gpu", "exactly": {"deviceClassName": DRIVER, "count": 2}}]
    name = _smi_pod(kube, ns, smi_node, template(kube, ns, requests=two))
    output = _smi_output(kube, ns, name)
    gpus = _allocated(kube, ns, smi_node, name)
    assert len({g["uuid"] for g in gpus}) == 2
    assert output == _gpu_lines(gpus)


def test_a_mig_claims_container_lists_its_parent_and_its_mig_device_only(
    kube: Kube, ns: str, smi_node: Node
) -> None:
    """One of the A100's two 1g.5gb devices: the parent GPU's line and that device,
    numbered 0 as in a container; not its sibling nor the other MIG devices."""
    attributes = f'device.attributes["{DRIVER}"]'
    selector = f'{attributes}.profile == "1g.5gb"'
    request = {
        "name": "gpu",
        "exactly": {"deviceClassName": MIG_CLASS, "selectors": [{"cel": {"expression": selector}}]},
    }
    name = _smi_pod(kube, ns, smi_node, template(kube, ns, requests=[request]))
    output = _smi_output(kube, ns, name)
    (mig,) = _allocated(kube, ns, smi_node, name)
    assert output == (
        f"GPU 0: {mig['productName']} (UUID: {mig['parentUUID']})\n"
        f"  MIG 1g.5gb      Device  0: (UUID: {mig['uuid']})\n"
    )


def test_on_the_host_the_same_program_lists_every_device(smi_node: Node) -> None:
    """Not vacuous: the root's nvidia-smi over the same mock, on the node (its dev root,
    no caps folder: a host's view), lists all three GPUs and the A100's four MIG devices."""
    mock = smi_node.plugin.mock_root()
    done = subprocess.run(
        [str(mock.root / "usr/bin/nvidia-smi"), "-L"],
        env={
            "LD_LIBRARY_PATH": str(mock.root / MULTIARCH_LIB_DIR.lstrip("/")),
            **mock.node.env(),
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    gpus = simulated_gpus(PROFILE, node_name=smi_node.name)
    listed = done.stdout.splitlines()
    assert [line for line in listed if line.startswith("GPU ")] == [
        f"GPU {g.index}: {g.model.product_name} (UUID: {g.uuid})" for g in gpus
    ]
    assert sorted(line.rsplit("UUID: ", 1)[1][:-1] for line in listed if "MIG-" in line) == sorted(
        m.uuid for m in gpus[2].migs
    )
