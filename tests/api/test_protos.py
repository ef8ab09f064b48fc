"""kubelet's gRPC contracts: our .proto files match upstream's wire names and numbers.

The expected tables are written from kubelet's protos (docs/design.md#kubelet-grpc-apis), not our
files, so a typo in either shows up here.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor, descriptor_pool
from typing_extensions import override

from drasil.api.kubelet import names, protos
from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2, deviceplugin_pb2_grpc
from drasil.api.kubelet.dra.v1 import dra_pb2 as dra_v1
from drasil.api.kubelet.dra.v1 import dra_pb2_grpc as dra_v1_grpc
from drasil.api.kubelet.dra.v1beta1 import dra_pb2 as dra_v1beta1
from drasil.api.kubelet.dra.v1beta1 import dra_pb2_grpc as dra_v1beta1_grpc
from drasil.api.kubelet.health.v1 import health_pb2 as health_v1
from drasil.api.kubelet.health.v1 import health_pb2_grpc as health_v1_grpc
from drasil.api.kubelet.health.v1alpha1 import health_pb2 as health_v1alpha1
from drasil.api.kubelet.health.v1alpha1 import health_pb2_grpc as health_v1alpha1_grpc
from drasil.api.kubelet.pluginregistration import registration_pb2, registration_pb2_grpc

# All six files are imported above into one process: the default descriptor pool
# accepted them, which it would not if two registered the same file name.
MODULES: dict[str, tuple[ModuleType, ModuleType]] = {
    "drasil/api/kubelet/dra/v1/dra.proto": (dra_v1, dra_v1_grpc),
    "drasil/api/kubelet/dra/v1beta1/dra.proto": (dra_v1beta1, dra_v1beta1_grpc),
    "drasil/api/kubelet/health/v1alpha1/health.proto": (health_v1alpha1, health_v1alpha1_grpc),
    "drasil/api/kubelet/health/v1/health.proto": (health_v1, health_v1_grpc),
    "drasil/api/kubelet/pluginregistration/registration.proto": (
        registration_pb2,
        registration_pb2_grpc,
    ),
    "drasil/api/kubelet/deviceplugin/v1beta1/deviceplugin.proto": (
        deviceplugin_pb2,
        deviceplugin_pb2_grpc,
    ),
}

PACKAGES = {
    "drasil/api/kubelet/dra/v1/dra.proto": "k8s.io.kubelet.pkg.apis.dra.v1",
    "drasil/api/kubelet/dra/v1beta1/dra.proto": "k8s.io.kubelet.pkg.apis.dra.v1beta1",
    "drasil/api/kubelet/health/v1alpha1/health.proto": "v1alpha1",
    "drasil/api/kubelet/health/v1/health.proto": "v1",
    "drasil/api/kubelet/pluginregistration/registration.proto": "pluginregistration",
    "drasil/api/kubelet/deviceplugin/v1beta1/deviceplugin.proto": "v1beta1",
}

# Every method path kubelet dials or serves, exactly as upstream spells it.
DRA_V1 = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/"
DRA_V1BETA1 = "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/"
WIRE_PATHS = {
    dra_v1_grpc: [DRA_V1 + "NodePrepareResources", DRA_V1 + "NodeUnprepareResources"],
    dra_v1beta1_grpc: [
        DRA_V1BETA1 + "NodePrepareResources",
        DRA_V1BETA1 + "NodeUnprepareResources",
    ],
    health_v1alpha1_grpc: ["/v1alpha1.DRAResourceHealth/NodeWatchResources"],
    health_v1_grpc: ["/v1.DRAResourceHealth/NodeWatchResources"],
    registration_pb2_grpc: [
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    ],
    deviceplugin_pb2_grpc: [
        "/v1beta1.Registration/Register",
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
        "/v1beta1.DevicePlugin/ListAndWatch",
        "/v1beta1.DevicePlugin/GetPreferredAllocation",
        "/v1beta1.DevicePlugin/Allocate",
        "/v1beta1.DevicePlugin/PreStartContainer",
    ],
}

# Field tables: message -> field -> (number, type). Types are spelled as in a .proto
# file; "optional" means explicit presence.
Table = dict[str, dict[str, tuple[int, str]]]

_DRA_COMMON: Table = {
    "NodePrepareResourcesRequest": {"claims": (1, "repeated Claim")},
    "NodePrepareResourcesResponse": {
        "claims": (1, "map<string, NodePrepareResourceResponse>"),
    },
    "NodePrepareResourceResponse": {"devices": (1, "repeated Device"), "error": (2, "string")},
    "NodeUnprepareResourcesRequest": {"claims": (1, "repeated Claim")},
    "NodeUnprepareResourcesResponse": {
        "claims": (1, "map<string, NodeUnprepareResourceResponse>"),
    },
    "NodeUnprepareResourceResponse": {"error": (1, "string")},
    "Claim": {"namespace": (1, "string"), "uid": (2, "string"), "name": (3, "string")},
}
_DRA_DEVICE = {
    "request_names": (1, "repeated string"),
    "pool_name": (2, "string"),
    "device_name": (3, "string"),
    "cdi_device_ids": (4, "repeated string"),
}
DRA_V1_FIELDS: Table = _DRA_COMMON | {"Device": _DRA_DEVICE | {"share_id": (5, "optional string")}}
DRA_V1BETA1_FIELDS: Table = _DRA_COMMON | {"Device": _DRA_DEVICE}

HEALTH_FIELDS: Table = {
    "NodeWatchResourcesRequest": {},
    "DeviceIdentifier": {"pool_name": (1, "string"), "device_name": (2, "string")},
    "DeviceHealth": {
        "device": (1, "DeviceIdentifier"),
        "health": (2, "HealthStatus"),
        "last_updated_time": (3, "int64"),
        "health_check_timeout_seconds": (4, "int64"),
        "message": (5, "string"),
    },
    "NodeWatchResourcesResponse": {"devices": (1, "repeated DeviceHealth")},
}

REGISTRATION_FIELDS: Table = {
    "PluginInfo": {
        "type": (1, "string"),
        "name": (2, "string"),
        "endpoint": (3, "string"),
        "supported_versions": (4, "repeated string"),
    },
    "RegistrationStatus": {"plugin_registered": (1, "bool"), "error": (2, "string")},
    "RegistrationStatusResponse": {},
    "InfoRequest": {},
}

DEVICE_PLUGIN_FIELDS: Table = {
    "DevicePluginOptions": {
        "pre_start_required": (1, "bool"),
        "get_preferred_allocation_available": (2, "bool"),
    },
    "RegisterRequest": {
        "version": (1, "string"),
        "endpoint": (2, "string"),
        "resource_name": (3, "string"),
        "options": (4, "DevicePluginOptions"),
    },
    "Empty": {},
    "ListAndWatchResponse": {"devices": (1, "repeated Device")},
    "TopologyInfo": {"nodes": (1, "repeated NUMANode")},
    "NUMANode": {"ID": (1, "int64")},
    "Device": {"ID": (1, "string"), "health": (2, "string"), "topology": (3, "TopologyInfo")},
    "PreStartContainerRequest": {"devices_ids": (1, "repeated string")},
    "PreStartContainerResponse": {},
    "PreferredAllocationRequest": {
        "container_requests": (1, "repeated ContainerPreferredAllocationRequest"),
    },
    "ContainerPreferredAllocationRequest": {
        "available_deviceIDs": (1, "repeated string"),
        "must_include_deviceIDs": (2, "repeated string"),
        "allocation_size": (3, "int32"),
    },
    "PreferredAllocationResponse": {
        "container_responses": (1, "repeated ContainerPreferredAllocationResponse"),
    },
    "ContainerPreferredAllocationResponse": {"deviceIDs": (1, "repeated string")},
    "AllocateRequest": {"container_requests": (1, "repeated ContainerAllocateRequest")},
    "ContainerAllocateRequest": {"devices_ids": (1, "repeated string")},
    "CDIDevice": {"name": (1, "string")},
    "AllocateResponse": {"container_responses": (1, "repeated ContainerAllocateResponse")},
    "ContainerAllocateResponse": {
        "envs": (1, "map<string, string>"),
        "mounts": (2, "repeated Mount"),
        "devices": (3, "repeated DeviceSpec"),
        "annotations": (4, "map<string, string>"),
        "cdi_devices": (5, "repeated CDIDevice"),
    },
    "Mount": {
        "container_path": (1, "string"),
        "host_path": (2, "string"),
        "read_only": (3, "bool"),
    },
    "DeviceSpec": {
        "container_path": (1, "string"),
        "host_path": (2, "string"),
        "permissions": (3, "string"),
    },
}

FIELDS: dict[ModuleType, Table] = {
    dra_v1: DRA_V1_FIELDS,
    dra_v1beta1: DRA_V1BETA1_FIELDS,
    health_v1alpha1: HEALTH_FIELDS,
    health_v1: HEALTH_FIELDS,
    registration_pb2: REGISTRATION_FIELDS,
    deviceplugin_pb2: DEVICE_PLUGIN_FIELDS,
}

_SCALARS = {
    descriptor.FieldDescriptor.TYPE_STRING: "string",
    descriptor.FieldDescriptor.TYPE_BOOL: "bool",
    descriptor.FieldDescriptor.TYPE_INT32: "int32",
    descriptor.FieldDescriptor.TYPE_INT64: "int64",
}


# --- generated stubs are current -------------------------------------------------------


def test_checked_in_stubs_are_not_stale() -> None:
    stale = protos.stale_files()
    assert stale == [], f"stale generated files (run `make protos`): {stale}"


def test_check_lists_a_stale_file(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    current = protos.checked_in()
    monkeypatch.setattr(
        protos, "checked_in", lambda: current | {"dra/v1/dra_pb2.py": b"# edited by hand\n"}
    )
    assert protos.main(["check"]) == 1
    assert "stale: " + str(protos.KUBELET_DIR / "dra/v1/dra_pb2.py") in capsys.readouterr().err


def test_generation_covers_every_proto() -> None:
    assert protos.proto_files() == [
        "deviceplugin/v1beta1/deviceplugin.proto",
        "dra/v1/dra.proto",
        "dra/v1beta1/dra.proto",
        "health/v1/health.proto",
        "health/v1alpha1/health.proto",
        "pluginregistration/registration.proto",
    ]
    for rel in protos.proto_files():
        stem = rel.removesuffix(".proto")
        for suffix in protos.GENERATED_SUFFIXES:
            assert (protos.KUBELET_DIR / (stem + suffix)).is_file(), stem + suffix


# --- one descriptor pool, distinct file names, upstream packages -----------------------


@pytest.mark.parametrize("file_name", list(MODULES))
def test_files_register_under_distinct_names(file_name: str) -> None:
    pb2, _ = MODULES[file_name]
    assert pb2.DESCRIPTOR.name == file_name
    assert pb2.DESCRIPTOR.package == PACKAGES[file_name]
    assert descriptor_pool.Default().FindFileByName(file_name) is pb2.DESCRIPTOR


# --- wire names -------------------------------------------------------------------------


class _Recorder:
    """Stands in for a grpc channel and server; records the method paths they get."""

    def __init__(self) -> None:
        self.dialed: list[str] = []
        self.served: list[str] = []

    def _dial(self, path: str, **_: Any) -> None:
        self.dialed.append(path)

    unary_unary = unary_stream = stream_unary = stream_stream = _dial

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.served += [f"/{service}/{method}" for method in handlers]


def _services(grpc_module: ModuleType) -> list[str]:
    pb2 = next(pb2 for pb2, mod in MODULES.values() if mod is grpc_module)
    return list(pb2.DESCRIPTOR.services_by_name)


@pytest.mark.parametrize("grpc_module", list(WIRE_PATHS), ids=lambda m: m.__name__)
def test_method_paths_match_upstream(grpc_module: ModuleType) -> None:
    recorder = _Recorder()
    for service in _services(grpc_module):
        getattr(grpc_module, f"{service}Stub")(recorder)
        servicer = getattr(grpc_module, f"{service}Servicer")()
        getattr(grpc_module, f"add_{service}Servicer_to_server")(servicer, recorder)
    assert recorder.dialed == WIRE_PATHS[grpc_module]
    assert recorder.served == WIRE_PATHS[grpc_module]


def test_service_names_from_descriptors_match_upstream() -> None:
    assert names.DRA_PLUGIN_V1_SERVICE == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert names.DRA_PLUGIN_V1BETA1_SERVICE == "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
    assert names.DRA_HEALTH_V1_SERVICE == "v1.DRAResourceHealth"
    assert names.DRA_HEALTH_V1ALPHA1_SERVICE == "v1alpha1.DRAResourceHealth"
    assert names.PLUGIN_REGISTRATION_SERVICE == "pluginregistration.Registration"
    assert names.DEVICE_PLUGIN_REGISTRATION_SERVICE == "v1beta1.Registration"
    assert names.DEVICE_PLUGIN_SERVICE == "v1beta1.DevicePlugin"
    assert names.method_path(names.DRA_PLUGIN_V1_SERVICE, "NodePrepareResources") == (
        DRA_V1 + "NodePrepareResources"
    )


def test_registration_strings() -> None:
    assert names.DRA_PLUGIN_TYPE == "DRAPlugin"
    assert names.SUPPORTED_VERSIONS == (
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    )
    assert names.DEVICE_PLUGIN_API_VERSION == "v1beta1"
    assert (names.HEALTHY, names.UNHEALTHY) == ("Healthy", "Unhealthy")


def test_streaming_methods() -> None:
    streaming = {
        method.full_name
        for pb2, _ in MODULES.values()
        for service in pb2.DESCRIPTOR.services_by_name.values()
        for method in service.methods
        if method.server_streaming or method.client_streaming
    }
    assert streaming == {
        "v1alpha1.DRAResourceHealth.NodeWatchResources",
        "v1.DRAResourceHealth.NodeWatchResources",
        "v1beta1.DevicePlugin.ListAndWatch",
    }
    for pb2, _ in MODULES.values():
        for service in pb2.DESCRIPTOR.services_by_name.values():
            assert not any(m.client_streaming for m in service.methods), service.full_name


# --- messages: field names, numbers, types ----------------------------------------------


def _type_name(field: descriptor.FieldDescriptor) -> str:
    if field.type in _SCALARS:
        return _SCALARS[field.type]
    named = field.message_type or field.enum_type
    return named.full_name.removeprefix(field.file.package + ".")


def _spelling(field: descriptor.FieldDescriptor) -> str:
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
        return f"map<{_type_name(key)}, {_type_name(value)}>"
    if field.is_repeated:
        return "repeated " + _type_name(field)
    # Singular message fields always have presence; a scalar has it only when optional.
    if field.has_presence and field.message_type is None:
        return "optional " + _type_name(field)
    return _type_name(field)


def _table(pb2: ModuleType) -> Table:
    return {
        name: {f.name: (f.number, _spelling(f)) for f in message.fields}
        for name, message in pb2.DESCRIPTOR.message_types_by_name.items()
    }


@pytest.mark.parametrize("pb2", list(FIELDS), ids=lambda m: m.__name__)
def test_fields_match_reference(pb2: ModuleType) -> None:
    assert _table(pb2) == FIELDS[pb2]


@pytest.mark.parametrize("pb2", [health_v1alpha1, health_v1], ids=lambda m: m.__name__)
def test_health_status_enum(pb2: ModuleType) -> None:
    enum = pb2.DESCRIPTOR.enum_types_by_name["HealthStatus"]
    assert {v.name: v.number for v in enum.values} == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}


def test_share_id_has_presence_only_in_v1() -> None:
    device = dra_v1.Device(pool_name="node-a", device_name="gpu-0")
    assert not device.HasField("share_id")
    device.share_id = ""
    assert device.HasField("share_id")
    assert "share_id" not in dra_v1beta1.Device.DESCRIPTOR.fields_by_name


def test_v1beta1_decodes_v1_device_ignoring_share_id() -> None:
    # The two versions differ only by field 5: a v1 encoding is a valid v1beta1 one.
    v1 = dra_v1.Device(request_names=["gpu"], device_name="gpu-0", share_id="s-1")
    beta = dra_v1beta1.Device.FromString(v1.SerializeToString())
    assert (list(beta.request_names), beta.device_name) == (["gpu"], "gpu-0")


# --- a real round trip over a unix socket -----------------------------------------------


class _Plugin(dra_v1_grpc.DRAPluginServicer):
    """Prepares every claim onto one device named after it; refuses claim "bad"."""

    @override
    def NodePrepareResources(
        self, request: dra_v1.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra_v1.NodePrepareResourcesResponse:
        response = dra_v1.NodePrepareResourcesResponse()
        for claim in request.claims:
            result = response.claims[claim.uid]
            if claim.name == "bad":
                result.error = f"claim {claim.namespace}/{claim.name}: no such device"
                continue
            result.devices.add(
                request_names=["gpu"],
                pool_name="node-a",
                device_name=f"gpu-{claim.name}",
                cdi_device_ids=[f"k8s.gpu.drasil.dev/claim={claim.uid}"],
                share_id=f"share-{claim.uid}",
            )
        return response

    @override
    def NodeUnprepareResources(
        self, request: dra_v1.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra_v1.NodeUnprepareResourcesResponse:
        return dra_v1.NodeUnprepareResourcesResponse(
            claims={c.uid: dra_v1.NodeUnprepareResourceResponse() for c in request.claims}
        )


@pytest.fixture
def dra_socket(tmp_path: Path) -> Iterator[str]:
    target = f"unix://{tmp_path / 'dra.sock'}"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    dra_v1_grpc.add_DRAPluginServicer_to_server(_Plugin(), server)
    server.add_insecure_port(target)
    server.start()
    yield target
    server.stop(grace=None)


def test_prepare_round_trip_keys_by_claim_uid(dra_socket: str) -> None:
    claims = [
        dra_v1.Claim(namespace="ns", uid="uid-1", name="one"),
        dra_v1.Claim(namespace="ns", uid="uid-2", name="bad"),
    ]
    with grpc.insecure_channel(dra_socket) as channel:
        stub = dra_v1_grpc.DRAPluginStub(channel)
        prepared = stub.NodePrepareResources(
            dra_v1.NodePrepareResourcesRequest(claims=claims), timeout=45
        )
        unprepared = stub.NodeUnprepareResources(
            dra_v1.NodeUnprepareResourcesRequest(claims=claims), timeout=45
        )
    assert set(prepared.claims) == {"uid-1", "uid-2"}
    (device,) = prepared.claims["uid-1"].devices
    assert (device.pool_name, device.device_name) == ("node-a", "gpu-one")
    assert list(device.cdi_device_ids) == ["k8s.gpu.drasil.dev/claim=uid-1"]
    assert device.HasField("share_id")
    assert device.share_id == "share-uid-1"
    assert prepared.claims["uid-1"].error == ""
    assert prepared.claims["uid-2"].error == "claim ns/bad: no such device"
    assert not prepared.claims["uid-2"].devices
    assert set(unprepared.claims) == {"uid-1", "uid-2"}
