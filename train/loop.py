"""The framework-neutral training loop. Reads top to bottom; the backend does the tensors.

python -m train --config configs/ocr/smoke.yaml
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from train import checkpoint, faults, stall, tasks
from train.autotune import LoaderAutotune
from train.data import RunData
from train.errors import WorkerDiedError, out_of_memory_named
from train.nonfinite import NonFiniteSteps
from train.stops import (
    EvaluationInterrupted,
    StopAgreement,
    install_stop_handler,
    settle_after_stop,
)
from train.telemetry import loader_knobs, run_telemetry
from train.validation import evaluate
from train.weights import apply_init_from

log = logging.getLogger("train")


def train(config, backend, dist, data: RunData, run_dir: Path, resume: bool, source=None) -> dict:
    """Run to train.max_steps or train.epochs, whichever comes first; return the summary.
    ``config`` is resolved (train.data.resolve, then the /dev/shm policy); ``source``: (the
    config file, its --set overrides) as given, which loader.autotune's tuned.yaml extends."""
    run = Run(config, backend, dist, data, run_dir, resume, source)
    while run.position.step < run.total_steps:
        epoch_ended = run.train_epoch()
        if run.stopping:
            run.stop()  # a checkpoint, then StopRequested
        if epoch_ended:
            run.end_epoch()
            if run.stops.between_epochs():
                run.stop()  # arrived during the epoch's evaluation or checkpoint
    run.evaluate_and_save()  # unless this step's are done already
    return run.finish()


