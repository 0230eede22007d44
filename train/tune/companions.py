"""The node's other ranks in the tuner's measured runs (``python -m train.tune --local-ranks N``):
N - 1 companion processes, each one rank's loader, run beside the tuner's own (rank 0) so that a
measured rate is one rank's among N, sharing the cores, memory and /dev/shm as N ranks of
training share them.

A companion is this Python (``sys.executable -m train.tune.companions``: the same environment),
started once per tuning, since its framework's import takes seconds; it is given the tuner's
resolved config (pickled: the very dataclass, not a file read and checked again). For each
measured run it

1. opens the training data as training opens it (verify.open_train_dataset) at the run's
   setting (verify.run_config), fills its record cache as rank 0 does, sets its CPU threads as
   training sets a rank's, and builds the backend's loader over its own shard of the epoch
   (EpochSampler rank r of N);
2. takes the loader's first batch, which means its workers are up, says it is ready and waits:
   rank 0 starts its own loader, and so its window, only once every companion is ready (the
   start barrier), then tells them all to go;
3. takes batches, each at the device's step, until rank 0's window has ended;
4. stops its loader (workers included, as a measured run stops rank 0's), closes the data and
   reports its pid and the batches it took within rank 0's window.

The step a companion takes each batch at is what a real rank's own device does to it. A GPU step
(the step measured here on this host's GPU, or ``--step-ms``'s device elsewhere) is the device's
time, not the host's: the companion's stand-in device (verify.DeviceStandIn) takes ``step_s``
per step, queued as CUDA queues work. A step on the CPU is work on the node's cores, which is
what the ranks share: a companion then takes batches as fast as its loader makes them, which
keeps its share of the cores as busy as its workers and its own CPU step would. A companion
never touches a GPU (its device is the CPU): it takes the loader's host batches, as rank 0 does
with ``--step-ms``, so a real rank's copy to its GPU (pinned memory, the copy, the
normalization) is not counted on the companions.

A failure of a companion's loader (a worker killed or hung, bad data, a missing dataset) is
printed by the companion as training prints it, and ends the measured run, and so the tuning,
with training's exit code for it (:class:`CompanionFailed`). A companion that dies, or is
silent past its time (:data:`READY_WAIT_S`, :data:`STOP_WAIT_S`), is killed, its workers with
it, and what it left in /dev/shm is removed. A companion whose tuner dies sees its end of the
connection close and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

from datasets.sampler import EpochSampler
from train import errors
from train.tune import verify
from train.tune.model import Candidate

log = logging.getLogger("train.tune")

# Seconds a companion may take to be ready for a run, beyond loader.timeout_s (the most its
# loader waits for a batch before it fails by itself): the interpreter's start and the
# framework's import (seconds, paid at its first run), opening the data and filling the cache.
READY_WAIT_S = 120.0
# Seconds a companion may take to stop after rank 0's window, beyond loader.timeout_s (its batch
# in hand): stopping its workers (torch waits up to 5 s for each) and closing the data.
STOP_WAIT_S = 60.0
# A companion's epoch holds this many times the batches rank 0's run takes: rank 0 starts its
# loader after the companions' go, so they take batches for longer than its run. An epoch that
# still ends early is followed by the next, as in training.
EPOCH_MARGIN = 2


class CompanionFailed(verify.LoaderFailed):
    """A companion (another rank's loader) failed in a measured run; its report, where it could
    make one, is above. ``code``: training's exit code for the failure (errors.EXIT_WORKER for
    a companion that died or went silent; 1 for a bug, whose traceback is above)."""

    def __init__(self, message: str, code: int) -> None:
        Exception.__init__(self, message)
        self.code = code


@dataclass
class Companion:
    """One companion process and the tuner's end of its connection."""

    rank: int
    process: subprocess.Popen
    connection: multiprocessing.connection.Connection

    def send(self, *message) -> None:
        """Send ``message``, unless the companion has gone: what it said before it went (its
        failure) or its end is what the tuner reads next (Companions.collect)."""
        with contextlib.suppress(OSError):
            self.connection.send(message)


