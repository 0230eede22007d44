"""Stage remote datasets (``s3://``) into a node-local cache, once per node.

    python -m datasets.remote stage s3://bucket/ocr/train_lmdb --cache-dir /local/cache

Readers open LMDB with mmap and HDF5 with random reads; both are slow or impossible on object
storage, so a remote dataset is copied to local disk before the first reader opens it. An
``s3://.../prefix`` (an LMDB directory, or a tree of them) becomes a local directory, a single
object (``s3://b/x.h5``) a local file. ``lock.mdb`` objects are skipped: readers open with
``lock=False``.

Many ranks and DataLoader workers call :func:`stage` at once: an ``fcntl.flock`` per dataset in
``cache_dir/.locks`` lets one process download while the others wait and then reuse. Objects are
downloaded to ``cache_dir/.partial`` (resumed with a Range request while the remote ETag is
unchanged), checked for size and MD5-ETag, and renamed into place, so a final name never holds a
partial file. A JSON manifest per dataset records ETag/size/mtime of every object; a warm call
lists or HEADs the remote (one request) and downloads only what changed.

Endpoint and credentials come only from the AWS environment variables (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL[_S3], AWS_PROFILE, AWS_REGION) and
the AWS config files, never from training configs. s3fs is imported only when staging.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib  # before paddle can shadow it: see _zlib_shadowed
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from datasets.errors import DatasetError

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["RemoteStorageError", "is_remote", "release", "stage"]

MANIFEST_VERSION = 1
_CHUNK = 1 << 20
_PARALLEL_OBJECTS = 8
_AUTH_CODES = {
    "InvalidAccessKeyId": "the server does not know this access key id",
    "SignatureDoesNotMatch": "the secret access key does not match the access key id",
    "AccessDenied": "the credentials lack s3:ListBucket / s3:GetObject on this path",
    "403": "access denied (HTTP 403): wrong credentials or missing permission",
    "InvalidToken": "the session token is malformed or does not match the key",
    "ExpiredToken": "the session token has expired",
    "TokenRefreshRequired": "the session token has expired",
    "AllAccessDisabled": "all access to this object has been disabled",
}
_MISSING_CODES = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}
_TRANSIENT_CODES = set(
    "500 502 503 504 InternalError ServiceUnavailable SlowDown RequestTimeout Throttling "
    "ThrottlingException".split()
)
_CRED_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (plus AWS_SESSION_TOKEN for "
    "temporary credentials), or AWS_PROFILE naming a profile in ~/.aws/credentials"
)
_FS_ENV = tuple(  # the environment an S3 client is built from: a change means a new client
    "AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN AWS_PROFILE AWS_ENDPOINT_URL "
    "AWS_ENDPOINT_URL_S3 AWS_REGION AWS_DEFAULT_REGION AWS_CONFIG_FILE AWS_SHARED_CREDENTIALS_FILE "
    "AWS_CA_BUNDLE".split()
)
_FS_CACHE: dict[tuple, Any] = {}
_IN_USE: dict[str, int] = {}  # lock-file path -> fd holding LOCK_SH while this process uses it


class RemoteStorageError(DatasetError):
    """A remote dataset could not be staged: ``problem. HINT: hint`` on one line.

    A DatasetError, so the scripts and the trainer report it like any unusable dataset.
    """

    def __init__(self, problem: str, hint: str) -> None:
        super().__init__(problem, hint)


class _RemoteChanged(Exception):
    """The object changed on the server while we downloaded it (If-Match failed)."""


class _Corrupt(Exception):
    """A downloaded object has the wrong size or MD5; the partial file was discarded."""


@dataclass(frozen=True)
class RemoteObject:
    """One object to stage: where it lives remotely, where it goes locally, its version."""

    rel: str  # path below the staged root (the basename for a single object)
    key: str
    etag: str
    size: int
    mtime: str


@dataclass(frozen=True)
class _Options:
    """How hard to try and how much to keep; travels through the private helpers."""

    retries: int
    backoff_s: float
    max_cache_bytes: int | None
    progress: bool


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True for paths that :func:`stage` must copy locally first (``s3://`` / ``s3a://``)."""
    return str(path).startswith(("s3://", "s3a://"))


