# CI ONLY: a stand-in for the GPU base images, which cannot be pulled on hosts without registry
# access (and would not run without a GPU anyway). scripts/ci_containers.sh builds it FROM a
# Debian bookworm rootfs made with debootstrap and imported into podman, then builds
# docker/paddle.Dockerfile and docker/torch.Dockerfile on it with --build-arg BASE_IMAGE=...
#
# It mimics what the real bases give the project Dockerfiles: a `python` on PATH with the
# framework already installed (CPU builds of the same versions), pip, apt. Python is 3.11 here
# (bookworm) vs 3.10 (Paddle GPU image) and 3.11 (PyTorch image); the project supports both.
ARG ROOTFS_IMAGE=localhost/standin-rootfs:bookworm
FROM ${ROOTFS_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Unpinned apt packages: the rootfs is a fresh debootstrap of bookworm, whose versions it fixes.
# libgomp1: paddle's libpaddle.so needs it (the GPU base images ship it).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates libgomp1 \
    && rm -rf /var/lib/apt/lists/*

# The framework as the real base image ships it, e.g. "paddlepaddle==2.6.2" or
# "torch==2.6.0 torchvision==0.21.0". /root/.cache/pip is the CI host's pip cache, bind-mounted
# by the script (with podman 4.3 it stayed empty in our runs: see docs/containers.md).
# PIP_CERT: the CI host's CA bundle (downloads go through a TLS-inspecting proxy), mounted beside
# the image's own, which apt's ca-certificates rewrites and so must not be a read-only mount here.
ARG FRAMEWORK_PIP
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
# DL3013 (pin pip packages): FRAMEWORK_PIP carries the exact pins (==) from the script.
# hadolint ignore=DL3013
RUN test -n "${FRAMEWORK_PIP}" \
    && python3 -m venv /opt/venv \
    && /opt/venv/bin/python -m pip install --progress-bar off --cache-dir /root/.cache/pip ${FRAMEWORK_PIP} \
    && ln -s /opt/venv/bin/python /usr/local/bin/python
# Builds FROM this image get the host bundle mounted at the usual path (scripts/ci_containers.sh).
ENV PATH=/opt/venv/bin:${PATH} \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
