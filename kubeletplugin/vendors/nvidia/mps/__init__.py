"""MPS on NVIDIA GPUs: the step of prepare that makes a GPU's sharing hold.

In the flow: the claim's plan (``drasil.driver.claims``) says which devices are
shares or ask for MPS; the Preparer (``kubeletplugin.dra.prepare``) hands the plan to
``shares.GpuEffects`` (through the vendor seam's ``SharingStep``), which sets the GPU's
compute mode and time slice and asks ``daemons.MpsDaemons`` for the GPU's MPS control
daemon: a host process, or a Pod of its own on the node (``pods``, the chart's way),
run in the mount namespace of ``view``; the simulated backend runs
``drasil.driver.simulated.mpsstandin`` in place of ``nvidia-cuda-mps-control``.
Unprepare and start settle what no claim needs; ``watch`` finds a daemon that died
under its clients and says so (health stream, Events). Each GPU's daemon is changed
under a lock of its own, so calls for different GPUs never wait for each other.
"""
