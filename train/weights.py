"""model.init_from: a new run starts from another run's weights (fine-tuning), framework-free.

A source is one of our checkpoint directories (``checkpoints/step-XXXXXXXX`` or ``best/``), a
run directory (its best checkpoint, else its latest), a torch state-dict file (``.pt``/``.pth``)
or a Paddle ``.pdparams``. Each backend reads the source into name -> array
(``Backend.init_weights_from``) and loads what ``match`` says fits: tensors whose name and
shape are the model's. The rest keeps the model's fresh initialization (a new head for another
dictionary or class count), and the report names every key that did not load. Optimizer state
never loads: the new run's optimizer starts fresh. On --resume the checkpoint wins and
init_from is ignored (apply_init_from logs so).
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from train import checkpoint

log = logging.getLogger(__name__)

# Weight files by suffix, and the framework that reads each.
WEIGHT_FILES = {".pt": "torch", ".pth": "torch", ".pdparams": "paddle"}
REPORT_FILE = "init_from.json"  # in the run directory
SOURCES_HINT = (
    "point model.init_from at a checkpoint directory (RUN/checkpoints/step-XXXXXXXX or "
    "RUN/best), a run directory, a torch .pt/.pth state dict or a Paddle .pdparams file"
)


class InitFromError(checkpoint.CheckpointError):
    """model.init_from names something that cannot give weights to this model."""


@dataclass(frozen=True)
class WeightsSource:
    path: Path  # the checkpoint directory or weight file that is read
    kind: str  # "checkpoint" (ours) or "file" (a framework's weight file)
    framework: str  # the framework that wrote it ("torch" or "paddle")


def source_problem(path: str) -> tuple[str, str] | None:
    """(problem, fix) when ``path`` cannot be a weights source, else None (config validation
    calls this, so a bad model.init_from fails before any data is read)."""
    try:
        resolve_source(path)
    except InitFromError as error:
        text = str(error)
        problem, _, fix = text.partition(" HINT: ")
        return problem, fix or SOURCES_HINT
    return None


def resolve_source(path: str | Path) -> WeightsSource:
    """What ``path`` names: our checkpoint (a run directory: its best, else its latest) or a
    framework's weight file."""
    given = Path(path)
    if given.is_file():
        framework = WEIGHT_FILES.get(given.suffix.lower())
        if framework is None:
            raise InitFromError(
                f"{given} is a {given.suffix or 'suffix-less'} file, not a known weight file. "
                f"HINT: {SOURCES_HINT}"
            )
        return WeightsSource(given, "file", framework)
    if given.is_dir():
        found = given if (given / "trainer.json").is_file() else checkpoint.best_or_latest(given)
        if found is None:
            raise InitFromError(
                f"{given} is a directory without a checkpoint (no trainer.json, no best/, no "
                f"complete checkpoints/step-*). HINT: {SOURCES_HINT}"
            )
        meta = json.loads((found / "trainer.json").read_text(encoding="utf-8"))
        return WeightsSource(found, "checkpoint", meta["framework"])
    raise InitFromError(f"{given} does not exist. HINT: {SOURCES_HINT}")


@dataclass
class InitReport:
    """What loaded from a source into the model, and what kept its fresh initialization."""

    source: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # in the model, not in the source
    unexpected: list[str] = field(default_factory=list)  # in the source, not in the model
    # name -> [the source's shape, the model's shape]: kept fresh (e.g. a new head)
    shape_mismatched: dict[str, list[list[int]]] = field(default_factory=dict)

    def summary(self) -> str:
        mismatched = [
            f"{name}: {source} -> {model}"
            for name, (source, model) in self.shape_mismatched.items()
        ]
        return (
            f"model.init_from {self.source}: loaded {len(self.loaded)} tensors; "
            f"missing {self.missing}; unexpected {self.unexpected}; "
            f"shape-mismatched {mismatched} (missing and shape-mismatched keep their fresh "
            "initialization; optimizer state is not loaded)"
        )


# What a framework's own weight files are, for the error naming the file a run can take.
FRAMEWORK_FILES = {"torch": "a .pt/.pth state dict", "paddle": "a .pdparams file"}


def source_for(path: str | Path, framework: str) -> WeightsSource:
    """``path`` resolved (resolve_source), refused unless ``framework`` wrote it: a run of one
    framework cannot read the other's tensors by name."""
    source = resolve_source(path)
    if source.framework != framework:
        raise InitFromError(
            f"model.init_from {source.path} was written by {source.framework}; this run "
            f"trains with {framework}. HINT: use a {framework} checkpoint or "
            f"{FRAMEWORK_FILES[framework]}"
        )
    return source