class Run:
    """One training run: its loaders, model, position and telemetry, and the steps of the loop
    in the order train() calls them."""

    def __init__(
        self, config, backend, dist, data: RunData, run_dir: Path, resume: bool, source=None
    ) -> None:
        self.config, self.backend, self.dist, self.data = config, backend, dist, data
        self.run_dir, self.train_cfg = run_dir, config.train
        self.batch_size = config.loader.batch_size
        # loader.autotune: the training loader's setting, from the config or (on --resume)
        # where the tuning had got to.
        self.autotune = LoaderAutotune(
            config, run_dir, dist.is_main, dist.local_world_size, resume, source
        )
        train_loader = self.autotune.loader_config(config.loader)
        self.sampler, self.loader, self.val_sampler, self.val_loader = data.loaders(
            config, backend, dist, train_loader
        )
        self.taken = 0  # samples taken from the sampler since it was last set (this rank's)
        self.steps_per_epoch = len(self.sampler) // self.batch_size
        self.total_steps = checkpoint.last_step(
            self.train_cfg, self.train_cfg.epochs * self.steps_per_epoch
        )
        # Model, optimizer and schedule; on --resume, their state and where the run was.
        input_shape = tasks.get(config.task).input_shape(config.data)
        backend.build(config.model, config.optim, input_shape, data.num_classes, self.total_steps)
        self.position = checkpoint.start_position(run_dir, backend, config, resume, dist.world_size)
        if self.position.world_size != dist.world_size:  # a checkpoint of another world size
            self.total_steps = self.position.reshard(
                dist.world_size, self.sampler, self.steps_per_epoch, config, backend
            )
        apply_init_from(config, backend, run_dir, resume, dist.is_main)  # model.init_from
        self.telemetry = run_telemetry(config, backend, dist, run_dir)
        self.stops = StopAgreement(install_stop_handler(), dist, backend, self.train_cfg.log_every)
        self.stopping = False
        self.interrupted_batches = None  # an evaluation loader left open by a stop request
        self.open_batches = None  # the training batches, left open by a stop request
        self.resumed_mid_epoch = resume and self.position.epoch_samples > 0
        self.nonfinite = NonFiniteSteps(self.train_cfg, run_dir, self.batch_size)
        self.loss: float | None = None  # the last step read's loss
        self.last_eval: dict[str, float] = {}
        self.saved_at = self.evaluated_at = None  # the steps of the last checkpoint, evaluation
        self.telemetry.start_progress(self.total_steps, self.position.step)

    def train_epoch(self) -> bool:
        """Train this epoch's batches (the rest of them, on resume) until they end, the run's
        last step, or a stop request. Returns whether the epoch's batches are all done."""
        position, backend = self.position, self.backend
        self.start_epoch()
        batches = self.epoch_batches()
        if faults.injected():  # TRAIN_INJECT_FAULT: the fault tests' poisoned batches
            batches = faults.steps(batches, position.step + 1, backend)
        for batch in batches:
            with (
                backend.runtime.profile_range("train_step"),
                out_of_memory_named(backend, "a train step"),
            ):
                backend.trainer.train_step(batch)  # queued: nothing here waits for the device
            position.step += 1
            position.epoch_samples += self.batch_size * self.dist.world_size
            self.taken += self.batch_size
            self.nonfinite.queued(self.taken)  # where its batch ends in the sampler's order
            self.telemetry.step_done(position.step)
            self.log_evaluate_save(position.step)
            self.stopping = self.stops.after_step(position.step)
            if self.stopping:
                self.read_steps()  # before the stop's checkpoint
                # Closing the loader waits for its workers to finish their batches (seconds on
                # slow storage): it stays open until the stop's checkpoint is written.
                self.open_batches = batches
                return False
            if position.step >= self.total_steps:
                self.read_steps()
                # the last step may have been the epoch's last
                return len(self.sampler) - self.taken < self.batch_size
        self.read_steps()  # the epoch's last steps: their sample positions are this epoch's
        return True

    def epoch_batches(self):
        """The epoch's batches on the device, timed. With loader.autotune, the loader is
        rebuilt at the setting the tuner asks for: between two steps for the workers and the
        prefetch, at the epoch's start for a record cache. The old loader's workers are
        stopped, the sampler goes on from the epoch's position (as on --resume: the same
        batches follow), and the new loader starts there."""
        cache_change = self.autotune.epoch_started(self.position.epoch)
        if cache_change is not None:
            self.loader = None  # its workers stop before the cache they read is replaced
            self.data.use_train_cache(self.config, cache_change.cache)
            self.switch_loader()
        while True:
            batches = self.telemetry.timed(self.backend.batches.device_batches(self.loader))
            yield from self.autotune.watch(batches, self.read_steps, self.position.epoch)
            if self.autotune.switch_to is None:
                return  # the epoch's batches are done
            self.read_steps()  # the queued steps' sample positions are the old order's
            batches.close()
            del batches
            self.switch_loader()

    def switch_loader(self) -> None:
        """A new training loader at the tuner's setting, from the epoch's position."""
        self.loader = None  # its workers stop before the new loader's start
        loader_cfg = self.autotune.loader_config(self.config.loader)
        self.set_sampler()
        self.loader = self.data.train_loader(self.backend, self.sampler, loader_cfg)
        self.telemetry.knobs = loader_knobs(loader_cfg)

    def set_sampler(self) -> None:
        """The sampler at the epoch's position: the samples all ranks have taken are left out."""
        self.sampler.set_epoch(self.position.epoch, consumed=self.position.epoch_samples)
        self.taken = 0

    def start_epoch(self) -> None:
        self.set_sampler()
        self.data.train.start_epoch(self.position.epoch)
        if self.resumed_mid_epoch:  # the epoch's bad samples before the checkpoint count too
            self.data.train.count_resumed(self.sampler.consumed_positions())
            self.resumed_mid_epoch = False

    def log_evaluate_save(self, step: int) -> None:
        """The schedule of train.log_every, train.eval_every and train.checkpoint_every."""
        every = self.train_cfg
        log_now = step % every.log_every == 0
        evaluate_now = bool(every.eval_every and step % every.eval_every == 0)
        save_now = bool(every.checkpoint_every and step % every.checkpoint_every == 0)
        if log_now or evaluate_now or save_now:
            self.read_steps()  # the window's one read, before anything is saved
        if log_now:
            bad = sum(self.data.train.bad_log.epoch_counts().values())
            lr = self.backend.trainer.current_lr()
            self.telemetry.log_window(step, self.position.epoch, self.loss, lr, bad)
        if evaluate_now:
            self.evaluate()
        if save_now:
            self.save()

    def read_steps(self) -> None:
        """The steps queued since the last read, through train.nonfinite (NonFiniteSteps)."""
        loss = self.nonfinite.read(self.backend, self.position, self.sampler)
        if loss is not None:
            self.loss = loss

    def end_epoch(self) -> None:
        """The epoch's record (bad samples by kind); then, while the run goes on, the epoch's
        evaluation and checkpoint when they are per epoch (train.eval_every,
        train.checkpoint_every unset). At the run's last step evaluate_and_save() does them."""
        position = self.position
        counts = self.data.train.bad_log.epoch_counts()
        bad = {"bad_samples": sum(counts.values()), **{f"bad.{k}": v for k, v in counts.items()}}
        self.telemetry.emit(
            {"type": "epoch", "step": position.step, "epoch": position.epoch, **bad}
        )
        position.epoch += 1
        position.epoch_samples = 0
        if position.step < self.total_steps:
            if not self.train_cfg.eval_every:
                self.evaluate()
            if not self.train_cfg.checkpoint_every:
                self.save()

    def evaluate(self) -> None:
        if self.val_loader is not None:
            self.backend.trainer.sync_buffers()  # every rank evaluates the checkpoint's model
            log.info("evaluating at step %d", self.position.step)
            started = time.monotonic()
            loader, counted = self.val_loader, self.val_sampler.unpadded  # not the padding
            try:
                task, flag = self.config.task, self.stops.flag
                self.last_eval = evaluate(self.backend, loader, task, flag, self.dist, counted)
            except EvaluationInterrupted as interrupted:
                self.interrupted_batches = interrupted.batches
                self.stops.agreed = True  # by every rank: they all stop at this step
                log.warning(
                    "evaluation at step %d interrupted by the stop request after %.1f s",
                    self.position.step,
                    time.monotonic() - started,
                )
                return
            position = self.position
            record = {"type": "eval", "step": position.step, "epoch": position.epoch}
            self.telemetry.emit({**record, **self.last_eval})
            self.keep_best()
        self.evaluated_at = self.position.step

    def keep_best(self) -> None:
        """best/ in the run directory: this step's weights when the task's main metric beats
        the best so far (train/checkpoint.py's save_best)."""
        if self.dist.is_main:
            metric = tasks.get(self.config.task).metric.main
            value = self.last_eval[metric]
            checkpoint.save_best(
                self.run_dir, self.backend, self.position, self.config, metric, value
            )
        self.backend.runtime.barrier()

    def save(self) -> None:
        position, is_main = self.position, self.dist.is_main
        died = checkpoint.save_on_every_rank(
            self.run_dir, self.backend, position, self.config, is_main
        )
        self.saved_at = position.step
        if died is not None:
            raise died  # a loader worker, during a checkpoint now complete on every rank

    def evaluate_and_save(self) -> None:
        if self.evaluated_at != self.position.step:
            self.evaluate()
        if self.saved_at != self.position.step:
            self.save()

    def stop(self) -> None:
        """Stop after a stop request: checkpoint this step unless done, then StopRequested."""
        if self.saved_at != self.position.step:
            try:
                self.save()
            except WorkerDiedError as died:  # the checkpoint is complete; the stop stands
                log.warning("%s", died)
        settle_after_stop()
        if self.interrupted_batches is not None:  # now the loader may take its time to close
            self.interrupted_batches.close()
        self.open_batches = None
        raise self.stops.stopped(self.position.step)

    def finish(self) -> dict:
        """Close the telemetry; the run's summary."""
        self.telemetry.close()
        totals = self.telemetry.totals
        wall = max(totals["wall_s"], 1e-9)
        loss = self.loss if self.loss is not None else float("nan")  # read by read_steps
        data_wait = totals["wait_s"] / wall
        return {
            "steps": self.position.step,
            "epochs_completed": self.position.epoch,
            "final_loss": loss,
            "samples_per_s": totals["samples"] / wall,
            "data_wait_fraction": data_wait,
            # the device holding the loader's hand-over back: not counted as data wait
            "device_wait_fraction": totals["device_wait_s"] / wall,
            # above train.stall.BOTTLENECK_FRACTION: which bottleneck held the loader
            **stall.summary_keys(data_wait, self.telemetry.loader_use()),
            "bad_samples_total": sum(self.data.train.bad_log.total_counts().values()),
            **self.autotune.summary(),  # loader.autotune: where it settled
            **{f"val_{k}": v for k, v in self.last_eval.items()},
        }
