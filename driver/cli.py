"""The ``drasil`` command (also ``kubectl drasil``): inspect what the driver would do."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from drasil.api.documents import ConfigError, load_documents
from drasil.api.limits import MAX_FILE_BYTES, allow_nesting
from drasil.driver.amd.partitions import PARTITION_MODES
from drasil.driver.claims.configcheck import validate_config_document
from drasil.driver.devices import CapacityPolicy, Device, VendorError, Version
from drasil.driver.discovery.backends import BACKENDS, discover_node, open_backends
from drasil.driver.explain.claims import render_table
from drasil.driver.explain.fromapi import ClaimNotFound, explain_from_api
from drasil.driver.health import FAULT_FILE, read_faults, write_faults
from drasil.driver.kubeapi import (
    InvalidName,
    KubeApi,
    KubeconfigError,
    checked_name,
    load_user_api_client,
)
from drasil.driver.nvidia import migration, nvidiadra
from drasil.driver.nvidia.driverfiles import DriverRoot, load_nvml
from drasil.driver.nvidia.nodecheck import check_device_nodes, check_driver, check_hook, report
from drasil.driver.nvidia.nodedevices import GPU_SHARING, MIG_MODES
from drasil.driver.nvidia.nvml import NvmlError, NvmlLibrary
from drasil.driver.nvidia.partitions import ExistingMig, existing_mig_instances
from drasil.driver.simulated.gpus import ProfileSpecError
from drasil.driver.slices.build import build_slices, quantity

DEFAULT_DRIVER = "gpu.drasil.dev"
DESCRIPTION = "The drasil command (also kubectl drasil): inspect what the driver would do."
OUTPUTS = ("table", "json", "yaml")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="drasil", description=DESCRIPTION)
    # The installed distribution's version: what an image or a venv actually holds.
    version = importlib.metadata.version("drasil")
    p.add_argument("--version", action="version", version=f"drasil {version}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("discover", help="list this node's devices and the ResourceSlices")
    d.add_argument("--backend", choices=BACKENDS, default="nvml")
    d.add_argument(
        "--profile", default="h100-80gb:8", help="simulated GPUs, e.g. l4:2 or mi300x:8,h100-80gb:2"
    )
    d.add_argument(
        "--vendors",
        default="nvidia",
        help="with --backend nvml: nvidia, amd, nvidia,amd or auto (--backend simulated: "
        "from the profile)",
    )
    d.add_argument("--amd-sysfs-root", default="/sys", help="where amdgpu's sysfs tree is read")
    d.add_argument("--node-name", required=True, help="the node (and pool) name")
    d.add_argument("--driver-name", default=DEFAULT_DRIVER)
    d.add_argument("-o", "--output", choices=OUTPUTS, default="table")
    d.add_argument(
        "--mig-mode",
        choices=MIG_MODES,
        default="static",
        help="static: publish existing MIG devices; dynamic: every placement, with counters",
    )
    d.add_argument(
        "--gpu-sharing",
        choices=GPU_SHARING,
        default="exclusive",
        help="exclusive: one claim per GPU; consumable: GPUs shared by memory and compute",
    )
    d.add_argument(
        "--amd-partition-mode",
        choices=PARTITION_MODES,
        default="static",
        help="static: AMD GPUs in their current partition mode; dynamic: every partition, "
        "with counters",
    )
    d.add_argument(
        "--simulated-state",
        type=Path,
        help="the simulated GPUs' MIG state file (the plugin's simulated-gpus.json)",
    )
    v = sub.add_parser("validate-config", help="check an opaque config or objects holding one")
    v.add_argument(
        "file",
        help="a GpuConfig/MigDeviceConfig, or ResourceClaim(Template)/"
        "DeviceClass YAML; - for standard input",
    )
    v.add_argument("--driver-name", default=DEFAULT_DRIVER)
    e = sub.add_parser("explain", help="why a ResourceClaim is (not) satisfiable")
    e.add_argument("claim", help="CLAIM or NAMESPACE/CLAIM")
    e.add_argument("-n", "--namespace", default="default")
    e.add_argument("--kubeconfig", help="default: $KUBECONFIG, then ~/.kube/config")
    e.add_argument("--driver-name", default=DEFAULT_DRIVER)
    f = sub.add_parser("fault", help="mark a device unhealthy by hand, or mend it")
    f.add_argument("action", choices=("inject", "clear", "list"))
    f.add_argument("device", nargs="?", help="device name, e.g. gpu-3 (clear: all if omitted)")
    f.add_argument("--message", default="fault injected with drasil fault inject")
    f.add_argument("--plugins-dir", default="/var/lib/kubelet/plugins")
    f.add_argument("--driver-name", default=DEFAULT_DRIVER)
    _doctor_parser(sub)
    m = sub.add_parser(
        "migrate",
        help="what moves from NVIDIA's device plugin or DRA driver to drasil (read-only)",
    )
    m.add_argument("action", choices=("check",))
    m.add_argument(
        "--from",
        dest="source",
        choices=MIGRATE_SOURCES,
        default="device-plugin",
        help="device-plugin: NVIDIA's device plugin; nvidia-dra: NVIDIA's DRA driver "
        "(to drasil with compatibility: nvidia-dra)",
    )
    m.add_argument("--kubeconfig", help="default: $KUBECONFIG, then ~/.kube/config")
    m.add_argument(
        "-f", "--values", help="the chart values you will install (default: the chart's)"
    )
    m.add_argument(
        "--pool-label",
        default="node.kubernetes.io/instance-type",
        help="the node label that names a node pool (--from device-plugin)",
    )
    return p


def _doctor_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Defaults from the plugin container's env, so `kubectl exec <plugin pod> -- drasil
    # doctor` checks what the plugin uses.
    env = os.environ
    doc = sub.add_parser(
        "doctor",
        help="is this node ready to give containers a real GPU? (driver files, hook, devices)",
    )
    doc.add_argument("--backend", choices=BACKENDS, default=env.get("BACKEND", "nvml"))
    doc.add_argument("--nvidia-driver-root", default=env.get("NVIDIA_DRIVER_ROOT") or "/")
    doc.add_argument(
        "--container-driver-root",
        default=env.get("CONTAINER_DRIVER_ROOT"),
        help="where this process sees the driver root (default: the same path)",
    )
    doc.add_argument("--nvidia-cdi-hook-path", default=env.get("NVIDIA_CDI_HOOK_PATH"))
    doc.add_argument(
        "--cdi-hooks", choices=("enabled", "disabled"), default=env.get("CDI_HOOKS", "enabled")
    )
    doc.add_argument("--plugins-dir", default="/var/lib/kubelet/plugins")
    doc.add_argument("--driver-name", default=env.get("DRIVER_NAME", DEFAULT_DRIVER))


def _doctor(args: argparse.Namespace, out: TextIO) -> int:
    local = Path(args.container_driver_root or args.nvidia_driver_root)
    root = DriverRoot(host=args.nvidia_driver_root, local=local)
    nvml_version = None
    nodes: list[str] = []
    if args.backend == "nvml":
        load_nvml(root)  # the root's NVML, not whatever the loader's path finds first
        lib = open_backends("nvml", vendors=["nvidia"], profile="", node_name="doctor").nvml
        lib.init()
        try:
            nvml_version = lib.system_driver_version()
            nodes = [*lib.control_device_nodes()]
            nodes += [n for i in range(lib.device_count()) for n in _gpu_nodes(lib, i)]
        finally:
            lib.shutdown()
    checks = check_driver(root, nvml_version=nvml_version)
    installed = Path(args.plugins_dir) / args.driver_name / "nvidia-cdi-hook"
    hook = args.nvidia_cdi_hook_path or (str(installed) if installed.is_file() else None)
    checks.append(
        check_hook(hook, enabled=args.cdi_hooks == "enabled", local=lambda p: _seen(p, root))
    )
    if args.backend == "nvml":
        checks.append(check_device_nodes(nodes))
    out.write(report(checks) + "\n")
    return 0 if all(c.ok for c in checks) else 1


def _gpu_nodes(lib: NvmlLibrary, index: int) -> tuple[str, ...]:
    return lib.device_nodes(lib.device_minor_number(lib.device_handle_by_index(index)))


def _seen(host_path: str, root: DriverRoot) -> Path | None:
    """Where this process sees a host path: under the driver root's view, or as is."""
    path = Path(host_path)
    if path.is_relative_to(root.host) and root.local != Path(root.host):
        return root.local / path.relative_to(root.host)
    return path


