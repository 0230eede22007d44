"""Benchmark child: runs trials of one pipeline, one JSON spec per stdin line.

  python -m bench.child        (started by bench.runner, never by hand)

Each pipeline lives in its own long-lived child so imports are paid once, a segfault in a peer
(PaddleOCR's LMDBDataSet on PNG records: docs/paddle_png_zlib.md) kills only that child, and the
memory we sample (this process and its loader workers) belongs to one pipeline. Results go to
the file named in the spec, not stdout, which frameworks print warnings into.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import psutil

from bench import handover
from bench.pipelines import BUILDERS, batch_nbytes, image_dtype

MB = 2**20


def shm_used() -> int:
    try:
        return shutil.disk_usage("/dev/shm").used
    except OSError:
        return 0


class MemorySampler:
    """Peak RSS/USS of each loader worker (children of this process) and of /dev/shm use."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.shm_base = shm_used()
        self.shm_peak = 0
        self.rss: dict[int, float] = {}
        self.uss: dict[int, float] = {}
        self.first_uss: dict[int, float] = {}

    def sample(self) -> None:
        self.shm_peak = max(self.shm_peak, shm_used() - self.shm_base)
        for child in self.me.children(recursive=True):
            try:
                info = child.memory_full_info()
            except (psutil.Error, OSError):
                continue  # a worker that just exited
            self.rss[child.pid] = max(self.rss.get(child.pid, 0), info.rss / MB)
            self.uss[child.pid] = max(self.uss.get(child.pid, 0), info.uss / MB)
            self.first_uss.setdefault(child.pid, info.uss / MB)

    def summary(self) -> dict:
        growth = [self.uss[p] - self.first_uss[p] for p in self.uss]
        return {
            "workers_seen": len(self.rss),
            "peak_worker_rss_mb": round(max(self.rss.values(), default=0.0), 1),
            "peak_worker_uss_mb": round(max(self.uss.values(), default=0.0), 1),
            "worker_uss_growth_mb": round(max(growth, default=0.0), 2),
            "main_rss_mb": round(self.me.memory_info().rss / MB, 1),
            "shm_peak_delta_bytes": int(self.shm_peak),
        }


def cpu_seconds(me: psutil.Process) -> float:
    """User + system CPU time of this process, its live loader workers, and the workers it has
    already reaped (psutil's children_* fields)."""
    times = me.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child_times = child.cpu_times()
            total += child_times.user + child_times.system
    return total


def minor_faults(me: psutil.Process) -> int:
    """Minor page faults of this process, the workers it has reaped and its live loader
    workers (/proc/PID/stat's minflt and cminflt; psutil has no field for them). A first touch
    of a fresh page is one: 3.4 us each on the benchmark host, so they show where a pipeline
    spends time the instruction counts (bench/instructions.py) cannot see."""

    def counts(pid: int) -> list[int]:
        with open(f"/proc/{pid}/stat") as stat:  # the fields after "(comm)": state is first
            fields = stat.read().rpartition(")")[2].split()
        return [int(fields[7]), int(fields[8])]

    own, reaped = counts(me.pid)
    total = own + reaped
    for child in me.children(recursive=True):
        with contextlib.suppress(OSError, psutil.Error):
            total += counts(child.pid)[0]
    return total


