"""The shared record cache: one copy for all workers, bounded, counted, and transparent."""

from __future__ import annotations

import numpy as np
import pytest

from datasets.dataset import build_image_dataset, build_ocr_dataset
from datasets.errors import DatasetError
from datasets.ocr_transforms import CharDict


def test_unknown_cache_mode_is_named_with_the_choices(image_h5, tmp_path):
    with pytest.raises(DatasetError, match="unknown cache mode 'ram'") as err:
        build_image_dataset(image_h5, train=False, cache="ram", state_dir=tmp_path)
    assert "none, memory or disk" in err.value.hint


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_cached_equals_uncached_for_deterministic_transforms(image_h5, tmp_path, mode):
    plain = build_image_dataset(image_h5, train=False, state_dir=tmp_path)
    cached = build_image_dataset(
        image_h5, train=False, cache=mode, cache_dir=tmp_path / "c", state_dir=tmp_path
    )
    for _ in range(2):  # first pass fills (misses), second pass hits
        for i in range(len(plain)):
            a, b = plain[i], cached[i]
            assert np.array_equal(a["image"], b["image"]) and a["label"] == b["label"]
    stats = cached.cache.stats()
    assert (stats["misses"], stats["hits"], stats["inserts"]) == (24, 24, 24)
    cached.close()


def test_random_augmentation_stays_random_with_a_cache(ocr_lmdb, tmp_path):
    chars = CharDict.from_file(ocr_lmdb.parent / "charset.txt")
    dataset = build_ocr_dataset(ocr_lmdb, chars, train=True, cache="memory", state_dir=tmp_path)
    e0 = [dataset[(0, i)]["image"] for i in range(20)]
    e1 = [dataset[(1, i)]["image"] for i in range(20)]
    assert sum(not np.array_equal(a, b) for a, b in zip(e0, e1)) > 5  # epochs differ
    assert all(np.array_equal(a, dataset[(0, i)]["image"]) for i, a in enumerate(e0))  # seeded
    dataset.close()


def test_cache_is_bounded_and_counts_rejections(image_h5, tmp_path):
    dataset = build_image_dataset(
        image_h5, train=False, cache="memory", cache_max_bytes=500_000, state_dir=tmp_path
    )
    for i in range(len(dataset)):
        dataset[i]
    stats = dataset.cache.stats()
    assert stats["bytes_used"] <= 500_000
    assert stats["inserts"] + stats["rejected_full"] == 24 and stats["rejected_full"] > 0
    dataset.close()


def test_disk_cache_is_reused_by_a_later_run_and_invalidated_by_a_new_file(image_h5, tmp_path):
    first = build_image_dataset(image_h5, train=False, cache="disk", cache_dir=tmp_path / "c")
    [first[i] for i in range(len(first))]
    later = build_image_dataset(image_h5, train=False, cache="disk", cache_dir=tmp_path / "c")
    later.cache.reset_counters()
    [later[i] for i in range(len(later))]
    assert later.cache.stats()["hits"] == 24 and later.cache.stats()["misses"] == 0
    copy = tmp_path / "other.h5"
    copy.write_bytes(image_h5.read_bytes())  # different path and mtime: a different dataset
    other = build_image_dataset(copy, train=False, cache="disk", cache_dir=tmp_path / "c")
    assert other.cache.stats()["inserts"] == 0
    assert len(list((tmp_path / "c").glob("*.cache"))) == 2


def test_a_disk_cache_left_half_built_by_a_dead_process_is_removed_when_a_cache_is_built(
    image_h5, tmp_path
):
    """A run killed while it built a disk cache leaves records-<fingerprint>.cache.<pid>.partial
    (hundreds of MB for a real dataset). The next build in that folder removes it; one being
    built by a live process stays: its pid is alive here, or it carries the owner's mark of a
    process this PID namespace cannot see."""
    import os
    import subprocess

    from datasets import owner_lock

    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = finished.pid
    folder = tmp_path / "c"
    folder.mkdir()
    left = folder / f"records-00000000abcdef.cache.{dead}.partial"
    left.write_bytes(b"\0" * 4096)
    live_here = folder / f"records-0000000000beef.cache.{os.getpid()}.partial"
    live_here.write_bytes(b"\0" * 4096)
    marked_path = folder / f"records-0000000000cafe.cache.{dead}.partial"
    marked = owner_lock.create_marked(str(marked_path), 4096)  # a live owner, pid not visible
    try:
        dataset = build_image_dataset(image_h5, train=False, cache="disk", cache_dir=folder)
        [dataset[i] for i in range(len(dataset))]
        assert not left.exists() and live_here.exists() and marked_path.exists()
        assert len(list(folder.glob("*.cache"))) == 1
    finally:
        os.close(marked)


