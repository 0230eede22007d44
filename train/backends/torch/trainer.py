"""The torch backend's Trainer (train/backends/base.py): the model wrapped for DDP and
torch.compile, the fused optimizer, the LR schedule, AMP, and the step that skips a NaN/Inf
update on the device."""

from __future__ import annotations

import contextlib
import os
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from train.backends import common
from train.backends.torch.models import HEADS, build_model, memory_format
from train.errors import RunError
from train.schedule import lr_factor, weight_decay_groups


class TorchTrainer(common.TrainerBase):
    """The model (``net`` bare, ``model`` as train_step calls it), its optimizer, schedule and
    AMP scaler, and the step: nothing in it waits for the device."""

    def __init__(self, task, runtime) -> None:
        super().__init__(task, runtime)
        self.amp_dtype: torch.dtype | None = None
        self.grad_clip: float | None = None
        self.schedule_name = ""
        self.head = HEADS[self.task.loss]  # the loss and decoding of the task's loss kind
        self.steps = common.StepTable(
            zeros=lambda rows, like: torch.zeros((rows, 2), device=like.device),
            row=lambda loss, nonfinite: torch.stack([loss.float(), nonfinite]),
        )

    def build(
        self, model, optim, input_shape: tuple[int, int, int], num_classes: int, total_steps: int
    ) -> None:
        device = self.runtime.device
        spec = self.task.model(model.name)
        net = build_model(
            spec, num_classes, input_shape=input_shape, hidden_size=model.hidden_size
        ).to(device)
        # The weights in the layout of the batches (Batches.normalize_for).
        if memory_format(device.type, spec.family) == torch.channels_last:
            net = net.to(memory_format=torch.channels_last)
        self.net = net
        self.model = net
        if self.runtime.dist.world_size > 1:
            device_ids = [device.index] if device.type == "cuda" else None
            # gradient_as_bucket_view: gradients live in the all-reduce buckets, saving a copy.
            self.model = DistributedDataParallel(
                net, device_ids=device_ids, gradient_as_bucket_view=True
            )
        if self.runtime.train.compile:
            _check_compile_toolchain(device.type)
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
        dtype = common.amp_dtype(self.runtime.train.amp, device.type == "cuda")
        self.amp_dtype = getattr(torch, dtype) if dtype else None
        # Only fp16 needs loss scaling (its exponent range is narrow); disabled, the scaler
        # passes everything through and its state is an empty dict. Under bf16 nothing runs in
        # fp16: the CRNN's LSTM, which torch's autocast would run in fp16 on cuDNN, runs in
        # float32 there (models.recurrent_dtype).
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type="cuda", dtype=self.amp_dtype)

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
        self.set_training(True)
        profile_range = self.runtime.profile_range
        # The forward pass updates BatchNorm's running statistics (and its batch counts)
        # before the loss is known: kept in one flat copy per dtype (a kernel each, a few KB to
        # MB), so that a NaN/Inf step can put them back on the device.
        buffers = _by_dtype(self.net.buffers())
        saved = [torch.cat([b.detach().reshape(-1) for b in group]) for group in buffers]
        with profile_range("forward"), self._autocast():
            scores = self.model(batch["image"])
        loss = self.head.loss(scores.float(), batch)  # losses in float32 whatever the autocast
        self.optimizer.zero_grad(set_to_none=True)
        with profile_range("backward"):
            self.scaler.scale(loss).backward()
        loss = loss.detach()
        with profile_range("optimizer"):
            # fp16: the true gradients are checked, clipped and stepped (unscale_ also records
            # the overflow check that scaler.update() adapts the scale by).
            self.scaler.unscale_(self.optimizer)  # a no-op unless fp16
            nonfinite, skip = self._finite_on_all_ranks(loss)
            if self.grad_clip is not None:  # one multi-tensor norm; nothing read on the host
                nn.utils.clip_grad_norm_(self.net.parameters(), self.grad_clip)
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
        self.steps.record(loss, nonfinite)
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
        if self.runtime.dist.world_size > 1:  # every rank skips or none does (DDP agrees)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # a collective, not a host read
        nonfinite = flags[0]
        return nonfinite, torch.maximum(nonfinite, flags[1])

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @torch.no_grad()
    def predict(self, batch: dict[str, Any]) -> np.ndarray:
        self.set_training(False)
        # The bare model, not DDP: evaluation needs no collectives, and ranks may see different
        # numbers of evaluation batches.
        with self._autocast():
            scores = self.net(batch["image"])
        return self.head.decode(scores)

    def num_parameters(self) -> int:
        return sum(parameter.numel() for parameter in self.net.parameters())

    def sync_buffers(self) -> None:
        if self.runtime.dist.world_size > 1:
            for buffer in self.net.buffers():
                dist.broadcast(buffer, src=0)


def _by_dtype(tensors: Iterator[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by dtype (each group concatenates into one flat tensor)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())


def _make_optimizer(net: nn.Module, optim) -> torch.optim.Optimizer:
    """optim is a train.config.schema.OptimConfig; weight decay by train/schedule.py's rule (none on
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
