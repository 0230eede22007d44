"""datasets.remote against a real S3-compatible server (moto) on 127.0.0.1.

    python -m pytest tests/test_remote.py -q

Downloads are counted on the server side (bench/s3_server.py logs every request), so "no
re-download" and "exactly one download" are facts about HTTP traffic, not about our own logs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.s3_server import S3TestServer
from datasets.remote import RemoteStorageError, is_remote, release, stage
from tests import dev_tools

ROOT = Path(__file__).resolve().parent.parent
FAST = {"retries": 2, "backoff_s": 0.01, "timeout_s": 5.0}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3TestServer]:
    """One moto server per session, with IAM signature checks on."""
    dev_tools.require("moto")  # the server (bench/s3_server.py)
    dev_tools.require("s3fs", "requirements/remote.txt")  # what datasets.remote stages with
    server = S3TestServer().start()
    try:
        server.enable_auth()
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: S3TestServer, monkeypatch: pytest.MonkeyPatch) -> S3TestServer:
    """The server, with AWS_* pointing at it and nothing else (no profile, no config files)."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(var, raising=False)
    for var, value in s3_server.env().items():
        monkeypatch.setenv(var, value)
    s3_server.clear_requests()
    return s3_server


_BUCKETS = iter(range(10_000))


def _bucket(server: S3TestServer, objects: dict[str, bytes]) -> str:
    """A fresh bucket holding ``objects``; returns its name."""
    name = f"test-{os.getpid()}-{next(_BUCKETS)}"
    client = server.admin_client()
    client.create_bucket(Bucket=name)
    for key, body in objects.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    return name


def _gets(server: S3TestServer, key_path: str) -> list[dict]:
    return server.requests("GET", key_path)


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_is_remote() -> None:
    assert is_remote("s3://bucket/prefix") and is_remote("s3a://b/x.h5")
    assert not is_remote("/data/lmdb") and not is_remote(Path("s3/local"))


def test_cold_stage_lmdb_dir_is_byte_identical(s3: S3TestServer, tmp_path: Path) -> None:
    data = os.urandom(300_000)
    bucket = _bucket(s3, {"ocr/train/data.mdb": data, "ocr/train/lock.mdb": b"lock"})
    local = stage(f"s3://{bucket}/ocr/train", tmp_path / "cache", **FAST)
    assert local.is_dir()
    assert _files(local) == {"data.mdb": data}  # lock.mdb is never staged
    manifest = json.loads(next((tmp_path / "cache").glob("*.manifest.json")).read_text())
    entry = manifest["objects"]["data.mdb"]
    assert entry["size"] == len(data) and entry["etag"].strip('"') == hashlib.md5(data).hexdigest()
    assert entry["mtime"] and manifest["kind"] == "prefix"
    assert not list((tmp_path / "cache").rglob("*.part"))


def test_single_hdf5_object_becomes_a_file(s3: S3TestServer, tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    import numpy as np

    src = tmp_path / "images.h5"
    with h5py.File(src, "w") as f:
        f["images"] = np.arange(4 * 8 * 8 * 3, dtype=np.uint8).reshape(4, 8, 8, 3)
    bucket = _bucket(s3, {"resnet/images.h5": src.read_bytes()})
    local = stage(f"s3://{bucket}/resnet/images.h5", tmp_path / "cache", **FAST)
    assert local.is_file() and local.name == "images.h5"
    with h5py.File(local, "r") as f:
        assert f["images"].shape == (4, 8, 8, 3) and int(f["images"][3, 7, 7, 2]) == 767 % 256


def test_warm_cache_does_one_cheap_request(s3: S3TestServer, tmp_path: Path) -> None:
    bucket = _bucket(s3, {"ds/data.mdb": os.urandom(200_000), "one.h5": b"h5" * 1000})
    for url in (f"s3://{bucket}/ds", f"s3://{bucket}/one.h5"):
        first = stage(url, tmp_path, **FAST)
        stat = (first / "data.mdb" if first.is_dir() else first).stat()
        s3.clear_requests()
        assert stage(url, tmp_path, **FAST) == first
        log = s3.requests()
        assert len(log) == 1 and log[0]["method"] in ("GET", "HEAD"), log  # one LIST or HEAD
        again = (first / "data.mdb" if first.is_dir() else first).stat()
        assert (again.st_ino, again.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)


def _race(url: str, cache: str, barrier, results) -> None:
    """One racing 'rank': wait for the others, then stage the same URL."""
    barrier.wait()
    results.put(str(stage(url, cache, **FAST)))


def test_concurrent_stagers_download_once(s3: S3TestServer, tmp_path: Path) -> None:
    data = os.urandom(4_000_000)
    bucket = _bucket(s3, {"ds/data.mdb": data})
    url, n = f"s3://{bucket}/ds", 4
    ctx = multiprocessing.get_context("spawn")  # like torchrun ranks: fresh interpreters
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_race, args=(url, str(tmp_path), barrier, results)) for _ in range(n)
    ]
    for proc in procs:
        proc.start()
    paths = {results.get(timeout=60) for _ in range(n)}
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert len(paths) == 1 and (Path(paths.pop()) / "data.mdb").read_bytes() == data
    assert len(_gets(s3, f"/{bucket}/ds/data.mdb")) == 1  # exactly one download


