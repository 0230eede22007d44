"""The contract between the framework-neutral training loop (train/loop.py) and a framework.

The loop calls only these methods, in this order:

    backend = make_backend(config)            # train/backends/__init__.py: by config.framework
    dist = backend.init_distributed()         # torchrun / paddle.distributed.launch env, device
    backend.seed_everything(seed, deterministic)
    backend.set_cpu_threads(config.loader.num_workers)  # share the cores with the workers
    train_loader = backend.make_loader(train_set, sampler, config.loader, train=True)
    backend.build(config.model, config.optim, input_shape, num_classes, total_steps)
    backend.load_state(dir)                   # on --resume
    for each epoch:
        for batch in backend.device_batches(train_loader):   # on the device, normalized
            loss = backend.train_step(batch)                  # NOT synchronized
            backend.read_steps()                              # once per log window (syncs)
        backend.predict(batch) / backend.batch_labels(batch)  # evaluation
        backend.prepare_save()                                # every rank, then on rank 0:
        backend.save_state(tmp_dir)                           # checkpoint (atomic rename is ours)

A backend is made for one task (train/tasks.py) and the ``train:`` section, and is handed the
other sections where it uses them. What it does per task is only the loss and the decoding,
keyed by the task's loss kind (HEADS in train/backends/<framework>/models.py); what needs no
framework is written once in train/backends/common.py and train/schedule.py.

Batch layout from the loaders (uint8 on the host, fields as the task's dataset yields them):
  OCR:      {"image": uint8 [N, H, W, C] BGR, "label": int32 [N, L], "length": int32 [N]}
  ResNet50: {"image": uint8 [N, H, W, 3] RGB, "label": int64 [N]}
device_batches() moves them to the device, permutes the images to [N, C, H, W] and normalizes
them there with the task's per-channel scale and shift (OCR to [-1, 1]; ResNet with ImageNet's
mean and std). Shipping uint8 keeps worker IPC at 1/4 of float32 bytes.
"""

from __future__ import annotations

