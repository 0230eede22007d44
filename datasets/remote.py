"""Stage remote datasets (``s3://``) into a node-local cache, once per node.

    python -m datasets.remote stage s3://bucket/ocr/train_lmdb --cache-dir /local/cache

Readers open LMDB with mmap and HDF5 with random reads; both are slow or impossible on object
storage, so a remote dataset is copied to local disk before the first reader opens it. An
``s3://.../prefix`` (an LMDB directory, or a tree of them) becomes a local directory, a single
object (``s3://b/x.h5``) a local file. ``lock.mdb`` objects are skipped: readers open with
``lock=False``.

Many ranks and DataLoader workers call :func:`stage` at once: an ``fcntl.flock`` per dataset in
``cache_dir/.locks`` lets one process download while the others wait and then reuse. Objects are
downloaded to ``cache_dir/.partial`` and renamed into place once verified
(:mod:`datasets.s3_objects` does the S3 side), so a final name never holds a partial file. A
JSON manifest per dataset records ETag/size/mtime of every object; a warm call lists or HEADs
the remote (one request) and downloads only what changed.

Endpoint and credentials come only from the AWS environment variables (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL[_S3], AWS_PROFILE, AWS_REGION) and
the AWS config files, never from training configs. s3fs is imported only when staging.

Stage before a framework is imported: a framework that bundles its own copy of zlib can break
the compression under the S3 client (aiohttp). ``python -m train`` stages first
(train/__main__.py); in a process of your own, stage first or use the CLI above.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from datasets import s3_objects as s3
from datasets import safe_files
from datasets.s3_objects import RemoteObject, RemoteStorageError

log = logging.getLogger(__name__)

__all__ = ["RemoteStorageError", "is_remote", "release", "stage"]

MANIFEST_VERSION = 1
_PARALLEL_OBJECTS = 8
_IN_USE: dict[str, int] = {}  # lock-file path -> fd holding LOCK_SH while this process uses it


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True for paths that :func:`stage` must copy locally first (``s3://`` / ``s3a://``)."""
    return str(path).startswith(("s3://", "s3a://"))


