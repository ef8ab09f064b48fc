"""The Helm chart (charts/drasil) as the e2e tests use it: the pinned helm (never
against a cluster), rendering it, applying with the pinned kubectl, and its CRD."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from drasil.api.devicepool import CRD_NAME
from e2e.harness import binaries, paths, versions
from e2e.harness.controllerproc import ControllerProcess
from e2e.harness.kube import Kube, NotYet, gone, wait_for

CHART = paths.CHECKOUT / "charts" / "drasil"
# One file, whatever its name (issue 5 regenerates it from the API types).
(CRD,) = sorted((CHART / "crds").glob("*.yaml"))
RELEASE = "drasil"


@functools.cache
def helm_binary() -> Path:
    return binaries.ensure_binaries(["helm"])["helm"]


@functools.cache
def _helm_home() -> Path:
    # helm keeps repositories, plugins and caches under these; a test must not read or
    # change the developer's own.
    home = Path(os.environ.get("TMPDIR", "/tmp")) / f"drasil-e2e-helm-{os.getuid()}"
    home.mkdir(parents=True, exist_ok=True)
    return home


def helm(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the pinned helm. It never sees KUBECONFIG: nothing here talks to a cluster."""
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG" and not k.startswith("HELM_")}
    home = _helm_home()
    env |= {
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "KUBECONFIG": str(home / "no-cluster.kubeconfig"),
    }
    result = subprocess.run(
        [str(helm_binary()), *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}{result.stdout}"
        )
    return result


def values_args(values_file: Path | None, sets: Iterable[str] = ()) -> list[str]:
    args = ["-f", str(values_file)] if values_file is not None else []
    for s in sets:
        args += ["--set", s]
    return args


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping of the rendered chart names one key twice."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys; kubectl and Helm do too, but ArgoCD and
    other YAML tools refuse the object (a label emitted twice broke NVIDIA's chart for
    GitOps users). The chart's output must have none."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKeyError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r}", key_node.start_mark,
                )  # fmt: skip
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_rendered(text: str) -> list[dict[str, Any]]:
    """The objects of a rendered chart; DuplicateKeyError where a mapping repeats a key."""
    return [doc for doc in yaml.load_all(text, Loader=_StrictLoader) if doc]


def render(
    *,
    namespace: str,
    values_file: Path | None = None,
    sets: Iterable[str] = (),
    release: str = RELEASE,
    include_crds: bool = False,
) -> list[dict[str, Any]]:
    """`helm template` as a list of objects."""
    kube_version = versions.KUBERNETES.lstrip("v")
    args = [
        "template",
        release,
        str(CHART),
        f"--namespace={namespace}",
        f"--kube-version={kube_version}",
        *values_args(values_file, sets),
    ]
    if include_crds:
        args.append("--include-crds")
    return load_rendered(helm(*args).stdout)


