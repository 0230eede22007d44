"""The tuner against an exhaustive sweep, side by side in one process on this host.

    python -m bench.tune_sweep --config configs/ocr/single_gpu.yaml --step-ms 1
    python -m bench.tune_sweep --config configs/resnet50/single_gpu.yaml --step-ms 1

1. The tuner (train.tune's ``tune``) at the command's default budget (--budget-s), timed.
2. The sweep: every setting of the tuner's grid (workers 0 to 2 x cores, prefetch 1/2/4, cache
   none/memory/disk, ring on/off; those that fit /dev/shm) measured once with the tuner's own
   measured run (train/tune/verify.py), timed.
3. The comparison: the tuner's pick, the sweep's fastest three, the rule of thumb (a worker per
   core, prefetch 2), the scenario's own setting and the bad start (0 workers, no cache,
   prefetch 1) measured again in interleaved rounds (A B C, C B A, ...), so a slow spell of the
   shared host hits each alike; medians. A sweep's single fastest figure is the maximum
   of many noisy measurements, so the pick is compared with the re-measured medians.

Writes a JSON and a Markdown file into bench/results/ (or --out), named by the config's folder
and framework: tune-ocr-paddle, tune-resnet50-torch.
--step-ms 1 makes the device much faster than any loader on a CPU host: the loader is the
limit.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

from bench.runner import ROOT, package_versions, write_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tune_sweep", description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--step-ms", type=float, default=1.0)
    parser.add_argument(
        "--budget-s", type=float, help="the tuner's --budget-s (default: the command's own)"
    )
    parser.add_argument("--window-s", type=float, default=2.0, help="each sweep run's window")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds at the end")
    parser.add_argument("--out", type=Path, help="results path without suffix")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from train.config.load import load_config
    from train.config.schema import DEFAULT_PREFETCH_FACTOR
    from train.tune import model, verify
    from train.tune.run import DEFAULT_BUDGET_S, prepare, tune

    budget_s = DEFAULT_BUDGET_S if args.budget_s is None else args.budget_s

    held: list = []
    config, backend = prepare(load_config(args.config, args.overrides), args.step_ms, 1, held)
    try:
        started = time.perf_counter()
        tuning = tune(config, backend, args.step_ms, budget_s)
        tune_s = time.perf_counter() - started
        device = verify.DeviceStandIn(tuning.target.step_s)

        grid = [
            p.candidate
            for p in tuning.plan.predictions
            if p.feasible
            and p.candidate in model.candidates(tuning.host, tuning.target, costs=tuning.costs)
        ]
        started = time.perf_counter()
        sweep = []
        for number, candidate in enumerate(grid, 1):
            expected = tuning.predicted_rate(candidate)
            result = verify.measure(
                config, backend, candidate, device, args.window_s, expected, on_device=False
            )
            logging.info(
                "sweep %d/%d %s: %.0f", number, len(grid), candidate.label(), result.samples_per_s
            )
            sweep.append(result)
        sweep_s = time.perf_counter() - started

        ranked = sorted(sweep, key=lambda m: m.samples_per_s, reverse=True)
        bad = model.Candidate(0, 1, "none", False)
        # The rule of thumb the tuner must beat: a worker per core, the frameworks' prefetch.
        thumb = model.Candidate(tuning.host.cores, DEFAULT_PREFETCH_FACTOR, "none", True)
        baselines = [thumb, tuning.configured]
        arms = list(
            dict.fromkeys([tuning.pick, *(m.candidate for m in ranked[:3]), *baselines, bad])
        )
        rounds: dict[model.Candidate, list[float]] = {arm: [] for arm in arms}
        for number in range(args.rounds):
            for arm in arms if number % 2 == 0 else arms[::-1]:
                result = verify.measure(
                    config,
                    backend,
                    arm,
                    device,
                    args.window_s,
                    tuning.predicted_rate(arm),
                    on_device=False,
                )
                rounds[arm].append(result.samples_per_s)
        medians = {arm: statistics.median(speeds) for arm, speeds in rounds.items()}
    finally:
        for release in reversed(held):
            release()

    best = max((arm for arm in arms if arm not in (tuning.pick, bad)), key=medians.get)
    best = best if medians[best] > medians[tuning.pick] else tuning.pick
    results = {
        "command": " ".join(["python -m bench.tune_sweep", *(argv or sys.argv[1:])]),
        "host": {"node": platform.node(), "cores": tuning.host.cores},
        "packages": package_versions(),
        "step_ms": args.step_ms,
        "tune_s": round(tune_s, 1),
        "sweep_s": round(sweep_s, 1),
        "tune_share_of_sweep": round(tune_s / sweep_s, 3),
        "settings_swept": len(grid),
        "settings_the_tuner_measured": len(tuning.rates()),
        "runs_the_tuner_made": len(tuning.measured),
        "pick": tuning.pick.label(),
        "bottleneck": tuning.bottleneck,
        "sweep_fastest": [
            {"setting": m.candidate.label(), "samples_per_s": round(m.samples_per_s, 1)}
            for m in ranked[:5]
        ],
        "rounds": {arm.label(): [round(s, 1) for s in speeds] for arm, speeds in rounds.items()},
        "medians": {arm.label(): round(speed, 1) for arm, speed in medians.items()},
        "best_remeasured": best.label(),
        "pick_vs_best": round(medians[tuning.pick] / medians[best], 3),
        "pick_vs_bad_start": round(medians[tuning.pick] / medians[bad], 2),
        "workers_equal_cores": thumb.label(),
        "pick_vs_workers_equal_cores": round(medians[tuning.pick] / medians[thumb], 3),
        "configured": tuning.configured.label(),
        "pick_vs_configured": round(medians[tuning.pick] / medians[tuning.configured], 3),
        "budget_s": budget_s,
        "sweep": [m.as_dict() for m in sweep],
    }
    scenarios = Path(args.config).parent.name  # configs/ocr, configs/resnet50
    stem = args.out or ROOT / "bench" / "results" / f"tune-{scenarios}-{config.framework}"
    write_results(stem, results, markdown(results))
    return 0


def markdown(results: dict) -> str:
    lines = [
        f"`{results['command']}` on {results['host']['cores']} cores",
        "",
        f"- tuner: {results['tune_s']} s, {results['settings_the_tuner_measured']} settings "
        f"in {results['runs_the_tuner_made']} measured runs; sweep: {results['sweep_s']} s, "
        f"{results['settings_swept']} settings "
        f"(tuner / sweep = {results['tune_share_of_sweep']})",
        f"- pick: {results['pick']} (bottleneck: {results['bottleneck']})",
        f"- pick / best re-measured ({results['best_remeasured']}): {results['pick_vs_best']}",
        f"- pick / bad start (workers=0, no cache, prefetch 1): {results['pick_vs_bad_start']}",
        f"- pick / a worker per core ({results['workers_equal_cores']}): "
        f"{results['pick_vs_workers_equal_cores']}",
        f"- pick / the scenario's own setting ({results['configured']}): "
        f"{results['pick_vs_configured']}",
        f"- the tuner's budget: {results['budget_s']:g} s",
        "",
        "| setting | median samples/s | rounds |",
        "|---|---:|---|",
    ]
    for setting, median in results["medians"].items():
        rounds = ", ".join(f"{s:.0f}" for s in results["rounds"][setting])
        lines.append(f"| {setting} | {median} | {rounds} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
