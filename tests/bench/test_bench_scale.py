"""The scale benchmark's and the fleet publisher's own logic, without a cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kubernetes import client

from bench.scale import audit_writes, cpu_per_scheduled_pod, per_minute, summary, table
from bench.stats import percentile
from drasil.driver.kubeapi import KubeApi
from e2e.harness.cluster.control_plane import Cluster
from tools.fleet import FleetError, FleetPublisher, node_names


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) == 0.0
    assert summary([2.0, 1.0]) == {"count": 2, "p50": 1.0, "p99": 2.0, "max": 2.0}


def test_cpu_per_scheduled_pod_is_the_controllers_cpu_over_the_waves_pods() -> None:
    usage = {"started": {"cpu_seconds": 1.0}, "after_scheduling": {"cpu_seconds": 5.0}}

    assert cpu_per_scheduled_pod(usage, 100.04, 400) == {"seconds": 100.0, "ms": 10.0}
    assert cpu_per_scheduled_pod(usage, 1.0, 0)["ms"] == 4000.0  # no Pods: no division


def test_node_names_sort_as_numbers() -> None:
    assert node_names("n-", 3) == ["n-0", "n-1", "n-2"]
    names = node_names("n-", 200)
    assert (names[0], names[-1]) == ("n-000", "n-199")
    assert names == sorted(names)
    assert node_names("n-", 0) == []
    with pytest.raises(ValueError, match="--count"):
        node_names("n-", -1)


def _entry(user: str, verb: str, resource: str, when: str, **ref: str) -> str:
    return json.dumps(
        {
            "user": {"username": user},
            "userAgent": "kube-scheduler/v1.37.1 (linux/amd64)",
            "verb": verb,
            "objectRef": {"resource": resource, **ref},
            "stageTimestamp": when,
        }
    )


def test_audit_writes_count_by_user_in_the_window(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    cluster.logs_dir.mkdir()
    cluster.audit_log.write_text(
        "\n".join(
            [
                _entry(
                    "system:serviceaccount:fleet-ns:plugin",
                    "update",
                    "resourceslices",
                    "2026-01-01T00:00:10.5Z",
                ),
                _entry(
                    "system:kube-scheduler",
                    "create",
                    "pods",
                    "2026-01-01T00:00:11Z",
                    subresource="binding",
                ),
                _entry(
                    "system:kube-scheduler",
                    "create",
                    "pods",
                    "2026-01-01T00:00:12Z",
                    subresource="binding",
                ),
                # Outside the window.
                _entry(
                    "system:serviceaccount:fleet-ns:plugin",
                    "update",
                    "resourceslices",
                    "2026-01-01T00:01:00Z",
                ),
            ]
        )
        + "\n"
    )
    since = 1767225600.0 + 10  # 2026-01-01T00:00:10Z
    counts = audit_writes(cluster, since, since + 30, {"system:serviceaccount:fleet-ns:": "fleet"})
    assert counts == {
        ("fleet", "update", "resourceslices"): 1,
        ("system:kube-scheduler (kube-scheduler)", "create", "pods/binding"): 2,
    }
    rows = per_minute(counts, 0.5)
    assert rows[0] == {
        "who": "system:kube-scheduler (kube-scheduler)",
        "verb": "create",
        "resource": "pods/binding",
        "count": 2,
        "per_minute": 4.0,
    }


def test_a_flip_of_an_unknown_node_or_device_is_refused_before_any_call() -> None:
    # An API client for a server that does not exist: nothing may be called.
    configuration = client.Configuration()
    configuration.host = "https://127.0.0.1:9"
    fleet = FleetPublisher(
        KubeApi(client.ApiClient(configuration)),
        driver="gpu.drasil.dev",
        profile="h100-80gb:2",
        nodes=["n-0"],
    )
    assert sorted(fleet.nodes["n-0"].health.snapshot()) == ["gpu-0", "gpu-1"]
    with pytest.raises(FleetError, match="node 'n-9' is not in the fleet"):
        fleet.flip("n-9", "gpu-0", healthy=False)
    with pytest.raises(FleetError, match="node n-0 has no device 'gpu-7'"):
        fleet.flip("n-0", "gpu-7", healthy=False)
    assert fleet.status() == {"nodes": 1, "published": 0, "writes": {}, "errors": []}


def test_the_table_compares_rss_after_scheduling_across_n() -> None:
    """RSS after scheduling (nothing pending at any N) is a row beside RSS at the end."""
    runs = [
        {"nodes": n, "controller": {"usage": {"after_scheduling": {"rss_mib": rss}}}}
        for n, rss in ((50, 98.0), (500, 112.0))
    ]
    rows = table(runs).splitlines()
    assert rows[0] == "| figure | N = 50 | N = 500 |"
    assert "| ctrl RSS MiB after scheduling | 98.0 | 112.0 |" in rows
    assert "| ctrl RSS MiB (end) | None | None |" in rows
