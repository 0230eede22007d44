"""Targets for spawned daemonic processes that stand in for loader workers left behind by a
stop (tests/test_stop_signals.py): one that ignores SIGTERM, as a spawned worker does while it
still holds the stop signals in its start-up (datasets.handles), and one that ends at it."""

from __future__ import annotations

import signal
import time


def ignores_sigterm(ready) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(600)


def ends_at_sigterm(ready) -> None:
    ready.set()
    time.sleep(600)
