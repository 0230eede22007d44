r"""Evaluate a trained model on a dataset: the task's metrics, printed and written as JSON.

    python -m train.evaluate --run runs/ocr-paddle-smoke
    python -m train.evaluate --config configs/ocr/smoke.yaml \
        --checkpoint runs/ocr-paddle-smoke/checkpoints/step-00000300 --data data/synth_ocr/val

--run takes the run's best checkpoint (best/), else its latest. The config defaults to the
run's config.resolved.yaml; --set overrides it as for training. --data is any dataset of the
task (OCR: an LMDB; ResNet: an HDF5 file or an image folder), by default the config's data.val.
OCR: exact match (acc), 1 - normalized edit distance, accuracy per label length; ResNet:
top-1, top-5. Exit codes as python -m train's (2 config, 3 data, 4 checkpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train.__main__ import one_line
from train.errors import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_DATA


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--checkpoint | --run, --config and --set: how train.evaluate and train.export name the
    model and its config."""
    from train.config import add_overrides_argument

    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="a checkpoint directory (RUN/best, RUN/checkpoints/…)")
    which.add_argument("--run", help="a run directory: its best checkpoint, else its latest")
    parser.add_argument("--config", help="the run's config (default: RUN/config.resolved.yaml)")
    add_overrides_argument(parser)


def evaluate(config, backend, dataset, workers: int) -> dict:
    """One pass over ``dataset`` with the backend's model: the task's metric, and for OCR the
    accuracy per label length."""
    from datasets.sampler import EpochSampler
    from train import tasks
    from train.metrics import OcrLengthAccuracy

    loader = backend.make_loader(
        dataset, EpochSampler(len(dataset), shuffle=False), config.loader, workers, train=False
    )
    metric = tasks.get(config.task).metric()
    lengths = OcrLengthAccuracy() if config.task == "ocr" else None
    samples = 0
    for batch in backend.device_batches(loader):
        predicted, labels = backend.predict(batch), backend.batch_labels(batch)
        metric.update(predicted, labels)
        if lengths is not None:
            lengths.update(predicted, labels)
        samples += len(predicted)
    result = {**metric.summarize(metric.state()), "samples": samples}
    if lengths is not None:
        result["acc_by_length"] = lengths.summarize()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument("--data", help="dataset to evaluate on (default: the config's data.val)")
    parser.add_argument("--out", help="JSON file to write (default: RUN/eval/<checkpoint>.json)")
    args = parser.parse_args(argv)

    from datasets.errors import DatasetError
    from train import inference, tasks
    from train.__main__ import setup_logging
    from train.checkpoint import CheckpointError
    from train.config import ConfigError
    from train.cpus import resolve_num_workers

    setup_logging(None, True)
    try:
        model = inference.find_checkpoint(args.checkpoint or args.run)
        config = inference.run_config(model, args.config, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG
    except inference.InferenceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CHECKPOINT
    data_path = args.data or config.data.val
    if not data_path:
        print("error: the config has no data.val. HINT: pass --data PATH", file=sys.stderr)
        return EXIT_CONFIG
    try:
        dataset = tasks.get(config.task).open_dataset(config.data, data_path, train=False)
        labels = inference.labels_of(config)
        backend = inference.load_backend(model, config, labels)
    except DatasetError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_DATA
    except (inference.InferenceError, CheckpointError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CHECKPOINT
    workers, _ = resolve_num_workers(config.loader.num_workers, local_world_size=1)
    try:
        metrics = evaluate(config, backend, dataset, workers)
    finally:
        dataset.close()
        backend.shutdown()
    report = {"checkpoint": str(model.checkpoint), "data": str(data_path), **metrics}
    out = Path(args.out) if args.out else model.run_dir / "eval" / f"{model.checkpoint.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(json.dumps(report, indent=2))
    print(f"written: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
