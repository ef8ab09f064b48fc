"""What GPUs a node has, and whether they are healthy.

``nvml`` is our small NVML Protocol with the pynvml adapter; ``simulated`` is the
fake NVML fed by ``gpucatalog`` (GPU models with the numbers real hardware reports);
``backends`` picks one; ``nodedevices`` turns what NVML reports into ``Device``
objects with stable names; ``health`` tracks XID events and injected faults. Used by
the node daemon (both modes) and by ``drasil discover``.
"""