def select(
    state: Mapping[str, Any], model: Mapping[str, Any], origin: str, is_tensor
) -> tuple[dict[str, Any], InitReport]:
    """The tensors of ``state`` (a read weight file or checkpoint) that ``model`` (a state
    dict) takes by name and shape, and the report of what was loaded, missing, unexpected (a
    non-tensor entry included) and shape-mismatched."""
    tensors = {name: value for name, value in state.items() if is_tensor(value)}
    report = match(tensors, model, origin)
    report.unexpected += [name for name in state if name not in tensors]
    return {name: tensors[name] for name in report.loaded}, report


def match(source: Mapping[str, Any], model: Mapping[str, Any], origin: str) -> InitReport:
    """Compare the source's arrays with the model's (both name -> something with .shape) and
    report which load. Names are compared exactly."""
    report = InitReport(source=origin)
    for name, value in source.items():
        if name not in model:
            report.unexpected.append(name)
            continue
        have, want = list(value.shape), list(model[name].shape)
        if have == want:
            report.loaded.append(name)
        else:
            report.shape_mismatched[name] = [have, want]
    report.missing = [name for name in model if name not in source]
    return report


def unwrap_state_dict(state: Any, path: Path) -> dict[str, Any]:
    """The state dict inside a loaded weight file: the mapping itself, or under "state_dict" or
    "model" (how training scripts often save); a "module." prefix (DataParallel) is dropped."""
    for key in ("state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
            break
    if not isinstance(state, Mapping):
        raise InitFromError(
            f"{path} holds a {type(state).__name__}, not a state dict (name -> tensor). "
            f"HINT: {SOURCES_HINT}"
        )
    names = list(state)
    if names and all(str(name).startswith("module.") for name in names):
        state = {str(name)[len("module.") :]: value for name, value in state.items()}
    return dict(state)


# What a .pdparams (paddle.save of a state dict: a pickle of name -> numpy array) may refer to.
# Anything else in the pickle could run code when unpickled, so it is refused. numpy 1.x pickles
# arrays through numpy.core.multiarray, numpy 2 through numpy._core.multiarray; numpy 1.26 and 2
# both read either name, so both are accepted whichever numpy wrote the file.
_PDPARAMS_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("collections", "OrderedDict"),
}
# paddle.save's bookkeeping beside the tensors (structured -> parameter names), not a tensor
_PDPARAMS_METADATA = "StructuredToParameterName@@"


def _latin1_bytes(text: str, encoding: str = "latin1") -> bytes:
    """What a protocol-2 pickle calls as _codecs.encode to rebuild a bytes object (an array's
    raw data): Python 2 had no bytes type, so pickle writes bytes as a latin-1 str and this call.
    Only that codec is taken, so the call can do nothing but make bytes."""
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with codec {encoding!r} (only latin1)")
    return text.encode("latin1")


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode"):  # protocol 2 (older PaddleOCR releases)
            return _latin1_bytes
        if (module, name) not in _PDPARAMS_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not a numpy array part")
        return super().find_class(module, name)


def read_pdparams(path: Path) -> dict[str, Any]:
    """The arrays of a Paddle .pdparams, read as paddle.load reads them but refusing any
    pickled object other than numpy arrays and plain containers (as torch's weights_only)."""
    try:
        with open(path, "rb") as f:
            state = _ArraysOnly(f).load()
    except pickle.UnpicklingError as error:
        holds = "pickled objects other than numpy arrays"
        reader = "an unpickler that accepts numpy arrays only"
        raise checkpoint.refuse_pickle(path, holds, reader, str(error)) from error
    state = unwrap_state_dict(state, path)
    state.pop(_PDPARAMS_METADATA, None)
    return state


def apply_init_from(config, backend, run_dir: Path, resume: bool, is_main: bool) -> None:
    """model.init_from for a new run: load the weights, log the report and write it to the run
    directory. On --resume the checkpoint wins."""
    source = config.model.init_from
    if source is None:
        return
    if resume:
        log.info("model.init_from %s ignored: resuming, the run's checkpoint wins", source)
        return
    report = backend.state.init_weights_from(source)
    log.info(report.summary())
    if is_main:
        text = json.dumps(asdict(report), indent=2)
        checkpoint.write_atomic(Path(run_dir) / REPORT_FILE, text)
