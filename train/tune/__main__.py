r"""Measure the input pipeline on this host, find its bottleneck, and write the loader settings
that keep the device fed.

    python -m train.tune --config configs/ocr/single_gpu.yaml
    python -m train.tune --config configs/resnet50/single_gpu.yaml --step-ms 180
    python -m train --config runs/tune-ocr-paddle-single_gpu/tuned.yaml

It times each stage of the pipeline on the real data, models the pipeline (docs/tuning.md),
runs the real loader for a few seconds at the predicted setting and its neighbours, and writes
tuned.yaml (the scenario with only the loader and data knobs changed), report.md, report.json
and throughput.png into --output-dir (default: tune-<the run's folder name> beside the run's
output.dir). --step-ms plans for a device elsewhere (a GPU this host does not have); without
it the model's step is measured on train.device.

Exit codes: 0 done; 2 bad config or command line; 3 data problem; 5 not even the slowest
setting fits /dev/shm; 7 train.device asks for a GPU this host lacks (pass --step-ms); 10
another tuning holds the output folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from train import cli, errors
from train.tune.run import DEFAULT_BUDGET_S

log = logging.getLogger("train.tune")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from train.config.load import add_overrides_argument

    parser = argparse.ArgumentParser(
        prog="python -m train.tune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="scenario YAML to tune")
    add_overrides_argument(parser)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds the tuning may take, measured runs included (default {DEFAULT_BUDGET_S:g})",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        help="the device's train step in ms, when it is not on this host (default: measured)",
    )
    parser.add_argument(
        "--local-ranks",
        type=int,
        default=1,
        help="training processes on this node, each with its own loader: each measured run "
        "runs that many loaders at once and its rate is one rank's (default 1)",
    )
    parser.add_argument("--output-dir", help="where to write (default: runs/tune-<run name>)")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s:g}")
    if args.step_ms is not None and args.step_ms <= 0:
        parser.error(f"--step-ms must be > 0, got {args.step_ms:g}")
    if args.local_ranks < 1:
        parser.error(f"--local-ranks must be >= 1, got {args.local_ranks}")
    return args


def default_output_dir(config) -> Path:
    run = Path(config.output.dir)
    return run.parent / f"tune-{run.name}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from train.tune.run import LOG_FORMAT

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    held: list = []
    from train.tune.verify import LoaderFailed

    try:
        return run(args, argv, held)
    except LoaderFailed as failed:  # its report (the sample, the worker, the hint) is printed
        return failed.code
    except Exception as exc:
        code = cli.failure_exit_code(exc)  # printed, as python -m train prints it
        if code is None:
            raise
        if code == errors.EXIT_DEVICE and args.step_ms is None:
            print(
                "HINT: to tune for a GPU that is not on this host, pass its step time: "
                "--step-ms X (the loader then runs here, the step is a stand-in)",
                file=sys.stderr,
            )
        return code
    finally:
        for release in reversed(held):
            release()


def run(args, argv: list[str], held: list) -> int:
    from train.config.load import load_config, overrides_mapping
    from train.run_lock import RunLock
    from train.tune import report
    from train.tune.run import prepare, tune

    if any(int(os.environ.get(name) or 1) > 1 for name in ("WORLD_SIZE", "PADDLE_TRAINERS_NUM")):
        print(
            "error: the tuner runs as one process. HINT: start it with python -m train.tune, not "
            "through a launcher; --local-ranks N plans for N ranks on this node",
            file=sys.stderr,
        )
        return errors.EXIT_CONFIG
    config = load_config(args.config, args.overrides)
    out_dir = Path(args.output_dir) if args.output_dir else default_output_dir(config)
    lock = RunLock(out_dir).acquire()
    held.append(lock.release)
    config, backend = prepare(config, args.step_ms, args.local_ranks, held)
    tuning = tune(config, backend, args.step_ms, args.budget_s, args.local_ranks)
    written = report.write(
        tuning, out_dir, Path(args.config), overrides_mapping(args.overrides), argv
    )
    print(
        f"pick: {written['pick']['setting']}: {written['pick_samples_per_s']} samples/s "
        f"(as configured, {written['configured']}: {written['configured_samples_per_s']})\n"
        f"bottleneck: {written['bottleneck_text']}\n"
        f"report: {out_dir / 'report.md'}\n"
        f"train with: {written['train_command']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
