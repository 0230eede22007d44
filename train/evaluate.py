r"""Evaluate a trained model on datasets: the task's metrics, printed and written as JSON.

    python -m train.evaluate --run runs/ocr-paddle-smoke
    python -m train.evaluate --config configs/ocr/smoke.yaml \
        --checkpoint runs/ocr-paddle-smoke/checkpoints/step-00000300 --data data/synth_ocr/val
    python -m train.evaluate --config configs/ocr/finetune_ppocrv4.yaml \
        --weights .cache/ppocrv4/ppocrv4_rec.pdparams --data data/ppocrv4_dots/val \
        --data data/ppocrv4_clean/val

--run takes the run's best checkpoint (best/), else its latest. The config defaults to the
run's config.resolved.yaml; --set overrides it as for training. --weights takes what
model.init_from takes (a converted .pt/.pth or .pdparams file, a checkpoint or run directory)
and evaluates it in --config's model, released weights zero-shot included; every tensor of the
model must come from it. --data is any dataset of the task (OCR: an LMDB; ResNet: an HDF5 file
or an image folder), by default the config's data.val; give it several times for several
datasets (the JSON is then a list, one report each). The JSON goes to --out, by default
RUN/eval/<checkpoint>.json (with --weights: printed only). OCR: exact match (acc),
1 - normalized edit distance, accuracy per label length; ResNet: top-1, top-5. Exit codes as
python -m train's (2 config, 3 data, 4 checkpoint or weights).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from datasets.safe_files import write_atomic
from train.errors import EXIT_CONFIG


def add_model_arguments(parser: argparse.ArgumentParser, weights: bool = False) -> None:
    """--checkpoint | --run (| --weights), --config and --set: how train.evaluate and
    train.export name the model and its config."""
    from train.config.load import add_overrides_argument

    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="a checkpoint directory (RUN/best, RUN/checkpoints/…)")
    which.add_argument("--run", help="a run directory: its best checkpoint, else its latest")
    if weights:
        which.add_argument(
            "--weights", help="weights as model.init_from takes them, in --config's model"
        )
    parser.add_argument("--config", help="the run's config (default: RUN/config.resolved.yaml)")
    add_overrides_argument(parser)


def evaluate(config, backend, dataset) -> dict:
    """One pass over ``dataset`` with the backend's model (train/validation.py's, as training
    evaluates): the task's metric, the sample count, then the task's breakdowns. ``config`` is
    resolved (train.data.resolve)."""
    from datasets.sampler import EpochSampler
    from train import validation

    loader = backend.batches.make_loader(
        dataset, EpochSampler(len(dataset), shuffle=False), config.loader, train=False
    )
    return validation.evaluate(backend, loader, config.task, breakdowns=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser, weights=True)
    parser.add_argument(
        "--data", action="append", help="a dataset to evaluate on (default: the config's data.val)"
    )
    parser.add_argument("--out", help="JSON file to write (default: RUN/eval/<checkpoint>.json)")
    args = parser.parse_args(argv)
    if args.weights and not args.config:
        parser.error("--weights needs --config: the model to load the weights into")

    from train import inference
    from train.cli import run_command, setup_logging

    setup_logging(None, True)
    return run_command(unusable=inference.UNUSABLE_MODEL, body=lambda: _evaluate_command(args))


def _evaluate_command(args: argparse.Namespace) -> int:
    from train import inference
    from train.data import open_split

    # The config's own validation data is staged when remote; --data paths are read as given.
    stage = None if args.data else ("val",)
    model = None if args.weights else inference.find_checkpoint(args.checkpoint or args.run)
    config = inference.run_config(model, args.config, args.overrides, stage)
    data_paths = args.data or ([config.data.val] if config.data.val else [])
    if not data_paths:
        print("error: the config has no data.val. HINT: pass --data PATH", file=sys.stderr)
        return EXIT_CONFIG
    datasets, backend, reports = [], None, []
    try:
        for path in data_paths:
            datasets.append(open_split(config, "val", path))
        labels = inference.labels_of(config)
        if model is None:
            backend = inference.load_weights(args.weights, config, labels)
            origin = {"weights": args.weights}
        else:
            backend = inference.load_backend(model, config, labels)
            origin = {"checkpoint": str(model.checkpoint)}
        for path, dataset in zip(data_paths, datasets):
            metrics = evaluate(config, backend, dataset)
            reports.append({**origin, "data": str(path), **metrics})
    finally:
        for dataset in datasets:
            dataset.close()
        if backend is not None:
            backend.runtime.shutdown()
    text = json.dumps(reports[0] if len(reports) == 1 else reports, indent=2)
    print(text)
    out = Path(args.out) if args.out else None
    if out is None and model is not None:
        out = model.run_dir / "eval" / f"{model.checkpoint.name}.json"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, text)  # a link at that name is refused, not followed
        print(f"written: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
