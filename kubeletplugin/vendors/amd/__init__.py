"""AMD on the node daemon: the vendor (``node``) and its one prepare step (``modes``).

``node`` implements the seam over amdgpu's sysfs tree (``drasil.driver.amd``);
``modes`` switches a GPU to the compute partition mode a claim's partitions need, and
back once no claim holds it. Used by the registry (``kubeletplugin.vendors.registry``).
"""
