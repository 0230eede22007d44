"""Fault injection in the trainer's own process, for reliability tests and to reproduce a
failure on purpose (loader workers have theirs: datasets/faults.py).

    TRAIN_INJECT_FAULT=nan@5 python -m train --config ...

multiplies the images of the batch of step 5 by NaN, so that step's loss is NaN;
``oom@5`` raises the backend's own out-of-memory exception (torch.cuda.OutOfMemoryError,
Paddle's MemoryError) in place of step 5, as a CUDA allocator that runs out would;
``alloc@5`` makes a real one: before step 5 it asks the framework's allocator, on the run's
device, for 256 TiB (more than a 48-bit address space holds, so no machine and no overcommit
setting grants it);
``killworker@5`` kills one loader worker of this trainer with SIGKILL (as the OOM killer would)
in the middle of the checkpoint of step 5 and gives its exit a second to be noticed;
``killidle@5`` does the same before step 5, after a second in which the workers finish their
prefetching and sit idle (no sample in flight). Several faults: ``nan@5,nan@6``. Unset (every
production config), the loop's batches are not wrapped and the steps have no fault hook.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from train.errors import out_of_memory_named

ENV = "TRAIN_INJECT_FAULT"
KINDS = ("nan", "oom", "alloc", "killworker", "killidle")
UNALLOCATABLE_BYTES = 1 << 48


def _faults() -> dict[int, str]:
    faults = {}
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        kind, _, step = item.partition("@")
        if kind not in KINDS or not step.isdigit():
            raise ValueError(f"{ENV}={item!r}: use KIND@STEP with KIND one of {', '.join(KINDS)}")
        faults[int(step)] = kind
    return faults


_FAULTS = _faults()


def injected() -> bool:
    """Whether TRAIN_INJECT_FAULT asks for any fault."""
    return bool(_FAULTS)


def steps(batches: Iterable[dict], first_step: int, backend) -> Iterator[dict]:
    """``batches`` for the steps from ``first_step`` (1-based) on, each through before_step.
    Its out-of-memory faults are named as the step's own would be."""
    for step, batch in enumerate(batches, start=first_step):
        with out_of_memory_named(backend, "a train step"):
            batch = before_step(step, batch, backend)
        yield batch


def before_step(step: int, batch: dict, backend) -> dict:
    """The batch for ``step`` (1-based), poisoned or replaced by an exception if asked."""
    kind = _FAULTS.get(step)
    if kind == "nan":
        return {**batch, "image": batch["image"] * math.nan}
    if kind == "oom":
        raise backend.runtime.out_of_memory_errors[0](
            f"CUDA out of memory. Tried to allocate 2.00 GiB ({ENV}=oom@{step}, injected)"
        )
    if kind == "alloc":
        backend.runtime.allocate_bytes(UNALLOCATABLE_BYTES)
    if kind == "killidle":
        time.sleep(1.0)  # the workers fill their prefetch and wait for the next index
        _kill_a_worker(step, kind)
    return batch


_KILLED_AT: set[int] = set()


def during_save(step: int) -> None:
    """Called between writing a checkpoint's files and sealing them (best/ too: the first
    save of the step kills, once)."""
    if _FAULTS.get(step) != "killworker" or step in _KILLED_AT:
        return
    _KILLED_AT.add(step)
    _kill_a_worker(step, "killworker")


def _kill_a_worker(step: int, kind: str) -> None:
    """SIGKILL this trainer's first child (a loader worker), then give the framework's
    dead-worker check (its SIGCHLD handler) a second to notice."""
    children = [
        int(pid)
        for thread_dir in Path("/proc/self/task").iterdir()
        for pid in (thread_dir / "children").read_text().split()
    ]
    if not children:
        raise RuntimeError(f"{ENV}={kind}@{step}: this trainer has no loader worker to kill")
    os.kill(min(children), signal.SIGKILL)
    time.sleep(1.0)
