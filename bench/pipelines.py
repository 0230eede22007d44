"""The pipelines under test, each built from a plain dict ``spec`` inside a benchmark child.

Every builder returns a ``Pipeline``: ``epoch(e)`` gives an iterator over that epoch's batches.
Frameworks are imported inside the builders, so this module loads in either venv.

Peers are configured as their own documentation and training scripts do:
- torchvision's references/classification/train.py: ImageFolder + RandomResizedCrop(224),
  RandomHorizontalFlip, PILToTensor-era ToTensor + Normalize, DataLoader(shuffle, pin_memory,
  default collate).
- PaddleOCR's build_dataloader: LMDBDataSet with DecodeImage / CTCLabelEncode / RecResizeImg /
  KeepKeys (+ RecAug), a shuffling BatchSampler, paddle.io.DataLoader with shared memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from datasets.cache import DEFAULT_CACHE_DIR, DEFAULT_CACHE_MAX_BYTES

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
OCR_SHAPE = [3, 48, 320]
MAX_TEXT_LENGTH = 25


@dataclass
class Pipeline:
    epoch: Callable[[int], Iterator]
    close: Callable[[], None] = lambda: None
    handover: str | None = (
        None  # how workers hand a batch over (bench/handover.py); None: 0 workers
    )


def _loader_knobs(spec: dict, torch_dataloader: bool = False) -> dict:
    """The spec's loader knobs; ``torch_dataloader``: as torch's own DataLoader takes them, which
    refuses a prefetch_factor without workers."""
    from train.config.schema import DEFAULT_PREFETCH_FACTOR

    workers = spec["workers"] > 0
    prefetch = spec.get("prefetch", DEFAULT_PREFETCH_FACTOR)
    return {
        "num_workers": spec["workers"],
        "prefetch_factor": None if torch_dataloader and not workers else prefetch,
        "persistent_workers": bool(spec.get("persistent", False)) and workers,
    }


class DecodeOnly:
    """Full-resolution PIL decode, then a free 224x224 corner: the ceiling of any pipeline that
    decodes every pixel. Batches have our shape and dtype, so only the transform differs."""

    def __init__(self, size: int = 224) -> None:
        self.size = size

    def __call__(self, data: bytes, label, rng) -> dict:
        from datasets.decode import load_pil_rgb, open_pil

        image = load_pil_rgb(open_pil(data))
        corner = np.asarray(image.crop((0, 0, self.size, self.size)), dtype=np.uint8)
        return {"image": corner, "label": np.int64(label)}


def epoch_length(spec: dict, size: int) -> int:
    """Samples per epoch: the dataset's, or more when the trial asks for more batches than one
    pass holds (the quick preset's small datasets), so steady-state speed is measured over a
    window long enough to mean something. Every pipeline repeats its dataset the same way:
    a sampler or thin wrapper over indices, never cached results."""
    wanted = spec["batch_size"] * (spec["batches"] + 1) if spec.get("batches") else 0
    return max(size, wanted)


def _dataset_kwargs(spec: dict) -> dict:
    return {
        "cache": spec.get("cache", "none"),
        "cache_dir": spec.get("cache_dir", DEFAULT_CACHE_DIR),
        "cache_max_bytes": spec.get("cache_max_bytes", DEFAULT_CACHE_MAX_BYTES),
    }


def _torch_ours(spec: dict, decode_only: bool = False) -> Pipeline:
    from datasets.dataset import RecordDataset, build_image_dataset
    from datasets.hdf5_images import Hdf5ImageSource
    from datasets.sampler import EpochSampler
    from train.backends.common import LoaderKnobs
    from train.backends.torch.data import make_loader

    if decode_only:
        dataset = RecordDataset(Hdf5ImageSource(spec["hdf5"]), DecodeOnly())
    else:
        dataset = build_image_dataset(spec["hdf5"], train=True, **_dataset_kwargs(spec))
    # Positions past the end wrap around (RecordDataset reads position % len).
    sampler = EpochSampler(epoch_length(spec, len(dataset)), shuffle=True, seed=0)
    knobs = LoaderKnobs(batch_size=spec["batch_size"], **_loader_knobs(spec))
    loader = make_loader(
        dataset,
        sampler,
        knobs,
        pin_memory=spec.get("pin", False),
        batch_ring=spec.get("ring", True),
    )

    def epoch(e: int) -> Iterator:
        sampler.set_epoch(e)
        return iter(loader)

    handover = None
    if knobs.num_workers:
        handover = "ring" if spec.get("ring", True) else "torch_shm"
    return Pipeline(epoch, dataset.close, handover)


def _torchvision_ref(spec: dict) -> Pipeline:
    import torch
    from torchvision import datasets, transforms

    recipe = transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )
    dataset = datasets.ImageFolder(spec["folder"], transform=recipe)
    # shuffle=True is a RandomSampler; num_samples > len(dataset) chains permutations.
    sampler = torch.utils.data.RandomSampler(dataset, num_samples=epoch_length(spec, len(dataset)))
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=spec["batch_size"],
        sampler=sampler,
        pin_memory=spec.get("pin", True),  # the reference always pins
        drop_last=True,
        **_loader_knobs(spec, torch_dataloader=True),
    )
    handover = "torch_shared_collate" if spec["workers"] else None
    return Pipeline(lambda e: iter(loader), handover=handover)


def _paddle_ours_ocr(spec: dict) -> Pipeline:
    from datasets.dataset import build_ocr_dataset
    from datasets.ocr_transforms import CharDict
    from datasets.sampler import EpochSampler
    from train.backends.common import LoaderKnobs
    from train.backends.paddle.data import make_loader

    dataset = build_ocr_dataset(
        spec["lmdb"],
        CharDict.from_file(spec["charset"]),
        train=True,
        augment=spec.get("augment", False),
        image_shape=OCR_SHAPE,
        max_text_length=MAX_TEXT_LENGTH,
        **_dataset_kwargs(spec),
    )
    sampler = EpochSampler(epoch_length(spec, len(dataset)), shuffle=True, seed=0)
    knobs = LoaderKnobs(batch_size=spec["batch_size"], drop_last=True, **_loader_knobs(spec))
    loader = make_loader(
        dataset,
        sampler,
        knobs,
        use_shared_memory=spec.get("shm", True),
        batch_ring=spec.get("ring", True),
    )

    def epoch(e: int) -> Iterator:
        sampler.set_epoch(e)
        return iter(loader)

    handover = None
    if knobs.num_workers:
        handover = (
            "ring" if loader.ring else "paddle_shm" if spec.get("shm", True) else "paddle_pipe"
        )
    return Pipeline(epoch, dataset.close, handover)


def _repeated(dataset, spec: dict):
    """``dataset`` with indices past its end wrapping around (paddle's RandomSampler cannot
    draw more than one permutation); one extra Python call per sample."""
    import paddle

    class Repeated(paddle.io.Dataset):
        def __len__(self) -> int:
            return epoch_length(spec, len(dataset))

        def __getitem__(self, index: int):
            return dataset[index % len(dataset)]

    return Repeated()


def _paddleocr_peer(spec: dict) -> Pipeline:
    import logging

    import paddle
    import paddleocr  # noqa: F401  (puts ppocr on sys.path)
    from ppocr.data.lmdb_dataset import LMDBDataSet

    ops = [{"DecodeImage": {"img_mode": "BGR", "channel_first": False}}]
    if spec.get("augment", False):
        ops.append({"RecAug": None})
    ops += [
        {"CTCLabelEncode": None},
        {"RecResizeImg": {"image_shape": OCR_SHAPE}},
        {"KeepKeys": {"keep_keys": ["image", "label", "length"]}},
    ]
    config = {
        "Global": {
            "character_dict_path": spec["charset"],
            "max_text_length": MAX_TEXT_LENGTH,
            "use_space_char": False,
        },
        "Train": {
            "dataset": {"name": "LMDBDataSet", "data_dir": spec["lmdb"], "transforms": ops},
            "loader": {"shuffle": True, "batch_size_per_card": spec["batch_size"]},
        },
    }
    dataset = _repeated(LMDBDataSet(config, "Train", logging.getLogger("ppocr")), spec)
    batch_sampler = paddle.io.BatchSampler(
        dataset=dataset, batch_size=spec["batch_size"], shuffle=True, drop_last=True
    )
    knobs = _loader_knobs(spec)
    loader = paddle.io.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=knobs["num_workers"],
        prefetch_factor=knobs["prefetch_factor"],
        persistent_workers=knobs["persistent_workers"],
        use_shared_memory=spec.get("shm", True),
        return_list=True,
    )

    def epoch(e: int) -> Iterator:
        # A trial stops after its batches, mid-epoch. Paddle's iterator only stops its workers
        # at the end of an epoch (its reader thread keeps it alive past `del`), so do what the
        # end of an epoch does; otherwise every trial leaves two workers behind in this child.
        iterator = iter(loader)
        try:
            yield from iterator
        finally:
            if not getattr(iterator, "_shutdown", True):
                iterator._try_shutdown_all()

    handover = (
        ("paddle_shm" if spec.get("shm", True) else "paddle_pipe") if spec["workers"] else None
    )
    return Pipeline(epoch, handover=handover)


BUILDERS: dict[str, Callable[[dict], Pipeline]] = {
    "resnet50.ours": _torch_ours,
    "resnet50.decode_only": lambda spec: _torch_ours(spec, decode_only=True),
    "resnet50.torchvision_ref": _torchvision_ref,
    "ocr.ours": _paddle_ours_ocr,
    "ocr.paddleocr": _paddleocr_peer,
}
FRAMEWORK_OF = {name: "torch" if name.startswith("resnet50") else "paddle" for name in BUILDERS}


def batch_nbytes(batch) -> int:
    """Bytes of every array in a batch (dict or list of torch/paddle tensors or numpy)."""
    items = batch.values() if isinstance(batch, dict) else batch
    total = 0
    for item in items:
        if hasattr(item, "nbytes"):  # numpy
            total += int(item.nbytes)
        elif hasattr(item, "nelement"):  # torch
            total += item.element_size() * item.nelement()
        else:  # paddle Tensor
            total += item.element_size() * int(np.prod(item.shape))
    return total


def image_dtype(batch) -> str:
    first = batch["image"] if isinstance(batch, dict) else batch[0]
    return str(first.dtype).replace("torch.", "").replace("paddle.", "")
