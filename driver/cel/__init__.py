"""The CEL environment of DRA device selectors, evaluated as kube-scheduler does.

``selectors`` is the entry point (compile a selector once, convert a device once,
evaluate in microseconds); ``compiler`` turns cel-python's parse tree into closures;
``operators`` and ``functions`` are the operators and the Kubernetes function
library; ``values`` holds the CEL value types (quantity, semver, optional).
Used by ``drasil.driver.explain`` (and so the controller and the CLI); the node
daemon never evaluates CEL.
"""
