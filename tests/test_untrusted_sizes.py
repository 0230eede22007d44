"""No small input takes large memory or time: every size a file or a server declares is checked
against what it really holds, or against a bound, before anything of that size is allocated,
read or walked. HDF5 datasets declared and never written, LMDB counts and labels, pixel budgets
on every decode path (tuner, bench, predict, validation), YAML alias bombs, S3 listings that do
not end and downloads larger than their listing. Memory is measured with tracemalloc (numpy and
h5py allocate through it), time with the clock; every case runs in-process, in well under a
second each."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import http.server
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import h5py
import numpy as np
import pytest

from datasets import decode, hdf5_images, limits
from datasets.errors import BadSampleError, DatasetError
from datasets.hdf5_images import Hdf5ImageSource, Hdf5ImageWriter, Hdf5TagSource
from datasets.lmdb_ocr import MAX_LABEL_BYTES, LmdbOcrSource, LmdbOcrWriter
from datasets.ocr_transforms import CharDict
from datasets.synthetic import LATIN, encode_image, imagenet_like, ocr_samples, write_all
from tests.test_pixel_budget import png_bomb
from train.config.errors import ConfigError
from train.config.load import load_config

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


class Peak:
    """Peak traced memory (bytes) of the block, over what was allocated before it."""

    def __enter__(self) -> Peak:
        tracemalloc.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


# ---------------------------------------------------------------- HDF5
def _jpegs(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [encode_image(imagenet_like(i % 2, rng), "jpeg") for i in range(n)]


def _good_file(path: Path, n: int = 3) -> Path:
    writer = Hdf5ImageWriter(path, ["a", "b"])
    for i, data in enumerate(_jpegs(n)):
        writer.add(data, i % 2, f"{i}.jpg")
    return writer.finish()


def _replace(path: Path, name: str, make) -> None:
    """Replace dataset ``name`` of the file with ``make(file, name, old values)``."""
    with h5py.File(path, "a") as f:
        old = f[name][:]
        del f[name]
        make(f, name, old)


def _image_bytes_never_written(tmp_path: Path) -> Path:
    """8 kB on disk; image_bytes claims 64 MiB in chunks, none ever written."""
    path = tmp_path / "never.h5"
    with h5py.File(path, "w") as f:
        f.attrs.update(format="resnet50-hdf5", schema_version=2, class_names='["a"]')
        f.create_dataset("image_bytes", (64 * MiB,), np.uint8, chunks=(MiB,))
        f["offsets"] = np.array([0, 64 * MiB], np.int64)
        f["labels"] = np.array([0], np.int64)
    return path


def _image_bytes_half_written(tmp_path: Path) -> Path:
    """The records of a real file, their bytes chunked, only the first chunk written: the
    records past it would read as zeros."""
    path = _good_file(tmp_path / "half.h5")

    def make(f, name, old):
        f.create_dataset(name, old.shape, np.uint8, chunks=(4096,))[:4096] = old[:4096]

    _replace(path, "image_bytes", make)
    return path


def _offsets_never_written(tmp_path: Path) -> Path:
    """A real file whose offsets and labels claim 8 M records (64 MiB each), never written."""
    path = _good_file(tmp_path / "offsets.h5")
    records = 8 * MiB
    for name, length in (("offsets", records + 1), ("labels", records)):
        _replace(
            path,
            name,
            lambda f, n, _, k=length: f.create_dataset(n, (k,), np.int64, chunks=(4096,)),
        )
    with h5py.File(path, "a") as f:
        del f["keys"]
    return path


def _labels_never_written(tmp_path: Path) -> Path:
    """A real file whose labels were declared and never written: every record would read as
    class 0, silently."""
    path = _good_file(tmp_path / "labels.h5")
    _replace(
        path, "labels", lambda f, n, old: f.create_dataset(n, old.shape, np.int64, chunks=(2,))
    )
    return path


def _tags_never_written(tmp_path: Path) -> Path:
    """A file with tags whose tags were declared and never written: no record would have any."""
    writer = Hdf5ImageWriter(tmp_path / "tags.h5", ["a", "b"], tag_names=["x", "y"])
    for i, data in enumerate(_jpegs(3)):
        writer.add(data, i % 2, f"{i}.jpg", tags=[i % 2])
    path = writer.finish()
    _replace(
        path, "tags", lambda f, n, old: f.create_dataset(n, old.shape, np.uint8, chunks=(2, 2))
    )
    return path


@pytest.mark.parametrize(
    "make, field",
    [
        (_image_bytes_never_written, "'image_bytes'"),
        (_image_bytes_half_written, "'image_bytes'"),
        (_offsets_never_written, "'offsets'"),
        (_labels_never_written, "'labels'"),
        (_tags_never_written, "'tags'"),
    ],
    ids=["image_bytes-never-written", "image_bytes-half-written", "offsets", "labels", "tags"],
)
def test_hdf5_bytes_declared_and_never_written_are_refused_at_open(tmp_path, make, field):
    """Before any read of them: the file, not one record, is unusable (its writer never wrote
    them), and the error names the file, the field and the fix. Nothing of the claimed size is
    allocated (reading the 64 MiB record through h5py took 2 x 64 MiB, the index 64 MiB)."""
    path = make(tmp_path)
    with Peak() as peak, pytest.raises(DatasetError) as raised:
        Hdf5TagSource(path).read(0) if field == "'tags'" else Hdf5ImageSource(path).read(0)
    message = str(raised.value)
    assert str(path) in message and f"{field}: declares" in message, message
    assert "never written" in message and "HINT: " in message, message
    assert peak.bytes < 4 * MiB, peak.bytes


def test_hdf5_compressed_datasets_past_what_real_data_compresses_are_refused(tmp_path, monkeypatch):
    """A compressed chunk is inflated whole on every read of one of its elements, and no real
    index or image compresses past deflate's 1032:1: both are checked from the header (the
    limits lowered here so the test writes kilobytes)."""
    path = _good_file(tmp_path / "gz.h5")

    def make(f, name, old):
        f.create_dataset(name, data=old, chunks=(len(old),), compression="gzip")

    _replace(path, "image_bytes", make)
    Hdf5ImageSource(path)  # compressed image bytes read as before
    monkeypatch.setattr(hdf5_images, "MAX_FILTERED_CHUNK_BYTES", 4096)
    with pytest.raises(DatasetError, match=r"'image_bytes': compressed chunks of \d+ bytes"):
        Hdf5ImageSource(path)
    monkeypatch.undo()
    path = tmp_path / "zeros.h5"  # 4096 records of one byte, their labels compressed ~500:1
    with h5py.File(path, "w") as f:
        f.attrs.update(format="resnet50-hdf5", schema_version=2, class_names='["a"]')
        f["image_bytes"] = np.zeros(4096, np.uint8)
        f["offsets"] = np.arange(4097, dtype=np.int64)
        f.create_dataset("labels", data=np.zeros(4096, np.int64), chunks=(4096,), compression=9)
    Hdf5ImageSource(path)
    monkeypatch.setattr(hdf5_images, "MAX_INFLATE_RATIO", 10)
    with pytest.raises(DatasetError, match=r"'labels': 32768 bytes compressed into \d+, more than"):
        Hdf5ImageSource(path)


# ---------------------------------------------------------------- LMDB and labels
def test_lmdb_num_samples_of_thousands_of_digits_is_a_dataset_error(tmp_path):
    """Python refuses to parse an int of over 4300 digits (a ValueError out of the reader)."""
    import lmdb

    path = write_all(LmdbOcrWriter(tmp_path / "db"), ocr_samples(2, LATIN, None, seed=0))
    with lmdb.open(str(path)) as env, env.begin(write=True) as txn:
        txn.put(b"num-samples", b"9" * 5000)
    with pytest.raises(DatasetError, match=r"key 'num-samples' is b'9999.* \(5000 bytes\)"):
        LmdbOcrSource(path)


def test_a_label_of_megabytes_is_refused_before_it_is_decoded_or_encoded(tmp_path):
    """The reader refuses a label over MAX_LABEL_BYTES without decoding it; the encoder checks
    the length before its per-character lookups (which cost a 10 M-character label 80 MB and a
    message quoting all of it)."""
    samples = list(ocr_samples(2, LATIN, None, seed=0))
    samples[1] = (samples[1][0], "a" * (MAX_LABEL_BYTES + 1))
    source = LmdbOcrSource(write_all(LmdbOcrWriter(tmp_path / "db"), samples))
    source.read(0)
    with pytest.raises(BadSampleError, match=f"holds {MAX_LABEL_BYTES + 1} bytes") as raised:
        source.read(1)
    assert raised.value.kind == "label_too_long"
    label = "a" * 10_000_000 + "\u00e9"  # too long, and a character out of the dictionary
    started = time.perf_counter()
    with Peak() as peak, pytest.raises(BadSampleError) as raised:
        CharDict(list(LATIN)).encode(label, 25)
    assert raised.value.kind == "label_too_long" and len(str(raised.value)) < 100
    assert peak.bytes < MiB and time.perf_counter() - started < 0.1


# ---------------------------------------------------------------- pixel budget, every path
BOMB = png_bomb(7000)  # 49 Mpixels in 50 kB: over the 40 M budget; 147 MB as an RGB array


def test_max_image_pixels_is_defined_once():
    from train.config.fields import DataConfig

    default = DataConfig.__dataclass_fields__["max_image_pixels"].default
    assert default is limits.MAX_IMAGE_PIXELS is decode.MAX_IMAGE_PIXELS
    defining = []
    for folder in ("train", "datasets", "scripts", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                value = getattr(node, "value", None)
                assigns = isinstance(node, (ast.Assign, ast.AnnAssign))
                if assigns and isinstance(value, ast.Constant) and value.value == 40_000_000:
                    defining.append(path.relative_to(ROOT).as_posix())
    assert defining == ["datasets/limits.py"]


@pytest.fixture
def ocr_lmdb_with_bomb(tmp_path):
    root = tmp_path / "ocr"
    write_all(LmdbOcrWriter(root), [*ocr_samples(30, LATIN, None, seed=0), (BOMB, "abc")])
    (tmp_path / "charset.txt").write_text("".join(c + "\n" for c in LATIN), encoding="utf-8")
    return root, tmp_path / "charset.txt"


def test_tuner_stage_timing_refuses_a_giant_from_its_header(ocr_lmdb_with_bomb):
    """The tuner times the decode with the transform's budget and skips bad samples, as
    training does (it decoded the full image with no budget: 147 MB here, then failed)."""
    from datasets.dataset import build_ocr_dataset
    from train.tune import measure

    root, charset = ocr_lmdb_with_bomb
    chars = CharDict.from_file(charset)
    dataset = build_ocr_dataset(str(root), chars, train=False, max_bad_fraction=1.0)
    with Peak() as peak:
        sample = measure.time_stages(dataset, batch_size=2, seed=0, seconds=2.0)
    assert len(sample.decode_s) == 30 and peak.bytes < 40 * MiB, peak.bytes


def test_bench_decoders_refuse_a_giant_from_its_header(ocr_lmdb_with_bomb, monkeypatch):
    """bench/pipelines.py's full decode (PIL) and bench/ocr_layers.py's C-only layer go through
    the pixel budget (open_pil checked only the container; the layer decoded raw)."""
    from bench import ocr_layers
    from bench.pipelines import DecodeOnly

    with Peak() as peak, pytest.raises(BadSampleError) as raised:
        DecodeOnly()(BOMB, 0, None)
    assert raised.value.kind == "image_too_large" and peak.bytes < 40 * MiB, peak.bytes
    root, charset = ocr_lmdb_with_bomb
    monkeypatch.setattr(ocr_layers, "ocr_data", lambda lines: {"mixed": root, "charset": charset})
    with Peak() as peak, pytest.raises(BadSampleError) as raised:
        for _, run, _ in ocr_layers._layers(4, 4)[:1]:  # the C-only layer
            run()
    assert raised.value.kind == "image_too_large" and peak.bytes < 40 * MiB, peak.bytes


@pytest.mark.parametrize("task", ["ocr", "classification"])
def test_predict_and_validation_refuse_a_giant_from_its_header(tmp_path, task):
    """train.predict preprocesses through the task's prepare_image, scripts/validate_data.py
    through datasets.validate: both check the budget from the header."""
    from datasets.validate import scan
    from train import inference

    spec = {
        "ocr": {"task": "ocr", "image_shape": [3, 32, 100]},
        "classification": {"task": "classification", "image_size": 32, "eval_resize": 40},
    }[task]
    with Peak() as peak, pytest.raises(BadSampleError) as raised:
        inference.preprocess(spec, [BOMB])
    assert raised.value.kind == "image_too_large" and peak.bytes < 40 * MiB, peak.bytes
    writer = Hdf5ImageWriter(tmp_path / "x.h5", ["a"])
    writer.add(BOMB, 0, "bomb.png")
    path = writer.finish()
    with Peak() as peak:
        report = scan(path)
    assert [bad[1] for bad in report.bad] == ["image_too_large"] and peak.bytes < 40 * MiB


# ---------------------------------------------------------------- YAML
def _laughs(levels: int) -> str:
    """A "billion laughs": each anchor a list of nine aliases of the one before."""
    lines = ["task: ocr", 'l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for k in range(1, levels):
        lines.append(f"l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text, problem",
    [
        (_laughs(10), "expands to more than 100000 values with its aliases followed"),
        ("task: ocr\nx: &x [1, *x]\n", "recursive alias *x (line 2) inside its own anchor"),
        ("task: ocr\nx: &x {a: *x}\n", "recursive alias *x (line 2)"),
        ("task: ocr\nx: " + "[" * 500 + "]" * 500 + "\n", "nested deeper than 100 levels"),
    ],
    ids=["billion-laughs", "recursive-list", "recursive-mapping", "deep"],
)
def test_yaml_that_expands_past_the_bounds_is_a_config_error_at_once(tmp_path, text, problem):
    """The bomb (600 bytes) expands to 9**10 values (the duplicate-key walk ran for minutes), a
    recursive alias or 500 '[' were RecursionError tracebacks; now each is a ConfigError that
    names the file, from one pass over the parser's events."""
    path = tmp_path / "bomb.yaml"
    path.write_text(text, encoding="utf-8")
    assert path.stat().st_size < 8000
    started = time.perf_counter()
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert time.perf_counter() - started < 1.0
    assert problem in str(raised.value) and "bomb.yaml" in str(raised.value)


