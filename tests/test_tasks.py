"""The task spec (train/tasks.py) and the helpers both backends share
(train/backends/common.py): framework-free, so these run in both environments."""

from __future__ import annotations

import dataclasses
import logging
import typing

import numpy as np
import pytest

from train import tasks
from train.backends.common import LoaderKnobs, amp_dtype, crnn_plan, pad_top_k, stack_samples
from train.config.load import config_from_dict
from train.config.schema import DEFAULT_PREFETCH_FACTOR, Config, LoaderConfig, ModelConfig


def test_model_names_are_listed_once_and_the_config_takes_them_from_the_spec():
    assert len(set(tasks.MODEL_NAMES)) == len(tasks.MODEL_NAMES)  # each model once
    hints = typing.get_type_hints(Config)
    assert typing.get_args(hints["task"]) == tasks.TASK_NAMES
    (choice, _none) = typing.get_args(typing.get_type_hints(ModelConfig)["name"])
    assert typing.get_args(choice) == tasks.MODEL_NAMES
    for task in tasks.TASKS.values():
        assert task.model(None) is task.models[0]
        assert all(task.model(name).name == name for name in task.model_names)


@pytest.mark.parametrize("name", tasks.TASK_NAMES)
def test_pixel_scale_and_shift_are_the_mean_and_std(name):
    task = tasks.get(name)
    scale, shift = task.pixel_scale_shift()
    assert scale.dtype == shift.dtype == np.float32 and scale.shape == (1, len(task.mean), 1, 1)
    pixels = np.arange(256, dtype=np.float64).reshape(1, 1, 1, 256)
    expected = (pixels / 255 - np.reshape(task.mean, (1, -1, 1, 1))) / np.reshape(
        task.std, (1, -1, 1, 1)
    )
    np.testing.assert_allclose(pixels * scale + shift, expected, atol=1e-5)


def test_a_model_with_its_own_pixel_contract_normalizes_with_it():
    """ppocrv4_rec keeps the per-channel normalization its released weights were trained with;
    the CRNNs keep the OCR task's."""
    from dataclasses import replace

    ocr = tasks.get("ocr")
    own = ocr.model("ppocrv4_rec")
    scale, shift = ocr.pixel_scale_shift(own)
    assert scale.shape == shift.shape == (1, 3, 1, 1)
    np.testing.assert_allclose(255 * scale + shift, 1.0, atol=1e-6)  # white -> 1
    np.testing.assert_allclose(shift, -1.0, atol=1e-6)  # black -> -1
    assert ocr.pixel_scale_shift(ocr.model("crnn"))[0].shape == (1, 1, 1, 1)  # the task's
    other = replace(own, mean=(0.2, 0.4, 0.6), std=(0.5, 0.5, 0.5))
    np.testing.assert_allclose(ocr.pixel_scale_shift(other)[1].ravel(), [-0.4, -0.8, -1.2])


def fixture_configs(ocr_lmdb, image_h5):
    """(task name, config, task) for each task over the test fixtures' data."""
    data_by_task = {
        "ocr": {"train": str(ocr_lmdb), "char_dict": str(ocr_lmdb.parent / "charset.txt")},
        "classification": {"train": str(image_h5), "image_size": 64, "eval_resize": 72},
        "tagging": {"train": str(image_h5), "image_size": 64, "eval_resize": 72},
    }
    for name, data in data_by_task.items():
        config = config_from_dict({"task": name, "framework": "torch", "data": data})
        yield name, config, tasks.get(name)


def test_sample_bytes_match_a_real_sample(ocr_lmdb, image_h5):
    """The /dev/shm estimate before any data is read (train/preflight.py) is the size of what
    the dataset really yields."""
    for name, config, task in fixture_configs(ocr_lmdb, image_h5):
        dataset = task.open_dataset(config.data, config.data.train, train=True)
        sample = dataset[0]
        dataset.close()
        assert set(sample) == {"image", *task.label_keys}
        assert sum(np.asarray(v).nbytes for v in sample.values()) == task.sample_bytes(config.data)
        assert sample["image"].shape == tuple(np.roll(task.input_shape(config.data), -1)), name


def test_num_classes_come_from_the_data_unless_the_config_says():
    ocr = tasks.get("ocr")
    fake_ocr = type(
        "D", (), {"transform": type("T", (), {"char_dict": type("C", (), {"num_classes": 11})})}
    )
    assert ocr.num_classes(ModelConfig(), fake_ocr) == 11
    resnet = tasks.get("classification")
    fake = type("D", (), {"source": type("S", (), {"class_names": ["a", "b", "c"]})})
    assert resnet.num_classes(ModelConfig(), fake) == 3
    assert resnet.num_classes(ModelConfig(num_classes=1000), fake) == 1000


def test_after_training_the_labels_give_the_outputs_training_built(ocr_lmdb, image_h5):
    """train.evaluate, export and predict build the model from Task.labels and the loss kind:
    the same outputs as training's num_classes from the data."""
    for name, config, task in fixture_configs(ocr_lmdb, image_h5):
        dataset = task.open_dataset(config.data, config.data.train, train=False)
        trained = task.num_classes(config.model, dataset)
        dataset.close()
        assert task.num_outputs(task.labels(config)) == trained, name


