"""A mock NVML of our own: `libnvidia-ml.so.1` serving the simulated backend's GPUs.

`compiled_mock()` builds `mock_nvml.c` with the system C compiler into a real shared
object (SONAME `libnvidia-ml.so.1`) that NVIDIA's Python binding (pynvml), drasil's
`PynvmlLibrary` and NVIDIA's Go tools (go-nvml, dlopen) use as they would the real
library. It serves the GPUs `drasil.driver.simulated.gpus.simulated_gpus` makes of a
profile spec and node name, with the same answers, MIG tables and MIG state, so that
`discover()` over `PynvmlLibrary` + mock equals `discover()` over `FakeNvml`.

`make_mock_node(root, profile, node_name=...)` lays out one node under `root`: the config
(`mocknvml.conf`), the device nodes (`dev/nvidia<minor>`, nvidiactl, nvidia-uvm,
nvidia-uvm-tools), a fake `/proc` for MIG device nodes (`proc/`), a boot id file
(`boot_id`), an empty events file (`nvml-events`) and the path of the GPU state file
(`gpu-state.json`, made on the first MIG change). A process points the library at a node
with `MockNode.env()` (`DRASIL_MOCK_NVML_CONFIG`); the library re-reads the config on
every 0 -> 1 init, so one process (which can only ever hold one `libnvidia-ml.so.1`)
switches nodes between init/shutdown pairs. Without the variable the library reads the
config embedded at build time (`compiled_mock(embedded_config=...)`, `install_mock`, for
a copy inside a container), else it has no GPUs.

What a process sees is what real NVML shows it: the GPUs whose `<dev root>/nvidia<minor>`
exists, and of those the MIG devices whose two capability nodes
(`<dev root>/nvidia-caps/nvidia-cap<N>`, N as `mig_cap_minor` numbers them) exist, where
the dev root is a container's `/dev` (the config's dev root is absent there) or has an
`nvidia-caps` folder; a node's dev root without one stands for a host, where root reaches
every MIG device. Indices count what is visible, as NVML's do inside a container.

Config format (`config_text`): one record per line, `<key> <value>`, `#` comments; the
value is the rest of the line. Global keys: `driver_version`, `cuda_version` (NVML's
encoding, 13000), `state_file`, `events_file`, `dev_root`, `boot_id_file` (`-` for
none). `gpu <uuid>` starts a GPU; the keys after it are that GPU's: `name`, `minor`,
`bus_id` (NVML's `00000000:3B:00.0`), `pci_device_id`, `memory_mib`, `numa_node` (-1:
none), `brand`, `architecture`, `compute_capability <major> <minor>`, `mig <capable 0|1>
<max MIG devices> <MIG mode at start 0|1>`, `events_supported 0|1`, `busy 0|1` (every MIG
mode change answers IN_USE in activationStatus), `profile <index> <id> <compute slices>
<instances> <SMs> <copy engines> <decoders> <encoders> <JPEG> <OFA> <MiB> <name>` (index
is NVML_GPU_INSTANCE_PROFILE_*, the name carries the "MIG " prefix), `placement <profile
id> <start> <size> <GPU instance id>`, `mig_uuid <GPU instance id> <compute instance id>
<uuid>` (every possible GPU instance, compute instance 0), `layout <GPU instance id>
<profile id> <start> <size> <compute instance bit mask>` (the initial layout).

State: MIG mode and instances, time slice and compute mode live in the simulated
backend's state file (see `drasil.driver.simulated.gpustate`), read when it changed
and written atomically under flock on `<file>.lock`; keys the library does not manage
are kept. It adds one key of its own, `migPending`, only while an Ampere GPU's pending
MIG mode differs from the current one (the simulated backend ignores it); a "reboot"
(`reboot(node)`: a new boot id) applies the pending mode and drops the instances.

Events file: lines appended under flock: `xid <uuid> <xid> <gi> <ci>` (`inject_xid`) and
`lost <uuid>` (`lose_gpu`: the GPU answers GPU_IS_LOST from then on, and event sets
registered for it return GPU_IS_LOST once). An event set sees the lines appended after
it was created.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shlex
import shutil
import stat
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from drasil.driver.nvidia.nvml import NO_INSTANCE
from drasil.driver.simulated.gpucatalog import (
    PROFILE_ID_1G,
    PROFILE_ID_1G_DOUBLE_MEMORY,
    PROFILE_ID_1G_ME,
    PROFILE_ID_2G,
    PROFILE_ID_3G,
    PROFILE_ID_4G,
    PROFILE_ID_7G,
    gpu_instance_id_at,
)
from drasil.driver.simulated.gpus import (
    CUDA_DRIVER_VERSION,
    DRIVER_VERSION,
    FakeGpu,
    mig_uuid,
    simulated_gpus,
)
from e2e.harness import paths
from e2e.harness.cbuild import cached_build, compile_c, compiler

SOURCES = Path(__file__).resolve().parent
C_SOURCES = ("mock_nvml.c", "nvml_types.h")
CONFIG_ENV = "DRASIL_MOCK_NVML_CONFIG"
SONAME = "libnvidia-ml.so.1"

# NVML_GPU_INSTANCE_PROFILE_* (the index nvmlDeviceGetGpuInstanceProfileInfo takes) of
# each profile id of the catalogue: 1_SLICE 0, 2_SLICE 1, 3_SLICE 2, 4_SLICE 3, 7_SLICE 4,
# 1_SLICE_REV1 (+me) 7, 1_SLICE_REV2 (double memory) 9.
PROFILE_INDEX = {
    PROFILE_ID_1G: 0,
    PROFILE_ID_2G: 1,
    PROFILE_ID_3G: 2,
    PROFILE_ID_4G: 3,
    PROFILE_ID_7G: 4,
    PROFILE_ID_1G_ME: 7,
    PROFILE_ID_1G_DOUBLE_MEMORY: 9,
}

# PCI device ids (nvmlPciInfo_t.pciDeviceId: device << 16 | vendor 0x10de) of the
# catalogue's boards (the SXM parts); 0 for a board not listed.
PCI_DEVICE_IDS = {
    "NVIDIA A100-SXM4-40GB": 0x20B010DE,
    "NVIDIA A100-SXM4-80GB": 0x20B210DE,
    "NVIDIA H100 80GB HBM3": 0x233010DE,
    "NVIDIA H200": 0x233510DE,
    "NVIDIA B200": 0x290110DE,
    "NVIDIA L4": 0x27B810DE,
}

# Device nodes: NVIDIA's fixed major 195; nvidia-uvm's and nvidia-caps' majors are
# dynamic on a real host (these are what /proc/devices says here).
NVIDIA_MAJOR = 195
UVM_MAJOR = 510
CAPS_MAJOR = 511
CONTROL_NODES = {
    "nvidiactl": (NVIDIA_MAJOR, 255),
    "nvidia-uvm": (UVM_MAJOR, 0),
    "nvidia-uvm-tools": (UVM_MAJOR, 1),
}
# /proc/driver/nvidia-caps/mig-minors: config 1, monitor 2, then per GPU every GPU
# instance id 0..14, each followed by its compute instances 0..7 (9 minors per GPU
# instance, 135 per GPU), as the driver numbers them.
GPU_INSTANCE_IDS = 15
COMPUTE_INSTANCE_IDS = 8
CAPS_PER_GPU = GPU_INSTANCE_IDS * (1 + COMPUTE_INSTANCE_IDS)
CAP_MODE = 0o444  # DeviceFileMode: 292


class MockNvmlError(RuntimeError):
    """The mock could not be built or loaded."""


@dataclass(frozen=True)
class MockNode:
    """One simulated node served by the mock: everything lives under `root`."""

    profile: str
    node_name: str
    root: Path
    state_path: Path | None = None
    events_unsupported: tuple[int, ...] = ()
    busy: tuple[int, ...] = ()

    @property
    def config_path(self) -> Path:
        return self.root / "mocknvml.conf"

    @property
    def state_file(self) -> Path:
        return self.state_path if self.state_path is not None else self.root / "gpu-state.json"

    @property
    def events_file(self) -> Path:
        return self.root / "nvml-events"

    @property
    def dev_root(self) -> Path:
        return self.root / "dev"

    @property
    def proc_root(self) -> Path:
        return self.root / "proc"

    @property
    def boot_id_file(self) -> Path:
        return self.root / "boot_id"

    @property
    def gpus(self) -> list[FakeGpu]:
        return simulated_gpus(self.profile, node_name=self.node_name)

    def boot_id(self) -> str:
        """The node's current boot id (what `FakeNvml(boot_id=...)` should read)."""
        return self.boot_id_file.read_text(encoding="ascii").strip()

    def env(self) -> dict[str, str]:
        return {CONFIG_ENV: str(self.config_path)}