class Companions:
    """The node's ranks 1 to ``local_ranks`` - 1, one companion process each, for the measured
    runs of one tuning (:meth:`running`). ``step_s``: each companion's step (its stand-in
    device's), None to take batches as fast as its loader makes them (a CPU step)."""

    def __init__(self, config, local_ranks: int, step_s: float | None) -> None:
        self.config, self.local_ranks, self.step_s = config, local_ranks, step_s
        self.members: list[Companion] = []

    def start(self) -> Companions:
        for rank in range(1, self.local_ranks):
            ours, theirs = multiprocessing.Pipe(duplex=True)
            try:
                process = subprocess.Popen(
                    [sys.executable, "-m", "train.tune.companions"]
                    + ["--connection-fd", str(theirs.fileno())]
                    + ["--rank", str(rank), "--local-ranks", str(self.local_ranks)],
                    pass_fds=(theirs.fileno(),),
                    # Its own session: a Ctrl-C in the terminal reaches the tuner alone, which
                    # stops the companions itself; its workers are found by their session.
                    start_new_session=True,
                )
            finally:
                theirs.close()  # the companion's end is the companion's alone: EOF when it exits
            member = Companion(rank, process, ours)
            self.members.append(member)
            member.send("setup", self.config, self.step_s)
        return self

    @contextlib.contextmanager
    def running(self, candidate: Candidate, batches: int) -> Iterator[Run]:
        """The companions' loaders at ``candidate``, each over its shard of an epoch of
        ``batches`` batches per rank (EPOCH_MARGIN times it: they run past rank 0's run), ready
        (workers up) and running by the time this yields; :meth:`Run.stop` stops them with
        rank 0's window and gives each one's rate within it. Leaving without it (rank 0's loader
        failed) stops them too."""
        if not self.members:
            raise RuntimeError("the companions are not running (closed, or one failed)")
        timeout_s = self.config.loader.timeout_s
        for member in self.members:
            member.send("run", candidate, EPOCH_MARGIN * batches)
        self.collect("ready", READY_WAIT_S + timeout_s)
        for member in self.members:
            member.send("go")
        run = Run(self, self.config.loader.batch_size)
        try:
            yield run
        finally:
            if not run.stopped:  # rank 0 failed: its error is the one to see
                with contextlib.suppress(CompanionFailed):
                    run.stop(None, None)

    def collect(self, kind: str, timeout_s: float) -> list[dict]:
        """Each companion's next message, which must be ``kind``: its payload, by rank. A
        companion that reports a failure, dies or is silent for ``timeout_s`` ends them all and
        raises CompanionFailed."""
        deadline = time.monotonic() + timeout_s
        waiting = {member.connection: member for member in self.members}
        payloads: dict[int, dict] = {}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                member = next(iter(waiting.values()))
                self.fail(member, f"was not {kind} within {timeout_s:.0f} s", errors.EXIT_WORKER)
            for connection in multiprocessing.connection.wait(list(waiting), timeout=left):
                member = waiting.pop(connection)
                try:
                    said, payload = connection.recv()
                except (EOFError, OSError):
                    code = wait_exit(member.process, STOP_WAIT_S)
                    self.fail(
                        member, f"exited (code {code}) before it was {kind}", errors.EXIT_WORKER
                    )
                if said == "failed":
                    self.fail(member, f"failed: {payload['error']}", payload["code"] or 1)
                if said != kind:
                    self.fail(member, f"said {said!r} where {kind!r} was due", 1)
                payloads[member.rank] = payload
        return [payloads[member.rank] for member in self.members]

    def fail(self, member: Companion, what: str, code: int):
        """End every companion and raise CompanionFailed for ``member``."""
        message = (
            f"local rank {member.rank} of {self.local_ranks} (a companion loader, pid "
            f"{member.process.pid}) {what}"
        )
        log.error("%s; the measured run ends", message)
        self.close()
        raise CompanionFailed(message, code)

    def close(self) -> None:
        """Stop every companion: asked to exit, then killed (its workers die with it) if it has
        not within STOP_WAIT_S; what a killed one left in /dev/shm is removed."""
        for member in self.members:
            member.send("exit")
        deadline = time.monotonic() + STOP_WAIT_S + self.config.loader.timeout_s
        killed = False
        for member in self.members:
            try:
                member.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                member.process.kill()
                member.process.wait()
                killed = True
            killed = killed or member.process.returncode < 0
            member.connection.close()
        self.members.clear()
        if killed:
            from train import preflight

            preflight.remove_stale_batches()
            preflight.remove_stale_state_files()


class Run:
    """The companions' part of one measured run, once they are going."""

    def __init__(self, companions: Companions, batch_size: int) -> None:
        self.companions, self.batch_size = companions, batch_size
        self.stopped = False

    def stop(self, window_began: float | None, window_ended: float | None) -> list[float]:
        """Stop the companions at the end of rank 0's window (time.monotonic() times; None: rank
        0 failed), their loaders and workers with them, and return each one's samples/s within
        that window, by rank."""
        self.stopped = True
        for member in self.companions.members:
            member.send("stop", window_began, window_ended)
        timeout_s = STOP_WAIT_S + self.companions.config.loader.timeout_s
        done = self.companions.collect("done", timeout_s)
        if window_began is None:
            return []
        seconds = max(window_ended - window_began, 1e-9)
        return [report["batches_in_window"] * self.batch_size / seconds for report in done]


