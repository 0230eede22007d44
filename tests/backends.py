"""Helpers for the backend tests: small CPU configs over the fixture data, and backends started,
fed and built the way the training loop does it (test_backend_contract.py and each backend's
own module)."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from datasets.sampler import EpochSampler
from train import tasks
from train.backends import make_backend
from train.config.load import config_from_dict
from train.config.schema import Config

# OCR lines 32 wide, for tests that build a model without reading the fixture's lines: the
# CRNN's 8 CTC time steps align labels of up to 4 characters (2 L - 1 <= T).
TINY_OCR_DATA = {"image_shape": [3, 16, 32], "max_text_length": 4}


def make_config(framework: str, task: str, data_path: Path, **sections) -> Config:
    """A small CPU config over fixture data; each keyword updates that config section."""
    raw: dict = {
        "task": task,
        "framework": framework,
        "data": {"train": str(data_path), "augment": False},
        "loader": {"batch_size": 8, "num_workers": 0},
        "optim": {"name": "adamw", "lr": 1.0e-3, "schedule": "constant"},
        "train": {"device": "cpu"},
    }
    if task == "ocr":  # the fixture data's side files and a model small enough for the CPU
        raw["data"]["char_dict"] = str(data_path.parent / "charset.txt")
        # The fixture's longest line (datasets/synthetic.py's ocr_samples): a width of 80 or
        # more gives the 2 x 10 - 1 CTC time steps such a line may need.
        raw["data"]["max_text_length"] = 10
        raw["model"] = {"name": "crnn_tiny", "hidden_size": 64}
    else:
        raw["data"].update(
            image_size=32, eval_resize=32
        )  # ResNet's smallest input: 1 x 1 after five halvings
        raw["model"] = {"name": "resnet18"}
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    return config_from_dict(raw)


def start(config: Config, seed: int | None = None):
    backend = make_backend(config)
    backend.runtime.init_distributed()
    backend.runtime.seed_everything(config.seed if seed is None else seed, config.deterministic)
    return backend


def open_dataset(config: Config, train: bool = True):
    """The training dataset and the model's class count, as train/data.py builds them."""
    task = tasks.get(config.task)
    dataset = task.open_dataset(config.data, config.data.train, train=train, seed=config.seed)
    return dataset, task.num_classes(config.model, dataset)


def build(backend, config: Config, num_classes: int, total_steps: int) -> None:
    input_shape = tasks.get(config.task).input_shape(config.data)
    backend.build(config.model, config.optim, input_shape, num_classes, total_steps)


def first_batches(backend, config: Config, count: int) -> tuple[list, int]:
    """The first ``count`` device batches of epoch 0 (loaded in the main process), cycled when
    the dataset has fewer."""
    dataset, num_classes = open_dataset(config)
    loader = backend.batches.make_loader(dataset, EpochSampler(len(dataset)), config.loader, True)
    batches = list(itertools.islice(backend.batches.device_batches(loader), count))
    return [batches[i % len(batches)] for i in range(count)], num_classes


def host_batches(backend, dataset, config: Config, workers: int, epochs: int) -> list[dict]:
    """The training loader's batches over ``epochs`` epochs with ``workers`` workers, as numpy
    arrays on the host."""
    sampler = EpochSampler(len(dataset), seed=config.seed)
    with_workers = dataclasses.replace(config.loader, num_workers=workers)
    loader = backend.batches.make_loader(dataset, sampler, with_workers, True)
    batches = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches += [{k: backend.batches.to_numpy(v) for k, v in batch.items()} for batch in loader]
    return batches


def record_call(marker: str) -> str:
    """What unpickling the payload below would run: the proof that loading executed code."""
    Path(marker).write_text("unpickling ran code")
    return marker


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return record_call, (self.marker,)
