"""ResourceSlices: a pool's devices as the scheduler reads them, kept published.

``build`` turns ``Device`` objects into slices under the API's per-slice limits;
``plan`` computes the minimal writes under pool generation semantics; ``publisher``
builds, plans and applies against the API server. Used by the node daemon (its
node's pool), the controller (DevicePool pools) and ``drasil discover``.
"""
