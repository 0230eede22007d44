"""A stand-in for nvidia-ml-py's pynvml on a host without GPUs: eight H200s (driver 550, for
CUDA 12.4) whose utilization query raises NVMLError_NotSupported (as on MIG slices) and whose
used memory, in GB, is their physical index plus one, so a record tells which GPU it came from.

Tests put it in sys.modules (monkeypatch.setitem), or this folder first on PYTHONPATH for a
``python -m train`` subprocess. ``CALLS`` lists the functions called, in order.
"""

from __future__ import annotations

from types import SimpleNamespace

GPUS = 8
CALLS: list[str] = []


def uuid_of(index: int) -> str:
    return f"GPU-0000000{index}-1111-2222-3333-44444444444{index}"


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801  (pynvml's name)
    def __str__(self) -> str:
        return "Not Supported"


class NVMLError_NotFound(NVMLError):  # noqa: N801
    def __str__(self) -> str:
        return "Not Found"


class Handle(SimpleNamespace):
    index: int


def nvmlInit() -> None:  # noqa: N802  (pynvml's names)
    CALLS.append("nvmlInit")


def nvmlShutdown() -> None:  # noqa: N802
    CALLS.append("nvmlShutdown")


def nvmlSystemGetDriverVersion() -> str:  # noqa: N802
    return "550.54.15"


def nvmlSystemGetCudaDriverVersion() -> int:  # noqa: N802
    return 12040


def nvmlDeviceGetName(handle: Handle) -> str:  # noqa: N802
    return "NVIDIA H200"


def nvmlDeviceGetCudaComputeCapability(handle: Handle) -> tuple[int, int]:  # noqa: N802
    return (9, 0)


def nvmlDeviceGetCount() -> int:  # noqa: N802
    return GPUS


def nvmlDeviceGetHandleByIndex(index: int) -> Handle:  # noqa: N802
    CALLS.append(f"nvmlDeviceGetHandleByIndex({index})")
    if not 0 <= index < GPUS:
        raise NVMLError_NotFound()
    return Handle(index=index)


def nvmlDeviceGetHandleByUUID(uuid: str) -> Handle:  # noqa: N802
    for index in range(GPUS):
        if uuid_of(index) == uuid:
            return Handle(index=index)
    raise NVMLError_NotFound()


def nvmlDeviceGetUUID(handle: Handle) -> str:  # noqa: N802
    return uuid_of(handle.index)


def nvmlDeviceGetUtilizationRates(handle: Handle):  # noqa: N802
    CALLS.append("nvmlDeviceGetUtilizationRates")
    raise NVMLError_NotSupported()


def nvmlDeviceGetMemoryInfo(handle: Handle):  # noqa: N802
    CALLS.append("nvmlDeviceGetMemoryInfo")
    used = (handle.index + 1) * 10**9
    return SimpleNamespace(used=used, total=141 * 10**9, free=141 * 10**9 - used)
