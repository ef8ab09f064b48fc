"""The e2e harness: a real local Kubernetes cluster and what runs on it, as a library.

- `cluster/`: the control plane, the real node, the KWOK fleet of a run (its CLI is
  `python -m tools.cluster`);
- `kube`, `pods`, `procs`: the tests' API client, Pods on the node, processes;
- `pluginproc`, `controllerproc`, `chart`: drasil's daemons run as the chart runs them;
- `binaries`, `build`, `recipes`, `versions`, `paths`, `cbuild`: what is built (from
  upstream sources, cached by version outside the checkout) and where it lives;
- `node_images`, `probe/`: the node's images (pause, busybox, the GPU probe);
- `mocknvml/`, `driverroot/`, `nvidiatoolkit`: the faked NVIDIA driver (our C NVML, fake
  driver roots) and NVIDIA's own toolkit as the oracle;
- `go/`: Go sources the build compiles (etcd's and pause's mains);
- `sources`: an earlier commit's tree from git history (the upgrade test's release).
"""
