"""GPUs handed to virtual machines through VFIO, whatever their vendor: PCI functions
in sysfs and their IOMMU groups, the passthrough devices published beside the GPUs,
and who holds a GPU open. Used by each vendor's node code and its prepare step
(``drasil.kubeletplugin.vendors.passthrough``); docs/passthrough.md."""
