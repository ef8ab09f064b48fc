"""The node daemon's GPU vendors: the seam they implement, the registry, and their rooms.

``seam`` says what a vendor gives the node daemon (discovery, health sources,
spec-wide container edits, readiness, Node labels, prepare steps); ``registry`` finds
the vendors a node serves (``--vendors``, ``auto``, a simulated profile) and opens
them, importing a vendor's module only when it is served; ``installed`` lists vendors
other packages register. ``nvidia/`` and ``amd/`` are drasil's vendors, each on top of
its library in ``drasil.driver.<vendor>``. ``kubeletplugin.node``, ``dra`` and
``deviceplugin`` see vendors through the seam only (an import-linter contract).
"""
