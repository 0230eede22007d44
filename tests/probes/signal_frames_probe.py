"""A CPU LSTM's forward and backward in eager torch while a second process sends this one
SIGUSR1 every half millisecond, with a Python handler installed for it (as the trainer has one
for SIGTERM). Exits 0 after SECONDS; a heap that the signal frames corrupted ends it with
glibc's abort (SIGABRT). Used by tests/test_signal_frames.py.

  python tests/probes/signal_frames_probe.py SECONDS bare          # no alternate signal stack
  python tests/probes/signal_frames_probe.py SECONDS trainer       # the trainer's set-up
  python tests/probes/signal_frames_probe.py SECONDS trainer-nofd  # the same, stderr without fd

Why it can crash: the f32 GEMM kernels that torch 2.6's bundled oneDNN generates for x86-64
point the stack register at a heap workspace while they run. The kernel builds a signal's frame
below the stack register of the thread it interrupts, unless that thread has an alternate
signal stack (sigaltstack; CPython installs its handlers with SA_ONSTACK): the frame then lands
on the heap chunk in front of the workspace, and glibc aborts when the workspace is freed.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Stops when the probe is gone: a crashed probe is a zombie until its own parent reaps it, and
# os.kill still reaches a zombie, so the sender watches for being reparented instead.
SENDER = """
import os, signal, sys, time
pid = int(sys.argv[1])
while os.getppid() == pid:
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        break
    time.sleep(0.0005)
"""


def main() -> int:
    seconds, mode = float(sys.argv[1]), sys.argv[2]
    if mode.startswith("trainer"):
        from train.cli import report_native_crashes

        if mode == "trainer-nofd":
            sys.stderr = io.StringIO()  # a notebook's stream: faulthandler cannot write to it
        report_native_crashes()
        sys.stderr = sys.__stderr__
    elif mode != "bare":
        raise SystemExit(f"unknown mode {mode!r}: bare, trainer or trainer-nofd")
    import torch

    torch.set_num_threads(1)  # the GEMMs on this thread, the one the signals interrupt
    handled = 0

    def count(signum, frame):
        nonlocal handled
        handled += 1

    signal.signal(signal.SIGUSR1, count)
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(96, 128, 1, bidirectional=True, batch_first=True)  # the CRNN's
    sequence = torch.randn(8, 40, 96, requires_grad=True)
    sender = subprocess.Popen(  # no pipes of ours: a caller reading them waits for it too
        [sys.executable, "-c", SENDER, str(os.getpid())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    started, passes = time.monotonic(), 0
    try:
        while time.monotonic() - started < seconds:
            out, _ = lstm(sequence)
            out.sum().backward()
            passes += 1
    finally:
        sender.kill()
        sender.wait()
    print(f"{mode}: {passes} forward+backward passes, {handled} signals handled", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
