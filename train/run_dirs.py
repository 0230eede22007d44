"""Which directories may be a run directory, and so may be written into or emptied by --overwrite.

``--overwrite`` deletes everything in the run directory, and a run writes its files into it, so
the trainer only takes a directory that is new, empty, or a run directory already: one holding
the marker file ``.starved-run``, which the trainer writes into every run directory it takes.
A run directory written before the marker existed is taken when it holds the run's own files
(``checkpoints/`` and ``config.resolved.yaml`` or ``metrics.jsonl``); it gets its marker then.
A non-empty directory without either is refused, with or without --overwrite: a run that
wrote into it would make it look like a run directory to the next --overwrite.

The filesystem root, the home directory, the repository root and the current directory are
refused whatever they hold (a mistyped path, ``.``, or an empty ``output.dir``), since stale run
files there would otherwise pass for a run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

from datasets.safe_files import write_atomic
from train.config.errors import ConfigError

MARKER = ".starved-run"
# A run directory of before the marker: checkpoints/ and one of these.
LEGACY_FILES = ("config.resolved.yaml", "metrics.jsonl")
# Entries that do not make a directory used: the run lock (train/run_lock.py), the Paddle
# launcher's log folder, which it creates before the trainer starts (--log_dir RUN/launch-logs),
# and a filesystem's own lost+found at a volume's root.
NOT_CONTENT = frozenset({".lock", "launch-logs", "lost+found"})
FIX = "pick an empty or new directory for the run"
REPOSITORY = Path(__file__).resolve().parent.parent


def _never_a_run_dir(path: Path) -> str | None:
    """What ``path`` is when it is a directory no run may use, else None."""
    resolved = path.resolve()
    special = [(Path("/"), "the filesystem root")]
    with contextlib.suppress(RuntimeError, KeyError):  # no HOME and no passwd entry
        special.append((Path.home().resolve(), "the home directory"))
    special.append((REPOSITORY, "the repository root"))
    special.append((Path.cwd().resolve(), "the current directory"))
    return next((what for where, what in special if resolved == where), None)


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds the marker, or the files of a run written before it existed."""
    if (path / MARKER).is_file():
        return True
    return (path / "checkpoints").is_dir() and any((path / n).is_file() for n in LEGACY_FILES)


def check(text: str, overwrite: bool, key: str = "output.dir") -> Path:
    """The run directory ``text`` names, or ConfigError (one line: the path, what it lacks, the
    fix) when the trainer may not use it; ``key`` is where it came from (--output-dir,
    output.dir). Reads the directory, writes nothing."""
    if not text.strip():
        raise ConfigError(key, "is empty (it would name the current directory)", FIX)
    path = Path(text)
    what = _never_a_run_dir(path)
    if what is not None:
        raise ConfigError(
            key, f"{text} is {what} ({path.resolve()}), which is never a run directory", FIX
        )
    if not path.exists():
        return path
    if not path.is_dir():
        raise ConfigError(key, f"{text} is a file, not a directory", FIX)
    content = sorted(set(os.listdir(path)) - NOT_CONTENT)
    if not content or is_run_dir(path):
        return path
    shown = ", ".join(content[:5]) + (f" and {len(content) - 5} more" if len(content) > 5 else "")
    action = "--overwrite would delete them" if overwrite else "a run would write among them"
    raise ConfigError(
        key,
        f"{text} is not a run directory: it holds {shown} but no {MARKER} marker (python -m "
        f"train writes one into each run directory it creates), and {action}",
        FIX,
    )


def clear(run_dir: Path, key: str = "output.dir") -> None:
    """--overwrite: delete what the run directory holds, after checking again that it is one
    (this is the step that deletes). Its lock (held by this run) and marker stay."""
    check(str(run_dir), overwrite=True, key=key)
    for path in run_dir.iterdir():
        if path.name in NOT_CONTENT - {"launch-logs"} or path.name == MARKER:
            continue  # launch-logs goes with the rest (docs/containers.md: no --overwrite there)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def mark(run_dir: Path) -> None:
    """Write the marker into ``run_dir`` (a directory check() took) unless it is there."""
    if not os.path.lexists(run_dir / MARKER):
        note = {"written_by": "python -m train", "at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        write_atomic(run_dir / MARKER, json.dumps(note) + "\n")