def run_epoch(pipeline, epoch: int, spec: dict, memory: MemorySampler) -> dict:
    """Iterate up to spec["batches"] batches (None = the whole epoch); time every wait."""
    step_s, limit = spec.get("step_s", 0.0), spec.get("batches")
    # Memory is sampled on a clock, not every N batches: reading a worker's smaps costs ~20 ms
    # of CPU here, in the consuming thread; per batch, that taxed the faster pipeline more
    # (every 4 batches was ~14% of a 2-core host at 900 samples/s).
    sample_every_s = spec.get("memory_every_s", 1.0)
    last_sample = float("-inf")
    start = time.perf_counter()
    iterator = pipeline.epoch(epoch)
    waits, stamps, nbytes, dtype, first = [], [], 0, "", None
    warmup, cpu_at_warmup, faults_at_warmup = spec.get("warmup", 2), None, None
    while limit is None or len(stamps) < limit:
        before = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        now = time.perf_counter()
        waits.append(now - before)
        stamps.append(now)
        if len(stamps) == warmup + 1:  # the stamp the steady window starts at (summarize)
            cpu_at_warmup = cpu_seconds(memory.me)
            faults_at_warmup = minor_faults(memory.me)
        if len(stamps) == 1:
            nbytes, dtype = batch_nbytes(batch), image_dtype(batch)
            first = handover.as_numpy(batch) if spec.get("handover", True) else None
        if sample_every_s and now - last_sample >= sample_every_s:
            memory.sample()
            last_sample = now
        del batch
        if step_s:
            time.sleep(step_s)  # the simulated train step; the loader keeps working meanwhile
    # Read before the iterator goes: its workers' CPU time is still theirs (live children).
    cpu_in_window = None if cpu_at_warmup is None else cpu_seconds(memory.me) - cpu_at_warmup
    faults = None if faults_at_warmup is None else minor_faults(memory.me) - faults_at_warmup
    del iterator  # a non-persistent loader shuts its workers down here
    return {
        "cpu_s": cpu_in_window,
        "faults": faults,
        "start": start,
        "waits": waits,
        "stamps": stamps,
        "bytes": nbytes,
        "dtype": dtype,
        "first": first,
    }


def summarize(epochs: list[dict], spec: dict) -> dict:
    """Steady-state samples/s after ``warmup`` batches of the last epoch, plus cold figures."""
    warmup, batch_size = spec.get("warmup", 2), spec["batch_size"]
    last = epochs[-1]
    stamps, waits = last["stamps"], last["waits"]
    steady = len(stamps) - 1 - warmup
    result = {
        "batches": len(stamps),
        "batch_bytes": epochs[0]["bytes"],
        "image_dtype": epochs[0]["dtype"],
        "first_batch_s": [round(e["stamps"][0] - e["start"], 4) for e in epochs if e["stamps"]],
        "epoch_s": [round(e["stamps"][-1] - e["start"], 4) for e in epochs if e["stamps"]],
    }
    if steady > 0:
        wall = stamps[-1] - stamps[warmup]
        result["samples_per_s"] = round(steady * batch_size / wall, 2)
        # Wait fraction of the steady part: time blocked in next() over wall time.
        result["wait_fraction"] = round(sum(waits[warmup + 1 :]) / wall, 4)
        if last["cpu_s"] is not None:
            # Includes the batches prefetched past the window's end, as it excludes those
            # prefetched before its start: a few batches either way, against tens in it.
            result["cpu_us_per_sample"] = round(last["cpu_s"] / (steady * batch_size) * 1e6, 1)
            result["faults_per_batch"] = round(last["faults"] / steady, 1)
    return result


def run_trial(spec: dict) -> dict:
    memory = MemorySampler()
    built = time.perf_counter()
    pipeline = BUILDERS[spec["pipeline"]](spec)
    build_s = time.perf_counter() - built
    try:
        epochs = [run_epoch(pipeline, e, spec, memory) for e in range(spec.get("epochs", 1))]
        memory.sample()
    finally:
        pipeline.close()
    result = {**summarize(epochs, spec), **memory.summary(), "build_s": round(build_s, 4)}
    return {**result, **handover_figures(pipeline, epochs[0]["first"], spec, result)}


def handover_figures(pipeline, batch, spec: dict, result: dict) -> dict:
    """Copies per batch and the hand-over's share of a worker's time (bench/handover.py),
    measured after the trial on its first batch, so the trial's timing does not include it."""
    if pipeline.handover is None or batch is None:
        return {}
    figures = handover.measure(pipeline.handover, batch)
    if result.get("samples_per_s"):
        figures["handover_share"] = handover.share_of_worker_time(
            figures["handover_ms"], spec["workers"], spec["batch_size"], result["samples_per_s"]
        )
    return figures


def main() -> None:
    for line in sys.stdin:
        spec = json.loads(line)
        try:
            result = {"ok": True, **run_trial(spec)}
        except Exception as exc:  # reported to the parent, which decides what it means
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        tmp = spec["result_file"] + ".tmp"
        Path(tmp).write_text(json.dumps(result))
        os.replace(tmp, spec["result_file"])


if __name__ == "__main__":
    main()
