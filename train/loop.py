"""The framework-neutral training loop. Reads top to bottom; the backend does the tensors.

python -m train --config configs/ocr/smoke.yaml
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from pathlib import Path

from datasets.errors import DatasetError
from datasets.sampler import EpochSampler
from train import checkpoint, faults, tasks
from train.data import RunData
from train.errors import NonFiniteLossError, OutOfMemoryError, WorkerDiedError
from train.stops import (
    EvaluationInterrupted,
    HeldBatches,
    StopAwareBatches,
    StopFlag,
    StopRequested,
    install_stop_handler,
    stop_now,
)
from train.telemetry import Telemetry
from train.weights import apply_init_from

log = logging.getLogger("train")


def evaluate(
    backend,
    loader,
    task: str,
    stop_flag: StopFlag | None = None,
    dist=None,
    counted: int | None = None,
) -> dict[str, float]:
    """One pass over the validation loader; the task's metric, summed over ranks. With a
    ``stop_flag``, a stop request ends the pass (EvaluationInterrupted, which carries the
    loader's batches to close after the checkpoint): on one rank within 0.1 s, even while it
    waits for a batch (StopAwareBatches); on several, after the batch in flight, all ranks at
    the same one (HeldBatches: a rank alone dropping its pass would leave the others waiting in
    its all-reduce).

    ``counted``: how many of this rank's samples, the first ones, count in the metric (the
    loader's EpochSampler.unpadded; None: all). The rest are the sampler's wrap-around padding,
    repeats of samples another rank counts: still read and predicted, so every rank reads as
    many batches, but left out of the metric, so the sum over ranks counts each sample once and
    equals one rank's evaluation of the whole set. Batches arrive in the sampler's order (the
    loaders keep it, with workers and the batch ring too), so the padding is the last rows."""
    metric = tasks.get(task).metric()
    several = dist is not None and dist.world_size > 1
    if stop_flag is None:
        host_batches = loader
    elif several:
        host_batches = HeldBatches(loader)
    else:
        host_batches = StopAwareBatches(loader, stop_flag)
    try:
        for batch in backend.device_batches(host_batches):
            with out_of_memory_named(backend, "evaluation"):
                predicted, labels = backend.predict(batch), backend.batch_labels(batch)
            if counted is not None:  # the padding: the rows after this rank's own samples
                predicted = predicted[:counted]
                labels = {key: value[:counted] for key, value in labels.items()}
                counted -= len(predicted)
            if len(predicted):
                metric.update(predicted, labels)
            # Every rank reads as many batches (the sampler pads), so all reach each agreement.
            if several and stop_flag is not None and stop_now(stop_flag, 0, 1, dist, backend):
                raise EvaluationInterrupted
    except EvaluationInterrupted as interrupted:
        interrupted.batches = host_batches
        raise
    return metric.summarize(backend.all_reduce_sum(metric.state()))


@contextlib.contextmanager
def out_of_memory_named(backend, where: str):
    """The framework's out-of-memory exception as OutOfMemoryError (exit 9), with the fix."""
    try:
        yield
    except Exception as exc:
        if not backend.is_out_of_memory(exc):
            raise
        raise OutOfMemoryError(
            f"out of memory in {where} on {backend.device_name}: {str(exc).splitlines()[0]}. "
            "HINT: lower loader.batch_size, use train.amp (bf16/fp16) on a GPU, or a smaller "
            "model.name; check that no other process holds the GPU's memory (nvidia-smi)"
        ) from exc


def train(config, backend, dist, data: RunData, run_dir: Path, resume: bool, workers: int) -> dict:
    """Run to train.max_steps or train.epochs, whichever comes first; return the summary.
    ``workers`` is the resolved loader.num_workers (after the /dev/shm policy)."""
    run = Run(config, backend, dist, data, run_dir, resume, workers)
    while run.position.step < run.total_steps:
        epoch_ended = run.train_epoch()
        if run.stopping:
            run.stop()  # a checkpoint, then StopRequested
        if epoch_ended:
            run.end_epoch()
            if run.stop_agreed or (run.dist.world_size == 1 and run.stop_flag.requested):
                run.stop()  # arrived during the epoch's evaluation or checkpoint
    run.evaluate_and_save()  # unless this step's are done already
    return run.finish()


class Run:
    """One training run: its loaders, model, position and telemetry, and the steps of the loop
    in the order train() calls them."""

    def __init__(
        self, config, backend, dist, data: RunData, run_dir: Path, resume: bool, workers: int
    ) -> None:
        self.config, self.backend, self.dist, self.data = config, backend, dist, data
        self.run_dir = run_dir
        loader_cfg, train_cfg = config.loader, config.train
        self.batch_size, self.train_cfg = loader_cfg.batch_size, train_cfg

        # Data: this rank's share of each epoch, in batches of uint8 arrays.
        self.sampler = EpochSampler(
            len(data.train),
            shuffle=True,
            seed=config.seed,
            rank=dist.rank,
            world_size=dist.world_size,
        )
        backend.set_cpu_threads(workers)
        self.loader = backend.make_loader(data.train, self.sampler, loader_cfg, workers, train=True)
        self.val_loader = self.val_sampler = None
        if data.val is not None:
            self.val_sampler = val_sampler = EpochSampler(
                len(data.val), shuffle=False, rank=dist.rank, world_size=dist.world_size
            )
            self.val_loader = backend.make_loader(
                data.val, val_sampler, loader_cfg, workers, train=False
            )
        self.steps_per_epoch = len(self.sampler) // loader_cfg.batch_size
        if self.steps_per_epoch < 1:
            raise DatasetError(
                f"loader.batch_size {loader_cfg.batch_size} is larger than this rank's "
                f"{len(self.sampler)} samples of {config.data.train}",
                "lower loader.batch_size (or use fewer ranks)",
            )
        self.total_steps = self.steps_in_run(step_scale=1.0)

        # Model, optimizer and schedule; on --resume, their state and where the run was.
        input_shape = tasks.get(config.task).input_shape(config.data)
        backend.build(config.model, config.optim, input_shape, data.num_classes, self.total_steps)
        world = dist.world_size
        self.position = (
            checkpoint.restore(run_dir, backend, config)
            if resume
            else checkpoint.Position(world_size=world, started_world_size=world)
        )
        if self.position.world_size in (0, world):  # 0: saved before world sizes were recorded
            if not self.position.world_size:
                self.position.epoch_samples *= world  # then it counted one rank's samples
            self.position.world_size = world
            self.position.started_world_size = self.position.started_world_size or world
        else:
            self.reshard()
        apply_init_from(config, backend, run_dir, resume, dist.is_main)  # model.init_from

        knobs = (
            f"workers={workers} prefetch={loader_cfg.prefetch_factor or 2} "
            f"persistent={loader_cfg.persistent_workers} batch={loader_cfg.batch_size}"
        )
        self.telemetry = Telemetry(
            run_dir,
            dist.is_main,
            loader_cfg.batch_size * dist.world_size,
            backend.device_index,  # the GPU NVML reports on (None on the CPU)
            knobs,
            train_cfg.stall_warn_fraction,
            backend.scalar_writer(run_dir / "scalars") if dist.is_main else None,
        )
        self.stop_flag = install_stop_handler()
        self.stopping = False
        self.stop_agreed = False  # an evaluation was interrupted: all ranks stop at this step
        self.interrupted_batches = None  # an evaluation loader left open by a stop request
        self.open_batches = None  # the training batches, left open by a stop request
        self.resumed_mid_epoch = resume and self.position.epoch_samples > 0
        self.nonfinite_in_a_row = 0  # steps in a row whose loss was NaN/Inf (train.nonfinite)
        # The steps the backend has queued since check_finite last read them: where each
        # one's batch ends in this rank's epoch order (host ints, to name a bad batch).
        self.unread_steps: list[int] = []
        self.loss: float | None = None  # the last step read's loss
        self.last_eval: dict[str, float] = {}
        self.saved_at = self.evaluated_at = None  # the steps of the last checkpoint, evaluation
        self.telemetry.start_progress(self.total_steps, self.position.step)

    def train_epoch(self) -> bool:
        """Train this epoch's batches (the rest of them, on resume) until they end, the run's
        last step, or a stop request. Returns whether the epoch's batches are all done."""
        position, every, backend = self.position, self.train_cfg, self.backend
        self.sampler.set_epoch(position.epoch, consumed=position.epoch_samples)
        self.data.train.start_epoch(position.epoch)
        if self.resumed_mid_epoch:  # the epoch's bad samples before the checkpoint count too
            self.data.train.count_resumed(self.sampler.consumed_positions())
            self.resumed_mid_epoch = False
        left = len(self.sampler)  # this rank's samples in the rest of the epoch
        batches = self.telemetry.timed(backend.device_batches(self.loader))
        for batch in batches:
            with backend.profile_range("train_step"), out_of_memory_named(backend, "a train step"):
                batch = faults.before_step(position.step + 1, batch, backend)
                backend.train_step(batch)  # queued: nothing here waits for the device
            position.step += 1
            position.epoch_samples += self.batch_size * self.dist.world_size
            left -= self.batch_size
            self.unread_steps.append(len(self.sampler) - left)  # where its batch ends
            self.telemetry.step_done(position.step)
            log_now = position.step % every.log_every == 0
            evaluate_now = bool(every.eval_every and position.step % every.eval_every == 0)
            save_now = bool(every.checkpoint_every and position.step % every.checkpoint_every == 0)
            if log_now or evaluate_now or save_now:
                self.check_finite()  # the window's one read, before anything is saved
            if log_now:
                bad = sum(self.data.train.bad_log.epoch_counts().values())
                lr = backend.current_lr()
                self.telemetry.log_window(position.step, position.epoch, self.loss, lr, bad)
            if evaluate_now:
                self.evaluate()
            if save_now:
                self.save()
            self.stopping = self.stop_agreed or stop_now(
                self.stop_flag, position.step, every.log_every, self.dist, backend
            )
            if self.stopping:
                self.check_finite()  # before the stop's checkpoint
                # Closing the loader waits for its workers to finish their batches (seconds on
                # slow storage): it stays open until the stop's checkpoint is written.
                self.open_batches = batches
                return False
            if position.step >= self.total_steps:
                self.check_finite()
                # The last step may also have been the epoch's last batch.
                return left < self.batch_size
        self.check_finite()  # the epoch's last steps: their sample positions are this epoch's
        return True

    def steps_in_run(self, step_scale: float, epochs_steps: int | None = None) -> int:
        """The run's last step: the end of train.epochs (``epochs_steps``; default: epochs of
        this world size's steps per epoch), or train.max_steps, which counts steps of the first
        launch's global batch (``step_scale``: its world size over this one's)."""
        if epochs_steps is None:
            epochs_steps = self.train_cfg.epochs * self.steps_per_epoch
        max_steps = self.train_cfg.max_steps
        if max_steps is None:
            return epochs_steps
        return min(epochs_steps, max(1, round(max_steps * step_scale)))

    def reshard(self) -> None:
        """Continue a checkpoint taken on another number of ranks, as the same training in
        samples: the epoch goes on with the samples not yet read (the sampler deals them out to
        this world size); the step count, train.max_steps and the warmup are converted to this
        world size's global batch (loader.batch_size per rank, so the global batch changes), so
        the learning-rate curve continues where it was. The LR itself is not rescaled for the
        new global batch; that stays the config's choice."""
        position, world = self.position, self.dist.world_size
        saved_world, started = position.world_size, position.started_world_size or world
        old_step = position.step
        position.step = round(old_step * saved_world / world)
        position.world_size = world
        position.started_world_size = started
        step_scale = started / world
        # The epochs end after the rest of this one, dealt out to this world size, and the
        # epochs after it at this world size's steps per epoch.
        self.sampler.set_epoch(position.epoch, consumed=position.epoch_samples)
        rest_of_epoch = len(self.sampler) // self.batch_size
        later_epochs = self.train_cfg.epochs - position.epoch - 1
        epochs_steps = position.step + rest_of_epoch + later_epochs * self.steps_per_epoch
        self.total_steps = self.steps_in_run(step_scale, epochs_steps)
        warmup = round(self.config.optim.warmup_steps * step_scale)
        self.backend.reschedule(position.step, self.total_steps, warmup)
        log.warning(
            "resuming a checkpoint of %d rank(s) on %d: global batch %d -> %d, step %d -> %d of "
            "%d (the same samples seen and learning-rate progress); the epoch's %d samples read "
            "so far are not read again. The learning rate is not rescaled for the new batch.",
            saved_world,
            world,
            self.batch_size * saved_world,
            self.batch_size * world,
            old_step,
            position.step,
            self.total_steps,
            position.epoch_samples,
        )

    def check_finite(self) -> None:
        """train.nonfinite over the steps since the last call, whose updates the backend
        skipped on every rank when their loss or gradients were NaN/Inf: abort, or go on until
        too many in a row. ONE read of the device (backend.read_steps: each step's loss and
        flag), once per logging window and before an evaluation, a checkpoint or the end of
        train_epoch, where the loop waits for the device anyway; not once per step, which left
        the GPU idle while the host read each step's flag. So an abort comes up to
        train.log_every - 1 steps after its bad step, naming that step: nothing is lost by the
        wait, since a bad step changes no weights and nothing after it was saved yet."""
        reads, self.unread_steps = self.unread_steps, []
        if not reads:
            return
        rows = self.backend.read_steps()
        if len(rows) != len(reads):
            raise RuntimeError(
                f"the backend read {len(rows)} steps where the loop ran {len(reads)}: every "
                "train_step must be read by exactly one read_steps()"
            )
        self.loss = float(rows[-1, 0])
        position, policy = self.position, self.train_cfg
        first_step = position.step - len(reads) + 1
        for index, (loss, nonfinite) in enumerate(rows):
            if not nonfinite:
                self.nonfinite_in_a_row = 0
                continue
            self.nonfinite_in_a_row += 1
            read = reads[index]  # this rank's samples read in the epoch, the batch the last
            samples = self.sampler.positions()[read - self.batch_size : read].tolist()
            where = (
                f"step {first_step + index} (epoch {position.epoch}, this rank's batch of "
                f"samples {samples})"
            )
            if policy.nonfinite == "skip" and self.nonfinite_in_a_row <= policy.nonfinite_max_skips:
                log.warning(
                    "non-finite loss or gradients at %s: update skipped (%d in a row, "
                    "train.nonfinite_max_skips %d)",
                    where,
                    self.nonfinite_in_a_row,
                    policy.nonfinite_max_skips,
                )
                continue
            problem = (
                f"the loss or its gradients were not finite (loss {loss}) at {where}"
                if policy.nonfinite == "abort"
                else f"{self.nonfinite_in_a_row} steps in a row with a non-finite loss or "
                f"gradients, the last at {where}"
            )
            saved = checkpoint.latest(self.run_dir)
            raise NonFiniteLossError(
                f"{problem}; the weights were not updated by it, nor checkpointed (latest "
                f"checkpoint: {saved}). HINT: lower optim.lr or raise optim.warmup_steps, set "
                "optim.grad_clip, check that batch with scripts/validate_data.py; "
                "train.nonfinite: skip steps over rare bad batches"
            )

    def end_epoch(self) -> None:
        """The epoch's record (bad samples by kind); then, while the run goes on, the epoch's
        evaluation and checkpoint when they are per epoch (train.eval_every,
        train.checkpoint_every unset). At the run's last step evaluate_and_save() does them."""
        position = self.position
        counts = self.data.train.bad_log.epoch_counts()
        self.telemetry.emit(
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
        if position.step < self.total_steps:
            if not self.train_cfg.eval_every:
                self.evaluate()
            if not self.train_cfg.checkpoint_every:
                self.save()

    def evaluate(self) -> None:
        if self.val_loader is not None:
            self.backend.sync_buffers()  # every rank evaluates the checkpoint's model
            log.info("evaluating at step %d", self.position.step)
            started = time.monotonic()
            try:
                result = evaluate(
                    self.backend,
                    self.val_loader,
                    self.config.task,
                    self.stop_flag,
                    self.dist,
                    counted=self.val_sampler.unpadded,  # not the padding's repeats
                )
            except EvaluationInterrupted as interrupted:
                self.interrupted_batches = interrupted.batches
                self.stop_agreed = True  # by every rank: they all stop at this step
                result = None
            if result is None:
                log.warning(
                    "evaluation at step %d interrupted by the stop request after %.1f s",
                    self.position.step,
                    time.monotonic() - started,
                )
                return
            self.last_eval = result
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
        self.backend.barrier()

    def save(self) -> None:
        died = None
        self.backend.prepare_save()  # every rank: what rank 0's checkpoint holds per rank
        if self.dist.is_main:
            keep = self.train_cfg.keep_last
            try:
                checkpoint.save(self.run_dir, self.backend, self.position, keep, self.config)
            except WorkerDiedError as error:  # saved; raised once the other ranks have it too
                died = error
        self.backend.barrier()
        self.saved_at = self.position.step
        if died is not None:
            raise died

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
        # The checkpoint is on disk and nothing is left to save: ignore the rest of a
        # launcher's burst. Python puts the default action back while the interpreter exits,
        # and a SIGTERM then turned "exit 143" into death by signal 15 (seen with Paddle).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # Nor is a worker that ends badly from here on a failure: a spawned evaluation worker
        # still unpickling its start-up when the stop came dies once the trainer's semaphores
        # are gone, and Torch's SIGCHLD handler then raised "DataLoader worker ... exited
        # unexpectedly" in Python's exit, after the stop had succeeded.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if self.interrupted_batches is not None:  # now the loader may take its time to close
            self.interrupted_batches.close()
        self.open_batches = None
        by = self.stop_flag.signal_name or "another rank's stop signal"
        raise StopRequested(
            f"stopped by {by} at step {self.position.step}", self.stop_flag.signal_name
        )

    def finish(self) -> dict:
        """Close the telemetry; the run's summary."""
        self.telemetry.close()
        totals = self.telemetry.totals
        wall = max(totals["wall_s"], 1e-9)
        loss = self.loss if self.loss is not None else float("nan")  # read by check_finite
        return {
            "steps": self.position.step,
            "epochs_completed": self.position.epoch,
            "final_loss": loss,
            "samples_per_s": totals["samples"] / wall,
            "data_wait_fraction": totals["wait_s"] / wall,
            "bad_samples_total": sum(self.data.train.bad_log.total_counts().values()),
            **{f"val_{k}": v for k, v in self.last_eval.items()},
        }