def _line(key: str, value: object) -> str:
    text = str(value)
    if "\n" in text:
        raise ValueError(f"a config value cannot hold a newline: {key} {text!r}")
    return f"{key} {text}\n"


def _gpu_config(gpu: FakeGpu, *, events: bool, busy: bool) -> str:
    model = gpu.model
    out = [
        _line("gpu", gpu.uuid),
        _line("name", model.product_name),
        _line("minor", gpu.minor),
        _line("bus_id", gpu.pci_bus_id),
        _line("pci_device_id", f"0x{PCI_DEVICE_IDS.get(model.product_name, 0):08X}"),
        _line("memory_mib", model.memory_mib),
        _line("numa_node", gpu.numa_node),
        _line("brand", model.brand),
        _line("architecture", model.architecture),
        _line("compute_capability", f"{model.compute_capability[0]} {model.compute_capability[1]}"),
        _line("mig", f"{int(model.mig_capable)} {model.max_mig_devices} {int(model.mig_enabled)}"),
        _line("events_supported", int(events)),
        _line("busy", int(busy)),
    ]
    for p in model.mig_profiles:
        index = PROFILE_INDEX.get(p.profile_id)
        if index is None:
            raise ValueError(f"{model.product_name} {p.name}: no NVML profile index known")
        fields = (
            index,
            p.profile_id,
            p.gpu_slices,
            p.instance_count,
            p.multiprocessors,
            p.copy_engines,
            p.decoders,
            p.encoders,
            p.jpeg_engines,
            p.ofa_engines,
            p.memory_mib,
        )
        out.append(_line("profile", " ".join(str(f) for f in fields) + f" MIG {p.name}"))
    gi_ids: set[int] = set()
    for p in model.mig_profiles:
        for pl in p.placements:
            gi = gpu_instance_id_at(pl)
            gi_ids.add(gi)
            out.append(_line("placement", f"{p.profile_id} {pl.start} {pl.size} {gi}"))
    initial = {m.instance.gpu_instance_id: m for m in gpu.migs}
    for gi in sorted(gi_ids | set(initial)):
        mig = initial.get(gi)
        if mig is not None and mig.instance.compute_instance_id == 0:
            out.append(_line("mig_uuid", f"{gi} 0 {mig.uuid}"))
        else:
            out.append(_line("mig_uuid", f"{gi} 0 {mig_uuid(gpu.node_name, gpu.index, gi, 0)}"))
    for m in gpu.migs:
        inst = m.instance
        if inst.compute_instance_id != 0:
            out.append(
                _line("mig_uuid", f"{inst.gpu_instance_id} {inst.compute_instance_id} {m.uuid}")
            )
        pl = inst.placement
        cis = 1 << inst.compute_instance_id
        out.append(
            _line(
                "layout",
                f"{inst.gpu_instance_id} {inst.profile.profile_id} {pl.start} {pl.size} {cis}",
            )
        )
    return "".join(out)


