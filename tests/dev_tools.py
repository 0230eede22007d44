"""Packages that only the development venvs have, for the tests that need them.

`make setup` installs requirements/dev.txt (the S3 test server, linters, schema checkers) into
.venv-torch and .venv-paddle, and there a test that needs one of them must run: a missing one is
an import error, not a skip. A borrowed GPU host's stack (`make test-compat`, TEST_COMPAT=1) has
none of them, nor requirements/remote.txt's s3fs, so there such a test skips and says what it
lacks.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

COMPAT = os.environ.get("TEST_COMPAT") == "1"


def require(module: str, requirements: str = "requirements/dev.txt") -> ModuleType:
    """``module`` imported; under TEST_COMPAT=1, where it is absent, the calling test skips."""
    if COMPAT:
        reason = f"needs {module} ({requirements}), which a GPU host's stack lacks"
        return pytest.importorskip(module, reason=reason)
    return importlib.import_module(module)
