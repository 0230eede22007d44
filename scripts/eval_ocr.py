#!/usr/bin/env python
r"""Exact-match accuracy of OCR weights on LMDBs, through the training stack's own data path.

  .venv-paddle/bin/python scripts/eval_ocr.py --config configs/ocr/finetune_ppocrv4.yaml \
      --weights .cache/ppocrv4/ppocrv4_rec.pdparams data/ppocrv4_dots/val data/ppocrv4_clean/val
  .venv-torch/bin/python scripts/eval_ocr.py --config configs/ocr/finetune_ppocrv4_torch.yaml \
      --weights runs/finetune_ppocrv4_torch data/ppocrv4_dots/val

--weights is anything model.init_from takes (a converted .pt/.pdparams, a run directory: its
best checkpoint, a checkpoint directory). The model, dictionary, input shape and pixel contract
are the config's (--set KEY=VALUE overrides it, as for python -m train); each LMDB is read as
a validation split and decoded greedily, as the run's evaluations are. Prints one JSON line per
LMDB: {"data", "acc", "norm_edit_dis", "samples", "weights"}. A weight that does not load
(missing or shape-mismatched key) stops it: zero-shot figures need the whole model.
"""

from __future__ import annotations

import argparse
import json
import sys

import _bootstrap


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--weights", required=True, help="what model.init_from takes")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("lmdb", nargs="+", help="OCR LMDBs to read as validation data")
    args = parser.parse_args()

    from datasets.sampler import EpochSampler
    from train import tasks
    from train.backends import make_backend
    from train.config import load_config
    from train.loop import evaluate

    config = load_config(args.config, overrides=[*args.set, f"model.init_from={args.weights}"])
    task = tasks.get(config.task)
    backend = make_backend(config)
    backend.init_distributed()
    backend.seed_everything(config.seed, config.deterministic)
    built = False
    for path in args.lmdb:
        dataset = task.open_dataset(config.data, path, train=False, seed=config.seed)
        if not built:
            num_classes = task.num_classes(config.model, dataset)
            input_shape = task.input_shape(config.data)
            backend.build(config.model, config.optim, input_shape, num_classes, total_steps=1)
            report = backend.init_weights_from(args.weights)
            if report.missing or report.shape_mismatched:
                print(f"error: {report.summary()}", file=sys.stderr)
                return 2
            built = True
        sampler = EpochSampler(len(dataset), shuffle=False, rank=0, world_size=1)
        loader = backend.make_loader(dataset, sampler, config.loader, 0, train=False)
        metrics = evaluate(backend, loader, config.task)
        record = {"data": path, **metrics, "samples": len(dataset), "weights": args.weights}
        print(json.dumps(record), flush=True)
    backend.shutdown()
    return 0


if __name__ == "__main__":
    _bootstrap.run(main)
