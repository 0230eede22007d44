"""S3 access for :mod:`datasets.remote`: listing, and verified, resumable downloads.

One client per process and AWS environment (:func:`make_fs`). Every request goes through one
retry policy, with bounded exponential backoff on transient errors only. Failures are turned
into a :class:`RemoteStorageError` that names the URL, the endpoint and the fix. A download
resumes a partial file while the remote ETag is unchanged, and is checked against the size and
the MD5 ETag before it is renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from datasets.errors import DatasetError
from datasets.safe_files import open_append, open_new, write_atomic

log = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK = 1 << 20
# A listing is bounded like every other remote answer: a dataset here is an LMDB directory, a
# tree of them or one HDF5 file, a few objects to a few thousand, so a listing that runs past
# these (S3 pages hold at most 1000 keys) is a server that does not stop, not a dataset.
MAX_LIST_PAGES = 10_000
MAX_LISTED_OBJECTS = 1_000_000
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


class RemoteStorageError(DatasetError):
    """A remote dataset could not be staged: ``problem. HINT: hint`` on one line.

    A DatasetError, so the scripts and the trainer report it like any unusable dataset.
    """

    def __init__(self, problem: str, hint: str) -> None:
        super().__init__(problem, hint)


class RemoteChanged(Exception):
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
class TransferOptions:
    """How hard to try (here) and how much to keep (the cache in datasets.remote)."""

    retries: int
    backoff_s: float
    cache_max_bytes: int | None
    progress: bool


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> (``bucket``, ``a/b``)."""
    bucket, _, key = url.split("://", 1)[1].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url!r}; expected s3://bucket/prefix")
    return bucket, key.strip("/")


def endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def endpoint_label() -> str:
    return endpoint() or "the endpoint from the AWS config or AWS itself (AWS_ENDPOINT_URL unset)"


def make_fs(timeout_s: float) -> Any:
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
        endpoint_url=endpoint(),
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


def drop_clients() -> None:
    """Forget this process's clients: the next :func:`make_fs` builds one, as a new process does."""
    _FS_CACHE.clear()


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


def _translate(exc: BaseException, url: str) -> RemoteStorageError | RemoteChanged | None:
    """Map a non-transient failure to a clear error; None means "transient, retry"."""
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError, ProfileNotFound

    code, where = _error_code(exc), f"{url} at {endpoint_label()}"
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
        return RemoteChanged(str(exc))
    if code in _TRANSIENT_CODES or _is_transient(exc):
        return None
    return RemoteStorageError(
        f"S3 error {code or type(exc).__name__} for {where}: {exc}",
        "see the message above; rerun with logging at DEBUG for details",
    )


def _retrying(what: str, url: str, fn: Callable[[], T], opt: TransferOptions) -> T:
    """Run ``fn`` with bounded exponential backoff; only transient errors are retried."""
    retries = opt.retries
    for attempt in range(retries + 1):
        try:
            return fn()
        except (RemoteStorageError, RemoteChanged):
            raise
        except Exception as exc:
            clear = _translate(exc, url)
            if clear is not None:
                raise clear from exc
            if attempt == retries:
                raise RemoteStorageError(
                    f"gave up on {what} {url} after {attempt + 1} attempts against "
                    f"{endpoint_label()}: {type(exc).__name__}: {exc}",
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


def list_remote(fs: Any, url: str, kind_hint: str | None, opt: TransferOptions) -> tuple[str, list]:
    """Return ("prefix"|"object", objects); one request when the manifest knows the kind."""
    bucket, key = split_url(url)
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
        f"{endpoint_label()}",
        "check the dataset path and AWS_ENDPOINT_URL",
    )


def _head(fs: Any, url: str, bucket: str, key: str, opt: TransferOptions) -> RemoteObject | None:
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


