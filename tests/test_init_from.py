"""model.init_from (train/weights.py): a new run starts from a checkpoint, a run directory or a
framework weight file; names and shapes that fit load, a new head keeps its fresh init, the
report names every key that did not load, and nothing unpickles arbitrary objects.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest -m "not paddle" tests/test_init_from.py
    TEST_FRAMEWORK=paddle .venv-paddle/bin/python -m pytest -m "not torch" tests/test_init_from.py
"""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.backends import Payload, build, make_config, start
from tests.test_train import ROOT, run_train, train_cmd
from train import checkpoint
from train.config.errors import ConfigError
from train.config.load import config_from_dict
from train.weights import InitFromError, resolve_source

FRAMEWORKS = [
    pytest.param("torch", marks=pytest.mark.torch),
    pytest.param("paddle", marks=pytest.mark.paddle),
]
# The classifier's last layer in each framework's ResNet (torchvision's and paddle.vision's).
HEAD = {"torch": {"fc.weight", "fc.bias"}, "paddle": {"fc.weight", "fc.bias"}}


def _resnet(framework: str, image_h5: Path, num_classes: int, seed: int):
    config = make_config(framework, "classification", image_h5, model={"num_classes": num_classes})
    backend = start(config, seed=seed)
    build(backend, config, num_classes, total_steps=4)
    return backend, config


def _arrays(backend) -> dict[str, np.ndarray]:
    return {
        name: np.array(backend.batches.to_numpy(t))
        for name, t in backend.trainer.net.state_dict().items()
    }


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_checkpoint_into_another_class_count_keeps_a_fresh_head(framework, image_h5, tmp_path):
    source, config = _resnet(framework, image_h5, num_classes=4, seed=1)
    saved = checkpoint.save(tmp_path / "run", source, checkpoint.Position(step=3), 2, config)
    target, _ = _resnet(framework, image_h5, num_classes=6, seed=2)
    fresh = _arrays(target)

    report = target.state.init_weights_from(tmp_path / "run")  # a run directory: its latest

    assert report.source == str(saved)
    assert set(report.shape_mismatched) == HEAD[framework]
    assert report.missing == [] and report.unexpected == []
    loaded, now, before = set(report.loaded), _arrays(target), _arrays(source)
    assert loaded == set(now) - HEAD[framework]
    for name in loaded:
        np.testing.assert_array_equal(now[name], before[name], err_msg=name)
    for name in HEAD[framework]:  # the new head: its own fresh initialization, untouched
        np.testing.assert_array_equal(now[name], fresh[name], err_msg=name)
    assert "shape-mismatched ['fc.weight: " in report.summary()


@pytest.mark.torch
def test_torch_state_dict_file_nested_and_prefixed(image_h5, tmp_path):
    import torch

    source, _ = _resnet("torch", image_h5, num_classes=4, seed=1)
    state = {f"module.{k}": v for k, v in source.trainer.net.state_dict().items()}
    state["module.extra.weight"] = torch.zeros(3)
    torch.save({"state_dict": state, "epoch": 7}, tmp_path / "weights.pth")
    target, _ = _resnet("torch", image_h5, num_classes=4, seed=2)

    report = target.state.init_weights_from(tmp_path / "weights.pth")

    assert report.unexpected == ["extra.weight"] and not report.shape_mismatched
    assert len(report.loaded) == len(source.trainer.net.state_dict())
    torch.testing.assert_close(target.trainer.net.state_dict(), source.trainer.net.state_dict())


@pytest.mark.torch
def test_torch_weight_file_with_objects_is_refused(image_h5, tmp_path):
    import torch

    torch.save({"fc.weight": Payload(tmp_path / "ran")}, tmp_path / "evil.pt")
    target, _ = _resnet("torch", image_h5, num_classes=4, seed=2)
    with pytest.raises(pickle.UnpicklingError, match="refused to load"):
        target.state.init_weights_from(tmp_path / "evil.pt")
    assert not (tmp_path / "ran").exists()


