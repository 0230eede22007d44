"""The ``_probe`` helper (run by a framework's interpreter): the framework build and a few ops on
the device, each on its own so that the first failing one names the library (elementwise, matmul:
cuBLAS, conv2d: cuDNN, LSTM and CTC loss: what the CRNN uses), then a real training step:
conv, BatchNorm in training mode, a linear head, the backward pass and an Adam step (the kernels
a build can lack while its forward ops run: cuDNN's backward convolutions, BatchNorm's backward,
the fused optimizer update).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys

from .util import emit, short_error


def helper_probe(args: argparse.Namespace) -> int:
    """The framework build and a few ops on the device: elementwise, matmul (cuBLAS), conv2d
    (cuDNN), LSTM and CTC loss (what the CRNN uses). One JSON line."""
    facts: dict = {"framework": args.framework, "device": args.device}
    ops: dict[str, str] = {}
    try:
        if args.framework == "torch":
            ops = _probe_torch(facts, args.device)
        else:
            ops = _probe_paddle(facts, args.device)
    except BaseException as error:  # noqa: BLE001  (report, whatever it is)
        facts.update(ok=False, error=short_error(error), ops=ops)
        emit(facts)
        return 0
    bad = {name: result for name, result in ops.items() if result != "ok"}
    facts.update(ok=not bad, ops=ops)
    if bad:
        facts["error"] = "; ".join(f"{name}: {result}" for name, result in bad.items())
    emit(facts)
    return 0


def _probe_torch(facts: dict, device_kind: str) -> dict[str, str]:
    """torch's build into ``facts``; its ops' results on ``device_kind`` (gpu or cpu)."""
    import numpy
    import torch

    facts.update(
        version=torch.__version__,
        cuda=torch.version.cuda,
        compiled_with_cuda=torch.version.cuda is not None,
        cudnn_runtime=torch.backends.cudnn.version(),
        python=sys.version.split()[0],
        numpy=numpy.__version__,
        imports=_project_imports(),
    )
    missing = [name for name, origin in facts["imports"].items() if origin is None]
    if missing:
        facts["missing_imports"] = missing
        raise ImportError(f"the project's data layer needs {', '.join(missing)}")
    if device_kind == "gpu":
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        device = torch.device("cuda", 0)
        facts.update(
            device_name=torch.cuda.get_device_name(0),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            arch_list=torch.cuda.get_arch_list(),
        )
    else:
        device = torch.device("cpu")
    return _torch_ops(torch, device)


def _probe_paddle(facts: dict, device_kind: str) -> dict[str, str]:
    """Paddle's build into ``facts``; its ops' results on ``device_kind`` (gpu or cpu)."""
    try:
        import paddle
    except ImportError as error:
        facts["import_error"] = short_error(error)
        raise
    compiled = bool(paddle.is_compiled_with_cuda())
    facts.update(
        version=paddle.__version__,
        compiled_with_cuda=compiled,
        cuda=paddle.version.cuda() if compiled else None,
        cudnn=paddle.version.cudnn() if compiled else None,
    )
    if device_kind == "gpu":
        if not compiled:
            raise RuntimeError("this is Paddle's CPU build")
        count = paddle.device.cuda.device_count()
        if count == 0:
            raise RuntimeError("Paddle sees no GPU (paddle.device.cuda.device_count() == 0)")
        paddle.set_device("gpu:0")
        capability = tuple(paddle.device.cuda.get_device_capability(0))
        facts.update(
            device_name=paddle.device.cuda.get_device_name(0),
            capability=".".join(map(str, capability)),
            cudnn_runtime=paddle.get_cudnn_version(),
            arch_problem=paddle_arch_problem(facts["version"], facts["cuda"], capability),
        )
        if facts["arch_problem"] and facts["arch_problem"]["fatal"]:
            # A CUDA 11.x build on Hopper passes small ops and aborts later in training: no
            # op is run, the build is refused by its facts.
            raise RuntimeError(facts["arch_problem"]["reason"])
    else:
        paddle.set_device("cpu")
    return _paddle_ops(paddle)


def paddle_arch_problem(version: str, cuda: str | None, capability: tuple) -> dict | None:
    """The doctor's verdict on this Paddle build for a GPU of ``capability``: None, or its
    reason, fix and whether it is fatal."""
    from train.doctor_gpu import arch_problem
    from train.gpu_probe import FrameworkCuda

    build = FrameworkCuda("paddle", version=version, cuda=cuda, compiled=cuda is not None)
    problem = arch_problem(build, (int(capability[0]), int(capability[1])))
    return None if problem is None else problem._asdict()


# What the data layer imports beside the framework: a preinstalled GPU host has the first four,
# the wheelhouse brings the rest (requirements/gpu-wheelhouse.txt).
PROJECT_IMPORTS = ("cv2", "h5py", "PIL", "yaml", "lmdb", "simplejpeg", "isal")


def _project_imports() -> dict[str, str | None]:
    """Where each of PROJECT_IMPORTS is imported from; None for one that does not import."""
    found: dict[str, str | None] = {}
    for name in PROJECT_IMPORTS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            found[name] = None
        else:
            found[name] = str(getattr(module, "__file__", None) or name)
    return found


def _run_ops(ops) -> dict[str, str]:
    results = {}
    for name, op in ops:
        try:
            op()
            results[name] = "ok"
        except Exception as error:  # each op on its own: the first failure names the library
            results[name] = short_error(error)
    return results


def _torch_ops(torch, device) -> dict[str, str]:
    import torch.nn.functional as F

    def elementwise():
        value = float((torch.arange(4.0, device=device) * 2).sum())  # float() waits
        assert value == 12.0, value

    def matmul():
        a = torch.randn(64, 64, device=device)
        float((a @ a).sum())

    def conv2d():
        conv = torch.nn.Conv2d(3, 8, 3).to(device)
        float(conv(torch.randn(2, 3, 16, 16, device=device)).sum())

    def lstm():
        net = torch.nn.LSTM(8, 8, bidirectional=True).to(device)
        float(net(torch.randn(5, 2, 8, device=device))[0].sum())

    def ctc():
        log_probs = torch.randn(10, 2, 5, device=device).log_softmax(2)
        targets = torch.tensor([[1, 2], [3, 4]], device=device)
        lengths = torch.full((2,), 10, dtype=torch.long, device=device)
        float(F.ctc_loss(log_probs, targets, lengths, torch.tensor([2, 2], device=device)))

    def train_step():
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 4),
        ).to(device)
        net.train()
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
        images = torch.randn(8, 3, 16, 16, device=device)
        labels = torch.randint(0, 4, (8,), device=device)
        before = net[0].weight.detach().clone()
        losses = []
        for _ in range(2):
            loss = F.cross_entropy(net(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
        assert all(math.isfinite(x) for x in losses), losses
        assert bool((net[0].weight != before).any()), "Adam did not change the weights"
        assert float(net[1].running_mean.abs().sum()) > 0, "BatchNorm's running mean did not move"

    return _run_ops(
        [
            ("elementwise", elementwise),
            ("matmul", matmul),
            ("conv2d", conv2d),
            ("lstm", lstm),
            ("ctc_loss", ctc),
            ("train_step", train_step),
        ]
    )


def _paddle_ops(paddle) -> dict[str, str]:
    import paddle.nn.functional as F

    def elementwise():
        value = float((paddle.arange(4, dtype="float32") * 2).sum())
        assert value == 12.0, value

    def matmul():
        a = paddle.randn([64, 64])
        float(paddle.matmul(a, a).sum())

    def conv2d():
        conv = paddle.nn.Conv2D(3, 8, 3)
        float(conv(paddle.randn([2, 3, 16, 16])).sum())

    def lstm():
        net = paddle.nn.LSTM(8, 8, direction="bidirect")
        float(net(paddle.randn([2, 5, 8]))[0].sum())

    def ctc():
        logits = paddle.randn([10, 2, 5])
        labels = paddle.to_tensor([[1, 2], [3, 4]], dtype="int32")
        loss = F.ctc_loss(
            logits,
            labels,
            paddle.full([2], 10, dtype="int64"),
            paddle.full([2], 2, dtype="int64"),
            blank=0,
            reduction="mean",
        )
        float(loss)

    def train_step():
        paddle.seed(0)
        net = paddle.nn.Sequential(
            paddle.nn.Conv2D(3, 8, 3, padding=1),
            paddle.nn.BatchNorm2D(8),
            paddle.nn.ReLU(),
            paddle.nn.AdaptiveAvgPool2D(1),
            paddle.nn.Flatten(),
            paddle.nn.Linear(8, 4),
        )
        net.train()
        optimizer = paddle.optimizer.Adam(learning_rate=1e-2, parameters=net.parameters())
        images, labels = paddle.randn([8, 3, 16, 16]), paddle.randint(0, 4, [8])
        before = net[0].weight.numpy().copy()
        losses = []
        for _ in range(2):
            loss = F.cross_entropy(net(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            losses.append(float(loss))
        assert all(math.isfinite(x) for x in losses), losses
        assert (net[0].weight.numpy() != before).any(), "Adam did not change the weights"
        assert float(net[1]._mean.abs().sum()) > 0, "BatchNorm's running mean did not move"

    return _run_ops(
        [
            ("elementwise", elementwise),
            ("matmul", matmul),
            ("conv2d", conv2d),
            ("lstm", lstm),
            ("ctc_loss", ctc),
            ("train_step", train_step),
        ]
    )
