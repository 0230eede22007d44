"""What a tuning writes into its folder: ``tuned.yaml`` (the scenario, extended with the loader
and data knobs chosen), ``report.json`` (every figure), ``report.md`` (the same for a reader,
with the bottleneck in one sentence and the command to train with the result) and
``throughput.png`` (predicted against measured per setting). Each file is written whole or not
at all (a temporary file renamed over it); the user's scenario file is never touched."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import platform
import shlex
import tempfile
import time
from pathlib import Path

import yaml

from train.config.load import deep_merge
from train.tune import model
from train.tune.run import Tuning

MB = 2**20


def write_atomic(path: Path, text: str | bytes) -> None:
    mode = "wb" if isinstance(text, bytes) else "w"
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, mode) as stream:
            stream.write(text)
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def knobs(candidate: model.Candidate) -> dict:
    """The config sections a candidate sets."""
    loader: dict = {"num_workers": candidate.workers}
    if candidate.workers:
        loader["prefetch_factor"] = candidate.prefetch
        loader["batch_ring"] = candidate.ring
    return {"loader": loader, "data": {"cache": candidate.cache}}


def tuned_yaml(tuning: Tuning, scenario: Path, out_dir: Path, overrides: dict, command: str):
    """The text of tuned.yaml: ``extends:`` the scenario as the command line named it (a
    relative path is looked up from the working directory, the repository root, in a checkout
    and in a container alike), the command line's --set values, then the chosen knobs."""
    extends = str(scenario)
    body = deep_merge(overrides, knobs(tuning.pick))
    header = [
        f"# Written by: {command}",
        f"# on {platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}: {tuning.host.cores} cores.",
        f"# Bottleneck: {model.BOTTLENECK_TEXT[tuning.bottleneck]}.",
        f"# Train with: python -m train --config {out_dir / 'tuned.yaml'}",
        "# Only the loader and data knobs below differ from the scenario (and any --set the",
        "# tuner was given, kept so training reads the data the tuner measured).",
    ]
    text = yaml.safe_dump({"extends": extends, **body}, sort_keys=False)
    return "\n".join(header) + "\n" + text


def as_json(tuning: Tuning, command: str, train_command: str) -> dict:
    def rate(value):
        return None if value is None else round(value, 1)

    rows = []
    for candidate, runs in tuning.rates().items():
        predicted = model.predict(tuning.costs, tuning.host, tuning.target, candidate)
        interval = tuning.interval(candidate)
        rows.append(
            {
                "setting": candidate.label(),
                "samples_per_s": rate(tuning.measured_rate(candidate)),
                "runs": [rate(r) for r in runs],
                "interval_95": [rate(v) for v in interval] if interval else None,
                "predicted_samples_per_s": rate(predicted.samples_per_s),
                "model_bottleneck": predicted.bottleneck,
                # the storage's bound on this setting: absent when no read goes to storage
                "storage_bound_samples_per_s": rate(predicted.limits.get(model.STORAGE)),
                "shm_mb": round(predicted.shm_bytes / MB, 1),
            }
        )
    configured = tuning.measured_rate(tuning.configured)
    picked = tuning.measured_rate(tuning.pick)
    return {
        "command": command,
        "train_command": train_command,
        "pick": {**knobs(tuning.pick), "setting": tuning.pick.label()},
        "pick_samples_per_s": rate(picked),
        "configured": tuning.configured.label(),
        "configured_samples_per_s": rate(configured),
        "speedup_over_configured": round(picked / configured, 2) if configured else None,
        "bottleneck": tuning.bottleneck,
        "bottleneck_text": model.BOTTLENECK_TEXT[tuning.bottleneck],
        "device_samples_per_s": rate(tuning.target.batch_size / tuning.target.step_s),
        "step": tuning.step,
        "host": dataclasses.asdict(tuning.host),
        "stages": tuning.stages,
        "costs": {  # an unmeasured storage rate is math.inf, which JSON has not: null
            name: value if not isinstance(value, float) or math.isfinite(value) else None
            for name, value in dataclasses.asdict(tuning.costs).items()
        },
        "model_pick": tuning.plan.pick.candidate.label(),
        "model_best": tuning.plan.best.candidate.label(),
        "candidates_modelled": len(tuning.plan.predictions),
        "measured": rows,
        "unexplored": tuning.unexplored,
        "elapsed_s": round(tuning.elapsed_s, 1),
    }


