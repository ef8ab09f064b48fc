"""CDI spec rules: the official schema itself, version selection, name/env/field validation.

Every hand-written spec here is checked against the official CDI JSON Schema
(kubeletplugin/gpucheck/cdi-schema.json, the ``schema_validator`` fixture) where the
schema can tell, and by ``drasil.driver.cdi.spec.validate_spec``, which also checks what the schema
cannot (its env item rule is broken: "ref" instead of "$ref").
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from cdicheck import assert_valid_cdi

from drasil.driver.cdi import spec as cdi_spec
from drasil.driver.cdi.spec import CdiSpecError

UID = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"

# --- helpers -------------------------------------------------------------------------


def minimal_spec(**changes: Any) -> dict[str, Any]:
    """A hand-written spec for the version table; ``changes`` are merged in."""
    spec: dict[str, Any] = {
        "cdiVersion": "0.3.0",
        "kind": "k8s.gpu.drasil.dev/claim",
        "devices": [{"name": "gpu0", "containerEdits": {"env": ["A=1"]}}],
    }
    spec.update(changes)
    return spec


MOUNT = {"hostPath": "/a", "containerPath": "/b"}
ENV = {"env": ["A=1"]}


def device_edits(**edits: Any) -> list[dict[str, Any]]:
    return [{"name": "gpu0", "containerEdits": {"env": ["A=1"], **edits}}]


# --- the schema itself -----------------------------------------------------------------


def test_schema_loads_with_its_defs(schema_validator: jsonschema.Draft7Validator) -> None:
    # A $ref into defs.json must resolve, or every check below would be vacuous.
    bad_node = minimal_spec(devices=device_edits(deviceNodes=[{"hostPath": "/dev/x"}]))
    with pytest.raises(jsonschema.ValidationError, match="'path' is a required property"):
        schema_validator.validate(bad_node)
    with pytest.raises(jsonschema.ValidationError, match="'devices' is a required property"):
        schema_validator.validate({"cdiVersion": "0.3.0", "kind": "a/b"})


def test_schema_misses_bad_env_that_our_check_catches(
    schema_validator: jsonschema.Draft7Validator,
) -> None:
    spec = minimal_spec(devices=[{"name": "gpu0", "containerEdits": {"env": ["=oops", 3]}}])
    schema_validator.validate(spec)  # the broken "ref" lets this through
    with pytest.raises(CdiSpecError, match=r"devices\[0\]\.containerEdits\.env\[0\]"):
        cdi_spec.validate_spec(spec)


# --- version selection -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "version"),
    [
        pytest.param({}, "0.3.0", id="base"),
        pytest.param({"kind": "k8s.gpu.drasil.dev/claim"}, "0.3.0", id="dots-in-vendor-only"),
        pytest.param(
            {"devices": device_edits(mounts=[MOUNT])},
            "0.3.0",
            id="mount-without-type",
        ),
        pytest.param(
            {"devices": device_edits(mounts=[{**MOUNT, "type": "bind"}])},
            "0.4.0",
            id="mount-type",
        ),
        pytest.param(
            {"containerEdits": {"mounts": [{**MOUNT, "type": "x"}]}},
            "0.4.0",
            id="spec-mount-type",
        ),
        pytest.param(
            {"devices": device_edits(deviceNodes=[{"path": "/dev/a", "hostPath": "/dev/b"}])},
            "0.5.0",
            id="node-host-path",
        ),
        pytest.param(
            {"containerEdits": {"deviceNodes": [{"path": "/dev/a", "hostPath": "/dev/b"}]}},
            "0.5.0",
            id="spec-node-host-path",
        ),
        pytest.param(
            {"devices": device_edits(deviceNodes=[{"path": "/dev/a"}])},
            "0.3.0",
            id="node-without-host-path",
        ),
        pytest.param(
            {"devices": [{"name": "0gpu", "containerEdits": {"env": ["A=1"]}}]},
            "0.5.0",
            id="digit-name",
        ),
        pytest.param({"annotations": {"a": "b"}}, "0.6.0", id="spec-annotations"),
        pytest.param({"annotations": {}}, "0.3.0", id="empty-annotations"),
        pytest.param(
            {"devices": [{"name": "g", "annotations": {"a": "b"}, "containerEdits": ENV}]},
            "0.6.0",
            id="device-annotations",
        ),
        pytest.param({"kind": "drasil.dev/gpu.claim"}, "0.6.0", id="dot-in-class"),
        pytest.param({"containerEdits": {"intelRdt": {"closID": "c"}}}, "0.7.0", id="intel-rdt"),
        pytest.param(
            {"devices": device_edits(additionalGids=[5, 6])}, "0.7.0", id="additional-gids"
        ),
        pytest.param({"containerEdits": {"additionalGids": []}}, "0.3.0", id="no-gids"),
        pytest.param(
            {"devices": device_edits(netDevices=[{"hostInterfaceName": "eth1", "name": "n1"}])},
            "1.1.0",
            id="net-devices",
        ),
        pytest.param(
            {"containerEdits": {"intelRdt": {"schemata": ["L3:0=f"]}}},
            "1.1.0",
            id="rdt-schemata",
        ),
        pytest.param(
            {
                "annotations": {"a": "b"},
                "devices": [{"name": "0gpu", "containerEdits": {"additionalGids": [1]}}],
            },
            "0.7.0",
            id="highest-wins",
        ),
    ],
)
def test_required_version(
    schema_validator: jsonschema.Draft7Validator, changes: dict[str, Any], version: str
) -> None:
    spec = minimal_spec(**changes)
    assert cdi_spec.required_cdi_version(spec) == version
    spec["cdiVersion"] = version
    assert_valid_cdi(schema_validator, spec)


def test_version_lower_than_the_content_needs_is_rejected() -> None:
    spec = minimal_spec(devices=[{"name": "0gpu", "containerEdits": {"env": ["A=1"]}}])
    with pytest.raises(CdiSpecError, match=r"cdiVersion: 0\.3\.0 is too old, .* 0\.5\.0"):
        cdi_spec.validate_spec(spec)


def test_unknown_version_is_rejected() -> None:
    with pytest.raises(CdiSpecError, match="cdiVersion"):
        cdi_spec.validate_spec(minimal_spec(cdiVersion="9.9.9"))


# --- name and env validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "ok"),
    [
        ("k8s.gpu.drasil.dev/claim", True),
        ("vendor.com/device", True),
        ("a/b", True),
        ("v_1-x/c_2-y", True),
        ("1vendor/claim", False),  # vendor must start with a letter
        ("vendor-/claim", False),  # ... and end with a letter or digit
        ("vendor/1claim", False),
        ("vendor/claim.", False),
        ("ven dor/claim", False),
        ("vendor:x/claim", False),
        ("vendorclaim", False),
        ("/claim", False),
        ("vendor/", False),
    ],
)
def test_kind_names(kind: str, ok: bool) -> None:
    spec = minimal_spec(kind=kind, cdiVersion="0.6.0")
    if ok:
        cdi_spec.validate_spec(spec)
    else:
        with pytest.raises(CdiSpecError, match="kind"):
            cdi_spec.validate_spec(spec)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("gpu0", True),
        ("0", True),
        (f"{UID}-gpu-0", True),
        ("a.b:c_d-e", True),
        ("-gpu", False),
        ("gpu-", False),
        ("gpu:", False),
        ("g/pu", False),
        ("g pu", False),
        ("", False),
        ("gpü", False),
    ],
)
def test_device_names(name: str, ok: bool) -> None:
    spec = minimal_spec(devices=[{"name": name, "containerEdits": {"env": ["A=1"]}}])
    spec["cdiVersion"] = "0.5.0"
    if ok:
        cdi_spec.validate_spec(spec)
    else:
        with pytest.raises(CdiSpecError, match=r"devices\[0\]\.name"):
            cdi_spec.validate_spec(spec)


@pytest.mark.parametrize(
    ("entry", "ok"),
    [
        ("A=1", True),
        ("A=", True),
        ("_A1=x=y", True),
        ("=1", False),
        ("A", False),
        ("1A=x", False),
        ("A-B=x", False),
        ("A=x\0y", False),
        (7, False),
    ],
)
def test_env_entries(entry: object, ok: bool) -> None:
    spec = minimal_spec(devices=[{"name": "g", "containerEdits": {"env": [entry]}}])
    if ok:
        cdi_spec.validate_spec(spec)
    else:
        with pytest.raises(CdiSpecError, match=r"devices\[0\]\.containerEdits\.env\[0\]"):
            cdi_spec.validate_spec(spec)


def test_duplicate_env_and_device_names() -> None:
    twice = minimal_spec(devices=[{"name": "g", "containerEdits": {"env": ["A=1", "A=2"]}}])
    with pytest.raises(CdiSpecError, match=r"env\[1\]: A is set twice"):
        cdi_spec.validate_spec(twice)
    dev = {"name": "g", "containerEdits": {"env": ["A=1"]}}
    with pytest.raises(CdiSpecError, match=r"devices\[1\]\.name: duplicate"):
        cdi_spec.validate_spec(minimal_spec(devices=[dev, dev]))


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (minimal_spec(extra=1), r"spec\.extra"),
        (minimal_spec(devices=[{"name": "g", "containerEdits": ENV, "x": 1}]), r"devices\[0\]\.x"),
        (minimal_spec(containerEdits={"envs": ["A=1"]}), r"containerEdits\.envs"),
        (
            minimal_spec(devices=device_edits(deviceNodes=[{"path": "/dev/a", "mode": 1}])),
            r"deviceNodes\[0\]\.mode",
        ),
        (minimal_spec(devices=device_edits(mounts=[{**MOUNT, "ro": True}])), r"mounts\[0\]\.ro"),
    ],
)
def test_unknown_fields_are_rejected(
    schema_validator: jsonschema.Draft7Validator, spec: dict[str, Any], field: str
) -> None:
    schema_validator.validate(spec)  # the schema allows extra keys; runtimes do not
    with pytest.raises(CdiSpecError, match=rf"{field}: unknown field"):
        cdi_spec.validate_spec(spec)


def test_device_without_edits_is_rejected() -> None:
    spec = minimal_spec(devices=[{"name": "g", "containerEdits": {"env": []}}])
    with pytest.raises(CdiSpecError, match=r"devices\[0\]\.containerEdits"):
        cdi_spec.validate_spec(spec)


@pytest.mark.parametrize(
    ("node", "field"),
    [
        ({"path": "/dev/a", "type": "x"}, "type"),
        ({"path": "/dev/a", "permissions": "rwx"}, "permissions"),
        ({"path": "/dev/a", "hostPath": "dev/b"}, "hostPath"),
    ],
)
def test_device_node_fields(node: dict[str, Any], field: str) -> None:
    spec = minimal_spec(devices=device_edits(deviceNodes=[node]), cdiVersion="0.5.0")
    with pytest.raises(CdiSpecError, match=rf"deviceNodes\[0\]\.{field}"):
        cdi_spec.validate_spec(spec)
