"""A task of a new kind from one file: tagging (train/task_modules/tagging.py, configs/tagging/),
multi-label on the HDF5 images' tags with the multi_label loss kind, trains, evaluates, exports
and predicts on both frameworks with nothing else written for it.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest -m "not paddle" \
        tests/test_new_task_kind.py
    TEST_FRAMEWORK=paddle .venv-paddle/bin/python -m pytest -m "not torch" \
        tests/test_new_task_kind.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from datasets.errors import DatasetError
from datasets.hdf5_images import Hdf5TagSource
from datasets.synthetic import IMAGENET_TAG_NAMES, imagenet_tags
from tests.test_after_training import SHORT, SMALL_RESNET, _cli, _predictions
from tests.test_train import ROOT, run_train
from train import inference, tasks
from train.metrics import MultiLabelMetric

EXPORTS = [  # framework, export format, how the exported model runs a batch
    pytest.param("torch", "onnx", marks=pytest.mark.torch),
    pytest.param("paddle", "paddle-inference", marks=pytest.mark.paddle),
]


def _exported_probabilities(framework: str, export, batch: np.ndarray) -> np.ndarray:
    if framework == "torch":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(export / "model.onnx"))
        return session.run(None, {"images": batch})[0]
    from train.backends.paddle.export import InferenceModel

    return InferenceModel(export)(batch)


def test_the_task_comes_from_its_own_module_with_a_loss_kind_of_its_own():
    tagging = tasks.get("tagging")
    assert tagging.loss == "multi_label" and tagging.metric is MultiLabelMetric
    assert type(tagging).__module__ == "train.tasks"
    assert tagging.label_text.__module__ == "train.task_modules.tagging"
    others = [task for name, task in tasks.TASKS.items() if name != "tagging"]
    assert "multi_label" not in {task.loss for task in others}


def test_no_code_but_its_own_module_names_the_task():
    """The task is its module and its configs: nothing else in the code that runs it (train/,
    scripts/, bench/, datasets/) names it."""
    naming = sorted(
        str(path.relative_to(ROOT))
        for folder in ("train", "scripts", "bench", "datasets")
        for path in (ROOT / folder).rglob("*.py")
        if "tagging" in path.read_text(encoding="utf-8")
    )
    assert naming == ["train/task_modules/tagging.py"]
    scenarios = {path.stem for path in (ROOT / "configs" / "tagging").glob("*.yaml")}
    standard = {"base", "smoke", "single_gpu", "multi_gpu", "small_dataset", "remote_storage"}
    assert scenarios == standard


def test_tags_are_written_read_and_batched_as_multi_hot(image_h5):
    source = Hdf5TagSource(image_h5)
    assert source.class_names == list(IMAGENET_TAG_NAMES)
    for index in range(4):  # the fixture's classes are 0..3 in turn
        _, mask = source.read(index)
        assert mask == sum(1 << tag for tag in imagenet_tags(index))
    source.close()
    dataset = tasks.get("tagging").open_dataset(
        type("Data", (), {"image_size": 32, "eval_resize": 40, "max_image_pixels": 10**8}),
        str(image_h5),
        train=False,
    )
    batch = dataset.get_batch([0, 1, 2, 3])
    dataset.close()
    assert batch["image"].shape == (4, 32, 32, 3) and batch["label"].dtype == np.float32
    expected = np.zeros((4, len(IMAGENET_TAG_NAMES)), np.float32)
    for row in range(4):
        expected[row, list(imagenet_tags(row))] = 1
    np.testing.assert_array_equal(batch["label"], expected)


def test_outputs_are_the_datas_tags_and_model_num_classes_cannot_change_them():
    from train.config.schema import ModelConfig

    tagging = tasks.get("tagging")
    fake = type("D", (), {"source": type("S", (), {"class_names": list(IMAGENET_TAG_NAMES)})})
    assert tagging.num_classes(ModelConfig(), fake) == len(IMAGENET_TAG_NAMES)
    with pytest.raises(DatasetError, match="model.num_classes: 10, but the tagging task"):
        tagging.num_classes(ModelConfig(num_classes=10), fake)


def test_multi_label_metric_counts_exact_sets_and_micro_f1():
    metric = MultiLabelMetric()
    truth = np.array([[1, 0, 1], [0, 1, 0]], np.float32)
    metric.update(np.array([[1, 0, 1], [1, 1, 0]]), {"label": truth})
    summary = MultiLabelMetric.summarize(metric.state())
    assert summary["exact_match"] == 0.5
    assert summary["f1"] == pytest.approx(2 * 3 / (2 * 3 + 1 + 0))


def test_tag_decoding_names_the_tags_above_one_half():
    probabilities = np.array([[0.9, 0.2, 0.6], [0.1, 0.3, 0.4]])
    (first, score), (none, none_score) = inference.decode("tagging", probabilities, ["a", "b", "c"])
    assert first == "a,c" and score == pytest.approx(0.9 * 0.8 * 0.6)
    assert none == "" and none_score == pytest.approx(0.9 * 0.7 * 0.6)


@pytest.mark.parametrize("framework, fmt", EXPORTS)
def test_tagging_trains_evaluates_exports_and_predicts(framework, fmt, tmp_path, image_h5):
    run = tmp_path / "run"
    # A short run on small images: one evaluation and the checkpoint it makes best.
    extra = [*SHORT, *SMALL_RESNET]
    result = run_train("tagging", framework, run, extra=extra, image_h5=image_h5)
    assert result.returncode == 0, result.stderr[-3000:]
    tag_count = len(IMAGENET_TAG_NAMES)

    evaluated = json.loads(_cli("train.evaluate", "--run", run, "--data", image_h5).stdout)
    assert evaluated["samples"] == 24
    assert 0 <= evaluated["exact_match"] <= 1 and 0 <= evaluated["f1"] <= 1

    export = tmp_path / "export"
    _cli("train.export", "--run", run, "--format", fmt, "--out", export)
    spec, labels = inference.read_contract(export)
    assert spec["task"] == "tagging" and labels == list(IMAGENET_TAG_NAMES)
    encoded = [data for _, data, _ in inference.read_inputs([str(image_h5)])][:16]
    batch = inference.preprocess(spec, encoded)

    # The exported model outputs the checkpoint's sigmoid per tag, not a softmax.
    model = inference.find_checkpoint(run)
    config = inference.run_config(model)
    backend = inference.load_backend(model, config, inference.labels_of(config))
    expected = inference.probabilities("tagging", backend.exporter.infer(batch))
    backend.runtime.shutdown()
    got = _exported_probabilities(framework, export, batch)
    assert got.shape == expected.shape == (16, tag_count)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert not np.allclose(got.sum(axis=1), 1.0)  # independent per tag

    ours = _predictions(_cli("train.predict", "--model", export, image_h5).stdout)
    from_checkpoint = _predictions(_cli("train.predict", "--model", run, image_h5).stdout)
    assert [row[:2] for row in ours] == [row[:2] for row in from_checkpoint]
    assert len(ours) == 24
    for index, (_, prediction, score, label) in enumerate(ours):
        assert set(filter(None, prediction.split(","))) <= set(IMAGENET_TAG_NAMES)
        assert 0 < float(score) <= 1
        assert label == ",".join(IMAGENET_TAG_NAMES[t] for t in imagenet_tags(index % 4))
    exact = np.mean([row[1] == row[3] for row in from_checkpoint])
    assert evaluated["exact_match"] == pytest.approx(exact)