def _list_prefix(
    fs: Any, url: str, bucket: str, key: str, opt: TransferOptions
) -> list[RemoteObject]:
    """All objects below ``key/`` except lock.mdb and folder markers, paginated.

    Every page must make progress: a continuation token seen before, or a page whose first key
    does not come after the previous page's last (S3 lists keys in ascending order), is a
    server going round in circles; it and a listing past MAX_LIST_PAGES pages or
    MAX_LISTED_OBJECTS keys are errors that name the bucket and prefix."""
    prefix, token, objects = f"{key}/" if key else "", None, []
    tokens: set[str] = set()
    listed, last_key = 0, None

    def endless(problem: str) -> RemoteStorageError:
        return RemoteStorageError(
            f"listing s3://{bucket}/{prefix} at {endpoint_label()} {problem}",
            "the server is not S3-compatible in its listings, or the prefix names far more "
            "than a dataset: check AWS_ENDPOINT_URL and the dataset path",
        )

    for _ in range(MAX_LIST_PAGES):
        kw = {"Bucket": bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
        page = _retrying("LIST", url, lambda kw=kw: fs.call_s3("list_objects_v2", **kw), opt)
        contents = page.get("Contents", [])
        listed += len(contents)
        if listed > MAX_LISTED_OBJECTS:
            raise endless(f"goes past {MAX_LISTED_OBJECTS} objects")
        if contents and last_key is not None and contents[0]["Key"] <= last_key:
            raise endless(
                f"makes no progress: a page starts at {contents[0]['Key']!r}, not after the "
                f"previous page's last key {last_key!r}"
            )
        last_key = contents[-1]["Key"] if contents else last_key
        for item in contents:
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
        if token in tokens:
            raise endless(f"makes no progress: continuation token {token[:40]!r} came twice")
        tokens.add(token)
    raise endless(f"goes past {MAX_LIST_PAGES} pages")


class Meter:
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
                    for block in iter(lambda: f.read(8 * CHUNK), b""):
                        hasher.update(block)
            return size, hasher
    part.parent.mkdir(parents=True, exist_ok=True)
    os.close(open_new(part))  # a link planted at the name is refused, never followed
    write_atomic(sidecar, json.dumps({"etag": obj.etag, "size": obj.size}))
    return 0, hasher


async def _stream_get(
    fs: Any, bucket: str, obj: RemoteObject, offset: int, part: Path, hasher: Any, meter: Meter
) -> str | None:
    """GET the object from ``offset`` (If-Match its ETag) and append it to ``part``.

    Never more than the listed size: each read asks for at most one byte past what is left, so
    a server that sends more (whatever its Content-Length says) is stopped after one byte too
    many, with ``part`` no larger than the object, and the staging fails (not retried: the
    same server would answer the same)."""
    kw = {"IfMatch": obj.etag, **({"Range": f"bytes={offset}-"} if offset else {})}
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=obj.key, **kw)
    body = resp["Body"]
    left = obj.size - offset
    try:
        with os.fdopen(open_append(part), "ab") as out:
            while chunk := await body.read(min(CHUNK, left + 1)):
                if len(chunk) > left:
                    break
                out.write(chunk)
                hasher.update(chunk)
                meter.add(len(chunk))
                left -= len(chunk)
    finally:
        body.close()
    if chunk:
        part.unlink(missing_ok=True)
        part.with_name(part.name + ".json").unlink(missing_ok=True)
        raise RemoteStorageError(
            f"s3://{bucket}/{obj.key} at {endpoint_label()}: the server sent more than the "
            f"{obj.size} bytes its listing gave; stopped there, the partial download removed",
            "the server is not S3-compatible, or the object is being rewritten: check "
            "AWS_ENDPOINT_URL, and stage again once any upload has finished",
        )
    return resp.get("ServerSideEncryption")


def download(
    fs: Any,
    url: str,
    obj: RemoteObject,
    final: Path,
    part: Path,
    opt: TransferOptions,
    meter: Meter,
) -> None:
    """Download one object resumably, verify size and MD5-ETag, rename it to ``final``."""
    from fsspec.asyn import sync

    bucket, _ = split_url(url)

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
