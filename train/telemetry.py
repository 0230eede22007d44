"""Where the time goes: reader cost, batch cost, samples/s, data-wait share, bad samples, GPU.

Timing model: the trainer alternates between waiting for the next batch (reader cost: the time
blocked in the loader, including the host-to-device copy) and computing. Over a logging window,
data-wait share = sum(reader cost) / wall time. A wait inside the loader's ``next`` for the
device to catch up (``waiting_for_device``: the batch ring reusing a pinned buffer whose copy the
device has not run yet) is the device holding the host back, not the loader: it is left out of
the reader cost and reported as the device-wait share. Device work is asynchronous, so single
steps are not timed; the window ends at a synchronizing point (the loss read-out), which makes
the window sums honest. Only rank 0 logs and writes files. Over the same windows rank 0 samples
the CPU use that tells why the loader held the trainer (train/stall.py: the run summary's
sentence).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from datasets.safe_files import open_append
from train import run_files, stall
from train.device_wait import DEVICE_WAITS

log = logging.getLogger("train")


STALL_WINDOWS = 3  # consecutive high-wait windows before the warning


class _FetchTimer:
    """One batch fetch, from its start: its data wait (wall and this thread's CPU) is the time
    it took less the device wait inside it."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()
        self.device_wall, self.device_cpu = DEVICE_WAITS.wall_s, DEVICE_WAITS.cpu_s

    def add_to(self, window: dict) -> None:
        device_wall = DEVICE_WAITS.wall_s - self.device_wall
        device_cpu = DEVICE_WAITS.cpu_s - self.device_cpu
        window["device_wait_s"] += device_wall
        window["wait_s"] += time.perf_counter() - self.wall - device_wall
        window["wait_cpu_s"] += time.thread_time() - self.cpu - device_cpu


class GpuMonitor:
    """Utilization and memory of this process's GPU through NVML, when nvidia-ml-py and a GPU
    are both present. ``cuda_index`` is the CUDA ordinal the backend trains on
    (Backend.device_index); None (training on the CPU): no GPU columns at all.

    NVML numbers GPUs physically, CUDA relative to CUDA_VISIBLE_DEVICES: see nvml_target. A
    query NVML refuses (NotSupported: utilization on a MIG slice; a GPU fallen off the bus) is
    logged once and reported as null; telemetry never ends a run.
    """

    def __init__(self, cuda_index: int | None) -> None:
        self._nvml = None
        self._handle = None
        self._failed: set[str] = set()  # queries that raised, logged once each
        if cuda_index is None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no library, no driver: GPU columns stay empty
            return
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            self._handle = _nvml_handle(pynvml, nvml_target(cuda_index, visible))
        except Exception as error:  # pynvml.NVMLError and friends
            log.warning(
                "NVML: no handle for CUDA device %d (CUDA_VISIBLE_DEVICES=%s): %s; GPU "
                "utilization and memory are reported as null",
                cuda_index,
                visible,
                error,
            )
        self._nvml = pynvml

    def sample(self) -> dict[str, float | None]:
        if self._nvml is None:
            return {}
        nvml, handle = self._nvml, self._handle
        return {
            "gpu_util": self._query(
                "utilization", lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            ),
            "gpu_mem_gb": self._query(
                "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used / 1e9
            ),
        }

    def _query(self, what: str, read) -> float | None:
        if self._handle is None:
            return None
        try:
            return read()
        except Exception as error:  # NVMLError_NotSupported on MIG, NVMLError_GpuIsLost, ...
            if what not in self._failed:
                self._failed.add(what)
                log.warning(
                    "NVML cannot read the GPU's %s (%s: %s); reported as null, training goes on",
                    what,
                    type(error).__name__,
                    error,
                )
            return None


def nvml_target(cuda_index: int, visible: str | None) -> int | str:
    """What NVML calls CUDA device ``cuda_index``: a physical index, or the UUID (or UUID prefix)
    that CUDA_VISIBLE_DEVICES (``visible``) lists at that position; unset, the same index. (CUDA
    counts fastest first, NVML by PCI bus: the same order on a node of identical GPUs; with mixed
    GPUs set CUDA_DEVICE_ORDER=PCI_BUS_ID.)"""
    if visible is None:
        return cuda_index
    entries = [entry.strip() for entry in visible.split(",")]
    if cuda_index >= len(entries) or not entries[cuda_index]:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} has no entry {cuda_index}")
    entry = entries[cuda_index]
    return int(entry) if entry.isdigit() else entry


