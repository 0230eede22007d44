"""Stop requests: SIGTERM/SIGINT handling, the ranks' agreement to stop at the same step, and
evaluation batches that a stop can interrupt. Framework-free; train/loop.py calls these.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time

log = logging.getLogger("train")


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived; the loop saved a checkpoint and stopped."""

    def __init__(self, message: str, signal_name: str) -> None:
        super().__init__(message)
        self.signal_name = signal_name


class EvaluationInterrupted(Exception):
    """A stop request arrived during an evaluation pass (one rank alone): the pass is dropped
    so that the checkpoint lands within the stop budget instead of after the whole pass, which
    may take longer than a container's grace period."""


_END = object()


class StopAwareBatches:
    """The host batches of ``loader``, taken from it by a helper thread, so that the trainer
    waits for each in 0.1 s slices and checks the stop flag in between: a stop request ends the
    wait at once (EvaluationInterrupted) instead of after the batch, which on slow storage takes
    seconds. The loader is opened in the calling thread (the loaders start their workers and
    signal handlers there) and closed by close(): closing waits for the workers to finish their
    batches, so the stop closes it after its checkpoint."""

    def __init__(self, loader, stop_flag: StopFlag) -> None:
        self.loader, self.stop_flag = loader, stop_flag
        self.device_prefetch = getattr(loader, "device_prefetch", True)  # torch's knob
        self._handoff: queue.Queue = queue.Queue(maxsize=1)
        self._closed = threading.Event()

    def __iter__(self):
        batches = iter(self.loader)
        helper = threading.Thread(target=self._take, args=(batches,), daemon=True)
        helper.name = "evaluation-batches"
        helper.start()
        while True:
            try:
                batch, error = self._handoff.get(timeout=0.1)
            except queue.Empty:
                if self.stop_flag.requested:
                    raise EvaluationInterrupted from None
                continue
            if error is not None:
                raise error  # the loader's own failure (a dead worker...), classified by main
            if batch is _END:
                return
            yield batch

    def _take(self, batches) -> None:
        try:
            for batch in batches:
                if not self._offer((batch, None)):
                    break
            else:
                self._offer((_END, None))
        except BaseException as error:
            self._offer((_END, error))
        finally:
            close = getattr(batches, "close", None)
            if close is not None:  # a generator (Paddle's): its finally ends the workers
                close()

    def _offer(self, item: tuple) -> bool:
        while not self._closed.is_set():
            try:
                self._handoff.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        self._closed.set()
        # The helper may be waiting in the loader's next() for a batch that never comes (a dead
        # worker): a loader that can stop its epoch's workers from here does (torch's).
        stop_workers = getattr(self.loader, "stop_epoch_workers", None)
        if stop_workers is not None:
            stop_workers()


