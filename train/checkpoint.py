"""Checkpoints that are never half-written, and the run position they restore.

A checkpoint is a directory ``checkpoints/step-00001234/`` holding the backend's files
(model, optimizer, schedule, RNG states, in formats that load without unpickling) and
``trainer.json`` (epoch, step, samples consumed in the epoch, framework, task). It is written
as ``*.partial`` and renamed into place, so a crash mid-write leaves the previous checkpoint as
the latest; ``latest`` names the newest and is replaced atomically too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import signal
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from datasets import safe_files
from train import faults, run_files, tasks
from train.errors import CheckpointError, WorkerDiedError  # raised here; main maps them

log = logging.getLogger(__name__)
run_log = logging.getLogger("train")  # the loop's logger: what a resume decides about the run


@dataclass
class Position:
    """Where a run stands, and how it maps onto another number of ranks."""

    epoch: int = 0
    step: int = 0  # optimizer steps done, each of world_size x loader.batch_size samples
    epoch_samples: int = 0  # samples of the current epoch consumed, by all ranks together
    # How many ranks the checkpoint's steps were taken on, and the run's first launch (whose
    # global batch train.max_steps and optim.warmup_steps count): a resume on another number
    # of ranks converts the position (reshard). 0: a checkpoint from before they were
    # recorded, taken to be from the resuming world size (start_position).
    world_size: int = 0
    started_world_size: int = 0

    @property
    def step_scale(self) -> float:
        """Steps of the first launch's global batch per step of this world size's."""
        return self.started_world_size / self.world_size

    def reshard(self, world_size: int, sampler, steps_per_epoch: int, config, backend) -> int:
        """Continue on ``world_size`` ranks as the same training in samples; return the run's
        last step. The epoch goes on with the samples not yet read (``sampler`` deals them out
        to this world size) and later epochs take ``steps_per_epoch``; the step count,
        train.max_steps and the warmup are converted to this world size's global batch
        (loader.batch_size per rank, so the global batch changes), and the backend's schedule
        with them, so the learning-rate curve continues where it was. The learning rate itself
        is not rescaled for the new global batch; that stays the config's choice."""
        saved_world, saved_step = self.world_size, self.step
        batch_size, train_cfg = config.loader.batch_size, config.train
        self.step = round(saved_step * saved_world / world_size)
        self.world_size = world_size
        sampler.set_epoch(self.epoch, consumed=self.epoch_samples)
        rest_of_epoch = len(sampler) // batch_size
        later_epochs = train_cfg.epochs - self.epoch - 1
        epochs_end = self.step + rest_of_epoch + later_epochs * steps_per_epoch
        total_steps = last_step(train_cfg, epochs_end, self.step_scale)
        warmup = round(config.optim.warmup_steps * self.step_scale)
        backend.trainer.reschedule(self.step, total_steps, warmup)
        run_log.warning(
            "resuming a checkpoint of %d rank(s) on %d: global batch %d -> %d, step %d -> %d of "
            "%d (the same samples seen and learning-rate progress); the epoch's %d samples read "
            "so far are not read again. The learning rate is not rescaled for the new batch.",
            saved_world,
            world_size,
            batch_size * saved_world,
            batch_size * world_size,
            saved_step,
            self.step,
            total_steps,
            self.epoch_samples,
        )
        return total_steps


def last_step(train_cfg, epochs_end: int, step_scale: float = 1.0) -> int:
    """The run's last step: the end of train.epochs (``epochs_end``) or train.max_steps,
    whichever comes first. train.max_steps counts steps of the first launch's global batch
    (``step_scale``: Position.step_scale)."""
    if train_cfg.max_steps is None:
        return epochs_end
    return min(epochs_end, max(1, round(train_cfg.max_steps * step_scale)))


def start_position(run_dir: Path, backend, config, resume: bool, world_size: int) -> Position:
    """Where the run starts: step 0 on ``world_size`` ranks or, with ``resume``, the newest
    usable checkpoint's position (restore, which loads its state into ``backend``). Its world
    sizes are filled in where the checkpoint predates them; when it was taken on another
    number of ranks, its world_size still says so, for the caller to reshard."""
    if not resume:
        return Position(world_size=world_size, started_world_size=world_size)
    position = restore(run_dir, backend, config)
    if not position.world_size:  # then epoch_samples counted one rank's samples
        position.epoch_samples *= world_size
        position.world_size = world_size
    position.started_world_size = position.started_world_size or world_size
    return position


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
    tmp = safe_files.refuse_link(path).with_name(path.name + ".partial")
    with os.fdopen(safe_files.open_new(tmp), "w", encoding="utf-8") as f:  # never via a link
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


