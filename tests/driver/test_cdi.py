"""Per-claim CDI specs: content, version selection, validation, files, crashes.

Every spec these tests build or write is checked twice: against the official CDI JSON
Schema (tests/data/cdi-schema) and by our own env check, which the schema cannot do
because its env item rule is broken ("ref" instead of "$ref").
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from drasil.driver.cdi import claimspecs as cdi
from drasil.driver.cdi import spec as cdi_spec
from drasil.driver.cdi.claimspecs import ClaimDevice, ClaimSpecRequest
from drasil.driver.cdi.spec import CdiSpecError, ContainerEdits, DeviceNode, Mount
from drasil.driver.devices import Device, DeviceType
from drasil.driver.files import CRASH_ENV, CRASH_EXIT_CODE, write_atomic

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = ROOT / "tests" / "data" / "cdi-schema"
DRIVER = "gpu.drasil.dev"
UID = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
UID2 = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
GPU0_UUID = "GPU-11111111-2222-3333-4444-555555555555"
GPU1_UUID = "GPU-66666666-7777-8888-9999-000000000000"


# --- helpers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schema_validator() -> jsonschema.Draft7Validator:
    schema_file, defs_file = SCHEMA_DIR / "schema.json", SCHEMA_DIR / "defs.json"
    if not (schema_file.is_file() and defs_file.is_file()):
        pytest.fail(
            f"official CDI schema not found: expected schema.json and defs.json in "
            f"{SCHEMA_DIR} (the official CDI schema, see its README.md)"
        )
    defs = json.loads(defs_file.read_text())
    registry: Registry[Any] = Registry().with_resource(
        "defs.json", Resource.from_contents(defs, default_specification=DRAFT7)
    )
    schema = json.loads(schema_file.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema, registry=registry)


def assert_valid_cdi(validator: jsonschema.Draft7Validator, spec: Mapping[str, Any]) -> None:
    validator.validate(spec)
    # The schema does not check env items; this is the rule it means.
    for edits in _every_edits(spec):
        for entry in edits.get("env", []):
            name, eq, _ = entry.partition("=")
            assert eq, f"env entry {entry!r} has no '='"
            assert name, f"env entry {entry!r} has an empty name"
    cdi_spec.validate_spec(spec)


def _every_edits(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    edits = [d["containerEdits"] for d in spec["devices"]]
    return [*edits, spec.get("containerEdits", {})]


def gpu(name: str = "gpu-0", uuid: str = GPU0_UUID, nodes: tuple[str, ...] = ()) -> Device:
    return Device(
        name=name,
        type=DeviceType.GPU,
        uuid=uuid,
        minor=0,
        attributes={"uuid": uuid},
        capacity={"memory": 80 * 2**30},
        device_nodes=nodes,
    )


def request(
    *devices: ClaimDevice, uid: str = UID, common: ContainerEdits | None = None
) -> ClaimSpecRequest:
    return ClaimSpecRequest(
        claim_uid=uid,
        namespace="team-a",
        name="train",
        devices=devices or (ClaimDevice(gpu()),),
        common_edits=common or ContainerEdits(),
    )


def build(validator: jsonschema.Draft7Validator, req: ClaimSpecRequest) -> dict[str, Any]:
    spec = cdi.build_claim_spec(req, driver=DRIVER)
    assert_valid_cdi(validator, spec)
    return spec


def write(validator: jsonschema.Draft7Validator, req: ClaimSpecRequest, root: Path) -> Path:
    path = cdi.write_claim_spec(req, cdi_root=root, driver=DRIVER)
    assert_valid_cdi(validator, json.loads(path.read_bytes()))
    return path


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


# --- building ----------------------------------------------------------------------------


def test_claim_spec_content(schema_validator: jsonschema.Draft7Validator) -> None:
    req = request(ClaimDevice(gpu("gpu-0", GPU0_UUID)), ClaimDevice(gpu("gpu-1", GPU1_UUID)))
    spec = build(schema_validator, req)
    assert spec["kind"] == "k8s.gpu.drasil.dev/claim"
    assert spec["cdiVersion"] == "0.5.0"  # device names start with the UID's digit
    assert [d["name"] for d in spec["devices"]] == [f"{UID}-gpu-0", f"{UID}-gpu-1"]
    assert spec["devices"][1]["containerEdits"] == {"env": [f"DRASIL_DEVICE_GPU_1={GPU1_UUID}"]}
    # Lists go to the spec-wide edits: per-device values of one variable would clash.
    both = f"{GPU0_UUID},{GPU1_UUID}"
    assert spec["containerEdits"] == {
        "env": [
            f"DRASIL_CLAIM_NAME={req.name}",
            f"DRASIL_CLAIM_NAMESPACE={req.namespace}",
            f"DRASIL_CLAIM_UID={UID}",
            f"DRASIL_VISIBLE_DEVICES={both}",
            f"NVIDIA_VISIBLE_DEVICES={both}",
        ]
    }


def test_uid_starting_with_a_letter_needs_only_the_base_version(
    schema_validator: jsonschema.Draft7Validator,
) -> None:
    spec = build(schema_validator, request(uid="a" + UID[1:]))
    assert spec["cdiVersion"] == "0.3.0"


def test_vendor_and_class_derive_from_the_driver_name(
    schema_validator: jsonschema.Draft7Validator,
) -> None:
    spec = cdi.build_claim_spec(request(), driver="example.com")
    assert_valid_cdi(schema_validator, spec)
    assert spec["kind"] == "k8s.example.com/claim"
    assert cdi.claim_kind("example.com") == "k8s.example.com/claim"


def test_sharing_env_from_the_caller(schema_validator: jsonschema.Draft7Validator) -> None:
    sharing = {
        "DRASIL_TIMESLICE_INTERVAL": "Short",
        "DRASIL_SHARING_STRATEGY": "TimeSlicing",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
    }
    spec = build(schema_validator, request(ClaimDevice(gpu(), extra_env=sharing)))
    assert spec["devices"][0]["containerEdits"]["env"] == [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
        f"DRASIL_DEVICE_GPU_0={GPU0_UUID}",
        "DRASIL_SHARING_STRATEGY=TimeSlicing",
        "DRASIL_TIMESLICE_INTERVAL=Short",
    ]


def test_device_nodes_and_common_edits(schema_validator: jsonschema.Draft7Validator) -> None:
    common = ContainerEdits(
        env={"NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
        device_nodes=(DeviceNode("/dev/nvidiactl"), DeviceNode("/dev/nvidia-uvm")),
        mounts=(Mount("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/libcuda.so.1"),),
    )
    req = request(ClaimDevice(gpu(nodes=("/dev/nvidia0",))), common=common)
    spec = build(schema_validator, req)
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    assert spec["containerEdits"] == {
        "env": [
            f"DRASIL_CLAIM_NAME={req.name}",
            f"DRASIL_CLAIM_NAMESPACE={req.namespace}",
            "DRASIL_CLAIM_UID=" + UID,
            f"DRASIL_VISIBLE_DEVICES={GPU0_UUID}",
            "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
            f"NVIDIA_VISIBLE_DEVICES={GPU0_UUID}",
        ],
        "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}],
        "mounts": [
            {
                "hostPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                "containerPath": "/usr/lib/libcuda.so.1",
            }
        ],
    }


def test_mount_type_and_host_path_raise_the_version(
    schema_validator: jsonschema.Draft7Validator,
) -> None:
    letter_uid = "a" + UID[1:]
    typed = ContainerEdits(mounts=(Mount("/h", "/c", options=("ro", "bind"), type="bind"),))
    assert build(schema_validator, request(uid=letter_uid, common=typed))["cdiVersion"] == "0.4.0"
    hosted = ContainerEdits(device_nodes=(DeviceNode("/dev/x", host_path="/dev/y"),))
    assert build(schema_validator, request(uid=letter_uid, common=hosted))["cdiVersion"] == "0.5.0"


def test_claim_cdi_device_ids() -> None:
    req = request(ClaimDevice(gpu("gpu-0")), ClaimDevice(gpu("gpu-1", GPU1_UUID)))
    assert cdi.claim_cdi_device_ids(req, driver=DRIVER) == {
        "gpu-0": f"k8s.gpu.drasil.dev/claim={UID}-gpu-0",
        "gpu-1": f"k8s.gpu.drasil.dev/claim={UID}-gpu-1",
    }
    one = cdi.cdi_device_id(driver=DRIVER, claim_uid=UID, device_name="gpu-1")
    assert one == f"k8s.gpu.drasil.dev/claim={UID}-gpu-1"


@pytest.mark.parametrize(
    ("req", "field"),
    [
        pytest.param(request(ClaimDevice(gpu()), ClaimDevice(gpu())), "duplicate", id="dup"),
        pytest.param(
            ClaimSpecRequest(claim_uid=UID, namespace="n", name="c", devices=()),
            "devices",
            id="no-devices",
        ),
        pytest.param(
            request(ClaimDevice(gpu(), extra_env={"DRASIL_VISIBLE_DEVICES": "x"})),
            "DRASIL_VISIBLE_DEVICES",
            id="override-visible",
        ),
        pytest.param(
            request(common=ContainerEdits(env={"DRASIL_CLAIM_UID": "x"})),
            "DRASIL_CLAIM_UID",
            id="override-claim-uid",
        ),
        pytest.param(
            request(ClaimDevice(gpu(), extra_env={"BAD NAME": "x"})),
            r"devices\[0\]\.containerEdits\.env\[0\]",
            id="bad-env-name",
        ),
        pytest.param(
            request(common=ContainerEdits(device_nodes=(DeviceNode("dev/rel"),))),
            r"containerEdits\.deviceNodes\[0\]\.path",
            id="relative-node",
        ),
        pytest.param(request(uid="../../etc"), "claimUID", id="uid-escape"),
        pytest.param(request(ClaimDevice(gpu("gpu_0-"))), r"devices\[0\]\.name", id="dev-name"),
    ],
)
def test_bad_requests_name_the_field(req: ClaimSpecRequest, field: str) -> None:
    with pytest.raises(CdiSpecError, match=field):
        cdi.build_claim_spec(req, driver=DRIVER)


def test_error_names_the_claim() -> None:
    req = request(ClaimDevice(gpu()), ClaimDevice(gpu()))
    with pytest.raises(CdiSpecError, match="claim team-a/train"):
        cdi.build_claim_spec(req, driver=DRIVER)


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


# --- files ---------------------------------------------------------------------------------


def test_spec_path() -> None:
    path = cdi.spec_path(Path("/var/run/cdi"), driver=DRIVER, claim_uid=UID)
    assert path == Path(f"/var/run/cdi/k8s.gpu.drasil.dev-claim_{UID}.json")


def test_write_read_back(schema_validator: jsonschema.Draft7Validator, tmp_path: Path) -> None:
    req = request(ClaimDevice(gpu(), extra_env={"DRASIL_SHARING_STRATEGY": "TimeSlicing"}))
    path = write(schema_validator, req, tmp_path)
    assert path == cdi.spec_path(tmp_path, driver=DRIVER, claim_uid=UID)
    assert os.listdir(tmp_path) == [path.name]  # no temp file left
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert cdi.read_claim_spec(tmp_path, driver=DRIVER, claim_uid=UID) == build(
        schema_validator, req
    )
    assert path.read_bytes() == cdi_spec.encode_spec(build(schema_validator, req))


def test_repeated_write_is_byte_identical_and_skipped(
    schema_validator: jsonschema.Draft7Validator, tmp_path: Path
) -> None:
    env = {"B": "2", "A": "1"}
    path = write(schema_validator, request(ClaimDevice(gpu(), extra_env=env)), tmp_path)
    before, first = path.stat(), path.read_bytes()
    reordered = dict(reversed(env.items()))
    write(schema_validator, request(ClaimDevice(gpu(), extra_env=reordered)), tmp_path)
    assert path.read_bytes() == first
    assert path.stat().st_ino == before.st_ino  # not even rewritten


def test_changed_content_replaces_the_file(
    schema_validator: jsonschema.Draft7Validator, tmp_path: Path
) -> None:
    path = write(schema_validator, request(), tmp_path)
    write(schema_validator, request(ClaimDevice(gpu(uuid=GPU1_UUID))), tmp_path)
    assert GPU1_UUID in path.read_text()
    assert os.listdir(tmp_path) == [path.name]


def test_read_missing_and_garbage(tmp_path: Path) -> None:
    assert cdi.read_claim_spec(tmp_path, driver=DRIVER, claim_uid=UID) is None
    cdi.spec_path(tmp_path, driver=DRIVER, claim_uid=UID).write_bytes(b"{not json")
    with pytest.raises(CdiSpecError, match="not JSON"):
        cdi.read_claim_spec(tmp_path, driver=DRIVER, claim_uid=UID)


def test_delete_is_idempotent(schema_validator: jsonschema.Draft7Validator, tmp_path: Path) -> None:
    write(schema_validator, request(), tmp_path)
    assert cdi.delete_claim_spec(tmp_path, driver=DRIVER, claim_uid=UID) is True
    assert cdi.delete_claim_spec(tmp_path, driver=DRIVER, claim_uid=UID) is False
    assert cdi.read_claim_spec(tmp_path, driver=DRIVER, claim_uid=UID) is None
    assert os.listdir(tmp_path) == []


def test_list_claim_specs(schema_validator: jsonschema.Draft7Validator, tmp_path: Path) -> None:
    assert cdi.list_claim_specs(tmp_path / "absent", DRIVER) == []
    write(schema_validator, request(uid=UID2), tmp_path)
    write(schema_validator, request(uid=UID), tmp_path)
    (tmp_path / f"k8s.gpu.drasil.dev-claim_{UID}.json.abc.tmp").write_text("{")
    (tmp_path / "k8s.other.dev-claim_x.json").write_text("{}")
    (tmp_path / "nvidia.yaml").write_text("")
    assert cdi.list_claim_specs(tmp_path, DRIVER) == sorted([UID, UID2])
    assert cdi.list_claim_specs(tmp_path, "other.dev") == ["x"]


def test_failed_write_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "x.json"
    target.write_bytes(b"old")

    def refuse(src: object, dst: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk on fire"):
        write_atomic(target, b"new")
    assert os.listdir(tmp_path) == ["x.json"]
    assert target.read_bytes() == b"old"


# --- crashes -----------------------------------------------------------------------------

_CHILD = """
import sys
from pathlib import Path
from drasil.driver.cdi import claimspecs as cdi
from drasil.driver.devices import Device, DeviceType

