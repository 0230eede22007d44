"""Why the loader held the trainer (train/stall.py): the run summary's one sentence from the
run's own CPU figures, each bottleneck from synthetic figures; Telemetry's measurement of the
trainer's CPU inside its wait and of its child processes' CPU; and the tuner's command.
Framework-free: no training (tests/test_train.py checks the keys in a real run's summary)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from train import report
from train.stall import LoaderUse, diagnose, summary_keys, tune_command
from train.telemetry import Telemetry


def use(**figures) -> LoaderUse:
    """A 100 s run on a 2-core host, 40 s of it waiting for data, 4 workers of an 8-core
    process, nothing busy; each test sets what its case measured."""
    base = dict(
        wall_s=100.0,
        wait_s=40.0,
        wait_cpu_s=1.0,
        num_workers=4,
        usable_cores=8,
        host_cpus=8,
        trainer_cpu_s=20.0,
        workers_cpu_s=40.0,
        host_busy_s=100.0,
        host_iowait_s=0.0,
    )
    return LoaderUse(**{**base, **figures})


@pytest.mark.parametrize(
    "figures, says",
    [
        # workers at 95% each, the run on 7.8 of 8 cores: CPU-bound, more workers cannot help
        (
            dict(workers_cpu_s=380.0, trainer_cpu_s=400.0, host_busy_s=790.0),
            "the loader workers were CPU-bound on a full CPU: the 4 loader workers were busy "
            "95% of the time and this run used 7.8 of 8 usable cores, the host was 99% busy.",
        ),
        # workers at 95% each, 4.8 of 8 cores used: room for more
        (
            dict(workers_cpu_s=380.0, trainer_cpu_s=100.0, host_busy_s=480.0),
            "CPU-bound with cores to spare",
        ),
        # the trainer on 7 of 8 cores, the workers at 10%: the trainer, not the loader
        (dict(trainer_cpu_s=700.0, host_busy_s=760.0), "the trainer took the cores"),
        # the host busy (another job), the workers at 10% and idle-looking: kept off the CPU,
        # or waiting? CPU time alone cannot say
        (dict(host_busy_s=760.0), "could not tell: the 4 loader workers were busy 10%"),
        (dict(host_busy_s=760.0), "but the host was 95% busy"),
        # workers idle, the trainer's thread busy 90% of its wait: the hand-over
        (dict(wait_cpu_s=36.0), "the hand-over held the trainer"),
        # workers idle, the trainer idle in its wait, 1.5 cores of I/O wait: storage
        (dict(host_iowait_s=150.0), "storage held the loader"),
        # workers idle, the trainer idle, no I/O wait: nothing measured names a cause
        (dict(), "could not tell: the 4 loader workers were busy 10% of the time"),
        # no workers at all
        (dict(num_workers=0, wait_cpu_s=38.0), "num_workers was 0"),
        # psutil could not read the processes
        (dict(trainer_cpu_s=None, workers_cpu_s=None, host_busy_s=None), "could not tell"),
    ],
)
def test_diagnosis_names_what_the_run_measured(figures, says):
    sentence = diagnose(use(**figures))
    assert says in sentence, sentence
    assert sentence.count(". ") == 0 and sentence.endswith("."), f"one sentence: {sentence}"


def test_ranks_on_a_node_share_its_cores():
    """Rank 0 of 4 on 8 cores has 2: its 2 workers at 75% and its trainer (1.9 cores) fill
    its share, though the host has some left."""
    figures = dict(ranks=4, num_workers=2, workers_cpu_s=150.0, trainer_cpu_s=40.0)
    figures["host_busy_s"] = 700.0
    assert "on a full CPU" in diagnose(use(**figures))
    assert "of 2 usable cores" in diagnose(use(**figures))


def test_the_summary_explains_only_a_wait_above_ten_percent():
    assert summary_keys(0.10, use()) == {}
    assert summary_keys(0.05, use()) == {}
    assert summary_keys(0.4, None) == {}  # another rank: rank 0 writes the summary
    keys = summary_keys(0.11, use())
    assert list(keys) == ["loader_bottleneck"] and keys["loader_bottleneck"].startswith("could")
    table = report.summary_table({"data_wait_fraction": 0.4, **keys})
    (line,) = [line for line in table.splitlines() if line.startswith("loader_bottleneck")]
    assert line.split(maxsplit=1)[1].startswith("could not tell:"), table


def test_tune_command_is_the_runs_scenario_and_sets():
    assert tune_command("configs/ocr/smoke.yaml") == (
        "python -m train.tune --config configs/ocr/smoke.yaml"
    )
    command = tune_command("my configs/x.yaml", ["loader.num_workers=2", "data.train=a b"])
    assert command == (
        "python -m train.tune --config 'my configs/x.yaml' --set loader.num_workers=2 "
        "--set 'data.train=a b'"
    )


def spin(seconds: float) -> None:
    """Compute for ``seconds`` of this thread's CPU time (longer on a busy host: its wall time
    is not what the test measures)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_telemetry_measures_the_trainers_cpu_in_its_wait(tmp_path):
    """A loader whose next() computes (the hand-over) and one whose next() sleeps (waiting for
    workers): the trainer thread's CPU inside the wait tells them apart."""
    found = {}
    for name, fetch in (("busy", spin), ("idle", time.sleep)):
        telemetry = Telemetry(tmp_path, True, 8, None, "knobs", 0.3, num_workers=1)

        def batches(fetch=fetch):
            for _ in range(3):
                fetch(0.1)
                yield None

        for _ in telemetry.timed(batches()):
            telemetry.step_done(0)
        telemetry.log_window(step=3, epoch=0, loss=1.0, lr=0.1, bad=0)
        telemetry.close()
        found[name] = telemetry.loader_use()
    busy, idle = found["busy"], found["idle"]
    assert busy.wait_s >= 0.25 and idle.wait_s >= 0.25, (busy, idle)
    # The spinning fetches' 0.3 CPU-s are all in the wait (a tick of 10 ms may be lost at
    # each end); the sleeping ones' wait holds next to none.
    assert busy.wait_cpu_s >= 0.25, busy
    assert idle.wait_cpu_s < 0.05, idle
    assert busy.trainer_cpu_s is not None and busy.trainer_cpu_s >= busy.wait_cpu_s * 0.5


def test_telemetry_counts_the_cpu_of_child_processes_that_exited(tmp_path):
    """Loader workers end with their epoch (persistent_workers: false): their CPU still counts,
    from the parent's reaped-children times."""
    telemetry = Telemetry(tmp_path, True, 8, None, "knobs", 0.3, num_workers=1)
    child = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
    telemetry.log_window(step=1, epoch=0, loss=1.0, lr=0.1, bad=0)
    telemetry.close()
    measured = telemetry.loader_use()
    assert measured.workers_cpu_s >= 0.35, measured
    assert measured.host_busy_s > 0 and measured.host_cpus >= 1, measured


def test_telemetry_without_a_worker_count_measures_nothing(tmp_path):
    """Rank 0 only, and only when told the workers (Telemetry's other users pass neither)."""
    telemetry = Telemetry(tmp_path, True, 8, None, "knobs", 0.3)
    assert telemetry.loader_use() is None
    telemetry.close()
    other_rank = Telemetry(tmp_path, False, 8, None, "knobs", 0.3, num_workers=2)
    assert other_rank.loader_use() is None
    other_rank.close()