def _open_lock(path: Path) -> int:
    """A lock file of the cache, created when missing; a link at its name is refused (the cache
    folder may be shared, and O_CREAT through a link would create its target)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | safe_files.NOFOLLOW, 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise safe_files.LinkRefusedError(path) from None
        raise


@contextlib.contextmanager
def _locked(path: Path, url: str) -> Iterator[None]:
    """Hold the exclusive staging lock for one dataset; say so if another process has it."""
    fd = _open_lock(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process on this node to finish staging %s", url)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _mark_in_use(inuse: Path) -> None:
    """Hold a shared lock until exit (or :func:`release`) so eviction skips this dataset."""
    if str(inuse) not in _IN_USE:
        fd = _open_lock(inuse)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _IN_USE[str(inuse)] = fd


def _try_exclusive(paths: list[Path]) -> list[int] | None:
    """Non-blocking exclusive locks on all ``paths``, or None if any is held elsewhere."""
    fds: list[int] = []
    for path in paths:
        fds.append(_open_lock(path))
        try:
            fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            for fd in fds:
                os.close(fd)
            return None
    return fds


def _entry_name(url: str) -> str:
    """Readable and unique per (endpoint, url) cache entry name."""
    bucket, key = s3.split_url(url)
    digest = hashlib.sha256(f"{s3.endpoint()}|{bucket}/{key}".encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{bucket}_{key.rsplit('/', 1)[-1]}")[:60]
    return f"{slug}-{digest}"


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _read_json(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            return data
    return {}


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with os.fdopen(safe_files.open_new(tmp), "w") as f:  # a link at the name: refused
        f.write(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, safe_files.refuse_link(path))


def _cache_entries(cache: Path) -> list[tuple[float, str, int, str]]:
    """(last_used, name, bytes, url) for every dataset in the cache, crashed stagings too."""
    names = {p.name[: -len(".manifest.json")] for p in cache.glob("*.manifest.json")}
    names |= {p.name for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")}
    if (cache / ".partial").is_dir():
        names |= {p.name for p in (cache / ".partial").iterdir()}
    out = []
    for name in names:
        meta = _read_json(cache / f"{name}.manifest.json")
        size = _du(cache / name) + _du(cache / ".partial" / name)
        out.append((float(meta.get("last_used", 0.0)), name, size, meta.get("url", name)))
    return out


def _evict(cache: Path, keep: str, need: int, max_bytes: int, url: str) -> None:
    """Remove least-recently-used datasets, never one in use, until ``need`` more bytes fit."""
    if need > max_bytes:
        raise RemoteStorageError(
            f"{url} needs {need} bytes, more than cache_max_bytes={max_bytes}",
            "raise data.remote_cache_max_bytes (--cache-max-bytes) or stage a smaller dataset",
        )
    entries = [e for e in _cache_entries(cache) if e[1] != keep]
    used = sum(size for _, _, size, _ in entries)
    for last_used, name, size, old_url in sorted(entries):
        if used + need <= max_bytes:
            return
        locks = cache / ".locks"
        fds = _try_exclusive([locks / f"{name}.lock", locks / f"{name}.inuse"])
        if fds is None:
            log.info("not evicting %s: in use by another process", old_url)
            continue
        try:
            for path in (cache / name, cache / ".partial" / name):
                shutil.rmtree(path, ignore_errors=True)
            (cache / f"{name}.manifest.json").unlink(missing_ok=True)
        finally:
            for fd in fds:
                os.close(fd)
        used -= size
        log.warning(
            "evicted %s from %s (%.1f MiB, last used %s) to stay under %.1f MiB",
            old_url,
            cache,
            size / 2**20,
            time.ctime(last_used),
            max_bytes / 2**20,
        )
    if used + need > max_bytes:
        log.warning("cache %s stays over cache_max_bytes: the other datasets are in use", cache)


def _stale(root: Path, objects: list[RemoteObject], known: dict) -> list[RemoteObject]:
    """Objects whose local copy is missing, or whose remote ETag or size changed."""
    out = []
    for obj in objects:
        local, meta = root / obj.rel, known.get(obj.rel, {})
        fresh = meta.get("etag") == obj.etag and meta.get("size") == obj.size
        if not (fresh and local.is_file() and local.stat().st_size == obj.size):
            out.append(obj)
    return out


def _download_all(
    fs: Any,
    url: str,
    cache: Path,
    name: str,
    todo: list[RemoteObject],
    opt: s3.TransferOptions,
    on_done: Callable[[RemoteObject], None],
) -> None:
    """Download objects in parallel; ``on_done`` records each one as soon as it is in place."""
    need = sum(o.size for o in todo)
    if shutil.disk_usage(cache).free < need:
        raise RemoteStorageError(
            f"not enough free space in {cache} for {need} bytes of {url}",
            "free disk space, lower cache_max_bytes or move cache_dir",
        )
    log.info("staging %d object(s), %.1f MiB, from %s", len(todo), need / 2**20, url)
    meter = s3.Meter(url, need, opt.progress)

    def one(obj: RemoteObject) -> None:
        part = cache / ".partial" / name / f"{obj.rel}.part"
        s3.download(fs, url, obj, cache / name / obj.rel, part, opt, meter)
        on_done(obj)

    with ThreadPoolExecutor(min(_PARALLEL_OBJECTS, len(todo))) as pool:
        futures = [pool.submit(one, obj) for obj in todo]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _sync_entry(
    fs: Any, url: str, cache: Path, name: str, opt: s3.TransferOptions
) -> tuple[str, list]:
    """List the remote, download what is missing or changed, forget what vanished.

    The manifest is rewritten after every finished object, so an interrupted staging of a
    large tree keeps the objects it completed.
    """
    manifest_path, root = cache / f"{name}.manifest.json", cache / name
    manifest = _read_json(manifest_path)
    kind, objects = s3.list_remote(fs, url, manifest.get("kind"), opt)
    known: dict[str, dict] = dict(manifest.get("objects", {}))
    todo = _stale(root, objects, known)
    lock = threading.Lock()

    def record(obj: RemoteObject | None = None) -> None:
        with lock:
            if obj is not None:
                known[obj.rel] = {k: v for k, v in asdict(obj).items() if k != "rel"}
            _write_json(
                manifest_path,
                {
                    "version": MANIFEST_VERSION,
                    "url": url,
                    "endpoint": s3.endpoint(),
                    "kind": kind,
                    "last_used": time.time(),
                    "total_bytes": sum(o.size for o in objects),
                    "objects": known,
                },
            )

    if opt.cache_max_bytes is not None:
        _evict(cache, name, sum(o.size for o in objects), opt.cache_max_bytes, url)
    if todo:
        _download_all(fs, url, cache, name, todo, opt, record)
    partial = cache / ".partial" / name
    for folder in [*sorted(partial.rglob("*"), reverse=True), partial]:
        with contextlib.suppress(OSError):
            folder.rmdir()  # empty folders only: left-over partial files stay resumable
    for rel in set(known) - {o.rel for o in objects}:
        del known[rel]
        # Staged earlier, deleted remotely since. The name comes from the manifest, a file in
        # the cache that anyone who can write the cache can edit: only a name that stays
        # inside this dataset's folder is removed.
        if _inside(root, root / rel):
            (root / rel).unlink(missing_ok=True)
        else:
            log.warning("%s names %r, outside %s: not removed", manifest_path, rel, root)
    record()
    return kind, objects


def _inside(folder: Path, path: Path) -> bool:
    """Whether ``path``, with every symlink and '..' resolved, lies below ``folder``."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def stage(
    url: str,
    cache_dir: str | os.PathLike[str],
    *,
    cache_max_bytes: int | None = None,
    retries: int = 5,
    backoff_s: float = 0.5,
    timeout_s: float = 30.0,
    progress: bool = False,
) -> Path:
    """Copy ``url`` into ``cache_dir`` (once per node) and return the local path to read.

    Returns a directory for a prefix (LMDB dir or tree) and a file for a single object. The
    dataset stays marked in use, and so safe from eviction, until this process exits or calls
    :func:`release`. Raises :class:`RemoteStorageError` with a hint on any failure.
    """
    if not is_remote(url):
        raise ValueError(f"not a remote path: {url!r} (expected s3://bucket/prefix)")
    cache, name, started = Path(cache_dir), _entry_name(url), time.monotonic()
    (cache / ".locks").mkdir(parents=True, exist_ok=True)
    opt = s3.TransferOptions(retries, backoff_s, cache_max_bytes, progress)
    with _locked(cache / ".locks" / f"{name}.lock", url):
        fs = s3.make_fs(timeout_s)
        for attempt in range(3):
            try:
                kind, objects = _sync_entry(fs, url, cache, name, opt)
                break
            except s3.RemoteChanged:
                if attempt == 2:
                    raise RemoteStorageError(
                        f"{url} keeps changing while it is being staged",
                        "stage it again once the upload has finished",
                    ) from None
                log.warning("%s changed on the server during download; listing again", url)
        _mark_in_use(cache / ".locks" / f"{name}.inuse")
    local = cache / name if kind == "prefix" else cache / name / objects[0].rel
    log.info("%s ready at %s (%.2fs)", url, local, time.monotonic() - started)
    return local