root, uid, uuid = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
device = Device(name="gpu-0", type=DeviceType.GPU, uuid=uuid, minor=0, attributes={},
                capacity={})
req = cdi.ClaimSpecRequest(claim_uid=uid, namespace="team-a", name="train",
                           devices=(cdi.ClaimDevice(device),))
if sys.argv[4] == "write":
    cdi.write_claim_spec(req, cdi_root=root, driver="gpu.drasil.dev")
else:
    cdi.delete_claim_spec(root, driver="gpu.drasil.dev", claim_uid=uid)
"""


def _run_child(root: Path, *, uuid: str, action: str, crash_at: str) -> int:
    env = {**os.environ, CRASH_ENV: crash_at}
    argv = [sys.executable, "-c", _CHILD, str(root), UID, uuid, action]
    return subprocess.run(argv, env=env, check=False, timeout=60).returncode


@pytest.mark.parametrize(
    ("point", "survivor"),
    [
        ("cdi-mid-write", "old"),
        ("cdi-before-rename", "old"),
        ("cdi-after-rename", "new"),
        ("no-such-point", "new"),
    ],
)
def test_crash_leaves_old_or_new_never_partial(
    schema_validator: jsonschema.Draft7Validator, tmp_path: Path, point: str, survivor: str
) -> None:
    path = write(schema_validator, request(), tmp_path)
    old = path.read_bytes()
    new = cdi_spec.encode_spec(build(schema_validator, request(ClaimDevice(gpu(uuid=GPU1_UUID)))))
    code = _run_child(tmp_path, uuid=GPU1_UUID, action="write", crash_at=point)
    assert code == (0 if point == "no-such-point" else CRASH_EXIT_CODE)
    assert path.read_bytes() == (old if survivor == "old" else new)
    assert_valid_cdi(schema_validator, json.loads(path.read_bytes()))
    leftovers = cdi.sweep_claim_spec_temps(tmp_path, DRIVER)
    assert bool(leftovers) == (point in {"cdi-mid-write", "cdi-before-rename"})
    assert all(p.name.endswith(".tmp") and ".json." in p.name for p in leftovers)
    assert os.listdir(tmp_path) == [path.name]
    # A leftover temp file is never mistaken for a spec.
    assert cdi.list_claim_specs(tmp_path, DRIVER) == [UID]


def test_crash_before_remove_keeps_the_spec(
    schema_validator: jsonschema.Draft7Validator, tmp_path: Path
) -> None:
    path = write(schema_validator, request(), tmp_path)
    code = _run_child(tmp_path, uuid=GPU0_UUID, action="delete", crash_at="cdi-before-remove")
    assert code == CRASH_EXIT_CODE
    assert path.exists()
    assert cdi.delete_claim_spec(tmp_path, driver=DRIVER, claim_uid=UID) is True
