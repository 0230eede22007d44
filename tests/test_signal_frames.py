"""Signal frames off the heap: torch 2.6's bundled oneDNN (3.5.3) runs its x86-64 f32 GEMM
kernels with the stack register pointing into a heap workspace, so a signal handled on the
interrupted thread's normal stack writes its frame over the heap and glibc aborts later
("corrupted size vs. prev_size while consolidating"), which a SIGTERM to a torch OCR trainer
on the CPU can meet (https://github.com/uxlfoundation/oneDNN/issues/4845). The trainer's
main thread handles its stop signals on faulthandler's alternate signal stack
(train.cli.report_native_crashes), which CPython's handlers use (SA_ONSTACK);
tests/probes/signal_frames_probe.py reproduces both sides with an LSTM and a SIGUSR1 every
half millisecond."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.test_train import ROOT

pytestmark = pytest.mark.torch
PROBE = ROOT / "tests" / "probes" / "signal_frames_probe.py"
CRASHES = (-signal.SIGABRT, -signal.SIGSEGV)


def probe(mode: str, seconds: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PROBE), str(seconds), mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=seconds + 120,
    )


def test_without_an_alternate_stack_torchs_onednn_corrupts_the_heap():
    """The reproduction outside the project (torch only, no train code): it crashes within a
    second or two on this torch. When it stops crashing, the bundled oneDNN has the fix and the
    comment in report_native_crashes can say so."""
    result = probe("bare", 30)
    assert result.returncode in CRASHES, (
        "the bare LSTM ran 30 s of signals without a crash: this torch's oneDNN no longer "
        f"writes signal frames onto the heap ({result.stdout.strip()})"
    )


@pytest.mark.parametrize("mode", ["trainer", "trainer-nofd"])
def test_the_trainers_signal_handling_keeps_frames_off_the_heap(mode):
    """With the trainer's set-up, also when stderr has no file descriptor (faulthandler is then
    armed on os.devnull: no crash report, but the alternate stack). 4 s of signals: twice the
    time the bare reproduction takes at most to crash."""
    result = probe(mode, 4)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert "signals handled" in result.stdout
