"""Fixtures for e2e tests: one real control plane per session, a namespace per test,
schedulable Node objects, API clients.

The cluster is started here (binaries built first if needed) unless
DRASIL_E2E_KUBECONFIG names an existing one. The ambient KUBECONFIG is never used: a
developer's real cluster must not be touched by tests by accident. DRASIL_E2E_KEEP=1
leaves the started cluster running after the session (see docs/e2e.md).
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from kubernetes import client

from e2e.harness import binaries, build
from e2e.harness.chart import chart_identity
from e2e.harness.cluster import Cluster
from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, device_classes, gone, wait_for
from e2e.harness.pluginproc import DRIVER
from e2e.harness.pods import (
    EXTENDED_CLASS,
    EXTENDED_RESOURCE,
    NODE_GPU_SELECTOR,
    drain_namespace,
)

E2E_DIR = Path(__file__).parent
KUBECONFIG_ENV = "DRASIL_E2E_KUBECONFIG"
KEEP_ENV = "DRASIL_E2E_KEEP"

BUILD_ERROR = pytest.StashKey[Exception]()
STARTED = pytest.StashKey[tuple[Path, bool]]()  # run dir of the session's cluster, kept?


def _keep() -> bool:
    return os.environ.get(KEEP_ENV, "") not in ("", "0", "false", "no")


def _needs_harness(item: pytest.Item) -> bool:
    """Every test in e2e/ needs the harness (a cluster, or what its build makes); tests that
    need neither live in tests/ (docs/e2e.md)."""
    return E2E_DIR in Path(str(item.path)).parents


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _needs_harness(item):
            item.add_marker(pytest.mark.e2e)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries before the first test: a cold build takes minutes, more than
    the per-test timeout, which would otherwise count it against the first test."""
    if not any(_needs_harness(i) for i in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stream = getattr(reporter, "_tw", None)

    class _Out:
        def write(self, text: str, /) -> int:
            if stream is not None and text.strip():
                stream.line(text.rstrip())
            return len(text)

        def flush(self) -> None:
            pass

    try:
        build.ensure_all(out=_Out())
    except Exception as e:  # reported by every e2e test through the cluster fixture
        session.config.stash[BUILD_ERROR] = e


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster | None]:
    """The Cluster this session started, or None when DRASIL_E2E_KUBECONFIG is used."""
    if os.environ.get(KUBECONFIG_ENV):
        yield None
        return
    build_error = request.config.stash.get(BUILD_ERROR, None)
    if build_error is not None:
        raise build_error
    keep = _keep()
    c = Cluster(die_with_parent=not keep, out=sys.stderr)
    previous: Any = None
    if not keep:
        # Whatever ends this process (exception, Ctrl-C, SIGTERM), nothing stays behind;
        # with SIGKILL the components die with us (die_with_parent).
        atexit.register(c.down)

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        previous = signal.signal(signal.SIGTERM, on_sigterm)
    request.config.stash[STARTED] = (c.run_dir, keep)
    try:
        c.up()
        yield c
    finally:
        if not keep:
            c.down()
            atexit.unregister(c.down)
            signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session")
def node_cluster(cluster: Cluster | None, kubeconfig: Path) -> Cluster:
    """The session's cluster with a real node: containerd, kubelet (Node `drasil-node`)
    and the drasil kubelet plugin beside it (simulated h100-80gb:8). The node starts
    the first time a test asks for it and runs until the session's cluster stops.

    With DRASIL_E2E_KUBECONFIG, the cluster must be one of this harness's runs started
    with `python -m tools.cluster up --with-node` (the tests restart its kubelet and
    kill its plugin); any other cluster skips the node tests, saying why."""
    if cluster is None:
        run = Cluster(kubeconfig.parent)
        node = run.node if (kubeconfig.parent / "cluster.json").is_file() else None
        if node is None or not all(alive for _, _, alive, _, _ in node.status()):
            pytest.skip(
                f"{KUBECONFIG_ENV}={kubeconfig} is not a running `python -m tools.cluster up "
                "--with-node` cluster; the node e2e tests need its kubelet and plugin"
            )
        return run
    if cluster.node is None or cluster.state().get("node", {}).get("state") != "up":
        cluster.start_node()
    return cluster


@pytest.fixture(scope="session")
def node(node_cluster: Cluster) -> Node:
    """The real node of `node_cluster` (`.name`, `.plugin`, `.restart_kubelet()`, ...)."""
    n = node_cluster.node
    assert n is not None
    return n


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """Where the session's cluster left its logs, and how to reach it if it was kept."""
    started = config.stash.get(STARTED, None)
    if started is None:
        return
    run_dir, kept = started
    tr = terminalreporter
    tr.write_sep("-", "e2e cluster")
    tr.write_line(f"logs: {run_dir / 'logs'}")
    if kept:
        tr.write_line(f"{KEEP_ENV} is set: the cluster is still running. Use it with")
        tr.write_line(f"  export $(.venv/bin/python -m tools.cluster env --run-dir {run_dir})")
        tr.write_line(
            f"and stop it with .venv/bin/python -m tools.cluster down --run-dir {run_dir}"
        )