def _fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in ``directory`` durable: without it a power loss after
    os.replace can bring back the old name (ext4, xfs)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _manifest(directory: Path) -> dict[str, dict[str, int]]:
    """Each file's size and CRC-32, checked on resume: a truncated or damaged file is found
    before the backend reads it (fast: the files are still in the page cache)."""
    return {
        path.name: {"bytes": path.stat().st_size, "crc32": _crc32(path)}
        for path in sorted(directory.iterdir())
        if path.is_file()
    }


def _save_failed(
    error: BaseException, room: int | None, root: Path, what: str, kept: str
) -> CheckpointError:
    """The one line for a failed save of ``what`` into ``root``: ``room`` is run_files'
    room_errno (the disk, a quota or the file-size limit ran out), read before the partial files
    were removed; ``kept`` names what is intact."""
    if room is not None:
        return CheckpointError(
            f"{run_files.OUT_OF_ROOM[room]}: {what} does not fit in {root} "
            f"({run_files.room_left(room, root)}); its partial files are removed and {kept}. "
            f"HINT: {run_files.room_fix(room)}, then continue with --resume"
        )
    return CheckpointError(
        f"{what} could not be written to {root}: {type(error).__name__}: "
        f"{run_files.one_line(str(error))[:300]}; its partial files are removed and {kept}. "
        "HINT: check that the run directory is writable (permissions, a read-only or lost "
        "mount), then continue with --resume"
    )


def _write_state(directory: Path, backend, position: Position, config) -> None:
    """A complete checkpoint in the new ``directory``: the backend's files, then trainer.json
    (the position, what wrote it, each file's size and CRC-32 for restore to verify), all on
    disk before a rename makes it a checkpoint."""
    directory.mkdir(parents=True)
    backend.state.save_state(directory)
    faults.during_save(position.step)
    _fsync_tree(directory)
    meta = {
        "position": asdict(position),
        "framework": config.framework,
        "task": config.task,
        "model": config.model.name,
        "saved_at": time.time(),
        "files": _manifest(directory),
    }
    _write_atomic(directory / "trainer.json", json.dumps(meta, indent=2))


