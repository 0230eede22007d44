"""The released PP-OCRv4 recognizer's weights, read from its ONNX export (framework-free).

The export (ch_PP-OCRv4_rec_infer.onnx, from Paddle by paddle2onnx) stores every weight as a
Constant node named after its Paddle parameter (conv2d_157.w_0, batch_norm2d_2.w_1, ...), and
its dictionary in the metadata under ``character``. :func:`read_onnx` returns the weights in
the order the graph first uses them; :func:`map_weights` pairs them with a model's own tensors
in registration order (both backends register PP-OCRv4's layers in the graph's order), checks
every shape, and says which tensor went where. Anything that does not match stops the
conversion with :class:`WeightsError` before a file is written.

What the export changed: PP-LCNetV3's training-time blocks (parallel conv branches, each with
its batch norm) are fused into one conv with a bias per layer; the stem and the neck keep their
batch norms. The models here are that fused form, so fine-tuning starts from exactly the
released function; the fused convs then train as plain convs with bias (docs/ppocrv4.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from datasets.safe_files import write_atomic

if TYPE_CHECKING:  # numpy is imported where used: scripts/fetch_ppocrv4.py runs on a bare Python
    import numpy as np

# A Paddle parameter's name; the export's other Constants are shapes and helper scalars.
_PARAMETER = re.compile(
    r"^(conv2d|batch_norm2d|mobile_one_block|whswish_b|layer_norm|linear)_\d+\.[wb]_\d$"
)
NUM_TENSORS = 234  # the released model's weight tensors
OUTPUT_CLASSES = 6625  # blank + 6,623 characters + space


class WeightsError(Exception):
    """A weights file that cannot be converted: its problem and the fix."""

    def __init__(self, problem: str, hint: str = "") -> None:
        self.problem = problem
        self.hint = hint
        super().__init__(f"{problem}. HINT: {hint}" if hint else problem)


@dataclass(frozen=True)
class Released:
    path: Path
    tensors: list[tuple[str, np.ndarray]]  # (export's name, float32 array), graph order
    characters: list[str]  # class i + 1 is characters[i]; class 0 is the CTC blank


_FIX = (
    "pass the ch_PP-OCRv4_rec_infer.onnx of the rapidocr-onnxruntime 1.4.4 wheel "
    "(python -m scripts.fetch_ppocrv4 fetches and checks it)"
)


def read_onnx(path: str | Path) -> Released:
    """The weights and dictionary of the exported recognizer at ``path``."""
    import numpy as np
    import onnx  # deferred: only the conversion needs it
    from onnx import numpy_helper

    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"ONNX model not found: {path}", _FIX)
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # protobuf's DecodeError and friends: a damaged or foreign file
        raise WeightsError(f"{path} is not a readable ONNX model ({exc})", _FIX) from exc
    constants = {
        node.output[0]: node.attribute[0].t
        for node in model.graph.node
        if node.op_type == "Constant" and node.attribute
    }
    seen: dict[str, np.ndarray] = {}
    for node in model.graph.node:
        for name in node.input:
            if name in constants and name not in seen and _PARAMETER.match(name):
                seen[name] = numpy_helper.to_array(constants[name]).astype(np.float32)
    tensors = list(seen.items())
    meta = {prop.key: prop.value for prop in model.metadata_props}
    characters = meta.get("character", "").split("\n")
    if len(tensors) != NUM_TENSORS:
        raise WeightsError(
            f"{path}: found {len(tensors)} weight tensors, the PP-OCRv4 recognizer has "
            f"{NUM_TENSORS} (a different model, or a truncated file)",
            _FIX,
        )
    if len(characters) + 2 != OUTPUT_CLASSES:  # the export lists neither blank nor space
        raise WeightsError(
            f"{path}: its metadata lists {len(characters)} characters, "
            f"PP-OCRv4's dictionary has {OUTPUT_CLASSES - 2}",
            _FIX,
        )
    return Released(path, tensors, characters)


def map_weights(
    released: Released, targets: list[tuple[str, tuple[int, ...]]], *, linear_transposed: bool
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Pair the released tensors with ``targets`` ((model key, shape), registration order).

    ``linear_transposed``: the framework stores a linear layer's weight as [out, in] (torch);
    the export, like Paddle, stores [in, out]. Returns (model key -> array, one report line per
    tensor). Raises WeightsError on any count or shape mismatch.
    """
    if len(targets) != len(released.tensors):
        raise WeightsError(
            f"the model has {len(targets)} weight tensors, {released.path} has "
            f"{len(released.tensors)}",
            "build model.name: ppocrv4_rec with the released dictionary (6,625 classes)",
        )
    import numpy as np

    weights, report = {}, []
    for (source, array), (key, shape) in zip(released.tensors, targets):
        if linear_transposed and source.startswith("linear_") and array.ndim == 2:
            array = array.T
        if tuple(array.shape) != tuple(shape):
            raise WeightsError(
                f"{released.path}: {source} {list(array.shape)} does not fit {key} "
                f"{list(shape)}: the graph is not the PP-OCRv4 recognizer this project builds",
                _FIX,
            )
        weights[key] = np.ascontiguousarray(array)
        report.append(f"{source:24s} {str(list(array.shape)):18s} -> {key}")
    return weights, report


def write_dictionary(characters: list[str], path: str | Path) -> Path:
    """The released dictionary as a char_dict file (one character per line; the space is
    data.use_space_char: true, as in PaddleOCR's ppocr_keys_v1.txt)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, "".join(c + "\n" for c in characters))  # never through a link
