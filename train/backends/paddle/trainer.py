"""The Paddle backend's Trainer (train/backends/base.py): the model (to_static, DataParallel),
the optimizer and schedule, AMP, and the step that flags a NaN/Inf update and, under
train.nonfinite: skip, undoes it on the device."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle import _C_ops, _legacy_C_ops
from paddle.base.layer_helper import LayerHelper
from paddle.utils import unique_name

from train.backends import common
from train.backends.paddle.models import HEADS, build_model
from train.schedule import lr_factor, weight_decay_groups


class PaddleTrainer(common.TrainerBase):
    """The model (``net`` bare, ``model`` as train_step calls it), its optimizer, schedule and
    AMP scaler, and the step: nothing in it waits for the device. ``step`` counts optimizer
    steps and seeds Paddle's generators per step (_reseed), so StateIO saves it."""

    def __init__(self, task, runtime) -> None:
        super().__init__(task, runtime)
        self.amp_dtype: str | None = None  # "float16" | "bfloat16" | None
        self.grad_clip: float | None = None  # optim.grad_clip
        self.schedule_name = ""
        self.step = 0  # optimizer steps taken
        self._trainable: list[paddle.Tensor] = []  # the parameters the optimizer steps
        # Parameter and optimizer-accumulator names come from this generator, not the
        # process-wide one, so they are the same in every process and every backend instance:
        # Paddle's optimizer state is keyed by them.
        self._names: Any = None
        self.head = HEADS[self.task.loss]  # the loss and decoding of the task's loss kind
        self.steps = common.StepTable(
            zeros=lambda rows, like: paddle.zeros([rows, 2], dtype="float32"),
            row=lambda loss, flag: paddle.concat([loss.astype("float32").reshape([1]), flag]),
        )

    def build(
        self, model, optim, input_shape: tuple[int, int, int], num_classes: int, total_steps: int
    ) -> None:
        # Paddle's BatchNorm warns on every training forward that it tracks running statistics,
        # which it always did; the message says nothing to act on.
        warnings.filterwarnings("ignore", "When training, we now always track global mean")
        with self._own_names():
            self.net = build_model(
                self.task.model(model.name),
                num_classes,
                input_shape=input_shape,
                hidden_size=model.hidden_size,
            )
            if self.runtime.train.compile:
                # Dynamic-to-static: the bare model's forward is traced into a static program at
                # the first step. to_static replaces the Layer's forward in place and returns the
                # Layer itself: self.net stays the object whose parameters checkpoints save.
                # Traced first, wrapped second (PaddleOCR's order): DataParallel's forward is
                # dygraph-only (it prepares the gradient all-reduce for the outputs), and
                # to_static over it fails at the first step ("requires 0 arguments").
                self.net = paddle.jit.to_static(self.net, full_graph=True)
            parallel = self.runtime.dist.world_size > 1
            self.model = paddle.DataParallel(self.net) if parallel else self.net
            factor = lr_factor(optim.schedule, optim.warmup_steps, total_steps)
            self.schedule_name = optim.schedule
            self.scheduler = paddle.optimizer.lr.LambdaDecay(optim.lr, factor)
            self.optimizer = _make_optimizer(self.net, optim, self.scheduler)
        self._trainable = [p for p in self.net.parameters() if p.trainable]
        self.grad_clip = optim.grad_clip
        self.amp_dtype = common.amp_dtype(self.runtime.train.amp, self.runtime.gpu_id is not None)
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

    def reschedule(self, step: int, total_steps: int, warmup_steps: int) -> None:
        # LambdaDecay's lr after n steps: base_lr * lr_lambda(n), with last_epoch = n; the
        # optimizer reads last_lr.
        self.scheduler.lr_lambda = lr_factor(self.schedule_name, warmup_steps, total_steps)
        self.scheduler.last_epoch = step
        self.scheduler.last_lr = self.scheduler.get_lr()

    def _reseed(self) -> None:
        """Seed Paddle's generators from (seed, step) before every step.

        Paddle 2.6 cannot restore its CPU generator from plain data: GeneratorState pickles to
        (device, seed, offset) only, without the Mersenne-Twister position, and has no other
        serializable form. A state that is a pure function of (seed, step) needs none: a resumed
        run draws exactly what the uninterrupted one drew (dropout masks, for instance).
        """
        sequence = np.random.SeedSequence([self.runtime.seed, self.step])
        paddle.seed(int(sequence.generate_state(1, np.uint64)[0] >> np.uint64(1)))

    def train_step(self, batch: dict[str, Any]) -> paddle.Tensor:
        self.set_training(True)
        self._reseed()
        # Under skip a NaN/Inf step is undone: its update and the BatchNorm statistics its
        # forward pass changed, from copies taken before (two ops a tensor, every step). Under
        # abort the run ends at the loop's next read of the flags, which comes before any
        # evaluation or checkpoint (train/nonfinite.py), so the bad update is never used and
        # nothing is copied.
        undo = self.runtime.train.nonfinite == "skip"
        # The forward pass updates BatchNorm's running statistics (parameters that take no
        # gradient) before the loss is known.
        stats = [p for p in self.net.parameters() if p.stop_gradient] if undo else []
        saved = [p.detach().clone() for p in stats]
        with self._autocast():
            logits = self.model(batch["image"])
        loss = self.head.loss(logits.astype("float32"), batch)  # losses in float32 under AMP
        # Accumulators are created on the first optimizer step: name them from our generator.
        with self._own_names():
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            loss = loss.detach()
            if self.scaler is not None:  # the true gradients are checked, clipped and stepped
                self.scaler.unscale_(self.optimizer)
            nonfinite, skip = self._finite_on_all_ranks(loss)
            if self.grad_clip is not None:
                # Over all the gradients together, as torch's clip_grad_norm_. Not the
                # optimizer's grad_clip: with parameter groups, Paddle 2.6 applies it per group
                # (Optimizer._apply_optimize), clipping the decayed and the undecayed
                # parameters each to the full norm. Nothing is read on the host.
                paddle.nn.utils.clip_grad_norm_(self._trainable, self.grad_clip)
            # Undone on the device: Paddle 2.6's own skip (found_inf for Adam, SkipUpdate) is a
            # host branch in dygraph, a read per step. Under fp16 the scaler's own skip covers
            # overflowed gradients only, not a NaN/Inf loss over finite ones: still undone here.
            state = self._stepped_state() if undo else []
            before = [t.clone() for t in state]
            self._optimizer_step()
            if undo:
                with paddle.no_grad():
                    _restore_where(skip, state, before)
                    _restore_where(nonfinite, stats, saved)
        self.optimizer.clear_grad(set_to_zero=False)  # frees the gradients, like set_to_none
        self.scheduler.step()
        self.step += 1
        self.steps.record(loss, nonfinite)
        return loss

    def _stepped_state(self) -> list[paddle.Tensor]:
        """What an optimizer step changes on the device: the trainable parameters and the
        optimizer's accumulators."""
        return [*self._trainable, *_accumulators(self.optimizer, self.runtime.gpu_id)]

    def _optimizer_step(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
            return
        # fp16: step() skips an overflowed step and update() adapts the scale, both on the host
        # (Paddle 2.6's dynamic loss scaling reads found_inf each step). Not minimize():
        # Optimizer.minimize walks the parameter list, which holds our parameter groups
        # (dicts), and fails with "must be list of Tensor, but got dict".
        self.scaler.step(self.optimizer)
        self.scaler.update()

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
        if self.runtime.dist.world_size > 1:  # every rank skips or none does
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # a collective, not a host read
        nonfinite = flags[0:1]
        return nonfinite, paddle.maximum(nonfinite, flags[1:2])

    def current_lr(self) -> float:
        return float(self.optimizer.get_lr())

    def predict(self, batch: dict[str, Any]) -> np.ndarray:
        self.set_training(False)
        # The bare model, not DataParallel: evaluation needs no collectives.
        with paddle.no_grad(), self._autocast():
            logits = self.net(batch["image"])
        return self.head.decode(logits)

    def num_parameters(self) -> int:
        # Trainable only: Paddle keeps BatchNorm running statistics as (frozen) parameters,
        # where torch has buffers; this way both backends count the same model alike.
        return sum(int(np.prod(p.shape)) for p in self.net.parameters() if p.trainable)

    def sync_buffers(self) -> None:
        if self.runtime.dist.world_size > 1:
            # Paddle keeps BatchNorm's running statistics as untrained parameters. The state
            # dict, not buffers(): the LSTM's scratch dropout state has no place to send from.
            for tensor in self.net.state_dict().values():
                if not getattr(tensor, "trainable", False):
                    dist.broadcast(tensor, src=0)


def _accumulators(optimizer: paddle.optimizer.Optimizer, gpu_id: int | None) -> list:
    """The optimizer's accumulators a step changes on the device (made here before the first
    step, so that it too can be undone). Paddle 2.6 keeps Adam's beta powers on the host when
    training on a GPU (one float each, the step count of its bias correction): those a skipped
    step advances, as if it counted (restoring them would need the flag on the host); on the
    CPU they are restored too."""
    block = paddle.static.default_main_program().global_block()
    if optimizer.helper is None:  # Optimizer._apply_optimize's, made at its first step
        optimizer.helper = LayerHelper(type(optimizer).__name__)
    for group in optimizer._param_groups:  # as Optimizer._apply_optimize makes them
        params = [p for p in group["params"] if not p.stop_gradient]
        optimizer._create_accumulators(block, {**group, "params": params})
    on_gpu = gpu_id is not None
    return [
        t
        for by_param in optimizer._accumulators.values()
        for t in by_param.values()
        if t.place.is_gpu_place() == on_gpu
    ]


def _restore_where(flag: paddle.Tensor, tensors: list, copies: list) -> None:
    """Each tensor back to its copy where ``flag`` (a [1] device tensor) is 1, on the device:
    paddle.assign, not set_value, which goes through a host array.

    Two ops per tensor, every step: the flag is expanded once per shape and the where kernel
    gets operands of one shape. paddle.where, given the [1] flag, broadcasts it with eleven ops
    per tensor (zeros_like, casts, adds over the whole tensor): for ResNet-18 on the CPU it cost
    0.2 s a call, and a step makes two calls; on a GPU each op is a kernel launch."""
    keep = flag.astype("bool")
    masks: dict[tuple[int, ...], paddle.Tensor] = {}
    for tensor, copy in zip(tensors, copies):
        shape = tuple(tensor.shape)
        if shape not in masks:
            masks[shape] = keep.reshape([]) if not shape else keep.expand(list(shape))
        paddle.assign(_C_ops.where(masks[shape], copy, tensor), output=tensor)


def _make_optimizer(net: paddle.nn.Layer, optim, schedule) -> paddle.optimizer.Optimizer:
    """optim is a train.config.schema.OptimConfig; weight decay by train/schedule.py's rule. Only
    trainable parameters: Paddle keeps BatchNorm's running statistics as frozen ones. No
    grad_clip here: PaddleTrainer.train_step clips over all groups together."""
    groups = weight_decay_groups([p for p in net.parameters() if p.trainable], optim.weight_decay)
    if optim.name == "sgd":
        return paddle.optimizer.Momentum(schedule, momentum=optim.momentum, parameters=groups)
    optimizer_class = paddle.optimizer.Adam if optim.name == "adam" else paddle.optimizer.AdamW
    return optimizer_class(schedule, parameters=groups)
