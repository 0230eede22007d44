"""Values the run cannot use are refused before any framework code runs, each with one line
naming the key (or the file), the value and the fix: NaN and infinities in every float field of
the config, OCR line shapes the model cannot reduce or whose CTC time steps cannot hold the
longest label, class counts below the classes the data holds, and metadata files that cannot
be read as written (an HDF5 schema_version that is text, names that are not strings, a
dictionary that is not UTF-8), in training and in the doctor alike.

    .venv-torch/bin/python -m pytest tests/test_refused_values.py
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Annotated, Union, get_args, get_origin

import h5py
import pytest

from datasets.errors import DatasetError
from train import tasks
from train.config.errors import ConfigError
from train.config.fields import INFINITY, Bounds
from train.config.load import config_from_dict
from train.config.schema import Config
from train.config.validate import _parse, _type_hints

ROOT = Path(__file__).resolve().parent.parent
# A config each task accepts, over paths nothing here reads.
MINIMAL = {
    "ocr": {"task": "ocr", "framework": "torch", "data": {"train": "t", "char_dict": "c.txt"}},
    **{
        name: {"task": name, "framework": "torch", "data": {"train": "t.h5"}}
        for name in tasks.TASKS
        if name != "ocr"
    },
}
NOT_FINITE = {".nan": "nan", ".inf": "inf", "-.inf": "-inf"}  # as YAML writes them: as shown


# ---------------------------------------------------------------- NaN and infinities
def _has_float(hint) -> bool:
    if hint is float:
        return True
    if get_origin(hint) in (Annotated, Union, types.UnionType, list):
        return any(_has_float(arg) for arg in get_args(hint))
    return False


def _float_fields(cls, prefix: str = ""):
    """(dotted key, type hint) of every float field under the section ``cls``."""
    for spec in dataclasses.fields(cls):
        hint = _type_hints(cls)[spec.name]
        if dataclasses.is_dataclass(hint):
            yield from _float_fields(hint, f"{prefix}{spec.name}.")
        elif _has_float(hint):
            yield f"{prefix}{spec.name}", hint


def _every_float_field() -> list[tuple[str, str]]:
    """(task, dotted key): the float fields of every section, the data keys of every task's data
    section; a field added to the schema is in this list without a change here."""
    found = {}
    for name, task in tasks.TASKS.items():
        for key, _ in _float_fields(Config):
            if not key.startswith("data."):
                found.setdefault(key, "ocr")
        for key, _ in _float_fields(task.data, "data."):
            found.setdefault(key, name)
    return sorted((task, key) for key, task in found.items())


def test_the_walk_finds_the_float_fields_and_no_int_field():
    keys = {key for _, key in _every_float_field()}
    assert {"optim.lr", "loader.timeout_s", "data.max_bad_fraction", "optim.grad_clip"} <= keys
    assert "loader.batch_size" not in keys  # ints are left out


@pytest.mark.parametrize(("task", "key"), _every_float_field(), ids=lambda x: x)
@pytest.mark.parametrize("written", list(NOT_FINITE))
def test_every_float_field_refuses_nan_and_both_infinities(task, key, written):
    config_from_dict(MINIMAL[task])  # the config is fine without the value
    with pytest.raises(ConfigError) as caught:
        config_from_dict(MINIMAL[task], overrides=[f"{key}={written}"])
    message = str(caught.value)
    assert f"{key}: is {NOT_FINITE[written]}, not a finite number. Give a" in message
    assert "\n" not in message


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-Infinity", "'.nan'"])
def test_set_spellings_of_nan_and_inf_that_yaml_reads_as_text_are_refused_as_such(text):
    with pytest.raises(ConfigError) as caught:
        config_from_dict(MINIMAL["classification"], overrides=[f"optim.lr={text}"])
    message = str(caught.value)
    assert message.startswith(f"config error: --set optim.lr={text}: optim.lr: is ")
    assert "not a finite number. Give a number > 0, e.g. the default 0.001" in message


def test_a_float_past_the_largest_double_is_an_infinity_and_refused(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text(
        "task: classification\nframework: torch\ndata: {train: t.h5}\n"
        "train: {dist_timeout_s: 1.0e+400}\n"
    )
    from train.config.load import load_config

    with pytest.raises(ConfigError, match=r"train\.dist_timeout_s: is inf, not a finite"):
        load_config(path)


def test_a_field_marked_infinity_takes_it_but_never_nan():
    hint = Annotated[float, Bounds(low=0), INFINITY]
    assert _parse(float("inf"), hint, "k") == float("inf")
    assert _parse("inf", hint, "k") == _parse(" +.Inf", hint, "k") == float("inf")
    with pytest.raises(ConfigError, match="k: must be >= 0, got -inf"):
        _parse(float("-inf"), hint, "k")  # its bounds still apply
    with pytest.raises(ConfigError, match="k: is nan, not a finite number"):
        _parse(float("nan"), hint, "k")


# ---------------------------------------------------------------- what the OCR models can take
def _ocr(model: str, shape, length: int | None = None, **data):
    raw = {**MINIMAL["ocr"], "model": {"name": model}}
    raw["data"] = {**raw["data"], "image_shape": shape, **data}
    if length is not None:
        raw["data"]["max_text_length"] = length
    return config_from_dict(raw)


@pytest.mark.parametrize(
    ("model", "shape", "length", "expected"),
    [
        ("crnn", [3, 40, 320], 25, "data.image_shape: the CRNN reduces the height 16-fold"),
        ("crnn_tiny", [3, 8, 320], 25, "must be a multiple of 16, got 8 in [3, 8, 320]"),
        ("crnn", [3, 32, 318], 25, "must be a multiple of 4, got 318 in [3, 32, 318]. Use"),
        ("crnn", [2, 32, 320], 25, "data.image_shape: [2, 32, 320] has 2 channels"),
        ("crnn", [3, 32, 64], 25, "data.max_text_length: 25 characters need at least 25 CTC"),
        ("crnn_tiny", [1, 16, 28], 8, "but the CRNN has 7 for data.image_shape [1, 16, 28]"),
        ("ppocrv4_rec", [3, 48, 160], 25, "but ppocrv4_rec has 20 for data.image_shape"),
    ],
)
def test_ocr_shapes_and_label_lengths_the_model_cannot_take(model, shape, length, expected):
    with pytest.raises(ConfigError) as caught:
        _ocr(model, shape, length)
    assert expected in str(caught.value)


def test_the_length_error_names_both_fixes():
    with pytest.raises(ConfigError) as caught:
        _ocr("crnn", [3, 32, 64], 25)
    hint = "Lower data.max_text_length to 16, or widen the lines: data.image_shape [3, 32, 100]"
    assert hint in str(caught.value)
    _ocr("crnn", [3, 32, 64], 16)  # the first fix loads
    _ocr("crnn", [3, 32, 100], 25)  # and so does the second
    with pytest.raises(ConfigError, match="Lower data.max_text_length to 20, or widen the lines"):
        _ocr("ppocrv4_rec", [3, 48, 160], 25)
    _ocr("ppocrv4_rec", [3, 48, 320], 25)  # PaddleOCR's own pairing: 40 steps, 25 characters


@pytest.mark.parametrize("width", [32, 80, 100, 160, 318, 320, 323])
def test_ppocrv4_time_steps_follow_its_strided_layers(width):
    """Stem and one block: stride-2 convolutions padded by 1 (ceil), then a 2-wide pool (floor)."""
    after_stem = (width + 2 - 3) // 2 + 1
    after_block = (after_stem + 2 - 3) // 2 + 1
    assert tasks.ppocrv4_time_steps([3, 48, width]) == after_block // 2


def _time_steps_of_built_models(framework: str) -> dict[tuple, int]:
    """T of each OCR model's output as the framework builds it, for a few line shapes."""
    shapes = {"crnn_tiny": [(3, 32, 160), (1, 16, 36)], "ppocrv4_rec": [(3, 48, 80), (3, 48, 90)]}
    found = {}
    for name, cases in shapes.items():
        model = tasks.OCR.model(name)
        for shape in cases:
            if framework == "torch":
                import torch

                from train.backends.torch.models import build_model

                net = build_model(model, 7, input_shape=shape, hidden_size=8).eval()
                with torch.no_grad():
                    scores = net(torch.zeros(1, *shape))
            else:
                import paddle

                from train.backends.paddle.models import build_model

                net = build_model(model, 7, input_shape=shape, hidden_size=8)
                net.eval()
                with paddle.no_grad():
                    scores = net(paddle.zeros([1, *shape]))
            found[(name, shape)] = int(scores.shape[1])
    return found


