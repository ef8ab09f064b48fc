"""`drasil migrate check --from nvidia-dra`'s judgement (drasil.driver.nvidia.nvidiadra)
over NVIDIA's own specs: kubernetes-sigs/dra-driver-nvidia-gpu's quickstart
(`demo/specs/quickstart/v1/gpu-test1..6`, `gpu-test-mps`, `gpu-test-vfiopci`), its
consumable-shares demos (memory, integer), its extended-resource examples, an IMEX
ComputeDomain with the channel template NVIDIA's controller makes for it, and hostile
objects that must get a verdict quickly instead of a crash."""

from __future__ import annotations

import io
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from drasil.driver import cli
from drasil.driver.discovery.backends import discover_node, open_backends
from drasil.driver.nvidia.migration import BLOCKED, CHANGE, UNCHANGED
from drasil.driver.nvidia.nvidiadra import (
    KINDS,
    MAX_CEL_CHARS,
    PUBLISHED_ATTRIBUTES,
    PUBLISHED_CAPACITY,
    PUBLISHED_STANDARD,
    STANDARD_DOMAIN,
    Result,
    check_all,
    nvidia_sharing,
    plan_from,
    report,
    scan_cel,
)

# --- NVIDIA's specs, as its README has them (Namespaces and images left out) -----------

GPU_TEST1 = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test1, name: single-gpu}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
---
apiVersion: v1
kind: Pod
metadata: {namespace: gpu-test1, name: pod1}
spec:
  containers:
  - name: ctr
    resources: {claims: [{name: gpu}]}
  resourceClaims:
  - name: gpu
    resourceClaimTemplateName: single-gpu
---
apiVersion: v1
kind: Pod
metadata: {namespace: gpu-test1, name: pod2}
spec:
  containers:
  - name: ctr
    resources: {claims: [{name: gpu}]}
  resourceClaims:
  - name: gpu
    resourceClaimTemplateName: single-gpu
"""

GPU_TEST2 = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test2, name: single-gpu}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
---
apiVersion: v1
kind: Pod
metadata: {namespace: gpu-test2, name: pod}
spec:
  containers:
  - name: ctr0
    resources: {claims: [{name: shared-gpu}]}
  - name: ctr1
    resources: {claims: [{name: shared-gpu}]}
  resourceClaims:
  - name: shared-gpu
    resourceClaimTemplateName: single-gpu
"""

GPU_TEST3 = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {namespace: gpu-test3, name: single-gpu}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.nvidia.com
---
apiVersion: v1
kind: Pod
metadata: {namespace: gpu-test3, name: pod1}
spec:
  containers:
  - name: ctr
    resources: {claims: [{name: shared-gpu}]}
  resourceClaims:
  - name: shared-gpu
    resourceClaimName: single-gpu
---
apiVersion: v1
kind: Pod
metadata: {namespace: gpu-test3, name: pod2}
spec:
  containers:
  - name: ctr
    resources: {claims: [{name: shared-gpu}]}
  resourceClaims:
  - name: shared-gpu
    resourceClaimName: single-gpu
"""

GPU_TEST4 = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test4, name: mig-devices}
spec:
  spec:
    devices:
      requests:
      - name: mig-1g-5gb-0
        exactly:
          deviceClassName: mig.nvidia.com
          selectors:
          - cel:
              expression: "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"
      - name: mig-1g-5gb-1
        exactly:
          deviceClassName: mig.nvidia.com
          selectors:
          - cel:
              expression: "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"
      - name: mig-2g-10gb
        exactly:
          deviceClassName: mig.nvidia.com
          selectors:
          - cel:
              expression: "device.attributes['gpu.nvidia.com'].profile == '2g.10gb'"
      - name: mig-3g-20gb
        exactly:
          deviceClassName: mig.nvidia.com
          selectors:
          - cel:
              expression: "device.attributes['gpu.nvidia.com'].profile == '3g.20gb'"
      constraints:
      - requests: []
        matchAttribute: "gpu.nvidia.com/parentUUID"
---
apiVersion: apps/v1
kind: Deployment
metadata: {namespace: gpu-test4, name: pod}
spec:
  replicas: 4
  selector: {matchLabels: {app: pod}}
  template:
    metadata: {labels: {app: pod}}
    spec:
      resourceClaims:
      - name: mig-devices
        resourceClaimTemplateName: mig-devices
      containers:
      - name: ctr0
        resources: {claims: [{name: mig-devices, request: mig-1g-5gb-0}]}
      - name: ctr1
        resources: {claims: [{name: mig-devices, request: mig-1g-5gb-1}]}
      - name: ctr2
        resources: {claims: [{name: mig-devices, request: mig-2g-10gb}]}
      - name: ctr3
        resources: {claims: [{name: mig-devices, request: mig-3g-20gb}]}
"""

GPU_TEST5 = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test5, name: multiple-gpus}
spec:
  spec:
    devices:
      requests:
      - name: ts-gpu
        exactly:
          deviceClassName: gpu.nvidia.com
      - name: mps-gpu
        exactly:
          deviceClassName: gpu.nvidia.com
      config:
      - requests: ["ts-gpu"]
        opaque:
          driver: gpu.nvidia.com
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: GpuConfig
            sharing:
              strategy: TimeSlicing
              timeSlicingConfig:
                interval: Long
      - requests: ["mps-gpu"]
        opaque:
          driver: gpu.nvidia.com
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: GpuConfig
            sharing:
              strategy: MPS
              mpsConfig:
                defaultActiveThreadPercentage: 50
                defaultPinnedDeviceMemoryLimit: 10Gi
