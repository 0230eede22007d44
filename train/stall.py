"""Why the loader held the trainer, in one sentence, from what the run itself measured.

Telemetry (rank 0) adds up, over the same logging windows as the data-wait share: the wall time,
the time blocked in the loader's ``next`` and the trainer thread's CPU time inside it, and, from
a CPU sample at the first window's start and at each window's end, the CPU seconds of the
trainer process, of its child processes (the loader workers, live and exited) and of the host's
CPUs (busy, and idle with I/O outstanding). ``diagnose`` turns those into the run summary's
``loader_bottleneck`` when the data wait is above BOTTLENECK_FRACTION, and names only what the
figures show: where they fit no single cause it says it could not tell.

The figures are rank 0's (its process tree) and the host's (every process on it); a child
process that is not a loader worker (a compiler's worker pool) counts as one.
"""

from __future__ import annotations

import dataclasses
import shlex

# The run summary explains the data wait above this share of the step time: below it the loader
# costs little that the tuner could win back.
BOTTLENECK_FRACTION = 0.10
# A worker busy this share of the wall time or more is limited by its CPU.
WORKER_BUSY = 0.7
# The cores count as full when this run used this share of its usable cores, or the host this
# share of all of its CPUs (other processes count there too).
CORES_FULL = 0.85
# The trainer's thread busy this share of its wait was receiving batches, not waiting for them.
HANDOVER_BUSY = 0.5
# Host CPUs idle with I/O outstanding, on average over the run, in cores: storage was slow.
IOWAIT_CORES = 0.25


@dataclasses.dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds at one moment."""

    trainer_s: float  # the trainer process, all of its threads
    children_s: float  # its child processes: the live ones, and the exited ones it reaped
    host_busy_s: float  # all of the host's CPUs, busy (not idle, not waiting on I/O)
    host_iowait_s: float  # all of the host's CPUs, idle with I/O outstanding


def process_tree_cpu() -> tuple[float, float]:
    """(this process's CPU seconds, all threads; its child processes', live and reaped).
    Exited children are in children_* once reaped (the loaders join their workers); live ones
    are read one by one. A child that exits between two samples moves from the second sum to
    the first, so the difference of two samples still holds all of its time."""
    import psutil

    me = psutil.Process()
    own = me.cpu_times()
    children = own.children_user + own.children_system
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # exited since the listing: counted once reaped
            continue
        children += times.user + times.system
    return own.user + own.system, children


def host_cpu() -> tuple[float, float]:
    """(all of the host's CPUs' busy seconds, not idle and not waiting on I/O; their seconds
    idle with I/O outstanding)."""
    import psutil

    host = psutil.cpu_times()
    iowait = getattr(host, "iowait", 0.0)
    # Linux counts guest time in user time as well: leave it out so nothing counts twice.
    guest = getattr(host, "guest", 0.0) + getattr(host, "guest_nice", 0.0)
    return sum(host) - host.idle - iowait - guest, iowait


def sample_cpu() -> CpuSample | None:
    """This moment's CpuSample, or None where psutil cannot read it (telemetry never fails)."""
    try:
        trainer, children = process_tree_cpu()
        busy, iowait = host_cpu()
        return CpuSample(
            trainer_s=trainer, children_s=children, host_busy_s=busy, host_iowait_s=iowait
        )
    except Exception:  # no psutil, no /proc: the summary then says it could not tell
        return None


@dataclasses.dataclass(frozen=True)
class LoaderUse:
    """What one run measured about its loader, over its logging windows."""

    wall_s: float
    wait_s: float  # blocked in the loader's next()
    wait_cpu_s: float  # the trainer thread's CPU time inside those next() calls
    num_workers: int
    usable_cores: int  # this process's CPUs (affinity, cgroup quota)
    ranks: int = 1  # training processes on this node, sharing its cores
    host_cpus: int | None = None
    trainer_cpu_s: float | None = None  # None: no CPU samples
    workers_cpu_s: float | None = None
    host_busy_s: float | None = None
    host_iowait_s: float | None = None

    @classmethod
    def between(cls, first: CpuSample | None, last: CpuSample | None, **measured) -> LoaderUse:
        """The use over the span of two samples (either None: no CPU figures)."""
        if first is None or last is None:
            return cls(**measured)
        import psutil

        return cls(
            **measured,
            host_cpus=psutil.cpu_count() or 1,
            trainer_cpu_s=last.trainer_s - first.trainer_s,
            workers_cpu_s=last.children_s - first.children_s,
            host_busy_s=last.host_busy_s - first.host_busy_s,
            host_iowait_s=last.host_iowait_s - first.host_iowait_s,
        )


