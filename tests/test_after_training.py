"""After training: python -m train.evaluate, train.export and train.predict on smoke runs.

Paddle OCR: the exported inference model is loaded by PaddleOCR's own TextRecognizer (the
installed paddleocr wheel's tools/infer/predict_rec.py), whose texts on held-out lines equal
train.predict's, whose exact match equals train.evaluate's, and whose probabilities, from
PaddleOCR's own preprocessing (resize_norm_img) and predictor, equal the checkpoint's on our
preprocessing. Torch CRNN and ResNet: ONNX Runtime on the exported model gives the checkpoint's
argmax on the same batch. A test's commands run one after another in one interpreter
(tests/probes/cli_session.py); tests/test_new_task_kind.py runs each as its own python -m.

    TEST_FRAMEWORK=paddle .venv-paddle/bin/python -m pytest -m "not torch" \
        tests/test_after_training.py
    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest -m "not paddle" \
        tests/test_after_training.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from datasets.lmdb_ocr import LmdbOcrSource, LmdbOcrWriter
from datasets.synthetic import LATIN, ocr_samples, write_all
from tests.test_train import ROOT, run_train
from train import inference


def _cli(module: str, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, *map(str, args)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{cmd}\n{result.stderr[-3000:]}"
    return result


class CliSession:
    """``cli(module, *args)``: ``python -m module args`` run by tests/probes/cli_session.py, one
    interpreter for all of a test's commands; exit code, stdout and stderr as _cli gives them.
    The test's own process stays clear of the commands' logging set-up and loader workers."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "probes" / "cli_session.py")],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __call__(self, module: str, *args, expect: int = 0) -> subprocess.CompletedProcess:
        request = {"module": module, "args": [str(arg) for arg in args]}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the command session ended (exit {self.process.wait()}) running {request}"
        reply = json.loads(line)
        result = subprocess.CompletedProcess(
            [module, *request["args"]], reply["returncode"], reply["stdout"], reply["stderr"]
        )
        assert result.returncode == expect, f"{result.args}\n{result.stderr[-3000:]}"
        return result

    def close(self) -> None:
        self.process.stdin.close()
        assert self.process.wait(timeout=60) == 0


@pytest.fixture
def cli():
    session = CliSession()
    yield session
    session.close()


def _predictions(stdout: str) -> list[list[str]]:
    """train.predict's rows (name, prediction, score, label) without the header."""
    rows = [line.split("\t") for line in stdout.splitlines() if "\t" in line]
    assert rows[0][:3] == ["name", "prediction", "score"]
    return rows[1:]


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> Path:
    """24 OCR lines the smoke runs never train on (another seed than the ocr_lmdb fixture)."""
    path = tmp_path_factory.mktemp("held_out") / "val"
    write_all(LmdbOcrWriter(path), ocr_samples(24, LATIN, None, seed=7))
    return path


# The torch runs only need a best checkpoint to export and compare against: one evaluation
# and one checkpoint, on ResNet inputs of 32 pixels (its checkpoint is as large at any size).
SHORT = ["train.max_steps=6", "train.eval_every=6", "train.checkpoint_every=6"]
SMALL_RESNET = ["data.image_size=32", "data.eval_resize=36"]


def _train(task, framework, out, ocr_lmdb, image_h5, held_out, extra=()) -> Path:
    extra = [*([f"data.val={held_out}"] if task == "ocr" else []), *extra]
    result = run_train(task, framework, out, extra=extra, ocr_lmdb=ocr_lmdb, image_h5=image_h5)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def paddle_ocr_run(tmp_path_factory, ocr_lmdb, image_h5, held_out) -> Path:
    """One 12-step Paddle OCR smoke run that both Paddle export tests read (neither changes
    its checkpoints)."""
    out = tmp_path_factory.mktemp("paddle_ocr") / "run"
    return _train("ocr", "paddle", out, ocr_lmdb, image_h5, held_out)


