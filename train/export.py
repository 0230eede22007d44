r"""Export a trained model for use outside this repository.

    python -m train.export --run runs/ocr-paddle-smoke --format paddle-inference --out export/ocr
    python -m train.export --run runs/resnet50-torch-smoke --format onnx --out export/resnet

Formats: paddle-inference (Paddle models: inference.pdmodel/.pdiparams, which PaddleOCR's
TextRecognizer and PaddleOCR(rec_model_dir=..., rec_char_dict_path=...) load), pdparams
(Paddle weights, paddle.load-able), onnx (torch models: model.onnx for ONNX Runtime). Beside
the weights: preprocess.json (the preprocessing contract: image shape, channel order, resize,
padding, normalization, output) and dict.txt (OCR) or classes.txt (ResNet). --run takes the
run's best checkpoint, else its latest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from datasets.safe_files import refuse_link
from train.evaluate import add_model_arguments

FORMATS = {"paddle-inference": "paddle", "pdparams": "paddle", "onnx": "torch"}


def export(model, config, fmt: str, out: Path) -> list[Path]:
    """Write ``model`` (an inference.TrainedModel) as ``fmt`` with its contract into ``out``."""
    from train import inference, tasks

    if FORMATS[fmt] != model.framework:
        formats = [name for name, framework in FORMATS.items() if framework == model.framework]
        raise inference.InferenceError(
            f"{model.checkpoint} is a {model.framework} model; {fmt} is for "
            f"{FORMATS[fmt]} models. HINT: use --format {' or '.join(formats)}"
        )
    labels = inference.labels_of(config)
    backend = inference.load_backend(model, config, labels)
    out.mkdir(parents=True, exist_ok=True)
    task = tasks.get(config.task)
    # The frameworks' writers open their files by name and follow links: they write into a new
    # folder of the process's own, and each file is then renamed into ``out``, after checking
    # that no name it takes there is a link (one planted there is refused, never written through).
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        files = backend.exporter.export(
            staging, fmt, task.input_shape(config.data), task.pad_value()
        )
        files += inference.write_contract(staging, config, labels)
        spec_path = staging / tasks.CONTRACT_FILE
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
        spec.update(format=fmt, checkpoint=str(model.checkpoint), files=[f.name for f in files])
        spec_path.write_text(json.dumps(spec, indent=2), encoding="utf-8")
        written = sorted(staging.iterdir())
        for path in written:
            refuse_link(out / path.name)
        for path in written:
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    backend.runtime.shutdown()
    return [out / f.name for f in files]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument("--format", required=True, choices=sorted(FORMATS))
    parser.add_argument("--out", required=True, help="directory to write the model into")
    args = parser.parse_args(argv)

    from train import inference
    from train.cli import run_command, setup_logging

    setup_logging(None, True)
    return run_command(unusable=inference.UNUSABLE_MODEL, body=lambda: _export_command(args))


def _export_command(args: argparse.Namespace) -> int:
    from train import inference

    model = inference.find_checkpoint(args.checkpoint or args.run)
    config = inference.run_config(model, args.config, args.overrides)
    for path in export(model, config, args.format, Path(args.out)):
        print(f"{path}\t{path.stat().st_size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