def test_memory_cache_file_is_removed_on_close(image_h5, tmp_path):
    dataset = build_image_dataset(image_h5, train=False, cache="memory", state_dir=tmp_path)
    path = dataset.cache._block.path
    dataset[0]
    dataset.close()
    import os

    assert not os.path.exists(path)


def _read_in_a_process(dataset, indices, results) -> None:
    """A loader worker's part: read ``indices`` through the shared cache, report the labels."""
    results.put([int(dataset[i]["label"]) for i in indices])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_two_worker_processes_share_one_memory_cache(image_h5, tmp_path, context):
    """What one worker caches, another process hits: worker A reads the first half (misses,
    inserts), then worker B reads everything (hits on A's half, misses on the rest), then the
    trainer's process hits on all. Real processes, as the loaders start them."""
    import multiprocessing

    dataset = build_image_dataset(image_h5, train=False, cache="memory", state_dir=tmp_path)
    plain = build_image_dataset(image_h5, train=False, state_dir=tmp_path / "plain")
    ctx = multiprocessing.get_context(context)
    results = ctx.Queue()
    for indices in (range(12), range(24)):
        worker = ctx.Process(target=_read_in_a_process, args=(dataset, list(indices), results))
        worker.start()
        labels = results.get(timeout=120)
        worker.join(timeout=60)
        assert worker.exitcode == 0
        assert labels == [int(plain[i]["label"]) for i in indices]
    stats = dataset.cache.stats()
    assert (stats["inserts"], stats["misses"], stats["hits"]) == (24, 12 + 12, 12)
    for i in range(24):  # the trainer's process: all from what the workers cached
        assert np.array_equal(dataset[i]["image"], plain[i]["image"])
    assert dataset.cache.stats()["hits"] == 12 + 24
    dataset.close()


def test_shared_files_are_created_exclusively_never_through_a_symlink(tmp_path):
    """Shared files (memory cache, counters, in-flight table) sit in world-writable folders:
    a name planted there as a symlink is refused, never truncated through; a regular file of
    our own at the name (a leftover of an earlier process) is replaced."""
    from datasets.shared_block import SharedBlock

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = tmp_path / "block"
    planted.symlink_to(victim)
    with pytest.raises(FileExistsError, match="not a file of ours"):
        SharedBlock(planted, 64)
    assert victim.read_bytes() == b"precious"

    leftover = tmp_path / "leftover"
    leftover.write_bytes(b"x" * 10)
    block = SharedBlock(leftover, 64)
    assert leftover.stat().st_size == 64
    assert not block.array(np.uint8, 0, 64).any()


@pytest.mark.parametrize("mode", ["none", "memory"])
def test_injected_storage_latency_is_paid_on_reads_from_the_storage_only(
    image_h5, tmp_path, monkeypatch, mode
):
    """DATA_INJECT_FAULT=latency@MS delays each read that reaches the storage, below the record
    cache: two passes without a cache pay it every time, with one only on the first pass's
    misses, as a cache spares a network volume's round trips."""
    from datasets import faults

    slept = []
    monkeypatch.setenv(faults.ENV, "latency@0.5")  # fractions of a millisecond too
    monkeypatch.setattr(faults, "_parsed", {})
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    dataset = build_image_dataset(
        image_h5, train=False, cache=mode, cache_dir=tmp_path / "c", state_dir=tmp_path
    )
    try:
        for _ in range(2):
            for i in range(len(dataset)):
                dataset[i]
    finally:
        dataset.close()
    reads = 2 * len(dataset) if mode == "none" else len(dataset)
    assert slept == [0.0005] * reads
