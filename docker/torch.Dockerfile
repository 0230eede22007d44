# PyTorch 2.6 GPU image: ResNet-50 (service train-resnet50 in compose.yaml).
#
#   docker compose build train-resnet50
#   DOCKER_BUILDKIT=1 docker build -f docker/torch.Dockerfile -t starved-gpu/torch:local .
# Needs BuildKit (RUN --mount=type=cache): the default builder from Docker 23 on; Docker 20.10
# needs DOCKER_BUILDKIT=1. Stages: `runtime` (the default: training and the smoke tests) and
# `dev` (adds JupyterLab; compose.yaml's dev-torch service).
#
# BASE_IMAGE: PyTorch's official runtime image (Docker Hub): torch 2.6.0 and torchvision 0.21.0
# for CUDA 12.4 / cuDNN 9, conda Python 3.11 on Ubuntu 22.04. torch and torchvision come from
# here and are never reinstalled. CI builds this file on a CPU stand-in (scripts/ci_containers.sh).
ARG BASE_IMAGE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE} AS runtime

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# DejaVu Sans and a CJK font for synthetic OCR data, as in docker/paddle.Dockerfile (the data
# services may run in either image); libGL/glib for opencv; gcc and g++ for train.compile:
# TorchInductor compiles its CPU kernels with g++ and Triton its CUDA launcher with gcc, and the
# runtime base has no compiler (its conda Python has the headers both need). Not version-pinned: see docker/paddle.Dockerfile (same list on three
# distributions).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends fonts-dejavu-core fonts-wqy-microhei \
        libgl1 libglib2.0-0 gcc g++ \
    && rm -rf /var/lib/apt/lists/*

# Non-root user, and every path a volume is mounted at (compose.yaml, k8s/), created here with the
# owner and mode the volume should have: a new named volume copies them from the image, and one
# mounted where the image has no directory comes up root:root 0755 on the Docker Engine, which
# the non-root user cannot write. /data/<task> is written once by the data services as this
# user; /cache is world-writable (sticky) because training may run as the host user's uid
# (HOST_UID in compose.yaml); /runs is normally the host's ./runs, bind-mounted.
# HOME is set and world-writable so that any uid can run: Docker sets HOME=/ for a uid that is
# not in /etc/passwd, and matplotlib, pip and Jupyter write there.
ARG TRAIN_UID=1000
RUN useradd --uid "${TRAIN_UID}" --create-home --home-dir /home/trainer --shell /bin/bash trainer \
    && mkdir -p /workspace /data/ocr /data/resnet50 /runs /cache \
    && chown trainer:trainer /data/ocr /data/resnet50 /runs \
    && chmod 1777 /cache /home/trainer

# The container's roots, given once: the scenario files read them as ${OCR_DATA_DIR:-...} etc.,
# so every file in configs/ works here unchanged (the defaults are the checkout's layout).
ENV OCR_DATA_DIR=/data/ocr \
    RESNET50_DATA_DIR=/data/resnet50 \
    RUNS_ROOT=/runs \
    CACHE_ROOT=/cache
# train.compile's kernel cache. Inductor's default, /tmp/torchinductor_<user name>, asks
# /etc/passwd for the name and raises KeyError for a uid that is not there (HOST_UID, a pod's
# runAsUser); /tmp is per container and writable by any uid.
ENV TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor

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

# The project's home: commands run from /workspace (the scenario files' relative paths).
WORKDIR /workspace
COPY docker/entrypoint.sh /usr/local/bin/train-entrypoint
COPY . /workspace/
# The project is installed editable, without dependencies (the requirements above are its
# dependencies): `train`, `datasets`, `bench` and `scripts` import from /workspace in any directory
# and from a file run by path (Paddle's launcher runs train/__main__.py). Editable only, never a
# regular install: its `datasets` package would land in site-packages, in the folder of Hugging
# Face's library of that name (datasets/__init__.py). The dev stage's bind mount of the checkout
# over /workspace is what the install then points to. The source stays root-owned (read-only to
# the user); the benchmark's dataset and result folders are the writable exceptions (volumes in
# compose.yaml's bench service).
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m pip install --progress-bar off --no-deps -e /workspace \
    && mkdir -p /workspace/bench/data /workspace/bench/results \
    && chown trainer:trainer /workspace/bench/data /workspace/bench/results

# Numeric, so that Kubernetes' runAsNonRoot can verify it. HOME: see the user above.
ENV HOME=/home/trainer
USER ${TRAIN_UID}
ENTRYPOINT ["/usr/local/bin/train-entrypoint"]
# `train` is the entrypoint's shorthand for `python -m train --config "$CONFIG" $TRAIN_ARGS`.
ENV CONFIG=configs/resnet50/single_gpu.yaml
CMD ["train"]

# ---------------------------------------------------------------- dev: JupyterLab on top
# compose.yaml's dev-torch service (profile dev) bind-mounts the checkout over /workspace, so edits
# take effect at once. Not in the runtime image: training never needs it.
FROM runtime AS dev
ARG TRAIN_UID=1000
USER 0
COPY requirements/notebook.txt requirements/constraints.txt /tmp/requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m pip install --progress-bar off --cache-dir /root/.cache/pip \
        -r /tmp/requirements/notebook.txt \
        -c /tmp/requirements/constraints.txt \
    && rm -rf /tmp/requirements
USER ${TRAIN_UID}
EXPOSE 8888
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser"]

# ---------------------------------------------------------------- the default stage
# `docker build` without --target builds the last stage: the runtime image, not dev.
FROM runtime
