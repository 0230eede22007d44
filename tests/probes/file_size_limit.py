"""Run ``python -m train ARGS`` with the file-size limit (RLIMIT_FSIZE, as ``ulimit -f`` or a batch
system sets it) lowered once the checkpoint of step STEP is written: every write past LIMIT
bytes then fails with EFBIG, as a write to a full disk fails with ENOSPC, in whatever file the
run writes next (metrics.jsonl, summary.json, the plots). LIMIT is a number of bytes, or
FILE+N: the size FILE of the run directory has at that moment plus N bytes (the next record
appended to it fails, and no new file of more than that size can be written).

  python tests/probes/file_size_limit.py STEP LIMIT --config ... --output-dir RUN ...

Exit status: the trainer's. SIGXFSZ is ignored (Python ignores it too), so the write fails
instead of killing the process. The scalar log's writer thread is flushed before the limit is
set, so that what it writes later, not what it still had queued, meets the limit.
"""

from __future__ import annotations

import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train import __main__ as train_main  # noqa: E402
from train import checkpoint, telemetry  # noqa: E402


def limit_bytes(spec: str, run_dir: Path) -> int:
    if "+" not in spec:
        return int(spec)
    name, extra = spec.split("+")
    return (run_dir / name).stat().st_size + int(extra)


def main() -> int:
    step, spec, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    run_dir = Path(argv[argv.index("--output-dir") + 1])
    save, made, started = checkpoint.save, [], telemetry.Telemetry.__init__

    def recorded(self, *args, **kwargs):
        started(self, *args, **kwargs)
        made.append(self)

    def save_then_limit(run_dir_, backend, position, keep_last, config):
        path = save(run_dir_, backend, position, keep_last, config)
        if position.step == step:
            for each in made:
                if each._scalars is not None:
                    each._scalars.flush()
            limit = limit_bytes(spec, run_dir)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
            print(f"file-size limit {limit} after the checkpoint of step {step}", file=sys.stderr)
        return path

    checkpoint.save = save_then_limit
    telemetry.Telemetry.__init__ = recorded
    return train_main.main(argv)


if __name__ == "__main__":
    sys.exit(main())