def _nvml_handle(nvml, target: int | str):
    if isinstance(target, int):
        return nvml.nvmlDeviceGetHandleByIndex(target)
    try:  # a full GPU- or MIG- UUID
        return nvml.nvmlDeviceGetHandleByUUID(target)
    except Exception:  # CUDA also accepts a unique prefix of one
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            if (uuid.decode() if isinstance(uuid, bytes) else str(uuid)).startswith(target):
                return handle
        raise


class Telemetry:
    def __init__(
        self,
        run_dir: Path,
        is_main: bool,
        global_batch: int,
        gpu_index: int | None,
        knobs: str,
        stall_warn_fraction: float,
        scalars=None,
        num_workers: int | None = None,
        local_ranks: int = 1,
    ) -> None:
        """``gpu_index``: the CUDA ordinal the backend trains on (Backend.device_index), None on
        the CPU; ``scalars``: the backend's scalar log (Backend.scalar_writer), or None;
        ``num_workers`` (resolved) and ``local_ranks`` (training processes on this node) for
        the loader's diagnosis (None: no diagnosis)."""
        self.is_main = is_main
        self.stall_warn_fraction = stall_warn_fraction  # train.stall_warn_fraction
        self.global_batch = global_batch
        self.knobs = knobs  # the loader settings in effect, quoted in the stall warning
        self.history: list[dict] = []
        # Held open for the whole run (closed in close()), one unbuffered write per record, so
        # that a write that fails (disk full) is cut back to whole lines (run_files.append).
        # Opened by open_append: a link planted at metrics.jsonl is refused, not followed.
        self._jsonl_path = run_dir / "metrics.jsonl"
        self._jsonl = open_append(self._jsonl_path) if is_main else None
        self._scalars = scalars
        self._scalars_dir = run_dir / "scalars"
        self._gpu = GpuMonitor(gpu_index if is_main else None)  # only rank 0 records it
        self._bar = None
        self.total_steps: int | None = None  # start_progress sets it
        self._stall_windows = 0
        self.totals = {
            "wait_s": 0.0,
            "device_wait_s": 0.0,
            "wall_s": 0.0,
            "samples": 0,
            "steps": 0,
            "wait_cpu_s": 0.0,
        }
        self.num_workers, self.local_ranks = num_workers, local_ranks
        # CPU use from the first window's start to the last window's end: the totals' span.
        self._measure_cpu = is_main and num_workers is not None
        self._cpu_first = stall.sample_cpu() if self._measure_cpu else None
        self._cpu_last: stall.CpuSample | None = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._window = {
            "wait_s": 0.0,
            "device_wait_s": 0.0,
            "wait_cpu_s": 0.0,
            "steps": 0,
            "start": time.perf_counter(),
        }

    def start_progress(self, total_steps: int, done: int) -> None:
        """The run's step count (for the ETA) and, on a terminal, the tqdm bar (its own ETA
        is the time after "<")."""
        self.total_steps = total_steps
        if self.is_main and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=done, unit="step", dynamic_ncols=True)

    def timed(self, batches):
        """Yield from ``batches``, adding the time blocked in each ``next`` to the window, and
        this thread's CPU time in it (busy receiving a batch, or idle waiting for one); the
        part of it spent ``waiting_for_device`` goes to the window's device wait instead."""
        iterator = iter(batches)
        while True:
            fetch = _FetchTimer()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            fetch.add_to(self._window)
            yield batch

    def step_done(self, step: int) -> None:
        self._window["steps"] += 1
        if self._bar is not None:
            self._bar.update(1)

    def log_window(self, step: int, epoch: int, loss: float, lr: float, bad: int) -> dict:
        """Close the logging window (the caller has just synchronized by reading the loss)."""
        now = time.perf_counter()
        wall = max(now - self._window["start"], 1e-9)
        steps = max(self._window["steps"], 1)
        record = {
            "type": "train",
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "lr": lr,
            "samples_per_s": steps * self.global_batch / wall,
            "reader_cost_s": self._window["wait_s"] / steps,
            "batch_cost_s": wall / steps,
            "data_wait_fraction": min(1.0, self._window["wait_s"] / wall),
            "device_wait_fraction": min(1.0, self._window["device_wait_s"] / wall),
            "bad_samples": bad,
            **self._gpu.sample(),
        }
        for key, value in (
            ("wait_s", self._window["wait_s"]),
            ("device_wait_s", self._window["device_wait_s"]),
            ("wait_cpu_s", self._window["wait_cpu_s"]),
            ("wall_s", wall),
            ("samples", steps * self.global_batch),
            ("steps", steps),
        ):
            self.totals[key] += value
        if self.total_steps is not None:
            # Training steps left at the run's mean step time so far (evaluations and
            # checkpoints not included): the log line shows it as eta=H:MM:SS.
            step_time = self.totals["wall_s"] / max(self.totals["steps"], 1)
            record["eta_s"] = float(max(self.total_steps - step, 0) * step_time)
        if self._measure_cpu:
            self._cpu_last = stall.sample_cpu()
        self._reset_window()
        self._check_stall(record)
        self.emit(record)
        return record

    def _check_stall(self, record: dict) -> None:
        high = record["data_wait_fraction"] > self.stall_warn_fraction
        self._stall_windows = self._stall_windows + 1 if high else 0
        if self._stall_windows == STALL_WINDOWS and self.is_main:
            log.warning(
                "data-starved: %.0f%% of step time waiting for data over the last %d windows "
                "(%s). Turn these knobs: raise loader.num_workers (up to the cores you have), "
                "loader.prefetch_factor 2-4, loader.persistent_workers: true, data.cache: memory "
                "for a dataset that fits in RAM; check the storage (scripts/validate_data.py, "
                "local copy of remote data). python -m train.tune --config <this scenario> "
                "measures this host and picks them; the run summary names the bottleneck.",
                100 * record["data_wait_fraction"],
                STALL_WINDOWS,
                self.knobs,
            )

    def loader_use(self) -> stall.LoaderUse | None:
        """What the run's windows measured about the loader (rank 0; None elsewhere)."""
        if not self._measure_cpu:
            return None
        from train.cpus import usable_cores

        return stall.LoaderUse.between(
            self._cpu_first,
            self._cpu_last,
            wall_s=self.totals["wall_s"],
            wait_s=self.totals["wait_s"],
            wait_cpu_s=self.totals["wait_cpu_s"],
            num_workers=self.num_workers,
            usable_cores=usable_cores(),
            ranks=self.local_ranks,
        )

    def emit(self, record: dict) -> None:
        """Write a record to metrics.jsonl, the scalar writer and the log (rank 0 only)."""
        if not self.is_main:
            return
        self.history.append(record)
        run_files.append(self._jsonl, self._jsonl_path, (json.dumps(record) + "\n").encode())
        step = record.get("step", 0)
        # The framework's writer raises the failure of its own writes (a thread's) here.
        with run_files.writing(self._scalars_dir):
            for key, value in record.items():
                if (
                    self._scalars is not None
                    and isinstance(value, float)
                    and key not in ("step", "epoch")
                ):
                    self._scalars.add_scalar(f"{record['type']}/{key}", value, step)
        text = " ".join(_fmt(k, v) for k, v in record.items() if k != "type")
        message = f"[{record['type']}] {text}"
        if self._bar is not None:
            self._bar.write(message)
        else:
            log.info(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            os.close(self._jsonl)
            self._jsonl = None
        if self._scalars is not None:
            scalars, self._scalars = self._scalars, None
            with run_files.writing(self._scalars_dir):
                scalars.close()  # writes what the framework's writer still buffers


def _fmt(key: str, value) -> str:
    if key == "eta_s":
        minutes, seconds = divmod(round(value), 60)
        return f"eta={minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
    if isinstance(value, float):
        return f"{key}={value:.4g}"
    return f"{key}={value}"


def loader_knobs(loader_cfg) -> str:
    """The loader's settings, as the stall warning quotes them."""
    return (
        f"workers={loader_cfg.num_workers} prefetch={loader_cfg.prefetch_factor} "
        f"persistent={loader_cfg.persistent_workers} batch={loader_cfg.batch_size}"
    )


def run_telemetry(config, backend, dist, run_dir: Path) -> Telemetry:
    """The run's Telemetry: rank 0 writes; the knobs line names the loader's settings."""
    loader_cfg = config.loader
    return Telemetry(
        run_dir,
        dist.is_main,
        loader_cfg.batch_size * dist.world_size,
        backend.runtime.device_index,  # the GPU NVML reports on (None on the CPU)
        loader_knobs(loader_cfg),
        config.train.stall_warn_fraction,
        backend.runtime.scalar_writer(run_dir / "scalars") if dist.is_main else None,
        num_workers=loader_cfg.num_workers,
        local_ranks=dist.local_world_size,
    )