def kubectl_run(
    kubeconfig: Path, *args: str, stdin: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    binary = binaries.ensure_binaries(["kubectl"])["kubectl"]
    result = subprocess.run(
        [str(binary), f"--kubeconfig={kubeconfig}", *args],
        input=stdin,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"kubectl {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stderr}{result.stdout}"
        )
    return result


def dump(objs: Iterable[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(list(objs), sort_keys=False)


def crd_exists(kube: Kube) -> bool:
    """Whether the DevicePool CRD is installed (a test puts back what it found)."""
    crds = kube.resource("apiextensions.k8s.io/v1", "CustomResourceDefinition")
    try:
        crds.get(name=CRD_NAME)
    except ApiException as e:
        if e.status != 404:
            raise
        return False
    return True


# A deleted CRD goes once kube-apiserver's finalizer has removed its objects. The finalizer
# lists them through the watch cache; while that cache is (re)initializing the list fails
# and the finalizer retries with an exponential backoff, so the CRD can stay Terminating
# for about twice as long as the cache was not ready: over 120 s once on CI's loaded run,
# where the next test's create was then refused ("custom resource definition is
# terminating"). Every test that removes the CRD waits this long for it, and every test
# that installs it first waits for a Terminating one to go.
CRD_GONE_TIMEOUT = 300.0
_CRD_REF = ("apiextensions.k8s.io/v1", "CustomResourceDefinition", CRD_NAME)


def crd_terminating_gone(kube: Kube) -> None:
    """Wait for a DevicePool CRD that is being deleted to be gone (none: return)."""

    def settled() -> Any:
        try:
            obj = kube.get(*_CRD_REF)
        except ApiException as e:
            if e.status == 404:
                return True
            raise
        deleting = (obj.get("metadata") or {}).get("deletionTimestamp")
        return True if not deleting else NotYet((obj.get("status") or {}).get("conditions"))

    wait_for(settled, timeout=CRD_GONE_TIMEOUT, what="the Terminating DevicePool CRD to go")


def remove_crd(kube: Kube) -> None:
    """Delete the DevicePool CRD and wait until it is gone (see CRD_GONE_TIMEOUT)."""
    kube.delete(*_CRD_REF)
    wait_for(
        lambda: gone(kube, *_CRD_REF), timeout=CRD_GONE_TIMEOUT, what="the DevicePool CRD to go"
    )


@contextlib.contextmanager
def crd_installed(kube: Kube, kubeconfig: Path) -> Iterator[dict[str, Any]]:
    """The chart's CRD applied for real (DevicePools need it served); removed afterwards
    unless it was there before."""
    crd_terminating_gone(kube)
    existed = crd_exists(kube)
    kubectl_run(kubeconfig, "apply", "--server-side", "-f", str(CRD))
    kubectl_run(
        kubeconfig,
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/devicepools.drasil.dev",
    )
    try:
        yield yaml.safe_load(CRD.read_text())
    finally:
        if not existed:
            remove_crd(kube)


def token_kubeconfig(kubeconfig: Path, token: str, path: Path, name: str) -> Path:
    """A kubeconfig at `path` that authenticates with `token` against the cluster of
    `kubeconfig`."""
    config = yaml.safe_load(kubeconfig.read_text())
    context = next(c for c in config["contexts"] if c["name"] == config["current-context"])
    cluster = next(c for c in config["clusters"] if c["name"] == context["context"]["cluster"])
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster],
                "users": [{"name": name, "user": {"token": token}}],
                "contexts": [{"name": name, "context": {"cluster": cluster["name"], "user": name}}],
                "current-context": name,
            }
        )
    )
    return path


_RBAC_KINDS = frozenset(
    {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
)


@dataclasses.dataclass(frozen=True)
class ChartIdentity:
    """A daemon's identity as the chart makes it: its service account's token in a
    kubeconfig, its RBAC applied, and the Lease its Role lets it hold."""

    kubeconfig: Path
    namespace: str
    lease: str  # the Lease its Role allows ("" for a daemon without one)


@contextlib.contextmanager
def chart_identity(
    kube: Kube,
    kubeconfig: Path,
    *,
    component: str,
    release: str,
    driver: str,
    directory: Path,
) -> Iterator[ChartIdentity]:
    """The chart's RBAC of one daemon (`component`: controller or kubelet-plugin) for
    `driver`, applied in a namespace of its own, and a kubeconfig with a token of that
    daemon's service account; removed after."""
    objs: list[dict[str, Any]] = []
    try:
        identity = create_chart_identity(
            kube,
            kubeconfig,
            component=component,
            release=release,
            driver=driver,
            directory=directory,
            created=objs,
        )
        yield identity
    finally:
        for obj in objs:
            if obj["kind"].startswith("Cluster"):
                kube.delete(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])
        kube.delete("v1", "Namespace", f"{release}-system")


