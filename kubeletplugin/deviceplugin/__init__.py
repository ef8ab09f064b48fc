"""Device-plugin mode of the node daemon (``--mode device-plugin``): kubelet's classic
``v1beta1.DevicePlugin`` API for nodes without DRA.

``plugin`` assembles it (``DevicePluginServer``, started by ``kubeletplugin.main``):
``resources`` (which extended resources and device IDs are advertised), ``service``
(ListAndWatch, Allocate, preferred allocation) and ``allocation`` (what a container
gets). It never imports ``kubeletplugin.dra``.
"""
