r"""PaddlePaddle 2.6 implementation of the training-loop contract in train/backends/base.py.

The loop (train/loop.py) drives it; nothing here knows about epochs or logging cadence. Run:
    .venv-paddle/bin/python -m train --config configs/ocr/smoke.yaml
and on several GPUs or CPU processes:
    python -m paddle.distributed.launch --nproc_per_node 2 --log_dir RUN_DIR/launch-logs \
        train/__main__.py --config ... --output-dir RUN_DIR
(--log_dir: the launcher's default, ./log, is not writable in the images.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle import _legacy_C_ops
from paddle.base.layer_helper import LayerHelper
from paddle.utils import unique_name

from train import weights
from train.backends import common
from train.backends.base import Backend, DeviceUnavailableError, DistInfo
from train.backends.paddle import data as paddle_data
from train.backends.paddle.models import HEADS, build_model
from train.checkpoint import refuse_pickle
from train.gpu_probe import FrameworkCuda
from train.schedule import lr_factor, weight_decay_groups

log = logging.getLogger(__name__)

STATE_FORMAT = 1
STORE_TIMEOUT_S = 900  # Paddle 2.6's rendezvous (TCPStore) timeout: see init_distributed
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.npz", "optimizer.npz", "state.json"


class PaddleBackend(Backend):
    name = "paddle"

    def __init__(self, task: str, train) -> None:
        super().__init__(task, train)
        self.dist = DistInfo()
        self.gpu_id: int | None = None  # None: CPU
        self.net: paddle.nn.Layer | None = None  # the bare model: predict, checkpoints
        self.model: paddle.nn.Layer | None = None  # what train_step calls (DataParallel > 1 rank)
        self.optimizer: paddle.optimizer.Optimizer | None = None
        self.scheduler: paddle.optimizer.lr.LambdaDecay | None = None
        self.scaler: paddle.amp.GradScaler | None = None
        self.amp_dtype: str | None = None  # "float16" | "bfloat16" | None
        self.grad_clip: float | None = None  # optim.grad_clip
        self._trainable: list[paddle.Tensor] = []  # the parameters the optimizer steps
        self.step = 0  # optimizer steps taken; also seeds Paddle's RNG per step (see _reseed)
        # Parameter and optimizer-accumulator names come from this generator, not the
        # process-wide one, so they are the same in every process and every backend instance:
        # Paddle's optimizer state is keyed by them.
        self._names: Any = None
        self._training_mode: bool | None = None
        self._stats: tuple[paddle.Tensor, paddle.Tensor] | None = None  # pixel scale, shift
        self._model_spec = None  # train/tasks.py's Model once built: its pixel contract
        self._head = HEADS[self.task.loss]  # the loss and decoding of the task's loss kind
        self._steps_table: paddle.Tensor | None = None  # (loss, nonfinite) per step, on device
        self._steps_recorded = 0  # its rows since the last read_steps()

    # --- process ---------------------------------------------------------------------------
    def init_distributed(self) -> DistInfo:
        env = os.environ  # set by python -m paddle.distributed.launch
        world_size = int(env.get("PADDLE_TRAINERS_NUM", "1"))
        local_rank = int(env.get("PADDLE_LOCAL_RANK", env.get("PADDLE_RANK_IN_NODE", "0")))
        self.dist = DistInfo(
            rank=int(env.get("PADDLE_TRAINER_ID", "0")),
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=int(env.get("PADDLE_LOCAL_SIZE", str(world_size))),
        )
        self.gpu_id = self._pick_gpu()
        _allow_tf32()
        device = "cpu" if self.gpu_id is None else f"gpu:{self.gpu_id}"
        paddle.set_device(device)
        if world_size > 1 and not dist.is_initialized():
            # The NCCL process group's timeout (ms), which Paddle 2.6 reads from the environment
            # in init_parallel_env (ParallelEnv; its default is 30 min).
            os.environ["PADDLE_PG_TIMEOUT"] = str(int(self.train.dist_timeout_s * 1000))
            # The rendezvous before it has a timeout of its own that nothing can set: every rank
            # waits at most 900 s for all ranks to reach init_parallel_env. Paddle 2.6.2 makes
            # its TCPStore with core.create_or_get_global_tcp_store() (distributed/parallel.py,
            # line 1099), which passes no timeout, so TCPStore's default argument holds
            # (include/paddle/phi/core/distributed/store/tcp_store.h, line 128: timeout = 900).
            # The FLAGS_stop_check_timeout read on the line before is never used.
            if self.train.dist_timeout_s > STORE_TIMEOUT_S:
                log.info(
                    "train.dist_timeout_s=%g s covers Paddle's collectives; its start-up "
                    "rendezvous waits at most %d s for all ranks (fixed in Paddle 2.6): a rank "
                    "that arrives later, such as one still staging s3:// data, fails the start "
                    "(a restart reuses what data.remote_cache_dir already holds)",
                    self.train.dist_timeout_s,
                    STORE_TIMEOUT_S,
                )
            if self.gpu_id is None:
                # On a GPU host the launcher hands each rank a GPU (FLAGS_selected_gpus) and no
                # backend, and a CUDA build then picks NCCL: gloo is the CPU's.
                os.environ["PADDLE_DISTRI_BACKEND"] = "gloo"
            dist.init_parallel_env()
            # init_parallel_env sets the expected place itself (the launcher's GPU on a CUDA
            # build, whatever train.device says): ours again.
            paddle.set_device(device)
        return self.dist

    def _pick_gpu(self) -> int | None:
        if not common.choose_gpu(self.train.device, cuda_facts()):
            return None
        gpus = paddle.device.cuda.device_count()
        # The launcher gives each rank its GPU in FLAGS_selected_gpus (--devices 0,1,...).
        selected = os.environ.get("FLAGS_selected_gpus", "").split(",")[0]  # noqa: SIM112
        gpu = int(selected) if selected.strip() else self.dist.local_rank
        if gpu >= gpus:
            raise DeviceUnavailableError(
                f"rank {self.dist.rank} wants GPU {gpu} but only {gpus} are visible",
                "start at most one process per GPU (paddle.distributed.launch --devices)",
            )
        return gpu

    @property
    def place(self) -> Any:
        return paddle.CPUPlace() if self.gpu_id is None else paddle.CUDAPlace(self.gpu_id)

    @property
    def device_index(self) -> int | None:
        return self.gpu_id

    @property
    def device_name(self) -> str:
        if self.gpu_id is None:
            return "cpu"
        return f"gpu:{self.gpu_id} ({paddle.device.cuda.get_device_name(self.gpu_id)})"

    def allocate_bytes(self, count: int) -> paddle.Tensor:
        # Paddle raises MemoryError ("(ResourceExhausted) Fail to alloc memory of ...") for the
        # host's allocator and for the GPU's alike.
        return paddle.empty([count], dtype="uint8")

    def seed_framework(self, seed: int, deterministic: bool) -> None:
        paddle.seed(seed)  # the CPU and every CUDA generator
        if deterministic:
            _set_flags_that_exist(
                FLAGS_cpu_deterministic=True,
                # CUDA builds only; a CPU build rejects them as unknown.
                FLAGS_cudnn_deterministic=True,
                FLAGS_cudnn_exhaustive_search=False,
                FLAGS_embedding_deterministic=1,
            )

    def _reseed(self) -> None:
        """Seed Paddle's generators from (seed, step) before every step.

        Paddle 2.6 cannot restore its CPU generator from plain data: GeneratorState pickles to
        (device, seed, offset) only, without the Mersenne-Twister position, and has no other
        serializable form. A state that is a pure function of (seed, step) needs none: a resumed
        run draws exactly what the uninterrupted one drew (dropout masks, for instance).
        """
        sequence = np.random.SeedSequence([self.seed, self.step])
        paddle.seed(int(sequence.generate_state(1, np.uint64)[0] >> np.uint64(1)))

    def set_cpu_threads(self, num_workers: int) -> None:
        # Nothing to share: CPU threads stay at Paddle's FLAGS_paddle_num_threads (default 1;
        # set the environment variable to raise it). More threads than free cores make Paddle's
        # OpenMP kernels spin: 2 threads on a busy 2-core host ran a crnn_tiny step 3-5x slower
        # than 1 thread.
        return None

    # --- data ------------------------------------------------------------------------------
    def make_loader(self, dataset, sampler, loader_config, train: bool) -> Any:
        return paddle_data.make_loader(
            dataset,
            sampler,
            common.LoaderKnobs.of(loader_config, train),
            use_shared_memory=loader_config.use_shared_memory,
            batch_ring=loader_config.batch_ring,
            places=self.place,
        )

    def device_batches(self, loader) -> Iterator[dict[str, Any]]:
        # On a GPU the loader was built with places=this GPU: its batches arrive there, each
        # staged in pinned memory and copied on a side CUDA stream one batch ahead of use, so
        # the copy of batch k+1 overlaps step k (through the batch ring: data.PinnedCopies;
        # without it: Paddle's buffered reader). What is left is to normalize, which runs on
        # the device's compute stream.
        for batch in loader:
            yield self._on_device(batch)

    def _on_device(self, batch: dict[str, paddle.Tensor]) -> dict[str, paddle.Tensor]:
        batch = dict(batch)
        if self.gpu_id is not None:  # a no-op for loader batches, which are there already
            for key, value in batch.items():
                place = value.place
                if not (place.is_gpu_place() and place.gpu_device_id() == self.gpu_id):
                    batch[key] = value.cuda(self.gpu_id, blocking=False)
        batch["image"] = self._normalize(batch["image"])
        return batch

    def _normalize(self, images: paddle.Tensor) -> paddle.Tensor:
        """uint8 [N,H,W,C] -> float32 [N,C,H,W] on the device, normalized with the task's
        per-channel scale and shift (train/tasks.py) in one multiply-add."""
        # Transpose the uint8 batch: a quarter of the bytes of the float32 one.
        images = images.transpose([0, 3, 1, 2]).astype("float32")
        if self._stats is None:  # device constants, made once (not a host copy per batch)
            self._stats = tuple(
                paddle.to_tensor(a) for a in self.task.pixel_scale_shift(self._model_spec)
            )
        scale, shift = self._stats
        return images * scale + shift

    # --- model and optimization ---------------------------------------------------------------
    def build(
        self, model, optim, input_shape: tuple[int, int, int], num_classes: int, total_steps: int
    ) -> None:
        # Paddle's BatchNorm warns on every training forward that it tracks running statistics,
        # which it always did; the message says nothing to act on.
        warnings.filterwarnings("ignore", "When training, we now always track global mean")
        self._model_spec, self._stats = self.task.model(model.name), None  # its normalization
        with self._own_names():
            self.net = build_model(
                self.task.model(model.name),
                num_classes,
                input_shape=input_shape,
                hidden_size=model.hidden_size,
            )
            if self.train.compile:
                # Dynamic-to-static: the bare model's forward is traced into a static program at
                # the first step. to_static replaces the Layer's forward in place and returns the
                # Layer itself: self.net stays the object whose parameters checkpoints save.
                # Traced first, wrapped second (PaddleOCR's order): DataParallel's forward is
                # dygraph-only (it prepares the gradient all-reduce for the outputs), and
                # to_static over it fails at the first step ("requires 0 arguments").
                self.net = paddle.jit.to_static(self.net, full_graph=True)
            self.model = paddle.DataParallel(self.net) if self.dist.world_size > 1 else self.net
            factor = lr_factor(optim.schedule, optim.warmup_steps, total_steps)
            self.schedule_name = optim.schedule
            self.scheduler = paddle.optimizer.lr.LambdaDecay(optim.lr, factor)
            self.optimizer = _make_optimizer(self.net, optim, self.scheduler)
        self._trainable = [p for p in self.net.parameters() if p.trainable]
        self.grad_clip = optim.grad_clip
        self.amp_dtype = common.amp_dtype(self.train.amp, self.gpu_id is not None)
        # Only fp16 needs loss scaling: bf16 has float32's exponent range.
        self.scaler = paddle.amp.GradScaler() if self.amp_dtype == "float16" else None

    @contextlib.contextmanager
    def _own_names(self) -> Iterator[None]:
        # switch() swaps (name generator, parameter-name checker); no args: fresh ones.
        previous = unique_name.switch(*self._names) if self._names else unique_name.switch()
        try:
            yield
        finally:
            self._names = unique_name.switch(*previous)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return paddle.amp.auto_cast(level="O1", dtype=self.amp_dtype)

    def _set_training(self, training: bool) -> None:
        if self._training_mode == training:  # train()/eval() walk every layer: only on change
            return
        if training:
            self.model.train()
        else:
            self.model.eval()
        self._training_mode = training

    def reschedule(self, step: int, total_steps: int, warmup_steps: int) -> None:
        # LambdaDecay's lr after n steps: base_lr * lr_lambda(n), with last_epoch = n; the
        # optimizer reads last_lr.
        self.scheduler.lr_lambda = lr_factor(self.schedule_name, warmup_steps, total_steps)
        self.scheduler.last_epoch = step
        self.scheduler.last_lr = self.scheduler.get_lr()

    def train_step(self, batch: dict[str, Any]) -> paddle.Tensor:
        self._set_training(True)
        self._reseed()
        # The forward pass updates BatchNorm's running statistics (parameters that take no
        # gradient) before the loss is known: kept, so that a NaN/Inf step can put them back.
        stats = [p for p in self.net.parameters() if p.stop_gradient]
        saved = [p.detach().clone() for p in stats]
        with self._autocast():
            logits = self.model(batch["image"])
        loss = self._head.loss(logits.astype("float32"), batch)  # losses in float32 under AMP
        # Accumulators are created on the first optimizer step: name them from our generator.
        with self._own_names():
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            loss = loss.detach()
            if self.scaler is not None:  # the true gradients are checked, clipped and stepped
                self.scaler.unscale_(self.optimizer)
            nonfinite, skip = self._finite_on_all_ranks(loss)
            self._clip_gradients()
            # Skipped on the device: a copy of the weights and of the optimizer's state taken
            # before the step is put back where skip is set. Paddle 2.6's own skip (found_inf
            # for Adam, SkipUpdate) is a host branch in dygraph, a read per step.
            state = self._optimizer_state()
            before = [t.clone() for t in state]
            if self.scaler is None:
                self.optimizer.step()
            else:
                # fp16: step() skips an overflowed step and update() adapts the scale, both on
                # the host (Paddle 2.6's dynamic loss scaling reads found_inf each step). Not
                # minimize(): Optimizer.minimize walks the parameter list, which holds our
                # parameter groups (dicts), and fails with "must be list of Tensor, but got
                # dict".
                self.scaler.step(self.optimizer)
                self.scaler.update()
            with paddle.no_grad():
                _restore_where(skip, state, before)
                _restore_where(nonfinite, stats, saved)
        self.optimizer.clear_grad(set_to_zero=False)  # frees the gradients, like set_to_none
        self.scheduler.step()
        self.step += 1
        self._record_step(loss, nonfinite)
        return loss

    def _finite_on_all_ranks(self, loss: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Whether the loss and the gradients are finite on every rank, as two float32 [1]
        device flags that nothing here reads (a read would wait for the device every step):
        ``nonfinite`` (1.0: the loss, or outside fp16 the gradients, were NaN/Inf on some rank:
        what train.nonfinite counts) and ``skip`` (1.0: leave the weights as they are; also
        when fp16 gradients overflowed, which the scaler answers with a lower scale and is no
        error). The gradients too: CTC's loss over NaN inputs can be finite while its gradients
        are NaN. One multi-tensor check over all gradients (the op GradScaler unscales with,
        at a scale of 1: finite gradients stay bit for bit), not a reduction per tensor."""
        bad_loss = paddle.logical_not(paddle.isfinite(loss.astype("float32").reshape([1])))
        bad_loss = bad_loss.astype("float32")
        overflow = paddle.zeros([1], dtype="bool")
        grads = [p.grad for p in self._trainable if p.grad is not None]
        if grads:
            one = paddle.ones([1], dtype="float32")
            _legacy_C_ops.check_finite_and_unscale(grads, one, grads, overflow)
        overflow = overflow.astype("float32")
        first = bad_loss if self.scaler is not None else paddle.maximum(bad_loss, overflow)
        flags = paddle.concat([first, overflow])
        if self.dist.world_size > 1:  # every rank skips or none does (the next step agrees)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # a collective, not a host read
        nonfinite = flags[0:1]
        return nonfinite, paddle.maximum(nonfinite, flags[1:2])

    def _optimizer_state(self) -> list[paddle.Tensor]:
        """The tensors a step changes on the device: the trainable weights and the optimizer's
        accumulators (made here before the first step, so that it too can be undone). Paddle
        2.6 keeps Adam's beta powers on the host when training on a GPU (one float each, the
        step count of its bias correction): those a skipped step advances, as if it counted
        (restoring them would need the flag on the host); on the CPU they are restored too."""
        optimizer = self.optimizer
        block = paddle.static.default_main_program().global_block()
        if optimizer.helper is None:  # Optimizer._apply_optimize's, made at its first step
            optimizer.helper = LayerHelper(type(optimizer).__name__)
        for group in optimizer._param_groups:  # as Optimizer._apply_optimize makes them
            params = [p for p in group["params"] if not p.stop_gradient]
            optimizer._create_accumulators(block, {**group, "params": params})
        on_gpu = self.gpu_id is not None
        accumulators = [
            t
            for by_param in optimizer._accumulators.values()
            for t in by_param.values()
            if t.place.is_gpu_place() == on_gpu
        ]
        return [*self._trainable, *accumulators]

    def _record_step(self, loss: paddle.Tensor, nonfinite: paddle.Tensor) -> None:
        """Append (loss, nonfinite) to the device-side table read_steps() hands over; it
        doubles when full (rows are written on the device: no host read)."""
        rows = self._steps_table
        if rows is None or self._steps_recorded == rows.shape[0]:
            grown = paddle.zeros([max(64, 2 * self._steps_recorded), 2], dtype="float32")
            if rows is not None:
                grown[: rows.shape[0]] = rows
            self._steps_table = rows = grown
        row = paddle.concat([loss.astype("float32").reshape([1]), nonfinite])
        rows[self._steps_recorded] = row
        self._steps_recorded += 1

    def read_steps(self) -> np.ndarray:
        recorded, self._steps_recorded = self._steps_recorded, 0
        if not recorded:
            return np.zeros((0, 2))
        return np.array(self._steps_table[:recorded].tolist(), np.float64)  # the one read

    def _clip_gradients(self) -> None:
        """optim.grad_clip: scale the gradients so that the norm of all of them together is at
        most grad_clip, as torch's clip_grad_norm_. Not the optimizer's grad_clip: with
        parameter groups, Paddle 2.6 applies it per group (Optimizer._apply_optimize), clipping
        the decayed and the undecayed parameters each to the full norm. Under fp16 train_step
        has unscaled the gradients first: the limit is on the true ones. Nothing is read on
        the host (clip_grad_norm_'s error_if_nonfinite would)."""
        if self.grad_clip is None:
            return
        paddle.nn.utils.clip_grad_norm_(self._trainable, self.grad_clip)

    def to_float(self, loss: Any) -> float:
        return float(loss.item())

    def current_lr(self) -> float:
        return float(self.optimizer.get_lr())

    def predict(self, batch: dict[str, Any]) -> np.ndarray:
        self._set_training(False)
        # The bare model, not DataParallel: evaluation needs no collectives.
        with paddle.no_grad(), self._autocast():
            logits = self.net(batch["image"])
        return self._head.decode(logits)

    def to_numpy(self, tensor: paddle.Tensor) -> np.ndarray:
        return tensor.numpy()

    def num_parameters(self) -> int:
        # Trainable only: Paddle keeps BatchNorm running statistics as (frozen) parameters,
        # where torch has buffers; this way both backends count the same model alike.
        return sum(int(np.prod(p.shape)) for p in self.net.parameters() if p.trainable)

    # --- checkpoints -------------------------------------------------------------------------
    def save_state(self, directory: Path) -> None:
        """model.npz and optimizer.npz (tensors), state.json (everything else)."""
        directory = Path(directory)
        model = {name: tensor.numpy() for name, tensor in self.net.state_dict().items()}
        np.savez(directory / MODEL_FILE, **model)
        np.savez(directory / OPTIMIZER_FILE, **self._optimizer_tensors())
        scaler = self.scaler.state_dict() if self.scaler is not None else None
        if scaler:
            scaler["scale"] = [float(v) for v in np.ravel(scaler["scale"])]
        kind, keys, position, has_gauss, cached = np.random.get_state()
        state = {
            "format": STATE_FORMAT,
            "framework": "paddle",
            "step": self.step,
            "seed": self.seed,
            "lr_scheduler": self.scheduler.state_dict(),
            "grad_scaler": scaler,
            "python_random": random.getstate(),
            "numpy_random": [kind, keys.tolist(), position, has_gauss, cached],
        }
        (directory / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")

    def _optimizer_tensors(self) -> dict[str, np.ndarray]:
        state = self.optimizer.state_dict()
        if state.get("master_weights"):  # only with AMP O2, which this backend does not use
            raise NotImplementedError("saving master weights (AMP O2) is not supported")
        skip = ("LR_Scheduler", "master_weights")
        return {name: value.numpy() for name, value in state.items() if name not in skip}

    def load_state(self, directory: Path) -> None:
        directory = Path(directory)
        state = _read_state(directory / STATE_FILE)
        model = _load_npz(directory / MODEL_FILE)
        _check_same_tensors(directory / MODEL_FILE, model, self.net.state_dict())
        self.net.set_state_dict(model)
        # Accumulators made before this call (load after training steps) get the values now;
        # otherwise Paddle keeps them and fills each accumulator when the first step makes it.
        # The optimizer also hands LR_Scheduler to the schedule.
        optimizer = _load_npz(directory / OPTIMIZER_FILE)
        self.optimizer.set_state_dict({**optimizer, "LR_Scheduler": state["lr_scheduler"]})
        scaler = state.get("grad_scaler")
        if self.scaler is not None and scaler:
            self.scaler.load_state_dict({**scaler, "scale": np.array(scaler["scale"], "float32")})
        version, internal, gauss = state["python_random"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, position, has_gauss, cached = state["numpy_random"]
        np.random.set_state((kind, np.array(keys, np.uint32), position, has_gauss, cached))
        self.step, self.seed = int(state["step"]), int(state["seed"])

    def infer(self, images: np.ndarray) -> np.ndarray:
        self._set_training(False)
        with paddle.no_grad():
            scores = self.net(paddle.to_tensor(np.ascontiguousarray(images), place=self.place))
        return scores.astype("float32").numpy()

    def export(self, directory: Path, fmt: str, input_shape, pad: float | None) -> list[Path]:
        from train.backends.paddle.export import export

        self._set_training(False)
        return export(self.net, fmt, directory, input_shape, pad, self._head.probabilities)

    def init_weights_from(self, path: str | Path) -> weights.InitReport:
        """model.init_from (after build): load the tensors of ``path`` whose names and shapes
        are the model's; the rest keeps its fresh initialization. No optimizer state."""
        source = weights.source_for(path, "paddle")
        if source.kind == "checkpoint":
            state = _load_npz(source.path / MODEL_FILE)
        else:
            state = weights.read_pdparams(source.path)
        loaded, report = weights.select(
            state, self.net.state_dict(), str(source.path), lambda v: isinstance(v, np.ndarray)
        )
        with warnings.catch_warnings():  # one "Skip loading" per key the report names already
            warnings.filterwarnings("ignore", "Skip loading for")
            self.net.set_state_dict(loaded)
        return report

    # --- distributed and telemetry -----------------------------------------------------------
    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        if self.dist.world_size == 1:
            return values
        tensor = paddle.to_tensor(np.asarray(values, dtype=np.float64), place=self.place)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.numpy()

    def sync_buffers(self) -> None:
        if self.dist.world_size > 1:
            # Paddle keeps BatchNorm's running statistics as untrained parameters. The state
            # dict, not buffers(): the LSTM's scratch dropout state has no place to send from.
            for tensor in self.net.state_dict().values():
                if not getattr(tensor, "trainable", False):
                    dist.broadcast(tensor, src=0)

    def barrier(self) -> None:
        if self.dist.world_size > 1:
            dist.barrier()

    def synchronize(self) -> None:
        if self.gpu_id is not None:
            paddle.device.cuda.synchronize(self.gpu_id)

    def profile_range(self, name: str) -> contextlib.AbstractContextManager:
        if not self.train.profile:
            return contextlib.nullcontext()
        return paddle.profiler.RecordEvent(name)  # shows in paddle.profiler timelines

    def scalar_writer(self, log_dir: Path) -> Any | None:
        try:
            from visualdl import LogWriter

            return LogWriter(logdir=str(log_dir))
        except Exception:  # visualdl is not installed: no scalar log
            return None

    def shutdown(self) -> None:
        if self.dist.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _allow_tf32() -> None:
    """TF32 tensor cores for float32 matrix multiplies (cuBLAS) and convolutions (cuDNN): Paddle
    2.6's defaults, said explicitly because the torch backend sets the same (see its
    _allow_tf32). Only CUDA builds have these switches."""
    core = paddle.base.core
    for switch in ("set_cublas_switch", "set_cudnn_switch"):
        if hasattr(core, switch):
            getattr(core, switch)(True)


def cuda_facts() -> FrameworkCuda:
    """What this Paddle build says about CUDA (as train/gpu_probe.py's probe asks it): whether
    it is a CUDA build and the GPUs it can use."""
    compiled = bool(paddle.device.is_compiled_with_cuda())
    count, said = 0, ""
    if compiled:
        try:
            count = paddle.device.cuda.device_count()
        except Exception as error:  # a CUDA runtime that cannot start
            said = str(error).strip().splitlines()[0][:500] if str(error).strip() else ""
    return FrameworkCuda(
        "paddle",
        version=paddle.__version__,
        cuda=paddle.version.cuda() if compiled else None,
        compiled=compiled,
        count=count,
        warnings=said,
    )


def _set_flags_that_exist(**flags: Any) -> None:
    """paddle.set_flags, skipping flags this build does not define (CUDA-only ones on CPU)."""
    for name, value in flags.items():
        try:
            paddle.set_flags({name: value})
        except ValueError:
            log.debug("this Paddle build has no %s; not set", name)


def _restore_where(flag: paddle.Tensor, tensors: list, copies: list) -> None:
    """Each tensor back to its copy where ``flag`` (a [1] device tensor) is 1, on the device:
    paddle.assign, not set_value, which goes through a host array."""
    keep = flag.astype("bool")
    for tensor, copy in zip(tensors, copies):
        paddle.assign(paddle.where(keep, copy, tensor), output=tensor)


def _make_optimizer(net: paddle.nn.Layer, optim, schedule) -> paddle.optimizer.Optimizer:
    """optim is a train.config.OptimConfig; weight decay by train/schedule.py's rule. Only
    trainable parameters: Paddle keeps BatchNorm's running statistics as frozen ones. No
    grad_clip here: PaddleBackend._clip_gradients clips over all groups together."""
    groups = weight_decay_groups([p for p in net.parameters() if p.trainable], optim.weight_decay)
    if optim.name == "sgd":
        return paddle.optimizer.Momentum(schedule, momentum=optim.momentum, parameters=groups)
    optimizer_class = paddle.optimizer.Adam if optim.name == "adam" else paddle.optimizer.AdamW
    return optimizer_class(schedule, parameters=groups)


def _read_state(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path.parent} has no {path.name}; it is incomplete or not a paddle "
            f"checkpoint (expected {MODEL_FILE}, {OPTIMIZER_FILE} and {STATE_FILE})"
        )
    state = json.loads(path.read_text(encoding="utf-8"))
    if state.get("framework") != "paddle" or state.get("format") != STATE_FORMAT:
        raise ValueError(
            f"{path}: framework {state.get('framework')!r}, format {state.get('format')!r}; "
            f"this backend reads paddle checkpoints of format {STATE_FORMAT}"
        )
    return state


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array in ``path``, refusing pickled objects: unpickling could run code from
    whoever wrote the file."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    arrays: dict[str, np.ndarray] = {}
    entry = ""
    try:
        with np.load(path, allow_pickle=False) as npz:
            for entry in npz.files:
                arrays[entry] = npz[entry]
    except ValueError as error:
        if "pickle" not in str(error):
            raise
        where = f" (entry {entry!r})" if entry else ""
        holds = "a pickled Python object (or is no .npz at all)"
        raise refuse_pickle(
            f"{path}{where}", holds, "numpy allow_pickle=False", str(error)
        ) from error
    return arrays


def _check_same_tensors(path: Path, loaded: dict[str, np.ndarray], expected: dict) -> None:
    """Fail with the names, not deep inside Paddle, when a checkpoint belongs to another model."""
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    reshaped = [
        f"{name} {list(loaded[name].shape)} vs {list(expected[name].shape)}"
        for name in sorted(set(loaded) & set(expected))
        if list(loaded[name].shape) != list(expected[name].shape)
    ]
    if missing or unexpected or reshaped:
        raise ValueError(
            f"{path} does not fit this model (did model.name, model.hidden_size or "
            "data.image_shape change?): "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}, shape {reshaped[:5]}"
        )