@pytest.mark.parametrize(
    "framework",
    [
        pytest.param("torch", marks=pytest.mark.torch),
        pytest.param("paddle", marks=pytest.mark.paddle),
    ],
)
def test_the_configs_time_steps_are_the_built_models(framework):
    """The config's rule reads the models' downsampling from train/tasks.py: the models the
    backends build give exactly those time steps."""
    pytest.importorskip(framework)
    rule = {"crnn_tiny": tasks.crnn_time_steps, "ppocrv4_rec": tasks.ppocrv4_time_steps}
    for (name, shape), steps in _time_steps_of_built_models(framework).items():
        assert steps == rule[name](shape), (name, shape)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_python_m_train_refuses_the_shape_in_one_line_exit_2(framework, tmp_path):
    """The config is checked before the framework is imported: no traceback, either framework."""
    command = [
        sys.executable,
        "-m",
        "train",
        "--config",
        "configs/ocr/smoke.yaml",
        "--set",
        f"framework={framework}",
        "--set",
        "data.image_shape=[3,40,160]",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("config error: --set data.image_shape=[3,40,160]: data.image_shape: ")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- class counts against the data
def _classification(image_h5: Path, **model) -> Config:
    raw = {**MINIMAL["classification"], "model": {"name": "resnet18", **model}}
    raw["data"] = {"train": str(image_h5), "val": str(image_h5), "image_size": 32}
    raw["data"]["eval_resize"] = 32
    return config_from_dict(raw)


def test_num_classes_below_a_class_of_the_data_is_a_dataset_error_at_open(image_h5, tmp_path):
    from train.data import RunData

    with pytest.raises(DatasetError) as caught:
        RunData.open(_classification(image_h5, num_classes=2), tmp_path)
    message = str(caught.value)
    assert f"{image_h5} holds class 3 ('c3') but model.num_classes is 2" in message
    assert "set model.num_classes to at least 4 (the data names 4 classes), or remove it" in message
    for count in (None, 4, 6):  # the data's count, or more outputs than it names
        RunData.open(_classification(image_h5, num_classes=count), tmp_path).close()


def test_the_doctor_reports_the_class_count_as_a_failure(image_h5):
    from train.doctor import check_dataset

    check, _ = check_dataset(_classification(image_h5, num_classes=2), "train", str(image_h5))
    assert check.status == "FAIL"
    assert "holds class 3 ('c3') but model.num_classes is 2" in check.detail
    assert check.fix.startswith("set model.num_classes to at least 4")


def test_tagging_with_another_tag_count_is_a_dataset_error(image_h5, tmp_path):
    from train.data import RunData

    raw = {**MINIMAL["tagging"], "model": {"name": "resnet18", "num_classes": 3}}
    raw["data"] = {"train": str(image_h5), "image_size": 32, "eval_resize": 32}
    with pytest.raises(DatasetError, match="model.num_classes: 3, but the tagging task has one"):
        RunData.open(config_from_dict(raw), tmp_path)


# ---------------------------------------------------------------- metadata that cannot be read
def _h5_copy(image_h5: Path, tmp_path: Path, **attrs) -> Path:
    path = tmp_path / "train.h5"
    shutil.copy(image_h5, path)
    with h5py.File(path, "a") as f:
        for name, value in attrs.items():
            f.attrs[name] = value
    return path


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        ({"schema_version": "2"}, "attribute 'schema_version': '2' (str) is not an integer"),
        ({"schema_version": 2.0}, "attribute 'schema_version': 2.0 (float64) is not an integer"),
        ({"class_names": '["a", 1, "c", "d"]'}, "'class_names': holds 1 (int), not a name"),
        ({"class_names": b"\xff\xfe"}, "attribute 'class_names': not JSON"),
        ({"tag_names": "[tags"}, "attribute 'tag_names': not JSON"),
        ({"format": ["resnet50-hdf5", "x"]}, "lacks format='resnet50-hdf5'"),
    ],
    ids=["version-text", "version-float", "class-int", "class-bytes", "tags-not-json", "format"],
)
def test_malformed_hdf5_metadata_is_a_dataset_error_naming_the_file(
    image_h5, tmp_path, attrs, expected
):
    from datasets.hdf5_images import Hdf5TagSource

    path = _h5_copy(image_h5, tmp_path, **attrs)
    with pytest.raises(DatasetError) as caught:
        Hdf5TagSource(path)
    assert str(path) in str(caught.value) and expected in str(caught.value)