def test_yaml_bombs_in_set_and_through_python_m_train(tmp_path):
    bomb = "[" + ", ".join(f"&l{k} [" + ", ".join([f"*l{k - 1}"] * 9) + "]" for k in range(1, 8))
    bomb = bomb.replace("&l1 [*l0", "&l0 [1, 1, 1, 1, 1, 1, 1, 1, 1], &l1 [*l0", 1) + "]"
    with pytest.raises(ConfigError, match=r"--set x=.*an alias bomb"):
        load_config(ROOT / "configs/ocr/smoke.yaml", [f"x={bomb}"])
    path = tmp_path / "bomb.yaml"
    path.write_text(_laughs(10), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "train", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "an alias bomb" in result.stderr and "bomb.yaml" in result.stderr


# ---------------------------------------------------------------- S3
class _StubS3(http.server.BaseHTTPRequestHandler):
    """Just enough of S3 to misbehave, by ``mode``: listings that repeat their token
    (repeat-token), their page under new tokens (repeat-page) or never end (endless), and one
    object (one-object) whose GET sends more than its listed size."""

    mode = "repeat-token"
    body = b"x" * (4 * MiB)
    listed = 10
    pages = 0

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        url = urlparse(self.path)
        if "list-type" not in parse_qs(url.query):
            self._send(self.body, "application/octet-stream")
            return
        type(self).pages += 1
        page, mode = type(self).pages, self.mode
        key = "p/k000001" if mode in ("repeat-page", "one-object") else f"p/k{page:06d}"
        token = "again" if mode == "repeat-token" else f"t{page}"
        truncated = "false" if mode == "one-object" else "true"
        size = self.listed if mode == "one-object" else 1
        etag = hashlib.md5(self.body[:size]).hexdigest()
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>b</Name><Prefix>p/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
            f"<IsTruncated>{truncated}</IsTruncated><NextContinuationToken>{token}"
            f"</NextContinuationToken><Contents><Key>{key}</Key>"
            "<LastModified>2024-01-01T00:00:00.000Z</LastModified>"
            f"<ETag>&quot;{etag}&quot;</ETag><Size>{size}</Size>"
            "<StorageClass>STANDARD</StorageClass></Contents></ListBucketResult>"
        )
        self._send(xml.encode(), "application/xml")

    def _send(self, payload: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        # The client may stop reading early: what it should do with a body past the listing.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(payload)


@pytest.fixture
def stub_s3(monkeypatch):
    pytest.importorskip("s3fs")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StubS3)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "stub")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "stub")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    _StubS3.pages = 0
    try:
        yield _StubS3
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "mode, problem",
    [
        ("repeat-token", "makes no progress: continuation token 'again' came twice"),
        ("repeat-page", "makes no progress: a page starts at 'p/k000001', not after"),
    ],
)
def test_an_s3_listing_that_does_not_end_is_an_error(stub_s3, tmp_path, monkeypatch, mode, problem):
    """A server that repeats its continuation token (or its page, under new tokens) was listed
    forever; now the second page stops it, naming the bucket and prefix."""
    from datasets.remote import RemoteStorageError, stage

    monkeypatch.setattr(stub_s3, "mode", mode)
    started = time.perf_counter()
    with pytest.raises(RemoteStorageError) as raised:
        stage("s3://b/p", tmp_path / "cache", retries=0, timeout_s=5.0)
    assert "listing s3://b/p/ at http://127.0.0.1:" in str(raised.value)
    assert problem in str(raised.value) and stub_s3.pages == 2
    assert time.perf_counter() - started < 10


