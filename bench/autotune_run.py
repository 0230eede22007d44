"""Training with loader.autotune from a bad start against training at the offline tuner's pick,
side by side on this host.

    python -m bench.autotune_run --config configs/ocr/smoke.yaml
    python -m bench.autotune_run --config configs/ocr/smoke.yaml --set framework=torch

1. The offline pick: ``python -m train.tune`` on the scenario (the step measured here, as the
   training runs it), its tuned.yaml kept.
2. Rounds, interleaved (A B, B A, ...), each a whole training run of --epochs epochs:
   A: the scenario from a bad start (0 workers, no cache) with loader.autotune on;
   B: the offline pick's tuned.yaml, autotune off.
   Each run's throughput per epoch is read from its metrics.jsonl (the train windows of that
   epoch: their samples over their wall time); no evaluation or checkpoint runs inside an
   epoch, so the windows time training alone.
3. The ratio A / B of the medians, epoch by epoch: run-time tuning's goal is 0.9 or more by
   the second epoch.

Writes a JSON and a Markdown file into bench/results/ (or --out), named by the config's
folder and framework: autotune-ocr-torch, autotune-ocr-paddle.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.runner import ROOT, package_versions, write_results

# No evaluation or checkpoint inside an epoch (they would land in a window); logged often
# enough that each epoch has many windows.
QUIET = ["train.eval_every=1000000", "train.checkpoint_every=1000000", "output.plots=false"]
BAD_START = ["loader.num_workers=0", "data.cache=none"]
AUTOTUNE = ["loader.autotune.enabled=true"]


def sets(items) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def epoch_rates(run_dir: Path) -> dict[int, float]:
    """Samples/s of each epoch's train windows (metrics.jsonl), by epoch (0-based). A window
    records its samples/s and its wall time per step (batch_cost_s), and each holds
    train.log_every steps: the epoch's rate is its steps' samples over their wall time."""
    samples: dict[int, float] = {}
    wall: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("type") != "train":
            continue
        epoch, per_step = record["epoch"], record["batch_cost_s"]
        samples[epoch] = samples.get(epoch, 0.0) + record["samples_per_s"] * per_step
        wall[epoch] = wall.get(epoch, 0.0) + per_step
    return {epoch: samples[epoch] / wall[epoch] for epoch in samples if wall[epoch] > 0}


def train(command: list[str], out: Path) -> tuple[dict[int, float], dict]:
    result = subprocess.run(
        [*command, "--output-dir", str(out), "--overwrite"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    return epoch_rates(out), json.loads((out / "summary.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.autotune_run", description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, interleaved")
    parser.add_argument("--tune-budget-s", type=float, default=120.0)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-autotune")
    parser.add_argument("--out", type=Path, help="results path without suffix")
    args = parser.parse_args(argv)

    from train.config.load import load_config

    config = load_config(args.config, args.overrides)
    length = [f"train.epochs={args.epochs}", "train.max_steps=100000000", *QUIET]
    python = [sys.executable]
    tune_dir = args.work / "tune"
    tune_command = [
        *python,
        "-m",
        "train.tune",
        "--config",
        args.config,
        *sets(args.overrides),
        "--budget-s",
        f"{args.tune_budget_s:g}",
        "--output-dir",
        str(tune_dir),
    ]
    started = time.perf_counter()
    tuned = subprocess.run(tune_command, cwd=ROOT, capture_output=True, text=True)
    if tuned.returncode != 0:
        raise SystemExit(f"the tuner failed:\n{tuned.stderr[-4000:]}")
    tune_s = time.perf_counter() - started
    report = json.loads((tune_dir / "report.json").read_text())
    arms = {
        "autotune from 0 workers, no cache": [
            *python,
            "-m",
            "train",
            "--config",
            args.config,
            *sets([*args.overrides, *BAD_START, *AUTOTUNE, *length]),
        ],
        "offline pick (train.tune)": [
            *python,
            "-m",
            "train",
            "--config",
            str(tune_dir / "tuned.yaml"),
            *sets(length),
        ],
    }
    names = list(arms)
    rates: dict[str, list[dict[int, float]]] = {name: [] for name in names}
    settled: list[str] = []
    for number in range(args.rounds):
        for name in names if number % 2 == 0 else names[::-1]:
            out = args.work / f"{'autotune' if name == names[0] else 'pick'}-{number}"
            per_epoch, summary = train(arms[name], out)
            rates[name].append(per_epoch)
            if name == names[0]:
                settled.append(summary.get("autotune_setting", ""))
    epochs = range(args.epochs)
    medians = {
        name: {epoch: statistics.median(run.get(epoch, 0.0) for run in runs) for epoch in epochs}
        for name, runs in rates.items()
    }
    ratio = {
        epoch + 1: round(medians[names[0]][epoch] / medians[names[1]][epoch], 3)
        for epoch in epochs
        if medians[names[1]][epoch] > 0
    }
    results = {
        "command": " ".join(["python -m bench.autotune_run", *(argv or sys.argv[1:])]),
        "host": {"node": platform.node()},
        "packages": package_versions(),
        "framework": config.framework,
        # A storage fault below the record cache (datasets/faults.py), when the run was given one
        "data_inject_fault": os.environ.get("DATA_INJECT_FAULT"),
        "tune_command": " ".join(tune_command[1:]),
        "tune_s": round(tune_s, 1),
        "offline_pick": report["pick"]["setting"],
        "autotune_settled_on": settled,
        "rounds": args.rounds,
        "samples_per_s_by_epoch": {
            name: [{e + 1: round(r, 1) for e, r in run.items()} for run in runs]
            for name, runs in rates.items()
        },
        "median_samples_per_s_by_epoch": {
            name: {e + 1: round(r, 1) for e, r in m.items()} for name, m in medians.items()
        },
        "autotune_vs_pick_by_epoch": ratio,
    }
    stem = args.out or ROOT / "bench" / "results" / (
        f"autotune-{Path(args.config).parent.name}-{config.framework}"
    )
    write_results(stem, results, markdown(results))
    return 0


def markdown(results: dict) -> str:
    names = list(results["median_samples_per_s_by_epoch"])
    epochs = sorted(results["autotune_vs_pick_by_epoch"])
    settled = ", ".join(results["autotune_settled_on"])
    lines = [
        f"# loader.autotune from a bad start vs the offline pick ({results['framework']})",
        "",
        f"`{results['command']}`"
        + (
            f" with `DATA_INJECT_FAULT={results['data_inject_fault']}`"
            if results["data_inject_fault"]
            else ""
        ),
        "",
        f"Offline pick: {results['offline_pick']} (`{results['tune_command']}`, "
        f"{results['tune_s']} s). Autotune settled on: {settled}.",
        "",
        "| epoch | " + " | ".join(names) + " | autotune / pick |",
        "|---:|" + "---:|" * (len(names) + 1),
    ]
    for epoch in epochs:
        row = [f"{results['median_samples_per_s_by_epoch'][n][epoch]:.0f}" for n in names]
        lines.append(
            f"| {epoch} | "
            + " | ".join(row)
            + f" | {results['autotune_vs_pick_by_epoch'][epoch]} |"
        )
    lines += ["", f"Medians of {results['rounds']} interleaved runs of each; samples/s per rank."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
