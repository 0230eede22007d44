"""Run the project's command-line entry points one after another in one interpreter, as
``python -m MODULE ARGS...`` runs each: ``main(ARGS)`` of the module, its return value or
SystemExit as the exit code, an exception as exit 1 with its traceback on stderr.

A test that checks what several commands print (train.export, then train.predict and
train.evaluate on the export) pays the framework's import once instead of once per command:
about 3 CPU-s for torch with torchvision, 2 for Paddle. What differs from separate processes is
that the commands share one interpreter (imported modules, the logging set-up each command
redoes, the framework's thread settings). The commands themselves still start as python -m
does elsewhere in the suite (tests/test_new_task_kind.py runs each as its own process).

Protocol, one JSON object per line: a request ``{"module": "train.predict", "args": [...]}``
on stdin, the reply ``{"returncode": int, "stdout": str, "stderr": str}`` on the stdout the
session started with. Output the commands write to file descriptor 1 below Python (a
framework's C++ logging) goes to stderr, so it cannot break a reply.

  python tests/probes/cli_session.py   # used by tests/test_after_training.py
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def run(module: str, args: list[str]) -> dict:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = importlib.import_module(module).main(args)
        except SystemExit as exit_:  # argparse's errors, or a command that exits
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if exit_.code is not None and not isinstance(exit_.code, int):
                print(exit_.code, file=sys.stderr)
        except Exception:  # what python -m does with an uncaught exception
            traceback.print_exc()
            code = 1
    return {"returncode": code or 0, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # fd 1 is the commands' now, and it goes to stderr
    sys.stdout = os.fdopen(1, "w", encoding="utf-8", closefd=False)
    for line in sys.stdin:
        request = json.loads(line)
        replies.write(json.dumps(run(request["module"], request["args"])) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
