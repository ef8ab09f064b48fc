"""The controller's reconcilers, one per concern, each with its own state and lock.

``drasil.controller.controller`` routes watch events to them and, once a second, asks
each for what is due. One concern affects another only by marking work due in the
other's queue (``due.DueQueue``), never by calling into it, so each runs and is
tested alone:

- ``pools``: DevicePools published as ResourceSlices, retried, resynced;
- ``configs``: opaque configs of claims and templates checked, problems as Events;
- ``devicestatus``: ``status.devices`` of claims holding DevicePool devices, with
  the simulated attach of devices that have binding conditions;
- ``explanations``: why a pending claim cannot be allocated, as Events.
"""
