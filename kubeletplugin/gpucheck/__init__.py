"""``make gpu-check``: drasil on a real NVIDIA GPU, with no Kubernetes and no runtime.

Run as ``python -m drasil.kubeletplugin.gpucheck`` (or the bundle's ``run.py``). It discovers
the node's GPUs through drasil's NVML backend and compares them with ``nvidia-smi -q
-x`` (``compare``), validates the ResourceSlices drasil would publish (``slices``),
prepares and unprepares one whole GPU through the kubelet plugin's real ``Preparer``
from a claim file (``prepare``, ``claim``), validates the claim's CDI spec against the
official schema and compares it with ``nvidia-ctk cdi generate`` (``cdicheck``), runs
``probe`` in a mount and PID namespace that holds only what the spec gives
(``sandbox``), cuts and destroys a MIG instance where MIG mode is already on (``mig``),
and prints and writes the result (``report``). Used by people checking a GPU node and
by ``e2e/test_gpucheck.py``; nothing else imports it.
"""
