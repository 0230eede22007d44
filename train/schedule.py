"""The optimization rules both backends share, so PaddlePaddle and PyTorch runs compare: the
learning-rate curve and which parameters weight decay applies to (framework-free)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence


def lr_factor(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The LR multiplier at each step: linear warmup, then cosine to 0, constant, or x0.1 at 1/3
    and 2/3 of total_steps. A plain function (not a callable object), so torch's LambdaLR
    state_dict stays plain data that torch.load(weights_only=True) accepts."""
    total_steps = max(1, total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:  # starts at 1/warmup, not 0: a zero-LR step would be wasted
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        if schedule == "step":
            return 0.1 ** sum(step >= total_steps * k / 3 for k in (1, 2))
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def decays(shape: Sequence[int]) -> bool:
    """The weight-decay rule: decay a parameter of two or more dimensions (conv kernels, linear
    and LSTM weight matrices), never a 1-D one (biases, BatchNorm scales and shifts), whose
    decay only fights the normalization. The common practice (timm's, PaddleOCR's)."""
    return len(shape) > 1


def weight_decay_groups(params: Iterable, weight_decay: float) -> list[dict]:
    """Optimizer parameter groups by :func:`decays`: optim.weight_decay for the parameters it
    decays, 0 for the others; an empty group is left out. ``params`` are a framework's trainable
    parameters (anything with a ``shape``); both torch and Paddle optimizers take the groups."""
    params = list(params)
    groups = [
        {"params": [p for p in params if decays(p.shape)], "weight_decay": weight_decay},
        {"params": [p for p in params if not decays(p.shape)], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]
