"""drasil's end-to-end tests and their harness, in two rooms.

- `e2e/harness/`: what starts and drives a real local Kubernetes cluster (control plane,
  node, images, KWOK fleet, the daemons' processes, the fake drivers) for the tests, the
  tools and the benchmarks; it imports nothing of the tests nor of `tools/`;
- `e2e/test_*.py` and `conftest.py`: the tests that need that harness (a cluster, or
  what its build step makes: NVIDIA's toolkit, drasil's image).

Tests that need neither live in `tests/`. See docs/e2e.md.
"""