def test_an_s3_listing_past_the_page_limit_is_an_error(stub_s3, tmp_path, monkeypatch):
    """New keys and tokens on every page, never the last: stopped at MAX_LIST_PAGES (lowered
    here from 10000)."""
    from datasets import s3_objects
    from datasets.remote import RemoteStorageError, stage

    monkeypatch.setattr(stub_s3, "mode", "endless")
    monkeypatch.setattr(s3_objects, "MAX_LIST_PAGES", 5)
    with pytest.raises(RemoteStorageError, match=r"s3://b/p/ .* goes past 5 pages"):
        stage("s3://b/p", tmp_path / "cache", retries=0, timeout_s=5.0)
    assert stub_s3.pages == 5


def test_a_download_longer_than_its_listing_is_stopped_at_the_listed_size(
    stub_s3, tmp_path, monkeypatch
):
    """The listing says 10 bytes; the server sends 4 MiB (its Content-Length agreeing). The
    client reads at most one byte past the 10, fails without retrying, and leaves no partial
    file (it wrote the 4 MiB, then retried, before)."""
    from datasets.remote import RemoteStorageError, stage

    monkeypatch.setattr(stub_s3, "mode", "one-object")
    with pytest.raises(RemoteStorageError) as raised:
        stage("s3://b/p", tmp_path / "cache", retries=2, backoff_s=0.01, timeout_s=5.0)
    assert "s3://b/p/k000001 at http://127.0.0.1:" in str(raised.value)
    assert "sent more than the 10 bytes its listing gave" in str(raised.value)
    left = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and ".locks" not in p.parts]
    assert sum(p.stat().st_size for p in left if not p.name.endswith(".json")) == 0, left
