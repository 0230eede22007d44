"""One evaluation pass over a loader, which a stop request can interrupt: the training loop's
evaluations and train.evaluate's alike."""

from __future__ import annotations

from train import tasks
from train.errors import out_of_memory_named
from train.stops import EvaluationInterrupted, HeldBatches, StopAwareBatches, StopFlag, stop_now


def evaluate(
    backend,
    loader,
    task: str,
    stop_flag: StopFlag | None = None,
    dist=None,
    counted: int | None = None,
    breakdowns: bool = False,
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
    loaders keep it, with workers and the batch ring too), so the padding is the last rows.

    ``breakdowns``: the sample count and the task's breakdowns too (OCR: the accuracy per label
    length), this rank's, for train.evaluate's one-process report."""
    spec = tasks.get(task)
    metric = spec.metric()
    extra = {key: make() for key, make in spec.breakdowns} if breakdowns else {}
    samples = 0
    several = dist is not None and dist.world_size > 1
    if stop_flag is None:
        host_batches = loader
    elif several:
        host_batches = HeldBatches(loader)
    else:
        host_batches = StopAwareBatches(loader, stop_flag)
    try:
        for batch in backend.batches.device_batches(host_batches):
            with out_of_memory_named(backend, "evaluation"):
                predicted, labels = (
                    backend.trainer.predict(batch),
                    backend.batches.batch_labels(batch),
                )
            if counted is not None:  # the padding: the rows after this rank's own samples
                predicted = predicted[:counted]
                labels = {key: value[:counted] for key, value in labels.items()}
                counted -= len(predicted)
            if len(predicted):
                for accumulator in (metric, *extra.values()):
                    accumulator.update(predicted, labels)
                samples += len(predicted)
            # Every rank reads as many batches (the sampler pads), so all reach each agreement.
            if several and stop_flag is not None and stop_now(stop_flag, 0, 1, dist, backend):
                raise EvaluationInterrupted
    except EvaluationInterrupted as interrupted:
        interrupted.batches = host_batches
        raise
    result = metric.summarize(backend.runtime.all_reduce_sum(metric.state()))
    if not breakdowns:
        return result
    return {**result, "samples": samples} | {key: b.summarize() for key, b in extra.items()}
