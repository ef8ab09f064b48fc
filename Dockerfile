# syntax=docker/dockerfile:1
#
# drasil's image for registries: the node daemon (drasil-kubelet-plugin), the cluster
# daemon (drasil-controller) and the CLI (drasil), one image for the Helm chart.
#
#   docker build -t <registry>/drasil:0.1.0 .
#
# Tests build the same layout without a Docker engine or a registry: e2e/image/ (see
# its docstring for what differs: the Python build underneath, and pinned versions).
#
# The default user is 65532 (non-root). The chart's controller runs as that user on a
# read-only root filesystem; the kubelet plugin's DaemonSet overrides it with root,
# because it must create sockets and files in root-owned kubelet directories on the host
# (docs/helm.md).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: our wheel, then a venv with it and its dependencies ------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api/ api/
COPY driver/ driver/
COPY kubeletplugin/ kubeletplugin/
COPY controller/ controller/
# Every dependency ships binary wheels for CPython 3.11 on manylinux: nothing compiles,
# and no compiler is needed even here.
RUN pip wheel --wheel-dir /wheels .
# The venv has no pip of its own; the build stage's pip installs into it (and compiles
# the .pyc files the read-only root filesystem could not cache later).
RUN python -m venv --without-pip /opt/drasil \
 && pip --python /opt/drasil/bin/python install --no-index --find-links /wheels drasil \
 && /opt/drasil/bin/drasil-kubelet-plugin --help >/dev/null

# ---- final: the base image, the venv, nothing else -------------------------------------
FROM ${PYTHON_IMAGE}
# No build or install tools in the final image: pip, setuptools and wheel go too.
RUN python -m pip uninstall --yes --quiet pip setuptools wheel \
 && groupadd --system --gid 65532 drasil \
 && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin drasil
COPY --from=build /opt/drasil /opt/drasil
ENV PATH=/opt/drasil/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
WORKDIR /
ENTRYPOINT ["/opt/drasil/bin/drasil"]
LABEL org.opencontainers.image.title="drasil" \
      org.opencontainers.image.description="drasil, a Kubernetes DRA driver for NVIDIA GPUs" \
      org.opencontainers.image.licenses="Apache-2.0"
