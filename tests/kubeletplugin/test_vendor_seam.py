"""The node daemon's vendor seam (``drasil.kubeletplugin.vendors``): the registry opens
the vendors a node serves and nothing else; an AMD-only node never loads NVML."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from drasil.driver.amd.partitions import PARTITION_MODES as AMD_PARTITION_MODES
from drasil.driver.devices import Vendor, VendorError
from drasil.driver.simulated.amdsysfs import write_simulated_tree
from drasil.kubeletplugin import options
from drasil.kubeletplugin.dra.plugin import merged_steps
from drasil.kubeletplugin.options import parse_options
from drasil.kubeletplugin.vendors.registry import BUILT_IN, open_vendors
from drasil.kubeletplugin.vendors.seam import PrepareSteps

NODE = "n1"


def _opts(tmp_path: Path, *flags: str) -> options.PluginOptions:
    return parse_options(
        [f"--node-name={NODE}", f"--plugins-dir={tmp_path / 'plugins'}", *flags], {}
    )


def test_the_registry_names_the_options_vendors() -> None:
    assert tuple(BUILT_IN) == options.VENDORS
    assert options.PARTITION_MODES == AMD_PARTITION_MODES


def test_a_simulated_profile_opens_each_vendor_on_its_entries(tmp_path: Path) -> None:
    opts = _opts(tmp_path, "--backend=simulated", "--simulated-profile=h100-80gb:1,mi300x:2")
    served, vendors = open_vendors(opts)
    assert served.vendors == ("nvidia", "amd")
    assert [v.vendor for v in vendors] == [Vendor.NVIDIA, Vendor.AMD]
    found = {v.vendor: [d.name for d in v.discover(dra=True).devices] for v in vendors}
    assert found == {Vendor.NVIDIA: ["gpu-0"], Vendor.AMD: ["amdgpu-1", "amdgpu-9"]}


def test_an_unknown_model_names_every_vendors_models(tmp_path: Path) -> None:
    opts = _opts(tmp_path, "--backend=simulated", "--simulated-profile=z9000:1")
    with pytest.raises(VendorError, match=r'unknown profile "z9000".*; AMD models: .*mi300x'):
        open_vendors(opts)


def test_auto_with_no_driver_names_where_each_vendor_was_looked_for(tmp_path: Path) -> None:
    opts = _opts(
        tmp_path,
        "--backend=nvml",
        "--vendors=auto",
        f"--proc-root={tmp_path / 'proc'}",
        f"--amd-sysfs-root={tmp_path / 'sys'}",
    )
    with pytest.raises(VendorError, match=r"no GPU driver found: no .*nvidia/version .* amdgpu"):
        open_vendors(opts)


def test_two_vendors_with_one_kind_of_step_are_refused() -> None:
    one = PrepareSteps(modes=object())  # type: ignore[arg-type]
    with pytest.raises(VendorError, match="kind modes"):
        merged_steps([one, one])
    ran: list[str] = []
    merged = merged_steps(
        [
            PrepareSteps(recover=lambda: ran.append("a")),
            PrepareSteps(recover=lambda: ran.append("b")),
        ]
    )
    assert merged.recover is not None
    merged.recover()
    assert ran == ["a", "b"]


# What an AMD-only node's plugin imports on its way to serving: the daemon's modules,
# the vendors opened, the devices discovered and the prepare steps built.
_AMD_ONLY = """
import json, sys
from drasil.kubeletplugin import main  # every module the daemon starts with
from drasil.kubeletplugin.options import parse_options
from drasil.kubeletplugin.vendors.registry import open_vendors
opts, vendors = open_vendors(parse_options(sys.argv[1:], {}))
devices = [d.name for v in vendors for d in v.discover(dra=True).devices]
print(json.dumps({"devices": devices, "modules": sorted(sys.modules)}))
"""


@pytest.mark.parametrize("backend", ["nvml", "simulated"])
def test_an_amd_only_node_loads_no_nvml(tmp_path: Path, backend: str) -> None:
    tree = tmp_path / "sys"
    write_simulated_tree((("mi300x", 1),), tree, node_name=NODE)
    flags = [
        f"--node-name={NODE}",
        f"--plugins-dir={tmp_path / 'plugins'}",
        f"--backend={backend}",
        "--vendors=amd",
        f"--amd-sysfs-root={tree}",
        "--simulated-profile=mi300x:1",
    ]
    done = subprocess.run(
        [sys.executable, "-c", _AMD_ONLY, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    found = json.loads(done.stdout)
    assert found["devices"] == ["amdgpu-1"]
    nvidia = [
        m
        for m in found["modules"]
        if m == "pynvml"
        or m.startswith(("drasil.driver.nvidia", "drasil.kubeletplugin.vendors.nvidia"))
    ]
    assert nvidia == []


def test_an_installed_vendor_is_served_beside_drasils_own(
    tmp_path: Path, third_vendor: Path
) -> None:
    # A vendor from another package (tests/conftest.py), found through its entry point.
    profile = "--simulated-profile=h100-80gb:1,acme-npu:2"
    opts = _opts(tmp_path, "--backend=simulated", profile)
    served, vendors = open_vendors(opts)
    assert served.vendors == ("nvidia", "acme")
    found = [d for v in vendors for d in v.discover(dra=True).devices]
    assert [(d.name, d.type.value, d.vendor.value) for d in found] == [
        ("gpu-0", "gpu", "nvidia"),
        ("acme-0", "acme-npu", "acme"),
        ("acme-1", "acme-npu", "acme"),
    ]
    assert parse_options([f"--node-name={NODE}", "--vendors=nvidia,acme"], {}).vendors == (
        "nvidia",
        "acme",
    )


def test_a_vendor_nobody_installed_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(options.OptionsError, match="--vendors: 'acme' is not"):
        parse_options([f"--node-name={NODE}", "--vendors=acme"], {})


def test_a_vendor_auto_finds_is_opened_as_served(tmp_path: Path) -> None:
    # With --vendors auto, NVIDIA's node must see itself served: its driver root (the
    # driver's files in every spec) is read from the options it was opened with.
    from drasil.kubeletplugin.vendors.nvidia.driverroot import driver_root
    from drasil.kubeletplugin.vendors.nvidia.node import NvidiaNode

    proc = tmp_path / "proc"
    (proc / "driver" / "nvidia").mkdir(parents=True)
    (proc / "driver" / "nvidia" / "version").write_text("NVRM version: 580.95.05\n")
    root = tmp_path / "driver-root"
    root.mkdir()
    opts = _opts(
        tmp_path,
        "--backend=nvml",
        "--vendors=auto",
        f"--proc-root={proc}",
        f"--amd-sysfs-root={tmp_path / 'sys'}",
        f"--nvidia-driver-root={root}",
    )
    served, (nvidia,) = open_vendors(opts)
    assert served.vendors == ("nvidia",)
    assert isinstance(nvidia, NvidiaNode)
    assert nvidia.opts.vendors == ("nvidia",)
    assert driver_root(nvidia.opts) is not None
