"""The data of a run, framework-free: the one resolved config every entry point runs with, and
the run's data as one object.

- :func:`resolve`: a loaded config as it runs on this host: loader.num_workers and
  loader.prefetch_factor counts, s3:// inputs staged once per node into data.remote_cache_dir
  and replaced by their local copies (the URLs kept beside them for reports). python -m train,
  train.evaluate, train.predict, train.export, the doctor, the tuner and python -m train.config
  all get their config from it; no loader sees "auto".
- :class:`RunData`: the datasets of a resolved config, built by its task (train/tasks.py):
  ``open`` on each rank, ``loaders`` for this rank's share, ``close``. :func:`open_split` opens
  one dataset as a run does (the sample policy, the cache), for training, evaluation, the
  doctor and the tuner alike.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from datasets.dataset import RecordDataset
from datasets.errors import DatasetError
from datasets.sampler import EpochSampler
from train import tasks
from train.config.schema import Config
from train.cpus import resolve_num_workers

log = logging.getLogger(__name__)

SPLITS = ("train", "val")


# ---------------------------------------------------------------- the resolved config
@dataclass(frozen=True)
class Resolved:
    """A config as it runs here, and what resolving it decided."""

    config: Config  # loader counts, local data paths
    workers_reason: str  # why loader.num_workers is what it is (logged by each entry point)
    staged: dict[str, str] = field(default_factory=dict)  # data key -> the s3:// URL it came from


def resolve(
    config,
    *,
    local_world_size: int = 1,
    cpu_count: int | None = None,
    stage: tuple[str, ...] | None = SPLITS,
) -> Resolved:
    """``config`` with its loader counts decided for this host and ``local_world_size`` ranks
    per node, and the s3:// inputs of the ``stage`` splits (with the task's input files) staged
    to local paths; ``stage=None`` stages nothing (a report that only reads the config)."""
    workers, reason = resolve_num_workers(config.loader.num_workers, cpu_count, local_world_size)
    resolved = dataclasses.replace(config, loader=config.loader.resolved(workers))
    staged: dict[str, str] = {}
    if stage is not None:
        data, staged = stage_remote(resolved, stage)
        resolved = dataclasses.replace(resolved, data=data)
    return Resolved(resolved, reason, staged)


def stage_remote(config, splits: tuple[str, ...] = SPLITS):
    """(config.data with every s3:// input of ``splits`` and of the task's input files replaced
    by its staged local copy, {key: URL} of those replaced). Staged once per node: remote.stage
    shares one copy between the ranks of a node (datasets/remote.py)."""
    from datasets import remote

    data = config.data
    changes, staged = {}, {}
    for name in (*splits, *tasks.get(config.task).input_files):
        path = getattr(data, name)
        if path and remote.is_remote(path):
            log.info("staging %s into %s", path, data.remote_cache_dir)
            local = remote.stage(
                path, data.remote_cache_dir, cache_max_bytes=data.remote_cache_max_bytes
            )
            changes[name], staged[name] = str(local), path
    return dataclasses.replace(data, **changes), staged


# ---------------------------------------------------------------- the run's data
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


def open_split(config, split: str, path=None, run_dir: Path | None = None, **policy):
    """The dataset at ``path`` (default: the config's ``split``, data.train or data.val) opened
    as a run opens it: the task's transform (augmented for training), the sample policy, the
    cache for training only (one pass per evaluation: caching buys little). Bad records go to
    ``run_dir``/bad_samples.<split>.tsv, which a later run can skip; ``policy`` overrides the
    config's (the tuner measures without a cache)."""
    data = config.data
    chosen = dict(sample_policy(data))
    if split != "train":
        chosen["cache"] = "none"
    if run_dir is not None:
        chosen["bad_keys_file"] = run_dir / f"bad_samples.{split}.tsv"
    chosen.update(policy)
    return tasks.get(config.task).open_dataset(
        data,
        getattr(data, split) if path is None else path,
        train=split == "train",
        seed=config.seed,
        **chosen,
    )


@dataclass
class RunData:
    """The datasets of a run: ``open`` builds them on each rank from a resolved config (its
    data already local), ``loaders`` gives this rank's share, ``close`` releases the handles."""

    train: RecordDataset
    val: RecordDataset | None
    num_classes: int  # model outputs; includes the CTC blank for OCR

    @classmethod
    def open(cls, config, run_dir: Path | None = None) -> RunData:
        """The training and validation datasets of ``config`` (resolved: local paths), with the
        model's class count checked against the data."""
        task = tasks.get(config.task)
        built: dict[str, RecordDataset] = {}
        try:
            for split in SPLITS:
                if getattr(config.data, split):
                    built[split] = open_split(config, split, run_dir=run_dir)
            num_classes = task.num_classes(config.model, built["train"])
            if task.loss == "cross_entropy":
                for split, dataset in built.items():
                    check_class_count(config.model, dataset, getattr(config.data, split))
        except BaseException:
            for dataset in built.values():
                dataset.close()
            raise
        return cls(built["train"], built.get("val"), num_classes)

    def loaders(self, config, backend, dist, train_loader_cfg=None):
        """This rank's share of each epoch, in batches of uint8 arrays: the training sampler
        and loader (at ``train_loader_cfg``, default config.loader: loader.autotune may set
        another), and the validation ones (None without validation data)."""
        loader_cfg = config.loader
        sampler = EpochSampler(
            len(self.train),
            shuffle=True,
            seed=config.seed,
            rank=dist.rank,
            world_size=dist.world_size,
        )
        if len(sampler) // loader_cfg.batch_size < 1:
            raise DatasetError(
                f"loader.batch_size {loader_cfg.batch_size} is larger than this rank's "
                f"{len(sampler)} samples of {config.data.train}",
                "lower loader.batch_size (or use fewer ranks)",
            )
        loader = self.train_loader(backend, sampler, train_loader_cfg or loader_cfg)
        val_sampler = val_loader = None
        if self.val is not None:
            val_sampler = EpochSampler(
                len(self.val), shuffle=False, rank=dist.rank, world_size=dist.world_size
            )
            val_loader = backend.batches.make_loader(self.val, val_sampler, loader_cfg, train=False)
        return sampler, loader, val_sampler, val_loader

    def train_loader(self, backend, sampler, loader_cfg):
        """The training loader over ``sampler`` at ``loader_cfg``, with the trainer's CPU
        threads set for its worker count (a CPU step shares the cores with the workers)."""
        backend.batches.set_cpu_threads(loader_cfg.num_workers)
        return backend.batches.make_loader(self.train, sampler, loader_cfg, train=True)

    def use_train_cache(self, config, mode: str) -> None:
        """The training dataset's record cache set to ``mode`` (none, memory or disk), as
        opening it with data.cache: ``mode`` would have made it; the old one is closed (a
        memory cache's /dev/shm file removed). Only while no loader reads the dataset: a
        loader's workers hold the cache they started with."""
        from datasets.cache import SharedRecordCache

        data, old = config.data, self.train.cache
        self.train.cache = None
        if mode != "none":
            self.train.cache = SharedRecordCache(
                mode, len(self.train.source), data.cache_max_bytes, str(data.train), data.cache_dir
            )
        if old is not None:
            old.close()

    def close(self) -> None:
        for dataset in (self.train, self.val):
            if dataset is not None:
                dataset.close()


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
