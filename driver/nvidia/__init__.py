"""Everything that is NVIDIA's: NVML, its GPUs as devices, MIG, driver files, XIDs.

``nvml`` is our small NVML Protocol with the pynvml adapter; ``simulated`` the fake
NVML fed by ``gpucatalog``; ``nodedevices`` turns what NVML reports into ``Device``
objects; ``partitions`` the MIG placements and counters of ``--mig-mode dynamic``;
``driverfiles``, ``ldcache`` and ``driveredits`` the driver's files and the CDI edits
that give them to a container; ``nodecheck`` whether a node is ready (``drasil
doctor``); ``xid`` health from XID events. Used by the node daemon and the CLI through
``drasil.driver.discovery``; the vendor-neutral core never imports it, nor does the
AMD backend.
"""
