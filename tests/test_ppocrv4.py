"""The PP-OCRv4 recognizer written here against the released one: its ONNX export, run by ONNX
Runtime on the same inputs, in each framework; the weight converter's refusals; its config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from datasets.ocr_transforms import resize_and_pad
from datasets.synthetic import CJK, LATIN, random_text, render_text_line
from train.ppocrv4_weights import WeightsError, read_onnx

ROOT = Path(__file__).resolve().parent.parent

LINES = 24  # half Chinese, half Latin (letters and digits)
SHAPE = (3, 48, 320)  # PP-OCR's recognizer input


def _rendered_lines(font) -> tuple[list[str], np.ndarray]:
    """(texts, float32 [N, 3, 48, 320]) under PP-OCR's pixel contract: BGR, 48 high, aspect
    kept, right padding (resize_and_pad, the data path's), (x / 255 - 0.5) / 0.5."""
    rng = np.random.default_rng(7)
    texts = [random_text(CJK, rng, 4, 10) for _ in range(LINES // 2)]
    texts += [random_text(LATIN, rng, 4, 10) for _ in range(LINES // 2)]
    images = np.stack(
        [resize_and_pad(render_text_line(t, str(font), rng), SHAPE)[0] for t in texts]
    )
    return texts, (images.transpose(0, 3, 1, 2).astype(np.float32) / 255 - 0.5) / 0.5


def _greedy_ctc(probabilities: np.ndarray, characters: list[str]) -> list[str]:
    """PP-OCR's decoding: best class per step, repeats merged, blanks (0) dropped."""
    texts = []
    for best in probabilities.argmax(2):
        keep = (best != 0) & np.r_[True, best[1:] != best[:-1]]
        texts.append("".join(characters[c - 1] for c in best[keep]))
    return texts


@pytest.fixture(scope="module")
def reference(ppocrv4_files):
    """The released model's class scores for the rendered lines, from ONNX Runtime."""
    import onnxruntime

    released = read_onnx(ppocrv4_files["onnx"])
    texts, images = _rendered_lines(ppocrv4_files["font"])
    session = onnxruntime.InferenceSession(
        str(ppocrv4_files["onnx"]), providers=["CPUExecutionProvider"]
    )
    scores = session.run(None, {"x": images})[0]
    characters = [*released.characters, " "]  # the export's classes: blank, dictionary, space
    decoded = _greedy_ctc(scores, characters)
    # The lines are readable: a wrong pixel contract (RGB, no normalization) reads few of them.
    read = sum(got.strip() == text for got, text in zip(decoded, texts))
    assert read >= LINES * 2 // 3, list(zip(texts, decoded))
    return released, images, scores, decoded, characters


def _check_fidelity(probabilities: np.ndarray, reference) -> None:
    _, _, scores, decoded, characters = reference
    assert probabilities.shape == scores.shape == (LINES, SHAPE[2] // 8, 6625)
    assert np.abs(probabilities - scores).max() < 1e-3
    assert _greedy_ctc(probabilities, characters) == decoded


@pytest.mark.torch
def test_torch_model_reproduces_onnx_runtime(reference):
    import torch

    from train.backends.torch.models import build_model
    from train.backends.torch.ppocrv4 import load_released
    from train.tasks import OCR

    released, images, *_ = reference
    net = build_model(OCR.model("ppocrv4_rec"), 6625, input_shape=SHAPE, hidden_size=256)
    report = load_released(net, released)
    assert len(report) == 234 and report[-1].endswith("-> head.bias")
    with torch.no_grad():
        probabilities = net.eval()(torch.from_numpy(images)).softmax(-1).numpy()
    _check_fidelity(probabilities, reference)


@pytest.mark.paddle
def test_paddle_model_reproduces_onnx_runtime(reference):
    import paddle

    from train.backends.paddle.models import build_model
    from train.backends.paddle.ppocrv4 import load_released
    from train.tasks import OCR

    released, images, *_ = reference
    net = build_model(OCR.model("ppocrv4_rec"), 6625, input_shape=SHAPE, hidden_size=256)
    report = load_released(net, released)
    assert len(report) == 234 and report[-1].endswith("-> head.bias")
    net.eval()  # returns None in Paddle
    with paddle.no_grad():
        logits = net(paddle.to_tensor(images))
        probabilities = paddle.nn.functional.softmax(logits, axis=-1).numpy()
    _check_fidelity(probabilities, reference)


def _convert(*args: str) -> subprocess.CompletedProcess:
    convert = [sys.executable, "-m", "scripts.convert_weights", *args]
    return subprocess.run(convert, cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "other_graph"])
def test_a_wrong_or_truncated_onnx_file_gives_one_clear_error_and_writes_nothing(
    ppocrv4_files, tmp_path, damage
):
    data = ppocrv4_files["onnx"].read_bytes()
    bad = tmp_path / "model.onnx"
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        bad.write_bytes(b"<html>502 Bad Gateway</html>")
    else:  # a valid ONNX model of another network: the export without its head's weights
        import onnx

        model = onnx.load(str(ppocrv4_files["onnx"]))
        head = [
            n for n in model.graph.node if n.op_type == "Constant" and "linear_85" in n.output[0]
        ]
        for node in head:
            model.graph.node.remove(node)
        onnx.save(model, str(bad))
    with pytest.raises(WeightsError, match="HINT: pass the ch_PP-OCRv4_rec_infer.onnx"):
        read_onnx(bad)
    out = tmp_path / "out"
    done = _convert("--onnx", str(bad), "--out-dir", str(out))
    assert done.returncode == 2
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: {bad}"), done.stderr
    assert not out.exists()


def test_ppocrv4_refuses_an_input_its_weights_cannot_read(tmp_path):
    from train.config.errors import ConfigError
    from train.config.load import load_config

    with pytest.raises(ConfigError, match="ppocrv4_rec reads BGR lines 48 pixels high"):
        load_config(
            ROOT / "configs/ocr/smoke.yaml",
            overrides=["model.name=ppocrv4_rec", "data.image_shape=[1,32,100]"],
        )


@pytest.fixture(scope="module")
def converted(ppocrv4_files, tmp_path_factory) -> Path:
    """The released weights as scripts/convert_weights.py writes them in this framework's env
    (ppocrv4_rec.pt or .pdparams and ppocr_keys.txt), converted once for the tests that load
    them; none of them writes there."""
    weights_dir = tmp_path_factory.mktemp("converted")
    done = _convert("--onnx", str(ppocrv4_files["onnx"]), "--out-dir", str(weights_dir), "--quiet")
    assert done.returncode == 0, done.stderr
    return weights_dir


FINETUNE_CONFIGS = {
    "paddle": "configs/ocr/finetune_ppocrv4.yaml",
    "torch": "configs/ocr/finetune_ppocrv4_torch.yaml",
}


@pytest.mark.parametrize(
    "framework",
    [
        pytest.param("torch", marks=pytest.mark.torch),
        pytest.param("paddle", marks=pytest.mark.paddle),
    ],
)
def test_fine_tuning_from_the_released_weights_with_a_new_dictionary_renews_only_the_head(
    framework, converted, ocr_lmdb, tmp_path
):
    """The fine-tuning scenario, shortened: the converted weights (convert_weights.py in this
    framework's env) load into ppocrv4_rec; a dictionary with one character more than the
    released one leaves only the head fresh, and the run's report says so."""
    import json

    weights_dir = converted
    weights = weights_dir / ("ppocrv4_rec.pt" if framework == "torch" else "ppocrv4_rec.pdparams")
    released_keys = (weights_dir / "ppocr_keys.txt").read_text(encoding="utf-8")
    new_keys = tmp_path / "keys.txt"
    new_keys.write_text(released_keys + "\u2603\n", encoding="utf-8")  # a snowman: not in it
    run_dir = tmp_path / "run"
    sets = [
        f"data.train={ocr_lmdb}",
        "data.val=null",  # the init_from report is what this run is for: no evaluation
        f"data.char_dict={new_keys}",
        f"model.init_from={weights}",
        "data.image_shape=[3,48,160]",
        "data.max_text_length=10",  # the 20 time steps of a line 160 wide align 10 characters
        "loader.batch_size=4",
        "loader.num_workers=0",
        "train.max_steps=2",
        "optim.warmup_steps=1",
        "train.checkpoint_every=2",
    ]
    cmd = [sys.executable, "-m", "train", "--config", FINETUNE_CONFIGS[framework]]
    cmd += ["--output-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((run_dir / "init_from.json").read_text())
    assert sorted(report["shape_mismatched"]) == ["head.bias", "head.weight"]
    assert report["shape_mismatched"]["head.weight"][0] in ([6625, 120], [120, 6625])
    assert report["missing"] == [] and report["unexpected"] == []
    all_but_head = 232 if framework == "paddle" else 238  # torch's: + 6 BN step counters
    assert len(report["loaded"]) == all_but_head
    assert "head.weight" in result.stderr + result.stdout  # the log names the fresh head


def test_fine_tuning_configs_read_the_weights_where_the_converter_writes_them(
    monkeypatch, tmp_path
):
    """With CACHE_ROOT set (the images set /cache) the configs take the weights from
    CACHE_ROOT/ppocrv4, where scripts/fetch_ppocrv4.py caches and convert_weights.py writes."""
    from train.config.load import load_config

    monkeypatch.setenv("CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("PPOCRV4_CACHE", raising=False)
    fetch = [
        sys.executable,
        "-c",
        "from scripts import fetch_ppocrv4; print(fetch_ppocrv4.cache_dir())",
    ]
    cache = subprocess.run(
        fetch, cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert cache == str(tmp_path / "ppocrv4")
    for framework, path in FINETUNE_CONFIGS.items():
        weights = (
            tmp_path / "ppocrv4" / f"ppocrv4_rec.{'pt' if framework == 'torch' else 'pdparams'}"
        )
        weights.parent.mkdir(exist_ok=True)
        weights.touch()  # the config checks the file exists; its content is read at training
        config = load_config(ROOT / path)
        assert (config.framework, config.model.name) == (framework, "ppocrv4_rec")
        assert config.model.init_from == str(weights)
        assert config.data.use_space_char and config.data.image_shape == [3, 48, 320]


@pytest.mark.paddle
def test_a_fine_tuned_ppocrv4_exports_to_an_inference_model_paddleocr_reads(
    converted, ocr_lmdb, tmp_path
):
    """The fine-tuning scenario's end (issue 14 with the export of issue 12): a run fine-tuned
    from the released weights, exported by train.export as a Paddle inference model, is read
    by PaddleOCR's own TextRecognizer (the paddleocr wheel's tools/infer/predict_rec.py, as
    PaddleOCR sets up its PP-OCRv4 recognizer: SVTR_LCNet) with the texts train.predict gives.
    Lines wider than 320/48 are left out: PaddleOCR widens a batch's canvas for them where our
    contract squeezes them (docs/after_training.md)."""
    import json

    import paddleocr  # noqa: F401  (puts the wheel's tools/ and ppocr/ on sys.path)
    from tools.infer.predict_rec import TextRecognizer
    from tools.infer.utility import init_args

    from datasets.decode import decode_bgr
    from datasets.lmdb_ocr import LmdbOcrSource

    weights_dir = converted
    run_dir, export = tmp_path / "run", tmp_path / "export"
    sets = [
        f"data.train={ocr_lmdb}",
        "data.val=null",  # exported from its latest checkpoint: no evaluation needed
        f"data.char_dict={weights_dir / 'ppocr_keys.txt'}",
        f"model.init_from={weights_dir / 'ppocrv4_rec.pdparams'}",
        "loader.batch_size=4",
        "loader.num_workers=0",
        "train.max_steps=2",
        "optim.warmup_steps=1",
        "train.checkpoint_every=2",
    ]
    cmd = [sys.executable, "-m", "train", "--config", FINETUNE_CONFIGS["paddle"]]
    cmd += ["--output-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    for command in (
        cmd,
        [sys.executable, "-m", "train.export", "--run", str(run_dir)]
        + ["--format", "paddle-inference", "--out", str(export)],
    ):
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]

    source = LmdbOcrSource(ocr_lmdb)
    images = [decode_bgr(source.read(i)[0]) for i in range(len(source))]
    narrow = [i for i, image in enumerate(images) if image.shape[1] / image.shape[0] <= 320 / 48]
    assert len(narrow) >= 20
    predicted = subprocess.run(
        [sys.executable, "-m", "train.predict", "--model", str(export), str(ocr_lmdb)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    rows = [line.split("\t") for line in predicted.stdout.splitlines() if "\t" in line][1:]
    ours = [rows[i][1] for i in narrow]

    spec = json.loads((export / "preprocess.json").read_text())
    assert spec["model"] == "ppocrv4_rec" and spec["channel_order"].startswith("BGR")
    args = init_args().parse_args([])
    args.rec_model_dir, args.rec_char_dict_path = str(export), str(export / spec["dictionary"])
    args.rec_image_shape = ",".join(map(str, spec["image_shape"]))
    args.use_space_char, args.use_gpu = spec["use_space_char"], False
    args.rec_algorithm = "SVTR_LCNet"  # what PaddleOCR runs PP-OCRv4's recognizer as
    texts, _ = TextRecognizer(args)([images[i] for i in narrow])
    assert [text for text, _ in texts] == ours
    assert sum(bool(text) for text in ours) > len(ours) // 4  # it reads: not all blank


# Latin lines, half of them PNG: each decoder on about 30 lines, and a last batch of 20 after
# the first of 40; about 18 s of CPU for both readers.
PARITY_LINES = 60


@pytest.mark.paddle
def test_evaluating_the_released_weights_reads_what_paddleocr_reads(
    ppocrv4_files, converted, tmp_path
):
    """The released recognizer through our path (the LMDB, the data path's decode and
    resize_and_pad, the paddle backend's normalization and greedy CTC: train.evaluate's
    evaluate()) against PaddleOCR's own TextRecognizer (the wheel's predict_rec.py, cv2
    decode, resize_norm_img, CTCLabelDecode with the space) running the released ONNX under
    ONNX Runtime: the same exact match within 0.5 point and the same text on every line but
    at most one. Lines are at most 320 wide at height 48, where the two inputs differ only in
    the padding's value, 1/255 against 0 (docs/ppocrv4.md; wider lines:
    docs/after_training.md)."""
    import cv2
    import paddleocr  # noqa: F401  (puts the wheel's tools/ and ppocr/ on sys.path)
    from tools.infer.predict_rec import TextRecognizer
    from tools.infer.utility import init_args

    from datasets.decode import decode_bgr, sniff_format
    from datasets.lmdb_ocr import LmdbOcrSource, LmdbOcrWriter
    from datasets.synthetic import LATIN, ocr_samples, write_all
    from train import tasks
    from train.config.load import load_config
    from train.evaluate import evaluate
    from train.inference import labels_of, load_weights
    from train.metrics import ctc_greedy_decode

    def narrow(samples):
        for data, text in samples:
            image = decode_bgr(data)
            if np.ceil(48 * image.shape[1] / image.shape[0]) <= 320:
                yield data, text

    lines = tmp_path / "lines"
    samples = ocr_samples(PARITY_LINES + 10, LATIN, str(ppocrv4_files["font"]), 5, 0.5)
    write_all(LmdbOcrWriter(lines), list(narrow(samples))[:PARITY_LINES])
    source = LmdbOcrSource(lines)
    records = [source.read(i) for i in range(len(source))]
    source.close()
    labels = [str(label) for _, label in records]
    formats = [sniff_format(data) for data, _ in records]
    assert len(records) == PARITY_LINES and 0.3 < formats.count("png") / PARITY_LINES < 0.7

    weights = converted
    config = load_config(
        ROOT / FINETUNE_CONFIGS["paddle"],
        [
            "model.init_from=null",
            f"data.char_dict={weights / 'ppocr_keys.txt'}",
            "loader.batch_size=40",
            "loader.num_workers=0",
        ],
    )
    characters = labels_of(config)
    backend = load_weights(str(weights / "ppocrv4_rec.pdparams"), config, characters)
    dataset = tasks.get("ocr").open_dataset(config.data, str(lines), train=False)
    read = []

    trainer = backend.trainer

    class Reading:  # the backend's trainer, noting each line's text as evaluate() predicts it
        def __getattr__(self, name):
            return getattr(trainer, name)

        def predict(self, batch):
            classes = trainer.predict(batch)
            for row in ctc_greedy_decode(classes):
                read.append("".join(characters[c - 1] for c in row))
            return classes

    backend.trainer = Reading()
    try:
        ours = evaluate(config, backend, dataset)
    finally:
        dataset.close()
        backend.runtime.shutdown()

    args = init_args().parse_args([])
    args.rec_model_dir, args.use_onnx = str(ppocrv4_files["onnx"]), True
    args.rec_char_dict_path = str(weights / "ppocr_keys.txt")
    args.rec_image_shape, args.use_space_char, args.use_gpu = "3,48,320", True, False
    args.rec_algorithm = "SVTR_LCNet"  # what PaddleOCR runs PP-OCRv4's recognizer as
    images = [cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR) for data, _ in records]
    paddleocr_read = [text for text, _ in TextRecognizer(args)(images)[0]]

    theirs = sum(text == label for text, label in zip(paddleocr_read, labels)) / PARITY_LINES
    differ = [
        (label, fmt, a, b)
        for label, fmt, a, b in zip(labels, formats, read, paddleocr_read)
        if a != b
    ]
    assert ours["samples"] == len(read) == PARITY_LINES
    assert abs(ours["acc"] - theirs) <= 0.005 and len(differ) <= 1, (ours["acc"], theirs, differ)
    assert theirs >= 0.5  # a wrong contract (RGB, unnormalized) reads few lines, in both
