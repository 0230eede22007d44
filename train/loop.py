"""The framework-neutral training loop. Reads top to bottom; the backend does the tensors.

python -m train --config configs/ocr/smoke.yaml
"""

from __future__ import annotations

import logging
import math
import signal
from pathlib import Path

from datasets.errors import DatasetError
from datasets.sampler import EpochSampler
from train import checkpoint
from train.data import RunData
from train.metrics import OcrMetric, TopKMetric
from train.telemetry import Telemetry

log = logging.getLogger("train")


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived; the loop saved a checkpoint and stopped."""


def evaluate(backend, loader, task: str) -> dict[str, float]:
    """One pass over the validation loader; metrics summed over ranks."""
    metric = OcrMetric() if task == "ocr" else TopKMetric()
    for batch in backend.device_batches(loader):
        predicted = backend.predict(batch)
        labels = backend.batch_labels(batch)
        if task == "ocr":
            metric.update(predicted, labels["label"], labels["length"])
        else:
            metric.update(predicted, labels["label"])
    return metric.summarize(backend.all_reduce_sum(metric.state()))


def train(config, backend, dist, data: RunData, run_dir: Path, resume: bool, workers: int) -> dict:
    """Run to train.max_steps or train.epochs, whichever comes first; return the summary.
    ``workers`` is the resolved loader.num_workers (after the /dev/shm policy)."""
    loader_cfg, train_cfg = config.loader, config.train
    sampler = EpochSampler(
        len(data.train), shuffle=True, seed=config.seed, rank=dist.rank, world_size=dist.world_size
    )
    loader = backend.make_loader(data.train, sampler, loader_cfg, workers, train=True)
    val_loader = None
    if data.val is not None:
        val_sampler = EpochSampler(
            len(data.val), shuffle=False, rank=dist.rank, world_size=dist.world_size
        )
        val_loader = backend.make_loader(data.val, val_sampler, loader_cfg, workers, train=False)

    steps_per_epoch = len(sampler) // loader_cfg.batch_size
    if steps_per_epoch < 1:
        raise DatasetError(
            f"loader.batch_size {loader_cfg.batch_size} is larger than this rank's "
            f"{len(sampler)} samples of {config.data.train}",
            "lower loader.batch_size (or use fewer ranks)",
        )
    total_steps = min(train_cfg.max_steps or math.inf, train_cfg.epochs * steps_per_epoch)
    backend.build(data.num_classes, int(total_steps))
    position = checkpoint.restore(run_dir, backend, config) if resume else checkpoint.Position()

    knobs = (
        f"workers={workers} prefetch={loader_cfg.prefetch_factor or 2} "
        f"persistent={loader_cfg.persistent_workers} batch={loader_cfg.batch_size}"
    )
    telemetry = Telemetry(
        config,
        run_dir,
        dist.is_main,
        loader_cfg.batch_size * dist.world_size,
        dist.local_rank,
        knobs,
    )
    stop = _install_stop_handler()
    last_eval: dict[str, float] = {}
    telemetry.start_progress(int(total_steps), position.step)

    loss = None

    def save() -> int:
        if dist.is_main:
            checkpoint.save(run_dir, backend, position, train_cfg.keep_last, config)
        backend.barrier()
        return position.step

    def run_eval() -> int:
        nonlocal last_eval
        if val_loader is not None:
            last_eval = evaluate(backend, val_loader, config.task)
            telemetry.emit(
                {"type": "eval", "step": position.step, "epoch": position.epoch, **last_eval}
            )
        return position.step

    saved_at = evaluated_at = None
    while position.step < total_steps:
        sampler.set_epoch(position.epoch, start=position.epoch_samples)
        data.train.start_epoch(position.epoch)
        for batch in telemetry.timed(backend.device_batches(loader)):
            with backend.profile_range("train_step"):
                loss = backend.train_step(batch)
            position.step += 1
            position.epoch_samples += loader_cfg.batch_size
            telemetry.step_done(position.step)
            if position.step % train_cfg.log_every == 0:
                bad = sum(data.train.bad_log.epoch_counts().values())
                telemetry.log_window(
                    position.step, position.epoch, backend.to_float(loss), backend.current_lr(), bad
                )
            if train_cfg.eval_every and position.step % train_cfg.eval_every == 0:
                evaluated_at = run_eval()
            if train_cfg.checkpoint_every and position.step % train_cfg.checkpoint_every == 0:
                saved_at = save()
            if stop.requested or position.step >= total_steps:
                break
        else:  # the epoch ran to its end
            _end_epoch(data, telemetry, position)
            if not train_cfg.eval_every:
                evaluated_at = run_eval()
            if not train_cfg.checkpoint_every:
                saved_at = save()
            continue
        if stop.requested:
            if saved_at != position.step:
                save()
            raise StopRequested(f"stopped by {stop.signal_name} at step {position.step}")
        if sampler.per_rank - position.epoch_samples < loader_cfg.batch_size:
            _end_epoch(data, telemetry, position)  # the last step was also the epoch's last batch

    if evaluated_at != position.step:
        run_eval()
    if saved_at != position.step:
        save()
    telemetry.close()
    return _summary(telemetry, data, position, last_eval, loss, backend)


def _end_epoch(data: RunData, telemetry: Telemetry, position) -> None:
    counts = data.train.bad_log.epoch_counts()
    telemetry.emit(
        {
            "type": "epoch",
            "step": position.step,
            "epoch": position.epoch,
            "bad_samples": sum(counts.values()),
            **{f"bad.{k}": v for k, v in counts.items()},
        }
    )
    position.epoch += 1
    position.epoch_samples = 0


def _summary(telemetry, data, position, last_eval, loss, backend) -> dict:
    totals = telemetry.totals
    wall = max(totals["wall_s"], 1e-9)
    return {
        "steps": position.step,
        "epochs_completed": position.epoch,
        "final_loss": backend.to_float(loss) if loss is not None else float("nan"),
        "samples_per_s": totals["samples"] / wall,
        "data_wait_fraction": totals["wait_s"] / wall,
        "bad_samples_total": sum(data.train.bad_log.total_counts().values()),
        **{f"val_{k}": v for k, v in last_eval.items()},
    }


class _StopFlag:
    requested = False
    signal_name = ""


def _install_stop_handler() -> _StopFlag:
    """SIGTERM (docker stop, Kubernetes preemption) and SIGINT finish the current step, save a
    checkpoint and stop; a second signal falls back to the default (immediate) behaviour."""
    flag = _StopFlag()

    def handler(signum, frame):
        flag.requested = True
        flag.signal_name = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)
        log.warning(
            "%s received: finishing the current step, then checkpoint and stop", flag.signal_name
        )

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return flag
