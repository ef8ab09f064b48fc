"""drasil's node daemon, ``drasil-kubelet-plugin``: what runs on every GPU node.

Two modes, one package each, on a shared top level:

- ``dra``: DRA mode (the default). Publishes the node's ResourceSlices and serves
  kubelet's DRA plugin API (prepare and unprepare of ResourceClaims, device health),
  the registration socket, the checkpoint and the clean-up of stale claims.
- ``deviceplugin``: ``--mode device-plugin``, kubelet's classic device-plugin API for
  nodes without DRA (extended resources, ListAndWatch, Allocate).

``dra`` and ``deviceplugin`` never import each other; what both need lives at the top:
``main`` (the entry point), ``options`` (flags and env), ``node`` (discovery, health,
HTTP endpoints, threads, signals), ``metrics`` and ``sockets`` (restartable gRPC unix
sockets). Everything else comes from ``drasil.driver`` (never its ``cel`` or
``explain``, which serve the CLI and the controller) and ``drasil.api``.
"""