def config_text(node: MockNode) -> str:
    """The mock's config for `node` (format: the module docstring)."""
    gpus = node.gpus
    for index in (*node.events_unsupported, *node.busy):
        if not 0 <= index < len(gpus):
            raise ValueError(
                f"GPU index {index} is not one of the {len(gpus)} GPUs of {node.profile}"
            )
    head = [
        f"# drasil mock NVML: {node.profile} on {node.node_name}\n",
        _line("driver_version", DRIVER_VERSION),
        _line("cuda_version", CUDA_DRIVER_VERSION),
        _line("state_file", node.state_file),
        _line("events_file", node.events_file),
        _line("dev_root", node.dev_root),
        _line("boot_id_file", node.boot_id_file),
    ]
    body = [
        _gpu_config(
            gpu, events=gpu.index not in node.events_unsupported, busy=gpu.index in node.busy
        )
        for gpu in gpus
    ]
    return "".join(head + body)


def make_mock_node(
    root: Path,
    profile: str,
    *,
    node_name: str,
    state_file: Path | None = None,
    events_unsupported: Sequence[int] = (),
    busy: Sequence[int] = (),
    dev_nodes: bool = True,
) -> MockNode:
    """Lay out a node under `root` (see the module docstring) and return it. With
    `dev_nodes` False no GPU device node is made, so the mock sees no GPU until the
    test makes some (`make_dev_nodes`)."""
    root.mkdir(parents=True, exist_ok=True)
    node = MockNode(
        profile=profile,
        node_name=node_name,
        root=root.resolve(),
        state_path=state_file,
        events_unsupported=tuple(events_unsupported),
        busy=tuple(busy),
    )
    gpus = node.gpus
    node.config_path.write_text(config_text(node))
    node.dev_root.mkdir(exist_ok=True)
    if dev_nodes:
        make_dev_nodes(node.dev_root, gpus)
    write_fake_proc(node.proc_root, gpus)
    if not node.boot_id_file.exists():
        node.boot_id_file.write_text(f"{uuid.uuid4()}\n")
    node.events_file.touch()
    return node


