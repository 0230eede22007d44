"""After training, framework-free: what train.evaluate, train.export and train.predict share.

- the model a path names: a checkpoint (``checkpoints/step-X``, ``best/``) or a run directory
  (its best, else its latest), with the run's config (``config.resolved.yaml``);
- the preprocessing contract (``preprocess.json`` beside exported weights): image shape, channel
  order, resize, padding and normalization, the dictionary or class names; the task's part
  comes from its spec (Task.contract, train/tasks.py), and ``preprocess`` applies it to encoded
  images exactly as evaluation does (Task.prepare_image), then normalizes in float32 as the
  backends do on the device;
- the decoding of a model's probabilities into text or labels with a score, by the task's loss
  kind: CTC as PaddleOCR's CTCLabelDecode (argmax per time step, repeats merged, blanks dropped;
  the score is the mean of the kept steps' probabilities), cross-entropy the top class and its
  probability, multi-label the labels above 0.5 (the score: the probability of that set);
- the inputs of train.predict: image files, folders, an OCR LMDB or an HDF5 file.

The framework parts (running a checkpoint, exporting, the Paddle inference predictor) are in the
backends; ONNX Runtime is no training framework and runs here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datasets import sources
from datasets.sources import IMAGE_SUFFIXES
from train import checkpoint, tasks
from train.config.load import RESOLVED_NAME
from train.tasks import CONTRACT_FILE, TAG_SEPARATOR


class InferenceError(Exception):
    """A path or a model that train.evaluate/export/predict cannot use; the message has the
    fix after HINT:."""


# What train.evaluate, train.export and train.predict report as a model they cannot use (exit 4,
# train.cli.run_command): ValueError and FileNotFoundError are what the frameworks raise for
# weights they cannot read.
UNUSABLE_MODEL = (InferenceError, ValueError, FileNotFoundError)


# ---------------------------------------------------------------- checkpoints and their runs
@dataclass(frozen=True)
class TrainedModel:
    checkpoint: Path  # the checkpoint directory read
    run_dir: Path  # the run it belongs to (its config.resolved.yaml)
    framework: str
    task: str


def find_checkpoint(path: str | Path) -> TrainedModel:
    """The checkpoint ``path`` names (a run directory: its best/, else its latest)."""
    given = Path(path)
    if (given / "trainer.json").is_file():
        found = given
    elif given.is_dir():
        found = checkpoint.best_or_latest(given)
    else:
        raise InferenceError(f"{given} does not exist. HINT: {_CHECKPOINT_HINT}")
    if found is None:
        raise InferenceError(f"{given} holds no checkpoint. HINT: {_CHECKPOINT_HINT}")
    # checkpoints/step-X -> the run is two levels up; best/ -> one.
    run_dir = found.parent.parent if found.parent.name == "checkpoints" else found.parent
    meta = json.loads((found / "trainer.json").read_text(encoding="utf-8"))
    return TrainedModel(found, run_dir, meta["framework"], meta["task"])


_CHECKPOINT_HINT = (
    "give a run directory (its best/, else its latest checkpoint), RUN/best or "
    "RUN/checkpoints/step-XXXXXXXX"
)


def run_config(
    model: TrainedModel | None,
    config_path: str | None = None,
    overrides=(),
    stage: tuple[str, ...] | None = None,
):
    """The config of the run that wrote ``model`` (or ``config_path``), with ``overrides``,
    resolved for this host (train.data.resolve; the s3:// inputs of ``stage`` staged).
    model.init_from is dropped: its weights are in the checkpoint, and its file may be gone."""
    from train.config.load import load_config
    from train.data import resolve

    path = Path(config_path) if config_path else model.run_dir / RESOLVED_NAME
    if not path.is_file():
        raise InferenceError(
            f"{path} not found. HINT: pass --config with the scenario the run was trained with"
        )
    return resolve(load_config(path, ["model.init_from=null", *overrides]), stage=stage).config


def labels_of(config) -> list[str]:
    """The names of the model's classes by id, as training read them (Task.labels): OCR's
    characters (class c is characters[c - 1], 0 the CTC blank), or the class names."""
    return tasks.get(config.task).labels(config)


def num_classes(config, labels: list[str]) -> int:
    """The model's outputs for ``labels``: with CTC's blank when the task's loss has one."""
    return tasks.get(config.task).num_outputs(labels)


# ---------------------------------------------------------------- the preprocessing contract
def contract(config) -> dict:
    """What an exported model expects and returns, written as preprocess.json beside it: what
    every task's has, then the task's own part (Task.contract)."""
    task = tasks.get(config.task)
    common = {
        "task": config.task,
        "model": config.model.name,
        "framework": config.framework,
        "normalize": "x / 255 then (x - mean) / std per channel, in the channel order below",
        "mean": list(task.mean),
        "std": list(task.std),
        "layout": "NCHW float32",
    }
    return {**common, **task.contract(config)}


def write_contract(directory: Path, config, labels: list[str]) -> list[Path]:
    """preprocess.json and the dictionary or class names, in ``directory``."""
    spec = contract(config)
    names = directory / (spec.get("dictionary") or spec["classes"])
    if spec.get("use_space_char"):
        labels = labels[:-1]  # CharDict appended the space; PaddleOCR appends it itself
    names.write_text("".join(f"{label}\n" for label in labels), encoding="utf-8")
    path = directory / CONTRACT_FILE
    path.write_text(json.dumps(spec, indent=2), encoding="utf-8")
    return [path, names]


def read_contract(directory: Path) -> tuple[dict, list[str]]:
    """An exported model's contract and its labels (the dictionary: without the CTC blank)."""
    path = Path(directory) / CONTRACT_FILE
    if not path.is_file():
        raise InferenceError(
            f"{directory} has no {CONTRACT_FILE}. HINT: export with python -m train.export, "
            "which writes it beside the weights"
        )
    spec = json.loads(path.read_text(encoding="utf-8"))
    names_file = Path(directory) / (spec.get("dictionary") or spec["classes"])
    labels = [line.rstrip("\r") for line in names_file.read_text(encoding="utf-8").split("\n")]
    labels = [label for label in labels if label]
    if spec.get("use_space_char"):
        labels.append(" ")  # the space the dictionary file leaves out, as PaddleOCR reads it
    return spec, labels


def preprocess(spec: dict, encoded: list[bytes]) -> np.ndarray:
    """Encoded images -> the model's float32 NCHW batch, as evaluation builds it."""
    task = tasks.get(spec["task"])
    images = [task.prepare_image(spec, data) for data in encoded]
    batch = np.stack(images).transpose(0, 3, 1, 2).astype(np.float32)
    scale, shift = task.pixel_scale_shift()
    return batch * scale + shift


def softmax(scores: np.ndarray) -> np.ndarray:
    shifted = scores - scores.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


def sigmoid(scores: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-scores))


