"""The strings kubelet and our daemons exchange about kubelet's gRPC APIs.

Service names come from the generated descriptors, so they cannot drift from the .proto
files that define what goes over the wire.
"""

from __future__ import annotations

from typing import Final

from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2
from drasil.api.kubelet.dra.v1 import dra_pb2 as dra_v1
from drasil.api.kubelet.dra.v1beta1 import dra_pb2 as dra_v1beta1
from drasil.api.kubelet.health.v1 import health_pb2 as health_v1
from drasil.api.kubelet.health.v1alpha1 import health_pb2 as health_v1alpha1
from drasil.api.kubelet.pluginregistration import registration_pb2

# PluginInfo.type for a DRA driver.
DRA_PLUGIN_TYPE: Final = "DRAPlugin"

# PluginInfo.supported_versions entries. These are registration strings, not the wire
# package names (v1 DRAPlugin lives in k8s.io.kubelet.pkg.apis.dra.v1).
DRA_PLUGIN_V1: Final = "v1.DRAPlugin"
DRA_PLUGIN_V1BETA1: Final = "v1beta1.DRAPlugin"
DRA_HEALTH_V1: Final = "v1.DRAResourceHealth"
DRA_HEALTH_V1ALPHA1: Final = "v1alpha1.DRAResourceHealth"
# kubelet picks the first entry it supports, so the order is our preference.
DRA_PLUGIN_VERSIONS: Final = (DRA_PLUGIN_V1, DRA_PLUGIN_V1BETA1)
DRA_HEALTH_VERSIONS: Final = (DRA_HEALTH_V1, DRA_HEALTH_V1ALPHA1)
# What to advertise when the health service is served too.
SUPPORTED_VERSIONS: Final = DRA_PLUGIN_VERSIONS + DRA_HEALTH_VERSIONS

# RegisterRequest.version of the classic device-plugin API.
DEVICE_PLUGIN_API_VERSION: Final = "v1beta1"
# Device.health values of the classic device-plugin API.
HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"

# Full gRPC service names; a method's path is f"/{service}/{method}".
DRA_PLUGIN_V1_SERVICE: Final = dra_v1.DESCRIPTOR.services_by_name["DRAPlugin"].full_name
DRA_PLUGIN_V1BETA1_SERVICE: Final = dra_v1beta1.DESCRIPTOR.services_by_name["DRAPlugin"].full_name
DRA_HEALTH_V1_SERVICE: Final = health_v1.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name
DRA_HEALTH_V1ALPHA1_SERVICE: Final = health_v1alpha1.DESCRIPTOR.services_by_name[
    "DRAResourceHealth"
].full_name
PLUGIN_REGISTRATION_SERVICE: Final = registration_pb2.DESCRIPTOR.services_by_name[
    "Registration"
].full_name
DEVICE_PLUGIN_REGISTRATION_SERVICE: Final = deviceplugin_pb2.DESCRIPTOR.services_by_name[
    "Registration"
].full_name
DEVICE_PLUGIN_SERVICE: Final = deviceplugin_pb2.DESCRIPTOR.services_by_name[
    "DevicePlugin"
].full_name


def method_path(service: str, method: str) -> str:
    """The HTTP/2 path of a gRPC method, as kubelet dials it."""
    return f"/{service}/{method}"
