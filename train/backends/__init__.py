"""Framework backends: the only code in the project that imports torch or paddle.

``base.py`` is the contract the training loop calls, five parts composed by one ``Backend``;
``torch/`` and ``paddle/`` implement each part; ``common.py`` holds what both do that needs no
framework. The backends are registered here,
and only the one a config asks for is imported.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from train.backends.base import Backend

# config.framework -> the module and class that implement train/backends/base.py's contract.
BACKENDS = {
    "torch": ("train.backends.torch.backend", "TorchBackend"),
    "paddle": ("train.backends.paddle.backend", "PaddleBackend"),
}


# The environment variable in which each framework's launcher (torchrun,
# python -m paddle.distributed.launch) gives a process its rank.
RANK_VARIABLES = {"torch": "RANK", "paddle": "PADDLE_TRAINER_ID"}


def launcher_rank(framework: str) -> int:
    """This process's rank, as its launcher set it, without importing the framework."""
    return int(os.environ.get(RANK_VARIABLES[framework], "0"))


def make_backend(config) -> Backend:
    """The backend ``config.framework`` names, for the config's task and train: section."""
    module, name = BACKENDS[config.framework]
    return getattr(importlib.import_module(module), name)(config.task, config.train)
