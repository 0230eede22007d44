"""Preflight doctor: is this machine ready for this config? One line per check, with the fix.

    python -m train.doctor --config configs/resnet50/single_gpu.yaml [--set key=value ...]

Checks /dev/shm against the config's need, GPU visibility, ulimits, CPU count against
num_workers, the datasets (present, valid, a sample decodes), and disk space for checkpoints.
Exit 1 when any check FAILs, 0 otherwise (WARN does not fail). The container entrypoint runs it.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train import preflight  # noqa: E402

# Parameters by model, for the checkpoint-size estimate without importing a framework.
MODEL_PARAMS = {"resnet50": 25.6e6, "resnet18": 11.7e6, "crnn": 9e6, "crnn_tiny": 1e6}


@dataclass
class Check:
    name: str
    status: str  # PASS | WARN | FAIL
    detail: str
    fix: str = ""


def check_shm(config, workers: int, ranks: int, sample) -> Check:
    plan = preflight.plan(config, workers, ranks, sample)
    stale = preflight.stale_batches()
    free = preflight.shm_free_bytes() + stale.bytes  # training removes them before it starts
    detail = f"need {plan.describe()}; free {free / 2**20:.0f} MiB"
    if stale.paths:
        detail += (
            f" (counting {stale.bytes / 2**20:.0f} MiB in {len(stale.paths)} batch files left "
            "by dead Paddle processes, which training removes at start)"
        )
    if plan.need_bytes <= free:
        return Check("/dev/shm", "PASS", detail)
    status = "WARN" if config.shm.policy == "adapt" else "FAIL"
    note = " (shm.policy=adapt will lower prefetch/workers, slower)" if status == "WARN" else ""
    return Check("/dev/shm", status, detail + note, preflight.SHM_FIX)


def gpu_info() -> list[str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = pynvml.nvmlDeviceGetCount()
        names = [
            pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)
        ]
        return [f"{n} (driver {driver})" for n in names]
    except Exception:
        return []


def check_gpu(config) -> Check:
    gpus = gpu_info()
    wanted = config.train.device
    if gpus:
        return Check("GPU", "PASS", f"{len(gpus)} visible: {', '.join(gpus)}")
    fix = (
        "run the container with the NVIDIA runtime (compose.yaml's device reservation, "
        "docker run --gpus all) and check nvidia-smi on the host"
    )
    if wanted == "gpu":
        return Check("GPU", "FAIL", "train.device is gpu but no GPU is visible", fix)
    if wanted == "auto":
        return Check("GPU", "WARN", "no GPU visible: training will run on the CPU", fix)
    return Check("GPU", "PASS", "train.device is cpu")


def check_ulimits(gpus: bool) -> list[Check]:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    nofile = Check(
        "ulimit nofile",
        "PASS" if soft >= 4096 else "WARN",
        f"soft limit {soft}",
        ""
        if soft >= 4096
        else "raise it (compose ulimits nofile: 65536); workers "
        "and shared-memory batches each hold descriptors",
    )
    memlock, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = memlock == resource.RLIM_INFINITY
    shown = "unlimited" if unlimited else f"{memlock} bytes"
    lock = Check(
        "ulimit memlock",
        "PASS" if unlimited or not gpus else "WARN",
        shown,
        ""
        if unlimited or not gpus
        else "set memlock: -1 (compose ulimits) for pinned " "memory and RDMA/NCCL",
    )
    return [nofile, lock]


def check_cpus(config, workers: int, reason: str, ranks: int) -> Check:
    from train.config import usable_cores

    cores = usable_cores()
    detail = f"{cores} usable cores; num_workers={workers} per rank x {ranks} rank(s) ({reason})"
    if workers * ranks > cores:
        return Check(
            "CPU vs workers",
            "WARN",
            detail,
            "more workers than cores oversubscribe the CPU; use num_workers: auto",
        )
    if workers == 0 and cores >= 4:
        return Check(
            "CPU vs workers",
            "WARN",
            detail,
            "decode runs in the training process; set loader.num_workers: auto",
        )
    return Check("CPU vs workers", "PASS", detail)


def check_dataset(config, split: str, path: str | None):
    """Open the dataset like training does and decode one sample (returns it for shm sizing)."""
    from datasets import remote
    from datasets.dataset import build_image_dataset, build_ocr_dataset
    from datasets.errors import BadSampleError, DatasetError
    from datasets.ocr_transforms import CharDict

    if path is None:
        return Check(f"data.{split}", "PASS", "not set"), None
    if remote.is_remote(path):
        return Check(f"data.{split}", "PASS", f"{path}: remote, staged at start"), None
    try:
        if config.task == "ocr":
            chars = CharDict.from_file(config.data.char_dict, config.data.use_space_char)
            dataset = build_ocr_dataset(
                path,
                chars,
                train=False,
                image_shape=config.data.image_shape,
                max_text_length=config.data.max_text_length,
            )
        else:
            dataset = build_image_dataset(
                path,
                train=False,
                image_size=config.data.image_size,
                eval_resize=config.data.eval_resize,
            )
        sample = dataset[0]
        count = len(dataset)
        dataset.close()
    except (DatasetError, BadSampleError) as exc:
        return Check(
            f"data.{split}",
            "FAIL",
            str(exc).split(". HINT")[0],
            "scripts/validate_data.py PATH shows every bad record",
        ), None
    if count < config.loader.batch_size and split == "train":
        return Check(
            f"data.{split}",
            "FAIL",
            f"{count} samples < batch_size " f"{config.loader.batch_size}",
            "lower loader.batch_size",
        ), sample
    return Check(f"data.{split}", "PASS", f"{path}: {count} samples, first decodes"), sample


def check_disk(config) -> Check:
    out = Path(config.output.dir)
    probe = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free
    params = MODEL_PARAMS.get(config.model.name, 25e6)
    # weights + two optimizer moments, float32, for each kept checkpoint plus one being written
    need = int(params * 4 * 3 * (config.train.keep_last + 1))
    detail = f"{free / 2**30:.1f} GiB free at {probe}; checkpoints need ~{need / 2**30:.2f} GiB"
    if free < need:
        return Check(
            "disk for checkpoints",
            "FAIL",
            detail,
            "free space, lower train.keep_last, or set output.dir on a larger volume",
        )
    return Check("disk for checkpoints", "PASS" if free > 2 * need else "WARN", detail)


def run_checks(config) -> list[Check]:
    from train.config import resolve_num_workers

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("PADDLE_LOCAL_SIZE", "1")))
    workers, reason = resolve_num_workers(config.loader.num_workers, local_world_size=ranks)
    checks = []
    train_check, sample = check_dataset(config, "train", config.data.train)
    val_check, _ = check_dataset(config, "val", config.data.val)
    gpu = check_gpu(config)
    checks += [check_shm(config, workers, ranks, sample), gpu]
    checks += check_ulimits(gpu.status == "PASS" and "visible" in gpu.detail)
    checks += [
        check_cpus(config, workers, reason, ranks),
        train_check,
        val_check,
        check_disk(config),
    ]
    return checks


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status != "PASS":
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.doctor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from train.config import ConfigError, add_overrides_argument, load_config

    parser.add_argument("--config", required=True, help="scenario YAML, as for python -m train")
    add_overrides_argument(parser)
    args = parser.parse_args(argv)

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    checks = run_checks(config)
    print(render(checks))
    failed = [c.name for c in checks if c.status == "FAIL"]
    print(
        f"doctor: {len(failed)} FAIL, {sum(c.status == 'WARN' for c in checks)} WARN"
        + (f" ({', '.join(failed)})" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
