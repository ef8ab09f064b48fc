"""What GPUs a node has and whether they are healthy, across vendors.

``backends`` opens the vendor backends a node runs (NVIDIA's from
``drasil.driver.nvidia``, AMD's from ``drasil.driver.amd``, real or simulated) and
merges their devices; ``health`` tracks device health over every source (the vendors'
error events, injected faults). Used by the node daemon (both modes) and by
``drasil discover``.
"""
