"""End-of-run summary table and PNG plots from metrics.jsonl (rank 0)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from datasets.safe_files import write_atomic
from train import run_files


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary_table(summary: dict) -> str:
    """Two aligned columns, one line per figure."""
    width = max(len(k) for k in summary)
    lines = ["-" * (width + 24)]
    for key, value in summary.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<{width}}  {shown}")
    lines.append(lines[0])
    return "\n".join(lines)


def _save(fig, path: Path) -> None:
    """The figure as PNG, written through a rename that refuses a link at ``path``. The plots
    are drawn last, from metrics.jsonl: one that cannot be written (disk full...) ends the run
    with exit 4 like any run file, and its message says that nothing else is missing."""
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    run_dir = path.parent.parent
    note = "the run itself is complete (checkpoints, metrics.jsonl, summary.json)"
    then = f"draw the plots with python -m train.report {run_dir}"
    with run_files.writing(path, note=note, then=then):
        write_atomic(path, image.getvalue())


def write_plots(run_dir: Path) -> list[Path]:
    """loss.png (train loss and eval metrics) and throughput.png (samples/s, data wait)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    if not train:
        return []
    out = Path(run_dir) / "plots"
    out.mkdir(exist_ok=True)
    steps = [r["step"] for r in train]

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in train], label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if evals:
        metric_keys = [k for k in evals[-1] if k not in ("type", "step", "epoch", "samples")]
        twin = ax.twinx()
        for key in metric_keys:
            twin.plot(
                [r["step"] for r in evals], [r[key] for r in evals], "o--", label=f"val {key}"
            )
        twin.set_ylabel("validation metric")
        twin.legend(loc="center right")
    ax.legend(loc="upper right")
    ax.set_title("loss and validation metrics")
    fig.tight_layout()
    _save(fig, out / "loss.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["samples_per_s"] for r in train], label="samples/s")
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s")
    twin = ax.twinx()
    twin.plot(steps, [100 * r["data_wait_fraction"] for r in train], "r:", label="data wait %")
    twin.set_ylabel("data wait (% of wall time)")
    twin.set_ylim(0, 100)
    ax.legend(loc="upper left")
    twin.legend(loc="upper right")
    ax.set_title("throughput and data wait")
    fig.tight_layout()
    _save(fig, out / "throughput.png")
    plt.close(fig)
    return [out / "loss.png", out / "throughput.png"]


def main(argv: list[str] | None = None) -> int:
    """python -m train.report RUN_DIR: draw the plots of a run again from its metrics.jsonl."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m train.report", description=main.__doc__)
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    plots = write_plots(args.run_dir)
    print(f"plots: {', '.join(map(str, plots)) or 'none (no train records)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