@contextlib.contextmanager
def worker_exits_after_save(step: int) -> Iterator[None]:
    """Hold the loaders' dead-worker check (their SIGCHLD handler) until the save is done.
    Torch and Paddle raise from that handler in whatever code is running when a worker exits:
    inside a save, a worker OOM-killed while the trainer wrote was reported as a failed
    checkpoint write (exit 4) and the checkpoint it had written removed. Held, the save completes
    and the worker's death is then raised as what it is (WorkerDiedError, exit 6)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread runs Python signal handlers, or may set them
        return
    check = signal.getsignal(signal.SIGCHLD)
    if not callable(check):  # no loader has installed one (no workers), or not from Python
        yield
        return
    exited: list[int] = []
    signal.signal(signal.SIGCHLD, lambda signum, frame: exited.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, check)
    if exited:
        try:
            check(signal.SIGCHLD, None)
        except Exception as error:
            raise WorkerDiedError(
                f"a data loader worker died during the checkpoint of step {step}, which is "
                f"complete: {str(error).strip()}\nHINT: for a kill by signal 9, check the "
                "memory limit (dmesg, docker stats); continue with --resume"
            ) from error


def save(run_dir: Path, backend, position: Position, keep_last: int, config) -> Path:
    """Write a checkpoint of ``position``; on failure (disk full...) remove what was written
    and raise CheckpointError naming the cause. The previous checkpoints and ``latest`` are
    touched only once the new one is complete."""
    with worker_exits_after_save(position.step):
        return _save(run_dir, backend, position, keep_last, config)


def save_on_every_rank(
    run_dir: Path, backend, position: Position, config, is_main: bool
) -> WorkerDiedError | None:
    """Every rank's part of a checkpoint of ``position`` (backend.state.prepare_save), written by
    rank 0 (``is_main``); every rank returns once it is on disk. A loader worker that died
    while it was written is returned, not raised, for the caller to raise once it has recorded
    the checkpoint: it is complete, and the other ranks have passed the barrier too."""
    died = None
    backend.state.prepare_save()  # every rank: what rank 0's checkpoint holds per rank
    if is_main:
        try:
            save(run_dir, backend, position, config.train.keep_last, config)
        except WorkerDiedError as error:  # saved; raised once the other ranks have it too
            died = error
    backend.runtime.barrier()
    return died


def _save(run_dir: Path, backend, position: Position, keep_last: int, config) -> Path:
    started = time.perf_counter()
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{position.step:08d}"
    tmp = root / f"step-{position.step:08d}.partial"
    try:
        root.mkdir(parents=True, exist_ok=True)
        safe_files.remove_stale(tmp, folder=True)  # a link there is refused, not followed
        _write_state(tmp, backend, position, config)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / "latest", final.name + "\n")
        _fsync_dir(root)
    except Exception as error:  # OSError, or the framework's own error for a failed write
        room = run_files.room_errno(error, root, probe=tmp)  # before the cleanup frees room
        shutil.rmtree(tmp, ignore_errors=True)
        (root / "latest.partial").unlink(missing_ok=True)
        what = f"the checkpoint of step {position.step}"
        kept = "the previous checkpoints are intact"
        raise _save_failed(error, room, root, what, kept) from error
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


def _newest_first(run_dir: Path) -> list[Path]:
    """The checkpoints to try on resume: ``latest`` first, then the others, newest first."""
    root = Path(run_dir) / "checkpoints"
    found = sorted(root.glob("step-????????"), reverse=True)
    first = latest(run_dir)
    return ([first] if first else []) + [p for p in found if p != first]


def _verified_meta(path: Path) -> dict:
    """trainer.json of checkpoint ``path``, after checking its files against the manifest;
    ValueError (or OSError) naming what is wrong."""
    meta = json.loads((path / "trainer.json").read_text())
    if not isinstance(meta, dict) or "position" not in meta:
        raise ValueError("trainer.json has no position")
    Position(**meta["position"])
    for name, want in meta.get("files", {}).items():  # checkpoints before the manifest: none
        file = path / name
        if not file.is_file():
            raise ValueError(f"{name} is missing")
        if file.stat().st_size != want["bytes"]:
            raise ValueError(f"{name} has {file.stat().st_size} bytes, {want['bytes']} written")
        if _crc32(file) != want["crc32"]:
            raise ValueError(f"{name} is damaged (CRC-32 differs from the one written)")
    return meta


def restore(run_dir: Path, backend, config) -> Position:
    """Load the newest usable checkpoint of ``run_dir`` into ``backend``; return where to
    continue. A checkpoint that fails its checks or its load is skipped with a warning for the
    one before it; CheckpointError when none is usable."""
    tried = []
    for path in _newest_first(run_dir):
        try:
            meta = _verified_meta(path)
        except (OSError, ValueError, TypeError, KeyError) as error:
            tried.append(f"{path.name}: {error}")
            log.warning("checkpoint %s is unusable (%s): trying the one before", path, error)
            continue
        for key in ("framework", "task", "model"):
            wanted = (
                config.framework
                if key == "framework"
                else (config.task if key == "task" else config.model.name)
            )
            found = tasks.current_name(meta[key]) if key == "task" else meta[key]
            if found != wanted:
                raise CheckpointError(
                    f"--resume: {path} was written by {key}={meta[key]}, this config has "
                    f"{wanted}. HINT: resume with the config that started the run, or use a new "
                    "--output-dir"
                )
        try:
            backend.state.load_state(path)
        except Exception as error:  # whatever the framework's reader raises on a bad file
            tried.append(f"{path.name}: {type(error).__name__}: {str(error)[:200]}")
            log.warning("checkpoint %s failed to load (%s): trying the one before", path, error)
            continue
        position = Position(**meta["position"])
        if tried:
            log.warning(
                "resumed from %s, an older checkpoint: the newer ones are unusable (%s)",
                path,
                "; ".join(tried),
            )
        log.info("resumed from %s (epoch %d, step %d)", path, position.epoch, position.step)
        return position
    if tried:
        raise CheckpointError(
            f"--resume: no usable checkpoint in {Path(run_dir) / 'checkpoints'} ("
            + "; ".join(tried)
            + "). HINT: restore the run directory from a backup, or start over with --overwrite"
        )
    raise CheckpointError(
        f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'}. HINT: drop --resume to "
        "start a new run, or point --output-dir at the run to continue"
    )


# ---------------------------------------------------------------- the run's best checkpoint
BEST_DIR = "best"  # in the run directory, beside checkpoints/; keep_last never rotates it


def write_atomic(path: Path, text: str) -> None:
    """Write the run file ``path`` (summary.json, a report) through a rename, as the
    checkpoints' own files; a failed write (disk full...) is RunFileError, with no .partial
    left."""
    path = Path(path)
    with run_files.writing(path, partial=path.with_name(path.name + ".partial")):
        _write_atomic(path, text)


def best(run_dir: Path) -> Path | None:
    """The run's best checkpoint (``best/``) when there is a complete one."""
    for name in (BEST_DIR, BEST_DIR + ".old"):  # .old: a crash between save_best's renames
        path = Path(run_dir) / name
        if (path / "trainer.json").is_file():
            return path
    return None


