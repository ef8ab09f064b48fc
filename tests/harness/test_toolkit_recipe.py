"""NVIDIA's toolkit as the e2e harness builds it (the oracle of drasil's CDI specs): a
pinned recipe, read without building. What the built tools say is e2e/test_nvidia_oracle.py."""

from __future__ import annotations

from e2e.harness import recipes, versions


def test_the_toolkit_is_a_pinned_recipe() -> None:
    built = {b.name: b for b in recipes.binaries()}
    for name in ("nvidia-ctk", "nvidia-cdi-hook"):
        binary = built[name]
        assert binary.package == f"github.com/NVIDIA/nvidia-container-toolkit/cmd/{name}"
        assert binary.cgo is True  # go-nvml dlopens libnvidia-ml.so.1
        gomod = binary.module.files["go.mod"]
        assert f"nvidia-container-toolkit {versions.NVIDIA_CONTAINER_TOOLKIT}" in gomod
    assert built["nvidia-ctk"].recipe() != built["nvidia-cdi-hook"].recipe()
