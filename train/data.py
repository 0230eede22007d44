"""Datasets for a run, built from the config (framework-free).

Remote (s3://) sources are staged once per node into data.remote_cache_dir first, then read
locally through the same per-worker handles as local data.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from datasets.dataset import RecordDataset, build_image_dataset, build_ocr_dataset
from datasets.ocr_transforms import CharDict

log = logging.getLogger(__name__)


@dataclass
class RunData:
    train: RecordDataset
    val: RecordDataset | None
    num_classes: int  # model outputs; includes the CTC blank for OCR
    char_dict: CharDict | None

    def close(self) -> None:
        for dataset in (self.train, self.val):
            if dataset is not None:
                dataset.close()


def local_path(path: str, config) -> str:
    """The local path of a dataset: staged first when it is an s3:// URL."""
    from datasets import remote

    if not remote.is_remote(path):
        return path
    log.info("staging %s into %s", path, config.data.remote_cache_dir)
    staged = remote.stage(
        path, config.data.remote_cache_dir, max_cache_bytes=config.data.remote_cache_max_bytes
    )
    return str(staged)


def build_run_data(config, run_dir: Path) -> RunData:
    data = config.data
    common = dict(
        seed=config.seed,
        max_bad_fraction=data.max_bad_fraction,
        skip_keys_file=data.skip_keys_file,
        cache=data.cache,
        cache_max_bytes=data.cache_max_bytes,
        cache_dir=data.cache_dir,
    )
    paths = {"train": local_path(data.train, config)}
    if data.val:
        paths["val"] = local_path(data.val, config)
    built: dict[str, RecordDataset] = {}
    char_dict = None
    for split, path in paths.items():
        # Bad records of each split go to their own file, which a later run can skip.
        extra = dict(common, bad_keys_file=run_dir / f"bad_samples.{split}.tsv")
        if split == "val":
            extra["cache"] = "none"  # one pass per evaluation: caching buys little
        if config.task == "ocr":
            char_dict = char_dict or CharDict.from_file(
                local_path(data.char_dict, config), data.use_space_char
            )
            built[split] = build_ocr_dataset(
                path,
                char_dict,
                train=split == "train",
                image_shape=tuple(data.image_shape),
                max_text_length=data.max_text_length,
                augment=data.augment,
                **extra,
            )
        else:
            built[split] = build_image_dataset(
                path,
                train=split == "train",
                image_size=data.image_size,
                eval_resize=data.eval_resize,
                **extra,
            )
    if config.task == "ocr":
        num_classes = char_dict.num_classes
    else:
        num_classes = config.model.num_classes or len(built["train"].source.class_names)
    return RunData(built["train"], built.get("val"), num_classes, char_dict)