@pytest.fixture(scope="session")
def kubeconfig(cluster: Cluster | None) -> Path:
    """The admin kubeconfig of the cluster under test."""
    if cluster is not None:
        return cluster.kubeconfig
    path = Path(os.environ[KUBECONFIG_ENV]).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{KUBECONFIG_ENV}={path}: no such file")
    return path


@pytest.fixture(scope="session")
def kube(kubeconfig: Path) -> Kube:
    """Real API clients: .api (ApiClient), .core (CoreV1Api), .dyn (DynamicClient)."""
    k = Kube(kubeconfig)
    wait_for(
        lambda: k.core.read_namespaced_service_account("default", "default"),
        timeout=60,
        what="the API server to answer (ServiceAccount default/default)",
    )
    return k


@pytest.fixture(scope="session")
def kubectl(kubeconfig: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the built kubectl against the cluster under test: kubectl("get", "nodes")."""
    binary = binaries.ensure_binaries(["kubectl"])["kubectl"]

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(binary), f"--kubeconfig={kubeconfig}", *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    return run


def _namespace_name(node_name: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", node_name.lower()).strip("-")[:40].strip("-")
    return f"e2e-{base}-{secrets.token_hex(3)}"


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for this test (with its default ServiceAccount), deleted after.

    Teardown waits until the ResourceClaims in it are gone, so they no longer hold
    devices when the next test allocates (the rest of the namespace goes in the
    background). Pods are force-deleted first: without a kubelet nobody would confirm
    their graceful termination, and a reserved claim is not released."""
    name = _namespace_name(request.node.name)
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        # The ServiceAccount admission plugin rejects pods until the controller made it.
        wait_for(
            lambda: kube.core.read_namespaced_service_account("default", name),
            timeout=30,
            what=f"ServiceAccount default in namespace {name}",
        )
        yield name
    finally:
        kube.core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
        claims = kube.resource(RESOURCE, "ResourceClaim")
        for claim in claims.get(namespace=name).items:
            kube.delete(RESOURCE, "ResourceClaim", claim.metadata.name, name)

        def no_claims() -> Any:
            left = [c.metadata.name for c in claims.get(namespace=name).items]
            return not left or NotYet({"claims left": left})

        wait_for(no_claims, timeout=60, what=f"the ResourceClaims in {name} to be deleted")
        kube.delete("v1", "Namespace", name)


@pytest.fixture
def make_node(kube: Kube) -> Iterator[Callable[..., dict[str, Any]]]:
    """make_node(name, **kw) creates a schedulable Node (see Kube.make_node); every
    Node made is deleted after the test (ResourceSlices it owns go with it)."""
    made: list[str] = []

    def make(name: str, **kwargs: Any) -> dict[str, Any]:
        made.append(name)
        return kube.make_node(name, **kwargs)

    yield make
    for name in made:
        kube.delete("v1", "Node", name)
    for name in made:
        wait_for(
            functools.partial(gone, kube, "v1", "Node", name),
            timeout=30,
            what=f"Node {name} to be deleted",
        )


# --- the node's GPUs for the node tests (test_node, test_container_view) -------------


@pytest.fixture(scope="module")
def gpu_class(kube: Kube, node: Node) -> Iterator[str]:
    """DeviceClass gpu.drasil.dev (as in test_kubeletplugin) and one that maps the
    extended resource drasil.dev/gpu to the same devices."""
    classes = {
        DRIVER: {"selectors": [{"cel": {"expression": NODE_GPU_SELECTOR}}]},
        EXTENDED_CLASS: {
            "selectors": [{"cel": {"expression": NODE_GPU_SELECTOR}}],
            "extendedResourceName": EXTENDED_RESOURCE,
        },
    }
    with device_classes(kube, classes):
        yield DRIVER


@pytest.fixture
def ns(namespace: str, kube: Kube, node: Node, gpu_class: str) -> Iterator[str]:
    """The test's namespace; afterwards its Pods are deleted and the test waits until
    the node unprepared every claim of it: no CDI spec, no checkpoint entry left."""
    yield namespace
    drain_namespace(kube, node, namespace)


@pytest.fixture(scope="module")
def plugin_kubeconfig(
    kube: Kube, kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A token of the plugin's service account with the chart's RBAC: what the plugin
    may do in a cluster is what it may do here."""
    with chart_identity(
        kube,
        kubeconfig,
        component="kubelet-plugin",
        release=f"plugin-{secrets.token_hex(3)}",
        driver=DRIVER,
        directory=tmp_path_factory.mktemp("plugin-identity"),
    ) as identity:
        yield identity.kubeconfig