def test_interrupted_download_resumes_with_range(s3: S3TestServer, tmp_path: Path) -> None:
    data = os.urandom(1_000_000)
    bucket = _bucket(s3, {"ds/data.mdb": data})
    s3.cut_next_get("/ds/data.mdb", after_bytes=300_000)
    local = stage(f"s3://{bucket}/ds", tmp_path, **FAST)
    assert (local / "data.mdb").read_bytes() == data
    gets = _gets(s3, f"/{bucket}/ds/data.mdb")
    assert [g["range"] for g in gets] == [None, "bytes=300000-"]


def test_resume_survives_a_failed_stage_call(s3: S3TestServer, tmp_path: Path) -> None:
    """A crashed or failed job leaves a partial file that the next job continues."""
    data = os.urandom(1_000_000)
    bucket = _bucket(s3, {"ds/data.mdb": data})
    url = f"s3://{bucket}/ds"
    s3.cut_next_get("/ds/data.mdb", after_bytes=400_000)
    with pytest.raises(RemoteStorageError, match="gave up on download"):
        stage(url, tmp_path, retries=0, backoff_s=0.01)
    assert not list(tmp_path.rglob("data.mdb"))  # never a partial file under the final name
    local = stage(url, tmp_path, **FAST)
    assert (local / "data.mdb").read_bytes() == data
    assert [g["range"] for g in _gets(s3, f"/{bucket}/ds/data.mdb")] == [None, "bytes=400000-"]


def test_partial_of_an_old_version_is_not_resumed(s3: S3TestServer, tmp_path: Path) -> None:
    bucket = _bucket(s3, {"ds/data.mdb": os.urandom(500_000)})
    url = f"s3://{bucket}/ds"
    s3.cut_next_get("/ds/data.mdb", after_bytes=200_000)
    with pytest.raises(RemoteStorageError):
        stage(url, tmp_path, retries=0, backoff_s=0.01)
    new = os.urandom(500_000)
    s3.admin_client().put_object(Bucket=bucket, Key="ds/data.mdb", Body=new)
    s3.clear_requests()
    assert (stage(url, tmp_path, **FAST) / "data.mdb").read_bytes() == new
    assert [g["range"] for g in _gets(s3, f"/{bucket}/ds/data.mdb")] == [None]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_server_fails_fast_and_clearly(
    s3: S3TestServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, "datasets"),
        pytest.raises(RemoteStorageError) as err,
    ):
        stage("s3://bucket/ds", tmp_path, retries=3, backoff_s=0.05, timeout_s=2.0)
    assert time.monotonic() - started < 10
    text = str(err.value)
    assert "s3://bucket/ds" in text and endpoint in text and "after 4 attempts" in text
    assert "AWS_ENDPOINT_URL" in err.value.hint and len(text.splitlines()) == 1
    assert len([r for r in caplog.records if "retry" in r.getMessage()]) == 3
    assert [p for p in tmp_path.rglob("*") if p.is_file() and ".locks" not in p.parts] == []


@pytest.mark.parametrize(
    ("variable", "value", "code"),
    [
        ("AWS_SECRET_ACCESS_KEY", "not-the-secret", "SignatureDoesNotMatch"),
        ("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000", "InvalidAccessKeyId"),
    ],
)
def test_wrong_credentials_are_named_and_not_retried(
    s3: S3TestServer, tmp_path: Path, monkeypatch, caplog, variable, value, code
) -> None:
    bucket = _bucket(s3, {"ds/data.mdb": b"x" * 1000, "x.h5": b"h5"})
    monkeypatch.setenv(variable, value)
    for url in (f"s3://{bucket}/ds", f"s3://{bucket}/x.h5"):
        s3.clear_requests()
        quiet = caplog.at_level(logging.WARNING, "datasets")
        with quiet, pytest.raises(RemoteStorageError, match=code) as err:
            stage(url, tmp_path, retries=5, backoff_s=1.0)
        assert "AWS_ACCESS_KEY_ID" in err.value.hint and "AWS_SECRET_ACCESS_KEY" in err.value.hint
        assert not [r for r in caplog.records if "retry" in r.getMessage()]
        assert len(s3.requests()) <= 2  # LIST (+ HEAD for a single object): no retries


