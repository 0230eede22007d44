"""Small utilities: progress lines on stderr, --set items, JSON and log reading, JSON-safe values,
and both ends of the helpers' ``GPU-CHECK {json}`` line (``emit`` in a helper, ``marked`` in the
orchestrator). Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
import threading
import time
from pathlib import Path

from .plan import MARK

_print_lock = threading.Lock()
START = time.monotonic()


def say(message: str) -> None:
    with _print_lock:
        print(
            f"[gpu_check {time.monotonic() - START:6.1f}s] {message}", file=sys.stderr, flush=True
        )


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def marked(stdout: str) -> dict:
    """The helper's ``GPU-CHECK {json}`` line (the last one), whatever else was printed."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            with contextlib.suppress(ValueError):
                return json.loads(line[len(MARK) :])
    return {}


_ERROR_LINE = re.compile(r"^((config )?error:|[\w.]*(Error|Exception|Interrupt)\b|.*Error: )")


def error_text(log: str, limit: int = 600) -> str:
    """The line that says what went wrong: the last exception or ``error:`` line of a log."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.match(line) and not line.startswith("File "):
            return line[:limit]
    return (lines[-1] if lines else "no output")[:limit]


def tail(text: str, lines: int = 15, limit: int = 2000) -> str:
    return "\n".join(text.splitlines()[-lines:])[-limit:]


def clean(value):
    """JSON-safe: non-finite floats as strings (NaN is not JSON), other objects as text."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def rounded(value, digits: int = 4):
    if isinstance(value, float):
        return round(value, digits) if math.isfinite(value) else str(value)
    return value


def emit(payload: dict) -> None:
    """A helper's answer: one ``GPU-CHECK {json}`` line on stdout (read back by ``marked``)."""
    print(MARK + json.dumps(payload, default=str), flush=True)


def short_error(error: BaseException) -> str:
    """One line for an exception: its type and the last line of its message that names an error."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = next((x for x in reversed(lines) if "rror" in x), lines[-1] if lines else "")
    return f"{type(error).__name__}: {line}"[:600]
