"""A third vendor of a few dozen lines, registered through drasil's vendor seam only.

``acme_vendor-0.1.dist-info/entry_points.txt`` names it in the group
``drasil.vendors``; with this folder on ``PYTHONPATH`` the node daemon serves its
simulated NPUs (``--simulated-profile acme-npu:2``) beside drasil's own vendors: no
line of drasil names it (tests/kubeletplugin/test_vendor_seam.py, e2e/test_vendors.py).
Each NPU is given to a container as ``/dev/acme<N>``, a character device with
``/dev/null``'s numbers, so that a container can open it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from drasil.driver.devices import CharDevice, Device, DeviceType, Vendor
from drasil.driver.health import HealthTracker
from drasil.kubeletplugin.options import PluginOptions
from drasil.kubeletplugin.vendors.seam import (
    HealthSource,
    NodeLabelSet,
    NodeState,
    PrepareSteps,
    ReadinessCheck,
    VendorDevices,
)

ACME = Vendor.declare("acme")
NPU = DeviceType.declare("acme-npu", vendor=ACME)
MODEL = "acme-npu"


class AcmeNode:
    vendor = ACME

    def __init__(self, count: int) -> None:
        self.count = count
        self.closed = threading.Event()

    def discover(self, *, dra: bool) -> VendorDevices:
        npus = tuple(_npu(index) for index in range(self.count))
        return VendorDevices(devices=npus, driver="acme 1.0")

    def health_sources(
        self, devices: Sequence[Device], health: HealthTracker
    ) -> list[HealthSource]:
        return []

    def container_edits(self, *, device_plugin: bool = False) -> None:
        return None

    def readiness(self) -> list[ReadinessCheck]:
        return []

    def node_labels(self, devices: Sequence[Device]) -> NodeLabelSet | None:
        return None

    def prepare_steps(self, node: NodeState) -> PrepareSteps:
        return PrepareSteps()

    def close(self) -> None:
        self.closed.set()


def _npu(index: int) -> Device:
    node = CharDevice(path=f"/dev/acme{index}", host_path=f"/dev/acme{index}", major=1, minor=3)
    return Device(
        name=f"acme-{index}",
        type=NPU,
        uuid=f"ACME-{index:04d}",
        minor=index,
        attributes={"type": NPU.value, "uuid": f"ACME-{index:04d}", "productName": "Acme NPU"},
        capacity={"memory": 16 * 1024**3},
        char_devices=(node,),
    )


class AcmeSource:
    vendor = ACME

    def detect(self, opts: PluginOptions) -> bool:
        return False

    def where_detected(self, opts: PluginOptions) -> str:
        return "no Acme driver (it has none)"

    def simulates(self, model: str) -> bool:
        return model == MODEL

    def simulated_models(self) -> tuple[str, ...]:
        return (MODEL,)

    def open(self, opts: PluginOptions, *, simulated: str | None) -> AcmeNode:
        if simulated is None:
            raise ValueError("Acme NPUs are simulated only")
        counts = [entry.partition(":")[2] or "1" for entry in simulated.split(",")]
        return AcmeNode(sum(int(c) for c in counts))


SOURCE = AcmeSource()
