"""train.nonfinite: what a step whose loss or gradients were NaN/Inf does to the run.

The backend keeps such a step's loss and flag on the device; this policy reads the steps queued
since its last read in ONE read of the device (backend.trainer.read_steps), once per logging window
and before an evaluation, a checkpoint or the end of an epoch, where the loop waits for the device
anyway. So an abort comes up to train.log_every - 1 steps after its bad step, naming that step:
nothing is lost by the wait, since every evaluation and checkpoint comes after a read, and no
weights of a bad step or of the steps after it are ever evaluated or saved. Under skip the backend
undoes a bad step's update on every rank, since the run goes on from those weights; under abort the
run ends at the read, so the backend need not undo it (the Paddle backend does not, and copies no
state per step for it).
"""

from __future__ import annotations

import logging
from pathlib import Path

from train import checkpoint
from train.errors import NonFiniteLossError

log = logging.getLogger("train")


class NonFiniteSteps:
    """The steps queued since the last read, and how many steps in a row were not finite."""

    def __init__(self, train_cfg, run_dir: Path, batch_size: int) -> None:
        self.mode, self.max_skips = train_cfg.nonfinite, train_cfg.nonfinite_max_skips
        self.run_dir, self.batch_size = run_dir, batch_size
        self.in_a_row = 0
        # Where each unread step's batch ends in this rank's epoch order (host ints, to name a
        # bad batch).
        self.unread: list[int] = []

    def queued(self, batch_end: int) -> None:
        """A train step the backend has queued, whose batch ends at ``batch_end``."""
        self.unread.append(batch_end)

    def read(self, backend, position: checkpoint.Position, sampler) -> float | None:
        """Read the queued steps (``position``: after the last of them) and apply the policy:
        a warning per skipped step, NonFiniteLossError on abort or past
        train.nonfinite_max_skips in a row. Returns the last step's loss (None: none queued)."""
        reads, self.unread = self.unread, []
        if not reads:
            return None
        rows = backend.trainer.read_steps()
        if len(rows) != len(reads):
            raise RuntimeError(
                f"the backend read {len(rows)} steps where the loop ran {len(reads)}: every "
                "train_step must be read by exactly one read_steps()"
            )
        first_step = position.step - len(reads) + 1
        for index, (loss, nonfinite) in enumerate(rows):
            if not nonfinite:
                self.in_a_row = 0
                continue
            self.in_a_row += 1
            read = reads[index]  # this rank's samples read in the epoch, the batch the last
            samples = sampler.positions()[read - self.batch_size : read].tolist()
            where = (
                f"step {first_step + index} (epoch {position.epoch}, this rank's batch of "
                f"samples {samples})"
            )
            if self.mode == "skip" and self.in_a_row <= self.max_skips:
                log.warning(
                    "non-finite loss or gradients at %s: update skipped (%d in a row, "
                    "train.nonfinite_max_skips %d)",
                    where,
                    self.in_a_row,
                    self.max_skips,
                )
                continue
            self.abort(loss, where)
        return float(rows[-1, 0])

    def abort(self, loss: float, where: str) -> None:
        problem = (
            f"the loss or its gradients were not finite (loss {loss}) at {where}"
            if self.mode == "abort"
            else f"{self.in_a_row} steps in a row with a non-finite loss or gradients, the "
            f"last at {where}"
        )
        saved = checkpoint.latest(self.run_dir)
        raise NonFiniteLossError(
            f"{problem}; no checkpoint holds weights of that step or later (latest "
            f"checkpoint: {saved}). HINT: lower optim.lr or raise optim.warmup_steps, set "
            "optim.grad_clip, check that batch with scripts/validate_data.py; "
            "train.nonfinite: skip steps over rare bad batches"
        )