def _split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> (``bucket``, ``a/b``)."""
    bucket, _, key = url.split("://", 1)[1].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url!r}; expected s3://bucket/prefix")
    return bucket, key.strip("/")


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _endpoint_label() -> str:
    return _endpoint() or "the endpoint from the AWS config or AWS itself (AWS_ENDPOINT_URL unset)"


def _make_fs(timeout_s: float) -> Any:
    """An S3FileSystem configured from the environment, with retries left to us.

    Retries are disabled in botocore and s3fs so that one policy (``retries``/``backoff_s``)
    bounds the time to a clear error; listings are never cached so a warm check sees changes.
    The client is reused per process and environment: building one costs ~0.4 s, about 20
    times the warm check itself.
    """
    import s3fs

    key = (os.getpid(), timeout_s, *(os.environ.get(v) for v in _FS_ENV))
    if key in _FS_CACHE:
        return _FS_CACHE[key]
    client_kwargs = {}
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        client_kwargs["region_name"] = region
    fs = s3fs.S3FileSystem(
        endpoint_url=_endpoint(),
        client_kwargs=client_kwargs,
        config_kwargs={
            "connect_timeout": timeout_s,
            "read_timeout": timeout_s,
            "retries": {"mode": "standard", "total_max_attempts": 1},
        },
        skip_instance_cache=True,
        use_listings_cache=False,
    )
    fs.retries = 1  # s3fs's own retry loop; ours is _retrying()
    _FS_CACHE[key] = fs
    return fs


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code (``NoSuchKey``, ``403``...) anywhere in the exception chain."""
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict) and "Error" in response:
            return str(response["Error"].get("Code"))
        seen = seen.__cause__ or seen.__context__
    return None


