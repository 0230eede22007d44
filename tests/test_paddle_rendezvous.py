"""Paddle's start-up rendezvous: train.dist_timeout_s reaches the process group
(PADDLE_PG_TIMEOUT, tests/test_gpu_paths.py), but Paddle 2.6 makes its TCPStore with a fixed
900 s timeout that nothing can set. The backend says so in the log when the configured timeout
is longer, and the installed Paddle is checked to still behave that way."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import pytest

from tests.backends import make_config
from tests.test_gpu_paths import launcher_env

pytestmark = pytest.mark.paddle


@pytest.mark.parametrize("timeout_s, said", [(5400, True), (600, False)])
def test_a_timeout_longer_than_the_rendezvous_says_the_rendezvous_keeps_900_s(
    timeout_s, said, ocr_lmdb, monkeypatch, caplog
):
    from train.backends.paddle import backend as paddle_backend
    from train.backends.paddle import runtime as paddle_runtime

    started = []
    monkeypatch.setattr(paddle_runtime.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(paddle_runtime.dist, "init_parallel_env", lambda: started.append(1))
    monkeypatch.setattr(paddle_runtime.paddle, "set_device", lambda device: None)
    launcher_env(monkeypatch, "paddle")
    train = {"device": "cpu", "dist_timeout_s": timeout_s}
    config = make_config("paddle", "ocr", ocr_lmdb, train=train)
    with caplog.at_level(logging.INFO, logger=paddle_runtime.log.name):
        paddle_backend.PaddleBackend(config.task, config.train).runtime.init_distributed()
    assert started == [1]
    lines = [r.getMessage() for r in caplog.records if "rendezvous" in r.getMessage()]
    if said:
        assert len(lines) == 1
        assert f"train.dist_timeout_s={timeout_s} s" in lines[0]
        assert "at most 900 s" in lines[0]
    else:
        assert lines == []


def test_the_installed_paddle_still_fixes_the_rendezvous_timeout_at_900_s():
    """What the backend's log line and comment rest on: init_parallel_env creates the store
    without a timeout, and TCPStore's default is 900 s. A Paddle that changes either needs
    train.dist_timeout_s wired to it instead."""
    import paddle
    from paddle.distributed import parallel

    from train.backends.paddle.runtime import STORE_TIMEOUT_S

    source = inspect.getsource(parallel.init_parallel_env)
    assert "core.create_or_get_global_tcp_store()" in source
    header = Path(paddle.__file__).parent / "include/paddle/phi/core/distributed/store/tcp_store.h"
    if not header.is_file():
        pytest.skip(f"this Paddle install has no C++ headers ({header})")
    assert f"int timeout = {STORE_TIMEOUT_S});" in header.read_text()