def wait_exit(process: subprocess.Popen, timeout_s: float) -> int:
    """``process``'s exit code, killing it when it has not exited within ``timeout_s``."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@contextlib.contextmanager
def started(config, local_ranks: int, step_s: float, step_on_cpu: bool):
    """The node's other ranks for one tuning (None with one rank), closed on leaving. Their step
    is the device's ``step_s``, or none when the step runs on the CPU (the module's doc)."""
    if local_ranks <= 1:
        yield None
        return
    companions = Companions(config, local_ranks, None if step_on_cpu else step_s)
    try:
        yield companions.start()
    finally:
        companions.close()


# ---------------------------------------------------------------- in the companion process
def serve(connection, rank: int, local_ranks: int) -> None:
    """A companion's life: set up its backend, then run each measured run it is sent until it
    is told to exit (or the tuner's end of the connection closes)."""
    from train.backends import make_backend

    setup = receive(connection)
    if setup[0] != "setup":
        return  # the tuner ended before it was set up
    config, step_s = setup[1:]
    # The loader's host batches, on the CPU: the rank's device is its own (the module's doc).
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, device="cpu"))
    backend = make_backend(config)
    # Paddle's import sets up the root logger its own way: the companion prints warnings and
    # errors, each line naming its rank.
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s %(levelname)s local rank {rank}: %(name)s: %(message)s",
        force=True,
    )
    backend.runtime.init_distributed()
    backend.runtime.seed_everything(config.seed, config.deterministic)
    while True:
        order = receive(connection)
        if order[0] != "run":
            return  # exit
        candidate, batches = order[1:]
        report = run_loader(
            connection, config, backend, candidate, batches, rank, local_ranks, step_s
        )
        if report is None:
            return  # told to exit mid-run
        connection.send(("done", report))


def receive(connection) -> tuple:
    """The tuner's next order; ("exit",) when its end of the connection has closed."""
    try:
        return connection.recv()
    except (EOFError, OSError):
        return ("exit",)


def run_loader(connection, config, backend, candidate, batches, rank, local_ranks, step_s):
    """One measured run's loader on rank ``rank``: ready, go, batches until stopped. Returns
    the report for the tuner, None when told to exit instead."""
    config = verify.run_config(config, candidate)
    batch = config.loader.batch_size
    sampler = EpochSampler(
        local_ranks * batches * batch,
        shuffle=True,
        seed=config.seed,
        rank=rank,
        world_size=local_ranks,
    )
    device = verify.DeviceStandIn(step_s) if step_s else None
    taken: list[float] = []  # time.monotonic() of each batch taken after go
    dataset = verify.open_train_dataset(config, candidate.cache)
    try:
        verify.fill_cache(dataset, candidate, sampler)
        verify.set_rank_threads(backend, candidate.workers, local_ranks)
        with verify.failures_named(config, dataset), verify.more_workers_than_cores():
            loader = backend.batches.make_loader(dataset, sampler, config.loader, train=True)
            epoch_batches = verify.batches_of(backend, loader, on_device=False)
            try:
                next(epoch_batches)  # its workers are up
                connection.send(("ready", {"pid": os.getpid()}))
                order = receive(connection)
                while order[0] == "go":
                    if connection.poll():  # stop (or exit): rank 0's window has ended
                        order = receive(connection)
                        break
                    try:
                        item = next(epoch_batches)
                    except StopIteration:  # the next epoch, as a rank goes on to it
                        verify.close_batches(epoch_batches)
                        sampler.set_epoch(sampler.epoch + 1)
                        epoch_batches = verify.batches_of(backend, loader, on_device=False)
                        continue
                    taken.append(time.monotonic())
                    if device is not None:
                        device.step(item)
            finally:
                verify.close_batches(epoch_batches)
                del epoch_batches, loader
    finally:
        dataset.close()
    if order[0] != "stop":
        return None
    began, ended = order[1:]
    in_window = 0 if began is None else sum(began <= t <= ended for t in taken)
    return {"pid": os.getpid(), "batches": len(taken), "batches_in_window": in_window}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.tune.companions", description=__doc__)
    parser.add_argument("--connection-fd", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-ranks", type=int, required=True)
    args = parser.parse_args(argv)
    connection = multiprocessing.connection.Connection(args.connection_fd)
    try:
        serve(connection, args.rank, args.local_ranks)
        return 0
    except Exception as exc:
        from train import cli

        if isinstance(exc, verify.LoaderFailed):
            code = exc.code  # its report (the sample, the worker, the hint) is printed
            error = str(exc.__cause__ or exc)
        else:
            code = cli.failure_exit_code(exc)  # printed, as python -m train prints it
            if code is None:
                traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):
            connection.send(("failed", {"code": code, "error": error}))
        return code or 1


if __name__ == "__main__":
    sys.exit(main())