def test_missing_bucket_and_missing_key(s3: S3TestServer, tmp_path: Path) -> None:
    with pytest.raises(RemoteStorageError, match="bucket does not exist"):
        stage("s3://no-such-bucket-here/ds", tmp_path, **FAST)
    bucket = _bucket(s3, {"other/data.mdb": b"x"})
    with pytest.raises(RemoteStorageError, match="nothing to stage"):
        stage(f"s3://{bucket}/missing", tmp_path, **FAST)


def test_object_changed_remotely_is_staged_again(s3: S3TestServer, tmp_path: Path) -> None:
    keep, old, new = os.urandom(100_000), os.urandom(100_000), os.urandom(120_000)
    bucket = _bucket(s3, {"tree/a/data.mdb": keep, "tree/b/data.mdb": old})
    url = f"s3://{bucket}/tree"
    local = stage(url, tmp_path, **FAST)
    assert (local / "b/data.mdb").read_bytes() == old
    s3.admin_client().put_object(Bucket=bucket, Key="tree/b/data.mdb", Body=new)
    s3.admin_client().delete_object(Bucket=bucket, Key="tree/a/data.mdb")
    s3.admin_client().put_object(Bucket=bucket, Key="tree/c/data.mdb", Body=keep)
    s3.clear_requests()
    assert stage(url, tmp_path, **FAST) == local
    assert _files(local) == {"b/data.mdb": new, "c/data.mdb": keep}
    assert len(s3.requests("GET", "/data.mdb")) == 2  # only the changed and the new object


def test_lmdb_tree_prefix_keeps_its_layout(s3: S3TestServer, tmp_path: Path) -> None:
    objects = {f"root/{part}/data.mdb": os.urandom(50_000) for part in ("a", "b", "c/d")}
    objects["root/a/lock.mdb"] = b"lock"
    bucket = _bucket(s3, objects)
    local = stage(f"s3://{bucket}/root/", tmp_path, **FAST)
    assert _files(local) == {k[len("root/") :]: v for k, v in objects.items() if "lock" not in k}