---
apiVersion: v1
kind: Pod
metadata: {namespace: gpu-test5, name: pod0}
spec:
  containers:
  - name: ts-ctr0
    resources: {claims: [{name: shared-gpus, request: ts-gpu}]}
  - name: ts-ctr1
    resources: {claims: [{name: shared-gpus, request: ts-gpu}]}
  - name: mps-ctr0
    resources: {claims: [{name: shared-gpus, request: mps-gpu}]}
  - name: mps-ctr1
    resources: {claims: [{name: shared-gpus, request: mps-gpu}]}
  resourceClaims:
  - name: shared-gpus
    resourceClaimTemplateName: multiple-gpus
"""

GPU_TEST6 = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test6, name: a100}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
          selectors:
          - cel:
              expression: |
                device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$')
                &&
                (device.attributes['gpu.nvidia.com'].index == 0 ||
                device.attributes['gpu.nvidia.com'].index == 2 ||
                device.attributes['gpu.nvidia.com'].index == 4 ||
                device.attributes['gpu.nvidia.com'].index == 6)
      config:
      - requests: ["gpu"]
        opaque:
          driver: gpu.nvidia.com
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: GpuConfig
            sharing:
              strategy: TimeSlicing
              timeSlicingConfig:
                interval: Long
---
apiVersion: apps/v1
kind: Deployment
metadata: {namespace: gpu-test6, name: pod}
spec:
  replicas: 4
  selector: {matchLabels: {app: pod}}
  template:
    metadata: {labels: {app: pod}}
    spec:
      containers:
      - name: ctr
        resources: {claims: [{name: a100}]}
      resourceClaims:
      - name: a100
        resourceClaimTemplateName: a100
"""

GPU_TEST_MPS = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test-mps, name: shared-gpu}
spec:
  spec:
    devices:
      requests:
      - name: mps-gpu
        exactly:
          deviceClassName: gpu.nvidia.com
      config:
      - requests: ["mps-gpu"]
        opaque:
          driver: gpu.nvidia.com
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: GpuConfig
            sharing:
              strategy: MPS
              mpsConfig:
                defaultActiveThreadPercentage: 50
                defaultPinnedDeviceMemoryLimit: 10Gi
---
apiVersion: v1
kind: Pod
metadata: {namespace: gpu-test-mps, name: test-pod}
spec:
  containers:
  - name: mps-ctr0
    resources: {claims: [{name: shared-gpu, request: mps-gpu}]}
  - name: mps-ctr1
    resources: {claims: [{name: shared-gpu, request: mps-gpu}]}
  resourceClaims:
  - name: shared-gpu
    resourceClaimTemplateName: shared-gpu
"""

MEMORY_SHARING = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-share-memory, name: gpu-4gi}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
          capacity:
            requests:
              memory: 4Gi
---
apiVersion: apps/v1
kind: Deployment
metadata: {namespace: gpu-share-memory, name: memory-sharing}
spec:
  replicas: 2
  selector: {matchLabels: {app: memory-sharing}}
  template:
    metadata: {labels: {app: memory-sharing}}
    spec:
      resourceClaims:
      - name: gpu
        resourceClaimTemplateName: gpu-4gi
      containers:
      - name: ctr
        resources: {claims: [{name: gpu}]}
"""

# tests/bats/specs/gpu-consumable-shares-integer.yaml: one share asked explicitly.
INTEGER_SHARING = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-share-integer, name: rct-share-integer-gpu}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
          capacity:
            requests:
              shares: 1
---
apiVersion: v1
kind: Pod
metadata: {namespace: gpu-share-integer, name: pod-share-integer-0}
spec:
  containers:
  - name: ctr
    resources: {claims: [{name: gpu}]}
  resourceClaims:
  - name: gpu
    resourceClaimTemplateName: rct-share-integer-gpu
"""

# demo/specs/consumable-shares/integer-sharing.yaml: the default share, asked by nothing.
INTEGER_DEMO = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-share-integer, name: gpu-1share}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
---
apiVersion: apps/v1
kind: Deployment
metadata: {namespace: gpu-share-integer, name: integer-sharing}
spec:
  replicas: 4
  selector: {matchLabels: {app: integer-sharing}}
  template:
    metadata: {labels: {app: integer-sharing}}
    spec:
      resourceClaims:
      - name: gpu
        resourceClaimTemplateName: gpu-1share
      containers:
      - name: ctr
        resources: {claims: [{name: gpu}]}
"""

# A ResourceSlice of NVIDIA's driver run with --consumable-shares=4.
INTEGER_SLICE = """
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {name: node-a-gpu.nvidia.com-x}
spec:
  driver: gpu.nvidia.com
  nodeName: node-a
  pool: {name: node-a, generation: 1, resourceSliceCount: 1}
  devices:
  - name: gpu-0
    allowMultipleAllocations: true
    attributes: {type: {string: gpu}}
    capacity:
      memory:
        value: 40Gi
        requestPolicy: {default: "0", validRange: {min: "0", max: 40Gi, step: 1Mi}}
      shares:
        value: "4"
        requestPolicy: {default: "1", validRange: {min: "1", max: "4", step: "1"}}
"""

