"""What the command-line scripts share: the repository root, logging, one-line errors.

The scripts import the project by name (``train``, ``datasets``): they run as
``python -m scripts.NAME`` from the repository root, or from anywhere once the project is
installed (``pip install --no-deps -e .``, which make setup's venvs and the images do).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(main) -> None:
    """Call ``main()``; turn a DatasetError, a WeightsError or a write refused at a link
    (LinkRefusedError) into one line on stderr and exit code 2."""
    from datasets.errors import DatasetError
    from datasets.safe_files import LinkRefusedError
    from train.ppocrv4_weights import WeightsError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        sys.exit(main())
    except (DatasetError, WeightsError, LinkRefusedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: partial output removed", file=sys.stderr)
        sys.exit(130)
