"""drasil.controller — the cluster daemon (``drasil-controller``, kopf, leader-elected).

Publishes the ResourceSlices of ``DevicePool`` objects (``devicepools``, ``poolsync``),
watches ResourceClaims and their templates (``controller``, ``state``): checks their
opaque configs early, explains pending claims with Events (``pending``, ``events``,
through ``drasil.driver.explain``) and writes device status (``devicestatus``). kopf
is confined to ``operator`` and ``kopfstorage``; ``leader`` holds the Lease. Uses
``drasil.driver`` and ``drasil.api``; never the node daemon.
"""
