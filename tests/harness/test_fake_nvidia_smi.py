"""The fake driver roots' `nvidia-smi` (e2e/harness/driverroot/nvidia_smi.c) over the mock NVML.

The program dlopens `libnvidia-ml.so.1` by SONAME (here the compiled mock, through
LD_LIBRARY_PATH) and prints `nvidia-smi -L` in NVIDIA's format from what NVML lists. The
mock lists the GPUs whose `nvidia<minor>` its dev root holds and, where capabilities are
checked (a container's /dev, or a dev root with an nvidia-caps folder), the MIG devices
whose two capability nodes it holds; so a dev root holding some nodes is what a container
of a claim sees. No cluster, no root (but for the one test that mounts a /dev).
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from drasil.driver.simulated.gpus import FakeGpu, FakeMig
from e2e.harness import driverroot, mocknvml
from e2e.harness.mocknvml import MockNode

NODE = "node-smi"


def _smi(node: MockNode | None, *args: str, lib_dir: Path | None = None) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != mocknvml.CONFIG_ENV}
    env["LD_LIBRARY_PATH"] = str(lib_dir or mocknvml.compiled_mock().parent)
    if node is not None:
        env.update(node.env())
    done = subprocess.run(
        [str(driverroot.compiled_nvidia_smi()), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def _node(tmp_path: Path, profile: str, gpus: list[int]) -> MockNode:
    """A mock node whose dev root holds the device nodes of `gpus` (indices) only."""
    node = mocknvml.make_mock_node(tmp_path / "node", profile, node_name=NODE, dev_nodes=False)
    mocknvml.make_dev_nodes(node.dev_root, [node.gpus[i] for i in gpus])
    return node


def _give_caps(dev_root: Path, gpu: FakeGpu, *migs: FakeMig) -> None:
    """The GPU and compute instance capability nodes of `migs` under `dev_root`."""
    caps = dev_root / "nvidia-caps"
    caps.mkdir(exist_ok=True)
    for mig in migs:
        for ci in (None, mig.instance.compute_instance_id):
            minor = mocknvml.mig_cap_minor(gpu.minor, mig.instance.gpu_instance_id, ci)
            (caps / f"nvidia-cap{minor}").touch()


def _gpu_line(index: int, gpu: FakeGpu) -> str:
    return f"GPU {index}: {gpu.model.product_name} (UUID: {gpu.uuid})\n"


def test_it_lists_exactly_the_gpus_whose_device_nodes_are_there(tmp_path: Path) -> None:
    node = _node(tmp_path, "h100-80gb:4", [1, 3])
    code, out, err = _smi(node, "-L")
    assert (code, err) == (0, "")
    assert out == _gpu_line(0, node.gpus[1]) + _gpu_line(1, node.gpus[3])
    assert _smi(node, "--list-gpus")[1] == out


def test_the_listing_has_nvidias_format(tmp_path: Path) -> None:
    node = _node(tmp_path, "h100-80gb:1", [0])
    code, out, _ = _smi(node, "-L")
    assert code == 0
    assert out == f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {node.gpus[0].uuid})\n"


def test_a_mig_claims_view_is_its_parent_and_its_mig_device_only(tmp_path: Path) -> None:
    """The parent's node and the caps of one of the two 1g.5gb devices: the parent GPU
    line, that device renumbered 0, nothing of its siblings."""
    node = _node(tmp_path, "h100-80gb:1,a100-40gb-mig:1", [1])
    a100 = node.gpus[1]
    small = [m for m in a100.migs if m.instance.profile.name == "1g.5gb"]
    assert len(small) == 2
    _give_caps(node.dev_root, a100, small[1])
    code, out, err = _smi(node, "-L")
    assert (code, err) == (0, "")
    assert out == (
        f"GPU 0: NVIDIA A100-SXM4-40GB (UUID: {a100.uuid})\n"
        f"  MIG 1g.5gb      Device  0: (UUID: {small[1].uuid})\n"
    )


def test_a_mig_device_needs_both_of_its_capability_nodes(tmp_path: Path) -> None:
    node = _node(tmp_path, "a100-40gb-mig:1", [0])
    a100 = node.gpus[0]
    first, second = a100.migs[:2]
    _give_caps(node.dev_root, a100, first, second)
    ci_minor = mocknvml.mig_cap_minor(a100.minor, second.instance.gpu_instance_id, 0)
    (node.dev_root / "nvidia-caps" / f"nvidia-cap{ci_minor}").unlink()
    _, out, _ = _smi(node, "-L")
    assert out.splitlines()[1:] == [f"  MIG 3g.20gb     Device  0: (UUID: {first.uuid})"]


def test_a_whole_gpu_without_caps_nodes_shows_no_mig_device(tmp_path: Path) -> None:
    """Capabilities are checked (an nvidia-caps folder) and the container has none of
    this GPU's: the GPU, none of its MIG devices."""
    node = _node(tmp_path, "a100-40gb-mig:1", [0])
    (node.dev_root / "nvidia-caps").mkdir()
    assert _smi(node, "-L")[1] == _gpu_line(0, node.gpus[0])


