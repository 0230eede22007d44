"""Run under a launcher with 2 ranks: build a ResNet-18 with the project's backend, give each
rank different BatchNorm running statistics (as training on each rank's own batches does), call
backend.trainer.sync_buffers(), and write what each rank then holds. Used by
tests/test_distributed.py.

  python -m torch.distributed.run --nproc-per-node 2 tests/probes/sync_buffers_probe.py torch OUT
  python -m paddle.distributed.launch --nproc_per_node 2 tests/probes/sync_buffers_probe.py \
      paddle OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.backends import make_backend  # noqa: E402
from train.config.load import load_config


def running_statistics(backend, framework: str) -> list:
    """The BatchNorm running means and variances, as framework tensors."""
    if framework == "torch":
        return [b for name, b in backend.trainer.net.named_buffers() if "running_" in name]
    return [p for p in backend.trainer.net.parameters() if not p.trainable]


def main() -> None:
    framework, out = sys.argv[1], Path(sys.argv[2])
    sets = [f"framework={framework}", "model.name=resnet18", "data.image_size=32"]
    config = load_config("configs/resnet50/smoke.yaml", sets)
    backend = make_backend(config)
    dist = backend.runtime.init_distributed()
    backend.build(config.model, config.optim, (3, 32, 32), 4, total_steps=10)
    stats = running_statistics(backend, framework)
    for tensor in stats:  # each rank's own statistics, as after training on its own batches
        value = np.full(tuple(tensor.shape), dist.rank + 1.0, dtype=np.float32)
        if framework == "torch":
            tensor.data.copy_(_torch(value))
        else:
            tensor.set_value(value)
    backend.trainer.sync_buffers()
    held = np.concatenate([backend.batches.to_numpy(t).ravel() for t in stats])
    np.save(out / f"rank{dist.rank}.npy", held)
    backend.runtime.barrier()
    backend.runtime.shutdown()


def _torch(value):
    import torch

    return torch.from_numpy(value)


if __name__ == "__main__":
    main()