def diagnose(use: LoaderUse) -> str:
    """One sentence: which bottleneck held the loader, by the run's own figures."""
    wall = max(use.wall_s, 1e-9)
    wait_busy = use.wait_cpu_s / use.wait_s if use.wait_s > 0 else 0.0
    if use.num_workers == 0:
        return (
            "num_workers was 0: the trainer read, decoded and collated every batch itself "
            f"(its thread was busy {wait_busy:.0%} of the wait), with {use.usable_cores} usable "
            "core(s) for workers."
        )
    if use.trainer_cpu_s is None or use.workers_cpu_s is None or use.host_busy_s is None:
        return (
            "could not tell: this run has no CPU figures (psutil could not read the processes), "
            f"only that it waited {use.wait_s / wall:.0%} of the step time with "
            f"{use.num_workers} workers."
        )
    workers = use.num_workers
    worker_busy = use.workers_cpu_s / (wall * workers)
    run_cores = (use.trainer_cpu_s + use.workers_cpu_s) / wall
    share = use.usable_cores / max(use.ranks, 1)  # this rank's part of the node's cores
    host_busy = use.host_busy_s / (wall * (use.host_cpus or 1))
    iowait_cores = (use.host_iowait_s or 0.0) / wall
    used = f"this run used {run_cores:.1f} of {share:.3g} usable cores"
    used += f", the host was {host_busy:.0%} busy"
    plural = "the 1 loader worker was" if workers == 1 else f"the {workers} loader workers were"
    busy = f"{plural} busy {worker_busy:.0%} of the time"
    own_full = run_cores >= CORES_FULL * share
    host_full = host_busy >= CORES_FULL
    if worker_busy >= WORKER_BUSY and (own_full or host_full):
        return f"the loader workers were CPU-bound on a full CPU: {busy} and {used}."
    if own_full:
        return f"the trainer took the cores, not the loader: {busy} while {used}."
    if worker_busy >= WORKER_BUSY:
        return (
            f"the loader workers were CPU-bound with cores to spare: {busy} while {used}, room "
            "for more workers."
        )
    if wait_busy >= HANDOVER_BUSY:
        return (
            f"the hand-over held the trainer, not reading or decoding: {busy}, and the "
            f"trainer's own thread was busy {wait_busy:.0%} of its wait receiving batches "
            "(unpickling, copying, the copy to the device)."
        )
    if iowait_cores >= IOWAIT_CORES:
        return (
            f"storage held the loader: {busy}, the trainer sat idle in its wait, and the host's "
            f"CPUs spent {iowait_cores:.2f} cores on average waiting on I/O."
        )
    if host_full:
        # Low CPU time is what a worker kept off the CPU by other processes shows, and what a
        # worker waiting on storage or the hand-over shows: the figures cannot tell them apart.
        return (
            f"could not tell: {busy} and the trainer sat idle in its wait, but the host was "
            f"{host_busy:.0%} busy (this run used {run_cores:.1f} of {share:.3g} usable cores), "
            "which may have kept the workers off the CPU; waiting on storage or on the "
            "hand-over looks the same in these figures."
        )
    return (
        f"could not tell: {busy}, the trainer sat idle in its wait and the host showed "
        f"{iowait_cores:.2f} cores of I/O wait (storage that shows no I/O wait, such as a "
        "network file system, and a slow hand-over queue both look like this)."
    )


def tune_command(config_path: str, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The loader tuner's command for a run's scenario and its --set items."""
    words = ["python", "-m", "train.tune", "--config", str(config_path)]
    for item in overrides:
        words += ["--set", item]
    return shlex.join(words)


def summary_keys(data_wait_fraction: float, use: LoaderUse | None) -> dict[str, str]:
    """The run summary's loader_bottleneck, when the data wait is worth explaining."""
    if use is None or data_wait_fraction <= BOTTLENECK_FRACTION:
        return {}
    return {"loader_bottleneck": diagnose(use)}
