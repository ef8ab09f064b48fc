"""NVIDIA's `nvidia-ctk cdi generate` (go-nvml, dlopen) against drasil's mock NVML.

A fake driver root (e2e.harness.driverroot) whose libnvidia-ml is the mock
(e2e.harness.mocknvml): the CDI spec NVIDIA's generator writes in its default (nvml)
mode names the mock's GPUs by index and UUID, and its MIG devices as `<gpu>:<mig index>`
and MIG UUID. go-nvlib reads
the MIG capability files from the host's /proc, so the run happens in a private mount
namespace with the node's fake /proc/driver and /proc/devices bound over the real ones.

No cluster: the e2e harness only builds nvidia-ctk first. Needs root (mknod, ldconfig
-r, mount namespaces).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from e2e.harness import mocknvml, nvidiatoolkit
from e2e.harness.driverroot import build_fake_root

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="fake driver roots and mount namespaces need root"
)

NODE = "node-a"


def test_nvidia_ctk_lists_the_mock_gpus(tmp_path: Path) -> None:
    node = mocknvml.make_mock_node(
        tmp_path / "node", "h100-80gb:1,a100-40gb-mig:1,l4:1", node_name=NODE
    )
    root = build_fake_root(tmp_path / "root", layout="debian", dev_nodes=True, gpus=3)
    nvml = next(p for p in root.libraries if "/libnvidia-ml.so." in p)
    shutil.copyfile(mocknvml.compiled_mock(), root.host(nvml))
    config = tmp_path / "config.toml"
    config.write_text("")
    output = tmp_path / "spec.json"
    ctk = [
        str(nvidiatoolkit.ctk_path()),
        f"--config={config}",
        "cdi",
        "generate",
        f"--driver-root={root.root}",
        f"--dev-root={node.root}",
        f"--nvidia-cdi-hook-path={nvidiatoolkit.cdi_hook_path()}",
        "--format=json",
        f"--output={output}",
    ]
    binds = (
        f"mount --bind {node.proc_root}/driver /proc/driver && "
        f'mount --bind {node.proc_root}/devices /proc/devices && exec "$@"'
    )
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", binds, "sh", *ctk]
    env = {"PATH": nvidiatoolkit.DEFAULT_PATH, "HOME": str(tmp_path), "LANG": "C", **node.env()}
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    spec = json.loads(output.read_text())
    nodes = {
        d["name"]: [n["path"] for n in d["containerEdits"].get("deviceNodes", [])]
        for d in spec["devices"]
    }
    gpus = node.gpus
    want: dict[str, list[str]] = {}
    for gpu in gpus:
        if gpu.migs:
            for slot, mig in enumerate(sorted(gpu.migs, key=lambda m: m.instance.gpu_instance_id)):
                want[f"{gpu.index}:{slot}"] = [f"/dev/nvidia{gpu.minor}"]
                want[mig.uuid] = [f"/dev/nvidia{gpu.minor}"]
        else:
            want[str(gpu.index)] = [f"/dev/nvidia{gpu.minor}"]
            want[gpu.uuid] = [f"/dev/nvidia{gpu.minor}"]
    want["all"] = [f"/dev/nvidia{gpu.minor}" for gpu in gpus]
    assert nodes == want
    assert "libnvidia-ml.so" in done.stderr  # it loaded the root's library, the mock