@pytest.mark.paddle
def test_paddleocr_text_recognizer_runs_the_export_as_predict_does(
    tmp_path, paddle_ocr_run, held_out, cli
):
    run = paddle_ocr_run
    evaluated = json.loads(cli("train.evaluate", "--run", run).stdout)
    assert evaluated["checkpoint"] == str(run / "best") and evaluated["samples"] == 24
    assert sum(v["samples"] for v in evaluated["acc_by_length"].values()) == 24
    export = tmp_path / "export"
    listed = cli("train.export", "--run", run, "--format", "paddle-inference", "--out", export)
    assert "inference.pdiparams" in listed.stdout
    ours = _predictions(cli("train.predict", "--model", export, held_out).stdout)
    from_checkpoint = _predictions(cli("train.predict", "--model", run, held_out).stdout)
    assert [row[:2] for row in ours] == [row[:2] for row in from_checkpoint]

    # PaddleOCR's recognizer, as its tools/infer/predict_rec.py sets it up, on the same lines
    # (decoded to BGR arrays, as cv2.imread gives them).
    import paddleocr  # noqa: F401  (puts the wheel's tools/ and ppocr/ on sys.path)
    from tools.infer.predict_rec import TextRecognizer
    from tools.infer.utility import init_args

    from datasets.decode import decode_bgr

    spec = json.loads((export / "preprocess.json").read_text())
    args = init_args().parse_args([])
    args.rec_model_dir, args.rec_char_dict_path = str(export), str(export / spec["dictionary"])
    args.rec_image_shape = ",".join(map(str, spec["image_shape"]))
    args.use_space_char, args.use_gpu, args.rec_algorithm = spec["use_space_char"], False, "CRNN"
    recognizer = TextRecognizer(args)
    source = LmdbOcrSource(held_out)
    records = [source.read(i) for i in range(len(source))]
    texts, _ = recognizer([decode_bgr(data) for data, _ in records])

    assert [text for text, _ in texts] == [row[1] for row in ours]
    np.testing.assert_allclose([s for _, s in texts], [float(r[2]) for r in ours], atol=1e-5)
    exact = np.mean([text == label for (text, _), (_, label) in zip(texts, records)])
    assert exact == evaluated["acc"]

    # The contract itself: PaddleOCR's preprocessing and predictor give the probabilities our
    # preprocessing gives the checkpoint (a 12-step model predicts few characters, so equal
    # texts alone would prove little).
    images = [decode_bgr(data) for data, _ in records[:8]]
    width_ratio = spec["image_shape"][2] / spec["image_shape"][1]
    theirs = np.stack([recognizer.resize_norm_img(image, width_ratio) for image in images])
    handle = recognizer.predictor.get_input_handle(recognizer.predictor.get_input_names()[0])
    handle.copy_from_cpu(theirs.astype(np.float32))
    recognizer.predictor.run()
    paddleocr_probabilities = recognizer.output_tensors[0].copy_to_cpu()
    model = inference.find_checkpoint(run)
    config = inference.run_config(model)
    backend = inference.load_backend(model, config, inference.labels_of(config))
    batch = inference.preprocess(spec, [data for data, _ in records[:8]])
    checkpoint_probabilities = inference.softmax(backend.exporter.infer(batch))
    np.testing.assert_allclose(paddleocr_probabilities, checkpoint_probabilities, atol=1e-5)


@pytest.mark.paddle
def test_pdparams_export_loads_with_paddle_load(tmp_path, ocr_lmdb, paddle_ocr_run):
    import paddle

    run = paddle_ocr_run
    export = tmp_path / "export"
    _cli("train.export", "--run", run, "--format", "pdparams", "--out", export)
    state = paddle.load(str(export / "model.pdparams"))
    with np.load(run / "best" / "model.npz") as saved:
        assert sorted(state) == sorted(saved.files)
        for name in saved.files:
            np.testing.assert_array_equal(np.asarray(state[name]), saved[name], err_msg=name)
    charset = (ocr_lmdb.parent / "charset.txt").read_text()
    assert (export / "dict.txt").read_text() == charset  # PaddleOCR's rec_char_dict_path


