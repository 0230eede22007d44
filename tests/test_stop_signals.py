"""Stop signals as launchers really send them. python -m paddle.distributed.launch stops a rank
with three SIGTERMs 0.2 s apart, sent to the rank's whole process group (trainer and loader
workers); the trainer must still finish its step, write the checkpoint, exit 143, and --resume
must continue from that checkpoint. Both frameworks; then the real launchers (paddle launch,
torchrun) with two CPU ranks, which must stop after the same step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.test_distributed import local_master
from tests.test_resume import wait_for_step
from tests.test_train import LOST_WORKER, ROOT, data_overrides, set_args, train_cmd
from train.launch import launch_command

# checkpoint_every far beyond max_steps: the only checkpoint a stopped run holds is the one its
# stop handler wrote. Checkpoints at epoch ends exist only when checkpoint_every is unset.
SETTINGS = [
    "train.max_steps=400",
    "train.log_every=1",
    "train.eval_every=100000",
    "train.checkpoint_every=100000",
    "optim.warmup_steps=2",
    "output.plots=false",  # a resumed run's plots cost 0.6-0.9 CPU-s; test_train draws them
]
STOPPED = re.compile(r"stopped by SIGTERM at step (\d+); continue with --resume")
# A rank that has not had its own signal yet stops with the others (see train/stops.py, stop_now).
ANY_STOP = re.compile(r"stopped by (?:SIGTERM|another rank's stop signal) at step (\d+);")


def send_burst(pgid: int, count: int = 3, gap_s: float = 0.2) -> int:
    """What paddle.distributed.launch does to each rank on stop (utils/process_context.py
    ProcessContext.terminate: os.killpg(SIGTERM), sleep 0.2, up to 3 times while the rank is
    alive). Returns how many signals found the group alive."""
    sent = 0
    for _ in range(count):
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            break
        sent += 1
        time.sleep(gap_s)
    return sent


def only_checkpoint_step(run_dir: Path) -> int:
    """The step of the run's only checkpoint (and `latest` points at it)."""
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert len(steps) == 1, f"expected only the stop's checkpoint, found {steps}"
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == steps[0]
    return int(latest.split("-")[1])


PAIRS = [
    pytest.param("ocr", "paddle", marks=pytest.mark.paddle),
    pytest.param("resnet50", "torch", marks=pytest.mark.torch),
]