EXTENDED_RESOURCES = """
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: mig-1g-12gb.gpu.nvidia.com}
spec:
  selectors:
  - cel:
      expression: >-
        device.driver == 'gpu.nvidia.com' &&
        device.attributes['gpu.nvidia.com'].type == 'mig' &&
        device.attributes['gpu.nvidia.com'].profile == '1g.12gb'
  extendedResourceName: nvidia.com/mig-1g.12gb
---
apiVersion: v1
kind: Pod
metadata: {namespace: extended-resources, name: gpu-full}
spec:
  containers:
  - name: ctr
    resources:
      limits: {nvidia.com/gpu: 1}
---
apiVersion: v1
kind: Pod
metadata: {namespace: extended-resources, name: mig-1g-12gb}
spec:
  containers:
  - name: ctr
    resources:
      limits: {nvidia.com/mig-1g.12gb: 1}
---
apiVersion: v1
kind: Pod
metadata: {namespace: extended-resources, name: mig-2g-24gb}
spec:
  containers:
  - name: ctr
    resources:
      limits: {nvidia.com/mig-2g.24gb: 1}
---
apiVersion: v1
kind: Pod
metadata: {namespace: extended-resources, name: mig-1g-12gb-me}
spec:
  containers:
  - name: ctr
    resources:
      limits: {nvidia.com/mig-1g.12gb.me: 1}
"""

# A ComputeDomain, the channel template NVIDIA's controller makes for it, and a Pod.
IMEX = """
apiVersion: resource.nvidia.com/v1beta1
kind: ComputeDomain
metadata: {namespace: imex-test, name: imex-channel-injection}
spec:
  numNodes: 1
  channel:
    resourceClaimTemplate:
      name: imex-channel-0
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: imex-test, name: imex-channel-0}
spec:
  spec:
    devices:
      requests:
      - name: channel
        exactly:
          deviceClassName: compute-domain-default-channel.nvidia.com
      config:
      - requests: ["channel"]
        opaque:
          driver: compute-domain.nvidia.com
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: ComputeDomainChannelConfig
            domainID: 2b5a3e3a-1f39-4e0e-8d7c-3c8f5c1a1e42
---
apiVersion: v1
kind: Pod
metadata: {namespace: imex-test, name: imex-channel-injection}
spec:
  containers:
  - name: ctr
    resources: {claims: [{name: imex-channel-0}]}
  resourceClaims:
  - name: imex-channel-0
    resourceClaimTemplateName: imex-channel-0
"""

VFIO = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test-vfio, name: single-gpu}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: vfio.gpu.nvidia.com
---
apiVersion: v1
kind: Pod
metadata: {namespace: gpu-test-vfio, name: pod1}
spec:
  containers:
  - name: ctr
    resources: {claims: [{name: gpu}]}
  resourceClaims:
  - name: gpu
    resourceClaimTemplateName: single-gpu
