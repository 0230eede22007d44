"""The contract between the framework-neutral training loop (train/loop.py) and a framework.

A backend is five parts, each a small class per framework (train/backends/<framework>/), with
what needs no framework written once in train/backends/common.py:

    Runtime   this process in the run: ranks, device, seeds, collectives, profiling, scalar log
    Batches   the framework's loaders and the normalized batches they give on the device
    Trainer   the model, its optimizer and schedule, the train step, evaluation's forward
    StateIO   checkpoints (save, verified load) and model.init_from's weights
    Exporter  the trained model after training: raw scores (train.predict), deployment files

:class:`Backend` makes the five together; callers reach each part by name. The loop calls, in
this order:

    backend = make_backend(config)            # train/backends/__init__.py: by config.framework
    dist = backend.runtime.init_distributed() # torchrun / paddle.distributed.launch env, device
    backend.runtime.seed_everything(seed, deterministic)
    backend.batches.set_cpu_threads(config.loader.num_workers)  # share the cores with workers
    loader = backend.batches.make_loader(train_set, sampler, config.loader, train=True)
    backend.build(config.model, config.optim, input_shape, num_classes, total_steps)
    backend.state.load_state(dir)             # on --resume
    for each epoch:
        for batch in backend.batches.device_batches(loader):  # on the device, normalized
            loss = backend.trainer.train_step(batch)          # NOT synchronized
            backend.trainer.read_steps()                      # once per log window (syncs)
        backend.trainer.predict(batch), backend.batches.batch_labels(batch)  # evaluation
        backend.state.prepare_save()                          # every rank, then on rank 0:
        backend.state.save_state(tmp_dir)     # checkpoint (the atomic rename is ours)

A backend is made for one task (train/tasks.py) and the ``train:`` section, and is handed the
other sections where it uses them. What it does per task is only the loss and the decoding,
keyed by the task's loss kind (HEADS in train/backends/<framework>/models.py).

Batch layout from the loaders (uint8 on the host, fields as the task's dataset yields them):
  OCR:      {"image": uint8 [N, H, W, C] BGR, "label": int32 [N, L], "length": int32 [N]}
  ResNet50: {"image": uint8 [N, H, W, 3] RGB, "label": int64 [N]}
device_batches() moves them to the device, permutes the images to [N, C, H, W] and normalizes
them there with the task's per-channel scale and shift (OCR to [-1, 1]; ResNet with ImageNet's
mean and std). Shipping uint8 keeps worker IPC at 1/4 of float32 bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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


class Runtime(Protocol):
    """This process's place in the run and what it does with the other ranks: the launcher's
    ranks, the device, the seeds, the collectives, profiler markers and the scalar log. Every
    other part reads its device, ranks and seed from here, so they are decided once."""

    dist: DistInfo
    seed: int  # seed_everything's
    # The exceptions the framework raises when the device (or host) runs out of memory; the
    # loop turns them into train.errors.OutOfMemoryError (exit 9).
    out_of_memory_errors: tuple[type[BaseException], ...]

    def init_distributed(self) -> DistInfo:
        """Read the launcher's environment, join the process group when world size > 1 (gloo on
        CPU, nccl on GPU), and pick the device from train.device by common.choose_gpu (auto: a
        GPU if the framework can use one; gpu: DeviceUnavailableError when it cannot)."""

    @property
    def device_name(self) -> str:
        """Human-readable device, e.g. "cpu" or "cuda:0 (NVIDIA H100)"."""

    @property
    def device_index(self) -> int | None:
        """The CUDA ordinal this process trains on (relative to CUDA_VISIBLE_DEVICES, as the
        framework counts), or None on the CPU. Telemetry maps it to NVML's physical GPU."""

    @property
    def uses_gpu(self) -> bool: ...

    def is_out_of_memory(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the framework's report of an allocation its device or host could
        not make (the loop's exit 9)."""

    def allocate_bytes(self, count: int) -> object:
        """A ``count``-byte tensor on the run's device through the framework's own allocator
        (TRAIN_INJECT_FAULT=alloc@N asks for more than any machine can give, train/faults.py)."""

    def seed_everything(self, seed: int, deterministic: bool) -> None:
        """Seed Python's and numpy's global RNGs and the framework's (every device's); with
        deterministic, also select deterministic kernels. The loaders made afterwards follow
        ``seed`` too."""

    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        """Sum a small float64 array over ranks (identity when world size is 1)."""

    def barrier(self) -> None:
        """Wait for every rank (nothing to wait for on one)."""

    def synchronize(self) -> None:
        """Wait for queued device work (for honest timings at log points)."""

    def profile_range(self, name: str) -> contextlib.AbstractContextManager:
        """A profiler marker (NVTX for torch, paddle.profiler.RecordEvent) when
        train.profile is true, otherwise a no-op."""

    def scalar_writer(self, log_dir: Path) -> Any | None:
        """The framework's scalar log (TensorBoard, VisualDL) writing to ``log_dir``: an object
        with add_scalar(tag, value, step) and close(); None when it is not installed."""

    def shutdown(self) -> None:
        """Leave the process group."""


class Batches(Protocol):
    """The framework's loaders over the framework-free datasets, and their batches on the
    device, normalized there by the built model's pixel contract: the data side of a step,
    apart from the model so that loaders can be made before it."""

    def set_cpu_threads(self, num_workers: int) -> None:
        """Share this rank's CPU cores between the framework's threads and ``num_workers``
        loader workers, when training on the CPU."""

    def make_loader(self, dataset, sampler, loader_config, train: bool) -> Any:
        """The framework's DataLoader over a datasets.dataset.RecordDataset with a
        datasets.sampler.EpochSampler; every knob of loader_config honoured
        (train/backends/common.py's LoaderKnobs)."""

    def normalize_for(self, model_spec: tasks.Model) -> None:
        """Normalize the batches from now on as ``model_spec`` (train/tasks.py's Model) wants
        its pixels (Trainer.build's model); before it, as the task's."""

    def device_batches(self, loader) -> Iterator[dict[str, Any]]:
        """Iterate one epoch of ``loader``, yielding batches on the device with float images
        normalized there (on CUDA: copies on a side stream, one batch ahead, from pinned memory).
        Label fields keep their keys."""

    def to_numpy(self, tensor: Any) -> np.ndarray:
        """A tensor's values on the host."""

    def batch_labels(self, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        """The batch's label fields (the task's label_keys) as numpy arrays."""


class Trainer(Protocol):
    """The model, its optimizer, LR schedule and AMP, and what is done with them: the train
    step, evaluation's forward, the ranks' model state. One part because each of these reads
    and changes the others' state every step."""

    net: Any  # the bare model: predict, checkpoints, counting, export
    model: Any  # what train_step calls: the data-parallel and compiled wrappers around net
    optimizer: Any
    scheduler: Any
    scaler: Any  # the AMP loss scaler (fp16)

    def build(
        self, model, optim, input_shape: tuple[int, int, int], num_classes: int, total_steps: int
    ) -> None:
        """Create the model (``model``: the model: section; input [C, H, W]), the optimizer
        (``optim``: the optim: section; weight decay by train/schedule.py's rule), the LR
        schedule (warmup + schedule over total_steps), the AMP scaler when train.amp != none on
        a GPU, and the data-parallel wrapper when world size > 1. num_classes includes the CTC
        blank for OCR."""

    def reschedule(self, step: int, total_steps: int, warmup_steps: int) -> None:
        """Replace the LR schedule built by build() (after load_state on a resume) with one of
        total_steps and warmup_steps, standing at ``step``: a resume on another number of ranks
        counts steps of another global batch (train/checkpoint.py, Position.reshard)."""

    def train_step(self, batch: dict[str, Any]) -> Any:
        """Forward, loss, backward, clip, optimizer and LR-schedule step. Returns the loss as a
        framework scalar. Nothing in it waits for the device: whether the loss and gradients
        are finite on every rank is a device-side flag (all-reduced: every rank agrees), and a
        step where they are not leaves the weights, the optimizer's state and BatchNorm's
        statistics as they were on the device (the LR schedule still advances), so NaN weights
        never reach a checkpoint. The step's loss and flag are kept on the device for
        read_steps()."""

    def read_steps(self) -> np.ndarray:
        """The train_steps since the last call, one row each: (loss, 1.0 if its loss or
        gradients were NaN/Inf on some rank and its update was skipped, else 0.0), float64
        [steps, 2]. ONE device-to-host transfer, the only read the steps need: the loop calls
        it once per logging window (and before an evaluation or checkpoint), not per step."""

    def to_float(self, loss: Any) -> float:
        """Loss value as a Python float (synchronizes)."""

    def current_lr(self) -> float: ...

    def predict(self, batch: dict[str, Any]) -> np.ndarray:
        """Evaluation forward without gradients, decoded for the task's metric. OCR: int64
        [N, T] argmax class per time step (0 = blank). ResNet: int64 [N, 5] top-5 class ids,
        best first (padded with -1 below 5 classes)."""

    def num_parameters(self) -> int:
        """Trainable parameters of the model (not BatchNorm's running statistics)."""

    def sync_buffers(self) -> None:
        """Make every rank's untrained model state (BatchNorm running statistics) rank 0's,
        which the checkpoint holds. Gradients keep the weights equal across ranks; the running
        statistics follow each rank's own batches (Paddle's DataParallel never syncs them,
        torch's DDP broadcasts rank 0's before each forward and each rank then adds its batch),
        so without this the ranks would each evaluate a different model. No-op on one rank."""

    def set_training(self, training: bool) -> None:
        """Put the model in training or evaluation mode (only on a change)."""


class StateIO(Protocol):
    """What outlives the process: the checkpoint's files, written and read back without
    unpickling anything, and model.init_from's weights. Apart from the Trainer because it is
    all file formats and the rules for reading untrusted files."""

    def prepare_save(self) -> None:
        """Called by every rank right before a checkpoint, which only rank 0 writes
        (save_state): gather there what each rank must restore as its own (torch: the
        generator states). Collective: every rank calls it, or none does."""

    def save_state(self, directory: Path) -> None:
        """Write model, optimizer, LR schedule, AMP scaler and framework RNG state as files in
        ``directory`` (which exists and is empty). Only formats that load without unpickling
        arbitrary objects: torch.save read back with weights_only=True; numpy .npz read with
        allow_pickle=False plus JSON for Paddle."""

    def load_state(self, directory: Path) -> None:
        """Restore everything save_state wrote (after build()). A file that would need
        unpickling raises train.checkpoint.UnsafeCheckpointError, and nothing in it runs."""

    def init_weights_from(self, path: str | Path) -> Any:
        """model.init_from, after build(): load the weights at ``path`` (train/weights.py's
        sources) whose names and shapes match the model, leave the rest at their fresh
        initialization, never touch the optimizer; return a train.weights.InitReport."""


class Exporter(Protocol):
    """The trained model after training, for train.predict and train.export: raw scores of a
    host batch, and the model written in a deployment format. Apart from the Trainer because
    it serves the tools that load a checkpoint and need neither loaders nor a step."""

    def infer(self, images: np.ndarray) -> np.ndarray:
        """The model's raw float32 scores (logits) for a normalized NCHW float32 batch on the
        host: [N, T, classes] for OCR, [N, classes] for ResNet (train.predict)."""

    def export(self, directory: Path, fmt: str, input_shape, pad: float | None) -> list[Path]:
        """Write the model in the deployment format ``fmt`` into ``directory``: the network,
        its loss kind's probabilities after it (softmax, a sigmoid per tag), and (``pad`` not
        None, OCR) an input of exactly 0 read as ``pad``; returns the files written
        (train.export)."""


class Backend:
    """One framework's five parts, made together: callers reach each through its part
    (``backend.runtime.barrier()``, ``backend.trainer.train_step(batch)``), whose protocol above
    gives its contract, so a call site says which part it needs. ``build`` is the one call that
    reaches two parts: the trainer builds the model, then the batches are normalized for it."""

    name: str

    def __init__(
        self,
        task: str,
        runtime: Runtime,
        batches: Batches,
        trainer: Trainer,
        state: StateIO,
        exporter: Exporter,
    ) -> None:
        self.task = tasks.get(task)  # what is trained: train/tasks.py
        self.runtime, self.batches, self.trainer = runtime, batches, trainer
        self.state, self.exporter = state, exporter

    def build(
        self, model, optim, input_shape: tuple[int, int, int], num_classes: int, total_steps: int
    ) -> None:
        self.trainer.build(model, optim, input_shape, num_classes, total_steps)
        self.batches.normalize_for(self.task.model(model.name))