@pytest.mark.parametrize("task, framework", PAIRS)
def test_sigterm_burst_to_the_process_group_still_checkpoints(
    task, framework, tmp_path, ocr_lmdb, image_h5
):
    """Before: the second SIGTERM killed the trainer before its checkpoint (exit -15), and the
    first killed the loader workers ("DataLoader worker ... killed by signal: Terminated")."""
    run_dir = tmp_path / "run"
    cmd = train_cmd(task, framework, run_dir, SETTINGS, ocr_lmdb=ocr_lmdb, image_h5=image_h5)
    process = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as the launcher starts each rank
    )
    try:
        wait_for_step(run_dir, process, 5)
        sent = send_burst(process.pid)
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    stderr = process.stderr.read()
    assert code == 143, f"exit {code} after {sent} SIGTERM(s)\n{stderr[-3000:]}"
    # The trainer, alone in its group (loader workers leave it), was alive for all three.
    assert sent == 3, f"the run was gone after {sent} SIGTERM(s): the burst did not test anything"
    stopped = STOPPED.findall(stderr)
    assert len(stopped) == 1, stderr[-3000:]
    assert only_checkpoint_step(run_dir) == int(stopped[0]) >= 5

    step = int(stopped[0])
    resumed = subprocess.run(
        [*cmd, "--resume", *set_args([f"train.max_steps={step + 3}"])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(rf"resumed from \S+step-{step:08d} \(epoch \d+, step {step}\)", resumed.stderr)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == step + 3


def wait_for_evaluation(log: Path, process: subprocess.Popen, step: int = 4) -> None:
    """Until ``log`` says the evaluation at ``step`` began (the process must live that long)."""
    deadline = time.monotonic() + 300
    while not log.exists() or f"evaluating at step {step}" not in log.read_text(errors="replace"):
        assert process.poll() is None and time.monotonic() < deadline, tail_of(log)
        time.sleep(0.05)


def tail_of(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("task, framework", PAIRS)
def test_group_sigterm_while_evaluation_workers_start_is_a_stop(
    task, framework, start_method, tmp_path, ocr_lmdb, image_h5
):
    """A loader worker starts in its trainer's process group and leaves it first thing in
    worker_init_fn; a launcher's group SIGTERM in between killed it. Seen in CI: torchrun
    stopped a rank just as its evaluation loader started, rank 1's worker died "killed by
    signal: Terminated", rank 1 died, rank 0's all-reduce failed. Here every worker is held 3 s
    in that window (DATA_INJECT_FAULT=startdelay@3) and the group gets the SIGTERM as the
    evaluation starts: the run must stop with its checkpoint, not lose a worker, and exit (the
    workers' own exit must not wait on a signal the pending group one swallowed: spawn)."""
    run_dir = tmp_path / "run"
    sets = [*SETTINGS, "train.eval_every=4", "loader.num_workers=2"]
    sets += [f"loader.multiprocessing_context={start_method}"]
    cmd = train_cmd(task, framework, run_dir, sets, ocr_lmdb=ocr_lmdb, image_h5=image_h5)
    env = dict(os.environ, DATA_INJECT_FAULT="startdelay@3")
    err = tmp_path / "stderr.txt"
    with err.open("w") as sink:
        process = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=sink,
            start_new_session=True,  # its own process group, as a launcher starts each rank
        )
        try:
            wait_for_evaluation(err, process)
            time.sleep(0.5)  # the evaluation workers are forked and in their start delay
            os.killpg(process.pid, signal.SIGTERM)
            code = process.wait(timeout=120)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    stderr = err.read_text()
    assert LOST_WORKER.search(stderr) is None, stderr[-3000:]
    assert code == 143, stderr[-3000:]
    assert STOPPED.findall(stderr) == ["4"], stderr[-3000:]
    assert only_checkpoint_step(run_dir) == 4


def test_a_worker_still_running_after_a_stops_checkpoint_is_killed_and_named(monkeypatch, caplog):
    """What a spawned worker that died unpickling its start-up leaves behind, made on purpose:
    after the stop's checkpoint, python -m train's main() ends the daemonic children; one that
    ignores SIGTERM (its peer's start-up never came) is killed after the grace period and named
    in a warning, one that ends at SIGTERM is not; the exit is still the stop's 143 and no
    child is left for Python's exit to join forever."""
    import functools
    import logging
    import multiprocessing

    import train.__main__ as entry
    from tests.probes import leftover_workers
    from train import stops

    context = multiprocessing.get_context("spawn")
    started = []
    for target in (leftover_workers.ignores_sigterm, leftover_workers.ends_at_sigterm):
        ready = context.Event()
        process = context.Process(target=target, args=(ready,), daemon=True)
        process.start()
        assert ready.wait(60), "the stand-in worker did not start"
        started.append(process)
    stubborn, polite = started

    def stopped_run(args, held):
        raise stops.StopRequested("stopped by SIGTERM at step 4, checkpoint saved", "SIGTERM")

    monkeypatch.setattr(entry, "run", stopped_run)
    monkeypatch.setattr(stops, "LEFTOVER_WORKER_GRACE_S", 1.0)
    quick = functools.partial(stops.end_leftover_workers, grace_s=1.0)
    monkeypatch.setattr(stops, "end_leftover_workers", quick)
    with caplog.at_level(logging.WARNING):
        code = entry.main(["--config", "configs/ocr/smoke.yaml"])
    assert code == 143
    assert not stubborn.is_alive() and not polite.is_alive()
    assert stubborn.exitcode == -signal.SIGKILL and polite.exitcode == -signal.SIGTERM
    named = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert named == [
        f"loader worker(s) {stubborn.pid} still running 1 s after the stop's checkpoint: killed "
        "(the checkpoint is complete)"
    ]


def stop_launcher(cmd: list[str], run_dir: Path, out: Path, env=None) -> float:
    """Start a launcher, send it one SIGTERM at step 5 (what Kubernetes does to a pod's PID 1),
    return how long it took to exit. Its output goes to ``out``."""
    with out.open("w") as sink:
        launcher = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True
        )
        try:
            wait_for_step(run_dir, launcher, 5)
            started = time.monotonic()
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=60)
            return time.monotonic() - started
        finally:
            if launcher.poll() is None:
                launcher.kill()


def assert_ranks_stopped_at_the_checkpoint(rank_logs: list[str], run_dir: Path, context: str):
    """Every rank logged one stop, all at the same step, and the run's only checkpoint is of
    that step."""
    steps = [int(step) for log in rank_logs for step in ANY_STOP.findall(log)]
    assert len(steps) == 2 and len(set(steps)) == 1, context
    assert only_checkpoint_step(run_dir) == steps[0] >= 5


