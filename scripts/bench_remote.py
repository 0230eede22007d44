#!/usr/bin/env python
"""Time to the first usable local path for an s3:// LMDB: cold cache vs warm cache.

  python -m scripts.bench_remote --mb 50 --runs 3

Starts moto's S3 server on 127.0.0.1 (bench/s3_server.py, a separate process), uploads one
LMDB of about --mb MB, then alternates cold (empty cache dir) and warm (the cache the cold run
just filled) calls of datasets.remote.stage(), each with a fresh S3 client as a new training
process would have, plus a warm call that reuses the client (a second dataset or a restarted
loader in the same process). ``import s3fs``, paid once per process, is timed on its own.
Prints JSON with every run and the medians. Loopback has no network latency or bandwidth
limit: the cold figure is the floor of staging cost on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def make_lmdb(path: Path, megabytes: int) -> int:
    """Write an LMDB of about ``megabytes`` MB of random values; return data.mdb's size."""
    import lmdb

    value_size = 4000  # one 4 KiB overflow page each, like a small encoded image
    env = lmdb.open(str(path), map_size=(megabytes + 64) * 2**20)
    with env.begin(write=True) as txn:
        for i in range(megabytes * 2**20 // value_size):
            txn.put(f"image-{i:09d}".encode(), os.urandom(value_size))
    env.close()
    return (path / "data.mdb").stat().st_size


def timed_stage(url: str, cache: Path, new_client: bool = True) -> float:
    """Seconds until stage() returns a usable path (by default with a client built anew)."""
    from datasets import remote, s3_objects

    if new_client:
        s3_objects.drop_clients()  # a new training process has no client yet
    started = time.perf_counter()
    local = remote.stage(url, cache)
    elapsed = time.perf_counter() - started
    assert (local / "data.mdb").is_file()
    remote.release(url, cache)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=50, help="size of the LMDB in MB")
    parser.add_argument("--runs", type=int, default=3, help="cold/warm pairs (median reported)")
    args = parser.parse_args()

    from bench.s3_server import S3TestServer

    started = time.perf_counter()
    import s3fs  # noqa: F401 - paid once per process, before cold and warm alike

    import_s = time.perf_counter() - started
    server = S3TestServer().start()
    try:
        os.environ.update(server.env())
        with tempfile.TemporaryDirectory(prefix="bench_remote_") as tmp:
            size = make_lmdb(Path(tmp) / "src", args.mb)
            client = server.admin_client()
            client.create_bucket(Bucket="bench")
            client.upload_file(str(Path(tmp) / "src" / "data.mdb"), "bench", "ocr/data.mdb")
            url, cold, warm, again = "s3://bench/ocr", [], [], []
            for run in range(args.runs):  # alternate A B A B: the host is shared and noisy
                cache = Path(tmp) / f"cache{run}"
                cold.append(timed_stage(url, cache))
                warm.append(timed_stage(url, cache))
                again.append(timed_stage(url, cache, new_client=False))
    finally:
        server.stop()
    result = {
        "command": f"python -m scripts.bench_remote --mb {args.mb} --runs {args.runs}",
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, py{platform.python_version()}",
        "server": "moto S3 on 127.0.0.1 (separate process)",
        "lmdb_bytes": size,
        "import_s3fs_s": round(import_s, 3),
        "cold_s": [round(t, 3) for t in cold],
        "warm_s": [round(t, 3) for t in warm],
        "cold_median_s": round(statistics.median(cold), 3),
        "warm_median_s": round(statistics.median(warm), 3),
        "warm_same_process_s": [round(t, 3) for t in again],
        "warm_same_process_median_s": round(statistics.median(again), 3),
        "cold_MiB_per_s": round(size / 2**20 / statistics.median(cold), 1),
        "cold_over_warm": round(statistics.median(cold) / statistics.median(warm), 1),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
