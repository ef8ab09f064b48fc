"""DRA mode of the node daemon: kubelet's DRA plugin API over ``dra.sock``.

``plugin`` assembles it (``KubeletPlugin``, started by ``kubeletplugin.main``):
``registration`` (the plugin watcher's socket), ``service`` (DRAPlugin v1, and v1beta1
as an adapter over it), ``prepare`` (carries out a claim's prepare plan from
``drasil.driver.claims.plan`` against the checkpoint and the CDI specs), ``reconcile``
(stale claims, leaked specs, a lost checkpoint), ``healthservice`` (DRAResourceHealth),
``nodeslices`` (the node's ResourceSlices), ``migs`` (MIG instances cut on demand),
``shares`` (what claims change on whole GPUs: MPS daemons from ``mps``, with the
simulated backend's stand-in in ``mpsstandin``, and time slices). It never imports
``kubeletplugin.deviceplugin``.
"""
