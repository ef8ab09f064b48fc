"""drasil's end-to-end harness: a real local Kubernetes control plane and the tests on it.

See docs/e2e.md.
"""