def test_the_doctor_and_training_report_a_text_schema_version(image_h5, tmp_path):
    from train.data import RunData
    from train.doctor import check_dataset

    path = _h5_copy(image_h5, tmp_path, schema_version="two")
    config = _classification(path)
    check, _ = check_dataset(config, "train", str(path))
    assert check.status == "FAIL" and "'schema_version': 'two' (str) is not" in check.detail
    with pytest.raises(DatasetError, match=f"{path}: attribute 'schema_version'"):
        RunData.open(config, tmp_path)


@pytest.fixture
def latin1_dict(tmp_path) -> Path:
    path = tmp_path / "dict.txt"
    path.write_bytes("a\nb\n\u00e9\n".encode("latin-1"))  # é as one byte: no UTF-8
    return path


def test_a_dictionary_that_is_not_utf8_is_a_dataset_error_in_training_and_the_doctor(
    latin1_dict, ocr_lmdb, tmp_path
):
    from train.data import RunData
    from train.doctor import check_dataset

    raw = {**MINIMAL["ocr"], "model": {"name": "crnn_tiny"}}
    raw["data"] = {"train": str(ocr_lmdb), "char_dict": str(latin1_dict), "max_text_length": 10}
    config = config_from_dict(raw)
    expected = f"character dictionary {latin1_dict} is not UTF-8 text: byte 0xe9 on line 3"
    with pytest.raises(DatasetError, match="save it as UTF-8") as caught:
        RunData.open(config, tmp_path)
    assert expected in str(caught.value)
    check, _ = check_dataset(config, "train", str(ocr_lmdb))
    assert check.status == "FAIL" and expected in check.detail
    assert check.fix.startswith("save it as UTF-8")


