"""The errors that end a run, each with its own exit code.

A failure is classified where it is known (the checkpoint code knows a save failed, the loop
knows the loss was not finite, the loader knows which worker died) and raised as one of these;
``python -m train`` maps the class to the exit code (``exit_code``) and prints the message,
which names the problem and the fix. Nothing is classified by reading an exception's text.

The data layer (``datasets/``) and the config (``train/config/``) keep their own error classes
so that they import nothing from the trainer; ``exit_code`` maps those too.
"""

from __future__ import annotations

import contextlib

from datasets.errors import CacheSpaceError, DatasetError, TooManyBadSamplesError
from datasets.safe_files import LinkRefusedError
from train.config.errors import ConfigError

EXIT_CONFIG = 2  # bad config or command line
EXIT_DATA = 3  # dataset unreadable or malformed, too many bad samples
EXIT_CHECKPOINT = 4  # a checkpoint or run file cannot be written (disk full, a planted link...)
EXIT_SHM = 5  # /dev/shm too small for the config (shm.policy: fail)
EXIT_WORKER = 6  # a loader worker died or hung (the error names the sample it was on)
EXIT_DEVICE = 7  # train.device asks for a GPU this process cannot use
EXIT_NONFINITE = 8  # the loss was NaN/Inf (train.nonfinite: abort, or too many skips)
EXIT_OUT_OF_MEMORY = 9  # the device (or host) ran out of memory in a step
EXIT_LOCKED = 10  # another run holds the output directory


class RunError(Exception):
    """A failure of the run that has its own exit code; the message names the fix."""

    exit_code = 1


class CheckpointError(RunError):
    exit_code = EXIT_CHECKPOINT


class RunFileError(RunError):
    """A file of the run directory (metrics.jsonl, the scalar log, summary.json, the plots,
    config.resolved.yaml) could not be written, most often for want of room: train/run_files.py."""

    exit_code = EXIT_CHECKPOINT


class ShmTooSmallError(RunError):
    exit_code = EXIT_SHM


class WorkerDiedError(RunError):
    """A loader worker process died or hung; only raised when one really did."""

    exit_code = EXIT_WORKER


class DeviceUnavailableError(RunError, RuntimeError):
    """train.device asks for a GPU this process cannot train on (a CPU build, no visible GPU,
    a driver too old for the build, fewer GPUs than ranks). ``reason`` and ``fix`` are one line
    each."""

    exit_code = EXIT_DEVICE

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason}. HINT: {fix}")
        self.reason, self.fix = reason, fix


class NonFiniteLossError(RunError):
    exit_code = EXIT_NONFINITE


class OutOfMemoryError(RunError):
    exit_code = EXIT_OUT_OF_MEMORY


class OutputDirLockedError(RunError):
    exit_code = EXIT_LOCKED


def exit_code(exc: BaseException) -> int | None:
    """The exit code of a failure of a known kind, None for anything else (a bug: traceback)."""
    if isinstance(exc, RunError):
        return exc.exit_code
    if isinstance(exc, ConfigError):
        return EXIT_CONFIG
    if isinstance(exc, CacheSpaceError):  # a disk cache without its room: as a run file's
        return EXIT_CHECKPOINT
    if isinstance(exc, (DatasetError, TooManyBadSamplesError)):
        return EXIT_DATA
    if isinstance(exc, LinkRefusedError):  # a link at a name the run writes (datasets.safe_files)
        return EXIT_CHECKPOINT
    return None


@contextlib.contextmanager
def out_of_memory_named(backend, where: str):
    """The framework's out-of-memory exception as OutOfMemoryError (exit 9), with the fix."""
    try:
        yield
    except Exception as exc:
        if not backend.runtime.is_out_of_memory(exc):
            raise
        device = backend.runtime.device_name
        raise OutOfMemoryError(
            f"out of memory in {where} on {device}: {str(exc).splitlines()[0]}. "
            "HINT: lower loader.batch_size, use train.amp (bf16/fp16) on a GPU, or a smaller "
            "model.name; check that no other process holds the GPU's memory (nvidia-smi)"
        ) from exc