def _is_transient(exc: BaseException) -> bool:
    """Network trouble, timeouts and truncated or corrupt transfers: worth another try."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError

    kinds: tuple[type[BaseException], ...] = (
        BotoConnectionError,
        HTTPClientError,
        ConnectionError,
        TimeoutError,
        _Corrupt,
    )
    with contextlib.suppress(ImportError):
        import aiohttp

        kinds += (aiohttp.ClientError,)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kinds):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _translate(exc: BaseException, url: str) -> RemoteStorageError | _RemoteChanged | None:
    """Map a non-transient failure to a clear error; None means "transient, retry"."""
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError, ProfileNotFound

    code, where = _error_code(exc), f"{url} at {_endpoint_label()}"
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return RemoteStorageError(f"no usable AWS credentials for {where}: {exc}", _CRED_HINT)
    if isinstance(exc, ProfileNotFound):
        return RemoteStorageError(
            f"{exc} (from AWS_PROFILE) for {where}",
            "unset AWS_PROFILE or add the profile to ~/.aws/config",
        )
    if code in _AUTH_CODES:
        return RemoteStorageError(f"{code} for {where}: {_AUTH_CODES[code]}", _CRED_HINT)
    if code in _MISSING_CODES:
        what = "bucket does not exist" if code == "NoSuchBucket" else "no such object or prefix"
        return RemoteStorageError(f"{what}: {where}", "check the dataset path and AWS_ENDPOINT_URL")
    if code == "PreconditionFailed":
        return _RemoteChanged(str(exc))
    if code in _TRANSIENT_CODES or _is_transient(exc):
        return None
    return RemoteStorageError(
        f"S3 error {code or type(exc).__name__} for {where}: {exc}",
        "see the message above; rerun with logging at DEBUG for details",
    )


def _retrying(what: str, url: str, fn: Callable[[], T], opt: _Options) -> T:
    """Run ``fn`` with bounded exponential backoff; only transient errors are retried."""
    retries = opt.retries
    for attempt in range(retries + 1):
        try:
            return fn()
        except (RemoteStorageError, _RemoteChanged):
            raise
        except Exception as exc:
            clear = _translate(exc, url)
            if clear is not None:
                raise clear from exc
            if attempt == retries:
                raise RemoteStorageError(
                    f"gave up on {what} {url} after {attempt + 1} attempts against "
                    f"{_endpoint_label()}: {type(exc).__name__}: {exc}",
                    "check AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 (and AWS_CA_BUNDLE for TLS), "
                    "that the server is up and reachable from this node (network, proxy)",
                ) from exc
            delay = opt.backoff_s * 2**attempt
            log.warning(
                "%s %s failed (%s: %s); retry %d/%d in %.2fs",
                what,
                url,
                type(exc).__name__,
                exc,
                attempt + 1,
                retries,
                delay,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")


def _list_remote(fs: Any, url: str, kind_hint: str | None, opt: _Options) -> tuple[str, list]:
    """Return ("prefix"|"object", objects); one request when the manifest knows the kind."""
    bucket, key = _split_url(url)
    if kind_hint == "object" and key:
        found = _head(fs, url, bucket, key, opt)
        if found:
            return "object", [found]
    objects = _list_prefix(fs, url, bucket, key, opt)
    if objects:
        return "prefix", objects
    if key and not url.endswith("/") and kind_hint != "object":
        found = _head(fs, url, bucket, key, opt)
        if found:
            return "object", [found]
    raise RemoteStorageError(
        f"nothing to stage at {url}: no such object and no objects under it at "
        f"{_endpoint_label()}",
        "check the dataset path and AWS_ENDPOINT_URL",
    )


def _head(fs: Any, url: str, bucket: str, key: str, opt: _Options) -> RemoteObject | None:
    """HEAD one object; None when it does not exist."""

    def fetch() -> dict | None:
        try:
            return fs.call_s3("head_object", Bucket=bucket, Key=key)
        except Exception as exc:
            code = _error_code(exc)
            if code in ("404", "NoSuchKey"):
                return None
            if code == "403":  # a HEAD reply has no body; a LIST names the exact problem
                fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=key, MaxKeys=1)
            raise

    out = _retrying("HEAD", url, fetch, opt)
    if out is None:
        return None
    return RemoteObject(
        key.rsplit("/", 1)[-1],
        key,
        out["ETag"],
        int(out["ContentLength"]),
        str(out.get("LastModified", "")),
    )


def _list_prefix(fs: Any, url: str, bucket: str, key: str, opt: _Options) -> list[RemoteObject]:
    """All objects below ``key/`` except lock.mdb and folder markers, paginated."""
    prefix, token, objects = f"{key}/" if key else "", None, []
    while True:
        kw = {"Bucket": bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
        page = _retrying("LIST", url, lambda kw=kw: fs.call_s3("list_objects_v2", **kw), opt)
        for item in page.get("Contents", []):
            rel = item["Key"][len(prefix) :]
            if rel.endswith("/") or rel.rsplit("/", 1)[-1] == "lock.mdb":
                continue
            if any(part in ("", ".", "..") for part in rel.split("/")):
                raise RemoteStorageError(
                    f"unsafe object key {item['Key']!r} under {url}",
                    "rename the object; keys must be plain relative paths",
                )
            objects.append(
                RemoteObject(
                    rel,
                    item["Key"],
                    item["ETag"],
                    int(item["Size"]),
                    str(item.get("LastModified", "")),
                )
            )
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            return objects


class _Meter:
    """Thread-safe byte counter that logs progress at most every few seconds."""

    def __init__(self, url: str, total: int, verbose: bool) -> None:
        self.url, self.total, self.verbose = url, total, verbose
        self.done, self.start, self.last = 0, time.monotonic(), time.monotonic()
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            now = time.monotonic()
            if now - self.last >= 5.0 or self.done == self.total:
                self.last = now
                mib_s = self.done / 2**20 / max(now - self.start, 1e-9)
                log.log(
                    logging.INFO if self.verbose else logging.DEBUG,
                    "staging %s: %.1f/%.1f MiB (%.1f MiB/s)",
                    self.url,
                    self.done / 2**20,
                    self.total / 2**20,
                    mib_s,
                )


def _md5_etag(etag: str) -> str | None:
    """The MD5 an ETag stands for, or None (multipart ETags are not an MD5)."""
    bare = etag.strip('"').lower()
    return bare if re.fullmatch(r"[0-9a-f]{32}", bare) else None


def _resume_offset(part: Path, obj: RemoteObject) -> tuple[int, Any]:
    """Bytes already downloaded of this exact version, and an MD5 primed with them.

    The sidecar JSON names the ETag the partial bytes came from; a different remote ETag or
    size means a new version, so the partial file is discarded rather than resumed.
    """
    sidecar = part.with_name(part.name + ".json")
    hasher = hashlib.md5(usedforsecurity=False)
    with contextlib.suppress(OSError, ValueError):
        meta = json.loads(sidecar.read_text())
        size = part.stat().st_size
        if meta == {"etag": obj.etag, "size": obj.size} and size <= obj.size:
            if _md5_etag(obj.etag):
                with part.open("rb") as f:
                    for block in iter(lambda: f.read(8 * _CHUNK), b""):
                        hasher.update(block)
            return size, hasher
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(b"")
    sidecar.write_text(json.dumps({"etag": obj.etag, "size": obj.size}))
    return 0, hasher


async def _stream_get(
    fs: Any, bucket: str, obj: RemoteObject, offset: int, part: Path, hasher: Any, meter: _Meter
) -> str | None:
    """GET the object from ``offset`` (If-Match its ETag) and append it to ``part``."""
    kw = {"IfMatch": obj.etag, **({"Range": f"bytes={offset}-"} if offset else {})}
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=obj.key, **kw)
    body = resp["Body"]
    try:
        with part.open("ab") as out:
            while chunk := await body.read(_CHUNK):
                out.write(chunk)
                hasher.update(chunk)
                meter.add(len(chunk))
    finally:
        body.close()
    return resp.get("ServerSideEncryption")


def _download(
    fs: Any, url: str, obj: RemoteObject, final: Path, part: Path, opt: _Options, meter: _Meter
) -> None:
    """Download one object resumably, verify size and MD5-ETag, rename it to ``final``."""
    from fsspec.asyn import sync

    bucket, _ = _split_url(url)

    def attempt() -> None:
        offset, hasher = _resume_offset(part, obj)
        if offset:
            log.info("resuming s3://%s/%s at byte %d of %d", bucket, obj.key, offset, obj.size)
            meter.add(offset)
        sse = None
        if offset < obj.size or obj.size == 0:
            sse = sync(fs.loop, _stream_get, fs, bucket, obj, offset, part, hasher, meter)
        size, md5 = part.stat().st_size, _md5_etag(obj.etag)
        kms = (sse or "").startswith("aws:kms")
        if size != obj.size or (md5 and not kms and hasher.hexdigest() != md5):
            part.unlink()  # SSE-KMS ETags are not an MD5: only the size is checked there
            raise _Corrupt(
                f"{obj.key}: got {size} bytes (md5 {hasher.hexdigest()}), "
                f"expected {obj.size} (ETag {obj.etag})"
            )
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, final)
        part.with_name(part.name + ".json").unlink(missing_ok=True)

    _retrying("download", f"s3://{bucket}/{obj.key}", attempt, opt)


@contextlib.contextmanager
def _locked(path: Path, url: str) -> Iterator[None]:
    """Hold the exclusive staging lock for one dataset; say so if another process has it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
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
        fd = os.open(inuse, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _IN_USE[str(inuse)] = fd


def _try_exclusive(paths: list[Path]) -> list[int] | None:
    """Non-blocking exclusive locks on all ``paths``, or None if any is held elsewhere."""
    fds: list[int] = []
    for path in paths:
        fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o666))
        try:
            fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            for fd in fds:
                os.close(fd)
            return None
    return fds


