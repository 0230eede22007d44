"""The torch backend's StateIO (train/backends/base.py): checkpoints as one torch.save file per
part, read back with weights_only=True, each rank's generator states, and model.init_from."""

from __future__ import annotations

import logging
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from train import weights
from train.backends import common
from train.backends.base import DistInfo
from train.checkpoint import refuse_pickle

log = logging.getLogger(__name__)

# One file per part, so a reader can tell which part of a checkpoint is broken or missing.
STATE_FILES = ("model", "optimizer", "scheduler", "scaler", "rng")


class TorchState(common.InitFrom):
    """The Trainer's model, optimizer, schedule and scaler and this process's generators, to
    and from a checkpoint directory; only tensors and plain containers are ever unpickled."""

    framework = "torch"

    def __init__(self, runtime, trainer) -> None:
        self.runtime, self.trainer = runtime, trainer
        self._rank_rng_states: list[dict[str, Any]] | None = None  # gathered by prepare_save

    def prepare_save(self) -> None:
        """Every rank: gather each rank's generator states (torch CPU and CUDA, Python, numpy)
        to rank 0, whose save_state writes them all; a resumed rank then restores its own.
        One small collective per checkpoint (a few KB per rank)."""
        info = self.runtime.dist
        if info.world_size == 1:
            return
        gathered = [None] * info.world_size if info.is_main else None
        dist.gather_object(_rng_state(self.runtime.device), gathered, dst=0)
        self._rank_rng_states = gathered

    def save_state(self, directory: Path) -> None:
        directory = Path(directory)
        trainer = self.trainer
        rng = _rng_state(self.runtime.device)  # this process's (rank 0's): what one restores
        if self._rank_rng_states is not None:  # prepare_save's, used once: every rank's
            rng["ranks"], self._rank_rng_states = self._rank_rng_states, None
        parts = {
            "model": trainer.net.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "scaler": trainer.scaler.state_dict(),
            "rng": rng,
        }
        for name, state in parts.items():
            torch.save(state, directory / f"{name}.pt")

    def load_state(self, directory: Path) -> None:
        directory, trainer, device = Path(directory), self.trainer, self.runtime.device
        trainer.net.load_state_dict(_load(directory, "model", device))
        # Read onto the CPU: load_state_dict moves each parameter's state to that parameter's
        # device itself, the step counts of the fused optimizers included (_load_as_fused).
        trainer.optimizer.load_state_dict(_load(directory, "optimizer", "cpu"))
        trainer.scheduler.load_state_dict(_load(directory, "scheduler", "cpu"))
        scaler = _scaler_state_to_load(
            _load(directory, "scaler", "cpu"), trainer.scaler.is_enabled()
        )
        if scaler is not None:
            trainer.scaler.load_state_dict(scaler)
        rng = _load(directory, "rng", "cpu")
        _set_rng_state(_rank_rng_state(rng, self.runtime.dist), device)

    # --- model.init_from (common.InitFrom) ----------------------------------------------------
    def read_weights(self, source: weights.WeightsSource) -> dict[str, Any]:
        if source.kind == "checkpoint":
            state = _load(source.path, "model", "cpu")
        else:
            state = _torch_load(source.path, "cpu")
        return weights.unwrap_state_dict(state, source.path)

    def is_tensor(self, value: Any) -> bool:
        return torch.is_tensor(value)

    def load_fitting(self, state: dict[str, Any]) -> None:
        self.trainer.net.load_state_dict(state, strict=False)


def _load(directory: Path, name: str, map_location) -> Any:
    path = directory / f"{name}.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {directory} has no {path.name}; it is incomplete or not a torch "
            f"checkpoint (expected {', '.join(n + '.pt' for n in STATE_FILES)})"
        )
    return _torch_load(path, map_location)


def _torch_load(path: Path, map_location) -> Any:
    try:
        # weights_only: tensors and plain containers only; unpickling anything else could
        # run code from whoever wrote the file.
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        holds = "pickled objects other than tensors and plain containers"
        reader = "torch.load(weights_only=True)"
        raise refuse_pickle(path, holds, reader, str(error).splitlines()[0]) from error


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