def probabilities(task_name: str, scores: np.ndarray) -> np.ndarray:
    """A model's raw scores -> the probabilities its export outputs, by the task's loss kind."""
    return DECODERS[tasks.get(task_name).loss].probabilities(scores)


def decode(task_name: str, probabilities: np.ndarray, labels: list[str]) -> list[tuple[str, float]]:
    """(text or label, score) per row of a batch of probabilities, by the task's loss kind."""
    return DECODERS[tasks.get(task_name).loss].decode(probabilities, labels)


def _decode_ctc(probabilities: np.ndarray, labels: list[str]) -> list[tuple[str, float]]:
    """[N, T, 1 + labels]: best path, repeats merged, blanks (class 0) dropped, the labels
    joined into text; the score is the mean probability of the kept steps."""
    results = []
    classes, best = probabilities.argmax(axis=2), probabilities.max(axis=2)
    for row, probs in zip(classes, best):
        keep = np.ones(len(row), dtype=bool)
        keep[1:] = row[1:] != row[:-1]
        keep &= row != 0
        text = "".join(labels[c - 1] for c in row[keep])
        results.append((text, float(probs[keep].mean()) if keep.any() else 0.0))
    return results


def _decode_top_class(probabilities: np.ndarray, labels: list[str]) -> list[tuple[str, float]]:
    """[N, labels]: the most probable label and its probability."""
    results = []
    for probs in probabilities:
        top = int(probs.argmax())
        results.append((labels[top], float(probs[top])))
    return results


def _decode_tags(probabilities: np.ndarray, labels: list[str]) -> list[tuple[str, float]]:
    """[N, labels] independent probabilities: the labels above 0.5 in label order, joined
    with TAG_SEPARATOR (empty: none); the score is the probability of exactly that set (each
    label's own probability of being in or out, multiplied)."""
    results = []
    for probs in probabilities:
        chosen = probs > 0.5
        text = TAG_SEPARATOR.join(label for label, on in zip(labels, chosen) if on)
        results.append((text, float(np.prod(np.where(chosen, probs, 1.0 - probs)))))
    return results