def test_python_m_doctor_reports_the_dictionary_without_a_traceback(
    latin1_dict, ocr_lmdb, tmp_path
):
    command = [
        sys.executable,
        "-m",
        "train.doctor",
        "--config",
        "configs/ocr/smoke.yaml",
        "--set",
        f"data.train={ocr_lmdb}",
        "--set",
        "data.val=null",
        "--set",
        f"data.char_dict={latin1_dict}",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1
    assert f"{latin1_dict} is not UTF-8 text: byte 0xe9 on line 3" in done.stdout


def test_other_text_metadata_that_is_not_utf8_is_a_dataset_error(tmp_path):
    from datasets.bad_samples import read_bad_keys
    from datasets.convert import read_paddleocr_labels

    keys = tmp_path / "skip.tsv"
    keys.write_bytes(b"image-000000001\tgarbage_image\n\xff\n")
    with pytest.raises(DatasetError, match=f"skip-keys file {keys} is not UTF-8 text: byte 0xff"):
        read_bad_keys(keys)
    labels = tmp_path / "labels.txt"
    labels.write_bytes("a.jpg\t\u00fcber\n".encode("latin-1"))
    with pytest.raises(DatasetError, match=f"label file {labels} is not UTF-8 text: byte 0xfc"):
        read_paddleocr_labels(labels)
