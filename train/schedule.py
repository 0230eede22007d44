"""The learning-rate curve, shared by both backends so PaddlePaddle and PyTorch runs compare."""

from __future__ import annotations

import math
from collections.abc import Callable


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