def test_each_loss_kind_decodes_after_training_and_a_task_needs_a_known_one():
    from dataclasses import replace

    from train import inference

    assert set(inference.DECODERS) == set(tasks.LOSSES)
    with pytest.raises(ValueError, match="loss 'focal'"):
        replace(tasks.get("classification"), loss="focal")


def test_the_pad_value_is_the_padding_pixel_normalized():
    """OCR pads lines with uint8 128 (datasets/ocr_transforms.py), 1/255 after [-1, 1]; the
    exported model reads 0 as it. ResNet never pads."""
    from datasets.ocr_transforms import PAD_VALUE

    assert tasks.get("ocr").pad_pixel() == PAD_VALUE
    assert tasks.get("ocr").pad_value() == pytest.approx((PAD_VALUE / 255 - 0.5) / 0.5, abs=1e-6)
    assert tasks.get("classification").pad_value() is None


# ---------------------------------------------------------------- train/backends/common.py
def test_stack_samples_and_top_k_padding():
    samples = [{"image": np.full((2, 3), i, np.uint8), "label": np.int64(i)} for i in range(4)]
    stacked = stack_samples(samples)
    assert stacked["image"].shape == (4, 2, 3) and stacked["image"].dtype == np.uint8
    assert stacked["label"].tolist() == [0, 1, 2, 3] and stacked["label"].dtype == np.int64
    top = pad_top_k(np.array([[3, 1, 2], [0, 2, 1]], dtype=np.int32))
    assert top.dtype == np.int64 and top.tolist() == [[3, 1, 2, -1, -1], [0, 2, 1, -1, -1]]
    assert pad_top_k(np.arange(10).reshape(2, 5)).tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_loader_knobs_follow_the_batching_rule():
    loader = LoaderConfig(
        batch_size=32, eval_batch_size=100, drop_last=True, prefetch_factor=3, num_workers=4
    )
    train = LoaderKnobs.of(loader, train=True)
    assert (train.batch_size, train.drop_last) == (32, True)
    evaluation = LoaderKnobs.of(loader, train=False)
    assert (evaluation.batch_size, evaluation.drop_last) == (100, False)
    assert train == LoaderKnobs(32, True, 4, 3, False, None, 120.0)
    no_workers = dataclasses.replace(loader, num_workers=0, prefetch_factor=None)
    assert LoaderKnobs.of(no_workers, train=True).num_workers == 0
    # An unset prefetch is the one default, whichever code builds the knobs.
    unset = dataclasses.replace(loader, prefetch_factor=None)
    assert LoaderKnobs.of(unset, train=True).prefetch_factor == DEFAULT_PREFETCH_FACTOR


def test_loader_knobs_take_a_resolved_worker_count():
    unresolved = LoaderConfig()  # num_workers: auto
    with pytest.raises(ValueError, match="train.data.resolve"):
        LoaderKnobs.of(unresolved, train=True)


def test_amp_dtype_and_the_cpu_warning(caplog):
    assert amp_dtype("bf16", on_gpu=True) == "bfloat16"
    assert amp_dtype("fp16", on_gpu=True) == "float16"
    assert amp_dtype("none", on_gpu=True) is None
    with caplog.at_level(logging.WARNING):
        assert amp_dtype("fp16", on_gpu=False) is None
        assert amp_dtype("none", on_gpu=False) is None
    assert [r.message for r in caplog.records] == [
        "train.amp is fp16 but the device is the CPU: training in float32"
    ]


def test_crnn_plan_gives_a_quarter_of_the_width_as_time_steps():
    widths = tasks.get("ocr").model("crnn").widths
    plan = crnn_plan(widths, (3, 48, 320), hidden_size=256, num_classes=11)
    layers = plan.backbone
    height, width = 48, 320
    for layer in layers:
        if hasattr(layer, "size"):
            height, width = height // layer.size[0], width // layer.size[1]
        else:
            height = height + 2 * layer.padding[0] - layer.kernel[0] + 1
    assert (height, width) == (1, 80)
    assert layers[-1].out_channels == widths.stages[-1] == plan.rnn[0]
    assert plan.head == (512, 11) and plan.height == 48
    with pytest.raises(ValueError, match="divisible by 16"):
        crnn_plan(widths, (3, 40, 320), 256, 11)


def test_the_old_classification_task_name_reads_with_one_deprecation_line(caplog):
    """task: resnet50 (the classification task's old name) still loads, as classification,
    with one warning line per process however many configs name it."""
    from train.config import load as config_load

    config_load._WARNED_RENAMES.discard("resnet50")
    old = {"task": "resnet50", "framework": "torch", "data": {"train": "data/x.h5"}}
    with caplog.at_level(logging.WARNING, logger="train.config.load"):
        first = config_from_dict(old)
        second = config_from_dict(old)
    assert first.task == second.task == "classification"
    assert first.model.name == "resnet50"  # the default model stays
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert lines == [
        "task: resnet50 is deprecated, read as task: classification; "
        "write task: classification in the config"
    ]
    assert tasks.get("resnet50") is tasks.get("classification")  # old exports and checkpoints
