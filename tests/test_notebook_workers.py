"""DataLoader workers started from a real Jupyter kernel (what the dev services' JupyterLab runs):
a restarted, killed or interrupted kernel must not leave its loader workers behind.

    .venv-torch/bin/python -m pytest -m "not paddle" tests/test_notebook_workers.py
    .venv-paddle/bin/python -m pytest -m "not torch" tests/test_notebook_workers.py

Each test starts an ipykernel of this interpreter through jupyter_client (the same LocalProvisioner
JupyterLab uses), builds the loader in it the way training does (backend.batches.make_loader over
the project's LMDB dataset, two workers), takes a batch and keeps the iterator in a global. What the
kernel does to its process tree:

- restart_kernel(now=True) and shutdown_kernel(now=True) SIGKILL the kernel's process group.
  Loader workers leave that group (datasets.handles.die_with_parent: launchers signal whole
  groups), so they end by PR_SET_PDEATHSIG, the same way as under the OOM killer, which kills the
  kernel alone (also tested).
- interrupt_kernel() sends SIGINT to the kernel's group, so again not to the workers: the
  iterator survives the interrupt. The cell waits in next() (the loop is data-starved), so the
  KeyboardInterrupt's traceback holds the iterator's frames, and IPython keeps that traceback
  (sys.last_traceback, InteractiveTB.tb, for %debug): `del it` alone would leave the workers
  running until the next error or a restart. So the backends stop an epoch's workers when an
  interrupt leaves next() (torch: _EpochLoader; Paddle: with_deadline closes the epoch).

Known limit (Paddle, use_shared_memory): batches that workers had put in /dev/shm and that the
killed kernel had not freed stay there as paddle_<worker pid>_* files (about 20 files, some 7
batches' bytes, here); no process is left to remove them. They are what train.preflight's sweep
removes (dead creator) once they are STALE_AFTER_S old, at the next training run; the tests
check exactly that and delete their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from datasets.handles import process_alive
from train.preflight import stale_batches

pytest.importorskip("ipykernel")
psutil = pytest.importorskip("psutil")
jupyter_client = pytest.importorskip("jupyter_client")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG, /dev/shm")

ROOT = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm")
GONE_WITHIN_S = 15.0
CELL_TIMEOUT_S = 120.0

FRAMEWORKS = [
    pytest.param("torch", marks=pytest.mark.torch),
    pytest.param("paddle", marks=pytest.mark.paddle),
]
# Where the interrupt lands when the loop waits for data: a frame of the loader's next().
WAITING_IN = {"torch": "torch/utils/data/dataloader.py", "paddle": "in with_deadline"}

# Training's recipe (train/loop.py): the backend's make_loader over the project's dataset.
SETUP_CELL = """
import faulthandler, gc, json, os, signal, time
import psutil
faulthandler.register(signal.SIGUSR1, file=open({stacks!r}, "a"), all_threads=True)  # forks too
from datasets.dataset import build_ocr_dataset
from datasets.ocr_transforms import CharDict
from datasets.sampler import EpochSampler
from train.backends import make_backend
from train.config.load import config_from_dict

config = config_from_dict({config!r})
backend = make_backend(config)
backend.runtime.init_distributed()
backend.runtime.seed_everything(config.seed, config.deterministic)
chars = CharDict.from_file(config.data.char_dict)
dataset = build_ocr_dataset(config.data.train, chars, train=True, augment=False)
if {slow_s}:  # slow storage: the loop below waits for batches, as a starved training loop does
    _transform = dataset.transform
    dataset.transform = lambda *args: (time.sleep({slow_s}), _transform(*args))[1]
sampler = EpochSampler(len(dataset), shuffle=False)
loader = backend.batches.make_loader(dataset, sampler, config.loader, train=True)
"""
START_EPOCH_CELL = """
it = iter(loader)
batch = next(it)
print("PIDS " + json.dumps([p.pid for p in psutil.Process().children(recursive=True)]))
"""
LOOP_CELL = """
print("LOOPING", flush=True)
for batch in it:
    pass