def best_or_latest(run_dir: Path) -> Path | None:
    """What a run directory means as a source of weights: its best checkpoint, else its
    latest."""
    return best(run_dir) or latest(run_dir)


BEST_METRIC_FILE = "metric.json"  # in best/: {"metric", "value", "step", "epoch"}


def best_metric(run_dir: Path) -> dict | None:
    """best/metric.json of the run, or None before its first evaluation."""
    path = best(run_dir)
    if path is None or not (path / BEST_METRIC_FILE).is_file():
        return None
    return json.loads((path / BEST_METRIC_FILE).read_text(encoding="utf-8"))


def save_best(run_dir: Path, backend, position: Position, config, metric: str, value: float):
    """Keep this step's weights as ``best/`` when ``value`` of the task's main ``metric``
    (higher is better) beats best/metric.json's; return the new record, or None when the
    previous best stands (ties too: the earlier step stays). best/ is a checkpoint like the
    others (same files, trainer.json), written as ``best.partial`` and renamed into place, and
    keep_last never removes it. --resume reads the record, so a resumed run keeps comparing
    against the best before the stop. A failed write (disk full...) is the CheckpointError of a
    failed save, best.partial removed and the previous best/ in place."""
    with worker_exits_after_save(position.step):
        return _save_best(run_dir, backend, position, config, metric, value)


def _save_best(run_dir: Path, backend, position: Position, config, metric: str, value: float):
    previous = best_metric(run_dir)
    if previous is not None and previous["metric"] == metric and value <= previous["value"]:
        return None
    started = time.perf_counter()
    run_dir = Path(run_dir)
    final, tmp, old = (run_dir / f"{BEST_DIR}{end}" for end in ("", ".partial", ".old"))
    record = {"metric": metric, "value": value, "step": position.step, "epoch": position.epoch}
    try:
        safe_files.remove_stale(tmp, folder=True)  # a link there is refused, not followed
        _write_state(tmp, backend, position, config)
        _write_atomic(tmp / BEST_METRIC_FILE, json.dumps(record, indent=2))
        # Two renames: a crash between them leaves best.old, which best() still finds.
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(run_dir)
    except Exception as error:  # as in _save: OSError, or the framework's own failed write
        room = run_files.room_errno(error, run_dir, probe=tmp)  # before the cleanup frees room
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():  # failed between the renames: put it back
            os.replace(old, final)
        what = f"the best checkpoint (step {position.step}, {metric} {value:.4f})"
        kept = f"the previous {BEST_DIR}/ and the checkpoints are intact"
        raise _save_failed(error, room, run_dir, what, kept) from error
    shutil.rmtree(old, ignore_errors=True)
    was = f"{previous['value']:.4f} at step {previous['step']}" if previous else "none"
    log.info(
        "best %s %.4f at step %d (was %s): %s (%.2f s)",
        metric,
        value,
        position.step,
        was,
        final,
        time.perf_counter() - started,
    )
    return record
