"""Tagging: any number of tags per image (multi-label), on HDF5 image files that hold each
image's tags (datasets/hdf5_images.py: the /tags dataset; scripts/make_synthetic.py imagenet
writes them). The whole task is this file and configs/tagging/: it reuses the classification
task's images, models and preprocessing, and trains with the multi_label loss kind (a sigmoid
and binary cross-entropy per tag) that both backends have.
"""

from __future__ import annotations

from pathlib import Path

from train.metrics import MultiLabelMetric
from train.tasks import (
    TAG_SEPARATOR,
    ImageData,
    Model,
    Task,
    image_contract,
    image_problems,
    prepare_image,
)

# The sample-size estimate's tag count when data.train is not a local file yet (s3://, staged
# later); the estimate only sizes /dev/shm, and the loop measures a real sample before it.
ASSUMED_TAGS = 64


def _open_tagged(data, path: str, *, train: bool, seed: int = 0, **policy):
    from datasets.dataset import build_tagged_image_dataset

    return build_tagged_image_dataset(
        path,
        train=train,
        seed=seed,
        image_size=data.image_size,
        eval_resize=data.eval_resize,
        max_image_pixels=data.max_image_pixels,
        reader="the tagging task",
        **policy,
    )


def _num_tags(model, train_set) -> int:
    """One output per tag of the data: the multi-hot labels have exactly that many."""
    from datasets.errors import DatasetError

    tags = len(train_set.source.class_names)
    if model.num_classes is not None and model.num_classes != tags:
        raise DatasetError(
            f"model.num_classes: {model.num_classes}, but the tagging task has one output per "
            f"tag of the data ({tags})",
            "remove model.num_classes",
        )
    return tags


def _tag_names(config) -> list[str]:
    """The training data's tag names, by the column of each in its /tags."""
    dataset = _open_tagged(config.data, config.data.train, train=False)
    try:
        return list(dataset.source.class_names)
    finally:
        dataset.close()


def _contract(config) -> dict:
    return {
        **image_contract(config),
        "output": "[N, tags] independent sigmoid probabilities, one per tag of the classes file",
        "decode": f"the tags above 0.5, in the classes file's order, joined by {TAG_SEPARATOR!r}",
    }


def _sample_bytes(data) -> int:
    """RGB image and float32 multi-hot tags (their count read from data.train when local)."""
    tags = ASSUMED_TAGS
    if Path(data.train).is_file():
        from datasets.sources import open_tag_source

        source = open_tag_source(data.train, reader="the tagging task")
        tags = len(source.class_names)
        source.close()
    return 3 * data.image_size**2 + 4 * tags


def _tags_text(label, labels) -> str:
    """A record's tags (bit i set: tag i, datasets/hdf5_images.py's Hdf5TagSource) as the
    decoded predictions read them: their names in tag order, joined."""

    return TAG_SEPARATOR.join(name for i, name in enumerate(labels) if (int(label) >> i) & 1)


def _tag_source(path):
    from datasets.sources import open_tag_source

    return open_tag_source(path, reader="the tagging task")


TASK = Task(
    name="tagging",
    models=(Model("resnet50", "resnet", 25.6e6), Model("resnet18", "resnet", 11.7e6)),
    label_keys=("label",),  # float32 multi-hot [tags]
    mean=(0.485, 0.456, 0.406),  # ImageNet's, RGB, as the classification task's
    std=(0.229, 0.224, 0.225),
    loss="multi_label",
    metric=MultiLabelMetric,
    data=ImageData,  # the classification task's data keys: image_size, eval_resize
    open_dataset=_open_tagged,
    num_classes=_num_tags,
    input_shape=lambda data: (3, data.image_size, data.image_size),
    sample_bytes=_sample_bytes,
    problems=image_problems,
    labels=_tag_names,
    contract=_contract,
    prepare_image=prepare_image,
    label_text=_tags_text,
    label_source=_tag_source,
)
