"""What drasil makes of a ResourceClaim's allocation and opaque configs.

- ``deviceconfigs``: reads ``status.allocation`` and resolves which opaque config
  applies to each allocated device;
- ``sharing``: the env a device's sharing config puts into its container;
- ``plan``: a claim's prepare worked out without side effects (used by
  ``drasil.kubeletplugin.dra.prepare``);
- ``configcheck``: configs checked before a node sees them (used by the controller
  and ``drasil validate-config``).
"""
