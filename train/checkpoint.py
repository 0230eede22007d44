"""Checkpoints that are never half-written, and the run position they restore.

A checkpoint is a directory ``checkpoints/step-00001234/`` holding the backend's files
(model, optimizer, schedule, RNG states, in formats that load without unpickling) and
``trainer.json`` (epoch, step, samples consumed in the epoch, framework, task). It is written
as ``*.partial`` and renamed into place, so a crash mid-write leaves the previous checkpoint as
the latest; ``latest`` names the newest and is replaced atomically too.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class Position:
    epoch: int = 0
    step: int = 0  # optimizer steps done
    epoch_samples: int = 0  # this rank's samples consumed in the current epoch


from train.errors import CheckpointError  # noqa: E402  (raised here; main maps it to exit 4)


class UnsafeCheckpointError(pickle.UnpicklingError, ValueError):
    """A checkpoint file holds pickled Python objects, which a backend's load_state refuses to
    unpickle: that could run code from whoever wrote the file."""


def refuse_pickle(path: Path, holds: str, reader: str, detail: str) -> UnsafeCheckpointError:
    """The error for a checkpoint file that only unpickling could read: what it ``holds``,
    which safe ``reader`` refused it, and the reader's own words (``detail``)."""
    return UnsafeCheckpointError(
        f"refused to load {path}: it holds {holds}, and checkpoints are read with {reader} so "
        "that a file cannot run code. Use a checkpoint written by this project's save_state. "
        f"({detail})"
    )


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def save(run_dir: Path, backend, position: Position, keep_last: int, config) -> Path:
    started = time.perf_counter()
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{position.step:08d}"
    tmp = root / f"step-{position.step:08d}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    backend.save_state(tmp)
    _fsync_tree(tmp)  # on disk before the rename makes it the latest
    meta = {
        "position": asdict(position),
        "framework": config.framework,
        "task": config.task,
        "model": config.model.name,
        "saved_at": time.time(),
    }
    _write_atomic(tmp / "trainer.json", json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(root / "latest", final.name + "\n")
    for old in sorted(root.glob("step-????????"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    # Size and time in the log: what a stop grace period (compose, k8s) has to cover.
    size = sum(path.stat().st_size for path in final.iterdir() if path.is_file())
    log.info("checkpoint %s (%.0f MB in %.2f s)", final, size / 1e6, time.perf_counter() - started)
    return final


def latest(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    marker = root / "latest"
    if marker.is_file():
        candidate = root / marker.read_text().strip()
        if (candidate / "trainer.json").is_file():
            return candidate
    complete = [p for p in sorted(root.glob("step-????????")) if (p / "trainer.json").is_file()]
    return complete[-1] if complete else None


def restore(run_dir: Path, backend, config) -> Position:
    """Load the latest checkpoint of ``run_dir`` into ``backend``; return where to continue."""
    path = latest(run_dir)
    if path is None:
        raise CheckpointError(
            f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'}. HINT: drop --resume to "
            "start a new run, or point --output-dir at the run to continue"
        )
    meta = json.loads((path / "trainer.json").read_text())
    for key in ("framework", "task", "model"):
        wanted = (
            config.framework
            if key == "framework"
            else (config.task if key == "task" else config.model.name)
        )
        if meta[key] != wanted:
            raise CheckpointError(
                f"--resume: {path} was written by {key}={meta[key]}, this config has {wanted}. "
                "HINT: resume with the config that started the run, or use a new --output-dir"
            )
    backend.load_state(path)
    position = Position(**meta["position"])
    log.info("resumed from %s (epoch %d, step %d)", path, position.epoch, position.step)
    return position