@pytest.mark.torch
@pytest.mark.compat  # train, evaluate, export and predict, OCR and ResNet: make test-compat's pair
@pytest.mark.parametrize("task", ["ocr", "resnet50"])
def test_onnx_export_gives_the_checkpoints_argmax(
    task, tmp_path, ocr_lmdb, image_h5, held_out, cli
):
    import onnxruntime

    short = [*SHORT, *(SMALL_RESNET if task == "resnet50" else [])]
    run = _train(task, "torch", tmp_path / "run", ocr_lmdb, image_h5, held_out, short)
    export = tmp_path / "export"
    cli("train.export", "--run", run, "--format", "onnx", "--out", export)
    spec, labels = inference.read_contract(export)
    inputs = held_out if task == "ocr" else image_h5
    encoded = [data for _, data, _ in inference.read_inputs([str(inputs)])][:16]
    batch = inference.preprocess(spec, encoded)

    model = inference.find_checkpoint(run)
    config = inference.run_config(model)
    backend = inference.load_backend(model, config, inference.labels_of(config))
    expected = inference.softmax(backend.exporter.infer(batch))
    session = onnxruntime.InferenceSession(str(export / "model.onnx"))
    got = session.run(None, {"images": batch})[0]

    assert got.shape == expected.shape
    np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))
    np.testing.assert_allclose(got, expected, atol=1e-5)
    ours = _predictions(cli("train.predict", "--model", export, inputs).stdout)
    from_checkpoint = _predictions(cli("train.predict", "--model", run, inputs).stdout)
    assert [row[:2] for row in ours] == [row[:2] for row in from_checkpoint]
    assert len(ours) == 24  # both fixtures hold 24 images
    if task == "ocr":  # image files and folders (searched recursively) give the same texts
        folder = tmp_path / "lines" / "nested"
        folder.mkdir(parents=True)
        files = []
        for name, data, _ in list(inference.read_inputs([str(inputs)]))[:3]:
            suffix = "png" if data.startswith(b"\x89PNG") else "jpg"
            files.append(folder / f"{name}.{suffix}")
            files[-1].write_bytes(data)
        rows = _predictions(cli("train.predict", "--model", export, tmp_path / "lines").stdout)
        assert [row[1] for row in rows] == [row[1] for row in ours[:3]]
        assert [row[0] for row in rows] == [str(path) for path in files]
    # train.evaluate on a given checkpoint and dataset: its exact match is train.predict's
    best = run / "best"
    evaluated = json.loads(cli("train.evaluate", "--checkpoint", best, "--data", inputs).stdout)
    assert evaluated["checkpoint"] == str(best) and evaluated["samples"] == 24
    main = "acc" if task == "ocr" else "top1"
    assert evaluated[main] == np.mean([row[1] == row[3] for row in from_checkpoint])

    # --weights: the run as model.init_from takes it (its best), in the run's scenario, on two
    # datasets: a report each, equal to --checkpoint's; nothing written without --out.
    config = run / "config.resolved.yaml"
    weights = ["--config", config, "--weights", run, "--data", inputs, "--data", inputs]
    reports = json.loads(cli("train.evaluate", *weights).stdout)
    assert [report["weights"] for report in reports] == [str(run)] * 2
    assert [report[main] for report in reports] == [evaluated[main]] * 2
    assert [report["samples"] for report in reports] == [24, 24]
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["best.json"]  # --checkpoint's
    if task == "ocr":  # weights that do not fill the model: refused, not evaluated half-fresh
        refused = cli("train.evaluate", *weights, "--set", "model.hidden_size=64", expect=4)
        assert "does not hold the whole crnn_tiny model" in refused.stderr
        assert "have another shape" in refused.stderr and "HINT" in refused.stderr


def test_unknown_model_path_is_a_clear_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "train.predict", "--model", str(tmp_path / "nope"), "x.png"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 4
    assert "does not exist" in result.stderr and "HINT" in result.stderr


def test_export_format_of_the_other_framework_is_a_clear_error(tmp_path, ocr_lmdb):
    from tests.backends import make_config
    from train.config.load import save_resolved

    run = tmp_path / "run"
    save_resolved(make_config("paddle", "ocr", ocr_lmdb), run)
    (run / "best").mkdir()
    meta = {"framework": "paddle", "task": "ocr", "position": {}}
    (run / "best" / "trainer.json").write_text(json.dumps(meta))
    cmd = [sys.executable, "-m", "train.export", "--run", str(run), "--format", "onnx"]
    result = subprocess.run(
        [*cmd, "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 4, result.stderr
    assert "is a paddle model; onnx is for torch models" in result.stderr
    assert "HINT: use --format paddle-inference or pdparams" in result.stderr
    assert not (tmp_path / "out").exists()