def test_real_lmdb_opens_after_staging(s3: S3TestServer, tmp_path: Path) -> None:
    lmdb = pytest.importorskip("lmdb")
    src = tmp_path / "src"
    env = lmdb.open(str(src), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i in range(500):
            txn.put(f"image-{i:09d}".encode(), os.urandom(256))
        txn.put(b"num-samples", b"500")
    env.close()
    bucket = _bucket(s3, {f"ocr/{p.name}": p.read_bytes() for p in src.iterdir()})
    local = stage(f"s3://{bucket}/ocr", tmp_path / "cache", **FAST)
    staged = lmdb.open(str(local), readonly=True, lock=False)
    with staged.begin() as txn:
        assert txn.get(b"num-samples") == b"500" and txn.stat()["entries"] == 501
    staged.close()


def _sized(s3: S3TestServer, bucket: str, name: str, size: int) -> str:
    s3.admin_client().put_object(Bucket=bucket, Key=f"{name}/data.mdb", Body=os.urandom(size))
    return f"s3://{bucket}/{name}"


def test_eviction_is_lru_and_spares_datasets_in_use(
    s3: S3TestServer, tmp_path: Path, caplog
) -> None:
    bucket, size = _bucket(s3, {}), 100_000
    a, b, c, d = (_sized(s3, bucket, n, size) for n in "abcd")
    budget = {"cache_max_bytes": int(2.5 * size), **FAST}
    paths = {url: stage(url, tmp_path, **budget) for url in (a, b)}
    release(b, tmp_path)
    with caplog.at_level(logging.INFO, "datasets.remote"):
        paths[c] = stage(c, tmp_path, **budget)  # a is older but in use: b goes
    assert paths[a].exists() and not paths[b].exists() and paths[c].exists()
    assert any("evicted" in r.getMessage() and b in r.getMessage() for r in caplog.records)
    assert any("not evicting" in r.getMessage() and a in r.getMessage() for r in caplog.records)
    for url in (a, c):
        release(url, tmp_path)
    stage(a, tmp_path, **budget)  # a becomes the most recently used
    release(a, tmp_path)
    stage(d, tmp_path, **budget)  # so c, the least recently used, goes
    assert paths[a].exists() and not paths[c].exists()
    with pytest.raises(RemoteStorageError, match="cache_max_bytes"):
        stage(a, tmp_path, **{**budget, "cache_max_bytes": size // 2})


def test_cli_stage_prints_the_local_path(s3: S3TestServer, tmp_path: Path) -> None:
    bucket = _bucket(s3, {"ds/data.mdb": b"cli" * 1000})
    cmd = [sys.executable, "-m", "datasets.remote", "stage", f"s3://{bucket}/ds"]
    out = subprocess.run(
        [*cmd, "--cache-dir", str(tmp_path), "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert (Path(out.stdout.strip()) / "data.mdb").read_bytes() == b"cli" * 1000
    helped = subprocess.run([*cmd[:4], "--help"], cwd=ROOT, capture_output=True, text=True)
    assert helped.returncode == 0 and "--cache-dir" in helped.stdout


@pytest.mark.paddle
def test_training_on_s3_data_stages_it_before_paddle_is_imported(
    s3: S3TestServer, tmp_path: Path, ocr_lmdb: Path
) -> None:
    """python -m train stages s3:// data (the LMDB and the character list) before the backend
    imports its framework: Paddle's bundled zlib would break the S3 client in that process."""
    objects = {f"ocr/train/{p.name}": p.read_bytes() for p in ocr_lmdb.iterdir() if p.is_file()}
    objects["ocr/charset.txt"] = (ocr_lmdb.parent / "charset.txt").read_bytes()
    bucket = _bucket(s3, objects)
    sets = [
        "framework=paddle",
        f"data.train=s3://{bucket}/ocr/train",
        "data.val=null",
        f"data.char_dict=s3://{bucket}/ocr/charset.txt",
        f"data.remote_cache_dir={tmp_path / 'cache'}",
        "loader.num_workers=0",
        "loader.batch_size=8",
        "optim.warmup_steps=0",
        "train.max_steps=2",
        "train.log_every=1",
        "train.checkpoint_every=2",
    ]
    cmd = [sys.executable, "-m", "train", "--config", "configs/ocr/smoke.yaml"]
    cmd += ["--output-dir", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    staged = [i for i, line in enumerate(lines) if "ready at" in line and "s3://" in line]
    started = [i for i, line in enumerate(lines) if " ocr paddle on cpu" in line]
    assert len(staged) == 2 and started and max(staged) < started[0], out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2


def test_profile_and_endpoint_from_aws_config_files(
    s3: S3TestServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No AWS_* credentials or endpoint in the environment: AWS_PROFILE and the files suffice."""
    bucket = _bucket(s3, {"ds/data.mdb": b"profile" * 100})
    config, credentials = tmp_path / "config", tmp_path / "credentials"
    config.write_text(f"[profile stager]\nregion = us-east-1\nendpoint_url = {s3.endpoint}\n")
    credentials.write_text(
        f"[stager]\naws_access_key_id = {s3.key_id}\naws_secret_access_key = {s3.secret}\n"
    )
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "stager")
    local = stage(f"s3://{bucket}/ds", tmp_path / "cache", **FAST)
    assert (local / "data.mdb").read_bytes() == b"profile" * 100
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(RemoteStorageError, match="AWS_PROFILE"):
        stage(f"s3://{bucket}/ds", tmp_path / "cache2", **FAST)


def test_unsafe_object_keys_are_refused(s3: S3TestServer, tmp_path: Path) -> None:
    """A key whose path has a '..' (or an empty or '.' part) could write outside the cache."""
    bucket = _bucket(s3, {"tree/a/data.mdb": b"x", "tree/a/../../escape": b"y"})
    with pytest.raises(RemoteStorageError, match="unsafe object key"):
        stage(f"s3://{bucket}/tree", tmp_path / "cache", **FAST)
    assert not (tmp_path / "escape").exists()


def test_manifest_names_outside_the_dataset_are_never_removed(
    s3: S3TestServer, tmp_path: Path
) -> None:
    """The manifest is a file in the cache: a name in it that leads out of the dataset's folder
    (edited by hand or by another user) is dropped from it without removing that file."""
    bucket = _bucket(s3, {"tree/a/data.mdb": b"x" * 1000})
    url = f"s3://{bucket}/tree"
    cache = tmp_path / "cache"
    local = stage(url, cache, **FAST)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (manifest_path,) = cache.glob("*.manifest.json")
    manifest = json.loads(manifest_path.read_text())
    escape = os.path.relpath(victim, local)
    manifest["objects"][escape] = dict(manifest["objects"]["a/data.mdb"])
    manifest_path.write_text(json.dumps(manifest))

    assert stage(url, cache, **FAST) == local
    assert victim.read_text() == "keep me"
    assert escape not in json.loads(manifest_path.read_text())["objects"]
