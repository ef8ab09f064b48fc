"""drasil.driver — the core both daemons and the CLI are built from; no process of its own.

Sub-packages, one per subsystem:

- ``cel``: the CEL environment of DRA device selectors (compiler, functions, values).
- ``explain``: why a ResourceClaim is pending; used by the controller and the CLI,
  never by the node daemon.
- ``claims``: from a claim's allocation to what its prepare must do (configs per
  device, sharing, the prepare plan) and early config checks.
- ``cdi``: CDI specs: the generic rules, the per-claim files, the device-plugin file.
- ``discovery``: NVML (real or simulated) turned into ``Device`` objects, and health.
- ``slices``: ResourceSlices built, their writes planned, and published.

Small modules shared by all of them sit at the top: ``devices`` (the device model),
``files`` (atomic writes, locks, crash points), ``kubeapi`` (the only importer of the
``kubernetes`` client), ``checkpoint`` (the node's record of prepared claims),
``endpoints`` (``/metrics`` and ``/healthz``), ``logs`` and ``cli`` (the ``drasil``
command). Nothing here imports ``drasil.kubeletplugin`` or ``drasil.controller``.
"""
