"""Fault injection for reliability tests and for reproducing a crash on purpose.

    DATA_INJECT_FAULT=segv@123 python -m train --config ...

makes whichever process reads source index 123 die the way a broken decoder or the kernel would
kill it: ``segv`` (SIGSEGV), ``kill`` (SIGKILL, as the OOM killer does), ``exit`` (os._exit(1)),
or ``hang`` (sleep forever); ``raise`` makes the sample's code raise a RuntimeError, as a bug in
a transform would (the worker stays alive). Unset, it costs one dictionary lookup per process.

    DATA_INJECT_FAULT=slow@200

makes every sample take 200 ms more to read, as slow storage would (a long evaluation pass).

    DATA_INJECT_FAULT=latency@0.3

makes every read from the storage take 0.3 ms more, below the record cache: a cached record skips
it, as it skips a network volume's round trip. So a cache can pay where it would on such a
volume (the tuner's tests and benchmarks); ``slow`` delays every sample, cached or not.

    DATA_INJECT_FAULT=startdelay@3

makes every loader worker sleep 3 s as it starts, before it binds itself to the trainer's
lifetime: the window in which a trainer killed with -9 would otherwise leave workers behind.
"""

from __future__ import annotations

import os
import re
import signal
import time

from datasets.process_id import current_pid

ENV = "DATA_INJECT_FAULT"
_parsed: dict[int, tuple[str, float] | None] = {}
_NUMBER = re.compile(r"\d+(\.\d+)?")  # a sample index, or milliseconds (latency@0.3)


def _fault() -> tuple[str, float] | None:
    pid = current_pid()
    if pid not in _parsed:
        spec = os.environ.get(ENV, "")
        kind, _, number = spec.partition("@")
        _parsed[pid] = (kind, float(number)) if spec and _NUMBER.fullmatch(number) else None
    return _parsed[pid]


def delay_start() -> None:
    """Sleep at worker start if DATA_INJECT_FAULT=startdelay@SECONDS."""
    fault = _fault()
    if fault is not None and fault[0] == "startdelay":
        time.sleep(fault[1])


def storage_latency() -> None:
    """Sleep before a read from the storage if DATA_INJECT_FAULT=latency@MILLISECONDS."""
    fault = _fault()
    if fault is not None and fault[0] == "latency":
        time.sleep(fault[1] / 1000)


def maybe_inject(index: int) -> None:
    fault = _fault()
    if fault is not None and fault[0] == "slow":
        time.sleep(fault[1] / 1000)
        return
    if fault is None or fault[0] in ("startdelay", "latency") or fault[1] != index:
        return
    kind = fault[0]
    if kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "exit":
        os._exit(1)
    elif kind == "raise":
        raise RuntimeError(f"{ENV}=raise@{index}: an exception in the sample's code, injected")
    elif kind == "hang":
        while True:
            time.sleep(60)
    else:
        raise ValueError(
            f"{ENV}={kind}@{index}: kind must be segv, kill, exit, hang, raise, slow, latency "
            "or startdelay"
        )