@dataclass(frozen=True)
class Decoding:
    """What after training does with a model's outputs, for one loss kind."""

    # raw scores -> the probabilities the exported model outputs (the backends' export applies
    # the same, HEADS' Head.probabilities)
    probabilities: Callable[[np.ndarray], np.ndarray]
    # probabilities, labels -> (text or label, score) per row
    decode: Callable[[np.ndarray, list[str]], list[tuple[str, float]]]


DECODERS = {  # by Task.loss
    "ctc": Decoding(softmax, _decode_ctc),
    "cross_entropy": Decoding(softmax, _decode_top_class),
    "multi_label": Decoding(sigmoid, _decode_tags),
}


# ---------------------------------------------------------------- inputs of train.predict
def read_inputs(
    paths: list[str], task_name: str | None = None
) -> Iterator[tuple[str, bytes, object]]:
    """(name, encoded image, label or None) for each image of ``paths``, each path read as
    datasets/sources.py finds it: an image file; an image folder, searched recursively for image
    files (no class folders needed); an OCR LMDB (tree); an HDF5 file of images, whose labels
    are those ``task_name`` reads (Task.label_source; default: the class)."""
    task = tasks.get(task_name) if task_name else None
    for given in map(Path, paths):
        found = sources.detect_format(given)
        if found == sources.IMAGE_FILE:
            yield str(given), given.read_bytes(), None
        elif found == sources.IMAGE_FOLDER:
            files = sorted(p for p in given.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
            yield from ((str(p), p.read_bytes(), None) for p in files)
        elif found == sources.HDF5 and task is not None and task.label_source is not None:
            yield from _records(task.label_source(given))
        else:
            yield from _records(sources.open_source(given, (found,), reader="train.predict"))


def _records(source) -> Iterator[tuple[str, bytes, object]]:
    try:
        for index in range(len(source)):
            data, label = source.read(index)
            yield source.key(index), data, label
    finally:
        source.close()


def batched(items, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def framework_missing(framework: str, path: Path) -> InferenceError:
    """The error for a model whose framework this Python environment lacks."""
    return InferenceError(
        f"{path} needs {framework}, which this Python environment lacks. HINT: run with "
        f".venv-{framework}/bin/python (or in the {framework} image)"
    )


def load_backend(model: TrainedModel, config, labels: list[str]):
    """A backend (config.framework's) holding the checkpoint's model, ready for predict() and
    infer(): built as training built it, then the checkpoint's state loaded."""
    if config.framework != model.framework:
        raise InferenceError(
            f"{model.checkpoint} was trained with {model.framework}, the config says "
            f"{config.framework}. HINT: run with the {model.framework} environment and config"
        )
    backend = _built_backend(config, labels, model.checkpoint)
    backend.state.load_state(model.checkpoint)
    return backend


def load_weights(path: str, config, labels: list[str]):
    """A backend holding ``path``'s weights (anything model.init_from takes) in the config's
    model. Every tensor of the model must come from ``path``: evaluating a partly fresh model
    would report figures of weights nobody trained."""
    backend = _built_backend(config, labels, Path(path))
    report = backend.state.init_weights_from(path)
    if report.missing or report.shape_mismatched:
        backend.runtime.shutdown()
        raise InferenceError(
            f"{path} does not hold the whole {config.model.name} model: "
            f"{len(report.missing)} of its tensors are missing (first: {report.missing[:3]}), "
            f"{len(report.shape_mismatched)} have another shape (first: "
            f"{list(report.shape_mismatched.items())[:3]}). HINT: give --config the scenario "
            "these weights were trained or converted for (model.name, data.char_dict, "
            "data.image_shape)"
        )
    return backend


def _built_backend(config, labels: list[str], origin: Path):
    from train.backends import make_backend

    config = _uncompiled(config)
    try:
        backend = make_backend(config)
    except ImportError as error:
        raise framework_missing(config.framework, origin) from error
    backend.runtime.init_distributed()
    backend.runtime.seed_everything(config.seed, config.deterministic)
    input_shape = tasks.get(config.task).input_shape(config.data)
    backend.build(config.model, config.optim, input_shape, num_classes(config, labels), 1)
    return backend


def _uncompiled(config):
    """``config`` with train.compile off. After training only the bare model runs (predict,
    infer, export's tracing), never the compiled training step, and checkpoints are the same
    files either way; built with compile on, torch's backend would check for the C compiler
    torch.compile needs and refuse a host without one, such as an export or serving host."""
    return dataclasses.replace(config, train=dataclasses.replace(config.train, compile=False))