@pytest.mark.paddle
def test_sigterm_to_paddle_launch_stops_both_ranks_at_one_checkpoint(tmp_path, ocr_lmdb, image_h5):
    """The real python -m paddle.distributed.launch, two CPU ranks over gloo, stopped the way
    Kubernetes stops a PaddleJob pod: one SIGTERM to the launcher. The launcher passes it on as
    a burst of three to rank 0's group, then to rank 1's 0.6 s later (SIGKILL after 30 s). Both
    ranks must stop after the same step, rank 0 having written that step's checkpoint. Before,
    rank 0 died of the burst; with the burst fixed, the ranks stopped at different steps and
    hung in mismatched collectives until the launcher's SIGKILL."""
    import paddle

    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        pytest.skip("GPUs present: paddle.distributed.launch would place ranks on them")
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    sets = ["framework=paddle", *SETTINGS, "loader.num_workers=1", "loader.batch_size=8"]
    sets += data_overrides("ocr", ocr_lmdb, image_h5)
    args = ["train/__main__.py", "--config", "configs/ocr/smoke.yaml", "--output-dir", str(run_dir)]
    cmd = launch_command("paddle", sys.executable, 2, args + set_args(sets), log_dir=logs)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_"))}
    env["PYTHONPATH"] = str(ROOT)
    took = stop_launcher(cmd, run_dir, tmp_path / "launcher.out", env)
    rank_logs = [(logs / f"workerlog.{rank}").read_text(errors="replace") for rank in (0, 1)]
    context = (tmp_path / "launcher.out").read_text()[-1500:] + "".join(
        x[-2500:] for x in rank_logs
    )
    assert_ranks_stopped_at_the_checkpoint(rank_logs, run_dir, context)
    assert STOPPED.search(rank_logs[0]), context  # rank 0 stopped for its own SIGTERM
    assert took < 25, f"the launcher needed {took:.0f} s: did it have to SIGKILL a rank?"


@pytest.mark.torch
def test_sigterm_to_torchrun_stops_both_ranks_at_one_checkpoint(tmp_path, image_h5):
    """torchrun, two CPU ranks: on SIGTERM it os.killpg()s each rank's group once (ranks run in
    sessions of their own), SIGKILL after 30 s. Torch's loader workers die of a SIGTERM their
    trainer did not send, so before, each rank failed with "DataLoader worker ... killed by
    signal: Terminated" and no checkpoint was written."""
    run_dir = tmp_path / "run"
    sets = ["framework=torch", *SETTINGS, "loader.num_workers=1", "loader.batch_size=4"]
    sets += data_overrides("resnet50", None, image_h5)
    args = ["-m", "train", "--config", "configs/resnet50/smoke.yaml", "--output-dir", str(run_dir)]
    cmd = launch_command("torch", sys.executable, 2, args + set_args(sets), master=local_master())
    took = stop_launcher(cmd, run_dir, tmp_path / "torchrun.out")
    output = (tmp_path / "torchrun.out").read_text(errors="replace")
    assert_ranks_stopped_at_the_checkpoint([output], run_dir, output[-4000:])
    assert "killed by signal" not in output, output[-4000:]
    assert took < 25, f"torchrun needed {took:.0f} s: did it have to SIGKILL a rank?"


# The slow-read tests below evaluate after the first step: DATA_INJECT_FAULT=slow@500 slows every
# read, the training batches' too, so each step before the evaluation would cost a batch of
# half-second reads (4 s on one loader worker) and show nothing more.
EVAL_STEP = 1

# The stop budget docs/reliability.md states: SIGTERM to exit, with the checkpoint written, on
# these fixtures (measured: see the docs); compose's and the Kubernetes manifests' grace periods
# (120 s) exceed it. Generous here: the host may be loaded.
STOP_BUDGET_S = 30.0


@pytest.mark.parametrize("task, framework", PAIRS)
def test_sigterm_during_evaluation_stops_at_the_next_batch_with_a_checkpoint(
    task, framework, tmp_path, ocr_lmdb, image_h5
):
    """Before: the whole evaluation pass ran before the stop flag was read, so a long pass
    outlasted Docker's 10 s and Kubernetes' 30 s grace and the run was SIGKILLed without its
    checkpoint. Every sample takes 0.5 s here, so a pass takes 6 s (ResNet) to 24 s (OCR)."""
    run_dir, err = tmp_path / "run", tmp_path / "stderr.txt"
    sets = [
        *SETTINGS,
        f"train.eval_every={EVAL_STEP}",
        "loader.num_workers=2",
        "loader.batch_size=8",
    ]
    cmd = train_cmd(task, framework, run_dir, sets, ocr_lmdb=ocr_lmdb, image_h5=image_h5)
    env = dict(os.environ, DATA_INJECT_FAULT="slow@500")
    with err.open("w") as sink:
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=sink, env=env)
        try:
            wait_for_evaluation(err, process, EVAL_STEP)
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=120)
            took = time.monotonic() - started
        finally:
            if process.poll() is None:
                process.kill()
    stderr = err.read_text()
    times = {
        line.split(" WARNING ")[0].split(" INFO ")[0]: line
        for line in stderr.splitlines()
        if "SIGTERM received" in line or "checkpoint" in line
    }
    stamps = [datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f") for t in times]
    to_checkpoint = (max(stamps) - min(stamps)).total_seconds() if len(stamps) == 2 else -1
    print(
        f"{task} {framework}: SIGTERM during evaluation: checkpoint written {to_checkpoint:.1f} s "
        f"after the signal (log times), exit after {took:.1f} s"
    )
    assert code == 143, stderr[-3000:]
    assert f"evaluation at step {EVAL_STEP} interrupted by the stop request" in stderr, stderr[
        -3000:
    ]
    assert STOPPED.findall(stderr) == [str(EVAL_STEP)]
    assert only_checkpoint_step(run_dir) == EVAL_STEP
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r["type"] == "eval"]  # the interrupted pass is dropped
    assert took < STOP_BUDGET_S, f"{took:.0f} s from SIGTERM to exit"