def release(url: str, cache_dir: str | os.PathLike[str]) -> None:
    """Drop this process's in-use mark on a staged dataset so it may be evicted."""
    fd = _IN_USE.pop(str(Path(cache_dir) / ".locks" / f"{_entry_name(url)}.inuse"), None)
    if fd is not None:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """CLI: stage a dataset and print the local path (for shell scripts and init containers)."""
    parser = argparse.ArgumentParser(
        prog="python -m datasets.remote",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("stage", help="copy s3://bucket/prefix into the cache, print its path")
    cmd.add_argument("url", help="s3://bucket/prefix (LMDB dir or tree) or s3://bucket/x.h5")
    cmd.add_argument("--cache-dir", required=True, help="node-local directory for the cache")
    size = cmd.add_mutually_exclusive_group()
    size.add_argument("--cache-max-gb", type=float, help="evict LRU datasets above this size")
    size.add_argument("--cache-max-bytes", type=int, help="the same, in bytes")
    cmd.add_argument("--retries", type=int, default=5, help="retries on network errors")
    cmd.add_argument("--backoff-s", type=float, default=0.5, help="first retry delay, doubled")
    cmd.add_argument("--timeout-s", type=float, default=30.0, help="connect/read timeout")
    cmd.add_argument("-q", "--quiet", action="store_true", help="print only the path")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    max_bytes = args.cache_max_bytes
    if args.cache_max_gb is not None:
        max_bytes = int(args.cache_max_gb * 2**30)
    try:
        path = stage(
            args.url,
            args.cache_dir,
            cache_max_bytes=max_bytes,
            retries=args.retries,
            backoff_s=args.backoff_s,
            timeout_s=args.timeout_s,
            progress=not args.quiet,
        )
    except RemoteStorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
