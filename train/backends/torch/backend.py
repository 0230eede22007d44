"""PyTorch implementation of the training-loop contract in train/backends/base.py.

The loop (train/loop.py) drives it; nothing here knows about epochs or logging cadence. Run a
config with it:  .venv-torch/bin/python -m train --config configs/resnet50/smoke.yaml
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import shutil
import sysconfig
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from train import weights
from train.backends import common
from train.backends.base import Backend, DeviceUnavailableError, DistInfo
from train.backends.torch.data import make_loader
from train.backends.torch.models import HEADS, build_model, memory_format
from train.checkpoint import refuse_pickle
from train.cpus import usable_cores
from train.errors import RunError
from train.gpu_probe import FrameworkCuda
from train.schedule import lr_factor, weight_decay_groups

log = logging.getLogger(__name__)

# One file per part, so a reader can tell which part of a checkpoint is broken or missing.
STATE_FILES = ("model", "optimizer", "scheduler", "scaler", "rng")


class TorchBackend(Backend):
    out_of_memory_errors = (torch.cuda.OutOfMemoryError, MemoryError)
    name = "torch"

    def __init__(self, task: str, train) -> None:
        super().__init__(task, train)
        self.device = torch.device("cpu")  # until init_distributed picks one
        self.dist = DistInfo()
        self.model: nn.Module | None = None  # what train_step calls (DDP-wrapped when > 1 rank)
        self.net: nn.Module | None = None  # the bare model: predict, checkpoints, counting
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: LambdaLR | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.amp_dtype: torch.dtype | None = None
        self._training_mode: bool | None = None
        self._stats: tuple[torch.Tensor, torch.Tensor] | None = None  # pixel scale, shift
        self._model_spec = None  # train/tasks.py's Model once built: its pixel contract
        self._layout = torch.contiguous_format  # the batches' (and weights') memory format
        self._rank_rng_states: list[dict[str, Any]] | None = None  # gathered by prepare_save
        self._head = HEADS[self.task.loss]  # the loss and decoding of the task's loss kind
        self._steps_table: torch.Tensor | None = None  # (loss, nonfinite) per step, on device
        self._steps_recorded = 0  # its rows since the last read_steps()

    # --- process ---------------------------------------------------------------------------
    def init_distributed(self) -> DistInfo:
        env = os.environ
        world_size = int(env.get("WORLD_SIZE", "1"))
        self.dist = DistInfo(
            rank=int(env.get("RANK", "0")),
            world_size=world_size,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world_size))),
        )
        self.device = self._pick_device()
        _allow_tf32()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if world_size > 1 and not dist.is_initialized():
            cuda = self.device.type == "cuda"
            dist.init_process_group(
                backend="nccl" if cuda else "gloo",
                rank=self.dist.rank,
                world_size=world_size,
                # The rendezvous, NCCL's setup and every collective (NCCL's default: 10 min).
                timeout=timedelta(seconds=self.train.dist_timeout_s),
                # Binds NCCL to this rank's GPU up front, so collectives never guess the device.
                device_id=self.device if cuda else None,
            )
        return self.dist

    def _pick_device(self) -> torch.device:
        if not common.choose_gpu(self.train.device, cuda_facts()):
            return torch.device("cpu")
        count = torch.cuda.device_count()
        if self.dist.local_rank >= count:
            raise DeviceUnavailableError(
                f"LOCAL_RANK {self.dist.local_rank} but only {count} GPU(s) are visible",
                "start at most one process per GPU (torchrun --nproc-per-node)",
            )
        return torch.device("cuda", self.dist.local_rank)

    @property
    def device_index(self) -> int | None:
        return self.device.index if self.device.type == "cuda" else None

    @property
    def device_name(self) -> str:
        if self.device.type != "cuda":
            return "cpu"
        return f"cuda:{self.device.index} ({torch.cuda.get_device_name(self.device)})"

    def is_out_of_memory(self, exc: BaseException) -> bool:
        # On the CPU torch reports a failed allocation as a plain RuntimeError from c10's
        # alloc_cpu ("DefaultCPUAllocator: can't allocate memory: you tried to allocate ...").
        return super().is_out_of_memory(exc) or (
            isinstance(exc, RuntimeError) and "DefaultCPUAllocator" in str(exc)
        )

    def allocate_bytes(self, count: int) -> torch.Tensor:
        return torch.empty(count, dtype=torch.uint8, device=self.device)

    def seed_framework(self, seed: int, deterministic: bool) -> None:
        torch.manual_seed(seed)  # CPU and every CUDA device
        if deterministic:
            # cuBLAS needs a fixed workspace for reproducible GEMMs; read at its first use.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # CTC loss, NLL loss and adaptive average pooling have no deterministic CUDA backward,
        # so on a GPU those only warn instead of stopping the run. On a CPU every op used here
        # is deterministic, and a new one that is not should fail loudly.
        torch.use_deterministic_algorithms(deterministic, warn_only=self.device.type == "cuda")
        torch.backends.cudnn.deterministic = deterministic
        # Input shapes are fixed, so cuDNN's one-off autotuning pays for itself, but it may pick
        # a different (equally correct) kernel in each run.
        torch.backends.cudnn.benchmark = not deterministic

    def set_cpu_threads(self, num_workers: int) -> None:
        # Training on the CPU, the main process's intra-op pool and the loader workers share
        # the cores: torch's default (one thread per core) would oversubscribe them, and workers
        # starved of CPU make every step wait for data. So give this rank its share of the
        # cores minus one per worker, and never fewer than one thread.
        if self.device.type != "cpu":
            return
        cores = max(1, usable_cores() // max(1, self.dist.local_world_size))
        threads = max(1, cores - num_workers)
        torch.set_num_threads(threads)
        log.info("torch threads: %d (%d cores - %d loader workers)", threads, cores, num_workers)

    # --- data ------------------------------------------------------------------------------
    def make_loader(self, dataset, sampler, loader_config, train: bool) -> Any:
        loader = make_loader(
            dataset,
            sampler,
            common.LoaderKnobs.of(loader_config, train),
            pin_memory=loader_config.pin_memory and self.device.type == "cuda",
            seed=self.seed,
            batch_ring=loader_config.batch_ring,
        )
        loader.device_prefetch = loader_config.device_prefetch  # read by device_batches
        return loader

    def device_batches(self, loader) -> Iterator[dict[str, Any]]:
        if self.device.type == "cuda" and getattr(loader, "device_prefetch", True):
            return self._cuda_prefetch(loader)
        return (self._to_device(batch) for batch in loader)

    def _to_device(self, host_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy (asynchronously when the host memory is pinned) and normalize on the device."""
        batch = {key: value.to(self.device, non_blocking=True) for key, value in host_batch.items()}
        batch["image"] = self._normalize(batch["image"])
        return batch

    def _normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [N,H,W,C] -> float32 [N,C,H,W] on the device, normalized with the task's
        per-channel scale and shift (train/tasks.py) in one multiply-add, in the memory format
        of the model's weights (models.memory_format: channels_last only for the families
        that use it on CUDA)."""
        # permute() is a view: NHWC memory seen as NCHW is exactly the channels_last layout,
        # so for channels_last models no copy happens.
        images = images.permute(0, 3, 1, 2).float()
        scale, shift = self._pixel_constants()
        images = images.mul_(scale).add_(shift)
        return images.contiguous(memory_format=self._layout)

    def _pixel_constants(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and shift as [1, C, 1, 1] device tensors, made once (not a host copy per
        batch)."""
        if self._stats is None:
            scale, shift = self.task.pixel_scale_shift(self._model_spec)
            self._stats = (
                torch.from_numpy(scale).to(self.device),
                torch.from_numpy(shift).to(self.device),
            )
        return self._stats

    def _cuda_prefetch(self, loader) -> Iterator[dict[str, torch.Tensor]]:
        """Yield each batch while the next one is copied and normalized on a side stream."""
        self._pixel_constants()  # made on the compute stream, before the side stream reads it
        side_stream = torch.cuda.Stream(device=self.device)
        # Work already queued on the compute stream (such as those constants) comes first.
        side_stream.wait_stream(torch.cuda.current_stream(self.device))
        host_batches = iter(loader)

        def preload() -> dict[str, torch.Tensor] | None:
            host_batch = next(host_batches, None)
            if host_batch is None:
                return None
            with torch.cuda.stream(side_stream):
                return self._to_device(host_batch)

        upcoming = preload()
        while upcoming is not None:
            batch = upcoming
            compute_stream = torch.cuda.current_stream(self.device)
            # The step must not read the batch before its copy and normalization finished...
            compute_stream.wait_stream(side_stream)
            # ...and the allocator must not hand its memory (allocated on the side stream) to
            # another tensor until the compute stream is done with it.
            for tensor in batch.values():
                tensor.record_stream(compute_stream)
            upcoming = preload()  # queue the next copy before the step runs on this batch
            yield batch

    # --- model and optimization ---------------------------------------------------------------
    def build(
        self, model, optim, input_shape: tuple[int, int, int], num_classes: int, total_steps: int
    ) -> None:
        spec = self.task.model(model.name)
        self._model_spec, self._stats = spec, None  # the model's own normalization
        net = build_model(
            spec, num_classes, input_shape=input_shape, hidden_size=model.hidden_size
        ).to(self.device)
        # The weights and _normalize's batches in one layout.
        self._layout = memory_format(self.device.type, spec.family)
        if self._layout == torch.channels_last:
            net = net.to(memory_format=torch.channels_last)
        self.net = net
        self.model = net
        if self.dist.world_size > 1:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            # gradient_as_bucket_view: gradients live in the all-reduce buckets, saving a copy.
            self.model = DistributedDataParallel(
                net, device_ids=device_ids, gradient_as_bucket_view=True
            )
        if self.train.compile:
            _check_compile_toolchain(self.device.type)
            # Compiled lazily, at the first training step. Only the training forward is
            # compiled: predict() and checkpoints use the bare model (self.net), so checkpoints
            # are the same files with or without it.
            self.model = torch.compile(self.model)
        self.optimizer = _make_optimizer(net, optim)
        self.schedule_name = optim.schedule
        self.scheduler = LambdaLR(
            self.optimizer, lr_factor(optim.schedule, optim.warmup_steps, total_steps)
        )
        self.grad_clip = optim.grad_clip
        dtype = common.amp_dtype(self.train.amp, self.device.type == "cuda")
        self.amp_dtype = getattr(torch, dtype) if dtype else None
        # Only fp16 needs loss scaling (its exponent range is narrow); disabled, the scaler
        # passes everything through and its state is an empty dict.
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type="cuda", dtype=self.amp_dtype)

    def _set_training(self, training: bool) -> None:
        if self._training_mode != training:  # train()/eval() walk every module: only on change
            self.model.train(training)
            self._training_mode = training

    def reschedule(self, step: int, total_steps: int, warmup_steps: int) -> None:
        factor = lr_factor(self.schedule_name, warmup_steps, total_steps)
        scheduler = self.scheduler
        scheduler.lr_lambdas = [factor] * len(self.optimizer.param_groups)
        # LambdaLR's lr after n steps: base_lr * factor(n), with last_epoch = n.
        scheduler.last_epoch = step
        scheduler._last_lr = [base * factor(step) for base in scheduler.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, scheduler._last_lr, strict=True):
            group["lr"] = lr

    def train_step(self, batch: dict[str, Any]) -> torch.Tensor:
        self._set_training(True)
        # The forward pass updates BatchNorm's running statistics (and its batch counts)
        # before the loss is known: kept in one flat copy per dtype (a kernel each, a few KB to
        # MB), so that a NaN/Inf step can put them back on the device.
        buffers = _by_dtype(self.net.buffers())
        saved = [torch.cat([b.detach().reshape(-1) for b in group]) for group in buffers]
        with self.profile_range("forward"), self._autocast():
            scores = self.model(batch["image"])
        loss = self._head.loss(scores.float(), batch)  # losses in float32 whatever the autocast
        self.optimizer.zero_grad(set_to_none=True)
        with self.profile_range("backward"):
            self.scaler.scale(loss).backward()
        loss = loss.detach()
        with self.profile_range("optimizer"):
            # fp16: the true gradients are checked, clipped and stepped (unscale_ also records
            # the overflow check that scaler.update() adapts the scale by).
            self.scaler.unscale_(self.optimizer)  # a no-op unless fp16
            nonfinite, skip = self._finite_on_all_ranks(loss)
            self._clip_gradients()
            # Skipped on the device: the fused optimizers leave the weights, moments and step
            # counts as they were where found_inf is 1 (as GradScaler has them do), so no host
            # branch waits for the flag.
            self.optimizer.found_inf = skip
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
            self.scaler.update()  # fp16: a lower scale after an overflow, as always
            self.scheduler.step()
        for group, before in zip(buffers, saved):  # NaN/Inf step: as before its forward
            now = torch.cat([b.reshape(-1) for b in group])
            kept = torch.where(nonfinite.bool(), before, now).split([b.numel() for b in group])
            torch._foreach_copy_(group, [k.view_as(b) for k, b in zip(kept, group)])
        self._record_step(loss, nonfinite)
        return loss

    def _finite_on_all_ranks(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whether the loss and the gradients are finite on every rank, as two float32 0-d
        device flags that nothing here reads (a read would wait for the device every step):
        ``nonfinite`` (1.0: the loss, or outside fp16 the gradients, were NaN/Inf on some rank:
        what train.nonfinite counts) and ``skip`` (1.0: leave the weights as they are; also
        when fp16 gradients overflowed, the scaler's usual skip, which it answers with a lower
        scale and which is no error). The gradients too: a loss can be finite over NaN inputs
        (Paddle's CTC) while its gradients are not. One multi-tensor check over all gradients
        (the kernel GradScaler uses, with a scale of 1: the gradients stay bit for bit), not a
        reduction per tensor."""
        bad_loss = (~torch.isfinite(loss.float())).to(torch.float32)
        overflow = torch.zeros((), dtype=torch.float32, device=loss.device)
        grads = [p.grad for p in self.net.parameters() if p.grad is not None]
        if grads:
            one = torch.ones((), dtype=torch.float32, device=loss.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, overflow, one)
        fp16 = self.scaler.is_enabled()
        flags = torch.stack([bad_loss if fp16 else torch.maximum(bad_loss, overflow), overflow])
        if self.dist.world_size > 1:  # every rank skips or none does (DDP's next step agrees)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # a collective, not a host read
        nonfinite = flags[0]
        return nonfinite, torch.maximum(nonfinite, flags[1])

    def _clip_gradients(self) -> None:
        """optim.grad_clip: scale the gradients so that the norm of all of them together is at
        most grad_clip (one multi-tensor norm on the GPU; nothing read on the host)."""
        if self.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.net.parameters(), self.grad_clip)

    def _record_step(self, loss: torch.Tensor, nonfinite: torch.Tensor) -> None:
        """Append (loss, nonfinite) to the device-side table read_steps() hands over; it
        doubles when full (rows are written on the device: no host read)."""
        rows = self._steps_table
        if rows is None or self._steps_recorded == rows.shape[0]:
            grown = torch.zeros((max(64, 2 * self._steps_recorded), 2), device=loss.device)
            if rows is not None:
                grown[: rows.shape[0]] = rows
            self._steps_table = rows = grown
        rows[self._steps_recorded] = torch.stack([loss.float(), nonfinite])
        self._steps_recorded += 1

    def read_steps(self) -> np.ndarray:
        recorded, self._steps_recorded = self._steps_recorded, 0
        if not recorded:
            return np.zeros((0, 2))
        return np.array(self._steps_table[:recorded].tolist(), np.float64)  # the one read

    def to_float(self, loss: Any) -> float:
        return float(loss.item())

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @torch.no_grad()
    def predict(self, batch: dict[str, Any]) -> np.ndarray:
        self._set_training(False)
        # The bare model, not DDP: evaluation needs no collectives, and ranks may see different
        # numbers of evaluation batches.
        with self._autocast():
            scores = self.net(batch["image"])
        return self._head.decode(scores)

    def to_numpy(self, tensor: torch.Tensor) -> np.ndarray:
        return tensor.cpu().numpy()

    def num_parameters(self) -> int:
        return sum(parameter.numel() for parameter in self.net.parameters())

    # --- checkpoints -------------------------------------------------------------------------
    def prepare_save(self) -> None:
        """Every rank: gather each rank's generator states (torch CPU and CUDA, Python, numpy)
        to rank 0, whose save_state writes them all; a resumed rank then restores its own.
        One small collective per checkpoint (a few KB per rank)."""
        if self.dist.world_size == 1:
            return
        gathered = [None] * self.dist.world_size if self.dist.is_main else None
        dist.gather_object(_rng_state(self.device), gathered, dst=0)
        self._rank_rng_states = gathered

    def save_state(self, directory: Path) -> None:
        directory = Path(directory)
        rng = _rng_state(self.device)  # this process's (rank 0's): what one process restores
        if self._rank_rng_states is not None:  # prepare_save's, used once: every rank's
            rng["ranks"], self._rank_rng_states = self._rank_rng_states, None
        parts = {
            "model": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng,
        }
        for name, state in parts.items():
            torch.save(state, directory / f"{name}.pt")

    def load_state(self, directory: Path) -> None:
        directory = Path(directory)
        self.net.load_state_dict(self._load(directory, "model", self.device))
        # Read onto the CPU: load_state_dict moves each parameter's state to that parameter's
        # device itself, the step counts of the fused optimizers included (_load_as_fused).
        self.optimizer.load_state_dict(self._load(directory, "optimizer", "cpu"))
        self.scheduler.load_state_dict(self._load(directory, "scheduler", "cpu"))
        scaler = _scaler_state_to_load(
            self._load(directory, "scaler", "cpu"), self.scaler.is_enabled()
        )
        if scaler is not None:
            self.scaler.load_state_dict(scaler)
        rng = self._load(directory, "rng", "cpu")
        _set_rng_state(_rank_rng_state(rng, self.dist), self.device)

    @staticmethod
    def _load(directory: Path, name: str, map_location) -> Any:
        path = directory / f"{name}.pt"
        if not path.is_file():
            raise FileNotFoundError(
                f"checkpoint {directory} has no {path.name}; it is incomplete or not a torch "
                f"checkpoint (expected {', '.join(n + '.pt' for n in STATE_FILES)})"
            )
        try:
            # weights_only: tensors and plain containers only; unpickling anything else could
            # run code from whoever wrote the file.
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as error:
            holds = "pickled objects other than tensors and plain containers"
            reader = "torch.load(weights_only=True)"
            raise refuse_pickle(path, holds, reader, str(error).splitlines()[0]) from error

    @torch.no_grad()
    def infer(self, images: np.ndarray) -> np.ndarray:
        self._set_training(False)
        scores = self.net(torch.from_numpy(np.ascontiguousarray(images)).to(self.device))
        return scores.float().cpu().numpy()

    def export(self, directory: Path, fmt: str, input_shape, pad: float | None) -> list[Path]:
        from train.backends.torch.export import export

        self._set_training(False)
        return export(self.net, fmt, directory, input_shape, pad, self._head.probabilities)

    def init_weights_from(self, path: str | Path) -> weights.InitReport:
        """model.init_from (after build): load the tensors of ``path`` whose names and shapes
        are the model's; the rest keeps its fresh initialization. No optimizer state."""
        source = weights.source_for(path, "torch")
        if source.kind == "checkpoint":
            state = self._load(source.path, "model", "cpu")
        else:
            try:
                state = torch.load(source.path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as error:
                holds = "pickled objects other than tensors and plain containers"
                reader = "torch.load(weights_only=True)"
                detail = str(error).splitlines()[0]
                raise refuse_pickle(source.path, holds, reader, detail) from error
        state = weights.unwrap_state_dict(state, source.path)
        loaded, report = weights.select(
            state, self.net.state_dict(), str(source.path), torch.is_tensor
        )
        self.net.load_state_dict(loaded, strict=False)
        return report

    # --- distributed and telemetry -----------------------------------------------------------
    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        if self.dist.world_size == 1:
            return values
        tensor = torch.as_tensor(np.asarray(values, dtype=np.float64), device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.cpu().numpy()

    def sync_buffers(self) -> None:
        if self.dist.world_size > 1:
            for buffer in self.net.buffers():
                dist.broadcast(buffer, src=0)

    def barrier(self) -> None:
        if self.dist.world_size > 1:
            dist.barrier()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def profile_range(self, name: str) -> contextlib.AbstractContextManager:
        if not self.train.profile:
            return contextlib.nullcontext()
        if self.device.type == "cuda":
            return torch.cuda.nvtx.range(name)  # shows in Nsight Systems timelines
        return torch.autograd.profiler.record_function(name)  # shows in torch.profiler traces

    def scalar_writer(self, log_dir: Path) -> Any | None:
        try:
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter(str(log_dir))
        except Exception:  # tensorboard is not installed: no scalar log
            return None

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _allow_tf32() -> None:
    """TF32 tensor cores (Ampere and newer) for float32 matrix multiplies and convolutions, as
    Paddle 2.6 does by default for both (cuBLAS and cuDNN). Torch's defaults differ: TF32 for
    convolutions, full float32 for matmuls, which slowed the CRNN's LSTM and linear layers and
    skewed every torch-vs-Paddle comparison. TF32 keeps float32's range with a 10-bit mantissa:
    the common choice for training; under AMP only the float32 ops use it."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def cuda_facts() -> FrameworkCuda:
    """What this torch build says about CUDA (as train/gpu_probe.py's probe asks it): whether
    it is a CUDA build, the GPUs it can use, and what it warned while looking (a driver too
    old, for one)."""
    compiled = torch.version.cuda is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            count = torch.cuda.device_count() if compiled and torch.cuda.is_available() else 0
        except Exception as error:  # a CUDA runtime that cannot start
            warnings.warn(str(error), stacklevel=1)
            count = 0
    said = "; ".join(dict.fromkeys(str(w.message).strip() for w in caught))[:500]
    return FrameworkCuda(
        "torch",
        version=torch.__version__,
        cuda=torch.version.cuda,
        compiled=compiled,
        count=count,
        warnings=said,
    )


def _by_dtype(tensors: Iterator[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by dtype (each group concatenates into one flat tensor)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())


def _make_optimizer(net: nn.Module, optim) -> torch.optim.Optimizer:
    """optim is a train.config.OptimConfig; weight decay by train/schedule.py's rule (none on
    1-D parameters), as in the Paddle backend. Fused (one kernel per step on CUDA and CPU):
    only the fused optimizers skip a step on the device when found_inf is set (train_step)."""
    params = weight_decay_groups(net.parameters(), optim.weight_decay)
    if optim.name == "sgd":
        optimizer = torch.optim.SGD(
            params,
            lr=optim.lr,
            momentum=optim.momentum,
            nesterov=False,
            weight_decay=optim.weight_decay,
            fused=True,
        )
        if optim.momentum:
            # Fused SGD's first step would make its buffers with empty_like and, skipped,
            # leave them uninitialized for the next; zeros give the same first update
            # (momentum * 0 + gradient).
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    optimizer.state[parameter]["momentum_buffer"] = torch.zeros_like(parameter)
    else:
        optimizer_class = torch.optim.Adam if optim.name == "adam" else torch.optim.AdamW
        optimizer = optimizer_class(
            params, lr=optim.lr, weight_decay=optim.weight_decay, fused=True
        )
    optimizer.register_load_state_dict_pre_hook(_load_as_fused)
    return optimizer


def _load_as_fused(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's parameter groups replace the optimizer's, flags included: keep them
    fused (a checkpoint of the unfused optimizers would otherwise turn the device-side skip
    off), which also puts Adam's step counts on the parameters' device, as fused needs."""
    groups = [{**group, "fused": True, "foreach": None} for group in state["param_groups"]]
    return {**state, "param_groups": groups}


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    # Python's and numpy's global generators, as plain tuples and tensors (weights_only-safe).
    state["python"] = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in state:
        _set_cuda_rng_states(state["torch_cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))


def _set_cuda_rng_states(states: list[torch.Tensor]) -> None:
    """The CUDA generators' states, one per GPU that was visible at the save
    (get_rng_state_all), onto the GPUs visible now: the first min(saved, visible).
    torch.cuda.set_rng_state_all would raise IndexError on a pod with fewer GPUs. Each rank
    draws from its own GPU's generator only (cuda:LOCAL_RANK), so its state is among them."""
    visible = torch.cuda.device_count()
    restored = min(len(states), visible)
    if restored != len(states) or restored != visible:
        log.info(
            "checkpoint holds the CUDA RNG states of %d GPU(s), %d are visible: restoring "
            "GPUs 0-%d%s",
            len(states),
            visible,
            restored - 1,
            "" if visible <= restored else "; the others keep their seeded state",
        )
    for index in range(restored):
        torch.cuda.set_rng_state(states[index], index)


def _check_compile_toolchain(device_type: str) -> None:
    """train.compile: TorchInductor builds the model's kernels at the first step, with the C++
    compiler on the CPU (each kernel loaded through a Python extension: Python.h) and with
    Triton on CUDA (its launcher is C, built against Python.h too). Without them the first
    step would die in a long traceback (InvalidCxxCompiler); this names what is missing and
    the fix before any work is done."""
    missing = []
    cxx = os.environ.get("CXX", "g++")  # what inductor runs (torch._inductor.config.cpp.cxx)
    if shutil.which(cxx) is None and not os.environ.get("TORCH_INDUCTOR_INSTALL_GXX"):
        missing.append(f"a C++ compiler ({cxx}, or $CXX)")
    if device_type == "cuda":  # Triton's search: $CC, else gcc, else clang
        c_compilers = [os.environ["CC"]] if os.environ.get("CC") else ["gcc", "clang"]
        if not any(shutil.which(cc) for cc in c_compilers):
            missing.append(f"a C compiler ({' or '.join(c_compilers)})")
    include = Path(sysconfig.get_path("include"))
    if not (include / "Python.h").is_file():
        missing.append(f"Python's headers ({include}/Python.h)")
    if missing:
        raise RunError(
            f"train.compile: true needs {' and '.join(missing)}, which this environment lacks: "
            "torch.compile (TorchInductor) builds the model's kernels with them. HINT: install "
            "them (Debian/Ubuntu: apt-get install gcc g++ python3-dev; conda's Python ships its "
            "headers; docker/torch.Dockerfile installs the compilers), or set "
            "train.compile=false"
        )


def _scaler_state_to_load(saved: dict[str, Any], enabled: bool) -> dict[str, Any] | None:
    """What of a checkpoint's GradScaler state to load into this run's scaler; None: nothing.
    A disabled scaler (amp none or bf16) saves {}, and an enabled one (fp16) refuses to load
    {}: resumed with fp16 from such a checkpoint, the scaler starts fresh (its initial scale,
    2**16, found again within a few steps). A disabled scaler ignores what it is given, so a
    saved fp16 state is simply not used."""
    if not enabled:
        return None
    if not saved:
        log.info(
            "checkpoint has no fp16 loss-scaler state (saved with train.amp none or bf16): "
            "the loss scaler starts at its initial scale"
        )
        return None
    return saved


def _rank_rng_state(state: dict[str, Any], info: DistInfo) -> dict[str, Any]:
    """This rank's generator states in a checkpoint's rng.pt: its own entry of "ranks" (one per
    rank, gathered by prepare_save) when the world size is the one saved; otherwise rank 0's
    (the file's top level), which is also all a single process or an older file saved."""
    ranks = state.get("ranks")
    if ranks is not None and len(ranks) == info.world_size:
        return ranks[info.rank]
    if info.is_main and (ranks is not None or info.world_size > 1):
        log.info(
            "checkpoint holds the RNG states of %d rank(s), this run has %d: every rank "
            "restores rank 0's",
            len(ranks) if ranks is not None else 1,
            info.world_size,
        )
    return state
