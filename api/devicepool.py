"""The DevicePool custom resource: ``drasil.dev/v1alpha1``, cluster-scoped.

A DevicePool lists devices that no single node's plugin owns (network-attached
GPUs, a rack's shared accelerators) and says where they are reachable; the
controller publishes it as the ResourceSlices of one pool named after the
DevicePool. The fields are shaped like the ResourceSlice fields they become::

    apiVersion: drasil.dev/v1alpha1
    kind: DevicePool
    metadata: {name: rack-a}
    spec:
      driver: gpu.drasil.dev            # optional: the controller's driver
      nodeSelector: {nodeSelectorTerms: [{matchExpressions: [...]}]}   # or allNodes: true
      devices:
      - name: remote-0
        attributes: {type: {string: remote-gpu}, productName: {string: NVIDIA L4}}
        capacity: {memory: {value: 24Gi}}

The CRD schema checks shapes and types only. What the ResourceSlice API would reject
on top (attribute names, value lengths, semver, quantities, the per-slice limits) is
checked by the controller, which reports it in ``status.conditions`` in words and
keeps the previous good slices: a typo must not take devices away from running
workloads.

``python -m drasil.api.devicepool crd`` prints the CRD generated from these models.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError

from drasil.api.documents import StrictModel
from drasil.api.limits import (
    MAX_BINDING_CONDITIONS,
    MAX_BINDING_FAILURE_CONDITIONS,
    MAX_SIMULATED_ATTACH_SECONDS,
)

GROUP: Final = "drasil.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = "drasil.dev/v1alpha1"
KIND: Final = "DevicePool"
PLURAL: Final = "devicepools"
SINGULAR: Final = "devicepool"
SHORT_NAMES: Final = ("dpool",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

READY: Final = "Ready"
"""The condition type the controller maintains."""
MAX_DEVICES: Final = 1024
"""Devices per DevicePool (eight full slices); keeps the object well under etcd's limit."""


class DeviceAttribute(StrictModel):
    """One attribute value; exactly one field is set, as in a ResourceSlice."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1, "maxProperties": 1})

    int_: int | None = Field(None, alias="int")
    bool_: bool | None = Field(None, alias="bool")
    string: str | None = None
    version: str | None = Field(None, description="A semantic version such as 12.4.0.")


class DeviceCapacity(StrictModel):
    """A capacity value as a Kubernetes quantity (24Gi, 4)."""

    value: int | str


class DeviceTaint(StrictModel):
    """A device taint; claims that do not tolerate it are not allocated the device."""

    key: str
    value: str | None = None
    effect: Literal["None", "NoSchedule", "NoExecute"]


class PoolDevice(StrictModel):
    """One device: its name (a DNS label), attributes, capacity and taints.

    Attribute and capacity names are C identifiers (the driver's domain) or
    <domain>/<identifier>, as in a ResourceSlice."""

    name: str
    attributes: dict[str, DeviceAttribute] = Field(default_factory=dict)
    capacity: dict[str, DeviceCapacity] = Field(default_factory=dict)
    taints: list[DeviceTaint] = Field(default_factory=list)
    # KEP-5007, per device as in a ResourceSlice: a pool may mix devices that are
    # reachable at once with devices that must first be attached.
    binds_to_node: bool | None = Field(
        None,
        alias="bindsToNode",
        description="The allocation is limited to the node the scheduler picked.",
    )
    binding_conditions: list[str] = Field(
        default_factory=list,
        alias="bindingConditions",
        description="Condition types (label names) that must be True in the claim's "
        "status.devices entry before the Pod is bound; with bindingFailureConditions.",
        max_length=MAX_BINDING_CONDITIONS,
    )
    binding_failure_conditions: list[str] = Field(
        default_factory=list,
        alias="bindingFailureConditions",
        description="Condition types of which any True makes the scheduler un-allocate "
        "the device and schedule the Pod again; with bindingConditions.",
        max_length=MAX_BINDING_FAILURE_CONDITIONS,
    )


class SimulatedFabric(StrictModel):
    """SIMULATED: how the controller pretends to attach devices with binding conditions.

    drasil has no fabric manager. The controller plays one so that binding conditions
    can be shown and tested: an attach takes ``attachSeconds`` from the allocation and
    fails for the devices in ``failDevices``."""

    attach_seconds: int = Field(0, alias="attachSeconds", ge=0, le=MAX_SIMULATED_ATTACH_SECONDS)
    fail_devices: list[str] = Field(
        default_factory=list,
        alias="failDevices",
        json_schema_extra={"maxItems": MAX_DEVICES},
    )


class DevicePoolSpec(StrictModel):
    """The devices and where they are reachable: nodeSelector or allNodes."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.nodeSelector) != (has(self.allNodes) && self.allNodes)",
                    "message": "set exactly one of nodeSelector and allNodes: true",
                }
            ]
        }
    )

    driver: str | None = Field(
        None, description="The DRA driver that publishes the pool; default: the controller's."
    )
    node_selector: dict[str, Any] | None = Field(
        None,
        alias="nodeSelector",
        description="A core/v1 NodeSelector with exactly one term.",
    )
    all_nodes: bool | None = Field(None, alias="allNodes")
    devices: list[PoolDevice] = Field(
        default_factory=list,
        # A list map: kubectl apply and server-side apply merge devices by name, and
        # the API server rejects a name used twice.
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "maxItems": MAX_DEVICES,
        },
    )
    simulated_fabric: SimulatedFabric | None = Field(
        None,
        alias="simulatedFabric",
        description="SIMULATED attach of devices with binding conditions (demo and tests).",
    )


