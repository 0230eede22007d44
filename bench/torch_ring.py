"""Does the batch ring help our torch loader? ResNet-50 through our torch loader with
``loader.batch_ring`` off (torch's own hand-over) and on (datasets.batch_ring), 1 and 2 workers.

    .venv-torch/bin/python -m bench.torch_ring [--reps 6] [--workers 1 2] [--images 256]

Torch's own hand-over: the worker stacks a batch into a numpy array, the queue moves its
storage into a new /dev/shm file (a copy into pages mapped for that batch alone: about 1,190
page faults per ResNet-50 batch of 32, 3.3 us each here), and the trainer maps the file. Through
the ring the worker stacks the samples straight into a slot that stays mapped, and the trainer
copies the slot into an array of an earlier batch that nothing refers to any more
(datasets.batch_buffers): no faults, one memcpy in the trainer (train/backends/torch/data.py).

Both arms are the benchmark's ``resnet50.ours`` pipeline (the same dataset, sampler, batch size,
transform and workers), with the spec's ``ring`` false and true: only the hand-over differs.
They run in the benchmark's children (bench.runner), interleaved round by round, so a slow
spell of the host falls on both. Printed:
per worker count, the median samples/s, CPU us per sample (trainer + workers) and page faults
per batch of each arm, and the ratio ring / torch (ratio of medians and the paired median).
docs/benchmarks.md ("The batch ring for torch") quotes a run.
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="batches before the timed window")
    args = parser.parse_args()

    from bench.data import image_data
    from bench.runner import Runner, interleaved

    data = image_data(args.images)
    base = {"hdf5": data["hdf5"], "batch_size": 32, "batches": args.batches, "warmup": args.warmup}
    arms = [
        ("torch", "resnet50.ours", {**base, "ring": False}),
        ("ring", "resnet50.ours", {**base, "ring": True}),
    ]
    runner = Runner()
    try:
        for workers in args.workers:
            spec_arms = [(label, name, {**spec, "workers": workers}) for label, name, spec in arms]
            trials = interleaved(runner, spec_arms, args.reps, lambda line: None)
            _print_row(workers, trials)
    finally:
        runner.close()


def _print_row(workers: int, trials: dict[str, list[dict]]) -> None:
    def median(label: str, key: str):
        values = [t[key] for t in trials[label] if t.get("ok") and t.get(key) is not None]
        return round(statistics.median(values), 1) if values else None

    for label in ("torch", "ring"):
        errors = [t.get("error", "")[:200] for t in trials[label] if not t.get("ok")]
        print(
            f"workers={workers} {label:5s}: {median(label, 'samples_per_s')} samples/s, "
            f"{median(label, 'cpu_us_per_sample')} CPU us/sample, "
            f"{median(label, 'faults_per_batch')} faults/batch"
            + (f", errors {errors}" if errors else "")
        )
    pairs = [
        r["samples_per_s"] / t["samples_per_s"]
        for t, r in zip(trials["torch"], trials["ring"])
        if t.get("ok") and r.get("ok")
    ]
    if pairs:
        speeds = median("ring", "samples_per_s") / median("torch", "samples_per_s")
        print(
            f"workers={workers} ring / torch: {speeds:.3f} (ratio of medians), "
            f"{statistics.median(pairs):.3f} (paired), rounds {[round(p, 3) for p in pairs]}"
        )


if __name__ == "__main__":
    main()
