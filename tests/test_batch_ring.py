"""The batch ring (datasets/batch_ring.py): a worker's batch reaches the trainer through one slot
written once, a worker waits for its slot and lets go when the epoch is ended, Paddle's and
torch's loaders through the ring give the same batches as the framework's own hand-over (Paddle:
one copy instead of two; torch: no /dev/shm file faulted in per batch), with persistent workers
too, and a trainer killed with -9 leaves ring files that the start-up sweep removes (both
frameworks)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from datasets.batch_ring import RING_PREFIX, BatchRing, RingTicket, StaleBatch
from train import preflight
from train.backends.common import stack_samples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _samples(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.integers(0, 256, (6, 10, 3), dtype=np.uint8),
            "label": rng.integers(0, 50, (4,), dtype=np.int64),
        }
        for _ in range(n)
    ]


def _write_in_child(ring: BatchRing, ticket: RingTicket, seed: int, result) -> None:
    try:
        result.put(ring.write(ticket, _samples(3, seed)))
    except StaleBatch:
        result.put("stale")


@pytest.fixture
def ring(tmp_path):
    ring = BatchRing.create(2, tmp_path)
    yield ring
    ring.unlink()


def test_a_batch_written_in_another_process_is_read_back_exactly(ring):
    generation = ring.start_generation()
    result = multiprocessing.get_context("spawn").Queue()
    child = multiprocessing.get_context("spawn").Process(
        target=_write_in_child, args=(ring, RingTicket(generation, 0), 7, result)
    )
    child.start()
    assert result.get(timeout=60) == 0
    child.join(30)
    views = ring.take(generation, 0, 0)
    expected = stack_samples(_samples(3, 7))
    assert views.keys() == expected.keys()
    for key in expected:
        assert views[key].dtype == expected[key].dtype
        np.testing.assert_array_equal(views[key], expected[key])
    ring.release()
    with pytest.raises(RuntimeError, match="out of step: got generation .* batch 0"):
        ring.take(generation, 0, 0)  # taken already: the trainer expects batch 1


def test_a_worker_waits_for_its_slot_and_drops_a_batch_of_an_ended_epoch(ring):
    generation = ring.start_generation()
    ring.write(RingTicket(generation, 0), _samples(2, 1))
    ring.write(RingTicket(generation, 1), _samples(2, 2))
    context = multiprocessing.get_context("fork")
    result = context.Queue()
    # Batch 2 goes to slot 0, which holds batch 0 until the trainer releases it.
    waiting = context.Process(
        target=_write_in_child, args=(ring, RingTicket(generation, 2), 3, result)
    )
    waiting.start()
    time.sleep(0.5)
    assert result.empty() and waiting.is_alive()
    ring.take(generation, 0, 0)
    ring.release()
    assert result.get(timeout=30) == 0
    waiting.join(30)
    # Batch 4 waits for batch 2's slot; the epoch is abandoned: the worker lets go.
    stuck = context.Process(
        target=_write_in_child, args=(ring, RingTicket(generation, 4), 4, result)
    )
    stuck.start()
    time.sleep(0.3)
    ring.end_generation()
    assert result.get(timeout=30) == "stale"
    stuck.join(30)


def test_a_field_that_is_not_numbers_is_a_clear_error(ring):
    generation = ring.start_generation()
    with pytest.raises(TypeError, match="sample field 'text' is object .*loader.batch_ring: false"):
        ring.write(RingTicket(generation, 0), [{"text": np.array(["a", 1], dtype=object)}])


def test_slots_grow_to_the_batch_and_shrink_between_epochs(ring):
    generation = ring.start_generation()
    ring.write(RingTicket(generation, 0), _samples(5, 1))
    payload = stack_samples(_samples(5, 1))
    assert ring.bytes_on_disk() >= sum(a.nbytes for a in payload.values())
    ring.shrink()
    assert ring.bytes_on_disk() == 2 * 4096 + 16  # headers and the control block only


@pytest.mark.paddle
def test_paddle_loader_through_the_ring_matches_paddles_own_handover(ocr_lmdb):
    import train.backends.paddle  # noqa: F401  (zlib before paddle)
    from datasets.dataset import build_ocr_dataset
    from datasets.ocr_transforms import CharDict
    from datasets.sampler import EpochSampler
    from train.backends.common import LoaderKnobs
    from train.backends.paddle.data import make_loader

    charset = CharDict.from_file(ocr_lmdb.parent / "charset.txt")
    dataset = build_ocr_dataset(ocr_lmdb, charset, train=True, augment=False)
    knobs = LoaderKnobs(batch_size=16, num_workers=2, timeout_s=60)
    epochs = {}
    for ring in (True, False):
        sampler = EpochSampler(len(dataset), seed=3)
        loader = make_loader(dataset, sampler, knobs, batch_ring=ring)
        assert (loader.ring is not None) == ring
        assert loader.copies_per_batch == (1 if ring else 2)
        batches = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for i, batch in enumerate(loader):
                batches.append({key: value.numpy() for key, value in batch.items()})
                if epoch == 0 and i == 1:
                    break  # an epoch abandoned mid-way (max_steps) ends cleanly
        if ring:
            assert loader.ring.bytes_on_disk() == (2 * 2 + 2) * 4096 + 16  # shrunk after
            paths = loader.ring.paths()
            del loader
            assert not any(os.path.exists(p) for p in paths)  # unlinked with the loader
        epochs[ring] = batches
    dataset.close()
    assert len(epochs[True]) == len(epochs[False]) == 2 + 96 // 16
    for ours, theirs in zip(epochs[True], epochs[False]):
        assert ours.keys() == theirs.keys()
        for key in ours:
            np.testing.assert_array_equal(ours[key], theirs[key])


@pytest.mark.torch
@pytest.mark.parametrize("persistent", [False, True])
def test_torch_loader_through_the_ring_matches_torchs_own_handover(image_h5, persistent):
    from datasets.dataset import build_image_dataset
    from datasets.sampler import EpochSampler
    from train.backends.common import LoaderKnobs
    from train.backends.torch.data import RingLoader, make_loader

    dataset = build_image_dataset(image_h5, train=True)
    knobs = LoaderKnobs(batch_size=4, num_workers=2, timeout_s=60, persistent_workers=persistent)
    epochs = {}
    for ring in (True, False):
        sampler = EpochSampler(len(dataset), seed=3)
        loader = make_loader(dataset, sampler, knobs, batch_ring=ring)
        assert isinstance(loader, RingLoader) == ring
        batches = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for i, batch in enumerate(loader):
                batches.append({key: value.numpy().copy() for key, value in batch.items()})
                if epoch == 0 and i == 1:
                    break  # an epoch abandoned mid-way (max_steps) ends cleanly
        if ring:
            assert loader.copies_per_batch == 1
            slots = 2 * 2 + 2
            if persistent:  # the workers keep their slots mapped, so the files keep their pages
                assert loader.ring.bytes_on_disk() > slots * 4 * 224 * 224 * 3
            else:
                assert loader.ring.bytes_on_disk() == slots * 4096 + 16  # shrunk after
            paths = loader.ring.paths()
            del loader
            assert not any(os.path.exists(p) for p in paths)  # unlinked with the loader
        epochs[ring] = batches
    dataset.close()
    assert len(epochs[True]) == len(epochs[False]) == 2 + 2 * (24 // 4)
    for ours, theirs in zip(epochs[True], epochs[False]):
        assert ours.keys() == theirs.keys() == {"image", "label"}
        for key in ours:
            np.testing.assert_array_equal(ours[key], theirs[key])


_KILLED_TRAINER = {
    "paddle": """
