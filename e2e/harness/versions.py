"""Every upstream version the e2e harness pins, in one place.

Bumping a version here is all it takes: `python -m e2e.harness.build` notices that the recipe of
a binary changed and rebuilds only that binary.

All of it comes from the Go module proxy (proxy.golang.org); check that the proxy serves
the module zip (HTTP 200) before bumping.
"""

from __future__ import annotations

# Kubernetes: kube-apiserver, kube-scheduler, kube-controller-manager, kubelet, kubectl.
KUBERNETES = "v1.37.2"
# The git commit of the KUBERNETES tag, stamped into the binaries beside the version so
# `kubectl version` and /version report the real release; "" where it is not known (the
# module proxy's .info no longer names it, as for v1.37.2): then gitCommit stays empty.
KUBERNETES_COMMIT = ""
# k8s.io/kubernetes requires its staging modules at v0.0.0 (they are replaced by
# ./staging/... in its own repo); our go.mod replaces each with its published release.
STAGING = "v0.37.2"
STAGING_MODULES = (
    "k8s.io/api",
    "k8s.io/apiextensions-apiserver",
    "k8s.io/apimachinery",
    "k8s.io/apiserver",
    "k8s.io/cli-runtime",
    "k8s.io/client-go",
    "k8s.io/cloud-provider",
    "k8s.io/cluster-bootstrap",
    "k8s.io/code-generator",
    "k8s.io/component-base",
    "k8s.io/component-helpers",
    "k8s.io/controller-manager",
    "k8s.io/cri-api",
    "k8s.io/cri-client",
    "k8s.io/cri-streaming",
    "k8s.io/csi-translation-lib",
    "k8s.io/dynamic-resource-allocation",
    "k8s.io/endpointslice",
    "k8s.io/externaljwt",
    "k8s.io/kms",
    "k8s.io/kube-aggregator",
    "k8s.io/kube-controller-manager",
    "k8s.io/kube-proxy",
    "k8s.io/kube-scheduler",
    "k8s.io/kubectl",
    "k8s.io/kubelet",
    "k8s.io/metrics",
    "k8s.io/mount-utils",
    "k8s.io/pod-security-admission",
    "k8s.io/streaming",
    # Not published, so not replaced: sample-apiserver, sample-cli-plugin,
    # sample-controller (nothing we build imports them).
)

# etcd server, the version Kubernetes 1.37 is tested with (its build/dependencies.yaml
# says 3.7.0), newest patch. Built from a tiny main around etcdmain.Main.
ETCD = "v3.7.3"

# Helm 4 (charts of apiVersion v2 install unchanged).
HELM = "v4.3.1"

# The `go` line of our go.mod files; k8s.io/kubernetes 1.37 says go 1.26.0.
GO_DIRECTIVE = "1.26.0"

# DRA feature gates (docs/design.md#feature-gates) that 1.37 still lets us set. Gates
# that are GA and locked to their default (DRAPrioritizedList, DRAAdminAccess,
# DRAExtendedResource, DRAResourceClaimDeviceStatus, DynamicResourceAllocation) make
# every component refuse to start when named, so they are left out: they are on anyway.
# The same gates go to apiserver, scheduler, controller-manager and kubelet.
FEATURE_GATES = {
    "DRAPartitionableDevices": True,  # beta, on by default
    "DRADeviceTaints": True,  # GA in 1.37, not locked until 1.38
    "DRADeviceTaintRules": True,  # GA in 1.37, not locked until 1.38
    "DRAConsumableCapacity": True,  # beta, on by default
    "DRADeviceBindingConditions": True,  # beta, on by default
    "ResourceHealthStatus": True,  # beta, on by default (kubelet health stream)
    # alpha (1.36): a device's nodeAllocatableResources (--host-resources-per-gpu)
    "DRANodeAllocatableResources": True,
    # beta, off by default: the Workload API's PodGroups and kube-scheduler's gang
    # scheduling, and ResourceClaims of a whole PodGroup (e2e/test_podgroup.py)
    "GenericWorkload": True,
    "DRAWorkloadResourceClaims": True,
}

# resource.k8s.io/v1 (with DeviceTaintRule, GA in 1.37) is served by default; the beta
# versions are for clients that still speak them.
RUNTIME_CONFIG = {
    "resource.k8s.io/v1beta1": True,
    "resource.k8s.io/v1beta2": True,
    # Workloads and PodGroups (GenericWorkload): kube-scheduler and the controller
    # manager watch v1beta1; v1alpha3 is watched by one controller too.
    "scheduling.k8s.io/v1beta1": True,
    "scheduling.k8s.io/v1alpha3": True,
}

# -- the node: containerd, runc, CNI plugins, local images ---------------------------
# All from the Go module proxy as well, so a fresh machine needs nothing but Go (and a
# C compiler for runc's cgo part). Check the zip is served before bumping, e.g.
# curl -sI https://proxy.golang.org/github.com/containerd/containerd/v2/@v/<v>.zip

# containerd 2.x (containerd, ctr, containerd-shim-runc-v2): CDI is on by default.
CONTAINERD = "v2.4.2"
# runc (cgroup v1 deprecated since 1.4 but supported; 1.5.2 has the workaround for the
# Linux >= 6.17 device-rules bug). Built with cgo (nsenter), without seccomp/libpathrs.
RUNC = "v1.5.2"
RUNC_COMMIT = "29dd3dc2b13b4123162e5fe132504bb4b15569f1"
# CNI reference plugins: what the node's bridge network config needs.
CNI_PLUGINS = "v1.9.1"
CNI_PLUGIN_NAMES = ("bridge", "host-local", "loopback")

# Local images, built as OCI archives without a registry (e2e.harness.node_images). The registry
# host does not resolve; the tags never say `latest`, so kubelet never tries to pull.
PAUSE_IMAGE = "drasil.local/e2e/pause:1.0"
# busybox from Debian's busybox-static package (whatever version the mirror serves;
# the archive name records it), plus a sleep-forever entrypoint for test Pods.
BUSYBOX_DEBIAN_PACKAGE = "busybox-static"
TEST_IMAGE = "drasil.local/e2e/busybox:1.0"
# The same busybox plus the host's glibc (dynamic loader, libc, ld.so.cache, ldconfig)
# and e2e/harness/probe/gpu_probe.c as /usr/local/bin/gpu-probe: a container that dlopens the
# driver's libcuda.so.1 and libnvidia-ml.so.1 by SONAME (e2e.harness.node_images).
PROBE_IMAGE = "drasil.local/e2e/probe:1.0"

# -- the simulated fleet (`up --fake-nodes N`, docs/scale.md) ---------------------------
# KWOK (Kubernetes WithOut Kubelet, sigs.k8s.io/kwok): keeps fake Nodes Ready and plays
# their Pods' lifecycle (Running, deletion) without any kubelet. Its go.mod has no
# replace directives, so our wrapper module builds it as it is.
KWOK = "v0.8.0"

# -- NVIDIA's own CDI generator, the oracle of drasil's driver-file discovery -----------
# nvidia-ctk (`cdi generate`) and nvidia-cdi-hook from the NVIDIA Container Toolkit's Go
# module (e2e.harness.nvidiatoolkit). v1.20.2 is the newest release the proxy serves (v1.20.3 and
# v1.21.0 are 403); its go.mod has no replace directives and says go 1.26.0.
NVIDIA_CONTAINER_TOOLKIT = "v1.20.2"
