"""The command line of a framework's multi-process launcher, built in one place for whatever
starts ranks (the GPU check, the tests): torchrun (``python -m torch.distributed.run``) for
torch, ``python -m paddle.distributed.launch`` for Paddle. The two spell their options
differently (``--nproc-per-node`` and ``--nproc_per_node``) and take different ones; an option a
framework's launcher has no equivalent for is a ValueError, not silently dropped.

Standard library only, and no framework import: it runs in processes that have neither.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

LAUNCHERS = {"torch": "torch.distributed.run", "paddle": "paddle.distributed.launch"}


def launch_command(
    framework: str,
    python: str | os.PathLike,
    nproc_per_node: int,
    args: Sequence[str | os.PathLike],
    *,
    master: str | None = None,
    nnodes: int | None = None,
    node_rank: int | None = None,
    rdzv_id: str | None = None,
    rdzv_conf: str | None = None,
    log_dir: str | os.PathLike | None = None,
    devices: str | None = None,
) -> list[str]:
    """``python -m LAUNCHER OPTIONS ARGS`` for ``framework``.

    ``args``: what each rank runs and its arguments: a script path, or for torchrun ``-m
    MODULE`` (Paddle's launcher runs a script file only: ``train/__main__.py``).
    ``master``: ``HOST:PORT``: torchrun's static rendezvous (``--master-addr``,
    ``--master-port``), or with ``rdzv_id`` its c10d rendezvous endpoint (``--rdzv-backend c10d
    --rdzv-endpoint``, plus ``--rdzv-conf`` when given); Paddle's ``--master``.
    ``nnodes``, ``node_rank``: torchrun's ``--nnodes``/``--node-rank``, Paddle's
    ``--nnodes``/``--rank``. ``log_dir``, ``devices`` (Paddle only): ``--log_dir`` (the launcher
    writes its workers' logs there and cannot start without a writable one) and ``--devices``.
    """
    if framework not in LAUNCHERS:
        raise ValueError(f"no launcher for framework {framework!r}: one of {sorted(LAUNCHERS)}")
    given = {"rdzv_id": rdzv_id, "rdzv_conf": rdzv_conf, "log_dir": log_dir, "devices": devices}
    only = ("rdzv_id", "rdzv_conf") if framework == "paddle" else ("log_dir", "devices")
    refused = [name for name in only if given[name] is not None]
    if refused or (rdzv_conf is not None and rdzv_id is None):
        refused = refused or ["rdzv_conf without rdzv_id"]
        raise ValueError(f"the {framework} launcher takes no {', '.join(refused)}")
    cmd = [str(python), "-m", LAUNCHERS[framework]]
    torch = framework == "torch"
    if nnodes is not None:
        cmd += ["--nnodes", str(nnodes)]
    if node_rank is not None:
        cmd += ["--node-rank" if torch else "--rank", str(node_rank)]
    cmd += ["--nproc-per-node" if torch else "--nproc_per_node", str(nproc_per_node)]
    if master is not None and not torch:
        cmd += ["--master", master]
    elif master is not None and rdzv_id is not None:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", master, "--rdzv-id", rdzv_id]
        cmd += ["--rdzv-conf", rdzv_conf] if rdzv_conf is not None else []
    elif master is not None:
        host, _, port = master.rpartition(":")
        cmd += ["--master-addr", host, "--master-port", port]
    elif rdzv_id is not None:
        raise ValueError("rdzv_id needs master: the c10d rendezvous endpoint, HOST:PORT")
    if log_dir is not None:
        cmd += ["--log_dir", str(log_dir)]
    if devices is not None:
        cmd += ["--devices", devices]
    return [*cmd, *map(str, args)]
