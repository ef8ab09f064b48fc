"""An ``nvidia-smi`` stand-in for the mock NVML, and the fake driver root that carries it.

``python -m e2e.harness.mocknvml.smi --profile h100-80gb:2 --node-name n1 -q -x`` prints the XML
log of ``nvidia-smi -q -x`` (NVIDIA's ``nvsmi_device_v12.dtd``: ``<nvidia_smi_log>``, a
``<gpu id="...">`` per GPU) for the GPUs ``simulated_gpus`` makes of the profile: the
UUIDs, names, memory, bus ids, minor numbers and MIG mode the mock NVML serves, and
driver 580.95.05. With ``DRASIL_MOCK_SMI_WRONG_UUID=1`` the first GPU's UUID is wrong,
so that the GPU check's comparison can be seen to fail.

``make_root(dest, profile, node_name)`` builds what ``make gpu-check-mock`` checks: a
fake driver root (``e2e.harness.driverroot``, layout ``debian``) whose
``libnvidia-ml.so.<version>`` is the mock with the node's config embedded (so that a
process in the GPU check's sandbox, which has no environment of ours, finds the node),
whose ``usr/bin/nvidia-smi`` runs this module, and the mock's node (config, device
nodes) under ``<dest>/node``. The check then runs with ``--nvidia-driver-root <dest>/root
--dev-root <dest>/node/dev``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from drasil.driver.simulated.gpus import (
    CUDA_DRIVER_VERSION,
    DRIVER_VERSION,
    FakeGpu,
    simulated_gpus,
)
from e2e.harness import driverroot, mocknvml

WRONG_UUID_ENV = "DRASIL_MOCK_SMI_WRONG_UUID"
WRONG_UUID = "GPU-00000000-dead-beef-0000-000000000000"
REPO = Path(__file__).resolve().parents[3]


def _gpu_xml(gpu: FakeGpu, uuid: str) -> str:
    model = gpu.model
    mig = ("Enabled" if model.mig_enabled else "Disabled") if model.mig_capable else "N/A"
    bus = gpu.pci_bus_id
    return f"""\t<gpu id="{bus}">
\t\t<product_name>{escape(model.product_name)}</product_name>
\t\t<product_brand>NVIDIA</product_brand>
\t\t<mig_mode>
\t\t\t<current_mig>{mig}</current_mig>
\t\t\t<pending_mig>{mig}</pending_mig>
\t\t</mig_mode>
\t\t<uuid>{uuid}</uuid>
\t\t<minor_number>{gpu.minor}</minor_number>
\t\t<pci>
\t\t\t<pci_bus>{bus[9:11]}</pci_bus>
\t\t\t<pci_device>{bus[12:14]}</pci_device>
\t\t\t<pci_domain>{bus[:8]}</pci_domain>
\t\t\t<pci_bus_id>{bus}</pci_bus_id>
\t\t</pci>
\t\t<fb_memory_usage>
\t\t\t<total>{model.memory_mib} MiB</total>
\t\t\t<reserved>0 MiB</reserved>
\t\t\t<used>0 MiB</used>
\t\t\t<free>{model.memory_mib} MiB</free>
\t\t</fb_memory_usage>
\t</gpu>
"""


def smi_xml(profile: str, *, node_name: str, wrong_uuid: bool = False) -> str:
    """What ``nvidia-smi -q -x`` prints on the mock node."""
    gpus = simulated_gpus(profile, node_name=node_name)
    cuda = f"{CUDA_DRIVER_VERSION // 1000}.{CUDA_DRIVER_VERSION % 1000 // 10}"
    body = "".join(
        _gpu_xml(g, WRONG_UUID if wrong_uuid and i == 0 else g.uuid) for i, g in enumerate(gpus)
    )
    return f"""<?xml version="1.0" ?>
<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">
<nvidia_smi_log>
\t<timestamp>Thu Jan  1 00:00:00 2026</timestamp>
\t<driver_version>{DRIVER_VERSION}</driver_version>
\t<cuda_version>{cuda}</cuda_version>
\t<attached_gpus>{len(gpus)}</attached_gpus>
{body}</nvidia_smi_log>
"""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nvidia-smi (drasil mock)")
    p.add_argument("--profile", required=True)
    p.add_argument("--node-name", required=True)
    p.add_argument("-q", action="store_true")
    p.add_argument("-x", action="store_true")
    args = p.parse_args(argv)
    if not (args.q and args.x):
        print("the mock nvidia-smi answers -q -x only", file=sys.stderr)
        return 2
    wrong = os.environ.get(WRONG_UUID_ENV) == "1"
    sys.stdout.write(smi_xml(args.profile, node_name=args.node_name, wrong_uuid=wrong))
    return 0


# ---- the mock node's driver root ----------------------------------------------------------


@dataclass(frozen=True)
class MockRoot:
    root: Path  # --nvidia-driver-root
    node: mocknvml.MockNode

    @property
    def dev_root(self) -> Path:  # --dev-root
        return self.node.dev_root

    def check_args(self) -> list[str]:
        return [
            f"--nvidia-driver-root={self.root}",
            f"--dev-root={self.dev_root}",
            f"--node-name={self.node.node_name}",
            f"--proc-root={self.node.proc_root}",
            # The fake root's MPS programs are stubs, and the fake libcuda no MPS
            # client: the MPS step runs on a GPU only (its verdict is unit-tested).
            "--no-mps",
        ]


def _smi_script(profile: str, node_name: str) -> str:
    return (
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from e2e.harness.mocknvml.smi import main\n"
        f"sys.exit(main(['--profile', {profile!r}, '--node-name', {node_name!r}, *sys.argv[1:]]))\n"
    )


def make_root(dest: Path, *, profile: str, node_name: str) -> MockRoot:
    """The fake driver root and the mock node of ``profile`` (needs root: mknod)."""
    node = mocknvml.make_mock_node(dest / "node", profile, node_name=node_name)
    gpus = len(node.gpus)
    fake = driverroot.build_fake_root(dest / "root", layout="debian", dev_nodes=True, gpus=gpus)
    mocknvml.install_mock(fake.host(f"{fake.lib_dirs[0]}/libnvidia-ml.so.{fake.version}"), node)
    smi = fake.host("/usr/bin/nvidia-smi")
    smi.unlink()
    smi.write_text(_smi_script(profile, node_name))
    smi.chmod(0o755)
    return MockRoot(root=fake.root, node=node)


def make_root_main(argv: Sequence[str] | None = None) -> int:
    """``python -m e2e.harness.mocknvml.smi make-root DEST --profile P --node-name N``: build
    it and print the check's arguments."""
    p = argparse.ArgumentParser(prog="python -m e2e.harness.mocknvml.smi make-root")
    p.add_argument("dest", type=Path)
    p.add_argument("--profile", default="h100-80gb:2")
    p.add_argument("--node-name", default="gpu-check-mock")
    args = p.parse_args(argv)
    if args.dest.exists():
        shutil.rmtree(args.dest)
    made = make_root(args.dest, profile=args.profile, node_name=args.node_name)
    print(" ".join(made.check_args()))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["make-root"]:
        sys.exit(make_root_main(sys.argv[2:]))
    sys.exit(main())
