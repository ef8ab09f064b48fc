# syntax=docker/dockerfile:1
#
# drasil's image: the node daemon (drasil-kubelet-plugin), the cluster daemon
# (drasil-controller) and the CLI (drasil), one image for the Helm chart, with NVIDIA's
# nvidia-cdi-hook for the CDI specs of real GPUs.
#
#   make image                                    # buildah, into local storage and dist/
#   docker build -t <registry>/drasil:0.1.0 .     # or any other OCI builder
#
# `make image` (tools/image) builds this file with buildah. Where no registry is
# reachable it first builds both bases locally and passes them as build arguments:
# PYTHON_IMAGE from Debian 12's own packages (python3.11 from Debian, see
# tools/image/base.py) and GO_IMAGE from Debian 12's gcc and libc6-dev with the host's Go
# toolchain (tools/image/golang.py); elsewhere the public images below are the bases. The
# steps work on both: they call `python3` and `go` from PATH (/usr/local/bin and
# /usr/local/go/bin in the public images) and need only the standard library's venv and
# ensurepip, and Go with a C compiler.
#
# Reproducible dependencies: constraints.txt pins every distribution the image installs
# (regenerate it with `python -m tools.image constraints` from a fresh .venv);
# NVIDIA_CTK_VERSION pins NVIDIA's nvidia-cdi-hook, whose go.sum pins its own.
#
# The default user is 65532 (non-root). The chart's controller runs as that user on a
# read-only root filesystem; the kubelet plugin's DaemonSet overrides it with root,
# because it must create sockets and files in root-owned kubelet directories on the host
# (docs/helm.md).

ARG PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm
ARG GO_IMAGE=docker.io/library/golang:1.26-bookworm

# ---- hook: NVIDIA's nvidia-cdi-hook, static ---------------------------------------------
# The container runtime runs the hooks of a CDI spec on the host, so the plugin copies
# this binary to the host (<pluginsDir>/<driverName>/nvidia-cdi-hook) and names that path
# in its specs, as NVIDIA's DRA driver does with its own (docs/helm.md#real-gpus).
# Statically linked, so it runs on any host whatever its C library. It needs cgo (its
# NVML bindings); the linker warns that dlopen in a static binary needs the glibc it was
# built with at run time: only `apply-cuda-memory-limits` loads NVML, and drasil's specs
# never use it. The module comes from the Go module proxy (GOPROXY and GOSUMDB: Go's
# defaults, or a mirror of your own); SSL_CERT_FILE may name a CA bundle mounted into
# the build for a proxy that intercepts TLS (empty: the image's). Module and build
# caches are cache mounts, not layers.
FROM ${GO_IMAGE} AS hook
ARG NVIDIA_CTK_VERSION=v1.20.2
ARG GOPROXY=https://proxy.golang.org,direct
ARG GOSUMDB=sum.golang.org
ARG SSL_CERT_FILE=
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=1 CGO_CFLAGS="-O2 -Wno-deprecated-declarations" GOFLAGS=-mod=mod \
    GOTOOLCHAIN=local GOMODCACHE=/go/pkg/mod GOCACHE=/root/.cache/go-build GOBIN=/out \
    go install -trimpath -tags netgo,osusergo \
      -ldflags "-s -w -linkmode=external -extldflags=-static \
        -X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version=${NVIDIA_CTK_VERSION#v}" \
      "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook@${NVIDIA_CTK_VERSION}" \
 && /out/nvidia-cdi-hook --version

# ---- build: our wheel, then a venv with it and its dependencies ------------------------
FROM ${PYTHON_IMAGE} AS build
# A pip configuration for this stage's pip only, e.g. the CA bundle of a proxy that
# intercepts TLS, mounted into the build (`make image` passes the host's, see
# tools/image/local.py); unset, pip's defaults.
ARG PIP_CONFIG_FILE
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# A throwaway venv for the build's pip (ensurepip): the base's own pip, if it has one,
# is never used or changed.
RUN python3 -m venv /opt/build
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
COPY api/ api/
COPY driver/ driver/
COPY kubeletplugin/ kubeletplugin/
COPY controller/ controller/
# Every dependency ships binary wheels for CPython 3.11 on manylinux: nothing compiles,
# and no compiler is needed even here. pip's HTTP cache outlives the build (a cache
# mount, not a layer), for indexes whose responses may be cached.
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/build/bin/pip wheel --quiet --only-binary=:all: --constraint constraints.txt \
      --wheel-dir /wheels .
# The image's venv has no pip of its own; the build venv's pip installs into it (and
# compiles the .pyc files the read-only root filesystem could not cache later).
RUN python3 -m venv --without-pip /opt/drasil \
 && /opt/build/bin/pip --python /opt/drasil/bin/python install --quiet --no-index \
      --find-links /wheels drasil \
 && /opt/drasil/bin/drasil-kubelet-plugin --help >/dev/null

# ---- final: the base image, the hook, the venv, nothing else ---------------------------
FROM ${PYTHON_IMAGE}
# No build or install tools in the final image: the public base's pip, setuptools and
# wheel go too (Debian's python3.11 has none to remove).
RUN if python3 -m pip --version >/dev/null 2>&1; then \
      python3 -m pip uninstall --yes --quiet pip setuptools wheel; \
    fi \
 && groupadd --system --gid 65532 drasil \
 && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin drasil
# The hook first: with a builder that caches layers, its layer stays the same while
# drasil's code changes.
COPY --from=hook /out/nvidia-cdi-hook /opt/drasil/bin/nvidia-cdi-hook
COPY --from=build /opt/drasil /opt/drasil
ENV PATH=/opt/drasil/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
WORKDIR /
ENTRYPOINT ["/opt/drasil/bin/drasil"]
# What the image is and where it came from (OCI annotation keys; `make image` passes
# the version from pyproject.toml and the git commit, and sets the same as annotations
# of the manifest).
ARG VERSION=unknown
ARG REVISION=unknown
ARG SOURCE=https://github.com/drasil-dev/drasil
LABEL org.opencontainers.image.title="drasil" \
      org.opencontainers.image.description="drasil, a Kubernetes DRA driver for NVIDIA GPUs" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}"
