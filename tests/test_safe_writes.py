"""Nothing a user can mistype deletes their files, and no write goes through a planted link.

--overwrite (python -m train, the converters) empties or replaces only what this project made: a
run directory carrying the marker (or a run's own files), an LMDB or HDF5 file of its writers.
Every file the trainer, the caches, the converters and the export write is opened without
following a link: a link at such a name is an error naming it, and its target is untouched.
Paths from a label file or a folder listing are contained after their links are resolved.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

from datasets.convert import paddleocr_labels_to_lmdb
from datasets.errors import DatasetError
from datasets.hdf5_images import Hdf5ImageWriter
from datasets.image_folder import ImageFolderSource
from datasets.lmdb_ocr import LmdbOcrSource, LmdbOcrWriter
from datasets.safe_files import LinkRefusedError
from datasets.synthetic import LATIN, ocr_samples, write_all
from train import run_dirs
from train.config.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
PRECIOUS = b"the user's own bytes\n"
LINK_WORDS = "is a symbolic link; remove it"


def victim(tmp_path: Path, name: str = "victim.txt") -> Path:
    """A file of the user's, outside every folder the code under test writes."""
    path = tmp_path / "elsewhere" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(PRECIOUS)
    return path


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


# ---------------------------------------------------------------- --overwrite of python -m train
def overwrite_args(output_dir=None) -> Namespace:
    return Namespace(resume=False, auto_resume=False, overwrite=True, output_dir=output_dir)


def test_overwrite_refuses_a_directory_that_is_no_run_directory(tmp_path):
    from train.__main__ import prepare_run_dir

    folder = tmp_path / "thesis"
    (folder / "chapters").mkdir(parents=True)
    (folder / "notes.txt").write_bytes(PRECIOUS)
    (folder / "chapters" / "one.tex").write_bytes(PRECIOUS)
    before = tree(folder)
    with pytest.raises(ConfigError) as refused:
        prepare_run_dir(folder, overwrite_args(str(folder)), is_main=True)
    message = str(refused.value)
    assert "\n" not in message and str(folder) in message and run_dirs.MARKER in message
    assert "empty or new directory" in message and "--overwrite would delete" in message
    assert tree(folder) == before and not (folder / run_dirs.MARKER).exists()
    # Without --overwrite too: a run writing there would make it pass for a run directory.
    with pytest.raises(ConfigError, match="a run would write among them"):
        run_dirs.check(str(folder), overwrite=False)


def test_the_current_directory_home_root_and_repository_are_never_run_directories(
    tmp_path, monkeypatch
):
    from train.__main__ import prepare_run_dir

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "keep.txt").write_bytes(PRECIOUS)
    # Stale run files do not make them run directories (a run once written there by mistake).
    (cwd / "checkpoints").mkdir()
    (cwd / "metrics.jsonl").write_text("{}\n")
    monkeypatch.chdir(cwd)
    with pytest.raises(ConfigError, match="the current directory"):
        prepare_run_dir(Path("."), overwrite_args("."), is_main=True)
    assert (cwd / "keep.txt").read_bytes() == PRECIOUS and (cwd / "checkpoints").is_dir()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    cases = {"": "is empty", ".": "the current directory", "/": "the filesystem root"}
    cases |= {str(home): "the home directory", str(ROOT): "the repository root"}
    for text, what in cases.items():
        for overwrite in (True, False):
            with pytest.raises(ConfigError, match=what) as refused:
                run_dirs.check(text, overwrite, "--output-dir")
            assert "\n" not in str(refused.value) and "empty or new directory" in str(refused.value)


