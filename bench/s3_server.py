"""A real S3-compatible server on loopback for the remote-storage tests and benchmark.

    python bench/s3_server.py           # prints "PORT <n>", then serves on 127.0.0.1:<n>

It is moto's standalone server app (the one ``moto_server`` runs) in its own process, so the
server never competes with the client for the GIL, and wrapped in a small WSGI middleware that

- records every S3 request (method, path, Range header) so tests can count downloads,
- cuts the next matching GET response short on demand, to test resumed downloads.

The middleware answers ``/_test/requests`` (GET: the log, POST: clear it) and ``/_test/cut``.
IAM authentication is switched on by :meth:`S3TestServer.enable_auth` (moto checks signatures
only then), so wrong credentials fail as they do against AWS. Only 127.0.0.1 is ever used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
_ALLOW_ALL = json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
)


class _Recorder:
    """WSGI middleware around moto: request log plus one-shot response truncation."""

    def __init__(self, app: Callable) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.log: list[dict[str, Any]] = []
        self.cuts: list[dict[str, Any]] = []

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
        if path.startswith("/_test/"):
            return self._control(path, method, environ, start_response)
        entry = {"method": method, "path": path, "range": environ.get("HTTP_RANGE")}
        with self.lock:
            self.log.append(entry)
            cut = next((c for c in self.cuts if method == "GET" and c["path"] in path), None)
            if cut:
                self.cuts.remove(cut)
        body = self.app(environ, start_response)
        return self._truncated(body, cut["after"]) if cut else body

    @staticmethod
    def _truncated(body: Iterable[bytes], after: int) -> Iterator[bytes]:
        """Send ``after`` bytes, then fail: werkzeug drops the connection mid-body."""
        sent = 0
        for chunk in body:
            if sent + len(chunk) >= after:
                yield chunk[: after - sent]
                raise ConnectionAbortedError("test server: response cut on purpose")
            sent += len(chunk)
            yield chunk

    def _control(self, path: str, method: str, environ: dict, start_response: Callable) -> list:
        with self.lock:
            if path == "/_test/requests" and method == "POST":
                self.log.clear()
            elif path == "/_test/cut":
                size = int(environ.get("CONTENT_LENGTH") or 0)
                self.cuts.append(json.loads(environ["wsgi.input"].read(size)))
            payload = json.dumps(self.log).encode()
        start_response("200 OK", [("Content-Type", "application/json")])
        return [payload]


def serve(port: int = 0) -> None:
    """Run moto's app behind the recorder on 127.0.0.1 and announce the port on stdout."""
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class QuietHandler(MotoRequestHandler):
        def log_request(self, *args: Any, **kwargs: Any) -> None:
            pass

    app = _Recorder(DomainDispatcherApplication(create_backend_app))
    server = make_server(HOST, port, app, threaded=True, request_handler=QuietHandler)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


def _exit_with_parent(parent: int) -> None:
    """Never outlive the test run that started us, even if it was killed."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


class S3TestServer:
    """Client-side handle: starts :func:`serve` in a subprocess and talks to it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.key_id, self.secret = "testing", "testing"

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> S3TestServer:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        timer = threading.Timer(timeout_s, self.proc.kill)
        timer.start()
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        timer.cancel()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"moto test server did not start (got {line!r})")
        self.port = int(line.split()[1])
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def _post(self, path: str, data: bytes = b"") -> bytes:
        req = urllib.request.Request(
            f"{self.endpoint}{path}", data=data, headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read()

    def requests(self, method: str | None = None, contains: str = "") -> list[dict[str, Any]]:
        """Requests seen since the last :meth:`clear_requests`, optionally filtered."""
        with urllib.request.urlopen(f"{self.endpoint}/_test/requests", timeout=10) as resp:
            log = json.loads(resp.read())
        return [r for r in log if (method in (None, r["method"])) and contains in r["path"]]

    def clear_requests(self) -> None:
        self._post("/_test/requests", b"clear")

    def cut_next_get(self, contains: str, after_bytes: int) -> None:
        """Make the next GET whose path contains ``contains`` drop after ``after_bytes``."""
        self._post("/_test/cut", json.dumps({"path": contains, "after": after_bytes}).encode())

    def admin_client(self, service: str = "s3") -> Any:
        """A boto3 client with the valid test credentials (for arranging fixtures)."""
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.key_id,
            aws_secret_access_key=self.secret,
        )

    def enable_auth(self) -> None:
        """Create an IAM user allowed everything, then make moto check every signature."""
        iam = self.admin_client("iam")
        iam.create_user(UserName="stager")
        iam.put_user_policy(UserName="stager", PolicyName="all", PolicyDocument=_ALLOW_ALL)
        key = iam.create_access_key(UserName="stager")["AccessKey"]
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        self._post("/moto-api/reset-auth", b"0")

    def env(self) -> dict[str, str]:
        """Environment that points AWS SDKs (and so datasets.remote) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
            "NO_PROXY": HOST,
            "no_proxy": HOST,
        }


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
