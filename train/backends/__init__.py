"""Framework backends: the only code in the project that imports torch or paddle.

``base.py`` is the contract the training loop calls, five parts composed by one ``Backend``;
``torch/`` and ``paddle/`` implement each part; ``common.py`` holds what both do that needs no
framework. The backends are registered here,
and only the one a config asks for is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from train.backends.base import Backend, DistInfo

# config.framework -> the module and class that implement train/backends/base.py's contract.
BACKENDS = {
    "torch": ("train.backends.torch.backend", "TorchBackend"),
    "paddle": ("train.backends.paddle.backend", "PaddleBackend"),
}


def launcher_dist(framework: str) -> DistInfo:
    """This process's place among the ranks, as its framework's launcher (torchrun, python -m
    paddle.distributed.launch) set it in the environment, read without importing the framework:
    the run directory's writer and the data's resolution know it before the backend exists, and
    the backend's runtime reads the same. A process started alone is rank 0 of 1."""
    from train.backends.base import DistInfo

    env = os.environ
    if framework == "paddle":
        world_size = int(env.get("PADDLE_TRAINERS_NUM", "1"))
        return DistInfo(
            rank=int(env.get("PADDLE_TRAINER_ID", "0")),
            world_size=world_size,
            local_rank=int(env.get("PADDLE_LOCAL_RANK", env.get("PADDLE_RANK_IN_NODE", "0"))),
            local_world_size=int(env.get("PADDLE_LOCAL_SIZE", str(world_size))),
        )
    world_size = int(env.get("WORLD_SIZE", "1"))
    return DistInfo(
        rank=int(env.get("RANK", "0")),
        world_size=world_size,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world_size))),
    )


def make_backend(config) -> Backend:
    """The backend ``config.framework`` names, for the config's task and train: section; a
    ConfigError (exit 2, one line) when this Python lacks that framework, the most common cause
    being the other framework's environment (the venvs and images hold one framework each)."""
    module, name = BACKENDS[config.framework]
    if importlib.util.find_spec(config.framework) is None:
        from train.config.errors import ConfigError

        others = [other for other in BACKENDS if other != config.framework]
        raise ConfigError(
            "framework",
            f"{config.framework}, which this Python ({sys.executable}) does not have",
            f"run with the {config.framework} environment (.venv-{config.framework}/bin/python "
            f"from make setup, or the {config.framework} image), or set framework: "
            + " or ".join(others),
        )
    return getattr(importlib.import_module(module), name)(config.task, config.train)