def test_new_empty_marked_and_older_run_directories_are_taken(tmp_path):
    from train.__main__ import prepare_run_dir

    run_dirs.check(str(tmp_path / "new"), overwrite=True)
    empty = tmp_path / "empty"
    (empty / "launch-logs").mkdir(parents=True)  # the Paddle launcher's, made before the run
    (empty / ".lock").write_text("")
    run_dirs.check(str(empty), overwrite=False)
    # A run directory of before the marker: checkpoints/ and its metrics; it is marked once taken.
    old = tmp_path / "old"
    (old / "checkpoints" / "step-00000002").mkdir(parents=True)
    (old / "metrics.jsonl").write_text("{}\n")
    (old / "plots").mkdir()
    (old / ".lock").write_text("")
    prepare_run_dir(old, overwrite_args(str(old)), is_main=True)
    assert sorted(p.name for p in old.iterdir()) == [".lock", run_dirs.MARKER]
    # Marked: --overwrite empties it again, whatever it holds by then.
    (old / "summary.json").write_text("{}")
    prepare_run_dir(old, overwrite_args(str(old)), is_main=True)
    assert sorted(p.name for p in old.iterdir()) == [".lock", run_dirs.MARKER]


def test_the_cli_refuses_before_it_writes_or_reads_anything(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(PRECIOUS)
    config = str(ROOT / "configs/ocr/smoke.yaml")
    cmd = [sys.executable, "-m", "train", "--config", config, "--overwrite"]
    result = subprocess.run(
        [*cmd, "--output-dir", str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert str(folder) in lines[0] and run_dirs.MARKER in lines[0], lines
    assert "empty or new directory" in lines[0]
    assert sorted(p.name for p in folder.iterdir()) == ["cat.jpg"]  # no .lock either
    assert (folder / "cat.jpg").read_bytes() == PRECIOUS
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [*cmd, "--set", 'output.dir=""'], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 2 and "output.dir: is empty" in result.stderr, result.stderr
    assert os.listdir(tmp_path) == ["photos"]


# ---------------------------------------------------------------- links at names the run writes
def test_a_link_at_the_run_lock_is_refused_and_its_target_kept(tmp_path):
    from train.run_lock import RunLock

    run = tmp_path / "run"
    target = victim(tmp_path)
    plant(run / ".lock", target)
    with pytest.raises(LinkRefusedError, match=LINK_WORDS) as refused:
        RunLock(run).acquire()
    assert str(run / ".lock") in str(refused.value)
    assert target.read_bytes() == PRECIOUS
    (run / ".lock").unlink()
    os.link(target, run / ".lock")  # a hard link: the same file under a second name
    with pytest.raises(LinkRefusedError, match="hard link"):
        RunLock(run).acquire()
    assert target.read_bytes() == PRECIOUS


class FakeState:
    def save_state(self, directory: Path) -> None:
        (directory / "model.bin").write_bytes(b"weights")


class FakeBackend:  # what checkpoint.save reaches: the state part
    state = FakeState()


def test_a_link_at_a_checkpoint_partial_name_is_refused_and_its_target_kept(tmp_path):
    from train import checkpoint
    from train.errors import CheckpointError, exit_code

    run = tmp_path / "run"
    config = SimpleNamespace(framework="torch", task="ocr", model=SimpleNamespace(name="crnn"))
    position = checkpoint.Position(step=2, world_size=1, started_world_size=1)
    target = victim(tmp_path)
    plant(run / "checkpoints" / "latest.partial", target)
    with pytest.raises(CheckpointError) as refused:
        checkpoint.save(run, FakeBackend(), position, 2, config)
    assert LINK_WORDS in str(refused.value) and "latest.partial" in str(refused.value)
    assert exit_code(refused.value) == 4 and target.read_bytes() == PRECIOUS
    # A checkpoint's .partial folder: the link is refused, the folder it points at untouched.
    folder = tmp_path / "elsewhere" / "folder"
    folder.mkdir()
    (folder / "keep.txt").write_bytes(PRECIOUS)
    plant(run / "checkpoints" / "step-00000004.partial", folder)
    position.step = 4
    with pytest.raises(CheckpointError, match=LINK_WORDS):
        checkpoint.save(run, FakeBackend(), position, 2, config)
    assert tree(folder) == {"keep.txt": PRECIOUS}
    plant(run / "best.partial", folder)
    with pytest.raises((CheckpointError, LinkRefusedError), match=LINK_WORDS) as refused:
        checkpoint.save_best(run, FakeBackend(), position, config, "acc", 0.5)
    assert exit_code(refused.value) == 4
    assert tree(folder) == {"keep.txt": PRECIOUS}


def _write_metrics(run: Path) -> None:
    from train.telemetry import Telemetry

    Telemetry(run, True, 8, None, "knobs", 0.1)


def _write_log(run: Path) -> None:
    from train.cli import setup_logging

    handlers = logging.getLogger().handlers[:]
    try:
        setup_logging(run, True)
    finally:
        logging.getLogger().handlers[:] = handlers


def _write_resolved_config(run: Path) -> None:
    from train.config.load import load_config, save_resolved

    save_resolved(load_config(str(ROOT / "configs/ocr/smoke.yaml"), []), run)


def _write_bad_keys(run: Path) -> None:
    from datasets.bad_samples import BadSampleLog

    BadSampleLog(4, bad_keys_file=run / "bad_samples.train.tsv").close()


def _write_plots(run: Path) -> None:
    from train.report import write_plots

    rows = [
        {"type": "train", "step": s, "loss": 1.0 / s, "samples_per_s": 9.0}
        | {"data_wait_fraction": 0.1}
        for s in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_plots(run)


def _write_summary_through_atomic_write(run: Path) -> None:
    from datasets.safe_files import write_atomic

    write_atomic(run / "summary.json", "{}")


RUN_FILES = {
    "metrics.jsonl": _write_metrics,
    "train.log": _write_log,
    "config.resolved.yaml": _write_resolved_config,
    "bad_samples.train.tsv": _write_bad_keys,
    "plots/loss.png": _write_plots,
    "summary.json.partial": _write_summary_through_atomic_write,
}


@pytest.mark.parametrize("name", RUN_FILES)
def test_a_link_at_a_run_file_is_refused_and_its_target_kept(name, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    target = victim(tmp_path)
    plant(run / name, target)
    with pytest.raises(LinkRefusedError, match=LINK_WORDS) as refused:
        RUN_FILES[name](run)
    assert str(run / name) in str(refused.value)
    assert target.read_bytes() == PRECIOUS


def test_a_link_at_a_disk_cache_is_refused_and_its_target_kept(image_h5, tmp_path):
    from datasets.cache import SharedRecordCache

    folder = tmp_path / "cache"
    first = SharedRecordCache("disk", 24, 1 << 20, str(image_h5), folder)
    path = Path(first._block.path)
    first.close()
    copy = victim(tmp_path, "copy.cache")
    copy.write_bytes(path.read_bytes())  # a valid cache: reused, it would be written to
    path.unlink()
    plant(path, copy)
    with pytest.raises(LinkRefusedError, match=LINK_WORDS):
        SharedRecordCache("disk", 24, 1 << 20, str(image_h5), folder)


def test_export_refuses_a_link_in_its_output_folder(tmp_path, monkeypatch):
    """The frameworks' writers (torch.onnx.export, paddle.jit.save) open their files by name;
    the stand-in writes as they do. A link at one of those names is refused, its target kept."""
    from train import export, inference
    from train.config.load import load_config

    class Exporter:
        def export(self, directory, fmt, input_shape, pad):
            path = Path(directory) / "model.onnx"
            with open(path, "wb") as f:
                f.write(b"onnx")
            return [path]

    class Runtime:
        def shutdown(self):
            pass

    backend = SimpleNamespace(exporter=Exporter(), runtime=Runtime())
    monkeypatch.setattr(inference, "labels_of", lambda config: ["cat", "dog"])
    monkeypatch.setattr(inference, "load_backend", lambda *args: backend)
    config = load_config(str(ROOT / "configs/resnet50/smoke.yaml"), ["framework=torch"])
    model = SimpleNamespace(framework="torch", checkpoint=tmp_path / "ckpt")
    out = tmp_path / "out"
    target = victim(tmp_path)
    plant(out / "model.onnx", target)
    with pytest.raises(LinkRefusedError, match=LINK_WORDS):
        export.export(model, config, "onnx", out)
    assert target.read_bytes() == PRECIOUS
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx"]  # nothing else left
    (out / "model.onnx").unlink()
    files = export.export(model, config, "onnx", out)
    assert [f.parent for f in files] == [out, out, out] and (out / "model.onnx").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(f.name for f in files)


# ---------------------------------------------------------------- converters and their --overwrite
def test_lmdb_overwrite_replaces_only_an_lmdb_of_ours(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "data.mdb").write_bytes(PRECIOUS)  # LMDB-like by name only: not our writer's
    (folder / "notes.txt").write_bytes(PRECIOUS)
    for overwrite in (True, False):
        with pytest.raises(DatasetError, match="is not an OCR LMDB this project wrote") as no:
            LmdbOcrWriter(folder, overwrite=overwrite)
        assert "empty or new --out" in str(no.value)
    assert tree(folder) == {"data.mdb": PRECIOUS, "notes.txt": PRECIOUS}
    ours = tmp_path / "ours"
    write_all(LmdbOcrWriter(ours), ocr_samples(2, LATIN, None, seed=0))
    with pytest.raises(DatasetError, match="already exists.*--overwrite"):
        LmdbOcrWriter(ours)
    write_all(LmdbOcrWriter(ours, overwrite=True), ocr_samples(3, LATIN, None, seed=0))
    assert len(LmdbOcrSource(ours)) == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    write_all(LmdbOcrWriter(empty), ocr_samples(2, LATIN, None, seed=0))
    assert len(LmdbOcrSource(empty)) == 2
    # A .partial folder holding what no interrupted write leaves is not removed either.
    (tmp_path / "next.partial").mkdir()
    (tmp_path / "next.partial" / "notes.txt").write_bytes(PRECIOUS)
    with pytest.raises(DatasetError, match="not removed"):
        LmdbOcrWriter(tmp_path / "next")
    assert (tmp_path / "next.partial" / "notes.txt").read_bytes() == PRECIOUS


def test_hdf5_overwrite_replaces_only_a_file_of_ours_and_never_writes_through_a_link(tmp_path):
    out = tmp_path / "train.h5"
    out.write_bytes(PRECIOUS)
    with pytest.raises(DatasetError, match="is not a ResNet-50 HDF5 file this project wrote"):
        Hdf5ImageWriter(out, ["a"], overwrite=True)
    assert out.read_bytes() == PRECIOUS
    out.unlink()
    for name in ("train.h5.partial", "train.h5.partial-bytes", "train.h5"):
        target = victim(tmp_path, name)
        plant(tmp_path / name, target)
        with pytest.raises(LinkRefusedError, match=LINK_WORDS):
            Hdf5ImageWriter(out, ["a"], overwrite=True)
        assert target.read_bytes() == PRECIOUS
        (tmp_path / name).unlink()


def test_lmdb_partial_link_is_refused(tmp_path):
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "keep.txt").write_bytes(PRECIOUS)
    plant(tmp_path / "out.partial", folder)
    with pytest.raises(LinkRefusedError, match=LINK_WORDS):
        LmdbOcrWriter(tmp_path / "out")
    assert tree(folder) == {"keep.txt": PRECIOUS}


def test_make_synthetic_overwrite_leaves_a_folder_of_the_users_alone(tmp_path):
    out = tmp_path / "data"
    (out / "train").mkdir(parents=True)
    (out / "train" / "keep.txt").write_bytes(PRECIOUS)
    (out / "charset.txt").write_bytes(PRECIOUS)
    base = [sys.executable, "-m", "scripts.make_synthetic", "ocr", "--num", "4", "--quiet"]
    result = subprocess.run(
        [*base, "--out", str(out), "--overwrite"], cwd=ROOT, capture_output=True, text=True
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert f"{out / 'train'} exists and is not an OCR LMDB" in lines[0]
    assert tree(out) == {"train/keep.txt": PRECIOUS, "charset.txt": PRECIOUS}
    # A charset.txt of the user's beside no dataset of ours is not replaced either.
    (out / "train" / "keep.txt").unlink()
    (out / "train").rmdir()
    result = subprocess.run(
        [*base, "--out", str(out), "--overwrite"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2 and "charset.txt already exists" in result.stderr
    assert tree(out) == {"charset.txt": PRECIOUS}


# ---------------------------------------------------------------- paths from labels and listings
def test_label_file_links_that_lead_outside_the_data_dir_are_never_copied(tmp_path):
    images = tmp_path / "imgs"
    (images / "sub").mkdir(parents=True)
    (data, _), *_ = ocr_samples(1, LATIN, None, seed=0)
    (images / "sub" / "ok.jpg").write_bytes(data)
    secret = victim(tmp_path, "secret.jpg")
    plant(images / "sub" / "leak.jpg", secret)  # the path text stays inside; the link does not
    plant(images / "inside.jpg", images / "sub" / "ok.jpg")  # a link within the folder: fine
    lines = ["sub/ok.jpg\tfine", "sub/leak.jpg\tleak", "inside.jpg\tlinked"]
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(lines) + "\n", encoding="utf-8")
    path, count, problems = paddleocr_labels_to_lmdb(labels, images, tmp_path / "out")
    assert count == 2 and len(problems) == 1
    assert f"{labels}:2: 'sub/leak.jpg' is a link that leads outside --data-dir" in problems[0]
    source = LmdbOcrSource(path)
    assert [source.read(i) for i in range(len(source))] == [(data, "fine"), (data, "linked")]
    with pytest.raises(DatasetError, match="labels.txt:2: 'sub/leak.jpg' is a link"):
        paddleocr_labels_to_lmdb(labels, images, tmp_path / "strict", strict=True)


def test_image_folder_links_that_lead_outside_it_are_left_out(tmp_path, caplog):
    root = tmp_path / "folder"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "0.jpg").write_bytes(b"jpeg")
    plant(root / "cat" / "leak.jpg", victim(tmp_path, "secret.jpg"))
    plant(root / "cat" / "same.jpg", root / "cat" / "0.jpg")
    outside = tmp_path / "elsewhere" / "dog"
    outside.mkdir(parents=True)
    (outside / "1.jpg").write_bytes(PRECIOUS)
    plant(root / "dog", outside)  # a whole class folder elsewhere
    with caplog.at_level(logging.WARNING):
        source = ImageFolderSource(root)
    assert [source.key(i) for i in range(len(source))] == ["cat/0.jpg", "cat/same.jpg"]
    assert "left out 2 link(s) that lead outside it: cat/leak.jpg, dog/" in caplog.text
    assert source.read(1) == (b"jpeg", 0)
    # A file replaced by a link after the listing is refused when read.
    (root / "cat" / "0.jpg").unlink()
    plant(root / "cat" / "0.jpg", tmp_path / "elsewhere" / "secret.jpg")
    from datasets.errors import BadSampleError

    with pytest.raises(BadSampleError, match="is a link that leads outside"):
        source.read(0)


# ---------------------------------------------------------------- every write site, by kind
WRITE_MODES = set("wax+")
# Writes that may open by name as they do, each with its reason; any other (a new write_text,
# open(..., "w"), FileHandler, savefig or framework save to a path) fails the test below: use
# datasets.safe_files (open_new, open_append, write_atomic, refuse_link) instead.
REVIEWED = {
    ("train/cli.py", "open(w)"): "os.devnull, for faulthandler",
    ("train/backends/paddle/state.py", "write_text"): "in the checkpoint's new .partial folder",
    ("train/backends/torch/state.py", "torch.save"): "in the checkpoint's new .partial folder",
    ("train/backends/paddle/export.py", "paddle.save"): "in train/export.py's staging folder",
    ("train/backends/paddle/export.py", "paddle.jit.save"): "in train/export.py's staging folder",
    ("train/export.py", "write_text"): "in its staging folder (tempfile.mkdtemp)",
    ("train/inference.py", "write_text"): "write_contract: into train/export.py's staging folder",
    ("scripts/bench_loader.py", "write_text"): "benchmark results beside the benchmark",
    ("scripts/gpu_check/context.py", "open(w)"): "in the GPU check's own new work folder",
}


def _write_kind(node: ast.Call) -> str | None:
    """What kind of link-following write ``node`` is, or None."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
    if name in ("write_text", "write_bytes", "FileHandler", "savefig"):
        first = node.args[0] if node.args else None
        if name == "savefig" and isinstance(first, ast.Name) and first.id == "image":
            return None  # into an io.BytesIO, then write_atomic
        return name
    if name == "save" and owner in ("torch", "paddle", "paddle.jit"):
        return f"{owner}.save"
    if name == "open" and owner == "os":
        text = ast.unparse(node)
        if "O_CREAT" in text and not ("O_EXCL" in text or "NOFOLLOW" in text):
            return "os.open(O_CREAT)"
        return None
    if name == "open" and owner not in ("lmdb", "Image", "tarfile", "zipfile", "gzip", "npz"):
        mode = node.args[1] if len(node.args) > 1 else None
        mode = next((k.value for k in node.keywords if k.arg == "mode"), mode)
        if isinstance(mode, ast.Constant) and set(str(mode.value)) & WRITE_MODES:
            return "open(w)"
    if name == "File" and len(node.args) > 1:
        mode = node.args[1]
        if isinstance(mode, ast.Constant) and mode.value in ("w", "a", "r+"):
            return "h5py.File(w)"
    return None


def test_every_write_site_refuses_links_or_is_reviewed():
    found, seen = [], set()
    for folder in ("train", "datasets", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
                kind = _write_kind(node) if isinstance(node, ast.Call) else None
                if kind is None:
                    continue
                seen.add((rel, kind))
                if (rel, kind) not in REVIEWED:
                    found.append(f"{rel}:{node.lineno}: {kind}")
    assert found == [], "writes that follow a link at their name: " + "; ".join(found)
    assert set(REVIEWED) <= seen, f"reviewed writes that are gone: {set(REVIEWED) - seen}"


def test_a_link_at_an_s3_staging_part_file_is_refused_and_its_target_kept(tmp_path):
    """The S3 staging cache starts a download in ``<name>.part`` beside its ``.part.json``
    sidecar: a link planted at either is refused, and what it points to keeps its bytes."""
    from datasets.s3_objects import RemoteObject, _resume_offset

    obj = RemoteObject("a.bin", "k/a.bin", '"0123456789abcdef0123456789abcdef"', 10, "now")
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    for name in ("a.bin.part", "a.bin.part.json"):
        stage = tmp_path / name.replace(".", "_")
        stage.mkdir()
        (stage / name).symlink_to(outside)
        with pytest.raises(LinkRefusedError):
            _resume_offset(stage / "a.bin.part", obj)
        assert outside.read_text() == "keep me"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert _resume_offset(fresh / "a.bin.part", obj)[0] == 0  # a plain start still works
    assert (fresh / "a.bin.part").read_bytes() == b""


def test_the_doctor_fails_a_folder_training_would_refuse(tmp_path):
    """The doctor's output-dir check is training's: a folder holding a user's files and no
    marker FAILs with the same reason and fix; a new folder passes."""
    from train.doctor import check_output_dir

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    check, _ = check_output_dir(folder, "overwrite")
    assert check.status == "FAIL" and ".starved-run" in check.detail, check
    assert "--overwrite would delete them" in check.detail and "new directory" in check.fix
    assert (folder / "thesis.tex").read_text() == "years of work"
    check, _ = check_output_dir(tmp_path / "new-run")
    assert check.status == "PASS", check
