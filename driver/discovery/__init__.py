"""What GPUs a node has, across vendors.

``backends`` opens the vendor backends a node runs (NVIDIA's from
``drasil.driver.nvidia``, AMD's from ``drasil.driver.amd``, real or simulated) and
merges their devices. Used by the node daemon (both modes) and by ``drasil discover``.
Device health, which both vendors report into, is vendor-neutral: ``drasil.driver.health``.
"""