@pytest.mark.torch
def test_sigterm_during_evaluation_on_two_ranks_cuts_the_pass_on_both(tmp_path, image_h5):
    """torchrun, two CPU ranks, every sample 0.5 s: a pass is 3 batches of 4 per rank (6 s).
    Before, with several ranks the pass always ran to its end (one rank alone dropping it would
    leave the other in the pass's all-reduce). Now the ranks agree after each batch: SIGTERM to
    torchrun cuts the pass on both at the same batch, and both stop at that step's
    checkpoint."""
    run_dir, out = tmp_path / "run", tmp_path / "torchrun.out"
    sets = ["framework=torch", *SETTINGS, f"train.eval_every={EVAL_STEP}", "loader.num_workers=1"]
    sets += ["loader.batch_size=4", *data_overrides("resnet50", None, image_h5)]
    args = ["-m", "train", "--config", "configs/resnet50/smoke.yaml", "--output-dir", str(run_dir)]
    cmd = launch_command("torch", sys.executable, 2, args + set_args(sets), master=local_master())
    env = dict(os.environ, DATA_INJECT_FAULT="slow@500")
    with out.open("w") as sink:
        launcher = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True
        )
        try:
            wait_for_evaluation(out, launcher, EVAL_STEP)
            started = time.monotonic()
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=120)
            took = time.monotonic() - started
        finally:
            if launcher.poll() is None:
                launcher.kill()
    output = out.read_text(errors="replace")
    assert (
        output.count(f"evaluation at step {EVAL_STEP} interrupted by the stop request") == 2
    ), output[-4000:]
    assert ANY_STOP.findall(output) == [str(EVAL_STEP)] * 2, output[-4000:]
    assert only_checkpoint_step(run_dir) == EVAL_STEP
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r["type"] == "eval"]  # the interrupted pass is dropped
    assert took < STOP_BUDGET_S, f"{took:.0f} s from SIGTERM to exit"


@pytest.mark.paddle
def test_sigterm_during_evaluation_on_two_paddle_ranks_cuts_the_pass_on_both(
    tmp_path, ocr_lmdb, image_h5
):
    """The same with python -m paddle.distributed.launch and the OCR smoke run (6 batches of 8
    per rank and pass, 4 s each): the launcher's bursts reach rank 1 up to 0.6 s after rank 0,
    and both ranks still cut the pass at the same batch and stop at that step's checkpoint."""
    import paddle

    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        pytest.skip("GPUs present: paddle.distributed.launch would place ranks on them")
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    sets = ["framework=paddle", *SETTINGS, f"train.eval_every={EVAL_STEP}", "loader.num_workers=1"]
    sets += ["loader.batch_size=8", *data_overrides("ocr", ocr_lmdb, image_h5)]
    args = ["train/__main__.py", "--config", "configs/ocr/smoke.yaml", "--output-dir", str(run_dir)]
    cmd = launch_command("paddle", sys.executable, 2, args + set_args(sets), log_dir=logs)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_"))}
    env.update(PYTHONPATH=str(ROOT), DATA_INJECT_FAULT="slow@500")
    rank0 = logs / "workerlog.0"
    with (tmp_path / "launcher.out").open("w") as sink:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_for_evaluation(rank0, launcher, EVAL_STEP)
            started = time.monotonic()
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=120)
            took = time.monotonic() - started
        finally:
            if launcher.poll() is None:
                launcher.kill()
    rank_logs = [(logs / f"workerlog.{rank}").read_text(errors="replace") for rank in (0, 1)]
    context = "".join(x[-3000:] for x in rank_logs)
    for log in rank_logs:
        assert f"evaluation at step {EVAL_STEP} interrupted by the stop request" in log, context
        assert ANY_STOP.findall(log) == [str(EVAL_STEP)], context
    assert only_checkpoint_step(run_dir) == EVAL_STEP
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r["type"] == "eval"]  # the interrupted pass is dropped
    assert took < STOP_BUDGET_S, f"{took:.0f} s from SIGTERM to exit"
