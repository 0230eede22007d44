"""Preflight doctor: is this machine ready for this config? One line per check, with the fix.

    python -m train.doctor --config configs/resnet50/single_gpu.yaml [--set key=value ...]
        [--output-dir DIR] [--resume | --auto-resume | --overwrite] [--run-dir RUN]
    python -m train.doctor --run-dir runs/ocr-paddle-smoke

Checks /dev/shm against the config's need; the GPUs (NVML) against what the framework build can
use (compute capability, CUDA build, a tiny op on each kind of GPU, asked in a subprocess so this
process imports no framework); ulimits; CPU count against num_workers; the datasets (readable,
valid, a sample decodes); that the run directory and the caches the config uses are writable
(a file is really created and removed there); and disk space for checkpoints in the run
directory. --output-dir and the resume flags mean what they mean for `python -m train`, so a
launcher can pass the training command's arguments through unchanged. --run-dir adds a finished
run's data wait (its summary.json) against train.stall_warn_fraction, with the loader tuner's
command as the fix; without --config it checks that run's own config (config.resolved.yaml) and
directory.
Exit 1 when any check FAILs, 0 otherwise (WARN does not fail); 2 for a bad config. The container
entrypoint runs it.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
from pathlib import Path

# The path probes are in train/paths.py; the GPU checks in train/backends/gpu_verdicts.py, on
# the facts that train/backends/gpu_probe.py gathers.
from train import preflight, tasks
from train.backends.gpu_verdicts import check_gpu
from train.check import Check
from train.paths import (
    RUN_AS_OWNER,
    WriteProbe,
    denial,
    first_unreadable,
    first_unwritable,
    nearest_existing,
    probe_writable,
    read_fix,
    strerror,
    write_fix,
)


def check_shm(config, ranks: int, sample) -> Check:
    plan = preflight.plan(config, ranks, sample)
    stale = preflight.stale_batches()
    free = preflight.shm_free_bytes() + stale.bytes  # training removes them before it starts
    detail = f"need {plan.describe()}; free {free / 2**20:.0f} MiB"
    if stale.paths:
        detail += (
            f" (counting {stale.bytes / 2**20:.0f} MiB in {len(stale.paths)} file(s) that dead "
            "processes left: Paddle batch files, batch rings, memory caches; training removes "
            "them at start)"
        )
    if plan.need_bytes <= free:
        return Check("/dev/shm", "PASS", detail)
    status = "WARN" if config.shm.policy == "adapt" else "FAIL"
    note = " (shm.policy=adapt will lower prefetch/workers, slower)" if status == "WARN" else ""
    return Check("/dev/shm", status, detail + note, preflight.SHM_FIX)


# ---------------------------------------------------------------- run directory and caches
def write_failure(name: str, probe: WriteProbe, elsewhere: str) -> Check:
    return Check(name, "FAIL", probe.problem, write_fix(probe, elsewhere))


# Directories and files inside a run directory that training writes into again on --resume.
_RUN_SUBDIRS = ("checkpoints", "scalars", "plots")
_RUN_FILES = (
    "train.log",
    "metrics.jsonl",
    "summary.json",
    "bad_samples.train.tsv",
    "bad_samples.val.tsv",
)


def check_output_dir(run_dir: Path, resume: str | None = None) -> tuple[Check, WriteProbe]:
    """The run directory, as python -m train derives it (--output-dir, else output.dir): one
    training would take (train/run_dirs.py: new, empty or a run directory) and can write."""
    from train import run_dirs
    from train.config.errors import ConfigError

    name = "output dir"
    try:
        run_dirs.check(str(run_dir), overwrite=resume == "overwrite")
    except ConfigError as error:
        return Check(name, "FAIL", error.problem, error.hint), WriteProbe(Path(run_dir))
    probe = probe_writable(run_dir)
    if not probe.ok:
        return write_failure(name, probe, "--output-dir somewhere writable"), probe
    # A run directory left by another user (an earlier run as root) is writable itself but its
    # checkpoints/ and logs may not be: training would die at its first checkpoint, hours in.
    blocked = first_unwritable(
        [probe.path / sub for sub in _RUN_SUBDIRS], [probe.path / f for f in _RUN_FILES]
    )
    if blocked is not None:
        detail = f"{probe.path}: {denial('write', *blocked)}; an earlier run by another user?"
        fix = (
            f"{RUN_AS_OWNER}, or chown -R {os.getuid()}:{os.getgid()} {probe.path}, or "
            "--output-dir for a new run"
        )
        return Check(name, "FAIL", detail, fix), probe
    from train import checkpoint

    detail = f"{probe.path}: writable"
    detail += (
        " (a test file was created and removed)"
        if probe.existed
        else " (missing: training creates it; a test directory and file were created and removed)"
    )
    latest = checkpoint.latest(probe.path) if probe.existed else None
    if resume == "resume" and latest is None:
        fix = "drop --resume for a new run, or use --auto-resume"
        return Check(name, "FAIL", f"{detail}; --resume but it holds no checkpoint", fix), probe
    if latest is not None:
        detail += f"; holds a run (latest {latest.name})"
        if resume is None:
            detail += ": python -m train needs --resume, --auto-resume or --overwrite"
    return Check(name, "PASS", detail), probe


def _check_disk_cache(data) -> Check:
    name = "data.cache_dir"
    probe = probe_writable(data.cache_dir)
    if not probe.ok:
        elsewhere = "set data.cache_dir to a writable directory (or data.cache: none)"
        return write_failure(name, probe, elsewhere)
    detail = (
        f"{probe.path}: writable, {probe.free_bytes / 2**30:.1f} GiB free; "
        f"data.cache_max_bytes {data.cache_max_bytes / 2**30:.1f} GiB"
    )
    if probe.free_bytes < data.cache_max_bytes:
        fix = (
            "the disk cache is a sparse memory-mapped file: filling it on a full disk "
            "kills the readers with SIGBUS; lower data.cache_max_bytes, free space, or "
            "move data.cache_dir"
        )
        return Check(name, "WARN", detail, fix)
    return Check(name, "PASS", detail)


def _check_remote_cache(data) -> Check:
    name = "data.remote_cache_dir"
    probe = probe_writable(data.remote_cache_dir)
    if not probe.ok:
        return write_failure(name, probe, "set data.remote_cache_dir to a writable directory")
    limit = data.remote_cache_max_bytes
    detail = (
        f"{probe.path}: writable, {probe.free_bytes / 2**30:.1f} GiB free for staging "
        f"s3:// data (data.remote_cache_max_bytes "
        f"{'none' if limit is None else f'{limit / 2**30:.1f} GiB'})"
    )
    return Check(name, "PASS", detail)


def check_cache_dirs(config) -> list[Check]:
    """The caches the config uses, and only those: data.cache_dir (data.cache: disk) and
    data.remote_cache_dir (an s3:// source)."""
    from datasets import remote

    data = config.data
    checks = []
    if data.cache == "disk":
        checks.append(_check_disk_cache(data))
    own_files = [getattr(data, name) for name in tasks.get(config.task).input_files]
    sources = (data.train, data.val, data.skip_keys_file, *own_files)
    if any(path and remote.is_remote(path) for path in sources):
        checks.append(_check_remote_cache(data))
    return checks


# ---------------------------------------------------------------- datasets
def _dataset_failure(config, split: str, path: str, exc: Exception) -> Check:
    """Why the dataset could not be opened: a path this user may not read, else the error."""
    name = f"data.{split}"
    inputs = [getattr(config.data, name) for name in tasks.get(config.task).input_files]
    needed = [path, *(file for file in inputs if file)]
    denied = first_unreadable(needed)
    if denied is not None:
        where, action, error = denied
        detail = f"{path}: {denial(action, where, error)}"
        fix = read_fix(where, action, f"point data.{split} at a readable copy")
        return Check(name, "FAIL", detail, fix)
    if isinstance(exc, OSError):
        detail = f"{path}: cannot read {exc.filename or path}: {strerror(exc)}"
        return Check(name, "FAIL", detail, "check the path and its volume mount")
    fix = "scripts/validate_data.py PATH shows every bad record"
    hint = getattr(exc, "hint", "")  # a DatasetError's own fix, when it names one
    return Check(name, "FAIL", str(exc).split(". HINT")[0], f"{hint}; {fix}" if hint else fix)


def check_dataset(config, split: str, path: str | None):
    """Open the dataset like training does, decode one sample (returns it for shm sizing) and
    check its classes against the model's, as train/data.py does at the start of a run."""
    from datasets import remote
    from datasets.errors import BadSampleError, DatasetError
    from train.data import check_class_count, open_split

    name = f"data.{split}"
    if path is None:
        return Check(name, "PASS", "not set"), None
    if remote.is_remote(path):
        return Check(name, "PASS", f"{path}: remote, staged at start"), None
    task = tasks.get(config.task)
    try:
        # As the run opens it (train.data.open_split), without filling a cache for one sample.
        dataset = open_split(config, split, path, cache="none")
        try:
            sample = dataset[0]
            count = len(dataset)
            if split == "train":
                task.num_classes(config.model, dataset)
            if task.loss == "cross_entropy":
                check_class_count(config.model, dataset, path)
        finally:
            dataset.close()
    except (DatasetError, BadSampleError, OSError) as exc:
        return _dataset_failure(config, split, path, exc), None
    if count < config.loader.batch_size and split == "train":
        detail = f"{count} samples < batch_size {config.loader.batch_size}"
        return Check(name, "FAIL", detail, "lower loader.batch_size"), sample
    return Check(name, "PASS", f"{path}: {count} samples, first decodes"), sample


# ---------------------------------------------------------------- host
def check_ulimits(gpus: bool) -> list[Check]:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    enough = soft >= 4096
    more_files = (
        "raise it (compose ulimits nofile: 65536); workers and shared-memory batches each hold "
        "descriptors"
    )
    memlock, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = memlock == resource.RLIM_INFINITY
    fine = unlimited or not gpus
    lock_more = "set memlock: -1 (compose ulimits) for pinned memory and RDMA/NCCL"
    shown = "unlimited" if unlimited else f"{memlock} bytes"
    return [
        Check(
            "ulimit nofile",
            "PASS" if enough else "WARN",
            f"soft limit {soft}",
            "" if enough else more_files,
        ),
        Check("ulimit memlock", "PASS" if fine else "WARN", shown, "" if fine else lock_more),
    ]


def check_cpus(config, reason: str, ranks: int) -> Check:
    from train.cpus import usable_cores

    cores, workers = usable_cores(), config.loader.num_workers
    detail = f"{cores} usable cores; num_workers={workers} per rank x {ranks} rank(s) ({reason})"
    if workers * ranks > cores:
        fix = "more workers than cores oversubscribe the CPU; use num_workers: auto"
    elif workers == 0 and cores >= 4:
        fix = "decode runs in the training process; set loader.num_workers: auto"
    else:
        return Check("CPU vs workers", "PASS", detail)
    return Check("CPU vs workers", "WARN", detail, fix)


def check_disk(config, run_dir: Path, free: int | None = None) -> Check:
    """Space for checkpoints in the run directory (its volume: the nearest existing directory
    when it is missing or could not be probed)."""
    run_dir = Path(os.path.abspath(run_dir))
    where = run_dir if free is not None else nearest_existing(run_dir)
    if free is None:
        try:
            free = shutil.disk_usage(where).free
        except OSError as exc:
            return Check("disk for checkpoints", "WARN", f"{where}: {strerror(exc)}")
    params = tasks.get(config.task).model(config.model.name).parameters
    # weights + two optimizer moments, float32, for each kept checkpoint plus one being written
    need = int(params * 4 * 3 * (config.train.keep_last + 1))
    detail = f"{free / 2**30:.1f} GiB free at {where}; checkpoints need ~{need / 2**30:.2f} GiB"
    if free < need:
        fix = "free space, lower train.keep_last, or --output-dir (output.dir) on a larger volume"
        return Check("disk for checkpoints", "FAIL", detail, fix)
    return Check("disk for checkpoints", "PASS" if free > 2 * need else "WARN", detail)


def check_run_summary(run_dir: Path, config, tune: str) -> Check:
    """A finished run's data wait (summary.json) against train.stall_warn_fraction; ``tune``
    is the tuner's command for the config checked, used when the summary has none."""
    import json

    from train.stall import BOTTLENECK_FRACTION

    name = "last run's data wait"
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
        fraction = float(summary["data_wait_fraction"])
    except FileNotFoundError:
        detail = f"{path}: missing (the run has not finished, or ended with an error)"
        return Check(name, "WARN", detail, "--run-dir a directory of a finished run")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        detail = f"{path}: no data_wait_fraction to read ({type(exc).__name__}: {exc})"
        return Check(name, "WARN", detail)
    limit = config.train.stall_warn_fraction
    detail = (
        f"{run_dir}: the steps waited on data {fraction:.0%} of the time "
        f"(train.stall_warn_fraction {limit:.0%})"
    )
    if fraction <= limit:
        return Check(name, "PASS", detail)
    # The run's own sentence and command (its scenario and --set items) when it wrote them;
    # runs from before they existed, or below the summary's own threshold, get this config's.
    if fraction > BOTTLENECK_FRACTION and summary.get("loader_bottleneck"):
        detail += f"; {summary['loader_bottleneck']}"
    fix = f"{summary.get('loader_tune') or tune} (finds loader settings for this host)"
    return Check(name, "WARN", detail, fix)


def run_checks(
    config,
    output_dir: str | None = None,
    resume: str | None = None,
    run_dir: str | None = None,
    tune: str = "",
) -> list[Check]:
    """All checks; ``output_dir`` is --output-dir (None: output.dir), ``resume`` the resume
    flag given (resume, auto_resume, overwrite or None), ``run_dir`` a finished run to read
    (--run-dir) and ``tune`` the tuner's command for this config."""
    from train.backends import launcher_dist
    from train.data import resolve

    finished = run_dir  # --run-dir; run_dir below is the directory a new run would write
    ranks = launcher_dist(config.framework).local_world_size
    resolved = resolve(config, local_world_size=ranks, stage=None)  # remote data: check_remote
    config, reason = resolved.config, resolved.workers_reason
    checks = []
    train_check, sample = check_dataset(config, "train", config.data.train)
    val_check, _ = check_dataset(config, "val", config.data.val)
    gpu = check_gpu(config)
    uses_gpu = config.train.device != "cpu" and any(
        c.name == "GPU" and c.status == "PASS" for c in gpu
    )
    checks += [check_shm(config, ranks, sample), *gpu]
    checks += check_ulimits(uses_gpu)
    run_dir = Path(output_dir or config.output.dir)  # as python -m train derives it
    output_check, probe = check_output_dir(run_dir, resume)
    checks += [
        check_cpus(config, reason, ranks),
        train_check,
        val_check,
        *check_cache_dirs(config),
        output_check,
        check_disk(config, run_dir, probe.free_bytes),
    ]
    if finished is not None:
        checks.append(check_run_summary(Path(finished), config, tune))
    return checks


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status != "PASS":
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from train.config.load import add_overrides_argument

    parser = argparse.ArgumentParser(
        prog="python -m train.doctor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        help="scenario YAML, as for python -m train (default with --run-dir: that run's "
        "config.resolved.yaml)",
    )
    add_overrides_argument(parser)
    parser.add_argument(
        "--output-dir",
        help="run directory, as for python -m train (default: output.dir of the config)",
    )
    parser.add_argument(
        "--run-dir",
        help="a finished run's directory: warn when its data wait (summary.json) was above "
        "train.stall_warn_fraction",
    )
    group = parser.add_mutually_exclusive_group()
    for flag in ("--resume", "--auto-resume", "--overwrite"):
        group.add_argument(
            flag,
            dest="resume",
            action="store_const",
            const=flag[2:].replace("-", "_"),
            help=f"as for python -m train ({flag} is checked against the run directory)"
            if flag == "--resume"
            else "as for python -m train",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    from train.cli import failure_exit_code
    from train.config.errors import ConfigError
    from train.config.load import RESOLVED_NAME, load_config
    from train.stall import tune_command

    parser = _parser()
    args = parser.parse_args(argv)
    if args.config is None and args.run_dir is None:
        parser.error("--config is required (or --run-dir, to check a finished run)")
    config_path, output_dir = args.config, args.output_dir
    if config_path is None:  # the run's own config, and its directory
        config_path = str(Path(args.run_dir) / RESOLVED_NAME)
        output_dir = output_dir or args.run_dir
    try:
        config = load_config(config_path, args.overrides)
    except ConfigError as exc:
        return failure_exit_code(exc)  # printed in one line, exit 2
    tune = tune_command(config_path, args.overrides)
    checks = run_checks(config, output_dir, args.resume, args.run_dir, tune)
    print(render(checks))
    failed = [c.name for c in checks if c.status == "FAIL"]
    print(
        f"doctor: {len(failed)} FAIL, {sum(c.status == 'WARN' for c in checks)} WARN"
        + (f" ({', '.join(failed)})" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
