"""CDI specs: what the container runtime reads to give a container its devices.

``spec`` holds the rules every spec obeys (edits, the lowest ``cdiVersion``,
validation); ``claimspecs`` writes, reads and lists the per-claim transient specs of
DRA mode; ``staticspec`` writes the one node-wide spec of device-plugin mode. Used by
the node daemon's two modes.
"""