@pytest.mark.paddle
def test_pdparams_loads_and_objects_in_it_are_refused(image_h5, tmp_path):
    import paddle

    source, _ = _resnet("paddle", image_h5, num_classes=4, seed=1)
    paddle.save(source.trainer.net.state_dict(), str(tmp_path / "model.pdparams"))
    target, _ = _resnet("paddle", image_h5, num_classes=4, seed=2)

    report = target.state.init_weights_from(tmp_path / "model.pdparams")

    assert len(report.loaded) == len(source.trainer.net.state_dict()) and not report.missing
    for name, value in _arrays(source).items():
        np.testing.assert_array_equal(_arrays(target)[name], value, err_msg=name)

    with open(tmp_path / "evil.pdparams", "wb") as f:
        pickle.dump({"fc.weight": Payload(tmp_path / "ran")}, f)
    with pytest.raises(pickle.UnpicklingError, match="refused to load"):
        target.state.init_weights_from(tmp_path / "evil.pdparams")
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("core", ["numpy.core", "numpy._core"])
def test_protocol_2_pdparams_read_and_other_codecs_refused(core, tmp_path):
    """Older PaddleOCR releases saved .pdparams with pickle protocol 2, which rebuilds each
    array's raw bytes through _codecs.encode(text, "latin1"): accepted for that codec only.
    Arrays pickled by numpy 1.x name numpy.core.multiarray, by numpy 2 numpy._core.multiarray:
    the file is rewritten to name ``core``, so either numpy reads what the other wrote."""
    from collections import OrderedDict

    from train.weights import read_pdparams

    arrays = OrderedDict(w=np.arange(6, dtype=np.float32).reshape(2, 3), b=np.ones(3, np.int64))
    pickled = pickle.dumps(arrays, protocol=2)  # GLOBAL opcodes: "module\nname\n", no lengths
    for written in (b"numpy.core.multiarray\n", b"numpy._core.multiarray\n"):
        pickled = pickled.replace(written, f"{core}.multiarray\n".encode())
    assert f"{core}.multiarray\n_reconstruct".encode() in pickled
    (tmp_path / "old.pdparams").write_bytes(pickled)
    state = read_pdparams(tmp_path / "old.pdparams")
    assert state.keys() == arrays.keys()
    for name, value in arrays.items():
        np.testing.assert_array_equal(state[name], value)

    # The same call with another codec (rot13 here) is no array data: refused before it runs.
    evil = b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x05\x00\x00\x00rot13\x86R."
    (tmp_path / "codec.pdparams").write_bytes(evil)
    with pytest.raises(pickle.UnpicklingError, match="refused to load.*rot13"):
        read_pdparams(tmp_path / "codec.pdparams")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_other_frameworks_checkpoint_is_a_clear_error(framework, image_h5, tmp_path):
    other = "paddle" if framework == "torch" else "torch"
    step = tmp_path / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    (step / "trainer.json").write_text(json.dumps({"framework": other}))
    target, _ = _resnet(framework, image_h5, num_classes=4, seed=2)
    with pytest.raises(InitFromError, match=f"written by {other}; this run trains with"):
        target.state.init_weights_from(tmp_path)


def test_bad_init_from_is_a_config_error_naming_the_key(image_h5, tmp_path):
    raw = {"task": "classification", "framework": "torch", "data": {"train": str(image_h5)}}
    for path, problem in (
        (tmp_path / "nope", "does not exist"),
        (tmp_path, "directory without a checkpoint"),
        (image_h5, "not a known weight file"),
    ):
        with pytest.raises(ConfigError) as caught:
            config_from_dict({**raw, "model": {"init_from": str(path)}})
        text = str(caught.value)
        assert "model.init_from" in text and problem in text, text
        assert "HINT" not in text and ".pdparams" in text, text  # the fix, as a sentence
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "trainer.json").write_text(json.dumps({"framework": "torch"}))
    assert resolve_source(tmp_path).path == tmp_path / "best"  # a run: best before latest


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_fine_tune_run_reports_the_new_head(framework, tmp_path, image_h5):
    first, second = tmp_path / "first", tmp_path / "second"
    short = ["train.max_steps=2", "train.checkpoint_every=2", "optim.warmup_steps=1"]
    short.append("data.val=null")
    result = run_train("resnet50", framework, first, extra=short, image_h5=image_h5)
    assert result.returncode == 0, result.stderr[-3000:]
    extra = [*short, f"model.init_from={first}", "model.num_classes=6"]
    result = run_train("resnet50", framework, second, extra=extra, image_h5=image_h5)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((second / "init_from.json").read_text())
    assert set(report["shape_mismatched"]) == HEAD[framework]
    assert report["source"] == str(first / "checkpoints" / "step-00000002")
    assert "shape-mismatched ['fc.weight: " in (second / "train.log").read_text()

    # On --resume the run's own checkpoint wins, and the log says init_from was ignored.
    cmd = train_cmd("resnet50", framework, second, [*extra, "train.max_steps=3"], None, image_h5)
    resumed = subprocess.run(
        [*cmd, "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "ignored: resuming, the run's checkpoint wins" in resumed.stderr