def test_the_hosts_view_lists_every_mig_device(tmp_path: Path) -> None:
    """A node's dev root without an nvidia-caps folder is a host's: root sees all."""
    node = _node(tmp_path, "a100-40gb-mig:1", [0])
    a100 = node.gpus[0]
    code, out, _ = _smi(node, "-L")
    assert code == 0
    migs = sorted(a100.migs, key=lambda m: m.instance.gpu_instance_id)
    assert out == _gpu_line(0, a100) + "".join(
        f"  {'MIG ' + m.instance.profile.name:<15} Device {i:>2}: (UUID: {m.uuid})\n"
        for i, m in enumerate(migs)
    )
    assert [line.split("Device")[0] for line in out.splitlines()[1:]] == [
        "  MIG 3g.20gb     ",
        "  MIG 2g.10gb     ",
        "  MIG 1g.5gb      ",
        "  MIG 1g.5gb      ",
    ]


def test_without_arguments_a_header_then_the_listing(tmp_path: Path) -> None:
    node = _node(tmp_path, "l4:2", [0])
    code, out, _ = _smi(node)
    assert code == 0
    header, *rest = out.splitlines(keepends=True)
    assert "Driver Version: 580.95.05" in header
    assert "CUDA Version: 13.0" in header
    assert rest == [_gpu_line(0, node.gpus[0])]


def test_no_device_node_no_gpu(tmp_path: Path) -> None:
    node = _node(tmp_path, "h100-80gb:2", [])
    assert _smi(node, "-L")[:2] == (6, "No devices were found\n")


def test_other_options_fail_clearly(tmp_path: Path) -> None:
    node = _node(tmp_path, "h100-80gb:1", [0])
    code, out, err = _smi(node, "-q", "-x")
    assert (code, out) == (2, "")
    assert "not implemented here: -q -x" in err
    assert "-L, --list-gpus" in err
    assert _smi(node, "--help")[0] == 0


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="this host has an NVML of its own"
)
def test_without_an_nvml_it_says_so(tmp_path: Path) -> None:
    code, _, err = _smi(None, "-L", lib_dir=tmp_path)
    assert code == 12
    assert "couldn't find libnvidia-ml.so" in err


def test_the_fake_root_carries_it(tmp_path: Path) -> None:
    fake = driverroot.build_fake_root(tmp_path / "root", layout="no-ldcache")
    smi = fake.host("/usr/bin/nvidia-smi")
    assert smi.read_bytes() == driverroot.compiled_nvidia_smi().read_bytes()
    assert smi.read_bytes()[:4] == b"\x7fELF"
    assert os.access(smi, os.X_OK)
    # The other binaries stay stubs.
    assert fake.host("/usr/bin/nvidia-debugdump").read_text().startswith("#!/bin/sh")


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="mounts a /dev: needs root"
)
def test_in_a_container_the_containers_dev_decides(tmp_path: Path) -> None:
    """The config's dev root is not there (as in a container): the mock looks at /dev,
    here a folder mounted over /dev in a private mount namespace, holding one GPU's node
    and one MIG device's caps nodes: no nvidia-caps folder would mean no MIG device."""
    node = mocknvml.make_mock_node(
        tmp_path / "node", "h100-80gb:2,a100-40gb-mig:1", node_name=NODE, dev_nodes=False
    )
    node.dev_root.rmdir()
    a100 = node.gpus[2]
    dev = tmp_path / "container-dev"
    mocknvml.make_dev_nodes(dev, [a100])
    _give_caps(dev, a100, a100.migs[1])
    assert _smi_with_dev(node, dev) == (
        f"GPU 0: NVIDIA A100-SXM4-40GB (UUID: {a100.uuid})\n"
        f"  MIG 2g.10gb     Device  0: (UUID: {a100.migs[1].uuid})\n"
    )
    (dev / "nvidia-caps").rename(tmp_path / "no-caps")
    assert _smi_with_dev(node, dev) == _gpu_line(0, a100)


def _smi_with_dev(node: MockNode, dev: Path) -> str:
    """`nvidia-smi -L`'s output in a private mount namespace where `dev` is /dev."""
    env = {k: v for k, v in os.environ.items() if k != mocknvml.CONFIG_ENV}
    env.update(node.env(), LD_LIBRARY_PATH=str(mocknvml.compiled_mock().parent))
    script = 'mount --bind "$1" /dev && exec "$2" -L'
    smi = driverroot.compiled_nvidia_smi()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", dev, smi],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout
