"""AMD Instinct GPUs, discovered from what the amdgpu kernel driver puts in sysfs.

No ROCm is needed on the node: ``sysfs`` reads the PCI, DRM and KFD topology files
into records, ``devices`` turns them into drasil ``Device`` objects, ``health``
watches RAS error counters, and ``simulated`` writes a fake sysfs tree that the same
reader reads (``catalog`` holds the simulated models' figures).
"""
