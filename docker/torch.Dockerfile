# PyTorch 2.6 GPU image: ResNet-50 (service train-resnet50 in compose.yaml).
#
#   docker compose build train-resnet50
#   docker build -f docker/torch.Dockerfile -t starved-gpu/torch:dev .
#
# BASE_IMAGE: PyTorch's official runtime image (Docker Hub): torch 2.6.0 and torchvision 0.21.0
# for CUDA 12.4 / cuDNN 9, conda Python 3.11 on Ubuntu 22.04. torch and torchvision come from
# here and are never reinstalled. CI builds this file on a CPU stand-in (scripts/ci_containers.sh).
ARG BASE_IMAGE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# A CJK font for synthetic OCR data (the data services may run in either image); libGL/glib for
# opencv. Not version-pinned: see docker/paddle.Dockerfile (same list on three distributions).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends fonts-wqy-microhei libgl1 libglib2.0-0 \
    && rm -rf /var/lib/apt/lists/*

# Non-root user; /runs and /cache owned by it (see docker/paddle.Dockerfile).
ARG TRAIN_UID=1000
RUN useradd --uid "${TRAIN_UID}" --create-home --home-dir /home/trainer --shell /bin/bash trainer \
    && mkdir -p /workspace /data /runs /cache \
    && chown trainer:trainer /runs /cache \
    && chmod 1777 /home/trainer

# Requirements before the source. requirements/torch.txt pins torch/torchvision for the venvs; the
# base image already has the CUDA builds of exactly these versions, so those lines are filtered
# out, and the build fails if pip changed them anyway (a reinstall would pull ~3 GB of CUDA wheels
# next to the conda ones).
ARG FRAMEWORK_PATTERN="^(torch|torchvision|torchaudio)([=<>!~ ;\\[]|$)"
COPY requirements/ /tmp/requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    grep -v -E "${FRAMEWORK_PATTERN}" /tmp/requirements/torch.txt > /tmp/requirements/image.txt \
    && { python -m pip list --format=freeze | grep -i -E "${FRAMEWORK_PATTERN}" || echo none; } > /tmp/framework.before \
    && python -m pip install --progress-bar off -r /tmp/requirements/image.txt \
        -r /tmp/requirements/remote.txt -c /tmp/requirements/constraints.txt \
    && { python -m pip list --format=freeze | grep -i -E "${FRAMEWORK_PATTERN}" || echo none; } > /tmp/framework.after \
    && diff /tmp/framework.before /tmp/framework.after \
    && python -c "import sys, torch, torchvision; print('python', sys.version.split()[0], 'torch', torch.__version__)" \
    && rm -rf /tmp/requirements /tmp/framework.*

# The project runs from /workspace, never pip-installed (the `datasets` name hazard).
WORKDIR /workspace
COPY docker/entrypoint.sh /usr/local/bin/train-entrypoint
COPY . /workspace/
# The source stays root-owned (read-only to the user); the benchmark's dataset and result folders
# are the writable exceptions (volumes in compose.yaml's bench service).
RUN mkdir -p /workspace/bench/data /workspace/bench/results \
    && chown trainer:trainer /workspace/bench/data /workspace/bench/results

# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER ${TRAIN_UID}
ENTRYPOINT ["/usr/local/bin/train-entrypoint"]
# `train` is the entrypoint's shorthand for `python -m train --config "$CONFIG" $TRAIN_ARGS`.
ENV CONFIG=configs/resnet50/container.yaml
CMD ["train"]
