"""Instructions per sample of each arm at 0 workers, counted by valgrind's callgrind.

    .venv-paddle/bin/python -m bench.instructions --task ocr       [--out FILE.json]
    .venv-torch/bin/python  -m bench.instructions --task resnet50  [--out FILE.json]

Seconds on these shared hosts move by 30-40% within a minute (docs/benchmarks.md); instruction
counts do not: the same binary on the same input executes the same instructions whatever else
the machine does. So this is the noise-free half of the comparison: the work each pipeline does
per sample, ours against the peer, and in which library (libjpeg-turbo, OpenCV, zlib, numpy,
the interpreter, ...). It is not a speed: an instruction that waits on memory costs more than
one that does not, which the timed benchmark measures.

Each arm (a bench/pipelines.py builder, 0 workers) runs once under callgrind: a warm pass
(imports, first LMDB/HDF5 touches, lazy initialisation), then ``--passes`` passes, counted on
their own (``callgrind_control`` switches the counting on after the warm pass). A pass is one
shuffled epoch over the whole dataset (``--items``, a multiple of ``--batch-size``), so both arms
decode exactly the same records (their mix of JPEG and PNG sets the work). The measured passes'
instructions over their samples are the work per sample in the steady state, every thread
included (Paddle's loader reads in a thread of its own). Needs ``valgrind`` on PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = {
    "ocr": ("ocr.ours", "ocr.paddleocr"),
    "resnet50": ("resnet50.ours", "resnet50.torchvision_ref"),
}
# The frameworks print to stdout too: the child's progress lines carry this prefix.
MARK = "bench.instructions: done with "
DEFAULTS = {  # the quick preset's data; the OCR batch of the full preset
    "ocr": {"items": 768, "batch_size": 128},
    "resnet50": {"items": 256, "batch_size": 32},
}


def _versions() -> dict[str, str]:
    """Instruction counts belong to the binaries that ran: their versions go with the result."""
    from bench.runner import package_versions

    valgrind = subprocess.run(["valgrind", "--version"], capture_output=True, text=True)
    return {
        **package_versions(),
        "valgrind": valgrind.stdout.strip(),
        "python": sys.version.split()[0],
    }


def _ocr_inputs(items: int) -> dict:
    from bench.data import ocr_data

    data = ocr_data(items)
    return {"lmdb": data["mixed"], "charset": data["charset"]}


def _image_inputs(items: int) -> dict:
    from bench.data import image_data

    return image_data(items)


INPUTS = {"ocr": _ocr_inputs, "resnet50": _image_inputs}  # items -> a task's data, as ARMS read it


def _spec(task: str, items: int, batch_size: int) -> dict:
    # No "batches": an epoch is then the dataset itself (bench.pipelines.epoch_length).
    return {"batch_size": batch_size, "workers": 0, **INPUTS[task](items)}


def run_child(arm: str, spec: dict, passes: int) -> None:
    """Inside valgrind: a warm pass, then ``passes`` measured ones, each part followed by a
    line on stdout and a wait for the parent's go-ahead (it dumps callgrind's counters then)."""
    from bench.pipelines import BUILDERS

    pipeline = BUILDERS[arm](spec)

    def run_passes(first_epoch: int, count: int) -> None:
        for epoch in range(first_epoch, first_epoch + count):
            batches = pipeline.epoch(epoch)
            for _ in batches:
                pass
            del batches

    for part, (first_epoch, count) in (("warm", (0, 1)), ("measured", (1, passes))):
        run_passes(first_epoch, count)
        print(MARK + part, flush=True)
        sys.stdin.readline()
    pipeline.close()


def _callgrind(arm: str, spec: dict, passes: int, workdir: Path) -> Path:
    """The callgrind dump of ``arm``'s measured passes alone. The child starts uninstrumented
    (``--instr-atstart=no``: valgrind then runs the interpreter's start-up, the framework imports
    and the warm pass several times faster than while counting); callgrind_control switches the
    counting on after the warm pass and dumps the counters after the measured passes, so the
    dump holds exactly their work (neither start-up nor the interpreter's exit)."""
    out = workdir / f"{arm}.callgrind"
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
    command += [f"--callgrind-out-file={out}", sys.executable]
    command += ["-m", "bench.instructions", "--child", arm, "--spec", json.dumps(spec)]
    command += ["--passes", str(passes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(workdir / f"{arm}.log", "w")  # noqa: SIM115  (the child's stderr, read on failure)
    child = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
    )
    with child, log:
        for part in ("warm", "measured"):
            if not _wait_for(child.stdout, MARK + part):
                break  # the child died: its log says why
            control = "--instr=on" if part == "warm" else f"--dump={part}"
            subprocess.run(
                ["callgrind_control", control, str(child.pid)], check=True, capture_output=True
            )
            child.stdin.write("go\n")
            child.stdin.flush()
        child.wait()
    measured = out.with_name(out.name + ".1")
    if child.returncode != 0 or not measured.is_file():
        tail = (workdir / f"{arm}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{arm} under callgrind failed (exit {child.returncode}):\n{tail}")
    return measured


def _wait_for(stream, marker: str) -> bool:
    """Read ``stream`` up to the line ``marker``; False at its end (the child died)."""
    return any(line.rstrip("\n") == marker for line in stream)


def _by_library(callgrind_file: Path) -> Counter:
    """Instructions per shared object: the self cost lines of a callgrind dump, each under its
    ``ob=``. A cost line right after ``calls=`` is the call's inclusive cost, counted where it
    is spent instead. (callgrind_annotate misreads dumps after the first: its per-function sums
    of a second part came to ten times the part's total.) Names may be compressed: "(3) name"
    defines id 3 for later "(3)"; ob=, cob= and the file/function specs each number their own."""
    names: dict[str, str] = {}
    libraries: Counter = Counter()
    library, after_call = "?", False
    for line in callgrind_file.read_text(errors="replace").splitlines():
        if line.startswith(("ob=", "cob=")):
            spec = line.split("=", 1)[1]
            match = re.match(r"\((\d+)\)\s*(.*)", spec)
            if match:
                if match.group(2):
                    names[match.group(1)] = match.group(2)
                spec = names.get(match.group(1), "?")
            if line.startswith("ob="):
                library = Path(spec).name or "?"
        elif line.startswith("calls="):
            after_call = True
        elif line[:1].isdigit() or line[:1] in "+-*":
            if after_call:
                after_call = False
                continue
            fields = line.split()
            if len(fields) >= 2:
                libraries[library] += int(fields[1])
    return libraries


def _total(callgrind_file: Path) -> int:
    for line in callgrind_file.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise SystemExit(f"{callgrind_file}: no totals line")


def measure(task: str, items: int, batch_size: int, passes: int) -> dict:
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on PATH: apt-get install valgrind")
    if items % batch_size:
        raise SystemExit(f"--items {items} is no multiple of --batch-size {batch_size}")
    spec = _spec(task, items, batch_size)
    samples = passes * items
    with tempfile.TemporaryDirectory(prefix="bench-instr-") as tmp:
        with ThreadPoolExecutor(max_workers=2) as pool:  # one valgrind per core
            dumps = list(pool.map(lambda arm: _callgrind(arm, spec, passes, Path(tmp)), ARMS[task]))
        arms = {}
        for arm, dump in zip(ARMS[task], dumps):
            libraries = _by_library(dump)
            arms[arm.split(".", 1)[1]] = {
                "instructions_per_sample": round(_total(dump) / samples),
                "by_library": {
                    name: round(count / samples) for name, count in libraries.most_common(10)
                },
            }
    ours, peer = (arm.split(".", 1)[1] for arm in ARMS[task])
    ratio = arms[peer]["instructions_per_sample"] / arms[ours]["instructions_per_sample"]
    return {
        "task": task,
        "settings": {**spec, "items": items, "passes": passes},
        "arms": arms,
        "ours": ours,
        "peer": peer,
        "peer_over_ours": round(ratio, 3),
        "versions": _versions(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(ARMS), default="ocr")
    parser.add_argument("--items", type=int, help="records in the dataset (bench/data.py)")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--passes", type=int, default=2, help="measured passes")
    parser.add_argument("--out", type=Path, help="also write the result here (JSON)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.child, json.loads(args.spec), args.passes)
        return
    settings = {**DEFAULTS[args.task]}
    for key in ("items", "batch_size"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    result = measure(args.task, passes=args.passes, **settings)
    result["command"] = " ".join(
        [Path(sys.executable).name, "-m", "bench.instructions", *sys.argv[1:]]
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    for arm, row in result["arms"].items():
        print(f"{arm:16s} {row['instructions_per_sample']:>12,d} instructions per sample")
        for library, count in row["by_library"].items():
            print(f"    {count:>12,d}  {library}")
    print(f"{result['peer']} / {result['ours']} instructions: {result['peer_over_ours']}")


if __name__ == "__main__":
    main()
