"""The PyTorch backend: train/backends/base.py's five parts, made for torch and composed.

The loop (train/loop.py) drives it; nothing here knows about epochs or logging cadence. Run a
config with it:  .venv-torch/bin/python -m train --config configs/resnet50/smoke.yaml
"""

from __future__ import annotations

from train import tasks
from train.backends.base import Backend
from train.backends.torch.batches import TorchBatches
from train.backends.torch.export import TorchExporter
from train.backends.torch.runtime import TorchRuntime
from train.backends.torch.state import TorchState
from train.backends.torch.trainer import TorchTrainer


class TorchBackend(Backend):
    """The torch parts, each reading the device and ranks from the one TorchRuntime."""

    name = "torch"

    def __init__(self, task: str, train) -> None:
        spec = tasks.get(task)
        runtime = TorchRuntime(train)
        trainer = TorchTrainer(spec, runtime)
        batches = TorchBatches(spec, runtime)
        state, exporter = TorchState(runtime, trainer), TorchExporter(runtime, trainer)
        super().__init__(task, runtime, batches, trainer, state, exporter)
