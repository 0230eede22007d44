# PaddlePaddle 2.6 GPU image: the OCR recognizer (service train-ocr in compose.yaml).
#
#   docker compose build train-ocr
#   docker build -f docker/paddle.Dockerfile -t starved-gpu/paddle:dev .
#
# BASE_IMAGE: Paddle's own 2.6.1 GPU release image (Docker Hub; also registry.baidubce.com):
# CUDA 11.8, cuDNN 8.6, TensorRT 8.5, Ubuntu 20.04, Python 3.10, paddlepaddle-gpu 2.6.1 installed.
# CI builds this file on a CPU stand-in base instead (scripts/ci_containers.sh).
ARG BASE_IMAGE=paddlepaddle/paddle:2.6.1-gpu-cuda11.8-cudnn8.6-trt8.5
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# A CJK font so that `make_synthetic.py ocr --charset full` renders Chinese text lines (4 MB,
# vs ~90 MB for fonts-noto-cjk); libGL/glib for opencv-python, which paddleocr pulls in.
# Versions are not pinned: the same list is installed on Ubuntu 20.04 (this base), Ubuntu 22.04
# (the PyTorch base) and Debian 12 (CI stand-in); the pinned base tag fixes the package set.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends fonts-wqy-microhei libgl1 libglib2.0-0 \
    && rm -rf /var/lib/apt/lists/*

# Non-root user. /data is mounted read-only; /runs and /cache are volumes: an empty named volume
# takes the owner of its mount point from the image, so the user can write to them.
# HOME is world-writable so `user: UID:GID` (compose) can run as any host user.
ARG TRAIN_UID=1000
RUN useradd --uid "${TRAIN_UID}" --create-home --home-dir /home/trainer --shell /bin/bash trainer \
    && mkdir -p /workspace /data /runs /cache \
    && chown trainer:trainer /runs /cache \
    && chmod 1777 /home/trainer

# Requirements before the source, so that editing code does not re-run pip.
# requirements/paddle.txt pins the CPU wheel paddlepaddle==2.6.2 for the venvs; installing it here
# would put a CPU build over the base image's paddlepaddle-gpu (same `paddle` package dir). So the
# framework lines are filtered out (FRAMEWORK_PATTERN), and the build fails if pip changed the
# framework anyway (e.g. a new dependency that requires paddlepaddle).
ARG FRAMEWORK_PATTERN="^(paddlepaddle|paddlepaddle-gpu)([=<>!~ ;\\[]|$)"
COPY requirements/ /tmp/requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    grep -v -E "${FRAMEWORK_PATTERN}" /tmp/requirements/paddle.txt > /tmp/requirements/image.txt \
    && { python -m pip list --format=freeze | grep -i -E "${FRAMEWORK_PATTERN}" || echo none; } > /tmp/framework.before \
    && python -m pip install --progress-bar off -r /tmp/requirements/image.txt \
        -r /tmp/requirements/remote.txt -c /tmp/requirements/constraints.txt \
    && { python -m pip list --format=freeze | grep -i -E "${FRAMEWORK_PATTERN}" || echo none; } > /tmp/framework.after \
    && diff /tmp/framework.before /tmp/framework.after \
    && python -c "import sys, paddle, paddleocr; print('python', sys.version.split()[0], 'paddle', paddle.__version__)" \
    && rm -rf /tmp/requirements /tmp/framework.*

# The project runs from /workspace (repository root on sys.path), never pip-installed: its
# top-level `datasets` package would shadow Hugging Face's `datasets` in site-packages.
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
ENV CONFIG=configs/ocr/container.yaml
CMD ["train"]
