r"""The PaddlePaddle 2.6 backend: train/backends/base.py's five parts, made for Paddle and
composed.

The loop (train/loop.py) drives it; nothing here knows about epochs or logging cadence. Run:
    .venv-paddle/bin/python -m train --config configs/ocr/smoke.yaml
and on several GPUs or CPU processes:
    python -m paddle.distributed.launch --nproc_per_node 2 --log_dir RUN_DIR/launch-logs \
        train/__main__.py --config ... --output-dir RUN_DIR
(--log_dir: the launcher's default, ./log, is not writable in the images.)
"""

from __future__ import annotations

from train import tasks
from train.backends.base import Backend
from train.backends.paddle.batches import PaddleBatches
from train.backends.paddle.export import PaddleExporter
from train.backends.paddle.runtime import PaddleRuntime
from train.backends.paddle.state import PaddleState
from train.backends.paddle.trainer import PaddleTrainer


class PaddleBackend(Backend):
    """The Paddle parts, each reading the GPU and ranks from the one PaddleRuntime."""

    name = "paddle"

    def __init__(self, task: str, train) -> None:
        spec = tasks.get(task)
        runtime = PaddleRuntime(train)
        trainer = PaddleTrainer(spec, runtime)
        batches = PaddleBatches(spec, runtime)
        state, exporter = PaddleState(runtime, trainer), PaddleExporter(runtime, trainer)
        super().__init__(task, runtime, batches, trainer, state, exporter)
