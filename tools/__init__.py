"""The commands a user runs, over the e2e harness and drasil's sources.

- `demo`: `make demo` (a local cluster, the chart, a Pod with a simulated GPU);
- `image/`: `make image` (the Dockerfile built with buildah);
- `cluster`: `python -m tools.cluster up|down|status|env`, a local cluster to try or test;
- `fleet`: the fleet publisher (many KWOK nodes' pools from one process), which the
  harness's KWOK fleet starts and `make bench-scale` measures;
- `gpubundle`: `make gpu-check-bundle` (the folder `make gpu-check` runs on a GPU host).

They import the harness (`e2e.harness`), never the tests; the harness imports none of
them (it starts the fleet publisher as a process).
"""
