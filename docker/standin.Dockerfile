# CI ONLY: CPU stand-ins for the GPU base images, which cannot be pulled on hosts without registry
# access (and would not run without a GPU anyway). scripts/ci_containers.sh builds them FROM a
# Debian bookworm rootfs (debootstrap, `docker import`), then builds docker/paddle.Dockerfile and
# docker/torch.Dockerfile on them with --build-arg BASE_IMAGE=...
#
# What each mimics of its real base, in what the project's code can trip on (the remaining
# differences and why they cannot matter: docs/containers.md, "Stand-ins"):
#   --target paddle   paddlepaddle/paddle:2.6.1-gpu-cuda11.8-cudnn8.6-trt8.5: CPython 3.10 as
#                     `python` (a system install, not a venv), paddlepaddle 2.6.x in its
#                     site-packages, runs as root, no /data, /runs or /cache tree.
#                     The interpreter is the CI host's own CPython 3.10 build, copied into the
#                     build context as python3.10/ by the script (Debian bookworm has only 3.11).
#   --target torch    pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime: CPython 3.11 as `python`
#                     with torch 2.6.0 and torchvision 0.21.0 and Python's headers (conda's
#                     Python ships include/python3.11; train.compile builds against them),
#                     no C compiler, runs as root.
ARG ROOTFS_IMAGE=starved-ci/rootfs:bookworm

# ---------------------------------------------------------------- common: the distribution part
FROM ${ROOTFS_IMAGE} AS common
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Unpinned apt packages: the rootfs is a fresh debootstrap of bookworm, whose versions it fixes.
# libgomp1: paddle's libpaddle.so needs it (the GPU base images ship it). The lib* packages are
# the shared libraries a CPython build links its extension modules against.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libgomp1 libssl3 libffi8 \
        zlib1g libbz2-1.0 liblzma5 libsqlite3-0 libreadline8 libncursesw6 libgdbm6 \
    && rm -rf /var/lib/apt/lists/*
# The CI host reaches the package index through a TLS-inspecting proxy: pip in this image and in
# the project images built on it trusts the host's CA bundle (copied in by the script). Only pip
# reads PIP_CERT; the real bases reach the index directly.
COPY ci-host-ca.crt /etc/ssl/ci-host-ca.crt
ENV PIP_CERT=/etc/ssl/ci-host-ca.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# ---------------------------------------------------------------- paddle: CPython 3.10
FROM common AS paddle
# The host's CPython 3.10 prefix, merged into /usr/local like a source install (`make install`):
# python3.10 in /usr/local/bin, libpython3.10.so in /usr/local/lib (found through ldconfig).
COPY python3.10/ /usr/local/
ARG FRAMEWORK_PIP
# DL3013 (pin pip packages): FRAMEWORK_PIP carries the exact pins (==) from the script.
# hadolint ignore=DL3013
RUN ldconfig \
    && ln -sf /usr/local/bin/python3.10 /usr/local/bin/python \
    && test -n "${FRAMEWORK_PIP}" \
    && python -m pip install --no-cache-dir --progress-bar off ${FRAMEWORK_PIP} \
    && python -c "import sys, paddle; print('stand-in: python', sys.version.split()[0], 'paddle', paddle.__version__)"

# ---------------------------------------------------------------- torch: CPython 3.11
FROM common AS torch
# Unpinned apt packages: bookworm's, fixed by the rootfs (as in the common stage).
# libpython3.11-dev: the headers only (Python.h in /usr/include/python3.11, the venv's include
# path), as the real base has them; the compilers come from docker/torch.Dockerfile.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libpython3.11-dev \
    && rm -rf /var/lib/apt/lists/*
ARG FRAMEWORK_PIP
# DL3013 (pin pip packages): FRAMEWORK_PIP carries the exact pins (==) from the script.
# hadolint ignore=DL3013
RUN test -n "${FRAMEWORK_PIP}" \
    && python3 -m venv /opt/venv \
    && /opt/venv/bin/python -m pip install --no-cache-dir --progress-bar off ${FRAMEWORK_PIP} \
    && ln -s /opt/venv/bin/python /usr/local/bin/python \
    && /opt/venv/bin/python -c "import sys, torch; print('stand-in: python', sys.version.split()[0], 'torch', torch.__version__)"
ENV PATH=/opt/venv/bin:${PATH}
