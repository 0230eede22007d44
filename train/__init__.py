"""Training: config, loop, metrics, checkpoints and the per-framework backends."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _check_datasets_is_ours() -> None:
    """Fail at import, with the fix, when ``datasets`` is not this project's data layer.

    The project's framework-free data layer is the top-level package ``datasets``, the name of
    Hugging Face's library. In an environment that has that library installed, a process started
    outside the repository root finds it first (site-packages comes before the editable install's
    finder), and every import from it here would fail later with a confusing error.
    The check looks the package up without importing it, so it costs a path lookup.
    """
    ours = Path(__file__).resolve().parent.parent / "datasets" / "__init__.py"
    spec = importlib.util.find_spec("datasets")
    found = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    if found == ours:
        return
    raise ImportError(
        f"`datasets` resolves to {found or 'nothing'}, not this project's data layer ({ours}). "
        "Another package named `datasets` (Hugging Face's) comes first on sys.path. HINT: run "
        "from the repository root (python -m train ...), which puts the project first, or use "
        "an environment without Hugging Face's datasets (make setup's venvs, the images)"
    )


_check_datasets_is_ours()