def _attribute_text(value: object) -> str:
    return value.value if isinstance(value, Version) else str(value)


def _device_row(device: Device, *, shared_column: bool) -> list[str]:
    memory = device.capacity.get("memory", 0) / 2**30
    row = [
        device.name,
        str(device.type),
        _attribute_text(device.attributes.get("productName", "")),
        f"{memory:g}Gi",
    ]
    if shared_column:
        row.append("yes" if device.allow_multiple_allocations else "")
    return [*row, device.uuid, device.parent_uuid or ""]


def _policy_text(name: str, policy: CapacityPolicy) -> str:
    top = "the capacity" if policy.maximum is None else quantity(policy.maximum)
    step = f" in steps of {quantity(policy.step)}" if policy.step is not None else ""
    return f"{name} {quantity(policy.minimum)} to {top}{step} (default {quantity(policy.default)})"


def _sharing_notes(devices: Sequence[Device]) -> list[str]:
    """One line per distinct set of request policies, naming its devices."""
    groups: dict[str, list[str]] = {}
    for device in devices:
        if device.allow_multiple_allocations:
            policies = device.capacity_policies
            text = ", ".join(_policy_text(n, policies[n]) for n in sorted(policies))
            groups.setdefault(text, []).append(device.name)
    return [f"shared by capacity: {', '.join(names)}: {text}" for text, names in groups.items()]


