"""Markdown table and PNG plots from a results JSON (matplotlib Agg, no display needed)."""

from __future__ import annotations

from pathlib import Path

ARMS = (
    ("resnet50", "ours"),
    ("resnet50", "torchvision_ref"),
    ("resnet50", "decode_only"),
    ("ocr", "ours"),
    ("ocr", "paddleocr"),
    ("ocr", "ours_recaug"),
    ("ocr", "paddleocr_recaug"),
)


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def throughput_table(results: dict) -> str:
    workers = sorted(
        {
            w
            for task, arm in ARMS
            for w in results.get(task, {}).get(arm, {}).get("samples_per_s", {})
        },
        key=int,
    )
    lines = [
        "| pipeline | " + " | ".join(f"workers={w}" for w in workers) + " |",
        "|---|" + "---:|" * len(workers),
    ]
    for task, arm in ARMS:
        speeds = results.get(task, {}).get(arm, {}).get("samples_per_s")
        if speeds:
            cells = " | ".join(_fmt(speeds.get(w)) for w in workers)
            lines.append(f"| {task}.{arm} (samples/s) | {cells} |")
    kinds = (  # bench/parts.py: _all_ratios
        ("ratios", "ratio"),  # of the median speeds
        ("paired_ratios", "paired ratio"),  # median over the rounds of the round's own ratio
        ("cpu_ratios", "CPU ratio"),  # the peer's CPU time per sample over ours
    )
    for task_name in ("resnet50", "ocr"):
        for key, label in kinds:
            for name, by_workers in results.get(task_name, {}).get(key, {}).items():
                cells = " | ".join(_fmt(by_workers.get(w), 2) for w in workers)
                lines.append(f"| {task_name} {label} {name} | {cells} |")
    return "\n".join(lines)


def cost_table(results: dict) -> str:
    """Per arm and worker count: CPU time per sample (trainer and workers) and minor page faults
    per batch in the steady window, medians of the trials (bench/child.py)."""
    rows = []
    for task, arm in ARMS:
        detail = results.get(task, {}).get(arm, {}).get("detail", {})
        cells = [
            f"{_fmt(row.get('cpu_us_per_sample'))} / {_fmt(row.get('faults_per_batch'), 0)}"
            for _, row in sorted(detail.items(), key=lambda item: int(item[0]))
        ]
        if cells:
            rows.append(f"| {task}.{arm} | " + " | ".join(cells) + " |")
    if not rows:
        return ""
    workers = sorted(
        {w for task, arm in ARMS for w in results.get(task, {}).get(arm, {}).get("detail", {})},
        key=int,
    )
    header = [
        "| CPU us per sample / page faults per batch | "
        + " | ".join(f"workers={w}" for w in workers)
        + " |",
        "|---|" + "---:|" * len(workers),
    ]
    return "\n".join(header + rows)


def handover_table(results: dict) -> str:
    """Per arm and worker count: copies of a batch after the stack, the worker's ms to stack and
    hand over one batch, and that time's share of a worker's time per batch (bench/handover.py)."""
    rows = []
    for task, arm in ARMS:
        detail = results.get(task, {}).get(arm, {}).get("detail", {})
        for workers, row in sorted(detail.items(), key=lambda item: int(item[0])):
            if row.get("copies_per_batch") is None:
                continue
            share = row.get("handover_share")
            rows.append(
                f"| {task}.{arm} | {workers} | {row['copies_per_batch']:g} "
                f"| {_fmt(row.get('handover_ms'), 2)} "
                f"| {'-' if share is None else f'{100 * share:.1f}%'} |"
            )
    if not rows:
        return ""
    header = [
        "| hand-over | workers | copies per batch | stack + hand-over ms/batch "
        "| share of worker time |",
        "|---|---:|---:|---:|---:|",
    ]
    return "\n".join(header + rows)


def knob_table(rows: list[dict]) -> str:
    lines = [
        "| framework | config | samples/s | shm estimate MB | shm measured MB "
        "| worker RSS MB | worker USS MB | first batch s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['framework']} | {r['config']} | {_fmt(r['samples_per_s'])} "
            f"| {_fmt(r['shm_estimate_bytes'] / 2**20)} "
            f"| {_fmt((r['shm_peak_delta_bytes'] or 0) / 2**20)} "
            f"| {_fmt(r['peak_worker_rss_mb'])} | {_fmt(r['peak_worker_uss_mb'])} "
            f"| {_fmt(r['first_batch_s'], 2)} |"
        )
    return "\n".join(lines)


def markdown(results: dict) -> str:
    parts = [f"# Loader benchmark: {results.get('name')}", "", throughput_table(results)]
    for table in (cost_table(results), handover_table(results)):
        if table:
            parts += ["", table]
    if results.get("ipc"):
        parts += ["", "| IPC bytes per batch | ours | peer | ratio |", "|---|---:|---:|---:|"]
        for task, row in results["ipc"].items():
            parts.append(
                f"| {task} | {row['ours_bytes']} ({row['ours_dtype']}) "
                f"| {row['peer_bytes']} ({row['peer_dtype']}) | {_fmt(row['ratio'], 3)} |"
            )
    for framework, stall in results.get("stall", {}).items():
        parts += [
            "",
            f"Data stall ({framework}, {stall['step_s']} s step, " f"batch {stall['batch_size']}):",
            "",
            "| config | waiting | samples/s | demand |",
            "|---|---:|---:|---:|",
        ]
        for label, row in stall["configs"].items():
            parts.append(
                f"| {label} | {_fmt((row['wait_fraction'] or 0) * 100)}% "
                f"| {_fmt(row['samples_per_s'])} | {row['demand_samples_per_s']} |"
            )
    knobs = [r for rows in results.get("knobs", {}).values() for r in rows]
    if knobs:
        parts += ["", knob_table(knobs)]
    cold = [r for rows in results.get("cold_start", {}).values() for r in rows]
    if cold:
        parts += [
            "",
            "| framework | cache | epoch 1 s | epoch 2 s | first batch s (e1, e2) |",
            "|---|---|---:|---:|---|",
        ]
        for r in cold:
            epochs = r["epoch_s"] or [None, None]
            parts.append(
                f"| {r['framework']} | {r['cache']} | {_fmt(epochs[0], 2)} "
                f"| {_fmt(epochs[-1], 2)} | {r['first_batch_s']} |"
            )
    return "\n".join(parts) + "\n"


def plots(results: dict, out_prefix: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task_name in ("resnet50", "ocr"):
        if task_name not in results:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm, row in results[task_name].items():
            speeds = row.get("samples_per_s") if isinstance(row, dict) else None
            if not speeds or arm in ("ratios", "paired_ratios", "cpu_ratios", "settings"):
                continue
            points = sorted((int(w), s) for w, s in speeds.items() if s)
            ax.plot(*zip(*points), marker="o", label=arm)
        ax.set(
            xlabel="num_workers", ylabel="samples/s", title=f"{task_name}: throughput vs workers"
        )
        ax.legend()
        ax.grid(alpha=0.3)
        path = Path(f"{out_prefix}-{task_name}-workers.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(str(path))
    for framework, rows in results.get("knobs", {}).items():
        fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.5))
        ax.barh([r["config"] for r in rows], [r["samples_per_s"] or 0 for r in rows])
        ax.set(xlabel="samples/s", title=f"{framework} loader knobs")
        ax.invert_yaxis()
        path = Path(f"{out_prefix}-knobs-{framework}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(str(path))
    return written
