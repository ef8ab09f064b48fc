"""CDI specs: what the container runtime reads to give a container its devices.

``spec`` holds the rules every spec obeys (edits, the lowest ``cdiVersion``,
validation); ``claimspecs`` writes, reads and lists the per-claim transient specs of
DRA mode; ``staticspec`` writes the node-wide specs of device-plugin mode (one per
vendor); ``metadata`` the KEP-5304 device metadata files. Vendor-neutral: a vendor's
devices bring their nodes, and its spec-wide edits come from its own package. Used by
the node daemon's two modes.
"""