class HeldBatches:
    """The batches of ``loader``, its iterator held until close(). An interrupted evaluation
    drops its loop, and with it the last reference to the iterator, whose clean-up (Paddle's
    generator finally, torch's __del__) would then wait for the workers' batches before the
    stop's checkpoint; held here, it is closed after it (Run.stop)."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.device_prefetch = getattr(loader, "device_prefetch", True)  # torch's knob
        self._batches = None

    def __iter__(self):
        self._batches = iter(self.loader)
        return self._batches

    def close(self) -> None:
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()
        self._batches = None


def stop_now(stop: StopFlag, step: int, every: int, dist, backend) -> bool:
    """Whether to stop after this step. All ranks must stop after the same step: otherwise one
    saves and waits in the barrier while another waits in its next step's gradient all-reduce,
    until the collective times out (seen with 2 ranks under paddle.distributed.launch, which
    signals rank 1 up to 0.6 s after rank 0; Kubernetes signals each pod of a job on its own).
    So with several ranks the flags are summed over the ranks every ``every`` (log_every) steps,
    where the loop reads the loss and so already waits for the device: a stop waits at most
    that many steps, and no step pays for an extra synchronization."""
    if dist.world_size == 1:
        return stop.requested
    if step % every:
        return False
    return backend.runtime.all_reduce_sum([float(stop.requested)])[0] > 0


class StopFlag:
    requested = False
    signal_name = ""


class StopAgreement:
    """Whether the run stops, the same answer on every rank: the stop flag of this process,
    agreed over the ranks every ``every`` steps (stop_now), or at once when an interrupted
    evaluation already made every rank agree (``agreed``)."""

    def __init__(self, flag: StopFlag, dist, backend, every: int) -> None:
        self.flag, self.dist, self.backend, self.every = flag, dist, backend, every
        self.agreed = False

    def after_step(self, step: int) -> bool:
        """Whether every rank stops after ``step`` (one all-reduce every ``every`` steps)."""
        return self.agreed or stop_now(self.flag, step, self.every, self.dist, self.backend)

    def between_epochs(self) -> bool:
        """After an epoch's evaluation and checkpoint, where no all-reduce is due: several
        ranks stop here only on an agreement they already reached."""
        return self.agreed or (self.dist.world_size == 1 and self.flag.requested)

    def stopped(self, step: int) -> StopRequested:
        """The exception that ends the run at ``step``, once its checkpoint is written."""
        by = self.flag.signal_name or "another rank's stop signal"
        return StopRequested(f"stopped by {by} at step {step}", self.flag.signal_name)


# Repeated SIGTERMs this soon after the first are the same stop request. Launchers send bursts:
# paddle 2.6's `python -m paddle.distributed.launch`, itself stopped, runs Pod.stop(timeout=30)
# (launch/controllers/controller.py), whose Container.terminate (launch/job/container.py) calls
# ProcessContext.terminate (launch/utils/process_context.py): os.killpg(SIGTERM) to the rank's
# process group, sleep 0.2 s, up to 3 times while the rank lives, so 3 signals within 0.4 s;
# after 30 s it sends the burst again and SIGKILLs. Shells and init processes (tini -g) may
# forward one signal more. 5 s is ten times the launcher's burst, so a loaded host that delays
# it still counts as one request; a person who repeats `kill` after longer still aborts.
SIGTERM_REPEAT_WINDOW_S = 5.0


def install_stop_handler() -> StopFlag:
    """SIGTERM (docker stop, Kubernetes preemption, the launchers) and SIGINT finish the current
    step, save a checkpoint and stop. A second SIGINT (Ctrl-C twice) exits at once, as does a
    SIGTERM more than SIGTERM_REPEAT_WINDOW_S after the first; repeats within that window are
    ignored, so a launcher's burst cannot abort the checkpoint it asked for."""
    flag = StopFlag()
    first_sigterm_at: float | None = None

    def handler(signum, frame):
        nonlocal first_sigterm_at
        name = signal.Signals(signum).name
        now = time.monotonic()
        if signum == signal.SIGTERM and first_sigterm_at is not None:
            if now - first_sigterm_at < SIGTERM_REPEAT_WINDOW_S:
                log.info(
                    "SIGTERM again %.1f s after the first: the same stop request, still finishing "
                    "the step and the checkpoint",
                    now - first_sigterm_at,
                )
                return
            signal.signal(signum, signal.SIG_DFL)  # a late repeat: stop now, no checkpoint
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGTERM:
            first_sigterm_at = now
        else:
            signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C exits at once
        flag.requested = True
        flag.signal_name = name
        log.warning("%s received: finishing the current step, then checkpoint and stop", name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return flag


def settle_after_stop() -> None:
    """After a stop's checkpoint, on the way out: neither more SIGTERMs nor a loader worker
    that ends badly can fail the stop now."""
    # The checkpoint is on disk and nothing is left to save: ignore the rest of a
    # launcher's burst. Python puts the default action back while the interpreter exits,
    # and a SIGTERM then turned "exit 143" into death by signal 15 (seen with Paddle).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Nor is a worker that ends badly from here on a failure: a spawned evaluation worker
    # still unpickling its start-up when the stop came dies once the trainer's semaphores
    # are gone, and Torch's SIGCHLD handler then raised "DataLoader worker ... exited
    # unexpectedly" in Python's exit, after the stop had succeeded.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


# How long loader workers still running after a stop's checkpoint get to end before SIGKILL.
LEFTOVER_WORKER_GRACE_S = 10.0


def end_leftover_workers(grace_s: float = LEFTOVER_WORKER_GRACE_S) -> list[int]:
    """After a stop's checkpoint, before the interpreter exits: what Python's exit does to the
    trainer's daemonic processes (the loaders' workers, in both frameworks), SIGTERM and a join,
    but with the join bounded: those still running ``grace_s`` later get SIGKILL. Returns the
    pids killed (normally none: persistent workers, for one, end at the SIGTERM).

    Python's exit joins every multiprocessing child without a time limit. A loader whose epoch
    was cut short while spawned workers started can leave a worker waiting for work that never
    comes (its peer died unpickling its start-up, and the batch it owed with it; its exit-time
    SIGTERM can land while it still holds the stop signals, datasets.handles): the trainer then
    hung after "stopped by SIGTERM" until the launcher's SIGKILL (both frameworks, 1 to 2 runs
    in 3 of tests/test_stop_signals.py's spawn cases). The checkpoint is complete by now, so
    killing a worker loses nothing."""
    import multiprocessing

    children = [child for child in multiprocessing.active_children() if child.daemon]
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    killed = []
    for child in children:
        if child.is_alive():
            child.kill()
            child.join(1.0)
            killed.append(child.pid)
    return killed