class Condition(StrictModel):
    """A metav1.Condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str = Field(
        alias="lastTransitionTime", json_schema_extra={"format": "date-time"}
    )
    observed_generation: int | None = Field(None, alias="observedGeneration")


class DevicePoolStatus(StrictModel):
    """What the controller did: the Ready condition and the slices it published."""

    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    published_slices: list[str] = Field(default_factory=list, alias="publishedSlices")
    observed_generation: int | None = Field(None, alias="observedGeneration")


class DevicePool(StrictModel):
    """Devices that no single node owns, published by the controller as one pool of
    ResourceSlices named after the DevicePool."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["drasil.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["DevicePool"] = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: DevicePoolSpec
    status: DevicePoolStatus | None = None

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))


class DevicePoolError(ValueError):
    """A DevicePool object that does not match the types; the message names the field."""


def _location(loc: Sequence[int | str]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def parse_devicepool(obj: Mapping[str, Any]) -> DevicePool:
    """Validate a DevicePool in its API JSON form; raises ``DevicePoolError``."""
    try:
        return DevicePool.model_validate(obj)
    except ValidationError as err:
        problems = [f"{_location(e['loc'])}: {e['msg']}" for e in err.errors()]
        raise DevicePoolError("; ".join(problems)) from None


# --- the CRD -----------------------------------------------------------------------


def _resolve(schema: Any, defs: Mapping[str, Any]) -> Any:
    """Inline ``$ref``s: structural schemas may not use them."""
    if isinstance(schema, list):
        return [_resolve(item, defs) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    if "$ref" in schema:
        target = defs[str(schema["$ref"]).rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return {key: _resolve(value, defs) for key, value in schema.items()}


def _structural(schema: Any) -> Any:
    """Turn pydantic's JSON Schema into a Kubernetes structural schema."""
    if isinstance(schema, list):
        return [_structural(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _structural(v) for k, v in schema.items() if k not in ("title", "default")}
    variants = out.pop("anyOf", None)
    if variants is not None:
        out.update(_merge_variants(variants))
    if "const" in out:
        out["enum"] = [out.pop("const")]
    if out.get("additionalProperties") is False:
        del out["additionalProperties"]  # not allowed beside properties; the API prunes
    if out.get("additionalProperties") is True:
        del out["additionalProperties"]
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _merge_variants(variants: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    kept = [v for v in variants if v.get("type") != "null"]  # optional = may be left out
    types = {v.get("type") for v in kept}
    if types == {"integer", "string"}:
        return {"x-kubernetes-int-or-string": True}
    if len(kept) != 1:
        raise ValueError(f"no structural schema for anyOf {variants}")
    return dict(kept[0])


def openapi_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the CRD, generated from ``DevicePool``."""
    raw = DevicePool.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema: dict[str, Any] = _structural(_resolve(raw, defs))
    schema["properties"]["metadata"] = {"type": "object"}
    schema["properties"]["apiVersion"] = {"type": "string"}
    schema["properties"]["kind"] = {"type": "string"}
    schema["required"] = ["spec"]
    schema.pop("additionalProperties", None)
    return schema


_PRINTER_COLUMNS: Final = (
    {"name": "Driver", "type": "string", "jsonPath": ".spec.driver"},
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
    },
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition of DevicePool."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/name": "drasil"}},
        "spec": {
            "group": GROUP,
            "scope": "Cluster",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["drasil"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(list(_PRINTER_COLUMNS)),
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `python -m drasil.api.devicepool crd`; do not edit.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=100)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drasil.api.devicepool")
    commands = parser.add_subparsers(dest="command", required=True)
    crd = commands.add_parser("crd", help="print the DevicePool CRD (YAML)")
    crd.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the output")
    args = parser.parse_args(argv)
    text = crd_yaml()
    if args.check:
        try:
            with open(args.check) as f:
                current = f.read()
        except FileNotFoundError:
            current = ""
        if current != text:
            print(
                f"{args.check} is stale: run python -m drasil.api.devicepool crd", file=sys.stderr
            )
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
