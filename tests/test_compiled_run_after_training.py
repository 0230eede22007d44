"""After training a train.compile: true run (torch): train.export, train.evaluate and
train.predict build the bare model, so they run on a host with no C compiler, where
torch.compile's toolchain check would refuse to build the model.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest tests/test_compiled_run_after_training.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.backends import build, make_config, start  # noqa: E402
from train import checkpoint, inference  # noqa: E402
from train.backends.torch.trainer import _check_compile_toolchain  # noqa: E402
from train.config.load import save_resolved  # noqa: E402
from train.errors import RunError  # noqa: E402
from train.export import export  # noqa: E402

pytestmark = pytest.mark.torch


def compiled_run(ocr_lmdb: Path, run: Path) -> Path:
    """A run directory as a train.compile: true run leaves it: its config, compile on, and a
    checkpoint of the model, written here by the uncompiled model (a compiled run's checkpoints
    are the same files: tests/test_compile.py)."""
    small = {
        "data": {"image_shape": [3, 32, 64], "max_text_length": 8},  # 16 CTC time steps
        "model": {"name": "crnn_tiny", "hidden_size": 16},
    }
    compiled = make_config("torch", "ocr", ocr_lmdb, train={"compile": True}, **small)
    plain = make_config("torch", "ocr", ocr_lmdb, **small)
    backend = start(plain)
    labels = inference.labels_of(compiled)
    build(backend, plain, inference.num_classes(compiled, labels), total_steps=1)
    checkpoint.save(run, backend, checkpoint.Position(step=1), keep_last=1, config=compiled)
    save_resolved(compiled, run)
    backend.runtime.shutdown()
    return run


@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """This process sees no C or C++ compiler: an empty PATH, no $CXX or $CC."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    for name in ("CXX", "CC", "TORCH_INDUCTOR_INSTALL_GXX"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RunError, match="needs a C\\+\\+ compiler"):
        _check_compile_toolchain("cpu")  # what building with compile on would meet


def test_compiled_run_exports_and_loads_without_a_compiler(ocr_lmdb, tmp_path, no_compiler):
    run = compiled_run(ocr_lmdb, tmp_path / "run")
    model = inference.find_checkpoint(run)
    config = inference.run_config(model)
    assert config.train.compile  # the run's own config, as train.export reads it

    files = export(model, config, "onnx", tmp_path / "export")
    assert (tmp_path / "export" / "model.onnx") in files

    labels = inference.labels_of(config)
    # train.predict and train.evaluate --run/--checkpoint: the checkpoint in the bare model
    backend = inference.load_backend(model, config, labels)
    assert backend.trainer.model is backend.trainer.net
    backend.runtime.shutdown()
    # train.evaluate --weights: the same model filled by model.init_from's reader
    inference.load_weights(str(run), config, labels).runtime.shutdown()
