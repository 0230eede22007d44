"""Run under a launcher with 2 ranks: build the OCR smoke model with the project's backend and
evaluate it with train.loop.evaluate over a validation LMDB twice, the way training shards it
(this rank's EpochSampler share, padded by wrapping, its padding not counted) and whole on every
rank (world size 1's sampler: each rank's metric is the 1-rank one, and the all-reduce's sum of
two equal states keeps every ratio). Rank 0 writes both, and each sample's normalized edit
distance on its own, as JSON. Used by tests/test_eval_padding.py.

  python -m torch.distributed.run --nproc-per-node 2 tests/probes/eval_ranks_probe.py \
      torch LMDB OUT.json
  python -m paddle.distributed.launch --nproc_per_node 2 tests/probes/eval_ranks_probe.py \
      paddle LMDB OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from datasets.sampler import EpochSampler  # noqa: E402
from train import tasks  # noqa: E402
from train.backends import make_backend  # noqa: E402
from train.config.load import load_config
from train.loop import evaluate  # noqa: E402
from train.metrics import OcrMetric  # noqa: E402


def main() -> None:
    framework, lmdb, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    sets = [
        f"framework={framework}",
        f"data.train={lmdb}",
        f"data.val={lmdb}",
        f"data.char_dict={lmdb.parent / 'charset.txt'}",
        "loader.batch_size=2",
        "loader.num_workers=1",  # a worker per rank: the batch ring on torch
    ]
    config = load_config("configs/ocr/smoke.yaml", sets)
    task = tasks.get(config.task)
    backend = make_backend(config)
    dist = backend.runtime.init_distributed()
    backend.runtime.seed_everything(config.seed, config.deterministic)  # the same model every run
    dataset = task.open_dataset(config.data, str(lmdb), train=False)
    classes = task.num_classes(config.model, dataset)
    backend.build(config.model, config.optim, task.input_shape(config.data), classes, 10)
    backend.trainer.sync_buffers()  # one model on both ranks (the wrapper broadcast rank 0's)

    def loader(sampler: EpochSampler):
        return backend.batches.make_loader(dataset, sampler, config.loader, train=False)

    share = EpochSampler(len(dataset), shuffle=False, rank=dist.rank, world_size=dist.world_size)
    sharded = evaluate(backend, loader(share), config.task, dist=dist, counted=share.unpadded)
    whole_sampler = EpochSampler(len(dataset), shuffle=False)
    whole = evaluate(backend, loader(whole_sampler), config.task, dist=dist)

    per_sample = []  # each sample's 1 - normalized edit distance, in position order
    for batch in backend.batches.device_batches(loader(whole_sampler)):
        predicted, labels = backend.trainer.predict(batch), backend.batches.batch_labels(batch)
        for row in range(len(predicted)):
            metric, rows = OcrMetric(), slice(row, row + 1)
            metric.update(predicted[rows], {key: value[rows] for key, value in labels.items()})
            per_sample.append(OcrMetric.summarize(metric.state())["norm_edit_dis"])
    if dist.is_main:
        out.write_text(json.dumps({"sharded": sharded, "whole": whole, "per_sample": per_sample}))
    backend.runtime.barrier()
    dataset.close()
    backend.runtime.shutdown()


if __name__ == "__main__":
    main()
