"""Run real framework DataLoaders over the project's datasets and report which process opened
which file (via DATA_OPEN_LOG). Used by tests/test_workers.py in a child process, so that
spawn, fork and crashes are all real.

  python tests/probes/loader_probe.py FRAMEWORK OCR_ROOT CHARSET H5 OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from datasets.dataset import build_image_dataset, build_ocr_dataset  # noqa: E402
from datasets.ocr_transforms import CharDict  # noqa: E402
from datasets.sampler import EpochSampler  # noqa: E402
from train.backends.common import LoaderKnobs  # noqa: E402

# Two epochs tell the cases apart: persistent workers are the same two processes in both,
# fresh ones four; a third epoch only starts more workers (a spawned one imports the framework).
EPOCHS = 2
WORKERS = 2


def loader(framework, dataset, sampler, context, persistent):
    knobs = LoaderKnobs(
        batch_size=8,
        num_workers=WORKERS,
        persistent_workers=persistent,
        multiprocessing_context=context,
    )
    if framework == "torch":
        from train.backends.torch.data import make_loader

        return make_loader(dataset, sampler, knobs)
    from train.backends.paddle.data import make_loader

    return make_loader(dataset, sampler, knobs)


def run_case(framework, kind, context, persistent, args, log) -> dict:
    # One log for the whole probe, set before any worker starts: a fork server keeps the
    # environment it started with, so a per-case variable would never reach its workers.
    start = log.stat().st_size if log.exists() else 0
    if kind == "ocr":
        dataset = build_ocr_dataset(args[0], CharDict.from_file(args[1]), train=True)
    else:
        dataset = build_image_dataset(args[2], train=True, image_size=64)
    sampler = EpochSampler(len(dataset), seed=1)
    data = loader(framework, dataset, sampler, context, persistent)
    batches = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        batches += sum(1 for _ in data)
    del data
    dataset.close()
    with open(log, "rb") as lines:
        lines.seek(start)
        opens = [line.split("\t") for line in lines.read().decode().splitlines()]
    return {"parent": os.getpid(), "batches": batches, "opens": opens}


def main() -> None:
    framework, ocr_root, charset, h5, out_dir = sys.argv[1:6]
    log = Path(out_dir) / f"{framework}-opens.log"
    os.environ["DATA_OPEN_LOG"] = str(log)  # inherited by every worker the probe starts
    results = {}
    for kind in ("ocr", "h5"):
        for context in ("fork", "spawn", "forkserver"):
            for persistent in (True, False):
                case = f"{kind}-{context}-{'persistent' if persistent else 'fresh'}"
                results[case] = run_case(
                    framework, kind, context, persistent, (ocr_root, charset, h5), log
                )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
