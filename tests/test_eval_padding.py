"""An evaluation over W ranks counts each validation sample once: EpochSampler pads each rank's
share by wrapping around to the order's start so every rank reads as many batches, and
train.loop.evaluate leaves those repeats out of the metric (EpochSampler.unpadded), so the
metric summed over ranks equals one rank's over the whole set, whatever N % W is."""

from __future__ import annotations

import numpy as np
import pytest

from datasets.sampler import EpochBatchSampler, EpochSampler
from train.loop import evaluate


@pytest.mark.parametrize("num_samples", [1, 5, 6, 7, 20])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("consumed", [0, 3])
def test_unpadded_positions_of_all_ranks_are_the_epoch_once(num_samples, world_size, consumed):
    ranks = range(world_size)
    shards = [EpochSampler(num_samples, seed=2, rank=r, world_size=world_size) for r in ranks]
    for sampler in shards:
        sampler.set_epoch(1, consumed=consumed)
    own = [p for sampler in shards for p in sampler.positions()[: sampler.unpadded]]
    rest = shards[0].order()[consumed:]
    assert sorted(own) == sorted(rest)  # each sample of the rest of the epoch exactly once
    assert all(len(sampler.positions()) - sampler.unpadded in (0, 1) for sampler in shards)


def test_five_samples_on_two_ranks_pad_rank_1_with_the_first():
    ranks = [EpochSampler(5, shuffle=False, rank=r, world_size=2) for r in range(2)]
    assert [list(s.positions()) for s in ranks] == [[0, 2, 4], [1, 3, 0]]
    assert [s.unpadded for s in ranks] == [3, 2]


class PositionBackend:
    """The backend surface evaluate() uses, over batches of sample positions: a ResNet-like
    model whose top-1 is right for sample 0 only (label = position, top-1 = 0), and an
    all-reduce that adds the states of the ranks evaluated before this one, as all_reduce_sum
    over the ranks does."""

    out_of_memory_errors = ()
    device_name = "cpu"

    def __init__(self, reduced: list[np.ndarray]) -> None:
        self.reduced = reduced
        # One object answers the three parts evaluation reaches (runtime, batches, trainer).
        self.runtime = self.batches = self.trainer = self

    def device_batches(self, loader):
        return ({"position": np.array([p for _, p in batch])} for batch in loader)

    def predict(self, batch) -> np.ndarray:
        return np.tile(np.arange(5), (len(batch["position"]), 1))  # top-5: classes 0..4

    def batch_labels(self, batch) -> dict[str, np.ndarray]:
        return {"label": batch["position"]}

    def all_reduce_sum(self, state: np.ndarray) -> np.ndarray:
        self.reduced.append(np.asarray(state))
        return np.sum(self.reduced, axis=0)


def evaluated_on(world_size: int, num_samples: int, batch_size: int) -> dict[str, float]:
    """evaluate() on each of ``world_size`` ranks in turn (the last one sees every rank's
    state in its all-reduce), each over its EpochSampler share in batches as the loaders cut."""
    reduced: list[np.ndarray] = []
    for rank in range(world_size):
        sampler = EpochSampler(num_samples, shuffle=False, rank=rank, world_size=world_size)
        loader = EpochBatchSampler(sampler, batch_size, drop_last=False)
        backend = PositionBackend(reduced)
        result = evaluate(backend, loader, "classification", counted=sampler.unpadded)
    return result


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_two_ranks_over_an_odd_set_give_the_one_rank_metric(batch_size):
    """5 samples, 2 ranks: rank 1 reads sample 0 again as padding. Counted, top-1 would be
    2/6 = 0.333 (sample 0, the only right one, twice); left out, it is 1/5 = 0.2 as on 1 rank."""
    one = evaluated_on(1, 5, batch_size)
    assert one["top1"] == pytest.approx(0.2)
    assert evaluated_on(2, 5, batch_size) == one
    assert evaluated_on(3, 7, batch_size)["top1"] == pytest.approx(1 / 7)  # counted: 2 / 9


def test_without_counted_every_row_counts():
    """A loader that is not an EpochSampler share (counted=None) counts every row it reads."""
    sampler = EpochSampler(5, shuffle=False, rank=1, world_size=2)
    loader = EpochBatchSampler(sampler, 2, drop_last=False)
    assert evaluate(PositionBackend([]), loader, "classification")["top1"] == pytest.approx(1 / 3)


# ---------------------------------------------------------------- two real ranks over gloo
@pytest.mark.parametrize(
    "framework",
    [
        pytest.param("torch", marks=pytest.mark.torch),
        pytest.param("paddle", marks=pytest.mark.paddle),
    ],
)
def test_two_gloo_ranks_evaluate_an_odd_set_as_one_rank_does(framework, tmp_path):
    """The OCR smoke model (untrained) on 7 lines under the real launcher: 2 ranks, a loader
    worker each, the metric all-reduced over gloo, equal to the 1-rank metric. Counted, rank 1's
    padding (line 0 again) would move norm_edit_dis to (sum + line 0's) / 8."""
    import json
    import os
    import subprocess
    import sys

    from datasets.lmdb_ocr import LmdbOcrWriter
    from datasets.synthetic import LATIN, ocr_samples, write_all
    from tests.conftest import ROOT
    from tests.test_distributed import rendezvous
    from train.launch import launch_command

    if framework == "paddle":
        import paddle

        if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
            pytest.skip("GPUs present: paddle.distributed.launch would place ranks on them")
    lmdb, out = tmp_path / "val", tmp_path / "eval.json"
    write_all(LmdbOcrWriter(lmdb), ocr_samples(7, LATIN, None, seed=3))
    (tmp_path / "charset.txt").write_text("".join(c + "\n" for c in LATIN), encoding="utf-8")
    probe = ["tests/probes/eval_ranks_probe.py", framework, str(lmdb), str(out)]
    options = rendezvous(framework, tmp_path / "logs")
    cmd = launch_command(framework, sys.executable, 2, probe, **options)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_"))}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("workerlog.*"))
    assert result.returncode == 0, result.stderr[-3000:] + logs[-3000:]
    found = json.loads(out.read_text())
    per_sample = found["per_sample"]
    assert len(per_sample) == 7
    padded_in = (sum(per_sample) + per_sample[0]) / 8
    assert padded_in != pytest.approx(np.mean(per_sample)), "lines alike: the set cannot tell"
    assert found["whole"]["norm_edit_dis"] == pytest.approx(np.mean(per_sample))
    assert found["sharded"] == pytest.approx(found["whole"])