import sys, time
import train.backends.paddle
from datasets.dataset import build_ocr_dataset
from datasets.ocr_transforms import CharDict
from datasets.sampler import EpochSampler
from train.backends.common import LoaderKnobs
from train.backends.paddle.data import make_loader
dataset = build_ocr_dataset(sys.argv[1], CharDict.from_file(sys.argv[2]), train=True, augment=False)
loader = make_loader(dataset, EpochSampler(len(dataset)), LoaderKnobs(batch_size=8, num_workers=1))
for batch in loader:
    print(loader.ring.base, flush=True)
    time.sleep(600)
""",
    "torch": """
import sys, time
from datasets.dataset import build_image_dataset
from datasets.sampler import EpochSampler
from train.backends.common import LoaderKnobs
from train.backends.torch.data import make_loader
dataset = build_image_dataset(sys.argv[1], train=True)
loader = make_loader(dataset, EpochSampler(len(dataset)), LoaderKnobs(batch_size=8, num_workers=1))
for batch in loader:
    print(loader.ring.base, flush=True)
    time.sleep(600)
""",
}


@pytest.mark.parametrize(
    "framework",
    [
        pytest.param("paddle", marks=pytest.mark.paddle),
        pytest.param("torch", marks=pytest.mark.torch),
    ],
)
def test_the_rings_of_a_trainer_killed_with_sigkill_are_swept_at_start(
    framework, ocr_lmdb, image_h5, tmp_path
):
    data = (
        [str(ocr_lmdb), str(ocr_lmdb.parent / "charset.txt")]
        if framework == "paddle"
        else [str(image_h5)]
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_TRAINER[framework], *data],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        base = trainer.stdout.readline().strip()
        assert base.startswith(os.path.join(preflight.SHM_PATH, RING_PREFIX)), base
        live = preflight.stale_batches()
        assert not [p for p in live.paths if str(p).startswith(base)]  # its owner is alive
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
    # The worker dies with its parent (die_with_parent), and with the last of them the files'
    # owner's mark goes: each file is then listed once it is past the mark's window.
    deadline, files = time.monotonic() + 30, 1 + (2 * 1 + 2)
    while time.monotonic() < deadline:
        left = [p for p in preflight.stale_batches().paths if str(p).startswith(base)]
        if len(left) >= files:
            break
        time.sleep(0.2)
    batch_bytes = 8 * 48 * 320 * 3 if framework == "paddle" else 8 * 224 * 224 * 3
    assert len(left) == 1 + (2 * 1 + 2) and sum(os.path.getsize(p) for p in left) > batch_bytes
    preflight.remove_stale_batches()
    assert not [p for p in os.listdir(preflight.SHM_PATH) if p.startswith(os.path.basename(base))]