"""

CONSUMABLE = {"compatibility": "nvidia-dra", "gpuSharing": "consumable"}


def judge(
    *specs: str, values: Mapping[str, Any] | None = None, slices: str = ""
) -> dict[str, tuple[str, str]]:
    """ref -> (verdict, reasons joined) for every object and workload judged."""
    return _table(_result(*specs, values=values, slices=slices))


def _result(*specs: str, values: Mapping[str, Any] | None = None, slices: str = "") -> Result:
    documents = [d for spec in specs for d in yaml.safe_load_all(spec) if d]
    of = {kind: [d for d in documents if d["kind"] == kind] for kind in _KINDS}
    plan = plan_from(values or {}, of["DeviceClass"], list(yaml.safe_load_all(slices)))
    return check_all(
        plan=plan,
        claims=of["ResourceClaim"],
        templates=of["ResourceClaimTemplate"],
        compute_domains=of["ComputeDomain"],
        pods=of["Pod"],
        controllers={kind: of[kind] for kind in KINDS},
    )


_KINDS = ("DeviceClass", "ResourceClaim", "ResourceClaimTemplate", "ComputeDomain", "Pod", *KINDS)


def _table(result: Result) -> dict[str, tuple[str, str]]:
    return {f.ref: (f.verdict, "; ".join(f.reasons)) for f in (*result.objects, *result.workloads)}


# --- the quickstart ---------------------------------------------------------------------

QUICKSTART = [
    pytest.param(
        GPU_TEST1,
        {
            "ResourceClaimTemplate gpu-test1/single-gpu": UNCHANGED,
            "Pod gpu-test1/pod1": UNCHANGED,
            "Pod gpu-test1/pod2": UNCHANGED,
        },
        id="gpu-test1",
    ),
    pytest.param(
        GPU_TEST2,
        {"ResourceClaimTemplate gpu-test2/single-gpu": UNCHANGED, "Pod gpu-test2/pod": UNCHANGED},
        id="gpu-test2",
    ),
    pytest.param(
        GPU_TEST3,
        {
            "ResourceClaim gpu-test3/single-gpu": UNCHANGED,
            "Pod gpu-test3/pod1": UNCHANGED,
            "Pod gpu-test3/pod2": UNCHANGED,
        },
        id="gpu-test3",
    ),
    pytest.param(
        GPU_TEST4,
        {
            "ResourceClaimTemplate gpu-test4/mig-devices": UNCHANGED,
            "Deployment gpu-test4/pod": UNCHANGED,
        },
        id="gpu-test4",
    ),
    pytest.param(
        GPU_TEST5,
        {
            "ResourceClaimTemplate gpu-test5/multiple-gpus": UNCHANGED,
            "Pod gpu-test5/pod0": UNCHANGED,
        },
        id="gpu-test5",
    ),
    pytest.param(
        GPU_TEST6,
        {"ResourceClaimTemplate gpu-test6/a100": UNCHANGED, "Deployment gpu-test6/pod": UNCHANGED},
        id="gpu-test6",
    ),
    pytest.param(
        GPU_TEST_MPS,
        {
            "ResourceClaimTemplate gpu-test-mps/shared-gpu": UNCHANGED,
            "Pod gpu-test-mps/test-pod": UNCHANGED,
        },
        id="gpu-test-mps",
    ),
]


@pytest.mark.parametrize(("spec", "expected"), QUICKSTART)
def test_the_quickstart_runs_unchanged(spec: str, expected: dict[str, str]) -> None:
    found = judge(spec)
    assert {ref: verdict for ref, (verdict, _) in found.items()} == expected
    assert all(why == "" for _, why in found.values()), found


# --- what needs a change, what cannot move ----------------------------------------------


@pytest.mark.parametrize(
    ("spec", "values", "slices", "expected"),
    [
        pytest.param(
            MEMORY_SHARING, {"compatibility": "nvidia-dra"}, "",
            {
                "ResourceClaimTemplate gpu-share-memory/gpu-4gi":
                    (CHANGE, "request gpu asks capacity memory (a share of a GPU): set the chart "
                             "value gpuSharing: consumable"),
                "Deployment gpu-share-memory/memory-sharing":
                    (CHANGE, "ResourceClaimTemplate gpu-4gi: request gpu asks capacity memory"),
            },
            id="consumable-shares-memory-exclusive-values",
        ),
        pytest.param(
            MEMORY_SHARING, CONSUMABLE, "",
            {
                "ResourceClaimTemplate gpu-share-memory/gpu-4gi": (UNCHANGED, ""),
                "Deployment gpu-share-memory/memory-sharing": (UNCHANGED, ""),
            },
            id="consumable-shares-memory-consumable-values",
        ),
        pytest.param(
            INTEGER_SHARING, CONSUMABLE, "",
            {
                "ResourceClaimTemplate gpu-share-integer/rct-share-integer-gpu":
                    (BLOCKED, "request gpu asks capacity shares: NVIDIA's integer "
                              "consumable-shares mode (capacity shares) has no drasil "
                              "counterpart: drasil shares by memory and compute"),
                "Pod gpu-share-integer/pod-share-integer-0":
                    (BLOCKED, "ResourceClaimTemplate rct-share-integer-gpu: request gpu asks "
                              "capacity shares"),
            },
            id="consumable-shares-integer-explicit",
        ),
        pytest.param(
            INTEGER_DEMO, CONSUMABLE, INTEGER_SLICE,
            {
                "ResourceClaimTemplate gpu-share-integer/gpu-1share":
                    (CHANGE, "request gpu took one of the N shares of a GPU "
                             "(--consumable-shares=N) on NVIDIA's driver, and gets the whole "
                             "device on drasil: ask capacity.requests.memory"),
                "Deployment gpu-share-integer/integer-sharing":
                    (CHANGE, "ResourceClaimTemplate gpu-1share: request gpu took one of the N"),
            },
            id="consumable-shares-integer-default-share",
        ),
        pytest.param(
            EXTENDED_RESOURCES, {}, "",
            {
                "DeviceClass mig-1g-12gb.gpu.nvidia.com": (UNCHANGED, ""),
                "Pod extended-resources/gpu-full": (UNCHANGED, ""),
                "Pod extended-resources/mig-1g-12gb": (UNCHANGED, ""),
                "Pod extended-resources/mig-2g-24gb":
                    (CHANGE, "asks for nvidia.com/mig-2g.24gb, which no DeviceClass stands for: "
                             "create one that selects mig devices of profile 2g.24gb with "
                             "extendedResourceName nvidia.com/mig-2g.24gb"),
                "Pod extended-resources/mig-1g-12gb-me":
                    (CHANGE, "selects mig devices of profile 1g.12gb+me with extendedResourceName "
                             "nvidia.com/mig-1g.12gb.me"),
            },
            id="extended-resources",
        ),
        pytest.param(
            IMEX, {}, "",
            {
                "ComputeDomain imex-test/imex-channel-injection":
                    (BLOCKED, "ComputeDomains (IMEX channels across a multi-node NVLink domain)"),
                "ResourceClaimTemplate imex-test/imex-channel-0":
                    (BLOCKED, "config for channel (ComputeDomainChannelConfig), request channel "
                              "asks for compute-domain-default-channel.nvidia.com: ComputeDomains"),
                "Pod imex-test/imex-channel-injection":
                    (BLOCKED, "ResourceClaimTemplate imex-channel-0: config for channel "
                              "(ComputeDomainChannelConfig), request channel asks for "
                              "compute-domain-default-channel.nvidia.com: ComputeDomains"),
            },
            id="imex-compute-domain",
        ),
        pytest.param(
            VFIO, {}, "",
            {
                "ResourceClaimTemplate gpu-test-vfio/single-gpu":
                    (CHANGE, "request gpu asks for vfio.gpu.nvidia.com: GPUs for virtual "
                             "machines are published with the chart value passthrough.enabled"),
                "Pod gpu-test-vfio/pod1":
                    (CHANGE, "ResourceClaimTemplate single-gpu: request gpu asks for "
                             "vfio.gpu.nvidia.com: GPUs for virtual machines"),
            },
            id="vfio",
        ),
        pytest.param(
            VFIO, {"compatibility": "nvidia-dra", "passthrough": {"enabled": True}}, "",
            {
                "ResourceClaimTemplate gpu-test-vfio/single-gpu": (UNCHANGED, ""),
                "Pod gpu-test-vfio/pod1": (UNCHANGED, ""),
            },
            id="vfio-with-passthrough",
        ),
    ],
)  # fmt: skip
def test_nvidias_other_specs(
    spec: str, values: dict[str, Any], slices: str, expected: dict[str, tuple[str, str]]
) -> None:
    found = judge(spec, values=values, slices=slices)
    assert {ref: verdict for ref, (verdict, _) in found.items()} == {
        ref: verdict for ref, (verdict, _) in expected.items()
    }, found
    for ref, (_, why) in expected.items():
        assert why in found[ref][1], (ref, found[ref])


def _template(
    requests: list[dict[str, Any]], *, config: list[dict[str, Any]] | None = None, **devices: Any
) -> str:
    spec = {"devices": {"requests": requests, **devices, **({"config": config} if config else {})}}
    return yaml.safe_dump(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"namespace": "ns", "name": "t"},
            "spec": {"spec": spec},
        }
    )


def _gpu(name: str = "gpu", **exactly: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": "gpu.nvidia.com", **exactly}}


def _config(requests: list[str], kind: str = "GpuConfig", **parameters: Any) -> dict[str, Any]:
    body = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": kind, **parameters}
    return {"requests": requests, "opaque": {"driver": "gpu.nvidia.com", "parameters": body}}


MPS: dict[str, Any] = {"sharing": {"strategy": "MPS"}}


@pytest.mark.parametrize(
    ("template", "verdict", "why"),
    [
        pytest.param(
            _template([_gpu(count=2)], config=[_config(["gpu"], **MPS)]), CHANGE,
            "one MPS device per claim: gpu (2)", id="mps-on-two-gpus-by-count",
        ),
        pytest.param(
            _template([_gpu(allocationMode="All")], config=[_config([], **MPS)]), CHANGE,
            "one MPS device per claim: gpu (all)", id="mps-on-all-gpus",
        ),
        pytest.param(
            _template([_gpu("a"), _gpu("b")], config=[_config([], **MPS)]), CHANGE,
            "one MPS device per claim: a (1), b (1)", id="mps-on-two-requests",
        ),
        pytest.param(
            _template([_gpu("a"), _gpu("b")], config=[_config(["a"], **MPS)]), UNCHANGED,
            "", id="mps-on-one-of-two-requests",
        ),
        pytest.param(
            _template([_gpu(adminAccess=True)], config=[_config(["gpu"], **MPS)]), CHANGE,
            "request gpu: MPS on an adminAccess request", id="mps-admin-access",
        ),
        pytest.param(
            _template(
                [_gpu(count=2)],
                config=[_config(["gpu"], **MPS), _config(["gpu"], sharing={
                    "strategy": "TimeSlicing"})],
            ),
            UNCHANGED, "", id="the-last-config-wins",
        ),
        pytest.param(
            _template([_gpu()], config=[_config(["gpu"], sharing={"strategy": "Sometimes"})]),
            CHANGE, "config for gpu: sharing.strategy: unsupported value \"Sometimes\"",
            id="a-config-drasil-refuses",
        ),
        pytest.param(
            _template([{"name": "gpu", "exactly": {"deviceClassName": "vfio.gpu.nvidia.com"}}],
                      config=[_config(["gpu"], kind="VfioDeviceConfig", iommu={
                          "backendPolicy": "LegacyOnly", "enableAPIDevice": True})]),
            CHANGE, "request gpu asks for vfio.gpu.nvidia.com: GPUs for virtual machines",
            id="vfio-config",
        ),
        pytest.param(
            _template([{"name": "gpu", "exactly": {"deviceClassName": "mig.nvidia.com"}}],
                      config=[_config(["gpu"], kind="MigDeviceConfig", **MPS)]),
            UNCHANGED, "", id="mig-device-mps",
        ),
        pytest.param(
            _template([_gpu(selectors=[{"cel": {"expression":
                "device.attributes[\"gpu.nvidia.com\"].addressingMode == 'HMM'"}}])]),
            UNCHANGED, "", id="addressing-mode",
        ),
        pytest.param(
            _template([_gpu(selectors=[{"cel": {"expression":
                "device.capacity['gpu.nvidia.com'].memorySlice0 == 1"}}])]),
            CHANGE, "capacity gpu.nvidia.com/memorySlice0, which drasil does not publish",
            id="memory-slice-capacity",
        ),
        pytest.param(
            _template([_gpu(selectors=[{"cel": {"expression":
                "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0 && "
                "device.attributes['resource.kubernetes.io'].pcieRoot == 'pci0000:00' && "
                "device.attributes['gpu.nvidia.com'].cudaComputeCapability"
                ".isGreaterThan(semver('8.0.0'))"}}])]),
            UNCHANGED, "", id="published-capacity-and-attributes",
        ),
        pytest.param(
            _template([_gpu(selectors=[{"cel": {"expression":
                "device.attributes['resource.kubernetes.io'].pcieGeneration == 5"}}])]),
            CHANGE, "attribute resource.kubernetes.io/pcieGeneration", id="standard-attribute",
        ),
        pytest.param(
            _template([_gpu("a"), _gpu("b")],
                      constraints=[{"requests": [], "matchAttribute": "gpu.nvidia.com/clique"}]),
            CHANGE, "constraint matchAttribute gpu.nvidia.com/clique: drasil does not publish it",
            id="match-attribute-unknown",
        ),
        pytest.param(
            _template([_gpu("a"), _gpu("b")], constraints=[
                {"requests": [], "matchAttribute": "resource.kubernetes.io/pcieRoot"}]),
            UNCHANGED, "", id="match-attribute-pcie-root",
        ),
        pytest.param(
            _template([{"name": "gpu", "firstAvailable": [
                {"name": "big", "deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {
                    "expression": "device.attributes['gpu.nvidia.com'].gpuModuleId == 1"}}]},
                {"name": "small", "deviceClassName": "mig.nvidia.com"}]}]),
            CHANGE, "request gpu/big selects on attribute gpu.nvidia.com/gpuModuleId",
            id="first-available",
        ),
        pytest.param(
            _template([{"name": "gpu", "exactly": {"deviceClassName": "nvswitch.nvidia.com"}}]),
            CHANGE, "asks for DeviceClass nvswitch.nvidia.com, which drasil does not offer",
            id="unknown-nvidia-class",
        ),
        pytest.param(
            _template([_gpu(capacity={"requests": {"memory": "4500Mi"}})]), UNCHANGED,
            "memory is rounded up to whole Gi", id="memory-not-in-whole-gi",
        ),
        pytest.param(
            _template([_gpu(capacity={"requests": {"multiprocessors": "8"}})]), CHANGE,
            "asks capacity multiprocessors, which drasil does not share", id="other-capacity",
        ),
    ],
)  # fmt: skip
def test_claim_details(template: str, verdict: str, why: str) -> None:
    found = judge(template, values=CONSUMABLE)["ResourceClaimTemplate ns/t"]
    assert found[0] == verdict, found
    assert why in found[1], found


def test_a_class_of_the_users_is_judged_and_its_claims_with_it() -> None:
    classes = """
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: nvl4-gpus}
spec:
  selectors:
  - cel:
      expression: "device.attributes['gpu.nvidia.com'].partition4 == 1"
  config:
  - opaque:
      driver: gpu.nvidia.com
      parameters: {apiVersion: resource.nvidia.com/v1beta1, kind: GpuConfig,
                   sharing: {strategy: MPS}}
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: fpga.example.com}
spec:
  selectors: [{cel: {expression: "device.driver == 'fpga.example.com'"}}]
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu.nvidia.com}
spec:
  selectors: [{cel: {expression: "device.driver == 'gpu.nvidia.com'"}}]
