"""Per-claim CDI specs: content, files, crashes.

Every spec these tests build or write is checked twice: against the official CDI JSON
Schema (kubeletplugin/gpucheck/cdi-schema.json) and by our own env check, which the
schema cannot do because its env item rule is broken ("ref" instead of "$ref").
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from cdicheck import assert_valid_cdi

from drasil.driver.cdi import claimspecs as cdi
from drasil.driver.cdi import spec as cdi_spec
from drasil.driver.cdi.claimspecs import ClaimDevice, ClaimSpecRequest
from drasil.driver.cdi.spec import CdiSpecError, ContainerEdits, DeviceNode, Mount
from drasil.driver.devices import Device, DeviceType
from drasil.driver.files import CRASH_ENV, CRASH_EXIT_CODE, write_atomic

DRIVER = "gpu.drasil.dev"
UID = "0b7c3f2e-8d1a-4c55-9e0f-1a2b3c4d5e6f"
UID2 = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
GPU0_UUID = "GPU-11111111-2222-3333-4444-555555555555"
GPU1_UUID = "GPU-66666666-7777-8888-9999-000000000000"


# --- helpers -------------------------------------------------------------------------


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


# --- building ----------------------------------------------------------------------------


def test_claim_spec_content(schema_validator: jsonschema.Draft7Validator) -> None:
    req = request(ClaimDevice(gpu("gpu-0", GPU0_UUID)), ClaimDevice(gpu("gpu-1", GPU1_UUID)))
    spec = build(schema_validator, req)
    assert spec["kind"] == "k8s.gpu.drasil.dev/claim"
    assert spec["cdiVersion"] == "0.6.0"  # annotations
    assert [d["name"] for d in spec["devices"]] == [f"{UID}-gpu-0", f"{UID}-gpu-1"]
    assert spec["devices"][1]["containerEdits"] == {"env": [f"DRASIL_DEVICE_GPU_1={GPU1_UUID}"]}
    # Nothing claim-wide reaches a container: a container with two claims would get
    # two values of one variable. The claim's identity is for drasil only.
    assert "containerEdits" not in spec or spec["containerEdits"] == {}
    assert spec["annotations"] == {
        "drasil.dev/claim-uid": UID,
        "drasil.dev/claim-namespace": req.namespace,
        "drasil.dev/claim-name": req.name,
    }
    assert cdi.claim_identity(spec) == cdi.ClaimIdentity(UID, req.namespace, req.name)


def test_identity_of_a_spec_written_before_annotations() -> None:
    legacy = {
        "containerEdits": {
            "env": [f"DRASIL_CLAIM_UID={UID}", "DRASIL_CLAIM_NAMESPACE=a", "DRASIL_CLAIM_NAME=b"]
        }
    }
    assert cdi.claim_identity(legacy) == cdi.ClaimIdentity(UID, "a", "b")
    assert cdi.claim_identity({"containerEdits": {"env": ["X=1"]}}) is None
    assert cdi.claim_identity({"annotations": {"drasil.dev/claim-uid": 3}}) is None


def test_vendor_and_class_derive_from_the_driver_name(
    schema_validator: jsonschema.Draft7Validator,
) -> None:
    spec = cdi.build_claim_spec(request(), driver="example.com")
    assert_valid_cdi(schema_validator, spec)
    assert spec["kind"] == "k8s.example.com/claim"
    assert cdi.claim_kind("example.com") == "k8s.example.com/claim"


def test_settings_are_named_after_their_device(
    schema_validator: jsonschema.Draft7Validator,
) -> None:
    sharing = {"TIMESLICE_INTERVAL": "Short", "SHARING_STRATEGY": "TimeSlicing"}
    mps = {"SHARING_STRATEGY": "MPS", "MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    req = request(
        ClaimDevice(gpu(), settings=sharing), ClaimDevice(gpu("gpu-1", GPU1_UUID), settings=mps)
    )
    spec = build(schema_validator, req)
    assert spec["devices"][0]["containerEdits"]["env"] == [
        f"DRASIL_DEVICE_GPU_0={GPU0_UUID}",
        "DRASIL_DEVICE_GPU_0_SHARING_STRATEGY=TimeSlicing",
        "DRASIL_DEVICE_GPU_0_TIMESLICE_INTERVAL=Short",
    ]
    assert spec["devices"][1]["containerEdits"]["env"] == [
        f"DRASIL_DEVICE_GPU_1={GPU1_UUID}",
        "DRASIL_DEVICE_GPU_1_MPS_ACTIVE_THREAD_PERCENTAGE=50",
        "DRASIL_DEVICE_GPU_1_SHARING_STRATEGY=MPS",
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
        "env": ["NVIDIA_DRIVER_CAPABILITIES=compute,utility"],
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
    # The identity annotations need 0.6.0 already; 0.7.0 comes with additionalGids,
    # which drasil does not write. The version rules themselves: test_cdi_spec.py.
    typed = ContainerEdits(mounts=(Mount("/h", "/c", options=("ro", "bind"), type="bind"),))
    assert build(schema_validator, request(common=typed))["cdiVersion"] == "0.6.0"


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
            request(common=ContainerEdits(env={"DRASIL_DEVICE_GPU_0": "x"})),
            "DRASIL_DEVICE_GPU_0 is set per device",
            id="common-sets-a-device-variable",
        ),
        pytest.param(
            request(ClaimDevice(gpu(), settings={"BAD NAME": "x"})),
            r"devices\[0\]\.containerEdits\.env\[1\]",
            id="bad-setting-name",
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


# --- files ---------------------------------------------------------------------------------


def test_spec_path() -> None:
    path = cdi.spec_path(Path("/var/run/cdi"), driver=DRIVER, claim_uid=UID)
    assert path == Path(f"/var/run/cdi/k8s.gpu.drasil.dev-claim_{UID}.json")


def test_write_read_back(schema_validator: jsonschema.Draft7Validator, tmp_path: Path) -> None:
    req = request(ClaimDevice(gpu(), settings={"SHARING_STRATEGY": "TimeSlicing"}))
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
    path = write(schema_validator, request(ClaimDevice(gpu(), settings=env)), tmp_path)
    before, first = path.stat(), path.read_bytes()
    reordered = dict(reversed(env.items()))
    write(schema_validator, request(ClaimDevice(gpu(), settings=reordered)), tmp_path)
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