def markdown(report: dict, tuning: Tuning) -> str:
    host, stages = tuning.host, report["stages"]
    step = report["step"]
    step_text = (
        f"{step['step_s'] * 1e3:.1f} ms, given by --step-ms"
        if step["source"] == "--step-ms"
        else f"{step['step_s'] * 1e3:.1f} ms, measured on {step['device']} (batch "
        f"{step['measured_batch']}, scaled to {tuning.target.batch_size})"
    )
    speedup = report["speedup_over_configured"]
    lines = [
        "# Loader tuning",
        "",
        f"Command: `{report['command']}`",
        "",
        f"**Pick:** {report['pick']['setting']}: {report['pick_samples_per_s']} samples/s "
        f"measured"
        + (
            f", {speedup}x the scenario's own setting ({report['configured']}: "
            f"{report['configured_samples_per_s']} samples/s)."
            if speedup
            else "."
        ),
        "",
        f"**Bottleneck:** {report['bottleneck_text']}.",
        "",
        f"**Train with:** `{report['train_command']}`",
        "",
        "## This host",
        "",
        "| cores | busy elsewhere | /dev/shm free | memory available | training data | "
        "memory copy |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {host.cores} | {host.busy_elsewhere:.2f} cores | {host.shm_free_bytes / MB:.0f} MiB | "
        f"{host.memory_available_bytes / MB:.0f} MiB | {host.dataset_bytes / MB:.1f} MiB | "
        f"{host.copy_bytes_per_s / MB:.0f} MiB/s |",
        "",
        f"## Stages, per sample (median of {stages['samples_timed']} records, "
        f"{stages['batches_timed']} batches)",
        "",
        "| read, first: wall / CPU | read again: wall / CPU | decode | augment, resize, label "
        "| in a batch (all but the read) | batch time's cv |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {stages['read']['median_ms']} / {stages['read_cpu']['median_ms']} ms | "
        f"{stages['reread']['median_ms']} / {stages['reread_cpu']['median_ms']} ms | "
        f"{stages['decode']['median_ms']} ms | "
        f"{max(0.0, stages['transform']['median_ms'] - stages['decode']['median_ms']):.4f} ms | "
        f"{stages['batched_per_sample_ms']} ms | {stages['batch_cv']} |",
        "",
        "A read's wall time beyond its CPU time waits on storage: it holds a worker, not a core "
        f"(first read {stages['read_wait_ms']['first']} ms, again "
        f"{stages['read_wait_ms']['again']} ms). " + storage_text(stages),
        "",
        "Per batch beyond making it, CPU (the real loader's runs): the trainer's own work "
        f"without workers {stages['trainer_alone_per_batch_ms']} ms; with a worker, ring on: "
        f"worker {stages['handover_per_batch_ms']['ring']['worker']} ms, trainer "
        f"{stages['handover_per_batch_ms']['ring']['trainer']} ms; ring off: worker "
        f"{stages['handover_per_batch_ms']['framework']['worker']} ms, trainer "
        f"{stages['handover_per_batch_ms']['framework']['trainer']} ms.",
        "",
        f"The step: {step_text}; the device takes {report['device_samples_per_s']} samples/s.",
        "",
        f"## Settings measured ({len(report['measured'])} of {report['candidates_modelled']} "
        "modelled)",
        "",
        "| setting | predicted samples/s | measured samples/s (median) | runs | 95% interval "
        "of the mean | the model's bottleneck | storage bound samples/s | /dev/shm need |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in report["measured"]:
        interval = row["interval_95"]
        shown = f"{interval[0]}-{interval[1]}" if interval else "one run"
        storage = row["storage_bound_samples_per_s"]
        lines.append(
            f"| {row['setting']} | {row['predicted_samples_per_s']} | {row['samples_per_s']} | "
            f"{len(row['runs'])} | {shown} | {row['model_bottleneck']} | "
            f"{'none' if storage is None else storage} | {row['shm_mb']} MiB |"
        )
    if report["unexplored"]:
        lines += [
            "",
            f"The budget ended the search before it tried other {', '.join(report['unexplored'])}"
            " settings; a larger --budget-s measures them.",
        ]
    lines += [
        "",
        "![predicted and measured throughput](throughput.png)",
        "",
        f"Tuning took {report['elapsed_s']} s. How the tuner decides, and what it cannot see: "
        "docs/tuning.md.",
        "",
    ]
    return "\n".join(lines)


def storage_text(stages: dict) -> str:
    """The storage's read rate in a sentence (measure.storage_read_rate)."""
    if stages["storage_mb_per_s"] is None:
        return (
            "The storage's read rate past the page cache was not measured (its filesystem "
            "reads no O_DIRECT): no storage bound."
        )
    return (
        f"The storage serves {stages['storage_mb_per_s']} MiB/s of records "
        f"({stages['storage_records_per_s']} records/s) to reads the page cache does not "
        "serve: the bound of a setting whose reads go to storage (a dataset the page cache "
        "cannot keep)."
    )


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["measured"]
    labels = [row["setting"].replace(" ", "\n") for row in rows]
    positions = range(len(rows))
    figure, axes = plt.subplots(figsize=(max(6.0, 1.3 * len(rows)), 4.5))
    width = 0.4
    axes.bar(
        [p - width / 2 for p in positions],
        [r["predicted_samples_per_s"] for r in rows],
        width,
        label="predicted",
    )
    axes.bar(
        [p + width / 2 for p in positions],
        [r["samples_per_s"] for r in rows],
        width,
        label="measured",
    )
    axes.axhline(
        report["device_samples_per_s"], color="grey", linestyle="--", label="the device's rate"
    )
    axes.set_xticks(list(positions), labels, fontsize=7)
    axes.set_ylabel("samples/s")
    axes.set_title(f"pick: {report['pick']['setting']}", fontsize=9)
    top = max([r["samples_per_s"] for r in rows] + [r["predicted_samples_per_s"] for r in rows])
    axes.set_ylim(0, top * 1.25)
    axes.legend(fontsize=8)
    figure.tight_layout()
    image = io.BytesIO()
    try:
        figure.savefig(image, format="png", dpi=110)
    finally:
        plt.close(figure)
    write_atomic(path, image.getvalue())


def write(tuning: Tuning, out_dir: Path, scenario: Path, overrides: dict, argv: list[str]) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "train.tune", *argv])
    train_command = f"python -m train --config {shlex.quote(str(out_dir / 'tuned.yaml'))}"
    report = as_json(tuning, command, train_command)
    write_atomic(out_dir / "report.json", json.dumps(report, indent=2) + "\n")
    write_atomic(out_dir / "report.md", markdown(report, tuning))
    plot(report, out_dir / "throughput.png")
    # Last: a tuned.yaml next to a report always comes from that report's tuning.
    write_atomic(out_dir / "tuned.yaml", tuned_yaml(tuning, scenario, out_dir, overrides, command))
    return report
