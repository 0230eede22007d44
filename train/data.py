"""Datasets for a run, built from the config by its task (train/tasks.py); framework-free.

Remote (s3://) sources are staged once per node into data.remote_cache_dir first
(:func:`stage_remote`), then read locally through the same per-worker handles as local data.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datasets.dataset import RecordDataset
from datasets.errors import DatasetError
from datasets.sampler import EpochSampler
from train import tasks

log = logging.getLogger(__name__)


@dataclass
class RunData:
    train: RecordDataset
    val: RecordDataset | None
    num_classes: int  # model outputs; includes the CTC blank for OCR

    def close(self) -> None:
        for dataset in (self.train, self.val):
            if dataset is not None:
                dataset.close()


def stage_remote(config):
    """config.data with every s3:// input (data.train, data.val and the task's input files)
    replaced by its staged local copy; local paths are kept as they are."""
    from datasets import remote

    data = config.data
    changes = {}
    for name in ("train", "val", *tasks.get(config.task).input_files):
        path = getattr(data, name)
        if path and remote.is_remote(path):
            log.info("staging %s into %s", path, data.remote_cache_dir)
            staged = remote.stage(
                path, data.remote_cache_dir, max_cache_bytes=data.remote_cache_max_bytes
            )
            changes[name] = str(staged)
    return dataclasses.replace(data, **changes)


def build_run_data(config, run_dir: Path, local_data=None) -> RunData:
    """The training and validation datasets of ``config``. ``local_data`` is config.data with
    local paths (:func:`stage_remote`, which python -m train calls before it imports a
    framework); None: staged here."""
    task = tasks.get(config.task)
    data = local_data if local_data is not None else stage_remote(config)
    policy = sample_policy(data)
    built: dict[str, RecordDataset] = {}
    for split, path in (("train", data.train), ("val", data.val)):
        if not path:
            continue
        # Bad records of each split go to their own file, which a later run can skip.
        extra = dict(policy, bad_keys_file=run_dir / f"bad_samples.{split}.tsv")
        if split == "val":
            extra["cache"] = "none"  # one pass per evaluation: caching buys little
        built[split] = task.open_dataset(
            data, path, train=split == "train", seed=config.seed, **extra
        )
    try:
        num_classes = task.num_classes(config.model, built["train"])
        if task.loss == "cross_entropy":
            for split, path in (("train", data.train), ("val", data.val)):
                if split in built:
                    check_class_count(config.model, built[split], path)
    except BaseException:
        for dataset in built.values():
            dataset.close()
        raise
    return RunData(built["train"], built.get("val"), num_classes)


def check_class_count(model, dataset: RecordDataset, path: str) -> None:
    """Raise DatasetError when model.num_classes leaves out a class the data at ``path`` holds:
    the model has no output for it, and the loss would index past the scores (a framework's
    traceback on the CPU, a device-side assert on a GPU). Read at open from the labels the
    source lists (a task with one class id per image); a label past the data's own class names
    is a bad sample of its record (bad_label), not counted here."""
    names = getattr(dataset.source, "class_names", None)
    labels = getattr(dataset.source, "labels", None)
    if model.num_classes is None or names is None or labels is None or not len(labels):
        return
    labels = np.asarray(labels)
    named = labels[(labels >= 0) & (labels < len(names))]
    largest = int(named.max()) if len(named) else -1
    if largest >= model.num_classes:
        raise DatasetError(
            f"{path} holds class {largest} ({names[largest]!r}) but model.num_classes is "
            f"{model.num_classes}: the model's outputs are classes 0..{model.num_classes - 1}",
            f"set model.num_classes to at least {largest + 1} (the data names {len(names)} "
            "classes), or remove it to take the count from the data",
        )


def sample_policy(data) -> dict:
    """What a task's open_dataset takes besides the path, from the data section: the bad-sample
    bound, the keys to skip and the record cache."""
    return dict(
        max_bad_fraction=data.max_bad_fraction,
        skip_keys_file=data.skip_keys_file,
        cache=data.cache,
        cache_max_bytes=data.cache_max_bytes,
        cache_dir=data.cache_dir,
    )


def make_loaders(config, backend, dist, data: RunData):
    """This rank's share of each epoch, in batches of uint8 arrays: the training sampler and
    loader, and the validation ones (None without validation data). ``config.loader`` has its
    worker count resolved (train.cpus.resolve_loader)."""
    loader_cfg = config.loader
    sampler = EpochSampler(
        len(data.train), shuffle=True, seed=config.seed, rank=dist.rank, world_size=dist.world_size
    )
    backend.set_cpu_threads(loader_cfg.num_workers)
    loader = backend.make_loader(data.train, sampler, loader_cfg, train=True)
    val_sampler = val_loader = None
    if data.val is not None:
        val_sampler = EpochSampler(
            len(data.val), shuffle=False, rank=dist.rank, world_size=dist.world_size
        )
        val_loader = backend.make_loader(data.val, val_sampler, loader_cfg, train=False)
    if len(sampler) // loader_cfg.batch_size < 1:
        raise DatasetError(
            f"loader.batch_size {loader_cfg.batch_size} is larger than this rank's "
            f"{len(sampler)} samples of {config.data.train}",
            "lower loader.batch_size (or use fewer ranks)",
        )
    return sampler, loader, val_sampler, val_loader