def _entry_name(url: str) -> str:
    """Readable and unique per (endpoint, url) cache entry name."""
    bucket, key = _split_url(url)
    digest = hashlib.sha256(f"{_endpoint()}|{bucket}/{key}".encode()).hexdigest()[:12]
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
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


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
            f"{url} needs {need} bytes, more than max_cache_bytes={max_bytes}",
            "raise data.remote_cache_max_bytes (max_cache_bytes) or stage a smaller dataset",
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
        log.warning("cache %s stays over max_cache_bytes: the other datasets are in use", cache)


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
    opt: _Options,
    on_done: Callable[[RemoteObject], None],
) -> None:
    """Download objects in parallel; ``on_done`` records each one as soon as it is in place."""
    need = sum(o.size for o in todo)
    if shutil.disk_usage(cache).free < need:
        raise RemoteStorageError(
            f"not enough free space in {cache} for {need} bytes of {url}",
            "free disk space, lower max_cache_bytes or move cache_dir",
        )
    log.info("staging %d object(s), %.1f MiB, from %s", len(todo), need / 2**20, url)
    meter = _Meter(url, need, opt.progress)

    def one(obj: RemoteObject) -> None:
        part = cache / ".partial" / name / f"{obj.rel}.part"
        _download(fs, url, obj, cache / name / obj.rel, part, opt, meter)
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


def _sync_entry(fs: Any, url: str, cache: Path, name: str, opt: _Options) -> tuple[str, list]:
    """List the remote, download what is missing or changed, forget what vanished.

    The manifest is rewritten after every finished object, so an interrupted staging of a
    large tree keeps the objects it completed.
    """
    manifest_path, root = cache / f"{name}.manifest.json", cache / name
    manifest = _read_json(manifest_path)
    kind, objects = _list_remote(fs, url, manifest.get("kind"), opt)
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
                    "endpoint": _endpoint(),
                    "kind": kind,
                    "last_used": time.time(),
                    "total_bytes": sum(o.size for o in objects),
                    "objects": known,
                },
            )

    if opt.max_cache_bytes is not None:
        _evict(cache, name, sum(o.size for o in objects), opt.max_cache_bytes, url)
    if todo:
        _download_all(fs, url, cache, name, todo, opt, record)
    partial = cache / ".partial" / name
    for folder in [*sorted(partial.rglob("*"), reverse=True), partial]:
        with contextlib.suppress(OSError):
            folder.rmdir()  # empty folders only: left-over partial files stay resumable
    for rel in set(known) - {o.rel for o in objects}:
        (root / rel).unlink(missing_ok=True)  # staged earlier, deleted remotely since
        del known[rel]
    record()
    return kind, objects


