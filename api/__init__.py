"""drasil.api — the contracts: what users, kubelet and the disk see of drasil.

``config`` holds the opaque config kinds users write into claims and classes
(``GpuConfig``, ``MigDeviceConfig``; strict pydantic models, JSON Schemas in
``schemas/``), ``devicepool`` the ``DevicePool`` CRD types, ``checkpoint`` the
versioned schema of the node's checkpoint file, ``quantity`` Kubernetes quantities
with bounded parsing, ``limits`` the bounds on untrusted input both enforce, and
``kubelet/`` our ``.proto`` files of kubelet's gRPC APIs with their generated stubs.
Imported by everything else; imports nothing of drasil.
"""
