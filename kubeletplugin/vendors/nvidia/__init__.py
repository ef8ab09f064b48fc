"""NVIDIA on the node daemon: the vendor (``node``), and what its prepare steps do.

``node`` implements the seam over NVML (``drasil.driver.nvidia``); ``migs`` cuts MIG
instances on demand and ``recovery`` reconciles them against the checkpoint at start;
``driverroot`` builds the node's driver-file edits and readiness checks; ``mps/``
holds MPS: the daemons of shared GPUs and of claims' GPUs with MPS, and time slices.
Used by the registry (``kubeletplugin.vendors.registry``) and by ``gpucheck``.
"""