"""
    claims = _template([{"name": "gpu", "exactly": {"deviceClassName": "nvl4-gpus", "count": 2}}])
    fpga = _template([{"name": "f", "exactly": {"deviceClassName": "fpga.example.com"}}])
    found = judge(classes, claims, fpga.replace("name: t", "name: fpga"))
    assert set(found) == {"DeviceClass nvl4-gpus", "ResourceClaimTemplate ns/t"}, found
    assert found["DeviceClass nvl4-gpus"][0] == CHANGE
    verdict, why = found["ResourceClaimTemplate ns/t"]
    assert verdict == CHANGE
    assert "request gpu: DeviceClass nvl4-gpus: a selector selects on attribute" in why
    assert "one MPS device per claim: gpu (2)" in why  # the class's config counts


def test_claims_made_for_pods_are_judged_through_their_template() -> None:
    generated = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  namespace: gpu-test1
  name: pod1-gpu-x7k2p
  annotations: {resource.kubernetes.io/pod-claim-name: gpu}
  ownerReferences: [{apiVersion: v1, kind: Pod, name: pod1, uid: u, controller: true}]
spec:
  devices:
    requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}]
"""
    owned = """
apiVersion: v1
kind: Pod
metadata:
  namespace: gpu-test4
  name: pod-5d8f-abcde
  ownerReferences: [{apiVersion: apps/v1, kind: ReplicaSet, name: pod-5d8f, controller: true}]
spec:
  resourceClaims: [{name: mig-devices, resourceClaimTemplateName: mig-devices}]
"""
    found = judge(GPU_TEST1, generated, GPU_TEST4, owned)
    assert not [ref for ref in found if "x7k2p" in ref or "abcde" in ref], found
    assert "Deployment gpu-test4/pod" in found


