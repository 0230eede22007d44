"""Run under a launcher with 2 ranks: build the project's backend with train.compile=true
(torch.compile / paddle.jit.to_static, wrapped for data parallelism as the backend does), take
STEPS training steps on batches that differ per rank, and write each rank's trainable
parameters. With the gradients all-reduced every step, the ranks end with equal parameters; a
rank whose gradients stayed its own drifts away. Used by tests/test_compile_distributed.py.

  python -m torch.distributed.run --nproc-per-node 2 tests/probes/compiled_ranks_probe.py \
      torch OUT STEPS
  python -m paddle.distributed.launch --nproc_per_node 2 tests/probes/compiled_ranks_probe.py \
      paddle OUT STEPS
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from datasets.synthetic import LATIN  # noqa: E402
from train.backends import make_backend  # noqa: E402
from train.config.load import load_config

# The shapes of tests/test_compile.py's training (configs/ocr/smoke.yaml's image_shape, its batch
# of 8, the blank and the 62 characters of its Latin charset): torch compiles the same graph
# there and here, so inductor's compile cache (/tmp/torchinductor_$USER), filled by whichever of
# the two runs first, spares the other its C++ kernel builds (about 25 of its 65 CPU seconds
# here).
SHAPE = (3, 32, 160)
BATCH, LABEL_LENGTH, CLASSES = 8, 5, 1 + len(LATIN)


def host_batch(framework: str, rng: np.random.Generator) -> dict:
    """A loader's batch as the framework's host tensors: uint8 NHWC images, CTC labels."""
    channels, height, width = SHAPE
    arrays = {
        "image": rng.integers(0, 256, (BATCH, height, width, channels), dtype=np.uint8),
        "label": rng.integers(1, CLASSES, (BATCH, LABEL_LENGTH), dtype=np.int64),
        "length": np.full(BATCH, LABEL_LENGTH, dtype=np.int64),
    }
    if framework == "torch":
        import torch

        return {key: torch.from_numpy(value) for key, value in arrays.items()}
    import paddle

    return {key: paddle.to_tensor(value, place=paddle.CPUPlace()) for key, value in arrays.items()}


def trainable(backend, framework: str) -> dict[str, np.ndarray]:
    if framework == "torch":
        # A copy: a CPU tensor's numpy() shares its memory, which the optimizer updates.
        return {
            k: p.detach().cpu().numpy().copy() for k, p in backend.trainer.net.named_parameters()
        }
    return {k: p.numpy() for k, p in backend.trainer.net.named_parameters() if p.trainable}


def main() -> None:
    framework, out, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    sets = [f"framework={framework}", "train.compile=true", "optim.warmup_steps=0"]
    config = load_config("configs/ocr/smoke.yaml", sets)
    backend = make_backend(config)
    dist = backend.runtime.init_distributed()
    backend.runtime.seed_everything(config.seed, config.deterministic)
    backend.build(config.model, config.optim, SHAPE, CLASSES, total_steps=steps)
    initial = trainable(backend, framework)
    rng = np.random.default_rng(1000 + dist.rank)  # each rank its own data, as a shard is
    loader = [host_batch(framework, rng) for _ in range(steps)]
    for batch in backend.batches.device_batches(loader):
        backend.trainer.to_float(backend.trainer.train_step(batch))
    np.savez(out / f"rank{dist.rank}.npz", **trainable(backend, framework))
    if dist.rank == 0:
        np.savez(out / "initial.npz", **initial)
    backend.runtime.barrier()
    backend.runtime.shutdown()


if __name__ == "__main__":
    main()
