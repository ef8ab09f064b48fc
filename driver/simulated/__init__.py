"""Simulated hardware: what the simulated backend serves in place of GPUs and their tools.

``nvml`` (with ``nvmlcore``, ``gpus``, ``gpustate`` and the models of ``gpucatalog``)
is a fake NVML, an ``NvmlLibrary`` over simulated NVIDIA GPUs with NVML's MIG rules and
state kept in a file; ``amdsysfs`` (models in ``amdcatalog``) writes and changes a fake
amdgpu sysfs tree; ``mpsstandin`` stands in for ``nvidia-cuda-mps-control``. The
product imports them only where the simulated backend is chosen (the vendors' wiring in
``kubeletplugin.vendors``, the CLI's ``--backend simulated``: an import-linter
contract); tests, the demo and the benchmarks use them freely.
"""
