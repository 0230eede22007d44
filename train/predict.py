r"""Run a trained or exported model on images: text (OCR) or class (ResNet) with a score.

    python -m train.predict --model export/ocr line1.png lines/ data/synth_ocr/val
    python -m train.predict --model runs/resnet50-torch-smoke --out predictions.tsv images/

--model: an exported directory (train.export: a Paddle inference model or model.onnx, with
preprocess.json), a checkpoint directory or a run directory (its best, else its latest; run with
that framework's environment). Inputs: image files, folders (searched recursively), an OCR LMDB
or an HDF5 file. Prints one line per image: name, prediction, score, and the label when the
input has labels (then also the exact-match accuracy). --out writes the same as a TSV.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from datasets.safe_files import write_atomic


class Model:
    """A model to predict with: its contract (train/inference.py), its labels, and
    ``probabilities(batch)`` for a preprocessed batch."""

    def __init__(self, spec: dict, labels: list[str], run: Callable[[np.ndarray], np.ndarray]):
        self.spec, self.labels, self.probabilities = spec, labels, run


def open_model(path: str, overrides=()) -> Model:
    """The model at ``path``: an exported directory or a checkpoint / run directory."""
    from train import inference

    directory = Path(path)
    if (directory / "inference.pdmodel").is_file():
        try:
            from train.backends.paddle.export import InferenceModel
        except ImportError as error:
            raise inference.framework_missing("paddle", directory) from error

        spec, labels = inference.read_contract(directory)
        return Model(spec, labels, InferenceModel(directory))
    if (directory / "model.onnx").is_file():
        try:
            import onnxruntime
        except ImportError as error:
            raise inference.InferenceError(
                f"{directory} needs onnxruntime. HINT: run with .venv-torch/bin/python (or in "
                "the torch image), or pip install onnxruntime"
            ) from error

        spec, labels = inference.read_contract(directory)
        session = onnxruntime.InferenceSession(
            str(directory / "model.onnx"), providers=["CPUExecutionProvider"]
        )
        return Model(spec, labels, lambda batch: session.run(None, {"images": batch})[0])
    trained = inference.find_checkpoint(directory)
    config = inference.run_config(trained, None, overrides)
    labels = inference.labels_of(config)
    backend = inference.load_backend(trained, config, labels)
    spec = inference.contract(config)
    task = config.task
    return Model(
        spec, labels, lambda batch: inference.probabilities(task, backend.exporter.infer(batch))
    )


def predict(model: Model, inputs, batch_size: int):
    """(name, prediction, score, label or None) per input, in input order."""
    from train import inference, tasks

    task = tasks.get(model.spec["task"])
    for batch in inference.batched(inputs, batch_size):
        images = inference.preprocess(model.spec, [data for _, data, _ in batch])
        results = inference.decode(task.name, model.probabilities(images), model.labels)
        for (name, _, label), (text, score) in zip(batch, results):
            if label is not None:
                label = task.label_text(label, model.labels)  # as the predictions read
            yield name, text, score, label


def main(argv: list[str] | None = None) -> int:
    from train.config.load import add_overrides_argument

    parser = argparse.ArgumentParser(
        prog="python -m train.predict",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="exported, checkpoint or run directory")
    parser.add_argument("inputs", nargs="+", help="image files, folders, an LMDB or an HDF5 file")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", help="write name, prediction, score[, label] as a TSV")
    add_overrides_argument(parser)
    args = parser.parse_args(argv)

    from train import inference
    from train.cli import run_command

    return run_command(unusable=inference.UNUSABLE_MODEL, body=lambda: _predict_command(args))


def _predict_command(args: argparse.Namespace) -> int:
    from train import inference

    model = open_model(args.model, args.overrides)
    inputs = inference.read_inputs(args.inputs, model.spec["task"])
    rows = list(predict(model, inputs, args.batch_size))
    labelled = [row for row in rows if row[3] is not None]
    lines = ["name\tprediction\tscore" + ("\tlabel" if labelled else "")]
    for name, text, score, label in rows:
        lines.append(f"{name}\t{text}\t{score:.6f}" + (f"\t{label}" if labelled else ""))
    text = "\n".join(lines) + "\n"
    if args.out:
        write_atomic(args.out, text)  # a link at that name is refused, not followed
    sys.stdout.write(text)
    if labelled:
        correct = sum(prediction == label for _, prediction, _, label in labelled)
        print(f"exact match: {correct}/{len(labelled)} = {correct / len(labelled):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
