"""The cached process id (datasets/process_id.py) must follow fork: a forked loader worker that
kept its parent's id would write into the parent's in-flight slot and reuse its LMDB handles."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np

from datasets.in_flight import InFlightTable
from datasets.process_id import current_pid


def _report(table: InFlightTable, queue) -> None:
    table.start(7)
    queue.put((current_pid(), os.getpid(), [tuple(map(int, row)) for row in table._table()]))


def test_current_pid_is_the_childs_after_fork(tmp_path):
    table = InFlightTable(tmp_path)
    table.start(3)  # the parent takes a slot first: the child must not write into it
    assert current_pid() == os.getpid()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_report, args=(table, queue))
    child.start()
    cached, real, rows = queue.get(timeout=30)
    child.join(30)
    assert cached == real == child.pid != os.getpid()
    busy = {pid: index for pid, index, _, state in rows if pid and index != -1}
    assert busy == {os.getpid(): 3, child.pid: 7}
    assert current_pid() == os.getpid()


def test_current_pid_after_a_bare_os_fork(tmp_path):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's test teardown
        try:
            os.write(write, np.array([current_pid(), os.getpid()], dtype=np.int64).tobytes())
        finally:
            os._exit(0)
    os.close(write)
    cached, real = np.frombuffer(os.read(read, 16), dtype=np.int64)
    os.waitpid(pid, 0)
    os.close(read)
    assert cached == real == pid