"""


def setup_cell(framework: str, lmdb: Path, slow_s: float, stacks: Path) -> str:
    config = {
        "task": "ocr",
        "framework": framework,
        "data": {"train": str(lmdb), "char_dict": str(lmdb.parent / "charset.txt")},
        # A worker silent this long fails the cell with the loader's own error, well before
        # the test gives up on the cell (CELL_TIMEOUT_S).
        "loader": {"batch_size": 4, "num_workers": 2, "timeout_s": 45},
        "model": {"name": "crnn_tiny", "hidden_size": 64},
        "train": {"device": "cpu"},
    }
    return SETUP_CELL.format(config=config, slow_s=slow_s, stacks=str(stacks))


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # IPython colors its tracebacks


class Kernel:
    """A python3 kernel of this interpreter (so of this venv), started in the checkout."""

    def __init__(self, tmp: Path) -> None:
        spec_dir = tmp / "kernels" / "venv"
        spec_dir.mkdir(parents=True)
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "venv",
            "language": "python",
            "interrupt_mode": "signal",  # JupyterLab's default for ipykernel
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        specs = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)], ensure_native_kernel=False)
        self.km = KernelManager(kernel_name="venv", kernel_spec_manager=specs)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("DATA_INJECT_FAULT", None)
        self.km.start_kernel(cwd=str(ROOT), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.workers: list[int] = []  # every loader worker it started
        self.stacks_file = tmp / "stacks.txt"  # where SIGUSR1 makes them write their stacks

    def stacks(self) -> str:
        """Where the kernel and its children wait: each one's Python stacks (SIGUSR1, set up by
        the setup cell) and each thread's kernel wait channel, for a cell that never ends."""
        lines = []
        try:
            family = [psutil.Process(self.pid)]
            family += family[0].children(recursive=True)
        except psutil.Error as error:
            return f"(no process to inspect: {error})"
        for process in family:
            with contextlib.suppress(psutil.Error, OSError):
                channels = [
                    Path(f"/proc/{process.pid}/task/{t.id}/wchan").read_text()
                    for t in process.threads()
                ]
                lines.append(f"pid {process.pid} {process.status()} waits in {channels}")
                process.send_signal(signal.SIGUSR1)
        time.sleep(2.0)
        if self.stacks_file.exists():
            lines.append(self.stacks_file.read_text())
        return "\n".join(lines)

    @property
    def pid(self) -> int:
        return self.km.provisioner.pid

    def send(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, timeout: float = CELL_TIMEOUT_S, until=None) -> dict:
        """Output of cell ``msg_id`` until the kernel goes idle, or until ``until(text)``:
        {"text": stdout, stderr and traceback, "error": the exception's name or None}."""
        text: list[str] = []
        error = None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no end of cell in {timeout} s; output: {''.join(text)}\n{self.stacks()}"
                )
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text.append(content["text"])
            elif kind == "error":
                error = content["ename"]
                text.append(plain("\n".join(content["traceback"])))
            elif kind == "status" and content["execution_state"] == "idle":
                return {"text": "".join(text), "error": error}
            if until is not None and until("".join(text)):
                return {"text": "".join(text), "error": error}

    def run(self, code: str) -> str:
        out = self.collect(self.send(code))
        assert out["error"] is None, out["text"] + "\n" + self.stacks()
        return out["text"]

    def start_epoch(self) -> list[int]:
        """iter(loader), one batch; the loader's worker pids (the kernel's only children)."""
        text = self.run(START_EPOCH_CELL)
        workers = json.loads(re.search(r"^PIDS (.*)$", text, re.M).group(1))
        assert len(workers) == 2, text
        self.workers += workers
        return workers

    def close(self) -> None:
        """Shut down as a user would (a kernel SIGKILLed here would leave Paddle batch files of
        its last batch), then remove any its workers left all the same."""
        if self.km.has_kernel:
            self.km.shutdown_kernel()
        self.kc.stop_channels()
        still_alive(self.workers)
        remove_batch_files(self.workers)


@pytest.fixture
def notebook(request, tmp_path, ocr_lmdb):
    """A kernel with the loader built (not yet iterated); ``request.param`` is the sample delay."""
    framework, slow_s = request.param
    kernel = Kernel(tmp_path)
    try:
        kernel.run(setup_cell(framework, ocr_lmdb, slow_s, kernel.stacks_file))
        yield framework, kernel
    finally:
        kernel.close()


def notebooks(slow_s: float = 0.0) -> list:
    return [pytest.param((p.values[0], slow_s), marks=p.marks, id=p.values[0]) for p in FRAMEWORKS]