import abc
import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from train import tasks
from train.errors import DeviceUnavailableError  # noqa: F401  (re-exported: backends raise it)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class Backend(abc.ABC):
    name: str
    # The exceptions the framework raises when the device (or host) runs out of memory; the
    # loop turns them into train.errors.OutOfMemoryError (exit 9).
    out_of_memory_errors: tuple[type[BaseException], ...] = (MemoryError,)

    def is_out_of_memory(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the framework's report of an allocation its device or host could
        not make (the loop's exit 9)."""
        return isinstance(exc, self.out_of_memory_errors)

    @abc.abstractmethod
    def allocate_bytes(self, count: int) -> object:
        """A ``count``-byte tensor on the run's device through the framework's own allocator
        (TRAIN_INJECT_FAULT=alloc@N asks for more than any machine can give, train/faults.py)."""

    def __init__(self, task: str, train) -> None:
        self.task = tasks.get(task)  # what is trained: train/tasks.py
        self.train = train  # the train: section (device, amp, profile), a train.config.TrainConfig
        self.seed = 0  # seed_everything's

    # --- process ---------------------------------------------------------------------------
    @abc.abstractmethod
    def init_distributed(self) -> DistInfo:
        """Read the launcher's environment, join the process group when world size > 1 (gloo on
        CPU, nccl on GPU), and pick the device from train.device by common.choose_gpu (auto: a
        GPU if the framework can use one; gpu: DeviceUnavailableError when it cannot)."""

    @property
    @abc.abstractmethod
    def device_name(self) -> str:
        """Human-readable device, e.g. "cpu" or "cuda:0 (NVIDIA H100)"."""

    @property
    def uses_gpu(self) -> bool:
        return self.device_index is not None

    @property
    @abc.abstractmethod
    def device_index(self) -> int | None:
        """The CUDA ordinal this process trains on (relative to CUDA_VISIBLE_DEVICES, as the
        framework counts), or None on the CPU. Telemetry maps it to NVML's physical GPU."""

    def seed_everything(self, seed: int, deterministic: bool) -> None:
        """Seed Python's and numpy's global RNGs and the framework's (seed_framework); with
        deterministic, also select deterministic kernels. The loaders made afterwards follow
        ``seed`` too."""
        self.seed = seed
        random.seed(seed)
        np.random.seed(seed)
        self.seed_framework(seed, deterministic)

    @abc.abstractmethod
    def seed_framework(self, seed: int, deterministic: bool) -> None:
        """Seed the framework's generators (every device's); with deterministic, select
        deterministic kernels."""

    def set_cpu_threads(self, num_workers: int) -> None:  # noqa: B027  (framework default)
        """Share this rank's CPU cores between the framework's threads and ``num_workers``
        loader workers, when training on the CPU."""

    # --- data ------------------------------------------------------------------------------
    @abc.abstractmethod
    def make_loader(self, dataset, sampler, loader_config, train: bool) -> Any:
        """The framework's DataLoader over a datasets.dataset.RecordDataset with a
        datasets.sampler.EpochSampler; every knob of loader_config honoured
        (train/backends/common.py's LoaderKnobs)."""

    @abc.abstractmethod
    def device_batches(self, loader) -> Iterator[dict[str, Any]]:
        """Iterate one epoch of ``loader``, yielding batches on the device with float images
        normalized there (on CUDA: copies on a side stream, one batch ahead, from pinned memory).
        Label fields keep their keys."""

    # --- model and optimization ---------------------------------------------------------------
    @abc.abstractmethod
    def build(
        self, model, optim, input_shape: tuple[int, int, int], num_classes: int, total_steps: int
    ) -> None:
        """Create the model (``model``: the model: section; input [C, H, W]), the optimizer
        (``optim``: the optim: section; weight decay by train/schedule.py's rule), the LR
        schedule (warmup + schedule over total_steps), the AMP scaler when train.amp != none on
        a GPU, and the data-parallel wrapper when world size > 1. num_classes includes the CTC
        blank for OCR."""

    @abc.abstractmethod
    def reschedule(self, step: int, total_steps: int, warmup_steps: int) -> None:
        """Replace the LR schedule built by build() (after load_state on a resume) with one of
        total_steps and warmup_steps, standing at ``step``: a resume on another number of ranks
        counts steps of another global batch (train/checkpoint.py, Position.reshard)."""

    @abc.abstractmethod
    def train_step(self, batch: dict[str, Any]) -> Any:
        """Forward, loss, backward, clip, optimizer and LR-schedule step. Returns the loss as a
        framework scalar. Nothing in it waits for the device: whether the loss and gradients
        are finite on every rank is a device-side flag (all-reduced: every rank agrees), and a
        step where they are not leaves the weights, the optimizer's state and BatchNorm's
        statistics as they were on the device (the LR schedule still advances), so NaN weights
        never reach a checkpoint. The step's loss and flag are kept on the device for
        read_steps()."""

    @abc.abstractmethod
    def read_steps(self) -> np.ndarray:
        """The train_steps since the last call, one row each: (loss, 1.0 if its loss or
        gradients were NaN/Inf on some rank and its update was skipped, else 0.0), float64
        [steps, 2]. ONE device-to-host transfer, the only read the steps need: the loop calls
        it once per logging window (and before an evaluation or checkpoint), not per step."""

    @abc.abstractmethod
    def to_float(self, loss: Any) -> float:
        """Loss value as a Python float (synchronizes)."""

    @abc.abstractmethod
    def current_lr(self) -> float: ...

    @abc.abstractmethod
    def predict(self, batch: dict[str, Any]) -> np.ndarray:
        """Evaluation forward without gradients, decoded for the task's metric. OCR: int64
        [N, T] argmax class per time step (0 = blank). ResNet: int64 [N, 5] top-5 class ids,
        best first (padded with -1 below 5 classes)."""

    def batch_labels(self, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        """The batch's label fields (the task's label_keys) as numpy arrays."""
        return {key: self.to_numpy(batch[key]) for key in self.task.label_keys}

    @abc.abstractmethod
    def to_numpy(self, tensor: Any) -> np.ndarray:
        """A tensor's values on the host."""

    @abc.abstractmethod
    def num_parameters(self) -> int:
        """Trainable parameters of the model (not BatchNorm's running statistics)."""

    # --- checkpoints -------------------------------------------------------------------------
    def prepare_save(self) -> None:  # noqa: B027  (default: nothing to gather)
        """Called by every rank right before a checkpoint, which only rank 0 writes
        (save_state): gather there what each rank must restore as its own (torch: the
        generator states). Collective: every rank calls it, or none does."""

    @abc.abstractmethod
    def save_state(self, directory: Path) -> None:
        """Write model, optimizer, LR schedule, AMP scaler and framework RNG state as files in
        ``directory`` (which exists and is empty). Only formats that load without unpickling
        arbitrary objects: torch.save read back with weights_only=True; numpy .npz read with
        allow_pickle=False plus JSON for Paddle."""

    @abc.abstractmethod
    def load_state(self, directory: Path) -> None:
        """Restore everything save_state wrote (after build()). A file that would need
        unpickling raises train.checkpoint.UnsafeCheckpointError, and nothing in it runs."""

    def infer(self, images: np.ndarray) -> np.ndarray:
        """The model's raw float32 scores (logits) for a normalized NCHW float32 batch on the
        host: [N, T, classes] for OCR, [N, classes] for ResNet (train.predict)."""
        raise NotImplementedError(f"{self.name} backend cannot run inference")

    def export(self, directory: Path, fmt: str, input_shape, pad: float | None) -> list[Path]:
        """Write the model in the deployment format ``fmt`` into ``directory``: the network,
        softmax after it, and (``pad`` not None, OCR) an input of exactly 0 read as ``pad``;
        returns the files written (train.export)."""
        raise NotImplementedError(f"{self.name} backend cannot export")

    def init_weights_from(self, path: str | Path) -> Any:
        """model.init_from, after build(): load the weights at ``path`` (train/weights.py's
        sources) whose names and shapes match the model, leave the rest at their fresh
        initialization, never touch the optimizer; return a train.weights.InitReport."""
        raise NotImplementedError(f"{self.name} backend cannot load model.init_from weights")

    # --- distributed and telemetry -----------------------------------------------------------
    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        """Sum a small float64 array over ranks (identity when world size is 1)."""
        return values

    @abc.abstractmethod
    def sync_buffers(self) -> None:
        """Make every rank's untrained model state (BatchNorm running statistics) rank 0's,
        which the checkpoint holds. Gradients keep the weights equal across ranks; the running
        statistics follow each rank's own batches (Paddle's DataParallel never syncs them,
        torch's DDP broadcasts rank 0's before each forward and each rank then adds its batch),
        so without this the ranks would each evaluate a different model. No-op on one rank."""

    def barrier(self) -> None:  # noqa: B027  (single-process default: nothing to wait for)
        return None

    def synchronize(self) -> None:  # noqa: B027  (CPU default: nothing queued)
        """Wait for queued device work (for honest timings at log points)."""

    def profile_range(self, name: str) -> contextlib.AbstractContextManager:
        """A profiler marker (NVTX for torch, paddle.profiler.RecordEvent) when
        train.profile is true, otherwise a no-op."""
        return contextlib.nullcontext()

    def scalar_writer(self, log_dir: Path) -> Any | None:
        """The framework's scalar log (TensorBoard, VisualDL) writing to ``log_dir``: an object
        with add_scalar(tag, value, step) and close(); None when it is not installed."""
        return None

    def shutdown(self) -> None:  # noqa: B027  (single-process default)
        """Leave the process group."""