def _print_table(rows: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        out.write("\n")


def _print_devices(devices: Sequence[Device], out: TextIO) -> None:
    # The SHARED column appears only with shareable devices, so exclusive output is
    # what scripts parsing it have always seen.
    shared = any(d.allow_multiple_allocations for d in devices)
    header = ["NAME", "TYPE", "PRODUCT", "MEMORY", *(["SHARED"] if shared else []), "UUID"]
    rows = [_device_row(d, shared_column=shared) for d in devices]
    _print_table([[*header, "PARENT"], *rows], out)


def _discover(args: argparse.Namespace, out: TextIO) -> int:
    # Simulated AMD GPUs are a sysfs tree: a fresh one per run (they hold no state here).
    with tempfile.TemporaryDirectory(prefix="drasil-amd-") as amd_root:
        backends = open_backends(
            args.backend,
            vendors=args.vendors.split(","),
            profile=args.profile,
            node_name=args.node_name,
            state_file=args.simulated_state,
            simulated_amd_root=Path(amd_root),
            amd_sysfs_root=Path(args.amd_sysfs_root),
        )
        result = discover_node(
            backends.nvml,
            backends.amd_sysfs,
            node_name=args.node_name,
            mig_mode=args.mig_mode,
            gpu_sharing=args.gpu_sharing,
            amd_partition_mode=args.amd_partition_mode,
        )
    for skipped in result.skipped:
        print(f"warning: device skipped: {skipped}", file=sys.stderr)
    slices = build_slices(
        driver=args.driver_name,
        pool=args.node_name,
        devices=result.devices,
        node_name=args.node_name,
        counter_sets=result.counter_sets,
        generation=1,
        owner=None,
    )
    if args.output == "json":
        json.dump(slices, out, indent=2)
        out.write("\n")
    elif args.output == "yaml":
        yaml.safe_dump_all(slices, out, sort_keys=False)
    else:
        _print_devices(result.devices, out)
        drivers = "; ".join((f"driver {args.driver_name}", *result.drivers))
        out.write(
            f"\n{len(result.devices)} devices in {len(slices)} ResourceSlice(s) of pool "
            f"{args.node_name} ({drivers})\n"
        )
        for note in _sharing_notes(result.devices):
            out.write(note + "\n")
        _print_mig_instances(_mig_instances(backends.nvml), out)
    return 0


def _mig_instances(lib: NvmlLibrary) -> list[ExistingMig]:
    lib.init()
    try:
        return existing_mig_instances(lib)
    finally:
        lib.shutdown()


def _print_mig_instances(instances: Sequence[ExistingMig], out: TextIO) -> None:
    """The MIG instances that exist, one line each (after the table, only if any)."""
    if instances:
        out.write(f"\n{len(instances)} MIG instance(s):\n")
    for instance in instances:
        out.write(instance.line() + "\n")


def _read_limited(name: str) -> bytes:
    """The file's bytes (``-``: standard input), one past ``MAX_FILE_BYTES`` at most:
    enough for the check to say "too large" without reading a huge file whole."""
    if name == "-":
        return sys.stdin.buffer.read(MAX_FILE_BYTES + 1)
    with Path(name).open("rb") as f:
        return f.read(MAX_FILE_BYTES + 1)


def _validate_config(args: argparse.Namespace, out: TextIO) -> int:
    # Bytes: validate_config_document reports text that is not UTF-8 as a problem.
    problems = validate_config_document(_read_limited(args.file), driver=args.driver_name)
    for problem in problems:
        print(f"{args.file}: {problem}", file=sys.stderr)
    if problems:
        return 1
    out.write(f"{args.file}: valid\n")
    return 0


def _explain(args: argparse.Namespace, out: TextIO) -> int:
    namespace, _, name = args.claim.rpartition("/")
    namespace = namespace or args.namespace
    try:  # before any connection: "ns/" or "a/b/c" is a typo, not a network problem
        checked_name(namespace, what="namespace", label=True)
        checked_name(name, what="claim name")
    except InvalidName as err:
        print(f"drasil explain: {err}", file=sys.stderr)
        return 2
    # A person at a terminal: their kubeconfig, never the in-cluster account.
    api = KubeApi(load_user_api_client(args.kubeconfig))
    try:
        explanation = explain_from_api(api, namespace=namespace, name=name, driver=args.driver_name)
    except ClaimNotFound as err:
        print(f"drasil explain: {err}", file=sys.stderr)
        return 1
    out.write(render_table(explanation))
    out.write("\n")
    return 0


def _fault(args: argparse.Namespace, out: TextIO) -> int:
    path = Path(args.plugins_dir) / args.driver_name / FAULT_FILE
    faults = read_faults(path)
    if args.action == "inject":
        if not args.device:
            print("drasil fault inject: name the device, e.g. gpu-3", file=sys.stderr)
            return 2
        faults[args.device] = args.message
    elif args.action == "clear":
        faults = {k: v for k, v in faults.items() if args.device not in (None, k)}
    if args.action != "list":
        write_faults(path, faults)
    for device, message in sorted(faults.items()):
        out.write(f"{device}\t{message}\n")
    return 0


MIGRATE_SOURCES = ("device-plugin", "nvidia-dra")
MIGRATE_LISTS = {
    "pods": "/api/v1/pods",
    "Deployment": "/apis/apps/v1/deployments",
    "StatefulSet": "/apis/apps/v1/statefulsets",
    "Job": "/apis/batch/v1/jobs",
    "nodes": "/api/v1/nodes",
    "deviceclasses": "/apis/resource.k8s.io/v1/deviceclasses",
    "configmaps": "/api/v1/configmaps",
}
NVIDIA_DRA_LISTS = {
    "pods": "/api/v1/pods",
    "Deployment": "/apis/apps/v1/deployments",
    "StatefulSet": "/apis/apps/v1/statefulsets",
    "Job": "/apis/batch/v1/jobs",
    "deviceclasses": "/apis/resource.k8s.io/v1/deviceclasses",
    "resourceclaims": "/apis/resource.k8s.io/v1/resourceclaims",
    "resourceclaimtemplates": "/apis/resource.k8s.io/v1/resourceclaimtemplates",
    "resourceslices": "/apis/resource.k8s.io/v1/resourceslices",
    # NVIDIA's CRD: none listed (404) where the cluster does not have it.
    "computedomains": "/apis/resource.nvidia.com/v1beta1/computedomains",
}


def _migrate_lists(api: KubeApi, paths: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    lists: dict[str, list[dict[str, Any]]] = {}
    for what, path in paths.items():
        found = api.list_everywhere(path)  # [] where the cluster has no such resource
        if found is None:
            print(f"drasil migrate check: may not list {what}: not checked", file=sys.stderr)
        lists[what] = found or []
    return lists


def _from_nvidia_dra(api: KubeApi, values: dict[str, Any]) -> nvidiadra.Result:
    lists = _migrate_lists(api, NVIDIA_DRA_LISTS)
    return nvidiadra.check_all(
        plan=nvidiadra.plan_from(values, lists["deviceclasses"], lists["resourceslices"]),
        claims=lists["resourceclaims"],
        templates=lists["resourceclaimtemplates"],
        compute_domains=lists["computedomains"],
        pods=lists["pods"],
        controllers={kind: lists[kind] for kind in nvidiadra.KINDS},
    )


def _migrate_check(args: argparse.Namespace, out: TextIO) -> int:
    values: Any = {}
    if args.values:
        documents = load_documents(Path(args.values).read_bytes())
        values = documents[0] if documents else {}
        if not isinstance(values, dict):
            print(f"drasil migrate check: {args.values}: not a mapping of chart values",
                  file=sys.stderr)  # fmt: skip
            return 2
    api = KubeApi(load_user_api_client(args.kubeconfig))
    if args.source == "nvidia-dra":
        out.write(nvidiadra.report(_from_nvidia_dra(api, values)))
        return 0
    lists = _migrate_lists(api, MIGRATE_LISTS)
    plan = migration.plan_from(values, lists["deviceclasses"], lists["configmaps"])
    controllers = {kind: lists[kind] for kind in migration.KINDS}
    verdicts = migration.check_all(lists["pods"], controllers, plan)
    found_pools = migration.pools(lists["nodes"], lists["pods"], plan, pool_label=args.pool_label)
    out.write(migration.report(verdicts, found_pools))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO], int]] = {
    "discover": _discover,
    "fault": _fault,
    "explain": _explain,
    "doctor": _doctor,
    "migrate": _migrate_check,
    "validate-config": _validate_config,
}


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = _parser().parse_args(argv)
    out = out or sys.stdout
    allow_nesting()  # objects users write may nest thousands of levels deep
    try:
        return COMMANDS[args.command](args, out)
    except (NvmlError, ProfileSpecError, VendorError, OSError, KubeconfigError, ConfigError) as err:
        print(f"drasil {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