def reboot(node: MockNode) -> str:
    """Give the node a new boot id (the mock and `FakeNvml` then drop MIG instances)."""
    boot_id = str(uuid.uuid4())
    paths.write_atomic(node.boot_id_file, f"{boot_id}\n")
    return boot_id


def _append_event(events_file: Path, line: str) -> None:
    with events_file.open("a", encoding="ascii") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            f.write(line)
            f.flush()
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def inject_xid(
    events_file: Path,
    gpu_uuid: str,
    xid: int,
    gpu_instance_id: int = NO_INSTANCE,
    compute_instance_id: int = NO_INSTANCE,
) -> None:
    """Deliver an XID critical error of the GPU (or of one of its MIG devices) to every
    event set registered for it."""
    if not gpu_uuid.startswith("GPU-") or any(c.isspace() for c in gpu_uuid):
        raise ValueError(f"not a GPU UUID: {gpu_uuid!r}")
    _append_event(events_file, f"xid {gpu_uuid} {xid} {gpu_instance_id} {compute_instance_id}\n")


def lose_gpu(events_file: Path, gpu_uuid: str) -> None:
    """Make the GPU fall off the bus: its calls answer GPU_IS_LOST from now on."""
    if not gpu_uuid.startswith("GPU-") or any(c.isspace() for c in gpu_uuid):
        raise ValueError(f"not a GPU UUID: {gpu_uuid!r}")
    _append_event(events_file, f"lost {gpu_uuid}\n")


def _mknod_or_file(path: Path, major: int, minor: int) -> None:
    path.unlink(missing_ok=True)
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
    except PermissionError:
        path.touch()  # no CAP_MKNOD: NVML only checks that the node exists
    path.chmod(0o666)