def stage(
    url: str,
    cache_dir: str | os.PathLike[str],
    *,
    max_cache_bytes: int | None = None,
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
    opt = _Options(retries, backoff_s, max_cache_bytes, progress)
    if _zlib_shadowed():
        _mark_in_use(cache / ".locks" / f"{name}.inuse")  # before the child: no eviction gap
        return _stage_in_child(url, cache, opt, timeout_s)
    with _locked(cache / ".locks" / f"{name}.lock", url):
        fs = _make_fs(timeout_s)
        for attempt in range(3):
            try:
                kind, objects = _sync_entry(fs, url, cache, name, opt)
                break
            except _RemoteChanged:
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


def _zlib_shadowed() -> bool:
    """True when CPython's zlib is bound to the copy of zlib inside libpaddle.so.

    paddlepaddle 2.6's libpaddle.so exports its own zlib symbols; a ``zlib`` extension module
    loaded after it binds to them, and aiohttp (under s3fs) then raises ``zlib.error:
    inconsistent stream state`` or dies in ``inflateReset2``. Importing this module before
    paddle avoids it (it imports zlib first). Otherwise only a real round trip tells, so it is
    tried in a forked child that may crash harmlessly; staging then runs in a clean process.
    """
    return "paddle" in sys.modules and not _zlib_works_in_a_fork()


@functools.lru_cache(maxsize=1)
def _zlib_works_in_a_fork() -> bool:
    """Round-trip zlib as aiohttp uses it, in a forked copy of this process."""
    pid = os.fork()
    if pid == 0:  # child: silence paddle's crash report, exercise zlib like aiohttp, leave
        ok = False
        with contextlib.suppress(BaseException):
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            for sig in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS):
                signal.signal(sig, signal.SIG_DFL)
            data = b"zlib probe " * 64
            ok = True
            for wbits in (15, -15, 31):
                packer = zlib.compressobj(wbits=wbits)
                packed = packer.compress(data) + packer.flush()
                unpacker = zlib.decompressobj(wbits=wbits)
                ok = ok and unpacker.decompress(packed) + unpacker.flush() == data
        os._exit(0 if ok else 1)
    return os.waitpid(pid, 0)[1] == 0


def _stage_in_child(url: str, cache: Path, opt: _Options, timeout_s: float) -> Path:
    """Run ``python -m datasets.remote stage`` in a child and return its path (or its error)."""
    log.info("paddle was imported before zlib here; staging %s in a child process", url)
    cmd = [sys.executable, "-m", "datasets.remote", "stage", url, "--cache-dir", str(cache)]
    cmd += ["--retries", str(opt.retries), "--backoff-s", str(opt.backoff_s)]
    cmd += ["--timeout-s", str(timeout_s), *([] if opt.progress else ["--quiet"])]
    if opt.max_cache_bytes is not None:
        cmd += ["--max-cache-bytes", str(opt.max_cache_bytes)]
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, check=False)
    for line in proc.stderr.splitlines():
        log.info("[child] %s", line)
    if proc.returncode != 0:
        errors = [ln[7:] for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
        last = errors[-1] if errors else f"staging child exited with {proc.returncode}"
        problem, _, hint = last.partition(". HINT: ")
        raise RemoteStorageError(problem, hint or "see the [child] log lines above")
    return Path(proc.stdout.strip().splitlines()[-1])


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
    size.add_argument("--max-cache-gb", type=float, help="evict LRU datasets above this size")
    size.add_argument("--max-cache-bytes", type=int, help="the same, in bytes")
    cmd.add_argument("--retries", type=int, default=5, help="retries on network errors")
    cmd.add_argument("--backoff-s", type=float, default=0.5, help="first retry delay, doubled")
    cmd.add_argument("--timeout-s", type=float, default=30.0, help="connect/read timeout")
    cmd.add_argument("-q", "--quiet", action="store_true", help="print only the path")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    max_bytes = args.max_cache_bytes
    if args.max_cache_gb is not None:
        max_bytes = int(args.max_cache_gb * 2**30)
    try:
        path = stage(
            args.url,
            args.cache_dir,
            max_cache_bytes=max_bytes,
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