def test_a_workload_whose_template_is_missing_is_not_judged_unchanged() -> None:
    pod = """
apiVersion: v1
kind: Pod
metadata: {namespace: a, name: p}
spec:
  resourceClaims: [{name: gpu, resourceClaimTemplateName: gone}]
"""
    assert judge(pod) == {
        "Pod a/p": (CHANGE, "uses ResourceClaimTemplate gone, which was not found: not judged")
    }


def test_workloads_without_nvidia_devices_are_left_out() -> None:
    other = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: a, name: nic}
spec:
  spec:
    devices:
      requests: [{name: nic, exactly: {deviceClassName: sriov.example.com}}]
---
apiVersion: v1
kind: Pod
metadata: {namespace: a, name: p}
spec:
  containers: [{name: c, resources: {limits: {cpu: "1"}}}]
  resourceClaims: [{name: nic, resourceClaimTemplateName: nic}]
"""
    assert judge(other) == {}


def test_nvidias_sharing_mode_is_read_from_its_slices() -> None:
    integer = list(yaml.safe_load_all(INTEGER_SLICE))
    assert nvidia_sharing(integer) == "integer"
    device = integer[0]["spec"]["devices"][0]
    del device["capacity"]["shares"]
    assert nvidia_sharing(integer) == "unlimited"
    device["capacity"]["memory"]["requestPolicy"]["default"] = "40Gi"
    assert nvidia_sharing(integer) == "memory"
    device["allowMultipleAllocations"] = False
    assert nvidia_sharing(integer) is None
    integer[0]["spec"]["driver"] = "gpu.drasil.dev"
    device["allowMultipleAllocations"] = True
    assert nvidia_sharing(integer) is None
    junk: Any = ["junk", {"spec": "junk"}, {"spec": {"driver": "gpu.nvidia.com", "devices": [1]}}]
    assert nvidia_sharing(junk) is None


# --- hostile input ----------------------------------------------------------------------


def _deep(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


def test_hostile_objects_get_a_verdict_quickly() -> None:
    huge = "device.attributes['gpu.nvidia.com']." + "a" * 1_000_000
    spaces = "device.attributes[" + " " * (MAX_CEL_CHARS - 20)
    quotes = "device.attributes['" * (MAX_CEL_CHARS // 20)
    many = {f"c{j}": "1" for j in range(1000)}  # one mapping, reached 10,000 times
    junk: Any = "junk"
    templates: list[Any] = [
        {
            "metadata": {"namespace": "h", "name": "huge"},
            "spec": {
                "spec": {"devices": {"requests": [_gpu(selectors=[{"cel": {"expression": huge}}])]}}
            },
        },
        {
            "metadata": {"namespace": "h", "name": "spaces"},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            _gpu(selectors=[{"cel": {"expression": e}} for e in (spaces, quotes)])
                        ]
                    }
                }
            },
        },
        {
            "metadata": {"namespace": "h", "name": "deep"},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [_gpu()],
                        "config": [
                            {
                                "opaque": {
                                    "driver": "gpu.nvidia.com",
                                    "parameters": {
                                        "apiVersion": "resource.nvidia.com/v1beta1",
                                        "kind": "GpuConfig",
                                        "sharing": _deep(100_000),
                                    },
                                }
                            }
                        ],
                    }
                }
            },
        },
        {
            "metadata": {"namespace": "h", "name": "wide"},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            _gpu(f"r{i}", capacity={"requests": many}) for i in range(10_000)
                        ],
                        "constraints": [{"matchAttribute": "gpu.nvidia.com/" + "x" * 100_000}]
                        * 10_000,
                    }
                }
            },
        },
        {"metadata": ["junk"], "spec": {"spec": {"devices": {"requests": "junk"}}}},
        {
            "metadata": {"namespace": "h", "name": "types"},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": 5,
                                "exactly": {
                                    "deviceClassName": ["gpu.nvidia.com"],
                                    "selectors": [{"cel": {"expression": 7}}],
                                    "count": "many",
                                    "capacity": "lots",
                                },
                            },
                            {
                                "name": "x",
                                "exactly": {
                                    "deviceClassName": "gpu.nvidia.com",
                                    "capacity": {"requests": {"memory": "9" * 5000}},
                                    "selectors": "junk",
                                },
                            },
                        ],
                        "config": [
                            {
                                "requests": "gpu",
                                "opaque": {"driver": "gpu.nvidia.com", "parameters": "junk"},
                            },
                            3,
                        ],
                    }
                }
            },
        },
        "junk",
    ]
    pods: list[Any] = [
        {
            "metadata": {"namespace": "h", "name": "p"},
            "spec": {
                "resourceClaims": [
                    {"name": "x", "resourceClaimTemplateName": n}
                    for n in ("huge", "spaces", "deep", "wide", "types")
                ],
                "containers": [{"resources": {"limits": {"nvidia.com/" + "g" * 100_000: 1}}}],
            },
        },
        {"metadata": None, "spec": {"resourceClaims": _deep(100_000)}},
        {"metadata": {"ownerReferences": "junk"}, "spec": []},
    ]
    classes: list[Any] = [
        {"metadata": {"name": "c"}, "spec": {"selectors": _deep(100_000)}},
        None,
        5,
    ]
    start = time.monotonic()
    result = check_all(
        plan=plan_from({}, classes, [{"spec": _deep(100_000)}]),
        templates=templates,
        pods=pods,
        controllers={"Job": [{"spec": {"template": "junk"}}, junk]},
    )
    text = report(result)
    assert time.monotonic() - start < 5.0
    found = _table(result)
    assert found["ResourceClaimTemplate h/huge"][0] == CHANGE
    assert f"a CEL selector of {len(huge)} characters" in found["ResourceClaimTemplate h/huge"][1]
    assert found["ResourceClaimTemplate h/spaces"][0] == UNCHANGED
    assert found["ResourceClaimTemplate h/deep"][0] == CHANGE
    assert "nested too deeply" in found["ResourceClaimTemplate h/deep"][1]
    assert found["ResourceClaimTemplate h/wide"][0] == CHANGE
    assert found["ResourceClaimTemplate h/types"][0] == CHANGE
    assert found["Pod h/p"][0] == BLOCKED
    assert len(text) < 64 * 1024, len(text)  # names and lists are cut short


def test_the_scan_is_linear_in_the_expression() -> None:
    for filler in ("device.attributes['gpu.nvidia.com'].", "device . ", "'\"[]", " "):
        expression = (filler * (MAX_CEL_CHARS // len(filler)))[:MAX_CEL_CHARS]
        start = time.monotonic()
        scan_cel(expression)
        assert time.monotonic() - start < 0.5, filler
    found = scan_cel(
        "device.attributes['gpu.nvidia.com']['profile'] == '1g.5gb' && "
        'device.capacity["gpu.nvidia.com"].memory > 0 && device.driver == "gpu.nvidia.com"'
    )
    assert found.references == {
        ("attributes", "gpu.nvidia.com", "profile"),
        ("capacity", "gpu.nvidia.com", "memory"),
    }
    assert found.drivers == {"gpu.nvidia.com"}


# --- the list of what drasil publishes ----------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "mig_mode", "sharing"),
    [
        ("a100-40gb:1,a100-40gb-mig:1", "static", "exclusive"),
        ("a100-40gb:1", "dynamic", "consumable"),
        ("h100-80gb:1", "static", "consumable"),
    ],
)
def test_the_published_lists_are_what_discovery_publishes(
    profile: str, mig_mode: str, sharing: str
) -> None:
    backends = open_backends("simulated", vendors=["nvidia"], profile=profile, node_name="n")
    found = discover_node(
        backends.nvml, None, node_name="n", mig_mode=mig_mode, gpu_sharing=sharing
    )
    attributes = {name for device in found.devices for name in device.attributes}
    capacity = {name for device in found.devices for name in device.capacity}
    standard = {n.removeprefix(f"{STANDARD_DOMAIN}/") for n in attributes if "/" in n}
    assert {n for n in attributes if "/" not in n} <= PUBLISHED_ATTRIBUTES
    assert standard <= PUBLISHED_STANDARD
    assert capacity <= PUBLISHED_CAPACITY


# --- the report and the command ---------------------------------------------------------


def test_the_report_lists_objects_then_workloads_blocked_first() -> None:
    text = report(
        _result(GPU_TEST1, IMEX, VFIO, MEMORY_SHARING, values={"gpuSharing": "exclusive"})
    )
    assert text.splitlines() == [
        "OBJECT\tVERDICT\tWHY",
        f"ComputeDomain imex-test/imex-channel-injection\t{BLOCKED}\t"
        "ComputeDomains (IMEX channels across a multi-node NVLink domain) are NVIDIA's: "
        "drasil runs no ComputeDomain controller nor IMEX daemons",
        f"ResourceClaimTemplate imex-test/imex-channel-0\t{BLOCKED}\t"
        "config for channel (ComputeDomainChannelConfig), request channel asks for "
        "compute-domain-default-channel.nvidia.com: ComputeDomains (IMEX channels across "
        "a multi-node NVLink domain) are NVIDIA's: drasil runs no ComputeDomain "
        "controller nor IMEX daemons",
        f"ResourceClaimTemplate gpu-share-memory/gpu-4gi\t{CHANGE}\t"
        "request gpu asks capacity memory (a share of a GPU): set the chart value "
        "gpuSharing: consumable",
        f"ResourceClaimTemplate gpu-test-vfio/single-gpu\t{CHANGE}\t"
        "request gpu asks for vfio.gpu.nvidia.com: GPUs for virtual machines are "
        "published with the chart value passthrough.enabled: true (docs/passthrough.md)",
        f"ResourceClaimTemplate gpu-test1/single-gpu\t{UNCHANGED}\t-",
        "",
        "WORKLOAD\tVERDICT\tWHY",
        f"Pod imex-test/imex-channel-injection\t{BLOCKED}\t"
        "ResourceClaimTemplate imex-channel-0: config for channel "
        "(ComputeDomainChannelConfig), request channel asks for "
        "compute-domain-default-channel.nvidia.com: ComputeDomains (IMEX channels across "
        "a multi-node NVLink domain) are NVIDIA's: drasil runs no ComputeDomain "
        "controller nor IMEX daemons",
        f"Deployment gpu-share-memory/memory-sharing\t{CHANGE}\t"
        "ResourceClaimTemplate gpu-4gi: request gpu asks capacity memory (a share of a "
        "GPU): set the chart value gpuSharing: consumable",
        f"Pod gpu-test-vfio/pod1\t{CHANGE}\t"
        "ResourceClaimTemplate single-gpu: request gpu asks for vfio.gpu.nvidia.com: GPUs"
        " for virtual machines are published with the chart value passthrough.enabled: "
        "true (docs/passthrough.md)",
        f"Pod gpu-test1/pod1\t{UNCHANGED}\t-",
        f"Pod gpu-test1/pod2\t{UNCHANGED}\t-",
        "",
        "objects: 5 (runs unchanged 1, needs a change 2, cannot move yet 2)",
        "workloads: 5 (runs unchanged 2, needs a change 2, cannot move yet 1)",
        "judged for: compatibility nvidia-dra, gpuSharing exclusive, passthrough off",
        "the values do not set compatibility: nvidia-dra, which all of this needs",
    ]


class _FakeApi:
    def __init__(self, lists: dict[str, list[dict[str, Any]] | None]) -> None:
        self.lists = lists
        self.paths: list[str] = []

    def list_everywhere(self, path: str) -> list[dict[str, Any]] | None:
        self.paths.append(path)
        return self.lists.get(path.rsplit("/", 1)[-1], [])


def test_the_command_lists_what_it_judges(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    documents = [d for d in yaml.safe_load_all(GPU_TEST5 + "---\n" + IMEX) if d]
    by_path = {
        "resourceclaimtemplates": [d for d in documents if d["kind"] == "ResourceClaimTemplate"],
        "pods": [d for d in documents if d["kind"] == "Pod"],
        "computedomains": [d for d in documents if d["kind"] == "ComputeDomain"],
        "resourceslices": None,  # may not list them: said, and judged without
    }
    api = _FakeApi(by_path)
    monkeypatch.setattr(cli, "load_user_api_client", lambda _path: None)
    monkeypatch.setattr(cli, "KubeApi", lambda _client: api)
    values = tmp_path / "values.yaml"
    values.write_text("compatibility: nvidia-dra\n")
    out = io.StringIO()
    code = cli.main(["migrate", "check", "--from", "nvidia-dra", "-f", str(values)], out=out)
    assert code == 0
    assert "may not list resourceslices: not checked" in capsys.readouterr().err
    rows = {line.split("\t")[0]: line.split("\t")[1] for line in out.getvalue().splitlines()
            if "\t" in line}  # fmt: skip
    assert rows == {
        "OBJECT": "VERDICT",
        "WORKLOAD": "VERDICT",
        "ComputeDomain imex-test/imex-channel-injection": BLOCKED,
        "ResourceClaimTemplate imex-test/imex-channel-0": BLOCKED,
        "ResourceClaimTemplate gpu-test5/multiple-gpus": UNCHANGED,
        "Pod imex-test/imex-channel-injection": BLOCKED,
        "Pod gpu-test5/pod0": UNCHANGED,
    }
    assert "/apis/resource.k8s.io/v1/resourceclaims" in api.paths
    assert "/apis/resource.nvidia.com/v1beta1/computedomains" in api.paths
    assert "/api/v1/configmaps" not in api.paths  # the device plugin's, not read here
