"""How many CPUs this process may use, and how many loader workers that makes (framework-free;
every entry point resolves the count through train.data.resolve, which calls
``resolve_num_workers``)."""

from __future__ import annotations

import os
from pathlib import Path

# Past 8 loader workers per rank, workers rarely help one device: the rule of thumb's cap, and
# the most that the tuners (train.tune, loader.autotune) try on a host without slow storage.
MAX_USEFUL_WORKERS = 8


def resolve_num_workers(
    value: int | str, cpu_count: int | None = None, local_world_size: int = 1
) -> tuple[int, str]:
    """Turn loader.num_workers into a count, with the reason to log.

    'auto' follows the rule of thumb min(8, 0.75 x cores): leave a quarter of the cores to the
    main process (and the GPU driver), and stop at 8, past which workers rarely help one GPU.
    With several ranks on one node, each rank gets its share of the cores.
    """
    if value != "auto":
        return int(value), f"set in config: {value}"
    cores = cpu_count if cpu_count is not None else usable_cores()
    ranks = max(1, local_world_size)
    workers = min(MAX_USEFUL_WORKERS, max(1, int(0.75 * cores / ranks)))
    share = f"{cores} cores" if ranks == 1 else f"{cores} cores / {ranks} ranks"
    return workers, f"auto: min({MAX_USEFUL_WORKERS}, 0.75 x {share}) = {workers}"


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota if any."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        cores = os.cpu_count() or 1
    try:  # containers and Kubernetes limit CPU by quota, which the affinity mask does not show
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, round(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores
