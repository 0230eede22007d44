#!/usr/bin/env python
r"""Convert PaddleOCR's released PP-OCRv4 recognizer (ONNX) into this project's checkpoints.

  python -m scripts.convert_weights                      # this interpreter's framework
  .venv-torch/bin/python -m scripts.convert_weights --out-dir runs/weights    # .pt
  .venv-paddle/bin/python -m scripts.convert_weights --out-dir runs/weights   # .pdparams

Without --onnx it converts ch_PP-OCRv4_rec_infer.onnx fetched by scripts/fetch_ppocrv4.py.
Writes OUT/ppocrv4_rec.pt (a torch state dict: torch.load(..., weights_only=True)) or
OUT/ppocrv4_rec.pdparams (paddle.load), for model.name: ppocrv4_rec, and OUT/ppocr_keys.txt
(or --dict-out), the released dictionary (data.char_dict, with data.use_space_char: true).
Every tensor mapped is listed (export name, shape, model key). A file that is not that model's
export (another graph, a truncated or damaged file) is refused with one error line and nothing
is written.
docs/ppocrv4.md says how the export's fused layers are carried.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
from pathlib import Path

from datasets.safe_files import write_atomic
from scripts import _cli
from train.ppocrv4_weights import OUTPUT_CLASSES, read_onnx, write_dictionary

SUFFIX = {"torch": ".pt", "paddle": ".pdparams"}


def convert(
    onnx_path: Path, framework: str, out_dir: Path, dict_out: Path | None, quiet: bool
) -> Path:
    released = read_onnx(onnx_path)
    if framework == "torch":
        import torch

        from train.backends.torch.ppocrv4 import PpocrV4Rec, load_released

        net = PpocrV4Rec(OUTPUT_CLASSES)
        report = load_released(net, released)
        save = torch.save
    else:
        import paddle

        from train.backends.paddle.ppocrv4 import PpocrV4Rec, load_released

        net = PpocrV4Rec(OUTPUT_CLASSES)
        report = load_released(net, released)
        save = paddle.save
    if not quiet:
        print("\n".join(report))
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"ppocrv4_rec{SUFFIX[framework]}"
    weights = io.BytesIO()  # the frameworks' save follows a link at a path; write_atomic won't
    save(net.state_dict(), weights)
    write_atomic(target, weights.getvalue())
    keys = write_dictionary(released.characters, dict_out or out_dir / "ppocr_keys.txt")
    print(
        f"mapped {len(report)} tensors of {onnx_path} -> {target} "
        f"({OUTPUT_CLASSES} classes; dictionary {keys}, use_space_char: true)"
    )
    return target


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--onnx", help="the exported recognizer (default: fetch the released one)")
    parser.add_argument("--out-dir", help="default: the fetch cache (scripts/fetch_ppocrv4.py)")
    installed = [name for name in SUFFIX if importlib.util.find_spec(name)]
    parser.add_argument(
        "--framework",
        choices=tuple(SUFFIX),
        default=installed[0] if installed else None,
        help=f"default: the one this interpreter has ({', '.join(installed) or 'none'})",
    )
    parser.add_argument("--dict-out", help="where the dictionary goes (default: in --out-dir)")
    parser.add_argument("--quiet", action="store_true", help="only the summary line")
    args = parser.parse_args()
    if args.framework is None:
        parser.error("neither torch nor paddle is importable: run with a project venv")
    from scripts.fetch_ppocrv4 import RECOGNIZER, cache_dir, fetch

    onnx_path = Path(args.onnx) if args.onnx else fetch(RECOGNIZER)
    out_dir = Path(args.out_dir) if args.out_dir else cache_dir()
    dict_out = Path(args.dict_out) if args.dict_out else None
    convert(onnx_path, args.framework, out_dir, dict_out, args.quiet)
    return 0


if __name__ == "__main__":
    _cli.run(main)