def create_chart_identity(
    kube: Kube,
    kubeconfig: Path,
    *,
    component: str,
    release: str,
    driver: str,
    directory: Path,
    expiration_seconds: int = 3600,
    created: list[dict[str, Any]] | None = None,
) -> ChartIdentity:
    """What `chart_identity` sets up, left in place (a daemon that lives as long as its
    cluster); `created` collects the objects as they are made, for a caller that
    removes them."""
    namespace = f"{release}-system"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    objs = [
        o
        for o in render(namespace=namespace, release=release, sets=[f"driverName={driver}"])
        if o["kind"] in _RBAC_KINDS
        and o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
    ]
    for obj in objs:
        kube.create(obj, namespace)
        if created is not None:
            created.append(obj)
    sa = next(o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount")
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=expiration_seconds)
    )
    issued = kube.core.create_namespaced_service_account_token(sa, namespace, request)
    token = issued.status.token if issued.status is not None else None
    assert token, f"no token issued for {namespace}/{sa}"
    path = token_kubeconfig(kubeconfig, token, directory / f"{sa}.kubeconfig", sa)
    roles = [o for o in objs if o["kind"] == "Role"]
    lease = roles[0]["rules"][0]["resourceNames"][0] if roles else ""
    return ChartIdentity(kubeconfig=path, namespace=namespace, lease=lease)


@contextlib.contextmanager
def chart_controller(
    kube: Kube,
    kubeconfig: Path,
    *,
    release: str,
    driver: str,
    directory: Path,
) -> Iterator[ControllerProcess]:
    """drasil-controller for `driver` under the chart's RBAC (`chart_identity`),
    leading its own Lease; stopped after, with its log's tail printed."""
    (directory / "identity").mkdir(parents=True, exist_ok=True)
    with chart_identity(
        kube,
        kubeconfig,
        component="controller",
        release=release,
        driver=driver,
        directory=directory / "identity",
    ) as identity:
        proc = ControllerProcess(
            kubeconfig=identity.kubeconfig,
            log_path=directory / "controller.log",
            driver=driver,
            lease=identity.lease,
            lease_namespace=identity.namespace,
            identity=f"e2e-{release}",
        )
        proc.start()
        proc.wait_logged("leading")
        try:
            yield proc
        finally:
            proc.stop()
            print(f"controller log ({proc.log_path}):\n{proc.tail()}")


@dataclasses.dataclass(frozen=True)
class LocalNode:
    """What the chart needs to know of the harness's real node (e2e.harness.cluster.node)."""

    name: str
    registrar_dir: Path
    plugins_dir: Path
    cdi_dir: Path


def local_node_values(
    node: LocalNode,
    *,
    kubeconfig: Path,
    repository: str,
    tag: str,
    ports: Sequence[int],
    relay: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """Chart values for the local cluster and its real node, all ordinary chart values:

    - `apiServer.host/port` and `hostNetwork` for both daemons: the API server listens
      on 127.0.0.1 only and there is no kube-proxy, so a Pod reaches it only from the
      host's network namespace, at its own address; `ports` (plugin metrics and health,
      controller metrics and health) are free ports of the host;
    - `kubeletPlugin.podUidInSocketNames: false`: with host ports the chart replaces the
      plugin's Pod without a surge, so the two never serve at once;
    - the node's registrar, plugins and CDI directories; the image imported into the
      node's containerd (`pullPolicy: Never`);
    - one controller replica (two would share the node's ports); leader election
      still runs, on the release's Lease.

    With `relay` (host and port of an `e2e.harness.apirelay.ApiRelay` on the node IP)
    both daemons run on the Pod network as the chart's defaults have them: no host
    network, per-Pod socket names (the node's short kubelet root leaves room for them),
    so the plugin's update surges; they reach the API server through the relay.
    """
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    host, port = server.removeprefix("https://").rsplit(":", 1)
    metrics_port, health_port, controller_metrics, controller_health = ports
    selector = {"kubernetes.io/hostname": node.name}
    if relay is not None:
        host, port = relay[0], str(relay[1])
    return {
        "backend": "simulated",
        "apiServer": {"host": host, "port": int(port)},
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "kubeletPlugin": {
            "registrarDir": str(node.registrar_dir),
            "pluginsDir": str(node.plugins_dir),
            "cdiRoot": str(node.cdi_dir),
            "hostNetwork": relay is None,
            "podUidInSocketNames": relay is not None,
            "metricsPort": metrics_port,
            "healthPort": health_port,
            "nodeSelector": selector,
        },
        "controller": {
            "enabled": True,
            "replicas": 1,
            "hostNetwork": relay is None,
            "metricsPort": controller_metrics,
            "healthPort": controller_health,
            "nodeSelector": selector,
        },
    }
