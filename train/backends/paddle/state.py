"""The Paddle backend's StateIO (train/backends/base.py): checkpoints as numpy .npz (tensors)
and JSON (everything else), read back with allow_pickle=False, and model.init_from."""

from __future__ import annotations

import json
import random
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from train import weights
from train.backends import common
from train.checkpoint import refuse_pickle

STATE_FORMAT = 1
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.npz", "optimizer.npz", "state.json"


def _write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``arrays`` as np.savez writes them (one uncompressed ZIP64 member NAME.npy each), with
    the ZIP file closed when a write fails (disk full, the file-size limit). np.savez leaves it
    open then: its close at garbage collection fails the same way, and Python prints that as
    "Exception ignored" with a traceback after the run's one-line error."""
    with zipfile.ZipFile(path, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as npz:
        for name, array in arrays.items():
            with npz.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


class PaddleState(common.InitFrom):
    """The Trainer's model, optimizer, schedule, scaler and step count, the run's seed and
    Python's and numpy's generators, to and from a checkpoint directory. Paddle's own
    generators need no saving: they are reseeded from (seed, step) every step."""

    framework = "paddle"

    def __init__(self, runtime, trainer) -> None:
        self.runtime, self.trainer = runtime, trainer

    def prepare_save(self) -> None:
        """Nothing to gather: every rank's generator states follow from (seed, step)."""

    def save_state(self, directory: Path) -> None:
        """model.npz and optimizer.npz (tensors), state.json (everything else)."""
        directory, trainer = Path(directory), self.trainer
        model = {name: tensor.numpy() for name, tensor in trainer.net.state_dict().items()}
        _write_npz(directory / MODEL_FILE, model)
        _write_npz(directory / OPTIMIZER_FILE, self.optimizer_tensors())
        scaler = trainer.scaler.state_dict() if trainer.scaler is not None else None
        if scaler:
            scaler["scale"] = [float(v) for v in np.ravel(scaler["scale"])]
        kind, keys, position, has_gauss, cached = np.random.get_state()
        state = {
            "format": STATE_FORMAT,
            "framework": "paddle",
            "step": trainer.step,
            "seed": self.runtime.seed,
            "lr_scheduler": trainer.scheduler.state_dict(),
            "grad_scaler": scaler,
            "python_random": random.getstate(),
            "numpy_random": [kind, keys.tolist(), position, has_gauss, cached],
        }
        (directory / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")

    def optimizer_tensors(self) -> dict[str, np.ndarray]:
        """The optimizer's state as arrays by name, as optimizer.npz holds it."""
        state = self.trainer.optimizer.state_dict()
        if state.get("master_weights"):  # only with AMP O2, which this backend does not use
            raise NotImplementedError("saving master weights (AMP O2) is not supported")
        skip = ("LR_Scheduler", "master_weights")
        return {name: value.numpy() for name, value in state.items() if name not in skip}

    def load_state(self, directory: Path) -> None:
        directory, trainer = Path(directory), self.trainer
        state = _read_state(directory / STATE_FILE)
        model = _load_npz(directory / MODEL_FILE)
        _check_same_tensors(directory / MODEL_FILE, model, trainer.net.state_dict())
        trainer.net.set_state_dict(model)
        # Accumulators made before this call (load after training steps) get the values now;
        # otherwise Paddle keeps them and fills each accumulator when the first step makes it.
        # The optimizer also hands LR_Scheduler to the schedule.
        optimizer = _load_npz(directory / OPTIMIZER_FILE)
        trainer.optimizer.set_state_dict({**optimizer, "LR_Scheduler": state["lr_scheduler"]})
        scaler = state.get("grad_scaler")
        if trainer.scaler is not None and scaler:
            scale = np.array(scaler["scale"], "float32")
            trainer.scaler.load_state_dict({**scaler, "scale": scale})
        version, internal, gauss = state["python_random"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, position, has_gauss, cached = state["numpy_random"]
        np.random.set_state((kind, np.array(keys, np.uint32), position, has_gauss, cached))
        trainer.step, self.runtime.seed = int(state["step"]), int(state["seed"])

    # --- model.init_from (common.InitFrom) ----------------------------------------------------
    def read_weights(self, source: weights.WeightsSource) -> dict[str, Any]:
        if source.kind == "checkpoint":
            return _load_npz(source.path / MODEL_FILE)
        return weights.read_pdparams(source.path)

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, np.ndarray)

    def load_fitting(self, state: dict[str, Any]) -> None:
        with warnings.catch_warnings():  # one "Skip loading" per key the report names already
            warnings.filterwarnings("ignore", "Skip loading for")
            self.trainer.net.set_state_dict(state)


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