def still_alive(pids: list[int], within: float = GONE_WITHIN_S) -> list[int]:
    """The pids still running (zombies count as gone) after up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = [pid for pid in pids if process_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def remove_batch_files(pids: list[int]) -> None:
    """Delete the Paddle batch files of these (dead) workers."""
    for pid in pids:
        for path in SHM.glob(f"paddle_{pid}_*"):
            if not process_alive(pid):
                path.unlink(missing_ok=True)


def shm_names() -> set[str]:
    return {entry.name for entry in os.scandir(SHM)} if SHM.is_dir() else set()


def check_shm_left(framework: str, before: set[str], pids: list[int]) -> None:
    """No /dev/shm entry named after these (dead) processes is left, except Paddle's batch files
    (module docstring), which must be ones the trainer's sweep removes; those are deleted here."""
    tokens = tuple(f"_{pid}_" for pid in pids)
    left = sorted(name for name in shm_names() - before if any(t in name for t in tokens))
    if framework == "paddle":
        swept = {path.name for path in stale_batches(str(SHM), older_than_s=0).paths}
        assert set(left) <= swept, f"not removable by the sweep: {set(left) - swept}"
        remove_batch_files(pids)
        left = []
    assert left == [], f"/dev/shm entries of the dead kernel or its workers: {left}"


@pytest.mark.parametrize("notebook", notebooks(), indirect=True)
def test_restarted_kernel_leaves_no_worker(notebook):
    framework, kernel = notebook
    before, kernel_pid = shm_names(), kernel.pid
    workers = kernel.start_epoch()

    kernel.km.restart_kernel(now=True)  # JupyterLab's "Restart Kernel"

    assert still_alive(workers) == [], "workers outlived the restarted kernel"
    assert not process_alive(kernel_pid)
    check_shm_left(framework, before, [kernel_pid, *workers])
    kernel.kc.wait_for_ready(timeout=60)
    assert kernel.run("print(6 * 7)").strip() == "42"  # the new kernel works


@pytest.mark.parametrize("how", ["shutdown", "oom_kill"])
@pytest.mark.parametrize("notebook", notebooks(), indirect=True)
def test_killed_kernel_leaves_no_worker(notebook, how):
    """shutdown: shutdown_kernel(now=True), SIGKILL to the kernel's process group (JupyterLab's
    "Shut Down Kernel" when the kernel does not answer). oom_kill: SIGKILL to the kernel alone."""
    framework, kernel = notebook
    before, kernel_pid = shm_names(), kernel.pid
    workers = kernel.start_epoch()

    if how == "shutdown":
        kernel.km.shutdown_kernel(now=True)
    else:
        os.kill(kernel_pid, signal.SIGKILL)

    assert still_alive(workers) == [], "workers outlived the killed kernel"
    assert still_alive([kernel_pid]) == []
    check_shm_left(framework, before, [kernel_pid, *workers])


@pytest.mark.parametrize("notebook", notebooks(slow_s=0.2), indirect=True)
def test_interrupted_loop_keeps_the_kernel_and_del_ends_the_workers(notebook):
    framework, kernel = notebook
    before, kernel_pid = shm_names(), kernel.pid
    workers = kernel.start_epoch()

    cell = kernel.send(LOOP_CELL)
    kernel.collect(cell, until=lambda text: "LOOPING" in text)
    time.sleep(1.5)  # a few batches in
    kernel.km.interrupt_kernel()  # JupyterLab's "Interrupt Kernel"
    out = kernel.collect(cell, timeout=60)

    assert out["error"] == "KeyboardInterrupt", out["text"]
    assert WAITING_IN[framework] in out["text"], "the interrupt missed the loader"
    assert kernel.run("print(os.getpid())").strip() == str(kernel_pid)  # same kernel, alive
    kernel.run("del it; gc.collect()")
    assert still_alive(workers) == [], "workers outlived `del it` after an interrupt"
    check_shm_left(framework, before, workers)

    # The notebook goes on: a new epoch starts new workers, and `del` ends them too.
    again = kernel.start_epoch()
    assert not set(again) & set(workers)
    kernel.run("del it; gc.collect()")
    assert still_alive(again) == [], "workers outlived `del it`"