def make_dev_nodes(dev_root: Path, gpus: Sequence[FakeGpu]) -> tuple[Path, ...]:
    """`nvidia<minor>` for every GPU (char 195:minor) plus nvidiactl, nvidia-uvm and
    nvidia-uvm-tools under `dev_root`; regular empty files where mknod is refused."""
    dev_root.mkdir(parents=True, exist_ok=True)
    nodes = dict(CONTROL_NODES)
    nodes.update({f"nvidia{gpu.minor}": (NVIDIA_MAJOR, gpu.minor) for gpu in gpus})
    made = []
    for name, (major, minor) in sorted(nodes.items()):
        _mknod_or_file(dev_root / name, major, minor)
        made.append(dev_root / name)
    return tuple(made)


def mig_cap_minor(gpu_minor: int, gpu_instance_id: int, compute_instance_id: int | None) -> int:
    """The nvidia-caps minor of a GPU instance (`compute_instance_id` None) or compute
    instance, as `/proc/driver/nvidia-caps/mig-minors` lists it."""
    base = 3 + gpu_minor * CAPS_PER_GPU + gpu_instance_id * (1 + COMPUTE_INSTANCE_IDS)
    return base if compute_instance_id is None else base + 1 + compute_instance_id


def _access(minor: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {CAP_MODE}\nDeviceFileModify: 1\n"


def write_fake_proc(proc_root: Path, gpus: Sequence[FakeGpu]) -> None:
    """`driver/nvidia-caps/mig-minors`, `devices` and `driver/nvidia/capabilities/gpu<m>/
    mig/gi<g>[/ci<c>]/access` under `proc_root` for every possible instance of every
    MIG-capable GPU."""
    minors = ["config 1", "monitor 2"]
    caps = proc_root / "driver" / "nvidia" / "capabilities"
    for gpu in gpus:
        if not gpu.model.mig_capable:
            continue
        for gi in range(GPU_INSTANCE_IDS):
            gi_minor = mig_cap_minor(gpu.minor, gi, None)
            minors.append(f"gpu{gpu.minor}/gi{gi}/access {gi_minor}")
            gi_dir = caps / f"gpu{gpu.minor}" / "mig" / f"gi{gi}"
            gi_dir.mkdir(parents=True, exist_ok=True)
            (gi_dir / "access").write_text(_access(gi_minor))
            for ci in range(COMPUTE_INSTANCE_IDS):
                ci_minor = mig_cap_minor(gpu.minor, gi, ci)
                minors.append(f"gpu{gpu.minor}/gi{gi}/ci{ci}/access {ci_minor}")
                (gi_dir / f"ci{ci}").mkdir(exist_ok=True)
                (gi_dir / f"ci{ci}" / "access").write_text(_access(ci_minor))
    mig_minors = proc_root / "driver" / "nvidia-caps" / "mig-minors"
    mig_minors.parent.mkdir(parents=True, exist_ok=True)
    mig_minors.write_text("\n".join(minors) + "\n")
    (proc_root / "devices").write_text(
        "Character devices:\n"
        "  1 mem\n"
        "  4 /dev/vc/0\n"
        f"{NVIDIA_MAJOR} nvidia\n"
        f"{NVIDIA_MAJOR} nvidia-modeset\n"
        f"{UVM_MAJOR} nvidia-uvm\n"
        f"{CAPS_MAJOR} nvidia-caps\n"
        "\n"
        "Block devices:\n"
        "  7 loop\n"
        "  8 sd\n"
    )


# -- building and loading -------------------------------------------------------------------


def _embedded_source(config: str) -> str:
    data = config.encode()
    escaped = [f"\\{b:03o}" if b in b'"\\?' or not 32 <= b < 127 else chr(b) for b in data]
    # One literal per line keeps the generated file readable (split between characters,
    # never inside an escape).
    chunks = ["".join(escaped[i : i + 96]) for i in range(0, len(escaped), 96)] or [""]
    body = "\n".join(f'    "{chunk}"' for chunk in chunks)
    head = "/* Generated by e2e.harness.mocknvml.compiled_mock. */\n"
    return f"{head}const char mock_nvml_embedded_config[] =\n{body};\n"


def _flags() -> list[str]:
    return ["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-pthread", f"-Wl,-soname,{SONAME}"]


def _cache_key() -> str:
    h = hashlib.sha256()
    h.update(f"{compiler()}\0{shlex.join(_flags())}\0".encode())
    for name in C_SOURCES:
        h.update(name.encode() + b"\0" + (SOURCES / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _build(work: Path, embedded_config: str) -> Path:
    embedded = work / "embedded_config.c"
    embedded.write_text(_embedded_source(embedded_config))
    cmd = [
        compiler(),
        *_flags(),
        f"-I{SOURCES}",
        "-o",
        str(work / SONAME),
        str(SOURCES / "mock_nvml.c"),
        str(embedded),
    ]
    compile_c(cmd, error=MockNvmlError)
    embedded.unlink()
    return work / SONAME


def _build_plain(work: Path) -> None:
    _build(work, "")


def compiled_mock(embedded_config: str | None = None, *, dest: Path | None = None) -> Path:
    """The path of a compiled `libnvidia-ml.so.1`.

    Without `embedded_config`: built on first use into `<cache>/e2e/mocknvml/<key>/`.
    With one (the config it falls back to without the environment, a node's paths
    in it): built into the folder `dest`, never the cache, which would grow by one
    library per test node.
    """
    if embedded_config is None:
        target = paths.e2e_root() / "mocknvml" / _cache_key()
        return cached_build(target, _build_plain) / SONAME
    if dest is None:
        raise ValueError("compiled_mock: an embedded config needs a dest folder")
    dest.mkdir(parents=True, exist_ok=True)
    return _build(dest, embedded_config)


def install_mock(target: Path, node: MockNode) -> Path:
    """Put the mock, with `node`'s config embedded, at `target` (a driver root's
    `libnvidia-ml.so.<version>`, replaced): a process that has no environment of ours,
    such as a container given the file by a CDI spec, finds the node's GPUs. There the
    node's dev root is absent, so the mock looks at the container's own /dev: it lists
    the GPUs and MIG devices whose device nodes the container was given. Built in
    `<node root>/build`. Returns `target`."""
    mock = compiled_mock(embedded_config=config_text(node), dest=node.root / "build")
    target.unlink(missing_ok=True)
    shutil.copyfile(mock, target)
    target.chmod(0o755)
    return target


def loaded_nvml_libraries() -> list[Path]:
    """The files of every libnvidia-ml this process has mapped (/proc/self/maps)."""
    found: list[Path] = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) == 6 and "libnvidia-ml" in Path(parts[5].strip()).name:
                path = Path(parts[5].strip())
                if path not in found:
                    found.append(path)
    return found


def preload(path: Path) -> ctypes.CDLL:
    """Load the mock into this process with RTLD_GLOBAL, so pynvml's later
    `CDLL("libnvidia-ml.so.1")` gets it. Raises MockNvmlError when another
    libnvidia-ml is already loaded (a process can only ever hold one)."""
    wanted = path.resolve()
    others = [p for p in loaded_nvml_libraries() if p.resolve() != wanted]
    if others:
        raise MockNvmlError(
            f"another libnvidia-ml is loaded in this process ({', '.join(map(str, others))}); "
            f"cannot load the mock {path}"
        )
    return ctypes.CDLL(str(wanted), mode=ctypes.RTLD_GLOBAL)


def init_count(lib: ctypes.CDLL) -> int:
    """The mock's NVML init count (its test hook mockNvmlInitCount)."""
    fn = lib.mockNvmlInitCount
    fn.restype = ctypes.c_int
    return int(fn())


def reset(lib: ctypes.CDLL) -> None:
    """Forget the mock's init count and state (its test hook mockNvmlReset)."""
    lib.mockNvmlReset()


__all__ = [
    "CONFIG_ENV",
    "MockNode",
    "MockNvmlError",
    "compiled_mock",
    "config_text",
    "init_count",
    "inject_xid",
    "install_mock",
    "lose_gpu",
    "make_dev_nodes",
    "make_mock_node",
    "mig_cap_minor",
    "preload",
    "reboot",
    "reset",
    "write_fake_proc",
]
