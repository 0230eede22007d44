"""Shared fixtures: tiny datasets written with the project's own writers, framework markers."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from datasets.hdf5_images import Hdf5ImageWriter
from datasets.lmdb_ocr import LmdbOcrWriter
from datasets.synthetic import (
    IMAGENET_TAG_NAMES,
    LATIN,
    imagenet_samples,
    ocr_samples,
    write_all,
)
from tests import tiers

ROOT = Path(__file__).resolve().parent.parent

# The images set these roots (docker/*.Dockerfile) and the scenario files read them as
# ${NAME:-default}. Tests expect the checkout's layout wherever they run, the images' smoke
# tests included, and tests that want the container's roots set them themselves; removed at
# import so that the subprocesses tests start see the same environment.
CONTAINER_ROOTS = ("OCR_DATA_DIR", "RESNET50_DATA_DIR", "RUNS_ROOT", "CACHE_ROOT")
for _name in CONTAINER_ROOTS:
    os.environ.pop(_name, None)

# One OpenMP thread per process, unless the caller chose: the suite's two halves already fill the
# cores side by side, each with training subprocesses and loader workers, and a second OpenMP
# thread per process only spins waiting for a core (Paddle's ResNet-18 step on a loaded 2-core
# host: 2.1 CPU-s with two threads, 0.8 s with one). Set here, before a framework is imported,
# so the tests' own processes and the trainings they start inherit it. The torch trainer sets
# its thread count itself (set_cpu_threads), so only Paddle's CPU kernels and in-process tests
# change; what the tests assert does not depend on the number of compute threads
# (docs/testing.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Skip framework tests whose framework is absent, unless TEST_FRAMEWORK says it must be
    there (make test sets it): then a missing framework stops the run instead of skipping."""
    required = os.environ.get("TEST_FRAMEWORK")
    if required and importlib.util.find_spec(required) is None:
        raise pytest.UsageError(
            f"TEST_FRAMEWORK={required} but {required} is not importable; " "run make setup"
        )
    slow = tiers.read_list()  # tests/slow_tests.txt: the measured slow tier (tests/tiers.py)
    shared = _shared_fixtures_of(item for item in items if item.nodeid in slow)
    for item in items:
        if item.nodeid in slow or shared & _module_fixtures(item):
            item.add_marker(pytest.mark.slow)
        for framework in ("torch", "paddle"):
            if item.get_closest_marker(framework) and importlib.util.find_spec(framework) is None:
                item.add_marker(pytest.mark.skip(reason=f"needs {framework}"))


def _module_fixtures(item) -> set:
    """The fixtures a test uses that its own module defines with a scope wider than the test:
    built once for the module, their time is counted in whichever test of theirs runs first."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    module = item.nodeid.split("::")[0]  # a fixture defined in a test module has it as baseid
    return {
        definition
        for definitions in info.name2fixturedefs.values()
        for definition in definitions
        if definition.scope != "function" and definition.baseid == module
    }


def _shared_fixtures_of(slow_items) -> set:
    """A slow test's module-level fixtures: each test using one of them is slow too, since the
    quick tier would build the fixture in whichever of them it runs first (the gpu_check
    dry-run's two minutes, a module's trained run)."""
    return set().union(*(_module_fixtures(item) for item in slow_items))


@pytest.fixture(scope="session")
def ocr_lmdb(tmp_path_factory) -> Path:
    """A 96-line OCR LMDB (JPEG and PNG records) and its charset.txt beside it."""
    root = tmp_path_factory.mktemp("ocr")
    write_all(LmdbOcrWriter(root / "train"), ocr_samples(96, LATIN, None, seed=1))
    (root / "charset.txt").write_text("".join(c + "\n" for c in LATIN), encoding="utf-8")
    return root / "train"


@pytest.fixture(scope="session")
def image_h5(tmp_path_factory) -> Path:
    """A 24-image, 4-class ImageNet-like HDF5 file (~95 KB JPEGs of about 500x375), with each
    image's tags (IMAGENET_TAG_NAMES) as scripts/make_synthetic.py writes them."""
    path = tmp_path_factory.mktemp("h5") / "train.h5"
    writer = Hdf5ImageWriter(path, [f"c{i}" for i in range(4)], tag_names=IMAGENET_TAG_NAMES)
    write_all(writer, imagenet_samples(24, 4, 0, with_tags=True))
    return path


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def ppocrv4_files() -> dict[str, Path]:
    """The released PP-OCRv4 recognizer (ONNX) and a CJK font, fetched once from the package
    index by scripts/fetch_ppocrv4.py into .cache/ppocrv4 (or $PPOCRV4_CACHE), sha256-checked."""
    import subprocess
    import sys

    fetch = [sys.executable, "-m", "scripts.fetch_ppocrv4"]
    done = subprocess.run(fetch, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    onnx_path, font = (Path(line) for line in done.stdout.split())
    return {"onnx": onnx_path, "font": font}
